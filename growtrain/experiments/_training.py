"""Sibling trainings: one experiment trains many networks, each with its own trainer.

A *sibling* trainer has the settings the experiment's trainer was built with (``init_kwargs``:
max_epochs, precision, callbacks, …) but its own ``default_root_dir``, a CSV logger in that
directory, fresh deep copies of the callbacks, and whatever the experiment overrides (e.g.
``max_steps`` for the compute-matched arm). Sibling trainings are single-process.

:class:`BaseGrowTrainer` is the trainer class of both the siblings and the CLI's
:class:`growtrain.trainer.GrowTrainer` (which adds the experiment subcommands).
"""

from __future__ import annotations

import copy
import types
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.callbacks.model_summary import log
from lightning.pytorch.utilities.model_summary.model_summary import _format_summary_table
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.utilities.types import EVAL_DATALOADERS, TRAIN_DATALOADERS
from torch.utils.data import DataLoader

from growtrain.callbacks import GammaTracePlot, RandomStateCheckpoint, growth_callbacks
from growtrain.callbacks._select import as_callback_list
from growtrain.quiet import quiet_upstream_noise
from growtrain.resume import continue_run_folder

__all__ = ["BaseGrowTrainer", "sibling_trainer", "evaluate"]


class BaseGrowTrainer(Trainer):
    """``lightning.Trainer`` that keeps its arguments and plots the growth checks.

    Takes exactly ``lightning.Trainer``'s arguments and keeps them in ``init_kwargs`` so an
    experiment can build sibling trainers with the same settings. When a
    ``GrowUntilSaturated`` callback is configured, a :class:`growtrain.callbacks.GammaTracePlot`
    is added so ``fit`` also writes ``gamma_trace.png`` next to the logs. Every trainer gets a
    :class:`growtrain.callbacks.RandomStateCheckpoint` (the random state in its checkpoints, so a
    resumed fit trains on the batches the uninterrupted one would have), and ``fit`` resumed from
    ``…/version_N/checkpoints/*.ckpt`` logs on into ``version_N/`` (``growtrain.resume``).
    """

    continues_run_folder = True  # fit(ckpt_path=…) writes on into the checkpoint's run folder (growtrain.resume)

    def __init__(self, **kwargs: Any) -> None:
        self.init_kwargs: dict[str, Any] = dict(kwargs)
        quiet_upstream_noise()
        callbacks = as_callback_list(kwargs.get("callbacks"))
        if growth_callbacks(callbacks) and not any(isinstance(cb, GammaTracePlot) for cb in callbacks):
            callbacks = callbacks + [GammaTracePlot()]
        if kwargs.get("enable_model_summary") is not False and not any(isinstance(cb, ModelSummary) for cb in callbacks):
            callbacks = callbacks + [SummaryWithoutZeroFlops()]
        if not any(isinstance(cb, RandomStateCheckpoint) for cb in callbacks):
            callbacks = callbacks + [RandomStateCheckpoint()]
        if callbacks:
            kwargs["callbacks"] = callbacks
        super().__init__(**kwargs)
        bar = self.progress_bar_callback
        if bar is not None and "get_metrics" not in vars(bar):
            bar.get_metrics = types.MethodType(_metrics_without_version, bar)

    def fit(
        self,
        model: LightningModule,
        train_dataloaders: Optional[Union[TRAIN_DATALOADERS, LightningDataModule]] = None,
        val_dataloaders: Optional[EVAL_DATALOADERS] = None,
        datamodule: Optional[LightningDataModule] = None,
        ckpt_path: Optional[Union[str, Path]] = None,
        weights_only: Optional[bool] = None,
    ) -> None:
        # Same signature as Trainer.fit: LightningCLI reads the fit subcommand's arguments from it.
        # A resumed fit logs on into the checkpoint's version_N/ (one metrics.csv per run); its
        # checkpoints/ folder is then, as expected, not empty: Lightning's warning says nothing then.
        if continue_run_folder(self, ckpt_path) is None:
            return super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=r"Checkpoint directory .* exists and is not empty")
            return super().fit(model, train_dataloaders, val_dataloaders, datamodule, ckpt_path, weights_only)

    fit.__doc__ = Trainer.fit.__doc__


def _metrics_without_version(bar, trainer, pl_module):
    """The progress bar's metrics without ``v_num`` (the logger's version, not a metric)."""
    items = type(bar).get_metrics(bar, trainer, pl_module)
    items.pop("v_num", None)
    return items


