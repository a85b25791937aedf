"""Triton row helpers shared by the hard-target and soft-target forward kernels (:mod:`._hard_target_kernels`,
:mod:`._soft_target_kernels`), and the codes the kernels compile in.

* ``_pow``, ``_row_gamma``: ``base ** exponent`` via exp2/log2 with ``x ** 0 = 1``, and the row's γ (FLSD-53's band of
  a probability, a per-sample γ or the argument).
* ``_statistics_chunk``: one chunk of a two-read statistics pass: the logits in fp32 (asked to stay in L2 for the
  gradient pass), the online max and the factor ``e^{m - m_new}`` that rescales the running sums.
* ``_store_row_loss``, ``_gradient_scale``: a row's loss ``u_i CE_i`` (0 on an ignored row, NaN on a bad target) and
  the reduction's factor of its gradient (1 / the mean's divisor, counted in the program for a small batch).
* Target scans (``_target_chunk``, ``_mix_chunk``, ``_scan_start``, ``_scan_chunk``, ``_store_target_flag``,
  ``_count_valid``, ``_mean_divisor``): the mean's divisor and the target flag of class indices, a mix's
  ``mix_target`` and λ checked in the same scan (calibkernels._kernel_codes.TARGET_FLAG_CODES).
* Top-label statistics (STATS launches: ``return_stats=True``): the first column of the max of a block or of a
  streamed row (``_first_top_index``, ``_running_top_index``), and ``_store_top_label``, a row's confidence ``1/d``
  and prediction (re-reading a row with a NaN for its first NaN).
* ``_finish``: the end of every loss launch. The last program to finish its row (a ticket from an atomic counter)
  sums the rows' losses in a fixed order, divides by the mean's divisor, writes the loss in its dtype and makes the
  target flag, so that the forward is one launch.

The weight, mode, reduction and count codes are those of :mod:`calibkernels._validation`, also as Triton compile-time
constants (``_FOCAL``, ``_LOSS_MODE``, ``_MEAN``, ...) so that the kernels' branches read by name and every launch
compiles only its own.
"""

from __future__ import annotations

import triton
import triton.language as tl

from .. import _validation as validation
from .._kernel_codes import FLSD_LOW_GAMMA, FLSD_LOW_THRESHOLD, FLSD_MID_GAMMA, FLSD_MID_THRESHOLD, TARGET_FLAG_CODES

WEIGHT_NONE, WEIGHT_FOCAL, WEIGHT_FLSD, WEIGHT_DUAL_FOCAL, WEIGHT_BRIER, WEIGHT_EXTERNAL, WEIGHT_BRIER_FLSD = (
    validation.WEIGHT_CODES[k] for k in ("none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd")
)
MODE_LOSS, MODE_GRAD = validation.MODE_CODES["loss"], validation.MODE_CODES["grad"]
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = (
    validation.REDUCTION_CODES["none"], validation.REDUCTION_CODES["mean"], validation.REDUCTION_CODES["sum"])

# Where a launch's mean divisor comes from (the kernels' COUNT): every row counts (a dense target has no ignored
# rows); the class-index targets counted in the loss launch itself (COUNT_INLINE: by every program, for the mean's
# gradient, in batches of up to the launcher's INLINE_COUNT_MAX_ROWS rows, else only by the last program; the forward
# is one launch); or the targets kernel counted them in a launch of its own first (COUNT_LOADED: a mean with a
# gradient over a larger batch, where every program re-reading all N targets from L2 would cost more than the launch
# it saves: N² · 8 bytes).
COUNT_ROWS, COUNT_INLINE, COUNT_LOADED = 0, 1, 2

# The same codes as Triton compile-time constants, so the kernel's branches read by name.
_NONE, _FOCAL, _FLSD, _DUAL_FOCAL, _BRIER, _EXTERNAL, _BRIER_FLSD = (tl.constexpr(code) for code in (
    WEIGHT_NONE, WEIGHT_FOCAL, WEIGHT_FLSD, WEIGHT_DUAL_FOCAL, WEIGHT_BRIER, WEIGHT_EXTERNAL, WEIGHT_BRIER_FLSD))
