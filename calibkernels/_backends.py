"""Which implementations of the loss family this install can run, and how ``backend="auto"`` chooses one.

Each compiled backend is a module exposing ``is_available(name, device) -> str | None`` (``None`` when it can run on
that device, otherwise the reason it cannot) and the ``forward`` of :mod:`calibkernels._autograd`, which runs all of
them through one autograd definition; the reference runs its own PyTorch graph. Backends are imported lazily:
``import calibkernels`` never fails and stays fast when Triton or the compiled extension is missing.
"""

from __future__ import annotations

import importlib
import warnings

import torch

from . import _autograd
from ._validation import LossInputs, check_backend, one_hot_for_dual_focal
from .reference import uncertainty_weighted_ce_from_inputs

# backend name -> module implementing it (relative to the calibkernels package)
_BACKEND_MODULES = {
    "cpu": ".cpp.uncertainty_weighted_ce",
    "cuda": ".cpp.uncertainty_weighted_ce",
    "triton": ".triton.uncertainty_weighted_ce",
}

# What "auto" tries, fastest first, per device type; the reference is the last resort everywhere. On CUDA tensors an
# eager call first asks AUTO_CUDA_MAX_CLASSES (resolve_for_shape).
_AUTO_ORDER = {"cuda": ("triton", "cuda"), "cpu": ("cpu",)}

# backend="auto" on CUDA tensors, eager calls: the CUDA C++ kernel for rows of at most this many classes, Triton for
# wider rows, per target kind ("hard": class indices; "smooth": class indices with label smoothing; "mix": a mix of two
# class indices, smoothed or not; "dense": a probability row per sample). The thresholds were measured on an NVIDIA
# H100 at N = 8192 in bf16; the table in docs/performance.md ("backend='auto' on the GPU") has the numbers. Under
# torch.compile the choice is a constant of the graph made without the shape, so _AUTO_ORDER decides there.
AUTO_CUDA_MAX_CLASSES = {"hard": 4096, "smooth": 4096, "mix": 32000, "dense": 1000}


# A plain dict rather than functools.lru_cache: torch.compile traces through lru_cache wrappers (into
# importlib, a graph break) but reads an already-filled dict; `resolve` fills it before `run` is traced.
_loaded_modules: dict = {}


def _module(name: str):
    """Import a backend's module; return ``(module, None)`` or ``(None, reason)``."""
    if name not in _loaded_modules:
        try:
            _loaded_modules[name] = importlib.import_module(_BACKEND_MODULES[name], __package__), None
        except Exception as exc:  # a missing compiled part or Triton must not break the package
            _loaded_modules[name] = None, f"{type(exc).__name__}: {exc}"
    return _loaded_modules[name]


def unavailable_reason(name: str, device: torch.device) -> str | None:
    """``None`` if backend ``name`` can run on ``device``, else a human-readable reason."""
    if name == "reference":
        return None  # pure PyTorch: every device and dtype
    module, reason = _module(name)
    if module is None:
        return reason
    return module.is_available(name, torch.device(device))


def available_backends() -> list[str]:
    """Backends this install can run on some device of this machine (``"reference"`` is always there)."""
    devices = [torch.device("cpu")]
    if torch.cuda.is_available():
        devices.append(torch.device("cuda"))
    return [
        name for name in ("reference", "cpu", "cuda", "triton")
        if any(unavailable_reason(name, d) is None for d in devices)
    ]


_warned_fallback: set[str] = set()


# Under torch.compile the choice is made once, eagerly, at trace time (the result is a constant of the graph).
@torch.compiler.assume_constant_result
def resolve(backend: str, device: torch.device) -> str:
    """Pick the backend that will run; a named backend that cannot run raises, it never silently substitutes."""
    check_backend(backend)
    if backend != "auto":
        reason = unavailable_reason(backend, device)
        if reason is not None:
            raise RuntimeError(
                f"calibkernels backend {backend!r} is not available for {device.type} tensors: {reason}. "
                f"Available here: {available_backends()}"
            )
        return backend
    reasons = []
    for name in _AUTO_ORDER.get(device.type, ()):
        reason = unavailable_reason(name, device)
        if reason is None:
            return name
        reasons.append(f"{name}: {reason}")
    if device.type not in _warned_fallback:
        _warned_fallback.add(device.type)
        why = "; ".join(reasons) if reasons else f"no compiled kernel for {device.type}"
        warnings.warn(
            f"calibkernels: no fused kernel available for {device.type} tensors ({why}); "
            "falling back to the pure-PyTorch reference (slower, more memory).",
            RuntimeWarning,
            stacklevel=3,
        )
    return "reference"


_warned_soft_targets = False


