"""``nn.Module`` losses and their registry (names follow the papers' reference code; formulas, defaults and the
registry table: ``docs/losses.md``).

Every registry name accepts exactly the hyper-parameters its loss uses: a name given one it ignores (``gamma`` for
``cross_entropy``, ``norm`` for ``focal_loss``) raises ``TypeError`` listing the accepted ones, and values out of range
(NaN, infinite, negative γ; a non-positive norm; MMCE's ``lam`` and ``bandwidth``) raise ``ValueError``.

>>> import calibkernels as ck
>>> criterion = ck.losses.build("bsce_gra", gamma=4.0, reduction="sum")
>>> criterion
UncertaintyWeightedCE(uncertainty='brier', mode='grad', gamma=4.0, norm=2.0, reduction='sum', backend='auto')
"""

from __future__ import annotations

from torch import nn

from . import more_losses
from . import reference as _reference
from ._drop_in_module import DropInOptions
from ._validation import (DUAL_FOCAL_SOFT_MESSAGE, check_backend, check_ignore_index, check_label_smoothing, check_mode,
                          check_norm, check_reduction, check_scalar_gamma, check_uncertainty, is_number)
from .functional import uncertainty_weighted_ce
from .loss_stats import check_return_stats
from .fused_linear import FusedLinearUncertaintyWeightedCE  # noqa: F401  (module form of the fused linear loss)
from .more_losses import AdaFocalLoss, MbLSLoss, MDCALoss, common_repr

__all__ = ["UncertaintyWeightedCE", "SoftTargetUncertaintyWeightedCE", "BrierLoss", "LabelSmoothingCE", "MMCELoss",
           "AdaptiveBSCEGRA", "AdaFocalLoss", "MDCALoss", "MbLSLoss", "build", "names", "REGISTRY"]