_LOSS_MODE = tl.constexpr(MODE_LOSS)
_MEAN = tl.constexpr(REDUCTION_MEAN)
_REDUCTION_NONE = tl.constexpr(REDUCTION_NONE)
_COUNT_ROWS, _COUNT_INLINE, _COUNT_LOADED = (tl.constexpr(code) for code in (COUNT_ROWS, COUNT_INLINE, COUNT_LOADED))
# FLSD-53 (Mukhoti et al.): the bands of calibkernels._kernel_codes, as in csrc/uncertainty_weighted_ce.h
_FLSD_LOW_THRESHOLD, _FLSD_LOW_GAMMA, _FLSD_MID_THRESHOLD, _FLSD_MID_GAMMA = (tl.constexpr(v) for v in (
    FLSD_LOW_THRESHOLD, FLSD_LOW_GAMMA, FLSD_MID_THRESHOLD, FLSD_MID_GAMMA))
# the first slot of a class-index target flag (_store_target_flag)
_FLAG_TARGET, _FLAG_MIX_TARGET, _FLAG_MIX_LAMBDA = (tl.constexpr(TARGET_FLAG_CODES[k]) for k in (
    "target", "mix_target", "mix_lambda"))
# below every target: the running maximum of a scan's bad targets before it has seen one
_MIN_INT64 = tl.constexpr(-9223372036854775807)


@triton.jit
def _pow(base, exponent):
    """``base ** exponent`` for ``base ≥ 0`` via exp2/log2, with ``x ** 0 = 1`` (also ``0 ** 0``)."""
    return tl.where(exponent == 0.0, 1.0, tl.exp2(exponent * tl.log2(base)))


@triton.jit
def _store_row_loss(row_loss_ptr, row, u, cross_entropy, is_valid, is_bad):
    """``L_i = u_i · CE_i`` into ``row_loss`` (float32, or the loss's dtype for ``reduction="none"``): 0 on an ignored
    row, NaN on a row with a bad target."""
    row_loss = tl.where(is_valid, u * cross_entropy, 0.0)
    row_loss = tl.where(is_bad, float("nan"), row_loss)
    tl.store(row_loss_ptr + row, row_loss)


@triton.jit
def _target_chunk(target_ptr, rows, in_batch, num_classes, ignore_index):
    """One chunk of a scan of class-index targets: ``(t, valid, bad)``, the targets (int64; ``ignore_index`` past the
    batch), whether each counts for the mean and whether it is out of range."""
    t = tl.load(target_ptr + rows, mask=in_batch, other=ignore_index).to(tl.int64)
    valid = t != ignore_index
    return t, valid, valid & ((t < 0) | (t >= num_classes))


@triton.jit
def _mix_chunk(first_mix, first_lambda, mix_ptr, lambda_ptr, lambda_stride, rows, in_batch, valid, num_classes):
    """One chunk of the scan of a mix, beside :func:`_target_chunk`'s: ``first_mix`` and ``first_lambda`` (per lane,
    ``num_rows`` where none is yet) lowered to the chunk's rows whose ``mix_target`` is not a class index where the
    target is not ignored (``valid``), and whose λ is outside [0, 1] or NaN (compared in λ's own dtype; every row,
    ignored or not, as the host check reads them)."""
    mix = tl.load(mix_ptr + rows, mask=in_batch & valid, other=0).to(tl.int64)
    lam = tl.load(lambda_ptr + rows.to(tl.int64) * lambda_stride, mask=in_batch, other=0)
    mix_bad = valid & ((mix < 0) | (mix >= num_classes))
    lambda_bad = in_batch & ~((lam >= 0) & (lam <= 1))
    rows64 = rows.to(tl.int64)
    return (tl.minimum(first_mix, tl.where(mix_bad, rows64, first_mix)),
            tl.minimum(first_lambda, tl.where(lambda_bad, rows64, first_lambda)))


@triton.jit
def _scan_start(num_rows, BLOCK: tl.constexpr):
    """The per-lane accumulators of a scan of class-index targets before its first chunk (:func:`_scan_chunk`):
    ``(bad_any, bad_value, first_mix, first_lambda)``, no bad target and no bad mix row."""
    return (tl.zeros((BLOCK,), tl.int32), tl.full((BLOCK,), _MIN_INT64, tl.int64),
            tl.full((BLOCK,), num_rows, tl.int64), tl.full((BLOCK,), num_rows, tl.int64))


