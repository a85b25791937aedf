"""The losses beyond the fused family ("More losses"): BSCE-GRA with the official code's adaptive exponent, AdaFocal,
MDCA and MbLS (formulas, defaults and sources: ``docs/losses.md``, "More losses").

Each loss has a readable reference function (pure PyTorch, any device and dtype, gradients by autograd) and a module
that runs the fused kernel wherever the loss is a per-sample weight on cross-entropy:

* ``bsce_adaptive_gra`` (:func:`bsce_adaptive_gra_loss`; the module is ``calibkernels.losses.AdaptiveBSCEGRA``, the
  fused op's ``uncertainty="brier_flsd"``): ``sg[‖p - e_y‖_q^{γ_i}] · CE`` with γ_i = 5 / 3 / γ for p_y < 0.2 / < 0.5 /
  otherwise (the official BSCE-GRA code's ``BSCELossAdaptiveGra``).
* ``adafocal`` (:class:`AdaFocalLoss`): ``-(1 - p_y)^{γ_b} log p_y``, or ``-(1 + p_y)^{|γ_b|} log p_y`` when
  γ_b < 0, with γ_b the exponent of the sample's p_y bin, updated from the validation set's calibration.
* ``mdca`` (:class:`MDCALoss`): a base loss + β · (1/C) Σ_j |mean_i p_ij - mean_i 1[y_i = j]|.
* ``mbls`` (:class:`MbLSLoss`): CE + λ · (1/C) Σ_k max(0, max_j z_j - z_k - m).

Rows whose target equals ``ignore_index`` contribute nothing, to MDCA's batch term neither; ``"mean"`` averages
over the other rows. The batch-level MDCA term follows the MMCE convention of :mod:`calibkernels.reference`:
``reduction="sum"`` adds ``β · m · MDCA`` (``m`` non-ignored rows), so a summed recipe keeps the balance of the mean
form.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ._row_math import flsd_gamma, masked_rows, reduce_rows
from ._validation import (check_backend, check_ignore_index, check_logits_target, check_norm, check_number,
                          check_reduction, check_scalar_gamma)
from .functional import uncertainty_weighted_ce
from ._validation.metric_inputs import check_n_bins, prepare
from .metrics.binned import bin_sums, confidence_and_correct, equal_count_edges
from .reference import uncertainty_weight

__all__ = [
    "ADAFOCAL_DEFAULTS",
    "AdaFocalLoss",
    "MDCALoss",
    "MbLSLoss",
    "adafocal_bins_from_validation",
    "adafocal_loss",
    "adafocal_next_gamma",
    "bsce_adaptive_gamma",
    "bsce_adaptive_gra_loss",
    "mbls_loss",
    "mbls_penalty",
    "mdca",
    "mdca_loss",
]


def _rows(logits, target, ignore_index, check_values=True):
    """``(valid (N,), z (N, C) in the compute dtype with ignored rows zeroed, safe target (N,), batch shape)``."""
    logits2d, target1d, batch_shape = check_logits_target(logits, target, ignore_index=ignore_index,
                                                          check_values=check_values)
    valid, z, safe = masked_rows(logits2d, target1d, ignore_index)
    if not check_values:  # unchecked targets never index out of range here; the fused op reports them
        safe = safe.clamp(0, z.shape[1] - 1)
    return valid, z, safe, batch_shape


def _cross_entropy_rows(z, safe):
    # -log_softmax (the row max subtracted first), as the reference: logsumexp(z) - z_y carries an ulp of the logits
    return -torch.log_softmax(z, dim=1).gather(1, safe[:, None]).squeeze(1)


def _check_reduction(reduction, backend, ignore_index, *, batch_level=False, name="this loss"):
    check_reduction(reduction)
    check_backend(backend)
    check_ignore_index(ignore_index)
    if batch_level and reduction == "none":
        raise ValueError(f"{name} has a batch-level term: reduction='none' is not supported (use 'mean' or 'sum')")


def common_repr(reduction, ignore_index, backend=None) -> str:
    """The loss modules' shared ``extra_repr`` tail: the reduction, ``ignore_index`` where it is not -100, the
    backend where given."""
    parts = [f"reduction={reduction!r}"]
    if ignore_index != -100:
        parts.append(f"ignore_index={ignore_index}")
    if backend is not None:
        parts.append(f"backend={backend!r}")
    return ", ".join(parts)


# ---------------------------------------------------------------------------------------------------------------------
# BSCE-GRA with the official code's adaptive exponent (BSCELossAdaptiveGra)
# ---------------------------------------------------------------------------------------------------------------------
def bsce_adaptive_gamma(z, target, gamma):
    """γ_i ``(N,)`` of ``bsce_adaptive_gra`` for logits ``z (N, C)`` and in-range targets: 5 if p_y < 0.2, 3 if
    p_y < 0.5, else ``gamma``; p_y and the thresholds compared in float32, the rule FLSD-53 uses everywhere
    (:func:`calibkernels._row_math.flsd_gamma`). Never differentiated."""
    return flsd_gamma(z, target, gamma)


def _adaptive_brier_weight(z, safe, gamma, norm):
    """``sg[‖p - e_y‖_q^{γ_i}]`` per row of ``z`` (compute dtype), in the log domain like every Brier weight."""
    z = z.detach()
    return uncertainty_weight(z, safe, uncertainty="brier", gamma=bsce_adaptive_gamma(z, safe, gamma), norm=norm)


def _check_gamma_norm(gamma, norm):
    gamma = check_scalar_gamma(
        gamma, "bsce_adaptive_gra chooses γ_i itself: gamma is the number used where p_y >= 0.5")
    check_norm(norm)
    return gamma, float(norm)


def bsce_adaptive_gra_loss(logits, target, *, gamma=3.0, norm=2.0, reduction="mean", ignore_index=-100):
    """Reference of ``bsce_adaptive_gra``: ``L_i = sg[‖p_i - e_{y_i}‖_q^{γ_i}] · CE_i`` (gradient
    ``‖p_i - e_{y_i}‖_q^{γ_i} (p_i - e_{y_i})``), γ_i = 5 if p_y < 0.2, 3 if 0.2 <= p_y < 0.5, else ``gamma``.

    The official BSCE-GRA code's ``BSCELossAdaptiveGra``: the FLSD-53 exponent schedule on the generalised Brier
    weight, which is detached (GRA). Class-index targets only. Written apart from the fused op's
    ``uncertainty="brier_flsd"`` (``calibkernels.losses.AdaptiveBSCEGRA``), which the tests check against it.
    """
    gamma, norm = _check_gamma_norm(gamma, norm)
    check_reduction(reduction)
    valid, z, safe, batch_shape = _rows(logits, target, ignore_index)
    per_row = _adaptive_brier_weight(z, safe, gamma, norm) * _cross_entropy_rows(z, safe)
    return reduce_rows(per_row, valid, reduction, batch_shape, logits.dtype)


# ---------------------------------------------------------------------------------------------------------------------
# AdaFocal (Ghosh, Schaaf & Gormley, NeurIPS 2022)
# ---------------------------------------------------------------------------------------------------------------------
# The official code's defaults (3mcloud/adafocal main.py).
ADAFOCAL_DEFAULTS = {"n_bins": 15, "lam": 1.0, "gamma_initial": 1.0, "gamma_max": 20.0, "gamma_min": -2.0,
                     "switch_point": 0.2}


def _target_probability(z, safe):
    """``p_y = exp(z_y - logsumexp(z))`` per row, detached, in the compute dtype of ``z``."""
    z = z.detach()
    return torch.exp(z.gather(1, safe[:, None]).squeeze(1) - torch.logsumexp(z, dim=1))


def _check_adafocal_gamma(gamma, target, z):
    """``gamma`` of :func:`adafocal_loss` flattened to ``(N,)`` in the dtype of ``z``, detached. As the fused op's
    per-sample γ (docs/losses.md, 'Input checks'): ``TypeError`` unless a floating tensor, ``ValueError`` for another
    shape or device, or a value that is not finite (any sign is allowed here: negative is inverse focal)."""
    if not isinstance(gamma, torch.Tensor):
        raise TypeError(f"gamma must be a tensor of the target's shape {tuple(target.shape)}, got "
                        f"{type(gamma).__name__}")
    if not gamma.is_floating_point():
        raise TypeError(f"a per-sample gamma tensor must be floating point, got {gamma.dtype}")
    if tuple(gamma.shape) != tuple(target.shape):
        raise ValueError(f"gamma shape {tuple(gamma.shape)} does not match the target's shape {tuple(target.shape)}")
    if gamma.device != z.device:
        raise ValueError(f"gamma is on {gamma.device} but logits are on {z.device}")
    gamma = gamma.detach().reshape(-1).to(z.dtype)
    if not bool(gamma.isfinite().all()):
        # NaN would make the loss NaN, +inf the focal weight 0 and -inf the inverse-focal weight inf
        raise ValueError(f"gamma must be finite, got {float(gamma[~gamma.isfinite()][0])} (row "
                         f"{int((~gamma.isfinite()).nonzero()[0, 0])} of the flattened target)")
    return gamma


def adafocal_loss(logits, target, gamma, *, reduction="mean", ignore_index=-100):
    """Reference of the AdaFocal loss with per-sample exponents ``gamma`` (a finite floating tensor of the target's
    shape, any sign):

    ``L_i = -(1 - p_y)^{γ_i} log p_y`` where γ_i >= 0 (focal), ``-(1 + p_y)^{|γ_i|} log p_y`` where γ_i < 0
    (inverse focal), differentiated through the weight (loss mode); ``gamma`` gets no gradient.
    """
    check_reduction(reduction)
    valid, z, safe, batch_shape = _rows(logits, target, ignore_index)
    gamma = _check_adafocal_gamma(gamma, target, z)
    ce = _cross_entropy_rows(z, safe)
    focal = uncertainty_weight(z, safe, uncertainty="focal", gamma=gamma.clamp_min(0), norm=2.0)
    inverse = torch.exp(gamma.abs() * torch.log1p(torch.exp(-ce)))  # (1 + p_y)^{|γ|}, p_y = exp(-CE)
    per_row = torch.where(gamma < 0, inverse, focal) * ce
    return reduce_rows(per_row, valid, reduction, batch_shape, logits.dtype)


def adafocal_next_gamma(gamma, gap, *, lam, switch_point, gamma_min, gamma_max):
    """One AdaFocal update of the per-bin exponents (float64 tensors ``(B,)``), as the official code does it:

    ``γ' = γ · exp(λ · gap)`` if ``γ > 0``, else ``γ · exp(-λ · gap)``, with ``gap`` = mean confidence - accuracy of
    the bin on the validation set; then, if ``|γ'| < switch_point``, γ' jumps to ``-switch_point`` (from above 0) or
    ``+switch_point`` (from 0 or below): the switch between focal and inverse focal; finally γ' is clipped to
    ``[gamma_min, gamma_max]``.
    """
    updated = torch.where(gamma > 0, gamma * torch.exp(lam * gap), gamma * torch.exp(-lam * gap))
    switched = torch.where(updated > 0, -switch_point, switch_point)
    updated = torch.where(updated.abs() < switch_point, switched, updated)
    return updated.clamp(gamma_min, gamma_max)


def adafocal_bins_from_validation(val_inputs, val_labels, n_bins, *, inputs_are="auto", ignore_index=-100):
    """``(edges (B+1,), gap (B,))`` float64: the equal-count bins of the validation confidences (max probability;
    the AdaECE edges of Mukhoti et al.'s code, :func:`calibkernels.metrics.equal_count_edges`, kept in float64) and
    each bin's ``mean confidence - accuracy`` over its ``(lo, hi]`` members (0 for an empty bin), membership compared
    in the confidences' dtype as the official code does (a unique minimum confidence falls in no bin)."""
    check_n_bins(n_bins)
    prepared = prepare(val_inputs, val_labels, inputs_are, ignore_index)
    confidence, correct = confidence_and_correct(prepared)
    edges = equal_count_edges(confidence.to(torch.float64), n_bins)
    count, confidence_sum, correct_sum = bin_sums(confidence, correct, edges)
    safe = count.clamp_min(1)
    gap = torch.where(count > 0, confidence_sum / safe - correct_sum / safe, 0.0)
    return edges.cpu(), gap.cpu()


class AdaFocalLoss(nn.Module):
    """AdaFocal (Ghosh, Schaaf & Gormley, NeurIPS 2022): focal loss whose exponent γ_b is kept per confidence bin and
    updated from the validation set's calibration; negative γ_b means the inverse-focal loss.

    ``forward(logits, target)``: each sample takes the γ_b of the bin its ``p_y`` (target probability) falls in:
    ``[e_b, e_{b+1})``, the first bin open below and the last open above, compared in float64 (bins start as
    ``n_bins`` equal-width ones on [0, 1] and become the validation's equal-count bins). With every γ_b >= 0 the loss
    is the fused focal kernel with that per-sample γ (``mode="loss"``); rows with γ_b < 0 take
    ``-(1 + p_y)^{|γ_b|} log p_y`` in PyTorch (:func:`adafocal_loss` is the reference, ``backend="reference"``).

    ``update(val_logits, val_labels)`` runs one AdaFocal step (:func:`adafocal_bins_from_validation`,
    :func:`adafocal_next_gamma`): call it once per epoch (the official code's default) with the whole validation
    split, the same on every DDP rank (gather first). ``gamma`` and ``edges`` hold the current table; the state is
    part of ``state_dict()`` (checkpoints resume it).
    """

    def __init__(self, n_bins=15, lam=1.0, gamma_initial=1.0, gamma_max=20.0, gamma_min=-2.0, switch_point=0.2,
                 reduction="mean", ignore_index=-100, backend="auto"):
        super().__init__()
        self.n_bins = check_n_bins(n_bins)
        self.lam = check_number("lam", lam)
        self.gamma_max = check_number("gamma_max", gamma_max, minimum=None)
        self.gamma_min = check_number("gamma_min", gamma_min, minimum=None)
        self.switch_point = check_number("switch_point", switch_point)
        self.gamma_initial = check_number("gamma_initial", gamma_initial, minimum=None)
        if not self.gamma_min <= self.gamma_initial <= self.gamma_max:
            raise ValueError(f"need gamma_min <= gamma_initial <= gamma_max, got {gamma_min}, {gamma_initial}, "
                             f"{gamma_max}")
        _check_reduction(reduction, backend, ignore_index)
        self.reduction, self.ignore_index, self.backend = reduction, ignore_index, backend
        self.gamma = torch.full((self.n_bins,), self.gamma_initial, dtype=torch.float64)
        self.edges = torch.arange(self.n_bins + 1, dtype=torch.float64) * (1.0 / self.n_bins)  # b · (1/B)
        self.updates = 0

    # ---------------------------------------------------------------------------------------------- the γ table
    @torch.no_grad()
    def update(self, val_logits, val_labels, *, inputs_are="auto"):
        """One AdaFocal step from the validation split's logits (or probabilities) and labels; returns the new γ."""
        edges, gap = adafocal_bins_from_validation(val_logits, val_labels, self.n_bins, inputs_are=inputs_are,
                                                   ignore_index=self.ignore_index)
        self.gamma = adafocal_next_gamma(self.gamma, gap, lam=self.lam, switch_point=self.switch_point,
                                         gamma_min=self.gamma_min, gamma_max=self.gamma_max)
        self.edges = edges
        self.updates += 1
        return self.gamma.clone()

    def sample_gamma(self, logits, target):
        """γ of each sample (the target's shape, float64, detached): the γ_b of the bin of its ``p_y``."""
        with torch.no_grad():
            valid, z, safe, _ = _rows(logits, target, self.ignore_index, check_values=False)
            p_target = _target_probability(z, safe).to(torch.float64)
            inner = self.edges[1:-1].to(p_target.device)
            index = torch.bucketize(p_target, inner, right=True)
            return self.gamma.to(p_target.device)[index].reshape(target.shape)

    def get_extra_state(self):
        return {"gamma": self.gamma.tolist(), "edges": self.edges.tolist(), "updates": self.updates}

    def set_extra_state(self, state):
        gamma = torch.tensor(state["gamma"], dtype=torch.float64)
        edges = torch.tensor(state["edges"], dtype=torch.float64)
        if gamma.shape != (self.n_bins,) or edges.shape != (self.n_bins + 1,):
            raise ValueError(f"AdaFocal state has {gamma.numel()} bins, this loss {self.n_bins}")
        # a table that update() could not have produced would silently give NaN losses or misplaced bins
        if not bool(gamma.isfinite().all()) or not bool(edges.isfinite().all()):
            raise ValueError("AdaFocal state has a non-finite gamma or edge")
        if not bool((edges[1:] >= edges[:-1]).all()):
            raise ValueError("AdaFocal state has edges that are not sorted")
        self.gamma, self.edges, self.updates = gamma, edges, int(state.get("updates", 0))

    # ---------------------------------------------------------------------------------------------- the loss
    def forward(self, logits, target):
        gamma = self.sample_gamma(logits, target)
        if self.backend == "reference":
            return adafocal_loss(logits, target, gamma, reduction=self.reduction, ignore_index=self.ignore_index)
        if bool((self.gamma >= 0).all()):  # the table lives on the host: no device synchronisation
            return uncertainty_weighted_ce(
                logits, target, uncertainty="focal", mode="loss", gamma=gamma.to(torch.float32),
                reduction=self.reduction, ignore_index=self.ignore_index, backend=self.backend)
        focal = uncertainty_weighted_ce(
            logits, target, uncertainty="focal", mode="loss", gamma=gamma.clamp_min(0).to(torch.float32),
            reduction="none", ignore_index=self.ignore_index, backend=self.backend)
        valid, z, safe, batch_shape = _rows(logits, target, self.ignore_index, check_values=False)
        ce = _cross_entropy_rows(z, safe)
        magnitude = gamma.reshape(-1).abs().to(z.dtype)
        inverse = torch.exp(magnitude * torch.log1p(torch.exp(-ce))) * ce
        per_row = torch.where(gamma.reshape(-1) < 0, inverse, focal.reshape(-1).to(z.dtype))
        return reduce_rows(per_row, valid, self.reduction, batch_shape, logits.dtype)

    def extra_repr(self):
        return (f"n_bins={self.n_bins}, lam={self.lam}, gamma_initial={self.gamma_initial}, "
                f"gamma_min={self.gamma_min}, gamma_max={self.gamma_max}, switch_point={self.switch_point}, "
                f"updates={self.updates}, {common_repr(self.reduction, self.ignore_index, self.backend)}")


# ---------------------------------------------------------------------------------------------------------------------
# MDCA (Hebbalaguppe, Prakash, Madan & Arora, CVPR 2022)
# ---------------------------------------------------------------------------------------------------------------------
def _mdca_of_rows(z, safe, valid):
    """``(MDCA, m)`` of the valid rows of ``z (N, C)`` (compute dtype; 0 when no row is valid)."""
    keep = valid[:, None].to(z.dtype)
    confidence_sum = (torch.softmax(z, dim=1) * keep).sum(0)
    count = (F.one_hot(safe, z.shape[1]).to(z.dtype) * keep).sum(0)
    m = valid.sum()
    return (confidence_sum - count).abs().sum() / (m.clamp_min(1) * z.shape[1]), m


def mdca(logits, target, *, ignore_index=-100):
    """Multi-class difference in confidence and accuracy of a batch: ``(1/C) Σ_j |mean_i p_ij - mean_i 1[y_i = j]|``
    over the non-ignored rows (0 if none), differentiable through ``p``; in the logits' dtype."""
    valid, z, safe, _ = _rows(logits, target, ignore_index)
    return _mdca_of_rows(z, safe, valid)[0].to(logits.dtype)


def _with_batch_term(base_value, term, m, scale, reduction, dtype):
    """``base + scale · term`` (``· m`` for the sum reduction: the MMCE convention)."""
    if reduction == "sum":
        term = term * m
    return (base_value.to(term.dtype) + scale * term).to(dtype)


def mdca_loss(logits, target, *, beta=1.0, reduction="mean", ignore_index=-100):
    """Reference of ``mdca`` with its default base: ``CE + β · MDCA`` (``"sum"``: ``Σ CE + β · m · MDCA``)."""
    beta = check_number("beta", beta)
    _check_reduction(reduction, "reference", ignore_index, batch_level=True, name="mdca")
    valid, z, safe, batch_shape = _rows(logits, target, ignore_index)
    ce = reduce_rows(_cross_entropy_rows(z, safe), valid, reduction, batch_shape, z.dtype)
    term, m = _mdca_of_rows(z, safe, valid)
    return _with_batch_term(ce, term, m, beta, reduction, logits.dtype)


class MDCALoss(nn.Module):
    """``base(logits, target) + β · MDCA`` (:func:`mdca`); the base is cross-entropy through the fused op unless
    another loss module is given (the registry name ``mdca`` builds it from ``base="focal_loss"`` and the like, with
    the same reduction, ``ignore_index`` and backend). ``reduction`` must be ``"mean"`` or ``"sum"`` (``"sum"`` adds
    ``β · m · MDCA``, m the non-ignored rows). β defaults to 1, the official scripts' value for NLL+MDCA and
    FL+MDCA."""

    def __init__(self, beta=1.0, base=None, reduction="mean", ignore_index=-100, backend="auto"):
        super().__init__()
        self.beta = check_number("beta", beta)
        _check_reduction(reduction, backend, ignore_index, batch_level=True, name="mdca")
        if base is not None and not isinstance(base, nn.Module):
            raise TypeError(f"base must be an nn.Module (a loss), got {type(base).__name__}")
        for name, value in (("reduction", reduction), ("ignore_index", ignore_index)):
            # the base and the MDCA term must reduce the same rows the same way, or their sum mixes two losses
            if base is not None and hasattr(base, name) and getattr(base, name) != value:
                raise ValueError(f"MDCALoss: the base loss has {name}={getattr(base, name)!r} and MDCA "
                                 f"{name}={value!r}; build the base with the same {name} (or use "
                                 f"ck.losses.build('mdca', base=..., {name}=...))")
        self.reduction, self.ignore_index, self.backend = reduction, ignore_index, backend
        self.base = base

    def forward(self, logits, target):
        valid, z, safe, _ = _rows(logits, target, self.ignore_index, check_values=False)
        if self.base is None:
            base_value = uncertainty_weighted_ce(logits, target, uncertainty="none", reduction=self.reduction,
                                                 ignore_index=self.ignore_index, backend=self.backend)
        else:
            base_value = self.base(logits, target)
        term, m = _mdca_of_rows(z, safe, valid)
        return _with_batch_term(base_value, term, m, self.beta, self.reduction, logits.dtype)

    def extra_repr(self):
        return f"beta={self.beta}, {common_repr(self.reduction, self.ignore_index, self.backend)}"


# ---------------------------------------------------------------------------------------------------------------------
# MbLS: margin-based label smoothing (Liu, Ben Ayed, Galdran & Dolz, CVPR 2022)
# ---------------------------------------------------------------------------------------------------------------------
def mbls_penalty(z, margin):
    """``(1/C) Σ_k max(0, max_j z_j - z_k - m)`` per row of ``z (N, C)``: the official code's ``LogitMarginL1``
    penalty (``relu(d - m).mean()`` over the batch's N x C logit distances, i.e. a mean over the classes). A masked
    class (a -inf logit) adds 0: it has no margin to keep, and its infinite distance would make the loss infinite."""
    gap = z.amax(dim=1, keepdim=True) - z - margin
    return F.relu(gap.masked_fill(z == float("-inf"), 0.0)).mean(dim=1)


def _check_mbls(margin, lam):
    return check_number("margin", margin), check_number("lam", lam)


def mbls_loss(logits, target, *, margin=10.0, lam=0.1, reduction="mean", ignore_index=-100):
    """Reference of ``mbls``: ``L_i = CE_i + λ · (1/C) Σ_k max(0, max_j z_ij - z_ik - m)`` (m = 10, λ = 0.1)."""
    margin, lam = _check_mbls(margin, lam)
    check_reduction(reduction)
    valid, z, safe, batch_shape = _rows(logits, target, ignore_index)
    per_row = _cross_entropy_rows(z, safe) + lam * mbls_penalty(z, margin)
    return reduce_rows(per_row, valid, reduction, batch_shape, logits.dtype)


class MbLSLoss(nn.Module):
    """MbLS (:func:`mbls_loss`): cross-entropy through the fused op plus ``λ ·`` the logit-margin penalty
    (:func:`mbls_penalty`) in PyTorch; ``backend="reference"`` runs :func:`mbls_loss`."""

    def __init__(self, margin=10.0, lam=0.1, reduction="mean", ignore_index=-100, backend="auto"):
        super().__init__()
        self.margin, self.lam = _check_mbls(margin, lam)
        _check_reduction(reduction, backend, ignore_index)
        self.reduction, self.ignore_index, self.backend = reduction, ignore_index, backend

    def forward(self, logits, target):
        if self.backend == "reference":
            return mbls_loss(logits, target, margin=self.margin, lam=self.lam, reduction=self.reduction,
                             ignore_index=self.ignore_index)
        ce = uncertainty_weighted_ce(logits, target, uncertainty="none", reduction=self.reduction,
                                     ignore_index=self.ignore_index, backend=self.backend)
        valid, z, _, batch_shape = _rows(logits, target, self.ignore_index, check_values=False)
        penalty = reduce_rows(mbls_penalty(z, self.margin), valid, self.reduction, batch_shape, z.dtype)
        return (ce.to(penalty.dtype) + self.lam * penalty).to(logits.dtype)

    def extra_repr(self):
        return f"margin={self.margin}, lam={self.lam}, {common_repr(self.reduction, self.ignore_index, self.backend)}"
