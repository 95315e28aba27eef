"""growtrain: grow a residual network one function-preserving block at a time, until saturated.

The math (``measure_saturation``, growable networks) imports no Lightning; the Lightning parts
(``GrowUntilSaturated``, ``ImageClassifier``, ``LanguageModel``) load on first use.
"""

from growtrain.families.generic import GrowableStack
from growtrain.growable import Site, find_growable, grown_blocks, replay_growth
from growtrain.saturation import SaturationReport, SiteRecord, measure_saturation

_LAZY = {
    "GrowUntilSaturated": "growtrain.callbacks.growth",
    # its parts' options: when a check comes, what decides
    "Budget": "growtrain.callbacks.parts",
    "BudgetFork": "growtrain.callbacks.parts",
    "Plan": "growtrain.callbacks.parts",
    "Converged": "growtrain.callbacks.parts",
    "Periodic": "growtrain.callbacks.parts",
    "Trial": "growtrain.callbacks.parts",
    "StageFork": "growtrain.callbacks.parts",
    "Rule": "growtrain.callbacks.parts",
    "GrowableModuleMixin": "growtrain.module",
    "ImageClassifier": "growtrain.module",
    "LanguageModel": "growtrain.lm",
}

__all__ = [
    "Site",
    "GrowableStack",
    "find_growable",
    "grown_blocks",
    "replay_growth",
    "measure_saturation",
    "SaturationReport",
    "SiteRecord",
    *_LAZY,
]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'growtrain' has no attribute {name!r}")
