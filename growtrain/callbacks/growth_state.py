"""What ``GrowUntilSaturated`` carries through a checkpoint: counters, history, the stage anneal,
the realized-gain reference (per-sample losses and their samples' fingerprints) and the
restore snapshot. A mixin: ``_reset_state`` / ``state_dict`` / ``load_state_dict``.
"""

from __future__ import annotations

from typing import Any

from growtrain.callbacks import telemetry

__all__ = ["GrowthStateMixin"]


class GrowthStateMixin:
    def _reset_state(self) -> None:
        self.history: list[dict] = []
        self.checks = 0  # probe checks run (seeds candidate blocks)
        self.growths = 0  # checks that grew
        self.inserted = 0  # blocks inserted by this callback
        self.alpha_index = 0  # α-spending tests used
        self.best: float | None = None
        self.wait = 0
        self.cooldown_left = 0
        self.epochs_since_check = 0
        self.stage_epochs = 0  # epochs since the start or the last growth
        self.trained_since_check = 0  # training samples (all ranks) since the last check
        self.finished: str | None = None
        self.stop_reason: str | None = None
        self.restart_pending = False
        self.start_depth: int | None = None
        self.anneal_done: int | None = None  # epochs of the running anneal done (None: not annealing)
        self.anneal_kind: str | None = None  # "stage" (before a check) or "final" (after growth ended)
        self.anneal_base_lrs: list[float] = []
        self.gain_reference: list[float] | None = None  # per-sample probe losses at the last growth
        self.gain_signature: list[float] | None = None  # ... and the fingerprints of those probe samples
        self.snapshot: dict | None = None  # host copy of the network before the last growth (restore_best)

    # -- checkpoint state ------------------------------------------------------------------
    _STATE_INTS = ("checks", "growths", "inserted", "alpha_index", "wait", "cooldown_left", "epochs_since_check",
                   "stage_epochs", "trained_since_check")  # fmt: skip

    def state_dict(self) -> dict[str, Any]:
        state = {k: getattr(self, k) for k in self._STATE_INTS}
        state.update(history=self.history, best=self.best, finished=self.finished, stop_reason=self.stop_reason,
                     restart_pending=self.restart_pending, start_depth=self.start_depth,
                     anneal_done=self.anneal_done, anneal_kind=self.anneal_kind,
                     anneal_base_lrs=self.anneal_base_lrs, gain_reference=self.gain_reference,
                     gain_signature=self.gain_signature)  # fmt: skip
        state = telemetry.plain(state)
        state["snapshot"] = self.snapshot  # tensors: torch.save keeps them as they are
        if getattr(self, "_trials", None) is not None:  # the trial collaborator's own state
            state["trials"] = self._trials.state_dict()
        if getattr(self, "_window", None) is not None:  # the window rule's kept probe losses
            state["window"] = self._window.state_dict()
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._reset_state()
        self.history = [dict(h) for h in state_dict.get("history", [])]
        for key in self._STATE_INTS:
            setattr(self, key, int(state_dict.get(key, 0)))
        self.best = state_dict.get("best")
        self.finished = state_dict.get("finished")
        self.stop_reason = state_dict.get("stop_reason")
        self.restart_pending = bool(state_dict.get("restart_pending", False))
        self.start_depth = state_dict.get("start_depth")
        self.anneal_done = state_dict.get("anneal_done")
        self.anneal_kind = state_dict.get("anneal_kind", "final" if self.anneal_done is not None else None)
        self.anneal_base_lrs = [float(v) for v in state_dict.get("anneal_base_lrs", [])]
        reference = state_dict.get("gain_reference")
        self.gain_reference = None if reference is None else [float(v) for v in reference]
        signature = state_dict.get("gain_signature")
        self.gain_signature = None if signature is None else [float(v) for v in signature]
        self.snapshot = state_dict.get("snapshot")
        if getattr(self, "_window", None) is not None:
            self._window.load_state_dict(state_dict.get("window", {}))
        if getattr(self, "_trials", None) is not None:
            self._trials.load_state_dict(state_dict.get("trials", {}))
