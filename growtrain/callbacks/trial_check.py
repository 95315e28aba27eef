"""``BlockTrials``: the block-only trial decision of ``GrowUntilSaturated`` (``decision="trial"``).

A collaborator with its own state, not a mixin: the callback hands it the trainer, the module,
the network and the check's first-order report, and gets back a verdict (``growtrain.trial``
decides). Per check it tries up to ``TRIAL_SITES`` (3) sites — the best first-order site of each
stage, best first — and for each: a fresh zero-output block goes in, is trained alone for
``Trial.epochs`` of the training loader's batches (as a training step receives them; Adam, cosine
to 0), and each probe sample's loss is compared with its loss before; then the block is taken out
again, so the network is bit-for-bit what it was (the other parameters were frozen, every other
module in eval mode, the trial's optimizer is its own).

What is scored: the probe alone — samples split off the training data by dataset index, which
neither the network nor the trial ever trains on. ``check_probe_independent`` refuses a probe
that shares a dataset index with the training loader, at the start of training and again at every
trial (a loader reloaded since could). Training samples are never scored: the network before the
trial was trained on them, and with augmentation a new crop of a sample cannot be told from another
sample (docs/decision.md, "The decision study").

Under DDP every rank trains the same block (its gradients are averaged) and rank 0's verdict is
broadcast, so every rank takes the same action. Under FSDP2 the trial block is sharded like its
neighbours for the trial (FSDP gathers its parameters and averages its gradients, with the
neighbours' mixed-precision policy) and taken out again with its unit; the probe passes are
collectives, run by every rank alike.
"""

from __future__ import annotations

import math
import time
from typing import Any, Iterator

import torch
from lightning.pytorch import LightningModule, Trainer
from torch import nn

from growtrain import fsdp
from growtrain.callbacks.probe_check import check_probe_independent
from growtrain.callbacks.probe_data import Converted, ProbeView, as_training_batch, per_sample_losses
from growtrain.callbacks.progress import Steps, counted, progress_for
from growtrain.trial import (
    MIN_TRIAL_STEPS, at_chance, constant_prediction_loss, train_block, trial_test, trial_verdict,
)  # fmt: skip

__all__ = ["BlockTrials", "trial_candidates"]


def trial_candidates(report: Any, limit: int) -> list[str]:
    """The best first-order site of each stage (by lower bound, else ``‖ĝ‖``), best first."""
    key = (lambda r: r.lower) if all(r.lower is not None for r in report.sites) else (lambda r: r.grad_norm)
    best: dict[str, Any] = {}
    for r in report.sites:
        stage = r.name.rpartition(".")[0] or r.name
        if stage not in best or key(r) > key(best[stage]):
            best[stage] = r
    return [r.name for r in sorted(best.values(), key=key, reverse=True)][:limit]


