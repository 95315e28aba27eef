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

from growtrain import decision as dec

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

    def plateaued(self, trainer: Trainer) -> bool:
        """Read this epoch's value, update ``best``/``wait``; a metric never logged is an error naming it."""
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            value = self._returned_loss(trainer)
        if value is None:
            validation = " If it is a validation metric, make sure validation runs every epoch." if "val" in self.monitor else ""
            raise RuntimeError(
                f"monitor: metric {self.monitor!r} is not logged; available: {sorted(trainer.callback_metrics)}. "
                f"Fix: log it per epoch in your LightningModule (self.log({self.monitor!r}, value, on_epoch=True)), "
                f"monitor one of the available metrics, or pass monitor=None (checks every every_n_epochs).{validation}"
            )
        value = float(value)
        min_delta = self.min_rel_delta * abs(self.best) if self.best is not None else 0.0
        self.best, self.wait, plateaued = dec.plateau_update(
            value, self.best, self.wait, mode=self.mode, min_delta=min_delta, patience=self.patience
        )
        return plateaued
