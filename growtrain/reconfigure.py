"""Optimizer and LR-scheduler reconfiguration after a block is inserted mid-fit.

Plain functions, no Lightning hooks: :class:`growtrain.callbacks.GrowUntilSaturated` decides
*when* to call them, these decide *what* changes.

The rules (docs/design.md §4 "The growth step", the paper's zero-state optimizer rule):

* New parameters join the *existing* optimizer with ``add_param_group``, one named group per
  growth event (``growth{k}``, ``growth{k}/no_decay``; the layout ``growtrain.optim.param_groups``
  builds from ``growth_log``, so a resumed run's ``configure_optimizers`` lines up by position).
  Their optimizer state is empty: SGD momentum, Adam moments and Adam's ``step`` start at zero.
* Old parameters keep their state objects untouched. Parameters are matched by identity,
  never by value (a fresh zero-output block's terminal map is all zeros).
* ``continue``: every scheduler's per-group lists (``base_lrs``, ``_last_lr``, ``lr_lambdas``,
  ``min_lrs``, ``max_lrs``) grow by one entry per new group, copied from the group's
  reference (the ``base`` group of the same decay kind, else group 0); the new group's ``lr`` is
  "where the schedule is now": ``base_lr_new × lr_ref / base_lr_ref``.
* ``restart``: a fresh scheduler for the new stage, bound to the existing optimizer, from the
  module's own ``configure_optimizers`` (transplanted onto the live optimizer) or else by
  re-instantiating the old scheduler's class with its constructor arguments. Learning rates go
  back to the schedule's step 0; interval, frequency and monitor stay those of the old config.
"""

from __future__ import annotations

import copy
import inspect
from dataclasses import replace
from typing import Any, Iterable, Literal, Sequence

import torch
from torch import nn
from torch.optim import Optimizer
from torch.optim.lr_scheduler import LRScheduler, ReduceLROnPlateau

__all__ = [
    "LR_SCHEDULES",
    "new_param_groups",
    "add_param_groups",
    "extend_scheduler",
    "continue_schedulers",
    "restart_schedulers",
    "reconfigure_optimizer",
]

LR_SCHEDULES = ("continue", "restart")
LRSchedule = Literal["continue", "restart"]

# Scheduler attributes that hold one entry per param group (torch 2.x names).
_PER_GROUP_LISTS = ("base_lrs", "_last_lr", "lr_lambdas", "min_lrs", "max_lrs")
# Schedulers that wrap others (SequentialLR, ChainedScheduler) keep them here.
_CHILDREN = ("_schedulers",)


# -- new parameter groups ----------------------------------------------------------------------
def _reference_index(optimizer: Optimizer, name: str | None, k: int) -> int:
    """The old group a new group copies its hyper-parameters from: ``base`` for ``growth{k}``,
    ``base/no_decay`` for ``growth{k}/no_decay``; group 0 when the optimizer has no such names."""
    if name is not None:
        wanted = name.replace(f"growth{k}", "base", 1)
        for i, group in enumerate(optimizer.param_groups):
            if group.get("name") == wanted:
                return i
    return 0


def _clone_value(value: Any) -> Any:
    # A tensor lr (capturable/fused optimizers) must not be shared between groups: schedulers
    # update it in place.
    return value.clone() if isinstance(value, torch.Tensor) else copy.copy(value)


def new_param_groups(
    module: nn.Module, block: nn.Module, k: int, optimizer: Optimizer
) -> tuple[list[dict], list[int]]:
    """Param groups for a just-inserted ``block`` (growth index ``k``) and their reference groups.

    The groups' parameters and overrides come from ``growtrain.optim.groups_for_new_parameters``
    (so ``module.param_group_options`` such as ``no_decay`` apply as in ``configure_optimizers``);
    every other hyper-parameter is copied from the reference group, and ``lr`` / ``initial_lr``
    follow the schedule's current point (see the module docstring).

    Returns:
        ``(groups, reference_indices)``: ready for ``optimizer.add_param_group``, and for each
        group the index of the old group whose schedule it follows.
    """
    from growtrain.optim import groups_for_new_parameters

    groups = groups_for_new_parameters(module, block, k)
    refs = []
    for group in groups:
        ref_i = _reference_index(optimizer, group.get("name"), k)
        ref = optimizer.param_groups[ref_i]
        explicit_lr = group.get("lr")
        for key, value in ref.items():
            if key not in ("params", "name") and key not in group:
                group[key] = _clone_value(value)
        if explicit_lr is not None:  # the group rule gave this group its own base lr
            ref_base = ref.get("initial_lr", ref["lr"])
            scale = float(ref["lr"]) / float(ref_base) if float(ref_base) != 0 else 1.0
            group["lr"] = float(explicit_lr) * scale
            if "initial_lr" in ref:
                group["initial_lr"] = float(explicit_lr)
        refs.append(ref_i)
    return groups, refs


