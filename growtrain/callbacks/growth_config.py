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

from growtrain.decision import DEFAULT_MIN_GAIN, DEFAULT_RULE, DEFAULT_TAU, RULES, check_min_gain, check_tau
from growtrain.reconfigure import LR_SCHEDULES as _SCHEDULER_MODES
from growtrain.trial import DEFAULT_TRIAL_EPOCHS, DEFAULT_TRIAL_HOLDOUT, DEFAULT_TRIAL_LR

__all__ = ["GrowthConfig", "ON_SATURATED", "ALPHA_SPENDING", "MODES", "LR_SCHEDULES", "DECISIONS", "SCHEDULES"]

ON_SATURATED = ("stop", "continue", "anneal")
ALPHA_SPENDING = ("constant", "geometric", "inverse_square")  # growtrain.crossfit.alpha_schedule's names
MODES = ("min", "max")
# "trial": every check trains candidate blocks alone and grows iff one certifies min_gain (the default,
# docs/decision.md); "gain": the first-order rule (or a trial growth) first, then the stage's realized gain;
# "rule": the first-order rule alone; "window" (schedule="periodic"): the growing run's own paired gain
# over the last `window` epochs (growtrain/window.py).
DECISIONS = ("trial", "gain", "rule", "window")
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
    window: int = 10  # schedule="periodic": the stop rule's window J, in epochs
    monitor: str | None = "train_loss"
    mode: Literal["min", "max"] = "min"
    patience: int = 3
    min_delta: float = 0.0
    min_rel_delta: float = 0.01
    min_stage_epochs: int = 2
    cooldown: int = 0
    probe_budget: float | None = None
    delta: float = 0.0
    alpha: float = 0.05
    t: float | None = None
    rule: Literal["paper", "crossfit", "relative"] | None = None
    tau: float = DEFAULT_TAU
    min_gain: float | None = DEFAULT_MIN_GAIN
    alpha_spending: Literal["constant", "geometric", "inverse_square"] = "constant"
    restore_best: bool = True
    trial_growth: bool = False
    decision: Literal["trial", "gain", "rule", "window"] | None = None
    trial_epochs: float = DEFAULT_TRIAL_EPOCHS
    trial_lr: float = DEFAULT_TRIAL_LR
    trial_holdout: int = DEFAULT_TRIAL_HOLDOUT
    trial_sites: int = 3
    top_k: int = 1
    max_growths: int | None = None
    max_blocks: int | None = None
    max_params: int | None = None
    on_saturated: Literal["stop", "continue", "anneal"] = "stop"
    anneal_epochs: int = 10
    lr_schedule: Literal["continue", "restart", "anneal"] = "continue"
    projected: bool = False
    calibrate: bool = True
    seed: int = 0
    log_sites: bool = True
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
        if not given_every:
            object.__setattr__(self, "every_n_epochs", 1)
        _int("every_n_epochs", self.every_n_epochs, 1)
        _int("window", self.window, 1)
        if periodic and self.window < self.every_n_epochs:
            raise _bad("window", f"at least every_n_epochs={self.every_n_epochs} (the stop rule compares a check with "
                       "one at least `window` epochs back)", self.window,
                       f"pass window={3 * self.every_n_epochs} or more")  # fmt: skip
        if periodic and self.lr_schedule == "anneal":
            raise _bad("lr_schedule", "'continue' with schedule='periodic' (its checks come at the constant rate; "
                       "the one anneal is the final phase, on_saturated='anneal')", self.lr_schedule,
                       "drop lr_schedule, or pass schedule='converged'")  # fmt: skip
        if self.monitor is not None and not (isinstance(self.monitor, str) and self.monitor):
            raise _bad("monitor", "None or the name of a logged metric", self.monitor, "pass monitor='train_loss'")
        if self.monitor is not None and given_every and not periodic:  # periodic: the monitor is not used
            warnings.warn(f"GrowUntilSaturated: every_n_epochs={self.every_n_epochs} has no effect while monitor="
                          f"{self.monitor!r} is set: a check runs when the monitor plateaus, whatever the epoch. Fix: "
                          "pass monitor=None to check every every_n_epochs, or drop every_n_epochs.", UserWarning,
                          stacklevel=4)  # fmt: skip
        _choice("mode", self.mode, MODES)
        _int("patience", self.patience, 1)
        _number("min_delta", self.min_delta, fix="pass min_delta=0.0")
        _number("min_rel_delta", self.min_rel_delta, fix="pass min_rel_delta=0.01 (an improvement of 1 % of the best)")
        _int("min_stage_epochs", self.min_stage_epochs, 1)
        _int("cooldown", self.cooldown, 0)
        budget = self.probe_budget
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, (int, float)) or not 0 < budget <= 1):
            raise _bad("probe_budget", "None or a fraction in (0, 1]", budget, "pass probe_budget=0.05 or None")
        _number("delta", self.delta, fix="pass delta=0.0 (the practical-saturation margin δ, gradient-norm units)")
        alpha = self.alpha
        if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
            raise _bad("alpha", "a probability in (0, 1)", alpha, "pass alpha=0.05")
        if self.t is not None:
            _number("t", self.t, strict=True, fix="leave t=None to derive it from alpha")
        rule = self.rule
        if rule is None:  # t is the paper rule's threshold: giving it asks for that rule
            object.__setattr__(self, "rule", rule := "paper" if self.t is not None else DEFAULT_RULE)
        _choice("rule", rule, RULES)
        object.__setattr__(self, "tau", check_tau(self.tau))
        object.__setattr__(self, "min_gain", check_min_gain(self.min_gain))
        if self.t is not None and rule != "paper":
            warnings.warn(f"GrowUntilSaturated: t only sets the paper rule's threshold; rule={rule!r} decides by its "
                          "lower bound at level alpha, so t changes the reported figures only.", UserWarning,
                          stacklevel=4)  # fmt: skip
        _choice("alpha_spending", self.alpha_spending, ALPHA_SPENDING)
        _int("top_k", self.top_k, 1)
        _int("max_growths", self.max_growths, 0, optional=True)
        _int("max_blocks", self.max_blocks, 1, optional=True)
        _int("max_params", self.max_params, 1, optional=True)
        _choice("on_saturated", self.on_saturated, ON_SATURATED)
        _int("anneal_epochs", self.anneal_epochs, 1)
        _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        for name in ("projected", "calibrate", "log_sites", "verbose", "restore_best", "trial_growth"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, "True or False", getattr(self, name), f"pass {name}=True")
        _int("seed", self.seed, 0)
        if self.trial_growth and self.min_gain is None:
            raise _bad("trial_growth", "min_gain set (a trial growth is judged by its realized gain)", self.min_gain,
                       "pass min_gain=0.01 with trial_growth=True, or trial_growth=False")  # fmt: skip
        self._check_decision()
        for name in ("min_delta", "min_rel_delta", "delta", "alpha"):
            object.__setattr__(self, name, float(getattr(self, name)))
        if budget is not None:
            object.__setattr__(self, "probe_budget", float(budget))

    def _check_decision(self) -> None:
        decision = self.decision
        periodic = self.schedule == "periodic"
        if decision is None:  # min_gain=None asks for the first-order rule alone; trial_growth for the stage gain
            decision = ("rule" if self.min_gain is None else "gain" if self.trial_growth
                        else "window" if periodic else "trial")  # fmt: skip
        _choice("decision", decision, DECISIONS)
        if decision == "window" and not periodic:
            raise _bad("decision", "'window' only with schedule='periodic' (it compares checks `window` epochs "
                       "apart while the run grows at the constant rate)", decision,
                       "pass schedule='periodic', or decision='trial'")  # fmt: skip
        if periodic and decision == "gain":
            raise _bad("decision", "'window', 'trial' or 'rule' with schedule='periodic' (a stage's realized gain "
                       "needs a converged stage)", decision, "pass decision='window'")  # fmt: skip
        if decision in ("trial", "gain", "window") and self.min_gain is None:
            raise _bad("decision", "min_gain set (the gain a block must certify)", f"{decision!r} with min_gain=None",
                       "pass min_gain=0.01, or decision='rule'")  # fmt: skip
        if decision == "trial" and self.trial_growth:
            raise _bad("trial_growth", "False with decision='trial' (every check already tries blocks)", True,
                       "drop trial_growth, or pass decision='gain'")  # fmt: skip
        object.__setattr__(self, "decision", decision)
        for name, value in (("trial_epochs", self.trial_epochs), ("trial_lr", self.trial_lr)):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
                raise _bad(name, "a finite number > 0", value, f"pass {name}={getattr(GrowthConfig, name)}")
            object.__setattr__(self, name, float(value))
        _int("trial_holdout", self.trial_holdout, 0)
        _int("trial_sites", self.trial_sites, 1)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
