"""The paired, one-sided gain certificate (growtrain.gain) on the probe's per-sample losses, and the
callback's use of it with min_gain: the periodic schedule's window rule pairs every check's losses
with those of a check a window back (the block-only trial's own use: tests/test_trial.py)."""

from __future__ import annotations

import math
import statistics

import lightning as L
import pytest
import torch
from torch.nn import functional as F


from growtrain.gain import GAIN_METHODS, gain_test
from growtrain.saturation_report import best_scored_site
from growtrain.callbacks import GrowUntilSaturated
from growtrain.callbacks.probe_data import ProbeView, per_sample_losses, refuse_random_probe
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier

Z95 = 1.6448536269514722  # the standard normal's 0.95 quantile


def test_gain_test_matches_a_hand_computation():
    """The normal bound by hand (statistics module), the bootstrap-t bound by hand (explicit loops
    over the same resample indices, a sorted list's quantile), the margin inside the terms."""
    before = torch.tensor([0.9, 0.5, 1.2, 0.3, 0.8, 0.6, 2.5, 0.05])
    after = torch.tensor([0.7, 0.45, 1.0, 0.35, 0.6, 0.5, 0.4, 0.06])
    g, n = 0.02, 8
    e = [(1 - g) * float(b) - float(a) for b, a in zip(before.double(), after.double())]
    d = [float(b) - float(a) for b, a in zip(before.double(), after.double())]
    se_e = statistics.stdev(e) / math.sqrt(n)
    margin = g * statistics.fmean(before.double().tolist())
    normal = gain_test(before, after, min_gain=g, level=0.05, method="normal")
    assert normal["mean"] == pytest.approx(statistics.fmean(d)) and normal["n"] == n
    assert normal["se"] == pytest.approx(statistics.stdev(d) / math.sqrt(n))
    assert normal["margin"] == pytest.approx(margin)
    assert normal["lower"] - normal["margin"] == pytest.approx(statistics.fmean(e) - Z95 * se_e)
    # bootstrap-t by hand, with the resample indices the product draws for seed 7
    gen = torch.Generator().manual_seed(7)
    idx = torch.randint(n, (2000, n), generator=gen).tolist()
    t_star = []
    for row in idx:
        sample = [e[i] for i in row]
        sd = statistics.stdev(sample) / math.sqrt(n)
        t_star.append((statistics.fmean(sample) - statistics.fmean(e)) / sd if sd > 0 else
                      (math.inf if statistics.fmean(sample) > statistics.fmean(e) else 0.0))
    q = sorted(t_star)[math.ceil(0.95 * (len(t_star) - 1))]
    boot = gain_test(before, after, min_gain=g, level=0.05, seed=7)
    assert boot["method"] == "bootstrap_t"
    assert boot["lower"] - boot["margin"] == pytest.approx(statistics.fmean(e) - q * se_e, rel=1e-9)
    assert boot["paid"] == (statistics.fmean(e) - q * se_e > 0)


def test_paid_needs_the_bound_strictly_above_the_margin():
    """Losses unchanged and min_gain = 0: the bound equals the margin (0 = 0) — not paid."""
    same = torch.tensor([0.3, 0.7, 1.1, 0.2])
    for method in GAIN_METHODS:
        out = gain_test(same, same.clone(), min_gain=0.0, level=0.05, method=method)
        assert out["lower"] == out["margin"] == 0.0 and out["paid"] is False


def test_gain_refuses_unpaired_vectors():
    with pytest.raises(ValueError, match=r"gain: expected two 1-d per-sample loss vectors of one length.*Fix"):
        gain_test(torch.ones(5), torch.ones(6), min_gain=0.0, level=0.05)


def tiny_dm() -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                           val_size=40, batch_size=32, augment=False)  # fmt: skip


