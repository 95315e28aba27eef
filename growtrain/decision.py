"""The growth decision: pure, typed functions from probe statistics to a verdict with a reason.

Three rules read the same probe pass (``measure_saturation``); every report carries all the
verdicts it could compute, and states, when it is built, which rule made its decision.

* ``"paper"`` — Proposition 1: saturated iff ``Γ̂_n ≤ δ + t``, ``t = sqrt(Σ_l σ̂²_l/(nα))``.
* ``"crossfit"`` — grow iff some site's cross-fit lower bound on ``‖g_l‖`` (level ``α/K``)
  exceeds the absolute margin ``δ`` (``growtrain.crossfit``).
* ``"crossfit"`` is the callback's default rule; with ``min_gain`` the callback's decision is a
  block-only trial (``growtrain.trial``) or the paired stage fork (``growtrain.fork``), and the
  rule only ranks the sites.
* ``"relative"`` — grow iff some site's cross-fit lower bound exceeds
  ``max(δ, τ · R)``, where ``R`` is the root-mean-square population gradient norm of the
  *existing* blocks' terminal maps, estimated without bias on half ``A`` of the same probe
  pass (:func:`debiased_reference`). ``R`` is fixed given ``A`` and the bound uses only ``B``,
  so the test keeps its level conditionally on ``A``. The ratio of two gradient norms of the
  same loss is unchanged by scaling the loss and has no learning-rate units: the decision is
  scale-free. Why this rule and how ``τ`` was chosen: ``docs/decision.md``. It did not track
  depth on real data: it is reported (``growtrain measure``), not a callback option.

Also here: the option these rules read, checked (``check_tau``), and their
defaults (``DEFAULT_RULE``, ``DEFAULT_TAU``, ``DEFAULT_MIN_GAIN``). The block-only trial
(``growtrain.trial``) and the paired fork (``growtrain.fork``) return this module's ``Verdict``. When a check comes and what a verdict turns
into (the budgets) are not decisions: they are ``growtrain.schedule_rules``'s. No Lightning import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, Sequence

import torch

__all__ = [
    "RULES",
    "DEFAULT_RULE",
    "DEFAULT_TAU",
    "DEFAULT_MIN_GAIN",
    "Verdict",
    "paper_verdict",
    "crossfit_verdict",
    "relative_verdict",
    "debiased_reference",
    "check_tau",
]

Rule = Literal["paper", "crossfit", "relative"]
RULES: tuple[str, ...] = ("paper", "crossfit", "relative")
# The decision entry points' default: a certified first-order gain (δ = 0); in the callback the
# rule ranks the sites and min_gain decides (a trial, the periodic stage fork). The relative rule did
# not track depth on real data (docs/decision.md) and stays available and reported.
DEFAULT_RULE: Rule = "crossfit"
# min_gain: grow only where a tried block (or the stage fork's arm) lowers the held-out loss by a
# certified more than this fraction of it (docs/decision.md, results.md "Stop where depth stops paying").
DEFAULT_MIN_GAIN = 0.01
# τ: the relative rule's threshold (a fraction of the existing blocks' RMS first-order value).
# Set a priori; on real data the ratio did not fall with depth (docs/decision.md).
DEFAULT_TAU = 0.5


@dataclass(frozen=True)
class Verdict:
    """One rule's answer: ``saturated``, where to grow, and what was compared with what."""

    rule: str
    saturated: bool
    site: str | None  # the site to grow at (None when saturated)
    score: float  # the rule's statistic: Γ̂ (paper) or the best lower bound (crossfit, relative)
    margin: float  # what the statistic had to exceed: δ + t, δ, or max(δ, τ·R)
    reason: str
    # ``saturated`` says growth should end; ``certified`` says more: an upper confidence bound on what
    # one more block gains lies below the margin (block-only trials, the stage fork). A stop without it
    # is "no certified gain": the lower bound did not clear the margin, which leaves a gain above it
    # unresolved. A field set from the numbers by the rule, so no reader has to parse ``reason``.
    certified: bool = False

    def to_dict(self) -> dict:
        return {"rule": self.rule, "saturated": self.saturated, "certified": self.certified, "site": self.site,
                "score": self.score, "margin": self.margin, "reason": self.reason}  # fmt: skip


def check_tau(tau: object, arg: str = "tau") -> float:
    """``τ`` must be a finite number > 0 (a ratio of gradient norms)."""
    if isinstance(tau, bool) or not isinstance(tau, (int, float)) or not math.isfinite(tau) or tau <= 0:
        raise ValueError(
            f"{arg}: expected a finite number > 0 (the fraction of the existing blocks' RMS gradient norm a new "
            f"block must certify); got {tau!r}. Fix: pass {arg}={DEFAULT_TAU} (the default), or rule='crossfit' "
            "for an absolute margin delta."
        )
    return float(tau)


