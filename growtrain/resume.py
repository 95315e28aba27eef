"""Resuming a fit: the run folder it continues, and the command that resumes an interrupted one.

- :func:`continue_run_folder`: a fit resumed from ``…/version_N/checkpoints/last.ckpt`` logs on
  into ``version_N/`` (``metrics.csv`` appended, ``growth_history.json`` and the Γ̂ trace
  rewritten there) instead of a new ``version_N+1/`` that would split the run's metrics across
  two folders. growtrain's trainers call it from ``fit`` (the CLI's and the Python API's alike).
- :func:`resume_command` / :func:`interrupted_message`: after Ctrl-C, the exact command that
  resumes the fit (the ``growtrain fit`` command line as given, or ``trainer.fit(...,
  ckpt_path=...)`` from Python); :func:`interrupt_report` gathers their inputs from a trainer.

Nothing here imports ``growtrain.callbacks`` (``callbacks.rng_state`` imports this module, and
``GrowUntilSaturated`` may).
"""

from __future__ import annotations

import csv
import os
import re
import shlex
from pathlib import Path
from typing import Any, Callable, Sequence

from lightning.fabric.loggers.logger import rank_zero_experiment
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.loggers.csv_logs import ExperimentWriter

__all__ = ["continue_run_folder", "run_folder_of", "RunFolderCSVLogger", "resume_command", "interrupted_message",
           "interrupt_report", "latest_checkpoint", "CLI_ARGV_ATTRIBUTE"]  # fmt: skip

# The trainer attribute where GrowtrainCLI keeps the command line it ran (its arguments after
# ``growtrain``), so that a message about the fit can repeat it. Absent: the fit came from Python.
CLI_ARGV_ATTRIBUTE = "growtrain_cli_argv"

_VERSION = re.compile(r"version_(\d+)")


# -- the run folder a resumed fit writes to ------------------------------------------------------
def run_folder_of(ckpt_path: Any) -> tuple[Path, int] | None:
    """``(versions root, N)`` when ``ckpt_path`` is a file in ``<root>/version_N/checkpoints/``
    (where Lightning's default checkpointing puts it), else ``None``."""
    if not isinstance(ckpt_path, (str, os.PathLike)):
        return None
    path = Path(ckpt_path)
    if path.parent.name != "checkpoints":
        return None
    match = _VERSION.fullmatch(path.parent.parent.name)
    return (path.parent.parent.parent, int(match.group(1))) if match else None


def _checkpoint_position(ckpt_path: Any) -> tuple[int, int] | None:
    """``(epoch, global_step)`` the checkpoint was written at, read without loading its tensors
    (``mmap``); ``None`` when it cannot be read (Lightning's own load reports why, later)."""
    try:
        import torch

        checkpoint = torch.load(ckpt_path, map_location="cpu", mmap=True, weights_only=True)
        return int(checkpoint["epoch"]), int(checkpoint["global_step"])
    except Exception:
        return None


class _AppendingWriter(ExperimentWriter):
    """Lightning's CSV writer, which deletes an existing ``metrics.csv`` when it starts; this one
    keeps its rows up to the checkpoint the fit resumes from (``keep``) and appends to them. The
    rows after it (an epoch that was interrupted) are dropped: the resumed fit trains it again."""

    def __init__(self, log_dir: str, keep: Callable[[dict], bool] | None) -> None:
        self._keep = keep
        super().__init__(log_dir)

    def _check_log_dir_exists(self) -> None:
        if not self._fs.isfile(self.metrics_file_path):
            return
        with self._fs.open(self.metrics_file_path, "r", newline="") as file:
            reader = csv.DictReader(file)
            rows, header = list(reader), list(reader.fieldnames or [])
        # the header the file has: new rows append under it (a new key rewrites the file, keeping its rows)
        self.metrics_keys = header
        kept = [row for row in rows if self._keep is None or self._keep(row)]
        if len(kept) != len(rows):
            with self._fs.open(self.metrics_file_path, "w", newline="") as file:
                writer = csv.DictWriter(file, fieldnames=header)
                writer.writeheader()
                writer.writerows(kept)


def _number(value: Any) -> float | None:
    try:
        return float(value) if value not in (None, "") else None
    except (TypeError, ValueError):
        return None


def rows_up_to(epoch: int, step: int) -> Callable[[dict], bool]:
    """``keep(row)`` for ``metrics.csv`` rows written no later than a checkpoint at ``(epoch,
    step)``: Lightning writes an ``epoch`` column with every ``self.log`` row and a ``step``
    column with every row (the growth checks' rows have the step only)."""

    def keep(row: dict) -> bool:
        row_epoch, row_step = _number(row.get("epoch")), _number(row.get("step"))
        return (row_epoch is None or row_epoch <= epoch) and (row_step is None or row_step <= step)

    return keep


