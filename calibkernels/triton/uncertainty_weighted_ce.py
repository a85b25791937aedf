"""Triton kernel of the fused uncertainty-weighted cross-entropy (SPEC §2, §7, §8): the default GPU backend.

Per row ``i`` with logits ``z_i (C,)``, target ``y_i`` and ``p_i = softmax(z_i)``, one program computes

    CE_i = lse_i - z_{i,y_i},      L_i = u_i · CE_i,

with the uncertainty weight ``u_i`` of :mod:`calibkernels.reference` (none / focal / FLSD-53 / dual focal / generalised
Brier score / external), and, in the same launch, the gradient of the *reduced* loss for ``grad_output = 1``:

    mode="grad" (GRA):   dL_i/dz_ik = u_i (p_ik - e_ik)
    mode="loss":         dL_i/dz_ik = u_i (p_ik - e_ik) + CE_i du_i/dz_ik

    focal / FLSD       du/dz_k = -γ (1-p_y)^{γ-1} p_y (δ_ky - p_k)                       (γ_i of FLSD not differentiated)
    dual focal         du/dz_k = γ (1-p_y+p_j)^{γ-1} (p_j (τ_k - p_k) - p_y (δ_ky - p_k)),   p_j = max{p_k : z_k < z_y},
                       τ_k = 1/n on the n classes tied at p_j (how ``amax``'s backward splits the gradient)
    Brier (q, γ)       u = S^{γ/q},  S = Σ_{k≠y} p_k^q + (1-p_y)^q,
                       du/dz_k = γ S^{γ/q-1} (h_k - p_k H),  h_k = p_k^q (k≠y),  h_y = -p_y (1-p_y)^{q-1},  H = Σ_k h_k

(Lin et al. 2017; Mukhoti et al. 2020; Tao, Dong & Xu, ICML 2023; the BSCE-GRA paper, Eq. 3/11.)

Kernel design (SPEC §7):

* One program per row; online softmax with ``exp2``; the running max ``m``, the sum ``d = Σ e^{z-m}``, the sum over the
  non-target classes ``d_¬y`` (so ``1 - p_y = d_¬y / d`` never cancels), the gBS accumulator ``Σ_{k≠y} e^{q(z-m)}``
  (rescaled by ``e^{-qΔm}`` when the max moves) and dual focal's running ``max{z_k < z_y}`` with its tie count are all
  accumulators of the same pass; ``z_y`` is loaded first.
* All arithmetic in fp32 whatever the logits' dtype; offsets in int64; the row stride is an argument (sliced logits
  need no copy); the target entry of the gradient, ``-c (1 - p_y) + …``, is formed in fp32 before the single cast.
* Single-read path when the row fits one block (``C ≤ MAX_BLOCK``: read the logits once, write the gradient once, in
  the loss launch) and a two-read path beyond that (statistics pass, then gradient pass, over ``MAX_BLOCK // 2``
  chunks).
* Gradient in the forward: backward only multiplies the saved gradient by ``grad_output`` with
  ``_uncertainty_weighted_ce_scale_grad_kernel``, which reads ``grad_output`` on the device and leaves the buffer
  untouched when it is exactly 1 (so ``loss.backward()`` costs one read and one write of N×C in total). The scaling is
  in place in eager mode; autograd's version counter then makes a second backward through the same graph
  (``retain_graph=True``) raise instead of returning a rescaled gradient. Under tracing (torch.compile, AOTAutograd,
  opcheck) the scaling is out of place.
* Opt-in ``inplace=True``: the gradient overwrites the logits buffer (zero extra N×C memory).
* No host synchronisation on the hot path: the non-ignored count for ``mean`` is computed on the device and read by
  the kernel; reductions are device ops.

Target-check policy: an out-of-range target (not in ``[0, C)`` and not ``ignore_index``) never makes the kernel read
or write out of bounds: the kernel reads class 0 instead, writes NaN to that row's loss and gradient (so a wrong label
can never produce a plausible-looking loss), and raises a device-side error flag. When ``VALIDATE_TARGETS`` is true
(the default; environment variable ``CALIBKERNELS_VALIDATE=0`` turns it off) the flag is read back after the launch
(one host synchronisation per call) and a ``ValueError`` naming the bad value is raised. The read-back is skipped
automatically while a CUDA graph is being captured, and can be turned off for the last microseconds of training
throughput; the NaN rows stay.

Registered as ``torch.ops.calibkernels.uncertainty_weighted_ce_triton`` (+ ``..._inplace_`` and the backward's
``..._scale_grad_``) with ``torch.library.custom_op`` + ``register_fake`` + ``register_autograd``, so
``torch.compile(fullgraph=True)`` keeps the op in the graph and ``torch.library.opcheck`` passes. (``triton_op`` /
``wrap_triton`` would let Inductor look inside, but it cannot trace kernels that run through the Triton interpreter,
which is how this backend is tested on CPU; the opaque custom op behaves the same on both.)

Naming ladder: ``_uncertainty_weighted_ce_fwd_kernel`` / ``_uncertainty_weighted_ce_scale_grad_kernel`` →
``uncertainty_weighted_ce_forward`` / ``scale_grad_`` → the registered ops and autograd → the backend interface
``is_available(name, device)`` / ``run(name, inputs, inplace)`` used by :mod:`calibkernels._backends`.
"""

