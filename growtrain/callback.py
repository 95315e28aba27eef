"""``GrowUntilSaturated``: grow the network mid-fit while the certified test says depth helps.

Data flow at each check (DESIGN.md §3)::

    probe data → measure_saturation (all sites, one pass) → decide_growth (pure) →
    network.grow (function-preserving, verified) → reconfigure_optimizer (zero state) →
    DDP re-wrap → history / loggers / table / growth_history.json

The hooks only gather inputs; :func:`should_check` and :func:`decide_growth` are pure functions
that return an action and a reason (the ``EarlyStopping`` pattern), so every rank that sees the
same all-reduced probe sums takes the same action.

What a checkpoint holds: the module's ``GrowableModuleMixin`` stores the growth record and
replays it before the weights load; this callback's ``state_dict`` keeps its history and
counters (check index, growths, plateau tracking, α-spending index, a pending scheduler
restart). Candidate blocks are seeded by check index (``seed·1000 + check``), so a resumed run
inserts exactly the blocks an uninterrupted run would.
"""

from __future__ import annotations

import io
import json
import math
import os
import time
from typing import Any, Callable, Iterable, Literal, Sequence

import torch
from lightning.pytorch import Callback, LightningModule, Trainer
from lightning.pytorch.utilities import rank_zero_info, rank_zero_warn
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Sampler, Subset

from growtrain.growable import find_growable, grown_blocks
from growtrain.reconfigure import LR_SCHEDULES, reconfigure_optimizer, restart_schedulers
from growtrain.saturation import RULES, SaturationReport, measure_saturation

__all__ = [
    "GrowUntilSaturated",
    "FunctionChangedError",
    "should_check",
    "decide_growth",
    "rank_sites",
    "insertion_tolerance",
    "probe_overlap",
    "ProbeView",
]

ON_SATURATED = ("stop", "continue")
# Cost of one probe sample in training-sample equivalents (one forward+backward+step), used by
# ``probe_budget``; conservative: bench/callback.py measured 1.8-2.6 (basic family, calibration on,
# fashion-mnist-mini, shared 2-core CPU); DESIGN.md §2 measured 1.6-2.3 without calibration.
PROBE_COST = 3.0
ALPHA_SPENDING = ("none", "geometric", "inverse_square")
MODES = ("min", "max")
# Absolute tolerance per unit of output scale for the insertion check, by output dtype.
_TOLERANCE = {torch.float64: 1e-10, torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}
_UNSUPPORTED_STRATEGIES = {
    "FSDPStrategy": "FSDP shards parameters, so a block cannot be inserted into one rank's module",
    "DeepSpeedStrategy": "DeepSpeed owns the optimizer and partitions parameters",
    "ModelParallelStrategy": "model-parallel layouts are fixed at setup",
    "XLAStrategy": "not tested with growth",
    "XLAFSDPStrategy": "FSDP shards parameters",
}


class FunctionChangedError(RuntimeError):
    """An inserted block changed the network's output: the insertion was rolled back."""


def _bad(arg: str, expected: str, given: Any, fix: str) -> ValueError:
    return ValueError(f"{arg}: expected {expected}; got {given!r}. Fix: {fix}.")


def _check_int(arg: str, value: Any, low: int, *, optional: bool = False) -> None:
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        kind = f"an integer >= {low}" + (" or None" if optional else "")
        raise _bad(arg, kind, value, f"pass {arg}={max(low, 1)}" + (" or leave it None" if optional else ""))


def _check_choice(arg: str, value: Any, choices: Sequence[str]) -> None:
    if value not in choices:
        raise _bad(arg, f"one of {tuple(choices)}", value, f"pass {arg}={choices[0]!r}")


# -- pure decision functions -----------------------------------------------------------------
def should_check(
    *,
    finished: str | None,
    cooldown_left: int,
    epochs_since_check: int,
    every_n_epochs: int,
    monitor: str | None,
    plateaued: bool,
    probe_budget: float | None = None,
    probe_samples: int = 0,
    trained_samples: int = 0,
) -> tuple[bool, str]:
    """Whether this train-epoch end runs a probe check, and why (or why not).

    With ``probe_budget`` a due check also needs the samples trained since the last check to
    pay for it: ``PROBE_COST · probe_samples ≤ probe_budget · trained_samples``.
    """
    if finished is not None:
        return False, f"growth has ended ({finished})"
    if cooldown_left > 0:
        return False, f"cooldown after growth: {cooldown_left} epoch(s) left"
    if monitor is not None:
        if not plateaued:
            return False, f"{monitor} is still improving"
        why = f"{monitor} has plateaued"
    elif epochs_since_check >= every_n_epochs:
        why = f"every {every_n_epochs} epoch(s)"
    else:
        return False, f"next check in {every_n_epochs - epochs_since_check} epoch(s)"
    if probe_budget is not None and PROBE_COST * probe_samples > probe_budget * trained_samples:
        need = math.ceil(PROBE_COST * probe_samples / probe_budget)
        return False, f"probe_budget={probe_budget}: postponed until {need} trained samples ({trained_samples} so far)"
    return True, why


def plateau_update(
    current: float, best: float | None, wait: int, *, mode: str, min_delta: float, patience: int
) -> tuple[float, int, bool]:
    """EarlyStopping-style tracking: returns ``(best, wait, plateaued)``.

    An improvement is a change beyond ``min_delta`` in the ``mode`` direction; ``plateaued``
    once ``patience`` consecutive epochs brought none.
    """
    if best is None or not math.isfinite(best):
        return current, 0, False
    improved = current < best - min_delta if mode == "min" else current > best + min_delta
    if improved:
        return current, 0, False
    wait += 1
    return best, wait, wait >= patience


