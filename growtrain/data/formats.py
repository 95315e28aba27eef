"""Readers for the official on-disk formats: IDX (MNIST family) and CIFAR's python pickles.

Pure numpy/stdlib: no torch, no Lightning. Every reader raises `CorruptDatasetError` (a
`ValueError`) that names the file, what was expected, what was found, and how to fix it, so a
truncated download fails at load time with a sentence instead of a reshape error mid-epoch.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import pickle
import tarfile
import urllib.request
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

__all__ = [
    "CorruptDatasetError",
    "DatasetNotFoundError",
    "read_idx",
    "read_cifar_pickle",
    "read_cifar_split",
    "download_url",
    "md5sum",
]


class DatasetNotFoundError(FileNotFoundError):
    """A dataset is not on disk. The message lists every path searched and how to get it."""


class CorruptDatasetError(ValueError):
    """A dataset file exists but is not in the format it claims to be."""


# IDX type codes (third byte of the magic number) -> numpy big-endian dtype.
_IDX_DTYPES = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}


def _open_maybe_gzip(path: Path) -> BinaryIO:
    # Sniff the gzip magic rather than trusting the suffix: people gunzip files and keep names.
    with open(path, "rb") as f:
        head = f.read(2)
    return gzip.open(path, "rb") if head == b"\x1f\x8b" else open(path, "rb")


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (`.gz` or plain) into a numpy array in native byte order.

    Format (http://yann.lecun.com/exdb/mnist/): magic = 0x00 0x00 <type> <ndim>, then `ndim`
    big-endian uint32 dimensions, then the data in C order. Images are 0x00000803
    (uint8, 3-d), labels 0x00000801 (uint8, 1-d).
    """
    path = Path(path)
    try:
        with _open_maybe_gzip(path) as f:
            raw = f.read()
    except (OSError, EOFError) as e:  # truncated gzip stream, unreadable file
        raise CorruptDatasetError(
            f"{path}: could not read the IDX file ({e}). Expected an IDX file, plain or gzip. "
            "Fix: delete it and copy/download it again."
        ) from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise CorruptDatasetError(
            f"{path}: bad IDX magic number {raw[:4].hex() or '(empty file)'}; expected "
            "00 00 <type in 08,09,0b,0c,0d,0e> <ndim> (e.g. 00000803 images, 00000801 labels). "
            "Fix: this is not an IDX file or it is damaged; get the official file again."
        )
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise CorruptDatasetError(
            f"{path}: header says {ndim} dimensions but the file has only {len(raw)} bytes. "
            "Fix: the file is truncated; get it again."
        )
    dims = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
    if len(raw) - header != expected:
        raise CorruptDatasetError(
            f"{path}: header dims {dims} need {expected} data bytes, the file has "
            f"{len(raw) - header}. Fix: the file is truncated or damaged; get it again."
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header).reshape(dims)
    return data.astype(dtype.newbyteorder("="), copy=True)


# --- CIFAR python pickles -------------------------------------------------------------------
# The official files are pickles; unpickling runs arbitrary code, so only the globals a numpy
# array needs are allowed. A file that asks for anything else is refused, not executed.
_ALLOWED_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"),
    ("numpy._core.multiarray", "_reconstruct"),
    ("numpy.core.multiarray", "scalar"),
    ("numpy._core.multiarray", "scalar"),
    ("numpy", "ndarray"),
    ("numpy", "dtype"),
    ("_codecs", "encode"),  # how protocol-2 pickles written by Python 3 store bytes
}


class _SafeUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _ALLOWED_GLOBALS:
            raise CorruptDatasetError(
                f"CIFAR pickle asks for {module}.{name}; expected only plain dicts, lists, bytes "
                "and numpy arrays. Fix: use the official python-version archive."
            )
        return super().find_class(module, name)


