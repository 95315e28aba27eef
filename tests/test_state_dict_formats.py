"""A grown network's state dict in every format a state dict travels in.

The growth record is the network's extra state: the JSON of ``{"growth": growth_log}`` as UTF-8
bytes in a uint8 tensor, so the state dict holds tensors only and ``safetensors`` (what Hugging
Face saves with) accepts it. Each round trip below loads into a freshly built, *ungrown* network
and must give the grown network's own outputs exactly; the grown blocks get non-zero terminal
weights first, so a block that was not rebuilt, or rebuilt without its weights, shows in the output.
"""

from __future__ import annotations

import json

import lightning as L
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from growtrain.experiments.sweep_table import weights_digest
from growtrain.growable import grown_blocks
from growtrain.models import cifar_resnet, gpt
from growtrain.module import ImageClassifier

from tests import helpers as H

safetensors_torch = pytest.importorskip("safetensors.torch")

SITES = ("layer2.1", "layer1.0")  # the second shifts layer1's original block down: order matters


def _grown(net: torch.nn.Module) -> torch.nn.Module:
    """``net`` grown at SITES, each new block's terminal map made non-zero (so it changes the output)."""
    gen = torch.Generator().manual_seed(7)
    for site in SITES:
        block = net.grow(site)
        with torch.no_grad():
            for p in block.terminal_parameters():
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return net.eval()


def _net() -> torch.nn.Module:
    torch.manual_seed(0)
    return cifar_resnet(width=4, num_classes=3)


def _inputs() -> torch.Tensor:
    return torch.randn(5, 3, 8, 8, generator=torch.Generator().manual_seed(1))


def _record(state: torch.Tensor) -> dict:
    """The record decoded here, independently of growtrain's reader."""
    assert state.dtype == torch.uint8 and state.dim() == 1
    return json.loads(bytes(state.tolist()).decode("utf-8"))


@pytest.fixture
def grown():
    net = _grown(_net())
    with torch.no_grad():
        reference = net(_inputs())  # the grown network's own forward, before any save
    ungrown = _net().eval()
    with torch.no_grad():
        assert not torch.allclose(ungrown(_inputs()), reference)  # the round trips below have something to rebuild
    return net, reference


def _check_loaded(fresh: torch.nn.Module, net: torch.nn.Module, reference: torch.Tensor) -> None:
    assert fresh.growth_log == net.growth_log and len(grown_blocks(fresh)) == len(SITES)
    fresh.eval()
    with torch.no_grad():
        torch.testing.assert_close(fresh(_inputs()), reference, rtol=0, atol=0)


# -- every value is a tensor ---------------------------------------------------------------------
def _hf():
    pytest.importorskip("transformers")
    from growtrain.hf import growable
    from growtrain.hf.tiny import tiny_model

    net = growable(tiny_model("llama"))
    net.grow("layers.1")
    return net


NETWORKS = {
    "cifar_resnet": lambda: _grown(_net()),
    "GrowableStack": lambda: (lambda s: (s.grow("blocks.1"), s)[1])(H.mlp_stack()),
    "gpt": lambda: (lambda g: (g.grow(g.sites()[1]), g)[1])(gpt(n_layer=2, d_model=8, n_head=2, block_size=4, vocab_size=11)),
    "hf": _hf,
}


@pytest.mark.parametrize("kind", list(NETWORKS))
def test_every_value_of_a_grown_networks_state_dict_is_a_tensor(kind):
    net = NETWORKS[kind]()
    state = net.state_dict()
    assert len(net.growth_log) >= 1
    not_tensors = {k: type(v).__name__ for k, v in state.items() if not isinstance(v, torch.Tensor)}
    assert not not_tensors, f"state_dict values that are not tensors: {not_tensors}"
    assert _record(state["_extra_state"]) == {"growth": net.growth_log}


# -- the three round trips -------------------------------------------------------------------------
def test_torch_save_and_load_into_an_ungrown_network(grown, tmp_path):
    net, reference = grown
    torch.save(net.state_dict(), tmp_path / "grown.pt")
    fresh = _net()
    fresh.load_state_dict(torch.load(tmp_path / "grown.pt", weights_only=True))  # strict
    _check_loaded(fresh, net, reference)


def test_safetensors_save_file_and_load_file_into_an_ungrown_network(grown, tmp_path):
    net, reference = grown
    safetensors_torch.save_file(net.state_dict(), tmp_path / "grown.safetensors")
    loaded = safetensors_torch.load_file(tmp_path / "grown.safetensors")
    assert _record(loaded["_extra_state"]) == {"growth": net.growth_log}
    fresh = _net()
    fresh.load_state_dict(loaded)  # strict
    _check_loaded(fresh, net, reference)


def _lightning_checkpoint(tmp_path):
    torch.manual_seed(0)
    module = ImageClassifier(width=4, in_channels=3, num_classes=3)
    _grown(module.network).train()  # the fit trains it: in training mode like the rest of the module
    x = torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    y = torch.randint(0, 3, (16,), generator=torch.Generator().manual_seed(3))
    trainer = L.Trainer(max_epochs=1, limit_train_batches=1, limit_val_batches=0, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        accelerator="cpu")  # fmt: skip
    trainer.fit(module, DataLoader(TensorDataset(x, y), batch_size=8))
    path = tmp_path / "grown.ckpt"
    trainer.save_checkpoint(path)
    module.eval()
    with torch.no_grad():
        reference = module(_inputs())  # after the fit step: the weights the checkpoint holds
    return path, module, reference


