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


def conv_gram(phi: torch.Tensor, kernel: tuple[int, int], padding: tuple[int, int], bias: bool = False) -> torch.Tensor:
    """``dense_gram(conv_patches(phi, kernel, padding))`` for a stride-1 "same" conv
    (``k = 2p + 1``), without forming the patches, in about a sixth of the multiply-adds.

    ``A[(c,s),(c',s')] = Σ_i Σ_y φp_i[c, y+s] φp_i[c', y+s']`` (``φp`` zero-padded, ``y`` over
    the output grid) depends on the shifts through the lag ``d = s' − s`` except near the
    border: it is the full-image lag sum ``L_d = Σ_x φp[x] φp[x+d]ᵀ`` minus the interior
    positions ``x`` that ``y + s`` never reaches (at most ``p`` rows and columns at one edge).
    In the channels-last, zero-padded image flattened over (sample, row, column), a 2-D lag is
    one 1-D offset ``d_r·W_p + d_c``, and every position it carries past an edge lands in the
    zero padding (the padding is ``(k−1)/2`` wide), so ``L_d`` is one matmul of two shifted
    views: ``(2k_h−1)(2k_w−1)/2`` lag products instead of ``(k_h k_w)²`` blocks, and no
    ``k²``-fold copy of ``φ``. ``bias``: append the ones column's row and column, as
    ``DenseFeatures(bias=True).patches()`` does.
    """
    b, c, h, w = phi.shape
    (kh, kw), (ph, pw) = kernel, padding
    if kh != 2 * ph + 1 or kw != 2 * pw + 1:
        raise ValueError(f"conv_gram: needs a 'same' conv (kernel = 2·padding + 1), got kernel {kernel}, padding {padding}")
    hp, wp = h + 2 * ph, w + 2 * pw
    edge = (kh - 1) * wp + (kw - 1)  # the largest |offset|: zero rows at both ends keep every shift in range
    x = torch.nn.functional.pad(phi, (pw, pw, ph, ph)).permute(0, 2, 3, 1).reshape(b * hp * wp, c)
    x = torch.nn.functional.pad(x, (0, 0, edge, edge))
    m = x.shape[0]
    lags: dict[int, torch.Tensor] = {}

    def lag(o: int) -> torch.Tensor:
        if o < 0:
            return lag(-o).T
        if o not in lags:
            lags[o] = x[: m - o].T @ x[o:]
        return lags[o]

    # interior positions (padded coordinates) that y + s misses, as flat indices into x
    rows = torch.arange(ph, ph + h, device=phi.device)
    cols = torch.arange(pw, pw + w, device=phi.device)
    base = torch.arange(b, device=phi.device) * (hp * wp) + edge

    def missed(a: int, bb: int) -> torch.Tensor:
        row_out = (rows < a) | (rows >= a + h)  # rectangle rows [a, a + H) vs interior [ph, ph + H)
        col_out = (cols < bb) | (cols >= bb + w)
        mask = row_out[:, None] | col_out[None, :]
        yx = (rows[:, None] * wp + cols[None, :])[mask]  # (k,)
        return (base[:, None] + yx[None, :]).reshape(-1)

    shifts = [(a, bb) for a in range(kh) for bb in range(kw)]
    s_count = len(shifts)
    missed_idx = [missed(a, bb) for a, bb in shifts]
    gram = x.new_empty(c, s_count, c, s_count)
    for i, (a, bb) in enumerate(shifts):
        left = x[missed_idx[i]] if missed_idx[i].numel() else None
        for j in range(i, s_count):
            a2, b2 = shifts[j]
            o = (a2 - a) * wp + (b2 - bb)
            block = lag(o)
            if left is not None:
                block = block - left.T @ x[missed_idx[i] + o]
            gram[:, i, :, j] = block
            if j != i:
                gram[:, j, :, i] = block.T
    gram = gram.reshape(c * s_count, c * s_count)
    if not bias:
        return gram
    total = x.sum(0)
    sums = torch.stack([total - (x[idx].sum(0) if idx.numel() else 0) for idx in missed_idx], dim=1)  # (C, S)
    count = x.new_full((1, 1), float(b * h * w))
    top = torch.cat([gram, sums.reshape(-1, 1)], dim=1)
    return torch.cat([top, torch.cat([sums.reshape(1, -1), count], dim=1)], dim=0)


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


