"""Growth vs Scratch (the paper's Table 1), with compute accounting and a compute-matched arm.

Per seed, up to four *arms*, each one training of the configured module (same data,
augmentation, optimizer, schedule and callbacks, i.e. the same convergence criterion):

* **growth** — *continuous mode* (``depths=None``): one fit with ``GrowUntilSaturated``
  (the configured one, or a default one) that grows until saturated or ``max_growths``.
  *Table mode* (``depths=[…]``, the paper's protocol): for each final depth ``D`` (a value of
  the depth hyper-parameter, e.g. ``added=N`` for cifar_resnet), the **base** arm trains depth
  ``D−1`` to convergence; the growth arm loads it, inserts ONE zero-output block and trains
  again to convergence (a new fit: fresh optimizer state and schedule, as a new training run).
  The block goes to the probe's best site (``insert_at="best"``: the scored candidate itself)
  or to the end of the stage the cyclic depth rule would extend (``"cyclic"``: the paper's
  architectures).
* **scratch** — the *same final architecture* (module tree and parameter count checked
  equal), every parameter from the constructor's random initialisation, seeded with
  ``seed + 10000`` so no initial tensor is shared with the growth arm.
* **matched** — scratch again, given the growth arm's *total* training FLOPs (base included
  in table mode) as a step budget; early-stopping callbacks are removed so it spends it.
  Schedules keyed to epochs are not rescaled.

Train loss is re-measured after training on the train split in eval mode without
augmentation (not the running training-loss log), test loss/accuracy on the test split.
Compute: epochs, wall time and estimated FLOPs (``growtrain.callbacks.ComputeMeter``).

Every finished (depth, seed, arm) is appended to ``output_dir/runs.jsonl``; a rerun skips
those and trains only what is missing. Outputs: ``compare.md``, ``compare.csv``,
``compare.json`` and a rich table.
"""

from __future__ import annotations

import csv
import json
import math
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Sequence

from lightning.pytorch import LightningDataModule, LightningModule, seed_everything
from lightning.pytorch.callbacks import EarlyStopping

from growtrain.callbacks import ComputeMeter, GrowUntilSaturated, growth_callbacks
from growtrain.experiments._training import evaluate, sibling_trainer
from growtrain.experiments.runs import (
    ModuleFactory,
    RunLog,
    architecture_digest,
    check_rebuildable,
    fingerprint,
    fmt_mean_std,
    growable_of,
    load_checkpoint_into,
    markdown_table,
    mean_std,
    module_at_depth,
    module_with_stages,
    prepare,
    probe_loss_of,
    rebuild_module,
    reference_module,
    resolve_depth_kwarg,
    rich_table,
    stage_sizes,
)
from growtrain.saturation import measure_saturation

__all__ = ["CompareResult", "run_compare", "SCRATCH_SEED_OFFSET"]

SCRATCH_SEED_OFFSET = 10_000
# Columns of the summary: (metric, heading, digits)
_METRICS = (("train_loss", "Train loss", 4), ("test_loss", "Test loss", 4), ("test_acc", "Test acc", 4))
_COMPUTE = (("epochs", "Epochs", "{:.1f}"), ("wall_s", "Time (s)", "{:.1f}"), ("flops", "FLOPs", "{:.2e}"))


