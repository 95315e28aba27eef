"""The relative rule (``measure_saturation(rule="relative")``, reported by ``growtrain measure``; no
longer a callback option, whose default is ``"crossfit"``) against independent oracles.

* the reference ``R`` equals a plain-autograd recomputation over the same pieces of half A;
* ``debiased_reference`` is unbiased for ``‖g‖²`` where the naive squared norm is not;
* decisions are invariant to scaling the loss (the absolute cross-fit rule with δ > 0 is not);
* the verdict functions and the callback's options fail loudly on bad input.
"""

from __future__ import annotations

import math

import pytest
import torch
from torch.nn import functional as F

from growtrain import decision as dec
from growtrain.callbacks import Converged, GrowUntilSaturated, Periodic, Rule, Trial
from growtrain.saturation import measure_saturation
from tests.helpers import cat_batches, make_net, num_classes, probe_batches, random_inputs


def signal_batches(kind: str, n: int, batch: int, seed: int = 7):
    """Probe batches whose labels depend on the inputs, so that first-order gains are real."""
    gen = torch.Generator().manual_seed(seed)
    x = random_inputs(kind, n, gen)
    y = (x.flatten(1)[:, :16].sum(1) > 0).long() * (num_classes(kind) - 1)
    return [(x[i : i + batch], y[i : i + batch]) for i in range(0, n, batch)]


def _pieces_of_a(batch_sizes, n_a: int):
    """Half A as documented: each batch cut into pieces of at most ⌈n_a/4⌉, and at the A/B boundary."""
    piece, out, seen = math.ceil(n_a / 4), [], 0
    for size in batch_sizes:
        start = 0
        while start < size and seen < n_a:
            stop = min(size, start + piece, start + n_a - seen)
            out.append((seen, seen + stop - start))
            seen += stop - start
            start = stop
        seen += size - start
    return out


def _oracle_reference(net, batches, n_a: int) -> float:
    """R from plain autograd: per existing block, per piece k, S_k = n_k · ∇(mean piece loss)."""
    x, y = cat_batches(batches)
    blocks = [b for name in dict.fromkeys(s.stage for s in net.sites()) for b in net.stage(name)]
    pieces = _pieces_of_a([len(b[1]) for b in batches], n_a)
    per_block = []
    for block in blocks:
        params = list(block.terminal_parameters())
        sums, sq = None, 0.0
        for a, b in pieces:
            grads = torch.autograd.grad(F.cross_entropy(net(x[a:b]), y[a:b]), params)
            s = torch.cat([g.flatten() for g in grads]).double() * (b - a)
            sums = s if sums is None else sums + s
            sq += float(s.pow(2).sum())
        n = sum(b - a for a, b in pieces)
        n_sq = sum((b - a) ** 2 for a, b in pieces)
        per_block.append((float(sums.pow(2).sum()) - sq) / (n * n - n_sq))
    return math.sqrt(max(0.0, sum(per_block) / len(per_block))), len(pieces)


@pytest.mark.parametrize("kind", ["preact", "basic", "generic"])
def test_reference_equals_autograd_over_the_same_pieces(kind):
    net = make_net(kind, blocks=(1, 2, 1))
    batches = signal_batches(kind, n=30, batch=7)  # batches straddle the pieces and the A/B boundary (n_a = 15)
    report = measure_saturation(net, batches, F.cross_entropy, rule="relative", projected=False, calibrate=False)
    expected, pieces = _oracle_reference(net, batches, n_a=15)
    assert expected > 0
    assert report.reference == pytest.approx(expected, rel=1e-9)
    assert report.extra["reference_pieces"] == pieces == 5
    assert report.margin == pytest.approx(max(0.0, report.tau * expected), rel=1e-9)
    # the cut into pieces changes no per-sample quantity: the lower bounds equal the cross-fit rule's
    crossfit = measure_saturation(net, batches, F.cross_entropy, rule="crossfit", projected=False, calibrate=False)
    assert [r.lower for r in report.sites] == pytest.approx([r.lower for r in crossfit.sites], rel=1e-9)
    # and the parameters' requires_grad flags are back as they were
    assert all(p.requires_grad for p in net.parameters())


def test_debiased_reference_is_unbiased_where_the_naive_norm_is_not():
    gen = torch.Generator().manual_seed(0)
    g = torch.tensor([0.3, -0.1, 0.2], dtype=torch.float64)  # ‖g‖² = 0.14
    sizes = [5, 3, 7, 4]
    est, naive = [], []
    for _ in range(4000):
        pieces = [(g + torch.randn(m, 3, generator=gen, dtype=torch.float64)).sum(0) for m in sizes]
        total = torch.stack(pieces).sum(0)
        n = sum(sizes)
        _, per_block = dec.debiased_reference([total], [float(sum(p.pow(2).sum() for p in pieces))], n,
                                              sum(m * m for m in sizes))  # fmt: skip
        est.append(per_block[0])
        naive.append(float((total / n).pow(2).sum()))
    mean, se = sum(est) / len(est), torch.tensor(est).std().item() / math.sqrt(len(est))
    assert abs(mean - 0.14) < 4 * se  # unbiased
    assert sum(naive) / len(naive) > 0.14 + 3 / sum(sizes) * 0.9  # ‖ĝ‖² is biased by tr(Σ)/n = 3/19


