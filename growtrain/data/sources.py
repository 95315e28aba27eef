"""The dataset registry: name -> loader returning uint8 images in memory.

Pure torch/numpy (no Lightning), so a probe set can be built in a notebook without a Trainer.
Every loader returns the same dict:

    train=(x uint8 (N, C, H, W), y int64 (N,)), test=(x, y), num_classes, mean, std, class_names

`train`/`test` are the *official* splits; the train/probe/val cut is the datamodule's job.
`imagefolder` is the exception: its images are decoded lazily (see `imagefolder.py`), so its
`train`/`test` are `ImageFolder` datasets and the dict has `lazy=True`.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from .formats import (
    ArchiveReader,
    CorruptDatasetError,
    DatasetNotFoundError,
    download_url,
    read_cifar_meta,
    read_cifar_split,
    read_idx,
)
from .imagefolder import IMAGENET_MEAN, IMAGENET_STD, load_imagefolder

__all__ = [
    "DATASETS",
    "DATASET_INFO",
    "DatasetInfo",
    "load_images",
    "default_roots",
    "locate_cifar",
    "CIFAR_NAMES",
    "check_name",
    "MINI_PATH",
]

MINI_PATH = Path(__file__).with_name("fashion_mnist_mini.npz")
FASHION_MNIST_DIRS = (
    Path("/usr/share/datasets/fashion-mnist"),  # Debian/Ubuntu package dataset-fashion-mnist
    Path("~/.cache/growtrain/fashion-mnist"),
)
FASHION_MNIST_CLASSES = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)  # fmt: skip
FASHION_MNIST_STATS = ((0.2860,), (0.3530,))
CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))


@dataclass(frozen=True)
class DatasetInfo:
    """What is known about a dataset without reading it (the CLI links these into the model
    before `setup`). `None` = depends on options (synthetic) or on the files (imagefolder)."""

    in_channels: int | None
    image_size: int | None
    num_classes: int | None
    num_train: int | None  # size of the official train split
    mean: tuple[float, ...] | None
    std: tuple[float, ...] | None


DATASET_INFO: dict[str, DatasetInfo] = {
    "fashion-mnist-mini": DatasetInfo(1, 28, 10, 8000, *FASHION_MNIST_STATS),
    "fashion-mnist": DatasetInfo(1, 28, 10, 60000, *FASHION_MNIST_STATS),
    "cifar10": DatasetInfo(3, 32, 10, 50000, *CIFAR10_STATS),
    "cifar100": DatasetInfo(3, 32, 100, 50000, *CIFAR100_STATS),
    "synthetic": DatasetInfo(None, None, None, None, None, None),
    "imagefolder": DatasetInfo(3, None, None, None, IMAGENET_MEAN, IMAGENET_STD),
}


def default_roots() -> list[Path]:
    """Where archives are looked for when `root=None`: `$GROWTRAIN_DATA`, then the cache."""
    env = os.environ.get("GROWTRAIN_DATA")
    return [Path(p).expanduser() for p in ([env] if env else []) + ["~/.cache/growtrain"]]


def _pack(train, test, num_classes, stats, class_names) -> dict:
    as_t = lambda x, y: (torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(y).long())
    return dict(
        train=as_t(*train),
        test=as_t(*test),
        num_classes=num_classes,
        mean=tuple(stats[0]),
        std=tuple(stats[1]),
        class_names=list(class_names) if class_names is not None else None,
    )


# --- Fashion-MNIST ---------------------------------------------------------------------------
def load_fashion_mnist_mini(root: str | Path | None = None, *, download: bool = False) -> dict:
    """The embedded 10k subset (8,000 train + 2,000 test images; see `make_mini.py`).

    `root` and `download` are accepted for a uniform registry signature and ignored: the file
    ships inside the package.
    """
    if not MINI_PATH.is_file():
        raise DatasetNotFoundError(
            f"fashion-mnist-mini: {MINI_PATH} is missing from the installed package. Fix: "
            "reinstall growtrain, or regenerate it with `python -m growtrain.data.make_mini` "
            "(needs `apt-get install dataset-fashion-mnist`)."
        )
    with np.load(MINI_PATH) as z:
        train = (z["x_train"][:, None], z["y_train"].astype(np.int64))
        test = (z["x_test"][:, None], z["y_test"].astype(np.int64))
    return _pack(train, test, 10, FASHION_MNIST_STATS, FASHION_MNIST_CLASSES)


def _idx_file(folder: Path, stem: str) -> Path | None:
    for name in (stem + ".gz", stem):
        if (folder / name).is_file():
            return folder / name
    return None


def load_fashion_mnist(root: str | Path | None = None, *, download: bool = False) -> dict:
    """Full Fashion-MNIST from the official IDX files (`.gz` or uncompressed) in one folder.

    `root=None` searches /usr/share/datasets/fashion-mnist (Debian `dataset-fashion-mnist`)
    then ~/.cache/growtrain/fashion-mnist. No download: the files' home is a package here.
    """
    stems = ("train-images-idx3-ubyte", "train-labels-idx1-ubyte",
             "t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte")  # fmt: skip
    if root is not None:
        folders = [Path(root).expanduser(), Path(root).expanduser() / "fashion-mnist"]
    else:
        folders = [d.expanduser() for d in FASHION_MNIST_DIRS]
    for folder in folders:
        files = [_idx_file(folder, s) for s in stems]
        if all(files):
            xtr, ytr, xte, yte = (read_idx(f) for f in files)
            for x, y, f in ((xtr, ytr, files[0]), (xte, yte, files[2])):
                if x.ndim != 3 or y.ndim != 1 or len(x) != len(y):
                    raise CorruptDatasetError(
                        f"{f}: expected images (N, H, W) and N labels, got {x.shape} and "
                        f"{y.shape}. Fix: the image and label files do not belong together."
                    )
            train, test = (xtr[:, None], ytr.astype(np.int64)), (xte[:, None], yte.astype(np.int64))
            return _pack(train, test, 10, FASHION_MNIST_STATS, FASHION_MNIST_CLASSES)
    raise DatasetNotFoundError(
        "fashion-mnist: IDX files not found. Looked in: "
        + ", ".join(str(f) for f in folders)
        + f" for {', '.join(s + '[.gz]' for s in stems)}. Fix: `apt-get install "
        "dataset-fashion-mnist` (Debian/Ubuntu), or download the four .gz files from "
        "https://github.com/zalandoresearch/fashion-mnist into ~/.cache/growtrain/fashion-mnist "
        "and pass root=. Or use dataset='fashion-mnist-mini', which ships with growtrain."
    )


# --- CIFAR-10 / CIFAR-100 (official python-version archives) ---------------------------------
_CIFAR = {
    "cifar10": dict(
        dir="cifar-10-batches-py",
        archive="cifar-10-python.tar.gz",
        url="https://www.cs.toronto.edu/~kriz/cifar-10-python.tar.gz",
        md5="c58f30108f718f92721af3b95e74349a",
        train=[f"data_batch_{i}" for i in range(1, 6)],
        test=["test_batch"],
        meta="batches.meta",
        label_key="labels",
        names_key="label_names",
        classes=10,
        stats=CIFAR10_STATS,
    ),
    "cifar100": dict(
        dir="cifar-100-python",
        archive="cifar-100-python.tar.gz",
        url="https://www.cs.toronto.edu/~kriz/cifar-100-python.tar.gz",
        md5="eb9058c3a382ffc7106e4002c42a8d85",
        train=["train"],
        test=["test"],
        meta="meta",
        label_key="fine_labels",
        names_key="fine_label_names",
        classes=100,
        stats=CIFAR100_STATS,
    ),
}


CIFAR_NAMES = tuple(_CIFAR)


def locate_cifar(
    name: str, root: str | Path | None = None, download: bool = False
) -> tuple[Path, str]:
    """Find CIFAR on disk: returns (directory or .tar.gz, member prefix inside it).

    Per root it accepts `root/<dir>/` (extracted), `root/` itself being that directory, or
    `root/<archive>.tar.gz`. With `download=True` and nothing found, fetches the official
    archive (md5-checked) into the first root.
    """
    spec = _CIFAR[name]
    roots = [Path(root).expanduser()] if root is not None else default_roots()
    tried = []
    for r in roots:
        archive = (r / spec["archive"], spec["dir"] + "/")
        for path, prefix in ((r / spec["dir"], ""), (r, ""), archive):
            tried.append(path)
            if (prefix and path.is_file()) or (not prefix and (path / spec["meta"]).is_file()):
                return path, prefix
    if download:
        dest = download_url(spec["url"], roots[0] / spec["archive"], spec["md5"])
        return dest, spec["dir"] + "/"
    raise DatasetNotFoundError(
        f"{name}: not found. Looked in: {', '.join(str(p) for p in tried)}. Expected the "
        f"official python-version archive {spec['archive']} or its extracted folder "
        f"{spec['dir']}/ ({', '.join(spec['train'] + spec['test'] + [spec['meta']])}). "
        f"Fix: download {spec['url']} into {roots[0]} (tar.gz can stay packed), pass root=, "
        "or pass download=True where there is a network."
    )


def _load_cifar(name: str, root: str | Path | None, download: bool) -> dict:
    spec = _CIFAR[name]
    location, prefix = locate_cifar(name, root, download)
    with ArchiveReader(location) as ar:

        def read(files: list[str]) -> tuple[np.ndarray, np.ndarray]:
            handles = [(f"{location}:{prefix}{f}", ar.open(prefix + f)) for f in files]
            try:
                return read_cifar_split(handles, spec["label_key"])
            finally:
                for _, h in handles:
                    h.close()

        train, test = read(spec["train"]), read(spec["test"])
        with ar.open(prefix + spec["meta"]) as f:
            names = read_cifar_meta(f, f"{location}:{prefix}{spec['meta']}", spec["names_key"])
    return _pack(train, test, spec["classes"], spec["stats"], names)


def load_cifar10(root: str | Path | None = None, *, download: bool = False) -> dict:
    """CIFAR-10 from `cifar-10-batches-py/` or `cifar-10-python.tar.gz` under `root`."""
    return _load_cifar("cifar10", root, download)


def load_cifar100(root: str | Path | None = None, *, download: bool = False) -> dict:
    """CIFAR-100 (fine labels) from `cifar-100-python/` or `cifar-100-python.tar.gz`."""
    return _load_cifar("cifar100", root, download)


# --- Synthetic -------------------------------------------------------------------------------
def load_synthetic(
    root: str | Path | None = None,
    *,
    download: bool = False,
    size: int = 4000,
    test_size: int | None = None,
    image_size: int = 32,
    channels: int = 3,
    num_classes: int = 10,
    seed: int = 0,
) -> dict:
    """Learnable random images: class prototype + per-pixel noise, deterministic from `seed`.

    Each class has a smooth prototype (4×4 noise upsampled, mirrored so that a horizontal flip
    keeps the class) added to mid-grey with per-pixel Gaussian noise; the class signal spans
    every pixel so a small network separates classes within an epoch, while the noise keeps it
    from being trivial. `root`/`download` are ignored.
    """
    for arg, v, lo in (("size", size, num_classes), ("image_size", image_size, 1),
                       ("channels", channels, 1), ("num_classes", num_classes, 2)):  # fmt: skip
        if v < lo:
            raise ValueError(f"synthetic: {arg} must be >= {lo}; got {v}. Fix: raise {arg}.")
    g = torch.Generator().manual_seed(seed)
    protos = torch.rand(num_classes, channels, 4, 4, generator=g) * 2 - 1
    protos = F.interpolate(protos, size=(image_size,) * 2, mode="bilinear", align_corners=False)
    protos = (protos + protos.flip(-1)) / 2  # (K, C, S, S), flip-invariant

    def make(n: int) -> tuple[torch.Tensor, torch.Tensor]:
        y = (torch.arange(n) % num_classes)[torch.randperm(n, generator=g)]
        x = torch.randn(n, channels, image_size, image_size, generator=g).mul_(40)
        x.add_(protos[y], alpha=70).add_(128).round_().clamp_(0, 255)  # in place: big at 50k
        x = x.to(torch.uint8)
        return x, y

    train = make(size)
    test = make(test_size if test_size is not None else max(size // 5, num_classes))
    # Per-channel stats of (up to) 2048 train images: plenty for normalisation constants, and
    # a full reduction over 50k images costs seconds.
    xc = train[0][:2048].transpose(0, 1).reshape(channels, -1).to(torch.float32) / 255
    var, mean = torch.var_mean(xc, dim=1)
    mean, std = tuple(mean.tolist()), tuple(var.sqrt().tolist())
    names = [f"class_{i}" for i in range(num_classes)]
    return dict(
        train=train, test=test, num_classes=num_classes, mean=mean, std=std, class_names=names
    )


DATASETS: dict[str, Callable[..., dict]] = {
    "fashion-mnist-mini": load_fashion_mnist_mini,
    "fashion-mnist": load_fashion_mnist,
    "cifar10": load_cifar10,
    "cifar100": load_cifar100,
    "synthetic": load_synthetic,
    "imagefolder": load_imagefolder,
}


def check_name(name: str, argument: str = "dataset") -> str:
    if name not in DATASETS:
        raise ValueError(
            f"{argument}={name!r} is not a known dataset; expected one of "
            f"{', '.join(sorted(DATASETS))}. Fix: pick one of those names, or add a loader "
            "to growtrain.data.DATASETS."
        )
    return name


def load_images(name: str, root: str | Path | None = None, **options) -> dict:
    """Load dataset `name` via the registry. `options` go to its loader (e.g. `download=True`;
    synthetic: `size`, `image_size`, `channels`, `num_classes`, `seed`; imagefolder:
    `image_size`)."""
    return DATASETS[check_name(name, "name")](root, **options)
