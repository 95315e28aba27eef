"""When growth must end so that the final phase fits: pure functions of the budget.

With ``on_saturated="anneal"`` the final anneal (the schedule's ``anneal_epochs``) is reserved inside
``max_epochs`` and ``max_steps`` (as whole epochs of optimizer steps) under both schedules
(converged and periodic): once no more than that is left, growth ends as a budget and the anneal trains the network handed over, so no fit hands over a
network cut mid-stage. ``CheckSchedule``: the schedule part of the callback (when a check comes,
what the rate does), built from these and the plateau (``StageMonitor``) and anneal (``LrAnneal``).
No Lightning import here: the callback passes the trainer.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from growtrain.callbacks.anneal import LrAnneal
from growtrain.callbacks.monitor import StageMonitor
from growtrain.schedule_rules import should_check

__all__ = ["final_reserved", "no_room", "steps_per_epoch", "CheckSchedule"]


def _anneal_follows(on_saturated: str, finished: str | None) -> bool:
    """Is a final anneal still to come (growth goes on, and it ends in an anneal)?"""
    return on_saturated == "anneal" and finished is None


def steps_per_epoch(trainer: Any) -> int | None:
    """Optimizer steps in a full training epoch (the batches over ``accumulate_grad_batches``, the
    last partial accumulation stepping too), or ``None`` when the loader has no length."""
    batches = getattr(trainer, "num_training_batches", None)
    if not isinstance(batches, int) or batches < 1:
        return None
    return math.ceil(batches / max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1)))


def _epochs_left(max_epochs: int | None, current_epoch: int, max_steps: int | None, global_step: int,
                 per_epoch: int | None) -> tuple[int, str, str] | None:  # fmt: skip
    """Whole epochs the budget leaves after epoch ``current_epoch``, the budget that binds
    (``"max_epochs"``, or ``"max_steps"`` over ``per_epoch`` optimizer steps an epoch) and its figures."""
    left = []
    if max_epochs is not None and max_epochs >= 0:
        left.append((max_epochs - (current_epoch + 1), "max_epochs", f"max_epochs={max_epochs}"))
    if max_steps is not None and max_steps >= 0 and per_epoch:
        steps = max_steps - global_step
        left.append((steps // per_epoch, "max_steps",
                     f"max_steps={max_steps} ({steps} step(s) left, {per_epoch} an epoch)"))
    return min(left) if left else None


def final_reserved(max_epochs: int | None, current_epoch: int, anneal_epochs: int, on_saturated: str,
                   finished: str | None, *, max_steps: int | None = None, global_step: int = 0,
                   per_epoch: int | None = None) -> str | None:  # fmt: skip
    """At the end of epoch ``current_epoch``: the budget reason when growth must end now, else ``None``.
    The budget is ``max_epochs`` or ``max_steps`` (optimizer steps, ``per_epoch`` of them an epoch),
    whichever leaves fewer whole epochs: the anneal then completes inside both."""
    if not _anneal_follows(on_saturated, finished):
        return None
    budget = _epochs_left(max_epochs, current_epoch, max_steps, global_step, per_epoch)
    if budget is None or budget[0] > anneal_epochs:
        return None
    left, _, which = budget
    return (f"{which}: the last {anneal_epochs} epoch(s) are reserved for the final anneal "
            f"({left} whole epoch(s) left after epoch {current_epoch})")  # fmt: skip


def no_room(max_epochs: int | None, current_epoch: int, anneal_epochs: int, on_saturated: str,
            finished: str | None, *, max_steps: int | None = None, global_step: int = 0,
            per_epoch: int | None = None) -> str | None:  # fmt: skip
    """At the start of training: why this fit cannot grow at all, or ``None``."""
    if not _anneal_follows(on_saturated, finished):
        return None
    # the epochs left counting the one about to train (current_epoch - 1: "after the previous epoch")
    budget = _epochs_left(max_epochs, current_epoch - 1, max_steps, global_step, per_epoch)
    if budget is None or budget[0] > anneal_epochs + 1:
        return None
    _, name, which = budget
    return (f"{which} leaves no epoch to grow in: the last anneal_epochs={anneal_epochs} are reserved for the "
            "final anneal (on_saturated='anneal'), so growth ends at the first epoch as a budget. "
            f"Fix: raise {name}, lower the schedule's anneal_epochs, or pass on_saturated='stop'.")  # fmt: skip


class CheckSchedule:
    """When a check comes and what the learning rate does around it: ``"converged"`` (a check when
    the monitor has plateaued and the stage is at least ``min_stage_epochs`` long; with
    ``lr_schedule="anneal"`` the stage is cosine-annealed first and checked annealed) or
    ``"periodic"`` (every ``every_n_epochs`` at the constant rate; with ``min_steps_between_checks``,
    at the first epoch end at least that many optimizer steps after the last check, so the same
    settings grow at the same pace per step on any size of data). Under both the final anneal is
    reserved inside ``max_epochs`` and ``max_steps``, and after growth ends it runs here too.

    The callback asks it at every train-epoch end what to do (:meth:`epoch_end`); its state (the
    counters, the plateau's, the anneal's) travels in the callback's checkpoint. ``should_check``
    (growtrain.schedule_rules) decides; this class only keeps the count.
    """

    def __init__(self, *, kind: str, every_n_epochs: int, min_stage_epochs: int, lr_schedule: str,
                 on_saturated: str, monitor: StageMonitor, anneal: LrAnneal,
                 min_steps_between_checks: int | None = None):  # fmt: skip
        self.kind, self.every_n_epochs, self.min_stage_epochs = kind, every_n_epochs, min_stage_epochs
        self.min_steps_between_checks = min_steps_between_checks
        self.lr_schedule, self.on_saturated = lr_schedule, on_saturated
        self.monitor, self.anneal = monitor, anneal
        self.epochs_since_check = 0
        self.last_check_step = 0  # trainer.global_step at the last check (min_steps_between_checks counts from it)
        self.stage_epochs = 0  # epochs since the start or the last growth
        self.waiting: str | None = None  # why the last epoch end ran no check (should_check's reason)

    def epoch_start(self, trainer: Any, optimizer: Callable[[], Any]) -> None:
        self.monitor.epoch_start()
        if self.anneal.active:
            self.anneal.set_lr(trainer, optimizer())

    def epoch_end(self, trainer: Any, *, finished: str | None, budget: Callable[[], str | None],
                  optimizer: Callable[[], Any]) -> str | None:  # fmt: skip
        """What this train-epoch end does: ``"check"``, ``"check_annealed"`` (a stage anneal has run
        its course and the rate is back at its constant value), ``"stop"`` (the final anneal has), or
        ``None``. ``budget()``: the budget that already ends growth, if any (then no stage anneal:
        the final anneal follows that check, the same single anneal)."""
        anneal = self.anneal
        if anneal.active:
            if not anneal.epoch_done():
                self.waiting = f"the {anneal.kind} anneal: {anneal.done} of {anneal.epochs} epoch(s) done"
                return None
            if anneal.kind == "stage":
                anneal.end(optimizer())
                return "check_annealed"
            return "stop"
        if finished is not None:
            return None
        self.epochs_since_check += 1
        self.stage_epochs += 1
        if self.reserved(trainer, finished) is not None:
            return "check"  # no room for another stage: a budget check ends growth
        monitor = self.monitor.monitor if self.kind == "converged" else None  # periodic: every every_n_epochs
        plateaued = self.monitor.plateaued(trainer) if monitor is not None else False
        due, self.waiting = should_check(
            finished=finished, epochs_since_check=self.epochs_since_check, every_n_epochs=self.every_n_epochs,
            monitor=monitor, plateaued=plateaued, min_stage_epochs=self.min_stage_epochs,
            stage_epochs=self.stage_epochs, min_steps_between_checks=self.min_steps_between_checks,
            steps_since_check=(None if self.min_steps_between_checks is None
                               else int(trainer.global_step) - self.last_check_step),
        )  # fmt: skip
        if trainer.world_size > 1:  # one answer on every rank
            due = trainer.strategy.reduce_boolean_decision(due, all=False)
        if not due:
            return None
        if self.lr_schedule == "anneal" and budget() is None and anneal.start(optimizer(), "stage"):
            return None  # the converged stage is annealed first, then checked
        return "check"

    def reserved(self, trainer: Any, finished: str | None) -> str | None:
        """The budget reason when growth must end at this epoch end for the final anneal to fit
        inside ``max_epochs`` and ``max_steps``; ``None`` otherwise."""
        return final_reserved(trainer.max_epochs, trainer.current_epoch, self.anneal.epochs, self.on_saturated,
                              finished, **self._steps(trainer))  # fmt: skip

    def no_room(self, trainer: Any, finished: str | None) -> str | None:
        """At the start of training: why the budget leaves no epoch to grow in (or why the final
        anneal cannot be reserved inside ``max_steps``), or ``None``."""
        steps = self._steps(trainer)
        if steps and steps["per_epoch"] is None and _anneal_follows(self.on_saturated, finished):
            return (f"max_steps={steps['max_steps']} bounds this fit, but the training loader has no length, so the "
                    "final anneal cannot be reserved inside it (only max_epochs ends growth in time) and max_steps may "
                    "cut the anneal short. Fix: give the loader a length (or set limit_train_batches), or bound the fit "
                    "by max_epochs.")  # fmt: skip
        return no_room(trainer.max_epochs, trainer.current_epoch, self.anneal.epochs, self.on_saturated, finished,
                       **self._steps(trainer)) or self.no_check(trainer, finished)  # fmt: skip

    def earliest_check(self) -> tuple[int, str]:
        """Epochs a stage trains before its first possible check, and why: a converged stage at least
        ``min_stage_epochs`` long whose monitor went ``patience`` epochs without improving (after the
        epoch that set its best), then — with ``lr_schedule="anneal"`` — annealed over ``anneal_epochs``;
        a periodic one ``every_n_epochs``."""
        if self.kind == "periodic":
            return (self.every_n_epochs or 1), f"every_n_epochs={self.every_n_epochs}"
        plateau = max(self.min_stage_epochs, self.monitor.patience + 1)
        why = f"min_stage_epochs={self.min_stage_epochs} and patience={self.monitor.patience} (a plateau: {plateau})"
        if self.lr_schedule == "anneal":
            return plateau + self.anneal.epochs, f"{why}, then the stage anneal's anneal_epochs={self.anneal.epochs}"
        return plateau, why

    def no_check(self, trainer: Any, finished: str | None) -> str | None:
        """At the start of training: why this fit ends before even one check can come, with what
        would do, or ``None`` (a fit counted in steps that the loader's length cannot turn into
        epochs is not judged here)."""
        if finished is not None or self.min_steps_between_checks is not None:
            return None
        steps = self._steps(trainer)
        budget = _epochs_left(trainer.max_epochs, trainer.current_epoch - 1, steps.get("max_steps"),
                              steps.get("global_step", 0), steps.get("per_epoch"))  # fmt: skip
        if budget is None:
            return None
        left, name, which = budget
        reserved = self.anneal.epochs if _anneal_follows(self.on_saturated, finished) else 0
        need, why = self.earliest_check()
        if left - reserved >= need:
            return None
        tail = f" and {reserved} for the final anneal" if reserved else ""
        return (f"{which} leaves {left} epoch(s), but the first check cannot come before {need} epoch(s) of training "
                f"({why}){tail}: the fit would train to its end without a check. Fix: raise {name} to allow "
                f"{need + reserved} epoch(s), or lower those settings (e.g. a shorter anneal_epochs).")  # fmt: skip

    @staticmethod
    def _steps(trainer: Any) -> dict:
        max_steps = getattr(trainer, "max_steps", None)  # -1 / None: no step budget
        if max_steps is None or max_steps < 0:
            return {}
        return {"max_steps": int(max_steps), "global_step": int(trainer.global_step),
                "per_epoch": steps_per_epoch(trainer)}  # fmt: skip

    def checked(self, step: int = 0) -> None:
        """A check ran at optimizer step ``step`` (``trainer.global_step``)."""
        self.epochs_since_check = 0
        self.last_check_step = int(step)

    def new_stage(self) -> None:
        """After a growth: a new stage, judged from scratch."""
        self.stage_epochs = 0
        self.monitor.new_stage()

    def state_dict(self) -> dict[str, Any]:
        return {"epochs_since_check": self.epochs_since_check, "stage_epochs": self.stage_epochs,
                "last_check_step": self.last_check_step,
                **self.monitor.state_dict(), **self.anneal.state_dict()}  # fmt: skip

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epochs_since_check = int(state.get("epochs_since_check", 0))
        self.stage_epochs = int(state.get("stage_epochs", 0))
        self.last_check_step = int(state.get("last_check_step", 0))
        self.monitor.load_state_dict(state)
        self.anneal.load_state_dict(state)