def add_param_groups(optimizer: Optimizer, groups: Sequence[dict]) -> list[int]:
    """``add_param_group`` each group after checking, by identity, that no parameter is already
    in the optimizer or has optimizer state. Returns the new groups' indices.

    Nothing is added when a check fails (a ``ValueError`` names the offending group).
    """
    known = {id(p) for g in optimizer.param_groups for p in g["params"]}
    seen: set[int] = set()
    for group in groups:
        for p in group["params"]:
            if id(p) in known or id(p) in seen:
                raise ValueError(
                    f"groups: a parameter of group {group.get('name')!r} (shape {tuple(p.shape)}) is already in "
                    "the optimizer; new blocks must bring fresh parameters (matched by identity)"
                )
            if p in optimizer.state and optimizer.state[p]:
                raise ValueError(f"groups: a parameter of group {group.get('name')!r} already has optimizer state")
            seen.add(id(p))
    start = len(optimizer.param_groups)
    for group in groups:
        optimizer.add_param_group(dict(group))
    return list(range(start, len(optimizer.param_groups)))


# -- continue ------------------------------------------------------------------------------
def _scheduler_tree(scheduler: Any) -> list[Any]:
    out = [scheduler]
    for attr in _CHILDREN:
        for child in getattr(scheduler, attr, None) or []:
            out += _scheduler_tree(child)
    return out


def extend_scheduler(
    scheduler: LRScheduler | ReduceLROnPlateau, ref_indices: Sequence[int], optimizer: Optimizer
) -> None:
    """Give ``scheduler`` one entry per new param group, copied from each group's reference.

    ``ref_indices[j]`` is the reference of the ``j``-th new group (the new groups are the last
    ``len(ref_indices)`` groups of ``optimizer``). ``base_lrs`` gets the new group's
    ``initial_lr`` (its own base), ``_last_lr`` its current ``lr``; ``lr_lambdas`` (LambdaLR,
    MultiplicativeLR, ``growtrain.optim.WarmupCosine``), ``min_lrs`` (ReduceLROnPlateau) and
    ``max_lrs`` (CyclicLR) copy the reference's entry. Wrapped schedulers (SequentialLR,
    ChainedScheduler) are extended too.
    """
    n_new = len(ref_indices)
    n_old = len(optimizer.param_groups) - n_new
    new_groups = optimizer.param_groups[n_old:]
    for sched in _scheduler_tree(scheduler):
        for attr in _PER_GROUP_LISTS:
            values = getattr(sched, attr, None)
            if not isinstance(values, list):
                continue
            if len(values) == n_old + n_new:
                continue  # already extended (a wrapper and its child can share a list)
            if len(values) != n_old:
                raise ValueError(
                    f"scheduler: {type(sched).__name__}.{attr} has {len(values)} entries but the optimizer had "
                    f"{n_old} param groups before growth; cannot extend it. Use lr_schedule='restart'."
                )
            for ref, group in zip(ref_indices, new_groups):
                if attr == "base_lrs":
                    values.append(_clone_value(group.get("initial_lr", group["lr"])))
                elif attr == "_last_lr":
                    values.append(_clone_value(group["lr"]))
                else:
                    values.append(values[ref])


def continue_schedulers(configs: Iterable[Any], ref_indices: Sequence[int], optimizer: Optimizer) -> None:
    """``extend_scheduler`` for every scheduler config bound to ``optimizer``."""
    for config in configs:
        sched = getattr(config, "scheduler", config)
        if getattr(sched, "optimizer", None) is optimizer:
            extend_scheduler(sched, ref_indices, optimizer)


# -- restart -------------------------------------------------------------------------------
def _bind(scheduler: Any, optimizer: Optimizer) -> None:
    for sched in _scheduler_tree(scheduler):
        if hasattr(sched, "optimizer"):
            sched.optimizer = optimizer


def _fresh_from_module(module: Any, optimizer: Optimizer) -> list | None:
    """Re-run ``module.configure_optimizers()`` and move its schedulers onto ``optimizer``.

    Works when the fresh optimizer has the live one's group layout (same parameters, by
    identity, group by group), as ``growtrain.optim.param_groups`` guarantees. Copies the fresh
    groups' hyper-parameters (``lr`` at the schedule's step 0, ``initial_lr``, any key a
    scheduler set) into the live groups; the live optimizer *state* is not touched.
    Returns the fresh scheduler configs, or ``None`` when the layouts differ.
    """
    from lightning.pytorch.core.optimizer import _configure_optimizers, _configure_schedulers_automatic_opt

    configure = getattr(module, "configure_optimizers", None)
    if configure is None:
        return None
    optimizers, schedulers, monitor = _configure_optimizers(configure())
    if not optimizers or optimizers[0] is optimizer:
        return None  # e.g. LightningCLI's auto-configured optimizer: the same, stale object
    fresh = optimizers[0]
    if len(fresh.param_groups) != len(optimizer.param_groups):
        return None
    for new, old in zip(fresh.param_groups, optimizer.param_groups):
        if [id(p) for p in new["params"]] != [id(p) for p in old["params"]]:
            return None
    configs = _configure_schedulers_automatic_opt(schedulers, monitor)
    for new, old in zip(fresh.param_groups, optimizer.param_groups):
        for key, value in new.items():
            if key != "params":
                old[key] = _clone_value(value)
    for config in configs:
        _bind(config.scheduler, optimizer)
    return configs


