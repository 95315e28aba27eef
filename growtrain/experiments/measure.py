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
once trained (``decision="trial"``), or what blocks trained with the run until the next check gain
(``decision="stage_fork"``). So on a checkpoint whose fit ended growth, the report says how its
verdict relates to the fit's (the callback's ``finished`` and ``stop_reason`` are in the checkpoint).

Two more things a user must be able to trust, both read from the checkpoint:

- the probe is the one the checkpoint's network never trained on: the datamodule's split
  (``ImageDataModule``: dataset, seed, probe_size, val_size, train_subset) must be the one the
  checkpoint saved (:func:`check_split`); another split is refused before anything is loaded or
  written, unless ``allow_other_split`` asks for it (the report then says so);
- how its figures relate to the fit's last check (:func:`last_check`, :func:`differences`): they
  are the same computation, and differ only where the inputs differ — the network trained or grew
  after that check, the candidate blocks were drawn with another seed (the callback seeds check
  ``k`` with ``seed·1000 + k``; their BatchNorm calibration follows the weights), its probe ran
  under a mixed precision's autocast, or the level, ``t``, rule or δ differ. Both run the probe in
  eval mode on the same probe loader, so mode and data are not among the reasons. Each reason
  that applies is listed; when none does, the figures agree (tested).
"""

from __future__ import annotations

import inspect
import json
import math
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import torch
from lightning.pytorch import LightningDataModule, LightningModule

from growtrain.experiments.runs import (
    apply_checkpoint,
    fmt,
    growable_of,
    markdown_table,
    prepare,
    probe_loss_of,
    read_checkpoint,
    rich_table,
)
from growtrain.decision import DEFAULT_RULE
from growtrain.report import verdict_words
from growtrain.saturation import SaturationReport, measure_saturation

__all__ = ["MeasureResult", "run_measure", "site_dims", "QUESTION", "fit_verdict", "relation_to_fit", "check_split",
           "checkpoint_split", "last_check", "differences"]  # fmt: skip

QUESTION = ("Question answered: the first-order value of one new zero-output block at each site of this network as "
            "it is (the probe gradient of its last map, before any training): not what a new block is worth once "
            "trained (the growth callback's trial, decision='trial'), nor what blocks trained with the run until "
            "the next check gain (decision='stage_fork').")


def _growth_state(checkpoint: dict | None) -> dict | None:
    states = (checkpoint or {}).get("callbacks") or {}
    return next((v for k, v in states.items() if "GrowUntilSaturated" in str(k) and isinstance(v, dict)), None)


def fit_verdict(checkpoint: dict | None) -> dict | None:
    """The growth callback's end of growth as the checkpoint saved it: ``finished``, ``stop_reason``,
    the number of checks and what decided the last one; ``None`` without a growth callback's state."""
    state = _growth_state(checkpoint)
    if state is None:
        return None
    history = state.get("history") or []
    last = history[-1] if history else {}
    decided_by = next((k for k in ("trial", "fork") if last.get(k)), None) or last.get("rule")
    return {"finished": state.get("finished"), "stop_reason": state.get("stop_reason"), "checks": len(history),
            "decided_by": decided_by}  # fmt: skip


_DECIDED_BY = {
    "trial": "block-only trials (decision='trial'): what a new block lowers the held-out loss by once trained",
    "fork": "the paired stage fork (decision='stage_fork'): the run against a copy with the block(s), trained on "
            "the same batches and cooled, on the probe",
}
# what the fit could not certify, per decision (the second half of relation_to_fit's answer)
_NOT_CERTIFIED = {
    "trial": "that a trained block lowers the loss by more than min_gain",
    "fork": "that the block(s), trained with the run until the next check, lower the loss by more than min_gain",
}


def relation_to_fit(fit: dict | None, report: SaturationReport) -> str | None:
    """How this report's verdict relates to the verdict of the fit that saved the checkpoint."""
    if fit is None:
        return None
    mine = verdict_words(report)
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
                       "when its last map leaves zero, which says nothing about how far. The fit could not certify "
                       f"{_NOT_CERTIFIED[fit['decided_by']]}: the two do not contradict each other.")  # fmt: skip
    return text + (f"This report says grow at {report.best_site}: the same question asked of this checkpoint's "
                   "network (after any anneal) with this probe and seed, where the fit's last check saw "
                   "another state.")


# -- the split the checkpoint was trained with ----------------------------------------------------
_NOT_SPLITS = ("callbacks", "state_dict", "hyper_parameters", "datamodule_hyper_parameters", "optimizer_states")


