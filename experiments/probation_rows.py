"""The per-look table of decision="probation" runs (growth_history.json under each folder), and the raw
rows copied to docs/results/probation/<name>/ (growth_history_seed<S>.json per seed, and runs.jsonl).

    python experiments/probation_rows.py NAME=FOLDER ...
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "probation"


def pct(x: float | None) -> str:
    return "–" if x is None else f"{100 * x:+.2f}"


def main(pairs: list[str]) -> None:
    print("| run | seed | epoch | blocks (on probation) | look | gain % [lower, upper] | act |")
    print("|---|---|---|---|---|---|---|")
    for pair in pairs:
        name, _, folder = pair.partition("=")
        for hist in sorted(Path(folder).glob("**/growth_history.json")):
            seed = hist.parent.name.rpartition("seed")[2]
            dest = OUT / name
            dest.mkdir(parents=True, exist_ok=True)
            shutil.copy(hist, dest / f"growth_history_seed{seed}.json")  # growth_history.json is git-ignored
            runs = hist.parent.parent / "runs.jsonl"
            if runs.exists():
                shutil.copy(runs, dest / "runs.jsonl")
            for r in json.loads(hist.read_text()):
                p = r.get("probation") or {}
                if p.get("act") == "open":
                    print(f"| {name} | {seed} | {r['epoch']} | {r['depth_before']} → {p.get('next_site')} | – | – | open |")
                    continue
                print(f"| {name} | {seed} | {r['epoch']} | {r['depth_before']} ({p.get('site')}) | {p.get('looks')} | "
                      f"{pct(p.get('gain_frac'))} [{pct(p.get('lower_frac'))}, {pct(p.get('upper_frac'))}] | "
                      f"{p.get('act')}{' → ' + p['next_site'] if p.get('next_site') else ''} |")  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:])
