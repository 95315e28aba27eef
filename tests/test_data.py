"""Tests for growtrain.data: splits, official file formats, batched transforms, the hook.

Fake datasets are written by the tests in the official formats (IDX, CIFAR pickles, tar.gz,
image folders) under tmp_path, so nothing here needs a download. Whole file: a few seconds.
"""

from __future__ import annotations

import gzip
import io
import pickle
import struct
import tarfile
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from growtrain.data import (
    DATASETS,
    CorruptDatasetError,
    DatasetNotFoundError,
    ImageDataModule,
    SyntheticImageDataModule,
    augment_batch,
    load_images,
    normalize_batch,
    read_idx,
)


def small_synthetic(**kw) -> SyntheticImageDataModule:
    args = dict(synthetic_size=120, image_size=8, synthetic_classes=3, probe_size=30,
                val_size=20, batch_size=16)  # fmt: skip
    return SyntheticImageDataModule(**(args | kw))


# --- splits ----------------------------------------------------------------------------------
def test_split_disjoint_complete_and_seeded():
    dm = small_synthetic()
    tr, pr, va = (set(t.tolist()) for t in (dm.train_indices, dm.probe_indices, dm.val_indices))
    assert (len(pr), len(va), len(tr)) == (30, 20, 70)
    assert not (tr & pr) and not (tr & va) and not (pr & va)
    assert tr | pr | va == set(range(120))
    again = small_synthetic()
    assert torch.equal(again.probe_indices, dm.probe_indices)
    assert torch.equal(again.train_indices, dm.train_indices)
    other = small_synthetic(seed=1)
    assert not torch.equal(other.probe_indices, dm.probe_indices)
    # train_subset caps train only; probe/val are unchanged by it.
    sub = small_synthetic(train_subset=25)
    assert len(sub.train_indices) == 25 and torch.equal(sub.probe_indices, dm.probe_indices)
    assert set(sub.train_indices.tolist()) <= tr


def test_loaders_never_yield_probe_images():
    dm = small_synthetic()
    dm.setup("fit")
    # Tag every image by its label: label = index in the official split (+10**6 for test).
    x, _ = dm._data["train"]
    dm._data["train"] = (x, torch.arange(len(x)))
    xt, _ = dm._data["test"]
    dm._data["test"] = (xt, torch.arange(len(xt)) + 10**6)
    seen = {
        name: torch.cat([y for _, y in getattr(dm, f"{name}_dataloader")()]).tolist()
        for name in ("train", "val", "test", "probe")
    }
    probe = set(dm.probe_indices.tolist())
    assert seen["probe"] == dm.probe_indices.tolist()  # fixed order, nothing dropped
    assert not probe & set(seen["train"]) and not probe & set(seen["val"])
    assert set(seen["train"]) <= set(dm.train_indices.tolist())
    assert set(seen["val"]) == set(dm.val_indices.tolist())
    assert min(seen["test"]) >= 10**6
    # Probe batches are normalised float, train batches raw uint8 (normalised on device).
    xp, _ = next(iter(dm.probe_dataloader()))
    xb, _ = next(iter(dm.train_dataloader()))
    assert xp.dtype == torch.float32 and xb.dtype == torch.uint8


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(probe_size=100, val_size=20), ["probe_size + val_size", "120", "lower"]),
        (dict(probe_size=-1), ["probe_size", ">= 0"]),
        (dict(batch_size=0), ["batch_size", ">= 1"]),
    ],
)
def test_bad_sizes_raise_clear_errors(kwargs, words):
    with pytest.raises(ValueError) as e:
        small_synthetic(**kwargs)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_unknown_dataset_lists_known_names():
    with pytest.raises(ValueError, match="cifar10.*fashion-mnist-mini"):
        ImageDataModule(dataset="mnist")
    assert {"fashion-mnist-mini", "fashion-mnist", "cifar10", "cifar100", "synthetic",
            "imagefolder"} <= set(DATASETS)  # fmt: skip


def test_static_shape_before_setup_and_split_checked_early():
    dm = ImageDataModule(dataset="cifar100", root="/nonexistent")  # nothing read yet
    assert (dm.num_classes, dm.in_channels, dm.image_size) == (100, 3, 32)
    with pytest.raises(ValueError, match="probe_size"):
        ImageDataModule(probe_size=5000, val_size=3000)  # the mini set has 8000


@pytest.mark.parametrize("dataset, why", [("fashion-mnist-mini", "its images ship inside the package"),
                                          ("synthetic", "its images are generated from seed")])  # fmt: skip
