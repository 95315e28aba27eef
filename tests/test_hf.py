"""Hugging Face decoders: growth, the probe against explicit insertion, save/load, fit + resume.

Every model is a tiny random config built here (hidden 32, 2 layers, vocabulary 64; nothing
downloads). Oracles are independent of ``growtrain.saturation``: a scored candidate is really
inserted into a copy of the model and differentiated with plain autograd.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from growtrain.growable import grown_blocks  # noqa: E402
from growtrain.hf import HFGrowable, growable  # noqa: E402
from growtrain.hf.tiny import ARCHS, tiny_model  # noqa: E402
from growtrain.lm import token_cross_entropy  # noqa: E402
from growtrain.saturation import measure_saturation  # noqa: E402

VOCAB = 64


def _tokens(seed: int, shape=(3, 10)) -> torch.Tensor:
    return torch.randint(0, VOCAB, shape, generator=torch.Generator().manual_seed(seed))


def _layer_positions(net: HFGrowable) -> list[int]:
    path = net.spec.layer_idx[0].split(".")
    out = []
    for layer in net.stage("layers"):
        obj = layer
        for part in path:
            obj = getattr(obj, part)
        out.append(obj)
    return out


# -- wrapping and function preservation ----------------------------------------------------------
@pytest.mark.parametrize("arch", ARCHS)
def test_insertion_preserves_forward_masked_forward_cached_generation_and_bf16(arch):
    model = tiny_model(arch)
    weights = {id(p) for p in model.parameters()}
    net = growable(model)
    assert net.model is model and {id(p) for p in net.parameters()} == weights  # wrapped, not copied
    assert [s.name for s in net.sites()] == ["layers.0", "layers.1", "layers.2"]
    x = _tokens(0)
    mask = torch.ones_like(x)
    mask[0, :4] = 0  # left padding in one row
    with torch.no_grad():
        plain, masked = net(x), net(x, attention_mask=mask)
        tokens = model.generate(x[:2], attention_mask=mask[:2], max_new_tokens=8, do_sample=False, use_cache=True)
    layer_cls = type(net.stage("layers")[0])
    for site in ("layers.2", "layers.1", "layers.0", "layers.4"):  # end, middle, front, new end
        inserted = net.grow(site)
        assert type(inserted) is layer_cls  # the model's own class, so save_pretrained stays plain
    assert net.depth() == 6 and model.config.num_hidden_layers == 6
    assert _layer_positions(net) == list(range(6))  # KV-cache slots follow the positions
    if getattr(model.config, "layer_types", None) is not None:
        assert len(model.config.layer_types) == 6
    with torch.no_grad():
        assert torch.equal(net(x), plain)  # bit-identical: zero projections add exact zeros
        assert torch.equal(net(x, attention_mask=mask), masked)
        again = model.generate(x[:2], attention_mask=mask[:2], max_new_tokens=8, do_sample=False, use_cache=True)
    assert torch.equal(again, tokens)
    # bf16: a model in bfloat16 grows without changing its logits either
    half = growable(tiny_model(arch).to(torch.bfloat16))
    with torch.no_grad():
        before = half(x, attention_mask=mask)
        half.grow("layers.1")
        assert half.stage("layers")[1].mlp.training is False
        assert next(half.stage("layers")[1].parameters()).dtype == torch.bfloat16
        assert torch.equal(half(x, attention_mask=mask), before)


# -- the probe ------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "gpt_neox_sequential", "llama", "qwen2"])
def test_probe_gradient_equals_explicit_insertion_and_the_joint_pass_is_one_at_a_time(arch):
    net = growable(tiny_model(arch, seed=1))
    x, y = _tokens(1, (4, 12)), _tokens(2, (4, 12))
    loader = [(x[:2], y[:2]), (x[2:], y[2:])]  # two batches: ĝ is the mean over all 4 sequences
    report = measure_saturation(net, loader, token_cross_entropy, projected=True)
    assert [r.name for r in report.sites] == ["layers.0", "layers.1", "layers.2"]
    one_at_a_time = {}
    for record in report.sites:
        grown = copy.deepcopy(net)
        layer = grown.grow(record.site, copy.deepcopy(record.block))
        V = grown.terminal_parameters_of(layer)
        grads = torch.autograd.grad(token_cross_entropy(grown(x), y), V)
        one_at_a_time[record.name] = grads
        for g, h in zip(grads, record.grad):
            assert g.shape == h.shape
            torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-6)
        assert record.grad_norm == pytest.approx(float(torch.sqrt(sum(g.pow(2).sum() for g in grads))), rel=1e-4)
    # Joint: every candidate inserted at once gives each the gradient it has alone (Corollary 2).
    joint = copy.deepcopy(net)
    layers = {}
    for record in sorted(report.sites, key=lambda r: -r.site.index):  # deepest first: indices stay valid
        layers[record.name] = joint.grow(record.site, copy.deepcopy(record.block))
    params = [p for name in layers for p in joint.terminal_parameters_of(layers[name])]
    grads = iter(torch.autograd.grad(token_cross_entropy(joint(x), y), params))
    for name, layer in layers.items():
        for alone in one_at_a_time[name]:
            torch.testing.assert_close(next(grads), alone, rtol=1e-4, atol=1e-6)
    # AG at a decoder input (the paper's Pythia quantity): the per-sequence activation gradient norm.
    acts = {}
    handle = net.stage("layers")[1].register_forward_pre_hook(lambda m, a: acts.setdefault("z", a[0].requires_grad_()))
    with torch.enable_grad():
        per_seq = []
        for i in range(4):
            acts.clear()
            loss = token_cross_entropy(net(x[i : i + 1]), y[i : i + 1])
            per_seq.append(torch.autograd.grad(loss, acts["z"])[0].pow(2).sum())
    handle.remove()
    assert report.record("layers.1").ag == pytest.approx(float(torch.stack(per_seq).mean().sqrt()), rel=1e-4)
    assert report.record("layers.1").projected is not None


# -- save_pretrained ------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["gpt2", "gpt_neox", "qwen2"])
def test_grown_model_saves_as_a_plain_hugging_face_checkpoint(arch, tmp_path):
    net = growable(tiny_model(arch))
    net.grow("layers.1")
    net.grow("layers.3")
    with torch.no_grad():  # make the new layers non-trivial, as after training
        for layer in grown_blocks(net):
            for p in net.terminal_parameters_of(layer):
                p.normal_(0, 0.02)
    net.save_pretrained(tmp_path)
    text = (tmp_path / "config.json").read_text()
    assert "growtrain" not in text and json.loads(text).get("num_hidden_layers", json.loads(text).get("n_layer")) == 4
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, local_files_only=True).eval()
    assert type(loaded) is type(net.model) and loaded.config.num_hidden_layers == 4
    x = _tokens(3)
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, net(x), rtol=0, atol=1e-6)
        tokens = net.generate(x[:1], max_new_tokens=6, do_sample=False)
        assert torch.equal(loaded.generate(x[:1], max_new_tokens=6, do_sample=False), tokens)


# -- bad input ------------------------------------------------------------------------------------
def test_unsupported_quantized_frozen_and_position_scaled_models_are_refused():
    with pytest.raises(TypeError, match=r"not a supported .*GPT2LMHeadModel.*LlamaForCausalLM.*register_decoder"):
        growable(torch.nn.Linear(2, 2))
    model = tiny_model("llama")
    model.config.quantization_config = {"quant_method": "bitsandbytes", "load_in_8bit": True}
    with pytest.raises(ValueError, match="quantized"):
        growable(model)
    frozen = tiny_model("llama").requires_grad_(False)
    with pytest.raises(ValueError, match="every weight is frozen.*allow_frozen=True"):
        growable(frozen)
    assert growable(frozen, allow_frozen=True).depth() == 2
    with torch.inference_mode():
        inference = tiny_model("llama")
    with pytest.raises(ValueError, match="inference tensors"):
        growable(inference)
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        growable(tiny_model("gpt2", scale_attn_by_inverse_layer_idx=True))
    net = growable(tiny_model("llama"))
    block = net.new_block("layers.1")
    with torch.no_grad():
        block.layer.mlp.down_proj.weight[0, 0] = 1.0
    with pytest.raises(ValueError, match="must be exactly zero"):
        net.grow("layers.1", block)
    with pytest.raises(ValueError, match="not a candidate site.*layers.0, layers.1, layers.2"):
        net.grow("layers.7")
    assert net.depth() == 2 and net.config.num_hidden_layers == 2 and net.growth_log == []
