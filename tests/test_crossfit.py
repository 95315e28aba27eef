"""The cross-fit growth decision (growtrain.crossfit): math, streaming, size under H0, power.

Oracles are independent: numpy/scipy recompute the cross-fit bound from per-sample gradients
(computed here by hand for a linear-feature block, or by real insertion + per-sample autograd
in tests/helpers.py); the planted problems draw per-sample gradients ``ξ_i = g + noise`` with a
known population gradient ``g``. Size checks: the rate of "grow" under ``‖g‖ ≤ δ`` over ≥ 500
independent probe draws must be ≤ α + 3·sqrt(α(1−α)/draws).
"""

from __future__ import annotations

import copy
import itertools
import math
import importlib.util
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy import stats
from torch import nn
from torch.nn import functional as F

from growtrain import GrowableStack
from growtrain.families.base import DenseFeatures
from growtrain.families.preact import PreActBlock
from growtrain import probe_pass as probe_pass_module
from growtrain.crossfit import (
    CrossFitState,
    cantelli_factor,
    crossfit_from_samples,
    crossfit_lower_bound,
    normal_quantile,
)
from growtrain.saturation import candidate_blocks, measure_saturation


def _load_bench(name: str):
    """A module of bench/ by file path: no sys.path change that would outlive this file."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# The Chen–Qin test is benchmark code (bench/chen_qin.py), not part of the library.
_chen_qin = _load_bench("chen_qin")
chen_qin_test, debiased_norm_sq, trace_sq_estimate = (
    _chen_qin.chen_qin_test, _chen_qin.debiased_norm_sq, _chen_qin.trace_sq_estimate
)

ALPHA = 0.05


def size_limit(alpha: float, draws: int) -> float:
    return alpha + 3 * math.sqrt(alpha * (1 - alpha) / draws)


# -- independent numpy oracle ------------------------------------------------------------------
def np_crossfit(xi: np.ndarray, level: float, bound: str) -> float:
    """u from the first ⌈n/2⌉ rows, s on the rest, mean/sd/quantile by numpy and scipy."""
    xi = np.asarray(xi, dtype=np.float64).reshape(xi.shape[0], -1)
    n_a = -(-xi.shape[0] // 2)
    g_a = xi[:n_a].mean(0)
    if not np.any(g_a):
        return -math.inf
    s = xi[n_a:] @ (g_a / np.linalg.norm(g_a))
    m, mean, sd = len(s), s.mean(), s.std(ddof=1)
    if bound == "normal":
        return mean - stats.norm.ppf(1 - level) * sd / math.sqrt(m)
    return mean - sd * math.sqrt((1 - level) / (level * m))


# -- pure functions --------------------------------------------------------------------------
def test_quantile_and_cantelli_factor():
    for p in (0.5, 0.9, 0.975, 1 - 0.05 / 13, 1e-4):
        assert normal_quantile(p) == pytest.approx(stats.norm.ppf(p), rel=1e-9, abs=1e-12)
    a, m = 0.05 / 13, 1000
    assert cantelli_factor(a, m) == pytest.approx(math.sqrt((1 - a) / (a * m)))
    # Cantelli is valid for any distribution: check it against its worst case (a two-point law)
    # for m = 1: P(X − μ ≥ λσ) ≤ 1/(1 + λ²) with equality attainable.
    lam = cantelli_factor(a, 1)
    assert 1 / (1 + lam**2) == pytest.approx(a)


@pytest.mark.parametrize("bound", ["normal", "cantelli"])
def test_lower_bound_matches_scipy(bound):
    gen = torch.Generator().manual_seed(0)
    s = torch.randn(5, 37, generator=gen, dtype=torch.float64) + 0.3
    for row in s:
        x = row.numpy()
        level = 0.01
        if bound == "normal":
            expected = x.mean() - stats.norm.ppf(1 - level) * x.std(ddof=1) / math.sqrt(len(x))
        else:
            expected = x.mean() - x.std(ddof=1) * math.sqrt((1 - level) / (level * len(x)))
        got = crossfit_lower_bound(row, level, bound)
        assert isinstance(got, float)
        assert got == pytest.approx(expected, rel=1e-12)
    batched = crossfit_lower_bound(s, 0.01, bound)
    assert batched.shape == (5,)
    assert torch.allclose(batched, torch.tensor([crossfit_lower_bound(r, 0.01, bound) for r in s], dtype=torch.float64))


# -- the streamed state equals the independent computation -------------------------------------
@pytest.mark.parametrize("bound", ["normal", "cantelli"])
def test_streamed_state_equals_numpy(bound):
    gen = torch.Generator().manual_seed(1)
    n, batch = 37, 8  # A = first 19 samples: the boundary falls inside the third batch
    xis = [
        torch.randn(n, 2, 3, generator=gen, dtype=torch.float64) + 0.4,  # a site with signal
        torch.randn(n, 5, generator=gen, dtype=torch.float64),  # pure noise
        torch.randn(n, 4, generator=gen, dtype=torch.float64) + torch.tensor([3.0, 0, 0, 0], dtype=torch.float64),
    ]
    state = CrossFitState(n, len(xis), bound=bound)
    for offset in range(0, n, batch):
        for j, xi in enumerate(xis):
            state.update(j, xi[offset : offset + batch], offset)
    lowers, info = state.lower_bounds(ALPHA)
    level = ALPHA / 3
    expected = [np_crossfit(xi.numpy(), level, bound) for xi in xis]
    assert lowers == pytest.approx(expected, rel=1e-10)
    # the pure in-memory version agrees too
    for xi, e in zip(xis, expected):
        assert float(crossfit_from_samples(xi.flatten(1), level, bound)) == pytest.approx(e, rel=1e-10)
    assert info["level"] == pytest.approx(level)
    assert (info["n_a"], info["n_b"], info["bound_kind"]) == (19, 18, bound)


def test_zero_direction_gives_minus_infinity():
    xi = torch.zeros(10, 3, dtype=torch.float64)
    xi[5:] = torch.randn(5, 3, dtype=torch.float64)  # B has data, A's mean is exactly 0
    state = CrossFitState(10, 1)
    state.update(0, xi, 0)
    assert state.lower_bounds(ALPHA)[0] == [-math.inf]
    assert float(crossfit_from_samples(xi, 0.05)) == -math.inf


# -- planted linear-Gaussian problem: per-sample gradients drawn directly ------------------------
def planted(draws, K, n, p, g, scales, seed):
    """``ξ = g + ε``, ``ε ~ N(0, diag(scales²))``: ``(draws, K, n, p)``; ``g: (K, p)``."""
    gen = torch.Generator().manual_seed(seed)
    eps = torch.randn(draws, K, n, p, generator=gen, dtype=torch.float64) * scales
    return g[None, :, None, :] + eps


def decisions(xi, delta, alpha, *, bonferroni: bool = True):
    """Grow decisions ``(draws,)`` of each rule on planted per-sample gradients.

    ``bonferroni=False`` is the deliberately broken variant: every site at level ``α``, not
    ``α/K`` (the negative control of the null-rate tests)."""
    draws, K, n, p = xi.shape
    mean = xi.mean(2)  # (draws, K, p)
    gamma = mean.norm(dim=-1).amax(1)
    total_var = ((xi - mean[:, :, None]) ** 2).sum((2, 3)).sum(1) / (n - 1)
    t = (total_var / (n * alpha)).sqrt()
    out = {"paper": gamma > delta + t}
    level = alpha / K if bonferroni else alpha
    for bound in ("normal", "cantelli"):
        lower = crossfit_from_samples(xi, level, bound)  # (draws, K)
        out[f"crossfit-{bound}"] = (lower > delta).any(1)
    return out


NULL_CASES = {
    # g = 0, δ = 0: the sharp null for the cross-fit test (E s = 0 exactly).
    "zero": dict(g_norm=0.0, spiked=False),
    # every site on the boundary ‖g_l‖ = δ, noise spiked (sd 3) along g, the least favourable
    # direction. ‖g‖ = 3 ≫ the noise of ĝ(A) (‖ε̄_A‖ ≈ sqrt(p/n_a) ≈ 0.6), so u ≈ g/‖g‖ and
    # E s = g·u sits just below δ: each site's rate is close to its level, and a level α per
    # site (no Bonferroni split) shows up in the union.
    "boundary": dict(g_norm=3.0, spiked=True),
}


@pytest.mark.parametrize("variant", ["alpha/K", "broken: alpha per site"])
@pytest.mark.parametrize("case", list(NULL_CASES))
def test_planted_null_rate_at_most_alpha(case, variant):
    """Size of the normal cross-fit rule on a planted null, with a negative control: the same
    draws decided at level α per site instead of α/K must exceed the size limit, so the test
    can tell the Bonferroni split from its absence. Measured (1000 draws): zero 0.056 vs 0.143,
    boundary 0.042 vs 0.114; limit α + 3 binomial sd = 0.071.

    Not rate-tested here: Cantelli's bound and the paper rule are so conservative that their
    null rate is 0 at both α and α/K at these sizes, so a rate test cannot see the split; the
    level they are computed at is checked where the decision uses it
    (``test_level_used_by_the_decision_is_alpha_over_K``)."""
    draws, K, n, p = 1000, 3, 120, 24
    cfg = NULL_CASES[case]
    scales = torch.ones(p, dtype=torch.float64)
    if cfg["spiked"]:
        scales[0] = 3.0
    g = torch.zeros(K, p, dtype=torch.float64)
    g[:, 0] = cfg["g_norm"]
    delta = cfg["g_norm"]
    grows = decisions(planted(draws, K, n, p, g, scales, 7), delta, ALPHA, bonferroni=variant == "alpha/K")
    rate = float(grows["crossfit-normal"].double().mean())
    if variant == "alpha/K":
        assert rate <= size_limit(ALPHA, draws), (case, rate)
        for rule in ("paper", "crossfit-cantelli"):  # conservative rules: at most the normal rule's rate
            assert float(grows[rule].double().mean()) <= size_limit(ALPHA, draws)
    else:
        assert rate > size_limit(ALPHA, draws), (case, rate)


def test_level_used_by_the_decision_is_alpha_over_K(monkeypatch):
    """The streamed decision computes its bounds at α/K, K = the number of scored sites: spy on
    the factor where the bound is computed and check the report's figures against it."""
    import growtrain.crossfit as crossfit_module

    used = []
    real = crossfit_module._bound_factor
    monkeypatch.setattr(crossfit_module, "_bound_factor", lambda level, m, b: used.append(level) or real(level, m, b))
    net = identity_stack()
    (x,), (y,) = planted_data(1, 40, torch.zeros(D), seed=2)
    for alpha in (0.05, 0.01):
        used.clear()
        report = measure_saturation(net, batches_of(x, y, (16, 16, 8)), half_sq_loss, rule="crossfit", alpha=alpha,
                                    projected=False)  # fmt: skip
        K = len(report.sites)
        assert K == 2 and used == [pytest.approx(alpha / K, rel=1e-15)]
        assert report.extra["level"] == pytest.approx(alpha / K, rel=1e-15)


