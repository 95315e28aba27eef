"""What ``GrowUntilSaturated`` tells a user who would otherwise wonder what happened.

- :func:`no_check_message`: a fit in which no check ran, with the reason (the ``Converged``
  schedule's monitor and its best value, patience, ``min_stage_epochs``, or the ``Periodic``
  interval) and what to change (:func:`no_check_reason`: the
  reason alone, for the summary that follows the warning);
- :func:`output_lines`: where the fit's outputs are (logs, ``growth_history.json``, the Γ̂
  trace, checkpoints, and which checkpoint holds the network the fit handed over), naming only
  files the fit wrote;
- :func:`phase_line`: how the fit's epochs split between growing and the final phase (the
  summary's line; ``telemetry.fit_end_summary`` builds the summary).

Nothing here decides anything; the numbers come from the callback's state.
"""

from __future__ import annotations

import os
from typing import Any

__all__ = ["no_check_message", "no_check_reason", "output_lines", "phase_line"]

def no_check_message(*, schedule: Any, best: float | None, wait: int, stage_epochs: int, epochs: int,
                     waiting: str | None, steps: int = 0) -> str:  # fmt: skip
    """Why a fit ended without a single growth check, and what to change. ``schedule``: the callback's
    ``Converged`` (its monitor gates a check) or ``Periodic`` (a fixed interval) part; ``best``,
    ``wait``: the plateau's state; ``steps``: the optimizer steps of the fit (what
    ``min_steps_between_checks`` counts)."""
    converged = schedule.kind == "converged"
    monitor = schedule.monitor if converged else None
    every_n_epochs = None if converged else schedule.every_n_epochs
    min_steps_between_checks = None if converged else schedule.min_steps_between_checks
    if epochs == 0:
        why = "no training epoch ended (a check runs at the end of a training epoch)"
    elif converged:
        patience, mode, min_rel_delta = schedule.patience, schedule.mode, schedule.min_rel_delta
        if best is None:
            plateau = f"its best value was never recorded (patience={patience})"
        else:
            step = min_rel_delta * abs(best)
            plateau = (f"best {best:.4g} ({mode}); a plateau needs patience={patience} epochs in a row without an "
                       f"improvement larger than min_rel_delta×|best| = {step:.3g}, and the last "
                       f"{wait} epoch(s) had none")  # fmt: skip
        why = (
            f"monitor={monitor!r} never plateaued: {plateau}; the current stage is {stage_epochs} epoch(s) long "
            f"(min_stage_epochs={schedule.min_stage_epochs})"
        )
    elif min_steps_between_checks is not None:
        why = (f"min_steps_between_checks={min_steps_between_checks} is more than the {steps} optimizer step(s) "
               "of this fit" if min_steps_between_checks > steps else
               f"the check due after min_steps_between_checks={min_steps_between_checks} step(s) had not run when "
               "the fit ended")  # fmt: skip
    elif every_n_epochs > epochs:
        why = f"every_n_epochs={every_n_epochs} is more than the {epochs} training epoch(s) of this fit"
    else:  # the schedule was due, something delayed the check (a stage anneal): ``waiting`` says what
        why = f"the check due after every_n_epochs={every_n_epochs} epoch(s) had not run when the fit ended"
    if waiting:
        why += f"; at the last epoch: {waiting}"
    fixes = ["train longer (trainer.max_epochs or max_steps)"]
    if epochs > 0 and converged:  # no epoch trained: only training at all helps
        fixes += [f"a smaller Converged.patience (now {schedule.patience}) or a larger Converged.min_rel_delta "
                  f"(now {schedule.min_rel_delta:g})",
                  "schedule=Periodic(every_n_epochs=N) to check on a fixed interval"]  # fmt: skip
    elif epochs > 0 and min_steps_between_checks is not None:
        if min_steps_between_checks > steps:
            fixes.append("a smaller Periodic.min_steps_between_checks")
    elif epochs > 0 and every_n_epochs > epochs:
        fixes.append("a smaller Periodic.every_n_epochs")
    return (
        f"GrowUntilSaturated: no growth check ran in this fit of {epochs} epoch(s), so the network was not "
        f"grown or judged and no growth_history.json or gamma_trace.png was written. Why: {why}. "
        f"Fix: {'; or '.join(fixes)}."
    )


def no_check_reason(message: str) -> str:
    """The "Why" of a :func:`no_check_message` text, for the end-of-fit summary: the callback warns with
    the whole message, and the summary after it says why in one line instead of repeating it. A text
    that is not such a message is returned whole."""
    _, found, rest = message.partition(" Why: ")
    why = rest.rsplit(". Fix: ", 1)[0] if found else ""
    return why or message


