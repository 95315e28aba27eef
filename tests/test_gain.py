"""min_gain: did the last growth pay? A paired, one-sided test on the probe's per-sample losses."""

from __future__ import annotations

import math
import statistics

import lightning as L
import pytest
import torch
from torch.nn import functional as F

from pathlib import Path

from growtrain import decision as dec
from growtrain.gain import GAIN_METHODS, gain_test
from growtrain.saturation_report import best_scored_site
from growtrain.callbacks import GrowUntilSaturated
from growtrain.callbacks.probe_data import ProbeView, per_sample_losses
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
    verdict = dec.gain_verdict(boot)
    assert verdict.saturated is (not boot["paid"]) and verdict.score == boot["lower"]


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


def _fit(min_gain, tmp_path, rule="paper", extra=(), max_epochs=20, ckpt=None, data=None, **kw):
    L.seed_everything(0)
    # the paper's rule with a tiny t always grows: only min_gain can end growth here
    kw = ({"t": 1e-12} if rule == "paper" else {}) | {"max_growths": 3} | kw
    grow = GrowUntilSaturated(monitor=None, every_n_epochs=2, rule=rule, min_gain=min_gain,
                              decision="gain" if min_gain is not None else "rule",
                              lr_schedule="anneal", anneal_epochs=1, on_saturated="anneal", verbose=False, **kw)  # fmt: skip
    resume = ckpt not in (None, True)
    # A resumed run gets back the checkpoint callback it was saved with, in the same folder (else
    # Lightning warns that the dirpath changed), and writes nothing beside the run it resumes.
    checkpoints = [L.pytorch.callbacks.ModelCheckpoint(dirpath=Path(ckpt).parent if resume else tmp_path / "ckpt",
                                                       save_top_k=0 if resume else -1, every_n_epochs=1,
                                                       save_on_train_epoch_end=True)] if ckpt is not None else []  # fmt: skip
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=[*extra, grow, *checkpoints], logger=False,
                        enable_checkpointing=bool(checkpoints), enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0, default_root_dir=tmp_path, deterministic=True)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic",
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4))  # fmt: skip
    trainer.fit(model, (data or tiny_dm)(), ckpt_path=ckpt if resume else None)
    grow.model = model
    return grow


def test_every_gain_verdict_compares_with_the_last_growth_by_hand(tmp_path):
    """A run with three gain verdicts (min_gain=0: growth goes on while each growth paid): each
    verdict equals gain_test on the per-sample losses computed independently at the check that
    grew last and at this check — not the first growth's, not the previous check's."""
    watch = ProbeLosses()
    grow = _fit(0.0, tmp_path, extra=[watch], max_growths=4)
    checks = grow.history
    verdicts = [h for h in checks if "gain" in h]
    assert len(verdicts) >= 2, [h["action"] for h in checks]
    last_growth_epoch = None
    for h in checks:
        if "gain" in h:
            before, after = watch.by_epoch[last_growth_epoch], watch.by_epoch[h["epoch"]]
            want = gain_test(before, after, min_gain=0.0, level=h["level"], seed=h["check"] + 1)
            got = h["gain"]
            assert got["loss_before"] == pytest.approx(float(before.mean()), rel=1e-5)
            assert got["loss_now"] == pytest.approx(float(after.mean()), rel=1e-5)
            assert got["mean"] == pytest.approx(want["mean"], rel=1e-4, abs=1e-7)
            assert got["lower"] == pytest.approx(want["lower"], rel=1e-3, abs=1e-6)
            assert got["paid"] == want["paid"] and got["saturated"] == (not want["paid"])
        if h["action"] == "grow":
            last_growth_epoch = h["epoch"]
    assert sum(h["action"] == "grow" for h in verdicts) >= 1  # a paid verdict moved the reference on


def test_the_gain_level_follows_alpha_spending(tmp_path):
    """alpha_spending='inverse_square': the k-th test (k = 0, 1, ...) runs at α·6/(π²(k+1)²)
    (growtrain.crossfit.alpha_schedule), and the gain's bound uses that level, not α."""
    grow = _fit(0.0, tmp_path, alpha_spending="inverse_square", max_growths=2)
    verdicts = [h for h in grow.history if "gain" in h]
    assert verdicts
    for h in verdicts:
        k = h["check"]
        want = 0.05 * 6 / (math.pi**2 * (k + 1) ** 2)
        assert h["gain"]["level"] == pytest.approx(want) and h["level"] == pytest.approx(want)


