"""``GrowthConfig``: every option of ``GrowUntilSaturated``, validated in one place.

Each check raises a ``ValueError`` that names the argument, what was expected, what was given and
the fix, at construction — before any training or state change.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Literal, Sequence

from torch import nn
from torch.utils.data import DataLoader

from growtrain.decision import DEFAULT_MIN_GAIN, DEFAULT_RULE, check_min_gain
from growtrain.reconfigure import LR_SCHEDULES as _SCHEDULER_MODES
from growtrain.trial import DEFAULT_TRIAL_EPOCHS

__all__ = ["GrowthConfig", "ON_SATURATED", "MODES", "LR_SCHEDULES", "DECISIONS", "SCHEDULES", "CALLBACK_RULES"]

ON_SATURATED = ("stop", "continue", "anneal")
MODES = ("min", "max")
# "trial": every check trains candidate blocks alone and grows iff one certifies min_gain (the default,
# docs/decision.md); "rule": the first-order rule alone; "stage_fork" (schedule="periodic"): the run against
# a copy with one more block in every stage, trained on the same batches until the next check, compared on
# the probe (growtrain/fork.py).
DECISIONS = ("trial", "rule", "stage_fork")
# The first-order rules a check decides or chooses its site by (the relative rule stays a reported verdict of
# growtrain measure and measure_saturation, not a callback option: docs/results/history.md).
CALLBACK_RULES = ("paper", "crossfit")
# When a check comes: "converged" (a stage plateaus, optionally annealed, then is judged: the paper's
# protocol) or "periodic" (every every_n_epochs at the constant rate, one final anneal at the end).
SCHEDULES = ("converged", "periodic")
# "continue"/"restart": what the user's schedulers do after a growth; "anneal": the callback drives
# the learning rate itself (constant per stage, a cosine anneal before each check, back up after a growth).
LR_SCHEDULES = (*_SCHEDULER_MODES, "anneal")


def _bad(arg: str, expected: str, given: Any, fix: str) -> ValueError:
    return ValueError(f"{arg}: expected {expected}; got {given!r}. Fix: {fix}.")


def _int(arg: str, value: Any, low: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = f"an integer >= {low}" + (" or None" if optional else "")
        raise _bad(arg, kind, value, f"pass {arg}={max(low, 1)}" + (" or leave it None" if optional else ""))


def _choice(arg: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise _bad(arg, f"one of {tuple(choices)}", value, f"pass {arg}={choices[0]!r}")


def _number(arg: str, value: Any, *, low: float = 0.0, strict: bool = False, fix: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):
        raise _bad(arg, f"a finite number {'>' if strict else '>='} {low:g}", value, fix)


@dataclass(frozen=True)
class GrowthConfig:
    """The options of ``GrowUntilSaturated`` (documented there), checked at construction."""

    probe: DataLoader | Callable[[], Iterable] | None = None
    network: str | nn.Module | None = None
    loss_fn: Callable[[Any, Any], Any] | None = None
    schedule: Literal["converged", "periodic"] = "converged"
    every_n_epochs: int | None = None  # None: 1 (given with a monitor: warned about, it has no effect)
    # instead of every_n_epochs: a check at the first epoch end this many optimizer steps after the last
    # (the same pace per step on any amount of data)
    min_steps_between_checks: int | None = None
    monitor: str | None = "train_loss"
    mode: Literal["min", "max"] = "min"
    patience: int = 3
    min_rel_delta: float = 0.01
    min_stage_epochs: int = 2
    delta: float = 0.0
    alpha: float = 0.05
    t: float | None = None
    rule: Literal["paper", "crossfit"] | None = None
    min_gain: float | None = DEFAULT_MIN_GAIN
    decision: Literal["trial", "rule", "stage_fork"] | None = None
    trial_epochs: float = DEFAULT_TRIAL_EPOCHS
    max_growths: int | None = None
    max_params: int | None = None
    on_saturated: Literal["stop", "continue", "anneal"] = "stop"
    anneal_epochs: int = 10
    lr_schedule: Literal["continue", "restart", "anneal"] | None = None
    seed: int = 0
    verbose: bool = True

    def __post_init__(self) -> None:
        probe = self.probe
        if probe is not None and not (isinstance(probe, DataLoader) or callable(probe) or hasattr(probe, "__iter__")):
            raise _bad("probe", "a DataLoader, a callable returning one, or None", type(probe).__name__,
                       "pass probe=datamodule.probe_dataloader (or leave None to use the datamodule's)")  # fmt: skip
        if self.network is not None and not isinstance(self.network, (str, nn.Module)):
            raise _bad("network", "None, an attribute path (str) or an nn.Module", type(self.network).__name__,
                       "pass network='network' (the attribute holding your growable network)")  # fmt: skip
        if self.loss_fn is not None and not callable(self.loss_fn):
            raise _bad("loss_fn", "a callable (output, target) -> mean loss, or None", self.loss_fn,
                       "pass F.cross_entropy")  # fmt: skip
        _choice("schedule", self.schedule, SCHEDULES)
        periodic = self.schedule == "periodic"
        given_every = self.every_n_epochs is not None
        steps = self.min_steps_between_checks
        _int("min_steps_between_checks", steps, 1, optional=True)
        if steps is not None and given_every:
            raise _bad("min_steps_between_checks", "None when every_n_epochs is given (checks are counted in epochs "
                       "or in optimizer steps, not both)", steps,
                       "drop one of every_n_epochs and min_steps_between_checks")  # fmt: skip
        if not given_every:
            object.__setattr__(self, "every_n_epochs", 1)
        _int("every_n_epochs", self.every_n_epochs, 1)
        interval, unit = (self.every_n_epochs, "epochs") if steps is None else (steps, "optimizer steps")
        if periodic and self.lr_schedule == "anneal":
            raise _bad("lr_schedule", "'continue' with schedule='periodic' (its checks come at the constant rate; "
                       "the one anneal is the final phase, on_saturated='anneal')", self.lr_schedule,
                       "drop lr_schedule, or pass schedule='converged'")  # fmt: skip
        if self.monitor is not None and not (isinstance(self.monitor, str) and self.monitor):
            raise _bad("monitor", "None or the name of a logged metric", self.monitor, "pass monitor='train_loss'")
        if self.monitor is not None and (given_every or steps is not None) and not periodic:  # periodic: no monitor
            given = "every_n_epochs" if steps is None else "min_steps_between_checks"
            warnings.warn(f"GrowUntilSaturated: {given}={interval} has no effect while monitor="
                          f"{self.monitor!r} is set: a check runs when the monitor plateaus, whatever the epoch. Fix: "
                          f"pass monitor=None to check every {given}, or drop {given}.", UserWarning,
                          stacklevel=4)  # fmt: skip
        _choice("mode", self.mode, MODES)
        _int("patience", self.patience, 1)
        _number("min_rel_delta", self.min_rel_delta, fix="pass min_rel_delta=0.01 (an improvement of 1 % of the best)")
        _int("min_stage_epochs", self.min_stage_epochs, 1)
        _number("delta", self.delta, fix="pass delta=0.0 (the practical-saturation margin δ, gradient-norm units)")
        alpha = self.alpha
        if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
            raise _bad("alpha", "a probability in (0, 1)", alpha, "pass alpha=0.05")
        if self.t is not None:
            _number("t", self.t, strict=True, fix="leave t=None to derive it from alpha")
        rule = self.rule
        if rule is None:  # t is the paper rule's threshold: giving it asks for that rule
            object.__setattr__(self, "rule", rule := "paper" if self.t is not None else DEFAULT_RULE)
        _choice("rule", rule, CALLBACK_RULES)
        object.__setattr__(self, "min_gain", check_min_gain(self.min_gain))
        if self.t is not None and rule != "paper":
            warnings.warn(f"GrowUntilSaturated: t only sets the paper rule's threshold; rule={rule!r} decides by its "
                          "lower bound at level alpha, so t changes the reported figures only.", UserWarning,
                          stacklevel=4)  # fmt: skip
        _int("max_growths", self.max_growths, 0, optional=True)
        _int("max_params", self.max_params, 1, optional=True)
        _choice("on_saturated", self.on_saturated, ON_SATURATED)
        _int("anneal_epochs", self.anneal_epochs, 1)
        if self.lr_schedule is None and (periodic or self.monitor is None):
            # checks at a fixed interval (the periodic schedule, or no monitor): the rate goes on as it is
            object.__setattr__(self, "lr_schedule", "continue")
        # else None stays until the fit starts: "anneal" (a converged stage is annealed before its check,
        # so what a check measures is not what annealing alone gives), or "continue" when the network's
        # optimizer has a scheduler of its own (GrowUntilSaturated.on_train_start says so)
        if self.lr_schedule is not None:
            _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if not isinstance(self.verbose, bool):
            raise _bad("verbose", "True or False", self.verbose, "pass verbose=True")
        _int("seed", self.seed, 0)
        self._check_decision()
        if self.delta != type(self).delta and self.decision != "rule":  # the class attribute: the field's default
            # the trial and the fork grow on a certified gain over min_gain, and rank the sites by a lower bound δ
            # does not move: δ reaches only the first-order verdict each check reports
            warnings.warn(f"GrowUntilSaturated: delta={self.delta!r} only changes the reported first-order verdict: "
                          f"under decision={self.decision!r} a block grows when it certifies min_gain of the probe "
                          "loss, and the sites are ranked by a lower bound that delta does not move. Fix: drop delta, "
                          "or pass decision='rule' to decide by the first-order rule with this margin.", UserWarning,
                          stacklevel=4)  # fmt: skip
        for name in ("min_rel_delta", "delta", "alpha"):
            object.__setattr__(self, name, float(getattr(self, name)))

    def _check_decision(self) -> None:
        decision = self.decision
        periodic = self.schedule == "periodic"
        if decision is None:  # min_gain=None asks for the first-order rule alone
            decision = "rule" if self.min_gain is None else "stage_fork" if periodic else "trial"
        _choice("decision", decision, DECISIONS)
        if decision == "stage_fork" and not periodic:
            raise _bad("decision", f"{decision!r} only with schedule='periodic' (a fork opened at one check is judged at the "
                       "next, every_n_epochs later)", decision, "pass schedule='periodic', or decision='trial'")  # fmt: skip
        if decision in ("trial", "stage_fork") and self.min_gain is None:
            raise _bad("decision", "min_gain set (the gain a block must certify)", f"{decision!r} with min_gain=None",
                       "pass min_gain=0.01, or decision='rule'")  # fmt: skip
        object.__setattr__(self, "decision", decision)
        value = self.trial_epochs
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise _bad("trial_epochs", "a finite number > 0", value, f"pass trial_epochs={DEFAULT_TRIAL_EPOCHS}")
        object.__setattr__(self, "trial_epochs", float(value))

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
