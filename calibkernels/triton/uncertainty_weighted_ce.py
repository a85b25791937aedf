"""Triton kernel of the fused uncertainty-weighted cross-entropy (docs/losses.md): the default GPU backend.

Per row ``i`` with logits ``z_i (C,)``, target ``y_i`` and ``p_i = softmax(z_i)``, one program computes

    CE_i = lse_i - z_{i,y_i},      L_i = u_i · CE_i,

with the uncertainty weight ``u_i`` of :mod:`calibkernels.reference` (none / focal / FLSD-53 / dual focal / generalised
Brier score / external / generalised Brier score with FLSD-53's γ_i), and, in the same launch, the gradient of the
*reduced* loss for ``grad_output = 1``:

    mode="grad" (GRA):   dL_i/dz_ik = u_i (p_ik - e_ik)
    mode="loss":         dL_i/dz_ik = u_i (p_ik - e_ik) + CE_i du_i/dz_ik

    focal / FLSD       du/dz_k = -γ (1-p_y)^{γ-1} p_y (δ_ky - p_k)                       (γ_i of FLSD not differentiated)
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

Soft targets (docs/losses.md, "Soft targets"; :func:`calibkernels.reference.soft_uncertainty_weight` is the oracle)
put a target distribution ``t`` where the hard path has ``e_y``. It arrives in one of two forms:

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
``p_j`` needs one target class): soft targets with ``weight="dual_focal"`` raise ``ValueError``.

Kernel design (docs/performance.md):

* One program per row; online softmax with ``exp2``; the running max ``m``, the sum ``d = Σ e^{z-m}``, the sum over the
  non-target classes ``d_¬y`` (so ``1 - p_y = d_¬y / d`` never cancels), the gBS accumulator ``Σ_{k≠y} e^{q(z-m)}``
  (rescaled by ``e^{-qΔm}`` when the max moves) and dual focal's running ``max{z_k < z_y}`` with its tie count are all
  accumulators of the same pass; ``z_y`` is loaded first.
* All arithmetic in fp32 whatever the logits' dtype; offsets in int64; the row stride is an argument (sliced logits
  need no copy); the target entry of the gradient, ``-c (1 - p_y) + …``, is formed in fp32 before the single cast.
* Single-read path when the row fits one block (``C ≤ MAX_BLOCK``, ``MAX_BLOCK_16BIT`` for 16-bit logits: read the
  logits once, write the gradient once, in the loss launch) and a two-read path beyond that (statistics pass, then
  gradient pass, over ``TWO_READ_CHUNK`` chunks; the statistics pass asks L2 to keep the row and the gradient pass
  walks the chunks backwards, so the second read mostly hits L2).
* Gradient in the forward: the backward (:mod:`calibkernels._autograd`, shared with the compiled backends) only
  multiplies the saved gradient by ``grad_output`` with ``_uncertainty_weighted_ce_scale_grad_kernel``, which reads
  ``grad_output`` on the device and leaves the buffer untouched when it is exactly 1 (so ``loss.backward()`` costs one
  read and one write of N×C in total).
* ``inplace=True``: the gradient overwrites the logits buffer (zero extra N×C memory).
* Soft targets keep that traffic: their own kernel (``_soft_target_ce_fwd_kernel``, one program per row, the same
  launch shapes). A compact target is O(N) data (y, m and λ per row: three loads), and ``t_k`` is formed from three
  scalars per column; the statistics exclude the columns y and m (so ``1 - p_y``, ``1 - p_m`` never cancel) and add
  ``Σ (m - z)`` for the smoothing term of CE and, for the Brier weight, ``Σ e²`` (q = 2: ``Σ_{k∉{y,m}} (p_k - c)² =
  Σ p² - 2c Σ p + n c²``) or, without smoothing, ``Σ e^q``. A dense target adds one read of the N×C target (twice on
  the two-read path, beside the logits) and the sums ``Σ t (m - z)``, ``Σ e (1 - t)``, ``Σ e t``, ``Σ t`` (and
  ``Σ e²``, ``Σ t²`` for q = 2). In registers every S is summed term by term; on the two-read path the Brier weight
  with q ≠ 2 and smoothing or a dense target, whose ``|p_k - t_k|`` needs ``d``, reads the row once more before the
  gradient pass. The gradient of a compact row is a function of ``p`` alone (the target and mix columns' values are
  row scalars), and float32 soft rows are held in registers only up to ``MAX_BLOCK_DENSE`` (dense) and
  ``SOFT_BLOCK_CAPS`` classes, so that no launch spills (bench/triton_registers.py).
* No host synchronisation on the hot path, and one launch in the forward: the last program of the loss launch to
  finish (a ticket from an atomic counter, :func:`_finish`) sums the rows' losses in a fixed order, divides by the
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

Registered as ``torch.ops.calibkernels.uncertainty_weighted_ce_triton`` with ``torch.library.custom_op`` (the same
schema as the compiled op: in place is its mutable ``grad_out`` argument) and ``register_fake``, so
``torch.compile(fullgraph=True)`` keeps it in the graph and ``torch.library.opcheck`` passes; eager calls launch the
kernels directly (:func:`forward`). (``triton_op`` / ``wrap_triton`` would let Inductor look inside, but it cannot
trace kernels that run through the Triton interpreter, which is how this backend is tested on CPU.)

Naming ladder: ``_uncertainty_weighted_ce_fwd_kernel`` / ``_uncertainty_weighted_ce_scale_grad_kernel`` →
``uncertainty_weighted_ce_forward`` / ``scale_grad_`` → the registered op → the backend interface ``is_available`` /
``forward`` used by :mod:`calibkernels._backends` and :mod:`calibkernels._autograd`.
"""

