"""The loss call's arguments checked and gathered: :class:`LossInputs` (logits ``(..., C)`` flattened to rows
``(N, C)``, class dimension last; targets ``(...)`` to ``(N,)``) and :func:`check_loss_inputs`, with the common call's
few type tests (:func:`_common_call`) before the full checks of :mod:`calibkernels._validation.arguments`."""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace

import torch

from .._kernel_codes import MODE_CODES, REDUCTION_CODES, WEIGHT_CODES
from .._target_checks import DENSE_ROW_SUM_TOLERANCE, is_plain_eager, out_of_range_message, poll
from .arguments import (INT64_MAX, INT64_MIN, _queue_value_check, check_class_weight, check_class_weight_tensor,
                        check_dense_target, check_drop_in_options, check_gamma, check_ignore_index,
                        check_label_smoothing, check_logits_target, check_mix, check_mode, check_norm,
                        check_per_sample_gamma, check_reduction, check_sample_weight, check_uncertainty,
                        soft_target_request, target_flag)


@dataclass(slots=True)
class LossInputs:
    """Validated, flattened arguments of ``uncertainty_weighted_ce``, as every backend receives them."""

    logits: torch.Tensor  # (N, C), any float dtype, rows may be strided
    target: torch.Tensor  # (N,) int64
    uncertainty: str  # the uncertainty weight's name (WEIGHT_CODES)
    mode: str
    gamma: float | torch.Tensor  # scalar, or (N,) per-sample (focal only)
    norm: float
    sample_weight: torch.Tensor | None  # (N,) for uncertainty="external"
    reduction: str
    ignore_index: int
    batch_shape: tuple  # leading shape of the input, to reshape reduction="none" results
    # Soft targets (docs/losses.md, "Soft targets"). `target` is then (N,) int64
    # indices (with `mix_target`/`mix_lambda` and/or `label_smoothing`) or, with `dense`, (N, C) probabilities.
    label_smoothing: float = 0.0
    mix_target: torch.Tensor | None = None  # (N,) int64
    mix_lambda: float | torch.Tensor | None = None  # a number or (N,)
    dense: bool = False
    # F.cross_entropy's and Liger-Kernel's drop-in options (docs/losses.md, "Coming from F.cross_entropy /
    # Liger-Kernel"): per-class weights (`weight=` of the public functions; named apart from the uncertainty weight
    # and sample_weight here), the z-loss s·lse² and its separate return, and logit soft-capping c·tanh(z/c)
    class_weight: torch.Tensor | None = None  # (C,) floating, finite, >= 0, on the logits' device
    lse_square_scale: float = 0.0
    return_z_loss: bool = False
    softcap: float | None = None

    @property
    def soft(self) -> bool:
        """Whether the targets are soft (anything but one-hot class indices)."""
        return self.dense or self.mix_target is not None or self.label_smoothing != 0.0


DUAL_FOCAL_SOFT_MESSAGE = (
    "dual focal has no published soft-target form (its p_j, the largest probability below the target's, needs one "
    "target class), so it takes one-hot targets only: label_smoothing=0 and no mix (or mix_lambda exactly 0 or 1 on "
    "every row); use uncertainty='focal', 'flsd' or 'brier' with soft targets")


def one_hot_for_dual_focal(inputs: LossInputs) -> LossInputs:
    """Dual focal accepts only truly one-hot targets: a mix whose λ is 0 or 1 on every row, or a dense target whose
    rows are one-hot, is turned into class indices; anything else (smoothing, a proper mix) raises ``ValueError``."""
    if inputs.label_smoothing != 0.0:
        raise ValueError(f"uncertainty='dual_focal' with label_smoothing={inputs.label_smoothing}: "
                         f"{DUAL_FOCAL_SOFT_MESSAGE}")
    if inputs.dense:
        t = inputs.target
        if not bool(((t == 0) | (t == 1)).all()):
            raise ValueError(f"uncertainty='dual_focal' with a dense target that is not one-hot: "
                             f"{DUAL_FOCAL_SOFT_MESSAGE}")
        return replace(inputs, target=t.argmax(dim=1), dense=False)
    lam = inputs.mix_lambda
    if isinstance(lam, torch.Tensor):
        valid = inputs.target != inputs.ignore_index
        if not bool((((lam == 0) | (lam == 1)) | ~valid).all()):
            raise ValueError(f"uncertainty='dual_focal' with mix_lambda strictly between 0 and 1: "
                             f"{DUAL_FOCAL_SOFT_MESSAGE}")
        target = torch.where(valid & (lam == 0), inputs.mix_target, inputs.target)
        return replace(inputs, target=target, mix_target=None, mix_lambda=None)
    raise ValueError(f"uncertainty='dual_focal' with soft targets: {DUAL_FOCAL_SOFT_MESSAGE}")


