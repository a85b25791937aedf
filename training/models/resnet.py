"""CIFAR-style ResNets (He et al. 2016): 3×3 stem, no max-pool, three stages at 32/16/8 px, global average pooling.

* ``resnet110``: basic blocks, 18 per stage, widths 16/32/64 (the original CIFAR ResNet-110, 1.7 M parameters).
* ``resnet50``: bottleneck blocks [3, 4, 6, 3], widths 64…512 ×4 expansion, the ImageNet ResNet-50 with a 3×3 stride-1
  stem and no max-pool — the variant used by the focal-loss calibration papers (Mukhoti et al. 2020, the BSCE-GRA
  paper) on CIFAR-10/100.

Every model exposes ``features`` (input → penultimate ``(N, d)``) and ``classifier`` (``nn.Linear(d, C)``) with
``forward(x) == classifier(features(x))``.
"""

from __future__ import annotations

import torch
from torch import nn


class BasicBlock(nn.Module):
    expansion = 1

    def __init__(self, cin: int, planes: int, stride: int = 1, option_a_shortcut: bool = False):
        super().__init__()
        self.conv1 = nn.Conv2d(cin, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != planes:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, planes, 1, stride, bias=False), nn.BatchNorm2d(planes))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, cin: int, planes: int, stride: int = 1):
        super().__init__()
        cout = planes * self.expansion
        self.conv1 = nn.Conv2d(cin, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, cout, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(cout)
        self.shortcut = nn.Identity()
        if stride != 1 or cin != cout:
            self.shortcut = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        out = torch.relu(self.bn1(self.conv1(x)))
        out = torch.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet(nn.Module):
    """ResNet with a 3×3 stride-1 stem; ``stage_widths[i]`` planes and ``stage_blocks[i]`` blocks per stage."""

    def __init__(self, block, stage_blocks, stage_widths, num_classes: int = 10, in_channels: int = 3):
        super().__init__()
        stem_width = stage_widths[0]
        layers: list[nn.Module] = [nn.Conv2d(in_channels, stem_width, 3, 1, 1, bias=False),
                                   nn.BatchNorm2d(stem_width), nn.ReLU(inplace=True)]
        cin = stem_width
        for stage, (blocks, planes) in enumerate(zip(stage_blocks, stage_widths)):
            for index in range(blocks):
                stride = 2 if stage > 0 and index == 0 else 1
                layers.append(block(cin, planes, stride))
                cin = planes * block.expansion
        layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(cin, num_classes)
        for module in self.modules():
            if isinstance(module, nn.Conv2d):
                nn.init.kaiming_normal_(module.weight, mode="fan_out", nonlinearity="relu")

    def forward(self, x):
        return self.classifier(self.features(x))


def resnet50(num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    return CifarResNet(Bottleneck, [3, 4, 6, 3], [64, 128, 256, 512], num_classes, in_channels)


def resnet110(num_classes: int = 10, in_channels: int = 3) -> CifarResNet:
    return CifarResNet(BasicBlock, [18, 18, 18], [16, 32, 64], num_classes, in_channels)
