"""The Triton kernels that work over the batch's rows rather than one row, for hard and soft targets alike; launched by
:mod:`calibkernels.triton.uncertainty_weighted_ce`.

* ``_uncertainty_weighted_ce_targets_kernel``: one program before the loss launch of a batch too large to count its
  class-index targets in every program (a mean with a gradient): the mean's divisor and the target flag (a mix's
  ``mix_target`` and λ checked in the same scan).
* ``_uncertainty_weighted_ce_scale_grad_kernel``: the backward. The forward already wrote the gradient of the reduced
  loss for ``grad_output = 1``; this persistent-grid launch multiplies it by ``grad_output``, read on the device, and
  leaves the buffer untouched where the factor is exactly 1 (so ``loss.backward()`` costs one read and one write of
  N×C in total).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._row_helpers import _scan_chunk, _scan_start, _store_target_flag


@triton.jit
def _uncertainty_weighted_ce_targets_kernel(
    target_ptr, mix_ptr, lambda_ptr, lambda_stride, num_rows, num_classes, ignore_index, valid_count_ptr, error_ptr,
    CHECK_MIX: tl.constexpr, BLOCK: tl.constexpr,
):
    """One program, before the loss kernel of a batch too large to count its targets in every program (COUNT
    ``COUNT_LOADED``): the mean's divisor (non-ignored rows) into ``valid_count``, and the target flag into ``error``
    (:func:`_store_target_flag`; with a mix, CHECK_MIX, its values checked too)."""
    offs = tl.arange(0, BLOCK)
    count = tl.zeros((BLOCK,), tl.int64)
    bad_any, bad_value, first_mix, first_lambda = _scan_start(num_rows, BLOCK)
    for start in range(0, num_rows, BLOCK):
        rows = start + offs
        count, bad_any, bad_value, first_mix, first_lambda = _scan_chunk(
            count, bad_any, bad_value, first_mix, first_lambda, target_ptr, mix_ptr, lambda_ptr, lambda_stride, rows,
            rows < num_rows, num_classes, ignore_index, CHECK_MIX)
    tl.store(valid_count_ptr, tl.sum(count, 0))
    _store_target_flag(error_ptr, bad_any, bad_value, first_mix, first_lambda, mix_ptr, num_rows, CHECK_MIX)


@triton.jit
def _uncertainty_weighted_ce_scale_grad_kernel(
    grad_ptr, grad_row_stride, grad_output_ptr, grad_output_stride, num_rows, num_classes,
    PER_ROW: tl.constexpr, BLOCK: tl.constexpr,
):
    """``grad[i, :] *= grad_output[i]`` (or by the scalar ``grad_output``), skipped where the factor is exactly 1.

    A persistent grid (a few programs per multiprocessor, each striding over rows), so the common
    ``loss.backward()`` with ``grad_output = 1`` costs a handful of programs that read one number and exit, not one
    program per row and tile."""
    pid = tl.program_id(0)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    if PER_ROW:
        run = True
    else:
        run = tl.load(grad_output_ptr).to(tl.float32) != 1.0
    if run:
        for row in range(pid, num_rows, programs):
            row64 = tl.cast(row, tl.int64)
            factor = tl.load(grad_output_ptr + row64 * grad_output_stride).to(tl.float32)
            if factor != 1.0:
                for start in range(0, num_classes, BLOCK):
                    offs = start + cols
                    mask = offs < num_classes
                    ptrs = grad_ptr + row64 * grad_row_stride + offs
                    values = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
                    tl.store(ptrs, (values * factor).to(grad_ptr.dtype.element_ty), mask=mask)
