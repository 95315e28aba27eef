"""Checkpoints written before 15 options were removed still resume (tests/data/old_checkpoints/).

Both files are real ``last.ckpt`` files of fits run with the code before the removal (commit
ba9df4c; tests/data/old_checkpoints/make.py has the command): their callback state holds the keys
of that version (``alpha_index``, ``cooldown_left``, ``gain_reference``, ``snapshot``, ...). The
fits below resume them with today's callback: the growth record is replayed before the weights
load, the history, counters and the trial count carry over, and a fit the removed stage-gain
decision was judging says that its reference is ignored (a warning), then goes on by the trial.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch

from growtrain.callbacks import GrowUntilSaturated
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier

OLD = Path(__file__).parent / "data" / "old_checkpoints"


def _fit(tmp_path, ckpt: str, epochs: int) -> tuple[GrowUntilSaturated, ImageClassifier]:
    L.seed_everything(0)
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=300, synthetic_classes=4, probe_size=64,
                         val_size=16, batch_size=32, augment=False)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4)
    grow = GrowUntilSaturated(monitor=None, every_n_epochs=1, rule="paper", t=1e-9, max_growths=3, verbose=False,
                              decision="trial", min_gain=0.0, trial_epochs=0.2)  # fmt: skip
    trainer = L.Trainer(max_epochs=epochs, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=1,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, dm, ckpt_path=OLD / ckpt)
    return grow, model


def _old_state(ckpt: str) -> dict:
    return torch.load(OLD / ckpt, weights_only=False)["callbacks"]["GrowUntilSaturated"]


def test_a_trial_checkpoint_of_the_earlier_version_resumes_with_its_history_and_counters(tmp_path):
    old = _old_state("old_trial.ckpt")
    assert {"alpha_index", "cooldown_left", "snapshot", "gain_reference"} <= old.keys()  # the old format indeed
    assert [h["action"] for h in old["history"]] == ["grow", "grow"] and old["finished"] is None
    grow, model = _fit(tmp_path, "old_trial.ckpt", epochs=3)
    # the two old checks carried over unchanged, one new check after them
    assert grow.history[:2] == [dict(h) for h in old["history"]] and len(grow.history) == 3
    assert grow.history[2]["check"] == old["checks"] and grow.history[2]["epoch"] == 2
    assert grow.checks == old["checks"] + 1
    # the depth: the start (3) plus the old growths (replayed before the weights loaded) plus today's
    new = grow.history[2]["action"] == "grow"
    assert model.network.depth() == 3 + old["growths"] + new == 3 + grow.growths
    assert grow._trials.trials > old["trials"]["trials"]  # trial blocks seeded on from the old count


def test_a_checkpoint_of_the_removed_gain_decision_warns_and_goes_on_by_the_trial(tmp_path):
    old = _old_state("old_gain.ckpt")
    assert old["gain_reference"] is not None and old["snapshot"] is not None and old["finished"] is None
    with pytest.warns(UserWarning, match=r"written by decision='gain' \(removed.*reference is ignored.*decision='trial'"):
        grow, model = _fit(tmp_path, "old_gain.ckpt", epochs=2)
    assert [h["action"] for h in grow.history][:1] == ["grow"] and len(grow.history) == 2
    assert "trial" in grow.history[1] and "gain" not in grow.history[1]  # judged by the trial now
    assert model.network.depth() == 3 + grow.growths  # the un-judged block of the old fit is kept
