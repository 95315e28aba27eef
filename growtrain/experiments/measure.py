"""Per-site saturation report of a trained model on its probe split (``growtrain measure``).

Loads a checkpoint (replaying its growth), runs ``measure_saturation`` on the datamodule's
probe split and reports, per candidate site: ‖ĝ‖ (the site's term of Γ̂), σ̂², V_S (projected
growth value), AG in both of the paper's normalisations (Remark 1: sample-normalised ``AG`` and
coordinate-normalised ``AG/√N_l``, ``N_l`` the activation size per sample), the batch-level
``AG`` of Eq. (2), and the realisability ratio ``V_S/AG``; the decision ``Γ̂ ≤ δ+t`` and its
error bound in the caption. Written as ``measure.json`` and ``measure.md``.

It answers one question, and says so: the *first-order* value of one new zero-output block at
each site of this network as it is (the probe gradient of the block's last map, before any
training). The growth callback decides by other questions by default: what a new block is worth
once trained (``decision="trial"``), or what the last stage realized (``decision="gain"``). So
on a checkpoint whose fit ended growth, the report says how its verdict relates to the fit's
(the callback's ``finished`` and ``stop_reason`` are in the checkpoint).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from lightning.pytorch import LightningDataModule, LightningModule

from growtrain.experiments.runs import (
    fmt,
    growable_of,
    markdown_table,
    prepare,
    probe_loss_of,
    read_checkpoint_into,
    rich_table,
)
from growtrain.decision import DEFAULT_RULE, DEFAULT_TAU
from growtrain.saturation import SaturationReport, measure_saturation

__all__ = ["MeasureResult", "run_measure", "site_dims", "QUESTION", "fit_verdict", "relation_to_fit"]

QUESTION = ("Question answered: the first-order value of one new zero-output block at each site of this network as "
            "it is (the probe gradient of its last map, before any training): not what a new block is worth once "
            "trained (the growth callback's trial, decision='trial'), nor what the last block realized "
            "(decision='gain').")


def fit_verdict(checkpoint: dict | None) -> dict | None:
    """The growth callback's end of growth as the checkpoint saved it: ``finished``, ``stop_reason``,
    the number of checks and what decided the last one; ``None`` without a growth callback's state."""
    states = (checkpoint or {}).get("callbacks") or {}
    state = next((v for k, v in states.items() if "GrowUntilSaturated" in str(k) and isinstance(v, dict)), None)
    if state is None:
        return None
    history = state.get("history") or []
    last = history[-1] if history else {}
    decided_by = "trial" if last.get("trial") else "gain" if last.get("gain") else last.get("rule")
    return {"finished": state.get("finished"), "stop_reason": state.get("stop_reason"), "checks": len(history),
            "decided_by": decided_by}  # fmt: skip


_DECIDED_BY = {
    "trial": "block-only trials (decision='trial'): what a new block lowers the held-out loss by once trained",
    "gain": "the realized gain of the last stage (decision='gain'): what the last block lowered the probe loss by",
}


def relation_to_fit(fit: dict | None, report: SaturationReport) -> str | None:
    """How this report's verdict relates to the verdict of the fit that saved the checkpoint."""
    if fit is None:
        return None
    mine = "saturated (no site certified)" if report.saturated else f"grow at {report.best_site}"
    if fit["finished"] is None:
        return (f"The fit that saved this checkpoint had not ended growth ({fit['checks']} check(s)); this report "
                f"says: {mine}.")  # fmt: skip
    if fit["finished"] == "budget":
        return (f"The fit stopped growing at a budget ({fit['stop_reason']}), not at a verdict on depth; this report "
                f"says: {mine}.")  # fmt: skip
    how = _DECIDED_BY.get(fit["decided_by"], f"the first-order {fit['decided_by']} rule, this report's question")
    text = f"The fit that saved this checkpoint stopped growing ({fit['stop_reason']}); it decided by {how}. "
    if report.saturated:
        return text + "This report agrees: no site's first-order value is certified."
    if fit["decided_by"] in _DECIDED_BY:
        return text + (f"This report says grow at {report.best_site}: the loss of a new block there certifiably falls "
                       "when its last map leaves zero, which says nothing about how far. The fit could not certify that "
                       "a trained block lowers the loss by more than min_gain: the two do not contradict each other.")  # fmt: skip
    return text + (f"This report says grow at {report.best_site}: the same question asked of this checkpoint's "
                   "network (after any undo or anneal) with this probe and seed, where the fit's last check saw "
                   "another state.")


