"""Optimizer and scheduler reconfiguration after growth (growtrain.reconfigure).

Oracles: optimizer state objects compared by identity and value; Adam's first step on a new
parameter computed by hand from the zero state; learning rates compared with the old groups'
curve (continue) or with a freshly built scheduler on a fresh optimizer (restart).
Whole file: a few seconds (plus one tiny fit).
"""

from __future__ import annotations

import functools

import lightning as L
import pytest
import torch
from lightning.pytorch.utilities.types import LRSchedulerConfig
from torch import nn
from torch.nn import functional as F
from torch.optim.lr_scheduler import CosineAnnealingLR, LambdaLR, MultiStepLR, ReduceLROnPlateau, StepLR

from growtrain.models import cifar_resnet
from growtrain.optim import WarmupCosine, param_groups
from growtrain.reconfigure import (
    add_param_groups,
    continue_schedulers,
    new_param_groups,
    reconfigure_optimizer,
    restart_schedulers,
)


def _net(family: str = "preact") -> nn.Module:
    torch.manual_seed(0)
    return cifar_resnet(width=4, family=family, num_classes=3)


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(8, 3, 8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def _train_steps(net, opt, steps: int = 3) -> None:
    for s in range(steps):
        x, y = _batch(s)
        opt.zero_grad()
        F.cross_entropy(net(x), y).backward()
        opt.step()


def _grow(net, site="layer1.1", seed=7):
    block = net.new_block(site, seed=seed)
    net.grow(site, block=block)
    return block, len(net.growth_log) - 1


OPTIMIZERS = {
    "sgd": lambda groups: torch.optim.SGD(groups, lr=0.05, momentum=0.9, weight_decay=5e-4),
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2, weight_decay=1e-4),
    "adamw": lambda groups: torch.optim.AdamW(groups, lr=1e-2, weight_decay=0.05),
}


# -- optimizer: zero state for the new, untouched state for the old ----------------------------
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_new_params_join_with_empty_state_old_state_untouched(name):
    net = _net()
    net.param_group_options = {"no_decay": "gpt"}  # what ImageClassifier carries for groups_for_new_parameters
    opt = OPTIMIZERS[name](param_groups(net, **net.param_group_options))
    _train_steps(net, opt)
    old_params = [p for g in opt.param_groups for p in g["params"]]
    snapshot = {id(p): {k: (v, v.clone() if torch.is_tensor(v) else v) for k, v in opt.state[p].items()} for p in old_params}
    n_groups = len(opt.param_groups)

    block, k = _grow(net)
    indices = reconfigure_optimizer(net, opt, [], [block], [k])

    new_ids = {id(p) for p in block.parameters()}
    in_opt = [p for i in indices for p in opt.param_groups[i]["params"]]
    assert {id(p) for p in in_opt} == new_ids  # by identity, every new parameter, nothing else
    assert [opt.param_groups[i]["name"] for i in indices] == ["growth0", "growth0/no_decay"]
    assert len(opt.param_groups) == n_groups + 2
    assert all(len(opt.state[p]) == 0 for p in block.parameters())  # zero state before the next step
    # hyper-parameters as configure_optimizers would give them (weight-decay rule included)
    base, base_nd = opt.param_groups[0], opt.param_groups[1]
    for i, ref in zip(indices, (base, base_nd)):
        for key in ("lr", "weight_decay", "betas", "momentum", "eps"):
            if key in ref:
                assert opt.param_groups[i][key] == ref[key], key
    assert opt.param_groups[indices[1]]["weight_decay"] == 0.0
    # old state: the very same tensor objects with the same values
    for p in old_params:
        for key, (obj, value) in snapshot[id(p)].items():
            assert opt.state[p][key] is obj
            if torch.is_tensor(value):
                assert torch.equal(opt.state[p][key], value)
    # training goes on, and the new parameters now get state
    _train_steps(net, opt, 1)
    assert all(len(opt.state[p]) > 0 for p in block.terminal_parameters())


