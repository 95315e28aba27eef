"""Finding the growth callbacks among a trainer's (or a configuration's) callbacks."""

from __future__ import annotations

from typing import Sequence

from lightning.pytorch import Callback

from growtrain.callbacks.growth import GrowUntilSaturated

__all__ = ["as_callback_list", "growth_callbacks"]


def as_callback_list(callbacks: Sequence[Callback] | Callback | None) -> list[Callback]:
    """``callbacks`` as a list, however a trainer was given them (None, one, or a sequence)."""
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]
    return list(callbacks)


def growth_callbacks(callbacks: Sequence[Callback] | Callback | None) -> list[Callback]:
    """The ``GrowUntilSaturated`` instances among ``callbacks``."""
    return [cb for cb in as_callback_list(callbacks) if isinstance(cb, GrowUntilSaturated)]
