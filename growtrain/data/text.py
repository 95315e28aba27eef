"""Character- or byte-level language-model data from plain text files, with a probe split.

Corpus. ``path=None`` uses the **Python standard library's own source files**
(``sysconfig.get_paths()["stdlib"]``, every ``*.py`` below it, skipping ``site-packages``,
``dist-packages``, ``__pycache__`` and hidden folders): a real, license-clean text corpus
present wherever Python is (about 30 MB for CPython 3.11; its exact content depends on the
installed Python version). ``path`` may also be one text file or a directory, read
recursively (files matching ``glob``, default every file).

Order. Files are read in **sorted order of their path relative to the root** (POSIX
separators, plain string order), concatenated with one ``"\\n"`` between files, and cut at
``max_chars`` tokens (the first ``max_chars`` characters, or bytes with the byte tokenizer).
Only files up to the cap are read, so a capped corpus loads fast.

Tokens. ``tokenizer="byte"``: the UTF-8 bytes, vocabulary 256 (no corpus needed to know it).
``tokenizer="char"``: Unicode code points (files decoded as UTF-8, undecodable bytes replaced
by U+FFFD), vocabulary = the sorted distinct characters of the (capped) corpus.

Splits. The token stream is cut into **contiguous, non-overlapping ranges in the order train /
probe / val / test** (sizes ``1 - probe - val - test``, ``probe_fraction``, ``val_fraction``,
``test_fraction`` of the tokens, rounded down, train takes the rest). Each range is packed into
non-overlapping sequences of ``block_size + 1`` tokens (a ragged tail is dropped); a sequence
gives ``x = seq[:-1]``, ``y = seq[1:]``, both ``(T,) int64``. Contiguous ranges keep the probe
out of training (no sequence straddles two splits), which the growth certificate requires.
The splits do not depend on ``seed``; ``seed`` only fixes the train shuffle (a fresh
permutation per epoch, ``seed`` and the epoch number determine it, so a resumed run continues
the same order).
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from fnmatch import fnmatch
from pathlib import Path
from typing import Iterator, Literal, Sequence

import lightning
import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, Sampler

from .datamodule import check_resumed_split
from .formats import DatasetNotFoundError

__all__ = [
    "TextDataModule",
    "ByteTokenizer",
    "CharTokenizer",
    "PackedSequences",
    "corpus_files",
    "read_corpus",
    "stdlib_path",
]

SKIP_DIRS = ("site-packages", "dist-packages", "__pycache__")


# -- tokenizers ------------------------------------------------------------------------------
class ByteTokenizer:
    """UTF-8 bytes as tokens; vocabulary 256."""

    name = "byte"
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return bytes(ids).decode("utf-8", errors="replace")


class CharTokenizer:
    """Unicode characters as tokens; token ``i`` is ``vocab[i]`` (sorted by code point)."""

    name = "char"

    def __init__(self, vocab: str):
        if not vocab:
            raise ValueError("vocab: expected at least one character")
        if list(vocab) != sorted(set(vocab)):
            raise ValueError("vocab: expected distinct characters in code-point order")
        self.vocab = vocab
        self._index = {ch: i for i, ch in enumerate(vocab)}

    @classmethod
    def from_text(cls, text: str) -> "CharTokenizer":
        return cls("".join(sorted(set(text))))

    @property
    def vocab_size(self) -> int:
        return len(self.vocab)

    def encode(self, text: str) -> list[int]:
        try:
            return [self._index[ch] for ch in text]
        except KeyError:
            unknown = sorted({ch for ch in text if ch not in self._index})
            raise ValueError(
                f"text: characters {unknown[:10]!r}{' …' if len(unknown) > 10 else ''} are not in this "
                f"corpus's vocabulary of {self.vocab_size} characters; use tokenizer='byte' for arbitrary text"
            ) from None

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return "".join(self.vocab[i] for i in ids)


# -- corpus ----------------------------------------------------------------------------------
def stdlib_path() -> Path:
    """The standard library's source directory of the running Python."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(path: str | os.PathLike | None = None, glob: str | None = None) -> list[Path]:
    """The files of a corpus, in the documented order (sorted relative POSIX paths).

    ``path=None``: the stdlib's ``*.py`` files. A file: itself. A directory: every file below
    it whose name matches ``glob`` (default ``*``), skipping hidden entries,
    ``site-packages``, ``dist-packages`` and ``__pycache__``.
    """
    if path is None:
        root, glob = stdlib_path(), glob or "*.py"
        where = f"the Python standard library at {root} (path=None)"
    else:
        root = Path(path).expanduser()
        glob = glob or "*"
        where = str(root)
    if not root.exists():
        raise DatasetNotFoundError(
            f"path: {where} does not exist. Expected a text file, or a directory whose files matching "
            f"{glob!r} are the corpus; pass path=/path/to/corpus (or path=None for the stdlib)."
        )
    if root.is_file():
        return [root]
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not d.startswith(".") and d not in SKIP_DIRS]
        for f in filenames:
            if not f.startswith(".") and fnmatch(f, glob):
                found.append(Path(dirpath) / f)
    found.sort(key=lambda p: p.relative_to(root).as_posix())
    if not found:
        raise DatasetNotFoundError(
            f"path: found no files matching {glob!r} under {where} (searched recursively, hidden folders, "
            f"{', '.join(SKIP_DIRS)} skipped). Expected text files there; pass glob='*.txt' (or the "
            "pattern your files use), or point path at a single text file."
        )
    return found


