"""GrowUntilSaturated: a real grow-then-saturate fit, insertion safety, refusals, decisions.

Tiny models (width 4, 8×8 synthetic images, a few hundred samples), one CPU thread.
Whole file: about a minute on a loaded 2-core machine.
"""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from types import SimpleNamespace

import lightning as L
import pytest
import torch
from lightning.pytorch.loggers import CSVLogger
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

import growtrain.callbacks.probe_check as probe_check_module
from growtrain.callbacks import Converged, Rule, telemetry
from growtrain.callbacks.editor import insertion_order as _insertion_order
from growtrain.callbacks.growth import FunctionChangedError, GrowUntilSaturated
from growtrain.callbacks.probe_data import probe_overlap
from growtrain.saturation_report import rank_sites
from growtrain.data import ImageDataModule
from growtrain.families.generic import GrowableStack
from growtrain.growable import grown_blocks
from growtrain.module import GrowableModuleMixin, ImageClassifier
from growtrain.optim import param_groups
from growtrain.schedule_rules import decide_growth, plateau_update, should_check


def tiny_dm(**kw) -> ImageDataModule:
    args = dict(dataset="synthetic", image_size=8, synthetic_size=600, synthetic_classes=4, probe_size=200,
                val_size=50, batch_size=32, augment=False)  # fmt: skip
    return ImageDataModule(**(args | kw))


def tiny_trainer(tmp_path, callbacks, max_epochs=8, **kw) -> L.Trainer:
    args = dict(max_epochs=max_epochs, callbacks=callbacks, logger=False, enable_checkpointing=False,
                enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                default_root_dir=tmp_path, deterministic=True)  # fmt: skip
    return L.Trainer(**(args | kw))


class CountSteps(L.Callback):
    def __init__(self):
        self.steps = 0

    def on_train_batch_start(self, *args):
        self.steps += 1


# -- the real thing ------------------------------------------------------------------------
def test_grows_then_stops_at_saturation(tmp_path):
    """Paper rule, α = 0.05, a check every epoch, on learnable synthetic data: the untrained net starts
    far from a minimum (large probe gradients: grow), and a few epochs of training on 350
    separable images flatten it (saturated, stop). Each decision is checked against its own
    numbers recomputed from the per-site figures (Γ̂ = max ‖ĝ_l‖, t = sqrt(Σσ̂²_l/(nα)))
    rather than against values copied from one run (seed 0 gave Γ̂ 4.9 vs δ+t 1.4, then 0.3
    vs 1.2)."""
    L.seed_everything(0)
    dm, module = tiny_dm(), ImageClassifier(width=4, num_classes=4)
    depth0, params0 = module.network.depth(), sum(p.numel() for p in module.parameters())
    grow = GrowUntilSaturated(schedule="periodic", rule="paper", decision="rule", verbose=False)
    logger = CSVLogger(tmp_path, name="run")
    trainer = tiny_trainer(tmp_path, [grow], logger=logger, log_every_n_steps=1)
    trainer.fit(module, dm)

    actions = [h["action"] for h in grow.history]
    assert actions[0] == "grow" and actions[-1] == "saturated" and set(actions) <= {"grow", "saturated"}
    assert trainer.should_stop and trainer.current_epoch < 7  # stopped by saturation, not max_epochs
    last = grow.history[-1]
    for h in grow.history:  # the decision follows from the per-site figures (Proposition 1)
        scores = h["site_scores"]
        assert h["gamma"] == pytest.approx(max(s["grad_norm"] for s in scores), rel=1e-12)
        t = math.sqrt(sum(s["variance"] for s in scores) / (h["n"] * 0.05))
        assert h["threshold"] == pytest.approx(0.0 + t, rel=1e-9)
        assert (h["action"] == "grow") == (h["gamma"] > h["threshold"])
    # the paper's rule certifies no saturation (Γ̂ ≤ δ+t rules out Γ ≥ δ+2t only): "saturated" is the action
    assert last["action"] == "saturated" and not last["saturated"] and not last["certified"] and last["site"] is None
    grown = [h for h in grow.history if h["action"] == "grow"]
    assert module.network.depth() == depth0 + len(grown)
    assert [r["site"] for r in module.network.growth_log] == [h["site"] for h in grown]
    for h in grown:  # every insertion left the output unchanged, measured
        assert h["max_abs_change"] == 0.0  # fp32, eval: a zero-output insertion is bit-exact
        assert 0.0 < h["tolerance"] <= 1e-5 * 100
        assert h["params"] > h["params_before"] and h["depth"] == h["depth_before"] + 1
    assert last["params"] == sum(p.numel() for p in module.network.parameters()) > params0
    for h in grow.history:
        for key in ("epoch", "step", "site", "gamma", "threshold", "saturated", "params", "depth", "reason",
                    "error_bound", "lower", "level", "n"):  # fmt: skip
            assert key in h, key
        assert h["n"] == 200
    # the new groups are in the optimizer, named for resume
    names = [g.get("name") for g in trainer.optimizers[0].param_groups]
    assert names == ["base"] + [f"growth{k}" for k in range(len(grown))]

    # telemetry: JSON next to the logs, loggers got growth/*, state_dict is plain and complete
    saved = json.loads(Path(trainer.log_dir, "growth_history.json").read_text())
    assert saved == json.loads(json.dumps(grow.history))
    with open(Path(logger.log_dir, "metrics.csv")) as f:
        rows = list(csv.DictReader(f))
    logged = {k for row in rows for k, v in row.items() if v not in ("", None)}
    for key in ("growth/gamma", "growth/threshold", "growth/error_bound", "growth/depth", "growth/params",
                "growth/layer1.0/grad_norm", "growth/layer1.0/ag"):  # fmt: skip
        assert key in logged, key
    state = grow.state_dict()
    assert state["checks"] == len(grow.history) and state["growths"] == len(grown)
    assert state["finished"] == "saturated"
    json.dumps(state)  # plain data only


