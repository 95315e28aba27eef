"""decision="probation": a block in the run on probation, each training sample passing through it or
skipping it, judged by scoring the probe with and without it (growtrain/leave_out.py,
growtrain/callbacks/probation_check.py).

The oracles are explicit: the mix written out by hand with the draws of a generator seeded alike,
the network with the block physically removed (``undo_growth``), the running average recomputed
step by step from the recorded weights, and the optimizer built without the block."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
from torch.nn import functional as F

from growtrain.callbacks import GrowUntilSaturated
from growtrain.callbacks import probation_check
from growtrain.data import ImageDataModule
from growtrain.growable import grown_blocks
from growtrain.leave_out import KEEP, MAX_LOOKS, LeaveOut, probation_verdict
from growtrain.module import ImageClassifier
from growtrain.optim import param_groups
from growtrain.reconfigure import reconfigure_optimizer, remove_param_groups


def tiny_net(seed=0, family="preact"):
    torch.manual_seed(seed)
    return ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family=family, in_channels=3).network


def trained_block(net, site="layer2.1", seed=3):
    """A block grown at ``site`` with a non-zero terminal map (as after some training)."""
    block = net.grow(site, net.new_block(site, seed=seed))
    with torch.no_grad():
        for p in block.terminal_parameters():
            p.normal_(0, 0.3)
    return block


# -- the hook -------------------------------------------------------------------------------------
def test_each_training_sample_passes_through_the_block_or_skips_it_by_its_own_draw():
    net = tiny_net()
    block = trained_block(net)
    x = torch.randn(64, 8, 8, 8)  # layer2's input: 8 channels
    block.train()
    plain = block(x)  # no hook yet
    hook = LeaveOut(block)
    hook.reseed(123)
    mixed = block(x)
    keep = torch.rand(64, generator=torch.Generator().manual_seed(123)) < KEEP  # the same draws, by hand
    assert 10 < int(keep.sum()) < 54  # both modes present
    assert torch.allclose(mixed[keep], plain[keep]) and torch.equal(mixed[~keep], x[~keep])
    assert hook.kept == [(float(keep.float().mean()), 64)]
    hook.remove()
    assert torch.allclose(block(x), plain)  # the plain block again


def test_a_sample_that_skips_the_block_gives_it_no_gradient():
    net = tiny_net()
    block = trained_block(net)
    x = torch.randn(32, 8, 8, 8)
    hook = LeaveOut(block)
    hook.reseed(7)
    keep = torch.rand(32, generator=torch.Generator().manual_seed(7)) < KEEP
    block.train()
    block(x).square().sum().backward()
    got = [p.grad.clone() for p in block.parameters()]
    block.zero_grad()
    hook.remove()
    # the oracle: only the passing samples through the plain block (BatchNorm sees the whole batch in both)
    out = block(x)
    (out[keep].square().sum() + x[~keep].square().sum()).backward()
    for a, p in zip(got, block.parameters()):
        assert torch.allclose(a, p.grad, atol=1e-5)


def test_the_draws_leave_the_runs_random_stream_alone():
    net = tiny_net()
    block = trained_block(net)
    LeaveOut(block).reseed(1)
    block.train()
    torch.manual_seed(5)
    block(torch.ones(8, 8, 8, 8))
    after = torch.rand(3)
    torch.manual_seed(5)
    assert torch.equal(after, torch.rand(3))


@pytest.mark.parametrize("family", ["preact", "basic"])
def test_scored_without_the_block_is_the_network_with_the_block_removed(family):
    net = tiny_net(family=family)
    block = trained_block(net)
    hook = LeaveOut(block)
    net.eval()
    x = torch.rand(16, 3, 8, 8)
    with torch.no_grad():
        with_block = net(x)
        with hook.left_out():
            without = net(x)
        hook.remove()
        plain = net(x)
        removed = copy.deepcopy(net)
        removed.undo_growth([grown_blocks(removed)[-1]], 0)
        assert removed.depth() == 3
        assert torch.allclose(without, removed(x), atol=1e-6) and torch.allclose(with_block, plain)
    assert not torch.allclose(with_block, without)


# -- the verdict ----------------------------------------------------------------------------------
def _test(lower, upper):
    return {"gain_frac": (lower + upper) / 2, "lower_frac": lower, "upper_frac": upper, "level": 0.0125, "n": 100}


@pytest.mark.parametrize("lower, upper, looks, act, certified", [
    (0.02, 0.05, 1, "confirm", False),  # certified above min_gain at any look
    (0.02, 0.05, MAX_LOOKS, "confirm", False),
    (-0.05, -0.02, 1, "wait", False),  # below, but early: a fresh block is worth less; no early look takes it out
    (-0.05, -0.02, MAX_LOOKS, "reject", True),  # below at the last look: certified saturation
    (0.0, 0.03, MAX_LOOKS - 1, "wait", False),
    (0.0, 0.03, MAX_LOOKS, "unresolved", False),  # at the last look, not resolved: no certified gain
    (float("nan"), float("nan"), MAX_LOOKS, "unresolved", False),
])  # fmt: skip
def test_the_verdict_confirms_on_the_lower_bound_and_takes_out_only_at_the_last_look(lower, upper, looks, act,
                                                                                    certified):  # fmt: skip
    verdict, got = probation_verdict(_test(lower, upper), site="layer1.1", min_gain=0.01, looks=looks)
    assert got == act and verdict.certified == certified
    assert verdict.saturated == (act in ("reject", "unresolved"))
    assert (verdict.site == "layer1.1") == (act == "confirm")


# -- taking a block's optimizer groups back -------------------------------------------------------
def test_taking_a_block_back_leaves_the_optimizer_and_schedule_as_without_it():
    net = tiny_net()
    for p in net.parameters():
        p.grad = torch.ones_like(p)
    opt = torch.optim.SGD(param_groups(net), lr=0.1, momentum=0.9, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda e: 0.5**e)
    opt.step()
    before_names = [g["name"] for g in opt.param_groups]
    state = {id(p): opt.state[p]["momentum_buffer"].clone() for p in net.parameters()}
    block = trained_block(net)
    reconfigure_optimizer(net, opt, [sched], [block], [0])
    assert len(opt.param_groups) > len(before_names) and len(sched.base_lrs) == len(opt.param_groups)
    for p in block.parameters():
        p.grad = torch.ones_like(p)
    opt.step()  # the block now has state
    removed = remove_param_groups(opt, block, [sched])
    assert removed and [g["name"] for g in opt.param_groups] == before_names
    assert len(sched.base_lrs) == len(sched.lr_lambdas) == len(opt.param_groups)
    assert not any(p in opt.state for p in block.parameters())
    ids = {id(p) for g in opt.param_groups for p in g["params"]}
    assert ids == {id(p) for p in net.parameters() if not any(p is q for q in block.parameters())}
    # the old parameters' state is the same objects, one step further (not reset)
    assert all(not torch.equal(opt.state[p]["momentum_buffer"], state[id(p)]) for p in net.parameters()
               if not any(p is q for q in block.parameters()))  # fmt: skip


def test_only_the_last_growths_groups_can_be_taken_back():
    net = tiny_net()
    opt = torch.optim.SGD(param_groups(net), lr=0.1)
    first, second = trained_block(net, "layer1.1"), trained_block(net, "layer3.1")
    reconfigure_optimizer(net, opt, [], [first, second], [0, 1])
    n = len(opt.param_groups)
    with pytest.raises(ValueError, match=r"^block: its groups .* are not the optimizer's last"):
        remove_param_groups(opt, first)
    assert len(opt.param_groups) == n  # nothing changed


# -- the callback ---------------------------------------------------------------------------------
def tiny_dm() -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                           val_size=40, batch_size=32, augment=False)  # fmt: skip


def fit(tmp_path, callbacks, max_epochs=6):
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    trainer.fit(model, tiny_dm())
    return model, trainer


def probation_cb(**kw):
    kw = {"schedule": "periodic", "decision": "probation", "every_n_epochs": 1, "min_gain": 0.01,
          "on_saturated": "continue", "verbose": False} | kw
    return GrowUntilSaturated(**kw)


def test_the_probe_is_scored_by_the_average_with_and_without_the_block(tmp_path, monkeypatch):
    """The two loss vectors the test compared are the running average's per-sample losses with
    the block and with the block physically removed; the level is alpha split over the looks."""
    seen = {}
    real = probation_check.leave_out_test

    def spy(without, with_block, **kw):
        if not seen:
            cb = grow._probation
            seen.update(without=without, with_block=with_block, ema=copy.deepcopy(cb.ema), opened=dict(cb.opened),
                        indices=list(cb.indices), level=kw["level"], steps=cb.ema_steps)  # fmt: skip
        return real(without, with_block, **kw)

    monkeypatch.setattr(probation_check, "leave_out_test", spy)
    grow = probation_cb(min_gain=10.0)
    _, trainer = fit(tmp_path, [grow], max_epochs=2)
    assert [h["action"] for h in grow.history] == ["probation", "wait"]
    assert seen["level"] == pytest.approx(grow.alpha / MAX_LOOKS)
    assert seen["steps"] == trainer.num_training_batches  # one averaging step per optimizer step
    # the losses: the average with the block, and with it removed
    probe = trainer.datamodule.probe_dataloader()
    net = seen["ema"]
    for h in list(net.modules()):
        h._forward_hooks.clear()
    net.eval()
    removed = copy.deepcopy(net)
    assert sorted(seen["indices"]) == [0, 1, 2]  # one block in every stage, on probation together
    removed.undo_growth(grown_blocks(removed), 0)
    with torch.no_grad():
        xs, ys = zip(*[(b[0], b[1]) for b in probe])
        x, y = torch.cat(xs), torch.cat(ys)
        with_block = F.cross_entropy(net(x), y, reduction="none").double()
        without = F.cross_entropy(removed(x), y, reduction="none").double()
    assert torch.allclose(seen["with_block"], with_block, atol=1e-6)
    assert torch.allclose(seen["without"], without, atol=1e-6)


def test_the_average_takes_in_each_optimizer_step_of_the_run_once():
    """The scored network, by hand: from the grown network at insertion, e ← e + w·(live − e) per
    optimizer step with w = 1 − exp(−1/τ), τ = EMA_FRACTION of the steps between checks; integer
    buffers copied; a batch without an optimizer step (gradient accumulation) adds nothing."""
    from types import SimpleNamespace

    net = tiny_net()
    block = net.grow("layer2.1", net.new_block("layer2.1", seed=3))
    judge = probation_check.Probation(min_gain=0.01)
    judge.open(net, {"layer2.1": block}, epoch=0, step=0)
    oracle = {k: v.double().clone() for k, v in net.state_dict().items() if torch.is_tensor(v)}
    interval = 20
    w = 1.0 - math.exp(-1.0 / (probation_check.EMA_FRACTION * interval))
    g = torch.Generator().manual_seed(0)
    last = 0
    for step in (1, 1, 2, 3, 3, 4):  # a repeated step: the batch did not step the optimizer
        with torch.no_grad():
            for p in net.parameters():
                p.add_(torch.randn(p.shape, generator=g))
            for name, b in net.named_buffers():
                if b.is_floating_point():
                    b.add_(torch.rand(b.shape, generator=g))
                else:
                    b.add_(1)
        judge.batch_end(SimpleNamespace(global_step=step), net, interval)
        if step != last:
            for k, v in net.state_dict().items():
                if torch.is_tensor(v):
                    oracle[k] = oracle[k] + w * (v.double() - oracle[k]) if v.is_floating_point() else v.double()
        last = step
    got = judge.ema.state_dict()
    assert judge.ema_steps == 4
    for k, v in oracle.items():
        assert torch.allclose(got[k].double(), v, atol=1e-5), k
    assert not any(p is q for p in judge.ema.parameters() for q in net.parameters())  # a copy, nothing shared


def test_a_confirmed_block_stays_and_the_next_block_goes_on_probation(tmp_path, monkeypatch):
    real = probation_check.probation_verdict
    monkeypatch.setattr(probation_check, "probation_verdict", lambda test, **k: real(
        {**test, "lower_frac": 1.0, "upper_frac": 2.0}, **k))  # every look confirms (its figures still computed)
    grow = probation_cb()
    model, trainer = fit(tmp_path, [grow], max_epochs=4)
    assert [h["action"] for h in grow.history] == ["probation", "grow", "grow", "grow"]
    assert [h["probation"].get("next_site") is not None for h in grow.history] == [True] * 4
    assert all(", ".join(h["sites"]) == h["probation"]["site"] for h in grow.history[1:])  # it keeps the blocks it judged
    assert model.network.depth() == 3 + 3 * 3 + 3  # three stages' worth confirmed, one on probation
    assert grow.growths == 3 and grow.inserted == 12
    assert all(len({s.rpartition(".")[0] for s in h["sites"]}) == 3 for h in grow.history[1:])  # one per stage
    opt = trainer.optimizers[0]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}


def test_a_block_that_does_not_pay_is_taken_out_with_its_optimizer_groups(tmp_path):
    """No block can pay 1000 %: after MAX_LOOKS looks the block goes, certified, and the run goes on
    (on_saturated='continue') with the network and optimizer it had before the block went in."""
    grow = probation_cb(min_gain=10.0)
    model, trainer = fit(tmp_path, [grow], max_epochs=MAX_LOOKS + 3)
    actions = [h["action"] for h in grow.history]
    assert actions == ["probation"] + ["wait"] * (MAX_LOOKS - 1) + ["saturated"]
    assert grow.history[-1]["certified"] and grow.history[-1]["probation"]["act"] == "reject"
    assert model.network.depth() == 3 and model.network.growth_log == []
    opt = trainer.optimizers[0]
    assert [g["name"] for g in opt.param_groups] == [g["name"] for g in param_groups(tiny_net(family="basic"))]
    assert {id(p) for g in opt.param_groups for p in g["params"]} == {id(p) for p in model.parameters()}
    assert grow.history[1]["probation"]["kept"] == pytest.approx(KEEP, abs=0.15)
    assert grow._probation.hooks == [] and grow._probation.ema is None


def test_the_probation_state_survives_the_callbacks_checkpoint(tmp_path):
    grow = probation_cb(min_gain=10.0)
    fit(tmp_path, [grow], max_epochs=2)
    state = grow.state_dict()
    saved = state["probation"]
    assert saved["site"] is not None and saved["looks"] == 1 and "ema" in saved
    fresh = probation_cb(min_gain=10.0)
    fresh.load_state_dict(state)
    assert fresh.state_dict()["probation"].keys() == saved.keys()
    assert all(torch.equal(a, b) for a, b in zip(fresh.state_dict()["probation"]["ema"].values(), saved["ema"].values())
               if torch.is_tensor(a))  # fmt: skip


@pytest.mark.parametrize("kw", [
    {"schedule": "periodic", "decision": "probation", "min_gain": None},
    {"decision": "probation", "min_gain": None},
])  # fmt: skip
def test_bad_probation_options_are_refused_naming_the_argument(kw):
    with pytest.raises(ValueError, match=r"^decision:"):
        GrowUntilSaturated(**kw)


def test_probation_is_refused_under_fsdp2_before_any_state_changes():
    from types import SimpleNamespace

    class ModelParallelStrategy:  # recognised by name, as growtrain.callbacks.sharded does
        _device_mesh, _tensor_parallel_size, _data_parallel_size = None, 1, 2

    fsdp = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=1, precision_plugin=SimpleNamespace())
    with pytest.raises(RuntimeError, match=r"^strategy: decision='probation'.*decision='trial' under FSDP2"):
        probation_cb().setup(fsdp, None, "fit")


def test_one_draw_per_sample_takes_every_block_on_probation_in_or_out_together():
    """The stage's blocks skip together: each sample is in the network with all of them or with none."""
    from types import SimpleNamespace

    net = tiny_net()
    blocks = {s: trained_block(net, s, seed=i) for i, s in enumerate(["layer1.1", "layer2.1", "layer3.1"])}
    judge = probation_check.Probation(min_gain=0.01)
    judge.open(net, blocks, epoch=0, step=0)
    judge.batch_start(SimpleNamespace(global_step=3, global_rank=0), net, 0)
    seen = []
    handles = [b.register_forward_hook(lambda m, a, o: seen.append((a[0], o))) for b in blocks.values()]
    net.train()
    net(torch.rand(40, 3, 8, 8))
    for h in handles:
        h.remove()
    # each block's output equals its input (skipped) for the same samples
    skipped = [torch.tensor([torch.equal(o[i], x[i]) for i in range(40)]) for x, o in seen]
    assert 0 < int(skipped[0].sum()) < 40
    assert all(torch.equal(skipped[0], s) for s in skipped[1:])


def test_a_stage_taken_back_leaves_the_network_as_before_it():
    from types import SimpleNamespace

    net = tiny_net()
    x = torch.rand(8, 3, 8, 8)
    net.eval()
    before = net(x)
    opt = torch.optim.SGD(param_groups(net), lr=0.1, momentum=0.9)
    names = [g["name"] for g in opt.param_groups]
    blocks = {s: trained_block(net, s, seed=i) for i, s in enumerate(["layer3.1", "layer1.1", "layer2.1"])}
    reconfigure_optimizer(net, opt, [], [grown_blocks(net)[k] for k in range(3)], [0, 1, 2])
    judge = probation_check.Probation(min_gain=0.01)
    judge.open(net, blocks, epoch=0, step=0)
    assert not torch.allclose(net(x), before)
    trainer = SimpleNamespace(strategy=SimpleNamespace(lr_scheduler_configs=[]), world_size=1)
    judge.reject(trainer, None, net, opt)
    assert net.depth() == 3 and net.growth_log == [] and judge.site is None
    assert torch.equal(net(x), before)
    assert [g["name"] for g in opt.param_groups] == names
