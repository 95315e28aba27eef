"""``run_compare`` end to end on tiny networks: pairing by seed (checked on the dataset indices
each training really read), the stopping rule and the cap flag, the equal-train-loss lookup
(recomputed by a plain loop over the saved weights), the stretched matched schedule, and the
bad inputs refused before any training.

Tiny on purpose: width-4 ResNets on 8×8 synthetic images, 2 batches per epoch, ≤ 3 epochs.
"""

from __future__ import annotations

import json
import logging
from functools import partial

import pytest
import torch
from lightning.pytorch import Trainer
from torch.nn import functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, ExponentialLR, MultiStepLR

from growtrain.callbacks import TrainLossEarlyStopping
from growtrain.data import ImageDataModule
from growtrain.data import datamodule as datamodule_module
from growtrain.experiments import run_compare
from growtrain.experiments.pairing import EpochOrder
from growtrain.module import ImageClassifier

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
BATCHES = 2  # training batches per epoch


def tiny_model(**kw) -> ImageClassifier:
    return ImageClassifier(width=4, in_channels=3, num_classes=4, **kw)


def tiny_data(seed: int = 0) -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, channels=3, synthetic_size=120, synthetic_classes=4,
                           probe_size=16, val_size=0, batch_size=16, seed=seed)  # fmt: skip


def tiny_trainer(stop: TrainLossEarlyStopping | None, **kw) -> dict:
    settings = dict(
        max_epochs=3, limit_train_batches=BATCHES, limit_val_batches=0, limit_test_batches=1, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
        devices=1, logger=False, callbacks=[stop] if stop is not None else [],
    )  # fmt: skip
    settings.update(kw)
    return settings


def record_indices(monkeypatch) -> list[list[list[int]]]:
    """Per fit, the dataset positions of every training batch, as the dataset was asked for them
    (evaluation after a fit is not recorded)."""
    fits: list[list[list[int]]] = []
    active = []
    original_fit, original_get = Trainer.fit, datamodule_module.TensorImages.__getitems__

    def fit(self, *args, **kwargs):
        fits.append([])
        active.append(True)
        try:
            return original_fit(self, *args, **kwargs)
        finally:
            active.pop()

    def getitems(self, idx):
        if active:
            fits[-1].append(list(idx))
        return original_get(self, idx)

    monkeypatch.setattr(Trainer, "fit", fit)
    monkeypatch.setattr(datamodule_module.TensorImages, "__getitems__", getitems)
    return fits


@pytest.fixture
def no_training(monkeypatch):
    def refuse(self, *args, **kwargs):
        raise AssertionError("a training started before the bad input was refused")

    monkeypatch.setattr(Trainer, "fit", refuse)


# -- pairing, lookup, matched arm ----------------------------------------------------------------
@pytest.fixture(scope="module")
def paired_run(tmp_path_factory):
    """Two seeds, depth 1 (cyclic), plateau stop after 3 epochs (cap 4), with the matched arm."""
    out = tmp_path_factory.mktemp("paired")
    mp = pytest.MonkeyPatch()
    fits = record_indices(mp)
    # checked from epoch 1 (the milestone); min_delta 10: no later epoch counts as an improvement,
    # so patience 1 stops after epoch 2, before the cap of 4
    stop = TrainLossEarlyStopping(start_epoch=1, patience=1, min_delta=10.0)
    model = tiny_model(lr_scheduler=partial(MultiStepLR, milestones=[1], gamma=0.1))
    try:
        result = run_compare(model, tiny_data(), trainer_kwargs=tiny_trainer(stop, max_epochs=4), seeds=[0, 1], depths=[1],
                             insert_at="cyclic", output_dir=out, keep_epoch_weights=True)  # fmt: skip
    finally:
        mp.undo()
    return result, out, fits


def _runs(result, arm, seed):
    return next(r for r in result.runs if r["arm"] == arm and r["seed"] == seed)


def test_both_arms_of_a_seed_read_the_same_indices_in_the_same_order(paired_run):
    result, _, fits = paired_run
    # fit order: seed 0: base, growth, scratch, matched; then seed 1 likewise
    assert len(fits) == 8
    seed0, seed1 = fits[:4], fits[4:]
    for runs in (seed0, seed1):
        base, growth, scratch, matched = runs
        assert growth == base[: len(growth)] and growth == scratch[: len(growth)]
        assert matched[: len(scratch)] == scratch
    assert seed0[2][:BATCHES] != seed1[2][:BATCHES]  # another seed, another order
    # epoch 0 and epoch 1 of one training differ (reshuffled each epoch)
    assert seed0[2][:BATCHES] != seed0[2][BATCHES : 2 * BATCHES]
    # and the recorded order digests agree across the seed's arms
    orders = {arm: _runs(result, arm, 0)["orders"] for arm in ("base", "growth", "scratch", "matched")}
    assert orders["growth"]["0"] == orders["scratch"]["0"] == orders["base"]["0"] == orders["matched"]["0"]
    assert _runs(result, "scratch", 0)["orders"]["0"] != _runs(result, "scratch", 1)["orders"]["0"]
    # the positions are EpochOrder's permutation of the 104 train samples, cut into batches of 16
    expected = EpochOrder(104, 0).order(0).tolist()
    assert [i for batch in seed0[2][:BATCHES] for i in batch] == expected[: 16 * BATCHES]


