"""The implementations the loss bench times (providers), whether each can run a case here, and the correctness check.

Providers (Liger-Kernel's naming; :data:`PROVIDERS`): ``calibkernels_cpu``/``_cuda``/``_triton`` (the fused
kernels), the same with ``_inplace``, ``calibkernels`` (``ck.uncertainty_weighted_ce`` with the default backend and,
for the default loss, no keywords: the call a user writes), ``reference`` (eager
:func:`calibkernels.reference.uncertainty_weighted_ce`), ``reference_compiled`` (``torch.compile`` of a function that
calls the reference and then ``.backward()``), and the other libraries' cross-entropies of :mod:`bench.competitors`,
``torch_cross_entropy`` (``F.cross_entropy``) and ``liger_cross_entropy`` (Liger-Kernel), weight ``"none"`` only.
"""

from __future__ import annotations

import importlib.util
import warnings
from dataclasses import dataclass, replace
from typing import Callable

import torch

import calibkernels as ck
from bench.cases import Case, Step, fresh_logits, loss_step, make_inputs, target_call
from bench.competitors import liger_cross_entropy_step, needs_module, torch_cross_entropy_step
from calibkernels import _backends
from calibkernels import _kernel_codes as ck_codes
from calibkernels import reference as ck_reference


@dataclass(frozen=True)
class Provider:
    """One implementation being benchmarked.

    ``make_step(case)`` returns the step function; ``weights`` and ``targets`` restrict the cases it applies to
    (losses and target kinds; ``None``: all); ``requires(device)`` returns ``None`` when it can run on that device,
    else the reason it cannot; ``backend`` names the calibkernels backend a fused provider runs (soft targets need
    one whose module sets ``SOFT_TARGETS``).
    """

    name: str
    label: str
    devices: tuple[str, ...]
    make_step: Callable[[Case], Step]
    requires: Callable[[torch.device], str | None] = lambda device: None
    weights: tuple[str, ...] | None = None
    inplace: bool = False
    targets: tuple[str, ...] | None = None
    backend: str | None = None

    def applies_to(self, case: Case, any_weight: bool = False) -> bool:
        """Whether the provider runs ``case``: its device and target kind, and its loss unless ``any_weight``
        (host-step suites pair providers of different losses on purpose)."""
        return (case.device in self.devices and (self.targets is None or case.target in self.targets)
                and (any_weight or self.weights is None or case.weight in self.weights))

    def computed_case(self, case: Case) -> Case:
        """The case this provider actually computes (plain cross-entropy for a ``weights=("none",)`` provider)."""
        if self.weights is None or case.weight in self.weights:
            return case
        return replace(case, weight=self.weights[0])


def _backend_step(backend: str, inplace: bool) -> Callable[[Case], Step]:
    def make(case: Case) -> Step:
        return loss_step(ck.uncertainty_weighted_ce, case, uncertainty=case.weight, mode=case.mode, backend=backend,
                         inplace=inplace)

    return make


def _default_call_step(case: Case) -> Step:
    """``ck.uncertainty_weighted_ce(logits, target)`` as a user writes it: default backend, and no keywords at all
    for the default loss (BSCE-GRA) but the soft target's."""
    default_loss = (case.weight, case.mode) == (ck_codes.DEFAULT_WEIGHT, ck_codes.DEFAULT_MODE)
    if default_loss and case.target == "hard":
        def step(logits, target):
            loss = ck.uncertainty_weighted_ce(logits, target)
            loss.backward()
            return loss

        return step
    keywords = {} if default_loss else {"uncertainty": case.weight, "mode": case.mode}
    return loss_step(ck.uncertainty_weighted_ce, case, **keywords)


def _reference_eager(case: Case) -> Step:
    return loss_step(ck_reference.uncertainty_weighted_ce, case, uncertainty=case.weight, mode=case.mode)


def _reference_compiled(case: Case) -> Step:
    # A fresh Dynamo cache per case: every case gets its own static-shape graph (no dynamic-shape recompile after
    # the first shape, no recompile limit across the ~12 cases of a suite).
    torch._dynamo.reset()
    # Dynamo compiles the forward (with its AOTAutograd backward) and graph-breaks at .backward(), which then runs
    # the compiled backward graph: "torch.compile of the reference" as a user would write it.
    return torch.compile(_reference_eager(case))


def _needs_backend(name: str) -> Callable[[torch.device], str | None]:
    return lambda device: _backends.unavailable_reason(name, device)


def _needs_compile(device: torch.device) -> str | None:
    if device.type == "cuda" and importlib.util.find_spec("triton") is None:
        return "torch.compile on CUDA needs triton"
    return None


