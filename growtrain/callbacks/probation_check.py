"""``Probation``: the leave-one-block-out decision of ``GrowUntilSaturated`` (``decision="probation"``).

A collaborator with its own state. At a check with no block on probation, a zero-output block goes
into the run at the best first-order site (the editor's function-preserving insertion, zero-state
optimizer groups) and is put on probation: each training sample passes through it with probability
``growtrain.leave_out.KEEP`` (growtrain/leave_out.py says why). At each later check the same weights
score the probe with the block and without it; the paired test at the per-look level
(``alpha / MAX_LOOKS``) says:

* confirm — the block certifiably lowers the probe loss by more than ``min_gain``: it leaves
  probation (a plain block from now on), the run has grown, and the next block goes on probation;
* reject — its gain is certifiably below ``min_gain`` ("certified saturation"), or still unresolved
  after ``MAX_LOOKS`` looks ("no certified gain"): the block is taken out (its optimizer groups and
  state with it) and growth ends on the network without it, which trained on every batch.

What is held out from what: the probe is never trained on (the datamodule's probe split, checked at
setup); nothing else is scored. What it costs beyond the run's own training: two eval passes over the
probe per check, one first-order probe pass per block put on probation, and the training of a block
that is taken back. The block's state (its site, growth index and looks) is in the callback's
checkpoint; the block itself is in the network's (its growth record), and the hook goes back on at
the first batch of a resumed fit. Under DDP the masks differ by rank (as the batches do) and rank
0's verdict is broadcast; FSDP2 is refused at setup.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import ExitStack
from typing import Any

import torch
from torch import nn

from growtrain.callbacks.editor import rewrap_ddp
from growtrain.callbacks.fork_check import swapped
from growtrain.callbacks.probe_data import ProbeView, probe_sample_losses
from growtrain.decision import Verdict
from growtrain.growable import grown_blocks
from growtrain.leave_out import KEEP, MAX_LOOKS, LeaveOut, leave_out_test, probation_verdict
from growtrain.reconfigure import remove_param_groups

__all__ = ["Probation", "EMA_FRACTION"]

# The scored network is an exponential moving average of the run's weights (and buffers) since the
# block went in, with a time constant of this fraction of the steps between checks. At a constant rate
# SGD wanders around its basin, and the two modes with it: on the embedded subset the live weights'
# gain swung from -9 % to +5 % between consecutive epochs. The average is what cooling the rate would
# reach (the stage fork cooled copies instead, at an eighth of the horizon's training twice over); it
# costs one weighted add per parameter per step.
EMA_FRACTION = 0.25


class Probation:
    """At most one block on probation at a time (see the module docstring)."""

    key = "probation"  # the check record's entry (history[i]["probation"])

    def __init__(self, *, min_gain: float, seed: int = 0, max_looks: int = MAX_LOOKS, keep: float = KEEP,
                 per_stage: bool = True):  # fmt: skip
        self.min_gain, self.seed, self.max_looks, self.keep = float(min_gain), int(seed), int(max_looks), float(keep)
        self.per_stage = bool(per_stage)  # a block at the best site of every stage, on probation together
        self.count = 0  # probations opened so far (seeds the bootstrap)
        self.site: str | None = None  # the sites on probation, in words (None: none on probation)
        self.sites: list[str] = []
        self.indices: list[int] = []  # their growth indices (network.growth_log, grown_blocks order)
        self.opened: dict | None = None  # epoch and step at which they went in
        self.looks = 0  # checks that judged them
        self.hooks: list[LeaveOut] = []
        self.ema: nn.Module | None = None  # the average of the run's network since the blocks went in
        self.ema_hooks: list[LeaveOut] = []
        self.ema_steps = 0
        self.kept = [0.0, 0]  # samples that passed through the block, and samples, since the last look
        self._pending: dict | None = None  # a checkpoint's average, rebuilt at the first batch
        self._last_step: int | None = None
        self.seconds = 0.0  # wall time of scoring, this process (not saved)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"count": self.count, "site": self.site, "sites": list(self.sites), "indices": list(self.indices),
                 "opened": self.opened,
                 "looks": self.looks, "ema_steps": self.ema_steps, "kept": list(self.kept)}  # fmt: skip
        if self.ema is not None:
            state["ema"] = {k: v.detach().cpu().clone() if torch.is_tensor(v) else copy.deepcopy(v)
                            for k, v in self.ema.state_dict().items()}  # fmt: skip
        elif self._pending is not None:
            state["ema"] = self._pending
        return state

    def load_state_dict(self, state: dict) -> None:
        self._drop_hook()
        self.count, self.looks = int(state.get("count", 0)), int(state.get("looks", 0))
        self.site, self.opened = state.get("site"), state.get("opened")
        self.sites, self.indices = list(state.get("sites", [])), [int(i) for i in state.get("indices", [])]
        self.ema_steps = int(state.get("ema_steps", 0))
        self.kept = [float(state.get("kept", [0.0, 0])[0]), int(state.get("kept", [0.0, 0])[1])]
        self._pending = state.get("ema") if self.site is not None else None

    def _drop_hook(self) -> None:
        for hook in self.hooks + self.ema_hooks:
            hook.remove()
        self.hooks, self.ema, self.ema_hooks, self._last_step = [], None, [], None

    def _start_average(self, network: nn.Module, saved: dict | None = None) -> None:
        """The average starts as a copy of the network (made before the live hook goes on)."""
        self.ema = copy.deepcopy(network)
        if saved is not None:
            self.ema.load_state_dict(saved)
        self.ema.requires_grad_(False)
        self.ema_hooks = [LeaveOut(b, self.keep) for b in self.blocks(self.ema)]

    def blocks(self, network: nn.Module) -> list[nn.Module]:
        """The blocks on probation, by their growth indices."""
        grown = grown_blocks(network)
        return [grown[i] for i in self.indices]

    def attach(self, network: nn.Module) -> None:
        """The hooks on the blocks on probation and the average (a resumed fit's network has the
        blocks, not the hooks; its average comes from the checkpoint)."""
        if self.site is not None and not self.hooks:
            self._start_average(network, self._pending)
            self._pending = None
            self.hooks = [LeaveOut(b, self.keep) for b in self.blocks(network)]

    @torch.no_grad()
    def batch_end(self, trainer: Any, network: nn.Module, interval_steps: int | None) -> None:
        """After an optimizer step of the run: the average takes it in."""
        if self.site is None or self.ema is None:
            return
        if self.hooks:  # what the hooks drew since the last batch end (one draw, shared: the first hook's)
            drawn = self.hooks[0].kept
            self.kept = [self.kept[0] + sum(s * n for s, n in drawn), self.kept[1] + sum(n for _, n in drawn)]
            for hook in self.hooks:
                hook.kept.clear()
        if int(trainer.global_step) == self._last_step:
            return
        self._last_step = int(trainer.global_step)
        tau = max(1.0, EMA_FRACTION * interval_steps) if interval_steps else 1.0
        weight = 1.0 - math.exp(-1.0 / tau)
        self.ema_steps += 1
        mine = [t for t in self.ema.state_dict().values() if torch.is_tensor(t)]
        live = [t for t in network.state_dict().values() if torch.is_tensor(t)]
        floats = [(a, b) for a, b in zip(mine, live) if a.is_floating_point()]
        if floats:
            torch._foreach_lerp_([a for a, _ in floats], [b.detach() for _, b in floats], weight)
        for a, b in zip(mine, live):
            if not a.is_floating_point():
                a.copy_(b)

    def batch_start(self, trainer: Any, network: nn.Module, batch_idx: int) -> None:
        """The masks of this training batch: from the seed, the step, the batch and the rank; every
        block's hook seeded alike, so a sample skips all the blocks on probation or none."""
        if self.site is None:
            return
        self.attach(network)
        step, rank = int(trainer.global_step), int(getattr(trainer, "global_rank", 0))
        for hook in self.hooks:
            hook.reseed(((self.seed * 1_000_003 + step) * 100_003 + int(batch_idx)) * 1009 + rank)

    def open(self, network: nn.Module, blocks: dict[str, nn.Module], *, epoch: int, step: int) -> None:
        """Put ``blocks`` (site → the block just inserted) on probation."""
        self._drop_hook()
        grown = grown_blocks(network)
        self.sites = list(blocks)
        self.indices = [next(i for i, g in enumerate(grown) if g is b) for b in blocks.values()]  # by identity
        self.site, self.opened, self.looks = ", ".join(self.sites), {"epoch": epoch, "step": step}, 0
        self.count += 1
        self._pending, self.ema_steps, self.kept = None, 0, [0.0, 0]
        self._start_average(network)
        self.hooks = [LeaveOut(b, self.keep) for b in blocks.values()]
        self._last_step = step

    def _close(self) -> None:
        self._drop_hook()
        self.site, self.sites, self.indices, self.opened, self.looks = None, [], [], None, 0

    def confirm(self) -> None:
        """The blocks stay, plain blocks from now on."""
        self._close()

    def reject(self, trainer: Any, pl_module: Any, network: nn.Module, optimizer: Any) -> None:
        """Take the blocks back: their optimizer groups and state (the last growth's first), then the
        blocks and their growth records."""
        self.attach(network)
        order = sorted(zip(self.indices, self.blocks(network)), key=lambda t: t[0])
        self._drop_hook()
        if optimizer is not None:
            for _, block in reversed(order):
                remove_param_groups(optimizer, block, trainer.strategy.lr_scheduler_configs)
        network.undo_growth([b for _, b in order], order[0][0])
        rewrap_ddp(trainer)
        self._close()

    # -- a check ----------------------------------------------------------------------------
    def judge(self, inputs: Any) -> tuple[Verdict, list[str], dict]:
        """No block on probation → a verdict that decides nothing (the callback puts one in); one on
        probation → the paired test of the network with it against the network without it."""
        if self.site is None:
            verdict = Verdict("probation", False, None, float("nan"), self.min_gain,
                              "probation: no block on probation; one goes in at the best first-order site and trains "
                              "with the run (each sample through it with probability "
                              f"{self.keep:g}), then the probe is scored with and without it")  # fmt: skip
            return verdict, [], {"act": "open", "reason": verdict.reason, "min_gain": self.min_gain}
        trainer, pl_module, network = inputs.trainer, inputs.pl_module, inputs.network
        start = time.perf_counter()
        self.attach(network)
        device = next(network.parameters()).device
        view = ProbeView(pl_module, self.ema)
        with swapped(pl_module, network, self.ema):
            with ExitStack() as stack:
                for hook in self.ema_hooks:
                    stack.enter_context(hook.left_out())
                without = probe_sample_losses(trainer, view, inputs.probe, inputs.loss_fn, device)[0]
            with_block = probe_sample_losses(trainer, view, inputs.probe, inputs.loss_fn, device)[0]
        self.looks += 1
        test = leave_out_test(without, with_block, min_gain=self.min_gain, level=inputs.level / self.max_looks,
                              seed=self.seed * 100_019 + self.count * 101 + self.looks)  # fmt: skip
        verdict, act = probation_verdict(test, site=self.site, min_gain=self.min_gain, looks=self.looks,
                                         max_looks=self.max_looks)  # fmt: skip
        if trainer.world_size > 1:  # one decision on every rank: rank 0's
            verdict, act, test = trainer.strategy.broadcast((verdict, act, test), src=0)
        self.seconds += time.perf_counter() - start
        entry = {"act": act, "site": self.site, "opened": self.opened, "looks": self.looks, "max_looks": self.max_looks,
                 "averaged_steps": self.ema_steps,
                 "kept": self.kept[0] / self.kept[1] if self.kept[1] else None, "certified": verdict.certified,
                 "min_gain": self.min_gain, "reason": verdict.reason,
                 **{k: test[k] for k in ("gain_frac", "lower_frac", "upper_frac", "loss_before", "loss_now", "n",
                                         "level", "se")}}  # fmt: skip
        self.kept = [0.0, 0]
        return verdict, list(self.sites) if act == "confirm" else [], entry
