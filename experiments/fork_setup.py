"""The shared setting of the manual fork diagnostics (experiments/fork_noise.py, fork_anneal.py):
full Fashion-MNIST as the growth runs split it (2,000 probe, 1,000 validation images, seed 0, no
augmentation), ResNet-8 width 8 and the growth runs' optimizer (SGD 0.05, momentum 0.9, weight
decay 5e-4, batch 128), one thread."""

import torch
import torch.nn.functional as F

from growtrain.data import ImageDataModule
from growtrain.data.transforms import normalize_batch
from growtrain.module import ImageClassifier
from growtrain.optim import param_groups

torch.set_num_threads(1)
torch.manual_seed(0)
dm = ImageDataModule(dataset="fashion-mnist", root="/usr/share/datasets/fashion-mnist", augment=False,
                     probe_size=2000, val_size=1000)  # fmt: skip
dm.setup("fit")
probe = list(dm.probe_dataloader())
net = ImageClassifier(in_channels=1).network
opt = torch.optim.SGD(param_groups(net), lr=0.05, momentum=0.9, weight_decay=5e-4)


def batches():
    """One epoch of training batches, normalised as the datamodule's hook does."""
    for x, y in dm.train_dataloader():
        yield normalize_batch(x, dm.mean, dm.std), y


def step(n, o, b):
    """One SGD step of network ``n`` with optimizer ``o`` on batch ``b``."""
    n.train()
    o.zero_grad(set_to_none=True)
    F.cross_entropy(n(b[0]), b[1]).backward()
    o.step()


@torch.no_grad()
def losses(n):
    """Each probe image's loss under ``n`` (eval mode), float64."""
    n.eval()
    return torch.cat([F.cross_entropy(n(x), y, reduction="none").double() for x, y in probe])


def step_all(arms: dict, b, t: int, ramp: int) -> None:
    """The run's step on batch ``b`` (its ``t``-th since the forks opened), then each arm's at the
    run's rate, its block's rate ramped over ``ramp`` steps (growtrain.fork.warmup)."""
    from growtrain.fork import mirror_lrs, warmup

    step(net, opt, b)
    for arm, arm_opt, _, refs in arms.values():
        mirror_lrs(arm_opt, opt, refs, [1.0] * len(refs), warm=warmup(t, ramp))
        step(arm, arm_opt, b)