def test_every_arm_stops_at_the_plateau_and_none_is_capped(paired_run):
    result, _, _ = paired_run
    (row,) = result.summary
    for arm in ("base", "growth", "scratch"):
        for seed in (0, 1):
            run = _runs(result, arm, seed)
            assert run["stop"] == "plateau" and run["capped"] is False and run["epochs"] == 3
            assert len(run["trace"]) == 3 and run["split"] == _runs(result, "growth", 0)["split"]
            # every arm (growth too: a new fit) runs the whole schedule: ×0.1 from epoch 1 on
            assert [r["lr"] for r in run["trace"]] == pytest.approx([0.1, 0.01, 0.01])
    assert row["scratch_capped"] == row["growth_capped"] == 0
    assert _runs(result, "matched", 0)["stop"] == "budget"


def test_base_of_a_row_is_the_from_scratch_training_of_depth_minus_one(paired_run):
    result, _, _ = paired_run
    base, growth = _runs(result, "base", 0), _runs(result, "growth", 0)
    assert base["blocks"] == 3 and growth["blocks"] == 4 and base["init_seed"] == _runs(result, "scratch", 0)["init_seed"]
    assert growth["arch"] == _runs(result, "scratch", 0)["arch"] == _runs(result, "matched", 0)["arch"]
    assert growth["insertion"] == {"site": "layer1.1", "rule": "cyclic"}


def test_matched_arm_gets_growth_flops_and_a_schedule_stretched_to_them(paired_run):
    result, _, _ = paired_run
    base, growth, scratch, matched = (_runs(result, a, 0) for a in ("base", "growth", "scratch", "matched"))
    budget = base["flops"] + growth["flops"]
    per_step = scratch["flops"] / scratch["steps"]
    assert matched["steps"] == matched["budget_steps"] and budget / per_step <= matched["steps"] < budget / per_step + 1
    steps_per_epoch = scratch["steps"] / scratch["epochs"]
    assert matched["schedule_factor"] == pytest.approx(matched["budget_steps"] / (4 * steps_per_epoch))


def _test_loss_by_hand(model, state, datamodule) -> float:
    model.load_state_dict(state)
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for x, y in datamodule.test_dataloader():
            total += F.cross_entropy(model(x), y, reduction="sum").item()
            count += len(y)
            break  # limit_test_batches=1
    return total / count


def test_equal_train_loss_lookup_uses_the_first_epoch_at_the_common_target(paired_run):
    result, out, _ = paired_run
    lookup = next(r for r in result.lookups if r["key"] == "equal/d1/s0")
    growth, scratch = _runs(result, "growth", 0), _runs(result, "scratch", 0)
    target = max(growth["trace"][-1]["train_loss"], scratch["trace"][-1]["train_loss"])
    assert lookup["target"] == pytest.approx(target)
    assert lookup["from_epoch"] == 1  # the lr is final from the milestone on: earlier epochs do not count
    dm = tiny_data()
    dm.setup("fit")
    for arm, run in (("growth", growth), ("scratch", scratch)):
        first = next(r for r in run["trace"] if r["epoch"] >= 1 and r["train_loss"] <= target)
        assert lookup[arm]["epoch"] == first["epoch"]
        state = torch.load(f"{run['weights_dir']}/{first['weights']}", weights_only=True)
        model = tiny_model(blocks=[2, 1, 1])  # the final architecture
        assert lookup[arm]["test"]["loss"] == pytest.approx(_test_loss_by_hand(model, state, dm), rel=1e-5)
    (row,) = result.summary
    saved = json.loads((out / "compare.json").read_text())
    assert saved["summary"][0]["diff_equal_test_loss"]["n"] == 2 and row["diff_test_loss"]["lo"] is not None
    md = (out / "compare.md").read_text()
    assert "Δ test loss G−S [95% CI]" in md and "Test loss @target Growth" in md