from __future__ import annotations

import os
from typing import Optional

import torch
import triton
import triton.language as tl

from .. import _validation as V

__all__ = [
    "MAX_BLOCK",
    "VALIDATE_TARGETS",
    "uncertainty_weighted_ce_forward",
    "scale_grad_",
    "is_available",
    "run",
]

# Rows of up to MAX_BLOCK classes take the single-read path (the whole row held in registers as fp32, whatever the
# logits' dtype: 32768 values over 32 warps, for which ptxas (sm_90) reports at most 88 bytes of spill); longer rows
# are streamed in chunks of MAX_BLOCK // 2 classes (16384: no spill), two reads and one write.
MAX_BLOCK = 32768
# Read the device-side target-range flag back and raise (one host sync per call); see the module docstring.
VALIDATE_TARGETS = os.environ.get("CALIBKERNELS_VALIDATE", "1") != "0"
# Whether the kernels below were defined under the Triton interpreter (decided when triton.jit runs, i.e. now).
_INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_SCALE_BLOCK = 4096

WEIGHT_NONE, WEIGHT_FOCAL, WEIGHT_FLSD, WEIGHT_DUAL_FOCAL, WEIGHT_BRIER, WEIGHT_EXTERNAL = (
    V.WEIGHT_CODES[k] for k in ("none", "focal", "flsd", "dual_focal", "brier", "external")
)
MODE_LOSS, MODE_GRAD = V.MODE_CODES["loss"], V.MODE_CODES["grad"]
REDUCTION_NONE, REDUCTION_MEAN, REDUCTION_SUM = V.REDUCTION_CODES["none"], V.REDUCTION_CODES["mean"], V.REDUCTION_CODES["sum"]

# The same codes as Triton compile-time constants, so the kernel's branches read by name.
_NONE, _FOCAL, _FLSD, _DUAL_FOCAL, _BRIER, _EXTERNAL = (tl.constexpr(code) for code in (
    WEIGHT_NONE, WEIGHT_FOCAL, WEIGHT_FLSD, WEIGHT_DUAL_FOCAL, WEIGHT_BRIER, WEIGHT_EXTERNAL))
_LOSS_MODE = tl.constexpr(MODE_LOSS)
_MEAN = tl.constexpr(REDUCTION_MEAN)



# ---------------------------------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------------------------------
@triton.jit
def _pow(base, exponent):
    """``base ** exponent`` for ``base ≥ 0`` via exp2/log2, with ``x ** 0 = 1`` (also ``0 ** 0``)."""
    return tl.where(exponent == 0.0, 1.0, tl.exp2(exponent * tl.log2(base)))


