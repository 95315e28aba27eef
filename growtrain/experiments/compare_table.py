"""The Growth-vs-Scratch summary: per depth, means ± sd per arm, paired differences with 95 %
t-intervals, the equal-train-loss comparison, compute and stopping; as Markdown, CSV, JSON
and a rich table."""

from __future__ import annotations

import csv
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from growtrain.experiments.paired import paired_difference
from growtrain.experiments.runs import fmt, fmt_mean_std, markdown_table, mean_std, rich_table

__all__ = ["CompareResult", "summarise", "write_files"]

_ARM_METRICS = ("train_loss", "test_loss", "test_acc", "gap", "epochs", "wall_s", "flops")
_PAIRED = ("train_loss", "test_loss", "gap")  # Growth − Scratch, per seed


def arm_values(rows: dict, arm: str) -> dict[str, Any] | None:
    """One seed's numbers for ``arm``; the growth arm's compute includes its base training."""
    row = rows.get(arm)
    if row is None:
        return None
    train, test = row["train"].get("loss"), row["test"].get("loss")
    values = {
        "train_loss": train, "test_loss": test, "test_acc": row["test"].get("acc"),
        "gap": None if train is None or test is None else test - train,
        "epochs": row["epochs"], "wall_s": row["wall_s"], "flops": row["flops"], "capped": bool(row.get("capped")),
        "stop": row.get("stop"),
    }  # fmt: skip
    base = rows.get("base")
    if arm == "growth" and base is not None:
        values["epochs_after_insertion"] = row["epochs"]
        for k in ("epochs", "wall_s", "flops"):
            values[k] += base[k]
        values["capped"] = values["capped"] or bool(base.get("capped"))
    return values


def _equal_values(rows: dict) -> dict:
    lookup = rows.get("equal") or {}
    out = {"target": lookup.get("target")}
    for arm in ("growth", "scratch"):
        entry = lookup.get(arm) or {}
        out[f"{arm}_test"] = (entry.get("test") or {}).get("loss")
        out[f"{arm}_train"] = (entry.get("train") or {}).get("loss")
        out[f"{arm}_epoch"] = entry.get("epoch")
    return out


def summarise(depth, label, per_seed: list[dict], arms, depth_kwarg) -> dict:
    growth_rows = [rows["growth"] for rows in per_seed]
    blocks = sorted({r["blocks"] for r in growth_rows})
    row: dict[str, Any] = {
        "depth": depth,
        "depth_kwarg": depth_kwarg,
        "label": label or (f"{depth_kwarg}={depth}" if depth is not None else "grown until saturated"),
        "blocks": blocks[0] if len(blocks) == 1 else "/".join(map(str, blocks)),
        "n": len(per_seed),
        "seeds": [r["seed"] for r in growth_rows],
        "sites": [((r.get("insertion") or {}).get("site")) or [g["site"] for g in r["growth_log"]] for r in growth_rows],
    }
    values = {arm: [arm_values(rows, arm) for rows in per_seed] for arm in arms}
    for arm in arms:
        known = [v for v in values[arm] if v is not None]
        for metric in _ARM_METRICS:
            row[f"{arm}_{metric}"], row[f"{arm}_{metric}_std"], _ = mean_std(v[metric] for v in known)
        row[f"{arm}_capped"] = sum(v["capped"] for v in known)
        row[f"{arm}_stops"] = [v["stop"] for v in known]
    if values["growth"] and "epochs_after_insertion" in (values["growth"][0] or {}):
        row["growth_epochs_after_insertion"], _, _ = mean_std(v["epochs_after_insertion"] for v in values["growth"] if v)

    def per_seed_metric(arm, metric):
        return [None if v is None else v[metric] for v in values[arm]]

    for metric in _PAIRED:
        row[f"diff_{metric}"] = paired_difference(per_seed_metric("growth", metric), per_seed_metric("scratch", metric))
    if "matched" in arms:
        row["diff_matched_test_loss"] = paired_difference(per_seed_metric("growth", "test_loss"), per_seed_metric("matched", "test_loss"))
    equal = [_equal_values(rows) for rows in per_seed]
    row["equal_target"], row["equal_target_std"], _ = mean_std(e["target"] for e in equal)
    for arm in ("growth", "scratch"):
        row[f"equal_{arm}_test_loss"], row[f"equal_{arm}_test_loss_std"], _ = mean_std(e[f"{arm}_test"] for e in equal)
        row[f"equal_{arm}_train_loss"], _, _ = mean_std(e[f"{arm}_train"] for e in equal)
        row[f"equal_{arm}_epoch"], _, _ = mean_std(e[f"{arm}_epoch"] for e in equal)
    row["diff_equal_test_loss"] = paired_difference([e["growth_test"] for e in equal], [e["scratch_test"] for e in equal])
    return row


def fmt_diff(diff: dict, digits: int = 4) -> str:
    """``+0.0123 [−0.0050, +0.0296]``; one pair: ``+0.0123 (n=1)``; none: ``—``."""
    if diff is None or diff.get("mean") is None:
        return "—"

    def signed(x):
        return ("+" if x >= 0 else "−") + fmt(abs(x), digits)

    if diff.get("lo") is None:
        return f"{signed(diff['mean'])} (n={diff['n']})"
    return f"{signed(diff['mean'])} [{signed(diff['lo'])}, {signed(diff['hi'])}]"