@triton.jit
def _scan_chunk(count, bad_any, bad_value, first_mix, first_lambda, target_ptr, mix_ptr, lambda_ptr, lambda_stride,
                rows, in_batch, num_classes, ignore_index, CHECK_MIX: tl.constexpr):
    """One chunk of the scan of class-index targets that makes the target flag: per lane, ``count`` (in its own
    dtype) of the rows whose target is not ``ignore_index``, whether a target is out of range (``bad_any``) and the
    largest such (``bad_value``), and with a mix (CHECK_MIX) the first bad rows of :func:`_mix_chunk`; returned
    updated, in that order."""
    t, valid, bad = _target_chunk(target_ptr, rows, in_batch, num_classes, ignore_index)
    count += valid.to(count.dtype)
    bad_any = bad_any | bad.to(tl.int32)
    bad_value = tl.maximum(bad_value, tl.where(bad, t, _MIN_INT64))
    if CHECK_MIX:
        first_mix, first_lambda = _mix_chunk(first_mix, first_lambda, mix_ptr, lambda_ptr, lambda_stride, rows,
                                             in_batch, valid, num_classes)
    return count, bad_any, bad_value, first_mix, first_lambda


@triton.jit
def _store_target_flag(error_ptr, bad_any, bad_value, first_mix, first_lambda, mix_ptr, num_rows,
                       CHECK_MIX: tl.constexpr):
    """The target flag of class indices, ``(code, value)`` (calibkernels._kernel_codes.TARGET_FLAG_CODES), from a scan's
    per-lane results (:func:`_scan_chunk`): 1 and the largest bad target where a target is bad; else, with a mix
    (CHECK_MIX), 2 and the first bad row's ``mix_target`` (``first_mix``), or 3 and the first row of a bad λ
    (``first_lambda``; both ``num_rows`` when none is); else 0."""
    bad_any, bad_value = tl.max(bad_any, 0), tl.max(bad_value, 0)
    first_mix, first_lambda = tl.min(first_mix, 0), tl.min(first_lambda, 0)
    code = tl.where(bad_any != 0, _FLAG_TARGET, 0).to(tl.int64)
    value = bad_value
    if CHECK_MIX:
        mix_value = tl.load(mix_ptr + tl.minimum(first_mix, num_rows - 1)).to(tl.int64)
        code = tl.where(bad_any != 0, code, tl.where(first_mix < num_rows, _FLAG_MIX_TARGET,
                                                     tl.where(first_lambda < num_rows, _FLAG_MIX_LAMBDA, 0)))
        value = tl.where(code == _FLAG_MIX_TARGET, mix_value, tl.where(code == _FLAG_MIX_LAMBDA, first_lambda, value))
    tl.store(error_ptr, code)
    tl.store(error_ptr + 1, value)


@triton.jit
def _count_valid(target_ptr, num_rows, num_classes, ignore_index, BLOCK: tl.constexpr):
    """The number of rows whose class-index target is not ``ignore_index`` (the mean's divisor)."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros((BLOCK,), tl.int32)
    for start in range(0, num_rows, BLOCK):
        rows = start + offs
        _, valid, _ = _target_chunk(target_ptr, rows, rows < num_rows, num_classes, ignore_index)
        count += valid.to(tl.int32)
    return tl.sum(count, 0)


@triton.jit
def _mean_divisor(valid_count_ptr, inline_count, num_rows, COUNT: tl.constexpr):
    """The mean's divisor as a float, at least 1 (all rows ignored: a loss of 0, never NaN): ``num_rows``
    (COUNT_ROWS), ``inline_count`` (COUNT_INLINE, counted by the caller) or the targets kernel's ``valid_count``."""
    if COUNT == _COUNT_LOADED:
        count = tl.load(valid_count_ptr).to(tl.float32)
    elif COUNT == _COUNT_INLINE:
        count = inline_count.to(tl.float32)
    else:
        count = tl.cast(num_rows, tl.float32)
    return tl.maximum(count, 1.0)


@triton.jit
def _gradient_scale(valid_count_ptr, target_ptr, num_rows, num_classes, ignore_index, REDUCTION: tl.constexpr,
                    COUNT: tl.constexpr, COUNT_BLOCK: tl.constexpr):
    """The reduction's factor of every gradient entry: 1 / (the mean's divisor) for the mean, else 1. The divisor
    (COUNT): ``num_rows`` (a dense target, whose rows all count), the non-ignored targets counted by this program
    (a small batch: no launch before this one), or the count the targets kernel stored in ``valid_count``."""
    if REDUCTION == _MEAN:
        inline_count = 0
        if COUNT == _COUNT_INLINE:
            inline_count = _count_valid(target_ptr, num_rows, num_classes, ignore_index, COUNT_BLOCK)
        scale = 1.0 / _mean_divisor(valid_count_ptr, inline_count, num_rows, COUNT)
    else:
        scale = tl.full((), 1.0, tl.float32)
    return scale


