"""The paired, one-sided gain certificate (growtrain.gain) on the probe's per-sample losses, the probe
pass's own per-sample losses, and the checks' hygiene (the random stream, the probe's order). The
block-only trial's use of the certificate is tests/test_trial.py's, the stage fork's tests/test_fork.py's."""

from __future__ import annotations

import math
import statistics

import lightning as L
import pytest
import torch
from torch.nn import functional as F


from growtrain.gain import GAIN_METHODS, gain_test
from growtrain.callbacks import GrowUntilSaturated, Rule, StageFork, Trial
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


@pytest.mark.parametrize("value", [-0.1, math.nan, math.inf, "1%", True, None])
@pytest.mark.parametrize("part", [Trial, StageFork])
def test_bad_min_gain_is_refused_at_construction(part, value):
    name = part.__name__
    with pytest.raises(ValueError, match=rf"^{name}\.min_gain: expected a finite number >= 0.*Fix: pass "
                                         rf"{name}\(min_gain=0\.01\).*decision='rule'"):  # fmt: skip
        part(min_gain=value)


def test_the_end_of_fit_summary_shows_the_margin_column_only_when_a_margin_was_set():
    """The summary's columns: the first-order figures always; the margin (δ) only when some check had a
    non-zero one (δ = 0, the default, is a column that says nothing)."""
    from rich.console import Console

    from growtrain.callbacks import telemetry

    def headers(margin):
        history = [{"check": 0, "epoch": 9, "depth_before": 3, "action": "grow", "site": "layer1.0", "lower": 0.1,
                    "margin": margin},
                   {"check": 1, "epoch": 19, "depth_before": 4, "action": "saturated", "lower": 0.02,
                    "margin": margin}]  # fmt: skip
        table = telemetry.fit_summary(history, start_depth=3, final_depth=4, finished="saturated",
                                      stop_reason="no certified first-order gain", metrics={}, probe_seconds=1.0,
                                      fit_seconds=10.0)  # fmt: skip
        console = Console(width=200, record=True)
        console.print(table)
        return [c.header for c in table.columns], console.export_text()

    columns, text = headers(0.0)
    assert columns == ["check", "epoch", "depth", "action", "site", "first-order ≥"]
    columns, text = headers(0.0513)
    assert columns == ["check", "epoch", "depth", "action", "site", "first-order ≥", "margin"]
    assert "0.0513" in text and "no certified gain" in text


def test_the_final_metrics_are_the_trainers_last_callback_metrics():
    """The summary's final numbers: the trainer's callback metrics among SUMMARY_KEYS, as floats."""
    from growtrain.callbacks.telemetry import final_metrics

    got = final_metrics({"val_loss": torch.tensor(0.5), "lr": 0.1, "train_loss": 2})
    assert got == {"val_loss": 0.5, "train_loss": 2.0} and all(type(v) is float for v in got.values())


@pytest.mark.parametrize("rule", ["crossfit", "paper"])
def test_the_probe_pass_yields_the_networks_own_per_sample_losses(rule):
    """measure_saturation's sample_losses are the probe pass's own forward's (ghosts output zero): they
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


def test_a_check_does_not_move_the_training_random_stream(tmp_path, monkeypatch):
    """A run whose checks probe and a run whose checks do not (a budget) train identically when
    neither grows: each check runs on a fork of the generators, so iterating the probe loader
    (a DataLoader draws a base seed from torch's generator) does not move the data order. The
    negative control: with the fork disabled the same two runs end with different weights."""
    import contextlib

    def final_weights(**kw):
        L.seed_everything(0)
        grow = GrowUntilSaturated(schedule="periodic", decision="rule", on_saturated="continue", verbose=False, **kw)
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


def test_a_shuffling_probe_loader_is_refused_at_setup():
    from torch.utils.data import DataLoader, TensorDataset

    dm = tiny_dm()
    probe = DataLoader(TensorDataset(torch.randn(64, 3, 8, 8), torch.randint(4, (64,))), batch_size=16, shuffle=True)
    grow = GrowUntilSaturated(probe=probe, schedule="periodic", decision=Trial(min_gain=0.01), verbose=False)
    trainer = L.Trainer(max_epochs=1, callbacks=[grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic")
    with pytest.raises(ValueError, match=r"probe: min_gain compares.*RandomSampler \(shuffle=True\).*shuffle=False"):
        trainer.fit(model, dm)
    assert trainer.global_step == 0  # refused before any training
    # decision="rule" (the first-order rule alone): the order does not matter, the same loader is accepted
    grow = GrowUntilSaturated(probe=probe, schedule="periodic", decision="rule", max_growths=0, verbose=False)
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, callbacks=[grow], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False)  # fmt: skip
    trainer.fit(model, dm)
    assert trainer.global_step == 1 and grow.decision == Rule()
    refuse_random_probe(DataLoader(probe.dataset, batch_size=16), "probe")  # the same data unshuffled: accepted
