"""Argument checks of :func:`calibkernels.fused_linear_uncertainty_weighted_ce`: the settings, the tensors' shapes,
dtypes and devices, the backend that runs a call, and the per-row tensors (targets, a mix, ``sample_weight``, a
per-sample ``gamma``), whose values are read on the host where that costs no device synchronisation and flagged on
the device otherwise (:mod:`calibkernels._target_checks`)."""

from __future__ import annotations

import operator

import torch

from .. import _autograd, _backends, _target_checks
from .arguments import (check_backend, check_class_weight, check_dense_target, check_gamma, check_ignore_index,
                        check_label_smoothing, check_mix, check_mode, check_norm, check_per_sample_gamma,
                        check_reduction, check_sample_weight, check_target_values, check_uncertainty,
                        device_target_flag, drop_in_option_names)
from .loss_inputs import (DUAL_FOCAL_SOFT_MESSAGE, LossInputs, one_hot_for_dual_focal)

__all__ = ["check_accum_dtype", "check_chunk_size", "check_linear_inputs", "check_row_tensors", "check_settings",
           "backend_for_call", "one_hot_forms", "submit_device_target_check"]


def _check_tensor(name: str, value) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(value).__name__}")
    return value


def check_linear_inputs(hidden, linear_weight, target, linear_bias):
    """Shapes, dtypes and devices of ``hidden (..., H)``, ``linear_weight (C, H)``, ``target (...)``, ``linear_bias
    (C,)``; returns ``(hidden2d (N, H), target1d (N,) int64 or a dense target (N, C), batch_shape)``."""
    hidden = _check_tensor("hidden", hidden)
    linear_weight = _check_tensor("linear_weight", linear_weight)
    target = _check_tensor("target", target)
    if not hidden.is_floating_point():
        raise TypeError(f"hidden must be a floating-point tensor, got {hidden.dtype}")
    if hidden.dim() < 2:
        raise ValueError(f"hidden must have at least 2 dimensions (..., H), got shape {tuple(hidden.shape)}")
    if linear_weight.dim() != 2:
        raise ValueError(f"linear_weight must be 2-D (C, H), got shape {tuple(linear_weight.shape)}")
    num_classes, hidden_size = linear_weight.shape
    if linear_weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"linear_weight shape {tuple(linear_weight.shape)} does not match hidden shape "
                         f"{tuple(hidden.shape)}: expected (C, {hidden.shape[-1]})")
    if num_classes < 1:
        raise ValueError("linear_weight has zero rows (zero classes)")
    if hidden_size < 1:
        raise ValueError("hidden has a zero-size feature dimension")
    if linear_weight.dtype != hidden.dtype:
        raise TypeError(f"linear_weight dtype {linear_weight.dtype} does not match hidden dtype {hidden.dtype}")
    if linear_weight.device != hidden.device:
        raise ValueError(f"linear_weight is on {linear_weight.device} but hidden is on {hidden.device}")
    if linear_bias is not None:
        _check_tensor("linear_bias", linear_bias)
        if tuple(linear_bias.shape) != (num_classes,):
            raise ValueError(f"linear_bias shape {tuple(linear_bias.shape)} does not match linear_weight shape "
                             f"{tuple(linear_weight.shape)}: expected ({num_classes},)")
        if linear_bias.dtype != hidden.dtype:
            raise TypeError(f"linear_bias dtype {linear_bias.dtype} does not match hidden dtype {hidden.dtype}")
        if linear_bias.device != hidden.device:
            raise ValueError(f"linear_bias is on {linear_bias.device} but hidden is on {hidden.device}")
    if target.is_floating_point():  # dense probabilities (..., C): soft targets
        if tuple(target.shape) == tuple(hidden.shape[:-1]):
            raise TypeError(f"target has the shape of class indices {tuple(target.shape)} but holds {target.dtype}: "
                            "integer class indices (int64) are needed, or dense probabilities of shape (..., C)")
        if tuple(target.shape) != tuple(hidden.shape[:-1]) + (num_classes,):
            raise ValueError(f"a dense target must have shape {tuple(hidden.shape[:-1]) + (num_classes,)} (hidden's "
                             f"leading shape and C), got {tuple(target.shape)}")
        if target.device != hidden.device:
            raise ValueError(f"target is on {target.device} but hidden is on {hidden.device}")
        hidden2d = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden_size)
        if hidden2d.shape[0] == 0:
            raise ValueError("empty batch: hidden has no rows")
        return hidden2d, target.reshape(-1, num_classes), tuple(hidden.shape[:-1])
    if target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices (int64) or probabilities, got {target.dtype}")
    if tuple(target.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} does not match hidden shape {tuple(hidden.shape)}: "
                         f"expected {tuple(hidden.shape[:-1])}")
    if target.device != hidden.device:
        raise ValueError(f"target is on {target.device} but hidden is on {hidden.device}")
    batch_shape = tuple(hidden.shape[:-1])
    hidden2d = hidden if hidden.dim() == 2 else hidden.reshape(-1, hidden_size)
    if hidden2d.shape[0] == 0:
        raise ValueError("empty batch: hidden has no rows")
    target1d = target.reshape(-1)
    if target1d.dtype != torch.int64:
        target1d = target1d.long()
    return hidden2d, target1d, batch_shape