def test_table_printed_once_per_decision(tmp_path, monkeypatch):
    printed = []
    monkeypatch.setattr(telemetry, "rank_zero_info", printed.append)  # no RichProgressBar: logged
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", rule="paper", t=1e-9, max_growths=1, verbose=True)
    trainer = tiny_trainer(tmp_path, [grow], max_epochs=2)
    trainer.fit(ImageClassifier(width=4, num_classes=4), tiny_dm(synthetic_size=200, probe_size=40))
    tables = [m for m in printed if "growth check" in m]
    assert sum("GrowUntilSaturated: depth 3 → 4" in m for m in printed) == 1  # the end-of-fit summary
    assert len(tables) == len(grow.history) == 2
    assert "layer1.0" in tables[0] and "Γ̂" in tables[0] and "grow" in tables[0]
    assert "max_growths=1 reached" in tables[1]


def test_a_check_grows_one_block_at_the_best_site(tmp_path):
    """top_k was removed: a check that grows inserts exactly one block, at the site with the
    largest ‖ĝ‖ (the paper rule's Γ̂ = max_l ‖ĝ_l‖), recomputed here from the per-site figures."""
    L.seed_everything(0)
    module = ImageClassifier(width=4, num_classes=4, blocks=(2, 1, 1))
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", rule="paper", t=1e-9, max_growths=1, verbose=False)
    trainer = tiny_trainer(tmp_path, [grow], max_epochs=2)
    trainer.fit(module, tiny_dm(synthetic_size=200, probe_size=40))
    first = grow.history[0]
    scores = {s["site"]: s["grad_norm"] for s in first["site_scores"]}
    assert len(scores) == 5  # three insertion points in layer1, one after each later stage's block
    best = max(scores, key=scores.get)
    assert first["action"] == "grow" and first["sites"] == [best] == [first["site"]]
    assert first["max_abs_change"] == 0.0  # fp32, eval: bit-exact
    log = module.network.growth_log
    assert [r["site"] for r in log] == [best] and grow.history[1]["action"] == "budget"
    assert module.network.depth() == 5 and len(grown_blocks(module.network)) == 1
    names = [g.get("name") for g in trainer.optimizers[0].param_groups]
    assert names == ["base", "growth0"]


def test_continue_keeps_training_without_further_checks(tmp_path):
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", rule="paper", t=1e3, on_saturated="continue",
                              verbose=False)
    steps = CountSteps()
    trainer = tiny_trainer(tmp_path, [grow, steps], max_epochs=3)
    trainer.fit(ImageClassifier(width=4, num_classes=4), tiny_dm(synthetic_size=200, probe_size=40))
    assert [h["action"] for h in grow.history] == ["saturated"]
    assert trainer.current_epoch == 3 and not trainer.should_stop  # ran to max_epochs


