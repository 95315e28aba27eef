"""The warm-start control of the periodic study: shrink and perturb (Ash & Adams, "On
Warm-Starting Neural Network Training", NeurIPS 2020) once, when growth has ended and the final
anneal begins: every parameter θ ← λ·θ + σ·ε, ε ~ N(0, 1).

A control, not a product option: the periodic protocol's grown network trained as well as
scratch at the same architecture and compute but generalised worse (docs/results.md, "Grow while
training"), the gap warm-started networks show. Used from a config's callbacks list, with the
repository root on PYTHONPATH:

    --trainer.callbacks+=experiments.shrink_perturb.ShrinkPerturbAtFinal
"""

from __future__ import annotations

import torch
from lightning.pytorch import Callback


class ShrinkPerturbAtFinal(Callback):
    def __init__(self, shrink: float = 0.6, noise: float = 0.01, seed: int = 0):
        self.shrink, self.noise, self.seed = float(shrink), float(noise), int(seed)
        self.applied_at: int | None = None  # the epoch it was applied at (checkpointed: once per fit)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        grow = next((c for c in trainer.callbacks if type(c).__name__ == "GrowUntilSaturated"), None)
        if self.applied_at is not None or grow is None or grow._anneal.kind != "final" or grow._anneal.done != 0:
            return
        generator = torch.Generator().manual_seed(self.seed)
        with torch.no_grad():
            for p in pl_module.parameters():
                noise = torch.randn(p.shape, generator=generator, dtype=torch.float32).to(p.device, p.dtype)
                p.mul_(self.shrink).add_(noise, alpha=self.noise)
        self.applied_at = trainer.current_epoch

    def state_dict(self) -> dict:
        return {"applied_at": self.applied_at}

    def load_state_dict(self, state_dict: dict) -> None:
        self.applied_at = state_dict.get("applied_at")