def test_a_root_for_a_dataset_that_reads_no_file_is_an_error(dataset, why):
    """A root given with the embedded (or synthetic) set was meant for files that are never read:
    an error that names root, what it must be, what was given and the fix, not a silent fit on other images."""
    with pytest.raises(ValueError, match=rf"^root: expected None for dataset='{dataset}': {why}, so root would be "
                       r"unused; got '/nonexistent'\. Fix: drop root, or pass the dataset whose files are in "
                       r"'/nonexistent' \(dataset=fashion-mnist, cifar10, cifar100 or imagefolder\)\.$"):  # fmt: skip
        ImageDataModule(dataset=dataset, root="/nonexistent")
    assert ImageDataModule(dataset=dataset, root=None).root is None  # the default stays fine


# --- embedded Fashion-MNIST subset -----------------------------------------------------------
def test_embedded_mini_set():
    d = load_images("fashion-mnist-mini")
    (x, y), (xt, yt) = d["train"], d["test"]
    assert x.shape == (8000, 1, 28, 28) and xt.shape == (2000, 1, 28, 28)
    assert x.dtype == torch.uint8 and y.dtype == torch.int64
    assert d["num_classes"] == 10 and len(d["class_names"]) == 10
    assert torch.bincount(y).tolist() == [800] * 10 and torch.bincount(yt).tolist() == [200] * 10
    dm = ImageDataModule()
    assert (dm.num_classes, dm.in_channels, dm.image_size) == (10, 1, 28)
    assert (len(dm.train_indices), len(dm.probe_indices), len(dm.val_indices)) == (5000, 2000, 1000)


# --- Fashion-MNIST IDX -----------------------------------------------------------------------
def write_idx(path: Path, arr: np.ndarray, compress: bool) -> None:
    magic = 0x00000800 | arr.ndim  # 0x0803 images, 0x0801 labels (type 0x08 = uint8)
    raw = struct.pack(">I", magic) + struct.pack(f">{arr.ndim}I", *arr.shape) + arr.tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_mnist_idx(tmp_path, compress):
    rng = np.random.default_rng(0)
    sfx = ".gz" if compress else ""
    arrays = {"train-images-idx3-ubyte": rng.integers(0, 256, (30, 28, 28), dtype=np.uint8),
              "train-labels-idx1-ubyte": rng.integers(0, 10, 30, dtype=np.uint8),
              "t10k-images-idx3-ubyte": rng.integers(0, 256, (12, 28, 28), dtype=np.uint8),
              "t10k-labels-idx1-ubyte": rng.integers(0, 10, 12, dtype=np.uint8)}  # fmt: skip
    for stem, a in arrays.items():
        write_idx(tmp_path / (stem + sfx), a, compress)
    assert read_idx(tmp_path / ("train-images-idx3-ubyte" + sfx)).shape == (30, 28, 28)
    d = load_images("fashion-mnist", tmp_path)
    x, y = d["train"]
    assert x.shape == (30, 1, 28, 28)
    assert np.array_equal(x[:, 0].numpy(), arrays["train-images-idx3-ubyte"])
    assert y.tolist() == arrays["train-labels-idx1-ubyte"].tolist()
    assert d["test"][0].shape == (12, 1, 28, 28)
    dm = ImageDataModule("fashion-mnist", str(tmp_path), batch_size=8, probe_size=5, val_size=5)
    assert len(dm.train_indices) == 20


def test_idx_corrupt_file(tmp_path):
    bad = tmp_path / "x-idx3-ubyte"
    bad.write_bytes(b"\x12\x34\x08\x03" + b"\0" * 20)
    with pytest.raises(CorruptDatasetError, match="magic"):
        read_idx(bad)
    write_idx(bad, np.zeros((2, 4, 4), np.uint8), compress=False)
    bad.write_bytes(bad.read_bytes()[:-3])  # truncated
    with pytest.raises(CorruptDatasetError, match="truncated"):
        read_idx(bad)


# --- CIFAR pickles ---------------------------------------------------------------------------
def cifar_files(n: int, label_key: str, names_key: str, n_classes: int, splits: dict) -> dict:
    """{filename: pickled bytes} in the official format (bytes keys, N×3072 uint8 rows)."""
    out, rng = {}, np.random.default_rng(0)
    for i, fname in enumerate(splits["train"] + splits["test"]):
        data = rng.integers(0, 256, (n, 3072), dtype=np.uint8)
        data[:, :1024], data[:, 1024:2048], data[:, 2048:] = 10, 20, 30  # R, G, B planes
        data[:, 0] = np.arange(n) + 100 * i  # tag: first red pixel = file/row
        d = {b"data": data, label_key.encode(): [int(v) for v in rng.integers(0, n_classes, n)],
             b"batch_label": fname.encode()}  # fmt: skip
        out[fname] = pickle.dumps(d, protocol=2)
    names = [f"c{k}".encode() for k in range(n_classes)]
    out[splits["meta"]] = pickle.dumps({names_key.encode(): names}, protocol=2)
    return out


