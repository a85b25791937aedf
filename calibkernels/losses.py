"""``nn.Module`` losses and the registry of SPEC §2 (names follow the papers' reference code).

>>> import calibkernels as ck
>>> criterion = ck.losses.build("bsce_gra", gamma=4.0, reduction="sum")
>>> criterion
UncertaintyWeightedCE(weight='brier', mode='grad', gamma=4.0, norm=2.0, reduction='sum', backend='auto')
"""

from __future__ import annotations

import torch
from torch import nn

from . import _validation as V
from . import functional as F_ck
from . import reference as _reference

__all__ = ["UncertaintyWeightedCE", "BrierLoss", "LabelSmoothingCE", "MMCELoss", "build", "names", "REGISTRY"]


class UncertaintyWeightedCE(nn.Module):
    """Module form of :func:`calibkernels.uncertainty_weighted_ce` (``L_i = u_i · CE_i``).

    ``forward(logits (..., C), target (...), sample_weight=None)``; ``sample_weight`` only with
    ``weight="external"``; for ``weight="focal"`` the forward also accepts a per-sample ``gamma`` tensor.
    """

    def __init__(self, weight="brier", mode="grad", gamma=4.0, norm=2.0, reduction="mean", ignore_index=-100,
                 backend="auto", inplace=False):
        super().__init__()
        V.check_weight(weight)
        V.check_mode(mode)
        V.check_gamma(gamma)
        V.check_norm(norm)
        V.check_reduction(reduction)
        V.check_backend(backend)
        self.weight, self.mode, self.gamma, self.norm = weight, mode, float(gamma), float(norm)
        self.reduction, self.ignore_index, self.backend, self.inplace = reduction, ignore_index, backend, inplace

    def forward(self, logits, target, sample_weight=None, gamma=None):
        return F_ck.uncertainty_weighted_ce(
            logits, target, weight=self.weight, mode=self.mode, gamma=self.gamma if gamma is None else gamma,
            norm=self.norm, sample_weight=sample_weight, reduction=self.reduction, ignore_index=self.ignore_index,
            backend=self.backend, inplace=self.inplace,
        )

    def extra_repr(self):
        parts = [f"weight={self.weight!r}"]
        if self.weight not in ("none", "external"):
            parts.append(f"mode={self.mode!r}")
        if self.weight in ("focal", "flsd", "dual_focal", "brier"):
            parts.append(f"gamma={self.gamma}")
        if self.weight == "brier":
            parts.append(f"norm={self.norm}")
        parts.append(f"reduction={self.reduction!r}")
        if self.ignore_index != -100:
            parts.append(f"ignore_index={self.ignore_index}")
        parts.append(f"backend={self.backend!r}")
        if self.inplace:
            parts.append("inplace=True")
        return ", ".join(parts)


def _check_reference_only_backend(loss_name, backend):
    """Losses without a fused kernel run the reference; naming a kernel backend for them is an error, not a fallback."""
    V.check_backend(backend)
    if backend not in ("auto", "reference"):
        raise ValueError(f"{loss_name} has no fused kernel: use backend='auto' or 'reference', not {backend!r}")
    return backend


class BrierLoss(nn.Module):
    """Brier loss ``Σ_k (p_k - e_{y,k})²`` per sample (see :func:`calibkernels.reference.brier_loss`)."""

    def __init__(self, reduction="mean", ignore_index=-100, backend="auto"):
        super().__init__()
        V.check_reduction(reduction)
        self.reduction, self.ignore_index = reduction, ignore_index
        self.backend = _check_reference_only_backend("brier_loss", backend)

    def forward(self, logits, target):
        return _reference.brier_loss(logits, target, reduction=self.reduction, ignore_index=self.ignore_index)

    def extra_repr(self):
        return f"reduction={self.reduction!r}"


