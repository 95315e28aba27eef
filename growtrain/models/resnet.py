"""The paper's stagewise CIFAR ResNet (Appendix B.1–B.2), growable.

3×3 stride-1 stem → three stages of widths ``w, 2w, 4w`` (stride-2 transitions into stages 2
and 3) → global average pool → linear head. ``blocks=(1, 1, 1)`` is ResNet-8; ``added=N``
assigns N extra blocks cyclically to layer1, layer2, layer3 (added block ``k`` goes to stage
``k mod 3``), the paper's depth variable.

Candidate sites are every position inside a stage where a same-shape block fits: all of
``layer1`` (the stem already has width ``w``), and ``layer2``/``layer3`` after their stride-2
transition block.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn
from torch.nn import functional as F

from growtrain.families import conv_family
from growtrain.growable import GrowableMixin


def stage_counts(blocks: Sequence[int], added: int) -> list[int]:
    """Blocks per stage after the cyclic allocation of ``added`` extra blocks."""
    counts = list(blocks)
    for k in range(added):
        counts[k % len(counts)] += 1
    return counts


class CifarResNet(GrowableMixin, nn.Module):
    growable_stages = ("layer1", "layer2", "layer3")

    def __init__(
        self,
        blocks: Sequence[int] = (1, 1, 1),
        width: int = 16,
        family: str = "basic",
        in_channels: int = 3,
        num_classes: int = 10,
        added: int = 0,
    ):
        super().__init__()
        blocks = tuple(int(b) for b in blocks)
        if len(blocks) != 3 or min(blocks) < 1:
            raise ValueError(f"blocks: expected three stage block counts, each ≥ 1 (e.g. (1, 1, 1)), got {blocks}")
        for name, value in (("width", width), ("in_channels", in_channels), ("num_classes", num_classes)):
            if int(value) < 1:
                raise ValueError(f"{name}: expected a positive integer, got {value}")
        if int(added) < 0:
            raise ValueError(f"added: expected a number of extra blocks ≥ 0, got {added}")
        self.family = family
        self.block_cls = conv_family(family)  # raises with the known names
        self.widths = (width, 2 * width, 4 * width)
        self.stem = nn.Conv2d(in_channels, width, 3, stride=1, padding=1, bias=False)
        nn.init.kaiming_normal_(self.stem.weight, mode="fan_out", nonlinearity="relu")
        # basic (post-activation) blocks expect a normalised, rectified input; pre-activation
        # blocks normalise their own input and need a final BN-ReLU before pooling.
        self.stem_bn = nn.BatchNorm2d(width) if family != "preact" else nn.Identity()
        counts = stage_counts(blocks, int(added))
        in_ch = width
        for i, (count, out_ch) in enumerate(zip(counts, self.widths)):
            stride = 1 if i == 0 else 2
            layer = [self.block_cls(in_ch, out_ch, stride)] + [self.block_cls(out_ch, out_ch, 1) for _ in range(count - 1)]
            setattr(self, f"layer{i + 1}", nn.ModuleList(layer))
            in_ch = out_ch
        self.final_bn = nn.BatchNorm2d(in_ch) if family == "preact" else nn.Identity()
        self.fc = nn.Linear(in_ch, num_classes)
        self._init_growth()

    # -- growth protocol -----------------------------------------------------------------
    def first_site(self, stage: str) -> int:
        return 0 if stage == "layer1" else 1  # no site in front of a stride-2 transition

    def make_block(self, stage: str) -> nn.Module:
        width = self.widths[self.growable_stages.index(stage)]
        block = self.block_cls(width, width, 1)
        block.zero_init_last()
        return block

    # -- forward -------------------------------------------------------------------------
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)  # (B, w, H, W)
        if not isinstance(self.stem_bn, nn.Identity):
            x = F.relu(self.stem_bn(x))
        for name in self.growable_stages:
            for block in self.stage(name):
                x = block(x)  # layer1: (B, w, H, W); layer2: (B, 2w, H/2, W/2); layer3: (B, 4w, H/4, W/4)
        if not isinstance(self.final_bn, nn.Identity):
            x = F.relu(self.final_bn(x))
        x = torch.flatten(F.adaptive_avg_pool2d(x, 1), 1)  # (B, 4w)
        return self.fc(x)


def cifar_resnet(
    blocks: Sequence[int] = (1, 1, 1),
    width: int = 16,
    family: str = "basic",
    in_channels: int = 3,
    num_classes: int = 10,
    added: int = 0,
) -> CifarResNet:
    """The paper's CIFAR ResNet; ``blocks=(1,1,1), added=N`` has ``3 + N`` residual blocks."""
    return CifarResNet(blocks, width, family, in_channels, num_classes, added)
