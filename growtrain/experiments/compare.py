"""Growth vs Scratch at convergence (the paper's Table 1), paired by seed, with a
compute-matched Scratch arm whose schedule is stretched to its own budget.

**Arms**, per seed, each one training of the configured module (same data, augmentation,
optimizer, schedule, stopping rule):

* **growth** — *table mode* (``depths=[…]``, the paper's protocol): for each final depth ``D``
  (a value of the depth hyper-parameter, e.g. ``added=N`` for cifar_resnet) the **base**
  network of depth ``D−1`` is trained to convergence; the growth arm loads it, inserts ONE
  zero-output block and trains again to convergence (a new fit: fresh optimizer state and a
  fresh schedule). The block goes to the probe's best site (``insert_at="best"``: the scored
  candidate itself) or to the end of the stage the cyclic depth rule extends (``"cyclic"``:
  the paper's architectures). *Continuous mode* (``depths=None``): one fit with
  ``GrowUntilSaturated`` that grows until saturated or ``max_growths``.
* **scratch** — the same final architecture (module tree and parameters checked equal) from
  the constructor's random initialisation.
* **matched** — scratch again, given the growth arm's *total* training FLOPs (base included)
  as a step budget, with its schedule stretched onto that budget (below).

**Stopping rule** (one for every converged arm): the configured
``growtrain.callbacks.TrainLossEarlyStopping`` (stop when the epoch's ``train_loss`` has not
improved by ``min_delta`` for ``patience`` epochs, checked from ``start_epoch`` on) and the
trainer's ``max_epochs`` as a cap. Each arm records why it stopped (``stop``: ``plateau``,
``cap``, ``budget``, ``callback``) and ``capped`` is true when the cap, not the plateau, ended
it; the tables count capped arms. Without a ``TrainLossEarlyStopping`` compare warns, and every
arm runs to the cap and is reported as capped.

**Complete schedules.** A schedule is defined on the epoch cap (the paper: ×0.1 at epochs 100
and 150 of at most 300, early stopping checked from epoch 180). A converged arm may stop any
time after ``start_epoch``, so compare requires the schedule to have reached its final
learning rate by then (``MultiStepLR``: last milestone; ``growtrain.optim.WarmupCosine``:
``total_steps``); a schedule that never settles (``StepLR``; ``CosineAnnealingLR``, whose lr
rises again after ``T_max``) is refused under early stopping. Every converged arm — base,
growth, scratch — therefore runs its whole schedule and then trains at the final lr until its
train loss plateaus or the cap binds. The matched arm has no stopping rule; its schedule is
the cap's schedule stretched by ``budget steps / (max_epochs × steps per epoch)``
(``growtrain.experiments.schedules``). A scheduler compare cannot stretch is an error naming
it, raised before any training.

**Pairing.** Seed ``s`` fixes the data: every training of seed ``s`` (base, growth, scratch,
matched) sees the same split and, epoch by epoch, the same train order
(``growtrain.experiments.pairing.EpochOrder``; its index digests are recorded per run) and the
same augmentation draws (the global RNG is reseeded with ``s`` right before each fit). Every
network built from random initialisation uses the init seed ``s + 10000``; a from-scratch
training is therefore a function of (stage sizes, ``s``) and is trained once: the base of
depth ``D`` *is* the scratch arm of depth ``D−1`` when their architectures agree.

**Reported** per depth: means ± sd over seeds of train loss (re-measured after training on the
train split in eval mode, no augmentation), test loss and accuracy, the train–test gap; the
mean paired difference Growth − Scratch with a 95 % t-interval; the **test loss at equal
training loss**: per seed, target = the larger of the two arms' final epoch ``train_loss``
(the quantity the stopping rule watches), and each arm's test loss at its first epoch *at the
final learning rate* whose ``train_loss`` is at or below it (weights saved at each new
train-loss minimum, evaluated afterwards; both arms' last epochs qualify, so the lookup always
finds an epoch); epochs, FLOPs and wall time per arm. Every finished training is appended to ``output_dir/runs.jsonl`` and
every lookup to ``output_dir/equal.jsonl``; a rerun trains only what is missing.
"""

from __future__ import annotations

import math
import shutil
import time
import warnings
from pathlib import Path
from typing import Literal, Sequence

