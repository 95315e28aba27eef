"""Probe data for ``GrowUntilSaturated``: overlap checks, DDP sharding, and the probe's view of the model.

The probe sample must be independent of training (the certificate's premise): ``probe_overlap``
detects the common ways it is not. Under DDP every rank reads a disjoint shard (``shard_loader``)
and the probe sums are all-reduced, so all ranks decide alike. ``ProbeView`` lets the probe run
the LightningModule's whole forward while the sites are the growable trunk's (the network's own
forward when the module defines none). ``check_probe_setup`` runs once before the first step: a
probe batch through that forward and the loss, and a fresh block at each stage is the identity.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterable, Iterator

import torch
from torch import nn
from torch.utils.data import DataLoader, Sampler, SequentialSampler, Subset

__all__ = ["probe_overlap", "refuse_random_probe", "ShardSampler", "shard_loader", "loaders_of", "datasets_of", "ProbeView",
           "first_input", "eval_output", "check_split_indices", "has_forward", "check_probe_setup", "probe_sample_losses"]


def _base_and_indices(ds: Any) -> tuple[Any, set[int] | None]:
    """The underlying storage of a dataset and the indices of it that ``ds`` exposes."""
    idx: list[int] | None = None

    def compose(outer: list[int] | None, inner: list[int]) -> list[int]:
        return inner if outer is None else [inner[i] for i in outer]

    for _ in range(32):
        if isinstance(ds, Subset):
            idx = compose(idx, [int(i) for i in ds.indices])
            ds = ds.dataset
            continue
        x = getattr(ds, "x", None)
        indices = getattr(ds, "indices", None)
        if isinstance(x, torch.Tensor) and indices is not None:  # growtrain's in-memory TensorImages
            return x, set(compose(idx, [int(i) for i in torch.as_tensor(indices).tolist()]))
        break
    return ds, None if idx is None else set(idx)


def probe_overlap(probe_dataset: Any, train_dataset: Any) -> str | None:
    """A description of the overlap between probe and training data, or ``None`` if none is seen.

    Detects the same dataset object, and subsets (``torch.utils.data.Subset`` or growtrain's
    in-memory sets) of one storage whose indices intersect. Different storages are assumed
    independent (nothing more can be told without reading the data).
    """
    if probe_dataset is None or train_dataset is None:
        return None
    if probe_dataset is train_dataset:
        return "the probe loader and the train loader use the same dataset object"
    base_p, idx_p = _base_and_indices(probe_dataset)
    base_t, idx_t = _base_and_indices(train_dataset)
    if base_p is not base_t:
        return None
    if idx_p is None or idx_t is None:
        return "the probe set and the train set are views of the same dataset, one of them all of it"
    common = idx_p & idx_t
    if common:
        return f"{len(common)} sample index(es) are in both the probe and the train set (e.g. {sorted(common)[:5]})"
    return None


class ShardSampler(Sampler[int]):
    """Rank ``r`` of ``w`` reads positions ``r, r+w, ...``: disjoint shards, no padding, so the
    all-reduced sample count is the probe size exactly (DistributedSampler would repeat samples)."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.length, self.rank, self.world_size = length, rank, world_size

    def __iter__(self):
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))


def shard_loader(loader: Any, rank: int, world_size: int) -> Any:
    if world_size <= 1:
        return loader
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"probe: with {world_size} processes the probe must be a torch DataLoader (it is sharded across "
            f"ranks); got {type(loader).__name__}. Fix: return a DataLoader from probe_dataloader()."
        )
    if loader.batch_size is None:
        raise TypeError("probe: a DataLoader with a custom batch_sampler cannot be sharded; pass batch_size instead")
    if not isinstance(loader.sampler, SequentialSampler):  # the shards cover the whole dataset, in order
        raise TypeError(
            f"probe: with {world_size} processes the probe is sharded by position over its whole dataset, but this "
            f"DataLoader reads it through a {type(loader.sampler).__name__}, which the shards would ignore (a subset "
            "sampler's other samples would be scored too). Fix: make the probe samples the dataset itself "
            "(torch.utils.data.Subset) and keep the default sequential order."
        )
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=ShardSampler(len(loader.dataset), rank, world_size),
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
    )