def test_adam_first_step_on_new_parameter_is_the_zero_state_step():
    net = _net()
    opt = torch.optim.Adam(param_groups(net), lr=1e-2, betas=(0.9, 0.99), eps=1e-8, weight_decay=1e-3)
    _train_steps(net, opt)
    block, k = _grow(net)
    reconfigure_optimizer(net, opt, [], [block], [k])
    x, y = _batch(11)
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    before = {id(p): p.detach().clone() for p in block.parameters()}
    grads = {id(p): p.grad.detach().clone() for p in block.parameters()}
    opt.step()
    lr, (b1, b2), eps, wd = 1e-2, (0.9, 0.99), 1e-8, 1e-3
    assert any(g.abs().max() > 0 for g in grads.values())
    for p in block.parameters():
        p0, g = before[id(p)], grads[id(p)] + wd * before[id(p)]  # Adam's L2 weight decay
        m, v = (1 - b1) * g, (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1), v / (1 - b2)  # step 1: bias correction of the zero state
        expected = p0 - lr * m_hat / (v_hat.sqrt() + eps)
        torch.testing.assert_close(p.detach(), expected, rtol=1e-6, atol=1e-7)
        assert int(opt.state[p]["step"]) == 1


def test_sgd_momentum_starts_from_zero_for_new_parameters():
    net = _net()
    opt = torch.optim.SGD(param_groups(net), lr=0.1, momentum=0.9)
    _train_steps(net, opt)
    block, k = _grow(net)
    reconfigure_optimizer(net, opt, [], [block], [k])
    x, y = _batch(3)
    opt.zero_grad()
    F.cross_entropy(net(x), y).backward()
    before = {id(p): (p.detach().clone(), p.grad.clone()) for p in block.parameters()}
    opt.step()
    for p in block.parameters():
        p0, g = before[id(p)]
        torch.testing.assert_close(p.detach(), p0 - 0.1 * g)  # momentum buffer = g on the first step


def test_add_param_groups_refuses_known_parameters_and_changes_nothing():
    net = _net()
    opt = torch.optim.SGD(param_groups(net), lr=0.1)
    n = len(opt.param_groups)
    with pytest.raises(ValueError, match="already in the optimizer"):
        add_param_groups(opt, [{"name": "growth0", "params": [next(net.parameters())]}])
    assert len(opt.param_groups) == n


# -- schedulers ----------------------------------------------------------------------------
def _warmup_cosine(opt):
    return WarmupCosine(opt, warmup_steps=3, total_steps=10, min_lr_ratio=0.1)


def _warmup_lambda(opt):
    return LambdaLR(opt, functools.partial(lambda s, w: min(1.0, (s + 1) / w), w=4))


SCHEDULERS = {
    "multistep": lambda opt: MultiStepLR(opt, milestones=[2, 4], gamma=0.5),
    "cosine": lambda opt: CosineAnnealingLR(opt, T_max=8, eta_min=1e-3),
    "lambda_warmup": _warmup_lambda,
    "warmup_cosine": _warmup_cosine,
    "plateau": lambda opt: ReduceLROnPlateau(opt, factor=0.5, patience=0),
}
# ReduceLROnPlateau sees a loss that never improves, so it halves the lr every step.
_METRIC = 1.0


def _step(sched):
    if isinstance(sched, ReduceLROnPlateau):
        sched.step(_METRIC)
    else:
        sched.step()


def _fresh(name, lr=0.1, steps=0):
    """Reference: a fresh optimizer and scheduler on a throwaway network, ``steps`` steps in."""
    opt = torch.optim.SGD(param_groups(_net()), lr=lr, momentum=0.9)
    sched = SCHEDULERS[name](opt)
    for _ in range(steps):
        opt.step()
        _step(sched)
    return opt, sched


class _Module(nn.Module):
    """A stand-in LightningModule: what restart_schedulers needs is configure_optimizers."""

    def __init__(self, net, name):
        super().__init__()
        self.network, self.name = net, name

    def configure_optimizers(self):
        opt = torch.optim.SGD(param_groups(self.network), lr=0.1, momentum=0.9)
        sched = SCHEDULERS[self.name](opt)
        config = {"scheduler": sched}
        if isinstance(sched, ReduceLROnPlateau):
            config["monitor"] = "train_loss"
        return {"optimizer": opt, "lr_scheduler": config}


