"""Fused linear layer + uncertainty-weighted cross-entropy for large vocabularies (docs/large_vocabularies.md).

The loss of ``logits = hidden @ linear_weight.T + linear_bias`` without ever holding all ``N × C`` logits: the rows
are processed in chunks of ``R`` rows, and each chunk's logits ``Z_c = H_c Wᵀ + b`` (``R × C``) are turned into their
gradient **in place** by the fused op, then folded into the three parameter gradients before the next chunk reuses the
same buffer (the scheme of Liger-Kernel's fused linear cross-entropy)::

    G_c = ∂(Σ_{i∈c} L_i)/∂Z_c          (the fused kernel, reduction "none", written over Z_c; ignored rows are 0)
    ∂H_c  = G_c W                        (R × H, written into its rows of grad_hidden)
    ∂W   += G_cᵀ H_c                     (C × H, accumulated in float32 for half-precision inputs)
    ∂b   += Σ_rows G_c                   (C, float32 accumulator for half precision)

``L_i = u_i · CE_i`` is the family of :func:`calibkernels.uncertainty_weighted_ce` (weights, modes and formulas:
docs/losses.md). The kernels run every chunk with reduction ``"none"``, whose gradient is that of the sum of the
chunk's rows; the reduction of the whole batch is applied afterwards, once: for ``"mean"`` the loss and the three
gradients are multiplied by ``1 / n_valid`` with ``n_valid`` the number of non-ignored rows of the **whole** batch
(``max(n_valid, 1)``: all rows ignored gives loss 0 and zero gradients). That scale is a device tensor, so no host
synchronisation is needed, and it touches ``N × H + C × H + C`` numbers instead of ``N × C``.

``return_stats=True``: each chunk's top-label statistics (:func:`calibkernels.loss_stats.top_label_stats`) go into
``(N,)`` buffers in the forward's pass over the chunks, written by the compiled kernels in their loss pass over
``Z_c`` (the reference's chunks read them from ``Z_c`` before ``G_c`` overwrites it); the backward of
``reduction="none"`` recomputes the logits without them.

Autograd (``reduction="mean"``/``"sum"``): all gradients are computed in the forward for ``grad_output = 1`` and the
backward only scales them by the scalar ``grad_output``, in place where that is safe (as the fused op does).
``reduction="none"``: ``grad_output`` is one factor per row, which must scale ``G_c`` before the matmuls, so the
forward computes only the per-row losses and the backward **recomputes** each chunk's logits (a second pass: one more
``R × C × H`` matmul per chunk), scales ``G_c``'s rows by ``grad_output`` and accumulates as above.

Memory: besides the inputs and the three gradients, one ``R × C`` logits buffer in the input dtype (plus, for
half-precision inputs on the CPU, a bounded ``R × C``-sized temporary for the float32 weight-gradient accumulation; the
reference backend's own temporaries, a few ``R × C``, when ``backend="reference"``). The default ``R``:
:func:`default_chunk_size`.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from . import _autograd, _backends, _target_checks
from ._kernel_codes import MODE_CODES, REDUCTION_CODES, WEIGHT_CODES
from ._row_math import gamma_gradient_factor, reduce_rows, soft_capped
from ._drop_in_module import DropInOptions
from ._validation.fused_linear import (backend_for_call, check_accum_dtype, check_chunk_size, check_linear_inputs,
                                  check_row_tensors, check_settings, one_hot_forms, submit_device_target_check)
from ._validation import (LossInputs, check_backend, check_class_weight_tensor,
                          check_drop_in_options, check_ignore_index, check_label_smoothing, check_mode, check_norm,
                          check_reduction, check_scalar_gamma, check_uncertainty, lambda_tensor, soft_target_request)
from .loss_stats import LossStats, check_return_stats, empty_loss_stats, top_label_stats
from .more_losses import common_repr
from .reference import uncertainty_weighted_ce_from_inputs

__all__ = ["fused_linear_uncertainty_weighted_ce", "FusedLinearUncertaintyWeightedCE", "default_chunk_size"]

# The default chunk's logits buffer holds at least MIN and at most MAX bytes (see default_chunk_size).
MIN_CHUNK_BYTES = 16 << 20
MAX_CHUNK_BYTES = 256 << 20
# ... and on a GPU at least this many rows, within those bounds (default_chunk_size: the weight-gradient accumulator)
GPU_MIN_CHUNK_ROWS = 1024

_HALF = (torch.float16, torch.bfloat16)


def _next_power_of_two(x: int) -> int:
    return 1 << max(0, (int(x) - 1).bit_length())


def default_chunk_size(num_rows: int, num_classes: int, hidden_size: int, element_size: int,
                       device_type: str = "cpu") -> int:
    """Rows per chunk when ``chunk_size=None``.

    Liger-Kernel's heuristic, ``next_pow2(ceil(N / ceil(C / H)))``, makes the chunk's logits ``R × C`` about as large
    as ``hidden`` (``N × H``), so the extra memory scales like the activations already held. It is then bounded so
    that the chunk's logits buffer holds at least ``MIN_CHUNK_BYTES`` (16 MiB, rounded up to a power of two of rows:
    smaller matmuls waste time, and small batches then run in one chunk) and at most ``MAX_CHUNK_BYTES`` (256 MiB),
    and never more than ``N`` rows. On a GPU (``device_type="cuda"``) the chunk also takes at least
    ``GPU_MIN_CHUNK_ROWS`` (1024) rows within those bounds: every chunk reads and writes the whole ``C × H`` float32
    weight-gradient accumulator (``8·C·H`` bytes) for ``6·R·C·H`` flops of matmuls, so at a GPU's ratio of matmul
    rate to bandwidth (about 200 flop per byte) 256 rows spend more time on the accumulator than on the matmuls.

    E.g. ``N = 8192, H = 4096, C = 128256`` bf16: 256 rows on the CPU (64 MiB of logits), 1024 on a GPU (251 MiB);
    ``N = 8192, H = 256, C = 32000`` fp32: 256 rows on the CPU (32 MiB, against 1 GiB for all logits).
    """
    row_bytes = num_classes * element_size
    liger = _next_power_of_two(math.ceil(num_rows / math.ceil(num_classes / hidden_size)))
    floor_rows = _next_power_of_two(math.ceil(MIN_CHUNK_BYTES / row_bytes))
    if device_type == "cuda":
        floor_rows = max(floor_rows, GPU_MIN_CHUNK_ROWS)
    cap_rows = max(1, MAX_CHUNK_BYTES // row_bytes)
    return max(1, min(num_rows, cap_rows, max(liger, floor_rows)))


class _Spec(NamedTuple):
    """The loss of one call, as every chunk runs it."""

    backend: str
    uncertainty: str
    mode: str
    gamma: float  # 0.0 when a per-sample gamma tensor is given
    norm: float
    ignore_index: int
    label_smoothing: float = 0.0  # soft targets (docs/losses.md, "Soft targets")
    dense: bool = False           # the target is (N, C) probabilities
    accum_dtype: torch.dtype | None = None  # the weight and bias gradients' accumulator; None: float32 for 16-bit
    # the drop-in options (docs/losses.md, "Coming from F.cross_entropy / Liger-Kernel"); lse_square_scale is the
    # scale the chunks run with (_z_loss_scale_for_mean), mean_divisor the "mean"'s divisor (None: the valid rows)
    class_weight: torch.Tensor | None = None
    lse_square_scale: float = 0.0
    softcap: float | None = None
    mean_divisor: torch.Tensor | None = None

    @property
    def soft_arguments(self) -> tuple:
        return () if self.label_smoothing == 0.0 else (None, None, self.label_smoothing)

    @property
    def has_options(self) -> bool:
        return self.class_weight is not None or self.lse_square_scale != 0.0 or self.softcap is not None


# ------------------------------------------------------------------------------------------------------ one chunk
def _chunk_kernel(z, target, sample_weight, gamma, spec: _Spec, compute_grad: bool, gamma_grad: bool, mix_target=None,
                  mix_lambda=None, z_rows=None, stats_out=None):
    """Run the loss on one chunk's logits ``z (R, C)``; return ``(row_loss (R,), G, dL/dγ (R,) or None)``.

    ``G``, the gradient of the chunk's summed loss, is written over ``z`` by the compiled backends (``z`` is returned);
    the reference computes it with ``autograd.grad`` in the compute dtype (float32 for half-precision inputs).
    ``z_rows``: an ``(R,)`` buffer that receives the rows' z-loss (the call returns it), or ``None``.
    ``stats_out``: ``(confidence, prediction)`` ``(R,)`` buffers the kernel writes in its loss pass (a compiled
    backend with ``STATS_IN_KERNEL``), or ``None``.
    """
    if spec.backend == "reference":
        compute_dtype = torch.float64 if z.dtype == torch.float64 else torch.float32
        zc = z.detach().to(compute_dtype)
        g = None if gamma is None else gamma.detach()

        def rows(zc, g):
            inputs = LossInputs(logits=zc, target=target, uncertainty=spec.uncertainty, mode=spec.mode,
                                gamma=spec.gamma if g is None else g, norm=spec.norm, sample_weight=sample_weight,
                                reduction="none", ignore_index=spec.ignore_index, batch_shape=(zc.shape[0],),
                                label_smoothing=spec.label_smoothing, mix_target=mix_target, mix_lambda=mix_lambda,
                                dense=spec.dense, class_weight=spec.class_weight,
                                lse_square_scale=spec.lse_square_scale, return_z_loss=z_rows is not None,
                                softcap=spec.softcap)
            if z_rows is None:
                return uncertainty_weighted_ce_from_inputs(inputs)
            row_loss, z_loss = uncertainty_weighted_ce_from_inputs(inputs)
            z_values.append(z_loss)  # kept out of the transform below (vjp refuses a write to a captured tensor)
            return row_loss

        z_values = []

        if not (compute_grad or gamma_grad):
            row_loss = rows(zc, g)
            if z_rows is not None:
                z_rows.copy_(z_values[-1])
            return row_loss, None, None
        # torch.func.vjp rather than autograd.grad: it also runs where autograd is off (this autograd.Function's
        # forward), and torch.compile traces it
        if gamma_grad:
            row_loss, vjp = torch.func.vjp(rows, zc, g)
            grad, gamma_factor = vjp(torch.ones_like(row_loss))
        else:
            row_loss, vjp = torch.func.vjp(lambda zc: rows(zc, g), zc)
            (grad,), gamma_factor = vjp(torch.ones_like(row_loss)), None
        if z_rows is not None:
            z_rows.copy_(z_values[-1])
        return row_loss, (grad if compute_grad else None), gamma_factor
    module = _backends.module(spec.backend)
    gamma_factor = None
    if gamma_grad:  # read the logits before the kernel overwrites them
        gamma_factor = gamma_gradient_factor(z, target, gamma, spec.ignore_index, REDUCTION_CODES["sum"])
    soft = (mix_target, mix_lambda, spec.label_smoothing) if mix_target is not None else spec.soft_arguments
    options = {} if stats_out is None else {"stats_out": stats_out}
    if spec.has_options:  # keywords only where given: a backend's defaults otherwise
        options.update(class_weight=spec.class_weight, lse_square_scale=spec.lse_square_scale,
                       softcap=0.0 if spec.softcap is None else spec.softcap, z_loss_out=z_rows)
    row_loss, _, _ = module.forward(
        z, target, sample_weight, gamma, WEIGHT_CODES[spec.uncertainty], MODE_CODES[spec.mode], spec.gamma,
        spec.norm, spec.ignore_index, REDUCTION_CODES["none"], compute_grad, z if compute_grad else None, *soft,
        **options)
    return row_loss, (z if compute_grad else None), gamma_factor


# Whether torch.addmm(..., out_dtype=torch.float32) accumulates half-precision products into a float32 tensor in
# place on this device type (CUDA); probed once, eagerly, by _probe_out_dtype_addmm.
_OUT_DTYPE_ADDMM: dict = {}


def _probe_out_dtype_addmm(device: torch.device, dtype: torch.dtype) -> bool:
    key = (device.type, dtype)
    if key not in _OUT_DTYPE_ADDMM:
        ok = False
        if device.type == "cuda":
            try:
                acc = torch.ones(2, 2, device=device)
                a = torch.tensor([[1.0, 2.0], [3.0, 4.0]], device=device, dtype=dtype)
                torch.addmm(acc, a, a, out_dtype=torch.float32, out=acc)
                ok = torch.equal(acc.cpu(), torch.tensor([[8.0, 11.0], [16.0, 23.0]]))
            except (RuntimeError, TypeError):
                ok = False
        _OUT_DTYPE_ADDMM[key] = ok
    return _OUT_DTYPE_ADDMM[key]


def _accumulate_weight_grad(acc: torch.Tensor, grad: torch.Tensor, hidden: torch.Tensor) -> None:
    """``acc += gradᵀ hidden`` (``acc (C, H)``, ``grad (R, C)``, ``hidden (R, H)``), with a float32 ``acc`` for
    half-precision inputs: on CUDA one ``addmm`` with ``out_dtype=float32`` into ``acc``; elsewhere the product is
    taken in blocks of classes whose half-precision temporary is at most ``R × C`` elements."""
    if acc.dtype == grad.dtype:
        acc.addmm_(grad.t(), hidden)
        return
    if (acc.dtype == torch.float32 and not torch.compiler.is_compiling()
            and _OUT_DTYPE_ADDMM.get((grad.device.type, grad.dtype), False)):
        torch.addmm(acc, grad.t(), hidden, out_dtype=torch.float32, out=acc)
        return
    num_classes, hidden_size = acc.shape
    block = max(1, min(num_classes, grad.numel() // hidden_size))
    for start in range(0, num_classes, block):
        stop = min(start + block, num_classes)
        acc[start:stop].add_(torch.mm(grad[:, start:stop].t(), hidden))


def _chunked_pass(hidden, linear_weight, linear_bias, target, sample_weight, gamma, spec: _Spec, chunk: int,
                  need_hidden: bool, need_weight: bool, need_bias: bool, need_gamma: bool, row_scale=None,
                  mix_target=None, mix_lambda=None, stats: LossStats | None = None, z_rows=None):
    """One pass over the chunks: ``(row_loss (N,), d hidden, d weight, d bias, d gamma)`` of ``Σ_i s_i L_i``, with
    ``s_i = row_scale[i]`` (1 when ``None``); a gradient not asked for is ``None``. The weight and bias gradients are
    float32 for half-precision inputs (the accumulators); the caller casts them. ``stats``: ``(N,)`` buffers that
    receive each chunk's :func:`calibkernels.loss_stats.top_label_stats` (ignored rows: those whose class-index
    target is ``ignore_index``), of the soft-capped logits where the call caps them: written by the kernel in its
    loss pass where the backend's module has ``STATS_IN_KERNEL``, else taken from the chunk's logits before the
    kernel writes its gradient over them. ``z_rows``: an ``(N,)`` buffer for the rows' z-loss, or ``None``."""
    num_rows, hidden_size = hidden.shape
    num_classes = linear_weight.shape[0]
    dtype, device = hidden.dtype, hidden.device
    compute_grad = need_hidden or need_weight or need_bias
    acc_dtype = spec.accum_dtype or (torch.float32 if dtype in _HALF else dtype)
    loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    row_loss = torch.empty(num_rows, dtype=loss_dtype, device=device)
    d_hidden = torch.empty((num_rows, hidden_size), dtype=dtype, device=device) if need_hidden else None
    d_weight = torch.zeros((num_classes, hidden_size), dtype=acc_dtype, device=device) if need_weight else None
    d_bias = torch.zeros(num_classes, dtype=acc_dtype, device=device) if need_bias else None
    d_gamma = torch.empty(num_rows, dtype=loss_dtype, device=device) if need_gamma else None
    buffer = torch.empty((min(chunk, num_rows), num_classes), dtype=dtype, device=device)
    weight_t = linear_weight.t()
    stats_in_kernel = stats is not None and spec.backend != "reference" and getattr(
        _backends.module(spec.backend), "STATS_IN_KERNEL", False)
    for start in range(0, num_rows, chunk):
        stop = min(start + chunk, num_rows)
        h = hidden[start:stop]
        z = buffer[: stop - start]
        if linear_bias is None:
            torch.mm(h, weight_t, out=z)
        else:
            torch.addmm(linear_bias, h, weight_t, out=z)
        if stats is not None and not stats_in_kernel:
            chunk_target = target[start:stop]
            ignored = None if spec.dense else chunk_target == spec.ignore_index
            chunk_stats = top_label_stats(soft_capped(z, spec.softcap), ignored, (stop - start,))
            stats.confidence[start:stop] = chunk_stats.confidence
            stats.prediction[start:stop] = chunk_stats.prediction
        loss, grad, gamma_factor = _chunk_kernel(
            z, target[start:stop], None if sample_weight is None else sample_weight[start:stop],
            None if gamma is None else gamma[start:stop], spec, compute_grad, need_gamma,
            None if mix_target is None else mix_target[start:stop],
            None if mix_lambda is None else mix_lambda[start:stop], None if z_rows is None else z_rows[start:stop],
            (stats.confidence[start:stop], stats.prediction[start:stop]) if stats_in_kernel else None)
        row_loss[start:stop] = loss
        if need_gamma:
            d_gamma[start:stop] = gamma_factor if row_scale is None else gamma_factor * row_scale[start:stop]
        if not compute_grad:
            continue
        if row_scale is not None:
            grad = grad.mul_(row_scale[start:stop, None].to(grad.dtype))
        if grad.dtype != dtype:
            grad = grad.to(dtype)
        if need_hidden:
            torch.mm(grad, linear_weight, out=d_hidden[start:stop])
        if need_weight:
            _accumulate_weight_grad(d_weight, grad, h)
        if need_bias:
            d_bias += grad.sum(0, dtype=acc_dtype)
    return row_loss, d_hidden, d_weight, d_bias, d_gamma


