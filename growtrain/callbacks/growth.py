"""``GrowUntilSaturated``: grow the network mid-fit while the certified test says depth pays.

Three parts, each with one interface (docs/design.md draws one check's data flow)::

    schedule  — when a check comes (the ``schedule`` option: ``Converged`` or ``Periodic``): a
                converged stage (StageMonitor's plateau, LrAnneal's stage anneal) or every K epochs;
                the final anneal reserved (schedule.py, schedule_rules.should_check)
    decision  — what decides (the ``decision`` option: ``Trial``, ``StageFork`` or ``Rule``): what a
                check measured → a Verdict: BlockTrials (trial), PairedFork (stage_fork: its arm also
                trains on every batch between checks), or the first-order rule of measure_saturation (rule)
    editor    — what the verdict does: schedule_rules.decide_growth applies the budgets; grow
                (function-preserving, verified, rolled back on failure), zero-state optimizer
                groups, DDP re-wrap (editor.py)

The hooks only gather inputs and call these parts, so every rank that sees the same all-reduced
probe sums takes the same action. Options are validated once, in ``GrowthConfig``.

What a checkpoint holds: the network's state dict carries its growth record (its extra state)
and rebuilds the grown blocks before they load, for any module; this callback also writes the
record to ``checkpoint["growtrain"]`` (what an FSDP2 resume reads before the shards load), at
fit start gives a grown network's blocks growth's optimizer groups (a plain optimizer over
``self.parameters()`` lines up with the saved state), and its ``state_dict`` keeps its counters and history
and each part's own state. Candidate blocks are seeded by check index (``seed·1000 + check``), so
a resumed run inserts exactly the blocks an uninterrupted run would.
"""

from __future__ import annotations

import time
from typing import Any, Callable, Iterable, Literal

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.utils.data import DataLoader

from growtrain import schedule_rules
from growtrain.callbacks import editor, guidance, probe_check, sharded, telemetry
from growtrain.callbacks.anneal import LrAnneal, refuse_scheduler, schedulers_of
from growtrain.callbacks.editor import FunctionChangedError
from growtrain.callbacks.fork_check import PairedFork
from growtrain.callbacks.growth_config import Converged, GrowthConfig, Periodic, Rule, StageFork, Trial
from growtrain.callbacks.monitor import StageMonitor
from growtrain.callbacks.probe_data import Converted, check_probe_setup, first_input
from growtrain.callbacks.rng_state import RandomStateCheckpoint
from growtrain.callbacks.schedule import CheckSchedule, steps_per_epoch
from growtrain.callbacks.rule_check import FirstOrderRule
from growtrain.callbacks.trial_check import BlockTrials
from growtrain.growable import probe_loss_for, resolve_network
from growtrain.plots import outcome
from growtrain.reconfigure import restart_schedulers
from growtrain.saturation import SaturationReport
from growtrain.trial import DEFAULT_TRIAL_LR, TRIAL_SITES

__all__ = ["GrowUntilSaturated", "FunctionChangedError"]

# Counters kept in the checkpoint.
_STATE_INTS = ("checks", "growths", "inserted")