def _key(d: dict, name: str, source: str) -> Any:
    # Official files (Python 2 pickles read with encoding="bytes") have bytes keys; files
    # rewritten by Python 3 tools often have str keys. Accept both.
    for k in (name.encode(), name):
        if k in d:
            return d[k]
    raise CorruptDatasetError(
        f"{source}: missing key {name!r}; found keys {sorted(map(repr, d))}. "
        "Fix: expected an official CIFAR python-version file; get the archive again."
    )


def read_cifar_pickle(f: BinaryIO, source: str) -> dict:
    try:
        obj = _SafeUnpickler(f, encoding="bytes").load()
    except CorruptDatasetError:
        raise
    except Exception as e:  # truncated or not a pickle at all
        raise CorruptDatasetError(
            f"{source}: not a readable CIFAR pickle ({type(e).__name__}: {e}). "
            "Fix: get the official python-version archive again."
        ) from e
    if not isinstance(obj, dict):
        raise CorruptDatasetError(f"{source}: expected a pickled dict, got {type(obj).__name__}.")
    return obj


def _decode(names: list) -> list[str]:
    return [n.decode() if isinstance(n, bytes) else str(n) for n in names]


def read_cifar_split(
    files: list[tuple[str, BinaryIO]], label_key: str
) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate CIFAR batch files into (uint8 N×3×32×32, int64 N).

    Each row of `data` is 3072 bytes: the 1024 red, then green, then blue values of a 32×32
    image in row-major order, so a plain reshape gives NCHW.
    """
    xs, ys = [], []
    for source, f in files:
        d = read_cifar_pickle(f, source)
        x = np.asarray(_key(d, "data", source), dtype=np.uint8)
        y = np.asarray(_key(d, label_key, source), dtype=np.int64)
        if x.ndim != 2 or x.shape[1] != 3072 or len(x) != len(y):
            raise CorruptDatasetError(
                f"{source}: expected data of shape (N, 3072) and N labels, got data "
                f"{x.shape} and {len(y)} labels. Fix: get the official archive again."
            )
        xs.append(x.reshape(-1, 3, 32, 32))
        ys.append(y)
    return np.concatenate(xs), np.concatenate(ys)


def read_cifar_meta(f: BinaryIO, source: str, names_key: str) -> list[str]:
    return _decode(list(_key(read_cifar_pickle(f, source), names_key, source)))


class ArchiveReader:
    """Open members of an extracted directory or of a `.tar.gz` by their relative path.

    Reading from the tarball directly means no extraction step (nothing written next to a
    read-only dataset, no path-traversal risk from member names).
    """

    def __init__(self, location: Path):
        self.location = location
        self._tar = tarfile.open(location, "r:*") if location.is_file() else None

    def open(self, relpath: str) -> BinaryIO:
        if self._tar is None:
            path = self.location / relpath
            if not path.is_file():
                raise CorruptDatasetError(
                    f"{self.location}: missing {relpath}. Expected the official extracted "
                    "layout. Fix: extract the official archive again (tar xzf ...)."
                )
            return open(path, "rb")
        try:
            member = self._tar.extractfile(relpath)
        except KeyError:
            member = None
        if member is None:
            raise CorruptDatasetError(
                f"{self.location}: archive has no member {relpath}. Fix: download the official "
                "archive again."
            )
        return io.BytesIO(member.read())

    def close(self) -> None:
        if self._tar is not None:
            self._tar.close()

    def __enter__(self) -> "ArchiveReader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def md5sum(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.md5()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def download_url(url: str, dest: Path, md5: str) -> Path:
    """Download `url` to `dest` atomically (write to `.part`, check md5, rename)."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    part = dest.with_name(dest.name + ".part")
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(part, "wb") as out:
            while block := r.read(1 << 20):
                out.write(block)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise DatasetNotFoundError(
            f"download of {url} failed ({e}). Fix: download it by hand and put it at {dest}."
        ) from e
    got = md5sum(part)
    if got != md5:
        part.unlink(missing_ok=True)
        raise CorruptDatasetError(
            f"{url}: md5 {got}, expected {md5}. Fix: retry; if it persists, download by hand."
        )
    part.replace(dest)
    return dest
