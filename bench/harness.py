"""The one benchmark harness of calibkernels: providers, inputs, timing, peak memory, correctness check, JSON/Markdown.

What is measured (issues 3, 4, 5): one **training step of the loss**, forward + backward, for logits ``(N, C)`` and
int64 targets, i.e. ``loss = f(logits, target); loss.backward()``, until the gradient sits in ``leaf.grad``.

Fairness rules, the same for every provider:

* Each repetition starts from a fresh **non-leaf** copy of the logits, ``logits = leaf.clone()``, made *outside* the
  timed region. It stands in for a layer's output (what the logits are in training), which is what
  ``inplace=True`` requires, and its ``CloneBackward`` passes the gradient through without a copy (autograd's
  ``AccumulateGrad`` then steals it into ``leaf.grad``), so the clone costs no provider anything inside the timed
  region. ``leaf.grad`` is reset to ``None`` before each repetition, so no provider pays for gradient accumulation.
* Timed region: the provider's step (forward + ``backward()``) and, on CUDA, nothing else: CUDA events bracket the
  step on the stream; the L2 cache is flushed (a 256 MiB ``zero_``) before each repetition, as
  ``triton.testing.do_bench`` does. We do not call ``do_bench`` itself because it cannot run an untimed setup
  (the fresh logits copy) before each repetition. On the CPU: ``time.perf_counter`` around the step.
* Reported time: the **median** over repetitions, after warm-up repetitions (which also absorb ``torch.compile``'s
  compilation and Triton's JIT). ``torch._dynamo.reset()`` runs before each compiled provider is built, so every
  case gets its own static-shape graph and the recompile limit is never hit.
* Bandwidth: ``2·N·C·bytes / time`` (read the logits once, write the gradient once: the minimum traffic of a fused
  step; target and loss are negligible). It is an "effective" bandwidth: a provider that moves more data than that
  minimum still gets credit only for the minimum.
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

Providers (Liger-Kernel's naming; ``PROVIDERS``): ``calibkernels_cpu``/``_cuda``/``_triton`` (the fused kernels),
the same with ``_inplace``, ``reference`` (eager :func:`calibkernels.reference.uncertainty_weighted_ce`),
``reference_compiled`` (``torch.compile`` of a function that calls the reference and then ``.backward()``),
``torch_cross_entropy`` (``F.cross_entropy``, weight ``"none"`` only) and ``liger_cross_entropy`` (Liger-Kernel's
fused cross-entropy, weight ``"none"`` only, CUDA, when ``liger_kernel`` is importable).

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
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import _backends
from calibkernels import reference as ck_reference

__all__ = [
    "Case",
    "Provider",
    "Suite",
    "Result",
    "PROVIDERS",
    "DTYPES",
    "make_inputs",
    "unavailable_reason",
    "build_step",
    "time_steps",
    "time_step",
    "bench_case",
    "time_fn",
    "rows_to_markdown",
    "peak_extra_memory",
    "check_provider",
    "check_tolerance",
    "bench_one",
    "run_suites",
    "machine_info",
    "write_json",
    "markdown_table",
    "main",
]

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
MB = 1e6  # reported memory is in MB (10^6 bytes), bandwidth in GB/s (10^9 bytes/s)


# ----------------------------------------------------------------------------------------------------------------
# Cases, providers, suites
# ----------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    """One benchmark input: logits ``(n, c)`` of ``dtype`` on ``device``, loss ``weight``/``mode`` (mean reduction)."""

    n: int
    c: int
    dtype: str = "fp32"  # a key of DTYPES
    weight: str = "brier"
    mode: str = "grad"
    device: str = "cpu"

    def __post_init__(self):
        if self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; expected one of {sorted(DTYPES)}")
        if self.n <= 0 or self.c <= 0:
            raise ValueError(f"N and C must be positive, got ({self.n}, {self.c})")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    @property
    def id(self) -> str:
        return f"{self.device}-{self.n}x{self.c}-{self.dtype}-{self.weight}-{self.mode}"

    @property
    def nc_bytes(self) -> int:
        """Bytes of one ``N×C`` buffer in the logits' dtype."""
        return self.n * self.c * torch.empty((), dtype=self.torch_dtype).element_size()

    @property
    def min_traffic_bytes(self) -> int:
        """``2·N·C·bytes``: read the logits once, write the gradient once."""
        return 2 * self.nc_bytes


