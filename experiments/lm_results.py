"""The language-model budget study's rows (experiments/lm_budget.py) as docs/results.md's table and figure.

    python experiments/lm_results.py runs/lm --copy docs/results/lm_budget --figure docs/results/lm_budget.png

Reads every ``ARM/row.json`` under the folder, copies them (the raw rows) into ``--copy``, prints the
markdown table (final validation and test loss on the whole splits, steps, depth, FLOPs; growth −
scratch at the same final depth and schedule), the FLOPs at which each growth arm's validation curve
first reaches its scratch arm's last curve point (the 30 %-fewer-FLOPs target), the sweep's best
depth and where the decision stopped, and draws validation loss against FLOPs for every arm.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

# each growth arm's scratch reference: the same final depth under the same schedule
REFERENCE = {"grow-zero": "scratch-6", "grow-mask": "scratch-6", "grow-copy": "scratch-6", "grow-late": "scratch-6-wsd",
             "grow-late-copy": "scratch-6-wsd", "grow-copy-wsd": "scratch-6-wsd", "grow-zero-wsd": "scratch-6-wsd"}


def load(folder: Path) -> dict[str, dict]:
    return {p.parent.name: json.loads(p.read_text()) for p in sorted(folder.glob("*/row.json"))}


def reach(row: dict, target: float) -> float | None:
    """FLOPs at the first validation point at or below ``target`` (the 20-batch curve), else None."""
    return next((c["flops"] for c in row["curve"] if c["val_loss"] <= target), None)


def table(rows: dict[str, dict]) -> str:
    out = ["| arm | start → final depth | steps | TFLOP | val loss | test loss | growth − scratch (test) | "
           "reaches scratch's final val at |", "|---|---|---|---|---|---|---|---|"]
    for arm, r in rows.items():
        ref = rows.get(REFERENCE.get(arm, ""))
        diff = f"{r['test_loss'] - ref['test_loss']:+.4f} (vs {REFERENCE[arm]})" if ref else ""
        at = ""
        if ref:
            hit = reach(r, ref["curve"][-1]["val_loss"])  # like with like: the 20-batch curves' points
            at = "never" if hit is None else f"{100 * hit / ref['flops']:.0f} % of its FLOPs"
        start = r["spec"]["start"]
        out.append(f"| {arm} | {start} → {r['depth']} | {r['steps']} | {r['flops'] / 1e12:.1f} | {r['val_loss']:.4f} | "
                   f"{r['test_loss']:.4f} | {diff} | {at} |")
    return "\n".join(out)


def summary(rows: dict[str, dict]) -> dict:
    sweep = {r["depth"]: r["val_loss"] for a, r in rows.items() if a.startswith("scratch-") and not a.endswith("wsd")}
    best = min(sweep, key=sweep.get) if sweep else None
    decide = rows.get("decide")
    out = {"sweep_val": dict(sorted(sweep.items())), "sweep_best_depth": best}
    if decide:
        out.update(decided_depth=decide["depth"], checks=len(decide.get("growth") or []),
                   check_share=(decide["check_seconds"] / decide["fit_seconds"]) if decide.get("fit_seconds") else None,
                   actions=[(h.get("step"), h.get("action"), h.get("depth")) for h in decide.get("growth") or []])
    return out


def figure(rows: dict[str, dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8.5, 5.0))
    for i, (arm, r) in enumerate(rows.items()):
        xs = [c["flops"] / 1e12 for c in r["curve"]]
        ys = [c["val_loss"] for c in r["curve"]]
        style = "-" if arm.startswith("scratch") else "--"
        ax.plot(xs, ys, style, color=f"C{i % 10}", lw=1.2, label=f"{arm} ({r['depth']} blocks): {r['val_loss']:.3f}")
    ax.set_xlabel("training TFLOP (3 × forward × sequences)")
    ax.set_ylabel("validation loss (nats per byte, 20 batches; legend: whole split)")
    ax.set_ylim(top=min(2.2, ax.get_ylim()[1]))
    ax.set_title("Byte-level GPT on the Python standard library, one FLOP budget: growth against scratch", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("folder", type=Path)
    ap.add_argument("--copy", type=Path, help="copy the rows (row.json per arm) here")
    ap.add_argument("--figure", type=Path)
    args = ap.parse_args()
    rows = load(args.folder)
    if args.copy:
        args.copy.mkdir(parents=True, exist_ok=True)
        for arm in rows:
            shutil.copy(args.folder / arm / "row.json", args.copy / f"{arm}.json")
    print(table(rows))
    print(json.dumps(summary(rows), indent=1))
    if args.figure:
        figure(rows, args.figure)


if __name__ == "__main__":
    main()
