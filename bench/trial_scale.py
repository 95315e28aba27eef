"""Is the default decision scale-free on a real network? The block-only trial, through the
product's own ``train_block`` / ``trial_test`` / ``trial_verdict``, on one saved network with the
loss × 1 and × 10: same block initialisation, same batches, scored on the same probe (the
callback's evaluation set: 2000 images held out from training by index, nothing else).

A whole growth run with the loss × 10 (and lr ÷ 10, weight decay × 10) cannot test this alone:
its SGD steps equal the plain run's only up to rounding, which compounds over thousands of steps
into another network by the first check. This script fixes the network and changes only the
scale, so any difference in the verdict is the decision's own.

    PYTHONPATH=. OMP_NUM_THREADS=1 python bench/trial_scale.py \
        --ckpt ../shared/data/fmnist-full-scratch/seed0_blocks3.ckpt --out docs/results/trial_study/scale.json
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(__file__))
from trial_study import batches, load_split, per_sample  # noqa: E402  (the study's split and batches)

from growtrain.module import ImageClassifier  # noqa: E402
from growtrain.trial import (  # noqa: E402
    DEFAULT_TRIAL_EPOCHS, DEFAULT_TRIAL_LR, train_block, trial_test, trial_verdict,
)  # fmt: skip


def trials(net, sites, train, probe, scale, min_gain, level, seed):
    loss_fn = lambda out, y: scale * F.cross_entropy(out, y)  # noqa: E731
    # half an epoch of the training split, as the callback counts it (batches of 128, the last one dropped)
    steps = int(round(DEFAULT_TRIAL_EPOCHS * (len(train[1]) // 128)))
    before = scale * per_sample(net, *probe)
    rows = []
    for site in sites:
        grown = copy.deepcopy(net)
        block = grown.grow(site, grown.new_block(site, seed=seed))
        fit = train_block(grown, grown, block, batches(train, 1.0, seed), loss_fn, steps=steps,
                          lr=DEFAULT_TRIAL_LR)  # fmt: skip
        after = scale * per_sample(grown, *probe)
        test = trial_test(before, after, min_gain=min_gain, level=level / len(sites), seed=seed)
        rows.append({"site": site, "diverged": fit["diverged"], "steps": fit["steps"], **test})
    return rows, trial_verdict(rows, min_gain)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--sites", nargs="+", default=["layer3.1", "layer2.1", "layer1.1"])
    ap.add_argument("--root", default="/usr/share/datasets/fashion-mnist")
    ap.add_argument("--min_gain", type=float, default=0.01)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    sets, train = load_split(a.root, 0, 2000, 1000, 0, None)  # no training image set aside: all are trained on
    net = ImageClassifier.load_from_checkpoint(a.ckpt, map_location="cpu").network.eval()
    result = {"ckpt": os.path.basename(a.ckpt), "sites": a.sites, "min_gain": a.min_gain}
    for scale in (1.0, 10.0):
        rows, verdict = trials(net, a.sites, train, sets["probe"], scale, a.min_gain, 0.05, a.seed)
        result[f"x{scale:g}"] = {"verdict": {"saturated": verdict.saturated, "site": verdict.site,
                                             "score": verdict.score, "reason": verdict.reason},
                                 "trials": [{k: r[k] for k in ("site", "diverged", "gain_frac", "lower_frac",
                                                                "upper_frac", "loss_before")} for r in rows]}  # fmt: skip
        print(scale, result[f"x{scale:g}"]["verdict"], flush=True)
    one, ten = result["x1"], result["x10"]
    result["identical_decision"] = (one["verdict"]["saturated"], one["verdict"]["site"]) == (
        ten["verdict"]["saturated"], ten["verdict"]["site"])
    result["max_abs_diff_gain_frac"] = max(abs(p["gain_frac"] - q["gain_frac"])
                                           for p, q in zip(one["trials"], ten["trials"]))  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: result[k] for k in ("identical_decision", "max_abs_diff_gain_frac")}))


if __name__ == "__main__":
    main()