def loaders_of(loaders: Any) -> list[DataLoader]:
    if isinstance(loaders, DataLoader):
        return [loaders]
    if isinstance(loaders, dict):
        return [d for v in loaders.values() for d in loaders_of(v)]
    if isinstance(loaders, (list, tuple)):
        return [d for v in loaders for d in loaders_of(v)]
    return []


def datasets_of(loaders: Any) -> list[Any]:
    return [loader.dataset for loader in loaders_of(loaders)]


# -- the probe's view of the model ------------------------------------------------------------
def has_forward(module: nn.Module) -> bool:
    """Does ``module`` define ``forward``? Lightning does not require one (a ``training_step``
    may call ``self.net`` directly); ``nn.Module``'s and ``LightningModule``'s only raise."""
    unimplemented = [nn.Module.forward]
    try:
        from lightning.pytorch import LightningModule

        unimplemented.append(LightningModule.forward)
    except ImportError:  # pragma: no cover - growtrain depends on Lightning
        pass
    return getattr(type(module), "forward", None) not in unimplemented


class ProbeView:
    """The growable ``network``'s sites and stages, the LightningModule's forward.

    ``measure_saturation`` calls ``network(x)``; when the growable network is only part of the
    model (a trunk between an encoder and a head) the probe must still run the whole forward,
    input to output, so that ``loss_fn(output, target)`` is the model's loss. Site hooks sit on
    the network's stages, which the module's forward runs. A module without ``forward`` (legal
    in Lightning) is probed through the network itself: the only input → output map it names;
    ``check_probe_setup`` refuses, before training, a network whose output the loss cannot take.
    ``eval()`` / ``train()`` save and restore every submodule's own mode (a frozen BatchNorm
    stays in eval).
    """

    def __init__(self, module: nn.Module, network: nn.Module):
        self.module, self.network = module, network
        self.runs = module if has_forward(module) else network

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.runs(*args, **kwargs)

    # Modes and parameters are the whole module's: ``measure_saturation`` saves every
    # submodule's mode and ``requires_grad`` flag through these and restores them afterwards,
    # so an encoder's BatchNorm or a head's Dropout outside the trunk is back in train mode
    # after a check (they stayed in eval for the rest of the fit when these reached only the trunk).
    def modules(self):
        return self.module.modules()

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    @property
    def training(self) -> bool:
        return self.module.training

    def eval(self) -> "ProbeView":
        self.module.eval()
        return self

    def train(self, mode: bool = True) -> "ProbeView":
        self.module.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:  # sites, stage, new_block, neighbour_tensor, ...
        return getattr(self.__dict__["network"], name)


def first_input(loader: Iterable) -> Any:
    for batch in loader:
        return batch[0] if isinstance(batch, (list, tuple)) else batch
    raise ValueError("probe: the probe loader yielded no batches")



@contextmanager
def evaluating(view: ProbeView) -> Iterator[None]:
    """The whole module in eval mode for the block, then every submodule's own mode back."""
    modes = [(m, m.training) for m in view.modules()]
    view.eval()
    try:
        yield
    finally:
        for m, was in modes:
            m.training = was


@torch.no_grad()
def eval_output(view: ProbeView, x: Any) -> torch.Tensor:
    with evaluating(view):
        out = view(x)
    return out if isinstance(out, torch.Tensor) else out[0]