def checkpoint_split(checkpoint: dict, keys: Any = ()) -> dict | None:
    """The data split the checkpoint's network was trained with: the datamodule's state (its
    ``"split"``, saved by Lightning under the datamodule's class name), else the values of ``keys``
    among its saved hyper-parameters (``datamodule_hyper_parameters``); ``None`` when it has neither."""
    for key, value in checkpoint.items():
        if key not in _NOT_SPLITS and isinstance(value, Mapping) and isinstance(value.get("split"), Mapping):
            return dict(value["split"])
    hparams = checkpoint.get("datamodule_hyper_parameters")
    if isinstance(hparams, Mapping):
        found = {k: hparams[k] for k in keys if k in hparams}
        return found or None
    return None


def _cli_value(value: Any) -> str:
    """A value as the command line takes it (``--data.init_args.train_subset=null``)."""
    return "null" if value is None else str(value).lower() if isinstance(value, bool) else str(value)


def check_split(datamodule: Any, checkpoint: dict, ckpt_path: Any, allow_other_split: bool = False) -> dict:
    """Whether ``datamodule`` cuts the probe the checkpoint's network never trained on.

    The probe is carved out of the training images by the split (for ``ImageDataModule``: the
    seeded permutation of ``dataset``, its first ``probe_size`` images, then ``val_size``, then the
    ``train_subset``); another split's probe can hold images the network trained on, and a report
    on it is not a held-out measurement. A split that differs from the checkpoint's is an error
    naming each argument, unless ``allow_other_split``; then a warning, and the report says so.
    Returns what was checked (``checked``, ``checkpoint``, ``measured``, ``differs``, or ``why``
    it could not be checked), for the report."""
    key_of = getattr(datamodule, "_split_key", None)
    if not callable(key_of):
        return {"checked": False, "why": f"{type(datamodule).__name__} does not describe its split (no _split_key())"}
    current = dict(key_of())
    saved = checkpoint_split(checkpoint, current)
    if saved is None:
        return {"checked": False, "measured": current,
                "why": "the checkpoint records no data split (no datamodule state or hyper-parameters)"}  # fmt: skip
    differ = [k for k in saved if k in current and saved[k] != current[k]]
    record = {"checked": True, "checkpoint": saved, "measured": current, "differs": differ}
    if not differ:
        return record
    args = set(inspect.signature(type(datamodule).__init__).parameters)
    expected = ", ".join(f"{k}={_cli_value(saved[k])}" for k in differ)
    given = ", ".join(f"{k}={_cli_value(current[k])}" for k in differ)
    flags = " ".join(f"--data.init_args.{k}={_cli_value(saved[k])}" for k in differ if k in args)
    fix = (f"pass {flags} (in Python: the datamodule with {expected})" if flags
           else "use the data the checkpoint was trained with")  # fmt: skip
    why = ("the probe is carved out of the training images by that split, so this one can hold images the "
           "network trained on and the report would not be a held-out measurement")  # fmt: skip
    if not allow_other_split:
        names = ", ".join(f"data.init_args.{k}" for k in differ)
        raise ValueError(f"{names}: expected {expected}, the split {str(ckpt_path)!r} was trained with; got {given}: "
                         f"{why}. Fix: {fix}; or allow_other_split=True (--allow_other_split=true) to measure on "
                         "this split anyway.")  # fmt: skip
    warnings.warn(f"allow_other_split: measuring {str(ckpt_path)!r}, trained with {expected}, on the split {given}: "
                  f"{why}.", UserWarning, stacklevel=3)  # fmt: skip
    return record


def _split_note(split: dict | None) -> str | None:
    if not split:
        return None
    if not split["checked"]:
        return (f"Split not checked: {split['why']}; whether this probe was held out from the network's training "
                "is unknown.")  # fmt: skip
    if split["differs"]:
        saved, here = split["checkpoint"], split["measured"]
        shown = ", ".join(f"{k}: checkpoint {_cli_value(saved[k])}, here {_cli_value(here[k])}"
                          for k in split["differs"])  # fmt: skip
        return (f"Another split than the checkpoint's (allow_other_split; {shown}): this probe can hold images the "
                "network trained on, so these figures are not held-out.")  # fmt: skip
    return None


# -- the fit's last check, and why this report's figures can differ from it ----------------------
def last_check(checkpoint: dict | None) -> dict | None:
    """The growth callback's last check that measured (its Γ̂, δ+t, level, rule, the step it ran at
    and what it did), as its history in the checkpoint recorded it, and the step the checkpoint was
    saved at (``checkpoint_step``); ``None`` without one."""
    history = (_growth_state(checkpoint) or {}).get("history") or []
    measured = [h for h in history if h.get("gamma") is not None]
    if not measured:
        return None
    h = measured[-1]
    keys = ("check", "epoch", "step", "gamma", "threshold", "t", "delta", "alpha", "error_bound", "rule", "action",
            "sites", "depth")  # fmt: skip
    return {**{k: h.get(k) for k in keys}, "checkpoint_step": checkpoint.get("global_step")}


