"""growtrain's Lightning callbacks, one job per module.

- ``growth``: :class:`GrowUntilSaturated`, the probe-and-grow callback; its parts' options
  (``growth_config``): when a check comes, :class:`Converged` or :class:`Periodic`, and what
  decides, :class:`Trial`, :class:`StageFork` or :class:`Rule`;
- ``budget``: :class:`GrowForBudget`, growth early in the fit's compute budget, decided by equal-FLOP forks;
- ``scheduled``: :class:`GrowOnSchedule`, growth at set points of the step budget (no test);
- ``early_stopping``: :class:`TrainLossEarlyStopping`, the paper's stop on the training loss;
- ``compute``: :class:`ComputeMeter`, batches, samples and estimated FLOPs of a fit;
- ``gamma_plot``: :class:`GammaTracePlot`, ``gamma_trace.png`` from the growth checks at fit end;
- ``rng_state``: :class:`RandomStateCheckpoint`, the random state in every checkpoint, back on resume.
"""

from growtrain.callbacks._select import growth_callbacks
from growtrain.callbacks.budget import GrowForBudget
from growtrain.callbacks.compute import ComputeMeter, forward_flops
from growtrain.callbacks.early_stopping import TrainLossEarlyStopping
from growtrain.callbacks.gamma_plot import GammaTracePlot, save_gamma_trace
from growtrain.callbacks.growth import GrowUntilSaturated
from growtrain.callbacks.growth_config import Converged, Periodic, Rule, StageFork, Trial
from growtrain.callbacks.rng_state import RandomStateCheckpoint
from growtrain.callbacks.scheduled import GrowOnSchedule
from growtrain.quiet import quiet_upstream_noise

# a plain script (no growtrain CLI or trainer) that uses a growtrain callback: no Lightning tips or
# LeafSpec deprecation it cannot act on (growtrain/quiet.py; message by message, growtrain's own kept)
quiet_upstream_noise()

__all__ = [
    "ComputeMeter",
    "Converged",
    "GammaTracePlot",
    "GrowForBudget",
    "GrowOnSchedule",
    "GrowUntilSaturated",
    "Periodic",
    "RandomStateCheckpoint",
    "Rule",
    "StageFork",
    "TrainLossEarlyStopping",
    "Trial",
    "forward_flops",
    "growth_callbacks",
    "save_gamma_trace",
]
