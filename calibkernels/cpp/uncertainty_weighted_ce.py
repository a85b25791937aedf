"""Python side of the compiled ``calibkernels::uncertainty_weighted_ce`` ops (C++ CPU kernel, CUDA kernel).

The schema lives in ``csrc/calibkernels.cpp`` and the semantics in ``csrc/uncertainty_weighted_ce.h``: one fused
forward computes ``L_i = u_i · CE_i`` (SPEC §2) *and* the gradient of the reduced loss for ``grad_output = 1``
("gradient in forward"), so the backward is a single scaling by ``grad_output`` (a scalar, or ``(N,)`` for
``reduction="none"``).

Layers, in the naming of Liger-Kernel:

* :func:`uncertainty_weighted_ce_forward` — typed wrapper around ``torch.ops.calibkernels.uncertainty_weighted_ce``;
* ``torch.library.register_fake`` (shapes for torch.compile / meta tensors) and ``torch.library.register_autograd``
  (the backward) on the functional op;
* :class:`UncertaintyWeightedCEFunction` — eager autograd (less host time than the registered one), and the opt-in
  ``inplace=True`` path, whose op mutates the logits;
* :func:`is_available` / :func:`run` — the backend interface of :mod:`calibkernels._backends` (``"cpu"``, ``"cuda"``).

Importing this module raises ``ImportError`` if the extension ``calibkernels._C`` was not built; ``_backends``
turns that into "backend unavailable" (and ``backend="auto"`` into a one-time warning and the reference).
"""

from __future__ import annotations

import contextlib
import functools
import os

import torch

from .. import _target_checks
from .. import _validation as V

try:
    from .. import _C  # noqa: F401  (loading the library runs the TORCH_LIBRARY registrations)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "calibkernels' compiled extension (calibkernels._C) is not built: reinstall with "
        "`pip install --no-build-isolation -e .` (needs a C++ compiler), or use backend='reference'. "
        f"Original error: {exc}"
    ) from exc

__all__ = ["uncertainty_weighted_ce_forward", "UncertaintyWeightedCEFunction", "is_available", "run"]

_OP = torch.ops.calibkernels.uncertainty_weighted_ce
_INPLACE_OP = torch.ops.calibkernels.uncertainty_weighted_ce_inplace_
_SCALE_OP = torch.ops.calibkernels.uncertainty_weighted_ce_scale_grad_
_QUALNAME = "calibkernels::uncertainty_weighted_ce"
_INPLACE_QUALNAME = "calibkernels::uncertainty_weighted_ce_inplace_"


def _loss_dtype(logits: torch.Tensor) -> torch.dtype:
    # fp32 accumulation for fp32/fp16/bf16; float64 stays float64 (gradcheck)
    return torch.float64 if logits.dtype == torch.float64 else torch.float32


def _fake_loss(logits, reduction):
    shape = (logits.shape[0],) if reduction == V.REDUCTION_CODES["none"] else ()
    return logits.new_empty(shape, dtype=_loss_dtype(logits))


# ----------------------------------------------------------------------------------------------------------------
# Fake (meta) kernels: output shapes and dtypes without running anything, for torch.compile and FakeTensor.
# ----------------------------------------------------------------------------------------------------------------
@torch.library.register_fake(_QUALNAME)
def _uncertainty_weighted_ce_fake(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma, norm,
                                  ignore_index, reduction, compute_grad):
    torch._check(logits.dim() == 2, lambda: "logits must be 2-D (N, C)")
    grad_shape = tuple(logits.shape) if compute_grad else (0,)
    grad = logits.new_empty(grad_shape)  # contiguous, logits' dtype
    return _fake_loss(logits, reduction), grad


@torch.library.register_fake(_INPLACE_QUALNAME)
def _uncertainty_weighted_ce_inplace_fake(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma,
                                          norm, ignore_index, reduction):
    torch._check(logits.dim() == 2, lambda: "logits must be 2-D (N, C)")
    return _fake_loss(logits, reduction)


