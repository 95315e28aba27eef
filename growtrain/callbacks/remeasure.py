"""The metrics of a network handed over by an undo (``restore_best``), measured on it.

When a check undoes the last growth, the epoch's logged numbers (``train_loss``, ``val_loss``,
``val_acc``, ...) belong to the network that was just removed: validation ran before the check,
and the training loss is that epoch's mean over the removed network. Carried over, they would
become the end-of-fit summary's "final" line, the checkpoint callback's score and the last
logged metrics of a network nobody gets. So the restored network is measured again:

- the validation metrics with the module's own ``validation_step`` over the trainer's val
  loaders, in eval mode without gradients (what ``trainer.validate`` on the checkpoint gives:
  what the step logs, batch-size-weighted means, torchmetrics computed then reset);
- ``train_loss`` with the probe's loss over the trainer's train set (every sample once, in
  order), in eval mode and without augmentation: the network as handed over, not an average
  over an epoch of changing weights; ``train_acc`` (top-1) in the same pass where the module
  logs one for class targets.

:func:`publish` logs them from the running ``on_train_epoch_end`` hook, so the monitoring
callbacks that run after the growth callback (``ModelCheckpoint``, ``EarlyStopping``) and the
loggers see the restored network's numbers. ``telemetry.final_metrics`` picks the numbers the
end-of-fit summary shows.

The checkpoint files are rewound too (:func:`rewind_checkpoints`, :func:`save_rewound`): every file a
``ModelCheckpoint`` scored since the growth holds the removed network, so it is dropped and the
restored network saved in its place, whether the callback saves at the end of the training
epoch or of validation.
"""

from __future__ import annotations

import itertools
import math
import os
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from torch import nn

# evaluating: the whole module in eval mode, then every submodule's own mode back (a frozen BatchNorm stays in eval)
from growtrain.callbacks.probe_data import evaluating as _eval_mode, loaders_of, shard_loader

__all__ = ["remeasure", "publish", "saved_checkpoints", "rewind_checkpoints", "save_rewound"]


def _limit(count: Any) -> int | None:
    """A loader's batch limit from ``trainer.num_*_batches`` (``inf``: the whole loader)."""
    if count is None or (isinstance(count, float) and math.isinf(count)):
        return None
    return int(count)


def _batches(loader: Any, limit: int | None) -> Any:
    return loader if limit is None else itertools.islice(loader, limit)


def _to_device(trainer: Any, batch: Any, dataloader_idx: int) -> Any:
    """A batch as the fit loop feeds it: the precision plugin's input conversion, then the strategy's transfer."""
    batch = trainer.precision_plugin.convert_input(batch)
    return trainer.strategy.batch_to_device(batch, dataloader_idx=dataloader_idx)


class _Captured:
    """What a module's ``self.log`` calls record while ``validation_step`` runs outside Lightning's loop.

    Plain values: the batch-size-weighted sum and the weight (Lightning's epoch mean); a
    torchmetrics ``Metric``: the object, computed at the end (its state is the pass's)."""

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.weights: dict[str, float] = {}
        self.metrics: dict[str, Any] = {}
        self.batch: Any = None

    def log(self, name: str, value: Any, *args: Any, batch_size: int | None = None, **kwargs: Any) -> None:
        if hasattr(value, "compute") and hasattr(value, "reset"):  # a torchmetrics Metric
            self.metrics[name] = value
            return
        if batch_size is None:
            from lightning.pytorch.utilities.data import extract_batch_size

            try:
                batch_size = extract_batch_size(self.batch)
            except Exception:  # a batch Lightning cannot size either: each step counts once
                batch_size = 1
        value = torch.as_tensor(value, dtype=torch.float64).detach().cpu()
        self.sums[name] = self.sums.get(name, torch.zeros((), dtype=torch.float64)) + value * batch_size
        self.weights[name] = self.weights.get(name, 0.0) + float(batch_size)

    def log_dict(self, dictionary: dict, *args: Any, **kwargs: Any) -> None:
        for name, value in dictionary.items():
            self.log(name, value, *args, **kwargs)

    def values(self, trainer: Any) -> dict[str, float]:
        out = {}
        for name in self.sums:
            total = torch.stack([self.sums[name], torch.tensor(self.weights[name], dtype=torch.float64)])
            if trainer.world_size > 1:  # every rank read its shard: the mean is over all of them
                total = trainer.strategy.reduce(total.to(trainer.strategy.root_device), reduce_op="sum").cpu()
            out[name] = float(total[0] / total[1]) if float(total[1]) > 0 else float("nan")
        for name, metric in self.metrics.items():  # torchmetrics syncs its own state across ranks
            out[name] = float(metric.compute())
            metric.reset()  # the next validation epoch starts from an empty state, as Lightning leaves it
        return out


