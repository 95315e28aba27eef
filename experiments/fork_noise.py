"""How much of a fork's gain is the block, and how much the two sides' SGD paths parting?

Full Fashion-MNIST, seed 0 (the growth runs' data and optimizer: SGD 0.05, momentum 0.9, weight
decay 5e-4, batch 128). The run trains ``E0`` epochs; then forks open at the same moment at one
site, one arm per block seed (growtrain.fork.make_arm; the block's rate ramped over the first half
of the horizon, growtrain.fork.warmup); all train ``H`` epochs on the same batches. Printed: each
arm's gain over the run on the 2,000-image probe (% of the run's loss), averaged over five
scoring points (1/2, 5/8, 3/4, 7/8 of the horizon and its end), with the bootstrap-free
standard error of the paired mean; the spread *between* arms that differ only in the block's
random initialisation is the noise of one fork's verdict that the per-sample bounds do not see.

    PYTHONPATH=. python experiments/fork_noise.py 3 layer2.1 4 1 2 3
"""

import sys


from growtrain.fork import make_arm

from fork_setup import batches, dm, losses, net, opt, step, step_all

E0, SITE, H = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
SEEDS = [int(s) for s in sys.argv[4:]] or [1, 2, 3]

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
        step_all(arms, b, t, horizon // 2)
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
