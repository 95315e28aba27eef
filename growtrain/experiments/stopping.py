"""Does growth stop where depth stops paying? Growth runs beside a from-scratch depth sweep.

One config gives the trainer (with a configured ``GrowUntilSaturated``), the model at its start
depth and the data. For every seed:

* **growth**: the configured callback grows the model from its start depth until it certifies
  saturation (or hits a budget), then ``on_saturated`` finishes the run (``"anneal"``: a cosine
  anneal of the final network);
* **scratch**: every depth of the sweep (``depths``, values of the depth hyper-parameter, e.g.
  ``added``) is trained from random initialisation under the *same* stopping rule as the growth
  run's final stage: the configured callback with ``max_growths=0`` — constant learning rate
  until its schedule's ``monitor`` plateaus (the shipped config's ``Converged`` watches ``val_loss``;
  the same ``patience``/``min_rel_delta``/``min_stage_epochs``), then the same anneal. No probe is spent on scratch
  runs. Each training keeps its epoch checkpoints in its own folder under ``output_dir``
  (``growth_<decision>_seed<S>/``, ``scratch_<depth kwarg><value>_seed<S>/``).

Reported: per depth the scratch test loss (mean ± sd over seeds); ``d*`` = the smallest depth
whose mean test loss is within one standard error of the best depth's; per growth seed the found
depth, why it stopped, test loss and compute (FLOPs, wall time) beside scratch at ``d*`` and the
whole sweep's cost. Rows are resumable (``runs.jsonl``): rerunning the same command skips done
rows. ``stopping.png`` draws the sweep's test loss against depth with the found depths marked,
and each growth seed's certified gain per check (with ``min_gain``).
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

from lightning.pytorch import LightningDataModule, LightningModule, seed_everything

from growtrain.callbacks import ComputeMeter, GrowUntilSaturated, growth_callbacks
from growtrain.callbacks.growth_config import GrowthConfig
from growtrain.experiments._training import evaluate, sibling_trainer
from growtrain.experiments.growers import grower_from
from growtrain.experiments.runs import (
    ModuleFactory, RunLog, check_rebuildable, depth_offset, fingerprint, fmt, growable_of, markdown_table,
    mean_std, module_at_depth, parse_depths, prepare, resolve_depth_kwarg, rich_table,
)  # fmt: skip
from growtrain.plots import outcome
from growtrain.trial import DEFAULT_TRIAL_EPOCHS

__all__ = ["StoppingResult", "run_stopping", "smallest_good_depth", "stopped_by"]

# GrowUntilSaturated options that change only the growth decision, not a scratch run (a scratch run
# never grows, so what happens to the learning rate around a growth, lr_schedule, does not touch it).
DECISION_OPTIONS = ("rule", "alpha", "delta", "t", "max_growths", "seed", "lr_schedule", "min_gain",
                    "decision", "trial_epochs")  # fmt: skip
# Options added after folders of results were written, with their default: left out of the file's
# fingerprint while at it, so those folders resume (min_steps_between_checks: 2026-12-03, commit 22a9790).
NEW_OPTIONS = {"min_steps_between_checks": None, "insertion": "zero"}
# The fields of the schedule the callback does not have, as the flat options every folder was keyed by
# before the options were grouped into the schedule and decision parts (their defaults then).
# (max_params, an option then, keys every folder as None: the folders written with it resume.)
FLAT_DEFAULTS = {"monitor": "train_loss", "mode": "min", "patience": 3, "min_rel_delta": 0.01, "min_stage_epochs": 2,
                 "every_n_epochs": 1, "min_steps_between_checks": None, "max_params": None}  # fmt: skip


def smallest_good_depth(by_depth: dict[int, list[float]]) -> tuple[int, int]:
    """``(d*, best)``: the depth with the lowest mean test loss, and the smallest depth whose mean
    is within one standard error (of the best depth's mean) of it."""
    means = {d: sum(v) / len(v) for d, v in by_depth.items() if v}
    best = min(means, key=means.get)
    values = by_depth[best]
    if len(values) > 1:
        mu = means[best]
        se = math.sqrt(sum((v - mu) ** 2 for v in values) / (len(values) - 1)) / math.sqrt(len(values))
    else:
        se = 0.0
    return min(d for d, m in means.items() if m <= means[best] + se), best


def stopped_by(row: dict) -> str:
    """Why a growth row's run stopped growing, in words that claim no more than its last check certified
    (``plots.outcome`` of that check: "certified saturation" only where its verdict was certified, else
    "no certified gain"; "budget"), or that its fit ended first."""
    if not row.get("stopped"):
        return "not ended (the fit ended first: no verdict)"
    history = row.get("history") or []
    last = history[-1] if history and history[-1].get("action") == row["stopped"] else {"action": row["stopped"]}
    return outcome(last)  # a row without its stop's record (an older runs.jsonl) claims no certification


@dataclass
class StoppingResult:
    scratch: list[dict]
    growth: list[dict]
    depth_kwarg: str
    d_star: int | None = None
    best_depth: int | None = None
    output_dir: Path | None = None
    files: dict[str, Path] = field(default_factory=dict)
    table1: object | None = None  # a CompareResult when Table 1 was asked for (``table``)

    def summary(self) -> dict:
        by_depth: dict[int, list[dict]] = {}
        for r in self.scratch:
            by_depth.setdefault(r["depth"], []).append(r)
        sweep_flops = {}
        for r in self.scratch:
            sweep_flops[r["seed"]] = sweep_flops.get(r["seed"], 0.0) + (r.get("flops") or 0.0)
        at_star = [r["test_loss"] for r in by_depth.get(self.d_star, [])]
        growth = []
        for g in self.growth:
            total = sweep_flops.get(g["seed"])
            growth.append({**g, "compute_vs_sweep": (g["flops"] / total) if total else None,
                           "within_one_block": None if self.d_star is None else abs(g["depth"] - self.d_star) <= 1})  # fmt: skip
        return {
            "depth_kwarg": self.depth_kwarg, "d_star": self.d_star, "best_depth": self.best_depth,
            "scratch_at_d_star": mean_std(at_star),
            "by_depth": {d: {"test_loss": mean_std([r["test_loss"] for r in rows]),
                             "train_loss": mean_std([r["train_loss"] for r in rows]),
                             "epochs": mean_std([r["epochs"] for r in rows]),
                             "flops": mean_std([r["flops"] for r in rows])} for d, rows in sorted(by_depth.items())},
            "growth": growth,
        }  # fmt: skip

    def _cells(self):
        s = self.summary()
        header = [self.depth_kwarg, "seeds", "scratch test loss", "train loss", "epochs", "GFLOPs"]
        rows = []
        for d, v in s["by_depth"].items():
            t, tr, ep, fl = v["test_loss"], v["train_loss"], v["epochs"], v["flops"]
            mark = " (d*)" if d == s["d_star"] else ""
            rows.append([f"{d}{mark}", str(t[2]), f"{fmt(t[0])} ± {fmt(t[1])}", fmt(tr[0]), fmt(ep[0], 3),
                         fmt((fl[0] or 0) / 1e9, 3)])  # fmt: skip
        for g in s["growth"]:
            found = f"growth → {g['depth']}" if g.get("stopped") else f"growth (not ended) at {g['depth']}"
            rows.append([found, f"seed {g['seed']}", fmt(g["test_loss"]), fmt(g["train_loss"]),
                         str(g["epochs"]), f"{fmt(g['flops'] / 1e9, 3)} ({fmt(g['compute_vs_sweep'], 2)}× sweep)"])  # fmt: skip
        return header, rows

    def table(self):
        reasons = "; ".join(f"seed {g['seed']}: {stopped_by(g)}" for g in self.growth)
        return rich_table(*self._cells(), title="Growth until saturated vs a from-scratch depth sweep",
                          caption=f"d* = {self.d_star} (best {self.best_depth}); growth stopped by: {reasons}",
                          left_columns=1)  # fmt: skip

    def markdown(self) -> str:
        return markdown_table(*self._cells())

    def __rich__(self):
        return self.table()


def flat_options(config: GrowthConfig) -> dict:
    """The callback's options as the flat names results folders are keyed by (the form they had before
    the options were grouped): the schedule and decision by name, their fields beside them (``min_gain``
    ``None`` for the rule alone, ``trial_epochs`` the trial's budget, the default elsewhere)."""
    options = {k: v for k, v in vars(config).items() if k not in ("probe", "network", "loss_fn", "verbose")}
    when, what = options.pop("schedule"), options.pop("decision")
    # the fields of the schedule in force (every_n_epochs was 1, never None, beside min_steps_between_checks)
    options |= FLAT_DEFAULTS | {k: v for k, v in vars(when).items() if v is not None}
    options |= {"schedule": when.kind, "decision": what.name, "min_gain": getattr(what, "min_gain", None),
                "trial_epochs": getattr(what, "epochs", DEFAULT_TRIAL_EPOCHS)}  # fmt: skip
    return options


def file_options(config: GrowthConfig) -> dict:
    """The callback's options that key a results folder (its fingerprint, with the decision's split
    off by the caller), flat (``flat_options``). An option added later keys it only when set
    (``NEW_OPTIONS``), so folders written before it was added still resume."""
    options = flat_options(config)
    for name, default in NEW_OPTIONS.items():
        if options.get(name) == default:
            options.pop(name)
    return options


def _scratch_grower(grow: GrowUntilSaturated) -> GrowUntilSaturated:
    """The growth run's final-stage stopping rule with no growth: the same options, ``max_growths=0``."""
    return grower_from(grow, max_growths=0, verbose=False)


def _seeded_grower(grow: GrowUntilSaturated, seed: int) -> GrowUntilSaturated:
    """The configured growth callback with candidate and trial blocks seeded by ``seed``."""
    return grower_from(grow, seed=seed)


def run_stopping(
    model: LightningModule,
    datamodule: LightningDataModule,
    *,
    trainer_kwargs: dict | None = None,
    depths: str | Sequence[int] = "0..7",
    seeds: Sequence[int] = (0, 1, 2),
    depth_kwarg: str | None = None,
    output_dir: str | Path = "stopping",
    resume: bool = True,
    module_factory: ModuleFactory | None = None,
    skip_scratch: bool = False,
    skip_growth: bool = False,
    train: bool = True,
    table: str | Sequence[int] | None = None,
    compute_matched: bool = True,
    table_controls: bool = False,
) -> StoppingResult:
    """Growth runs and a scratch sweep under one stopping rule; writes stopping.json/.md/.png.

    ``train=False`` trains nothing: it summarises the rows already in ``runs.jsonl`` (e.g. while
    other processes are still filling it). ``table`` (values ``N`` of the depth hyper-parameter)
    adds the paper's Table 1 built on the sweep's networks (``growtrain.experiments.sweep_table``;
    ``compute_matched``: with the compute-matched arm; ``table_controls``: with the base retrained
    without a block), written to table1.md/.csv/.json."""
    values = parse_depths(depths)
    name = resolve_depth_kwarg(model, depth_kwarg)
    rows = parse_depths(table) if table is not None else []
    missing = sorted({v for n in rows for v in (n - 1, n)} - set(values))
    if rows and (min(rows) < 1 or missing):
        raise ValueError(
            f"table: row N needs the sweep's networks at {name}=N-1 and N (its base and its scratch arm), so the "
            f"rows {rows} need depths {sorted({v for n in rows for v in (n - 1, n)})}; depths={depths!r} lacks "
            f"{missing}. Fix: e.g. --depths={min(rows) - 1}..{max(rows)} (rows must be ≥ 1)."
        )
    prepare(datamodule, "stopping")
    check_rebuildable(model, module_factory)
    kwargs = dict(trainer_kwargs or {})
    configured = growth_callbacks(kwargs.get("callbacks"))
    if len(configured) != 1:
        raise ValueError(
            f"trainer.callbacks: the stopping experiment needs exactly one GrowUntilSaturated (the growth run's "
            f"decision and its final-stage stopping rule), found {len(configured)}. Fix: add one under "
            "trainer.callbacks in the config."
        )
    grow = configured[0]
    if grow.on_saturated == "stop":
        raise ValueError(
            "on_saturated: 'stop' ends the growth run unannealed, while the scratch runs finish their stage; "
            "the comparison needs the same final stage for both. Fix: on_saturated: anneal (or continue)."
        )
    start = int(dict(model.hparams).get(name, 0))
    out = Path(output_dir)
    out.mkdir(parents=True, exist_ok=True)
    options = file_options(grow.config)
    # The file's fingerprint holds what every row shares (model, data, trainer, the stopping rule);
    # the decision's options (rule, τ, α, …) key the growth rows only, so a τ control reuses the sweep.
    decision = {k: options.pop(k) for k in DECISION_OPTIONS}
    fp = fingerprint(
        {k: v for k, v in dict(model.hparams).items() if not k.startswith("_")},
        dict(getattr(datamodule, "hparams", {}) or {}),
        {k: v for k, v in kwargs.items() if k not in ("default_root_dir", "logger", "enable_progress_bar", "callbacks")},
        options, {"depth_kwarg": name},
    )  # fmt: skip
    log = RunLog(out / "runs.jsonl", fp, resume)
    decision_key = fingerprint(decision)
    others = lambda cb: cb not in configured  # noqa: E731

    def row(key: str, value: int, seed: int, directory: str, grower: Callable[[], GrowUntilSaturated]) -> dict | None:
        """The logged row, else (with ``train``) one training of depth ``value``, logged."""
        done = log.get(key)
        if done is not None or not train:
            return done
        seed_everything(seed, workers=True, verbose=False)
        module = module_at_depth(model, value, name, module_factory)
        return log.add(key, _train(module, datamodule, kwargs, out / directory, others, grower(), name,
                                   depth_offset(model, name), seed))  # fmt: skip

    # the directory is keyed by the decision too: a cut run resumes from its own epoch checkpoint,
    # never from another decision's
    growth_rows = [row(f"growth/{decision_key}/seed={seed}", start, seed, f"growth_{decision_key}_seed{seed}",
                       lambda seed=seed: _seeded_grower(grow, seed)) for seed in (seeds if not skip_growth else ())]  # fmt: skip
    scratch_rows = [row(f"scratch/{name}={value}/seed={seed}", value, seed, f"scratch_{name}{value}_seed{seed}",
                        lambda: _scratch_grower(grow))
                    for seed in (seeds if not skip_scratch else ()) for value in values]  # fmt: skip
    growth_rows = [r for r in growth_rows if r is not None]
    scratch_rows = [r for r in scratch_rows if r is not None]
    result = StoppingResult(scratch=scratch_rows, growth=growth_rows, depth_kwarg=name, output_dir=out)
    if scratch_rows:
        by_depth: dict[int, list[float]] = {}
        for r in scratch_rows:
            by_depth.setdefault(r["depth"], []).append(r["test_loss"])
        result.d_star, result.best_depth = smallest_good_depth(by_depth)
    if rows:
        from growtrain.experiments.sweep_table import table_arms

        train_fn = lambda module, root, grower, seed, extra=(): _train(  # noqa: E731
            module, datamodule, kwargs, root, others, grower, name, depth_offset(model, name), seed, extra)
        result.table1 = table_arms(
            model=model, datamodule=datamodule, kwargs=kwargs, log=log, out=out, name=name, rows=rows, seeds=seeds,
            keep=others, grower=lambda: _scratch_grower(grow), train_fn=train_fn,
            anneal_epochs=grow.schedule.anneal_epochs,
            compute_matched=compute_matched, controls=table_controls, train=train, factory=module_factory,
        )  # fmt: skip
        result.files.update({f"table1.{k}": v for k, v in result.table1.files.items()})
    (out / "stopping.json").write_text(json.dumps({"summary": result.summary(), "growth": growth_rows,
                                                   "scratch": scratch_rows}, indent=1, default=str))  # fmt: skip
    (out / "stopping.md").write_text("# Growth until saturated vs a from-scratch sweep\n\n" + result.markdown())
    from growtrain.plots import plot_stopping

    plot_stopping(result.summary(), growth_rows, out / "stopping.png")
    result.files.update({k: out / f"stopping.{k}" for k in ("json", "md", "png")})
    return result


def _train(module, datamodule, kwargs, root: Path, keep, grower: GrowUntilSaturated, name: str, offset: int,
           seed: int, extra=()) -> dict:  # fmt: skip
    meter = ComputeMeter()
    trainer = sibling_trainer(kwargs, root, keep=keep, extra_callbacks=[meter, grower, *extra])
    # A training cut short (a killed process) resumes from its last epoch checkpoint: the growth
    # callback, the compute meter and the optimizer are in it, so the row is the one an
    # uninterrupted run writes (its wall_s counts the resumed part only).
    last = sorted((root / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(last[-1]) if last else None)
    wall = time.perf_counter() - start
    network = growable_of(module)
    blocks = network.depth()
    return {
        "seed": seed, "depth": blocks - offset, "blocks": blocks,
        "train_loss": evaluate(module, datamodule, "train", kwargs, root / "eval").get("loss"),
        "test_loss": evaluate(module, datamodule, "test", kwargs, root / "eval").get("loss"),
        "epochs": trainer.current_epoch, "steps": meter.steps, "flops": meter.flops, "wall_s": wall,
        "probe_s": grower.check_seconds, "checkpoint": _saved(trainer, root),
        "stopped": grower.finished, "stop_reason": grower.stop_reason, "growths": grower.growths,
        "history": [{k: h.get(k) for k in ("epoch", "depth_before", "action", "certified", "site", "lower", "margin",
                                            "gamma", "threshold", "verdicts")}
                    for h in grower.history],
        "params": sum(p.numel() for p in module.parameters()),
    }  # fmt: skip


def _saved(trainer, root: Path) -> str:
    """The final network's checkpoint (Table 1 on the sweep loads it as a base): saved here at
    the end of the fit, so it is the network the row measured, whatever ModelCheckpoint kept."""
    path = root / "final.ckpt"
    trainer.save_checkpoint(path)
    return str(path)