def budget_reason(
    *,
    growths: int,
    max_growths: int | None,
    depth: int | None,
    max_blocks: int | None,
    params: int,
    max_params: int | None,
) -> str | None:
    """The budget that forbids any further growth, or ``None`` when growth is still allowed."""
    if max_growths is not None and growths >= max_growths:
        return f"max_growths={max_growths} reached ({growths} growth step(s) done)"
    if max_blocks is not None and depth is not None and depth >= max_blocks:
        return f"max_blocks={max_blocks} reached (depth {depth})"
    if max_params is not None and params >= max_params:
        return f"max_params={max_params} reached ({params} parameters)"
    return None


def rank_sites(report: SaturationReport, top_k: int) -> list[str]:
    """Up to ``top_k`` distinct sites to grow, best first (empty when saturated).

    The first is the report's ``best_site``. Further sites need the same evidence: with the
    cross-fit rule only sites whose certified ``lower`` exceeds δ (ranked by ``lower``); with the
    paper's rule the next sites by ``‖ĝ‖`` (Proposition 1 certifies the maximum only, so
    ``top_k > 1`` is a heuristic there).
    """
    if report.saturated or report.best_site is None:
        return []
    out = [report.best_site]
    if report.rule == "crossfit":
        rest = [r for r in report.sites if r.lower is not None and r.lower > report.delta]
        rest.sort(key=lambda r: -r.lower)
    else:
        rest = sorted(report.sites, key=lambda r: -r.grad_norm)
    for r in rest:
        if len(out) >= top_k:
            break
        if r.name not in out:
            out.append(r.name)
    return out


def decide_growth(
    *,
    saturated: bool,
    ranked: Sequence[str],
    block_params: dict[str, int],
    growths: int,
    max_growths: int | None,
    depth: int | None,
    max_blocks: int | None,
    params: int,
    max_params: int | None,
    reason: str = "",
) -> tuple[str, str, list[str]]:
    """The action after a probe: ``("grow", why, sites)``, ``("saturated", why, [])`` or
    ``("budget", why, [])``. Sites are taken in rank order while the budgets allow."""
    if saturated or not ranked:
        return "saturated", reason or "no site certifies first-order gain", []
    blocked = budget_reason(
        growths=growths, max_growths=max_growths, depth=depth, max_blocks=max_blocks,
        params=params, max_params=max_params,
    )  # fmt: skip
    if blocked is not None:
        return "budget", blocked, []
    chosen: list[str] = []
    total = params
    for name in ranked:
        if max_blocks is not None and depth is not None and depth + len(chosen) + 1 > max_blocks:
            break
        if max_params is not None and total + block_params.get(name, 0) > max_params:
            continue
        chosen.append(name)
        total += block_params.get(name, 0)
    if not chosen:
        return "budget", f"max_params={max_params}: no candidate block fits ({params} parameters now)", []
    why = reason or "a site certifies first-order gain"
    return "grow", f"{why}; grow at {', '.join(chosen)}", chosen


def insertion_tolerance(dtype: torch.dtype, scale: float) -> float:
    """Largest acceptable ``max|Δ output|`` after inserting zero-output blocks."""
    return _TOLERANCE.get(dtype, 1e-5) * max(1.0, float(scale))


# -- data checks ---------------------------------------------------------------------------
def _base_and_indices(ds: Any) -> tuple[Any, set[int] | None]:
    """The underlying storage of a dataset and the indices of it that ``ds`` exposes."""
    idx: list[int] | None = None

    def compose(outer: list[int] | None, inner: list[int]) -> list[int]:
        return inner if outer is None else [inner[i] for i in outer]

    for _ in range(32):
        if isinstance(ds, Subset):
            idx = compose(idx, [int(i) for i in ds.indices])
            ds = ds.dataset
            continue
        x = getattr(ds, "x", None)
        indices = getattr(ds, "indices", None)
        if isinstance(x, torch.Tensor) and indices is not None:  # growtrain's in-memory TensorImages
            return x, set(compose(idx, [int(i) for i in torch.as_tensor(indices).tolist()]))
        break
    return ds, None if idx is None else set(idx)


def probe_overlap(probe_dataset: Any, train_dataset: Any) -> str | None:
    """A description of the overlap between probe and training data, or ``None`` if none is seen.

    Detects the same dataset object, and subsets (``torch.utils.data.Subset`` or growtrain's
    in-memory sets) of one storage whose indices intersect. Different storages are assumed
    independent (nothing more can be told without reading the data).
    """
    if probe_dataset is None or train_dataset is None:
        return None
    if probe_dataset is train_dataset:
        return "the probe loader and the train loader use the same dataset object"
    base_p, idx_p = _base_and_indices(probe_dataset)
    base_t, idx_t = _base_and_indices(train_dataset)
    if base_p is not base_t:
        return None
    if idx_p is None or idx_t is None:
        return "the probe set and the train set are views of the same dataset, one of them all of it"
    common = idx_p & idx_t
    if common:
        return f"{len(common)} sample index(es) are in both the probe and the train set (e.g. {sorted(common)[:5]})"
    return None


class _ShardSampler(Sampler[int]):
    """Rank ``r`` of ``w`` reads positions ``r, r+w, ...``: disjoint shards, no padding, so the
    all-reduced sample count is the probe size exactly (DistributedSampler would repeat samples)."""

    def __init__(self, length: int, rank: int, world_size: int):
        self.length, self.rank, self.world_size = length, rank, world_size

    def __iter__(self):
        return iter(range(self.rank, self.length, self.world_size))

    def __len__(self) -> int:
        return len(range(self.rank, self.length, self.world_size))