def test_budget_ends_growth_but_not_training(tmp_path):
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", rule="paper", t=1e-9, max_growths=1, verbose=False)
    trainer = tiny_trainer(tmp_path, [grow], max_epochs=3)
    module = ImageClassifier(width=4, num_classes=4)
    trainer.fit(module, tiny_dm(synthetic_size=200, probe_size=40))
    assert [h["action"] for h in grow.history] == ["grow", "budget"]
    assert "max_growths=1 reached" in grow.history[1]["reason"] and grow.history[1]["gamma"] is None  # no probe spent
    assert module.network.depth() == 4 and trainer.current_epoch == 3


def test_function_change_is_rolled_back_with_a_clear_error(tmp_path, monkeypatch):
    """A candidate that changes the output (here: a hook adds 1) is removed again and fit fails."""
    real = probe_check_module.measure_saturation  # the check's probe pass (probe_check.py)

    def tampered(*args, **kwargs):
        report = real(*args, **kwargs)
        for r in report.sites:
            r.block.register_forward_hook(lambda m, i, out: out + 1.0)
        return report

    L.seed_everything(0)
    module = ImageClassifier(width=4, num_classes=4)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", rule="paper", t=1e-9, verbose=False)
    trainer = tiny_trainer(tmp_path, [grow], max_epochs=2)
    monkeypatch.setattr(probe_check_module, "measure_saturation", tampered)
    with pytest.raises(FunctionChangedError, match="insertion was undone"):
        trainer.fit(module, tiny_dm(synthetic_size=200, probe_size=40))
    net = module.network
    assert net.growth_log == [] and net._grown_blocks == [] and net.depth() == 3
    assert [len(net.stage(s)) for s in net.growable_stages] == [1, 1, 1]
    assert len(trainer.optimizers[0].param_groups) == 1


# -- a user's own LightningModule in a few lines ----------------------------------------------
class MLPBlock(nn.Module):
    def __init__(self, width=6):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, z):
        return z + self.fc2(torch.tanh(self.fc1(z)))


class UserModule(GrowableModuleMixin, L.LightningModule):
    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(4, 6)
        self.trunk = GrowableStack([MLPBlock()], factory=MLPBlock, terminal=("fc2.weight", "fc2.bias"))
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        return self.head(self.trunk(torch.tanh(self.inp(x))))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        # growth groups last (base, growth0, growth1, ...) so a resumed run lines up by position
        other = {"name": "other", "params": [*self.inp.parameters(), *self.head.parameters()]}
        return torch.optim.Adam([other] + param_groups(self.trunk), lr=1e-2)


def _blobs(n=240, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 3, (n,), generator=g)
    x = torch.randn(n, 4, generator=g) + 2 * F.one_hot(y, 4)[:, :4].float()
    return TensorDataset(x, y)


def test_users_own_module_with_probe_loader_and_loss(tmp_path):
    ds = _blobs()
    train = DataLoader(Subset(ds, range(0, 160)), batch_size=32, shuffle=True)
    probe = DataLoader(Subset(ds, range(160, 240)), batch_size=40)
    L.seed_everything(0)
    module = UserModule()
    grow = GrowUntilSaturated(schedule="periodic", probe=lambda: probe, network="trunk", loss_fn=F.cross_entropy,
                              decision="rule", rule="paper", t=1e-9, max_growths=1, verbose=False)  # fmt: skip
    trainer = tiny_trainer(tmp_path, [grow], max_epochs=2)
    trainer.fit(module, train)
    assert grow.history[0]["action"] == "grow" and len(module.trunk.blocks) == 2
    assert grow.history[0]["max_abs_change"] == 0.0  # fp32, eval: bit-exact
    (new,) = grown_blocks(module.trunk)
    groups = trainer.optimizers[0].param_groups
    assert [g["name"] for g in groups] == ["other", "base", "growth0"]
    assert {id(p) for p in groups[2]["params"]} == {id(p) for p in new.parameters()}


# -- refusals: before anything changes --------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, arg",
    [
        ({"delta": -0.1}, "delta"),
        ({"delta": float("nan")}, "delta"),
        ({"alpha": 0.0}, "alpha"),
        ({"alpha": 1.0}, "alpha"),
        ({"alpha": 1.5}, "alpha"),
        ({"t": -1.0}, "t"),
        ({"rule": "bonferroni"}, "rule"),
        ({"on_saturated": "halt"}, "on_saturated"),
        ({"lr_schedule": "reset"}, "lr_schedule"),
        ({"schedule": "sometimes"}, "schedule"),
        ({"max_growths": -1}, "max_growths"),
        ({"insertion": "stack"}, "insertion"),
        ({"decision": "guess"}, "decision"),
        ({"decision": Converged()}, "decision"),
        ({"network": 3}, "network"),
        ({"loss_fn": "ce"}, "loss_fn"),
    ],
)
def test_bad_arguments_raise_naming_argument_expected_given_fix(kwargs, arg):
    with pytest.raises(ValueError) as info:
        GrowUntilSaturated(**kwargs)
    msg = str(info.value)
    assert msg.startswith(f"{arg}:") and "expected" in msg and "got" in msg and "Fix:" in msg


