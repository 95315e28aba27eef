"""A probe check leaves the user's LightningModule as it found it.

A real fit of a module whose growable trunk (``GrowableStack``, ``network="trunk"``) sits
between a ``Linear + BatchNorm1d`` encoder and a ``Dropout + Linear`` head, with a parameter
the user froze and a submodule the user keeps in eval mode. Two spy callbacks around
``GrowUntilSaturated`` (hooks run in list order) snapshot every module's mode, every
parameter's ``requires_grad``, grad mode and autocast right before and right after each check;
``training_step`` records ``self.training``. The bug this guards: from the first check on, the
LightningModule and every layer outside the trunk stayed in eval mode for the rest of the fit.
"""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from growtrain import GrowUntilSaturated, StageFork, Trial
from growtrain.families.generic import GrowableStack
from growtrain.growable import grown_blocks

DIM, CLASSES = 6, 3


class Block(nn.Module):
    """``x + fc2(relu(bn(fc1 x)))``: a BatchNorm inside, so calibration has work to do."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(DIM, 5)
        self.bn = nn.BatchNorm1d(5)
        self.fc2 = nn.Linear(5, DIM)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.bn(self.fc1(x))))


def zero_block() -> Block:
    block = Block()
    nn.init.zeros_(block.fc2.weight)
    nn.init.zeros_(block.fc2.bias)
    return block


class Sandwich(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(4, DIM), nn.BatchNorm1d(DIM))
        self.trunk = GrowableStack([Block()], zero_block, ("fc2.weight", "fc2.bias"))
        self.head = nn.Sequential(nn.Dropout(0.2), nn.Linear(DIM, CLASSES))
        # user choices a check must not undo: a frozen parameter, a submodule kept in eval mode
        self.encoder[0].bias.requires_grad_(False)
        self.steady = nn.Dropout(0.5)
        self.training_flags: list[bool] = []

    def forward(self, x):
        return self.head(self.trunk(self.steady(self.encoder(x))))

    def on_train_epoch_start(self):
        self.steady.eval()  # the user keeps this one in eval while the rest trains

    def training_step(self, batch, batch_idx):
        self.training_flags.append(self.training)
        x, y = batch
        return F.cross_entropy(self(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD([p for p in self.parameters() if p.requires_grad], lr=0.05)


def snapshot(module: nn.Module) -> dict:
    return {
        "modes": {id(m): m.training for m in module.modules()},
        "requires_grad": {id(p): p.requires_grad for p in module.parameters()},
        "grad_enabled": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "autocast_cpu": torch.is_autocast_enabled("cpu"),
    }


class Spy(L.Callback):
    def __init__(self):
        self.snapshots: list[dict] = []

    def on_train_epoch_end(self, trainer, pl_module):
        self.snapshots.append(snapshot(pl_module))


def data(n: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=gen)
    y = (x[:, 0] > 0).long() + (x[:, 1] > 0.5).long()
    return TensorDataset(x, y)


# calibration of candidate BatchNorms is always on (the option was removed). Each decision runs its own code inside a check: the trial trains a
# block with the rest of the network frozen and in eval mode, the stage fork opens its arm.
@pytest.mark.parametrize(
    "rule, options",
    [
        ("paper", {"decision": "rule", "t": 1e-9}),
        ("crossfit", {"decision": "rule"}),
        ("crossfit", {"decision": Trial(min_gain=0.01)}),
        ("crossfit", {"decision": StageFork(min_gain=0.01)}),
    ],
    ids=["paper-rule", "crossfit-rule", "trial", "stage_fork"],
)
def test_a_check_restores_modes_flags_and_grad_state(tmp_path, rule, options):
    torch.manual_seed(0)
    module = Sandwich()
    train = DataLoader(data(96, 0), batch_size=16, shuffle=True)
    probe = DataLoader(data(64, 1), batch_size=16)
    # t=1e-9 makes the paper rule grow at its first check (both the grow and the later
    # checks are covered); the other decisions decide whatever the data say.
    grower = GrowUntilSaturated(schedule="periodic", probe=probe, network="trunk", rule=rule, max_growths=2,
                                on_saturated="continue", verbose=False, **options)  # fmt: skip
    before, after = Spy(), Spy()
    trainer = L.Trainer(max_epochs=3, callbacks=[before, grower, after], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip
    trainer.fit(module, train)

    checks = len(grower.history)
    name = grower.decision.name
    assert checks >= 1 and name == getattr(options["decision"], "name", options["decision"])
    key = {"trial": "trial", "stage_fork": "fork"}.get(name)
    if key is not None:  # the decision's own step ran inside the check
        assert key in grower.history[0]
    if options["decision"] == "trial":
        assert grower.history[0]["trial"]["trials"], grower.history[0]["trial"]
    if rule == "paper":
        assert grower.history[0]["action"] == "grow"
    for pre, post in zip(before.snapshots[:checks], after.snapshots[:checks]):
        # every module that existed before the check is back in its mode, including the
        # LightningModule itself, the encoder's BatchNorm, the head's Dropout and `steady`
        assert {k: post["modes"][k] for k in pre["modes"]} == pre["modes"]
        assert {k: post["requires_grad"][k] for k in pre["requires_grad"]} == pre["requires_grad"]
        for key in ("grad_enabled", "inference", "autocast_cpu"):
            assert post[key] == pre[key], key
    assert module.encoder[0].bias.requires_grad is False
    assert module.steady.training is False  # restored to the user's eval, not forced to train
    # training_step ran in train mode in every epoch, including those after the first check
    steps_per_epoch = len(train)
    assert len(module.training_flags) == 3 * steps_per_epoch
    assert all(module.training_flags), module.training_flags
    # inserted blocks train with the trunk and their parameters take gradients
    for block in grown_blocks(module.trunk):
        assert all(m.training for m in block.modules())
        assert all(p.requires_grad for p in block.parameters())
