"""What ``GrowUntilSaturated`` tells the user: one history record per check, logger metrics,
``growth_history.json``, a rich table per check and a one-screen summary at the end of the fit.

Nothing here decides anything: it formats what the hooks, ``growtrain.decision`` and
``growtrain.schedule_rules`` produced.
"""

from __future__ import annotations

import io
import json
import math
import os
from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from growtrain.callbacks import guidance
from growtrain.callbacks.guidance import no_check_reason
from growtrain.plots import outcome
from growtrain.saturation import SaturationReport

__all__ = ["plain", "count_params", "check_record", "log_check", "publish", "history_path", "write_history",
           "print_renderable", "check_table", "fit_summary", "fit_end_summary", "final_metrics",
           "SUMMARY_KEYS"]  # fmt: skip

SUMMARY_KEYS = ("train_loss", "val_loss", "train_acc", "val_acc")  # the end-of-fit summary's final metrics


def plain(value: Any) -> Any:
    """Plain Python data for JSON and ``weights_only=True`` checkpoints."""
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return plain(value.item() if value.numel() == 1 else value.tolist())
    if isinstance(value, bool) or value is None or isinstance(value, (int, str, float)):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def check_record(report: SaturationReport | None, action: str, reason: str, sites: list[str], network: nn.Module,
                 depth: int | None, certified: bool = False) -> dict:  # fmt: skip
    """The history fields that describe a check's outcome and the report behind it.

    ``action`` is the code value (``"grow"``, ``"saturated"``, ``"budget"``, ``"fork"``: a fork
    opened, nothing decided yet); ``certified`` is the
    deciding verdict's ``Verdict.certified``. ``saturated`` and ``certified`` are true only for a
    stop whose verdict certified it (an upper bound below the margin): a stop on a lower bound that
    did not clear the margin is ``action="saturated"`` with both false ("no certified gain")."""
    certified = bool(certified) and action == "saturated"
    out: dict[str, Any] = {
        "action": action, "reason": reason, "site": sites[0] if sites else None, "sites": list(sites),
        "saturated": certified, "certified": certified, "params": count_params(network), "depth": depth,
    }  # fmt: skip
    keys = ("gamma", "threshold", "t", "delta", "alpha", "n", "error_bound", "rule", "margin")
    if report is None:
        out.update({k: None for k in keys})
        out.update(lower=None, best_site=None, ag_max=None, verdicts={})
        return out
    out.update({k: getattr(report, k) for k in keys})
    out.update(ag_max=report.ag_max, best_site=report.best_record.name)
    lowers = [r.lower for r in report.sites if r.lower is not None]
    out["lower"] = max(lowers) if lowers else None
    out["verdicts"] = {k: v.to_dict() for k, v in report.verdicts.items()}
    if report.extra:
        out["extra"] = dict(report.extra)
    out["site_scores"] = [r.to_dict() for r in report.sites]
    return out


def log_check(trainer: Trainer, report: SaturationReport | None, record: dict) -> None:
    """``growth/*`` metrics to every logger at the current step."""
    metrics = {
        "growth/depth": record.get("depth"),
        "growth/params": record.get("params"),
        "growth/saturated": float(record["saturated"]),  # 1 only at a certified stop (check_record)
        "growth/grew": float(len(record["sites"])),
    }
    if report is not None:
        metrics.update({"growth/gamma": report.gamma, "growth/threshold": report.threshold,
                        "growth/error_bound": report.error_bound, "growth/margin": report.margin,
                        "growth/lower": record.get("lower")})  # fmt: skip
        for r in report.sites:
            for key in ("grad_norm", "projected", "ag", "lower"):
                value = getattr(r, key)
                if value is not None:
                    metrics[f"growth/{r.name}/{key}"] = value
    metrics = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
    for logger in trainer.loggers:
        logger.log_metrics(metrics, step=trainer.global_step)
    publish(trainer, {k: v for k, v in metrics.items() if k.count("/") == 1}, replace=True)


