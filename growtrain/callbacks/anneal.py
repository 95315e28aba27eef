"""``LrAnneal``: the cosine anneals the callback drives — a converged stage's before its check
(``lr_schedule="anneal"``) and the final network's after growth ends (``on_saturated="anneal"``).

A collaborator of ``GrowUntilSaturated`` with its own state (``anneal_done``, ``anneal_kind``,
``anneal_base_lrs``, in the callback's checkpoint).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from lightning.pytorch import Trainer

__all__ = ["LrAnneal", "anneal_factor", "refuse_scheduler", "schedulers_of"]


def schedulers_of(trainer: Trainer, optimizer: torch.optim.Optimizer | None) -> list[str]:
    """The class names of the trainer's schedulers bound to ``optimizer`` (by identity)."""
    return [type(c.scheduler).__name__ for c in trainer.strategy.lr_scheduler_configs
            if optimizer is not None and c.scheduler.optimizer is optimizer]  # fmt: skip


def refuse_scheduler(trainer: Trainer, optimizer: torch.optim.Optimizer | None) -> None:
    """``lr_schedule="anneal"`` drives the rate itself: a scheduler on the network's optimizer would
    fight it, so it is refused at the start of training (before any step)."""
    schedulers = schedulers_of(trainer, optimizer)
    if schedulers:
        raise ValueError(
            f"lr_schedule: 'anneal' drives the learning rate itself (constant per stage, an anneal before each "
            f"check), but the network's optimizer has a scheduler ({', '.join(schedulers)}) that would fight it. "
            "Fix: return no lr_scheduler from configure_optimizers, or use lr_schedule='restart' to restart "
            "your schedule per stage."
        )


def anneal_factor(done: int, epochs: int) -> float:
    """The rate's factor in epoch ``done`` of an anneal over ``epochs``: ``½(1 + cos(π·(k+1)/(T+1)))``
    (never 0 inside the anneal, 0 only one epoch past its end)."""
    return 0.5 * (1.0 + math.cos(math.pi * (done + 1) / (epochs + 1)))


class LrAnneal:
    """The running anneal (``kind`` "stage" or "final"), its progress and the rates it started from."""

    def __init__(self, epochs: int):
        self.epochs = int(epochs)
        self.done: int | None = None  # epochs of the running anneal done (None: not annealing)
        self.kind: str | None = None  # "stage" (before a check) or "final" (after growth ended)
        self.base_lrs: list[float] = []

    @property
    def active(self) -> bool:
        return self.done is not None

    def start(self, optimizer: torch.optim.Optimizer | None, kind: str) -> bool:
        if optimizer is None:
            return False
        self.done, self.kind = 0, kind
        self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        return True

    def set_lr(self, trainer: Trainer, optimizer: torch.optim.Optimizer | None) -> None:
        """At an epoch's start: the network's schedulers are set aside (the user's schedule must not
        fight the anneal) and every group gets ``base · anneal_factor``."""
        if optimizer is None or self.done is None:
            return
        configs = trainer.strategy.lr_scheduler_configs
        trainer.strategy.lr_scheduler_configs = [c for c in configs if c.scheduler.optimizer is not optimizer]
        factor = anneal_factor(self.done, self.epochs)
        for group, base in zip(optimizer.param_groups, self.base_lrs):
            group["lr"] = base * factor

    def epoch_done(self) -> bool:
        """Count an annealed epoch; ``True`` when the anneal has run its course."""
        self.done += 1
        return self.done >= self.epochs

    def end(self, optimizer: torch.optim.Optimizer | None) -> None:
        """A stage anneal is over: back to the constant rate. The rate goes up before the check, so
        a new block's groups (which copy their reference group's current rate) start the new stage
        at the constant rate too."""
        if optimizer is not None:
            for group, base in zip(optimizer.param_groups, self.base_lrs):
                group["lr"] = base
        self.done, self.kind, self.base_lrs = None, None, []

    def state_dict(self) -> dict[str, Any]:
        return {"anneal_done": self.done, "anneal_kind": self.kind, "anneal_base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.done = state.get("anneal_done")
        self.kind = state.get("anneal_kind")
        self.base_lrs = [float(v) for v in state.get("anneal_base_lrs", [])]
