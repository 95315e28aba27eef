"""``GrowForBudget``: grow early in a fit's compute budget while one more block pays for its compute.

The question a user brings: *I have this much compute; how deep should the network be?* The
answer depends on the budget (a scaling law), so the callback reads it from the trainer
(growtrain/budget.py: the fit's optimizer steps at the start depth, in FLOPs) and decides inside it.
Three parts:

    when    — a decision at each of ``checks`` points spread over the first ``growth_phase`` of the
              budget; the rate is warmup-stable-decay over the budget (the callback drives it), so
              every decision lands at the stable rate and the budget's end anneals the final network
    decides — an equal-FLOP fork: a copy of the network with one more block on top of every stage
              (``insertion``) trains on the run's next batches for ``fork`` of the budget while the
              run trains on the same batches for the same FLOPs (the deeper arm takes fewer steps,
              so training progress is not credited to depth); both are scored on the held-out probe
              with their weights averaged over the fork (EMA, Hägele et al. 2024: most of a cooldown's
              gain without one); grow iff the arm's probe loss is below the run's by a certified more
              than ``min_gain`` of it (paired bootstrap-t bound, ``growtrain.fork.fork_test``); with
              ``statistic="steps"`` the arm takes as many steps as the run instead, and its gain, carried
              to the budget's end, is charged what fewer steps cost on the run's own learning curve
    inserts — the run grows the same blocks and takes the arm's weights and optimizer state
              (``growtrain.fork.adopt``; the new parameters' groups from the editor)

What it certifies is what the fork measured: at equal compute over the fork, the deeper network
was ahead on held-out data. A deeper network that would only pay later in the budget is not seen
(short-horizon bias: the fork favours the shallower side), so growth ends early rather than late.
Every FLOP the forks and their scoring spend comes out of the same budget.

Not yet: DDP/FSDP2 (refused at setup), a user's own learning-rate scheduler (refused: the
callback's WSD is the schedule), ``insertion="copy_ramp"``.
"""

from __future__ import annotations

import copy
import math
import time
from typing import Any, Callable

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn

from growtrain import insertion as ins
import growtrain.budget as budget_math
from growtrain.budget import BudgetPlan, budget_verdict, carried, fork_steps, plan_problem, steps_cost
from growtrain.callbacks import editor, probe_check, telemetry
from growtrain.callbacks.compute import _inputs, forward_flops
from growtrain.callbacks.fork_check import PairedFork, swapped
from growtrain.batches import to_device
from growtrain.callbacks.probe_data import Converted, ProbeView, eval_output, first_input, probe_sample_losses
from growtrain.fork import adopt, fork_test, make_arm
from growtrain.growable import grown_blocks, insertion_tolerance, probe_loss_for, resolve_network
from growtrain.reconfigure import add_param_groups, new_param_groups

__all__ = ["GrowForBudget", "INSERTIONS", "STATISTICS"]

INSERTIONS = ("copy", "zero")
# What a decision judges (docs/budget.md): "fork", the equal-FLOP fork's gain at its end; "carried", that
# gain carried to the budget's end linearly in log FLOPs from its halfway and final scores; "steps", the
# gain at equal optimizer steps less what the fewer steps a deeper network can afford cost by the budget's
# end on the run's own learning curve (growtrain.budget.steps_cost).
STATISTICS = ("fork", "carried", "steps")
# Fewest run steps a fork may have: below this the averaged weights are a handful of steps.
MIN_FORK_STEPS = 20


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
    twin.load_state_dict({**twin.state_dict(), **ema})
    return twin


