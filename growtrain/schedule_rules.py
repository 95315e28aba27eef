"""The callback's pure schedule and action functions: when a check is due, what a plateau is,
which budget ends growth, and what a verdict turns into.

``GrowUntilSaturated``'s hooks gather their inputs (``callbacks/schedule.py``'s ``CheckSchedule``,
``callbacks/monitor.py``'s ``StageMonitor``, ``callbacks/growth.py``) and call these, the way
``EarlyStopping``'s hooks call ``_evaluate_stopping_criteria``:

* ``should_check`` — whether this train-epoch end runs a check (the schedule);
* ``plateau_update`` — EarlyStopping-style plateau tracking (the converged schedule's trigger);
* ``budget_reason`` — the budget (``max_growths``) that forbids further growth;
* ``decide_growth`` — a verdict and the budgets turned into an action: grow, saturated or budget;

The verdicts themselves come from ``growtrain.decision`` and the deciders. No Lightning import here.
"""

from __future__ import annotations

import math
from typing import Sequence

__all__ = ["should_check", "plateau_update", "budget_reason", "decide_growth"]


def should_check(
    *,
    finished: str | None,
    epochs_since_check: int,
    every_n_epochs: int,
    monitor: str | None,
    plateaued: bool,
    min_stage_epochs: int = 1,
    stage_epochs: int | None = None,
    steps_since_check: int | None = None,
    min_steps_between_checks: int | None = None,
) -> tuple[bool, str]:
    """Whether this train-epoch end runs a probe check, and why (or why not).

    With ``monitor`` a check needs the metric to have plateaued *and* the current stage (epochs
    since the last growth, ``stage_epochs``) to be at least ``min_stage_epochs`` long; without it,
    every ``every_n_epochs`` — or, with ``min_steps_between_checks``, at the first epoch end at
    least that many optimizer steps (``steps_since_check``) after the last check.
    """
    if finished is not None:
        return False, f"growth has ended ({finished})"
    if monitor is not None:
        stage = epochs_since_check if stage_epochs is None else stage_epochs
        if stage < min_stage_epochs:
            return False, f"stage is {stage} epoch(s) long; min_stage_epochs={min_stage_epochs}"
        if not plateaued:
            return False, f"{monitor} is still improving"
        why = f"{monitor} has plateaued"
    elif min_steps_between_checks is not None:
        since = int(steps_since_check or 0)
        if since < min_steps_between_checks:
            return False, f"next check after {min_steps_between_checks - since} more optimizer step(s)"
        why = f"every {min_steps_between_checks} optimizer step(s) ({since} since the last check)"
    elif epochs_since_check >= every_n_epochs:
        why = f"every {every_n_epochs} epoch(s)"
    else:
        return False, f"next check in {every_n_epochs - epochs_since_check} epoch(s)"
    return True, why


def plateau_update(
    current: float, best: float | None, wait: int, *, mode: str, min_delta: float, patience: int
) -> tuple[float, int, bool]:
    """EarlyStopping-style tracking: returns ``(best, wait, plateaued)``.

    An improvement is a change beyond ``min_delta`` in the ``mode`` direction; ``plateaued``
    once ``patience`` consecutive epochs brought none.
    """
    if best is None or not math.isfinite(best):
        return current, 0, False
    improved = current < best - min_delta if mode == "min" else current > best + min_delta
    if improved:
        return current, 0, False
    wait += 1
    return best, wait, wait >= patience


def budget_reason(*, growths: int, max_growths: int | None) -> str | None:
    """The budget that forbids any further growth, or ``None`` when growth is still allowed."""
    if max_growths is not None and growths >= max_growths:
        return f"max_growths={max_growths} reached ({growths} growth step(s) done)"
    return None


def decide_growth(*, saturated: bool, ranked: Sequence[str], growths: int, max_growths: int | None,
                  reason: str = "") -> tuple[str, str, list[str]]:  # fmt: skip
    """The action after a probe: ``("grow", why, sites)``, ``("saturated", why, [])`` or
    ``("budget", why, [])``: every ranked site grows while ``max_growths`` allows."""
    if saturated or not ranked:
        return "saturated", reason or "no site certifies first-order gain", []
    blocked = budget_reason(growths=growths, max_growths=max_growths)
    if blocked is not None:
        return "budget", blocked, []
    chosen = list(ranked)
    why = reason or "a site certifies first-order gain"
    return "grow", f"{why}; grow at {', '.join(chosen)}", chosen
