"""``GrowUntilSaturated``: the one growth callback — grow the network mid-fit while depth pays.

Three parts, each one option (docs/design.md draws one check's data flow)::

    schedule  — when: ``Budget`` (the default: decisions early in the fit's compute budget, the final
                network trained and annealed for the rest: budget.BudgetRun), ``Converged`` (a stage
                has plateaued: the paper's protocol), ``Periodic`` (every K epochs) or ``Plan`` (set
                points, no test: scheduled.PlanRun); growth_steps.StageChecks runs a converged or
                periodic check
    decision  — what decides: ``BudgetFork`` (a fork priced against the budget), ``Trial`` (block-only
                trials), ``StageFork`` (a copy with one more block per stage) or ``Rule`` (the
                first-order rule alone); every decision reports the paper's Γ̂_n against δ+t beside it
    insertion — how a block starts (growtrain/insertion.py): function-preserving by default

What every schedule shares lives here: the probe checks (held out by index, fixed order), the
strategy check and DDP re-wrap, the FSDP2 resume, the random state in the checkpoint, the growth
record (the network's extra state, and ``checkpoint["growtrain"]`` for an FSDP2 resume), zero-state
optimizer groups for a resumed grown network, one ``growth_history.json``, the metrics, the
end-of-fit summary and the refusals. Options are validated once, in ``GrowthConfig``; candidate
blocks are seeded by check index, so a resumed run inserts exactly the blocks an uninterrupted
run would.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from growtrain.callbacks import editor, guidance, probe_check, sharded, telemetry
from growtrain.callbacks.anneal import LrAnneal, refuse_scheduler
from growtrain.callbacks.editor import FunctionChangedError
from growtrain.callbacks.fork_check import PairedFork
from growtrain.callbacks.budget import BudgetRun
from growtrain.callbacks.growth_steps import RunParts, StageChecks, _Seconds
from growtrain.callbacks.growth_config import GrowthConfig, option_property, read_only
from growtrain.callbacks.parts import Budget, BudgetFork, Converged, Periodic, Plan, Rule, StageFork, Trial
from growtrain.callbacks.monitor import StageMonitor
from growtrain.callbacks.probe_data import check_probe_setup
from growtrain.callbacks.rng_state import RandomStateCheckpoint
from growtrain.callbacks.schedule import CheckSchedule
from growtrain.callbacks.scheduled import PlanRun
from growtrain.callbacks.rule_check import FirstOrderRule
from growtrain.callbacks.trial_check import BlockTrials
from growtrain.growable import probe_loss_for, resolve_network
from growtrain.reconfigure import restart_schedulers
from growtrain.saturation import SaturationReport
from growtrain.trial import DEFAULT_TRIAL_LR, TRIAL_SITES

__all__ = ["GrowUntilSaturated", "FunctionChangedError"]

# Counters kept in the checkpoint.
_STATE_INTS = ("checks", "growths", "inserted")


class GrowUntilSaturated(StageChecks, RunParts, Callback):
    """Insert function-preserving blocks while depth pays, then stop growing, with a certificate.

    Quick start (growtrain's module and datamodule need no arguments; the budget is the trainer's)::

        trainer = lightning.Trainer(max_epochs=60, callbacks=[GrowUntilSaturated()])
        trainer.fit(ImageClassifier(in_channels=1), ImageDataModule())

    Your own LightningModule: keep the growable network as a submodule (``cifar_resnet``,
    ``GrowableStack``; any optimizer over ``self.parameters()``), return the loss from
    ``training_step``, and give a probe (``probe=`` or ``datamodule.probe_dataloader()``) that never
    feeds training. docs/callback.md has a row per option with the measurement behind it.

    Args:
        probe: held-out DataLoader of ``(input, target)`` in a fixed order, or a callable returning
            one; ``None``: ``trainer.datamodule.probe_dataloader()``.
        network: the growable network: ``None`` (found), a dotted attribute path, or the module.
        loss_fn: ``loss_fn(output, target)`` → mean loss; ``None``: ``pl_module.probe_loss``, else cross-entropy.
        schedule: ``Budget(...)`` (``"budget"``, the default), ``Converged(...)`` (``"converged"``),
            ``Periodic(...)`` (``"periodic"``) or ``Plan(at=...)``: each part's options on the part.
        decision: ``BudgetFork(...)`` (under ``Budget``), ``Trial(...)``, ``StageFork(...)`` (under
            ``Periodic``) or ``Rule()``; ``None``: the schedule's own (a ``Plan`` takes none).
        insertion: how a new block starts (growtrain/insertion.py); ``None``: ``"copy_ramp"`` under a
            budget (the block below's weights behind a mask ramped from 0 within the decision's fork),
            ``"zero"`` elsewhere.
        delta, alpha, t, rule: the first-order test every check reports (Γ̂_n against δ+t), its error
            probability (also every decision's), and how it ranks the sites (``"crossfit"`` or ``"paper"``).
        max_growths: a budget of growths; reaching it ends growth (reason "budget").
        on_saturated: when growth ends under ``Converged``/``Periodic``: ``"stop"`` (default),
            ``"continue"`` or ``"anneal"`` (the final anneal, reserved inside the fit, then stop).
        lr_schedule: under ``Converged``/``Periodic``, after a growth the schedulers ``"continue"`` or
            ``"restart"``; ``"anneal"``: the callback drives the rate (docs/callback.md).
        seed: candidate blocks of check ``k`` come from ``seed·1000 + k``.
        verbose: a line or table per check and a summary at the end of the fit (rank 0).

    Attributes:
        config: the options, validated (``GrowthConfig``, frozen), each readable as ``callback.<option>``.
        history: one plain dict per check or growth (``check``, ``epoch``, ``step``, ``depth_before``,
            ``depth``, ``action``, ``reason``, ``sites``, ``gamma``, ``threshold``, ``certified``,
            ``verdicts``, and the decision's own figures under its key: ``budget``, ``trial``, ``fork``, ``plan``).
        run: a budget's or a plan's own state (``None`` under ``Converged``/``Periodic``).
    """

    def __init__(
        self,
        probe: DataLoader | Callable[[], Iterable] | None = None,
        network: str | nn.Module | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        schedule: Literal["budget", "converged", "periodic"] | Budget | Converged | Periodic | Plan = "budget",
        decision: Literal["budget_fork", "trial", "rule", "stage_fork"] | BudgetFork | Trial | StageFork | Rule
        | None = None,
        insertion: Literal["zero", "copy_zero", "mask_ramp", "copy", "copy_ramp"] | None = None,
        delta: float = 0.0,
        alpha: float = 0.05,
        t: float | None = None,
        rule: Literal["paper", "crossfit"] | None = None,
        max_growths: int | None = None,
        on_saturated: Literal["stop", "continue", "anneal"] | None = None,
        lr_schedule: Literal["continue", "restart", "anneal"] | None = None,
        seed: int = 0,
        verbose: bool = True,
    ):
        super().__init__()
        # The options, validated once and kept in one place: the parts below are built from this config and the
        # options read back through it (read-only properties, after the class), so nothing can change one copy
        # of an option and not the others. lr_schedule=None is resolved per fit into the schedule (lr_schedule).
        self._config = GrowthConfig(
            probe=probe, network=network, loss_fn=loss_fn, schedule=schedule, decision=decision, insertion=insertion,
            delta=delta, alpha=alpha, t=t, rule=rule, max_growths=max_growths, on_saturated=on_saturated,
            lr_schedule=lr_schedule, seed=seed, verbose=verbose,
        )  # fmt: skip
        c = self._config
        when, what = c.schedule, c.decision
        converged = isinstance(when, Converged)
        self._network: nn.Module | None = None
        self._loss: Callable | None = None
        # the schedule: when a check comes (its plateau and anneal parts kept here by name too); a periodic
        # schedule has no plateau to watch
        self._monitor = (StageMonitor(when.monitor, when.mode, when.patience, when.min_rel_delta) if converged
                         else StageMonitor(None, "min", 1, 0.0))  # fmt: skip
        self._anneal = LrAnneal(max(1, when.anneal_epochs))
        staged = isinstance(when, (Converged, Periodic))
        self._schedule = CheckSchedule(
            kind=when.kind, every_n_epochs=1 if not isinstance(when, Periodic) else when.every_n_epochs or 1,
            min_stage_epochs=when.min_stage_epochs if converged else 1, lr_schedule=c.lr_schedule,
            on_saturated=c.on_saturated, monitor=self._monitor, anneal=self._anneal,
            min_steps_between_checks=when.min_steps_between_checks if isinstance(when, Periodic) else None)  # fmt: skip
        # the decision at a converged or periodic check: one interface, judge(CheckInputs) → (verdict, sites, entry);
        # a budget or a plan runs its own part (budget.py, scheduled.py) from this callback's hooks
        self._decider = {
            "trial": lambda: BlockTrials(epochs=what.epochs, lr=DEFAULT_TRIAL_LR, sites=TRIAL_SITES,
                                         min_gain=what.min_gain, seed=c.seed),
            "rule": FirstOrderRule,
            "stage_fork": lambda: PairedFork(min_gain=what.min_gain, seed=c.seed, horizon=when.interval),
            "budget_fork": lambda: _Seconds("budget"),
        }[what.name]() if staged or what is not None else _Seconds("plan")  # fmt: skip
        self._run: BudgetRun | PlanRun | None = (BudgetRun(self) if isinstance(when, Budget)
                                                 else PlanRun(self) if isinstance(when, Plan) else None)  # fmt: skip
        self._trials = self._decider if isinstance(self._decider, BlockTrials) else None
        self._fork = self._decider if isinstance(self._decider, PairedFork) else None
        self._reset_state()
        self.probe_seconds = 0.0  # wall time inside measure_saturation, this process (earlier ones: _before)
        self._fit_start = 0.0
        self._rng_state: RandomStateCheckpoint | None = None  # set per fit in setup
        self._groups = editor.ResumeGroups()  # a resumed checkpoint's optimizer group names
        self._first = True  # the first GrowUntilSaturated of its trainer (set in setup)

    # -- checkpoint state ------------------------------------------------------------------
    def _reset_state(self) -> None:
        self.history: list[dict] = []
        self.checks = 0  # probe checks run (seeds candidate blocks)
        self.growths = 0  # checks that grew
        self.inserted = 0  # blocks inserted by this callback
        self.finished: str | None = None
        self.stop_reason: str | None = None
        self.restart_pending = False
        self.start_depth: int | None = None
        self._schedule.load_state_dict({})
        if getattr(self, "_run", None) is not None:
            self._run.reset()
        # seconds of checks (probe passes and the decision's work) and of fit before this process: a resumed fit's
        # summary reports the whole fit's share
        self._before = {"checks": 0.0, "fit": 0.0}

    def state_dict(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in _STATE_INTS}
        state.update(history=self.history, finished=self.finished, stop_reason=self.stop_reason,
                     restart_pending=self.restart_pending, start_depth=self.start_depth,
                     **self._schedule.state_dict())  # fmt: skip
        state["seconds"] = {"checks": self.check_seconds, "fit": self.fit_seconds}
        state = telemetry.plain(state)
        if self._run is not None:  # the budget's or the plan's own state
            state[self._decider.key] = self._run.state_dict()
        elif self._decider.key is not None:  # the decision's own state
            state[self._state_key] = self._decider.state_dict()
        return state

    @property
    def check_seconds(self) -> float:
        """Wall time of the checks (probe passes, trials, arms) over the whole fit, resumes included."""
        return self._before["checks"] + self.probe_seconds + self._decider.seconds

    @property
    def fit_seconds(self) -> float:
        """Wall time of the fit so far, resumes included (this process's from on_fit_start)."""
        return self._before["fit"] + (time.perf_counter() - self._fit_start if self._fit_start else 0.0)

    @property
    def state_key(self) -> str:
        """The key of this callback's state in a checkpoint: one per growable network it grows
        (``network``: the attribute path, or the network's class), as Lightning's EarlyStopping
        keys by its monitor, so two callbacks growing two networks of one module keep their own."""
        spec = self.network_spec
        return self._generate_state_key(network=spec if spec is None or isinstance(spec, str) else type(spec).__name__)

    @property
    def _state_key(self) -> str:
        return {"trial": "trials"}.get(self._decider.key, self._decider.key)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._reset_state()
        self.history = [dict(h) for h in state_dict.get("history", [])]
        for key in _STATE_INTS:
            setattr(self, key, int(state_dict.get(key, 0)))
        self.finished, self.stop_reason = state_dict.get("finished"), state_dict.get("stop_reason")
        self.restart_pending = bool(state_dict.get("restart_pending", False))
        self.start_depth = state_dict.get("start_depth")
        self._before = {k: float((state_dict.get("seconds") or {}).get(k, 0.0)) for k in ("checks", "fit")}
        self.probe_seconds, self._decider.seconds = 0.0, 0.0  # counted in _before: a reused callback must not add them twice
        self._schedule.load_state_dict(state_dict)
        if self._run is not None:
            self._run.load_state_dict(state_dict.get(self._decider.key, {}))
        elif self._decider.key is not None:
            self._decider.load_state_dict(state_dict.get(self._state_key, {}))

    # -- setup: refuse early ------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        sharded.check_strategy(trainer)
        # The random state in every checkpoint, back on resume, so a resumed fit draws the uninterrupted fit's
        # batches (and makes its checks): RandomStateCheckpoint's work, done here unless the trainer has one of its
        # own (growtrain's trainers add it), by the first GrowUntilSaturated only.
        self._groups.forget()  # a resumed fit's come with on_load_checkpoint, after this hook
        callbacks = getattr(trainer, "callbacks", None) or []
        first = next((cb for cb in callbacks if isinstance(cb, GrowUntilSaturated)), self)
        self._first = first is self
        own = any(isinstance(cb, RandomStateCheckpoint) for cb in callbacks)
        self._rng_state = RandomStateCheckpoint() if first is self and not own else None
        forks = self.decision is not None and self.decision.name in ("stage_fork", "budget_fork")
        name = self.decision.name if forks else None
        if forks and sharded.is_model_parallel(trainer.strategy):
            raise RuntimeError(f"strategy: decision={name!r} trains a full copy of the network beside the run, which "
                               "is not sharded under FSDP2 (ModelParallelStrategy). Fix: use strategy='ddp' or one "
                               "device, or schedule='converged' (decision='trial') under FSDP2.")  # fmt: skip
        if forks and getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise RuntimeError(f"precision: decision={name!r} does not scale the arm's loss, so under "
                               f"precision={trainer.precision!r} (a loss-scaled float16) its gradients could underflow. "
                               "Fix: pass precision='bf16-mixed' or '32-true', or schedule='converged' "
                               "(decision='trial').")  # fmt: skip
        if forks:
            PairedFork.check_module(pl_module, name)
        if isinstance(self._run, PlanRun):
            if self.insertion != "zero" and sharded.is_model_parallel(trainer.strategy):
                raise RuntimeError(f"insertion: {self.insertion!r} writes whole tensors into the new block, which "
                                   "FSDP2 shards; use insertion='zero' under ModelParallelStrategy")  # fmt: skip
            self._run.setup()
        self._network = self._resolve_network(pl_module, required=not self._builds_late(pl_module))
        if sharded.is_model_parallel(trainer.strategy):  # resume: grow to the checkpoint's depth before the shards load
            sharded.install_resume(trainer, lambda: self._network or self._resolve_network(pl_module, required=True))
        self._loss = probe_loss_for(pl_module, self.loss_fn)
        if not isinstance(self._run, PlanRun):  # a plan probes nothing
            probe_check.check_probe_source(trainer, self.probe, paired=not isinstance(self.decision, Rule))

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self._monitor.fit_start()
        # a plain optimizer over self.parameters() of a grown network: growth's groups, before Lightning
        # restores a checkpoint's optimizer state by position (this hook runs between the two)
        network = self._network or self._resolve_network(pl_module, required=False)
        self._groups.regroup(trainer, pl_module, network)
        if isinstance(self._run, PlanRun):
            self._run.fit_start(trainer, network)

    def on_save_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # The growth record beside the weights, for any module (the network's extra state carries it in the state
        # dict too): an FSDP2 resume reads it from a sharded checkpoint's metadata before the shards load.
        if self._network is not None and self._first:  # one record: the first growth callback's network
            checkpoint["growtrain"] = {"growth": [dict(r) for r in self._network.growth_log]}
        if self._rng_state is not None:
            self._rng_state.on_save_checkpoint(trainer, pl_module, checkpoint)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        # the saved optimizers' group names: on_fit_start lines a plain optimizer up with them
        self._groups.remember(checkpoint)
        if self._rng_state is not None:
            self._rng_state.on_load_checkpoint(trainer, pl_module, checkpoint)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._rng_state is not None:  # a mid-epoch checkpoint: its states now (rng_state.py says why)
            self._rng_state.on_train_start(trainer, pl_module)
        if self._network is None:
            self._network = self._resolve_network(pl_module, required=True)
        if self.start_depth is None:
            self.start_depth = self._depth(self._network)
        # the depth from the first epoch on, for a ModelCheckpoint or EarlyStopping to monitor (each check adds its figures)
        telemetry.publish(trainer, {"growth/depth": self._depth(self._network)})
        # a callback reused in a new fit (its step count starts again at 0) counts from the new start
        self._schedule.last_check_step = min(self._schedule.last_check_step, int(trainer.global_step))
        if isinstance(self._run, PlanRun):
            self._run.train_start(trainer, self._network)
            return
        if isinstance(self._run, BudgetRun):
            self._run.train_start(trainer, pl_module)
        elif self.config.lr_schedule is None:  # the default under a converged (plateau) schedule: per fit, per module
            self._resolve_lr_schedule(trainer)
        if self.lr_schedule == "anneal" and (self.finished is None or self._anneal.active):
            refuse_scheduler(trainer, editor.optimizer_for(trainer, self._network))
        why = self._schedule.no_room(trainer, self.finished) if self._run is None else None
        if why is not None:  # a fit too short to grow says so
            rank_zero_warn(f"GrowUntilSaturated: {why}", category=UserWarning)
        check_probe_setup(trainer, pl_module, self._network, self._probe_loader(trainer, shard=False), self._loss,
                          defaulted=self.loss_fn is None and not callable(getattr(pl_module, "probe_loss", None)))
        probe_check.check_probe_independent(trainer, self._probe_loader(trainer))

    @staticmethod
    def _builds_late(pl_module: LightningModule) -> bool:
        """Does the module build its layers in ``configure_model``/``setup`` (after callback setup)?"""
        cls = type(pl_module)
        return any(getattr(cls, hook) is not getattr(LightningModule, hook) for hook in ("configure_model", "setup"))

    def _resolve_network(self, pl_module: LightningModule, required: bool) -> nn.Module | None:
        return resolve_network(pl_module, self.network_spec, required=required)

    def _probe_loader(self, trainer: Trainer, shard: bool = True) -> Any:
        return probe_check.probe_loader(self.probe, trainer, shard)  # FSDP2: equal shards

    # -- hooks: the schedule ---------------------------------------------------------------
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._rng_state is not None:  # first: a resumed fit's generators, before anything draws
            self._rng_state.on_train_epoch_start(trainer, pl_module)
        if self._run is not None:  # a budget or a plan acts per batch
            return
        if self.restart_pending:
            optimizer = editor.optimizer_for(trainer, self._network)
            if optimizer is not None:
                trainer.strategy.lr_scheduler_configs = restart_schedulers(
                    pl_module, optimizer, trainer.strategy.lr_scheduler_configs
                )
            self.restart_pending = False
        self._schedule.epoch_start(trainer, lambda: editor.optimizer_for(trainer, self._network))

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if isinstance(self._run, BudgetRun):
            self._run.batch_start(trainer, pl_module, batch)
        elif isinstance(self._run, PlanRun):
            self._run.batch_start(trainer)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        if isinstance(self._run, BudgetRun):
            return self._run.batch_end(trainer, pl_module, outputs, batch, batch_idx)
        if isinstance(self._run, PlanRun):
            return self._run.batch_end(trainer, pl_module, batch)
        self._monitor.batch_end(outputs)
        if self._fork is not None and self._fork.site is not None:  # the fork's arm trains on the same batch
            self._fork.batch_end(trainer, pl_module, self._network, batch, batch_idx,
                                 horizon_steps=self._horizon_steps(trainer))

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._monitor.validation_end(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._run is not None:
            return
        what = self._schedule.epoch_end(trainer, finished=self.finished, budget=lambda: self._budget_reason(trainer),
                                        optimizer=lambda: editor.optimizer_for(trainer, self._network))  # fmt: skip
        if what == "stop":  # the final anneal has run its course
            trainer.should_stop = True
        elif what is not None:
            self._check(trainer, pl_module, annealed=what == "check_annealed")

    @property
    def config(self) -> GrowthConfig:
        """The options as given and validated (frozen): the one place they are kept."""
        return self._config

    @property
    def lr_schedule(self) -> str | None:
        """The rate policy in force: the ``lr_schedule`` option, or — given as ``None`` under the
        converged schedule — the one each fit resolved at its start against the module's optimizer
        (``None`` before the first fit). It is the schedule's own value, so what the callback reports
        is what the schedule does; ``config.lr_schedule`` keeps the option as given."""
        return self._schedule.lr_schedule

    @lr_schedule.setter
    def lr_schedule(self, value: Any) -> None:
        read_only("lr_schedule")

    @property
    def stage_epochs(self) -> int:
        """Epochs since the start or the last growth."""
        return self._schedule.stage_epochs

    # -- the end of the fit ----------------------------------------------------------------
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._rng_state is not None:
            self._rng_state.on_fit_end(trainer, pl_module)
        if self._network is None:
            return
        written = bool(self.history)
        path = telemetry.history_path(trainer)  # every rank: trainer.log_dir is a collective (broadcast)
        no_check = None
        if self._run is not None:
            return self._driven_end(trainer, path, written)
        if not self.history:  # the callback did nothing: say so, why, and what to change
            no_check = guidance.no_check_message(
                schedule=self.schedule, best=self._monitor.best, wait=self._monitor.wait,
                stage_epochs=self.stage_epochs, epochs=trainer.current_epoch, waiting=self._schedule.waiting,
                steps=trainer.global_step,
            )  # fmt: skip
            rank_zero_warn(no_check, category=UserWarning)
        if not (self.verbose and trainer.is_global_zero):
            return
        summary = telemetry.fit_end_summary(self, trainer, no_check=no_check, history_path=path, written=written,
                                            fit_seconds=self.fit_seconds)  # fmt: skip
        telemetry.print_renderable(trainer, summary, soft_wrap=True)

    @property
    def run(self) -> BudgetRun | PlanRun | None:
        """A budget's or a plan's own state (budget: ``plan``, ``spent``, ``decision_flops``, ``curve``;
        plan: ``steps``, ``done``); ``None`` under a converged or periodic schedule."""
        return self._run

    # -- what the budget and the plan parts call ---------------------------------------------
    @property
    def growth_epochs(self) -> int | None:
        """Epochs trained when growth ended (``None`` while it goes on): the ending check's epoch + 1."""
        return self.history[-1]["epoch"] + 1 if self.finished is not None and self.history else None

    @property
    def last_save(self) -> dict[str, Any] | None:
        """Where this fit's latest checkpoint was written, as ``RandomStateCheckpoint`` records it
        (read by the Ctrl-C message, ``growtrain.resume.interrupt_report``); ``None`` when the
        trainer has its own ``RandomStateCheckpoint``."""
        return self._rng_state.last_save if self._rng_state is not None else None

    @property
    def final_epochs(self) -> int:
        """Epochs of the final anneal trained so far (its progress is callback state already)."""
        return self._anneal.done or 0 if self._anneal.kind == "final" else 0

    def on_exception(self, trainer: Trainer, pl_module: LightningModule, exception: BaseException) -> None:
        """Ctrl-C: the summary of the fit so far; RandomStateCheckpoint then prints the command that
        resumes it, and Lightning exits 1. One process only: the summary finds its folder with a
        collective under DDP, which an interrupted rank may never join."""
        if isinstance(exception, KeyboardInterrupt) and trainer.world_size == 1:
            self.on_fit_end(trainer, pl_module)
        if self._rng_state is not None:  # Ctrl-C: the command that resumes the fit, after the summary
            self._rng_state.on_exception(trainer, pl_module, exception)

    # -- one check -------------------------------------------------------------------------
    def _measure(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module) -> SaturationReport:
        report, seconds = probe_check.probe_pass(
            trainer, pl_module, network, self._probe_loader(trainer), self._loss, delta=self.delta, alpha=self.alpha,
            t=self.t, rule=self.rule, seed=self.seed * 1000 + self.checks)  # fmt: skip
        self.probe_seconds += seconds
        self.checks += 1
        return report

    @staticmethod
    def _depth(network: nn.Module) -> int | None:
        depth = getattr(network, "depth", None)
        return int(depth()) if callable(depth) else None

    # -- telemetry -------------------------------------------------------------------------
    @staticmethod
    def history_path(trainer: Trainer) -> str:
        """``growth_history.json`` in ``trainer.log_dir`` (else ``default_root_dir``); call on every rank."""
        return telemetry.history_path(trainer)

    def _emit(self, trainer: Trainer, report: SaturationReport | None, record: dict, table: bool = True) -> None:
        telemetry.log_check(trainer, report, record)
        path = telemetry.history_path(trainer)  # every rank: trainer.log_dir is a collective (broadcast)
        if not trainer.is_global_zero:
            return
        telemetry.write_history(path, self.history)
        if self.verbose and table:
            telemetry.print_renderable(trainer, telemetry.check_table(report, record))


# Every option readable on the callback (callback.alpha, callback.schedule.patience), through its config: the growable network's
# option as network_spec (the resolved network is found per fit), lr_schedule as resolved (the property above).
for _name in GrowthConfig.names():
    _attr = "network_spec" if _name == "network" else _name
    if _name != "lr_schedule":
        assert not hasattr(GrowUntilSaturated, _attr), _attr  # no hook or property of the class is shadowed
        setattr(GrowUntilSaturated, _attr, option_property(_name))
del _name, _attr
