"""Hand over the best certified network: a host-memory snapshot before each growth, and its restore.

When growth ends because the last block did not pay (its realized gain was not certified), the
network to hand over is the one *before* that growth: every weight and buffer (BatchNorm
statistics included), the architecture (the block removed, ``growth_log`` trimmed, so checkpoints
replay the restored architecture) and the optimizer (the block's groups removed, the old state
back). Only the latest snapshot is kept: each check judges the growth just before it.

The snapshot lives in host memory (no second copy on the accelerator) and in the callback's
checkpoint state, so a run resumed between a growth and its verdict can still restore.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from growtrain.growable import grown_blocks

__all__ = ["host_copy", "take_snapshot", "restore_snapshot"]


def host_copy(obj: Any) -> Any:
    """``obj`` with every tensor detached and copied to host memory (containers rebuilt)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return {k: host_copy(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(host_copy(v) for v in obj)
    return obj


def take_snapshot(module: nn.Module, network: nn.Module, optimizer: Any, **where: Any) -> dict:
    """What :func:`restore_snapshot` needs to put ``module`` back as it is now.

    ``where`` (check, epoch, depth, ...) is kept for the record."""
    return {
        "module": host_copy(module.state_dict()),
        "optimizer": host_copy(optimizer.state_dict()) if optimizer is not None else None,
        "groups": len(optimizer.param_groups) if optimizer is not None else 0,
        "log_len": len(network.growth_log),
        **where,
    }


def _drop_groups(optimizer: Any, params: list[nn.Parameter], configs: Any) -> int:
    """Remove the param groups holding ``params`` (by identity) and their state; trim the
    schedulers' per-group lists to match. Returns how many groups were removed."""
    ids = {id(p) for p in params}
    keep, drop = [], []
    for i, group in enumerate(optimizer.param_groups):
        owned = [id(p) in ids for p in group["params"]]
        if any(owned) and not all(owned):
            raise RuntimeError("restore: a param group mixes the removed block's parameters with others; "
                               "cannot undo the growth's optimizer groups")  # fmt: skip
        (drop if any(owned) else keep).append(i)
    for p in params:
        optimizer.state.pop(p, None)
    optimizer.param_groups[:] = [optimizer.param_groups[i] for i in keep]
    for config in configs or []:
        scheduler = getattr(config, "scheduler", config)
        if getattr(scheduler, "optimizer", None) is not optimizer:
            continue
        for name in ("base_lrs", "_last_lr"):
            values = getattr(scheduler, name, None)
            if isinstance(values, list) and len(values) == len(keep) + len(drop):
                setattr(scheduler, name, [values[i] for i in keep])
    return len(drop)


def restore_snapshot(snapshot: dict, module: nn.Module, network: nn.Module, optimizer: Any,
                     scheduler_configs: Any = None) -> dict:  # fmt: skip
    """Undo every growth since ``snapshot`` and load its weights, buffers and optimizer state.

    Returns what was undone (sites and block count), for the record."""
    log_len = int(snapshot["log_len"])
    blocks = grown_blocks(network)[log_len:]
    sites = [dict(r).get("site") for r in network.growth_log[log_len:]]
    params = [p for b in blocks for p in b.parameters()]
    if optimizer is not None:
        removed = _drop_groups(optimizer, params, scheduler_configs)
        if len(optimizer.param_groups) != snapshot["groups"]:
            raise RuntimeError(
                f"restore: the optimizer has {len(optimizer.param_groups)} param groups after removing {removed} of the "
                f"undone blocks, but had {snapshot['groups']} at the snapshot; the groups were changed by something "
                "other than growth"
            )
    network.undo_growth(blocks, log_len)
    module.load_state_dict(snapshot["module"], strict=True)
    if optimizer is not None and snapshot["optimizer"] is not None:
        optimizer.load_state_dict(snapshot["optimizer"])
    return {"removed_sites": sites, "removed_blocks": len(blocks)}
