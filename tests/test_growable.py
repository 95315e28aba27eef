"""Growable networks: sites, function-preserving insertion, errors, parameter counts, replay.

Function preservation is checked as a property over many random seeds, families, sites,
``added`` values and sequences of growths, in train and eval mode, with BatchNorm running
statistics compared by module identity. Parameter counts are compared with a hand count.
"""

from __future__ import annotations

import copy
import random

import pytest
import torch
from torch import nn

from growtrain import GrowableStack, Site, find_growable, grown_blocks, replay_growth
from growtrain.growable import terminal_parameters
from growtrain.models import cifar_resnet

try:
    from tests import helpers as H
except ImportError:  # pragma: no cover - pytest's rootdir-less import mode
    import helpers as H


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def inputs(kind: str, n: int = 6, seed: int = 0, dtype=torch.float32) -> torch.Tensor:
    return H.random_inputs(kind, n, torch.Generator().manual_seed(seed), dtype) + 0.2


def state(net: nn.Module):
    """Everything that must not change when a call fails: tree, log, every tensor's value."""
    return (
        H.module_tree(net),
        copy.deepcopy(net.growth_log),
        {k: v.clone() for k, v in net.state_dict().items() if torch.is_tensor(v)},
        {name: m.training for name, m in net.named_modules()},
    )


def assert_same_state(before, after):
    (tree1, log1, sd1, modes1), (tree2, log2, sd2, modes2) = before, after
    assert tree1 == tree2
    assert log1 == log2
    assert sd1.keys() == sd2.keys() and all(torch.equal(sd1[k], sd2[k]) for k in sd1)
    assert modes1 == modes2


# -- 6. function preservation (property test) --------------------------------------------------
def _outputs(net: nn.Module, x: torch.Tensor):
    """(eval output, train output); the train-mode forward runs on a copy so that the
    network's own BatchNorm running statistics are not touched by the comparison."""
    was = net.training
    net.eval()
    with torch.no_grad():
        out_eval = net(x)
        train_copy = copy.deepcopy(net).train()
        out_train = train_copy(x)
    net.train(was)
    return out_eval, out_train


CASES = [(family, seed) for family in H.KINDS for seed in range(5)]


@pytest.mark.parametrize("family,seed", CASES)
def test_growth_preserves_function_and_bn_statistics(family, seed):
    rng = random.Random(seed)
    torch.manual_seed(seed)
    if family == "generic":
        net = H.mlp_stack(n_blocks=rng.randint(1, 3))
    elif family == "dense":
        net = H.DenseNet(n_blocks=rng.randint(1, 2))
    else:
        blocks = tuple(rng.randint(1, 2) for _ in range(3))
        net = cifar_resnet(blocks, width=rng.choice([2, 3, 4]), family=family, in_channels=1, num_classes=3,
                           added=rng.randint(0, 4))
    with torch.no_grad():  # non-trivial running statistics first
        net.train()
        for _ in range(2):
            net(2 * inputs(family, 8, seed=seed + 100))
    mode = rng.choice(["train", "eval"])
    net.train(mode == "train")
    x = inputs(family, 6, seed=seed)
    ref_eval, ref_train = _outputs(net, x)
    old_bn = H.bn_snapshot(net)
    old_params = {id(p): p.detach().clone() for p in net.parameters()}
    for step in range(rng.randint(1, 4)):  # a sequence of growths
        sites = net.sites()
        site = rng.choice(sites)
        by_name = rng.random() < 0.5
        count = n_params(net)
        depth = net.depth()
        block = net.grow(site.name if by_name else site)
        # the block sits at the site, is zero-output, matches the network's mode and dtype
        assert net.stage(site.stage)[site.index] is block
        assert all(torch.count_nonzero(p) == 0 for p in terminal_parameters(block))
        assert all(m.training == net.training for m in block.modules())
        assert all(p.dtype == torch.float32 for p in block.parameters())
        assert net.depth() == depth + 1
        assert n_params(net) == count + n_params(block)
        assert net.growth_log[-1] == {"site": site.name, "stage": site.stage, "index": site.index}
        assert grown_blocks(net)[-1] is block
        # grow() itself touched no existing BatchNorm statistics and no existing parameter
        assert H.same_bn(old_bn, H.bn_snapshot(net))
        assert all(torch.equal(p, old_params[id(p)]) for p in net.parameters() if id(p) in old_params)
        out_eval, out_train = _outputs(net, x)
        # Bit-exact in fp32, in both modes: the new block's terminal map is exactly zero, so it
        # adds exactly 0.0 (basic: relu(z + 0) = z because z ≥ 0 at every site), and every
        # other layer runs the same kernels on the same inputs. Not a tolerance from the
        # callback's insertion_tolerance: any nonzero difference is a bug.
        assert torch.equal(out_eval, ref_eval), (family, seed, step, site.name, "eval")
        assert torch.equal(out_train, ref_train), (family, seed, step, site.name, "train")
        # an eval forward leaves every running statistic (old and new) alone
        snap = H.bn_snapshot(net)
        net.eval()
        with torch.no_grad():
            net(x)
        net.train(mode == "train")
        assert H.same_bn(snap, H.bn_snapshot(net))
        old_params.update({id(p): p.detach().clone() for p in block.parameters()})
    assert len(net.growth_log) == len(grown_blocks(net))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_grown_block_takes_the_networks_dtype(dtype):
    net = cifar_resnet((1, 1, 1), width=2, family="preact", in_channels=1, num_classes=3).to(dtype)
    block = net.grow("layer3.1")
    assert all(p.dtype == dtype for p in block.parameters())
    assert all(b.dtype == dtype for b in block.buffers() if b.is_floating_point())
    given = net.new_block("layer1.0").float()  # a float32 block into a float64 network is cast
    assert all(p.dtype == dtype for p in net.grow("layer1.0", block=given).parameters())