import torch
from lightning.pytorch import LightningDataModule, LightningModule, seed_everything
from lightning.pytorch.callbacks import EarlyStopping

from growtrain.callbacks import ComputeMeter, GrowUntilSaturated, TrainLossEarlyStopping, growth_callbacks
from growtrain.experiments._training import evaluate, sibling_trainer
from growtrain.experiments.compare_table import CompareResult, summarise, write_files
from growtrain.experiments.paired import equal_loss_target, first_reaching
from growtrain.experiments.pairing import EpochTrace, PairedData, split_digest
from growtrain.experiments.runs import (
    ModuleFactory,
    RunLog,
    architecture,
    architecture_digest,
    check_rebuildable,
    fingerprint,
    growable_of,
    load_checkpoint_into,
    module_with_stages,
    prepare,
    probe_loss_of,
    rebuild_module,
    reference_module,
    resolve_depth_kwarg,
    stage_sizes,
)
from growtrain.experiments.schedules import inspect_schedule, with_rescaled_schedule
from growtrain.experiments.growers import grower_from
from growtrain.saturation import measure_saturation

__all__ = ["CompareResult", "run_compare", "SCRATCH_SEED_OFFSET", "PROTOCOL"]

SCRATCH_SEED_OFFSET = 10_000  # init seed of every from-scratch network of seed s: s + offset
PROTOCOL = 3  # in the fingerprint: run logs of the earlier (unpaired, fixed-budget) protocol are refused


def run_compare(
    model: LightningModule,
    datamodule: LightningDataModule,
    *,
    trainer_kwargs: dict | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    depths: Sequence[int] | None = None,
    depth_kwarg: str | None = None,
    insert_at: Literal["best", "cyclic"] = "best",
    max_growths: int | None = None,
    compute_matched: bool = True,
    labels: Sequence[str] | None = None,
    output_dir: str | Path = "compare",
    resume: bool = True,
    module_factory: ModuleFactory | None = None,
    keep_epoch_weights: bool = False,
) -> CompareResult:
    """Growth vs Scratch over ``seeds`` (see the module docstring for the protocol).

    ``model`` is a template: it is never trained; fresh modules are built from its
    configuration (``module_factory(**overrides)`` if given). ``trainer_kwargs`` are
    ``lightning.Trainer`` arguments shared by every training (callbacks are deep-copied);
    they must set ``max_epochs`` (the cap) and should hold one ``TrainLossEarlyStopping``.
    ``keep_epoch_weights`` keeps the per-epoch weights after the equal-train-loss lookup.

    Every check of the inputs runs before the first training.
    """
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("seeds: expected at least one seed, e.g. [0, 1, 2]")
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds: expected distinct seeds (each is one paired replicate), got {seeds}")
    if insert_at not in ("best", "cyclic"):
        raise ValueError(f"insert_at: expected 'best' or 'cyclic', got {insert_at!r}")
    if max_growths is not None and max_growths < 1:
        raise ValueError(f"max_growths: expected None or an integer ≥ 1, got {max_growths!r}")
    if depths is not None:
        depths = [int(d) for d in depths]
        if not depths or min(depths) < 1:
            raise ValueError(f"depths: expected final depths ≥ 1 (depth−1 is trained first), got {depths!r}")
        depth_kwarg = resolve_depth_kwarg(model, depth_kwarg)
    if labels is not None and (depths is None or len(labels) != len(depths)):
        raise ValueError(f"labels: expected one label per depth ({depths}), got {labels!r}")
    kwargs = dict(trainer_kwargs or {})
    prepare(datamodule, "compare")
    check_rebuildable(model, module_factory)
    stopping = stopping_rule(kwargs)
    settled = check_schedule(model, datamodule, kwargs, stopping, compute_matched)
    out = Path(output_dir)
    split = split_digest(datamodule)
    if resume:
        _check_logged_split(out / "runs.jsonl", split)
    fp = fingerprint(
        {k: v for k, v in dict(model.hparams).items() if not k.startswith("_")},
        dict(getattr(datamodule, "hparams", {}) or {}),
        {k: v for k, v in kwargs.items() if k not in _COSMETIC},
        {"depth_kwarg": depth_kwarg, "insert_at": insert_at, "max_growths": max_growths,
         "scratch_seed_offset": SCRATCH_SEED_OFFSET, "protocol": PROTOCOL, "split": split},
    )  # fmt: skip
    runner = _Runner(model, datamodule, kwargs, out, depth_kwarg, module_factory, stopping, split, keep_epoch_weights)
    runner.settled = settled
    if depths is not None:
        runner.check_planned_architectures(depths, insert_at)
    out.mkdir(parents=True, exist_ok=True)
    runner.open_logs(fp, resume)
    arms = ("scratch", "growth", "matched") if compute_matched else ("scratch", "growth")
    summary, runs, lookups = [], [], []
    for i, depth in enumerate(depths if depths is not None else [None]):
        per_seed = []
        for seed in seeds:
            if depth is None:
                rows = runner.continuous(seed, max_growths, compute_matched)
            else:
                rows = runner.table_mode(depth, seed, insert_at, compute_matched)
            per_seed.append(rows)
            runs += [_role(r, role, depth) for role, r in rows.items() if r is not None and role != "equal"]
            lookups.append(rows["equal"])
        label = labels[i] if labels is not None else None
        summary.append(summarise(depth, label, per_seed, arms, depth_kwarg))
    result = CompareResult(summary=summary, runs=runs, lookups=lookups, output_dir=out, arms=arms)
    write_files(result, seeds=seeds, depths=depths, depth_kwarg=depth_kwarg, insert_at=insert_at, stopping=stopping)
    return result


