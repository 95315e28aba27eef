"""Paired statistics for Growth vs Scratch: Student-t quantiles without scipy, the mean paired
difference with its t-interval, and the "equal training loss" lookup.

Why paired: both arms of one seed see the same data split and the same data order, so the
per-seed difference ``growth − scratch`` removes the variation the two arms share; its mean
and a 95 % t-interval (``mean ± t_{0.975, n−1} · sd / √n``) are the comparison's answer.
"""

from __future__ import annotations

import math
from typing import Iterable, Sequence

__all__ = ["student_t_cdf", "student_t_quantile", "paired_difference", "first_reaching", "equal_loss_target"]


def _betacf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz; Numerical Recipes 6.4)."""
    tiny, eps = 1e-300, 1e-15
    qab, qap, qam = a + b, a + 1.0, a - 1.0
    c, d = 1.0, 1.0 - qab * x / qap
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 10_000):
        m2 = 2 * m
        aa = m * (b - m) * x / ((qam + m2) * (a + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        h *= d * c
        aa = -(a + m) * (qab + m) * x / ((a + m2) * (qap + m2))
        d = 1.0 + aa * d
        d = 1.0 / (d if abs(d) > tiny else tiny)
        c = 1.0 + aa / c
        c = c if abs(c) > tiny else tiny
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < eps:
            break
    return h


def _betainc(a: float, b: float, x: float) -> float:
    """Regularised incomplete beta I_x(a, b)."""
    if x <= 0.0:
        return 0.0
    if x >= 1.0:
        return 1.0
    log_front = math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log1p(-x)
    if x < (a + 1.0) / (a + b + 2.0):
        return math.exp(log_front) * _betacf(a, b, x) / a
    return 1.0 - math.exp(log_front) * _betacf(b, a, 1.0 - x) / b


def student_t_cdf(t: float, df: float) -> float:
    """P(T ≤ t) for Student's t with ``df`` degrees of freedom."""
    if df <= 0:
        raise ValueError(f"df: expected degrees of freedom > 0, got {df}")
    tail = 0.5 * _betainc(df / 2.0, 0.5, df / (df + t * t))  # P(T > |t|)
    return 1.0 - tail if t >= 0 else tail


def student_t_quantile(p: float, df: float) -> float:
    """The ``p``-quantile of Student's t (e.g. ``p=0.975``: the two-sided 95 % critical value),
    by bisection on :func:`student_t_cdf` to ~1e-12."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p: expected a probability strictly between 0 and 1, got {p}")
    if df <= 0:
        raise ValueError(f"df: expected degrees of freedom > 0, got {df}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    lo, hi = 0.0, 1.0
    while student_t_cdf(hi, df) < p:  # df=1, p=0.9995 needs ~637
        hi *= 2.0
    for _ in range(200):
        mid = 0.5 * (lo + hi)
        if student_t_cdf(mid, df) < p:
            lo = mid
        else:
            hi = mid
        if hi - lo < 1e-12 * max(1.0, hi):
            break
    return 0.5 * (lo + hi)


def paired_difference(first: Sequence[float | None], second: Sequence[float | None], level: float = 0.95) -> dict:
    """Mean of ``first[i] − second[i]`` over the pairs where both are known, with the sample
    sd (ddof 1) and the two-sided ``level`` t-interval; ``lo``/``hi`` are None for one pair."""
    if len(first) != len(second):
        raise ValueError(f"paired_difference: expected equal-length sequences (one value per seed), got {len(first)} and {len(second)}")
    diffs = [float(a) - float(b) for a, b in zip(first, second) if a is not None and b is not None]
    n = len(diffs)
    out: dict = {"n": n, "mean": None, "sd": None, "lo": None, "hi": None}
    if n == 0:
        return out
    mean = sum(diffs) / n
    out["mean"] = mean
    if n > 1:
        sd = math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1))
        half = student_t_quantile(0.5 + level / 2.0, n - 1) * sd / math.sqrt(n)
        out.update(sd=sd, lo=mean - half, hi=mean + half)
    return out


def equal_loss_target(final_losses: Iterable[float]) -> float:
    """The common train-loss target of one seed: the larger of the arms' final training
    losses, so every arm reaches it at some epoch of its own run."""
    values = [float(v) for v in final_losses]
    if not values:
        raise ValueError("equal_loss_target: expected at least one arm's final training loss")
    return max(values)


def first_reaching(trace: Sequence[dict], target: float, key: str = "train_loss") -> dict | None:
    """The first epoch record of ``trace`` whose ``key`` is ≤ ``target`` (None if none is)."""
    for record in trace:
        value = record.get(key)
        if value is not None and value <= target:
            return record
    return None
