"""The stage fork's grid (docs/results.md, "The stage fork's grid", 2026-12-04): found depth by constant, the
spread of one fork between runs that differ only in their numerics, growth against scratch given
the same FLOPs (paired by seed), and the figure. Trains nothing.

    python experiments/stage_grid.py runs/gpu/* runs/stage_k8 runs/stage_k8_t2 \
        --sweep docs/results/stopping_full/runs.jsonl --figure docs/results/stage_grid.png

Each argument is a run folder of experiments/fork_full.sh or experiments/gpu_rows.sh
(``<folder>/split<S>/runs.jsonl``, its ``config.yaml``, and the compute-matched scratch arms of
experiments/fork_matched.py under ``split<S>/matched/``). A folder under one named ``gpu`` ran
on the lent H200, any other on this machine's CPU.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments"))

from fork_matched import fork_flops  # noqa: E402
from fork_results import data_sizes  # noqa: E402
from periodic_matched import growth_flops, stage_sizes  # noqa: E402
from periodic_results import paired_interval  # noqa: E402


def _option(cb: dict, part: str, name: str):
    """An option of GrowUntilSaturated in a run's saved config.yaml: a flat key in runs written before
    the options were grouped, else a field of its ``schedule``/``decision`` part (``init_args``)."""
    return cb[name] if name in cb else cb[part]["init_args"][name]


def runs(folders: list[str]) -> list[dict]:
    """One record per finished growth row: its constants (from the run's own config.yaml), the
    judged forks, the total FLOPs (training, arms, scoring, probe passes) and its matched arms."""
    out, arms = [], {}
    for folder in map(Path, folders):
        for split_dir in sorted(folder.glob("split*")):
            if not (split_dir / "runs.jsonl").exists():
                continue
            config = yaml.safe_load((split_dir / "config.yaml").read_text())
            cb = config["trainer"]["callbacks"][0]["init_args"]
            data = config["data"]["init_args"]
            train_images, probe_size = data_sizes(split_dir)
            if (split_dir / "matched" / "plan.jsonl").exists():
                for line in open(split_dir / "matched" / "plan.jsonl"):
                    plan = json.loads(line)
                    done = split_dir / "matched" / plan["folder"] / "runs.jsonl"
                    if done.exists():  # pooled: a row of the same seed, architecture and budget shares the arm
                        key = (plan["seed"], data["seed"], tuple(plan["arm_blocks"]), round(plan["budget_flops"] / 1e9))
                        arms[key] = {**plan, **json.loads(done.read_text().splitlines()[-1])}
            for line in open(split_dir / "runs.jsonl"):
                row = json.loads(line)
                if not row["key"].startswith("growth/"):
                    continue
                seed = row["seed"]
                row["checkpoint"] = str(next(split_dir.glob(f"growth_*_seed{seed}")) / "final.ckpt")
                forks = fork_flops(row, train_images=train_images, steps_per_epoch=row["steps"] // row["epochs"],
                                   probe_size=probe_size)  # fmt: skip
                history = json.loads((Path(row["checkpoint"]).parent / "growth_history.json").read_text())
                judged = [h["fork"] for h in history if (h.get("fork") or {}).get("gain_frac") is not None]
                out.append({
                    "run": folder.name, "device": "H200" if "gpu" in folder.parts[:-1] else "CPU",
                    "seed": seed, "split": data["seed"], "K": _option(cb, "schedule", "every_n_epochs"),
                    "min_gain": _option(cb, "decision", "min_gain"),
                    "probe": probe_size, "train_images": train_images, "subset": bool(data.get("train_subset")), "blocks": row["blocks"],
                    "sizes": stage_sizes(row), "test_loss": row["test_loss"], "forks": judged,
                    "gflop": (growth_flops(row, probe_size) + forks["arms"] + forks["scoring"]) / 1e9,
                })  # fmt: skip
    for r in out:  # the found architecture's scratch arm given the same FLOPs, wherever it was trained
        m = arms.get((r["seed"], r["split"], tuple(r["sizes"]), round(r["gflop"])))
        r["matched"] = {"found": m} if m is not None else {}
    return out


def sweep_rows(path: str) -> list[dict]:
    rows = {}
    for line in open(path):
        r = json.loads(line)
        if r["key"].startswith("scratch/"):
            rows[r["key"]] = r  # a later row of the same key wins
    return list(rows.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folders", nargs="+")
    parser.add_argument("--sweep", default=str(ROOT / "docs" / "results" / "stopping_full" / "runs.jsonl"))
    parser.add_argument("--figure")
    args = parser.parse_args()
    rows = runs(args.folders)

    print("| run | device | K | min_gain | probe | train images | seed | split | first fork (3 → 6) | blocks | test loss | GFLOP |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in sorted(rows, key=lambda r: (r["subset"], r["K"], r["probe"], r["min_gain"], r["split"], r["seed"], r["device"])):
        f = r["forks"][0]
        print(f"| {r['run']} | {r['device']} | {r['K']} | {r['min_gain']} | {r['probe']:,} | {r['train_images']:,} | "
              f"{r['seed']} | {r['split']} | {100 * f['gain_frac']:+.2f} % [{100 * f['lower_frac']:+.2f}, "
              f"{100 * f['upper_frac']:+.2f}] | {r['blocks']} | {r['test_loss']:.4f} | {r['gflop']:,.0f} |")  # fmt: skip

    # the same fork, runs that differ only in their numerics (device, thread count, min_gain: the
    # threshold does not change what the run trains or what the fork scores)
    same = [r for r in rows if (r["K"], r["probe"], r["split"], r["seed"], r["subset"]) == (8, 2000, 0, 0, False)]
    gains = [100 * r["forks"][0]["gain_frac"] for r in same]
    if len(gains) > 1:
        mean = sum(gains) / len(gains)
        sd = (sum((g - mean) ** 2 for g in gains) / (len(gains) - 1)) ** 0.5
        se = [100 * r["forks"][0]["se"] / r["forks"][0]["loss_before"] for r in same]
        print(f"\nK = 8, seed 0, split 0, the first fork in {len(gains)} runs ({', '.join(r['run'] + '/' + r['device'] for r in same)}): "
              f"{' / '.join(f'{g:+.2f}' for g in gains)} % of the loss; sd between runs {sd:.2f} points, "
              f"each run's own se {min(se):.2f}-{max(se):.2f}")  # fmt: skip

    print("\n| run | device | seed | growth (blocks, test loss, GFLOP incl. arms) | scratch arm | epochs | GFLOP | test loss | growth − scratch |")
    print("|---|---|---|---|---|---|---|---|---|")
    deltas: dict[str, list[float]] = {}
    for r in sorted(rows, key=lambda r: (r["run"], r["seed"])):
        for arm, m in sorted(r["matched"].items()):
            d = r["test_loss"] - m["test_loss"]
            if r["K"] == 8 and r["probe"] == 2000 and r["split"] == 0 and not r["subset"] and r["min_gain"] == 0.01:
                deltas.setdefault(f"K = 8, {r['device']}, {arm}", []).append(d)
            print(f"| {r['run']} | {r['device']} | {r['seed']} | {r['blocks']}, {r['test_loss']:.4f}, {r['gflop']:,.0f} | "
                  f"{arm} {'-'.join(map(str, m['arm_blocks']))} | {m['epochs']} | {m['flops'] / 1e9:,.0f} | "
                  f"{m['test_loss']:.4f} | {d:+.4f} |")  # fmt: skip
    for arm, ds in sorted(deltas.items()):
        print("\n" + paired_interval(arm, ds))

    # what a user would do instead: scratch at a generous depth (10 blocks)
    # and at d* (7), the sweep's own plateau-stopped runs of the same seed and split
    sweep = {(r["seed"], r["blocks"]): r for r in sweep_rows(args.sweep)}
    print("\n| run | device | seed | growth (blocks, test loss, GFLOP) | scratch 10 blocks (test, GFLOP) | growth − it | "
          "scratch 7 blocks (test, GFLOP) | growth − it |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|")
    instead: dict[str, list[float]] = {}
    for r in sorted(rows, key=lambda r: (r["device"], r["seed"])):
        if (r["K"], r["probe"], r["split"], r["subset"], r["min_gain"]) != (8, 2000, 0, False, 0.01):
            continue
        cells = []
        for b in (10, 7):
            s_ = sweep[(r["seed"], b)]
            d = r["test_loss"] - s_["test_loss"]
            instead.setdefault(f"K = 8, {r['device']}, against scratch at {b} blocks (the sweep)", []).append(d)
            cells.append(f"{s_['test_loss']:.4f}, {s_['flops'] / 1e9:,.0f} | {d:+.4f}")
        print(f"| {r['run']} | {r['device']} | {r['seed']} | {r['blocks']}, {r['test_loss']:.4f}, {r['gflop']:,.0f} | "
              + " | ".join(cells) + " |")
    for arm, ds in sorted(instead.items()):
        print("\n" + paired_interval(arm, ds))

    if args.figure:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        sweep = sweep_rows(args.sweep)
        fig, (ax, dax) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
        cmap = plt.get_cmap("viridis")
        blocks = sorted({r["blocks"] for r in sweep})
        for i, b in enumerate(blocks):
            rs = [r for r in sweep if r["blocks"] == b]
            ax.scatter([r["flops"] / 1e9 for r in rs], [r["test_loss"] for r in rs], color=cmap(i / (len(blocks) - 1)),
                       s=18, label=f"scratch {b} blocks (sweep)")  # fmt: skip
        matched = [m for r in rows if not r["subset"] for m in r["matched"].values()]
        for m in matched:
            ax.scatter([m["flops"] / 1e9], [m["test_loss"]], marker="s", facecolors="none", edgecolors="k", s=40)
        points = sorted([(r["flops"] / 1e9, r["test_loss"]) for r in sweep] + [(m["flops"] / 1e9, m["test_loss"]) for m in matched])
        frontier, best = [], float("inf")
        for x, y in points:
            best = min(best, y)
            frontier.append((x, best))
        frontier.append((max(r["gflop"] for r in rows), best))  # the best scratch holds to the right edge
        ax.step(*zip(*frontier), where="post", color="0.4", lw=1, label="best scratch at ≤ F (sweep + matched arms □)")
        colors = {4: "tab:blue", 8: "tab:orange", 16: "tab:green"}
        for K in sorted({r["K"] for r in rows}):
            rs = [r for r in rows if r["K"] == K and not r["subset"]]
            ax.scatter([r["gflop"] for r in rs], [r["test_loss"] for r in rs], marker="*", s=150, edgecolors="k",
                       color=colors.get(K, "tab:gray"), label=f"stage fork, K = {K} (arms counted)")  # fmt: skip
        ax.set_xscale("log")
        ax.set_xlabel("GFLOP (log)")
        ax.set_ylabel("test loss (10k official test images)")
        ax.set_title("Full Fashion-MNIST: the stage fork's grid against scratch")
        ax.legend(fontsize=6)
        settings = []
        for r in sorted(rows, key=lambda r: (r["subset"], r["split"], r["probe"], r["min_gain"] != 0.01, r["min_gain"], r["K"])):
            name = (f"K={r['K']}" + (f", gain {r['min_gain']:g}" if r["min_gain"] != 0.01 else "")
                    + (f", probe {r['probe']}" if r["probe"] != 2000 else "") + (f", split {r['split']}" if r["split"] else "")
                    + (", 25 %" if r["subset"] else ""))  # fmt: skip
            if name not in settings:
                settings.append(name)
            x = settings.index(name) + (0.12 * r["seed"] - 0.12) + (0.05 if r["device"] == "CPU" else 0)
            dax.scatter([x], [r["blocks"]], marker="o" if r["device"] == "H200" else "s", s=40,
                        color=f"C{r['seed']}", edgecolors="k")  # fmt: skip
        dax.axhspan(7, 10, color="tab:red", alpha=0.1, label="the sweep's 7-10 blocks")
        dax.set_xticks(range(len(settings)), settings, rotation=45, ha="right", fontsize=7)
        dax.set_ylabel("blocks found (colour: seed; ○ H200, □ CPU)")
        dax.set_title("found depth by setting")
        dax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.figure, dpi=120)


if __name__ == "__main__":
    main()
