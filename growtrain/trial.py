"""The block-only trial: what is one more block, trained alone, worth to this network?

Pure functions (no Lightning). A trial inserts a zero-output block at a site, freezes every
other parameter (and keeps every other module in eval mode, so no BatchNorm statistic moves),
trains the block alone for a short budget, and compares each probe sample's loss after the
trial with its loss before (the block starts at zero output, so "before" is the network as it
is). The probe is split off the training data by dataset index and never trained on, by the
network or by the trial: it is the only thing a trial is scored on. It is the paper's
definition of saturation made finite: a candidate is saturated when no zero-state update of the
*inserted* parameters lowers the loss. Why this and not the realized gain of a whole stage:
per-sample differences of a block-only trial are 2–10× less spread (the rest of the network does
not move), and the stage's own training is not credited to the block (docs/decision.md, "The
decision study").

* :func:`train_block` — the trial's training loop (Adam, cosine to 0): scale-free, since Adam's
  step does not grow with the loss's scale (an SGD step does), and a diverging trial is
  reported (``diverged``), never raised.
* :func:`trial_test` — the paired, one-sided bootstrap-t bounds (``growtrain.gain``) on the
  trial's gain: ``lower`` (grow iff it exceeds ``min_gain`` × the loss) and ``upper``.
* :func:`trial_verdict` — the decision over the sites tried (Bonferroni inside the check), with
  the sentence that says what was certified and ``certified`` (:func:`trial_certified`): a stop
  is certified saturation only when every tried block's upper bound is below ``min_gain``.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Callable, ContextManager, Iterable, Sequence

import torch
from torch import nn

from growtrain.decision import Verdict
from growtrain.gain import gain_lower_bound, gain_test

__all__ = ["DEFAULT_TRIAL_EPOCHS", "DEFAULT_TRIAL_LR", "TRIAL_SITES", "train_block", "trial_test", "trial_certified",
           "trial_verdict", "label_entropy", "constant_prediction_loss", "at_chance"]  # fmt: skip

# Chosen by the decision study (docs/decision.md): half an epoch of Adam at 1e-3 per site.
DEFAULT_TRIAL_EPOCHS = 0.5
DEFAULT_TRIAL_LR = 1e-3
# Sites tried per check: the best first-order site of each stage of a three-stage ResNet, best first
# (Bonferroni over them); a network with more stages tries its three best.
TRIAL_SITES = 3
# A trial trains at least this many steps, however small the epoch (half an epoch of 2000 images
# is 8 steps: too few for a block to show its worth).
MIN_TRIAL_STEPS = 100
# Steps between two reads of the trial's losses on the host: a read is a device sync (and a
# collective under DDP), so not one per step; a diverged trial is found within this many steps
# (its block is thrown away either way).
CHECK_EVERY = 16


def _cosine(step: int, steps: int) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / max(steps, 1)))


def train_block(
    forward: Callable[[Any], Any],
    module: nn.Module,
    block: nn.Module,
    batches: Iterable[tuple[Any, Any]],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    steps: int,
    lr: float = DEFAULT_TRIAL_LR,
    sync_grads: Callable[[Sequence[torch.Tensor]], None] | None = None,
    any_rank: Callable[[bool], bool] | None = None,
    progress: Callable[[int, int], None] | None = None,
    context: Callable[[], ContextManager] | None = None,
    loss_scale: bool = False,
) -> dict:
    """Train ``block`` (already inserted in ``module``) alone for ``steps`` batches.

    Every other parameter of ``module`` is frozen and every other submodule is in eval mode
    during the trial; flags and modes are restored afterwards, whatever happens. ``forward(x)``
    is the model's forward (input to output), ``loss_fn(output, target)`` its mean batch loss.
    ``sync_grads`` averages the block's gradients across processes (DDP), so every rank trains
    the same block; ``any_rank(flag)`` tells whether any process saw a non-finite loss, so every
    rank stops at the same step. ``progress(done, steps)`` is told after every optimizer step (the
    callback's progress bar: a trial is seconds of training after the epoch's bar has finished).
    ``context()``: the trainer's precision context (``precision_plugin.forward_context``), entered
    around each forward and loss, as a training step's; ``loss_scale``: scale the loss for the
    backward (``16-mixed``: fp16 gradients underflow without it). The losses are read on the host
    once every ``CHECK_EVERY`` steps, not per step (no host sync per step); a non-finite loss ends
    the trial at the next read. Returns ``steps`` done, ``diverged`` (a non-finite loss or
    parameter: the trial is then a failed trial), and the first and last batch losses."""
    if not isinstance(steps, int) or steps < 1:
        raise ValueError(f"steps: expected an integer >= 1 (optimizer steps of the trial), got {steps!r}")
    params = [p for p in block.parameters()]
    ids = {id(p) for p in params}
    flags = [(p, p.requires_grad) for p in module.parameters()]
    modes = [(m, m.training) for m in module.modules()]
    # the frozen parameters get no gradient (requires_grad off; FSDP2 passes the flag on to the unsharded
    # parameters it computes with), so the training step's gradients are untouched: tests/test_fsdp.py checks it
    grads = [(p, p.grad) for p in params]
    done, diverged, first, last = 0, False, None, None
    pending: list[torch.Tensor] = []  # the losses since the last read, on the device

    def read() -> bool:  # one host sync (and one collective under DDP) per CHECK_EVERY steps
        nonlocal first, last, pending
        if not pending:
            return False
        values = torch.stack(pending).float().cpu()
        pending = []
        first = float(values[0]) if first is None else first
        last = float(values[-1])
        bad = not bool(torch.isfinite(values).all())
        return any_rank(bad) if any_rank is not None else bad

    try:
        for p, _ in flags:
            p.requires_grad_(id(p) in ids)
        module.eval()
        block.train()
        device = params[0].device if params else torch.device("cpu")
        # float16 weights (16-true): Adam's default eps (1e-8) is 0 in float16 and its squared-gradient
        # average underflows, so a step divides by zero; the dtype's own resolution keeps it finite
        half = bool(params) and params[0].dtype == torch.float16
        optimizer = torch.optim.Adam(params, lr=lr, eps=torch.finfo(torch.float16).eps if half else 1e-8)
        scaler = torch.amp.GradScaler(device.type, enabled=loss_scale)
        for x, y in batches:
            if done >= steps:
                break
            for group in optimizer.param_groups:
                group["lr"] = lr * _cosine(done, steps)
            with context() if context is not None else contextlib.nullcontext():
                loss = loss_fn(forward(x), y)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss).backward()
            if sync_grads is not None:
                sync_grads([p.grad for p in params if p.grad is not None])
            scaler.step(optimizer)  # a plain optimizer.step() unless loss_scale
            scaler.update()
            pending.append(loss.detach())
            done += 1
            if progress is not None:
                progress(done, steps)
            if done % CHECK_EVERY == 0 and read():
                diverged = True
                break
        if not diverged and read():
            diverged = True
        if not diverged:  # a sharded (FSDP2) block: each rank checks its own shard, and any rank's failure counts
            local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
            bad = not all(bool(torch.isfinite(t.detach()).all()) for t in local)
            diverged = any_rank(bad) if any_rank is not None else bad
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)
        for m, training in modes:
            m.training = training
        for p, grad in grads:  # the block is thrown away or replaced; leave no trial gradient behind
            p.grad = grad
    return {"steps": done, "diverged": diverged, "loss_first": first, "loss_last": last}


def trial_test(before: torch.Tensor, after: torch.Tensor, *, min_gain: float, level: float, seed: int = 0) -> dict:
    """The trial's gain ``b − a`` per probe sample, with one-sided ``1 − level`` bootstrap-t
    bounds: ``lower`` (``paid`` iff ``lower > min_gain · loss_before``) and ``upper`` (an upper
    bound on the mean gain). Fractions of the loss: ``gain_frac``, ``lower_frac``, ``upper_frac``."""
    out = gain_test(before, after, min_gain=min_gain, level=level, seed=seed)
    upper = -gain_lower_bound(after.double() - before.double(), level, seed=seed + 1)
    scale = out["loss_before"] if out["loss_before"] > 0 else float("nan")
    out.update(upper=upper, gain_frac=out["mean"] / scale, lower_frac=out["lower"] / scale, upper_frac=upper / scale)
    return out


def label_entropy(targets: torch.Tensor) -> float | None:
    """The loss of the best constant prediction (nats): the entropy of the empirical label
    distribution, for 1-d integer class targets; ``None`` for any other target."""
    if not isinstance(targets, torch.Tensor) or targets.dim() != 1 or targets.is_floating_point() or targets.numel() < 2:
        return None
    p = torch.bincount(targets.long().flatten().cpu()).double()
    p = p[p > 0] / p.sum()
    return float(-(p * p.log()).sum())


def constant_prediction_loss(targets: torch.Tensor, loss_fn: Any) -> float | None:
    """The probe loss of the best constant prediction *under the module's own loss*: ``loss_fn``
    applied to logits ``log p`` (``p`` the empirical label frequencies, shape ``(n, C)``) for
    1-d integer class targets; ``None`` for other targets or a loss that does not take logits.

    For plain cross-entropy this is :func:`label_entropy`; a scaled (× 10) or otherwise
    reshaped loss scales its reference with it, so the chance test stays scale-free."""
    if label_entropy(targets) is None:
        return None
    y = targets.long().flatten().cpu()
    p = torch.bincount(y).double() / y.numel()
    logits = p.clamp_min(1e-12).log().float().expand(y.numel(), -1)  # (n, C): C = the largest class + 1
    try:
        value = float(loss_fn(logits, y))
    except Exception:  # a loss of another shape of prediction: no claim either way
        return None
    return value if math.isfinite(value) else None


def at_chance(loss: float, reference: float | None, margin: float = 0.1) -> bool:
    """Has the network not learned: its probe loss within ``margin`` (10 %) of ``reference``,
    the best constant prediction's loss (:func:`constant_prediction_loss`)?"""
    return reference is not None and reference > 0 and loss >= (1.0 - margin) * reference