def test_per_sample_losses_equal_unreduced_cross_entropy_in_eval_mode():
    L.seed_everything(0)
    dm = tiny_dm()
    dm.setup("fit")
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic").train()
    got = per_sample_losses(ProbeView(model, model.network), dm.probe_dataloader(), F.cross_entropy, torch.device("cpu"))
    assert model.training  # mode restored
    model.eval()
    with torch.no_grad():
        want = torch.cat([F.cross_entropy(model(x), y, reduction="none") for x, y in dm.probe_dataloader()])
    assert got.dtype == torch.float64 and got.shape == (120,)
    torch.testing.assert_close(got.float(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, "1%", True])
def test_bad_min_gain_is_refused_at_construction(value):
    with pytest.raises(ValueError, match=r"min_gain: expected None or a finite number >= 0.*Fix: pass min_gain=0.01"):
        GrowUntilSaturated(min_gain=value)


class ProbeLosses(L.Callback):
    """Before the grower (hooks run in list order): every epoch's per-sample probe losses,
    computed independently (unreduced cross-entropy in eval mode, not the product's pass)."""

    def __init__(self):
        self.by_epoch: dict[int, torch.Tensor] = {}

    def on_train_epoch_end(self, trainer, pl_module):
        was = pl_module.training
        pl_module.eval()
        with torch.no_grad():
            self.by_epoch[trainer.current_epoch] = torch.cat(
                [F.cross_entropy(pl_module(x), y, reduction="none") for x, y in trainer.datamodule.probe_dataloader()]
            ).double()
        pl_module.train(was)


def _fit(tmp_path, min_gain=0.0, extra=(), max_epochs=8, **kw):
    """A periodic fit (a check every epoch, the window rule over 2 epochs, at the constant rate): until
    growth ends every check with a full window grows at its best first-order site, so the window pairs
    checks of networks of different depth."""
    L.seed_everything(0)
    kw = {"every_n_epochs": 1, "window": 2, "max_growths": 4} | kw
    grow = GrowUntilSaturated(schedule="periodic", monitor=None, min_gain=min_gain, on_saturated="stop", verbose=False,
                              **kw)  # fmt: skip
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=[*extra, grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, deterministic=True)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic",
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4))  # fmt: skip
    trainer.fit(model, tiny_dm())
    grow.model = model
    return grow


def test_every_window_verdict_pairs_the_losses_of_its_reference_check_by_hand(tmp_path):
    """Each full window's figures equal window_test on the per-sample probe losses computed
    independently at the reference check's epoch and at this check's (not the previous check's,
    not the first one's), with the bootstrap seeded by the check index; a window not full yet
    carries no figures and waits (grows nothing)."""
    from growtrain.window import window_test

    watch = ProbeLosses()
    grow = _fit(tmp_path, extra=[watch])
    checks = [h for h in grow.history if "window" in h]
    full = [h for h in checks if h["window"]["reference_epoch"] is not None]
    assert len(full) >= 2, [(h["action"], h["window"]["reference_epoch"]) for h in checks]
    assert all("gain_frac" not in c["window"] and c["action"] == "wait" and not c["sites"] for c in checks[:2])
    for h in full:
        ref = h["window"]["reference_epoch"]
        assert ref == max(c["epoch"] for c in checks if c["epoch"] <= h["epoch"] - 2)  # the latest a window back
        before, after = watch.by_epoch[ref], watch.by_epoch[h["epoch"]]
        want = window_test(before, after, min_gain=0.0, level=h["level"], seed=h["check"])  # seed 0 · 1000 + check
        got = h["window"]
        assert got["loss_before"] == pytest.approx(float(before.mean()), rel=1e-5)
        assert got["loss_now"] == pytest.approx(float(after.mean()), rel=1e-5)
        for key in ("gain_frac", "lower_frac", "upper_frac"):
            assert got[key] == pytest.approx(want[key], rel=1e-3, abs=1e-6), key
        assert got["saturated"] == (want["lower_frac"] <= 0.0) and got["n"] == 120
        assert (h["action"] == "grow") == (not got["saturated"])
    assert any(h["depth_before"] != grow.history[0]["depth_before"] for h in full)  # it paired networks that grew