# Trainer settings that do not change results (left out of the configuration fingerprint).
_COSMETIC = ("default_root_dir", "logger", "enable_progress_bar", "enable_model_summary", "log_every_n_steps")


# -- checks before any training ---------------------------------------------------------------------
def stopping_rule(trainer_kwargs: dict) -> dict | None:
    """The shared stopping rule: the epoch cap and the configured ``TrainLossEarlyStopping``
    (its settings as a dict), or None with a warning when there is none."""
    cap = trainer_kwargs.get("max_epochs")
    if not isinstance(cap, int) or cap < 1:
        raise ValueError(
            f"trainer.max_epochs: compare needs an epoch cap ≥ 1 (every converged arm stops at its train-loss "
            f"plateau or at the cap, and the cap is reported when it binds); got {cap!r}. Set max_epochs, e.g. 300."
        )
    callbacks = trainer_kwargs.get("callbacks") or []
    callbacks = [callbacks] if not isinstance(callbacks, (list, tuple)) else list(callbacks)
    rules = [cb for cb in callbacks if isinstance(cb, TrainLossEarlyStopping)]
    if len(rules) > 1:
        raise ValueError(f"trainer.callbacks: expected one TrainLossEarlyStopping (one stopping rule), got {len(rules)}")
    if not rules:
        warnings.warn(
            "compare: no growtrain.callbacks.TrainLossEarlyStopping among the trainer callbacks, so no arm is trained "
            f"to convergence: every arm runs to max_epochs={cap} and is reported as capped. Add one (the paper: "
            "start_epoch 180, patience 30, min_delta 1e-4 with max_epochs 300).",
            stacklevel=3,
        )
        return None
    rule = rules[0]
    if rule.start_epoch >= cap:
        raise ValueError(
            f"TrainLossEarlyStopping.start_epoch: expected < trainer.max_epochs={cap} (otherwise it never checks and "
            f"every arm is capped); got {rule.start_epoch}."
        )
    return {"monitor": rule.monitor, "start_epoch": rule.start_epoch, "patience": int(rule.patience),
            "min_delta": abs(float(rule.min_delta)), "max_epochs": cap}  # fmt: skip


def _steps_per_epoch(datamodule: LightningDataModule, trainer_kwargs: dict) -> int | None:
    try:
        n = len(datamodule.train_dataloader())
    except TypeError:
        return None
    limit = trainer_kwargs.get("limit_train_batches")
    if isinstance(limit, int) and not isinstance(limit, bool):
        return min(n, limit)
    if isinstance(limit, float):
        return max(1, int(n * limit))
    return n


