"""Hugging Face decoders: growth, the probe against explicit insertion, save/load, fit + resume.

Every model is a tiny random config built here (hidden 32, 2 layers, vocabulary 64; nothing
downloads). Oracles are independent of ``growtrain.saturation``: a scored candidate is really
inserted into a copy of the model and differentiated with plain autograd.
"""

from __future__ import annotations

import copy
import json
import math
import shutil

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
        tokens = half.generate(x[:2], attention_mask=mask[:2], max_new_tokens=8, do_sample=False)
        half.grow("layers.1")
        assert half.stage("layers")[1].mlp.training is False
        assert next(half.stage("layers")[1].parameters()).dtype == torch.bfloat16
        assert torch.equal(half(x, attention_mask=mask), before)
        assert torch.equal(half.generate(x[:2], attention_mask=mask[:2], max_new_tokens=8, do_sample=False), tokens)


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


# -- training: GrowUntilSaturated inside Trainer.fit, checkpoint, resume ----------------------------
@pytest.fixture
def llama_dir(tmp_path):
    path = tmp_path / "tiny-llama"
    tiny_model("llama", vocab=256, hidden=16, heads=2).save_pretrained(path)
    return path


def _text_data():
    from growtrain.data.text import TextDataModule

    return TextDataModule(tokenizer="byte", max_chars=6000, block_size=16, batch_size=8, eval_batch_size=32,
                          probe_fraction=0.1, val_fraction=0.05, test_fraction=0.0)  # fmt: skip


# Resumed into the checkpoint folder of the run it continues, as a user resumes: Lightning warns
# that the folder is not empty. Its noise, not growtrain's; filtered for this test only.
@pytest.mark.filterwarnings(
    r"ignore:Checkpoint directory .* exists and is not empty:UserWarning:lightning\.pytorch\.callbacks\.model_checkpoint"
)
def test_fit_grows_the_hf_model_with_zero_state_and_resumes_at_the_grown_depth(llama_dir, tmp_path, quiet_trainer_kwargs):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from growtrain import GrowUntilSaturated
    from growtrain.hf import HFCausalLM

    def trainer(epochs, grow):
        ckpt = ModelCheckpoint(dirpath=tmp_path / "ckpt", save_last=True)
        kw = {**quiet_trainer_kwargs, "enable_checkpointing": True}
        return L.Trainer(max_epochs=epochs, limit_train_batches=3, limit_val_batches=1, callbacks=[grow, ckpt], **kw)

    # t tiny: any nonzero Γ̂ exceeds δ + t, so every check grows (the decision itself is tested elsewhere)
    grow = GrowUntilSaturated(rule="paper", t=1e-9, schedule="periodic", max_growths=2, decision="rule",
                              verbose=False)
    module = HFCausalLM(str(llama_dir))
    base = {id(p) for p in module.parameters()}
    first = trainer(2, grow)
    first.fit(module, datamodule=_text_data())
    net = module.network
    assert net.depth() == 4 and net.config.num_hidden_layers == 4 and len(net.growth_log) == 2
    assert _layer_positions(net) == [0, 1, 2, 3]
    optimizer = first.optimizers[0]
    names = [g.get("name") for g in optimizer.param_groups]
    assert any(n and n.startswith("growth0") for n in names) and any(n and n.startswith("growth1") for n in names)
    new = [p for layer in grown_blocks(net) for p in layer.parameters()]
    assert new and all(id(p) not in base for p in new)  # the new layers' parameters, by identity
    grouped = {id(p) for g in optimizer.param_groups if str(g.get("name")).startswith("growth") for p in g["params"]}
    assert {id(p) for p in new} == grouped
    # The second growth happened at the last epoch's end: its layer has no optimizer state yet.
    assert all(p not in optimizer.state for p in grown_blocks(net)[1].parameters())
    # Resume into a fresh module loaded from the same directory (original depth): replayed, then loaded.
    last = tmp_path / "first.ckpt"
    shutil.copy(tmp_path / "ckpt" / "last.ckpt", last)
    resumed = HFCausalLM(str(llama_dir))
    assert resumed.network.depth() == 2
    grow2 = GrowUntilSaturated(rule="paper", t=1e-9, schedule="periodic", max_growths=2,
                               decision="rule", verbose=False)
    trainer(3, grow2).fit(resumed, datamodule=_text_data(), ckpt_path=str(last))
    assert resumed.network.depth() == 4 and [r["site"] for r in resumed.network.growth_log] == [
        r["site"] for r in net.growth_log
    ]
    reloaded = HFCausalLM.load_from_checkpoint(str(last))
    assert reloaded.network.depth() == 4
    x = _tokens(5, (2, 16)) * 3
    with torch.no_grad():
        torch.testing.assert_close(reloaded.eval()(x), module.eval()(x), rtol=0, atol=0)
    # The grown model is a plain Hugging Face checkpoint.
    module.save_pretrained(str(tmp_path / "grown"))
    plain = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "grown", local_files_only=True).eval()
    with torch.no_grad():
        torch.testing.assert_close(plain(x).logits, module(x), rtol=0, atol=1e-6)


