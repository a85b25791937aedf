"""Triton forward kernel of the fused uncertainty-weighted cross-entropy for class-index (hard) targets
(docs/losses.md); launched by :mod:`calibkernels.triton.uncertainty_weighted_ce`.

Per row ``i`` with logits ``z_i (C,)``, target ``y_i`` and ``p_i = softmax(z_i)``, one program computes

    CE_i = lse_i - z_{i,y_i},      L_i = u_i · CE_i,

with the uncertainty weight ``u_i`` of :mod:`calibkernels.reference` (none / focal / FLSD-53 / dual focal / generalised
Brier score / external / generalised Brier score with FLSD-53's γ_i), and, in the same launch, the gradient of the
*reduced* loss for ``grad_output = 1``:

    mode="grad" (GRA):   dL_i/dz_ik = u_i (p_ik - e_ik)
    mode="loss":         dL_i/dz_ik = u_i (p_ik - e_ik) + CE_i du_i/dz_ik

    focal / FLSD       du/dz_k = -γ (1-p_y)^{γ-1} p_y (δ_ky - p_k)                      (γ_i of FLSD not differentiated)
    dual focal         du/dz_k = γ (1-p_y+p_j)^{γ-1} (p_j (τ_k - p_k) - p_y (δ_ky - p_k)),   p_j = max{p_k : z_k < z_y},
                       τ_k = 1/n on the n classes tied at p_j (how ``amax``'s backward splits the gradient)
    Brier (q, γ)       u = S^{γ/q},  S = Σ_{k≠y} p_k^q + (1-p_y)^q,
                       du/dz_k = γ S^{γ/q-1} (h_k - p_k H),  h_k = p_k^q (k≠y),  h_y = -p_y (1-p_y)^{q-1},  H = Σ_k h_k
    Brier-FLSD         the Brier weight with γ_i of FLSD in place of γ (γ_i not differentiated)

FLSD-53's γ_i (5 where the band value is below 0.2f, 3 below 0.5f, else γ) belongs to the focal weight (``flsd``) and
to the Brier weight (``brier_flsd``): each kernel splits its weight code into the formula and whether γ follows the
bands (``weight_formula`` / ``uses_flsd_schedule``, as ``csrc/uncertainty_weighted_ce.h`` does), both compile-time
constants, so every weight compiles only its own branch.

(Lin et al. 2017; Mukhoti et al. 2020; Tao, Dong & Xu, ICML 2023; the BSCE-GRA paper, Eq. 3/11.)

Kernel design (docs/performance.md):

* One program per row; online softmax with ``exp2``; the running max ``m``, the sum ``d = Σ e^{z-m}``, the sum over the
  non-target classes ``d_¬y`` (so ``1 - p_y = d_¬y / d`` never cancels), the gBS accumulator ``Σ_{k≠y} e^{q(z-m)}``
  (rescaled by ``e^{-qΔm}`` when the max moves) and dual focal's running ``max{z_k < z_y}`` with its tie count are all
  accumulators of the same pass; ``z_y`` is loaded first.
* All arithmetic in fp32 whatever the logits' dtype; offsets in int64; the row stride is an argument (sliced logits
  need no copy); the target entry of the gradient, ``-c (1 - p_y) + …``, is formed in fp32 before the single cast.
* SINGLE_READ: the whole row in one block, read once, its gradient written once. Otherwise two reads over chunks of
  BLOCK classes: the statistics pass asks L2 to keep the row and the gradient pass walks the chunks backwards, so the
  second read mostly hits L2.
* An out-of-range target reads class 0 (never out of bounds) and makes its row's loss and gradient NaN; the launch's
  last program flags it (:func:`._row_helpers._finish`).
* STATS (``return_stats=True``): the row's top-label statistics from the same read, ``1/d`` and the first column of
  the max (on the two-read path, of the running max while the statistics pass streams; a row with a NaN, rare, is
  read once more for its first NaN, as ``torch.argmax``); compiled out otherwise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._row_helpers import (_BRIER, _BRIER_FLSD, _DUAL_FOCAL, _EXTERNAL, _FLSD, _FOCAL, _LOSS_MODE, _NONE,
                           _REDUCTION_NONE, _finish, _first_top_index, _gradient_scale, _pow, _row_gamma,
                           _running_top_index, _statistics_chunk, _store_row_loss, _store_top_label)


@triton.jit
def _hard_single_read_statistics(logits_row, cols, num_classes, safe_target, z_target, norm, FORMULA: tl.constexpr,
                                 NORM_IS_TWO: tl.constexpr, STATS: tl.constexpr):
    """The statistics of a row held in one block: ``(z, mask, e, is_target_col, m_safe, d_¬y, Σ_{k≠y} e^{q(z-m)},
    below, max{z < z_y}, n_ties, top_index)`` with ``e = e^{z - m}`` and ``below = z < z_y``; the gBS sum only for the
    Brier weight, the next three only for dual focal (otherwise stand-ins that are never read), the first column of
    the max (:func:`._row_helpers._first_top_index`) only with STATS."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    col_mask = cols < num_classes
    z = tl.load(logits_row + cols, mask=col_mask, other=NEG_INF).to(tl.float32)
    m = tl.max(z, 0)
    top_index = num_classes
    if STATS:
        top_index = _first_top_index(z, cols, m, num_classes)
    m_safe = tl.where(m == NEG_INF, 0.0, m)  # an all -inf row must not produce inf - inf
    e = tl.exp2((z - m_safe) * LOG2E)
    is_target_col = cols == safe_target
    e_others = tl.where(is_target_col, 0.0, e)
    d_others = tl.sum(e_others, 0)
    sum_q_others = d_others
    below = col_mask
    z_below_max = m_safe
    n_ties = d_others
    if FORMULA == _BRIER:
        if NORM_IS_TWO:
            sum_q_others = tl.sum(e_others * e_others, 0)
        else:
            sum_q_others = tl.sum(tl.where(is_target_col, 0.0, tl.exp2((z - m_safe) * (norm * LOG2E))), 0)
    if FORMULA == _DUAL_FOCAL:
        below = z < z_target
        z_below_max = tl.max(tl.where(below, z, NEG_INF), 0)
        n_ties = tl.sum(tl.where(below & (z == z_below_max), 1.0, 0.0), 0)
    return z, col_mask, e, is_target_col, m_safe, d_others, sum_q_others, below, z_below_max, n_ties, top_index


