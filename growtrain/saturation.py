"""The saturation certificate: one joint probe pass that scores every candidate site.

``measure_saturation(network, probe_loader, loss_fn)`` puts a zero-output *candidate* block
(a ghost) at every site of ``network.sites()`` at once. Because every ghost has ``V = 0`` the
network's function is unchanged and the joint gradient is the concatenation of the per-site
gradients (the paper's Corollary 2), so one forward+backward per probe batch scores all sites.
A ghost never runs ``V``: the probe keeps its features ``φ(z)`` from the forward pass and the
activation gradient ``q`` at the site from the backward pass, and forms ``ξ = J(z)ᵀ q``
directly (docs/design.md §2, "The probe pass").

Per site it reports ``grad_norm = ‖ĝ‖₂``, ``variance = σ̂²``, ``ag`` (Remark 1), ``ag_batch``
(Eq. 2) and ``projected = V_S = sqrt(ĝᵀ Ĝ† ĝ)`` (Lemma 4); the decision is Proposition 1's
``saturated ⇔ Γ̂_n ≤ δ + t``.

Conventions: ``loss_fn(output, target)`` returns the *mean* loss over the batch's samples
(for language models, a sample is a sequence), so the per-sample activation gradient is the
batch size times the gradient of the batch loss. The probe runs in eval mode, so samples are
independent (BatchNorm uses running statistics). No Lightning import here.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
from torch import nn

from growtrain import decision as dec
from growtrain import probe_math as pm
from growtrain.batches import batch_size as _batch_size
from growtrain.batches import slice_batch as _slice
from growtrain.batches import sample_loss_terms
from growtrain.batches import to_device as _to_device
from growtrain.families.base import ChannelAffineFeatures, DenseFeatures
from growtrain.growable import Site, terminal_parameters

__all__ = ["measure_saturation", "SaturationReport", "SiteRecord", "candidate_blocks", "calibrate_candidates"]

RULES = dec.RULES


# -- report --------------------------------------------------------------------------------
@dataclass
class SiteRecord:
    """Scores of one candidate site; ``block`` is the scored candidate (``V = 0``)."""

    site: Site
    block: nn.Module
    grad_norm: float
    variance: float
    ag: float
    ag_batch: float
    projected: float | None
    grad: list[torch.Tensor] = field(repr=False)  # ĝ, shaped like block.terminal_parameters()
    lower: float | None = None  # rule="crossfit": certified lower bound on ‖g_pop‖

    @property
    def name(self) -> str:
        return self.site.name

    @property
    def realisability(self) -> float | None:
        """``V_S / AG`` (Remark 3): 1 when the activation gradient is fully realisable."""
        if self.projected is None or self.ag == 0:
            return None
        return self.projected / self.ag

    def to_dict(self) -> dict:
        return {
            "site": self.name,
            "grad_norm": self.grad_norm,
            "variance": self.variance,
            "ag": self.ag,
            "ag_batch": self.ag_batch,
            "projected": self.projected,
            "realisability": self.realisability,
            "lower": self.lower,
        }


@dataclass
class SaturationReport:
    sites: list[SiteRecord]
    gamma: float  # Γ̂_n = max_l ‖ĝ_l‖₂
    t: float
    threshold: float  # δ + t
    delta: float
    alpha: float
    n: int
    saturated: bool
    best_site: str | None  # the site growth would use (None when saturated)
    error_bound: float  # Σ_l σ̂²_l / (n t²)
    rule: str = "paper"  # the rule that made ``saturated``/``best_site``/``reason``
    reason: str = ""
    extra: dict = field(default_factory=dict)  # rule-specific figures (e.g. crossfit levels)
    margin: float = math.nan  # what the deciding rule's statistic had to exceed (δ+t, δ or max(δ, τ·R))
    reference: float | None = None  # rule="relative": R, the existing blocks' RMS gradient norm
    tau: float | None = None  # rule="relative": the relative threshold τ
    verdicts: dict = field(default_factory=dict)  # every rule's verdict this pass could compute

    @property
    def ratio(self) -> float | None:
        """The best certified lower bound in units of ``R`` (rule="relative"); grow iff > τ."""
        if self.reference is None:
            return None
        best = max((r.lower for r in self.sites if r.lower is not None), default=None)
        if best is None:
            return None
        return best / self.reference if self.reference > 0 else math.inf

    @property
    def ag_max(self) -> float:
        return max(r.ag for r in self.sites)

    @property
    def best_record(self) -> SiteRecord:
        """The top-scoring site's record (also when saturated): largest lower bound under the
        cross-fit rule, largest ‖ĝ‖ under the paper's."""
        if self.rule in ("crossfit", "relative"):
            return max(self.sites, key=lambda r: r.lower)
        return max(self.sites, key=lambda r: r.grad_norm)

    def record(self, site: Site | str) -> SiteRecord:
        name = site.name if isinstance(site, Site) else site
        for r in self.sites:
            if r.name == name:
                return r
        raise KeyError(f"site: no record for {name!r}; scored sites are {[r.name for r in self.sites]}")

    def to_dict(self) -> dict:
        return {
            "rule": self.rule,
            "gamma": self.gamma,
            "t": self.t,
            "threshold": self.threshold,
            "delta": self.delta,
            "alpha": self.alpha,
            "n": self.n,
            "saturated": self.saturated,
            "best_site": self.best_site,
            "error_bound": self.error_bound,
            "ag_max": self.ag_max,
            "reason": self.reason,
            "margin": self.margin,
            "reference": self.reference,
            "tau": self.tau,
            "ratio": self.ratio,
            "verdicts": {k: v.to_dict() for k, v in self.verdicts.items()},
            **{k: v for k, v in self.extra.items()},
            "sites": [r.to_dict() for r in self.sites],
        }

    def table(self):
        from growtrain.report import saturation_table

        return saturation_table(self)

    def __rich__(self):
        return self.table()


