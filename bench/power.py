"""Power of the growth decision on a planted linear-Gaussian problem (docs/power.md).

    PYTHONPATH=. python bench/power.py --md docs/power_tables.md   # ~3 min on 2 idle CPU cores
    PYTHONPATH=. python bench/power.py --quick                     # smoke run, < 30 s

The planted problem: ``K`` candidate sites, per-sample gradients ``ξ_i = g_l + ε_i`` in ``p``
dimensions, ``n`` probe samples, ``ε ~ N(0, Σ)`` with ``Σ`` diagonal and ``tr Σ = σ² = 1``.
Site 0 carries the signal ``g_0 = γ e₀`` (``e₀`` = the noise's top-variance axis), the other
``K − 1`` sites have ``g = 0``. The x-axis is ``x = ‖g‖ √n / σ``: the signal in units of the
noise norm of ``ĝ`` (``E‖ĝ − g‖² = σ²/n``). Covariances: ``iso`` (``Σ = I/p``) and ``decay``
(``λ_k ∝ 1/k``: low effective rank, signal along the noisiest axis — the hard case).

Rules, all at overall level ``α`` (δ = 0), with a union bound over sites where they need one:
  paper              grow iff ``max_l ‖ĝ_l‖ > sqrt(Σ_l σ̂²_l / (n α))`` (Proposition 1);
  crossfit-normal    cross-fit lower bound > 0 at some site, CLT quantile at ``α/K``;
  crossfit-cantelli  the same with Cantelli's distribution-free factor;
  chen-qin           debiased ``‖ĝ‖² − σ̂²/n`` with a Chen–Qin variance, one-sided z-test at
                     ``α/K`` per site (bench/chen_qin.py's chen_qin_test; not wired into
                     measure_saturation).

Two simulation routes, cross-checked against each other on every setting where both run:
  * sufficient statistics (paper, cross-fit; Gaussian noise only, exact): with Gaussian noise
    ``ĝ ~ N(g, Σ/n)`` is independent of ``(n−1) tr S ~ Σ_k λ_k χ²_{n−1}``; for the cross-fit,
    ``u`` comes from ``ĝ(A) ~ N(g, Σ/|A|)`` and, given ``u``, the ``s_j`` on ``B`` are i.i.d.
    ``N(g·u, uᵀΣu)``, so their mean and sd are a normal and an independent χ². ``O(p)`` per
    draw and site, so ``--draws`` can be large;
  * per-sample (every rule, any noise): draws the ``n × p`` per-sample gradients and calls the
    package's functions (``crossfit_from_samples``, ``chen_qin_test`` with the ``"pairs"``
    tr(Σ²) estimate); ``O(n p)`` per draw and site, so only where ``n·p ≤ --max-np``. One noise
    draw serves every point of a curve (common random numbers, exact algebra in ``γ``); the
    points of a curve are correlated, each is an average over independent draws.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import zlib
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from chen_qin import chen_qin_test, chen_qin_z, trace_sq_estimate  # noqa: E402  (bench/chen_qin.py)
from growtrain.crossfit import (  # noqa: E402
    cantelli_factor,
    crossfit_from_samples,
    normal_quantile,
)

RULES = ("paper", "crossfit-normal", "crossfit-cantelli", "chen-qin")
EXACT_RULES = RULES[:3]
X_GRID = (0.0, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.6, 0.8, 1.0, 1.25, 1.5, 2.0, 2.5, 3.0, 4.0, 5.0, 6.0, 8.0, 10.0)
X_GRID += (12.0, 16.0, 24.0)
ROOT = Path(__file__).resolve().parents[1]


def covariance(kind: str, p: int) -> np.ndarray:
    """Diagonal of ``Σ`` (``tr Σ = 1``), largest first."""
    if kind == "iso":
        lam = np.ones(p)
    elif kind == "decay":
        lam = 1.0 / np.arange(1, p + 1)
    else:
        raise ValueError(f"cov: expected 'iso' or 'decay', got {kind!r}")
    return lam / lam.sum()


def seed_of(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


# -- route 1: sufficient statistics (Gaussian, exact, O(p)) ------------------------------------
def sufficient_curves(p, n, cov, K, draws, alpha, xs, seed, chunk_elems=2**22):
    """P(grow) of the paper and cross-fit rules at each ``x``; site 0 carries the signal ``γ e₀``.

    Per draw and site it draws ``ĝ − g ~ N(0, Σ/n)``, ``σ̂²`` (independent of ``ĝ``), ``ĝ(A) − g ~
    N(0, Σ/|A|)`` and the standardised mean and χ² of the ``s_j`` on ``B``; every statistic at
    every ``γ`` is then exact scalar algebra in a few of their summaries.
    """
    lam = covariance(cov, p)
    rng = np.random.default_rng(seed)
    n_a = math.ceil(n / 2)
    n_b = n - n_a
    level = alpha / K
    factor = {
        "crossfit-normal": normal_quantile(1 - level) / math.sqrt(n_b),
        "crossfit-cantelli": cantelli_factor(level, n_b),
    }
    counts = {rule: np.zeros(len(xs)) for rule in EXACT_RULES}
    gammas = np.asarray(xs, dtype=np.float64)[:, None] / math.sqrt(n)  # (X, 1); σ = 1
    chunk = max(1, chunk_elems // (K * p))
    done = 0
    while done < draws:
        d = min(chunk, draws - done)
        z = rng.standard_normal((d, K, p)) * np.sqrt(lam / n)  # ĝ − g
        z_sq, z_e = (z**2).sum(-1), z[..., 0]
        t = np.sqrt(((rng.chisquare(n - 1, (d, K, p)) * lam).sum(-1) / (n - 1)).sum(1) / (n * alpha))  # (d,)
        grad0 = np.sqrt(z_sq[:, 0] + 2 * gammas * z_e[:, 0] + gammas**2)  # (X, d)
        gamma_null = np.sqrt(z_sq[:, 1:]).max(1) if K > 1 else np.zeros(d)
        counts["paper"] += (np.maximum(grad0, gamma_null) > t).sum(1)
        za = rng.standard_normal((d, K, p)) * np.sqrt(lam / n_a)  # ĝ(A) − g
        za_sq, za_e, za_lam = (za**2).sum(-1), za[..., 0], (za**2 * lam).sum(-1)
        w = rng.standard_normal((d, K))  # standardised mean of s on B
        chi2_b = rng.chisquare(n_b - 1, (d, K))  # (n_b − 1) sd²/τ²
        # site 0 at every γ (X, d); the null sites (d, K − 1) are the same for every γ
        G = gammas
        v_sq = za_sq[:, 0] + 2 * G * za_e[:, 0] + G**2  # ‖ĝ(A)‖²
        tau2_0 = (za_lam[:, 0] + 2 * G * lam[0] * za_e[:, 0] + lam[0] * G**2) / v_sq  # uᵀΣu
        mu_0 = G * (G + za_e[:, 0]) / np.sqrt(v_sq)  # g·u
        s_bar0 = mu_0 + np.sqrt(tau2_0 / n_b) * w[:, 0]
        sd0 = np.sqrt(tau2_0 * chi2_b[:, 0] / (n_b - 1))
        tau2_null = za_lam[:, 1:] / za_sq[:, 1:]
        s_bar_null = np.sqrt(tau2_null / n_b) * w[:, 1:]
        sd_null = np.sqrt(tau2_null * chi2_b[:, 1:] / (n_b - 1))
        for rule, f in factor.items():
            null_grow = (s_bar_null - f * sd_null > 0).any(1)  # (d,)
            counts[rule] += ((s_bar0 - f * sd0 > 0) | null_grow).sum(1)
        done += d
    return {rule: (c / draws).tolist() for rule, c in counts.items()}


# -- route 2: per-sample gradients (any noise, every rule) -------------------------------------
def noise(draws: int, n: int, lam: np.ndarray, tails: str, gen: torch.Generator) -> torch.Tensor:
    """``(draws, n, p)`` float32 noise with covariance ``diag(lam)``; ``tails="t3"`` makes it a
    multivariate t with 3 degrees of freedom (same covariance, infinite fourth moment)."""
    eps = torch.randn(draws, n, lam.size, generator=gen).mul_(torch.from_numpy(np.sqrt(lam)).float())
    if tails == "t3":
        chi2 = torch.randn(draws, n, 3, generator=gen).pow(2).sum(-1, keepdim=True)  # χ²_ν, ν = 3
        eps.mul_(chi2.rsqrt())  # × sqrt((ν − 2)/χ²_ν): a multivariate t_ν with covariance diag(lam)
    elif tails != "gauss":
        raise ValueError(f"tails: expected 'gauss' or 't3', got {tails!r}")
    return eps


def summaries(eps: torch.Tensor, block: int) -> dict:
    """Noise summaries of one site per draw; every rule's statistic is exact algebra in these and γ
    for ``ξ_i = γ e₀ + ε_i`` (A = first ⌈n/2⌉ samples, B the rest)."""
    n = eps.shape[1]
    n_a = math.ceil(n / 2)
    n_b = n - n_a
    mean = eps.mean(1).double()  # (D, p)
    mean_a = eps[:, :n_a].mean(1)  # (D, p)
    a = eps[:, n_a:, 0].double()  # (D, n_b): ε_j · e₀
    b = (eps[:, n_a:] @ mean_a.unsqueeze(-1)).squeeze(-1).double()  # (D, n_b): ε_j · ε̄_A
    ac, bc = a - a.mean(1, keepdim=True), b - b.mean(1, keepdim=True)
    mean_a = mean_a.double()
    sum_sq = torch.linalg.vector_norm(eps, dim=2).double().pow(2).sum(1)  # Σ_i ‖ε_i‖²
    return {
        "mean_e": mean[:, 0],
        "mean_sq": mean.pow(2).sum(1),
        "tr_s": (sum_sq - n * mean.pow(2).sum(1)) / (n - 1),
        "mean_a_e": mean_a[:, 0],
        "mean_a_sq": mean_a.pow(2).sum(1),
        "a_bar": a.mean(1),
        "b_bar": b.mean(1),
        "var_a": ac.pow(2).sum(1) / (n_b - 1),
        "var_b": bc.pow(2).sum(1) / (n_b - 1),
        "cov_ab": (ac * bc).sum(1) / (n_b - 1),
        "trace_sq": trace_sq_estimate(eps, "pairs", block),
    }


def site_stats(sm: dict, gamma: float, n: int) -> dict:
    """Per-draw statistics of a site with ``g = γ e₀`` from its noise summaries."""
    g_sq = gamma**2 + 2 * gamma * sm["mean_e"] + sm["mean_sq"]  # ‖ĝ‖²
    v_norm = (gamma**2 + 2 * gamma * sm["mean_a_e"] + sm["mean_a_sq"]).clamp_min(0).sqrt()  # ‖ĝ(A)‖
    # s_j = (γe₀ + ε_j)·(γe₀ + ε̄_A)/‖ĝ(A)‖ = (γ² + γ ε̄_A·e₀ + γ a_j + b_j)/‖ĝ(A)‖
    s_mean = (gamma**2 + gamma * sm["mean_a_e"] + gamma * sm["a_bar"] + sm["b_bar"]) / v_norm
    s_var = (gamma**2 * sm["var_a"] + 2 * gamma * sm["cov_ab"] + sm["var_b"]) / v_norm**2
    return {
        "grad_norm": g_sq.sqrt(),
        "tr_s": sm["tr_s"],
        "s_mean": s_mean,
        "s_sd": s_var.clamp_min(0).sqrt(),
        "debiased": g_sq - sm["tr_s"] / n,  # = debiased_norm_sq(ξ)
        "trace_sq": sm["trace_sq"],
    }


def decide(stats: list[dict], n: int, alpha: float) -> dict:
    """Grow decisions ``(D,)`` per rule from the ``K`` sites' statistics (δ = 0)."""
    K, n_b = len(stats), n - math.ceil(n / 2)
    level = alpha / K
    gamma = torch.stack([s["grad_norm"] for s in stats]).amax(0)
    t = (sum(s["tr_s"] for s in stats) / (n * alpha)).sqrt()
    factors = {
        "crossfit-normal": normal_quantile(1 - level) / math.sqrt(n_b),
        "crossfit-cantelli": cantelli_factor(level, n_b),
    }
    out = {"paper": gamma > t}
    for rule, factor in factors.items():
        out[rule] = torch.stack([s["s_mean"] - factor * s["s_sd"] > 0 for s in stats]).any(0)
    z_crit = normal_quantile(1 - level)
    out["chen-qin"] = torch.stack([chen_qin_z(s["debiased"], s["trace_sq"], n) > z_crit for s in stats]).any(0)
    return out


