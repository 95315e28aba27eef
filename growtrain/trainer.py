"""``GrowTrainer``: a ``lightning.Trainer`` whose extra methods are growtrain's experiments.

LightningCLI builds one subcommand per trainer method named in ``subcommands()``, with the
method's signature as its arguments. So ``growtrain compare|measure|sweep|match`` are
``GrowTrainer.compare|measure|sweep|match``; each is a thin wrapper around a function in
``growtrain.experiments`` that needs no CLI (call it from Python or a notebook).

The experiments train many networks, one after another in this process. Each training gets a
*sibling* trainer: the same settings this trainer was built with (``init_kwargs``: max_epochs,
precision, callbacks, …) but its own ``default_root_dir``, a CSV logger in that directory,
fresh deep copies of the callbacks, and whatever the experiment overrides (e.g. ``max_steps``
for the compute-matched arm). Sibling trainings are single-process: ``devices > 1`` is
refused by the experiment methods.

Compute is counted by :class:`ComputeMeter`: estimated training FLOPs are
``3 × forward FLOPs of one sample × samples seen``, the forward FLOPs counted once per
architecture with ``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions;
elementwise work such as BatchNorm and ReLU is not counted).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, Trainer
from lightning.pytorch.cli import SaveConfigCallback
from lightning.pytorch.loggers import CSVLogger
from torch.utils.data import DataLoader
from torch.utils.flop_counter import FlopCounterMode

from growtrain.callback import GrowUntilSaturated
from growtrain.plots import GammaTracePlot

__all__ = ["EXPERIMENTS", "GrowTrainer", "ComputeMeter", "forward_flops", "sibling_trainer", "evaluate", "growth_callbacks"]

# GrowTrainer methods that the CLI exposes as subcommands (``growtrain compare --config …``).
EXPERIMENTS = ("compare", "measure", "sweep", "match")


def growth_callbacks(callbacks: Sequence[Callback] | Callback | None) -> list[Callback]:
    """The ``GrowUntilSaturated`` instances among ``callbacks``."""
    return [cb for cb in _as_list(callbacks) if isinstance(cb, GrowUntilSaturated)]


def _as_list(callbacks) -> list:
    if callbacks is None:
        return []
    if isinstance(callbacks, Callback):
        return [callbacks]
    return list(callbacks)


# -- compute ---------------------------------------------------------------------------------
def _inputs(batch: Any) -> Any:
    """The model input of a batch: ``x`` of ``(x, y)``, else the batch itself."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 1:
        return batch[0]
    if isinstance(batch, dict):
        for key in ("input", "inputs", "x", "input_ids", "idx"):
            if key in batch:
                return batch[key]
    return batch


def forward_flops(module: torch.nn.Module, example: torch.Tensor) -> int:
    """Forward FLOPs of ``module`` on ONE sample (``example[:1]``), counted by FlopCounterMode.

    Runs in eval mode under ``no_grad`` (BatchNorm running statistics are not touched) and
    restores the module's mode.
    """
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            module(example[:1])
    finally:
        module.train(was_training)
    return int(counter.get_total_flops())