class RunFolderCSVLogger(CSVLogger):
    """A ``CSVLogger`` that continues an existing ``version_N/`` folder: its ``metrics.csv`` is
    appended to (rows after ``resume_at = (epoch, global_step)`` dropped), not deleted."""

    def __init__(self, *args: Any, resume_at: tuple[int, int] | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resume_at = resume_at

    @property
    @rank_zero_experiment  # as CSVLogger's: a stand-in that does nothing on the other ranks
    def experiment(self) -> ExperimentWriter:  # type: ignore[override]
        if self._experiment is not None:
            return self._experiment
        self._fs.makedirs(self.root_dir, exist_ok=True)
        keep = rows_up_to(*self.resume_at) if self.resume_at is not None else None
        self._experiment = _AppendingWriter(log_dir=self.log_dir, keep=keep)
        return self._experiment


def continue_run_folder(trainer: Any, ckpt_path: Any) -> Path | None:
    """Make ``trainer`` log into the run folder that holds ``ckpt_path``; returns that folder.

    Only the run's latest checkpoint (its ``metrics.csv`` holds nothing after the epoch that
    followed it: at most the interrupted one, which is trained again) in
    ``<root>/version_N/checkpoints/`` and a ``CSVLogger`` (Lightning's default when TensorBoard
    is not installed, as with growtrain) writing versions under the same ``<root>`` with an
    automatic version (``version=None``) qualify; its version becomes N. Any other case is left
    as it is (``None``, a new ``version_N+1/``): an earlier checkpoint of the run (a branch), a
    checkpoint that cannot be read, a logger with a version of its own, another logger type, a
    checkpoint copied elsewhere.
    """
    found = run_folder_of(ckpt_path)
    position = _checkpoint_position(ckpt_path) if found is not None else None
    if found is None or position is None:
        return None
    root, version = found
    if _logged_past(root / f"version_{version}" / "metrics.csv", epoch=position[0] + 1):
        return None  # an earlier checkpoint than the run's last: a new branch, in a new folder (nothing is deleted)
    loggers = list(getattr(trainer, "loggers", []) or [])
    for i, logger in enumerate(loggers):
        if (type(logger) is not CSVLogger or logger._version is not None or logger._experiment is not None
                or os.path.abspath(logger.root_dir) != os.path.abspath(root)):  # fmt: skip
            continue
        loggers[i] = RunFolderCSVLogger(
            save_dir=logger.save_dir, name=logger.name, version=version, prefix=logger._prefix,
            flush_logs_every_n_steps=logger._flush_logs_every_n_steps, resume_at=position,
        )  # fmt: skip
        trainer.loggers = loggers
        return Path(loggers[i].log_dir)
    return None


def _logged_past(metrics: Path, epoch: int) -> bool:
    """Does ``metrics`` (a ``metrics.csv``) hold rows of an epoch after ``epoch``? Then the fit
    went on past the checkpoint's next epoch, and resuming from it is not resuming the run."""
    try:
        with open(metrics, newline="") as file:
            return any((_number(row.get("epoch")) or 0) > epoch for row in csv.DictReader(file))
    except OSError:
        return False


# -- the command that resumes an interrupted fit -------------------------------------------------
def resume_command(argv: Sequence[str] | None, ckpt_path: str | None) -> str:
    """The command that resumes a fit from ``ckpt_path``.

    ``argv``: the ``growtrain`` command line's arguments as the user gave them (``["fit",
    "--config", "configs/quickstart.yaml", ...]``): the same command, any earlier ``--ckpt_path``
    replaced. ``None``: the fit came from Python; the ``trainer.fit`` call. ``ckpt_path=None``:
    nothing to resume from; the command that starts the fit again."""
    if argv is None:
        where = f", ckpt_path={str(ckpt_path)!r}" if ckpt_path else ""
        return f"trainer.fit(model, datamodule=datamodule{where})"
    tokens, skip = [], False
    for token in map(str, argv):
        if skip:
            skip = False
            continue
        if token == "--ckpt_path":
            skip = True
            continue
        if token.startswith("--ckpt_path="):
            continue
        tokens.append(token)
    if ckpt_path:
        tokens += ["--ckpt_path", str(ckpt_path)]
    return "growtrain " + shlex.join(tokens)


def interrupted_message(*, epoch: int, argv: Sequence[str] | None, ckpt_path: str | None,
                        saved: dict | None = None, run_folder: str | None = None,
                        same_folder: bool = False) -> str:  # fmt: skip
    """What a user reads after Ctrl-C: where the fit stopped and the command that resumes it.

    ``saved``: where the checkpoint was written (``{"epoch", "global_step", "at_epoch_end"}``, as
    :class:`growtrain.callbacks.RandomStateCheckpoint` records it), or ``None`` when no random
    state went into it; ``run_folder``: the fit's log folder; ``same_folder``: the trainer
    resumes into the checkpoint's own run folder (growtrain's trainers do)."""
    command = resume_command(argv, ckpt_path)
    head = f"growtrain: the fit was interrupted (Ctrl-C) in epoch {epoch}."
    if not ckpt_path:
        how = ("no checkpoint was written yet (a ModelCheckpoint with save_last=True writes last.ckpt at the end of "
               "every epoch), so it cannot be resumed; start it again with:")  # fmt: skip
        return f"{head} {how}\n  {command}"
    if saved is not None and saved.get("at_epoch_end"):
        position = f" (written at the end of epoch {saved['epoch']}, step {saved['global_step']})"
    elif saved is not None:
        position = f" (written in epoch {saved['epoch']}, at step {saved['global_step']})"
    else:
        position = ""
    how = "run:" if argv is not None else "fit a trainer built as this one on the same model and data:"
    lines = [f"{head} To resume it from its latest checkpoint{position}, {how}", f"  {command}"]
    folder = f"writes on into {run_folder}{os.sep} (metrics.csv continues)" if same_folder and run_folder else None
    if saved is not None and saved.get("at_epoch_end"):
        state = ("restores the random state saved in the checkpoint: it trains on the batches the uninterrupted fit "
                 "would have, so it makes the same growth checks")  # fmt: skip
    elif saved is None:
        state = ("cannot restore the random state (the checkpoint holds none; growtrain's trainers add "
                 "growtrain.callbacks.RandomStateCheckpoint, which saves it): it trains on other batches than the "
                 "uninterrupted fit would have, and its later growth checks may differ")  # fmt: skip
    else:  # a mid-epoch checkpoint: Lightning restarts that epoch's batches, so no promise about them
        state = None
    said = " and ".join(part for part in (folder, state) if part)
    if said:
        lines.append(f"The resumed fit {said}.")
    return "\n".join(lines)


def latest_checkpoint(trainer: Any) -> str | None:
    """The checkpoint a resume continues from: a checkpoint callback's ``last.ckpt`` or, from one
    without ``monitor`` (Lightning's default ``ModelCheckpoint`` keeps just its latest save,
    ``epoch=N-step=M.ckpt``), its latest save; ``None`` when nothing was saved yet."""
    for cb in getattr(trainer, "checkpoint_callbacks", []) or []:
        if getattr(cb, "last_model_path", ""):
            return cb.last_model_path
    for cb in getattr(trainer, "checkpoint_callbacks", []) or []:
        # with a monitor the best save may be an older one: resuming from it would train epochs again
        if getattr(cb, "monitor", "set") is None and getattr(cb, "best_model_path", ""):
            return cb.best_model_path
    return None


def interrupt_report(trainer: Any) -> str:
    """:func:`interrupted_message` for ``trainer`` as it stands after Ctrl-C: its latest checkpoint
    (:func:`latest_checkpoint`), the CLI command line it ran (if any),
    what its :class:`~growtrain.callbacks.RandomStateCheckpoint` recorded. No collective: safe to
    call on rank 0 alone."""
    ckpt_path = latest_checkpoint(trainer)
    saved = next((cb.last_save for cb in trainer.callbacks if getattr(cb, "last_save", None) is not None), None)
    loggers = getattr(trainer, "loggers", []) or []
    run_folder = getattr(loggers[0], "log_dir", None) if loggers else None
    argv = getattr(trainer, CLI_ARGV_ATTRIBUTE, None)
    # continue_run_folder's rule, as far as it can be told now: the checkpoint is the one of the epoch before
    latest = saved is not None and saved.get("epoch") is not None and saved["epoch"] >= trainer.current_epoch - 1
    same = bool(getattr(trainer, "continues_run_folder", False)) and latest and ckpt_path is not None \
        and run_folder is not None and run_folder_of(ckpt_path) is not None \
        and os.path.abspath(Path(ckpt_path).parent.parent) == os.path.abspath(run_folder)  # fmt: skip
    return interrupted_message(epoch=trainer.current_epoch, argv=argv, ckpt_path=ckpt_path, saved=saved,
                               run_folder=run_folder, same_folder=same)  # fmt: skip
