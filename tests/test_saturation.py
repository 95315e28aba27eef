"""Independent-oracle tests for the saturation certificate (``measure_saturation``).

Every number the certificate reports is recomputed the obvious way — real insertion of the
scored block with ``grow`` and plain autograd, one sample at a time, or explicit per-sample
Jacobians and ``torch.linalg.pinv`` — never from the library's own output (tests/helpers.py).
Families (``kind``): ``preact``, ``basic``, a user-defined MLP block through ``GrowableStack``
(the generic ``torch.func`` path) and a user's own growable network whose block has a
``DenseFeatures`` fast form with a bias column (``dense``); plus a planted linear-Gaussian
problem whose population gradient is known in closed form. Whole file: ~20 s on 2 cores.
"""

from __future__ import annotations

import copy
import io
import json
import math
import time

import pytest
import torch
from torch import nn
from torch.nn import functional as F

from growtrain import GrowableStack
from growtrain.families import PreActBlock, ResidualAdapter
from growtrain.families.base import DenseFeatures
from growtrain.growable import GrowableMixin, terminal_parameters
from growtrain.models import cifar_resnet
from growtrain.saturation import measure_saturation

try:
    from tests import helpers as H
except ImportError:  # pragma: no cover - pytest's rootdir-less import mode
    import helpers as H

REL = 1e-5


def rel_err(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-300)


# -- one probe + the oracles per family, shared by the tests below -------------------------------
_CACHE: dict = {}


def scored(kind: str):
    """(net, batches, report, {site name: SiteOracle}) for a tiny float64 network of ``kind``."""
    if kind not in _CACHE:
        net = H.make_net(kind, seed=0)
        batches = H.probe_batches(kind, n=20, batch=8)  # batches of 8, 8, 4
        report = measure_saturation(net, batches, H.loss_fn, alpha=0.05, seed=7)
        oracles = {r.name: H.site_oracle(net, r.site, r.block, batches) for r in report.sites}
        _CACHE[kind] = (net, batches, report, oracles)
    return _CACHE[kind]


@pytest.fixture(params=H.KINDS)
def kind(request):
    return request.param


# -- 1. grad_norm / grad against real insertion ------------------------------------------------
def test_records_follow_sites_and_blocks_are_zero_output(kind):
    net, _, report, _ = scored(kind)
    assert [r.site for r in report.sites] == net.sites()
    assert [r.name for r in report.sites] == [s.name for s in net.sites()]
    for r in report.sites:
        assert all(torch.count_nonzero(p) == 0 for p in terminal_parameters(r.block))
        assert [tuple(g.shape) for g in r.grad] == [tuple(p.shape) for p in terminal_parameters(r.block)]
        assert not any(r.block is m for m in net.modules())  # a candidate, not part of the network
    assert report.n == 20


def test_grad_matches_real_insertion(kind):
    net, _, report, oracles = scored(kind)
    assert len(report.sites) >= 3
    for r in report.sites:
        o = oracles[r.name]
        assert o.grad_norm > 1e-6, f"{r.name}: degenerate test setup (zero gradient)"
        assert rel_err(r.grad_norm, o.grad_norm) <= REL, (r.name, r.grad_norm, o.grad_norm)
        for got, want in zip(r.grad, o.grad):
            assert got.shape == want.shape
            assert float((got - want).norm()) <= 1e-7 * o.grad_norm, r.name
        # the per-sample gradients average to ĝ (a consistency check of the oracle itself)
        assert torch.allclose(o.xi.mean(0), H.flat(o.grad), rtol=1e-9, atol=1e-13)


def test_grow_inserts_the_scored_block_unchanged(kind):
    """The record's block really is the block whose gradient is reported (same U₀)."""
    net, batches, report, oracles = scored(kind)
    r = report.best_record
    net2, inserted = H.insert_copy(net, r.site, r.block)
    for (n1, p1), (n2, p2) in zip(r.block.named_parameters(), inserted.named_parameters()):
        assert n1 == n2 and torch.equal(p1, p2)
    for (n1, b1), (n2, b2) in zip(r.block.named_buffers(), inserted.named_buffers()):
        assert torch.equal(b1, b2)


# -- 2. AG (Remark 1) and AG_batch (Eq. 2) -------------------------------------------------------
def test_ag_and_ag_batch(kind):
    _, _, report, oracles = scored(kind)
    for r in report.sites:
        o = oracles[r.name]
        assert rel_err(r.ag, o.ag) <= REL, (r.name, r.ag, o.ag)
        assert rel_err(r.ag_batch, o.ag_batch) <= REL, (r.name, r.ag_batch, o.ag_batch)
    assert report.ag_max == max(r.ag for r in report.sites)


