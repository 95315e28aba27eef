"""``GrowUntilSaturated(schedule=Plan(...))``: grow at set points of a fit, as the language-model
growth methods do (``PlanRun`` is this schedule's part of the callback).

G_stack, MSG and Bu 2025 do not test whether depth pays; they grow at chosen times of a fixed token
budget and measure the result against scratch given the same compute. This schedule is that protocol
on growtrain's editor: at each point of ``Plan.at`` (fractions of the fit's optimizer steps, or steps)
it inserts ``blocks`` blocks at ``site``, gives them zero optimizer state in groups of their own,
continues the schedules, and starts them as the callback's ``insertion`` says (growtrain/insertion.py).
Every growth records whether it left the network's output unchanged, measured on the batch, not
assumed from the kind.

The whole plan is checked when the fit starts, before a step is trained: every point of ``at`` must
fall inside the fit, and every site it would grow at must be a candidate site of the network then.
It certifies nothing; docs/results.md's language-model section measures it against scratch for the
same FLOPs.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

import torch
from torch import nn

from growtrain import insertion as ins
from growtrain.callbacks.compute import _inputs
from growtrain.growable import grown_blocks

__all__ = ["PlanRun", "plan_growth", "schedule_sites"]

Placement = Literal["last", "first", "interleave", "cyclic"]


def schedule_sites(depth: int, n: int, site: str, stage: str = "h") -> list[str]:
    """Site names for ``n`` new blocks in a stage of ``depth`` blocks (one growth).

    ``"last"``/``"first"``: all at the top/bottom (``n`` names, inserted one after another);
    ``"interleave"``: one after each of ``n`` evenly spaced existing blocks (``n ≤ depth``), so
    ``n = depth`` doubles the stage as G_stack's and Bu's one-shot growths do.
    """
    if site == "last":
        return [f"{stage}.{depth + i}" for i in range(n)]
    if site == "first":
        return [f"{stage}.0"] * n
    if n > depth:
        raise ValueError(f"blocks: site='interleave' puts one block after each of {n} existing blocks, but the stage "
                         f"has {depth}; grow at most {depth} at once, or use site='last'")  # fmt: skip
    after = sorted({round((i + 1) * depth / n) for i in range(n)})  # 1-based: after block j
    return [f"{stage}.{j}" for j in after]


def plan_growth(stages: Sequence[str], lengths: Mapping[str, int], grown: int, n: int, site: str) -> list[list[str]]:
    """One growth of ``n`` blocks as the editor calls that make it: lists of site names, each list
    inserted at once (its names index the stage as it was before that call).

    ``stages``: the network's growable stages in order; ``lengths``: blocks per stage now; ``grown``:
    blocks the network has grown so far (``len(growth_log)``), which ``"cyclic"`` counts from.
    """
    if site == "cyclic":  # block k of the network's growth on top of stage k mod S, one editor call each
        picks = [stages[(grown + i) % len(stages)] for i in range(n)]
        return [[f"{st}.{lengths[st] + picks[:i].count(st)}"] for i, st in enumerate(picks)]
    stage = stages[-1]  # the last stage: a decoder has one
    sites = schedule_sites(lengths[stage], n, site, stage)
    # one editor call per block on top or at the bottom ("last", "first": each indexes the stage the previous one
    # grew); one call for "interleave"'s sites, which all index the stage as it was
    return [[s] for s in sites] if site in ("last", "first") else [sites]


class PlanRun:
    """The plan schedule's state and work inside ``GrowUntilSaturated`` (``cb``): the points in
    optimizer steps, the points reached, and the masks of blocks still ramping."""

    def __init__(self, cb: Any):
        self.cb = cb
        self._ramp = ins.MaskRamp(cb.schedule.ramp_steps)
        self._checked = False  # the plan checked against this fit (at its start)
        self.reset()

    def reset(self) -> None:
        self.steps: list[int] | None = None  # ``at`` in optimizer steps, fixed at the first fit start
        self.done = 0  # points of ``at`` reached
        self._ramps: list[dict] = []  # {"k": growth index, "start": step} of blocks still masked

    # -- checkpoint state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "done": self.done, "ramps": [dict(r) for r in self._ramps]}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = state_dict.get("steps")
        self.done = int(state_dict.get("done", 0))
        self._ramps = [dict(r) for r in state_dict.get("ramps", [])]

    # -- hooks ---------------------------------------------------------------------------------
    def setup(self) -> None:
        self._checked = False

    def fit_start(self, trainer: Any, network: nn.Module | None) -> None:
        if network is not None:
            self.check_plan(trainer, network)  # before the sanity check and the first step

    def train_start(self, trainer: Any, network: nn.Module) -> None:
        self.check_plan(trainer, network)  # a network found only now (checked once per fit)
        blocks = grown_blocks(network)
        self._ramp.clear()
        for r in self._ramps:  # a resumed fit: the masks of blocks still ramping, where they were
            self._ramp.add(blocks[r["k"]], r["start"], trainer.global_step)

    def batch_start(self, trainer: Any) -> None:
        if self._ramps:
            step = trainer.global_step
            self._ramp.set_step(step)  # removes a mask that reached 1; the checkpoint keeps the rest
            self._ramps = [r for r in self._ramps if self._ramp.value(r["start"], step) < 1.0]

    def batch_end(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        # global_step moves only at an optimizer step, so the first batch end at or past a point is the
        # one right after that step (with gradient accumulation too): growth never splits an accumulation
        step = trainer.global_step
        if self.steps is not None and self.done < len(self.steps) and step >= self.steps[self.done]:
            self._grow(trainer, pl_module, _inputs(batch), self.cb.schedule.blocks[self.done])
            self.done += 1
            if self.done == len(self.steps):
                self.cb.finished, self.cb.stop_reason = "budget", f"the plan's last point ({len(self.steps)} growths)"

    # -- the plan, checked before training ----------------------------------------------------------
    def check_plan(self, trainer: Any, network: nn.Module) -> None:
        """Fix ``at`` in optimizer steps (first fit start), then refuse a point past the fit's end or
        a planned site the network would not have, before anything is trained: both would otherwise
        surface only at that point (or never), after the training before it."""
        if self._checked:
            return
        plan = self.cb.schedule
        at, counts = list(plan.at), list(plan.blocks)
        total = trainer.estimated_stepping_batches
        known = isinstance(total, (int, float)) and total != float("inf")
        if self.steps is None:
            if isinstance(at[0], float):
                if not known:
                    raise ValueError("Plan.at: fractions need a fit of known length; set max_steps or max_epochs, or "
                                     "give at as optimizer steps")  # fmt: skip
                self.steps = [max(1, round(a * total)) for a in at]
            else:
                self.steps = [int(a) for a in at]
        late = [s for s in self.steps[self.done:] if known and s > total]
        if late:
            raise ValueError(f"Plan.at: the point(s) {late} (optimizer steps) lie past this fit's {int(total)} optimizer "
                             f"steps (trainer.estimated_stepping_batches), so the plan would never grow there, "
                             f"silently. Expected every point <= {int(total)}; given at={tuple(at)!r}. Fix: give the "
                             "points as fractions of the fit (e.g. at=[0.25, 0.5]), as steps within it, or lengthen "
                             "the fit (max_steps / max_epochs).")  # fmt: skip
        stages = list(network.growable_stages)
        lengths = {st: len(network.stage(st)) for st in stages}
        first: dict[str, int] = {}  # a stage's first candidate position; its end is always one
        for s in network.sites():
            first[s.stage] = min(first.get(s.stage, s.index), s.index)
        grown = len(network.growth_log)
        for k in range(self.done, len(self.steps)):
            where = f"at[{k}] = {at[k]!r} (optimizer step {self.steps[k]})"
            try:
                calls = plan_growth(stages, lengths, grown, counts[k], plan.site)
            except ValueError as err:
                raise ValueError(f"Plan.{err} (the growth at {where}; checked before training)") from None
            for names in calls:  # a call's names index the stage before that call
                for name in names:
                    stage, _, index = name.rpartition(".")
                    lo = first.get(stage)
                    if lo is None or not lo <= int(index) <= lengths[stage]:
                        have = f"{stage}.{lo} … {stage}.{lengths[stage]}" if lo is not None else "none"
                        raise ValueError(
                            f"Plan.site: Plan(site={plan.site!r}) would insert a block at {name!r} at {where}, "
                            f"which is not a candidate site of the network then: expected one of {stage!r}'s sites, "
                            f"{have} (a position in front of a shape-changing block, such as a ResNet stage's stride-2 "
                            f"transition, is not a site); given {name!r}. Fix: site='last' or site='cyclic' (on top of "
                            "a stage: always a site), or site='interleave'. Nothing was trained.")  # fmt: skip
                for name in names:
                    lengths[name.rpartition(".")[0]] += 1
            grown += counts[k]
        self._checked = True

    # -- growth --------------------------------------------------------------------------------
    def _grow(self, trainer: Any, pl_module: Any, x: Any, n: int) -> None:
        cb, network = self.cb, self.cb._network
        kind, seed = cb.insertion, cb.seed
        stages = list(network.growable_stages)
        calls = plan_growth(stages, {st: len(network.stage(st)) for st in stages}, len(network.growth_log), n,
                            cb.schedule.site)  # fmt: skip
        sites = [name for names in calls for name in names]
        # measured over the whole growth: a copy or a drawn block changes the blocks after it too
        before = cb.output_of(trainer, pl_module, network, x)
        ks: list[int] = []
        kept_zero: list[int] = []
        done: dict = {"growth_index": []}
        for names in calls:
            k0 = len(network.growth_log)
            blocks = {name: network.new_block(name, seed=seed * 1000 + k0 + i) for i, name in enumerate(names)}
            step = cb.insert(trainer, pl_module, blocks, x=x)
            ks += step["growth_index"]
            done["growth_index"] += step["growth_index"]
        for k in ks:
            block = grown_blocks(network)[k]  # what went in (a HF layer, not its candidate)
            if not ins.start_block(network, block, kind, torch.Generator().manual_seed(seed * 1000 + k + 500)):
                kept_zero.append(k)  # nothing of its shape to copy (a stage's first added block): it starts at zero
                continue
            if kind in ins.RAMPED:
                self._ramp.add(block, trainer.global_step)
                self._ramps.append({"k": k, "start": trainer.global_step})
        change, tolerance = cb.compare_outputs(before, cb.output_of(trainer, pl_module, network, x))
        record = {"insertion": kind, "max_abs_change": change, "tolerance": tolerance,
                  "function_preserving": change <= tolerance, "growth_index": done["growth_index"]}  # fmt: skip
        if kind in ins.COPIED:  # the blocks with nothing of their shape to copy, left at zero
            record["zero"] = [network.growth_log[k]["site"] for k in kept_zero]  # its own site, whatever the call order
        verdict = ("function-preserving" if record["function_preserving"] else "NOT function-preserving") + (
            f" (output change on the batch {change:.3g}, tolerance {tolerance:.3g})")
        reason = f"the plan's point {self.done + 1} of {len(self.steps)}: {n} block(s) at {sites} ({kind}); {verdict}"
        cb.planned(trainer, sites, reason, record)