def publish(trainer: Trainer, metrics: dict[str, float], *, replace: bool = False) -> None:
    """``metrics`` into ``trainer.callback_metrics``, where ``ModelCheckpoint(monitor=...)`` and
    ``EarlyStopping(monitor=...)`` read them. A check runs at a train-epoch end: a checkpoint or
    early stopping that acts at that train-epoch end sees this check's figures (Lightning runs
    checkpoint callbacks last); one that acts when validation ends sees the previous check's.
    ``replace``: drop every earlier ``growth/<name>`` figure first (a figure this check does not
    have must not keep an older check's value). Lightning keeps them until it resets its metrics
    at the start of a fit: the callback publishes the depth again at every train start."""
    target = getattr(trainer, "callback_metrics", None)  # a stand-in trainer (tests, growtrain measure) may have none
    if target is None:
        return
    if replace:
        for key in [k for k in target if k.startswith("growth/") and k.count("/") == 1]:
            del target[key]
    target.update({k: torch.tensor(float(v)) for k, v in metrics.items()})


def history_path(trainer: Trainer) -> str:
    """``growth_history.json`` in ``trainer.log_dir`` (else ``default_root_dir``); call on every rank."""
    root = trainer.log_dir or trainer.default_root_dir
    return os.path.join(root, "growth_history.json")


def write_history(path: str, history: list[dict]) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(history, f, indent=1, allow_nan=True)
    os.replace(tmp, path)


def print_renderable(trainer: Trainer, renderable: Any, soft_wrap: bool = False) -> None:
    """Print above rich's live progress bar when there is one, else through ``rank_zero_info``
    (``soft_wrap``: text lines are not folded at the console width, so a path copies whole)."""
    from rich.console import Console

    bar = trainer.progress_bar_callback
    console = getattr(bar, "_console", None)
    if bar is not None and type(bar).__name__ == "RichProgressBar" and console is not None:
        console.print(renderable, soft_wrap=soft_wrap)
        return
    buffer = io.StringIO()
    Console(file=buffer, width=120, force_terminal=False, color_system=None).print(renderable, soft_wrap=soft_wrap)
    rank_zero_info(buffer.getvalue().rstrip())


def check_table(report: SaturationReport | None, record: dict) -> Any:
    # the header says what was certified (plots.outcome), never the bare code value "saturated"
    title = f"growth check {record['check']} (epoch {record['epoch']}, step {record['step']}): {outcome(record)}"
    if report is None:
        return f"{title}: {record['reason']}"
    from growtrain.report import saturation_table

    table = saturation_table(report, title=title)
    table.caption = f"{table.caption}\n{record['reason']}"
    return table


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return format(value, spec)
    return str(value)