@torch.compiler.assume_constant_result
def resolve_soft_targets(backend: str, device: torch.device, gamma_needs_grad: bool = False) -> str:
    """The backend for soft targets (label smoothing, a mix, dense probabilities): as :func:`resolve`, among the
    backends whose module sets ``SOFT_TARGETS``. A per-sample ``gamma`` that requires grad has its gradient only on
    the reference with soft targets. ``"auto"`` falls back to the reference with one ``RuntimeWarning`` per process;
    a named fused backend that cannot run them raises ``NotImplementedError`` rather than running something else."""
    global _warned_soft_targets
    name = resolve(backend, device)
    if name == "reference":
        return name
    why = None
    if not getattr(module(name), "SOFT_TARGETS", False):
        why = "does not support soft targets (label_smoothing > 0, mix_target/mix_lambda, or a dense target)"
    elif gamma_needs_grad:
        why = "has no gradient for a per-sample gamma with soft targets"
    if why is None:
        return name
    if backend != "auto":
        raise NotImplementedError(f"calibkernels backend {backend!r} {why}: use backend='reference' (or 'auto', "
                                  "which runs it)")
    if not _warned_soft_targets:
        _warned_soft_targets = True
        warnings.warn(f"calibkernels: the fused {name!r} kernel {why}; running the pure-PyTorch reference "
                      "(slower, more memory).", RuntimeWarning, stacklevel=3)
    return "reference"


def target_kind(soft: bool, dense: bool, mix: bool) -> str:
    """The row of :data:`AUTO_CUDA_MAX_CLASSES` for a call: class indices ("hard") unless it asks for soft targets,
    then a dense target, a mix (smoothed or not) or label smoothing alone."""
    return "hard" if not soft else "dense" if dense else "mix" if mix else "smooth"


def auto_prefers_cuda(num_classes: int, kind: str) -> bool:
    """Whether ``backend="auto"`` runs rows of ``num_classes`` classes with target kind ``kind`` ("hard", "smooth",
    "mix" or "dense") on the CUDA C++ kernel rather than Triton (:data:`AUTO_CUDA_MAX_CLASSES`)."""
    return num_classes <= AUTO_CUDA_MAX_CLASSES[kind]


def resolve_for_shape(backend: str, device: torch.device, num_classes: int, kind: str,
                      gamma_needs_grad: bool = False) -> str:
    """:func:`resolve` (hard targets) or :func:`resolve_soft_targets` (any other ``kind``), except that an
    eager ``backend="auto"`` call on CUDA tensors first takes the GPU kernel :func:`auto_prefers_cuda` names for rows
    of ``num_classes`` classes, where it can run them."""
    if backend == "auto" and device.type == "cuda" and not torch.compiler.is_compiling():
        first = "cuda" if auto_prefers_cuda(num_classes, kind) else "triton"
        if unavailable_reason(first, device) is None and (kind == "hard" or (
                getattr(module(first), "SOFT_TARGETS", False) and not gamma_needs_grad)):
            return first
    if kind == "hard":
        return resolve(backend, device)
    return resolve_soft_targets(backend, device, gamma_needs_grad)


# (backend, device, target kind, gamma needs grad, CUDA kernel preferred) -> backend name, for eager calls
_chosen: dict = {}


def choose_for_call(backend, logits, target, mode, gamma, label_smoothing, mix_target, mix_lambda,
                    options: str | None = None, uncertainty: str | None = None) -> tuple:
    """``(name, cannot_run)``: the backend that runs a call of :func:`calibkernels.uncertainty_weighted_ce` with these
    arguments (:func:`resolve_for_shape`), or ``("reference", error)`` when the named backend cannot run it, so that
    the arguments are checked (as the reference checks them) before ``error`` is raised. Read from the arguments'
    types and shapes only; malformed arguments are left to the checks. Eager choices are kept per (backend, device,
    target kind): the choice costs microseconds a small training step notices. ``options``: the drop-in options the
    call asks for, named for a message (e.g. ``"per-class weights"``); a fused backend runs them where its module
    sets ``OPTIONS_IN_KERNEL`` (not with ``uncertainty="dual_focal"``), otherwise a named fused backend refuses them
    with ``NotImplementedError`` and ``"auto"`` leaves them to the reference with one ``RuntimeWarning``."""
    eager = not torch.compiler.is_compiling()
    if options is not None:
        name, cannot_run = _choose(backend, logits, target, mode, gamma, label_smoothing, mix_target, mix_lambda,
                                   eager)
        return (name, cannot_run) if cannot_run is not None else with_options(name, backend, options, uncertainty)
    # class indices, the common call: kept per (backend, device, row width within the CUDA kernel's)
    common = (eager and type(backend) is str and type(logits) is torch.Tensor and type(target) is torch.Tensor
              and mix_target is None and mix_lambda is None and type(label_smoothing) is float and label_smoothing == 0
              and not target.is_floating_point() and logits.ndim == 2)
    if common:
        # (get_device, -1 on the CPU: a new torch.device per call costs; is_cpu tells the CPU from other devices)
        key = (backend, logits.get_device(), logits.is_cpu, logits.shape[1] <= _CUDA_MAX_HARD)
        name = _chosen_hard.get(key)
        if name is not None:
            return name, None
    name, cannot_run = _choose(backend, logits, target, mode, gamma, label_smoothing, mix_target, mix_lambda, eager)
    if common and cannot_run is None:
        _chosen_hard[key] = name
    return name, cannot_run


