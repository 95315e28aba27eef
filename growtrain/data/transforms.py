"""Batched image transforms that run on whatever device the batch is on.

Pure torch (no Lightning): the datamodule calls these from `on_after_batch_transfer`, so a
GPU does the per-pixel work for a whole batch at once instead of CPU workers doing it per
sample with PIL. Paper Appendix B.2: 4-pixel pad, random crop back to size, random
horizontal flip; normalise with the dataset's mean/std.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F

__all__ = ["normalize_batch", "augment_batch"]


def normalize_batch(
    x: torch.Tensor, mean: Sequence[float] | torch.Tensor, std: Sequence[float] | torch.Tensor
) -> torch.Tensor:
    """uint8 `(B, C, H, W)` in [0, 255] -> float32 `(x / 255 - mean) / std`, per channel.

    Float input is taken to be already in [0, 1]. `mean`/`std` have C entries (or 1).
    """
    if x.dim() != 4:
        raise ValueError(
            f"normalize_batch: x must be (B, C, H, W); got shape {tuple(x.shape)}. "
            "Fix: add a batch dimension with x.unsqueeze(0)."
        )
    scale = 255.0 if x.dtype == torch.uint8 else 1.0
    m = torch.as_tensor(mean, dtype=torch.float32, device=x.device).reshape(1, -1, 1, 1)
    s = torch.as_tensor(std, dtype=torch.float32, device=x.device).reshape(1, -1, 1, 1)
    if m.shape[1] not in (1, x.shape[1]) or s.shape[1] != m.shape[1]:
        raise ValueError(
            f"normalize_batch: mean/std need 1 or C={x.shape[1]} entries; got "
            f"{m.shape[1]} and {s.shape[1]}. Fix: pass the dataset's per-channel statistics."
        )
    # One fused expression: x*(1/(255 s)) - m/s, avoids three full-size temporaries.
    return torch.addcmul(-m / s, x.to(torch.float32), 1.0 / (scale * s))


def augment_batch(
    x: torch.Tensor,
    pad: int = 4,
    flip: bool = True,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Random crop after zero padding, and random horizontal flip, for a whole batch.

    `x` is float `(B, C, H, W)`, normally already normalised: the padding is then 0 in
    normalised units, i.e. the dataset mean colour rather than black (the torchvision recipe
    pads before normalising; the difference is immaterial for training and lets the whole
    pipeline run on the device after one uint8 transfer). Each sample gets its own shift
    `(dy, dx)` uniform in `[-pad, pad]²` and a flip with probability 1/2. Vectorised: one
    gather with per-sample index grids, no Python loop over samples.

    `generator` (any device) makes the draw reproducible; the random numbers are drawn on the
    generator's device and moved to `x`'s.
    """
    if x.dim() != 4:
        raise ValueError(
            f"augment_batch: x must be (B, C, H, W); got shape {tuple(x.shape)}. "
            "Fix: add a batch dimension with x.unsqueeze(0)."
        )
    if pad < 0:
        raise ValueError(f"augment_batch: pad must be >= 0; got {pad}. Fix: use pad=4 (paper).")
    B, C, H, W = x.shape
    if B == 0 or (pad == 0 and not flip):
        return x
    gen_device = generator.device if generator is not None else x.device
    shifts = torch.randint(0, 2 * pad + 1, (2, B), generator=generator, device=gen_device)
    flips = torch.rand(B, generator=generator, device=gen_device) < 0.5
    shifts, flips = shifts.to(x.device), flips.to(x.device)

    padded = F.pad(x, (pad, pad, pad, pad)) if pad else x  # (B, C, H+2p, W+2p)
    rows = shifts[0, :, None] + torch.arange(H, device=x.device)  # (B, H) into padded rows
    cols = torch.arange(W, device=x.device).expand(B, W)  # (B, W)
    if flip:
        cols = torch.where(flips[:, None], cols.flip(1), cols)
    cols = shifts[1, :, None] + cols  # (B, W) into padded cols
    b = torch.arange(B, device=x.device)
    # Advanced indices around a slice put the indexed dims first: (B, H, W, C).
    out = padded[b[:, None, None], :, rows[:, :, None], cols[:, None, :]]
    # clone, not .contiguous(): with C == 1 the permuted view already counts as contiguous but
    # keeps odd strides, which crashed a single-threaded mkldnn conv backward on 1-channel data.
    return out.permute(0, 3, 1, 2).clone(memory_format=torch.contiguous_format)