# -- 3. projected growth value V_S (Lemma 4) ------------------------------------------------------
def test_projected_matches_brute_force_pinv(kind):
    _, _, report, oracles = scored(kind)
    for r in report.sites:
        o = oracles[r.name]
        jac = H.block_jacobians(o.block, o.z)  # (n, out, p) on the really-inserted block
        # J_iᵀ q_i is sample i's gradient: ties the Jacobians to the autograd oracle
        assert torch.allclose(torch.einsum("nop,no->np", jac, o.q), o.xi, rtol=1e-9, atol=1e-14)
        want = H.brute_projected(H.flat(o.grad), jac)
        assert want > 0
        assert rel_err(r.projected, want) <= 1e-6, (r.name, r.projected, want)
        assert r.projected <= r.ag * (1 + 1e-9)
        assert r.realisability == pytest.approx(r.projected / r.ag)


@pytest.mark.parametrize("case", ["well_conditioned", "duplicate_column", "rank_deficient", "near_cutoff"])
def test_quadratic_pinv_equals_the_pseudo_inverse(case, monkeypatch):
    """tr(C A† Cᵀ) by Cholesky where safe, else by eigenvalues, against torch.linalg.pinv; the
    Cholesky path is taken only where no eigenvalue is near the pseudo-inverse's cutoff."""
    from growtrain import probe_math as pm

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(200, 12, dtype=torch.float64, generator=gen)
    if case == "duplicate_column":
        x = torch.cat([x, x[:, 3:4]], dim=1)  # the same feature twice: A singular, V_S unchanged
    elif case == "rank_deficient":
        x = x[:, :6] @ torch.randn(6, 12, dtype=torch.float64, generator=gen)
    elif case == "near_cutoff":
        x[:, -1] = x[:, 0] + x[:, 1] + 1e-9 * x[:, 2]  # λ_min ≈ 1e-19 λ_max: below the cutoff, no duplicate
    gram = x.T @ x
    grad = (torch.randn(5, 200, dtype=torch.float64, generator=gen) @ x) / 200  # in the span of the features
    eig_calls = []
    real = pm.psd_pinv
    monkeypatch.setattr(pm, "psd_pinv", lambda *a, **k: eig_calls.append(1) or real(*a, **k))
    value = pm.quadratic_pinv(grad, gram)
    want = ((grad @ torch.linalg.pinv(gram, hermitian=True, rtol=12 * 2.2e-16)) * grad).sum()
    assert float(value) == pytest.approx(float(want), rel=1e-8)
    assert bool(eig_calls) == (case in ("rank_deficient", "near_cutoff"))


@pytest.mark.parametrize("shape, kernel, padding", [
    ((3, 2, 5, 4), (3, 3), (1, 1)), ((2, 3, 6, 6), (5, 5), (2, 2)), ((2, 2, 4, 5), (3, 1), (1, 0)),
    ((2, 3, 4, 4), (1, 1), (0, 0)), ((4, 5, 8, 8), (3, 3), (1, 1)),
])  # fmt: skip
@pytest.mark.parametrize("bias", [False, True])
def test_conv_gram_equals_the_gram_of_unfolded_patches(shape, kernel, padding, bias):
    """The patch-free Gram (lag sums minus the border each shift misses) against F.unfold."""
    from growtrain.probe_math import conv_gram

    phi = torch.randn(*shape, dtype=torch.float64, generator=torch.Generator().manual_seed(sum(shape)))
    patches = F.unfold(phi, kernel, padding=padding).transpose(1, 2)  # (B, P, C·k²), unfold's order
    if bias:
        patches = torch.cat([patches, patches.new_ones(patches.shape[:-1] + (1,))], dim=-1)
    flat = patches.reshape(-1, patches.shape[-1])
    assert torch.allclose(conv_gram(phi, kernel, padding, bias=bias), flat.T @ flat, rtol=1e-12, atol=1e-12)
    if kernel != (1, 1):
        with pytest.raises(ValueError, match="same"):
            conv_gram(phi, kernel, (0, 0))


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_projected_never_exceeds_ag(kind, seed):
    net = H.make_net(kind, seed=seed, blocks=(2, 1, 1))
    batches = H.probe_batches(kind, n=12, batch=6, seed=seed)
    report = measure_saturation(net, batches, H.loss_fn, seed=seed)
    for r in report.sites:
        assert 0 <= r.projected <= r.ag * (1 + 1e-9), (r.name, r.projected, r.ag)


def test_projected_false_skips_it(kind):
    net, batches, report, _ = scored(kind)
    plain = measure_saturation(net, batches, H.loss_fn, seed=7, projected=False)
    assert all(r.projected is None and r.realisability is None for r in plain.sites)
    assert [r.grad_norm for r in plain.sites] == pytest.approx([r.grad_norm for r in report.sites], rel=1e-12)


