"""The saturation certificate: one joint probe pass that scores every candidate site.

``measure_saturation(network, probe_loader, loss_fn)`` puts a zero-output *candidate* block
(a ghost) at every site of ``network.sites()`` at once. Because every ghost has ``V = 0`` the
network's function is unchanged and the joint gradient is the concatenation of the per-site
gradients (the paper's Corollary 2), so one forward+backward per probe batch scores all sites.
A ghost never runs ``V``: the probe keeps its features ``φ(z)`` from the forward pass and the
activation gradient ``q`` at the site from the backward pass, and forms ``ξ = J(z)ᵀ q``
directly (docs/design.md §2, "The probe pass") — or, in the cross-fit check without σ̂², only
their batch sums and directional derivatives ``ξ_i · u`` (``growtrain.probe_pass``).

Modules: the pass and its per-site sums in ``growtrain.probe_pass``, the ghosts and their
BatchNorm calibration in ``growtrain.ghosts``, the report in ``growtrain.saturation_report``;
this module checks the arguments and runs them in order.

Per site it reports ``grad_norm = ‖ĝ‖₂``, ``variance = σ̂²``, ``ag`` (Remark 1), ``ag_batch``
(Eq. 2) and ``projected = V_S = sqrt(ĝᵀ Ĝ† ĝ)`` (Lemma 4); the decision is Proposition 1's
``saturated ⇔ Γ̂_n ≤ δ + t``.

Conventions: ``loss_fn(output, target)`` returns the *mean* loss over the batch's samples
(for language models, a sample is a sequence), so the per-sample activation gradient is the
batch size times the gradient of the batch loss. The probe runs in eval mode, so samples are
independent (BatchNorm uses running statistics; only the ghosts' own BatchNorms use batch
statistics on half A of a cross-fit check, while they are calibrated). No Lightning import here.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Iterable, Mapping

import torch
from torch import nn

from growtrain import decision as dec
from growtrain.ghosts import calibrate_candidates, candidate_blocks, cumulative_statistics, frozen, restore_modes, save_modes
from growtrain.growable import terminal_parameters
from growtrain.probe_pass import all_reduce, probe_pass
from growtrain.saturation_report import SaturationReport, SiteRecord, build_report

__all__ = ["measure_saturation", "SaturationReport", "SiteRecord", "candidate_blocks", "calibrate_candidates"]


# -- arguments ---------------------------------------------------------------------------------
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
    if rule not in dec.RULES:
        raise ValueError(f"rule: expected one of {dec.RULES}, got {rule!r}. Fix: pass rule={dec.DEFAULT_RULE!r}")


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
    candidates: Mapping[str, nn.Module] | None = None,
    seed: int | None = 0,
    calibrate: bool = True,
    autocast_dtype: torch.dtype | None = None,
    sync_fn: Callable[[torch.Tensor], torch.Tensor] | None = None,
    probe_size: int | None = None,
    sample_losses: list | None = None,
    variance: bool | None = None,
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
        rule: ``"paper"`` (Proposition 1) or ``"crossfit"`` (cross-fit lower bound > δ, see
            ``growtrain.crossfit``). The default stays the paper's rule here, the function that
            measures the paper's quantities; the decision entry points (``GrowUntilSaturated``,
            ``growtrain measure``) default to ``"crossfit"``. Every rule this pass can compute is
            reported in ``report.verdicts``.
        candidates: site name → candidate block (``V = 0``); fresh ones from ``seed`` if None.
        calibrate: set the candidates' BatchNorm statistics on the probe inputs: under the
            paper's rule in a forward pass over the whole probe first; under the cross-fit rule
            on half A *within* the probe pass (no pass of its own: on A a ghost's features use
            batch statistics, which it accumulates; B is scored with A's statistics, so given A
            the scored ghost and ``u`` are fixed and B is fresh data, as the bound needs).
        autocast_dtype: e.g. ``torch.bfloat16`` to run the network under autocast.
        sync_fn: sums a tensor over ranks (DDP); every rank then reaches the same decision.
        probe_size: ``rule="crossfit"`` only: the number of probe samples on this rank, for a
            loader without a sized sampler or dataset (the split needs it before the pass).
        sample_losses: a list that receives, per probe batch in loader order, each sample's term
            of the loss (float64, on the network's device) of the network as it is — the ghosts output zero — from the
            pass's own forward (no extra pass; bench/probe.py times it).
        variance: compute ``σ̂²`` per site (``Σ‖ξ_i‖²`` needs every per-sample gradient), and
            with it the paper rule's ``t``, threshold, error bound and verdict. Default: only
            under ``rule="paper"``, which decides by it. Without it, conv and linear terminal
            maps never form per-sample gradients (``ĝ`` is a batched weight gradient, the
            cross-fit scalars directional derivatives), and ``variance``, ``t``, the
            threshold and the error bound are None.
    """
    _check_arguments(network, delta, alpha, t, rule)
    _check_one_device(network)
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

    if variance is None:
        variance = rule == "paper"
    elif rule == "paper" and not variance:
        raise ValueError("variance: the paper's rule decides by σ̂² (its t); pass variance=True or rule='crossfit'")
    crossfit = None
    if rule == "crossfit":
        from growtrain.crossfit import CrossFitState

        crossfit = CrossFitState.for_loader(probe_loader, len(sites), sync_fn=sync_fn, n=probe_size, alpha=alpha)

    device = network.neighbour_tensor(sites[0]).device
    modes = save_modes(network)
    with torch.inference_mode(False), torch.enable_grad():
        # the cross-fit rule: calibrate on half A only (B stays fresh data given A), folded into the pass
        fold = calibrate and crossfit is not None
        if calibrate and not fold:
            calibrate_candidates(network, candidates, probe_loader, autocast_dtype=autocast_dtype, sync_fn=sync_fn)
        network.eval()
        try:
            with frozen(network), cumulative_statistics([candidates[s.name] for s in sites] if fold else []):
                accs, n, batches = probe_pass(
                    network, sites, candidates, probe_loader, loss_fn, device, projected, autocast_dtype, crossfit,
                    sample_losses, variance, fold, sync_fn,
                )
        finally:
            restore_modes(modes)

    if sync_fn is not None:
        n, batches = all_reduce(accs, n, batches, sync_fn, device)
    if n < 2:
        raise ValueError(f"probe_loader: the probe sample has {n} sample(s); at least 2 are needed for σ̂²")
    return build_report(sites, accs, n, batches, delta, alpha, t, rule, crossfit, variance)