@triton.jit
def _hard_streamed_statistics(logits_row, cols, num_classes, safe_target, z_target, norm, FORMULA: tl.constexpr,
                              BLOCK: tl.constexpr, NORM_IS_TWO: tl.constexpr, STATS: tl.constexpr):
    """The statistics pass of a row read in chunks of BLOCK classes, with the online max: ``(m_safe, d_¬y,
    Σ_{k≠y} e^{q(z-m)}, max{z < z_y}, n_ties, top_index)``, the gBS sum only for the Brier weight, the next two only
    for dual focal, the first column of the running max (:func:`._row_helpers._running_top_index`) only with STATS.

    Scalar running sums, reduced per chunk, not per-lane sums reduced once after the loop: two more BLOCK-wide live
    vectors cost occupancy, which this memory-bound loop needs more than it needs fewer block reductions
    (docs/performance.md)."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    m_safe = tl.full((), 0.0, tl.float32)
    m = tl.full((), NEG_INF, tl.float32)
    d_others = tl.full((), 0.0, tl.float32)
    sum_q_others = tl.full((), 0.0, tl.float32)
    z_below_max = tl.full((), NEG_INF, tl.float32)
    n_ties = tl.full((), 0.0, tl.float32)
    top_index = num_classes + tl.zeros((), tl.int32)  # no column yet
    for start in range(0, num_classes, BLOCK):
        offs = start + cols
        z, col_mask, m_new, m_new_safe, rescale = _statistics_chunk(logits_row, offs, num_classes, m)
        if STATS:
            top_index = _running_top_index(top_index, z, cols, start, m, m_new, BLOCK)
        e_others = tl.where(offs == safe_target, 0.0, tl.exp2((z - m_new_safe) * LOG2E))
        d_others = d_others * rescale + tl.sum(e_others, 0)
        if FORMULA == _BRIER:
            if NORM_IS_TWO:
                sum_q_others = sum_q_others * (rescale * rescale) + tl.sum(e_others * e_others, 0)
            else:
                sum_q_others = sum_q_others * tl.exp2((m - m_new_safe) * (norm * LOG2E)) + tl.sum(
                    tl.where(offs == safe_target, 0.0, tl.exp2((z - m_new_safe) * (norm * LOG2E))), 0)
        if FORMULA == _DUAL_FOCAL:
            below = z < z_target
            chunk_max = tl.max(tl.where(below, z, NEG_INF), 0)
            chunk_ties = tl.sum(tl.where(below & (z == chunk_max), 1.0, 0.0), 0)
            n_ties = tl.where(chunk_max > z_below_max, chunk_ties,
                              tl.where(chunk_max == z_below_max, n_ties + chunk_ties, n_ties))
            z_below_max = tl.maximum(z_below_max, chunk_max)
        m = m_new
        m_safe = m_new_safe
    return m_safe, d_others, sum_q_others, z_below_max, n_ties, top_index


@triton.jit
def _hard_cross_entropy(z_target, d_others, m_safe):
    """``(d, log2 d, p_y, CE, 1 - p_y)`` of a row from its statistics, with ``d = d_¬y + e^{z_y - m}``.

    Probabilities as p_k = 2^{(z_k - m) log2 e - log2 d}: the max is subtracted first, so z_k - m is exact for the
    classes that matter; 2^{(z_k - lse) log2 e} would carry the rounding of lse = m + ln d, an error of ulp(m) in the
    exponent (~1e-5 relative in p_k for logits of a few hundred), which a loss-mode gradient multiplies by CE."""
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    e_target = tl.exp2((z_target - m_safe) * LOG2E)
    d = d_others + e_target
    log2_d = tl.log2(d)
    p_target = tl.exp2((z_target - m_safe) * LOG2E - log2_d)
    # Confident rows: CE = -log p_y = log1p(d_¬y / e^{z_y - m}); log(d) with d ≈ 1 would keep only the rounding of d.
    # log1p by Kahan's trick (exact log of the rounded 1 + x, rescaled).
    odds_against = d_others / e_target
    one_plus = 1.0 + odds_against
    log1p_odds = tl.where(one_plus == 1.0, odds_against, tl.log(one_plus) * odds_against / (one_plus - 1.0))
    cross_entropy = tl.where(p_target > 0.5, log1p_odds, (m_safe - z_target) + log2_d * LN2)
    one_minus_p = d_others / d  # = 1 - p_y without cancellation
    return d, log2_d, p_target, cross_entropy, one_minus_p


@triton.jit
def _hard_weight(row, cross_entropy, one_minus_p, p_target, z_target, m_safe, d, log2_d, z_below_max, n_ties,
                 sum_q_others, sample_weight_ptr, gamma_ptr, gamma, norm, FORMULA: tl.constexpr,
                 FLSD_SCHEDULE: tl.constexpr, MODE: tl.constexpr, PER_SAMPLE_GAMMA: tl.constexpr,
                 NORM_IS_TWO: tl.constexpr):
    """``(u, coef_p, extra_y, coef_tie, coef_h, h_sum)``: the weight and the coefficients of its row's gradient,

        grad_k = coef_p p_k + coef_tie τ_k + coef_h (p_k^q - p_k H)   (k ≠ y),   grad_y = -coef_p (1-p_y) + extra_y,

    with ``h_sum = H``; ``coef_tie`` only for dual focal and ``coef_h``, ``h_sum`` only for the Brier weight, in loss
    mode (otherwise 0, never read). Under FLSD_SCHEDULE γ is FLSD's γ_i."""
    LOG2E: tl.constexpr = 1.4426950408889634
    coef_p = 1.0
    extra_y = 0.0
    coef_tie = 0.0
    coef_h = 0.0
    h_sum = 0.0
    # Loss mode on a saturated row (1 - p_y = 0, so CE = 0): the CE du/dz terms tend to 0 for every gamma > 0, while
    # du alone is infinite for gamma below 1 (focal, dual focal) or below q (Brier); 0 · inf would give NaN.
    saturated = one_minus_p == 0.0
    if FLSD_SCHEDULE:
        # the band from float32(exp(z_y - lse)), lse = m + log(d), as every implementation computes it (the kernel's
        # own p_y can differ in the last ulp and put a row at a threshold in the other band)
        p_band = tl.exp(z_target - (m_safe + tl.log(d)))
    else:
        p_band = one_minus_p  # not read
    if FORMULA == _NONE:
        u = 1.0
    elif FORMULA == _EXTERNAL:
        u = tl.load(sample_weight_ptr + row).to(tl.float32)
        coef_p = u
    elif FORMULA == _FOCAL:
        g = _row_gamma(row, p_band, gamma, gamma_ptr, FLSD_SCHEDULE, PER_SAMPLE_GAMMA)
        u = _pow(one_minus_p, g)
        coef_p = u
        if MODE == _LOSS_MODE:
            du = tl.where(g == 0.0, 0.0, -g * _pow(one_minus_p, g - 1.0) * p_target)
            coef_p = u - tl.where(saturated, 0.0, cross_entropy * du)
    elif FORMULA == _DUAL_FOCAL:
        p_j = tl.exp2((z_below_max - m_safe) * LOG2E - log2_d)  # 0 when nothing is below z_y
        base = one_minus_p + p_j
        u = _pow(base, gamma)
        coef_p = u
        if MODE == _LOSS_MODE:
            du = tl.where((gamma == 0.0) | saturated, 0.0, gamma * _pow(base, gamma - 1.0))
            coef_p = u + cross_entropy * du * (p_target - p_j)
            extra_y = -cross_entropy * du * p_j
            coef_tie = cross_entropy * du * p_j / tl.maximum(n_ties, 1.0)
    else:  # FORMULA == _BRIER, generalised Brier score
        # Σ_{k≠y} p_k^q = Σ_{k≠y} e^{q(z-m)} / d^q. For q = 2 directly (1 ≤ d ≤ C, so d² cannot overflow): the log-space
        # form below rounds its exponent at |log2 S| ulps, several times the reference's own error, which the loss-mode
        # gradient then multiplies by CE. For other q in log space, so that d^q cannot overflow.
        if NORM_IS_TWO:
            p_q_others = sum_q_others / (d * d)
        else:
            p_q_others = tl.exp2(tl.log2(sum_q_others) - norm * log2_d)
        brier_q = p_q_others + _pow(one_minus_p, norm)
        g = _row_gamma(row, p_band, gamma, gamma_ptr, FLSD_SCHEDULE, False)
        u = _pow(brier_q, g / norm)
        coef_p = u
        if MODE == _LOSS_MODE:
            # S can underflow to 0 before 1 - p_y does (S ~ (1 - p_y)^q): there too the limit of the terms is 0
            du = tl.where((g == 0.0) | saturated | (brier_q == 0.0), 0.0, g * _pow(brier_q, g / norm - 1.0))
            # du/dz_k = γ S^{γ/q-1} (p_k^q - p_k H) is formed before the CE factor (which can be huge) multiplies
            # it: for a dominant non-target class the bracket cancels to ~0 and must stay ~0.
            h_sum = tl.where(saturated, 0.0, p_q_others - p_target * _pow(one_minus_p, norm - 1.0))
            coef_h = cross_entropy * du
            extra_y = -coef_h * p_target * brier_q  # du/dz_y = -γ S^{γ/q-1} p_y S, cancellation-free
    return u, coef_p, extra_y, coef_tie, coef_h, h_sum


