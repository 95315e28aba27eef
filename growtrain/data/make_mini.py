"""Regenerate `fashion_mnist_mini.npz`, the 10k-image Fashion-MNIST subset shipped in the package.

    python -m growtrain.data.make_mini [--src /usr/share/datasets/fashion-mnist] [--out PATH]

Selection (fixed, no randomness): stratified first-N in the official order, i.e. for each of
the 10 classes the first 800 images of the official train split and the first 200 of the
official test split, kept in their original order. That is 8,000 + 2,000 images, exactly
balanced. The original indices are stored too (`train_index`, `test_index`) so any image can
be traced back. Source: Debian package `dataset-fashion-mnist` (Fashion-MNIST © 2017 Zalando
SE, MIT licence, see FASHION_MNIST_LICENSE.txt).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from .formats import read_idx
from .sources import MINI_PATH

TRAIN_PER_CLASS, TEST_PER_CLASS = 800, 200


def first_per_class(labels: np.ndarray, per_class: int) -> np.ndarray:
    """Indices of the first `per_class` samples of every class, in original order."""
    picks = [np.flatnonzero(labels == c)[:per_class] for c in np.unique(labels)]
    if any(len(p) < per_class for p in picks):
        raise ValueError(f"a class has fewer than {per_class} samples; expected the full set")
    return np.sort(np.concatenate(picks))


def make_mini(src: Path, out: Path) -> Path:
    arrays = {}
    for split, prefix, n in (("train", "train", TRAIN_PER_CLASS), ("test", "t10k", TEST_PER_CLASS)):
        x = read_idx(src / f"{prefix}-images-idx3-ubyte.gz")
        y = read_idx(src / f"{prefix}-labels-idx1-ubyte.gz")
        idx = first_per_class(y, n)
        arrays[f"x_{split}"], arrays[f"y_{split}"] = x[idx], y[idx]
        arrays[f"{split}_index"] = idx.astype(np.int32)
    np.savez_compressed(out, **arrays)
    return out


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--src", type=Path, default=Path("/usr/share/datasets/fashion-mnist"))
    p.add_argument("--out", type=Path, default=MINI_PATH)
    a = p.parse_args()
    out = make_mini(a.src, a.out)
    print(f"wrote {out} ({out.stat().st_size / 1e6:.2f} MB)")


if __name__ == "__main__":
    main()
