"""The joint probe pass: one forward and one backward per probe batch score every site.

Per site it streams float64 sums of the ghost's cross-gradients ``ξ_i = J_iᵀ q_i`` (see
``growtrain.saturation`` for what they mean); the cross-fit state and the per-sample losses
ride on the same pass. No Lightning import here.
"""

from __future__ import annotations

import threading

import torch
from torch import nn

from growtrain import probe_math as pm
from growtrain.batches import batch_size as _batch_size
from growtrain.batches import sample_loss_terms
from growtrain.batches import to_device as _to_device
from growtrain.families.base import ChannelAffineFeatures, DenseFeatures
from growtrain.ghosts import autocast as _autocast
from growtrain.ghosts import batch_norms, batch_statistics, sync_batch_norms
from growtrain.ghosts import site_hooks as _site_hooks
from growtrain.ghosts import split_batch as _split_batch
from growtrain.growable import terminal_parameters

# The probe's loss scale under float16 autocast (a power of two: dividing back is exact). Activation
# gradients of a batch-mean loss are small (about 1/B each) and underflow float16 below 6e-8; 2^10 lifts
# them while a gradient would have to exceed 64 to overflow (65504 / 2^10). bfloat16 has float32's
# exponent range: no scale.
FP16_LOSS_SCALE = 2.0**10


