"""Tables and figure of the periodic protocol's study (docs/results.md, "Grow while training").

    python experiments/periodic_results.py --sweep docs/results/stopping_full/runs.jsonl \
        --growth docs/results/periodic_full/growth.jsonl --matched docs/results/periodic_full/matched.jsonl \
        --converged docs/results/stopping_full/runs.jsonl --converged_key 2fddbd4854ba1517 \
        --figure docs/results/periodic_full.png

Reads the rows ``growtrain stopping`` wrote: the scratch sweep (``scratch/added=A/seed=S``), the
periodic growth runs (one row per run, with its history), the compute-matched scratch arms (each
row tagged with its ``arm``, ``blocks`` and ``budget_flops`` by experiments/periodic_matched.py's
plan) and, for comparison, the converged protocol's growth rows. Prints Markdown tables and draws
test loss against training FLOPs: the scratch sweep's points by depth, the frontier (the best
scratch test loss at ≤ F FLOPs, matched arms included), and each growth run's end (its path as
the depth reached against FLOPs, in a second panel).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def load(path):
    rows = {}
    for line in open(path):
        if line.strip():
            r = json.loads(line)
            rows[(r["key"], r.get("arm"), r.get("tag"))] = r  # a later row of the same key wins
    return list(rows.values())


def mean_sd(values):
    if len(values) == 1:
        return f"{values[0]:.4f}"
    return f"{statistics.mean(values):.4f} ± {statistics.stdev(values):.4f}"


def sizes_of(row, start=(1, 1, 1)):
    sizes = list(start)
    for h in row["history"]:
        if h["action"] == "grow" and h.get("site"):
            sizes[int(h["site"].split(".")[0].removeprefix("layer")) - 1] += 1
    return sizes


def path_of(row):
    """``3 → grow at layer1.0 (window: not full); ...; 7 → stop (window +5.20 % ≥ −0.30 %)``."""
    steps = []
    for h in row["history"]:
        w = (h.get("verdicts") or {}).get("window") or h.get("window") or {}
        fig = "" if not w else (" (window not full)" if w.get("gain_frac") is None else
                                f" (window {100 * w['gain_frac']:+.2f} % ≥ {100 * w['lower_frac']:+.2f} %)")
        what = f"grow at {h['site']}" if h["action"] == "grow" else ("stop" if h["action"] == "saturated" else h["action"])
        steps.append(f"e{h['epoch']} {h['depth_before']} → {what}{fig}")
    return "; ".join(steps)


def path_points(row: dict, train_images: int) -> tuple[list[float], list[int]]:
    """Cumulative training GFLOP at the start of each epoch and the blocks trained in it."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from periodic_matched import per_sample_flops

    grows = {h["epoch"]: h["site"] for h in row["history"] if h["action"] == "grow"}
    sizes, total, xs, ys = [1, 1, 1], 0.0, [], []
    cache: dict = {}
    for epoch in range(row["epochs"]):
        key = tuple(sizes)
        cache.setdefault(key, 3.0 * per_sample_flops(sizes) * train_images / 1e9)
        xs.append(total)
        ys.append(sum(sizes))
        total += cache[key]
        if epoch in grows:
            sizes[int(grows[epoch].split(".")[0].removeprefix("layer")) - 1] += 1
    xs.append(total)
    ys.append(sum(sizes))
    return xs, ys


def matched_rows(folder: Path) -> list[dict]:
    """Each planned arm's row, with its plan (arm, blocks, budget) beside the training's figures."""
    out = []
    for line in open(folder / "plan.jsonl"):
        plan = json.loads(line)
        name = plan.get("folder") or f"{plan['arm']}_{'-'.join(map(str, plan['blocks']))}"  # older plans: no seed
        runs = folder / name / "runs.jsonl"
        if not runs.is_file():
            continue
        rows = [r for r in load(runs) if r["seed"] == plan["seed"]]
        if rows:
            out.append({**rows[-1], "arm": plan["arm"], "arm_blocks": plan["blocks"],
                        "budget_flops": plan["budget_flops"], "planned_epochs": plan["max_epochs"]})
    return list({(r["seed"], r["arm"]): r for r in out}.values())