# A step takes (logits, target) and runs forward + backward; it returns the (detached) loss.
Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class Provider:
    """One implementation being benchmarked.

    ``make_step(case)`` returns the step function; ``weights`` restricts the cases it applies to (``None``: all);
    ``requires(device)`` returns ``None`` when it can run on that device, else the reason it cannot.
    """

    name: str
    label: str
    devices: tuple[str, ...]
    make_step: Callable[[Case], Step]
    requires: Callable[[torch.device], str | None] = lambda device: None
    weights: tuple[str, ...] | None = None
    inplace: bool = False

    def applies_to(self, case: Case) -> bool:
        return case.device in self.devices and (self.weights is None or case.weight in self.weights)


@dataclass(frozen=True)
class Suite:
    """Cases crossed with providers (each provider runs the cases it applies to)."""

    name: str
    cases: tuple[Case, ...]
    providers: tuple[str, ...]


def _backend_step(backend: str, inplace: bool) -> Callable[[Case], Step]:
    def make(case: Case) -> Step:
        def step(logits, target):
            loss = ck.uncertainty_weighted_ce(logits, target, weight=case.weight, mode=case.mode, backend=backend,
                                              inplace=inplace)
            loss.backward()
            return loss.detach()

        return step

    return make


def _reference_eager(case: Case) -> Step:
    def step(logits, target):
        loss = ck_reference.uncertainty_weighted_ce(logits, target, weight=case.weight, mode=case.mode)
        loss.backward()
        return loss.detach()

    return step


def _reference_compiled(case: Case) -> Step:
    # A fresh Dynamo cache per case: every case gets its own static-shape graph (no dynamic-shape recompile after
    # the first shape, no recompile limit across the ~12 cases of a suite).
    torch._dynamo.reset()
    # Dynamo compiles the forward (with its AOTAutograd backward) and graph-breaks at .backward(), which then runs
    # the compiled backward graph: "torch.compile of the reference" as a user would write it.
    return torch.compile(_reference_eager(case))


def _torch_cross_entropy(case: Case) -> Step:
    def step(logits, target):
        loss = F.cross_entropy(logits, target)
        loss.backward()
        return loss.detach()

    return step


def _liger_cross_entropy(case: Case) -> Step:
    from liger_kernel.transformers import LigerCrossEntropyLoss

    criterion = LigerCrossEntropyLoss(reduction="mean")

    def step(logits, target):
        loss = criterion(logits, target)
        if isinstance(loss, tuple):  # versions that also return the z-loss / accuracy
            loss = loss[0]
        loss.backward()
        return loss.detach()

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
                 _needs_backend("cpu")),
        Provider("calibkernels_cpu_inplace", "calibkernels C++ (cpu), inplace", ("cpu",), _backend_step("cpu", True),
                 _needs_backend("cpu"), inplace=True),
        Provider("calibkernels_triton", "calibkernels Triton", ("cuda",), _backend_step("triton", False),
                 _needs_backend("triton")),
        Provider("calibkernels_triton_inplace", "calibkernels Triton, inplace", ("cuda",),
                 _backend_step("triton", True), _needs_backend("triton"), inplace=True),
        Provider("calibkernels_cuda", "calibkernels CUDA C++", ("cuda",), _backend_step("cuda", False),
                 _needs_backend("cuda")),
        Provider("calibkernels_cuda_inplace", "calibkernels CUDA C++, inplace", ("cuda",),
                 _backend_step("cuda", True), _needs_backend("cuda"), inplace=True),
        Provider("reference", "eager reference", ("cpu", "cuda"), _reference_eager),
        Provider("reference_compiled", "torch.compile(reference)", ("cpu", "cuda"), _reference_compiled,
                 _needs_compile),
        Provider("torch_cross_entropy", "F.cross_entropy", ("cpu", "cuda"), _torch_cross_entropy,
                 weights=("none",)),
        Provider("liger_cross_entropy", "Liger-Kernel cross-entropy", ("cuda",), _liger_cross_entropy,
                 _needs_module("liger_kernel"), weights=("none",), inplace=True),
    ]
}