def differences(last: dict, report: SaturationReport, *, seed: int, t: float | None = None,
                fit_growth: Mapping[str, Any] | None = None) -> list[str]:  # fmt: skip
    """Each reason this report's figures can differ from the fit's last check ``last`` that applies.

    The two compute the same thing (``measure_saturation`` in eval mode on the same probe loader,
    ``variance=True``) and differ only through their inputs. ``fit_growth``: the fit's
    ``GrowUntilSaturated`` ``seed`` and the trainer's ``precision`` (``GrowTrainer.measure``
    passes the configured ones); without them the candidates' seed is given by its formula.
    ``t``: this report's given ``t`` (None: derived from alpha); the check's was given when its
    error bound is not its level."""
    reasons = []
    k, step, saved_at = last.get("check"), last.get("step"), last.get("checkpoint_step")
    if last.get("action") == "grow":
        reasons.append(f"that check then grew the network at {', '.join(last.get('sites') or [])}: this network has "
                       "the new block(s), so other sites and figures")  # fmt: skip
    if isinstance(saved_at, int) and isinstance(step, int) and saved_at != step:
        what = "trained on for" if saved_at > step else "was saved before that check, by"
        reasons.append(f"the network {what} {abs(saved_at - step)} optimizer step(s) (the check at step {step}, "
                       f"this checkpoint at step {saved_at}: e.g. the final anneal, or the stage after a growth)")  # fmt: skip
    growth_seed = (fit_growth or {}).get("seed")
    want = None if growth_seed is None or k is None else int(growth_seed) * 1000 + int(k)
    if want is None or seed != want:
        drawn = (f"seed {want} (GrowUntilSaturated's seed {growth_seed} × 1000 + check {k})" if want is not None
                 else f"seed = GrowUntilSaturated's seed × 1000 + {k} (check {k})")  # fmt: skip
        same = f" (seed={want} draws that check's)" if want is not None else ""
        reasons.append(f"candidate blocks: that check drew them with {drawn}, this report with seed={seed}: other "
                       "random feature weights, calibrated on the probe to other BatchNorm statistics, score other "
                       f"ĝ, σ̂² and Γ̂{same}")  # fmt: skip
    precision = str((fit_growth or {}).get("precision") or "")
    if "mixed" in precision:  # the callback autocasts its probe pass under a mixed precision; run_measure does not
        reasons.append(f"precision: the fit's checks ran the probe under autocast (precision={precision}), this "
                       "report in the weights' own dtype")  # fmt: skip
    if last.get("alpha") is not None and not math.isclose(float(last["alpha"]), report.alpha, rel_tol=1e-12):
        reasons.append(f"level: that check tested at α={last['alpha']:.3g} (the callback's alpha), this report at "
                       f"alpha={report.alpha:g}: t and δ+t differ")  # fmt: skip
    bound, level = last.get("error_bound"), last.get("alpha")
    given = None  # the check's t when it was given (its error bound then is not its level), else None
    if bound is not None and level is not None and not math.isclose(float(bound), min(1.0, float(level)), rel_tol=1e-6):
        given = last.get("t")
    if given is not None and t != given:
        reasons.append(f"t: that check's was given (t={given:.4g}, the callback's t), this report's "
                       + ("derived from alpha" if t is None else f"is t={t:.4g}") + ": δ+t differs")  # fmt: skip
    elif given is None and t is not None:
        reasons.append(f"t: that check derived t from its level, this report's is given (t={t:.4g}): δ+t differs")
    if last.get("rule") is not None and last["rule"] != report.rule:
        reasons.append(f"rule: that check's was {last['rule']!r}, this report's {report.rule!r}: the verdict and its "
                       "margin differ, and Γ̂ and σ̂² through the candidates' calibration (on the whole probe under "
                       "the paper's rule, on half A under the cross-fit rule)")  # fmt: skip
    if last.get("delta") is not None and last["delta"] != report.delta:
        reasons.append(f"δ: that check's was {last['delta']:g}, this report's {report.delta:g}: δ+t differs")
    return reasons


