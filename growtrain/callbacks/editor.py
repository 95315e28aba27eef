"""The network editor of ``GrowUntilSaturated``: insert blocks (function-preserving, verified,
rolled back on failure), give them zero optimizer state, re-wrap DDP; find the network's optimizer.

Functions over the trainer and the module; the callback keeps only its counters.
"""

from __future__ import annotations

import math
import re
from typing import Any, Callable, Mapping

from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn

from growtrain import fsdp
from growtrain.batches import to_device
from growtrain.callbacks import sharded
from growtrain.callbacks.probe_data import ProbeView, eval_output
from growtrain.growable import grown_blocks, insertion_order, insertion_tolerance
from growtrain.reconfigure import reconfigure_optimizer

__all__ = ["FunctionChangedError", "ResumeGroups", "insertion_order", "grow", "optimizer_for", "output_change",
           "regroup_grown", "rewrap_ddp"]


class FunctionChangedError(RuntimeError):
    """An inserted block changed the network's output: the insertion was rolled back."""


def grow(trainer: Trainer, pl_module: LightningModule, network: nn.Module, blocks: Mapping[str, nn.Module],
         probe_input: Any, rewrap: Callable[[Trainer], None] | None = None) -> dict:  # fmt: skip
    """Insert ``blocks`` (site → zero-output candidate), check on ``probe_input`` that the output
    is unchanged, then give the new parameters zero optimizer state and re-wrap DDP.

    Returns ``max_abs_change``, ``tolerance``, ``growth_index`` (the growth log's indices) and
    ``restart`` (the network's optimizer has schedulers a ``"restart"`` would restart). ``rewrap``:
    what re-wraps DDP (the callback passes its own, so a test can replace it)."""
    device = next(network.parameters()).device
    view = ProbeView(pl_module, network)
    x = to_device(probe_input, device)
    before = eval_output(view, x)
    log_len = len(network.growth_log)
    sites = list(blocks)
    inserted: list[nn.Module] = []
    try:
        for name in insertion_order(sites):
            inserted.append(network.grow(name, block=blocks[name]))
        fsdp.shard_like_neighbours(network, inserted, root=pl_module)  # FSDP2: sharded like the neighbours
        after = eval_output(view, x)
        change, tolerance = output_change(before, after)
        if not change <= tolerance or after.shape != before.shape:  # a NaN change is never within tolerance
            raise FunctionChangedError(
                f"inserting blocks at {sites} changed the network's output on a probe batch by "
                f"max|Δ|={change:.3g} > tolerance {tolerance:.3g} ({before.dtype}); the insertion was undone. "
                "A zero-output block must leave the function unchanged: check the family's zero_init_last() and "
                "that the site's input is in the block's identity regime (e.g. z ≥ 0 for 'basic' blocks)."
            )
    except BaseException:
        network.undo_growth(inserted, log_len)  # the contract's rollback (resolve_network checked it)
        fsdp.reinit_root(pl_module)  # FSDP2: the root forgets the removed units (no-op otherwise)
        raise
    fsdp.reshard_all(pl_module)  # FSDP2: the optimizer takes the sharded DTensor parameters
    ks = list(range(log_len, log_len + len(inserted)))
    blocks_in_k_order = [b for b in grown_blocks(network) if any(b is i for i in inserted)] or inserted
    optimizer = optimizer_for(trainer, network)
    restart = False
    if optimizer is not None:
        reconfigure_optimizer(pl_module, optimizer, trainer.strategy.lr_scheduler_configs, blocks_in_k_order, ks)
        if fsdp.is_sharded(pl_module):  # explicit zero state: a sharded checkpoint needs an entry per parameter
            sharded.zero_state(optimizer, [p for b in inserted for p in b.parameters()])
        restart = bool(trainer.strategy.lr_scheduler_configs)
    (rewrap or rewrap_ddp)(trainer)
    return {"max_abs_change": change, "tolerance": tolerance, "growth_index": ks, "restart": restart}


def output_change(before: Any, after: Any) -> tuple[float, float]:
    """``(max|after − before|, tolerance)``: the one function-preservation check of every growth path
    (an insertion here, a plan's copy, a fork's arm against the run). Preserved iff
    ``change <= tolerance`` (``growtrain.growable.insertion_tolerance`` of the output's dtype and
    scale); a NaN change (or outputs of another shape) is ``inf``, never within it."""
    if before.shape != after.shape:
        return math.inf, 0.0
    change = float((after.float() - before.float()).abs().max()) if before.numel() else 0.0
    tolerance = insertion_tolerance(before.dtype, float(before.float().abs().max()) if before.numel() else 1.0)
    return (change if math.isfinite(change) else math.inf), tolerance


