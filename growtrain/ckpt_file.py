"""Is a checkpoint file complete? A clear error naming the file, instead of torch's bare
``OSError('[Errno 22] Invalid argument')`` or ``PytorchStreamReader failed ...``.

:func:`checkpoint_problem` reads only the file's first bytes and, for torch's zip format, its
central directory (at the end of the file, so a truncated copy has none). It is called before
``load_from_checkpoint`` and ``growtrain measure|match`` load a file, and, for
``trainer.fit(ckpt_path=...)``, by :class:`CheckpointFileCheck` when the load failed.
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

from lightning.pytorch import Callback

__all__ = ["checkpoint_problem", "check_checkpoint_file", "CheckpointFileCheck"]

_FIX = ("Fix: point ckpt_path at a complete checkpoint (e.g. another file in the same checkpoints/ folder); a copy "
        "interrupted while being written or transferred is truncated.")  # fmt: skip


def checkpoint_problem(path: str | os.PathLike) -> str | None:
    """Why ``path`` is not a complete torch checkpoint, or ``None`` when it looks complete (or is
    not a local file: remote paths are left to their loader)."""
    p = Path(path)
    if not p.is_file():
        return None
    size = p.stat().st_size
    where = f"ckpt_path: {str(p)!r} ({size} bytes)"
    if size == 0:
        return f"{where} is empty, not a checkpoint. {_FIX}"
    with open(p, "rb") as f:
        head = f.read(4)
    if head == b"PK\x03\x04":  # torch.save's zip format
        if not zipfile.is_zipfile(p):
            return f"{where} is not a complete checkpoint: the file is truncated (its zip directory is missing). {_FIX}"
        try:
            with zipfile.ZipFile(p) as archive:
                names = archive.namelist()
        except (zipfile.BadZipFile, OSError) as err:
            return f"{where} is not a complete checkpoint: {err}. {_FIX}"
        if not any(name.endswith("data.pkl") for name in names):
            return f"{where} is a zip file but not a torch checkpoint (no data.pkl). {_FIX}"
        return None
    if head[:1] == b"\x80":  # torch's legacy (pickle) format: left to torch.load
        return None
    return f"{where} is not a torch checkpoint (it starts with {head!r}). {_FIX}"


def check_checkpoint_file(path: str | os.PathLike) -> None:
    """Raise ``ValueError`` naming ``path`` when it is not a complete checkpoint."""
    problem = checkpoint_problem(path)
    if problem is not None:
        raise ValueError(problem)


class CheckpointFileCheck(Callback):
    """Turns a failed ``trainer.fit|validate|test(ckpt_path=...)`` load of an incomplete file into
    a ``ValueError`` that names the file (``GrowableModuleMixin`` adds it through
    ``configure_callbacks``). Lightning exposes the path only once it starts loading, so the file
    is examined when the load failed; any other error is left as it is."""

    def on_exception(self, trainer, pl_module, exception: BaseException) -> None:
        path = getattr(trainer, "ckpt_path", None)
        if not path or isinstance(exception, (KeyboardInterrupt, ValueError)):
            return
        problem = checkpoint_problem(path)
        if problem is not None:
            raise ValueError(problem) from exception