# -- the three rules -------------------------------------------------------------------------
def paper_verdict(gamma: float, best_site: str, delta: float, t: float) -> Verdict:
    """Proposition 1: saturated iff ``Γ̂_n ≤ δ + t``; the best site is ``argmax_l ‖ĝ_l‖``.

    What a stop certifies: Proposition 1 separates ``Γ ≤ δ`` from ``Γ ≥ δ + 2t``, so ``Γ̂ ≤ δ + t``
    rules out ``Γ ≥ δ + 2t`` (up to its error bound), not ``Γ > δ``: "no certified first-order gain"."""
    margin = delta + t
    if gamma <= margin:
        return Verdict("paper", True, None, gamma, margin,
                       f"no certified first-order gain: Γ̂={gamma:.4g} ≤ δ+t={margin:.4g} (Proposition 1 then "
                       f"bounds the first-order gain Γ below δ+2t={delta + 2 * t:.4g} up to its error bound, "
                       "not below δ)")  # fmt: skip
    return Verdict("paper", False, best_site, gamma, margin, f"grow: Γ̂={gamma:.4g} > δ+t={margin:.4g}")


def _best(lowers: Sequence[float]) -> int:
    return max(range(len(lowers)), key=lambda j: lowers[j])


def crossfit_verdict(lowers: Sequence[float], names: Sequence[str], delta: float, level: float) -> Verdict:
    """Grow iff ``max_l lower_l > δ`` (each bound at ``level = α/K``) at the argmax site. A stop
    certifies nothing: a lower bound at or below δ leaves ``‖g_l‖ > δ`` open."""
    j = _best(lowers)
    best, name = lowers[j], names[j]
    if best > delta:
        return Verdict("crossfit", False, name, best, delta,
                       f"grow: lower bound {best:.4g} at {name} > δ={delta:.4g} (level {level:.3g})")  # fmt: skip
    return Verdict("crossfit", True, None, best, delta,
                   f"no certified first-order gain: max lower bound {best:.4g} (at {name}) ≤ δ={delta:.4g} "
                   f"(level {level:.3g})")  # fmt: skip


def relative_verdict(
    lowers: Sequence[float], names: Sequence[str], reference: float, tau: float, delta: float, level: float
) -> Verdict:
    """Grow iff ``max_l lower_l > max(δ, τ·R)``: a new block certifies at least ``τ`` times the
    first-order value (gradient norm) of an average existing block. Like the cross-fit rule, a
    stop is a lower bound that did not clear the margin: no certified gain, not saturation."""
    j = _best(lowers)
    best, name = lowers[j], names[j]
    margin = max(delta, tau * reference)
    ratio = best / reference if reference > 0 else math.inf
    what = f"lower bound {best:.4g} at {name} = {ratio:.3g}×R (R={reference:.4g}, τ={tau:g}, level {level:.3g})"
    if best > margin:
        return Verdict("relative", False, name, best, margin, f"grow: {what} > max(δ, τ·R)={margin:.4g}")
    return Verdict("relative", True, None, best, margin,
                   f"no certified first-order gain: {what} ≤ max(δ, τ·R)={margin:.4g}")  # fmt: skip


def debiased_reference(
    sum_grad: Sequence[torch.Tensor], sum_sq: Sequence[float], n: int, sum_n_sq: float
) -> tuple[float, list[float]]:
    """``R``: the RMS over existing blocks of an unbiased estimate of ``‖g_b‖²``, and the per-block
    estimates.

    Per block ``b`` the probe's half ``A`` is cut into pieces ``k`` of ``n_k`` samples, with
    ``S_{b,k}`` the gradient of the piece's *summed* loss w.r.t. the block's terminal map.
    Independent pieces give ``E[S_k·S_k'] = n_k n_k' ‖g_b‖²`` for ``k ≠ k'``, so

        R_b² = (‖Σ_k S_{b,k}‖² − Σ_k ‖S_{b,k}‖²) / (n² − Σ_k n_k²)

    is unbiased for ``‖g_b‖²`` (a U-statistic over pieces; it needs no per-sample gradients and
    can be negative). ``R = sqrt(max(0, mean_b R_b²))``.

    sum_grad: per block ``Σ_k S_{b,k}`` (float64, any shape); sum_sq: per block
    ``Σ_k ‖S_{b,k}‖²``; n: ``Σ_k n_k``; sum_n_sq: ``Σ_k n_k²``.
    """
    if len(sum_grad) != len(sum_sq) or not sum_grad:
        raise ValueError(f"sum_grad, sum_sq: expected one entry per existing block (≥ 1), got {len(sum_grad)}, {len(sum_sq)}")
    pairs = float(n) * float(n) - float(sum_n_sq)
    if pairs <= 0:
        raise ValueError(
            f"n, sum_n_sq: the reference needs at least two independent pieces of half A (n={n}, Σn_k²={sum_n_sq})"
        )
    per_block = [(float(s.double().pow(2).sum()) - float(q)) / pairs for s, q in zip(sum_grad, sum_sq)]
    mean_sq = sum(per_block) / len(per_block)
    return math.sqrt(max(0.0, mean_sq)), per_block

