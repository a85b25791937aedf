"""The argument checks of every public call: choices, numbers, per-sample tensors, targets, soft targets and the
drop-in options, each with its message. Tensor values are read on the host (``check_values=True``) or flagged on the
device and queued (:mod:`calibkernels._target_checks`), so that every backend raises the same error."""

from __future__ import annotations

import functools
import math
import numbers

import torch

from .._kernel_codes import BACKENDS, MODE_CODES, REDUCTION_CODES, WEIGHT_CODES
# the error texts are the device checks' too
from .._target_checks import (DENSE_ROW_SUM_TOLERANCE, checking, dense_row_sum_tolerance, gamma_message,
                              lambda_message, mix_target_message, out_of_range_message, sample_weight_message,
                              submit_check)


def _check_choice(kind: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(repr(c) for c in choices)}")


def check_uncertainty(uncertainty: str) -> None:
    """``uncertainty``: the name of the uncertainty weight ``u(p, y)`` (:data:`WEIGHT_CODES`)."""
    _check_choice("uncertainty", uncertainty, tuple(WEIGHT_CODES))


def check_class_weight(weight) -> None:
    """``weight`` is reserved for ``F.cross_entropy``'s per-class ``(C,)`` tensor, not supported yet: only ``None``
    passes. A string is an uncertainty weight given under its former keyword (``TypeError`` naming
    ``uncertainty=``); a tensor raises ``NotImplementedError``."""
    if weight is None:
        return
    if isinstance(weight, str):
        raise TypeError(f"weight is F.cross_entropy's per-class weight tensor; the uncertainty weight is now "
                        f"uncertainty={weight!r}")
    if isinstance(weight, torch.Tensor):
        raise NotImplementedError("per-class weights are not supported yet: pass weight=None (the uncertainty weight "
                                  "is uncertainty=)")
    raise TypeError(f"weight must be None (per-class weight tensors are not supported yet), got "
                    f"{type(weight).__name__}")


def check_mode(mode: str) -> None:
    _check_choice("mode", mode, tuple(MODE_CODES))


def check_reduction(reduction: str) -> None:
    _check_choice("reduction", reduction, tuple(REDUCTION_CODES))


def check_backend(backend: str) -> None:
    _check_choice("backend", backend, BACKENDS)


