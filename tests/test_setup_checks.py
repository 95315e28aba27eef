"""What would fail only at the first check, a whole stage in, is refused before the first step
(``check_probe_setup``, called from ``GrowUntilSaturated.on_train_start``): a block that is not
the identity at zero output, and a module without ``forward`` whose network the probe cannot
score. A module without ``forward`` whose network is the whole model is probed through it."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Subset, TensorDataset

from growtrain import GrowableStack
from growtrain.callbacks import GrowUntilSaturated
from growtrain.callbacks.probe_data import ProbeView, check_probe_setup, has_forward
from growtrain.models import cifar_resnet
from growtrain.module import GrowableModuleMixin
from growtrain.optim import param_groups


class Residual(nn.Module):
    """``x + fc2(tanh(fc1(x)))``: the identity when fc2 is zero."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(width, width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.fc2(torch.tanh(self.fc1(x)))


class NoSkip(Residual):
    """``fc2(tanh(fc1(x)))``: the skip connection forgotten; zero (not x) when fc2 is zero."""

    def forward(self, x):
        return self.fc2(torch.tanh(self.fc1(x)))


def stack(block=Residual) -> GrowableStack:
    return GrowableStack([block()], factory=block, terminal=("fc2.weight", "fc2.bias"))


class Quiet(GrowableModuleMixin, L.LightningModule):
    """No ``forward``: ``training_step`` calls ``self.net`` (legal in Lightning). With ``head``,
    the network is a trunk between an input map and a head the probe cannot know about."""

    def __init__(self, block=Residual, head: bool = False):
        super().__init__()
        self.net = stack(block)
        self.inp, self.out = (nn.Linear(3, 4), nn.Linear(4, 2)) if head else (None, None)

    def training_step(self, batch, batch_idx):
        x, y = batch
        if self.inp is not None:
            return F.cross_entropy(self.out(self.net(self.inp(x))), y)
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        other = [p for m in (self.inp, self.out) if m is not None for p in m.parameters()]
        groups = ([{"name": "other", "params": other}] if other else []) + param_groups(self.net)
        return torch.optim.Adam(groups, lr=1e-2)