# -- bad sites and bad blocks change nothing ---------------------------------------------------
@pytest.mark.parametrize("family", ["preact", "basic"])
@pytest.mark.parametrize(
    "site,error",
    [
        ("layer2.0", ValueError),  # in front of the stride-2 transition
        ("layer3.0", ValueError),
        ("nope.3", ValueError),
        ("layer1.9", ValueError),
        ("layer1.-1", ValueError),
        ("layer1", ValueError),
        ("", ValueError),
        (Site("layer1", 5), ValueError),
        (Site("layer4", 0), ValueError),
        (42, TypeError),
        (1.0, TypeError),
        (None, TypeError),
        (("layer1", 0), TypeError),
    ],
)
def test_bad_site_raises_and_changes_nothing(family, site, error):
    torch.manual_seed(0)
    net = cifar_resnet((1, 1, 1), width=2, family=family, in_channels=1, num_classes=3)
    net.grow("layer1.1")
    before = state(net)
    with pytest.raises(error):
        net.grow(site)
    with pytest.raises(error):
        net.new_block(site)
    assert_same_state(before, state(net))
    if error is ValueError:  # the message lists the valid sites
        with pytest.raises(ValueError, match="layer1.0, layer1.1, layer1.2, layer2.1, layer3.1"):
            net.grow(site)


@pytest.mark.parametrize("kind", H.KINDS)
def test_bad_blocks_raise_and_change_nothing(kind):
    torch.manual_seed(0)
    net = H.make_net(kind, dtype=torch.float32, blocks=(1, 1, 1))
    site = net.sites()[1]
    before = state(net)
    # non-zero terminal map (every terminal tensor, one at a time)
    for k in range(len(terminal_parameters(net.new_block(site)))):
        block = net.new_block(site)
        with torch.no_grad():
            terminal_parameters(block)[k].view(-1)[0] = 0.1
        with pytest.raises(ValueError, match="terminal"):
            net.grow(site, block=block)
        assert_same_state(before, state(net))
    # a block that is already part of the network
    existing = net.stage(site.stage)[0]
    with pytest.raises(ValueError, match="already part"):
        net.grow(site, block=existing)
    # not a module; a module without terminal_parameters()
    with pytest.raises(TypeError):
        net.grow(site, block="block")
    with pytest.raises(TypeError, match="terminal_parameters"):
        net.grow(site, block=nn.Identity())
    assert_same_state(before, state(net))
    assert grown_blocks(net) == []