@dataclass
class CompareResult:
    """``summary``: one dict per row (depth); ``runs``: every training's record."""

    summary: list[dict]
    runs: list[dict]
    output_dir: Path
    arms: tuple[str, ...] = ("scratch", "growth", "matched")
    files: dict[str, Path] = field(default_factory=dict)

    def _metrics(self):
        return [m for m in _METRICS if any(r.get(f"growth_{m[0]}") is not None for r in self.summary)]

    def _cells(self, row: dict) -> list[str]:
        cells = [row["label"], str(row["blocks"])]
        for metric, _, digits in self._metrics():
            for arm in ("scratch", "growth"):
                cells.append(fmt_mean_std(_stats(row, arm, metric), digits))
        if "matched" in self.arms:
            for metric, _, digits in self._metrics()[1:]:
                cells.append(fmt_mean_std(_stats(row, "matched", metric), digits))
        for metric, _, spec in _COMPUTE:
            cells.append(" / ".join("—" if row.get(f"{arm}_{metric}") is None else spec.format(row[f"{arm}_{metric}"]) for arm in self.arms))
        return cells

    def header(self) -> list[str]:
        head = ["Model", "Blocks"]
        for _, name, _ in self._metrics():
            head += [f"{name} Scratch", f"{name} Growth"]
        if "matched" in self.arms:
            head += [f"{name} Matched" for _, name, _ in self._metrics()[1:]]
        arms = "/".join(a[0].upper() for a in self.arms)
        head += [f"{name} {arms}" for _, name, _ in _COMPUTE]
        return head

    def table(self):
        n = max((row["n"] for row in self.summary), default=0)
        return rich_table(
            self.header(), [self._cells(r) for r in self.summary],
            title="Growth vs Scratch (same final architecture)",
            caption=f"mean ± std over {n} seed(s); compute S = Scratch, G = Growth (base included), M = compute-matched Scratch",
        )  # fmt: skip

    def markdown(self) -> str:
        return markdown_table(self.header(), [self._cells(r) for r in self.summary])

    def __rich__(self):
        return self.table()


def _stats(row: dict, arm: str, metric: str) -> tuple:
    return row.get(f"{arm}_{metric}"), row.get(f"{arm}_{metric}_std"), row.get("n", 0)


def run_compare(
    model: LightningModule,
    datamodule: LightningDataModule,
    *,
    trainer_kwargs: dict | None = None,
    seeds: Sequence[int] = (0, 1, 2),
    depths: Sequence[int] | None = None,
    depth_kwarg: str | None = None,
    insert_at: Literal["best", "cyclic"] = "best",
    max_growths: int | None = None,
    compute_matched: bool = True,
    labels: Sequence[str] | None = None,
    output_dir: str | Path = "compare",
    resume: bool = True,
    module_factory: ModuleFactory | None = None,
) -> CompareResult:
    """Growth vs Scratch over ``seeds`` (see the module docstring for the protocol).

    ``model`` is a template: it is never trained; fresh modules are built from its
    configuration (``module_factory(**overrides)`` if given). ``trainer_kwargs`` are
    ``lightning.Trainer`` arguments shared by every training (callbacks are deep-copied).
    """
    seeds = [int(s) for s in seeds]
    if not seeds:
        raise ValueError("seeds: expected at least one seed, e.g. [0, 1, 2]")
    if insert_at not in ("best", "cyclic"):
        raise ValueError(f"insert_at: expected 'best' or 'cyclic', got {insert_at!r}")
    if max_growths is not None and max_growths < 1:
        raise ValueError(f"max_growths: expected None or an integer ≥ 1, got {max_growths!r}")
    if depths is not None:
        depths = [int(d) for d in depths]
        if not depths or min(depths) < 1:
            raise ValueError(f"depths: expected final depths ≥ 1 (depth−1 is trained first), got {depths!r}")
        depth_kwarg = resolve_depth_kwarg(model, depth_kwarg)
    if labels is not None and (depths is None or len(labels) != len(depths)):
        raise ValueError(f"labels: expected one label per depth ({depths}), got {labels!r}")
    prepare(datamodule, "compare")
    check_rebuildable(model, module_factory)
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    kwargs = dict(trainer_kwargs or {})
    fp = fingerprint(
        {k: v for k, v in dict(model.hparams).items() if not k.startswith("_")},
        dict(getattr(datamodule, "hparams", {}) or {}),
        {k: v for k, v in kwargs.items() if k not in _COSMETIC},
        {"depth_kwarg": depth_kwarg, "insert_at": insert_at, "max_growths": max_growths, "scratch_seed_offset": SCRATCH_SEED_OFFSET},
    )  # fmt: skip
    runner = _Runner(model, datamodule, kwargs, out, RunLog(out / "runs.jsonl", fp, resume), depth_kwarg, module_factory)
    arms = ("scratch", "growth", "matched") if compute_matched else ("scratch", "growth")
    summary, runs = [], []
    for i, depth in enumerate(depths if depths is not None else [None]):
        per_seed = []
        for seed in seeds:
            if depth is None:
                rows = runner.continuous(seed, max_growths, compute_matched)
            else:
                rows = runner.table_mode(depth, seed, insert_at, compute_matched)
            per_seed.append(rows)
            runs += [r for r in rows.values() if r is not None]
        label = labels[i] if labels is not None else None
        summary.append(_summarise(depth, label, per_seed, arms, depth_kwarg))
    result = CompareResult(summary=summary, runs=runs, output_dir=out, arms=arms)
    _write(result, seeds=seeds, depths=depths, depth_kwarg=depth_kwarg, insert_at=insert_at)
    return result