@triton.jit
def _finish(row_loss_ptr, target_ptr, row_flags_ptr, valid_count_ptr, loss_ptr, error_ptr, counter_ptr,
            mix_ptr, lambda_ptr, lambda_stride, num_rows, num_classes, ignore_index,
            REDUCTION: tl.constexpr, COUNT: tl.constexpr, CHECK_TARGETS: tl.constexpr, FOLD_FLAGS: tl.constexpr,
            CHECK_MIX: tl.constexpr, BLOCK: tl.constexpr):
    """The end of every program of a loss launch: the last program to finish its row (a ticket drawn from
    ``counter``) folds the batch, so that the loss launch is the forward's only one:

    * REDUCTION mean/sum: ``Σ_i L_i`` over ``row_loss`` in a fixed order (the loss is bitwise reproducible), ÷ the
      mean's divisor (COUNT: ``num_rows``, the non-ignored targets counted here, or ``valid_count``), stored in the
      loss's dtype (all rows ignored: 0, never NaN);
    * CHECK_TARGETS: the flag of class-index targets (:func:`_store_target_flag`) into ``error``: whether a target is
      out of range (the largest such value), with a mix (CHECK_MIX: ``mix_target`` and λ at ``lambda_ptr + row *
      lambda_stride``) also whether a ``mix_target`` or λ is bad;
    * FOLD_FLAGS: a dense target's per-row flags into ``error``, ``(any row flagged, the first flagged row)``
      (``num_rows`` when none is), as :func:`calibkernels._validation.first_flagged_row` makes it.

    It then resets ``counter`` to 0 for the next launch on the stream. Each program's threads meet at a barrier before
    its ticket, whose atomic is acquire-release at GPU scope, so the last program sees every row's stores; it reads
    them past L1 (``.cg``)."""
    tl.debug_barrier()
    ticket = tl.atomic_add(counter_ptr, 1, sem="acq_rel")
    if ticket == tl.num_programs(0) - 1:
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((BLOCK,), tl.float32)
        count = tl.zeros((BLOCK,), tl.int32)
        bad_any, bad_value, first_mix, first_lambda = _scan_start(num_rows, BLOCK)
        first = tl.full((BLOCK,), num_rows, tl.int64)
        for start in range(0, num_rows, BLOCK):
            rows = start + offs
            in_batch = rows < num_rows
            if REDUCTION != _REDUCTION_NONE:
                acc += tl.load(row_loss_ptr + rows, mask=in_batch, other=0.0, cache_modifier=".cg")
            if CHECK_TARGETS:
                count, bad_any, bad_value, first_mix, first_lambda = _scan_chunk(
                    count, bad_any, bad_value, first_mix, first_lambda, target_ptr, mix_ptr, lambda_ptr,
                    lambda_stride, rows, in_batch, num_classes, ignore_index, CHECK_MIX)
            if FOLD_FLAGS:
                flagged = tl.load(row_flags_ptr + rows, mask=in_batch, other=0, cache_modifier=".cg") != 0
                first = tl.minimum(first, tl.where(flagged, rows.to(tl.int64), num_rows))
        if REDUCTION != _REDUCTION_NONE:
            total = tl.sum(acc, 0)
            if REDUCTION == _MEAN:
                total = total / _mean_divisor(valid_count_ptr, tl.sum(count, 0), num_rows, COUNT)
            tl.store(loss_ptr, total.to(loss_ptr.dtype.element_ty))
        if CHECK_TARGETS:
            _store_target_flag(error_ptr, bad_any, bad_value, first_mix, first_lambda, mix_ptr, num_rows, CHECK_MIX)
        if FOLD_FLAGS:
            first_row = tl.min(first, 0)
            tl.store(error_ptr, (first_row < num_rows).to(tl.int64))
            tl.store(error_ptr + 1, first_row)
        tl.store(counter_ptr, 0)