@dataclass
class MeasureResult:
    report: SaturationReport
    dims: dict[str, int]  # N_l: activation elements per sample at each site
    ckpt_path: str | None = None
    output_dir: Path | None = None
    fit: dict | None = None  # fit_verdict() of the checkpoint

    def rows(self) -> list[dict]:
        out = []
        for r in self.report.sites:
            n = self.dims.get(r.name)
            out.append({**r.to_dict(), "dim": n, "ag_coordinate": r.ag / math.sqrt(n) if n else None})
        return out

    def to_dict(self) -> dict:
        return {"ckpt_path": self.ckpt_path, **self.report.to_dict(), "sites": self.rows(), "question": QUESTION,
                "fit": self.fit, "relation_to_fit": relation_to_fit(self.fit, self.report)}  # fmt: skip

    def _header_cells(self):
        header = ["site", "‖ĝ‖", "σ̂²", "V_S", "AG", "AG/√N", "AG (Eq. 2)", "V_S/AG"]
        crossfit = any(r.get("lower") is not None for r in self.rows())
        if crossfit:
            header.append("lower")
        rows = []
        for r in self.rows():
            cells = [r["site"]] + [fmt(r[k]) for k in ("grad_norm", "variance", "projected", "ag", "ag_coordinate", "ag_batch", "realisability")]  # fmt: skip
            rows.append(cells + ([fmt(r["lower"])] if crossfit else []))
        return header, rows

    def caption(self) -> str:
        rep = self.report
        verdict = "saturated" if rep.saturated else f"grow at {rep.best_site}"
        lines = [
            f"{rep.rule} rule: {verdict} — Γ̂={fmt(rep.gamma)}, δ+t={fmt(rep.threshold)} (t={fmt(rep.t)}), "
            f"error bound={fmt(rep.error_bound)}, n={rep.n}, AG_max={fmt(rep.ag_max)}",
            QUESTION,
        ]
        relation = relation_to_fit(self.fit, rep)
        return "\n".join(lines + ([relation] if relation else []))

    def table(self):
        header, rows = self._header_cells()
        best = self.report.best_record.name
        rows = [[f"[bold]{c[0]}[/]" if c[0] == best else c[0]] + c[1:] for c in rows]
        title = f"Saturation per site{f' — {self.ckpt_path}' if self.ckpt_path else ''}"
        return rich_table(header, rows, title=title, caption=self.caption())

    def markdown(self) -> str:
        return markdown_table(*self._header_cells()) + f"\n{self.caption()}\n"

    def __rich__(self):
        return self.table()


def site_dims(network: torch.nn.Module, example: torch.Tensor) -> dict[str, int]:
    """``N_l``: elements per sample of the activation at each site (one no-grad forward)."""
    dims: dict[str, int] = {}
    handles = []

    def record(name):
        def hook(_module, args, output=None):
            z = args[0] if output is None else output
            dims[name] = int(z[0].numel())

        return hook

    for site in network.sites():
        stage = network.stage(site.stage)
        if site.index < len(stage):
            handles.append(stage[site.index].register_forward_pre_hook(record(site.name)))
        else:
            handles.append(stage[site.index - 1].register_forward_hook(record(site.name)))
    was_training = network.training
    network.eval()
    try:
        with torch.no_grad():
            network(example[:1])
    finally:
        network.train(was_training)
        for h in handles:
            h.remove()
    return dims


def run_measure(
    model: LightningModule,
    datamodule: LightningDataModule,
    *,
    ckpt_path: str | None = None,
    delta: float = 0.0,
    alpha: float = 0.05,
    t: float | None = None,
    rule: str | None = None,
    tau: float = DEFAULT_TAU,
    projected: bool = True,
    seed: int = 0,
    output_dir: str | Path | None = None,
) -> MeasureResult:
    """Score every candidate site of ``model`` (loaded from ``ckpt_path`` if given) on the probe split.

    ``rule=None`` resolves as in ``GrowUntilSaturated``: ``"crossfit"`` (the decision entry
    points' default, ``growtrain.decision.DEFAULT_RULE``), or ``"paper"`` when ``t`` is given. ``projected=True``: V_S is reported.
    """
    if rule is None:  # t is the paper rule's threshold: giving it asks for that rule
        rule = "paper" if t is not None else DEFAULT_RULE
    prepare(datamodule, "measure")
    # the fit's verdict is all this needs of the checkpoint beyond the weights: no second copy kept
    fit = fit_verdict(read_checkpoint_into(model, ckpt_path)) if ckpt_path is not None else None
    network = growable_of(model)
    probe = datamodule.probe_dataloader()
    report = measure_saturation(
        network, probe, probe_loss_of(model), delta=delta, alpha=alpha, t=t, rule=rule, tau=tau, projected=projected,
        seed=seed, variance=True,  # the measurement reports σ̂² and the paper's figures under every rule
    )
    example = next(iter(probe))[0].to(network.neighbour_tensor(network.sites()[0]).device)
    result = MeasureResult(report, site_dims(network, example), ckpt_path=ckpt_path, fit=fit)
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "measure.json").write_text(json.dumps(result.to_dict(), indent=1, default=str))
        (out / "measure.md").write_text("# Saturation per site\n\n" + result.markdown())
        result.output_dir = out
    return result