@torch.library.register_fake("calibkernels::uncertainty_weighted_ce_scale_grad_")
def _uncertainty_weighted_ce_scale_grad_fake(grad, grad_output):
    return None


# ----------------------------------------------------------------------------------------------------------------
# Autograd of the functional op.
#
# register_autograd (rather than an autograd.Function around the op) is what lets torch.compile / AOTAutograd
# trace the op as one node in both the forward and the backward graph without a graph break, and it is what
# torch.library.opcheck verifies. The forward already produced the gradient, so the backward is a scaling.
# ----------------------------------------------------------------------------------------------------------------
def _setup_context(ctx, inputs, output):
    _, grad = output
    ctx.mark_non_differentiable(grad)
    # The second output (the gradient) is never differentiated; without this autograd would materialise an N×C
    # zero tensor as its incoming gradient on every backward (a full extra write of the logits' size).
    ctx.set_materialize_grads(False)
    ctx.save_for_backward(grad)


def _is_plain_eager(*tensors: torch.Tensor) -> bool:
    """True when running outside any tracer (Dynamo, make_fx/AOTAutograd, FakeTensor mode) and every tensor given is
    a plain ``torch.Tensor`` (no subclass)."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and all(type(t) is torch.Tensor for t in tensors))


def _scale_saved_gradient(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """``grad · grad_output`` (scalar, or ``(N,)`` per row), reusing the saved buffer when that is safe.

    Eager: the buffer is scaled in place (no second ``N×C`` allocation) and returned; the multiply is skipped when
    ``grad_output`` is the scalar 1 on the CPU (reading it is free there; on CUDA it would be a sync, so we just
    multiply). When the backward runs with ``retain_graph=True`` (gradcheck, several backwards through one graph)
    the multiply is out of place, so the saved buffer stays valid for the next backward.
    Traced (torch.compile, opcheck): an out-of-place multiply, which the compiler fuses and plans memory for.
    """
    if grad_output is None:  # the loss was not used (set_materialize_grads(False) passes None)
        return None
    per_row = grad_output[:, None] if grad_output.dim() == 1 else grad_output
    if not _is_plain_eager(grad, grad_output):
        return (grad * per_row).to(grad.dtype)
    if grad_output.numel() == 1 and grad_output.device.type == "cpu" and grad_output.item() == 1.0:
        return grad
    if torch._C._autograd._get_current_graph_task_keep_graph():
        # retain_graph=True (gradcheck, several backwards through one graph): the saved buffer must survive
        return (grad * per_row).to(grad.dtype)
    if grad.device.type == "cuda" and grad.dtype != torch.float64:
        # reads grad_output on the device and skips the N×C pass when it is 1 (a plain mul_ would always make it)
        _SCALE_OP(grad, grad_output)
        return grad
    return grad.mul_(per_row)


def _backward(ctx, grad_loss, _grad_of_grad_output):
    (grad,) = ctx.saved_tensors
    return _scale_saved_gradient(grad, grad_loss), None, None, None, None, None, None, None, None, None, None


torch.library.register_autograd(_QUALNAME, _backward, setup_context=_setup_context)


# ----------------------------------------------------------------------------------------------------------------
# Typed wrapper
# ----------------------------------------------------------------------------------------------------------------
def uncertainty_weighted_ce_forward(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    weight: str,
    mode: str,
    gamma: float | torch.Tensor,
    norm: float,
    sample_weight: torch.Tensor | None,
    reduction: str,
    ignore_index: int,
    compute_grad: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the fused op on validated ``(N, C)`` logits. Returns ``(loss, grad)``.

    ``loss`` is float32 (float64 for float64 logits): 0-dim for mean/sum, ``(N,)`` for none. ``grad`` is
    ``d loss / d logits`` for ``grad_output = 1`` in the logits' dtype (``(0,)`` when ``compute_grad`` is false).
    Differentiable w.r.t. ``logits`` through ``register_autograd``.
    """
    gamma_per_sample = gamma if isinstance(gamma, torch.Tensor) else None
    gamma_value = 0.0 if gamma_per_sample is not None else float(gamma)
    return _OP(
        logits, target, sample_weight, gamma_per_sample, V.WEIGHT_CODES[weight], V.MODE_CODES[mode], gamma_value,
        float(norm), int(ignore_index), V.REDUCTION_CODES[reduction], bool(compute_grad),
    )