@contextmanager
def _as_validation(trainer: Any) -> Iterator[None]:
    """The trainer in its validating stage, as the fit loop sets it for validation (a datamodule
    augments only while ``trainer.training``), then back in the stage it was in."""
    stage = trainer.state.stage
    trainer.validating = True
    try:
        yield
    finally:
        trainer.state.stage = stage


@contextmanager
def _capturing(pl_module: nn.Module, captured: _Captured) -> Iterator[None]:
    """``pl_module.log`` / ``log_dict`` record into ``captured`` (instance attributes shadow the methods)."""
    pl_module.__dict__["log"], pl_module.__dict__["log_dict"] = captured.log, captured.log_dict
    try:
        yield
    finally:
        del pl_module.__dict__["log"], pl_module.__dict__["log_dict"]


def _validation(trainer: Any, pl_module: Any) -> dict[str, float]:
    """The module's own validation metrics on the trainer's val loaders, or ``{}`` when the fit has none."""
    loaders = loaders_of(getattr(trainer, "val_dataloaders", None))
    limits = list(getattr(trainer, "num_val_batches", None) or [])
    if not loaders or not callable(getattr(pl_module, "validation_step", None)):
        return {}
    if len(limits) != len(loaders):
        limits = [None] * len(loaders)
    if all(limit == 0 for limit in limits):  # limit_val_batches=0: this fit does not validate
        return {}
    captured = _Captured()
    with _capturing(pl_module, captured), _as_validation(trainer), _eval_mode(pl_module), torch.no_grad():
        pl_module.on_validation_epoch_start()
        for idx, (loader, limit) in enumerate(zip(loaders, limits)):
            for batch_idx, batch in enumerate(_batches(loader, _limit(limit))):
                captured.batch = batch = _to_device(trainer, batch, idx)
                extra = (idx,) if len(loaders) > 1 else ()
                with trainer.precision_plugin.val_step_context():
                    pl_module.validation_step(batch, batch_idx, *extra)
        pl_module.on_validation_epoch_end()
    return captured.values(trainer)


def _in_order(loader: Any, trainer: Any) -> Any:
    """Every sample of a train loader once, in order (no shuffle, no dropped last batch), this
    rank's shard under DDP: the loss then does not depend on a shuffle. A loader that cannot be
    rebuilt (an iterable dataset, a custom batch sampler) is read as it is."""
    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader) or loader.batch_size is None or isinstance(loader.dataset, IterableDataset):
        return loader
    ordered = DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False, drop_last=False,
                         collate_fn=loader.collate_fn, num_workers=loader.num_workers)  # fmt: skip
    return shard_loader(ordered, trainer.global_rank, trainer.world_size)


def _train_limit(trainer: Any, loader: Any) -> int | None:
    """``limit_train_batches`` as a batch count, or ``None`` when the fit reads its whole loader."""
    limit = _limit(getattr(trainer, "num_training_batches", None))
    try:
        whole = len(loader)
    except TypeError:  # an iterable without a length
        return limit
    return limit if limit is not None and limit < whole else None


