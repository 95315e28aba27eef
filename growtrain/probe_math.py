"""Pure tensor functions for the saturation certificate (no Lightning, no hooks, no state).

Names follow the paper: for candidate site ``l`` and probe sample ``i``, ``q_i`` is the
per-sample activation gradient at the block's output, ``φ_i`` the block's features, ``ξ_i =
J_iᵀ q_i`` the per-sample gradient of the terminal map ``V`` at ``V = 0``; ``ĝ = mean ξ_i``.
"""

from __future__ import annotations

import math

import torch


# -- per-sample cross-gradients --------------------------------------------------------------
def dense_cross_gradients(patches: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``ξ_i = Σ_pos q_pos φ_posᵀ``.

    patches: ``(B, P, K)`` features per position; q: ``(B, P, N)`` activation gradients at the
    same positions. Returns ``(B, N, K)``.
    """
    return torch.bmm(q.transpose(1, 2), patches)  # (B, N, P) @ (B, P, K)


def conv_cross_gradients(phi: torch.Tensor, q: torch.Tensor, padding: tuple[int, int]) -> torch.Tensor:
    """Per-sample gradients of a stride-1 conv's kernel, without unfolding.

    phi: ``(B, C, H, W)`` conv input; q: ``(B, N, H', W')`` gradient at the conv output.
    ``ξ_i[n, c, a, b] = Σ_{h,w} q_i[n, h, w] · φ_i[c, h+a−p, w+b−p]`` is a correlation of
    ``φ_i`` with ``q_i``: one grouped convolution with the samples as groups. Returns
    ``(B, N, C·kh·kw)`` in ``unfold``'s (c, a, b) order. (``unfold`` + ``bmm`` is the same
    number of multiply-adds but materialises ``k²`` copies of ``φ``; measured 2–16× slower.)
    """
    b, c, h, w = phi.shape
    n, ho, wo = q.shape[1], q.shape[2], q.shape[3]
    if ho * wo < 4 * c:
        # Few positions, many channels (e.g. 8×8×64): k² batched matmuls over shifted
        # channels-last slices beat the grouped convolution (measured 35 vs 133 ms for
        # 128×64×8×8 on one CPU thread; the grouped convolution wins at 16×16 and 32×32).
        kh, kw = h + 2 * padding[0] - ho + 1, w + 2 * padding[1] - wo + 1
        padded = torch.nn.functional.pad(phi, (padding[1], padding[1], padding[0], padding[0]))
        padded = padded.permute(0, 2, 3, 1).contiguous()  # (B, H+2p, W+2p, C)
        qf = q.flatten(2)  # (B, N, P)
        out = phi.new_empty(b, n, c, kh * kw)
        for i in range(kh):
            for j in range(kw):
                out[..., i * kw + j] = torch.bmm(qf, padded[:, i : i + ho, j : j + wo, :].reshape(b, ho * wo, c))
        return out.reshape(b, n, c * kh * kw)
    kernels = q.reshape(b * n, 1, q.shape[2], q.shape[3])  # one H'×W' kernel per (sample, out-channel)
    out = torch.nn.functional.conv2d(phi.transpose(0, 1), kernels, padding=padding, groups=b)  # (C, B·N, kh, kw)
    kk = out.shape[2] * out.shape[3]
    return out.reshape(c, b, n, kk).permute(1, 2, 0, 3).reshape(b, n, c * kk)


def conv_patches(phi: torch.Tensor, kernel: tuple[int, int], padding: tuple[int, int]) -> torch.Tensor:
    """``unfold`` for a stride-1 conv by stacking shifted slices: ``(B, P, C·kh·kw)``.

    Same values and order as ``F.unfold(...).transpose(1, 2)``; plain slice copies are much
    faster on CPU than ``im2col``.
    """
    b, c, h, w = phi.shape
    (kh, kw), (ph, pw) = kernel, padding
    padded = torch.nn.functional.pad(phi, (pw, pw, ph, ph))
    ho, wo = h + 2 * ph - kh + 1, w + 2 * pw - kw + 1
    cols = [padded[:, :, i : i + ho, j : j + wo] for i in range(kh) for j in range(kw)]
    return torch.stack(cols, dim=2).reshape(b, c * kh * kw, ho * wo).transpose(1, 2)


def dense_gram(patches: torch.Tensor) -> torch.Tensor:
    """``Σ_i Σ_pos φ φᵀ`` over a batch: ``(K, K)`` (divide by ``n`` for ``A``)."""
    flat = patches.reshape(-1, patches.shape[-1])  # (B·P, K)
    return flat.T @ flat


def affine_cross_gradients(uhat: torch.Tensor, mask: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Per-channel ``(γ, β)`` gradients: ``(B, C, 2)`` from ``(B, C, P)`` inputs."""
    return torch.stack([(q * uhat).sum(-1), (q * mask).sum(-1)], dim=-1)


