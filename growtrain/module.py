"""LightningModules for growtrain, and the mixin that makes checkpoints growth-aware.

Why a mixin: Lightning restores a checkpoint as module ``on_load_checkpoint`` → model
``load_state_dict`` → callbacks' state. Callback state therefore arrives *after* the weights,
so the grown architecture must be rebuilt by the module itself, from a plain-data growth
record it stored (``checkpoint["growtrain"]["growth"]``). Plain data also keeps the
checkpoint loadable with ``torch.load(weights_only=True)``, which ``LightningCLI`` uses.
"""

from __future__ import annotations

import os
from typing import Any, Literal, Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.cli import LRSchedulerCallable, OptimizerCallable
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import ReduceLROnPlateau
from torchmetrics import Metric
from torchmetrics.classification import MulticlassAccuracy

from growtrain.growable import replay_growth, resolve_network
from growtrain.models import cifar_resnet
from growtrain.optim import param_groups, paper_sgd
from growtrain.quiet import quiet_upstream_noise

# a plain script that trains a growtrain module with Lightning's own Trainer: no tips or LeafSpec
# deprecation it cannot act on (growtrain/quiet.py; message by message, growtrain's own kept)
quiet_upstream_noise()

__all__ = ["ConfiguredOptimizerMixin", "GrowableModuleMixin", "ImageClassifier", "SharedStepsMixin", "WeightedMean"]

_ARCHS = {"cifar_resnet": cifar_resnet}
_PLAIN = (str, int, float, bool, type(None))


