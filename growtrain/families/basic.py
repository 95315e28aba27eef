"""torchvision-style BasicBlock: ``relu(z + bn2(conv2(relu(bn1(conv1(z))))))``.

Zero output through ``bn2.weight = bn2.bias = 0`` (the ``zero_init_residual`` trick): the
block returns ``relu(z)``, which is ``z`` because its input is the output of a ReLU (the stem
or a previous block), so ``z ≥ 0``. The terminal map ``V`` is ``(γ, β)`` of ``bn2``: two
numbers per channel, a much smaller tangent space than a conv's kernel — ``projected``
(``V_S``) is correspondingly often well below ``ag`` for this family.

Inside the ReLU the Jacobian is masked: ``∂y/∂γ_c = 1[z>0]·û_c`` and ``∂y/∂β_c = 1[z>0]``,
with ``û = (conv2(a) − μ)/√(σ²+ε)`` normalised by ``bn2``'s running statistics (the probe
runs in eval mode).
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from growtrain.families.base import ChannelAffineFeatures
from growtrain.families.preact import conv3x3


class BasicBlock(nn.Module):
    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.conv1 = conv3x3(in_channels, out_channels, stride)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = conv3x3(out_channels, out_channels)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False), nn.BatchNorm2d(out_channels)
            )
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        skip = z if self.shortcut is None else self.shortcut(z)
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(z)))))
        return F.relu(skip + out)

    # -- growth protocol -----------------------------------------------------------------
    def zero_init_last(self) -> None:
        nn.init.zeros_(self.bn2.weight)
        nn.init.zeros_(self.bn2.bias)

    def terminal_parameters(self) -> list[nn.Parameter]:
        return [self.bn2.weight, self.bn2.bias]

    # the feature form runs every BatchNorm of the block: a folded calibration (growtrain.probe_pass)
    # sets the statistics while it computes the features
    probe_features_calibrates = True

    def normalised(self, z: torch.Tensor) -> torch.Tensor:
        """``û``: ``bn2``'s input normalised by its running statistics, ``(B, C, H, W)``; in
        train mode by the batch's, accumulated into the running ones as ``bn2`` itself would."""
        u = self.conv2(F.relu(self.bn1(self.conv1(z))))
        bn = self.bn2
        if bn.training:
            bn.num_batches_tracked.add_(1)
            factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
            return F.batch_norm(u, bn.running_mean, bn.running_var, None, None, True, factor, bn.eps)
        mean = bn.running_mean.view(1, -1, 1, 1)
        var = bn.running_var.view(1, -1, 1, 1)
        return (u - mean) * torch.rsqrt(var + bn.eps)

    def probe_features(self, z: torch.Tensor) -> ChannelAffineFeatures:
        mask = (z > 0).to(z.dtype).flatten(2)  # (B, C, P): the ReLU after the add, at V = 0
        uhat = self.normalised(z).flatten(2) * mask
        return ChannelAffineFeatures(uhat=uhat, mask=mask)

    def split_terminal(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """``(C, 2)`` → ``[γ-gradient, β-gradient]``."""
        return [matrix[:, 0].contiguous(), matrix[:, 1].contiguous()]
