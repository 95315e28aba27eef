"""The decision study's table: ``bench/trial_study.py``'s rows, by statistic and depth.

    PYTHONPATH=. python bench/trial_table.py docs/results/trial_study/rows.jsonl --d_star 6 \
        > docs/results/trial_study/table.md

Per statistic (kind, optimizer, rate, budget) and evaluation set: the mean gain (% of the loss)
over sites and trial seeds at each depth, the mean standard error of one trial, and the
separation of the depths before ``d*`` from those at and after it: the gap between the smallest
before and the largest after (positive: the statistic orders every depth correctly), and the
z-score of that gap in units of one trial's standard error. With ``--best``: the best site's
gain per check (what a decision over several sites sees) instead of the mean over sites.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("rows")
    ap.add_argument("--d_star", type=int, default=6)
    a = ap.parse_args()
    rows = [json.loads(line) for line in open(a.rows) if line.strip()]
    groups = defaultdict(list)
    for r in rows:
        if r["kind"] == "first_order":
            continue
        groups[(r["kind"], r["opt"], r["lr"], r["epochs"])].append(r)
    sets = ("probe", "val", "holdout", "test")
    for (kind, opt, lr, epochs), rs in sorted(groups.items()):
        depths = sorted({r["blocks"] for r in rs})
        print(f"\n### {kind}, {opt} lr {lr}, {epochs} epoch(s): {len(rs)} trials "
              f"(sites {sorted({r['site'] for r in rs})}, seeds {sorted({r['seed'] for r in rs})})\n")
        print("| set | " + " | ".join(f"{d} blocks" for d in depths) + " | se of one trial | gap | z | best-site gap |")
        print("|---|" + "---|" * (len(depths) + 4))
        for s in sets:
            if not any(s in r for r in rs):
                continue
            mean = {d: statistics.mean(r[s]["gain_pct"] for r in rs if r["blocks"] == d and s in r) for d in depths}
            best = {}
            for d in depths:  # best site per trial seed, then the mean over seeds
                by_seed = defaultdict(list)
                for r in rs:
                    if r["blocks"] == d and s in r:
                        by_seed[r["seed"]].append(r[s]["gain_pct"])
                best[d] = statistics.mean(max(v) for v in by_seed.values())
            se = statistics.mean(r[s]["se_pct"] for r in rs if s in r)
            before = [mean[d] for d in depths if d < a.d_star]
            after = [mean[d] for d in depths if d >= a.d_star]
            gap = min(before) - max(after) if before and after else float("nan")
            bgap = (min(best[d] for d in depths if d < a.d_star) - max(best[d] for d in depths if d >= a.d_star)
                    if before and after else float("nan"))  # fmt: skip
            cells = " | ".join(f"{mean[d]:+.2f}" for d in depths)
            print(f"| {s} | {cells} | {se:.2f} | {gap:+.2f} | {gap / se:+.1f} | {bgap:+.2f} |")
        walls = [r["wall_s"] for r in rs]
        print(f"\ncost: {statistics.median(walls):.0f} s per trial (median, one core), "
              f"{statistics.median(r.get('steps', 0) for r in rs)} optimizer steps")
    fo = [r for r in rows if r["kind"] == "first_order"]
    if fo:
        print("\n### first-order (cross-fit lower bounds, Γ̂ vs δ+t), probe\n")
        print("| blocks | Γ̂ | δ+t | best lower bound | site |")
        print("|---|---|---|---|---|")
        for r in sorted(fo, key=lambda r: r["blocks"]):
            site, low = max(r["lowers"].items(), key=lambda kv: kv[1])
            thr = r.get("threshold")
            print(f"| {r['blocks']} | {r['gamma']:.4f} | {'—' if thr is None else f'{thr:.4f}'} | {low:+.4f} | {site} |")


if __name__ == "__main__":
    main()