def _setup(name, steps=3):
    net = _net()
    opt = torch.optim.SGD(param_groups(net), lr=0.1, momentum=0.9)
    sched = SCHEDULERS[name](opt)
    config = LRSchedulerConfig(sched, interval="epoch", frequency=1, reduce_on_plateau=isinstance(sched, ReduceLROnPlateau),
                               monitor="train_loss" if isinstance(sched, ReduceLROnPlateau) else None)  # fmt: skip
    for s in range(steps):
        _train_steps(net, opt, 1)
        _step(sched)
    return net, opt, config


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_continue_new_groups_follow_the_running_schedule(name):
    net, opt, config = _setup(name)
    lr_now = opt.param_groups[0]["lr"]
    block, k = _grow(net)
    indices = reconfigure_optimizer(net, opt, [config], [block], [k])
    new = opt.param_groups[indices[0]]
    assert new["lr"] == pytest.approx(lr_now)  # where the schedule is now, not its start
    if "initial_lr" in opt.param_groups[0]:
        assert new["initial_lr"] == opt.param_groups[0]["initial_lr"]
    _, ref = _fresh(name, steps=3)
    for s in range(5):  # the whole curve from here on equals the old groups' (and an ungrown run's)
        _train_steps(net, opt, 1)
        _step(config.scheduler)
        ref.optimizer.step()
        _step(ref)
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs == pytest.approx([ref.optimizer.param_groups[0]["lr"]] * len(lrs)), (name, s)
    assert len(config.scheduler.get_last_lr()) == len(opt.param_groups)


@pytest.mark.parametrize("via_module", [True, False], ids=["configure_optimizers", "reinstantiate"])
@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_restart_gives_a_fresh_schedule_from_step_zero(name, via_module):
    net, opt, config = _setup(name)
    state_objects = {id(p): dict(opt.state[p]) for g in opt.param_groups for p in g["params"]}
    block, k = _grow(net)
    reconfigure_optimizer(net, opt, [config], [block], [k])
    module = _Module(net, name) if via_module else None
    (new_config,) = restart_schedulers(module, opt, [config])
    assert new_config.scheduler is not config.scheduler and new_config.scheduler.optimizer is opt
    assert (new_config.interval, new_config.frequency, new_config.monitor) == (config.interval, config.frequency, config.monitor)
    ref_opt, ref = _fresh(name, steps=0)
    for s in range(6):
        lrs = [g["lr"] for g in opt.param_groups]
        assert lrs == pytest.approx([ref_opt.param_groups[0]["lr"]] * len(lrs)), (name, s)
        _train_steps(net, opt, 1)
        _step(new_config.scheduler)
        ref_opt.step()
        _step(ref)
    # the optimizer state of old parameters survived the restart
    for p_id, state in state_objects.items():
        p = next(q for g in opt.param_groups for q in g["params"] if id(q) == p_id)
        for key, obj in state.items():
            assert opt.state[p][key] is obj


def test_lambda_lr_without_extension_breaks_and_continue_fixes_it():
    """Why extension is needed: torch's LambdaLR refuses a group it has no lambda for."""
    net, opt, config = _setup("lambda_warmup")
    block, k = _grow(net)
    groups, _ = new_param_groups(net, block, k, opt)
    add_param_groups(opt, groups)
    with pytest.raises((ValueError, IndexError)):
        config.scheduler.step()
    continue_schedulers([config], [0], opt)
    config.scheduler.step()
    assert len({g["lr"] for g in opt.param_groups}) == 1


# -- in a real fit: restart takes effect at the next epoch's start ----------------------------
def test_restart_in_fit_resets_lrs_for_the_next_epoch(tmp_path):
    from growtrain.callbacks import GrowUntilSaturated, Periodic
    from growtrain.data import ImageDataModule
    from growtrain.module import ImageClassifier

    seen = []

    class Watch(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            if batch_idx == 0:
                seen.append([g["lr"] for g in trainer.optimizers[0].param_groups])

    L.seed_everything(0)
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=160, synthetic_classes=3,
                         probe_size=40, val_size=8, batch_size=32, augment=False)  # fmt: skip
    module = ImageClassifier(width=4, num_classes=3, lr_scheduler=lambda opt: StepLR(opt, step_size=1, gamma=0.5))
    grow = GrowUntilSaturated(schedule=Periodic(every_n_epochs=2), decision="trial", rule="paper", t=1e-9,
                              max_growths=1, lr_schedule="restart", verbose=False)
    trainer = L.Trainer(max_epochs=4, callbacks=[grow, Watch()], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, dm)
    assert grow.history[0]["action"] == "grow" and grow.history[0]["epoch"] == 1
    assert seen[0] == pytest.approx([0.1]) and seen[1] == pytest.approx([0.05])
    # growth at the end of epoch 1 → epoch 2 starts the new stage at the base lr, for all groups
    assert seen[2] == pytest.approx([0.1, 0.1]) and seen[3] == pytest.approx([0.05, 0.05])