def _comparison(last: dict | None, reasons: list[str], report: SaturationReport) -> str | None:
    if last is None:
        return None
    head = (f"The fit's last check (check {last['check']}, epoch {last['epoch']}, step {last['step']}) measured "
            f"Γ̂={fmt(last['gamma'])}, δ+t={fmt(last['threshold'])}; this report Γ̂={fmt(report.gamma)}, "
            f"δ+t={fmt(report.threshold)}.")  # fmt: skip
    if not reasons:
        return head + (" Same network, candidate blocks, calibration, precision, level, t, rule and δ: the figures "
                       "agree (up to floating-point summation order).")  # fmt: skip
    return head + " They can differ: " + "; ".join(f"({i}) {r}" for i, r in enumerate(reasons, 1)) + "."


@dataclass
class MeasureResult:
    report: SaturationReport
    dims: dict[str, int]  # N_l: activation elements per sample at each site
    ckpt_path: str | None = None
    output_dir: Path | None = None
    fit: dict | None = None  # fit_verdict() of the checkpoint
    split: dict | None = None  # check_split(): the probe's split against the checkpoint's
    last_check: dict | None = None  # last_check() of the checkpoint
    differences: list[str] | None = None  # why this report's figures can differ from last_check's

    def rows(self) -> list[dict]:
        out = []
        for r in self.report.sites:
            n = self.dims.get(r.name)
            out.append({**r.to_dict(), "dim": n, "ag_coordinate": r.ag / math.sqrt(n) if n else None})
        return out

    def to_dict(self) -> dict:
        return {"ckpt_path": self.ckpt_path, **self.report.to_dict(), "sites": self.rows(), "question": QUESTION,
                "fit": self.fit, "relation_to_fit": relation_to_fit(self.fit, self.report), "split": self.split,
                "last_check": self.last_check, "differences": self.differences,
                "comparison": _comparison(self.last_check, self.differences or [], self.report)}  # fmt: skip

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
        lines = [
            f"{rep.rule} rule: {verdict_words(rep)} — Γ̂={fmt(rep.gamma)}, δ+t={fmt(rep.threshold)} "
            f"(t={fmt(rep.t)}), error bound={fmt(rep.error_bound)}, n={rep.n}, AG_max={fmt(rep.ag_max)}",
            QUESTION,
        ]
        extra = (relation_to_fit(self.fit, rep), _comparison(self.last_check, self.differences or [], rep),
                 _split_note(self.split))  # fmt: skip
        return "\n".join(lines + [line for line in extra if line])

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
    projected: bool = True,
    seed: int = 0,
    output_dir: str | Path | None = None,
    allow_other_split: bool = False,
    fit_growth: Mapping[str, Any] | None = None,
) -> MeasureResult:
    """Score every candidate site of ``model`` (loaded from ``ckpt_path`` if given) on the probe split.

    ``rule=None`` resolves as in ``GrowUntilSaturated``: ``"crossfit"`` (the decision entry
    points' default, ``growtrain.decision.DEFAULT_RULE``), or ``"paper"`` when ``t`` is given. ``projected=True``: V_S is reported.
    With ``ckpt_path``, the datamodule's split must be the checkpoint's (:func:`check_split`; an
    error before the model or the data is touched, unless ``allow_other_split``), and the report
    compares its figures with the fit's last check (``fit_growth``: see :func:`differences`).
    """
    if rule is None:  # t is the paper rule's threshold: giving it asks for that rule
        rule = "paper" if t is not None else DEFAULT_RULE
    checkpoint = split = None
    if ckpt_path is not None:  # the split is checked before the data is loaded or the weights are
        checkpoint = read_checkpoint(ckpt_path)
        split = check_split(datamodule, checkpoint, ckpt_path, allow_other_split) if datamodule is not None else None
    prepare(datamodule, "measure")
    fit = last = None
    if checkpoint is not None:
        apply_checkpoint(model, checkpoint)
        # the fit's verdict and last check are all this keeps of the checkpoint beyond the weights
        fit, last, checkpoint = fit_verdict(checkpoint), last_check(checkpoint), None
    network = growable_of(model)
    probe = datamodule.probe_dataloader()
    report = measure_saturation(
        network, probe, probe_loss_of(model), delta=delta, alpha=alpha, t=t, rule=rule, projected=projected,
        seed=seed, variance=True,  # the measurement reports σ̂² and the paper's figures under every rule
    )
    example = next(iter(probe))[0].to(network.neighbour_tensor(network.sites()[0]).device)
    reasons = differences(last, report, seed=seed, t=t, fit_growth=fit_growth) if last is not None else None
    result = MeasureResult(report, site_dims(network, example), ckpt_path=ckpt_path, fit=fit, split=split,
                           last_check=last, differences=reasons)  # fmt: skip
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "measure.json").write_text(json.dumps(result.to_dict(), indent=1, default=str))
        (out / "measure.md").write_text("# Saturation per site\n\n" + result.markdown())
        result.output_dir = out
    return result
