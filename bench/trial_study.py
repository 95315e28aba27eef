"""Decision study: which statistic sees what one more block is worth, on converged networks?

Runs candidate growth statistics on saved, converged scratch networks of a depth sweep (the
ground truth: each depth's test loss is known) and writes one JSON row per (network, statistic,
site, seed) to ``--out`` (resumable: rows already there are skipped).

Statistics (``--kind``):

* ``block``  — block-only trial: a zero-output block at ``site``, every other parameter frozen
  and every other module in eval mode, the block alone trained for ``epochs`` epochs of the
  training split (``opt`` / ``lr``, cosine to 0), then per-sample losses compared, paired,
  with the network before, on the probe, the validation split, the official test split, and
  ``holdout`` training images the trial did not train on (the network before it did: they are
  in-sample for it, which is why the callback's trial scores the probe alone).
* ``joint``  — paired joint trial: the grown and the not-grown copy, *all* parameters trained
  for the same budget on the same batches at a low rate; the grown copy's per-sample losses
  are compared with the not-grown copy's.
* ``first_order`` — the cross-fit first-order lower bounds and Γ̂ of ``measure_saturation``.

Command (full Fashion-MNIST, the sweep's seed-0 networks; rows in docs/results/trial_study/):

    PYTHONPATH=. python bench/trial_study.py --ckpt ../shared/data/fmnist-full-scratch/seed0_blocks{3,4,5,6,7}.ckpt \
        --kind block --site layer2.1 --opt adam --lr 1e-3 --epochs 1 --seeds 0 1 \
        --out docs/results/trial_study/rows.jsonl
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import time

import torch
import torch.nn.functional as F

from growtrain.data import ImageDataModule, load_images
from growtrain.module import ImageClassifier


def load_split(root: str, seed: int, probe: int, val: int, holdout: int, train_subset: int | None):
    dm = ImageDataModule(dataset="fashion-mnist", root=root, probe_size=probe, val_size=val, seed=seed,
                         batch_size=128, train_subset=train_subset)
    dm.setup()
    data = load_images(dm.dataset, root)  # the official splits the datamodule's indices point into
    mean = torch.tensor(dm.mean).view(1, -1, 1, 1)
    std = torch.tensor(dm.std).view(1, -1, 1, 1)

    def norm(x):
        return (x.float() / 255.0 - mean) / std if x.dtype == torch.uint8 else x

    xtr, ytr = data["train"]
    xte, yte = data["test"]
    xtr = norm(xtr if xtr.dim() == 4 else xtr.unsqueeze(1))
    xte = norm(xte if xte.dim() == 4 else xte.unsqueeze(1))
    train = dm.train_indices
    g = torch.Generator().manual_seed(1234)
    perm = train[torch.randperm(len(train), generator=g)]
    hold, fit = perm[:holdout], perm[holdout:]
    sets = {
        "probe": (xtr[dm.probe_indices], ytr[dm.probe_indices]),
        "val": (xtr[dm.val_indices], ytr[dm.val_indices]),
        "test": (xte, yte),
        "holdout": (xtr[hold], ytr[hold]),
    }
    return sets, (xtr[fit], ytr[fit])


@torch.no_grad()
def per_sample(net, x, y, bs=1000):
    net.eval()
    out = [F.cross_entropy(net(x[i : i + bs]), y[i : i + bs], reduction="none") for i in range(0, len(y), bs)]
    return torch.cat(out)


def schedule(opt, steps):
    return torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))


def make_opt(params, kind, lr):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr)


def batches(train, epochs, seed, bs=128):
    x, y = train
    g = torch.Generator().manual_seed(seed)
    n = len(y)
    total = int(round(epochs * (n // bs)))
    done = 0
    while done < total:
        perm = torch.randperm(n, generator=g)
        for i in range(0, n - bs + 1, bs):
            if done == total:
                return
            idx = perm[i : i + bs]
            yield x[idx], y[idx]
            done += 1


def block_trial(net, site, train, epochs, opt_kind, lr, seed):
    net = copy.deepcopy(net)
    block = net.grow(site, net.new_block(site, seed=seed))
    for p in net.parameters():
        p.requires_grad_(False)
    params = list(block.parameters())
    for p in params:
        p.requires_grad_(True)
    steps = int(round(epochs * (len(train[1]) // 128)))
    opt = make_opt(params, opt_kind, lr)
    sched = schedule(opt, steps)
    torch.manual_seed(seed)
    net.eval()
    block.train()
    diverged = False
    for x, y in batches(train, epochs, seed):
        loss = F.cross_entropy(net(x), y)
        if not torch.isfinite(loss):
            diverged = True
            break
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        sched.step()
    return net, steps, diverged


def joint_trial(net, site, train, epochs, opt_kind, lr, seed):
    grown = copy.deepcopy(net)
    grown.grow(site, grown.new_block(site, seed=seed))
    plain = copy.deepcopy(net)
    steps = int(round(epochs * (len(train[1]) // 128)))
    opts = [make_opt(m.parameters(), opt_kind, lr) for m in (grown, plain)]
    scheds = [schedule(o, steps) for o in opts]
    for m in (grown, plain):
        m.train()
    for x, y in batches(train, epochs, seed):
        for m, o, s in zip((grown, plain), opts, scheds):
            loss = F.cross_entropy(m(x), y)
            o.zero_grad(set_to_none=True)
            loss.backward()
            o.step()
            s.step()
    return grown, plain, steps


def summarise(before, after):
    d = before.double() - after.double()  # positive: the trial lowered the loss
    n = d.numel()
    mb = float(before.double().mean())
    return {"n": n, "loss": mb, "gain": float(d.mean()), "gain_pct": 100 * float(d.mean()) / mb,
            "sd": float(d.std()), "se_pct": 100 * float(d.std()) / math.sqrt(n) / mb}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", nargs="+", required=True)
    ap.add_argument("--kind", choices=["block", "joint", "first_order"], default="block")
    ap.add_argument("--site", nargs="+", default=["layer2.1"])
    ap.add_argument("--opt", choices=["sgd", "adam"], default="adam")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--root", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--split_seed", type=int, default=0)
    ap.add_argument("--probe", type=int, default=2000)
    ap.add_argument("--val", type=int, default=1000)
    ap.add_argument("--holdout", type=int, default=0, help="training images the trial does not train on (scored)")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    done = set()
    if os.path.exists(a.out):
        done = {json.loads(line)["key"] for line in open(a.out) if line.strip()}
    sets, train = load_split(a.root, a.split_seed, a.probe, a.val, a.holdout, None)
    if a.holdout == 0:
        sets.pop("holdout")
    for ckpt in a.ckpt:
        model = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu")
        net = model.network.eval()
        depth = net.depth()
        base = {k: per_sample(net, *v) for k, v in sets.items()}
        for site in a.site:
            for seed in a.seeds:
                key = f"{os.path.basename(ckpt)}|{a.kind}|{site}|{a.opt}|{a.lr}|{a.epochs}|{a.holdout}|{a.probe}|{seed}"
                if key in done:
                    continue
                t0 = time.perf_counter()
                row = {"key": key, "ckpt": os.path.basename(ckpt), "blocks": depth, "kind": a.kind, "site": site,
                       "opt": a.opt, "lr": a.lr, "epochs": a.epochs, "holdout": a.holdout, "seed": seed}
                if a.kind == "block":
                    grown, steps, div = block_trial(net, site, train, a.epochs, a.opt, a.lr, seed)
                    row.update(steps=steps, diverged=div)
                    for k, v in sets.items():
                        row[k] = summarise(base[k], per_sample(grown, *v))
                elif a.kind == "joint":
                    grown, plain, steps = joint_trial(net, site, train, a.epochs, a.opt, a.lr, seed)
                    row.update(steps=steps)
                    for k, v in sets.items():
                        row[k] = summarise(per_sample(plain, *v), per_sample(grown, *v))
                else:
                    from growtrain.saturation import measure_saturation

                    x, y = sets["probe"]
                    loader = [(x[i : i + 500], y[i : i + 500]) for i in range(0, len(y), 500)]
                    rep = measure_saturation(net, loader, F.cross_entropy, rule="crossfit", delta=0.0, alpha=0.05,
                                             variance=True)
                    row.update(gamma=float(rep.gamma), threshold=rep.threshold,
                               lowers={r.name: float(r.lower) for r in rep.sites if r.lower is not None})
                row["wall_s"] = time.perf_counter() - t0
                with open(a.out, "a") as f:
                    f.write(json.dumps(row) + "\n")
                if a.kind == "first_order":
                    print(row["ckpt"], "gamma", round(row["gamma"], 4), "delta+t", row["threshold"], flush=True)
                    continue
                short = {k: round(row[k]["gain_pct"], 2) for k in sets if k in row}
                print(row["ckpt"], site, seed, short, {k: round(row[k]["se_pct"], 2) for k in sets if k in row},
                      f"{row['wall_s']:.0f}s", flush=True)


if __name__ == "__main__":
    main()
