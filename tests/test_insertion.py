"""growtrain.insertion on every family: MSG's drawn terminal map is nonzero (a ResNet BasicBlock's
BatchNorm scale included) and hidden by the mask at m = 0; the masked block is the hand-written mix
``z + m·(block(z) − z)`` of its plain forward; the copy behind the ramp; the mask is network state, so
a plain ``load_state_dict`` into a fresh network (which replays the growth) gives the masked network
back, and a deep copy carries its own."""

from __future__ import annotations

import copy
import io

import pytest
import torch

from growtrain.growable import grown_blocks
from growtrain.insertion import (MASK_KEY, MaskRamp, attach_mask, copy_neighbour, draw_terminal, load_masks,
                                 mask_value, set_mask)  # fmt: skip
from helpers import DenseNet, make_net, mlp_stack

FAMILIES = ("basic", "preact", "generic", "dense", "gpt", "hf-llama", "hf-gpt2")


def _family(kind: str):
    """(network in eval mode, an input, a site with a trained neighbour of the new block's shape)."""
    gen = torch.Generator().manual_seed(7)
    if kind in ("basic", "preact"):
        net = make_net(kind)  # float64, BatchNorm statistics away from (0, 1)
        return net, torch.randn(4, 1, 8, 8, generator=gen, dtype=torch.float64), f"layer2.{len(net.layer2)}"
    if kind in ("generic", "dense"):
        torch.manual_seed(0)
        net = (mlp_stack() if kind == "generic" else DenseNet()).double().eval()
        return net, torch.randn(6, 4, generator=gen, dtype=torch.float64), "blocks.1"
    if kind == "gpt":
        from growtrain.models.gpt import GPT, GPTConfig

        torch.manual_seed(0)
        net = GPT(GPTConfig(n_layer=2, d_model=16, n_head=2, block_size=8, vocab_size=32)).double().eval()
        return net, torch.randint(0, 32, (3, 8), generator=gen), "h.1"
    pytest.importorskip("transformers")
    from growtrain.hf import growable
    from growtrain.hf.tiny import tiny_model

    net = growable(tiny_model(kind[3:], vocab=64, hidden=16, heads=2)).double()
    return net, torch.randint(0, 64, (2, 8), generator=gen), "layers.1"


def _terminal(net, block):
    of = getattr(net, "terminal_parameters_of", None)
    return list(of(block)) if of is not None else list(block.terminal_parameters())


def _names(block, params):
    names = {id(p): n for n, p in block.named_parameters()}
    return [names[id(p)] for p in params]


def _explicit_block_mix(block, m: float):
    """Capture the block's call (input, arguments, output) and compare its output with
    ``z + m·(forward(z) − z)``, ``forward`` the class's own (no hooks)."""
    seen = {}

    def pre(module, args, kwargs):
        seen["args"], seen["kwargs"] = args, kwargs

    def post(module, args, kwargs, output):  # registered after the mask's hook: it sees the masked output
        seen["out"] = output if isinstance(output, torch.Tensor) else output[0]

    handles = [block.register_forward_pre_hook(pre, with_kwargs=True),
               block.register_forward_hook(post, with_kwargs=True)]  # fmt: skip
    return seen, handles


@pytest.mark.parametrize("kind", FAMILIES)
def test_mask_ramp_draws_a_nonzero_terminal_map_that_the_mask_hides_at_first(kind):
    net, x, site = _family(kind)
    with torch.no_grad():
        before = net(x)
    block = net.grow(site)
    draw_terminal(net, block, torch.Generator().manual_seed(0))
    terminal = _terminal(net, block)
    names = _names(block, terminal)
    weights = [p for p, n in zip(terminal, names) if not n.endswith("bias")]
    assert weights and all(int(torch.count_nonzero(p)) == p.numel() for p in weights), names  # drawn: nonzero
    assert all(int(torch.count_nonzero(p)) == 0 for p, n in zip(terminal, names) if n.endswith("bias"))
    if kind == "basic":  # the whole terminal map is bn2's (γ, β): a fresh BatchNorm's, γ = 1, β = 0
        assert torch.equal(block.bn2.weight, torch.ones_like(block.bn2.weight))
    ramp = MaskRamp(4)
    ramp.add(block, start=0)
    with torch.no_grad():
        assert torch.equal(net(x), before)  # m = 0: x + 0·(y − x) is x, bit for bit
    ramp.set_step(1)  # m = 1/4: the block's output is the mix of its own forward, written out
    seen, handles = _explicit_block_mix(block, 0.25)
    with torch.no_grad():
        net(x)
        z = seen["args"][0] if seen["args"] else seen["kwargs"]["hidden_states"]
        plain = type(block).forward(block, *seen["args"], **seen["kwargs"])
        plain = plain if isinstance(plain, torch.Tensor) else plain[0]
        torch.testing.assert_close(seen["out"], z + 0.25 * (plain - z), rtol=1e-12, atol=1e-12)
        assert float((plain - z).abs().max()) > 1e-3  # the block itself is not the identity
    for h in handles:
        h.remove()
    ramp.set_step(4)  # m = 1: the mask is gone and the drawn block acts in full
    assert mask_value(block) is None and MASK_KEY not in block.state_dict() and len(ramp) == 0
    with torch.no_grad():
        after = net(x)
    assert float((after - before).abs().max()) > 1e-3 * max(1.0, float(before.abs().max()))