def test_the_window_losses_survive_a_checkpoint_in_order(tmp_path):
    """Through a real checkpoint file (torch.save / load with weights_only=True): the kept per-sample
    losses and fingerprints come back equal, element by element, in their order."""
    grow = _fit(tmp_path, max_epochs=3)
    state = grow.state_dict()
    entries = state["window"]["entries"]
    assert entries and all(len(e["losses"]) == len(e["signature"]) == 120 for e in entries)
    assert len(set(entries[-1]["losses"])) > 100  # non-constant
    torch.save({"callbacks": {"grow": state}}, tmp_path / "state.ckpt")
    loaded = torch.load(tmp_path / "state.ckpt", weights_only=True)["callbacks"]["grow"]
    again = GrowUntilSaturated(schedule="periodic", every_n_epochs=1, window=2, min_gain=0.0)
    again.load_state_dict(loaded)
    assert again._window.entries == grow._window.entries == entries


def test_stopping_figure_draws_every_seeds_certified_gain(tmp_path):
    """Rows of an earlier version's decision="gain" (their stopping.json stays readable): each seed's
    certified gain of its last block, with the min_gain line."""
    from growtrain.plots import plot_stopping

    def check(blocks, lower, loss):
        return {"depth_before": blocks, "verdicts": {"gain": {"score": lower, "margin": 0.01 * loss, "loss_before": loss}}}

    rows = [{"seed": s, "depth": 2, "test_loss": 0.4, "history": [{"depth_before": 3}, check(4, 0.04, 0.4),
                                                                  check(5, -0.01, 0.36)]} for s in (0, 1)]  # fmt: skip
    summary = {"depth_kwarg": "added", "d_star": 3, "by_depth": {0: {"test_loss": (0.45, 0.01)}, 3: {"test_loss": (0.37, 0.01)}}}
    fig = plot_stopping(summary, rows, tmp_path / "s.png")
    right = fig.axes[1]
    assert (tmp_path / "s.png").stat().st_size > 0
    for line in right.lines[:2]:  # one line per seed: lower bound / loss at the growth
        assert list(line.get_ydata()) == pytest.approx([0.04 / 0.4, -0.01 / 0.36])
    assert right.lines[-1].get_ydata()[0] == pytest.approx(0.01)  # the min_gain line


def test_end_of_fit_summary_shows_each_blocks_certified_gain():
    """A history of an earlier version's decision="gain" (growth_history.json stays readable)."""
    from rich.console import Console

    from growtrain.callbacks import telemetry

    history = [{"check": 0, "epoch": 9, "depth_before": 3, "action": "grow", "site": "layer1.0", "lower": 0.1},
               {"check": 1, "epoch": 19, "depth_before": 4, "action": "saturated", "lower": 0.02,
                "gain": {"score": -0.0123, "margin": 0.0041}}]  # fmt: skip
    table = telemetry.fit_summary(history, start_depth=3, final_depth=4, finished="saturated",
                                  stop_reason="saturated: depth stopped paying", metrics={}, probe_seconds=1.0,
                                  fit_seconds=10.0)  # fmt: skip
    console = Console(width=200, record=True)
    console.print(table)
    text = console.export_text()
    assert "gain ≥" in text and "need" in text and "-0.0123" in text and "0.0041" in text and "depth stopped paying" in text
    assert "ratio (" not in text and "margin" not in text  # no relative rule, δ = 0: columns that say nothing


def test_the_final_metrics_are_the_trainers_last_callback_metrics():
    """The summary's final numbers: the trainer's callback metrics among SUMMARY_KEYS, as floats."""
    from growtrain.callbacks.telemetry import final_metrics

    got = final_metrics({"val_loss": torch.tensor(0.5), "lr": 0.1, "train_loss": 2})
    assert got == {"val_loss": 0.5, "train_loss": 2.0} and all(type(v) is float for v in got.values())


