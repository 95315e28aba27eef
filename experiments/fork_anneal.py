"""Does scoring each side of a fork after a short anneal measure the block, where scoring at the
run's constant rate measured SGD noise?

Full Fashion-MNIST, seed 0, the growth runs' optimizer (SGD 0.05, momentum 0.9, weight decay 5e-4,
batch 128), as experiments/fork_noise.py: the run trains ``E0`` epochs, then forks open at ``SITE``,
one arm per block seed (the block's rate ramped over the first ``RAMP`` epochs), and all train on
the same batches (``SITE`` may name one site per stage, comma-separated: decision="stage_fork"'s
arm). At the end of every epoch after that, a copy of the run and of each arm is
annealed for ``A`` steps (the rate cosine from the run's to 0, each side with a copy of its own
optimizer state, on the same ``A`` training batches for every side) and scored on the
2,000-image probe. Printed per epoch: each arm's gain over the run at the constant rate and
after the anneal, in % of the run's loss, with the paired se.

    PYTHONPATH=. python experiments/fork_anneal.py 3 layer2.1 8 111 1 2 3
    PYTHONPATH=. python experiments/fork_anneal.py 3 layer1.0,layer2.1,layer3.1 10 111 1   # a stage fork's arm
"""

import copy
import math
import sys


from growtrain.fork import copy_optimizer, make_arm

from fork_setup import batches, dm, losses, net, opt, step, step_all

E0, SITE, H, A = int(sys.argv[1]), sys.argv[2].split(","), int(sys.argv[3]), int(sys.argv[4])  # SITE: one or a,b,c
SEEDS = [int(s) for s in sys.argv[5:]] or [1, 2, 3]
RAMP = 1  # epochs of the block's rate warm-up

anneal_batches = []
for b in batches():  # A fixed training batches (a later epoch's order), the same for every side
    anneal_batches.append(b)
    if len(anneal_batches) == A:
        break


def annealed(n, o):
    memo = {}
    n2 = copy.deepcopy(n, memo)
    o2 = copy_optimizer(o, {id(p): memo[id(p)] for p in n.parameters()})
    lr0 = [grp["lr"] for grp in o2.param_groups]
    for i, b in enumerate(anneal_batches):
        f = 0.5 * (1 + math.cos(math.pi * i / A))
        for grp, l0 in zip(o2.param_groups, lr0):
            grp["lr"] = l0 * f
        step(n2, o2, b)
    return losses(n2)


def gain(run, arm):
    d = run - arm
    return f"{100 * float(d.mean() / run.mean()):+6.2f} % (se {100 * float(d.std() / d.numel() ** 0.5 / run.mean()):.2f})"


for _ in range(E0):
    for b in batches():
        step(net, opt, b)
arms = {s: make_arm(net, opt, SITE, seed=s) for s in SEEDS}
steps_per_epoch = sum(1 for _ in dm.train_dataloader())
t = 0
for epoch in range(E0 + 1, E0 + H + 1):
    for b in batches():
        t += 1
        step_all(arms, b, t, RAMP * steps_per_epoch)
    run, run_a = losses(net), annealed(net, opt)
    print(f"epoch {epoch} (horizon {epoch - E0}): run {run.mean():.4f}, annealed {run_a.mean():.4f}", flush=True)
    for s, (arm, arm_opt, *_) in arms.items():
        print(f"  block seed {s}: constant rate {gain(run, losses(arm))}   annealed {A} steps {gain(run_a, annealed(arm, arm_opt))}",
              flush=True)
