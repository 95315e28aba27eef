"""Residual families: one file per block type, registered by name (timm-style)."""

from __future__ import annotations

from typing import Callable

from torch import nn

from growtrain.families.base import ChannelAffineFeatures, DenseFeatures
from growtrain.families.basic import BasicBlock
from growtrain.families.generic import ResidualAdapter
from growtrain.families.preact import PreActBlock

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
    """Add a block class ``(in_channels, out_channels, stride) -> block`` under ``name``."""
    for attr in ("zero_init_last", "terminal_parameters"):
        if not hasattr(block_cls, attr):
            raise TypeError(f"block_cls: a growable block needs a `{attr}` method; {block_cls!r} has none")
    _CONV_FAMILIES[name] = block_cls


def conv_families() -> list[str]:
    return sorted(_CONV_FAMILIES)


__all__ = [
    "BasicBlock",
    "PreActBlock",
    "ResidualAdapter",
    "DenseFeatures",
    "ChannelAffineFeatures",
    "conv_family",
    "conv_families",
    "register_conv_family",
]
