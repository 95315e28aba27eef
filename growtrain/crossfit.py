"""A growth decision with real power: the cross-fit directional test (``rule="crossfit"``).

Why. The paper's rule (Proposition 1) grows only when ``Γ̂_n > δ + t`` with
``t = sqrt(Σ_l σ̂²_l / (n α))``. ``σ̂²_l`` is the *total* variance of a p-dimensional
per-sample gradient, so ``t`` is the noise norm of ``ĝ`` inflated by ``sqrt(K/α)``: the rule
needs ``‖g‖ ≳ sqrt(K/α) · σ/√n`` and practically never grows (docs/design.md §3,
``docs/power.md``). A test about the *length of a mean vector* only needs the noise along one
direction.

The rule. Split the probe sample, in loader order, into ``A`` = the first ``⌈n/2⌉`` samples
and ``B`` = the rest. For every site ``l``:

* ``u_l = ĝ_l(A) / ‖ĝ_l(A)‖`` (the mean per-sample gradient on ``A``, normalised);
* on ``B`` only the per-sample scalars ``s_j = ξ_j · u_l`` are kept (no per-sample gradients).
  Given ``A`` they are i.i.d. with mean ``g_l · u_l ≤ ‖g_l‖`` (Cauchy–Schwarz), ``g_l`` the
  population gradient;
* a one-sided lower confidence bound on that mean, at level ``a = α/K`` (Bonferroni over the
  ``K`` sites), with ``m = |B|``, ``s̄`` the mean and ``sd`` the sample standard deviation
  (``ddof = 1``):

  - ``bound="normal"`` (default): ``s̄ − z_{1−a} · sd/√m`` (central limit theorem);
  - ``bound="cantelli"``: ``s̄ − sd · sqrt((1 − a)/(a m))``, the one-sided Chebyshev
    (Cantelli) inequality for the mean of ``m`` i.i.d. scalars. It needs no distributional
    assumption except that it plugs the *sample* sd in for the true one, so it is
    distribution-free only up to that variance estimate.

  If ``ĝ_l(A) = 0`` the direction is undefined and the bound is ``−∞``.

Decision: grow iff some site's lower bound exceeds ``δ``; the site with the largest lower bound
is the one to grow. Under ``H0: max_l ‖g_l‖ ≤ δ`` the probability of growing is ≤ ``α`` (exactly
for Cantelli up to the variance estimate, asymptotically for the normal bound). The cost is
the same single probe pass; on ``B`` it keeps ``|B|`` floats per site.

Streaming (``CrossFitState``). ``measure_saturation`` feeds every batch's per-sample
gradients in loader order; ``A`` comes first, so ``u_l`` is complete when ``B`` starts, and a
batch that straddles the boundary is split inside. The candidate blocks' BatchNorm statistics
are calibrated on ``A`` only, inside the same pass (``growtrain.probe_pass``), so given ``A`` the
scored block and ``u_l`` are fixed and ``B`` is fresh data: the conditional i.i.d. argument
holds exactly. The probe is read once, so a loader that reshuffles only makes the split random.
Without per-sample gradients (``measure_saturation(variance=False)``, the cross-fit default)
the pass feeds ``advance`` with the sums over ``A`` and ``add_scalars`` with the directional
derivatives ``ξ_i · u_l`` on ``B``; ``update`` is the same from per-sample gradients.

DDP. With ``sync_fn`` (a sum over ranks) each rank splits *its own* shard in two; at its A/B
boundary every rank all-reduces its ``Σ_{i∈A} ξ_i`` (one call per site, in site order), so all
ranks share ``u_l``; at the end the ``B`` counts, sums and centred sums of squares are
all-reduced too. Requirement: every rank must reach its A/B boundary (each shard needs a
non-empty ``A`` and ``B``) and issue no other collective in between. ``DistributedSampler``'s
equal shards with equal batch sizes make every rank reach it at the same batch; unequal shards
work too (a rank that gets there first waits inside the all-reduce), as the tests check.

A Chen & Qin (2010)-style test of ``‖g‖ ≤ δ`` needs per-sample inner products (a Gram matrix)
that a streamed probe pass does not keep; it lives in ``bench/chen_qin.py``, for the power
comparison of ``bench/power.py``.

Pure tensor functions first; ``CrossFitState`` only holds the streamed state.
"""

