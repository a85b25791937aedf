"""Pure-PyTorch reference of the calibration loss family (SPEC §2). Every fast kernel is tested against this module.

All computation happens in float32 (float64 stays float64, for ``gradcheck``), on any device; results come back in the
input dtype, as ``torch.nn.functional.cross_entropy`` does.  Gradients come from autograd, so the reference is the
independent check of the kernels' hand-written backward.

The family is ``L_i = u_i · CE_i`` with ``CE_i = logsumexp(z_i) - z_{i,y_i}`` and a per-sample uncertainty weight
``u_i = u(p_i, y_i)``:

==============  ===============================================  ==========================================
weight          u(p, y)                                           source
==============  ===============================================  ==========================================
``none``        1                                                 plain cross-entropy
``focal``       (1 - p_y)^γ                                       Lin et al. 2017; Mukhoti et al. 2020
``flsd``        (1 - p_y)^γ_i, γ_i = 5 / 3 / γ for p_y < .2/.5/≥  Mukhoti et al. 2020 (FLSD-53 with γ = 3)
``dual_focal``  (1 - p_y + p_j)^γ, p_j = max{p_k : z_k < z_y}     Tao, Dong, Xu, ICML 2023
``brier``       ‖p - e_y‖_q^γ = (Σ_k |p_k - e_{y,k}|^q)^{γ/q}       BSCE-GRA paper, Eq. 3/11
``external``    sg[w_i] (user-supplied, always detached)          BSCE-GRA paper §4.2
==============  ===============================================  ==========================================

``mode="loss"`` differentiates through ``u`` (classic focal/dual-focal/BSCE); ``mode="grad"`` uses ``sg[u]``, so the
gradient is exactly ``u_i (p_i - e_{y_i})`` (the GRA losses).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import _validation as V

__all__ = [
    "uncertainty_weight",
    "uncertainty_weighted_ce",
    "bsce_gra_loss",
    "brier_loss",
    "label_smoothing_loss",
    "mmce",
    "mmce_loss",
]

FLSD_LOW_THRESHOLD, FLSD_LOW_GAMMA = 0.2, 5.0  # Lambert-W bound γ*(0.2) = 4.85, rounded up (Mukhoti et al. §5)
FLSD_MID_THRESHOLD, FLSD_MID_GAMMA = 0.5, 3.0


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked_rows(logits2d, target1d, ignore_index):
    """Return (valid mask, logits in compute dtype with ignored rows zeroed, target with ignored rows set to 0).

    Zeroing ignored rows keeps their (discarded) loss finite, so no NaN can leak into the gradient through
    ``torch.where``'s backward.
    """
    valid = target1d != ignore_index
    z = logits2d.to(_compute_dtype(logits2d.dtype))
    z = torch.where(valid[:, None], z, torch.zeros((), dtype=z.dtype, device=z.device))
    safe_target = torch.where(valid, target1d, torch.zeros_like(target1d))
    return valid, z, safe_target


def _reduce(per_row, valid, reduction, batch_shape, out_dtype):
    per_row = torch.where(valid, per_row, torch.zeros((), dtype=per_row.dtype, device=per_row.device))
    if reduction == "none":
        return per_row.reshape(batch_shape).to(out_dtype)
    total = per_row.sum()
    if reduction == "sum":
        return total.to(out_dtype)
    # mean over non-ignored rows; all rows ignored gives 0, not NaN
    return (total / valid.sum().clamp_min(1)).to(out_dtype)


def _flsd_gamma(p_target, gamma):
    """Sample-dependent γ of FLSD (never differentiated)."""
    p_target = p_target.detach()
    high = torch.full_like(p_target, float(gamma))
    mid = torch.full_like(p_target, FLSD_MID_GAMMA)
    low = torch.full_like(p_target, FLSD_LOW_GAMMA)
    return torch.where(p_target < FLSD_LOW_THRESHOLD, low, torch.where(p_target < FLSD_MID_THRESHOLD, mid, high))


def uncertainty_weight(z, target, *, weight, gamma, norm, sample_weight=None):
    """Differentiable per-row weight ``u_i`` of SPEC §2 for logits ``z (N, C)`` (compute dtype) and targets ``(N,)``.

    ``1 - p_y`` is computed as ``-expm1(log p_y)`` so confident rows (p_y → 1) keep full relative precision.
    """
    if weight == "none":
        return torch.ones(z.shape[0], dtype=z.dtype, device=z.device)
    if weight == "external":
        return sample_weight.detach().to(z.dtype)
    log_p = torch.log_softmax(z, dim=-1)
    log_p_target = log_p.gather(1, target[:, None]).squeeze(1)
    one_minus_p_target = -torch.expm1(log_p_target)
    if isinstance(gamma, torch.Tensor):
        gamma = gamma.to(z.dtype)
    if weight == "focal":
        return one_minus_p_target.pow(gamma)
    if weight == "flsd":
        return one_minus_p_target.pow(_flsd_gamma(log_p_target.exp(), gamma))
    p = log_p.exp()
    if weight == "dual_focal":
        # p_j: the largest probability strictly below p_y (0 if none). Compared on logits, which orders the same
        # as probabilities but without softmax rounding merging distinct values into ties.
        z_target = z.gather(1, target[:, None])
        below = z < z_target
        p_below = torch.where(below, p, torch.zeros((), dtype=p.dtype, device=p.device))
        p_j = p_below.amax(dim=1)
        return (one_minus_p_target + p_j).pow(gamma)
    if weight == "brier":
        # ‖p - e_y‖_q^q = Σ_{k≠y} p_k^q + (1 - p_y)^q  (no cancellation in p_y - 1)
        is_target = F.one_hot(target, z.shape[1]).bool()
        p_others = torch.where(is_target, torch.zeros((), dtype=p.dtype, device=p.device), p)
        norm_q = p_others.pow(norm).sum(dim=1) + one_minus_p_target.pow(norm)
        return norm_q.pow(gamma / norm)
    raise ValueError(f"unknown weight {weight!r}")


def uncertainty_weighted_ce(
    logits,
    target,
    *,
    weight="brier",
    mode="grad",
    gamma=4.0,
    norm=2.0,
    sample_weight=None,
    reduction="mean",
    ignore_index=-100,
    backend="reference",
):
    """Uncertainty-weighted cross-entropy ``L_i = u_i · CE_i`` (``mode="loss"``) or ``sg[u_i] · CE_i`` (``"grad"``).

    Args:
        logits: ``(..., C)`` float tensor (class dimension last).
        target: ``(...)`` int64 class indices in ``[0, C)`` or ``ignore_index``.
        weight: ``"none" | "focal" | "flsd" | "dual_focal" | "brier" | "external"`` (table in the module docstring).
        mode: ``"grad"`` (GRA: weight detached, gradient ``u (p - e_y)``) or ``"loss"`` (weight differentiated).
        gamma: exponent γ ≥ 0; for ``weight="focal"`` also a per-sample tensor of the target's shape.
        norm: q > 0 of the generalised Brier score (``weight="brier"``).
        sample_weight: ``(...)`` per-sample weight for ``weight="external"``, used as ``sg[w]``.
        reduction: ``"mean"`` (over non-ignored rows; 0 if none), ``"sum"`` or ``"none"`` (ignored rows → 0).
        backend: accepted for signature parity with :func:`calibkernels.uncertainty_weighted_ce`; must be
            ``"reference"`` or ``"auto"``.

    Returns:
        the loss in the logits' dtype: a scalar, or ``target``-shaped for ``reduction="none"``.
    """
    V.check_backend(backend)
    if backend not in ("reference", "auto"):
        raise ValueError(f"calibkernels.reference only runs backend='reference', not {backend!r}")
    inputs = V.check_loss_inputs(
        logits, target, weight=weight, mode=mode, gamma=gamma, norm=norm, sample_weight=sample_weight,
        reduction=reduction, ignore_index=ignore_index,
    )
    return _uncertainty_weighted_ce(inputs)


def _uncertainty_weighted_ce(inputs: V.LossInputs):
    """The reference on already-validated inputs (what the ``"reference"`` backend runs)."""
    valid, z, safe_target = _masked_rows(inputs.logits, inputs.target, inputs.ignore_index)
    cross_entropy = torch.logsumexp(z, dim=-1) - z.gather(1, safe_target[:, None]).squeeze(1)
    sample_weight = inputs.sample_weight
    if sample_weight is not None:
        sample_weight = torch.where(valid, sample_weight, torch.zeros((), dtype=sample_weight.dtype,
                                                                       device=sample_weight.device))
    u = uncertainty_weight(z, safe_target, weight=inputs.weight, gamma=inputs.gamma, norm=inputs.norm,
                           sample_weight=sample_weight)
    if inputs.mode == "grad":
        u = u.detach()
    return _reduce(u * cross_entropy, valid, inputs.reduction, inputs.batch_shape, inputs.logits.dtype)


def bsce_gra_loss(logits, target, *, gamma=4.0, norm=2.0, reduction="mean", ignore_index=-100, backend="reference"):
    """BSCE-GRA: ``sg[‖p - e_y‖_q^γ] · CE`` (BSCE-GRA paper Eq. 11); gradient ``‖p - e_y‖_q^γ (p - e_y)``."""
    return uncertainty_weighted_ce(logits, target, weight="brier", mode="grad", gamma=gamma, norm=norm,
                                   reduction=reduction, ignore_index=ignore_index, backend=backend)


def brier_loss(logits, target, *, reduction="mean", ignore_index=-100):
    """Brier loss ``Σ_k (p_k - e_{y,k})²`` per sample (Brier 1950; a proper scoring rule, not CE-weighted)."""
    V.check_reduction(reduction)
    logits2d, target1d, batch_shape = V.check_logits_target(logits, target, ignore_index=ignore_index)
    valid, z, safe_target = _masked_rows(logits2d, target1d, ignore_index)
    u = uncertainty_weight(z, safe_target, weight="brier", gamma=2.0, norm=2.0)
    return _reduce(u, valid, reduction, batch_shape, logits2d.dtype)


def label_smoothing_loss(logits, target, *, alpha=0.05, reduction="mean", ignore_index=-100):
    """Cross-entropy against the smoothed target ``(1 - α) e_y + α / C`` (Szegedy et al. 2016).

    This is the variant of ``F.cross_entropy(label_smoothing=α)``: the α mass is spread over all C classes, the
    target included. Per sample: ``-(1 - α) log p_y - (α / C) Σ_k log p_k``.
    """
    V.check_reduction(reduction)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"label smoothing alpha must be in [0, 1], got {alpha}")
    logits2d, target1d, batch_shape = V.check_logits_target(logits, target, ignore_index=ignore_index)
    valid, z, safe_target = _masked_rows(logits2d, target1d, ignore_index)
    log_p = torch.log_softmax(z, dim=-1)
    nll = -log_p.gather(1, safe_target[:, None]).squeeze(1)
    smooth = -log_p.mean(dim=-1)
    return _reduce((1.0 - alpha) * nll + alpha * smooth, valid, reduction, batch_shape, logits2d.dtype)


def mmce(logits, target, *, weighted=False, bandwidth=0.4, ignore_index=-100):
    """Maximum mean calibration error of a batch (Kumar, Sarawagi, Jain, ICML 2018), differentiable.

    With confidence ``r_i = max_k p_ik``, correctness ``c_i = 1[argmax p_i = y_i]`` and the Laplacian kernel
    ``k(r, r') = exp(-|r - r'| / bandwidth)``:

    * unweighted: ``MMCE = sqrt(Σ_ij (c_i - r_i)(c_j - r_j) k(r_i, r_j)) / m``;
    * weighted (Kumar et al. Eq. 5, the form the focal-loss paper's ``mmce_weighted`` uses): the correct and
      incorrect samples are compared as two distributions, ``MMCE_w² = Σ_{c=c'=1}(1-r)(1-r')k / n₁²
      + Σ_{c=c'=0} r r' k / n₀² - 2 Σ_{c=1,c'=0}(1-r) r' k / (n₁ n₀)``; it is 0 when either group is empty.

    A ``1e-10`` inside the square root keeps its gradient finite at 0. Ignored rows take no part.
    """
    logits2d, target1d, _ = V.check_logits_target(logits, target, ignore_index=ignore_index)
    valid, z, safe_target = _masked_rows(logits2d, target1d, ignore_index)
    p = torch.softmax(z, dim=-1)
    confidence, prediction = p.max(dim=-1)
    correct = (prediction == safe_target).to(p.dtype)
    mask = valid.to(p.dtype)
    kernel = torch.exp(-(confidence[:, None] - confidence[None, :]).abs() / bandwidth)
    if not weighted:
        residual = (correct - confidence) * mask
        m = mask.sum().clamp_min(1)
        return torch.sqrt((residual[:, None] * residual[None, :] * kernel).sum() / (m * m) + 1e-10)
    is_correct = correct * mask
    is_wrong = (1.0 - correct) * mask
    n_correct, n_wrong = is_correct.sum(), is_wrong.sum()
    a = (1.0 - confidence) * is_correct  # under-confidence of correct samples
    b = confidence * is_wrong  # over-confidence of wrong samples
    squared = (
        (a[:, None] * a[None, :] * kernel).sum() / n_correct.clamp_min(1) ** 2
        + (b[:, None] * b[None, :] * kernel).sum() / n_wrong.clamp_min(1) ** 2
        - 2.0 * (a[:, None] * b[None, :] * kernel).sum() / (n_correct * n_wrong).clamp_min(1)
    )
    both_groups = ((n_correct > 0) & (n_wrong > 0)).to(p.dtype)
    return both_groups * torch.sqrt(squared.clamp_min(0) + 1e-10)


def mmce_loss(logits, target, *, lamda=2.0, weighted=False, bandwidth=0.4, reduction="mean", ignore_index=-100):
    """Cross-entropy + λ·MMCE (Kumar et al. 2018; λ = 2 as in Mukhoti et al.'s runs).

    MMCE is a batch-level term, so ``reduction="none"`` is not defined. ``"mean"``: mean CE + λ·MMCE;
    ``"sum"``: sum CE + λ·n·MMCE (n non-ignored rows), i.e. n times the mean form, so the paper recipes'
    sum reduction keeps the same balance between the two terms.
    """
    V.check_reduction(reduction)
    if reduction == "none":
        raise ValueError("MMCE is a batch-level loss: reduction='none' is not supported (use 'mean' or 'sum')")
    ce = uncertainty_weighted_ce(logits, target, weight="none", reduction=reduction, ignore_index=ignore_index)
    penalty = mmce(logits, target, weighted=weighted, bandwidth=bandwidth, ignore_index=ignore_index)
    if reduction == "sum":
        penalty = penalty * (target.reshape(-1) != ignore_index).sum()
    return ce + (lamda * penalty).to(ce.dtype)