def per_sample_curves(p, n, cov, tails, K, draws, alpha, xs, block, seed, chunk_elems=2**23):
    """P(grow) of every rule at each ``x`` from simulated per-sample gradients."""
    lam = covariance(cov, p)
    gen = torch.Generator().manual_seed(seed)
    chunk = max(1, chunk_elems // (n * p))
    counts = {rule: torch.zeros(len(xs), dtype=torch.float64) for rule in RULES}
    done = 0
    while done < draws:
        d = min(chunk, draws - done)
        sms = [summaries(noise(d, n, lam, tails, gen), block) for _ in range(K)]
        for i, x in enumerate(xs):
            gamma = x / math.sqrt(n)  # σ = 1
            stats = [site_stats(sms[0], gamma, n)] + [site_stats(sm, 0.0, n) for sm in sms[1:]]
            for rule, grow in decide(stats, n, alpha).items():
                counts[rule][i] += grow.double().sum()
        done += d
    return {rule: (c / draws).tolist() for rule, c in counts.items()}


def self_check(alpha=0.05, K=3, n=41, p=30, draws=6, block=8):
    """The summary algebra equals the package's functions on explicit ``ξ``."""
    gen = torch.Generator().manual_seed(0)
    lam = covariance("decay", p)
    eps = [noise(draws, n, lam, "gauss", gen).double() for _ in range(K)]
    gamma = 0.3
    g = torch.zeros(p, dtype=torch.float64)
    g[0] = gamma
    xis = [eps[0] + g] + eps[1:]
    stats = [site_stats(summaries(e, block), gamma if i == 0 else 0.0, n) for i, e in enumerate(eps)]
    got = decide(stats, n, alpha)
    level, n_b = alpha / K, n - math.ceil(n / 2)
    for bound in ("normal", "cantelli"):
        direct = torch.stack([crossfit_from_samples(xi, level, bound) for xi in xis])  # (K, D)
        factor = normal_quantile(1 - level) / math.sqrt(n_b) if bound == "normal" else cantelli_factor(level, n_b)
        route = torch.stack([s["s_mean"] - factor * s["s_sd"] for s in stats])
        assert torch.allclose(direct, route, rtol=1e-5, atol=1e-6), (bound, direct, route)
        assert torch.equal(got[f"crossfit-{bound}"], (direct > 0).any(0))
    for xi, s in zip(xis, stats):
        cq = chen_qin_test(xi, 0.0, level, trace="pairs", block=block)
        assert torch.allclose(cq.statistic, s["debiased"], rtol=1e-6, atol=1e-9)
        assert torch.allclose(cq.trace_sq, s["trace_sq"], rtol=1e-5)
    gamma_hat = torch.stack([xi.mean(1).norm(dim=-1) for xi in xis]).amax(0)
    total = sum(((xi - xi.mean(1, keepdim=True)) ** 2).sum((1, 2)) / (n - 1) for xi in xis)
    assert torch.equal(got["paper"], gamma_hat > (total / (n * alpha)).sqrt())


# -- jobs ------------------------------------------------------------------------------------
def run_job(job: tuple) -> dict:
    """``(function name, keyword arguments)`` → its curves (runs in a worker process)."""
    torch.set_num_threads(1)  # one process per core: tiny tensor ops don't wait on a thread pool
    name, kwargs = job
    t0 = time.time()
    out = {"sufficient": sufficient_curves, "per_sample": per_sample_curves}[name](**kwargs)
    label = {k: v for k, v in kwargs.items() if k in ("tails", "cov", "p", "n", "K", "alpha")}
    print(f"# {name} {label}: {time.time() - t0:.1f}s", file=sys.stderr, flush=True)
    return out


def x_at(curve, xs, target: float = 0.8):
    """Smallest ``x`` where the (linearly interpolated) power reaches ``target``; None if never."""
    for i in range(1, len(xs)):
        if curve[i] >= target:
            lo = curve[i - 1]
            if lo >= target:
                return xs[i - 1]
            return xs[i - 1] + (target - lo) / (curve[i] - lo) * (xs[i] - xs[i - 1])
    return None


def fmt_x(value) -> str:
    return f"> {X_GRID[-1]:g}" if value is None else f"{value:.2g}"


def markdown(curves, nulls, k_table, check, args) -> str:
    xs = list(X_GRID)
    bsd = lambda d: math.sqrt(args.alpha * (1 - args.alpha) / d)  # noqa: E731
    L = [
        f"Planted problem: K = {args.K} sites (signal at one), α = {args.alpha}, δ = 0; x = ‖g‖√n/σ. "
        f"paper / cross-fit: {args.draws} draws per point (sufficient-statistic route); chen-qin: "
        f"{args.cq_draws} draws per point (per-sample route, only where n·p ≤ {args.max_np:g}).",
        "",
        "**x needed for 80 % power** (smaller is better) and **size** = P(grow) at x = 0 "
        f"(must be ≤ α; binomial sd {bsd(args.draws):.3f} / {bsd(args.cq_draws):.3f}):",
        "",
        "| cov | p | n | " + " | ".join([f"{r} x₈₀" for r in RULES] + [f"{r} size" for r in RULES]) + " |",
        "|" + "---|" * (3 + 2 * len(RULES)),
    ]
    for key, c in curves.items():
        row = [str(k) for k in key]
        row += [fmt_x(x_at(c[r], xs)) if r in c else "—" for r in RULES]
        row += [f"{c[r][0]:.3f}" if r in c else "—" for r in RULES]
        L.append("| " + " | ".join(row) + " |")
    L += ["", "**P(grow) against x:**", "", "| cov | p | n | rule | " + " | ".join(f"{x:g}" for x in xs) + " |"]
    L.append("|" + "---|" * (4 + len(xs)))
    for key, c in curves.items():
        for rule in RULES:
            if rule in c:
                cells = [str(k) for k in key] + [rule] + [f"{v:.2f}" for v in c[rule]]
                L.append("| " + " | ".join(cells) + " |")
    L += [
        "",
        f"**Heavy tails: size** (multivariate t₃ noise — finite variance, infinite fourth moment — g = 0 at "
        f"every site, per-sample route, {args.null_draws} draws; binomial sd {bsd(args.null_draws):.3f}):",
        "",
        "| cov | p | n | " + " | ".join(RULES) + " |",
        "|" + "---|" * (3 + len(RULES)),
    ]
    for key, sizes in nulls.items():
        L.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(f"{sizes[r]:.3f}" for r in RULES) + " |")
    L += [
        "",
        f"**More sites** (x₈₀, p = {args.big[0]}, n = {args.big[1]}, sufficient-statistic route):",
        "",
        "| cov | K | " + " | ".join(f"{r} x₈₀" for r in EXACT_RULES) + " |",
        "|" + "---|" * (2 + len(EXACT_RULES)),
    ]
    for (cov, K), c in k_table.items():
        L.append(f"| {cov} | {K} | " + " | ".join(fmt_x(x_at(c[r], xs)) for r in EXACT_RULES) + " |")
    L += ["", f"Cross-check of the two routes (paper and cross-fit, Gaussian): {check}."]
    return "\n".join(L)


