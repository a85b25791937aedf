"""Python side of the compiled op ``calibkernels::uncertainty_weighted_ce`` (C++ CPU kernel, CUDA C++ kernel).

The schema is declared once in ``csrc/calibkernels.cpp`` and its contract in ``csrc/uncertainty_weighted_ce.h``: one
forward computes ``L_i = u_i · CE_i`` (docs/losses.md) and the gradient of the reduced loss for ``grad_output = 1``,
returned, or written into ``grad_out`` (the logits themselves for ``inplace=True``), and with ``return_stats`` the
logits' top-label statistics (:func:`calibkernels.loss_stats.top_label_stats`) from the same pass over the rows.

Layers, as in pytorch/extension-cpp and torchvision's ``csrc/ops``:

* the fake (meta) kernel registered here, for torch.compile and FakeTensor;
* :func:`loss_with_autograd`, the op with its autograd kernel (csrc/uncertainty_weighted_ce_autograd.cpp), which
  :mod:`calibkernels._autograd` calls for eager and traced code alike;
* :func:`forward`, the op below the Autograd key (the kernel alone), for callers with an autograd of their own
  (:mod:`calibkernels.fused_linear`);
* the fake kernel of the backward's in-place scaling op on CUDA tensors, which the C++ autograd calls (no host read
  of ``grad_output``);
* :func:`is_available`, the backend interface of :mod:`calibkernels._backends` (``"cpu"``, ``"cuda"``).

Importing this module raises ``ImportError`` if the extension ``calibkernels._C`` was not built; ``_backends``
turns that into "backend unavailable" (and ``backend="auto"`` into a one-time warning and the reference).
"""

from __future__ import annotations

import contextlib
import functools

import torch

from .._target_checks import is_plain_eager
from .._kernel_codes import REDUCTION_CODES
from ..loss_stats import LossStats

try:
    from .. import _C  # noqa: F401  (loading the library runs the TORCH_LIBRARY registrations)
except ImportError as exc:  # pragma: no cover - depends on the install
    raise ImportError(
        "calibkernels' compiled extension (calibkernels._C) is not built: reinstall with "
        "`pip install --no-build-isolation -e .` (needs a C++ compiler), or use backend='reference'. "
        f"Original error: {exc}"
    ) from exc

__all__ = ["loss_with_autograd", "forward", "is_available", "SOFT_TARGETS"]

# The CPU and CUDA kernels take soft targets (label smoothing, a mix, a dense target): calibkernels._backends.
SOFT_TARGETS = True
# The op computes the drop-in options (class weights, z-loss, soft-capping) itself: calibkernels._backends.
OPTIONS_IN_KERNEL = True
# The op writes the rows' top-label statistics in its loss pass (return_stats): calibkernels._autograd.
STATS_IN_KERNEL = True

_OP = torch.ops.calibkernels.uncertainty_weighted_ce.default
_QUALNAME = "calibkernels::uncertainty_weighted_ce"


@torch.library.register_fake(_QUALNAME)
def _uncertainty_weighted_ce_fake(logits, target, sample_weight, gamma_per_sample, weight, loss_mode, gamma, norm,
                                  ignore_index, reduction, compute_grad, grad_out, mix_target=None, mix_lambda=None,
                                  label_smoothing=0.0, loss_in_logits_dtype=False, return_stats=False,
                                  class_weight=None, lse_square_scale=0.0, softcap=0.0):
    torch._check(logits.dim() == 2, lambda: "logits must be 2-D (N, C)")
    if loss_in_logits_dtype:
        loss_dtype = logits.dtype
    else:
        loss_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    loss = logits.new_empty((logits.shape[0],) if reduction == REDUCTION_CODES["none"] else (), dtype=loss_dtype)
    returned = compute_grad and grad_out is None
    # the target flag: two slots on CUDA, none on the CPU (its kernel raises instead)
    flag = logits.new_empty((2,) if logits.device.type == "cuda" else (0,), dtype=torch.int64)
    # the top-label statistics: (N,) each with return_stats, else empty
    stats_rows = logits.shape[0] if return_stats else 0
    confidence = logits.new_empty((stats_rows,), dtype=torch.float32)
    prediction = logits.new_empty((stats_rows,), dtype=torch.int64)
    # the rows' z-loss where the call asks for one
    z_loss = logits.new_empty((logits.shape[0] if lse_square_scale != 0.0 else 0,),
                              dtype=torch.float64 if logits.dtype == torch.float64 else torch.float32)
    return loss, logits.new_empty(tuple(logits.shape) if returned else (0,)), flag, confidence, prediction, z_loss