class SummaryWithoutZeroFlops(ModelSummary):
    """Lightning's model summary, without its FLOPs column and "Total Flops" line when it counted
    none (it counts only with an ``example_input_array``, so they read 0 for every growtrain model)."""

    @staticmethod
    def summarize(summary_data, total_parameters, trainable_parameters, model_size, total_training_modes,
                  total_flops, **summarize_kwargs) -> None:  # fmt: skip
        if total_flops:
            return ModelSummary.summarize(summary_data, total_parameters, trainable_parameters, model_size,
                                          total_training_modes, total_flops, **summarize_kwargs)  # fmt: skip
        data = [column for column in summary_data if column[0] != "FLOPs"]
        table = _format_summary_table(total_parameters, trainable_parameters, model_size, total_training_modes, 0, *data)
        lines = table.splitlines()
        if lines and lines[-1].rstrip().endswith("Total Flops"):
            lines = lines[:-1]
        log.info("\n" + "\n".join(lines))


def sibling_trainer(
    trainer_kwargs: dict | None,
    root: str | Path,
    *,
    keep: Callable[[Callback], bool] = lambda cb: True,
    extra_callbacks: Sequence[Callback] = (),
    **overrides: Any,
) -> BaseGrowTrainer:
    """A trainer with the settings ``trainer_kwargs`` but its own directory and callbacks.

    Callbacks are deep copies of the configured ones that ``keep`` accepts (the CLI's
    ``SaveConfigCallback`` is never copied: it refuses to overwrite a config file), plus
    ``extra_callbacks``. A configured logger becomes a ``CSVLogger`` writing into ``root``.
    ``overrides`` replace any setting (e.g. ``max_steps=…``).
    """
    kwargs = dict(trainer_kwargs or {})
    callbacks = [
        copy.deepcopy(cb)
        for cb in as_callback_list(kwargs.pop("callbacks", None))
        if not isinstance(cb, (SaveConfigCallback, GammaTracePlot)) and keep(cb)
    ]
    root = Path(root)
    kwargs["default_root_dir"] = str(root)
    kwargs["callbacks"] = callbacks + list(extra_callbacks)
    if kwargs.get("logger") is not False:  # None and True mean Lightning's default logger
        kwargs["logger"] = CSVLogger(str(root), name="", version="")
    kwargs.update(overrides)
    return BaseGrowTrainer(**kwargs)


class DelegatingDataModule(LightningDataModule):
    """A datamodule wrapping ``self.inner``: batches move and transform exactly as the inner
    datamodule's hooks do (normalisation, augmentation, precision)."""

    inner: LightningDataModule

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return self.inner.transfer_batch_to_device(batch, device, dataloader_idx)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return self.inner.on_before_batch_transfer(batch, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return self.inner.on_after_batch_transfer(batch, dataloader_idx)


class _SplitAsTest(DelegatingDataModule):
    """Serve one split of ``datamodule`` as a test split, with the datamodule's batch hooks."""

    def __init__(self, datamodule: LightningDataModule, split: str):
        super().__init__()
        self.inner, self.split = datamodule, split

    def prepare_data(self) -> None:
        self.inner.prepare_data()

    def setup(self, stage: str) -> None:
        self.inner.setup("test" if self.split == "test" else "fit")

    def test_dataloader(self):
        # Its batch hooks may ask `self.trainer.training` (augmentation): answer with this
        # evaluation-only trainer, so train batches are normalised but never augmented.
        self.inner.trainer = self.trainer
        make = getattr(self.inner, f"{self.split}_dataloader", None)
        if make is None:
            raise ValueError(f"datamodule: {type(self.inner).__name__} has no {self.split}_dataloader()")
        loader = make()
        if isinstance(loader, DataLoader) and loader.batch_size is not None:
            # the train loader shuffles and drops its last batch: evaluate every sample, in order
            loader = DataLoader(loader.dataset, batch_size=loader.batch_size, shuffle=False, drop_last=False,
                                collate_fn=loader.collate_fn, num_workers=loader.num_workers)  # fmt: skip
        return loader



def evaluate(
    module: LightningModule,
    datamodule: LightningDataModule,
    split: Literal["train", "val", "test"],
    trainer_kwargs: dict | None,
    root: str | Path,
) -> dict[str, float]:
    """Metrics of ``module`` on one split, in eval mode, without augmentation.

    Runs the module's own ``test_step`` through ``Trainer.test`` on the split's loader and
    returns its ``test_*`` metrics without the prefix (e.g. ``{"loss": …, "acc": …}``). The
    train split is capped by ``limit_train_batches``, the others by their own limits.
    """
    kwargs = trainer_kwargs or {}
    limit = kwargs.get({"train": "limit_train_batches", "val": "limit_val_batches"}.get(split, "limit_test_batches"))
    trainer = sibling_trainer(
        kwargs,
        root,
        keep=lambda cb: False,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_test_batches=1.0 if limit is None else limit,
    )
    results = trainer.test(module, datamodule=_SplitAsTest(datamodule, split), verbose=False)
    metrics = results[0] if results else {}
    return {k[len("test_") :]: float(v) for k, v in metrics.items() if k.startswith("test_")}
