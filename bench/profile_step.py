"""Where a provider's training step spends its time: GPU kernels one by one, and the host's launch time.

    python -m bench.profile_step --cases 8192x32000-bf16-brier [--providers calibkernels_triton ...] [--out DIR]

For each case × provider: the loss bench's step (fresh non-leaf logits, forward + ``backward()``, :mod:`bench.timing`)
runs under ``torch.profiler`` a few times after warm-up; printed are the kernels with their mean device time per step,
the sum of kernel time per step, the host time to *issue* the step (no synchronisation) and the synchronised wall
time of one step. When the host time is close to or above the kernel sum, the step is launch-bound and a faster kernel
will not show in the harness's CUDA-event time. Measures; asserts nothing. A provider that cannot run a case here is
named with the reason (``skip:`` lines on stderr); when none of the pairs can run, the script ends with one ``error:``
line and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from bench.cases import DTYPES, Case, make_inputs
from bench.providers import PROVIDERS, build_step, unavailable_reason

DEFAULT_PROVIDERS = ("calibkernels_triton", "calibkernels_triton_inplace", "calibkernels_cuda", "reference_compiled",
                     "torch_cross_entropy", "liger_cross_entropy")


def parse_case(text: str, device: str) -> Case:
    """``NxC-dtype-weight[-mode]``, e.g. ``8192x32000-bf16-brier``."""
    shape, dtype, weight, *mode = text.split("-")
    n, c = (int(v) for v in shape.split("x"))
    if dtype not in DTYPES:
        raise SystemExit(f"unknown dtype {dtype!r} in {text!r}")
    return Case(n, c, dtype, weight, mode[0] if mode else "grad", device)


def profile_step(provider_name: str, case: Case, steps: int = 5) -> dict:
    step = build_step(PROVIDERS[provider_name], case)
    leaf, target = make_inputs(case)
    sync = torch.cuda.synchronize if case.device == "cuda" else (lambda: None)
    for _ in range(3):
        leaf.grad = None
        step(leaf.clone(), target)
    sync()
    issue_ms, wall_ms = [], []
    for _ in range(steps):
        leaf.grad = None
        logits = leaf.clone()
        sync()
        t0 = time.perf_counter()
        step(logits, target)
        t1 = time.perf_counter()
        sync()
        issue_ms.append(1e3 * (t1 - t0))
        wall_ms.append(1e3 * (time.perf_counter() - t0))
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if case.device == "cuda" else [])
    fresh = [leaf.clone() for _ in range(steps)]  # made before profiling: the copies are setup, not the step
    sync()
    with profile(activities=activities) as prof:
        for logits in fresh:
            leaf.grad = None
            step(logits, target)
        sync()
    del fresh
    kernels = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            kernels.setdefault(event.name, []).append(event.device_time)
    rows = sorted(((name, sum(t) / steps / 1e3, len(t) / steps) for name, t in kernels.items()),
                  key=lambda row: -row[1])
    return {
        "provider": provider_name, "case": case.id,
        "issue_ms": statistics.median(issue_ms), "wall_ms": statistics.median(wall_ms),
        "kernels": [{"name": name[:110], "ms_per_step": ms, "launches_per_step": n} for name, ms, n in rows],
    }


def host_profile(provider_name: str, case: Case, steps: int = 300) -> None:
    """Print the Python functions that take the host's time in ``steps`` steps (cProfile, by own time)."""
    import cProfile
    import pstats

    step = build_step(PROVIDERS[provider_name], case)
    leaf, target = make_inputs(case)
    for _ in range(10):
        leaf.grad = None
        step(leaf.clone(), target)
    profiler = cProfile.Profile()
    for _ in range(steps):
        # one fresh copy at a time, made while the profiler is off: copies made up front for all steps (as before)
        # ran an H200 out of memory at 8192 x 32000
        leaf.grad = None
        logits = leaf.clone()
        profiler.enable()
        step(logits, target)
        profiler.disable()
    print(f"\n== host profile: {case.id} · {provider_name}, {steps} steps", flush=True)
    pstats.Stats(profiler).sort_stats("tottime").print_stats(22)


def runnable_pairs(cases: list[Case], providers: list[str]) -> list[tuple[Case, str]]:
    """The (case, provider) pairs that can run here; each other one is printed to stderr with the reason
    (``skip: <case> <provider>: <reason>``). None at all: one ``error:`` line and exit status 2."""
    pairs = []
    for case in cases:
        for name in providers:
            reason = unavailable_reason(PROVIDERS[name], case)
            if reason is None:
                pairs.append((case, name))
            else:
                print(f"skip: {case.id} {name}: {reason}", file=sys.stderr, flush=True)
    if not pairs:
        print(f"error: no provider can run any of the cases here (device {cases[0].device if cases else '?'}; "
              "the skip lines above say why)", file=sys.stderr, flush=True)
        raise SystemExit(2)
    return pairs


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.profile_step", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--cases", nargs="+", default=["8192x32000-bf16-brier", "8192x32000-bf16-none"])
    parser.add_argument("--providers", nargs="+", default=list(DEFAULT_PROVIDERS))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    parser.add_argument("--host-profile", action="store_true",
                        help="instead: cProfile of 300 steps per case × provider (where the host time goes)")
    args = parser.parse_args(argv)
    unknown = sorted(set(args.providers) - set(PROVIDERS))
    if unknown:
        parser.error(f"unknown provider(s) {unknown}; known: {', '.join(PROVIDERS)}")
    pairs = runnable_pairs([parse_case(text, args.device) for text in args.cases], args.providers)
    if args.host_profile:
        for case, name in pairs:
            host_profile(name, case)
        return
    results = []
    for case, name in pairs:
        result = profile_step(name, case, args.steps)
        results.append(result)
        print(f"\n== {case.id} · {name}: issue {result['issue_ms']:.3f} ms (host), wall {result['wall_ms']:.3f} ms "
              f"(synchronised), kernels {sum(k['ms_per_step'] for k in result['kernels']):.3f} ms", flush=True)
        for k in result["kernels"]:
            print(f"   {k['ms_per_step']:8.3f} ms  ×{k['launches_per_step']:.0f}  {k['name']}")
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