PROVIDERS: dict[str, Provider] = {
    p.name: p
    for p in [
        Provider("calibkernels_cpu", "calibkernels C++ (cpu)", ("cpu",), _backend_step("cpu", False),
                 _needs_backend("cpu"), backend="cpu"),
        Provider("calibkernels_cpu_inplace", "calibkernels C++ (cpu), inplace", ("cpu",), _backend_step("cpu", True),
                 _needs_backend("cpu"), inplace=True, backend="cpu"),
        Provider("calibkernels_triton", "calibkernels Triton", ("cuda",), _backend_step("triton", False),
                 _needs_backend("triton"), backend="triton"),
        Provider("calibkernels_triton_inplace", "calibkernels Triton, inplace", ("cuda",),
                 _backend_step("triton", True), _needs_backend("triton"), inplace=True, backend="triton"),
        Provider("calibkernels_cuda", "calibkernels CUDA C++", ("cuda",), _backend_step("cuda", False),
                 _needs_backend("cuda"), backend="cuda"),
        Provider("calibkernels_cuda_inplace", "calibkernels CUDA C++, inplace", ("cuda",),
                 _backend_step("cuda", True), _needs_backend("cuda"), inplace=True, backend="cuda"),
        Provider("calibkernels", "ck.uncertainty_weighted_ce, default backend", ("cpu", "cuda"),
                 _default_call_step),
        Provider("reference", "eager reference", ("cpu", "cuda"), _reference_eager),
        Provider("reference_compiled", "torch.compile(reference)", ("cpu", "cuda"), _reference_compiled,
                 _needs_compile),
        Provider("torch_cross_entropy", "F.cross_entropy", ("cpu", "cuda"), torch_cross_entropy_step,
                 weights=("none",)),
        Provider("liger_cross_entropy", "Liger-Kernel cross-entropy", ("cuda",), liger_cross_entropy_step,
                 needs_module("liger_kernel"), weights=("none",), inplace=True, targets=("hard", "smooth")),
    ]
}


def unavailable_reason(provider: Provider, case: Case, any_weight: bool = False) -> str | None:
    """``None`` if ``provider`` can run ``case`` here, else why not (no GPU, backend not built, not installed, no
    soft targets in that backend yet)."""
    if not provider.applies_to(case, any_weight):
        return f"{provider.name} does not apply to {case.id}"
    if case.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    reason = provider.requires(torch.device(case.device))
    if reason is None and case.target != "hard" and provider.backend is not None:
        if not getattr(_backends.module(provider.backend), "SOFT_TARGETS", False):
            reason = f"the {provider.backend!r} backend does not support soft targets"
    return reason


def build_step(provider: Provider, case: Case, any_weight: bool = False) -> Step:
    reason = unavailable_reason(provider, case, any_weight)
    if reason is not None:
        raise RuntimeError(f"provider {provider.name!r} cannot run {case.id}: {reason}")
    return provider.make_step(case)


def backend_target_kind(case: Case) -> str:
    """The target kind ``calibkernels._backends`` chooses a backend by (``target_kind``: ``"hard"``, ``"smooth"``,
    ``"mix"`` or ``"dense"``) for a case's :data:`~bench.cases.TARGET_KINDS` entry: ``"mix_smooth"`` is a mix
    there."""
    return _backends.target_kind(case.target != "hard", case.target == "dense", case.target in ("mix", "mix_smooth"))


def resolved_backend(provider: Provider, case: Case) -> str | None:
    """The backend the ``calibkernels`` provider's call runs on this case: ``backend="auto"`` resolved as the eager
    call resolves it (``_backends.resolve_for_shape``: on CUDA the kernel measured faster for the row width and target
    kind, ``AUTO_CUDA_MAX_CLASSES``), not merely the device's first backend."""
    if provider.name != "calibkernels":
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return _backends.resolve_for_shape("auto", torch.device(case.device), case.c, backend_target_kind(case))
        except Exception:  # noqa: BLE001 - a label, never a reason to fail
            return None


# ----------------------------------------------------------------------------------------------------------------
# Correctness (used by tests/test_bench_providers.py)
# ----------------------------------------------------------------------------------------------------------------
def check_provider(provider: Provider, case: Case, seed: int = 0, step: Step | None = None
                   ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Run one step of ``provider`` and of the float64 reference on the same inputs (a soft case: the same soft
    target, its keywords passed to the reference).

    Returns ``(loss, grad, ref_loss, ref_grad)``; the provider's values are in the logits' dtype, the reference's in
    float64 (the inputs cast exactly to float64), so callers can compare with a tolerance suited to the dtype.
    """
    step = step or build_step(provider, case)
    leaf, target = make_inputs(case, seed)
    loss = step(fresh_logits(leaf), target)
    grad = leaf.grad.detach().clone()
    leaf.grad = None
    exact = leaf.detach().double().requires_grad_()
    ref_target, soft_kwargs = target_call(target)  # the same soft arguments (λ and a dense target as given)
    ref_loss = ck_reference.uncertainty_weighted_ce(exact, ref_target, uncertainty=case.weight, mode=case.mode,
                                                    **soft_kwargs)
    ref_loss.backward()
    return loss.detach(), grad, ref_loss.detach(), exact.grad


def check_tolerance(dtype: str) -> tuple[float, float]:
    """``(rtol, atol)`` for a provider's loss and gradient against :func:`check_provider`'s float64 reference: fp32,
    or a 16-bit dtype, which loses ~3 significant digits in the gradient's single rounding."""
    return (1e-4, 1e-6) if dtype == "fp32" else (2e-2, 1e-4)
