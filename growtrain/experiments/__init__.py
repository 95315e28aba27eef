"""growtrain's experiments as plain functions (no CLI needed): the paper's Table 1 (Growth vs
Scratch), Figure 1 (depth sweep), Appendix H (activation-gradient matching) and per-site
saturation reports of a checkpoint. ``growtrain.trainer.GrowTrainer`` exposes each as a
subcommand: ``growtrain compare|sweep|match|measure|stopping --config FILE``; ``stopping``
puts growth runs beside a from-scratch depth sweep (does growth stop where depth stops paying?)."""

from growtrain.experiments.compare import CompareResult, run_compare
from growtrain.experiments.match import MatchResult, run_match
from growtrain.experiments.measure import MeasureResult, run_measure
from growtrain.experiments.stopping import StoppingResult, run_stopping
from growtrain.experiments.sweep import SweepResult, run_sweep

__all__ = [
    "CompareResult",
    "MatchResult",
    "MeasureResult",
    "StoppingResult",
    "SweepResult",
    "run_compare",
    "run_match",
    "run_measure",
    "run_stopping",
    "run_sweep",
]
