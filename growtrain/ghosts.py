"""Ghosts: the zero-output candidate blocks the probe scores, how they are attached to the
network's sites, and their BatchNorm calibration.

A ghost is never inserted: hooks on the existing blocks hand it the activation at its site
(``site_hooks``). No Lightning import here.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from growtrain.batches import to_device
from growtrain.growable import Site

__all__ = ["candidate_blocks", "calibrate_candidates", "cumulative_statistics", "sync_batch_norms"]


# -- candidates ----------------------------------------------------------------------------
def candidate_blocks(network: nn.Module, seed: int | None = 0) -> dict[str, nn.Module]:
    """A fresh zero-output candidate per site, reproducible from ``seed`` (site ``j`` uses
    the private stream ``seed·1000003 + j``)."""
    out = {}
    for j, site in enumerate(network.sites()):
        out[site.name] = network.new_block(site, seed=None if seed is None else int(seed) * 1_000_003 + j)
    return out


def batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def save_modes(module: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Every submodule's own train/eval flag (a user may keep, e.g., a frozen BN in eval)."""
    return [(m, m.training) for m in module.modules()]


def restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for m, training in modes:
        m.training = training


@contextmanager
def frozen(network: nn.Module):
    """Parameters need no gradient in the probe (only the site activations do): with them
    frozen, layers stop saving inputs for weight gradients, which lowers the pass's memory.
    The graph then starts at the first site (see ``capture``)."""
    flags = [(p, p.requires_grad) for p in network.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


# -- hooks ---------------------------------------------------------------------------------
@contextmanager
def site_hooks(network: nn.Module, sites: list[Site], on_activation: Callable[[int, torch.Tensor], Any]):
    """Call ``on_activation(j, z)`` with the activation at site ``j`` during each forward.

    The activation at ``stage.i`` is the input of block ``i`` (or the output of the stage's
    last block at the end). A returned tensor replaces the activation.
    """
    handles = []
    try:
        for j, site in enumerate(sites):
            stage = network.stage(site.stage)
            if len(stage) == 0:
                # A ModuleList is never called itself, so an empty stage has nothing to hook.
                raise ValueError(
                    f"network: stage {site.stage!r} has no blocks, so the probe cannot find the activation at "
                    f"{site.name}; give every growable stage at least one block"
                )
            if site.index < len(stage):

                def pre_hook(module, args, j=j):
                    new = on_activation(j, args[0])
                    return None if new is None else (new,) + tuple(args[1:])

                handles.append(stage[site.index].register_forward_pre_hook(pre_hook))
            else:

                def post_hook(module, args, output, j=j):
                    return on_activation(j, output)

                handles.append(stage[site.index - 1].register_forward_hook(post_hook))
        yield
    finally:
        for h in handles:
            h.remove()


def split_batch(batch):
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise TypeError(
            f"probe_loader: expected batches of (input, target), got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else "")
        )
    x, y = batch
    # A short target would otherwise fail deep inside the loss with no word about the probe, or
    # broadcast silently in a loss like MSE; the per-sample scaling and n count targets.
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() and y.dim() and len(x) != len(y):
        raise ValueError(
            f"probe_loader: a probe batch has {len(x)} inputs but {len(y)} targets; every input needs its "
            "target (check the probe dataset's collate_fn)"
        )
    return batch


def autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


# -- BatchNorm calibration of the ghosts -----------------------------------------------------
@torch.no_grad()
def calibrate_candidates(
    network: nn.Module,
    candidates: Mapping[str, nn.Module],
    probe_loader: Iterable,
    *,
    autocast_dtype: torch.dtype | None = None,
    sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Set each ghost's BatchNorm running statistics from the probe sample's activations.

    A fresh BatchNorm has running mean 0 and variance 1, so in eval mode a ghost's features
    would be unnormalised. One forward pass over the probe inputs (no labels, no gradients, so
    the protocol is still fixed before any gradient is seen) runs each ghost in train mode with
    a cumulative average (``momentum=None``), the way ``torch.optim.swa_utils.update_bn``
    does. Inner BatchNorms see batch-normalised inputs during this pass, a small approximation.
    With ``sync_fn`` (a sum over ranks) the statistics are averaged over ranks.
    """
    sites = network.sites()
    blocks = [candidates[s.name] for s in sites]
    bns = [bn for b in blocks for bn in batch_norms(b)]
    if not bns:
        return
    saved = [(bn.momentum, bn.training) for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    modes = save_modes(network)
    network.eval()
    device = network.neighbour_tensor(sites[0]).device

    def run_ghost(j, z):
        blocks[j].train()
        blocks[j](z)
        blocks[j].eval()

    try:
        with site_hooks(network, sites, run_ghost), autocast(device, autocast_dtype):
            for batch in probe_loader:
                x, _ = split_batch(batch)
                network(to_device(x, device))
    finally:
        restore_modes(modes)
        for bn, (momentum, training) in zip(bns, saved):
            bn.momentum = momentum
            bn.train(training)
    if sync_fn is not None:
        sync_batch_norms(bns, sync_fn)


def sync_batch_norms(bns: list[nn.modules.batchnorm._BatchNorm], sync_fn: Callable[[torch.Tensor], torch.Tensor]) -> None:
    """Average running statistics over ranks: one all-reduce of every mean and variance and a
    rank count (``sync_fn`` sums)."""
    if not bns:
        return
    device = bns[0].running_mean.device
    parts = [t.double().flatten() for bn in bns for t in (bn.running_mean, bn.running_var)]
    flat = sync_fn(torch.cat(parts + [torch.ones(1, dtype=torch.float64, device=device)]))
    flat = flat[:-1] / flat[-1]
    start = 0
    for bn in bns:
        for t in (bn.running_mean, bn.running_var):
            t.copy_(flat[start : start + t.numel()].view_as(t))
            start += t.numel()


@contextmanager
def cumulative_statistics(blocks: Iterable[nn.Module]):
    """The ghosts' BatchNorms start from fresh statistics and average every batch they see
    equally (``momentum=None``, as in ``calibrate_candidates``) while the context lasts; their
    momentum and mode are restored after."""
    bns = [bn for b in blocks for bn in batch_norms(b)]
    saved = [(bn.momentum, bn.training) for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    try:
        yield
    finally:
        for bn, (momentum, training) in zip(bns, saved):
            bn.momentum = momentum
            bn.train(training)


@contextmanager
def batch_statistics(bns: list[nn.modules.batchnorm._BatchNorm]):
    """Only the BatchNorms in train mode (batch statistics, accumulated into the running ones);
    the rest of the block (e.g. dropout) stays in eval mode."""
    for bn in bns:
        bn.train()
    try:
        yield
    finally:
        for bn in bns:
            bn.eval()