def check_loss_inputs(
    logits,
    target,
    *,
    uncertainty="brier",
    mode="grad",
    gamma=4.0,
    norm=2.0,
    sample_weight=None,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    label_smoothing=0.0,
    mix_target=None,
    mix_lambda=None,
    checked_by: str = "reference",
    check_values: bool | None = None,
    lse_square_scale=0.0,
    return_z_loss=False,
    softcap=None,
    class_weight_supported: bool = False,
) -> LossInputs:
    """Validate every argument of ``uncertainty_weighted_ce``; return them flattened as :class:`LossInputs`.

    ``checked_by`` is the backend that will run the call, which decides where the values of the tensors are checked:

    * on the host, raising at once: the reference, and CPU tensors (each a read of the values, which on a GPU would
      be a device synchronisation);
    * by the kernel itself, with the same errors: the C++ CPU op checks the targets, a mix and a dense target (it
      raises); the GPU kernels flag bad targets, a mix and (on plain eager calls) a dense target on the device;
    * on a GPU otherwise (``sample_weight``, a per-sample ``gamma``): flagged by a few device ops and queued.

    ``check_values`` overrides the first two: ``True`` on the host, ``False`` as on a GPU (tests of the device path).
    The device flags are read by :mod:`calibkernels._target_checks` without stalling the host. A number ``mix_lambda``
    is checked here. A number ``mix_lambda`` of exactly 1 drops the mix (``t = e_target``); exactly 0 replaces the
    target by ``mix_target`` on the non-ignored rows (``t = e_mix_target``): one-hot targets on the hard-target path.

    ``weight`` (per-class weights), ``lse_square_scale``, ``return_z_loss`` and ``softcap``:
    :func:`check_drop_in_options`. A ``weight`` tensor is taken only by a caller that computes class weights
    (``class_weight_supported=True``, the reference); otherwise :func:`check_class_weight` refuses it.
    """
    if (check_values is None and softcap is None and return_z_loss is False and type(lse_square_scale) in (float, int)
            and lse_square_scale == 0):
        common = _common_call(logits, target, uncertainty, mode, gamma, norm, sample_weight, weight, reduction,
                              ignore_index, label_smoothing, mix_target, mix_lambda, checked_by)
        if common is not None:
            return common
    device = logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")
    on_host = (checked_by == "reference" or device.type == "cpu") if check_values is None else check_values
    if not on_host and is_plain_eager(logits):
        poll()  # before this call queues flags of its own: what poll raises belongs to an earlier call
    # the dual-focal weight's soft targets become class indices before any kernel runs (calibkernels._backends), so
    # no kernel sees their values
    in_kernel = uncertainty != "dual_focal" and (checked_by == "cpu" or (
        checked_by in ("triton", "cuda") and device.type == "cuda"))
    return _checked_inputs(
        logits, target, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=norm, sample_weight=sample_weight,
        weight=weight, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
        mix_target=mix_target, mix_lambda=mix_lambda, check_values=on_host, kernel_checks_mix=in_kernel,
        # the CPU op checks a dense target in its sweep; the GPU kernels flag it on plain eager calls (the calls whose
        # flag calibkernels._target_checks reads)
        kernel_checks_dense=in_kernel and (checked_by == "cpu" or is_plain_eager(logits)),
        kernel_checks_targets=checked_by == "cpu", lse_square_scale=lse_square_scale, return_z_loss=return_z_loss,
        softcap=softcap, class_weight_supported=class_weight_supported)


