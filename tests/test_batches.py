"""growtrain.batches: one definition of moving, counting and cutting probe batches."""

from __future__ import annotations

import pytest
import torch
from torch.nn import functional as F

from growtrain.batches import batch_size, slice_batch, to_device


def test_to_device_keeps_the_structure():
    x, y = torch.zeros(4, 3), torch.arange(4)
    moved = to_device([(x, y), {"ids": y, "name": "keep"}], torch.device("cpu"))
    assert type(moved) is list and type(moved[0]) is tuple
    assert moved[0][0].device.type == "cpu" and moved[1]["name"] == "keep"
    assert to_device(None, "cpu") is None


def test_batch_size_reads_the_target():
    # the input's first dimension is not the sample count here (a time-major input)
    batch = (torch.zeros(7, 3, 2), torch.zeros(3, dtype=torch.long))
    assert batch_size(batch) == 3 and batch_size(batch[1]) == 3
    assert batch_size({"input_ids": torch.zeros(5, 9), "labels": torch.zeros(5, 9)}) == 5
    for bad in (torch.tensor(1.0), (), {}, "text"):
        with pytest.raises(TypeError, match="probe_loader"):
            batch_size(bad)


def test_language_model_samples_are_sequences():
    """Token-mean loss over (B, T): B × ∂(mean loss)/∂z_i is sequence i's own loss gradient, so
    the B of batch_size is the count the probe must multiply by (checked with autograd)."""
    torch.manual_seed(0)
    B, T, V = 3, 4, 5
    z = torch.randn(B, T, V, dtype=torch.float64, requires_grad=True)  # per-sequence activations
    y = torch.randint(V, (B, T))
    mean_loss = F.cross_entropy(z.reshape(-1, V), y.reshape(-1))
    (grad,) = torch.autograd.grad(mean_loss, z)
    n = batch_size((torch.zeros(B, T), y))
    assert n == B
    for i in range(B):
        own = F.cross_entropy(z[i], y[i])  # sequence i's token-mean loss
        (own_grad,) = torch.autograd.grad(own, z)
        assert torch.allclose(n * grad[i], own_grad[i], atol=1e-12)


def test_slice_batch_cuts_every_tensor():
    x, y = torch.arange(12).reshape(6, 2), torch.arange(6)
    head = slice_batch((x, {"y": y, "tag": "t"}), 1, 3)
    assert torch.equal(head[0], x[1:3]) and torch.equal(head[1]["y"], y[1:3]) and head[1]["tag"] == "t"