from __future__ import annotations

import os
import threading
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _validation as V
from .._codes import (DENSE_KERNEL_CHECK_MAX_CLASSES, FLSD_LOW_GAMMA, FLSD_LOW_THRESHOLD, FLSD_MID_GAMMA,
                      FLSD_MID_THRESHOLD, TARGET_FLAG_CODES)

__all__ = [
    "SOFT_TARGETS",
    "MAX_BLOCK",
    "MAX_BLOCK_16BIT",
    "uncertainty_weighted_ce_forward",
    "forward",
    "scale_grad_",
    "is_available",
]

# Launch shapes, chosen with bench/tune_triton.py on an H200 (docs/performance.md):
# * Rows of up to MAX_BLOCK classes (float32) or MAX_BLOCK_16BIT classes (float16/bfloat16) take the single-read
#   path: the whole row held in registers as fp32, one program per row.
# * Longer rows take the two-read path, streamed in chunks of TWO_READ_CHUNK classes by a few warps: many rows in
#   flight per multiprocessor hide the memory latency better than one register-resident row of 32 warps (at
#   C = 32000 bf16: 0.47 ms against 0.60 ms for the best single-read shape), and the second read mostly hits L2.
MAX_BLOCK = 32768
MAX_BLOCK_16BIT = 4096
# * fp32 two-read chunks: 16384 classes by 16 warps (faster than 4096 by 8 at C = 128256).
# * 16-bit two-read chunks: 2048 classes by 4 warps (half of MAX_BLOCK_16BIT; the H200 sweep measured this shape).
TWO_READ_CHUNK = {2: (2048, 4), 4: (16384, 16)}  # element size -> (chunk, num_warps)
# * Soft targets hold more per column than class indices. Their float32 rows stay in registers only where the
#   block, compiled for sm_90, does not spill (bench/triton_registers.py; docs/performance.md, "Registers"): dense
#   rows (which also hold the target's entries) up to MAX_BLOCK_DENSE classes, and the variants in SOFT_BLOCK_CAPS
#   (target kind, weight formula, mode) only up to their cap; longer rows stream, in chunks no longer than the cap.
#   The 32768-class blocks had spilled 80-1100 stores' worth of registers to local memory (more traffic than the
#   row's own) in every dense variant, and 161-168 in the compact loss-mode ones with the FLSD and Brier weights.
MAX_BLOCK_DENSE = 16384
SOFT_BLOCK_CAPS = {("compact", "brier", "loss"): 16384, ("dense", "focal", "loss"): 8192,
                   ("dense", "focal", "grad"): 8192}
# Whether the kernels below were defined under the Triton interpreter (decided when triton.jit runs, i.e. now).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

# Soft targets (label smoothing, a compact mix, a dense target) run here: calibkernels._backends routes them to
# backends whose module says so.
SOFT_TARGETS = True

# Where a launch's mean divisor comes from (the kernels' COUNT): every row counts (a dense target has no ignored
# rows); the class-index targets counted in the loss launch itself (COUNT_INLINE: by every program, for the mean's
# gradient, in batches of up to INLINE_COUNT_MAX_ROWS rows, else only by the last program; the forward is one
# launch); or the targets kernel counted them in a launch of its own first (COUNT_LOADED: a mean with a gradient over
# a larger batch, where every program re-reading all N targets from L2 would cost more than the launch it saves:
# N² · 8 bytes).
COUNT_ROWS, COUNT_INLINE, COUNT_LOADED = 0, 1, 2
INLINE_COUNT_MAX_ROWS = 1024

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SCALE_BLOCK = 4096

WEIGHT_NONE, WEIGHT_FOCAL, WEIGHT_FLSD, WEIGHT_DUAL_FOCAL, WEIGHT_BRIER, WEIGHT_EXTERNAL, WEIGHT_BRIER_FLSD = (
    V.WEIGHT_CODES[k] for k in ("none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd")
)
MODE_LOSS, MODE_GRAD = V.MODE_CODES["loss"], V.MODE_CODES["grad"]
# the weight formula of SOFT_BLOCK_CAPS' keys (FLSD's rows are focal rows, Brier-FLSD's Brier rows)
_FORMULA_NAMES = {WEIGHT_FOCAL: "focal", WEIGHT_FLSD: "focal", WEIGHT_BRIER: "brier", WEIGHT_BRIER_FLSD: "brier"}
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = V.REDUCTION_CODES["none"], V.REDUCTION_CODES["mean"], V.REDUCTION_CODES["sum"]

