"""The budget decision's insertion rows: how the arm's new block starts, against the plain copy.

Reads the language model's 19.2-TFLOP rows (docs/results/lm_frontier/b19.2/sS/ARM.json, written by
experiments/lm_budget.py) of ``budget-steps-f30-c3-p30`` (the copy, G_stack: not function-preserving)
and its ``-copyzero`` / ``-copyramp`` variants (function-preserving), and prints one markdown table:
per seed and insertion, the depth handed over, the test loss, and each decision's fork gain at its end
(% of the run's probe loss; the copy's margin over each function-preserving kind is the difference).

    python experiments/lm_insertion_results.py            # the table docs/results.md shows
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "docs" / "results" / "lm_frontier" / "b19.2"
ARMS = {"copy": "budget-steps-f30-c3-p30", "copy_zero": "budget-steps-f30-c3-p30-copyzero",
        "copy_ramp": "budget-steps-f30-c3-p30-copyramp"}  # fmt: skip


def fork_gains(row: dict) -> list[float]:
    """Each decision's fork gain at its end, as a fraction of the run's probe loss (both record forms)."""
    out = []
    for h in row.get("growth") or []:
        b = h.get("budget")
        out.append(b["fork_gain_frac"] if b is not None else h["gain_frac"])
    return out


def rows(root: Path = ROOT) -> list[dict]:
    found = []
    for seed_dir in sorted(root.glob("s*")):
        for kind, arm in ARMS.items():
            path = seed_dir / f"{arm}.json"
            if path.exists():
                row = json.loads(path.read_text())
                found.append({"seed": int(seed_dir.name[1:]), "insertion": kind, "depth": row["depth"],
                              "test_loss": row["test_loss"], "gains": fork_gains(row)})  # fmt: skip
    return found


def table(found: list[dict]) -> str:
    lines = ["| seed | insertion | depth | test loss | fork gain per decision (%) |", "|---|---|---|---|---|"]
    for r in found:
        gains = " / ".join(f"{100 * g:+.2f}" for g in r["gains"])
        lines.append(f"| {r['seed']} | `{r['insertion']}` | {r['depth']} | {r['test_loss']:.4f} | {gains} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.stdout.write(table(rows()) + "\n")
