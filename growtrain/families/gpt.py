"""Pre-LayerNorm GPT-2 decoder block: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``.

Names follow GPT-2/nanoGPT (``c_attn``, ``c_fc``, ``c_proj``, ``ln_1``, ``ln_2``) so that
checkpoints and parameter-name rules (``growtrain.optim.gpt_no_decay``) carry over.

Zero-output form. ``zero_init_last()`` zeros **both** output projections, ``attn.c_proj``
and ``mlp.c_proj`` (weights and biases). With both zero the attention branch adds nothing,
so the MLP sees ``ln_2(z)`` of the unchanged ``z`` and the block is ``z + h(z)`` with

    h(z) = W_a φ_a(z) + b_a + W_m φ_m(z) + b_m = V [φ_a, 1, φ_m, 1]ᵀ   (per token)

``φ_a`` = the attention's concatenated head outputs before ``c_proj`` on ``ln_1(z)`` and
``φ_m = gelu(c_fc(ln_2(z)))``. One linear map ``V = [W_a, b_a, W_m, b_m]`` (shape
``(d, d + 1 + 4d + 1)``) of per-token features, so the probe uses the dense fast path
(``DenseFeatures``, ``Ĝ = I ⊗ A``). The two ones columns are identical, so ``A`` is singular;
``V_S`` uses a pseudo-inverse and is unaffected (it is invariant to that redundancy).

The second-order coupling (the MLP seeing the attention branch's output) vanishes at
``V = 0``: ``∂h/∂W_a`` through the MLP carries a factor ``W_m = 0``.
"""

from __future__ import annotations

import math

import torch
from torch import nn
from torch.nn import functional as F

from growtrain.families.base import DenseFeatures

__all__ = ["CausalSelfAttention", "MLP", "Block", "INIT_STD", "scaled_proj_std"]

INIT_STD = 0.02  # GPT-2's initialisation standard deviation for linear and embedding weights


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_head: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        if d_model % n_head != 0:
            raise ValueError(f"n_head: must divide d_model; got d_model={d_model}, n_head={n_head}")
        self.n_head = n_head
        self.d_model = d_model
        self.dropout = dropout
        self.c_attn = nn.Linear(d_model, 3 * d_model, bias=bias)  # q, k, v for all heads at once
        self.c_proj = nn.Linear(d_model, d_model, bias=bias)
        self.resid_dropout = nn.Dropout(dropout)

    def heads(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenated head outputs before ``c_proj``: ``(B, T, C)`` → ``(B, T, C)``."""
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.d_model, dim=2)  # 3 × (B, T, C)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)  # (B, nh, T, hs)
        return y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C): heads side by side

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.resid_dropout(self.c_proj(self.heads(x)))


class MLP(nn.Module):
    def __init__(self, d_model: int, dropout: float = 0.0, bias: bool = True):
        super().__init__()
        self.c_fc = nn.Linear(d_model, 4 * d_model, bias=bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * d_model, d_model, bias=bias)
        self.dropout = nn.Dropout(dropout)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        """``gelu(c_fc(x))``: ``(B, T, C)`` → ``(B, T, 4C)``."""
        return self.gelu(self.c_fc(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.hidden(x)))


class Block(nn.Module):
    """One GPT-2 decoder block, initialised like GPT-2 (normal(0, 0.02), zero biases).

    ``proj_std`` is the init std of both ``c_proj`` weights (GPT-2 scales it by
    ``1/sqrt(2·n_layer)``; the model passes that for its initial blocks). A grown block is
    built the same way and then ``zero_init_last()``-ed.
    """

    def __init__(
        self,
        d_model: int,
        n_head: int,
        dropout: float = 0.0,
        bias: bool = True,
        proj_std: float = INIT_STD,
    ):
        super().__init__()
        self.ln_1 = nn.LayerNorm(d_model, bias=bias)
        self.attn = CausalSelfAttention(d_model, n_head, dropout, bias)
        self.ln_2 = nn.LayerNorm(d_model, bias=bias)
        self.mlp = MLP(d_model, dropout, bias)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, mean=0.0, std=INIT_STD)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
        for proj in (self.attn.c_proj, self.mlp.c_proj):
            nn.init.normal_(proj.weight, mean=0.0, std=proj_std)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))  # (B, T, C)
        x = x + self.mlp(self.ln_2(x))  # (B, T, C)
        return x

    # -- growth protocol -----------------------------------------------------------------
    def zero_init_last(self) -> None:
        """Zero both output projections (weights and biases): the block becomes the identity."""
        with torch.no_grad():
            for p in self.terminal_parameters():
                p.zero_()

    def terminal_parameters(self) -> list[nn.Parameter]:
        """``V``: ``[attn.c_proj.weight, attn.c_proj.bias, mlp.c_proj.weight, mlp.c_proj.bias]``
        (the biases only when the block has them)."""
        out = []
        for proj in (self.attn.c_proj, self.mlp.c_proj):
            out.append(proj.weight)
            if proj.bias is not None:
                out.append(proj.bias)
        return out

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """Per-token features ``[φ_a, 1, φ_m, 1]`` at ``V = 0``: ``(B, T, C)`` → ``(B, T, K)``.

        ``K = C + 1 + 4C + 1`` with biases, ``5C`` without. Meaningful only at ``V = 0`` (the
        MLP sees ``ln_2(z)``, i.e. the attention branch adds nothing).
        """
        phi_a = self.attn.heads(self.ln_1(z))  # (B, T, C)
        phi_m = self.mlp.hidden(self.ln_2(z))  # (B, T, 4C)
        if self.attn.c_proj.bias is None:
            return torch.cat([phi_a, phi_m], dim=-1)  # (B, T, 5C)
        ones = z.new_ones(z.shape[:-1] + (1,))  # (B, T, 1)
        return torch.cat([phi_a, ones, phi_m, ones], dim=-1)  # (B, T, 5C + 2)

    def probe_features(self, z: torch.Tensor) -> DenseFeatures:
        return DenseFeatures(self.features(z), bias=False)

    def split_terminal(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """``(C, K)`` cross-gradient matrix → tensors shaped like ``terminal_parameters()``."""
        C = self.attn.c_proj.weight.shape[0]
        bias = self.attn.c_proj.bias is not None
        widths = [C, 1, 4 * C, 1] if bias else [C, 4 * C]
        if matrix.shape[-1] != sum(widths):
            raise ValueError(f"matrix: expected {sum(widths)} columns (the features of this block), got {tuple(matrix.shape)}")
        parts = matrix.split(widths, dim=-1)
        if bias:
            return [parts[0], parts[1].squeeze(-1), parts[2], parts[3].squeeze(-1)]
        return list(parts)


def scaled_proj_std(n_layer: int) -> float:
    """GPT-2's residual-projection init std, ``0.02 / sqrt(2·n_layer)``."""
    return INIT_STD / math.sqrt(2 * int(n_layer))