class UncertaintyWeightedCE(DropInOptions):
    """Module form of :func:`calibkernels.uncertainty_weighted_ce` (``L_i = u_i · CE_i``).

    ``forward(logits (..., C), target, sample_weight=None, gamma=None, mix_target=None, mix_lambda=None)``:
    ``target`` is ``(...)`` int64 class indices or a floating ``(..., C)`` probability tensor; ``sample_weight`` only
    with ``uncertainty="external"``; a per-sample ``gamma`` tensor only with ``uncertainty="focal"``; ``mix_target``
    (int64, the target's shape) and ``mix_lambda`` (a number or one per row) give
    ``t = λ e_target + (1 - λ) e_mix_target`` (mixup / cutmix). ``label_smoothing`` (α) smooths every target:
    ``t <- (1 - α) t + α / C`` (docs/losses.md, "Soft targets"); dual focal refuses soft targets.

    ``F.cross_entropy`` / Liger-Kernel options (docs/losses.md, "Coming from F.cross_entropy / Liger-Kernel"), passed
    to :func:`calibkernels.uncertainty_weighted_ce` on every call: ``weight``, the per-class ``(C,)`` weights
    (``L_i = u_i · CE_i^w``, ``F.cross_entropy``'s weighted mean), registered as a buffer as
    ``nn.CrossEntropyLoss`` does (``.to(device)`` moves it; in the state dict when given); ``lse_square_scale``, the
    z-loss ``s · lse_i²``; ``softcap``, logits ``c · tanh(z / c)`` first; ``return_z_loss=True``: ``forward``
    returns ``(loss, z_loss)``. With ``backend="auto"`` these run on the reference until the fused kernels take them
    (one ``RuntimeWarning``); a named fused backend raises ``NotImplementedError``.

    ``gra_detach="p_j"`` (``uncertainty="dual_focal"``, ``mode="grad"`` only) is the official BSCE-GRA code's
    ``DualFocalLossGra``, ``(1 - p_y + sg[p_j])^γ · CE``; the fused kernels implement the default ``"weight"``
    (``sg[u] · CE``) only, so this form runs the reference (``backend`` must be ``"auto"`` or ``"reference"``).

    ``return_stats=True``: ``forward`` returns ``(loss, stats)``, ``stats`` a :class:`calibkernels.LossStats` of the
    logits' top label per row (docs/metrics.md, "Monitor calibration while training"); with ``return_z_loss`` too,
    ``(loss, z_loss, stats)``.
    """

    def __init__(self, uncertainty="brier", mode="grad", gamma=4.0, norm=2.0, reduction="mean", ignore_index=-100,
                 backend="auto", inplace=False, label_smoothing=0.0, gra_detach="weight", *, weight=None,
                 return_stats=False, lse_square_scale=0.0, softcap=None, return_z_loss=False):
        super().__init__()
        self.return_stats = check_return_stats(return_stats)
        self._init_drop_in(weight, lse_square_scale, softcap, return_z_loss)
        check_uncertainty(uncertainty)
        check_mode(mode)
        # γ: a finite number ≥ 0; q: a finite number > 0 (NaN and ±inf are refused, not carried into the loss)
        gamma = check_scalar_gamma(
            gamma, "a module's gamma is a number; pass a per-sample gamma tensor to forward(..., gamma=...)")
        check_norm(norm)
        check_reduction(reduction)
        check_backend(backend)
        check_ignore_index(ignore_index)
        if not isinstance(inplace, bool):
            raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
        _reference.check_gra_detach(gra_detach, uncertainty=uncertainty, mode=mode)
        if gra_detach == "p_j" and backend not in ("auto", "reference"):
            raise ValueError(f"gra_detach='p_j' (the official DualFocalLossGra) has no fused kernel: use "
                             f"backend='auto' or 'reference', not {backend!r}")
        self.gra_detach = gra_detach
        label_smoothing = check_label_smoothing(label_smoothing)
        if uncertainty == "dual_focal" and label_smoothing != 0.0:
            raise ValueError(f"uncertainty='dual_focal' with label_smoothing={label_smoothing}: "
                             f"{DUAL_FOCAL_SOFT_MESSAGE}")
        self.uncertainty, self.mode, self.gamma, self.norm = uncertainty, mode, gamma, float(norm)
        self.reduction, self.ignore_index, self.backend, self.inplace = reduction, ignore_index, backend, inplace
        self.label_smoothing = label_smoothing

    def forward(self, logits, target, sample_weight=None, gamma=None, mix_target=None, mix_lambda=None):
        if self.gra_detach != "weight":
            return _reference.uncertainty_weighted_ce(
                logits, target, uncertainty=self.uncertainty, mode=self.mode,
                gamma=self.gamma if gamma is None else gamma,
                norm=self.norm, sample_weight=sample_weight, reduction=self.reduction,
                ignore_index=self.ignore_index, label_smoothing=self.label_smoothing, mix_target=mix_target,
                mix_lambda=mix_lambda, gra_detach=self.gra_detach, return_stats=self.return_stats,
                **self._drop_in_options())
        return uncertainty_weighted_ce(
            logits, target, uncertainty=self.uncertainty, mode=self.mode, gamma=self.gamma if gamma is None else gamma,
            norm=self.norm, sample_weight=sample_weight, reduction=self.reduction, ignore_index=self.ignore_index,
            backend=self.backend, inplace=self.inplace, label_smoothing=self.label_smoothing, mix_target=mix_target,
            mix_lambda=mix_lambda, return_stats=self.return_stats, **self._drop_in_options(),
        )

    def _weight_repr(self) -> list:
        """The uncertainty weight's part of :meth:`extra_repr` (uncertainty, mode and its hyperparameters)."""
        parts = [f"uncertainty={self.uncertainty!r}"]
        if self.uncertainty not in ("none", "external"):
            parts.append(f"mode={self.mode!r}")
        if self.uncertainty in ("focal", "flsd", "dual_focal", "brier", "brier_flsd"):
            parts.append(f"gamma={self.gamma}")
        if self.uncertainty in ("brier", "brier_flsd"):
            parts.append(f"norm={self.norm}")
        return parts

    def extra_repr(self):
        parts = self._weight_repr()
        if self.gra_detach != "weight":
            parts.append(f"gra_detach={self.gra_detach!r}")
        if self.label_smoothing:
            parts.append(f"label_smoothing={self.label_smoothing}")
        parts.append(common_repr(self.reduction, self.ignore_index, self.backend))
        if self.inplace:
            parts.append("inplace=True")
        parts += self._drop_in_repr()
        if self.return_stats:
            parts.append("return_stats=True")
        return ", ".join(parts)


