"""The saturation report: per-site records and the report of one probe pass, and the function
that turns a pass's streamed sums into them (every verdict the pass can compute, and the one the
chosen rule makes). No Lightning import here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import nn

from growtrain import decision as dec
from growtrain import probe_math as pm
from growtrain.growable import Site

__all__ = ["SaturationReport", "SiteRecord", "build_report", "rank_sites"]


# -- report --------------------------------------------------------------------------------
@dataclass
class SiteRecord:
    """Scores of one candidate site; ``block`` is the scored candidate (``V = 0``)."""

    site: Site
    block: nn.Module
    grad_norm: float
    variance: float | None  # σ̂²; None when the pass was run without variance=True
    ag: float
    ag_batch: float
    projected: float | None
    grad: list[torch.Tensor] = field(repr=False)  # ĝ, shaped like block.terminal_parameters()
    lower: float | None = None  # rule="crossfit": certified lower bound on ‖g_pop‖

    @property
    def name(self) -> str:
        return self.site.name

    @property
    def realisability(self) -> float | None:
        """``V_S / AG`` (Remark 3): 1 when the activation gradient is fully realisable."""
        if self.projected is None or self.ag == 0:
            return None
        return self.projected / self.ag

    def to_dict(self) -> dict:
        return {
            "site": self.name,
            "grad_norm": self.grad_norm,
            "variance": self.variance,
            "ag": self.ag,
            "ag_batch": self.ag_batch,
            "projected": self.projected,
            "realisability": self.realisability,
            "lower": self.lower,
        }


@dataclass
class SaturationReport:
    sites: list[SiteRecord]
    gamma: float  # Γ̂_n = max_l ‖ĝ_l‖₂
    t: float | None  # None without σ̂² (a cross-fit pass run without variance=True)
    threshold: float | None  # δ + t
    delta: float
    alpha: float
    n: int
    saturated: bool
    best_site: str | None  # the site growth would use (None when saturated)
    error_bound: float | None  # Σ_l σ̂²_l / (n t²)
    rule: str = "paper"  # the rule that made ``saturated``/``best_site``/``reason``
    reason: str = ""
    extra: dict = field(default_factory=dict)  # rule-specific figures (e.g. crossfit levels)
    margin: float = math.nan  # what the deciding rule's statistic had to exceed (δ+t or δ)
    verdicts: dict = field(default_factory=dict)  # every rule's verdict this pass could compute

    @property
    def ag_max(self) -> float:
        return max(r.ag for r in self.sites)

    @property
    def best_record(self) -> SiteRecord:
        """The top-scoring site's record (also when saturated): largest lower bound under the
        cross-fit rule, largest ‖ĝ‖ under the paper's."""
        if self.rule == "crossfit":
            return max(self.sites, key=lambda r: r.lower)
        return max(self.sites, key=lambda r: r.grad_norm)

    def record(self, site: Site | str) -> SiteRecord:
        name = site.name if isinstance(site, Site) else site
        for r in self.sites:
            if r.name == name:
                return r
        raise KeyError(f"site: no record for {name!r}; scored sites are {[r.name for r in self.sites]}")

    def to_dict(self) -> dict:
        return {
            "rule": self.rule,
            "gamma": self.gamma,
            "t": self.t,
            "threshold": self.threshold,
            "delta": self.delta,
            "alpha": self.alpha,
            "n": self.n,
            "saturated": self.saturated,
            "best_site": self.best_site,
            "error_bound": self.error_bound,
            "ag_max": self.ag_max,
            "reason": self.reason,
            "margin": self.margin,
            "verdicts": {k: v.to_dict() for k, v in self.verdicts.items()},
            **{k: v for k, v in self.extra.items()},
            "sites": [r.to_dict() for r in self.sites],
        }

    def table(self):
        from growtrain.report import saturation_table

        return saturation_table(self)

    def __rich__(self):
        return self.table()


