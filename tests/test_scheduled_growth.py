"""GrowUntilSaturated(schedule=Plan(...)) and its insertions (zero, MSG mask ramp, G_stack copy, copy behind the ramp), checked
against explicit computations: the masked network against a hand-written mix of the block's plain
forward, the copy against the neighbour's tensors, optimizer state by Adam's own step counts; the plan
refused before training; a checkpoint written mid-ramp loads as the network that was trained.
(growtrain/insertion.py on every family: tests/test_insertion.py.)"""

from __future__ import annotations

import shutil

import pytest
import torch

from growtrain.growable import grown_blocks
from growtrain.insertion import MaskRamp, copy_neighbour, detach_mask, draw_terminal, mask_value, neighbour_block
from growtrain.models.gpt import GPT, GPTConfig


def _gpt(n_layer=2, seed=0) -> GPT:
    torch.manual_seed(seed)
    return GPT(GPTConfig(n_layer=n_layer, d_model=16, n_head=2, block_size=8, vocab_size=32))


def _explicit(net: GPT, idx: torch.Tensor, masks: dict[int, float]) -> torch.Tensor:
    """The network's forward written out, each masked block as x + m·(plain block(x) − x)."""
    t = net.transformer
    x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
    for block in t.h:
        y = type(block).forward(block, x)  # the class's forward: no hooks
        m = masks.get(id(block))
        x = y if m is None else x + m * (y - x)
    return net.lm_head(t.ln_f(x))


def test_mask_ramp_is_the_network_at_insertion_then_mixes_the_block_in_linearly():
    net = _gpt().eval()
    idx = torch.randint(0, 32, (3, 8))
    with torch.no_grad():
        before = net(idx)
    block = net.grow("h.1")
    draw_terminal(net, block, torch.Generator().manual_seed(1))
    ramp = MaskRamp(steps=4)
    ramp.add(block, start=10)
    with torch.no_grad():
        torch.testing.assert_close(net(idx), before, rtol=0, atol=1e-6)  # m = 0: function-preserving
        assert not torch.allclose(_explicit(net, idx, {}), before, atol=1e-3)  # the drawn block does change it
        for step, m in ((11, 0.25), (12, 0.5), (13, 0.75)):
            ramp.set_step(step)
            assert ramp.mask(block) == m
            torch.testing.assert_close(net(idx), _explicit(net, idx, {id(block): m}), rtol=1e-6, atol=1e-6)
        ramp.set_step(14)
        assert ramp.mask(block) is None and len(ramp) == 0  # at m = 1 the hook is gone
        assert not block._forward_hooks
        torch.testing.assert_close(net(idx), _explicit(net, idx, {}), rtol=1e-6, atol=1e-6)


def test_draw_terminal_takes_the_neighbours_scale_and_leaves_biases_zero():
    net = _gpt()
    with torch.no_grad():
        for p in net.transformer.h[0].terminal_parameters():
            if p.dim() == 2:
                p.mul_(7.0)  # a trained neighbour with a scale of its own
    block = net.grow("h.1")
    assert neighbour_block(net, block) is net.transformer.h[0]
    draw_terminal(net, block, torch.Generator().manual_seed(0))
    for p, q in zip(block.terminal_parameters(), net.transformer.h[0].terminal_parameters()):
        if p.dim() == 1:
            assert torch.count_nonzero(p) == 0
        else:
            assert 0.8 < float(p.detach().std() / q.detach().std()) < 1.25  # 256 or 1024 draws of N(0, std(q)²)
    again = _gpt()
    with torch.no_grad():
        for p in again.transformer.h[0].terminal_parameters():
            if p.dim() == 2:
                p.mul_(7.0)
    other = again.grow("h.1")
    draw_terminal(again, other, torch.Generator().manual_seed(0))
    for p, q in zip(block.parameters(), other.parameters()):
        assert torch.equal(p, q)  # seeded: the same draw on every run and rank


