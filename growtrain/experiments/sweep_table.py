"""The paper's Table 1 on a depth sweep's own networks: one convergence rule for both.

``growtrain stopping --table=1..4`` turns the stopping experiment's scratch sweep into Table 1.
Row ``N`` (final depth hyper-parameter ``N``, e.g. ``added=N``: ResNet-8 + N blocks), per seed:

* **base** — the sweep's converged network at ``N−1`` (its row, its checkpoint: not retrained);
* **growth** — that network with ONE zero-output block inserted where the depth hyper-parameter's
  cyclic rule puts it (so the architecture is the sweep's ``N`` network, checked by module tree),
  then trained again to convergence: a new fit (fresh optimizer state, the constant rate again);
* **scratch** — the sweep's converged network at ``N`` (its row);
* **matched** — the ``N`` network from the same random initialisation as scratch, trained for
  growth's *total* FLOPs (base + growth) with the same schedule shape: the constant rate, then
  the stopping rule's cosine anneal over its last ``anneal_epochs`` epochs;
* **control** (``table_controls``) — the base retrained under the same rule with NO block: the
  growth arm's second stage of training is worth something by itself (a warm restart), so the
  block's own value is growth − control, reported per row beside the growth's gain over its base.

**One notion of "trained to convergence"** for the sweep and the table: the configured
``GrowUntilSaturated`` with ``max_growths=0`` — the constant rate until the held-out validation
loss stops improving (``patience``, ``min_rel_delta``, ``min_stage_epochs``), then the cosine
anneal. Why it, and not compare's train-loss plateau: on the full data a width-8 network does not
interpolate, and at a constant rate its training loss keeps creeping down for tens of epochs
(docs/decision.md), so a train-loss plateau is either never reached or reached at an arbitrary
point; the validation loss levels off within ~10 epochs and never selects weights (the last
epoch is the network, whatever the validation loss says). The same rule trained every sweep
network, so the base and scratch arms are the sweep's checkpoints, trained once.

**Test loss at equal training loss**, per seed: target = the larger of the two arms' final
training losses (re-measured in eval mode on the training split); the arm that ends there is
taken at its end, the other at its first *annealed* epoch whose re-measured training loss is at
or below the target (the growth arm keeps its weights of every epoch for this). The sweep keeps
only its final networks, so where scratch is the arm that ends lower, its entry is missing and
says so.

Every finished training and lookup is a row of the sweep's ``runs.jsonl`` (keys ``table/…``);
a rerun trains only what is missing, and a training cut short resumes from its last epoch
checkpoint.
"""

from __future__ import annotations

import hashlib
import math
import time
from pathlib import Path
from typing import Callable, Sequence

import torch
from lightning.pytorch import Callback, LightningDataModule, LightningModule, seed_everything

from growtrain.callbacks import ComputeMeter
from growtrain.experiments._training import evaluate, sibling_trainer
from growtrain.experiments.compare import _cyclic_stage
from growtrain.experiments.compare_table import CompareResult, summarise, write_files
from growtrain.experiments.runs import (
    RunLog, architecture_digest, growable_of, load_checkpoint_into, module_at_depth, stage_sizes,
)  # fmt: skip

__all__ = ["BudgetAnneal", "EpochWeights", "table_arms", "anneal_factor", "checkpoint_of", "weights_digest"]

# a checkpoint must reproduce its row's test loss to this (float32 sums over 10k samples: ~1e-7)
_SAME_NETWORK_TOL = 1e-4


def anneal_factor(k: int, anneal_epochs: int) -> float:
    """The stopping rule's anneal: the rate in epoch ``k`` (0-based) of ``anneal_epochs`` is the
    constant rate times ``½(1 + cos(π·(k+1)/(T+1)))`` (``growtrain.callbacks.anneal``)."""
    return 0.5 * (1.0 + math.cos(math.pi * (k + 1) / (anneal_epochs + 1)))