@pytest.mark.parametrize("record", ["as_saved", "state_dict_only"])
def test_lightning_load_from_checkpoint(tmp_path, record):
    """``state_dict_only``: the checkpoint's ``growtrain`` entry removed, so the module's hook grows
    nothing and the state dict's own (tensor) record must rebuild the blocks."""
    path, module, reference = _lightning_checkpoint(tmp_path)
    if record == "state_dict_only":
        checkpoint = torch.load(path, weights_only=True)
        del checkpoint["growtrain"]
        torch.save(checkpoint, path)
    loaded = ImageClassifier.load_from_checkpoint(path, weights_only=True)
    assert isinstance(torch.load(path, weights_only=True)["state_dict"]["network._extra_state"], torch.Tensor)
    assert loaded.network.depth() == module.network.depth() == 3 + len(SITES)
    _check_loaded(loaded.network, module.network, reference)


def test_the_string_record_of_earlier_checkpoints_still_loads(grown):
    net, reference = grown
    state = net.state_dict()
    state["_extra_state"] = json.dumps({"growth": net.growth_log})  # how checkpoints held it before the tensor form
    fresh = _net()
    fresh.load_state_dict(state)
    _check_loaded(fresh, net, reference)


# -- a corrupt record: a clear error, and nothing loaded -------------------------------------------
CORRUPT = {
    "float_tensor": lambda good: good.float(),  # e.g. a blanket dtype conversion of the whole state dict
    "two_dimensional": lambda good: good.view(1, -1),
    "not_utf8": lambda good: torch.tensor([0xFF, 0xFE, 0x7B], dtype=torch.uint8),
    "not_json": lambda good: torch.tensor(list(b"growth: layer2.1"), dtype=torch.uint8),
    "no_growth_list": lambda good: torch.tensor(list(b'{"blocks": 2}'), dtype=torch.uint8),
    "not_a_record": lambda good: 3,
}


@pytest.mark.parametrize("kind", list(CORRUPT))
def test_a_corrupt_record_is_a_clear_error_before_the_network_changes(grown, kind):
    net, _ = grown
    state = net.state_dict()
    state["_extra_state"] = CORRUPT[kind](state["_extra_state"])
    fresh = _net()
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    with pytest.raises(ValueError, match=r"state_dict: a growable network's extra state must be the JSON of "
                                         r"\{'growth': \[records\]\}, as UTF-8 bytes in a 1-D uint8 tensor.*nothing was loaded"):  # fmt: skip
        fresh.load_state_dict(state)
    assert fresh.growth_log == [] and fresh.depth() == 3
    after = fresh.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)


# -- what reads the state dict as weights skips the record ----------------------------------------
def test_weights_digest_ignores_the_growth_record():
    """A network built at depth and one grown to it, with the same weights: one digest."""
    torch.manual_seed(0)
    built = cifar_resnet(width=4, num_classes=3, added=1)  # the extra block at the end of layer1
    grown_net = cifar_resnet(width=4, num_classes=3)
    grown_net.grow("layer1.1")
    weights = {k: v for k, v in built.state_dict().items() if not k.endswith("_extra_state")}
    grown_net.load_state_dict(weights)  # strict: the same tensors at the same names
    assert built.growth_log == [] and len(grown_net.growth_log) == 1
    assert weights_digest(grown_net) == weights_digest(built)
    with torch.no_grad():
        grown_net.fc.bias.add_(1.0)
    assert weights_digest(grown_net) != weights_digest(built)  # it does read the weights


# -- FSDP2: the record a distributed checkpoint can load whatever its length ----------------------
def test_a_sharded_network_refuses_a_grown_distributed_checkpoint_clearly(tmp_path):
    """torch.distributed.checkpoint loads a tensor in place, into one of the length the loading
    network's record has: a sharded network's record is its JSON string (loaded whole), so an
    ungrown network given a grown one's checkpoint reaches growtrain's error, not a size mismatch."""
    dist = pytest.importorskip("torch.distributed")
    from growtrain.fsdp import fsdp_available

    if not (dist.is_available() and fsdp_available()):
        pytest.skip("needs torch.distributed with FSDP2")
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    def sharded(net, mesh):
        for stage in net.growable_stages:
            for block in net.stage(stage):
                fully_shard(block, mesh=mesh)
        return fully_shard(net, mesh=mesh)

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", world_size=1, rank=0)
    try:
        mesh = init_device_mesh("cpu", (1,))
        grown_net = sharded(_grown(_net()), mesh)
        state = get_model_state_dict(grown_net)
        assert json.loads(state["_extra_state"]) == {"growth": grown_net.growth_log}
        dcp.save({"model": state}, checkpoint_id=tmp_path / "ckpt")
        fresh = sharded(_net(), mesh)
        target = {"model": get_model_state_dict(fresh)}
        dcp.load(target, checkpoint_id=tmp_path / "ckpt")
        with pytest.raises(RuntimeError, match=r"state_dict: it records 2 growth\(s\) but this FSDP2-sharded network has 0"):
            fresh.load_state_dict(target["model"])
    finally:
        dist.destroy_process_group()
