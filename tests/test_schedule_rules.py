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

from growtrain.callbacks import GrowUntilSaturated
from growtrain.schedule_rules import should_check


def test_plateau_needs_a_minimum_stage_and_is_relative():
    common = dict(finished=None, every_n_epochs=1, monitor="train_loss", plateaued=True)
    assert should_check(**common, epochs_since_check=1, min_stage_epochs=3, stage_epochs=2) == (
        False, "stage is 2 epoch(s) long; min_stage_epochs=3")
    assert should_check(**common, epochs_since_check=1, min_stage_epochs=3, stage_epochs=3)[0]
    # the callback's plateau is relative: the same losses ×10 or ×0.1 plateau at the same epoch
    def plateau_epoch(scale):
        grow = GrowUntilSaturated(patience=2, min_rel_delta=0.05)
        for epoch, loss in enumerate([1.0, 0.8, 0.7, 0.69, 0.68, 0.675]):
            if grow._monitor.plateaued(SimpleNamespace(callback_metrics={"train_loss": torch.tensor(scale * loss)})):
                return epoch

    assert plateau_epoch(1.0) == plateau_epoch(10.0) == plateau_epoch(0.1) == 4
    with pytest.raises(RuntimeError, match=r"monitor: metric 'train_loss' is not logged; available: \['loss'\]"):
        GrowUntilSaturated()._monitor.plateaued(SimpleNamespace(callback_metrics={"loss": torch.tensor(1.0)}))


def test_window_never_judged_agrees_with_a_brute_force_schedule():
    """Against a simulation of the periodic schedule: checks end epochs K-1, 2K-1, ...; one is
    judged when an earlier check is at least J epochs older (growtrain.window.window_reference);
    it may grow when more than the final anneal's epochs remain after it (growtrain.callbacks.
    schedule.final_reserved), or always without a final anneal."""
    from growtrain.schedule_rules import window_never_judged

    for max_epochs in range(1, 25):
        for k in (1, 2, 3):
            for j in (1, 2, 4, 6):
                for anneal, on_saturated in ((3, "anneal"), (5, "anneal"), (3, "stop")):
                    checks = list(range(k - 1, max_epochs, k))
                    usable = [e for e in checks
                              if any(c <= e - j for c in checks if c < e)
                              and (on_saturated != "anneal" or max_epochs - e - 1 > anneal)]  # fmt: skip
                    got = window_never_judged(max_epochs=max_epochs, every_n_epochs=k, window=j, anneal_epochs=anneal,
                                              on_saturated=on_saturated)  # fmt: skip
                    assert (got is not None) == (not usable), (max_epochs, k, j, anneal, on_saturated, got)


def test_a_window_that_can_never_be_judged_is_said_before_training(tmp_path):
    import lightning as L
    import pytest

    from growtrain import GrowUntilSaturated, ImageClassifier
    from tests.test_periodic import tiny_dm

    grow = GrowUntilSaturated(schedule="periodic", every_n_epochs=2, window=6, on_saturated="anneal", anneal_epochs=3,
                              verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=8, callbacks=[grow], logger=False, enable_progress_bar=False, limit_train_batches=1,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    with pytest.warns(UserWarning, match=r"window=6: the first check with a full window ends epoch 7.*never grows"):
        trainer.fit(ImageClassifier(width=4, num_classes=4, in_channels=3), tiny_dm())
    assert not grow.history or all(h["action"] != "grow" for h in grow.history)