def test_planted_power_crossfit_beats_paper():
    """A signal the paper's rule cannot see: ‖g‖ = 2 standard errors of ĝ (x = ‖g‖√n/σ = 2).

    The thresholds follow from the setup (σ² = p = 24, n = 120, K = 3, α = 0.05):
    paper: t = sqrt(Σ_l σ̂²_l/(nα)) ≈ sqrt(72/6) ≈ 3.5, while Γ̂ ≈ sqrt(‖g‖² + p/n) ≈ 1, so it
    essentially never grows (< 0.05);
    cross-fit normal: u from A (n_a = 60) has cos(u, g) ≈ ‖g‖/sqrt(‖g‖² + p/n_a) ≈ 0.82, so
    E s̄ ≈ 0.73 with sd 1/√60: z ≈ 5.6 against z_{1−α/K} ≈ 2.1, power ≈ Φ(3.5) > 0.99 (> 0.9
    asserted); Chen–Qin: the debiased ‖ĝ‖² ≈ 0.8 against sd sqrt(2p/(n(n−1))) ≈ 0.06, power ≈ 1."""
    draws, K, n, p = 500, 3, 120, 24
    scales = torch.ones(p, dtype=torch.float64)
    sigma = math.sqrt(p)  # σ² = tr Σ
    g = torch.zeros(K, p, dtype=torch.float64)
    g[1, 3] = 2.0 * sigma / math.sqrt(n)
    xi = planted(draws, K, n, p, g, scales, 11)
    rates = {rule: float(d.double().mean()) for rule, d in decisions(xi, 0.0, ALPHA).items()}
    assert rates["paper"] < 0.05, rates
    assert rates["crossfit-normal"] > 0.9, rates
    assert rates["crossfit-cantelli"] > rates["paper"], rates
    cq = chen_qin_test(xi[:, 1], 0.0, ALPHA / K).reject.double().mean()
    assert float(cq) > 0.9


