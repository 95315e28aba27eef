"""Batches as the probe sees them: tensors, or tuples/lists/mappings of tensors, samples first.

One definition each of moving a batch to a device, counting its samples and cutting samples
out of it, shared by the probe pass (``saturation``), the cross-fit split (``crossfit``) and
the growth callback.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch

__all__ = ["to_device", "batch_size", "slice_batch"]


def to_device(obj: Any, device: torch.device | str) -> Any:
    """``obj`` with every tensor in it moved to ``device`` (tuples/lists keep their type,
    mappings become dicts; anything else is returned as it is)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device, non_blocking=True)
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(o, device) for o in obj)
    if isinstance(obj, Mapping):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


def batch_size(batch_or_target: Any) -> int:
    """The number of samples in a batch: the first dimension of its target.

    Given an ``(input, target)`` batch it reads the target (the last element); given the
    target itself, its first dimension; a mapping, its first value. Why the target: the
    probe's loss is a mean over samples, ``loss = (1/B) Σ_i ℓ_i``, and the probe multiplies
    gradients of that mean by ``B`` to get per-sample gradients, so ``B`` must be the number
    of terms the mean averages over, which is what the target enumerates (one label per
    sample). The input can be a structure whose first value is not per-sample. For a
    language model (input and target both ``(B, T)`` tokens, token-mean loss) this is the
    number of sequences ``B``: the token mean over ``B·T`` tokens is the mean over the ``B``
    sequences of each sequence's token mean, so a sample is a sequence (with equal ``T``
    and no ignored tokens; a padded batch would weight sequences by their token counts).
    """
    if isinstance(batch_or_target, torch.Tensor):
        if batch_or_target.dim() == 0:
            raise TypeError("probe_loader: a 0-d tensor has no sample dimension; batches must be (samples, ...)")
        return int(batch_or_target.shape[0])
    if isinstance(batch_or_target, (list, tuple)) and batch_or_target:
        return batch_size(batch_or_target[-1])  # (input, target): the target's length
    if isinstance(batch_or_target, Mapping) and batch_or_target:
        return batch_size(next(iter(batch_or_target.values())))
    raise TypeError(f"probe_loader: cannot tell the batch size of a {type(batch_or_target).__name__}")


def sample_loss_terms(output: Any, target: Any, loss_fn: Any) -> torch.Tensor:
    """Each sample's term of the batch-mean loss ``loss_fn(output, target)``, as float64 (B,):
    ``loss_fn`` on one sample's slice of the output and target (for a language model: that
    sequence's token mean).

    One batched call: ``torch.func.vmap`` maps ``loss_fn`` over the samples (each a batch of
    one), so a batch costs one call of the loss, not B. A loss vmap cannot batch (a host read such
    as ``.item()``, data-dependent control flow, outputs that are not one tensor) is called once
    per sample instead: the same terms, slower."""
    n = batch_size(target)
    with torch.no_grad():
        # negative class targets (ignore_index=-100, padded labels): vmap's nll_loss rule gathers at the target
        # before masking, which on a GPU is a device-side assert no except can catch: one call per sample
        ignored = not target.is_floating_point() and bool((target < 0).any()) if isinstance(target, torch.Tensor) else True
        if n and isinstance(output, torch.Tensor) and not ignored:
            try:
                terms = torch.func.vmap(lambda o, t: loss_fn(o.unsqueeze(0), t.unsqueeze(0)))(output, target)
            except (RuntimeError, ValueError, TypeError, NotImplementedError, IndexError, AssertionError):
                terms = None  # not batchable by vmap: one call per sample below
            if isinstance(terms, torch.Tensor) and terms.shape == (n,):
                return terms.double()
        terms = [loss_fn(slice_batch(output, i, i + 1), slice_batch(target, i, i + 1)).double() for i in range(n)]
    return torch.stack(terms) if terms else torch.zeros(0, dtype=torch.float64)


def slice_batch(obj: Any, start: int, stop: int) -> Any:
    """Samples ``start:stop`` of a batch (tensors, tuples/lists, mappings of them)."""
    if isinstance(obj, torch.Tensor):
        return obj[start:stop]
    if isinstance(obj, (list, tuple)):
        return type(obj)(slice_batch(o, start, stop) for o in obj)
    if isinstance(obj, Mapping):
        return {k: slice_batch(v, start, stop) for k, v in obj.items()}
    return obj