def _train_loss(trainer: Any, forward: Callable, loss_fn: Callable, module: nn.Module,
                accuracy: bool = False) -> dict[str, float]:  # fmt: skip
    """The probe's loss over the trainer's train loader, batch-size weighted, in eval mode; with
    ``accuracy``, also ``train_acc`` (top-1, where outputs are ``(n, C)`` scores of class targets
    ``(n,)``: what an image classifier logs under that name)."""
    loaders = loaders_of(getattr(trainer, "train_dataloader", None))
    if len(loaders) != 1:  # several train loaders: no single "train_loss" to re-measure
        return {}
    total = torch.zeros(3, dtype=torch.float64)  # loss·n, n, correct
    classes = accuracy
    with _as_validation(trainer), _eval_mode(module), torch.no_grad():
        for batch in _batches(_in_order(loaders[0], trainer), _train_limit(trainer, loaders[0])):
            batch = _to_device(trainer, batch, 0)
            x, y = (batch[0], batch[-1]) if isinstance(batch, (list, tuple)) else (batch, None)
            with trainer.precision_plugin.val_step_context():
                out = forward(x)
                loss = loss_fn(out, y)
            n = len(y) if y is not None and hasattr(y, "__len__") else 1
            classes = classes and isinstance(y, torch.Tensor) and y.dim() == 1 and not y.is_floating_point() \
                and isinstance(out, torch.Tensor) and out.dim() == 2 and out.shape[0] == n
            correct = float((out.argmax(1) == y).sum()) if classes else 0.0
            total += torch.tensor([float(loss) * n, n, correct], dtype=torch.float64)
    if trainer.world_size > 1:
        total = trainer.strategy.reduce(total.to(trainer.strategy.root_device), reduce_op="sum").cpu()
    if float(total[1]) <= 0:
        return {}
    measured = {"train_loss": float(total[0] / total[1])}
    if classes:
        measured["train_acc"] = float(total[2] / total[1])
    return measured


def remeasure(trainer: Any, pl_module: Any, forward: Callable, loss_fn: Callable) -> dict[str, float]:
    """The handed-over network's validation metrics (the module's ``validation_step``) and
    ``train_loss`` (``loss_fn(forward(x), y)`` over the train loader), both in eval mode, and
    ``train_acc`` where the module logs one for class targets — else the last logged
    ``train_acc`` would be the removed network's.

    ``forward``: the probe's view of the model (input → output). Call on every rank."""
    metrics = _train_loss(trainer, forward, loss_fn, pl_module, accuracy="train_acc" in trainer.callback_metrics)
    metrics.update(_validation(trainer, pl_module))  # the module's own train_* names are not produced here
    return metrics


def publish(pl_module: Any, metrics: dict[str, float]) -> bool:
    """Log ``metrics`` from the running ``on_train_epoch_end`` hook (epoch-level, already the
    same on every rank), so they replace the removed network's in ``trainer.callback_metrics``
    for the callbacks after this one and in the epoch's logged metrics. ``False`` when the
    module is not in a hook that may log (nothing is logged then)."""
    if getattr(pl_module, "_current_fx_name", None) != "on_train_epoch_end" or getattr(pl_module, "_trainer", None) is None:
        return False
    trainer = pl_module._trainer
    for name, value in metrics.items():
        if math.isfinite(value):  # the same value on every rank: syncing it only keeps Lightning from warning
            pl_module.log(name, value, on_step=False, on_epoch=True, sync_dist=trainer.world_size > 1,
                          logger=bool(trainer.loggers))  # fmt: skip
    return True


def _model_checkpoints(trainer: Any) -> list:
    from lightning.pytorch.callbacks import ModelCheckpoint

    return [cb for cb in trainer.checkpoint_callbacks if isinstance(cb, ModelCheckpoint)]


def _files_in(trainer: Any, cb: Any) -> list[str]:
    """The checkpoint files in ``cb``'s directory (local file systems; rank 0's listing on every
    rank, so every rank deletes and saves alike). A callback without ``monitor`` scores nothing
    (``best_k_models`` stays empty), so its files since a growth are found by listing."""
    from lightning.fabric.utilities.cloud_io import _is_local_file_protocol

    files: list[str] = []
    if cb.dirpath and _is_local_file_protocol(str(cb.dirpath)) and os.path.isdir(cb.dirpath):
        files = sorted(os.path.join(cb.dirpath, name) for name in os.listdir(cb.dirpath)
                       if name.endswith(cb.FILE_EXTENSION))  # fmt: skip
    if getattr(trainer, "world_size", 1) > 1:
        files = trainer.strategy.broadcast(files, src=0)
    return files


def saved_checkpoints(trainer: Any) -> dict[str, dict]:
    """Each ``ModelCheckpoint``'s files now (its ``state_key`` → each scored path's score, every
    file in its directory, and the step it last saved at): kept with the snapshot at a growth, so
    an undo knows which files were written after it — new files, and scored paths saved over (a
    fixed ``filename`` such as ``best_train``) since. Plain values: the same on every rank."""
    return {cb.state_key: {"files": {path: float(score) for path, score in cb.best_k_models.items()},
                           "listed": _files_in(trainer, cb), "step": int(cb._last_global_step_saved)}
            for cb in _model_checkpoints(trainer)}  # fmt: skip


