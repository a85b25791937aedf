"""Functional API: validate once, pick a backend, run it (docs/losses.md)."""

from __future__ import annotations

import torch

from . import _autograd, _backends, _target_checks
from . import reference as _reference
from ._kernel_codes import MODE_CODES, REDUCTION_CODES, WEIGHT_CODES
from ._validation import INT64_MAX, INT64_MIN, check_loss_inputs, soft_target_request

__all__ = ["uncertainty_weighted_ce", "bsce_gra_loss", "brier_loss", "label_smoothing_loss", "mmce_loss"]


def uncertainty_weighted_ce(
    logits: torch.Tensor,
    target: torch.Tensor,
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
    inplace: bool = False,
    label_smoothing: float = 0.0,
    mix_target: torch.Tensor | None = None,
    mix_lambda: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Uncertainty-weighted cross-entropy ``L_i = u_i · CE_i``, fused (softmax + weight + CE + backward in one pass).

    ``mode="grad"`` (default, the GRA losses) uses ``sg[u_i]``: gradient ``u_i (p_i - e_{y_i})``.
    ``mode="loss"`` differentiates through ``u_i`` as the classic focal / dual-focal / BSCE losses do.
    The weights ``u(p, y)`` are listed in :mod:`calibkernels.reference`; the defaults (``uncertainty="brier"``,
    ``gamma=4``, ``norm=2``, ``mode="grad"``) are BSCE-GRA as run in the BSCE-GRA paper.

    Args:
        logits: ``(..., C)`` float32/float16/bfloat16 (float64 on the reference), class dimension last.
        target: ``(...)`` int64 class indices in ``[0, C)`` or ``ignore_index``; or a floating ``(..., C)`` tensor
            of probabilities per row (soft targets, as ``F.cross_entropy`` accepts; no ``ignore_index`` then).
        uncertainty, mode, gamma, norm, sample_weight: see :func:`calibkernels.reference.uncertainty_weighted_ce`.
        weight: reserved for ``F.cross_entropy``'s per-class ``(C,)`` weight tensor (not supported yet): ``None``.
            A string raises ``TypeError`` (the uncertainty weight's keyword is ``uncertainty=``), a tensor
            ``NotImplementedError``.
        label_smoothing: α in [0, 1]; the target becomes ``(1 - α) t + α / C`` (``F.cross_entropy``'s convention).
        mix_target, mix_lambda: mixup / cutmix in O(N): ``t = λ e_target + (1 - λ) e_mix_target`` with
            ``mix_target`` int64 of the target's shape (usually ``target.flip(0)``) and ``λ`` in [0, 1], a number
            or one per row. The fused kernels take these compact forms in one pass (O(N) target data); a dense
            target costs one more read of ``N×C``. ``uncertainty="dual_focal"`` refuses soft targets
            (docs/losses.md, "Soft targets").
        reduction: ``"mean"`` (default; over non-ignored rows, 0 if none), ``"sum"`` or ``"none"``.
        ignore_index: target value whose rows contribute neither loss nor gradient.
        backend: ``"auto"`` (fastest available for the tensors' device; warns once if it must fall back to the
            reference), ``"reference"``, ``"cpu"``, ``"triton"`` or ``"cuda"``. A named backend that cannot run
            raises ``RuntimeError``.
        inplace: allow the kernel to overwrite ``logits`` with the gradient (no extra ``N×C`` memory). The logits
            are garbage afterwards. Backends that do not need to (the reference) leave them intact.

    Returns:
        the loss in the logits' dtype: a scalar, or ``target``-shaped for ``reduction="none"``.
    """
    if (type(logits) is torch.Tensor and type(target) is torch.Tensor and sample_weight is None and weight is None
            and type(inplace) is bool and logits.dim() == 2 and target.device == logits.device
            and not torch.compiler.is_compiling()):
        soft = _fast_soft_arguments(target, uncertainty, label_smoothing, mix_target, mix_lambda)
        if soft is not None:
            loss = _fast_call(logits, target, uncertainty, mode, gamma, norm, reduction, ignore_index, backend, soft,
                              inplace)
            if loss is not None:
                return loss
    device = logits.device if isinstance(logits, torch.Tensor) else torch.device("cpu")
    soft = soft_target_request(target, label_smoothing, mix_target, mix_lambda)
    # only "loss" mode differentiates the weight, hence a per-sample gamma (the kernels' soft rows do not)
    gamma_needs_grad = (soft and mode == "loss" and isinstance(gamma, torch.Tensor) and gamma.requires_grad
                        and torch.is_grad_enabled())
    kind = _backends.target_kind(soft, isinstance(target, torch.Tensor) and target.is_floating_point(),
                                 mix_target is not None)
    # "auto" on CUDA tensors: the kernel measured faster for this row width and target kind (_backends)
    num_classes = logits.shape[-1] if isinstance(logits, torch.Tensor) and logits.dim() > 0 else 0
    try:
        name = _backends.resolve_for_shape(backend, device, num_classes, kind, gamma_needs_grad)
    except RuntimeError as exc:  # NotImplementedError too: a named backend that cannot run this call
        # Bad inputs raise what the reference raises, whichever backend was asked for: the inputs are checked first,
        # on the host as the reference checks them, and this error only once they pass
        name, cannot_run = "reference", exc
    else:
        cannot_run = None
    # On a GPU nothing is read on the host (a synchronisation per call): the kernels flag bad targets on the device,
    # and the values of sample_weight, a per-sample gamma and a mix are flagged by device ops; both are read by
    # calibkernels._target_checks. The reference and CPU tensors check on the host and raise at once.
    host_check = name == "reference" or device.type == "cpu"
    if not host_check and _autograd.is_plain_eager(logits):
        # before this call queues flags of its own: what poll raises belongs to an earlier call
        _target_checks.poll()
    inputs = check_loss_inputs(
        logits, target, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=norm, sample_weight=sample_weight,
        weight=weight,
        reduction=reduction, ignore_index=ignore_index, check_values=host_check, label_smoothing=label_smoothing,
        # a mix's values: the CPU op checks them (raising at once), the GPU kernels in their scan of the targets (in
        # the target flag); the dual-focal weight's soft targets become class indices before any kernel runs
        # (_backends._one_hot_for_dual_focal), so no kernel would see their values: checked here
        mix_target=mix_target, mix_lambda=mix_lambda, kernel_checks_mix=uncertainty != "dual_focal" and (
            name == "cpu" or (name in ("triton", "cuda") and device.type == "cuda")),
        # a dense target's values: the CPU op checks them in its sweep (in place, in a pass of its own before the
        # kernel overwrites the logits); the GPU backends flag them on the device on plain eager calls (the calls
        # whose flag calibkernels._target_checks reads)
        kernel_checks_dense=uncertainty != "dual_focal" and (name == "cpu" or (
            name in ("triton", "cuda") and device.type == "cuda" and _autograd.is_plain_eager(logits))),
    )
    if not isinstance(inplace, bool):
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    if cannot_run is not None:
        raise cannot_run
    return _backends.run(name, inputs, inplace)


def _fast_soft_arguments(target, uncertainty, label_smoothing, mix_target, mix_lambda):
    """The soft-target arguments of :func:`_fast_call` (``()`` for hard targets), or ``None`` when they need the
    general path: dual focal, a λ of exactly 0 or 1, a dense target that requires grad or of another floating dtype,
    a mix on another device than the target, anything its checks would reject. ``target`` is on the logits'
    device."""
    if target.is_floating_point():
        if (mix_target is not None or mix_lambda is not None or target.dtype not in _DENSE_DTYPES
                or (target.requires_grad and torch.is_grad_enabled())):
            return None
    elif mix_target is None and mix_lambda is None:
        if type(label_smoothing) in (float, int) and label_smoothing == 0:  # hard targets, as the general path sees
            return ()
    # (get_device and ndim rather than .device and dim(): a mixed call's checks cost several microseconds otherwise)
    elif not (type(mix_target) is torch.Tensor and mix_target.get_device() == target.get_device()
              and mix_target.dtype is torch.int64 and mix_target.shape == target.shape):
        return None
    elif type(mix_lambda) is float:
        if not 0.0 < mix_lambda < 1.0:
            return None
    elif not (type(mix_lambda) is torch.Tensor and mix_lambda.get_device() == target.get_device()
              and mix_lambda.is_floating_point() and (mix_lambda.ndim == 0 or mix_lambda.shape == target.shape)
              and not mix_lambda.requires_grad):
        return None
    if type(label_smoothing) not in (float, int) or not 0 <= label_smoothing <= 1 or uncertainty == "dual_focal":
        return None
    return mix_target, mix_lambda, float(label_smoothing)


def _fast_call(logits, target, uncertainty, mode, gamma, norm, reduction, ignore_index, backend, soft=(),
               inplace=False):
    """The common eager call, straight into the compiled op and its C++ autograd, or into the Triton kernels: the
    per-call host time of the general path (argument normalisation, backend resolution, the Python target checks) is
    as large as the whole step of ``F.cross_entropy`` at small shapes. The compiled op: on CPU tensors with
    ``backend`` "auto" or "cpu"; on CUDA tensors with "cuda", or "auto" where
    :func:`calibkernels._backends.auto_prefers_cuda` picks the CUDA kernel. The Triton kernels
    (:func:`calibkernels._autograd.run_rows`): on CUDA tensors with "triton", or "auto" where the compiled op does
    not serve the call; on CPU tensors with "triton" under the interpreter (class indices, label smoothing and dense
    targets, not a mix). ``None`` when any argument needs the general path, which also makes every error message.
    The CPU kernel checks the target values itself (the same ValueError as the general path), those of a mix and of
    a dense target (``soft``: see :func:`_fast_soft_arguments`); the CUDA and Triton kernels flag them on the device
    for :mod:`calibkernels._target_checks`, as the general path does on a GPU. ``inplace``: as the general path,
    which refuses logits that are a leaf requiring grad, or a view of one."""
    uncertainty_code = WEIGHT_CODES.get(uncertainty) if type(uncertainty) is str else None
    mode_code = MODE_CODES.get(mode) if type(mode) is str else None
    reduction_code = REDUCTION_CODES.get(reduction) if type(reduction) is str else None
    dense = target.is_floating_point()
    on_gpu = logits.is_cuda
    if type(backend) is not str or (on_gpu and torch._C._len_torch_dispatch_stack() != 0):
        return None  # the general path's error; a dispatch mode must not see the flag's host copy
    # "auto" on CUDA tensors is the CUDA kernel where the measured table prefers it for this row width (_backends),
    # else Triton
    gpu_auto = on_gpu and backend == "auto"
    kernel = "cuda" if gpu_auto else backend
    device_index = logits.get_device() if on_gpu else -1
    served = _FAST_KERNELS.get((on_gpu, logits.is_cpu, kernel, device_index))
    if served is None:
        served = _compiled_kernel(kernel, logits.device)
    if served and gpu_auto and not _backends.auto_prefers_cuda(
            logits.shape[1], _backends.target_kind(bool(soft), dense, bool(soft) and soft[0] is not None)):
        served = False
    triton = False
    if not served and (gpu_auto or backend == "triton"):
        # the Triton kernels, launched from here without the general path's argument normalisation; not for dtypes
        # they do not take (the general path's error), nor for a mix on CPU tensors (the interpreter), whose values
        # the general path checks on the host there (the GPU kernels flag them)
        triton = _FAST_TRITON.get((on_gpu, logits.is_cpu, device_index))
        if triton is None:
            triton = _triton_kernels(logits.device)
        triton = (triton and logits.dtype in _TRITON_DTYPES and (on_gpu or not (soft and soft[0] is not None))
                  and torch._C._len_torch_dispatch_stack() == 0)
    if ((not served and not triton) or uncertainty_code is None or mode_code is None or reduction_code is None
            or uncertainty == "external" or type(gamma) not in (float, int) or not 0 <= gamma < _INF
            or type(norm) not in (float, int) or not 0 < norm < _INF or type(ignore_index) is not int
            or target.shape != (logits.shape if dense else logits.shape[:1])
            or not (ignore_index == -100 if dense else target.dtype == torch.int64)
            or logits.shape[0] == 0 or logits.shape[1] == 0 or not logits.is_floating_point()
            or (soft and served and not getattr(_backends.module("cuda" if on_gpu else "cpu"), "SOFT_TARGETS", False))):
        return None
    if inplace and logits.requires_grad and torch.is_grad_enabled() and _autograd._is_leaf_or_view_of_leaf(logits):
        return None
    try:
        gamma, norm = float(gamma), float(norm)
    except OverflowError:
        return None  # an int past float's range (e.g. 10**400): the general path's ValueError
    if on_gpu:
        _target_checks.poll()  # raise for a bad target that an earlier call flagged
    if triton:
        if not INT64_MIN <= ignore_index <= INT64_MAX:
            return None  # the general path's ValueError: a Triton kernel would take a wider int as uint64
        return _autograd.run_rows(_backends.module("triton"), logits, target, None, gamma, uncertainty_code,
                                  mode_code, norm, ignore_index, reduction_code, soft, inplace)
    try:
        loss, flag = _EAGER_LOSS(logits, target, uncertainty_code, mode_code, gamma, norm, ignore_index,
                                 reduction_code, *(soft or (None, None, 0.0)), inplace)
    except OverflowError:
        # an int the op cannot take (ignore_index outside int64), refused in its argument parsing before it runs:
        # the general path makes the error (a try costs nothing where nothing is raised, a range test would)
        return None
    if on_gpu:
        _target_checks.submit(flag, logits.shape[1], ignore_index, target.dtype if dense else None)
    return loss


_INF = float("inf")
_DENSE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
# (on CUDA, on the CPU, backend, CUDA device index or -1) -> whether _fast_call serves that backend there (per GPU:
# a build may hold no code for one of several); filled on first use
_FAST_KERNELS: dict = {}
_EAGER_LOSS = None  # calibkernels._C.eager_loss, once the extension is known to load
# (on CUDA, on the CPU, CUDA device index or -1) -> whether _fast_call may launch the Triton kernels there; filled on
# first use
_FAST_TRITON: dict = {}
_TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _compiled_kernel(backend, device: torch.device) -> bool:
    """Whether :func:`_fast_call` may run ``backend`` on ``device``: the compiled op's CPU kernel for "auto" and
    "cpu" on the CPU, its CUDA kernel for "cuda" on CUDA tensors (where "auto" asks for "cuda"); cached."""
    global _EAGER_LOSS
    on_gpu = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else -1
    key = (on_gpu, device.type == "cpu", backend, index)
    known = _FAST_KERNELS.get(key)
    if known is None:
        name = device.type if device.type in ("cpu", "cuda") else None
        known = False
        if name is not None and backend in ("auto", name) and _backends.unavailable_reason(name, device) is None:
            # "auto" asks here only on the CPU (_fast_call asks for "cuda" on CUDA tensors): the op where it comes first
            known = backend == name or _backends.resolve("auto", device) == name
            if known:
                from . import _C  # loads: unavailable_reason has imported the backend's module, which imports it

                _EAGER_LOSS = _C.eager_loss
        _FAST_KERNELS[key] = known
    return known


def _triton_kernels(device: torch.device) -> bool:
    """Whether :func:`_fast_call` may launch the Triton kernels on ``device``: CUDA tensors where Triton can run, and
    CPU tensors under the Triton interpreter (so that the tests run this path); cached."""
    on_gpu = device.type == "cuda"
    index = (device.index if device.index is not None else torch.cuda.current_device()) if on_gpu else -1
    known = device.type in ("cpu", "cuda") and _backends.unavailable_reason("triton", device) is None
    _FAST_TRITON[(on_gpu, device.type == "cpu", index)] = known
    return known


def bsce_gra_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    gamma: float = 4.0,
    norm: float = 2.0,
    reduction: str = "mean",
    ignore_index: int = -100,
    backend: str = "auto",
    inplace: bool = False,
    label_smoothing: float = 0.0,
    mix_target: torch.Tensor | None = None,
    mix_lambda: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """BSCE-GRA (BSCE-GRA paper, Eq. 11): ``L_i = sg[‖p_i - e_{y_i}‖_q^γ] · CE_i``.

    The detached generalised Brier score scales the cross-entropy *gradient*: ``∂L_i/∂z_i = ‖p_i - e_{y_i}‖_q^γ
    (p_i - e_{y_i})``, so confident, correct samples stop pushing their logits apart. Defaults γ = 4, q = 2.
    With soft targets ``t`` (``label_smoothing``, ``mix_target``/``mix_lambda``, a dense ``target``) ``e_y``
    becomes ``t``: ``L_i = sg[‖p_i - t_i‖_q^γ] · CE_i``, gradient ``‖p_i - t_i‖_q^γ (p_i - t_i)``
    (see :func:`uncertainty_weighted_ce`).
    """
    return uncertainty_weighted_ce(logits, target, uncertainty="brier", mode="grad", gamma=gamma, norm=norm,
                                   reduction=reduction, ignore_index=ignore_index, backend=backend, inplace=inplace,
                                   label_smoothing=label_smoothing, mix_target=mix_target, mix_lambda=mix_lambda)


# Batch-level and non-CE-weighted members of the family have no fused kernel; they are the reference's.
brier_loss = _reference.brier_loss
label_smoothing_loss = _reference.label_smoothing_loss
mmce_loss = _reference.mmce_loss