def _valid_rows(target, ignore_index):
    """The non-ignored rows of the whole batch (every row of a dense target), at least 1."""
    if target.is_floating_point():
        return torch.tensor(max(target.shape[0], 1), device=target.device)
    return (target != ignore_index).sum().clamp(min=1)


def _mean_scale(target, spec: _Spec, dtype: torch.dtype) -> torch.Tensor:
    """``1 / divisor`` of the "mean" in ``dtype``: the valid rows, or ``spec.mean_divisor`` (class weights; 0 when
    that is 0)."""
    if spec.mean_divisor is None:
        return 1.0 / _valid_rows(target, spec.ignore_index).to(dtype)
    divisor = spec.mean_divisor.to(dtype)
    positive = divisor > 0
    return torch.where(positive, 1.0 / torch.where(positive, divisor, torch.ones_like(divisor)),
                       torch.zeros_like(divisor))


def _z_rows_buffer(hidden):
    """An ``(N,)`` buffer for the rows' z-loss, in the loss's compute dtype."""
    return hidden.new_empty((hidden.shape[0],), dtype=torch.float64 if hidden.dtype == torch.float64
                            else torch.float32)


def _to(tensor, dtype):
    return tensor if tensor is None or tensor.dtype == dtype else tensor.to(dtype)