@torch.library.register_fake("calibkernels::uncertainty_weighted_ce_scale_grad_")
def _uncertainty_weighted_ce_scale_grad_fake(grad, grad_output):
    return None


def _checked_flag(flag: torch.Tensor) -> torch.Tensor | None:
    """The op's target flag for calibkernels._target_checks: the CUDA kernel's (it never indexes with a bad target;
    that row is NaN), ``None`` on the CPU, whose kernel raises instead."""
    return flag if flag.shape[0] else None


def forward(logits, target, sample_weight, gamma_per_sample, uncertainty, mode, gamma, norm, ignore_index, reduction,
            compute_grad, grad_out, mix_target=None, mix_lambda=None, label_smoothing=0.0, *, loss_dtype=None,
            stats_out=None, class_weight=None, lse_square_scale=0.0, softcap=0.0, z_loss_out=None):
    """``(loss, grad, target_flag)`` of the op below its autograd (the backend forward of
    :mod:`calibkernels._autograd`, for callers with an autograd of their own); the loss in the logits' dtype where
    ``loss_dtype`` asks for it (the kernel writes it so: no cast launch), else in the op's float32 (float64).

    ``stats_out``: ``(confidence, prediction)``, ``(N,)`` float32 and int64 buffers that receive the op's top-label
    statistics of the logits' rows (:class:`~calibkernels.loss_stats.LossStats`), computed by the kernel in its loss
    pass (the Triton forward's keyword too).

    ``class_weight``, ``lse_square_scale``, ``softcap``: the drop-in options (``softcap=0.0``: none); ``z_loss_out``
    an ``(N,)`` buffer that receives the rows' z-loss ``s · lse_i²`` (0 on ignored rows) where ``s != 0``."""
    eager = is_plain_eager(logits)
    if sample_weight is not None:
        sample_weight = sample_weight.detach()
    if gamma_per_sample is not None:
        gamma_per_sample = gamma_per_sample.detach()
    # Eager: below the Autograd key, straight to the device kernel. Traced: the op itself, one graph node.
    with torch._C._AutoDispatchBelowAutograd() if eager else contextlib.nullcontext():
        loss, grad, flag, confidence, prediction, z_loss = _OP(
            logits, target, sample_weight, gamma_per_sample, uncertainty, mode, gamma, norm, ignore_index, reduction,
            compute_grad, grad_out, mix_target, mix_lambda, label_smoothing, loss_dtype == logits.dtype,
            stats_out is not None, _detached(class_weight), lse_square_scale, softcap)
    if z_loss_out is not None and lse_square_scale != 0.0:
        z_loss_out.copy_(z_loss)
    if stats_out is not None:
        stats_out[0].copy_(confidence)
        stats_out[1].copy_(prediction)
    return loss, grad, _checked_flag(flag) if eager else None


def _detached(tensor):
    return tensor if tensor is None else tensor.detach()


