"""The language-model LightningModule: next-token cross-entropy around a growable GPT.

The paper's GPT-2 recipe (Appendix B.4, Table 6) is the default optimizer: AdamW with
β = (0.9, 0.95) and weight decay 0.1, not applied to biases, LayerNorm gains or embeddings
(``growtrain.optim.param_groups(..., no_decay="gpt")``). The rest of the recipe lives in the
Trainer/config: gradient clipping 1.0 (``trainer.gradient_clip_val``), a 1% linear warmup then
cosine decay to 10% of the peak (``growtrain.optim.WarmupCosine``, stepped per optimizer step),
bf16 (``trainer.precision: bf16-mixed``). See ``configs/paper/gpt2_small.yaml``.

Growth: ``LanguageModel.probe_loss`` is the loss ``measure_saturation`` needs (token-mean
cross-entropy, i.e. the mean over equal-length sequences of each sequence's token-mean loss);
checkpoints carry the growth record (``GrowableModuleMixin``), so ``load_from_checkpoint`` and
``trainer.fit(ckpt_path=...)`` rebuild the grown depth before loading the weights.
"""

from __future__ import annotations

from typing import Iterable, Literal, Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.nn import functional as F

from growtrain.fsdp import ShardedBlocksMixin
from growtrain.models.gpt import GPT, GPTConfig
from growtrain.module import ConfiguredOptimizerMixin, GrowableModuleMixin, SharedStepsMixin, WeightedMean

__all__ = ["ExpMean", "LanguageModel", "gpt2_adamw", "token_cross_entropy"]


def gpt2_adamw(params: Iterable) -> torch.optim.AdamW:
    """The paper's GPT-2 optimizer (Table 6): AdamW, lr 2.5e-4, β = (0.9, 0.95), weight decay 0.1.

    Groups that set their own ``weight_decay`` (the ``no_decay`` groups: 0) keep it.
    """
    return torch.optim.AdamW(params, lr=2.5e-4, betas=(0.9, 0.95), weight_decay=0.1)


class ExpMean(WeightedMean):
    """``exp`` of a weighted mean: perplexity from token-mean losses weighted by token counts.

    ``exp(Σ_b n_b L_b / Σ_b n_b)`` with ``L_b`` a batch's token-mean cross-entropy and ``n_b``
    its token count is ``exp`` of the mean per-token negative log-likelihood: what
    ``torchmetrics.text.Perplexity`` computes, without its per-step softmax over the whole
    ``(B, T, vocab)`` logits and its boolean-mask indexing (a host sync on a GPU each step).
    """

    def compute(self) -> torch.Tensor:
        return super().compute().exp()


def token_cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy: logits ``(B, T, V)``, target ``(B, T)`` → scalar.

    With equal-length sequences this is the mean over sequences of each sequence's token-mean
    loss, so a "sample" of the growth certificate is one sequence.
    """
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)).float(), target.reshape(-1))


class TokenStepsMixin:
    """Token-weighted epoch loss and perplexity for causal LMs (``LanguageModel``, ``HFCausalLM``).

    Call ``_init_token_metrics()`` in ``__init__``; ``_shared_step`` serves training, validation
    and test. No step waits for the device: metrics accumulate there and are read once per epoch.
    """

    def _init_token_metrics(self) -> None:
        self.metrics = nn.ModuleDict()
        for stage in ("train", "val", "test"):
            # WeightedMean, not torchmetrics' MeanMetric: no host read per step (see WeightedMean).
            self.metrics[f"{stage}_loss"] = WeightedMean()
            self.metrics[f"{stage}_ppl"] = ExpMean()

    def _shared_step(self, batch: Sequence[torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch  # (B, T), (B, T)
        loss = token_cross_entropy(self(x), y)  # logits (B, T, vocab)
        # Weights made on the device (full_like): a Python number would be copied there each step.
        tokens = torch.full_like(loss.detach(), y.numel(), dtype=torch.float32)
        self.metrics[f"{stage}_loss"].update(loss.detach(), weight=tokens)
        self.metrics[f"{stage}_ppl"].update(loss.detach(), weight=tokens)
        self.log(f"{stage}_loss", self.metrics[f"{stage}_loss"], on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}_ppl", self.metrics[f"{stage}_ppl"], on_step=False, on_epoch=True)
        return loss


class LanguageModel(TokenStepsMixin, GrowableModuleMixin, ShardedBlocksMixin, ConfiguredOptimizerMixin, SharedStepsMixin, LightningModule):
    """Causal language model around a growable decoder.

    Args:
        network: a ready network mapping ``(B, T)`` token ids to ``(B, T, vocab)`` logits;
            ``None`` builds ``growtrain.models.gpt`` from the arguments below. A given network
            is not saved in the hyper-parameters: pass it again to
            ``load_from_checkpoint(path, network=...)``.
        n_layer, d_model, n_head, block_size, vocab_size, dropout, bias: the GPT
            (``vocab_size`` must match the datamodule's; a CLI links it).
        optimizer: called with the named param groups each time ``configure_optimizers`` runs;
            ``None`` = ``gpt2_adamw`` (the paper's AdamW).
        lr_scheduler: called with the optimizer, e.g. ``growtrain.optim.WarmupCosine``.
        scheduler_interval: step the scheduler every optimizer ``"step"`` (WarmupCosine) or
            every ``"epoch"``.
        no_decay: ``"gpt"`` exempts biases, norms and embeddings from weight decay (the
            paper); ``"none"`` decays everything.

    Logs per epoch: ``train_loss``, ``train_ppl``, ``val_loss``, ``val_ppl``, ``test_loss``,
    ``test_ppl`` (token-weighted; ppl = exp of the epoch's mean token loss, ``ExpMean``);
    ``loss`` in the progress bar (a step's loss, refreshed every ``log_every_n_steps`` steps).
    No step waits for the device: metrics accumulate on it and are read once per epoch.
    """

    growable_attr = "network"

    def __init__(
        self,
        network: nn.Module | None = None,
        *,
        n_layer: int = 4,
        d_model: int = 128,
        n_head: int = 4,
        block_size: int = 128,
        vocab_size: int = 256,
        dropout: float = 0.0,
        bias: bool = True,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        scheduler_interval: Literal["epoch", "step"] = "step",
        no_decay: Literal["none", "gpt"] = "gpt",
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["network"])
        self._set_optimization(optimizer, lr_scheduler, scheduler_interval, no_decay, gpt2_adamw)
        if network is None:
            network = GPT(GPTConfig(n_layer, d_model, n_head, block_size, vocab_size, dropout, bias))
        self.network = network
        self._init_token_metrics()

    # The growth callback finds the probe loss here (ImageClassifier has the same method).
    probe_loss = staticmethod(token_cross_entropy)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.network(idx)  # (B, T, vocab)

    def setup(self, stage: str) -> None:
        # A token id ≥ vocab_size would index past the embedding: fail before training, with the fix.
        data_vocab = getattr(getattr(self.trainer, "datamodule", None), "vocab_size", None)
        model_vocab = self.network.config.vocab_size if hasattr(self.network, "config") else None
        if data_vocab is not None and model_vocab is not None and data_vocab > model_vocab:
            raise ValueError(
                f"vocab_size: the datamodule's tokenizer has {data_vocab} tokens but the model's embedding has "
                f"{model_vocab}; set model vocab_size to {data_vocab} (or use tokenizer: byte, 256 tokens)"
            )
