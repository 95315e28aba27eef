"""``PairedFork``: the paired-fork decision of ``GrowUntilSaturated`` (``decision="fork"``).

A collaborator with its own state. At a check with no fork open it opens one at the best
first-order site (growtrain.fork says what a fork is); on every training batch after that the
arm takes one optimizer step on the batch the run just trained on, as the training step received
it (after the batch hooks and the transfer), under the trainer's precision context, at the run's
rate at that step, with the trainer's gradient clipping. At the next check both sides are scored
on the probe (the mean of each sample's loss over the second half of the horizon) and the verdict
is ``growtrain.fork.fork_verdict``'s: grow (the run grows the same block and takes the arm's
weights and optimizer state, so the compute the arm spent is kept), or the block did not pay: the
arm is dropped (the run is the control, trained as it would have been) and a fork opens at the best
site of a stage not tried since the last growth; when every stage has had its fork, growth ends.

What is held out from what: the probe is never trained on by the run, the arm or any earlier
network (the datamodule's probe split, disjoint from the training split by index, checked at
setup); no other sample is scored.

Under DDP each rank's arm steps on its own batches with gradients averaged across ranks (as DDP
does for the run), so the arms stay identical; rank 0's verdict is broadcast. FSDP2 is refused at
setup. The arm (weights and optimizer state) travels in the callback's checkpoint, so a resumed
fit judges the same fork.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import replace
from typing import Any, Iterator

import torch
from torch import nn

from growtrain.callbacks.editor import optimizer_for
from growtrain.callbacks.probe_data import Converted, ProbeView, per_sample_losses
from growtrain.callbacks.trial_check import trial_candidates
from growtrain.fork import adopt, fork_test, fork_verdict, make_arm, mirror_lrs, warmup
from growtrain.reconfigure import add_param_groups, new_param_groups

__all__ = ["PairedFork", "swapped", "SCORE_FRACTIONS"]

# Where in the horizon (fractions of the steps between two checks) both sides are scored besides
# the check itself; each sample's loss is averaged over these points.
SCORE_FRACTIONS = (0.5, 0.625, 0.75, 0.875)
# The block's rate ramps up linearly over this fraction of the horizon (growtrain.fork.warmup says
# why); the scoring points above all lie after it.
WARMUP_FRACTION = 0.5


def next_site(report: Any, failed: list[str]) -> str | None:
    """The best first-order site of the best stage none of whose sites is in ``failed`` (forks that
    did not pay since the last growth), or ``None`` when every stage has had one: then growth ends.
    A fork judges one block at one site; a block that does not pay early at the input side (on full
    Fashion-MNIST the first-order choice, layer1.0, lost 1.6 % over 2 epochs where layer2.1 gained
    6.6 % over 4) says nothing about another stage."""
    tried = {name.rpartition(".")[0] or name for name in failed}
    for site in trial_candidates(report, limit=len(report.sites)):
        if (site.rpartition(".")[0] or site) not in tried:
            return site
    return None


@contextmanager
def swapped(module: nn.Module, network: nn.Module, replacement: nn.Module) -> Iterator[None]:
    """``module``'s forward runs ``replacement`` where it runs ``network`` (a submodule, matched by
    identity); everything outside the network is the module's own (shared, and not trained by
    the arm)."""
    if module is network:
        yield
        return
    for name, parent in module.named_modules(remove_duplicate=False):
        for child_name, child in parent.named_children():
            if child is network:
                setattr(parent, child_name, replacement)
                try:
                    yield
                finally:
                    setattr(parent, child_name, network)
                return
    raise RuntimeError("fork: the growable network is not a submodule of the LightningModule; the arm cannot run")


class PairedFork:
    """Opens, trains and judges one fork at a time (see the module docstring)."""

    key = "fork"  # the check record's entry (history[i]["fork"])

    def __init__(self, *, min_gain: float, seed: int = 0, horizon: str = "the interval"):
        self.min_gain, self.seed, self.horizon = float(min_gain), int(seed), horizon
        self.forks = 0  # forks opened so far: seeds each arm's block and bootstrap
        self.failed: list[str] = []  # sites whose fork did not pay since the last growth
        self.uppers: list[float] = []  # their upper bounds (fractions of the loss)
        self.site: str | None = None  # the open fork's site (None: no fork open)
        self.opened: dict | None = None  # epoch and step at which it opened
        self.arm: nn.Module | None = None
        self.arm_opt: torch.optim.Optimizer | None = None
        self.refs: list[int] = []
        self.ratios: list[float] = []
        self.steps = 0  # arm optimizer steps since the fork opened
        self._pending: dict | None = None  # a checkpoint's arm, rebuilt at the first batch
        self._optimizer: torch.optim.Optimizer | None = None  # the run's optimizer the arm mirrors
        self._last_step: int | None = None  # trainer.global_step at the last arm step
        self.seconds = 0.0  # wall time of arm steps and scoring, this process (not saved)
        self._sums: list[torch.Tensor] | None = None  # per-sample probe losses summed over the scoring points
        self._points = 0

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"forks": self.forks, "failed": list(self.failed), "uppers": list(self.uppers), "site": self.site,
                 "opened": self.opened, "steps": self.steps, "refs": list(self.refs), "ratios": list(self.ratios),
                 "points": self._points,
                 "sums": None if self._sums is None else [t.clone() for t in self._sums]}  # fmt: skip
        if self.arm is not None:
            state["arm"] = {k: v.detach().cpu().clone() for k, v in self.arm.state_dict().items()}
            state["arm_opt"] = self.arm_opt.state_dict() if self.arm_opt is not None else None
        elif self._pending is not None:
            state["arm"], state["arm_opt"] = self._pending["arm"], self._pending["arm_opt"]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.forks = int(state.get("forks", 0))
        self.failed = list(state.get("failed", []))
        self.uppers = [float(u) for u in state.get("uppers", [])]
        self.site, self.opened, self.steps = state.get("site"), state.get("opened"), int(state.get("steps", 0))
        self.refs, self.ratios = list(state.get("refs", [])), list(state.get("ratios", []))
        self._points, self._sums = int(state.get("points", 0)), state.get("sums")
        self.arm, self.arm_opt, self._last_step = None, None, None
        self._pending = {"arm": state["arm"], "arm_opt": state.get("arm_opt")} if self.site and "arm" in state else None

    def _seed(self, k: int) -> int:
        return self.seed * 100019 + k

    # -- the arm ----------------------------------------------------------------------------
    def _build(self, pl_module: Any, network: nn.Module, optimizer: Any, site: str, seed: int) -> list[int]:
        """The arm at ``site`` (block seed ``seed``) from the network and optimizer as they are now;
        the optimizer is kept, so a training batch does not look it up again."""

        def groups(block, arm_opt):
            new, refs = new_param_groups(pl_module, block, len(network.growth_log), arm_opt)
            add_param_groups(arm_opt, new)
            return refs

        self.arm, self.arm_opt, _, refs = make_arm(network, optimizer, site, seed, new_groups=groups)
        self._optimizer = optimizer
        return refs

    def open(self, pl_module: Any, network: nn.Module, optimizer: Any, site: str, *, epoch: int, step: int) -> None:
        """A fork at ``site``: the arm from the network and optimizer as they are now."""
        self.refs = self._build(pl_module, network, optimizer, site, self._seed(self.forks))
        self.forks += 1
        n = len(optimizer.param_groups) if optimizer is not None else 0
        self.ratios = [float(self.arm_opt.param_groups[n + j]["lr"]) / float(optimizer.param_groups[r]["lr"])
                       if float(optimizer.param_groups[r]["lr"]) != 0 else 1.0
                       for j, r in enumerate(self.refs)] if optimizer is not None else []  # fmt: skip
        self.site, self.opened, self.steps, self._last_step, self._pending = site, {"epoch": epoch, "step": step}, 0, step, None
        self._sums, self._points = None, 0

    def close(self) -> None:
        self.site, self.opened, self.arm, self.arm_opt, self._pending = None, None, None, None, None
        self.refs, self.ratios, self.steps, self._optimizer = [], [], 0, None
        self._sums, self._points = None, 0

    def _rebuild(self, pl_module: Any, network: nn.Module, optimizer: Any) -> None:
        """The arm of a checkpoint: the same construction (the block's seed does not matter: its
        weights are the saved ones), then its saved weights and optimizer state; the fork's counters
        came with load_state_dict."""
        self._build(pl_module, network, optimizer, self.site, self._seed(self.forks - 1))
        self.arm.load_state_dict(self._pending["arm"])
        if self.arm_opt is not None and self._pending.get("arm_opt") is not None:
            self.arm_opt.load_state_dict(self._pending["arm_opt"])
        self._pending = None

    def batch_end(self, trainer: Any, pl_module: Any, network: nn.Module, batch: Any, loss_fn: Any, *,
                  marks: list[int] = (), score: Any = None, horizon_steps: int | None = None) -> None:  # fmt: skip
        """One arm step on the batch the run just trained on (when the run stepped its optimizer)."""
        if self.site is None:
            return
        start = time.perf_counter()
        if self.arm is None:  # a resumed fit: the arm of the checkpoint
            self._rebuild(pl_module, network, optimizer_for(trainer, network))
            self._last_step = int(trainer.global_step) - 1
        accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
        x, y = trainer.precision_plugin.convert_input(batch[0]), batch[-1]
        self.arm.train(network.training)
        with swapped(pl_module, network, self.arm), trainer.precision_plugin.forward_context():
            loss = loss_fn(pl_module(x), y)
        (loss / accumulate).backward()
        stepped = int(trainer.global_step) != self._last_step  # the run stepped its optimizer on this batch
        if stepped and self.arm_opt is not None:
            self._last_step = int(trainer.global_step)
            params = [p for p in self.arm.parameters() if p.grad is not None]
            if trainer.world_size > 1:
                for p in params:
                    torch.distributed.all_reduce(p.grad)
                    p.grad.div_(trainer.world_size)
            clip = getattr(trainer, "gradient_clip_val", None)
            if clip:
                if getattr(trainer, "gradient_clip_algorithm", "norm") == "value":
                    torch.nn.utils.clip_grad_value_(params, clip)
                else:
                    torch.nn.utils.clip_grad_norm_(params, clip)
            ramp = round(WARMUP_FRACTION * horizon_steps) if horizon_steps else 0
            mirror_lrs(self.arm_opt, self._optimizer, self.refs, self.ratios, warm=warmup(self.steps + 1, ramp))
            self.arm_opt.step()
            self.arm_opt.zero_grad(set_to_none=True)
            self.steps += 1
            if self.steps in marks and score is not None:
                score()
        self.seconds += time.perf_counter() - start

    def _score(self, trainer: Any, pl_module: Any, network: nn.Module, probe: Any, loss_fn: Any) -> None:
        """Add each probe sample's loss under the run and under the arm, now, to the fork's sums."""
        device = next(network.parameters()).device
        with trainer.precision_plugin.forward_context():
            control = per_sample_losses(ProbeView(pl_module, network), Converted(probe, trainer), loss_fn, device)
            with swapped(pl_module, network, self.arm):
                arm = per_sample_losses(ProbeView(pl_module, self.arm), Converted(probe, trainer), loss_fn, device)
        if self._sums is None:
            self._sums = [torch.zeros_like(control), torch.zeros_like(arm)]
        self._sums[0] += control
        self._sums[1] += arm
        self._points += 1

    def marks(self, horizon_steps: int | None) -> list[int]:
        """The arm steps after which both sides are scored besides the check itself: at 1/2, 5/8,
        3/4 and 7/8 of the horizon (an SGD run at a constant rate wanders around its basin; the
        mean over these points of each sample's loss is what the two sides are compared on)."""
        if not horizon_steps or horizon_steps < 2:
            return []
        return sorted({max(1, round(horizon_steps * f)) for f in SCORE_FRACTIONS} - {horizon_steps})

    # -- a check ----------------------------------------------------------------------------
    def judge(self, inputs: Any) -> tuple[Any, list[str], dict]:
        """The decision's interface: no fork open → a verdict that decides nothing (the callback
        opens one); a fork open → the paired test of the arm against the run on the probe."""
        trainer, pl_module, network = inputs.trainer, inputs.pl_module, inputs.network
        if self.site is None:
            verdict = fork_verdict(None, site=None, min_gain=self.min_gain, horizon=self.horizon)
            return verdict, [], {"open_new": True, "reason": verdict.reason, "min_gain": self.min_gain}
        if self.arm is None:  # resumed exactly at a check: rebuild before scoring
            self._rebuild(pl_module, network, optimizer_for(trainer, network))
        start = time.perf_counter()
        self._score(trainer, pl_module, network, inputs.probe, inputs.loss_fn)  # the last point: the check itself
        control, arm = self._sums[0] / self._points, self._sums[1] / self._points
        test = fork_test(control, arm, min_gain=self.min_gain, level=inputs.level, seed=self._seed(self.forks))
        verdict = fork_verdict(test, site=self.site, min_gain=self.min_gain, horizon=self.horizon)
        if trainer.world_size > 1:  # one decision on every rank: rank 0's
            verdict, test = trainer.strategy.broadcast((verdict, test), src=0)
        retry = None
        if verdict.saturated:  # the block at this site did not pay; another stage's best site may
            self.failed.append(self.site)
            self.uppers.append(float(test["upper_frac"]))
            retry = next_site(inputs.report, self.failed)
            if retry is None:  # growth ends: certified only if every stage's fork bounded its block below min_gain
                verdict = replace(verdict, certified=all(u < self.min_gain for u in self.uppers))
            else:
                verdict = replace(verdict, saturated=False, certified=False, site=None,
                                  reason=f"{verdict.reason}; a fork at {retry} (the best site of a stage not tried since "
                                         "the last growth) decides next")  # fmt: skip
        else:
            self.failed, self.uppers = [], []
        self.seconds += time.perf_counter() - start
        entry = {"site": self.site, "opened": self.opened, "arm_steps": self.steps, "points": self._points,
                 "saturated": verdict.saturated,
                 "certified": verdict.certified, "lower_frac": verdict.score, "min_gain": self.min_gain,
                 "reason": verdict.reason, **{k: test[k] for k in ("gain_frac", "lower_frac", "upper_frac",
                                                                   "loss_before", "loss_now", "n", "level", "se")}}  # fmt: skip
        if retry is not None:
            entry["open_new"] = retry
        return verdict, [self.site] if not (verdict.saturated or retry) else [], entry

    def adopt(self, network: nn.Module, optimizer: Any) -> int:
        """The run (already grown at the fork's site) takes the arm's weights and optimizer state."""
        copied = adopt(network, optimizer, self.arm, self.arm_opt)
        self.close()
        return copied
