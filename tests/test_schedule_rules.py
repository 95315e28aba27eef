"""The callback's pure schedule functions (``growtrain.schedule_rules``): when a check is due.

* a converged stage must be at least ``min_stage_epochs`` long before a plateau checks;
* the plateau is relative (``min_rel_delta``): scaling the loss does not move the check.

The same functions' other cases (the periodic schedule, ``plateau_update``, ``decide_growth``'s
budgets) are in tests/test_callback.py and tests/test_periodic.py.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from growtrain.callbacks import Converged, GrowUntilSaturated
from growtrain.schedule_rules import should_check


def test_plateau_needs_a_minimum_stage_and_is_relative():
    common = dict(finished=None, every_n_epochs=1, monitor="train_loss", plateaued=True)
    assert should_check(**common, epochs_since_check=1, min_stage_epochs=3, stage_epochs=2) == (
        False, "stage is 2 epoch(s) long; min_stage_epochs=3")
    assert should_check(**common, epochs_since_check=1, min_stage_epochs=3, stage_epochs=3)[0]
    # the callback's plateau is relative: the same losses ×10 or ×0.1 plateau at the same epoch
    def plateau_epoch(scale):
        grow = GrowUntilSaturated(schedule=Converged(patience=2, min_rel_delta=0.05))
        for epoch, loss in enumerate([1.0, 0.8, 0.7, 0.69, 0.68, 0.675]):
            if grow._monitor.plateaued(SimpleNamespace(callback_metrics={"train_loss": torch.tensor(scale * loss)})):
                return epoch

    assert plateau_epoch(1.0) == plateau_epoch(10.0) == plateau_epoch(0.1) == 4
    with pytest.raises(RuntimeError, match=r"monitor: metric 'train_loss' is not logged; available: \['loss'\]"):
        GrowUntilSaturated(schedule="converged")._monitor.plateaued(SimpleNamespace(callback_metrics={"loss": torch.tensor(1.0)}))
