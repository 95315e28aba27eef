"""A user's own residual block, made growable by naming its terminal parameters; a user's own
stack of them, made a growable network (``GrowableStack``).

``ResidualAdapter(block, ("fc2.weight", "fc2.bias"))`` computes exactly ``block(x)``; it adds
``terminal_parameters()`` and ``zero_init_last()``. The block must compute
``x + h(x)`` with ``h`` vanishing when the named parameters are zero (e.g. ``h`` ends in a
linear/conv layer whose weight and bias are named). Without a fast feature form the probe
computes per-sample gradients of the named parameters with ``torch.func`` (slower, exact).
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

import torch
from torch import nn

from growtrain.growable import GrowableMixin


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


class GrowableStack(GrowableMixin, nn.Module):
    """Make a user's own stack of residual blocks growable.

    ``blocks`` is an ``nn.ModuleList``/``nn.Sequential`` of blocks whose input and output
    shapes agree; ``factory()`` builds a fresh block; ``terminal`` names the parameters of the
    terminal map inside a block (e.g. ``("fc2.weight", "fc2.bias")``). New blocks are wrapped
    in :class:`ResidualAdapter` only to expose
    ``terminal_parameters()``/``zero_init_last()``; they compute exactly ``factory()``'s block.

    ``GrowableStack(blocks, factory, terminal)(x)`` runs the blocks in order; use it in place
    of your ``nn.Sequential``.
    """

    growable_stages = ("blocks",)

    def __init__(self, blocks: Iterable[nn.Module], factory: Callable[[], nn.Module], terminal: Sequence[str]):
        super().__init__()
        if not callable(factory):
            raise TypeError(f"factory: expected a callable returning a block, got {type(factory).__name__}")
        terminal = tuple(terminal)
        if not terminal:
            raise ValueError("terminal: name at least one parameter of the block's terminal map, e.g. ('fc2.weight',)")
        probe = factory()
        names = dict(probe.named_parameters())
        missing = [t for t in terminal if t not in names]
        if missing:
            raise ValueError(
                f"terminal: {missing} are not parameters of factory()'s block; its parameters are {sorted(names)}"
            )
        self.factory = factory
        self.terminal = terminal
        self.blocks = nn.ModuleList(
            b if hasattr(b, "terminal_parameters") else ResidualAdapter(b, terminal) for b in blocks
        )
        self._init_growth()

    def make_block(self, stage: str) -> nn.Module:
        block = ResidualAdapter(self.factory(), self.terminal)
        block.zero_init_last()
        return block

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return x
