"""``PairedFork``: the paired-fork decision of ``GrowUntilSaturated`` (``decision="stage_fork"``).

A collaborator with its own state. At a check with no fork open it opens one with one more block at
the best first-order site of every stage (growtrain.fork says what a fork is); on every training batch after that the
arm takes one optimizer step on the batch the run just trained on, as the training step received
it (after the batch hooks and the transfer), on the module's own objective (its ``training_step``
run with the arm in the network's place, logging nothing: ``untouched``), under the trainer's
precision context, at the run's rate at that step, with the trainer's gradient clipping. Over the
horizon's last eighth a copy of the run and a copy of the arm, each with a copy of its optimizer,
are *cooled*: trained on the same batches with their rates annealed to zero (a cosine), while the
run and the arm go on at the run's rate. At the next check the two cooled copies are scored on the probe and the verdict is
``growtrain.fork.fork_verdict``'s: grow (the run grows the same block and takes the arm's weights
and optimizer state, not the cooled copy's, so the compute the arm spent is kept and the run stays
at its own rate), or the blocks did not pay: the arm is dropped (the run is the control, trained as
it would have been) and growth ends.

Why cooled: at the run's constant rate SGD wanders around its basin, and the probe loss with it.
On full Fashion-MNIST (experiments/fork_anneal.py) three arms differing only in the block's seed
scored -16 % to +1 % against the run at the constant rate one epoch into a fork; the same arms
cooled over 111 steps scored -0.8 % to +1.4 %, each within its paired se (about 1 %). A cooled
side is what the network would be if training ended there, which is what the block is worth to it.

What is held out from what: the probe is never trained on by the run, the arm or any earlier
network (the datamodule's probe split, disjoint from the training split by index, checked at
setup); no other sample is scored.

Under DDP each rank's arm steps on its own batches with gradients averaged across ranks (as DDP
does for the run), so the arms stay identical; rank 0's verdict is broadcast. FSDP2 is refused at
setup. The arm (weights and optimizer state) travels in the callback's checkpoint, so a resumed
fit judges the same fork.
"""

from __future__ import annotations

import copy
import math
import time
from contextlib import contextmanager
from typing import Any, Iterator, Mapping

import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torchmetrics import Metric

from growtrain.batches import to_device
from growtrain.callbacks.editor import optimizer_for
from growtrain.callbacks.probe_check import forked_rng
from growtrain.callbacks.probe_data import ProbeView, eval_output, probe_sample_losses
from growtrain.callbacks.trial_check import trial_candidates
from growtrain.fork import adopt, copy_optimizer, fork_test, fork_verdict, make_arm, mirror_lrs, warmup
from growtrain.reconfigure import add_param_groups, new_param_groups

__all__ = ["PairedFork", "output_of", "swapped", "train_sides", "untouched", "cosine", "COOL_FRACTION", "WARMUP_FRACTION"]

# The block's rate ramps up linearly over this fraction of the horizon (growtrain.fork.warmup says why).
WARMUP_FRACTION = 0.5
# The horizon's last fraction over which both sides' cooled copies anneal to zero before they are scored.
COOL_FRACTION = 0.125


def cosine(step: int, steps: int) -> float:
    """A cooled copy's rate factor at its ``step``-th optimizer step (1-based) of ``steps``: a
    cosine from 1 (the first step, at the rate it was copied with) towards 0."""
    return 0.5 * (1.0 + math.cos(math.pi * (step - 1) / max(1, steps)))