def with_checks(row: dict, probe_size: int) -> float:
    """Training FLOPs plus the checks' (experiments/periodic_matched.py's count: the budget the
    matched arms were given)."""
    sys.path.insert(0, str(ROOT / "experiments"))
    from periodic_matched import growth_flops

    return growth_flops(row, probe_size)


# two-sided 95 % Student t quantiles by degrees of freedom (n - 1 paired seeds)
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571}


def paired_interval(arm: str, deltas: list[float]) -> str:
    """Growth − scratch, paired by seed: the mean with its 95 % t interval (none from one seed)."""
    mean = statistics.mean(deltas)
    if len(deltas) < 2:
        return f"growth − scratch ({arm}), 1 seed: {mean:+.4f} (no interval from one seed)"
    half = _T95[len(deltas) - 1] * statistics.stdev(deltas) / len(deltas) ** 0.5
    return (f"growth − scratch ({arm}), paired over {len(deltas)} seeds: mean {mean:+.4f}, 95 % interval "
            f"[{mean - half:+.4f}, {mean + half:+.4f}]")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--probe_size", type=int, default=2000)
    p.add_argument("--train_images", type=int, default=57000)
    p.add_argument("--sweep", required=True)
    p.add_argument("--growth", required=True, nargs="+", help="periodic growth rows (tag: file stem)")
    p.add_argument("--matched", nargs="*", default=[],
                   help="folders of experiments/periodic_matched.py (plan.jsonl), each FOLDER or FOLDER:TAG, TAG the "
                        "growth rows (file stem) its arms were planned from (default: growth)")
    p.add_argument("--converged")
    p.add_argument("--converged_key", default="2fddbd4854ba1517")
    p.add_argument("--figure")
    args = p.parse_args()

    sweep = [r for r in load(args.sweep) if r["key"].startswith("scratch/")]
    by_blocks = {}
    for r in sweep:
        by_blocks.setdefault(r["blocks"], []).append(r)
    growth = []
    for path in args.growth:
        for r in load(path):
            growth.append({**r, "tag": r.get("tag") or Path(path).stem})
    matched = []
    for spec in args.matched:
        folder, _, tag = spec.partition(":")
        matched += [{**r, "growth_tag": tag or "growth"} for r in matched_rows(Path(folder))]
    converged = [r for r in load(args.converged) if args.converged_key in r["key"]] if args.converged else []

    best_mean = min(statistics.mean([x["test_loss"] for x in rs]) for rs in by_blocks.values())
    dstar = min(by_blocks, key=lambda b: statistics.mean([x["test_loss"] for x in by_blocks[b]]))
    sd = statistics.stdev([x["test_loss"] for x in by_blocks[dstar]])
    sweep_total = {s: sum(r["flops"] for r in sweep if r["seed"] == s) for s in {r["seed"] for r in sweep}}
    print(f"d* = {dstar} blocks: scratch test loss {best_mean:.4f} ± {sd:.4f}; target ≤ {best_mean + sd:.4f}\n")

    print("| run | seed | checks (epoch: blocks → action) | handed over | test loss | epochs (growing + final) | "
          "GFLOP, checks included (÷ seed's sweep) | checks' share of wall time |")
    print("|---|---|---|---|---|---|---|---|")
    for r in sorted(growth, key=lambda r: (r["tag"], r["seed"])):
        grown = max((h["epoch"] for h in r["history"]), default=0) + 1
        share = r["probe_s"] / r["wall_s"] if r.get("wall_s") else float("nan")
        total = sweep_total.get(r["seed"]) or sweep_total[0]
        flops = with_checks(r, args.probe_size)
        print(f"| {r['tag']} | {r['seed']} | {path_of(r)} | {r['blocks']} {sizes_of(r)} | {r['test_loss']:.4f} | "
              f"{r['epochs']} ({grown} + {r['epochs'] - grown}) | {flops / 1e9:,.0f} ({flops / total:.2f}×) | "
              f"{100 * share:.1f} % |")
    if matched:
        print("\n| seed | growth (blocks, test loss, GFLOP incl. checks) | scratch arm | blocks | epochs | GFLOP | "
              "test loss | growth − scratch |")
        print("|---|---|---|---|---|---|---|---|")
        deltas: dict[tuple[str, str], list[float]] = {}
        for m in sorted(matched, key=lambda r: (r["growth_tag"], r["seed"], r["arm"])):
            # each arm was planned from the growth rows of its tag (file growth.jsonl: "growth")
            g = next((r for r in growth if r["seed"] == m["seed"] and r["tag"] == m["growth_tag"]), None)
            if g is None:
                continue
            deltas.setdefault((m["growth_tag"], m["arm"]), []).append(g["test_loss"] - m["test_loss"])
            print(f"| {m['seed']} | {m['growth_tag']}: {g['blocks']}, {g['test_loss']:.4f}, "
                  f"{m['budget_flops'] / 1e9:,.0f} | {m['arm']} | "
                  f"{m['arm_blocks']} | {m['epochs']} | {m['flops'] / 1e9:,.0f} | {m['test_loss']:.4f} | "
                  f"{g['test_loss'] - m['test_loss']:+.4f} |")
        for (tag, arm), ds in sorted(deltas.items()):
            print("\n" + paired_interval(f"{tag}, {arm}", ds))
    if converged:
        print("\nConverged protocol (same split, seeds): " + "; ".join(
            f"seed {r['seed']}: {r['blocks']} blocks, {r['test_loss']:.4f}, {r['flops'] / 1e9:,.0f} GFLOP"
            for r in sorted(converged, key=lambda r: r["seed"])))

    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, (ax, path_ax) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
        cmap = plt.get_cmap("viridis")
        blocks = sorted(by_blocks)
        points = [(r["flops"] / 1e9, r["test_loss"]) for r in sweep] + [(m["flops"] / 1e9, m["test_loss"]) for m in matched]
        for i, b in enumerate(blocks):
            xs = [r["flops"] / 1e9 for r in by_blocks[b]]
            ys = [r["test_loss"] for r in by_blocks[b]]
            ax.scatter(xs, ys, color=cmap(i / max(1, len(blocks) - 1)), s=18, label=f"scratch {b} blocks")
        for m in matched:
            ax.scatter([m["flops"] / 1e9], [m["test_loss"]], marker="s", facecolors="none", edgecolors="k", s=40)
        frontier, best = [], float("inf")
        for x, y in sorted(points):
            best = min(best, y)
            frontier.append((x, best))
        ax.step([x for x, _ in frontier], [y for _, y in frontier], where="post", color="0.4", lw=1,
                label="best scratch at ≤ F (sweep + matched arms □)")  # fmt: skip
        for r in growth:
            if "25pct" in r["tag"]:  # another training set: not on the full data's scratch frontier
                continue
            ax.scatter([r["flops"] / 1e9], [r["test_loss"]], marker="*", s=160, edgecolors="k",
                       label=f"{r['tag']} seed {r['seed']} ({r['blocks']} blocks)")  # fmt: skip
        for r in converged:
            ax.scatter([r["flops"] / 1e9], [r["test_loss"]], marker="^", s=60, color="tab:red", alpha=0.7,
                       label="converged protocol" if r is converged[0] else None)  # fmt: skip
        ax.axhline(best_mean + sd, color="tab:red", ls=":", lw=1, label=f"target ≤ {best_mean + sd:.4f}")
        for r in growth:  # the path: depth against the FLOPs spent so far, epoch by epoch
            if "25pct" in r["tag"]:  # another epoch size: its path is not drawn on the full data's axis
                continue
            xs, ys = path_points(r, args.train_images)
            path_ax.step(xs, ys, where="post", label=f"{r['tag']} s{r['seed']}")
            path_ax.scatter([xs[-1]], [ys[-1]], marker="*", s=120, edgecolors="k")
        for b in blocks:
            path_ax.scatter([r["flops"] / 1e9 for r in by_blocks[b]], [b] * len(by_blocks[b]), color="0.6", s=12)
        path_ax.axhline(dstar, color="tab:red", ls=":", lw=1, label=f"d* = {dstar}")
        path_ax.set_xlabel("training GFLOP so far")
        path_ax.set_ylabel("blocks")
        path_ax.set_title("each growth run's path (grey: scratch runs at their depth)")
        path_ax.legend(fontsize=7)
        ax.set_xscale("log")
        ax.set_xlabel("training GFLOP (log)")
        ax.set_ylabel("test loss (10k official test images)")
        ax.set_title("Full Fashion-MNIST: growth against scratch for the same compute")
        ax.legend(fontsize=6, ncol=2)
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)


if __name__ == "__main__":
    main()