def check_schedule(model, datamodule, trainer_kwargs: dict, stopping: dict | None, compute_matched: bool) -> float:
    """Refuse a schedule the matched arm cannot stretch, or one the stopping rule could cut.

    Returns the epoch from which the learning rate is final (0: no schedule; ``inf``: never)."""
    info = inspect_schedule(model)
    unsupported = info.unsupported()
    if compute_matched and unsupported:
        raise ValueError(
            f"lr_scheduler: compare cannot rescale {', '.join(unsupported)} to the compute-matched arm's budget "
            "(known: MultiStepLR, StepLR, CosineAnnealingLR, growtrain.optim.WarmupCosine); the matched arm would "
            "run a truncated or unrelated schedule. Use one of those, or compute_matched=false."
        )
    if not info.schedulers:
        return 0.0
    spe = _steps_per_epoch(datamodule, trainer_kwargs) if any(i == "step" for _, i in info.schedulers) else None
    end = info.end_epoch(spe)
    if stopping is not None and end > stopping["start_epoch"]:
        when = "never settles (it keeps changing the lr)" if math.isinf(end) else f"settles only at epoch {end:g}"
        raise ValueError(
            f"lr_scheduler: {', '.join(info.names)} {when}, but TrainLossEarlyStopping may stop an arm from "
            f"start_epoch={stopping['start_epoch']} on, cutting its schedule short. Fix: start_epoch ≥ the last "
            "milestone (the paper: milestones 100, 150, start_epoch 180), or a schedule that ends (MultiStepLR, "
            "growtrain.optim.WarmupCosine)."
        )
    return end


def _check_logged_split(path: Path, split: str) -> None:
    import json

    if not path.exists():
        return
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if row.get("split") not in (None, split):
            raise ValueError(
                f"datamodule: {path} holds runs on a different data split (digest {row['split']} ≠ {split}: another "
                "split seed, subset or probe size), and runs on different splits are not paired. Use the same "
                "datamodule settings, another output_dir, or resume=false to discard them."
            )