def _distinct_columns(gram: torch.Tensor, rtol: float) -> torch.Tensor:
    """Indices of the features to keep: feature ``k`` is dropped when an earlier feature ``j``
    equals it to rounding, ``‖x_j − x_k‖² = A_jj + A_kk − 2A_jk ≤ rtol·(A_jj + A_kk)/2`` (e.g. the
    GPT block's two ones columns). The direction ``x_j − x_k`` then has an eigenvalue below
    ``psd_pinv``'s cutoff, which the pseudo-inverse would drop too."""
    diag = gram.diagonal()
    scale = 0.5 * (diag[:, None] + diag[None, :])
    same = (diag[:, None] + diag[None, :] - 2 * gram) <= rtol * scale
    same = torch.triu(same, diagonal=1) & (scale > 0)
    return torch.nonzero(~same.any(0)).flatten()


def quadratic_pinv(grad: torch.Tensor, gram: torch.Tensor, rtol: float | None = None) -> torch.Tensor:
    """``tr(C A† Cᵀ)`` for a symmetric PSD ``A`` (``(K, K)``) and ``C`` (``(N, K)``), as
    ``psd_pinv`` would give it, in ``K³/3`` instead of an eigendecomposition where that is safe.

    ``V_S`` is unchanged by a feature that repeats another (the span of the features is the
    same), so duplicates (to rounding) are dropped first. Then a Cholesky factor ``A = LLᵀ`` gives
    ``‖L⁻¹Cᵀ‖²`` — equal to the pseudo-inverse's value when no eigenvalue of ``A`` is below
    ``psd_pinv``'s cutoff ``rtol·λ_max``. That is checked against an estimate of ``λ_min``
    (inverse iteration on the factor) with a margin of 10⁴; a singular or nearly singular
    ``A`` falls back to the eigendecomposition (an eigendecomposition of a 1,282² Gram took
    0.9 s on one CPU thread, a Cholesky factor 0.03 s).
    """
    if rtol is None:
        rtol = gram.shape[-1] * torch.finfo(gram.dtype).eps
    keep = _distinct_columns(gram, rtol)
    if len(keep) < gram.shape[-1]:
        gram, grad = gram[keep][:, keep], grad[..., keep]
    k = gram.shape[-1]
    sym = 0.5 * (gram + gram.T)
    factor, info = torch.linalg.cholesky_ex(sym)
    if int(info) == 0:
        lam_max_bound = float(torch.linalg.matrix_norm(sym))  # ‖A‖_F ≥ λ_max
        x = torch.ones(k, 1, dtype=sym.dtype, device=sym.device)
        for _ in range(8):  # inverse iteration: A⁻¹x via two triangular solves per step
            x = torch.cholesky_solve(x, factor)
            x = x / x.norm()
        lam_min = float((x.T @ sym @ x).squeeze())
        if lam_min > 1e4 * rtol * lam_max_bound:
            y = torch.linalg.solve_triangular(factor, grad.reshape(-1, k).T, upper=False)  # L⁻¹Cᵀ
            return y.pow(2).sum()
    return ((grad @ psd_pinv(sym, rtol)) * grad).sum()


def projected_dense(grad: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``V_S² = tr(C A† Cᵀ)`` for ``Ĝ = I ⊗ A``; grad ``C``: ``(N, K)``, gram ``A``: ``(K, K)``."""
    return quadratic_pinv(grad, gram).clamp_min(0).sqrt()


def projected_blocks(grad: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``V_S² = Σ_c g_cᵀ G_c† g_c`` for a block-diagonal ``Ĝ``; grad ``(C, r)``, gram ``(C, r, r)``."""
    value = torch.einsum("cr,crs,cs->", grad, psd_pinv(gram), grad)
    return value.clamp_min(0).sqrt()


def projected_full(grad: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """``V_S² = ĝᵀ Ĝ† ĝ`` with an explicit ``(p, p)`` Gram matrix."""
    return quadratic_pinv(grad, gram).clamp_min(0).sqrt()


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