def _ms(row: dict, key: str, digits: int = 4) -> str:
    return fmt_mean_std((row.get(key), row.get(f"{key}_std"), row.get("n", 0)), digits)


@dataclass
class CompareResult:
    """``summary``: one dict per row (depth); ``runs``: every training in its role (base,
    growth, scratch, matched), per seed; ``lookups``: the equal-train-loss lookups."""

    summary: list[dict]
    runs: list[dict]
    output_dir: Path
    lookups: list[dict] = field(default_factory=list)
    arms: tuple[str, ...] = ("scratch", "growth", "matched")
    files: dict[str, Path] = field(default_factory=dict)
    extra_markdown: str = ""  # a further table some experiments add (e.g. the block's own value)

    # -- table 1: converged losses, paired ------------------------------------------------------
    def header(self) -> list[str]:
        head = ["Model", "Blocks", "n"]
        for name in ("Train loss", "Test loss", "Gap"):
            head += [f"{name} Scratch", f"{name} Growth", f"Δ {name.lower()} G−S [95% CI]"]
        return head + ["Test acc Scratch", "Test acc Growth"]

    def _cells(self, row: dict) -> list[str]:
        cells = [row["label"], str(row["blocks"]), str(row["n"])]
        for metric in ("train_loss", "test_loss", "gap"):
            cells += [_ms(row, f"scratch_{metric}"), _ms(row, f"growth_{metric}"), fmt_diff(row.get(f"diff_{metric}"))]
        return cells + [_ms(row, "scratch_test_acc"), _ms(row, "growth_test_acc")]

    # -- table 2: equal training loss, compute, stopping, matched -------------------------------------
    def header2(self) -> list[str]:
        arms = "/".join(a[0].upper() for a in self.arms)
        head = ["Model", "Target train loss", "Test loss @target Scratch", "Test loss @target Growth",
                "Δ @target G−S [95% CI]", "Train loss @target S/G", "Epoch @target S/G", f"Epochs {arms}", f"FLOPs {arms}", "Capped (of n)"]  # fmt: skip
        if "matched" in self.arms:
            head += ["Test loss Matched", "Δ test G−M [95% CI]"]
        return head

    def _cells2(self, row: dict) -> list[str]:
        def joined(metric, spec):
            return " / ".join("—" if row.get(f"{a}_{metric}") is None else spec.format(row[f"{a}_{metric}"]) for a in self.arms)

        train_at = " / ".join("—" if row.get(f"equal_{a}_train_loss") is None else fmt(row[f"equal_{a}_train_loss"], 4) for a in ("scratch", "growth"))
        epochs_at = " / ".join("—" if row.get(f"equal_{a}_epoch") is None else f"{row[f'equal_{a}_epoch']:.1f}" for a in ("scratch", "growth"))
        cells = [
            row["label"], _ms(row, "equal_target"), _ms(row, "equal_scratch_test_loss"), _ms(row, "equal_growth_test_loss"),
            fmt_diff(row.get("diff_equal_test_loss")), train_at, epochs_at, joined("epochs", "{:.1f}"), joined("flops", "{:.2e}"),
            ", ".join(f"{a[0].upper()} {row.get(f'{a}_capped', 0)}/{row['n']}" for a in ("scratch", "growth")),
        ]  # fmt: skip
        if "matched" in self.arms:
            cells += [_ms(row, "matched_test_loss"), fmt_diff(row.get("diff_matched_test_loss"))]
        return cells

    def caption(self) -> str:
        n = max((row["n"] for row in self.summary), default=0)
        return (
            f"mean ± sd over {n} seed(s); Δ: mean paired difference over seeds with its 95 % t-interval; "
            "gap = test − train loss; @target: each arm at its first epoch at the final lr whose logged train loss is ≤ the "
            "larger of the two arms' final ones (train loss there re-measured in eval mode); arms S = Scratch, G = Growth (epochs/FLOPs include its base), M = compute-matched "
            "Scratch; Capped: arms the epoch cap stopped (not the train-loss plateau; M always spends its budget)."
        )

    def table(self):
        from rich.console import Group

        return Group(
            rich_table(self.header(), [self._cells(r) for r in self.summary], title="Growth vs Scratch at convergence (same final architecture)"),
            rich_table(self.header2(), [self._cells2(r) for r in self.summary], title="At equal training loss; compute and stopping", caption=self.caption()),
        )  # fmt: skip

    def markdown(self) -> str:
        return (
            markdown_table(self.header(), [self._cells(r) for r in self.summary]) + "\n"
            + markdown_table(self.header2(), [self._cells2(r) for r in self.summary])
        )  # fmt: skip

    def __rich__(self):
        return self.table()


def write_files(result: CompareResult, stem: str = "compare", **options) -> None:
    out = result.output_dir
    extra = f"\n{result.extra_markdown}" if result.extra_markdown else ""
    (out / f"{stem}.md").write_text("# Growth vs Scratch\n\n" + result.markdown() + "\n" + result.caption() + "\n" + extra)
    fields = list(result.summary[0]) if result.summary else []
    with open(out / f"{stem}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in result.summary:
            writer.writerow({k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in row.items()})
    (out / f"{stem}.json").write_text(
        json.dumps({"options": options, "summary": result.summary, "runs": result.runs, "lookups": result.lookups},
                   indent=1, default=str)  # fmt: skip
    )
    result.files = {k: out / f"{stem}.{k}" for k in ("md", "csv", "json")}