class BlockTrials:
    """Runs one check's trials; keeps the seconds spent and the number of trials (checkpointed)."""

    key = "trial"  # the check record's entry (history[i]["trial"])

    def judge(self, inputs: Any) -> tuple[Any, list[str], dict]:
        """The decision's interface (``rule_check.FirstOrderRule``): trials at the best first-order
        site of each stage → the verdict, the site to grow at, and the record's ``trial`` entry."""
        verdict, trials = self.run(inputs.trainer, inputs.pl_module, inputs.network, inputs.report, inputs.probe,
                                   inputs.loss_fn, inputs.level)  # fmt: skip
        entry = {"saturated": verdict.saturated, "certified": verdict.certified, "site": verdict.site,
                 "lower_frac": verdict.score, "min_gain": verdict.margin, "reason": verdict.reason, "trials": trials}
        return verdict, [verdict.site] if verdict.site else [], entry

    def __init__(self, *, epochs: float, lr: float, sites: int, min_gain: float, seed: int):
        self.epochs, self.lr, self.sites = epochs, lr, sites
        self.min_gain, self.seed = min_gain, seed
        self.trials = 0  # trials run so far: seeds each trial's block and bootstrap
        self.seconds = 0.0  # wall time in trials, this process

    def state_dict(self) -> dict:
        return {"trials": self.trials}

    def load_state_dict(self, state: dict) -> None:
        self.trials = int(state.get("trials", 0))

    # -- batches -------------------------------------------------------------------------
    @staticmethod
    def _train_batches(trainer: Trainer) -> Iterator[tuple[Any, Any]]:
        """The training loader's batches as a training step receives them (``as_training_batch``:
        the precision conversion and the batch hooks, augmentation included), pass after pass:
        what the trial block trains on. None of them is scored (the probe is)."""
        loader = trainer.train_dataloader
        if loader is None:
            raise RuntimeError("decision='trial': the trainer has no training dataloader to train a trial block on")
        while True:
            empty = True
            for batch in loader:
                empty = False
                batch = as_training_batch(trainer, batch)
                yield batch[0], batch[-1]
            if empty:
                return

    def _steps(self, trainer: Trainer) -> int:
        batches = trainer.num_training_batches
        if not isinstance(batches, int) or not math.isfinite(batches) or batches < 1:
            batches = len(trainer.train_dataloader)
        return max(MIN_TRIAL_STEPS, int(round(self.epochs * batches)))  # small data: enough steps to learn

    # -- one check -----------------------------------------------------------------------
    def run(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module, report: Any, probe: Any,
            loss_fn: Any, level: float) -> tuple[Any, list[dict]]:  # fmt: skip
        """Try the candidate sites; return ``(verdict, trials)`` (``growtrain.trial.trial_verdict``).

        Each phase (the probe's losses before, each trial's training and its scoring on the probe)
        shows in the trainer's progress bar (``growtrain.callbacks.progress``): nothing when bars
        are off or on ranks other than 0."""
        # checked at the start of training too; the loader the trials train on may have been reloaded since
        # (reload_dataloaders_every_n_epochs), and a probe sample trained on would be scored in-sample
        check_probe_independent(trainer, probe)
        start = time.perf_counter()
        device = next(network.parameters()).device
        view = ProbeView(pl_module, network)
        sites = trial_candidates(report, self.sites)
        steps = self._steps(trainer)
        sync = self._grad_sync(trainer)
        trials = []
        with progress_for(trainer) as step:
            with trainer.precision_plugin.forward_context():  # scored in the precision the run trains in
                probe_before = per_sample_losses(view, Converted(counted(probe, step, "trials: probe losses"),
                                                                 trainer), loss_fn, device)  # fmt: skip
            for k, site in enumerate(sites):
                label = f"trial {site} ({k + 1}/{len(sites)})"
                trials.append(self._one(trainer, pl_module, network, view, site, probe, probe_before, loss_fn,
                                        device, steps, sync, level / max(1, len(sites)), step, label))  # fmt: skip
        verdict = trial_verdict(trials, self.min_gain, chance=self._chance(trainer, probe, probe_before, loss_fn))
        if trainer.world_size > 1:  # one decision on every rank: rank 0's
            verdict, trials = trainer.strategy.broadcast((verdict, trials), src=0)
        self.seconds += time.perf_counter() - start
        return verdict, trials

    def _one(self, trainer, pl_module, network, view, site, probe, probe_before, loss_fn, device, steps, sync,
             level, step: Steps, label: str) -> dict:  # fmt: skip
        seed = self.seed * 100003 + self.trials
        self.trials += 1
        log_len = len(network.growth_log)
        block = network.grow(site, network.new_block(site, seed=seed))
        batches = self._train_batches(trainer)
        # FSDP2: the trial block is sharded like its neighbours (its own unit, the neighbours' mixed-precision
        # policy), so FSDP gathers it and reduce-scatters its gradients; it is taken out again below
        try:
            sharded = bool(fsdp.shard_like_neighbours(network, [block], root=pl_module))
            if sharded:
                fsdp.reshard_all(pl_module)  # the trial's Adam takes the block's sharded DTensor parameters
            train = f"{label}: train block"
            fit = train_block(view, pl_module, block, batches, loss_fn, steps=steps, lr=self.lr,
                              context=trainer.precision_plugin.forward_context,  # as a training step's forward
                              # the run's own loss scaling (16-mixed); never under 16-true (half-precision weights)
                              loss_scale=getattr(trainer.precision_plugin, "scaler", None) is not None,
                              sync_grads=None if sharded else sync,  # FSDP2 already averaged them
                              any_rank=self._any_rank(trainer),
                              progress=lambda done, total: step(done, total, train))  # fmt: skip
            if fit["diverged"]:
                return {"site": site, "diverged": True, "steps": fit["steps"]}
            scored = Converted(counted(probe, step, f"{label}: score on the probe"), trainer)
            with trainer.precision_plugin.forward_context():
                probe_after = per_sample_losses(view, scored, loss_fn, device)
        finally:
            batches.close()  # ends the training loader's iterator now (its workers), not at garbage collection
            network.undo_growth([block], log_len)  # bit-for-bit the network before the trial
            fsdp.reinit_root(pl_module)  # FSDP2: the root forgets the trial block's unit (a no-op otherwise)
        test = trial_test(probe_before, probe_after, min_gain=self.min_gain, level=level, seed=seed)
        return {"site": site, "diverged": False, "steps": fit["steps"], "n_probe": probe_before.numel(), **test}

    @staticmethod
    def _chance(trainer: Trainer, probe: Any, losses: torch.Tensor, loss_fn: Any) -> str | None:
        """Why the network is at chance level (class targets only), else ``None``. The reference
        is the best constant prediction's loss under the module's own loss (a loss × 10 has a
        reference × 10), not the label entropy in nats."""
        targets = [batch[-1] for batch in Converted(probe, trainer)]
        if not targets or not all(isinstance(t, torch.Tensor) and t.dim() == 1 for t in targets):
            return None
        reference = constant_prediction_loss(torch.cat([t.cpu() for t in targets]), loss_fn)
        loss = float(losses.mean()) if losses.numel() else float("nan")
        if not at_chance(loss, reference):
            return None
        return (f"the network is at chance level (probe loss {loss:.4g} ≥ 90 % of {reference:.4g}, the loss of "
                "predicting the label frequencies): it has not learned, so depth is not the question — train "
                "longer or check the data and learning rate")  # fmt: skip

    @staticmethod
    def _any_rank(trainer: Trainer):
        if trainer.world_size <= 1:
            return None
        return lambda flag: trainer.strategy.reduce_boolean_decision(flag, all=False)

    @staticmethod
    def _grad_sync(trainer: Trainer):
        if trainer.world_size <= 1:
            return None

        def sync(grads):
            for g in grads:
                torch.distributed.all_reduce(g)
                g.div_(trainer.world_size)

        return sync