def test_a_growth_that_did_not_pay_ends_growth_and_the_verdict_is_reported(tmp_path):
    """min_gain=10 (a tenfold loss drop, impossible): the check after the first growth finds it
    did not pay and ends growth as "saturated"; every later-check record carries the gain verdict
    beside the other rules, and the gain equals the probe-loss drop computed from the record."""
    grow = _fit(10.0, tmp_path)
    assert [h["action"] for h in grow.history][:2] == ["grow", "saturated"] and grow.growths == 1
    assert grow.finished == "saturated" and "depth stopped paying" in grow.stop_reason
    gain = grow.history[1]["gain"]
    assert gain["mean"] == pytest.approx(gain["loss_before"] - gain["loss_now"], abs=1e-9)
    assert grow.history[1]["verdicts"]["gain"]["saturated"] is True and "paper" in grow.history[1]["verdicts"]
    assert "gain" not in grow.history[0]  # nothing to judge before the first growth
    off = _fit(None, tmp_path)  # without min_gain the same run grows on (negative control)
    assert [h["action"] for h in off.history] == ["grow", "grow", "grow", "budget"]


def test_the_losses_at_the_last_growth_survive_a_checkpoint_in_order(tmp_path):
    """Through a real checkpoint file (torch.save / load with weights_only=True): the per-sample
    reference losses and fingerprints come back equal, element by element, in their order."""
    grow = _fit(0.0, tmp_path, max_growths=1)
    state = grow.state_dict()
    reference, signature = state["gain_reference"], state["gain_signature"]
    assert len(reference) == len(signature) == 120 and len(set(reference)) > 100  # non-constant
    torch.save({"callbacks": {"grow": state}}, tmp_path / "state.ckpt")
    loaded = torch.load(tmp_path / "state.ckpt", weights_only=True)["callbacks"]["grow"]
    again = GrowUntilSaturated(min_gain=0.0, decision="gain")
    again.load_state_dict(loaded)
    assert again.gain_reference == reference and again.gain_signature == signature


def test_a_resumed_run_makes_the_same_gain_verdict(tmp_path):
    """Killed after the first growth (its epoch's checkpoint), resumed: the next check — a gain
    verdict — decides exactly as the uninterrupted run's (an epoch-seeded train sampler, as in
    test_resume.py: Lightning does not checkpoint the global generator a shuffling loader uses)."""
    from test_resume import ResumableData

    def data():
        return ResumableData(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4,
                             probe_size=120, val_size=40, batch_size=32, augment=False)  # fmt: skip

    full = _fit(0.0, tmp_path / "full", ckpt=True, max_growths=2, data=data)
    grew = next(h for h in full.history if h["action"] == "grow")
    verdict = next(h for h in full.history if "gain" in h)
    ckpt = tmp_path / "full" / "ckpt" / f"epoch={grew['epoch']}-step={grew['step']}.ckpt"
    assert ckpt.exists(), sorted(p.name for p in (tmp_path / "full" / "ckpt").iterdir())
    resumed = _fit(0.0, tmp_path / "resumed", ckpt=str(ckpt), max_growths=2, data=data)
    again = next(h for h in resumed.history if "gain" in h)
    assert again["check"] == verdict["check"] and again["gain"] == verdict["gain"]
    assert [h["action"] for h in resumed.history] == [h["action"] for h in full.history]


def test_after_a_growth_its_realized_gain_decides_not_the_first_order_rule(tmp_path):
    """On this run the cross-fit rule says "saturated" at the second check (no certified
    first-order gain on the annealed network) while the probe loss fell by a certified amount
    since the growth: with min_gain the paid growth wins and the network grows at the site with
    the best lower bound; without it the first-order verdict ends growth."""
    grow = _fit(0.0, tmp_path, rule="crossfit")
    second = grow.history[1]
    assert second["verdicts"]["crossfit"]["saturated"] is True and second["gain"]["saturated"] is False
    assert second["action"] == "grow" and "paid" in second["reason"]
    lowers = {site["site"]: site["lower"] for site in second["site_scores"]}
    assert second["site"] == max(lowers, key=lowers.get)
    plain = _fit(None, tmp_path, rule="crossfit")
    assert [h["action"] for h in plain.history] == ["grow", "saturated"]