# -- per-site accumulation -----------------------------------------------------------------
class SiteAccumulator:
    """Streamed float64 sums for one site; every field is a sum, so ranks all-reduce them.

    Two ways to the same sums. With ``variance`` (σ̂² needs ``Σ‖ξ_i‖²``) the per-sample ``ξ_i``
    are formed. Otherwise a position-wise linear terminal map (conv or linear:
    ``DenseFeatures``) never forms them: ``Σ_i ξ_i`` is one batched weight gradient and the
    cross-fit scalars ``ξ_i · u`` are directional derivatives, one forward of the terminal map
    with ``u`` as its weight contracted with ``q_i``; a block without a feature form uses one
    VJP and one JVP (unless ``projected``: V_S needs its per-sample Jacobians). Per-sample
    gradients of a conv are ``B`` kernels per batch; forming them cost more than the rest of
    the probe (docs/design.md §2). The ``basic`` family's (2 numbers per channel) are formed:
    cheaper than any alternative.

    ``calibrating``: the ghost's BatchNorm statistics are set during this pass (the cross-fit
    rule's folded calibration, ``growtrain.ghosts``): on half A the ghost runs in train mode
    (batch statistics, accumulated into its running statistics), from the A/B boundary on in
    eval mode with the statistics of A.
    """

    def __init__(self, block: nn.Module, projected: bool, variance: bool = True, calibrating: bool = False):
        self.block = block
        self.projected = projected
        self.variance = variance
        self.bns = batch_norms(block)
        self.calibrating = calibrating and bool(self.bns)
        self.fast = hasattr(block, "probe_features")
        self.sum_xi: torch.Tensor | None = None  # Σ ξ_i
        # Scalar sums start as Python floats' tensors on the first update's device (CUDA or CPU):
        # a CPU accumulator added to CUDA norms crashed the first check on a GPU.
        self.sum_sq: torch.Tensor | float = 0.0  # Σ ‖ξ_i‖² (only with variance)
        self.sum_q_sq: torch.Tensor | float = 0.0  # Σ ‖q_i‖²
        self.sum_batch_norm: torch.Tensor | float = 0.0  # Σ_b ‖∇_H L_b‖
        self.gram: torch.Tensor | None = None  # Σ J_iᵀ J_i in the kind's compact form
        self.kind = None
        self.per_sample_formed = False  # did any batch form per-sample ξ_i (tests read it)

    def features(self, z: torch.Tensor, train: bool = False):
        """What the forward pass keeps for this site (no graph).

        ``train`` (half A of a folded calibration): the ghost's BatchNorms accumulate this
        part's statistics. A block whose feature form runs its BatchNorms
        (``probe_features_calibrates = True``: preact, basic) does it in the same computation,
        and its features use the batch statistics; any other block runs once in train mode
        first, and its features use the statistics accumulated so far.
        """
        # A part of one sample (a batch cut at the A/B boundary)
        # has no batch statistics to give where a BatchNorm sees one value per channel: it is
        # scored with the statistics so far and adds none.
        if not (train and self.bns) or z.shape[0] < 2:
            return self.block.probe_features(z) if self.fast else z
        if self.fast and getattr(self.block, "probe_features_calibrates", False):
            with batch_statistics(self.bns):
                return self.block.probe_features(z)
        with batch_statistics(self.bns):
            self.block(z)
        return self.block.probe_features(z) if self.fast else z

    def part(self, feats, grad: torch.Tensor, scale: float):
        """``(Σ_i ξ_i, scalars)`` over the samples of ``feats``, with ``q = scale · grad``: the sum
        in the kind's shape, and ``scalars(u)`` → per-sample ``ξ_i · u`` (``u`` flat, float64).
        Both are linear in ``q``, so the dense path scales its small results, not ``grad``."""
        if isinstance(feats, DenseFeatures) and not self.variance:
            total, scalars = self._dense_part(feats, grad)
            return total * scale, lambda u: scalars(u) * scale
        if not self.fast and not (self.variance or self.projected):
            self.kind = "generic"
            total, scalars = _generic_part(self.block, feats, grad)
            return total * scale, lambda u: scalars(u) * scale
        xi = self.per_sample(feats, grad * scale)
        self.per_sample_formed = True
        if self.variance:
            # Σ_i ‖ξ_i‖² is the squared norm of the whole (B, …) tensor: no per-sample temporaries.
            self.sum_sq = self.sum_sq + torch.linalg.vector_norm(xi).double().pow(2)
        return xi.sum(0), lambda u: xi.flatten(1) @ u.to(xi.dtype)

    def _dense_part(self, feats: DenseFeatures, q: torch.Tensor):
        """``DenseFeatures`` without per-sample gradients (see the class docstring)."""
        self.kind = "dense"
        if feats.conv is not None:
            kernel, dilation, padding, stride = feats.conv
            phi = feats.phi.to(q.dtype)  # (B, C, H, W)
            if self.projected:
                self._add_gram(_conv_gram(feats, q.dtype))
            n_out, c_in = q.shape[1], phi.shape[1]
            shape = (n_out, c_in, *kernel)
            total = torch.nn.grad.conv2d_weight(phi, shape, q, stride, padding, dilation).reshape(n_out, -1)
            if feats.bias:
                total = torch.cat([total, q.sum((0, 2, 3)).unsqueeze(-1)], dim=-1)

            def scalars(u):
                u = u.to(q.dtype).reshape(n_out, -1)
                weight = u[:, : c_in * kernel[0] * kernel[1]].reshape(shape)
                out = torch.nn.functional.conv2d(phi, weight, None, stride, padding, dilation)  # (B, N, H', W')
                s = (out * q).sum((1, 2, 3))
                return s + q.sum((2, 3)) @ u[:, -1] if feats.bias else s

            return total, scalars
        patches = feats.patches().to(q.dtype)  # (B, P, K)
        qq = q.unsqueeze(1) if q.dim() == 2 else q  # (B, P, N)
        if self.projected:
            self._add_gram(pm.dense_gram(patches))
        total = qq.reshape(-1, qq.shape[-1]).T @ patches.reshape(-1, patches.shape[-1])  # (N, K)

        def scalars(u):
            u = u.to(q.dtype).reshape(total.shape)
            return ((patches @ u.T) * qq).sum((1, 2))

        return total, scalars

    def per_sample(self, feats, q: torch.Tensor) -> torch.Tensor:
        """Per-sample cross-gradients ``ξ_i``, and the Gram increment when asked."""
        if isinstance(feats, DenseFeatures):
            self.kind = "dense"
            if feats.simple_conv:
                phi = feats.phi.to(q.dtype)
                if self.projected:
                    self._add_gram(_conv_gram(feats, q.dtype))
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

    def update(self, z: torch.Tensor, grad: torch.Tensor, scale: float, grad_norm: torch.Tensor, autocast,
               crossfit=None, j: int = 0, offset: int = 0, sync_fn=None) -> None:  # fmt: skip
        """One batch: activations ``z`` and the batch loss's gradient ``grad`` at the site, whose
        per-sample activation gradients are ``q = scale · grad``; ``grad_norm = ‖grad‖``.

        With ``crossfit`` the batch is cut at the A/B boundary: the part in ``A`` adds to
        ``Σ_A ξ`` (and, when calibrating, to the ghost's statistics), the part in ``B`` gives
        the scalars ``ξ_i · u``, once ``A`` is complete.
        """
        size = grad.shape[0]
        k = size if crossfit is None else crossfit.a_count(offset, size)
        total = None
        sum_a = None
        if k > 0:
            with autocast():
                feats = self.features(z[:k] if k < size else z, train=self.calibrating)
            sum_a, _ = self.part(feats, grad[:k] if k < size else grad, scale)
            total = sum_a
        if crossfit is not None:
            if crossfit.advance(j, offset, size, sum_a if k > 0 else None) and self.calibrating:
                self.end_calibration(sync_fn)
            if k < size:
                with autocast():
                    feats = self.features(z[k:] if k > 0 else z)
                sum_b, scalars = self.part(feats, grad[k:] if k > 0 else grad, scale)
                total = sum_b if total is None else total + sum_b
                u = crossfit.direction(j)
                if u is not None:
                    crossfit.add_scalars(j, scalars(u))
        s = total.double()
        self.sum_xi = s if self.sum_xi is None else self.sum_xi + s
        norm = grad_norm.double()
        self.sum_q_sq = self.sum_q_sq + (norm * scale).pow(2)
        self.sum_batch_norm = self.sum_batch_norm + norm

    def end_calibration(self, sync_fn=None) -> None:
        """Half A is done: the ghost's BatchNorm statistics are final (averaged over ranks with
        ``sync_fn``, in site order on every rank, right after the site's ``u``)."""
        self.calibrating = False
        if sync_fn is not None:
            sync_batch_norms(self.bns, sync_fn)

    def tensors(self) -> list[torch.Tensor]:
        out = [self.sum_xi, torch.as_tensor(self.sum_sq), self.sum_q_sq, self.sum_batch_norm]
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


