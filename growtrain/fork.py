"""The paired fork: what one more block is worth under the run's own training.

Pure functions (no Lightning). At a check the run forks: an *arm* is a copy of the network with a
fresh zero-output block at one site (function-preserving) and a copy of the run's optimizer (the
old parameters keep their state, matched by identity through the copy; the block's parameters
start with zero state, in the groups growth would give them). Until the next check the arm takes
one step on every batch the run trains on, on the run's own objective (the module's
``training_step``), at the run's own learning rate at that step; the run
itself is the *control*: the same network, the same batches, the same steps, without the block.
At the next check both are scored on the held-out probe (samples neither trained on) and each
sample's loss is paired: the block is worth ``mean(control − arm)``.

Why this and not a trial or a window: the block-only trial trains the block alone (a short
horizon that misses what the network re-learns around it: it stopped at 3–5 blocks against
d* = 7), and the window credits the block with everything the run learned over J epochs
(training progress: its depth followed the interval K like 1/K; removed, docs/results/history.md). The fork's two sides share the
state they start from, the batches and the rate, so what differs between them is the block.

* :func:`make_arm` — the arm and its optimizer.
* :func:`mirror_lrs` — the arm's groups follow the run's rates (schedulers, anneals).
* :func:`adopt` — the run takes the arm's weights and optimizer state after it grew the same block.
* :func:`fork_test` / :func:`fork_verdict` — the paired bounds and the decision's sentence.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Sequence

import torch
from torch import nn

from growtrain.decision import Verdict
from growtrain.growable import insertion_order
from growtrain.trial import trial_test

__all__ = ["make_arm", "copy_optimizer", "mirror_lrs", "warmup", "adopt", "fork_test", "fork_verdict"]


def copy_optimizer(optimizer: torch.optim.Optimizer, mapping: dict[int, torch.Tensor]) -> torch.optim.Optimizer:
    """A new optimizer of ``optimizer``'s class over ``mapping[id(p)]`` for every parameter ``p``
    it holds that ``mapping`` names (matched by identity), group by group (same indices and
    hyper-parameters; a group with none of them stays, empty, so indices line up), with each
    parameter's state cloned."""
    groups = []
    for group in optimizer.param_groups:
        hyper = {k: copy.deepcopy(v) for k, v in group.items() if k != "params"}
        groups.append({**hyper, "params": [mapping[id(p)] for p in group["params"] if id(p) in mapping]})
    if not any(g["params"] for g in groups):
        raise ValueError("optimizer: it holds none of the network's parameters (matched by identity); the fork's arm "
                         "would not train. Fix: build the optimizer over the growable network's parameters.")
    cls = type(optimizer)
    nonempty = [g for g in groups if g["params"]]
    try:
        new = cls(nonempty, **optimizer.defaults)
    except TypeError:  # a constructor that does not take every default back as a keyword
        new = cls(nonempty)
    # empty groups keep their place (the run's group i is the arm's group i)
    new.param_groups[:] = [g if g["params"] else {**g, "params": []} for g in groups]
    for group, copied in zip(groups, new.param_groups):
        for key, value in group.items():
            if key != "params" and key not in copied:
                copied[key] = value
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) in mapping and p in optimizer.state:
                new.state[mapping[id(p)]] = {k: (v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v))
                                             for k, v in optimizer.state[p].items()}  # fmt: skip
    return new


def make_arm(network: nn.Module, optimizer: torch.optim.Optimizer | None, site: str | Sequence[str], seed: int,
             new_groups: Callable[[nn.Module, torch.optim.Optimizer], list[int]] | None = None,
             ) -> tuple[nn.Module, torch.optim.Optimizer | None, nn.Module, list[int]]:  # fmt: skip
    """The arm: a deep copy of ``network`` with a fresh zero-output block (``network.new_block(site,
    seed)``) grown at ``site`` — or one at each of several sites, grown deepest index first within a
    stage as the callback's growth inserts them (seeds ``seed``, ``seed + 1``, ... in that order) —
    and a copy of ``optimizer`` over its parameters (identity mapping through the copy).
    ``new_groups(block, arm_optimizer)`` adds a block's parameter groups (zero state) and returns,
    for each added group, the index of the run's group whose rate it follows; ``None``: one group
    with the first group's hyper-parameters. Returns ``(arm, arm_optimizer, block, refs)`` (the
    last block grown)."""
    memo: dict[int, Any] = {}
    arm = copy.deepcopy(network, memo)
    mapping = {id(p): memo[id(p)] for p in network.parameters() if id(p) in memo}
    arm_opt = copy_optimizer(optimizer, mapping) if optimizer is not None else None
    refs: list[int] = []
    for k, name in enumerate(insertion_order([site] if isinstance(site, str) else list(site))):
        block = arm.grow(name, arm.new_block(name, seed=seed + k))
        if arm_opt is not None:
            if new_groups is not None:
                refs += list(new_groups(block, arm_opt))
            else:
                hyper = {k: copy.deepcopy(v) for k, v in arm_opt.param_groups[0].items() if k != "params"}
                arm_opt.add_param_group({**hyper, "params": list(block.parameters())})
                refs.append(0)
    return arm, arm_opt, block, refs