def _below_autograd(logits: torch.Tensor):
    """Dispatch below the Autograd key in plain eager mode (see UncertaintyWeightedCEFunction.forward); a no-op
    while traced (Dynamo cannot trace the guard, and the traced op needs its registered autograd)."""
    if _is_plain_eager(logits):
        return torch._C._AutoDispatchBelowAutograd()
    return contextlib.nullcontext()


class UncertaintyWeightedCEFunction(torch.autograd.Function):
    """Eager-mode autograd around the compiled ops, for plain tensors outside ``torch.compile``.

    ``inplace=False``: the functional op. Why not its ``register_autograd`` here too: that Python glue (argument
    normalisation and a generated Function per call) costs about as much host time as this whole Function and is paid
    on every eager call; inside ``Function.forward`` grad mode is off, so the op's autograd kernel goes straight to the
    device kernel. Traced code (torch.compile, opcheck, FakeTensor, make_fx) still sees the registered op and its
    registered autograd.

    ``inplace=True``: the op overwrites ``logits`` with the gradient (zero extra ``N×C`` memory). That op is declared
    mutating (``Tensor(a!) logits``), so it has no ``register_autograd``, and this Function is its autograd in every
    mode. Any other autograd node that saved the logits sees their version change and raises at backward instead of
    using garbage.

    Either way the backward scales the saved gradient by ``grad_output`` (:func:`_scale_saved_gradient`).
    """

    @staticmethod
    def forward(ctx, logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma, norm, ignore_index,
                reduction, inplace):
        # Below the Autograd key: straight to the device kernel, not through register_autograd's Python glue (which
        # this Function replaces in eager mode and which re-enters the dispatcher from Python, ~25 µs per call).
        with _below_autograd(logits):
            if inplace:
                loss = _INPLACE_OP(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma, norm,
                                   ignore_index, reduction)
            else:
                loss, grad = _OP(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma, norm,
                                 ignore_index, reduction, True)
        if inplace:
            # The dispatcher does not bump the version of a custom op's mutated argument here (autograd is off inside
            # Function.forward), so do it: any other node that saved the logits then raises at backward.
            torch.autograd.graph.increment_version(logits)
            # A new alias (own TensorImpl) of the overwritten logits: AccumulateGrad adopts a gradient as .grad only
            # when nothing else references its TensorImpl, and the caller still holds the logits themselves; handing
            # those back made it copy the whole N×C gradient on every step.
            grad = logits.detach()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad)
        return loss

    @staticmethod
    def backward(ctx, grad_loss):
        (grad,) = ctx.saved_tensors
        return (_scale_saved_gradient(grad, grad_loss),) + (None,) * 10


def _is_leaf_or_view_of_leaf(tensor: torch.Tensor) -> bool:
    if tensor.is_leaf:
        return True
    base = tensor._base
    return base is not None and base.is_leaf and base.requires_grad


# ----------------------------------------------------------------------------------------------------------------
# Backend interface (calibkernels._backends)
# ----------------------------------------------------------------------------------------------------------------
@functools.lru_cache(maxsize=None)
def _has_kernel(dispatch_key: str) -> bool:
    # fixed once the extension is loaded; cached because backend selection runs on every call (~10 µs otherwise)
    return torch._C._dispatch_has_kernel_for_dispatch_key(_QUALNAME, dispatch_key)


