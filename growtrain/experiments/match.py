"""Activation-gradient-matched insertion (the paper's Appendix H, Table 7).

At a converged checkpoint, per seed:

1. score the candidate sites on the probe split (``measure_saturation``, candidate feature
   weights ``U`` drawn from ``seed``) and insert the top site's scored block (``V = 0``: the
   network's function is unchanged);
2. with the model frozen (eval mode), cache over ``samples`` training images (no
   augmentation) the block's input ``z_i`` and the per-sample activation gradient ``q_i`` at
   its output (``∂ℓ_i/∂z_i``);
3. fit ONLY the block's terminal parameters ``V`` by full-batch gradient descent (Nesterov
   momentum, step ``lr/L`` with ``L`` the objective's curvature from power iteration on
   finite-difference Hessian–vector products) on
   ``J(V) = (1/2M) Σ_i ‖h_V(z_i) + α q_i‖²``, ``h_V(z) = block(z) − z`` — for a
   pre-activation block exactly ``V ψ(z)`` with ``ψ`` fixed;
4. evaluate immediately, no further training: matching error ``‖h + αq‖ / ‖αq‖`` (1 = no fit),
   relative hidden-state change ``‖h‖ / ‖z‖``, the first-order prediction ``−(1/M) Σ q_i·h_i``,
   and the train (the ``M`` cached samples) and test loss before → after. Gains are
   ``before − after`` (positive = lower loss), as in Table 7.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
from lightning.pytorch import LightningDataModule, LightningModule

from growtrain.experiments.runs import (
    batches,
    fmt,
    fmt_mean_std,
    growable_of,
    load_checkpoint_into,
    markdown_table,
    mean_std,
    prepare,
    probe_loss_of,
    rich_table,
)
from growtrain.growable import terminal_parameters
from growtrain.saturation import measure_saturation

__all__ = ["MatchResult", "run_match", "fit_terminal"]

_SUMMARY = ("train_before", "train_after", "gain_train", "test_before", "test_after", "gain_test",
            "match_error", "hidden_change", "predicted_gain")  # fmt: skip


@dataclass
class MatchResult:
    runs: list[dict]  # one per seed
    summary: dict
    reference: str
    output_dir: Path | None = None

    def _cells(self):
        s = {k: (self.summary[k], self.summary.get(f"{k}_std"), len(self.runs)) for k in _SUMMARY}
        header = ["Reference", "site(s)", "Train loss (ave)", "Δ_train", "Test loss (ave)", "Δ_test",
                  "match error", "‖Δh‖/‖h‖", "predicted Δ"]  # fmt: skip
        sites = ", ".join(sorted({r["site"] for r in self.runs}))
        row = [
            self.reference, sites,
            f"{fmt(s['train_before'][0])} → {fmt(s['train_after'][0])}", fmt_mean_std(s["gain_train"]),
            f"{fmt(s['test_before'][0])} → {fmt(s['test_after'][0])}", fmt_mean_std(s["gain_test"]),
            fmt_mean_std(s["match_error"]), fmt_mean_std(s["hidden_change"]), fmt_mean_std(s["predicted_gain"]),
        ]  # fmt: skip
        return header, [row]

    def table(self):
        return rich_table(
            *self._cells(),
            title="Activation-gradient-matched insertion (no further training)",
            caption=f"mean ± std over {len(self.runs)} seed(s); Δ = before − after (positive: lower loss)",
            left_columns=2,
        )

    def markdown(self) -> str:
        return markdown_table(*self._cells())

    def __rich__(self):
        return self.table()


def _mean_loss(module, data, loss_fn) -> float:
    total = count = 0.0
    with torch.no_grad():
        for x, y in data:
            total += float(loss_fn(module(x), y)) * len(y)
            count += len(y)
    return total / count


def _cache(module, block, data, loss_fn) -> dict:
    """Block inputs ``z``, per-sample activation gradients ``q`` at its output, the samples and their loss."""
    store: dict = {}

    def hook(_block, args, output):
        store["z"] = args[0].detach()
        out = output.detach().requires_grad_(True)  # the graph starts here: no parameter gradients
        store["out"] = out
        return out

    zs, qs, xs, ys = [], [], [], []
    total = 0.0
    handle = block.register_forward_hook(hook)
    try:
        with torch.enable_grad():
            for x, y in data:
                loss = loss_fn(module(x), y)  # batch mean
                (grad,) = torch.autograd.grad(loss, store["out"])
                zs.append(store["z"])
                qs.append(grad * len(y))  # per-sample ∂ℓ_i/∂z_i
                xs.append(x)
                ys.append(y)
                total += float(loss.detach()) * len(y)
    finally:
        handle.remove()
    n = sum(len(y) for y in ys)
    return {"z": zs, "q": qs, "x": xs, "y": ys, "loss": total / n, "n": n}


def fit_terminal(block, zs: Sequence[torch.Tensor], qs: Sequence[torch.Tensor], alpha: float, *,
                 steps: int = 200, lr: float = 1.0, power_iters: int = 10) -> dict:  # fmt: skip
    """Fit the block's terminal parameters to ``h(z) ≈ −α q`` in place; return fit statistics.

    Full-batch Nesterov gradient descent on ``(1/2M) Σ‖block(z) − z + α q‖²`` with step
    ``lr / L``; ``L`` from power iteration with finite-difference Hessian–vector products
    (first-order autograd only, so any block works); a step that raises the objective is
    undone and the step halved.
    """
    params = terminal_parameters(block)
    m = sum(len(z) for z in zs)
    block.eval()

    def objective(with_grad: bool = True):
        value, grads = 0.0, [torch.zeros_like(p) for p in params]
        for z, q in zip(zs, qs):
            with torch.enable_grad():
                r = block(z) - z + alpha * q
                j = 0.5 * r.pow(2).sum() / m
            if with_grad:
                for g, d in zip(grads, torch.autograd.grad(j, params)):
                    g += d
            value += float(j.detach())  # float() of a tensor that requires grad warns
        return value, grads

    def assign(values):
        with torch.no_grad():
            for p, v in zip(params, values):
                p.copy_(v)

    start = [p.detach().clone() for p in params]
    j0, g0 = objective()
    # power iteration: H v ≈ (∇J(V + εv) − ∇J(V)) / ε
    gen = torch.Generator().manual_seed(0)
    v = [torch.randn(p.shape, generator=gen, dtype=p.dtype).to(p.device) for p in params]
    curvature, eps = 0.0, 1e-3
    for _ in range(power_iters):
        norm = math.sqrt(sum(float(t.pow(2).sum()) for t in v)) or 1.0
        v = [t / norm for t in v]
        assign([s + eps * t for s, t in zip(start, v)])
        _, g1 = objective()
        hv = [(a - b) / eps for a, b in zip(g1, g0)]
        curvature = math.sqrt(sum(float(t.pow(2).sum()) for t in hv))
        v = hv
    assign(start)
    step = lr / curvature if curvature > 0 else 0.0
    current, previous = [s.clone() for s in start], [s.clone() for s in start]
    value, k = j0, 0
    for _ in range(steps if step > 0 else 0):
        momentum = k / (k + 3)
        look = [c + momentum * (c - p) for c, p in zip(current, previous)]
        assign(look)
        _, g_look = objective()
        new = [a - step * g for a, g in zip(look, g_look)]
        assign(new)
        new_value, _ = objective(with_grad=False)
        if new_value > value * (1 + 1e-6):  # overshoot (beyond float noise): restart momentum; a plain step halves
            if k == 0:
                step /= 2
            assign(current)
            k, previous = 0, [c.clone() for c in current]
            continue
        previous, current, value, k = current, new, new_value, k + 1
    assign(current)
    return {"objective_start": j0, "objective_end": value, "curvature": curvature, "step": step}


def run_match(
    model: LightningModule,
    datamodule: LightningDataModule,
    *,
    ckpt_path: str | None = None,
    alpha: float = 1e-3,
    seeds: Sequence[int] = (0, 1, 2),
    steps: int = 200,
    lr: float = 1.0,
    samples: int | None = 2048,
    batch_size: int = 256,
    output_dir: str | Path | None = None,
) -> MatchResult:
    """Appendix H at ``ckpt_path`` (or at ``model`` as it is): see the module docstring."""
    if not alpha > 0:
        raise ValueError(f"alpha: expected a matching scale > 0 (paper: 1e-3), got {alpha!r}")
    if steps < 0 or not lr > 0:
        raise ValueError(f"steps, lr: expected steps ≥ 0 and lr > 0, got steps={steps!r}, lr={lr!r}")
    if samples is not None and samples < 2:
        raise ValueError(f"samples: expected None (all) or ≥ 2 training samples, got {samples!r}")
    prepare(datamodule, "match")
    if ckpt_path is not None:
        load_checkpoint_into(model, ckpt_path)
    model.eval()
    loss_fn = probe_loss_of(model)
    device = next(model.parameters()).device  # GrowTrainer.match puts the model on the trainer's device
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)  # the same training subset for every seed and every rerun
        train = [(x[i : i + batch_size], y[i : i + batch_size])
                 for x, y in batches(datamodule, "train", samples, device) for i in range(0, len(y), batch_size)]  # fmt: skip
    test_before = _mean_loss(model, batches(datamodule, "test", device=device), loss_fn)
    cached: dict[str, dict] = {}
    runs = []
    for seed in seeds:
        module = copy.deepcopy(model)
        network = growable_of(module)
        report = measure_saturation(network, datamodule.probe_dataloader(), loss_fn, projected=False, seed=int(seed))
        best = report.best_record
        block = best.block
        network.grow(best.site, block=block)  # V = 0: function-preserving
        if best.name not in cached:
            cached[best.name] = _cache(module, block, train, loss_fn)
        data = cached[best.name]
        fit = fit_terminal(block, data["z"], data["q"], alpha, steps=steps, lr=lr)
        with torch.no_grad():
            hs = [block(z) - z for z in data["z"]]
        target = sum(float((alpha * q).pow(2).sum()) for q in data["q"])
        residual = sum(float((h + alpha * q).pow(2).sum()) for h, q in zip(hs, data["q"]))
        hidden = sum(float(z.pow(2).sum()) for z in data["z"])
        train_after = _mean_loss(module, zip(data["x"], data["y"]), loss_fn)
        test_after = _mean_loss(module, batches(datamodule, "test", device=device), loss_fn)
        runs.append({
            "seed": int(seed), "site": best.name, "gamma": report.gamma, "site_grad_norm": best.grad_norm,
            "samples": data["n"], "alpha": alpha,
            "match_error": math.sqrt(residual / target) if target > 0 else None,
            "hidden_change": math.sqrt(sum(float(h.pow(2).sum()) for h in hs) / hidden) if hidden > 0 else None,
            "predicted_gain": -sum(float((q * h).sum()) for q, h in zip(data["q"], hs)) / data["n"],
            "train_before": data["loss"], "train_after": train_after, "gain_train": data["loss"] - train_after,
            "test_before": test_before, "test_after": test_after, "gain_test": test_before - test_after,
            **fit,
        })  # fmt: skip
    summary = {}
    for key in _SUMMARY:
        summary[key], summary[f"{key}_std"], _ = mean_std(r[key] for r in runs)
    reference = Path(ckpt_path).name if ckpt_path else f"{growable_of(model).depth()} blocks"
    result = MatchResult(runs=runs, summary=summary, reference=reference)
    if output_dir is not None:
        out = Path(output_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "match.json").write_text(
            json.dumps({"ckpt_path": ckpt_path, "summary": summary, "runs": runs}, indent=1, default=str)
        )
        (out / "match.md").write_text("# Activation-gradient-matched insertion\n\n" + result.markdown())
        result.output_dir = out
    return result