class ScaledMLP(nn.Module):
    """``x + c · fc2(relu(bn(fc1(x))))``: the same tangent space for every ``c ≠ 0``."""

    def __init__(self, c: float):
        super().__init__()
        self.c = c
        self.fc1 = nn.Linear(4, 3)
        self.bn = nn.BatchNorm1d(3)
        self.fc2 = nn.Linear(3, 4)

    def forward(self, x):
        return x + self.c * self.fc2(torch.relu(self.bn(self.fc1(x))))


class ScaledPreAct(PreActBlock):
    """A pre-activation block whose terminal conv output is multiplied by ``c``."""

    def __init__(self, width: int, c: float):
        super().__init__(width, width, 1)
        self.c = c

    def features(self, z):
        return self.c * super().features(z)  # conv2(c·φ) = c·conv2(φ): no bias

    def forward(self, z):
        return z + self.conv2(self.features(z))


def _scaled_candidates(net, kind: str, c: float, seed: int = 11) -> dict:
    out = {}
    for j, site in enumerate(net.sites()):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed + j)  # the same U₀ for every c
            if kind == "generic":
                block = ResidualAdapter(ScaledMLP(c), H.MLP_TERMINAL)
            else:
                width = net.widths[net.growable_stages.index(site.stage)]
                block = ScaledPreAct(width, c)
        block.zero_init_last()
        out[site.name] = block.to(torch.float64)
    return out


@pytest.mark.parametrize("kind_", ["generic", "preact"])
def test_projected_is_invariant_to_reparameterisation(kind_):
    """Remark 2: V_S depends only on the tangent space; ‖ĝ‖ scales with the coordinates."""
    net = H.make_net(kind_, seed=4)
    batches = H.probe_batches(kind_, n=16, batch=8, seed=5)
    reports = {
        c: measure_saturation(net, batches, H.loss_fn, candidates=_scaled_candidates(net, kind_, c)) for c in (1.0, 3.0)
    }
    for r1, r3 in zip(reports[1.0].sites, reports[3.0].sites):
        assert rel_err(r3.projected, r1.projected) <= 1e-6, (r1.name, r1.projected, r3.projected)
        assert rel_err(r3.grad_norm, 3.0 * r1.grad_norm) <= 1e-9
        assert rel_err(r3.ag, r1.ag) <= 1e-9  # the activation gradient does not see V at all
    # and the c = 3 numbers are right, not just consistent: real insertion of the scaled block
    r = reports[3.0].best_record
    o = H.site_oracle(net, r.site, r.block, batches)
    assert rel_err(r.grad_norm, o.grad_norm) <= REL
    assert rel_err(r.projected, H.brute_projected(H.flat(o.grad), H.block_jacobians(o.block, o.z))) <= 1e-6


# -- 4. variance and the decision (Proposition 1) ------------------------------------------------
def test_variance_matches_per_sample_loop(kind):
    _, _, report, oracles = scored(kind)
    for r in report.sites:
        o = oracles[r.name]
        assert rel_err(r.variance, o.variance) <= REL, (r.name, r.variance, o.variance)


def test_decision_arithmetic(kind):
    net, batches, report, oracles = scored(kind)
    n = 20
    total_var = sum(o.variance for o in oracles.values())
    gamma = max(o.grad_norm for o in oracles.values())
    assert report.n == n
    assert rel_err(report.gamma, gamma) <= REL
    assert rel_err(report.t, math.sqrt(total_var / (n * 0.05))) <= REL
    assert report.threshold == report.delta + report.t
    assert rel_err(report.error_bound, min(1.0, total_var / (n * report.t**2))) <= REL
    assert report.error_bound == pytest.approx(0.05, rel=1e-9)  # t from α solves bound = α
    assert report.saturated == (report.gamma <= report.delta + report.t)


def test_given_t_overrides_alpha_and_best_site_is_argmax(kind):
    net, batches, report, oracles = scored(kind)
    total_var = sum(o.variance for o in oracles.values())
    oracle_best = max(oracles, key=lambda name: oracles[name].grad_norm)
    t = 1e-3 * report.gamma  # far below Γ̂: grow
    grow = measure_saturation(net, batches, H.loss_fn, t=t, alpha=0.5, delta=0.0, seed=7)
    assert grow.t == t and grow.threshold == t
    assert not grow.saturated and grow.best_site == oracle_best
    assert grow.best_site == max(grow.sites, key=lambda r: r.grad_norm).name
    assert rel_err(grow.error_bound, min(1.0, total_var / (20 * t * t))) <= REL
    # δ pushes the threshold past Γ̂: saturated, no site
    sat = measure_saturation(net, batches, H.loss_fn, t=t, delta=2 * report.gamma, seed=7)
    assert sat.saturated and sat.best_site is None and sat.threshold == 2 * report.gamma + t
    assert sat.best_record.name == oracle_best  # still reported for the table
    # large t: the bound is small, saturated
    big = measure_saturation(net, batches, H.loss_fn, t=10 * report.gamma + 1, seed=7)
    assert big.saturated and big.error_bound < report.error_bound


