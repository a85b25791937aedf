"""Triton forward kernel of the fused uncertainty-weighted cross-entropy with the drop-in options (docs/losses.md):
per-class weights, the z-loss and logit soft-capping (:func:`calibkernels.reference.uncertainty_weighted_ce_from_inputs`
is the oracle); launched by :mod:`calibkernels.triton.uncertainty_weighted_ce` for calls that ask for any of them.
Calls without options never come here: their kernels (:mod:`._hard_target_kernels`, :mod:`._soft_target_kernels`)
are untouched.

Every row is read as a soft target ``t`` (class indices are the compact form with ``c = 0``, ``w_y = 1``; smoothing
and a mix the compact form; a dense target its smoothed entries), in three passes over its chunks of BLOCK classes
(one chunk when the row fits a block, so the later reads hit the cache):

1. statistics: the capped logits ``z'_k = c_s tanh(z_k / c_s)`` (SOFTCAP; ``c_s`` the cap), their online max ``m``
   and ``d = Σ e^{z' - m}``, so ``lse = m + log d`` (and with STATS the first column of the max);
2. sums, with ``p = e^{z' - lse}`` and ``t'_k = w_k t_k`` (HAS_CLASS_WEIGHT; ``w`` the class weights):
   ``CE^w = Σ_{t>0} t' (lse - z')``, ``Σ t'``, ``P = Σ t p``, ``1 - P = Σ p (1 - t)``, ``Σ t``, FLSD's band value
   and the Brier weight's ``S = Σ |p - t|^q``, ``H = Σ h p`` (the weight ``u`` is the unweighted target's);
3. gradient: ``dL/dz'_k = σ_CE (u (Σt' p_k - t'_k) + CE^w du/dz'_k) + σ_z 2 s lse p_k`` (Z_LOSS: ``s`` the z-loss
   scale; σ the reduction's factors, 1 / the class-weighted divisor and 1 / the count for a mean), times
   ``dz'/dz = sech²(z / c_s)`` under SOFTCAP (0 at a -inf logit).

Each row stores ``u CE^w`` and the z-loss ``s lse²`` apart (0 on an ignored row, NaN on a bad target), so that the
launcher reduces them with their own divisors.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ._row_helpers import (_BRIER, _BRIER_FLSD, _FLSD, _FOCAL, _LOSS_MODE, _MEAN, REDUCTION_MEAN, REDUCTION_NONE,
                           _running_top_index, _store_top_label)
from ._soft_target_kernels import (_brier_h, _brier_power, _soft_gradient, _soft_row_target, _soft_weight,
                                   _store_gradient)


@triton.jit
def _capped(z, softcap, SOFTCAP: tl.constexpr):
    """``(z', dz'/dz)``: ``z' = c tanh(z / c)`` and ``sech²(z / c)`` under SOFTCAP (``c = softcap``; -inf → ``(-c,
    0)``), else ``(z, 1)``. Both from ``e = e^{-2|x|}``: ``tanh|x| = (1 - e) / (1 + e)`` (a short series below
    ``|x| = 1/8``, where ``1 - e`` cancels) and ``sech² x = 4e / (1 + e)²``, which does not cancel near the cap."""
    LOG2E: tl.constexpr = 1.4426950408889634
    slope = tl.full(z.shape, 1.0, tl.float32)
    if SOFTCAP:
        x = z / softcap
        ax = tl.abs(x)
        e = tl.exp2(-2.0 * LOG2E * ax)
        x2 = x * x
        series = ax * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
        tanh_abs = tl.where(ax < 0.125, series, (1.0 - e) / (1.0 + e))
        z = softcap * tl.where(x < 0.0, -tanh_abs, tanh_abs)
        slope = 4.0 * e / ((1.0 + e) * (1.0 + e))
    return z, slope


@triton.jit
def _load_capped(logits_row, offs, num_classes, softcap, SOFTCAP: tl.constexpr):
    """``(mask, z', dz'/dz)`` of the columns ``offs``: the logits in fp32 (-inf past the row), capped."""
    col_mask = offs < num_classes
    z = tl.load(logits_row + offs, mask=col_mask, other=float("-inf")).to(tl.float32)
    z, slope = _capped(z, softcap, SOFTCAP)
    return col_mask, tl.where(col_mask, z, float("-inf")), slope


@triton.jit
def _option_statistics(logits_row, cols, num_classes, softcap, BLOCK: tl.constexpr, SOFTCAP: tl.constexpr,
                       STATS: tl.constexpr):
    """``(m, d, top_index)`` of the capped row: its max (0 for a row of -inf), ``d = Σ e^{z' - m}`` and with STATS
    the first column of the max (:func:`._row_helpers._running_top_index`), by the online max over the chunks."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    m = tl.full((), NEG_INF, tl.float32)
    d = tl.full((), 0.0, tl.float32)
    top_index = num_classes + tl.zeros((), tl.int32)
    for start in range(0, num_classes, BLOCK):
        _, z, _ = _load_capped(logits_row, start + cols, num_classes, softcap, SOFTCAP)
        m_new = tl.maximum(m, tl.max(z, 0))
        m_new_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
        m_safe = tl.where(m == NEG_INF, 0.0, m)
        d = d * tl.exp2((m_safe - m_new_safe) * LOG2E) + tl.sum(tl.exp2((z - m_new_safe) * LOG2E), 0)
        if STATS:
            top_index = _running_top_index(top_index, z, cols, start, m, m_new, BLOCK)
        m = m_new
    return tl.where(m == NEG_INF, 0.0, m), d, top_index


@triton.jit
def _option_columns(offs, col_mask, target_row, class_weight_ptr, safe_target, safe_mix, w_target, w_mix,
                    one_minus_a, c, DENSE: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr):
    """``(t, t')`` of the columns ``offs`` (0 past the row): the row's target distribution (compact ``c + w_y [k = y]
    + w_m [k = m]`` with the raw weights, which add up where ``m = y``; dense ``(1-a) T + c``) and ``w_k t_k``."""
    if DENSE:
        raw = tl.load(target_row + offs, mask=col_mask, other=0.0).to(tl.float32)
        t = raw * one_minus_a + c
    else:
        t = c + tl.where(offs == safe_target, w_target, 0.0) + tl.where(offs == safe_mix, w_mix, 0.0)
    t = tl.where(col_mask, t, 0.0)
    t_weighted = t
    if HAS_CLASS_WEIGHT:
        t_weighted = t * tl.load(class_weight_ptr + offs, mask=col_mask, other=0.0).to(tl.float32)
    return t, t_weighted


@triton.jit
def _option_sums(logits_row, target_row, class_weight_ptr, cols, num_classes, softcap, lse, safe_target, safe_mix,
                 w_target, w_mix, one_minus_a, c, norm, BLOCK: tl.constexpr, DENSE: tl.constexpr,
                 HAS_CLASS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr, IS_BRIER: tl.constexpr, MODE: tl.constexpr,
                 NORM_IS_TWO: tl.constexpr):
    """The row's sums once ``lse`` is known: ``(CE^w, Σt', P, 1 - P, Σt, band, S, H)``, ``1 - P = Σ p (1 - t)`` (no
    cancellation for a confident row), ``band`` the compact form's ``w_y p_y + w_m p_m`` (FLSD's, before ``+ c``),
    ``S``/``H`` the Brier weight's (IS_BRIER; ``H`` in loss mode)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    zero = tl.zeros((BLOCK,), tl.float32)
    ce = zero
    t_weighted_sum = zero
    P = zero
    one_minus_P = zero
    t_sum = zero
    band = zero
    brier_s = zero
    brier_h_sum = zero
    for start in range(0, num_classes, BLOCK):
        offs = start + cols
        col_mask, z, _ = _load_capped(logits_row, offs, num_classes, softcap, SOFTCAP)
        p = tl.exp2((z - lse) * LOG2E)
        t, t_weighted = _option_columns(offs, col_mask, target_row, class_weight_ptr, safe_target, safe_mix,
                                        w_target, w_mix, one_minus_a, c, DENSE, HAS_CLASS_WEIGHT)
        # 0 · log p = 0 where t = 0, also for a -inf logit
        ce += tl.where(t > 0.0, t_weighted * (lse - z), 0.0)
        t_weighted_sum += t_weighted
        P += t * p
        one_minus_P += p * (1.0 - t)
        t_sum += t
        if not DENSE:
            band += tl.where(offs == safe_target, w_target * p, 0.0) + tl.where(offs == safe_mix, w_mix * p, 0.0)
        if IS_BRIER:
            delta = p - t
            brier_s += tl.where(col_mask, _brier_power(delta, norm, NORM_IS_TWO), 0.0)
            if MODE == _LOSS_MODE:
                brier_h_sum += tl.where(col_mask, _brier_h(delta, norm, NORM_IS_TWO) * p, 0.0)
    return (tl.sum(ce, 0), tl.sum(t_weighted_sum, 0), tl.sum(P, 0), tl.sum(one_minus_P, 0), tl.sum(t_sum, 0),
            tl.sum(band, 0), tl.sum(brier_s, 0), tl.sum(brier_h_sum, 0))


@triton.jit
def _option_gradient(grad_row, logits_row, target_row, class_weight_ptr, cols, num_classes, softcap, lse,
                     safe_target, safe_mix, w_target, w_mix, one_minus_a, c, t_weighted_sum, P, one_minus_P, u,
                     coef_focal, coef_brier, brier_h_sum, z_coef, ce_scale, is_valid, is_bad, norm,
                     BLOCK: tl.constexpr, DENSE: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, SOFTCAP: tl.constexpr,
                     FORMULA: tl.constexpr, MODE: tl.constexpr, NORM_IS_TWO: tl.constexpr):
    """The gradient pass: per chunk ``(ce_scale (u (Σt' p - t') + CE^w du/dz') + z_coef p) dz'/dz`` (``z_coef = 2 s
    lse σ_z``), 0 on an ignored row and NaN on a bad one (:func:`._soft_target_kernels._store_gradient`)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    for start in range(0, num_classes, BLOCK):
        offs = start + cols
        col_mask, z, slope = _load_capped(logits_row, offs, num_classes, softcap, SOFTCAP)
        p = tl.exp2((z - lse) * LOG2E)
        t, t_weighted = _option_columns(offs, col_mask, target_row, class_weight_ptr, safe_target, safe_mix,
                                        w_target, w_mix, one_minus_a, c, DENSE, HAS_CLASS_WEIGHT)
        # t - P from 1 - P and 1 - t where t > 1/2 (a confident target), as the soft kernel takes it
        t_minus_P = tl.where(t > 0.5, one_minus_P - (1.0 - t), t - P)
        grad = _soft_gradient(p, p - t, t_weighted_sum * p - t_weighted, t_minus_P, u, coef_focal, coef_brier,
                              brier_h_sum, norm, FORMULA, MODE, NORM_IS_TWO)
        grad = (grad * ce_scale + z_coef * p) * slope
        _store_gradient(grad_row + offs, grad, col_mask, 1.0, is_valid, is_bad, "")


@triton.jit
def _option_ce_fwd_kernel(
    logits_ptr, logits_row_stride,
    target_ptr, target_row_stride, mix_ptr, lambda_ptr, lambda_stride,
    sample_weight_ptr, gamma_ptr, class_weight_ptr, divisors_ptr,
    row_loss_ptr, z_loss_ptr, grad_ptr, grad_row_stride, confidence_ptr, prediction_ptr,
    num_classes, gamma, norm, ignore_index, smoothing, lse_square_scale, softcap,
    WEIGHT: tl.constexpr, MODE: tl.constexpr, REDUCTION: tl.constexpr, COMPUTE_GRAD: tl.constexpr,
    PER_SAMPLE_GAMMA: tl.constexpr, BLOCK: tl.constexpr, NORM_IS_TWO: tl.constexpr, DENSE: tl.constexpr,
    HAS_MIX: tl.constexpr, HAS_CLASS_WEIGHT: tl.constexpr, Z_LOSS: tl.constexpr, SOFTCAP: tl.constexpr,
    STATS: tl.constexpr,
):
    """One program per row: ``row_loss[i] = u_i CE_i^w``, ``z_loss[i] = s lse_i²`` (Z_LOSS), the gradient row of the
    reduced loss for grad_output = 1 (COMPUTE_GRAD; a mean's factors ``1 / D`` (0 where ``D = 0``) and ``1 / max(count,
    1)`` from ``divisors = (D, count)``) and with STATS the capped logits' top-label statistics. Targets as the soft
    kernel takes them (class indices are a compact target without smoothing or mix)."""
    FORMULA: tl.constexpr = _FOCAL if WEIGHT == _FLSD else (_BRIER if WEIGHT == _BRIER_FLSD else WEIGHT)
    FLSD_SCHEDULE: tl.constexpr = WEIGHT == _FLSD or WEIGHT == _BRIER_FLSD
    LN2: tl.constexpr = 0.6931471805599453
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    target_row = target_ptr + row * target_row_stride
    cols = tl.arange(0, BLOCK)
    zero = tl.full((), 0.0, tl.float32)
    one_minus_a = 1.0 - smoothing
    c = smoothing / num_classes
    is_valid, is_bad, safe_target, safe_mix, w_target, w_mix, _, _, _, _, _ = _soft_row_target(
        target_ptr, mix_ptr, lambda_ptr, lambda_stride, logits_row, row, num_classes, ignore_index, one_minus_a, zero,
        DENSE, HAS_MIX)

    m, d, top_index = _option_statistics(logits_row, cols, num_classes, softcap, BLOCK, SOFTCAP, STATS)
    lse = m + tl.log2(d) * LN2
    if STATS:
        _store_top_label(confidence_ptr, prediction_ptr, logits_row, row, 1.0 / d, top_index, num_classes, is_valid,
                         BLOCK)
    ce, t_weighted_sum, P, one_minus_P, t_sum, band, brier_s, brier_h_sum = _option_sums(
        logits_row, target_row, class_weight_ptr, cols, num_classes, softcap, lse, safe_target, safe_mix, w_target,
        w_mix, one_minus_a, c, norm, BLOCK, DENSE, HAS_CLASS_WEIGHT, SOFTCAP, FORMULA == _BRIER, MODE, NORM_IS_TWO)
    # the focal base Σt - P of a dense target (its sum within tolerance of 1); FLSD's band value as the soft kernel's
    focal_base = one_minus_P
    p_band = band + c
    if DENSE:
        focal_base = one_minus_P + (t_sum - 1.0)
        p_band = P
    u, coef_focal, coef_brier = _soft_weight(row, ce, focal_base, p_band, brier_s, sample_weight_ptr, gamma_ptr,
                                             gamma, norm, FORMULA, FLSD_SCHEDULE, MODE, PER_SAMPLE_GAMMA)
    row_loss = tl.where(is_valid, u * ce, 0.0)
    tl.store(row_loss_ptr + row, tl.where(is_bad, float("nan"), row_loss))
    z_coef = zero
    if Z_LOSS:
        z_loss = tl.where(is_valid, lse_square_scale * lse * lse, 0.0)
        tl.store(z_loss_ptr + row, tl.where(is_bad, float("nan"), z_loss).to(z_loss_ptr.dtype.element_ty))
        z_coef = 2.0 * lse_square_scale * lse
    if COMPUTE_GRAD:
        ce_scale = zero + 1.0
        if REDUCTION == _MEAN:
            divisor = tl.load(divisors_ptr)
            ce_scale = tl.where(divisor > 0.0, 1.0 / tl.where(divisor > 0.0, divisor, 1.0), 0.0)
            z_coef = z_coef / tl.maximum(tl.load(divisors_ptr + 1), 1.0)
        _option_gradient(grad_ptr + row * grad_row_stride, logits_row, target_row, class_weight_ptr, cols, num_classes,
                         softcap, lse, safe_target, safe_mix, w_target, w_mix, one_minus_a, c, t_weighted_sum, P,
                         one_minus_P, u, coef_focal, coef_brier, brier_h_sum, z_coef, ce_scale, is_valid, is_bad, norm,
                         BLOCK, DENSE, HAS_CLASS_WEIGHT, SOFTCAP, FORMULA, MODE, NORM_IS_TWO)


# ---------------------------------------------------------------------------------------------------------------------
# Host-side pieces of the option launch (checks, the mean's divisors, the reduction): O(N) torch operations
# ---------------------------------------------------------------------------------------------------------------------
_WHERE = "calibkernels::uncertainty_weighted_ce_triton: "


def check_options(logits, class_weight, lse_square_scale, softcap, z_loss_out):
    """Check the options' shapes, dtypes and devices (the class weights' values are checked in Python before) and
    return the class weights as a contiguous float32 ``(C,)`` tensor (or ``None``)."""
    num_rows, num_classes = logits.shape
    if class_weight is not None:
        if (not isinstance(class_weight, torch.Tensor) or not class_weight.is_floating_point()
                or tuple(class_weight.shape) != (num_classes,) or class_weight.device != logits.device):
            described = (f"{class_weight.dtype} {tuple(class_weight.shape)} on {class_weight.device}"
                         if isinstance(class_weight, torch.Tensor) else type(class_weight).__name__)
            raise ValueError(f"{_WHERE}class_weight must be a floating tensor of shape ({num_classes},) on "
                             f"{logits.device}, got {described}")
        class_weight = class_weight.detach().to(torch.float32).contiguous()
    for name, value in (("lse_square_scale", lse_square_scale), ("softcap", softcap)):
        if not (math.isfinite(value) and value >= 0.0):
            raise ValueError(f"{_WHERE}{name} must be a finite number >= 0, got {value}")
    if z_loss_out is not None and (
            not isinstance(z_loss_out, torch.Tensor) or z_loss_out.dtype != torch.float32
            or tuple(z_loss_out.shape) != (num_rows,) or z_loss_out.device != logits.device
            or (num_rows > 1 and z_loss_out.stride(0) != 1)):
        raise ValueError(f"{_WHERE}z_loss_out must be a contiguous float32 tensor of shape ({num_rows},) on "
                         f"{logits.device}")
    return class_weight


def class_weighted_divisor(target, class_weight, mix_target, mix_lambda, ignore_index):
    """The class-weighted mean's divisor ``D = Σ_i <w, t̄_i>`` over the non-ignored rows of class indices, ``t̄`` the
    target before smoothing: ``Σ w_y``, with a mix ``Σ (λ w_y + (1 - λ) w_m)`` (float32, 0-dim). Out-of-range
    classes read class 0 (their rows are NaN and flagged anyway)."""
    num_classes = class_weight.shape[0]
    valid = target != ignore_index
    safe = torch.where(valid & (target >= 0) & (target < num_classes), target, 0)
    per_row = class_weight[safe]
    if mix_target is not None:
        safe_mix = torch.where(valid & (mix_target >= 0) & (mix_target < num_classes), mix_target, 0)
        lam = mix_lambda.to(torch.float32)
        per_row = lam * per_row + (1.0 - lam) * class_weight[safe_mix]
    return torch.where(valid, per_row, 0.0).sum()


def reduced_option_loss(row_loss, z_rows, divisor, count, reduction, loss_dtype):
    """The loss from the rows' ``u CE^w`` and z-loss (``None``: no z-loss): per row their sum, else the sums, a mean
    dividing the first by ``divisor`` (0 where it is 0) and the z-loss by ``max(count, 1)``."""
    if reduction == REDUCTION_NONE:
        return (row_loss if z_rows is None else row_loss + z_rows).to(loss_dtype)
    total = row_loss.sum()
    z_total = None if z_rows is None else z_rows.sum()
    if reduction == REDUCTION_MEAN:
        positive = divisor > 0
        total = torch.where(positive, total / torch.where(positive, divisor, 1.0), 0.0)
        if z_total is not None:
            z_total = z_total / count.clamp_min(1.0)
    return (total if z_total is None else total + z_total).to(loss_dtype)
