"""``GrowUntilSaturated(schedule=Budget())``: grow early in the fit's compute budget while one more
block pays for its compute (the default schedule; ``BudgetRun`` is its part of the callback).

The question a user brings: *I have this much compute; how deep should the network be?* The
answer depends on the budget, so the schedule reads it from the trainer (growtrain/budget.py: the
fit's optimizer steps at the start depth, in FLOPs) and decides inside it:

    when    — a decision at each of ``Budget.checks`` points over the first ``growth_phase`` of the
              budget; the callback drives warmup-stable-decay over it, so every decision lands at the
              stable rate and the budget's end anneals the final network
    decides — ``BudgetFork``: a copy with one more block on top of every stage (``insertion``) trains on
              the run's next batches for ``fork`` of the budget beside the run (the one fork arm:
              fork_check.train_sides, under accumulation, precision and DDP); both scored on the probe
              with their weights averaged over the fork; ``statistic`` prices what it measured against
              the budget (growtrain/budget.py); every decision also reports the paper's Γ̂ against δ+t
    inserts — the run grows the same blocks and takes the arm's weights and optimizer state

Every FLOP the forks and their scoring spend comes out of the same budget. What it certifies is
what the fork measured; a deeper network that would pay only later is not seen (short-horizon
bias: growth ends early rather than late).
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any

import torch
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

import growtrain.budget as budget_math
from growtrain.batches import to_device
from growtrain.budget import BudgetPlan, budget_verdict, carried, fork_steps, steps_cost
from growtrain.callbacks import editor
from growtrain.callbacks.compute import _inputs, forward_flops
from growtrain.callbacks.fork_check import PairedFork, swapped, train_sides
from growtrain.callbacks.parts import MIN_FORK_STEPS
from growtrain.callbacks.probe_check import forked_rng
from growtrain.callbacks.probe_data import Converted, ProbeView, first_input, probe_sample_losses
from growtrain.fork import adopt, fork_test, make_arm
from growtrain.growable import grown_blocks
from growtrain.insertion import attach_mask, mask_value, set_mask, start_block
from growtrain.budget import plan_problem
from growtrain.reconfigure import add_param_groups, new_param_groups

__all__ = ["BudgetRun"]


def _ema_update(ema: dict[str, torch.Tensor], module: nn.Module, beta: float) -> None:
    with torch.no_grad():
        for name, t in module.state_dict().items():
            if torch.is_tensor(t) and t.is_floating_point():
                ema[name].mul_(beta).add_(t.detach(), alpha=1.0 - beta)
            elif torch.is_tensor(t):
                ema[name].copy_(t)


def _ema_init(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items() if torch.is_tensor(v)}


def _averaged(module: nn.Module, ema: dict[str, torch.Tensor]) -> nn.Module:
    twin = copy.deepcopy(module)
    state = twin.state_dict()  # a ramp's mask, removed at 1, is averaged while it lasts and left out after
    twin.load_state_dict({**state, **{k: v for k, v in ema.items() if k in state}})
    return twin


class BudgetRun:
    """The budget schedule's state and work inside ``GrowUntilSaturated`` (``cb``): the plan, the
    FLOPs spent, the rate, the open fork and its decision. The callback's hooks call it; what every
    schedule shares (the probe, the strategy, the record, the history, the summary) stays there."""

    def __init__(self, cb: Any):
        self.cb = cb
        self._flops: dict[int, float] = {}  # forward FLOPs per sample, by parameter count
        self._ramped: list[nn.Module] = []  # copy_ramp: the arm's blocks behind a mask
        self.reset()

    def reset(self) -> None:
        self.plan: BudgetPlan | None = None
        self.spent = 0.0
        self.decision_flops = 0.0
        self.next_point = 0
        # (optimizer step, training loss) of each of the run's batches: "steps" prices steps on it. The losses stay
        # tensors on the network's device until a decision reads them: no host sync on the training step.
        self.curve: list[tuple[int, torch.Tensor | float]] = []
        self.fork_state: dict | None = None  # the open fork's counters (sites, steps, targets)
        self.arm: nn.Module | None = None
        self.arm_opt: torch.optim.Optimizer | None = None
        self.ema: dict[str, dict[str, torch.Tensor]] | None = None  # run, arm, and arm_half (the arm halfway)
        self.half: torch.Tensor | None = None  # the probe losses halfway: (run, arm) per sample
        self._pending: dict | None = None
        self._total_steps = 0
        self._seen_step = -1  # trainer.global_step at the last batch end: it moves where the run stepped

    @property
    def schedule(self):
        return self.cb.schedule

    @property
    def decision(self):
        return self.cb.decision

    # -- checkpoint state -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        state = {"plan": self.plan.as_dict() if self.plan else None, "spent": self.spent,
                 "decision_flops": self.decision_flops, "next_point": self.next_point,
                 "fork_state": copy.deepcopy(self.fork_state), "curve": [[a, float(b)] for a, b in self.curve]}  # fmt: skip
        if self.arm is not None:
            state["arm"] = {k: v.detach().cpu().clone() for k, v in self.arm.state_dict().items() if torch.is_tensor(v)}
            state["arm_opt"] = self.arm_opt.state_dict() if self.arm_opt is not None else None
            state["ema"] = {side: {k: v.cpu().clone() for k, v in ema.items()} for side, ema in self.ema.items()}
            state["half"] = None if self.half is None else self.half.clone()
        elif self._pending is not None:
            state.update(self._pending)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.reset()
        self.plan = BudgetPlan(**state["plan"]) if state.get("plan") else None
        self.spent, self.decision_flops = float(state.get("spent", 0.0)), float(state.get("decision_flops", 0.0))
        self.next_point = int(state.get("next_point", 0))
        self.curve = [(int(a), float(b)) for a, b in state.get("curve", [])]
        self.fork_state = state.get("fork_state")
        if self.fork_state is not None and "arm" in state:
            self._pending = {k: state.get(k) for k in ("arm", "arm_opt", "ema", "half")}

    # -- the fit's start: refuse early ------------------------------------------------------------
    def train_start(self, trainer: Any, pl_module: Any) -> None:
        """Before the first step: no scheduler of the user's (the budget drives the rate), a fit of
        known length, long enough for every decision."""
        if trainer.lr_scheduler_configs:
            names = ", ".join(type(c.scheduler).__name__ for c in trainer.lr_scheduler_configs)
            raise ValueError(f"configure_optimizers: schedule=Budget() drives the learning rate over the fit's "
                             f"compute budget (warmup, the stable peak, a linear decay over its last part, so the "
                             f"budget's end anneals the network whatever depth it grew to), but the module returns "
                             f"a scheduler ({names}) that would fight it; expected the optimizer alone. Fix: return "
                             "only the optimizer (its lr is the peak; Budget(warmup=, decay=, min_lr_ratio=) shape "
                             "the rest), or pass schedule='converged' to keep your scheduler. Nothing was trained.")
        total = trainer.estimated_stepping_batches
        if not isinstance(total, (int, float)) or not math.isfinite(total) or total < 1:
            raise ValueError(f"max_steps/max_epochs: schedule=Budget() reads the budget from the fit's length, but it "
                             f"is {total!r}. Fix: set max_steps (or max_epochs) on the Trainer.")  # fmt: skip
        if self.plan is None:  # a fit too short for any decision says so before it trains
            when, what = self.schedule, self.decision
            problem = plan_problem(int(total), growth_phase=when.growth_phase, checks=when.checks, fork=what.fork,
                                   decay=when.decay, warmup=when.warmup, min_fork_steps=MIN_FORK_STEPS)  # fmt: skip
            if problem is not None:
                raise ValueError(f"GrowUntilSaturated: schedule=Budget(): {problem}. Nothing was trained.")
        self._total_steps = int(total)
        optimizer = editor.optimizer_for(trainer, self.cb._network)
        for group in optimizer.param_groups if optimizer is not None else []:
            group.setdefault("peak_lr", float(group["lr"]))  # the optimizer's rate is the peak (saved with it)

    # -- the FLOP count ---------------------------------------------------------------------------
    def _per_sample(self, pl_module: Any, x: torch.Tensor, module: nn.Module | None = None) -> float:
        """Forward FLOPs of one sample with ``module`` in the network's place (``None``: the network)."""
        network = self.cb._network
        module = module or network
        key = sum(p.numel() for p in module.parameters())
        if key not in self._flops:  # counted once per size, on forked generators (a resumed fit counts again)
            with swapped(pl_module, network, module) as host, forked_rng(pl_module.trainer, x.device):
                self._flops[key] = float(forward_flops(host, x))
        return self._flops[key]

    def progress(self, trainer: Any) -> float:
        """Fraction of the budget behind the rate: FLOPs spent, or steps when a smaller last batch lags them."""
        return max(self.spent / self.plan.total_flops, trainer.global_step / max(1, self._total_steps))

    def rate(self, trainer: Any) -> float:
        return self.plan.lr_factor(self.progress(trainer) * self.plan.total_flops)

    @staticmethod
    def _set_rates(optimizer: torch.optim.Optimizer | None, factor: float) -> None:
        for group in optimizer.param_groups if optimizer is not None else []:
            group["lr"] = float(group.get("peak_lr", group["lr"])) * factor

    # -- hooks ------------------------------------------------------------------------------------
    def batch_start(self, trainer: Any, pl_module: Any, batch: Any) -> None:
        x = _inputs(batch)
        if self.plan is None:
            when = self.schedule
            per_step = 3.0 * self._per_sample(pl_module, x) * int(x.shape[0]) * trainer.accumulate_grad_batches
            self.plan = BudgetPlan(total_flops=self._total_steps * per_step * max(1, trainer.world_size),
                                   steps=self._total_steps, growth_phase=when.growth_phase, checks=when.checks,
                                   fork=self.decision.fork, decay=when.decay, warmup=when.warmup,
                                   min_lr_ratio=when.min_lr_ratio)  # fmt: skip
            if self.cb.verbose:
                rank_zero_info(f"GrowUntilSaturated: {self.plan.describe(self.cb.start_depth)}")
        self._set_rates(editor.optimizer_for(trainer, self.cb._network), self.rate(trainer))

    def batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        x = _inputs(batch)
        self.spent += 3.0 * self._per_sample(pl_module, x) * int(x.shape[0]) * max(1, trainer.world_size)
        if self.decision.statistic == "steps":
            self._record_loss(trainer, outputs)
        stepped, self._seen_step = int(trainer.global_step) != self._seen_step, int(trainer.global_step)
        if self.fork_state is not None:
            self._fork_step(trainer, pl_module, batch, batch_idx, x)
        elif (stepped and self.cb.finished is None and self.next_point < self.schedule.checks
              and self.spent >= self.plan.point_flops(self.next_point)):  # fmt: skip
            # only right after an optimizer step: a fork opened mid-accumulation would train its first step on
            # the step's last micro-batches alone
            self._open(trainer, pl_module, x)
        if self.spent >= self.plan.total_flops * (1 - 1e-9):
            trainer.should_stop = True

    def _record_loss(self, trainer: Any, outputs: Any) -> None:
        """The run's training loss at this optimizer step (the "steps" statistic's learning curve)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not torch.is_tensor(loss):
            raise ValueError(f"BudgetFork.statistic='steps': prices steps on the run's training losses, but "
                             f"training_step returned {type(outputs).__name__}, not the loss. Fix: return the loss "
                             "(or a dict with 'loss') from training_step, or pass BudgetFork(statistic='carried').")
        # every batch (under gradient accumulation, several at one step): the fit's bins average them
        self.curve.append((int(trainer.global_step), loss.detach()))
        horizon = 4 * max(1, int(self.decision.fork * self._total_steps)) * trainer.accumulate_grad_batches
        if len(self.curve) > 2 * horizon:
            del self.curve[: len(self.curve) - horizon]

    # -- the fork ---------------------------------------------------------------------------------
    def _build(self, trainer: Any, pl_module: Any, sites: list[str], seed: int) -> None:
        network = self.cb._network
        optimizer = editor.optimizer_for(trainer, network)
        added = iter(range(len(network.growth_log), len(network.growth_log) + len(sites)))

        def groups(block, arm_opt):  # the groups growth would give each block (growtrain.reconfigure)
            new, refs = new_param_groups(pl_module, block, next(added), arm_opt)
            add_param_groups(arm_opt, new)
            return refs

        # on a fork of the random generators: building the arm (a seeded block) must not move the run's draws, or a
        # fit resumed with a fork open (which builds it again) would see other batches than the uninterrupted one
        with forked_rng(trainer, next(network.parameters()).device):
            self.arm, self.arm_opt, _, _ = make_arm(network, optimizer, sites, seed, new_groups=groups)
        self._ramped = []
        for block in grown_blocks(self.arm)[-len(sites):]:
            # a stage's first added block has no copy: it stays zero
            if start_block(self.arm, block, self.cb.insertion) and self.cb.insertion == "copy_ramp":
                attach_mask(block, 0.0)  # the copy behind a mask at 0: the arm starts as the run's function
                self._ramped.append(block)

    def _ramp_to(self, arm_steps: int) -> None:
        """``copy_ramp``: the arm's masks at ``arm_steps`` of a ramp over the fork's first quarter (so the
        arm the run adopts holds plain blocks: a mask at 1 is removed)."""
        ramp = max(1, self.fork_state["arm_target"] // 4)
        for block in self._ramped:
            if mask_value(block) is not None:
                set_mask(block, min(1.0, arm_steps / ramp))

    def _open(self, trainer: Any, pl_module: Any, x: torch.Tensor) -> None:
        start = time.perf_counter()
        network = self.cb._network
        sites = [f"{stage}.{len(network.stage(stage))}" for stage in network.growable_stages]
        k = self.next_point
        self._build(trainer, pl_module, sites, seed=self.cb.seed * 1000 + k)
        batch = int(x.shape[0]) * trainer.accumulate_grad_batches * max(1, trainer.world_size)  # one optimizer step
        run_step = 3.0 * self._per_sample(pl_module, x) * batch
        arm_step = 3.0 * self._per_sample(pl_module, x, self.arm) * batch
        change, tolerance = self.cb.output_change(trainer, pl_module, self.arm)
        steps = self.decision.statistic == "steps"
        self.fork_state = {"sites": sites, "k": k, "spent": self.spent, "step": int(trainer.global_step),
                           "function_preserving": change <= tolerance, "max_abs_change": change,
                           "tolerance": tolerance, "run_step_flops": run_step, "arm_step_flops": arm_step,
                           "run_target": fork_steps(self.plan.fork_flops, run_step), "run_steps": 0, "arm_steps": 0,
                           # equal steps under "steps" (capacity compared; the steps' price comes later)
                           "arm_target": fork_steps(self.plan.fork_flops, run_step if steps else arm_step),
                           "last_step": int(trainer.global_step)}  # fmt: skip
        self._ramp_to(0)
        self.ema = {"run": _ema_init(network), "arm": _ema_init(self.arm)}
        self.next_point += 1
        self.cb.add_seconds(time.perf_counter() - start)
        if self.cb.verbose:
            f = self.fork_state
            kept = "function-preserving" if f["function_preserving"] else "NOT function-preserving"
            rank_zero_info(f"GrowUntilSaturated: decision {k + 1} at {100 * self.spent / self.plan.total_flops:.1f} % "
                           f"of the budget: a copy with one more block at {', '.join(sites)} ({self.cb.insertion}: "
                           f"{kept}, output change {change:.3g}) trains {f['arm_target']} steps beside the run's "
                           f"{f['run_target']} ({'equal steps' if steps else 'equal FLOPs'})")  # fmt: skip

    def _rebuild(self, trainer: Any, pl_module: Any) -> None:
        """A checkpoint's open fork: the same construction, then its saved weights, optimizer state and averages."""
        f = self.fork_state
        self._build(trainer, pl_module, f["sites"], seed=self.cb.seed * 1000 + f["k"])
        self.arm.load_state_dict({**self.arm.state_dict(), **self._pending["arm"]})
        self._ramp_to(f["arm_steps"])  # a mask where the checkpoint had it, or gone once the ramp was done
        if self.arm_opt is not None and self._pending.get("arm_opt") is not None:
            self.arm_opt.load_state_dict(self._pending["arm_opt"])
        device = next(self.cb._network.parameters()).device
        self.ema = {side: {k: v.to(device) for k, v in ema.items()} for side, ema in self._pending["ema"].items()}
        self.half = self._pending.get("half")
        self._pending = None

    def _fork_step(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int, x: torch.Tensor) -> None:
        start = time.perf_counter()
        f, network = self.fork_state, self.cb._network
        if self.arm is None:
            self._rebuild(trainer, pl_module)
        training = f["arm_steps"] < f["arm_target"]
        if training:  # every micro-batch of the run's step, each weighted as in the run's
            self._set_rates(self.arm_opt, self.rate(trainer))
            train_sides(trainer, pl_module, network, [self.arm], batch, batch_idx)
            flops = 3.0 * self._per_sample(pl_module, x, self.arm) * int(x.shape[0]) * max(1, trainer.world_size)
            self.spent += flops
            self.decision_flops += flops
        if int(trainer.global_step) == f["last_step"]:  # gradient accumulation: the run has not stepped yet
            self.cb.add_seconds(time.perf_counter() - start)
            return
        f["last_step"] = int(trainer.global_step)
        f["run_steps"] += 1
        _ema_update(self.ema["run"], network, 1.0 - 4.0 / max(4.0, f["run_target"]))
        if training:
            PairedFork._step(trainer, self.arm, self.arm_opt)
            f["arm_steps"] += 1
            self._ramp_to(f["arm_steps"])
            _ema_update(self.ema["arm"], self.arm, 1.0 - 4.0 / max(4.0, f["arm_target"]))
            if f["arm_steps"] == max(1, f["arm_target"] // 2):  # the arm halfway (in its FLOPs): kept until the run's
                self.ema["arm_half"] = {k: v.clone() for k, v in self.ema["arm"].items()}
        if f["run_steps"] == max(1, f["run_target"] // 2) and self.half is None:  # both sides halfway, equal FLOPs
            c, a = self._score(trainer, pl_module, [(network, self.ema["run"]), (self.arm, self.ema.pop("arm_half"))])
            self.half = torch.stack([c, a])
        self.cb.add_seconds(time.perf_counter() - start)
        if f["run_steps"] >= f["run_target"]:
            self._decide(trainer, pl_module)

    def _score(self, trainer: Any, pl_module: Any, sides: list) -> list[torch.Tensor]:
        """Each probe sample's loss under each ``(module, averaged weights)`` side (the FLOPs spent)."""
        network = self.cb._network
        probe = self.cb.probe_loader(trainer, shard=False)
        device = next(network.parameters()).device
        losses = []
        for module, ema in sides:
            averaged = _averaged(module, ema)
            with swapped(pl_module, network, averaged) as host:
                losses.append(probe_sample_losses(trainer, ProbeView(host, averaged), probe, self.cb._loss, device))
            per = self._per_sample(pl_module, to_device(first_input(Converted(probe, trainer)), device), module)
            self.decision_flops += per * losses[-1].numel()
            self.spent += per * losses[-1].numel()
        return losses

    # -- the decision -----------------------------------------------------------------------------
    def _decide(self, trainer: Any, pl_module: Any) -> None:
        start = time.perf_counter()
        f, network, what = self.fork_state, self.cb._network, self.decision
        control, arm = self._score(trainer, pl_module, [(network, self.ema["run"]), (self.arm, self.ema["arm"])])
        figures = self._figures(trainer, control, arm, seed=self.cb.seed * 1000 + f["k"])
        if trainer.world_size > 1:  # one decision on every rank: rank 0's (each rank's curve saw its own batches)
            figures = trainer.strategy.broadcast(figures, src=0)
        judged = figures[what.statistic]
        grow, certified = budget_verdict(judged["lower_frac"], judged["upper_frac"], what.min_gain)
        depth = int(network.depth())
        entry = {"decision": f["k"], "spent": f["spent"] / self.plan.total_flops, "statistic": what.statistic,
                 "opened_step": f["step"], "n": figures["fork"]["n"],
                 "run_steps": f["run_steps"], "arm_steps": f["arm_steps"], "min_gain": what.min_gain,
                 "insertion": self.cb.insertion, "function_preserving": f["function_preserving"],
                 "max_abs_change": f["max_abs_change"], "tolerance": f["tolerance"],
                 "lower_frac": judged["lower_frac"], "upper_frac": judged["upper_frac"],
                 "gain_frac": judged["gain_frac"], **{f"{s}_{k}": v for s, d in figures.items() if d for k, v in d.items()}}  # fmt: skip
        if trainer.world_size > 1:  # rank 0's record too (each rank measured the arm's start on its own BatchNorm stats)
            entry = trainer.strategy.broadcast(entry, src=0)
            f.update({k: entry[k] for k in ("function_preserving", "max_abs_change", "tolerance")})
        said = _sentence(f, figures, what, self.cb.insertion, self.cb.alpha)
        if grow:
            kept = "function-preserving" if f["function_preserving"] else "NOT function-preserving"
            reason = (f"one more block pays for its compute: {said} > min_gain {100 * what.min_gain:.2f} %; the run "
                      f"takes the arm ({kept} at insertion)")  # fmt: skip
            action, sites = "grow", list(f["sites"])
        else:
            head = "certified not to pay" if certified else "not certified to pay"
            reason = f"growth ended at {depth} blocks: one more block was {head} for its compute: {said}"
            action, sites = "saturated", []
        self.cb.add_seconds(time.perf_counter() - start)
        self.cb.decided(trainer, pl_module, action, reason, sites, certified, entry,
                        adopt=lambda: self._adopt(trainer, pl_module),
                        last=self.next_point >= self.schedule.checks)  # fmt: skip
        self.arm, self.arm_opt, self.ema, self.fork_state, self.half = None, None, None, None, None

    def _figures(self, trainer: Any, control: torch.Tensor, arm: torch.Tensor, seed: int) -> dict:
        """Every statistic's figures, as fractions of the run's probe loss: the fork's gain at its end
        (``fork``), halfway (``half``), carried to the budget's end (``carried``) and, for ``steps``, the
        equal-steps gain carried to the budget's end less the price of fewer steps."""
        f, what, alpha = self.fork_state, self.decision, self.cb.alpha
        test = fork_test(control, arm, min_gain=what.min_gain, level=alpha, seed=seed)
        keys = ("gain_frac", "lower_frac", "upper_frac")
        m = math.log2(max(self.plan.total_flops - f["spent"], self.plan.fork_flops) / self.plan.fork_flops)
        c1, a1 = self.half if self.half is not None else (control, arm)
        far = fork_test(carried(control, c1, m), carried(arm, a1, m), min_gain=what.min_gain, level=alpha,
                        seed=seed + 1)  # fmt: skip
        half = fork_test(c1, a1, min_gain=what.min_gain, level=alpha, seed=seed + 2)
        out = {"fork": {**{k: test[k] for k in (*keys, "loss_before", "loss_now", "n", "se")}},
               "carried": _fractions(far, test["loss_before"]) | {"log2_horizon": m},
               "half": {k: half[k] for k in (*keys, "loss_before")}, "steps": None}  # fmt: skip
        if what.statistic == "steps":
            out["steps"] = self._priced(trainer, test, control, arm, c1, a1, seed + 3)
        return out

    def _priced(self, trainer: Any, test: dict, control: torch.Tensor, arm: torch.Tensor, c1: torch.Tensor,
                a1: torch.Tensor, seed: int) -> dict:  # fmt: skip
        """The equal-steps gain carried to the budget's end, less the price of fewer steps
        (growtrain.budget.steps_cost), as fractions of the run's probe loss.

        A copied block's equal-steps gain is still rising when a short fork ends (on the language model
        it rose from halfway to the end in every seed), so it is carried on linearly in log steps from the
        halfway and final scores to the steps the deeper network would train to the budget's end. The
        bound covers the probe's sampling of that carried gain; the price is an estimate on the run's own
        curve, outside the bound."""
        f, what = self.fork_state, self.decision
        left = max(self.plan.total_flops - self.spent, 0.0)  # after the fork and its scoring
        now = int(trainer.global_step)
        end_run, end_arm = now + left / f["run_step_flops"], now + left / f["arm_step_flops"]
        m = math.log2(max(end_arm - f["step"], f["run_target"]) / f["run_target"])  # doublings past the fork
        far = fork_test(carried(control, c1, m), carried(arm, a1, m), min_gain=what.min_gain, level=self.cb.alpha,
                        seed=seed)  # fmt: skip
        gain = _fractions(far, test["loss_before"])
        window = [(a, b) for a, b in self.curve if a >= f["step"] - f["run_target"]]  # as long before the fork as it
        steps = torch.tensor([a for a, _ in window], dtype=torch.float64)
        device = next(self.cb._network.parameters()).device  # a resumed curve holds floats, a live one tensors
        losses = torch.stack([torch.as_tensor(b).to(device, torch.float64) for _, b in window]).cpu()  # one sync
        cost, slope = steps_cost(steps, losses, end_run=end_run, end_arm=end_arm,
                                 exponent=budget_math.COST_EXPONENT)  # read here: the rows vary it
        frac = cost / test["loss_before"]
        return {"cost_frac": frac, "curve_A": slope, "end_run": end_run, "end_arm": end_arm, "log2_steps": m,
                **{f"carried_{k}": v for k, v in gain.items()},
                **{k: gain[k] - frac for k in ("gain_frac", "lower_frac", "upper_frac")}}  # fmt: skip

    def _adopt(self, trainer: Any, pl_module: Any) -> dict:
        """The run grows the arm's blocks (zero-output, checked) and takes the arm's weights and state."""
        network, f = self.cb._network, self.fork_state
        blocks = {s: network.new_block(s, seed=self.cb.seed * 1000 + f["k"] + i) for i, s in enumerate(f["sites"])}
        done = self.cb.insert(trainer, pl_module, blocks)
        adopt(network, editor.optimizer_for(trainer, network), self.arm, self.arm_opt)
        return done

    # -- the end ----------------------------------------------------------------------------------
    def fit_end(self, trainer: Any) -> str | None:
        """The budget's line of the end-of-fit summary; a warning when the fit stopped before the
        budget's end (the network handed over is then not annealed)."""
        if self.plan is None:
            return None
        total = self.plan.total_flops
        line = (f"budget {total / 1e12:.3g} TFLOP: spent {100 * self.spent / total:.1f} %, deciding "
                f"{100 * self.decision_flops / total:.1f} % of it; the rate ended at {self.rate(trainer):.3g}× the peak")
        if self.spent < total * (1 - 1e-6) and self.progress(trainer) < 1.0:
            rank_zero_warn(f"GrowUntilSaturated: {line}. The fit stopped before its budget was spent, so the rate did "
                           "not finish its decay: the network handed over is NOT annealed. Fix: let the fit run to "
                           "its max_steps/max_epochs (no other callback stopping it), or resume it.")  # fmt: skip
        return line


def _fractions(test: dict, loss: float) -> dict:
    """A carried test's gain and bounds as fractions of the run's final probe loss ``loss``: the carried
    losses themselves may extrapolate below zero (a fast-falling image loss), their paired gain not."""
    scale = loss if loss > 0 else float("nan")
    return {"gain_frac": test["mean"] / scale, "lower_frac": test["lower"] / scale, "upper_frac": test["upper"] / scale}


def _sentence(f: dict, figures: dict, what: Any, insertion: str, alpha: float) -> str:
    """What a decision measured, in words: the fork, its bounds, and each statistic's figure."""
    test, half, far, priced = figures["fork"], figures["half"], figures["carried"], figures["steps"]
    said = (f"over {100 * what.fork:.1f} % of the budget at equal {'steps' if what.statistic == 'steps' else 'FLOPs'} "
            f"({f['arm_steps']} steps against the run's {f['run_steps']}), one more block at {', '.join(f['sites'])} "
            f"({insertion}) changed the probe loss by {100 * test['gain_frac']:+.2f} % (at least "
            f"{100 * test['lower_frac']:+.2f} %, at most {100 * test['upper_frac']:+.2f} %, {100 * (1 - alpha):.0f} % "
            f"bounds, n={test['n']}, weights averaged over the fork; halfway {100 * half['gain_frac']:+.2f} %; carried "
            f"to the budget's end {100 * far['gain_frac']:+.2f} %, at least {100 * far['lower_frac']:+.2f} %)")  # fmt: skip
    if priced is not None:
        said += (f"; at equal steps carried to the budget's end ({priced['log2_steps']:.1f} doublings of the fork's "
                 f"steps) {100 * priced['carried_gain_frac']:+.2f} %; the fewer steps a deeper network affords cost "
                 f"{100 * priced['cost_frac']:.2f} % on the run's curve (to step {priced['end_arm']:.0f} instead of "
                 f"{priced['end_run']:.0f}), so it pays {100 * priced['gain_frac']:+.2f} %, at least "
                 f"{100 * priced['lower_frac']:+.2f} %")  # fmt: skip
    return said