# -- 7. sites, cyclic allocation, parameter counts --------------------------------------------
def test_resnet8_sites_and_growth_at_layer2_1():
    net = cifar_resnet((1, 1, 1))
    names = [s.name for s in net.sites()]
    assert names == ["layer1.0", "layer1.1", "layer2.1", "layer3.1"]
    assert net.sites() == net.sites()  # stable
    assert [s.name for s in net.sites()] == names
    assert net.site("layer2.1") == Site("layer2", 1) and str(Site("layer2", 1).name) == "layer2.1"
    net.grow("layer2.1")
    assert [s.name for s in net.sites()] == ["layer1.0", "layer1.1", "layer2.1", "layer2.2", "layer3.1"]
    net.grow(Site("layer1", 0))
    assert [s.name for s in net.sites()] == ["layer1.0", "layer1.1", "layer1.2", "layer2.1", "layer2.2", "layer3.1"]
    assert [len(net.layer1), len(net.layer2), len(net.layer3)] == [2, 2, 1]
    assert net.depth() == 5


@pytest.mark.parametrize(
    "added,counts",
    [(0, (1, 1, 1)), (1, (2, 1, 1)), (2, (2, 2, 1)), (3, (2, 2, 2)), (4, (3, 2, 2)), (5, (3, 3, 2)), (7, (4, 3, 3))],
)
def test_cyclic_added_blocks(added, counts):
    net = cifar_resnet((1, 1, 1), width=2, family="preact", added=added)
    assert (len(net.layer1), len(net.layer2), len(net.layer3)) == counts
    assert net.depth() == 3 + added
    # transition blocks stay first; every added block keeps the stage's width
    for name, width in zip(("layer1", "layer2", "layer3"), (2, 4, 8)):
        for block in net.stage(name)[1:]:
            assert block.shortcut is None and block.conv1.in_channels == width == block.conv2.out_channels


# hand count, ResNet-8, width 16, 3 input channels, 10 classes
STEM = 3 * 16 * 9  # 3×3 conv, no bias
BN16, BN32, BN64 = 2 * 16, 2 * 32, 2 * 64  # γ and β
FC = 64 * 10 + 10
BASIC = {
    "stem_bn": BN16,
    "layer1.0": 16 * 16 * 9 + BN16 + 16 * 16 * 9 + BN16,  # conv1, bn1, conv2, bn2
    "layer2.0": 16 * 32 * 9 + BN32 + 32 * 32 * 9 + BN32 + 16 * 32 + BN32,  # + 1×1 shortcut conv and BN
    "layer3.0": 32 * 64 * 9 + BN64 + 64 * 64 * 9 + BN64 + 32 * 64 + BN64,
}
PREACT = {
    "layer1.0": BN16 + 16 * 16 * 9 + BN16 + 16 * 16 * 9,  # bn1(in), conv1, bn2(out), conv2
    "layer2.0": BN16 + 16 * 32 * 9 + BN32 + 32 * 32 * 9 + 16 * 32,  # + 1×1 shortcut conv, no BN
    "layer3.0": BN32 + 32 * 64 * 9 + BN64 + 64 * 64 * 9 + 32 * 64,
    "final_bn": BN64,
}
# one same-width block per stage (identical for both families: two convs and two BNs)
PER_STAGE = [2 * (16 * 16 * 9) + 2 * BN16, 2 * (32 * 32 * 9) + 2 * BN32, 2 * (64 * 64 * 9) + 2 * BN64]


def test_hand_counts_written_out():
    assert STEM + sum(BASIC.values()) + FC == 78042
    assert STEM + sum(PREACT.values()) + FC == 77850
    assert PER_STAGE == [4672, 18560, 73984]


@pytest.mark.parametrize("family,table", [("basic", BASIC), ("preact", PREACT)])
@pytest.mark.parametrize("added", [0, 1, 2, 3, 4])
def test_parameter_counts_match_hand_count(family, table, added):
    net = cifar_resnet((1, 1, 1), width=16, family=family, in_channels=3, num_classes=10, added=added)
    expected = STEM + sum(table.values()) + FC + sum(PER_STAGE[k % 3] for k in range(added))
    assert n_params(net) == expected
    if added == 0:
        assert n_params(net.stem) == STEM and n_params(net.fc) == FC
        for name in ("layer1.0", "layer2.0", "layer3.0"):
            stage, i = name.split(".")
            assert n_params(net.stage(stage)[int(i)]) == table[name], name
    # growing one block at each stage's end adds exactly the per-stage count
    for stage, count in zip(("layer1", "layer2", "layer3"), PER_STAGE):
        before = n_params(net)
        net.grow(f"{stage}.{len(net.stage(stage))}")
        assert n_params(net) - before == count