# -- the debiased statistic and the Chen–Qin-style test -----------------------------------------
def test_debiased_norm_sq_identities():
    gen = torch.Generator().manual_seed(3)
    xi = torch.randn(9, 4, generator=gen, dtype=torch.float64) + 0.5
    n = 9
    g_hat = xi.mean(0)
    sigma2 = ((xi - g_hat) ** 2).sum() / (n - 1)
    pairs = sum(float(xi[i] @ xi[j]) for i in range(n) for j in range(n) if i != j) / (n * (n - 1))
    assert float(debiased_norm_sq(xi)) == pytest.approx(float(g_hat @ g_hat - sigma2 / n), rel=1e-12)
    assert float(debiased_norm_sq(xi)) == pytest.approx(pairs, rel=1e-12)


def test_trace_estimates():
    gen = torch.Generator().manual_seed(4)
    # 'full' equals the brute-force order-4 U-statistic
    xi = torch.randn(7, 5, generator=gen, dtype=torch.float64) * torch.rand(5, generator=gen, dtype=torch.float64) + 1.0
    u4 = [float(((xi[i] - xi[j]) @ (xi[k] - xi[l])) ** 2) / 4 for i, j, k, l in itertools.permutations(range(7), 4)]
    assert float(trace_sq_estimate(xi)) == pytest.approx(np.mean(u4), rel=1e-10)
    # both are unbiased (Monte Carlo, with a non-zero mean)
    scales = torch.tensor([2.0, 1.0, 1.0, 0.5, 0.1], dtype=torch.float64)
    draws = torch.randn(4000, 16, 5, generator=gen, dtype=torch.float64) * scales + 3.0
    truth = float((scales**4).sum())
    for method in ("full", "pairs"):
        est = trace_sq_estimate(draws, method, block=3)
        se = float(est.std() / math.sqrt(len(est)))
        assert abs(float(est.mean()) - truth) < 4 * se, method