def _shard(loader: Any, rank: int, world_size: int) -> Any:
    if world_size <= 1:
        return loader
    if not isinstance(loader, DataLoader):
        raise TypeError(
            f"probe: with {world_size} processes the probe must be a torch DataLoader (it is sharded across "
            f"ranks); got {type(loader).__name__}. Fix: return a DataLoader from probe_dataloader()."
        )
    if loader.batch_size is None:
        raise TypeError("probe: a DataLoader with a custom batch_sampler cannot be sharded; pass batch_size instead")
    return DataLoader(
        loader.dataset,
        batch_size=loader.batch_size,
        sampler=_ShardSampler(len(loader.dataset), rank, world_size),
        collate_fn=loader.collate_fn,
        num_workers=loader.num_workers,
        pin_memory=loader.pin_memory,
    )


def _loaders(loaders: Any) -> list[DataLoader]:
    if isinstance(loaders, DataLoader):
        return [loaders]
    if isinstance(loaders, dict):
        return [d for v in loaders.values() for d in _loaders(v)]
    if isinstance(loaders, (list, tuple)):
        return [d for v in loaders for d in _loaders(v)]
    return []


def _datasets(loaders: Any) -> list[Any]:
    return [loader.dataset for loader in _loaders(loaders)]


# -- the probe's view of the model ------------------------------------------------------------
class ProbeView:
    """The growable ``network``'s sites and stages, the LightningModule's forward.

    ``measure_saturation`` calls ``network(x)``; when the growable network is only part of the
    model (a trunk between an encoder and a head) the probe must still run the whole forward,
    input to output, so that ``loss_fn(output, target)`` is the model's loss. Site hooks sit on
    the network's stages, which the module's forward runs. ``eval()`` / ``train()`` save and
    restore every submodule's own mode (a frozen BatchNorm stays in eval).
    """

    def __init__(self, module: nn.Module, network: nn.Module):
        self.module, self.network = module, network

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    # Modes and parameters are the whole module's: ``measure_saturation`` saves every
    # submodule's mode and ``requires_grad`` flag through these and restores them afterwards,
    # so an encoder's BatchNorm or a head's Dropout outside the trunk is back in train mode
    # after a check (they stayed in eval for the rest of the fit when these reached only the trunk).
    def modules(self):
        return self.module.modules()

    def parameters(self, recurse: bool = True):
        return self.module.parameters(recurse)

    @property
    def training(self) -> bool:
        return self.module.training

    def eval(self) -> "ProbeView":
        self.module.eval()
        return self

    def train(self, mode: bool = True) -> "ProbeView":
        self.module.train(mode)
        return self

    def __getattr__(self, name: str) -> Any:  # sites, stage, new_block, neighbour_tensor, ...
        return getattr(self.__dict__["network"], name)


# -- growth surgery helpers ----------------------------------------------------------------
def _undo_growth(network: nn.Module, blocks: Sequence[nn.Module], log_len: int) -> None:
    """Remove ``blocks`` (inserted by ``grow``) and trim ``growth_log`` back to ``log_len``."""
    for block in reversed(list(blocks)):
        for module in network.modules():
            if isinstance(module, (nn.ModuleList, nn.Sequential)):
                hit = [i for i, m in enumerate(module) if m is block]
                if hit:
                    del module[hit[0]]
                    break
        grown = getattr(network, "_grown_blocks", None)
        if isinstance(grown, list):
            for i in range(len(grown) - 1, -1, -1):
                if grown[i] is block:
                    del grown[i]
                    break
    del network.growth_log[log_len:]


def _insertion_order(names: Sequence[str]) -> list[str]:
    """Sites as ``stage.index`` names, deepest index first within a stage, so that inserting one
    never shifts the index of a site not yet used."""

    def key(name: str):
        stage, _, index = name.rpartition(".")
        return (stage, -int(index)) if index.isdigit() else (name, 0)

    return sorted(names, key=key)


def _count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def _first_input(loader: Iterable) -> Any:
    for batch in loader:
        return batch[0] if isinstance(batch, (list, tuple)) else batch
    raise ValueError("probe: the probe loader yielded no batches")


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


@torch.no_grad()
def _eval_output(view: ProbeView, x: Any) -> torch.Tensor:
    modes = [(m, m.training) for m in view.modules()]
    view.eval()
    try:
        out = view(x)
    finally:
        for m, was in modes:
            m.training = was
    return out if isinstance(out, torch.Tensor) else out[0]