def test_copy_takes_every_tensor_of_the_block_below_or_above_at_the_bottom():
    net = _gpt(n_layer=2)
    top = net.grow("h.2")
    ids = [id(p) for p in top.parameters()]
    copy_neighbour(net, top)
    assert [id(p) for p in top.parameters()] == ids  # in place: the optimizer's references hold
    for (name, p), q in zip(top.state_dict().items(), net.transformer.h[1].state_dict().values()):
        assert torch.equal(p, q), name
    bottom = net.grow("h.0")
    copy_neighbour(net, bottom)
    for p, q in zip(bottom.state_dict().values(), net.transformer.h[1].state_dict().values()):
        assert torch.equal(p, q)  # the old h.0, now h.1
    lone = _gpt(n_layer=1)
    with torch.no_grad():
        lone.transformer.h[0].zero_init_last()
    fresh = lone.grow("h.1")
    with pytest.raises(ValueError, match="no trained neighbour"):
        copy_neighbour(lone, fresh)


def test_schedule_sites_stack_on_top_or_interleave():
    from growtrain.callbacks.scheduled import schedule_sites

    assert schedule_sites(3, 3, "interleave") == ["h.1", "h.2", "h.3"]  # one after each block: depth doubles
    assert schedule_sites(4, 2, "interleave") == ["h.2", "h.4"]
    assert schedule_sites(3, 2, "last") == ["h.3", "h.4"]
    assert schedule_sites(3, 2, "first") == ["h.0", "h.0"]
    with pytest.raises(ValueError, match="at most 2 at once"):
        schedule_sites(2, 3, "interleave")


def test_wsd_factor_is_warmup_flat_then_linear_decay():
    from growtrain.optim import WarmupStableDecay, wsd_factor

    f = [wsd_factor(s, warmup_steps=2, total_steps=10, decay_steps=4, min_lr_ratio=0.1) for s in range(12)]
    expected = [0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1 - 0.9 * 0.25, 1 - 0.9 * 0.5, 1 - 0.9 * 0.75, 0.1, 0.1]
    assert f == pytest.approx(expected)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=2.0)
    with pytest.raises(ValueError, match="warmup_steps \\+ decay_steps <= total_steps"):
        WarmupStableDecay(opt, warmup_steps=5, total_steps=8, decay_steps=4)


def GrowOnSchedule(*, at, blocks=1, site="last", ramp_steps=100, insertion="zero", **kw):
    """The plan schedule with these options (``Plan``'s and the callback's)."""
    from growtrain import GrowUntilSaturated, Plan

    return GrowUntilSaturated(schedule=Plan(at=at, blocks=blocks, site=site, ramp_steps=ramp_steps), insertion=insertion,
                              **kw)  # fmt: skip


def _growths(cb) -> list[dict]:
    """Each planned growth's record: the plan's figures with the step, the sites and the depth after it."""
    return [{**h["plan"], "step": h["step"], "sites": h["sites"], "depth": h["depth"],
             "function_preserving": h["function_preserving"]} for h in cb.history]  # fmt: skip


# -- the plan inside Trainer.fit ------------------------------------------------------------------
def _text_data():
    from growtrain.data.text import TextDataModule

    return TextDataModule(tokenizer="byte", max_chars=6000, block_size=16, batch_size=8, eval_batch_size=32,
                          probe_fraction=0.1, val_fraction=0.05, test_fraction=0.0)  # fmt: skip


def _lm(n_layer=1):
    import functools

    from growtrain.lm import LanguageModel

    torch.manual_seed(0)
    return LanguageModel(n_layer=n_layer, d_model=16, n_head=2, block_size=16, vocab_size=256,
                         optimizer=functools.partial(torch.optim.AdamW, lr=1e-2))  # fmt: skip


def _trainer(tmp_path, callbacks, quiet, **kw):
    import lightning as L

    return L.Trainer(limit_train_batches=4, limit_val_batches=1, callbacks=callbacks, **{**quiet, **kw})