# The same codes as Triton compile-time constants, so the kernel's branches read by name.
_NONE, _FOCAL, _FLSD, _DUAL_FOCAL, _BRIER, _EXTERNAL, _BRIER_FLSD = (tl.constexpr(code) for code in (
    WEIGHT_NONE, WEIGHT_FOCAL, WEIGHT_FLSD, WEIGHT_DUAL_FOCAL, WEIGHT_BRIER, WEIGHT_EXTERNAL, WEIGHT_BRIER_FLSD))
_LOSS_MODE = tl.constexpr(MODE_LOSS)
_MEAN = tl.constexpr(REDUCTION_MEAN)
_REDUCTION_NONE = tl.constexpr(REDUCTION_NONE)
_COUNT_ROWS, _COUNT_INLINE, _COUNT_LOADED = (tl.constexpr(code) for code in (COUNT_ROWS, COUNT_INLINE, COUNT_LOADED))
# FLSD-53 (Mukhoti et al.): the bands of calibkernels._codes, as in csrc/uncertainty_weighted_ce.h
_FLSD_LOW_THRESHOLD, _FLSD_LOW_GAMMA, _FLSD_MID_THRESHOLD, _FLSD_MID_GAMMA = (tl.constexpr(v) for v in (
    FLSD_LOW_THRESHOLD, FLSD_LOW_GAMMA, FLSD_MID_THRESHOLD, FLSD_MID_GAMMA))
# the first slot of a class-index target flag (_store_target_flag)
_FLAG_TARGET, _FLAG_MIX_TARGET, _FLAG_MIX_LAMBDA = (tl.constexpr(TARGET_FLAG_CODES[k]) for k in (
    "target", "mix_target", "mix_lambda"))
# below every target: the running maximum of a scan's bad targets before it has seen one
_MIN_INT64 = tl.constexpr(-9223372036854775807)


