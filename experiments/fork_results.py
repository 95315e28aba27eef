"""The stage fork's rows (decision="stage_fork") as the markdown table of docs/results.md, and the raw
rows copied to docs/results/fork/. Trains nothing.

    python experiments/fork_results.py runs/fork_k2 runs/fork_k4 runs/fork_k8 [--sweep-gflop 186974]

Each argument is a run folder of experiments/fork_full.sh (``<folder>/split<S>/``): a finished row
comes from its ``runs.jsonl``; a run still going (or cut) from its ``growth_history.json`` alone.
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from fork_matched import fork_flops  # noqa: E402
from periodic_matched import growth_flops  # noqa: E402


def checks(history: list[dict]) -> str:
    """``e7 3 → grow at layer2.1 (+6.76 % [+4.88, +8.68])`` per judged check."""
    out = []
    for h in history:
        fork = h.get("fork") or {}
        if fork.get("gain_frac") is None:
            if h["action"] == "budget":
                out.append(f"e{h['epoch']} {h['depth_before']} → budget")
            continue
        what = {"grow": "grow", "saturated": "stop", "fork": "no"}.get(h["action"], h["action"])
        out.append(f"e{h['epoch']} {h['depth_before']} → {what} at {fork['site']} ({100 * fork['gain_frac']:+.2f} % "
                   f"[{100 * fork['lower_frac']:+.2f}, {100 * fork['upper_frac']:+.2f}])")  # fmt: skip
    return "; ".join(out)


def data_sizes(split_dir: Path) -> tuple[int, int]:
    """(training images, probe images) of the run's data (its saved config.yaml): the full
    Fashion-MNIST's 60,000 less the probe and validation, capped by ``train_subset``."""
    import yaml

    data = yaml.safe_load((split_dir / "config.yaml").read_text())["data"]["init_args"]
    train = 60000 - data["probe_size"] - data["val_size"]
    return min(train, data.get("train_subset") or train), data["probe_size"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--sweep-gflop", type=float, default=186974.0, help="seed 0's 3-10-block sweep")
    parser.add_argument("--copy-to", default=str(ROOT / "docs" / "results" / "fork"))
    args = parser.parse_args()
    print("| run | seed | split | checks (epoch: blocks → verdict at site (gain [95 % bounds], % of the loss)) | "
          "blocks | test loss | epochs | GFLOP: training + arms + scoring + probe passes (÷ sweep) |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    for folder in map(Path, args.folders):
        for split_dir in sorted(folder.glob("split*")):
            split = split_dir.name.removeprefix("split")
            rows = {}
            if (split_dir / "runs.jsonl").exists():
                rows = {json.loads(line)["seed"]: json.loads(line) for line in open(split_dir / "runs.jsonl")}
            for path in sorted(glob.glob(str(split_dir / "growth_*_seed*" / "growth_history.json"))):
                seed = int(path.split("_seed")[-1].split("/")[0])
                history = json.loads(Path(path).read_text())
                row = rows.get(seed)
                dest = Path(args.copy_to) / folder.name / f"split{split}"
                dest.mkdir(parents=True, exist_ok=True)
                shutil.copy(path, dest / f"growth_history_seed{seed}.json")
                if row is None:
                    print(f"| {folder.name} (cut: history only) | {seed} | {split} | {checks(history)} | – | – | – | – |")
                    continue
                shutil.copy(split_dir / "runs.jsonl", dest / "runs.jsonl")
                # rows made on another machine (experiments/gpu_rows.sh) name its paths: read them here
                row = {**row, "checkpoint": str(Path(path).parent / "final.ckpt")}
                train_images, probe_size = data_sizes(split_dir)
                forks = fork_flops(row, train_images=train_images, steps_per_epoch=row["steps"] // row["epochs"],
                                   probe_size=probe_size)
                probe = growth_flops(row, probe_size) - row["flops"]
                total = row["flops"] + forks["arms"] + forks["scoring"] + probe
                parts = " + ".join(f"{v / 1e9:,.0f}" for v in (row["flops"], forks["arms"], forks["scoring"], probe))
                print(f"| {folder.name} | {seed} | {split} | {checks(history)} | {row['blocks']} | {row['test_loss']:.4f} | "
                      f"{row['epochs']} | {parts} = {total / 1e9:,.0f} ({total / 1e9 / args.sweep_gflop:.2f}×) |")  # fmt: skip


if __name__ == "__main__":
    main()