def _check_plain(value: Any, where: str) -> None:
    """Fail at save time, not at a later ``weights_only=True`` load, if a record is not plain data."""
    if isinstance(value, dict):
        for key, item in value.items():
            _check_plain(key, where)
            _check_plain(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_plain(item, f"{where}[{i}]")
    elif not isinstance(value, _PLAIN):
        raise TypeError(
            f"{where}: growth records must be plain data (dict/list/str/int/float/bool/None) so that "
            f"checkpoints load with weights_only=True; got {type(value).__name__}. Store names, not objects."
        )


class WeightedMean(Metric):
    """``Σ w·x / Σ w`` over an epoch (summed over ranks), with no host read in ``update``.

    Why not ``torchmetrics.MeanMetric``: its ``update`` screens every value for NaN with a
    Python ``if`` on a device tensor (a host synchronisation per step on a GPU), and with
    ``nan_strategy="disable"`` it drops the weights. Here a NaN value makes the mean NaN.
    """

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("total", default=torch.tensor(0.0), dist_reduce_fx="sum")
        self.add_state("weight", default=torch.tensor(0.0), dist_reduce_fx="sum")

    def update(self, value: torch.Tensor, weight: torch.Tensor) -> None:
        """``value`` and ``weight``: tensors on the metric's device (a Python number would be
        copied there, itself a synchronising transfer)."""
        self.total += (value.detach().to(self.total.dtype) * weight).sum()
        self.weight += weight.to(self.weight.dtype).sum()

    def compute(self) -> torch.Tensor:
        return self.total / self.weight


class GrowableModuleMixin:
    """Optional: growtrain's networks (``GrowableMixin``) carry their growth record in their own
    state dict and rebuild themselves on ``load_state_dict``, so a plain LightningModule needs no
    base class. This mixin adds a checkpoint-file check to ``load_from_checkpoint``, refuses a
    sharded (FSDP2) resume that would load into the ungrown model, and replays the record from
    ``checkpoint["growtrain"]`` for a network of your own that implements the growable protocol
    without ``GrowableMixin``::

        class MyModule(GrowableModuleMixin, LightningModule): ...

    The growable network is ``getattr(self, growable_attr)`` when
    ``growable_attr`` is set, else the first submodule with ``sites()`` and ``grow()``. If
    you override ``on_save_checkpoint``/``on_load_checkpoint``, call ``super()``.
    """

    growable_attr: str | None = None

    @property
    def growable_network(self) -> nn.Module:
        # TypeError, not AttributeError: nn.Module.__getattr__ would swallow the latter.
        where = f"self.{self.growable_attr}" if self.growable_attr else "any submodule"
        try:
            network = resolve_network(self, self.growable_attr, required=False)  # type: ignore[arg-type]
        except (TypeError, ValueError) as err:
            raise TypeError(f"growable_attr: {where} of {type(self).__name__}: {err}") from err
        if network is None:
            raise TypeError(
                f"growable_attr: {where} of {type(self).__name__} is not a growable network (needs sites(), "
                "grow() and growth_log). Set `growable_attr = '<attribute name>'` on your module class."
            )
        return network

    @classmethod
    def load_from_checkpoint(cls, checkpoint_path, *args: Any, **kwargs: Any):  # type: ignore[override]
        """``LightningModule.load_from_checkpoint``, after checking that a local file is a complete
        checkpoint (a truncated file is a ``ValueError`` naming it, not torch's bare ``OSError``)."""
        from growtrain.ckpt_file import check_checkpoint_file

        if isinstance(checkpoint_path, (str, os.PathLike)):
            check_checkpoint_file(checkpoint_path)
        return super().load_from_checkpoint(checkpoint_path, *args, **kwargs)  # type: ignore[misc]

    def configure_callbacks(self):
        """The module's callbacks plus :class:`growtrain.ckpt_file.CheckpointFileCheck`, so that
        ``trainer.fit(ckpt_path=<truncated file>)`` names the file. Overriding this? Call ``super()``."""
        from growtrain.ckpt_file import CheckpointFileCheck

        callbacks = super().configure_callbacks()  # type: ignore[misc]
        callbacks = [] if callbacks is None else [callbacks] if not isinstance(callbacks, (list, tuple)) else list(callbacks)
        return callbacks + [CheckpointFileCheck()]

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_save_checkpoint(checkpoint)  # type: ignore[misc]
        records = [dict(r) for r in self.growable_network.growth_log]
        _check_plain(records, "growth_log")
        checkpoint["growtrain"] = {"growth": records}

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        super().on_load_checkpoint(checkpoint)  # type: ignore[misc]
        records = checkpoint.get("growtrain", {}).get("growth", [])
        network = self.growable_network
        if len(records) > len(network.growth_log):
            from growtrain.fsdp import is_sharded

            if is_sharded(self):  # ModelParallelStrategy has loaded the shards already, into the ungrown model
                raise RuntimeError(
                    f"checkpoint: it records {len(records)} growth(s) but this FSDP2-sharded model has "
                    f"{len(network.growth_log)}, and its shards were loaded before this hook could grow it (a "
                    "distributed load fills only the keys the model has: the weights would sit at the wrong depth). "
                    "Fix: resume with GrowUntilSaturated in the trainer's callbacks (it grows the model to the "
                    "checkpoint's depth before the shards load)."
                )
        # Inserts fresh blocks at the recorded sites, in order; load_state_dict fills them next.
        replay_growth(network, records)


class ConfiguredOptimizerMixin:
    """Optimizer and scheduler built from injected factories over growth-aware param groups.

    ``configure_optimizers`` runs at fit start and again at resume (after the growth replay):
    the groups come from the current architecture in a deterministic order (base, then one set
    per growth), so resumed optimizer state lines up by position.
    """

    def _set_optimization(self, optimizer, lr_scheduler, scheduler_interval, no_decay, default_optimizer) -> None:
        # Callables given from Python are code, not data: keep them out of the checkpoint so it
        # loads with weights_only=True. (LightningCLI passes their config as plain dicts.)
        for key in ("optimizer", "lr_scheduler"):
            if callable(self.hparams.get(key)):
                del self.hparams[key]
        if scheduler_interval not in ("epoch", "step"):
            raise ValueError(f"scheduler_interval: expected 'epoch' or 'step', got {scheduler_interval!r}")
        if no_decay not in ("none", "gpt"):
            raise ValueError(f"no_decay: expected 'none' or 'gpt', got {no_decay!r}")
        self.optimizer_factory = optimizer or default_optimizer
        self.lr_scheduler_factory = lr_scheduler
        self.scheduler_interval = scheduler_interval
        # Read by growtrain.optim.groups_for_new_parameters, so blocks added mid-fit get the
        # same group rule as configure_optimizers gives them on resume.
        self.param_group_options = {"no_decay": no_decay}

    def configure_optimizers(self):
        optimizer = self.optimizer_factory(param_groups(self.network, **self.param_group_options))
        if self.lr_scheduler_factory is None:
            return optimizer
        scheduler = self.lr_scheduler_factory(optimizer)
        config = {"scheduler": scheduler, "interval": self.scheduler_interval}
        if isinstance(scheduler, ReduceLROnPlateau):
            config["monitor"] = "train_loss"  # the paper selects on training loss, never on val/test
        return {"optimizer": optimizer, "lr_scheduler": config}


class SharedStepsMixin:
    """``training/validation/test_step`` that delegate to the module's ``_shared_step(batch, stage)``."""

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        loss = self._shared_step(batch, "train")
        # The progress bar turns a logged tensor into a Python number on every step; for a CUDA
        # tensor that is a host synchronisation that drains the GPU's queue each step. So the
        # bar's loss is a CPU copy refreshed every `log_every_n_steps` steps (one sync per
        # refresh); the steps in between show that copy again without touching the device.
        trainer = getattr(self, "_trainer", None)
        every = max(1, int(getattr(trainer, "log_every_n_steps", 1) or 1))
        shown = getattr(self, "_shown_step_loss", None)
        if shown is None or batch_idx % every == 0:
            shown = self._shown_step_loss = loss.detach().float().cpu()
        self.log("loss", shown, on_step=True, on_epoch=False, prog_bar=True, logger=False)
        return loss

    def validation_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "val")

    def test_step(self, batch, batch_idx: int) -> None:
        self._shared_step(batch, "test")


