"""Table 1 on the stopping sweep's own networks (growtrain.experiments.sweep_table)."""

from __future__ import annotations

import csv
import json
import math

import lightning as L
import pytest
import torch

from growtrain.callbacks import Converged, GrowUntilSaturated
from growtrain.data import ImageDataModule
from growtrain.experiments.stopping import run_stopping
from growtrain.experiments.sweep_table import BudgetAnneal, weights_digest
from growtrain.module import ImageClassifier


def tiny_dm() -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=200, synthetic_classes=4, probe_size=40,
                           val_size=40, batch_size=32, augment=False)  # fmt: skip


def tiny_model(**kw) -> ImageClassifier:
    return ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic",
                           optimizer=lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9), **kw)  # fmt: skip


def kwargs() -> dict:
    grow = GrowUntilSaturated(schedule=Converged(monitor="val_loss", patience=1, min_rel_delta=0.2, min_stage_epochs=1,
                                                 anneal_epochs=2),
                              max_growths=0, lr_schedule="anneal", on_saturated="anneal", verbose=False)  # fmt: skip
    return dict(max_epochs=8, callbacks=[grow], log_every_n_steps=1, enable_progress_bar=False, enable_model_summary=False,
                num_sanity_val_steps=0)  # fmt: skip


def test_budget_anneal_is_the_stopping_rules_anneal_on_the_budgets_last_epochs():
    """23 steps of 5 per epoch: 5 epochs, the last 2 annealed by ½(1 + cos(π(k+1)/3)):
    cos(π/3) = ½ → 0.75, cos(2π/3) = −½ → 0.25 (by hand)."""
    schedule = BudgetAnneal(total_steps=23, steps_per_epoch=5, anneal_epochs=2)
    assert [schedule.factor(e) for e in range(5)] == pytest.approx([1, 1, 1, 0.75, 0.25])
    with pytest.raises(ValueError, match="total_steps"):
        BudgetAnneal(total_steps=0, steps_per_epoch=5, anneal_epochs=2)


def test_table_rows_need_the_sweeps_networks_before_any_training(tmp_path):
    with pytest.raises(ValueError, match=r"table: .*lacks \[2\].*--depths=0\.\.2"):
        run_stopping(tiny_model(), tiny_dm(), trainer_kwargs=kwargs(), depths=[0, 1], seeds=[0], table=[1, 2],
                     skip_growth=True, output_dir=tmp_path)  # fmt: skip
    assert not (tmp_path / "runs.jsonl").exists()


def _first_epoch_train_loss(directory) -> float:
    rows = [r for r in csv.DictReader(open(directory / "metrics.csv")) if r.get("train_loss")]
    return float(rows[0]["train_loss"])