_DOUBLE_BACKWARD_MESSAGE = (
    "calibkernels: fused_linear_uncertainty_weighted_ce does not support double backward (create_graph=True; its "
    "gradients are computed chunk by chunk without a graph); materialise the logits (hidden @ W.T + b) and use "
    "ck.uncertainty_weighted_ce(..., backend='reference') for that loss"
)


class FusedLinearUWCE(torch.autograd.Function):
    """Autograd of :func:`fused_linear_uncertainty_weighted_ce` on validated 2-D inputs (module docstring).

    With ``return_stats`` the forward returns ``(loss, confidence (N,), prediction (N,))``, the last two not
    differentiable (:func:`_chunked_pass`'s ``stats``, taken in the forward's pass over the chunks); with
    ``return_z_loss`` also the rows' z-loss ``(N,)`` last, not differentiable either."""

    @staticmethod
    def forward(ctx, hidden, linear_weight, linear_bias, target, sample_weight, gamma, backend, uncertainty, mode,
                gamma_value, norm, reduction, ignore_index, chunk, mix_target=None, mix_lambda=None,
                label_smoothing=0.0, return_stats=False, accum_dtype=None, class_weight=None, lse_square_scale=0.0,
                softcap=None, mean_divisor=None, return_z_loss=False):
        spec = _Spec(backend, uncertainty, mode, gamma_value, norm, ignore_index, label_smoothing,
                     target.is_floating_point(), accum_dtype, class_weight, lse_square_scale, softcap, mean_divisor)
        need_gamma = gamma is not None and ctx.needs_input_grad[5] and mode == "loss"
        ctx.set_materialize_grads(False)
        ctx.spec, ctx.chunk, ctx.reduction = spec, chunk, reduction
        ctx.weight_dtype = linear_weight.dtype
        stats = empty_loss_stats(hidden.shape[0], hidden.device) if return_stats else None
        z_rows = _z_rows_buffer(hidden) if return_z_loss else None
        extra = (*(stats or ()), *(() if z_rows is None else (z_rows,)))
        if extra:
            ctx.mark_non_differentiable(*extra)
        if reduction == "none":
            # grad_output is per row: the backward recomputes the chunks (module docstring)
            row_loss, *_ = _chunked_pass(hidden, linear_weight, linear_bias, target, sample_weight, gamma, spec,
                                         chunk, False, False, False, False, None, mix_target, mix_lambda, stats,
                                         z_rows)
            ctx.save_for_backward(hidden, linear_weight, linear_bias, target, sample_weight, gamma, mix_target,
                                  mix_lambda)
            return (row_loss, *extra) if extra else row_loss
        need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
        row_loss, d_hidden, d_weight, d_bias, d_gamma = _chunked_pass(
            hidden, linear_weight, linear_bias, target, sample_weight, gamma, spec, chunk, need_hidden, need_weight,
            need_bias, need_gamma, None, mix_target, mix_lambda, stats, z_rows)
        loss = row_loss.sum()
        if reduction == "mean":
            scale = _mean_scale(target, spec, loss.dtype)
            loss = loss * scale
            for grad in (d_hidden, d_weight, d_bias, d_gamma):
                if grad is not None:
                    grad.mul_(scale.to(grad.dtype))
        ctx.save_for_backward(d_hidden, _to(d_weight, linear_weight.dtype),
                              None if d_bias is None else _to(d_bias, linear_bias.dtype),
                              None if d_gamma is None else _to(d_gamma, gamma.dtype))
        return (loss, *extra) if extra else loss

    @staticmethod
    def backward(ctx, grad_loss, *_stats_grads):
        if grad_loss is None:  # the loss was not used
            return (None,) * 24
        _autograd.raise_if_create_graph(grad_loss, _DOUBLE_BACKWARD_MESSAGE)
        if ctx.reduction == "none":
            (hidden, linear_weight, linear_bias, target, sample_weight, gamma, mix_target,
             mix_lambda) = ctx.saved_tensors
            need_hidden, need_weight, need_bias = ctx.needs_input_grad[:3]
            need_gamma = gamma is not None and ctx.needs_input_grad[5] and ctx.spec.mode == "loss"
            _, d_hidden, d_weight, d_bias, d_gamma = _chunked_pass(
                hidden, linear_weight, linear_bias, target, sample_weight, gamma, ctx.spec, ctx.chunk, need_hidden,
                need_weight, need_bias, need_gamma, row_scale=grad_loss.detach(), mix_target=mix_target,
                mix_lambda=mix_lambda)
            d_weight = _to(d_weight, linear_weight.dtype)
            d_bias = None if d_bias is None else _to(d_bias, linear_bias.dtype)
            d_gamma = None if d_gamma is None else _to(d_gamma, gamma.dtype)
        else:
            d_hidden, d_weight, d_bias, d_gamma = (
                None if t is None else _autograd.scale_saved_gradient(t, grad_loss) for t in ctx.saved_tensors)
        return (d_hidden, d_weight, d_bias, None, None, d_gamma) + (None,) * 18


