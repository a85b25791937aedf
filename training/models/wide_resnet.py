"""Wide-ResNet-d-k for CIFAR (Zagoruyko & Komodakis 2016): pre-activation basic blocks, (d − 2) / 6 blocks per
stage, widths 16k / 32k / 64k. ``wide_resnet26_10`` (d = 26, k = 10, 36.5 M parameters) is the calibration papers'
WRN-26-10. Exposes ``features`` / ``classifier`` like every model in :mod:`training.models`.
"""

from __future__ import annotations

import torch
from torch import nn


class WideBasic(nn.Module):
    """Pre-activation block: BN-ReLU-conv3×3-(dropout)-BN-ReLU-conv3×3, 1×1 projection when the shape changes."""

    def __init__(self, cin: int, cout: int, stride: int, dropout: float):
        super().__init__()
        self.bn1 = nn.BatchNorm2d(cin)
        self.conv1 = nn.Conv2d(cin, cout, 3, 1, 1, bias=False)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.bn2 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, stride, 1, bias=False)
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Conv2d(cin, cout, 1, stride, bias=False)

    def forward(self, x):
        out = self.conv1(torch.relu(self.bn1(x)))
        out = self.conv2(torch.relu(self.bn2(self.dropout(out))))
        return out + self.shortcut(x)


class WideResNet(nn.Module):
    def __init__(self, depth: int = 26, widen_factor: int = 10, num_classes: int = 10, in_channels: int = 3,
                 dropout: float = 0.0):
        super().__init__()
        if (depth - 2) % 6 != 0:
            raise ValueError(f"Wide-ResNet depth must be 6n + 2, got {depth}")
        blocks = (depth - 2) // 6
        widths = [16, 16 * widen_factor, 32 * widen_factor, 64 * widen_factor]
        layers: list[nn.Module] = [nn.Conv2d(in_channels, widths[0], 3, 1, 1, bias=False)]
        cin = widths[0]
        for stage, cout in enumerate(widths[1:]):
            for index in range(blocks):
                layers.append(WideBasic(cin, cout, 2 if stage > 0 and index == 0 else 1, dropout))
                cin = cout
        layers += [nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(cin, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        return self.classifier(self.features(x))


def wide_resnet26_10(num_classes: int = 10, in_channels: int = 3, dropout: float = 0.0) -> WideResNet:
    return WideResNet(26, 10, num_classes, in_channels, dropout)