def _common_call(logits, target, uncertainty, mode, gamma, norm, sample_weight, weight, reduction, ignore_index,
                 label_smoothing, mix_target, mix_lambda, checked_by) -> LossInputs | None:
    """The checks of the common call, in a few type tests: ``(N, C)`` floating logits on a fused backend, whose kernel
    checks the target values (the C++ CPU op raises; the Triton and CUDA kernels flag them on the device, the Triton
    interpreter on CPU tensors alike), with ``(N,)`` int64 class indices or a dense
    ``(N, C)`` target that needs no gradient, on one device; numbers for ``gamma``, ``norm`` and ``label_smoothing``;
    no per-sample tensor and no mix. Its :class:`LossInputs`, or ``None`` for anything else, which takes the full
    checks (that also make every error message). Nothing here reads a value. (``get_device`` and ``ndim`` rather
    than ``device`` and ``dim()``: this runs on every call, where each new ``torch.device`` costs.)"""
    if not (type(logits) is torch.Tensor and type(target) is torch.Tensor and sample_weight is None and weight is None
            and mix_target is None and mix_lambda is None and type(uncertainty) is str and type(mode) is str
            and type(reduction) is str and type(gamma) in (float, int) and type(norm) in (float, int)
            and type(ignore_index) is int and type(label_smoothing) in (float, int)):
        return None
    if (uncertainty not in WEIGHT_CODES or uncertainty == "external" or mode not in MODE_CODES
            or reduction not in REDUCTION_CODES or not 0 <= gamma < math.inf or not 0 < norm < math.inf
            or not INT64_MIN <= ignore_index <= INT64_MAX or not 0 <= label_smoothing <= 1 or logits.ndim != 2
            or not logits.is_floating_point() or target.get_device() != logits.get_device() or logits.shape[0] == 0
            or logits.shape[1] == 0 or checked_by == "reference"
            or (uncertainty == "dual_focal" and label_smoothing != 0)):
        return None
    dense = target.is_floating_point()
    if dense:
        # a dense target's values: the CPU op checks them in its sweep, the GPU kernels flag them on plain eager calls
        if (target.shape != logits.shape or target.dtype not in DENSE_ROW_SUM_TOLERANCE or ignore_index != -100
                or uncertainty == "dual_focal" or (target.requires_grad and torch.is_grad_enabled())
                or not (checked_by == "cpu" or is_plain_eager(logits))):
            return None
    elif target.ndim != 1 or target.dtype is not torch.int64 or target.shape[0] != logits.shape[0]:
        return None
    try:
        gamma, norm = float(gamma), float(norm)
    except OverflowError:
        return None  # an int past float's range (e.g. 10**400): the full checks' ValueError
    if logits.is_cuda and is_plain_eager(logits):
        poll()  # raise for a bad target that an earlier call flagged
    return LossInputs(logits, target, uncertainty, mode, gamma, norm, None, reduction, ignore_index,
                      (logits.shape[0],), label_smoothing=float(label_smoothing), dense=dense)



