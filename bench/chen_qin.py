"""A Chen & Qin (2010)-style test of ``H0: ‖g‖ ≤ δ`` on per-sample gradients, for ``bench/power.py``.

Not part of the library (the growth decision uses ``growtrain.crossfit``'s cross-fit bound):
its variance needs ``tr(Σ²)``, i.e. per-sample inner products ``ξ_i · ξ_j`` (a Gram matrix,
``O(n² p)``), which a streamed probe pass does not keep. It is compared with the other rules
on the planted problem of ``bench/power.py`` (``docs/power.md``).

``debiased_norm_sq`` is ``‖ĝ‖² − σ̂²/n = Σ_{i≠j} ξ_i·ξ_j / (n(n−1))``, unbiased for ``‖g‖²``;
``chen_qin_test`` tests ``H0: ‖g‖ ≤ δ`` with the variance ``2 tr(Σ²)/(n(n−1))`` (+ ``4 δ²
λ_max(Σ)/n`` for ``δ > 0``).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from growtrain.crossfit import check_delta, check_level, normal_quantile  # noqa: E402

__all__ = ["debiased_norm_sq", "trace_sq_estimate", "chen_qin_z", "chen_qin_test", "ChenQin", "TRACE_METHODS"]

TRACE_METHODS = ("full", "pairs")


def debiased_norm_sq(xi: torch.Tensor) -> torch.Tensor:
    """``‖ĝ‖² − σ̂²/n = Σ_{i≠j} ξ_i·ξ_j / (n(n−1))``, unbiased for ``‖g‖²``.

    xi: ``(..., n, p)`` per-sample gradients. Returns ``(...)`` float64; may be negative.
    """
    n = xi.shape[-2]
    if n < 2:
        raise ValueError(f"xi: the debiased statistic needs n ≥ 2 samples, got {n}")
    xi = xi.double()
    total = xi.sum(-2).pow(2).sum(-1)  # ‖Σ ξ_i‖²
    diag = xi.pow(2).sum((-2, -1))  # Σ ‖ξ_i‖²
    return (total - diag) / (n * (n - 1))


def _centred_gram_stats(xi: torch.Tensor):
    """``(tr S, tr S², Q, λ_max(S))`` of the sample covariance ``S`` from the smaller Gram side."""
    n, p = xi.shape[-2], xi.shape[-1]
    xc = xi - xi.mean(-2, keepdim=True)  # (..., n, p)
    gram = xc @ xc.transpose(-1, -2) if n <= p else xc.transpose(-1, -2) @ xc  # (..., r, r)
    row_sq = xc.pow(2).sum(-1)  # (..., n): ‖ξ_i − ξ̄‖²
    tr_s = row_sq.sum(-1) / (n - 1)
    tr_s2 = gram.pow(2).sum((-2, -1)) / (n - 1) ** 2
    q = row_sq.pow(2).sum(-1) / (n - 1)
    lam_max = torch.linalg.eigvalsh(gram)[..., -1] / (n - 1)
    return tr_s, tr_s2, q, lam_max


def trace_sq_estimate(xi: torch.Tensor, method: str = "full", block: int = 32) -> torch.Tensor:
    """An unbiased estimate of ``tr(Σ²)``, ``Σ`` the covariance of the per-sample gradients.

    xi: ``(..., n, p)``. Returns ``(...)`` float64.

    ``method="full"``: the order-4 U-statistic ``¼ · mean_{i,j,k,l distinct}
    ((ξ_i − ξ_j)·(ξ_k − ξ_l))²`` (invariant to the mean ``g``), in the closed form of Himeno &
    Yamada (2014): ``(n−1)/(n(n−2)(n−3)) · ((n−1)(n−2) tr S² + (tr S)² − n Q)`` with
    ``Q = Σ_i ‖ξ_i − ξ̄‖⁴/(n−1)``; ``O(n p · min(n, p))``, needs ``n ≥ 4``. Chen & Qin's own
    leave-two-out estimator is a close variant (ratio-consistent; not exactly unbiased when
    ``g ≠ 0``).
    ``method="pairs"``: an incomplete U-statistic, ``O(block · n p)``: the differences
    ``d_k = (ξ_{2k} − ξ_{2k+1})/√2`` are i.i.d. with mean 0 and covariance ``Σ``, so
    ``E (d_k·d_l)² = tr Σ²`` for ``k ≠ l``; it averages ``(d_k·d_l)²`` over all pairs
    ``k < l`` inside consecutive blocks of ``block`` differences (needs ``n ≥ 4``). Computed
    in ``xi``'s floating dtype (float32 is fine for the products), summed in float64.
    """
    if method not in TRACE_METHODS:
        raise ValueError(f"method: expected one of {TRACE_METHODS}, got {method!r}")
    n = xi.shape[-2]
    if n < 4:
        raise ValueError(f"xi: a tr(Σ²) estimate needs n ≥ 4 samples, got {n}")
    if method == "full":
        tr_s, tr_s2, q, _ = _centred_gram_stats(xi.double())
        return (n - 1) / (n * (n - 2) * (n - 3)) * ((n - 1) * (n - 2) * tr_s2 + tr_s.pow(2) - n * q)
    if isinstance(block, bool) or not isinstance(block, int) or block < 2:
        raise ValueError(f"block: expected an int ≥ 2 (differences per block), got {block!r}")
    if not xi.is_floating_point() or torch.finfo(xi.dtype).bits < 32:
        xi = xi.float()
    m = n // 2
    d = (xi[..., 0 : 2 * m : 2, :] - xi[..., 1 : 2 * m : 2, :]) / math.sqrt(2.0)  # (..., m, p)
    total = torch.zeros(d.shape[:-2], dtype=torch.float64, device=d.device)
    count = 0
    full, rest = divmod(m, block)
    chunks = [(d[..., : full * block, :].reshape(*d.shape[:-2], full, block, d.shape[-1]), block)] if full else []
    if rest >= 2:
        chunks.append((d[..., full * block :, :].unsqueeze(-3), rest))
    for chunk, b in chunks:  # (..., blocks, b, p)
        gram = (chunk @ chunk.transpose(-1, -2)).double()  # (..., blocks, b, b)
        off = gram.pow(2).sum((-2, -1)) - gram.diagonal(dim1=-2, dim2=-1).pow(2).sum(-1)  # Σ_{k≠l}
        total = total + off.sum(-1) / 2
        count += chunk.shape[-3] * b * (b - 1) // 2
    return total / count


def chen_qin_z(
    statistic: torch.Tensor,
    trace_sq: torch.Tensor,
    n: int,
    delta: float = 0.0,
    lam_max: torch.Tensor | None = None,
) -> torch.Tensor:
    """``z = (T − δ²)/sd`` with ``sd² = 2 tr(Σ²)/(n(n−1)) + 4 δ² λ_max/n``.

    ``T`` is ``debiased_norm_sq``. Under ``‖g‖ = δ``, ``Var T = 2 tr(Σ²)/(n(n−1)) + 4 gᵀΣg/n``
    and ``gᵀΣg ≤ δ² λ_max(Σ)``; ``λ_max`` of the sample covariance is biased upwards in high
    dimension (and on average by convexity), which errs on the conservative side. For
    ``δ = 0`` it is Chen & Qin's statistic.
    """
    delta = check_delta(delta)
    var = 2.0 * torch.as_tensor(trace_sq, dtype=torch.float64).clamp_min(0) / (n * (n - 1))
    if delta > 0:
        if lam_max is None:
            raise ValueError("lam_max: needed for delta > 0 (the variance term 4 δ² gᵀΣg/n)")
        var = var + 4.0 * delta**2 * torch.as_tensor(lam_max, dtype=torch.float64).clamp_min(0) / n
    sd = var.sqrt()
    excess = torch.as_tensor(statistic, dtype=torch.float64) - delta**2
    tiny = torch.finfo(torch.float64).tiny
    return torch.where(sd > 0, excess / sd.clamp_min(tiny), torch.sign(excess) * math.inf)


class ChenQin(NamedTuple):
    statistic: torch.Tensor  # T = Σ_{i≠j} ξ_i·ξ_j/(n(n−1)), unbiased for ‖g‖²
    trace_sq: torch.Tensor  # estimate of tr(Σ²)
    z: torch.Tensor  # (T − δ²)/sd
    reject: torch.Tensor  # z > z_{1−α}: evidence that ‖g‖ > δ (grow)


def chen_qin_test(
    xi: torch.Tensor, delta: float = 0.0, alpha: float = 0.05, *, trace: str = "full", block: int = 32
) -> ChenQin:
    """One-sided test of ``H0: ‖g‖ ≤ δ`` from per-sample gradients ``xi: (..., n, p)``.

    Rejects (grow) when ``z = (T − δ²)/sd > z_{1−α}`` (normal approximation, valid as
    ``n, p → ∞`` under Chen & Qin's conditions). Per site at level ``α/K`` for ``K`` sites.
    """
    alpha = check_level(alpha, "alpha")
    delta = check_delta(delta)
    n = xi.shape[-2]
    statistic = debiased_norm_sq(xi)
    trace_sq = trace_sq_estimate(xi, trace, block)
    lam_max = _centred_gram_stats(xi.double())[3] if delta > 0 else None
    z = chen_qin_z(statistic, trace_sq, n, delta, lam_max)
    return ChenQin(statistic, trace_sq, z, z > normal_quantile(1.0 - alpha))