@contextmanager
def swapped(module: nn.Module, network: nn.Module, replacement: nn.Module) -> Iterator[nn.Module]:
    """The module whose forward and ``training_step`` run ``replacement`` where ``module`` runs
    ``network``: ``module`` itself with ``replacement`` swapped in for its submodule ``network``
    (matched by identity; everything outside the network is the module's own, shared and not
    trained by the arm); or, when the module *is* the growable network, ``replacement`` itself (a
    copy of the whole module then, made by ``make_arm``/``_copy``), with the module's trainer
    attached while it runs (a ``training_step`` may read ``self.trainer``). Why not a swap there:
    there is no attribute to swap, and running the module would run the run's own weights, so the
    arm would be trained and scored as the run (a gain of exactly 0: "certified saturation")."""
    if module is network:
        if replacement is module:
            yield module
            return
        attach = "_trainer" in vars(replacement)  # a LightningModule's copy: deepcopy left its trainer None
        if attach:
            replacement._trainer = vars(module).get("_trainer")
        try:
            yield replacement
        finally:
            if attach:
                replacement._trainer = None  # a copy that holds no trainer deep-copies and saves as it did
        return
    for name, parent in module.named_modules(remove_duplicate=False):
        for child_name, child in parent.named_children():
            if child is network:
                setattr(parent, child_name, replacement)
                try:
                    yield module
                finally:
                    setattr(parent, child_name, network)
                return
    raise RuntimeError("fork: the growable network is not a submodule of the LightningModule; the arm cannot run")


def output_of(pl_module: Any, network: nn.Module, x: Any, module: nn.Module | None = None) -> Any:
    """The network's output on ``x`` in eval mode, with ``module`` in its place (a fork's arm) if given."""
    x = to_device(x, next(network.parameters()).device)
    if module is None:
        return eval_output(ProbeView(pl_module, network), x)
    with swapped(pl_module, network, module) as host:
        return eval_output(ProbeView(host, module), x)


def _log_nothing(*args: Any, **kwargs: Any) -> None:
    return None


def _kept(name: str, value: Any, metric: bool) -> Any:
    # a metric updates its states in place (``self.total += x``, ``self.preds.append(x)``): keep copies of those;
    # so may a step with a container of its own (``self.seen.append(...)``): a shallow copy of a public list,
    # dict or set (torch's own ``_modules``/``_parameters``/... are kept as they are)
    if metric and torch.is_tensor(value):
        return value.clone()
    if isinstance(value, (list, dict, set)) and (metric or not name.startswith("_")):
        return copy.copy(value)
    return value


@contextmanager
def untouched(host: nn.Module, inside: nn.Module) -> Iterator[None]:
    """``host.training_step`` called for a copy (an arm or a cooled side, ``inside``): its
    ``self.log``/``self.log_dict`` log nothing, and every module of ``host`` outside ``inside`` gets
    its plain attributes back afterwards — a torchmetrics metric's running state and a public list,
    dict or set (updated in place, so copied), a figure the step caches on the module — so what the run logs and keeps is the run's
    alone. Parameters' gradients outside ``inside`` are the caller's (``batch_end``)."""
    mine = {id(m) for m in inside.modules()}
    saved = [(m, {k: _kept(k, v, isinstance(m, Metric)) for k, v in vars(m).items()})
             for m in host.modules() if id(m) not in mine]  # fmt: skip
    own = {k: vars(host)[k] for k in ("log", "log_dict") if k in vars(host)}
    vars(host).update(log=_log_nothing, log_dict=_log_nothing)  # instance attributes shadow the methods
    try:
        yield
    finally:
        for key in ("log", "log_dict"):
            vars(host).pop(key, None)
        vars(host).update(own)
        for module, attrs in saved:
            for key in [k for k in vars(module) if k not in attrs]:
                del vars(module)[key]
            vars(module).update(attrs)


def _step_args(host: Any, batch: Any, batch_idx: int) -> tuple:
    # as Lightning calls it: the batch index only when training_step takes a second argument
    takes_index = is_param_in_hook_signature(host.training_step, "batch_idx", min_args=2)
    return (batch, batch_idx) if takes_index else (batch,)