def _conv_gram(feats: DenseFeatures, dtype: torch.dtype) -> torch.Tensor:
    """``Σ_i Σ_pos φ φᵀ`` of a conv's patches: without forming them for a stride-1 "same" conv
    (``probe_math.conv_gram``, measured 2–5× faster at width 16), else from the patches."""
    kernel, dilation, padding, stride = feats.conv
    same = all(k == 2 * p + 1 for k, p in zip(kernel, padding)) if isinstance(padding, tuple) else False
    if feats.simple_conv and same:
        return pm.conv_gram(feats.phi.to(dtype), kernel, padding, bias=feats.bias)
    return pm.dense_gram(feats.patches().to(dtype))


GENERIC_GRAM_LIMIT = 4096


def _functional(block: nn.Module):
    """``(out_fn, values)``: the block's output as a function of its terminal parameters."""
    from torch.func import functional_call

    terminal = terminal_parameters(block)
    ids = {id(p) for p in terminal}
    names = {id(p): name for name, p in block.named_parameters()}
    t_names = [names[id(p)] for p in terminal]
    fixed = {name: p.detach() for name, p in block.named_parameters() if id(p) not in ids}
    fixed.update(dict(block.named_buffers()))

    def out_fn(values, z):
        return functional_call(block, {**fixed, **dict(zip(t_names, values))}, (z,))

    return out_fn, tuple(p.detach() for p in terminal)


_FORWARD_AD_LOCK = threading.Lock()


