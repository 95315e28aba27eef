"""Collect the runs of experiments/fmnist_results.sh into the tables of docs/results.md.

    python experiments/summarize_results.py [--out runs/results] [--docs docs/results]

Reads what the `growtrain` commands wrote (sweep runs.jsonl, growth_history.json and the last
checkpoint of each growth run, compare.md) and prints Markdown; copies the figures into
``--docs``. The growth runs' test loss is measured here, on the official test split, from each
run's final checkpoint (the fit itself never looks at test data).
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import statistics
from pathlib import Path

import torch
from torch.nn import functional as F


def mean_std(values):
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def sweep_rows(out: Path):
    by_depth: dict[int, list[dict]] = {}
    for path in sorted(out.glob("sweep_seed*/runs.jsonl")):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            by_depth.setdefault(row["blocks"], []).append(row)
    return by_depth


def print_sweep(by_depth):
    print("| blocks | seeds | train loss | test loss | AG_max | Γ̂ | δ+t (paper) |")
    print("|---|---|---|---|---|---|---|")
    for blocks in sorted(by_depth):
        rows = by_depth[blocks]
        print(
            f"| {blocks} | {len(rows)} | {mean_std([r['train_loss'] for r in rows])} | "
            f"{mean_std([r['test_loss'] for r in rows])} | {mean_std([r['ag_max'] for r in rows])} | "
            f"{mean_std([r['gamma'] for r in rows])} | {mean_std([r['threshold'] for r in rows])} |"
        )


@torch.no_grad()
def test_loss(ckpt: str) -> tuple[float, float]:
    from growtrain.data import ImageDataModule
    from growtrain.module import ImageClassifier

    model = ImageClassifier.load_from_checkpoint(ckpt, map_location="cpu").eval()
    data = ImageDataModule(dataset="fashion-mnist", probe_size=2000, val_size=0, eval_batch_size=1000)
    data.setup("test")
    total = correct = n = 0
    for x, y in data.test_dataloader():
        logits = model(x)
        total += float(F.cross_entropy(logits, y, reduction="sum"))
        correct += int((logits.argmax(1) == y).sum())
        n += len(y)
    return total / n, correct / n


def print_growth(out: Path, by_depth):
    print("| rule | seed | checks | growths (sites) | final blocks | test loss (grown) | scratch test loss at that depth |")
    print("|---|---|---|---|---|---|---|")
    for rule_dir in sorted(out.glob("growth_*")):
        rule = rule_dir.name.split("_", 1)[1]
        for seed_dir in sorted(rule_dir.glob("seed*")):
            hist_path = sorted(seed_dir.glob("lightning_logs/version_*/growth_history.json"))
            ckpts = sorted(glob.glob(str(seed_dir / "lightning_logs/version_*/checkpoints/*.ckpt")))
            if not hist_path or not ckpts:
                continue
            history = json.loads(hist_path[-1].read_text())
            sites = [h["site"] for h in history if h.get("action") == "grow"]
            blocks = history[-1]["depth"]
            loss, acc = test_loss(ckpts[-1])
            scratch = mean_std([r["test_loss"] for r in by_depth.get(blocks, [])])
            print(
                f"| {rule} | {seed_dir.name[4:]} | {len(history)} | {len(sites)} ({', '.join(sites) or '—'}) | "
                f"{blocks} | {loss:.4f} (acc {acc:.3f}) | {scratch} |"
            )


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="runs/results")
    p.add_argument("--docs", default="docs/results")
    args = p.parse_args()
    out, docs = Path(args.out), Path(args.docs)
    docs.mkdir(parents=True, exist_ok=True)
    by_depth = sweep_rows(out)
    print("## Sweep (Figure 1)\n")
    print_sweep(by_depth)
    print("\n## Growth from ResNet-8, per rule\n")
    print_growth(out, by_depth)
    gpt = out / "gpt_sweep" / "runs.jsonl"
    if gpt.exists():
        print("\n## Decoder sweep (stdlib corpus, bytes)\n")
        print("| decoder blocks | train loss | test loss | AG_max | Γ̂ | δ+t (paper) |")
        print("|---|---|---|---|---|---|")
        for line in gpt.read_text().splitlines():
            r = json.loads(line)
            print(f"| {r['blocks']} | {r['train_loss']:.4f} | {r['test_loss']:.4f} | {r['ag_max']:.4f} | {r['gamma']:.4f} | {r['threshold']:.4f} |")
    table = out / "table1" / "compare.md"
    if table.exists():
        print("\n## Table 1 protocol\n")
        print(table.read_text())
    for src, name in [
        (out / "sweep_seed0" / "sweep.png", "sweep_seed0.png"),
        (out / "gpt_sweep" / "sweep.png", "gpt_sweep.png"),
        (next(iter(sorted(out.glob("growth_crossfit/seed0/lightning_logs/version_*/gamma_trace.png"))), None), "gamma_trace_crossfit_seed0.png"),
        (next(iter(sorted(out.glob("growth_paper/seed0/lightning_logs/version_*/gamma_trace.png"))), None), "gamma_trace_paper_seed0.png"),
    ]:
        if src is not None and Path(src).exists():
            shutil.copy(src, docs / name)


if __name__ == "__main__":
    main()
