"""Scratch given a stage-fork growth run's compute (experiments/fork_full.sh): its ground truth, as
experiments/periodic_matched.py gives it for a periodic run, with the arms' compute counted.

A fork run's compute is its training FLOPs (the stopping row's ``flops``), its probe passes (one
forward and backward over the probe per check, as periodic_matched counts them), and what the
forks cost beside it: each arm's training (3 × forward FLOPs of the arm's architecture per image,
for every image the run trained on while the fork was open), the cooled copies' (a copy of the run
and one of the arm, trained over the horizon's last ``cool_steps``) and the scoring (a forward pass
of both sides over the probe at each scoring point: five in the forks of 2026-12-04 (commit 46e4318), one
since they are cooled). Each scratch arm (the found architecture,
d*) is trained with ``growtrain stopping`` and ``max_growths=0`` under the same schedule (the
constant rate, then the same final anneal), given ``max_epochs = round(F / F_epoch)``.

    python experiments/fork_matched.py runs/fork_full/split0 --seeds 0 --arms found \\
        --data.init_args.dataset=fashion-mnist --data.init_args.root=/usr/share/datasets/fashion-mnist
    python experiments/fork_matched.py runs/fork_full/split0 --budget-only   # the FLOP ledger, trains nothing
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "experiments"))

from periodic_matched import growth_flops, per_sample_flops, stage_sizes, train_scratch  # noqa: E402


def _grown(sizes: list[int], site: str | list[str]) -> list[int]:
    """Stage sizes after one block at ``site`` (or at each of several sites: a stage fork's)."""
    out = list(sizes)
    for name in [site] if isinstance(site, str) else site:
        out[int(name.split(".")[0].removeprefix("layer")) - 1] += 1
    return out


def full_history(row: dict) -> list[dict]:
    """The run's own growth_history.json (beside its checkpoint: every check's step and fork
    entry); the stopping row keeps a shorter history."""
    path = Path(row["checkpoint"]).parent / "growth_history.json"
    if not path.exists():
        raise FileNotFoundError(f"{path}: the fork's ledger needs each check's step; run on the machine that trained it")
    return json.loads(path.read_text())


def fork_flops(row: dict, *, train_images: int, steps_per_epoch: int, probe_size: int,
               start=(1, 1, 1)) -> dict:  # fmt: skip
    """The forks' FLOPs: ``arms`` (training) and ``scoring``; each fork is open from the check that
    opened it to the next check (its steps are the run's steps in between)."""
    sizes, arms, scoring, open_at = list(start), 0.0, 0.0, None
    for h in full_history(row):
        fork = h.get("fork") or {}
        if open_at is not None:  # the fork opened at open_at[0] ran until this check
            step0, site, arm_sizes = open_at
            images = (int(h["step"]) - step0) / steps_per_epoch * train_images
            arms += 3.0 * per_sample_flops(arm_sizes) * images
            # the cooled copies (a copy of the run and one of the arm) trained over the horizon's last steps
            cooled = fork.get("cool_steps", 0) / steps_per_epoch * train_images
            arms += 3.0 * (per_sample_flops(sizes) + per_sample_flops(arm_sizes)) * cooled
            points = fork.get("points", 1 if "gain_frac" in fork else 0)  # earlier forks scored 5 points, cooled ones 1
            scoring += points * probe_size * (per_sample_flops(sizes) + per_sample_flops(arm_sizes))
            open_at = None
        if h["action"] == "grow" and h.get("site"):
            sizes = _grown(sizes, h.get("sites") or h["site"])
        site = fork.get("next_site")
        if site:
            open_at = (int(h["step"]), site, _grown(sizes, site))
    return {"arms": arms, "scoring": scoring}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", help="a fork growth run's output folder (with runs.jsonl)")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--dstar", type=int, nargs=3, default=[3, 2, 2], help="d*'s stage sizes (full data: 7 blocks)")
    parser.add_argument("--train-images", type=int, default=57000)
    parser.add_argument("--steps-per-epoch", type=int, default=445)
    parser.add_argument("--probe-size", type=int, default=2000)
    parser.add_argument("--arms", nargs="+", default=["found", "dstar"])
    parser.add_argument("--config", default="configs/fmnist/periodic.yaml")
    parser.add_argument("--budget-only", action="store_true", help="print each row's FLOP ledger and train nothing")
    args, overrides = parser.parse_known_args()
    folder = Path(args.folder)
    rows = {json.loads(line)["seed"]: json.loads(line) for line in open(folder / "runs.jsonl")}
    out = folder / "matched"
    for seed in args.seeds:
        row = rows[seed]
        if not Path(row["checkpoint"]).exists():  # a row made on another machine (experiments/gpu_rows.sh)
            row = {**row, "checkpoint": str(next(folder.glob(f"growth_*_seed{seed}")) / "final.ckpt")}
        forks = fork_flops(row, train_images=args.train_images, steps_per_epoch=args.steps_per_epoch,
                           probe_size=args.probe_size)  # fmt: skip
        budget = growth_flops(row, args.probe_size) + forks["arms"] + forks["scoring"]
        ledger = {"seed": seed, "blocks": stage_sizes(row), "train_flops": row["flops"], **forks, "budget_flops": budget}
        print(json.dumps(ledger), flush=True)
        if args.budget_only:
            continue
        out.mkdir(exist_ok=True)
        for arm in args.arms:
            sizes = stage_sizes(row) if arm == "found" else list(args.dstar)
            per_epoch = 3.0 * per_sample_flops(sizes) * args.train_images
            epochs = max(6, round(budget / per_epoch))
            name = f"{arm}_{'-'.join(map(str, sizes))}_seed{seed}"
            plan = {**ledger, "arm": arm, "arm_blocks": sizes, "folder": name, "epoch_flops": per_epoch,
                    "max_epochs": epochs, "growth_test_loss": row["test_loss"]}  # fmt: skip
            with open(out / "plan.jsonl", "a") as f:
                f.write(json.dumps(plan) + "\n")
            train_scratch(out, name, seed=seed, epochs=epochs, sizes=sizes, config=args.config, overrides=overrides)


if __name__ == "__main__":
    main()