@torch.no_grad()
def per_sample_losses(view: ProbeView, loader: Iterable, loss_fn: Any, device: torch.device) -> torch.Tensor:
    """Every probe sample's loss under the network in eval mode, in the loader's order (float64).

    ``loss_fn`` is the probe's mean-over-samples loss; calling it on one sample's slice of the
    output gives that sample's term of the mean (for a language model: a sequence's token mean)."""
    from growtrain.batches import sample_loss_terms, to_device

    losses = []
    with evaluating(view):
        for batch in loader:
            x, y = to_device(batch[0], device), to_device(batch[-1], device)
            losses.append(sample_loss_terms(view(x), y, loss_fn))  # on the device: one copy at the end
    return torch.cat(losses).cpu() if losses else torch.zeros(0, dtype=torch.float64)


def check_split_indices(dm: Any) -> None:
    """A datamodule's ``probe_indices`` and ``train_indices`` must not share a sample."""
    train = getattr(dm, "train_indices", None)
    probe = getattr(dm, "probe_indices", None)
    if train is None or probe is None:
        return
    common = set(torch.as_tensor(train).tolist()) & set(torch.as_tensor(probe).tolist())
    if common:
        raise ValueError(
            f"probe: the datamodule's probe_indices and train_indices share {len(common)} sample(s) "
            f"(e.g. {sorted(common)[:5]}). The probe must be held out from training. Fix: make the splits disjoint."
        )