from __future__ import annotations

import math
import statistics
import warnings
from typing import Callable, Iterable

import torch

from growtrain.batches import batch_size

__all__ = [
    "BOUNDS",
    "check_level",
    "check_delta",
    "normal_quantile",
    "cantelli_factor",
    "crossfit_lower_bound",
    "crossfit_from_samples",
    "probe_size",
    "CrossFitState",
]

BOUNDS = ("normal", "cantelli")


# -- argument checks -------------------------------------------------------------------------
def check_level(value, name: str) -> float:
    """``value`` as a float if it is a probability in ``(0, 1)``; a ``ValueError`` naming ``name`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not (0 < value < 1):
        raise ValueError(f"{name}: expected a probability in (0, 1), e.g. 0.05, got {value!r}")
    return float(value)


def _check_bound(bound) -> str:
    if bound not in BOUNDS:
        raise ValueError(f"bound: expected one of {BOUNDS}, got {bound!r}")
    return bound


def check_delta(delta) -> float:
    """``delta`` (a margin on a gradient norm) as a float if it is finite and ``≥ 0``; a ``ValueError`` otherwise."""
    if isinstance(delta, bool) or not isinstance(delta, (int, float)) or not math.isfinite(delta) or delta < 0:
        raise ValueError(f"delta: expected a finite number ≥ 0, got {delta!r}")
    return float(delta)


# -- the cross-fit lower bound ---------------------------------------------------------------
def normal_quantile(p: float) -> float:
    """``z_p = Φ^{-1}(p)`` of the standard normal."""
    return statistics.NormalDist().inv_cdf(check_level(p, "p"))


def cantelli_factor(a: float, m: int) -> float:
    """``sqrt((1 − a)/(a m))``: Cantelli's one-sided bound for a mean of ``m`` i.i.d. scalars.

    ``P(s̄ − μ ≥ λ) ≤ σ²/(σ² + mλ²)``; setting the right side to ``a`` gives
    ``λ = σ · sqrt((1 − a)/(a m))``.
    """
    a = check_level(a, "a")
    if int(m) < 1:
        raise ValueError(f"m: expected a sample count ≥ 1, got {m!r}")
    return math.sqrt((1.0 - a) / (a * int(m)))


def _bound_factor(level: float, m: int, bound: str) -> float:
    """Multiplier of ``sd`` in the lower bound ``s̄ − factor · sd``."""
    if bound == "normal":
        return normal_quantile(1.0 - level) / math.sqrt(m)
    return cantelli_factor(level, m)


def crossfit_lower_bound(s: torch.Tensor, level: float, bound: str = "normal"):
    """One-sided lower confidence bound at ``level`` on the mean of the i.i.d. scalars ``s``.

    s: ``(m,)`` or ``(..., m)`` (a batch of independent samples, e.g. Monte Carlo draws).
    Returns a float for a 1-D ``s``, else a float64 tensor of shape ``s.shape[:-1]``.
    ``bound="normal"``: ``s̄ − z_{1−level} · sd/√m``;
    ``"cantelli"``: ``s̄ − sd · sqrt((1−level)/(level·m))``.
    """
    level = check_level(level, "level")
    bound = _check_bound(bound)
    if not isinstance(s, torch.Tensor) or s.dim() == 0:
        raise TypeError(f"s: expected a tensor of per-sample scalars with shape (..., m), got {type(s).__name__}")
    m = s.shape[-1]
    if m < 2:
        raise ValueError(f"s: a lower bound needs at least 2 samples for the standard deviation, got {m}")
    s = s.double()
    lower = s.mean(-1) - _bound_factor(level, m, bound) * s.std(-1, correction=1)
    return float(lower) if lower.dim() == 0 else lower


def crossfit_from_samples(xi: torch.Tensor, level: float, bound: str = "normal") -> torch.Tensor:
    """The cross-fit lower bound from one site's per-sample gradients, in sample order.

    xi: ``(..., n, p)``; ``A`` = the first ``⌈n/2⌉`` samples, ``B`` the rest. Returns
    ``(...)`` float64 (``−∞`` where ``ĝ(A) = 0``). The same computation as ``CrossFitState``,
    for in-memory samples (tests, the power study).
    """
    n = xi.shape[-2]
    if n < 4:
        raise ValueError(f"xi: the cross-fit split needs n ≥ 4 samples (2 per half), got {n}")
    n_a = math.ceil(n / 2)
    xi = xi.double()
    sum_a = xi[..., :n_a, :].sum(-2)  # (..., p)
    norm = sum_a.norm(dim=-1, keepdim=True)
    u = sum_a / torch.where(norm > 0, norm, torch.ones_like(norm))
    s = (xi[..., n_a:, :] @ u.unsqueeze(-1)).squeeze(-1)  # (..., n_b)
    lower = torch.as_tensor(crossfit_lower_bound(s, level, bound), dtype=torch.float64, device=xi.device)
    return torch.where(norm.squeeze(-1) > 0, lower, torch.full_like(lower, -math.inf))


# -- streamed state for measure_saturation ---------------------------------------------------
def _check_size(n) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 4:
        raise ValueError(f"probe_size: expected the number of probe samples on this rank (an int ≥ 4), got {n!r}")
    return n


def probe_size(loader, n: int | None = None) -> int:
    """How many samples ``loader`` yields on this rank: ``n`` if given, else from its sampler
    (a ``DataLoader``; per-rank with ``DistributedSampler``), ``len(loader.dataset)``, or the
    batch sizes of a list/tuple of batches."""
    if n is not None:
        return _check_size(n)
    if isinstance(loader, (list, tuple)):
        return sum(batch_size(batch) for batch in loader)
    if isinstance(loader, torch.utils.data.DataLoader) and loader.batch_size is not None:
        try:
            if loader.drop_last:
                return len(loader) * loader.batch_size
            return len(loader.sampler)
        except TypeError:  # an IterableDataset without __len__
            pass
    dataset = getattr(loader, "dataset", None)
    try:
        return len(dataset)  # type: ignore[arg-type]
    except TypeError:
        pass
    raise TypeError(
        f"probe_loader: rule='crossfit' splits the probe sample into its first ⌈n/2⌉ samples and the "
        f"rest, so it must know n before the pass, but a {type(loader).__name__} has no sized sampler "
        "or dataset and is not a list of batches. Pass probe_size=<number of probe samples on this rank> "
        "or use a sized DataLoader."
    )


class CrossFitState:
    """Streamed cross-fit state of ``K`` sites over a probe sample of ``n`` samples (this rank).

    ``update(j, xi, offset)`` (or ``advance`` and ``add_scalars``) for every batch and site, in
    loader order; then ``lower_bounds``.
    """

    def __init__(
        self,
        n: int,
        K: int,
        *,
        sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        bound: str = "normal",
    ):
        self.n = _check_size(n)
        self.n_a = math.ceil(self.n / 2)
        self.K = int(K)
        self.sync_fn = sync_fn
        self.bound = _check_bound(bound)
        self._sum_a: list[torch.Tensor | None] = [None] * self.K  # Σ_{i∈A} ξ_i (float64)
        self._u: list[torch.Tensor | None] = [None] * self.K  # unit direction; None until A is done
        self._defined = [False] * self.K  # ĝ(A) ≠ 0
        self._done_a = [False] * self.K
        self._s: list[list[torch.Tensor]] = [[] for _ in range(self.K)]  # per-sample scalars on B
        self._seen = [0] * self.K

    @classmethod
    def for_loader(
        cls,
        loader: Iterable,
        K: int,
        *,
        sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
        n: int | None = None,
        alpha: float | None = None,
    ) -> "CrossFitState":
        """State sized from the loader (or the ``n`` hint), with the normal bound; checks ``alpha`` early."""
        if alpha is not None:
            check_level(alpha, "alpha")
        return cls(probe_size(loader, n), K, sync_fn=sync_fn)

    def a_count(self, offset: int, size: int) -> int:
        """How many of the samples ``offset … offset+size−1`` belong to ``A``."""
        return min(max(self.n_a - offset, 0), size)

    def advance(self, j: int, offset: int, size: int, sum_a: torch.Tensor | None) -> bool:
        """Site ``j`` saw samples ``offset … offset+size−1``; ``sum_a`` is the sum of their
        cross-gradients that belong to ``A`` (None when none do). Returns True when this call
        completed ``A`` (``u`` is then set, all-reduced over ranks with ``sync_fn``)."""
        if offset != self._seen[j]:
            raise RuntimeError(f"crossfit: site {j} got samples from offset {offset}, expected {self._seen[j]}")
        self._seen[j] += size
        if sum_a is not None:
            part = sum_a.detach().flatten().double()
            self._sum_a[j] = part if self._sum_a[j] is None else self._sum_a[j] + part
        if not self._done_a[j] and offset + size >= self.n_a:
            self._finish_a(j)
            return True
        return False

    def direction(self, j: int) -> torch.Tensor | None:
        """``u_j`` (float64, flat), or None while ``A`` is incomplete or when ``ĝ_j(A) = 0``."""
        return self._u[j] if self._defined[j] else None

    def add_scalars(self, j: int, s: torch.Tensor) -> None:
        """Site ``j``'s per-sample ``ξ_i · u_j`` of samples of ``B``, in loader order."""
        self._s[j].append(s.detach().double())

    def update(self, j: int, xi: torch.Tensor, offset: int) -> None:
        """Site ``j``'s per-sample gradients ``xi: (B, …)`` of samples ``offset … offset+B−1``."""
        xi = xi.detach().flatten(1)  # (B, p)
        size = xi.shape[0]
        k = self.a_count(offset, size)
        self.advance(j, offset, size, xi[:k].sum(0, dtype=torch.float64) if k > 0 else None)
        u = self.direction(j)
        if k < size and u is not None:
            self.add_scalars(j, xi[k:] @ u.to(xi.dtype))  # (B − k,)

    def _finish_a(self, j: int) -> None:
        total = self._sum_a[j]
        if self.sync_fn is not None:
            total = self.sync_fn(total)
        norm = total.norm()
        self._defined[j] = bool(norm > 0)
        self._u[j] = total / norm if self._defined[j] else None
        self._done_a[j] = True

    def lower_bounds(self, alpha: float) -> tuple[list[float], dict]:
        """Per-site lower bounds at level ``alpha/K`` and the figures behind them.

        With ``sync_fn`` it all-reduces (twice, in the same order on every rank).
        """
        alpha = check_level(alpha, "alpha")
        level = alpha / self.K
        if not all(self._done_a):
            raise ValueError(
                f"probe_loader: it yielded {min(self._seen)} samples on this rank, but the cross-fit split "
                f"expected n={self.n} (A = the first {self.n_a}); pass probe_size=<the true count>"
            )
        if any(seen != self.n for seen in self._seen):
            warnings.warn(
                f"crossfit: the probe loader yielded {self._seen[0]} samples, not the expected n={self.n}; "
                f"A is the first {self.n_a} of them, B the other {self._seen[0] - self.n_a}",
                stacklevel=3,
            )
        device = self._sum_a[0].device  # the probe's device: every scalar below stays there
        s_all = [torch.cat(s) if s else torch.zeros(0, dtype=torch.float64, device=device) for s in self._s]
        n_a = torch.tensor(float(min(self.n_a, self._seen[0])), dtype=torch.float64, device=device)
        n_b = torch.tensor(float(self._seen[0] - self.n_a), dtype=torch.float64, device=device)
        sums = torch.stack([s.sum() for s in s_all] + [n_a, n_b])  # (K + 2,)
        if self.sync_fn is not None:
            sums = self.sync_fn(sums)
        n_a, n_b = int(sums[-2].item()), int(sums[-1].item())
        if n_b < 2:
            raise ValueError(f"crossfit: half B has {n_b} sample(s); it needs at least 2 (a probe sample of n ≥ 4)")
        means = sums[:-2] / n_b
        ss = torch.stack([(s - mu).pow(2).sum() for s, mu in zip(s_all, means)])  # centred Σ(s − s̄)²
        if self.sync_fn is not None:
            ss = self.sync_fn(ss)
        sds = (ss / (n_b - 1)).sqrt()
        factor = _bound_factor(level, n_b, self.bound)
        lowers = [
            float(mu - factor * sd) if defined else -math.inf
            for mu, sd, defined in zip(means.tolist(), sds.tolist(), self._defined)
        ]
        info = {"level": level, "bound_kind": self.bound, "n_a": n_a, "n_b": n_b, "factor": factor}
        return lowers, info
