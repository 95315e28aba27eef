"""Tables and figure of the full Fashion-MNIST stopping experiment (docs/results.md).

    python experiments/full_results.py docs/results/stopping_full/runs.jsonl \
        --figure docs/results/stopping_full.png > docs/results/stopping_full/tables.md

Reads the rows ``growtrain stopping`` wrote (scratch sweep and growth runs; every row has its
test loss on the official 10k test set, FLOPs and the growth history) and prints Markdown:
the sweep by depth and seed, each growth run's checks (the trial's best gain and lower bound per
check), and the targets of the depth issue, met or missed.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def load(path):
    rows = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            rows[r["key"]] = r  # a later row of the same key wins
    return list(rows.values())


def fmt_mean(values):
    if not values:
        return "—"
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def path_of(row):
    """``3 → grow at layer3.1 (2.41 % ≥ 1.79 %); 4 → ...`` from a growth row's history."""
    steps = []
    for h in row["history"]:
        trial = (h.get("verdicts") or {}).get("trial")
        if trial and trial.get("trials"):
            best = max((t for t in trial["trials"] if not t.get("diverged")), key=lambda t: t["lower_frac"], default=None)
            fig = "" if best is None else (f" ({best['site']}: {100 * best['gain_frac']:.2f} % ≥ "
                                           f"{100 * best['lower_frac']:.2f} %)")  # fmt: skip
        else:
            fig = ""
        what = f"grow at {h['site']}" if h["action"] == "grow" else h["action"]
        steps.append(f"{h['depth_before']} → {what}{fig}")
    return "; ".join(steps)


