"""The realized-gain verdict and the hand-over of the best certified network (``min_gain``,
``restore_best``): a mixin of ``GrowUntilSaturated``.

At each check after a growth the probe's per-sample losses are compared, sample by sample,
with those at that growth (``growtrain.gain``: bootstrap-t bound, fingerprints for pairing);
an unpaid growth that ends the run is undone from the host snapshot (``restore.py``), and the
handed-over network's metrics are measured again and logged (``remeasure.py``).
"""

from __future__ import annotations

import time
from typing import Any

import torch
from lightning.pytorch import LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from growtrain import decision as dec
from growtrain.callbacks.probe_data import Converted, Fingerprinted, ProbeView, per_sample_losses, random_order
from growtrain.callbacks.remeasure import publish, remeasure, rewind_checkpoints
from growtrain.callbacks.restore import restore_snapshot
from growtrain.gain import gain_test, signature_mismatch

__all__ = ["RealizedGainMixin"]


class RealizedGainMixin:
    """Probe-order refusal, the gain verdict, the restore, the α-spending level."""

    def _refuse_random_probe(self, loader: Any, name: str) -> None:
        """min_gain pairs each probe sample's loss across checks: a shuffling probe is refused here
        (a probe that changes otherwise is refused at the check, by its samples' fingerprints)."""
        why = random_order(loader) if self.min_gain is not None else None
        if why is not None:
            raise ValueError(
                f"{name}: min_gain compares every probe sample's loss at the last growth with its loss now, so the "
                f"probe must yield the same samples in the same order at every check, but {why}. Fix: build the "
                "probe loader with shuffle=False (the order does not matter to the saturation score), or pass "
                "min_gain=None."
            )

    def _probe_losses(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module
                      ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """The probe's per-sample losses now (on the host) and their samples' fingerprints.

        On one process they come from the probe pass's own forward (the ghosts output zero).
        Under DDP every rank scores the whole probe (not its shard) in one extra forward pass and
        takes rank 0's vector, so the stored losses and the decision are the same on every rank
        and after a resume."""
        if self._pass_losses and self._pass_probe is not None:  # one process: the pass's own forward
            losses = torch.cat(self._pass_losses).cpu()  # one device-to-host copy per check
            signatures = self._pass_probe.signatures
        else:
            start = time.perf_counter()
            device = next(network.parameters()).device
            probe = Fingerprinted(self._probe_loader(trainer, shard=False))
            losses = per_sample_losses(ProbeView(pl_module, network), Converted(probe, trainer), self._loss, device)
            signatures = probe.signatures
            if trainer.world_size > 1:  # one decision on every rank, even if a GPU kernel is not bit-reproducible
                losses = trainer.strategy.broadcast(losses, src=0)
                signatures = trainer.strategy.broadcast(signatures, src=0)
            self.probe_seconds += time.perf_counter() - start
        self._pass_losses, self._pass_probe = None, None
        if signatures is None or signatures.numel() != losses.numel():
            raise RuntimeError(f"probe: {losses.numel()} per-sample losses but fingerprints of "
                               f"{None if signatures is None else signatures.numel()} samples; the probe pass was cut short")
        return losses.cpu(), signatures.cpu()

    def _last_growth_paid(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module,
                          level: float) -> tuple[torch.Tensor, torch.Tensor, dict | None]:  # fmt: skip
        """The probe's per-sample losses now, their samples' fingerprints and, after a growth, the
        verdict on that growth (:meth:`_probe_losses`)."""
        losses, signatures = self._probe_losses(trainer, pl_module, network)
        if self.gain_reference is None:
            return losses, signatures, None
        before = torch.tensor(self.gain_reference, dtype=torch.float64)
        stored = torch.tensor(self.gain_signature, dtype=torch.float64) if self.gain_signature is not None else None
        mismatch = signature_mismatch(stored, signatures) if stored is not None else None
        if mismatch is None and before.shape != losses.shape:
            mismatch = f"the probe had {before.numel()} samples at the last growth and has {losses.numel()} now"
        if mismatch is not None:
            raise ValueError(
                f"probe: min_gain pairs every probe sample's loss at the last growth with its loss now, but {mismatch}; "
                "no decision was made. Fix: keep the probe fixed — the same samples in the same order at every check "
                "(a DataLoader with shuffle=False over a fixed dataset, as probe_dataloader() builds) — or pass "
                "min_gain=None."
            )
        # the bootstrap's seed follows the check index: the same losses give the same bound on
        # every rank and after a resume
        gain = gain_test(before, losses, min_gain=self.min_gain, level=level, seed=self.seed * 1000 + self.checks)
        return losses, signatures, {**dec.gain_verdict(gain).to_dict(), **gain}

    def _restore(self, trainer: Trainer, pl_module: LightningModule, network: nn.Module) -> dict:
        """Undo the growth that did not pay: the network of the check before it, restored."""
        snap = self.snapshot
        done = restore_snapshot(snap, pl_module, network, self._optimizer_for(trainer, network),
                                trainer.strategy.lr_scheduler_configs)  # fmt: skip
        self._rewrap_ddp(trainer)
        self.snapshot = None
        what = (f"restored the network of check {snap['check']} (epoch {snap['epoch']}, depth {snap['depth']}): "
                f"removed the unpaid block(s) at {', '.join(map(str, done['removed_sites']))} with their weights, "
                "BatchNorm statistics and optimizer groups (restore_best=True)")  # fmt: skip
        rank_zero_info(f"GrowUntilSaturated: {what}")
        # The epoch's logged numbers are the removed network's (validation ran before this
        # check): measure the handed-over one, and log that for the checkpoint callback, the
        # loggers and the summary (remeasure.py)
        metrics = remeasure(trainer, pl_module, ProbeView(pl_module, network), self._loss)
        published = publish(pl_module, metrics)
        # the checkpoint files written since the growth hold the removed network: deleted here; the
        # restored one is saved once the check's record is complete (growth.py, remeasure.py)
        checkpoints, self._rewound = (rewind_checkpoints(trainer, snap.get("checkpoints") or {}, metrics)
                                      if published else ([], []))  # fmt: skip
        for line in checkpoints:
            rank_zero_info(f"GrowUntilSaturated: {line}")
        if metrics:
            shown = ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items()))
            rank_zero_info(f"GrowUntilSaturated: the restored network, re-measured in eval mode: {shown}")
        return {**done, "check": snap["check"], "epoch": snap["epoch"], "step": snap["step"], "depth": snap["depth"],
                "annealed": snap.get("annealed", False), "what": what, "metrics": metrics,
                "metrics_logged": published, "checkpoints": checkpoints}  # fmt: skip

    def _level(self) -> float:
        """The level of the next test (``alpha_spending``); counts the test."""
        level = self.alpha
        if self.alpha_spending != "constant":
            from growtrain.crossfit import alpha_schedule

            level = float(alpha_schedule(self.alpha, self.alpha_index, scheme=self.alpha_spending))
        self.alpha_index += 1
        return level
