"""How much of a fork's gain is the block, and how much the two sides' SGD paths parting?

Full Fashion-MNIST, seed 0 (the growth runs' data and optimizer: SGD 0.05, momentum 0.9, weight
decay 5e-4, batch 128). The run trains ``E0`` epochs; then forks open at the same moment at one
site, one arm per block seed (growtrain.fork.make_arm; the block's rate ramped over the first half
of the horizon as decision="fork" does); all train ``H`` epochs on the same batches. Printed: each
arm's gain over the run on the 2,000-image probe (% of the run's loss), averaged over the fork's
five scoring points (1/2, 5/8, 3/4, 7/8 of the horizon and its end), with the bootstrap-free
standard error of the paired mean; the spread *between* arms that differ only in the block's
random initialisation is the noise of one fork's verdict that the per-sample bounds do not see.

    PYTHONPATH=. python experiments/fork_noise.py 3 layer2.1 4 1 2 3
"""

import sys

import torch
import torch.nn.functional as F

from growtrain.data import ImageDataModule
from growtrain.data.transforms import normalize_batch
from growtrain.fork import make_arm, mirror_lrs, warmup
from growtrain.module import ImageClassifier
from growtrain.optim import param_groups

torch.set_num_threads(1)
E0, SITE, H = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
SEEDS = [int(s) for s in sys.argv[4:]] or [1, 2, 3]
torch.manual_seed(0)
dm = ImageDataModule(dataset="fashion-mnist", root="/usr/share/datasets/fashion-mnist", augment=False,
                     probe_size=2000, val_size=1000)  # fmt: skip
dm.setup("fit")
probe = list(dm.probe_dataloader())
net = ImageClassifier(in_channels=1).network
opt = torch.optim.SGD(param_groups(net), lr=0.05, momentum=0.9, weight_decay=5e-4)


def batches():
    for x, y in dm.train_dataloader():
        yield normalize_batch(x, dm.mean, dm.std), y


def step(n, o, b):
    n.train()
    o.zero_grad(set_to_none=True)
    F.cross_entropy(n(b[0]), b[1]).backward()
    o.step()


@torch.no_grad()
def losses(n):
    n.eval()
    return torch.cat([F.cross_entropy(n(x), y, reduction="none").double() for x, y in probe])


for _ in range(E0):
    for b in batches():
        step(net, opt, b)
arms = {s: make_arm(net, opt, SITE, seed=s) for s in SEEDS}
n = len(opt.param_groups)
steps_per_epoch = sum(1 for _ in dm.train_dataloader())
horizon = H * steps_per_epoch
marks = {round(horizon * f) for f in (0.5, 0.625, 0.75, 0.875)} | {horizon}
sums = {"run": 0.0, **{s: 0.0 for s in SEEDS}}
t = 0
for epoch in range(E0 + 1, E0 + H + 1):
    for b in batches():
        t += 1
        step(net, opt, b)
        for s, (arm, arm_opt, _, refs) in arms.items():
            mirror_lrs(arm_opt, opt, refs, [1.0] * len(refs), warm=warmup(t, horizon // 2))
            step(arm, arm_opt, b)
        if t in marks:
            sums["run"] = sums["run"] + losses(net)
            for s, (arm, *_) in arms.items():
                sums[s] = sums[s] + losses(arm)
    run = losses(net)
    print(f"epoch {epoch}: run probe loss {run.mean():.4f}; arms now " + ", ".join(
        f"seed {s} {100 * float((run - losses(a[0])).mean() / run.mean()):+.2f} %" for s, a in arms.items()), flush=True)
control = sums["run"] / len(marks)
for s in SEEDS:
    d = control - sums[s] / len(marks)
    print(f"fork at {SITE} after {E0} epochs, horizon {H}, block seed {s}: gain {100 * float(d.mean() / control.mean()):+.2f} % "
          f"(paired se {100 * float(d.std() / d.numel() ** 0.5 / control.mean()):.2f} %)", flush=True)
