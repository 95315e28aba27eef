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


def test_each_samples_loss_term_in_one_batched_call_of_the_loss():
    """sample_loss_terms maps the loss over the samples in one call (vmap), not B calls, and its
    terms are each sample's own loss computed one at a time by hand; a language model's term is
    its sequence's token mean."""
    from growtrain.batches import sample_loss_terms
    from growtrain.lm import token_cross_entropy

    g = torch.Generator().manual_seed(0)
    out, y = torch.randn(9, 5, generator=g), torch.randint(0, 5, (9,), generator=g)
    calls = []

    def counted(o, t):
        calls.append(1)
        return F.cross_entropy(o, t)

    terms = sample_loss_terms(out, y, counted)
    assert len(calls) == 1 and terms.dtype == torch.float64
    torch.testing.assert_close(terms, torch.stack([F.cross_entropy(out[i : i + 1], y[i : i + 1]) for i in range(9)]).double())
    logits, tokens = torch.randn(3, 6, 7, generator=g), torch.randint(0, 7, (3, 6), generator=g)
    by_hand = torch.stack([F.cross_entropy(logits[i], tokens[i]) for i in range(3)]).double()
    torch.testing.assert_close(sample_loss_terms(logits, tokens, token_cross_entropy), by_hand)


def test_a_loss_vmap_cannot_batch_is_called_per_sample_with_the_same_terms():
    from growtrain.batches import sample_loss_terms

    g = torch.Generator().manual_seed(1)
    out, y = torch.randn(6, 4, generator=g), torch.randint(0, 4, (6,), generator=g)

    def reads_the_host(o, t):  # .item() inside: vmap refuses it
        scale = 2.0 if float(o.abs().max().item()) > 0 else 1.0
        return scale * F.cross_entropy(o, t)

    terms = sample_loss_terms(out, y, reads_the_host)
    torch.testing.assert_close(terms, 2.0 * F.cross_entropy(out, y, reduction="none").double())


def test_ignored_targets_take_the_per_sample_path_with_the_right_terms():
    """Padded labels (ignore_index=-100): each sequence's term is the mean over its kept tokens,
    as one call per sequence gives; vmap's loss rule is not used for them (on a GPU it would gather
    at index -100 before masking: a device-side assert)."""
    from growtrain.batches import sample_loss_terms
    from growtrain.lm import token_cross_entropy

    g = torch.Generator().manual_seed(2)
    logits, tokens = torch.randn(3, 6, 7, generator=g), torch.randint(0, 7, (3, 6), generator=g)
    tokens[0, 4:] = -100
    tokens[2, :2] = -100
    calls = []

    def counted(o, t):
        calls.append(1)
        return token_cross_entropy(o, t)

    terms = sample_loss_terms(logits, tokens, counted)
    by_hand = torch.stack([F.cross_entropy(logits[i][tokens[i] >= 0], tokens[i][tokens[i] >= 0]) for i in range(3)])
    torch.testing.assert_close(terms, by_hand.double())
    assert len(calls) == 3  # one call per sequence