@pytest.mark.parametrize("rule", ["paper", "crossfit"])
def test_every_rule_reports_t_and_the_threshold_when_the_variance_is_computed(kind, rule):
    """The callback passes variance=True under every rule and reports Γ̂ against δ+t: under the
    cross-fit rule too, t = sqrt(Σσ̂²/(nα)), the threshold δ+t and the error bound come from the
    per-sample loop of the oracle (the candidates uncalibrated, so every rule scores the same blocks)."""
    net = H.make_net(kind, seed=0)
    batches = H.probe_batches(kind, n=20, batch=8)
    delta = 0.01
    report = measure_saturation(net, batches, H.loss_fn, rule=rule, variance=True, delta=delta, alpha=0.05, seed=7,
                                calibrate=False, projected=False)  # fmt: skip
    oracles = {r.name: H.site_oracle(net, r.site, r.block, batches) for r in report.sites}
    total_var = sum(o.variance for o in oracles.values())
    t = math.sqrt(total_var / (20 * 0.05))
    assert report.t is not None and rel_err(report.t, t) <= REL, (rule, report.t, t)
    assert report.threshold == report.delta + report.t and report.delta == delta
    assert rel_err(report.error_bound, 0.05) <= 1e-9  # t from α solves Σσ̂²/(n t²) = α
    paper = report.verdicts["paper"]  # the paper's Γ̂ against δ+t, beside the rule that decided
    assert rel_err(paper.margin, delta + t) <= REL and paper.saturated == (report.gamma <= delta + t)
    assert report.to_dict()["t"] == report.t and report.to_dict()["threshold"] == report.threshold

# -- 5. planted linear-Gaussian problem with a known population gradient --------------------------
class LinearFeatureBlock(nn.Module):
    """``z + V (U z)`` with a ``DenseFeatures`` fast form; terminal map ``V`` (no bias)."""

    def __init__(self, dim: int, rank: int):
        super().__init__()
        self.U = nn.Linear(dim, rank, bias=False)
        self.V = nn.Linear(rank, dim, bias=False)

    def forward(self, z):
        return z + self.V(self.U(z))

    def zero_init_last(self):
        nn.init.zeros_(self.V.weight)

    def terminal_parameters(self):
        return [self.V.weight]

    def probe_features(self, z):
        return DenseFeatures(self.U(z), bias=False)


class PlantedNet(GrowableMixin, nn.Module):
    """Identity network (one zero-output block), two sites: ``blocks.0`` and ``blocks.1``."""

    growable_stages = ("blocks",)

    def __init__(self, dim: int):
        super().__init__()
        first = LinearFeatureBlock(dim, 1)
        first.zero_init_last()
        self.blocks = nn.ModuleList([first])
        self.dim = dim
        self._init_growth()

    def make_block(self, stage):
        block = LinearFeatureBlock(self.dim, 1)
        block.zero_init_last()
        return block

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return x


def _planted_setup():
    """y = z + B z + ε, z ~ N(0, I₂), ε ~ N(0, s² I₂); loss ½‖out − y‖²; out = z at V = 0.

    Candidate l has features φ_l = U_l z, so ξ_l = −(Bz + ε)(U_l z)ᵀ and
    g_l = −B U_lᵀ;  E‖ξ_l‖² = tr M tr N + 2 tr(M N) + s² d tr N  (Isserlis), M = BᵀB, N = U_lᵀU_l.
    """
    d, s = 2, 0.5
    B = torch.tensor([[1.0, 0.2], [0.1, 0.0]], dtype=torch.float64)
    Us = [torch.tensor([[1.0, 0.0]], dtype=torch.float64), torch.tensor([[0.0, 0.5]], dtype=torch.float64)]
    net = PlantedNet(d).double()
    candidates = {}
    for site, U in zip(net.sites(), Us):
        block = LinearFeatureBlock(d, 1).double()
        with torch.no_grad():
            block.U.weight.copy_(U)
        block.zero_init_last()
        candidates[site.name] = block
    M = B.T @ B
    g_pop, sigma2 = [], []
    for U in Us:
        N = U.T @ U
        g = -B @ U.T  # (d, 1): shaped like V.weight
        second = torch.trace(M) * torch.trace(N) + 2 * torch.trace(M @ N) + s * s * d * torch.trace(N)
        g_pop.append(g)
        sigma2.append(float(second - g.pow(2).sum()))
    return net, candidates, B, s, g_pop, sigma2