def read_corpus(
    files: Sequence[Path], tokenizer: Literal["char", "byte"] = "char", max_chars: int | None = None
) -> str | bytes:
    """The files' contents joined by ``"\\n"``, cut at ``max_chars`` (characters, or bytes for
    ``tokenizer="byte"``); stops reading once the cap is reached."""
    parts, total = [], 0
    sep = b"\n" if tokenizer == "byte" else "\n"
    for k, f in enumerate(files):
        raw = f.read_bytes()
        piece = raw if tokenizer == "byte" else raw.decode("utf-8", errors="replace")
        if k:
            parts.append(sep)
            total += 1
        parts.append(piece)
        total += len(piece)
        if max_chars is not None and total >= max_chars:
            break
    text = sep[:0].join(parts)
    return text if max_chars is None else text[:max_chars]


def _encode_fast(text: str | bytes, tokenizer: str) -> tuple[torch.Tensor, CharTokenizer | ByteTokenizer]:
    """Whole-corpus encoding with numpy (a Python loop over 30M characters would take minutes)."""
    if tokenizer == "byte":
        return torch.from_numpy(np.frombuffer(text, dtype=np.uint8).copy()), ByteTokenizer()
    points = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)  # one code point per char
    present = np.bincount(points) > 0  # (max code point + 1,): linear time, unlike a sort
    vocab = np.flatnonzero(present)  # sorted distinct code points
    dtype = np.int16 if len(vocab) < 2**15 else np.int32
    lookup = (np.cumsum(present) - 1).astype(dtype)  # code point -> token id
    codec = CharTokenizer("".join(map(chr, vocab.tolist())))
    return torch.from_numpy(lookup[points]), codec


# -- datasets --------------------------------------------------------------------------------
class PackedSequences(Dataset):
    """Non-overlapping sequences of ``block_size + 1`` tokens from a 1-D token range.

    Item ``i`` is ``(x, y)``: tokens ``[i·(T+1), (i+1)·(T+1))`` split into ``x = seq[:-1]`` and
    ``y = seq[1:]``, both ``(T,) int64``.
    """

    def __init__(self, tokens: torch.Tensor, block_size: int):
        n = len(tokens) // (block_size + 1)
        self.block_size = block_size
        self.rows = tokens[: n * (block_size + 1)].view(n, block_size + 1)  # (n, T+1), a view

    def __len__(self) -> int:
        return self.rows.shape[0]

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        row = self.rows[i].long()  # (T+1,)
        return row[:-1], row[1:]

    def __getitems__(self, idx: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        # DataLoader passes the sampler's whole batch (torch >= 2.1): one gather per batch.
        rows = self.rows[torch.as_tensor(idx, dtype=torch.long)].long()  # (B, T+1)
        return rows[:, :-1], rows[:, 1:]


def _collate(batch):
    if isinstance(batch, tuple) and len(batch) == 2 and isinstance(batch[0], torch.Tensor):
        return batch  # __getitems__ already built (x, y)
    xs, ys = zip(*batch)
    return torch.stack(xs), torch.stack(ys)


class EpochShuffle(Sampler[int]):
    """A permutation per epoch from ``(seed, epoch)``; Lightning calls ``set_epoch``."""

    def __init__(self, n: int, seed: int):
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __iter__(self) -> Iterator[int]:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.epoch)
        return iter(torch.randperm(self.n, generator=g).tolist())

    def __len__(self) -> int:
        return self.n