@triton.jit
def _statistics_chunk(logits_row, offs, num_classes, m):
    """One chunk of a two-read statistics pass: ``(z, mask, m_new, m_new_safe, rescale)``, the chunk's logits in fp32
    (-inf past the row; asked to stay in L2 for the gradient pass's second read), the new running max, its stand-in 0
    while every logit so far is -inf, and ``e^{m - m_new}``, which rescales the running sums."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    col_mask = offs < num_classes
    z = tl.load(logits_row + offs, mask=col_mask, other=NEG_INF, eviction_policy="evict_last").to(tl.float32)
    m_new = tl.maximum(m, tl.max(z, 0))
    m_new_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
    rescale = tl.exp2((m - m_new_safe) * LOG2E)
    return z, col_mask, m_new, m_new_safe, rescale


@triton.jit
def _row_gamma(row, p_band, gamma, gamma_ptr, FLSD_SCHEDULE: tl.constexpr, PER_SAMPLE_GAMMA: tl.constexpr):
    """The row's γ: FLSD-53's band of ``p_band`` (5 below 0.2f, 3 below 0.5f, else γ) for the weights with that
    schedule, the row's own γ (a per-sample tensor) or the argument."""
    if FLSD_SCHEDULE:
        g = tl.where(p_band < _FLSD_LOW_THRESHOLD, _FLSD_LOW_GAMMA,
                     tl.where(p_band < _FLSD_MID_THRESHOLD, _FLSD_MID_GAMMA, gamma))
    elif PER_SAMPLE_GAMMA:
        g = tl.load(gamma_ptr + row).to(tl.float32)
    else:
        g = gamma
    return g


@triton.jit
def _first_top_index(z, cols, m, none):
    """The first lane ``cols`` (``tl.arange(0, BLOCK)``) of a block or chunk of a row's fp32 logits ``z`` where ``z``
    equals the (running) max ``m``; ``none`` where none does (a chunk below the running max, or a NaN max under the
    interpreter, whose ``tl.max`` propagates NaN). Lanes past the row hold -inf, which equals ``m`` only where every
    logit so far is -inf, and then lane 0 comes first.

    One compare-select and a reduction over the lanes: a NaN test beside it made the largest float32 blocks spill and
    doubled the two-read loop's registers (64 → 125 at 16 warps: half the rows in flight), as did a reduction over the
    columns ``start + cols`` (bench/triton_registers.py --stats), so a row with a NaN is read again instead
    (:func:`_store_top_label`)."""
    return tl.min(tl.where(z == m, cols, none), 0)


@triton.jit
def _running_top_index(top_index, z, cols, start, m, m_new, BLOCK: tl.constexpr):
    """A streamed row's first column of the running max after the chunk ``z`` at columns ``start + cols`` (``C``
    before the first). Where the max rose past ``m`` the chunk holds it first; otherwise an earlier chunk holds ``m``
    first (a lower column than any of this chunk's, or the chunk's stand-in ``start + BLOCK``, one past it): the
    lesser of the two."""
    chunk_top = start + _first_top_index(z, cols, m_new, BLOCK)
    return tl.where(m_new > m, chunk_top, tl.minimum(top_index, chunk_top))


@triton.jit
def _store_top_label(confidence_ptr, prediction_ptr, logits_row, row, inv_d, top_index, num_classes, is_valid,
                     BLOCK: tl.constexpr):
    """A row's top-label statistics (:func:`calibkernels.loss_stats.top_label_stats`): ``confidence = 1/d`` (float32;
    ``d = Σ e^{z - m}`` holds ``e^0 = 1`` for the max, so this is ``max_k p_k``), NaN where ``d = 0`` (a row of only
    -inf logits) or ``d`` is NaN (a NaN or +inf logit); ``prediction`` (int64) the first column of the max
    (``top_index``) or, as ``torch.argmax``, of the first NaN: a row whose ``d`` is NaN is read once more for it, in
    chunks of at most 1024 (rare; called before any gradient store, so also in place); NaN / -1 on an ignored row."""
    SCAN: tl.constexpr = 1024 if BLOCK > 1024 else BLOCK
    prediction = top_index
    if inv_d != inv_d:
        first_nan = num_classes + tl.zeros((), tl.int32)
        for start in range(0, num_classes, SCAN):
            offs = start + tl.arange(0, SCAN)
            z = tl.load(logits_row + offs, mask=offs < num_classes, other=0.0).to(tl.float32)
            first_nan = tl.minimum(first_nan, tl.min(tl.where(z != z, offs, num_classes), 0))
        prediction = tl.where(first_nan < num_classes, first_nan, prediction)
    confidence = tl.where(inv_d == float("inf"), float("nan"), inv_d)
    tl.store(confidence_ptr + row, tl.where(is_valid, confidence, float("nan")))
    tl.store(prediction_ptr + row, tl.where(is_valid, prediction.to(tl.int64), -1))
