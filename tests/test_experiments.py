"""growtrain.experiments from Python: compare (table and continuous mode, resume), measure,
sweep, match, the scratch-architecture guarantee, compute counting and plots.

Tiny on purpose (two shared CPU cores): width-4 ResNets on 8×8 synthetic images, 1–2 epochs
of 2 batches, validation off. One table-mode compare run is shared by the measure and match
tests through its base checkpoint.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from lightning.pytorch.callbacks import EarlyStopping
from torch import nn

from growtrain.callbacks import ComputeMeter, forward_flops
from growtrain.data import ImageDataModule
from growtrain.experiments import run_compare, run_match, run_measure, run_sweep
from growtrain.experiments._training import BaseGrowTrainer, sibling_trainer
from growtrain.experiments.runs import (
    architecture,
    module_at_depth,
    module_with_stages,
    parse_depths,
    stage_sizes,
)
from growtrain.module import ImageClassifier
from growtrain.plots import plot_gamma_trace

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


def tiny_model(**kw) -> ImageClassifier:
    return ImageClassifier(width=4, in_channels=3, num_classes=4, **kw)


def tiny_data() -> ImageDataModule:
    return ImageDataModule(
        dataset="synthetic", image_size=8, channels=3, synthetic_size=160, synthetic_classes=4,
        probe_size=32, val_size=16, batch_size=16,
    )  # fmt: skip


# These tiny trainers have no TrainLossEarlyStopping: compare says every arm is capped (expected
# with pytest.warns, not filtered: the suite keeps growtrain's own warnings visible).
CAPPED = "no growtrain.callbacks.TrainLossEarlyStopping among the trainer callbacks"


def tiny_trainer(**kw) -> dict:
    settings = dict(
        max_epochs=1, limit_train_batches=2, limit_val_batches=0, limit_test_batches=1, num_sanity_val_steps=0,
        enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, accelerator="cpu",
        devices=1, logger=False, log_every_n_steps=1,  # 2 batches an epoch: Lightning warns below its interval
    )  # fmt: skip
    settings.update(kw)
    return settings


@pytest.fixture
def count_fits(monkeypatch):
    # sibling trainings run on BaseGrowTrainer, the base class of GrowTrainer
    calls = []
    original = BaseGrowTrainer.fit

    def counting(self, *args, **kwargs):
        calls.append(self.default_root_dir)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(BaseGrowTrainer, "fit", counting)
    return calls


@pytest.fixture(scope="module")
def table_run(tmp_path_factory):
    """compare in table mode, depth 1 (added=1), one seed, with the matched arm."""
    out = tmp_path_factory.mktemp("compare_table")
    with pytest.warns(UserWarning, match=CAPPED):
        result = run_compare(tiny_model(), tiny_data(), trainer_kwargs=tiny_trainer(), seeds=[0], depths=[1],
                             output_dir=out)  # fmt: skip
    return result, out


# -- the scratch architecture ----------------------------------------------------------------------
def test_scratch_has_the_grown_architecture_and_fresh_weights():
    torch.manual_seed(0)
    model = tiny_model()
    grown = module_at_depth(model, 0)
    for site in ("layer1.0", "layer3.1", "layer3.2"):  # not what the cyclic rule would build
        grown.network.grow(site)
    torch.manual_seed(1)
    scratch = module_with_stages(model, stage_sizes(grown.network))
    assert stage_sizes(scratch.network) == {"layer1": 2, "layer2": 1, "layer3": 3}
    assert architecture(scratch) == architecture(grown)
    assert sum(p.numel() for p in scratch.parameters()) == sum(p.numel() for p in grown.parameters())
    assert scratch.network.growth_log == []  # every block from the constructor, none zero-initialised
    grown_state = grown.state_dict()
    for name, p in scratch.named_parameters():
        if p.dim() > 1:  # conv/linear weights: random at construction
            assert not torch.equal(p, grown_state[name]), name
    for block in scratch.network.layer3:  # 'basic' family: the constructor's bn2 is (1, 0), not zero
        assert torch.all(block.bn2.weight == 1)


def test_scratch_of_a_single_stage_network_sets_its_depth_hyperparameter():
    from growtrain.lm import LanguageModel

    lm = LanguageModel(n_layer=1, d_model=8, n_head=2, block_size=8, vocab_size=16)
    lm.network.grow("h.1")
    scratch = module_with_stages(lm, stage_sizes(lm.network))
    assert scratch.hparams.n_layer == 2
    assert architecture(scratch) == architecture(lm)


def test_rebuild_refuses_a_module_built_around_a_foreign_network(tmp_path):
    from growtrain.models import cifar_resnet

    model = ImageClassifier(cifar_resnet(width=4, num_classes=4, blocks=(2, 1, 1)), num_classes=4)
    with pytest.raises(ValueError, match="module_factory"):
        run_compare(model, tiny_data(), trainer_kwargs=tiny_trainer(), seeds=[0], depths=[1], output_dir=tmp_path)


# -- compare -----------------------------------------------------------------------------------------
def test_compare_table_mode_fills_both_arms_and_writes_files(table_run):
    result, out = table_run
    (row,) = result.summary
    for arm in ("scratch", "growth", "matched"):
        for metric in ("train_loss", "test_loss", "test_acc", "flops", "epochs"):
            assert row[f"{arm}_{metric}"] is not None, (arm, metric)
    runs = {r["arm"]: r for r in result.runs}
    assert set(runs) == {"base", "growth", "scratch", "matched"}
    assert runs["base"]["blocks"] == 3 and runs["growth"]["blocks"] == 4
    assert runs["growth"]["arch"] == runs["scratch"]["arch"] == runs["matched"]["arch"]
    assert runs["growth"]["params"] == runs["scratch"]["params"]
    assert runs["growth"]["insertion"]["rule"] == "best"
    assert runs["growth"]["growth_log"] and not runs["scratch"]["growth_log"]
    # growth compute includes its base; the matched arm got that FLOPs budget in steps
    assert row["growth_flops"] == pytest.approx(runs["base"]["flops"] + runs["growth"]["flops"])
    per_step = runs["scratch"]["flops"] / runs["scratch"]["steps"]
    assert runs["matched"]["steps"] == runs["matched"]["budget_steps"] >= row["growth_flops"] / per_step - 1e-6
    md = (out / "compare.md").read_text()
    assert "Train loss Scratch" in md and "Test loss Growth" in md and "Test loss Matched" in md
    assert "added=1" in (out / "compare.csv").read_text()
    saved = json.loads((out / "compare.json").read_text())
    assert len(saved["runs"]) == 4 and saved["summary"][0]["growth_test_loss"] == row["growth_test_loss"]


def test_compare_resumes_without_redoing_finished_rows(tmp_path, count_fits):
    kwargs = dict(trainer_kwargs=tiny_trainer(), seeds=[0], compute_matched=False, output_dir=tmp_path)
    with pytest.warns(UserWarning, match=CAPPED):
        run_compare(tiny_model(), tiny_data(), depths=[1], **kwargs)
    assert len(count_fits) == 3  # base (added=0), growth, scratch
    first = (tmp_path / "runs.jsonl").read_text().splitlines()
    # "killed" after the first row: rerun with the full list
    with pytest.warns(UserWarning, match=CAPPED):
        result = run_compare(tiny_model(), tiny_data(), depths=[1, 2], **kwargs)
    # only depth 2's base (unless depth 1's scratch arm already is that network), growth, scratch
    scratch_d1 = next(r for r in result.runs if r["arm"] == "scratch" and r["depth"] == 1)
    shared = scratch_d1["stages"] == {"layer1": 2, "layer2": 1, "layer3": 1}  # depth 2's base (added=1)
    fits = 6 - shared
    assert len(count_fits) == fits
    lines = (tmp_path / "runs.jsonl").read_text().splitlines()
    assert lines[:3] == first and len(lines) == fits
    keys = [json.loads(line)["key"] for line in lines]
    assert len(set(keys)) == fits
    assert [r["depth"] for r in result.summary] == [1, 2]
    # nothing left to do: no training at all
    with pytest.warns(UserWarning, match=CAPPED):
        run_compare(tiny_model(), tiny_data(), depths=[1, 2], **kwargs)
    assert len(count_fits) == fits
    # a different configuration must not be mixed into these results
    with pytest.raises(ValueError, match="different configuration"), pytest.warns(UserWarning, match=CAPPED):
        run_compare(tiny_model(family="preact"), tiny_data(), depths=[1], **kwargs)


def test_compare_continuous_mode_grows_then_trains_the_same_architecture(tmp_path):
    from growtrain.callbacks import GrowUntilSaturated

    grow = GrowUntilSaturated(schedule="periodic", t=1e-6, max_growths=1, on_saturated="continue", decision="rule",
                              verbose=False)  # t tiny: always grows
    with pytest.warns(UserWarning, match=CAPPED):
        result = run_compare(
            tiny_model(), tiny_data(), trainer_kwargs=tiny_trainer(max_epochs=2, callbacks=[grow], logger=True),
            seeds=[0], compute_matched=False, output_dir=tmp_path,
        )  # fmt: skip
    runs = {r["arm"]: r for r in result.runs}
    assert len(runs["growth"]["growth_log"]) == 1 and runs["growth"]["blocks"] == 4
    assert runs["growth"]["history"] and runs["growth"]["history"][0]["action"] == "grow"
    assert runs["scratch"]["arch"] == runs["growth"]["arch"] and runs["scratch"]["growth_log"] == []
    assert grow.history == []  # the configured callback is a template: runs use copies
    assert (tmp_path / "auto_s0_growth" / "gamma_trace.png").stat().st_size > 0
    assert (tmp_path / "auto_s0_growth" / "growth_history.json").exists()


# -- measure, match, sweep ------------------------------------------------------------------------------
def test_measure_reports_every_site_of_a_checkpoint(table_run, tmp_path):
    _, out = table_run
    ckpt = out / "checkpoints" / "scratch_1-1-1_s0.ckpt"  # the base of depth 1 (added=0)
    model = tiny_model()
    result = run_measure(model, tiny_data(), ckpt_path=str(ckpt), output_dir=tmp_path)
    saved = json.loads((tmp_path / "measure.json").read_text())
    assert [s["site"] for s in saved["sites"]] == [s.name for s in model.network.sites()]
    for site in saved["sites"]:
        assert site["grad_norm"] >= 0 and site["projected"] is not None and site["ag"] > 0
        assert site["ag_coordinate"] == pytest.approx(site["ag"] / site["dim"] ** 0.5)
        assert 0 <= site["realisability"] <= 1 + 1e-6
    assert {"gamma", "threshold", "error_bound", "saturated"} <= set(saved)
    assert saved["threshold"] == pytest.approx(saved["delta"] + saved["t"])
    assert "AG/√N" in (tmp_path / "measure.md").read_text()
    assert result.report.n == 32
    trained = torch.load(ckpt, weights_only=True)["state_dict"]
    assert torch.equal(model.state_dict()["network.fc.weight"], trained["network.fc.weight"])


def test_match_lowers_the_training_loss_without_training(table_run, tmp_path):
    _, out = table_run
    result = run_match(
        tiny_model(), tiny_data(), ckpt_path=str(out / "checkpoints" / "scratch_1-1-1_s0.ckpt"), alpha=1e-2, seeds=[0, 1],
        steps=30, samples=64, output_dir=tmp_path,
    )  # fmt: skip
    assert len(result.runs) == 2
    for run in result.runs:
        assert run["samples"] == 64
        assert 0 < run["match_error"] < 1  # the fit moved towards −αq
        assert run["objective_end"] < run["objective_start"]
        assert run["predicted_gain"] > 0 and run["hidden_change"] > 0
        assert run["gain_train"] > 0  # the first-order prediction on the fitted sample (Table 7's sign)
    saved = json.loads((tmp_path / "match.json").read_text())
    assert saved["summary"]["gain_train"] == pytest.approx(sum(r["gain_train"] for r in result.runs) / 2)
    assert "Δ_train" in (tmp_path / "match.md").read_text()


def test_sweep_trains_each_depth_and_plots(tmp_path, count_fits):
    history = tmp_path / "growth_history.json"
    history.write_text(json.dumps([{"depth": 3, "action": "grow"}, {"depth": 4, "action": "saturated"}]))
    kwargs = dict(trainer_kwargs=tiny_trainer(), depths="0..1", growth_history=str(history), output_dir=tmp_path / "sweep")
    result = run_sweep(tiny_model(), tiny_data(), **kwargs)
    assert [r["depth"] for r in result.rows] == [0, 1] and [r["blocks"] for r in result.rows] == [3, 4]
    assert result.stop_depth == 1  # 4 blocks = ResNet-8 backbone + added=1
    for row in result.rows:
        assert row["ag_max"] > 0 and row["gamma"] > 0 and row["test_loss"] > 0 and row["train_loss"] > 0
    assert (tmp_path / "sweep" / "sweep.png").stat().st_size > 0
    assert len(count_fits) == 2
    run_sweep(tiny_model(), tiny_data(), **kwargs)  # resumed: nothing retrained
    assert len(count_fits) == 2


# -- pieces ----------------------------------------------------------------------------------------
def test_forward_flops_and_compute_meter_count_three_forwards_per_sample():
    model = nn.Linear(10, 5, bias=False)
    assert forward_flops(model, torch.zeros(7, 10)) == 2 * 10 * 5
    meter = ComputeMeter()
    meter.on_train_batch_end(None, model, None, (torch.zeros(7, 10), torch.zeros(7)), 0)
    assert (meter.samples, meter.steps, meter.flops) == (7, 1, 3 * 100 * 7)


def test_sibling_trainers_copy_callbacks_and_apply_overrides(tmp_path):
    stop = EarlyStopping(monitor="train_loss")
    trainer = sibling_trainer({"max_epochs": 3, "callbacks": [stop], "logger": False}, tmp_path, max_steps=5)
    copies = [cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping)]
    assert len(copies) == 1 and copies[0] is not stop
    assert trainer.max_steps == 5 and trainer.max_epochs == 3 and trainer.default_root_dir == str(tmp_path)
    assert trainer.init_kwargs["max_steps"] == 5
    dropped = sibling_trainer({"callbacks": [stop]}, tmp_path, keep=lambda cb: False)
    assert not any(isinstance(cb, EarlyStopping) for cb in dropped.callbacks)


def test_parse_depths():
    assert parse_depths("0..3") == [0, 1, 2, 3]
    assert parse_depths("1..7..3") == [1, 4, 7]
    assert parse_depths("2,5") == [2, 5] and parse_depths([4, 1]) == [4, 1]
    for bad in ("a..b", "3..1..0", "", [-1]):
        with pytest.raises(ValueError, match="depths"):
            parse_depths(bad)


def test_plot_gamma_trace_writes_a_png(tmp_path):
    history = [
        {"step": 4, "gamma": 0.2, "threshold": 0.1, "action": "grow", "site": "layer1.0", "sites": ["layer1.0"]},
        {"step": 8, "gamma": 0.05, "threshold": 0.1, "action": "saturated", "site": None, "sites": []},
        {"step": 8, "gamma": None, "threshold": None, "action": "budget", "site": None, "sites": []},
    ]
    path = tmp_path / "trace.png"
    plot_gamma_trace(history, path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    with pytest.raises(ValueError, match="history"):
        plot_gamma_trace([], tmp_path / "none.png")