def _plain(value: Any) -> Any:
    """Plain Python data for JSON and ``weights_only=True`` checkpoints."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, torch.Tensor):
        return _plain(value.item() if value.numel() == 1 else value.tolist())
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


# -- the callback ----------------------------------------------------------------------------
class GrowUntilSaturated(Callback):
    """Insert function-preserving blocks while the certified first-order test says depth helps.

    Quick start (growtrain's module and datamodule need no arguments)::

        trainer = lightning.Trainer(callbacks=[GrowUntilSaturated()])
        trainer.fit(ImageClassifier(in_channels=1), ImageDataModule())

    Your own LightningModule: keep the growable network as a submodule (``cifar_resnet``,
    ``GrowableStack``), add ``GrowableModuleMixin`` for checkpoints, build the optimizer from
    ``growtrain.optim.param_groups(network)`` so resumed runs line up, and give the callback a
    probe (``probe=`` or ``datamodule.probe_dataloader()``) that never feeds training.

    Args:
        probe: a DataLoader of ``(input, target)`` held out from training, or a callable
            returning one; ``None`` uses ``trainer.datamodule.probe_dataloader()``.
        network: the growable network: ``None`` finds the first submodule with ``sites()`` and
            ``grow()``; a dotted attribute path (``"network"``, ``"model.backbone"``); or the
            module itself (it must be part of the LightningModule).
        loss_fn: ``loss_fn(output, target)`` → mean batch loss for the probe; ``None`` uses
            ``pl_module.probe_loss`` if defined, else cross-entropy.
        every_n_epochs: check at the end of every n-th training epoch (counted from the last
            check) when ``monitor`` is None.
        monitor: a logged metric (e.g. ``"train_loss"``); when given, check only when it has
            plateaued (the paper grows a converged network) instead of every n epochs.
        mode: ``"min"`` or ``"max"``: the direction in which ``monitor`` improves.
        patience: epochs without an improvement larger than ``min_delta`` that make a plateau.
        min_delta: smallest change of ``monitor`` that counts as an improvement (absolute).
        cooldown: training epochs after each growth during which no check runs.
        probe_budget: ``None`` (checks run on schedule) or a fraction, e.g. ``0.05``: a due check
            is postponed until the samples trained since the last check cover it, i.e.
            ``PROBE_COST · probe size ≤ probe_budget · trained samples`` (``PROBE_COST = 3``
            training-sample equivalents per probe sample), which keeps probing near or below
            that fraction of the fit's compute on any data size. Counted in samples, not seconds,
            so it is deterministic (resume, DDP).
        delta: the practical-saturation margin δ ≥ 0 (gradient-norm units).
        alpha: target error probability in (0, 1) for each decision (or the total with
            ``alpha_spending="geometric"``).
        t: the separation of Proposition 1; overrides ``alpha`` for the paper's rule (with
            ``rule="crossfit"`` it only changes the reported paper figures).
        rule: ``"crossfit"`` (the directional cross-fit lower bound: grow iff some site's bound
            at level α/K exceeds δ) or ``"paper"`` (Proposition 1: grow iff ``Γ̂ > δ + t``);
            ``None`` picks ``"paper"`` when ``t`` is given (``t`` is that rule's threshold) and
            ``"crossfit"`` otherwise. The paper's figures are reported either way; its rule has
            little power at practical probe sizes (docs/callback.md, DESIGN.md §2).
        alpha_spending: ``"none"`` (every check at level α; with ``on_saturated="stop"`` the
            checks are a fixed-sequence procedure, so the run still errs with probability ≤ α),
            ``"geometric"`` (check ``k`` at ``α·2^-(k+1)``) or ``"inverse_square"``
            (``α·6/(π²(k+1)²)``): all checks together err with probability ≤ α
            (``growtrain.crossfit.alpha_schedule``).
        top_k: grow at up to this many distinct certified sites per check.
        max_growths: at most this many growth steps (checks that grew).
        max_blocks: at most this many residual blocks in the network (``network.depth()``).
        max_params: at most this many parameters in the network.
        on_saturated: ``"stop"`` ends ``fit`` when saturated; ``"continue"`` keeps training at
            that depth with no further checks. A budget always only ends growth.
        lr_schedule: after growth, new groups ``"continue"`` on the current schedule, or
            every scheduler ``"restart"`` s from step 0 for the new stage.
        projected: also compute ``V_S`` (Gram matrices; logged, not needed by the decision).
        calibrate: set candidate blocks' BatchNorm statistics on the probe inputs first.
        seed: candidate blocks for check ``k`` come from ``seed·1000 + k``.
        log_sites: log and keep per-site figures (``growth/<site>/grad_norm|projected|ag``).
        verbose: print one table per decision (rank 0).

    Attributes:
        history: one plain dict per check (``epoch``, ``step``, ``site``, ``gamma``,
            ``threshold``, ``saturated``, ``params``, ``depth``, ``reason``, ``error_bound``,
            ``lower``, ``level``, ``action``, ``max_abs_change``, ...).
    """

    def __init__(
        self,
        probe: DataLoader | Callable[[], Iterable] | None = None,
        network: str | nn.Module | None = None,
        loss_fn: Callable[[Any, Any], torch.Tensor] | None = None,
        every_n_epochs: int = 1,
        monitor: str | None = None,
        mode: Literal["min", "max"] = "min",
        patience: int = 3,
        min_delta: float = 0.0,
        cooldown: int = 0,
        probe_budget: float | None = None,
        delta: float = 0.0,
        alpha: float = 0.05,
        t: float | None = None,
        rule: Literal["paper", "crossfit"] | None = None,
        alpha_spending: Literal["none", "geometric", "inverse_square"] = "none",
        top_k: int = 1,
        max_growths: int | None = None,
        max_blocks: int | None = None,
        max_params: int | None = None,
        on_saturated: Literal["stop", "continue"] = "stop",
        lr_schedule: Literal["continue", "restart"] = "continue",
        projected: bool = False,
        calibrate: bool = True,
        seed: int = 0,
        log_sites: bool = True,
        verbose: bool = True,
    ):
        super().__init__()
        if probe is not None and not (isinstance(probe, DataLoader) or callable(probe) or hasattr(probe, "__iter__")):
            raise _bad("probe", "a DataLoader, a callable returning one, or None", type(probe).__name__,
                       "pass probe=datamodule.probe_dataloader (or leave None to use the datamodule's)")  # fmt: skip
        if network is not None and not isinstance(network, (str, nn.Module)):
            raise _bad("network", "None, an attribute path (str) or an nn.Module", type(network).__name__,
                       "pass network='network' (the attribute holding your growable network)")  # fmt: skip
        if loss_fn is not None and not callable(loss_fn):
            raise _bad("loss_fn", "a callable (output, target) -> mean loss, or None", loss_fn, "pass F.cross_entropy")
        _check_int("every_n_epochs", every_n_epochs, 1)
        if monitor is not None and not (isinstance(monitor, str) and monitor):
            raise _bad("monitor", "None or the name of a logged metric", monitor, "pass monitor='train_loss'")
        _check_choice("mode", mode, MODES)
        _check_int("patience", patience, 1)
        if not (isinstance(min_delta, (int, float)) and math.isfinite(min_delta) and min_delta >= 0):
            raise _bad("min_delta", "a finite number >= 0", min_delta, "pass min_delta=0.0")
        _check_int("cooldown", cooldown, 0)
        if probe_budget is not None and (isinstance(probe_budget, bool) or not isinstance(probe_budget, (int, float))
                                         or not 0 < probe_budget <= 1):  # fmt: skip
            raise _bad("probe_budget", "None or a fraction in (0, 1]", probe_budget, "pass probe_budget=0.05 or None")
        if isinstance(delta, bool) or not (isinstance(delta, (int, float)) and math.isfinite(delta) and delta >= 0):
            raise _bad("delta", "a finite number >= 0 (the practical-saturation margin δ)", delta, "pass delta=0.0")
        if isinstance(alpha, bool) or not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
            raise _bad("alpha", "a probability in (0, 1)", alpha, "pass alpha=0.05")
        if t is not None and not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
            raise _bad("t", "None or a finite number > 0", t, "leave t=None to derive it from alpha")
        if rule is None:
            rule = "paper" if t is not None else "crossfit"
        _check_choice("rule", rule, RULES)
        if t is not None and rule == "crossfit":
            rank_zero_warn("GrowUntilSaturated: t only sets the paper rule's threshold; rule='crossfit' decides "
                           "by its lower bound at level alpha, so t changes the reported figures only.")  # fmt: skip
        _check_choice("alpha_spending", alpha_spending, ALPHA_SPENDING)
        _check_int("top_k", top_k, 1)
        _check_int("max_growths", max_growths, 0, optional=True)
        _check_int("max_blocks", max_blocks, 1, optional=True)
        _check_int("max_params", max_params, 1, optional=True)
        _check_choice("on_saturated", on_saturated, ON_SATURATED)
        _check_choice("lr_schedule", lr_schedule, LR_SCHEDULES)
        for name, value in (("projected", projected), ("calibrate", calibrate), ("log_sites", log_sites),
                            ("verbose", verbose)):  # fmt: skip
            if not isinstance(value, bool):
                raise _bad(name, "True or False", value, f"pass {name}=True")
        _check_int("seed", seed, 0)

        self.probe, self.network_spec, self.loss_fn = probe, network, loss_fn
        self.every_n_epochs, self.monitor, self.mode = every_n_epochs, monitor, mode
        self.patience, self.min_delta, self.cooldown = patience, float(min_delta), cooldown
        self.probe_budget = None if probe_budget is None else float(probe_budget)
        self.delta, self.alpha, self.t, self.rule = float(delta), float(alpha), t, rule
        self.alpha_spending, self.top_k = alpha_spending, top_k
        self.max_growths, self.max_blocks, self.max_params = max_growths, max_blocks, max_params
        self.on_saturated, self.lr_schedule = on_saturated, lr_schedule
        self.projected, self.calibrate, self.seed = projected, calibrate, seed
        self.log_sites, self.verbose = log_sites, verbose

        self._network: nn.Module | None = None
        self._loss: Callable | None = None
        self._reset_state()
        self.probe_seconds = 0.0  # wall time inside measure_saturation, this process (not saved)

    def _reset_state(self) -> None:
        self.history: list[dict] = []
        self.checks = 0  # probe checks run (seeds candidate blocks)
        self.growths = 0  # checks that grew
        self.inserted = 0  # blocks inserted by this callback
        self.alpha_index = 0  # α-spending tests used
        self.best: float | None = None
        self.wait = 0
        self.cooldown_left = 0
        self.epochs_since_check = 0
        self.trained_since_check = 0  # training samples (all ranks) since the last check
        self.finished: str | None = None
        self.restart_pending = False

    # -- checkpoint state ------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return _plain(
            {
                "history": self.history,
                "checks": self.checks,
                "growths": self.growths,
                "inserted": self.inserted,
                "alpha_index": self.alpha_index,
                "best": self.best,
                "wait": self.wait,
                "cooldown_left": self.cooldown_left,
                "epochs_since_check": self.epochs_since_check,
                "trained_since_check": self.trained_since_check,
                "finished": self.finished,
                "restart_pending": self.restart_pending,
            }
        )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._reset_state()
        self.history = [dict(h) for h in state_dict.get("history", [])]
        for key in ("checks", "growths", "inserted", "alpha_index", "wait", "cooldown_left", "epochs_since_check",
                    "trained_since_check"):  # fmt: skip
            setattr(self, key, int(state_dict.get(key, 0)))
        self.best = state_dict.get("best")
        self.finished = state_dict.get("finished")
        self.restart_pending = bool(state_dict.get("restart_pending", False))

    # -- setup: refuse early ------------------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._check_strategy(trainer)
        self._network = self._resolve_network(pl_module, required=not self._builds_late(pl_module))
        self._loss = self._resolve_loss(pl_module)
        if self.probe is None:
            dm = trainer.datamodule
            if dm is None or not callable(getattr(dm, "probe_dataloader", None)):
                raise ValueError(
                    "probe: no probe data. GrowUntilSaturated needs a held-out probe sample: pass "
                    "GrowUntilSaturated(probe=<DataLoader or callable>) or use a datamodule with a "
                    "probe_dataloader() method (growtrain.data.ImageDataModule has one). The probe must never "
                    "be trained on."
                )
            self._check_datamodule_split(dm)

    def on_train_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self._network is None:
            self._network = self._resolve_network(pl_module, required=True)
        probe = self._probe_loader(trainer)
        train = _datasets(trainer.train_dataloader)
        probe_ds = getattr(probe, "dataset", None)
        for ds in train:
            overlap = probe_overlap(probe_ds, ds)
            if overlap is not None:
                raise ValueError(
                    f"probe: the probe sample overlaps the training data ({overlap}). The certificate needs a "
                    "probe independent of training. Fix: carve the probe out of the training split (e.g. "
                    "ImageDataModule's probe_size) and never train on it."
                )

    def _check_strategy(self, trainer: Trainer) -> None:
        strategy = trainer.strategy
        names = {cls.__name__ for cls in type(strategy).__mro__}
        for name, why in _UNSUPPORTED_STRATEGIES.items():
            if name in names:
                raise RuntimeError(
                    f"strategy: GrowUntilSaturated does not support {type(strategy).__name__} ({why}). "
                    "Supported: single device and strategy='ddp'."
                )
        launcher = getattr(strategy, "launcher", None)
        if launcher is not None and type(launcher).__name__ == "_MultiProcessingLauncher":
            raise RuntimeError(
                f"strategy: GrowUntilSaturated does not support spawn/fork-based DDP "
                f"(start_method={getattr(strategy, '_start_method', '?')!r}): Lightning copies rank 0's weights back "
                "into the un-grown parent model with strict=False, silently dropping the grown blocks. "
                "Fix: use strategy='ddp' (subprocess launcher) and run your script from the command line."
            )
        if trainer.world_size > 1 and not hasattr(strategy, "configure_ddp"):
            raise RuntimeError(
                f"strategy: {type(strategy).__name__} with {trainer.world_size} processes is not supported; "
                "use strategy='ddp'."
            )

    @staticmethod
    def _builds_late(pl_module: LightningModule) -> bool:
        """Does the module build its layers in ``configure_model``/``setup`` (after callback setup)?"""
        cls = type(pl_module)
        return any(getattr(cls, hook) is not getattr(LightningModule, hook) for hook in ("configure_model", "setup"))

    def _resolve_network(self, pl_module: LightningModule, required: bool) -> nn.Module | None:
        spec = self.network_spec
        if isinstance(spec, nn.Module):
            if not any(m is spec for m in pl_module.modules()):
                raise ValueError(
                    "network: the given module is not part of the LightningModule, so the optimizer would not "
                    "train it. Fix: pass the attribute path instead, e.g. network='network'."
                )
            network = spec
        elif isinstance(spec, str):
            try:
                network = pl_module.get_submodule(spec)
            except AttributeError:
                if not required:
                    return None
                raise ValueError(
                    f"network: {type(pl_module).__name__} has no submodule {spec!r}. Fix: pass the attribute path "
                    "of your growable network (e.g. network='network') or leave network=None to find it."
                ) from None
        else:
            network = find_growable(pl_module)
            if network is None:
                if not required:
                    return None
                raise ValueError(
                    f"network: {type(pl_module).__name__} has no growable submodule (one with sites() and grow()). "
                    "Fix: build your network with growtrain.models.cifar_resnet or wrap your residual blocks in "
                    "growtrain.GrowableStack, or pass network='<attribute path>'."
                )
        for attr in ("sites", "grow", "growth_log"):
            if not hasattr(network, attr):
                raise ValueError(
                    f"network: {type(network).__name__} has no {attr}; a growable network needs sites(), grow() and "
                    "growth_log (see growtrain.growable.GrowableMixin)."
                )
        if not network.sites():
            raise ValueError(
                f"network: {type(network).__name__} has no candidate sites, so nothing can be grown. Fix: give each "
                "stage room for a same-shape block (see the model's first_site())."
            )
        return network

    def _resolve_loss(self, pl_module: LightningModule) -> Callable:
        if self.loss_fn is not None:
            return self.loss_fn
        probe_loss = getattr(pl_module, "probe_loss", None)
        return probe_loss if callable(probe_loss) else F.cross_entropy

    @staticmethod
    def _check_datamodule_split(dm: Any) -> None:
        train = getattr(dm, "train_indices", None)
        probe = getattr(dm, "probe_indices", None)
        if train is None or probe is None:
            return
        common = set(torch.as_tensor(train).tolist()) & set(torch.as_tensor(probe).tolist())
        if common:
            raise ValueError(
                f"probe: the datamodule's probe_indices and train_indices share {len(common)} sample(s) "
                f"(e.g. {sorted(common)[:5]}). The probe must be held out from training. Fix: make the splits disjoint."
            )

    def _probe_loader(self, trainer: Trainer) -> Any:
        source = self.probe
        if source is None:
            loader = trainer.datamodule.probe_dataloader()
        elif isinstance(source, DataLoader) or not callable(source):
            loader = source
        else:
            loader = source()
        return _shard(loader, trainer.global_rank, trainer.world_size)

    # -- hooks -----------------------------------------------------------------------------
    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.restart_pending:
            self._restart_schedules(trainer, pl_module)

    def on_train_epoch_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.finished is not None:
            return
        self.epochs_since_check += 1
        self.trained_since_check += self._samples_per_epoch(trainer)
        if self.cooldown_left > 0:
            self.cooldown_left -= 1
            return
        plateaued = False
        if self.monitor is not None:
            plateaued = self._track_monitor(trainer)
        check, _ = should_check(
            finished=self.finished, cooldown_left=self.cooldown_left, epochs_since_check=self.epochs_since_check,
            every_n_epochs=self.every_n_epochs, monitor=self.monitor, plateaued=plateaued,
            probe_budget=self.probe_budget, trained_samples=self.trained_since_check,
            probe_samples=self._probe_samples(trainer) if self.probe_budget is not None else 0,
        )  # fmt: skip
        if trainer.world_size > 1:
            check = trainer.strategy.reduce_boolean_decision(check, all=False)
        if check:
            self._check(trainer, pl_module)

    @staticmethod
    def _samples_per_epoch(trainer: Trainer) -> int:
        """Training samples of one epoch over all ranks: batches (after ``limit_train_batches``)
        × the train loader's batch size × world size (a count, not a measurement)."""
        batches = trainer.num_training_batches
        loaders = trainer.train_dataloader
        loader = loaders if isinstance(loaders, DataLoader) else next(iter(_loaders(loaders)), None)
        size = getattr(loader, "batch_size", None) or 1
        if not isinstance(batches, (int, float)) or not math.isfinite(batches):
            return 0
        return int(batches) * int(size) * trainer.world_size

    def _probe_samples(self, trainer: Trainer) -> int:
        loader = self._probe_loader(trainer)
        dataset = getattr(loader, "dataset", None)
        try:
            return len(dataset) if dataset is not None else sum(len(b[-1]) for b in loader)
        except TypeError:
            return 0

    def _track_monitor(self, trainer: Trainer) -> bool:
        value = trainer.callback_metrics.get(self.monitor)
        if value is None:
            raise RuntimeError(
                f"monitor: metric {self.monitor!r} is not logged; available: {sorted(trainer.callback_metrics)}. "
                "Fix: log it per epoch (self.log('train_loss', loss, on_epoch=True)) or pass monitor=None."
            )
        self.best, self.wait, plateaued = plateau_update(
            float(value), self.best, self.wait, mode=self.mode, min_delta=self.min_delta, patience=self.patience
        )
        return plateaued

    # -- one check -------------------------------------------------------------------------
    def _check(self, trainer: Trainer, pl_module: LightningModule) -> None:
        network = self._network
        assert network is not None
        self.epochs_since_check = 0
        self.trained_since_check = 0
        depth = self._depth(network)
        params = _count_params(network)
        record: dict[str, Any] = {
            "check": self.checks, "epoch": trainer.current_epoch, "step": trainer.global_step,
            "depth_before": depth, "params_before": params, "level": None,
        }  # fmt: skip
        blocked = budget_reason(
            growths=self.growths, max_growths=self.max_growths, depth=depth, max_blocks=self.max_blocks,
            params=params, max_params=self.max_params,
        )  # fmt: skip
        report = None
        if blocked is not None:  # known before probing: save the probe
            action, reason, sites = "budget", blocked, []
        else:
            report, level = self._measure(trainer, pl_module, network)
            record["level"] = level
            ranked = rank_sites(report, self.top_k)
            block_params = {name: _count_params(report.record(name).block) for name in ranked}
            action, reason, sites = decide_growth(
                saturated=report.saturated, ranked=ranked, block_params=block_params, growths=self.growths,
                max_growths=self.max_growths, depth=depth, max_blocks=self.max_blocks, params=params,
                max_params=self.max_params, reason=report.reason,
            )  # fmt: skip
        if action == "grow":
            record.update(self._grow(trainer, pl_module, network, report, sites))
            self.growths += 1
            self.cooldown_left = self.cooldown
            self.best, self.wait = None, 0
        elif action == "saturated":
            self.finished = "saturated"
            if self.on_saturated == "stop":
                trainer.should_stop = True
        else:
            self.finished = "budget"
        record.update(self._summary(report, action, reason, sites, network))
        self.history.append(_plain(record))
        self._emit(trainer, report, record)
        if action == "saturated" and self.on_saturated == "stop":
            rank_zero_info(f"GrowUntilSaturated: stopping training at epoch {trainer.current_epoch}: {reason}")

    def _measure(
        self, trainer: Trainer, pl_module: LightningModule, network: nn.Module
    ) -> tuple[SaturationReport, float]:
        level = self.alpha
        if self.alpha_spending != "none":
            from growtrain.crossfit import alpha_schedule

            level = float(alpha_schedule(self.alpha, self.alpha_index, scheme=self.alpha_spending))
        sync_fn = None
        if trainer.world_size > 1:
            sync_fn = lambda t: trainer.strategy.reduce(t, reduce_op="sum")  # noqa: E731
        loader = self._probe_loader(trainer)
        seed = self.seed * 1000 + self.checks
        start = time.perf_counter()
        report = measure_saturation(
            ProbeView(pl_module, network), loader, self._loss, delta=self.delta, alpha=level, t=self.t,
            projected=self.projected, rule=self.rule, seed=seed, calibrate=self.calibrate,
            autocast_dtype=self._autocast_dtype(trainer), sync_fn=sync_fn,
        )  # fmt: skip
        self.probe_seconds += time.perf_counter() - start
        self.checks += 1
        self.alpha_index += 1
        return report, level

    @staticmethod
    def _autocast_dtype(trainer: Trainer) -> torch.dtype | None:
        precision = str(trainer.precision)
        if precision.startswith("bf16-mixed"):
            return torch.bfloat16
        if precision.startswith("16-mixed"):
            return torch.float16 if trainer.strategy.root_device.type == "cuda" else torch.bfloat16
        return None

    @staticmethod
    def _depth(network: nn.Module) -> int | None:
        depth = getattr(network, "depth", None)
        return int(depth()) if callable(depth) else None

    def _grow(
        self, trainer: Trainer, pl_module: LightningModule, network: nn.Module, report: SaturationReport,
        sites: Sequence[str],
    ) -> dict:  # fmt: skip
        """Insert the scored candidates, verify the output, then reconfigure optimizer and DDP."""
        device = next(network.parameters()).device
        x = _to(_first_input(self._probe_loader(trainer)), device)
        view = ProbeView(pl_module, network)
        before = _eval_output(view, x)
        log_len = len(network.growth_log)
        inserted: list[nn.Module] = []
        try:
            for name in _insertion_order(sites):
                block = report.record(name).block
                inserted.append(network.grow(name, block=block))
            after = _eval_output(view, x)
            change = float((after.float() - before.float()).abs().max()) if before.numel() else 0.0
            tolerance = insertion_tolerance(before.dtype, float(before.float().abs().max()) if before.numel() else 1.0)
            if not math.isfinite(change) or change > tolerance or after.shape != before.shape:
                raise FunctionChangedError(
                    f"inserting blocks at {list(sites)} changed the network's output on a probe batch by "
                    f"max|Δ|={change:.3g} > tolerance {tolerance:.3g} ({before.dtype}); the insertion was undone. "
                    "A zero-output block must leave the function unchanged: check the family's zero_init_last() and "
                    "that the site's input is in the block's identity regime (e.g. z ≥ 0 for 'basic' blocks)."
                )
        except BaseException:
            _undo_growth(network, inserted, log_len)
            raise
        ks = list(range(log_len, log_len + len(inserted)))
        blocks_in_k_order = [b for b in grown_blocks(network) if any(b is i for i in inserted)] or inserted
        optimizer = self._optimizer_for(trainer, network)
        if optimizer is not None:
            reconfigure_optimizer(pl_module, optimizer, trainer.strategy.lr_scheduler_configs, blocks_in_k_order, ks)
            if self.lr_schedule == "restart" and trainer.strategy.lr_scheduler_configs:
                self.restart_pending = True
        self._rewrap_ddp(trainer)
        self.inserted += len(inserted)
        return {"max_abs_change": change, "tolerance": tolerance, "growth_index": ks}

    @staticmethod
    def _optimizer_for(trainer: Trainer, network: nn.Module):
        ids = {id(p) for p in network.parameters()}
        for opt in trainer.optimizers:
            if any(id(p) in ids for g in opt.param_groups for p in g["params"]):
                return opt
        if trainer.optimizers:
            rank_zero_warn("GrowUntilSaturated: no optimizer holds the network's parameters; new blocks were not added")
        return None

    def _restart_schedules(self, trainer: Trainer, pl_module: LightningModule) -> None:
        optimizer = self._optimizer_for(trainer, self._network) if self._network is not None else None
        if optimizer is not None:
            configs = restart_schedulers(pl_module, optimizer, trainer.strategy.lr_scheduler_configs)
            trainer.strategy.lr_scheduler_configs = configs
        self.restart_pending = False

    @staticmethod
    def _rewrap_ddp(trainer: Trainer) -> None:
        """DDP registers its gradient hooks at construction: wrap the grown module again (the DDP
        constructor also broadcasts rank 0's parameters, aligning the new blocks)."""
        strategy = trainer.strategy
        if trainer.world_size > 1 and hasattr(strategy, "configure_ddp"):
            strategy.model = strategy.lightning_module
            strategy.configure_ddp()

    # -- telemetry -------------------------------------------------------------------------
    def _summary(self, report, action, reason, sites, network) -> dict:
        out = {
            "action": action,
            "reason": reason,
            "site": sites[0] if sites else None,
            "sites": list(sites),
            "saturated": action == "saturated",
            "params": _count_params(network),
            "depth": self._depth(network),
        }
        keys = ("gamma", "threshold", "t", "delta", "alpha", "n", "error_bound", "rule")
        if report is None:
            out.update({k: None for k in keys})
            out.update({"lower": None, "best_site": None, "ag_max": None})
            return out
        out.update({k: getattr(report, k) for k in keys})
        out["ag_max"] = report.ag_max
        out["best_site"] = report.best_record.name
        lowers = [r.lower for r in report.sites if r.lower is not None]
        out["lower"] = max(lowers) if lowers else None
        if report.extra:
            out["extra"] = dict(report.extra)
        if self.log_sites:
            out["site_scores"] = [r.to_dict() for r in report.sites]
        return out

    def _emit(self, trainer: Trainer, report: SaturationReport | None, record: dict) -> None:
        metrics = {
            "growth/depth": record.get("depth"),
            "growth/params": record.get("params"),
            "growth/saturated": float(record["saturated"]),
            "growth/grew": float(len(record["sites"])),
        }
        if report is not None:
            metrics.update(
                {
                    "growth/gamma": report.gamma,
                    "growth/threshold": report.threshold,
                    "growth/error_bound": report.error_bound,
                }
            )
            if record.get("lower") is not None:
                metrics["growth/lower"] = record["lower"]
            if self.log_sites:
                for r in report.sites:
                    for key in ("grad_norm", "projected", "ag", "lower"):
                        value = getattr(r, key)
                        if value is not None:
                            metrics[f"growth/{r.name}/{key}"] = value
        metrics = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        for logger in trainer.loggers:
            logger.log_metrics(metrics, step=trainer.global_step)
        path = self.history_path(trainer)  # every rank: trainer.log_dir is a collective (broadcast)
        if not trainer.is_global_zero:
            return
        self._write_history(path)
        if self.verbose:
            self._print_table(trainer, report, record)

    @staticmethod
    def history_path(trainer: Trainer) -> str:
        """``growth_history.json`` in ``trainer.log_dir`` (else ``default_root_dir``); call on every rank."""
        root = trainer.log_dir or trainer.default_root_dir
        return os.path.join(root, "growth_history.json")

    def _write_history(self, path: str) -> None:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        tmp = path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.history, f, indent=1, allow_nan=True)
        os.replace(tmp, path)

    def _print_table(self, trainer: Trainer, report: SaturationReport | None, record: dict) -> None:
        from rich.console import Console

        title = f"growth check {record['check']} (epoch {record['epoch']}, step {record['step']}): {record['action']}"
        if report is not None:
            from growtrain.report import saturation_table

            renderable: Any = saturation_table(report, title=title)
            renderable.caption = f"{renderable.caption}\n{record['reason']}"
        else:
            renderable = f"{title}: {record['reason']}"
        bar = trainer.progress_bar_callback
        console = getattr(bar, "_console", None)
        if bar is not None and type(bar).__name__ == "RichProgressBar" and console is not None:
            console.print(renderable)  # rich prints above its live progress display
            return
        buffer = io.StringIO()
        Console(file=buffer, width=120, force_terminal=False, color_system=None).print(renderable)
        rank_zero_info(buffer.getvalue().rstrip())