# Trainer settings that do not change results (left out of the configuration fingerprint).
_COSMETIC = ("default_root_dir", "logger", "enable_progress_bar", "enable_model_summary", "log_every_n_steps")


class _Runner:
    """Trains the arms of one (depth, seed), reusing rows already in the run log."""

    def __init__(self, model, datamodule, kwargs, out: Path, log: RunLog, depth_kwarg, module_factory):
        self.model, self.dm, self.kwargs, self.out, self.log = model, datamodule, kwargs, out, log
        self.depth_kwarg, self.factory = depth_kwarg, module_factory

    # -- one training ---------------------------------------------------------------------
    def train(
        self, module, root: Path, *, growth: bool, early_stopping: bool = True, extra=(), max_growths=None, **overrides
    ) -> tuple:
        configured = growth_callbacks(self.kwargs.get("callbacks"))

        def keep(cb):
            if not growth and cb in configured:
                return False
            return early_stopping or not isinstance(cb, EarlyStopping)

        meter = ComputeMeter()
        trainer = sibling_trainer(self.kwargs, root, keep=keep, extra_callbacks=[meter, *extra], **overrides)
        if max_growths is not None:  # caps the configured growth callback's copy too
            for cb in growth_callbacks(trainer.callbacks):
                cb.max_growths = max_growths
        start = time.perf_counter()
        trainer.fit(module, datamodule=self.dm)
        wall = time.perf_counter() - start
        network = growable_of(module)
        row = {
            "epochs": trainer.current_epoch,
            "steps": meter.steps,
            "samples": meter.samples,
            "flops": meter.flops,
            "wall_s": wall,
            "train": evaluate(module, self.dm, "train", self.kwargs, root / "eval"),
            "test": evaluate(module, self.dm, "test", self.kwargs, root / "eval"),
            "params": sum(p.numel() for p in module.parameters()),
            "blocks": network.depth(),
            "stages": stage_sizes(network),
            "arch": architecture_digest(module),
            "growth_log": [dict(r) for r in getattr(network, "growth_log", [])],
        }
        return trainer, row

    def scratch(self, key: str, depth, seed: int, grown: dict) -> dict:
        row = self.log.get(key)
        if row is None:
            seed_everything(seed + SCRATCH_SEED_OFFSET, workers=True, verbose=False)
            module = module_with_stages(self.model, grown["stages"], self.depth_kwarg, self.factory)
            _same_architecture(module, grown)
            _, stats = self.train(module, self.out / _dirname(depth, seed, "scratch"), growth=False)
            row = self.log.add(key, {"depth": depth, "seed": seed, "arm": "scratch", **stats})
        return row

    def matched(self, key: str, depth, seed: int, grown: dict, scratch: dict, budget_flops: float) -> dict:
        row = self.log.get(key)
        if row is None:
            per_step = scratch["flops"] / max(scratch["steps"], 1)
            steps = max(1, math.ceil(budget_flops / per_step)) if per_step > 0 else max(scratch["steps"], 1)
            seed_everything(seed + SCRATCH_SEED_OFFSET, workers=True, verbose=False)
            module = module_with_stages(self.model, grown["stages"], self.depth_kwarg, self.factory)
            _, stats = self.train(
                module, self.out / _dirname(depth, seed, "matched"), growth=False, early_stopping=False,
                max_steps=steps, max_epochs=None, min_epochs=None, min_steps=None,
            )  # fmt: skip
            row = self.log.add(key, {"depth": depth, "seed": seed, "arm": "matched", "budget_flops": budget_flops, "budget_steps": steps, **stats})  # fmt: skip
        return row

    # -- continuous mode: grow during one fit ---------------------------------------------------
    def continuous(self, seed: int, max_growths: int | None, compute_matched: bool) -> dict[str, dict | None]:
        key = f"auto/s{seed}"
        growth = self.log.get(f"{key}/growth")
        if growth is None:
            seed_everything(seed, workers=True, verbose=False)
            module = rebuild_module(self.model, self.factory)  # the configured depth, freshly initialised
            configured = growth_callbacks(self.kwargs.get("callbacks"))
            extra = [] if configured else [GrowUntilSaturated(on_saturated="continue")]
            if any(cb.on_saturated == "stop" for cb in configured):
                warnings.warn(
                    "compare: GrowUntilSaturated(on_saturated='stop') ends the growth arm's training when saturated, "
                    "while Scratch trains to the trainer's own criterion; set on_saturated='continue' for the "
                    "same convergence criterion in both arms.",
                    stacklevel=2,
                )
            root = self.out / _dirname(None, seed, "growth")
            trainer, stats = self.train(module, root, growth=True, extra=extra, max_growths=max_growths)
            history = [dict(h) for cb in growth_callbacks(trainer.callbacks) for h in cb.history]
            growth = self.log.add(f"{key}/growth", {"depth": None, "seed": seed, "arm": "growth", "history": history, **stats})
        scratch = self.scratch(f"{key}/scratch", None, seed, growth)
        matched = self.matched(f"{key}/matched", None, seed, growth, scratch, growth["flops"]) if compute_matched else None
        return {"base": None, "growth": growth, "scratch": scratch, "matched": matched}

    # -- table mode: the paper's Table 1 protocol ------------------------------------------------
    def table_mode(self, depth: int, seed: int, insert_at: str, compute_matched: bool) -> dict[str, dict | None]:
        key = f"d{depth}/s{seed}"
        base_key = f"d{depth - 1}/s{seed}/base"
        ckpt = self.out / "checkpoints" / f"base_d{depth - 1}_s{seed}.ckpt"
        base = self.log.get(base_key)
        growth = self.log.get(f"{key}/growth")
        if base is None or (growth is None and not ckpt.is_file()):
            seed_everything(seed, workers=True, verbose=False)
            module = module_at_depth(self.model, depth - 1, self.depth_kwarg, self.factory)
            trainer, stats = self.train(module, self.out / _dirname(depth - 1, seed, "base"), growth=False)
            trainer.save_checkpoint(ckpt)
            base = self.log.add(base_key, {"depth": depth - 1, "seed": seed, "arm": "base", "checkpoint": str(ckpt), **stats})
        if growth is None:
            seed_everything(seed, workers=True, verbose=False)
            module = load_checkpoint_into(module_at_depth(self.model, depth - 1, self.depth_kwarg, self.factory), ckpt)
            insertion = self.insert(module, depth, seed, insert_at)
            _, stats = self.train(module, self.out / _dirname(depth, seed, "growth"), growth=False)
            growth = self.log.add(f"{key}/growth", {"depth": depth, "seed": seed, "arm": "growth", "insertion": insertion, **stats})
        scratch = self.scratch(f"{key}/scratch", depth, seed, growth)
        matched = None
        if compute_matched:
            matched = self.matched(f"{key}/matched", depth, seed, growth, scratch, base["flops"] + growth["flops"])
        return {"base": base, "growth": growth, "scratch": scratch, "matched": matched}

    def insert(self, module, depth: int, seed: int, insert_at: str) -> dict:
        """Insert one zero-output block into the converged base network; what was done, as data."""
        network = growable_of(module)
        if insert_at == "cyclic":
            site = _cyclic_site(self.model, network, depth, self.depth_kwarg, self.factory)
            network.grow(site)
            return {"site": site, "rule": "cyclic"}
        report = measure_saturation(network, self.dm.probe_dataloader(), probe_loss_of(module), projected=False, seed=seed)
        best = report.best_record  # the top site also when the test says "saturated": Table 1 always inserts
        network.grow(best.site, block=best.block)  # the very candidate that was scored
        return {
            "site": best.name, "rule": "best", "gamma": report.gamma, "threshold": report.threshold,
            "saturated": report.saturated, "ag_max": report.ag_max, "error_bound": report.error_bound,
        }  # fmt: skip


