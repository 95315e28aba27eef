"""The stage anneal of ``lr_schedule="anneal"``: a converged stage is cosine-annealed before its
check, and the final network after growth ends (``on_saturated="anneal"``).

A mixin of ``GrowUntilSaturated``: the state (``anneal_done``, ``anneal_kind``,
``anneal_base_lrs``) lives in the callback and its checkpoint; these methods only move it.
"""

from __future__ import annotations

import math

from lightning.pytorch import LightningModule, Trainer

__all__ = ["StageAnnealMixin"]


class StageAnnealMixin:
    """``_start_anneal`` / ``_set_anneal_lr`` (each epoch) / ``_check_annealed`` (its end)."""

    def _check_annealed(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """End of a stage anneal: check the annealed network; back to the constant rate for a new
        stage (after a growth) or for ``on_saturated="continue"``."""
        # The rate goes back up before the check: the new block's groups copy their reference
        # group's current rate, so they start the new stage at the constant rate too. (After a
        # saturated check the run stops, or continues at that rate with on_saturated="continue".)
        optimizer = self._optimizer_for(trainer, self._network)
        if optimizer is not None:
            for group, base in zip(optimizer.param_groups, self.anneal_base_lrs):
                group["lr"] = base
        self.anneal_done, self.anneal_kind, self.anneal_base_lrs = None, None, []
        self._check(trainer, pl_module, annealed=True)

    def _start_anneal(self, trainer: Trainer, kind: str) -> bool:
        optimizer = self._optimizer_for(trainer, self._network)
        if optimizer is None:
            return False
        self.anneal_done, self.anneal_kind = 0, kind
        self.anneal_base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        return True

    def _set_anneal_lr(self, trainer: Trainer) -> None:
        """An anneal (stage or final): ``lr = base · ½(1 + cos(π·(k+1)/(T+1)))`` in epoch ``k`` of
        ``T``; the network's schedulers are set aside, so the user's schedule does not fight it."""
        optimizer = self._optimizer_for(trainer, self._network)
        if optimizer is None:
            return
        configs = trainer.strategy.lr_scheduler_configs
        trainer.strategy.lr_scheduler_configs = [c for c in configs if c.scheduler.optimizer is not optimizer]
        factor = 0.5 * (1.0 + math.cos(math.pi * (self.anneal_done + 1) / (self.anneal_epochs + 1)))
        for group, base in zip(optimizer.param_groups, self.anneal_base_lrs):
            group["lr"] = base * factor