@pytest.mark.parametrize("insertion", ["zero", "copy"])
def test_grows_at_the_fractions_with_fresh_optimizer_state(insertion, tmp_path, quiet_trainer_kwargs, caplog):
    import logging

    grow = GrowOnSchedule(at=[0.25, 0.5], insertion=insertion, verbose=True)
    module = _lm()
    trainer = _trainer(tmp_path, [grow], quiet_trainer_kwargs, max_steps=12)
    with caplog.at_level(logging.INFO):
        trainer.fit(module, datamodule=_text_data())
    assert grow.run.steps == [3, 6] and [g["step"] for g in _growths(grow)] == [3, 6]
    assert [g["sites"] for g in _growths(grow)] == [["h.1"], ["h.2"]] and module.network.depth() == 3
    assert [h["depth_before"] for h in grow.history] == [1, 2] and grow.inserted == 2  # each record's depth before it
    # the printed line (rank_zero_info) is not asserted here: an earlier test in the same worker can cut
    # Lightning's rank-zero logger off from caplog; the record it prints from is checked below
    assert all(g["tolerance"] >= 1e-5 for g in _growths(grow))  # float32's, times the logits' scale when above 1
    if insertion == "zero":
        assert all(g["max_abs_change"] <= 1e-6 and g["function_preserving"] is True for g in _growths(grow))
    else:  # a copy changes the function, and says so
        assert all(g["max_abs_change"] > 1e-3 and g["function_preserving"] is False for g in _growths(grow))
    optimizer = trainer.optimizers[0]
    names = [g.get("name") for g in optimizer.param_groups]
    assert any(str(n).startswith("growth0") for n in names) and any(str(n).startswith("growth1") for n in names)
    # Adam counts each parameter's own steps: 12 for the base, 12 − 3 and 12 − 6 for the grown blocks —
    # their state began at zero when they went in (a copied state would count 12)
    steps = lambda p: int(optimizer.state[p]["step"])  # noqa: E731
    assert steps(module.network.transformer.wte.weight) == 12
    first, second = grown_blocks(module.network)
    assert {steps(p) for p in first.parameters()} == {9} and {steps(p) for p in second.parameters()} == {6}