# ---------------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------------
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
    """The target flag of class indices, ``(code, value)`` (calibkernels._codes.TARGET_FLAG_CODES), from a scan's
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
def _uncertainty_weighted_ce_row(
    row,
    logits_ptr, logits_row_stride,
    target_ptr, sample_weight_ptr, gamma_ptr,
    row_loss_ptr, grad_ptr, grad_row_stride,
    valid_count_ptr,
    num_rows, num_classes, gamma, norm, ignore_index,
    WEIGHT: tl.constexpr, MODE: tl.constexpr, REDUCTION: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, PER_SAMPLE_GAMMA: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE_READ: tl.constexpr, NORM_IS_TWO: tl.constexpr,
    COUNT: tl.constexpr, COUNT_BLOCK: tl.constexpr,
):
    """Row loss ``u_i CE_i`` of row ``row`` (int64; stored in ``row_loss``'s dtype) and, if COMPUTE_GRAD, its
    gradient of the reduced loss (the mean's divisor from COUNT, :func:`_gradient_scale`)."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
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
        col_mask = cols < num_classes
        z = tl.load(logits_row + cols, mask=col_mask, other=NEG_INF).to(tl.float32)
        m = tl.max(z, 0)
        m_safe = tl.where(m == NEG_INF, 0.0, m)  # an all -inf row must not produce inf - inf
        e = tl.exp2((z - m_safe) * LOG2E)
        is_target_col = cols == safe_target
        e_others = tl.where(is_target_col, 0.0, e)
        d_others = tl.sum(e_others, 0)
        if FORMULA == _BRIER:
            if NORM_IS_TWO:
                sum_q_others = tl.sum(e_others * e_others, 0)
            else:
                sum_q_others = tl.sum(tl.where(is_target_col, 0.0, tl.exp2((z - m_safe) * (norm * LOG2E))), 0)
        if FORMULA == _DUAL_FOCAL:
            below = z < z_target
            z_below_max = tl.max(tl.where(below, z, NEG_INF), 0)
            n_ties = tl.sum(tl.where(below & (z == z_below_max), 1.0, 0.0), 0)
    else:
        # Scalar running sums, reduced per chunk. Per-lane sums reduced once after the loop (fewer block reductions)
        # measured slower on an H200 (C = 128256 bf16: 1.87 against 1.61 ms): two more BLOCK-wide live vectors
        # cost occupancy, which this memory-bound loop needs more than it needs fewer barriers.
        m_safe = tl.full((), 0.0, tl.float32)
        m = tl.full((), NEG_INF, tl.float32)
        d_others = tl.full((), 0.0, tl.float32)
        sum_q_others = tl.full((), 0.0, tl.float32)
        z_below_max = tl.full((), NEG_INF, tl.float32)
        n_ties = tl.full((), 0.0, tl.float32)
        for start in range(0, num_classes, BLOCK):
            offs = start + cols
            z, col_mask, m_new, m_new_safe, rescale = _statistics_chunk(logits_row, offs, num_classes, m)
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
    e_target = tl.exp2((z_target - m_safe) * LOG2E)
    d = d_others + e_target

    # ---- per-row scalars -------------------------------------------------------------------------------------------
    # Probabilities as p_k = 2^{(z_k - m) log2 e - log2 d}: the max is subtracted first, so z_k - m is exact for the
    # classes that matter; 2^{(z_k - lse) log2 e} would carry the rounding of lse = m + ln d, an error of ulp(m) in
    # the exponent (~1e-5 relative in p_k for logits of a few hundred), which a loss-mode gradient multiplies by CE.
    log2_d = tl.log2(d)
    p_target = tl.exp2((z_target - m_safe) * LOG2E - log2_d)
    # Confident rows: CE = -log p_y = log1p(d_¬y / e^{z_y - m}); log(d) with d ≈ 1 would keep only the rounding of d.
    # log1p by Kahan's trick (exact log of the rounded 1 + x, rescaled).
    odds_against = d_others / e_target
    one_plus = 1.0 + odds_against
    log1p_odds = tl.where(one_plus == 1.0, odds_against, tl.log(one_plus) * odds_against / (one_plus - 1.0))
    cross_entropy = tl.where(p_target > 0.5, log1p_odds, (m_safe - z_target) + log2_d * LN2)
    one_minus_p = d_others / d  # = 1 - p_y without cancellation
    # gradient: grad_k = coef_p p_k + coef_tie τ_k + coef_h (p_k^q - p_k H) for k ≠ y;  grad_y = -coef_p (1-p_y) + extra_y
    coef_p = 1.0
    extra_y = 0.0
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

    _store_row_loss(row_loss_ptr, row, u, cross_entropy, is_valid, is_bad)

    # ---- gradient of the reduced loss for grad_output = 1 ----------------------------------------------------------
    if COMPUTE_GRAD:
        scale = _gradient_scale(valid_count_ptr, target_ptr, num_rows, num_classes, ignore_index, REDUCTION, COUNT,
                                COUNT_BLOCK)
        grad_target = (-coef_p * one_minus_p + extra_y) * scale
        grad_row = grad_ptr + row * grad_row_stride
        inv_d = 1.0 / d
        if SINGLE_READ:
            p = e * inv_d
            grad = coef_p * p
            if FORMULA == _DUAL_FOCAL and MODE == _LOSS_MODE:
                grad += tl.where(below & (z == z_below_max), coef_tie, 0.0)
            if FORMULA == _BRIER and MODE == _LOSS_MODE:
                if NORM_IS_TWO:
                    grad += coef_h * (p * p - p * h_sum)
                else:
                    grad += coef_h * (tl.exp2(((z - m_safe) * LOG2E - log2_d) * norm) - p * h_sum)
            grad = tl.where(is_target_col, grad_target, grad * scale)
            grad = tl.where(is_valid, grad, 0.0)
            grad = tl.where(is_bad, float("nan"), grad)
            tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=col_mask)
        else:
            # last chunk first: the chunks read most recently are the likeliest still in L2
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
                grad = tl.where(offs == safe_target, grad_target, grad * scale)
                grad = tl.where(is_valid, grad, 0.0)
                grad = tl.where(is_bad, float("nan"), grad)
                tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=col_mask, eviction_policy="evict_first")


@triton.jit
def _uncertainty_weighted_ce_fwd_kernel(
    logits_ptr, logits_row_stride,
    target_ptr, sample_weight_ptr, gamma_ptr,
    row_loss_ptr, grad_ptr, grad_row_stride,
    valid_count_ptr, loss_ptr, error_ptr, counter_ptr,
    num_rows, num_classes, gamma, norm, ignore_index,
    WEIGHT: tl.constexpr, MODE: tl.constexpr, REDUCTION: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, PER_SAMPLE_GAMMA: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE_READ: tl.constexpr, NORM_IS_TWO: tl.constexpr,
    COUNT: tl.constexpr, CHECK_TARGETS: tl.constexpr, FINISH_BLOCK: tl.constexpr,
):
    """Row losses and gradient rows, one program per row; then the batch's loss and target flag (:func:`_finish`)."""
    _uncertainty_weighted_ce_row(
        tl.program_id(0).to(tl.int64), logits_ptr, logits_row_stride, target_ptr, sample_weight_ptr, gamma_ptr,
        row_loss_ptr, grad_ptr, grad_row_stride, valid_count_ptr, num_rows, num_classes, gamma, norm, ignore_index,
        WEIGHT, MODE, REDUCTION, COMPUTE_GRAD, PER_SAMPLE_GAMMA, BLOCK, SINGLE_READ, NORM_IS_TWO, COUNT, FINISH_BLOCK)
    if REDUCTION != _REDUCTION_NONE or CHECK_TARGETS:
        _finish(row_loss_ptr, target_ptr, row_loss_ptr, valid_count_ptr, loss_ptr, error_ptr, counter_ptr,
                target_ptr, row_loss_ptr, 0, num_rows, num_classes, ignore_index, REDUCTION, COUNT, CHECK_TARGETS,
                False, False, FINISH_BLOCK)