def test_hf_causal_lm_refuses_a_missing_or_remote_model_path(tmp_path):
    from growtrain.hf import HFCausalLM

    with pytest.raises(FileNotFoundError, match="never downloads.*hf download"):
        HFCausalLM("EleutherAI/pythia-160m")
    with pytest.raises(ValueError, match="give exactly one"):
        HFCausalLM()


def test_hf_causal_lm_refuses_data_with_a_larger_vocabulary_before_training(quiet_trainer_kwargs):
    import lightning as L

    from growtrain.hf import HFCausalLM

    module = HFCausalLM(model=tiny_model("llama"))  # vocabulary 64; byte tokens need 256
    with pytest.raises(ValueError, match="vocab_size: the datamodule's tokenizer has 256 tokens .* 64"):
        L.Trainer(max_epochs=1, **quiet_trainer_kwargs).fit(module, datamodule=_text_data())


def test_measure_cli_scores_a_local_hf_model_directory(llama_dir, tmp_path):
    from growtrain.cli import GrowtrainCLI

    out = tmp_path / "measure"
    GrowtrainCLI(args=[
        "measure", "--model=growtrain.hf.HFCausalLM", f"--model.pretrained={llama_dir}",
        "--data=growtrain.data.text.TextDataModule", "--data.tokenizer=byte", "--data.max_chars=6000",
        "--data.block_size=16", "--data.probe_fraction=0.1", "--trainer.logger=false", f"--output_dir={out}",
    ])  # fmt: skip
    saved = json.loads((out / "measure.json").read_text())
    assert [s["site"] for s in saved["sites"]] == ["layers.0", "layers.1", "layers.2"]
    assert all(s["ag"] > 0 and s["dim"] == 16 * 16 for s in saved["sites"])  # N_l = T × hidden


def test_hf_text_datamodule_tokenizes_with_a_local_tokenizer_directory(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    from growtrain.hf import HFTextDataModule

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 40)
    vocab = {"[UNK]": 0, "def": 1, "f": 2, "(": 3, "x": 4, "):": 5, ":": 6, "return": 7, "+": 8, "1": 9}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]").save_pretrained(tmp_path / "tok")
    dm = HFTextDataModule(path=str(corpus), tokenizer=str(tmp_path / "tok"), block_size=8, batch_size=4,
                          probe_fraction=0.2, val_fraction=0.1, test_fraction=0.0)  # fmt: skip
    dm.setup("fit")
    assert dm.vocab_size == 10 and dm.tokens[:9].tolist() == [1, 2, 3, 4, 5, 7, 4, 8, 9]
    x, y = next(iter(dm.probe_dataloader()))
    assert x.shape == (4, 8) and torch.equal(x[:, 1:], y[:, :-1])
    assert dm.state_dict()["split"]["tokenizer"] == "hf:tok:10"
    with pytest.raises(FileNotFoundError, match="tokenizer: expected 'byte', 'char' or a local directory"):
        HFTextDataModule(path=str(corpus), tokenizer="EleutherAI/pythia-160m")


