"""A user's own residual block, made growable by naming its terminal parameters.

``ResidualAdapter(block, ("fc2.weight", "fc2.bias"))`` computes exactly ``block(x)``; it adds
``terminal_parameters()`` and ``zero_init_last()``. The block must compute
``x + h(x)`` with ``h`` vanishing when the named parameters are zero (e.g. ``h`` ends in a
linear/conv layer whose weight and bias are named). Without a fast feature form the probe
computes per-sample gradients of the named parameters with ``torch.func`` (slower, exact).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn


class ResidualAdapter(nn.Module):
    def __init__(self, block: nn.Module, terminal: Sequence[str]):
        super().__init__()
        self.block = block
        self.terminal = tuple(terminal)
        params = dict(block.named_parameters())
        missing = [t for t in self.terminal if t not in params]
        if missing:
            raise ValueError(f"terminal: {missing} are not parameters of the block; it has {sorted(params)}")
        # A block that knows its own feature form keeps the probe's fast path.
        for name in ("probe_features", "split_terminal", "probe_features_calibrates"):
            if hasattr(block, name):
                setattr(self, name, getattr(block, name))

    def forward(self, *args, **kwargs):
        return self.block(*args, **kwargs)

    def terminal_parameters(self) -> list[nn.Parameter]:
        params = dict(self.block.named_parameters())
        return [params[t] for t in self.terminal]

    def zero_init_last(self) -> None:
        with torch.no_grad():
            for p in self.terminal_parameters():
                p.zero_()