# ---------------------------------------------------------------------------------------------------------------------
# Soft targets: one program per row, as above, with the target distribution t of the row (module docstring)
# ---------------------------------------------------------------------------------------------------------------------
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
    grad = tl.where(is_valid, grad * scale, 0.0)
    grad = tl.where(is_bad, float("nan"), grad)
    tl.store(ptrs, grad.to(ptrs.dtype.element_ty), mask=col_mask, eviction_policy=EVICTION)


@triton.jit
def _soft_target_ce_fwd_kernel(
    logits_ptr, logits_row_stride,
    target_ptr, target_row_stride, mix_ptr, lambda_ptr, lambda_stride,
    sample_weight_ptr, gamma_ptr,
    row_loss_ptr, grad_ptr, grad_row_stride,
    valid_count_ptr, dense_bad_ptr, loss_ptr, error_ptr, counter_ptr,
    num_rows, num_classes, gamma, norm, ignore_index, smoothing, dense_tolerance,
    WEIGHT: tl.constexpr, MODE: tl.constexpr, REDUCTION: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, PER_SAMPLE_GAMMA: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE_READ: tl.constexpr, NORM_IS_TWO: tl.constexpr,
    DENSE: tl.constexpr, HAS_MIX: tl.constexpr, SMOOTH: tl.constexpr, DENSE_FLAGS: tl.constexpr,
    COUNT: tl.constexpr, CHECK_TARGETS: tl.constexpr, FINISH_BLOCK: tl.constexpr,
):
    """Row losses and gradient rows for soft targets, one program per row: a dense ``target (N, C)`` (DENSE) or
    class indices with an optional mix (HAS_MIX: ``mix_target (N,)``, λ at ``lambda_ptr + row * lambda_stride``),
    both with label smoothing ``a = smoothing`` (SMOOTH: ``a > 0``). A dense row's value check rides on its reads
    (DENSE_FLAGS): ``dense_bad_ptr[row]`` is 1 where an entry is negative or NaN or the entries' float32 sum is off 1
    by more than ``dense_tolerance``, else 0."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
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
    if DENSE:
        is_valid = row >= 0  # no ignored rows
        is_bad = row < 0
        safe_target = row  # placeholders of the compact form, never read
        safe_mix = row
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

    # ---- statistics: one pass (single read) or the streamed statistics pass with the online max -----------------
    # dense: Σe, Σ t(m - z), Σe², Σ e(1 - t), Σ e t, Σt, Σt²;  compact (over the other columns): Σe, Σ(m - z) over
    # all columns (smoothing), Σe^q (Brier)
    GAPS: tl.constexpr = SMOOTH
    POWERS: tl.constexpr = IS_BRIER and (NORM_IS_TWO or not SMOOTH)
    SQUARES: tl.constexpr = IS_BRIER and NORM_IS_TWO
    if SINGLE_READ:
        col_mask = cols < num_classes
        z = tl.load(logits_row + cols, mask=col_mask, other=NEG_INF).to(tl.float32)
        m = tl.max(z, 0)
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
            special = (cols == safe_target) | (cols == safe_mix)
            sum_e, gap, sum_q = _compact_sums(z, e, special, col_mask, m_safe, norm, GAPS, POWERS, NORM_IS_TWO)
    else:
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
        for start in range(0, num_classes, BLOCK):
            offs = start + cols
            z, col_mask, m_new, m_new_safe, rescale = _statistics_chunk(logits_row, offs, num_classes, m)
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

    # ---- per-row scalars: CE, 1 - P, FLSD's band value, and the compact form's target / mix columns -------------
    if DENSE:
        if DENSE_FLAGS:
            dense_bad = (not_nonneg > 0) | (tl.abs(given_sum - 1.0) > dense_tolerance) | (given_sum != given_sum)
            tl.store(dense_bad_ptr + row, dense_bad.to(tl.int8))
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
        delta_target = zero  # placeholders of the compact form
        delta_mix = zero
        t_minus_P_target = zero
        t_minus_P_mix = zero
        Q = zero
        p_y = zero
        p_m = zero
        grad_target = zero
        grad_mix = zero
    else:
        d_rest = sum_e
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
        sum_t = zero + 1.0  # placeholder: Σ_k t_k = 1

    # ---- the Brier weight's S = Σ |p - t|^q and H = Σ h_k p_k -------------------------------------------------------
    # In registers a row vector that stays live across the weight's scalar chain is 32-64 registers per thread at the
    # largest blocks, so the columns are formed where they are used, from p (and a dense row's entries) alone: a
    # δ, Σt p - t or t - P vector formed before the chain and kept to the gradient made the float32 rows of 16384 and
    # 32768 classes spill (docs/performance.md, "Registers").
    brier_s = zero
    brier_h_sum = zero
    if SINGLE_READ:
        p = e * inv_d
    if IS_BRIER:
        if SINGLE_READ and DENSE:
            delta = p - (raw * one_minus_a + c)
            brier_s = tl.sum(tl.where(col_mask, _brier_power(delta, norm, NORM_IS_TWO), 0.0), 0)
            if MODE == _LOSS_MODE:
                brier_h_sum = tl.sum(tl.where(col_mask, _brier_h(delta, norm, NORM_IS_TWO) * p, 0.0), 0)
        elif DENSE and NORM_IS_TWO:
            # Σ (p - t)² = Σp² - 2P + Σt², H = 2 (Σp² - P), from the statistics pass
            p_sq = sum_q * inv_d * inv_d
            brier_s = tl.maximum(p_sq - 2.0 * P + sum_t_sq, 0.0)
            brier_h_sum = 2.0 * (p_sq - P)
        elif DENSE or (SMOOTH and not SINGLE_READ and not NORM_IS_TWO):
            # q ≠ 2 with |p_k - t_k| depending on d: one more read of the row once d is known
            for start in range(0, num_classes, BLOCK):
                col_mask, p, delta, ce_delta, t_minus_P = _load_soft_chunk(
                    logits_row, target_row, start + cols, num_classes, m_safe, log2_d, DENSE, "evict_last",
                    one_minus_a, c, a_minus_c, sum_t, P, one_minus_P, safe_target, safe_mix, delta_target, delta_mix,
                    t_minus_P_target, t_minus_P_mix, Q)
                brier_s += tl.sum(tl.where(col_mask, _brier_power(delta, norm, NORM_IS_TWO), 0.0), 0)
                if MODE == _LOSS_MODE:
                    brier_h_sum += tl.sum(tl.where(col_mask, _brier_h(delta, norm, NORM_IS_TWO) * p, 0.0), 0)
        else:
            # compact: the other columns' terms (t = c), then the target and mix columns' own
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

    # ---- weight, loss ----------------------------------------------------------------------------------------------
    u, coef_focal, coef_brier = _soft_weight(row, cross_entropy, one_minus_P, p_band, brier_s, sample_weight_ptr,
                                             gamma_ptr, gamma, norm, FORMULA, FLSD_SCHEDULE, MODE, PER_SAMPLE_GAMMA)
    _store_row_loss(row_loss_ptr, row, u, cross_entropy, is_valid, is_bad)

    # ---- gradient of the reduced loss for grad_output = 1 ----------------------------------------------------------
    if COMPUTE_GRAD:
        scale = _gradient_scale(valid_count_ptr, target_ptr, num_rows, num_classes, ignore_index, REDUCTION, COUNT,
                                FINISH_BLOCK)
        grad_row = grad_ptr + row * grad_row_stride
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
            # last chunk first: the chunks read most recently are the likeliest still in L2
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
                grad = _soft_block_gradient(p, offs, raw, DENSE, one_minus_a, c, a_minus_c, sum_t, P, one_minus_P,
                                            safe_target, safe_mix, grad_target, grad_mix, Q, u, coef_focal,
                                            coef_brier, brier_h_sum, norm, FORMULA, MODE, NORM_IS_TWO)
                _store_gradient(grad_row + offs, grad, col_mask, scale, is_valid, is_bad, "evict_first")
    if REDUCTION != _REDUCTION_NONE or CHECK_TARGETS or DENSE_FLAGS:
        _finish(row_loss_ptr, target_ptr, dense_bad_ptr, valid_count_ptr, loss_ptr, error_ptr, counter_ptr,
                mix_ptr, lambda_ptr, lambda_stride, num_rows, num_classes, ignore_index, REDUCTION, COUNT,
                CHECK_TARGETS, DENSE_FLAGS, HAS_MIX, FINISH_BLOCK)


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


# ---------------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------------
def _next_power_of_2(n: int) -> int:
    """The smallest power of two ``>= n`` (1 for ``n <= 1``): ``triton.next_power_of_2`` in a few bit operations, for
    the launchers' per-call host path (Triton's own took about 5 µs per call on the development VM)."""
    return 1 << max(n - 1, 0).bit_length()


def _num_warps(block: int) -> int:
    # about 32 fp32 values per thread for big rows, at least one warp group for small ones
    return max(4, min(32, block // 1024))


def _launch_config(num_classes: int, element_size: int, target: str = "hard", weight: Optional[int] = None,
                   mode: Optional[int] = None) -> tuple[bool, int, int]:
    """``(single_read, BLOCK, num_warps)`` for rows of ``num_classes`` with ``target`` ``"hard"`` (class indices),
    ``"compact"`` (smoothing or a mix) or ``"dense"``, and the weight and mode codes (see the launch-shape notes at
    the top)."""
    base_cap = MAX_BLOCK
    if element_size <= 2:
        base_cap = min(base_cap, MAX_BLOCK_16BIT)
    cap = base_cap
    if target == "dense":
        cap = min(cap, MAX_BLOCK_DENSE)
    if target != "hard":
        mode_name = "loss" if mode == MODE_LOSS else "grad"
        cap = min(cap, SOFT_BLOCK_CAPS.get((target, _FORMULA_NAMES.get(weight), mode_name), cap))
    if num_classes <= cap:
        block = _next_power_of_2(num_classes)
        # 16-bit rows: 8 values per thread (a 16-byte load) at C = 1000 was fastest; fp32: 4; up to 16 warps
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
    if not V.is_number(label_smoothing):
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
        mix_lambda = V.lambda_tensor(mix_lambda, torch.float32, logits.device)
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
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Launch the kernels; return ``(loss, grad, target_flag)`` as in ``csrc/uncertainty_weighted_ce.h`` (loss in
    ``loss_dtype``). One launch: the rows' loss and gradient, then the batch's loss and target flag in its last
    program (:func:`_finish`); a mean with a gradient over more than ``INLINE_COUNT_MAX_ROWS`` rows of class indices
    counts its divisor in a launch before it.

    ``logits (N, C)`` with unit column stride and any row stride; ``target (N,)`` int64. ``loss`` is 0-dim for
    mean/sum, ``(N,)`` for none. The gradient is written into ``grad_out`` when given (``(N, C)``, unit column stride,
    e.g. the logits themselves; ``grad`` is then empty), else returned as a new ``(N, C)`` tensor; neither when
    ``compute_grad`` is false. ``target_flag`` is the device-side ``(code, value)`` of :func:`_store_target_flag`
    (a bad target, ``mix_target`` or λ).
    Soft targets (module docstring): ``mix_target (N,)`` int64 with ``mix_lambda`` (``()`` or ``(N,)``),
    ``label_smoothing``, or a floating ``target (N, C)`` (dense: the mean divides by N, and ``target_flag`` is
    ``(any bad row, the first bad row)`` of the kernel's value check, folded by the launch's last program; of float64
    reductions for a float64 target, :func:`calibkernels._validation.dense_target_flag`).
    Launch shapes come from the module constants (``MAX_BLOCK``, ``MAX_BLOCK_16BIT``, ``TWO_READ_CHUNK``), which
    bench/tune_triton.py and the tests override.
    """
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend supports float32/float16/bfloat16 logits, got {logits.dtype} "
                        "(use backend='reference' for float64)")
    if logits.dim() != 2 or not _unit_columns(logits):
        raise ValueError(f"expected (N, C) logits with unit column stride, got shape {tuple(logits.shape)} "
                         f"stride {logits.stride()}")
    target, mix_target, mix_lambda, label_smoothing, soft = _soft_target_arguments(
        logits, target, weight, mix_target, mix_lambda, label_smoothing)
    dense = target.is_floating_point()
    num_rows, num_classes = logits.shape
    device = logits.device
    single_read, block, num_warps = _launch_config(
        num_classes, logits.element_size(), "dense" if dense else ("compact" if soft else "hard"), weight, mode)

    if compute_grad and grad_out is not None:
        _check_grad_out(logits, grad_out)
    if compute_grad and grad_out is None:
        dest = grad = torch.empty((num_rows, num_classes), dtype=logits.dtype, device=device)
    else:  # no gradient, or written into grad_out: an empty placeholder
        dest, grad = grad_out if compute_grad else None, torch.empty((0,), dtype=logits.dtype, device=device)
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
        error = V.dense_target_flag(target) if dense and not dense_flags else torch.zeros(2, dtype=torch.int64,
                                                                                           device=device)
        return loss, grad, error
    # a mix's values are checked with the targets, by the launch that checks those (the first slot of the flag says
    # which was bad: calibkernels._codes.TARGET_FLAG_CODES)
    has_mix = mix_target is not None
    lambda_stride = mix_lambda.stride(0) if has_mix and mix_lambda.dim() == 1 else 0
    if dense:  # no class indices: every row counts for the mean; the kernel flags rows with bad values (dense_flags)
        count, valid_count = COUNT_ROWS, row_loss  # placeholder
        dense_bad = torch.empty(num_rows, dtype=torch.int8, device=device) if dense_flags else None
        error = torch.empty(2, dtype=torch.int64, device=device) if dense_flags else V.dense_target_flag(target)
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
    per_sample_gamma = gamma_per_sample is not None
    # placeholders (here and for the flags of rows without DENSE_FLAGS) are never read
    weight_args = (sample_weight if sample_weight is not None else row_loss,
                   gamma_per_sample if per_sample_gamma else row_loss)
    output_args = (row_loss, dest if dest is not None else logits, dest.stride(0) if dest is not None else 0,
                   valid_count)
    finish_args = (loss, error, _counter(device))
    meta = dict(WEIGHT=int(weight), MODE=int(mode), REDUCTION=int(reduction),
                COMPUTE_GRAD=bool(compute_grad), PER_SAMPLE_GAMMA=per_sample_gamma, BLOCK=block,
                SINGLE_READ=single_read, NORM_IS_TWO=weight in (WEIGHT_BRIER, WEIGHT_BRIER_FLSD) and float(norm) == 2.0,
                COUNT=count, CHECK_TARGETS=count == COUNT_INLINE, FINISH_BLOCK=_finish_block(num_rows, num_warps),
                num_warps=num_warps)
    if soft:
        _soft_target_ce_fwd_kernel[(num_rows,)](
            logits, logits.stride(0),
            target, target.stride(0) if dense else 0,
            mix_target if has_mix else target, mix_lambda if has_mix else row_loss, lambda_stride,
            *weight_args, *output_args, dense_bad if dense_flags else row_loss, *finish_args,
            num_rows, num_classes, float(gamma), float(norm), int(ignore_index), label_smoothing,
            V.dense_row_sum_tolerance(target.dtype),
            DENSE=dense, HAS_MIX=has_mix, SMOOTH=label_smoothing != 0.0, DENSE_FLAGS=dense_flags, **meta,
        )
    else:
        _uncertainty_weighted_ce_fwd_kernel[(num_rows,)](
            logits, logits.stride(0), target, *weight_args, *output_args, *finish_args,
            num_rows, num_classes, float(gamma), float(norm), int(ignore_index), **meta,
        )
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
    if V.expanded(grad_out):
        raise ValueError(f"{where}grad_out has elements that share memory (e.g. an expanded tensor), so its rows "
                         "would overwrite each other; for the gradient in place, the logits must not share memory "
                         "either (use inplace=False, or clone() them)")