@triton.jit
def _uncertainty_weighted_ce_fwd_kernel(
    logits_ptr, logits_row_stride,
    target_ptr, sample_weight_ptr, gamma_ptr,
    row_loss_ptr, grad_ptr, grad_row_stride,
    valid_count_ptr, error_ptr,
    num_classes, gamma, norm, ignore_index,
    WEIGHT: tl.constexpr, MODE: tl.constexpr, REDUCTION: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr, PER_SAMPLE_GAMMA: tl.constexpr, CHECK_TARGETS: tl.constexpr,
    BLOCK: tl.constexpr, SINGLE_READ: tl.constexpr,
):
    """Row loss ``u_i CE_i`` (fp32) and, if COMPUTE_GRAD, the row's gradient of the reduced loss; one program per row."""
    NEG_INF: tl.constexpr = float("-inf")
    LOG2E: tl.constexpr = 1.4426950408889634
    LN2: tl.constexpr = 0.6931471805599453
    FLSD_LOW_THRESHOLD: tl.constexpr = 0.2  # FLSD-53 (Mukhoti et al.), as in csrc/uncertainty_weighted_ce.h
    FLSD_LOW_GAMMA: tl.constexpr = 5.0
    FLSD_MID_THRESHOLD: tl.constexpr = 0.5
    FLSD_MID_GAMMA: tl.constexpr = 3.0

    row = tl.program_id(0).to(tl.int64)
    logits_row = logits_ptr + row * logits_row_stride
    target = tl.load(target_ptr + row).to(tl.int64)
    is_valid = target != ignore_index
    in_range = (target >= 0) & (target < num_classes)
    is_bad = is_valid & (target < 0) | is_valid & (target >= num_classes)
    # out-of-range targets read class 0 (never out of bounds); their row is poisoned with NaN below
    safe_target = tl.where(in_range, target, 0)
    if CHECK_TARGETS:
        # every writer stores the same 1 (benign race); the value slot keeps one of the bad targets
        tl.store(error_ptr, 1, mask=is_bad)
        tl.store(error_ptr + 1, target, mask=is_bad)
    z_target = tl.load(logits_row + safe_target).to(tl.float32)
    cols = tl.arange(0, BLOCK)

    # ---- statistics: running max m, d = Σ e^{z-m}, d_¬y, gBS Σ_{k≠y} e^{q(z-m)}, dual focal's max{z < z_y} -------
    if SINGLE_READ:
        col_mask = cols < num_classes
        z = tl.load(logits_row + cols, mask=col_mask, other=NEG_INF).to(tl.float32)
        m = tl.max(z, 0)
        m_safe = tl.where(m == NEG_INF, 0.0, m)  # an all -inf row must not produce inf - inf
        e = tl.exp2((z - m_safe) * LOG2E)
        is_target_col = cols == safe_target
        d = tl.sum(e, 0)
        d_others = tl.sum(tl.where(is_target_col, 0.0, e), 0)
        if WEIGHT == _BRIER:
            sum_q_others = tl.sum(tl.where(is_target_col, 0.0, tl.exp2((z - m_safe) * (norm * LOG2E))), 0)
        if WEIGHT == _DUAL_FOCAL:
            below = z < z_target
            z_below_max = tl.max(tl.where(below, z, NEG_INF), 0)
            n_ties = tl.sum(tl.where(below & (z == z_below_max), 1.0, 0.0), 0)
    else:
        m_safe = tl.full((), 0.0, tl.float32)
        m = tl.full((), NEG_INF, tl.float32)
        d = tl.full((), 0.0, tl.float32)
        d_others = tl.full((), 0.0, tl.float32)
        sum_q_others = tl.full((), 0.0, tl.float32)
        z_below_max = tl.full((), NEG_INF, tl.float32)
        n_ties = tl.full((), 0.0, tl.float32)
        for start in range(0, num_classes, BLOCK):
            offs = start + cols
            col_mask = offs < num_classes
            z = tl.load(logits_row + offs, mask=col_mask, other=NEG_INF).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, 0))
            m_new_safe = tl.where(m_new == NEG_INF, 0.0, m_new)
            rescale = tl.exp2((m - m_new_safe) * LOG2E)
            e = tl.exp2((z - m_new_safe) * LOG2E)
            is_target_col = offs == safe_target
            d = d * rescale + tl.sum(e, 0)
            d_others = d_others * rescale + tl.sum(tl.where(is_target_col, 0.0, e), 0)
            if WEIGHT == _BRIER:
                sum_q_others = sum_q_others * tl.exp2((m - m_new_safe) * (norm * LOG2E)) + tl.sum(
                    tl.where(is_target_col, 0.0, tl.exp2((z - m_new_safe) * (norm * LOG2E))), 0)
            if WEIGHT == _DUAL_FOCAL:
                below = z < z_target
                chunk_max = tl.max(tl.where(below, z, NEG_INF), 0)
                chunk_ties = tl.sum(tl.where(below & (z == chunk_max), 1.0, 0.0), 0)
                n_ties = tl.where(chunk_max > z_below_max, chunk_ties,
                                  tl.where(chunk_max == z_below_max, n_ties + chunk_ties, n_ties))
                z_below_max = tl.maximum(z_below_max, chunk_max)
            m = m_new
            m_safe = m_new_safe

    # ---- per-row scalars -------------------------------------------------------------------------------------------
    lse = m_safe + tl.log2(d) * LN2
    p_target = tl.exp2((z_target - lse) * LOG2E)
    # Confident rows: CE = -log p_y = log1p(d_¬y / e^{z_y - m}); log(d) with d ≈ 1 would keep only the rounding of d.
    # log1p by Kahan's trick (exact log of the rounded 1 + x, rescaled).
    odds_against = d_others / tl.exp2((z_target - m_safe) * LOG2E)
    one_plus = 1.0 + odds_against
    log1p_odds = tl.where(one_plus == 1.0, odds_against, tl.log(one_plus) * odds_against / (one_plus - 1.0))
    cross_entropy = tl.where(p_target > 0.5, log1p_odds, lse - z_target)
    one_minus_p = d_others / d  # = -expm1(z_y - lse) without cancellation
    # gradient: grad_k = coef_p p_k + coef_tie τ_k + coef_h (p_k^q - p_k H) for k ≠ y;  grad_y = -coef_p (1-p_y) + extra_y
    coef_p = 1.0
    extra_y = 0.0
    if WEIGHT == _NONE:
        u = 1.0
    elif WEIGHT == _EXTERNAL:
        u = tl.load(sample_weight_ptr + row).to(tl.float32)
        coef_p = u
    elif WEIGHT == _FOCAL or WEIGHT == _FLSD:
        if WEIGHT == _FLSD:
            g = tl.where(p_target < FLSD_LOW_THRESHOLD, FLSD_LOW_GAMMA,
                         tl.where(p_target < FLSD_MID_THRESHOLD, FLSD_MID_GAMMA, gamma))
        elif PER_SAMPLE_GAMMA:
            g = tl.load(gamma_ptr + row).to(tl.float32)
        else:
            g = gamma
        u = _pow(one_minus_p, g)
        coef_p = u
        if MODE == _LOSS_MODE:
            du = tl.where(g == 0.0, 0.0, -g * _pow(one_minus_p, g - 1.0) * p_target)
            coef_p = u - cross_entropy * du
    elif WEIGHT == _DUAL_FOCAL:
        p_j = tl.exp2((z_below_max - lse) * LOG2E)  # 0 when nothing is below z_y
        base = one_minus_p + p_j
        u = _pow(base, gamma)
        coef_p = u
        if MODE == _LOSS_MODE:
            du = tl.where(gamma == 0.0, 0.0, gamma * _pow(base, gamma - 1.0))
            coef_p = u + cross_entropy * du * (p_target - p_j)
            extra_y = -cross_entropy * du * p_j
            coef_tie = cross_entropy * du * p_j / tl.maximum(n_ties, 1.0)
    else:  # WEIGHT == _BRIER, generalised Brier score
        # Σ_{k≠y} p_k^q = Σ_{k≠y} e^{q(z-m)} / d^q, in log space so d^q cannot overflow
        p_q_others = tl.exp2(tl.log2(sum_q_others) + (m_safe - lse) * (norm * LOG2E))
        brier_q = p_q_others + _pow(one_minus_p, norm)
        u = _pow(brier_q, gamma / norm)
        coef_p = u
        if MODE == _LOSS_MODE:
            du = tl.where(gamma == 0.0, 0.0, gamma * _pow(brier_q, gamma / norm - 1.0))
            # du/dz_k = γ S^{γ/q-1} (p_k^q - p_k H) is formed before the CE factor (which can be huge) multiplies
            # it: for a dominant non-target class the bracket cancels to ~0 and must stay ~0.
            h_sum = p_q_others - p_target * _pow(one_minus_p, norm - 1.0)
            coef_h = cross_entropy * du
            extra_y = -coef_h * p_target * brier_q  # du/dz_y = -γ S^{γ/q-1} p_y S, cancellation-free

    row_loss = tl.where(is_valid, u * cross_entropy, 0.0)
    row_loss = tl.where(is_bad, float("nan"), row_loss)
    tl.store(row_loss_ptr + row, row_loss)

    # ---- gradient of the reduced loss for grad_output = 1 ----------------------------------------------------------
    if COMPUTE_GRAD:
        if REDUCTION == _MEAN:
            scale = 1.0 / tl.maximum(tl.load(valid_count_ptr).to(tl.float32), 1.0)
        else:
            scale = 1.0
        grad_target = (-coef_p * one_minus_p + extra_y) * scale
        grad_row = grad_ptr + row * grad_row_stride
        inv_d = 1.0 / d
        if SINGLE_READ:
            p = e * inv_d
            grad = coef_p * p
            if WEIGHT == _DUAL_FOCAL and MODE == _LOSS_MODE:
                grad += tl.where(below & (z == z_below_max), coef_tie, 0.0)
            if WEIGHT == _BRIER and MODE == _LOSS_MODE:
                grad += coef_h * (tl.exp2((z - lse) * (norm * LOG2E)) - p * h_sum)
            grad = tl.where(is_target_col, grad_target, grad * scale)
            grad = tl.where(is_valid, grad, 0.0)
            grad = tl.where(is_bad, float("nan"), grad)
            tl.store(grad_row + cols, grad.to(grad_ptr.dtype.element_ty), mask=col_mask)
        else:
            for start in range(0, num_classes, BLOCK):
                offs = start + cols
                col_mask = offs < num_classes
                z = tl.load(logits_row + offs, mask=col_mask, other=NEG_INF).to(tl.float32)
                p = tl.exp2((z - lse) * LOG2E)
                grad = coef_p * p
                if WEIGHT == _DUAL_FOCAL and MODE == _LOSS_MODE:
                    grad += tl.where((z < z_target) & (z == z_below_max), coef_tie, 0.0)
                if WEIGHT == _BRIER and MODE == _LOSS_MODE:
                    grad += coef_h * (tl.exp2((z - lse) * (norm * LOG2E)) - p * h_sum)
                grad = tl.where(offs == safe_target, grad_target, grad * scale)
                grad = tl.where(is_valid, grad, 0.0)
                grad = tl.where(is_bad, float("nan"), grad)
                tl.store(grad_row + offs, grad.to(grad_ptr.dtype.element_ty), mask=col_mask)