class LabelSmoothingCE(nn.Module):
    """CE against ``(1 - α) e_y + α / C`` (the ``F.cross_entropy(label_smoothing=α)`` variant), α = 0.05."""

    def __init__(self, alpha=0.05, reduction="mean", ignore_index=-100, backend="auto"):
        super().__init__()
        self.backend = _check_reference_only_backend("label_smoothing", backend)
        V.check_reduction(reduction)
        if not 0.0 <= alpha <= 1.0:
            raise ValueError(f"label smoothing alpha must be in [0, 1], got {alpha}")
        self.alpha, self.reduction, self.ignore_index = float(alpha), reduction, ignore_index

    def forward(self, logits, target):
        return _reference.label_smoothing_loss(logits, target, alpha=self.alpha, reduction=self.reduction,
                                               ignore_index=self.ignore_index)

    def extra_repr(self):
        return f"alpha={self.alpha}, reduction={self.reduction!r}"


class MMCELoss(nn.Module):
    """CE + λ·MMCE (Kumar et al. 2018), λ = 2, Laplacian kernel of bandwidth 0.4 on max-probability confidence."""

    def __init__(self, lamda=2.0, weighted=False, bandwidth=0.4, reduction="mean", ignore_index=-100,
                 backend="auto"):
        super().__init__()
        self.backend = _check_reference_only_backend("mmce", backend)
        V.check_reduction(reduction)
        if reduction == "none":
            raise ValueError("MMCE is a batch-level loss: reduction='none' is not supported (use 'mean' or 'sum')")
        if not bandwidth > 0:
            raise ValueError(f"MMCE kernel bandwidth must be > 0, got {bandwidth}")
        self.lamda, self.weighted, self.bandwidth = float(lamda), bool(weighted), float(bandwidth)
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, logits, target):
        return _reference.mmce_loss(logits, target, lamda=self.lamda, weighted=self.weighted,
                                    bandwidth=self.bandwidth, reduction=self.reduction,
                                    ignore_index=self.ignore_index)

    def extra_repr(self):
        return (f"lamda={self.lamda}, weighted={self.weighted}, bandwidth={self.bandwidth}, "
                f"reduction={self.reduction!r}")


def _uwce(weight, mode, **defaults):
    def make(**hp):
        kwargs = dict(defaults)
        kwargs.update(hp)
        return UncertaintyWeightedCE(weight=weight, mode=mode, **kwargs)
    return make


# name -> factory(**hyperparameters); defaults as in SPEC §2.
REGISTRY = {
    "cross_entropy": _uwce("none", "grad"),
    "focal_loss": _uwce("focal", "loss", gamma=3.0),
    "focal_loss_gra": _uwce("focal", "grad", gamma=3.0),
    "flsd": _uwce("flsd", "loss", gamma=3.0),
    "flsd_gra": _uwce("flsd", "grad", gamma=3.0),
    "dual_focal_loss": _uwce("dual_focal", "loss", gamma=5.0),
    "dual_focal_loss_gra": _uwce("dual_focal", "grad", gamma=5.0),
    "bsce": _uwce("brier", "loss", gamma=4.0, norm=2.0),
    "bsce_gra": _uwce("brier", "grad", gamma=4.0, norm=2.0),
    "brier_loss": BrierLoss,
    "label_smoothing": LabelSmoothingCE,
    "mmce": lambda **hp: MMCELoss(weighted=False, **hp),
    "mmce_weighted": lambda **hp: MMCELoss(weighted=True, **hp),
}


def names() -> list[str]:
    """Every registry name accepted by :func:`build`."""
    return list(REGISTRY)


def build(name: str, **hyperparameters) -> nn.Module:
    """Build the loss module registered as ``name`` (SPEC §2), overriding its defaults with ``hyperparameters``.

    Unknown names raise ``ValueError``; unknown hyperparameters raise ``TypeError`` naming them.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown loss {name!r}; expected one of {', '.join(REGISTRY)}")
    try:
        return REGISTRY[name](**hyperparameters)
    except TypeError as exc:
        raise TypeError(f"loss {name!r}: {exc}") from exc