CIFAR = {
    "cifar10": dict(dir="cifar-10-batches-py", archive="cifar-10-python.tar.gz",
                    train=[f"data_batch_{i}" for i in range(1, 6)], test=["test_batch"],
                    meta="batches.meta", label_key="labels", names_key="label_names", k=10),
    "cifar100": dict(dir="cifar-100-python", archive="cifar-100-python.tar.gz", train=["train"],
                     test=["test"], meta="meta", label_key="fine_labels",
                     names_key="fine_label_names", k=100),
}  # fmt: skip


@pytest.mark.parametrize("name", ["cifar10", "cifar100"])
@pytest.mark.parametrize("packed", [False, True])
def test_cifar_official_format(tmp_path, name, packed):
    spec = CIFAR[name]
    files = cifar_files(20, spec["label_key"], spec["names_key"], spec["k"], spec)
    if packed:
        with tarfile.open(tmp_path / spec["archive"], "w:gz") as tar:
            for fname, blob in files.items():
                info = tarfile.TarInfo(f"{spec['dir']}/{fname}")
                info.size = len(blob)
                tar.addfile(info, io.BytesIO(blob))
    else:
        (tmp_path / spec["dir"]).mkdir()
        for fname, blob in files.items():
            (tmp_path / spec["dir"] / fname).write_bytes(blob)
    d = load_images(name, tmp_path)
    x, y = d["train"]
    n_train = 20 * len(spec["train"])
    assert x.shape == (n_train, 3, 32, 32) and x.dtype == torch.uint8 and y.dtype == torch.int64
    assert d["test"][0].shape == (20, 3, 32, 32) and d["num_classes"] == spec["k"]
    assert x[0, :, 0, 0].tolist() == [0, 20, 30] and x[1, :, 1, 1].tolist() == [10, 20, 30]
    assert x[:, 0, 0, 0].tolist()[:3] == [0, 1, 2]  # rows kept in file order
    assert d["class_names"][:2] == ["c0", "c1"]
    dm = ImageDataModule(name, root=str(tmp_path), probe_size=10, val_size=5, batch_size=8)
    assert len(dm.train_indices) == n_train - 15 and dm.num_classes == spec["k"]


def test_cifar_pickle_with_code_is_refused(tmp_path):
    spec = CIFAR["cifar10"]
    files = cifar_files(4, spec["label_key"], spec["names_key"], 10, spec)
    files["data_batch_1"] = pickle.dumps(SimpleNamespace(a=1))  # asks for types.SimpleNamespace
    (tmp_path / spec["dir"]).mkdir()
    for fname, blob in files.items():
        (tmp_path / spec["dir"] / fname).write_bytes(blob)
    with pytest.raises(CorruptDatasetError, match="SimpleNamespace"):
        load_images("cifar10", tmp_path)


@pytest.mark.parametrize(
    "name, words",
    [
        ("cifar10", ["cifar-10-batches-py", "cifar-10-python.tar.gz", "https://www.cs.toronto"]),
        ("cifar100", ["cifar-100-python", "cifar-100-python.tar.gz", "download=True"]),
        ("fashion-mnist", ["train-images-idx3-ubyte", "apt-get install dataset-fashion-mnist"]),
        ("imagefolder", ["train/<class>", "root="]),
    ],
)
def test_missing_dataset_says_where_and_how(tmp_path, name, words):
    where = tmp_path / "nowhere"
    with pytest.raises(DatasetNotFoundError) as e:
        load_images(name, where)
    msg = str(e.value)
    assert str(where) in msg and all(w in msg for w in words), msg


