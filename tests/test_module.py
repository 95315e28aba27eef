"""ImageClassifier, growth-aware checkpoints, param groups, schedules, train-loss early stopping."""

from __future__ import annotations

import math

import lightning as L
import pytest
import torch
from lightning.pytorch import LightningModule

from growtrain.callbacks import TrainLossEarlyStopping
from growtrain.growable import grown_blocks
from growtrain.models import cifar_resnet
from growtrain.module import GrowableModuleMixin, ImageClassifier
from growtrain.optim import WarmupCosine, groups_for_new_parameters, param_groups


def tiny_module(**kw) -> ImageClassifier:
    return ImageClassifier(width=4, in_channels=3, num_classes=4, **kw)


class EpochLosses(L.Callback):
    def __init__(self):
        self.losses = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.losses.append(float(trainer.callback_metrics["train_loss"]))


def test_short_fit_lowers_training_loss_and_logs_metrics(tiny_data, quiet_trainer_kwargs):
    L.seed_everything(0)
    record = EpochLosses()
    trainer = L.Trainer(max_epochs=3, callbacks=[record], **quiet_trainer_kwargs)
    module = tiny_module()
    trainer.fit(module, tiny_data)
    assert len(record.losses) == 3
    assert record.losses[-1] < record.losses[0] - 0.1, record.losses
    assert record.losses[-1] < math.log(4), record.losses  # better than chance on 4 classes
    assert {"train_loss", "train_acc", "val_loss", "val_acc"} <= set(trainer.callback_metrics)
    (result,) = trainer.test(module, tiny_data, verbose=False)
    assert set(result) == {"test_loss", "test_acc"}
    assert 0.0 <= result["test_acc"] <= 1.0


def test_bad_arguments_name_the_argument():
    with pytest.raises(ValueError, match="arch: unknown architecture 'vgg'"):
        ImageClassifier(arch="vgg")
    with pytest.raises(ValueError, match="num_classes: expected a positive integer, got None"):
        ImageClassifier(num_classes=None)
    with pytest.raises(ValueError, match="scheduler_interval"):
        ImageClassifier(scheduler_interval="batch")


# -- param groups ----------------------------------------------------------------------------
def _ids(group):
    return [id(p) for p in group["params"]]


def test_param_groups_by_identity_and_deterministic():
    net = cifar_resnet(width=4)
    b0 = net.grow(net.sites()[0])
    b1 = net.grow(net.sites()[0])  # same shape, equal (zero) terminal values as b0
    groups = param_groups(net)
    assert [g["name"] for g in groups] == ["base", "growth0", "growth1"]
    assert _ids(groups[1]) == [id(p) for p in b0.parameters()]
    assert _ids(groups[2]) == [id(p) for p in b1.parameters()]
    every = [i for g in groups for i in _ids(g)]
    assert sorted(every) == sorted(id(p) for p in net.parameters())  # each parameter exactly once
    assert [_ids(g) for g in param_groups(net)] == [_ids(g) for g in groups]  # deterministic
    assert all("weight_decay" not in g for g in groups)  # default: the optimizer's decay for all


def test_param_groups_gpt_rule_and_weight_decay_override():
    net = cifar_resnet(width=4)
    net.grow(net.sites()[1])
    groups = param_groups(net, no_decay="gpt", weight_decay=0.1)
    assert [g["name"] for g in groups] == ["base", "base/no_decay", "growth0", "growth0/no_decay"]
    for g in groups:
        dims = {p.ndim for p in g["params"]}
        if g["name"].endswith("/no_decay"):
            assert g["weight_decay"] == 0.0 and dims == {1}  # biases and BatchNorm weights
        else:
            assert g["weight_decay"] == 0.1 and min(dims) >= 2
    with pytest.raises(ValueError, match="no_decay: expected one of"):
        param_groups(net, no_decay="bert")


def test_groups_for_new_parameters_match_configure_optimizers():
    module = tiny_module(no_decay="gpt")
    block = module.network.grow(module.network.sites()[0])
    new = groups_for_new_parameters(module, block)  # k found by identity: 0
    # the same layout that configure_optimizers builds when the grown run resumes
    rebuilt = module.configure_optimizers().param_groups[-2:]
    assert [g["name"] for g in new] == [g["name"] for g in rebuilt] == ["growth0", "growth0/no_decay"]
    assert [_ids(g) for g in new] == [_ids(g) for g in rebuilt]
    assert new[1]["weight_decay"] == 0.0 and "weight_decay" not in new[0]
    assert [g["name"] for g in groups_for_new_parameters(module.network, block, 3)][0] == "growth3"
    seen = []  # a custom rule sees the names param_groups gives it (qualified in the network)
    module.param_group_options = {"no_decay": lambda name, p: seen.append(name) or False}
    groups_for_new_parameters(module, block)
    assert seen and all(name.startswith("layer1.0.") for name in seen), seen
    with pytest.raises(ValueError, match="not found among grown_blocks"):
        groups_for_new_parameters(module, torch.nn.Linear(2, 2))


