"""Deprecated import path: ``GrowUntilSaturated`` lives in ``growtrain.callbacks.growth`` and the
decision functions in ``growtrain.decision``. Kept for one release; each name warns on use."""

from growtrain._deprecation import moved_names

_GROWTH = "growtrain.callbacks.growth"
_DECISION = "growtrain.decision"
_PROBE_DATA = "growtrain.callbacks.probe_data"

__getattr__ = moved_names(
    "growtrain.callback",
    {
        "GrowUntilSaturated": _GROWTH,
        "FunctionChangedError": _GROWTH,
        "_insertion_order": _GROWTH,
        "measure_saturation": _GROWTH,
        "should_check": _DECISION,
        "decide_growth": _DECISION,
        "rank_sites": _DECISION,
        "plateau_update": _DECISION,
        "budget_reason": _DECISION,
        "insertion_tolerance": _DECISION,
        "PROBE_COST": _DECISION,
        "probe_overlap": _PROBE_DATA,
        "ProbeView": _PROBE_DATA,
    },
)
