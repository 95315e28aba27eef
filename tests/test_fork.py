"""decision="stage_fork": the run against a copy with one more block in every stage, trained on the
same batches until the next check, compared on the probe (growtrain/fork.py, growtrain/callbacks/fork_check.py).

The oracles are explicit: a copy of the network stepped by hand with plain torch optimizers on
the batches the run trained on (recorded), and the run without any growth callback."""

from __future__ import annotations

import copy
import math

import lightning as L
import pytest
import torch
from torch.nn import functional as F

from growtrain.callbacks import GrowUntilSaturated, Periodic, StageFork
from growtrain.callbacks import fork_check
from growtrain.data import ImageDataModule
from growtrain.fork import adopt, fork_test, fork_verdict, make_arm
from growtrain.module import ImageClassifier
from growtrain.optim import param_groups


def tiny_net(seed=0):
    torch.manual_seed(seed)
    return ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3).network


def batches(n, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 3, 8, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def sgd(net):
    return torch.optim.SGD(param_groups(net), lr=0.05, momentum=0.9, weight_decay=5e-4)


def adam(net):
    return torch.optim.Adam(param_groups(net), lr=1e-2)


def step(net, opt, batch):
    opt.zero_grad(set_to_none=True)
    F.cross_entropy(net(batch[0]), batch[1]).backward()
    opt.step()


def frozen_block_arm(make_opt, trained=4):
    """A run trained ``trained`` steps and its arm at layer2.1 with the block frozen at zero output."""
    net = tiny_net()
    opt = make_opt(net)
    data = batches(trained + 8)
    for b in data[:trained]:
        step(net, opt, b)
    arm, arm_opt, block, _ = make_arm(net, opt, "layer2.1", seed=5)
    for p in block.parameters():
        p.requires_grad_(False)
    return net, opt, arm, arm_opt, block, data[trained:]


@pytest.mark.parametrize("make_opt", [sgd, adam])
def test_an_arm_whose_block_stays_zero_follows_the_run_exactly(make_opt):
    """The arm's old parameters carry the run's optimizer state (a copy, matched by identity):
    with its block held at zero output it is the run, step for step."""
    net, opt, arm, arm_opt, block, data = frozen_block_arm(make_opt)
    assert all(not arm_opt.state.get(p) for p in block.parameters())  # zero state
    assert not ({id(p) for p in arm.parameters()} & {id(p) for p in net.parameters()})  # a copy, nothing shared
    for b in data:
        step(net, opt, b)
        step(arm, arm_opt, b)
    x = data[0][0]
    net.eval(), arm.eval()
    assert torch.equal(net(x), arm(x))


def test_an_arm_without_the_optimizer_state_does_not_follow_the_run():
    """The broken variant: a fresh optimizer (momentum lost) departs from the run at once."""
    net, opt, arm, _, _, data = frozen_block_arm(sgd)
    fresh = torch.optim.SGD([p for p in arm.parameters() if p.requires_grad], lr=0.05, momentum=0.9,
                            weight_decay=5e-4)  # fmt: skip
    for b in data:
        step(net, opt, b)
        step(arm, fresh, b)
    net.eval(), arm.eval()
    assert not torch.allclose(net(data[0][0]), arm(data[0][0]))


def test_the_arms_block_gets_the_groups_growth_would_give_it():
    net = tiny_net()
    opt = sgd(net)
    _, arm_opt, block, refs = make_arm(net, opt, "layer1.1", seed=0)
    added = arm_opt.param_groups[len(opt.param_groups):]
    assert {id(p) for g in added for p in g["params"]} == {id(p) for p in block.parameters()}
    assert refs == [0] and all(g["lr"] == 0.05 and g["momentum"] == 0.9 for g in added)


def test_the_run_that_adopts_the_arm_computes_and_trains_as_the_arm():
    """After the run grows the same block, it takes the arm's weights, buffers and optimizer state:
    its outputs and its next steps are the arm's."""
    net = tiny_net()
    opt = sgd(net)
    data = batches(10)
    for b in data[:3]:
        step(net, opt, b)
    arm, arm_opt, _, _ = make_arm(net, opt, "layer3.1", seed=7)
    for b in data[3:6]:
        step(net, opt, b)
        step(arm, arm_opt, b)
    block = net.grow("layer3.1", net.new_block("layer3.1", seed=7))
    opt.add_param_group({**{k: v for k, v in opt.param_groups[0].items() if k != "params"},
                         "params": list(block.parameters())})  # fmt: skip
    assert adopt(net, opt, arm, arm_opt) == sum(1 for p in arm.parameters() if arm_opt.state.get(p))
    for b in data[6:]:
        step(net, opt, b)
        step(arm, arm_opt, b)
    net.eval(), arm.eval()
    assert torch.equal(net(data[0][0]), arm(data[0][0]))


def test_adopt_refuses_an_arm_of_another_architecture():
    net = tiny_net()
    arm, arm_opt, _, _ = make_arm(net, sgd(net), "layer3.1", seed=7)
    with pytest.raises(RuntimeError, match="differ in their parameters"):
        adopt(net, sgd(net), arm, arm_opt)


@pytest.mark.parametrize("lower, upper, saturated, certified, words", [
    (0.02, 0.05, False, False, "grow"),
    (-0.02, 0.005, True, True, "certified saturation"),
    (-0.02, 0.05, True, False, "no certified gain"),
])  # fmt: skip
def test_the_verdict_grows_on_the_lower_bound_and_certifies_on_the_upper(lower, upper, saturated, certified, words):
    test = {"gain_frac": (lower + upper) / 2, "lower_frac": lower, "upper_frac": upper, "level": 0.05, "n": 100}
    verdict = fork_verdict(test, site="layer1.1", min_gain=0.01, horizon="2 epoch(s)")
    assert (verdict.saturated, verdict.certified) == (saturated, certified)
    assert verdict.reason.startswith(words) and "layer1.1" in verdict.reason
    assert verdict.site == (None if saturated else "layer1.1")


def test_the_fork_test_is_the_paired_gain_of_the_arm_over_the_run():
    g = torch.Generator().manual_seed(0)
    control = torch.distributions.Exponential(torch.tensor(2.0)).sample((4000,)).double()  # skewed, like losses
    arm = control * 0.9 + 0.01 * torch.randn(4000, generator=g, dtype=torch.float64)
    test = fork_test(control, arm, min_gain=0.01, level=0.05, seed=0)
    assert test["gain_frac"] == pytest.approx(float((control - arm).mean() / control.mean()))
    assert test["lower_frac"] < test["gain_frac"] < test["upper_frac"]
    assert test["lower_frac"] > 0.05  # a 10 % gain is resolved on 4000 samples


# -- the callback ---------------------------------------------------------------------------------
def tiny_dm() -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                           val_size=40, batch_size=32, augment=False)  # fmt: skip