class SoftTargetUncertaintyWeightedCE(UncertaintyWeightedCE):
    """Drop-in for timm's ``SoftTargetCrossEntropy``: ``forward(x (..., C), target (..., C))`` with dense
    probability targets (what ``timm.data.Mixup`` produces, smoothing included), returning
    ``mean_i u_i · (-Σ_k t_ik log p_ik)``; ``ignore_index`` applies to class-index targets only.
    ``uncertainty="none"`` is timm's loss; the default is BSCE-GRA (``uncertainty="brier"``, ``mode="grad"``, γ = 4,
    q = 2). Class-index targets are accepted too (an evaluation loader).
    Registry: ``soft_target_bsce_gra`` and ``soft_target_cross_entropy`` (docs/losses.md, "Soft targets").
    """

    def __init__(self, uncertainty="brier", mode="grad", gamma=4.0, norm=2.0, reduction="mean", ignore_index=-100,
                 backend="auto", label_smoothing=0.0, *, weight=None, return_stats=False, lse_square_scale=0.0,
                 softcap=None, return_z_loss=False):
        super().__init__(uncertainty=uncertainty, mode=mode, gamma=gamma, norm=norm, reduction=reduction,
                         ignore_index=ignore_index, backend=backend, label_smoothing=label_smoothing, weight=weight,
                         return_stats=return_stats, lse_square_scale=lse_square_scale, softcap=softcap,
                         return_z_loss=return_z_loss)

    def forward(self, x, target):
        return super().forward(x, target)


class AdaptiveBSCEGRA(UncertaintyWeightedCE):
    """BSCE-GRA with the official BSCE-GRA code's adaptive exponent (``BSCELossAdaptiveGra``), registry name
    ``bsce_adaptive_gra``: ``sg[‖p - t‖_q^{γ_i}] · CE`` with γ_i = 5 where the target's probability (``<t, p>`` for
    soft targets) is below 0.2, 3 below 0.5, else ``gamma`` (FLSD-53's bands, decided as for ``uncertainty="flsd"``).

    The fused op's ``uncertainty="brier_flsd"`` in grad mode: each kernel picks γ_i from the row statistics it already
    has, so the loss costs what BSCE-GRA costs. Reference: :func:`calibkernels.more_losses.bsce_adaptive_gra_loss`.
    """

    def __init__(self, gamma=3.0, norm=2.0, reduction="mean", ignore_index=-100, backend="auto", inplace=False,
                 label_smoothing=0.0, return_stats=False, *, weight=None, lse_square_scale=0.0, softcap=None,
                 return_z_loss=False):
        super().__init__(uncertainty="brier_flsd", mode="grad", gamma=gamma, norm=norm, reduction=reduction,
                         ignore_index=ignore_index, backend=backend, inplace=inplace, label_smoothing=label_smoothing,
                         return_stats=return_stats, weight=weight, lse_square_scale=lse_square_scale,
                         softcap=softcap, return_z_loss=return_z_loss)

    def _weight_repr(self) -> list:
        return [f"gamma={self.gamma} (where <t, p> >= 0.5; 5 below 0.2, 3 below 0.5)", f"norm={self.norm}"]


def _check_reference_only_backend(loss_name, backend):
    """Losses without a fused kernel run the reference; naming a kernel backend for them is an error, not a fallback."""
    check_backend(backend)
    if backend not in ("auto", "reference"):
        raise ValueError(f"{loss_name} has no fused kernel: use backend='auto' or 'reference', not {backend!r}")
    return backend


class BrierLoss(nn.Module):
    """Brier loss ``Σ_k (p_k - e_{y,k})²`` per sample (see :func:`calibkernels.reference.brier_loss`)."""

    def __init__(self, reduction="mean", ignore_index=-100, backend="auto"):
        super().__init__()
        check_reduction(reduction)
        check_ignore_index(ignore_index)
        self.reduction, self.ignore_index = reduction, ignore_index
        self.backend = _check_reference_only_backend("brier_loss", backend)

    def forward(self, logits, target):
        return _reference.brier_loss(logits, target, reduction=self.reduction, ignore_index=self.ignore_index)

    def extra_repr(self):
        return common_repr(self.reduction, self.ignore_index)


class LabelSmoothingCE(nn.Module):
    """CE against ``(1 - α) e_y + α / C`` (the ``F.cross_entropy(label_smoothing=α)`` variant), α = 0.05."""

    def __init__(self, alpha=0.05, reduction="mean", ignore_index=-100, backend="auto"):
        super().__init__()
        self.backend = _check_reference_only_backend("label_smoothing", backend)
        check_reduction(reduction)
        check_ignore_index(ignore_index)
        if not is_number(alpha):
            raise TypeError(f"label smoothing alpha must be a number in [0, 1], got {type(alpha).__name__}")
        if not 0.0 <= alpha <= 1.0:  # also refuses NaN
            raise ValueError(f"label smoothing alpha must be in [0, 1], got {alpha}")
        self.alpha, self.reduction, self.ignore_index = float(alpha), reduction, ignore_index

    def forward(self, logits, target):
        return _reference.label_smoothing_loss(logits, target, alpha=self.alpha, reduction=self.reduction,
                                               ignore_index=self.ignore_index)

    def extra_repr(self):
        return f"alpha={self.alpha}, {common_repr(self.reduction, self.ignore_index)}"


