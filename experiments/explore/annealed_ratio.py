"""Exploration: the relative rule's ratio on the *annealed* scratch networks of a stopping sweep.

Every scratch run of `growtrain stopping` ends annealed (plateau, then a cosine anneal), which is
the state a check sees under `lr_schedule="anneal"`. Measuring the ratio (best cross-fit lower
bound / R) on each final checkpoint shows how the decision statistic moves with depth at no
training cost, and where a threshold would cut the sweep.

    python experiments/explore/annealed_ratio.py runs/stopping --out runs/explore/annealed_ratio_old.json --probe_seeds 0 1 2

(runs/stopping: the scratch sweep at 3, 6, 9, 12 blocks × seeds 0, 1.) The rows are in
docs/results/stopping/annealed_ratio.json; the table in docs/decision.md.
"""
import argparse, json, glob, re, time
from pathlib import Path

import torch
import torch.nn.functional as F

from growtrain.data import ImageDataModule
from growtrain.module import ImageClassifier
from growtrain.saturation import measure_saturation

ap = argparse.ArgumentParser()
ap.add_argument("sweep_dir")
ap.add_argument("--out", required=True)
ap.add_argument("--probe_seeds", type=int, nargs="+", default=[0, 1, 2])
a = ap.parse_args()
torch.set_num_threads(1)
data = ImageDataModule(dataset="fashion-mnist-mini", probe_size=2000, val_size=1000, batch_size=128, seed=0, augment=False)
data.setup("fit")
rows = []
done = {}
if Path(a.out).exists():
    for r in json.load(open(a.out)):
        done[(r["run"], r["probe_seed"])] = r
        rows.append(r)
for run in sorted(glob.glob(f"{a.sweep_dir}/scratch_*_seed*")):
    ckpts = sorted(glob.glob(f"{run}/checkpoints/*.ckpt"))
    if not ckpts:
        continue
    added, seed = map(int, re.findall(r"added(\d+)_seed(\d+)", run)[0])
    model = ImageClassifier.load_from_checkpoint(ckpts[-1], map_location="cpu").eval()
    for ps in a.probe_seeds:
        if (run, ps) in done:
            continue
        t0 = time.time()
        r = measure_saturation(model.network, data.probe_dataloader(), F.cross_entropy, rule="relative", tau=0.5,
                               alpha=0.05, projected=False, seed=ps)
        row = {"run": run, "added": added, "blocks": added + 3, "seed": seed, "probe_seed": ps,
               "ratio": r.ratio, "lower": r.margin if False else None, "reference": r.reference,
               "saturated": r.saturated, "site": r.best_site, "seconds": time.time() - t0}
        row["lower"] = r.ratio * r.reference if r.ratio is not None else None
        rows.append(row)
        print(json.dumps(row), flush=True)
        json.dump(rows, open(a.out, "w"), indent=1)