def test_chen_qin_null_rate():
    draws, n, p = 600, 40, 300
    gen = torch.Generator().manual_seed(5)
    xi = torch.randn(draws, n, p, generator=gen, dtype=torch.float64)
    rate = float(chen_qin_test(xi, 0.0, ALPHA).reject.double().mean())
    assert rate <= size_limit(ALPHA, draws)
    # boundary ‖g‖ = δ > 0 with the noise spiked along g
    scales = torch.ones(p, dtype=torch.float64)
    scales[0] = 4.0
    delta = 0.8
    xi = xi * scales
    xi[..., 0] += delta
    rate = float(chen_qin_test(xi, delta, ALPHA).reject.double().mean())
    assert rate <= size_limit(ALPHA, draws)


# -- end to end through measure_saturation --------------------------------------------------------
D, H = 3, 2


class LinearFeatures(nn.Module):
    """``x + fc2(fc1 x)``: linear features, so the population gradient has a closed form."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(D, H)
        self.fc2 = nn.Linear(H, D)

    def forward(self, x):
        return x + self.fc2(self.fc1(x))


class FastLinearFeatures(LinearFeatures):
    """The same block with the probe's fast dense form (``ξ = q [φ, 1]ᵀ``, no torch.func)."""

    def terminal_parameters(self):
        return [self.fc2.weight, self.fc2.bias]

    def probe_features(self, z):
        return DenseFeatures(self.fc1(z), bias=True)


def fast_copies(cands):
    out = {}
    for name, adapter in cands.items():
        out[name] = FastLinearFeatures().double()
        out[name].load_state_dict(adapter.block.state_dict())
    return out


def zero_block():
    block = LinearFeatures()
    with torch.no_grad():
        block.fc2.weight.zero_()
        block.fc2.bias.zero_()
    return block


def identity_stack():
    """One zero-output block (the network is the identity); sites blocks.0 and blocks.1."""
    torch.manual_seed(0)
    return GrowableStack([zero_block()], zero_block, ("fc2.weight", "fc2.bias")).double()


def half_sq_loss(out, y):
    return 0.5 * ((out - y) ** 2).sum(1).mean()


def planted_data(draws, n, c, seed):
    """``x ~ N(0, I)``, ``y = x + w − c``: the activation gradient is ``q = c − w`` at every site,
    so with features ``φ = W₁x + b₁`` the population gradient is ``(c b₁ᵀ, c)``."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(draws, n, D, generator=gen, dtype=torch.float64)
    w = torch.randn(draws, n, D, generator=gen, dtype=torch.float64)
    return x, x + w - torch.as_tensor(c, dtype=torch.float64)


def by_hand_xi(block, x, y):
    """Per-sample ``ξ_i = (q_i φ_iᵀ, q_i)`` of a candidate, ``q_i = x_i − y_i``: ``(n, D·H + D)``."""
    q = x - y
    phi = block.block.fc1(x).detach()
    return torch.cat([(q[:, :, None] * phi[:, None, :]).flatten(1), q], dim=1)


def batches_of(x, y, sizes):
    out, start = [], 0
    for size in sizes:
        out.append((x[start : start + size], y[start : start + size]))
        start += size
    return out


def test_end_to_end_null_rate(monkeypatch):
    """g = 0 at every site (y = x + noise), δ = 0, through measure_saturation: the cross-fit
    rule (normal bound) grows at rate ≤ α. Negative control on the same passes: the bounds
    recomputed from the same streamed state at level α per site (no Bonferroni split, K = 5)
    must exceed the limit (measured: 0.033 vs 0.133, limit 0.083). Cantelli's bound is too conservative for a rate test to see the
    split (its rate is 0 either way); instead every pass checks that it lies below the normal
    bound at the same level, so its rate is at most the normal rule's."""
    broken, dominated = [], []
    real = CrossFitState.lower_bounds

    def spy(self, alpha):
        lowers, info = real(self, alpha)
        broken.append(max(real(self, alpha * self.K)[0]) > 0)  # pure without sync_fn
        self.bound = "cantelli"
        dominated.append(all(c <= l for c, l in zip(real(self, alpha)[0], lowers)))
        self.bound = "normal"
        return lowers, info

    monkeypatch.setattr(CrossFitState, "lower_bounds", spy)
    draws, n = 400, 64
    torch.manual_seed(0)
    net = GrowableStack([zero_block() for _ in range(4)], zero_block, ("fc2.weight", "fc2.bias")).double()  # K = 5
    cands = fast_copies(candidate_blocks(net, seed=0))  # the dense fast path: ~10 ms a call
    K = len(net.sites())
    xs, ys = planted_data(draws, n, torch.zeros(D), seed=21)
    grows = 0
    for x, y in zip(xs, ys):
        report = measure_saturation(
            net, batches_of(x, y, (24, 24, 16)), half_sq_loss, rule="crossfit", candidates=cands, projected=False, probe_size=n,
        )
        grows += not report.saturated
    rates = {"alpha/K": grows / draws, "broken": sum(broken) / draws}
    assert K == 5 and len(broken) == draws and all(dominated)
    assert rates["alpha/K"] <= size_limit(ALPHA, draws), rates
    assert rates["broken"] > size_limit(ALPHA, draws), rates