class MMCELoss(nn.Module):
    """CE + λ·MMCE (Kumar et al. 2018), λ = ``lam`` = 2, Laplacian kernel of bandwidth 0.4 on max-probability
    confidence (:func:`calibkernels.reference.mmce_loss`). ``lam`` must be finite and ≥ 0, ``bandwidth`` finite
    and > 0. ``form="kumar"`` (default: Kumar et al.'s definitions, with the square root) or ``"papers_code"`` (the
    focal-loss / BSCE-GRA code's ``MMCE`` without the square root and ``MMCE_weighted`` normalised by about
    n₁⁴, n₀⁴, (n₁n₀)²; λ = 2 was tuned on it, use it to reproduce published numbers)."""

    def __init__(self, lam=2.0, weighted=False, bandwidth=0.4, reduction="mean", ignore_index=-100,
                 backend="auto", form="kumar"):
        super().__init__()
        self.form = _reference.check_mmce_form(form)
        self.backend = _check_reference_only_backend("mmce", backend)
        check_reduction(reduction)
        if reduction == "none":
            raise ValueError("MMCE is a batch-level loss: reduction='none' is not supported (use 'mean' or 'sum')")
        check_ignore_index(ignore_index)
        _reference.check_mmce_hyperparameters(lam=lam, bandwidth=bandwidth)
        self.lam, self.weighted, self.bandwidth = float(lam), bool(weighted), float(bandwidth)
        self.reduction, self.ignore_index = reduction, ignore_index

    def forward(self, logits, target):
        return _reference.mmce_loss(logits, target, lam=self.lam, weighted=self.weighted,
                                    bandwidth=self.bandwidth, reduction=self.reduction,
                                    ignore_index=self.ignore_index, form=self.form)

    def extra_repr(self):
        form = f", form={self.form!r}" if self.form != "kumar" else ""
        return (f"lam={self.lam}, weighted={self.weighted}, bandwidth={self.bandwidth}{form}, "
                f"{common_repr(self.reduction, self.ignore_index)}")


class _Factory:
    """A registry entry: builds its module from exactly the hyper-parameters in ``accepted`` (over ``defaults``)."""

    def __init__(self, make, accepted, **defaults):
        self.make, self.accepted, self.defaults = make, tuple(accepted), defaults

    def __call__(self, **hyperparameters):
        unused = [key for key in hyperparameters if key not in self.accepted]
        if unused:
            raise TypeError(f"got unexpected hyper-parameter(s) {', '.join(map(repr, unused))}; "
                            f"it accepts only the ones its loss uses: {', '.join(self.accepted)}")
        return self.make(**{**self.defaults, **hyperparameters})

    def __repr__(self):
        return f"<loss factory accepting {', '.join(self.accepted)}>"


_COMMON = ("reduction", "ignore_index", "backend")  # every loss
# losses with a fused kernel (UncertaintyWeightedCE); return_stats: forward returns (loss, stats)
_FUSED = _COMMON + ("inplace", "label_smoothing", "return_stats")


def _uwce(uncertainty, mode, extra=(), **defaults):
    def make(**hp):
        return UncertaintyWeightedCE(uncertainty=uncertainty, mode=mode, **hp)
    return _Factory(make, tuple(defaults) + tuple(extra) + _FUSED, **defaults)


def _soft_target(uncertainty, mode, **defaults):
    def make(**hp):
        return SoftTargetUncertaintyWeightedCE(uncertainty=uncertainty, mode=mode, **hp)
    return _Factory(make, tuple(defaults) + _COMMON + ("label_smoothing", "return_stats"), **defaults)


def _mmce(weighted):
    return _Factory(lambda **hp: MMCELoss(weighted=weighted, **hp), ("lam", "bandwidth", "form") + _COMMON)


# Losses MDCA may be added to: those of (logits, class indices) that take the same reduction (not MDCA itself, the
# soft-target drop-ins, or AdaFocal, whose validation update the sum would hide).
_MDCA_NO_BASE = ("mdca", "adafocal", "soft_target_cross_entropy", "soft_target_bsce_gra")


