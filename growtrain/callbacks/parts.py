"""The parts of ``GrowUntilSaturated``, each a small frozen dataclass that checks its own fields at
construction (a ``ValueError`` naming the field, what was expected, what was given and the fix):

* when (``schedule``): :class:`Budget`, :class:`Converged`, :class:`Periodic`, :class:`Plan`;
* what decides (``decision``): :class:`BudgetFork`, :class:`Trial`, :class:`StageFork`, :class:`Rule`.

The strings ``"budget"``, ``"converged"``, ``"trial"``, ... name the class with its defaults
(``part``). ``GrowthConfig`` (growth_config.py) combines them with the callback's own options.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Sequence

from growtrain.budget import plan_problem  # noqa: F401  (GrowthConfig checks a budget's fractions with it)
from growtrain.decision import DEFAULT_MIN_GAIN
from growtrain.trial import DEFAULT_TRIAL_EPOCHS

__all__ = ["Budget", "Converged", "Periodic", "Plan", "BudgetFork", "Trial", "StageFork", "Rule", "MODES",
           "STATISTICS", "PLACEMENTS", "MIN_FORK_STEPS", "part"]  # fmt: skip

MODES = ("min", "max")
# What a budget decision judges (docs/budget.md): "fork", the equal-FLOP fork's gain at its end; "carried", that
# gain carried to the budget's end linearly in log FLOPs; "steps", the gain at equal optimizer steps carried to the
# budget's end, less what the fewer steps a deeper network can afford cost on the run's own learning curve.
STATISTICS = ("fork", "carried", "steps")
PLACEMENTS = ("last", "first", "interleave", "cyclic")


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
    """When a check comes: ``Budget``, ``Converged``, ``Periodic`` or ``Plan``. A plain base class, so that a config names the
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


# The fewest optimizer steps a budget decision's fork may have: below this its averaged weights are a handful of steps.
MIN_FORK_STEPS = 20


def _fraction(arg: str, value: Any, *, closed: bool = False) -> float:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not ((0.0 <= value < 1.0) if closed else (0.0 < value < 1.0)):
        raise _bad(arg, f"a fraction in {'[0, 1)' if closed else '(0, 1)'} of the budget", value,
                   f"pass {_spelled(arg, '0.1')}")  # fmt: skip
    return float(value)


@dataclass(frozen=True)
class Budget(Schedule):
    """The fit's compute budget (the default): read from the trainer when the fit starts (its optimizer
    steps at the start depth, in FLOPs: growtrain/budget.py), a decision at each of ``checks`` points
    spread over the first ``growth_phase`` of it, then the final network trained for the rest; the
    callback drives warmup-stable-decay over the budget (so every decision lands at the stable rate
    and the budget's end anneals the network it hands over). A deeper network spends the budget
    faster; the fit ends when it is spent, and what deciding costs comes out of it too.

    Args:
        growth_phase: the fraction of the budget by which the last decision opens.
        checks: decisions in the growth phase (evenly spaced; growth ends at the first that does not grow).
        decay: the fraction of the budget at its end over which the rate decays linearly.
        warmup: the fraction of the budget over which the rate warms up.
        min_lr_ratio: the rate at the budget's end, as a fraction of the optimizer's (the peak).
    """

    kind: ClassVar[str] = "budget"

    growth_phase: float = 0.3
    checks: int = 3
    decay: float = 0.2
    warmup: float = 0.01
    min_lr_ratio: float = 0.1

    def __post_init__(self) -> None:
        for name in ("growth_phase", "decay"):
            object.__setattr__(self, name, _fraction(f"Budget.{name}", getattr(self, name)))
        for name in ("warmup", "min_lr_ratio"):
            object.__setattr__(self, name, _fraction(f"Budget.{name}", getattr(self, name), closed=True))
        _int("Budget.checks", self.checks, 1)

    @property
    def anneal_epochs(self) -> int:  # the budget's decay is its anneal: no epochs reserved past it
        return 0


