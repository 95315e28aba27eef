"""A probe call retains nothing once it returns.

The leak this guards against: the gradient hook on each site activation ``z`` captured ``z``
itself, a reference cycle through autograd (tensor → its C++ hook list → the Python lambda →
tensor) that Python's collector cannot see, so every probe pass's activations stayed alive
(~200 MB per call at width 16 with 512 images). Weak references to the activations that the
probe's forward passes produce must be dead once ``measure_saturation`` (or a fit with several
checks) has returned; while the pass runs they are alive, which the tests check too, so a
hook that never fires cannot pass them.
"""

from __future__ import annotations

import gc
import weakref

import lightning as L
import pytest
import torch
from torch.nn import functional as F

from growtrain import GrowUntilSaturated, measure_saturation
from growtrain.data import ImageDataModule
from growtrain.models import cifar_resnet
from growtrain.module import ImageClassifier


class ProbeActivations:
    """Weak references to every block's input and output during *probe* forward passes.

    A probe pass runs the network in eval mode with gradients enabled; training runs in train
    mode, validation and the BatchNorm calibration without gradients, so only the probe's
    activations are recorded. ``peak`` counts how many were alive at the end of the
    latest forward (the probe holds them until its backward has run)."""

    def __init__(self, network: torch.nn.Module):
        self.refs: list[weakref.ref] = []
        self.handles = [
            block.register_forward_hook(self._record)
            for name in network.growable_stages
            for block in network.stage(name)
        ]

    def _record(self, module, args, output):
        if not module.training and torch.is_grad_enabled():
            self.refs += [weakref.ref(args[0]), weakref.ref(output)]

    def alive(self) -> int:
        gc.collect()
        return sum(ref() is not None for ref in self.refs)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def _net_and_probe(seed: int = 0):
    torch.manual_seed(seed)
    net = cifar_resnet((1, 2, 1), width=4, family="preact", in_channels=3, num_classes=4).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(48, 3, 8, 8, generator=gen)
    y = torch.randint(0, 4, (48,), generator=gen)
    return net, [(x[i : i + 16], y[i : i + 16]) for i in range(0, 48, 16)]


@pytest.mark.parametrize("rule", ["paper", "crossfit"])
@pytest.mark.parametrize("calibrate", [True, False])
def test_probe_activations_are_freed_when_the_call_returns(rule, calibrate):
    net, batches = _net_and_probe()
    seen = ProbeActivations(net)
    alive_during = []

    def loss_fn(out, y):  # runs after each probe forward, while its activations must be alive
        alive_during.append(sum(ref() is not None for ref in seen.refs))
        return F.cross_entropy(out, y)

    try:
        for _ in range(3):  # repeated checks on one network
            measure_saturation(net, batches, loss_fn, rule=rule, calibrate=calibrate, projected=True)
            assert seen.refs, "no probe activation was recorded: the test no longer sees the probe pass"
            assert seen.alive() == 0, f"{seen.alive()} probe activations outlived the call"
    finally:
        seen.remove()
    assert min(alive_during) > 0  # the weak references do track live tensors during the pass


def test_a_fit_with_several_checks_keeps_no_probe_activations(tmp_path):
    L.seed_everything(0)
    dm = ImageDataModule(dataset="synthetic", image_size=8, synthetic_size=200, synthetic_classes=4, probe_size=48,
                         val_size=16, batch_size=32, augment=False)  # fmt: skip
    module = ImageClassifier(width=4, num_classes=4)
    # t tiny: every check grows, so the network (and its activations) change between checks.
    # monitor=None: a check at the end of every epoch (no plateau wait).
    grow = GrowUntilSaturated(schedule="periodic", decision="trial", rule="paper", t=1e-9,
                              max_growths=3, verbose=False)
    seen = ProbeActivations(module.network)

    class Between(L.Callback):
        """After each epoch's check, the activations of every probe pass so far are dead."""

        def __init__(self):
            self.after_checks: list[tuple[int, int]] = []

        def on_train_epoch_end(self, trainer, pl_module):
            self.after_checks.append((grow.checks, seen.alive()))

    between = Between()
    trainer = L.Trainer(max_epochs=3, callbacks=[grow, between], logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                        default_root_dir=tmp_path, accelerator="cpu")  # fmt: skip
    try:
        trainer.fit(module, dm)
    finally:
        seen.remove()
    assert grow.checks >= 2 and seen.refs
    assert seen.alive() == 0, f"{seen.alive()} probe activations outlived the fit"
    # The growth callback runs before `between` at each epoch end (callback order), so every
    # entry is measured after that epoch's check.
    assert all(alive == 0 for _, alive in between.after_checks), between.after_checks
