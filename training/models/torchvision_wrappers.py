"""torchvision ResNet-50 and ViT-B/16 reshaped to the project's model contract: ``features`` (input → ``(N, d)``)
and ``classifier`` (``nn.Linear(d, num_classes)``), ``forward(x) == classifier(features(x))``.

Pretrained weights come from a *local* file (no downloads): a torchvision state dict as published
(``resnet50-*.pth``, ``vit_b_16-*.pth``), or a dict holding one under ``"model"`` / ``"state_dict"``. The original
1000-class head is dropped and a fresh ``num_classes`` head is initialised.
"""

from __future__ import annotations

import os

import torch
from torch import nn

# torchvision (the `train` extra) is imported where a model is built, so that importing the model zoo, and with it the
# training CLI, works without it; the CLI then names the missing extra.

# Keys of torchvision's own classification heads, which a fine-tune replaces.
_HEAD_PREFIXES = ("fc.", "heads.")


def _load_backbone_weights(model: nn.Module, path: str | os.PathLike) -> None:
    """Load a local torchvision checkpoint into ``model`` (a torchvision model), skipping its classification head."""
    if not os.path.isfile(path):
        raise FileNotFoundError(f"pretrained checkpoint {str(path)!r} does not exist (expected a local torchvision "
                                "state dict .pth file; this project never downloads weights)")
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # a truncated, empty or foreign file raises many kinds of error (pickle's, torch's, zip's)
        reason = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else ""
        raise ValueError(f"pretrained checkpoint {str(path)!r} is not a readable torchvision state dict "
                         f"({type(exc).__name__}" + (f": {reason})" if reason else ")")) from exc
    for key in ("model", "state_dict"):
        if isinstance(state, dict) and key in state and isinstance(state[key], dict):
            state = state[key]
    if not isinstance(state, dict):
        raise ValueError(f"pretrained checkpoint {str(path)!r} does not hold a state dict")
    state = {k.removeprefix("module."): v for k, v in state.items()
             if not k.removeprefix("module.").startswith(_HEAD_PREFIXES)}
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not k.startswith(_HEAD_PREFIXES)]
    if missing or unexpected:
        raise ValueError(f"pretrained checkpoint {str(path)!r} does not match {type(model).__name__}: "
                         f"missing {missing[:5]}{'…' if len(missing) > 5 else ''}, "
                         f"unexpected {unexpected[:5]}{'…' if len(unexpected) > 5 else ''}")


class TorchvisionResNet50(nn.Module):
    """torchvision ResNet-50 (7×7 stem, max-pool, 224 px), penultimate 2048-d features."""

    def __init__(self, num_classes: int = 1000, pretrained: str | None = None, in_channels: int = 3):
        super().__init__()
        if in_channels != 3:
            raise ValueError("torchvision ResNet-50 takes 3-channel images")
        import torchvision

        net = torchvision.models.resnet50(weights=None)
        if pretrained:
            _load_backbone_weights(net, pretrained)
        self.features = nn.Sequential(net.conv1, net.bn1, net.relu, net.maxpool, net.layer1, net.layer2,
                                      net.layer3, net.layer4, net.avgpool, nn.Flatten())
        self.classifier = nn.Linear(net.fc.in_features, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


class _ViTFeatures(nn.Module):
    """Everything in torchvision's VisionTransformer up to (not including) ``heads``: the class-token embedding."""

    def __init__(self, vit: nn.Module):  # a torchvision.models.VisionTransformer
        super().__init__()
        self.vit = vit
        del self.vit.heads

    def forward(self, x):
        tokens = self.vit._process_input(x)
        class_token = self.vit.class_token.expand(tokens.shape[0], -1, -1)
        tokens = self.vit.encoder(torch.cat([class_token, tokens], dim=1))
        return tokens[:, 0]


class TorchvisionViTB16(nn.Module):
    """torchvision ViT-B/16 (224 px, 768-d class token)."""

    def __init__(self, num_classes: int = 1000, pretrained: str | None = None, in_channels: int = 3,
                 image_size: int = 224):
        super().__init__()
        if in_channels != 3:
            raise ValueError("torchvision ViT-B/16 takes 3-channel images")
        import torchvision

        vit = torchvision.models.vit_b_16(weights=None, image_size=image_size)
        if pretrained:
            _load_backbone_weights(vit, pretrained)
        hidden = vit.hidden_dim
        self.features = _ViTFeatures(vit)
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))