def is_available(name: str, device: torch.device) -> str | None:
    """``None`` if backend ``name`` ("cpu" or "cuda") can run on ``device``, else why not."""
    if name == "cpu":
        if device.type != "cpu":
            return f"the 'cpu' backend runs CPU tensors, not {device.type}"
        if not _has_kernel("CPU"):
            return "calibkernels._C was built without the CPU kernel"
        return None
    if name == "cuda":
        if device.type != "cuda":
            return f"the 'cuda' backend runs CUDA tensors, not {device.type}"
        if not torch.cuda.is_available():
            return "torch.cuda.is_available() is False"
        if not _has_kernel("CUDA"):
            return "calibkernels._C was built without the CUDA kernel (no CUDA toolkit at build time?)"
        return None
    return f"{name!r} is not a compiled backend"


# CUDA kernel's target policy (the Triton backend's): an out-of-range target is never used as an index; that row's loss
# and gradient are NaN. The wrapper computes the (any bad, a bad value) flag on the device and hands it to
# calibkernels._target_checks, which raises the other backends' ValueError without stalling the host (async, the
# default), at once (CALIBKERNELS_VALIDATE=sync) or never (0); nothing is queued under torch.compile or while a
# CUDA graph is being captured.
def _submit_cuda_target_check(inputs: V.LossInputs) -> None:
    if _target_checks.POLICY == "off" or torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return
    target, num_classes = inputs.target, inputs.logits.shape[-1]
    bad = V.out_of_range_targets(target, num_classes, inputs.ignore_index)
    flag = torch.stack((bad.any().to(torch.int64), torch.where(bad, target, torch.iinfo(torch.int64).min).max()))
    _target_checks.submit(flag, num_classes, inputs.ignore_index)


def run(name: str, inputs: V.LossInputs, inplace: bool) -> torch.Tensor:
    """The loss of validated ``inputs`` through the compiled op, in the logits' dtype and batch shape."""
    logits = inputs.logits
    if logits.device.type == "cuda" and not torch.compiler.is_compiling():
        _target_checks.poll()  # raise for a bad target that an earlier call flagged
    compute_grad = logits.requires_grad and torch.is_grad_enabled()
    gamma_per_sample = inputs.gamma if isinstance(inputs.gamma, torch.Tensor) else None
    gamma_value = 0.0 if gamma_per_sample is not None else float(inputs.gamma)
    eager = _is_plain_eager(logits)
    if inplace and compute_grad and _is_leaf_or_view_of_leaf(logits):
        raise ValueError(
            "inplace=True overwrites the logits with their gradient, so the logits must be an intermediate "
            "result (e.g. a layer's output), not a leaf tensor that requires grad; use inplace=False"
        )
    if compute_grad and (inplace or eager):
        loss = UncertaintyWeightedCEFunction.apply(
            logits, inputs.target, inputs.sample_weight, gamma_per_sample, V.WEIGHT_CODES[inputs.weight],
            V.MODE_CODES[inputs.mode], gamma_value, inputs.norm, inputs.ignore_index,
            V.REDUCTION_CODES[inputs.reduction], bool(inplace),
        )
    else:
        # Traced code, and no autograd (then there is nothing to overwrite: the op skips the gradient entirely).
        # Eager calls go below the Autograd key, as in UncertaintyWeightedCEFunction.forward (and for the same reasons).
        with _below_autograd(logits):
            loss, _ = uncertainty_weighted_ce_forward(
                logits, inputs.target, weight=inputs.weight, mode=inputs.mode, gamma=inputs.gamma, norm=inputs.norm,
                sample_weight=inputs.sample_weight, reduction=inputs.reduction, ignore_index=inputs.ignore_index,
                compute_grad=compute_grad,
            )
    if logits.device.type == "cuda":
        _submit_cuda_target_check(inputs)
    if inputs.reduction == "none" and loss.shape != inputs.batch_shape:
        loss = loss.reshape(inputs.batch_shape)
    return loss if loss.dtype == logits.dtype else loss.to(logits.dtype)