def submit_device_target_check(target1d: torch.Tensor, num_classes: int, ignore_index: int) -> None:
    """GPU kernels: one device flag for the whole batch, read without stalling the host (``CALIBKERNELS_VALIDATE``,
    docs/losses.md): ``(any bad, a bad value)`` of class indices, whose bad rows the kernels make NaN, or ``(any bad
    row, the first bad row)`` of a dense target's values."""
    if torch.compiler.is_compiling() or torch.cuda.is_current_stream_capturing():
        return
    _target_checks.submit(device_target_flag(target1d, num_classes, ignore_index), num_classes, ignore_index,
                          _autograd._dense_dtype(target1d))


def check_chunk_size(chunk_size) -> int | None:
    """``chunk_size`` as a Python int (any integer type, e.g. a NumPy integer: ``operator.index``), or ``None``."""
    if chunk_size is None:
        return None
    if isinstance(chunk_size, bool):
        raise TypeError("chunk_size must be an int or None, got bool")
    try:
        chunk_size = operator.index(chunk_size)
    except TypeError:
        raise TypeError(f"chunk_size must be an int or None, got {type(chunk_size).__name__}") from None
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    return chunk_size


def one_hot_forms(target1d, mix1d, lam, uncertainty, ignore_index):
    """Soft-target forms that are one-hot, as class indices: ``(target1d, mix1d, lam)`` as the chunks take them.

    A number ``λ`` of exactly 1 makes ``t = e_target`` (the mix is dropped), exactly 0 ``t = e_mix_target`` on the
    non-ignored rows, as :func:`calibkernels.uncertainty_weighted_ce` reads them: hard targets, whose kernels and
    per-sample ``γ`` gradient take class indices. For ``uncertainty="dual_focal"`` (no soft form) a ``λ`` tensor of 0s
    and 1s and a one-hot dense target become class indices too (read on the host, as the op does); any other soft
    form raises the op's ``ValueError``.
    """
    if mix1d is not None and not isinstance(lam, torch.Tensor) and lam in (0.0, 1.0):
        if lam == 0.0:
            target1d = torch.where(target1d == ignore_index, target1d, mix1d)
        mix1d = lam = None
    if uncertainty == "dual_focal" and (mix1d is not None or target1d.is_floating_point()):
        inputs = LossInputs(logits=None, target=target1d, uncertainty=uncertainty, mode="grad", gamma=0.0, norm=2.0,
                            sample_weight=None, reduction="none", ignore_index=ignore_index,
                            batch_shape=(target1d.shape[0],), mix_target=mix1d, mix_lambda=lam,
                            dense=target1d.is_floating_point())
        target1d, mix1d, lam = one_hot_for_dual_focal(inputs).target, None, None
    return target1d, mix1d, lam


def check_accum_dtype(accum_dtype) -> torch.dtype | None:
    """``accum_dtype``: ``None`` or a floating dtype the weight and bias gradients are accumulated in."""
    if accum_dtype is not None and accum_dtype not in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise TypeError("accum_dtype must be None or a floating torch.dtype (float16, bfloat16, float32, float64), "
                        f"got {accum_dtype!r}")
    return accum_dtype