@pytest.mark.filterwarnings(
    r"ignore:Checkpoint directory .* exists and is not empty:UserWarning:lightning\.pytorch\.callbacks\.model_checkpoint"
)
@pytest.mark.parametrize("insertion", ["mask_ramp", "copy_ramp"])
def test_a_fit_cut_mid_ramp_resumes_with_the_mask_where_it_was(insertion, tmp_path, quiet_trainer_kwargs):
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    from growtrain.callbacks import RandomStateCheckpoint

    class Crash(L.Callback):
        def on_train_epoch_start(self, trainer, pl_module):
            if trainer.current_epoch == 1:  # after the first 4-step epoch: m = (4 − 2) / 6 at the cut
                raise RuntimeError("simulated crash")

    def fit(ckpt=None, folder="a", crash=False):
        L.seed_everything(0)
        grow = GrowOnSchedule(at=[2], insertion=insertion, ramp_steps=6, verbose=False)
        cb = [grow, RandomStateCheckpoint(), ModelCheckpoint(dirpath=tmp_path / folder, save_last=True, every_n_epochs=1)]
        module = _lm()
        kw = {**quiet_trainer_kwargs, "enable_checkpointing": True, "limit_val_batches": 0, "deterministic": True}
        trainer = L.Trainer(limit_train_batches=4, max_epochs=3, callbacks=cb + ([Crash()] if crash else []), **kw)
        if crash:
            with pytest.raises(RuntimeError, match="simulated crash"):
                trainer.fit(module, datamodule=_text_data())
        else:
            trainer.fit(module, datamodule=_text_data(), ckpt_path=ckpt)
        return module, grow

    whole, _ = fit()
    fit(folder="cut", crash=True)
    shutil.copy(tmp_path / "cut" / "last.ckpt", tmp_path / "cut.ckpt")
    resumed, grow = fit(ckpt=str(tmp_path / "cut.ckpt"), folder="b")
    assert resumed.network.depth() == 2 and len(grow.run._ramp) == 0  # ramped to 1 by step 8, the hook removed
    for p, q in zip(whole.state_dict().values(), resumed.state_dict().values()):
        if isinstance(p, torch.Tensor):
            assert torch.equal(p, q)  # the uninterrupted fit, bit for bit: the ramp went on where it was
    record = _growths(grow)[0]
    assert record == {"step": 2, "sites": ["h.1"], "depth": 2, "insertion": insertion, "max_abs_change": 0.0,
                      "tolerance": record["tolerance"], "function_preserving": True,
                      **({"zero": []} if insertion == "copy_ramp" else {})}  # m = 0: x + 0·(y − x) is x exactly
    saved = torch.load(tmp_path / "cut.ckpt", weights_only=False)
    (state,) = [v["plan"] for k, v in saved["callbacks"].items() if k.startswith("GrowUntilSaturated")]
    assert state["ramps"] == [{"k": 0, "start": 2}] and grow.state_dict()["plan"]["ramps"] == []  # kept mid-ramp, dropped at 1
    # the network's own state holds the mask the cut fit last trained with (step 3's: (3 − 2) / 6), a tensor
    mask = saved["state_dict"]["network.transformer.h.1.growtrain_mask"]
    assert isinstance(mask, torch.Tensor) and float(mask) == pytest.approx(1 / 6)
    assert not any(k.endswith("growtrain_mask") for k in resumed.state_dict())  # ramped to 1: the key is gone


def test_with_gradient_accumulation_a_growth_comes_right_after_an_optimizer_step(tmp_path, quiet_trainer_kwargs):
    grow = GrowOnSchedule(at=[2], verbose=False)
    module = _lm()
    trainer = _trainer(tmp_path, [grow], quiet_trainer_kwargs, max_steps=4, accumulate_grad_batches=2)
    trainer.fit(module, datamodule=_text_data())
    assert [g["step"] for g in _growths(grow)] == [2] and trainer.global_step == 4
    (block,) = grown_blocks(module.network)
    # two optimizer steps after the growth, each over two whole micro-batches: Adam counted 2 for the block
    assert {int(trainer.optimizers[0].state[p]["step"]) for p in block.parameters()} == {2}


def test_bad_arguments_are_refused_with_the_fix(tmp_path, quiet_trainer_kwargs):
    from growtrain import GrowUntilSaturated

    for kwargs, match in (({"at": []}, "non-empty list"), ({"at": [0.5, 2]}, "all fractions"),
                          ({"at": [1.5]}, "all fractions"), ({"at": [0.4, 0.2]}, "strictly increasing"),
                          ({"at": [0.1, 0.2], "blocks": [1]}, "one per point"), ({"at": [0.1], "site": "middle"}, "site"),
                          ({"at": [0.1], "insertion": "random"}, "insertion: expected one of"),
                          ({"at": [0.1], "ramp_steps": 0}, "ramp_steps")):  # fmt: skip
        with pytest.raises(ValueError, match=match):
            GrowOnSchedule(**kwargs)
    from growtrain import Plan

    with pytest.raises(ValueError, match=r"decision: expected None with schedule=Plan\(\.\.\.\).*Fix: drop decision"):
        GrowUntilSaturated(schedule=Plan(at=[0.5]), decision="trial")
    with pytest.raises(ValueError, match="lr_schedule: expected None under schedule='plan'"):
        GrowUntilSaturated(schedule=Plan(at=[0.5]), lr_schedule="anneal")


