"""When has a stage converged? ``StageMonitor``: the monitored metric's plateau (or, when the
module logs no ``train_loss``, the epoch mean of the loss ``training_step`` returns).

A collaborator of ``GrowUntilSaturated`` (the converged schedule's input), with its own state
(``best``, ``wait``) that travels in the callback's checkpoint under the same keys as before.
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Trainer
from lightning.pytorch.utilities import rank_zero_info

from growtrain.schedule_rules import plateau_update

__all__ = ["StageMonitor"]


class StageMonitor:
    """``EarlyStopping``'s plateau, relative: an improvement is a change beyond ``min_rel_delta`` of
    the best value in the ``mode`` direction, and ``patience`` epochs without one make a plateau."""

    def __init__(self, monitor: str | None, mode: str, patience: int, min_rel_delta: float):
        self.monitor, self.mode, self.patience, self.min_rel_delta = monitor, mode, patience, min_rel_delta
        self.best: float | None = None
        self.wait = 0
        self._returned: torch.Tensor | None = None  # sum of this epoch's losses returned by training_step
        self._returned_batches = 0
        self._told_returned = False
        # freshness: a value read at a train-epoch end counts only if it is new since the last one read
        self._ever_validated = False  # a validation run has ended in this fit
        self._last: Any = None  # the tensor read last time (Lightning keeps a validation metric's object until the next run)
        self.stale = 0  # readings skipped as not fresh (said in the wait reason)

    def new_stage(self) -> None:
        """After a growth the new stage is judged from scratch."""
        self.best, self.wait = None, 0

    def state_dict(self) -> dict[str, Any]:
        return {"best": self.best, "wait": self.wait}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.best, self.wait = state.get("best"), int(state.get("wait", 0))

    # -- the returned loss: the default monitor's fallback ---------------------------------------
    def epoch_start(self) -> None:
        self._returned, self._returned_batches = None, 0

    def batch_end(self, outputs: Any) -> None:
        """Keep the loss ``training_step`` returned (summed on its device, no host copy per batch)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if self.monitor == "train_loss" and isinstance(loss, torch.Tensor) and loss.numel() == 1:
            loss = loss.detach().float()
            self._returned = loss if self._returned is None else self._returned + loss
            self._returned_batches += 1

    def _returned_loss(self, trainer: Trainer) -> torch.Tensor | None:
        """This epoch's mean of the losses ``training_step`` returned (all ranks), or None."""
        if self.monitor != "train_loss" or self._returned is None or not self._returned_batches:
            return None
        mean = self._returned / self._returned_batches
        if getattr(trainer, "world_size", 1) > 1:
            mean = trainer.strategy.reduce(mean, reduce_op="mean")
        if not self._told_returned:
            rank_zero_info("GrowUntilSaturated: 'train_loss' is not logged; monitoring the epoch mean of the loss "
                           "training_step returns instead (log 'train_loss' per epoch to choose it yourself)")  # fmt: skip
            self._told_returned = True
        return mean

    def fit_start(self) -> None:
        """A new fit (a reused callback too) waits for its own first validation."""
        self._ever_validated, self._last = False, None

    def validation_end(self, trainer: Trainer) -> None:
        if not getattr(trainer, "sanity_checking", False):
            self._ever_validated = True

    def plateaued(self, trainer: Trainer) -> bool:
        """Read this epoch's value, update ``best``/``wait``; a metric never logged is an error naming it.

        Only a fresh value counts, as Lightning's EarlyStopping judges a validation metric when
        validation ends: under ``check_val_every_n_epoch > 1`` (or a validation every so many
        steps) an epoch without validation still holds the last run's value, and counting it as
        "no improvement" would make a plateau of a loss that fell at every validation. Fresh: the
        value is a new object (Lightning recomputes a training metric every epoch and replaces a
        validation metric's at each validation run; between runs the same object stays).
        A validation metric not logged yet because no validation has run is waited for, not an
        error."""
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            value = self._returned_loss(trainer)
        if value is None and not self._ever_validated and _validation_due_later(trainer):
            self.stale += 1
            return False  # validation has not run yet in this fit: nothing to judge
        if value is not None and value is self._last:
            self.stale += 1
            return False  # the same value as last time: no new information
        if value is None:
            validation = " If it is a validation metric, make sure validation runs every epoch." if "val" in self.monitor else ""
            raise RuntimeError(
                f"monitor: metric {self.monitor!r} is not logged; available: {sorted(trainer.callback_metrics)}. "
                f"Fix: log it per epoch in your LightningModule (self.log({self.monitor!r}, value, on_epoch=True)), "
                f"monitor one of the available metrics, or pass schedule=Periodic(every_n_epochs=N) (a check every N "
                f"epochs, no monitor).{validation}"
            )
        self._last = value
        value = float(value)
        min_delta = self.min_rel_delta * abs(self.best) if self.best is not None else 0.0
        self.best, self.wait, plateaued = plateau_update(
            value, self.best, self.wait, mode=self.mode, min_delta=min_delta, patience=self.patience
        )
        return plateaued


def _validation_due_later(trainer: Trainer) -> bool:
    """Whether this fit's first validation is still to come: it validates at all (validation
    batches allowed and a ``validation_step``; its dataloaders are only known once the first
    validation runs) and, validating every ``check_val_every_n_epoch`` epochs, that epoch has not
    ended yet. (Once it should have run, a metric never logged is the error it always was.)"""
    from lightning.pytorch.utilities.model_helpers import is_overridden

    module = getattr(trainer, "lightning_module", None)
    if not (bool(getattr(trainer, "limit_val_batches", 1.0)) and module is not None
            and is_overridden("validation_step", module)):  # fmt: skip
        return False
    every = getattr(trainer, "check_val_every_n_epoch", 1)
    return every is None or int(trainer.current_epoch) + 1 < int(every)