def _assert_refused_before_training(tmp_path, module, fit_kwargs, grow, match, exc=ValueError):
    before = {k: v.clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}
    steps = CountSteps()
    trainer = tiny_trainer(tmp_path, [grow, steps], max_epochs=1)
    with pytest.raises(exc, match=match):
        trainer.fit(module, **fit_kwargs)
    assert steps.steps == 0
    after = module.state_dict()
    assert before.keys() == {k for k, v in after.items() if torch.is_tensor(v)} and all(torch.equal(before[k], after[k]) for k in before)


def test_no_probe_is_refused_in_setup(tmp_path):
    dm = tiny_dm(synthetic_size=200, probe_size=40)
    dm.setup("fit")
    # loaders, not the datamodule (it would supply the probe); a val loader as well, so that
    # Lightning does not warn that ImageClassifier's validation_step has none
    loaders = {"train_dataloaders": dm.train_dataloader(), "val_dataloaders": dm.val_dataloader()}
    _assert_refused_before_training(
        tmp_path, ImageClassifier(width=4, num_classes=4), loaders,
        GrowUntilSaturated(schedule="periodic", decision="trial", verbose=False), "probe: no probe data",
    )  # fmt: skip


def test_probe_overlapping_training_data_is_refused(tmp_path):
    ds = _blobs()
    train = DataLoader(Subset(ds, range(0, 160)), batch_size=32)
    probe = DataLoader(Subset(ds, range(150, 200)), batch_size=25)  # 10 samples shared
    grow = GrowUntilSaturated(schedule="periodic", decision="trial", probe=probe, verbose=False)
    _assert_refused_before_training(tmp_path, UserModule(), {"train_dataloaders": train}, grow, "overlaps the training")
    same = GrowUntilSaturated(schedule="periodic", decision="trial", probe=DataLoader(ds, batch_size=40), verbose=False)
    _assert_refused_before_training(tmp_path, UserModule(), {"train_dataloaders": DataLoader(ds)}, same, "same dataset")


def test_datamodule_with_overlapping_indices_is_refused(tmp_path):
    dm = tiny_dm(synthetic_size=200, probe_size=40)
    dm.setup("fit")
    dm._split = (dm._split[0], torch.cat([dm._split[1], dm._split[0][:3]]), dm._split[2])  # leak 3 train images
    _assert_refused_before_training(tmp_path, ImageClassifier(width=4, num_classes=4), {"datamodule": dm},
                                    GrowUntilSaturated(schedule="periodic", decision="trial", verbose=False), "share 3 sample")  # fmt: skip


