"""Learning-rate schedules in ``compare``: what a module's schedule is, when it ends, and the
same schedule stretched onto another budget.

The protocol (see ``growtrain.experiments.compare``): a schedule is defined on the epoch cap
``max_epochs`` shared by the converged arms (the paper: ×0.1 at epochs 100 and 150 of at most
300). The compute-matched Scratch arm has a budget instead of a cap, so its schedule is the
same shape stretched by ``factor = budget steps / (max_epochs × steps per epoch)``: milestones,
``step_size``, ``T_max`` and warmup/total lengths are multiplied and rounded. Only schedules
whose meaning is known are stretched; anything else is refused by name before training.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from lightning.pytorch import LightningModule
from torch.optim.lr_scheduler import CosineAnnealingLR, LRScheduler, MultiStepLR, StepLR

from growtrain.optim import WarmupCosine

__all__ = ["RESCALABLE", "ScheduleInfo", "inspect_schedule", "rescaled", "with_rescaled_schedule"]

# Exact types: a subclass may change what its arguments mean.
RESCALABLE = (MultiStepLR, StepLR, CosineAnnealingLR, WarmupCosine)


class ScheduleInfo:
    """The schedulers a module's ``configure_optimizers`` returns, each with its interval."""

    def __init__(self, schedulers: list[tuple[Any, str]]):
        self.schedulers = schedulers

    @property
    def names(self) -> list[str]:
        return [type(s).__name__ for s, _ in self.schedulers]

    def unsupported(self) -> list[str]:
        return [type(s).__name__ for s, _ in self.schedulers if type(s) not in RESCALABLE]

    def end_epoch(self, steps_per_epoch: int | None) -> float:
        """The epoch from which every learning rate stays constant (0: no scheduler; ``inf``:
        never, e.g. StepLR keeps decaying and CosineAnnealingLR rises again after ``T_max``).
        A step-interval schedule needs ``steps_per_epoch``."""
        end = 0.0
        for scheduler, interval in self.schedulers:
            if type(scheduler) is MultiStepLR:
                last = max(scheduler.milestones.elements(), default=0)
            elif type(scheduler) is WarmupCosine:
                last = scheduler.total_steps
            else:
                return math.inf
            if interval == "step":
                if not steps_per_epoch:
                    return math.inf
                last = math.ceil(last / steps_per_epoch)
            end = max(end, float(last))
        return end


def _scheduler_configs(config: Any) -> list[Any]:
    """The scheduler entries (a scheduler or a Lightning scheduler dict) of a
    ``configure_optimizers`` return value, in every form Lightning accepts."""
    if config is None or isinstance(config, torch.optim.Optimizer):
        return []
    if isinstance(config, dict):
        entry = config.get("lr_scheduler")
        return [] if entry is None else [entry]
    if isinstance(config, (list, tuple)):
        if len(config) == 2 and isinstance(config[0], (list, tuple)):
            second = config[1]
            return list(second) if isinstance(second, (list, tuple)) else [second]
        return [e for item in config for e in _scheduler_configs(item)]
    return [config] if isinstance(config, LRScheduler) else []


def _unwrap(entry: Any) -> tuple[Any, str]:
    if isinstance(entry, dict):
        return entry.get("scheduler"), entry.get("interval", "epoch")
    return entry, "epoch"


def inspect_schedule(module: LightningModule) -> ScheduleInfo:
    """Call ``module.configure_optimizers()`` on throwaway optimizer state and list its schedulers.

    Nothing is trained; the module's parameters are not changed (a scheduler only sets the
    learning rates of the fresh optimizer it was given).
    """
    try:
        config = module.configure_optimizers()
    except Exception as err:  # e.g. it reads self.trainer, which is not attached yet
        raise ValueError(
            f"model: compare needs to read {type(module).__name__}.configure_optimizers() before training "
            f"(to check the schedule can be rescaled), and it raised {type(err).__name__}: {err}. "
            "Make configure_optimizers work without a trainer, or use compute_matched=false."
        ) from err
    return ScheduleInfo([_unwrap(e) for e in _scheduler_configs(config)])


def _scaled(value: int, factor: float, minimum: int = 1) -> int:
    return max(minimum, int(round(value * factor)))


def rescaled(scheduler: Any, factor: float) -> LRScheduler:
    """A new scheduler of the same type on the same optimizer, its lengths × ``factor``."""
    kind = type(scheduler)
    opt = scheduler.optimizer
    if kind is MultiStepLR:
        milestones = [_scaled(m, factor) for m in scheduler.milestones.elements()]  # keeps repeats
        return MultiStepLR(opt, milestones=sorted(milestones), gamma=scheduler.gamma)
    if kind is StepLR:
        return StepLR(opt, step_size=_scaled(scheduler.step_size, factor), gamma=scheduler.gamma)
    if kind is CosineAnnealingLR:
        return CosineAnnealingLR(opt, T_max=_scaled(scheduler.T_max, factor), eta_min=scheduler.eta_min)
    if kind is WarmupCosine:
        warmup = _scaled(scheduler.warmup_steps, factor, minimum=0)
        total = max(warmup, _scaled(scheduler.total_steps, factor))
        return WarmupCosine(opt, warmup_steps=warmup, total_steps=total, min_lr_ratio=scheduler.min_lr_ratio)
    raise ValueError(
        f"lr_scheduler: compare cannot rescale {kind.__name__} to the compute-matched arm's budget "
        f"(known: {', '.join(k.__name__ for k in RESCALABLE)}). Use one of those, or compute_matched=false."
    )


def _map(config: Any, fn: Callable[[Any], Any]) -> Any:
    """``config`` with every scheduler replaced by ``fn(scheduler)``, structure kept."""
    if config is None or isinstance(config, torch.optim.Optimizer):
        return config
    if isinstance(config, LRScheduler):
        return fn(config)
    if isinstance(config, dict):
        if "scheduler" in config and "optimizer" not in config:  # a Lightning scheduler dict
            return {**config, "scheduler": fn(config["scheduler"])}
        if config.get("lr_scheduler") is None:
            return config
        return {**config, "lr_scheduler": _map(config["lr_scheduler"], fn)}
    if isinstance(config, (list, tuple)):
        return type(config)(_map(item, fn) for item in config)
    return config


def with_rescaled_schedule(module: LightningModule, factor: float) -> LightningModule:
    """Make ``module.configure_optimizers`` return its schedulers stretched by ``factor``."""
    if not (factor > 0 and math.isfinite(factor)):
        raise ValueError(f"factor: expected a finite positive stretch of the schedule, got {factor}")
    original = module.configure_optimizers

    def configure_optimizers():
        return _map(original(), lambda scheduler: rescaled(scheduler, factor))

    module.configure_optimizers = configure_optimizers  # an instance attribute: this module only
    return module
