"""``GrowthConfig``: every option of ``GrowUntilSaturated``, validated in one place, and the options
of its parts, each a small frozen dataclass that checks its own fields:

* when a check comes (``schedule``): :class:`Converged` (a stage has plateaued: the paper's protocol)
  or :class:`Periodic` (a fixed interval);
* what decides (``decision``): :class:`Trial` (block-only trials), :class:`StageFork` (the run against a
  copy with one more block per stage) or :class:`Rule` (the first-order rule alone).

The strings ``"converged"``, ``"trial"``, ... name the class with its defaults. Each check raises a
``ValueError`` that names the argument (``Converged.patience``), what was expected, what was given and
the fix, at construction — before any training or state change.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, ClassVar, Iterable, Literal, Sequence

from torch import nn
from torch.utils.data import DataLoader

from growtrain.decision import DEFAULT_MIN_GAIN, DEFAULT_RULE
from growtrain.reconfigure import LR_SCHEDULES as _SCHEDULER_MODES
from growtrain.trial import DEFAULT_TRIAL_EPOCHS

__all__ = [
    "GrowthConfig", "Converged", "Periodic", "Trial", "StageFork", "Rule",
    "ON_SATURATED", "MODES", "LR_SCHEDULES", "DECISIONS", "SCHEDULES", "CALLBACK_RULES",
]  # fmt: skip

ON_SATURATED = ("stop", "continue", "anneal")
MODES = ("min", "max")
# "trial": every check trains candidate blocks alone and grows iff one certifies min_gain (the default,
# docs/decision.md); "rule": the first-order rule alone; "stage_fork" (a Periodic schedule): the run against
# a copy with one more block in every stage, trained on the same batches until the next check, compared on
# the probe (growtrain/fork.py).
DECISIONS = ("trial", "rule", "stage_fork")
# The first-order rules a check decides or chooses its site by (the relative rule stays a reported verdict of
# growtrain measure and measure_saturation, not a callback option: docs/results/history.md).
CALLBACK_RULES = ("paper", "crossfit")
# When a check comes: "converged" (a stage plateaus, optionally annealed, then is judged: the paper's
# protocol) or "periodic" (every every_n_epochs, one final anneal at the end).
SCHEDULES = ("converged", "periodic")
# "continue"/"restart": what the user's schedulers do after a growth; "anneal": the callback drives
# the learning rate itself (constant per stage, a cosine anneal before each check, back up after a growth).
LR_SCHEDULES = (*_SCHEDULER_MODES, "anneal")


def _spelled(arg: str, value: str) -> str:
    """How a user passes ``value`` to ``arg``: ``arg=value``, or ``Class(field=value)`` for a part's field."""
    owner, _, name = arg.rpartition(".")
    return f"{owner}({name}={value})" if owner else f"{arg}={value}"


def _bad(arg: str, expected: str, given: Any, fix: str) -> ValueError:
    return ValueError(f"{arg}: expected {expected}; got {given!r}. Fix: {fix}.")