def test_end_to_end_lower_equals_oracle_and_grows_at_best_site():
    n = 200
    net = identity_stack()
    cands = candidate_blocks(net, seed=0)
    c = torch.tensor([0.0, 0.0, 0.5], dtype=torch.float64)
    (x,), (y,) = planted_data(1, n, c, seed=3)
    batches = batches_of(x, y, (64, 64, 64, 8))  # A = first 100: split inside the second batch
    report = measure_saturation(net, batches, half_sq_loss, rule="crossfit", candidates=cands, projected=False,
                                variance=True)  # fmt: skip
    assert report.n == n and report.rule == "crossfit"
    level = ALPHA / 2
    for record in report.sites:
        xi = by_hand_xi(record.block, x, y)
        assert record.lower == pytest.approx(np_crossfit(xi.numpy(), level, "normal"), rel=1e-9)
    # population gradients ‖g_l‖ = ‖c‖ sqrt(‖b₁‖² + 1); the lower bound must not exceed them here
    b1_sq = {name: float(b.block.fc1.bias.detach().pow(2).sum()) for name, b in cands.items()}
    true = {name: float(c.norm()) * math.sqrt(v + 1) for name, v in b1_sq.items()}
    assert all(r.lower <= true[r.name] for r in report.sites)
    assert not report.saturated
    assert report.best_site == max(report.sites, key=lambda r: r.lower).name
    assert report.threshold > report.gamma  # the paper's rule, reported alongside, sees nothing
    assert report.extra["paper_decision"] == "saturated"


