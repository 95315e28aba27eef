"""``RandomStateCheckpoint``: the random state goes into every checkpoint and comes back on resume.

Lightning's checkpoint restores weights, optimizer, loops and callback states, but not the random
number generators. A plain shuffling ``DataLoader`` draws its permutation from torch's global
generator when an epoch's iterator starts, so a fit resumed from ``last.ckpt`` trains on other
batches than the uninterrupted fit, and every later growth check sees another network: another
epoch, another verdict, another final depth. This callback saves, per process, torch's CPU
generator, CUDA's (where CUDA is in use), numpy's and Python's ``random``, and the state of every
``torch.Generator`` the train loaders own (``DataLoader(generator=...)``, a sampler's
``generator``), and puts them back on resume.

*When* it puts them back matters. Lightning restores callback states before ``on_fit_start``;
the resumed fit then draws from the generators before its first batch (the fit loop creates the
train iterator, which draws a base seed; ``on_train_start`` hooks may iterate a probe loader) in
an order the uninterrupted fit does not have. In the uninterrupted fit the checkpoint of epoch N
is written at the end of epoch N and the next draws are epoch N+1's: the train iterator's base
seed and the sampler's permutation, made after the ``on_train_epoch_start`` hooks. So the states
are held until the first ``on_train_epoch_start`` of the resumed fit, set there, and the train
iterator the fit loop made earlier is made again from them (``iter`` on the loop's data fetcher,
what the loop itself does at the start of every later epoch).

Exact for a checkpoint written at an epoch boundary (``ModelCheckpoint`` at the end of a train
epoch or after the epoch's validation, as the quickstart's ``last.ckpt``; tested single-process
and under 2-process DDP, ``tests/test_rng_state.py``). Not covered, and said here so nobody relies
on it: a checkpoint written mid-epoch (its states are set at ``on_train_start``, the best
available, but Lightning restarts the epoch's iterator, so the batches differ anyway);
a fit bounded by ``max_steps`` resumed from an epoch-end checkpoint (Lightning resumes it "on epoch
end", and the next epoch's batches differ; measured 2026-12-08, tests/test_budget.py bounds its
resume by ``max_epochs`` for this reason); persistent DataLoader workers (their own generators live in the worker processes; the order of
the samples is restored, random augmentations inside the workers are not); random draws in
``on_train_epoch_start`` hooks that run after this callback's (the LightningModule's own); and
``reload_dataloaders_every_n_epochs`` (the uninterrupted fit makes the epoch's iterator twice).

Under DDP every process's states are gathered into the checkpoint (``Trainer.save_checkpoint``
runs on every rank) and each rank gets its own back; with another number of processes every
rank gets rank 0's, with a warning.

On Ctrl-C the callback prints the command that resumes the fit (``growtrain.resume``): it is in
every trainer growtrain builds, so every ``growtrain fit`` says how to go on.
"""

from __future__ import annotations

import random
from typing import Any, Mapping

import numpy as np
import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn

from growtrain.resume import interrupt_report

__all__ = ["RandomStateCheckpoint", "capture_random_state", "restore_random_state", "CHECKPOINT_KEY"]

# A top-level checkpoint key, not a callback state: a checkpoint resumed by a trainer without this
# callback (a plain ``lightning.Trainer``) then loads without Lightning's "callbacks used to create
# the checkpoint need to be provided" warning.
CHECKPOINT_KEY = "growtrain_random_state"
_FORMAT = 1


def _train_loaders(trainer: Trainer) -> list[Any]:
    """The fit's train loaders, flattened (a loader, or a list/dict of them), in a fixed order."""
    try:
        loaders = trainer.train_dataloader
    except Exception:  # no fit loop data yet (a checkpoint saved before training started)
        return []
    out: list[Any] = []

    def walk(obj: Any) -> None:
        if obj is None:
            return
        if isinstance(obj, Mapping):
            for key in sorted(obj, key=str):
                walk(obj[key])
        elif isinstance(obj, (list, tuple)):
            for item in obj:
                walk(item)
        else:
            out.append(obj)

    walk(loaders)
    return out


