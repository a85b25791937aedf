"""How the loss bench times a step and measures its memory: the same rules for every provider.

Fairness rules of a timed step (``Suite(measure="step")``, :func:`time_steps`):

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
* Peak extra memory (:func:`peak_extra_memory`): the peak of memory allocated during the step **above what existed
  before it** (the leaf, its non-leaf copy and the targets). A fused kernel needs one ``N×C`` buffer (the gradient)
  and, with ``inplace=True``, none (the gradient overwrites the logits copy). Also reported in units of
  ``N·C·bytes`` ("×NC").

  - CUDA: ``torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated()`` measured around one step after
    ``reset_peak_memory_stats()``.
  - CPU: CPU tensors have no allocator counters, so one extra (untimed) step runs under
    ``torch.profiler.profile(profile_memory=True)``; its ``[memory]`` records (every allocation ``+bytes`` and free
    ``-bytes`` of the CPU allocator, with time stamps) are sorted by time and the peak of their running sum is the
    peak extra memory. Frees of blocks allocated before the profiler started count as negative (they lower the
    running sum), so the number is "peak above the level at the start". Allocations made on OpenMP worker threads
    are attributed by the allocator to the same process and are recorded too (the profiler's memory reporting hooks
    the allocator, not the operators).

Host-step suites (``Suite(measure="host_step")``, :func:`time_host_steps`): the host cost of an eager training step
at shapes where the kernel's work is negligible. Each provider reuses a leaf of its own (the same values for all) and
``leaf.grad`` is set to ``None`` before each step, as a training loop's ``zero_grad(set_to_none=True)`` does, with no
per-step copy, except for an in-place provider (``Provider.inplace``, e.g. Liger, which overwrites its logits with
their gradient): it gets a fresh non-leaf copy per step, the copies of a repetition made before its timer starts (so
it never changes its own or another provider's logits); one repetition times ``k`` back-to-back
steps (``k`` chosen so that a repetition lasts about ``host_rep_ms``) and records the time per step; the providers'
repetitions are interleaved.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from bench.cases import Step, fresh_logits


def sync(device: str) -> None:
    """Wait for the device's queued work (CUDA); nothing on the CPU."""
    if device == "cuda":
        torch.cuda.synchronize()


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
            sync(device)
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
            logits = fresh_logits(leaf)
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
            logits = fresh_logits(leaf)
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
            sync(device)
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
        sync(device)
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
                sync(device)
                start = time.perf_counter()
                _host_steps(steps[name], own_leaf, own_target, count, fresh=fresh)
                sync(device)
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
    sync(device)
    times: list[float] = []
    for i in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(1e3 * (time.perf_counter() - start))
        if i + 1 >= min_reps and sum(times) > 1e3 * max_time_s:
            break
    return Timing(statistics.median(times), min(times), max(times), len(times), times)



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
    logits = fresh_logits(leaf)
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
        logits = None  # released here (the profiled closure reads it first)
        leaf.grad = None
