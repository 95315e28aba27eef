"""A GPT-2-style decoder (nanoGPT layout and names) that grows one zero-output block at a time.

``wte`` + ``wpe`` → ``h`` (a ``nn.ModuleList`` of pre-LayerNorm ``Block`` s, see
``growtrain.families.gpt``) → ``ln_f`` → ``lm_head`` (tied to ``wte``). Causal attention uses
``F.scaled_dot_product_attention(is_causal=True)``; linear layers keep their biases by default
(as in the paper's Appendix B.4 runs); weights are initialised with std 0.02, the initial
blocks' ``c_proj`` weights with GPT-2's ``0.02/sqrt(2·n_layer)``.

Candidate sites are ``h.0 … h.L``: before the first block, between blocks, after the last
(every position fits, a decoder block never changes the shape). A grown block is a fresh
``Block`` with both ``c_proj`` s zeroed, so the network's output is unchanged.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from torch import nn
from torch.nn import functional as F

from growtrain.families.gpt import INIT_STD, Block, scaled_proj_std
from growtrain.growable import GrowableMixin

__all__ = ["GPTConfig", "GPT", "gpt"]


@dataclass
class GPTConfig:
    n_layer: int = 4  # decoder blocks at construction, ≥ 1 (growth adds more)
    d_model: int = 128  # residual width C (GPT-2's n_embd)
    n_head: int = 4  # attention heads; must divide d_model
    block_size: int = 128  # longest context in tokens (the size of wpe)
    vocab_size: int = 256  # tokens (256 = bytes)
    dropout: float = 0.0  # attention, residual and embedding dropout (paper: 0.1)
    bias: bool = True  # biases in linear layers and LayerNorms (paper: retained)

    def __post_init__(self):
        # n_layer ≥ 1: the probe reads site activations through hooks on the stage's blocks.
        for name, lo in (("n_layer", 1), ("d_model", 1), ("n_head", 1), ("block_size", 1), ("vocab_size", 1)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < lo:
                raise ValueError(f"{name}: expected an integer ≥ {lo}, got {value!r}")
        if self.d_model % self.n_head != 0:
            raise ValueError(
                f"n_head: must divide d_model (head size = d_model / n_head); got d_model={self.d_model}, "
                f"n_head={self.n_head}"
            )
        if not 0.0 <= float(self.dropout) < 1.0:
            raise ValueError(f"dropout: expected a probability in [0, 1), got {self.dropout!r}")


class GPT(GrowableMixin, nn.Module):
    growable_stages = ("h",)

    def __init__(self, config: GPTConfig | None = None, **kwargs):
        super().__init__()
        if config is None:
            config = GPTConfig(**kwargs)
        elif kwargs:
            raise TypeError(f"GPT: pass either a GPTConfig or keyword arguments, not both (got {sorted(kwargs)})")
        self.config = config
        c = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(c.vocab_size, c.d_model),
                wpe=nn.Embedding(c.block_size, c.d_model),
                drop=nn.Dropout(c.dropout),
                h=nn.ModuleList(
                    [Block(c.d_model, c.n_head, c.dropout, c.bias, scaled_proj_std(c.n_layer)) for _ in range(c.n_layer)]
                ),
                ln_f=nn.LayerNorm(c.d_model, bias=c.bias),
            )
        )
        self.lm_head = nn.Linear(c.d_model, c.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying (GPT-2)
        nn.init.normal_(self.transformer.wte.weight, mean=0.0, std=INIT_STD)
        nn.init.normal_(self.transformer.wpe.weight, mean=0.0, std=INIT_STD)
        self._init_growth()

    # -- growth protocol -----------------------------------------------------------------
    def stage(self, name: str) -> nn.ModuleList:
        if name != "h":
            raise ValueError(f"stage: a GPT has one growable stage, 'h'; got {name!r}")
        return self.transformer.h

    def first_site(self, stage: str) -> int:
        return 0  # a decoder block keeps the shape, so even "before the first block" fits

    def make_block(self, stage: str) -> nn.Module:
        c = self.config
        block = Block(c.d_model, c.n_head, c.dropout, c.bias)
        block.zero_init_last()
        return block

    # -- forward -------------------------------------------------------------------------
    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        """Token ids ``(B, T)`` → next-token logits ``(B, T, vocab_size)``."""
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(
                f"idx: sequence length {T} exceeds block_size {self.config.block_size} (the positional table); "
                "crop the context or build the model with a larger block_size"
            )
        pos = torch.arange(T, dtype=torch.long, device=idx.device)  # (T,)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (B, T, C)
        for block in self.transformer.h:
            x = block(x)  # (B, T, C)
        x = self.transformer.ln_f(x)  # (B, T, C)
        return self.lm_head(x)  # (B, T, vocab_size)

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameter count; without the position table by default (nanoGPT's convention; the
        token table is shared with ``lm_head`` so it counts once either way)."""
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 1.0, top_k: int | None = None):
        """Sample ``max_new_tokens`` continuations of ``idx (B, T)``; returns ``(B, T + max_new_tokens)``."""
        for _ in range(max_new_tokens):
            ctx = idx[:, -self.config.block_size :]  # (B, ≤ block_size)
            logits = self(ctx)[:, -1, :] / temperature  # (B, vocab_size)
            if top_k is not None:
                v, _ = torch.topk(logits, min(top_k, logits.size(-1)))
                logits[logits < v[:, [-1]]] = -float("inf")
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, num_samples=1)], dim=1)
        return idx

    def extra_repr(self) -> str:
        return ", ".join(f"{k}={v}" for k, v in asdict(self.config).items())


def gpt(
    n_layer: int = 4,
    d_model: int = 128,
    n_head: int = 4,
    block_size: int = 128,
    vocab_size: int = 256,
    dropout: float = 0.0,
    bias: bool = True,
) -> GPT:
    """A GPT-2-style decoder; ``gpt(12, 768, 12, 1024, ...)`` has GPT-2 small's dimensions."""
    return GPT(GPTConfig(n_layer, d_model, n_head, block_size, vocab_size, dropout, bias))
