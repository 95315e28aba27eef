"""What a zero-output block tells the probe about its terminal map ``V``.

A standard block is ``h(z) = V φ(z)``: the probe keeps ``φ(z)`` from the forward pass and the
activation gradient ``q`` at the block's output from the backward pass, and forms the
cross-gradient ``ξ = J(z)ᵀ q`` directly, without ever running ``V`` (docs/design.md §2).

Two shapes of terminal map cover the built-in families:

* :class:`DenseFeatures` — ``V`` is a matrix applied at every position (a conv's kernel on
  unfolded patches, or a linear layer on tokens), optionally with a bias (a column of ones).
  ``ξ_i = Σ_pos q_pos φ_posᵀ`` has shape ``(N, K)`` and ``Ĝ = I_N ⊗ A`` with
  ``A = (1/n) Σ_i Σ_pos φ φᵀ``.
* :class:`ChannelAffineFeatures` — ``V`` is a per-channel affine map ``(γ_c, β_c)`` inside a
  ReLU (torchvision's BasicBlock with ``bn2`` zeroed): ``∂y/∂γ_c = m·û_c``, ``∂y/∂β_c = m``
  with ``m = 1[z > 0]``. ``ξ_i`` has shape ``(C, 2)`` and ``Ĝ`` is block diagonal, one
  ``2×2`` block per channel.

Blocks without a fast form (a user's own block) are probed with ``torch.func`` per-sample
vector-Jacobian products instead; see ``growtrain.saturation``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from growtrain.probe_math import conv_patches


@dataclass
class DenseFeatures:
    """Features of a position-wise linear terminal map.

    ``phi``: ``(B, P, K)`` per-position features, or — when ``conv`` is set — the raw conv
    input ``(B, C_in, H, W)``, unfolded lazily with ``conv = (kernel, dilation, padding,
    stride)`` so that the stored tensor stays ``k²`` times smaller. ``bias``: append a
    column of ones (the bias of ``V``).
    """

    phi: torch.Tensor
    bias: bool = False
    conv: tuple | None = None

    @property
    def simple_conv(self) -> bool:
        """A stride-1, dilation-1 conv: the probe's fast grouped-convolution path applies."""
        return self.conv is not None and tuple(self.conv[1]) == (1, 1) and tuple(self.conv[3]) == (1, 1)

    def patches(self) -> torch.Tensor:
        """``(B, P, K)`` features, bias column included."""
        phi = self.phi
        if self.conv is not None:
            kernel, dilation, padding, stride = self.conv
            if self.simple_conv:
                phi = conv_patches(phi, kernel, padding)  # (B, P, C_in·k²)
            else:
                phi = torch.nn.functional.unfold(phi, kernel, dilation=dilation, padding=padding, stride=stride)
                phi = phi.transpose(1, 2)  # (B, P, C_in·k²)
        elif phi.dim() == 2:
            phi = phi.unsqueeze(1)  # (B, 1, K): one position per sample
        if self.bias:
            ones = phi.new_ones(phi.shape[:-1] + (1,))
            phi = torch.cat([phi, ones], dim=-1)
        return phi


@dataclass
class ChannelAffineFeatures:
    """Features of a per-channel ``(γ, β)`` terminal map inside a ReLU.

    ``uhat``: ``(B, C, P)`` normalised pre-affine features times the ReLU mask; ``mask``:
    ``(B, C, P)`` the mask ``1[z > 0]`` itself.
    """

    uhat: torch.Tensor
    mask: torch.Tensor