def folded_oracle(net, site, fresh_block, a_parts, b_parts, loss, forward_first: bool):
    """The cross-fit check of one site with its calibration folded into the pass, by explicit
    insertion and autograd: the block is really inserted; on each part of half A its BatchNorms
    run in train mode (batch statistics, accumulated with momentum=None into the running ones)
    and autograd gives Σ ξ over the part (``forward_first``: a block without a feature form,
    which accumulates the part's statistics in a train-mode forward of its own first and is then
    scored in eval mode); B is scored in eval mode with A's statistics, one sample at a time.
    Returns (u, s on B, the inserted block)."""
    from helpers import insert_copy

    block = copy.deepcopy(fresh_block)
    bns = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    net2, inserted = insert_copy(net, site, block)
    bns = [m for m in inserted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    params = list(inserted.terminal_parameters())
    sum_a = 0
    for bx, by in a_parts:
        if forward_first:
            with torch.no_grad():
                for bn in bns:
                    bn.train()
                net2(bx)
                for bn in bns:
                    bn.eval()
        else:
            for bn in bns:
                bn.train()
        grads = torch.autograd.grad(loss(net2(bx), by) * len(by), params)  # Σ over the part of ξ_i
        for bn in bns:
            bn.eval()
        sum_a = sum_a + torch.cat([g.flatten() for g in grads])
    u = sum_a / sum_a.norm()
    s = []
    for bx, by in b_parts:
        for i in range(len(by)):
            grads = torch.autograd.grad(loss(net2(bx[i : i + 1]), by[i : i + 1]), params)
            s.append(float(torch.cat([g.flatten() for g in grads]) @ u))
    return u, np.array(s), inserted


@pytest.mark.parametrize("kind", ["generic", "preact", "basic"])
@pytest.mark.parametrize("variance", [False, True])
def test_end_to_end_net_matches_explicit_insertion_with_folded_calibration(kind, variance):
    """BatchNorm candidates calibrated on half A within the probe pass (no pass of their own):
    every site's lower bound and running statistics equal an explicit-insertion autograd oracle
    of the same protocol, through the directional-derivative path (variance=False: no
    per-sample gradient of a conv is formed) and the per-sample one (variance=True)."""
    from helpers import loss_fn, make_net, probe_batches

    net = make_net(kind)
    batches = probe_batches(kind, n=21, batch=8)  # A = the first 11: batch 0 and 3 samples of batch 1
    cands = candidate_blocks(net, seed=0)
    fresh = copy.deepcopy(cands)
    report = measure_saturation(net, batches, loss_fn, rule="crossfit", candidates=cands, variance=variance)
    (x1, y1) = batches[1]
    a_parts = [batches[0], (x1[:3], y1[:3])]
    b_parts = [(x1[3:], y1[3:]), *batches[2:]]
    level = ALPHA / len(report.sites)
    for record in report.sites:
        u, s, inserted = folded_oracle(net, record.site, fresh[record.name], a_parts, b_parts, loss_fn,
                                       forward_first=kind == "generic")  # fmt: skip
        bns = [m for m in record.block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        ref_bns = [m for m in inserted.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert bns and len(bns) == len(ref_bns)
        for bn, ref_bn in zip(bns, ref_bns):
            assert torch.allclose(bn.running_mean, ref_bn.running_mean)
            assert torch.allclose(bn.running_var, ref_bn.running_var)
            assert float(bn.running_var.max()) != 1.0  # calibrated, not fresh
        m = len(s)
        expected = s.mean() - normal_quantile(1 - level) * s.std(ddof=1) / math.sqrt(m)
        assert record.lower == pytest.approx(expected, rel=1e-7, abs=1e-10), record.name
        assert (record.variance is None) == (not variance)


@pytest.mark.parametrize("kind, n, rule, counted", [
    ("dense", 17, "crossfit", 1),  # A = 9 = a batch of 8 and a cut of 1 sample
    ("preact", 17, "crossfit", 1),
])  # fmt: skip
def test_folded_calibration_skips_single_sample_parts(kind, n, rule, counted):
    """A one-sample part of half A has no batch statistics (BatchNorm1d refuses it): it is scored
    with the statistics so far and adds none, instead of failing the check."""
    from helpers import loss_fn, make_net, probe_batches

    net = make_net(kind)
    cands = candidate_blocks(net, seed=0)
    report = measure_saturation(net, probe_batches(kind, n=n, batch=8), loss_fn, rule=rule, candidates=cands)
    assert all(math.isfinite(r.lower) for r in report.sites)
    for block in cands.values():
        bns = [m for m in block.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
        assert bns and all(int(bn.num_batches_tracked) == counted for bn in bns)


class StridedGhost(PreActBlock):
    """A preact ghost whose terminal conv has stride 2, dilation 2 and a bias, on features at twice
    the site's resolution (so that its output has the site's shape)."""

    def terminal_parameters(self):
        return [self.conv2.weight, self.conv2.bias]

    def probe_features(self, z):
        c = self.conv2
        phi = F.interpolate(self.features(z), scale_factor=2.0)
        return DenseFeatures(phi, bias=True, conv=(c.kernel_size, c.dilation, c.padding, c.stride))

    def split_terminal(self, matrix):
        return [matrix[:, :-1].reshape(self.conv2.weight.shape), matrix[:, -1]]


def strided_ghost(block: nn.Module) -> nn.Module:
    ghost = copy.deepcopy(block)
    ghost.__class__ = StridedGhost
    old = ghost.conv2
    ghost.conv2 = nn.Conv2d(old.in_channels, old.out_channels, 3, stride=2, dilation=2, padding=2, dtype=old.weight.dtype)
    nn.init.zeros_(ghost.conv2.weight)
    nn.init.zeros_(ghost.conv2.bias)
    return ghost


@pytest.mark.parametrize("kind", ["preact", "dense", "gpt", "strided", "generic"])
def test_directional_derivatives_equal_the_per_sample_gradient_path(kind):
    """The cross-fit bound from directional derivatives (variance=False: ``Σ ξ`` as one batched
    weight gradient, ``ξ_i·u`` as a forward of the terminal map with ``u`` as its weight) equals
    the bound from per-sample gradients (variance=True) to float tolerance, as do ĝ and AG; and
    the directional path forms no per-sample gradient; V_S (projected=True) agrees too. ``strided``: a conv terminal map with
    stride 2 and dilation 2 (the patches path of the per-sample code); ``generic``: a user's block
    without a feature form (torch.func VJP and JVP instead of per-sample VJPs)."""
    from helpers import loss_fn, make_net, probe_batches

    if kind == "gpt":
        from growtrain.models import gpt

        torch.manual_seed(0)
        from growtrain.lm import LanguageModel

        net = gpt(vocab_size=11, block_size=6, d_model=8, n_head=2, n_layer=2).double().eval()
        x = torch.randint(0, 11, (22, 7))
        batches = [(x[i : i + 8, :-1], x[i : i + 8, 1:]) for i in (0, 8, 16)]
        loss = LanguageModel.probe_loss
    elif kind == "strided":
        net = make_net("preact")
        batches = probe_batches("preact", n=22, batch=8)
        loss = loss_fn
    else:
        net = make_net(kind)
        batches = probe_batches(kind, n=22, batch=8)
        loss = loss_fn
    cands = candidate_blocks(net, seed=0)
    if kind == "strided":
        cands = {name: strided_ghost(block) for name, block in cands.items()}
    # a block without a feature form needs per-sample Jacobians for V_S: its directional path
    # (a VJP for Σ ξ, a JVP for ξ_i·u) is tested without
    projected = kind != "generic"
    reports = {}
    formed = {}
    real_update = probe_pass_module.SiteAccumulator.update

    for variance in (False, True):
        seen = []

        def spy(self, *args, **kwargs):
            real_update(self, *args, **kwargs)
            seen.append(self.per_sample_formed)

        probe_pass_module.SiteAccumulator.update = spy
        try:
            reports[variance] = measure_saturation(net, batches, loss, rule="crossfit", candidates=copy.deepcopy(cands),
                                                   variance=variance, projected=projected, calibrate=False)  # fmt: skip
        finally:
            probe_pass_module.SiteAccumulator.update = real_update
        formed[variance] = any(seen)
    assert formed == {False: False, True: True}
    for a, b in zip(reports[False].sites, reports[True].sites):
        assert math.isfinite(b.lower)
        assert a.lower == pytest.approx(b.lower, rel=1e-9, abs=1e-12), a.name
        assert a.grad_norm == pytest.approx(b.grad_norm, rel=1e-9), a.name
        assert a.ag == pytest.approx(b.ag, rel=1e-12), a.name
        if projected:
            assert a.projected == pytest.approx(b.projected, rel=1e-9), a.name  # V_S's Gram in both paths
        assert all(torch.allclose(g, h, rtol=1e-9, atol=1e-14) for g, h in zip(a.grad, b.grad))


class ThreadSum:
    """A stand-in for an all-reduce over ``world`` ranks that run as threads."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=60)
        self.slots: list = [None] * world
        self.calls = [0] * world

    def for_rank(self, rank: int):
        def sync(t: torch.Tensor) -> torch.Tensor:
            self.calls[rank] += 1
            self.slots[rank] = t.detach().clone()
            self.barrier.wait()
            out = torch.stack(self.slots).sum(0)
            self.barrier.wait()
            return out

        return sync


def test_ddp_two_ranks_match_union_of_per_rank_halves():
    """Two ranks as threads with unequal shards (50 and 31 samples, as an unpadded sharding gives):
    rank 1 reaches its A/B boundary one batch before rank 0 and waits there in the all-reduce."""
    sizes, batch_sizes = (50, 31), ((16, 16, 16, 2), (16, 15))
    world = len(sizes)
    net = identity_stack()
    cands = candidate_blocks(net, seed=0)
    c = torch.tensor([0.3, 0.0, 0.0], dtype=torch.float64)
    data = [planted_data(1, n, c, seed=9 + r) for r, n in enumerate(sizes)]
    xs, ys = [d[0][0] for d in data], [d[1][0] for d in data]
    sync = ThreadSum(world)
    reports, errors = [None] * world, []
    nets = [copy.deepcopy(net) for _ in range(world)]  # one replica per rank (hooks are per network)
    rank_cands = [copy.deepcopy(cands) for _ in range(world)]

    def run(rank):
        try:
            reports[rank] = measure_saturation(
                nets[rank], batches_of(xs[rank], ys[rank], batch_sizes[rank]), half_sq_loss, rule="crossfit",
                candidates=rank_cands[rank], projected=False, sync_fn=sync.for_rank(rank),
            )
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)
            sync.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(world)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    assert sync.calls[0] == sync.calls[1]
    assert [r.lower for r in reports[0].sites] == [r.lower for r in reports[1].sites]
    assert reports[0].n == sum(sizes)
    assert (reports[0].extra["n_a"], reports[0].extra["n_b"]) == (25 + 16, 25 + 15)
    # independent: A = first ⌈n_r/2⌉ of each rank's shard, B = the rest, pooled
    for record in reports[0].sites:
        xis = [by_hand_xi(cands[record.name], xs[r], ys[r]).numpy() for r in range(world)]
        halves = [math.ceil(n / 2) for n in sizes]
        a = np.concatenate([xi[:h] for xi, h in zip(xis, halves)])
        b = np.concatenate([xi[h:] for xi, h in zip(xis, halves)])
        g_a = a.mean(0)
        s = b @ (g_a / np.linalg.norm(g_a))
        expected = s.mean() - stats.norm.ppf(1 - ALPHA / 2) * s.std(ddof=1) / math.sqrt(len(s))
        assert record.lower == pytest.approx(expected, rel=1e-9)


def test_ddp_folded_calibration_equals_one_process_on_the_same_halves():
    """Two ranks as threads, preact ghosts with BatchNorms calibrated inside the pass: at each
    site's A/B boundary the ranks average their statistics (one all-reduce), so the bounds and
    statistics equal one process that sees rank 0's A, rank 1's A, rank 0's B, rank 1's B."""
    from helpers import loss_fn, make_net, probe_batches

    net = make_net("preact")
    data = [probe_batches("preact", n=16, batch=8, seed=20 + r) for r in range(2)]  # per rank: A = batch 0
    cands = candidate_blocks(net, seed=0)
    sync = ThreadSum(2)
    reports, errors = [None, None], []
    nets = [copy.deepcopy(net) for _ in range(2)]
    rank_cands = [copy.deepcopy(cands) for _ in range(2)]

    def run(rank):
        try:
            reports[rank] = measure_saturation(nets[rank], data[rank], loss_fn, rule="crossfit", candidates=rank_cands[rank],
                                               projected=False, sync_fn=sync.for_rank(rank))  # fmt: skip
        except Exception as exc:  # pragma: no cover - surfaced below
            errors.append(exc)
            sync.barrier.abort()

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    assert not errors, errors
    one = copy.deepcopy(cands)
    single = measure_saturation(net, [data[0][0], data[1][0], data[0][1], data[1][1]], loss_fn, rule="crossfit",
                                candidates=one, projected=False)  # fmt: skip
    for r0, r1, s1 in zip(reports[0].sites, reports[1].sites, single.sites):
        assert r0.lower == r1.lower and r0.lower == pytest.approx(s1.lower, rel=1e-9, abs=1e-12), r0.name
        assert r0.grad_norm == pytest.approx(s1.grad_norm, rel=1e-9), r0.name
        for bn, ref in zip(rank_cands[1][r0.name].modules(), one[r0.name].modules()):
            if isinstance(bn, nn.modules.batchnorm._BatchNorm):
                assert torch.allclose(bn.running_mean, ref.running_mean) and torch.allclose(bn.running_var, ref.running_var)


# -- errors ----------------------------------------------------------------------------------
def test_errors():
    net = identity_stack()
    (x,), (y,) = planted_data(1, 20, torch.zeros(D), seed=0)
    batches = batches_of(x, y, (10, 10))

    def unsized():
        yield from batches

    with pytest.raises(TypeError, match="probe_size"):
        measure_saturation(net, unsized(), half_sq_loss, rule="crossfit", projected=False)
    report = measure_saturation(net, unsized(), half_sq_loss, rule="crossfit", projected=False, probe_size=20)
    assert report.extra["n_a"] == 10
    with pytest.raises(ValueError, match="alpha"):  # t given: the paper rule ignores α, cross-fit needs it
        measure_saturation(net, batches, half_sq_loss, rule="crossfit", t=0.1, alpha=1.5)
    with pytest.raises(ValueError, match="probe_size"):
        measure_saturation(net, batches, half_sq_loss, rule="crossfit", probe_size=2)
    with pytest.raises(ValueError, match="expected n=40"):  # the loader yields fewer than announced
        measure_saturation(net, batches[:1], half_sq_loss, rule="crossfit", probe_size=40, projected=False)
    with pytest.raises(ValueError, match="level"):
        crossfit_lower_bound(torch.randn(10), 0.0)
    with pytest.raises(ValueError, match="bound"):
        crossfit_lower_bound(torch.randn(10), 0.05, "chebyshev")
    with pytest.raises(ValueError, match="alpha"):
        chen_qin_test(torch.randn(10, 3), 0.0, alpha=1.0)
    with pytest.raises(ValueError, match="alpha"):
        CrossFitState.for_loader(batches, 2, n=20, alpha=-0.1)


def test_bn_candidates_calibrated_on_a_planted_null(monkeypatch):
    """Candidates with a BatchNorm (helpers.DenseBlock, calibrated on half A as in a check) on a
    planted null: y = net(x) + w with noise w independent of x, so at the fitted network the
    activation gradient q = −w is independent of every candidate's features, whatever their
    calibrated statistics: g = 0 at every site. The cross-fit rule grows at rate ≤ α. Negative
    control on the same passes: the bounds recomputed from the same streamed state at level α
    per site (no Bonferroni split) must exceed the limit (measured: 0.043 vs 0.147, limit 0.088,
    K = 4 sites; at 200 draws the margin was too thin)."""
    from helpers import DenseBlock

    def zero_dense():
        block = DenseBlock()
        block.zero_init_last()
        return block.double()

    broken = []  # per pass: does any site's bound at level α (not α/K) exceed δ = 0?
    real = CrossFitState.lower_bounds

    def spy(self, alpha):
        broken.append(max(real(self, alpha * self.K)[0]) > 0)  # pure without sync_fn
        return real(self, alpha)

    monkeypatch.setattr(CrossFitState, "lower_bounds", spy)
    torch.manual_seed(0)
    net = GrowableStack([DenseBlock() for _ in range(3)], zero_dense, ("fc2.weight", "fc2.bias")).double().eval()
    K = len(net.sites())
    draws, n = 300, 32
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(draws, n, 4, generator=gen, dtype=torch.float64) * 1.5 + 0.5  # BN statistics ≠ (0, 1)
    w = torch.randn(draws, n, 4, generator=gen, dtype=torch.float64)
    with torch.no_grad():
        y = net(x.reshape(-1, 4)).reshape(draws, n, 4) + w
    grows = 0
    for d in range(draws):
        gen_c = torch.Generator().manual_seed(d)
        cands = {}
        for site in net.sites():  # a fresh random first layer per draw, as a check's seed gives
            cands[site.name] = zero_dense()
            with torch.no_grad():
                cands[site.name].fc1.weight.copy_(torch.randn(3, 4, generator=gen_c, dtype=torch.float64))
        report = measure_saturation(net, batches_of(x[d], y[d], (16, 16)), half_sq_loss, rule="crossfit",
                                    alpha=ALPHA, candidates=cands, projected=False, calibrate=True)  # fmt: skip
        grows += not report.saturated
        assert report.extra["level"] == pytest.approx(ALPHA / K)
        assert float(cands[net.sites()[0].name].bn.running_var.max()) != 1.0  # calibrated, not fresh
    rates = {"alpha/K": grows / draws, "broken": sum(broken) / draws}
    assert len(broken) == draws and K == 4
    assert rates["alpha/K"] <= size_limit(ALPHA, draws), rates
    assert rates["broken"] > size_limit(ALPHA, draws), rates