def _constructor_arguments(scheduler: Any) -> dict[str, Any]:
    """Constructor arguments of a torch scheduler read back from its attributes."""
    aliases = {"lr_lambda": "lr_lambdas", "min_lr": "min_lrs", "max_lr": "max_lrs", "base_lr": "base_lrs"}
    params = inspect.signature(type(scheduler).__init__).parameters
    kwargs = {}
    for name, param in params.items():
        variadic = param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD)
        if name in ("self", "optimizer", "last_epoch", "verbose") or variadic:
            continue
        attr = name if hasattr(scheduler, name) else aliases.get(name)
        if attr is None or not hasattr(scheduler, attr):
            if param.default is inspect.Parameter.empty:
                raise TypeError(
                    f"scheduler: cannot recover {type(scheduler).__name__}'s constructor argument {name!r} from its "
                    "attributes; use lr_schedule='continue' or build param groups with growtrain.optim.param_groups"
                )
            continue
        value = getattr(scheduler, attr)
        if name == "milestones":
            value = sorted(value.elements()) if hasattr(value, "elements") else sorted(value)
        kwargs[name] = copy.copy(value)
    return kwargs


def _reinstantiate(config: Any, optimizer: Optimizer, base_lrs: list[float]) -> Any:
    old = config.scheduler
    for group, lr in zip(optimizer.param_groups, base_lrs):
        group["lr"] = lr
    kwargs = _constructor_arguments(old)
    sched = type(old)(optimizer, **kwargs)
    return replace(config, scheduler=sched)


def restart_schedulers(module: Any, optimizer: Optimizer, configs: Sequence[Any]) -> list[Any]:
    """Fresh schedulers for a new growth stage, bound to the live ``optimizer``.

    Args:
        module: the LightningModule whose ``configure_optimizers`` built the schedules (may be
            ``None``: then the old schedulers' classes are re-instantiated).
        optimizer: the live optimizer (its parameter state is kept).
        configs: the live ``LRSchedulerConfig`` s (``trainer.strategy.lr_scheduler_configs``).

    Returns:
        New configs in the same order, each with the old ``interval``, ``frequency``,
        ``monitor``, ``name``, ``strict`` and a scheduler at step 0.
    """
    mine = [c for c in configs if getattr(c.scheduler, "optimizer", None) is optimizer]
    if not mine:
        return list(configs)
    fresh = _fresh_from_module(module, optimizer) if module is not None else None
    out = []
    if fresh is not None and len(fresh) == len(mine):
        it = iter(fresh)
        for c in configs:
            out.append(replace(c, scheduler=next(it).scheduler) if c in mine else c)
        return out
    # Fallback: same class, same constructor arguments, lr back to each group's base.
    default = optimizer.defaults.get("lr")
    base_lrs = [g.get("initial_lr", default if default is not None else g["lr"]) for g in optimizer.param_groups]
    for g in optimizer.param_groups:
        g.pop("initial_lr", None)  # the new scheduler sets it from the reset lr
    for c in configs:
        out.append(_reinstantiate(c, optimizer, base_lrs) if c in mine else c)
    return out


# -- one call for the callback ---------------------------------------------------------------
def reconfigure_optimizer(
    module: nn.Module,
    optimizer: Optimizer,
    configs: Sequence[Any],
    blocks: Sequence[nn.Module],
    ks: Sequence[int],
) -> list[int]:
    """Add every new block's groups to ``optimizer`` (zero state) and continue the schedules.

    ``blocks[i]`` was inserted as growth ``ks[i]``. Returns the new groups' indices. Schedules
    always continue here; a restart is a separate step (:func:`restart_schedulers`), so that an
    epoch-interval scheduler can take its pending end-of-epoch step first.
    """
    all_groups, all_refs = [], []
    for block, k in zip(blocks, ks):
        groups, refs = new_param_groups(module, block, k, optimizer)
        all_groups += groups
        all_refs += refs
    indices = add_param_groups(optimizer, all_groups)
    continue_schedulers(configs, all_refs, optimizer)
    return indices