# ------------------------------------------------------------------------------------------------------ public API
def fused_linear_uncertainty_weighted_ce(
    hidden: torch.Tensor,
    linear_weight: torch.Tensor,
    target: torch.Tensor,
    linear_bias: torch.Tensor | None = None,
    *,
    uncertainty: str = "brier",
    mode: str = "grad",
    gamma: float | torch.Tensor = 4.0,
    norm: float = 2.0,
    sample_weight: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    backend: str = "auto",
    chunk_size: int | None = None,
    label_smoothing: float = 0.0,
    mix_target: torch.Tensor | None = None,
    mix_lambda: float | torch.Tensor | None = None,
    return_stats: bool = False,
    accum_dtype: torch.dtype | None = None,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    softcap: float | None = None,
):
    """``uncertainty_weighted_ce(hidden @ linear_weight.T + linear_bias, target, ...)`` without materialising the
    ``N × C`` logits (the output layer of a language model: ``C`` = vocabulary size).

    ``L_i = u_i · CE_i`` on the logits ``z_i = W h_i + b``; the gradients are ``∂h_i = W^T g_i``, ``∂W = Σ_i g_i
    h_iᵀ``, ``∂b = Σ_i g_i`` with ``g_i = ∂L/∂z_i`` (docs/losses.md; algorithm, memory and autograd:
    docs/large_vocabularies.md and this module's docstring). Rows are processed ``chunk_size`` at a time: peak extra
    memory ``O(chunk_size × C)``.

    Args:
        hidden: ``(..., H)`` float32/float16/bfloat16 (float64 on the reference and CPU backends).
        linear_weight: ``(C, H)``, same dtype and device as ``hidden`` (an ``nn.Linear(H, C).weight``).
        target: ``(...)`` (``hidden``'s leading shape) int64 class indices in ``[0, C)`` or ``ignore_index``; or
            dense probabilities ``(..., C)`` (soft targets: every row counts, no ``ignore_index``).
        linear_bias: optional ``(C,)``, same dtype and device.
        uncertainty, mode, gamma, norm, sample_weight, weight, reduction, ignore_index, backend, lse_square_scale,
            return_z_loss, softcap: as in :func:`calibkernels.uncertainty_weighted_ce` (``weight``: per-class
            weights; the z-loss and soft-capping of Liger-Kernel's fused linear loss). ``"mean"`` divides by the
            non-ignored rows of the whole batch (0 if there are none; with class weights by their sum over the
            targets, as ``F.cross_entropy`` does). ``sample_weight`` is used detached. A per-sample ``gamma`` tensor
            (focal) that requires grad gets ``∂L/∂γ_i = L_i log(1 - p_{i,y})`` (times the reduction's scale) in
            ``mode="loss"``, none in ``mode="grad"``.
        chunk_size: rows per chunk, ``>= 1``; ``None`` picks :func:`default_chunk_size`.
        accum_dtype: the dtype the weight and bias gradients are accumulated in over the chunks (Liger-Kernel's
            name); ``None`` (default): float32 for 16-bit inputs, the inputs' dtype otherwise. ``torch.bfloat16``
            for bfloat16 inputs halves the accumulator (``C × H``: 2.1 GB in float32 at 128256 × 4096) at the cost of
            rounding each chunk's sum to bfloat16.
        label_smoothing, mix_target, mix_lambda: soft targets, as in :func:`calibkernels.uncertainty_weighted_ce`
            (O(N) target data per chunk for the compact forms).
        return_stats: also return a :class:`calibkernels.LossStats` of the logits ``hidden @ linear_weight.T +
            linear_bias``: ``(loss, stats)``. The compiled kernels write each chunk's statistics in their loss pass
            over it (the reference takes them from the chunk before the gradient overwrites it); no ``N × C``
            tensor, and equal to :func:`calibkernels.loss_stats.top_label_stats` of the full logits
            (docs/metrics.md, "Monitor calibration while training").

    Returns:
        the loss in ``hidden``'s dtype: a scalar, or ``target``-shaped for ``reduction="none"``; with
        ``return_z_loss`` and/or ``return_stats``, ``(loss, [z_loss,] [stats])`` (``stats`` shaped like ``target``'s
        batch shape ``(...)``; ``z_loss`` reduced as the loss, detached).

    The matmuls run in the input dtype (half-precision inputs accumulate in float32 inside the matmul, as PyTorch's
    do); the kernels compute softmax and weight in float32; the weight and bias gradients are accumulated over the
    chunks in ``accum_dtype`` (float32 by default) and returned in the parameters' dtype. Double backward is not
    supported (differentiating a gradient raises ``RuntimeError``). With ``backend="reference"`` each chunk runs the
    pure-PyTorch reference and ``torch.autograd.grad``.
    """
    chunk_size, smoothing = check_settings(weight, uncertainty, mode, reduction, gamma, norm, backend, chunk_size,
                                            ignore_index, label_smoothing)
    check_return_stats(return_stats)
    drop_in = check_drop_in_options(lse_square_scale=lse_square_scale, return_z_loss=return_z_loss, softcap=softcap)
    soft = soft_target_request(target, smoothing, mix_target, mix_lambda)
    hidden2d, target1d, batch_shape = check_linear_inputs(hidden, linear_weight, target, linear_bias)
    num_rows, hidden_size = hidden2d.shape
    num_classes = linear_weight.shape[0]
    device = hidden.device
    name = backend_for_call(backend, device, soft, uncertainty, mode, gamma, smoothing, drop_in, weight)
    host_check = name == "reference" or device.type == "cpu"
    class_weight = check_class_weight_tensor(weight, hidden2d.new_empty((1, 1)).expand(num_rows, num_classes),
                                             check_values=host_check or not _autograd.is_plain_eager(hidden2d))
    if not host_check and _autograd.is_plain_eager(hidden2d):
        # before this call queues flags of its own: what poll raises belongs to an earlier call
        _target_checks.poll()
    mix1d, lam, sample_weight, gamma = check_row_tensors(hidden2d, num_classes, target1d, batch_shape, mix_target,
                                                         mix_lambda, sample_weight, gamma, uncertainty, ignore_index,
                                                         host_check)
    gamma_tensor = gamma if isinstance(gamma, torch.Tensor) else None
    gamma_value = 0.0 if gamma_tensor is not None else float(gamma)
    if gamma_tensor is not None and gamma_tensor.dtype != (torch.float64 if hidden.dtype == torch.float64
                                                           else torch.float32):
        gamma_tensor = gamma_tensor.to(torch.float64 if hidden.dtype == torch.float64 else torch.float32)
    if name != "reference" and device.type == "cuda" and _autograd.is_plain_eager(hidden2d):
        submit_device_target_check(target1d, num_classes, ignore_index)  # the targets as given, before any mix
    target1d, mix1d, lam = one_hot_forms(target1d, mix1d, lam, uncertainty, ignore_index)
    dense = target1d.is_floating_point()
    if mix1d is not None:
        lam = lambda_tensor(lam, hidden.dtype, device, (num_rows,))  # per row: the chunks slice it
    if hidden.dtype in _HALF and not torch.compiler.is_compiling():
        _probe_out_dtype_addmm(device, hidden.dtype)
    chunk = chunk_size if chunk_size is not None else default_chunk_size(
        num_rows, num_classes, hidden_size, hidden.element_size(), device.type)
    chunk = min(chunk, num_rows)
    spec = _Spec(name, uncertainty, mode, gamma_value, float(norm), ignore_index, smoothing, dense,
                 check_accum_dtype(accum_dtype), class_weight, drop_in["lse_square_scale"], drop_in["softcap"])
    spec, z_factor = _with_mean_divisor(spec, reduction, target1d, mix1d, lam)
    loss, stats, z_rows = _reduced_loss(hidden2d, linear_weight, linear_bias, target1d, sample_weight, gamma_tensor,
                                        spec, reduction, chunk, mix1d, lam, return_stats, return_z_loss)
    if reduction == "none":
        loss = loss.reshape(batch_shape)
    loss = loss if loss.dtype == hidden.dtype else loss.to(hidden.dtype)
    extra = ()
    if return_z_loss:
        extra += (_reduced_z_loss(z_rows, z_factor, target1d, spec, reduction, batch_shape, hidden.dtype),)
    if return_stats:
        extra += (LossStats(stats.confidence.reshape(batch_shape), stats.prediction.reshape(batch_shape)),)
    return (loss, *extra) if extra else loss