def optimizer_for(trainer: Trainer, network: nn.Module | None):
    """The optimizer holding the network's parameters (matched by identity), or ``None``."""
    if network is None:
        return None
    ids = {id(p) for p in network.parameters()}
    for opt in trainer.optimizers:
        if any(id(p) in ids for g in opt.param_groups for p in g["params"]):
            return opt
    if trainer.optimizers:
        rank_zero_warn("GrowUntilSaturated: no optimizer holds the network's parameters; new blocks were not added")
    return None


def _growth_index(name: Any) -> int | None:
    match = re.fullmatch(r"growth(\d+)(/.*)?", str(name))
    return int(match.group(1)) if match else None


def regroup_grown(trainer: Trainer, pl_module: LightningModule, network: nn.Module,
                  saved: list[list[Any]] | None) -> int:  # fmt: skip
    """Give a resumed fit's optimizer the groups growth gave the checkpoint's (``saved``: each
    saved optimizer's group names, from the checkpoint; ``None`` when the fit resumes nothing).

    Growth adds each block's parameters to the optimizer as new groups (``growth{k}``, zero
    state) after the existing ones, and the checkpoint's optimizer state lines up with that layout
    by position. A plain ``configure_optimizers`` over ``self.parameters()`` of the rebuilt grown
    network puts those blocks' parameters in its own groups instead. Lightning calls
    ``on_fit_start`` after ``configure_optimizers`` and before it restores the optimizer state, so
    the callback moves them here (matched by identity) into the growth groups the checkpoint has,
    in its order, and extends the schedulers' per-group lists (their saved values load next).
    Returns the number of groups added: 0 when the layout is the checkpoint's already
    (``growtrain.optim.param_groups`` builds it) or the fit resumes nothing."""
    blocks = grown_blocks(network)
    optimizer = optimizer_for(trainer, network)
    index = trainer.optimizers.index(optimizer) if optimizer is not None else len(saved or [])
    if not saved or not blocks or index >= len(saved):
        return 0
    names = saved[index]
    ks = sorted({k for k in map(_growth_index, names) if k is not None})
    if not ks or any(_growth_index(g.get("name")) is not None for g in optimizer.param_groups):
        return 0  # nothing grown then, or growth's groups built already
    if ks[-1] >= len(blocks):
        return 0  # the checkpoint's layout names blocks this network does not have: Lightning's load says so
    moved = {id(p) for k in ks for p in blocks[k].parameters()}
    if any(optimizer.state.get(p) for g in optimizer.param_groups for p in g["params"] if id(p) in moved):
        return 0  # state already: not a fresh configure_optimizers
    for group in optimizer.param_groups:
        group["params"] = [p for p in group["params"] if id(p) not in moved]
    # what growth itself does with a new block (zero-state groups, schedules continued)
    added = reconfigure_optimizer(pl_module, optimizer, trainer.strategy.lr_scheduler_configs, [blocks[k] for k in ks], ks)
    if [g.get("name") for g in optimizer.param_groups] != list(names):
        rank_zero_warn(f"GrowUntilSaturated: the resumed optimizer's groups {[g.get('name') for g in optimizer.param_groups]} "
                       f"do not line up with the checkpoint's {list(names)}; Lightning's restore of the optimizer "
                       "state may fail or misplace it. Fix: build the optimizer from growtrain.optim.param_groups(network).")
    return len(added)


class ResumeGroups:
    """What every growth callback does on resume, in one place: ``remember`` the checkpoint's optimizer
    group names (``on_load_checkpoint``, which Lightning calls before ``on_fit_start``), then
    ``regroup`` a plain optimizer of the rebuilt grown network into growth's groups (``on_fit_start``,
    between ``configure_optimizers`` and the restore of the optimizer state: :func:`regroup_grown`)."""

    def __init__(self) -> None:
        self.saved: list[list[Any]] | None = None

    def remember(self, checkpoint: dict[str, Any]) -> None:
        self.saved = [[g.get("name") for g in state.get("param_groups", [])]
                      for state in checkpoint.get("optimizer_states") or []]  # fmt: skip

    def forget(self) -> None:
        self.saved = None

    def regroup(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module | None) -> int:
        added = regroup_grown(trainer, pl_module, network, self.saved) if network is not None else 0
        self.saved = None
        return added


def rewrap_ddp(trainer: Trainer) -> None:
    """DDP registers its gradient hooks at construction: wrap the grown module again (the DDP
    constructor also broadcasts rank 0's parameters, aligning the new blocks)."""
    strategy = trainer.strategy
    if trainer.world_size > 1 and hasattr(strategy, "configure_ddp"):
        strategy.model = strategy.lightning_module
        strategy.configure_ddp()
