"""When has a stage converged? The monitor's plateau (or the loss ``training_step`` returned, when
none is logged), the training samples seen, and the probe's size: a mixin of ``GrowUntilSaturated``.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch.utils.data import DataLoader

from growtrain import decision as dec
from growtrain.callbacks import guidance
from growtrain.callbacks.probe_data import loaders_of

__all__ = ["StageMonitorMixin"]


class StageMonitorMixin:
    """``_track_monitor`` (plateau), its fallback on the returned loss, sample and probe counts."""

    @staticmethod
    def _samples_per_epoch(trainer: Trainer) -> int:
        """Training samples of one epoch over all ranks: batches (after ``limit_train_batches``)
        × the train loader's batch size × world size (a count, not a measurement)."""
        batches = trainer.num_training_batches
        loaders = trainer.train_dataloader
        loader = loaders if isinstance(loaders, DataLoader) else next(iter(loaders_of(loaders)), None)
        size = getattr(loader, "batch_size", None) or 1
        if not isinstance(batches, (int, float)) or not math.isfinite(batches):
            return 0
        return int(batches) * int(size) * trainer.world_size

    def _warn_small_probe(self, trainer: Trainer) -> None:
        """Warn once, before training, when a gain of ``min_gain`` is not detectable with this probe at level α.

        Only for ``decision="gain"``: the figure behind the warning is the spread of a whole stage's
        per-sample differences (≈ the probe loss). A block-only trial's are 2–10× tighter and it
        scores held-back training samples beside the probe (docs/decision.md)."""
        if self.min_gain is None or self.decision != "gain":
            return
        try:
            n = self._probe_samples(trainer)
        except Exception:  # a probe that cannot be counted: nothing to say
            return
        message = guidance.probe_size_message(n, self.min_gain, self.alpha)
        if message is not None:
            rank_zero_warn(message, category=UserWarning)

    def _probe_samples(self, trainer: Trainer) -> int:
        loader = self._probe_loader(trainer)
        dataset = getattr(loader, "dataset", None)
        try:
            return len(dataset) if dataset is not None else sum(len(b[-1]) for b in loader)
        except TypeError:
            return 0

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        """Keep the loss ``training_step`` returned (summed on its device, no host copy per batch):
        the default monitor's fallback when the module logs no ``train_loss``."""
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

    def _track_monitor(self, trainer: Trainer) -> bool:
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
        min_delta = max(self.min_delta, self.min_rel_delta * abs(self.best)) if self.best is not None else 0.0
        self.best, self.wait, plateaued = dec.plateau_update(
            value, self.best, self.wait, mode=self.mode, min_delta=min_delta, patience=self.patience
        )
        return plateaued
