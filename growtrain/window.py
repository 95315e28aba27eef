"""The window rule of the periodic schedule: has the growing run itself stopped paying?

Under ``schedule="periodic"`` the network grows every ``every_n_epochs`` (K) at the module's
constant rate, before it has converged (AutoGrow's protocol, docs/decision.md). What stops the
growth is not one block's value but the run's: every check keeps the probe's per-sample losses,
and the verdict pairs them, sample by sample, with those of the latest check at least ``window``
(J ≫ K) epochs earlier (optimizer steps, with ``min_steps_between_checks``: the same window on
a quarter of the data then spans four times the epochs). Growth goes on while the held-out probe loss fell over that window by a
certified (one-sided bootstrap-t lower bound at level α) more than ``min_gain`` of it; otherwise
it ends: "certified saturation" (``Verdict.certified``) only when the upper bound is below
``min_gain`` too, else "no certified gain".

Pure tensor functions: no Lightning, no callback state.
"""

from __future__ import annotations

from typing import Sequence

import torch

from growtrain.decision import Verdict
from growtrain.trial import trial_test

__all__ = ["window_reference", "window_prune", "window_test", "window_verdict", "window_waits"]


def window_reference(entries: Sequence[dict], epoch: int, window: int, unit: str = "epoch") -> dict | None:
    """The latest kept check at least ``window`` epochs before ``epoch`` (``None``: the window is
    not full yet). ``entries``: ``{"epoch", "losses", "signature"}`` dicts in check order. With
    ``unit="step"`` both ``epoch`` and ``window`` count optimizer steps, compared with each entry's
    ``"step"`` (an entry without one, written by an epoch-counted fit, is never a reference)."""
    older = [e for e in entries if e.get(unit) is not None and int(e[unit]) <= epoch - window]
    return older[-1] if older else None


def window_prune(entries: Sequence[dict], epoch: int, window: int, unit: str = "epoch") -> list[dict]:
    """Drop the entries no later check can use: a later check's reference is at least as recent
    as this one's, so everything before today's reference goes (bounded memory on long fits)."""
    reference = window_reference(entries, epoch, window, unit)
    if reference is None:
        return list(entries)
    index = max(i for i, e in enumerate(entries) if e is reference)
    return list(entries[index:])


def window_waits(verdict: Verdict) -> bool:
    """Whether a window verdict decided nothing (its window was not full: no test was made)."""
    return verdict.rule == "window" and not verdict.saturated and verdict.reason.startswith("wait:")


def window_test(before: torch.Tensor, after: torch.Tensor, *, min_gain: float, level: float, seed: int = 0) -> dict:
    """The window's paired gain ``b − a`` per probe sample with one-sided ``1 − level`` bounds,
    as fractions of the loss at the window's start (``lower_frac``, ``gain_frac``, ``upper_frac``;
    growtrain.trial.trial_test: the same bootstrap-t as the block-only trial)."""
    return trial_test(before, after, min_gain=min_gain, level=level, seed=seed)


def window_verdict(test: dict | None, *, window: int, epoch: int, reference_epoch: int | None,
                   min_gain: float, unit: str = "epoch") -> Verdict:  # fmt: skip
    """Grow (``saturated=False``, a site chosen by the caller) while the window's certified gain
    beats ``min_gain``; otherwise end growth. While the window is not full (``test`` is ``None``)
    nothing was compared, so nothing is decided: the verdict is not saturated and its reason starts
    with "wait"; the caller grows nothing (``window_waits``). ``certified`` (and "certified saturation" in the reason)
    only when the window's upper bound is below ``min_gain`` too; else "no certified gain", with
    the probe's resolution: a gain above ``min_gain`` was not ruled out. ``unit``: what ``window``,
    ``epoch`` and ``reference_epoch`` count ("epoch", or "step": optimizer steps)."""
    length = f"{window}-epoch" if unit == "epoch" else f"{window}-step"
    if test is None:  # no test, no growth: a check that grew here would grow blind (depth by construction)
        return Verdict("window", False, None, float("nan"), min_gain,
                       f"wait: the {length} window is not full yet ({unit} {epoch}); nothing is compared and "
                       "nothing grows until the probe loss can be compared with a check at least that far back")  # fmt: skip
    span = f"from {unit} {reference_epoch} to {epoch}"
    level = test["level"]
    what = (f"the probe loss fell {span} by {100 * test['gain_frac']:.2f} % (at least {100 * test['lower_frac']:.2f} %, "
            f"at most {100 * test['upper_frac']:.2f} %, {100 * (1 - level):.1f} % bounds, n={test['n']})")  # fmt: skip
    if test["lower_frac"] > min_gain:
        return Verdict("window", False, None, test["lower_frac"], min_gain,
                       f"grow: the growing run still pays: {what} > min_gain {100 * min_gain:.2f} %")  # fmt: skip
    if test["upper_frac"] < min_gain:
        return Verdict("window", True, None, test["lower_frac"], min_gain,
                       f"certified saturation: {what}: below min_gain {100 * min_gain:.2f} % over {window} {unit}s of "
                       "growing", certified=True)  # fmt: skip
    half = 100 * (test["upper_frac"] - test["lower_frac"]) / 2
    return Verdict("window", True, None, test["lower_frac"], min_gain,
                   f"no certified gain over the last {window} {unit}s: {what}: not above min_gain "
                   f"{100 * min_gain:.2f} %; this probe resolves the window's gain to about ±{half:.2f} % of the loss")  # fmt: skip
