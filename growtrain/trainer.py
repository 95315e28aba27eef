"""``GrowTrainer``: a ``lightning.Trainer`` whose extra methods are growtrain's experiments.

LightningCLI builds one subcommand per trainer method named in ``subcommands()``, with the
method's signature as its arguments. So ``growtrain compare|measure|sweep|match|stopping`` are
``GrowTrainer.compare|measure|sweep|match|stopping``; each is a thin wrapper around a function in
``growtrain.experiments`` that needs no CLI (call it from Python or a notebook).

The experiments train many networks, one after another in this process. Each training gets a
*sibling* trainer: the same settings this trainer was built with (``init_kwargs``: max_epochs,
precision, callbacks, …) but its own ``default_root_dir``, a CSV logger in that directory,
fresh deep copies of the callbacks, and whatever the experiment overrides (e.g. ``max_steps``
for the compute-matched arm). Sibling trainings are single-process: ``devices > 1`` is
refused by the experiment methods. Sibling trainers and ``evaluate`` live in
``growtrain.experiments._training``; compute is counted by
:class:`growtrain.callbacks.ComputeMeter`.
"""

from __future__ import annotations

import functools
import inspect
import os
import warnings
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence, Union

from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import SaveConfigCallback

from growtrain.experiments import run_compare, run_match, run_measure, run_stopping, run_sweep
from growtrain.experiments._training import BaseGrowTrainer
from growtrain.experiments.measure import check_split
from growtrain.experiments.runs import prepare, read_checkpoint

__all__ = ["EXPERIMENTS", "GrowTrainer"]

# GrowTrainer methods that the CLI exposes as subcommands (``growtrain compare --config …``).
EXPERIMENTS = ("compare", "measure", "sweep", "match", "stopping")


# Files a failed run may have written before it did anything: the CLI's copy of its config and the
# logger's hyper-parameters. A folder holding only these (and no step trained) is a run that never ran.
SETUP_FILES = frozenset({"config.yaml", "hparams.yaml"})


def remove_unwritten_log_dirs(trainer: Any, setup_files: frozenset = SETUP_FILES) -> list[str]:
    """After a failed ``fit|validate|test|predict``: remove each logger's ``version_N/`` folder when
    the run wrote nothing there (at most ``setup_files``, before any training step), then the
    logger's own folder (``lightning_logs/``) when that is left empty. Returns the folders removed.
    ``os.rmdir`` removes only empty folders, so a folder another process has just written to stays
    (and an error here never hides the run's own)."""
    removed = []
    for logger in getattr(trainer, "loggers", []) or []:
        try:
            log_dir = logger.log_dir if getattr(logger, "_experiment", True) is not None else None
        except Exception:  # a logger that cannot say where it writes: nothing to tidy
            continue
        if not (isinstance(log_dir, str) and os.path.isdir(log_dir)):
            continue
        try:
            names = set(os.listdir(log_dir))
            if names and not (names <= setup_files and getattr(trainer, "global_step", 1) == 0):
                continue
            for name in names:
                os.remove(os.path.join(log_dir, name))
            os.rmdir(log_dir)
        except OSError:  # a file that is a folder, a permission: left as it is
            continue
        removed.append(log_dir)
        parent = os.path.dirname(log_dir)
        if os.path.basename(parent) == getattr(logger, "name", None):  # lightning_logs/, if now empty
            try:
                os.rmdir(parent)
                removed.append(parent)
            except OSError:
                pass
    return removed


