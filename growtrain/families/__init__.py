"""Residual families: one file per block type, registered by name (timm-style)."""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from growtrain.families.base import ChannelAffineFeatures, DenseFeatures
from growtrain.families.basic import BasicBlock
from growtrain.families.generic import GrowableStack, ResidualAdapter
from growtrain.families.preact import PreActBlock
from growtrain.growable import check_growable_block

# name → block class taking (in_channels, out_channels, stride)
_CONV_FAMILIES: dict[str, Callable[..., nn.Module]] = {"basic": BasicBlock, "preact": PreActBlock}


def conv_family(name: str) -> Callable[..., nn.Module]:
    """The convolutional block class registered as ``name``."""
    try:
        return _CONV_FAMILIES[name]
    except KeyError:
        known = ", ".join(sorted(_CONV_FAMILIES))
        raise ValueError(f"family: expected one of {known}, got {name!r}") from None


def register_conv_family(name: str, block_cls: Callable[..., nn.Module]) -> None:
    """Add a block class ``(in_channels, out_channels, stride) -> block`` under ``name``.

    Checked before it is registered: the class has the whole growable-block contract
    (:class:`growtrain.growable.GrowableBlock`; ``split_terminal`` only with ``probe_features``,
    see :func:`growtrain.growable.check_growable_block`), and a small instance built with
    ``block_cls(2, 2, 1)`` is the identity on nonnegative input after ``zero_init_last()``.
    """
    if not isinstance(name, str) or not name:
        raise ValueError(f"name: expected a non-empty family name (str), got {name!r}")
    if not callable(block_cls):
        raise TypeError(f"block_cls: expected a block class (in_channels, out_channels, stride) -> block, got {block_cls!r}")
    check_growable_block(block_cls, "block_cls")
    try:
        block = block_cls(2, 2, 1)
    except Exception as err:
        raise TypeError(f"block_cls: {block_cls!r}(in_channels=2, out_channels=2, stride=1) failed: {err}") from err
    block.zero_init_last()
    block.eval()  # BatchNorm on running statistics: the identity must not depend on the batch
    # nonnegative: in a post-activation network a block's input comes out of a ReLU, and the
    # block's own final ReLU is the identity only there
    z = torch.rand(2, 2, 4, 4, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        same = torch.equal(block(z), z)
    if not same or any(bool(torch.any(p != 0)) for p in block.terminal_parameters()):
        raise ValueError(
            f"block_cls: after zero_init_last() a {block_cls.__name__} must output its (nonnegative) input "
            "exactly: zero terminal_parameters(), identity skip at stride 1 and equal channels; it does not."
        )
    _CONV_FAMILIES[name] = block_cls


def conv_families() -> list[str]:
    return sorted(_CONV_FAMILIES)


__all__ = [
    "BasicBlock",
    "PreActBlock",
    "ResidualAdapter",
    "GrowableStack",
    "DenseFeatures",
    "ChannelAffineFeatures",
    "conv_family",
    "conv_families",
    "register_conv_family",
]