def test_growable_stack_sites():
    stack = H.mlp_stack(n_blocks=2)
    assert [s.name for s in stack.sites()] == ["blocks.0", "blocks.1", "blocks.2"]
    stack.grow("blocks.1")
    assert [s.name for s in stack.sites()] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    assert find_growable(nn.Sequential(nn.Linear(4, 4), stack)) is stack
    assert find_growable(nn.Linear(2, 2)) is None
    with pytest.raises(ValueError, match="terminal"):
        GrowableStack([H.MLPBlock()], H.MLPBlock, ("fc3.weight",))
    with pytest.raises(ValueError, match="terminal"):
        GrowableStack([H.MLPBlock()], H.MLPBlock, ())
    with pytest.raises(TypeError, match="factory"):
        GrowableStack([H.MLPBlock()], "MLPBlock", H.MLP_TERMINAL)


# -- candidates and replay --------------------------------------------------------------------
def test_new_block_seed_is_reproducible_and_leaves_the_global_rng_alone():
    net = cifar_resnet((1, 1, 1), width=2, family="basic", in_channels=1)
    rng = torch.get_rng_state()
    a, b = net.new_block("layer2.1", seed=5), net.new_block("layer2.1", seed=5)
    assert torch.equal(torch.get_rng_state(), rng)
    c = net.new_block("layer2.1", seed=6)
    pa, pb, pc = (torch.cat([p.flatten() for p in m.parameters()]) for m in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


@pytest.mark.parametrize("family", ["preact", "basic"])
def test_replay_growth_rebuilds_the_architecture(family):
    torch.manual_seed(1)
    net = cifar_resnet((1, 1, 1), width=2, family=family, in_channels=1, num_classes=3)
    for site in ("layer2.1", "layer1.0", "layer2.2", "layer3.1", "layer1.2"):
        block = net.grow(site)
        with torch.no_grad():  # trained afterwards: the terminal map is no longer zero
            for p in terminal_parameters(block):
                p.normal_()
    net.eval()
    x = inputs(family, 4)
    fresh = cifar_resnet((1, 1, 1), width=2, family=family, in_channels=1, num_classes=3)
    replay_growth(fresh, net.growth_log)
    fresh.load_state_dict(net.state_dict())  # strict: the same architecture
    fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), net(x))
    assert fresh.growth_log == net.growth_log
    assert replay_growth(fresh, net.growth_log) == []  # already complete: nothing added
    other = cifar_resnet((1, 1, 1), width=2, family=family, in_channels=1, num_classes=3)
    other.grow("layer3.1")
    with pytest.raises(ValueError, match="differs"):
        replay_growth(other, net.growth_log)
    with pytest.raises(ValueError, match="already has"):
        replay_growth(net, net.growth_log[:2])


def test_output_change_is_the_largest_change_against_the_outputs_own_scale():
    """editor.output_change, the one function-preservation check: max|after − before| against float32's
    tolerance times the output's scale (above 1); outputs of another shape, or a NaN, are never preserved."""
    import math

    from growtrain.callbacks.editor import output_change

    before = torch.tensor([[0.5, -1.0, 0.25]])
    assert output_change(before, before + torch.tensor([[0.0, 0.003, -0.001]])) == (pytest.approx(0.003, rel=1e-4), 1e-5)
    big = 200.0 * before  # max|output| 200: the tolerance scales with it
    change, tolerance = output_change(big, big.clone())
    assert change == 0.0 and tolerance == pytest.approx(200 * 1e-5)
    assert output_change(before, before.expand(2, 3)) == (math.inf, 0.0)  # broadcastable, still another shape
    nan = before.clone()
    nan[0, 1] = float("nan")
    assert output_change(before, nan)[0] == math.inf