def _with_mean_divisor(spec: _Spec, reduction: str, target1d, mix1d, lam) -> tuple:
    """``(spec, z_factor)``: ``spec`` with the "mean"'s divisor of class-weighted class-index targets, ``D = Σ_i <w,
    t̄_i>`` over the non-ignored rows (``t̄`` the target before smoothing: ``Σ w_y``, or ``Σ (λ w_y + (1 - λ)
    w_mix)``), as ``F.cross_entropy`` divides. The z-loss divides by the non-ignored rows instead, so where both are
    asked for, the chunks run the z-loss scale ``s · D / rows`` (its gradient shares the chunk's buffer with the
    rest, all divided by ``D``) and ``z_factor = rows / D`` takes the reported z-loss back to ``s``; this reads ``D``
    on the host, a GPU's one synchronisation. A zero ``D`` (every target class weighted 0) makes the class-weighted
    part 0, as in the reference."""
    if spec.class_weight is None or spec.dense or reduction != "mean":
        return spec, 1.0
    weight = spec.class_weight.to(torch.float64 if spec.class_weight.dtype == torch.float64 else torch.float32)
    valid = target1d != spec.ignore_index
    per_row = weight[torch.where(valid, target1d, 0)]
    if mix1d is not None:
        lam = lam.to(weight.dtype)
        per_row = lam * per_row + (1 - lam) * weight[torch.where(valid, mix1d, 0)]
    divisor = torch.where(valid, per_row, torch.zeros_like(per_row)).sum()
    if spec.lse_square_scale == 0.0:
        return spec._replace(mean_divisor=divisor), 1.0
    rows = max(int(valid.sum()), 1)
    total = float(divisor)
    if total <= 0.0:  # the weighted part is 0: weights of 0 make it so, and the mean divides by the rows
        return spec._replace(class_weight=torch.zeros_like(spec.class_weight),
                             mean_divisor=divisor.new_tensor(float(rows))), 1.0
    return spec._replace(mean_divisor=divisor, lse_square_scale=spec.lse_square_scale * total / rows), rows / total


