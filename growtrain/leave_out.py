"""A block on probation: trained inside the run, dropped per sample, judged by leaving it out.

The question the depth decision must answer is what one more block is worth under the training the
run gives it, against the same training without it. Two networks trained side by side (the stage
fork) answer it at twice the cost, and their two training paths drift apart by more than the probe
resolves (docs/results.md, the thirteenth session). Here one network answers it: the new block sits
in the run on *probation*, and on every training forward each sample passes through it with
probability ``KEEP`` and skips it (the identity) otherwise (stochastic depth on one block, Huang et
al. 2016). Everything else trains on every sample both ways, at the run's rate, on the run's
batches. At a check the held-out probe is scored twice by the same weights: with the block
(``x + f(x)``) and without it (``x``). Both modes are ones the network trained in, so the paired
per-sample difference is the block's worth to this network, and the training both modes shared
(the run's progress) cancels in it.

Pure torch (no Lightning): the hook, its modes, and the verdict from the paired test.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch import nn

from growtrain.decision import Verdict
from growtrain.trial import trial_test

__all__ = ["KEEP", "MAX_LOOKS", "LeaveOut", "leave_out_test", "probation_verdict"]

# The chance a training sample passes through the block on probation. One half gives the two modes
# the same share of the training, so neither is scored in a mode it trained less in.
KEEP = 0.5
# Checks a block stays on probation before an unresolved verdict ends growth; the test's level is
# split over them (Bonferroni), so looking at every check does not inflate the error.
MAX_LOOKS = 4


def _hidden_in(args: tuple, kwargs: dict) -> torch.Tensor:
    if args and isinstance(args[0], torch.Tensor):
        return args[0]
    if isinstance(kwargs.get("hidden_states"), torch.Tensor):
        return kwargs["hidden_states"]
    raise TypeError("decision='probation': the block's input is not a tensor (first argument or hidden_states)")


class LeaveOut:
    """A forward hook on ``block``: ``out = x + m·(block(x) − x)`` with a per-sample ``m``.

    In training mode ``m ~ Bernoulli(keep)`` per sample (the batch is dimension 0), drawn from a
    private generator (``reseed`` before each batch), so the run's own random stream never moves
    and a resumed fit draws the same masks. In eval mode ``m = 1`` (the block is in), or ``m = 0``
    inside ``left_out()``. ``remove()`` takes the hook off (the plain block from then on)."""

    def __init__(self, block: nn.Module, keep: float = KEEP):
        if not 0.0 < float(keep) < 1.0:
            raise ValueError(f"keep: expected a probability in (0, 1); got {keep!r}")
        self.block, self.keep = block, float(keep)
        self.generator = torch.Generator()
        self.out = False  # eval mode: score without the block
        self.kept: list[tuple[float, int]] = []  # each training forward's share through the block, and its size

        def hook(module: nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
            x = _hidden_in(args, kwargs)
            first = output if isinstance(output, torch.Tensor) else output[0]
            if module.training:
                drawn = torch.rand(x.shape[0], generator=self.generator) < self.keep  # on the host: no device sync
                self.kept.append((float(drawn.float().mean()), int(drawn.numel())))
                m = drawn.to(device=x.device, dtype=x.dtype)
                mixed = x + m.view(-1, *([1] * (x.dim() - 1))) * (first - x)
            else:
                mixed = x if self.out else first
            return mixed if isinstance(output, torch.Tensor) else (mixed,) + tuple(output[1:])

        self.handle = block.register_forward_hook(hook, with_kwargs=True, prepend=True)

    def reseed(self, key: int) -> None:
        """The masks of the next training forward come from ``key`` (e.g. seed, step and batch)."""
        self.generator.manual_seed(int(key) % (2**63 - 1))

    @contextmanager
    def left_out(self) -> Iterator[None]:
        """Eval-mode forwards inside skip the block (the identity in its place)."""
        self.out = True
        try:
            yield
        finally:
            self.out = False

    def remove(self) -> None:
        self.handle.remove()


def leave_out_test(without: torch.Tensor, with_block: torch.Tensor, *, min_gain: float, level: float,
                   seed: int = 0) -> dict:  # fmt: skip
    """The block's gain ``without − with_block`` per probe sample (one network, two modes), with
    one-sided ``1 − level`` bootstrap-t bounds as fractions of the loss without it
    (:func:`growtrain.trial.trial_test`, "without" as "before")."""
    return trial_test(without, with_block, min_gain=min_gain, level=level, seed=seed)


def probation_verdict(test: dict, *, site: str, min_gain: float, looks: int, max_looks: int = MAX_LOOKS) -> tuple[Verdict, str]:
    """What a look at the block on probation decides, and the action in one word:

    * ``"confirm"``: the lower bound is above ``min_gain`` (the block stays; grow on);
    * ``"wait"``: not confirmed, and fewer than ``max_looks`` looks so far (train on, look again: a
      fresh block is worth less early in its training, so no early look takes it out);
    * ``"reject"``: at the last look, the upper bound is below ``min_gain`` ("certified saturation":
      the block goes);
    * ``"unresolved"``: at the last look, neither ("no certified gain": the block goes).

    ``looks`` counts this one; the test's level is already the per-look share."""
    many = "," in site
    what = (f"the block{'s' if many else ''} on probation at {site} lower{'' if many else 's'} the probe loss (samples "
            f"held out from all training) by {100 * test['gain_frac']:+.2f} % against the same network without "
            f"{'them' if many else 'it'} (at least "
            f"{100 * test['lower_frac']:+.2f} %, at most {100 * test['upper_frac']:+.2f} %, "
            f"{100 * (1 - test['level']):.2f} % bounds, n={test['n']}, look {looks} of {max_looks})")  # fmt: skip
    finite = math.isfinite(test["lower_frac"]) and math.isfinite(test["upper_frac"])
    if finite and test["lower_frac"] > min_gain:
        return Verdict("probation", False, site, test["lower_frac"], min_gain,
                       f"grow: {what} > min_gain {100 * min_gain:.2f} %"), "confirm"  # fmt: skip
    half = 100 * (test["upper_frac"] - test["lower_frac"]) / 2 if finite else float("nan")
    if looks < max_looks:  # a fresh block is worth less early on: only its last look may take it out
        return Verdict("probation", False, None, test["lower_frac"], min_gain,
                       f"wait: {what}: not above min_gain {100 * min_gain:.2f} % (±{half:.2f} %)"), "wait"
    if finite and test["upper_frac"] < min_gain:
        return Verdict("probation", True, None, test["lower_frac"], min_gain,
                       f"certified saturation: {what}: below min_gain {100 * min_gain:.2f} %", certified=True), "reject"
    if not finite:
        return Verdict("probation", True, None, float("nan"), min_gain,
                       f"no certified gain: the probe losses are not finite ({what})"), "unresolved"  # fmt: skip
    return Verdict("probation", True, None, test["lower_frac"], min_gain,
                   f"no certified gain: {what}: not above min_gain {100 * min_gain:.2f} % after {max_looks} looks; "
                   f"the probe resolves the gain to about ±{half:.2f} % of the loss"), "unresolved"  # fmt: skip