# -- datamodule ------------------------------------------------------------------------------
class TextDataModule(lightning.LightningDataModule):
    """Train / probe / val / test loaders of packed token sequences from a text corpus.

    Args:
        path: a text file or a directory (read recursively); ``None`` = the Python standard
            library's ``*.py`` sources (see the module docstring for order and filtering).
        block_size: tokens per training sequence ``T`` (the model's context).
        batch_size: train sequences per batch.
        tokenizer: ``"char"`` (vocabulary from the corpus) or ``"byte"`` (UTF-8 bytes, 256).
        probe_fraction, val_fraction, test_fraction: fractions of the tokens for the probe
            (scored by ``measure_saturation``, never trained on), validation and test ranges.
        max_chars: keep only the first ``max_chars`` tokens (characters or bytes) of the corpus.
        seed: seed of the train shuffle; the splits are contiguous and do not depend on it.
        num_workers: DataLoader workers (0 is right: a batch is one tensor gather).
        eval_batch_size: batch size of val/test/probe loaders (default ``batch_size``).
        glob: file-name pattern for directories (default ``*.py`` for the stdlib, ``*`` else).

    ``vocab_size`` is known right after construction (byte: 256 without reading; char: reads
    the corpus once, cached), so a CLI can link it into the model.
    """

    def __init__(
        self,
        path: str | None = None,
        block_size: int = 128,
        batch_size: int = 32,
        tokenizer: Literal["char", "byte"] = "char",
        probe_fraction: float = 0.05,
        val_fraction: float = 0.05,
        test_fraction: float = 0.05,
        max_chars: int | None = None,
        seed: int = 0,
        num_workers: int = 0,
        eval_batch_size: int | None = None,
        glob: str | None = None,
    ):
        super().__init__()
        self.save_hyperparameters()
        if tokenizer not in ("char", "byte"):
            raise ValueError(f"tokenizer: expected 'char' or 'byte', got {tokenizer!r}")
        for arg, v, lo in (("block_size", block_size, 1), ("batch_size", batch_size, 1),
                           ("max_chars", max_chars, 1), ("num_workers", num_workers, 0),
                           ("eval_batch_size", eval_batch_size, 1)):  # fmt: skip
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < lo):
                raise ValueError(f"{arg}: expected an integer ≥ {lo}, got {v!r}")
        fractions = {"probe_fraction": probe_fraction, "val_fraction": val_fraction, "test_fraction": test_fraction}
        for arg, v in fractions.items():
            if not (isinstance(v, (int, float)) and 0.0 <= v < 1.0):
                raise ValueError(f"{arg}: expected a fraction of the tokens in [0, 1), got {v!r}")
        if sum(fractions.values()) >= 1.0:
            raise ValueError(
                f"probe_fraction + val_fraction + test_fraction: must leave tokens for training (< 1), got "
                f"{sum(fractions.values())}"
            )
        self.path, self.block_size, self.batch_size = path, block_size, batch_size
        self.eval_batch_size = eval_batch_size or batch_size
        self.tokenizer, self.max_chars, self.seed, self.num_workers = tokenizer, max_chars, seed, num_workers
        self.fractions = (float(probe_fraction), float(val_fraction), float(test_fraction))
        self.glob = glob
        self._tokens: torch.Tensor | None = None
        self._digest: str | None = None
        self._codec: CharTokenizer | ByteTokenizer | None = ByteTokenizer() if tokenizer == "byte" else None
        # Find the files now: a wrong path fails at construction, not at the first epoch.
        self.files = corpus_files(path, glob)

    # -- corpus and vocabulary -----------------------------------------------------------
    def _load(self) -> torch.Tensor:
        if self._tokens is None:
            text = read_corpus(self.files, self.tokenizer, self.max_chars)
            if len(text) == 0:
                raise ValueError(
                    f"path: the corpus at {self.path or stdlib_path()} is empty (0 {self.tokenizer}s in "
                    f"{len(self.files)} file(s)). Expected non-empty text files."
                )
            self._tokens, self._codec = _encode_fast(text, self.tokenizer)
            self._ranges = self._split_ranges(len(self._tokens))
        return self._tokens

    @property
    def codec(self) -> CharTokenizer | ByteTokenizer:
        """The tokenizer object (``encode(str) -> list[int]``, ``decode(ids) -> str``)."""
        if self._codec is None:
            self._load()
        return self._codec

    @property
    def vocab_size(self) -> int:
        return self.codec.vocab_size

    def encode(self, text: str) -> list[int]:
        return self.codec.encode(text)

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        return self.codec.decode(ids)

    @property
    def tokens(self) -> torch.Tensor:
        """The whole token stream, 1-D (uint8 / int16 / int32 storage)."""
        return self._load()

    def _split_ranges(self, n: int) -> dict[str, tuple[int, int]]:
        probe, val, test = (int(f * n) for f in self.fractions)
        train = n - probe - val - test
        bounds, start = {}, 0
        for name, size in (("train", train), ("probe", probe), ("val", val), ("test", test)):
            bounds[name] = (start, start + size)
            start += size
        seq = self.block_size + 1
        for name, (a, b) in bounds.items():
            wanted = name == "train" or self.fractions[("probe", "val", "test").index(name)] > 0
            if wanted and b - a < seq:
                raise ValueError(
                    f"{name} split: {b - a} tokens, fewer than one sequence of block_size + 1 = {seq}; the corpus "
                    f"has {n} tokens. Raise max_chars (or use a larger corpus), lower block_size, or raise "
                    f"{name + '_fraction' if name != 'train' else 'the train share'}."
                )
        return bounds

    @property
    def split_ranges(self) -> dict[str, tuple[int, int]]:
        """Token ranges ``[start, end)`` of train / probe / val / test, contiguous, in that order."""
        self._load()
        return dict(self._ranges)

    def dataset(self, split: Literal["train", "probe", "val", "test"]) -> PackedSequences:
        if split not in ("train", "probe", "val", "test"):
            raise ValueError(f"split: expected one of 'train', 'probe', 'val', 'test', got {split!r}")
        tokens = self._load()
        a, b = self._ranges[split]
        return PackedSequences(tokens[a:b], self.block_size)

    # -- Lightning -----------------------------------------------------------------------
    def setup(self, stage: str | None = None) -> None:
        self._load()

    def _loader(self, split: str) -> DataLoader:
        ds = self.dataset(split)
        train = split == "train"
        return DataLoader(
            ds,
            batch_size=self.batch_size if train else self.eval_batch_size,
            sampler=EpochShuffle(len(ds), self.seed) if train else None,
            collate_fn=_collate,
            num_workers=self.num_workers,
            persistent_workers=self.num_workers > 0,
        )

    def train_dataloader(self) -> DataLoader:
        """Shuffled train sequences; yields ``(x (B, T) int64, y (B, T) int64)``."""
        return self._loader("train")

    def val_dataloader(self) -> DataLoader:
        return self._loader("val")

    def test_dataloader(self) -> DataLoader:
        return self._loader("test")

    def probe_dataloader(self) -> DataLoader:
        """The probe sequences in a fixed order: ready for ``measure_saturation(network, loader,
        LanguageModel.probe_loss)`` outside Lightning."""
        if self.fractions[0] == 0:
            raise ValueError("probe_fraction: it is 0, so there is no probe split; set e.g. probe_fraction=0.05")
        return self._loader("probe")

    # -- checkpoints: a resumed run must keep the same probe -----------------------------
    def _split_key(self) -> dict:
        tokens = self._load()
        if self._digest is None:
            self._digest = hashlib.sha1(tokens.numpy().tobytes()).hexdigest()
        return {
            "tokenizer": self.tokenizer,
            "block_size": self.block_size,
            "fractions": list(self.fractions),
            "n_tokens": len(tokens),
            "sha1": self._digest,
        }

    def state_dict(self) -> dict:
        state = {"split": self._split_key()}
        if self.tokenizer == "char":
            state["vocab"] = self.codec.vocab  # to decode a checkpoint's samples without the corpus
        return state

    def load_state_dict(self, state_dict: dict) -> None:
        check_resumed_split(
            self, state_dict.get("split"), "tokens", "path, tokenizer, max_chars, block_size and fractions"
        )