class BudgetAnneal(Callback):
    """The compute-matched arm's schedule: the constant rate, then the stopping rule's cosine
    anneal over the last ``anneal_epochs`` epochs of a budget of ``total_steps`` optimizer steps
    (``steps_per_epoch`` each; the last epoch may be cut by ``max_steps``)."""

    def __init__(self, total_steps: int, steps_per_epoch: int, anneal_epochs: int) -> None:
        for name, value in (("total_steps", total_steps), ("steps_per_epoch", steps_per_epoch),
                            ("anneal_epochs", anneal_epochs)):  # fmt: skip
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"BudgetAnneal.{name}: expected an integer ≥ 1, got {value!r}")
        self.total_steps, self.steps_per_epoch, self.anneal_epochs = total_steps, steps_per_epoch, anneal_epochs
        self.epochs = math.ceil(total_steps / steps_per_epoch)
        self.base_lrs: list[float] = []  # the constant rates, kept in the checkpoint (a resumed fit
        # finds the optimizer mid-anneal)
        self.lrs: list[float] = []  # the first group's rate in each epoch, for the record

    def factor(self, epoch: int) -> float:
        k = epoch - (self.epochs - self.anneal_epochs)
        return 1.0 if k < 0 else anneal_factor(k, self.anneal_epochs)

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        optimizer = trainer.optimizers[0]
        if not self.base_lrs:
            self.base_lrs = [float(g["lr"]) for g in optimizer.param_groups]
        for group, base in zip(optimizer.param_groups, self.base_lrs):
            group["lr"] = base * self.factor(trainer.current_epoch)
        self.lrs = self.lrs[: trainer.current_epoch] + [float(optimizer.param_groups[0]["lr"])]

    def state_dict(self) -> dict:
        return {"base_lrs": list(self.base_lrs), "lrs": list(self.lrs)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.base_lrs = [float(x) for x in state_dict.get("base_lrs", [])]
        self.lrs = [float(x) for x in state_dict.get("lrs", [])]


class EpochWeights(Callback):
    """Keeps the network's weights after every training epoch, with the rate it trained at
    (for the test loss at equal training loss). Records survive a resumed fit."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.records: list[dict] = []
        self._lr: float | None = None

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        self._lr = float(trainer.optimizers[0].param_groups[0]["lr"])  # after the rule set this epoch's rate

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"epoch{trainer.current_epoch}.pt"
        torch.save({k: v.detach().cpu() if torch.is_tensor(v) else v for k, v in pl_module.state_dict().items()}, path)
        self.records = [r for r in self.records if r["epoch"] != trainer.current_epoch]
        self.records.append({"epoch": trainer.current_epoch, "lr": self._lr, "weights": str(path)})

    def state_dict(self) -> dict:
        return {"records": list(self.records)}

    def load_state_dict(self, state_dict: dict) -> None:
        self.records = list(state_dict.get("records", []))


def weights_digest(module: torch.nn.Module) -> str:
    """A digest of the module's parameters and buffers (which initialisation it starts from)."""
    h = hashlib.sha1()
    for key, value in module.state_dict().items():
        # a module's extra state (a growable network's growth record, a uint8 tensor): not weights
        if key.endswith("_extra_state") or not torch.is_tensor(value):
            continue
        h.update(key.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def checkpoint_of(row: dict, out: Path, directory: str) -> Path:
    """A sweep row's final network: the checkpoint it recorded, else the newest epoch
    checkpoint of its finished training (rows from before ``final.ckpt`` was written)."""
    if row.get("checkpoint") and Path(row["checkpoint"]).is_file():
        return Path(row["checkpoint"])
    found = sorted((out / directory / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    if not found:
        raise FileNotFoundError(
            f"table: the sweep row {row['key']!r} has no checkpoint (looked for {row.get('checkpoint')!r} and "
            f"{out / directory / 'checkpoints'}/*.ckpt). Fix: put the row's final checkpoint there, or retrain the row "
            "(remove it from runs.jsonl)."
        )
    return found[-1]


def table_arms(
    *, model: LightningModule, datamodule: LightningDataModule, kwargs: dict, log: RunLog, out: Path, name: str,
    rows: Sequence[int], seeds: Sequence[int], keep: Callable, grower: Callable, train_fn: Callable,
    anneal_epochs: int, compute_matched: bool = True, controls: bool = False, train: bool = True, factory=None,
) -> CompareResult:  # fmt: skip
    """Table 1's arms for every row and seed on top of the sweep rows in ``log`` (see the module
    docstring); trains what is missing (``train``), summarises what exists."""
    summary, runs, lookups = [], [], []
    arms = ("scratch", "growth", "matched") if compute_matched else ("scratch", "growth")
    for n in rows:
        per_seed = []
        for seed in seeds:
            sweep = {v: log.get(f"scratch/{name}={v}/seed={seed}") for v in (n - 1, n)}
            if any(r is None for r in sweep.values()):
                continue  # the sweep has not trained this seed's rows yet: nothing to build on
            base, scratch = (_checked(log, model, datamodule, kwargs, out, name, v, seed, sweep[v], factory)
                             for v in (n - 1, n))  # fmt: skip
            growth = log.get(f"table/growth/{name}={n}/seed={seed}")
            if growth is None and train:
                growth = _growth_arm(model, datamodule, kwargs, log, out, name, n, seed, base, scratch, grower,
                                     train_fn, factory)  # fmt: skip
            if growth is None:
                continue
            matched = log.get(f"table/matched/{name}={n}/seed={seed}")
            if compute_matched and matched is None and train:
                matched = _matched_arm(model, datamodule, kwargs, log, out, name, n, seed, base, growth, keep,
                                       anneal_epochs, factory)  # fmt: skip
            control = log.get(f"table/control/{name}={n - 1}/seed={seed}")
            if controls and control is None and train:
                control = _control_arm(model, datamodule, kwargs, log, out, name, n - 1, seed, base, train_fn, grower,
                                       factory)  # fmt: skip
            equal = log.get(f"table/equal/{name}={n}/seed={seed}")
            if equal is None:
                equal = _equal(model, datamodule, kwargs, log, out, name, n, seed, growth, scratch, factory)
            per_seed.append({"base": base, "growth": growth, "scratch": scratch, "matched": matched, "equal": equal,
                             "control": control})  # fmt: skip
            runs += [{**r, "arm": a, "depth": n - (a == "base")} for a, r in per_seed[-1].items()
                     if r is not None and a not in ("equal", "control")]  # fmt: skip
            lookups.append(equal)
        if per_seed:
            row_arms = arms if all(s["matched"] is not None for s in per_seed) or not compute_matched else ("scratch", "growth")
            summary.append(summarise(n, f"ResNet-8 + {n}" if name == "added" else None, per_seed, row_arms, name))
            summary[-1].update(_block_value(per_seed))
    result = CompareResult(summary=summary, runs=runs, lookups=lookups, output_dir=out, arms=arms)
    if summary:
        result.extra_markdown = _block_value_markdown(summary)
        write_files(result, stem="table1", seeds=list(seeds), depths=list(rows), depth_kwarg=name, insert_at="cyclic",
                    stopping="the sweep's rule (GrowUntilSaturated, max_growths=0)")  # fmt: skip
    return result


# -- the arms ---------------------------------------------------------------------------------
def _checked(log, model, datamodule, kwargs, out, name, value, seed, row, factory) -> dict:
    """The sweep row as an arm (compare's format), its network loaded from its checkpoint and
    re-measured: a checkpoint that is not the row's network (test loss differs) is refused."""
    key = f"table/eval/{name}={value}/seed={seed}"
    done = log.get(key)
    if done is not None:
        return done
    path = checkpoint_of(row, out, f"scratch_{name}{value}_seed{seed}")
    with torch.random.fork_rng(devices=[]):
        module = load_checkpoint_into(module_at_depth(model, value, name, factory), path)
    root = out / "table_eval"
    train, test = (evaluate(module, datamodule, s, kwargs, root) for s in ("train", "test"))
    if abs(test["loss"] - row["test_loss"]) > _SAME_NETWORK_TOL:
        raise RuntimeError(
            f"table: checkpoint {path} is not the network of sweep row {row['key']!r}: its test loss is "
            f"{test['loss']:.6f}, the row's {row['test_loss']:.6f}. Fix: put that row's final checkpoint there."
        )
    network = growable_of(module)
    return log.add(key, {
        "seed": seed, "depth": value, "checkpoint": str(path), "train": train, "test": test,
        "epochs": row["epochs"], "flops": row["flops"], "wall_s": row["wall_s"], "steps": row.get("steps"),
        "stop": row.get("stopped"), "capped": row.get("stopped") is None,  # the epoch cap ended it, not the rule
        "blocks": network.depth(), "stages": stage_sizes(network), "arch": architecture_digest(module),
    })  # fmt: skip


def _growth_arm(model, datamodule, kwargs, log, out, name, n, seed, base, scratch, grower, train_fn,
                factory) -> dict:  # fmt: skip
    seed_everything(seed, workers=True, verbose=False)
    module = load_checkpoint_into(module_at_depth(model, n - 1, name, factory), base["checkpoint"])
    network = growable_of(module)
    with torch.random.fork_rng(devices=[]):
        target = stage_sizes(growable_of(module_at_depth(model, n, name, factory)))
    stage = _cyclic_stage(stage_sizes(network), target)
    site = f"{stage}.{len(network.stage(stage))}"
    network.grow(site)  # zero-output: the loaded network's function is unchanged
    if architecture_digest(module) != scratch["arch"]:
        raise RuntimeError(f"table: {name}={n - 1} grown at {site} is not the sweep's {name}={n} network "
                           f"(architecture {architecture_digest(module)} ≠ {scratch['arch']}); refusing to compare.")  # fmt: skip
    directory = f"table_growth_{name}{n}_seed{seed}"
    weights = EpochWeights(out / directory / "epochs")
    row = train_fn(module, out / directory, grower(), seed, extra=[weights])
    row.update({"insertion": {"site": site, "rule": "cyclic"}, "epoch_weights": weights.records,
                "train": {"loss": row["train_loss"]},  # measured by train_fn; the accuracy is the test split's
                "test": evaluate(module, datamodule, "test", kwargs, out / directory / "eval"),
                "stop": row.get("stopped"), "capped": row.get("stopped") is None, "arch": architecture_digest(module),
                "stages": stage_sizes(network)})  # fmt: skip
    return log.add(f"table/growth/{name}={n}/seed={seed}", row)


def _matched_arm(model, datamodule, kwargs, log, out, name, n, seed, base, growth, keep, anneal_epochs,
                 factory) -> dict:  # fmt: skip
    budget = float(base["flops"]) + float(growth["flops"])
    per_step = float(growth["flops"]) / max(int(growth["steps"]), 1)  # same architecture, same batch size
    steps = max(1, round(budget / per_step))
    steps_per_epoch = len(datamodule.train_dataloader())
    seed_everything(seed, workers=True, verbose=False)  # the sweep's init of this network (its scratch row)
    module = module_at_depth(model, n, name, factory)
    init = weights_digest(module)
    root = out / f"table_matched_{name}{n}_seed{seed}"
    meter = ComputeMeter()
    schedule = BudgetAnneal(steps, steps_per_epoch, anneal_epochs)
    trainer = sibling_trainer(kwargs, root, keep=keep, extra_callbacks=[meter, schedule], max_steps=steps,
                              max_epochs=-1)  # fmt: skip
    last = sorted((root / "checkpoints").glob("*.ckpt"), key=lambda p: p.stat().st_mtime)
    start = time.perf_counter()
    trainer.fit(module, datamodule=datamodule, ckpt_path=str(last[-1]) if last else None)
    wall = time.perf_counter() - start
    network = growable_of(module)
    return log.add(f"table/matched/{name}={n}/seed={seed}", {
        "seed": seed, "depth": n, "init_digest": init, "budget_flops": budget, "budget_steps": steps, "steps": meter.steps,
        "flops": meter.flops, "epochs": trainer.current_epoch, "wall_s": wall, "stop": "budget", "capped": False,
        "lrs": schedule.lrs,
        "train": evaluate(module, datamodule, "train", kwargs, root / "eval"),
        "test": evaluate(module, datamodule, "test", kwargs, root / "eval"),
        "blocks": network.depth(), "stages": stage_sizes(network), "arch": architecture_digest(module),
    })  # fmt: skip


def _control_arm(model, datamodule, kwargs, log, out, name, value, seed, base, train_fn, grower, factory) -> dict:
    """The base network retrained under the same rule WITHOUT a block: what the growth arm's
    extra stage of training alone is worth (growth − control = the block's own value)."""
    seed_everything(seed, workers=True, verbose=False)
    module = load_checkpoint_into(module_at_depth(model, value, name, factory), base["checkpoint"])
    directory = f"table_control_{name}{value}_seed{seed}"
    row = train_fn(module, out / directory, grower(), seed)
    row.update({"train": {"loss": row["train_loss"]},
                "test": evaluate(module, datamodule, "test", kwargs, out / directory / "eval")})  # fmt: skip
    return log.add(f"table/control/{name}={value}/seed={seed}", row)


def _block_value(per_seed: list[dict]) -> dict:
    """Test-loss gains over the base, per row: growth's, the retrained base's (control) and the
    block's own (growth − control), paired over the seeds that have them."""
    from growtrain.experiments.paired import paired_difference

    test = lambda r: None if r is None else r["test"]["loss"]  # noqa: E731
    base = [test(s["base"]) for s in per_seed]
    growth = [test(s["growth"]) for s in per_seed]
    control = [test(s.get("control")) for s in per_seed]
    return {"gain_growth": paired_difference(base, growth), "gain_control": paired_difference(base, control),
            "gain_block": paired_difference(control, growth),
            "base_test_loss": [b for b in base if b is not None]}  # fmt: skip


def _block_value_markdown(summary: list[dict]) -> str:
    from growtrain.experiments.compare_table import fmt_diff

    lines = ["| Model | base test loss (mean) | gain of growth: base − growth [95% CI] | gain of retraining the base "
             "alone: base − control | the block's own: control − growth |", "|---|---|---|---|---|"]
    for row in summary:
        bases = row.get("base_test_loss") or []
        mean = sum(bases) / len(bases) if bases else None
        lines.append(f"| {row['label']} | {'—' if mean is None else f'{mean:.4f}'} | {fmt_diff(row['gain_growth'])} | "
                     f"{fmt_diff(row['gain_control'])} | {fmt_diff(row['gain_block'])} |")
    return "\n".join(lines) + "\n"


def _equal(model, datamodule, kwargs, log, out, name, n, seed, growth, scratch, factory) -> dict:
    """Each arm's test loss where both have reached the same training loss (module docstring)."""
    target = max(growth["train"]["loss"], scratch["train"]["loss"])
    row: dict = {"target": target, "seed": seed}
    final = lambda arm: {"epoch": arm["epochs"], "train": arm["train"], "test": arm["test"]}  # noqa: E731
    if scratch["train"]["loss"] >= growth["train"]["loss"]:
        row["scratch"] = final(scratch)
        records = growth.get("epoch_weights") or []
        top = max((r["lr"] for r in records), default=None)
        annealed = [r for r in records if top is not None and r["lr"] < top]
        row["growth"] = final(growth)  # its last epoch always qualifies
        root = out / "table_equal_eval"
        for r in annealed[:-1]:
            if not Path(r["weights"]).is_file():
                row["growth"]["reason"] = f"weights of epoch {r['epoch']} are gone ({r['weights']}); its end is used"
                break
            with torch.random.fork_rng(devices=[]):
                module = module_at_depth(model, n, name, factory)
            module.load_state_dict(torch.load(r["weights"], map_location="cpu", weights_only=True))
            train = evaluate(module, datamodule, "train", kwargs, root)
            if train["loss"] <= target:
                row["growth"] = {"epoch": r["epoch"] + 1, "train": train,
                                 "test": evaluate(module, datamodule, "test", kwargs, root)}  # fmt: skip
                break
    else:
        row["growth"] = final(growth)
        row["scratch"] = {"epoch": None, "train": None, "test": None,
                          "reason": "scratch ends below growth, and the sweep keeps only its final network"}  # fmt: skip
    return log.add(f"table/equal/{name}={n}/seed={seed}", row)
