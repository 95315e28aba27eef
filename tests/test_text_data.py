"""TextDataModule: contiguous disjoint splits, determinism, errors, tokenizers (tiny corpora)."""

from __future__ import annotations

import pytest
import torch

from growtrain.data.formats import DatasetNotFoundError
from growtrain.data.text import ByteTokenizer, CharTokenizer, TextDataModule, corpus_files, stdlib_path

TEXT = "def f(x):\n    return x * 2  # héllo ✓\n" * 40  # 1600 characters, non-ASCII included


@pytest.fixture
def corpus(tmp_path):
    """A small directory corpus: two files in a sub-folder order that differs from creation order."""
    root = tmp_path / "corpus"
    (root / "b").mkdir(parents=True)
    (root / "b" / "two.txt").write_text(TEXT[800:], encoding="utf-8")
    (root / "a.txt").write_text(TEXT[:800], encoding="utf-8")
    (root / ".hidden.txt").write_text("never read", encoding="utf-8")
    return root


def make(path, **kw):
    kw = {"block_size": 8, "batch_size": 4, "probe_fraction": 0.1, "val_fraction": 0.1, "test_fraction": 0.1, **kw}
    return TextDataModule(str(path), **kw)


def test_files_are_read_in_sorted_relative_order_and_joined_by_newline(corpus):
    files = corpus_files(corpus)
    assert [f.relative_to(corpus).as_posix() for f in files] == ["a.txt", "b/two.txt"]
    dm = make(corpus)
    assert dm.decode(dm.tokens) == TEXT[:800] + "\n" + TEXT[800:]


@pytest.mark.parametrize("tokenizer", ["char", "byte"])
def test_splits_are_contiguous_disjoint_and_in_order(corpus, tokenizer):
    dm = make(corpus, tokenizer=tokenizer)
    ranges = dm.split_ranges
    assert list(ranges) == ["train", "probe", "val", "test"]
    n = len(dm.tokens)
    bounds = list(ranges.values())
    assert bounds[0][0] == 0 and bounds[-1][1] == n
    for (a0, b0), (a1, b1) in zip(bounds, bounds[1:]):
        assert b0 == a1 and a0 < b0  # contiguous, non-empty, no overlap
    for name, (a, b) in ranges.items():
        ds = dm.dataset(name)
        T = dm.block_size
        assert len(ds) == (b - a) // (T + 1) >= 1
        for i in range(len(ds)):
            x, y = ds[i]
            seq = dm.tokens[a + i * (T + 1) : a + (i + 1) * (T + 1)].long()  # inside its own range
            assert torch.equal(x, seq[:-1]) and torch.equal(y, seq[1:])
            assert x.dtype == y.dtype == torch.int64 and x.shape == (T,)


def test_loaders_yield_int64_batches_and_are_deterministic(corpus):
    a, b = make(corpus, seed=3), make(corpus, seed=3)
    assert torch.equal(a.tokens, b.tokens)
    for split in ("probe_dataloader", "val_dataloader", "test_dataloader"):
        xa, ya = next(iter(getattr(a, split)()))
        xb, yb = next(iter(getattr(b, split)()))
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
        assert xa.dtype == torch.int64 and xa.shape[1] == 8
    la, lb = a.train_dataloader(), b.train_dataloader()
    assert torch.equal(next(iter(la))[0], next(iter(lb))[0])  # same seed, same epoch → same order
    first = [x for x, _ in la]
    la.sampler.set_epoch(1)
    assert not all(torch.equal(x, y) for x, y in zip(first, [x for x, _ in la]))  # new epoch, new order
    # every train sequence once per epoch
    assert sum(len(x) for x in first) == len(a.dataset("train"))


def test_round_trip_byte_and_char_tokenizers(corpus):
    s = "return x  # héllo ✓"
    byte = ByteTokenizer()
    assert byte.decode(byte.encode(s)) == s and byte.vocab_size == 256
    assert len(byte.encode("✓")) == 3  # UTF-8 bytes, not characters
    char = CharTokenizer.from_text(TEXT)
    assert char.decode(char.encode(s)) == s and char.vocab_size == len(set(TEXT))
    dm_char, dm_byte = make(corpus, tokenizer="char"), make(corpus, tokenizer="byte")
    assert dm_char.decode(dm_char.encode(s)) == s and dm_char.vocab_size == len(set(TEXT + "\n"))
    assert dm_byte.decode(dm_byte.encode(s)) == s and dm_byte.vocab_size == 256
    with pytest.raises(ValueError, match="not in this corpus's vocabulary"):
        dm_char.encode("€")


def test_byte_vocab_size_needs_no_reading_and_max_chars_caps(corpus):
    dm = make(corpus, tokenizer="byte", max_chars=500)
    assert dm.vocab_size == 256 and dm._tokens is None
    assert len(dm.tokens) == 500
    assert len(make(corpus, max_chars=700).tokens) == 700


def test_missing_and_empty_corpus_errors_say_where_and_what(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(DatasetNotFoundError, match=r"nope.*does not exist.*text file"):
        make(missing)
    (tmp_path / "empty_dir").mkdir()
    with pytest.raises(DatasetNotFoundError, match=r"no files matching '\*'.*empty_dir"):
        make(tmp_path / "empty_dir")
    (tmp_path / "py_only").mkdir()
    (tmp_path / "py_only" / "a.py").write_text("x = 1\n" * 100)
    with pytest.raises(DatasetNotFoundError, match=r"no files matching '\*\.txt'.*glob="):
        make(tmp_path / "py_only", glob="*.txt")
    empty = tmp_path / "empty.txt"
    empty.write_text("")
    with pytest.raises(ValueError, match=r"empty\.txt is empty"):
        make(empty).setup("fit")


def test_too_small_corpus_and_bad_arguments(corpus):
    with pytest.raises(ValueError, match="probe split.*fewer than one sequence"):
        make(corpus, block_size=200).setup("fit")
    with pytest.raises(ValueError, match="tokenizer"):
        make(corpus, tokenizer="bpe")
    with pytest.raises(ValueError, match="must leave tokens for training"):
        make(corpus, probe_fraction=0.5, val_fraction=0.3, test_fraction=0.2)


def test_stdlib_is_the_default_corpus():
    dm = TextDataModule(block_size=16, max_chars=20_000)
    assert dm.files[0].is_relative_to(stdlib_path())
    assert all(f.suffix == ".py" and "site-packages" not in f.parts for f in dm.files)
    rel = [f.relative_to(stdlib_path()).as_posix() for f in dm.files]
    assert rel == sorted(rel)
    assert len(dm.tokens) == 20_000 and 30 < dm.vocab_size < 200
    assert dm.decode(dm.tokens[:200]) == dm.files[0].read_text(encoding="utf-8", errors="replace")[:200]


def test_state_dict_guards_the_split(corpus):
    dm = make(corpus)
    state = dm.state_dict()
    assert state["vocab"] == dm.codec.vocab
    make(corpus).load_state_dict(state)  # same corpus and split: silent
    with pytest.warns(UserWarning, match="datamodule split"):
        make(corpus, block_size=9).load_state_dict(state)