def test_model_without_growable_network_is_refused(tmp_path):
    class Plain(L.LightningModule):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 3)

        def training_step(self, batch, batch_idx):
            return F.cross_entropy(self.fc(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    ds = _blobs()
    grow = GrowUntilSaturated(schedule="converged", probe=DataLoader(Subset(ds, range(200, 240))), verbose=False)
    _assert_refused_before_training(tmp_path, Plain(), {"train_dataloaders": DataLoader(Subset(ds, range(200)))},
                                    grow, "no growable submodule")  # fmt: skip
    bad_path = GrowUntilSaturated(schedule="converged", probe=DataLoader(Subset(ds, range(200, 240))), network="trunk", verbose=False)
    _assert_refused_before_training(tmp_path, Plain(), {"train_dataloaders": DataLoader(Subset(ds, range(200)))},
                                    bad_path, "has no submodule 'trunk'")  # fmt: skip


def test_unsupported_strategies_are_refused_in_setup():
    from lightning.pytorch.strategies import FSDPStrategy

    module = ImageClassifier(width=4, num_classes=4)
    spawn = L.Trainer(strategy="ddp_spawn", accelerator="cpu", devices=2, logger=False).strategy
    for strategy, match in ((FSDPStrategy(), "FSDPStrategy"), (spawn, "spawn/fork-based DDP")):
        trainer = SimpleNamespace(strategy=strategy, world_size=2, datamodule=None)
        with pytest.raises(RuntimeError, match=match):
            GrowUntilSaturated(schedule="periodic", decision="trial", verbose=False).setup(trainer, module, "fit")
    assert module.network.growth_log == []


def test_missing_monitor_metric_is_a_clear_error(tmp_path):
    grow = GrowUntilSaturated(schedule=Converged(monitor="val_los"), verbose=False)
    trainer = tiny_trainer(tmp_path, [grow], max_epochs=1)
    with pytest.raises(RuntimeError, match="monitor: metric 'val_los' is not logged"):
        trainer.fit(ImageClassifier(width=4, num_classes=4), tiny_dm(synthetic_size=200, probe_size=40))


# -- pure decision functions ------------------------------------------------------------------
def test_should_check_schedule_and_plateau():
    base = dict(finished=None, epochs_since_check=1, every_n_epochs=1, monitor=None, plateaued=False)
    assert should_check(**base) == (True, "every 1 epoch(s)")
    assert should_check(**(base | {"every_n_epochs": 2})) == (False, "next check in 1 epoch(s)")
    assert should_check(**(base | {"every_n_epochs": 2, "epochs_since_check": 2}))[0]
    assert not should_check(**(base | {"finished": "saturated"}))[0]
    assert not should_check(**(base | {"monitor": "train_loss"}))[0]
    ok, why = should_check(**(base | {"monitor": "train_loss", "plateaued": True}))
    assert ok and "plateau" in why


def test_crossfit_rule_tests_every_check_at_alpha(tmp_path, monkeypatch):
    """Cross-fit bound, δ = 0.1: the untrained net's lower bound clears δ (grow), training flattens
    it (saturated, stop). alpha_spending was removed: every check runs at α itself, split over the
    K sites scored then; each decision follows from its own site bounds."""
    import growtrain.crossfit as crossfit_module

    used = []  # the level each decision's lower bounds were computed at, where they are computed
    real_factor = crossfit_module._bound_factor

    def spy(level, m, bound):
        used.append(level)
        return real_factor(level, m, bound)

    monkeypatch.setattr(crossfit_module, "_bound_factor", spy)
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", rule="crossfit", delta=0.1, verbose=False)  # fmt: skip
    trainer = tiny_trainer(tmp_path, [grow])
    trainer.fit(ImageClassifier(width=4, num_classes=4), tiny_dm())
    actions = [h["action"] for h in grow.history]
    assert actions[0] == "grow" and actions[-1] == "saturated" and set(actions[:-1]) == {"grow"}
    assert len(actions) >= 2  # more than one check: the level stays α at each
    levels = [0.05] * len(actions)
    assert [h["level"] for h in grow.history] == pytest.approx(levels, rel=1e-15)
    # Bonferroni over the K sites scored at that check, inside the bound computation itself
    sites = [len(h["site_scores"]) for h in grow.history]
    assert used == pytest.approx([lv / k for lv, k in zip(levels, sites)], rel=1e-12)
    first = grow.history[0]
    for h in grow.history:
        assert h["lower"] == max(s["lower"] for s in h["site_scores"])
        assert (h["action"] == "grow") == (h["lower"] > 0.1)
    assert first["rule"] == "crossfit"
    # every check also forms σ̂², so the paper's Γ̂ against δ+t is reported beside the deciding rule
    assert "paper" in first["verdicts"] and first["threshold"] is not None and first["gamma"] is not None
    assert all(s["lower"] is not None for s in first["site_scores"])
    assert trainer.should_stop


def test_plateau_update_counts_epochs_without_improvement():
    best, wait, flat = plateau_update(1.0, None, 0, mode="min", min_delta=0.01, patience=2)
    assert (best, wait, flat) == (1.0, 0, False)
    best, wait, flat = plateau_update(0.995, best, wait, mode="min", min_delta=0.01, patience=2)  # < min_delta
    assert (best, wait, flat) == (1.0, 1, False)
    best, wait, flat = plateau_update(0.5, best, wait, mode="min", min_delta=0.01, patience=2)
    assert (best, wait, flat) == (0.5, 0, False)
    for _ in range(2):
        best, wait, flat = plateau_update(0.5, best, wait, mode="min", min_delta=0.01, patience=2)
    assert flat and wait == 2
    assert plateau_update(0.9, 0.5, 0, mode="max", min_delta=0.0, patience=1) == (0.9, 0, False)


def test_decide_growth_budgets_and_saturation():
    common = dict(growths=0, max_growths=None)
    assert decide_growth(saturated=True, ranked=[], **common)[0] == "saturated"
    assert decide_growth(saturated=False, ranked=[], **common)[0] == "saturated"  # no site ranked: nothing to grow
    action, why, sites = decide_growth(saturated=False, ranked=["b.1", "a.0"], **common)
    assert (action, sites) == ("grow", ["b.1", "a.0"]) and why.endswith("grow at b.1, a.0")
    action, why, sites = decide_growth(saturated=False, ranked=["b.1"], **(common | {"growths": 2, "max_growths": 2}))
    assert (action, sites) == ("budget", []) and why == "max_growths=2 reached (2 growth step(s) done)"
    assert decide_growth(saturated=False, ranked=["b.1"], **(common | {"growths": 1, "max_growths": 2}))[0] == "grow"


def test_rank_sites_crossfit_needs_each_site_certified():
    rec = lambda name, g, lower=None: SimpleNamespace(name=name, grad_norm=g, lower=lower)  # noqa: E731
    sites = [rec("a.0", 3.0, 0.5), rec("a.1", 2.0, -0.1), rec("b.1", 1.0, 0.2)]
    report = SimpleNamespace(saturated=False, best_site="a.0", rule="crossfit", delta=0.0, sites=sites)
    assert rank_sites(report, 3) == ["a.0", "b.1"]
    report.rule = "paper"
    assert rank_sites(report, 2) == ["a.0", "a.1"]
    report.saturated = True
    assert rank_sites(report, 3) == []


def test_insertion_order_keeps_indices_valid():
    assert _insertion_order(["layer1.0", "layer2.1", "layer1.2"]) == ["layer1.2", "layer1.0", "layer2.1"]


def test_probe_overlap_detection():
    ds = _blobs(40)
    assert probe_overlap(ds, ds) is not None
    assert probe_overlap(Subset(ds, range(10)), Subset(ds, range(10, 40))) is None
    assert "1 sample" in probe_overlap(Subset(ds, range(11)), Subset(ds, range(10, 40)))
    nested = Subset(Subset(ds, range(20, 40)), [0, 1])  # → samples 20, 21
    assert probe_overlap(nested, Subset(ds, range(0, 20))) is None
    assert probe_overlap(nested, Subset(ds, [21])) is not None
    assert probe_overlap(Subset(ds, range(5)), _blobs(40)) is None  # another storage: not detectable
    dm = tiny_dm(synthetic_size=200, probe_size=40)
    dm.setup("fit")
    assert probe_overlap(dm.probe_dataloader().dataset, dm.train_dataloader().dataset) is None
    assert math.isfinite(len(dm.probe_dataloader().dataset))


def test_the_depth_and_the_checks_figures_are_callback_metrics_a_checkpoint_can_monitor(tmp_path):
    """growth/depth from the first epoch on and each check's growth/* figures are in
    trainer.callback_metrics: a ModelCheckpoint monitoring growth/depth keeps the deepest network,
    and sees each epoch's depth as the growth record says it was (counted from the record)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Seen(L.Callback):
        def __init__(self):
            self.depths, self.gammas = [], {}

        def on_train_epoch_start(self, trainer, pl_module):
            self.depths.append(float(trainer.callback_metrics["growth/depth"]))

        def on_train_epoch_end(self, trainer, pl_module):  # after the growth callback's check
            if "growth/gamma" in trainer.callback_metrics:
                self.gammas[trainer.current_epoch] = float(trainer.callback_metrics["growth/gamma"])

    L.seed_everything(0)
    module = ImageClassifier(width=4, num_classes=4, blocks=(1, 1, 1))
    grow = GrowUntilSaturated(schedule="periodic", decision="rule", rule="paper", t=1e-9, max_growths=2, verbose=False)
    best = ModelCheckpoint(dirpath=tmp_path / "ck", monitor="growth/depth", mode="max", save_top_k=1,
                           filename="deepest-{growth/depth:.0f}", auto_insert_metric_name=False)  # fmt: skip
    seen = Seen()
    trainer = tiny_trainer(tmp_path, [grow, seen, best], max_epochs=4, enable_checkpointing=True)
    trainer.fit(module, tiny_dm(synthetic_size=200, probe_size=40))
    grew_at = [h["epoch"] for h in grow.history if h["action"] == "grow"]
    assert len(grew_at) == 2
    assert seen.depths == [3 + sum(e < epoch for e in grew_at) for epoch in range(4)]
    assert float(trainer.callback_metrics["growth/grew"]) == float(grow.history[-1]["action"] == "grow")
    # each check's Γ̂ at its epoch's end; a check that measured nothing (the budget) leaves none behind
    assert seen.gammas == pytest.approx({h["epoch"]: h["gamma"] for h in grow.history if h.get("gamma") is not None})
    assert grow.history[-1].get("gamma") is None and "growth/gamma" not in trainer.callback_metrics
    assert best.best_model_path.endswith("deepest-5.ckpt")


def test_two_callbacks_growing_two_networks_keep_two_states():
    """Lightning keys each callback's checkpoint state by its state_key: one per network grown,
    so neither overwrites the other (as two EarlyStoppings on two monitors)."""
    from lightning.pytorch.trainer import call

    enc, dec = GrowUntilSaturated(network="encoder", verbose=False), GrowUntilSaturated(schedule="converged", network="decoder", verbose=False)
    enc.checks, dec.checks = 3, 5
    trainer = L.Trainer(callbacks=[enc, dec], logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)  # fmt: skip
    states = call._call_callbacks_state_dict(trainer)
    assert len(states) == 2 and sorted(s["checks"] for s in states.values()) == [3, 5]
    assert all(k.startswith("GrowUntilSaturated") for k in states)
    enc2, dec2 = GrowUntilSaturated(network="encoder", verbose=False), GrowUntilSaturated(schedule="converged", network="decoder", verbose=False)
    enc2.load_state_dict(states[enc2.state_key]), dec2.load_state_dict(states[dec2.state_key])
    assert (enc2.checks, dec2.checks) == (3, 5)


class ScriptedVal(ImageClassifier):
    """val_loss = 1 / (epoch + 1): lower at every validation run."""

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", 1.0 / (self.current_epoch + 1), on_epoch=True)


@pytest.mark.parametrize("every", [1, 3])
def test_a_validation_loss_falling_at_every_run_never_plateaus(tmp_path, every):
    """Validation every 3 epochs: the epochs between keep the last run's value, which must not
    count as "no improvement" (patience 1 would then see a plateau at the first of them), and
    the epochs before the first run have no val_loss yet, which is waited for, not an error."""
    L.seed_everything(0)
    grow = GrowUntilSaturated(schedule=Converged(monitor="val_loss", patience=1, min_rel_delta=0.0, min_stage_epochs=1),
                              decision="rule", rule="paper", verbose=False)  # fmt: skip
    trainer = tiny_trainer(tmp_path, [grow], max_epochs=7, limit_val_batches=1, check_val_every_n_epoch=every,
                           num_sanity_val_steps=0)  # fmt: skip
    trainer.fit(ScriptedVal(width=4, num_classes=4), tiny_dm(synthetic_size=200, probe_size=40))
    assert grow.history == []  # never a plateau, so never a check
    runs = [e for e in range(7) if (e + 1) % every == 0]
    assert grow._monitor.best == pytest.approx(1.0 / (runs[-1] + 1)) and grow._monitor.wait == 0
    assert grow._monitor.stale == 7 - len(runs)


def test_the_checks_seconds_and_the_fits_survive_a_checkpoint():
    """The end-of-fit summary's share of the fit spent on checks counts the whole fit: a resumed
    callback starts from the seconds the checkpoint recorded, then adds its own."""
    grow = GrowUntilSaturated(schedule="converged", verbose=False)
    grow.probe_seconds, grow._decider.seconds = 2.0, 3.0
    state = grow.state_dict()
    assert state["seconds"] == {"checks": 5.0, "fit": 0.0}
    again = GrowUntilSaturated(schedule="converged", verbose=False)
    again.load_state_dict(state | {"seconds": {"checks": 5.0, "fit": 40.0}})
    again.probe_seconds = 1.5
    assert again.check_seconds == 6.5 and again.fit_seconds == 40.0
    again._fit_start = __import__("time").perf_counter() - 10.0
    assert 50.0 <= again.fit_seconds < 51.0


def test_a_validation_metric_whose_validation_never_runs_is_the_error_once_it_was_due(tmp_path):
    """validation_step but no validation data: Lightning skips validation; the monitor waits
    only until the first validation was due (every 2 epochs: epoch 1's end), then names the metric."""
    grow = GrowUntilSaturated(schedule=Converged(monitor="val_loss", patience=1, min_stage_epochs=1), decision="rule",
                              rule="paper", verbose=False)  # fmt: skip
    trainer = tiny_trainer(tmp_path, [grow], max_epochs=4, limit_val_batches=1, check_val_every_n_epoch=2,
                           num_sanity_val_steps=0)  # fmt: skip
    dm = tiny_dm(synthetic_size=200, probe_size=40)
    dm.val_dataloader = None  # no validation data
    with pytest.raises(RuntimeError, match="monitor: metric 'val_loss' is not logged") as info:
        trainer.fit(ScriptedVal(width=4, num_classes=4), dm)
    assert trainer.current_epoch == 1 and grow._monitor.stale == 1  # epoch 0 waited, epoch 1 was due


def test_a_probe_read_through_a_subset_sampler_is_refused_when_sharded():
    """Under DDP the probe is sharded by position over its whole dataset: a DataLoader that reads
    only part of it through its own sampler would have the rest scored too, so it is refused by
    name; a sequential loader shards into disjoint shards that cover the dataset once."""
    from torch.utils.data import DataLoader, SubsetRandomSampler, TensorDataset

    from growtrain.callbacks.probe_data import shard_loader

    data = TensorDataset(torch.arange(10.0), torch.arange(10))
    with pytest.raises(TypeError, match=r"^probe: with 2 processes.*SubsetRandomSampler.*Fix: make the probe samples"):
        shard_loader(DataLoader(data, batch_size=4, sampler=SubsetRandomSampler(range(5))), 0, 2)
    shards = [[int(i) for _, y in shard_loader(DataLoader(data, batch_size=4), r, 2) for i in y] for r in (0, 1)]
    assert shards == [[0, 2, 4, 6, 8], [1, 3, 5, 7, 9]]


# -- the options: kept once ------------------------------------------------------------------
@pytest.mark.parametrize("kw", [{"schedule": "converged"}, {"schedule": "periodic"}])
def test_delta_outside_the_rule_decision_warns_that_it_changes_the_report_only(kw):
    """Under decision="trial" and "stage_fork" delta moves only the reported first-order verdict
    (the sites are ranked by a lower bound it does not move): said at construction, with the fix;
    nothing said for decision="rule" or the default delta."""
    import warnings

    with pytest.warns(UserWarning, match=r"delta=0\.5 only changes the reported first-order verdict: under "
                      r"decision='(trial|stage_fork)'.*Fix: drop delta, or pass decision='rule'") as record:  # fmt: skip
        GrowUntilSaturated(delta=0.5, verbose=False, **kw)
    assert [w.filename for w in record] == [__file__]  # it points at the caller's line
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GrowUntilSaturated(delta=0.5, decision="rule", verbose=False, **kw)
        GrowUntilSaturated(verbose=False, **kw)
        GrowUntilSaturated(delta=0.0, verbose=False, **kw)


def test_the_options_are_kept_once_and_lr_schedule_is_resolved_in_one_place(tmp_path):
    """Every option lives in the frozen config and is read through it (no copy on the callback that
    could drift); setting one is refused naming it and the fix. The default lr_schedule=None is
    resolved at fit start into the schedule, which the callback reports, while the config keeps
    the option as given."""
    from growtrain.callbacks.growth_config import GrowthConfig

    grow = GrowUntilSaturated(schedule=Converged(patience=1, min_rel_delta=0.9, min_stage_epochs=1, anneal_epochs=1),
                              decision="rule", max_growths=0, verbose=False)  # fmt: skip
    names = GrowthConfig.names()
    assert not set(names) & set(vars(grow)) and "network_spec" not in vars(grow)  # no copy on the instance
    read = {n: getattr(grow, "network_spec" if n == "network" else n) for n in names}
    assert read == {n: getattr(grow.config, n) for n in names}
    with pytest.raises(AttributeError, match=r"^schedule: .*read-only.*Fix: build a new GrowUntilSaturated\(schedule="):
        grow.schedule = "periodic"
    with pytest.raises(AttributeError):  # a part is frozen too (dataclasses.FrozenInstanceError)
        grow.schedule.patience = 5
    assert grow.schedule.patience == 1 and grow.decision == Rule()
    with pytest.raises(AttributeError, match=r"^lr_schedule: .*Fix:"):
        grow.lr_schedule = "restart"
    with pytest.raises(AttributeError):
        grow.config = GrowthConfig()
    assert grow.lr_schedule is None  # resolved when the fit starts
    trainer = tiny_trainer(tmp_path, [grow], max_epochs=3)
    trainer.fit(ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.1)), tiny_dm())  # fmt: skip
    # reported = used (CheckSchedule.epoch_end anneals a stage by its own lr_schedule; test_periodic checks the rates)
    assert grow.lr_schedule == grow._schedule.lr_schedule == "anneal"
    assert grow.config.lr_schedule is None  # the option as given
