"""``decision="window"``: the periodic schedule's stop rule, as a collaborator of the callback.

Each check hands it the probe's per-sample losses (and their samples' fingerprints); it keeps
them, pairs them with the latest kept check at least ``window`` epochs (or optimizer steps)
back, and returns the
verdict of growtrain.window. Its state (the kept losses) travels in the callback's checkpoint, so
a resumed fit compares with the same reference.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from growtrain.callbacks.probe_data import Fingerprinted, ProbeView, probe_sample_losses
from growtrain.callbacks.sharded import is_model_parallel
from growtrain.decision import Verdict
from growtrain.gain import signature_mismatch
from growtrain.saturation_report import best_scored_site
from growtrain.window import window_prune, window_reference, window_test, window_verdict, window_waits

__all__ = ["WindowRule", "probe_losses"]


def probe_losses(trainer: Any, pl_module: Any, network: Any, probe: Any, loss_fn: Any, pass_losses: list | None,
                 pass_probe: Fingerprinted | None) -> tuple[torch.Tensor, torch.Tensor, float]:  # fmt: skip
    """The probe's per-sample losses now (on the host), their samples' fingerprints and the seconds
    an extra pass took (0 without one).

    On one process they come from the probe pass's own forward (``pass_losses``, ``pass_probe``:
    the ghosts output zero). Under DDP each rank scores its shard of ``probe`` (the whole probe
    loader) in one extra forward pass and the shards are all-gathered in the probe's order
    (``probe_sample_losses``; under FSDP2 every rank scores the whole probe and takes rank 0's), so
    the stored losses and the decision are the same on every rank and after a resume."""
    seconds = 0.0
    if pass_losses and pass_probe is not None:  # one process: the pass's own forward
        losses = torch.cat(pass_losses).cpu()  # one device-to-host copy per check
        signatures = pass_probe.signatures
    else:  # DDP: each rank scores its shard, all-gathered (FSDP2: the whole probe, a collective forward)
        start = time.perf_counter()
        device = next(network.parameters()).device
        losses, signatures = probe_sample_losses(trainer, ProbeView(pl_module, network), probe, loss_fn, device,
                                                 fingerprints=True, collective=is_model_parallel(trainer.strategy))
        seconds = time.perf_counter() - start
    if signatures is None or signatures.numel() != losses.numel():
        raise RuntimeError(f"probe: {losses.numel()} per-sample losses but fingerprints of "
                           f"{None if signatures is None else signatures.numel()} samples; the probe pass was cut short")
    return losses.cpu(), signatures.cpu(), seconds


class WindowRule:
    """The kept per-sample probe losses of the periodic schedule's checks, and their verdict."""

    key = "window"  # the check record's entry (history[i]["window"])

    def __init__(self, *, window: int, min_gain: float, seed: int = 0, unit: str = "epoch"):
        self.window, self.min_gain, self.seed = int(window), float(min_gain), int(seed)
        self.unit = unit  # what `window` counts: "epoch", or "step" (optimizer steps: min_steps_between_checks)
        # {"epoch", "step", "losses", "signature"}: lists of floats (plain, for the checkpoint)
        self.entries: list[dict] = []
        self.seconds = 0.0  # wall time of extra probe passes (under DDP), this process

    def judge(self, inputs: Any) -> tuple[Verdict, list[str], dict]:
        """The decision's interface (``rule_check.FirstOrderRule``): the probe's per-sample losses now
        against the window's reference → the verdict, the best first-order site while growth goes
        on, and the record's ``window`` entry."""
        losses, signatures, seconds = probe_losses(inputs.trainer, inputs.pl_module, inputs.network, inputs.probe,
                                                   inputs.loss_fn, inputs.pass_losses, inputs.pass_probe)  # fmt: skip
        self.seconds += seconds
        verdict, entry = self.decide(losses, signatures, epoch=inputs.trainer.current_epoch, level=inputs.level,
                                     check=inputs.check, step=inputs.trainer.global_step)  # fmt: skip
        if window_waits(verdict):  # nothing compared: the callback grows nothing and trains on
            return verdict, [], {**entry, "wait": True}
        best = None if verdict.saturated else best_scored_site(inputs.report)
        return verdict, [best] if best else [], entry

    def decide(self, losses: torch.Tensor, signatures: torch.Tensor, *, epoch: int, level: float,
               check: int, step: int | None = None) -> tuple[Verdict, dict]:  # fmt: skip
        """The verdict at this check and the record's ``window`` entry; keeps today's losses.
        ``step``: the optimizer steps so far (what the window counts with ``unit="step"``)."""
        if self.unit == "step" and step is None:
            raise ValueError("step: the window counts optimizer steps (min_steps_between_checks); "
                             "pass the check's step")
        now = epoch if self.unit == "epoch" else int(step)
        reference = window_reference(self.entries, now, self.window, self.unit)
        test = None
        if reference is not None:
            before = torch.tensor(reference["losses"], dtype=torch.float64)
            stored = torch.tensor(reference["signature"], dtype=torch.float64)
            mismatch = signature_mismatch(stored, signatures.double().cpu())
            if mismatch is None and before.shape != losses.shape:
                mismatch = f"the probe had {before.numel()} samples at epoch {reference['epoch']}, {losses.numel()} now"
            if mismatch is not None:
                raise ValueError(
                    f"probe: the window rule pairs every probe sample's loss at epoch {reference['epoch']} with its loss "
                    f"now, but {mismatch}; no decision was made. Fix: keep the probe fixed — the same samples in the same "
                    "order at every check (probe_dataloader() builds one)."
                )
            # the bootstrap's seed follows the check index: the same losses give the same bound after a resume
            test = window_test(before, losses.double().cpu(), min_gain=self.min_gain, level=level,
                               seed=self.seed * 1000 + check)  # fmt: skip
        verdict = window_verdict(test, window=self.window, epoch=now,
                                 reference_epoch=None if reference is None else int(reference[self.unit]),
                                 min_gain=self.min_gain, unit=self.unit)  # fmt: skip
        self.entries.append({"epoch": int(epoch), "step": None if step is None else int(step),
                             "losses": losses.double().cpu().tolist(),
                             "signature": signatures.double().cpu().tolist()})  # fmt: skip
        self.entries = window_prune(self.entries, now, self.window, self.unit)
        record = {"saturated": verdict.saturated, "certified": verdict.certified, "reason": verdict.reason,
                  "window": self.window, "unit": self.unit,
                  "reference_epoch": None if reference is None else int(reference["epoch"]), "epoch": int(epoch),
                  "reference_step": None if reference is None else reference.get("step"), "step": step,
                  "min_gain": self.min_gain, "loss_now": float(losses.double().mean())}  # fmt: skip
        if test is not None:
            record.update({k: test[k] for k in ("gain_frac", "lower_frac", "upper_frac", "loss_before", "n", "level")})
        return verdict, record

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [dict(e) for e in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = [dict(e) for e in state.get("entries", [])]