def plot(curves, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = list(X_GRID)
    covs = list(dict.fromkeys(k[0] for k in curves))
    settings = list(dict.fromkeys(k[1:] for k in curves))
    fig, axes = plt.subplots(len(covs), len(settings), figsize=(3.2 * len(settings), 2.8 * len(covs)), squeeze=False)
    styles = {"paper": "k-", "crossfit-normal": "C0-o", "crossfit-cantelli": "C1-s", "chen-qin": "C2--^"}
    for r, cov in enumerate(covs):
        for c, (p, n) in enumerate(settings):
            ax = axes[r][c]
            for rule in RULES:
                if rule in curves[(cov, p, n)]:
                    ax.plot(xs[1:], curves[(cov, p, n)][rule][1:], styles[rule], ms=3, lw=1.2, label=rule)
            ax.set_xscale("log")
            ax.set_ylim(-0.02, 1.02)
            ax.axhline(0.8, color="0.8", lw=0.6)
            ax.axhline(0.05, color="0.8", lw=0.6, ls=":")
            ax.set_title(f"{cov}, p={p}, n={n}", fontsize=9)
            if r == len(covs) - 1:
                ax.set_xlabel("x = ‖g‖√n / σ")
            if c == 0:
                ax.set_ylabel("P(grow)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(RULES), fontsize=8, frameon=False)
    fig.suptitle("P(grow) on the planted problem (δ = 0, α = 0.05, one signal site of K = 4)", fontsize=10)
    fig.tight_layout(rect=(0, 0.05, 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--draws", type=int, default=2000, help="draws per point, paper and cross-fit (cheap route)")
    ap.add_argument("--cq-draws", type=int, default=300, help="draws per point, per-sample route (Chen–Qin)")
    ap.add_argument("--null-draws", type=int, default=1000, help="draws per heavy-tail size check")
    ap.add_argument("--max-np", type=float, default=1e6, help="per-sample route only where n·p ≤ this")
    ap.add_argument("--max-np-t3", type=float, default=2.5e5, help="heavy-tail size checks only where n·p ≤ this")
    ap.add_argument("--K", type=int, default=4, help="candidate sites")
    ap.add_argument("--K-big", type=int, default=13, help="sites for the K table")
    ap.add_argument("--alpha", type=float, default=0.05)
    ap.add_argument("--p", type=int, nargs="+", default=[100, 2000])
    ap.add_argument("--n", type=int, nargs="+", default=[500, 2000])
    ap.add_argument("--cov", nargs="+", default=["iso", "decay"])
    ap.add_argument("--big", type=int, nargs=2, default=[2000, 2000], metavar=("P", "N"))
    ap.add_argument("--block", type=int, default=32, help="block of the incomplete tr(Σ²) U-statistic")
    ap.add_argument("--workers", type=int, default=2, help="processes (one thread each)")
    ap.add_argument("--quick", action="store_true", help="small sizes (smoke run)")
    ap.add_argument("--png", default=str(ROOT / "docs/figures/power.png"))
    ap.add_argument("--md", default=None, help="also write the tables to this Markdown file")
    args = ap.parse_args(argv)
    if args.quick:
        args.p, args.n, args.big = [50, 200], [200], [200, 200]
        args.draws, args.cq_draws, args.null_draws = 300, 100, 200
    self_check()
    xs = list(X_GRID)
    common = dict(K=args.K, alpha=args.alpha, xs=xs)
    settings = [(cov, p, n) for cov in args.cov for p in args.p for n in args.n]
    jobs = {}  # key → (function name, keyword arguments)
    for cov, p, n in settings:
        size = dict(common, cov=cov, p=p, n=n)
        jobs[("curve", cov, p, n)] = ("sufficient", dict(size, draws=args.draws, seed=seed_of("s", cov, p, n)))
        if n * p <= args.max_np:
            cq = dict(size, tails="gauss", draws=args.cq_draws, block=args.block, seed=seed_of("g", cov, p, n))
            jobs[("cq", cov, p, n)] = ("per_sample", cq)
        if n * p <= args.max_np_t3:
            t3 = dict(size, tails="t3", draws=args.null_draws, xs=[0.0], block=args.block, seed=seed_of("t", cov, p, n))
            jobs[("t3", cov, p, n)] = ("per_sample", t3)
    P, N = args.big
    for cov in args.cov:
        big = dict(common, cov=cov, p=P, n=N, K=args.K_big, draws=args.draws)
        jobs[("K", cov, args.K_big)] = ("sufficient", dict(big, seed=seed_of("K", cov)))

    def cost(key):  # per-sample jobs first, biggest first, so the pool ends evenly
        name, kw = jobs[key]
        return -(name == "per_sample") * kw["n"] * kw["p"] * kw["draws"]

    keys = sorted(jobs, key=cost)
    start = time.time()
    if args.workers > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.workers) as pool:
            outs = pool.map(run_job, [jobs[k] for k in keys], chunksize=1)
    else:
        outs = [run_job(jobs[k]) for k in keys]
    res = dict(zip(keys, outs))

    curves, nulls, k_table, diffs = {}, {}, {}, []
    for cov, p, n in settings:
        c = dict(res[("curve", cov, p, n)])
        if ("cq", cov, p, n) in res:
            ps = res[("cq", cov, p, n)]
            c["chen-qin"] = ps["chen-qin"]
            diffs += [abs(a - b) for r in EXACT_RULES for a, b in zip(c[r], ps[r])]
        curves[(cov, p, n)] = c
        if ("t3", cov, p, n) in res:
            nulls[(cov, p, n)] = {r: v[0] for r, v in res[("t3", cov, p, n)].items()}
    for cov in args.cov:
        k_table[(cov, args.K)] = res[("curve", cov, P, N)] if ("curve", cov, P, N) in res else None
        k_table[(cov, args.K_big)] = res[("K", cov, args.K_big)]
    k_table = {k: v for k, v in k_table.items() if v is not None}
    check = (
        f"max |ΔP(grow)| = {max(diffs):.3f} over {len(diffs)} points "
        f"(binomial sd of a difference at P = 0.5: {math.sqrt(0.25 / args.draws + 0.25 / args.cq_draws):.3f})"
        if diffs
        else "no setting ran both routes"
    )
    table = markdown(curves, nulls, k_table, check, args)
    print(table)
    print(f"# total {time.time() - start:.0f}s", file=sys.stderr)
    plot(curves, Path(args.png))
    if args.md:
        Path(args.md).write_text(table + "\n")
    return curves, nulls


if __name__ == "__main__":
    main()
