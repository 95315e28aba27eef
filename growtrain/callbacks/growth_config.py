"""``GrowthConfig``: every option of ``GrowUntilSaturated``, validated in one place: the callback's
own options, and its parts (parts.py: when, ``Budget``/``Converged``/``Periodic``/``Plan``; what
decides, ``BudgetFork``/``Trial``/``StageFork``/``Rule``; and the ``insertion``) checked against
each other. Each check raises a ``ValueError`` that names the argument, what was expected, what was
given and the fix, at construction — before any training or state change.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Any, Callable, Iterable, Literal

from torch import nn
from torch.utils.data import DataLoader

from growtrain.budget import plan_problem
from growtrain.callbacks.parts import (MIN_FORK_STEPS, Budget, BudgetFork, Converged, Periodic, Plan, Rule,
                                       StageFork, Trial, _bad, _choice, _int, _number, _SCHEDULE_CLASSES,
                                       _DECISION_CLASSES, part)  # fmt: skip
from growtrain.decision import DEFAULT_RULE
from growtrain.insertion import INSERTIONS
from growtrain.reconfigure import LR_SCHEDULES as _SCHEDULER_MODES

__all__ = ["GrowthConfig", "ON_SATURATED", "LR_SCHEDULES", "DECISIONS", "SCHEDULES", "CALLBACK_RULES", "option_property",
           "read_only"]  # fmt: skip

ON_SATURATED = ("stop", "continue", "anneal")
# "budget_fork" (a Budget schedule): a fork priced against the fit's compute budget (budget.py); "trial": every check
# trains candidate blocks alone and grows iff one certifies min_gain (docs/decision.md); "rule": the first-order rule
# alone; "stage_fork" (a Periodic schedule): the run against a copy with one more block in every stage, trained on the
# same batches until the next check, compared on the probe (growtrain/fork.py).
DECISIONS = ("budget_fork", "trial", "rule", "stage_fork")
# The first-order rules a check decides or chooses its site by.
CALLBACK_RULES = ("paper", "crossfit")
# When: "budget" (decisions early in the fit's compute budget, the default), "converged" (a stage plateaus, optionally
# annealed, then is judged: the paper's protocol), "periodic" (every every_n_epochs, one final anneal at the end) or
# "plan" (set points of the fit, no test: Plan(at=...); the name alone grows one block at a quarter of the fit).
SCHEDULES = ("budget", "converged", "periodic", "plan")
# "continue"/"restart": what the user's schedulers do after a growth; "anneal": the callback drives
# the learning rate itself (constant per stage, a cosine anneal before each check, back up after a growth).
LR_SCHEDULES = (*_SCHEDULER_MODES, "anneal")


@dataclass(frozen=True)
class GrowthConfig:
    """The options of ``GrowUntilSaturated`` (documented there), checked at construction. ``schedule``,
    ``decision`` and ``insertion`` hold the resolved parts once constructed (``decision`` is ``None``
    under a ``Plan``: nothing decides)."""

    probe: DataLoader | Callable[[], Iterable] | None = None
    network: str | nn.Module | None = None
    loss_fn: Callable[[Any, Any], Any] | None = None
    schedule: Literal["budget", "converged", "periodic"] | Budget | Converged | Periodic | Plan = "budget"
    decision: Literal["budget_fork", "trial", "rule", "stage_fork"] | BudgetFork | Trial | StageFork | Rule | None = None
    insertion: Literal["zero", "copy_zero", "mask_ramp", "copy", "copy_ramp"] | None = None
    delta: float = 0.0
    alpha: float = 0.05
    t: float | None = None
    rule: Literal["paper", "crossfit"] | None = None
    max_growths: int | None = None
    on_saturated: Literal["stop", "continue", "anneal"] | None = None
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
        object.__setattr__(self, "schedule", schedule := part("schedule", self.schedule, _SCHEDULE_CLASSES))
        periodic, kind = isinstance(schedule, Periodic), schedule.kind
        self._check_decision()
        self._check_insertion()
        if kind in ("budget", "plan"):
            self._check_driven(kind)
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
        if self.on_saturated is None:  # a budget trains its final network to the budget's end (and anneals it)
            object.__setattr__(self, "on_saturated", "continue" if kind in ("budget", "plan") else "stop")
        _choice("on_saturated", self.on_saturated, ON_SATURATED)
        if self.lr_schedule is None and periodic:
            # checks at a fixed interval: the rate goes on as it is
            object.__setattr__(self, "lr_schedule", "continue")
        # else None stays until the fit starts: "anneal" (a converged stage is annealed before its check,
        # so what a check measures is not what annealing alone gives), or "continue" when the network's
        # optimizer has a scheduler of its own (GrowUntilSaturated.on_train_start says so); a budget drives the
        # rate itself and a plan leaves it to the optimizer's schedulers
        if self.lr_schedule is not None:
            _choice("lr_schedule", self.lr_schedule, LR_SCHEDULES)
        if not isinstance(self.verbose, bool):
            raise _bad("verbose", "True or False", self.verbose, "pass verbose=True")
        _int("seed", self.seed, 0)
        name = self.decision.name if self.decision is not None else None
        if self.delta != type(self).delta and name != "rule":  # the class attribute: the field's default
            # the trial and the forks grow on a certified gain over min_gain, and rank the sites by a lower bound δ
            # does not move: δ reaches only the first-order verdict each check reports
            warnings.warn(f"GrowUntilSaturated: delta={self.delta!r} only changes the reported first-order verdict: "
                          f"under decision={name!r} a block grows when it certifies min_gain of the probe "
                          "loss, and the sites are ranked by a lower bound that delta does not move. Fix: drop delta, "
                          "or pass decision='rule' to decide by the first-order rule with this margin.", UserWarning,
                          stacklevel=4)  # fmt: skip
        for field in ("delta", "alpha"):
            object.__setattr__(self, field, float(getattr(self, field)))

    def _check_decision(self) -> None:
        schedule = self.schedule
        kind = schedule.kind
        decision = self.decision
        if kind == "plan":
            if decision is not None:
                raise _bad("decision", "None with schedule=Plan(...) (a plan grows at its points with no test)",
                           decision, "drop decision, or pass schedule=Budget() to decide by measurement")  # fmt: skip
            return
        if decision is None:  # the schedule's own decision
            decision = {"budget": BudgetFork, "periodic": StageFork}.get(kind, Trial)()
        decision = part("decision", decision, _DECISION_CLASSES)
        if isinstance(decision, StageFork) and kind != "periodic":
            raise _bad("decision", "'stage_fork' only with schedule='periodic' (a fork opened at one check is judged "
                       "at the next, every_n_epochs later)", decision.name,
                       "pass schedule='periodic', or decision='trial'")  # fmt: skip
        if (kind == "budget") != isinstance(decision, BudgetFork):
            raise _bad("decision", "'budget_fork' exactly under schedule=Budget(...) (a budget decision is priced "
                       "against the fit's compute budget; the other decisions judge a converged or periodic check)",
                       decision.name, "pass schedule=Budget() with decision=BudgetFork(), or schedule='converged' "
                       f"with decision={decision.name!r}")  # fmt: skip
        if kind == "budget":
            problem = plan_problem(10**9, growth_phase=schedule.growth_phase, checks=schedule.checks,
                                   fork=decision.fork, decay=schedule.decay, warmup=schedule.warmup,
                                   min_fork_steps=MIN_FORK_STEPS)  # the fractions alone, before any fit
            if problem is not None:
                raise ValueError(f"schedule: {problem}.")
        object.__setattr__(self, "decision", decision)

    def _check_insertion(self) -> None:
        kind = self.schedule.kind
        insertion = self.insertion
        if insertion is None:  # function-preserving everywhere; under a budget the copy behind a ramp from zero,
            # which grew as the plain copy did where copy_zero stopped short (docs/results.md, 2026-12-08)
            insertion = "copy_ramp" if kind == "budget" else "zero"
        _choice("insertion", insertion, INSERTIONS)
        if kind in ("converged", "periodic") and insertion != "zero":
            raise _bad("insertion", f"'zero' under schedule={kind!r} (its checks score and insert the zero-output "
                       "candidates of the first-order probe)", insertion,
                       "drop insertion, or pass schedule=Budget() / Plan(...) to start blocks as copies")  # fmt: skip
        if kind == "budget" and insertion == "mask_ramp":
            raise _bad("insertion", "'copy_ramp', 'copy_zero', 'copy' or 'zero' under schedule=Budget() (a fresh "
                       "block behind a mask is not a copy of a trained one: MSG's insertion is a plan's)", insertion,
                       "pass insertion='copy_ramp'")  # fmt: skip
        object.__setattr__(self, "insertion", insertion)

    def _check_driven(self, kind: str) -> None:
        """Under a budget the callback drives the rate and trains to the budget's end; under a plan
        nothing is checked: the options of a check's schedule have no meaning there."""
        if self.on_saturated is not None:
            _choice("on_saturated", self.on_saturated, ON_SATURATED)
        if self.lr_schedule is not None:
            what = ("drives warmup-stable-decay over the budget itself" if kind == "budget"
                    else "leaves the rate to the optimizer's own schedulers")  # fmt: skip
            raise _bad("lr_schedule", f"None under schedule={kind!r} (it {what})", self.lr_schedule,
                       "drop lr_schedule (Budget's warmup, decay and min_lr_ratio shape the rate)")  # fmt: skip
        if self.on_saturated not in (None, "continue"):
            raise _bad("on_saturated", f"None under schedule={kind!r} (the final network trains to the fit's end"
                       f"{', annealed by the budget' if kind == 'budget' else ''})", self.on_saturated,
                       "drop on_saturated")  # fmt: skip

    @classmethod
    def names(cls) -> list[str]:
        return [f.name for f in fields(cls)]


def read_only(name: str) -> None:
    raise AttributeError(f"{name}: GrowUntilSaturated's options are read-only after construction (its parts were built "
                         f"from them, so a changed value would reach some and not others). Fix: build a new "
                         f"GrowUntilSaturated({name}=...) with the value.")  # fmt: skip


def option_property(name: str) -> property:
    return property(lambda self: getattr(self.config, name), lambda self, value: read_only(name),
                    doc=f"The ``{name}`` option as validated (``config.{name}``); read-only.")  # fmt: skip