@pytest.mark.parametrize("insertion", ["mask_ramp", "copy"])
def test_a_hugging_face_decoder_grows_on_schedule(insertion, tmp_path, quiet_trainer_kwargs):
    from growtrain.hf import HFCausalLM
    from growtrain.hf.tiny import tiny_model

    module = HFCausalLM(model=tiny_model("llama", vocab=256, hidden=16, heads=2))
    grow = GrowOnSchedule(at=[2], blocks=2, site="interleave", insertion=insertion, ramp_steps=3, verbose=False)
    _trainer(tmp_path, [grow], quiet_trainer_kwargs, max_steps=4).fit(module, datamodule=_text_data())
    net = module.network
    assert net.depth() == 4 and net.config.num_hidden_layers == 4
    (record,) = _growths(grow)
    assert record["sites"] == ["layers.1", "layers.2"]  # one after each of the two layers
    if insertion == "mask_ramp":
        assert record["max_abs_change"] <= 1e-5 and len(grow.run._ramp) == 2  # m = 2/3 at the end: both still masked
        assert all(torch.count_nonzero(p) > 0 for b in grown_blocks(net) for p in net.terminal_parameters_of(b)
                   if p.dim() == 2)  # fmt: skip
    else:
        assert record["max_abs_change"] > 1e-4


# -- the shipped config: the study's grow-zero arm, runnable ----------------------------------------------
CONFIG = __import__("pathlib").Path(__file__).resolve().parents[1] / "configs" / "gpt_budget.yaml"


