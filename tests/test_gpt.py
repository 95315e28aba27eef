"""The transformer half: GPT growth, its probe fast path against brute force, the LM module.

Oracles are independent of ``growtrain.saturation``/``probe_math``: the scored block is really
inserted (``grow(site, block=deepcopy(record.block))``) and differentiated with plain autograd,
or its per-sample Jacobians are built with ``torch.func.jacrev`` and pseudo-inverted with
``torch.linalg.pinv``. Sizes are tiny (d_model 8–16, T 4–16) for the shared 2-core CPU.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch.func import functional_call, jacrev

from growtrain.data.text import TextDataModule
from growtrain.families.gpt import Block
from growtrain.growable import terminal_parameters
from growtrain.lm import LanguageModel, token_cross_entropy
from growtrain.models.gpt import GPT, gpt
from growtrain.saturation import measure_saturation


def tiny_gpt(dtype=torch.float32, seed=0, **kw) -> GPT:
    torch.manual_seed(seed)
    kw = {"n_layer": 2, "d_model": 16, "n_head": 2, "block_size": 16, "vocab_size": 13, **kw}
    return gpt(**kw).to(dtype)


# -- the model and its growth protocol -----------------------------------------------------------
def test_gpt_layout_sites_and_zero_output_block():
    net = tiny_gpt()
    assert [s.name for s in net.sites()] == ["h.0", "h.1", "h.2"]
    assert net.lm_head.weight is net.transformer.wte.weight  # tied
    block = net.new_block("h.1")
    assert isinstance(block, Block)
    names = {id(p): n for n, p in block.named_parameters()}
    assert [names[id(p)] for p in terminal_parameters(block)] == [
        "attn.c_proj.weight", "attn.c_proj.bias", "mlp.c_proj.weight", "mlp.c_proj.bias",
    ]  # fmt: skip
    assert all(torch.count_nonzero(p) == 0 for p in terminal_parameters(block))
    assert block.attn.c_attn.weight.std() > 0.01  # the features keep GPT-2's init
    with pytest.raises(ValueError, match="exceeds block_size"):
        net(torch.zeros(1, 17, dtype=torch.long))
    with pytest.raises(ValueError, match="n_head: must divide d_model"):
        gpt(d_model=10, n_head=4)
    with pytest.raises(ValueError, match="n_layer: expected an integer ≥ 1"):
        gpt(n_layer=0)


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_insertion_preserves_the_function_at_every_site(mode):
    net = tiny_gpt(dropout=0.0)
    net.train(mode == "train")
    x = torch.randint(0, 13, (3, 16))
    with torch.no_grad():
        before = net(x)
    for site in net.sites():
        grown = copy.deepcopy(net)
        grown.grow(site)
        assert grown.depth() == 3 and grown.training == (mode == "train")
        with torch.no_grad():
            after = grown(x)
        # bit-exact: the block adds attn/mlp outputs through zero c_proj maps (exactly 0.0)
        assert torch.equal(after, before), (site.name, (after - before).abs().max().item())
    # grow twice, also at the ends
    grown = copy.deepcopy(net)
    grown.grow("h.0"), grown.grow("h.3"), grown.grow("h.2")
    with torch.no_grad():
        assert torch.equal(grown(x), before)
    assert [r["site"] for r in grown.growth_log] == ["h.0", "h.3", "h.2"]


# -- the probe fast path against brute force -----------------------------------------------------
def probe_setup(bias=True):
    torch.manual_seed(1)
    net = tiny_gpt(torch.float64, seed=1, d_model=8, n_head=2, block_size=4, vocab_size=11, bias=bias).eval()
    x = torch.randint(0, 11, (6, 4))
    y = torch.randint(0, 11, (6, 4))
    loader = [(x[:3], y[:3]), (x[3:], y[3:])]  # n = 6 sequences, two batches of equal size
    report = measure_saturation(net, loader, LanguageModel.probe_loss, projected=True)
    return net, x, y, report


def inserted(net, record):
    grown = copy.deepcopy(net)
    block = grown.grow(record.site, block=copy.deepcopy(record.block))
    return grown, block


@pytest.mark.parametrize("bias", [True, False])
def test_probe_gradient_equals_autograd_after_a_real_insertion(bias):
    net, x, y, report = probe_setup(bias)
    assert [r.name for r in report.sites] == ["h.0", "h.1", "h.2"] and report.n == 6
    for record in report.sites:
        grown, block = inserted(net, record)
        loss = token_cross_entropy(grown(x), y)  # mean over the 6 sequences of their token-mean loss
        grads = torch.autograd.grad(loss, terminal_parameters(block))
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        assert abs(record.grad_norm - norm.item()) <= 1e-5 * norm.item(), record.name
        assert len(record.grad) == (4 if bias else 2)
        for mine, ref in zip(record.grad, grads):
            assert mine.shape == ref.shape
            assert (mine - ref).norm() <= 1e-5 * norm, record.name


def test_projected_value_equals_explicit_jacobians_and_pinv():
    net, x, y, report = probe_setup()
    for record in report.sites:
        grown, block = inserted(net, record)
        inputs = []
        handle = block.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach()))
        loss = token_cross_entropy(grown(x), y)
        handle.remove()
        z = inputs[0]  # (n, T, C): the inserted block's input, sample by sample
        params = terminal_parameters(block)
        grad = torch.cat([g.flatten() for g in torch.autograd.grad(loss, params)])  # ĝ, (p,)
        names = {id(p): n for n, p in block.named_parameters()}
        keys = [names[id(p)] for p in params]
        fixed = {n: p.detach() for n, p in block.named_parameters()}

        def out(values, z_i):
            return functional_call(block, {**fixed, **dict(zip(keys, values))}, (z_i.unsqueeze(0),)).flatten()

        gram = torch.zeros(grad.numel(), grad.numel(), dtype=torch.float64)
        for i in range(z.shape[0]):
            jac = jacrev(out)(tuple(p.detach() for p in params), z[i])  # per tensor: (T·C, *shape)
            J = torch.cat([j.reshape(j.shape[0], -1) for j in jac], dim=1)  # (T·C, p)
            gram += J.T @ J
        gram /= z.shape[0]
        brute = torch.sqrt(grad @ torch.linalg.pinv(gram, hermitian=True) @ grad).item()
        assert abs(record.projected - brute) <= 1e-6 * brute, (record.name, record.projected, brute)
        assert record.projected <= record.ag * (1 + 1e-9)  # V_S ≤ AG (Remark 3)


# -- the LightningModule -------------------------------------------------------------------------
CORPUS = "".join(f"def f{i}(x):\n    return x * {i % 7} + {i % 5}\n" for i in range(400))


@pytest.fixture
def datamodule(tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text(CORPUS)
    return TextDataModule(str(path), block_size=16, batch_size=16, probe_fraction=0.1, val_fraction=0.05,
                          test_fraction=0.05)  # fmt: skip


def tiny_lm(dm, n_layer=1):
    torch.manual_seed(0)
    return LanguageModel(n_layer=n_layer, d_model=16, n_head=2, block_size=16, vocab_size=dm.vocab_size)


def trainer(tmp_path, **kw):
    import lightning

    kw = {"max_epochs": 1, "limit_train_batches": 4, "limit_val_batches": 2, "accelerator": "cpu", "devices": 1,
          "logger": False, "enable_progress_bar": False, "enable_model_summary": False,
          "default_root_dir": str(tmp_path), "gradient_clip_val": 1.0, **kw}  # fmt: skip
    return lightning.Trainer(**kw)


def test_paper_optimizer_groups_exempt_biases_norms_and_embeddings(datamodule):
    model = tiny_lm(datamodule)
    opt = model.configure_optimizers()
    assert isinstance(opt, torch.optim.AdamW) and opt.defaults["betas"] == (0.9, 0.95)
    groups = {g["name"]: g for g in opt.param_groups}
    assert groups["base"]["weight_decay"] == 0.1 and groups["base/no_decay"]["weight_decay"] == 0.0
    no_decay = {id(p) for p in groups["base/no_decay"]["params"]}
    net = model.network
    assert id(net.transformer.wte.weight) in no_decay and id(net.transformer.wpe.weight) in no_decay
    assert id(net.transformer.h[0].ln_1.weight) in no_decay and id(net.transformer.h[0].attn.c_attn.bias) in no_decay
    assert id(net.transformer.h[0].attn.c_attn.weight) not in no_decay


def test_checkpoint_round_trip_rebuilds_the_grown_depth(datamodule, tmp_path):
    model = tiny_lm(datamodule, n_layer=1)
    t = trainer(tmp_path)
    t.fit(model, datamodule)
    assert {"train_loss", "train_ppl", "val_loss", "val_ppl"} <= set(t.callback_metrics)
    ppl, loss = t.callback_metrics["val_ppl"], t.callback_metrics["val_loss"]
    assert torch.allclose(ppl, loss.exp(), rtol=1e-4)
    block = model.network.grow("h.0")
    with torch.no_grad():  # make the grown block non-trivial so the load must restore it
        for p in terminal_parameters(block):
            p.normal_(0, 0.02)
    path = tmp_path / "grown.ckpt"
    t.save_checkpoint(path)
    loaded = LanguageModel.load_from_checkpoint(path)
    assert loaded.network.depth() == 2 and loaded.network.growth_log == model.network.growth_log
    x, _ = next(iter(datamodule.val_dataloader()))
    model.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(model(x), loaded(x))


def test_fit_grows_and_resumes_with_the_grown_depth(datamodule, tmp_path):
    from growtrain.callbacks import GrowUntilSaturated

    grow = GrowUntilSaturated(schedule="periodic", decision="trial", delta=0.0, t=1e-6, max_growths=1)
    model = tiny_lm(datamodule, n_layer=1)
    # no automatic checkpoints: the resume below is from the one saved by hand (a ModelCheckpoint's
    # state in it would make Lightning warn that the resumed run's checkpoint folder differs)
    t = trainer(tmp_path, max_epochs=2, callbacks=[grow], enable_checkpointing=False)
    t.fit(model, datamodule)
    assert model.network.depth() == 2 and len(model.network.growth_log) == 1
    assert any(h["site"] is not None for h in grow.history)
    path = tmp_path / "after_growth.ckpt"
    t.save_checkpoint(path)
    resumed = tiny_lm(datamodule, n_layer=1)
    again = GrowUntilSaturated(schedule="periodic", decision="trial", delta=0.0, t=1e-6, max_growths=1)
    t2 = trainer(tmp_path / "resume", max_epochs=3, callbacks=[again])
    t2.fit(resumed, datamodule, ckpt_path=str(path))
    assert resumed.network.depth() == 2  # rebuilt from the checkpoint; max_growths already used
    assert t2.global_step > t.global_step  # it trained on after the resume
    assert LanguageModel.load_from_checkpoint(path).network.depth() == 2