def loss_with_autograd(logits, target, sample_weight, gamma_per_sample, uncertainty, mode, gamma, norm, ignore_index,
                       reduction, inplace, mix_target=None, mix_lambda=None, label_smoothing=0.0, return_stats=False,
                       *, class_weight=None, lse_square_scale=0.0, softcap=0.0, z_loss_out=None):
    """``(loss, target_flag, stats)`` of the op through its autograd kernel (csrc/uncertainty_weighted_ce_autograd.cpp),
    in eager and traced code alike: the one autograd of the compiled op, which computes the gradient only where the
    logits need one. The loss in the logits' dtype; the target flag of an eager CUDA call, else ``None``.
    ``inplace``: the gradient overwrites the logits (the caller passes it only when they need a gradient).
    ``return_stats``: ``stats`` is the logits' top-label :class:`~calibkernels.loss_stats.LossStats`, 1-D ``(N,)``
    (NaN / -1 on ignored rows, taken before an in-place gradient overwrites the logits, detached), written by the
    kernel in its loss pass; else ``None``. The drop-in options and ``z_loss_out``: as :func:`forward`."""
    compute_grad = logits.requires_grad and torch.is_grad_enabled()
    grad_out = logits if inplace else None
    if return_stats or class_weight is not None or lse_square_scale != 0.0 or softcap != 0.0:
        loss, _, flag, confidence, prediction, z_loss = _OP(
            logits, target, sample_weight, gamma_per_sample, uncertainty, mode, gamma, norm, ignore_index, reduction,
            compute_grad, grad_out, mix_target, mix_lambda, label_smoothing, True, return_stats,
            _detached(class_weight), lse_square_scale, softcap)
        stats = LossStats(confidence, prediction) if return_stats else None
        if z_loss_out is not None and lse_square_scale != 0.0:
            z_loss_out.copy_(z_loss)
    else:  # the defaulted last arguments left out: each argument of a boxed call costs
        loss, _, flag, _, _, _ = _OP(logits, target, sample_weight, gamma_per_sample, uncertainty, mode, gamma, norm,
                                     ignore_index, reduction, compute_grad, grad_out, mix_target, mix_lambda,
                                     label_smoothing, True)
        stats = None
    # the CPU kernel raises instead of flagging (an empty flag); a traced call's flag is nobody's to read
    return loss, (flag if flag.shape[0] and is_plain_eager(logits) else None), stats


@functools.lru_cache(maxsize=None)
def _has_kernel(dispatch_key: str) -> bool:
    # fixed once the extension is loaded; cached because backend selection runs on every call
    return torch._C._dispatch_has_kernel_for_dispatch_key(_QUALNAME, dispatch_key)


# The CUDA statuses of a build without code for the device (no machine code for its architecture, no PTX it can
# compile); any other failed probe says nothing about the build, and the op's own launch reports it.
_NO_CODE = frozenset({"cudaErrorNoKernelImageForDevice", "cudaErrorInvalidDeviceFunction",
                      "cudaErrorInvalidKernelImage", "cudaErrorUnsupportedPtxVersion"})
# device index -> None (the kernels run there) or the probe's status name; definite answers only
_missing_code: dict = {}


def _cuda_kernels_probe():
    """The op ``calibkernels::cuda_kernels_probe(device) -> (status, name)`` of a build with CUDA kernels, else
    ``None``."""
    return getattr(torch.ops.calibkernels, "cuda_kernels_probe", None)


def _code_missing_on(index: int) -> str | None:
    """The CUDA status name if this build holds no code for CUDA device ``index``, else ``None``. backend="auto"
    must not pick a kernel that cannot launch; the build's architectures are fixed once it is loaded."""
    if index in _missing_code:
        return _missing_code[index]
    probe = _cuda_kernels_probe()
    if probe is None:
        return None
    status, name = probe(index)
    if status == 0 or name in _NO_CODE:
        _missing_code[index] = None if status == 0 else name
        return _missing_code[index]
    return None


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
        # only once CUDA is in use: asking initialises it and makes a context on the device (available_backends(),
        # say, must not); a CUDA tensor's call finds it initialised
        if torch.cuda.is_initialized():
            index = device.index if device.index is not None else torch.cuda.current_device()
            missing = _code_missing_on(index)
            if missing is not None:
                major, minor = torch.cuda.get_device_capability(index)
                return (f"calibkernels._C holds no CUDA code for this GPU (compute capability {major}.{minor}: "
                        f"{missing}); rebuild with CALIBKERNELS_CUDA_ARCHS naming it")
        return None
    return f"{name!r} is not a compiled backend"