class GrowUntilSaturated(Callback):
    """Insert function-preserving blocks while the certified test says depth still pays.

    Quick start (growtrain's module and datamodule need no arguments)::

        trainer = lightning.Trainer(callbacks=[GrowUntilSaturated(on_saturated="anneal")])
        trainer.fit(ImageClassifier(in_channels=1), ImageDataModule())

    Three parts, each one option: **when** a check comes (``schedule``), **what** decides
    (``decision``), and **how** growth goes on (the budgets, ``on_saturated``, ``lr_schedule``).
    ``schedule=Converged(...)`` (the default ``"converged"``, the paper's protocol) checks when the
    monitored loss has plateaued (with ``lr_schedule="anneal"``: after a cosine anneal of the stage);
    each check trains a fresh block alone at the best first-order site of each stage and grows where
    one lowers the probe's loss (samples held out from training by index) by a certified more than
    ``min_gain`` of it (``decision=Trial(...)``, ``"trial"``).
    ``schedule=Periodic(every_n_epochs=K)`` (``"periodic"``: K = 1) checks every K epochs: by default
    the run against a copy with one more block in every stage, trained on the same batches until the
    next check, compared on the probe (``decision=StageFork(...)``), then one final anneal.
    docs/callback.md has a row per option with the measurement behind it. Your own LightningModule:
    keep the growable network as a submodule (``cifar_resnet``, ``GrowableStack``; no base class, any
    optimizer over ``self.parameters()``), log ``train_loss`` per epoch, and give a probe (``probe=`` or
    ``datamodule.probe_dataloader()``) that never feeds training.

    Args (one row each, with the measurement behind it, in docs/callback.md):
        probe: held-out DataLoader of ``(input, target)`` in a fixed order, or a callable returning
            one; ``None``: ``trainer.datamodule.probe_dataloader()``.
        network: the growable network: ``None`` (found), a dotted attribute path, or the module.
        loss_fn: ``loss_fn(output, target)`` → mean loss; ``None``: ``pl_module.probe_loss``, else cross-entropy.
        schedule: when a check comes: ``Converged(monitor, mode, patience, min_rel_delta,
            min_stage_epochs, anneal_epochs)`` (a check when ``monitor`` plateaus; ``"converged"``: its
            defaults) or ``Periodic(every_n_epochs, min_steps_between_checks, anneal_epochs)`` (a fixed
            interval; ``"periodic"``: every epoch). ``anneal_epochs``: the stage anneal's and the final
            anneal's length.
        decision: what decides: ``Trial(min_gain, epochs)`` (block-only trials), ``StageFork(min_gain)``
            (``Periodic`` only: the run against a copy with one more block in every stage, grown
            together; growtrain/fork.py) or ``Rule()`` (the first-order rule alone); a name
            (``"trial"``, ``"stage_fork"``, ``"rule"``) is the class with its defaults; ``None``:
            ``Trial()`` under ``Converged``, ``StageFork()`` under ``Periodic``.
        delta: the first-order rules' margin δ ≥ 0 (gradient-norm units).
        alpha: the error probability in (0, 1) of each test.
        t: Proposition 1's separation; giving it selects the paper's rule.
        rule: ``"crossfit"`` (default) or ``"paper"`` (Γ̂ > δ + t): decides under ``decision="rule"``,
            ranks the sites otherwise; every check reports every verdict.
        max_growths, max_params: budgets; reaching one ends growth (reason "budget").
        on_saturated: when growth ends: ``"stop"``, ``"continue"`` at that depth, or ``"anneal"``
            (the final anneal over the schedule's ``anneal_epochs``, reserved inside ``max_epochs`` and
            ``max_steps``, then stop).
        lr_schedule: after a growth the schedulers ``"continue"`` or ``"restart"``; ``"anneal"``:
            the callback drives the rate (constant per stage, annealed before each check; not with
            ``StageFork``). ``None`` (default): ``"anneal"`` under ``Converged``, unless the network's
            optimizer has a scheduler (then ``"continue"``, with a warning); ``"continue"`` under
            ``Periodic``.
        seed: candidate blocks of check ``k`` come from ``seed·1000 + k``; trial blocks from
            ``seed·100003 + k`` for the ``k``-th trial.
        verbose: one table per check and a summary at the end of the fit (rank 0).

    Attributes:
        config: the options, validated (``GrowthConfig``, frozen); each is also readable, read-only, as
            ``callback.<option>`` (``network`` as ``network_spec``; ``lr_schedule`` as in force this fit),
            the parts resolved to their instances (``callback.schedule.patience``, ``callback.decision.min_gain``).
        history: one plain dict per check (``epoch``, ``step``, ``site``, ``gamma``, ``threshold``,
            ``saturated`` (true only where ``certified``), ``certified``, ``params``, ``depth``,
            ``reason``, ``verdicts``, ``trial`` / ``fork``, ``action``, ...).
    """

    def __init__(
        self,
        probe: DataLoader | Callable[[], Iterable] | None = None,
        network: str | nn.Module | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        schedule: Literal["converged", "periodic"] | Converged | Periodic = "converged",
        decision: Literal["trial", "rule", "stage_fork"] | Trial | StageFork | Rule | None = None,
        delta: float = 0.0,
        alpha: float = 0.05,
        t: float | None = None,
        rule: Literal["paper", "crossfit"] | None = None,
        max_growths: int | None = None,
        max_params: int | None = None,
        on_saturated: Literal["stop", "continue", "anneal"] = "stop",
        lr_schedule: Literal["continue", "restart", "anneal"] | None = None,
        seed: int = 0,
        verbose: bool = True,
    ):
        super().__init__()
        # The options, validated once and kept in one place: the parts below are built from this config and the
        # options read back through it (read-only properties, after the class), so nothing can change one copy
        # of an option and not the others. lr_schedule=None is resolved per fit into the schedule (lr_schedule).
        self._config = GrowthConfig(
            probe=probe, network=network, loss_fn=loss_fn, schedule=schedule, decision=decision, delta=delta,
            alpha=alpha, t=t, rule=rule, max_growths=max_growths, max_params=max_params, on_saturated=on_saturated,
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
        self._anneal = LrAnneal(when.anneal_epochs)
        self._schedule = CheckSchedule(
            kind=when.kind, every_n_epochs=1 if converged else when.every_n_epochs or 1,
            min_stage_epochs=when.min_stage_epochs if converged else 1, lr_schedule=c.lr_schedule,
            on_saturated=c.on_saturated, monitor=self._monitor, anneal=self._anneal,
            min_steps_between_checks=None if converged else when.min_steps_between_checks)  # fmt: skip
        # the decision: one interface, judge(CheckInputs) → (verdict, sites, record entry)
        self._decider = {
            "trial": lambda: BlockTrials(epochs=what.epochs, lr=DEFAULT_TRIAL_LR, sites=TRIAL_SITES,
                                         min_gain=what.min_gain, seed=c.seed),
            "rule": FirstOrderRule,
            "stage_fork": lambda: PairedFork(min_gain=what.min_gain, seed=c.seed, horizon=when.interval),
        }[what.name]()  # fmt: skip
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
        if self._decider.key is not None:  # the decision's own state
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
        if self._decider.key is not None:
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
        if self._fork is not None and sharded.is_model_parallel(trainer.strategy):
            raise RuntimeError("strategy: decision='stage_fork' trains a full copy of the network beside the run, which "
                               "is not sharded under FSDP2 (ModelParallelStrategy). Fix: use strategy='ddp' or one "
                               "device, or decision='trial' under FSDP2.")  # fmt: skip
        if self._fork is not None and getattr(trainer.precision_plugin, "scaler", None) is not None:
            raise RuntimeError(f"precision: decision='stage_fork' does not scale the arm's loss, so under "
                               f"precision={trainer.precision!r} (a loss-scaled float16) its gradients could underflow. "
                               "Fix: pass precision='bf16-mixed' or '32-true', or decision='trial'.")  # fmt: skip
        if self._fork is not None:
            self._fork.check_module(pl_module)
        self._network = self._resolve_network(pl_module, required=not self._builds_late(pl_module))
        if sharded.is_model_parallel(trainer.strategy):  # resume: grow to the checkpoint's depth before the shards load
            sharded.install_resume(trainer, lambda: self._network or self._resolve_network(pl_module, required=True))
        self._loss = probe_loss_for(pl_module, self.loss_fn)
        probe_check.check_probe_source(trainer, self.probe, paired=not isinstance(self.decision, Rule))

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._fit_start = time.perf_counter()
        self._monitor.fit_start()
        # a plain optimizer over self.parameters() of a grown network: growth's groups, before Lightning
        # restores a checkpoint's optimizer state by position (this hook runs between the two)
        self._groups.regroup(trainer, pl_module, self._network or self._resolve_network(pl_module, required=False))

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
        if self.config.lr_schedule is None:  # the default under a converged (plateau) schedule: per fit, per module
            self._resolve_lr_schedule(trainer)
        if self.lr_schedule == "anneal" and (self.finished is None or self._anneal.active):
            refuse_scheduler(trainer, editor.optimizer_for(trainer, self._network))
        why = self._schedule.no_room(trainer, self.finished)
        if why is not None:  # a fit too short to grow says so
            rank_zero_warn(f"GrowUntilSaturated: {why}", category=UserWarning)
        check_probe_setup(trainer, pl_module, self._network, self._probe_loader(trainer, shard=False), self._loss,
                          defaulted=self.loss_fn is None and not callable(getattr(pl_module, "probe_loss", None)))
        probe_check.check_probe_independent(trainer, self._probe_loader(trainer))

    def _resolve_lr_schedule(self, trainer: Trainer) -> None:
        """``lr_schedule=None`` under the converged schedule: ``"anneal"`` — each stage, once its
        monitor has plateaued, is cosine-annealed before the check, so a trial block (itself trained
        with a cosine to zero) is not credited with what annealing the network alone would give —
        unless the network's optimizer has a scheduler of its own, which would fight it: then
        ``"continue"``, said once."""
        schedulers = schedulers_of(trainer, editor.optimizer_for(trainer, self._network))
        resolved = "continue" if schedulers else "anneal"
        if schedulers:
            rank_zero_warn(
                f"GrowUntilSaturated: lr_schedule: the network's optimizer has a scheduler ({', '.join(schedulers)}), so "
                "the default lr_schedule is 'continue': each check runs at the rate your schedule has then, not on an "
                "annealed stage, and a trial block trained with its own anneal may be credited with what annealing "
                "gives. Fix: return no lr_scheduler from configure_optimizers (lr_schedule='anneal' then anneals each "
                "stage before its check), or pass lr_schedule='continue' to keep your schedule.", category=UserWarning)
        self._schedule.lr_schedule = resolved  # the one resolved value (lr_schedule reads it); the config keeps None

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
        if self.restart_pending:
            optimizer = editor.optimizer_for(trainer, self._network)
            if optimizer is not None:
                trainer.strategy.lr_scheduler_configs = restart_schedulers(
                    pl_module, optimizer, trainer.strategy.lr_scheduler_configs
                )
            self.restart_pending = False
        self._schedule.epoch_start(trainer, lambda: editor.optimizer_for(trainer, self._network))

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        self._monitor.batch_end(outputs)
        if self._fork is not None and self._fork.site is not None:  # the fork's arm trains on the same batch
            self._fork.batch_end(trainer, pl_module, self._network, batch, batch_idx,
                                 horizon_steps=self._horizon_steps(trainer))

    def _horizon_steps(self, trainer: Trainer) -> int | None:
        """Optimizer steps from one check to the next (the fork's horizon)."""
        when = self.schedule  # a stage fork runs under a Periodic schedule only
        if when.min_steps_between_checks is not None:
            return int(when.min_steps_between_checks)
        per_epoch = steps_per_epoch(trainer)
        return None if per_epoch is None else per_epoch * when.every_n_epochs

    def on_validation_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._monitor.validation_end(trainer)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
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
        _read_only("lr_schedule")

    @property
    def epochs_since_check(self) -> int:
        return self._schedule.epochs_since_check

    @property
    def stage_epochs(self) -> int:
        """Epochs since the start or the last growth."""
        return self._schedule.stage_epochs

    def _budget_reason(self, trainer: Trainer | None = None) -> str | None:
        network = self._network
        return schedule_rules.budget_reason(
            growths=self.growths, max_growths=self.max_growths, params=telemetry.count_params(network),
            max_params=self.max_params,
        ) or (self._final_reserved(trainer) if trainer is not None else None)  # fmt: skip

    def _final_reserved(self, trainer: Trainer) -> str | None:
        return self._schedule.reserved(trainer, self.finished)

    # -- the end of the fit ----------------------------------------------------------------
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._rng_state is not None:
            self._rng_state.on_fit_end(trainer, pl_module)
        if self._network is None:
            return
        written = bool(self.history)
        path = telemetry.history_path(trainer)  # every rank: trainer.log_dir is a collective (broadcast)
        no_check = None
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
    def _check(self, trainer: Trainer, pl_module: LightningModule, annealed: bool = False) -> str:
        """One check, on a fork of the random number generators (probe_check.forked_rng says why);
        candidate blocks have their own seed (``seed``)."""
        with probe_check.forked_rng(trainer, next(self._network.parameters()).device):
            return self._check_unforked(trainer, pl_module, annealed)

    def _check_unforked(self, trainer: Trainer, pl_module: LightningModule, annealed: bool = False) -> str:
        """Measure (one probe pass), decide (the decision's verdict, then the budgets), act (editor)."""
        network = self._network
        self._schedule.checked(trainer.global_step)
        depth, params = self._depth(network), telemetry.count_params(network)
        record: dict[str, Any] = {
            "check": self.checks, "epoch": trainer.current_epoch, "step": trainer.global_step,
            "depth_before": depth, "params_before": params, "level": None,
        }  # fmt: skip
        if annealed:
            record["annealed"] = True
        blocked = self._budget_reason(trainer)
        report, sites, certified = None, [], False
        opened = None
        if blocked is not None:  # known before probing: save the probe
            action, reason = "budget", blocked
        else:
            report = self._measure(trainer, pl_module, network)
            record["level"] = self.alpha
            verdict, ranked, entry = self._decider.judge(probe_check.CheckInputs(
                trainer, pl_module, network, report, self._probe_loader(trainer, shard=False), self._loss, self.alpha,
                record["check"]))  # fmt: skip
            if entry is not None:
                record[self._decider.key] = entry
            if self._fork is not None and entry.get("open_new"):  # no fork was open: open one, decide nothing
                opened = entry["open_new"] if isinstance(entry["open_new"], str) else self._fork.first_sites(report)
                action, reason, sites = "fork", f"{verdict.reason} (at {opened})", []
            else:
                action, reason, sites = schedule_rules.decide_growth(
                    saturated=verdict.saturated, ranked=ranked, reason=verdict.reason,
                    block_params={s: telemetry.count_params(report.record(s).block) for s in ranked},
                    growths=self.growths, max_growths=self.max_growths, params=params, max_params=self.max_params,
                )  # fmt: skip
                if self._fork is not None and action == "grow" and sorted(sites) != sorted(ranked):
                    # the run must grow exactly the arm's blocks to take its weights: all of a stage fork's, or none
                    action, reason, sites = "budget", (f"max_params={self.max_params}: the fork's blocks at "
                                                       f"{', '.join(ranked)} do not all fit ({params} parameters now)"), []
            certified = verdict.certified  # only where the verdict's upper bound was below its margin
        if action == "grow":
            record.update(self._grow(trainer, pl_module, network, report, sites))
            if self._fork is not None:  # the run takes the arm (its training is kept), then forks again
                self._fork.adopt(network, editor.optimizer_for(trainer, network))
                if schedule_rules.budget_reason(growths=self.growths, max_growths=self.max_growths,
                                                params=telemetry.count_params(network),
                                                max_params=self.max_params) is None:
                    opened = self._fork.first_sites(self._measure(trainer, pl_module, network))
        elif action != "fork":
            if self._fork is not None:
                self._fork.close()
            self._finish(trainer, action, reason, annealed, certified)
        if opened is not None:
            self._fork.open(pl_module, network, editor.optimizer_for(trainer, network), opened,
                            epoch=trainer.current_epoch, step=trainer.global_step)
            record.setdefault("fork", {})["next_site"] = opened
        record.update(telemetry.check_record(report, action, reason, sites, network, self._depth(network),
                                             certified=certified))  # fmt: skip
        if isinstance(record.get("verdicts"), dict) and self._decider.key in record:
            record["verdicts"][self._decider.key] = record[self._decider.key]
        self.history.append(telemetry.plain(record))
        self._emit(trainer, report, record)
        return action

    def _finish(self, trainer: Trainer, why: str, reason: str, annealed: bool = False, certified: bool = False) -> None:
        """Growth has ended: stop, continue at this depth, or start the final anneal (unless the
        stage anneal before this check already annealed the final network)."""
        self.finished, self.stop_reason = why, reason
        words = outcome({"action": why, "certified": certified})  # never "saturated" for an uncertified stop
        if self.on_saturated == "anneal" and annealed:
            trainer.should_stop = True
            rank_zero_info(f"GrowUntilSaturated: growth ended ({words}) on the annealed network; stopping")
        elif self.on_saturated == "anneal":
            if self._anneal.start(editor.optimizer_for(trainer, self._network), "final"):
                rank_zero_info(f"GrowUntilSaturated: growth ended ({words}); annealing the learning rate to 0 over "
                               f"{self.schedule.anneal_epochs} epoch(s), then stopping")  # fmt: skip
        elif why == "saturated" and self.on_saturated == "stop":
            trainer.should_stop = True
            rank_zero_info(f"GrowUntilSaturated: stopping training at epoch {trainer.current_epoch}: {reason}")

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

    def _grow(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module, report: SaturationReport,
              sites: list[str]) -> dict:  # fmt: skip
        """Insert the scored candidates (the network editor: editor.py), then start the new stage."""
        x = first_input(Converted(self._probe_loader(trainer), trainer))
        done = editor.grow(trainer, pl_module, network, {name: report.record(name).block for name in sites}, x,
                           rewrap=editor.rewrap_ddp)
        if done.pop("restart") and self.lr_schedule == "restart":
            self.restart_pending = True
        self.inserted += len(done["growth_index"])
        self.growths += 1
        self._schedule.new_stage()
        return done

    # -- telemetry -------------------------------------------------------------------------
    @staticmethod
    def history_path(trainer: Trainer) -> str:
        """``growth_history.json`` in ``trainer.log_dir`` (else ``default_root_dir``); call on every rank."""
        return telemetry.history_path(trainer)

    def _emit(self, trainer: Trainer, report: SaturationReport | None, record: dict) -> None:
        telemetry.log_check(trainer, report, record)
        path = telemetry.history_path(trainer)  # every rank: trainer.log_dir is a collective (broadcast)
        if not trainer.is_global_zero:
            return
        telemetry.write_history(path, self.history)
        if self.verbose:
            telemetry.print_renderable(trainer, telemetry.check_table(report, record))


def _read_only(name: str) -> None:
    raise AttributeError(f"{name}: GrowUntilSaturated's options are read-only after construction (its parts were built "
                         f"from them, so a changed value would reach some and not others). Fix: build a new "
                         f"GrowUntilSaturated({name}=...) with the value.")  # fmt: skip


def _option(name: str) -> property:
    return property(lambda self: getattr(self.config, name), lambda self, value: _read_only(name),
                    doc=f"The ``{name}`` option as validated (``config.{name}``); read-only.")  # fmt: skip


# Every option readable on the callback (callback.alpha, callback.schedule.patience), through its config: the growable network's
# option as network_spec (the resolved network is found per fit), lr_schedule as resolved (the property above).
for _name in GrowthConfig.names():
    _attr = "network_spec" if _name == "network" else _name
    if _name != "lr_schedule":
        assert not hasattr(GrowUntilSaturated, _attr), _attr  # no hook or property of the class is shadowed
        setattr(GrowUntilSaturated, _attr, _option(_name))
del _name, _attr