class ImageClassifier(GrowableModuleMixin, ConfiguredOptimizerMixin, SharedStepsMixin, LightningModule):
    """Cross-entropy image classifier around a growable network.

    Args:
        network: a ready network; ``None`` builds ``arch`` from the arguments below. A given
            network is not saved in the hyper-parameters: pass it again to
            ``load_from_checkpoint(path, network=...)``.
        arch, blocks, width, family, added, in_channels, num_classes: the network
            (``growtrain.models.cifar_resnet``'s arguments; ``num_classes`` also sizes the
            accuracy metric).
        optimizer: called with the param groups each time ``configure_optimizers`` runs;
            ``None`` is the paper's SGD (lr 0.1, momentum 0.9, weight decay 5e-4).
        lr_scheduler: called with the optimizer; ``ReduceLROnPlateau`` monitors ``train_loss``.
        scheduler_interval: step the scheduler every ``"epoch"`` or every optimizer ``"step"``.
        no_decay: ``"none"`` decays every parameter (the paper); ``"gpt"`` exempts biases,
            norms and embeddings (see ``growtrain.optim.param_groups``).

    Logs per epoch: ``train_loss``, ``train_acc``, ``val_loss``, ``val_acc``, ``test_loss``,
    ``test_acc`` (sample-weighted means over the epoch); ``loss`` in the progress bar (a step's
    loss, refreshed every ``log_every_n_steps`` steps). No step waits for the device: metrics
    accumulate on it and are read once per epoch.
    """

    def __init__(
        self,
        network: nn.Module | None = None,
        *,
        arch: str = "cifar_resnet",
        blocks: tuple[int, int, int] = (1, 1, 1),
        width: int = 16,
        family: str = "basic",
        added: int = 0,
        in_channels: int = 3,
        num_classes: int = 10,
        optimizer: OptimizerCallable | None = None,
        lr_scheduler: LRSchedulerCallable | None = None,
        scheduler_interval: Literal["epoch", "step"] = "epoch",
        no_decay: Literal["none", "gpt"] = "none",
    ):
        super().__init__()
        self.save_hyperparameters(ignore=["network"])
        self._set_optimization(optimizer, lr_scheduler, scheduler_interval, no_decay, paper_sgd)
        for name, value in (("num_classes", num_classes), ("in_channels", in_channels)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(
                    f"{name}: expected a positive integer, got {value!r}. Under `growtrain fit` it comes from "
                    f"the datamodule's `{name}` attribute: give your datamodule that attribute."
                )
        if network is None:
            if arch not in _ARCHS:
                raise ValueError(f"arch: unknown architecture {arch!r}; known: {sorted(_ARCHS)}")
            network = _ARCHS[arch](tuple(blocks), width, family, in_channels, num_classes, added)
        self.network = network
        self.metrics = nn.ModuleDict()
        for stage in ("train", "val", "test"):
            # No per-step checks that read device values on the host (a sync per step on a GPU):
            # no NaN screening (a NaN loss makes the epoch mean NaN instead of being dropped with
            # a warning) and no label validation (cross_entropy already rejects bad labels).
            self.metrics[f"{stage}_loss"] = WeightedMean()
            # micro average = plain accuracy (torchmetrics' default is macro)
            self.metrics[f"{stage}_acc"] = MulticlassAccuracy(num_classes, average="micro", validate_args=False)

    # The growth callback scores candidate blocks with this loss (LanguageModel has the same
    # method): the batch-mean cross-entropy, exactly what training minimises.
    probe_loss = staticmethod(F.cross_entropy)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.network(x)

    def _shared_step(self, batch: Sequence[torch.Tensor], stage: str) -> torch.Tensor:
        x, y = batch
        logits = self(x)  # (B, num_classes)
        loss = self.probe_loss(logits, y)  # one loss for training, metrics and the probe
        # The weight is made on the device (full_like): a Python number would be copied there.
        weight = torch.full_like(loss.detach(), y.numel(), dtype=torch.float32)
        self.metrics[f"{stage}_loss"].update(loss.detach(), weight=weight)
        self.metrics[f"{stage}_acc"].update(logits.detach(), y)
        self.log(f"{stage}_loss", self.metrics[f"{stage}_loss"], on_step=False, on_epoch=True, prog_bar=True)
        self.log(f"{stage}_acc", self.metrics[f"{stage}_acc"], on_step=False, on_epoch=True)
        return loss

    def predict_step(self, batch, batch_idx: int) -> torch.Tensor:
        x = batch[0] if isinstance(batch, (tuple, list)) else batch
        return self(x)


class ScaledLossClassifier(ImageClassifier):
    """:class:`ImageClassifier` trained, evaluated and probed on ``loss_scale`` × the cross-entropy.

    The loss-scale control of a growth decision (a user's loss in other units): with the SGD rate
    ÷ ``loss_scale`` and weight decay × ``loss_scale`` it follows the plain classifier's trajectory,
    so a scale-free decision must make the same choices. Its logged losses are ``loss_scale`` × the
    plain ones.
    """

    def __init__(self, *args: Any, loss_scale: float = 10.0, **kwargs: Any):
        if not isinstance(loss_scale, (int, float)) or isinstance(loss_scale, bool) or not loss_scale > 0:
            raise ValueError(f"loss_scale: expected a positive number, got {loss_scale!r}. Fix: e.g. loss_scale=10.")
        super().__init__(*args, **kwargs)
        self.loss_scale = float(loss_scale)

    def probe_loss(self, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss_scale * F.cross_entropy(logits, y)