def _checked_inputs(
    logits,
    target,
    *,
    uncertainty,
    mode,
    gamma,
    norm,
    sample_weight,
    weight,
    reduction,
    ignore_index,
    check_values: bool,
    label_smoothing,
    mix_target,
    mix_lambda,
    kernel_checks_mix: bool,
    kernel_checks_dense: bool,
    kernel_checks_targets: bool,
    lse_square_scale,
    return_z_loss,
    softcap,
    class_weight_supported: bool,
) -> LossInputs:
    """Every check of :func:`check_loss_inputs`. ``check_values=True`` reads the tensors' values on the host and
    raises at once; ``False`` flags them on the device and queues the flags. ``kernel_checks_mix`` /
    ``kernel_checks_dense`` / ``kernel_checks_targets``: the kernel checks a mix's values, a dense target's, the class
    indices' itself, with the same errors."""
    if class_weight_supported and not isinstance(weight, str):
        class_weight = weight  # checked with the logits (check_class_weight_tensor)
    else:
        check_class_weight(weight)
        class_weight = None
    drop_in = check_drop_in_options(lse_square_scale=lse_square_scale, return_z_loss=return_z_loss, softcap=softcap)
    check_uncertainty(uncertainty)
    check_mode(mode)
    check_reduction(reduction)
    check_ignore_index(ignore_index)  # for a dense target too, which has no row to ignore
    check_gamma(gamma)
    check_norm(norm)
    smoothing = check_label_smoothing(label_smoothing)
    soft_target_request(target, smoothing, mix_target, mix_lambda)  # argument-level checks
    if isinstance(target, torch.Tensor) and target.is_floating_point() and isinstance(logits, torch.Tensor):
        if mix_target is not None:
            raise ValueError("mix_target/mix_lambda mix class-index targets; mix a dense target yourself "
                             "(t = lam t_a + (1 - lam) t_b) and pass the result as target")
        if not logits.is_floating_point():
            raise TypeError(f"logits must be a floating-point tensor, got {logits.dtype}")
        if logits.dim() < 2:
            raise ValueError(f"logits must have at least 2 dimensions (..., C), got shape {tuple(logits.shape)}")
        if logits.shape[-1] == 0:
            raise ValueError("logits have zero classes")
        if logits.numel() == 0:
            raise ValueError("empty batch: logits have no rows")
        target2d = check_dense_target(logits, target, ignore_index, check_values=not kernel_checks_dense)
        logits2d = logits if logits.dim() == 2 else logits.reshape(-1, logits.shape[-1])
        batch_shape = tuple(logits.shape[:-1])
        sample_weight = check_sample_weight(sample_weight, uncertainty, batch_shape, logits.device,
                                            check_values=check_values)
        gamma = check_per_sample_gamma(gamma, uncertainty, batch_shape, logits.device, check_values=check_values)
        drop_in["class_weight"] = check_class_weight_tensor(class_weight, logits, check_values=check_values)
        return LossInputs(logits2d, target2d, uncertainty, mode, gamma, float(norm), sample_weight, reduction,
                          ignore_index, batch_shape, label_smoothing=smoothing, dense=True, **drop_in)
    logits2d, target1d, batch_shape = check_logits_target(logits, target, ignore_index=ignore_index,
                                                          check_values=check_values and not kernel_checks_targets)
    drop_in["class_weight"] = check_class_weight_tensor(class_weight, logits, check_values=check_values)
    sample_weight = check_sample_weight(sample_weight, uncertainty, target.shape, logits.device,
                                        check_values=check_values)
    gamma = check_per_sample_gamma(gamma, uncertainty, target.shape, logits.device, check_values=check_values)
    mix1d = lam = None
    if mix_target is not None:
        num_classes = logits.shape[-1]
        mix1d, lam = check_mix(mix_target, mix_lambda, target1d, target.shape, num_classes, ignore_index,
                               logits.device, check_values=check_values, kernel_checks=kernel_checks_mix)
        if not isinstance(lam, torch.Tensor) and lam == 1.0:
            mix1d = lam = None
        elif not isinstance(lam, torch.Tensor) and lam == 0.0:
            if not check_values:
                # The kernel sees only the replaced target, so the given one's range is flagged here (the host path
                # checked it in check_logits_target). A bad mix value, already queued by check_mix, is then flagged
                # by the kernel too, as a target value: a second, later error of the same call.
                _queue_value_check(target1d, target_flag, functools.partial(
                    out_of_range_message, num_classes=num_classes, ignore_index=ignore_index), num_classes,
                    ignore_index)
            target1d = torch.where(target1d == ignore_index, target1d, mix1d)
            mix1d = lam = None
    return LossInputs(
        logits2d, target1d, uncertainty, mode, gamma, float(norm), sample_weight, reduction, ignore_index, batch_shape,
        label_smoothing=smoothing, mix_target=mix1d, mix_lambda=lam, **drop_in,
    )
