"""A growth callback rebuilt from another's options with some changed (its options are read-only).

Used by ``growtrain compare`` and ``growtrain stopping`` for their sibling arms (scratch, other seeds, a
capped growth): each arm gets a fresh callback whose collaborators are built from its own options.
"""

from __future__ import annotations

from growtrain.callbacks import GrowUntilSaturated
from growtrain.callbacks.growth_config import GrowthConfig

__all__ = ["grower_from"]


def grower_from(grow: GrowUntilSaturated, **changes) -> GrowUntilSaturated:
    """A fresh callback built from ``grow``'s options with ``changes`` (its collaborators, e.g.
    the trial runner, are built from them too, so nothing is patched after construction). The
    schedule and decision pass as the validated parts they are (frozen instances)."""
    options = {name: getattr(grow.config, name) for name in GrowthConfig.names()}
    return GrowUntilSaturated(**options | changes)