def test_cap_flag_when_the_plateau_is_not_reached(tmp_path):
    stop = TrainLossEarlyStopping(start_epoch=1, patience=5)  # cannot stop within 2 epochs
    result = run_compare(tiny_model(), tiny_data(), trainer_kwargs=tiny_trainer(stop, max_epochs=2), seeds=[0],
                         depths=[1], insert_at="cyclic", compute_matched=False, output_dir=tmp_path)  # fmt: skip
    (row,) = result.summary
    assert all(r["capped"] and r["stop"] == "cap" and r["epochs"] == 2 for r in result.runs)
    assert row["scratch_capped"] == row["growth_capped"] == 1
    assert "S 1/1, G 1/1" in (tmp_path / "compare.md").read_text()
    assert not (tmp_path / "epochs" / "d1_s0_growth").exists()  # per-epoch weights dropped after the lookup


# -- bad input: refused before any training ------------------------------------------------------------
def test_unrescalable_scheduler_is_refused_by_name(tmp_path, no_training):
    model = tiny_model(lr_scheduler=partial(ExponentialLR, gamma=0.9))
    stop = TrainLossEarlyStopping(start_epoch=1, patience=1)
    with pytest.raises(ValueError, match="ExponentialLR"):
        run_compare(model, tiny_data(), trainer_kwargs=tiny_trainer(stop), seeds=[0], depths=[1], output_dir=tmp_path)


def test_schedule_that_early_stopping_could_cut_is_refused(tmp_path, no_training):
    stop = TrainLossEarlyStopping(start_epoch=1, patience=1)
    model = tiny_model(lr_scheduler=partial(MultiStepLR, milestones=[2], gamma=0.1))
    with pytest.raises(ValueError, match="settles only at epoch 2.*start_epoch=1"):
        run_compare(model, tiny_data(), trainer_kwargs=tiny_trainer(stop), seeds=[0], depths=[1], output_dir=tmp_path)
    cosine = tiny_model(lr_scheduler=partial(CosineAnnealingLR, T_max=2))
    with pytest.raises(ValueError, match="CosineAnnealingLR never settles"):
        run_compare(cosine, tiny_data(), trainer_kwargs=tiny_trainer(stop), seeds=[0], depths=[1], output_dir=tmp_path)


def test_missing_cap_or_second_stopping_rule_is_refused(tmp_path, no_training):
    stop = TrainLossEarlyStopping(start_epoch=1, patience=1)
    with pytest.raises(ValueError, match="max_epochs"):
        run_compare(tiny_model(), tiny_data(), trainer_kwargs=tiny_trainer(stop, max_epochs=None), seeds=[0],
                    depths=[1], output_dir=tmp_path)  # fmt: skip
    two = tiny_trainer(stop, callbacks=[stop, TrainLossEarlyStopping(start_epoch=0)])
    with pytest.raises(ValueError, match="one TrainLossEarlyStopping"):
        run_compare(tiny_model(), tiny_data(), trainer_kwargs=two, seeds=[0], depths=[1], output_dir=tmp_path)
    with pytest.raises(ValueError, match="start_epoch"):
        run_compare(tiny_model(), tiny_data(), trainer_kwargs=tiny_trainer(TrainLossEarlyStopping(start_epoch=3)),
                    seeds=[0], depths=[1], output_dir=tmp_path)  # fmt: skip


def test_runs_on_another_split_are_refused(tmp_path, no_training):
    stop = TrainLossEarlyStopping(start_epoch=1, patience=1)
    (tmp_path / "runs.jsonl").write_text(json.dumps({"key": "scratch/x/s0", "fingerprint": "f", "split": "0123"}) + "\n")
    with pytest.raises(ValueError, match="different data split"):
        run_compare(tiny_model(), tiny_data(seed=1), trainer_kwargs=tiny_trainer(stop), seeds=[0], depths=[1],
                    output_dir=tmp_path)  # fmt: skip


def test_growth_that_scratch_cannot_rebuild_is_refused(tmp_path, no_training):
    # a factory whose deeper networks are wider: the grown network (width 4) and the scratch
    # network with the same stage sizes (width 6) would be different architectures
    def factory(**overrides):
        blocks = list(overrides.get("blocks", [1, 1, 1]))
        width = 4 if blocks == [1, 1, 1] else 6
        return ImageClassifier(width=width, in_channels=3, num_classes=4, **overrides)

    stop = TrainLossEarlyStopping(start_epoch=1, patience=1)
    with pytest.raises(ValueError, match="not be the same architecture"):
        run_compare(tiny_model(), tiny_data(), trainer_kwargs=tiny_trainer(stop), seeds=[0], depths=[1],
                    module_factory=factory, output_dir=tmp_path)  # fmt: skip


def test_no_stopping_rule_warns_that_nothing_converges(tmp_path):
    with pytest.warns(UserWarning, match="no growtrain.callbacks.TrainLossEarlyStopping"):
        result = run_compare(tiny_model(), tiny_data(), trainer_kwargs=tiny_trainer(None, max_epochs=1), seeds=[0],
                             depths=[1], insert_at="cyclic", compute_matched=False, output_dir=tmp_path)  # fmt: skip
    assert all(r["capped"] for r in result.runs)
