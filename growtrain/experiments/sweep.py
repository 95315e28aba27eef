"""Depth sweep (the paper's Figure 1, Appendix B.1–B.2): loss and AG_max against depth.

For each value of the depth hyper-parameter (``added=N`` blocks assigned cyclically to the
ResNet-8 backbone for cifar_resnet; ``n_layer`` for GPT) a fresh module is trained from
scratch with the configured trainer, then measured: train loss (train split, eval mode, no
augmentation), test loss, and the saturation test on the probe split (Γ̂, δ+t, AG_max, the
batch-level AG of Eq. (2)). ``sweep.png`` plots them against depth; with a growth run's
``growth_history.json`` the depth where growth stopped is marked. Depths already in
``output_dir/runs.jsonl`` are not retrained.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from lightning.pytorch import LightningDataModule, LightningModule, seed_everything

from growtrain.callbacks import ComputeMeter, growth_callbacks
from growtrain.experiments._training import evaluate, sibling_trainer
from growtrain.experiments.runs import (
    ModuleFactory,
    RunLog,
    check_rebuildable,
    depth_offset,
    fingerprint,
    fmt,
    growable_of,
    markdown_table,
    module_at_depth,
    parse_depths,
    prepare,
    probe_loss_of,
    resolve_depth_kwarg,
    rich_table,
)
from growtrain.plots import plot_sweep
from growtrain.saturation import measure_saturation

__all__ = ["SweepResult", "run_sweep", "growth_stop_depth"]

_COLUMNS = (
    ("depth", "depth"), ("blocks", "blocks"), ("train_loss", "train loss"), ("test_loss", "test loss"),
    ("ag_max", "AG_max"), ("gamma", "Γ̂"), ("threshold", "δ+t"), ("ag_batch_max", "AG_max (Eq. 2)"),
    ("saturated", "saturated"), ("epochs", "epochs"), ("wall_s", "time (s)"),
)  # fmt: skip


@dataclass
class SweepResult:
    rows: list[dict]
    depth_kwarg: str
    stop_depth: int | None = None  # depth (value of depth_kwarg) where a growth run stopped
    output_dir: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)

    def _cells(self) -> tuple[list[str], list[list[str]]]:
        header = [self.depth_kwarg if k == "depth" else name for k, name in _COLUMNS]
        rows = []
        for r in self.rows:
            rows.append([str(r[k]) if isinstance(r.get(k), (int, bool, str)) else fmt(r.get(k)) for k, _ in _COLUMNS])
        return header, rows

    def table(self):
        caption = None if self.stop_depth is None else f"growth stopped at {self.depth_kwarg}={self.stop_depth}"
        return rich_table(*self._cells(), title="Depth sweep (trained from scratch)", caption=caption, left_columns=0)

    def markdown(self) -> str:
        return markdown_table(*self._cells())

    def __rich__(self):
        return self.table()


def growth_stop_depth(history_path: str | Path, model: LightningModule, depth_kwarg: str) -> int:
    """The depth (a value of ``depth_kwarg``) of the network when a growth run stopped.

    Reads ``growth_history.json`` (a list of check records, or ``{"history": [...]}``): the
    last record's ``depth`` (total residual blocks), converted with the model's offset
    (cifar_resnet: ``added = blocks − sum(backbone blocks)``).
    """
    data = json.loads(Path(history_path).read_text())
    history = data.get("history", data) if isinstance(data, dict) else data
    depths = [h["depth"] for h in history if isinstance(h, dict) and h.get("depth") is not None]
    if not depths:
        raise ValueError(f"growth_history: {history_path} has no records with a 'depth'")
    return int(depths[-1]) - depth_offset(model, depth_kwarg)


def run_sweep(
    model: LightningModule,
    datamodule: LightningDataModule,
    *,
    trainer_kwargs: dict | None = None,
    depths: str | Sequence[int] = "0..6",
    depth_kwarg: str | None = None,
    seed: int = 0,
    growth_history: str | Path | None = None,
    delta: float = 0.0,
    alpha: float = 0.05,
    rule: str = "paper",
    projected: bool = False,
    output_dir: str | Path = "sweep",
    resume: bool = True,
    module_factory: ModuleFactory | None = None,
) -> SweepResult:
    """Train each depth from scratch and measure it; writes sweep.json/.csv/.md and sweep.png."""
    values = parse_depths(depths)
    name = resolve_depth_kwarg(model, depth_kwarg)
    prepare(datamodule, "sweep")
    check_rebuildable(model, module_factory)
    kwargs = dict(trainer_kwargs or {})
    stop = growth_stop_depth(growth_history, model, name) if growth_history else None
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(
        {k: v for k, v in dict(model.hparams).items() if not k.startswith("_")},
        dict(getattr(datamodule, "hparams", {}) or {}),
        {k: v for k, v in kwargs.items() if k not in ("default_root_dir", "logger", "enable_progress_bar")},
        {"seed": seed, "delta": delta, "alpha": alpha, "rule": rule, "projected": projected, "depth_kwarg": name},
    )  # fmt: skip
    log = RunLog(out / "runs.jsonl", fp, resume)
    configured = growth_callbacks(kwargs.get("callbacks"))
    rows = []
    for value in values:
        key = f"{name}={value}"
        row = log.get(key)
        if row is None:
            seed_everything(seed, workers=True, verbose=False)
            module = module_at_depth(model, value, name, module_factory)
            root = out / f"{name}_{value}"
            meter = ComputeMeter()
            trainer = sibling_trainer(kwargs, root, keep=lambda cb: cb not in configured, extra_callbacks=[meter])
            start = time.perf_counter()
            trainer.fit(module, datamodule=datamodule)
            wall = time.perf_counter() - start
            network = growable_of(module)
            report = measure_saturation(
                network, datamodule.probe_dataloader(), probe_loss_of(module), delta=delta, alpha=alpha, rule=rule,
                projected=projected, seed=seed, variance=True,  # the table reports the paper's δ+t under every rule
            )  # fmt: skip
            row = log.add(key, {
                "depth": value, "blocks": network.depth(),
                "train_loss": evaluate(module, datamodule, "train", kwargs, root / "eval").get("loss"),
                "test_loss": evaluate(module, datamodule, "test", kwargs, root / "eval").get("loss"),
                "gamma": report.gamma, "threshold": report.threshold, "ag_max": report.ag_max,
                "ag_batch_max": max(r.ag_batch for r in report.sites),
                "projected_max": max((r.projected for r in report.sites if r.projected is not None), default=None),
                "saturated": report.saturated, "best_site": report.best_record.name, "error_bound": report.error_bound,
                "epochs": trainer.current_epoch, "flops": meter.flops, "wall_s": wall,
                "params": sum(p.numel() for p in module.parameters()),
            })  # fmt: skip
        rows.append(row)
    result = SweepResult(rows=rows, depth_kwarg=name, stop_depth=stop, output_dir=out)
    (out / "sweep.json").write_text(
        json.dumps({"depth_kwarg": name, "stop_depth": stop, "rows": rows}, indent=1, default=str)
    )
    (out / "sweep.md").write_text("# Depth sweep\n\n" + result.markdown())
    with open(out / "sweep.csv", "w", newline="") as f:
        fields = [k for k in rows[0] if k not in ("key", "fingerprint")]
        writer = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    plot_sweep(rows, out / "sweep.png", depth_label=name, stop_depth=stop)
    result.files = {k: out / f"sweep.{k}" for k in ("json", "md", "csv", "png")}
    return result