@dataclass(frozen=True)
class Plan(Schedule):
    """Growth at set points of the fit, with no test (the schedule-based growth of G_stack, MSG and
    Bu 2025: chosen times of a fixed budget): at each point of ``at`` insert ``blocks`` blocks at
    ``site``. The whole plan is checked when the fit starts, before a step is trained.

    Args:
        at: fractions in (0, 1) of the fit's optimizer steps (``trainer.estimated_stepping_batches``),
            or optimizer-step counts (integers ≥ 1, none past the fit's last step).
        blocks: blocks inserted at each point (one number for all, or one per point).
        site: ``"last"`` (on top), ``"first"``, ``"interleave"`` (one after each of evenly spaced existing
            blocks) in the last stage, or ``"cyclic"`` (the network's ``k``-th inserted block on top of
            stage ``k mod S``).
        ramp_steps: optimizer steps of the ``mask_ramp`` / ``copy_ramp`` insertions' masks.
    """

    kind: ClassVar[str] = "plan"

    at: Sequence[float | int] = (0.25,)
    blocks: int | Sequence[int] = 1
    site: Literal["last", "first", "interleave", "cyclic"] = "last"
    ramp_steps: int = 100

    def __post_init__(self) -> None:
        at = list(self.at) if isinstance(self.at, (list, tuple)) else self.at
        fix = "pass e.g. Plan(at=[0.1, 0.2]) (fractions of the fit) or Plan(at=[500, 1000]) (optimizer steps)"
        if not isinstance(at, list) or not at:
            raise _bad("Plan.at", "a non-empty list of fractions in (0, 1) or of optimizer steps", self.at, fix)
        fractions = all(isinstance(a, float) for a in at) and all(0.0 < a < 1.0 for a in at)
        steps = all(isinstance(a, int) and not isinstance(a, bool) and a >= 1 for a in at)
        if not (fractions or steps) or sorted(at) != at or len(set(at)) != len(at):
            raise _bad("Plan.at", "strictly increasing points, all fractions in (0, 1) (of the fit's optimizer "
                       "steps) or all integers >= 1 (optimizer steps)", self.at, fix)  # fmt: skip
        counts = [self.blocks] * len(at) if isinstance(self.blocks, int) else list(self.blocks)
        if len(counts) != len(at) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
            raise _bad("Plan.blocks", f"an integer >= 1 or one per point of at ({len(at)})", self.blocks,
                       "pass Plan(blocks=1)")  # fmt: skip
        _choice("Plan.site", self.site, PLACEMENTS)
        _int("Plan.ramp_steps", self.ramp_steps, 1)
        object.__setattr__(self, "at", tuple(at))
        object.__setattr__(self, "blocks", tuple(counts))

    @property
    def anneal_epochs(self) -> int:  # a plan's rate is the optimizer's own schedule
        return 0


# -- what decides ----------------------------------------------------------------------------------
class Decision:
    """What decides: ``BudgetFork``, ``Trial``, ``StageFork`` or ``Rule`` (a plain base class, as ``Schedule``)."""

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


@dataclass(frozen=True)
class BudgetFork(Decision):
    """(A ``Budget`` schedule only; its default.) At each decision a copy of the network with one more
    block on top of every stage (the ``insertion``) trains on the run's next batches for ``fork`` of the
    budget beside the run; both are scored on the held-out probe with their weights averaged over the
    fork; grow iff ``statistic`` says the deeper network pays by a certified more than ``min_gain`` of
    the run's probe loss. The run then takes the arm's weights and optimizer state (its training is
    kept); everything the arm and its scoring spend comes out of the budget.

    Args:
        fork: the fraction of the budget each decision trains over (each side).
        min_gain: the fraction of the run's probe loss the deeper network must certifiably gain.
        statistic: ``"steps"`` (the arm trains as many steps as the run; its gain, carried to the
            budget's end, is charged what fewer steps cost on the run's own learning curve),
            ``"fork"`` (the equal-FLOP fork's gain at its end) or ``"carried"`` (that gain carried to
            the budget's end linearly in log FLOPs). Every statistic's figures are recorded.
    """

    name: ClassVar[str] = "budget_fork"

    fork: float = 0.03
    min_gain: float = 0.0
    statistic: Literal["steps", "fork", "carried"] = "steps"

    def __post_init__(self) -> None:
        object.__setattr__(self, "fork", _fraction("BudgetFork.fork", self.fork))
        object.__setattr__(self, "min_gain", _gain("BudgetFork.min_gain", self.min_gain))
        _choice("BudgetFork.statistic", self.statistic, STATISTICS)


_SCHEDULE_CLASSES = {cls.kind: cls for cls in (Budget, Converged, Periodic, Plan)}
_DECISION_CLASSES = {cls.name: cls for cls in (BudgetFork, Trial, Rule, StageFork)}


def part(arg: str, value: Any, classes: dict[str, type]) -> Any:
    """A part given as its name (the class with its defaults) or as an instance of one of ``classes``."""
    if isinstance(value, tuple(classes.values())):
        return value
    if isinstance(value, str) and value in classes:
        return classes[value]()
    names = " or ".join(f"{c.__name__}(...)" for c in classes.values())
    hint = f" (an instance: {value.__name__}())" if isinstance(value, type) and value in classes.values() else ""
    first = next(iter(classes))
    raise _bad(arg, f"one of {tuple(classes)} or {names}{hint}", value, f"pass {arg}={first!r}")