def _cyclic_site(model, network, depth: int, depth_kwarg, factory) -> str:
    """The end of the stage that the depth hyper-parameter's rule extends from depth−1 to depth."""
    target = stage_sizes(growable_of(reference_module(model, factory, **{resolve_depth_kwarg(model, depth_kwarg): depth})))
    now = stage_sizes(network)
    grown = [s for s in now if target.get(s, 0) == now[s] + 1]
    if len(grown) != 1 or any(target[s] != now[s] for s in now if s not in grown):
        raise ValueError(f"insert_at: 'cyclic' needs depths one block apart; stages {now} → {target}")
    return f"{grown[0]}.{now[grown[0]]}"


def _same_architecture(module, grown: dict) -> None:
    digest = architecture_digest(module)
    if digest != grown["arch"]:
        raise RuntimeError(
            f"scratch: the rebuilt architecture (digest {digest}) differs from the grown one ({grown['arch']}, "
            f"stages {grown['stages']}); refusing to compare different networks."
        )


def _dirname(depth, seed: int, arm: str) -> str:
    return f"{'auto' if depth is None else f'd{depth}'}_s{seed}_{arm}"


# -- summary and files ----------------------------------------------------------------------------
def _arm_values(rows: dict[str, dict | None], arm: str) -> dict[str, Any] | None:
    row = rows.get(arm)
    if row is None:
        return None
    values = {
        "train_loss": row["train"].get("loss"),
        "test_loss": row["test"].get("loss"),
        "test_acc": row["test"].get("acc"),
        "epochs": row["epochs"],
        "wall_s": row["wall_s"],
        "flops": row["flops"],
    }
    base = rows.get("base")
    if arm == "growth" and base is not None:  # growth inherits the base network's training
        for k in ("epochs", "wall_s", "flops"):
            values[k] += base[k]
    return values


