"""Triton forward kernel of the fused uncertainty-weighted cross-entropy for soft targets (docs/losses.md, "Soft
targets"; :func:`calibkernels.reference.soft_uncertainty_weight` is the oracle); launched by
:mod:`calibkernels.triton.uncertainty_weighted_ce`.

Soft targets put a target distribution ``t`` where the hard path (:mod:`._hard_target_kernels`) has ``e_y``. It
arrives in one of two forms:

    compact   class indices y, an optional mix class m with λ (mixup / cutmix) and smoothing a:
              t_k = c + w_y [k = y] + w_m [k = m],   c = a/C,  w_y = (1-a) λ,  w_m = (1-a)(1-λ)
              (no mix: w_m = 0; m = y: the two weights add up on one column)
    dense     a floating (N, C) target T, read as fp32:  t_k = (1-a) T_k + c

With ``P = <t, p>``:

    CE = -Σ_k t_k log p_k = Σ_k t_k (m - z_k) + (Σ_k t_k) log d            (classes with t_k = 0 add nothing, -inf ones
                                                                            included)
    u: focal (1-P)^γ,  FLSD (1-P)^{γ_i} with γ_i from the band value below,  Brier S^{γ/q}, S = Σ_k |p_k - t_k|^q,
       Brier-FLSD S^{γ_i/q}
    mode="grad":  dL/dz_k = u ((Σ_j t_j) p_k - t_k)
    mode="loss":  + CE du/dz_k,  focal / FLSD  du/dz_k = -γ (1-P)^{γ-1} p_k (t_k - P)
                                 Brier (-FLSD) du/dz_k = (γ/q) S^{γ/q-1} p_k (h_k - H),
                                               h_k = q |p_k - t_k|^{q-1} sign(p_k - t_k),  H = Σ_j h_j p_j

The differences that would cancel are taken from sums of non-negative terms instead:

    compact   1 - P = c (C-1) + w_y (1 - p_y) + w_m (1 - p_m),  1 - p_y = (Σ_{k∉{y,m}} e^{z_k-m} + e^{z_m-m}) / d
              t_y - P = w_y (1 - p_y) - w_m p_m;  p_y - t_y = (1 - t_y) - (1 - p_y) where p_y > 1/2;  -log p_y as
              log1p(Σ_{k≠y} e^{z_k - z_y}) where p_y > 1/2
    dense     1 - P = Σ_k p_k (1 - t_k) + (Σt - 1),  1 - t_k = (1-a)(1 - T_k) + (a - c)

FLSD's band value is, as in every implementation, ``float32((w_y e^{z_y-lse} + w_m e^{z_m-lse}) + c)`` for compact
targets (``lse = m + log d``) and ``float32(Σ_k t_k e^{z_k-lse})`` for dense ones. Dual focal has no soft form (its
``p_j`` needs one target class): soft targets with ``uncertainty="dual_focal"`` raise ``ValueError`` in the launcher.

Kernel design (docs/performance.md): soft targets keep the hard kernel's traffic in a kernel of their own
(``_soft_target_ce_fwd_kernel``, one program per row, the same launch shapes). A compact target is O(N) data (y, m and
λ per row: three loads), and ``t_k`` is formed from three scalars per column; the statistics exclude the columns y and
m (so ``1 - p_y``, ``1 - p_m`` never cancel) and add ``Σ (m - z)`` for the smoothing term of CE and, for the Brier
weight, ``Σ e²`` (q = 2: ``Σ_{k∉{y,m}} (p_k - c)² = Σ p² - 2c Σ p + n c²``) or, without smoothing, ``Σ e^q``. A dense
target adds one read of the N×C target (twice on the two-read path, beside the logits) and the sums ``Σ t (m - z)``,
``Σ e (1 - t)``, ``Σ e t``, ``Σ t`` (and ``Σ e²``, ``Σ t²`` for q = 2). In registers every S is summed term by term;
on the two-read path the Brier weight with q ≠ 2 and smoothing or a dense target, whose ``|p_k - t_k|`` needs ``d``,
reads the row once more before the gradient pass. The gradient of a compact row is a function of ``p`` alone (the
target and mix columns' values are row scalars), and float32 soft rows are held in registers only up to the
launcher's ``MAX_BLOCK_DENSE`` (dense) and ``SOFT_BLOCK_CAPS`` classes, so that no launch spills
(bench/triton_registers.py). With STATS (``return_stats=True``) the statistics pass also gives the logits' own
top-label statistics, ``1/d`` and the first column of the (running) max, as the hard-target kernel does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._row_helpers import (_BRIER, _BRIER_FLSD, _EXTERNAL, _FLSD, _FOCAL, _LOSS_MODE, _NONE, _REDUCTION_NONE, _finish,
                           _first_top_index, _gradient_scale, _pow, _row_gamma, _running_top_index,
                           _statistics_chunk, _store_row_loss, _store_top_label)


@triton.jit
def _neg_log_probability(z_k, e_k, e_others, p_k, m_safe, log2_d):
    """``-log p_k`` from ``e_k = e^{z_k - m}`` and the sum ``e_others`` of the other classes' ``e^{z - m}``: for
    ``p_k > 1/2`` as ``log1p(e_others / e_k)`` (Kahan's log1p), so a confident class keeps its relative precision."""
    LN2: tl.constexpr = 0.6931471805599453
    odds_against = e_others / e_k
    one_plus = 1.0 + odds_against
    log1p_odds = tl.where(one_plus == 1.0, odds_against, tl.log(one_plus) * odds_against / (one_plus - 1.0))
    return tl.where(p_k > 0.5, log1p_odds, (m_safe - z_k) + log2_d * LN2)


@triton.jit
def _brier_power(delta, norm, NORM_IS_TWO: tl.constexpr):
    """``|δ|^q``, a term of the generalised Brier score ``S = Σ_k |δ_k|^q`` (0 at ``δ = 0``)."""
    if NORM_IS_TWO:
        power = delta * delta
    else:
        power = tl.exp2(norm * tl.log2(tl.abs(delta)))
    return power


@triton.jit
def _brier_h(delta, norm, NORM_IS_TWO: tl.constexpr):
    """``h = dS/dδ = q |δ|^{q-1} sign(δ)``, taken as 0 at ``δ = 0`` (the limit for q > 1, a subgradient below)."""
    if NORM_IS_TWO:
        h = 2.0 * delta
    else:
        magnitude = norm * tl.exp2((norm - 1.0) * tl.log2(tl.abs(delta)))
        h = tl.where(delta == 0.0, 0.0, tl.where(delta < 0.0, -magnitude, magnitude))
    return h


@triton.jit
def _smoothed_target(raw, col_mask, one_minus_a, c, a_minus_c):
    """``(t, 1 - t)`` of dense target entries ``T``: ``t = (1-a) T + c`` and ``1 - t = (1-a)(1 - T) + (a - c)``, both
    sums of non-negative terms (no cancellation); ``t = 0`` on masked lanes."""
    t = tl.where(col_mask, raw * one_minus_a + c, 0.0)
    one_minus_t = tl.where(col_mask, (1.0 - raw) * one_minus_a + a_minus_c, 0.0)
    return t, one_minus_t


@triton.jit
def _dense_sums(z, e, t, one_minus_t, m_safe, SQUARES: tl.constexpr):
    """A block's sums for a dense target: ``Σ e``, ``Σ t (m - z)`` (0 where ``t = 0``, also for ``z = -inf``),
    ``Σ e²`` (SQUARES), ``Σ e (1 - t)``, ``Σ e t``, ``Σ t``, ``Σ t²`` (SQUARES)."""
    sum_e_sq = tl.full((), 0.0, tl.float32)
    sum_t_sq = tl.full((), 0.0, tl.float32)
    if SQUARES:
        sum_e_sq = tl.sum(e * e, 0)
        sum_t_sq = tl.sum(t * t, 0)
    gap = tl.sum(tl.where(t > 0.0, t * (m_safe - z), 0.0), 0)
    return (tl.sum(e, 0), gap, sum_e_sq, tl.sum(e * one_minus_t, 0), tl.sum(e * t, 0), tl.sum(t, 0), sum_t_sq)


@triton.jit
def _compact_sums(z, e, special, col_mask, m_safe, norm, GAPS: tl.constexpr, POWERS: tl.constexpr,
                  NORM_IS_TWO: tl.constexpr):
    """A block's sums for a compact target, over the columns that are neither the target nor the mix class:
    ``Σ e``, ``Σ (m - z)`` over all columns (GAPS: smoothing), ``Σ e^q`` (POWERS: the Brier weight's ``Σ p^q``)."""
    e_rest = tl.where(special, 0.0, e)
    gap = tl.full((), 0.0, tl.float32)
    sum_q = tl.full((), 0.0, tl.float32)
    if GAPS:
        gap = tl.sum(tl.where(col_mask, m_safe - z, 0.0), 0)
    if POWERS:
        if NORM_IS_TWO:
            sum_q = tl.sum(e_rest * e_rest, 0)
        else:
            sum_q = tl.sum(tl.where(special, 0.0, tl.exp2((z - m_safe) * (norm * 1.4426950408889634))), 0)
    return tl.sum(e_rest, 0), gap, sum_q


@triton.jit
def _soft_columns(p, offs, raw, DENSE: tl.constexpr, one_minus_a, c, a_minus_c, t_sum, P, one_minus_P,
                  safe_target, safe_mix, delta_target, delta_mix, t_minus_P_target, t_minus_P_mix, Q):
    """Per column: ``δ = p - t`` (the Brier weight's), ``Σt p - t`` (the cross-entropy's gradient) and ``t - P``
    (the focal weight's). Dense: from the entries ``raw``; ``t - P`` as ``(1 - P) - (1 - t)`` where ``t > 1/2``, with
    ``1 - P = one_minus_P - (Σt - 1)`` (``one_minus_P`` is the focal base ``Σt - P`` of a target that sums to Σt).
    Compact: the other columns have ``t = c``, ``t - P = -Q`` (``Q = P - c``); the target and mix columns take the
    row's cancellation-free scalars."""
    if DENSE:
        t = raw * one_minus_a + c
        one_minus_t = (1.0 - raw) * one_minus_a + a_minus_c
        delta = p - t
        ce_delta = t_sum * p - t
        # one_minus_P is Σt - P (the focal base, 1 - P for a target summing to 1): t - P = (1 - P) - (1 - t)
        t_minus_P = tl.where(t > 0.5, (one_minus_P - (t_sum - 1.0)) - one_minus_t, t - P)
    else:
        is_target = offs == safe_target
        is_mix = offs == safe_mix
        delta = tl.where(is_target, delta_target, tl.where(is_mix, delta_mix, p - c))
        ce_delta = delta
        t_minus_P = tl.where(is_target, t_minus_P_target, tl.where(is_mix, t_minus_P_mix, -Q))
    return delta, ce_delta, t_minus_P


@triton.jit
def _load_soft_chunk(logits_row, target_row, offs, num_classes, m_safe, log2_d, DENSE: tl.constexpr,
                     EVICTION: tl.constexpr, one_minus_a, c, a_minus_c, t_sum, P, one_minus_P, safe_target, safe_mix,
                     delta_target, delta_mix, t_minus_P_target, t_minus_P_mix, Q):
    """A chunk of a later pass over the row: ``(mask, p, δ, Σt p - t, t - P)`` (:func:`_soft_columns`) with
    ``p_k = 2^{(z_k - m) log2 e - log2 d}`` (see the hard-target kernel) and, dense, the target's entries."""
    LOG2E: tl.constexpr = 1.4426950408889634
    col_mask = offs < num_classes
    z = tl.load(logits_row + offs, mask=col_mask, other=float("-inf"), eviction_policy=EVICTION).to(tl.float32)
    p = tl.exp2((z - m_safe) * LOG2E - log2_d)
    raw = p
    if DENSE:
        raw = tl.load(target_row + offs, mask=col_mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    delta, ce_delta, t_minus_P = _soft_columns(p, offs, raw, DENSE, one_minus_a, c, a_minus_c, t_sum, P, one_minus_P,
                                               safe_target, safe_mix, delta_target, delta_mix, t_minus_P_target,
                                               t_minus_P_mix, Q)
    return col_mask, p, delta, ce_delta, t_minus_P


@triton.jit
def _soft_weight(row, cross_entropy, one_minus_P, p_band, brier_s, sample_weight_ptr, gamma_ptr, gamma, norm,
                 FORMULA: tl.constexpr, FLSD_SCHEDULE: tl.constexpr, MODE: tl.constexpr,
                 PER_SAMPLE_GAMMA: tl.constexpr):
    """``(u, A, K)``: the weight and its loss-mode coefficients, ``du/dz_k = -A/CE · p_k (t_k - P)`` (focal, FLSD:
    ``A = CE γ (1-P)^{γ-1}``) or ``K/CE · p_k (h_k - H)`` (Brier, Brier-FLSD: ``K = CE (γ/q) S^{γ/q-1}``); both 0
    where the base is 0 (the limit of the product with CE). Under FLSD_SCHEDULE γ is FLSD's γ_i of ``p_band``."""
    coef_focal = tl.full((), 0.0, tl.float32)
    coef_brier = tl.full((), 0.0, tl.float32)
    if FORMULA == _NONE:
        u = tl.full((), 1.0, tl.float32)
    elif FORMULA == _EXTERNAL:
        u = tl.load(sample_weight_ptr + row).to(tl.float32)
    elif FORMULA == _FOCAL:
        g = _row_gamma(row, p_band, gamma, gamma_ptr, FLSD_SCHEDULE, PER_SAMPLE_GAMMA)
        u = _pow(one_minus_P, g)
        if MODE == _LOSS_MODE:
            coef_focal = tl.where((g == 0.0) | (one_minus_P == 0.0), 0.0,
                                  cross_entropy * g * _pow(one_minus_P, g - 1.0))
    else:  # FORMULA == _BRIER
        g = _row_gamma(row, p_band, gamma, gamma_ptr, FLSD_SCHEDULE, False)
        exponent = g / norm
        u = _pow(brier_s, exponent)
        if MODE == _LOSS_MODE:
            coef_brier = tl.where((g == 0.0) | (brier_s == 0.0), 0.0,
                                  cross_entropy * exponent * _pow(brier_s, exponent - 1.0))
    return u, coef_focal, coef_brier


@triton.jit
def _soft_gradient(p, delta, ce_delta, t_minus_P, u, coef_focal, coef_brier, brier_h_sum, norm,
                   FORMULA: tl.constexpr, MODE: tl.constexpr, NORM_IS_TWO: tl.constexpr):
    """``u (Σt p - t) + CE du/dz`` of a block of columns (grad_output = 1, before the reduction's scale)."""
    grad = u * ce_delta
    if MODE == _LOSS_MODE:
        if FORMULA == _FOCAL:
            grad -= coef_focal * p * t_minus_P
        elif FORMULA == _BRIER:
            grad += coef_brier * p * (_brier_h(delta, norm, NORM_IS_TWO) - brier_h_sum)
    return grad


@triton.jit
def _soft_block_gradient(p, offs, raw, DENSE: tl.constexpr, one_minus_a, c, a_minus_c, t_sum, P, one_minus_P,
                         safe_target, safe_mix, grad_target, grad_mix, Q, u, coef_focal, coef_brier, brier_h_sum,
                         norm, FORMULA: tl.constexpr, MODE: tl.constexpr, NORM_IS_TWO: tl.constexpr):
    """The gradient of a block of columns (grad_output = 1, before the reduction's scale) from ``p`` and, dense, the
    entries ``raw`` alone. Compact: the other columns from ``p - c`` and ``t - P = -Q``, the target and mix columns
    the row's ``grad_target`` / ``grad_mix`` (the target's where ``m = y``)."""
    if DENSE:
        delta, ce_delta, t_minus_P = _soft_columns(p, offs, raw, DENSE, one_minus_a, c, a_minus_c, t_sum, P,
                                                   one_minus_P, safe_target, safe_mix, P, P, P, P, Q)
        grad = _soft_gradient(p, delta, ce_delta, t_minus_P, u, coef_focal, coef_brier, brier_h_sum, norm,
                              FORMULA, MODE, NORM_IS_TWO)
    else:
        rest = p - c
        grad = _soft_gradient(p, rest, rest, -Q, u, coef_focal, coef_brier, brier_h_sum, norm, FORMULA, MODE,
                              NORM_IS_TWO)
        grad = tl.where(offs == safe_target, grad_target, tl.where(offs == safe_mix, grad_mix, grad))
    return grad


@triton.jit
def _store_gradient(ptrs, grad, col_mask, scale, is_valid, is_bad, EVICTION: tl.constexpr):
    """A block of the gradient row: ``grad · scale``, 0 on an ignored row and NaN on a row with a bad target, stored
    in the gradient's dtype."""
    grad = tl.where(is_valid, grad * scale, 0.0)
    grad = tl.where(is_bad, float("nan"), grad)
    tl.store(ptrs, grad.to(ptrs.dtype.element_ty), mask=col_mask, eviction_policy=EVICTION)


@triton.jit
def _soft_row_target(target_ptr, mix_ptr, lambda_ptr, lambda_stride, logits_row, row, num_classes, ignore_index,
                     one_minus_a, zero, DENSE: tl.constexpr, HAS_MIX: tl.constexpr):
    """The row's target: ``(is_valid, is_bad, y, m, λ (1-a), (1-λ)(1-a), w_y, w_m, z_y, z_m, m ≠ y)``.

    Compact: ``y`` and ``m`` are the safe column indices (a bad row reads class 0 and is poisoned with NaN by the
    caller; a bad mix or a λ outside [0, 1] or NaN makes the row bad as a bad target does); without a mix ``m = y``
    and λ = 1. The first two weights are the target's and the mix's own, ``w_y`` and ``w_m`` those of the distinct
    columns. Dense: every row is valid and none is bad; the compact form's values are stand-ins, never read."""
    if DENSE:
        is_valid = row >= 0  # no ignored rows
        is_bad = row < 0
        safe_target = row
        safe_mix = row
        w_target = zero
        w_mix = zero
        w_y = zero
        w_m = zero
        z_target = zero
        z_mix = zero
        distinct = is_bad
    else:
        target = tl.load(target_ptr + row).to(tl.int64)
        is_valid = target != ignore_index
        in_range = (target >= 0) & (target < num_classes)
        is_bad = is_valid & ((target < 0) | (target >= num_classes))
        safe_target = tl.where(in_range, target, 0)  # bad rows read class 0 and are poisoned with NaN below
        if HAS_MIX:
            mix = tl.load(mix_ptr + row).to(tl.int64)
            mix_in_range = (mix >= 0) & (mix < num_classes)
            is_bad = is_bad | (is_valid & ((mix < 0) | (mix >= num_classes)))
            safe_mix = tl.where(mix_in_range & in_range, mix, safe_target)
            lam = tl.load(lambda_ptr + row * lambda_stride)
            # a λ outside [0, 1] (or NaN) makes the row NaN, as a bad mix_target does; the flag names it
            is_bad = is_bad | (is_valid & ~((lam >= 0) & (lam <= 1)))
            lam = lam.to(tl.float32)
            w_target = one_minus_a * lam
            w_mix = one_minus_a * (1.0 - lam)
        else:
            safe_mix = safe_target
            w_target = one_minus_a + zero
            w_mix = zero
        z_target = tl.load(logits_row + safe_target).to(tl.float32)
        z_mix = tl.load(logits_row + safe_mix).to(tl.float32)
        # a mix onto the target itself merges its weight into the target's
        distinct = safe_mix != safe_target
        w_y = tl.where(distinct, w_target, w_target + w_mix)
        w_m = tl.where(distinct, w_mix, 0.0)
    return is_valid, is_bad, safe_target, safe_mix, w_target, w_mix, w_y, w_m, z_target, z_mix, distinct


@triton.jit
def _soft_single_read_statistics(logits_row, target_row, cols, num_classes, safe_target, safe_mix, one_minus_a, c,
                                 a_minus_c, norm, zero, DENSE: tl.constexpr, DENSE_FLAGS: tl.constexpr,
                                 GAPS: tl.constexpr, POWERS: tl.constexpr, SQUARES: tl.constexpr,
                                 NORM_IS_TWO: tl.constexpr, STATS: tl.constexpr):
    """The statistics of a row held in one block: ``(mask, z, e, raw, t, m_safe, Σe, gap, Σq, Σ e(1-t), Σ e t, Σt,
    Σt², given Σ, not_nonneg, top_index)`` with ``e = e^{z - m}``, the sums of :func:`_dense_sums` (dense; ``raw`` and
    ``t`` the target's entries and smoothed values, and with DENSE_FLAGS the entries' float32 sum and count of
    negative or NaN ones) or of :func:`_compact_sums` (compact), and with STATS the first column of the max
    (:func:`._row_helpers._first_top_index`). Values a form does not have are the stand-in ``zero`` (or ``e``), never
    read."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    sum_e_omt = zero
    sum_e_t = zero
    sum_t = zero
    sum_t_sq = zero
    given_sum = zero
    not_nonneg = zero
    col_mask = cols < num_classes
    z = tl.load(logits_row + cols, mask=col_mask, other=NEG_INF).to(tl.float32)
    m = tl.max(z, 0)
    top_index = num_classes
    if STATS:
        top_index = _first_top_index(z, cols, m, num_classes)
    m_safe = tl.where(m == NEG_INF, 0.0, m)
    e = tl.exp2((z - m_safe) * LOG2E)
    if DENSE:
        raw = tl.load(target_row + cols, mask=col_mask, other=0.0).to(tl.float32)
        t, one_minus_t = _smoothed_target(raw, col_mask, one_minus_a, c, a_minus_c)
        sum_e, gap, sum_q, sum_e_omt, sum_e_t, sum_t, sum_t_sq = _dense_sums(z, e, t, one_minus_t, m_safe, SQUARES)
        if DENSE_FLAGS:
            given_sum = tl.sum(raw, 0)
            not_nonneg = tl.sum(((raw < 0.0) | (raw != raw)).to(tl.int32), 0)
    else:
        raw = e  # placeholder
        t = e
        special = (cols == safe_target) | (cols == safe_mix)
        sum_e, gap, sum_q = _compact_sums(z, e, special, col_mask, m_safe, norm, GAPS, POWERS, NORM_IS_TWO)
    return (col_mask, z, e, raw, t, m_safe, sum_e, gap, sum_q, sum_e_omt, sum_e_t, sum_t, sum_t_sq, given_sum,
            not_nonneg, top_index)


@triton.jit
def _soft_streamed_statistics(logits_row, target_row, cols, num_classes, safe_target, safe_mix, one_minus_a, c,
                              a_minus_c, norm, zero, BLOCK: tl.constexpr, DENSE: tl.constexpr,
                              DENSE_FLAGS: tl.constexpr, GAPS: tl.constexpr, POWERS: tl.constexpr,
                              SQUARES: tl.constexpr, NORM_IS_TWO: tl.constexpr, STATS: tl.constexpr):
    """The statistics pass of a row read in chunks of BLOCK classes, with the online max: the tuple of
    :func:`_soft_single_read_statistics`, whose row vectors (mask, z, e, raw, t) are the stand-in ``zero`` here and
    whose first column of the max follows the running max (:func:`._row_helpers._running_top_index`). The dense
    target is asked to stay in L2 beside the logits for the later passes."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    m = tl.full((), NEG_INF, tl.float32)
    m_safe = zero
    sum_e = zero
    gap = zero
    sum_q = zero
    sum_e_omt = zero
    sum_e_t = zero
    sum_t = zero
    sum_t_sq = zero
    given_sum = zero
    not_nonneg = tl.full((), 0, tl.int32)
    top_index = num_classes + tl.zeros((), tl.int32)  # no column yet
    for start in range(0, num_classes, BLOCK):
        offs = start + cols
        z, col_mask, m_new, m_new_safe, rescale = _statistics_chunk(logits_row, offs, num_classes, m)
        if STATS:
            top_index = _running_top_index(top_index, z, cols, start, m, m_new, BLOCK)
        e = tl.exp2((z - m_new_safe) * LOG2E)
        if NORM_IS_TWO:
            rescale_q = rescale * rescale
        else:
            rescale_q = tl.exp2((m - m_new_safe) * (norm * LOG2E))
        if DENSE:
            raw = tl.load(target_row + offs, mask=col_mask, other=0.0, eviction_policy="evict_last")
            raw_f32 = raw.to(tl.float32)
            if DENSE_FLAGS:
                given_sum += tl.sum(raw_f32, 0)
                not_nonneg += tl.sum(((raw_f32 < 0.0) | (raw_f32 != raw_f32)).to(tl.int32), 0)
            t, one_minus_t = _smoothed_target(raw_f32, col_mask, one_minus_a, c, a_minus_c)
            b_e, b_gap, b_q, b_e_omt, b_e_t, b_t, b_t_sq = _dense_sums(z, e, t, one_minus_t, m_new_safe, SQUARES)
            # Σ t (m - z) follows the max: + (m_new - m_old) Σt of the columns seen so far
            gap = gap + (m_new_safe - m_safe) * sum_t + b_gap
            sum_e_omt = sum_e_omt * rescale + b_e_omt
            sum_e_t = sum_e_t * rescale + b_e_t
            sum_t += b_t
            sum_t_sq += b_t_sq
        else:
            special = (offs == safe_target) | (offs == safe_mix)
            b_e, b_gap, b_q = _compact_sums(z, e, special, col_mask, m_new_safe, norm, GAPS, POWERS, NORM_IS_TWO)
            if GAPS:
                gap = gap + (m_new_safe - m_safe) * start + b_gap
        sum_e = sum_e * rescale + b_e
        sum_q = sum_q * rescale_q + b_q
        m = m_new
        m_safe = m_new_safe
    return (zero, zero, zero, zero, zero, m_safe, sum_e, gap, sum_q, sum_e_omt, sum_e_t, sum_t, sum_t_sq, given_sum,
            not_nonneg, top_index)


@triton.jit
def _store_dense_row_flag(dense_bad_ptr, row, given_sum, not_nonneg, dense_tolerance):
    """``dense_bad[row]``: 1 where an entry of the dense target row is negative or NaN or their float32 sum is off 1
    by more than ``dense_tolerance`` (or NaN), else 0."""
    dense_bad = (not_nonneg > 0) | (tl.abs(given_sum - 1.0) > dense_tolerance) | (given_sum != given_sum)
    tl.store(dense_bad_ptr + row, dense_bad.to(tl.int8))


@triton.jit
def _dense_row_scalars(z, t, m_safe, sum_e, gap, sum_e_omt, sum_e_t, sum_t, zero, SINGLE_READ: tl.constexpr):
    """The tuple of :func:`_compact_row_scalars` for a dense row from its statistics (``d = Σe``): ``log2 d``,
    ``1/d``, CE, ``1 - P``, ``P`` and FLSD's band value, term by term from the row's ``z`` and ``t`` where they are
    held in registers (SINGLE_READ), else ``P``; the compact form's values are the stand-in ``zero``, never read."""
    LN2: tl.constexpr = 0.6931471805599453
    d = sum_e
    log2_d = tl.log2(d)
    inv_d = 1.0 / d
    # CE = Σ_k t_k (lse - z_k) = Σ t (m - z) + Σt log d: non-negative terms only
    cross_entropy = gap + sum_t * (log2_d * LN2)
    # 1 - P = Σ_k t_k (1 - p_k) = Σ_k p_k (1 - t_k) + (Σt - 1): no 1 - p_k, so no cancellation at p_k → 1
    one_minus_P = tl.maximum(sum_e_omt * inv_d + (sum_t - 1.0), 0.0)
    P = sum_e_t * inv_d
    if SINGLE_READ:
        p_band = tl.sum(t * tl.exp(z - (m_safe + tl.log(d))), 0)
    else:
        p_band = P
    return (log2_d, inv_d, cross_entropy, one_minus_P, P, zero, zero, zero, zero, zero, zero, zero, p_band)


@triton.jit
def _compact_row_scalars(z_target, z_mix, distinct, w_target, w_mix, w_y, w_m, c, a_minus_c, m_safe, d_rest, gap,
                         num_classes, SMOOTH: tl.constexpr):
    """The per-row scalars of a compact row from its statistics (``d_rest``: Σe over the other columns): ``(log2 d,
    1/d, CE, 1 - P, P, Q, p_y, p_m, t_y - P, t_m - P, p_y - t_y, p_m - t_m, FLSD's band value)``, each without
    cancellation (the module's docstring)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    e_target = tl.exp2((z_target - m_safe) * LOG2E)
    e_mix = tl.where(distinct, tl.exp2((z_mix - m_safe) * LOG2E), 0.0)
    d = d_rest + e_target + e_mix
    log2_d = tl.log2(d)
    inv_d = 1.0 / d
    p_y = tl.exp2((z_target - m_safe) * LOG2E - log2_d)
    p_m = tl.exp2((z_mix - m_safe) * LOG2E - log2_d)
    # 1 - p_y and 1 - p_m as sums over the other classes (never a difference)
    one_minus_p_y = (d_rest + e_mix) * inv_d
    one_minus_p_m = tl.where(distinct, (d_rest + e_target) * inv_d, one_minus_p_y)
    nll_y = _neg_log_probability(z_target, e_target, d_rest + e_mix, p_y, m_safe, log2_d)
    nll_m = _neg_log_probability(z_mix, e_mix, d_rest + e_target, p_m, m_safe, log2_d)
    # CE = w_y (-log p_y) + w_m (-log p_m) + c Σ_k (lse - z_k); a zero weight takes no part (-inf logits)
    cross_entropy = tl.where(w_y > 0.0, w_y * nll_y, 0.0) + tl.where(w_m > 0.0, w_m * nll_m, 0.0)
    if SMOOTH:
        cross_entropy += c * (gap + num_classes * (log2_d * LN2))
    one_minus_P = a_minus_c + w_y * one_minus_p_y + w_m * one_minus_p_m
    Q = w_y * p_y + w_m * p_m
    P = c + Q
    t_minus_P_target = w_y * one_minus_p_y - w_m * p_m
    t_minus_P_mix = w_m * one_minus_p_m - w_y * p_y
    # p - t of the two columns, as (1 - t) - (1 - p) where p > 1/2
    delta_target = tl.where(p_y > 0.5, (a_minus_c + w_m) - one_minus_p_y, p_y - (c + w_y))
    delta_mix = tl.where(p_m > 0.5, (a_minus_c + w_y) - one_minus_p_m, p_m - (c + w_m))
    # FLSD's band value, the closed form every implementation evaluates (without a mix: w_m = 0, m = y)
    lse = m_safe + tl.log(d)
    p_band = (w_target * tl.exp(z_target - lse) + w_mix * tl.exp(z_mix - lse)) + c
    return (log2_d, inv_d, cross_entropy, one_minus_P, P, Q, p_y, p_m, t_minus_P_target, t_minus_P_mix, delta_target,
            delta_mix, p_band)


@triton.jit
def _dense_brier_sums(p, raw, col_mask, one_minus_a, c, sum_q, inv_d, P, sum_t_sq, zero, norm,
                      SINGLE_READ: tl.constexpr, MODE: tl.constexpr, NORM_IS_TWO: tl.constexpr):
    """``(S, H)`` of a dense row without another read: term by term from the row's ``p`` and entries ``raw`` held in
    registers (SINGLE_READ), else for q = 2 from the statistics pass's sums; ``H`` only in loss mode (else 0)."""
    brier_s = zero
    brier_h_sum = zero
    if SINGLE_READ:
        delta = p - (raw * one_minus_a + c)
        brier_s = tl.sum(tl.where(col_mask, _brier_power(delta, norm, NORM_IS_TWO), 0.0), 0)
        if MODE == _LOSS_MODE:
            brier_h_sum = tl.sum(tl.where(col_mask, _brier_h(delta, norm, NORM_IS_TWO) * p, 0.0), 0)
    else:
        # Σ (p - t)² = Σp² - 2P + Σt², H = 2 (Σp² - P), from the statistics pass
        p_sq = sum_q * inv_d * inv_d
        brier_s = tl.maximum(p_sq - 2.0 * P + sum_t_sq, 0.0)
        brier_h_sum = 2.0 * (p_sq - P)
    return brier_s, brier_h_sum


@triton.jit
def _reread_brier_sums(logits_row, target_row, cols, num_classes, m_safe, log2_d, one_minus_a, c, a_minus_c, t_sum,
                       P, one_minus_P, safe_target, safe_mix, delta_target, delta_mix, t_minus_P_target,
                       t_minus_P_mix, Q, zero, norm, DENSE: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr,
                       NORM_IS_TWO: tl.constexpr):
    """``(S, H)`` by one more read of the row once ``d`` is known, for q ≠ 2 where ``|p_k - t_k|`` depends on ``d``
    (a dense target, or a smoothed compact one on the two-read path); ``H`` only in loss mode (else 0)."""
    brier_s = zero
    brier_h_sum = zero
    for start in range(0, num_classes, BLOCK):
        col_mask, p, delta, ce_delta, t_minus_P = _load_soft_chunk(
            logits_row, target_row, start + cols, num_classes, m_safe, log2_d, DENSE, "evict_last",
            one_minus_a, c, a_minus_c, t_sum, P, one_minus_P, safe_target, safe_mix, delta_target, delta_mix,
            t_minus_P_target, t_minus_P_mix, Q)
        brier_s += tl.sum(tl.where(col_mask, _brier_power(delta, norm, NORM_IS_TWO), 0.0), 0)
        if MODE == _LOSS_MODE:
            brier_h_sum += tl.sum(tl.where(col_mask, _brier_h(delta, norm, NORM_IS_TWO) * p, 0.0), 0)
    return brier_s, brier_h_sum


@triton.jit
def _compact_brier_sums(p, col_mask, cols, safe_target, safe_mix, distinct, c, p_y, p_m, delta_target, delta_mix,
                        sum_q, d_rest, inv_d, log2_d, num_classes, zero, norm, SINGLE_READ: tl.constexpr,
                        MODE: tl.constexpr, NORM_IS_TWO: tl.constexpr):
    """``(S, H)`` of a compact row without another read: the other columns' terms (``t = c``) term by term in
    registers (SINGLE_READ), or for q = 2 or without smoothing in closed form from the statistics pass's sums, then
    the target and mix columns' own (``H`` of the other columns only in loss mode)."""
    brier_s = zero
    brier_h_sum = zero
    if SINGLE_READ:
        # term by term in registers (no cancellation in Σ (p - c)²)
        rest = col_mask & (cols != safe_target) & (cols != safe_mix)
        brier_s = tl.sum(tl.where(rest, _brier_power(p - c, norm, NORM_IS_TWO), 0.0), 0)
        if MODE == _LOSS_MODE:
            brier_h_sum = tl.sum(tl.where(rest, _brier_h(p - c, norm, NORM_IS_TWO) * p, 0.0), 0)
    elif NORM_IS_TWO:
        # Σ_rest (p - c)² = Σ_rest p² - 2c p_rest + n_rest c²,  Σ_rest h p = 2 (Σ_rest p² - c p_rest)
        p_sq = sum_q * inv_d * inv_d
        p_rest = d_rest * inv_d
        n_rest = (num_classes - 1) - distinct.to(tl.int32)
        brier_s = tl.maximum(p_sq + c * (n_rest * c - 2.0 * p_rest), 0.0)
        brier_h_sum = 2.0 * (p_sq - c * p_rest)
    else:
        # no smoothing: t = 0 on the other columns, Σ_rest p^q = Σ_rest e^q / d^q, Σ_rest h p = q Σ_rest p^q
        brier_s = tl.exp2(tl.log2(sum_q) - norm * log2_d)
        brier_h_sum = norm * brier_s
    brier_s += _brier_power(delta_target, norm, NORM_IS_TWO)
    brier_s += tl.where(distinct, _brier_power(delta_mix, norm, NORM_IS_TWO), 0.0)
    brier_h_sum += _brier_h(delta_target, norm, NORM_IS_TWO) * p_y
    brier_h_sum += tl.where(distinct, _brier_h(delta_mix, norm, NORM_IS_TWO) * p_m, 0.0)
    return brier_s, brier_h_sum


@triton.jit
def _soft_streamed_gradient(grad_row, logits_row, target_row, cols, num_classes, m_safe, log2_d, one_minus_a, c,
                            a_minus_c, t_sum, P, one_minus_P, safe_target, safe_mix, grad_target, grad_mix, Q, u,
                            coef_focal, coef_brier, brier_h_sum, scale, is_valid, is_bad, norm, DENSE: tl.constexpr,
                            FORMULA: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr,
                            NORM_IS_TWO: tl.constexpr):
    """The gradient pass of a row read in chunks of BLOCK classes (:func:`_soft_block_gradient` per chunk), last chunk
    first: the chunks read most recently are the likeliest still in L2."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    num_chunks = tl.cdiv(num_classes, BLOCK)
    for chunk in range(0, num_chunks):
        offs = (num_chunks - 1 - chunk) * BLOCK + cols
        col_mask = offs < num_classes
        z = tl.load(logits_row + offs, mask=col_mask, other=NEG_INF, eviction_policy="evict_first")
        p = tl.exp2((z.to(tl.float32) - m_safe) * LOG2E - log2_d)
        raw = p
        if DENSE:
            raw = tl.load(target_row + offs, mask=col_mask, other=0.0, eviction_policy="evict_first")
            raw = raw.to(tl.float32)
        grad = _soft_block_gradient(p, offs, raw, DENSE, one_minus_a, c, a_minus_c, t_sum, P, one_minus_P,
                                    safe_target, safe_mix, grad_target, grad_mix, Q, u, coef_focal, coef_brier,
                                    brier_h_sum, norm, FORMULA, MODE, NORM_IS_TWO)
        _store_gradient(grad_row + offs, grad, col_mask, scale, is_valid, is_bad, "evict_first")


@triton.jit
def _soft_target_ce_fwd_kernel(
    logits_ptr, logits_row_stride,
    target_ptr, target_row_stride, mix_ptr, lambda_ptr, lambda_stride,
    sample_weight_ptr, gamma_ptr,
    row_loss_ptr, grad_ptr, grad_row_stride, confidence_ptr, prediction_ptr,
    valid_count_ptr, dense_bad_ptr, loss_ptr, error_ptr, counter_ptr,
    num_rows, num_classes, gamma, norm, ignore_index, smoothing, dense_tolerance,
    WEIGHT: tl.constexpr, MODE: tl.constexpr, REDUCTION: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, PER_SAMPLE_GAMMA: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE_READ: tl.constexpr, NORM_IS_TWO: tl.constexpr,
    DENSE: tl.constexpr, HAS_MIX: tl.constexpr, SMOOTH: tl.constexpr, DENSE_FLAGS: tl.constexpr,
    COUNT: tl.constexpr, CHECK_TARGETS: tl.constexpr, FINISH_BLOCK: tl.constexpr, STATS: tl.constexpr,
):
    """Row losses and gradient rows for soft targets, one program per row: a dense ``target (N, C)`` (DENSE) or
    class indices with an optional mix (HAS_MIX: ``mix_target (N,)``, λ at ``lambda_ptr + row * lambda_stride``),
    both with label smoothing ``a = smoothing`` (SMOOTH: ``a > 0``). A dense row's value check rides on its reads
    (DENSE_FLAGS): ``dense_bad_ptr[row]`` is 1 where an entry is negative or NaN or the entries' float32 sum is off 1
    by more than ``dense_tolerance``, else 0. STATS: the logits' top-label statistics (``_store_top_label``)."""
    # the weight's formula and whether its γ follows FLSD-53's bands, as in the hard-target kernel
    FORMULA: tl.constexpr = _FOCAL if WEIGHT == _FLSD else (_BRIER if WEIGHT == _BRIER_FLSD else WEIGHT)
    FLSD_SCHEDULE: tl.constexpr = WEIGHT == _FLSD or WEIGHT == _BRIER_FLSD
    IS_BRIER: tl.constexpr = FORMULA == _BRIER
    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    target_row = target_ptr + row * target_row_stride
    cols = tl.arange(0, BLOCK)
    zero = tl.full((), 0.0, tl.float32)
    # t_k = c + w_y [k = y] + w_m [k = m] (compact) or (1-a) T_k + c (dense); a - c = c (C - 1) = Σ_k c (1 - p_k)
    one_minus_a = 1.0 - smoothing
    c = smoothing / num_classes
    a_minus_c = smoothing - c

    # ---- the row's target ---------------------------------------------------------------------------------------
    is_valid, is_bad, safe_target, safe_mix, w_target, w_mix, w_y, w_m, z_target, z_mix, distinct = _soft_row_target(
        target_ptr, mix_ptr, lambda_ptr, lambda_stride, logits_row, row, num_classes, ignore_index, one_minus_a, zero,
        DENSE, HAS_MIX)

    # ---- statistics: one pass (single read) or the streamed statistics pass with the online max -----------------
    GAPS: tl.constexpr = SMOOTH
    POWERS: tl.constexpr = IS_BRIER and (NORM_IS_TWO or not SMOOTH)
    SQUARES: tl.constexpr = IS_BRIER and NORM_IS_TWO
    if SINGLE_READ:
        statistics = _soft_single_read_statistics(logits_row, target_row, cols, num_classes, safe_target, safe_mix,
                                                  one_minus_a, c, a_minus_c, norm, zero, DENSE, DENSE_FLAGS, GAPS,
                                                  POWERS, SQUARES, NORM_IS_TWO, STATS)
    else:
        statistics = _soft_streamed_statistics(logits_row, target_row, cols, num_classes, safe_target, safe_mix,
                                               one_minus_a, c, a_minus_c, norm, zero, BLOCK, DENSE, DENSE_FLAGS, GAPS,
                                               POWERS, SQUARES, NORM_IS_TWO, STATS)
    (col_mask, z, e, raw, t, m_safe, sum_e, gap, sum_q, sum_e_omt, sum_e_t, sum_t, sum_t_sq, given_sum,
     not_nonneg, top_index) = statistics

    # ---- per-row scalars: CE, 1 - P, FLSD's band value, and the compact form's target / mix columns -------------
    if DENSE:
        if DENSE_FLAGS:
            _store_dense_row_flag(dense_bad_ptr, row, given_sum, not_nonneg, dense_tolerance)
        row_scalars = _dense_row_scalars(z, t, m_safe, sum_e, gap, sum_e_omt, sum_e_t, sum_t, zero, SINGLE_READ)
    else:
        row_scalars = _compact_row_scalars(z_target, z_mix, distinct, w_target, w_mix, w_y, w_m, c, a_minus_c, m_safe,
                                           sum_e, gap, num_classes, SMOOTH)
        sum_t = zero + 1.0  # placeholder: Σ_k t_k = 1
    (log2_d, inv_d, cross_entropy, one_minus_P, P, Q, p_y, p_m, t_minus_P_target, t_minus_P_mix, delta_target,
     delta_mix, p_band) = row_scalars
    if STATS:
        _store_top_label(confidence_ptr, prediction_ptr, logits_row, row, inv_d, top_index, num_classes, is_valid,
                         BLOCK)

    # ---- the Brier weight's S = Σ |p - t|^q and H = Σ h_k p_k -------------------------------------------------------
    # In registers a row vector that stays live across the weight's scalar chain is 32-64 registers per thread at the
    # largest blocks, so the columns are formed where they are used, from p (and a dense row's entries) alone: a
    # δ, Σt p - t or t - P vector formed before the chain and kept to the gradient made the float32 rows of 16384 and
    # 32768 classes spill (docs/performance.md, "Registers").
    brier_s = zero
    brier_h_sum = zero
    p = e  # a stand-in on the two-read path, whose passes form p chunk by chunk
    if SINGLE_READ:
        p = e * inv_d
    if IS_BRIER:
        if DENSE and (SINGLE_READ or NORM_IS_TWO):
            brier_s, brier_h_sum = _dense_brier_sums(p, raw, col_mask, one_minus_a, c, sum_q, inv_d, P, sum_t_sq,
                                                     zero, norm, SINGLE_READ, MODE, NORM_IS_TWO)
        elif DENSE or (SMOOTH and not SINGLE_READ and not NORM_IS_TWO):
            brier_s, brier_h_sum = _reread_brier_sums(
                logits_row, target_row, cols, num_classes, m_safe, log2_d, one_minus_a, c, a_minus_c, sum_t, P,
                one_minus_P, safe_target, safe_mix, delta_target, delta_mix, t_minus_P_target, t_minus_P_mix, Q, zero,
                norm, DENSE, MODE, BLOCK, NORM_IS_TWO)
        else:
            brier_s, brier_h_sum = _compact_brier_sums(p, col_mask, cols, safe_target, safe_mix, distinct, c, p_y, p_m,
                                                       delta_target, delta_mix, sum_q, sum_e, inv_d, log2_d,
                                                       num_classes, zero, norm, SINGLE_READ, MODE, NORM_IS_TWO)

    # ---- weight, loss ----------------------------------------------------------------------------------------------
    u, coef_focal, coef_brier = _soft_weight(row, cross_entropy, one_minus_P, p_band, brier_s, sample_weight_ptr,
                                             gamma_ptr, gamma, norm, FORMULA, FLSD_SCHEDULE, MODE, PER_SAMPLE_GAMMA)
    _store_row_loss(row_loss_ptr, row, u, cross_entropy, is_valid, is_bad)

    # ---- gradient of the reduced loss for grad_output = 1 ----------------------------------------------------------
    if COMPUTE_GRAD:
        scale = _gradient_scale(valid_count_ptr, target_ptr, num_rows, num_classes, ignore_index, REDUCTION, COUNT,
                                FINISH_BLOCK)
        grad_row = grad_ptr + row * grad_row_stride
        grad_target = zero  # a dense row has no target or mix column
        grad_mix = zero
        if not DENSE:
            # the target and mix columns' gradients, once per row (the other columns have t = c, t - P = -Q)
            grad_target = _soft_gradient(p_y, delta_target, delta_target, t_minus_P_target, u, coef_focal, coef_brier,
                                         brier_h_sum, norm, FORMULA, MODE, NORM_IS_TWO)
            grad_mix = _soft_gradient(p_m, delta_mix, delta_mix, t_minus_P_mix, u, coef_focal, coef_brier,
                                      brier_h_sum, norm, FORMULA, MODE, NORM_IS_TWO)
        if SINGLE_READ:
            grad = _soft_block_gradient(p, cols, raw, DENSE, one_minus_a, c, a_minus_c, sum_t, P, one_minus_P,
                                        safe_target, safe_mix, grad_target, grad_mix, Q, u, coef_focal, coef_brier,
                                        brier_h_sum, norm, FORMULA, MODE, NORM_IS_TWO)
            _store_gradient(grad_row + cols, grad, col_mask, scale, is_valid, is_bad, "")
        else:
            _soft_streamed_gradient(grad_row, logits_row, target_row, cols, num_classes, m_safe, log2_d, one_minus_a,
                                    c, a_minus_c, sum_t, P, one_minus_P, safe_target, safe_mix, grad_target, grad_mix,
                                    Q, u, coef_focal, coef_brier, brier_h_sum, scale, is_valid, is_bad, norm, DENSE,
                                    FORMULA, MODE, BLOCK, NORM_IS_TWO)
    if REDUCTION != _REDUCTION_NONE or CHECK_TARGETS or DENSE_FLAGS:
        _finish(row_loss_ptr, target_ptr, dense_bad_ptr, valid_count_ptr, loss_ptr, error_ptr, counter_ptr,
                mix_ptr, lambda_ptr, lambda_stride, num_rows, num_classes, ignore_index, REDUCTION, COUNT,
                CHECK_TARGETS, DENSE_FLAGS, HAS_MIX, FINISH_BLOCK)