def _int(arg: str, value: Any, low: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = f"an integer >= {low}" + (" or None" if optional else "")
        fix = f"pass {_spelled(arg, str(max(low, 1)))}" + (" or leave it None" if optional else "")
        raise _bad(arg, kind, value, fix)


def _choice(arg: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise _bad(arg, f"one of {tuple(choices)}", value, f"pass {_spelled(arg, repr(choices[0]))}")


def _number(arg: str, value: Any, *, low: float = 0.0, strict: bool = False, fix: str) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or (value <= low if strict else value < low):
        raise _bad(arg, f"a finite number {'>' if strict else '>='} {low:g}", value, fix)


# -- when a check comes ----------------------------------------------------------------------------
class Schedule:
    """When a check comes: ``Converged`` or ``Periodic``. A plain base class, so that a config names the
    part it means (``class_path: growtrain.Periodic``): LightningCLI (jsonargparse) matches a dict of
    dataclass fields to the first class it fits, and two parts share fields."""

    kind: ClassVar[str]
    anneal_epochs: int


@dataclass(frozen=True)
class Converged(Schedule):
    """A check once the stage has converged (the paper's protocol): ``monitor`` has gone ``patience``
    epochs without improving by more than ``min_rel_delta`` of its best value (in the ``mode``
    direction), in a stage at least ``min_stage_epochs`` long; with ``lr_schedule="anneal"`` the stage
    is first cosine-annealed over ``anneal_epochs``, then checked.

    Args:
        monitor: a metric logged per epoch (``"train_loss"``: else the epoch mean of the loss
            ``training_step`` returns); a fixed interval is ``Periodic``.
        mode: ``"min"`` or ``"max"``: the direction in which ``monitor`` improves.
        patience: epochs in a row without an improvement that make a plateau.
        min_rel_delta: the smallest improvement that counts, relative to the best value (scale-free).
        min_stage_epochs: a stage (epochs since the start or the last growth) is at least this long
            before a plateau check.
        anneal_epochs: the length of a stage's anneal before its check (``lr_schedule="anneal"``) and
            of the final anneal (``on_saturated="anneal"``).
    """

    kind: ClassVar[str] = "converged"

    monitor: str = "train_loss"
    mode: Literal["min", "max"] = "min"
    patience: int = 3
    min_rel_delta: float = 0.01
    min_stage_epochs: int = 2
    anneal_epochs: int = 10

    def __post_init__(self) -> None:
        if not (isinstance(self.monitor, str) and self.monitor):
            raise _bad("Converged.monitor", "the name of a metric logged per epoch", self.monitor,
                       "pass Converged(monitor='train_loss'), or schedule=Periodic(every_n_epochs=N) to check on a "
                       "fixed interval")  # fmt: skip
        _choice("Converged.mode", self.mode, MODES)
        _int("Converged.patience", self.patience, 1)
        _number("Converged.min_rel_delta", self.min_rel_delta,
                fix="pass Converged(min_rel_delta=0.01) (an improvement of 1 % of the best)")  # fmt: skip
        _int("Converged.min_stage_epochs", self.min_stage_epochs, 1)
        _int("Converged.anneal_epochs", self.anneal_epochs, 1)
        object.__setattr__(self, "min_rel_delta", float(self.min_rel_delta))


@dataclass(frozen=True)
class Periodic(Schedule):
    """A check every ``every_n_epochs`` epochs, counted from the last check (``None``: 1) — or, with
    ``min_steps_between_checks`` instead, at the first train-epoch end at least that many optimizer
    steps after the last (the same pace per step on any amount of data). Not both: after
    construction ``every_n_epochs`` is ``None`` exactly when the checks are counted in steps.

    Args:
        every_n_epochs: epochs between checks; ``None``: 1 (unless counted in steps).
        min_steps_between_checks: the interval in optimizer steps instead.
        anneal_epochs: the length of the final anneal (``on_saturated="anneal"``), reserved inside
            ``max_epochs`` and ``max_steps``.
    """

    kind: ClassVar[str] = "periodic"

    every_n_epochs: int | None = None
    min_steps_between_checks: int | None = None
    anneal_epochs: int = 10

    def __post_init__(self) -> None:
        steps = self.min_steps_between_checks
        _int("Periodic.min_steps_between_checks", steps, 1, optional=True)
        if steps is not None and self.every_n_epochs is not None:
            raise _bad("Periodic.min_steps_between_checks", "None when every_n_epochs is given (checks are counted in "
                       "epochs or in optimizer steps, not both)", steps,
                       "drop one of every_n_epochs and min_steps_between_checks")  # fmt: skip
        _int("Periodic.every_n_epochs", self.every_n_epochs, 1, optional=True)
        if steps is None and self.every_n_epochs is None:
            object.__setattr__(self, "every_n_epochs", 1)
        _int("Periodic.anneal_epochs", self.anneal_epochs, 1)

    @property
    def interval(self) -> str:
        """The interval in words (the stage fork's horizon)."""
        steps = self.min_steps_between_checks
        return f"{self.every_n_epochs} epoch(s)" if steps is None else f"{steps}+ optimizer step(s)"


# -- what decides ----------------------------------------------------------------------------------
class Decision:
    """What decides: ``Trial``, ``StageFork`` or ``Rule`` (a plain base class, as ``Schedule``)."""

    name: ClassVar[str]


def _gain(arg: str, value: Any) -> float:
    """A ``min_gain``: a finite fraction >= 0 of the probe loss (the first-order rule alone is ``Rule``)."""
    _number(arg, value, fix=f"pass {_spelled(arg, '0.01')} (1 % of the probe loss), or decision='rule' for the "
                            "first-order rule alone")  # fmt: skip
    return float(value)


@dataclass(frozen=True)
class Trial(Decision):
    """Every check trains a fresh block alone at the best first-order site of each stage, on the
    training loader's batches, and grows iff one lowers the probe loss by a certified more than
    ``min_gain`` of it (docs/decision.md).

    Args:
        min_gain: the fraction of the probe loss a trial block must certifiably gain.
        epochs: a trial's budget per site, in epochs of the training loader (Adam, >= 100 steps).
    """

    name: ClassVar[str] = "trial"

    min_gain: float = DEFAULT_MIN_GAIN
    epochs: float = DEFAULT_TRIAL_EPOCHS

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_gain", _gain("Trial.min_gain", self.min_gain))
        _number("Trial.epochs", self.epochs, strict=True, fix=f"pass Trial(epochs={DEFAULT_TRIAL_EPOCHS})")
        object.__setattr__(self, "epochs", float(self.epochs))


@dataclass(frozen=True)
class StageFork(Decision):
    """(A ``Periodic`` schedule only.) The run against a copy with one more block at the best
    first-order site of every stage, trained on the same batches until the next check and compared
    on the probe: all the blocks grow together iff the copy's loss is lower by a certified more than
    ``min_gain`` of it (growtrain/fork.py).

    Args:
        min_gain: the fraction of the probe loss the copy must certifiably gain.
    """

    name: ClassVar[str] = "stage_fork"

    min_gain: float = DEFAULT_MIN_GAIN

    def __post_init__(self) -> None:
        object.__setattr__(self, "min_gain", _gain("StageFork.min_gain", self.min_gain))


@dataclass(frozen=True)
class Rule(Decision):
    """The first-order rule alone decides every check (``rule``, ``delta``, ``t``, ``alpha``): the paper's
    reproduction."""

    name: ClassVar[str] = "rule"


_SCHEDULE_CLASSES = {cls.kind: cls for cls in (Converged, Periodic)}
_DECISION_CLASSES = {cls.name: cls for cls in (Trial, Rule, StageFork)}


def _part(arg: str, value: Any, classes: dict[str, type]) -> Any:
    """A part given as its name (the class with its defaults) or as an instance of one of ``classes``."""
    if isinstance(value, tuple(classes.values())):
        return value
    if isinstance(value, str) and value in classes:
        return classes[value]()
    names = " or ".join(f"{c.__name__}(...)" for c in classes.values())
    hint = f" (an instance: {value.__name__}())" if isinstance(value, type) and value in classes.values() else ""
    first = next(iter(classes))
    raise _bad(arg, f"one of {tuple(classes)} or {names}{hint}", value, f"pass {arg}={first!r}")


@dataclass(frozen=True)
class GrowthConfig:
    """The options of ``GrowUntilSaturated`` (documented there), checked at construction. ``schedule``
    and ``decision`` hold the resolved parts (a ``Converged``/``Periodic`` and a ``Trial``/``StageFork``/
    ``Rule`` instance) once constructed."""

    probe: DataLoader | Callable[[], Iterable] | None = None
    network: str | nn.Module | None = None
    loss_fn: Callable[[Any, Any], Any] | None = None
    schedule: Literal["converged", "periodic"] | Converged | Periodic = "converged"
    decision: Literal["trial", "rule", "stage_fork"] | Trial | StageFork | Rule | None = None
    delta: float = 0.0
    alpha: float = 0.05
    t: float | None = None
    rule: Literal["paper", "crossfit"] | None = None
    max_growths: int | None = None
    max_params: int | None = None
    on_saturated: Literal["stop", "continue", "anneal"] = "stop"
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
        object.__setattr__(self, "schedule", schedule := _part("schedule", self.schedule, _SCHEDULE_CLASSES))
        periodic = isinstance(schedule, Periodic)
        self._check_decision()
        if periodic and self.lr_schedule == "anneal" and isinstance(self.decision, StageFork):
            raise _bad("lr_schedule", "'continue' or 'restart' with decision='stage_fork' (the run and the fork's copy "
                       "train at the constant rate until the check that compares them; the one anneal is the final "
                       "phase, on_saturated='anneal')", self.lr_schedule,
                       "drop lr_schedule, or pass decision='trial'")  # fmt: skip
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
        if self.t is not None and rule != "paper":
            warnings.warn(f"GrowUntilSaturated: t only sets the paper rule's threshold; rule={rule!r} decides by its "
                          "lower bound at level alpha, so t changes the reported figures only.", UserWarning,
                          stacklevel=4)  # fmt: skip
        _int("max_growths", self.max_growths, 0, optional=True)
        _int("max_params", self.max_params, 1, optional=True)
        _choice("on_saturated", self.on_saturated, ON_SATURATED)
        if self.lr_schedule is None and periodic:
            # checks at a fixed interval: the rate goes on as it is
            object.__setattr__(self, "lr_schedule", "continue")
        # else None stays until the fit starts: "anneal" (a converged stage is annealed before its check,
        # so what a check measures is not what annealing alone gives), or "continue" when the network's
        # optimizer has a scheduler of its own (GrowUntilSaturated.on_train_start says so)
        if self.lr_schedule is not None:
            _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if not isinstance(self.verbose, bool):
            raise _bad("verbose", "True or False", self.verbose, "pass verbose=True")
        _int("seed", self.seed, 0)
        name = self.decision.name
        if self.delta != type(self).delta and name != "rule":  # the class attribute: the field's default
            # the trial and the fork grow on a certified gain over min_gain, and rank the sites by a lower bound δ
            # does not move: δ reaches only the first-order verdict each check reports
            warnings.warn(f"GrowUntilSaturated: delta={self.delta!r} only changes the reported first-order verdict: "
                          f"under decision={name!r} a block grows when it certifies min_gain of the probe "
                          "loss, and the sites are ranked by a lower bound that delta does not move. Fix: drop delta, "
                          "or pass decision='rule' to decide by the first-order rule with this margin.", UserWarning,
                          stacklevel=4)  # fmt: skip
        for field in ("delta", "alpha"):
            object.__setattr__(self, field, float(getattr(self, field)))

    def _check_decision(self) -> None:
        periodic = isinstance(self.schedule, Periodic)
        decision = self.decision
        if decision is None:  # the schedule's own decision
            decision = StageFork() if periodic else Trial()
        decision = _part("decision", decision, _DECISION_CLASSES)
        if isinstance(decision, StageFork) and not periodic:
            raise _bad("decision", "'stage_fork' only with schedule='periodic' (a fork opened at one check is judged "
                       "at the next, every_n_epochs later)", decision.name,
                       "pass schedule='periodic', or decision='trial'")  # fmt: skip
        object.__setattr__(self, "decision", decision)

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]
