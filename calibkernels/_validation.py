"""Input checking shared by every backend, so all of them reject bad input with the same clear message.

Logits of shape ``(..., C)`` are flattened to rows ``(N, C)`` (class dimension last, docs/losses.md); targets of shape
``(...)`` to ``(N,)``. The integer codes the kernels receive are declared in :mod:`calibkernels._codes`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ._codes import BACKENDS, MODE_CODES, REDUCTION_CODES, WEIGHT_CODES  # noqa: F401  (re-exported)


def _check_choice(kind: str, value, choices) -> None:
    if not isinstance(value, str) or value not in choices:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {', '.join(repr(c) for c in choices)}")


def check_weight(weight: str) -> None:
    _check_choice("weight", weight, tuple(WEIGHT_CODES))


def check_mode(mode: str) -> None:
    _check_choice("mode", mode, tuple(MODE_CODES))


def check_reduction(reduction: str) -> None:
    _check_choice("reduction", reduction, tuple(REDUCTION_CODES))


def check_backend(backend: str) -> None:
    _check_choice("backend", backend, BACKENDS)


def check_gamma(gamma) -> None:
    if isinstance(gamma, torch.Tensor):
        if not gamma.is_floating_point():
            raise TypeError(f"a per-sample gamma tensor must be floating point, got {gamma.dtype}")
        return  # values are checked once the rows are known (check_per_sample_gamma)
    if isinstance(gamma, bool) or not isinstance(gamma, (int, float)):
        raise TypeError(f"gamma must be a number or a per-sample tensor, got {type(gamma).__name__}")
    if not 0 <= gamma < float("inf"):  # also rejects NaN
        raise ValueError(f"gamma must be finite and >= 0, got {gamma}")


def check_norm(norm) -> None:
    if isinstance(norm, bool) or not isinstance(norm, (int, float)):
        raise TypeError(f"norm must be a number, got {type(norm).__name__}")
    if not 0 < norm < float("inf"):
        raise ValueError(f"norm (the q of the generalised Brier score) must be finite and > 0, got {norm}")


def out_of_range_targets(target: torch.Tensor, num_classes: int, ignore_index: int) -> torch.Tensor:
    """Boolean mask of the targets that are neither a class index in ``[0, num_classes)`` nor ``ignore_index``."""
    return (target != ignore_index) & ((target < 0) | (target >= num_classes))


def out_of_range_message(value: int, num_classes: int, ignore_index: int) -> str:
    """The ``ValueError`` text for an out-of-range target, the same from every backend."""
    return (f"target value {value} is out of range for {num_classes} classes "
            f"(valid: 0..{num_classes - 1}, or ignore_index={ignore_index})")


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
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
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
        # One reduction answers the common case (every target a class index); only a batch with ignored rows or a bad
        # value pays for the exact check. This runs on every call, and the exact check alone was ~5x the cost.
        low, high = (int(v) for v in torch.aminmax(target1d))
        if low >= 0 and high < num_classes:
            return logits2d, target1d, batch_shape
        bad = out_of_range_targets(target1d, num_classes, ignore_index)
        if bool(bad.any()):
            raise ValueError(out_of_range_message(int(target1d[bad][0]), num_classes, ignore_index))
    return logits2d, target1d, batch_shape


def check_sample_weight(sample_weight, weight: str, target_shape, device, *,
                        check_values: bool = True) -> torch.Tensor | None:
    """``sample_weight`` is required by, and only allowed with, ``weight="external"``; returned flattened."""
    if weight != "external":
        if sample_weight is not None:
            raise ValueError(f"sample_weight is only used with weight='external', not weight={weight!r}")
        return None
    if sample_weight is None:
        raise ValueError("weight='external' needs a sample_weight tensor of the target's shape")
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
    if check_values and not torch.compiler.is_compiling() and not bool(
            ((sample_weight >= 0) & sample_weight.isfinite()).all()):
        raise ValueError("sample_weight must be finite and >= 0 everywhere (it scales each row's loss and gradient)")
    return sample_weight.reshape(-1)


def check_per_sample_gamma(gamma, weight: str, target_shape, device, *, check_values: bool = True):
    """A tensor gamma (one exponent per row, e.g. from a γ-Net) is flattened; only the focal weight accepts it."""
    if not isinstance(gamma, torch.Tensor):
        return float(gamma)
    if weight != "focal":
        raise ValueError(f"a per-sample gamma tensor is only supported with weight='focal', not {weight!r}")
    if tuple(gamma.shape) != tuple(target_shape):
        raise ValueError(f"per-sample gamma shape {tuple(gamma.shape)} does not match target shape {tuple(target_shape)}")
    if gamma.device != device:
        raise ValueError(f"per-sample gamma is on {gamma.device} but logits are on {device}")
    if check_values and not torch.compiler.is_compiling() and not bool(((gamma >= 0) & gamma.isfinite()).all()):
        raise ValueError("per-sample gamma must be finite and >= 0 everywhere")
    return gamma.reshape(-1)


@dataclass(frozen=True)
class LossInputs:
    """Validated, flattened arguments of ``uncertainty_weighted_ce``, as every backend receives them."""

    logits: torch.Tensor  # (N, C), any float dtype, rows may be strided
    target: torch.Tensor  # (N,) int64
    weight: str
    mode: str
    gamma: float | torch.Tensor  # scalar, or (N,) per-sample (focal only)
    norm: float
    sample_weight: torch.Tensor | None  # (N,) for weight="external"
    reduction: str
    ignore_index: int
    batch_shape: tuple  # leading shape of the input, to reshape reduction="none" results


def check_loss_inputs(
    logits,
    target,
    *,
    weight="brier",
    mode="grad",
    gamma=4.0,
    norm=2.0,
    sample_weight=None,
    reduction="mean",
    ignore_index=-100,
    check_values: bool = True,
) -> LossInputs:
    """Validate every argument of ``uncertainty_weighted_ce``; return them flattened as :class:`LossInputs`.

    ``check_values=False`` skips the checks that read tensor values (a device synchronisation on GPU), for backends
    whose kernels check the targets on the device.
    """
    check_weight(weight)
    check_mode(mode)
    check_reduction(reduction)
    check_gamma(gamma)
    check_norm(norm)
    logits2d, target1d, batch_shape = check_logits_target(
        logits, target, ignore_index=ignore_index, check_values=check_values
    )
    sample_weight = check_sample_weight(sample_weight, weight, target.shape, logits.device, check_values=check_values)
    gamma = check_per_sample_gamma(gamma, weight, target.shape, logits.device, check_values=check_values)
    return LossInputs(
        logits2d, target1d, weight, mode, gamma, float(norm), sample_weight, reduction, ignore_index, batch_shape
    )
