"""The table of experiments/fmnist_budget.py rows (OUT/ARM/row.json), raw rows copied to
docs/results/fmnist_budget/ARM_seedS.json.

    python experiments/fmnist_budget_results.py runs/fb
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

DEST = Path(__file__).resolve().parents[1] / "docs" / "results" / "fmnist_budget"


def main(folder: str) -> None:
    DEST.mkdir(parents=True, exist_ok=True)
    print("| arm | seed | blocks | optimizer steps (epochs) | GFLOP | test loss | test accuracy | growths (step: sites) |")
    print("|---|---|---|---|---|---|---|---|")
    for row_file in sorted(Path(folder).glob("*/row.json")):
        row = json.loads(row_file.read_text())
        shutil.copy(row_file, DEST / f"{row['arm']}_seed{row['seed']}.json")
        growth = "; ".join(f"{g['step']}: {', '.join(g['sites'])}" + (f" (zero: {', '.join(g['zero'])})" if g.get("zero") else "")
                           for g in row["growth"] or []) or "–"  # fmt: skip
        acc = row.get("test_acc")
        print(f"| {row['arm']} | {row['seed']} | {'-'.join(map(str, row['blocks']))} ({row['depth']}) | "
              f"{row['steps']:,} ({row['epochs']:.1f}) | {row['gflop']:,.0f} | {row['test_loss']:.4f} | "
              f"{'–' if acc is None else f'{100 * acc:.2f} %'} | {growth} |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1])