def blobs(n=240, dim=4, seed=0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    y = torch.randint(0, 2, (n,), generator=g)
    x = torch.randn(n, dim, generator=g) + 2.0 * y[:, None].float()
    return TensorDataset(x, y)


def loaders(dim=4):
    ds = blobs(dim=dim)
    train = DataLoader(Subset(ds, range(160)), batch_size=32, shuffle=True)
    return train, DataLoader(Subset(ds, range(160, 240)), batch_size=40)


class FakeTrainer:
    """What check_probe_setup reads from a trainer: the precision plugin's input conversion."""

    class precision_plugin:  # noqa: N801 - the trainer's attribute name
        @staticmethod
        def convert_input(batch):
            return batch


def test_a_block_without_its_skip_is_refused_naming_it():
    L.seed_everything(0)
    module = Quiet(NoSkip)
    _, probe = loaders()
    with pytest.raises(ValueError, match=r"network: a new NoSkip \(in ResidualAdapter\) block at site blocks\.0.*"
                                         r"must return x \+ f\(x\).*last map.*Fix: make NoSkip\.forward return"):  # fmt: skip
        check_probe_setup(FakeTrainer(), module, module.net, probe, F.cross_entropy)
    assert module.net.growth_log == [] and module.net.depth() == 1  # the trial insertion was taken back


def test_identity_blocks_pass_and_leave_the_network_as_it_was():
    """The shipped families and a user's residual block pass; nothing of the network changes:
    its growth record, its blocks, every submodule's mode, every weight."""
    L.seed_everything(0)
    for network, x in ((stack(), torch.randn(8, 4)),
                       (cifar_resnet((1, 1, 1), width=4, family="basic", in_channels=1, num_classes=3), torch.randn(8, 1, 8, 8)),
                       (cifar_resnet((1, 2, 1), width=4, family="preact", in_channels=1, num_classes=3), torch.randn(8, 1, 8, 8))):  # fmt: skip
        network.train()
        network.get_submodule(next(n for n, m in network.named_modules() if n)).eval()  # a frozen part stays frozen
        modes = [m.training for m in network.modules()]
        state = {k: v.clone() for k, v in network.state_dict().items() if torch.is_tensor(v)}
        y = torch.zeros(8, dtype=torch.long)
        check_probe_setup(FakeTrainer(), network, network, [(x, y)], lambda out, t: out.sum())
        assert network.growth_log == [] and list(getattr(network, "_grown_blocks")) == []
        assert [m.training for m in network.modules()] == modes
        assert {k for k, v in network.state_dict().items() if torch.is_tensor(v)} == state.keys()
        assert all(torch.equal(network.state_dict()[k], v) for k, v in state.items())


def test_the_check_leaves_the_random_number_generators_alone():
    """A DataLoader iterator draws its base seed from torch's global generator: unforked, the
    check would move the training data order, and a run with it would train differently."""
    L.seed_everything(0)
    module = Quiet()
    _, probe = loaders()
    state = torch.get_rng_state()
    check_probe_setup(FakeTrainer(), module, module.net, probe, F.cross_entropy)
    assert torch.equal(torch.get_rng_state(), state)


def test_a_module_without_forward_is_probed_through_its_network(tmp_path):
    """Lightning does not require forward; the probe then runs the network (here: the whole
    model). The fit grows at its first check instead of failing there."""
    L.seed_everything(0)
    module = Quiet()
    assert not has_forward(module) and has_forward(module.net)
    x = torch.randn(5, 4)
    assert torch.equal(ProbeView(module, module.net)(x), module.net(x))
    train, probe = loaders()
    grow = GrowUntilSaturated(probe=probe, network="net", schedule="periodic", decision="rule",
                              rule="paper", t=1e-9, max_growths=1, verbose=False)  # fmt: skip
    trainer = L.Trainer(max_epochs=2, callbacks=[grow], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    trainer.fit(module, train)
    assert grow.history[0]["action"] == "grow" and module.net.depth() == 2


def test_a_module_without_forward_whose_network_is_a_trunk_is_refused_with_the_fix():
    """Its network takes 4 features, the probe's inputs have 3 (the module's input map is not
    in the network): the probe cannot score the network alone, and says how to fix it."""
    L.seed_everything(0)
    module = Quiet(head=True)
    _, probe = loaders(dim=3)
    with pytest.raises(ValueError, match=r"network: Quiet defines no forward\(\).*runs the growable network "
                                         r"\(GrowableStack\) alone.*Fix: define forward\(x\) on Quiet"):  # fmt: skip
        check_probe_setup(FakeTrainer(), module, module.net, probe, F.cross_entropy)


def _fit(tmp_path, module, probe, train):
    grow = GrowUntilSaturated(probe=probe, network="net", schedule="periodic", decision="rule",
                              rule="paper", t=1e-9, verbose=False)  # fmt: skip
    steps = []

    class Steps(L.Callback):
        def on_train_batch_end(self, *args):
            steps.append(1)

    trainer = L.Trainer(max_epochs=2, callbacks=[grow, Steps()], logger=False, enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False, default_root_dir=tmp_path)  # fmt: skip
    return trainer, steps


def test_the_callback_refuses_a_block_without_its_skip_before_the_first_step(tmp_path):
    L.seed_everything(0)
    train, probe = loaders()
    module = Quiet(NoSkip)
    trainer, steps = _fit(tmp_path, module, probe, train)
    with pytest.raises(ValueError, match=r"a new NoSkip \(in ResidualAdapter\) block.*must return x \+ f\(x\)"):
        trainer.fit(module, train)
    assert steps == [] and module.net.depth() == 1


def test_the_callback_refuses_a_trunk_without_forward_before_the_first_step(tmp_path):
    L.seed_everything(0)
    train, probe = loaders(dim=3)
    module = Quiet(head=True)
    trainer, steps = _fit(tmp_path, module, probe, train)
    with pytest.raises(ValueError, match=r"Quiet defines no forward\(\).*Fix: define forward\(x\)"):
        trainer.fit(module, train)
    assert steps == []