def loader_generators(trainer: Trainer) -> list[torch.Generator]:
    """Every ``torch.Generator`` the train loaders draw from: the loader's own (its base seeds, and
    the permutation of the ``RandomSampler`` that ``shuffle=True`` builds with it), the sampler's
    and a batch sampler's sampler's; each once, in a fixed order."""
    found: list[torch.Generator] = []
    for loader in _train_loaders(trainer):
        sampler = getattr(loader, "sampler", None)
        inner = getattr(getattr(loader, "batch_sampler", None), "sampler", None)
        for owner in (loader, sampler, inner):
            generator = getattr(owner, "generator", None)
            if isinstance(generator, torch.Generator) and not any(generator is g for g in found):
                found.append(generator)
    return found


def _cuda_in_use() -> bool:
    # Only where CUDA was initialized: asking for its states would otherwise create a context on
    # every GPU of a CPU-only fit. A process that never initialized CUDA drew nothing from it.
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def capture_random_state(trainer: Trainer | None = None) -> dict[str, Any]:
    """This process's random state as plain data (tensors, ints, floats, lists), which a
    ``torch.load(weights_only=True)`` reads back: torch CPU, CUDA (where in use), numpy, Python
    and, with a ``trainer``, its train loaders' generators."""
    key, keys, pos, has_gauss, cached = np.random.get_state()
    version, internal, gauss = random.getstate()
    return {
        "torch": torch.get_rng_state(),
        "cuda": list(torch.cuda.get_rng_state_all()) if _cuda_in_use() else [],
        "numpy": {"key": str(key), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},  # fmt: skip
        "python": [int(version), [int(v) for v in internal], gauss],
        "generators": [g.get_state() for g in loader_generators(trainer)] if trainer is not None else [],
    }


def restore_random_state(state: Mapping[str, Any], trainer: Trainer | None = None) -> list[str]:
    """Set this process's generators to ``state`` (from :func:`capture_random_state`). Returns
    what could not be restored (empty when everything was), for the caller to report."""
    missed = []
    torch.set_rng_state(state["torch"])
    cuda = list(state.get("cuda") or [])
    if cuda and torch.cuda.is_available():
        count = torch.cuda.device_count()
        for index, value in enumerate(cuda[:count]):
            torch.cuda.set_rng_state(value, index)
        if len(cuda) != count:
            missed.append(f"CUDA generators: saved for {len(cuda)} device(s), this process sees {count}")
    elif cuda:
        missed.append(f"CUDA generators: saved for {len(cuda)} device(s), CUDA is not available here")
    n = state["numpy"]
    np.random.set_state((n["key"], np.asarray(n["keys"].numpy(), dtype=np.uint32), int(n["pos"]), int(n["has_gauss"]),
                         float(n["cached_gaussian"])))  # fmt: skip
    version, internal, gauss = state["python"]
    random.setstate((int(version), tuple(int(v) for v in internal), gauss))
    if trainer is not None:
        saved, here = list(state.get("generators") or []), loader_generators(trainer)
        if len(saved) == len(here):
            for generator, value in zip(here, saved):
                generator.set_state(value)
        else:
            missed.append(f"train loader generators: {len(saved)} saved, the train loaders now have {len(here)}")
    return missed


