"""Soft-target training helpers: mixup / cutmix in compact form, model EMA, linear LR warm-up (training/README.md).

**Compact mixing (the default).** A mixed batch's targets are ``t_i = λ e_{y_i} + (1 - λ) e_{y_{π(i)}}`` with the
partner permutation ``π`` = reversal of the batch (``target.flip(0)``, as timm's and torchvision's batch mixers pair
samples) and one ``λ`` per batch. :func:`mix_batch` mixes the images and returns ``(images, mix_target, λ)``; the
loss takes ``target, mix_target=…, mix_lambda=λ``. The targets stay two int64 vectors and a number, O(N) data,
instead of the dense ``(N, C)`` float tensor that ``torchvision.transforms.v2.MixUp``/``CutMix`` and
``timm.data.Mixup`` build (4 MB per step at N = 1024, C = 1000 in float32, plus its ``one_hot`` and the loss's reads
of it); a kernel needs only the two class indices and λ per row to form ``t``. ``--mix-dense`` keeps torchvision's
dense path (:func:`dense_mixer`) for comparison: both give the same loss for the same λ and pairing.

**Mixup** (Zhang et al. 2018): ``x <- λ x + (1 - λ) x_π``, ``λ ~ Beta(α, α)``. **CutMix** (Yun et al. 2019): a box of
area ``(1 - λ) H W`` (``λ ~ Beta(α, α)``, centre uniform, clipped at the border) is pasted from ``x_π``; ``λ`` is then
recomputed from the clipped box's area, as torchvision's ``CutMix`` does. With both enabled, each batch picks one
with probability 1/2 (torchvision's ``RandomChoice([MixUp, CutMix])`` in its classification reference).
"""

from __future__ import annotations

import math

import torch

__all__ = ["mix_batch", "dense_mixer", "dense_targets", "make_ema", "ema_decay_per_update", "make_scheduler"]


def _beta(alpha: float, generator=None) -> float:
    """One sample of Beta(α, α) from torch's RNG (so a resumed run draws the same λ): ``G1 / (G1 + G2)``."""
    g = torch._standard_gamma(torch.full((2,), float(alpha), dtype=torch.float64))
    return float(g[0] / g.sum()) if float(g.sum()) > 0 else 0.5


def mix_batch(images: torch.Tensor, mixup_alpha: float = 0.0, cutmix_alpha: float = 0.0):
    """Mix a batch ``(N, C, H, W)`` with its reversal; return ``(mixed images, partner index π, λ)``.

    The targets of the result are ``λ e_y + (1 - λ) e_{y[π]}``: pass ``mix_target=target[π]`` (= ``target.flip(0)``)
    and ``mix_lambda=λ`` to the loss. ``λ = 1`` (no mixing) when both alphas are 0.
    """
    use_mixup, use_cutmix = mixup_alpha > 0, cutmix_alpha > 0
    partner = torch.arange(images.shape[0] - 1, -1, -1, device=images.device)
    if not (use_mixup or use_cutmix):
        return images, partner, 1.0
    if use_mixup and use_cutmix:
        use_mixup = bool(torch.rand(()) < 0.5)
    flipped = images.flip(0)
    if use_mixup:
        lam = _beta(mixup_alpha)
        return images * lam + flipped * (1.0 - lam), partner, lam
    lam = _beta(cutmix_alpha)
    height, width = images.shape[-2:]
    r_x, r_y = float(torch.randint(width, ())), float(torch.randint(height, ()))
    r = 0.5 * math.sqrt(1.0 - lam)
    r_w_half, r_h_half = int(r * width), int(r * height)
    x1, y1 = int(max(r_x - r_w_half, 0)), int(max(r_y - r_h_half, 0))
    x2, y2 = int(min(r_x + r_w_half, width)), int(min(r_y + r_h_half, height))
    mixed = images.clone()
    mixed[..., y1:y2, x1:x2] = flipped[..., y1:y2, x1:x2]
    lam = 1.0 - (x2 - x1) * (y2 - y1) / (width * height)
    return mixed, partner, lam