# -- the runs -------------------------------------------------------------------------------------
class _Runner:
    """Trains the arms of one (depth, seed), reusing what the run logs already hold."""

    def __init__(self, model, datamodule, kwargs, out: Path, depth_kwarg, module_factory, stopping, split, keep):
        self.model, self.dm, self.kwargs, self.out = model, datamodule, kwargs, out
        self.depth_kwarg, self.factory, self.stopping, self.split, self.keep = depth_kwarg, module_factory, stopping, split, keep
        self.settled = 0.0  # the epoch from which the lr is final (set by run_compare)

    def open_logs(self, fp: str, resume: bool) -> None:
        self.log = RunLog(self.out / "runs.jsonl", fp, resume)
        self.lookups = RunLog(self.out / "equal.jsonl", fp, resume)

    # -- helpers ----------------------------------------------------------------------------
    def fresh(self, stages: dict, seed: int) -> LightningModule:
        seed_everything(seed + SCRATCH_SEED_OFFSET, workers=True, verbose=False)
        return module_with_stages(self.model, stages, self.depth_kwarg, self.factory)

    def stages_at(self, depth: int) -> dict:
        return stage_sizes(growable_of(reference_module(self.model, self.factory, **{self.depth_kwarg: depth})))

    def check_planned_architectures(self, depths: Sequence[int], insert_at: str) -> None:
        """Before any training: every network a row can produce by growth must be rebuildable
        from scratch with the identical module tree (else the arms are not comparable)."""
        with torch.random.fork_rng(devices=[]):
            for depth in depths:
                base = self.stages_at(depth - 1)
                stages = [_cyclic_stage(base, self.stages_at(depth))] if insert_at == "cyclic" else list(base)
                for stage in stages:
                    grown = module_with_stages(self.model, base, self.depth_kwarg, self.factory)
                    growable_of(grown).grow(f"{stage}.{base[stage]}")
                    target = {s: n + (s == stage) for s, n in base.items()}
                    try:
                        scratch = module_with_stages(self.model, target, self.depth_kwarg, self.factory)
                    except ValueError as err:
                        raise ValueError(f"depths: depth {depth} grown at {stage} cannot be built from scratch: {err}") from err
                    if architecture(scratch) != architecture(grown):
                        raise ValueError(
                            f"model: growing depth {depth - 1} at the end of {stage} gives a different network from "
                            f"building stage sizes {target} from scratch (module trees differ), so Growth and Scratch "
                            "would not be the same architecture. Use a block family whose inserted block matches the "
                            "constructor's, or pass module_factory."
                        )

    def train(self, module, name: str, seed: int, *, growth=False, early_stopping=True, extra=(), trace=True,
              max_growths=None, **overrides) -> tuple:  # fmt: skip
        """One fit on the paired data of ``seed``; returns (trainer, row)."""
        configured = growth_callbacks(self.kwargs.get("callbacks"))

        def keep(cb):
            if not growth and cb in configured:
                return False
            return early_stopping or not isinstance(cb, EarlyStopping)

        meter = ComputeMeter()
        tracer = EpochTrace(self.out / "epochs" / name, reset_at=self.settled) if trace else None
        callbacks = [meter, *extra] + ([tracer] if tracer else [])
        root = self.out / name
        trainer = sibling_trainer(self.kwargs, root, keep=keep, extra_callbacks=callbacks, **overrides)
        if max_growths is not None:  # caps the configured growth callback's copy too: rebuilt (options are read-only)
            trainer.callbacks[:] = [grower_from(cb, max_growths=max_growths) if isinstance(cb, GrowUntilSaturated)
                                    else cb for cb in trainer.callbacks]  # fmt: skip
        data = PairedData(self.dm, seed)
        seed_everything(seed, workers=True, verbose=False)  # augmentation draws: common to the seed's arms
        start = time.perf_counter()
        trainer.fit(module, datamodule=data)
        wall = time.perf_counter() - start
        network = growable_of(module)
        stop = _stop_reason(trainer, budget=not early_stopping)
        row = {
            "seed": seed, "init_seed": seed + SCRATCH_SEED_OFFSET, "split": self.split,
            "epochs": trainer.current_epoch, "steps": meter.steps, "samples": meter.samples, "flops": meter.flops,
            "wall_s": wall, "stop": stop, "capped": stop == "cap",
            "max_epochs": overrides.get("max_epochs", self.kwargs.get("max_epochs")),
            "train": evaluate(module, self.dm, "train", self.kwargs, root / "eval"),
            "test": evaluate(module, self.dm, "test", self.kwargs, root / "eval"),
            "params": sum(p.numel() for p in module.parameters()),
            "blocks": network.depth(), "stages": stage_sizes(network), "arch": architecture_digest(module),
            "growth_log": [dict(r) for r in getattr(network, "growth_log", [])],
            "orders": {str(k): v for k, v in sorted((data.sampler.orders if data.sampler else {}).items())},
            "trace": tracer.records if tracer else [],
            "weights_dir": str(tracer.directory) if tracer else None,
        }  # fmt: skip
        return trainer, row

    def scratch(self, stages: dict, seed: int) -> dict:
        """The from-scratch training of ``stages`` for ``seed`` (base of one row, scratch arm of another)."""
        tag = ",".join(f"{s}={n}" for s, n in stages.items())
        key = f"scratch/{tag}/s{seed}"
        row = self.log.get(key)
        if row is None:
            name = f"scratch_{'-'.join(str(n) for n in stages.values())}_s{seed}"
            module = self.fresh(stages, seed)
            trainer, stats = self.train(module, name, seed)
            ckpt = self.out / "checkpoints" / f"{name}.ckpt"
            trainer.save_checkpoint(ckpt)
            row = self.log.add(key, {"depth": None, "arm": "scratch", "checkpoint": str(ckpt), **stats})
        return row

    def matched(self, key: str, depth, seed: int, scratch: dict, budget_flops: float) -> dict:
        row = self.log.get(key)
        if row is None:
            per_step = scratch["flops"] / max(scratch["steps"], 1)
            steps = max(1, math.ceil(budget_flops / per_step)) if per_step > 0 else max(scratch["steps"], 1)
            steps_per_epoch = scratch["steps"] / max(scratch["epochs"], 1)
            factor = steps / (self.kwargs["max_epochs"] * steps_per_epoch)  # the cap's schedule onto the budget
            module = with_rescaled_schedule(self.fresh(scratch["stages"], seed), factor)
            _, stats = self.train(
                module, _dirname(depth, seed, "matched"), seed, early_stopping=False, trace=False,
                max_steps=steps, max_epochs=None, min_epochs=None, min_steps=None,
            )  # fmt: skip
            row = self.log.add(key, {"depth": depth, "arm": "matched", "budget_flops": budget_flops,
                                     "budget_steps": steps, "schedule_factor": factor, **stats})  # fmt: skip
        return row

    # -- continuous mode: grow during one fit ---------------------------------------------------
    def continuous(self, seed: int, max_growths: int | None, compute_matched: bool) -> dict:
        key = f"growth/auto/s{seed}"
        growth = self.log.get(key)
        if growth is None:
            configured = growth_callbacks(self.kwargs.get("callbacks"))
            # none configured: the paper's protocol (Table 1 grows at converged stages), not the budget default
            extra = [] if configured else [GrowUntilSaturated(schedule="converged", on_saturated="continue")]
            if any(cb.on_saturated == "stop" for cb in configured):
                warnings.warn(
                    "compare: GrowUntilSaturated(on_saturated='stop') ends the growth arm's training when saturated, "
                    "while Scratch trains to the stopping rule; set on_saturated='continue' for the same rule in both.",
                    stacklevel=2,
                )
            seed_everything(seed + SCRATCH_SEED_OFFSET, workers=True, verbose=False)
            module = rebuild_module(self.model, self.factory)  # the configured depth, freshly initialised
            trainer, stats = self.train(module, _dirname(None, seed, "growth"), seed, growth=True, extra=extra,
                                        max_growths=max_growths)  # fmt: skip
            history = [dict(h) for cb in growth_callbacks(trainer.callbacks) for h in cb.history]
            growth = self.log.add(key, {"depth": None, "arm": "growth", "history": history, **stats})
        scratch = self.scratch(growth["stages"], seed)
        _same_architecture(scratch, growth)
        matched = self.matched(f"matched/auto/s{seed}", None, seed, scratch, growth["flops"]) if compute_matched else None
        equal = self.equal(f"equal/auto/s{seed}", growth, scratch)
        return {"base": None, "growth": growth, "scratch": scratch, "matched": matched, "equal": equal}

    # -- table mode: the paper's Table 1 protocol ------------------------------------------------
    def table_mode(self, depth: int, seed: int, insert_at: str, compute_matched: bool) -> dict:
        key = f"growth/d{depth}/s{seed}"
        growth = self.log.get(key)
        base = self.scratch(self.stages_at(depth - 1), seed)
        if growth is None:
            module = load_checkpoint_into(self.fresh(base["stages"], seed), base["checkpoint"])
            seed_everything(seed, workers=True, verbose=False)  # the new block's random half
            insertion = self.insert(module, depth, seed, insert_at)
            _, stats = self.train(module, _dirname(depth, seed, "growth"), seed)
            growth = self.log.add(key, {"depth": depth, "arm": "growth", "insertion": insertion, **stats})
        scratch = self.scratch(growth["stages"], seed)
        _same_architecture(scratch, growth)
        matched = None
        if compute_matched:
            matched = self.matched(f"matched/d{depth}/s{seed}", depth, seed, scratch, base["flops"] + growth["flops"])
        equal = self.equal(f"equal/d{depth}/s{seed}", growth, scratch)
        return {"base": base, "growth": growth, "scratch": scratch, "matched": matched, "equal": equal}

    def insert(self, module, depth: int, seed: int, insert_at: str) -> dict:
        """Insert one zero-output block into the converged base network; what was done, as data."""
        network = growable_of(module)
        if insert_at == "cyclic":
            stage = _cyclic_stage(stage_sizes(network), self.stages_at(depth))
            site = f"{stage}.{len(network.stage(stage))}"
            network.grow(site)
            return {"site": site, "rule": "cyclic"}
        report = measure_saturation(network, self.dm.probe_dataloader(), probe_loss_of(module), projected=False, seed=seed)
        best = report.best_record  # the top site also when the test says "saturated": Table 1 always inserts
        network.grow(best.site, block=best.block)  # the very candidate that was scored
        return {
            "site": best.name, "rule": "best", "gamma": report.gamma, "threshold": report.threshold,
            "saturated": report.saturated, "ag_max": report.ag_max, "error_bound": report.error_bound,
        }  # fmt: skip

    # -- test loss at equal training loss ---------------------------------------------------------
    def equal(self, key: str, growth: dict, scratch: dict) -> dict:
        """Each arm's test loss at its first epoch, once its lr is final, whose train_loss ≤ the
        seed's common target (the larger final train_loss: each arm's last epoch qualifies).

        Why only epochs at the final lr: a growth arm starts near the target (its base is
        converged) and passes it during the high-lr restart; that noisy state is not the
        converged solution the comparison is about."""
        row = self.lookups.get(key)
        if row is not None:
            return row
        arms = {"growth": growth, "scratch": scratch}
        # growth in continuous mode: only epochs with the final architecture can be compared
        traces = {
            a: [r for r in run["trace"] if r.get("train_loss") is not None and r.get("params", run["params"]) == run["params"]]
            for a, run in arms.items()
        }
        if not all(traces.values()):
            return self.lookups.add(key, {"target": None, "reason": "no per-epoch train_loss was logged"})
        settled = {a: [r for r in t if r["epoch"] >= self.settled] for a, t in traces.items()}
        from_epoch = self.settled if all(settled.values()) and math.isfinite(self.settled) else 0
        if from_epoch:
            traces = settled
        target = equal_loss_target(t[-1]["train_loss"] for t in traces.values())
        row = {"target": target, "seed": growth["seed"], "from_epoch": from_epoch}
        for arm, run in arms.items():
            record = first_reaching(traces[arm], target)
            path = Path(run["weights_dir"]) / str(record.get("weights")) if record.get("weights") else None
            entry = {"epoch": record["epoch"], "train_loss_logged": record["train_loss"], "train": None, "test": None}
            if path is not None and path.is_file():
                state = torch.load(path, map_location="cpu", weights_only=True)
                with torch.random.fork_rng(devices=[]):
                    module = module_with_stages(self.model, scratch["stages"], self.depth_kwarg, self.factory)
                if set(state) == set(module.state_dict()):
                    module.load_state_dict(state)
                    root = self.out / "equal_eval"
                    entry["train"] = evaluate(module, self.dm, "train", self.kwargs, root)
                    entry["test"] = evaluate(module, self.dm, "test", self.kwargs, root)
                else:
                    entry["reason"] = "the first epoch at the target had a smaller network (before its last growth)"
            else:
                entry["reason"] = f"weights of epoch {record['epoch']} are not on disk ({path})"
            row[arm] = entry
        row = self.lookups.add(key, row)
        if not self.keep:
            for run in arms.values():
                shutil.rmtree(run["weights_dir"], ignore_errors=True)
        return row


