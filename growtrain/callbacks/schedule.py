"""When growth must end so that the final phase fits: pure functions of the epoch budget.

With ``on_saturated="anneal"`` the final anneal (``anneal_epochs``) is reserved inside
``max_epochs`` under both schedules (converged and periodic): once no more than that is left,
growth ends as a budget and the anneal trains the network handed over, so no fit hands over a
network cut mid-stage. ``CheckSchedule``: the schedule part of the callback (when a check comes,
what the rate does), built from these and the plateau (``StageMonitor``) and anneal (``LrAnneal``).
No Lightning import here: the callback passes the trainer.
"""

from __future__ import annotations

from typing import Any, Callable

from growtrain.callbacks.anneal import LrAnneal
from growtrain.callbacks.monitor import StageMonitor
from growtrain.decision import should_check

__all__ = ["final_reserved", "no_room", "CheckSchedule"]


def _bounded(max_epochs: int | None, on_saturated: str, finished: str | None) -> bool:
    return on_saturated == "anneal" and finished is None and max_epochs is not None and max_epochs >= 0


def final_reserved(max_epochs: int | None, current_epoch: int, anneal_epochs: int, on_saturated: str,
                   finished: str | None) -> str | None:  # fmt: skip
    """At the end of epoch ``current_epoch``: the budget reason when growth must end now, else ``None``."""
    if not _bounded(max_epochs, on_saturated, finished):
        return None
    left = max_epochs - (current_epoch + 1)
    if left > anneal_epochs:
        return None
    return (f"max_epochs={max_epochs}: the last {anneal_epochs} epoch(s) are reserved for the final anneal "
            f"({left} left after epoch {current_epoch})")  # fmt: skip


def no_room(max_epochs: int | None, current_epoch: int, anneal_epochs: int, on_saturated: str,
            finished: str | None) -> str | None:  # fmt: skip
    """At the start of training: why this fit cannot grow at all, or ``None``."""
    if not _bounded(max_epochs, on_saturated, finished) or max_epochs - current_epoch > anneal_epochs + 1:
        return None
    return (f"max_epochs={max_epochs} leaves no epoch to grow in: the last anneal_epochs={anneal_epochs} are "
            "reserved for the final anneal (on_saturated='anneal'), so growth ends at the first epoch as a budget. "
            "Fix: raise max_epochs, lower anneal_epochs, or pass on_saturated='stop'.")  # fmt: skip


class CheckSchedule:
    """When a check comes and what the learning rate does around it: ``"converged"`` (a check when
    the monitor has plateaued and the stage is at least ``min_stage_epochs`` long; with
    ``lr_schedule="anneal"`` the stage is cosine-annealed first and checked annealed) or
    ``"periodic"`` (every ``every_n_epochs`` at the constant rate; with ``every_n_train_steps``, at
    the first epoch end at least that many optimizer steps after the last check, so the same
    settings grow at the same pace per step on any size of data). Under both the final anneal is
    reserved inside ``max_epochs``, and after growth ends it runs here too.

    The callback asks it at every train-epoch end what to do (:meth:`epoch_end`); its state (the
    counters, the plateau's, the anneal's) travels in the callback's checkpoint under the keys of
    earlier versions. ``should_check`` (growtrain.decision) decides; this class only keeps the count.
    """

    def __init__(self, *, kind: str, every_n_epochs: int, min_stage_epochs: int, lr_schedule: str,
                 on_saturated: str, monitor: StageMonitor, anneal: LrAnneal,
                 every_n_train_steps: int | None = None):  # fmt: skip
        self.kind, self.every_n_epochs, self.min_stage_epochs = kind, every_n_epochs, min_stage_epochs
        self.every_n_train_steps = every_n_train_steps
        self.lr_schedule, self.on_saturated = lr_schedule, on_saturated
        self.monitor, self.anneal = monitor, anneal
        self.epochs_since_check = 0
        self.last_check_step = 0  # trainer.global_step at the last check (every_n_train_steps counts from it)
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
        if final_reserved(trainer.max_epochs, trainer.current_epoch, anneal.epochs, self.on_saturated,
                          finished) is not None:  # fmt: skip
            return "check"  # no room for another stage: a budget check ends growth
        monitor = self.monitor.monitor if self.kind == "converged" else None  # periodic: every every_n_epochs
        plateaued = self.monitor.plateaued(trainer) if monitor is not None else False
        due, self.waiting = should_check(
            finished=finished, epochs_since_check=self.epochs_since_check, every_n_epochs=self.every_n_epochs,
            monitor=monitor, plateaued=plateaued, min_stage_epochs=self.min_stage_epochs,
            stage_epochs=self.stage_epochs, every_n_train_steps=self.every_n_train_steps,
            steps_since_check=None if self.every_n_train_steps is None else int(trainer.global_step) - self.last_check_step,
        )  # fmt: skip
        if trainer.world_size > 1:  # one answer on every rank
            due = trainer.strategy.reduce_boolean_decision(due, all=False)
        if not due:
            return None
        if self.lr_schedule == "anneal" and budget() is None and anneal.start(optimizer(), "stage"):
            return None  # the converged stage is annealed first, then checked
        return "check"

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