class GrowForBudget(Callback):
    """Grow in the first part of the fit's compute budget while an equal-FLOP fork certifies that one
    more block (one per stage) lowers the held-out loss; then train the final network for the rest of
    the budget and anneal it (see the module docstring).

    The defaults (the equal-steps statistic, 3 % forks, 3 decisions over the first 30 %) are the rows'
    best so far, not a met target (docs/results.md: the equal-steps statistic): on the language model
    they found 3 blocks in four seeds of five, one short of growth's best.

    Quick start (the budget is the trainer's; the optimizer's rate is the peak)::

        trainer = lightning.Trainer(max_steps=6000, callbacks=[GrowForBudget()])
        trainer.fit(LanguageModel(n_layer=2), TextDataModule())

    Args:
        probe: held-out DataLoader of ``(input, target)`` in a fixed order (or a callable returning
            one); ``None``: ``trainer.datamodule.probe_dataloader()``.
        network: the growable network: ``None`` (found), a dotted attribute path, or the module.
        loss_fn: ``loss_fn(output, target)`` → mean loss the probe is scored with; ``None``: the module's
            ``probe_loss``, else cross-entropy. The arm trains on the module's own ``training_step``.
        growth_phase: fraction of the budget by which the last decision opens.
        checks: decisions in the growth phase (evenly spaced; growth ends at the first that does not grow).
        fork: fraction of the budget each decision trains over (each side).
        min_gain: fraction of the run's probe loss the arm must certifiably gain.
        alpha: error probability of each decision's bound.
        insertion: how the arm's block starts: ``"copy"`` (the block below's weights, G_stack: changes
            the function) or ``"zero"`` (the paper's zero terminal map: function-preserving).
        statistic: what a decision judges. ``"fork"``: the equal-FLOP fork's gain at its end.
            ``"carried"``: that gain carried to the budget's end: each side is also scored halfway (at half
            its FLOPs), and the per-sample gain is carried on linearly in log FLOPs,
            ``g(τ) = g₂ + (g₂ − g₁)·log₂(τ/τ₂)``, to τ = the FLOPs left in the budget when the fork opened
            (the bound is on that combination of paired gains). ``"steps"``: the arm trains as many steps
            as the run (not FLOPs: capacity, not progress, is compared), and its certified gain is charged
            what fewer steps for the rest of the budget cost on the run's own learning curve,
            ``L(S) = E + A·S^(−½)`` fitted to its training losses over the fork and as long before it
            (``growtrain.budget.steps_cost``); the module's ``training_step`` must return its loss.
            Every statistic's figures are recorded at every decision.
        decay: fraction of the budget at its end over which the rate decays linearly.
        warmup: fraction of the budget over which the rate warms up.
        min_lr_ratio: the rate at the budget's end, as a fraction of the peak.
        seed: the arm's new blocks draw from ``seed·1000 + decision``.
        verbose: a line per decision and a summary at the end (rank 0).

    Attributes:
        history: one dict per decision (``spent``, ``depth_before``, ``sites``, ``steps``, the test's
            figures, ``action``, ``reason``).
        spent, decision_flops: FLOPs spent so far (run and decisions), and the decisions' part.
    """

    def __init__(self, probe: Any = None, network: str | nn.Module | None = None,
                 loss_fn: Callable[[Any, Any], torch.Tensor] | None = None, growth_phase: float = 0.3,
                 checks: int = 3, fork: float = 0.03, min_gain: float = 0.0, alpha: float = 0.05,
                 insertion: str = "copy", statistic: str = "steps", decay: float = 0.2, warmup: float = 0.01, min_lr_ratio: float = 0.1,
                 seed: int = 0, verbose: bool = True):  # fmt: skip
        super().__init__()
        for name, value, low, high in (("growth_phase", growth_phase, 0.0, 1.0), ("fork", fork, 0.0, 1.0),
                                       ("decay", decay, 0.0, 1.0), ("alpha", alpha, 0.0, 1.0)):  # fmt: skip
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and low < value < high):
                raise ValueError(f"{name}: expected a fraction in ({low:g}, {high:g}), got {value!r}")
        for name, value in (("warmup", warmup), ("min_lr_ratio", min_lr_ratio), ("min_gain", min_gain)):
            if not (isinstance(value, (int, float)) and not isinstance(value, bool) and 0.0 <= value < 1.0):
                raise ValueError(f"{name}: expected a fraction in [0, 1), got {value!r}")
        if isinstance(checks, bool) or not isinstance(checks, int) or checks < 1:
            raise ValueError(f"checks: expected an integer >= 1 (decisions in the growth phase), got {checks!r}")
        if statistic not in STATISTICS:
            raise ValueError(f"statistic: expected one of {STATISTICS}, got {statistic!r}. Fix: statistic='carried'")
        if insertion not in INSERTIONS:
            raise ValueError(f"insertion: expected one of {INSERTIONS}, got {insertion!r}. Fix: insertion='copy'")
        problem = plan_problem(10**9, growth_phase=growth_phase, checks=checks, fork=fork, decay=decay, warmup=warmup,
                               min_fork_steps=MIN_FORK_STEPS)  # the fractions alone, before any fit
        if problem is not None:
            raise ValueError(problem)
        self.probe, self.network_spec, self.loss_fn = probe, network, loss_fn
        self.growth_phase, self.checks, self.fork, self.min_gain = float(growth_phase), checks, float(fork), float(min_gain)
        self.alpha, self.insertion, self.decay, self.warmup = float(alpha), insertion, float(decay), float(warmup)
        self.statistic = statistic
        self.min_lr_ratio, self.seed, self.verbose = float(min_lr_ratio), int(seed), bool(verbose)
        self._network: nn.Module | None = None
        self._loss: Callable | None = None
        self._flops: dict[int, float] = {}  # forward FLOPs per sample, by parameter count
        self._groups = editor.ResumeGroups()
        self._reset()

    # -- state ------------------------------------------------------------------------------
    def _reset(self) -> None:
        self.plan: BudgetPlan | None = None
        self.spent = 0.0
        self.decision_flops = 0.0
        self.next_point = 0
        self.finished: str | None = None  # why growth ended
        self.history: list[dict] = []
        # (optimizer step, training loss) of each of the run's batches: "steps" prices steps on it. The losses stay
        # tensors on the network's device until a decision reads them: no host sync on the training step.
        self.curve: list[tuple[int, torch.Tensor | float]] = []
        self.start_depth: int | None = None
        self.fork_state: dict | None = None  # the open fork's counters (sites, steps, targets)
        self.arm: nn.Module | None = None
        self.arm_opt: torch.optim.Optimizer | None = None
        self.ema: dict[str, dict[str, torch.Tensor]] | None = None  # run, arm, and arm_half (the arm halfway)
        self.half: torch.Tensor | None = None  # the probe losses halfway: (run, arm) per sample
        self._pending: dict | None = None
        self.seconds = {"decisions": 0.0, "fit": 0.0}
        self._t0 = 0.0

    def state_dict(self) -> dict[str, Any]:
        state = {"plan": self.plan.as_dict() if self.plan else None, "spent": self.spent,
                 "decision_flops": self.decision_flops, "next_point": self.next_point, "finished": self.finished,
                 "history": telemetry.plain(self.history), "start_depth": self.start_depth,
                 "fork_state": copy.deepcopy(self.fork_state), "seconds": self._seconds(),
                 "curve": [[a, float(b)] for a, b in self.curve]}  # fmt: skip
        if self.arm is not None:
            state["arm"] = {k: v.detach().cpu().clone() for k, v in self.arm.state_dict().items() if torch.is_tensor(v)}
            state["arm_opt"] = self.arm_opt.state_dict() if self.arm_opt is not None else None
            state["ema"] = {side: {k: v.cpu().clone() for k, v in ema.items()} for side, ema in self.ema.items()}
            state["half"] = None if self.half is None else self.half.clone()
        elif self._pending is not None:
            state.update(self._pending)
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._reset()
        self.plan = BudgetPlan(**state["plan"]) if state.get("plan") else None
        self.spent, self.decision_flops = float(state.get("spent", 0.0)), float(state.get("decision_flops", 0.0))
        self.next_point, self.finished = int(state.get("next_point", 0)), state.get("finished")
        self.history = [dict(h) for h in state.get("history", [])]
        self.curve = [(int(a), float(b)) for a, b in state.get("curve", [])]
        self.start_depth, self.fork_state = state.get("start_depth"), state.get("fork_state")
        self.seconds = {k: float((state.get("seconds") or {}).get(k, 0.0)) for k in ("decisions", "fit")}
        if self.fork_state is not None and "arm" in state:
            self._pending = {k: state.get(k) for k in ("arm", "arm_opt", "ema", "half")}

    def _seconds(self) -> dict[str, float]:
        now = time.perf_counter()
        return {"decisions": self.seconds["decisions"],
                "fit": self.seconds["fit"] + (now - self._t0 if self._t0 else 0.0)}  # fmt: skip

    # -- setup: refuse early ------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        if trainer.world_size > 1:
            raise RuntimeError(f"GrowForBudget: runs on one device for now (world size {trainer.world_size}): the "
                               "fork's arm is not synchronised across ranks. Fix: devices=1, or GrowUntilSaturated "
                               "under DDP/FSDP2.")  # fmt: skip
        self._groups.forget()

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        self._groups.remember(checkpoint)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        # a resumed grown network under a plain optimizer: growth's groups (editor.py)
        self._groups.regroup(trainer, pl_module, resolve_network(pl_module, self.network_spec, required=False))

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        self._t0 = time.perf_counter()
        self._network = resolve_network(pl_module, self.network_spec, required=True)
        self._loss = probe_loss_for(pl_module, self.loss_fn)
        if self.start_depth is None:
            self.start_depth = int(self._network.depth())
        if trainer.lr_scheduler_configs:
            raise ValueError("configure_optimizers: GrowForBudget drives the learning rate over the budget "
                             "(warmup, the stable peak, a linear decay over its last part), so a scheduler of "
                             "your own would fight it. Fix: return only the optimizer; its lr is the peak.")  # fmt: skip
        total = trainer.estimated_stepping_batches
        if not isinstance(total, (int, float)) or not math.isfinite(total) or total < 1:
            raise ValueError(f"max_steps/max_epochs: GrowForBudget reads the budget from the fit's length, but it is "
                             f"{total!r}. Fix: set max_steps (or max_epochs) on the Trainer.")  # fmt: skip
        if self.plan is None:  # a fit too short for any decision says so before it trains
            problem = plan_problem(int(total), growth_phase=self.growth_phase, checks=self.checks, fork=self.fork,
                                   decay=self.decay, warmup=self.warmup, min_fork_steps=MIN_FORK_STEPS)  # fmt: skip
            if problem is not None:
                raise ValueError(f"GrowForBudget: {problem}")
        self._total_steps = int(total)
        # held out: the probe the decisions score must share no sample with any train loader
        probe_check.check_probe_independent(trainer, probe_check.probe_loader(self.probe, trainer, shard=False))
        optimizer = editor.optimizer_for(trainer, self._network)
        for group in optimizer.param_groups if optimizer is not None else []:
            group.setdefault("peak_lr", float(group["lr"]))  # the optimizer's rate is the peak (saved with it)

    # -- the FLOP count -------------------------------------------------------------------------
    def _per_sample(self, pl_module: LightningModule, x: torch.Tensor, module: nn.Module | None = None) -> float:
        """Forward FLOPs of one sample with ``module`` in the network's place (``None``: the network)."""
        module = module or self._network
        key = sum(p.numel() for p in module.parameters())
        if key not in self._flops:
            with swapped(pl_module, self._network, module) as host:
                self._flops[key] = float(forward_flops(host, x))
        return self._flops[key]

    def _progress(self, trainer: Trainer) -> float:
        """Fraction of the budget behind the rate: FLOPs spent, or steps when a smaller last batch lags them."""
        return max(self.spent / self.plan.total_flops, trainer.global_step / max(1, self._total_steps))

    def _set_rates(self, optimizer: torch.optim.Optimizer | None, factor: float) -> None:
        for group in optimizer.param_groups if optimizer is not None else []:
            group["lr"] = float(group.get("peak_lr", group["lr"])) * factor

    # -- hooks ----------------------------------------------------------------------------------
    def on_train_batch_start(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        x = _inputs(batch)
        if self.plan is None:
            per_step = 3.0 * self._per_sample(pl_module, x) * int(x.shape[0])
            self.plan = BudgetPlan(total_flops=self._total_steps * per_step, steps=self._total_steps,
                                   growth_phase=self.growth_phase, checks=self.checks, fork=self.fork,
                                   decay=self.decay, warmup=self.warmup, min_lr_ratio=self.min_lr_ratio)  # fmt: skip
            if self.verbose:
                rank_zero_info(f"GrowForBudget: {self.plan.describe(self.start_depth)}")
        factor = self.plan.lr_factor(self._progress(trainer) * self.plan.total_flops)
        self._set_rates(editor.optimizer_for(trainer, self._network), factor)

    def on_train_batch_end(self, trainer: Trainer, pl_module: LightningModule, outputs: Any, batch: Any,
                           batch_idx: int) -> None:  # fmt: skip
        x = _inputs(batch)
        self.spent += 3.0 * self._per_sample(pl_module, x) * int(x.shape[0])
        if self.statistic == "steps":
            self._record_loss(trainer, outputs)
        if self.fork_state is not None:
            self._fork_step(trainer, pl_module, batch, batch_idx, x)
        elif self.finished is None and self.next_point < self.checks and self.spent >= self.plan.point_flops(self.next_point):
            self._open(trainer, pl_module, x)
        if self.spent >= self.plan.total_flops:
            trainer.should_stop = True

    def _record_loss(self, trainer: Trainer, outputs: Any) -> None:
        """The run's training loss at this optimizer step (the "steps" statistic's learning curve)."""
        loss = outputs.get("loss") if isinstance(outputs, dict) else outputs
        if not torch.is_tensor(loss):
            raise ValueError(f"statistic='steps': prices steps on the run's training losses, but training_step "
                             f"returned {type(outputs).__name__}, not the loss. Fix: return the loss (or a dict "
                             "with 'loss') from training_step, or pass statistic='carried'.")  # fmt: skip
        # every batch (under gradient accumulation, several at one step): the fit's bins average them
        self.curve.append((int(trainer.global_step), loss.detach()))
        horizon = 4 * max(1, int(self.fork * self._total_steps)) * trainer.accumulate_grad_batches  # a window's use
        if len(self.curve) > 2 * horizon:
            del self.curve[: len(self.curve) - horizon]

    # -- the fork -------------------------------------------------------------------------------
    def _sites(self) -> list[str]:
        net = self._network
        return [f"{stage}.{len(net.stage(stage))}" for stage in net.growable_stages]

    def _build(self, trainer: Trainer, pl_module: LightningModule, sites: list[str], seed: int) -> None:
        network = self._network
        optimizer = editor.optimizer_for(trainer, network)
        added = iter(range(len(network.growth_log), len(network.growth_log) + len(sites)))

        def groups(block, arm_opt):  # the groups growth would give each block (growtrain.reconfigure)
            new, refs = new_param_groups(pl_module, block, next(added), arm_opt)
            add_param_groups(arm_opt, new)
            return refs

        self.arm, self.arm_opt, _, _ = make_arm(network, optimizer, sites, seed, new_groups=groups)
        if self.insertion == "copy":
            for block in self._new_blocks(self.arm, sites):
                if ins.neighbour_block(self.arm, block) is not None:  # a stage's first added block: stays zero
                    ins.copy_neighbour(self.arm, block)

    @staticmethod
    def _new_blocks(arm: nn.Module, sites: list[str]) -> list[nn.Module]:
        return grown_blocks(arm)[-len(sites):]

    def _open(self, trainer: Trainer, pl_module: LightningModule, x: torch.Tensor) -> None:
        start = time.perf_counter()
        sites = self._sites()
        k = len(self.history)
        self._build(trainer, pl_module, sites, seed=self.seed * 1000 + k)
        batch = int(x.shape[0])
        run_step = 3.0 * self._per_sample(pl_module, x) * batch
        arm_step = 3.0 * self._per_sample(pl_module, x, self.arm) * batch
        preserved = self._preserved(trainer, pl_module)
        self.fork_state = {"sites": sites, "k": k, "spent": self.spent, "step": int(trainer.global_step),
                           "function_preserving": preserved,
                           "run_target": fork_steps(self.plan.fork_flops, run_step), "run_step_flops": run_step,
                           "arm_step_flops": arm_step, "run_steps": 0, "arm_steps": 0,
                           # equal steps under "steps" (capacity compared; the steps' price comes later)
                           "arm_target": fork_steps(self.plan.fork_flops,
                                                    run_step if self.statistic == "steps" else arm_step),
                           "last_step": int(trainer.global_step)}  # fmt: skip
        self.ema = {"run": _ema_init(self._network), "arm": _ema_init(self.arm)}
        self.next_point += 1
        self.seconds["decisions"] += time.perf_counter() - start
        if self.verbose:
            f = self.fork_state
            rank_zero_info(f"GrowForBudget: decision {k + 1} at {100 * self.spent / self.plan.total_flops:.1f} % of the "
                           f"budget: a copy with one more block at {', '.join(sites)} ({self.insertion}: "
                           f"{'function-preserving' if preserved else 'NOT function-preserving'}) trains "
                           f"{f['arm_target']} steps beside the run's {f['run_target']} "
                           f"({'equal steps' if self.statistic == 'steps' else 'equal FLOPs'})")  # fmt: skip

    def _preserved(self, trainer: Trainer, pl_module: LightningModule) -> bool:
        """Did the arm start as the run's function? Measured on the probe's first batch, not assumed."""
        x = first_input(Converted(probe_check.probe_loader(self.probe, trainer, shard=False), trainer))
        x = to_device(x, next(self._network.parameters()).device)
        outs = []
        for module in (self._network, self.arm):
            with swapped(pl_module, self._network, module) as host:
                outs.append(eval_output(ProbeView(host, module), x).float())
        change = float((outs[1] - outs[0]).abs().max())
        return math.isfinite(change) and change <= insertion_tolerance(outs[0].dtype, float(outs[0].abs().max()))

    def _rebuild(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """A checkpoint's open fork: the same construction, then its saved weights, optimizer state and averages."""
        f = self.fork_state
        self._build(trainer, pl_module, f["sites"], seed=self.seed * 1000 + f["k"])
        self.arm.load_state_dict({**self.arm.state_dict(), **self._pending["arm"]})
        if self.arm_opt is not None and self._pending.get("arm_opt") is not None:
            self.arm_opt.load_state_dict(self._pending["arm_opt"])
        device = next(self._network.parameters()).device
        self.ema = {side: {k: v.to(device) for k, v in ema.items()} for side, ema in self._pending["ema"].items()}
        self.half = self._pending.get("half")
        self._pending = None

    def _fork_step(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int,
                   x: torch.Tensor) -> None:  # fmt: skip
        start = time.perf_counter()
        f = self.fork_state
        if self.arm is None:
            self._rebuild(trainer, pl_module)
        if int(trainer.global_step) == f["last_step"]:  # gradient accumulation: no optimizer step on this batch
            self.seconds["decisions"] += time.perf_counter() - start
            return
        f["last_step"] = int(trainer.global_step)
        f["run_steps"] += 1
        _ema_update(self.ema["run"], self._network, 1.0 - 4.0 / max(4.0, f["run_target"]))
        if f["arm_steps"] < f["arm_target"]:
            self._train_arm(trainer, pl_module, batch, batch_idx)
            f["arm_steps"] += 1
            _ema_update(self.ema["arm"], self.arm, 1.0 - 4.0 / max(4.0, f["arm_target"]))
            if f["arm_steps"] == max(1, f["arm_target"] // 2):  # the arm halfway (in its FLOPs): kept until the run's
                self.ema["arm_half"] = {k: v.clone() for k, v in self.ema["arm"].items()}
            arm_flops = 3.0 * self._per_sample(pl_module, x, self.arm) * int(x.shape[0])
            self.spent += arm_flops
            self.decision_flops += arm_flops
        if f["run_steps"] == max(1, f["run_target"] // 2) and self.half is None:  # both sides halfway, equal FLOPs
            c, a = self._score(trainer, pl_module, [(self._network, self.ema["run"]), (self.arm, self.ema.pop("arm_half"))])
            self.half = torch.stack([c, a])
        self.seconds["decisions"] += time.perf_counter() - start
        if f["run_steps"] >= f["run_target"]:
            self._decide(trainer, pl_module)

    def _train_arm(self, trainer: Trainer, pl_module: LightningModule, batch: Any, batch_idx: int) -> None:
        """One optimizer step of the arm on the batch the run just trained on, at the run's rate, on the
        module's own ``training_step`` (fork_check.PairedFork._train: logging nothing, the run untouched)."""
        network, arm = self._network, self.arm
        factor = self.plan.lr_factor(self._progress(trainer) * self.plan.total_flops)
        self._set_rates(self.arm_opt, factor)
        mine = {id(p) for p in network.parameters()}
        shared = [p for p in pl_module.parameters() if p.requires_grad and id(p) not in mine]
        saved = [None if p.grad is None else p.grad.detach().clone() for p in shared]
        with probe_check.forked_rng(trainer, next(network.parameters()).device):
            PairedFork._train(trainer, pl_module, network, arm, batch, batch_idx, accumulate=1)
        for p, grad in zip(shared, saved):  # a head outside the network is the run's: the arm does not train it
            p.grad = grad
        PairedFork._step(trainer, arm, self.arm_opt)

    def _score(self, trainer: Trainer, pl_module: LightningModule, sides: list) -> list[torch.Tensor]:
        """Each probe sample's loss under each ``(module, averaged weights)`` side; the FLOPs spent."""
        network = self._network
        probe = probe_check.probe_loader(self.probe, trainer, shard=False)
        device = next(network.parameters()).device
        losses = []
        for module, ema in sides:
            averaged = _averaged(module, ema)
            with swapped(pl_module, network, averaged) as host:
                losses.append(probe_sample_losses(trainer, ProbeView(host, averaged), probe, self._loss, device)[0])
            per = self._per_sample(pl_module, first_input(Converted(probe, trainer)).to(device), module)
            self.decision_flops += per * losses[-1].numel()
            self.spent += per * losses[-1].numel()
        return losses

    def _decide(self, trainer: Trainer, pl_module: LightningModule) -> None:
        start = time.perf_counter()
        f, network = self.fork_state, self._network
        control, arm = self._score(trainer, pl_module, [(network, self.ema["run"]), (self.arm, self.ema["arm"])])
        seed = self.seed * 1000 + f["k"]
        test = fork_test(control, arm, min_gain=self.min_gain, level=self.alpha, seed=seed)
        # the gain carried to the budget's end, linear in log FLOPs from the halfway and the final scores
        m = math.log2(max(self.plan.total_flops - f["spent"], self.plan.fork_flops) / self.plan.fork_flops)
        c1, a1 = self.half if self.half is not None else (control, arm)
        far = fork_test(carried(control, c1, m), carried(arm, a1, m), min_gain=self.min_gain, level=self.alpha,
                        seed=seed + 1)  # fmt: skip
        far_frac = {k: far[k] * far["loss_before"] / test["loss_before"] for k in ("gain_frac", "lower_frac", "upper_frac")}
        half = fork_test(c1, a1, min_gain=self.min_gain, level=self.alpha, seed=seed + 2)
        depth = int(network.depth())
        priced = self._priced(trainer, test, control, arm, c1, a1, seed + 3) if self.statistic == "steps" else None
        what = (f"over {100 * self.fork:.1f} % of the budget at equal "
                f"{'steps' if self.statistic == 'steps' else 'FLOPs'} ({f['arm_steps']} steps against the run's "
                f"{f['run_steps']}), one more block at {', '.join(f['sites'])} ({self.insertion}) changed the probe "
                f"loss by {100 * test['gain_frac']:+.2f} % (at least {100 * test['lower_frac']:+.2f} %, at most "
                f"{100 * test['upper_frac']:+.2f} %, {100 * (1 - self.alpha):.0f} % bounds, n={test['n']}, weights "
                f"averaged over the fork; halfway {100 * half['gain_frac']:+.2f} %; carried to the budget's end "
                f"{100 * far_frac['gain_frac']:+.2f} %, at least {100 * far_frac['lower_frac']:+.2f} %)")  # fmt: skip
        if priced is not None:
            what += (f"; at equal steps carried to the budget's end ({priced['log2_steps']:.1f} doublings of the fork's "
                     f"steps) {100 * priced['carried_gain_frac']:+.2f} %"
                     f"; the fewer steps a deeper network affords to the budget's end cost {100 * priced['cost_frac']:.2f} % "
                     f"on the run's curve (to step {priced['end_arm']:.0f} instead of {priced['end_run']:.0f}), so "
                     f"it pays {100 * priced['gain_frac']:+.2f} %, at least {100 * priced['lower_frac']:+.2f} %")  # fmt: skip
        judged = {"fork": test, "carried": far_frac, "steps": priced}[self.statistic]
        grow, certified = budget_verdict(judged["lower_frac"], judged["upper_frac"], self.min_gain)
        record = {"decision": f["k"], "spent": f["spent"] / self.plan.total_flops, "step": f["step"],
                  "depth_before": depth, "sites": list(f["sites"]), "run_steps": f["run_steps"],
                  "arm_steps": f["arm_steps"], "function_preserving": f.get("function_preserving"), "statistic": self.statistic, "log2_horizon": m,
                  **({f"priced_{k}": v for k, v in priced.items()} if priced is not None else {}),
                  "half_gain_frac": half["gain_frac"], "half_lower_frac": half["lower_frac"],
                  "half_loss_before": half["loss_before"],
                  **{f"far_{k}": v for k, v in far_frac.items()},
                  **{k: test[k] for k in ("gain_frac", "lower_frac", "upper_frac", "loss_before", "loss_now", "n",
                                          "se")}}  # fmt: skip
        if grow:
            self._adopt(trainer, pl_module)
            kept = "function-preserving" if f.get("function_preserving") else "NOT function-preserving"
            reason = f"grow: {what} > min_gain {100 * self.min_gain:.2f} %; the run takes the arm ({kept} at insertion)"
            record.update(action="grow", depth=int(network.depth()), reason=reason)
            if self.next_point >= self.checks:
                self.finished = "phase"
        else:
            head = "certified not to pay" if certified else "not certified to pay"
            reason = f"growth ended at {depth} blocks: one more block was {head} for its compute: {what}"
            record.update(action="stop", depth=depth, reason=reason, certified=certified)
            self.finished = "decision"
        self.arm, self.arm_opt, self.ema, self.fork_state, self.half = None, None, None, None, None
        self.history.append(telemetry.plain(record))
        self.seconds["decisions"] += time.perf_counter() - start
        telemetry.publish(trainer, {"growth/depth": float(network.depth())})
        if trainer.is_global_zero:
            telemetry.write_history(telemetry.history_path(trainer), self.history)
        if self.verbose:
            rank_zero_info(f"GrowForBudget: {reason}")

    def _priced(self, trainer: Trainer, test: dict, control: torch.Tensor, arm: torch.Tensor, c1: torch.Tensor,
                a1: torch.Tensor, seed: int) -> dict:  # fmt: skip
        """The equal-steps gain carried to the budget's end, less the price of fewer steps
        (growtrain.budget.steps_cost), as fractions of the run's probe loss.

        A copied block's equal-steps gain is still rising when a short fork ends (on the language model
        it rose from halfway to the end in every seed), so it is carried on linearly in log steps from the
        halfway and final scores to the steps the deeper network would train to the budget's end. The
        bound covers the probe's sampling of that carried gain; the price is an estimate on the run's own
        curve, outside the bound."""
        f = self.fork_state
        left = max(self.plan.total_flops - self.spent, 0.0)  # after the fork and its scoring
        now = int(trainer.global_step)
        end_run, end_arm = now + left / f["run_step_flops"], now + left / f["arm_step_flops"]
        m = math.log2(max(end_arm - f["step"], f["run_target"]) / f["run_target"])  # doublings past the fork
        far = fork_test(carried(control, c1, m), carried(arm, a1, m), min_gain=self.min_gain, level=self.alpha,
                        seed=seed)  # fmt: skip
        gain = {k: far[k] * far["loss_before"] / test["loss_before"] for k in ("gain_frac", "lower_frac", "upper_frac")}
        window = [(a, b) for a, b in self.curve if a >= f["step"] - f["run_target"]]  # as long before the fork as it
        steps = torch.tensor([a for a, _ in window], dtype=torch.float64)
        device = next(self._network.parameters()).device  # a resumed curve holds floats, a live one tensors
        losses = torch.stack([torch.as_tensor(b).to(device, torch.float64) for _, b in window]).cpu()  # one sync
        cost, slope = steps_cost(steps, losses, end_run=end_run,
                                 end_arm=end_arm, exponent=budget_math.COST_EXPONENT)  # read here: the rows vary it
        frac = cost / test["loss_before"]
        return {"cost_frac": frac, "curve_A": slope, "end_run": end_run, "end_arm": end_arm, "log2_steps": m,
                **{f"carried_{k}": v for k, v in gain.items()},
                **{k: gain[k] - frac for k in ("gain_frac", "lower_frac", "upper_frac")}}  # fmt: skip

    def _adopt(self, trainer: Trainer, pl_module: LightningModule) -> None:
        """The run grows the arm's blocks (zero-output, checked) and takes the arm's weights and state."""
        network, sites = self._network, self.fork_state["sites"]
        x = first_input(Converted(probe_check.probe_loader(self.probe, trainer, shard=False), trainer))
        blocks = {s: network.new_block(s, seed=self.seed * 1000 + self.fork_state["k"] + i) for i, s in enumerate(sites)}
        editor.grow(trainer, pl_module, network, blocks, x)
        adopt(network, editor.optimizer_for(trainer, network), self.arm, self.arm_opt)

    # -- the end --------------------------------------------------------------------------------
    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.plan is None or self._network is None:
            return
        secs = self._seconds()
        why = {None: "the growth phase had no decision left before the fit ended",
               "phase": f"the growth phase ended ({100 * self.growth_phase:.0f} % of the budget)",
               "decision": "a decision did not certify one more block"}[self.finished]  # fmt: skip
        summary = (f"GrowForBudget: {self.start_depth} → {self.depth} blocks; {why}; spent "
                   f"{100 * self.spent / self.plan.total_flops:.1f} % of the budget, decisions "
                   f"{100 * self.decision_flops / self.plan.total_flops:.1f} % of it and "
                   f"{100 * secs['decisions'] / max(secs['fit'], 1e-9):.1f} % of the wall time; the rate ended at "
                   f"{self.plan.lr_factor(self._progress(trainer) * self.plan.total_flops):.3g}× the peak")  # fmt: skip
        if self.spent < self.plan.total_flops * (1 - 1e-6) and self._progress(trainer) < 1.0:
            rank_zero_warn(f"{summary}. The fit stopped before its budget was spent, so the rate did not finish "
                           "its decay: the network handed over is not annealed.")  # fmt: skip
        elif self.verbose:
            rank_zero_info(summary)

    @property
    def depth(self) -> int | None:
        return int(self._network.depth()) if self._network is not None else None