def _gather(state: dict[str, Any]) -> list[dict[str, Any]]:
    """Every process's ``state``, by rank (one process: ``[state]``). A collective under DDP:
    ``Trainer.save_checkpoint``, the only caller of the checkpoint hooks, runs on every rank."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return [state]
    states: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(states, state)
    return states


class RandomStateCheckpoint(Callback):
    """Save the random state in every checkpoint; restore it when a fit resumes from one.

    ``growtrain``'s trainers (the CLI's, and every trainer an experiment builds) add it by
    themselves, and ``GrowUntilSaturated`` runs one of its own in a trainer that has none; add it
    to a plain ``lightning.Trainer`` without the growth callback to get the same::

        trainer = L.Trainer(callbacks=[GrowUntilSaturated(...), RandomStateCheckpoint()])
        trainer.fit(model, data, ckpt_path="…/last.ckpt")

    A fit resumed from a checkpoint written at the end of an epoch then draws exactly what the
    uninterrupted fit drew: the same batches, so the same growth checks (the module docstring
    says when the states are set, and what is not covered). A checkpoint without the states
    (written before this callback existed) resumes as before, with a one-line warning.

    On Ctrl-C it prints the command that resumes the fit from its latest checkpoint
    (:func:`growtrain.resume.interrupt_report`).
    """

    def __init__(self) -> None:
        self._pending: dict[str, Any] | None = None
        # where the latest checkpoint of this fit was written (epoch, global_step, at_epoch_end):
        # the message after Ctrl-C says what a resume starts from (growtrain.resume)
        self.last_save: dict[str, Any] | None = None

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # at_epoch_end: the epoch's last batch is done, a save at an epoch boundary (a resume from it is exact)
        progress = trainer.fit_loop.epoch_loop.batch_progress
        self.last_save = {"epoch": trainer.current_epoch, "global_step": trainer.global_step,
                          "at_epoch_end": bool(progress.is_last_batch)}  # fmt: skip
        checkpoint[CHECKPOINT_KEY] = {"format": _FORMAT, **self.last_save,
                                      "ranks": _gather(capture_random_state(trainer))}  # fmt: skip

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # Held, not set: Lightning restores callbacks before the resumed fit's own draws (see the module docstring)
        saved = checkpoint.get(CHECKPOINT_KEY)
        if saved is None:
            if trainer.state.fn == "fit":
                rank_zero_warn("RandomStateCheckpoint: the checkpoint holds no random state (it was written without "
                               "this callback), so the resumed fit draws other batches than the uninterrupted fit "
                               "would have, and its later growth checks may differ.", category=UserWarning)  # fmt: skip
            return
        if saved.get("format") != _FORMAT:
            raise ValueError(
                f"ckpt_path: {str(trainer.ckpt_path)!r} holds a random state of format {saved.get('format')!r}; this "
                f"growtrain reads format {_FORMAT}. Fix: resume it with the growtrain version that wrote it."
            )
        self._pending = dict(saved) if trainer.state.fn == "fit" else None
        self.last_save = {key: saved.get(key) for key in ("epoch", "global_step", "at_epoch_end")}

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # A mid-epoch checkpoint: Lightning calls no on_train_epoch_start for the epoch it resumes,
        # so set the states now, the nearest point (that epoch's batches differ anyway)
        loop = trainer.fit_loop  # (getattr: Lightning before 2.5 names no restart stages; then the epoch start)
        if self._pending is not None and (getattr(loop, "restarted_mid_epoch", False)
                                          or getattr(loop, "restarted_on_epoch_end", False)):  # fmt: skip
            self._restore(trainer, remake_iterator=False)

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._pending is not None:
            self._restore(trainer, remake_iterator=True)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._pending = None  # a fit that ended before its first epoch: the next fit of this trainer starts clean

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        # Ctrl-C: Lightning says only "attempting graceful shutdown" and exits 1. Say how to resume
        # (this callback is in every growtrain trainer; GrowUntilSaturated prints its summary first).
        self._pending = None
        if isinstance(exception, KeyboardInterrupt) and trainer.is_global_zero:
            print(interrupt_report(trainer), flush=True)

    def _restore(self, trainer: Trainer, remake_iterator: bool) -> None:
        saved, self._pending = self._pending, None
        assert saved is not None
        ranks = saved["ranks"]
        rank, world = trainer.global_rank, trainer.world_size
        if len(ranks) != world:
            rank_zero_warn(f"RandomStateCheckpoint: the checkpoint holds the random states of {len(ranks)} process(es), "
                           f"this fit has {world}; every process gets rank 0's.", category=UserWarning)  # fmt: skip
        missed = restore_random_state(ranks[rank] if len(ranks) == world else ranks[0], trainer)
        if missed:
            rank_zero_warn(f"RandomStateCheckpoint: restored all but: {'; '.join(missed)}. The resumed fit may draw "
                           "other random numbers than the uninterrupted fit.", category=UserWarning)  # fmt: skip
        fetcher = getattr(trainer.fit_loop, "_data_fetcher", None)
        if remake_iterator and fetcher is not None:
            # The loop made this epoch's train iterator at the start of the resumed fit, before this
            # hook, from the generators as they were then; make it again from the restored ones, as
            # the uninterrupted fit does at the start of every epoch after its first.
            iter(fetcher)