def output_lines(trainer: Any, *, history_path: str | None, history_written: bool) -> list[str]:
    """Where this fit's outputs are: the log directory (and which files are in it), the growth
    history and Γ̂ trace, and every checkpoint callback's files. Call on rank 0 with paths
    computed on every rank (``trainer.log_dir`` is a collective under DDP)."""
    lines = []
    folder = os.path.dirname(history_path) if history_path else None
    if folder:
        files = []
        for logger in getattr(trainer, "loggers", []) or []:
            log_dir = getattr(logger, "log_dir", None)
            if log_dir and os.path.abspath(log_dir) == os.path.abspath(folder):
                path = getattr(getattr(logger, "experiment", None), "metrics_file_path", None)
                if path and os.path.isfile(path):  # a fit that logged nothing (no epoch ran) wrote none
                    files.append(os.path.basename(path))
        if history_written:
            files.append(os.path.basename(history_path))
            # by name: importing growtrain.callbacks.gamma_plot here would close an import cycle
            if any("GammaTracePlot" in {c.__name__ for c in type(cb).__mro__} for cb in trainer.callbacks):
                files.append("gamma_trace.png")
        if files:
            lines.append(f"outputs: {folder}{os.sep} ({', '.join(files)})")
    for cb in getattr(trainer, "checkpoint_callbacks", []) or []:
        paths = [p for p in (getattr(cb, "best_model_path", ""), getattr(cb, "last_model_path", "")) if p]
        if paths:
            where = os.path.dirname(paths[0])
            names = ", ".join(dict.fromkeys(os.path.basename(p) for p in paths))
            lines.append(f"checkpoints: {where}{os.sep} ({names}): {checkpoint_roles(trainer, cb)}")
    return lines


def checkpoint_roles(trainer: Any, cb: Any) -> str:
    """Which of a ``ModelCheckpoint``'s files holds the network the fit handed over (the one in
    memory at its end), and what the best file holds: a user who loads ``best_train`` for the grown
    network may get an earlier, shallower one. A file holds the final network when the callback's
    last save was at the fit's last step (``ModelCheckpoint`` saves after the growth callback's
    check at an epoch's end)."""
    best, last = getattr(cb, "best_model_path", ""), getattr(cb, "last_model_path", "")
    step, end = getattr(cb, "_last_global_step_saved", None), getattr(trainer, "global_step", None)
    final = (last or getattr(cb, "_last_checkpoint_saved", "") or None) if step is not None and step == end else None
    if final:
        parts = [f"{os.path.basename(final)} holds the network this fit handed over (saved at its last step, {end})"]
    else:
        parts = [f"none holds the network this fit handed over: the last save was at step {step}, the fit ended at "
                 f"step {end}"]  # fmt: skip
    monitor = getattr(cb, "monitor", None)
    if best and best != final and monitor:
        extreme = "lowest" if getattr(cb, "mode", "min") == "min" else "highest"
        parts.append(f"{os.path.basename(best)} holds the save with the {extreme} {monitor}, which may be an earlier, "
                     "shallower network")  # fmt: skip
    return "; ".join(parts)


def phase_line(*, growth_epochs: int | None, final_epochs: int, anneal_epochs: int, on_saturated: str, epochs: int,
               schedule: str) -> str:  # fmt: skip
    """How the fit's epochs split between growing and the final phase, and whether the network
    handed over finished its final anneal (or was cut mid-stage by the end of the fit)."""
    if growth_epochs is None:
        return (f"epochs: {epochs} trained, all of them growing ({schedule} schedule); the fit ended before growth "
                "did: the network handed over was cut mid-stage, not annealed")  # fmt: skip
    line = f"epochs: {growth_epochs} growing ({schedule} schedule)"
    if on_saturated != "anneal":
        return f"{line}, {max(0, epochs - growth_epochs)} after growth ended (on_saturated={on_saturated!r}, no anneal)"
    if final_epochs >= anneal_epochs:
        return f"{line}, {final_epochs} in the final anneal (complete)"
    if final_epochs == 0 and epochs <= growth_epochs:
        return f"{line}; growth ended on an annealed network (no separate final anneal)"
    return (f"{line}, {final_epochs} of {anneal_epochs} in the final anneal: the fit ended before it was complete, "
            "the network handed over is not fully annealed")  # fmt: skip