@pytest.mark.parametrize("kind", ["basic", "gpt", "hf-llama"])
def test_a_state_dict_written_mid_ramp_loads_into_a_fresh_network_as_the_masked_one(kind):
    net, x, site = _family(kind)
    block = net.grow(site)
    draw_terminal(net, block, torch.Generator().manual_seed(0))
    ramp = MaskRamp(10)
    ramp.add(block, start=0, step=3)  # m = 0.3
    with torch.no_grad():
        masked = net(x)
    buffer = io.BytesIO()
    torch.save(net.state_dict(), buffer)  # tensors only: a weights_only load reads it
    buffer.seek(0)
    state = torch.load(buffer, weights_only=True)
    mask_keys = [k for k in state if k.endswith(MASK_KEY)]
    assert len(mask_keys) == 1 and float(state[mask_keys[0]]) == pytest.approx(0.3)
    fresh, _, _ = _family(kind)
    assert fresh.depth() == net.depth() - 1
    fresh.load_state_dict(state)  # strict: the growth replayed, the mask with its block
    (theirs,) = grown_blocks(fresh)
    assert mask_value(theirs) == mask_value(block)
    with torch.no_grad():
        assert torch.equal(fresh(x), masked)
    # a state written after the ramp (m = 1) has no mask: loaded into the masked network, it drops it
    ramp.set_step(10)
    assert not any(k.endswith(MASK_KEY) for k in net.state_dict())
    fresh.load_state_dict(net.state_dict())
    assert mask_value(theirs) is None
    with torch.no_grad():
        assert torch.equal(fresh(x), net(x))
        assert not torch.allclose(fresh(x), masked)


def test_a_deep_copy_carries_its_own_mask():
    net, x, site = _family("gpt")
    block = net.grow(site)
    draw_terminal(net, block, torch.Generator().manual_seed(0))
    attach_mask(block, 0.5)
    twin = copy.deepcopy(net)
    (other,) = grown_blocks(twin)
    with torch.no_grad():
        assert torch.equal(twin(x), net(x))
        set_mask(other, 0.0)  # the copy's hook reads the copy's buffer, not the original's
        assert mask_value(block) == 0.5 and not torch.equal(twin(x), net(x))


def test_copy_ramp_is_the_copy_behind_the_mask():
    """At m = 0 the network is unchanged; at m = 1 it is the network with a plain copy (G_stack's)."""
    net, x, _ = _family("gpt")
    with torch.no_grad():
        before = net(x)
    plain = copy.deepcopy(net)
    copy_neighbour(plain, plain.grow("h.2"))
    block = net.grow("h.2")
    source = copy_neighbour(net, block)
    assert source is net.transformer.h[1]
    ramp = MaskRamp(2)
    ramp.add(block, start=5)
    with torch.no_grad():
        assert torch.equal(net(x), before)
        ramp.set_step(7)
        assert torch.equal(net(x), plain(x)) and not torch.allclose(net(x), before)
    for p, q in zip(block.parameters(), source.parameters()):
        assert torch.equal(p, q)


def test_a_masked_neighbour_is_copied_without_its_mask():
    net, x, _ = _family("gpt")
    top = net.grow("h.2")
    copy_neighbour(net, top)
    attach_mask(top, 0.5)
    again = net.grow("h.3")
    assert copy_neighbour(net, again) is top
    assert mask_value(again) is None and MASK_KEY not in again.state_dict()
    load_masks(net, net.state_dict())  # the network's own state: nothing moves
    assert mask_value(top) == 0.5 and mask_value(again) is None
