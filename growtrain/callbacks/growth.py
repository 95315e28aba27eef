"""``GrowUntilSaturated``: grow the network mid-fit while the certified test says depth pays.

Data flow at each check (docs/design.md, "Growth step")::

    schedule (a plateau, or every K epochs) → measure_saturation (all sites, one pass) → verdict
    (trial / window / rule)
    → network.grow (function-preserving, verified, rolled back on failure) → zero-state optimizer
    → DDP re-wrap → history / loggers / table / growth_history.json

The hooks only gather inputs; ``growtrain.decision`` decides (``should_check``,
``decide_growth``: the ``EarlyStopping`` pattern), so every rank that sees the same all-reduced
probe sums takes the same action. Options are validated once, in ``GrowthConfig``.

What a checkpoint holds: the module's ``GrowableModuleMixin`` stores the growth record and
replays it before the weights load; this callback's ``state_dict`` keeps its history and
counters. Candidate blocks are seeded by check index (``seed·1000 + check``), so a resumed run
inserts exactly the blocks an uninterrupted run would.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from growtrain import decision as dec
from growtrain.callbacks import editor, schedule, sharded, telemetry
from growtrain.callbacks.editor import FunctionChangedError
from growtrain.callbacks.growth_config import GrowthConfig
from growtrain.callbacks.anneal import StageAnnealMixin
from growtrain.callbacks.gain_check import RealizedGainMixin
from growtrain.callbacks.growth_state import GrowthStateMixin
from growtrain.callbacks.monitor import StageMonitorMixin
from growtrain.callbacks.remeasure import save_rewound, saved_checkpoints
from growtrain.callbacks.restore import take_snapshot
from growtrain.callbacks.progress import counted, progress_for
from growtrain.plots import outcome
from growtrain.callbacks.rng_state import loader_generators
from growtrain.callbacks.trial_check import BlockTrials
from growtrain.callbacks.window_check import WindowRule
from growtrain.trial import DEFAULT_TRIAL_EPOCHS, DEFAULT_TRIAL_HOLDOUT, DEFAULT_TRIAL_LR
from growtrain.callbacks.probe_data import (
    Converted as _Converted, Fingerprinted, ProbeView, check_probe_setup, check_split_indices, datasets_of,
    first_input, probe_overlap,
)  # fmt: skip
from growtrain.crossfit import probe_size
from growtrain.callbacks import guidance  # what a user would otherwise wonder about
from growtrain.growable import probe_loss_for, resolve_network
from growtrain.reconfigure import restart_schedulers
from growtrain.saturation import SaturationReport, measure_saturation
from growtrain.saturation_report import best_scored_site, rank_sites

__all__ = ["GrowUntilSaturated", "FunctionChangedError"]


class GrowUntilSaturated(GrowthStateMixin, StageAnnealMixin, RealizedGainMixin, StageMonitorMixin, Callback):
    """Insert function-preserving blocks while the certified test says depth still pays.

    Quick start (growtrain's module and datamodule need no arguments)::

        trainer = lightning.Trainer(callbacks=[GrowUntilSaturated(on_saturated="anneal")])
        trainer.fit(ImageClassifier(in_channels=1), ImageDataModule())

    Two schedules say when a check comes. ``schedule="converged"`` (the default, the paper's
    protocol): when the monitored loss has plateaued (the stage has converged; with
    ``lr_schedule="anneal"`` after a cosine anneal of the stage), and every check trains a fresh
    block alone at the best first-order site of each stage and grows where one lowers the
    held-out loss by a certified more than ``min_gain`` (1 %) of it (``decision="trial"``).
    ``schedule="periodic"``: a check every ``every_n_epochs`` at the constant rate, growing at the
    best first-order site until the run's own probe loss has not fallen by a certified
    ``min_gain`` over the last ``window`` epochs (``decision="window"``), then one final anneal
    (docs/decision.md). Your own LightningModule: keep the growable network as a submodule
    (``cifar_resnet``, ``GrowableStack``), add ``GrowableModuleMixin`` for checkpoints, build
    the optimizer from ``growtrain.optim.param_groups(network)`` so resumed runs line up, log
    ``train_loss`` per epoch, and give the callback a probe (``probe=`` or
    ``datamodule.probe_dataloader()``) that never feeds training.

    Args:
        probe: a DataLoader of ``(input, target)`` held out from training, or a callable
            returning one; ``None`` uses ``trainer.datamodule.probe_dataloader()``.
        network: the growable network: ``None`` finds the first submodule with ``sites()`` and
            ``grow()``; a dotted attribute path (``"network"``, ``"model.backbone"``); or the
            module itself (it must be part of the LightningModule).
        loss_fn: ``loss_fn(output, target)`` → mean batch loss for the probe; ``None`` uses
            ``pl_module.probe_loss`` if defined, else cross-entropy.
        every_n_epochs: with ``monitor=None``, check at the end of every n-th training epoch
            (counted from the last check); ``None`` means 1. Given together with a monitor it
            has no effect and is warned about.
        schedule: when a check comes. ``"converged"`` (the paper's protocol): when ``monitor``
            has plateaued (with ``lr_schedule="anneal"``: after the stage is annealed).
            ``"periodic"``: every ``every_n_epochs`` at the module's constant rate, before the
            network has converged, no anneal before a check (AutoGrow's protocol); growth ends by
            ``decision`` (default ``"window"``), then ``on_saturated="anneal"`` runs the one final
            anneal (``anneal_epochs``). ``monitor`` is not used by it.
        window: ``decision="window"``: growth goes on while the probe loss fell over the last
            ``window`` epochs (compared with the latest check at least that far back, per sample)
            by a certified more than ``min_gain`` of it; until the window is full every check
            grows at the best first-order site (growtrain/window.py).
        monitor: a metric logged per epoch (default ``"train_loss"``): check only when it has
            plateaued, i.e. the current stage has converged (the paper grows a converged
            network). ``None`` checks every ``every_n_epochs``. A module that logs no
            ``train_loss`` is monitored through the epoch mean of the loss ``training_step``
            returns; any other metric that is never logged is an error naming it. A fit that
            ends with no check says so (warning and summary) with the reason.
        mode: ``"min"`` or ``"max"``: the direction in which ``monitor`` improves.
        patience: epochs without an improvement that make a plateau.
        min_delta: smallest absolute change of ``monitor`` that counts as an improvement.
        min_rel_delta: smallest change relative to the best value (0.01 = 1 %) that counts as an
            improvement; the larger of the two applies. Relative, so a loss scaled by 10 makes
            the same plateaus (and, with a scale-free decision, the same decisions).
        min_stage_epochs: a stage (epochs since the start or the last growth) must be at least
            this long before a plateau check.
        cooldown: training epochs after each growth during which no check runs.
        probe_budget: ``None`` or a fraction, e.g. ``0.05``: a due check is postponed until the
            samples trained since the last check cover it (``PROBE_COST · probe size ≤
            probe_budget · trained samples``, ``growtrain.decision.PROBE_COST`` = 3).
        delta: an absolute practical-saturation margin δ ≥ 0 (gradient-norm units): the
            cross-fit rule's margin; a floor under the relative rule's ``τ·R``.
        alpha: target error probability in (0, 1) for each decision (or the run's total with
            ``alpha_spending``).
        t: the separation of Proposition 1; giving it selects the paper's rule.
        rule: ``"crossfit"`` (default: lower bound > δ), ``"relative"`` (lower bound
            > max(δ, τ·R)) or ``"paper"`` (Γ̂ > δ + t); with ``min_gain`` it decides the first
            check and picks the site. All verdicts the pass can compute are reported at
            every check (``history[i]["verdicts"]``).
        tau: the relative rule's threshold τ > 0: the fraction of an average existing block's
            gradient norm ``R`` that a new block must certify.
        min_gain: a fraction ≥ 0 (default 0.01) or ``None`` (off): judge growth by what it
            realized. The first check decides by ``rule``; every check after a growth grows again
            (at the site with the rule's best score) iff the last growth *paid*: the probe loss
            fell from the check that grew to this one by a certified (one-sided bootstrap-t
            lower bound at level α, paired over the probe samples, which must be the same
            samples in the same order: their fingerprints are checked) amount of more than
            ``min_gain`` × the probe loss at that growth; otherwise growth ends ("no certified gain: depth stopped paying"). The per-sample
            losses come from the probe pass itself (under DDP: one extra forward pass). Scale-free
            (both sides scale with the loss). Why: on an annealed network the first-order
            statistics sit at their noise floor at every depth (docs/decision.md).
        alpha_spending: ``"constant"`` (every check at level α; with stop-at-first-saturated the
            checks are a fixed-sequence procedure), ``"geometric"`` or ``"inverse_square"``
            (all checks together err with probability ≤ α; ``growtrain.crossfit.alpha_schedule``).
            The gain's level follows ``alpha_spending`` like every other test.
        restore_best: when growth ends because the last growth did not pay (not when a budget
            ends it: that growth is not judged), hand over the network of the check before it:
            weights, BatchNorm statistics, optimizer state and architecture restored from a
            host-memory snapshot taken at that growth (the summary and the history's
            ``restored`` say what was undone). ``False`` keeps the last network as it is.
        trial_growth: with ``min_gain``, a check with no growth to judge grows at the best-scored
            site even when the first-order test does not certify a gain; that block's realized
            gain then decides (and ``restore_best`` undoes it if it did not pay). The first-order
            scores then only choose the site. Costs one more stage where depth stops paying.
        decision: ``"trial"`` (``None`` with ``min_gain`` set): every check trains a fresh block
            alone at the best first-order site of each stage (``trial_sites``) for
            ``trial_epochs`` (Adam, ``trial_lr``) and grows where the held-out loss (probe plus
            ``trial_holdout`` training samples) fell by a certified > ``min_gain``
            (growtrain/callbacks/trial_check.py). ``"gain"``: a stage's realized gain decides
            after a growth. ``"rule"`` (``min_gain=None``): the first-order rule alone.
        top_k: grow at up to this many distinct certified sites per check.
        max_growths, max_blocks, max_params: budgets; reaching one ends growth (reason "budget").
        on_saturated: when growth ends, ``"stop"`` ends ``fit``; ``"continue"`` keeps
            training at that depth with no further checks; ``"anneal"`` trains the final network
            for ``anneal_epochs`` more epochs with the learning rate annealed by a cosine from its
            current value to 0, then stops (also after a budget), so one fit yields a finished model.
            Its ``anneal_epochs`` are reserved inside ``max_epochs``: once no more are left, growth
            ends (a budget) so that the network handed over is annealed, never cut mid-stage.
        anneal_epochs: the length of that final anneal (and of a converged stage's anneal).
        lr_schedule: after growth, new groups ``"continue"`` on the current schedule, or every
            scheduler ``"restart"`` s from step 0 for the new stage; or ``"anneal"``: the callback
            drives the learning rate (no scheduler allowed): each stage trains at the optimizer's
            constant rate until it has converged, the rate is then cosine-annealed towards 0 over
            ``anneal_epochs``, the *annealed* network is checked, and after a growth the new stage
            starts at the constant rate again (warm restarts). The network growth ends on is then
            already annealed, so ``on_saturated="anneal"`` stops at once. Why: at a constant rate
            the stage sits on SGD's noise floor and the probe gradients of old and new terminal
            maps are of one size, whatever the depth (docs/decision.md).
        projected: also compute ``V_S`` (Gram matrices; logged, not needed by the decision).
        calibrate: set candidate blocks' BatchNorm statistics on the probe inputs first.
        seed: candidate blocks for check ``k`` come from ``seed·1000 + k``.
        log_sites: log and keep per-site figures (``growth/<site>/grad_norm|projected|ag``).
        verbose: print one table per check and a summary at the end of the fit (rank 0).

    Attributes:
        history: one plain dict per check (``epoch``, ``step``, ``site``, ``gamma``,
            ``threshold``, ``saturated`` (true only where ``certified``), ``certified``, ``params``,
            ``depth``, ``reason``, ``rule``, ``margin``,
            ``lower``, ``reference``, ``ratio``, ``verdicts``, ``level``, ``action``, ...).
    """

    def __init__(
        self,
        probe: DataLoader | Callable[[], Iterable] | None = None,
        network: str | nn.Module | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        every_n_epochs: int | None = None,
        schedule: Literal["converged", "periodic"] = "converged",
        window: int = 10,
        monitor: str | None = "train_loss",
        mode: Literal["min", "max"] = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        min_rel_delta: float = 0.01,
        min_stage_epochs: int = 2,
        cooldown: int = 0,
        probe_budget: float | None = None,
        delta: float = 0.0,
        alpha: float = 0.05,
        t: float | None = None,
        rule: Literal["paper", "crossfit", "relative"] | None = None,
        tau: float = dec.DEFAULT_TAU,
        min_gain: float | None = dec.DEFAULT_MIN_GAIN,
        alpha_spending: Literal["constant", "geometric", "inverse_square"] = "constant",
        restore_best: bool = True,
        trial_growth: bool = False,
        decision: Literal["trial", "gain", "rule", "window"] | None = None,
        trial_epochs: float = DEFAULT_TRIAL_EPOCHS,
        trial_lr: float = DEFAULT_TRIAL_LR,
        trial_holdout: int = DEFAULT_TRIAL_HOLDOUT,
        trial_sites: int = 3,
        top_k: int = 1,
        max_growths: int | None = None,
        max_blocks: int | None = None,
        max_params: int | None = None,
        on_saturated: Literal["stop", "continue", "anneal"] = "stop",
        anneal_epochs: int = 10,
        lr_schedule: Literal["continue", "restart", "anneal"] = "continue",
        projected: bool = False,
        calibrate: bool = True,
        seed: int = 0,
        log_sites: bool = True,
        verbose: bool = True,
    ):
        super().__init__()
        options = dict(locals())
        options.pop("self"), options.pop("__class__", None)
        self.config = GrowthConfig(**options)
        for name in GrowthConfig.names():  # the validated options as attributes (callback.rule, ...)
            setattr(self, "network_spec" if name == "network" else name, getattr(self.config, name))
        self._network: nn.Module | None = None
        self._loss: Callable | None = None
        self._decision_given = decision is not None
        self._trials = BlockTrials(epochs=self.trial_epochs, lr=self.trial_lr, holdout=self.trial_holdout,
                                   sites=self.trial_sites, min_gain=self.min_gain or 0.0,
                                   seed=self.seed) if self.decision == "trial" else None  # fmt: skip
        self._window = WindowRule(window=self.window, min_gain=self.min_gain or 0.0,
                                  seed=self.seed) if self.decision == "window" else None  # fmt: skip
        self._reset_state()
        self.probe_seconds = 0.0  # wall time inside measure_saturation, this process (not saved)
        self._pass_losses: list | None = None  # per-sample probe losses from the last pass (min_gain)
        self._pass_probe: Fingerprinted | None = None  # the last pass's probe, with its sample fingerprints
        self._can_restore = True  # restore_best under this strategy (not FSDP2 yet)
        self._fit_start = 0.0
        self._returned: torch.Tensor | None = None  # sum of this epoch's losses returned by training_step
        self._returned_batches = 0
        self._told_returned = False
        self._waiting: str | None = None  # why the last epoch end ran no check (should_check's reason)

    # -- setup: refuse early ------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        sharded.check_strategy(trainer, self.rule)
        self._network = self._resolve_network(pl_module, required=not self._builds_late(pl_module))
        if sharded.is_model_parallel(trainer.strategy) and self.decision == "trial":
            why = ("decision: 'trial' (block-only trials) is not supported under FSDP2 (ModelParallelStrategy) yet: "
                   "a trial block would need its own sharding inside a frozen sharded network")  # fmt: skip
            if self._decision_given:
                raise ValueError(f"{why}. Fix: pass decision='gain' (the stage's realized gain) under FSDP2.")
            rank_zero_warn(f"GrowUntilSaturated: {why}; this fit decides by decision='gain' instead. Pass "
                           "decision='gain' to acknowledge this.")  # fmt: skip
            self.decision, self._trials = "gain", None
        if sharded.is_model_parallel(trainer.strategy):  # resume: grow to the checkpoint's depth before shards load
            sharded.install_resume(trainer, lambda: self._network or self._resolve_network(pl_module, required=True))
            if self.restore_best and self.decision == "gain":  # undoing a sharded growth is not built yet
                self._can_restore = False
                rank_zero_warn("GrowUntilSaturated: restore_best is not supported under FSDP2 (ModelParallelStrategy) "
                               "yet: an unpaid last block will be kept, not undone. Pass restore_best=False to "
                               "acknowledge this.")  # fmt: skip
        self._loss = self._resolve_loss(pl_module)
        if self.probe is None:
            dm = trainer.datamodule
            if dm is None or not callable(getattr(dm, "probe_dataloader", None)):
                raise ValueError(
                    "probe: no probe data. GrowUntilSaturated needs a held-out probe sample: pass "
                    "GrowUntilSaturated(probe=<DataLoader or callable>) or use a datamodule with a "
                    "probe_dataloader() method (growtrain.data.ImageDataModule has one). The probe must never "
                    "be trained on."
                )
            check_split_indices(dm)
            # an empty probe (probe_size=0) is refused here, at setup, not at a check
            self._refuse_random_probe(dm.probe_dataloader(), "datamodule.probe_dataloader()")
        elif isinstance(self.probe, DataLoader):
            self._refuse_random_probe(self.probe, "probe")

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self._warn_small_probe(trainer)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._network is None:
            self._network = self._resolve_network(pl_module, required=True)
        if self.start_depth is None:
            self.start_depth = self._depth(self._network)
        self._check_lr_schedule(trainer)
        self._warn_no_room(trainer)
        check_probe_setup(trainer, pl_module, self._network, self._probe_loader(trainer, shard=False), self._loss)
        probe = self._probe_loader(trainer)
        probe_ds = getattr(probe, "dataset", None)
        for ds in datasets_of(trainer.train_dataloader):
            overlap = probe_overlap(probe_ds, ds)
            if overlap is not None:
                raise ValueError(
                    f"probe: the probe sample overlaps the training data ({overlap}). The certificate needs a "
                    "probe independent of training. Fix: carve the probe out of the training split (e.g. "
                    "ImageDataModule's probe_size) and never train on it."
                )

    def _check_lr_schedule(self, trainer: Trainer) -> None:
        if self.lr_schedule != "anneal" or (self.finished is not None and self.anneal_done is None):
            return
        optimizer = self._optimizer_for(trainer, self._network)
        schedulers = [type(c.scheduler).__name__ for c in trainer.strategy.lr_scheduler_configs
                      if optimizer is not None and c.scheduler.optimizer is optimizer]  # fmt: skip
        if schedulers:
            raise ValueError(
                f"lr_schedule: 'anneal' drives the learning rate itself (constant per stage, an anneal before each "
                f"check), but the network's optimizer has a scheduler ({', '.join(schedulers)}) that would fight it. "
                "Fix: return no lr_scheduler from configure_optimizers, or use lr_schedule='restart' to restart "
                "your schedule per stage."
            )

    @staticmethod
    def _builds_late(pl_module: LightningModule) -> bool:
        """Does the module build its layers in ``configure_model``/``setup`` (after callback setup)?"""
        cls = type(pl_module)
        return any(getattr(cls, hook) is not getattr(LightningModule, hook) for hook in ("configure_model", "setup"))

    def _resolve_network(self, pl_module: LightningModule, required: bool) -> nn.Module | None:
        return resolve_network(pl_module, self.network_spec, required=required)

    def _resolve_loss(self, pl_module: LightningModule) -> Callable:
        return probe_loss_for(pl_module, self.loss_fn)

    def _probe_loader(self, trainer: Trainer, shard: bool = True) -> Any:
        source = self.probe
        if source is None:
            loader = trainer.datamodule.probe_dataloader()
        elif isinstance(source, DataLoader) or not callable(source):
            loader = source
        else:
            loader = source()
        return sharded.shard_probe(loader, trainer) if shard else loader  # FSDP2: equal shards

    # -- hooks -----------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._returned, self._returned_batches = None, 0
        if self.restart_pending:
            self._restart_schedules(trainer, pl_module)
        if self.anneal_done is not None:
            self._set_anneal_lr(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.anneal_done is not None:
            self.anneal_done += 1
            if self.anneal_done < self.anneal_epochs:
                self._waiting = f"the {self.anneal_kind} anneal: {self.anneal_done} of {self.anneal_epochs} epoch(s) done"
                return
            if self.anneal_kind == "stage":  # the converged stage is annealed: check it now
                self._check_annealed(trainer, pl_module)
            else:
                trainer.should_stop = True
            return
        if self.finished is not None:
            return
        self.epochs_since_check += 1
        self.stage_epochs += 1
        self.trained_since_check += self._samples_per_epoch(trainer)
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            self._waiting = f"cooldown after growth: {self.cooldown_left + 1} epoch(s) left"
            return
        if self._final_reserved(trainer) is not None:  # no room for another stage: a budget check ends growth
            self._check(trainer, pl_module)
            return
        monitor = self.monitor if self.schedule == "converged" else None  # periodic: every every_n_epochs
        plateaued = self._track_monitor(trainer) if monitor is not None else False
        check, self._waiting = dec.should_check(
            finished=self.finished, cooldown_left=self.cooldown_left, epochs_since_check=self.epochs_since_check,
            every_n_epochs=self.every_n_epochs, monitor=monitor, plateaued=plateaued,
            min_stage_epochs=self.min_stage_epochs, stage_epochs=self.stage_epochs, probe_budget=self.probe_budget,
            trained_samples=self.trained_since_check,
            probe_samples=self._probe_samples(trainer) if self.probe_budget is not None else 0,
        )  # fmt: skip
        if trainer.world_size > 1:
            check = trainer.strategy.reduce_boolean_decision(check, all=False)
        if not check:
            return
        # lr_schedule="anneal": anneal the converged stage first (unless a budget already ends
        # growth: then the final anneal follows the check, the same single anneal)
        annealing = self.lr_schedule == "anneal" and self._budget_reason(trainer) is None
        if not (annealing and self._start_anneal(trainer, "stage")):
            self._check(trainer, pl_module)

    def _budget_reason(self, trainer: Trainer | None = None) -> str | None:
        network = self._network
        return dec.budget_reason(
            growths=self.growths, max_growths=self.max_growths, depth=self._depth(network), max_blocks=self.max_blocks,
            params=telemetry.count_params(network), max_params=self.max_params,
        ) or (self._final_reserved(trainer) if trainer is not None else None)  # fmt: skip

    def _warn_no_room(self, trainer: Trainer) -> None:
        """A fit whose ``max_epochs`` leaves no epoch outside the reserved final anneal cannot grow: say so."""
        why = schedule.no_room(trainer.max_epochs, trainer.current_epoch, self.anneal_epochs, self.on_saturated,
                               self.finished)  # fmt: skip
        if why is not None:
            rank_zero_warn(f"GrowUntilSaturated: {why}", category=UserWarning)

    def _final_reserved(self, trainer: Trainer) -> str | None:
        return schedule.final_reserved(trainer.max_epochs, trainer.current_epoch, self.anneal_epochs,
                                       self.on_saturated, self.finished)  # fmt: skip

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._network is None:
            return
        written = bool(self.history)
        path = telemetry.history_path(trainer)  # every rank: trainer.log_dir is a collective (broadcast)
        no_check = None
        if not self.history:  # the callback did nothing: say so, why, and what to change
            no_check = guidance.no_check_message(
                monitor=self.monitor, best=self.best, wait=self.wait, patience=self.patience, mode=self.mode,
                min_delta=self.min_delta, min_rel_delta=self.min_rel_delta, min_stage_epochs=self.min_stage_epochs,
                stage_epochs=self.stage_epochs, every_n_epochs=self.every_n_epochs, epochs=trainer.current_epoch,
                waiting=self._waiting,
            )  # fmt: skip
            rank_zero_warn(no_check, category=UserWarning)
        if not (self.verbose and trainer.is_global_zero):
            return
        metrics, measured_on = telemetry.final_metrics(self.history, trainer.callback_metrics, trainer.global_step)
        telemetry.print_renderable(trainer, telemetry.fit_summary(
            self.history, start_depth=self.start_depth, final_depth=self._depth(self._network), finished=self.finished,
            stop_reason=self.stop_reason, metrics=metrics,
            probe_seconds=self.probe_seconds + (self._trials.seconds if self._trials is not None else 0.0),
            fit_seconds=time.perf_counter() - self._fit_start, no_check=no_check, measured_on=measured_on,
            outputs=guidance.output_lines(trainer, history_path=path, history_written=written),
            phases=guidance.phase_line(growth_epochs=self.growth_epochs, final_epochs=self.final_epochs,
                                       anneal_epochs=self.anneal_epochs, on_saturated=self.on_saturated,
                                       epochs=trainer.current_epoch, schedule=self.schedule),
        ), soft_wrap=True)  # fmt: skip

    @property
    def growth_epochs(self) -> int | None:
        """Epochs trained when growth ended (``None`` while it goes on): the ending check's epoch + 1."""
        return self.history[-1]["epoch"] + 1 if self.finished is not None and self.history else None

    @property
    def final_epochs(self) -> int:
        """Epochs of the final anneal trained so far (its progress is callback state already)."""
        return self.anneal_done or 0 if self.anneal_kind == "final" else 0

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Ctrl-C: the summary of the fit so far; RandomStateCheckpoint then prints the command that
        resumes it, and Lightning exits 1. One process only: the summary finds its folder with a
        collective under DDP, which an interrupted rank may never join."""
        if isinstance(exception, KeyboardInterrupt) and trainer.world_size == 1:
            self.on_fit_end(trainer, pl_module)

    # -- one check -------------------------------------------------------------------------
    def _check(self, trainer: Trainer, pl_module: LightningModule, annealed: bool = False) -> str:
        """One check, on a fork of the random number generators: iterating the probe loader
        draws from torch's global generator (each DataLoader iterator takes a base seed), so
        without the fork a check would move the training data order and augmentation of the
        rest of the run — and two decision settings would train differently before they first
        decide differently. Candidate blocks have their own seed (``seed``)."""
        device = next(self._network.parameters()).device
        devices = []
        if device.type == "cuda":
            devices = [device.index if device.index is not None else torch.cuda.current_device()]
        # a generator the train loaders own (DataLoader(generator=g)) is not forked by fork_rng, and
        # the trials iterate the train loader: set it back after the check too
        owned = loader_generators(trainer)
        states = [g.get_state() for g in owned]
        try:
            with torch.random.fork_rng(devices=devices):
                return self._check_unforked(trainer, pl_module, annealed)
        finally:
            for g, state in zip(owned, states):
                g.set_state(state)

    def _check_unforked(self, trainer: Trainer, pl_module: LightningModule, annealed: bool = False) -> str:
        network = self._network
        assert network is not None
        self.epochs_since_check = 0
        self.trained_since_check = 0
        depth = self._depth(network)
        params = telemetry.count_params(network)
        record: dict[str, Any] = {
            "check": self.checks, "epoch": trainer.current_epoch, "step": trainer.global_step,
            "depth_before": depth, "params_before": params, "level": None,
        }  # fmt: skip
        if annealed:
            record["annealed"] = True
        blocked = self._budget_reason(trainer)
        report = None
        if blocked is not None:  # known before probing: save the probe
            action, reason, sites = "budget", blocked, []
        else:
            report, record["level"] = self._measure(trainer, pl_module, network)
            ranked = rank_sites(report, self.top_k)
            block_params = {name: telemetry.count_params(report.record(name).block) for name in ranked}
            action, reason, sites = dec.decide_growth(
                saturated=report.saturated, ranked=ranked, block_params=block_params, growths=self.growths,
                max_growths=self.max_growths, depth=depth, max_blocks=self.max_blocks, params=params,
                max_params=self.max_params, reason=report.reason,
            )  # fmt: skip
            if self.decision == "trial":
                action, reason, sites = self._trial_decision(trainer, pl_module, network, report, record, depth, params)
            elif self.decision == "window":
                action, reason, sites = self._window_decision(trainer, pl_module, network, report, record, depth, params)
            elif self.decision == "gain":
                losses, signatures, gain = self._last_growth_paid(trainer, pl_module, network, record["level"])
                trial = gain is None and self.trial_growth and action == "saturated"
                if gain is not None or trial:  # the realized gain decides (now or, for a trial, next check);
                    best = best_scored_site(report)  # the rule's best score only chooses the site
                    if gain is not None:
                        record["gain"] = gain
                        saturated, why = gain["saturated"], gain["reason"]
                    else:
                        saturated = best is None
                        why = reason if best is None else (
                            f"trial growth (trial_growth=True): {reason}; its realized gain decides at the next check")
                    action, reason, sites = dec.decide_growth(
                        saturated=saturated, ranked=[best] if best else [], growths=self.growths,
                        block_params={best: telemetry.count_params(report.record(best).block)} if best else {},
                        max_growths=self.max_growths, depth=depth, max_blocks=self.max_blocks, params=params,
                        max_params=self.max_params, reason=why,
                    )  # fmt: skip
                if action == "grow":  # the function is preserved: these are the new stage's starting losses
                    self.gain_reference, self.gain_signature = losses.tolist(), signatures.tolist()
        # certified only where the deciding verdict's upper bound was below its margin (trial, window)
        certified = any((record.get(key) or {}).get("certified") for key in ("trial", "window"))
        if action != "grow" and (record.get("gain") or {}).get("saturated") and self.snapshot:
            record["restored"] = self._restore(trainer, pl_module, network)
            reason = f"{reason}; {record['restored']['what']}"
            annealed = annealed or bool(record["restored"]["annealed"])  # it was checked annealed: no second anneal
        if action == "grow":
            if self.decision == "gain" and self.restore_best and self._can_restore:
                self.snapshot = take_snapshot(
                    pl_module, network, self._optimizer_for(trainer, network), check=record["check"],
                    epoch=trainer.current_epoch, step=trainer.global_step, depth=depth, annealed=annealed,
                    checkpoints=saved_checkpoints(trainer),  # the files an undo must not leave holding the block
                )  # fmt: skip
            record.update(self._grow(trainer, pl_module, network, report, sites))
        else:
            self._finish(trainer, "saturated" if action == "saturated" else "budget", reason, annealed, certified)
        record.update(telemetry.check_record(report, action, reason, sites, network, self._depth(network),
                                             self.log_sites, certified=certified))  # fmt: skip
        if isinstance(record.get("verdicts"), dict):
            for key in ("gain", "trial", "window"):
                if key in record:
                    record["verdicts"][key] = record[key]
        self.history.append(telemetry.plain(record))
        self._emit(trainer, report, record)
        if record.get("restored"):  # after the record and the stop: the files hold the undo (remeasure.py)
            save_rewound(trainer, self.__dict__.pop("_rewound", []))
        return action

    def _trial_decision(self, trainer, pl_module, network, report, record, depth, params):
        """decision='trial': block-only trials at the best site of each stage decide (trial_check.py)."""
        verdict, trials = self._trials.run(trainer, pl_module, network, report, self._probe_loader(trainer, shard=False),
                                           self._loss, record["level"])  # fmt: skip
        record["trial"] = {"saturated": verdict.saturated, "certified": verdict.certified, "site": verdict.site,
                           "lower_frac": verdict.score,
                           "min_gain": verdict.margin, "reason": verdict.reason, "trials": trials}  # fmt: skip
        return self._decide_at(verdict, verdict.site, report, depth, params)

    def _decide_at(self, verdict, site, report, depth, params):
        """A verdict that names its site (or none) → the action, with the budgets applied."""
        return dec.decide_growth(
            saturated=verdict.saturated, ranked=[site] if site else [], growths=self.growths,
            block_params={site: telemetry.count_params(report.record(site).block)} if site else {},
            max_growths=self.max_growths, depth=depth, max_blocks=self.max_blocks, params=params,
            max_params=self.max_params, reason=verdict.reason,
        )  # fmt: skip

    def _window_decision(self, trainer, pl_module, network, report, record, depth, params):
        """decision='window' (schedule='periodic'): grow at the best first-order site while the run's
        probe loss still falls by a certified > min_gain over the last ``window`` epochs (window_check.py)."""
        losses, signatures = self._probe_losses(trainer, pl_module, network)
        verdict, record["window"] = self._window.decide(losses, signatures, epoch=trainer.current_epoch,
                                                        level=record["level"], check=record["check"])  # fmt: skip
        return self._decide_at(verdict, None if verdict.saturated else best_scored_site(report), report, depth, params)

    def _finish(self, trainer: Trainer, why: str, reason: str, annealed: bool = False, certified: bool = False) -> None:
        """Growth has ended: stop, continue at this depth, or start the final anneal (unless the
        stage anneal before this check already annealed the final network)."""
        self.finished, self.stop_reason = why, reason
        self.snapshot = None  # no later verdict can restore it: free the host copy (and the checkpoint's)
        words = outcome({"action": why, "certified": certified})  # never "saturated" for an uncertified stop
        if self.on_saturated == "anneal" and annealed:
            trainer.should_stop = True
            rank_zero_info(f"GrowUntilSaturated: growth ended ({words}) on the annealed network; stopping")
        elif self.on_saturated == "anneal":
            if self._start_anneal(trainer, "final"):
                rank_zero_info(f"GrowUntilSaturated: growth ended ({words}); annealing the learning rate to 0 over "
                               f"{self.anneal_epochs} epoch(s), then stopping")  # fmt: skip
        elif why == "saturated" and self.on_saturated == "stop":
            trainer.should_stop = True
            rank_zero_info(f"GrowUntilSaturated: stopping training at epoch {trainer.current_epoch}: {reason}")

    def _measure(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module) -> tuple[SaturationReport, float]:
        level = self._level()
        sync_fn = None
        if trainer.world_size > 1:
            sync_fn = lambda t: trainer.strategy.reduce(t, reduce_op="sum")  # noqa: E731
            # DDP broadcasts buffers before each forward, but the last training forward then moved
            # each rank's BatchNorm statistics by its own batch: probe one network, rank 0's.
            for buffer in pl_module.buffers():
                torch.distributed.broadcast(buffer.data, src=0)
        loader = self._probe_loader(trainer)
        # The split of the cross-fit rules needs the sample count before the pass: read it from the
        # loader itself, since the precision wrapper below hides its sampler.
        size = probe_size(loader) if self.rule != "paper" else None
        # min_gain's per-sample losses come from this pass's own forward on one process; under
        # DDP each rank sees only its shard, so _last_growth_paid scores the whole probe instead
        self._pass_losses = [] if self.decision in ("gain", "window") and trainer.world_size == 1 else None
        self._pass_probe = Fingerprinted(loader) if self._pass_losses is not None else None
        start = time.perf_counter()
        # the pass over every site shows its batches in the progress bar (nothing without one, or off rank 0)
        probe = counted(self._pass_probe or loader, progress_for(trainer), "growth check: probe pass")
        report = measure_saturation(
            ProbeView(pl_module, network), _Converted(probe, trainer), self._loss, delta=self.delta, alpha=level,
            t=self.t, projected=self.projected, rule=self.rule, tau=self.tau, seed=self.seed * 1000 + self.checks,
            calibrate=self.calibrate, autocast_dtype=self._autocast_dtype(trainer), sync_fn=sync_fn, probe_size=size,
            sample_losses=self._pass_losses, variance=True,  # every check reports the paper's Γ̂ against δ+t
        )  # fmt: skip
        self.probe_seconds += time.perf_counter() - start
        self.checks += 1
        return report, level

    @staticmethod
    def _autocast_dtype(trainer: Trainer) -> torch.dtype | None:
        precision = str(trainer.precision)
        if precision.startswith("bf16-mixed"):
            return torch.bfloat16
        if precision.startswith("16-mixed"):
            return torch.float16 if trainer.strategy.root_device.type == "cuda" else torch.bfloat16
        return sharded.compute_dtype(trainer.lightning_module)  # FSDP2 MixedPrecisionPolicy(param_dtype=...), or None

    @staticmethod
    def _depth(network: nn.Module) -> int | None:
        depth = getattr(network, "depth", None)
        return int(depth()) if callable(depth) else None

    def _grow(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module, report: SaturationReport,
              sites: Sequence[str]) -> dict:  # fmt: skip
        """Insert the scored candidates (the network editor: editor.py), then start the new stage."""
        x = first_input(_Converted(self._probe_loader(trainer), trainer))
        done = editor.grow(trainer, pl_module, network, {name: report.record(name).block for name in sites}, x,
                           rewrap=self._rewrap_ddp)
        if done.pop("restart") and self.lr_schedule == "restart":
            self.restart_pending = True
        self.inserted += len(done["growth_index"])
        self.growths += 1
        self.cooldown_left = self.cooldown
        self.best, self.wait, self.stage_epochs = None, 0, 0
        return done

    _optimizer_for = staticmethod(editor.optimizer_for)
    _rewrap_ddp = staticmethod(editor.rewrap_ddp)

    def _restart_schedules(self, trainer: Trainer, pl_module: LightningModule) -> None:
        optimizer = self._optimizer_for(trainer, self._network)
        if optimizer is not None:
            trainer.strategy.lr_scheduler_configs = restart_schedulers(
                pl_module, optimizer, trainer.strategy.lr_scheduler_configs
            )
        self.restart_pending = False

    # -- telemetry -------------------------------------------------------------------------
    @staticmethod
    def history_path(trainer: Trainer) -> str:
        """``growth_history.json`` in ``trainer.log_dir`` (else ``default_root_dir``); call on every rank."""
        return telemetry.history_path(trainer)

    def _emit(self, trainer: Trainer, report: SaturationReport | None, record: dict) -> None:
        telemetry.log_check(trainer, report, record, self.log_sites)
        path = telemetry.history_path(trainer)  # every rank: trainer.log_dir is a collective (broadcast)
        if not trainer.is_global_zero:
            return
        telemetry.write_history(path, self.history)
        if self.verbose:
            telemetry.print_renderable(trainer, telemetry.check_table(report, record))