# -- candidates ----------------------------------------------------------------------------
def candidate_blocks(network: nn.Module, seed: int | None = 0) -> dict[str, nn.Module]:
    """A fresh zero-output candidate per site, reproducible from ``seed`` (site ``j`` uses
    the private stream ``seed·1000003 + j``)."""
    out = {}
    for j, site in enumerate(network.sites()):
        out[site.name] = network.new_block(site, seed=None if seed is None else int(seed) * 1_000_003 + j)
    return out


def _batch_norms(module: nn.Module) -> list[nn.modules.batchnorm._BatchNorm]:
    return [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _save_modes(module: nn.Module) -> list[tuple[nn.Module, bool]]:
    """Every submodule's own train/eval flag (a user may keep, e.g., a frozen BN in eval)."""
    return [(m, m.training) for m in module.modules()]


def _restore_modes(modes: list[tuple[nn.Module, bool]]) -> None:
    for m, training in modes:
        m.training = training


@contextmanager
def _frozen(network: nn.Module):
    """Parameters need no gradient in the probe (only the site activations do): with them
    frozen, layers stop saving inputs for weight gradients, which lowers the pass's memory.
    The graph then starts at the first site (see ``capture``)."""
    flags = [(p, p.requires_grad) for p in network.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


# -- hooks ---------------------------------------------------------------------------------
@contextmanager
def _site_hooks(network: nn.Module, sites: list[Site], on_activation: Callable[[int, torch.Tensor], Any]):
    """Call ``on_activation(j, z)`` with the activation at site ``j`` during each forward.

    The activation at ``stage.i`` is the input of block ``i`` (or the output of the stage's
    last block at the end). A returned tensor replaces the activation.
    """
    handles = []
    try:
        for j, site in enumerate(sites):
            stage = network.stage(site.stage)
            if len(stage) == 0:
                # A ModuleList is never called itself, so an empty stage has nothing to hook.
                raise ValueError(
                    f"network: stage {site.stage!r} has no blocks, so the probe cannot find the activation at "
                    f"{site.name}; give every growable stage at least one block"
                )
            if site.index < len(stage):

                def pre_hook(module, args, j=j):
                    new = on_activation(j, args[0])
                    return None if new is None else (new,) + tuple(args[1:])

                handles.append(stage[site.index].register_forward_pre_hook(pre_hook))
            else:

                def post_hook(module, args, output, j=j):
                    return on_activation(j, output)

                handles.append(stage[site.index - 1].register_forward_hook(post_hook))
        yield
    finally:
        for h in handles:
            h.remove()


def _split_batch(batch):
    if not isinstance(batch, (list, tuple)) or len(batch) != 2:
        raise TypeError(
            f"probe_loader: expected batches of (input, target), got {type(batch).__name__}"
            + (f" of length {len(batch)}" if isinstance(batch, (list, tuple)) else "")
        )
    x, y = batch
    # A short target would otherwise fail deep inside the loss with no word about the probe, or
    # broadcast silently in a loss like MSE; the per-sample scaling and n count targets.
    if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dim() and y.dim() and len(x) != len(y):
        raise ValueError(
            f"probe_loader: a probe batch has {len(x)} inputs but {len(y)} targets; every input needs its "
            "target (check the probe dataset's collate_fn)"
        )
    return batch


def _autocast(device: torch.device, dtype: torch.dtype | None):
    if dtype is None:
        return torch.autocast(device.type, enabled=False)
    return torch.autocast(device.type, dtype=dtype)


# -- BatchNorm calibration of the ghosts -----------------------------------------------------
@torch.no_grad()
def calibrate_candidates(
    network: nn.Module,
    candidates: Mapping[str, nn.Module],
    probe_loader: Iterable,
    *,
    autocast_dtype: torch.dtype | None = None,
    sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> None:
    """Set each ghost's BatchNorm running statistics from the probe sample's activations.

    A fresh BatchNorm has running mean 0 and variance 1, so in eval mode a ghost's features
    would be unnormalised. One forward pass over the probe inputs (no labels, no gradients, so
    the protocol is still fixed before any gradient is seen) runs each ghost in train mode with
    a cumulative average (``momentum=None``), the way ``torch.optim.swa_utils.update_bn``
    does. Inner BatchNorms see batch-normalised inputs during this pass, a small approximation.
    With ``sync_fn`` (a sum over ranks) the statistics are averaged over ranks.
    """
    sites = network.sites()
    blocks = [candidates[s.name] for s in sites]
    bns = [bn for b in blocks for bn in _batch_norms(b)]
    if not bns:
        return
    saved = [(bn.momentum, bn.training) for bn in bns]
    for bn in bns:
        bn.reset_running_stats()
        bn.momentum = None
    modes = _save_modes(network)
    network.eval()
    device = network.neighbour_tensor(sites[0]).device

    def run_ghost(j, z):
        blocks[j].train()
        blocks[j](z)
        blocks[j].eval()

    try:
        with _site_hooks(network, sites, run_ghost), _autocast(device, autocast_dtype):
            for batch in probe_loader:
                x, _ = _split_batch(batch)
                network(_to_device(x, device))
    finally:
        _restore_modes(modes)
        for bn, (momentum, training) in zip(bns, saved):
            bn.momentum = momentum
            bn.train(training)
    if sync_fn is not None:
        world = float(sync_fn(torch.ones((), device=device, dtype=torch.float64)))
        for bn in bns:
            bn.running_mean.copy_(sync_fn(bn.running_mean.double()) / world)
            bn.running_var.copy_(sync_fn(bn.running_var.double()) / world)


# -- per-site accumulation -----------------------------------------------------------------
class _SiteAccumulator:
    """Streamed float64 sums for one site; every field is a sum, so ranks all-reduce them."""

    def __init__(self, block: nn.Module, projected: bool):
        self.block = block
        self.projected = projected
        self.fast = hasattr(block, "probe_features")
        self.sum_xi: torch.Tensor | None = None  # Σ ξ_i
        # Scalar sums start as Python floats' tensors on the first update's device (CUDA or CPU):
        # a CPU accumulator added to CUDA norms crashed the first check on a GPU.
        self.sum_sq: torch.Tensor | float = 0.0  # Σ ‖ξ_i‖²
        self.sum_q_sq: torch.Tensor | float = 0.0  # Σ ‖q_i‖²
        self.sum_batch_norm: torch.Tensor | float = 0.0  # Σ_b ‖∇_H L_b‖
        self.gram: torch.Tensor | None = None  # Σ J_iᵀ J_i in the kind's compact form
        self.kind = None

    def features(self, z: torch.Tensor):
        """What the forward pass keeps for this site (no graph)."""
        return self.block.probe_features(z) if self.fast else z

    def per_sample(self, feats, q: torch.Tensor) -> torch.Tensor:
        """Per-sample cross-gradients ``ξ_i``, and the Gram increment when asked."""
        if isinstance(feats, DenseFeatures):
            self.kind = "dense"
            if feats.simple_conv:
                phi = feats.phi.to(q.dtype)
                if self.projected:
                    self._add_gram(pm.dense_gram(feats.patches().to(q.dtype)))
                xi = pm.conv_cross_gradients(phi, q, feats.conv[2])  # (B, N, C·k²)
                if feats.bias:
                    xi = torch.cat([xi, q.sum((2, 3)).unsqueeze(-1)], dim=-1)
                return xi
            patches = feats.patches().to(q.dtype)  # (B, P, K)
            if q.dim() == 2:
                qq = q.unsqueeze(1)  # (B, 1, N)
            elif feats.conv is not None:
                qq = q.flatten(2).transpose(1, 2)  # (B, N, H, W) → (B, P, N)
            else:
                qq = q  # (B, T, N)
            if self.projected:
                self._add_gram(pm.dense_gram(patches))
            return pm.dense_cross_gradients(patches, qq)  # (B, N, K)
        if isinstance(feats, ChannelAffineFeatures):
            self.kind = "affine"
            uhat, mask, qq = feats.uhat.to(q.dtype), feats.mask.to(q.dtype), q.flatten(2)
            if self.projected:
                self._add_gram(pm.affine_gram(uhat, mask))
            return pm.affine_cross_gradients(uhat, mask, qq)  # (B, C, 2)
        self.kind = "generic"
        xi, jac = _generic_per_sample(self.block, feats, q, self.projected)
        if jac is not None:
            self._add_gram(torch.einsum("bop,boq->pq", jac, jac))
        return xi  # (B, p)

    def _add_gram(self, gram: torch.Tensor) -> None:
        gram = gram.double()
        self.gram = gram if self.gram is None else self.gram + gram

    def update(self, feats, q: torch.Tensor, batch_grad: torch.Tensor) -> torch.Tensor:
        xi = self.per_sample(feats, q)
        s = xi.sum(0).double()
        self.sum_xi = s if self.sum_xi is None else self.sum_xi + s
        # Σ_i ‖ξ_i‖² is the squared norm of the whole (B, …) tensor: no per-sample temporaries.
        self.sum_sq = self.sum_sq + torch.linalg.vector_norm(xi).double().pow(2)
        self.sum_q_sq = self.sum_q_sq + torch.linalg.vector_norm(q).double().pow(2)
        self.sum_batch_norm = self.sum_batch_norm + torch.linalg.vector_norm(batch_grad).double()
        return xi

    def tensors(self) -> list[torch.Tensor]:
        out = [self.sum_xi, self.sum_sq, self.sum_q_sq, self.sum_batch_norm]
        return out + ([self.gram] if self.gram is not None else [])

    def load(self, tensors: list[torch.Tensor]) -> None:
        self.sum_xi, self.sum_sq, self.sum_q_sq, self.sum_batch_norm = tensors[:4]
        if self.gram is not None:
            self.gram = tensors[4]

    def projected_value(self, n: int) -> float | None:
        if not self.projected or self.gram is None:
            return None
        grad, gram = self.sum_xi / n, self.gram / n
        if self.kind == "dense":
            return float(pm.projected_dense(grad, gram))
        if self.kind == "affine":
            return float(pm.projected_blocks(grad, gram))
        return float(pm.projected_full(grad.flatten(), gram))

    def split(self, vector: torch.Tensor) -> list[torch.Tensor]:
        params = terminal_parameters(self.block)
        if self.fast and hasattr(self.block, "split_terminal"):
            return [t.to(p.dtype) for t, p in zip(self.block.split_terminal(vector), params)]
        if self.kind == "dense" and vector.dim() == 2 and len(params) == 2:
            rows, cols = vector.shape  # (N, K+1) for DenseFeatures(bias=True): weight columns, then bias
            weight, bias = params
            if bias.numel() == rows and weight.numel() == rows * (cols - 1):
                return [vector[:, :-1].reshape(weight.shape).to(weight.dtype), vector[:, -1].reshape(bias.shape).to(bias.dtype)]
        flat, out, start = vector.flatten(), [], 0
        for p in params:
            out.append(flat[start : start + p.numel()].reshape(p.shape).to(p.dtype))
            start += p.numel()
        return out


GENERIC_GRAM_LIMIT = 4096


def _generic_per_sample(block: nn.Module, z: torch.Tensor, q: torch.Tensor, with_jacobian: bool):
    """Per-sample ``ξ_i = J_iᵀ q_i`` of a block without a feature form, by ``torch.func``.

    Returns ``(ξ: (B, p), J: (B, out, p) or None)``.
    """
    from torch.func import functional_call, jacrev, vjp, vmap

    terminal = terminal_parameters(block)
    ids = {id(p) for p in terminal}
    names = {id(p): name for name, p in block.named_parameters()}
    t_names = [names[id(p)] for p in terminal]
    fixed = {name: p.detach() for name, p in block.named_parameters() if id(p) not in ids}
    fixed.update(dict(block.named_buffers()))
    t_values = tuple(p.detach() for p in terminal)

    def out_fn(values, z_i):
        params = {**fixed, **dict(zip(t_names, values))}
        return functional_call(block, params, (z_i.unsqueeze(0),)).squeeze(0)

    def xi_fn(z_i, q_i):
        _, pullback = vjp(lambda values: out_fn(values, z_i), t_values)
        return torch.cat([g.flatten() for g in pullback(q_i)[0]])

    xi = vmap(xi_fn)(z, q)  # (B, p)
    jac = None
    if with_jacobian:
        p = xi.shape[1]
        if p > GENERIC_GRAM_LIMIT:
            raise ValueError(
                f"projected: this block's terminal map has {p} parameters; the generic path builds a "
                f"({p}×{p}) Gram matrix from full Jacobians (limit {GENERIC_GRAM_LIMIT}). Pass "
                "projected=False, or give the block a probe_features() fast form."
            )

        def jac_fn(z_i):
            jacs = jacrev(lambda values: out_fn(values, z_i))(t_values)
            return torch.cat([j.reshape(-1, int(t.numel())) for j, t in zip(jacs, t_values)], dim=1)

        jac = vmap(jac_fn)(z)  # (B, out, p)
    return xi, jac


# -- the probe pass ------------------------------------------------------------------------
def _check_arguments(network, delta, alpha, t, rule):
    if not (callable(getattr(network, "sites", None)) and callable(getattr(network, "stage", None))):
        raise TypeError(
            f"network: expected a growable network with sites() (e.g. growtrain.models.cifar_resnet "
            f"or growtrain.GrowableStack), got {type(network).__name__}"
        )
    if not network.sites():
        raise ValueError("network: it has no candidate sites, so there is nothing to score")
    if not (isinstance(delta, (int, float)) and math.isfinite(delta) and delta >= 0):
        raise ValueError(f"delta: expected a finite number ≥ 0 (the practical-saturation margin), got {delta!r}")
    if t is None:
        if not (isinstance(alpha, (int, float)) and 0 < alpha < 1):
            raise ValueError(f"alpha: expected a target error probability in (0, 1), e.g. 0.05, got {alpha!r}")
    elif not (isinstance(t, (int, float)) and math.isfinite(t) and t > 0):
        raise ValueError(f"t: expected a finite number > 0 (or None to derive it from alpha), got {t!r}")
    if rule not in RULES:
        raise ValueError(f"rule: expected one of {RULES}, got {rule!r}. Fix: pass rule={dec.DEFAULT_RULE!r}")


def _check_one_device(network: nn.Module) -> None:
    """The probe runs the network where its parameters are: a network split across devices
    has no such place (the probe would fail mid-pass with a bare device-mismatch error)."""
    devices: dict[str, str] = {}  # device → the first parameter/buffer found there
    for name, t in list(network.named_parameters()) + list(network.named_buffers()):
        devices.setdefault(str(t.device), name)
    if len(devices) > 1:
        found = ", ".join(f"{d} (e.g. {name})" for d, name in devices.items())
        raise ValueError(
            f"network: its parameters and buffers are on {len(devices)} devices: {found}; the probe needs the "
            "whole network on one device. Move it with network.to(device) first."
        )


def measure_saturation(
    network: nn.Module,
    probe_loader: Iterable,
    loss_fn: Callable[[Any, Any], torch.Tensor],
    *,
    delta: float = 0.0,
    alpha: float = 0.05,
    t: float | None = None,
    projected: bool = True,
    rule: str = "paper",
    tau: float = dec.DEFAULT_TAU,
    candidates: Mapping[str, nn.Module] | None = None,
    seed: int | None = 0,
    calibrate: bool = True,
    autocast_dtype: torch.dtype | None = None,
    sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    select: str = "grad_norm",
    crossfit_bound: str = "normal",
    probe_size: int | None = None,
    sample_losses: list | None = None,
) -> SaturationReport:
    """Score every candidate site of ``network`` on an independent probe sample.

    Args:
        network: a growable network (``sites()``, ``stage()``, ``new_block()``).
        probe_loader: yields ``(input, target)``; must be independent of the training data.
        loss_fn: ``loss_fn(output, target)`` → mean loss of the batch.
        delta: practical-saturation margin ``δ ≥ 0``.
        alpha: target error probability; ``t = sqrt(Σσ̂²/(nα))`` unless ``t`` is given.
        t: the separation ``t > 0`` of Proposition 1 (overrides ``alpha``).
        projected: also compute ``V_S`` (costs Gram matrices; the decision does not need it).
        rule: ``"paper"`` (Proposition 1), ``"crossfit"`` (cross-fit lower bound > δ, see
            ``growtrain.crossfit``) or ``"relative"`` (lower bound > max(δ, τ·R), ``R`` the existing
            blocks' RMS gradient norm; see ``growtrain.decision``). The default stays the paper's
            rule here, the function that measures the paper's quantities; the decision entry points
            (``GrowUntilSaturated``, ``growtrain measure``) default to ``"crossfit"``. Every rule
            this pass can compute is reported in ``report.verdicts``.
        tau: ``rule="relative"`` only: the relative threshold ``τ > 0``.
        candidates: site name → candidate block (``V = 0``); fresh ones from ``seed`` if None.
        calibrate: set the candidates' BatchNorm statistics on the probe inputs first.
        autocast_dtype: e.g. ``torch.bfloat16`` to run the network under autocast.
        sync_fn: sums a tensor over ranks (DDP); every rank then reaches the same decision.
        select: rank sites by ``"grad_norm"`` (the paper's Γ̂) or ``"projected"`` (paper rule;
            the cross-fit rule picks the site with the largest lower bound).
        crossfit_bound: ``rule="crossfit"`` only: ``"normal"`` (CLT) or ``"cantelli"``
            (distribution-free up to the variance estimate) lower bound.
        probe_size: ``rule="crossfit"`` only: the number of probe samples on this rank, for a
            loader without a sized sampler or dataset (the split needs it before the pass).
        sample_losses: a list that receives, per probe batch in loader order, each sample's term
            of the loss (float64, on the network's device) of the network as it is — the ghosts output zero — from the
            pass's own forward (``GrowUntilSaturated``'s ``min_gain`` reads it: no extra pass).
    """
    _check_arguments(network, delta, alpha, t, rule)
    _check_one_device(network)
    if rule == "relative":
        tau = dec.check_tau(tau)
    if select not in ("grad_norm", "projected"):
        raise ValueError(f"select: expected 'grad_norm' or 'projected', got {select!r}")
    if select == "projected" and not projected:
        raise ValueError("select: 'projected' ranking needs projected=True")
    sites = network.sites()
    if candidates is None:
        candidates = candidate_blocks(network, seed)
    missing = [s.name for s in sites if s.name not in candidates]
    if missing:
        raise ValueError(f"candidates: no candidate block for sites {missing}")
    for s in sites:
        block = candidates[s.name]
        if any(bool(torch.any(p.detach() != 0)) for p in terminal_parameters(block)):
            raise ValueError(f"candidates: the block for {s.name} is not zero-output (terminal map ≠ 0)")
        block.eval()

    crossfit = None
    if rule in ("crossfit", "relative"):
        from growtrain.crossfit import CrossFitState

        crossfit = CrossFitState.for_loader(
            probe_loader, len(sites), sync_fn=sync_fn, n=probe_size, bound=crossfit_bound, alpha=alpha
        )

    device = network.neighbour_tensor(sites[0]).device
    modes = _save_modes(network)
    with torch.inference_mode(False), torch.enable_grad():
        if calibrate:
            # crossfit: calibrate on half A only, so that B stays fresh data given A
            calibration = probe_loader if crossfit is None else crossfit.first_half(probe_loader)
            calibrate_candidates(network, candidates, calibration, autocast_dtype=autocast_dtype, sync_fn=sync_fn)
        network.eval()
        try:
            with _frozen(network):
                reference = _ReferenceAccumulator(network, sites) if rule == "relative" else None
                accs, n, batches = _probe_pass(
                    network, sites, candidates, probe_loader, loss_fn, device, projected, autocast_dtype, crossfit,
                    reference, sample_losses,
                )
        finally:
            _restore_modes(modes)

    if sync_fn is not None:
        n, batches = _all_reduce(accs, n, batches, sync_fn, device, reference)
    if n < 2:
        raise ValueError(f"probe_loader: the probe sample has {n} sample(s); at least 2 are needed for σ̂²")
    return _report(sites, accs, n, batches, delta, alpha, t, rule, select, crossfit, reference, tau)


def _probe_pass(network, sites, candidates, loader, loss_fn, device, projected, autocast_dtype, crossfit, reference,
                sample_losses=None):  # fmt: skip
    """Stream the probe batches; per batch one forward and one backward score every site.

    The forward keeps only a reference to each site's activation ``z`` (autograd saves it for
    the next block anyway); the features ``φ(z)`` are computed in a gradient hook on ``z``,
    the moment ``q`` arrives, and dropped after the site's sums are updated — so no site's
    features wait in memory for the whole backward pass.
    """
    accs = [_SiteAccumulator(candidates[s.name], projected) for s in sites]
    activations: list = [None] * len(sites)
    scored = [False] * len(sites)
    batch = {"index": 0, "size": 0, "offset": 0}

    def score(j: int, z: torch.Tensor, grad: torch.Tensor) -> None:
        with torch.no_grad():
            grad = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
            if not torch.isfinite(grad).all():
                raise FloatingPointError(
                    f"probe batch {batch['index']}: non-finite activation gradient at site {sites[j].name}; "
                    "no decision was made"
                )
            with _autocast(device, autocast_dtype):
                feats = accs[j].features(z.detach())
            q = grad * batch["size"]  # per-sample activation gradients (the loss is a batch mean)
            xi = accs[j].update(feats, q, grad)
            if crossfit is not None:
                crossfit.update(j, xi, batch["offset"])
        scored[j] = True

    def capture(j, z):
        replaced = None
        if not z.requires_grad:  # parameters are frozen: the graph starts at the first site
            z = replaced = z.detach().requires_grad_(True)
        # The hook must not capture ``z`` itself: a hook on ``z`` that references ``z`` is a cycle
        # through autograd that Python's collector cannot see, and it kept every probe pass's
        # activations alive (~200 MB per call at width 16). A detached alias shares the storage
        # without holding the graph.
        alias = z.detach()
        z.register_hook(lambda grad, j=j, alias=alias: score(j, alias, grad))
        activations[j] = z
        return replaced

    n = batches = 0
    if reference is not None:  # half A in independent pieces (for the reference), cut at the A/B boundary
        loader = _pieces(map(_split_batch, loader), crossfit.n_a, reference.MIN_PIECES)
    with _site_hooks(network, sites, capture):
        for b, (x, y) in enumerate(map(_split_batch, loader)):
            x, y = _to_device(x, device), _to_device(y, device)
            in_a = reference is not None and n < crossfit.n_a  # pieces never straddle A and B
            if in_a:
                reference.track(True)
            with _autocast(device, autocast_dtype):
                out = network(x)
                loss = loss_fn(out, y)
                if sample_losses is not None:
                    sample_losses.append(sample_loss_terms(out, y, loss_fn))  # stays on the device
            if loss.dim() != 0:
                raise ValueError(f"loss_fn: expected a scalar mean loss, got shape {tuple(loss.shape)}")
            if not torch.isfinite(loss):
                raise FloatingPointError(f"probe batch {b}: the loss is {loss.item()}; no decision was made")
            batch.update(index=b, size=_batch_size(y), offset=n)
            scored[:] = [False] * len(sites)
            if in_a:
                grads = torch.autograd.grad(loss, activations + reference.params, allow_unused=True)
                reference.update(grads[len(activations):], batch["size"])
                reference.track(False)
            else:
                torch.autograd.grad(loss, activations, allow_unused=True)  # the hooks do the scoring
            for j in range(len(sites)):
                if not scored[j]:  # the loss does not depend on this site: its gradient is zero
                    score(j, activations[j], torch.zeros_like(activations[j]))
            activations[:] = [None] * len(sites)
            n += batch["size"]
            batches += 1
    if n == 0:
        raise ValueError("probe_loader: it yielded no batches; pass a non-empty probe sample")
    return accs, n, batches


def _all_reduce(accs, n, batches, sync_fn, device, reference=None):
    if reference is not None:
        reference.all_reduce(sync_fn, device)
    tensors = [t for a in accs for t in a.tensors()]
    counts = torch.tensor([n, batches], dtype=torch.float64, device=device)
    flat = torch.cat([torch.as_tensor(t, dtype=torch.float64, device=device).flatten() for t in tensors] + [counts])
    flat = sync_fn(flat).cpu()
    start = 0
    for a in accs:
        new = []
        for t in a.tensors():
            new.append(flat[start : start + t.numel()].reshape(t.shape))
            start += t.numel()
        a.load(new)
    return int(flat[start].item()), int(flat[start + 1].item())


def _report(sites, accs, n, batches, delta, alpha, t, rule, select, crossfit, reference, tau) -> SaturationReport:
    """Per-site records, every verdict this pass can compute, and the one ``rule`` makes."""
    records = []
    for site, acc in zip(sites, accs):
        grad = acc.sum_xi.cpu() / n
        grad_norm = float(grad.norm())
        variance = pm.sample_variance(float(acc.sum_sq), float(acc.sum_xi.pow(2).sum()), n)
        records.append(
            SiteRecord(
                site=site,
                block=acc.block,
                grad_norm=grad_norm,
                variance=variance,
                ag=math.sqrt(float(acc.sum_q_sq) / n),
                ag_batch=float(acc.sum_batch_norm) / batches,
                projected=acc.projected_value(n),
                grad=acc.split(grad),
            )
        )
    gamma = max(r.grad_norm for r in records)
    total_variance = sum(r.variance for r in records)
    if t is None:
        t = pm.chebyshev_t(total_variance, n, alpha)
    key = (lambda r: r.projected) if select == "projected" else (lambda r: r.grad_norm)
    verdicts = {"paper": dec.paper_verdict(gamma, max(records, key=key).name, delta, t)}
    extra: dict = {}
    ref_value = None
    if crossfit is not None:
        lowers, info = crossfit.lower_bounds(alpha)
        if info["n_a"] + info["n_b"] != n:
            raise RuntimeError(f"crossfit: it saw {info['n_a'] + info['n_b']} probe samples, the report counts {n}")
        for record, lower in zip(records, lowers):
            record.lower = lower
        names = [r.name for r in records]
        verdicts["crossfit"] = dec.crossfit_verdict(lowers, names, delta, info["level"])
        best = max(range(len(lowers)), key=lambda j: lowers[j])
        extra = {
            "level": info["level"], "bound_kind": info["bound_kind"], "n_a": info["n_a"], "n_b": info["n_b"],
            "max_lower": lowers[best], "lower_site": names[best],
            "paper_decision": "saturated" if verdicts["paper"].saturated else "grow",
        }  # fmt: skip
        if reference is not None:
            ref_value, per_block = reference.value()
            verdicts["relative"] = dec.relative_verdict(lowers, names, ref_value, tau, delta, info["level"])
            extra.update(reference_blocks=len(per_block), reference_pieces=reference.pieces)
        split = f" ({info['bound_kind']} bound, level α/K={info['level']:.3g}, |A|={info['n_a']}, |B|={info['n_b']})"
    chosen = verdicts[rule]
    reason = chosen.reason if rule == "paper" else chosen.reason + split
    return SaturationReport(
        sites=records,
        gamma=gamma,
        t=t,
        threshold=delta + t,
        delta=delta,
        alpha=alpha,
        n=n,
        saturated=chosen.saturated,
        best_site=chosen.site,
        error_bound=pm.chebyshev_bound(total_variance, n, t),
        rule=rule,
        reason=reason,
        extra=extra,
        margin=chosen.margin,
        reference=ref_value,
        tau=tau if rule == "relative" else None,
        verdicts=verdicts,
    )


# -- the relative rule's reference: existing blocks' terminal-map gradients on half A ----------
class _ReferenceAccumulator:
    """Streamed sums for ``decision.debiased_reference`` over the existing blocks of ``network``.

    During half ``A`` of the probe the existing blocks' terminal parameters require grad, so the
    same backward that scores the ghosts also yields each block's gradient of the piece's loss
    (``S_{b,k}`` = piece size × the gradient of the mean loss). Only sums are kept, so ranks
    all-reduce them like the site sums. Half ``B`` runs with every parameter frozen, as before.
    """

    MIN_PIECES = 4  # half A is cut into at least this many independent pieces

    def __init__(self, network: nn.Module, sites: list[Site]):
        stages = list(dict.fromkeys(s.stage for s in sites))
        blocks = [b for name in stages for b in network.stage(name) if hasattr(b, "terminal_parameters")]
        if not blocks:
            raise ValueError(
                "rule: 'relative' compares a new block with the network's existing blocks, but no block in the "
                f"growable stages {stages} has terminal_parameters(). Fix: give your blocks terminal_parameters() "
                "(growtrain.GrowableStack does), or pass rule='crossfit' with an absolute delta."
            )
        self.blocks = [list(terminal_parameters(b)) for b in blocks]
        self.params = [p for ps in self.blocks for p in ps]
        self.sum_grad: list[torch.Tensor | None] = [None] * len(blocks)  # Σ_k S_{b,k} (float64, flat)
        self.sum_sq: list[torch.Tensor | float] = [0.0] * len(blocks)  # Σ_k ‖S_{b,k}‖²
        self.n = 0  # Σ_k n_k
        self.sum_n_sq = 0  # Σ_k n_k²
        self.pieces = 0

    def track(self, on: bool) -> None:
        for p in self.params:
            p.requires_grad_(on)

    def update(self, grads: Sequence[torch.Tensor | None], size: int) -> None:
        it = iter(zip(self.params, grads))
        for b, ps in enumerate(self.blocks):
            flat = []
            for p, g in (next(it) for _ in ps):  # a parameter the loss does not reach has gradient 0
                flat.append((torch.zeros_like(p) if g is None else g).detach().flatten().double())
            piece = torch.cat(flat) * size  # (p_b,)
            self.sum_grad[b] = piece if self.sum_grad[b] is None else self.sum_grad[b] + piece
            self.sum_sq[b] = self.sum_sq[b] + piece.pow(2).sum()
        self.n += size
        self.sum_n_sq += size * size
        self.pieces += 1

    def all_reduce(self, sync_fn: Callable[[torch.Tensor], torch.Tensor], device: torch.device) -> None:
        sizes = [g.numel() for g in self.sum_grad]
        counts = torch.tensor([self.n, self.sum_n_sq, self.pieces], dtype=torch.float64, device=device)
        sq = torch.stack([torch.as_tensor(q, dtype=torch.float64, device=device) for q in self.sum_sq])
        flat = sync_fn(torch.cat([g.to(device) for g in self.sum_grad] + [sq, counts]))
        parts = list(flat.split(sizes + [len(sizes), 3]))
        self.sum_grad = parts[: len(sizes)]
        self.sum_sq = list(parts[len(sizes)])
        self.n, self.sum_n_sq, self.pieces = (int(v) for v in parts[-1].tolist())

    def value(self) -> tuple[float, list[float]]:
        if self.pieces < 2 or any(g is None for g in self.sum_grad):
            raise ValueError(
                f"probe_loader: rule='relative' needs half A of the probe in at least 2 pieces; got {self.pieces}. "
                "Fix: use a probe of at least 8 samples."
            )
        return dec.debiased_reference(self.sum_grad, [float(q) for q in self.sum_sq], self.n, self.sum_n_sq)


def _pieces(batches: Iterable, n_a: int, min_pieces: int):
    """Re-cut ``(input, target)`` batches so that half A (the first ``n_a`` samples) comes in
    pieces of at most ``⌈n_a/min_pieces⌉`` samples and no piece straddles A and B. In eval mode
    samples are independent, so cutting changes no per-sample quantity (only ``ag_batch``, the
    per-batch Eq. 2 figure, sees smaller batches in A)."""
    piece = max(1, math.ceil(n_a / min_pieces))
    seen = 0
    for x, y in batches:
        size, start = _batch_size(y), 0
        while start < size:
            stop = min(size, start + piece, start + n_a - seen) if seen < n_a else size
            yield _slice(x, start, stop), _slice(y, start, stop)
            seen += stop - start
            start = stop