@pytest.mark.parametrize("rule", ["crossfit", "relative", "paper"])
def test_the_probe_pass_yields_the_networks_own_per_sample_losses(rule):
    """The window rule reads the per-sample losses from the probe pass's forward (ghosts output zero,
    half A cut into pieces for the relative rule, which measure_saturation still computes): they
    equal an unreduced cross-entropy of the network alone in eval mode, in the loader's order."""
    from growtrain.saturation import measure_saturation

    L.seed_everything(0)
    dm = tiny_dm()
    dm.setup("fit")
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic")
    got: list = []
    measure_saturation(model.network, dm.probe_dataloader(), F.cross_entropy, rule=rule, projected=False,
                       sample_losses=got)  # fmt: skip
    model.eval()
    with torch.no_grad():
        want = torch.cat([F.cross_entropy(model(x), y, reduction="none") for x, y in dm.probe_dataloader()])
    torch.testing.assert_close(torch.cat(got).float(), want, rtol=1e-5, atol=1e-6)


def test_one_process_spends_no_extra_forward_pass_on_the_window(tmp_path, monkeypatch):
    """On one process the window's per-sample losses come from the probe pass's own forward: the
    extra pass (what a DDP run makes) is never called, and every check still keeps 120 losses."""
    import growtrain.callbacks.window_check as window_module

    def no_extra_pass(*args, **kwargs):
        raise AssertionError("probe_sample_losses ran: the probe pass's losses were not used")

    monkeypatch.setattr(window_module, "probe_sample_losses", no_extra_pass)
    grow = _fit(tmp_path, max_epochs=4)
    assert any("gain_frac" in h.get("window", {}) for h in grow.history)
    assert all(len(e["losses"]) == 120 for e in grow._window.entries)


def test_a_check_does_not_move_the_training_random_stream(tmp_path, monkeypatch):
    """A run whose checks probe and a run whose checks do not (a budget) train identically when
    neither grows: each check runs on a fork of the generators, so iterating the probe loader
    (a DataLoader draws a base seed from torch's generator) does not move the data order. The
    negative control: with the fork disabled the same two runs end with different weights."""
    import contextlib

    def final_weights(**kw):
        L.seed_everything(0)
        grow = GrowUntilSaturated(monitor=None, every_n_epochs=1, on_saturated="continue", min_gain=None,
                                  verbose=False, **kw)  # fmt: skip
        trainer = L.Trainer(max_epochs=3, callbacks=[grow], logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
        model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic")
        trainer.fit(model, tiny_dm())
        assert grow.growths == 0
        return torch.cat([p.detach().flatten() for p in model.parameters()])

    no_probe = final_weights(max_growths=0)  # the check ends growth by budget, without probing
    probed = final_weights(rule="crossfit", delta=1e9)  # probes, saturated: no growth either
    assert torch.equal(no_probe, probed)
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices=None: contextlib.nullcontext())
    assert not torch.equal(final_weights(max_growths=0), final_weights(rule="crossfit", delta=1e9))