def _planted_loss(out, y):
    return 0.5 * (out - y).pow(2).sum(1).mean()


def test_planted_problem_error_rate_within_bound():
    start = time.perf_counter()
    net, candidates, B, s, g_pop, sigma2 = _planted_setup()
    gamma = max(float(g.norm()) for g in g_pop)
    n, draws = 40, 300
    t = gamma / 2  # H1 with δ = 0 sits exactly at Γ = δ + 2t; H0 with δ = Γ sits at Γ = δ
    pop_bound = sum(sigma2) / (n * t * t)
    assert 0.1 < pop_bound < 0.5  # a non-trivial bound, so the check has teeth
    gen = torch.Generator().manual_seed(2024)

    def draw():
        z = torch.randn(n, 2, generator=gen, dtype=torch.float64)
        y = z + z @ B.T + s * torch.randn(n, 2, generator=gen, dtype=torch.float64)
        return [(z[:20], y[:20]), (z[20:], y[20:])]

    Us = [candidates[s.name].U.weight.detach() for s in net.sites()]

    def oracle_decision(batches, delta):
        """Γ̂ = max_l ‖ĝ_l‖ with ĝ_l = mean_i q_i φ_lᵢᵀ, q = z − y, φ_l = U_l z (by hand); grow iff > δ + t."""
        z = torch.cat([b[0] for b in batches])
        q = z - torch.cat([b[1] for b in batches])
        gamma_hat = max(float((q.T @ (z @ U.T) / len(z)).norm()) for U in Us)
        return gamma_hat, gamma_hat > delta + t

    wrong = {"H0": 0, "H1": 0}
    bounds = {"H0": [], "H1": []}
    ghat = [[] for _ in g_pop]
    var_hat = [[] for _ in g_pop]
    for _ in range(draws):
        for hyp, delta in (("H0", gamma), ("H1", 0.0)):
            batches = draw()
            rep = measure_saturation(
                net, batches, _planted_loss, delta=delta, t=t, candidates=candidates, projected=False
            )
            # every decision equals the one computed by hand on the same draw: this is what can
            # fail; the error-rate check below only restates Chebyshev, which is loose here
            gamma_hat, grow = oracle_decision(batches, delta)
            assert rep.gamma == pytest.approx(gamma_hat, rel=1e-10)
            assert rep.saturated == (not grow)
            bounds[hyp].append(rep.error_bound)
            if hyp == "H0":
                wrong[hyp] += not rep.saturated  # Γ ≤ δ but declared "grow"
                for j, r in enumerate(rep.sites):
                    ghat[j].append(r.grad[0])
                    var_hat[j].append(r.variance)
            else:
                wrong[hyp] += rep.saturated  # Γ ≥ δ + 2t but declared "saturated"
    for hyp in wrong:
        rate = wrong[hyp] / draws
        bound = sum(bounds[hyp]) / draws
        slack = 3 * math.sqrt(bound * (1 - bound) / draws)
        # Chebyshev's inequality, a sanity check only (the bound is loose: it cannot tell a
        # broken rule; the draw-by-draw oracle above and test_decision_arithmetic can)
        assert rate <= bound + slack, (hyp, rate, bound)
        assert bound == pytest.approx(pop_bound, rel=0.2)  # E σ̂² = σ²
    # sharper: ĝ is unbiased for the closed-form g_pop, with covariance trace σ²/n; σ̂² unbiased
    for j, g in enumerate(g_pop):
        G = torch.stack(ghat[j])  # (draws, d, 1)
        se = G.std(0) / math.sqrt(draws)
        assert torch.all((G.mean(0) - g).abs() <= 5 * se + 1e-12), (j, G.mean(0), g)
        mse = float((G - g).pow(2).sum((1, 2)).mean())
        assert mse == pytest.approx(sigma2[j] / n, rel=0.25), (j, mse, sigma2[j] / n)
        v = torch.tensor(var_hat[j])
        assert abs(float(v.mean()) - sigma2[j]) <= 5 * float(v.std()) / math.sqrt(draws), (j, v.mean(), sigma2[j])
    assert time.perf_counter() - start < 30


