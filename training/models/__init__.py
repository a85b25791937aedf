"""Model zoo for the training recipes.

``build_model(arch, num_classes, **kw)`` returns a module exposing ``features`` (input → penultimate ``(N, d)``) and
``classifier`` (``nn.Linear(d, num_classes)``) with ``forward(x) == classifier(features(x))``; the γ-Net, the meta
look-ahead and the gradient study rely on that shape.

| arch | model | source |
|---|---|---|
| ``small_cnn`` | 3-conv CNN, global average pooling | :mod:`training.models.small_cnn` (digits demo, tests) |
| ``resnet50`` / ``resnet110`` | CIFAR ResNets (3×3 stem) | :mod:`training.models.resnet` |
| ``wide_resnet26_10`` | WRN-26-10 | :mod:`training.models.wide_resnet` |
| ``densenet121`` | DenseNet-BC-121, CIFAR stem | :mod:`training.models.densenet` |
| ``tv_resnet50`` / ``tv_vit_b_16`` | torchvision ResNet-50 / ViT-B/16 (``pretrained=PATH`` for local weights) | :mod:`training.models.torchvision_wrappers` |
"""

from __future__ import annotations

from torch import nn

from .densenet import densenet121
from .resnet import resnet50, resnet110
from .small_cnn import SmallCNN
from .torchvision_wrappers import TorchvisionResNet50, TorchvisionViTB16
from .wide_resnet import wide_resnet26_10

__all__ = ["build_model", "ARCHITECTURES", "PRETRAINED_ARCHITECTURES"]

ARCHITECTURES = {
    "small_cnn": SmallCNN,
    "resnet50": resnet50,
    "resnet110": resnet110,
    "wide_resnet26_10": wide_resnet26_10,
    "densenet121": densenet121,
    "tv_resnet50": TorchvisionResNet50,
    "tv_vit_b_16": TorchvisionViTB16,
}
# The architectures that load local pretrained weights (``pretrained=PATH``); the others have no such argument.
PRETRAINED_ARCHITECTURES = ("tv_resnet50", "tv_vit_b_16")


def build_model(arch: str, num_classes: int, **kw) -> nn.Module:
    """Build architecture ``arch`` with a ``num_classes``-way linear classifier (keyword arguments go to its
    constructor, e.g. ``in_channels=1`` or ``pretrained="/path/resnet50.pth"``)."""
    if arch not in ARCHITECTURES:
        raise ValueError(f"unknown architecture {arch!r}; expected one of {', '.join(ARCHITECTURES)}")
    if not isinstance(num_classes, int) or isinstance(num_classes, bool) or num_classes < 2:
        raise ValueError(f"num_classes must be an integer >= 2, got {num_classes!r}")
    kw = {k: v for k, v in kw.items() if v is not None}
    return ARCHITECTURES[arch](num_classes=num_classes, **kw)