def _tidy_on_failure(method: Callable) -> Callable:
    """``method`` (a Trainer entry point) with :func:`remove_unwritten_log_dirs` on failure; its
    signature and docstring kept (``functools.wraps``) for LightningCLI and ``help()``. A run
    given a ``ckpt_path`` may write on into an earlier run's folder (``growtrain.resume``): there
    only an empty folder goes, never an earlier run's config.yaml or hparams.yaml."""
    signature = inspect.signature(method)

    @functools.wraps(method)
    def run(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except BaseException:
            try:
                resumed = signature.bind(self, *args, **kwargs).arguments.get("ckpt_path") is not None
            except TypeError:  # the call itself was wrong: Lightning's error says so, nothing was written
                resumed = False
            remove_unwritten_log_dirs(self, frozenset() if resumed else SETUP_FILES)
            raise

    return run


# -- the trainer ---------------------------------------------------------------------------------
class GrowTrainer(BaseGrowTrainer):
    """``lightning.Trainer`` + growtrain's experiment methods (the CLI's extra subcommands).

    Takes exactly ``lightning.Trainer``'s arguments and keeps them in ``init_kwargs`` so the
    experiments can build sibling trainers with the same settings. When a
    ``GrowUntilSaturated`` callback is configured, a :class:`growtrain.callbacks.GammaTracePlot`
    is added so ``fit`` also writes ``gamma_trace.png`` next to the logs.
    """

    # -- Lightning's entry points: a run that fails before writing anything leaves no folder ------
    # The loggers create their version_N/ folder in the setup hook, before the datamodule loads its
    # files: a missing data root would otherwise leave an empty version_N/ behind, which looks like
    # a run. Only a folder holding nothing (or only the config the CLI saved and the
    # hyper-parameters, with no step trained) is removed; a run that wrote anything else keeps it.
    # (wrapped, not overridden: LightningCLI reads each subcommand's arguments from the signature)
    fit = _tidy_on_failure(BaseGrowTrainer.fit)
    validate = _tidy_on_failure(BaseGrowTrainer.validate)
    test = _tidy_on_failure(BaseGrowTrainer.test)
    predict = _tidy_on_failure(BaseGrowTrainer.predict)

    # -- helpers --------------------------------------------------------------------------
    def _experiment_dir(self, name: str, output_dir: str | None, result: str | None = None) -> Path:
        """The folder an experiment writes to. ``result``: the file of a one-shot experiment
        (``measure.json``): an earlier result is never overwritten — the default folder becomes
        ``<name>_1``, ``<name>_2``, ...; an ``output_dir`` that holds one is refused. (The other
        experiments resume from their ``runs.jsonl`` in the same folder.)"""
        if self.world_size > 1:
            raise ValueError(
                f"{name}: runs its trainings one after another in this process; got world_size="
                f"{self.world_size}. Use devices=1 (and num_nodes=1) for experiment subcommands."
            )
        out = Path(output_dir) if output_dir is not None else Path(self.default_root_dir) / name
        if result is not None and (out / result).exists():
            if output_dir is not None:
                raise FileExistsError(
                    f"output_dir: {str(out)!r} already holds {result} from an earlier {name}, and growtrain never "
                    f"overwrites a result. Fix: pass another --output_dir, or move {str(out / result)!r} away."
                )
            base, k = out, 1
            while (out := base.with_name(f"{base.name}_{k}")).exists() and (out / result).exists():
                k += 1
        out.mkdir(parents=True, exist_ok=True)
        for cb in self.callbacks:  # keep the CLI's config with the results it produced
            if isinstance(cb, SaveConfigCallback) and not (out / "config.yaml").exists():
                cb.parser.save(cb.config, out / "config.yaml", skip_unset=False, overwrite=True, multifile=False)
        return out

    def _wrote(self, name: str, out: Path) -> None:
        """Say where an experiment's results are: its folder, the files in it and, where its
        trainings keep one, each training's own folder (its checkpoints/ and metrics.csv)."""
        if self.is_global_zero:
            files = ", ".join(sorted(p.name for p in out.iterdir() if p.is_file()))
            print(f"{name}: results in {out}{os.sep} ({files})", flush=True)
            runs = sorted(p.name for p in out.iterdir() if p.is_dir() and (p / "checkpoints").is_dir())
            if runs:
                shown = ", ".join(runs[:12]) + (f", … ({len(runs)} in all)" if len(runs) > 12 else "")
                print(f"{name}: each training's checkpoints/ and metrics.csv in its folder under {out}{os.sep}: "
                      f"{shown}", flush=True)

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
        keep_epoch_weights: bool = False,
    ):
        """Growth vs Scratch at convergence: grow, then train the same final architecture from random init.

        Every arm trains to the configured ``TrainLossEarlyStopping`` or the ``max_epochs`` cap
        (reported per arm when it binds); see ``growtrain.experiments.compare`` for the protocol.

        Args:
            seeds: paired replicates: both arms of a seed see the same split and data order; tables
                show mean ± sd and the mean paired difference with a 95 % t-interval.
            depths: Table mode (the paper's Table 1 protocol): final depths, as values of the
                model's depth hyper-parameter (``depth_kwarg``). Each is reached by training
                depth−1 to convergence and inserting one zero-output block. ``None``: grow with
                ``GrowUntilSaturated`` during one fit until saturated (or ``max_growths``).
            depth_kwarg: the model hyper-parameter that sets depth; ``None`` picks the first of
                ``added`` (cifar_resnet: blocks added cyclically to ResNet-8), ``n_layer`` (GPT).
            insert_at: Table mode: where the block goes: ``best`` (the probe's top site) or
                ``cyclic`` (the stage the cyclic depth rule would extend: the paper's architectures).
            max_growths: cap on growth events (continuous mode).
            compute_matched: also train Scratch with the Growth arm's total FLOPs budget, its
                schedule stretched onto that budget (unsupported schedulers are refused up front).
            labels: row names for ``depths`` (e.g. ``ResNet-10``), same length.
            output_dir: results (runs.jsonl, compare.md/.csv/.json); default ``<default_root_dir>/compare``.
            resume: skip (depth, seed, arm) rows already in ``output_dir/runs.jsonl``.
            keep_epoch_weights: keep the per-epoch weights (``output_dir/epochs``) after the
                equal-train-loss lookup has used them.
        """
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
            keep_epoch_weights=keep_epoch_weights,
        )
        self._show(result.table())
        self._wrote("compare", out)
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
        rule: Optional[Literal["paper", "crossfit"]] = None,
        projected: bool = True,
        seed: int = 0,
        output_dir: Optional[str] = None,
        allow_other_split: bool = False,
    ):
        """Per-site saturation report of a trained model on its probe split.

        Args:
            ckpt_path: checkpoint to load (its growth is replayed first); ``None`` scores the model as built.
            delta: practical-saturation margin δ ≥ 0 (units of the loss gradient norm).
            alpha: target error probability; sets t = sqrt(Σσ̂²/(nα)) unless ``t`` is given.
            t: the separation t > 0 of the paper's Proposition 1 (overrides ``alpha``).
            rule: ``paper`` (Γ̂ ≤ δ+t) or ``crossfit`` (certified directional lower bound > δ).
                ``None``: the decision entry points' default, as in ``GrowUntilSaturated``:
                ``crossfit``, or ``paper`` when ``t`` is given (``t`` is that rule's threshold).
                Every rule the pass can compute is in the report.
            projected: also compute V_S (Gram matrices) and the realisability ratio V_S/AG. On
                by default here, unlike the decision paths (the callback, ``sweep``): a report of
                V_S is what ``measure`` is for.
            seed: seed of the candidate blocks' feature weights. The fit's check ``k`` drew its
                candidates with ``GrowUntilSaturated``'s ``seed·1000 + k``; the report says which
                seed reproduces its last check, and every other reason its figures can differ.
            output_dir: where measure.json/.md go; default ``<default_root_dir>/measure``.
            allow_other_split: measure on the config's data split even where it differs from the
                one the checkpoint was trained with (seed, probe_size, val_size, train_subset,
                dataset). Off: that is an error, since the probe of another split can hold images
                the network trained on; on: a warning, and the report says its figures are not held-out.
        """
        if ckpt_path is not None:  # refused before the output folder is made: a failed measure leaves none
            try:
                check_split(datamodule, read_checkpoint(ckpt_path, mmap=True), ckpt_path, allow_other_split)
            except ValueError as error:  # the config's values: one `error:` line from growtrain.cli.main
                error._growtrain_config_error = True  # type: ignore[attr-defined]
                raise
        prepare(datamodule, "measure")  # a data error, too, comes before the folder (run_measure reuses the load)
        out = self._experiment_dir("measure", output_dir, result="measure.json")
        model.to(self.strategy.root_device)
        from growtrain.callbacks import growth_callbacks  # here, so growtrain.trainer does not re-export it

        growers = growth_callbacks(self.callbacks)  # the configured callback drew the fit's candidates
        fit_growth = {"seed": getattr(growers[0], "seed", None),
                      "precision": str(self.precision)} if growers else None  # fmt: skip
        with warnings.catch_warnings():  # the split warning was given above, once
            warnings.filterwarnings("ignore", message="allow_other_split: ", category=UserWarning)
            result = run_measure(
                model, datamodule, ckpt_path=ckpt_path, delta=delta, alpha=alpha, t=t, rule=rule,
                projected=projected, seed=seed, output_dir=out, allow_other_split=allow_other_split,
                fit_growth=fit_growth,
            )  # fmt: skip
        self._show(result.table())
        self._wrote("measure", out)
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
            delta, alpha, rule: the saturation test reported at each depth. ``rule`` defaults to
                ``paper``, unlike the decision entry points (``crossfit``): the sweep reproduces the
                paper's Figure 1, whose verdict is Proposition 1's Γ̂ ≤ δ+t.
            projected: also compute V_S at each depth (slower; off, as on every decision path).
            output_dir: sweep.json/.csv/.md and sweep.png; default ``<default_root_dir>/sweep``.
            resume: skip depths already in ``output_dir/runs.jsonl``.
        """
        out = self._experiment_dir("sweep", output_dir)
        result = run_sweep(
            model, datamodule, trainer_kwargs=self.init_kwargs, depths=depths, depth_kwarg=depth_kwarg,
            seed=seed, growth_history=growth_history, delta=delta, alpha=alpha, rule=rule,
            projected=projected, output_dir=out, resume=resume,
        )  # fmt: skip
        self._show(result.table())
        self._wrote("sweep", out)
        return result

    def stopping(
        self,
        model: LightningModule,
        datamodule: Optional[LightningDataModule] = None,
        *,
        depths: Union[str, list[int]] = "0..7",
        seeds: list[int] = [0, 1, 2],  # noqa: B006 (LightningCLI reads the default from the signature)
        depth_kwarg: Optional[str] = None,
        output_dir: Optional[str] = None,
        resume: bool = True,
        skip_scratch: bool = False,
        skip_growth: bool = False,
        train: bool = True,
        table: Optional[Union[str, list[int]]] = None,
        compute_matched: bool = True,
        table_controls: bool = False,
    ):
        """Growth until saturated beside a from-scratch depth sweep under one stopping rule.

        The configured ``GrowUntilSaturated`` grows the model from its start depth (one run per
        seed); every depth of ``depths`` is trained from scratch with the same callback at
        ``max_growths=0`` (same plateau trigger, same final anneal). Reports d*, the found depths,
        test losses and compute (``growtrain.experiments.stopping``).

        Args:
            depths: values of ``depth_kwarg`` for the scratch sweep (``"a..b"`` inclusive, or a list).
            seeds: one growth run and one sweep per seed.
            depth_kwarg: the model hyper-parameter that sets depth (default: ``added``, else ``n_layer``).
            output_dir: stopping.json/.md/.png and runs.jsonl; default ``<default_root_dir>/stopping``.
            resume: skip rows already in ``output_dir/runs.jsonl``.
            skip_scratch: only the growth runs (e.g. a control that changes the data or τ).
            skip_growth: only the scratch sweep (e.g. in a second process beside the growth runs).
            train: ``false`` summarises the rows already in ``runs.jsonl`` without training.
            table: rows ``N`` of the paper's Table 1 built on the sweep's own networks (base = the
                sweep's ``N−1`` network, scratch = its ``N`` network; ``growtrain.experiments.sweep_table``).
            compute_matched: with ``table``, also the compute-matched Scratch arm.
            table_controls: with ``table``, also the base retrained under the same rule without a
                block (so growth − control is the block's own value, apart from the extra training).
        """
        out = self._experiment_dir("stopping", output_dir)
        result = run_stopping(
            model, datamodule, trainer_kwargs=self.init_kwargs, depths=depths, seeds=seeds, depth_kwarg=depth_kwarg,
            output_dir=out, resume=resume, skip_scratch=skip_scratch, skip_growth=skip_growth,
            train=train, table=table, compute_matched=compute_matched, table_controls=table_controls,
        )  # fmt: skip
        self._show(result.table())
        if result.table1 is not None and result.table1.summary:
            self._show(result.table1.table())
        self._wrote("stopping", out)
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
        out = self._experiment_dir("match", output_dir, result="match.json")
        model.to(self.strategy.root_device)
        result = run_match(
            model, datamodule, ckpt_path=ckpt_path, alpha=alpha, seeds=seeds, steps=steps, lr=lr,
            samples=samples, batch_size=batch_size, output_dir=out,
        )  # fmt: skip
        self._show(result.table())
        self._wrote("match", out)
        return result
