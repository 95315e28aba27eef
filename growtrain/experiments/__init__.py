"""growtrain's experiments as plain functions (no CLI needed): the paper's Table 1 (Growth vs
Scratch), Figure 1 (depth sweep), Appendix H (activation-gradient matching) and per-site
saturation reports of a checkpoint. ``growtrain.trainer.GrowTrainer`` exposes each as a
subcommand: ``growtrain compare|sweep|match|measure --config FILE``."""

from growtrain.experiments.compare import CompareResult, run_compare
from growtrain.experiments.match import MatchResult, run_match
from growtrain.experiments.measure import MeasureResult, run_measure
from growtrain.experiments.sweep import SweepResult, run_sweep

__all__ = [
    "CompareResult",
    "MatchResult",
    "MeasureResult",
    "SweepResult",
    "run_compare",
    "run_match",
    "run_measure",
    "run_sweep",
]
