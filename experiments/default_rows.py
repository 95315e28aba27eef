"""The default decision's rows on the full Fashion-MNIST, with today's code (docs/results.md).

The callback's default decision (block-only trials, scored on the probe alone since 2026-12-04) was
last run on the full data when it still pooled 20,000 held-back *training* images with the probe.
These rows rerun it as it ships, one change from ``configs/fmnist/stopping.yaml`` per row (the
grid of seeds, a second split, a quarter of the data, each constant halved and doubled,
a larger probe), each with ``experiments/full_growth.sh`` into a folder of its own:

    OUT=runs/default_full/NAME experiments/full_growth.sh SEED [OVERRIDES]     # one row (see ROWS)
    python experiments/default_rows.py runs/default_full --commands      # every row's command
    python experiments/default_rows.py runs/default_full --raw docs/results/default_full

Prints the table (each check's best trial: gain and lower bound; the handed-over depth and test
loss beside the sweep's scratch network of that depth and seed) and copies each finished row to
``--raw`` as NAME.json. A row still training is listed as such.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from full_results import load, path_of, trial_flops  # noqa: E402

C = "--trainer.callbacks.init_args."
# NAME: (seed, the overrides after the seed, what it changes)
ROWS = {
    "s0": (0, "", "none (seed 0)"),
    "s1": (1, "", "seed 1"),
    "s2": (2, "", "seed 2"),
    "split1": (0, "--data.init_args.seed=1", "second split"),
    "p25": (0, "--data.init_args.train_subset=14250", "25 % of the training images"),
    "g05": (0, C + "decision.min_gain=0.005", "`min_gain` 0.5 % (halved)"),
    "g2": (0, C + "decision.min_gain=0.02", "`min_gain` 2 % (doubled)"),
    "s0p10k": (0, "--data.init_args.probe_size=10000", "10,000-image probe (5×)"),
    "s1p10k": (1, "--data.init_args.probe_size=10000", "10,000-image probe (5×), seed 1"),
    "t025": (0, C + "decision.epochs=0.25", "`Trial.epochs` 0.25 (halved)"),
    "t1": (0, C + "decision.epochs=1.0", "`Trial.epochs` 1 (doubled)"),
    "pat1": (0, C + "schedule.patience=1", "`patience` 1 (halved)"),
    "pat4": (0, C + "schedule.patience=4", "`patience` 4 (doubled)"),
    "s2p10k": (2, "--data.init_args.probe_size=10000", "10,000-image probe (5×), seed 2"),
    "split1p10k": (0, "--data.init_args.seed=1 --data.init_args.probe_size=10000", "10,000-image probe (5×), second split"),
    "p25s1": (1, "--data.init_args.train_subset=14250", "25 % of the training images, seed 1"),
    "p25s2": (2, "--data.init_args.train_subset=14250", "25 % of the training images, seed 2"),
    "mrd025": (0, C + "schedule.min_rel_delta=0.0025", "`min_rel_delta` 0.25 % (halved)"),
    "mrd1": (0, C + "schedule.min_rel_delta=0.01", "`min_rel_delta` 1 % (doubled)"),
    # full_stopping.sh pins one thread: this row is the same growtrain stopping call with OMP_NUM_THREADS=2, alone
    "s0t2": (0, "", "2 threads (seed 0, nothing else running)"),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", help="the folder holding one folder per row (NAME/runs.jsonl)")
    ap.add_argument("--sweep", default="docs/results/stopping_full/runs.jsonl", help="the scratch sweep's rows")
    ap.add_argument("--raw", default=None, help="copy each finished row here as NAME.json")
    ap.add_argument("--commands", action="store_true", help="print the command of every row (into RUNS/NAME) and exit")
    a = ap.parse_args()
    if a.commands:
        for name, (seed, overrides, _) in ROWS.items():
            if name == "s0t2":  # full_stopping.sh pins one thread
                print(f"# {name}: full_stopping.sh's growtrain stopping call by hand, OMP_NUM_THREADS=2, nothing else running")
                continue
            print(f"OUT={a.runs}/{name} experiments/full_growth.sh {seed} {overrides}".rstrip())
        return
    scratch = {(r["blocks"], r["seed"]): r for r in load(a.sweep) if r["key"].startswith("scratch/")}
    print("| row | change | checks: blocks → action (best trial: gain ≥ lower bound) | blocks | test loss | "
          "scratch at that depth (sweep, same seed) | epochs | GFLOP (trials' share) | checks' share of the wall time |")
    print("|---|---|---|---|---|---|---|---|---|")
    for name, (_, overrides, what) in ROWS.items():
        path = Path(a.runs) / name / "runs.jsonl"
        growth = [r for r in load(path) if r["key"].startswith("growth/")] if path.exists() else []
        if not growth:
            state = "training or cut" if path.parent.exists() else "not run"
            print(f"| {name} | {what} | ({state}) | | | | | | |")
            continue
        r = growth[-1]
        # the sweep's data: split 0, every training image, a 2,000-image probe; a --data override changes them
        same = scratch.get((r["blocks"], r["seed"])) if "--data." not in overrides else None
        total = r["flops"] + trial_flops(r)
        ref = f"{same['test_loss']:.4f}" if same else "—"
        print(f"| {name} | {what} | {path_of(r)} | {r['blocks']} | {r['test_loss']:.4f} | {ref} | {r['epochs']} | "
              f"{total / 1e9:,.0f} ({100 * (total - r['flops']) / total:.0f} %) | "
              f"{100 * r['probe_s'] / r['wall_s']:.0f} % of {r['wall_s'] / 60:.0f} min |")
        if a.raw:
            Path(a.raw).mkdir(parents=True, exist_ok=True)
            (Path(a.raw) / f"{name}.json").write_text(json.dumps(r, indent=1) + "\n")


if __name__ == "__main__":
    main()