def probe_sample_losses(trainer: Any, view: "ProbeView", probe: Any, loss_fn: Any, device: torch.device, *,
                        collective: bool = False) -> torch.Tensor:  # fmt: skip
    """Every probe sample's loss (float64, on the host, in the probe's order) — the same tensor on
    every rank, computed under the trainer's precision as a training step's forward is.

    Under DDP each rank scores only its shard (``ShardSampler``: positions ``r, r+w, ...``) and the
    shards are all-gathered and put back in order: a rank does 1/w of the work and no rank's result
    is thrown away. Under FSDP2 (``collective``: ``ModelParallelStrategy``, the caller knows) a
    forward is a collective that every rank runs on the same batches, so every rank scores the
    whole probe; so does one process."""
    world = int(getattr(trainer, "world_size", 1))
    sharded = world > 1 and not collective
    loader = shard_loader(probe, trainer.global_rank, world) if sharded else probe
    with trainer.precision_plugin.forward_context():
        losses = per_sample_losses(view, Converted(loader, trainer), loss_fn, device)
    if not sharded:
        losses = losses.double().cpu()
        if world > 1:  # FSDP2: rank 0's vector on every rank, one decision even if a kernel is not bit-reproducible
            losses = trainer.strategy.broadcast(losses, src=0)
        return losses
    n = len(probe.dataset)
    per_rank = -(-n // world)  # the longest shard; shorter ones are padded for the all-gather

    def gather(local: torch.Tensor) -> torch.Tensor:
        padded = torch.full((per_rank,), float("nan"), dtype=torch.float64, device=device)
        padded[: local.numel()] = local.to(device=device, dtype=torch.float64)
        rows = trainer.strategy.all_gather(padded).reshape(world, per_rank).cpu()
        full = torch.empty(n, dtype=torch.float64)
        for r in range(world):
            full[r::world] = rows[r, : len(range(r, n, world))]
        return full

    return gather(losses)


def random_order(loader: Any) -> str | None:
    """Why ``loader`` yields its samples in a random order (a shuffling sampler), else ``None``."""
    from torch.utils.data import RandomSampler
    from torch.utils.data.distributed import DistributedSampler

    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    for sampler in samplers:
        if isinstance(sampler, RandomSampler):
            return "its sampler is a RandomSampler (shuffle=True)"
        if isinstance(sampler, DistributedSampler) and sampler.shuffle:
            return "its DistributedSampler has shuffle=True"
    return None


def refuse_random_probe(loader: Any, name: str) -> None:
    """A decision that pairs each probe sample's loss (the trial's before and after, the fork's
    two sides) needs the same samples in the same order: a shuffling probe is refused at setup."""
    why = random_order(loader)
    if why is not None:
        raise ValueError(
            f"{name}: min_gain compares every probe sample's loss at one time with its loss at another, so the probe "
            f"must yield the same samples in the same order at every check, but {why}. Fix: build the probe loader "
            "with shuffle=False (the order does not matter to the saturation score), or pass schedule='converged', "
            "decision='rule' (the first-order rule alone needs no pairing)."
        )


class Converted:
    """The probe loader's batches as a training step receives its batches: the precision
    plugin's conversion (``64-true`` and ``bf16-true`` networks need float64 / bfloat16 inputs;
    mixed precision leaves them alone), then the batch hooks in Lightning's order —
    ``on_before_batch_transfer``, ``transfer_batch_to_device``, ``on_after_batch_transfer`` (the
    datamodule's where it defines them, else the module's) — so a datamodule that normalises or
    tokenises in a hook gets probe scores in the input space it trains in. (A hook that augments
    only ``if self.trainer.training`` augments the probe too: the probe runs inside training.)"""

    def __init__(self, loader: Iterable, trainer: Any):
        self.loader, self.trainer = loader, trainer

    def __iter__(self):
        return (as_training_batch(self.trainer, batch) for batch in self.loader)


def as_training_batch(trainer: Any, batch: Any) -> Any:
    """``batch`` as the training loop hands it to ``training_step`` (see :class:`Converted`)."""
    from lightning.pytorch import LightningDataModule
    from lightning.pytorch.utilities.model_helpers import is_overridden

    batch = trainer.precision_plugin.convert_input(batch)
    module, strategy = getattr(trainer, "lightning_module", None), getattr(trainer, "strategy", None)
    if module is None or strategy is None:  # no fit attached (a bare trainer): the conversion alone
        return batch
    datamodule = getattr(trainer, "datamodule", None)
    owner = datamodule if datamodule is not None and is_overridden("on_before_batch_transfer", datamodule,
                                                                    LightningDataModule) else module  # fmt: skip
    batch = owner.on_before_batch_transfer(batch, 0)
    return strategy.batch_to_device(batch, dataloader_idx=0)  # transfer_batch_to_device, on_after_batch_transfer


def _block_name(block: nn.Module) -> str:
    """A new block's class, the user's own inside ``ResidualAdapter`` (what ``GrowableStack`` wraps)."""
    inner = getattr(block, "block", None)
    if type(block).__name__ == "ResidualAdapter" and isinstance(inner, nn.Module):
        return f"{type(inner).__name__} (in ResidualAdapter)"
    return type(block).__name__


def _first_sites(network: nn.Module) -> list:
    """The first candidate site of each stage: every block of a stage comes from one ``make_block``."""
    first: dict[str, Any] = {}
    for site in network.sites():
        first.setdefault(site.stage, site)
    return list(first.values())


@torch.no_grad()
def check_probe_setup(trainer: Any, pl_module: nn.Module, network: nn.Module, loader: Iterable, loss_fn: Any,
                      seed: int = 0, *, defaulted: bool = False) -> None:  # fmt: skip
    """Refuse, before the first training step, what would otherwise fail only at the first check,
    a whole stage later: one probe batch must run through the probe's forward and its loss
    (a module without ``forward`` is probed through ``network``), and a fresh block inserted at
    the first site of each stage, its last map zero, must leave the output unchanged (a block
    must return ``x + f(x)``). Leaves the network, its growth record and every mode as they were.
    ``seed`` seeds the trial blocks privately. On a fork of the random number generators: a
    DataLoader iterator draws its base seed from torch's global generator, and this check must
    not move the training data order (a run with it trains as one without it). ``defaulted``:
    ``loss_fn`` is the cross-entropy nobody chose (no ``loss_fn``, no ``probe_loss``), so targets
    that look like regression targets are refused rather than scored as class probabilities."""
    device = next(network.parameters()).device
    devices = [device.index if device.index is not None else torch.cuda.current_device()] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        _check_probe_setup(trainer, pl_module, network, loader, loss_fn, seed, defaulted)


class _SilentLoss(Exception):
    """The defaulted cross-entropy refused (raised past the handler for a module without forward)."""


def _check_probe_setup(trainer: Any, pl_module: nn.Module, network: nn.Module, loader: Iterable, loss_fn: Any,
                       seed: int, defaulted: bool = False) -> None:  # fmt: skip
    from growtrain import fsdp
    from growtrain.batches import to_device
    from growtrain.growable import insertion_tolerance

    view = ProbeView(pl_module, network)
    device = next(network.parameters()).device
    batch = None
    for batch in Converted(loader, trainer):
        break
    if batch is None:
        raise ValueError("probe: the probe loader yielded no batches. Fix: give the probe at least one sample.")
    x = to_device(batch[0] if isinstance(batch, (list, tuple)) else batch, device)
    y = to_device(batch[-1], device) if isinstance(batch, (list, tuple)) and len(batch) > 1 else None
    try:
        with evaluating(view):
            out = view(x)
            if defaulted and torch.is_tensor(y) and torch.is_tensor(out) and y.is_floating_point() and y.shape == out.shape:
                raise _SilentLoss(f"loss_fn: the probe scores with cross-entropy when neither loss_fn nor "
                                  f"{type(pl_module).__name__}.probe_loss is given, and the targets are floats of the "
                                  f"output's shape {tuple(out.shape)}: regression targets, or class probabilities? "
                                  "Cross-entropy would take them as probabilities without a word. Fix: pass "
                                  "GrowUntilSaturated(loss_fn=...) with the loss the model trains on (e.g. "
                                  "torch.nn.functional.mse_loss), or loss_fn=torch.nn.functional.cross_entropy for "
                                  "soft labels.")  # fmt: skip
            if y is not None:
                loss_fn(out, y)
    except _SilentLoss as error:
        raise ValueError(str(error)) from None
    except Exception as error:
        if has_forward(pl_module):
            raise
        raise ValueError(
            f"network: {type(pl_module).__name__} defines no forward(), so the probe runs the growable network "
            f"({type(network).__name__}) alone, input to output, and scores its output with the probe loss; on a probe "
            f"batch that failed: {type(error).__name__}: {error}. Fix: define forward(x) on {type(pl_module).__name__}, "
            "returning what training_step feeds the loss (e.g. self.head(self.net(self.encoder(x)))), or pass "
            "loss_fn= that takes the network's output."
        ) from error
    if fsdp.is_sharded(pl_module):  # a sharded insertion needs its block sharded (the growth step's): checked there
        return
    before = eval_output(view, x)
    scale = float(before.float().abs().max()) if before.numel() else 1.0
    tolerance = insertion_tolerance(before.dtype, scale)
    for site in _first_sites(network):
        log_len = len(network.growth_log)
        block = network.grow(site, block=network.new_block(site, seed=seed))  # what grow inserted (it may wrap)
        try:
            after = eval_output(view, x)
        finally:
            network.undo_growth([block], log_len)
        change = float((after.float() - before.float()).abs().max()) if after.shape == before.shape else float("inf")
        if not change <= tolerance:  # also a NaN
            name = _block_name(block)
            raise ValueError(
                f"network: a new {name} block at site {site.name}, its last map zero, changed the model's output by "
                f"max|Δ|={change:.3g} (tolerance {tolerance:.3g}), so no block could be inserted without changing "
                f"what the network computes. A growable block must return x + f(x), carrying its own skip "
                f"connection, with f's last map (its terminal_parameters(), zeroed by zero_init_last()) zero, so a "
                f"new block is the identity. Fix: make {name.split()[0]}.forward return x + f(x); if it applies an "
                "activation after the sum, the site's input must already be in its identity range (e.g. >= 0 after "
                "a ReLU)."
            )
