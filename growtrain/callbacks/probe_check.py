"""The probe side of a growth check: which loader, refused setups, the forked random state, and
the one probe pass over every site (``measure_saturation``) with the trainer's precision and ranks.

Functions the callback's hooks call with the trainer's objects; the math is in
``growtrain.saturation`` (no Lightning there).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader

from growtrain.callbacks import sharded
from growtrain.callbacks.probe_data import (
    Converted, ProbeView, check_split_indices, datasets_of, probe_overlap, refuse_random_probe,
)  # fmt: skip
from growtrain.callbacks.progress import counted, progress_for
from growtrain.callbacks.rng_state import loader_generators
from growtrain.crossfit import probe_size
from growtrain.saturation import SaturationReport, measure_saturation

__all__ = ["CheckInputs", "probe_loader", "check_probe_source", "check_probe_independent", "forked_rng", "probe_pass",
           "autocast_dtype"]  # fmt: skip


@dataclass
class CheckInputs:
    """What one check measured, handed to its decision (``judge``): the trainer and module, the
    network, the first-order report of the probe pass, the whole (unsharded) probe, the loss, the
    test's level and the check's index."""

    trainer: Any
    pl_module: Any
    network: nn.Module
    report: SaturationReport
    probe: Any
    loss_fn: Callable
    level: float
    check: int


def probe_loader(source: Any, trainer: Any, shard: bool = True) -> Any:
    """The probe of this check: ``source`` (a DataLoader, an iterable, or a callable returning one)
    or the datamodule's ``probe_dataloader()``; under FSDP2 each rank's equal shard."""
    if source is None:
        loader = trainer.datamodule.probe_dataloader()
    elif isinstance(source, DataLoader) or not callable(source):
        loader = source
    else:
        loader = source()
    return sharded.shard_probe(loader, trainer) if shard else loader


def check_probe_source(trainer: Any, source: Any, paired: bool) -> None:
    """At setup: a probe exists, the datamodule's split is sound, and (``paired``: a decision that
    pairs per-sample losses) it does not shuffle. An empty probe is refused here, not at a check."""
    if source is None:
        dm = trainer.datamodule
        if dm is None or not callable(getattr(dm, "probe_dataloader", None)):
            raise ValueError(
                "probe: no probe data. GrowUntilSaturated needs a held-out probe sample: pass "
                "GrowUntilSaturated(probe=<DataLoader or callable>) or use a datamodule with a "
                "probe_dataloader() method (growtrain.data.ImageDataModule has one). The probe must never "
                "be trained on."
            )
        check_split_indices(dm)
        loader = dm.probe_dataloader()  # built here, so an empty probe (probe_size=0) is refused at setup
        if paired:
            refuse_random_probe(loader, "datamodule.probe_dataloader()")
    elif isinstance(source, DataLoader) and paired:
        refuse_random_probe(source, "probe")


def check_probe_independent(trainer: Any, loader: Any) -> None:
    """At the start of training: the probe shares no sample with any train loader."""
    probe_ds = getattr(loader, "dataset", None)
    for ds in datasets_of(trainer.train_dataloader):
        overlap = probe_overlap(probe_ds, ds)
        if overlap is not None:
            raise ValueError(
                f"probe: the probe sample overlaps the training data ({overlap}). The certificate needs a "
                "probe independent of training. Fix: carve the probe out of the training split (e.g. "
                "ImageDataModule's probe_size) and never train on it."
            )


@contextmanager
def forked_rng(trainer: Any, device: torch.device) -> Iterator[None]:
    """A check runs on a fork of the random number generators: iterating the probe loader draws
    from torch's global generator (each DataLoader iterator takes a base seed), so without the fork
    a check would move the training data order and augmentation of the rest of the run — and two
    decision settings would train differently before they first decide differently. A generator
    the train loaders own (``DataLoader(generator=g)``) is not forked by ``fork_rng``, and the
    trials iterate the train loader: it is set back afterwards too."""
    devices = []
    if device.type == "cuda":
        devices = [device.index if device.index is not None else torch.cuda.current_device()]
    owned = loader_generators(trainer)
    states = [g.get_state() for g in owned]
    try:
        with torch.random.fork_rng(devices=devices):
            yield
    finally:
        for g, state in zip(owned, states):
            g.set_state(state)


def autocast_dtype(trainer: Any) -> torch.dtype | None:
    """The compute dtype the trainer's precision trains in (the probe pass runs under it)."""
    precision = str(trainer.precision)
    if precision.startswith("bf16-mixed"):
        return torch.bfloat16
    if precision.startswith("16-mixed"):
        return torch.float16 if trainer.strategy.root_device.type == "cuda" else torch.bfloat16
    return sharded.compute_dtype(trainer.lightning_module)  # FSDP2 MixedPrecisionPolicy(param_dtype=...), or None


def probe_pass(trainer: Any, pl_module: Any, network: nn.Module, loader: Any, loss_fn: Callable, *, delta: float,
               alpha: float, t: float | None, rule: str, seed: int) -> tuple[SaturationReport, float]:  # fmt: skip
    """One pass over every site: the report and the seconds it took."""
    sync_fn = None
    if trainer.world_size > 1:
        sync_fn = lambda t: trainer.strategy.reduce(t, reduce_op="sum")  # noqa: E731
        # DDP broadcasts buffers before each forward, but the last training forward then moved
        # each rank's BatchNorm statistics by its own batch: probe one network, rank 0's.
        for buffer in pl_module.buffers():
            torch.distributed.broadcast(buffer.data, src=0)
    # The split of the cross-fit rule needs the sample count before the pass: read it from the
    # loader itself, since the precision wrapper below hides its sampler.
    size = probe_size(loader) if rule != "paper" else None
    start = time.perf_counter()
    # the pass over every site shows its batches in the progress bar (nothing without one, or off rank 0)
    probe = counted(loader, progress_for(trainer), "growth check: probe pass")
    report = measure_saturation(
        ProbeView(pl_module, network), Converted(probe, trainer), loss_fn, delta=delta, alpha=alpha, t=t,
        projected=False, rule=rule, seed=seed, calibrate=True, autocast_dtype=autocast_dtype(trainer),
        sync_fn=sync_fn, probe_size=size,
        variance=True,  # every check reports the paper's Γ̂ against δ+t
    )  # fmt: skip
    return report, time.perf_counter() - start
