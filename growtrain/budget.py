"""Growth on a compute budget: the plan of a fit and the learning rate over it (pure functions).

The budget is the fit's training compute, read from the trainer when the fit starts: its optimizer
steps (``max_steps``, or ``max_epochs`` × batches: ``trainer.estimated_stepping_batches``) at the
depth the network starts with, in FLOPs (3 × forward FLOPs per sample × samples, as
``ComputeMeter`` counts them). A deeper network spends it faster, so a grown fit takes fewer steps
than the trainer's limit, and everything a decision trains beside the run (a fork's arm, its
scoring) is spent from the same budget: a grown network's figures include what deciding cost.

Fractions of the budget (spent FLOPs / budget) place everything::

    0 ── warmup ── stable rate ─────────────────────────────────── decay ── 1
         │  growth phase: a decision at each of ``checks`` points  │
         0 < p_1 < … < p_checks = growth_phase                    1 − decay

A decision opens at each point of the growth phase and runs for ``fork`` of the budget; growth
ends at the first decision that does not grow, or after the last point. The rate is WSD's
(warmup-stable-decay, Hägele et al. 2024): a linear warmup, the peak rate, and a linear decay to
``min_lr_ratio`` of it over the last ``decay`` of the budget, so a budget's end always hands over
an annealed network and every growth lands at the stable rate.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch

__all__ = ["BudgetPlan", "wsd_fraction", "fork_steps", "plan_problem", "carried", "budget_verdict", "steps_cost",
           "COST_EXPONENT"]

# The exponent p of the learning curve L(S) = E + A·S^(−p) the "steps" statistic prices fewer steps with.
# Chosen on the language model's seed-0 scratch curves (docs/budget.md): a free fit of p to the first
# 10–30 % of a curve gave p ≈ 0.3 and overpriced the end's cost about threefold, p = 1 underpriced it
# about twofold; ½ sits between. One constant, halved and doubled in the stability rows.
COST_EXPONENT = 0.5


def wsd_fraction(spent: float, *, warmup: float, decay: float, min_lr_ratio: float) -> float:
    """The rate factor at ``spent`` ∈ [0, 1] of the budget: ``spent / warmup`` during the warmup,
    1 on the stable part, then linear from 1 to ``min_lr_ratio`` over the last ``decay``."""
    s = min(max(float(spent), 0.0), 1.0)
    if warmup > 0 and s < warmup:
        return max(s / warmup, 1e-3)  # never exactly 0: an optimizer step at rate 0 is a wasted step
    if decay > 0 and s > 1.0 - decay:
        return 1.0 - (1.0 - min_lr_ratio) * (s - (1.0 - decay)) / decay
    return 1.0


def fork_steps(flops: float, step_flops: float) -> int:
    """Optimizer steps that spend ``flops`` at ``step_flops`` per step (at least one)."""
    return max(1, int(round(flops / step_flops)))


@dataclass(frozen=True)
class BudgetPlan:
    """Where the decisions and the decay fall in one fit (fractions of the budget, FLOPs).

    ``total_flops``: the budget; ``steps``: the trainer's optimizer steps it was read from (at the
    start depth); the rest are the callback's options."""

    total_flops: float
    steps: int
    growth_phase: float
    checks: int
    fork: float
    decay: float
    warmup: float
    min_lr_ratio: float

    def __post_init__(self) -> None:
        if not (math.isfinite(self.total_flops) and self.total_flops > 0):
            raise ValueError(f"budget: expected a finite positive FLOP budget, got {self.total_flops!r}")

    @property
    def points(self) -> list[float]:
        """Fractions of the budget at which a decision opens: evenly spaced, the last at ``growth_phase``."""
        return [self.growth_phase * (k + 1) / self.checks for k in range(self.checks)]

    def point_flops(self, k: int) -> float:
        return self.points[k] * self.total_flops

    @property
    def fork_flops(self) -> float:
        return self.fork * self.total_flops

    def lr_factor(self, spent_flops: float) -> float:
        return wsd_fraction(spent_flops / self.total_flops, warmup=self.warmup, decay=self.decay,
                            min_lr_ratio=self.min_lr_ratio)  # fmt: skip

    def as_dict(self) -> dict:
        return asdict(self)

    def describe(self, depth: int | None) -> str:
        at = f" at {depth} blocks" if depth is not None else ""
        return (f"budget {self.total_flops / 1e12:.3g} TFLOP ({self.steps} optimizer steps{at}); a decision at "
                f"{', '.join(f'{100 * p:.0f} %' for p in self.points)} of it, each over {100 * self.fork:.1f} %; "
                f"the rate decays over the last {100 * self.decay:.0f} %; a deeper network takes fewer steps, and "
                "the fit ends when the budget is spent")  # fmt: skip


