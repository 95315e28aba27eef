"""The growth decision: pure, typed functions from probe statistics to a verdict with a reason.

Two rules read the same probe pass (``measure_saturation``); every report carries all the
verdicts it could compute, and states, when it is built, which rule made its decision.

* ``"paper"`` — Proposition 1: saturated iff ``Γ̂_n ≤ δ + t``, ``t = sqrt(Σ_l σ̂²_l/(nα))``.
* ``"crossfit"`` — grow iff some site's cross-fit lower bound on ``‖g_l‖`` (level ``α/K``)
  exceeds the absolute margin ``δ`` (``growtrain.crossfit``).
* ``"crossfit"`` is the callback's default rule; with ``min_gain`` the callback's decision is a
  block-only trial (``growtrain.trial``) or the paired stage fork (``growtrain.fork``), and the
  rule only ranks the sites.

Also here: the rules' defaults (``DEFAULT_RULE``, ``DEFAULT_MIN_GAIN``). The block-only trial
(``growtrain.trial``) and the paired fork (``growtrain.fork``) return this module's ``Verdict``. When a check comes and what a verdict turns
into (the budgets) are not decisions: they are ``growtrain.schedule_rules``'s. No Lightning import here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

__all__ = [
    "RULES",
    "DEFAULT_RULE",
    "DEFAULT_MIN_GAIN",
    "Verdict",
    "paper_verdict",
    "crossfit_verdict",
]

Rule = Literal["paper", "crossfit"]
RULES: tuple[str, ...] = ("paper", "crossfit")
# The decision entry points' default: a certified first-order gain (δ = 0); in the callback the
# rule ranks the sites and min_gain decides (a trial, the periodic stage fork).
DEFAULT_RULE: Rule = "crossfit"
# min_gain: grow only where a tried block (or the stage fork's arm) lowers the held-out loss by a
# certified more than this fraction of it (docs/decision.md, results.md "Stop where depth stops paying").
DEFAULT_MIN_GAIN = 0.01


@dataclass(frozen=True)
class Verdict:
    """One rule's answer: ``saturated``, where to grow, and what was compared with what."""

    rule: str
    saturated: bool
    site: str | None  # the site to grow at (None when saturated)
    score: float  # the rule's statistic: Γ̂ (paper) or the best lower bound (crossfit)
    margin: float  # what the statistic had to exceed: δ + t or δ
    reason: str
    # ``saturated`` says growth should end; ``certified`` says more: an upper confidence bound on what
    # one more block gains lies below the margin (block-only trials, the stage fork). A stop without it
    # is "no certified gain": the lower bound did not clear the margin, which leaves a gain above it
    # unresolved. A field set from the numbers by the rule, so no reader has to parse ``reason``.
    certified: bool = False

    def to_dict(self) -> dict:
        return {"rule": self.rule, "saturated": self.saturated, "certified": self.certified, "site": self.site,
                "score": self.score, "margin": self.margin, "reason": self.reason}  # fmt: skip


# -- the two rules -------------------------------------------------------------------------
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


def crossfit_verdict(lowers: Sequence[float], names: Sequence[str], delta: float, level: float) -> Verdict:
    """Grow iff ``max_l lower_l > δ`` (each bound at ``level = α/K``) at the argmax site. A stop
    certifies nothing: a lower bound at or below δ leaves ``‖g_l‖ > δ`` open."""
    j = max(range(len(lowers)), key=lambda j: lowers[j])
    best, name = lowers[j], names[j]
    if best > delta:
        return Verdict("crossfit", False, name, best, delta,
                       f"grow: lower bound {best:.4g} at {name} > δ={delta:.4g} (level {level:.3g})")  # fmt: skip
    return Verdict("crossfit", True, None, best, delta,
                   f"no certified first-order gain: max lower bound {best:.4g} (at {name}) ≤ δ={delta:.4g} "
                   f"(level {level:.3g})")  # fmt: skip
