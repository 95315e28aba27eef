"""``HFTextDataModule``: ``TextDataModule`` with a Hugging Face tokenizer from a local directory.

A pretrained model must see its own token ids, so ``tokenizer`` may name a local directory
holding a tokenizer (``tokenizer.json`` etc., usually the model directory itself); ``"byte"``
and ``"char"`` work as in ``TextDataModule``. The corpus, splits (contiguous train / probe /
val / test ranges of the token stream) and packing are ``TextDataModule``'s; ``max_chars``
caps the characters read before tokenizing. Nothing downloads.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from growtrain.data.text import TextDataModule, read_corpus, stdlib_path

__all__ = ["HFTextDataModule", "HFTokenizerCodec"]


class HFTokenizerCodec:
    """``encode``/``decode``/``vocab_size`` of a ``transformers`` tokenizer (no special tokens added)."""

    name = "hf"

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self.tokenizer)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        ids = ids.tolist() if isinstance(ids, torch.Tensor) else list(ids)
        return self.tokenizer.decode(ids)


class HFTextDataModule(TextDataModule):
    """Args as ``TextDataModule``, except ``tokenizer``: ``"byte"``, ``"char"`` or a local
    tokenizer directory (e.g. the ``pretrained`` model directory)."""

    def __init__(self, path: str | None = None, block_size: int = 128, batch_size: int = 32, tokenizer: str = "byte",
                 probe_fraction: float = 0.05, val_fraction: float = 0.05, test_fraction: float = 0.05,
                 max_chars: int | None = None, seed: int = 0, num_workers: int = 0,
                 eval_batch_size: int | None = None, glob: str | None = None):  # fmt: skip
        local = tokenizer not in ("byte", "char")
        if local and not Path(tokenizer).expanduser().is_dir():
            raise FileNotFoundError(
                f"tokenizer: expected 'byte', 'char' or a local directory with a Hugging Face tokenizer "
                f"(tokenizer.json / tokenizer_config.json), got {tokenizer!r}, which is not a directory. Nothing is "
                "downloaded: point it at the model directory you loaded the weights from."
            )
        super().__init__(path, block_size, batch_size, "char" if local else tokenizer, probe_fraction, val_fraction,
                         test_fraction, max_chars, seed, num_workers, eval_batch_size, glob)  # fmt: skip
        self.hf_tokenizer = str(Path(tokenizer).expanduser()) if local else None

    def _load(self) -> torch.Tensor:
        if self.hf_tokenizer is None:
            return super()._load()
        if self._tokens is None:
            from transformers import AutoTokenizer

            text = read_corpus(self.files, "char", self.max_chars)
            if len(text) == 0:
                raise ValueError(f"path: the corpus at {self.path or stdlib_path()} is empty; expected non-empty text files")
            codec = HFTokenizerCodec(AutoTokenizer.from_pretrained(self.hf_tokenizer, local_files_only=True))
            ids = codec.encode(text)
            self._tokens = torch.tensor(ids, dtype=torch.int32)
            self._codec = codec
            self._ranges = self._split_ranges(len(self._tokens))
        return self._tokens

    def _split_key(self) -> dict:
        key = super()._split_key()
        if self.hf_tokenizer is not None:
            key["tokenizer"] = f"hf:{Path(self.hf_tokenizer).name}:{self.vocab_size}"
        return key

    def state_dict(self) -> dict:
        if self.hf_tokenizer is None:
            return super().state_dict()
        return {"split": self._split_key()}