def mirror_lrs(arm_opt: torch.optim.Optimizer, optimizer: torch.optim.Optimizer, refs: Sequence[int],
               ratios: Sequence[float], warm: float = 1.0) -> None:  # fmt: skip
    """The arm's rates = the run's now: group ``i`` of the run's for the arm's copied groups, and
    ``warm`` × ``ratios[j]`` × the rate of the run's group ``refs[j]`` for the ``j``-th added group
    (the ratio it had when the fork opened, so a scheduler's or an anneal's factor applies to the
    block too; ``warm`` ∈ [0, 1] the block's warm-up, :func:`warmup`)."""
    n = len(optimizer.param_groups)
    for i in range(min(n, len(arm_opt.param_groups))):
        arm_opt.param_groups[i]["lr"] = optimizer.param_groups[i]["lr"]
    for j, (ref, ratio) in enumerate(zip(refs, ratios)):
        if n + j < len(arm_opt.param_groups):
            arm_opt.param_groups[n + j]["lr"] = float(optimizer.param_groups[ref]["lr"]) * ratio * warm


def warmup(step: int, steps: int) -> float:
    """The new block's rate factor at its ``step``-th optimizer step (1-based) of a ``steps``-step
    linear warm-up: ``step / steps``, then 1. Why: a fresh block at the run's full rate first
    disrupts the network — on full Fashion-MNIST, a block inserted at layer1.0 after one epoch
    (SGD 0.05, momentum 0.9) left the probe loss 70 % above the run without it 222 steps later and
    17 % above after 444; with the block's rate ramped over those 444 steps, 1 % (docs/decision.md,
    "The paired fork"). The fork would otherwise judge the transient, not the block."""
    return 1.0 if steps <= 0 else min(1.0, max(0, step) / steps)


def adopt(network: nn.Module, optimizer: torch.optim.Optimizer | None, arm: nn.Module,
          arm_opt: torch.optim.Optimizer | None) -> int:  # fmt: skip
    """After ``network`` grew the arm's block at the arm's site (same architecture): copy the arm's
    parameters and buffers into it, and each arm parameter's optimizer state to the run's
    parameter of the same name. Returns the number of parameters whose state was copied."""
    mine, theirs = dict(network.named_parameters()), dict(arm.named_parameters())
    if list(mine) != list(theirs) or any(mine[k].shape != theirs[k].shape for k in mine):
        raise RuntimeError("fork: the grown network and the arm differ in their parameters "
                           f"({sorted(set(mine) ^ set(theirs))[:4]}); the arm cannot be adopted")  # fmt: skip
    with torch.no_grad():
        network.load_state_dict(arm.state_dict())
    copied = 0
    if optimizer is not None and arm_opt is not None:
        for name, p in mine.items():
            state = arm_opt.state.get(theirs[name])
            if state:
                optimizer.state[p] = {k: (v.detach().clone().to(p.device) if torch.is_tensor(v) and v.dim() > 0
                                          else (v.detach().clone() if torch.is_tensor(v) else copy.deepcopy(v)))
                                      for k, v in state.items()}  # fmt: skip
                copied += 1
    return copied


def fork_test(control: torch.Tensor, arm: torch.Tensor, *, min_gain: float, level: float, seed: int = 0) -> dict:
    """The block's gain ``control − arm`` per held-out sample, with one-sided ``1 − level``
    bootstrap-t bounds (:func:`growtrain.trial.trial_test`, the control as "before")."""
    return trial_test(control, arm, min_gain=min_gain, level=level, seed=seed)


def fork_verdict(test: dict | None, *, site: str | None, min_gain: float, horizon: str, scored: str = "") -> Verdict:
    """Grow at ``site`` iff the arm's held-out loss is below the control's by a certified more than
    ``min_gain`` of it; otherwise end growth: "certified saturation" when the upper bound is below
    ``min_gain`` too, else "no certified gain" with the resolution. ``test`` ``None``: no fork was
    open (a fork opens at this check; nothing is decided). ``horizon``: the training the two sides
    shared, in words; ``scored``: how both sides were scored (e.g. "cooled over 111 steps")."""
    if test is None:
        return Verdict("fork", False, None, float("nan"), min_gain,
                       "fork: no fork was open; the network and a copy with one more block now train on the same "
                       f"batches for {horizon}, then the held-out probe compares them")  # fmt: skip
    level = test["level"]
    what = (f"with the block at {site}, {horizon} of the run's training lowered the probe loss (samples held "
            f"out from all training) by "
            f"{100 * test['gain_frac']:+.2f} % against the same training without it (at least "
            f"{100 * test['lower_frac']:+.2f} %, at most {100 * test['upper_frac']:+.2f} %, "
            f"{100 * (1 - level):.1f} % bounds, n={test['n']}{', both ' + scored if scored else ''})")  # fmt: skip
    if not (math.isfinite(test["lower_frac"]) and math.isfinite(test["upper_frac"])):
        return Verdict("fork", True, None, float("nan"), min_gain, f"no certified gain: the fork's losses are not "
                       f"finite ({what})")  # fmt: skip
    if test["lower_frac"] > min_gain:
        return Verdict("fork", False, site, test["lower_frac"], min_gain,
                       f"grow: {what} > min_gain {100 * min_gain:.2f} %")  # fmt: skip
    if test["upper_frac"] < min_gain:
        return Verdict("fork", True, None, test["lower_frac"], min_gain,
                       f"certified saturation: {what}: below min_gain {100 * min_gain:.2f} %", certified=True)
    half = 100 * (test["upper_frac"] - test["lower_frac"]) / 2
    return Verdict("fork", True, None, test["lower_frac"], min_gain,
                   f"no certified gain: {what}: not above min_gain {100 * min_gain:.2f} %; the probe resolves the "
                   f"block's gain to about ±{half:.2f} % of the loss")  # fmt: skip