def fit_summary(history: list[dict], *, start_depth: int | None, final_depth: int | None, finished: str | None,
                stop_reason: str | None, metrics: dict[str, float], probe_seconds: float,
                fit_seconds: float, no_check: str | None = None, outputs: list[str] | None = None,
                phases: str | None = None) -> Any:  # fmt: skip
    """One screen at the end of a fit: depth start → final, each growth, why it stopped, final
    losses, the probe's share of the run time and where the outputs are. A fit with no check
    (``no_check``: why) is a few lines of text instead of an empty table."""
    from rich.table import Table

    losses = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
    if not history:
        # no check, so no growth: the depth at the start is the depth now, even when no epoch ran (the
        # callback then never saw the start of training). The warning the callback gave carries the whole
        # message (why and what to change); the summary says why in one line, not the message again.
        start = final_depth if start_depth is None else start_depth
        line = f"GrowUntilSaturated: depth {_fmt(start)} → {_fmt(final_depth)}: no growth check ran"
        why = no_check_reason(no_check) if no_check else None
        lines = [line + (f" — {why}; the warning above says what to change" if why else "")]
        if losses:
            lines.append(f"final: {losses}")
        return "\n".join(lines + list(outputs or []))

    table = Table(title=f"GrowUntilSaturated: depth {_fmt(start_depth)} → {_fmt(final_depth)}", title_justify="left")
    # Only the columns that say something for this run (one screen, 80 columns): the margin when
    # it is not 0 (δ), the block's certified gain under a trial or a stage fork.
    cells = {
        "check": lambda h: str(h.get("check")), "epoch": lambda h: str(h.get("epoch")),
        "depth": lambda h: _fmt(h.get("depth_before")), "action": outcome,
        "site": lambda h: _fmt(h.get("site")), "first-order ≥": lambda h: _fmt(h.get("lower"), ".3g"),
        # decision="trial" or "stage_fork": what decided — the certified gain, % of the probe loss
        "block gain ≥ %": lambda h: _fmt(100 * (h.get("trial") or h.get("fork"))["lower_frac"], ".3g")
        if (h.get("trial") or h.get("fork") or {}).get("lower_frac") is not None else "–",
        "margin": lambda h: _fmt(h.get("margin")),
    }  # fmt: skip
    shown = {
        "margin": any(h.get("margin") for h in history),
        "block gain ≥ %": any(h.get("trial") or h.get("fork") for h in history),
    }  # fmt: skip
    columns = [c for c in cells if shown.get(c, True)]
    for col in columns:  # the action in full ("no certified gain"): it is the row's point
        table.add_column(col, justify="left" if col in ("action", "site") else "right",
                         min_width=9 if col == "action" else None)  # fmt: skip
    for h in history:
        table.add_row(*(cells[c](h) for c in columns))
    # "certified saturation" only where the stop's verdict certified it (its record's ``certified``:
    # an upper bound below the margin); otherwise "no certified gain", and the reason gives the
    # resolution the probe had (or that the network is at chance level)
    stop = next((h for h in reversed(history) if h.get("action") == "saturated"), {})
    why = {None: "growth had not ended when the fit stopped (max_epochs, max_steps or another callback)",
           "saturated": "certified saturation" if stop.get("certified") else "no certified gain from more depth",
           "budget": "a growth budget"}.get(finished, str(finished))  # fmt: skip
    lines = [f"stopped growing: {why}" + (f" — {stop_reason}" if stop_reason else "")]
    if phases:
        lines.append(phases)
    if losses:
        lines.append(f"final: {losses}")
    share = probe_seconds / fit_seconds if fit_seconds > 0 else float("nan")
    lines.append(f"probe and trials: {probe_seconds:.1f} s of {fit_seconds:.1f} s ({100 * share:.1f} % of the fit)")
    table.caption = "\n".join(lines)
    table.caption_justify = "left"
    if not outputs:
        return table
    from rich.console import Group
    from rich.text import Text

    # below the table, unwrapped: a path is copied whole from the terminal
    return Group(table, *(Text(line) for line in outputs))


def final_metrics(callback_metrics: dict, keys: tuple[str, ...] = SUMMARY_KEYS) -> dict[str, float]:
    """The numbers the end-of-fit summary calls final: the trainer's last callback metrics among ``keys``."""
    return {k: float(v) for k, v in callback_metrics.items() if k in keys}


def fit_end_summary(cb: Any, trainer: Any, *, no_check: str | None, history_path: str, written: bool,
                    fit_seconds: float) -> Any:  # fmt: skip
    """The end-of-fit summary of a ``GrowUntilSaturated`` (a rich renderable, telemetry.fit_summary):
    what it did, the final numbers, where its files are, and how the epochs split between growing
    and the final phase."""
    metrics = final_metrics(trainer.callback_metrics)
    return fit_summary(
        cb.history, start_depth=cb.start_depth, final_depth=cb._depth(cb._network), finished=cb.finished,
        stop_reason=cb.stop_reason, metrics=metrics,
        probe_seconds=cb.check_seconds,
        fit_seconds=fit_seconds, no_check=no_check,
        outputs=guidance.output_lines(trainer, history_path=history_path, history_written=written),
        phases=guidance.phase_line(growth_epochs=cb.growth_epochs, final_epochs=cb.final_epochs,
                                   anneal_epochs=cb.schedule.anneal_epochs, on_saturated=cb.on_saturated,
                                   epochs=trainer.current_epoch, schedule=cb.schedule.kind),
    )  # fmt: skip