def is_number(value) -> bool:
    """Whether ``value`` is a real number for a hyper-parameter: a Python or NumPy integer or float (any
    ``numbers.Real``), not a bool, not a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def check_ignore_index(ignore_index) -> None:
    """``ignore_index``: an int (not a bool) that int64 holds. Targets are int64 and every backend compares them with
    it as an int64 (the compiled op cannot take a wider int, a Triton kernel would take one as uint64), so a value
    outside the range is refused here rather than each backend failing its own way."""
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if not INT64_MIN <= ignore_index <= INT64_MAX:
        raise ValueError(f"ignore_index must be in the int64 range [{INT64_MIN}, {INT64_MAX}] (targets are int64), "
                         f"got {ignore_index}")


def _as_float(value) -> float:
    """A real number as the float the kernels take: an int past float's range (10**400, which compares below inf)
    becomes ±inf, so that a range check refuses it."""
    try:
        return float(value)
    except OverflowError:
        return math.inf if value > 0 else -math.inf


def check_number(name: str, value, *, minimum: float | None = 0.0, positive: bool = False) -> float:
    """``value`` as a float: a real number (:func:`is_number`), finite, and ``> 0`` (``positive``) or ``>= minimum``
    (``None``: any finite value). ``TypeError`` for what is not a number, ``ValueError`` for a value out of range
    (NaN included)."""
    if not is_number(value):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    number = _as_float(value)
    in_range = number > 0 if positive else (minimum is None or number >= minimum)  # both False for NaN
    if not (in_range and math.isfinite(number)):
        bound = " and > 0" if positive else ("" if minimum is None else f" and >= {minimum:g}")
        raise ValueError(f"{name} must be finite{bound}, got {value}")
    return number


def expanded(tensor: torch.Tensor) -> bool:
    """Whether elements of ``tensor`` share memory as an expanded tensor's do (a dimension of size > 1 with stride
    0), so that rows written at once would overwrite each other (the compiled op's own check of ``grad_out`` also
    catches rarer overlaps)."""
    return any(size > 1 and stride == 0 for size, stride in zip(tensor.shape, tensor.stride()))


def check_gamma(gamma) -> None:
    if isinstance(gamma, torch.Tensor):
        if not gamma.is_floating_point():
            raise TypeError(f"a per-sample gamma tensor must be floating point, got {gamma.dtype}")
        return  # values are checked once the rows are known (check_per_sample_gamma)
    if not is_number(gamma):
        raise TypeError(f"gamma must be a number or a per-sample tensor, got {type(gamma).__name__}")
    if not 0 <= _as_float(gamma) < float("inf"):  # also rejects NaN
        raise ValueError(f"gamma must be finite and >= 0, got {gamma}")


def check_scalar_gamma(gamma, why_not_per_sample: str) -> float:
    """``gamma`` where only a number is taken (a loss module's, a loss that picks ``γ_i`` itself): :func:`check_gamma`
    (finite, ``>= 0``), and ``TypeError(why_not_per_sample)`` for a per-sample tensor; returned as a float."""
    check_gamma(gamma)
    if isinstance(gamma, torch.Tensor):
        raise TypeError(why_not_per_sample)
    return float(gamma)


def check_norm(norm) -> None:
    if not is_number(norm):
        raise TypeError(f"norm must be a number, got {type(norm).__name__}")
    if not 0 < _as_float(norm) < float("inf"):
        raise ValueError(f"norm (the q of the generalised Brier score) must be finite and > 0, got {norm}")


def out_of_range_targets(target: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    """Boolean mask of the targets that are neither a class index in ``[0, num_classes)`` nor ``ignore_index``."""
    return (target != ignore_index) & ((target < 0) | (target >= num_classes))


def check_target_values(target: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    """Raise ``ValueError`` unless every target is a class index in ``[0, num_classes)`` or ``ignore_index``. Reads the
    values: a host synchronisation on a GPU."""
    # One reduction answers the common case (every target a class index); only a batch with ignored rows or a bad
    # value pays for the exact check. This runs on every call, and the exact check alone was ~5x the cost.
    low, high = (int(v) for v in torch.aminmax(target))
    if low >= 0 and high < num_classes:
        return
    bad = out_of_range_targets(target, num_classes, ignore_index)
    if bool(bad.any()):
        raise ValueError(out_of_range_message(int(target[bad][0]), num_classes, ignore_index))


def target_flag(target: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    """The device-side ``(any bad target, a bad value)`` int64 pair that :mod:`calibkernels._target_checks` reads,
    computed without a host synchronisation."""
    bad = out_of_range_targets(target, num_classes, ignore_index)
    return torch.stack((bad.any().to(torch.int64), torch.where(bad, target, torch.iinfo(torch.int64).min).max()))


def check_logits_target(logits, target, *, ignore_index: int = -100, check_values: bool = True):
    """Validate and flatten ``logits (..., C)`` and ``target (...)``; return ``(logits2d, target1d, batch_shape)``.

    ``check_values=False`` skips the target-range check, which needs a device synchronisation on GPU; the GPU kernels
    check the range on the device instead.
    """
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices (int64), got {target.dtype}")
    if logits.dim() < 2:
        raise ValueError(f"logits must have at least 2 dimensions (..., C), got shape {tuple(logits.shape)}")
    if tuple(target.shape) != tuple(logits.shape[:-1]):
        raise ValueError(
            f"target shape {tuple(target.shape)} does not match logits shape {tuple(logits.shape)}: "
            f"expected {tuple(logits.shape[:-1])} (class dimension last)"
        )
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits are on {logits.device}")
    check_ignore_index(ignore_index)
    num_classes = logits.shape[-1]
    if num_classes < 1:
        raise ValueError("logits have zero classes")
    batch_shape = tuple(logits.shape[:-1])
    # (N, C) input, the common case, is used as is: a reshape would add a view and its ViewBackward node per call
    logits2d = logits if logits.dim() == 2 else logits.reshape(-1, num_classes)
    if logits2d.shape[0] == 0:
        raise ValueError("empty batch: logits have no rows")
    target1d = target if target.dim() == 1 else target.reshape(-1)
    if target1d.dtype != torch.int64:
        target1d = target1d.long()
    # The range check needs the values (a device sync on GPU, a graph break under torch.compile); there the kernels'
    # own bounds check raises instead.
    if check_values and not torch.compiler.is_compiling():
        check_target_values(target1d, num_classes, ignore_index)
    return logits2d, target1d, batch_shape


def check_sample_weight(sample_weight, uncertainty: str, target_shape, device, *,
                        check_values: bool = True) -> torch.Tensor | None:
    """``sample_weight`` is required by, and only allowed with, ``uncertainty="external"``; returned flattened. Its
    values (finite, ``>= 0``) are read on the host, or with ``check_values=False`` flagged on the device and queued
    (:func:`finite_nonnegative_flag`, :mod:`calibkernels._target_checks`)."""
    if uncertainty != "external":
        if sample_weight is not None:
            raise ValueError(f"sample_weight is only used with uncertainty='external', not "
                             f"uncertainty={uncertainty!r}")
        return None
    if sample_weight is None:
        raise ValueError("uncertainty='external' needs a sample_weight tensor of the target's shape")
    if not isinstance(sample_weight, torch.Tensor):
        raise TypeError(f"sample_weight must be a torch.Tensor, got {type(sample_weight).__name__}")
    if not sample_weight.is_floating_point():
        raise TypeError(f"sample_weight must be floating point, got {sample_weight.dtype}")
    if tuple(sample_weight.shape) != tuple(target_shape):
        raise ValueError(
            f"sample_weight shape {tuple(sample_weight.shape)} does not match target shape {tuple(target_shape)}"
        )
    if sample_weight.device != device:
        raise ValueError(f"sample_weight is on {sample_weight.device} but logits are on {device}")
    _check_values(sample_weight, check_values, finite_nonnegative_flag, sample_weight_message)
    return sample_weight.reshape(-1)


def check_per_sample_gamma(gamma, uncertainty: str, target_shape, device, *, check_values: bool = True):
    """A tensor gamma (one exponent per row, e.g. from a γ-Net) is flattened; only the focal weight accepts it. Its
    values (finite, ``>= 0``) are read on the host, or with ``check_values=False`` flagged on the device and queued."""
    if not isinstance(gamma, torch.Tensor):
        return float(gamma)
    if uncertainty != "focal":
        raise ValueError(f"a per-sample gamma tensor is only supported with uncertainty='focal', not {uncertainty!r}")
    if tuple(gamma.shape) != tuple(target_shape):
        raise ValueError(f"per-sample gamma shape {tuple(gamma.shape)} does not match target shape "
                         f"{tuple(target_shape)}")
    if gamma.device != device:
        raise ValueError(f"per-sample gamma is on {gamma.device} but logits are on {device}")
    _check_values(gamma, check_values, finite_nonnegative_flag, gamma_message)
    return gamma.reshape(-1)


# The value checks of the optional tensors: each a few ops to a (2,) int64 flag (any bad, a value), read on the host
# at once (check_values=True) or, on the GPU path, queued for calibkernels._target_checks, which reads it without
# stalling the host (_check_values); the same message either way.
def _first_flagged(bad: torch.Tensor, values: torch.Tensor | None = None) -> torch.Tensor:
    """``(any entry of bad, the first bad index)`` as a device-side int64 pair, or ``values`` at that index in the
    second slot (0 where none is bad: argmax of all zeros)."""
    first = bad.view(torch.uint8).argmax()  # argmax returns the first of equal maxima
    return torch.stack((bad.any(), first if values is None else values.take(first)))


def finite_nonnegative_flag(values: torch.Tensor) -> torch.Tensor:
    """``(any entry negative, infinite or NaN, the first such index)`` of a floating tensor, without a host
    synchronisation: the device form of the ``sample_weight`` / per-sample ``gamma`` checks. (clamp keeps NaN, and
    NaN != NaN.)"""
    values = values.detach()
    return _first_flagged(values.clamp(0, torch.finfo(values.dtype).max) != values)


def mix_target_flag(mix1d: torch.Tensor, target1d: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    """``(any bad, the first bad value)`` of ``mix_target (N,)``: bad where the row's target is not ``ignore_index``
    and the mix is not a class index in ``[0, num_classes)``; the device form of :func:`check_mix`'s check."""
    bad = (mix1d.clamp(0, num_classes - 1) != mix1d) & (target1d != ignore_index)
    return _first_flagged(bad, mix1d)


def lambda_flag(mix_lambda: torch.Tensor) -> torch.Tensor:
    """``(any entry outside [0, 1] or NaN, the first such index)`` of a ``mix_lambda`` tensor (0-dim or ``(N,)``),
    the device form of :func:`check_mix`'s check."""
    mix_lambda = mix_lambda.detach()
    return _first_flagged(mix_lambda.clamp(0, 1) != mix_lambda)


def _queue_value_check(tensor: torch.Tensor, flag_of, message, *args) -> None:
    """Queue ``flag_of(tensor, *args)`` with ``message`` (:func:`calibkernels._target_checks.submit_check`) unless
    nothing would read it (policy off, a trace, a capture): then not even the flag is computed."""
    if checking(tensor):
        submit_check(flag_of(tensor, *args), message)


def _check_values(tensor: torch.Tensor, check_values: bool, flag_of, message, *args) -> None:
    """The one check of ``tensor``'s values, ``flag_of(tensor, *args)``: read on the host at once and raised as
    ``ValueError(message(value))`` (``check_values``; not while tracing), or queued (:func:`_queue_value_check`)."""
    if not check_values:
        _queue_value_check(tensor, flag_of, message, *args)
    elif not torch.compiler.is_compiling():
        has_bad, value = flag_of(tensor, *args).tolist()
        if has_bad:
            raise ValueError(message(value))


def first_flagged_row(flags: torch.Tensor) -> torch.Tensor:
    """``(any row flagged, the first flagged row)`` as a device-side int64 pair, from one flag per row."""
    bad = flags != 0
    rows = torch.arange(bad.shape[0], device=bad.device)
    return torch.stack((bad.any().to(torch.int64), torch.where(bad, rows, bad.shape[0]).min()))


def dense_target_flag(target2d: torch.Tensor) -> torch.Tensor:
    """The device-side ``(any bad row, the first bad row)`` int64 pair of a dense target ``(N, C)`` that
    :mod:`calibkernels._target_checks` reads, computed without a host synchronisation (:func:`check_dense_target`'s
    value check as the GPU backends make it where their kernels' float32 sums cannot decide: a float64 target of
    lower-precision logits, rows wider than ``DENSE_KERNEL_CHECK_MAX_CLASSES``; elsewhere the kernels make it in their
    own reads): a row is bad where an entry is negative or NaN, or where its sum, taken
    as that check takes it, is not finite or is off 1 by more than the dtype's tolerance."""
    row_sums = dense_row_sums(target2d)
    bad = ~(target2d.amin(dim=1) >= 0) | ~((row_sums - 1.0).abs() <= dense_row_sum_tolerance(target2d.dtype))
    return first_flagged_row(bad)


def device_target_flag(target: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    """The device flag of either kind of target: :func:`dense_target_flag` of a dense target, else
    :func:`target_flag` of class indices."""
    if target.is_floating_point():
        return dense_target_flag(target)
    return target_flag(target, num_classes, ignore_index)


def dense_row_sums(target2d: torch.Tensor) -> torch.Tensor:
    """A dense target's row sums as its value check takes them, in float64: summed in float64 for a float64 target,
    in float32 otherwise (a float16 / bfloat16 sum is not rounded back to the target's dtype, so the tolerance
    applies to the row's real sum, as the kernels' float32 sums see it)."""
    return target2d.sum(dim=1, dtype=torch.float64 if target2d.dtype == torch.float64 else torch.float32).double()


def check_label_smoothing(label_smoothing) -> float:
    """``label_smoothing`` (α of ``t <- (1 - α) t + α / C``): a real number in [0, 1]."""
    if not is_number(label_smoothing):
        raise TypeError(f"label_smoothing must be a number in [0, 1], got {type(label_smoothing).__name__}")
    if not 0.0 <= label_smoothing <= 1.0:  # also rejects NaN
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    return float(label_smoothing)


def soft_target_request(target, label_smoothing, mix_target, mix_lambda) -> bool:
    """Whether a call asks for soft targets, decided without reading tensor values (it picks the backend).

    Soft: ``label_smoothing != 0``, a floating ``target`` (dense probabilities), or ``mix_target`` with a
    ``mix_lambda`` that is a tensor or a number strictly between 0 and 1. A number ``mix_lambda`` of exactly 1 (or 0)
    makes the target one-hot ``e_target`` (or ``e_mix_target``): hard targets, today's path. Raises ``TypeError`` /
    ``ValueError`` for a bad ``label_smoothing`` or ``mix_lambda`` number, or a ``mix_target`` without
    ``mix_lambda`` (and vice versa).
    """
    smoothing = check_label_smoothing(label_smoothing)
    if (mix_target is None) != (mix_lambda is None):
        raise ValueError("mix_target and mix_lambda go together: t = lam e_target + (1 - lam) e_mix_target needs "
                         "both (or neither)")
    dense = isinstance(target, torch.Tensor) and target.is_floating_point()
    mixed = False
    if mix_lambda is not None:
        if isinstance(mix_lambda, torch.Tensor):
            mixed = True
        else:
            lam = _check_lambda_number(mix_lambda)
            mixed = 0.0 < lam < 1.0
    return smoothing != 0.0 or dense or mixed


def _check_lambda_number(mix_lambda) -> float:
    if not is_number(mix_lambda):
        raise TypeError(f"mix_lambda must be a number or a floating tensor, got {type(mix_lambda).__name__}")
    if not 0.0 <= mix_lambda <= 1.0:  # also rejects NaN
        raise ValueError(f"mix_lambda must be in [0, 1], got {mix_lambda}")
    return float(mix_lambda)


def lambda_tensor(mix_lambda, logits_dtype: torch.dtype, device, shape=()) -> torch.Tensor:
    """A checked number λ as the tensor the ops take (a tensor passes through): a tensor argument, not a float one,
    so that a new λ per batch does not recompile a compiled step. float64 for float64 logits, float32 otherwise (the
    kernels' accumulation types); 0-dim, or ``shape`` where the caller slices it per chunk."""
    if isinstance(mix_lambda, torch.Tensor):
        return mix_lambda
    dtype = torch.float64 if logits_dtype == torch.float64 else torch.float32
    return torch.full(shape, float(mix_lambda), dtype=dtype, device=device)


def check_dense_target(logits, target, ignore_index, *, requires_grad_ok: bool = False,
                       check_values: bool = True) -> torch.Tensor:
    """A dense probability target ``(..., C)`` of ``logits``' shape, returned as ``(N, C)``.

    A float16, bfloat16, float32 or float64 tensor; every entry finite and ``>= 0``, every row summing to 1 within
    :data:`calibkernels._target_checks.DENSE_ROW_SUM_TOLERANCE` of its dtype (:func:`dense_row_sums`: float32 sums,
    float64 for a float64 target); it is used as given, not renormalised (as ``F.cross_entropy`` does).
    ``ignore_index`` applies to class indices only, so it must stay at its default -100. Targets are constants: one
    that requires grad raises (the loss would silently give it no gradient). ``check_values=False`` leaves the value
    check to the C++ CPU op, which makes it, with these errors, in the sweep that reads the target anyway (in place,
    in a pass of its own before the kernel overwrites the logits).
    """
    if tuple(target.shape) == tuple(logits.shape[:-1]):
        raise TypeError(f"target has the shape of class indices {tuple(target.shape)} but holds {target.dtype}: "
                        f"class indices must be integer (int64); dense probability targets have the logits' shape "
                        f"{tuple(logits.shape)}")
    if tuple(target.shape) != tuple(logits.shape):
        raise ValueError(f"a floating-point (dense probability) target must have the logits' shape "
                         f"{tuple(logits.shape)}, got {tuple(target.shape)}; class indices must be int64")
    if target.dtype not in DENSE_ROW_SUM_TOLERANCE:
        raise TypeError(f"a dense target must be float16, bfloat16, float32 or float64, got {target.dtype}")
    if target.device != logits.device:
        raise ValueError(f"target is on {target.device} but logits are on {logits.device}")
    if ignore_index != -100:
        raise ValueError(f"ignore_index={ignore_index} applies to class-index targets only; dense probability "
                         "targets have no ignored rows (leave ignore_index at -100)")
    if target.requires_grad and torch.is_grad_enabled() and not requires_grad_ok:
        raise ValueError("the dense target requires grad, but targets are constants here (no gradient flows to "
                         "them): pass target.detach()")
    target2d = target.reshape(-1, logits.shape[-1])
    if check_values and not torch.compiler.is_compiling():
        # two reductions over N×C and no N×C temporary (a float64 sum would copy the target): the smallest entry,
        # and the row sums in the target's accumulation type (entries >= 0 with finite row sums are all finite; NaN
        # fails both tests); rounding of a float32 sum over 10^5 columns stays far below the tolerance
        row_sums = dense_row_sums(target2d)
        if not (bool(target2d.amin() >= 0) and bool(row_sums.isfinite().all())):
            raise ValueError("a dense target must be finite and >= 0 everywhere (a probability distribution per row)")
        tolerance = dense_row_sum_tolerance(target.dtype)
        error = (row_sums - 1.0).abs()
        worst = float(error.max())
        if worst > tolerance:
            row = int(error.argmax())
            raise ValueError(f"every row of a dense target must sum to 1 (within {tolerance:g} for {target.dtype}); "
                             f"row {row} sums to {float(target2d[row].double().sum()):.8g}")
    return target2d


def check_mix(mix_target, mix_lambda, target1d, target_shape, num_classes, ignore_index, device, *,
              check_values: bool = True, kernel_checks: bool = False):
    """``mix_target`` (int64, the target's shape, a class index on every non-ignored row) and ``mix_lambda`` (a
    number, a 0-dim tensor or one value per row, finite, in [0, 1]); returned as ``((N,), float | (N,))``.

    The tensors' values are read on the host (``check_values``), or flagged on the device and queued
    (``check_values=False``: :func:`mix_target_flag`, :func:`lambda_flag`, :mod:`calibkernels._target_checks`), or
    left to the kernel (``kernel_checks``: the C++ CPU op checks both, the GPU kernels flag both with the targets,
    with the same errors), which sees the mix only
    where ``mix_lambda`` is a tensor or a number strictly between 0 and 1 (a number 0 or 1 drops it). A number
    ``mix_lambda`` is always checked here.
    """
    if not isinstance(mix_target, torch.Tensor):
        raise TypeError(f"mix_target must be a torch.Tensor, got {type(mix_target).__name__}")
    if mix_target.is_floating_point() or mix_target.is_complex() or mix_target.dtype == torch.bool:
        raise TypeError(f"mix_target must hold integer class indices (int64), got {mix_target.dtype}")
    if tuple(mix_target.shape) != tuple(target_shape):
        raise ValueError(f"mix_target shape {tuple(mix_target.shape)} does not match target shape "
                         f"{tuple(target_shape)}")
    if mix_target.device != device:
        raise ValueError(f"mix_target is on {mix_target.device} but logits are on {device}")
    lam_is_tensor = isinstance(mix_lambda, torch.Tensor)
    lam = mix_lambda if lam_is_tensor else _check_lambda_number(mix_lambda)
    checks = not (kernel_checks and (lam_is_tensor or 0.0 < lam < 1.0))
    mix1d = mix_target.reshape(-1).long()
    if checks:
        _check_values(mix1d, check_values, mix_target_flag, functools.partial(
            mix_target_message, num_classes=num_classes, ignore_index=ignore_index), target1d, num_classes,
            ignore_index)
    if not lam_is_tensor:
        return mix1d, lam
    if not mix_lambda.is_floating_point():
        raise TypeError(f"a mix_lambda tensor must be floating point, got {mix_lambda.dtype}")
    if mix_lambda.dim() != 0 and tuple(mix_lambda.shape) != tuple(target_shape):
        raise ValueError(f"mix_lambda must be a number, a 0-dim tensor or one value per row of shape "
                         f"{tuple(target_shape)}, got shape {tuple(mix_lambda.shape)}")
    if mix_lambda.device != device:
        raise ValueError(f"mix_lambda is on {mix_lambda.device} but logits are on {device}")
    if mix_lambda.requires_grad and torch.is_grad_enabled():
        raise ValueError("the mix_lambda tensor requires grad, but the mix is a constant target here (no gradient "
                         "flows to it): pass mix_lambda.detach()")
    if checks:
        _check_values(mix_lambda, check_values, lambda_flag, lambda_message)
    lam = mix_lambda.detach()
    lam = lam.expand(target_shape).reshape(-1) if lam.dim() == 0 else lam.reshape(-1)
    return mix1d, lam


# slots and not frozen: a frozen dataclass sets each field through object.__setattr__, microseconds per call
def class_weight_message(index) -> str:
    """The ``ValueError`` text for a per-class weight entry that is negative, infinite or NaN."""
    return (f"weight (the per-class weights) must be finite and >= 0 everywhere; entry {index} is not (it scales "
            f"that class's cross-entropy)")


def check_class_weight_tensor(weight, logits: torch.Tensor, *, check_values: bool = True) -> torch.Tensor | None:
    """``weight``, ``F.cross_entropy``'s per-class weights: ``None``, or a floating ``(C,)`` tensor on the logits'
    device, every entry finite and ``>= 0``; returned as given. Per-class weights are constants of the loss (no
    gradient flows to them), so one that requires grad raises, as a dense target does.

    ``TypeError`` for what is not a floating tensor (any floating dtype: it is used in the loss's compute dtype);
    ``ValueError`` for a wrong shape, device or value. The values are read on the host (``check_values``) or
    flagged on the device and queued (:mod:`calibkernels._target_checks`), as ``sample_weight``'s are.
    """
    if weight is None:
        return None
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"weight (the per-class weights) must be None or a floating (C,) tensor, got "
                        f"{type(weight).__name__}")
    if not weight.is_floating_point():
        raise TypeError(f"weight (the per-class weights) must be a floating-point tensor, got {weight.dtype}")
    num_classes = logits.shape[-1]
    if tuple(weight.shape) != (num_classes,):
        raise ValueError(f"weight (the per-class weights) must have shape ({num_classes},), one entry per class of "
                         f"logits {tuple(logits.shape)}, got {tuple(weight.shape)}")
    if weight.device != logits.device:
        raise ValueError(f"weight (the per-class weights) is on {weight.device} but logits are on {logits.device}")
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("weight (the per-class weights) requires grad, but class weights are constants here (no "
                         "gradient flows to them): pass weight.detach()")
    _check_values(weight, check_values, finite_nonnegative_flag, class_weight_message)
    return weight


def check_drop_in_options(*, lse_square_scale=0.0, return_z_loss=False, softcap=None) -> dict:
    """Liger-Kernel's options, checked; returned as :class:`LossInputs` fields.

    ``lse_square_scale``: the z-loss scale ``s`` of ``s · logsumexp(z)^2``, a finite number ``>= 0``.
    ``return_z_loss``: a bool. ``softcap``: ``None`` or a finite number ``> 0`` (logits become ``c · tanh(z / c)``).
    ``TypeError`` for a wrong type, ``ValueError`` for a value out of range.
    """
    scale = check_number("lse_square_scale (the z-loss scale)", lse_square_scale)
    if not isinstance(return_z_loss, bool):
        raise TypeError(f"return_z_loss must be a bool, got {type(return_z_loss).__name__}")
    cap = None if softcap is None else check_number("softcap", softcap, positive=True)
    return {"lse_square_scale": scale, "return_z_loss": return_z_loss, "softcap": cap}


def drop_in_option_names(weight, lse_square_scale, return_z_loss, softcap) -> str | None:
    """The drop-in options a call asks for, named for a message, or ``None``."""
    wanted = [name for name, given in (
        ("per-class weights", isinstance(weight, torch.Tensor)),
        ("the z-loss", return_z_loss is True or not (type(lse_square_scale) in (float, int) and lse_square_scale == 0)),
        ("logit soft-capping", softcap is not None)) if given]
    return " and ".join(wanted) if wanted else None