class ComputeMeter(Callback):
    """Counts optimizer-side training work: batches, samples and estimated FLOPs.

    ``flops += 3 × forward_flops(one sample) × batch size`` for every training batch; the
    per-sample forward count is cached per architecture (number of parameters and input
    shape), so growth mid-fit is counted at the new size from the next batch on.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.samples = 0
        self.flops = 0.0
        self._per_sample: dict[tuple, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        x = _inputs(batch)
        if not isinstance(x, torch.Tensor):
            return
        key = (sum(p.numel() for p in pl_module.parameters()), tuple(x.shape[1:]), x.dtype)
        if key not in self._per_sample:
            self._per_sample[key] = forward_flops(pl_module, x)
        n = int(x.shape[0])
        self.steps += 1
        self.samples += n
        self.flops += 3.0 * self._per_sample[key] * n

    def state_dict(self) -> dict:
        return {"steps": self.steps, "samples": self.samples, "flops": self.flops}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = int(state_dict.get("steps", 0))
        self.samples = int(state_dict.get("samples", 0))
        self.flops = float(state_dict.get("flops", 0.0))


# -- sibling trainers --------------------------------------------------------------------------
def sibling_trainer(
    trainer_kwargs: dict | None,
    root: str | Path,
    *,
    keep: Callable[[Callback], bool] = lambda cb: True,
    extra_callbacks: Sequence[Callback] = (),
    **overrides: Any,
) -> "GrowTrainer":
    """A trainer with the settings ``trainer_kwargs`` but its own directory and callbacks.

    Callbacks are deep copies of the configured ones that ``keep`` accepts (the CLI's
    ``SaveConfigCallback`` is never copied: it refuses to overwrite a config file), plus
    ``extra_callbacks``. A configured logger becomes a ``CSVLogger`` writing into ``root``.
    ``overrides`` replace any setting (e.g. ``max_steps=…``).
    """
    kwargs = dict(trainer_kwargs or {})
    callbacks = [
        copy.deepcopy(cb)
        for cb in _as_list(kwargs.pop("callbacks", None))
        if not isinstance(cb, (SaveConfigCallback, GammaTracePlot)) and keep(cb)
    ]
    root = Path(root)
    kwargs["default_root_dir"] = str(root)
    kwargs["callbacks"] = callbacks + list(extra_callbacks)
    if kwargs.get("logger") is not False:  # None and True mean Lightning's default logger
        kwargs["logger"] = CSVLogger(str(root), name="", version="")
    kwargs.update(overrides)
    return GrowTrainer(**kwargs)


class _SplitAsTest(LightningDataModule):
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

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        return self.inner.transfer_batch_to_device(batch, device, dataloader_idx)

    def on_before_batch_transfer(self, batch, dataloader_idx):
        return self.inner.on_before_batch_transfer(batch, dataloader_idx)

    def on_after_batch_transfer(self, batch, dataloader_idx):
        return self.inner.on_after_batch_transfer(batch, dataloader_idx)


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


# -- the trainer ---------------------------------------------------------------------------------
class GrowTrainer(Trainer):
    """``lightning.Trainer`` + growtrain's experiment methods (the CLI's extra subcommands).

    Takes exactly ``lightning.Trainer``'s arguments and keeps them in ``init_kwargs`` so the
    experiments can build sibling trainers with the same settings. When a
    ``GrowUntilSaturated`` callback is configured, a :class:`growtrain.plots.GammaTracePlot`
    is added so ``fit`` also writes ``gamma_trace.png`` next to the logs.
    """

    def __init__(self, **kwargs: Any) -> None:
        self.init_kwargs: dict[str, Any] = dict(kwargs)
        callbacks = _as_list(kwargs.get("callbacks"))
        if growth_callbacks(callbacks) and not any(isinstance(cb, GammaTracePlot) for cb in callbacks):
            kwargs["callbacks"] = callbacks + [GammaTracePlot()]
        super().__init__(**kwargs)

    # -- helpers --------------------------------------------------------------------------
    def _experiment_dir(self, name: str, output_dir: str | None) -> Path:
        if self.world_size > 1:
            raise ValueError(
                f"{name}: runs its trainings one after another in this process; got world_size="
                f"{self.world_size}. Use devices=1 (and num_nodes=1) for experiment subcommands."
            )
        out = Path(output_dir) if output_dir is not None else Path(self.default_root_dir) / name
        out.mkdir(parents=True, exist_ok=True)
        for cb in self.callbacks:  # keep the CLI's config with the results it produced
            if isinstance(cb, SaveConfigCallback) and not (out / "config.yaml").exists():
                cb.parser.save(cb.config, out / "config.yaml", skip_none=False, overwrite=True, multifile=False)
        return out

    def _show(self, renderable) -> None:
        if self.is_global_zero:
            from rich.console import Console

            console = Console()
            if not console.is_terminal:  # a log file: no terminal width to wrap the wide tables to
                console = Console(width=200)
            console.print(renderable)

    # -- subcommands ----------------------------------------------------------------------
    def compare(
        self,
        model: LightningModule,
        datamodule: Optional[LightningDataModule] = None,
        *,
        seeds: Sequence[int] = (0, 1, 2),
        depths: Optional[list[int]] = None,
        depth_kwarg: Optional[str] = None,
        insert_at: Literal["best", "cyclic"] = "best",
        max_growths: Optional[int] = None,
        compute_matched: bool = True,
        labels: Optional[list[str]] = None,
        output_dir: Optional[str] = None,
        resume: bool = True,
    ):
        """Growth vs Scratch: grow, then train the same final architecture from random init.

        Args:
            seeds: one Growth, Scratch (and compute-matched) training per seed; tables show mean ± std.
            depths: Table mode (the paper's Table 1 protocol): final depths, as values of the
                model's depth hyper-parameter (``depth_kwarg``). Each is reached by training
                depth−1 to convergence and inserting one zero-output block. ``None``: grow with
                ``GrowUntilSaturated`` during one fit until saturated (or ``max_growths``).
            depth_kwarg: the model hyper-parameter that sets depth; ``None`` picks the first of
                ``added`` (cifar_resnet: blocks added cyclically to ResNet-8), ``n_layer`` (GPT).
            insert_at: Table mode: where the block goes: ``best`` (the probe's top site) or
                ``cyclic`` (the stage the cyclic depth rule would extend: the paper's architectures).
            max_growths: cap on growth events (continuous mode).
            compute_matched: also train Scratch with the Growth arm's total FLOPs budget.
            labels: row names for ``depths`` (e.g. ``ResNet-10``), same length.
            output_dir: results (runs.jsonl, compare.md/.csv/.json); default ``<default_root_dir>/compare``.
            resume: skip (depth, seed, arm) rows already in ``output_dir/runs.jsonl``.
        """
        from growtrain.experiments import run_compare

        out = self._experiment_dir("compare", output_dir)
        result = run_compare(
            model,
            datamodule,
            trainer_kwargs=self.init_kwargs,
            seeds=seeds,
            depths=depths,
            depth_kwarg=depth_kwarg,
            insert_at=insert_at,
            max_growths=max_growths,
            compute_matched=compute_matched,
            labels=labels,
            output_dir=out,
            resume=resume,
        )
        self._show(result.table())
        return result

    def measure(
        self,
        model: LightningModule,
        datamodule: Optional[LightningDataModule] = None,
        *,
        ckpt_path: Optional[str] = None,
        delta: float = 0.0,
        alpha: float = 0.05,
        t: Optional[float] = None,
        rule: Literal["paper", "crossfit"] = "paper",
        projected: bool = True,
        seed: int = 0,
        output_dir: Optional[str] = None,
    ):
        """Per-site saturation report of a trained model on its probe split.

        Args:
            ckpt_path: checkpoint to load (its growth is replayed first); ``None`` scores the model as built.
            delta: practical-saturation margin δ ≥ 0 (units of the loss gradient norm).
            alpha: target error probability; sets t = sqrt(Σσ̂²/(nα)) unless ``t`` is given.
            t: the separation t > 0 of the paper's Proposition 1 (overrides ``alpha``).
            rule: ``paper`` (Γ̂ ≤ δ+t) or ``crossfit`` (certified directional lower bound).
            projected: also compute V_S (Gram matrices) and the realisability ratio V_S/AG.
            seed: seed of the candidate blocks' feature weights.
            output_dir: where measure.json/.md go; default ``<default_root_dir>/measure``.
        """
        from growtrain.experiments import run_measure

        out = self._experiment_dir("measure", output_dir)
        model.to(self.strategy.root_device)
        result = run_measure(
            model, datamodule, ckpt_path=ckpt_path, delta=delta, alpha=alpha, t=t, rule=rule,
            projected=projected, seed=seed, output_dir=out,
        )  # fmt: skip
        self._show(result.table())
        return result

    def sweep(
        self,
        model: LightningModule,
        datamodule: Optional[LightningDataModule] = None,
        *,
        depths: Union[str, list[int]] = "0..6",
        depth_kwarg: Optional[str] = None,
        seed: int = 0,
        growth_history: Optional[str] = None,
        delta: float = 0.0,
        alpha: float = 0.05,
        rule: Literal["paper", "crossfit"] = "paper",
        projected: bool = False,
        output_dir: Optional[str] = None,
        resume: bool = True,
    ):
        """Figure 1: train each depth from scratch; loss, AG_max and Γ̂ against depth.

        Args:
            depths: values of ``depth_kwarg``: ``"a..b"`` (inclusive), ``"a..b..step"`` or a list.
            depth_kwarg: the model hyper-parameter that sets depth (default: ``added``, else ``n_layer``).
            seed: seed of every training (the paper uses one seed per depth).
            growth_history: a ``growth_history.json`` of a growth run: marks where growth stopped.
            delta, alpha, rule: the saturation test reported at each depth.
            projected: also compute V_S at each depth (slower).
            output_dir: sweep.json/.csv/.md and sweep.png; default ``<default_root_dir>/sweep``.
            resume: skip depths already in ``output_dir/runs.jsonl``.
        """
        from growtrain.experiments import run_sweep

        out = self._experiment_dir("sweep", output_dir)
        result = run_sweep(
            model, datamodule, trainer_kwargs=self.init_kwargs, depths=depths, depth_kwarg=depth_kwarg,
            seed=seed, growth_history=growth_history, delta=delta, alpha=alpha, rule=rule,
            projected=projected, output_dir=out, resume=resume,
        )  # fmt: skip
        self._show(result.table())
        return result

    def match(
        self,
        model: LightningModule,
        datamodule: Optional[LightningDataModule] = None,
        *,
        ckpt_path: Optional[str] = None,
        alpha: float = 1e-3,
        seeds: Sequence[int] = (0, 1, 2),
        steps: int = 200,
        lr: float = 1.0,
        samples: Optional[int] = 2048,
        batch_size: int = 256,
        output_dir: Optional[str] = None,
    ):
        """Appendix H: insert one activation-gradient-matched block, report the immediate loss change.

        Args:
            ckpt_path: the converged checkpoint (its growth is replayed first).
            alpha: matching scale: the block's output is fitted to −α·q (q: per-sample activation gradient).
            seeds: one fit per seed (candidate feature weights U differ); mean ± std.
            steps: gradient-descent steps on the matching objective.
            lr: step size in units of 1/L (L: the objective's curvature, estimated by power iteration).
            samples: training samples cached for the fit and the train-loss change (None: all).
            batch_size: chunk size when caching and fitting (memory only; the fit is full-batch).
            output_dir: match.json/.md; default ``<default_root_dir>/match``.
        """
        from growtrain.experiments import run_match

        out = self._experiment_dir("match", output_dir)
        model.to(self.strategy.root_device)
        result = run_match(
            model, datamodule, ckpt_path=ckpt_path, alpha=alpha, seeds=seeds, steps=steps, lr=lr,
            samples=samples, batch_size=batch_size, output_dir=out,
        )  # fmt: skip
        self._show(result.table())
        return result
