"""Triton backend of the fused uncertainty-weighted cross-entropy (docs/losses.md): the default GPU backend. This module
is the backend interface (``is_available``, ``forward``, ``scale_grad_``, ``SOFT_TARGETS``), the choice of launch
shape and the launches; the kernels live in private modules beside it:

* :mod:`._row_helpers`: the ``@triton.jit`` helpers both forward kernels share (row statistics, weights' powers and
  γ, the target scans, the reduction and the launch's closing fold ``_finish``) and the codes they compile in;
* :mod:`._hard_target_kernels`: the forward kernel for class-index targets (its docstring has the formulas);
* :mod:`._soft_target_kernels`: the forward kernel for soft targets (label smoothing, a compact mix, a dense target);
* :mod:`._batch_kernels`: the targets kernel (a large mean's divisor and target flag) and the backward's scaling.
* :mod:`._option_kernels`: the forward kernel of calls with the drop-in options (class weights, z-loss, soft-capping;
  ``OPTIONS_IN_KERNEL``), every row read as a soft target in three passes, and the option launch's host pieces.

Launch design (docs/performance.md):

* Single-read path when the row fits one block (``C ≤ MAX_BLOCK``, ``MAX_BLOCK_16BIT`` for 16-bit logits: read the
  logits once, write the gradient once, in the loss launch) and a two-read path beyond that (statistics pass, then
  gradient pass, over ``TWO_READ_CHUNK`` chunks; the statistics pass asks L2 to keep the row and the gradient pass
  walks the chunks backwards, so the second read mostly hits L2).
* Gradient in the forward: the backward (:mod:`calibkernels._autograd`, shared with the compiled backends) only
  multiplies the saved gradient by ``grad_output`` with ``_uncertainty_weighted_ce_scale_grad_kernel``, which reads
  ``grad_output`` on the device and leaves the buffer untouched when it is exactly 1 (so ``loss.backward()`` costs one
  read and one write of N×C in total).
* ``inplace=True``: the gradient overwrites the logits buffer (zero extra N×C memory).
* Soft targets run their own kernel with the same launch shapes, except that float32 soft rows are held in registers
  only up to ``MAX_BLOCK_DENSE`` (dense) and ``SOFT_BLOCK_CAPS`` classes, so that no launch spills
  (bench/triton_registers.py).
* Top-label statistics (``return_stats=True``, :class:`calibkernels.LossStats`): with ``stats_out`` the loss launch
  also writes each row's confidence ``max_k p_k = 1/d`` and prediction (the first column of the max) from the row
  statistics it already has, in the same read of the logits (before an in-place gradient overwrites them); without
  it the kernels compile without those stores (``STATS`` is a compile-time constant).
* No host synchronisation on the hot path, and one launch in the forward: the last program of the loss launch to
  finish (a ticket from an atomic counter, ``_finish``) sums the rows' losses in a fixed order, divides by the
  mean's divisor, writes the loss in the logits' dtype and makes the target flag. The mean's gradient needs its
  divisor before any row is written: each program counts the non-ignored targets itself in batches of up to
  ``INLINE_COUNT_MAX_ROWS`` rows; a larger batch's mean with a gradient counts them in a one-program launch first
  (every program re-reading N targets would cost N² reads; without a gradient, or for a sum, only the last program
  needs the count). The backward is one persistent-grid scaling launch (a no-op for ``grad_output``
  exactly 1, read on the device: no launch at all would need the host to read it).

Target-check policy: an out-of-range target (not in ``[0, C)`` and not ``ignore_index``) never makes the kernel read
or write out of bounds: the kernel reads class 0 instead and writes NaN to that row's loss and gradient (so a wrong
label can never produce a plausible-looking loss); the loss launch's last program (or the targets kernel, where
it counts the mean's divisor) raises a device-side flag, which :mod:`calibkernels._target_checks` turns into a
``ValueError`` without stalling the host (``CALIBKERNELS_VALIDATE=async``, the default; ``sync`` raises at once at the
cost of one synchronisation per call; ``0`` never reads the flag).
A mix is checked in the same scan (a ``mix_target`` outside ``[0, C)`` on a row whose target is not ignored, a λ
outside [0, 1] or NaN: that row is NaN too), so a mixed batch costs no check launches of its own.

Registered as ``torch.ops.calibkernels.uncertainty_weighted_ce_triton`` with ``torch.library.custom_op`` (the
compiled op's leading arguments: in place is its mutable ``grad_out`` argument; the top-label statistics go to
optional mutable output buffers) and ``register_fake``, so
``torch.compile(fullgraph=True)`` keeps it in the graph and ``torch.library.opcheck`` passes; eager calls launch the
kernels directly (:func:`forward`). (``triton_op`` / ``wrap_triton`` would let Inductor look inside, but it cannot
trace kernels that run through the Triton interpreter, which is how this backend is tested on CPU.)

Naming ladder: ``_uncertainty_weighted_ce_fwd_kernel`` / ``_uncertainty_weighted_ce_scale_grad_kernel`` →
``uncertainty_weighted_ce_forward`` / ``scale_grad_`` → the registered op → the backend interface ``is_available`` /
``forward`` used by :mod:`calibkernels._backends` and :mod:`calibkernels._autograd`. The kernels are importable from
here by their names (tests and bench/ compile and inspect them).
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch

from .. import _validation as validation
from .._kernel_codes import DENSE_KERNEL_CHECK_MAX_CLASSES
from ._batch_kernels import _uncertainty_weighted_ce_scale_grad_kernel, _uncertainty_weighted_ce_targets_kernel
from ._hard_target_kernels import _uncertainty_weighted_ce_fwd_kernel
# the codes, as tests and bench/ read them from the backend module
from ._row_helpers import (COUNT_INLINE, COUNT_LOADED, COUNT_ROWS, MODE_GRAD, MODE_LOSS, REDUCTION_MEAN,  # noqa: F401
                           REDUCTION_NONE, REDUCTION_SUM, WEIGHT_BRIER, WEIGHT_BRIER_FLSD, WEIGHT_DUAL_FOCAL,
                           WEIGHT_EXTERNAL, WEIGHT_FLSD, WEIGHT_FOCAL, WEIGHT_NONE)
from ._option_kernels import _option_ce_fwd_kernel, check_options, class_weighted_divisor, reduced_option_loss
from ._soft_target_kernels import _soft_target_ce_fwd_kernel

__all__ = [
    "SOFT_TARGETS",
    "OPTIONS_IN_KERNEL",
    "STATS_IN_KERNEL",
    "MAX_BLOCK",
    "MAX_BLOCK_16BIT",
    "uncertainty_weighted_ce_forward",
    "forward",
    "scale_grad_",
    "is_available",
]

# Launch shapes, chosen with bench/tune_triton.py (docs/performance.md, "Triton kernel"):
# * Rows of up to MAX_BLOCK classes (float32) or MAX_BLOCK_16BIT classes (float16/bfloat16) take the single-read
#   path: the whole row held in registers as fp32, one program per row.
# * Longer rows take the two-read path, streamed in chunks of TWO_READ_CHUNK classes by a few warps: many rows in
#   flight per multiprocessor hide the memory latency better than one register-resident row of 32 warps, and the
#   second read mostly hits L2.
MAX_BLOCK = 32768
MAX_BLOCK_16BIT = 4096
# * fp32 two-read chunks: 16384 classes by 16 warps; 16-bit: 2048 classes by 4 warps (half of MAX_BLOCK_16BIT). The
#   fastest shapes of the tuning sweep.
TWO_READ_CHUNK = {2: (2048, 4), 4: (16384, 16)}  # element size -> (chunk, num_warps)
# * Soft targets hold more per column than class indices. Their float32 rows stay in registers only where the
#   block, compiled for sm_90, does not spill (bench/triton_registers.py; docs/performance.md, "Registers"): dense
#   rows (which also hold the target's entries) up to MAX_BLOCK_DENSE classes, and the variants in SOFT_BLOCK_CAPS
#   (target kind, weight formula, mode) only up to their cap; longer rows stream, in chunks no longer than the cap.
#   Larger blocks spill registers to local memory, more traffic than the row's own.
MAX_BLOCK_DENSE = 16384
SOFT_BLOCK_CAPS = {("compact", "brier", "loss"): 16384, ("dense", "focal", "loss"): 8192,
                   ("dense", "focal", "grad"): 8192}
# * Launches that also write the top-label statistics (stats_out) hold the first column of the max and a rare path
#   that re-reads a NaN row: the soft Brier blocks that then spilled (bench/triton_registers.py --stats) stream past
#   these caps instead. (The hard-target Brier block of 32768 classes spills a few registers with or without them;
#   the hard two-read launch takes 85-94 registers instead of 64 with them, one program of 16 warps per
#   multiprocessor instead of two; launches without stats_out compile to the same code as before.)
STATS_BLOCK_CAPS = {("compact", "brier", "grad"): 16384, ("dense", "brier", "loss"): 8192,
                    ("dense", "brier", "grad"): 8192}
# Whether the kernels were defined under the Triton interpreter (decided when triton.jit ran, at the import of the
# kernel modules above).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Soft targets (label smoothing, a compact mix, a dense target) run here: calibkernels._backends routes them to
# backends whose module says so.
SOFT_TARGETS = True

# The drop-in options (class weights, z-loss, soft-capping) run in the kernels (:mod:`._option_kernels`):
# calibkernels._backends routes calls with them to backends whose module says so.
OPTIONS_IN_KERNEL = True

# The loss launch writes the top-label statistics itself (stats_out of forward), so calibkernels._autograd.run takes
# them from the kernels instead of a pass of its own over the logits.
STATS_IN_KERNEL = True

# The largest batch whose programs each count the class-index targets for the mean's gradient (COUNT_INLINE);
# a larger one counts them in the targets kernel first (COUNT_LOADED; _row_helpers, where the codes are defined).
INLINE_COUNT_MAX_ROWS = 1024

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SCALE_BLOCK = 4096

# the weight formula of SOFT_BLOCK_CAPS' keys (FLSD's rows are focal rows, Brier-FLSD's Brier rows)
_FORMULA_NAMES = {WEIGHT_FOCAL: "focal", WEIGHT_FLSD: "focal", WEIGHT_BRIER: "brier", WEIGHT_BRIER_FLSD: "brier"}


def _next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): ``triton.next_power_of_2`` in a few bit operations, for
    the launchers' per-call host path, where Triton's own costs more (docs/performance.md)."""
    return 1 << max(n - 1, 0).bit_length()