def _copy(module: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[nn.Module, Any]:
    """A deep copy of ``module`` and a copy of ``optimizer`` over it (state cloned, by identity)."""
    memo: dict[int, Any] = {}
    twin = copy.deepcopy(module, memo)
    mapping = {id(p): memo[id(p)] for p in module.parameters() if id(p) in memo}
    return twin, (copy_optimizer(optimizer, mapping) if optimizer is not None else None)


def _cpu(module: nn.Module) -> dict:
    # non-tensor entries (a growable network's growth record, its extra state) copied as they are
    return {k: v.detach().cpu().clone() if torch.is_tensor(v) else copy.deepcopy(v) for k, v in module.state_dict().items()}


def train_sides(trainer: Any, pl_module: Any, network: nn.Module, sides: list[nn.Module], batch: Any,
                batch_idx: int) -> None:  # fmt: skip
    """Forward and backward of every fork side (an arm, a cooled copy) on the batch the run just
    trained on: the module's own ``training_step`` with the side in the network's place, its loss
    divided by the trainer's gradient accumulation (each micro-batch counts as in the run's step),
    on a fork of the random generators (a side's dropout must not move the run's). The module's own
    parameters outside the network (a head the sides share) keep the run's gradients: under
    accumulation Lightning zeroes them once per step, so what a side's backward added would reach
    the run's next step. The one arm step every fork decision uses (``PairedFork``, ``BudgetRun``);
    ``PairedFork._step`` then steps a side once the run has stepped."""
    accumulate = max(1, int(getattr(trainer, "accumulate_grad_batches", 1) or 1))
    mine = {id(p) for p in network.parameters()}
    shared = [p for p in pl_module.parameters() if p.requires_grad and id(p) not in mine]
    saved = [None if p.grad is None else p.grad.detach().clone() for p in shared]
    with forked_rng(trainer, next(network.parameters()).device):
        for module in sides:
            PairedFork._train(trainer, pl_module, network, module, batch, batch_idx, accumulate)
    for p, grad in zip(shared, saved):
        p.grad = grad


class PairedFork:
    """Opens, trains and judges one fork at a time (see the module docstring)."""

    key = "fork"  # the check record's entry (history[i]["fork"])

    def __init__(self, *, min_gain: float, seed: int = 0, horizon: str = "the interval"):
        self.min_gain, self.seed, self.horizon = float(min_gain), int(seed), horizon
        self.forks = 0  # forks opened so far: seeds each arm's block and bootstrap
        self.site: str | None = None  # the open fork's site(s) in words (None: no fork open)
        self.sites: list[str] = []  # its sites
        self.opened: dict | None = None  # epoch and step at which it opened
        self.arm: nn.Module | None = None
        self.arm_opt: torch.optim.Optimizer | None = None
        self.refs: list[int] = []
        self.ratios: list[float] = []
        self.steps = 0  # arm optimizer steps since the fork opened
        # the cooled copies: [control, arm] with their optimizers, the rates they were copied with, steps taken
        self.cool: list[tuple[nn.Module, Any]] | None = None
        self.cool_lrs: list[list[float]] = []
        self.cool_steps = 0
        self._pending: dict | None = None  # a checkpoint's arm (and cooled copies), rebuilt at the first batch
        self._optimizer: torch.optim.Optimizer | None = None  # the run's optimizer the arm mirrors
        self._last_step: int | None = None  # trainer.global_step at the last arm step
        self.seconds = 0.0  # wall time of arm and cooled steps and scoring, this process (not saved)

    # -- state ----------------------------------------------------------------------------
    def state_dict(self) -> dict:
        state = {"forks": self.forks, "site": self.site,
                 "sites": list(self.sites),
                 "opened": self.opened, "steps": self.steps, "refs": list(self.refs), "ratios": list(self.ratios),
                 "cool_lrs": [list(v) for v in self.cool_lrs], "cool_steps": self.cool_steps}  # fmt: skip
        if self.arm is not None:
            state["arm"] = _cpu(self.arm)
            state["arm_opt"] = self.arm_opt.state_dict() if self.arm_opt is not None else None
            if self.cool is not None:
                state["cool"] = [{"net": _cpu(m), "opt": o.state_dict() if o is not None else None} for m, o in self.cool]
        elif self._pending is not None:
            state.update({k: v for k, v in self._pending.items() if k in ("arm", "arm_opt", "cool")})
        return state

    def load_state_dict(self, state: dict) -> None:
        self.forks = int(state.get("forks", 0))
        self.site, self.opened, self.steps = state.get("site"), state.get("opened"), int(state.get("steps", 0))
        self.sites = list(state.get("sites", []))
        self.refs, self.ratios = list(state.get("refs", [])), list(state.get("ratios", []))
        self.cool_lrs = [[float(x) for x in v] for v in state.get("cool_lrs", [])]
        self.cool_steps, self.cool = int(state.get("cool_steps", 0)), None
        self.arm, self.arm_opt, self._last_step = None, None, None
        self._pending = ({"arm": state["arm"], "arm_opt": state.get("arm_opt"), "cool": state.get("cool")}
                         if self.site and "arm" in state else None)  # fmt: skip

    def _seed(self, k: int) -> int:
        return self.seed * 100019 + k

    # -- the arm ----------------------------------------------------------------------------
    def _build(self, pl_module: Any, network: nn.Module, optimizer: Any, sites: list[str], seed: int) -> list[int]:
        """The arm at ``sites`` (block seeds from ``seed``) from the network and optimizer as they are now;
        the optimizer is kept, so a training batch does not look it up again."""

        added = iter(range(len(network.growth_log), len(network.growth_log) + len(sites)))

        def groups(block, arm_opt):  # the growth index each block would get when the run grows them
            new, refs = new_param_groups(pl_module, block, next(added), arm_opt)
            add_param_groups(arm_opt, new)
            return refs

        self.arm, self.arm_opt, _, refs = make_arm(network, optimizer, sites, seed, new_groups=groups)
        self._optimizer = optimizer
        return refs

    @staticmethod
    def check_module(pl_module: Any, name: str = "stage_fork") -> None:
        """At setup, before training: the arm steps through the module's ``training_step``, which
        under manual optimization steps the run's own optimizer (``self.optimizers()``)."""
        if not getattr(pl_module, "automatic_optimization", True):
            raise RuntimeError(f"decision: {name!r} trains its arm through {type(pl_module).__name__}."
                               "training_step, which under automatic_optimization=False would step the run's own "
                               "optimizer. Fix: use automatic optimization, or schedule='converged' with "
                               "decision='trial'.")  # fmt: skip

    def first_sites(self, report: Any) -> list[str] | None:
        """Where a fork opens after a growth or at the first check: the best first-order site of every stage."""
        return trial_candidates(report, limit=len(report.sites)) or None

    def open(self, pl_module: Any, network: nn.Module, optimizer: Any, site: str | list[str], *, epoch: int,
             step: int) -> None:  # fmt: skip
        """A fork at ``site`` (or at each of several sites): the arm from the network and optimizer as they are now."""
        sites = [site] if isinstance(site, str) else list(site)
        self.refs = self._build(pl_module, network, optimizer, sites, self._seed(self.forks))
        self.forks += 1
        n = len(optimizer.param_groups) if optimizer is not None else 0
        self.ratios = [float(self.arm_opt.param_groups[n + j]["lr"]) / float(optimizer.param_groups[r]["lr"])
                       if float(optimizer.param_groups[r]["lr"]) != 0 else 1.0
                       for j, r in enumerate(self.refs)] if optimizer is not None else []  # fmt: skip
        self.sites, self.site = sites, ", ".join(sites)
        self.opened, self.steps, self._last_step, self._pending = {"epoch": epoch, "step": step}, 0, step, None
        self.cool, self.cool_lrs, self.cool_steps = None, [], 0

    def close(self) -> None:
        self.sites = []
        self.site, self.opened, self.arm, self.arm_opt, self._pending = None, None, None, None, None
        self.refs, self.ratios, self.steps, self._optimizer = [], [], 0, None
        self.cool, self.cool_lrs, self.cool_steps = None, [], 0

    def _rebuild(self, pl_module: Any, network: nn.Module, optimizer: Any) -> None:
        """The arm of a checkpoint: the same construction (the block's seed does not matter: its
        weights are the saved ones), then its saved weights and optimizer state; the cooled copies
        likewise (copies of the run and of the arm, then their saved weights and state); the fork's
        counters came with load_state_dict."""
        self._build(pl_module, network, optimizer, self.sites, self._seed(self.forks - 1))
        self.arm.load_state_dict(self._pending["arm"])
        if self.arm_opt is not None and self._pending.get("arm_opt") is not None:
            self.arm_opt.load_state_dict(self._pending["arm_opt"])
        if self._pending.get("cool") is not None:
            self.cool = [_copy(network, optimizer), _copy(self.arm, self.arm_opt)]
            for (module, opt), saved in zip(self.cool, self._pending["cool"]):
                module.load_state_dict(saved["net"])
                if opt is not None and saved.get("opt") is not None:
                    opt.load_state_dict(saved["opt"])
        self._pending = None

    @staticmethod
    def cool_length(horizon_steps: int | None) -> int | None:
        """Steps the cooled copies anneal over: ``COOL_FRACTION`` of the horizon, at least one
        (``None``: the horizon is unknown or too short to cool, and the check scores the run and
        the arm as they are). With ``min_steps_between_checks`` the check comes at the first epoch
        end after the horizon: the cooled copies, annealed by then, wait for it (both sides alike)."""
        if not horizon_steps or horizon_steps < 2:
            return None
        return max(1, round(COOL_FRACTION * horizon_steps))

    def _start_cool(self, network: nn.Module) -> None:
        self.cool = [_copy(network, self._optimizer), _copy(self.arm, self.arm_opt)]
        self.cool_lrs = [[float(g["lr"]) for g in o.param_groups] if o is not None else [] for _, o in self.cool]
        self.cool_steps = 0

    @staticmethod
    def _train(trainer: Any, pl_module: Any, network: nn.Module, module: nn.Module, batch: Any, batch_idx: int,
               accumulate: int) -> None:  # fmt: skip
        """Forward and backward of the module's own training objective — its ``training_step``, as
        the run's step called it, logging nothing — with ``module`` in the network's place. Why
        not the probe loss: label smoothing, an auxiliary loss or mixup in the step would then have
        the arm optimise another objective than the run, and the fork judge that difference."""
        module.train(network.training)
        with swapped(pl_module, network, module) as host, untouched(host, module), \
                trainer.precision_plugin.train_step_context():  # fmt: skip
            out = host.training_step(*_step_args(host, batch, batch_idx))
        loss = out.get("loss") if isinstance(out, Mapping) else out
        if loss is not None:  # None: the step skips the batch, as Lightning skips it for the run
            (loss / accumulate).backward()

    @staticmethod
    def _step(trainer: Any, module: nn.Module, opt: torch.optim.Optimizer) -> None:
        """One optimizer step of a side: gradients averaged over ranks, the trainer's clipping."""
        params = [p for p in module.parameters() if p.grad is not None]
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
        opt.step()
        opt.zero_grad(set_to_none=True)

    def batch_end(self, trainer: Any, pl_module: Any, network: nn.Module, batch: Any, batch_idx: int, *,
                  horizon_steps: int | None = None) -> None:  # fmt: skip
        """One step of the arm (and of the cooled copies, once made) on the batch the run just
        trained on (when the run stepped its optimizer), on the module's ``training_step``."""
        if self.site is None:
            return
        start = time.perf_counter()
        if self.arm is None:  # a resumed fit: the arm of the checkpoint
            self._rebuild(pl_module, network, optimizer_for(trainer, network))
            self._last_step = int(trainer.global_step) - 1
        length = self.cool_length(horizon_steps)
        cooling = self.cool is not None and self.cool_steps < (length or 0)  # once annealed, it waits for the check
        sides = [self.arm] + ([m for m, _ in self.cool] if cooling else [])
        train_sides(trainer, pl_module, network, sides, batch, batch_idx)
        stepped = int(trainer.global_step) != self._last_step  # the run stepped its optimizer on this batch
        if stepped:
            self._last_step = int(trainer.global_step)
            if self.arm_opt is not None:
                ramp = round(WARMUP_FRACTION * horizon_steps) if horizon_steps else 0
                mirror_lrs(self.arm_opt, self._optimizer, self.refs, self.ratios, warm=warmup(self.steps + 1, ramp))
                self._step(trainer, self.arm, self.arm_opt)
            if cooling:
                factor = cosine(self.cool_steps + 1, length)
                for (module, opt), lrs in zip(self.cool, self.cool_lrs):
                    if opt is not None:
                        for group, lr in zip(opt.param_groups, lrs):
                            group["lr"] = lr * factor
                        self._step(trainer, module, opt)
                self.cool_steps += 1
            self.steps += 1
            if self.cool is None and length is not None and self.steps == horizon_steps - length:
                self._start_cool(network)
        self.seconds += time.perf_counter() - start

    def _score(self, trainer: Any, pl_module: Any, network: nn.Module, probe: Any, loss_fn: Any,
               ) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """Each probe sample's loss under the control and under the arm: the cooled copies when
        they were made, else the run and the arm as they are."""
        control, arm = self.cool[0][0] if self.cool is not None else network, (
            self.cool[1][0] if self.cool is not None else self.arm)
        device = next(network.parameters()).device
        out = []
        # under DDP each rank scores its shard and the shards are all-gathered (FSDP2 is refused for the fork)
        for module in (control, arm):
            with swapped(pl_module, network, module) as host:
                out.append(probe_sample_losses(trainer, ProbeView(host, module), probe, loss_fn, device))
        return out[0], out[1]

    # -- a check ----------------------------------------------------------------------------
    def judge(self, inputs: Any) -> tuple[Any, list[str], dict]:
        """The decision's interface: no fork open → a verdict that decides nothing (the callback
        opens one); a fork open → the paired test of the (cooled) arm against the (cooled) run on
        the probe."""
        trainer, pl_module, network = inputs.trainer, inputs.pl_module, inputs.network
        if self.site is None:
            verdict = fork_verdict(None, site=None, min_gain=self.min_gain, horizon=self.horizon)
            return verdict, [], {"open_new": True, "reason": verdict.reason, "min_gain": self.min_gain}
        if self.arm is None:  # resumed exactly at a check: rebuild before scoring
            self._rebuild(pl_module, network, optimizer_for(trainer, network))
        start = time.perf_counter()
        control, arm = self._score(trainer, pl_module, network, inputs.probe, inputs.loss_fn)
        scored = f"cooled over {self.cool_steps} steps" if self.cool is not None else "at the run's rate (not cooled)"
        test = fork_test(control, arm, min_gain=self.min_gain, level=inputs.level, seed=self._seed(self.forks))
        verdict = fork_verdict(test, site=self.site, min_gain=self.min_gain, horizon=self.horizon, scored=scored)
        if trainer.world_size > 1:  # one decision on every rank: rank 0's
            verdict, test = trainer.strategy.broadcast((verdict, test), src=0)
        self.seconds += time.perf_counter() - start
        entry = {"site": self.site, "opened": self.opened, "arm_steps": self.steps, "cool_steps": self.cool_steps,
                 "cooled": self.cool is not None, "saturated": verdict.saturated,
                 "certified": verdict.certified, "lower_frac": verdict.score, "min_gain": self.min_gain,
                 "reason": verdict.reason, **{k: test[k] for k in ("gain_frac", "lower_frac", "upper_frac",
                                                                   "loss_before", "loss_now", "n", "level", "se")}}  # fmt: skip
        return verdict, list(self.sites) if not verdict.saturated else [], entry

    def adopt(self, network: nn.Module, optimizer: Any) -> int:
        """The run (already grown at the fork's site) takes the arm's weights and optimizer state
        (the arm's, trained at the run's rate: not the cooled copy's)."""
        copied = adopt(network, optimizer, self.arm, self.arm_opt)
        self.close()
        return copied