def _generic_part(block: nn.Module, z: torch.Tensor, grad: torch.Tensor):
    """A block without a feature form, without per-sample gradients: ``Σ_i ξ_i`` is one VJP of
    the batch's output with ``grad``, and ``ξ_i · u`` one forward-mode JVP along ``u``
    contracted with ``grad_i`` (the block runs in eval mode, so samples stay independent)."""
    from torch.func import jvp, vjp

    out_fn, values = _functional(block)
    _, pullback = vjp(lambda v: out_fn(v, z), values)
    total = torch.cat([g.flatten() for g in pullback(grad)[0]])

    def scalars(u: torch.Tensor) -> torch.Tensor:
        u = u.to(grad.dtype)
        tangents, start = [], 0
        for v in values:
            tangents.append(u[start : start + v.numel()].reshape(v.shape))
            start += v.numel()
        # forward-AD levels are process-global in torch: two threads (e.g. ranks emulated by
        # threads) entering jvp at once corrupt each other's level, so one jvp at a time
        with _FORWARD_AD_LOCK:
            _, tangent = jvp(lambda v: out_fn(v, z), (values,), (tuple(tangents),))
        return (tangent * grad).flatten(1).sum(1)

    return total, scalars


def _generic_per_sample(block: nn.Module, z: torch.Tensor, q: torch.Tensor, with_jacobian: bool):
    """Per-sample ``ξ_i = J_iᵀ q_i`` of a block without a feature form, by ``torch.func``.

    Returns ``(ξ: (B, p), J: (B, out, p) or None)``.
    """
    from torch.func import jacrev, vjp, vmap

    batch_fn, t_values = _functional(block)

    def out_fn(values, z_i):  # one sample: the block's output as a function of its terminal map
        return batch_fn(values, z_i.unsqueeze(0)).squeeze(0)

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


def probe_pass(network, sites, candidates, loader, loss_fn, device, projected, autocast_dtype, crossfit,
               sample_losses=None, variance=True, calibrating=False, sync_fn=None):  # fmt: skip
    """Stream the probe batches; per batch one forward and one backward score every site.

    The forward keeps only a reference to each site's activation ``z`` (autograd saves it for
    the next block anyway); the features ``φ(z)`` are computed in a gradient hook on ``z``,
    the moment ``q`` arrives, and dropped after the site's sums are updated — so no site's
    features wait in memory for the whole backward pass.

    ``calibrating`` (the cross-fit rule only): the ghosts' BatchNorm statistics are set on half A
    in this pass (``SiteAccumulator``), not in a pass of their own.
    """
    accs = [SiteAccumulator(candidates[s.name], projected, variance, calibrating) for s in sites]
    # float16 autocast: the backward runs on loss × FP16_LOSS_SCALE and every gradient is divided back,
    # as a 16-mixed training step's GradScaler does (small activation gradients underflow float16)
    scale = FP16_LOSS_SCALE if autocast_dtype == torch.float16 else 1.0
    activations: list = [None] * len(sites)
    scored = [False] * len(sites)
    batch = {"index": 0, "size": 0, "offset": 0}

    def score(j: int, z: torch.Tensor, grad: torch.Tensor) -> None:
        with torch.no_grad():
            grad = grad.float() if grad.dtype in (torch.float16, torch.bfloat16) else grad
            if scale != 1.0:
                grad = grad / scale
            norm = torch.linalg.vector_norm(grad)  # one reduction: the finiteness check and AG's sums
            if not torch.isfinite(norm):
                raise FloatingPointError(
                    f"probe batch {batch['index']}: non-finite activation gradient at site {sites[j].name}; "
                    "no decision was made"
                )
            # per-sample activation gradients are q = size · grad (the loss is a batch mean)
            accs[j].update(z.detach(), grad, batch["size"], norm, lambda: _autocast(device, autocast_dtype),
                           crossfit, j, batch["offset"], sync_fn)  # fmt: skip
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
    with _site_hooks(network, sites, capture):
        for b, (x, y) in enumerate(map(_split_batch, loader)):
            x, y = _to_device(x, device), _to_device(y, device)
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
            torch.autograd.grad(loss * scale, activations, allow_unused=True)  # the hooks do the scoring
            for j in range(len(sites)):
                if not scored[j]:  # the loss does not depend on this site: its gradient is zero
                    score(j, activations[j], torch.zeros_like(activations[j]))
            activations[:] = [None] * len(sites)
            n += batch["size"]
            batches += 1
    if n == 0:
        raise ValueError("probe_loader: it yielded no batches; pass a non-empty probe sample")
    return accs, n, batches


def all_reduce(accs, n, batches, sync_fn, device):
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
