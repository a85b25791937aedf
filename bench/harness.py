"""The one benchmark harness of calibkernels: providers, inputs, timing, peak memory, correctness check, JSON/Markdown.

What is measured (issues 3, 4, 5): one **training step of the loss**, forward + backward, for logits ``(N, C)`` and
int64 targets, i.e. ``loss = f(logits, target); loss.backward()``, until the gradient sits in ``leaf.grad``.

Targets (``Case.target``, :data:`TARGET_KINDS`): ``"hard"`` class indices, or one of the soft forms of docs/losses.md
"Soft targets", built by :func:`make_inputs` from the same class indices: ``"smooth"`` (``label_smoothing=0.1``),
``"mix"`` (``mix_target = target.flip(0)``, one ``mix_lambda`` per row drawn from Beta(0.2, 0.2) with a fixed seed),
``"mix_smooth"`` (both) and ``"dense"`` (the float32 ``(N, C)`` distribution of ``"mix_smooth"``, as
``timm.data.Mixup`` builds it). A soft case's target is a :class:`SoftTarget`; the steps call
``f(logits, soft.target, **soft.kwargs)``. Cases that differ only in their target kind share the logits and are timed
together, interleaved, so a run compares the kinds as it compares providers.

Fairness rules, the same for every provider:

* Each repetition starts from a fresh **non-leaf** copy of the logits, ``logits = leaf.clone()``, made *outside* the
  timed region. It stands in for a layer's output (what the logits are in training), which is what
  ``inplace=True`` requires, and its ``CloneBackward`` passes the gradient through without a copy (autograd's
  ``AccumulateGrad`` then steals it into ``leaf.grad``), so the clone costs no provider anything inside the timed
  region. ``leaf.grad`` is reset to ``None`` before each repetition, so no provider pays for gradient accumulation.
* Timed region: the provider's step (forward + ``backward()``) and, on CUDA, nothing else: CUDA events bracket the
  step on the stream; the L2 cache is flushed (a 256 MiB ``zero_``) before each repetition, as
  ``triton.testing.do_bench`` does. We do not call ``do_bench`` itself because it cannot run an untimed setup
  (the fresh logits copy) before each repetition. Between the flush and the start event the GPU spins
  (``torch.cuda._sleep``) for twice the host's time to issue the step (measured on the last warm-up repetition, with
  the GPU idle) plus 100 µs, at most 20 ms (the margin also covers a clock faster than when the spin was timed): the
  host has issued the whole step by the time the spin ends and the start event runs, so the events time the
  device's work, not the host's launch gaps (at small, host-bound shapes the GPU would otherwise idle between the
  step's kernels while the host issues them). Each CUDA result records that issue time (``host_issue_ms``). On the
  CPU: ``time.perf_counter`` around the step.
* Reported time: the **median** over repetitions, after warm-up repetitions (which also absorb ``torch.compile``'s
  compilation and Triton's JIT). ``torch._dynamo.reset()`` runs before each compiled provider is built, so every
  case gets its own static-shape graph and the recompile limit is never hit.
* Bandwidth: ``2·N·C·bytes / time`` (read the logits once, write the gradient once: the minimum traffic of a fused
  step; target and loss are negligible), plus ``N·C·4`` for a dense float32 target, which is read once. It is an
  "effective" bandwidth: a provider that moves more data than that minimum still gets credit only for the minimum.
* Peak extra memory: the peak of memory allocated during the step **above what existed before it** (the leaf, its
  non-leaf copy and the targets). A fused kernel needs one ``N×C`` buffer (the gradient) and, with ``inplace=True``,
  none (the gradient overwrites the logits copy). Also reported in units of ``N·C·bytes`` ("×NC").

  - CUDA: ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` measured around one step after
    ``reset_peak_memory_stats()``.
  - CPU: CPU tensors have no allocator counters, so one extra (untimed) step runs under
    ``torch.profiler.profile(profile_memory=True)``; its ``[memory]`` records (every allocation ``+bytes`` and free
    ``-bytes`` of the CPU allocator, with time stamps) are sorted by time and the peak of their running sum is the
    peak extra memory. Frees of blocks allocated before the profiler started count as negative (they lower the
    running sum), so the number is "peak above the level at the start". Allocations made on OpenMP worker threads
    are attributed by the allocator to the same process and are recorded too (the profiler's memory reporting hooks
    the allocator, not the operators).

Host-step suites (``Suite(measure="host_step")``, issue #20): the host cost of an eager training step at shapes
where the kernel's work is negligible. Each provider reuses a leaf of its own (the same values for all) and
``leaf.grad`` is set to ``None`` before each step, as a training loop's ``zero_grad(set_to_none=True)`` does, with no
per-step copy, except for an in-place provider (``Provider.inplace``, e.g. Liger, which overwrites its logits with
their gradient): it gets a fresh non-leaf copy per step, the copies of a repetition made before its timer starts (so
it never changes its own or another provider's logits); one repetition times ``k`` back-to-back
steps (``k`` chosen so that a repetition lasts about ``host_rep_ms``) and records the time per step; the providers'
repetitions are interleaved and each provider is also reported as the median of its per-repetition ratios to the
suite's ``baseline`` (pairs measured next to each other in time). Each ``threads`` entry of the suite is a separate
measurement (``None``: the run's default thread count).

Providers (Liger-Kernel's naming; ``PROVIDERS``): ``calibkernels_cpu``/``_cuda``/``_triton`` (the fused kernels),
the same with ``_inplace``, ``calibkernels`` (``ck.uncertainty_weighted_ce`` with the default backend and, for the
default loss, no keywords: the call a user writes), ``reference`` (eager
:func:`calibkernels.reference.uncertainty_weighted_ce`), ``reference_compiled`` (``torch.compile`` of a function that
calls the reference and then ``.backward()``), ``torch_cross_entropy`` (``F.cross_entropy``, weight ``"none"`` only;
with a mix, ``(λ·CE(z, y) + (1 − λ)·CE(z, y2)).mean()`` over per-row cross-entropies) and ``liger_cross_entropy``
(Liger-Kernel's fused cross-entropy, weight ``"none"`` only, hard and ``"smooth"`` targets, CUDA, when
``liger_kernel`` is importable).

Results (:func:`publish`): ``<suite>-<device>-<date>.json`` and ``.md`` in ``bench/results/`` (or ``--results-dir``),
replacing the earlier files of the same suite and device, and one row per measured case appended to
``history.jsonl`` in the format of bench/README.md. A run stopped by SIGINT (a wall-clock limit) still writes them,
with the cases measured before it and ``meta.complete`` false (:class:`RunInterrupted`), then re-raises.

Bench files (``bench/bench_*.py``) only declare suites (cases × providers) and call :func:`main` or
:func:`run_pytest_benchmark`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import itertools
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import _backends
from calibkernels import _codes as ck_codes
from calibkernels import reference as ck_reference

__all__ = [
    "Case",
    "SoftTarget",
    "TARGET_KINDS",
    "Provider",
    "Suite",
    "Result",
    "PROVIDERS",
    "DTYPES",
    "make_inputs",
    "soft_target",
    "unavailable_reason",
    "build_step",
    "time_steps",
    "time_step",
    "time_host_steps",
    "bench_case",
    "bench_cases",
    "bench_host_case",
    "time_fn",
    "rows_to_markdown",
    "peak_extra_memory",
    "check_provider",
    "check_tolerance",
    "bench_one",
    "run_suites",
    "machine_info",
    "device_label",
    "device_slug",
    "write_json",
    "markdown_table",
    "HISTORY_FIELDS",
    "HISTORY_FIELDS_V1",
    "history_rows",
    "append_history",
    "publish",
    "RunInterrupted",
    "backend_target_kind",
    "gpu_sleep_cycles",
    "package_version",
    "main",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MB = 1e6  # reported memory is in MB (10^6 bytes), bandwidth in GB/s (10^9 bytes/s)
REPO_ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = REPO_ROOT / "bench" / "results"
MEASURES = ("step", "host_step")
# Target kinds (Case.target): class indices, and the soft forms of docs/losses.md "Soft targets" (make_inputs)
TARGET_KINDS = ("hard", "smooth", "mix", "mix_smooth", "dense")
LABEL_SMOOTHING = 0.1  # label_smoothing of the "smooth" and "mix_smooth" kinds (and in the "dense" distribution)
MIX_ALPHA = 0.2  # the mixes' per-row lambda ~ Beta(MIX_ALPHA, MIX_ALPHA) (mixup's alpha for ImageNet)
DENSE_TARGET_DTYPE = torch.float32  # what timm.data.Mixup builds, whatever the logits' dtype


# ----------------------------------------------------------------------------------------------------------------
# Cases, providers, suites
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One benchmark input: logits ``(n, c)`` of ``dtype`` on ``device``, loss ``weight``/``mode`` (mean reduction),
    targets of kind ``target`` (:data:`TARGET_KINDS`)."""

    n: int
    c: int
    dtype: str = "fp32"  # a key of DTYPES
    weight: str = "brier"
    mode: str = "grad"
    device: str = "cpu"
    target: str = "hard"  # a kind of TARGET_KINDS

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if self.target not in TARGET_KINDS:
            raise ValueError(f"unknown target kind {self.target!r}; expected one of {TARGET_KINDS}")
        if self.n <= 0 or self.c <= 0:
            raise ValueError(f"N and C must be positive, got ({self.n}, {self.c})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def id(self) -> str:
        """``<device>-<N>x<C>-<dtype>-<weight>-<mode>``, then ``-<target>`` for a soft target kind (hard cases keep the
        ids of the runs before target kinds existed)."""
        suffix = "" if self.target == "hard" else f"-{self.target}"
        return f"{self.device}-{self.n}x{self.c}-{self.dtype}-{self.weight}-{self.mode}{suffix}"

    @property
    def hard(self) -> "Case":
        """The same case with class-index targets."""
        return self if self.target == "hard" else replace(self, target="hard")

    @property
    def nc_bytes(self) -> int:
        """Bytes of one ``N×C`` buffer in the logits' dtype."""
        return self.n * self.c * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def min_traffic_bytes(self) -> int:
        """``2·N·C·bytes``: read the logits once, write the gradient once; plus the dense target, read once."""
        dense = self.n * self.c * DENSE_TARGET_DTYPE.itemsize if self.target == "dense" else 0
        return 2 * self.nc_bytes + dense


# A step takes (logits, target) and runs forward + backward; it returns the loss tensor (callers detach it: a detach
# inside the step would be timed). ``target`` is what make_inputs made for the case: the int64 class indices for a
# hard case, a SoftTarget for a soft one.
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


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


@dataclass(frozen=True)
class Suite:
    """Cases crossed with providers (each provider runs the cases it applies to).

    ``measure="step"``: the timed training step of the module docstring (fresh non-leaf logits per repetition).
    ``measure="host_step"``: the host cost of back-to-back eager steps on one reused leaf (see the module docstring):
    every provider runs every case whatever its loss, once per entry of ``threads`` (``None``: the run's default
    thread count), compared per repetition with ``baseline``; ``reps`` is the suite's default number of repetitions
    (``--reps`` overrides it).
    """

    name: str
    cases: tuple[Case, ...]
    providers: tuple[str, ...]
    measure: str = "step"
    threads: tuple[int | None, ...] = (None,)
    baseline: str | None = None
    reps: int | None = None

    def __post_init__(self):
        if self.measure not in MEASURES:
            raise ValueError(f"unknown measure {self.measure!r}; expected one of {MEASURES}")
        if self.baseline is not None and self.baseline not in self.providers:
            raise ValueError(f"baseline {self.baseline!r} is not one of the suite's providers {self.providers}")


def _loss_step(loss_fn: Callable[..., torch.Tensor], case: Case, **keywords) -> Step:
    """The step ``loss_fn(logits, target, **keywords).backward()``; for a soft case the target is a
    :class:`SoftTarget`, and the call is ``loss_fn(logits, soft.target, **keywords, **soft.kwargs)``."""
    if case.target == "hard":
        def step(logits, target):
            loss = loss_fn(logits, target, **keywords)
            loss.backward()
            return loss
    else:
        def step(logits, soft):
            loss = loss_fn(logits, soft.target, **keywords, **soft.kwargs)
            loss.backward()
            return loss

    return step


def _backend_step(backend: str, inplace: bool) -> Callable[[Case], Step]:
    def make(case: Case) -> Step:
        return _loss_step(ck.uncertainty_weighted_ce, case, weight=case.weight, mode=case.mode, backend=backend,
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
    keywords = {} if default_loss else {"weight": case.weight, "mode": case.mode}
    return _loss_step(ck.uncertainty_weighted_ce, case, **keywords)


def _reference_eager(case: Case) -> Step:
    return _loss_step(ck_reference.uncertainty_weighted_ce, case, weight=case.weight, mode=case.mode)


def _reference_compiled(case: Case) -> Step:
    # A fresh Dynamo cache per case: every case gets its own static-shape graph (no dynamic-shape recompile after
    # the first shape, no recompile limit across the ~12 cases of a suite).
    torch._dynamo.reset()
    # Dynamo compiles the forward (with its AOTAutograd backward) and graph-breaks at .backward(), which then runs
    # the compiled backward graph: "torch.compile of the reference" as a user would write it.
    return torch.compile(_reference_eager(case))


def _mixed_cross_entropy(logits, target, *, mix_target, mix_lambda, label_smoothing=0.0):
    """Mixup's compact loss in plain PyTorch with one λ per row: ``mean_i(λ_i CE(z_i, y_i) + (1 − λ_i) CE(z_i,
    y2_i))``, the per-row form of ``lam * F.cross_entropy(z, y) + (1 - lam) * F.cross_entropy(z, y2)``."""
    first = F.cross_entropy(logits, target, reduction="none", label_smoothing=label_smoothing)
    second = F.cross_entropy(logits, mix_target, reduction="none", label_smoothing=label_smoothing)
    return (mix_lambda * first + (1 - mix_lambda) * second).mean()


def _torch_cross_entropy(case: Case) -> Step:
    if case.target == "hard":
        def step(logits, target):
            loss = F.cross_entropy(logits, target)
            loss.backward()
            return loss

        return step
    if case.target in ("mix", "mix_smooth"):
        return _loss_step(_mixed_cross_entropy, case)
    # "smooth": F.cross_entropy(logits, y, label_smoothing=a); "dense": F.cross_entropy(logits, probabilities)
    return _loss_step(F.cross_entropy, case)


def _liger_cross_entropy(case: Case) -> Step:
    from liger_kernel.transformers import LigerCrossEntropyLoss

    smoothing = LABEL_SMOOTHING if case.target == "smooth" else 0.0
    criterion = LigerCrossEntropyLoss(reduction="mean", label_smoothing=smoothing)
    hard = case.target == "hard"

    def step(logits, target):
        loss = criterion(logits, target if hard else target.target)
        if isinstance(loss, tuple):  # versions that also return the z-loss / accuracy
            loss = loss[0]
        loss.backward()
        return loss

    return step


def _needs_backend(name: str) -> Callable[[torch.device], str | None]:
    return lambda device: _backends.unavailable_reason(name, device)


def _needs_module(module: str) -> Callable[[torch.device], str | None]:
    return lambda device: None if importlib.util.find_spec(module) is not None else f"{module} is not installed"


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
        Provider("torch_cross_entropy", "F.cross_entropy", ("cpu", "cuda"), _torch_cross_entropy,
                 weights=("none",)),
        Provider("liger_cross_entropy", "Liger-Kernel cross-entropy", ("cuda",), _liger_cross_entropy,
                 _needs_module("liger_kernel"), weights=("none",), inplace=True, targets=("hard", "smooth")),
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


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SoftTarget:
    """The target of a soft case (:func:`soft_target`): the loss is ``f(logits, target, **kwargs)``.

    ``target``: the int64 class indices ``(N,)``, or for kind ``"dense"`` the float32 ``(N, C)`` distribution;
    ``kwargs``: the keywords of ``ck.uncertainty_weighted_ce`` and of the reference, ``label_smoothing``,
    ``mix_target``, ``mix_lambda`` (empty for ``"dense"``)."""

    kind: str
    target: torch.Tensor
    kwargs: dict = field(default_factory=dict)


def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor | SoftTarget]:
    """Leaf logits ``(N, C)`` (``requires_grad``) ~ 𝒩(0, 2²), uniform targets in ``[0, C)``, on the case's device;
    for a soft case the target is the :class:`SoftTarget` of those class indices (:func:`soft_target`).

    A scale of 2 gives a spread of confidences (neither uniform softmax nor one-hot), so every branch of the weight
    is exercised; the values do not change the work of any provider. Generated with a fixed seed so every provider
    sees the same data, and every target kind the same logits and class indices.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    logits = (2.0 * torch.randn(case.n, case.c, generator=generator)).to(device=case.device, dtype=case.torch_dtype)
    target = torch.randint(0, case.c, (case.n,), generator=generator).to(case.device)
    return logits.requires_grad_(), target if case.target == "hard" else soft_target(case, target, seed)


def _mix_lambdas(n: int, seed: int) -> torch.Tensor:
    """``n`` draws of Beta(MIX_ALPHA, MIX_ALPHA), float32, from a fixed seed (the global generator's state is kept)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return torch.distributions.Beta(MIX_ALPHA, MIX_ALPHA).sample((n,)).float()


def soft_target(case: Case, target: torch.Tensor, seed: int = 0) -> SoftTarget:
    """The target of ``case.target``'s kind from the class indices ``target`` (docs/losses.md "Soft targets"):

    * ``"smooth"``: ``label_smoothing = LABEL_SMOOTHING`` (0.1);
    * ``"mix"``: ``mix_target = target.flip(0)`` (mixup's partner, the batch reversed) and one ``mix_lambda`` per row
      ~ Beta(0.2, 0.2) (float32, ``(N,)``, fixed seed): mixup draws one λ per batch, a number that reaches the kernels
      as a 0-dim λ tensor; one per row exercises the general path;
    * ``"mix_smooth"``: both;
    * ``"dense"``: the float32 ``(N, C)`` distribution of ``"mix_smooth"``, ``λ·s(e_y) + (1 − λ)·s(e_y2)`` with
      ``s(e) = (1 − α)·e + α/C``, as ``timm.data.Mixup`` builds its targets (float32 whatever the logits' dtype).
    """
    kind = case.target
    if kind == "hard":
        raise ValueError("a hard case's target is the class indices themselves")
    kwargs: dict = {}
    if kind in ("smooth", "mix_smooth"):
        kwargs["label_smoothing"] = LABEL_SMOOTHING
    if kind in ("mix", "mix_smooth", "dense"):
        kwargs["mix_target"] = target.flip(0)
        kwargs["mix_lambda"] = _mix_lambdas(case.n, seed).to(target.device)
    if kind != "dense":
        return SoftTarget(kind, target, kwargs)
    lam = kwargs["mix_lambda"].double()[:, None]
    off = LABEL_SMOOTHING / case.c
    first, second = (torch.full((case.n, case.c), off, dtype=torch.float64, device=target.device)
                     .scatter_(1, y[:, None], 1.0 - LABEL_SMOOTHING + off) for y in (target, kwargs["mix_target"]))
    return SoftTarget(kind, (lam * first + (1.0 - lam) * second).to(DENSE_TARGET_DTYPE))


def _target_call(target: torch.Tensor | SoftTarget) -> tuple[torch.Tensor, dict]:
    """``(target, keywords)`` of the loss call for a case's target (:func:`make_inputs`)."""
    return (target.target, target.kwargs) if isinstance(target, SoftTarget) else (target, {})


def _fresh_logits(leaf: torch.Tensor) -> torch.Tensor:
    """A non-leaf copy of the logits for one repetition (see the module docstring); resets ``leaf.grad``."""
    leaf.grad = None
    return leaf.clone()


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Timing:
    median_ms: float
    min_ms: float
    max_ms: float
    reps: int
    times_ms: list[float] = field(repr=False)
    steps_per_rep: int = 1  # host steps: back-to-back steps per repetition (the times are per step)
    issue_ms: float | None = None  # CUDA steps: the host's time to issue one step (the GPU spun meanwhile)


def _dropper(names: list[str], on_error: Callable[[str, Exception], None] | None
             ) -> Callable[[str, Exception], None]:
    """A timing loop's error handler: the failing step leaves ``names`` and goes to ``on_error`` (raised if None)."""
    def failed(name, exc):
        names.remove(name)
        if on_error is None:
            raise exc
        on_error(name, exc)

    return failed


def _warm_up(names: list[str], warm: Callable[[str], None], failed: Callable[[str, Exception], None],
             device: str) -> None:
    """``warm(name)`` for each step, synchronised; a step that raises is handed to ``failed``."""
    for name in list(names):
        try:
            warm(name)
            _sync(device)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            failed(name, exc)


def time_steps(steps: dict[str, Step], leaf: torch.Tensor, target, *, warmup: int = 2,
               reps: int = 10, min_reps: int = 3, max_time_s: float = 5.0,
               on_error: Callable[[str, Exception], None] | None = None,
               targets: dict | None = None) -> dict[str, Timing]:
    """Median time of each step, **interleaved**: repetition ``r`` runs every step once (in an order rotated by one
    each repetition) before repetition ``r + 1`` starts, so load from other processes on a shared machine hits all
    providers alike instead of whichever happened to run during a busy second.

    Each step gets ``warmup`` untimed repetitions, then up to ``reps`` timed ones; a step drops out early once it has
    ``min_reps`` and its timed repetitions have used ``max_time_s`` (so a slow eager reference does not dominate the
    run time, and fast kernels still get all ``reps``). Fresh non-leaf logits copy per repetition, made untimed.
    A step that raises is dropped and reported through ``on_error`` (re-raised when ``on_error`` is None).
    ``targets``: a target per step name, in place of ``target`` (steps of several target kinds on the same logits).
    """
    device = leaf.device.type
    names = list(steps)
    failed = _dropper(names, on_error)
    target_of = {name: target for name in names} if targets is None else targets
    issue_s: dict[str, float] = {}  # CUDA: the host's time to issue one step (the last warm-up repetition's)

    def warm(name):
        for _ in range(warmup):
            logits = _fresh_logits(leaf)
            if device == "cuda":
                torch.cuda.synchronize()  # the GPU idle: the host's issue time alone, not a wait for earlier work
            start_s = time.perf_counter()
            steps[name](logits, target_of[name])
            issue_s[name] = time.perf_counter() - start_s
            del logits

    _warm_up(names, warm, failed, device)
    times: dict[str, list[float]] = {name: [] for name in names}
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=leaf.device) if device == "cuda" else None
    cycles_per_ms = _gpu_sleep_cycles_per_ms() if flush is not None else None
    pending: dict[str, list] = {name: [] for name in names}  # CUDA events not yet read back

    def collect():
        torch.cuda.synchronize()
        for name, events in pending.items():
            times[name].extend(start.elapsed_time(end) for start, end in events)
            events.clear()

    active = list(names)
    for r in range(reps):
        if not active:
            break
        shift = r % len(active)
        for name in active[shift:] + active[:shift]:
            logits = _fresh_logits(leaf)
            try:
                if flush is not None:
                    flush.zero_()  # evict the logits from L2, as triton.testing.do_bench does
                    # keep the GPU busy while the host issues the step, so that the events time the device's work
                    # and not the host's launch gaps (module docstring)
                    cycles = gpu_sleep_cycles(issue_s.get(name), cycles_per_ms)
                    if cycles:
                        torch.cuda._sleep(cycles)
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    steps[name](logits, target_of[name])
                    end.record()
                    pending[name].append((start, end))
                else:
                    start_s = time.perf_counter()
                    steps[name](logits, target_of[name])
                    times[name].append(1e3 * (time.perf_counter() - start_s))
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                failed(name, exc)
                active.remove(name)
                times.pop(name, None)
                pending.pop(name, None)
            del logits
        if flush is not None and (r % 4 == 3 or r == reps - 1):
            collect()  # read the events back every few repetitions only: no sync per step
        if r + 1 >= min_reps and (flush is None or r % 4 == 3):
            active = [name for name in active if sum(times[name]) <= 1e3 * max_time_s]
    if flush is not None:
        collect()
    leaf.grad = None
    return {name: Timing(statistics.median(t), min(t), max(t), len(t), t,
                         issue_ms=1e3 * issue_s[name] if flush is not None and name in issue_s else None)
            for name, t in times.items() if t}


# The GPU spin queued before a timed CUDA step (time_steps): GPU_SLEEP_MARGIN times the host's issue time of the step
# plus GPU_SLEEP_EXTRA_MS, at most GPU_SLEEP_MAX_MS (a step whose issue time includes a wait for the device, e.g. a
# host synchronisation inside it, would otherwise spin for its whole GPU time too).
GPU_SLEEP_MARGIN = 2.0
GPU_SLEEP_EXTRA_MS = 0.1
GPU_SLEEP_MAX_MS = 20.0
_sleep_cycles_per_ms: dict[int, float] = {}


def gpu_sleep_cycles(issue_s: float | None, cycles_per_ms: float | None) -> int:
    """GPU clock cycles of ``torch.cuda._sleep`` that outlast the host's issue of a step that took ``issue_s`` to
    issue; 0 (no spin) without an issue time or a clock rate."""
    if issue_s is None or not cycles_per_ms:
        return 0
    ms = min(GPU_SLEEP_MAX_MS, GPU_SLEEP_MARGIN * 1e3 * issue_s + GPU_SLEEP_EXTRA_MS)
    return max(0, int(ms * cycles_per_ms))


def _gpu_sleep_cycles_per_ms() -> float | None:
    """``torch.cuda._sleep`` cycles per millisecond on the current device (timed once per device with CUDA events;
    ``None`` where it cannot be, and then no step is preceded by a spin)."""
    device = torch.cuda.current_device()
    if device not in _sleep_cycles_per_ms:
        try:
            cycles = 2_000_000
            torch.cuda._sleep(cycles // 10)  # the spin kernel's first launch loads its module
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(cycles)
            end.record()
            end.synchronize()
            _sleep_cycles_per_ms[device] = cycles / max(start.elapsed_time(end), 1e-6)
        except Exception:  # noqa: BLE001 - without it the events time the step as before
            _sleep_cycles_per_ms[device] = 0.0
    return _sleep_cycles_per_ms[device] or None


def time_step(step: Step, leaf: torch.Tensor, target: torch.Tensor, *, warmup: int = 2, reps: int = 10,
              min_reps: int = 3, max_time_s: float = 5.0) -> Timing:
    """:func:`time_steps` for a single step."""
    return time_steps({"step": step}, leaf, target, warmup=warmup, reps=reps, min_reps=min_reps,
                      max_time_s=max_time_s)["step"]


def _host_steps(step: Step, leaf: torch.Tensor, target: torch.Tensor, count: int, inplace: bool = False,
                fresh: list[torch.Tensor] | None = None) -> None:
    """``count`` training-loop steps on one leaf: ``leaf.grad = None``, forward, backward. An in-place step gets a
    non-leaf copy of the leaf each time (from ``fresh`` when given, made beforehand; else made here), so that the
    gradient it writes over its logits never reaches the leaf."""
    for i in range(count):
        leaf.grad = None
        if fresh is not None:
            step(fresh[i], target)
        else:
            step(leaf.clone() if inplace else leaf, target)


def _steps_per_rep(step: Step, leaf: torch.Tensor, target: torch.Tensor, rep_s: float, tries: int = 3,
                   inplace: bool = False) -> int:
    """How many back-to-back steps last at least about ``rep_s``: a burst doubled until it takes a quarter of that,
    then scaled; the largest count of ``tries`` estimates (an estimate taken while other processes held the cores
    is too small)."""
    device, best = leaf.device.type, 1
    for _ in range(tries):
        count = 1
        while True:
            start = time.perf_counter()
            _host_steps(step, leaf, target, count, inplace)
            _sync(device)
            elapsed = time.perf_counter() - start
            if elapsed >= rep_s / 4 or count >= 1 << 20:
                best = max(best, math.ceil(count * rep_s / max(elapsed, 1e-9)))
                break
            count *= 2
    return best


# An in-place host step's copies of the logits for one repetition are made before its timer starts and held until
# it ends: at most this many bytes of them (fewer steps per repetition where the logits are large).
HOST_INPLACE_COPY_BYTES = 1 << 30


def time_host_steps(steps: dict[str, Step], leaf: torch.Tensor | None, target: torch.Tensor | None, *,
                    reps: int = 100, rep_ms: float = 20.0, warmup: int = 20,
                    on_error: Callable[[str, Exception], None] | None = None,
                    inputs: dict[str, tuple[torch.Tensor, torch.Tensor]] | None = None,
                    inplace: frozenset[str] | set[str] = frozenset()) -> dict[str, Timing]:
    """Host time per step of each step on a reused leaf, **interleaved** (repetition ``r`` of every step before
    ``r + 1`` of any, order rotated by one each repetition).

    No per-step setup: ``leaf.grad = None`` and the step, as in a training loop (the step's ``backward`` writes
    ``leaf.grad``). After ``warmup`` untimed steps, each step gets its ``steps_per_rep`` (so one repetition lasts
    about ``rep_ms``); a repetition times that many back-to-back steps and records the mean per step. On CUDA the
    repetition ends with a synchronisation. A step that raises is dropped and reported through ``on_error``
    (re-raised when ``on_error`` is None).

    ``inputs``: a ``(leaf, target)`` per step name, in place of the shared ``leaf`` and ``target`` (so a step that
    writes into its logits cannot change what the others compute). A step named in ``inplace`` overwrites its
    logits with their gradient: it runs on a fresh non-leaf copy of its leaf per step, the copies of a repetition
    made before its timer starts (at most :data:`HOST_INPLACE_COPY_BYTES` of them, which may cap its steps per
    repetition), as the timed-step suites copy the logits outside the timed region.
    """
    inputs = {name: (leaf, target) for name in steps} if inputs is None else inputs
    device = next(iter(inputs.values()))[0].device.type if inputs else "cpu"
    names = list(steps)
    failed = _dropper(names, on_error)
    counts: dict[str, int] = {}

    def warm(name):
        own_leaf, own_target = inputs[name]
        copies = name in inplace
        _host_steps(steps[name], own_leaf, own_target, warmup, copies)
        _sync(device)
        count = _steps_per_rep(steps[name], own_leaf, own_target, rep_ms * 1e-3, inplace=copies)
        if copies:
            nbytes = own_leaf.numel() * own_leaf.element_size()
            count = max(1, min(count, HOST_INPLACE_COPY_BYTES // max(nbytes, 1)))
        counts[name] = count

    _warm_up(names, warm, failed, device)
    times: dict[str, list[float]] = {name: [] for name in names}
    for r in range(reps):
        if not names:
            break
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            count = counts[name]
            own_leaf, own_target = inputs[name]
            try:
                fresh = [own_leaf.clone() for _ in range(count)] if name in inplace else None
                _sync(device)
                start = time.perf_counter()
                _host_steps(steps[name], own_leaf, own_target, count, fresh=fresh)
                _sync(device)
                times[name].append(1e3 * (time.perf_counter() - start) / count)
                del fresh
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                times.pop(name, None)
                failed(name, exc)
    for own_leaf, _ in inputs.values():
        own_leaf.grad = None
    return {name: Timing(statistics.median(t), min(t), max(t), len(t), t, counts[name])
            for name, t in times.items() if t}


def time_fn(fn: Callable[[], object], device: str = "cpu", *, warmup: int = 2, reps: int = 10, min_reps: int = 3,
            max_time_s: float = 5.0) -> Timing:
    """Median time of a no-argument ``fn`` (no per-repetition setup; for forward-only work such as metrics).

    Host clock with a synchronisation after each call on CUDA (metrics return Python floats, which synchronise
    anyway)."""
    for _ in range(warmup):
        fn()
    _sync(device)
    times: list[float] = []
    for i in range(reps):
        start = time.perf_counter()
        fn()
        _sync(device)
        times.append(1e3 * (time.perf_counter() - start))
        if i + 1 >= min_reps and sum(times) > 1e3 * max_time_s:
            break
    return Timing(statistics.median(times), min(times), max(times), len(times), times)


def rows_to_markdown(headers: list[str], rows: list[list[object]]) -> str:
    """A plain Markdown table (numbers already formatted by the caller)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Peak extra memory
# ----------------------------------------------------------------------------------------------------------------
def _quiet_profiler_logs() -> None:
    """Keep the profiler's back end (Kineto) off stderr: it logs every profiler start and stop at its ``USDT`` level
    and, on a machine without a GPU, ``gpuGetDeviceCount failed`` at its ``ERROR`` level, between the bench's progress
    lines. Kineto reads ``KINETO_LOG_LEVEL`` when the first profiler of the process starts; 6 is above its highest
    level (USDT, 5). A level set by the user is kept."""
    os.environ.setdefault("KINETO_LOG_LEVEL", "6")


def _cpu_peak_from_profiler(run: Callable[[], None]) -> int:
    from torch.profiler import ProfilerActivity, profile

    _quiet_profiler_logs()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        run()
    records = sorted(
        (event.start_ns(), event.nbytes())
        for event in prof.profiler.kineto_results.events()
        if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU
    )
    running = itertools.accumulate(nbytes for _, nbytes in records)
    return max(0, max(running, default=0))


def peak_extra_memory(step: Step, leaf: torch.Tensor, target: torch.Tensor) -> int:
    """Peak bytes allocated during one step above the level before it (inputs and the logits copy excluded)."""
    logits = _fresh_logits(leaf)
    try:
        if leaf.device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            step(logits, target)
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - before
        return _cpu_peak_from_profiler(lambda: step(logits, target))
    finally:
        del logits
        leaf.grad = None


# ----------------------------------------------------------------------------------------------------------------
# Correctness (used by tests/test_bench.py and by `--check`)
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
    loss = step(_fresh_logits(leaf), target)
    grad = leaf.grad.detach().clone()
    leaf.grad = None
    exact = leaf.detach().double().requires_grad_()
    ref_target, soft_kwargs = _target_call(target)  # the same soft arguments (λ and a dense target as given)
    ref_loss = ck_reference.uncertainty_weighted_ce(exact, ref_target, weight=case.weight, mode=case.mode,
                                                    **soft_kwargs)
    ref_loss.backward()
    return loss.detach(), grad, ref_loss.detach(), exact.grad


def check_tolerance(dtype: str) -> tuple[float, float]:
    """``(rtol, atol)`` for a provider's loss and gradient against :func:`check_provider`'s float64 reference: fp32,
    or a 16-bit dtype, which loses ~3 significant digits in the gradient's single rounding."""
    return (1e-4, 1e-6) if dtype == "fp32" else (2e-2, 1e-4)


# ----------------------------------------------------------------------------------------------------------------
# One measurement, suites
# ----------------------------------------------------------------------------------------------------------------
@dataclass
class Result:
    case: dict
    case_id: str
    provider: str
    label: str
    status: str  # "ok", "skipped: <reason>", "error: <message>"
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    reps: int = 0
    gb_per_s: float | None = None
    peak_extra_mb: float | None = None
    peak_extra_nc: float | None = None  # in units of one N×C buffer
    speedup_vs_reference: float | None = None
    times_ms: list[float] = field(default_factory=list)
    measure: str = "step"  # "step" or "host_step" (Suite.measure)
    threads: int | None = None  # host steps: torch threads of the measurement (step results: the run's, in meta)
    steps_per_rep: int | None = None  # host steps: back-to-back steps per repetition; times are per step
    baseline: str | None = None  # host steps: the provider the ratios are taken against
    ratio_to_baseline: float | None = None  # this median / the baseline's median
    paired_ratio_to_baseline: float | None = None  # median over repetitions of this time / the baseline's time
    ratio_to_hard: float | None = None  # soft targets: this median / the same provider's on the hard case, same run
    config: dict = field(default_factory=dict)  # other parameters of the measurement (e.g. the resolved backend)
    host_issue_ms: float | None = None  # CUDA steps: the host's time to issue one step, untimed (time_steps)


def _error_status(exc: Exception) -> str:
    message = str(exc).splitlines()[0] if str(exc) else ""
    return f"error: {type(exc).__name__}: {message}"


def bench_case(case: Case, providers: list[Provider], *, warmup: int = 2, reps: int = 10, max_time_s: float = 5.0,
               memory: bool = True, seed: int = 0) -> list[Result]:
    """Time the providers on one case, interleaved (:func:`time_steps`), then measure each one's peak extra memory.

    Unavailable providers are recorded as skipped and failing ones as errors; neither stops the others.
    """
    return bench_cases([(case, providers)], warmup=warmup, reps=reps, max_time_s=max_time_s, memory=memory, seed=seed)


def bench_cases(items: list[tuple[Case, list[Provider]]], *, warmup: int = 2, reps: int = 10,
                max_time_s: float = 5.0, memory: bool = True, seed: int = 0) -> list[Result]:
    """:func:`bench_case` for cases that differ only in their target kind (``Case.hard`` the same): one set of
    logits, each case's target (:func:`make_inputs`), and every (case, provider) step timed together, interleaved,
    so the target kinds are compared as the providers are. Results in the order of ``items``."""
    bases = {case.hard for case, _ in items}
    if len(bases) != 1:
        raise ValueError(f"bench_cases takes the target kinds of one case, got {sorted(c.id for c in bases)}")
    results: dict[tuple[Case, str], Result] = {}
    steps: dict[tuple[Case, str], Step] = {}
    for case, providers in items:
        for provider in providers:
            key = (case, provider.name)
            results[key] = result = Result(asdict(case), case.id, provider.name, provider.label, "ok")
            backend = _resolved_backend(provider, case)
            if backend is not None:
                result.config["backend"] = backend
            reason = unavailable_reason(provider, case)
            if reason is not None:
                result.status = f"skipped: {reason}"
                continue
            try:
                steps[key] = build_step(provider, case)
            except Exception as exc:  # noqa: BLE001 - one failing provider must not lose the other measurements
                result.status = _error_status(exc)
    if not steps:
        return list(results.values())

    def on_error(key, exc):
        results[key].status = _error_status(exc)
        steps.pop(key, None)

    base = bases.pop()
    leaf, target = make_inputs(base, seed)
    kinds = {case: target if case.target == "hard" else soft_target(case, target, seed) for case, _ in items}
    targets = {key: kinds[key[0]] for key in steps}
    try:
        timings = time_steps(dict(steps), leaf, target, warmup=warmup, reps=reps, max_time_s=max_time_s,
                             on_error=on_error, targets=targets)
        for key, timing in timings.items():
            result = results[key]
            result.median_ms, result.min_ms, result.max_ms = timing.median_ms, timing.min_ms, timing.max_ms
            result.reps, result.times_ms = timing.reps, [round(t, 4) for t in timing.times_ms]
            result.gb_per_s = key[0].min_traffic_bytes / (timing.median_ms * 1e-3) / 1e9
            result.host_issue_ms = None if timing.issue_ms is None else round(timing.issue_ms, 4)
        if memory:
            for key in timings:
                try:
                    peak = peak_extra_memory(steps[key], leaf, targets[key])
                    results[key].peak_extra_mb = peak / MB
                    results[key].peak_extra_nc = peak / key[0].nc_bytes
                except Exception as exc:  # noqa: BLE001
                    results[key].status = _error_status(exc)
    finally:
        del leaf, target, kinds, targets, steps
        if base.device == "cuda":
            torch.cuda.empty_cache()
    return list(results.values())


def host_case_id(case: Case) -> str:
    """``<device>-<N>x<C>-<dtype>``: a host-step case pairs providers of different losses (each row's ``case`` says
    which loss its provider computed)."""
    return f"{case.device}-{case.n}x{case.c}-{case.dtype}"


def backend_target_kind(case: Case) -> str:
    """The target kind ``calibkernels._backends`` chooses a backend by (``target_kind``: ``"hard"``, ``"smooth"``,
    ``"mix"`` or ``"dense"``) for a case's :data:`TARGET_KINDS` entry: ``"mix_smooth"`` is a mix there."""
    return _backends.target_kind(case.target != "hard", case.target == "dense", case.target in ("mix", "mix_smooth"))


def _resolved_backend(provider: Provider, case: Case) -> str | None:
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


def bench_host_case(case: Case, providers: list[Provider], *, threads: tuple[int | None, ...] = (None,),
                    baseline: str | None = None, reps: int = 100, rep_ms: float = 20.0, warmup: int = 20,
                    seed: int = 0) -> list[Result]:
    """Host cost of the providers' eager steps on ``case`` (:func:`time_host_steps`), once per entry of ``threads``
    (``torch.set_num_threads``; ``None``: the count in effect when called, restored afterwards), with each provider's
    ratio to ``baseline``: of the medians, and the median of the per-repetition ratios.

    Every provider runs the case's shape and dtype whatever its loss (``Provider.computed_case``)."""
    default_threads = torch.get_num_threads()
    results: list[Result] = []
    try:
        for wanted in threads:
            count = default_threads if wanted is None else int(wanted)
            torch.set_num_threads(count)
            results += _bench_host_case_at(case, providers, count, baseline, reps, rep_ms, warmup, seed)
    finally:
        torch.set_num_threads(default_threads)
    return results


def _bench_host_case_at(case, providers, threads, baseline, reps, rep_ms, warmup, seed) -> list[Result]:
    results = {}
    steps: dict[str, Step] = {}
    for provider in providers:
        result = Result(asdict(provider.computed_case(case)), host_case_id(case), provider.name, provider.label, "ok",
                        measure="host_step", threads=threads, baseline=baseline)
        backend = _resolved_backend(provider, case)
        if backend is not None:
            result.config["backend"] = backend
        results[provider.name] = result
        reason = unavailable_reason(provider, case, any_weight=True)
        if reason is not None:
            result.status = f"skipped: {reason}"
            continue
        try:
            steps[provider.name] = build_step(provider, case, any_weight=True)
        except Exception as exc:  # noqa: BLE001 - one failing provider must not lose the other measurements
            result.status = _error_status(exc)
    if steps:
        # every provider its own leaf of the same values: an in-place provider (Liger) writes its gradient into its
        # logits, which must not become the next provider's input
        inputs = {name: make_inputs(case, seed) for name in steps}
        inplace = {provider.name for provider in providers if provider.inplace}
        timings = time_host_steps(steps, None, None, reps=reps, rep_ms=rep_ms, warmup=warmup, inputs=inputs,
                                  inplace=inplace,
                                  on_error=lambda name, exc: setattr(results[name], "status", _error_status(exc)))
        for name, timing in timings.items():
            result = results[name]
            result.median_ms, result.min_ms, result.max_ms = timing.median_ms, timing.min_ms, timing.max_ms
            result.reps, result.times_ms = timing.reps, [round(t, 6) for t in timing.times_ms]
            result.steps_per_rep = timing.steps_per_rep
        if baseline in timings:
            base = timings[baseline]
            for name, timing in timings.items():
                pairs = [t / b for t, b in zip(timing.times_ms, base.times_ms)]
                results[name].ratio_to_baseline = timing.median_ms / base.median_ms
                results[name].paired_ratio_to_baseline = statistics.median(pairs)
        del inputs
    return list(results.values())


def bench_one(provider: Provider, case: Case, **kwargs) -> Result:
    """:func:`bench_case` for a single provider."""
    return bench_case(case, [provider], **kwargs)[0]


def _filtered(suites, providers_filter, cases_filter, targets_filter=None):
    for suite in suites:
        host = suite.measure == "host_step"
        for case in suite.cases:
            case_id = host_case_id(case) if host else case.id
            if cases_filter and not any(f in case_id for f in cases_filter):
                continue
            if targets_filter and case.target not in targets_filter:
                continue
            for name in suite.providers:
                if providers_filter and name not in providers_filter:
                    continue
                if PROVIDERS[name].applies_to(case, any_weight=host):
                    yield suite, case, PROVIDERS[name]


class RunInterrupted(KeyboardInterrupt):
    """SIGINT (a wall-clock limit's, as bench/run_on_gpu.sh's DEADLINE sends) during :func:`run_suites`: ``results``
    holds the cases measured before it, the one in progress left out."""

    def __init__(self, results: list[Result]):
        super().__init__()
        self.results = results


def run_suites(suites: list[Suite], *, warmup: int = 2, reps: int = 10, max_time_s: float = 5.0, memory: bool = True,
               providers_filter: list[str] | None = None, cases_filter: list[str] | None = None,
               progress: bool = True, host_reps: int | None = None, host_rep_ms: float = 20.0,
               targets_filter: list[str] | None = None) -> list[Result]:
    """Measure every (case, provider) pair of the suites; fills ``speedup_vs_reference`` when the eager reference
    ran on the same case, and ``ratio_to_hard`` when the provider ran the case's hard targets. Host-step suites run
    with ``host_reps`` repetitions (default: the suite's ``reps``, else 100) of about ``host_rep_ms`` each.

    A ``KeyboardInterrupt`` (SIGINT) ends the run: :class:`RunInterrupted` is raised with the cases measured so far."""
    # group the pairs by case (in order), the target kinds of a case together: a group's providers and target kinds
    # are timed together, interleaved (bench_cases); a host-step suite's cases are measured on their own (its
    # threads, baseline and repetitions)
    groups: dict[tuple, dict[Case, list[Provider]]] = {}
    for suite, case, provider in _filtered(suites, providers_filter, cases_filter, targets_filter):
        key = ("step", case.hard, None) if suite.measure == "step" else ("host_step", case, suite)
        providers = groups.setdefault(key, {}).setdefault(case, [])
        if provider not in providers:
            providers.append(provider)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: fall back to one line per case
        tqdm = None
    items = list(groups.items())
    bar = tqdm(items, desc="bench", unit="case", file=sys.stderr, disable=not progress) if tqdm else items
    results = []
    try:
        _run_groups(bar, tqdm, progress, results, warmup, reps, max_time_s, memory, host_reps, host_rep_ms)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
        if tqdm:
            bar.close()
    steps = [r for r in results if r.status == "ok" and r.measure == "step"]
    reference_ms = {r.case_id: r.median_ms for r in steps if r.provider == "reference"}
    hard_ms = {(r.case_id, r.provider): r.median_ms for r in steps if r.case.get("target", "hard") == "hard"}
    for r in steps:
        if r.case_id in reference_ms:
            r.speedup_vs_reference = reference_ms[r.case_id] / r.median_ms
        hard_id = Case(**r.case).hard.id
        if hard_id != r.case_id and (hard_id, r.provider) in hard_ms:
            r.ratio_to_hard = r.median_ms / hard_ms[hard_id, r.provider]
    if interrupted:
        raise RunInterrupted(results)
    return results


def _run_groups(bar, tqdm, progress, results, warmup, reps, max_time_s, memory, host_reps, host_rep_ms) -> None:
    """:func:`run_suites`' loop over the groups of ``bar``; each group's results are appended to ``results`` once
    the whole group is measured."""
    for (measure, case, suite), by_case in bar:
        label = case.id if measure == "step" else f"{host_case_id(case)} host step"
        kinds = [c.target for c in by_case if c.target != "hard"]
        label += f" (+ targets {', '.join(kinds)})" if kinds else ""
        if tqdm:
            bar.set_postfix_str(f"{label} ({len({p.name for ps in by_case.values() for p in ps})} providers)")
        elif progress:
            print(f"[bench] {label}", file=sys.stderr, flush=True)
        if measure == "step":
            case_results = bench_cases(list(by_case.items()), warmup=warmup, reps=reps, max_time_s=max_time_s,
                                       memory=memory)
        else:
            (providers,) = by_case.values()
            case_results = bench_host_case(
                case, providers, threads=suite.threads,
                baseline=suite.baseline if any(p.name == suite.baseline for p in providers) else None,
                reps=host_reps if host_reps is not None else (suite.reps or 100), rep_ms=host_rep_ms)
        for result in case_results:
            if result.status != "ok" and progress:
                print(f"[bench] {result.case_id} {result.provider}: {result.status}", file=sys.stderr, flush=True)
        results.extend(case_results)


# ----------------------------------------------------------------------------------------------------------------
# Machine description, JSON and Markdown
# ----------------------------------------------------------------------------------------------------------------
def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        model = fields.get("Model name", "").strip()
        if model:
            return model
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return platform.processor() or platform.machine()


# what `git status` looks at for meta.git_dirty (pathspecs): the kernels' sources and the bench, not its results
GIT_DIRTY_SCOPE = ("csrc", "calibkernels", "setup.py", "bench", ":(exclude)bench/results")


def package_version(module: str) -> str | None:
    """The installed version of the distribution that provides ``module`` (``importlib.metadata``: the version pip
    installed, also for packages without a ``__version__``), or ``None`` when ``module`` is not importable. A module
    whose distribution cannot be found is reported as ``"unknown"``."""
    if importlib.util.find_spec(module) is None:
        return None
    from importlib import metadata

    names = [module, module.replace("_", "-")]
    try:
        names += metadata.packages_distributions().get(module, [])
    except Exception:  # noqa: BLE001 - a lookup aid, never a reason to fail
        pass
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def machine_info(device: str) -> dict:
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "calibkernels": getattr(ck, "__version__", "unknown"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # a shared machine's load at the start: other processes competing for the cores inflate CPU timings
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "device": device,
        # settings that change CPU results (threads; glibc malloc returning freed blocks to the OS, which makes every
        # fresh N×C buffer page-fault on first touch): recorded so a run can be reproduced
        "env": {k: v for k, v in os.environ.items()
                if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLIBC_TUNABLES", "LD_PRELOAD", "TRITON_INTERPRET",
                         "CUDA_VISIBLE_DEVICES") or k.startswith("MALLOC_")},
    }
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    for module in ("triton", "liger_kernel"):
        version = package_version(module)
        if version is not None:
            info[module] = version
    try:
        def git(*args):
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=REPO_ROOT).stdout

        full = git("rev-parse", "HEAD").strip()
        if full:
            info["git_commit"] = full[:7]
            info["git_commit_full"] = full
            # uncommitted changes to the code measured: the kernels (the extension is built from csrc/) and the
            # bench itself, whose providers and timing decide what a number means; result files are not code
            info["git_dirty_scope"] = list(GIT_DIRTY_SCOPE)
            info["git_dirty_paths"] = [line[3:] for line in git("status", "--porcelain", "--", *GIT_DIRTY_SCOPE)
                                       .splitlines() if line.strip()]
            info["git_dirty"] = bool(info["git_dirty_paths"])
    except (OSError, subprocess.SubprocessError):
        pass
    so = sorted(Path(ck.__file__).parent.glob("_C*.so"))
    if so:
        info["extension_mtime"] = _dt.datetime.fromtimestamp(so[0].stat().st_mtime, _dt.timezone.utc).isoformat(
            timespec="seconds")
    return info


def device_label(meta: dict, threads: int | None = None) -> str:
    """The ``device`` of a history row: the GPU's name, or ``"<CPU model> (<cores> cores, <threads> torch threads)"``
    (``threads``: the measurement's, default the run's)."""
    if meta.get("device") == "cuda" and meta.get("gpu"):
        return meta["gpu"]
    return f"{meta['cpu']} ({meta['cpu_count']} cores, {threads or meta['torch_threads']} torch threads)"


def device_slug(meta: dict) -> str:
    """The device in result file names: the GPU or CPU model without vendor and trademark words, lower case
    (``NVIDIA H200`` → ``h200``, ``AMD EPYC`` → ``epyc``, ``Intel(R) Xeon(R) Processor`` → ``xeon``)."""
    name = meta.get("gpu") if meta.get("device") == "cuda" else meta.get("cpu")
    text = re.sub(r"\((?:R|TM)\)|@.*$|\b(?:NVIDIA|Intel|AMD|CPU|Processor|\d+-Core)\b", " ", name or "", flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or str(meta.get("device") or "unknown")


def write_json(path: Path, meta: dict, results: list[Result]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1) + "\n")


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown_table(meta: dict, results: list[Result]) -> str:
    """One table of training steps, one row per (case, provider), cases in order; one table of host steps, one row
    per (case, threads, provider); skipped/errored providers listed below them."""
    machine = meta.get("gpu") or f"{meta['cpu']} ({meta['cpu_count']} cores, {meta['torch_threads']} torch threads)"
    lines = [
        f"Machine: {machine}; torch {meta['torch']}; {meta['date']}"
        + (f"; commit {meta['git_commit']}{' + local changes' if meta.get('git_dirty') else ''}"
           if meta.get("git_commit") else "")
        + (f"; 1-min load average at start {meta['load_average_1min']}" if meta.get("load_average_1min") is not None
           and meta.get("device") == "cpu" else "")
        + "".join(f"; {k}={v}" for k, v in meta.get("env", {}).items())
        + ("; **stopped part way** (complete = false): the cases measured before it" if meta.get("complete") is False
           else ""),
    ]
    problems = [f"- {r.case_id} / {r.provider}: {r.status}" for r in results if r.status != "ok"]
    steps = [r for r in results if r.status == "ok" and r.measure == "step"]
    hosts = [r for r in results if r.status == "ok" and r.measure == "host_step"]
    if steps:
        soft = any(r.case.get("target", "hard") != "hard" for r in steps)
        lines += [
            "",
            "Forward + backward of the mean loss. Time: median over repetitions (providers and target kinds of a case "
            "interleaved), min: fastest repetition. "
            + ("Time / hard: vs the same provider on the case's hard targets (class indices). " if soft else "")
            + "Speed-up: vs the eager reference on the "
            "same case. GB/s: 2·N·C·bytes / time"
            + (" (+ N·C·4 for a dense float32 target)" if soft else "")
            + ". Peak extra: peak allocation above the inputs during the step (MB, and in units of one N×C buffer).",
            "",
            "| N × C | dtype | weight / mode | target | provider | time (ms) | min (ms) | "
            + ("time / hard | " if soft else "")
            + "speed-up vs reference | GB/s | peak extra (MB) | peak extra (×NC) |",
            "|---|---|---|---|---|--:|--:|" + ("--:|" if soft else "") + "--:|--:|--:|--:|",
        ]
        for r in steps:
            c = r.case
            lines.append(
                f"| {c['n']} × {c['c']} | {c['dtype']} | {c['weight']} / {c['mode']} | {c.get('target', 'hard')} "
                f"| {r.label} | {_fmt(r.median_ms, '.2f')} | {_fmt(r.min_ms, '.2f')} "
                + (f"| {_fmt(r.ratio_to_hard, '.2f')} " if soft else "")
                + f"| {_fmt(r.speedup_vs_reference, '.2f')}"
                f"{'×' if r.speedup_vs_reference is not None else ''} "
                f"| {_fmt(r.gb_per_s, '.1f')} "
                f"| {_fmt(r.peak_extra_mb, '.1f')} | {_fmt(r.peak_extra_nc, '.2f')} |"
            )
    if hosts:
        baselines = sorted({PROVIDERS[r.baseline].label if r.baseline in PROVIDERS else str(r.baseline)
                            for r in hosts if r.baseline})
        lines += [
            "",
            "Host cost of an eager training step (forward + backward of the mean loss, `leaf.grad = None` between "
            "steps, one reused leaf, no copy). Time per step: median over repetitions of the mean of k back-to-back "
            "steps (providers interleaved); min: fastest repetition. Ratio to "
            + (", ".join(baselines) or "the baseline")
            + ": of the medians, and the median of the per-repetition ratios (each pair measured next to each other).",
            "",
            "| N × C | dtype | torch threads | provider | loss | target | per step (µs) | min (µs) | k steps / rep "
            "| reps | ratio of medians | median of paired ratios |",
            "|---|---|--:|---|---|---|--:|--:|--:|--:|--:|--:|",
        ]
        for r in hosts:
            c = r.case
            lines.append(
                f"| {c['n']} × {c['c']} | {c['dtype']} | {r.threads} | {r.label} | {c['weight']} / {c['mode']} "
                f"| {c.get('target', 'hard')} "
                f"| {_fmt(r.median_ms * 1e3, '.1f')} | {_fmt(r.min_ms * 1e3, '.1f')} | {r.steps_per_rep} | {r.reps} "
                f"| {_fmt(r.ratio_to_baseline, '.3f')} | {_fmt(r.paired_ratio_to_baseline, '.3f')} |"
            )
    if problems:
        lines += ["", "Not measured:", *problems]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# history.jsonl and the result files (format: bench/README.md, "history.jsonl")
# ----------------------------------------------------------------------------------------------------------------
# Version 2 added ``target`` (the target kind); version-1 rows, earlier in the append-only file, have every other field
# and only hard targets.
HISTORY_SCHEMA = 2
HISTORY_FIELDS = ("schema", "suite", "kernel", "device", "device_type", "date", "commit", "dirty", "torch", "triton",
                  "case_id", "n", "c", "dtype", "weight", "mode", "target", "provider", "config", "measure",
                  "median_ms", "min_ms", "max_ms", "mean_ms", "reps", "gb_per_s", "peak_extra_mb", "peak_extra_nc",
                  "speedup_vs_reference", "value", "status", "times_ms", "extra", "source_file")
HISTORY_FIELDS_V1 = tuple(name for name in HISTORY_FIELDS if name != "target")
HOST_STEP_TIMING = ("host clock; per repetition the mean of steps_per_rep back-to-back steps on one leaf "
                    "(leaf.grad = None between steps); median over repetitions")


def history_row(meta: dict, suite: str, source_file: str, **fields) -> dict:
    """One ``history.jsonl`` row: the run's fields from ``meta``, then ``fields``; every field present (``None``
    where it does not apply), in the documented order."""
    triton = meta.get("triton")
    row = dict.fromkeys(HISTORY_FIELDS)
    row.update(schema=HISTORY_SCHEMA, suite=suite, device=device_label(meta), device_type=meta.get("device"),
               date=meta.get("date"), commit=meta.get("git_commit") or None, dirty=meta.get("git_dirty"),
               torch=meta.get("torch"), triton=triton if triton and triton not in ("installed", "unknown") else None,
               source_file=source_file)
    unknown = set(fields) - set(HISTORY_FIELDS)
    if unknown:
        raise ValueError(f"not history.jsonl fields: {sorted(unknown)}")
    row.update(fields)
    return row


def history_rows(meta: dict, results: list, suite: str, source_file: str) -> list[dict]:
    """The ``history.jsonl`` rows of a loss bench run: one per result (:class:`Result`, or its dict from a result
    JSON)."""
    rows = []
    for r in results:
        r = asdict(r) if isinstance(r, Result) else r
        case, measure = r["case"], r.get("measure", "step")
        config = {"reduction": "mean"}
        if meta.get("env"):
            config["env"] = dict(meta["env"])
        config.update(r.get("config") or {})
        extra = {"load_average_1min": meta.get("load_average_1min"), "label": r.get("label")}
        if meta.get("git_commit_full"):
            extra["commit_full"] = meta["git_commit_full"]
        if r.get("ratio_to_hard") is not None:
            extra["ratio_to_hard"] = r["ratio_to_hard"]
        if r.get("host_issue_ms") is not None:
            extra["host_issue_ms"] = r["host_issue_ms"]
        if meta.get("complete") is False:
            extra["run_complete"] = False
        if measure == "host_step":
            config.update(torch_threads=r.get("threads"), steps_per_rep=r.get("steps_per_rep"))
            extra.update(timing=HOST_STEP_TIMING, baseline=r.get("baseline"),
                         ratio_to_baseline=r.get("ratio_to_baseline"),
                         paired_ratio_to_baseline=r.get("paired_ratio_to_baseline"))
        row = history_row(
            meta, suite, source_file, kernel="uncertainty_weighted_ce", case_id=r["case_id"], n=case["n"],
            c=case["c"], dtype=case["dtype"], weight=case["weight"], mode=case["mode"],
            target=case.get("target", "hard"), provider=r["provider"],
            config=config, measure=measure, median_ms=r.get("median_ms"), min_ms=r.get("min_ms"),
            max_ms=r.get("max_ms"), reps=r.get("reps") or None, gb_per_s=r.get("gb_per_s"),
            peak_extra_mb=r.get("peak_extra_mb"), peak_extra_nc=r.get("peak_extra_nc"),
            speedup_vs_reference=r.get("speedup_vs_reference"), status=r.get("status"),
            times_ms=r.get("times_ms") or None, extra=extra)
        if measure == "host_step" or r.get("threads"):
            row["device"] = device_label(meta, r.get("threads"))
        rows.append(row)
    return rows


def append_history(rows: list[dict], path: Path) -> None:
    """Append ``rows`` to ``path`` (one compact JSON object per line); earlier lines are never touched."""
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
    if path.exists() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                text = "\n" + text
    with path.open("a", encoding="utf-8") as f:
        f.write(text)


def _read_history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def result_stem(suite: str, meta: dict) -> str:
    """``<suite>-<device>-<YYYY-MM-DD>``: the name of a run's result files (date of the run's start, UTC)."""
    return f"{suite}-{device_slug(meta)}-{str(meta['date'])[:10]}"


def _repo_relative(path: Path) -> str:
    path = path.resolve()
    try:
        return path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def _retire_earlier(directory: Path, suite: str, meta: dict, keep: str, history: Path,
                    rows_of: Callable[[dict, str], list[dict]]) -> list[str]:
    """Delete the earlier result files of ``suite`` on this device in ``directory`` (``<suite>-<device>-<date>[-tag]``
    ``.json`` / ``.md``, other than ``keep``), after appending to ``history`` the rows of any whose run (suite and
    start time) it does not hold yet. A JSON that cannot be read is kept. Returns the deleted names."""
    name = re.escape(f"{suite}-{device_slug(meta)}-")
    pattern = re.compile(name + r"\d{4}-\d{2}-\d{2}(?:-[A-Za-z0-9]+)?")
    stems = sorted({f.stem for f in directory.glob("*") if f.suffix in (".json", ".md") and
                    pattern.fullmatch(f.stem)} - {keep})
    recorded = None
    removed = []
    for stem in stems:
        js = directory / f"{stem}.json"
        if js.exists():
            try:
                old = json.loads(js.read_text())
                if recorded is None:
                    recorded = {(row.get("suite"), row.get("date")) for row in _read_history(history)}
                if (suite, old["meta"]["date"]) not in recorded:
                    append_history(rows_of(old, f"bench/results/{js.name}"), history)
                    recorded.add((suite, old["meta"]["date"]))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"[bench] kept {js.name}: cannot read its rows ({type(exc).__name__}: {exc})", file=sys.stderr)
                continue
        for suffix in (".json", ".md"):
            path = directory / f"{stem}{suffix}"
            if path.exists():
                path.unlink()
                removed.append(path.name)
    return removed


_DEFAULT = object()


def publish(payload: dict, markdown: str, *, suite: str, rows_of: Callable[[dict, str], list[dict]],
            results_dir: Path | None = None, out: Path | None = None, history=_DEFAULT) -> dict:
    """Write a run's ``.json`` (``payload``, with ``payload["meta"]``) and ``.md`` and append its rows to the history.

    * Default (``out`` None): ``<results_dir>/<suite>-<device>-<date>.json`` / ``.md`` (``results_dir`` default
      ``bench/results``), replacing the earlier files of the same suite and device there (:func:`_retire_earlier`),
      rows appended to ``<results_dir>/history.jsonl``; the rows' ``source_file`` is ``bench/results/<name>``, the
      name the file has (or will have, when copied from a device machine's folder) in the repository.
    * ``out``: exactly ``out.json`` / ``out.md``, nothing replaced, rows appended only to an explicit ``history``.

    ``history``: a path overrides the history file; ``None`` appends nothing (and then nothing is replaced either).
    ``rows_of(payload, source_file)`` makes the rows. Returns the paths written and the names removed.
    """
    meta = payload["meta"]
    removed: list[str] = []
    if out is not None:
        json_path, md_path = out.with_suffix(".json"), out.with_suffix(".md")
        source_file = _repo_relative(json_path)
        history_path = None if history is _DEFAULT else history
    else:
        directory = Path(results_dir) if results_dir is not None else RESULTS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        stem = result_stem(suite, meta)
        json_path, md_path = directory / f"{stem}.json", directory / f"{stem}.md"
        source_file = f"bench/results/{json_path.name}"
        history_path = directory / "history.jsonl" if history is _DEFAULT else history
        if history_path is not None:
            removed = _retire_earlier(directory, suite, meta, stem, Path(history_path), rows_of)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    md_path.write_text(markdown)
    if history_path is not None:
        append_history(rows_of(payload, source_file), Path(history_path))
    return {"json": json_path, "md": md_path, "history": history_path, "removed": removed}


# ----------------------------------------------------------------------------------------------------------------
# Command line and pytest-benchmark entry points
# ----------------------------------------------------------------------------------------------------------------
def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--suite``, ``--results-dir``, ``--out``, ``--history``, ``--no-history``: where a run's results go
    (:func:`publish`)."""
    parser.add_argument("--suite", default=None,
                        help="name of the run: the `suite` of its history rows and the start of its file names "
                             "(default: the device, plus -quick, plus -subset when --cases/--providers select)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="write <suite>-<device>-<date>.json/.md here (default bench/results), replacing the "
                             "earlier files of the same suite and device, and append to history.jsonl here")
    parser.add_argument("--out", type=Path, default=None,
                        help="write exactly PREFIX.json and PREFIX.md instead (nothing replaced; history rows only "
                             "with --history)")
    parser.add_argument("--history", type=Path, default=None, help="append the history rows to this file instead")
    parser.add_argument("--no-history", action="store_true",
                        help="append no history rows (and replace no earlier result file)")


def output_history(args) -> object:
    """The ``history`` argument of :func:`publish` from :func:`add_output_arguments`' options."""
    if args.no_history:
        return None
    return args.history if args.history is not None else _DEFAULT


def main(suites: dict[str, list[Suite]], quick_suites: dict[str, list[Suite]], argv: list[str] | None = None,
         prog: str | None = None) -> list[Result]:
    """``python -m bench.bench_<op> [--device cpu|cuda] [--quick] [--results-dir DIR | --out PREFIX] ...``: measure,
    print the Markdown tables, write the results (``<suite>-<device>-<date>.json`` and ``.md`` in bench/results, the
    earlier files of that suite and device removed) and append one row per measured case to
    bench/results/history.jsonl."""
    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="headline cases only")
    add_output_arguments(parser)
    parser.add_argument("--providers", nargs="+", default=None, metavar="NAME",
                        help=f"only these providers (of {', '.join(PROVIDERS)})")
    parser.add_argument("--cases", nargs="+", default=None, metavar="SUBSTRING",
                        help="only cases whose id contains one of these, e.g. 4096x1000-fp32 or "
                             "4096x1000-fp32-brier-grad-mix_smooth (host-step cases: cpu-4x10-fp32)")
    parser.add_argument("--targets", nargs="+", default=None, choices=TARGET_KINDS, metavar="KIND",
                        help=f"only cases of these target kinds (of {', '.join(TARGET_KINDS)})")
    parser.add_argument("--only-suites", nargs="+", default=None, metavar="NAME",
                        help="only these suites of the run (e.g. cpu-soft-targets); the run's default name is then "
                             "the suite's when there is one")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None,
                        help="repetitions per measurement (default 60 on CPU, 50 on CUDA; host steps: the suite's)")
    parser.add_argument("--max-time", type=float, default=None, help="seconds of timed repetitions per measurement")
    parser.add_argument("--host-rep-ms", type=float, default=20.0,
                        help="host-step suites: milliseconds of back-to-back steps per repetition")
    parser.add_argument("--no-memory", action="store_true", help="skip the peak-memory step")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU)")
    parser.add_argument("--list", action="store_true", help="list the (case, provider) pairs and exit")
    args = parser.parse_args(argv)
    if args.providers:
        unknown = sorted(set(args.providers) - set(PROVIDERS))
        if unknown:
            parser.error(f"unknown provider(s) {unknown}; known: {', '.join(PROVIDERS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.out is not None and args.results_dir is not None:
        parser.error("--out and --results-dir are exclusive")
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = (quick_suites if args.quick else suites)[args.device]
    if args.only_suites:
        unknown = sorted(set(args.only_suites) - {s.name for s in chosen})
        if unknown:
            parser.error(f"unknown suite(s) {unknown} in this run; known: {', '.join(s.name for s in chosen)}")
        chosen = [s for s in chosen if s.name in args.only_suites]
    if args.list:
        for suite, case, provider in _filtered(chosen, args.providers, args.cases, args.targets):
            host = suite.measure == "host_step"
            print(host_case_id(case) + " host_step" if host else case.id, provider.name,
                  unavailable_reason(provider, case, any_weight=host) or "")
        return []
    warmup = args.warmup if args.warmup is not None else 2
    reps = args.reps if args.reps is not None else (60 if args.device == "cpu" else 50)
    max_time = args.max_time if args.max_time is not None else 5.0
    subset = bool(args.cases or args.providers or args.targets)
    if args.suite:
        suite_name = args.suite
    elif args.only_suites and len(chosen) == 1:
        suite_name = chosen[0].name + ("-subset" if subset else "")
    else:
        suite_name = (args.device + ("-quick" if args.quick else "")
                      + ("-subset" if subset or args.only_suites else ""))
    meta = machine_info(args.device)
    meta.update(suite=suite_name, quick=args.quick, suites=[suite.name for suite in chosen], targets=args.targets,
                warmup=warmup, reps=reps, max_time_s=max_time, host_reps=args.reps, host_rep_ms=args.host_rep_ms)
    print(f"[bench] {meta.get('gpu') or meta['cpu']}, torch {meta['torch']}, {meta['torch_threads']} threads",
          file=sys.stderr)
    stopped = None
    try:
        results = run_suites(chosen, warmup=warmup, reps=reps, max_time_s=max_time, memory=not args.no_memory,
                             providers_filter=args.providers, cases_filter=args.cases, host_reps=args.reps,
                             host_rep_ms=args.host_rep_ms, targets_filter=args.targets)
    except RunInterrupted as exc:  # a wall-clock limit's SIGINT: publish what was measured, then stop
        stopped, results = exc, exc.results
    # false: the run was stopped part way, and its files hold the cases measured before that
    meta["complete"] = stopped is None
    table = markdown_table(meta, results)
    written = publish({"meta": meta, "results": [asdict(r) for r in results]}, table, suite=suite_name,
                      rows_of=lambda payload, source: history_rows(payload["meta"], payload["results"], suite_name,
                                                                   source),
                      results_dir=args.results_dir, out=args.out, history=output_history(args))
    print(table)
    print(f"[bench] wrote {written['json']} and {written['md']}"
          + (f"; appended {len(results)} rows to {written['history']}" if written["history"] else "")
          + (f"; removed {', '.join(written['removed'])}" if written["removed"] else ""), file=sys.stderr)
    if stopped is not None:
        print(f"[bench] interrupted: the files hold the {len(results)} results measured before it "
              "(meta.complete = false)", file=sys.stderr)
        raise stopped
    return results


def run_pytest_benchmark(benchmark, provider_name: str, case: Case, *, rounds: int | None = None,
                         warmup_rounds: int = 2) -> None:
    """Body of a pytest-benchmark test: one (case, provider) pair, grouped by case so providers sit side by side.

    Uses ``benchmark.pedantic`` with a per-round ``setup`` (the fresh non-leaf logits copy, untimed). pytest-benchmark
    times with the host clock, so on CUDA the step ends with a synchronisation; the script's CUDA-event numbers are
    the primary GPU numbers.
    """
    import pytest

    provider = PROVIDERS[provider_name]
    reason = unavailable_reason(provider, case)
    if reason is not None:
        pytest.skip(reason)
    step = build_step(provider, case)
    leaf, target = make_inputs(case)

    def setup():
        return (_fresh_logits(leaf), target), {}

    def timed(logits, tgt):
        step(logits, tgt)
        _sync(case.device)

    if rounds is None:
        rounds = 20 if case.device == "cuda" else 5
    benchmark.group = case.id
    benchmark.name = provider_name
    benchmark.extra_info.update(case=asdict(case), min_traffic_bytes=case.min_traffic_bytes)
    benchmark.pedantic(timed, setup=setup, rounds=rounds, warmup_rounds=warmup_rounds, iterations=1)
    stats = getattr(benchmark, "stats", None)
    median_s = getattr(getattr(stats, "stats", None), "median", None)
    if median_s:
        benchmark.extra_info["gb_per_s"] = case.min_traffic_bytes / median_s / 1e9
    benchmark.extra_info["peak_extra_mb"] = peak_extra_memory(step, leaf, target) / MB
    leaf.grad = None