def trial_certified(trials: Sequence[dict], min_gain: float, chance: str | None = None) -> bool:
    """Certified saturation: every site tried was scored (none diverged: a failed trial says
    nothing about its block), the network has learned (``chance`` is ``None``: at chance level
    depth is not the question), and every tried block's one-sided upper bound on its gain is
    below ``min_gain``. Anything less is "no certified gain"."""
    usable = [t for t in trials if not t.get("diverged") and t.get("upper_frac") is not None]
    if chance is not None or not usable or len(usable) < len(trials):
        return False
    return max(t["upper_frac"] for t in usable) < min_gain


def trial_verdict(trials: Sequence[dict], min_gain: float, chance: str | None = None) -> Verdict:
    """Grow at the tried site with the largest certified lower bound iff it beats ``min_gain``.

    ``trials``: one dict per site with ``site`` and either the figures of :func:`trial_test`
    or ``diverged=True``. The verdict's ``score`` is the best lower bound as a fraction of the
    loss, ``margin`` is ``min_gain``; ``certified`` (:func:`trial_certified`) says whether a stop
    is certified saturation. The reason starts with what was certified: "grow", "certified
    saturation", or "no certified gain" with the resolution the probe had (or the network at
    chance level) — never "saturated" without the bound — and says what was scored: the probe,
    its ``n`` samples held out from training by index."""
    usable = [t for t in trials if not t.get("diverged") and t.get("lower_frac") is not None]
    failed = [t["site"] for t in trials if t.get("diverged")]
    note = f"; trial(s) at {', '.join(failed)} diverged (failed trials, the network is as it was)" if failed else ""
    if not usable:
        return Verdict("trial", True, None, float("nan"), min_gain,
                       f"no certified gain: no trial could be scored{note}")  # fmt: skip
    best = max(usable, key=lambda t: t["lower_frac"])
    level = best["level"]
    # every trial of a check scores the same probe: the reader learns what the percentages are of
    scored = f"the loss on the probe ({best['n']} samples held out from training by index)"
    if best["paid"]:
        return Verdict("trial", False, best["site"], best["lower_frac"], min_gain,
                       f"grow: the block at {best['site']} lowers {scored} by at least "
                       f"{100 * best['lower_frac']:.2f} % (estimate {100 * best['gain_frac']:.2f} %, "
                       f"{100 * (1 - level):.1f} % bound) > min_gain {100 * min_gain:.2f} %{note}")  # fmt: skip
    top = max(usable, key=lambda t: t["upper_frac"])
    tried = ", ".join(f"{t['site']} {100 * t['gain_frac']:+.2f} %" for t in usable)
    if chance is not None:  # no depth question to answer: the network has not learned
        return Verdict("trial", True, None, best["lower_frac"], min_gain,
                       f"stopped at chance level, no certified gain: {chance}; no block tried lowers {scored} by "
                       f"a certified more than {100 * min_gain:.2f} % [tried: {tried}]{note}")  # fmt: skip
    certified = trial_certified(trials, min_gain, chance)
    at_most = f"the best gains at most {100 * top['upper_frac']:.2f} % ({100 * (1 - level):.1f} %)"
    if certified:
        what = (f"certified saturation: no block tried lowers {scored} by more than "
                f"{100 * min_gain:.2f} %; {at_most}")  # fmt: skip
    elif top["upper_frac"] < min_gain:  # every scored block is bounded below min_gain, but one site was not scored
        what = (f"no certified gain: the blocks scored gain less than {100 * min_gain:.2f} % ({at_most}), but not "
                "every site tried could be scored")  # fmt: skip
    else:
        half = 100 * (top["upper_frac"] - top["lower_frac"]) / 2
        what = (f"no certified gain: no block tried lowers {scored} by a certified more than "
                f"{100 * min_gain:.2f} % (best lower bound {100 * best['lower_frac']:.2f} %); {at_most}: not "
                f"resolved below min_gain — this probe resolves gains to about ±{half:.2f} % of the loss (a "
                "larger probe resolves finer: the half-width falls as 1/√n)")  # fmt: skip
    return Verdict("trial", True, None, best["lower_frac"], min_gain, f"{what} [tried: {tried}]{note}",
                   certified=certified)