def test_the_budget_config_is_the_studys_grow_copy_wsd_arm():
    import importlib.util

    import yaml

    spec = importlib.util.spec_from_file_location("lm_budget", CONFIG.parents[1] / "experiments" / "lm_budget.py")
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    cfg = yaml.safe_load(CONFIG.read_text())
    arm = study.arm_spec("grow-copy-wsd")
    steps = study.steps_for(arm, 19.2e12)  # the study's default budget, as the config's comment says
    assert cfg["trainer"]["max_steps"] == steps
    grow = next(c["init_args"] for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("GrowUntilSaturated"))
    grow = {**grow, **grow["schedule"]["init_args"]}  # the plan's options and the callback's insertion
    assert grow["schedule"]["class_path"] == "growtrain.Plan"
    assert grow["at"] == arm["at"] and grow["site"] == arm["site"] and grow["insertion"] == arm["insertion"]
    assert grow["blocks"] == arm["blocks"] and arm["schedule"] == "wsd"
    model, data = cfg["model"]["init_args"], cfg["data"]["init_args"]
    assert (model["n_layer"], model["d_model"], model["n_head"], model["block_size"]) == (
        arm["start"], study.D_MODEL, study.N_HEAD, study.BLOCK)
    assert model["optimizer"]["init_args"]["lr"] == study.LR and data["batch_size"] == study.BATCH
    sched = model["lr_scheduler"]["init_args"]
    assert model["lr_scheduler"]["class_path"] == "growtrain.optim.WarmupStableDecay"
    assert sched["total_steps"] == steps and sched["warmup_steps"] == max(1, steps // 100)
    assert sched["decay_steps"] == steps // 5
    assert cfg["trainer"]["limit_train_batches"] == study.EPOCH_STEPS


def test_the_budget_config_runs_and_grows_at_its_fractions(tmp_path):
    from growtrain.cli import GrowtrainCLI

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    cli = GrowtrainCLI(args=["fit", f"--config={CONFIG}", "--trainer.max_steps=20", "--trainer.limit_train_batches=5",
                             "--trainer.limit_val_batches=1", "--trainer.logger=false", "--trainer.enable_progress_bar=false",
                             f"--trainer.default_root_dir={tmp_path / 'run'}", f"--data.init_args.path={corpus}",
                             "--data.init_args.block_size=16", "--model.init_args.block_size=16", "--data.init_args.batch_size=4",
                             "--data.init_args.val_fraction=0.1", "--data.init_args.probe_fraction=0.1",
                             "--data.init_args.test_fraction=0.1", "--model.init_args.d_model=16",
                             "--model.init_args.lr_scheduler.init_args.total_steps=20",
                             "--model.init_args.lr_scheduler.init_args.warmup_steps=1",
                             "--model.init_args.lr_scheduler.init_args.decay_steps=4"])  # fmt: skip
    from growtrain import GrowUntilSaturated

    (grow,) = [cb for cb in cli.trainer.callbacks if isinstance(cb, GrowUntilSaturated)]
    assert [(g["step"], g["sites"]) for g in _growths(grow)] == [(2, ["h.2"]), (4, ["h.3"]), (6, ["h.4"]), (8, ["h.5"])]
    assert all(g["insertion"] == "copy" and g["max_abs_change"] > 0 for g in _growths(grow))  # it says the output moved
    assert cli.model.network.depth() == 6 and cli.trainer.global_step == 20


def test_cyclic_growth_spreads_a_resnets_blocks_as_the_sweep_does_and_copies_only_same_shape_blocks(tmp_path):
    """site='cyclic' on a 3-stage ResNet: the network's k-th block on top of stage k mod 3, so 7 blocks
    give the sweep's added=7 layout (4-3-3). A copy takes the nearest block of its shape in the stage;
    a stage's first added block has only the stride-2 transition below it, so it starts at zero."""
    import lightning as L

    from growtrain.data import ImageDataModule
    from growtrain.module import ImageClassifier

    L.seed_everything(0)
    grow = GrowOnSchedule(at=[2, 4, 6, 8], blocks=[2, 2, 2, 1], site="cyclic", insertion="copy", verbose=False)
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3)
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=200, synthetic_classes=4, probe_size=40,
                         val_size=20, batch_size=20, augment=False)  # fmt: skip
    trainer = L.Trainer(max_steps=10, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(model, dm)
    net = model.network
    reference = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], added=7, family="basic", in_channels=3).network
    assert [len(net.stage(s)) for s in net.growable_stages] == [len(reference.stage(s)) for s in reference.growable_stages]
    assert [g["sites"] for g in _growths(grow)] == [["layer1.1", "layer2.1"], ["layer3.1", "layer1.2"],
                                                  ["layer2.2", "layer3.2"], ["layer1.3"]]  # fmt: skip
    # the first block added to layer2 and layer3 had no block of its shape to copy: zero start, said so
    assert [g["zero"] for g in _growths(grow)] == [["layer2.1"], ["layer3.1"], [], []]
    assert _growths(grow)[0]["max_abs_change"] > 0  # layer1.1 is a copy of layer1.0: the function moved
    # four at once: the fourth wraps round to layer1, on top of the first
    L.seed_everything(0)
    again = GrowOnSchedule(at=[2], blocks=4, site="cyclic", insertion="zero", verbose=False)
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3)
    L.Trainer(max_steps=3, callbacks=[again], logger=False, enable_progress_bar=False, enable_model_summary=False,
              enable_checkpointing=False, limit_val_batches=0, default_root_dir=tmp_path).fit(model, dm)  # fmt: skip
    assert _growths(again)[0]["sites"] == ["layer1.1", "layer2.1", "layer3.1", "layer1.2"]
    assert [len(model.network.stage(s)) for s in model.network.growable_stages] == [3, 2, 2]
    # neighbour_block never offers the transition block (other tensors) as a source
    lone = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3).network
    fresh = lone.grow("layer2.1")
    assert neighbour_block(lone, fresh) is None
    with pytest.raises(ValueError, match="no trained neighbour with its tensors"):
        copy_neighbour(lone, fresh)


# -- the plan, refused before training ---------------------------------------------------------------------
def _resnet_fit(tmp_path, grow, max_steps=4):
    import lightning as L

    from growtrain.data import ImageDataModule
    from growtrain.module import ImageClassifier

    L.seed_everything(0)
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3)
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=200, synthetic_classes=4, probe_size=40,
                         val_size=20, batch_size=20, augment=False)  # fmt: skip
    trainer = L.Trainer(max_steps=max_steps, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path,
                        limit_val_batches=1)  # fmt: skip
    return model, dm, trainer


