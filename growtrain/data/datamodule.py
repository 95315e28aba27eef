"""LightningDataModules for image classification with a held-out probe split.

The official train split is cut once, by a seeded permutation, into three disjoint index sets:
**probe** (scored by `measure_saturation`, never trained on, never used for model selection),
**val**, and **train** (the rest). The official test split stays the test set. Keeping the
probe out of training is what makes the growth test's certificate a held-out estimate.

Data path, in-memory sets (all but imagefolder): images are one uint8 tensor; a batch is one
tensor index (`Dataset.__getitems__`), no per-sample Python. The train loader yields uint8,
so host->device traffic is 1 byte/pixel; `on_after_batch_transfer` then normalises and, in
training, augments the whole batch on its device. Val/test/probe loaders normalise in their
collate function and yield float32, because the probe loader is also read outside Lightning
(`measure_saturation` calls `network(x)` directly and no hook runs there).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning
import torch
from lightning.pytorch.utilities import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from .imagefolder import ImageFolder, find_classes
from .sources import CIFAR_NAMES, DATASET_INFO, check_name, load_images, locate_cifar
from .transforms import augment_batch, normalize_batch

__all__ = ["ImageDataModule", "SyntheticImageDataModule"]


class TensorImages(Dataset):
    """The rows `indices` of in-memory `(x, y)`; `__getitems__` returns a whole batch at once."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, indices: torch.Tensor):
        self.x, self.y, self.indices = x, y, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        j = self.indices[i]
        return self.x[j], self.y[j]

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # DataLoader calls this with the sampler's whole batch of positions (torch >= 2.1).
        j = self.indices[torch.as_tensor(idx, dtype=torch.long)]
        return self.x[j], self.y[j]


