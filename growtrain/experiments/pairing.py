"""Pairing the arms of one seed, and what each training records per epoch.

* :class:`EpochOrder`: the train order of epoch ``e`` is a permutation drawn from
  ``(seed, e)`` alone, so two trainings with the same data seed see the same batches in the
  same order epoch by epoch, whatever their initialisation or length. Each permutation's
  digest is recorded (``orders``): the pairing is checked from the indices themselves.
* :class:`PairedData`: a datamodule that serves another one's train split through
  ``EpochOrder`` and forwards everything else (batch hooks, other splits, split state).
* :class:`EpochTrace`: per epoch, the logged ``train_loss`` (the quantity the stopping rule
  watches) and the learning rate; the weights are saved whenever ``train_loss`` reaches a new
  minimum, the only epochs where a "first epoch at or below a target" can fall. The
  equal-train-loss comparison then evaluates just the epoch it needs, after both arms ran.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any, Iterator

import torch
from lightning.pytorch import Callback, LightningDataModule
from torch.utils.data import DataLoader, Sampler

from growtrain.experiments._training import DelegatingDataModule

__all__ = ["EpochOrder", "PairedData", "EpochTrace", "split_digest"]


def _seed_of(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little")


class EpochOrder(Sampler[int]):
    """Shuffled order of ``n`` samples, a function of ``(seed, epoch)`` only.

    Lightning calls ``set_epoch`` at the start of every training epoch.
    """

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = int(n), int(seed), 0
        self.orders: dict[int, str] = {}  # epoch -> sha1 of the index order used

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def order(self, epoch: int) -> torch.Tensor:
        return torch.randperm(self.n, generator=torch.Generator().manual_seed(_seed_of("order", self.seed, epoch)))

    def __iter__(self) -> Iterator[int]:
        order = self.order(self.epoch)
        self.orders[self.epoch] = hashlib.sha1(order.numpy().tobytes()).hexdigest()[:16]
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.n


class PairedData(DelegatingDataModule):
    """``inner``'s data with its train loader re-made on :class:`EpochOrder` (``seed``); every
    other attribute is ``inner``'s."""

    def __init__(self, inner: LightningDataModule, seed: int):
        super().__init__()
        self.inner, self.seed = inner, int(seed)
        self.sampler: EpochOrder | None = None

    def prepare_data(self) -> None:
        self.inner.prepare_data()

    def setup(self, stage: str) -> None:
        self.inner.setup(stage)

    def _attach(self) -> None:
        # The inner hooks ask `self.trainer.training` (augmentation): answer with this trainer.
        self.inner.trainer = self.trainer

    def train_dataloader(self) -> DataLoader:
        self._attach()
        loader = self.inner.train_dataloader()
        if not isinstance(loader, DataLoader) or loader.batch_size is None or not hasattr(loader.dataset, "__len__"):
            raise ValueError(
                f"datamodule: compare pairs the arms' data order through a map-style DataLoader with a batch_size; "
                f"{type(self.inner).__name__}.train_dataloader() returned {type(loader).__name__}"
                f"{'' if not isinstance(loader, DataLoader) else ' with a batch_sampler or an iterable dataset'}. "
                "Return DataLoader(dataset, batch_size=..., shuffle=True)."
            )
        self.sampler = EpochOrder(len(loader.dataset), self.seed)
        return DataLoader(
            loader.dataset, batch_size=loader.batch_size, sampler=self.sampler, drop_last=loader.drop_last,
            collate_fn=loader.collate_fn, num_workers=loader.num_workers, pin_memory=loader.pin_memory,
            persistent_workers=loader.num_workers > 0,
        )  # fmt: skip

    def val_dataloader(self):
        self._attach()
        return self.inner.val_dataloader()

    def test_dataloader(self):
        self._attach()
        return self.inner.test_dataloader()


    def __getattr__(self, name: str):
        # Anything else the callbacks ask the datamodule for (e.g. GrowUntilSaturated's
        # probe_dataloader, num_classes) is the inner datamodule's.
        if name == "inner" or name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.inner, name)

    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        self.inner.load_state_dict(state_dict)


def split_digest(datamodule: LightningDataModule) -> str:
    """A digest of the datamodule's split: its train/probe/val index sets where it exposes them
    (growtrain's datamodules do), else its split settings or class name."""
    parts = []
    for name in ("train_indices", "probe_indices", "val_indices"):
        indices = getattr(datamodule, name, None)
        if isinstance(indices, torch.Tensor):
            parts.append(hashlib.sha1(indices.cpu().numpy().tobytes()).hexdigest())
    if not parts:
        key = getattr(datamodule, "_split_key", None)
        parts.append(repr(key()) if callable(key) else type(datamodule).__qualname__)
    return hashlib.sha1("|".join(parts).encode()).hexdigest()[:16]


class EpochTrace(Callback):
    """Per-epoch ``train_loss`` and learning rate; weights saved at each new train-loss minimum.

    The running minimum restarts at epoch ``reset_at`` (where the lr becomes final): a lookup
    restricted to epochs ≥ ``reset_at`` then always finds its first epoch at a target saved,
    and so does one over all epochs.

    ``records``: one dict per finished epoch ``{"epoch", "train_loss", "lr", "weights", "params"}``
    (``lr``: the first group's lr during the epoch; ``weights``: the saved file's name, or None;
    ``params``: the network's size at the epoch's end).
    """

    def __init__(self, directory: str | Path, monitor: str = "train_loss", reset_at: float = 0):
        self.directory, self.monitor, self.reset_at = Path(directory), monitor, reset_at
        self.records: list[dict] = []
        self._best = math.inf

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        # the lr this epoch trains with (epoch schedulers have already stepped by epoch end)
        self._lr = trainer.optimizers[0].param_groups[0]["lr"] if trainer.optimizers else None

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        value = trainer.callback_metrics.get(self.monitor)
        loss = float(value) if value is not None else None
        lr = getattr(self, "_lr", None)
        weights = None
        if trainer.current_epoch == self.reset_at:
            self._best = math.inf
        if loss is not None and math.isfinite(loss) and loss < self._best:
            self._best = loss
            self.directory.mkdir(parents=True, exist_ok=True)
            weights = f"epoch{trainer.current_epoch:04d}.pt"
            torch.save({k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in pl_module.state_dict().items()}, self.directory / weights)
        params = sum(p.numel() for p in pl_module.parameters())  # tells pre-growth epochs apart
        self.records.append({"epoch": trainer.current_epoch, "train_loss": loss, "lr": lr, "weights": weights, "params": params})