def affine_gram(uhat: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``Σ_i J_iᵀ J_i`` per channel: ``(C, 2, 2)`` (the mask is 0/1, so ``m² = m``)."""
    uu = (uhat * uhat).sum((0, 2))
    um = (uhat * mask).sum((0, 2))
    mm = mask.sum((0, 2))
    return torch.stack([torch.stack([uu, um], -1), torch.stack([um, mm], -1)], -2)


# -- projected growth value V_S = sqrt(ĝᵀ Ĝ† ĝ) ----------------------------------------------
def psd_pinv(matrix: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """Moore–Penrose pseudo-inverse of a symmetric PSD matrix (or a batch of them)."""
    matrix = 0.5 * (matrix + matrix.transpose(-1, -2))
    evals, evecs = torch.linalg.eigh(matrix)
    if rtol is None:
        rtol = matrix.shape[-1] * torch.finfo(matrix.dtype).eps
    cutoff = rtol * evals.abs().amax(-1, keepdim=True)
    inv = torch.where(evals > cutoff, 1.0 / evals, torch.zeros_like(evals))
    return (evecs * inv.unsqueeze(-2)) @ evecs.transpose(-1, -2)


def projected_dense(grad: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``V_S² = tr(C A† Cᵀ)`` for ``Ĝ = I ⊗ A``; grad ``C``: ``(N, K)``, gram ``A``: ``(K, K)``."""
    value = ((grad @ psd_pinv(gram)) * grad).sum()
    return value.clamp_min(0).sqrt()


def projected_blocks(grad: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``V_S² = Σ_c g_cᵀ G_c† g_c`` for a block-diagonal ``Ĝ``; grad ``(C, r)``, gram ``(C, r, r)``."""
    value = torch.einsum("cr,crs,cs->", grad, psd_pinv(gram), grad)
    return value.clamp_min(0).sqrt()


def projected_full(grad: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``V_S² = ĝᵀ Ĝ† ĝ`` with an explicit ``(p, p)`` Gram matrix."""
    value = grad @ psd_pinv(gram) @ grad
    return value.clamp_min(0).sqrt()


# -- the decision --------------------------------------------------------------------------
def chebyshev_t(total_variance: float, n: int, alpha: float) -> float:
    """``t = sqrt(Σ_l σ̂²_l / (n α))``: Proposition 1 solved for an error bound of ``α``."""
    return math.sqrt(total_variance / (n * alpha))


def chebyshev_bound(total_variance: float, n: int, t: float) -> float:
    """Proposition 1's error bound ``Σ_l σ̂²_l / (n t²)`` (capped at 1; 0 when there is no noise)."""
    if total_variance == 0:
        return 0.0
    if t <= 0:
        return 1.0
    return min(1.0, total_variance / (n * t * t))


def decide_paper(gamma: float, delta: float, t: float) -> tuple[bool, str]:
    """Proposition 1's rule: saturated iff ``Γ̂_n ≤ δ + t``. Returns ``(saturated, reason)``."""
    threshold = delta + t
    if gamma <= threshold:
        return True, f"saturated: Γ̂={gamma:.4g} ≤ δ+t={threshold:.4g}"
    return False, f"grow: Γ̂={gamma:.4g} > δ+t={threshold:.4g}"


def sample_variance(sum_sq: float, sum_vec_sq: float, n: int) -> float:
    """``σ̂² = (1/(n−1)) Σ‖ξ_i − ĝ‖² = (Σ‖ξ_i‖² − n‖ĝ‖²)/(n−1)`` from streamed sums.

    ``sum_sq = Σ‖ξ_i‖²``, ``sum_vec_sq = ‖Σ ξ_i‖²``. Accumulated in float64.
    """
    if n < 2:
        return float("nan")
    return max(0.0, (sum_sq - sum_vec_sq / n) / (n - 1))
