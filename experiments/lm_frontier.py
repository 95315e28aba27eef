"""The depth frontiers on a FLOP budget: scratch at each depth, growth to each depth, the decision.

Reads the rows experiments/lm_budget.py (ROOT/b<TFLOP>/s<SEED>/<ARM>/row.json) or
experiments/fmnist_budget.py (ROOT/b<GFLOP>/s<SEED>/<ARM>/row.json) wrote, or copies of them in
docs/results/lm_frontier/ and docs/results/fmnist_frontier/, and prints one markdown table per budget (test loss against
depth: the scratch frontier, the growth frontier, GrowForBudget's networks), the seeds' mean and
spread where there are several, and draws both frontiers on one figure per budget.

    python experiments/lm_frontier.py runs/lm57 --copy docs/results/lm_frontier --figure docs/results/lm_frontier.png
    python experiments/lm_frontier.py docs/results/lm_frontier            # the tables from the copies
    python experiments/lm_frontier.py runs/fb57 --copy docs/results/fmnist_frontier --figure docs/results/fmnist_frontier.png
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import statistics
from collections import defaultdict
from pathlib import Path


def load(root: Path) -> dict:
    """{budget: {arm: {seed: row}}} from ROOT/b<TFLOP>/s<SEED>/<ARM>/row.json or ROOT/b<TFLOP>/s<SEED>/<ARM>.json."""
    rows: dict = defaultdict(lambda: defaultdict(dict))
    for path in sorted(root.glob("b*/s*/*")):
        file = path / "row.json" if path.is_dir() else path
        if not file.is_file() or file.suffix != ".json":
            continue
        row = json.loads(file.read_text())
        budget, seed = path.parent.parent.name[1:], int(path.parent.name[1:])
        rows[budget][row["arm"]][seed] = row
    return rows


def kind(arm: str) -> tuple[str, int | None]:
    if m := re.fullmatch(r"scratch-(\d+)-wsd", arm):
        return "scratch", int(m.group(1))
    if m := re.fullmatch(r"growto-(\d+)", arm):
        return "growth", int(m.group(1))
    if arm.startswith("budget"):
        return "decision", None
    return "other", None


def tflop(budget: str) -> str:
    """A budget directory's name in TFLOP (the image rows' directories are named in GFLOP)."""
    return f"{float(budget) / 1000:.4g}" if float(budget) >= 1000 else budget


def spent(row: dict) -> float:
    return row["flops"] if "flops" in row else row["gflop"] * 1e9


def mean_sd(values: list[float]) -> tuple[float, float | None]:
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else None)


def table(budget: str, arms: dict) -> str:
    acc = any(r.get("test_acc") is not None for seeds in arms.values() for r in seeds.values())
    lines = [f"Budget {tflop(budget)} TFLOP (test loss; mean ± sd over the seeds listed)", "",
             f"| arm | kind | depth | seeds | test loss |{' test accuracy |' if acc else ''} steps | TFLOP spent | "
             "decisions' share |", "|---|---|---|---|---|" + ("---|" if acc else "") + "---|---|---|"]  # fmt: skip
    order = sorted(arms, key=lambda a: ({"scratch": 0, "growth": 1, "decision": 2}.get(kind(a)[0], 3), kind(a)[1] or 0, a))
    for arm in order:
        seeds = arms[arm]
        tests = [seeds[s]["test_loss"] for s in sorted(seeds)]
        m, sd = mean_sd(tests)
        depths = sorted({seeds[s]["depth"] for s in seeds})
        row0 = seeds[min(seeds)]
        b = row0.get("budget") or {}
        share = f"{100 * b['decision_flops'] / b['plan']['total_flops']:.1f} %" if b else ""
        a = ""
        if acc:
            am, asd = mean_sd([100 * seeds[s]["test_acc"] for s in sorted(seeds)])
            a = f" {am:.2f} %{'' if asd is None else f' ± {asd:.2f}'} |"
        lines.append(f"| {arm} | {kind(arm)[0]} | {'/'.join(map(str, depths))} | {','.join(map(str, sorted(seeds)))} "
                     f"| {m:.4f}{'' if sd is None else f' ± {sd:.4f}'} |{a} {row0['steps']} | {spent(row0) / 1e12:.2f} "
                     f"| {share} |")  # fmt: skip
    return "\n".join(lines)


def figure(rows: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    budgets = sorted(rows, key=float)
    fig, axes = plt.subplots(1, len(budgets), figsize=(5.5 * len(budgets), 4), squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for name, style in (("scratch", "o-"), ("growth", "s--")):
            pts = sorted((kind(a)[1], statistics.fmean(r["test_loss"] for r in arms.values()))
                         for a, arms in rows[budget].items() if kind(a)[0] == name)  # fmt: skip
            if pts:
                ax.plot(*zip(*pts), style, label=f"{name} frontier (seed mean)")
        for arm, arms in rows[budget].items():
            if kind(arm)[0] == "decision":
                for seed, r in arms.items():
                    ax.plot(r["depth"], r["test_loss"], "k*", ms=10)
                    ax.annotate(f"{arm} s{seed}", (r["depth"], r["test_loss"]), fontsize=7, xytext=(4, 4),
                                textcoords="offset points")  # fmt: skip
        ax.set(title=f"{tflop(budget)} TFLOP", xlabel="final depth (blocks)", ylabel="test loss")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("root")
    ap.add_argument("--copy", help="copy each row.json to COPY/b<TFLOP>/s<SEED>/<ARM>.json")
    ap.add_argument("--figure")
    args = ap.parse_args()
    root = Path(args.root)
    rows = load(root)
    if args.copy:
        for path in root.glob("b*/s*/*/row.json"):
            dest = Path(args.copy) / path.parent.parent.parent.name / path.parent.parent.name / f"{path.parent.name}.json"
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, dest)
    for budget in sorted(rows, key=float, reverse=True):
        print(table(budget, rows[budget]), end="\n\n")
    if args.figure:
        figure(rows, Path(args.figure))


if __name__ == "__main__":
    main()
