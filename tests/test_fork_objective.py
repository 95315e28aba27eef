"""decision="stage_fork": the arm trains on the module's own objective (its ``training_step``), and
a LightningModule that is itself the growable network gets a real arm.

The oracles are explicit: a copy of the arm (``copy.deepcopy`` of the arm and its optimizer
together) stepped by hand with autograd on the batch the run trained on, and the run without
any growth callback."""

from __future__ import annotations

import copy

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

from growtrain.callbacks import GrowUntilSaturated, Periodic, StageFork
from growtrain.callbacks import fork_check
from growtrain.data import ImageDataModule
from growtrain.families.generic import GrowableStack
from growtrain.module import ImageClassifier

SMOOTHING = 0.3


def tiny_dm() -> ImageDataModule:
    return ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=400, synthetic_classes=4, probe_size=120,
                           val_size=40, batch_size=32, augment=False)  # fmt: skip


def fork_cb(min_gain=10.0, every_n_epochs=2, **kw):
    kw = {"schedule": Periodic(every_n_epochs=every_n_epochs), "decision": StageFork(min_gain=min_gain),
          "on_saturated": "continue", "verbose": False} | kw
    return GrowUntilSaturated(**kw)


def trainer(tmp_path, callbacks, max_epochs=4, **kw):
    L.seed_everything(0)
    return L.Trainer(**{"max_epochs": max_epochs, "callbacks": callbacks, "logger": False, "enable_progress_bar": False,
                        "enable_model_summary": False, "enable_checkpointing": False, "limit_val_batches": 0,
                        "default_root_dir": tmp_path} | kw)  # fmt: skip


class Smoothed(ImageClassifier):
    """Trains on label-smoothed cross-entropy plus an auxiliary weight penalty on the network's
    first convolution: an objective the probe loss (plain cross-entropy) lacks. Returns a dict,
    logs on every step (the arm's call must not log)."""

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y, label_smoothing=SMOOTHING) + self.aux()
        self.log("train_loss", loss, on_step=False, on_epoch=True)
        self.calls = getattr(self, "calls", 0) + 1  # an attribute the arm's call must leave as the run's
        return {"loss": loss}

    def aux(self):
        return 0.05 * sum(p.square().sum() for p in self.network.stem.parameters())


def smoothed():
    torch.manual_seed(0)
    return Smoothed(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                    optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip


def test_the_arm_steps_on_the_modules_training_objective_not_the_probe_loss(tmp_path, monkeypatch):
    """One arm step, recomputed: a copy of the arm and its optimizer (taken together, before the
    step) stepped by autograd on the module's objective (label smoothing + the auxiliary term) on
    the batch the run just trained on, at the rates the arm stepped with, is the arm after the
    step; the same copy stepped on the probe loss is not."""
    seen = []
    real = fork_check.PairedFork.batch_end

    def spy(self, trainer, pl_module, network, batch, batch_idx, **kw):
        if self.arm is None or len(seen) >= 2 or self.steps < 2:  # steps after the first: momentum state in play
            return real(self, trainer, pl_module, network, batch, batch_idx, **kw)
        before = copy.deepcopy((self.arm, self.arm_opt))
        real(self, trainer, pl_module, network, batch, batch_idx, **kw)
        seen.append((before, copy.deepcopy(self.arm), [g["lr"] for g in self.arm_opt.param_groups], batch))

    monkeypatch.setattr(fork_check.PairedFork, "batch_end", spy)
    module = smoothed()
    trainer(tmp_path, [fork_cb()], max_epochs=3).fit(module, tiny_dm())
    assert len(seen) == 2
    for (net, opt), after, lrs, (x, y) in seen:
        results = {}
        for name, objective in (("training", lambda out, n: F.cross_entropy(out, y, label_smoothing=SMOOTHING)
                                 + 0.05 * sum(p.square().sum() for p in n.stem.parameters())),
                                ("probe", lambda out, n: F.cross_entropy(out, y))):  # fmt: skip
            n, o = copy.deepcopy((net, opt))
            for group, lr in zip(o.param_groups, lrs):
                group["lr"] = lr
            n.train()
            o.zero_grad(set_to_none=True)
            objective(n(x), n).backward()
            o.step()
            results[name] = n
        got = dict(after.named_parameters())
        worst = {k: max((got[name] - p).abs().max().item() for name, p in m.named_parameters())
                 for k, m in results.items()}  # fmt: skip
        assert worst["training"] < 1e-6, worst
        assert worst["probe"] > 1e-3, worst  # the probe-loss step is a different step


def test_the_arms_training_step_logs_nothing_and_leaves_the_runs_state(tmp_path):
    """The run with a fork open (its arm calling the module's training_step every batch) logs
    the same epoch figures and keeps the same attributes as the run without the callback."""
    forked, plain = smoothed(), smoothed()
    grow = fork_cb()
    t1 = trainer(tmp_path, [grow], max_epochs=4)
    t1.fit(forked, tiny_dm())
    assert grow.history[-1]["fork"]["arm_steps"] > 0  # an arm trained beside the run
    t2 = trainer(tmp_path, [], max_epochs=4)
    t2.fit(plain, tiny_dm())
    assert forked.calls == plain.calls == 4 * t2.num_training_batches
    assert float(t1.callback_metrics["train_loss"]) == float(t2.callback_metrics["train_loss"])
    for (name, a), (_, b) in zip(forked.state_dict().items(), plain.state_dict().items()):
        assert torch.equal(a, b) if torch.is_tensor(a) else a == b, name


def test_an_image_classifiers_logged_metrics_are_the_runs_alone(tmp_path):
    """growtrain's ImageClassifier accumulates its train loss in a metric inside training_step:
    the arm's calls leave it as the run's."""
    def run(callbacks):
        t = trainer(tmp_path, callbacks, max_epochs=4)
        torch.manual_seed(0)
        model = ImageClassifier(width=4, num_classes=4, blocks=[1, 1, 1], family="basic", in_channels=3,
                                optimizer=lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9))  # fmt: skip
        t.fit(model, tiny_dm())
        return t

    with_fork, without = run([fork_cb()]), run([])
    for key in ("train_loss", "train_acc"):
        assert float(with_fork.callback_metrics[key]) == float(without.callback_metrics[key]), key


