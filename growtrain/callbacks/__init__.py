"""growtrain's Lightning callbacks, one job per module.

- ``growth``: :class:`GrowUntilSaturated`, the one growth callback; its parts' options
  (``growth_config``): when, :class:`Budget` (the default), :class:`Converged`, :class:`Periodic` or
  :class:`Plan`; what decides, :class:`BudgetFork`, :class:`Trial`, :class:`StageFork` or :class:`Rule`;
  the budget's and the plan's own work in ``budget`` and ``scheduled``;
- ``early_stopping``: :class:`TrainLossEarlyStopping`, the paper's stop on the training loss;
- ``compute``: :class:`ComputeMeter`, batches, samples and estimated FLOPs of a fit;
- ``gamma_plot``: :class:`GammaTracePlot`, ``gamma_trace.png`` from the growth checks at fit end;
- ``rng_state``: :class:`RandomStateCheckpoint`, the random state in every checkpoint, back on resume.
"""

from growtrain.callbacks._select import growth_callbacks
from growtrain.callbacks.compute import ComputeMeter, forward_flops
from growtrain.callbacks.early_stopping import TrainLossEarlyStopping
from growtrain.callbacks.gamma_plot import GammaTracePlot, save_gamma_trace
from growtrain.callbacks.growth import GrowUntilSaturated
from growtrain.callbacks.parts import Budget, BudgetFork, Converged, Periodic, Plan, Rule, StageFork, Trial
from growtrain.callbacks.rng_state import RandomStateCheckpoint
from growtrain.quiet import quiet_upstream_noise

# a plain script (no growtrain CLI or trainer) that uses a growtrain callback: no Lightning tips or
# LeafSpec deprecation it cannot act on (growtrain/quiet.py; message by message, growtrain's own kept)
quiet_upstream_noise()

__all__ = [
    "Budget",
    "BudgetFork",
    "ComputeMeter",
    "Converged",
    "GammaTracePlot",
    "GrowUntilSaturated",
    "Periodic",
    "Plan",
    "RandomStateCheckpoint",
    "Rule",
    "StageFork",
    "TrainLossEarlyStopping",
    "Trial",
    "forward_flops",
    "growth_callbacks",
    "save_gamma_trace",
]
