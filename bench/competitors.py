"""The loss bench's steps of other libraries' losses, for the providers ``torch_cross_entropy`` and
``liger_cross_entropy`` (:data:`bench.providers.PROVIDERS`). Both compute plain cross-entropy (weight ``"none"``).

* ``F.cross_entropy``: hard targets as they are; ``"smooth"`` with ``label_smoothing=``; ``"dense"`` with the
  probabilities as the target; a mix as ``(λ·CE(z, y) + (1 − λ)·CE(z, y2)).mean()`` over per-row cross-entropies.
* Liger-Kernel's ``LigerCrossEntropyLoss`` (fused; it writes the gradient into its logits): hard and ``"smooth"``
  targets, on CUDA, when ``liger_kernel`` is importable.
"""

from __future__ import annotations

import importlib.util
from typing import Callable

import torch
import torch.nn.functional as F

from bench.cases import LABEL_SMOOTHING, Case, Step, loss_step


def mixed_cross_entropy(logits, target, *, mix_target, mix_lambda, label_smoothing=0.0):
    """Mixup's compact loss in plain PyTorch with one λ per row: ``mean_i(λ_i CE(z_i, y_i) + (1 − λ_i) CE(z_i,
    y2_i))``, the per-row form of ``lam * F.cross_entropy(z, y) + (1 - lam) * F.cross_entropy(z, y2)``."""
    first = F.cross_entropy(logits, target, reduction="none", label_smoothing=label_smoothing)
    second = F.cross_entropy(logits, mix_target, reduction="none", label_smoothing=label_smoothing)
    return (mix_lambda * first + (1 - mix_lambda) * second).mean()


def torch_cross_entropy_step(case: Case) -> Step:
    """The step of ``F.cross_entropy`` on ``case``'s target kind."""
    if case.target == "hard":
        def step(logits, target):
            loss = F.cross_entropy(logits, target)
            loss.backward()
            return loss

        return step
    if case.target in ("mix", "mix_smooth"):
        return loss_step(mixed_cross_entropy, case)
    # "smooth": F.cross_entropy(logits, y, label_smoothing=a); "dense": F.cross_entropy(logits, probabilities)
    return loss_step(F.cross_entropy, case)


def liger_cross_entropy_step(case: Case) -> Step:
    """The step of Liger-Kernel's ``LigerCrossEntropyLoss`` (mean, ``label_smoothing=0.1`` for ``"smooth"``)."""
    from liger_kernel.transformers import LigerCrossEntropyLoss

    smoothing = LABEL_SMOOTHING if case.target == "smooth" else 0.0
    criterion = LigerCrossEntropyLoss(reduction="mean", label_smoothing=smoothing)
    hard = case.target == "hard"

    def step(logits, target):
        loss = criterion(logits, target if hard else target.target)
        if isinstance(loss, tuple):  # versions that also return the z-loss / accuracy
            loss = loss[0]
        loss.backward()
        return loss

    return step


def needs_module(module: str) -> Callable[[torch.device], str | None]:
    """A provider's ``requires``: ``None`` when ``module`` is importable, else that it is not installed."""
    return lambda device: None if importlib.util.find_spec(module) is not None else f"{module} is not installed"