def build_report(sites, accs, n, batches, delta, alpha, t, rule, crossfit, variance=True) -> SaturationReport:
    """Per-site records, every verdict this pass can compute, and the one ``rule`` makes.

    Without ``variance`` the pass kept no ``Σ‖ξ_i‖²``: σ̂², the paper's ``t`` (unless given),
    threshold and error bound are None, and there is no paper verdict."""
    records = []
    for site, acc in zip(sites, accs):
        grad = acc.sum_xi.cpu() / n
        grad_norm = float(grad.norm())
        sigma_sq = pm.sample_variance(float(acc.sum_sq), float(acc.sum_xi.pow(2).sum()), n) if variance else None
        records.append(
            SiteRecord(
                site=site,
                block=acc.block,
                grad_norm=grad_norm,
                variance=sigma_sq,
                ag=math.sqrt(float(acc.sum_q_sq) / n),
                ag_batch=float(acc.sum_batch_norm) / batches,
                projected=acc.projected_value(n),
                grad=acc.split(grad),
            )
        )
    gamma = max(r.grad_norm for r in records)
    total_variance = sum(r.variance for r in records) if variance else None
    if t is None:
        t = pm.chebyshev_t(total_variance, n, alpha) if variance else None
    best_norm = max(records, key=lambda r: r.grad_norm).name
    verdicts = {"paper": dec.paper_verdict(gamma, best_norm, delta, t)} if variance else {}
    extra: dict = {}
    if crossfit is not None:
        lowers, info = crossfit.lower_bounds(alpha)
        if info["n_a"] + info["n_b"] != n:
            raise RuntimeError(f"crossfit: it saw {info['n_a'] + info['n_b']} probe samples, the report counts {n}")
        for record, lower in zip(records, lowers):
            record.lower = lower
        names = [r.name for r in records]
        verdicts["crossfit"] = dec.crossfit_verdict(lowers, names, delta, info["level"])
        best = max(range(len(lowers)), key=lambda j: lowers[j])
        extra = {
            "level": info["level"], "bound_kind": info["bound_kind"], "n_a": info["n_a"], "n_b": info["n_b"],
            "max_lower": lowers[best], "lower_site": names[best],
        }  # fmt: skip
        if "paper" in verdicts:
            extra["paper_decision"] = "saturated" if verdicts["paper"].saturated else "grow"
        split = f" ({info['bound_kind']} bound, level α/K={info['level']:.3g}, |A|={info['n_a']}, |B|={info['n_b']})"
    chosen = verdicts[rule]
    reason = chosen.reason if rule == "paper" else chosen.reason + split
    return SaturationReport(
        sites=records,
        gamma=gamma,
        t=t,
        threshold=None if t is None else delta + t,
        delta=delta,
        alpha=alpha,
        n=n,
        saturated=chosen.saturated,
        best_site=chosen.site,
        error_bound=pm.chebyshev_bound(total_variance, n, t) if variance else None,
        rule=rule,
        reason=reason,
        extra=extra,
        margin=chosen.margin,
        verdicts=verdicts,
    )


# -- which sites a report says to grow (here, not in decision.py: the decisions import no report)
def rank_sites(report: SaturationReport, top_k: int) -> list[str]:
    """Up to ``top_k`` distinct sites to grow, best first (empty when saturated).

    The first is the report's ``best_site``. Further sites need the same evidence: with the
    cross-fit rule only sites whose certified ``lower`` exceeds the rule's margin
    (ranked by ``lower``); with the paper's rule the next sites by ``‖ĝ‖`` (Proposition 1
    certifies the maximum only, so ``top_k > 1`` is a heuristic there).
    """
    if report.saturated or report.best_site is None:
        return []
    out = [report.best_site]
    if report.rule == "crossfit":
        margin = getattr(report, "margin", report.delta)
        rest = [r for r in report.sites if r.lower is not None and r.lower > margin]
        rest.sort(key=lambda r: -r.lower)
    else:
        rest = sorted(report.sites, key=lambda r: -r.grad_norm)
    for r in rest:
        if len(out) >= top_k:
            break
        if r.name not in out:
            out.append(r.name)
    return out
