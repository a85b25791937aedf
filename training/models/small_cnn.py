"""A small CNN for tiny images (scikit-learn's 8×8 digits, or any fixture-sized input).

Three 3×3 conv blocks (BN + ReLU, or conv + ReLU with ``batch_norm=False``), one 2×2 max-pool, global average pooling:
``x (N, in_channels, H, W) → features (N, 4·width) → classifier (N, num_classes)``. Adaptive pooling makes it
size-agnostic, which is why the tests also use it as a stand-in for the big architectures on tiny fixture images.
"""

from __future__ import annotations

from torch import nn


def _conv_bn_relu(cin: int, cout: int, batch_norm: bool = True) -> list[nn.Module]:
    if not batch_norm:
        return [nn.Conv2d(cin, cout, 3, padding=1), nn.ReLU(inplace=True)]
    return [nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True)]


class SmallCNN(nn.Module):
    """``features`` (input → ``(N, 4·width)``) then a linear ``classifier``; ``forward = classifier ∘ features``."""

    def __init__(self, num_classes: int = 10, in_channels: int = 1, width: int = 32, batch_norm: bool = True):
        super().__init__()
        self.features = nn.Sequential(
            *_conv_bn_relu(in_channels, width, batch_norm),
            *_conv_bn_relu(width, 2 * width, batch_norm),
            nn.MaxPool2d(2),
            *_conv_bn_relu(2 * width, 4 * width, batch_norm),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
        )
        self.classifier = nn.Linear(4 * width, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))