# (backend, device index, on the CPU, row width within AUTO_CUDA_MAX_CLASSES["hard"]) -> backend name, for eager
# class-index calls
_chosen_hard: dict = {}
_CUDA_MAX_HARD = AUTO_CUDA_MAX_CLASSES["hard"]


def _choose(backend, logits, target, mode, gamma, label_smoothing, mix_target, mix_lambda, eager) -> tuple:
    """:func:`choose_for_call` beyond the common call."""
    is_tensor = isinstance(logits, torch.Tensor)
    device = logits.device if is_tensor else torch.device("cpu")
    dense = isinstance(target, torch.Tensor) and target.is_floating_point()
    mix = mix_target is not None or mix_lambda is not None
    soft = dense or mix or not (type(label_smoothing) in (float, int) and label_smoothing == 0)
    # only "loss" mode differentiates the weight, hence a per-sample gamma (the kernels' soft rows do not)
    gamma_needs_grad = bool(soft and mode == "loss" and isinstance(gamma, torch.Tensor) and gamma.requires_grad
                            and torch.is_grad_enabled())
    kind = target_kind(soft, dense, mix)
    num_classes = logits.shape[-1] if is_tensor and logits.dim() > 0 else 0
    key = None
    if eager and type(backend) is str:
        key = (backend, device, kind, gamma_needs_grad, device.type == "cuda" and auto_prefers_cuda(num_classes, kind))
        if key in _chosen:
            return _chosen[key], None
    try:
        name = resolve_for_shape(backend, device, num_classes, kind, gamma_needs_grad)
    except RuntimeError as exc:  # NotImplementedError too: a named backend that cannot run this call
        return "reference", exc
    if key is not None:
        _chosen[key] = name
    return name, None


_warned_reference_only: set = set()


def with_options(name: str, backend, options: str | None, uncertainty) -> tuple:
    """``(name, cannot_run)`` for a call asking for the drop-in ``options`` (named for a message; ``None``: none) that
    backend ``name`` would run: ``name`` itself where its module computes them (``OPTIONS_IN_KERNEL``; not with
    ``uncertainty="dual_focal"``), else the reference: ``"auto"`` says so once with a ``RuntimeWarning``, a named
    fused backend gets ``NotImplementedError`` as ``cannot_run``."""
    if options is None or name == "reference" or (
            getattr(module(name), "OPTIONS_IN_KERNEL", False) and uncertainty != "dual_focal"):
        return name, None
    if backend != "auto":
        return "reference", NotImplementedError(
            f"calibkernels backend {backend!r} does not compute {options} for this call: use backend='reference' (or "
            "'auto', which runs it)")
    if options not in _warned_reference_only:
        _warned_reference_only.add(options)
        warnings.warn(f"calibkernels: the fused kernel does not compute {options} for this call; running the "
                      "pure-PyTorch reference (slower, more memory).", RuntimeWarning, stacklevel=4)
    return "reference", None


def module(name: str):
    """The module of backend ``name`` (``None`` if it failed to import; :func:`resolve` checks that first)."""
    return _loaded_modules[name][0] if name in _loaded_modules else _module(name)[0]


def run(backend: str, inputs: LossInputs, inplace: bool, return_stats: bool = False):
    """The loss of checked ``inputs`` on ``backend``; with ``return_stats`` also its :class:`calibkernels.LossStats`
    last (:func:`calibkernels._autograd.run`: from the loss pass where the kernels write them)."""
    if backend == "reference":
        # ``inplace`` lets a kernel overwrite the logits with the gradient; the reference never needs to
        return uncertainty_weighted_ce_from_inputs(inputs, return_stats=return_stats)
    backend_module = _loaded_modules[backend][0]  # resolve imported it
    if inputs.dense or inputs.mix_target is not None or inputs.label_smoothing != 0.0:  # soft targets
        if inputs.uncertainty == "dual_focal":
            inputs = one_hot_for_dual_focal(inputs)  # one-hot targets in a soft form, or the reference's ValueError
        elif not getattr(backend_module, "SOFT_TARGETS", False):  # resolve_soft_targets checked it
            raise NotImplementedError(f"calibkernels backend {backend!r} does not support soft targets: use "
                                      "backend='reference'")
    return _autograd.run(backend_module, inputs, inplace, return_stats)