def _reduced_z_loss(z_rows, z_factor, target1d, spec: _Spec, reduction, batch_shape, dtype):
    """The z-loss reduced as the loss is (the mean over the non-ignored rows), detached, from the rows' values at the
    chunks' scale (``z_factor`` takes them back to the call's; ``None``: a zero z-loss scale)."""
    if z_rows is None:
        z_rows = torch.zeros(target1d.shape[0], device=target1d.device)
    z_rows = z_rows * z_factor if z_factor != 1.0 else z_rows
    valid = (torch.ones_like(z_rows, dtype=torch.bool) if target1d.is_floating_point()
             else target1d != spec.ignore_index)
    return reduce_rows(z_rows, valid, reduction, batch_shape, dtype)


def _reduced_loss(hidden2d, linear_weight, linear_bias, target1d, sample_weight, gamma_tensor, spec: _Spec,
                  reduction: str, chunk: int, mix1d, lam, return_stats: bool = False, return_z_loss: bool = False):
    """``(loss, stats, z_rows)`` of checked 2-D inputs, through :class:`FusedLinearUWCE` where a gradient is needed,
    else one pass of the chunks without autograd; the loss in the compute dtype, ``(N,)`` for ``reduction="none"``;
    ``stats`` a ``(N,)`` :class:`LossStats` with ``return_stats``, else ``None``; ``z_rows`` the rows' z-loss at the
    chunks' scale with ``return_z_loss`` where the scale is not 0, else ``None``."""
    want_z_rows = return_z_loss and spec.lse_square_scale != 0.0
    needs_grad = torch.is_grad_enabled() and (
        hidden2d.requires_grad or linear_weight.requires_grad
        or (linear_bias is not None and linear_bias.requires_grad)
        or (gamma_tensor is not None and gamma_tensor.requires_grad and spec.mode == "loss"))
    if needs_grad:
        out = FusedLinearUWCE.apply(hidden2d, linear_weight, linear_bias, target1d, sample_weight, gamma_tensor,
                                    spec.backend, spec.uncertainty, spec.mode, spec.gamma, spec.norm, reduction,
                                    spec.ignore_index, chunk, mix1d, lam, spec.label_smoothing, return_stats,
                                    spec.accum_dtype, spec.class_weight, spec.lse_square_scale, spec.softcap,
                                    spec.mean_divisor, want_z_rows)
        if not (return_stats or want_z_rows):
            return out, None, None
        return (out[0], LossStats(out[1], out[2]) if return_stats else None,
                out[-1] if want_z_rows else None)
    stats = empty_loss_stats(hidden2d.shape[0], hidden2d.device) if return_stats else None
    z_rows = _z_rows_buffer(hidden2d) if want_z_rows else None
    with torch.no_grad():
        row_loss, *_ = _chunked_pass(hidden2d, linear_weight, linear_bias, target1d, sample_weight,
                                     None if gamma_tensor is None else gamma_tensor.detach(), spec, chunk,
                                     False, False, False, False, None, mix1d, lam, stats, z_rows)
        loss = row_loss if reduction == "none" else row_loss.sum()
        if reduction == "mean":
            loss = loss * _mean_scale(target1d, spec, loss.dtype)
    return loss, stats, z_rows