# -- 8. joint insertion = one at a time (Corollary 2) ---------------------------------------------
def test_inserting_all_scored_blocks_at_once_gives_each_sites_gradient(kind):
    net, batches, report, oracles = scored(kind)
    net2 = copy.deepcopy(net)
    inserted = {}
    # descending position per stage, so the positions of the remaining sites stay valid
    for r in sorted(report.sites, key=lambda r: (r.site.stage, -r.site.index)):
        inserted[r.name] = net2.grow(r.site, block=copy.deepcopy(r.block))
    net2.eval()
    assert net2.depth() == net.depth() + len(report.sites)
    x, y = H.cat_batches(batches)
    with torch.no_grad():
        assert torch.allclose(net2(x), net(x), rtol=0, atol=1e-12)
    total = sum(H.loss_fn(net2(bx), by) * (bx.shape[0] / x.shape[0]) for bx, by in batches)
    params = [p for r in report.sites for p in terminal_parameters(inserted[r.name])]
    grads = iter(torch.autograd.grad(total, params))
    for r in report.sites:
        for got in r.grad:
            want = next(grads)
            assert float((got - want).norm()) <= 1e-7 * max(float(want.norm()), 1e-12), r.name
        # and it equals the single-insertion oracle
        assert rel_err(r.grad_norm, oracles[r.name].grad_norm) <= REL


# -- 9. ghost BatchNorm calibration ------------------------------------------------------------
def _learnable_task(n: int, gen: torch.Generator):
    """3 classes by the sign pattern of two fixed image contrasts (8×8, one channel)."""
    x = torch.randn(n, 1, 8, 8, generator=gen, dtype=torch.float64)
    a = x[:, 0, :4].mean((1, 2)) - x[:, 0, 4:].mean((1, 2))
    b = x[:, 0, :, :4].mean((1, 2)) - x[:, 0, :, 4:].mean((1, 2))
    y = torch.where(a > 0, torch.where(b > 0, 0, 1), 2)
    return x, y


_CALIB: dict = {}


def calibrated_setup(family: str):
    """A fresh width-4 net whose BN running stats are settled on the task's distribution, a
    256-sample probe (one batch), and its reports with and without ghost calibration."""
    if family not in _CALIB:
        torch.manual_seed(3)
        gen = torch.Generator().manual_seed(3)
        net = cifar_resnet((1, 1, 1), width=4, family=family, in_channels=1, num_classes=3).double()
        for m in net.modules():  # running stats = the data distribution's (cumulative average)
            if isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.momentum = None
        net.train()
        with torch.no_grad():
            for _ in range(4):
                net(_learnable_task(256, gen)[0])
        net.eval()
        probe = [_learnable_task(256, gen)]
        reports = {
            calib: measure_saturation(net, probe, F.cross_entropy, calibrate=calib, seed=5, projected=False)
            for calib in (True, False)
        }
        _CALIB[family] = (net, probe, reports, gen)
    return _CALIB[family]


def _site_inputs(net, site, batches) -> list:
    """The activation at ``site`` for each probe batch (eval mode), captured by a plain hook."""
    stage = net.stage(site.stage)
    zs = []
    if site.index < len(stage):
        handle = stage[site.index].register_forward_pre_hook(lambda m, a: zs.append(a[0].detach()))
    else:
        handle = stage[site.index - 1].register_forward_hook(lambda m, a, out: zs.append(out.detach()))
    try:
        with torch.no_grad():
            for bx, _ in batches:
                net(bx)
    finally:
        handle.remove()
    return zs


@pytest.mark.parametrize("family", ["basic", "preact"])
def test_calibrated_bn_statistics_equal_probe_activation_statistics(family):
    net, probe, reports, _ = calibrated_setup(family)
    half = [(probe[0][0][:128], probe[0][1][:128]), (probe[0][0][128:], probe[0][1][128:])]
    for batches in (probe, half):  # one batch, and a cumulative average over two
        report = measure_saturation(net, batches, F.cross_entropy, calibrate=True, seed=5, projected=False)
        for rec in report.sites:
            blk = rec.block
            zs = _site_inputs(net, rec.site, batches)
            first = [z if family == "preact" else F.conv2d(z, blk.conv1.weight, padding=1) for z in zs]
            mean1 = torch.stack([u.mean((0, 2, 3)) for u in first]).mean(0)
            var1 = torch.stack([u.var((0, 2, 3), unbiased=True) for u in first]).mean(0)
            assert torch.allclose(blk.bn1.running_mean, mean1, rtol=1e-9, atol=1e-12), rec.name
            assert torch.allclose(blk.bn1.running_var, var1, rtol=1e-9, atol=1e-12), rec.name
            # the second BN sees features normalised by the first one's batch statistics
            second = []
            for u in first:
                a = F.relu(F.batch_norm(u, None, None, blk.bn1.weight, blk.bn1.bias, training=True, eps=blk.bn1.eps))
                second.append(F.conv2d(a, (blk.conv1 if family == "preact" else blk.conv2).weight, padding=1))
            mean2 = torch.stack([u.mean((0, 2, 3)) for u in second]).mean(0)
            var2 = torch.stack([u.var((0, 2, 3), unbiased=True) for u in second]).mean(0)
            assert torch.allclose(blk.bn2.running_mean, mean2, rtol=1e-9, atol=1e-12), rec.name
            assert torch.allclose(blk.bn2.running_var, var2, rtol=1e-9, atol=1e-12), rec.name
            assert float(blk.bn1.running_var.sub(1).abs().max()) > 1e-3  # moved off the fresh values
            assert int(blk.bn1.num_batches_tracked) == len(batches)
            assert blk.bn1.momentum == 0.1 and not blk.training  # restored after calibration