def dense_targets(target: torch.Tensor, partner: torch.Tensor, lam: float, num_classes: int,
                  dtype=torch.float32) -> torch.Tensor:
    """The dense ``(N, C)`` form of the compact targets: ``λ e_y + (1 - λ) e_{y[π]}``."""
    one_hot = torch.nn.functional.one_hot(target, num_classes).to(dtype)
    return lam * one_hot + (1.0 - lam) * one_hot[partner]


def dense_mixer(num_classes: int, mixup_alpha: float, cutmix_alpha: float):
    """torchvision's batch mixer (``transforms.v2.MixUp`` / ``CutMix``, one chosen per batch): ``(images, target)
    -> (images, dense (N, C) targets)``; ``None`` when both alphas are 0."""
    from torchvision.transforms import v2

    mixers = []
    if mixup_alpha > 0:
        mixers.append(v2.MixUp(alpha=mixup_alpha, num_classes=num_classes))
    if cutmix_alpha > 0:
        mixers.append(v2.CutMix(alpha=cutmix_alpha, num_classes=num_classes))
    if not mixers:
        return None
    return mixers[0] if len(mixers) == 1 else v2.RandomChoice(mixers)


def ema_decay_per_update(decay: float, steps: int, batch_size: int, epochs: int) -> float:
    """torchvision's classification reference rescales the EMA decay, given per image, to one update every
    ``steps`` optimiser steps of a global batch ``batch_size`` over ``epochs``: ``α = (1 - decay) · batch_size ·
    steps / epochs`` (capped at 1), decay per update ``1 - α``."""
    alpha = min(1.0, (1.0 - decay) * batch_size * steps / epochs)
    return 1.0 - alpha


def make_ema(model: torch.nn.Module, decay: float, device=None):
    """An exponential moving average of ``model``'s parameters and buffers (``torch.optim.swa_utils.AveragedModel``
    with ``get_ema_multi_avg_fn``): ``θ_ema <- decay θ_ema + (1 - decay) θ``; its first update copies ``θ``."""
    from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn

    return AveragedModel(model, device=device, multi_avg_fn=get_ema_multi_avg_fn(decay), use_buffers=True)


def make_scheduler(optimizer, scheduler: str, epochs: int, milestones=(), warmup_epochs: int = 0,
                   warmup_decay: float = 0.01):
    """The per-epoch schedule: ``cosine`` (to 0 at ``epochs``) or ``multistep`` (×0.1 at each milestone), after
    ``warmup_epochs`` of linear warm-up from ``warmup_decay · lr`` to ``lr`` (torchvision's ``--lr-warmup-method
    linear``: ``LinearLR`` then the main schedule through ``SequentialLR``; the main schedule's epochs and
    milestones count from the end of the warm-up, as there)."""
    if warmup_epochs < 0 or (warmup_epochs and warmup_epochs >= epochs):
        raise ValueError(f"--warmup-epochs must be >= 0 and < --epochs ({epochs}), got {warmup_epochs}")
    if not 0 < warmup_decay <= 1:
        raise ValueError(f"the warm-up start factor must be in (0, 1], got {warmup_decay}")
    lr_scheduler = torch.optim.lr_scheduler
    main_epochs = epochs - warmup_epochs
    if scheduler == "cosine":
        main = lr_scheduler.CosineAnnealingLR(optimizer, T_max=main_epochs)
    else:
        main = lr_scheduler.MultiStepLR(optimizer, milestones=[m - warmup_epochs for m in milestones], gamma=0.1)
    if not warmup_epochs:
        return main
    warmup = lr_scheduler.LinearLR(optimizer, start_factor=warmup_decay, total_iters=warmup_epochs)
    return lr_scheduler.SequentialLR(optimizer, [warmup, main], milestones=[warmup_epochs])