def test_table_on_the_sweep(tmp_path):
    L.seed_everything(0)
    result = run_stopping(tiny_model(), tiny_dm(), trainer_kwargs=kwargs(), depths=[0, 1], seeds=[0], table=[1],
                          skip_growth=True, output_dir=tmp_path, table_controls=True)  # fmt: skip
    rows = {json.loads(line)["key"]: json.loads(line) for line in open(tmp_path / "runs.jsonl")}
    base, scratch = rows["scratch/added=0/seed=0"], rows["scratch/added=1/seed=0"]
    growth, matched = rows["table/growth/added=1/seed=0"], rows["table/matched/added=1/seed=0"]
    equal = rows["table/equal/added=1/seed=0"]
    # the sweep's networks are used, not retrained: one training per depth, re-measured from their checkpoints
    assert sum(k.startswith("scratch/") for k in rows) == 2
    assert rows["table/eval/added=0/seed=0"]["test"]["loss"] == pytest.approx(base["test_loss"], abs=1e-6)
    # growth = the converged base + one block where the cyclic rule puts it (added=1: end of layer1)
    assert growth["insertion"]["site"] == "layer1.1"
    assert growth["arch"] == rows["table/eval/added=1/seed=0"]["arch"]
    # ... and it starts from the base: its first epoch trains an already fitted network
    start = _first_epoch_train_loss(tmp_path / "table_growth_added1_seed0")
    assert start < 0.75 * _first_epoch_train_loss(tmp_path / "scratch_added1_seed0")
    assert growth["stopped"] == "budget" and "max_growths=0" in growth["stop_reason"]  # the sweep's rule ended it
    # matched: scratch's initialisation (seed 0, added=1, built independently here), growth's FLOPs incl. its base
    L.seed_everything(0, workers=True)
    assert matched["init_digest"] == weights_digest(tiny_model(added=1))
    per_step = growth["flops"] / growth["steps"]
    assert abs(matched["flops"] - (base["flops"] + growth["flops"])) <= per_step / 2 + 1e-6
    # its schedule: the constant 0.05, then the rule's 2-epoch anneal (0.75, 0.25 by hand) on the budget's last epochs
    assert matched["lrs"] == pytest.approx([0.05] * (len(matched["lrs"]) - 2) + [0.0375, 0.0125])
    assert len(matched["lrs"]) == math.ceil(matched["budget_steps"] / 3)  # 120 training images / 32: 3 steps an epoch
    # equal training loss: the larger final train loss is the target; both entries are at or below it
    assert equal["target"] == pytest.approx(max(growth["train"]["loss"], rows["table/eval/added=1/seed=0"]["train"]["loss"]))
    for arm in ("growth", "scratch"):
        if equal[arm]["train"] is not None:
            assert equal[arm]["train"]["loss"] <= equal["target"] + 1e-7
    # the table: one row, growth's compute includes its base
    row = result.table1.summary[0]
    assert row["growth_flops"] == pytest.approx(base["flops"] + growth["flops"])
    assert row["diff_test_loss"]["mean"] == pytest.approx(growth["test"]["loss"] - scratch["test_loss"], abs=1e-6)
    assert (tmp_path / "table1.md").read_text().count("ResNet-8 + 1") == 3  # Table 1, its second part, the block value
    # the control: the base retrained without a block (its architecture, from its weights); the block's own value
    control = rows["table/control/added=0/seed=0"]
    assert control["blocks"] == 3 and control["params"] == base["params"]
    assert _first_epoch_train_loss(tmp_path / "table_control_added0_seed0") < 0.75 * _first_epoch_train_loss(
        tmp_path / "scratch_added0_seed0")
    assert row["gain_block"]["mean"] == pytest.approx(control["test"]["loss"] - growth["test"]["loss"], abs=1e-9)
    assert row["gain_growth"]["mean"] == pytest.approx(base["test_loss"] - growth["test"]["loss"], abs=1e-6)
    assert "the block's own" in (tmp_path / "table1.md").read_text()
    # a rerun trains nothing
    again = run_stopping(tiny_model(), tiny_dm(), trainer_kwargs=kwargs(), depths=[0, 1], seeds=[0], table=[1],
                         skip_growth=True, output_dir=tmp_path)  # fmt: skip
    assert again.table1.summary[0]["growth_wall_s"] == row["growth_wall_s"]
    # a checkpoint that is not the row's network is refused
    path = base["checkpoint"]
    checkpoint = torch.load(path, weights_only=True)
    name = next(k for k in checkpoint["state_dict"] if k.endswith("conv1.weight"))
    checkpoint["state_dict"][name] = checkpoint["state_dict"][name] * 1.5
    torch.save(checkpoint, path)
    lines = [line for line in open(tmp_path / "runs.jsonl") if not json.loads(line)["key"].startswith("table/")]
    (tmp_path / "runs.jsonl").write_text("".join(lines))
    with pytest.raises(RuntimeError, match="is not the network of sweep row"):
        run_stopping(tiny_model(), tiny_dm(), trainer_kwargs=kwargs(), depths=[0, 1], seeds=[0], table=[1],
                     skip_growth=True, output_dir=tmp_path, train=False)  # fmt: skip
    assert math.isfinite(start)