def _real_grad(net, rec, x, y, *, network_train: bool, block_train: bool):
    net2, inserted = H.insert_copy(net, rec.site, rec.block)
    net2.train(network_train)
    inserted.train(block_train)
    loss = F.cross_entropy(net2(x), y)
    return H.flat(torch.autograd.grad(loss, terminal_parameters(inserted)))


def _cosine(a, b) -> float:
    return float(F.cosine_similarity(a, b, dim=0))


@pytest.mark.parametrize("family", ["basic", "preact"])
def test_calibrated_candidate_trains_in_the_scored_direction(family):
    """After real insertion, the new block trains with batch statistics (train mode) on a
    probe-like batch: its gradient is the scored one when the ghost was calibrated, at every
    site. Uncalibrated ghosts (running stats 0/1) score a visibly different direction."""
    net, probe, reports, _ = calibrated_setup(family)
    (x, y) = probe[0]
    cal, raw = [], []
    for calib, out in ((True, cal), (False, raw)):
        for rec in reports[calib].sites:
            real = _real_grad(net, rec, x, y, network_train=False, block_train=True)
            out.append(_cosine(real, H.flat(rec.grad)))
    # Calibrated: the ghost's BN running statistics are the statistics of this very batch
    # (one calibration batch), so eval and train mode differ only by the unbiased (N/(N−1))
    # vs biased variance, N = 256·H·W ≥ 1024 values per channel: a per-channel scale within
    # 1e-3 of 1, hence cos > 0.999. Uncalibrated (running stats 0 and 1): the features differ
    # by a per-channel affine map, a different direction, which must show (< 0.99).
    assert min(cal) > 0.999, cal
    assert min(raw) < 0.99, raw  # the calibration is what makes it match


def test_first_training_step_direction_after_inserting_at_the_head_site():
    """One full train-mode step (every BN on batch statistics) on a fresh 256-sample batch, for
    ``basic`` at the end of the last stage (no BatchNorm downstream): cosine > 0.9.

    Why 0.9: with no BN downstream the scored and the real gradient estimate the same
    population gradient g from two independent 256-sample batches, so the cosine is limited by
    sampling noise only, E cos ≈ ‖g‖²/(‖g‖² + tr Σ/n); on this learnable task ‖g‖² dominates
    tr Σ/256 several times over at a fresh net. A BN downstream would change the direction
    itself (see the strict xfail below), which this bound would catch."""
    net, probe, reports, _ = calibrated_setup("basic")
    rec = reports[True].record("layer3.1")
    # its own generator: the cached setup's generator would hand out different samples
    # depending on which tests drew from it first
    x, y = _learnable_task(256, torch.Generator().manual_seed(11))
    real = _real_grad(net, rec, x, y, network_train=True, block_train=True)
    assert _cosine(real, H.flat(rec.grad)) > 0.9


@pytest.mark.xfail(
    strict=True,
    reason="known limitation (reported): with the whole network in train mode, every downstream "
    "BatchNorm uses batch statistics, and its backward removes the per-channel mean and scale "
    "components of the activation gradient that the eval-mode probe counts. Even on the probe "
    "samples themselves (no sampling noise) the cosine is 0.07-0.85 (basic; 0.998 only at layer3.1, "
    "which has no BN downstream) and 0.41-0.82 (preact, where every site feeds a BN)",
)
@pytest.mark.parametrize("family", ["basic", "preact"])
def test_full_train_mode_step_matches_the_scored_direction_at_every_site(family):
    net, probe, reports, _ = calibrated_setup(family)
    (x, y) = probe[0]
    cosines = [
        _cosine(_real_grad(net, rec, x, y, network_train=True, block_train=True), H.flat(rec.grad))
        for rec in reports[True].sites
    ]
    assert min(cosines) > 0.9, cosines


