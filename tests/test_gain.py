"""min_gain: did the last growth pay? A paired, one-sided test on the probe's per-sample losses."""

from __future__ import annotations

import math
import random
import statistics

import lightning as L
import pytest
import torch
from torch.nn import functional as F

from growtrain import decision as dec
from growtrain.callbacks import GrowUntilSaturated
from growtrain.callbacks.probe_data import ProbeView, per_sample_losses
from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier

Z95 = 1.6448536269514722  # the standard normal's 0.95 quantile


def test_paired_gain_and_verdict_match_a_hand_computation():
    before = [0.9, 0.5, 1.2, 0.3, 0.8, 0.6]
    after = [0.7, 0.45, 1.0, 0.35, 0.6, 0.5]
    d = [b - a for b, a in zip(before, after)]
    mean, se, n, before_mean = dec.paired_gain(torch.tensor(before), torch.tensor(after))
    assert n == 6 and mean == pytest.approx(statistics.fmean(d)) and before_mean == pytest.approx(statistics.fmean(before))
    assert se == pytest.approx(statistics.stdev(d) / math.sqrt(6))
    lower = statistics.fmean(d) - Z95 * statistics.stdev(d) / math.sqrt(6)
    paid = dec.gain_verdict(mean, se, before_mean, min_gain=0.0, level=0.05)
    assert not paid.saturated and paid.score == pytest.approx(lower) and paid.reason.startswith("paid")
    # just above / below the margin min_gain · mean(before)
    edge = lower / before_mean
    assert dec.gain_verdict(mean, se, before_mean, min_gain=edge * 0.99, level=0.05).saturated is False
    stopped = dec.gain_verdict(mean, se, before_mean, min_gain=edge * 1.01, level=0.05)
    assert stopped.saturated and "depth stopped paying" in stopped.reason


def test_paired_gain_refuses_unpaired_vectors():
    with pytest.raises(ValueError, match="paired_gain: expected two 1-d loss vectors of one length"):
        dec.paired_gain(torch.ones(5), torch.ones(6))


def _paid_rate(lower_fn, gain: float, reps: int = 3000, n: int = 400) -> float:
    rng = random.Random(0)
    paid = 0
    for _ in range(reps):
        difficulty = [rng.expovariate(2.0) for _ in range(n)]  # per-sample loss levels: shared by both
        before = torch.tensor([v + rng.gauss(0, 0.1) for v in difficulty])
        after = torch.tensor([v - gain + rng.gauss(0, 0.1) for v in difficulty])
        mean, se, _, before_mean = dec.paired_gain(before, after)
        paid += lower_fn(mean, se, before_mean) > 0.0
    return paid / reps


def test_no_gain_is_called_paid_at_most_at_the_level_and_a_broken_bound_is_not():
    """Null (no gain): the rate of "paid" stays within α + 3 sd; the broken variant that drops the
    standard error (a point estimate) says "paid" about half the time and fails the same check.
    A real gain of 0.03 is detected nearly always (power)."""
    alpha, reps = 0.05, 3000
    sd = math.sqrt(alpha * (1 - alpha) / reps)
    right = lambda m, se, b: dec.gain_verdict(m, se, b, min_gain=0.0, level=alpha).score  # noqa: E731
    broken = lambda m, se, b: m  # noqa: E731
    assert _paid_rate(right, 0.0, reps) <= alpha + 3 * sd
    assert _paid_rate(broken, 0.0, reps) > alpha + 3 * sd
    assert _paid_rate(right, 0.03, 500) > 0.95


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


def _fit(min_gain, tmp_path, rule="paper", **kw):
    L.seed_everything(0)
    # the paper's rule with a tiny t always grows: only min_gain can end growth here
    kw = ({"t": 1e-12} if rule == "paper" else {}) | kw
    grow = GrowUntilSaturated(monitor=None, every_n_epochs=2, rule=rule, min_gain=min_gain, max_growths=3,
                              lr_schedule="anneal", anneal_epochs=1, on_saturated="anneal", verbose=False, **kw)  # fmt: skip
    trainer = L.Trainer(max_epochs=20, callbacks=[grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic",
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, weight_decay=5e-4))  # fmt: skip
    trainer.fit(model, tiny_dm())
    return grow


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


def test_the_losses_at_the_last_growth_survive_a_checkpoint(tmp_path):
    grow = _fit(0.0, tmp_path, seed=0)
    state = grow.state_dict()
    assert len(state["gain_reference"]) == 120  # the probe's losses at the last growth
    again = GrowUntilSaturated(min_gain=0.0)
    again.load_state_dict({**state, "gain_reference": [0.5] * 120})
    assert again.gain_reference == [0.5] * 120


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
    import growtrain.callbacks.growth as growth_module

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


def test_a_probe_that_changes_between_checks_is_a_clear_error(tmp_path):
    """The paired gain needs the same probe samples at every check: a probe callable that
    returns another sample after the growth is refused by name, before any decision."""
    from torch.utils.data import DataLoader, TensorDataset

    L.seed_everything(0)
    dm = tiny_dm()
    dm.setup("fit")
    x, y = (torch.cat(t) for t in zip(*dm.probe_dataloader()))
    size = {"n": 120}

    def probe():
        return DataLoader(TensorDataset(x[: size["n"]], y[: size["n"]]), batch_size=32)

    class ShrinkAfterFirstGrowth(L.Callback):  # runs after the grower's epoch-end hook
        def on_train_epoch_end(self, trainer, pl_module):
            if grow.growths:
                size["n"] = 100

    grow = GrowUntilSaturated(probe=probe, monitor=None, every_n_epochs=1, rule="paper", t=1e-12, min_gain=0.0,
                              verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=4, callbacks=[grow, ShrinkAfterFirstGrowth()], logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                        limit_val_batches=0)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic")
    with pytest.raises(ValueError, match=r"probe: min_gain pairs every probe sample's loss.*120 samples.*100 now.*Fix"):
        trainer.fit(model, dm)
    assert grow.growths == 1 and model.network.depth() == 4  # the failing check grew nothing


def test_best_scored_site_takes_the_rules_own_score_whatever_the_verdict():
    from types import SimpleNamespace as S

    sites = [S(name="a", lower=-0.2, grad_norm=3.0), S(name="b", lower=-0.1, grad_norm=1.0)]
    assert dec.best_scored_site(S(rule="crossfit", sites=sites)) == "b"  # largest lower bound, though ≤ 0
    assert dec.best_scored_site(S(rule="relative", sites=sites)) == "b"
    assert dec.best_scored_site(S(rule="paper", sites=sites)) == "a"  # largest ‖ĝ‖
    assert dec.best_scored_site(S(rule="crossfit", sites=[])) is None
