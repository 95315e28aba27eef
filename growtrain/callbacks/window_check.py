"""``decision="window"``: the periodic schedule's stop rule, as a collaborator of the callback.

Each check hands it the probe's per-sample losses (and their samples' fingerprints); it keeps
them, pairs them with the latest kept check at least ``window`` epochs back, and returns the
verdict of growtrain.window. Its state (the kept losses) travels in the callback's checkpoint, so
a resumed fit compares with the same reference.
"""

from __future__ import annotations

from typing import Any

import torch

from growtrain.decision import Verdict
from growtrain.gain import signature_mismatch
from growtrain.window import window_prune, window_reference, window_test, window_verdict

__all__ = ["WindowRule"]


class WindowRule:
    """The kept per-sample probe losses of the periodic schedule's checks, and their verdict."""

    def __init__(self, *, window: int, min_gain: float, seed: int = 0):
        self.window, self.min_gain, self.seed = int(window), float(min_gain), int(seed)
        self.entries: list[dict] = []  # {"epoch", "losses", "signature"}: lists of floats (plain, for the checkpoint)

    def decide(self, losses: torch.Tensor, signatures: torch.Tensor, *, epoch: int, level: float,
               check: int) -> tuple[Verdict, dict]:  # fmt: skip
        """The verdict at this check and the record's ``window`` entry; keeps today's losses."""
        reference = window_reference(self.entries, epoch, self.window)
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
        verdict = window_verdict(test, window=self.window, epoch=epoch,
                                 reference_epoch=None if reference is None else int(reference["epoch"]),
                                 min_gain=self.min_gain)  # fmt: skip
        self.entries.append({"epoch": int(epoch), "losses": losses.double().cpu().tolist(),
                             "signature": signatures.double().cpu().tolist()})  # fmt: skip
        self.entries = window_prune(self.entries, epoch, self.window)
        record = {"saturated": verdict.saturated, "certified": verdict.certified, "reason": verdict.reason,
                  "window": self.window,
                  "reference_epoch": None if reference is None else int(reference["epoch"]), "epoch": int(epoch),
                  "min_gain": self.min_gain, "loss_now": float(losses.double().mean())}  # fmt: skip
        if test is not None:
            record.update({k: test[k] for k in ("gain_frac", "lower_frac", "upper_frac", "loss_before", "n", "level")})
        return verdict, record

    def state_dict(self) -> dict[str, Any]:
        return {"entries": [dict(e) for e in self.entries]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.entries = [dict(e) for e in state.get("entries", [])]