def test_loss_scale_changes_no_relative_decision():
    """R and every lower bound scale with the loss, so their ratio and the verdict do not; an
    absolute margin δ > 0 (the cross-fit rule) is not scale-free: the negative control."""
    net = make_net("basic", blocks=(1, 2, 1))
    batches = signal_batches("basic", n=96, batch=8)
    verdicts = {}
    for scale in (0.1, 1.0, 10.0):
        loss = lambda out, y, s=scale: s * F.cross_entropy(out, y)  # noqa: E731
        for tau in (1e-3, 0.5, 50.0):
            r = measure_saturation(net, batches, loss, rule="relative", tau=tau, projected=False, calibrate=False)
            verdicts[(scale, tau)] = (r.saturated, r.best_site, round(r.ratio, 9))
    for tau in (1e-3, 0.5, 50.0):
        assert verdicts[(0.1, tau)] == verdicts[(1.0, tau)] == verdicts[(10.0, tau)]
    assert {verdicts[(1.0, tau)][0] for tau in (1e-3, 50.0)} == {True, False}  # τ matters: both verdicts occur
    ref = measure_saturation(net, batches, F.cross_entropy, rule="crossfit", projected=False, calibrate=False)
    delta = ref.extra["max_lower"] * 2 if ref.extra["max_lower"] > 0 else 1e-3
    absolute = [measure_saturation(net, batches, lambda o, y, s=s: s * F.cross_entropy(o, y), rule="crossfit",
                                   delta=abs(delta), projected=False, calibrate=False).saturated
                for s in (0.1, 100.0)]  # fmt: skip
    assert absolute == [True, False]


def test_every_verdict_is_reported_and_the_deciding_rule_named():
    net = make_net("basic")
    report = measure_saturation(net, probe_batches("basic", n=32), F.cross_entropy, rule="relative", projected=False,
                                variance=True)  # fmt: skip
    assert report.rule == "relative" and set(report.verdicts) == {"paper", "crossfit", "relative"}
    # without σ̂² (the default of the cross-fit rules: no per-sample gradients) there is no paper verdict
    quick = measure_saturation(net, probe_batches("basic", n=32), F.cross_entropy, rule="relative", projected=False)
    assert set(quick.verdicts) == {"crossfit", "relative"} and quick.threshold is None
    assert [r.lower for r in quick.sites] == pytest.approx([r.lower for r in report.sites], rel=1e-9)
    chosen = report.verdicts["relative"]
    assert (report.saturated, report.best_site, report.margin) == (chosen.saturated, chosen.site, chosen.margin)
    d = report.to_dict()
    assert d["verdicts"]["paper"]["margin"] == pytest.approx(report.threshold)
    assert d["ratio"] == pytest.approx(report.ratio)


def test_relative_verdict_pure_function():
    v = dec.relative_verdict([0.1, 0.35, -1.0], ["a.0", "a.1", "b.1"], reference=0.5, tau=0.6, delta=0.0, level=0.01)
    assert (v.saturated, v.site, v.margin) == (False, "a.1", pytest.approx(0.3))
    v = dec.relative_verdict([0.1, 0.25], ["a.0", "a.1"], reference=0.5, tau=0.6, delta=0.0, level=0.01)
    assert (v.saturated, v.site) == (True, None) and "0.5×R" in v.reason
    v = dec.relative_verdict([0.1, 0.25], ["a.0", "a.1"], reference=0.5, tau=0.1, delta=0.3, level=0.01)
    assert v.saturated and v.margin == pytest.approx(0.3)  # δ is a floor under τ·R
    v = dec.relative_verdict([0.2], ["a.0"], reference=0.0, tau=1.0, delta=0.0, level=0.01)
    assert not v.saturated and "inf" in v.reason  # no signal in the existing blocks: any certified gain grows


@pytest.mark.parametrize("tau", [0, -1.0, float("nan"), float("inf"), True, "0.5"])
def test_bad_tau_is_refused_by_measure_saturation(tau):
    # tau is no callback option any more (tests/test_options.py); the library's relative rule still checks it
    net = make_net("basic")
    with pytest.raises(ValueError, match="tau: expected"):
        measure_saturation(net, probe_batches("basic", n=16), F.cross_entropy, rule="relative", tau=tau)


@pytest.mark.parametrize(
    "cls, kwargs, match",
    [
        (Converged, {"min_stage_epochs": 0},
         r"Converged\.min_stage_epochs: expected an integer >= 1; got 0\. Fix: pass Converged\(min_stage_epochs=1\)"),
        (Converged, {"min_rel_delta": -0.1}, r"Converged\.min_rel_delta: expected a finite number >= 0"),
        (Periodic, {"anneal_epochs": 0}, r"Periodic\.anneal_epochs: expected an integer >= 1"),
        (GrowUntilSaturated, {"on_saturated": "finish"}, r"on_saturated: expected one of \('stop', 'continue', 'anneal'\)"),
        (GrowUntilSaturated, {"rule": "relatve"},
         r"rule: expected one of \('paper', 'crossfit'\); got 'relatve'\. Fix: pass rule='paper'"),
        (GrowUntilSaturated, {"rule": "relative"},
         r"rule: expected one of \('paper', 'crossfit'\); got 'relative'\. Fix: pass rule='paper'"),
    ],
)
def test_bad_options_name_the_argument(cls, kwargs, match):
    with pytest.raises(ValueError, match=match):
        cls(**kwargs)


def test_defaults_tie_checks_to_convergence_and_judge_growth_by_its_gain():
    grow = GrowUntilSaturated()
    assert (grow.rule, grow.schedule.monitor, grow.decision) == ("crossfit", "train_loss", Trial(min_gain=0.01))
    assert dec.DEFAULT_MIN_GAIN == 0.01 and GrowUntilSaturated(decision="rule").decision == Rule()
    assert GrowUntilSaturated(t=0.5).rule == "paper"  # t is the paper rule's threshold