def check_settings(weight, uncertainty, mode, reduction, gamma, norm, backend, chunk_size, ignore_index,
                    label_smoothing):
    """The checks of :func:`fused_linear_uncertainty_weighted_ce`'s settings that need no tensor; returns
    ``(chunk_size, label_smoothing)`` as the call uses them."""
    if isinstance(weight, str):
        check_class_weight(weight)  # the TypeError naming uncertainty=
    check_uncertainty(uncertainty)
    check_mode(mode)
    check_reduction(reduction)
    check_gamma(gamma)
    check_norm(norm)
    check_backend(backend)
    chunk_size = check_chunk_size(chunk_size)
    check_ignore_index(ignore_index)
    return chunk_size, check_label_smoothing(label_smoothing)



def backend_for_call(backend: str, device: torch.device, soft: bool, uncertainty: str, mode: str, gamma,
                     smoothing: float, drop_in: dict, weight) -> str:
    """The backend that runs a call: :func:`calibkernels._backends.resolve` (soft targets: ``resolve_soft_targets``),
    then the reference for drop-in options the chosen kernel does not compute (a named fused backend raises
    ``NotImplementedError`` instead; ``"auto"`` warns once)."""
    if soft and uncertainty == "dual_focal" and smoothing != 0.0:
        raise ValueError(f"uncertainty='dual_focal' with soft targets: {DUAL_FOCAL_SOFT_MESSAGE}")
    # dual focal's other soft forms run as class indices once found one-hot (one_hot_forms), or raise there
    if soft and uncertainty != "dual_focal":
        # only "loss" mode differentiates the weight, hence a per-sample gamma (the kernels' soft rows do not)
        gamma_needs_grad = (mode == "loss" and isinstance(gamma, torch.Tensor) and gamma.requires_grad
                            and torch.is_grad_enabled())
        name = _backends.resolve_soft_targets(backend, device, gamma_needs_grad)
    else:
        name = _backends.resolve(backend, device)
    options = drop_in_option_names(weight, drop_in["lse_square_scale"], drop_in["return_z_loss"], drop_in["softcap"])
    name, cannot_run = _backends.with_options(name, backend, options, uncertainty)
    if cannot_run is not None:
        raise cannot_run
    return name


def check_row_tensors(hidden2d, num_classes: int, target1d, batch_shape, mix_target, mix_lambda, sample_weight, gamma,
                      uncertainty: str, ignore_index: int, host_check: bool) -> tuple:
    """``(mix1d, lam, sample_weight, gamma)`` checked: the targets' values (on the host with ``host_check``, else
    flagged on the device by the kernels), a dense target's, a mix, ``sample_weight`` (detached) and a per-sample
    ``gamma``."""
    device = hidden2d.device
    num_rows = hidden2d.shape[0]
    mix1d = lam = None
    if target1d.is_floating_point():
        if mix_target is not None:
            raise ValueError("mix_target/mix_lambda mix class-index targets; mix a dense target yourself")
        if not torch.compiler.is_compiling():
            # on a GPU the values of plain eager calls are flagged on the device (no synchronisation)
            check_dense_target(hidden2d.new_empty((1, 1)).expand(num_rows, num_classes), target1d, ignore_index,
                               check_values=host_check or not _autograd.is_plain_eager(hidden2d))
    elif host_check and not torch.compiler.is_compiling():
        check_target_values(target1d, num_classes, ignore_index)
    if mix_target is not None:
        # on a GPU the mix's values are flagged on the device (no synchronisation); the kernel flags the targets
        mix1d, lam = check_mix(mix_target, mix_lambda, target1d, batch_shape, num_classes, ignore_index, device,
                               check_values=host_check)
    sample_weight = check_sample_weight(sample_weight, uncertainty, batch_shape, device, check_values=host_check)
    if sample_weight is not None:
        sample_weight = sample_weight.detach()
    gamma = check_per_sample_gamma(gamma, uncertainty, batch_shape, device, check_values=host_check)
    return mix1d, lam, sample_weight, gamma