def test_an_unregistered_class_is_refused_until_register_decoder_names_its_layout():
    from growtrain.hf import DECODERS, DecoderSpec, register_decoder

    class MyForCausalLM(transformers.LlamaForCausalLM):
        pass

    model = MyForCausalLM(tiny_model("llama").config).eval()
    with pytest.raises(TypeError, match="MyForCausalLM is not a supported.*layers.*attn_out.*mlp_out.*layer_idx"):
        growable(model)
    try:
        register_decoder("MyForCausalLM", DecoderSpec("model.layers", "self_attn.o_proj", "mlp.down_proj", ("self_attn.layer_idx",)))
        net = growable(model)
        x = _tokens(4)
        with torch.no_grad():
            before = net(x)
            net.grow("layers.2")
            assert torch.equal(net(x), before) and net.config.num_hidden_layers == 3
    finally:
        DECODERS.pop("MyForCausalLM", None)


def test_existing_layers_expose_their_output_projections():
    from growtrain.growable import terminal_parameters

    net = growable(tiny_model("gpt_neox"))
    layer = net.stage("layers")[1]
    assert [id(p) for p in terminal_parameters(layer)] == [id(p) for p in (
        layer.attention.dense.weight, layer.attention.dense.bias, layer.mlp.dense_4h_to_h.weight, layer.mlp.dense_4h_to_h.bias,
    )]  # fmt: skip
    assert "terminal_parameters" not in "".join(net.model.state_dict())  # not a parameter, not saved
    copied = copy.deepcopy(net).stage("layers")[1]
    assert terminal_parameters(copied)[0] is copied.attention.dense.weight  # a copy answers with its own


def test_mixed_layer_types_follow_their_layers_and_the_probe_uses_each_positions_mask():
    # Qwen2 with a sliding window from layer 1 on: layer_types = [full, sliding], per-layer masks.
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=4, max_window_layers=1)
    assert model.config.layer_types == ["full_attention", "sliding_attention"]
    net = growable(model)
    x, y = _tokens(8, (4, 12)), _tokens(9, (4, 12))
    with torch.no_grad():
        before = net(x)
        tokens = model.generate(x[:1], max_new_tokens=6, do_sample=False)
    net.grow("layers.1")  # in front of a sliding layer: sliding
    net.grow("layers.0")  # in front of the full layer: full
    assert model.config.layer_types == ["full_attention", "full_attention", "sliding_attention", "sliding_attention"]
    assert [layer.self_attn.sliding_window for layer in model.model.layers] == [None, None, 4, 4]
    with torch.no_grad():
        assert torch.equal(net(x), before)
        assert torch.equal(model.generate(x[:1], max_new_tokens=6, do_sample=False), tokens)
    report = measure_saturation(net, [(x, y)], token_cross_entropy, projected=False)
    for name in ("layers.1", "layers.3"):  # a full-attention and a sliding-window candidate
        record = report.record(name)
        grown = copy.deepcopy(net)
        layer = grown.grow(record.site, copy.deepcopy(record.block))
        grads = torch.autograd.grad(token_cross_entropy(grown(x), y), grown.terminal_parameters_of(layer))
        for g, h in zip(grads, record.grad):
            torch.testing.assert_close(h, g, rtol=1e-4, atol=1e-6)


def test_probe_under_bf16_autocast_agrees_with_float32():
    # bf16-mixed training probes under autocast: the candidate layers run in bf16 inside the hooks.
    net = growable(tiny_model("gpt_neox", seed=2))
    x, y = _tokens(10, (4, 12)), _tokens(11, (4, 12))
    exact = measure_saturation(net, [(x, y)], token_cross_entropy, projected=False)
    mixed = measure_saturation(net, [(x, y)], token_cross_entropy, projected=False, autocast_dtype=torch.bfloat16)
    for a, b in zip(exact.sites, mixed.sites):
        assert b.grad_norm == pytest.approx(a.grad_norm, rel=0.05) and b.ag == pytest.approx(a.ag, rel=0.05)
        assert all(g.dtype == torch.float32 for g in b.grad)  # reported in the weights' dtype


