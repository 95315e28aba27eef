"""``GrowOnSchedule``: grow at set points of a fit's step budget, as the language-model growth methods do.

G_stack, MSG and Bu 2025 do not test whether depth pays; they grow at chosen times of a fixed token
budget and measure the result against scratch given the same compute. This callback is that protocol
on growtrain's editor: at each point of ``at`` (fractions of the fit's optimizer steps, or steps) it
inserts ``blocks`` blocks (``site``: at the top, the bottom, or one after each of evenly spaced
existing blocks), gives them zero optimizer state in groups of their own, continues the schedules,
and starts them as ``insertion`` says (growtrain/insertion.py: the paper's zero terminal map, an MSG
mask ramp, a G_stack copy of the neighbour, or that copy behind the mask ramp). Every growth records
whether it left the network's output unchanged, measured on the batch, not assumed from the kind.

The whole plan is checked when the fit starts, before a step is trained: every point of ``at`` must
fall inside the fit, and every site it would grow at must be a candidate site of the network then.

It certifies nothing: ``GrowUntilSaturated`` is the decision. docs/results.md's language-model
section measures both against scratch for the same FLOPs.
"""

from __future__ import annotations

from typing import Any, Literal, Mapping, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from growtrain import insertion as ins
from growtrain.batches import to_device
from growtrain.callbacks import editor, sharded
from growtrain.callbacks.compute import _inputs
from growtrain.callbacks.probe_data import ProbeView, eval_output
from growtrain.growable import grown_blocks, insertion_tolerance, resolve_network

__all__ = ["GrowOnSchedule", "plan_growth", "schedule_sites"]

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
    # one editor call per block at a repeated site ("last", "first"); one for distinct sites
    return [[s] for s in sites] if len(set(sites)) < len(sites) else [sites]


