"""Progress of a growth check's long phases in Lightning's own progress bar.

A check runs at the end of a training epoch, after the epoch's bar reached its last batch; the
probe pass over every candidate site and the block-only trials (up to 3 sites, 100+ steps each)
then take 15–20 s on a small CPU run, during which the bar would sit frozen at "15/15". Each
phase shows the way Lightning shows validation inside ``fit``: under the training bar, a task of
its own with the batches or steps done ("trial layer2.1 (1/3): train block  120/200"), removed
when the phase ends.

* ``RichProgressBar`` (Lightning's default when rich is installed): a task in its live display
  (rich's public ``Progress.add_task`` / ``update`` / ``remove_task``);
* ``TQDMProgressBar``: a nested ``Tqdm`` one line below the training bar, built like its
  validation bar (``leave=False``: it disappears when the phase ends);
* nothing when progress bars are off (``trainer.progress_bar_callback`` is ``None``, e.g.
  ``enable_progress_bar=False``, or the bar is disabled), on ranks other than 0 (Lightning's
  bars are off there too), or with another ``ProgressBar`` class (where it draws is its own).

:func:`progress_for` returns a :class:`Steps` (``step(done, total, what)`` and ``close()``) or a
no-op with the same interface, so callers never branch; :func:`counted` reports the batches of
any iterable (a probe loader) through one.
"""

from __future__ import annotations

import math
import sys
from typing import Any, Iterable, Iterator

__all__ = ["Steps", "NO_PROGRESS", "progress_for", "counted"]


class Steps:
    """``step(done, total, what)``: ``done`` of ``total`` (``None``: unknown) units of the phase
    ``what``; a new ``what`` ends the previous phase's display and starts its own. ``close()``
    ends the current one (also usable as a context manager). This base class shows nothing."""

    def __call__(self, done: int, total: int | None, what: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> "Steps":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


NO_PROGRESS = Steps()


class _RichSteps(Steps):
    """A task in a ``RichProgressBar``'s live display, below the training task."""

    def __init__(self, bar: Any):
        self.bar, self.task, self.what = bar, None, None

    def __call__(self, done: int, total: int | None, what: str) -> None:
        progress = self.bar.progress
        if progress is None:  # the bar's display is not running (stopped, or never started)
            return
        if what != self.what:
            self.close()
            # an unknown total is Lightning's infinite task (its CustomProgress refuses None)
            self.task = progress.add_task(what, total=float("inf") if total is None else total)
            self.what = what
        progress.update(self.task, completed=done)
        self.bar.refresh()

    def close(self) -> None:
        progress = self.bar.progress
        if self.task is not None and progress is not None:
            progress.remove_task(self.task)
            self.bar.refresh()
        self.task = self.what = None


class _TqdmSteps(Steps):
    """A nested ``Tqdm`` under a ``TQDMProgressBar``'s training bar (its validation bar's place)."""

    def __init__(self, bar: Any):
        self.bar, self.pbar, self.what = bar, None, None

    def __call__(self, done: int, total: int | None, what: str) -> None:
        from lightning.pytorch.callbacks.progress.tqdm_progress import Tqdm

        if what != self.what:
            self.close()
            self.pbar = Tqdm(desc=what, total=total, position=2 * self.bar.process_position + 1,
                             disable=self.bar.is_disabled, leave=False, dynamic_ncols=True, file=sys.stdout,
                             bar_format=self.bar.BAR_FORMAT)  # fmt: skip
            self.what = what
        self.pbar.update(done - self.pbar.n)  # tqdm's own throttle (mininterval) decides when to redraw

    def close(self) -> None:
        if self.pbar is not None:
            self.pbar.close()
        self.pbar = self.what = None


def progress_for(trainer: Any) -> Steps:
    """The :class:`Steps` that shows a check's phases in ``trainer``'s progress bar, or
    :data:`NO_PROGRESS` where nothing must be shown (no bar, a disabled bar, a rank other than 0,
    a bar class this module does not know)."""
    from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

    bar = getattr(trainer, "progress_bar_callback", None)
    if bar is None or not getattr(trainer, "is_global_zero", True) or not getattr(bar, "is_enabled", False):
        return NO_PROGRESS
    if isinstance(bar, RichProgressBar):
        return _RichSteps(bar)
    if isinstance(bar, TQDMProgressBar):
        return _TqdmSteps(bar)
    return NO_PROGRESS


def _length(iterable: Any) -> int | None:
    """Batches in ``iterable``: its ``len``, else that of the loader it wraps (``Converted``,
    ``counted``: ``.loader``), else ``None``."""
    for _ in range(8):  # a short chain of wrappers, never a cycle
        try:
            n = len(iterable)
            return n if isinstance(n, int) and math.isfinite(n) else None
        except TypeError:
            iterable = getattr(iterable, "loader", None)
            if iterable is None:
                return None
    return None


class counted:  # noqa: N801 - used like the iterable wrappers it stands beside (tqdm(...), Converted(...))
    """Iterates ``iterable`` unchanged and reports each batch done through ``step`` as the phase
    ``what``; each pass starts at 0 and ends the phase's display when it ends (or is abandoned)."""

    def __init__(self, iterable: Iterable, step: Steps, what: str, total: int | None = None):
        self.iterable, self.step, self.what, self.total = iterable, step, what, total
        self.loader = iterable  # for _length of a wrapper around this one

    def __iter__(self) -> Iterator:
        total = self.total if self.total is not None else _length(self.iterable)
        done = 0
        self.step(done, total, self.what)
        try:
            for item in self.iterable:
                yield item
                done += 1  # the consumer asked for the next batch: the previous one is done
                self.step(done, total, self.what)
        finally:
            self.step.close()
