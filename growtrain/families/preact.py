"""Pre-activation residual block: ``z + conv2(relu(bn2(conv1(relu(bn1(z))))))``.

The terminal map ``V`` is ``conv2`` (no bias), so a zero ``conv2`` makes the block exactly
the identity: ``h(z) = V φ(z)`` with ``φ(z) = relu(bn2(conv1(relu(bn1(z)))))``.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from growtrain.families.base import DenseFeatures


def conv3x3(in_ch: int, out_ch: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(in_ch, out_ch, 3, stride=stride, padding=1, bias=False)


class PreActBlock(nn.Module):
    """He et al. (2016b) pre-activation block; a 1×1 projection shortcut when the shape changes."""

    def __init__(self, in_channels: int, out_channels: int, stride: int = 1):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(in_channels)
        self.conv1 = conv3x3(in_channels, out_channels, stride)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.conv2 = conv3x3(out_channels, out_channels)
        self.shortcut = None
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Conv2d(in_channels, out_channels, 1, stride=stride, bias=False)
        for m in (self.conv1, self.conv2) + ((self.shortcut,) if self.shortcut is not None else ()):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")

    # the feature form runs every BatchNorm of the block: a folded calibration (growtrain.probe_pass)
    # sets the statistics while it computes the features
    probe_features_calibrates = True

    def features(self, z: torch.Tensor) -> torch.Tensor:
        """``φ(z)``: the input of the terminal conv, ``(B, C, H, W)``."""
        return F.relu(self.bn2(self.conv1(F.relu(self.bn1(z)))))

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        pre = F.relu(self.bn1(z))
        skip = z if self.shortcut is None else self.shortcut(pre)
        return skip + self.conv2(F.relu(self.bn2(self.conv1(pre))))

    # -- growth protocol -----------------------------------------------------------------
    def zero_init_last(self) -> None:
        nn.init.zeros_(self.conv2.weight)

    def terminal_parameters(self) -> list[nn.Parameter]:
        return [self.conv2.weight]

    def probe_features(self, z: torch.Tensor) -> DenseFeatures:
        c = self.conv2
        return DenseFeatures(self.features(z), bias=False, conv=(c.kernel_size, c.dilation, c.padding, c.stride))

    def split_terminal(self, matrix: torch.Tensor) -> list[torch.Tensor]:
        """``(C_out, C_in·k²)`` cross-gradient matrix → tensors shaped like ``terminal_parameters()``."""
        return [matrix.reshape(self.conv2.weight.shape)]