@pytest.mark.parametrize("change, message", [
    ("shrink", r"the probe had 120 samples .* 100 now"),
    ("permute", r"120 of 120 probe samples differ|probe samples differ.*the same samples in another order"),
    ("other", r"probe samples differ.*other samples \(content differs\)"),
    ("relabel", r"1 of 120 probe samples differ.*other samples"),
])  # fmt: skip
def test_a_probe_that_changes_between_checks_is_a_clear_error(tmp_path, change, message):
    """The window rule pairs the same probe samples in the same order at every check: a probe
    callable that returns fewer, reordered, other or relabelled samples after the first check is
    refused by name, before any decision (same size included: pairing is by fingerprint)."""
    from torch.utils.data import DataLoader, TensorDataset

    L.seed_everything(0)
    dm = tiny_dm()
    dm.setup("fit")
    x, y = (torch.cat(t) for t in zip(*dm.probe_dataloader()))
    state = {"changed": False}

    def probe():
        xs, ys = x, y
        if state["changed"]:
            if change == "shrink":
                xs, ys = x[:100], y[:100]
            elif change == "permute":
                order = torch.randperm(120, generator=torch.Generator().manual_seed(0))
                xs, ys = x[order], y[order]
            elif change == "other":
                xs = x.flip(-1)  # mirrored images: other inputs, same labels
            else:
                ys = y.clone()
                ys[17] = (ys[17] + 1) % 4
        return DataLoader(TensorDataset(xs, ys), batch_size=32)

    class ChangeAfterFirstCheck(L.Callback):  # runs after the grower's epoch-end hook
        def on_train_epoch_end(self, trainer, pl_module):
            if grow.history:
                state["changed"] = True

    # the check of epoch 0 waits (no window yet); epoch 1's pairs its losses with epoch 0's
    grow = GrowUntilSaturated(probe=probe, schedule="periodic", every_n_epochs=1, window=1, min_gain=0.0,
                              verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=4, callbacks=[grow, ChangeAfterFirstCheck()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic")
    with pytest.raises(ValueError, match=r"^probe: the window rule pairs every probe sample's loss at epoch 0 with") as err:
        trainer.fit(model, dm)
    assert "Fix: keep the probe fixed" in str(err.value)
    import re

    assert re.search(message, str(err.value)), str(err.value)
    assert grow.growths == 0 and model.network.depth() == 3 and len(grow.history) == 1  # no decision recorded


def test_a_fixed_probe_callable_passes_every_check(tmp_path):
    """The negative control of the test above: the same callable without the change decides on."""
    from torch.utils.data import DataLoader, TensorDataset

    L.seed_everything(0)
    dm = tiny_dm()
    dm.setup("fit")
    x, y = (torch.cat(t) for t in zip(*dm.probe_dataloader()))
    grow = GrowUntilSaturated(probe=lambda: DataLoader(TensorDataset(x, y), batch_size=32), schedule="periodic",
                              every_n_epochs=1, window=1, min_gain=0.0, max_growths=2, verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=3, callbacks=[grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic"), dm)
    assert sum("gain_frac" in h.get("window", {}) for h in grow.history) >= 1  # a comparison was made


def test_a_shuffling_probe_loader_is_refused_at_setup():
    from torch.utils.data import DataLoader, TensorDataset

    dm = tiny_dm()
    probe = DataLoader(TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(4, (64,))), batch_size=16, shuffle=True)
    grow = GrowUntilSaturated(probe=probe, monitor=None, min_gain=0.01, verbose=False)
    trainer = L.Trainer(max_epochs=1, callbacks=[grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic")
    with pytest.raises(ValueError, match=r"probe: min_gain compares.*RandomSampler \(shuffle=True\).*shuffle=False"):
        trainer.fit(model, dm)
    assert trainer.global_step == 0  # refused before any training
    # min_gain=None (the first-order rule alone): the order does not matter, the same loader is accepted
    grow = GrowUntilSaturated(probe=probe, monitor=None, min_gain=None, max_growths=0, verbose=False)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, callbacks=[grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, dm)
    assert trainer.global_step == 1 and grow.decision == "rule"
    refuse_random_probe(DataLoader(probe.dataset, batch_size=16), "probe")  # the same data unshuffled: accepted


def test_best_scored_site_takes_the_rules_own_score_whatever_the_verdict():
    from types import SimpleNamespace as S

    sites = [S(name="a", lower=-0.2, grad_norm=3.0), S(name="b", lower=-0.1, grad_norm=1.0)]
    assert best_scored_site(S(rule="crossfit", sites=sites)) == "b"  # largest lower bound, though ≤ 0
    assert best_scored_site(S(rule="relative", sites=sites)) == "b"
    assert best_scored_site(S(rule="paper", sites=sites)) == "a"  # largest ‖ĝ‖
    assert best_scored_site(S(rule="crossfit", sites=[])) is None
