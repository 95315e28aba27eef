"""The stopping experiment (growth runs beside a scratch sweep) and the final anneal."""

from __future__ import annotations

import json
import math

import lightning as L
import pytest
import torch

from growtrain.callbacks import GrowUntilSaturated
from growtrain.data import ImageDataModule
from growtrain.experiments.stopping import run_stopping, smallest_good_depth
from growtrain.module import ImageClassifier


def tiny_dm(**kw) -> ImageDataModule:
    args = dict(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                val_size=40, batch_size=32, augment=False)  # fmt: skip
    return ImageDataModule(**(args | kw))


def test_smallest_good_depth_is_within_one_standard_error_of_the_best():
    by_depth = {0: [0.60, 0.62], 1: [0.50, 0.54], 2: [0.49, 0.51], 3: [0.495, 0.505]}
    d_star, best = smallest_good_depth(by_depth)
    # best: depth 2 (mean 0.50, sd 0.0141, se 0.01); depth 1's mean 0.52 > 0.51, depth 3 is deeper
    assert (d_star, best) == (2, 2)
    by_depth[1] = [0.50, 0.52]  # mean 0.51 ≤ 0.51: now depth 1 is good enough
    assert smallest_good_depth(by_depth) == (1, 2)


def test_anneal_finishes_the_network_then_stops(tmp_path):
    """on_saturated="anneal": once growth ends, the lr follows a cosine to 0 over anneal_epochs,
    the user's scheduler is set aside, and the fit stops after exactly that many epochs."""
    L.seed_everything(0)
    lrs = []

    class RecordLR(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            lrs.append(trainer.optimizers[0].param_groups[0]["lr"])

    grow = GrowUntilSaturated(monitor=None, every_n_epochs=2, max_growths=0, on_saturated="anneal", anneal_epochs=3,
                              verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=20, callbacks=[grow, RecordLR()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                            lr_scheduler=lambda o: torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5))  # fmt: skip
    trainer.fit(model, tiny_dm())
    assert trainer.current_epoch == 5  # 2 epochs, the check ends growth (budget), 3 anneal epochs
    assert grow.finished == "budget" and grow.anneal_done == 3
    base = lrs[2 - 1] * 0.5  # the StepLR halved the lr after epoch 1 (the check is at the end of epoch 1)
    expected = [base * 0.5 * (1 + math.cos(math.pi * (k + 1) / 4)) for k in range(3)]
    assert lrs[2:] == pytest.approx(expected)
    assert lrs[-1] < 0.2 * lrs[2]


def test_stopping_experiment_rows_resume_and_summary(tmp_path):
    L.seed_everything(0)
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic")
    grow = GrowUntilSaturated(monitor=None, every_n_epochs=1, rule="relative", tau=1e-6, max_growths=1,
                              on_saturated="anneal", anneal_epochs=1, verbose=False)  # fmt: skip
    kwargs = dict(max_epochs=4, callbacks=[grow], logger=False, enable_checkpointing=False, enable_progress_bar=False,
                  enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    result = run_stopping(model, tiny_dm(), trainer_kwargs=kwargs, depths=[0, 1], seeds=[0], output_dir=tmp_path)
    growth = result.growth[0]
    assert growth["growths"] == 1 and growth["depth"] == 1 and growth["stopped"] == "budget"
    assert {r["depth"] for r in result.scratch} == {0, 1}
    assert all(r["growths"] == 0 and r["stopped"] == "budget" for r in result.scratch)  # same rule, no growth
    summary = json.loads((tmp_path / "stopping.json").read_text())["summary"]
    assert summary["d_star"] in (0, 1) and summary["growth"][0]["compute_vs_sweep"] > 0
    assert (tmp_path / "stopping.png").stat().st_size > 0
    again = run_stopping(model, tiny_dm(), trainer_kwargs=kwargs, depths=[0, 1], seeds=[0], output_dir=tmp_path)
    assert again.growth[0]["wall_s"] == growth["wall_s"]  # resumed from runs.jsonl, not retrained
    partial = run_stopping(model, tiny_dm(), trainer_kwargs=kwargs, depths=[0, 1, 2], seeds=[0, 1], output_dir=tmp_path,
                           train=False)  # fmt: skip
    assert len(partial.growth) == 1 and {r["depth"] for r in partial.scratch} == {0, 1}  # summarised, nothing trained


def test_stopping_experiment_refuses_an_unfinished_growth_arm(tmp_path):
    model = ImageClassifier(width=4, num_classes=4)
    kwargs = dict(max_epochs=1, callbacks=[GrowUntilSaturated(on_saturated="stop")])
    with pytest.raises(ValueError, match="on_saturated: 'stop' ends the growth run unannealed"):
        run_stopping(model, tiny_dm(), trainer_kwargs=kwargs, depths=[0], seeds=[0], output_dir=tmp_path)
    with pytest.raises(ValueError, match="needs exactly one GrowUntilSaturated"):
        run_stopping(model, tiny_dm(), trainer_kwargs={"max_epochs": 1}, depths=[0], seeds=[0], output_dir=tmp_path)