def _summarise(depth, label, per_seed: list[dict], arms, depth_kwarg) -> dict:
    growth_rows = [rows["growth"] for rows in per_seed]
    blocks = sorted({r["blocks"] for r in growth_rows})
    row: dict[str, Any] = {
        "depth": depth,
        "depth_kwarg": depth_kwarg,
        "label": label or (f"{depth_kwarg}={depth}" if depth is not None else "grown until saturated"),
        "blocks": blocks[0] if len(blocks) == 1 else "/".join(map(str, blocks)),
        "n": len(per_seed),
        "sites": [((r.get("insertion") or {}).get("site")) or [g["site"] for g in r["growth_log"]] for r in growth_rows],
    }
    for arm in arms:
        values = [_arm_values(rows, arm) for rows in per_seed]
        for metric in ("train_loss", "test_loss", "test_acc", "epochs", "wall_s", "flops"):
            mean, std, _ = mean_std(v[metric] for v in values if v is not None)
            row[f"{arm}_{metric}"], row[f"{arm}_{metric}_std"] = mean, std
    return row


def _write(result: CompareResult, **options) -> None:
    out = result.output_dir
    (out / "compare.md").write_text(
        "# Growth vs Scratch\n\n" + result.markdown() + "\nmean ± std over seeds; compute columns: "
        + " / ".join(result.arms) + " (growth includes its base training).\n"
    )
    fields = list(result.summary[0]) if result.summary else []
    with open(out / "compare.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields)
        writer.writeheader()
        for row in result.summary:
            writer.writerow({k: (json.dumps(v) if isinstance(v, (list, dict)) else v) for k, v in row.items()})
    (out / "compare.json").write_text(
        json.dumps({"options": options, "summary": result.summary, "runs": result.runs}, indent=1, default=str)
    )
    result.files = {k: out / f"compare.{k}" for k in ("md", "csv", "json")}
