"""The growth contract: the GrowableNetwork/GrowableBlock protocols, the one resolver for the
network and for the probe loss, full checks at family registration, and rollback of insertions."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import MLPBlock, mlp_stack
from torch import nn
from torch.nn import functional as F

from growtrain import GrowableStack
from growtrain.families import BasicBlock, PreActBlock, conv_families, conv_family, register_conv_family
from growtrain.growable import (
    FastProbeBlock,
    GrowableBlock,
    GrowableNetwork,
    check_growable,
    probe_loss_for,
    resolve_network,
)
from growtrain.models import cifar_resnet


class Wrapper(nn.Module):
    """An encoder, a growable trunk and a head: the network is only part of the model."""

    def __init__(self):
        super().__init__()
        self.encoder = nn.Linear(4, 4)
        self.body = nn.Module()
        self.body.trunk = mlp_stack(1)
        self.head = nn.Linear(4, 3)


# -- protocols ------------------------------------------------------------------------------------
def test_shipped_networks_and_blocks_satisfy_the_protocols():
    assert isinstance(mlp_stack(1), GrowableNetwork) and isinstance(cifar_resnet(width=2), GrowableNetwork)
    assert isinstance(BasicBlock(2, 2), FastProbeBlock) and isinstance(PreActBlock(2, 2), FastProbeBlock)
    assert isinstance(mlp_stack(1).blocks[0], GrowableBlock) and not isinstance(MLPBlock(), GrowableBlock)
    assert not isinstance(nn.Linear(2, 2), GrowableNetwork)


# -- resolve_network ------------------------------------------------------------------------------
def test_resolve_network_by_search_path_and_module():
    model = Wrapper()
    trunk = model.body.trunk
    assert resolve_network(model) is trunk
    assert resolve_network(model, "body.trunk") is trunk
    assert resolve_network(model, trunk) is trunk


@pytest.mark.parametrize(
    "spec, exc, match",
    [
        ("body.missing", ValueError, r"network: Wrapper has no submodule 'body.missing'"),
        ("encoder", TypeError, r"network: Linear is not a growable network: it lacks sites, site, stage"),
        (3, TypeError, r"network: expected None .* got int"),
    ],
)
def test_resolve_network_errors_name_the_argument(spec, exc, match):
    with pytest.raises(exc, match=match):
        resolve_network(Wrapper(), spec)


def test_resolve_network_refuses_a_module_outside_the_model_and_a_model_without_network():
    with pytest.raises(ValueError, match="network: the given module is not part of the model"):
        resolve_network(Wrapper(), mlp_stack(1))
    with pytest.raises(ValueError, match="network: Linear has no growable submodule"):
        resolve_network(nn.Linear(2, 2))
    # not built yet (a module that builds its layers in configure_model): no error, None
    assert resolve_network(nn.Linear(2, 2), required=False) is None
    assert resolve_network(Wrapper(), "later", required=False) is None


def test_check_growable_lists_every_missing_member_and_refuses_no_sites():
    class Partial(nn.Module):
        growth_log: list = []

        def sites(self):
            return []

        def grow(self, site, block=None):
            return block

    with pytest.raises(TypeError) as err:
        check_growable(Partial())
    for member in ("site,", "stage", "depth", "neighbour_tensor", "new_block", "undo_growth"):
        assert member in str(err.value)
    assert "grow," not in str(err.value) and "sites," not in str(err.value)

    no_room = cifar_resnet(width=2)
    no_room.first_site = lambda stage: len(no_room.stage(stage)) + 1  # no admissible position left
    with pytest.raises(ValueError, match="network: CifarResNet has no candidate sites"):
        check_growable(no_room)


def test_module_growable_network_uses_the_resolver():
    from lightning.pytorch import LightningModule

    from growtrain.module import GrowableModuleMixin

    class ByPath(GrowableModuleMixin, LightningModule):
        growable_attr = "body.trunk"

        def __init__(self):
            super().__init__()
            self.body = nn.Module()
            self.body.trunk = mlp_stack(1)

    class NotGrowable(GrowableModuleMixin, LightningModule):
        growable_attr = "fc"

        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(2, 2)

    module = ByPath()
    assert module.growable_network is module.body.trunk  # a dotted path now works too
    with pytest.raises(TypeError, match=r"growable_attr: self.fc of NotGrowable: network: Linear is not a growable"):
        NotGrowable().growable_network


# -- probe_loss_for -------------------------------------------------------------------------------
def test_probe_loss_for_prefers_the_argument_then_the_model_then_cross_entropy():
    def mine(out, y):
        return out.sum()

    class WithLoss(nn.Module):
        @staticmethod
        def probe_loss(out, y):
            return out.mean()

    assert probe_loss_for(WithLoss(), mine) is mine
    assert probe_loss_for(WithLoss()) is WithLoss.probe_loss
    assert probe_loss_for(nn.Linear(2, 2)) is F.cross_entropy
    with pytest.raises(TypeError, match="loss_fn: expected a callable"):
        probe_loss_for(nn.Linear(2, 2), "mse")


# -- register_conv_family ---------------------------------------------------------------------------
class NoZeroInit(nn.Module):
    def __init__(self, cin, cout, stride=1):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, 3, padding=1)

    def forward(self, z):
        return z + self.conv(z)

    def terminal_parameters(self):
        return [self.conv.weight, self.conv.bias]


class ZeroesTooLittle(NoZeroInit):
    def zero_init_last(self):
        nn.init.zeros_(self.conv.weight)  # the bias stays: block(z) != z


class SplitWithoutFeatures(NoZeroInit):
    def zero_init_last(self):
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def split_terminal(self, matrix):
        return [matrix]


@pytest.mark.parametrize(
    "block_cls, exc, match",
    [
        (NoZeroInit, TypeError, "block_cls: NoZeroInit lacks zero_init_last"),
        (SplitWithoutFeatures, TypeError, "block_cls: SplitWithoutFeatures lacks probe_features"),
        (ZeroesTooLittle, ValueError, "block_cls: after zero_init_last"),
        ("basic", TypeError, "block_cls: expected a block class"),
    ],
)
def test_register_conv_family_checks_the_whole_contract_before_registering(block_cls, exc, match):
    before = conv_families()
    with pytest.raises(exc, match=match):
        register_conv_family("bad", block_cls)
    assert conv_families() == before


def test_register_conv_family_accepts_a_conforming_block():
    from growtrain.families import _CONV_FAMILIES

    try:
        register_conv_family("basic_copy", BasicBlock)
        assert conv_family("basic_copy") is BasicBlock
    finally:
        _CONV_FAMILIES.pop("basic_copy", None)


# -- undo_growth ----------------------------------------------------------------------------------
def _stage_lists(network):
    return {s: list(network.stage(s)) for s in network.growable_stages}


def _perturb(block):
    with torch.no_grad():
        for p in block.terminal_parameters():
            p.add_(0.5)


@pytest.mark.parametrize("make", [lambda: cifar_resnet(blocks=(1, 1, 1), width=2, num_classes=3), lambda: mlp_stack(2)])
def test_undo_growth_restores_the_exact_modules_records_and_outputs(make):
    torch.manual_seed(0)
    network = make().double().eval()
    x = torch.randn(3, 3, 8, 8) if hasattr(network, "layer1") else torch.randn(3, 4)
    x = x.double()
    network.grow(network.sites()[0])  # an earlier growth that the rollback must keep
    before_modules, before_log = _stage_lists(network), copy.deepcopy(network.growth_log)
    before_grown = [id(b) for b in network._grown_blocks]
    with torch.no_grad():
        before_out = network(x)
    log_len = len(network.growth_log)
    inserted = [network.grow(network.sites()[-1]), network.grow(network.sites()[0])]
    for block in inserted:  # so that a block left behind would change the output
        _perturb(block)
    with torch.no_grad():
        assert not torch.equal(network(x), before_out)

    network.undo_growth(inserted, log_len)

    after = _stage_lists(network)
    assert after.keys() == before_modules.keys()
    for stage, modules in before_modules.items():
        assert len(after[stage]) == len(modules) and all(a is b for a, b in zip(after[stage], modules))
    assert network.growth_log == before_log
    assert [id(b) for b in network._grown_blocks] == before_grown
    with torch.no_grad():
        assert torch.equal(network(x), before_out)


def test_undo_growth_refuses_bad_arguments_before_changing_anything():
    network = mlp_stack(1)
    block = network.grow(network.sites()[0])
    state = (_stage_lists(network), copy.deepcopy(network.growth_log))
    stranger = MLPBlock()
    cases = [
        (([block], 2), "log_len: expected the growth_log length"),
        (([block], True), "log_len"),
        (([], 0), "blocks: 1 insertions were recorded after log_len=0, but 0 blocks"),
        (([stranger], 0), r"blocks\[0\]: MLPBlock was not inserted by grow\(\)"),
        (([block, block], 0), "blocks: 1 insertions"),
    ]
    for (blocks, log_len), match in cases:
        with pytest.raises(ValueError, match=match):
            network.undo_growth(blocks, log_len)
        assert _stage_lists(network) == state[0] and network.growth_log == state[1]


def test_undo_growth_on_a_user_stack_keeps_its_blocks_usable():
    network = GrowableStack([MLPBlock()], MLPBlock, ("fc2.weight", "fc2.bias"))
    block = network.grow("blocks.1")
    network.undo_growth([block], 0)
    assert network.depth() == 1 and network.growth_log == []
    network.grow("blocks.0")  # growth works again after a rollback
    assert [r["site"] for r in network.growth_log] == ["blocks.0"]