@triton.jit
def _uncertainty_weighted_ce_scale_grad_kernel(
    grad_ptr, grad_row_stride, grad_output_ptr, grad_output_stride, num_classes, BLOCK: tl.constexpr,
):
    """``grad[i, :] *= grad_output[i]`` (stride 0 for a scalar grad_output), skipped when the factor is exactly 1."""
    row = tl.program_id(0).to(tl.int64)
    factor = tl.load(grad_output_ptr + row * grad_output_stride).to(tl.float32)
    if factor != 1.0:
        offs = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < num_classes
        ptrs = grad_ptr + row * grad_row_stride + offs
        values = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        tl.store(ptrs, (values * factor).to(grad_ptr.dtype.element_ty), mask=mask)


# ---------------------------------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------------------------------
def _num_warps(block: int) -> int:
    # about 32 fp32 values per thread for big rows, at least one warp group for small ones
    return max(4, min(32, block // 1024))


def _capturing_cuda_graph(device: torch.device) -> bool:
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


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
    check_targets: bool,
    *,
    grad_out: Optional[torch.Tensor] = None,
    max_block: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel; return ``(loss fp32, grad)`` as in ``csrc/uncertainty_weighted_ce.h``.

    ``logits (N, C)`` with unit column stride and any row stride; ``target (N,)`` int64. ``loss`` is 0-dim for
    mean/sum, ``(N,)`` for none. ``grad`` is ``(N, C)`` in the logits' dtype (written into ``grad_out`` when given,
    e.g. the logits themselves for inplace), or shape ``(0,)`` when ``compute_grad`` is false. ``max_block`` overrides
    ``MAX_BLOCK`` (tests force the chunked two-read path with a small one).
    """
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend supports float32/float16/bfloat16 logits, got {logits.dtype} "
                        "(use backend='reference' for float64)")
    if logits.dim() != 2 or logits.stride(1) != 1:
        raise ValueError(f"expected (N, C) logits with unit column stride, got shape {tuple(logits.shape)} "
                         f"stride {logits.stride()}")
    num_rows, num_classes = logits.shape
    device = logits.device
    block_cap = triton.next_power_of_2(MAX_BLOCK if max_block is None else int(max_block))
    single_read = num_classes <= block_cap
    block = triton.next_power_of_2(num_classes) if single_read else max(1, block_cap // 2)

    row_loss = torch.empty(num_rows, dtype=torch.float32, device=device)
    if compute_grad:
        grad = torch.empty((num_rows, num_classes), dtype=logits.dtype, device=device) if grad_out is None else grad_out
    else:
        grad = torch.empty((0,), dtype=logits.dtype, device=device)
    valid_count = (target != ignore_index).sum()  # on the device: no sync
    error = torch.zeros(2, dtype=torch.int64, device=device)
    per_sample_gamma = gamma_per_sample is not None
    _uncertainty_weighted_ce_fwd_kernel[(num_rows,)](
        logits, logits.stride(0),
        target,
        sample_weight if sample_weight is not None else row_loss,  # placeholders are never read
        gamma_per_sample if per_sample_gamma else row_loss,
        row_loss, grad if compute_grad else logits, grad.stride(0) if compute_grad else 0,
        valid_count, error,
        num_classes, float(gamma), float(norm), int(ignore_index),
        WEIGHT=int(weight), MODE=int(mode), REDUCTION=int(reduction),
        COMPUTE_GRAD=bool(compute_grad), PER_SAMPLE_GAMMA=per_sample_gamma, CHECK_TARGETS=True,
        BLOCK=block, SINGLE_READ=single_read,
        num_warps=_num_warps(block),
    )
    if check_targets and not _capturing_cuda_graph(device):
        has_bad, bad_value = error.tolist()  # the one host synchronisation of the validate policy
        if has_bad:
            raise ValueError(f"target value {bad_value} is out of range for {num_classes} classes "
                             f"(valid: 0..{num_classes - 1}, or ignore_index={ignore_index})")
    if reduction == REDUCTION_NONE:
        loss = row_loss
    elif reduction == REDUCTION_SUM:
        loss = row_loss.sum()
    else:
        loss = row_loss.sum() / valid_count.clamp_min(1)
    return loss, grad


def scale_grad_(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """In place ``grad *= grad_output`` (0-dim, or ``(N,)`` per row) without reading ``grad_output`` on the host."""
    num_rows, num_classes = grad.shape
    grad_output_stride = grad_output.stride(0) if grad_output.dim() == 1 else 0
    block = min(triton.next_power_of_2(num_classes), _SCALE_BLOCK)
    _uncertainty_weighted_ce_scale_grad_kernel[(num_rows, triton.cdiv(num_classes, block))](
        grad, grad.stride(0), grad_output, grad_output_stride, num_classes, BLOCK=block,
        num_warps=_num_warps(block),
    )


# ---------------------------------------------------------------------------------------------------------------------
# Registered ops, fake kernels, autograd
# ---------------------------------------------------------------------------------------------------------------------
@torch.library.custom_op("calibkernels::uncertainty_weighted_ce_triton", mutates_args=())
def uncertainty_weighted_ce_triton(
    logits: torch.Tensor, target: torch.Tensor, sample_weight: Optional[torch.Tensor],
    gamma_per_sample: Optional[torch.Tensor], weight: int, loss_mode: int, gamma: float, norm: float, ignore_index: int,
    reduction: int, compute_grad: bool, check_targets: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(loss, grad)`` of the fused loss (see :func:`uncertainty_weighted_ce_forward`)."""
    return uncertainty_weighted_ce_forward(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma,
                                           norm, ignore_index, reduction, compute_grad, check_targets)


@uncertainty_weighted_ce_triton.register_fake
def _(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma, norm, ignore_index, reduction,
      compute_grad, check_targets):
    loss = logits.new_empty((logits.shape[0],) if reduction == REDUCTION_NONE else (), dtype=torch.float32)
    grad = logits.new_empty(logits.shape if compute_grad else (0,))
    return loss, grad


@torch.library.custom_op("calibkernels::uncertainty_weighted_ce_triton_inplace_", mutates_args=("logits",))
def uncertainty_weighted_ce_triton_inplace_(
    logits: torch.Tensor, target: torch.Tensor, sample_weight: Optional[torch.Tensor],
    gamma_per_sample: Optional[torch.Tensor], weight: int, loss_mode: int, gamma: float, norm: float, ignore_index: int,
    reduction: int, check_targets: bool,
) -> torch.Tensor:
    """The loss; the gradient (for grad_output = 1) overwrites ``logits``."""
    loss, _ = uncertainty_weighted_ce_forward(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma,
                                              norm, ignore_index, reduction, True, check_targets, grad_out=logits)
    return loss


@uncertainty_weighted_ce_triton_inplace_.register_fake
def _(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma, norm, ignore_index, reduction,
      check_targets):
    return logits.new_empty((logits.shape[0],) if reduction == REDUCTION_NONE else (), dtype=torch.float32)


@torch.library.custom_op("calibkernels::uncertainty_weighted_ce_triton_scale_grad_", mutates_args=("grad",))
def _scale_grad_op(grad: torch.Tensor, grad_output: torch.Tensor) -> None:
    """``grad *= grad_output`` in place (the backward of the fused loss)."""
    scale_grad_(grad, grad_output)


@_scale_grad_op.register_fake
def _(grad, grad_output):
    return None


def _is_traced(tensor: torch.Tensor) -> bool:
    # FakeTensor / FunctionalTensor (AOTAutograd, opcheck, make_fx) or Dynamo: mutate nothing, stay functional
    return torch.compiler.is_compiling() or type(tensor) is not torch.Tensor


def _scaled_saved_grad(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """The saved gradient times ``grad_output``: in place in eager mode, out of place when traced."""
    if grad.numel() == 0:
        raise RuntimeError("calibkernels: the fused loss was computed without a gradient (grad mode was off or the "
                           "logits did not require grad), so it cannot be differentiated")
    if grad_output is None:  # the loss was not used (set_materialize_grads(False) passes None)
        return None
    # Traced, or retain_graph=True (gradcheck, several backwards through one graph; the saved buffer must survive):
    # out of place.
    if _is_traced(grad) or _is_traced(grad_output) or torch._C._autograd._get_current_graph_task_keep_graph():
        factor = grad_output.to(torch.float32)
        if factor.dim() == 1:
            factor = factor[:, None]
        return (grad.to(torch.float32) * factor).to(grad.dtype)
    _scale_grad_op(grad, grad_output)
    return grad


def _setup_context(ctx, inputs, output):
    _, grad = output
    ctx.mark_non_differentiable(grad)
    # The gradient output is never differentiated; without this autograd would materialise an N×C zero tensor as
    # its incoming gradient on every backward (a full extra write of the logits' size).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad)


def _backward(ctx, grad_loss, _grad_of_grad):
    (grad,) = ctx.saved_tensors
    return (_scaled_saved_grad(grad, grad_loss),) + (None,) * 11


uncertainty_weighted_ce_triton.register_autograd(_backward, setup_context=_setup_context)


class _InplaceUncertaintyWeightedCE(torch.autograd.Function):
    """Autograd around the inplace op: the logits buffer becomes the saved gradient (no N×C allocation)."""

    @staticmethod
    def forward(ctx, logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, ignore_index,
                reduction, check_targets):
        loss = uncertainty_weighted_ce_triton_inplace_(logits, target, sample_weight, gamma_per_sample, weight,
                                                       mode, gamma, norm, ignore_index, reduction, check_targets)
        # saved after the overwrite, so the version counter guards against any later change
        ctx.save_for_backward(logits)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return (_scaled_saved_grad(grad, grad_loss),) + (None,) * 10


# ---------------------------------------------------------------------------------------------------------------------
# Backend interface (calibkernels._backends)
# ---------------------------------------------------------------------------------------------------------------------
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


def run(name: str, inputs: V.LossInputs, inplace: bool) -> torch.Tensor:
    """The fused loss for validated inputs, in the logits' dtype (``inputs.batch_shape``-shaped for "none")."""
    logits = inputs.logits
    if logits.dtype not in _SUPPORTED_DTYPES:
        raise TypeError(f"the triton backend supports float32/float16/bfloat16 logits, got {logits.dtype} "
                        "(use backend='reference' for float64)")
    sample_weight = inputs.sample_weight
    if sample_weight is not None:
        sample_weight = sample_weight.detach().contiguous()
    gamma_per_sample = None
    gamma = inputs.gamma
    if isinstance(gamma, torch.Tensor):
        gamma_per_sample, gamma = gamma.detach().contiguous(), 0.0
    target = inputs.target.contiguous()
    args = (target, sample_weight, gamma_per_sample, V.WEIGHT_CODES[inputs.weight], V.MODE_CODES[inputs.mode],
            float(gamma), float(inputs.norm), int(inputs.ignore_index), V.REDUCTION_CODES[inputs.reduction])
    compute_grad = torch.is_grad_enabled() and logits.requires_grad
    # The range check is a host read-back: off while tracing (the compiled op still NaN-poisons bad rows).
    check_targets = VALIDATE_TARGETS and not torch.compiler.is_compiling()
    if logits.stride(-1) != 1:
        logits = logits.contiguous()  # the kernels take any row stride but need unit column stride
        inplace = False  # the copy is ours: overwriting it saves no memory
    if inplace and compute_grad and not torch.compiler.is_compiling():
        loss = _InplaceUncertaintyWeightedCE.apply(logits, *args, check_targets)
    else:
        loss, _ = uncertainty_weighted_ce_triton(logits, *args, compute_grad, check_targets)
    loss = loss.to(inputs.logits.dtype)
    if inputs.reduction == "none":
        loss = loss.reshape(inputs.batch_shape)
    return loss