def rewind_checkpoints(trainer: Any, before: dict[str, dict], measured: Any = ()) -> tuple[list[str], list]:
    """After an undo: every ``ModelCheckpoint`` forgets (and deletes) the files it wrote since the
    growth — they hold the removed network. :func:`save_rewound` then saves the restored one
    (after :func:`publish`, and after the check's record, so the files hold the undo). Call both
    on every rank (saving is collective).

    Lightning's own save at the end of this epoch would not do: a callback that saves at the end
    of validation already saved this step (before the check: the removed network), and one that
    keeps its top k keeps the removed network's better-scored files of the stage. ``measured``:
    the names re-measured on the restored network; a callback monitoring anything else is not
    re-scored (its top k keeps what predates the growth; ``last`` is still re-saved). Files are
    deleted under Lightning's own rule (never the checkpoint the fit resumed from, nor a file
    outside the callback's directory). Returns what was done (one line per callback; nothing for
    a callback absent at the growth) and the callbacks to save, each with whether to re-score."""
    done, pending = [], []
    for cb in _model_checkpoints(trainer):
        if cb.state_key not in before:
            continue
        known = before[cb.state_key]
        saved_since = int(cb._last_global_step_saved) > known["step"]
        # scored since: a new path, a path saved over with a new score, or the last save's path
        stale = [path for path, score in cb.best_k_models.items() if known["files"].get(path) != float(score)
                 or (saved_since and path == cb._last_checkpoint_saved)]  # fmt: skip
        for path in stale:
            cb.best_k_models.pop(path)
        if cb.monitor is None and cb.best_model_path and saved_since and cb.best_model_path not in stale:
            stale.append(cb.best_model_path)  # monitor=None: its one file outside best_k_models, its last save
        listed = set(known.get("listed", ()))
        stale += [path for path in _files_in(trainer, cb) if path not in listed and path not in stale]
        deleted = [path for path in stale if path != cb.last_model_path
                   and cb._should_remove_checkpoint(trainer, path, cb.last_model_path or "")]  # fmt: skip
        for path in deleted:
            cb._remove_checkpoint(trainer, path)
        if cb._last_checkpoint_saved in stale:  # save_last="link" must not link to a deleted file
            cb._last_checkpoint_saved = ""
        # the bookkeeping Lightning keeps over best_k_models, recomputed without the removed files
        worst, best = (max, min) if cb.mode == "min" else (min, max)
        cb.kth_best_model_path, cb.kth_value = "", torch.tensor(math.inf if cb.mode == "min" else -math.inf)
        if cb.best_k_models:
            cb.best_model_path = best(cb.best_k_models, key=cb.best_k_models.get)
            cb.best_model_score = cb.best_k_models[cb.best_model_path]
            if len(cb.best_k_models) == cb.save_top_k:
                cb.kth_best_model_path = worst(cb.best_k_models, key=cb.best_k_models.get)
                cb.kth_value = cb.best_k_models[cb.kth_best_model_path]
        elif cb.best_model_path in stale:
            cb.best_model_path, cb.best_model_score = "", None
        rescore = cb.monitor is None or cb.monitor in measured
        names = ", ".join(sorted(os.path.basename(path) for path in deleted)) or "none"
        done.append(f"ModelCheckpoint(monitor={cb.monitor!r}): deleted the removed network's file(s) ({names}); "
                    + ("saves the restored network, scored by its re-measured metrics" if rescore else
                       f"{cb.monitor!r} was not re-measured on the restored network: only last is re-saved"))  # fmt: skip
        pending.append((cb, rescore))
    return done, pending


def save_rewound(trainer: Any, pending: list) -> None:
    """Save the restored network with each rewound callback: its top k (when its monitor was
    re-measured; whatever its epoch or step schedule, so the deleted files are replaced) and,
    whatever the score, ``last`` — the handed-over network."""
    if getattr(trainer, "fast_dev_run", False):  # Lightning saves nothing under fast_dev_run
        return
    for cb, rescore in pending:
        candidates = cb._monitor_candidates(trainer)
        if rescore:
            cb._save_topk_checkpoint(trainer, candidates)
        cb._save_last_checkpoint(trainer, candidates)