# --- batched transforms ----------------------------------------------------------------------
def test_augment_batch_shifts_and_flips():
    B, C, H, W = 64, 2, 6, 7
    x = torch.arange(B * C * H * W, dtype=torch.float32).reshape(B, C, H, W) + 1  # all nonzero
    out = augment_batch(x, pad=4, flip=True, generator=torch.Generator().manual_seed(0))
    assert out.shape == x.shape and out.dtype == x.dtype
    again = augment_batch(x, pad=4, flip=True, generator=torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    padded = torch.nn.functional.pad(x, (4, 4, 4, 4))
    flips = 0
    for b in range(B):  # brute force: every output is one crop of the padded input (maybe flipped)
        matches = [(dy, dx, f) for dy in range(9) for dx in range(9) for f in (False, True)
                   if torch.equal(out[b], (lambda c: c.flip(-1) if f else c)(
                       padded[b, :, dy:dy + H, dx:dx + W]))]  # fmt: skip
        assert matches, f"sample {b} is not a shifted (±4) crop of its input"
        flips += all(f for _, _, f in matches)
    assert 0 < flips < B  # some, not all, flipped
    assert torch.equal(augment_batch(x, pad=0, flip=False), x)


def test_normalize_batch():
    x = torch.tensor([0, 51, 255], dtype=torch.uint8).reshape(1, 1, 1, 3)
    out = normalize_batch(x, (0.2,), (0.5,))
    assert out.dtype == torch.float32
    assert torch.allclose(out.flatten(), torch.tensor([-0.4, 0.0, 1.6]), atol=1e-6)


def test_on_after_batch_transfer_normalises_and_augments_only_in_training():
    dm = small_synthetic()
    x, y = next(iter(dm.train_dataloader()))
    expected = normalize_batch(x, dm.mean, dm.std)
    out, y2 = dm.on_after_batch_transfer((x, y), 0)  # no trainer attached: normalise only
    assert out.dtype == torch.float32 and torch.allclose(out, expected) and y2 is y
    dm.trainer = SimpleNamespace(training=True)
    torch.manual_seed(0)
    aug, _ = dm.on_after_batch_transfer((x, y), 0)
    assert aug.shape == expected.shape and not torch.allclose(aug, expected)
    xf = expected.clone()
    assert dm.on_after_batch_transfer((xf, y), 0)[0] is xf  # float batches pass through


def test_lightning_calls_the_datamodule_hook():
    import lightning

    class Probe(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(3 * 8 * 8, 3))
            self.dtypes = []

        def training_step(self, batch, _):
            x, y = batch
            self.dtypes.append(x.dtype)
            return torch.nn.functional.cross_entropy(self.net(x), y)

        def validation_step(self, batch, _):
            pass  # never runs (limit_val_batches=0): only keeps Lightning from warning about the val loader

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Probe()
    trainer = lightning.Trainer(max_steps=2, logger=False, enable_checkpointing=False,
                                enable_progress_bar=False, enable_model_summary=False,
                                limit_val_batches=0, accelerator="cpu")  # fmt: skip
    trainer.fit(model, datamodule=small_synthetic())
    assert model.dtypes == [torch.float32, torch.float32]


# --- image folders ---------------------------------------------------------------------------
def test_imagefolder(tmp_path):
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 6), ("val", 2)):
        for c, fmt in (("ant", "PNG"), ("bee", "JPEG")):
            (tmp_path / split / c).mkdir(parents=True)
            for i in range(n):
                arr = rng.integers(0, 256, (20 + i, 30, 3), dtype=np.uint8)
                Image.fromarray(arr).save(tmp_path / split / c / f"{i}.{fmt.lower()}", fmt)
    dm = ImageDataModule("imagefolder", root=str(tmp_path), image_size=16, probe_size=2,
                         val_size=2, batch_size=4)  # fmt: skip
    assert (dm.num_classes, dm.in_channels, dm.image_size) == (2, 3, 16)
    assert dm.class_names == ["ant", "bee"]
    x, y = next(iter(dm.train_dataloader()))
    assert x.shape == (4, 3, 16, 16) and x.dtype == torch.uint8 and y.dtype == torch.int64
    xp, _ = next(iter(dm.probe_dataloader()))
    assert xp.shape == (2, 3, 16, 16) and xp.dtype == torch.float32
    ys = torch.cat([y for _, y in dm.test_dataloader()])
    assert sorted(ys.tolist()) == [0, 0, 1, 1]
    # imagefolder crops per sample; the hook only normalises (no pad-crop on top).
    dm.trainer = SimpleNamespace(training=True)
    out = dm.on_after_batch_transfer((x, y), 0)[0]
    assert torch.allclose(out, normalize_batch(x, dm.mean, dm.std))


def test_pure_modules_do_not_import_lightning():
    import growtrain.data as pkg

    folder = Path(pkg.__file__).parent
    for mod in ("formats", "sources", "transforms", "imagefolder", "make_mini"):
        src = (folder / f"{mod}.py").read_text()
        assert "import lightning" not in src and "from lightning" not in src, mod


def test_resume_with_another_split_warns_outside_fit_and_refuses_in_fit():
    dm = small_synthetic()
    state = dm.state_dict()
    small_synthetic().load_state_dict(state)  # same split: silent
    with pytest.warns(UserWarning, match="probe"):
        small_synthetic(seed=3).load_state_dict(state)
    resumed = small_synthetic(seed=3)
    resumed.trainer = SimpleNamespace(state=SimpleNamespace(fn="fit"))
    with pytest.raises(ValueError, match="seed"):
        resumed.load_state_dict(state)