def _num_warps(block: int) -> int:
    # about 32 fp32 values per thread for big rows, at least one warp group for small ones
    return max(4, min(32, block // 1024))


def _launch_config(num_classes: int, element_size: int, target: str = "hard", weight: Optional[int] = None,
                   mode: Optional[int] = None, stats: bool = False) -> tuple[bool, int, int]:
    """``(single_read, BLOCK, num_warps)`` for rows of ``num_classes`` with ``target`` ``"hard"`` (class indices),
    ``"compact"`` (smoothing or a mix) or ``"dense"``, the weight and mode codes, and whether the launch writes the
    top-label statistics (see the launch-shape notes at the top)."""
    base_cap = MAX_BLOCK
    if element_size <= 2:
        base_cap = min(base_cap, MAX_BLOCK_16BIT)
    cap = base_cap
    if target == "dense":
        cap = min(cap, MAX_BLOCK_DENSE)
    if target != "hard":
        variant = (target, _FORMULA_NAMES.get(weight), "loss" if mode == MODE_LOSS else "grad")
        cap = min(cap, SOFT_BLOCK_CAPS.get(variant, cap))
        if stats:
            cap = min(cap, STATS_BLOCK_CAPS.get(variant, cap))
    if num_classes <= cap:
        block = _next_power_of_2(num_classes)
        # 16-bit rows: 8 values per thread (one 16-byte load); fp32: 4; up to 16 warps (the tuned shapes)
        per_thread = 256 if element_size <= 2 else 128
        return True, block, max(1, min(16, block // per_thread)) if block >= 128 else 1
    chunk, warps = TWO_READ_CHUNK.get(element_size, (4096, 8))
    # tests force tiny chunks through a small MAX_BLOCK; soft rows stream in the tuned chunks of class indices, or in
    # chunks no longer than the rows their kind holds in registers (a dense chunk holds the target's entries too)
    chunk = min(chunk, cap, max(1, _next_power_of_2(base_cap) // 2))
    return False, chunk, max(1, min(warps, chunk // 128))


def _soft_target_arguments(logits, target, weight, mix_target, mix_lambda, label_smoothing):
    """Check the soft-target arguments (shapes, dtypes, devices; no values are read) and return them normalised:
    ``(target, mix_target, mix_lambda, label_smoothing, soft)``, with contiguous targets, a number λ as a 0-dim
    float32 tensor on the logits' device, and ``soft`` whether the row targets are anything but class indices."""
    if mix_target is None and mix_lambda is None and label_smoothing == 0.0 and not target.is_floating_point():
        return target, None, None, 0.0, False  # hard targets: the common case, checked first
    if not validation.is_number(label_smoothing):
        raise TypeError(f"label_smoothing must be a number in [0, 1], got {type(label_smoothing).__name__}")
    label_smoothing = float(label_smoothing)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if (mix_target is None) != (mix_lambda is None):
        raise ValueError("mix_target and mix_lambda go together (t = lam e_target + (1 - lam) e_mix_target)")
    num_rows = logits.shape[0]
    dense = target.is_floating_point()
    if dense:
        if tuple(target.shape) != tuple(logits.shape):
            raise ValueError(f"a dense (probability) target must have the logits' shape {tuple(logits.shape)}, got "
                             f"{tuple(target.shape)}")
        if mix_target is not None:
            raise ValueError("mix_target/mix_lambda mix class-index targets, not a dense target")
        target = target.detach()
        if target.stride(-1) != 1:
            target = target.contiguous()
    if mix_target is not None:
        if (mix_target.dtype != torch.int64 or tuple(mix_target.shape) != (num_rows,)
                or mix_target.device != logits.device):
            raise ValueError(f"mix_target must be an int64 tensor of shape ({num_rows},) on {logits.device}, got "
                             f"{mix_target.dtype} {tuple(mix_target.shape)} on {mix_target.device}")
        mix_lambda = validation.lambda_tensor(mix_lambda, torch.float32, logits.device)
        if (not mix_lambda.is_floating_point() or mix_lambda.shape not in ((), (num_rows,))
                or mix_lambda.device != logits.device):
            raise ValueError(f"mix_lambda must be a floating tensor of shape () or ({num_rows},) on {logits.device}, "
                             f"got {mix_lambda.dtype} {tuple(mix_lambda.shape)} on {mix_lambda.device}")
        mix_target, mix_lambda = mix_target.contiguous(), mix_lambda.detach()
    soft = dense or mix_target is not None or label_smoothing != 0.0
    if soft and weight == WEIGHT_DUAL_FOCAL:
        raise ValueError("the dual-focal weight has no soft-target form (its p_j needs one target class): "
                         "no label smoothing, mix or dense target with weight='dual_focal'")
    return target, mix_target, mix_lambda, label_smoothing, soft


def uncertainty_weighted_ce_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    sample_weight: Optional[torch.Tensor],
    gamma_per_sample: Optional[torch.Tensor],
    weight: int,
    mode: int,
    gamma: float,
    norm: float,
    ignore_index: int,
    reduction: int,
    compute_grad: bool,
    grad_out: Optional[torch.Tensor] = None,
    loss_dtype: torch.dtype = torch.float32,
    mix_target: Optional[torch.Tensor] = None,
    mix_lambda: Optional[torch.Tensor] = None,
    label_smoothing: float = 0.0,
    stats_out: Optional[tuple[torch.Tensor, torch.Tensor]] = None,
    class_weight: Optional[torch.Tensor] = None, lse_square_scale: float = 0.0, softcap: float = 0.0,
    z_loss_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the kernels; return ``(loss, grad, target_flag)`` as in ``csrc/uncertainty_weighted_ce.h`` (loss in
    ``loss_dtype``). One launch: the rows' loss and gradient, then the batch's loss and target flag in its last
    program (:func:`._row_helpers._finish`); a mean with a gradient over more than ``INLINE_COUNT_MAX_ROWS`` rows of
    class indices counts its divisor in a launch before it.

    ``logits (N, C)`` with unit column stride and any row stride; ``target (N,)`` int64. ``loss`` is 0-dim for
    mean/sum, ``(N,)`` for none. The gradient is written into ``grad_out`` when given (``(N, C)``, unit column stride,
    e.g. the logits themselves; ``grad`` is then empty), else returned as a new ``(N, C)`` tensor; neither when
    ``compute_grad`` is false. ``target_flag`` is the device-side ``(code, value)`` of
    :func:`._row_helpers._store_target_flag` (a bad target, ``mix_target`` or λ).
    Soft targets (:mod:`._soft_target_kernels`): ``mix_target (N,)`` int64 with ``mix_lambda`` (``()`` or ``(N,)``),
    ``label_smoothing``, or a floating ``target (N, C)`` (dense: the mean divides by N, and ``target_flag`` is
    ``(any bad row, the first bad row)`` of the kernel's value check, folded by the launch's last program; of float64
    reductions for a float64 target, :func:`calibkernels._validation.dense_target_flag`).
    ``stats_out``: ``(confidence, prediction)``, contiguous ``(N,)`` float32 and int64 buffers on the logits' device,
    into which the loss launch writes each row's top-label statistics
    (:func:`calibkernels.loss_stats.top_label_stats`: ``1/d`` and the first column of the max; NaN and -1 on a row
    whose class-index target is ``ignore_index``; the logits' own, whatever the target).
    Launch shapes come from the module constants (``MAX_BLOCK``, ``MAX_BLOCK_16BIT``, ``TWO_READ_CHUNK``), which
    bench/tune_triton.py and the tests override.
    Options (``class_weight (C,)``, ``lse_square_scale``, ``softcap``, ``z_loss_out``): :func:`_option_forward`.
    """
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend supports float32/float16/bfloat16 logits, got {logits.dtype} "
                        "(use backend='reference' for float64)")
    if logits.dim() != 2 or not _unit_columns(logits):
        raise ValueError(f"expected (N, C) logits with unit column stride, got shape {tuple(logits.shape)} "
                         f"stride {logits.stride()}")
    if class_weight is not None or lse_square_scale != 0.0 or softcap != 0.0 or z_loss_out is not None:
        return _option_forward(logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm,
                               ignore_index, reduction, compute_grad, grad_out, loss_dtype, mix_target, mix_lambda,
                               label_smoothing, stats_out, class_weight, float(lse_square_scale), float(softcap),
                               z_loss_out)
    target, mix_target, mix_lambda, label_smoothing, soft = _soft_target_arguments(
        logits, target, weight, mix_target, mix_lambda, label_smoothing)
    dense = target.is_floating_point()
    num_rows, num_classes = logits.shape
    device = logits.device
    single_read, block, num_warps = _launch_config(
        num_classes, logits.element_size(), "dense" if dense else ("compact" if soft else "hard"), weight, mode,
        stats_out is not None)

    dest, grad = _gradient_destination(logits, compute_grad, grad_out)
    if stats_out is not None:
        _check_stats_out(logits, stats_out)
    # a float64 target's tolerance (1e-6) is below what the kernel's float32 sums can tell on wide rows, and past
    # DENSE_KERNEL_CHECK_MAX_CLASSES columns their rounding nears a float32 target's (1e-4): those rows are checked by
    # device reductions (pairwise sums) instead of the kernel's flags
    dense_flags = dense and target.dtype != torch.float64 and num_classes <= DENSE_KERNEL_CHECK_MAX_CLASSES
    reduced = reduction != REDUCTION_NONE
    # reduction "none": the rows' losses are the result, written in its dtype (no cast launch)
    row_loss = torch.empty(num_rows, dtype=torch.float32 if reduced else loss_dtype, device=device)
    loss = torch.empty((), dtype=loss_dtype, device=device) if reduced else row_loss
    if num_rows == 0:  # nothing to launch: a mean or sum of no rows is 0, and no target is bad
        if reduced:
            loss.zero_()
        error = validation.dense_target_flag(target) if dense and not dense_flags else torch.zeros(2, dtype=torch.int64,
                                                                                           device=device)
        return loss, grad, error
    # a mix's values are checked with the targets, by the launch that checks those (the first slot of the flag says
    # which was bad: calibkernels._kernel_codes.TARGET_FLAG_CODES)
    has_mix = mix_target is not None
    lambda_stride = mix_lambda.stride(0) if has_mix and mix_lambda.dim() == 1 else 0
    count, valid_count, error, dense_bad = _count_and_flag_buffers(
        target, mix_target, mix_lambda, lambda_stride, row_loss, reduction, compute_grad, dense_flags, num_classes,
        ignore_index)
    per_sample_gamma = gamma_per_sample is not None
    # placeholders (here and for the flags of rows without DENSE_FLAGS) are never read
    weight_args = (sample_weight if sample_weight is not None else row_loss,
                   gamma_per_sample if per_sample_gamma else row_loss)
    confidence, prediction = stats_out if stats_out is not None else (row_loss, row_loss)  # placeholders: no STATS
    output_args = (row_loss, dest if dest is not None else logits, dest.stride(0) if dest is not None else 0,
                   confidence, prediction, valid_count)
    finish_args = (loss, error, _counter(device))
    meta = dict(WEIGHT=int(weight), MODE=int(mode), REDUCTION=int(reduction),
                COMPUTE_GRAD=bool(compute_grad), PER_SAMPLE_GAMMA=per_sample_gamma, BLOCK=block,
                SINGLE_READ=single_read, NORM_IS_TWO=weight in (WEIGHT_BRIER, WEIGHT_BRIER_FLSD) and float(norm) == 2.0,
                COUNT=count, CHECK_TARGETS=count == COUNT_INLINE, FINISH_BLOCK=_finish_block(num_rows, num_warps),
                STATS=stats_out is not None, num_warps=num_warps)
    if soft:
        _soft_target_ce_fwd_kernel[(num_rows,)](
            logits, logits.stride(0),
            target, target.stride(0) if dense else 0,
            mix_target if has_mix else target, mix_lambda if has_mix else row_loss, lambda_stride,
            *weight_args, *output_args, dense_bad if dense_flags else row_loss, *finish_args,
            num_rows, num_classes, float(gamma), float(norm), int(ignore_index), label_smoothing,
            validation.dense_row_sum_tolerance(target.dtype),
            DENSE=dense, HAS_MIX=has_mix, SMOOTH=label_smoothing != 0.0, DENSE_FLAGS=dense_flags, **meta,
        )
    else:
        _uncertainty_weighted_ce_fwd_kernel[(num_rows,)](
            logits, logits.stride(0), target, *weight_args, *output_args, *finish_args,
            num_rows, num_classes, float(gamma), float(norm), int(ignore_index), **meta,
        )
    return loss, grad, error


def _count_and_flag_buffers(target, mix_target, mix_lambda, lambda_stride, row_loss, reduction, compute_grad,
                            dense_flags, num_classes, ignore_index):
    """``(count mode, valid count buffer, target flag, dense rows' flags)`` of a launch: who counts the mean's rows
    (``COUNT_*``) and where the target flag comes from. A dense target counts every row and its kernel flags rows with
    bad values (``dense_flags``) or device reductions do; class indices are counted and checked by a launch of their
    own before the loss launch where a mean's gradient needs the count before any row is written (more than
    ``INLINE_COUNT_MAX_ROWS`` rows), else by the loss launch itself. Placeholders (``row_loss``) are never read."""
    num_rows, device = target.shape[0], target.device
    has_mix = mix_target is not None
    dense_bad = None
    if target.is_floating_point():  # no class indices
        count, valid_count = COUNT_ROWS, row_loss  # placeholder
        dense_bad = torch.empty(num_rows, dtype=torch.int8, device=device) if dense_flags else None
        error = (torch.empty(2, dtype=torch.int64, device=device) if dense_flags
                 else validation.dense_target_flag(target))
    elif reduction == REDUCTION_MEAN and compute_grad and num_rows > INLINE_COUNT_MAX_ROWS:
        # the gradient's scale needs the count before any row is written: a launch of its own for a large batch.
        # [any bad target, a bad target value, valid count]: the flag, returned, is the buffer's start (as its fake)
        count = COUNT_LOADED
        counts = torch.empty(3, dtype=torch.int64, device=device)
        error, valid_count = counts[:2], counts[2:]
        _uncertainty_weighted_ce_targets_kernel[(1,)](
            target, mix_target if has_mix else target, mix_lambda if has_mix else row_loss, lambda_stride,
            num_rows, num_classes, int(ignore_index), valid_count, error,
            CHECK_MIX=has_mix, BLOCK=min(4096, _next_power_of_2(num_rows)), num_warps=4)
    else:  # the loss launch counts and checks the targets itself
        count = COUNT_INLINE
        error = torch.empty(2, dtype=torch.int64, device=device)
        valid_count = row_loss  # placeholder
    return count, valid_count, error, dense_bad


def _gradient_destination(logits, compute_grad, grad_out):
    """``(dest, grad)``: where the kernels write the gradient (``None``: nowhere) and the returned gradient (a new
    ``(N, C)`` tensor, or an empty placeholder when it goes into ``grad_out`` or is not computed)."""
    if compute_grad and grad_out is not None:
        _check_grad_out(logits, grad_out)
    if compute_grad and grad_out is None:
        grad = torch.empty(tuple(logits.shape), dtype=logits.dtype, device=logits.device)
        return grad, grad
    return (grad_out if compute_grad else None), torch.empty((0,), dtype=logits.dtype, device=logits.device)


def _option_forward(logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, ignore_index,
                    reduction, compute_grad, grad_out, loss_dtype, mix_target, mix_lambda, label_smoothing, stats_out,
                    class_weight, lse_square_scale, softcap, z_loss_out):
    """:func:`uncertainty_weighted_ce_forward` of a call with options: one launch of
    :func:`._option_kernels._option_ce_fwd_kernel` (every row as a soft target), the target flag from the targets
    kernel (class indices; a dense target's from device reductions), and the reduction by torch operations (the
    class-weighted part and the z-loss have divisors of their own). Dual focal has no option form."""
    if weight == WEIGHT_DUAL_FOCAL:
        raise NotImplementedError("the triton kernels compute no class weights, z-loss or soft-capping with "
                                  "weight='dual_focal' (use backend='reference')")
    class_weight = check_options(logits, class_weight, lse_square_scale, softcap, z_loss_out)
    target, mix_target, mix_lambda, label_smoothing, _ = _soft_target_arguments(
        logits, target, weight, mix_target, mix_lambda, label_smoothing)
    dense = target.is_floating_point()
    num_rows, num_classes = logits.shape
    device = logits.device
    _, block, num_warps = _launch_config(num_classes, logits.element_size(), "dense" if dense else "compact", weight,
                                         mode, stats_out is not None)
    dest, grad = _gradient_destination(logits, compute_grad, grad_out)
    if stats_out is not None:
        _check_stats_out(logits, stats_out)
    row_loss = torch.empty(num_rows, dtype=torch.float32, device=device)
    z_rows = None
    if lse_square_scale != 0.0:
        z_rows = z_loss_out if z_loss_out is not None else torch.empty(num_rows, dtype=torch.float32, device=device)
    elif z_loss_out is not None:
        z_loss_out.zero_()
    has_mix = mix_target is not None
    lambda_stride = mix_lambda.stride(0) if has_mix and mix_lambda.dim() == 1 else 0
    if dense:
        error = validation.dense_target_flag(target)
        count = torch.full((), float(num_rows), dtype=torch.float32, device=device)
    else:  # [any bad target, a bad target value, valid count]
        counts = torch.zeros(3, dtype=torch.int64, device=device)
        error, count = counts[:2], counts[2]
        if num_rows > 0:
            _uncertainty_weighted_ce_targets_kernel[(1,)](
                target, mix_target if has_mix else target, mix_lambda if has_mix else row_loss, lambda_stride,
                num_rows, num_classes, int(ignore_index), counts[2:], error,
                CHECK_MIX=has_mix, BLOCK=min(4096, _next_power_of_2(num_rows)), num_warps=4)
        count = count.to(torch.float32)
    divisor = count
    if class_weight is not None and not dense:
        divisor = class_weighted_divisor(target, class_weight, mix_target, mix_lambda, ignore_index)
    if num_rows > 0:
        placeholder = row_loss  # never read
        confidence, prediction = stats_out if stats_out is not None else (placeholder, placeholder)
        _option_ce_fwd_kernel[(num_rows,)](
            logits, logits.stride(0), target, target.stride(0) if dense else 0,
            mix_target if has_mix else target, mix_lambda if has_mix else placeholder, lambda_stride,
            sample_weight if sample_weight is not None else placeholder,
            gamma_per_sample if gamma_per_sample is not None else placeholder,
            class_weight if class_weight is not None else placeholder, torch.stack((divisor, count)),
            row_loss, z_rows if z_rows is not None else placeholder,
            dest if dest is not None else logits, dest.stride(0) if dest is not None else 0, confidence, prediction,
            num_classes, float(gamma), float(norm), int(ignore_index), label_smoothing, lse_square_scale, softcap,
            WEIGHT=int(weight), MODE=int(mode), REDUCTION=int(reduction), COMPUTE_GRAD=bool(compute_grad),
            PER_SAMPLE_GAMMA=gamma_per_sample is not None, BLOCK=block,
            NORM_IS_TWO=weight in (WEIGHT_BRIER, WEIGHT_BRIER_FLSD) and float(norm) == 2.0, DENSE=dense,
            HAS_MIX=has_mix, HAS_CLASS_WEIGHT=class_weight is not None, Z_LOSS=z_rows is not None,
            SOFTCAP=softcap != 0.0, STATS=stats_out is not None, num_warps=num_warps)
    loss = reduced_option_loss(row_loss, z_rows, divisor, count, reduction, loss_dtype)
    return loss, grad, error


def _check_grad_out(logits: torch.Tensor, grad_out: torch.Tensor) -> None:
    """A caller's gradient buffer, as the compiled op checks it (csrc/uncertainty_weighted_ce.h, check_grad_out): the
    logits' shape, dtype and device (the kernels write every row of it), and no elements that share memory (an
    expanded tensor), whose rows would overwrite each other."""
    where = "calibkernels::uncertainty_weighted_ce_triton: "
    if grad_out.shape != logits.shape:
        raise ValueError(f"{where}grad_out must have the logits' shape {tuple(logits.shape)}, got "
                         f"{tuple(grad_out.shape)}")
    if grad_out.dtype != logits.dtype or grad_out.device != logits.device:
        raise ValueError(f"{where}grad_out must have the logits' dtype and device ({logits.dtype} on "
                         f"{logits.device}), got {grad_out.dtype} on {grad_out.device}")
    if validation.expanded(grad_out):
        raise ValueError(f"{where}grad_out has elements that share memory (e.g. an expanded tensor), so its rows "
                         "would overwrite each other; for the gradient in place, the logits must not share memory "
                         "either (use inplace=False, or clone() them)")


def _check_stats_out(logits: torch.Tensor, stats_out) -> None:
    """The statistics buffers ``(confidence, prediction)``: contiguous ``(N,)`` float32 and int64 tensors on the
    logits' device, which the loss launch writes row by row."""
    where = "calibkernels::uncertainty_weighted_ce_triton: "
    if not isinstance(stats_out, (tuple, list)) or len(stats_out) != 2:
        raise ValueError(f"{where}stats_out must be a pair (confidence, prediction)")
    num_rows = logits.shape[0]
    for name, buffer, dtype in zip(("confidence", "prediction"), stats_out, (torch.float32, torch.int64)):
        if (not isinstance(buffer, torch.Tensor) or buffer.dtype != dtype or tuple(buffer.shape) != (num_rows,)
                or buffer.device != logits.device or buffer.stride(0) != 1 and num_rows > 1):
            described = (f"{buffer.dtype} {tuple(buffer.shape)} stride {buffer.stride()} on {buffer.device}"
                         if isinstance(buffer, torch.Tensor) else type(buffer).__name__)
            raise ValueError(f"{where}{name} must be a contiguous {dtype} tensor of shape ({num_rows},) on "
                             f"{logits.device}, got {described}")


def _unit_columns(tensor: torch.Tensor) -> bool:
    """Whether the kernels can read ``tensor``'s rows as they lie: unit column stride, or a single column (whose
    stride is never read, and which ``contiguous()`` leaves as it is)."""
    return tensor.stride(-1) == 1 or tensor.shape[-1] == 1


def _finish_block(num_rows: int, num_warps: int) -> int:
    """The vector width of :func:`._row_helpers._finish`'s (and an inline count's) pass over the batch: up to 8 rows
    per thread of the launch's warps, at most 4096, no wider than the batch."""
    return min(_next_power_of_2(num_rows), 256 * num_warps, 4096)


# device (and, on a GPU, stream) -> the int32 ticket counter of _finish: zero between launches (the last program of
# each launch resets it), so a cached one costs no memset launch per call. One per stream, since launches on
# different streams may run at once; one per thread on the CPU, where the interpreter runs a launch in its caller.
_counters: dict = {}


def _counter(device: torch.device) -> torch.Tensor:
    """The zeroed ticket counter of a loss launch on ``device``'s current stream. While a CUDA graph is captured, a
    fresh one (its memset is captured with the launch), so that no graph holds a buffer eager launches share."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        if torch.cuda.is_current_stream_capturing():
            return torch.zeros(1, dtype=torch.int32, device=device)
        key = (index, torch._C._cuda_getCurrentRawStream(index))
    else:
        key = (device.type, threading.get_ident())
    counter = _counters.get(key)
    if counter is None:
        counter = _counters[key] = (_outside_memory_pools(index) if device.type == "cuda"
                                    else torch.zeros(1, dtype=torch.int32, device=device))
    return counter


def _outside_memory_pools(index: int) -> torch.Tensor:
    """A zeroed int32 counter on GPU ``index`` that no memory pool holds: allocated by another thread, since a pool
    that takes this thread's allocations (torch.compile's CUDA-graph warm-up, ``torch.cuda.use_mem_pool``) would
    hold a buffer that outlives the call, which the CUDA-graph trees refuse. Its zeroing, on that thread's default
    stream, is ordered before this thread's next launch by a stream wait, not by a host synchronisation."""
    made = []

    def make():
        try:
            with torch.cuda.device(index):
                made.append(torch.zeros(1, dtype=torch.int32, device=index))
        except BaseException as exc:  # re-raised in the caller
            made.append(exc)

    worker = threading.Thread(target=make, name="calibkernels-counter")
    worker.start()
    worker.join()
    if isinstance(made[0], BaseException):
        raise made[0]
    torch.cuda.current_stream(index).wait_stream(torch.cuda.default_stream(index))
    return made[0]


_PROGRAMS_PER_SM = 4
_sm_counts: dict = {}


def _persistent_programs(device: torch.device, num_rows: int, programs_per_sm: int = _PROGRAMS_PER_SM) -> int:
    """Grid of a row-striding launch: ``programs_per_sm`` per multiprocessor (3 on a CPU tensor, so that the
    interpreter tests exercise rows strided over fewer programs), at most one per row."""
    if device.type != "cuda":
        return max(1, min(num_rows, 3))
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _sm_counts:
        _sm_counts[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return max(1, min(num_rows, programs_per_sm * _sm_counts[index]))


def scale_grad_(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """In place ``grad *= grad_output`` (0-dim, or ``(N,)`` per row) without reading ``grad_output`` on the host."""
    num_rows, num_classes = grad.shape
    per_row = grad_output.dim() == 1
    block = min(_next_power_of_2(num_classes), _SCALE_BLOCK)
    _uncertainty_weighted_ce_scale_grad_kernel[(_persistent_programs(grad.device, num_rows),)](
        grad, grad.stride(0), grad_output, grad_output.stride(0) if per_row else 0, num_rows, num_classes,
        PER_ROW=per_row, BLOCK=block, num_warps=4 if block <= 1024 else 8,
    )


# ---------------------------------------------------------------------------------------------------------------------
# The registered op (the tracer's view) and the backend interface (calibkernels._backends, calibkernels._autograd)
# ---------------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("calibkernels::uncertainty_weighted_ce_triton",
                         mutates_args=("grad_out", "confidence_out", "prediction_out", "z_loss_out"))
def uncertainty_weighted_ce_triton(
    logits: torch.Tensor, target: torch.Tensor, sample_weight: Optional[torch.Tensor],
    gamma_per_sample: Optional[torch.Tensor], weight: int, loss_mode: int, gamma: float, norm: float, ignore_index: int,
    reduction: int, compute_grad: bool, grad_out: Optional[torch.Tensor], mix_target: Optional[torch.Tensor] = None,
    mix_lambda: Optional[torch.Tensor] = None, label_smoothing: float = 0.0,
    confidence_out: Optional[torch.Tensor] = None, prediction_out: Optional[torch.Tensor] = None,
    class_weight: Optional[torch.Tensor] = None, lse_square_scale: float = 0.0, softcap: float = 0.0,
    z_loss_out: Optional[torch.Tensor] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compiled op's contract (``csrc/uncertainty_weighted_ce.h``) on the Triton kernels: ``(loss, grad,
    target_flag)``, the gradient written into ``grad_out`` when given, the flag always two slots (these kernels never
    raise on a bad target). No target check is queued from here (traced code never reads the flag back; the bad rows
    are NaN). ``confidence_out`` / ``prediction_out`` (both or neither): the ``(N,)`` float32 / int64 buffers of the
    rows' top-label statistics (``stats_out`` of :func:`uncertainty_weighted_ce_forward`), written in the loss
    launch. The drop-in options as :func:`uncertainty_weighted_ce_forward` takes them, ``z_loss_out`` the rows'
    z-loss buffer."""
    return uncertainty_weighted_ce_forward(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma,
                                           norm, ignore_index, reduction, compute_grad, grad_out, torch.float32,
                                           mix_target, mix_lambda, label_smoothing,
                                           _stats_pair(confidence_out, prediction_out), class_weight=class_weight,
                                           lse_square_scale=lse_square_scale, softcap=softcap, z_loss_out=z_loss_out)


def _stats_pair(confidence_out, prediction_out):
    """``(confidence_out, prediction_out)``, or ``None`` when neither is given."""
    if confidence_out is None and prediction_out is None:
        return None
    if confidence_out is None or prediction_out is None:
        raise ValueError("calibkernels::uncertainty_weighted_ce_triton: confidence_out and prediction_out go together")
    return confidence_out, prediction_out


@uncertainty_weighted_ce_triton.register_fake
def _(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma, norm, ignore_index, reduction,
      compute_grad, grad_out, mix_target=None, mix_lambda=None, label_smoothing=0.0, confidence_out=None,
      prediction_out=None, class_weight=None, lse_square_scale=0.0, softcap=0.0, z_loss_out=None):
    loss = logits.new_empty((logits.shape[0],) if reduction == REDUCTION_NONE else (), dtype=torch.float32)
    grad = logits.new_empty(tuple(logits.shape) if compute_grad and grad_out is None else (0,))
    return loss, grad, logits.new_empty((2,), dtype=torch.int64)


def forward(logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, ignore_index, reduction,
            compute_grad, grad_out, mix_target=None, mix_lambda=None, label_smoothing=0.0, *, loss_dtype=None,
            stats_out=None, class_weight=None, lse_square_scale=0.0, softcap=0.0, z_loss_out=None):
    """``(loss, grad, target_flag)``: the backend forward of :mod:`calibkernels._autograd`. Eager calls launch the
    kernels directly (a ``custom_op`` call pays dispatcher and mutation bookkeeping in Python, more host time than the
    launches); traced calls go through the registered op. Soft targets: ``mix_target``/``mix_lambda`` (a number or
    a tensor), ``label_smoothing``, or a floating ``(N, C)`` ``target`` (refused with the dual-focal weight).
    ``loss_dtype``: an eager call's reduction writes the loss in this dtype (the logits' own, for the caller: no cast
    launch in the forward and none in the backward); traced calls return float32 as the op does. ``stats_out``: the
    ``(confidence, prediction)`` buffers the loss launch writes the rows' top-label statistics into
    (:func:`uncertainty_weighted_ce_forward`), from the logits as given (before an in-place gradient). The drop-in
    options ``class_weight``, ``lse_square_scale``, ``softcap`` (0: off) and the rows' z-loss buffer ``z_loss_out``
    as :func:`uncertainty_weighted_ce_forward` takes them (the option kernel)."""
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend supports float32/float16/bfloat16 logits, got {logits.dtype} "
                        "(use backend='reference' for float64)")
    if sample_weight is not None:
        sample_weight = sample_weight.detach().contiguous()
    if gamma_per_sample is not None:
        gamma_per_sample = gamma_per_sample.detach().contiguous()
    target, mix_target, mix_lambda, label_smoothing, soft = _soft_target_arguments(
        logits, target, weight, mix_target, mix_lambda, label_smoothing)
    target = target.contiguous()
    # The kernels take any row stride but need unit column stride: otherwise they work on a contiguous copy of the
    # logits, or write into a contiguous buffer, and the gradient is copied into the caller's grad_out afterwards.
    write_back = None
    if not _unit_columns(logits):
        in_place = grad_out is not None and grad_out.data_ptr() == logits.data_ptr()
        logits = logits.contiguous()
        if in_place:  # the copy is ours to overwrite
            write_back, grad_out = grad_out, logits
    if grad_out is not None and not _unit_columns(grad_out):
        write_back, grad_out = grad_out, torch.empty_like(logits, memory_format=torch.contiguous_format)
    args = (logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, ignore_index, reduction,
            compute_grad, grad_out)
    soft_args = (mix_target, mix_lambda, label_smoothing) if soft else ()
    options = {}
    if class_weight is not None or lse_square_scale != 0.0 or softcap != 0.0 or z_loss_out is not None:
        options = dict(class_weight=class_weight, lse_square_scale=float(lse_square_scale), softcap=float(softcap),
                       z_loss_out=z_loss_out)
    if torch.compiler.is_compiling() or type(logits) is not torch.Tensor:
        if stats_out is not None or options:  # the op's statistics buffers follow its soft-target arguments
            soft_args = (mix_target, mix_lambda, label_smoothing, *(stats_out or (None, None)))
        loss, grad, _ = uncertainty_weighted_ce_triton(*args, *soft_args, **options)
        flag = None
    else:
        # _target_checks ignores the flag during a capture
        loss, grad, flag = uncertainty_weighted_ce_forward(*args, loss_dtype or torch.float32, *soft_args,
                                                           stats_out=stats_out, **options)
    if write_back is not None:
        write_back.copy_(grad_out)
    return loss, grad, flag


def is_available(name: str, device: torch.device) -> str | None:
    """``None`` if the Triton kernels can run on ``device``: CUDA tensors, or CPU tensors under the interpreter."""
    device = torch.device(device)
    if device.type == "cuda":
        return None if torch.cuda.is_available() else "no CUDA device is available"
    if device.type == "cpu":
        if _INTERPRETED and os.environ.get("TRITON_INTERPRET") == "1":
            return None
        return "Triton kernels run on CPU tensors only under TRITON_INTERPRET=1 (set before calibkernels is imported)"
    return f"Triton kernels do not run on {device.type} tensors"