def test_undo_growth_restores_the_config_and_cache_indices():
    """A rolled-back insertion (the callback's FunctionChangedError path) leaves the raw model
    consistent at once: layer count in the config and every layer's KV-cache index."""
    model = tiny_model("llama")
    net = growable(model)
    before = (model.config.num_hidden_layers, _layer_positions(net))
    inserted = [net.grow("layers.1"), net.grow("layers.0")]
    assert model.config.num_hidden_layers == before[0] + 2
    net.undo_growth(inserted, 0)
    assert (model.config.num_hidden_layers, _layer_positions(net)) == before
    assert net.growth_log == []


@pytest.mark.parametrize("which", ["hf", "gpt"])
def test_epoch_loss_and_perplexity_are_token_weighted(which, llama_dir):
    """Batches of unequal token counts: the epoch loss is Σ n_b L_b / Σ n_b and the perplexity its
    exp (a plain per-batch mean — what MeanMetric with its weights dropped gave — differs)."""
    from growtrain.hf import HFCausalLM
    from growtrain.lm import LanguageModel

    module = HFCausalLM(pretrained=str(llama_dir)) if which == "hf" else LanguageModel(vocab_size=256, n_layer=1,
                                                                                        d_model=16, n_head=2)
    module.log = lambda *a, **k: None  # no trainer here
    batches = [(_tokens(1, (4, 12)) % 64, _tokens(2, (4, 12)) % 64), (_tokens(3, (1, 5)) % 64, _tokens(4, (1, 5)) % 64)]
    with torch.no_grad():
        losses = [float(module._shared_step(b, "val")) for b in batches]
    counts = [b[1].numel() for b in batches]
    expected = sum(n * l for n, l in zip(counts, losses)) / sum(counts)
    assert float(module.metrics["val_loss"].compute()) == pytest.approx(expected, rel=1e-5)
    assert float(module.metrics["val_ppl"].compute()) == pytest.approx(math.exp(expected), rel=1e-5)
    assert abs(expected - sum(losses) / 2) > 1e-4  # the two batches' losses do differ


def test_the_trial_decision_on_a_hf_decoder_leaves_it_bit_for_bit(llama_dir, quiet_trainer_kwargs):
    """decision='trial' on the tiny HF Llama: the trial layer trains alone and is taken out again
    (min_gain 500 %: no trial can pay), so the model after the check is the model before it."""
    import copy

    import lightning as L

    from growtrain import GrowUntilSaturated, Trial
    from growtrain.hf import HFCausalLM

    class Before(L.Callback):  # runs before the grower: the state the check sees
        def on_train_epoch_end(self, trainer, pl_module):
            self.state = copy.deepcopy(pl_module.state_dict())

    before = Before()
    grow = GrowUntilSaturated(schedule="periodic", decision=Trial(min_gain=5.0), verbose=False)  # fmt: skip
    module = HFCausalLM(str(llama_dir))
    trainer = L.Trainer(max_epochs=1, limit_train_batches=3, limit_val_batches=1, callbacks=[before, grow],
                        **quiet_trainer_kwargs)  # fmt: skip
    trainer.fit(module, datamodule=_text_data())
    trial = grow.history[0]["trial"]
    assert grow.history[0]["action"] == "saturated" and trial["trials"] and not trial["trials"][0]["diverged"]
    after = module.state_dict()
    assert list(after) == list(before.state) and all(torch.equal(after[k], before.state[k]) if torch.is_tensor(after[k]) else after[k] == before.state[k]
                                                             for k in after)
    assert module.network.depth() == 2 and module.network.growth_log == []