def _role(row: dict, role: str, depth) -> dict:
    """A run as it serves one row: a from-scratch training is the base of depth D (at D−1)
    and the scratch arm of depth D−1."""
    shown = {**row, "arm": role}
    if depth is not None:
        shown["depth"] = depth - 1 if role == "base" else depth
    return shown


def _stop_reason(trainer, budget: bool) -> str:
    if budget:
        return "budget"
    stoppers = [cb for cb in trainer.callbacks if isinstance(cb, EarlyStopping)]
    if trainer.should_stop and any(cb.wait_count >= cb.patience or cb.stopped_epoch > 0 for cb in stoppers):
        return "plateau"
    if trainer.should_stop:
        return "callback"
    cap = trainer.max_epochs
    return "cap" if cap is not None and cap > 0 and trainer.current_epoch >= cap else "other"


def _cyclic_stage(now: dict, target: dict) -> str:
    """The one stage that the depth hyper-parameter's rule extends from ``now`` to ``target``."""
    grown = [s for s in now if target.get(s, 0) == now[s] + 1]
    if len(grown) != 1 or any(target[s] != now[s] for s in now if s not in grown):
        raise ValueError(f"insert_at: 'cyclic' needs depths one block apart; stages {now} → {target}")
    return grown[0]


def _same_architecture(scratch: dict, grown: dict) -> None:
    if scratch["arch"] != grown["arch"]:
        raise RuntimeError(
            f"scratch: the rebuilt architecture (digest {scratch['arch']}) differs from the grown one ({grown['arch']}, "
            f"stages {grown['stages']}); refusing to compare different networks."
        )


def _dirname(depth, seed: int, arm: str) -> str:
    return f"{'auto' if depth is None else f'd{depth}'}_s{seed}_{arm}"