def unavailable_reason(provider: Provider, case: Case) -> str | None:
    """``None`` if ``provider`` can run ``case`` here, else why not (no GPU, backend not built, not installed)."""
    if not provider.applies_to(case):
        return f"{provider.name} does not apply to {case.id}"
    if case.device == "cuda" and not torch.cuda.is_available():
        return "no CUDA device"
    return provider.requires(torch.device(case.device))


def build_step(provider: Provider, case: Case) -> Step:
    reason = unavailable_reason(provider, case)
    if reason is not None:
        raise RuntimeError(f"provider {provider.name!r} cannot run {case.id}: {reason}")
    return provider.make_step(case)


# ----------------------------------------------------------------------------------------------------------------
# Inputs
# ----------------------------------------------------------------------------------------------------------------
def make_inputs(case: Case, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Leaf logits ``(N, C)`` (``requires_grad``) ~ 𝒩(0, 2²), uniform targets in ``[0, C)``, on the case's device.

    A scale of 2 gives a spread of confidences (neither uniform softmax nor one-hot), so every branch of the weight
    is exercised; the values do not change the work of any provider. Generated with a fixed seed so every provider
    sees the same data.
    """
    generator = torch.Generator(device="cpu").manual_seed(seed)
    logits = (2.0 * torch.randn(case.n, case.c, generator=generator)).to(device=case.device, dtype=case.torch_dtype)
    target = torch.randint(0, case.c, (case.n,), generator=generator).to(case.device)
    return logits.requires_grad_(), target


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


def time_steps(steps: dict[str, Step], leaf: torch.Tensor, target: torch.Tensor, *, warmup: int = 2,
               reps: int = 10, min_reps: int = 3, max_time_s: float = 5.0,
               on_error: Callable[[str, Exception], None] | None = None) -> dict[str, Timing]:
    """Median time of each step, **interleaved**: repetition ``r`` runs every step once (in an order rotated by one
    each repetition) before repetition ``r + 1`` starts, so load from other processes on a shared machine hits all
    providers alike instead of whichever happened to run during a busy second.

    Each step gets ``warmup`` untimed repetitions, then up to ``reps`` timed ones; a step drops out early once it has
    ``min_reps`` and its timed repetitions have used ``max_time_s`` (so a slow eager reference does not dominate the
    run time, and fast kernels still get all ``reps``). Fresh non-leaf logits copy per repetition, made untimed.
    A step that raises is dropped and reported through ``on_error`` (re-raised when ``on_error`` is None).
    """
    device = leaf.device.type
    names = list(steps)

    def failed(name, exc):
        names.remove(name)
        if on_error is None:
            raise exc
        on_error(name, exc)

    for name in list(names):
        try:
            for _ in range(warmup):
                steps[name](_fresh_logits(leaf), target)
            _sync(device)
        except Exception as exc:  # noqa: BLE001 - reported to the caller
            failed(name, exc)
    times: dict[str, list[float]] = {name: [] for name in names}
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=leaf.device) if device == "cuda" else None
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
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    steps[name](logits, target)
                    end.record()
                    pending[name].append((start, end))
                else:
                    start_s = time.perf_counter()
                    steps[name](logits, target)
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
    return {name: Timing(statistics.median(t), min(t), max(t), len(t), t) for name, t in times.items() if t}


def time_step(step: Step, leaf: torch.Tensor, target: torch.Tensor, *, warmup: int = 2, reps: int = 10,
              min_reps: int = 3, max_time_s: float = 5.0) -> Timing:
    """:func:`time_steps` for a single step."""
    return time_steps({"step": step}, leaf, target, warmup=warmup, reps=reps, min_reps=min_reps,
                      max_time_s=max_time_s)["step"]


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
def _cpu_peak_from_profiler(run: Callable[[], None]) -> int:
    from torch.profiler import ProfilerActivity, profile

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
    """Run one step of ``provider`` and of the float64 reference on the same inputs.

    Returns ``(loss, grad, ref_loss, ref_grad)``; the provider's values are in the logits' dtype, the reference's in
    float64 (the inputs cast exactly to float64), so callers can compare with a tolerance suited to the dtype.
    """
    step = step or build_step(provider, case)
    leaf, target = make_inputs(case, seed)
    loss = step(_fresh_logits(leaf), target)
    grad = leaf.grad.detach().clone()
    leaf.grad = None
    exact = leaf.detach().double().requires_grad_()
    ref_loss = ck_reference.uncertainty_weighted_ce(exact, target, weight=case.weight, mode=case.mode)
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


def _error_status(exc: Exception) -> str:
    message = str(exc).splitlines()[0] if str(exc) else ""
    return f"error: {type(exc).__name__}: {message}"


def bench_case(case: Case, providers: list[Provider], *, warmup: int = 2, reps: int = 10, max_time_s: float = 5.0,
               memory: bool = True, seed: int = 0) -> list[Result]:
    """Time the providers on one case, interleaved (:func:`time_steps`), then measure each one's peak extra memory.

    Unavailable providers are recorded as skipped and failing ones as errors; neither stops the others.
    """
    results = {p.name: Result(asdict(case), case.id, p.name, p.label, "ok") for p in providers}
    steps: dict[str, Step] = {}
    for provider in providers:
        reason = unavailable_reason(provider, case)
        if reason is not None:
            results[provider.name].status = f"skipped: {reason}"
            continue
        try:
            steps[provider.name] = build_step(provider, case)
        except Exception as exc:  # noqa: BLE001 - one failing provider must not lose the other measurements
            results[provider.name].status = _error_status(exc)
    if not steps:
        return list(results.values())

    def on_error(name, exc):
        results[name].status = _error_status(exc)
        steps.pop(name, None)

    leaf, target = make_inputs(case, seed)
    try:
        timings = time_steps(dict(steps), leaf, target, warmup=warmup, reps=reps, max_time_s=max_time_s,
                             on_error=on_error)
        for name, timing in timings.items():
            result = results[name]
            result.median_ms, result.min_ms, result.max_ms = timing.median_ms, timing.min_ms, timing.max_ms
            result.reps, result.times_ms = timing.reps, [round(t, 4) for t in timing.times_ms]
            result.gb_per_s = case.min_traffic_bytes / (timing.median_ms * 1e-3) / 1e9
        if memory:
            for name in timings:
                try:
                    peak = peak_extra_memory(steps[name], leaf, target)
                    results[name].peak_extra_mb = peak / MB
                    results[name].peak_extra_nc = peak / case.nc_bytes
                except Exception as exc:  # noqa: BLE001
                    results[name].status = _error_status(exc)
    finally:
        del leaf, target, steps
        if case.device == "cuda":
            torch.cuda.empty_cache()
    return list(results.values())


def bench_one(provider: Provider, case: Case, **kwargs) -> Result:
    """:func:`bench_case` for a single provider."""
    return bench_case(case, [provider], **kwargs)[0]


def _filtered(suites, providers_filter, cases_filter):
    for suite in suites:
        for case in suite.cases:
            if cases_filter and not any(f in case.id for f in cases_filter):
                continue
            for name in suite.providers:
                if providers_filter and name not in providers_filter:
                    continue
                if PROVIDERS[name].applies_to(case):
                    yield suite, case, PROVIDERS[name]


def run_suites(suites: list[Suite], *, warmup: int = 2, reps: int = 10, max_time_s: float = 5.0, memory: bool = True,
               providers_filter: list[str] | None = None, cases_filter: list[str] | None = None,
               progress: bool = True) -> list[Result]:
    """Measure every (case, provider) pair of the suites; fills ``speedup_vs_reference`` when the eager reference
    ran on the same case."""
    # group the pairs by case (in order): a case's providers are timed together, interleaved
    groups: dict[Case, list[Provider]] = {}
    for _, case, provider in _filtered(suites, providers_filter, cases_filter):
        if provider not in groups.setdefault(case, []):
            groups[case].append(provider)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: fall back to one line per case
        tqdm = None
    items = list(groups.items())
    bar = tqdm(items, desc="bench", unit="case", file=sys.stderr, disable=not progress) if tqdm else items
    results = []
    for case, providers in bar:
        if tqdm:
            bar.set_postfix_str(f"{case.id} ({len(providers)} providers)")
        elif progress:
            print(f"[bench] {case.id}", file=sys.stderr, flush=True)
        case_results = bench_case(case, providers, warmup=warmup, reps=reps, max_time_s=max_time_s, memory=memory)
        for result in case_results:
            if result.status != "ok" and progress:
                print(f"[bench] {case.id} {result.provider}: {result.status}", file=sys.stderr, flush=True)
        results.extend(case_results)
    reference_ms = {r.case_id: r.median_ms for r in results if r.provider == "reference" and r.status == "ok"}
    for r in results:
        if r.status == "ok" and r.case_id in reference_ms:
            r.speedup_vs_reference = reference_ms[r.case_id] / r.median_ms
    return results


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
        if importlib.util.find_spec(module) is not None:
            try:
                info[module] = __import__(module).__version__
            except Exception:  # a version attribute is a nicety, never a reason to fail
                info[module] = "installed"
    try:
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                            timeout=10, cwd=Path(__file__).resolve().parents[1]).stdout.strip()
        info["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--", "csrc", "calibkernels"],
                                                capture_output=True, text=True, timeout=10,
                                                cwd=Path(__file__).resolve().parents[1]).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    so = sorted(Path(ck.__file__).parent.glob("_C*.so"))
    if so:
        info["extension_mtime"] = _dt.datetime.fromtimestamp(so[0].stat().st_mtime, _dt.timezone.utc).isoformat(
            timespec="seconds")
    return info


def write_json(path: Path, meta: dict, results: list[Result]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1) + "\n")


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def markdown_table(meta: dict, results: list[Result]) -> str:
    """One table, one row per (case, provider), cases in order; skipped/errored providers listed below it."""
    machine = meta.get("gpu") or f"{meta['cpu']} ({meta['cpu_count']} cores, {meta['torch_threads']} torch threads)"
    lines = [
        f"Machine: {machine}; torch {meta['torch']}; {meta['date']}"
        + (f"; commit {meta['git_commit']}{' + local changes' if meta.get('git_dirty') else ''}"
           if meta.get("git_commit") else "")
        + (f"; 1-min load average at start {meta['load_average_1min']}" if meta.get("load_average_1min") is not None
           and meta.get("device") == "cpu" else "")
        + "".join(f"; {k}={v}" for k, v in meta.get("env", {}).items()),
        "",
        "Forward + backward of the mean loss. Time: median over repetitions (providers of a case interleaved), "
        "min: fastest repetition. Speed-up: vs the eager reference on the "
        "same case. GB/s: 2·N·C·bytes / time. Peak extra: peak allocation above the inputs during the step (MB, and "
        "in units of one N×C buffer).",
        "",
        "| N × C | dtype | weight / mode | provider | time (ms) | min (ms) | speed-up vs reference | GB/s "
        "| peak extra (MB) | peak extra (×NC) |",
        "|---|---|---|---|--:|--:|--:|--:|--:|--:|",
    ]
    problems = []
    for r in results:
        c = r.case
        if r.status != "ok":
            problems.append(f"- {r.case_id} / {r.provider}: {r.status}")
            continue
        lines.append(
            f"| {c['n']} × {c['c']} | {c['dtype']} | {c['weight']} / {c['mode']} | {r.label} "
            f"| {_fmt(r.median_ms, '.2f')} | {_fmt(r.min_ms, '.2f')} | {_fmt(r.speedup_vs_reference, '.2f')}"
            f"{'×' if r.speedup_vs_reference is not None else ''} "
            f"| {_fmt(r.gb_per_s, '.1f')} "
            f"| {_fmt(r.peak_extra_mb, '.1f')} | {_fmt(r.peak_extra_nc, '.2f')} |"
        )
    if problems:
        lines += ["", "Not measured:", *problems]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------------------------
# Command line and pytest-benchmark entry points
# ----------------------------------------------------------------------------------------------------------------
def main(suites: dict[str, list[Suite]], quick_suites: dict[str, list[Suite]], argv: list[str] | None = None,
         prog: str | None = None) -> list[Result]:
    """``python -m bench.bench_<op> [--device cpu|cuda] [--quick] [--out PREFIX] ...``: measure, print the Markdown
    table, write ``PREFIX.json`` and ``PREFIX.md``."""
    parser = argparse.ArgumentParser(prog=prog, description=main.__doc__)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="headline cases only, fewer repetitions")
    parser.add_argument("--out", type=Path, default=None,
                        help="output prefix (default bench/results/<device>-<date>[-quick]); .json and .md are added")
    parser.add_argument("--providers", nargs="+", default=None, metavar="NAME",
                        help=f"only these providers (of {', '.join(PROVIDERS)})")
    parser.add_argument("--cases", nargs="+", default=None, metavar="SUBSTRING",
                        help="only cases whose id contains one of these, e.g. 4096x1000-fp32")
    parser.add_argument("--warmup", type=int, default=None)
    parser.add_argument("--reps", type=int, default=None)
    parser.add_argument("--max-time", type=float, default=None, help="seconds of timed repetitions per measurement")
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
    if args.threads:
        torch.set_num_threads(args.threads)
    chosen = (quick_suites if args.quick else suites)[args.device]
    if args.list:
        for _, case, provider in _filtered(chosen, args.providers, args.cases):
            print(case.id, provider.name, unavailable_reason(provider, case) or "")
        return []
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
    reps = args.reps if args.reps is not None else (5 if args.quick else 60 if args.device == "cpu" else 50)
    max_time = args.max_time if args.max_time is not None else (2.0 if args.quick else 5.0)
    meta = machine_info(args.device)
    meta.update(quick=args.quick, warmup=warmup, reps=reps, max_time_s=max_time)
    print(f"[bench] {meta.get('gpu') or meta['cpu']}, torch {meta['torch']}, {meta['torch_threads']} threads",
          file=sys.stderr)
    results = run_suites(chosen, warmup=warmup, reps=reps, max_time_s=max_time, memory=not args.no_memory,
                         providers_filter=args.providers, cases_filter=args.cases)
    out = args.out or Path(__file__).resolve().parent / "results" / (
        f"{args.device}-{_dt.date.today().isoformat()}{'-quick' if args.quick else ''}")
    table = markdown_table(meta, results)
    write_json(out.with_suffix(".json"), meta, results)
    out.with_suffix(".md").write_text(table)
    print(table)
    print(f"[bench] wrote {out.with_suffix('.json')} and {out.with_suffix('.md')}", file=sys.stderr)
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