class _MDCAFactory(_Factory):
    """``mdca``: ``beta``, ``base`` (a registry name, default ``cross_entropy``) and the common keywords; any other
    keyword is a hyper-parameter of the base (``mdca:base=focal_loss:gamma=1`` is the official FL+MDCA)."""

    def __init__(self):
        super().__init__(None, ("beta", "base") + _COMMON, beta=1.0, base="cross_entropy")

    def __call__(self, **hyperparameters):
        own = {**self.defaults, **{k: v for k, v in hyperparameters.items() if k in self.accepted}}
        base_name = own.pop("base")
        if not isinstance(base_name, str) or base_name not in REGISTRY or base_name in _MDCA_NO_BASE:
            raise ValueError(f"base must be a registry name other than {', '.join(_MDCA_NO_BASE)}, got {base_name!r}")
        base_hyperparameters = {k: v for k, v in hyperparameters.items() if k not in self.accepted}
        if base_hyperparameters.get("inplace"):
            raise ValueError("mdca reads the logits after its base loss: inplace=True is not supported")
        if base_hyperparameters.get("return_stats"):
            raise ValueError("mdca adds a term to its base loss and returns the loss alone: return_stats=True is not "
                             "supported")
        common = {k: own[k] for k in _COMMON if k in own}
        try:
            base = REGISTRY[base_name](**common, **base_hyperparameters)
        except TypeError as exc:
            raise TypeError(f"{exc}; mdca itself accepts {', '.join(self.accepted)}") from exc
        return MDCALoss(base=None if base_name == "cross_entropy" and not base_hyperparameters else base, **own)


# name -> factory(**hyperparameters), accepting exactly the hyper-parameters its loss uses; defaults as in
# docs/losses.md ("Registry names").
REGISTRY = {
    "cross_entropy": _uwce("none", "grad"),
    "focal_loss": _uwce("focal", "loss", gamma=3.0),
    "focal_loss_gra": _uwce("focal", "grad", gamma=3.0),
    "flsd": _uwce("flsd", "loss", gamma=3.0),
    "flsd_gra": _uwce("flsd", "grad", gamma=3.0),
    "dual_focal_loss": _uwce("dual_focal", "loss", gamma=5.0),
    "dual_focal_loss_gra": _uwce("dual_focal", "grad", extra=("gra_detach",), gamma=5.0),
    "bsce": _uwce("brier", "loss", gamma=4.0, norm=2.0),
    "bsce_gra": _uwce("brier", "grad", gamma=4.0, norm=2.0),
    "brier_loss": _Factory(BrierLoss, _COMMON),
    "label_smoothing": _Factory(LabelSmoothingCE, ("alpha",) + _COMMON),
    "mmce": _mmce(weighted=False),
    "mmce_weighted": _mmce(weighted=True),
    "soft_target_cross_entropy": _soft_target("none", "grad"),
    "soft_target_bsce_gra": _soft_target("brier", "grad", gamma=4.0, norm=2.0),
    # the losses beyond the fused family (calibkernels/more_losses.py; docs/losses.md, "More losses")
    "bsce_adaptive_gra": _Factory(AdaptiveBSCEGRA, ("gamma", "norm") + _FUSED, gamma=3.0, norm=2.0),
    "adafocal": _Factory(AdaFocalLoss, tuple(more_losses.ADAFOCAL_DEFAULTS) + _COMMON),
    "mdca": _MDCAFactory(),
    "mbls": _Factory(MbLSLoss, ("margin", "lam") + _COMMON),
}


def names() -> list[str]:
    """Every registry name accepted by :func:`build`."""
    return list(REGISTRY)


def build(name: str, **hyperparameters) -> nn.Module:
    """Build the loss module registered as ``name``, overriding its defaults with ``hyperparameters``.

    Registry names, the hyper-parameters each accepts and their defaults: ``docs/losses.md`` ("Registry names").
    An unknown name raises ``ValueError``; a hyper-parameter the loss does not use raises ``TypeError`` listing the
    accepted ones; a value out of range raises ``ValueError``.
    """
    if name not in REGISTRY:
        raise ValueError(f"unknown loss {name!r}; expected one of {', '.join(REGISTRY)}")
    try:
        return REGISTRY[name](**hyperparameters)
    except TypeError as exc:
        raise TypeError(f"loss {name!r}: {exc}") from exc

