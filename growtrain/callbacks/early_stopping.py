"""`TrainLossEarlyStopping`: the paper's early stopping on the training loss (Table 5)."""

from __future__ import annotations

from typing import Any

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.callbacks import EarlyStopping

__all__ = ["TrainLossEarlyStopping"]


class TrainLossEarlyStopping(EarlyStopping):
    """Early stopping on the training loss that only starts checking at ``start_epoch``.

    The paper's CIFAR recipe: stop when ``train_loss`` has not improved by more than 1e-4 for
    30 consecutive epochs, enabled only after 180 epochs. Epochs before ``start_epoch``
    (0-based, like ``trainer.current_epoch``) are not checked at all, so the best score and
    the patience count both start there: the earliest stop is at epoch
    ``start_epoch + patience``.

    It checks at the end of each training epoch by default, because ``train_loss`` is an
    epoch-level metric that is only complete then (a check at validation end would see the
    previous epoch's value).
    """

    def __init__(
        self,
        start_epoch: int = 180,
        monitor: str = "train_loss",
        min_delta: float = 1e-4,
        patience: int = 30,
        mode: str = "min",
        check_on_train_epoch_end: bool | None = True,
        **kwargs: Any,
    ):
        if int(start_epoch) < 0:
            raise ValueError(f"start_epoch: expected an epoch index >= 0 (0 checks from the start), got {start_epoch}")
        super().__init__(
            monitor=monitor,
            min_delta=min_delta,
            patience=patience,
            mode=mode,
            check_on_train_epoch_end=check_on_train_epoch_end,
            **kwargs,
        )
        self.start_epoch = int(start_epoch)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch >= self.start_epoch:
            super().on_train_epoch_end(trainer, pl_module)

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if trainer.current_epoch >= self.start_epoch:
            super().on_validation_end(trainer, pl_module)
