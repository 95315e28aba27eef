"""``HFCausalLM``: continued pretraining of a local Hugging Face decoder that grows mid-fit.

The module loads ``pretrained`` (a local model directory; nothing downloads) with
``AutoModelForCausalLM.from_pretrained(..., local_files_only=True)``, wraps it with
``growtrain.hf.growable`` and trains next-token cross-entropy on ``(x, y)`` token batches
(``TextDataModule``, ``HFTextDataModule`` or any loader of equal-length sequences).
Everything growth needs comes from the shared mixins, as for ``growtrain.lm.LanguageModel``:

* ``probe_loss`` (token-mean cross-entropy) is what ``GrowUntilSaturated`` scores with;
* optimizer groups are ``growtrain.optim.param_groups`` (base, then one group per growth), so
  a layer inserted mid-fit joins the running optimizer with zero state
  (``growtrain.reconfigure``) and a resumed run's optimizer lines up;
* checkpoints carry the growth record; ``load_from_checkpoint`` / ``fit(ckpt_path=...)``
  reload ``pretrained`` at its original depth, replay the insertions, then load the weights.

``save_pretrained(dir)`` writes the grown model as a plain Hugging Face checkpoint.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn

from growtrain.fsdp import ShardedBlocksMixin
from growtrain.hf.adapter import growable
from growtrain.lm import TokenStepsMixin, gpt2_adamw, token_cross_entropy
from growtrain.module import ConfiguredOptimizerMixin, GrowableModuleMixin, SharedStepsMixin

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_local(path: str, dtype: Optional[str] = None, attn_implementation: Optional[str] = None) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, local_files_only=True)`` with clear errors."""
    root = Path(path).expanduser()
    if not (root / "config.json").is_file():
        raise FileNotFoundError(
            f"pretrained: {str(path)!r} is not a local Hugging Face model directory (no config.json there). "
            "growtrain loads models from disk only and never downloads; fetch one yourself first, e.g. "
            f"`hf download EleutherAI/pythia-160m --local-dir {path}`, or write a tiny random one with "
            f"`python -m growtrain.hf.tiny --arch llama --out {path}`."
        )
    if dtype is not None and dtype not in _DTYPES:
        raise ValueError(f"dtype: expected one of {sorted(_DTYPES)} or None (the checkpoint's), got {dtype!r}")
    from transformers import AutoModelForCausalLM

    kwargs = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = _DTYPES[dtype]
    if attn_implementation is not None:
        kwargs["attn_implementation"] = attn_implementation
    return AutoModelForCausalLM.from_pretrained(str(root), **kwargs)


class HFCausalLM(TokenStepsMixin, GrowableModuleMixin, ShardedBlocksMixin, ConfiguredOptimizerMixin, SharedStepsMixin, LightningModule):
    """Causal LM around a growable Hugging Face decoder.

    Args:
        pretrained: a local model directory (``config.json`` + weights), e.g. a downloaded
            Pythia checkpoint or one written by ``python -m growtrain.hf.tiny``.
        model: a ready ``transformers`` causal LM (or ``growable(...)`` of one) instead of
            ``pretrained``; not saved in the hyper-parameters (pass it again to
            ``load_from_checkpoint(path, model=...)``, at its original depth).
        dtype: load the weights as ``float32``/``bfloat16``/``float16``; None keeps the
            checkpoint's. For mixed precision keep float32 weights and set the trainer's precision.
        attn_implementation: ``"sdpa"`` (default), ``"eager"``, …, passed to ``from_pretrained``.
        allow_frozen: grow a model whose weights are all frozen (see ``growtrain.hf.growable``).
        optimizer, lr_scheduler, scheduler_interval, no_decay: as for ``growtrain.lm.LanguageModel``
            (default optimizer: the paper's AdamW, lr 2.5e-4, no decay on biases/norms/embeddings).

    Logs per epoch ``train/val/test_loss`` and ``_ppl`` like ``LanguageModel``.
    """

    growable_attr = "network"

    def __init__(
        self,
        pretrained: Optional[str] = None,
        *,
        model: Optional[nn.Module] = None,
        dtype: Optional[Literal["float32", "bfloat16", "float16"]] = None,
        attn_implementation: Optional[str] = None,
        allow_frozen: bool = False,
        optimizer: Optional[OptimizerCallable] = None,
        lr_scheduler: Optional[LRSchedulerCallable] = None,
        scheduler_interval: Literal["epoch", "step"] = "step",
        no_decay: Literal["none", "gpt"] = "gpt",
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["model"])
        self._set_optimization(optimizer, lr_scheduler, scheduler_interval, no_decay, gpt2_adamw)
        if (pretrained is None) == (model is None):
            raise ValueError(
                "pretrained/model: give exactly one: pretrained='/path/to/local/model_dir' or model=<a transformers "
                f"causal LM>; got pretrained={pretrained!r} and model={type(model).__name__ if model is not None else None}"
            )
        if model is None:
            model = load_local(pretrained, dtype, attn_implementation)
        # from_pretrained returns eval mode; Lightning keeps a module's modes, so train like a fresh module
        self.network = growable(model.train(), allow_frozen=allow_frozen)
        self._init_token_metrics()  # token-weighted loss and perplexity (growtrain.lm.TokenStepsMixin)

    probe_loss = staticmethod(token_cross_entropy)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.network(idx)  # (B, T, vocab)

    def setup(self, stage: str) -> None:
        # A token id ≥ the model's vocabulary would index past the embedding: fail before training.
        data_vocab = getattr(getattr(self.trainer, "datamodule", None), "vocab_size", None)
        model_vocab = self.network.config.vocab_size
        if data_vocab is not None and data_vocab > model_vocab:
            raise ValueError(
                f"vocab_size: the datamodule's tokenizer has {data_vocab} tokens but the model's embedding has "
                f"{model_vocab}; tokenize with the model's own tokenizer (HFTextDataModule tokenizer=<model dir>)"
            )

    def save_pretrained(self, path: str, **kwargs) -> None:
        """Write the (grown) model as a plain Hugging Face checkpoint directory.

        Under FSDP2 (``ModelParallelStrategy``) call it on every rank: the whole state dict is
        gathered (a collective) and rank 0 writes it; the other ranks write nothing."""
        from growtrain.fsdp import full_state_dict, is_sharded

        if is_sharded(self.network):
            state = full_state_dict(self.network)  # rank 0 gets it (on CPU), the others {}
            if not state:
                return
            prefix = "model."  # HFGrowable keeps the transformers model as .model
            kwargs.setdefault("state_dict", {k[len(prefix):]: v for k, v in state.items() if k.startswith(prefix)})
        self.network.save_pretrained(path, **kwargs)
