"""DenseNet-BC-121 for CIFAR (Huang et al. 2017; the kuangliu/pytorch-cifar variant used by the calibration papers):
blocks of [6, 12, 24, 16] bottleneck layers, growth rate 32, compression 0.5, a 3×3 stem (no 7×7 conv / max-pool) so
the 32×32 input keeps its resolution until the first transition. Exposes ``features`` / ``classifier``.
"""

from __future__ import annotations

import torch
from torch import nn


class DenseLayer(nn.Module):
    """BN-ReLU-conv1×1 (4·growth) - BN-ReLU-conv3×3 (growth), output concatenated to the input."""

    def __init__(self, cin: int, growth: int):
        super().__init__()
        self.body = nn.Sequential(
            nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, 4 * growth, 1, bias=False),
            nn.BatchNorm2d(4 * growth), nn.ReLU(inplace=True), nn.Conv2d(4 * growth, growth, 3, 1, 1, bias=False),
        )

    def forward(self, x):
        return torch.cat([self.body(x), x], dim=1)


def _transition(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.BatchNorm2d(cin), nn.ReLU(inplace=True), nn.Conv2d(cin, cout, 1, bias=False),
                         nn.AvgPool2d(2))


class DenseNet(nn.Module):
    def __init__(self, block_layers=(6, 12, 24, 16), growth: int = 32, compression: float = 0.5,
                 num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        channels = 2 * growth
        layers: list[nn.Module] = [nn.Conv2d(in_channels, channels, 3, 1, 1, bias=False)]
        for index, count in enumerate(block_layers):
            for _ in range(count):
                layers.append(DenseLayer(channels, growth))
                channels += growth
            if index < len(block_layers) - 1:
                reduced = int(channels * compression)
                layers.append(_transition(channels, reduced))
                channels = reduced
        layers += [nn.BatchNorm2d(channels), nn.ReLU(inplace=True), nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(channels, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


def densenet121(num_classes: int = 10, in_channels: int = 3) -> DenseNet:
    return DenseNet((6, 12, 24, 16), 32, 0.5, num_classes, in_channels)