# -- a LightningModule that is itself the growable network ---------------------------------------
class MLPBlock(nn.Module):
    def __init__(self, width=4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, 16), nn.Linear(16, width)

    def forward(self, z):
        return z + self.fc2(torch.tanh(self.fc1(z)))


class WholeStack(GrowableStack, L.LightningModule):
    """The LightningModule is the growable network (``network=None`` resolves to the module)."""

    def __init__(self):
        torch.manual_seed(0)
        super().__init__([MLPBlock()], factory=MLPBlock, terminal=("fc2.weight", "fc2.bias"))

    def training_step(self, batch, batch_idx):
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.2, momentum=0.9)


def blobs(n=480, seed=0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 4, (n,), generator=g)
    # a class pattern a single residual MLP block fits only in part: depth pays
    x = torch.randn(n, 4, generator=g) + 1.5 * torch.sin(3 * F.one_hot(y, 4).float() + y[:, None].float())
    return TensorDataset(x, y)


@pytest.mark.parametrize("network", [None, "module"])
def test_a_module_that_is_the_growable_network_gets_an_arm_of_its_own(tmp_path, network):
    """The fork must compare the run against a different network: with the module itself the
    growable network, the arm (a copy with one more block) trains away from the run, and the
    paired gain is not exactly zero (a swap that does nothing scores the run against itself)."""
    ds = blobs()
    train = DataLoader(Subset(ds, range(0, 320)), batch_size=32, shuffle=True)
    probe = DataLoader(Subset(ds, range(320, 480)), batch_size=80)
    module = WholeStack()
    seen = {}
    real = fork_check.PairedFork.judge

    def spy(self, inputs):
        if self.arm is not None and "arm" not in seen:
            seen.update(arm=copy.deepcopy(self.arm), run=copy.deepcopy(inputs.network))
        return real(self, inputs)

    grow = fork_cb(probe=lambda: probe, loss_fn=F.cross_entropy, min_gain=0.01,
                   network=module if network == "module" else None)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fork_check.PairedFork, "judge", spy)
        trainer(tmp_path, [grow], max_epochs=4).fit(module, train)
    judged = grow.history[1]["fork"]
    assert judged["arm_steps"] == 2 * len(train)
    arm_blocks = [b for b in seen["arm"].blocks]
    assert len(arm_blocks) == 2 and len(seen["run"].blocks) == 1  # the arm has the fork's block, the run not
    new = dict(arm_blocks[1].named_parameters())
    assert max(p.abs().max().item() for k, p in new.items() if k.startswith("block.fc2")) > 0  # the block trained
    assert judged["gain_frac"] != 0.0 and judged["se"] > 0  # two different networks were scored


def test_a_module_that_is_the_growable_network_takes_the_arm_it_judged(tmp_path, monkeypatch):
    """A fork that pays (forced) is adopted: the module, grown at the fork's site, computes as the
    arm the fork judged (the arm's weights, not the run's)."""
    from dataclasses import replace

    real_verdict, real_judge = fork_check.fork_verdict, fork_check.PairedFork.judge
    monkeypatch.setattr(fork_check, "fork_verdict", lambda test, **k: real_verdict(test, **k) if test is None else
                        replace(real_verdict(test, **k), saturated=False, site=k["site"]))  # fmt: skip
    seen = {}

    def spy(self, inputs):
        if self.arm is not None and "arm" not in seen:
            seen.update(arm=copy.deepcopy(self.arm), run=copy.deepcopy(inputs.network))
        return real_judge(self, inputs)

    monkeypatch.setattr(fork_check.PairedFork, "judge", spy)
    ds = blobs()
    train = DataLoader(Subset(ds, range(0, 320)), batch_size=32, shuffle=True)
    probe = DataLoader(Subset(ds, range(320, 480)), batch_size=80)
    module = WholeStack()
    grow = fork_cb(probe=lambda: probe, loss_fn=F.cross_entropy, min_gain=0.01)
    trainer(tmp_path, [grow], max_epochs=4).fit(module, train)  # the fork opens after epoch 2, is judged after 4
    assert [h["action"] for h in grow.history] == ["fork", "grow"] and len(module.blocks) == 2
    x = ds.tensors[0][:16]
    module.eval(), seen["arm"].eval(), seen["run"].eval()
    assert torch.equal(module(x), seen["arm"](x))
    assert not torch.allclose(module(x), seen["run"](x), atol=1e-4)  # the run before it took the arm differs


def test_manual_optimization_is_refused_before_training(tmp_path):
    """The arm steps through training_step, which under manual optimization would step the run's
    optimizer: refused at setup, naming the option and the fix."""
    module = smoothed()
    module.automatic_optimization = False
    with pytest.raises(RuntimeError, match=r"decision: 'stage_fork'.*automatic_optimization=False.*Fix:"):
        trainer(tmp_path, [fork_cb()]).fit(module, tiny_dm())
    assert not hasattr(module, "calls")  # no training step ran