@triton.jit
def _store_hard_gradient(grad_row, offs, grad, is_target_col, grad_target, scale, col_mask, is_valid, is_bad,
                         EVICTION: tl.constexpr):
    """A block of the gradient row: ``grad · scale`` off the target column, ``grad_target`` on it, 0 on an ignored row
    and NaN on a row with a bad target, stored in the gradient's dtype."""
    grad = tl.where(is_target_col, grad_target, grad * scale)
    grad = tl.where(is_valid, grad, 0.0)
    grad = tl.where(is_bad, float("nan"), grad)
    tl.store(grad_row + offs, grad.to(grad_row.dtype.element_ty), mask=col_mask, eviction_policy=EVICTION)


@triton.jit
def _hard_single_read_gradient(grad_row, cols, col_mask, z, e, is_target_col, below, z_below_max, m_safe, log2_d,
                               inv_d, coef_p, coef_tie, coef_h, h_sum, grad_target, scale, is_valid, is_bad, norm,
                               FORMULA: tl.constexpr, MODE: tl.constexpr, NORM_IS_TWO: tl.constexpr):
    """The gradient row of a row held in one block, from the statistics pass's ``e`` and the weight's coefficients
    (:func:`_hard_weight`)."""
    LOG2E: tl.constexpr = 1.4426950408889634
    p = e * inv_d
    grad = coef_p * p
    if FORMULA == _DUAL_FOCAL and MODE == _LOSS_MODE:
        grad += tl.where(below & (z == z_below_max), coef_tie, 0.0)
    if FORMULA == _BRIER and MODE == _LOSS_MODE:
        if NORM_IS_TWO:
            grad += coef_h * (p * p - p * h_sum)
        else:
            grad += coef_h * (tl.exp2(((z - m_safe) * LOG2E - log2_d) * norm) - p * h_sum)
    _store_hard_gradient(grad_row, cols, grad, is_target_col, grad_target, scale, col_mask, is_valid, is_bad, "")