# -- schedules -------------------------------------------------------------------------------
def test_warmup_cosine_matches_closed_form(tmp_path):
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = WarmupCosine(optimizer, warmup_steps=4, total_steps=12, min_lr_ratio=0.1)
    seen = []
    for _ in range(15):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    expected = {0: 0.5, 1: 1.0, 3: 2.0, 4: 2.0, 8: 0.2 + 1.8 * 0.5, 12: 0.2, 14: 0.2}
    for step, lr in expected.items():
        assert seen[step] == pytest.approx(lr), (step, seen)
    assert seen[6] == pytest.approx(0.2 + 1.8 * 0.5 * (1 + math.cos(math.pi * 2 / 8)))
    torch.save(scheduler.state_dict(), tmp_path / "s.pt")
    assert torch.load(tmp_path / "s.pt", weights_only=True)["total_steps"] == 12
    with pytest.raises(ValueError, match="warmup_steps"):
        WarmupCosine(optimizer, warmup_steps=5, total_steps=4)


def test_reduce_on_plateau_monitors_train_loss(tiny_data, quiet_trainer_kwargs):
    module = tiny_module(lr_scheduler=lambda opt: torch.optim.lr_scheduler.ReduceLROnPlateau(opt, patience=0))
    trainer = L.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0, **quiet_trainer_kwargs)
    trainer.fit(module, tiny_data)  # Lightning raises if the monitored metric is missing
    assert trainer.lr_scheduler_configs[0].monitor == "train_loss"


# -- growth-aware checkpoints ----------------------------------------------------------------
def test_checkpoint_of_grown_module_rebuilds_and_resumes(tiny_data, quiet_trainer_kwargs, tmp_path):
    L.seed_everything(0)
    module = tiny_module(optimizer=lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9))
    module.network.grow(module.network.sites()[0])
    trainer = L.Trainer(max_epochs=1, limit_train_batches=2, limit_val_batches=0, **quiet_trainer_kwargs)
    trainer.fit(module, tiny_data)  # trains the new block away from zero
    path = tmp_path / "grown.ckpt"
    trainer.save_checkpoint(path)

    raw = torch.load(path, weights_only=True)  # plain data only: what LightningCLI loads
    assert raw["growtrain"]["growth"] == module.network.growth_log
    assert "optimizer" not in raw["hyper_parameters"]  # Python callables stay out

    loaded = ImageClassifier.load_from_checkpoint(path)
    assert loaded.network.growth_log == module.network.growth_log
    x = torch.randn(5, 3, 8, 8)
    module.eval(), loaded.eval()
    with torch.no_grad():
        assert torch.equal(loaded(x), module(x))

    fresh = tiny_module()  # ungrown: fit(ckpt_path=...) must grow it before loading weights
    resume = L.Trainer(max_epochs=2, limit_train_batches=2, limit_val_batches=0, **quiet_trainer_kwargs)
    resume.fit(fresh, tiny_data, ckpt_path=path)
    assert fresh.network.growth_log == module.network.growth_log
    assert [g["name"] for g in resume.optimizers[0].param_groups] == ["base", "growth0"]
    new_param = next(grown_blocks(fresh.network)[0].parameters())
    assert "momentum_buffer" in resume.optimizers[0].state[new_param]  # state restored by position


class OwnModule(GrowableModuleMixin, LightningModule):
    """A user's module: one line (the mixin) makes its checkpoints growth-aware."""

    def __init__(self):
        super().__init__()
        self.body = cifar_resnet(width=4, num_classes=3)

    def forward(self, x):
        return self.body(x)


def test_mixin_on_a_users_module():
    torch.manual_seed(0)
    grown = OwnModule()
    block = grown.body.grow("layer2.1")
    torch.nn.init.normal_(block.bn2.weight)  # make the new block matter
    checkpoint = {"state_dict": grown.state_dict()}
    grown.on_save_checkpoint(checkpoint)

    fresh = OwnModule()
    fresh.on_load_checkpoint(checkpoint)  # Lightning's order: this hook, then load_state_dict
    fresh.load_state_dict(checkpoint["state_dict"])
    x = torch.randn(2, 3, 8, 8)
    grown.eval(), fresh.eval()
    with torch.no_grad():
        assert torch.equal(fresh(x), grown(x))

    class NoNetwork(GrowableModuleMixin, LightningModule):
        pass

    with pytest.raises(TypeError, match="growable_attr"):
        NoNetwork().on_save_checkpoint({})


# -- the paper's early stopping --------------------------------------------------------------
@pytest.mark.parametrize("start_epoch, stopped", [(0, 1), (2, 3)])
def test_train_loss_early_stopping_starts_at_start_epoch(start_epoch, stopped, tiny_data, quiet_trainer_kwargs):
    # lr 0 and min_delta 10: the first checked epoch sets the best score, the next one cannot
    # improve by 10 nats, so with patience 1 training stops one epoch after start_epoch.
    module = tiny_module(optimizer=lambda params: torch.optim.SGD(params, lr=0.0))
    stopper = TrainLossEarlyStopping(start_epoch=start_epoch, min_delta=10.0, patience=1)
    trainer = L.Trainer(
        max_epochs=10, limit_train_batches=1, limit_val_batches=0, callbacks=[stopper], **quiet_trainer_kwargs
    )
    trainer.fit(module, tiny_data)
    assert stopper.stopped_epoch == stopped
    assert trainer.current_epoch <= stopped + 1 < 10