def _untrained(model, trainer, before):
    assert trainer.global_step == 0 and model.network.depth() == 3 and model.network.growth_log == []
    for (name, p), q in zip(model.state_dict().items(), before.values()):
        assert torch.equal(p, q), name  # no optimizer step, no BatchNorm statistics moved: nothing trained


@pytest.mark.parametrize(("site", "blocks", "match"), [
    ("first", [1], r"Plan.site: Plan\(site='first'\) would insert a block at 'layer3\.0' at at\[0\] = 2 "
                   r"\(optimizer step 2\), .*expected one of 'layer3''s sites, layer3\.1 … layer3\.1 .*given "
                   r"'layer3\.0'\. Fix: site='last'"),
    # the second point's sites follow the first growth: layer3 has 2 blocks then, and 3 do not interleave
    ("interleave", [1, 3], r"blocks: site='interleave' .* grow at most 2 at once.*at\[1\] = 3 \(optimizer step 3\)"),
])  # fmt: skip
def test_a_site_the_network_would_not_have_is_refused_at_fit_start_before_a_step(site, blocks, match, tmp_path):
    grow = GrowOnSchedule(at=[2, 3][: len(blocks)], blocks=blocks, site=site, verbose=False)
    model, dm, trainer = _resnet_fit(tmp_path, grow)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=match):
        trainer.fit(model, dm)
    _untrained(model, trainer, before)


def test_interleave_planned_over_the_growths_before_it_runs(tmp_path):
    """The check follows the plan's own growth: 2 blocks interleave in layer3 once the first point gave it 2."""
    grow = GrowOnSchedule(at=[2, 3], blocks=[1, 2], site="interleave", verbose=False)
    model, dm, trainer = _resnet_fit(tmp_path, grow)
    trainer.fit(model, dm)
    assert [g["sites"] for g in _growths(grow)] == [["layer3.1"], ["layer3.1", "layer3.2"]]
    assert [len(model.network.stage(s)) for s in model.network.growable_stages] == [1, 1, 4]


def test_an_integer_point_past_the_fit_is_refused_before_training(tmp_path):
    grow = GrowOnSchedule(at=[2, 5, 9], verbose=False)
    model, dm, trainer = _resnet_fit(tmp_path, grow, max_steps=4)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(ValueError, match=r"Plan.at: the point\(s\) \[5, 9\] \(optimizer steps\) lie past this fit's 4 "
                                         r"optimizer steps .*Expected every point <= 4; given at=\(2, 5, 9\)\. Fix: "):
        trainer.fit(model, dm)
    _untrained(model, trainer, before)
    # at the fit's last step it still grows (after that step): 4 of 4 is inside the fit
    grow = GrowOnSchedule(at=[4], verbose=False)
    model, dm, trainer = _resnet_fit(tmp_path, grow, max_steps=4)
    trainer.fit(model, dm)
    assert [g["step"] for g in _growths(grow)] == [4]