class Recorder(L.Callback):
    """The batches the run trained on (as its training step received them) and each epoch's rate."""

    def __init__(self):
        self.batches = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.batches.append((trainer.current_epoch, batch[0].clone(), batch[1].clone(),
                             trainer.optimizers[0].param_groups[0]["lr"]))  # fmt: skip


def fit(tmp_path, callbacks, max_epochs=6):
    L.seed_everything(0)
    trainer = L.Trainer(max_epochs=max_epochs, callbacks=callbacks, logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    trainer.fit(model, tiny_dm())
    return model, trainer


def fork_cb(min_gain=0.01, every_n_epochs=2, **kw):
    kw = {"schedule": Periodic(every_n_epochs=every_n_epochs), "decision": StageFork(min_gain=min_gain),
          "on_saturated": "continue", "verbose": False} | kw
    return GrowUntilSaturated(**kw)


def test_an_open_fork_leaves_the_runs_training_untouched(tmp_path):
    """The run with a fork open (and stopped by it: no block can pay 1000 %) trains exactly as
    the same run without any growth callback: same batches, same weights."""
    grow = fork_cb(min_gain=10.0)
    with_fork, trainer = fit(tmp_path, [grow], max_epochs=8)
    # one fork with a block at the best site of each stage; it does not pay, so growth ends
    assert [h["action"] for h in grow.history] == ["fork", "saturated"]
    sites = grow.history[1]["fork"]["site"].split(", ")
    assert len({s.rpartition(".")[0] for s in sites}) == 3  # layer1, layer2, layer3
    assert grow.history[1]["fork"]["arm_steps"] == 2 * trainer.num_training_batches  # a step per batch, 2 epochs
    plain, _ = fit(tmp_path, [], max_epochs=8)
    for a, b in zip(with_fork.state_dict().values(), plain.state_dict().values()):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b  # the growth record: plain data


def test_the_arm_is_the_network_plus_its_block_trained_on_the_runs_batches(tmp_path, monkeypatch):
    """Independent recomputation: the network as it was when the fork opened, with the same blocks
    (one per stage, seeded in insertion order), stepped by hand (SGD, the run's momentum state; the
    blocks' rate ramped up over the first half of the horizon) on the recorded batches, is the arm
    the fork judged."""
    opened, judged = {}, {}
    real_open, real_judge = fork_check.PairedFork.open, fork_check.PairedFork.judge

    def spy_open(self, pl_module, network, optimizer, site, *, epoch, step):
        if not opened:  # the first fork
            opened.update(net=copy.deepcopy(network), state=copy.deepcopy(optimizer.state_dict()), site=site,
                          seed=self._seed(self.forks), epoch=epoch)  # fmt: skip
        return real_open(self, pl_module, network, optimizer, site, epoch=epoch, step=step)

    def spy_judge(self, inputs):
        if self.arm is not None and "arm" not in judged:
            judged["arm"] = copy.deepcopy(self.arm)
        return real_judge(self, inputs)

    monkeypatch.setattr(fork_check.PairedFork, "open", spy_open)
    monkeypatch.setattr(fork_check.PairedFork, "judge", spy_judge)
    record = Recorder()
    grow = fork_cb(min_gain=10.0)
    fit(tmp_path, [grow, record], max_epochs=4)
    net = opened["net"]
    opt = torch.optim.SGD(param_groups(net), lr=0.1, momentum=0.9)
    opt.load_state_dict(opened["state"])
    from growtrain.growable import insertion_order

    n_base = len(opt.param_groups)
    for k, name in enumerate(insertion_order(list(opened["site"]))):  # deepest first within a stage
        block = net.grow(name, net.new_block(name, seed=opened["seed"] + k))
        opt.add_param_group({**{k: v for k, v in opt.param_groups[0].items() if k != "params"},
                             "params": list(block.parameters())})  # fmt: skip
    net.train()
    after = [(x, y) for epoch, x, y, lr in record.batches if epoch > opened["epoch"]]
    ramp = round(0.5 * len(after))  # the block's rate ramps over the first half of the horizon (2 epochs)
    for t, batch in enumerate(after, start=1):
        for group in opt.param_groups[n_base:]:
            group["lr"] = 0.1 * min(1.0, t / ramp)
        step(net, opt, batch)
    x = record.batches[0][1]
    net.eval(), judged["arm"].eval()
    assert torch.allclose(net(x), judged["arm"](x), atol=1e-5)


def test_a_fork_that_pays_is_adopted_and_the_next_fork_opens(tmp_path, monkeypatch):
    from dataclasses import replace

    real = fork_check.fork_verdict  # every judged fork "pays" (its figures still computed)
    monkeypatch.setattr(fork_check, "fork_verdict", lambda test, **k: real(test, **k) if test is None else replace(
        real(test, **k), saturated=False, site=k["site"]))  # fmt: skip
    grow = fork_cb()
    model, _ = fit(tmp_path, [grow], max_epochs=8)
    grow_checks = [h for h in grow.history if h["action"] == "grow"]
    assert [h["action"] for h in grow.history][:3] == ["fork", "grow", "grow"]
    assert all(", ".join(h["sites"]) == h["fork"]["site"] for h in grow_checks)  # it grows the blocks it tested
    assert grow.history[1]["fork"]["next_site"] is not None  # and forks again at once
    assert model.network.depth() == 3 + 3 * len(grow_checks)  # a block in each of the 3 stages per growth


def test_the_fork_state_survives_the_callbacks_checkpoint(tmp_path):
    grow = fork_cb(min_gain=10.0, every_n_epochs=3)
    fit(tmp_path, [grow], max_epochs=4)  # the fork opened at epoch 2 is still open at the end
    state = grow.state_dict()
    assert state["fork"]["site"] is not None and "arm" in state["fork"]
    fresh = fork_cb(min_gain=10.0, every_n_epochs=3)
    fresh.load_state_dict(state)
    assert fresh._fork.site == grow._fork.site and fresh._fork.steps == grow._fork.steps
    assert fresh.state_dict()["fork"]["arm"].keys() == state["fork"]["arm"].keys()


@pytest.mark.parametrize("kw, arg", [
    ({"decision": "stage_fork"}, "decision"),  # the converged schedule
    ({"schedule": "periodic", "decision": "fork"}, "decision"),  # the one-block fork: removed
])  # fmt: skip
def test_bad_fork_options_are_refused_naming_the_argument(kw, arg):
    with pytest.raises(ValueError, match=rf"^{arg}:"):
        GrowUntilSaturated(**kw)


def test_the_arm_follows_the_runs_rate_and_its_block_warms_up():
    """A scheduler or an anneal moves the run's rates: the arm's copied groups take them, and the
    block's group takes its reference group's rate × its ratio at the fork × the warm-up factor."""
    from growtrain.fork import mirror_lrs, warmup

    net = tiny_net()
    opt = sgd(net)
    _, arm_opt, _, refs = make_arm(net, opt, "layer1.1", seed=0)
    n = len(opt.param_groups)
    opt.param_groups[0]["lr"] = 0.02  # an anneal's point
    mirror_lrs(arm_opt, opt, refs, [1.0], warm=warmup(3, 12))
    assert arm_opt.param_groups[0]["lr"] == 0.02
    assert arm_opt.param_groups[n]["lr"] == pytest.approx(0.02 * 3 / 12)
    assert [warmup(s, 4) for s in (1, 2, 4, 9)] == [0.25, 0.5, 1.0, 1.0] and warmup(5, 0) == 1.0


def test_the_cooled_copies_anneal_over_the_horizons_last_eighth(tmp_path):
    fork = fork_check.PairedFork(min_gain=0.01)
    assert fork.cool_length(890) == 111 and fork.cool_length(16) == 2 and fork.cool_length(4) == 1
    assert fork.cool_length(1) is None and fork.cool_length(None) is None
    assert [fork_check.cosine(i, 4) for i in (1, 3)] == [1.0, pytest.approx(0.5)]
    grow = fork_cb(min_gain=10.0)
    _, trainer = fit(tmp_path, [grow], max_epochs=4)
    judged = grow.history[1]["fork"]
    horizon = 2 * trainer.num_training_batches
    assert judged["cooled"] and judged["cool_steps"] == fork.cool_length(horizon) and judged["arm_steps"] == horizon
    assert "both cooled over 2 steps" in judged["reason"]


def test_the_verdict_compares_the_run_and_the_arm_each_annealed_to_zero_on_the_runs_batches(tmp_path, monkeypatch):
    """Independent recomputation: the run and the arm as they were when cooling began, copied
    with Python's deepcopy (network and optimizer together), stepped by hand with the rate a cosine
    from theirs to zero on the batches the run trained on next, are the two networks the verdict
    scored (the run first, then the arm); and the scored losses are those networks' losses."""
    began, scored, judged = {}, [], {}
    from growtrain.callbacks import probe_data

    real_start, real_judge, real_losses = (fork_check.PairedFork._start_cool, fork_check.PairedFork.judge,
                                           probe_data.per_sample_losses)  # fmt: skip
    record = Recorder()

    def spy_start(self, network):
        if not began:
            began.update(run=copy.deepcopy((network, self._optimizer)), arm=copy.deepcopy((self.arm, self.arm_opt)),
                         at=len(record.batches) + 1)  # this batch is not recorded yet: the next ones cool
        return real_start(self, network)

    def spy_judge(self, inputs):
        if self.cool is not None and not judged:
            judged.update(run=copy.deepcopy(self.cool[0][0]), arm=copy.deepcopy(self.cool[1][0]),
                          ids=(id(self.cool[0][0]), id(self.cool[1][0])), steps=self.cool_steps)  # fmt: skip
        return real_judge(self, inputs)

    def spy_losses(view, loader, loss_fn, device):
        out = real_losses(view, loader, loss_fn, device)
        scored.append((id(view.network), out))
        return out

    monkeypatch.setattr(fork_check.PairedFork, "_start_cool", spy_start)
    monkeypatch.setattr(fork_check.PairedFork, "judge", spy_judge)
    monkeypatch.setattr(probe_data, "per_sample_losses", spy_losses)  # what the fork's scoring calls
    grow = fork_cb(min_gain=10.0)
    fit(tmp_path, [grow, record], max_epochs=4)
    steps = judged["steps"]
    assert steps == 2
    after = record.batches[began["at"]:began["at"] + steps]
    for side in ("run", "arm"):
        net, opt = began[side]
        base = [g["lr"] for g in opt.param_groups]
        net.train()
        for i, (_, x, y, _) in enumerate(after):
            for g, lr in zip(opt.param_groups, base):
                g["lr"] = lr * 0.5 * (1 + math.cos(math.pi * i / steps))
            step(net, opt, (x, y))
        net.eval(), judged[side].eval()
        x = record.batches[0][1]
        assert torch.allclose(net(x), judged[side](x), atol=1e-5), side
    # the verdict's two sides are the cooled copies' losses, the run's first
    first = [out for i, out in scored if i in judged["ids"]][:2]
    assert [i for i, _ in scored if i in judged["ids"]][:2] == list(judged["ids"])
    entry = grow.history[1]["fork"]
    assert entry["loss_before"] == pytest.approx(float(first[0].mean()), rel=1e-12)
    assert entry["loss_now"] == pytest.approx(float(first[1].mean()), rel=1e-12)
    assert entry["gain_frac"] == pytest.approx(float((first[0] - first[1]).mean() / first[0].mean()), rel=1e-9)


def test_cooling_leaves_the_run_and_the_arm_at_the_runs_rate(tmp_path, monkeypatch):
    """The cooled copies are copies: the run trains as without a fork (test above), and the arm
    the run adopts is the one stepped at the run's rate, not the cooled one."""
    from dataclasses import replace

    seen = {}
    real_adopt = fork_check.adopt

    def spy_adopt(network, optimizer, arm, arm_opt):
        seen.setdefault("arm", arm)
        return real_adopt(network, optimizer, arm, arm_opt)

    real = fork_check.fork_verdict
    monkeypatch.setattr(fork_check, "fork_verdict", lambda test, **k: real(test, **k) if test is None else replace(
        real(test, **k), saturated=False, site=k["site"]))  # fmt: skip
    monkeypatch.setattr(fork_check, "adopt", spy_adopt)
    cooled = {}
    real_judge = fork_check.PairedFork.judge

    def spy_judge(self, inputs):
        if self.cool is not None and not cooled:
            cooled.update(arm=self.cool[1][0], live=self.arm)
        return real_judge(self, inputs)

    monkeypatch.setattr(fork_check.PairedFork, "judge", spy_judge)
    fit(tmp_path, [fork_cb()], max_epochs=4)
    assert seen["arm"] is cooled["live"] and seen["arm"] is not cooled["arm"]


def test_with_gradient_accumulation_the_arm_steps_when_the_run_does(tmp_path):
    L.seed_everything(0)
    grow = fork_cb(min_gain=10.0)
    trainer = L.Trainer(max_epochs=4, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        accumulate_grad_batches=2, default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                            optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
    trainer.fit(model, tiny_dm())
    judged = grow.history[1]
    assert judged["fork"]["arm_steps"] == judged["step"] - grow.history[0]["step"]  # the run's optimizer steps
    assert judged["fork"]["arm_steps"] < 2 * trainer.num_training_batches  # not one per batch


def test_a_stop_is_certified_only_when_the_forks_upper_bound_is_below_min_gain(tmp_path, monkeypatch):
    """The stage fork not resolved below min_gain (its upper bound forced above): growth ends with "no
    certified gain"; the same fork as measured (every block bounded below 1000 %): certified saturation."""
    real = fork_check.fork_test
    calls = []

    def test_(control, arm, **k):
        out = real(control, arm, **k)
        calls.append(out)
        if len(calls) == 1:  # the fork: not resolved below min_gain
            out = {**out, "upper_frac": 20.0}
        return out

    monkeypatch.setattr(fork_check, "fork_test", test_)
    grow = fork_cb(min_gain=10.0)
    fit(tmp_path, [grow], max_epochs=8)
    assert grow.history[-1]["action"] == "saturated" and not grow.history[-1]["certified"]
    calls.clear()
    monkeypatch.setattr(fork_check, "fork_test", real)
    again = fork_cb(min_gain=10.0)
    fit(tmp_path, [again], max_epochs=8)
    assert again.history[-1]["action"] == "saturated" and again.history[-1]["certified"]  # below 1000 %


def test_the_fork_is_refused_where_its_arm_cannot_follow_the_run():
    """Before any state changes: FSDP2 (the arm is a full, unsharded copy) and a loss-scaled
    float16 precision (the arm's loss is not scaled)."""
    from types import SimpleNamespace

    class ModelParallelStrategy:  # recognised by name, as growtrain.callbacks.sharded does
        _device_mesh, _tensor_parallel_size, _data_parallel_size = None, 1, 2

    fsdp = SimpleNamespace(strategy=ModelParallelStrategy(), world_size=1, precision_plugin=SimpleNamespace())
    with pytest.raises(RuntimeError, match=r"^strategy: decision='stage_fork'.*\(decision='trial'\) under FSDP2"):
        fork_cb().setup(fsdp, None, "fit")
    strategy = L.Trainer(logger=False, enable_progress_bar=False, enable_model_summary=False).strategy
    fp16 = SimpleNamespace(strategy=strategy, world_size=1, precision="16-mixed",
                           precision_plugin=SimpleNamespace(scaler=object()))  # fmt: skip
    with pytest.raises(RuntimeError, match=r"^precision: decision='stage_fork'.*Fix: pass precision='bf16-mixed'"):
        fork_cb().setup(fp16, None, "fit")


def test_a_fork_refuses_a_probe_holding_one_training_sample(tmp_path):
    """What the fork scores must be held out from everything it and the run train on: one training
    image slipped into the probe is refused before training, naming the overlap."""
    from torch.utils.data import DataLoader

    from growtrain.data.datamodule import TensorImages

    dm = tiny_dm()
    dm.setup("fit")
    probe, train = dm.probe_dataloader(), dm.train_dataloader()
    p, t = probe.dataset, train.dataset
    leaky = TensorImages(p.x, p.y, torch.cat([p.indices, t.indices[:1]]))
    grow = fork_cb(probe=DataLoader(leaky, batch_size=32, collate_fn=probe.collate_fn))
    trainer = L.Trainer(max_epochs=2, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3)
    with pytest.raises(ValueError, match=r"^probe: the probe sample overlaps the training data \(1 sample"):
        trainer.fit(model, dm)
    assert grow.history == [] and model.network.depth() == 3  # nothing was checked or grown


# -- decision="stage_fork": one more block in every stage -------------------------------------------
def test_an_arm_at_several_sites_is_the_network_grown_at_each_and_can_be_adopted():
    """Independent construction: the network grown by hand at the three sites (deepest index first
    within a stage, as the callback's growth inserts) has the arm's parameter names and shapes, and
    a run grown so takes the arm's weights and optimizer state."""
    net = tiny_net()
    opt = sgd(net)
    arm, arm_opt, _, refs = make_arm(net, opt, ["layer3.1", "layer1.0", "layer1.1"], seed=3)
    assert refs == [0, 0, 0] and len(arm_opt.param_groups) == len(opt.param_groups) + 3
    by_hand = copy.deepcopy(net)
    for k, site in enumerate(["layer1.1", "layer1.0", "layer3.1"]):
        by_hand.grow(site, by_hand.new_block(site, seed=3 + k))
    assert [(n, p.shape) for n, p in arm.named_parameters()] == [(n, p.shape) for n, p in by_hand.named_parameters()]
    x = batches(1)[0][0]
    arm.eval(), by_hand.eval(), net.eval()
    assert torch.equal(arm(x), net(x)) and torch.equal(by_hand(x), net(x))  # function-preserving, all three
    for name, p in by_hand.named_parameters():  # the same blocks: the seeds follow the insertion order
        assert torch.equal(p, dict(arm.named_parameters())[name]), name


def test_a_stage_fork_grows_one_block_in_every_stage_and_adopts_the_arm(tmp_path, monkeypatch):
    from dataclasses import replace

    real = fork_check.fork_verdict  # every judged fork "pays"
    monkeypatch.setattr(fork_check, "fork_verdict", lambda test, **k: real(test, **k) if test is None else replace(
        real(test, **k), saturated=False, site=k["site"]))  # fmt: skip
    seen = {}
    real_adopt = fork_check.adopt

    def spy_adopt(network, optimizer, arm, arm_opt):
        seen.setdefault("arm", copy.deepcopy(arm))
        out = real_adopt(network, optimizer, arm, arm_opt)
        seen.setdefault("run", copy.deepcopy(network))
        return out

    monkeypatch.setattr(fork_check, "adopt", spy_adopt)
    grow = fork_cb(max_growths=1)
    model, _ = fit(tmp_path, [grow], max_epochs=4)
    opened = grow.history[0]["fork"]["next_site"]
    assert len(opened) == 3 and len({s.rpartition(".")[0] for s in opened}) == 3  # one site per stage
    grew = grow.history[1]
    assert grew["action"] == "grow" and sorted(grew["sites"]) == sorted(opened)
    assert model.network.depth() == 6 and [len(model.network.stage(s)) for s in ("layer1", "layer2", "layer3")] == [2, 2, 2]
    x = tiny_dm_batch()
    seen["arm"].eval(), seen["run"].eval()
    assert torch.equal(seen["arm"](x), seen["run"](x))  # the run is the arm it judged


def tiny_dm_batch():
    g = torch.Generator().manual_seed(5)
    return torch.randn(4, 3, 8, 8, generator=g)


def test_a_stage_fork_that_does_not_pay_ends_growth_without_trying_a_stage_alone(tmp_path):
    grow = fork_cb(min_gain=10.0)
    model, _ = fit(tmp_path, [grow], max_epochs=6)
    assert [h["action"] for h in grow.history] == ["fork", "saturated"]
    assert model.network.depth() == 3
    assert "stage_fork" in str(GrowUntilSaturated.__init__.__annotations__["decision"])


class Headed(L.LightningModule):
    """A growable trunk between a dropout and a head the fork's copies share with the run."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.trunk = ImageClassifier(width=4, num_classes=8, blocks=[1, 1, 1], family="basic", in_channels=3).network
        self.drop, self.head = torch.nn.Dropout(0.3), torch.nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.drop(self.trunk(x)))

    def training_step(self, batch, batch_idx):
        return F.cross_entropy(self(batch[0]), batch[1])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def test_an_open_fork_leaves_a_shared_head_and_the_random_stream_untouched(tmp_path):
    """With a head outside the growable network, a dropout, and gradient accumulation (Lightning
    zeroes gradients once per optimizer step), the run with forks and cooled copies open trains
    exactly as the same run without the callback: the copies' backward adds nothing to the head's
    gradients and their dropout draws nothing from the run's random stream."""
    def run(callbacks):
        L.seed_everything(0)
        model = Headed()
        trainer = L.Trainer(max_epochs=6, callbacks=callbacks, logger=False, enable_progress_bar=False,
                            enable_model_summary=False, enable_checkpointing=False, limit_val_batches=0,
                            accumulate_grad_batches=2, default_root_dir=tmp_path)  # fmt: skip
        trainer.fit(model, tiny_dm())
        return model

    grow = fork_cb(min_gain=10.0, network="trunk")
    forked = run([grow])
    assert any((h.get("fork") or {}).get("cooled") for h in grow.history)  # forks were judged, cooled
    plain = run([])
    for (name, a), (_, b) in zip(forked.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name