def _as_batch(batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
    # `__getitems__` already built (x, y); a plain sample list (custom sampler) gets stacked.
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return batch
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.as_tensor(ys, dtype=torch.long)


class NormalizeCollate:
    """Collate for eval loaders: uint8 batch -> normalised float32 (a class so workers can
    pickle it)."""

    def __init__(self, mean: tuple[float, ...], std: tuple[float, ...]):
        self.mean, self.std = mean, std

    def __call__(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = _as_batch(batch)
        return normalize_batch(x, self.mean, self.std), y


# Datasets that read no file, so a ``root`` has nothing to point at: why, for the error
_NO_FILES = {
    "fashion-mnist-mini": "its images ship inside the package",
    "synthetic": "its images are generated from seed",
}


def _bad(arg: str, expected: str, given: Any, fix: str) -> ValueError:
    return ValueError(f"{arg}: expected {expected}; got {given!r}. Fix: {fix}.")


class ImageDataModule(lightning.LightningDataModule):
    """Train / probe / val / test loaders for one registered image dataset.

    Args:
        dataset: a name in `growtrain.data.DATASETS` (default: the Fashion-MNIST subset that
            ships with the package, so `fit` works offline with no download).
        root: where the files are; `None` = the dataset's default search paths. Must be `None`
            for `fashion-mnist-mini` and `synthetic`, which read no file (an error otherwise).
        batch_size: train batch size (paper: 128).
        probe_size: images held out for the growth probe. 2000 by default: enough samples for
            the certified test to have power, and it still leaves 5000 train images on the
            8000-image embedded set (use ~5000 on CIFAR's 50k if you can spare them).
        val_size: images held out for validation.
        seed: seed of the split permutation (not of shuffling or augmentation; those follow
            `lightning.seed_everything`). Same seed = same split, on every machine.
        augment: pad-4 crop + horizontal flip on train batches (paper Appendix B.2);
            for imagefolder RandomResizedCrop + flip (Appendix B.3).
        num_workers: DataLoader workers. 0 is right for the in-memory sets (a batch is one
            tensor index); imagefolder decodes JPEGs and wants several.
        eval_batch_size: batch size of val/test/probe loaders (default `batch_size`).
        train_subset: keep only this many train images (a random subset, same seed).
        download: fetch CIFAR archives from the official URL if missing (`prepare_data`).
        image_size: synthetic side length (default 32) or imagefolder crop (default 224);
            for the fixed-size sets it must match (28 Fashion-MNIST, 32 CIFAR) or be None.
        channels, synthetic_size, synthetic_classes: only for `dataset="synthetic"`.
    """

    def __init__(
        self,
        dataset: str = "fashion-mnist-mini",
        root: str | None = None,
        batch_size: int = 128,
        probe_size: int = 2000,
        val_size: int = 1000,
        seed: int = 0,
        augment: bool = True,
        num_workers: int = 0,
        eval_batch_size: int | None = None,
        train_subset: int | None = None,
        download: bool = False,
        image_size: int | None = None,
        channels: int = 3,
        synthetic_size: int = 4000,
        synthetic_classes: int = 10,
    ):
        super().__init__()
        if type(self) is ImageDataModule:  # subclasses record their own arguments
            self.save_hyperparameters()
        check_name(dataset, "dataset")
        if root is not None and dataset in _NO_FILES:
            # a root given here was meant for files: training silently on other images is the worse outcome
            raise _bad("root", f"None for dataset={dataset!r}: {_NO_FILES[dataset]}, so root would be unused", root,
                       f"drop root, or pass the dataset whose files are in {str(root)!r} (dataset=fashion-mnist, "
                       "cifar10, cifar100 or imagefolder)")  # fmt: skip
        for arg, v, lo in (("batch_size", batch_size, 1), ("probe_size", probe_size, 0),
                           ("val_size", val_size, 0), ("num_workers", num_workers, 0),
                           ("eval_batch_size", eval_batch_size, 1),
                           ("train_subset", train_subset, 1),
                           ("channels", channels, 1), ("synthetic_size", synthetic_size, 2),
                           ("synthetic_classes", synthetic_classes, 2)):  # fmt: skip
            if v is not None and (not isinstance(v, int) or v < lo):
                raise _bad(arg, f"an integer >= {lo}", v, f"pass {arg}={max(lo, 1)} or more")
        self.dataset, self.root, self.seed, self.augment = dataset, root, seed, augment
        self.batch_size, self.eval_batch_size = batch_size, eval_batch_size or batch_size
        self.probe_size, self.val_size, self.train_subset = probe_size, val_size, train_subset
        self.num_workers, self.download = num_workers, download

        info = DATASET_INFO[dataset]
        # self._shape = (in_channels, image_size, num_classes, official train size or None)
        if dataset == "synthetic":
            size = image_size or 32
            self._options = dict(size=synthetic_size, image_size=size, channels=channels,
                                 num_classes=synthetic_classes, seed=seed)  # fmt: skip
            self._shape = (channels, size, synthetic_classes, synthetic_size)
        elif dataset == "imagefolder":
            # One directory listing, so the model can be built before setup().
            size, classes = image_size or 224, find_classes(_need_root(root))
            self._options, self._shape = dict(image_size=size), (3, size, len(classes), None)
        else:
            if image_size not in (None, info.image_size):
                raise _bad("image_size", f"None or {info.image_size} for {dataset}", image_size,
                           "leave image_size unset; these images have a fixed size")  # fmt: skip
            self._options = {}
            self._shape = (info.in_channels, info.image_size, info.num_classes, info.num_train)
        if self._shape[3] is not None:  # refuse an impossible split now, not after loading
            self._check_split(self._shape[3])
        self._data: dict | None = None
        self._stats_on: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # device -> mean, std
        self._split: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    # --- what the model needs before setup ---------------------------------------------------
    @property
    def in_channels(self) -> int:
        return self._shape[0]

    @property
    def image_size(self) -> int:
        return self._shape[1]

    @property
    def num_classes(self) -> int:
        return self._shape[2]

    @property
    def mean(self) -> tuple[float, ...]:
        info = DATASET_INFO[self.dataset]
        return info.mean if info.mean is not None else self._loaded()["mean"]

    @property
    def std(self) -> tuple[float, ...]:
        info = DATASET_INFO[self.dataset]
        return info.std if info.std is not None else self._loaded()["std"]

    @property
    def class_names(self) -> list[str] | None:
        return self._loaded().get("class_names")

    # --- loading and the split ---------------------------------------------------------------
    def _check_split(self, n: int) -> None:
        if self.probe_size + self.val_size >= n:
            raise _bad(
                "probe_size + val_size",
                f"fewer than the {n} official training images of {self.dataset!r} (the rest "
                "is the train split)",
                f"{self.probe_size} + {self.val_size}",
                "lower probe_size or val_size",
            )

    def prepare_data(self) -> None:
        # Lightning runs this on one process only: the place to download, never to assign state.
        if self.download and self.dataset in CIFAR_NAMES:
            locate_cifar(self.dataset, self.root, download=True)

    def setup(self, stage: str | None = None) -> None:
        self._loaded()

    def _loaded(self) -> dict:
        if self._data is None:
            data = load_images(self.dataset, self.root, download=self.download, **self._options)
            n = len(data["train"] if data.get("lazy") else data["train"][1])
            self._check_split(n)
            perm = torch.randperm(n, generator=torch.Generator().manual_seed(self.seed))
            p, v = self.probe_size, self.val_size
            train = perm[p + v :][: self.train_subset]  # a random subset: perm is random
            self._split = tuple(t.sort().values for t in (train, perm[:p], perm[p : p + v]))
            self._data = data
        return self._data

    @property
    def train_indices(self) -> torch.Tensor:
        """Indices into the official train split used for training (sorted)."""
        self._loaded()
        return self._split[0]

    @property
    def probe_indices(self) -> torch.Tensor:
        """Indices into the official train split held out for the growth probe (sorted)."""
        self._loaded()
        return self._split[1]

    @property
    def val_indices(self) -> torch.Tensor:
        self._loaded()
        return self._split[2]

    def _subset(self, split: str, indices: torch.Tensor | None, train: bool) -> Dataset:
        source = self._loaded()[split]
        if indices is None:
            indices = torch.arange(len(source if self._lazy else source[1]))
        if self._lazy:
            return ImageFolder(source.samples, source.size, train=train and self.augment,
                               indices=indices)  # fmt: skip
        return TensorImages(*source, indices)

    @property
    def _lazy(self) -> bool:
        return self.dataset == "imagefolder"

    # --- loaders -----------------------------------------------------------------------------
    def _loader(self, ds: Dataset, train: bool) -> DataLoader:
        return DataLoader(
            ds,
            batch_size=self.batch_size if train else self.eval_batch_size,
            shuffle=train,
            # A ragged last batch of 1 would break BatchNorm in train mode; drop it in training.
            drop_last=train and len(ds) > self.batch_size,
            collate_fn=_as_batch if train else NormalizeCollate(self.mean, self.std),
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled train split; yields `(x uint8 (B, C, H, W), y int64)`."""
        return self._loader(self._subset("train", self.train_indices, train=True), train=True)

    def val_dataloader(self) -> DataLoader:
        return self._loader(self._subset("train", self.val_indices, train=False), train=False)

    def test_dataloader(self) -> DataLoader:
        return self._loader(self._subset("test", None, train=False), train=False)

    def probe_dataloader(self) -> DataLoader:
        """The probe split in a fixed order, no augmentation, normalised float32 `(x, y)`:
        ready for `measure_saturation(network, loader, loss_fn)` outside Lightning.

        With ``probe_size=0`` there is no probe split (fine for runs that never probe, e.g.
        cyclic insertion); asking for it is an error here, so ``GrowUntilSaturated`` refuses
        the run when it builds its probe loader at train start, before any training step,
        instead of failing at its first check epochs later."""
        if self.probe_size == 0:
            raise _bad("probe_size", "an integer >= 1 when a probe is used (GrowUntilSaturated, measure, "
                       "match, sweep, compare)", 0, "pass probe_size=500 or more")  # fmt: skip
        return self._loader(self._subset("train", self.probe_indices, train=False), train=False)

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        """uint8 batches (the train loader's) -> normalised float32, augmented when training."""
        x, y = batch
        if x.dtype != torch.uint8:
            return batch
        if str(x.device) not in self._stats_on:  # one small host->device copy per device, ever
            self._stats_on[str(x.device)] = tuple(
                torch.tensor(v, dtype=torch.float32, device=x.device) for v in (self.mean, self.std)
            )
        x = normalize_batch(x, *self._stats_on[str(x.device)])
        # imagefolder already cropped/flipped per sample; pad-crop on top would double it.
        if self.augment and not self._lazy and self.trainer is not None and self.trainer.training:
            x = augment_batch(x)
        plugin = getattr(self.trainer, "precision_plugin", None)
        if plugin is not None:  # Lightning converted the uint8 batch before this hook: convert the
            x = plugin.convert_input(x)  # floats now (float64 under "64-true")
        return type(batch)((x, y)) if isinstance(batch, (tuple, list)) else (x, y)

    # --- checkpoints: a resumed run must keep the same probe ---------------------------------
    def _split_key(self) -> dict:
        keys = ("dataset", "seed", "probe_size", "val_size", "train_subset")
        return {k: getattr(self, k) for k in keys}

    def state_dict(self) -> dict:
        return {"split": self._split_key()}

    def load_state_dict(self, state_dict: dict) -> None:
        check_resumed_split(self, state_dict.get("split"), "images", "dataset/seed/sizes")


def _need_root(root: str | None) -> Path:
    if root is None:
        raise _bad("root", "the folder holding train/<class>/ and val/<class>/ for imagefolder",
                   None, "pass root=/path/to/imagenet100")  # fmt: skip
    return Path(root).expanduser()


class SyntheticImageDataModule(ImageDataModule):
    """`ImageDataModule(dataset="synthetic")` with sizes for tests and benchmarks: learnable
    random images, no files, deterministic from `seed`."""

    def __init__(
        self,
        synthetic_size: int = 4000,
        image_size: int = 32,
        channels: int = 3,
        synthetic_classes: int = 10,
        batch_size: int = 128,
        probe_size: int = 1000,
        val_size: int = 500,
        seed: int = 0,
        augment: bool = True,
        num_workers: int = 0,
        eval_batch_size: int | None = None,
        train_subset: int | None = None,
    ):
        super().__init__(
            dataset="synthetic", batch_size=batch_size, probe_size=probe_size,
            val_size=val_size, seed=seed, augment=augment, num_workers=num_workers,
            eval_batch_size=eval_batch_size, train_subset=train_subset, image_size=image_size,
            channels=channels, synthetic_size=synthetic_size, synthetic_classes=synthetic_classes,
        )  # fmt: skip
        self.save_hyperparameters()


def check_resumed_split(datamodule, saved, units: str, fix: str) -> None:
    """Refuse to resume training on a different split than the checkpoint's (probe data could
    leak into training); only warn when evaluating."""
    current = datamodule._split_key()
    if saved is None or saved == current:
        return
    msg = (
        f"datamodule split: the checkpoint was trained with {saved}, this datamodule has {current}. "
        f"A different split can put probe {units} into training and void the growth certificate. "
        f"Fix: use the checkpoint's {fix}."
    )
    if datamodule.trainer is not None and datamodule.trainer.state.fn == "fit":
        raise ValueError(msg)
    rank_zero_warn(msg)  # evaluating elsewhere is fine; resuming training is not