class FusedLinearUncertaintyWeightedCE(DropInOptions):
    """Module form of :func:`fused_linear_uncertainty_weighted_ce`: the output layer's weight is passed to
    ``forward(hidden (..., H), linear_weight (C, H), target (...), linear_bias=None, sample_weight=None,
    mix_target=None, mix_lambda=None)``, as with Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss``, so the layer
    keeps owning its parameters. ``weight`` (per-class, a buffer), ``lse_square_scale``, ``softcap`` and
    ``return_z_loss``: as for :class:`calibkernels.losses.UncertaintyWeightedCE`. ``return_stats=True``: ``forward``
    returns ``(loss, stats)``, the logits' top-label statistics as :func:`fused_linear_uncertainty_weighted_ce`
    computes them. ``accum_dtype``: the
    dtype the weight and bias gradients are accumulated in, as there (``None``: float32 for 16-bit inputs)."""

    def __init__(self, uncertainty="brier", mode="grad", gamma=4.0, norm=2.0, reduction="mean", ignore_index=-100,
                 backend="auto", chunk_size=None, label_smoothing=0.0, *, weight=None, return_stats=False,
                 accum_dtype=None, lse_square_scale=0.0, softcap=None, return_z_loss=False):
        super().__init__()
        self.return_stats = check_return_stats(return_stats)
        self.accum_dtype = check_accum_dtype(accum_dtype)
        self._init_drop_in(weight, lse_square_scale, softcap, return_z_loss)
        check_uncertainty(uncertainty)
        check_mode(mode)
        gamma = check_scalar_gamma(
            gamma, "a module's gamma is a number; use the functional form for a per-sample gamma tensor")
        check_norm(norm)
        check_reduction(reduction)
        check_backend(backend)
        check_ignore_index(ignore_index)
        chunk_size = check_chunk_size(chunk_size)
        self.label_smoothing = check_label_smoothing(label_smoothing)
        self.uncertainty, self.mode, self.gamma, self.norm = uncertainty, mode, gamma, float(norm)
        self.reduction, self.ignore_index, self.backend, self.chunk_size = reduction, ignore_index, backend, chunk_size

    def forward(self, hidden, linear_weight, target, linear_bias=None, sample_weight=None, mix_target=None,
                mix_lambda=None):
        return fused_linear_uncertainty_weighted_ce(
            hidden, linear_weight, target, linear_bias, uncertainty=self.uncertainty, mode=self.mode, gamma=self.gamma,
            norm=self.norm, sample_weight=sample_weight, reduction=self.reduction, ignore_index=self.ignore_index,
            backend=self.backend, chunk_size=self.chunk_size, label_smoothing=self.label_smoothing,
            mix_target=mix_target, mix_lambda=mix_lambda, return_stats=self.return_stats, accum_dtype=self.accum_dtype,
            **self._drop_in_options())

    def extra_repr(self):
        parts = [f"uncertainty={self.uncertainty!r}", f"mode={self.mode!r}", f"gamma={self.gamma}", f"norm={self.norm}",
                 common_repr(self.reduction, self.ignore_index, self.backend)]
        if self.chunk_size is not None:
            parts.append(f"chunk_size={self.chunk_size}")
        if self.label_smoothing:
            parts.append(f"label_smoothing={self.label_smoothing}")
        if self.accum_dtype is not None:
            parts.append(f"accum_dtype={self.accum_dtype}")
        parts += self._drop_in_repr()
        if self.return_stats:
            parts.append("return_stats=True")
        return ", ".join(parts)