@triton.jit
def _hard_streamed_gradient(grad_row, logits_row, cols, num_classes, safe_target, z_target, z_below_max, m_safe,
                            log2_d, coef_p, coef_tie, coef_h, h_sum, grad_target, scale, is_valid, is_bad, norm,
                            FORMULA: tl.constexpr, MODE: tl.constexpr, BLOCK: tl.constexpr,
                            NORM_IS_TWO: tl.constexpr):
    """The gradient pass of a row read in chunks of BLOCK classes: the second read of the logits, last chunk first
    (the chunks read most recently are the likeliest still in L2), with the weight's coefficients
    (:func:`_hard_weight`)."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    num_chunks = tl.cdiv(num_classes, BLOCK)
    for chunk in range(0, num_chunks):
        offs = (num_chunks - 1 - chunk) * BLOCK + cols
        col_mask = offs < num_classes
        z = tl.load(logits_row + offs, mask=col_mask, other=NEG_INF, eviction_policy="evict_first")
        z = z.to(tl.float32)
        log2_p = (z - m_safe) * LOG2E - log2_d
        p = tl.exp2(log2_p)
        grad = coef_p * p
        if FORMULA == _DUAL_FOCAL and MODE == _LOSS_MODE:
            grad += tl.where((z < z_target) & (z == z_below_max), coef_tie, 0.0)
        if FORMULA == _BRIER and MODE == _LOSS_MODE:
            if NORM_IS_TWO:
                grad += coef_h * (p * p - p * h_sum)
            else:
                grad += coef_h * (tl.exp2(log2_p * norm) - p * h_sum)
        _store_hard_gradient(grad_row, offs, grad, offs == safe_target, grad_target, scale, col_mask, is_valid,
                             is_bad, "evict_first")


@triton.jit
def _uncertainty_weighted_ce_row(
    row,
    logits_ptr, logits_row_stride,
    target_ptr, sample_weight_ptr, gamma_ptr,
    row_loss_ptr, grad_ptr, grad_row_stride, confidence_ptr, prediction_ptr,
    valid_count_ptr,
    num_rows, num_classes, gamma, norm, ignore_index,
    WEIGHT: tl.constexpr, MODE: tl.constexpr, REDUCTION: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, PER_SAMPLE_GAMMA: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE_READ: tl.constexpr, NORM_IS_TWO: tl.constexpr,
    COUNT: tl.constexpr, COUNT_BLOCK: tl.constexpr, STATS: tl.constexpr,
):
    """Row loss ``u_i CE_i`` of row ``row`` (int64; stored in ``row_loss``'s dtype), if COMPUTE_GRAD its gradient
    of the reduced loss (the mean's divisor from COUNT, :func:`_gradient_scale`), and with STATS its top-label
    statistics into ``confidence`` / ``prediction`` (:func:`._row_helpers._store_top_label`) from the same read."""
    # the weight's formula and whether its γ follows FLSD-53's bands (weight_formula / uses_flsd_schedule of
    # csrc/uncertainty_weighted_ce.h): FLSD's rows are focal rows, Brier-FLSD's Brier rows
    FORMULA: tl.constexpr = _FOCAL if WEIGHT == _FLSD else (_BRIER if WEIGHT == _BRIER_FLSD else WEIGHT)
    FLSD_SCHEDULE: tl.constexpr = WEIGHT == _FLSD or WEIGHT == _BRIER_FLSD

    logits_row = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row).to(tl.int64)
    is_valid = target != ignore_index
    in_range = (target >= 0) & (target < num_classes)
    is_bad = is_valid & (target < 0) | is_valid & (target >= num_classes)
    # out-of-range targets read class 0 (never out of bounds); their row is poisoned with NaN below
    safe_target = tl.where(in_range, target, 0)
    z_target = tl.load(logits_row + safe_target).to(tl.float32)
    cols = tl.arange(0, BLOCK)

    # ---- statistics: running max m, d_¬y = Σ_{k≠y} e^{z-m}, gBS Σ_{k≠y} e^{q(z-m)}, dual focal's max{z < z_y} ----
    # Only non-target sums are accumulated: d = d_¬y + e^{z_y-m} is formed once at the end, so 1 - p_y = d_¬y / d
    # never cancels and each chunk costs one reduction less. For q = 2 (the default) e^{q(z-m)} = e², no second exp.
    if SINGLE_READ:
        z, col_mask, e, is_target_col, m_safe, d_others, sum_q_others, below, z_below_max, n_ties, top_index = (
            _hard_single_read_statistics(logits_row, cols, num_classes, safe_target, z_target, norm, FORMULA,
                                         NORM_IS_TWO, STATS))
    else:
        m_safe, d_others, sum_q_others, z_below_max, n_ties, top_index = _hard_streamed_statistics(
            logits_row, cols, num_classes, safe_target, z_target, norm, FORMULA, BLOCK, NORM_IS_TWO, STATS)

    # ---- per-row scalars: CE, the weight and its gradient's coefficients, the row loss -------------------------------
    d, log2_d, p_target, cross_entropy, one_minus_p = _hard_cross_entropy(z_target, d_others, m_safe)
    u, coef_p, extra_y, coef_tie, coef_h, h_sum = _hard_weight(
        row, cross_entropy, one_minus_p, p_target, z_target, m_safe, d, log2_d, z_below_max, n_ties, sum_q_others,
        sample_weight_ptr, gamma_ptr, gamma, norm, FORMULA, FLSD_SCHEDULE, MODE, PER_SAMPLE_GAMMA, NORM_IS_TWO)
    _store_row_loss(row_loss_ptr, row, u, cross_entropy, is_valid, is_bad)
    if STATS:
        _store_top_label(confidence_ptr, prediction_ptr, logits_row, row, 1.0 / d, top_index, num_classes, is_valid,
                         BLOCK)

    # ---- gradient of the reduced loss for grad_output = 1 ----------------------------------------------------------
    if COMPUTE_GRAD:
        scale = _gradient_scale(valid_count_ptr, target_ptr, num_rows, num_classes, ignore_index, REDUCTION, COUNT,
                                COUNT_BLOCK)
        grad_target = (-coef_p * one_minus_p + extra_y) * scale
        grad_row = grad_ptr + row * grad_row_stride
        inv_d = 1.0 / d
        if SINGLE_READ:
            _hard_single_read_gradient(grad_row, cols, col_mask, z, e, is_target_col, below, z_below_max, m_safe,
                                       log2_d, inv_d, coef_p, coef_tie, coef_h, h_sum, grad_target, scale, is_valid,
                                       is_bad, norm, FORMULA, MODE, NORM_IS_TWO)
        else:
            _hard_streamed_gradient(grad_row, logits_row, cols, num_classes, safe_target, z_target, z_below_max,
                                    m_safe, log2_d, coef_p, coef_tie, coef_h, h_sum, grad_target, scale, is_valid,
                                    is_bad, norm, FORMULA, MODE, BLOCK, NORM_IS_TWO)


@triton.jit
def _uncertainty_weighted_ce_fwd_kernel(
    logits_ptr, logits_row_stride,
    target_ptr, sample_weight_ptr, gamma_ptr,
    row_loss_ptr, grad_ptr, grad_row_stride, confidence_ptr, prediction_ptr,
    valid_count_ptr, loss_ptr, error_ptr, counter_ptr,
    num_rows, num_classes, gamma, norm, ignore_index,
    WEIGHT: tl.constexpr, MODE: tl.constexpr, REDUCTION: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, PER_SAMPLE_GAMMA: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE_READ: tl.constexpr, NORM_IS_TWO: tl.constexpr,
    COUNT: tl.constexpr, CHECK_TARGETS: tl.constexpr, FINISH_BLOCK: tl.constexpr, STATS: tl.constexpr,
):
    """Row losses, gradient rows and (STATS) top-label statistics, one program per row; then the batch's loss and
    target flag (:func:`_finish`)."""
    _uncertainty_weighted_ce_row(
        tl.program_id(0).to(tl.int64), logits_ptr, logits_row_stride, target_ptr, sample_weight_ptr, gamma_ptr,
        row_loss_ptr, grad_ptr, grad_row_stride, confidence_ptr, prediction_ptr, valid_count_ptr, num_rows,
        num_classes, gamma, norm, ignore_index, WEIGHT, MODE, REDUCTION, COMPUTE_GRAD, PER_SAMPLE_GAMMA, BLOCK,
        SINGLE_READ, NORM_IS_TWO, COUNT, FINISH_BLOCK, STATS)
    if REDUCTION != _REDUCTION_NONE or CHECK_TARGETS:
        _finish(row_loss_ptr, target_ptr, row_loss_ptr, valid_count_ptr, loss_ptr, error_ptr, counter_ptr,
                target_ptr, row_loss_ptr, 0, num_rows, num_classes, ignore_index, REDUCTION, COUNT, CHECK_TARGETS,
                False, False, FINISH_BLOCK)