class GrowOnSchedule(Callback):
    """Insert blocks at set points of the fit (no test): the schedule-based growth of G_stack, MSG and Bu.

    Args:
        at: when to grow: fractions in (0, 1) of the fit's optimizer steps
            (``trainer.estimated_stepping_batches``), or optimizer-step counts (integers ≥ 1, none past
            the fit's last step: checked when the fit starts).
        blocks: blocks inserted at each point (one number for all, or one per point).
        site: ``"last"`` (on top, the default), ``"first"``, or ``"interleave"`` (one after each of
            evenly spaced existing blocks) in the last stage; ``"cyclic"``: the network's ``k``-th
            inserted block on top of stage ``k mod S`` of its ``S`` stages (a ResNet's blocks spread as
            a depth sweep's ``added`` spreads them; one stage: ``"last"``). Every planned site must be a
            candidate site of the network (``"first"`` is not on a ResNet, whose last stage begins with a
            stride-2 transition): checked when the fit starts.
        insertion: ``"zero"`` (the paper's zero terminal map), ``"mask_ramp"`` (MSG: a fresh terminal
            map behind a mask ramped 0 → 1 over ``ramp_steps``), ``"copy"`` (G_stack: the neighbour's
            weights; changes the network's output), ``"copy_ramp"`` (the neighbour's weights behind the
            mask ramp). growtrain/insertion.py says what each does.
        ramp_steps: optimizer steps of the ``mask_ramp`` / ``copy_ramp`` masks.
        network: the growable network: ``None`` (found), a dotted attribute path, or the module.
        seed: new block ``k`` draws from ``seed·1000 + k``.
        verbose: one line per growth (rank 0), saying whether it preserved the function.

    Attributes:
        growths: one dict per growth: ``step``, ``sites``, ``depth``, ``insertion``, ``max_abs_change``
            (the output's change on the batch over the whole growth, in eval mode), ``tolerance``
            (``growtrain.growable.insertion_tolerance`` of the output's dtype and scale) and
            ``function_preserving`` (``max_abs_change ≤ tolerance``, measured). For ``copy`` and
            ``copy_ramp``, ``zero``: the sites whose block had no block of its shape in its stage to copy
            (a ResNet stage's first added block: only the stride-2 transition is below it), left at zero
            (and unmasked).
    """

    def __init__(self, at: Sequence[float | int], blocks: int | Sequence[int] = 1, site: Placement = "last",
                 insertion: ins.Insertion = "zero", ramp_steps: int = 100, network: str | nn.Module | None = None,
                 seed: int = 0, verbose: bool = True):  # fmt: skip
        super().__init__()
        at = list(at) if isinstance(at, (list, tuple)) else at
        if not isinstance(at, list) or not at:
            raise ValueError(f"at: expected a non-empty list of fractions in (0, 1) or optimizer steps, got {at!r}")
        fractions = all(isinstance(a, float) for a in at)
        steps = all(isinstance(a, int) and not isinstance(a, bool) for a in at)
        if not (fractions and all(0.0 < a < 1.0 for a in at)) and not (steps and all(a >= 1 for a in at)):
            raise ValueError(f"at: expected all fractions in (0, 1) (of the fit's optimizer steps) or all integers ≥ 1 "
                             f"(optimizer steps), got {at!r}. Fix: e.g. at=[0.1, 0.2] or at=[500, 1000].")  # fmt: skip
        if sorted(at) != at or len(set(at)) != len(at):
            raise ValueError(f"at: expected strictly increasing points, got {at!r}")
        counts = [blocks] * len(at) if isinstance(blocks, int) and not isinstance(blocks, bool) else list(blocks)
        if len(counts) != len(at) or any(isinstance(n, bool) or not isinstance(n, int) or n < 1 for n in counts):
            raise ValueError(f"blocks: expected an integer ≥ 1 or one per point of at ({len(at)}), got {blocks!r}")
        if site not in ("last", "first", "interleave", "cyclic"):
            raise ValueError(f"site: expected 'last', 'first', 'interleave' or 'cyclic', got {site!r}")
        self.at, self.blocks, self.site = at, counts, site
        self.insertion = ins.check_insertion(insertion)
        self._ramp = ins.MaskRamp(ramp_steps)
        self.ramp_steps = ramp_steps
        self.network_spec, self.seed, self.verbose = network, int(seed), bool(verbose)
        self._network: nn.Module | None = None
        self._groups = editor.ResumeGroups()
        self._checked = False  # the plan checked against this fit (at its start)
        self.steps: list[int] | None = None  # ``at`` in optimizer steps, fixed at the first fit start
        self.done = 0  # points of ``at`` reached
        self.growths: list[dict] = []
        self._ramps: list[dict] = []  # {"k": growth index, "start": step} of blocks still masked

    # -- checkpoint state ---------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "done": self.done, "growths": [dict(r) for r in self.growths],
                "ramps": [dict(r) for r in self._ramps]}  # fmt: skip

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.steps = state_dict.get("steps")
        self.done = int(state_dict.get("done", 0))
        self.growths = [dict(r) for r in state_dict.get("growths", [])]
        self._ramps = [dict(r) for r in state_dict.get("ramps", [])]

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._groups.remember(checkpoint)

    # -- hooks ---------------------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        from growtrain.callbacks.growth import GrowUntilSaturated  # one growth protocol per fit

        if any(isinstance(cb, GrowUntilSaturated) for cb in trainer.callbacks):
            raise ValueError("callbacks: GrowOnSchedule and GrowUntilSaturated both grow the network; use one. "
                             "GrowUntilSaturated decides by measurement, GrowOnSchedule grows at set points.")  # fmt: skip
        if self.insertion != "zero" and sharded.is_model_parallel(trainer.strategy):
            raise RuntimeError(f"insertion: {self.insertion!r} writes whole tensors into the new block, which "
                               "FSDP2 shards; use insertion='zero' under ModelParallelStrategy")  # fmt: skip
        self._groups.forget()
        self._checked = False

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        network = resolve_network(pl_module, self.network_spec, required=False)
        self._groups.regroup(trainer, pl_module, network)  # a resumed grown network: growth's groups (editor.py)
        if network is not None:
            self._check_plan(trainer, network)  # before the sanity check and the first step

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._network = resolve_network(pl_module, self.network_spec, required=True)
        self._check_plan(trainer, self._network)  # a network found only now (checked once per fit)
        blocks = grown_blocks(self._network)
        self._ramp.clear()
        for r in self._ramps:  # a resumed fit: the masks of blocks still ramping, where they were
            self._ramp.add(blocks[r["k"]], r["start"], trainer.global_step)

    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        if self._ramps:
            step = trainer.global_step
            self._ramp.set_step(step)  # removes a mask that reached 1; the checkpoint keeps the rest
            self._ramps = [r for r in self._ramps if self._ramp.value(r["start"], step) < 1.0]

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        # global_step moves only at an optimizer step, so the first batch end at or past a point is the
        # one right after that step (with gradient accumulation too): growth never splits an accumulation
        step = trainer.global_step
        if self.steps is not None and self.done < len(self.steps) and step >= self.steps[self.done]:
            self._grow(trainer, pl_module, _inputs(batch), self.blocks[self.done])
            self.done += 1

    # -- the plan, checked before training ----------------------------------------------------------
    def _check_plan(self, trainer: Trainer, network: nn.Module) -> None:
        """Fix ``at`` in optimizer steps (first fit start), then refuse a point past the fit's end or
        a planned site the network would not have, before anything is trained: both would otherwise
        surface only at that point (or never), after the training before it."""
        if self._checked:
            return
        total = trainer.estimated_stepping_batches
        known = isinstance(total, (int, float)) and total != float("inf")
        if self.steps is None:
            if isinstance(self.at[0], float):
                if not known:
                    raise ValueError("at: fractions need a fit of known length; set max_steps or max_epochs, or give "
                                     "at as optimizer steps")  # fmt: skip
                self.steps = [max(1, round(a * total)) for a in self.at]
            else:
                self.steps = [int(a) for a in self.at]
        late = [s for s in self.steps[self.done:] if known and s > total]
        if late:
            raise ValueError(f"at: the point(s) {late} (optimizer steps) lie past this fit's {int(total)} optimizer steps "
                             f"(trainer.estimated_stepping_batches), so GrowOnSchedule would never grow there, silently. "
                             f"Expected every point ≤ {int(total)}; given at={self.at!r}. Fix: give the points as "
                             "fractions of the fit (e.g. at=[0.25, 0.5]), as steps within it, or lengthen the fit "
                             "(max_steps / max_epochs).")  # fmt: skip
        stages = list(network.growable_stages)
        lengths = {st: len(network.stage(st)) for st in stages}
        first: dict[str, int] = {}  # a stage's first candidate position; its end is always one
        for s in network.sites():
            first[s.stage] = min(first.get(s.stage, s.index), s.index)
        grown = len(network.growth_log)
        for k in range(self.done, len(self.steps)):
            where = f"at[{k}] = {self.at[k]!r} (optimizer step {self.steps[k]})"
            try:
                calls = plan_growth(stages, lengths, grown, self.blocks[k], self.site)
            except ValueError as err:
                raise ValueError(f"{err} (the growth at {where}; checked before training)") from None
            for names in calls:  # a call's names index the stage before that call
                for name in names:
                    stage, _, index = name.rpartition(".")
                    lo = first.get(stage)
                    if lo is None or not lo <= int(index) <= lengths[stage]:
                        have = f"{stage}.{lo} … {stage}.{lengths[stage]}" if lo is not None else "none"
                        raise ValueError(
                            f"site: GrowOnSchedule(site={self.site!r}) would insert a block at {name!r} at {where}, "
                            f"which is not a candidate site of the network then: expected one of {stage!r}'s sites, "
                            f"{have} (a position in front of a shape-changing block, such as a ResNet stage's stride-2 "
                            f"transition, is not a site); given {name!r}. Fix: site='last' or site='cyclic' (on top of "
                            "a stage: always a site), or site='interleave'. Nothing was trained.")  # fmt: skip
                for name in names:
                    lengths[name.rpartition(".")[0]] += 1
            grown += self.blocks[k]
        self._checked = True

    # -- growth --------------------------------------------------------------------------------
    def _grow(self, trainer: Trainer, pl_module: LightningModule, x: Any, n: int) -> None:
        network = self._network
        stages = list(network.growable_stages)
        calls = plan_growth(stages, {st: len(network.stage(st)) for st in stages}, len(network.growth_log), n, self.site)
        sites = [name for names in calls for name in names]
        view, device = ProbeView(pl_module, network), next(network.parameters()).device
        x = to_device(x, device)
        # measured over the whole growth: a copy or a drawn block changes the blocks after it too
        before = eval_output(view, x)
        ks: list[int] = []
        kept_zero: list[int] = []
        for names in calls:
            k0 = len(network.growth_log)
            blocks = {name: network.new_block(name, seed=self.seed * 1000 + k0 + i) for i, name in enumerate(names)}
            ks += editor.grow(trainer, pl_module, network, blocks, x)["growth_index"]
        for k in ks:
            block = grown_blocks(network)[k]  # what went in (a HF layer, not its candidate)
            if self.insertion in ("copy", "copy_ramp"):
                if ins.neighbour_block(network, block) is None:
                    kept_zero.append(k)  # nothing of its shape to copy (a stage's first added block): it starts at zero
                    continue
                ins.copy_neighbour(network, block)
            elif self.insertion == "mask_ramp":
                ins.draw_terminal(network, block, torch.Generator().manual_seed(self.seed * 1000 + k + 500))
            if self.insertion in ins.RAMPED:
                self._ramp.add(block, trainer.global_step)
                self._ramps.append({"k": k, "start": trainer.global_step})
        after = eval_output(view, x)
        change = float((after.float() - before.float()).abs().max()) if before.numel() else 0.0
        tolerance = insertion_tolerance(before.dtype, float(before.float().abs().max()) if before.numel() else 1.0)
        record = {"step": trainer.global_step, "sites": sites, "depth": network.depth(), "insertion": self.insertion,
                  "max_abs_change": change, "tolerance": tolerance,
                  "function_preserving": change <= tolerance}  # fmt: skip  # measured; a NaN change is False
        if self.insertion in ("copy", "copy_ramp"):  # the blocks with nothing of their shape to copy, left at zero
            record["zero"] = [network.growth_log[k]["site"] for k in kept_zero]  # its own site, whatever the call order
        self.growths.append(record)
        if self.verbose:
            rank_zero_info(_growth_line(record, n))


def _growth_line(record: dict, n: int) -> str:
    """The line a growth prints: where, how, and whether the output stayed unchanged (measured)."""
    verdict = ("function-preserving" if record["function_preserving"] else "NOT function-preserving") + (
        f" (output change on the batch {record['max_abs_change']:.3g}, tolerance {record['tolerance']:.3g})")
    return (f"GrowOnSchedule: step {record['step']}: {n} block(s) at {record['sites']} ({record['insertion']}) → depth "
            f"{record['depth']}; {verdict}")
