"""``GrowOnSchedule``: grow at set points of a fit's step budget, as the language-model growth methods do.

G_stack, MSG and Bu 2025 do not test whether depth pays; they grow at chosen times of a fixed token
budget and measure the result against scratch given the same compute. This callback is that protocol
on growtrain's editor: at each point of ``at`` (fractions of the fit's optimizer steps, or steps) it
inserts ``blocks`` blocks (``site``: at the top, the bottom, or one after each of evenly spaced
existing blocks), gives them zero optimizer state in groups of their own, continues the schedules,
and starts them as ``insertion`` says (growtrain/insertion.py: the paper's zero terminal map, an MSG
mask ramp, or a G_stack copy of the neighbour, which changes the function and is logged as doing so).

It certifies nothing: ``GrowUntilSaturated`` is the decision. docs/results.md's language-model
section measures both against scratch for the same FLOPs.
"""

from __future__ import annotations

from typing import Any, Literal, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info
from torch import nn

from growtrain import insertion as ins
from growtrain.batches import to_device
from growtrain.callbacks import editor, sharded
from growtrain.callbacks.compute import _inputs
from growtrain.callbacks.probe_data import ProbeView, eval_output
from growtrain.growable import grown_blocks, resolve_network

__all__ = ["GrowOnSchedule", "schedule_sites"]

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


class GrowOnSchedule(Callback):
    """Insert blocks at set points of the fit (no test): the schedule-based growth of G_stack, MSG and Bu.

    Args:
        at: when to grow: fractions in (0, 1) of the fit's optimizer steps
            (``trainer.estimated_stepping_batches``), or optimizer-step counts (integers ≥ 1).
        blocks: blocks inserted at each point (one number for all, or one per point).
        site: ``"last"`` (on top, the default), ``"first"``, or ``"interleave"`` (one after each of
            evenly spaced existing blocks) in the last stage; ``"cyclic"``: the network's ``k``-th
            inserted block on top of stage ``k mod S`` of its ``S`` stages (a ResNet's blocks spread as
            a depth sweep's ``added`` spreads them; one stage: ``"last"``).
        insertion: ``"zero"`` (the paper's zero terminal map), ``"mask_ramp"`` (MSG: a random terminal
            map behind a mask ramped 0 → 1 over ``ramp_steps``), ``"copy"`` (G_stack: the neighbour's
            weights; changes the network's output).
        ramp_steps: optimizer steps of the ``mask_ramp``.
        network: the growable network: ``None`` (found), a dotted attribute path, or the module.
        seed: new block ``k`` draws from ``seed·1000 + k``.
        verbose: one line per growth (rank 0).

    Attributes:
        growths: one dict per growth: ``step``, ``sites``, ``depth``, ``insertion``, ``max_abs_change``
            (the output's change on the batch at insertion: 0 up to rounding unless ``copy``) and, for
            ``copy``, ``zero``: the sites whose block had no block of its shape in its stage to copy
            (a ResNet stage's first added block: only the stride-2 transition is below it), left at zero.
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
        self._saved_groups: list[list[Any]] | None = None
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
        self._saved_groups = [[g.get("name") for g in state.get("param_groups", [])]
                              for state in checkpoint.get("optimizer_states") or []]  # fmt: skip

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
        self._saved_groups = None

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        network = resolve_network(pl_module, self.network_spec, required=False)
        if network is not None:  # a plain optimizer of a resumed grown network: growth's groups (editor.py)
            editor.regroup_grown(trainer, pl_module, network, self._saved_groups)
        self._saved_groups = None

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._network = resolve_network(pl_module, self.network_spec, required=True)
        if self.steps is None:
            if isinstance(self.at[0], float):
                total = trainer.estimated_stepping_batches
                if not isinstance(total, (int, float)) or total == float("inf"):
                    raise ValueError("at: fractions need a fit of known length; set max_steps or max_epochs, or give "
                                     "at as optimizer steps")  # fmt: skip
                self.steps = [max(1, round(a * total)) for a in self.at]
            else:
                self.steps = [int(a) for a in self.at]
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

    # -- growth --------------------------------------------------------------------------------
    def _grow(self, trainer: Trainer, pl_module: LightningModule, x: Any, n: int) -> None:
        network = self._network
        if self.site == "cyclic":  # block k of the network's growth on top of stage k mod S, one editor call each
            stages = list(network.growable_stages)
            picks = [stages[(len(network.growth_log) + i) % len(stages)] for i in range(n)]
            sites = [f"{st}.{len(network.stage(st)) + picks[:i].count(st)}" for i, st in enumerate(picks)]
            batches = [[s] for s in sites]
        else:
            (stage,) = network.growable_stages[-1:]  # the last stage: a decoder has one
            sites = schedule_sites(len(network.stage(stage)), n, self.site, stage)
            # one editor call per block at a repeated site ("last", "first"); one for distinct sites
            batches = [[s] for s in sites] if len(set(sites)) < len(sites) else [sites]
        view, device = ProbeView(pl_module, network), next(network.parameters()).device
        # the editor checks each zero insertion left the output unchanged; copy and mask_ramp change the
        # blocks after it, so their change is measured here, over the whole growth
        before = eval_output(view, to_device(x, device)) if self.insertion != "zero" else None
        ks: list[int] = []
        kept_zero: list[int] = []
        change = 0.0
        for names in batches:
            k0 = len(network.growth_log)
            blocks = {name: network.new_block(name, seed=self.seed * 1000 + k0 + i) for i, name in enumerate(names)}
            result = editor.grow(trainer, pl_module, network, blocks, x)
            ks += result["growth_index"]
            change = max(change, result["max_abs_change"])
        for k in ks:
            block = grown_blocks(network)[k]  # what went in (a HF layer, not its candidate)
            if self.insertion == "copy" and ins.neighbour_block(network, block) is None:
                kept_zero.append(k)  # nothing of its shape to copy (a stage's first added block): it starts at zero
            elif self.insertion == "copy":
                ins.copy_neighbour(network, block)
            elif self.insertion == "mask_ramp":
                ins.draw_terminal(network, block, torch.Generator().manual_seed(self.seed * 1000 + k + 500))
                self._ramp.add(block, trainer.global_step)
                self._ramps.append({"k": k, "start": trainer.global_step})
        if before is not None:
            change = float((eval_output(view, to_device(x, device)).float() - before.float()).abs().max())
        record = {"step": trainer.global_step, "sites": sites, "depth": network.depth(), "insertion": self.insertion,
                  "max_abs_change": change}  # fmt: skip
        if self.insertion == "copy":  # the blocks with nothing of their shape to copy, left at zero
            record["zero"] = [sites[ks.index(k)] for k in kept_zero]
        self.growths.append(record)
        if self.verbose:
            rank_zero_info(f"GrowOnSchedule: step {record['step']}: {n} block(s) at {sites} ({self.insertion}) → depth "
                           f"{record['depth']}; output change on the batch {change:.3g}")  # fmt: skip
