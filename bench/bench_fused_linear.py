"""Fused linear + uncertainty-weighted cross-entropy (issue #24): time and peak memory of one training step of the
output layer's loss, ``loss = f(hidden, W, target); loss.backward()``, until ``hidden.grad`` and ``W.grad`` are set.

Providers (each is skipped with the reason where it cannot run):

* ``calibkernels_fused_linear``: :func:`calibkernels.fused_linear_uncertainty_weighted_ce` (default backend and
  chunk size, which its rows' ``config`` records); with ``--chunk-sizes``, ``calibkernels_fused_linear_chunk<K>`` too,
  the same at chunks of K rows;
* ``materialized_calibkernels``: ``logits = hidden @ W.T`` then ``ck.uncertainty_weighted_ce(logits, ...,
  inplace=True)`` (the fused op with the gradient written over the logits: the least memory a materialising step
  needs);
* ``materialized_torch``: ``F.cross_entropy(hidden @ W.T, target)`` (weight ``"none"`` only);
* ``chunked_reference_compiled``: ``torch.compile`` of the pure-PyTorch reference applied chunk by chunk, each chunk
  under ``torch.utils.checkpoint`` (non-reentrant) so that its logits are recomputed in the backward instead of kept
  (same chunk size as ours; compilation happens in the warm-up);
* ``liger_fused_linear_cross_entropy``: Liger-Kernel's ``LigerFusedLinearCrossEntropyLoss`` (weight ``"none"``,
  CUDA, when ``liger_kernel`` is importable);
* ``cut_cross_entropy``: Apple's Cut Cross-Entropy ``linear_cross_entropy`` (weight ``"none"``, CUDA, when
  ``cut_cross_entropy`` is importable), exact: ``filter_eps=None`` (its default, ``"auto"``, skips the gradient
  blocks whose softmax values are below a threshold, less work than an exact gradient; the row's ``config`` says
  ``filter_eps``).

Method (as the loss bench's, ``bench/timing.py``, whose code this script does not use): providers of a case are timed
interleaved after warm-up repetitions; the median and the minimum are reported; CUDA times come from CUDA events
around the step. The providers that compile (``COMPILED``: ``chunked_reference_compiled``, whose warm-up is an
inductor compilation, minutes at the CUDA case's size) are warmed up and timed after every other provider of every
case, interleaved among themselves: a run stopped during a compilation has measured the others already. Peak extra
memory: the peak allocated above the level before the step (which holds ``hidden``, ``W`` and the targets; the
gradients count as extra), by ``torch.cuda.max_memory_allocated`` on CUDA and, on the
CPU, from the allocation records of ``torch.profiler.profile(profile_memory=True)`` (the running sum of every
allocation and free during the step). It is also given in units of the ``N × C`` logits in the input dtype. Each
provider's loss and ``hidden.grad`` are compared with ``calibkernels_fused_linear``'s (max relative difference). A
provider that raises (in its warm-up, its timed repetitions or its memory step) is recorded with the error for that
case, and the others go on.

Usage::

    python -m bench.bench_fused_linear --device cpu                 # N=2048, H=256, C=32000 fp32
    python -m bench.bench_fused_linear --device cuda                # N=8192, H=4096, C=128256 bf16
    python -m bench.bench_fused_linear --device cpu --n 1024 --reps 3 --providers calibkernels_fused_linear

Results: ``bench/results/fused-linear-<device>-<date>.json`` and ``.md`` (``--out`` to change the stem); each JSON
result also carries its row in the ``history.jsonl`` format of bench/README.md (``history_row``). Both files are
written (each replaced whole) after every case's providers are measured, so a run stopped part way (a wall-clock
limit's SIGINT) leaves the rows measured so far; the JSON's ``meta.complete`` is false until the last case.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import importlib.util
import itertools
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import calibkernels as ck
from bench.machine import GIT_DIRTY_SCOPE, package_version
from calibkernels import reference as R
from calibkernels.fused_linear import default_chunk_size

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
DEFAULT_CASES = {"cpu": (2048, 256, 32000, "fp32"), "cuda": (8192, 4096, 128256, "bf16")}
WEIGHTS = (("brier", "grad"), ("none", "grad"))


class Skip(Exception):
    """A provider that cannot run this case (the message says why)."""


# ------------------------------------------------------------------------------------------------------ providers
def _fused_linear(case, chunk_size=None):
    def step(hidden, w, target):
        return ck.fused_linear_uncertainty_weighted_ce(hidden, w, target, uncertainty=case["weight"], mode=case["mode"],
                                                       chunk_size=chunk_size)
    return step


def chunk_provider(chunk_size: int) -> str:
    """The name of ``calibkernels_fused_linear`` at another chunk size (``--chunk-sizes``), registered in
    :data:`PROVIDERS` and :data:`PROVIDER_CONFIG` on first use."""
    name = f"calibkernels_fused_linear_chunk{chunk_size}"
    PROVIDERS.setdefault(name, lambda case: _fused_linear(case, chunk_size))
    PROVIDER_CONFIG.setdefault(name, {"chunk_size": chunk_size})
    return name


def _materialized_calibkernels(case):
    def step(hidden, w, target):
        return ck.uncertainty_weighted_ce(hidden @ w.T, target, uncertainty=case["weight"], mode=case["mode"],
                                          inplace=True)
    return step


def _materialized_torch(case):
    if case["weight"] != "none":
        raise Skip("plain cross-entropy only (weight 'none')")

    def step(hidden, w, target):
        return F.cross_entropy(hidden @ w.T, target)
    return step


def _chunked_reference_compiled(case):
    from torch.utils.checkpoint import checkpoint

    weight, mode = case["weight"], case["mode"]
    chunk = default_chunk_size(case["n"], case["c"], case["h"], DTYPES[case["dtype"]].itemsize, case["device"])

    def chunk_loss(h, w, y):
        return R.uncertainty_weighted_ce(h @ w.T, y, uncertainty=weight, mode=mode, reduction="sum")

    def loss(hidden, w, target):
        total = 0.0
        for start in range(0, hidden.shape[0], chunk):
            total = total + checkpoint(chunk_loss, hidden[start:start + chunk], w, target[start:start + chunk],
                                       use_reentrant=False)
        return total / (target != -100).sum().clamp(min=1)

    torch._dynamo.reset()
    return torch.compile(loss)


def _liger(case):
    if case["weight"] != "none":
        raise Skip("plain cross-entropy only (weight 'none')")
    if case["device"] != "cuda":
        raise Skip("Liger-Kernel runs on CUDA")
    if importlib.util.find_spec("liger_kernel") is None:
        raise Skip("liger_kernel is not installed")
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss_fn = LigerFusedLinearCrossEntropyLoss()

    def step(hidden, w, target):
        return loss_fn(w, hidden, target)
    return step


def _cut_cross_entropy(case):
    if case["weight"] != "none":
        raise Skip("plain cross-entropy only (weight 'none')")
    if case["device"] != "cuda":
        raise Skip("Cut Cross-Entropy's kernels run on CUDA")
    if importlib.util.find_spec("cut_cross_entropy") is None:
        raise Skip("cut_cross_entropy is not installed")
    from cut_cross_entropy import linear_cross_entropy

    def step(hidden, w, target):
        return linear_cross_entropy(hidden, w, target, **PROVIDER_CONFIG["cut_cross_entropy"])
    return step


PROVIDERS = {
    "calibkernels_fused_linear": _fused_linear,
    "materialized_calibkernels": _materialized_calibkernels,
    "materialized_torch": _materialized_torch,
    "chunked_reference_compiled": _chunked_reference_compiled,
    "liger_fused_linear_cross_entropy": _liger,
    "cut_cross_entropy": _cut_cross_entropy,
}
# keywords a provider is called with that change what it computes, recorded in its rows' config: Cut Cross-Entropy
# without its gradient filter (filter_eps="auto" skips small gradient blocks), so that every provider computes the
# exact gradient
PROVIDER_CONFIG = {"cut_cross_entropy": {"filter_eps": None}}
# the providers whose warm-up compiles (torch.compile): measured after all the others (module docstring)
COMPILED = ("chunked_reference_compiled",)
BASE = "calibkernels_fused_linear"  # the provider every other one's loss and hidden.grad are compared with


# ---------------------------------------------------------------------------------------------------- measurement
def _inputs(case, seed=0):
    g = torch.Generator().manual_seed(seed)
    dtype, device = DTYPES[case["dtype"]], case["device"]
    n, h, c = case["n"], case["h"], case["c"]
    hidden = torch.randn(n, h, generator=g).to(device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(c, h, generator=g) / h ** 0.5 * 2).to(device=device, dtype=dtype).requires_grad_()
    target = torch.randint(0, c, (n,), generator=g).to(device)
    return hidden, w, target


def _run_step(step, hidden, w, target):
    hidden.grad = w.grad = None
    loss = step(hidden, w, target)
    loss.backward()
    return loss


def _time_once(step, hidden, w, target, device):
    if device == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        hidden.grad = w.grad = None
        torch.cuda.synchronize()
        start.record()
        loss = step(hidden, w, target)
        loss.backward()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end)
    hidden.grad = w.grad = None
    t0 = time.perf_counter()
    _run_step(step, hidden, w, target)
    return (time.perf_counter() - t0) * 1e3


def _peak_extra_bytes(step, hidden, w, target, device):
    hidden.grad = w.grad = None
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        _run_step(step, hidden, w, target)
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        _run_step(step, hidden, w, target)
    records = sorted((event.start_ns(), event.nbytes()) for event in prof.profiler.kineto_results.events()
                     if event.name() == "[memory]" and event.device_type() == torch.autograd.DeviceType.CPU)
    return max(0, max(itertools.accumulate(nbytes for _, nbytes in records), default=0))


def _relative_difference(a, b):
    return ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp(min=1e-30)).item()


def run_case(case, providers, warmup, reps, max_time_s, memory, base=None):
    """Measure ``providers`` on ``case``; ``(results by provider, base)``, where ``base`` is ``BASE``'s (loss,
    hidden.grad) for the cross-check: measured here when ``BASE`` is among ``providers``, else the one given (from an
    earlier call on the same case, whose inputs are the same)."""
    hidden, w, target = _inputs(case)
    device = case["device"]
    steps, results = {}, {}
    for name in providers:
        try:
            steps[name] = PROVIDERS[name](case)
            results[name] = {"status": "ok", "times_ms": []}
        except Skip as exc:
            results[name] = {"status": f"skipped: {exc}"}
        except Exception as exc:  # a provider failing must not stop the others
            results[name] = {"status": _error(exc)}
        if name in PROVIDER_CONFIG:
            results[name]["config"] = dict(PROVIDER_CONFIG[name])
        elif name == BASE:  # the chunk the default picks for this case
            results[name]["config"] = {"chunk_size": default_chunk_size(
                case["n"], case["c"], case["h"], DTYPES[case["dtype"]].itemsize, device)}
    # warm-up (compilation, JIT), and each provider's result for the cross-check
    outputs = {}
    for name, step in list(steps.items()):
        try:
            for _ in range(warmup):
                loss = _run_step(step, hidden, w, target)
            outputs[name] = (loss.detach().clone(), hidden.grad.clone())
        except Exception as exc:  # a provider failing must not stop the others
            results[name] = {"status": _error(exc), **({"config": results[name]["config"]}
                                                       if "config" in results[name] else {})}
            del steps[name]
    base = outputs.get(BASE, base)
    for name, (loss, grad) in outputs.items():
        if base is not None:
            results[name]["loss_rel_diff"] = _relative_difference(loss, base[0])
            results[name]["grad_hidden_rel_diff"] = _relative_difference(grad, base[1])
    spent = {name: 0.0 for name in steps}
    names = list(steps)
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)] if names else []
        for name in order:
            if rep >= 3 and spent[name] > max_time_s * 1e3:
                continue
            try:
                elapsed = _time_once(steps[name], hidden, w, target, device)
            except Exception as exc:  # a provider failing must not stop the others: its times so far are kept
                results[name]["status"] = _error(exc)
                names.remove(name)
                continue
            results[name]["times_ms"].append(round(elapsed, 4))
            spent[name] += elapsed
    logits_bytes = case["n"] * case["c"] * DTYPES[case["dtype"]].itemsize
    for name in names:
        times = results[name]["times_ms"]
        results[name].update(median_ms=statistics.median(times), min_ms=min(times), max_ms=max(times),
                             reps=len(times))
        if memory:
            try:
                peak = _peak_extra_bytes(steps[name], hidden, w, target, device)
            except Exception as exc:  # the times stay; the row says why it has no memory
                results[name]["status"] = _error(exc)
                continue
            gradient_bytes = (hidden.numel() + w.numel()) * hidden.element_size()
            results[name].update(peak_extra_mb=peak / 1e6, peak_extra_logits=peak / logits_bytes,
                                 peak_above_gradients_logits=(peak - gradient_bytes) / logits_bytes)
    hidden.grad = w.grad = None
    return results, base


def _error(exc: Exception) -> str:
    return f"error: {type(exc).__name__}: {str(exc)[:300]}"


# ------------------------------------------------------------------------------------------------------ reporting
def _git(*args):
    try:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=20,
                              cwd=Path(__file__).resolve().parent.parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None


def _meta(device):
    cpu = platform.processor() or "unknown"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dirty = _git("status", "--porcelain", "--", *GIT_DIRTY_SCOPE)
    meta = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
        "calibkernels": ck.__version__, "cpu": cpu, "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_1min": os.getloadavg()[0] if hasattr(os, "getloadavg") else None, "device": device,
        "git_commit": _git("rev-parse", "--short", "HEAD"), "git_dirty": None if dirty is None else bool(dirty),
        "git_dirty_scope": list(GIT_DIRTY_SCOPE),
    }
    if device == "cuda":
        meta["gpu"] = torch.cuda.get_device_name()
    # the installed distributions' versions (importlib.metadata), for the optional providers too
    for module in ("triton", "liger_kernel", "cut_cross_entropy"):
        version = package_version(module)
        if version is not None:
            meta[module] = version
    return meta


def _case_id(case):
    return f"{case['device']}-{case['n']}x{case['h']}x{case['c']}-{case['dtype']}-{case['weight']}-{case['mode']}"


def _history_row(meta, case, provider, result, source_file):
    """The result as a row of bench/results/history.jsonl (bench/README.md)."""
    device_name = meta.get("gpu") or f"{meta['cpu']} ({meta['cpu_count']} cores, {meta['torch_threads']} torch threads)"
    return {
        "schema": 1, "suite": f"fused-linear-{case['device']}", "kernel": "fused_linear_uncertainty_weighted_ce",
        "device": device_name, "device_type": case["device"], "date": meta["date"], "commit": meta["git_commit"],
        "dirty": meta["git_dirty"], "torch": meta["torch"], "triton": meta.get("triton"), "case_id": _case_id(case),
        "n": case["n"], "c": case["c"], "dtype": case["dtype"], "weight": case["weight"], "mode": case["mode"],
        "provider": provider, "config": {"reduction": "mean", "hidden": case["h"], **(result.get("config") or {})},
        "measure": "step",
        "median_ms": result.get("median_ms"), "min_ms": result.get("min_ms"), "max_ms": result.get("max_ms"),
        "mean_ms": None, "reps": result.get("reps"), "gb_per_s": None, "peak_extra_mb": result.get("peak_extra_mb"),
        "peak_extra_nc": result.get("peak_extra_logits"), "speedup_vs_reference": None, "value": None,
        "status": "ok" if result["status"] == "ok" else result["status"], "times_ms": result.get("times_ms"),
        "extra": {"load_average_1min": meta["load_average_1min"], "loss_rel_diff": result.get("loss_rel_diff"),
                  "grad_hidden_rel_diff": result.get("grad_hidden_rel_diff"),
                  **({"run_complete": False} if meta.get("complete") is False else {})},
        "source_file": source_file,
    }


def _markdown(meta, rows):
    machine = meta.get("gpu") or f"{meta['cpu']} ({meta['cpu_count']} cores, {meta['torch_threads']} torch threads)"
    lines = [f"Machine: {machine}; torch {meta['torch']}; {meta['date']}; commit {meta['git_commit']}"
             f"{' (dirty)' if meta['git_dirty'] else ''}; 1-min load average at start {meta['load_average_1min']}",
             "",
             "One training step of the output layer's mean loss (forward + backward to hidden.grad and W.grad). Time: "
             "median (min) over repetitions, providers interleaved (those that compile among themselves, after the "
             "others). Peak extra: peak allocation above hidden, W and "
             "the targets during the step (the gradients included), in MB and in units of the N × C logits, and "
             "without the gradients' bytes. Diff: "
             "max relative difference of the loss / hidden.grad from calibkernels_fused_linear.",
             "",
             "| N × H × C | dtype | weight / mode | provider | time (ms) | min (ms) | peak extra (MB) | × logits "
             "| above the gradients (× logits) | diff loss / d hidden |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for case, provider, r in rows:
        config = "".join(f" ({key}={value})" for key, value in (r.get("config") or {}).items())
        head = f"| {case['n']} × {case['h']} × {case['c']} | {case['dtype']} | {case['weight']} / {case['mode']} " \
               f"| {provider}{config} "
        if r["status"] != "ok":
            lines.append(head + f"| {r['status']} | | | | | |")
            continue
        mem = (f"{r['peak_extra_mb']:.0f} | {r['peak_extra_logits']:.3f} | {r['peak_above_gradients_logits']:.3f}"
               if "peak_extra_mb" in r else "– | – | –")
        diff = (f"{r['loss_rel_diff']:.1e} / {r['grad_hidden_rel_diff']:.1e}" if "loss_rel_diff" in r else "–")
        lines.append(head + f"| {r['median_ms']:.1f} | {r['min_ms']:.1f} | {mem} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--n", type=int)
    parser.add_argument("--h", type=int)
    parser.add_argument("--c", type=int)
    parser.add_argument("--dtype", choices=tuple(DTYPES))
    parser.add_argument("--weights", nargs="+", default=[f"{w}/{m}" for w, m in WEIGHTS],
                        help="weight/mode pairs, e.g. brier/grad none/grad")
    parser.add_argument("--providers", nargs="+", default=list(PROVIDERS), choices=list(PROVIDERS))
    parser.add_argument("--chunk-sizes", nargs="+", type=int, default=[], metavar="K",
                        help="also time calibkernels_fused_linear at chunks of K rows (beside its default chunk)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reps", type=int, default=None, help="default: 5 on CPU, 20 on CUDA")
    parser.add_argument("--max-time", type=float, default=60.0, help="seconds of timed repetitions per provider")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--out", help="result stem (default bench/results/fused-linear-<device>-<date>)")
    args = parser.parse_args(argv)
    if any(k < 1 for k in args.chunk_sizes):
        parser.error(f"--chunk-sizes must be positive row counts, got {args.chunk_sizes}")
    if args.chunk_sizes:  # beside the default chunk, in the order given
        at = args.providers.index(BASE) + 1 if BASE in args.providers else 0
        args.providers[at:at] = [chunk_provider(k) for k in dict.fromkeys(args.chunk_sizes)]
    n, h, c, dtype = DEFAULT_CASES[args.device]
    n, h, c, dtype = args.n or n, args.h or h, args.c or c, args.dtype or dtype
    reps = args.reps or (5 if args.device == "cpu" else 20)
    meta = _meta(args.device)
    stem = args.out or str(Path(__file__).resolve().parent / "results" /
                           f"fused-linear-{args.device}-{meta['date'][:10]}")
    source_file = f"bench/results/{Path(stem).name}.json"
    cases = []
    for pair in args.weights:
        weight, mode = pair.split("/")
        cases.append(dict(n=n, h=h, c=c, dtype=dtype, weight=weight, mode=mode, device=args.device))
    groups = [[p for p in args.providers if p not in COMPILED], [p for p in args.providers if p in COMPILED]]
    plan = [(group, i, case) for group in groups if group for i, case in enumerate(cases)]
    measured, bases = [], {}  # (case index, provider index, case, provider, result); BASE's outputs by case
    Path(stem).parent.mkdir(parents=True, exist_ok=True)
    for step, (group, i, case) in enumerate(plan):
        print(f"case {_case_id(case)}: {' '.join(group)}", file=sys.stderr, flush=True)
        results, bases[i] = run_case(case, group, args.warmup, reps, args.max_time, not args.no_memory, bases.get(i))
        measured += [(i, args.providers.index(p), case, p, r) for p, r in results.items()]
        markdown = _write(stem, meta, sorted(measured, key=lambda m: m[:2]), source_file,
                          complete=step == len(plan) - 1)
    print(markdown)
    print(f"wrote {stem}.json and .md", file=sys.stderr)


def _write(stem, meta, measured, source_file, complete):
    """Replace ``stem``.json and .md with the rows measured so far (each file written beside and renamed, so that a
    run stopped while writing leaves the previous version); returns the Markdown. ``meta.complete`` is false until the
    last case, and so is each history row's ``extra.run_complete`` (as the harness writes them)."""
    meta = {**meta, "complete": complete}
    results = [{"case": case, "case_id": _case_id(case), "provider": provider, **r,
                "history_row": _history_row(meta, case, provider, r, source_file)}
               for _, _, case, provider, r in measured]
    markdown = _markdown(meta, [(case, provider, r) for _, _, case, provider, r in measured])
    for suffix, text in ((".json", json.dumps({"meta": meta, "results": results}, indent=1)),
                         (".md", markdown)):
        partial = Path(stem + suffix + ".partial")
        partial.write_text(text)
        os.replace(partial, stem + suffix)
    return markdown


if __name__ == "__main__":
    main()
