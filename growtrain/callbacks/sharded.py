"""``GrowUntilSaturated`` under Lightning's ``ModelParallelStrategy`` (FSDP2): the Lightning side.

What differs from DDP (docs/callback.md, "Growing a sharded model"):

* the strategy: only data parallelism (``tensor_parallel_size=1``) is supported, checked at
  setup with the fix (``ModelParallelStrategy()``'s default puts every device on the
  tensor-parallel dimension);
* the probe: a forward or backward pass through a sharded network is a collective (FSDP
  all-gathers each block's parameters), so every rank must run the same passes. Each rank
  scores an equal shard (``equal_shards``: the last ``n mod world_size`` probe samples are left
  out), so the ranks' batches, and the cross-fit split, line up;
* the insertion: the new block is sharded like its neighbours and FSDP's root state is
  rebuilt (``growtrain.fsdp.shard_like_neighbours``); every unit is resharded before the
  optimizer sees the new ``DTensor`` parameters;
* resuming: Lightning loads a sharded checkpoint into the model *before* the module's
  ``on_load_checkpoint`` runs (the growth replay), and a distributed load fills only the keys
  the model has, so an ungrown model would silently take the grown run's weights at the wrong
  depth. ``install_resume`` wraps the strategy's ``load_checkpoint``: it reads the growth record
  from the checkpoint, grows and shards the model to match, rebuilds the optimizer over the
  grown parameter groups, and only then lets the shards load.

Every rank runs the same code in the same order (the helpers are collectives).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn

from growtrain import fsdp
from growtrain.growable import replay_growth

__all__ = ["check_strategy", "is_model_parallel", "check_model_parallel", "equal_shards", "shard_probe", "compute_dtype", "install_resume", "growth_records",
           "zero_state", "REFUSED"]  # fmt: skip

# Strategy class name → (why growth cannot run under it, what to use instead).
REFUSED = {
    "FSDPStrategy": (
        "FSDP1 flattens each wrapped unit's parameters into one FlatParameter at setup, so a block inserted mid-fit "
        "has no place in it",
        "ModelParallelStrategy(data_parallel_size=<devices>, tensor_parallel_size=1) with a configure_model that "
        "calls fully_shard (growtrain.lm.LanguageModel and growtrain.hf.HFCausalLM do; growtrain.fsdp.shard_blocks "
        "for your own module)",
    ),
    "DeepSpeedStrategy": (
        "DeepSpeed owns the optimizer and partitions parameters at setup, so new parameters cannot join mid-fit",
        "ModelParallelStrategy (FSDP2) for sharded training, or strategy='ddp'",
    ),
    "XLAFSDPStrategy": ("FSDP on XLA shards parameters at setup and has not been tested with growth",
                        "ModelParallelStrategy (FSDP2) on GPUs/CPUs, or strategy='ddp'"),
    "XLAStrategy": ("not tested with growth", "strategy='ddp' or ModelParallelStrategy on GPUs/CPUs"),
}


def is_model_parallel(strategy: Any) -> bool:
    return any(cls.__name__ == "ModelParallelStrategy" for cls in type(strategy).__mro__)


def check_model_parallel(trainer: Any) -> None:
    """At setup: FSDP2 data parallelism only (tensor-parallel size 1). Every decision runs under it
    (a block-only trial shards its block like the neighbours: growtrain/callbacks/trial_check.py)."""
    strategy = trainer.strategy
    mesh = getattr(strategy, "_device_mesh", None)
    if mesh is not None and "tensor_parallel" in (mesh.mesh_dim_names or ()):
        tp, dp = mesh["tensor_parallel"].size(), mesh["data_parallel"].size()
    else:
        tp, dp = strategy._tensor_parallel_size, strategy._data_parallel_size
    if tp != 1:
        raise RuntimeError(
            f"strategy: GrowUntilSaturated grows FSDP2-sharded models on the data-parallel dimension only, but "
            f"{type(strategy).__name__} has tensor_parallel_size={tp} (data_parallel_size={dp}); a tensor-parallel "
            "plan is fixed per layer at setup, so a new block would not be split like its neighbours. "
            "ModelParallelStrategy() puts every device on the tensor-parallel dimension by default. Fix: "
            f"ModelParallelStrategy(data_parallel_size={trainer.world_size}, tensor_parallel_size=1)."
        )


def equal_shards(loader: Any, rank: int, world_size: int) -> Any:
    """``loader``'s dataset cut to a multiple of ``world_size`` samples before it is sharded,
    so every rank gets the same number of samples (and batches): under FSDP2 each forward and
    backward of the probe is a collective."""
    from torch.utils.data import DataLoader, Subset

    from growtrain.callbacks.probe_data import shard_loader

    if world_size <= 1 or not isinstance(loader, DataLoader) or loader.batch_size is None:
        return shard_loader(loader, rank, world_size)  # (its own clear errors)
    n = len(loader.dataset)
    keep = n - n % world_size
    if keep == 0:
        raise ValueError(
            f"probe: {n} probe sample(s) for {world_size} ranks; under ModelParallelStrategy every rank scores an "
            f"equal share of the probe. Fix: use a probe of at least {2 * world_size} samples."
        )
    dataset = loader.dataset if keep == n else Subset(loader.dataset, range(keep))
    cut = DataLoader(dataset, batch_size=loader.batch_size, shuffle=False, collate_fn=loader.collate_fn,
                     num_workers=loader.num_workers, pin_memory=loader.pin_memory)  # fmt: skip
    return shard_loader(cut, rank, world_size)


def zero_state(optimizer: Any, params: list) -> None:
    """``growtrain.fsdp.zero_optimizer_state`` for the new parameters, with a warning naming
    what it could not do."""
    from lightning.pytorch.utilities import rank_zero_warn

    problems = fsdp.zero_optimizer_state(getattr(optimizer, "_optimizer", optimizer), params)
    if problems:
        rank_zero_warn(
            f"GrowUntilSaturated: the new block's optimizer state starts empty ({', '.join(problems)} has no known zero "
            "state); a sharded checkpoint saved before its first optimizer step will not load. Use Adam/AdamW or SGD."
        )


def shard_probe(loader: Any, trainer: Any) -> Any:
    """This rank's shard of the probe: ``equal_shards`` under ``ModelParallelStrategy`` (every
    probe pass is a collective there), ``probe_data.shard_loader`` otherwise (DDP)."""
    from growtrain.callbacks.probe_data import shard_loader

    shard = equal_shards if is_model_parallel(trainer.strategy) else shard_loader
    return shard(loader, trainer.global_rank, trainer.world_size)


def compute_dtype(module: nn.Module | None) -> torch.dtype | None:
    """The dtype FSDP2 computes in when a ``MixedPrecisionPolicy`` sets ``param_dtype`` (None
    otherwise). The probe's candidate blocks keep the parameters' dtype, so the probe runs them
    under autocast to it, as the sharded blocks compute."""
    for unit in fsdp.fsdp_units(module) if module is not None else []:
        dtype = fsdp.shard_policy(unit)["mp_policy"].param_dtype
        if dtype is not None:
            return dtype
    return None


def growth_records(path: Path, weights_only: bool | None = None) -> list[dict] | None:
    """The growth record a Lightning checkpoint holds (a sharded folder's ``meta.pt`` or a
    single file), or None if there is no checkpoint there or it has no record."""
    from lightning.fabric.utilities.load import _METADATA_FILENAME

    if path.is_dir():
        meta = path / _METADATA_FILENAME
        if not meta.is_file():
            return None
        checkpoint = torch.load(meta, map_location="cpu", weights_only=weights_only)
    elif path.is_file():
        checkpoint = torch.load(path, mmap=True, map_location="cpu", weights_only=weights_only)
    else:
        return None
    records = checkpoint.get("growtrain", {}).get("growth") if isinstance(checkpoint, dict) else None
    return None if records is None else [dict(r) for r in records]


def grow_to_record(trainer: Any, pl_module: nn.Module, network: nn.Module, records: list[dict]) -> list[nn.Module]:
    """Grow ``network`` to the recorded architecture before the checkpoint's shards load: the
    recorded insertions with fresh blocks, each sharded like its neighbours, then the optimizer
    rebuilt by ``configure_optimizers`` over the grown parameter groups (growth groups in
    growth order), so the optimizer state in the checkpoint lines up."""
    blocks = replay_growth(network, records)
    if not blocks:
        return blocks
    fsdp.shard_like_neighbours(network, blocks, root=pl_module)
    fsdp.reshard_all(pl_module)
    strategy = trainer.strategy
    strategy.setup_optimizers(trainer)
    from lightning.fabric.utilities.optimizer import _optimizers_to_device

    _optimizers_to_device(strategy.optimizers, strategy.root_device)
    return blocks


def install_resume(trainer: Any, network_of: Callable[[], nn.Module]) -> None:
    """Wrap ``trainer.strategy.load_checkpoint`` (this trainer's strategy instance only) so a
    grown run's checkpoint is loaded into a model grown to match (``grow_to_record``)."""
    strategy = trainer.strategy
    if getattr(strategy, "_growtrain_resume", False):
        return
    original = strategy.load_checkpoint

    def load_checkpoint(checkpoint_path: Any, weights_only: bool | None = None) -> dict:
        path = Path(strategy.broadcast(checkpoint_path))
        records = growth_records(path, weights_only)
        if records:
            grow_to_record(trainer, strategy.lightning_module, network_of(), records)
        return original(checkpoint_path, weights_only=weights_only)

    strategy.load_checkpoint = load_checkpoint
    strategy._growtrain_resume = True


def check_strategy(trainer: Any) -> None:
    """Refuse, before any state changes, a strategy the growth callback cannot follow."""
    strategy = trainer.strategy
    names = {cls.__name__ for cls in type(strategy).__mro__}
    for name, (why, instead) in REFUSED.items():
        if name in names:
            raise RuntimeError(
                f"strategy: GrowUntilSaturated does not support {type(strategy).__name__} ({why}). "
                f"Supported: one device, strategy='ddp', and FSDP2. Fix: use {instead}."
            )
    if is_model_parallel(strategy):  # FSDP2: data parallel only
        return check_model_parallel(trainer)
    launcher = getattr(strategy, "launcher", None)
    if launcher is not None and type(launcher).__name__ == "_MultiProcessingLauncher":
        raise RuntimeError(
            f"strategy: GrowUntilSaturated does not support spawn/fork-based DDP "
            f"(start_method={getattr(strategy, '_start_method', '?')!r}): Lightning copies rank 0's weights back "
            "into the un-grown parent model with strict=False, silently dropping the grown blocks. "
            "Fix: use strategy='ddp' (subprocess launcher) and run your script from the command line."
        )
    if trainer.world_size > 1 and not hasattr(strategy, "configure_ddp"):
        raise RuntimeError(
            f"strategy: {type(strategy).__name__} with {trainer.world_size} processes is not supported; "
            "use strategy='ddp'."
        )