def plan_problem(steps: int, *, growth_phase: float, checks: int, fork: float, decay: float, warmup: float,
                 min_fork_steps: int) -> str | None:  # fmt: skip
    """Why a fit of ``steps`` optimizer steps cannot be planned, with the fix; ``None`` if it can."""
    if growth_phase + fork > 1.0 - decay:
        return (f"growth_phase ({growth_phase}) + fork ({fork}) must end before the decay starts (1 - decay = "
                f"{1.0 - decay:g}). Fix: a shorter growth_phase or decay")  # fmt: skip
    if warmup >= growth_phase / checks:
        return (f"warmup ({warmup}) must end before the first decision ({growth_phase / checks:g} of the budget). "
                "Fix: a shorter warmup or fewer checks")  # fmt: skip
    per_fork = int(fork * steps)
    if per_fork < min_fork_steps:
        need = math.ceil(min_fork_steps / fork)
        return (f"the fit is too short to decide anything: a decision trains over {100 * fork:.1f} % of its {steps} "
                f"optimizer steps = {per_fork} steps, fewer than the {min_fork_steps} a comparison needs. Fix: "
                f"train for at least {need} steps (max_steps or max_epochs), or pass a larger fork")  # fmt: skip
    return None


def carried(final: torch.Tensor, half: torch.Tensor, m: float) -> torch.Tensor:
    """Per-sample losses carried on linearly in log FLOPs from a side's halfway (``half``) and final
    (``final``) scores to ``m`` doublings past the final: ``final + m · (final − half)``. A paired gain
    of two carried sides is then the fork's gain carried to that horizon, sample by sample."""
    return (1.0 + m) * final - m * half


def budget_verdict(lower_frac: float, upper_frac: float, min_gain: float) -> tuple[bool, bool]:
    """``(grow, certified)``: grow iff the gain's lower bound is above ``min_gain``; otherwise growth
    ends, *certified* not to pay where the upper bound is below ``min_gain`` too."""
    grow = math.isfinite(lower_frac) and lower_frac > min_gain
    return grow, (not grow) and math.isfinite(upper_frac) and upper_frac < min_gain


def steps_cost(steps: torch.Tensor, losses: torch.Tensor, *, end_run: float, end_arm: float,
               exponent: float = COST_EXPONENT, bins: int = 16) -> tuple[float, float]:
    """``(cost, A)``: the loss the run's own curve says it gives up at the budget's end by reaching
    ``end_arm`` optimizer steps instead of ``end_run`` (``end_arm ≤ end_run``: a deeper network's steps
    cost more), from a least-squares fit of ``L(S) = E + A·S^(−p)`` to its training losses.

    ``steps``/``losses`` (1-D, same length): the run's optimizer steps and their training losses over a
    recent window; they are averaged in ``bins`` equal runs of steps first (one step's loss is one
    batch's: noisy; fewer bins when the window has fewer than ``2·bins`` pairs). A curve that does not fall (``A ≤ 0``) prices fewer steps at 0: more steps would not
    have lowered it either."""
    s = steps.detach().double().flatten()
    y = losses.detach().double().flatten()
    keep = torch.isfinite(y) & (s > 0)
    s, y = s[keep], y[keep]
    # a fork after a growth is shorter (a deeper network takes fewer steps for the same FLOPs): fewer bins then
    bins = min(bins, s.numel() // 2)
    if bins < 2:
        raise ValueError(f"steps_cost: expected at least 4 (step, loss) pairs to fit the curve, got "
                         f"{s.numel()}. Fix: a longer fork (more steps in the window)")  # fmt: skip
    order = torch.argsort(s)
    chunks = torch.tensor_split(order, bins)
    x = torch.stack([s[c].pow(-exponent).mean() for c in chunks])  # S^(−p) averaged as the losses are
    m = torch.stack([y[c].mean() for c in chunks])
    xc = x - x.mean()
    a = float((xc * (m - m.mean())).sum() / (xc * xc).sum())
    if not (math.isfinite(a) and a > 0):
        return 0.0, a
    return a * (float(end_arm) ** -exponent - float(end_run) ** -exponent), a