def test_stopping_figure_draws_every_seeds_certified_gain(tmp_path):
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


@pytest.mark.parametrize("rule", ["crossfit", "relative", "paper"])
def test_the_probe_pass_yields_the_networks_own_per_sample_losses(rule):
    """min_gain reads the per-sample losses from the probe pass's forward (ghosts output zero,
    half A cut into pieces for the relative rule): they equal an unreduced cross-entropy of the
    network alone in eval mode, in the loader's order."""
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


def test_one_process_spends_no_extra_forward_pass_on_the_gain(tmp_path, monkeypatch):
    import growtrain.callbacks.gain_check as growth_module

    def no_extra_pass(*args, **kwargs):
        raise AssertionError("per_sample_losses ran: the probe pass's losses were not used")

    monkeypatch.setattr(growth_module, "per_sample_losses", no_extra_pass)
    grow = _fit(0.0, tmp_path)
    assert any("gain" in h for h in grow.history) and len(grow.gain_reference) == 120


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
    ("shrink", r"120 samples at the last growth and has 100 now"),
    ("permute", r"120 of 120 probe samples differ|probe samples differ.*the same samples in another order"),
    ("other", r"probe samples differ.*other samples \(content differs\)"),
    ("relabel", r"1 of 120 probe samples differ.*other samples"),
])  # fmt: skip
def test_a_probe_that_changes_between_checks_is_a_clear_error(tmp_path, change, message):
    """The paired gain needs the same probe samples in the same order at every check: a probe
    callable that returns fewer, reordered, other or relabelled samples after the growth is
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

    class ChangeAfterFirstGrowth(L.Callback):  # runs after the grower's epoch-end hook
        def on_train_epoch_end(self, trainer, pl_module):
            if grow.growths:
                state["changed"] = True

    grow = GrowUntilSaturated(probe=probe, monitor=None, every_n_epochs=1, rule="paper", t=1e-12, min_gain=0.0,
                              decision="gain", verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=4, callbacks=[grow, ChangeAfterFirstGrowth()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic")
    with pytest.raises(ValueError, match=r"probe: min_gain pairs every probe sample's loss") as err:
        trainer.fit(model, dm)
    assert "Fix: keep the probe fixed" in str(err.value)
    import re

    assert re.search(message, str(err.value)), str(err.value)
    assert grow.growths == 1 and model.network.depth() == 4 and len(grow.history) == 1  # no decision recorded


def test_a_fixed_probe_callable_passes_every_check(tmp_path):
    """The negative control of the test above: the same callable without the change decides on."""
    from torch.utils.data import DataLoader, TensorDataset

    L.seed_everything(0)
    dm = tiny_dm()
    dm.setup("fit")
    x, y = (torch.cat(t) for t in zip(*dm.probe_dataloader()))
    grow = GrowUntilSaturated(probe=lambda: DataLoader(TensorDataset(x, y), batch_size=32), monitor=None,
                              every_n_epochs=1, rule="paper", t=1e-12, min_gain=0.0, max_growths=2, decision="gain",
                              verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=3, callbacks=[grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)  # fmt: skip
    trainer.fit(ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic"), dm)
    assert sum("gain" in h for h in grow.history) >= 1


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
    # min_gain=None: the order does not matter, the same loader is accepted
    GrowUntilSaturated(probe=probe, min_gain=None)._refuse_random_probe(probe, "probe")


def test_best_scored_site_takes_the_rules_own_score_whatever_the_verdict():
    from types import SimpleNamespace as S

    sites = [S(name="a", lower=-0.2, grad_norm=3.0), S(name="b", lower=-0.1, grad_norm=1.0)]
    assert best_scored_site(S(rule="crossfit", sites=sites)) == "b"  # largest lower bound, though ≤ 0
    assert best_scored_site(S(rule="relative", sites=sites)) == "b"
    assert best_scored_site(S(rule="paper", sites=sites)) == "a"  # largest ‖ĝ‖
    assert best_scored_site(S(rule="crossfit", sites=[])) is None