# -- a checkpoint written mid-ramp -------------------------------------------------------------------------
@pytest.mark.parametrize("insertion", ["mask_ramp", "copy_ramp"])
def test_a_checkpoint_written_mid_ramp_loads_as_the_network_that_was_trained(insertion, tmp_path, quiet_trainer_kwargs):
    from growtrain.lm import LanguageModel

    grow = GrowOnSchedule(at=[2], insertion=insertion, ramp_steps=50, verbose=False)
    module = _lm()
    trainer = _trainer(tmp_path, [grow], quiet_trainer_kwargs, max_steps=6)
    trainer.fit(module, datamodule=_text_data())
    (block,) = grown_blocks(module.network)
    assert mask_value(block) == pytest.approx((5 - 2) / 50)  # the last batch ran at step 5, 3 steps into the ramp
    path = tmp_path / "mid.ckpt"
    trainer.save_checkpoint(path)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    module.eval()
    with torch.no_grad():
        trained = module(idx)
        # the masked forward written out, with the mask the checkpoint holds
        m = torch.load(path, weights_only=False)["state_dict"]["network.transformer.h.1.growtrain_mask"]
        torch.testing.assert_close(trained, _explicit(module.network, idx, {id(block): float(m)}), rtol=1e-5, atol=1e-5)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert all(isinstance(v, torch.Tensor) for v in state.values())
    fresh = _lm()  # ungrown: the load replays the growth, and the mask comes with the block
    fresh.load_state_dict(state)
    loaded = LanguageModel.load_from_checkpoint(path)
    for other in (fresh, loaded):
        other.eval()
        (theirs,) = grown_blocks(other.network)
        assert mask_value(theirs) == mask_value(block)
        with torch.no_grad():
            assert torch.equal(other(idx), trained)
    detach_mask(grown_blocks(fresh.network)[0])  # the same weights at m = 1 (what a load gave before): another network
    with torch.no_grad():
        assert not torch.allclose(fresh(idx), trained, atol=1e-4)


# -- the config's budget, in blocks ------------------------------------------------------------------------
def test_the_periodic_configs_growth_budget_comment_counts_blocks_right():
    """configs/fmnist/periodic.yaml's max_growths counts growth events (checks that grew); its stage fork
    inserts one block per stage, so the comment's block figure is start + max_growths × stages."""
    import re
    from pathlib import Path

    import yaml

    from growtrain.module import ImageClassifier

    root = Path(__file__).resolve().parents[1]
    text = (root / "configs" / "fmnist" / "periodic.yaml").read_text()
    cfg = yaml.safe_load(text)
    grow = next(c["init_args"] for c in cfg["trainer"]["callbacks"] if c["class_path"].endswith("GrowUntilSaturated"))
    assert grow["decision"]["class_path"] == "growtrain.StageFork"
    model = {k: v for k, v in cfg["model"]["init_args"].items() if k != "optimizer"}
    net = ImageClassifier(**model).network
    stages, start, n = len(net.growable_stages), net.depth(), grow["max_growths"]
    lines = text.splitlines()
    at = next(i for i, line in enumerate(lines) if line.strip().startswith("max_growths:"))
    comment = " ".join([lines[at].split("#", 1)[1]] + [ln.strip().lstrip("#") for ln in lines[at + 1:at + 3]
                                                         if ln.strip().startswith("#")])  # fmt: skip
    figure = re.search(r"at most (\d+) \+ (\d+) × (\d+) = (\d+) blocks", comment)
    assert figure, comment
    assert tuple(map(int, figure.groups())) == (start, n, stages, start + n * stages)  # 3 + 12 × 3 = 39
    assert "growth events" in comment
    row = next(ln for ln in (root / "docs" / "callback.md").read_text().splitlines() if ln.startswith("| `max_growths`"))
    assert "growth events" in row and "one per growth" not in row


def test_several_blocks_on_top_at_one_point_go_in_one_after_another(tmp_path, quiet_trainer_kwargs):
    """Plan(blocks=2, site="last"): the two blocks stack on top (h.1, then h.2 on the grown stage), not
    refused as a site past the stage's end."""
    from growtrain.callbacks.scheduled import plan_growth

    assert plan_growth(["h"], {"h": 1}, 0, 2, "last") == [["h.1"], ["h.2"]]
    grow = GrowOnSchedule(at=[2], blocks=2, site="last", verbose=False)
    module = _lm()
    _trainer(tmp_path, [grow], quiet_trainer_kwargs, max_steps=4).fit(module, datamodule=_text_data())
    assert [g["sites"] for g in _growths(grow)] == [["h.1", "h.2"]] and module.network.depth() == 3