# -- 10. errors, modes, side effects, serialisation ------------------------------------------------
def test_argument_errors():
    net = H.make_net("basic", seed=0)
    batches = H.probe_batches("basic", n=8, batch=4)
    for kwargs in ({"delta": -0.1}, {"delta": float("nan")}, {"delta": float("inf")}):
        with pytest.raises(ValueError, match="delta"):
            measure_saturation(net, batches, H.loss_fn, **kwargs)
    for alpha in (0.0, 1.0, 1.5, -0.1):
        with pytest.raises(ValueError, match="alpha"):
            measure_saturation(net, batches, H.loss_fn, alpha=alpha)
    for t in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="t:"):
            measure_saturation(net, batches, H.loss_fn, t=t)
    with pytest.raises(ValueError, match="rule"):
        measure_saturation(net, batches, H.loss_fn, rule="nope")
    with pytest.raises(ValueError, match="probe_loader"):
        measure_saturation(net, [], H.loss_fn)
    with pytest.raises(ValueError, match="at least 2"):
        measure_saturation(net, [(batches[0][0][:1], batches[0][1][:1])], H.loss_fn)
    with pytest.raises(TypeError, match="input, target"):
        measure_saturation(net, [batches[0][0]], H.loss_fn, calibrate=False)


def test_networks_without_sites():
    x, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    with pytest.raises(TypeError, match="sites"):
        measure_saturation(nn.Linear(3, 3), [(x, y)], H.loss_fn)
    with pytest.raises(TypeError, match="sites"):  # a growable network hidden inside a plain wrapper
        measure_saturation(nn.Sequential(H.mlp_stack()), [(torch.randn(4, 4), y)], H.loss_fn)

    class NoStages(GrowableMixin, nn.Module):
        growable_stages = ()

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 3)
            self._init_growth()

    with pytest.raises(ValueError, match="no candidate sites"):
        measure_saturation(NoStages(), [(x, y)], H.loss_fn)
    # an empty stack has a site but no parameter to take a device/dtype from
    empty = GrowableStack([], H.MLPBlock, H.MLP_TERMINAL)
    with pytest.raises(ValueError, match="no parameters"):
        measure_saturation(empty, [(torch.randn(4, 4), y)], H.loss_fn)


def test_nan_loss_names_the_batch():
    net = H.make_net("preact", seed=0)
    batches = H.probe_batches("preact", n=12, batch=4)
    calls = {"n": 0}

    def bad_loss(out, y):
        calls["n"] += 1
        loss = F.cross_entropy(out, y)
        return loss * float("nan") if calls["n"] == 2 else loss

    with pytest.raises(FloatingPointError, match="batch 1.*no decision"):
        measure_saturation(net, batches, bad_loss)


def test_mode_restored_and_no_grads_left_behind(kind):
    net = H.make_net(kind, seed=2)
    batches = H.probe_batches(kind, n=8, batch=4)
    bn_before = H.bn_snapshot(net)
    net.train()
    modes = {name: m.training for name, m in net.named_modules()}
    report = measure_saturation(net, batches, H.loss_fn)
    assert net.training
    assert {name: m.training for name, m in net.named_modules()} == modes
    assert all(p.grad is None for p in net.parameters())
    assert all(p.grad is None for r in report.sites for p in r.block.parameters())
    assert H.same_bn(bn_before, H.bn_snapshot(net))  # the probe never updates the network's BN
    net.eval()
    measure_saturation(net, batches, H.loss_fn)
    assert not any(m.training for m in net.modules())


def test_mixed_submodule_modes_are_restored():
    """A user who froze some BatchNorm (eval) inside a training network keeps it frozen."""
    net = H.make_net("basic", seed=2)
    net.train()
    net.stem_bn.eval()
    measure_saturation(net, H.probe_batches("basic", n=8, batch=4), H.loss_fn)
    assert net.training and not net.stem_bn.training


def test_report_serialises_and_renders(kind):
    console = pytest.importorskip("rich.console")
    _, _, report, _ = scored(kind)
    data = json.loads(json.dumps(report.to_dict()))
    assert data["n"] == report.n and data["saturated"] == report.saturated
    assert [s["site"] for s in data["sites"]] == [r.name for r in report.sites]
    buf = io.StringIO()
    console.Console(file=buf, width=160).print(report)
    text = buf.getvalue()
    for r in report.sites:
        assert r.name in text


# -- 11. bfloat16 autocast -------------------------------------------------------------------
def test_bfloat16_autocast_close_to_float32():
    net = H.make_net("preact", seed=0, dtype=torch.float32, width=4)
    batches = H.probe_batches("preact", n=32, batch=16, dtype=torch.float32)
    full = measure_saturation(net, batches, H.loss_fn, seed=1, projected=False)
    half = measure_saturation(net, batches, H.loss_fn, seed=1, projected=False, autocast_dtype=torch.bfloat16)
    for a, b in zip(full.sites, half.sites):
        assert math.isfinite(b.grad_norm)
        assert rel_err(b.grad_norm, a.grad_norm) <= 0.05, (a.name, a.grad_norm, b.grad_norm)
        assert rel_err(b.ag, a.ag) <= 0.05
    assert all(g.dtype == torch.float32 for r in half.sites for g in r.grad)
