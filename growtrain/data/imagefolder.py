"""ImageNet-style folders (`root/train/<class>/*.JPEG`, `root/val/<class>/*`), read lazily.

Real ImageNet-100 (~130k JPEGs of varying size) cannot sit in memory as one uint8 tensor, so
unlike the other datasets this one decodes per sample in DataLoader workers. The paper's
Appendix B.3 transforms are written here with PIL (torchvision is not a dependency):
train = RandomResizedCrop(size) + horizontal flip; eval = resize the shorter side to
size·256/224 then center-crop size. Both give uint8 `(3, size, size)`; normalisation with the
ImageNet mean/std happens batched, like for the in-memory sets. The crop is per sample
because it resamples from the full-resolution image, which a batched op on equal-size
tensors cannot do.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import torch

from .formats import DatasetNotFoundError

__all__ = [
    "IMAGE_EXTENSIONS",
    "IMAGENET_MEAN",
    "IMAGENET_STD",
    "ImageFolder",
    "find_classes",
    "load_imagefolder",
]

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".ppm", ".pgm", ".tif", ".tiff", ".webp")
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_TRAIN_DIRS, _TEST_DIRS = ("train",), ("val", "test")


def _missing(root: Path, tried: list[Path]) -> DatasetNotFoundError:
    return DatasetNotFoundError(
        "imagefolder: no image folders found. Looked in: "
        + ", ".join(str(p) for p in tried)
        + f". Expected {root}/train/<class>/*.JPEG and {root}/val/<class>/* (one folder per "
        "class, the ImageNet-100 layout). Fix: pass root= the folder that contains train/ "
        "and val/."
    )


def _split_dir(root: Path, names: tuple[str, ...]) -> Path:
    for n in names:
        if (root / n).is_dir():
            return root / n
    raise _missing(root, [root / n for n in names])


def find_classes(root: str | Path) -> list[str]:
    """Sorted class folder names under `root/train` (cheap: one directory listing)."""
    root = Path(root).expanduser()
    train = _split_dir(root, _TRAIN_DIRS)
    classes = sorted(p.name for p in train.iterdir() if p.is_dir())
    if not classes:
        raise _missing(root, [train / "<class>"])
    return classes


def _scan(split: Path, classes: list[str]) -> list[tuple[str, int]]:
    extra = sorted(p.name for p in split.iterdir() if p.is_dir() and p.name not in classes)
    if extra:
        raise ValueError(
            f"imagefolder: {split} has classes {extra} that train/ does not. Expected the same "
            "class folders in train/ and val/. Fix: remove them or add them to train/."
        )
    samples = []
    for label, name in enumerate(classes):
        folder = split / name
        if folder.is_dir():
            samples += [
                (str(p), label)
                for p in sorted(folder.iterdir())
                if p.suffix.lower() in IMAGE_EXTENSIONS
            ]
    if not samples:
        raise _missing(split.parent, [split / f"<class>/*{e}" for e in IMAGE_EXTENSIONS[:2]])
    return samples


def _random_resized_crop_box(
    w: int, h: int, scale=(0.08, 1.0), ratio=(3 / 4, 4 / 3)
) -> tuple[int, int, int, int]:
    # torchvision's RandomResizedCrop.get_params: 10 tries at a random area and aspect ratio,
    # else fall back to the largest central crop with a clamped ratio.
    area = w * h
    log_r = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target = area * torch.empty(1).uniform_(*scale).item()
        r = math.exp(torch.empty(1).uniform_(*log_r).item())
        cw, ch = round(math.sqrt(target * r)), round(math.sqrt(target / r))
        if 0 < cw <= w and 0 < ch <= h:
            x0 = int(torch.randint(0, w - cw + 1, (1,)))
            y0 = int(torch.randint(0, h - ch + 1, (1,)))
            return x0, y0, x0 + cw, y0 + ch
    r = w / h
    if r < ratio[0]:  # too tall: full width, height cut to the narrowest allowed ratio
        cw, ch = w, round(w / ratio[0])
    elif r > ratio[1]:  # too wide: full height, width cut to the widest allowed ratio
        cw, ch = round(h * ratio[1]), h
    else:
        cw, ch = w, h
    x0, y0 = (w - cw) // 2, (h - ch) // 2
    return x0, y0, x0 + cw, y0 + ch


class ImageFolder(torch.utils.data.Dataset):
    """Lazy image dataset yielding `(uint8 (3, size, size), int64 label)`.

    `train=True` applies RandomResizedCrop + flip (torch's global RNG, which DataLoader seeds
    per worker); `train=False` the deterministic resize + center crop. `indices` selects a
    subset of `samples` (how the datamodule cuts train / probe / val from one folder).
    """

    def __init__(
        self,
        samples: list[tuple[str, int]],
        size: int = 224,
        train: bool = False,
        indices: torch.Tensor | None = None,
    ):
        self.samples, self.size, self.train = samples, size, train
        self.indices = torch.arange(len(samples)) if indices is None else indices

    def __len__(self) -> int:
        return len(self.indices)

    def load(self, i: int) -> tuple[torch.Tensor, int]:
        from PIL import Image  # imported here so the in-memory datasets never need PIL

        path, label = self.samples[int(self.indices[i])]
        with Image.open(path) as im:
            im = im.convert("RGB")
            if self.train:
                box = _random_resized_crop_box(*im.size)
                im = im.resize((self.size, self.size), Image.Resampling.BILINEAR, box=box)
                if torch.rand(1).item() < 0.5:
                    im = im.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
            else:
                short = round(self.size * 256 / 224)
                w, h = im.size
                s = short / min(w, h)
                new = (max(short, round(w * s)), max(short, round(h * s)))
                im = im.resize(new, Image.Resampling.BILINEAR)
                w, h = im.size
                x0, y0 = (w - self.size) // 2, (h - self.size) // 2
                im = im.crop((x0, y0, x0 + self.size, y0 + self.size))
            arr = np.asarray(im, dtype=np.uint8)
        return torch.from_numpy(arr.copy()).permute(2, 0, 1), label

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.load(i)
        return x, torch.tensor(y, dtype=torch.int64)

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # Same batch shape as the in-memory sets: one (x, y) pair of stacked tensors.
        pairs = [self.load(i) for i in idx]
        return torch.stack([p[0] for p in pairs]), torch.tensor([p[1] for p in pairs])


def load_imagefolder(
    root: str | Path | None = None, *, download: bool = False, image_size: int = 224
) -> dict:
    """`root/train` and `root/val` (or `root/test`) as lazy `ImageFolder` datasets.

    Returns the same keys as the in-memory loaders, but `train`/`test` hold `ImageFolder`
    objects (eval transform; the datamodule makes train-mode copies) and `lazy=True`.
    `download` is accepted for a uniform registry signature; ImageNet has no public URL.
    """
    if root is None:
        raise DatasetNotFoundError(
            "imagefolder: root is None; expected the folder holding train/<class>/ and "
            "val/<class>/. Fix: pass root=/path/to/imagenet100."
        )
    root = Path(root).expanduser()
    classes = find_classes(root)
    train = _scan(_split_dir(root, _TRAIN_DIRS), classes)
    test = _scan(_split_dir(root, _TEST_DIRS), classes)
    return dict(
        train=ImageFolder(train, image_size),
        test=ImageFolder(test, image_size),
        num_classes=len(classes),
        mean=IMAGENET_MEAN,
        std=IMAGENET_STD,
        class_names=classes,
        lazy=True,
    )
