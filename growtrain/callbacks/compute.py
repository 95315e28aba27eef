"""``ComputeMeter``: counts the training work of a fit (batches, samples, estimated FLOPs).

Estimated training FLOPs are ``3 × forward FLOPs of one sample × samples seen`` (backward ≈ 2
forwards), the forward FLOPs counted once per architecture with
``torch.utils.flop_counter.FlopCounterMode`` (matmuls and convolutions; elementwise work such as
BatchNorm and ReLU is not counted).
"""

from __future__ import annotations

from typing import Any

import torch
from lightning.pytorch import Callback
from torch.utils.flop_counter import FlopCounterMode

__all__ = ["ComputeMeter", "forward_flops"]


def _inputs(batch: Any) -> Any:
    """The model input of a batch: ``x`` of ``(x, y)``, else the batch itself."""
    if isinstance(batch, (tuple, list)) and len(batch) >= 1:
        return batch[0]
    if isinstance(batch, dict):
        for key in ("input", "inputs", "x", "input_ids", "idx"):
            if key in batch:
                return batch[key]
    return batch


def forward_flops(module: torch.nn.Module, example: torch.Tensor) -> int:
    """Forward FLOPs of ``module`` on ONE sample (``example[:1]``), counted by FlopCounterMode.

    Runs in eval mode under ``no_grad`` (BatchNorm running statistics are not touched) and
    restores the module's mode.
    """
    was_training = module.training
    module.eval()
    try:
        with torch.no_grad(), FlopCounterMode(display=False) as counter:
            module(example[:1])
    finally:
        module.train(was_training)
    return int(counter.get_total_flops())


class ComputeMeter(Callback):
    """Counts optimizer-side training work: batches, samples and estimated FLOPs.

    ``flops += 3 × forward_flops(one sample) × batch size`` for every training batch; the
    per-sample forward count is cached per architecture (number of parameters and input
    shape), so growth mid-fit is counted at the new size from the next batch on.
    """

    def __init__(self) -> None:
        self.steps = 0
        self.samples = 0
        self.flops = 0.0
        self._per_sample: dict[tuple, int] = {}

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        x = _inputs(batch)
        if not isinstance(x, torch.Tensor):
            return
        key = (sum(p.numel() for p in pl_module.parameters()), tuple(x.shape[1:]), x.dtype)
        if key not in self._per_sample:
            self._per_sample[key] = forward_flops(pl_module, x)
        n = int(x.shape[0])
        self.steps += 1
        self.samples += n
        self.flops += 3.0 * self._per_sample[key] * n

    def state_dict(self) -> dict:
        return {"steps": self.steps, "samples": self.samples, "flops": self.flops}

    def load_state_dict(self, state_dict: dict) -> None:
        self.steps = int(state_dict.get("steps", 0))
        self.samples = int(state_dict.get("samples", 0))
        self.flops = float(state_dict.get("flops", 0.0))
