"""A growth callback rebuilt from another's options with some changed (its options are read-only).

Used by ``growtrain compare`` and ``growtrain stopping`` for their sibling arms (scratch, other seeds, a
capped growth): each arm gets a fresh callback whose collaborators are built from its own options.
"""

from __future__ import annotations

from dataclasses import replace

from growtrain.callbacks import GrowUntilSaturated
from growtrain.callbacks.growth_config import GrowthConfig

__all__ = ["grower_from"]


def _config_with(grow: GrowUntilSaturated, **changes) -> GrowthConfig:
    """``grow``'s options with ``changes``; ``every_n_epochs`` back to "not given" where it does not
    time the checks (``replace`` re-validates: a given one would be warned about under a monitor,
    and refused beside ``min_steps_between_checks``)."""
    return replace(grow.config, every_n_epochs=_every_n_epochs(grow.config), **changes)


def _monitor_decides(config: GrowthConfig) -> bool:
    """Does a plateau of the monitor time the checks (the converged schedule with a monitor)?"""
    return config.monitor is not None and config.schedule == "converged"


def _every_n_epochs(config: GrowthConfig) -> int | None:
    """``every_n_epochs`` as given: ``None`` (the config normalises a missing one to 1) where a
    monitor or ``min_steps_between_checks`` times the checks."""
    return None if _monitor_decides(config) or config.min_steps_between_checks is not None else config.every_n_epochs


def grower_from(grow: GrowUntilSaturated, **changes) -> GrowUntilSaturated:
    """A fresh callback built from ``grow``'s options with ``changes`` (its collaborators, e.g.
    the trial runner, are built from them too, so nothing is patched after construction)."""
    config = _config_with(grow, **changes)
    options = {name: getattr(config, name) for name in GrowthConfig.names()}
    # the config normalises a missing every_n_epochs to 1: pass "not given" again where it does not time the checks
    return GrowUntilSaturated(**options | {"every_n_epochs": _every_n_epochs(grow.config)})