def _unit_columns(tensor: torch.Tensor) -> bool:
    """Whether the kernels can read ``tensor``'s rows as they lie: unit column stride, or a single column (whose
    stride is never read, and which ``contiguous()`` leaves as it is)."""
    return tensor.stride(-1) == 1 or tensor.shape[-1] == 1


def _finish_block(num_rows: int, num_warps: int) -> int:
    """The vector width of :func:`_finish`'s (and an inline count's) pass over the batch: up to 8 rows per thread of
    the launch's warps, at most 4096, no wider than the batch."""
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
@torch.library.custom_op("calibkernels::uncertainty_weighted_ce_triton", mutates_args=("grad_out",))
def uncertainty_weighted_ce_triton(
    logits: torch.Tensor, target: torch.Tensor, sample_weight: Optional[torch.Tensor],
    gamma_per_sample: Optional[torch.Tensor], weight: int, loss_mode: int, gamma: float, norm: float, ignore_index: int,
    reduction: int, compute_grad: bool, grad_out: Optional[torch.Tensor], mix_target: Optional[torch.Tensor] = None,
    mix_lambda: Optional[torch.Tensor] = None, label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The compiled op's contract (``csrc/uncertainty_weighted_ce.h``) on the Triton kernels: ``(loss, grad,
    target_flag)``, the gradient written into ``grad_out`` when given, the flag always two slots (these kernels never
    raise on a bad target). No target check is queued from here (traced code never reads the flag back; the bad rows
    are NaN)."""
    return uncertainty_weighted_ce_forward(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma,
                                           norm, ignore_index, reduction, compute_grad, grad_out, torch.float32,
                                           mix_target, mix_lambda, label_smoothing)


@uncertainty_weighted_ce_triton.register_fake
def _(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma, norm, ignore_index, reduction,
      compute_grad, grad_out, mix_target=None, mix_lambda=None, label_smoothing=0.0):
    loss = logits.new_empty((logits.shape[0],) if reduction == REDUCTION_NONE else (), dtype=torch.float32)
    grad = logits.new_empty(tuple(logits.shape) if compute_grad and grad_out is None else (0,))
    return loss, grad, logits.new_empty((2,), dtype=torch.int64)


def forward(logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, ignore_index, reduction,
            compute_grad, grad_out, mix_target=None, mix_lambda=None, label_smoothing=0.0, *, loss_dtype=None):
    """``(loss, grad, target_flag)``: the backend forward of :mod:`calibkernels._autograd`. Eager calls launch the
    kernels directly (a ``custom_op`` call pays dispatcher and mutation bookkeeping in Python, more host time than the
    launches); traced calls go through the registered op. Soft targets: ``mix_target``/``mix_lambda`` (a number or
    a tensor), ``label_smoothing``, or a floating ``(N, C)`` ``target`` (refused with the dual-focal weight).
    ``loss_dtype``: an eager call's reduction writes the loss in this dtype (the logits' own, for the caller: no cast
    launch in the forward and none in the backward); traced calls return float32 as the op does."""
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
    if torch.compiler.is_compiling() or type(logits) is not torch.Tensor:
        loss, grad, _ = uncertainty_weighted_ce_triton(*args, *soft_args)
        flag = None
    else:
        # _target_checks ignores the flag during a capture
        loss, grad, flag = uncertainty_weighted_ce_forward(*args, loss_dtype or torch.float32, *soft_args)
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