def trial_flops(row, width=8, in_channels=1, classes=10, image=28, batch=128):
    """FLOPs of a growth row's trials, from its history (the fit's meter counts training steps
    only): per trial, ``steps × batch`` training samples at 3 × the forward FLOPs of the network
    with the trial block (an upper bound: the frozen layers form no weight gradients) plus every
    scored sample once before (without the block) and once after (with it): the probe (``n_probe``)
    and, in records before 2026-12-04, the held-back training samples the trial pooled with it
    (``n_holdout``)."""
    import torch

    from growtrain.callbacks.compute import forward_flops
    from growtrain.models import cifar_resnet

    net = cifar_resnet((1, 1, 1), width, "basic", in_channels, classes)
    x = torch.zeros(1, in_channels, image, image)
    total = 0.0
    for h in row["history"]:
        trial = (h.get("verdicts") or {}).get("trial") or {}
        base = forward_flops(net, x)
        for t in trial.get("trials", []):
            probe = net.grow(t["site"], net.new_block(t["site"], seed=0))
            with_block = forward_flops(net, x)
            net.undo_growth([probe], len(net.growth_log) - 1)
            scored = t.get("n_probe", 0) + t.get("n_holdout", 0)  # n_holdout: the historical rows only
            total += 3.0 * with_block * t.get("steps", 0) * batch + (base + with_block) * scored
        if h["action"] == "grow" and h.get("site"):
            net.grow(h["site"], net.new_block(h["site"], seed=0))
    return total


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("--figure", default=None)
    ap.add_argument("--growth_key", default=None, help="only growth rows whose key contains this (a decision)")
    a = ap.parse_args()
    rows = load(a.rows)
    scratch = [r for r in rows if r["key"].startswith("scratch/")]
    growth = [r for r in rows if r["key"].startswith("growth/") and (a.growth_key is None or a.growth_key in r["key"])]
    by = defaultdict(dict)  # blocks -> seed -> row
    for r in scratch:
        by[r["blocks"]][r["seed"]] = r
    seeds = sorted({r["seed"] for r in scratch})
    print("### Scratch sweep (test loss, official 10k test set)\n")
    print("| blocks | " + " | ".join(f"seed {s}" for s in seeds) + " | mean ± sd | epochs | GFLOP (seed 0) |")
    print("|---|" + "---|" * (len(seeds) + 3))
    means = {}
    for b in sorted(by):
        cells = [f"{by[b][s]['test_loss']:.4f}" if s in by[b] else "—" for s in seeds]
        vals = [by[b][s]["test_loss"] for s in seeds if s in by[b]]
        means[b] = (statistics.mean(vals), statistics.stdev(vals) if len(vals) > 1 else 0.0, len(vals))
        epochs = "/".join(str(by[b][s]["epochs"]) for s in seeds if s in by[b])
        flops = f"{by[b][0]['flops'] / 1e9:.0f}" if 0 in by[b] else "—"
        print(f"| {b} | " + " | ".join(cells) + f" | {fmt_mean(vals)} | {epochs} | {flops} |")
    # d*: the stopping experiment's own definition (the smallest depth within one standard error
    # of the best mean; with one seed per depth, the best depth itself)
    from growtrain.experiments.stopping import smallest_good_depth

    # over the seeds with the most depths (a depth trained for one seed only would be compared
    # with other depths' means over other seeds)
    full = [s for s in seeds if sum(s in by[b] for b in by) == max(sum(t in by[b] for b in by) for t in seeds)]
    ref = {b: [by[b][s]["test_loss"] for s in full if s in by[b]] for b in by}
    d_star, best = smallest_good_depth({b: v for b, v in ref.items() if v}) if by else (None, None)
    print(f"\nd* = {d_star} blocks (seeds {full}: lowest mean at {best}; d* is the smallest depth within one "
          f"standard error of it)" if d_star else "")
    print("\n### Growth runs\n")
    print("| run | checks: blocks → action (best trial: gain ≥ lower bound) | handed over (blocks) | test loss | "
          "scratch at that depth, same seed | train loss | epochs | GFLOP, trials included (÷ seed 0's sweep) |")
    print("|---|---|---|---|---|---|---|---|")
    sweep0 = sum(by[b][0]["flops"] for b in by if 0 in by[b])
    for r in sorted(growth, key=lambda r: r["key"]):
        same = by.get(r["blocks"], {}).get(r["seed"])
        total = r["flops"] + trial_flops(r)
        ratio = (f"{total / 1e9:.0f} ({total / sweep0:.2f}×; trials {100 * (total - r['flops']) / total:.0f} %)"
                 if sweep0 else f"{total / 1e9:.0f}")  # fmt: skip
        print(f"| {r['key']} | {path_of(r)} | {r['blocks']} | {r['test_loss']:.4f} | "
              f"{same['test_loss']:.4f} | " if same else f"| {r['key']} | {path_of(r)} | {r['blocks']} | "
              f"{r['test_loss']:.4f} | — | ", end="")
        print(f"{r['train_loss']:.4f} | {r['epochs']} | {ratio} |")
    if a.figure and means:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(7, 4.2))
        xs = sorted(means)
        ax.errorbar(xs, [means[b][0] for b in xs], yerr=[means[b][1] for b in xs], color="k", marker="o",
                    capsize=3, label="scratch, mean ± sd over seeds")  # fmt: skip
        for i, r in enumerate(sorted(growth, key=lambda r: r["key"])):
            visited = [h["depth_before"] for h in r["history"]]
            y = r["test_loss"]
            ax.plot(visited, [y] * len(visited), marker="|", ms=10, alpha=0.7, color=f"C{i}")
            ax.plot([r["blocks"]], [y], marker="*", ms=14, color=f"C{i}",
                    label=f"growth seed {r['seed']}: checked {visited[0]}…{visited[-1]}, handed over {r['blocks']}")
        if d_star:
            ax.axvline(d_star, color="grey", ls=":", label=f"d* = {d_star}")
        ax.set_xlabel("residual blocks")
        ax.set_ylabel("test loss (official 10k)")
        ax.xaxis.get_major_locator().set_params(integer=True)
        ax.legend(fontsize=7)
        ax.set_title("Full Fashion-MNIST: growth (trial decision) vs a scratch depth sweep", fontsize=9)
        fig.tight_layout()
        fig.savefig(a.figure, dpi=120)


if __name__ == "__main__":
    main()
