"""Launch-shape comparison of the CUDA C++ kernel's streaming path (C > 4096; run on a GPU machine).

    python3 -m bench.tune_cuda --out DIR [--configs 256x16 256x32 512x16 512x32] [--classes 32000 128256]
                               [--dtypes bf16 fp32] [--rows 8192] [--reps 50]

The kernel reads ``CALIBKERNELS_CUDA_STREAM_CONFIG`` once per process, so each configuration runs in its own
subprocess (this module with ``--worker``). A worker times one training step (forward + backward of the mean loss,
weight brier, mode grad) of the ``calibkernels_cuda`` provider with :mod:`bench.harness` (fresh non-leaf logits per
repetition, L2 flushed, CUDA events, median), interleaved with the ``--baselines`` providers (Triton by default) so
that every configuration is compared with Triton measured in the same process; it also records the name of the kernel
that ran (proof that the configuration took effect) and checks a 16-row step against the float64 reference.

Prints a Markdown table and writes DIR/tune-cuda.json and DIR/tune-cuda.md.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import torch

STREAM_ENV = "CALIBKERNELS_CUDA_STREAM_CONFIG"
CONFIGS = ("256x16", "256x32", "512x16", "512x32")  # threads per row x values per thread; the first is the default


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python3 -m bench.tune_cuda", description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="output folder (default bench/results/tune-cuda-<date>)")
    parser.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=CONFIGS)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--classes", type=int, nargs="+", default=[32000, 128256])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp32", "fp16"])
    parser.add_argument("--baselines", nargs="*", default=["calibkernels_triton"],
                        help="providers timed alongside calibkernels_cuda in every worker (none: --baselines)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--max-time", type=float, default=5.0, help="seconds of timed repetitions per measurement")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, default=None, help=argparse.SUPPRESS)
    return parser


def _kernel_names(step, leaf, target) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    logits = leaf.clone()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step(logits, target)
        torch.cuda.synchronize()
    leaf.grad = None
    return sorted({e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
                   and "uncertainty_weighted_ce_kernel" in e.name})


def _check(provider, case) -> str:
    """A 16-row step against the float64 reference (harness.check_tolerance, as tests/test_bench.py)."""
    from bench import harness

    small = harness.Case(16, case.c, case.dtype, case.weight, case.mode, "cuda")
    try:
        loss, grad, ref_loss, ref_grad = harness.check_provider(provider, small, seed=1234)
        rtol, atol = harness.check_tolerance(case.dtype)
        torch.testing.assert_close(loss.double().cpu(), ref_loss.cpu(), rtol=rtol, atol=atol)
        torch.testing.assert_close(grad.double().cpu(), ref_grad.cpu(), rtol=rtol, atol=atol)
    except Exception as exc:  # noqa: BLE001 - recorded next to the timing, never hidden
        return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
    return "ok"


def _worker(args) -> None:
    from bench import harness

    assert os.environ.get(STREAM_ENV) == args.worker, "the parent sets the configuration in the environment"
    rows = []
    for c in args.classes:
        for dtype in args.dtypes:
            case = harness.Case(args.rows, c, dtype, "brier", "grad", "cuda")
            names = ["calibkernels_cuda"] + [p for p in args.baselines if p != "calibkernels_cuda"]
            steps, skipped = {}, {}
            for name in names:
                reason = harness.unavailable_reason(harness.PROVIDERS[name], case)
                if reason is None:
                    steps[name] = harness.build_step(harness.PROVIDERS[name], case)
                else:
                    skipped[name] = reason
            leaf, target = harness.make_inputs(case)
            errors = {}
            timings = harness.time_steps(steps, leaf, target, warmup=args.warmup, reps=args.reps,
                                         max_time_s=args.max_time,
                                         on_error=lambda name, exc: errors.__setitem__(name, repr(exc)[:300]))
            kernels = _kernel_names(steps["calibkernels_cuda"], leaf, target) if "calibkernels_cuda" in timings else []
            del leaf, target
            torch.cuda.empty_cache()
            for name in names:
                row = {"config": args.worker, "case": case.id, "n": case.n, "c": c, "dtype": dtype, "provider": name}
                if name in timings:
                    t = timings[name]
                    row.update(median_ms=t.median_ms, min_ms=t.min_ms, max_ms=t.max_ms, reps=t.reps,
                               gb_per_s=case.min_traffic_bytes / t.median_ms / 1e6)
                    if name == "calibkernels_cuda":
                        row.update(kernels=kernels, check=_check(harness.PROVIDERS[name], case))
                else:
                    row["status"] = skipped.get(name) or errors.get(name) or "not measured"
                rows.append(row)
                print(json.dumps(row), file=sys.stderr, flush=True)
    args.worker_out.write_text(json.dumps(rows))


def _markdown(rows: list[dict], configs: list[str], baselines: list[str]) -> str:
    """One line per case: each baseline (median over the workers), each configuration, and the fastest of them."""
    from bench.harness import rows_to_markdown

    by_key = {(r["config"], (r["n"], r["c"], r["dtype"]), r["provider"]): r for r in rows}
    cases = list(dict.fromkeys((r["n"], r["c"], r["dtype"]) for r in rows))

    def fmt(value):
        return "–" if value is None else f"{value:.3f}"

    headers = (["N × C", "dtype"] + [f"{b} ms (median over workers)" for b in baselines]
               + [f"CUDA {c}{' (default)' if c == CONFIGS[0] else ''} ms" for c in configs] + ["fastest CUDA"])
    table = []
    for case in cases:
        base = []
        for b in baselines:
            values = sorted(r["median_ms"] for c in configs if "median_ms" in (r := by_key.get((c, case, b), {})))
            base.append(values[len(values) // 2] if values else None)
        cuda = {c: by_key.get((c, case, "calibkernels_cuda"), {}) for c in configs}
        cells = [fmt(r.get("median_ms")) + (" (!)" if r.get("check", "ok") != "ok" else "") for r in cuda.values()]
        measured = {c: r["median_ms"] for c, r in cuda.items() if "median_ms" in r and r.get("check") == "ok"}
        best = min(measured, key=measured.get) if measured else None
        best_cell = "–" if best is None else best + (
            f", {measured[best] / base[0]:.2f}× {baselines[0]}" if base and base[0] else "")
        table.append([f"{case[0]} × {case[1]}", case[2], *map(fmt, base), *cells, best_cell])
    notes = [f"- {r['config']} {r['case']} {r['provider']}: {r.get('status') or 'check: ' + r['check']}"
             for r in rows if "status" in r or r.get("check", "ok") != "ok"]
    return rows_to_markdown(headers, table) + ("\n(!) not measured, or wrong against the reference:\n"
                                               + "\n".join(notes) + "\n" if notes else "")


def main(argv=None) -> dict:
    args = _parser().parse_args(argv)
    if args.worker is not None:
        _worker(args)
        return {}
    if not torch.cuda.is_available():
        _parser().error("needs a CUDA device")
    import datetime as _dt

    from bench.harness import machine_info

    root = Path(__file__).resolve().parents[1]
    out = args.out or root / "bench" / "results" / f"tune-cuda-{_dt.date.today().isoformat()}"
    out.mkdir(parents=True, exist_ok=True)
    meta = machine_info("cuda")
    meta.update(rows=args.rows, warmup=args.warmup, reps=args.reps, max_time_s=args.max_time, weight="brier",
                mode="grad", baselines=args.baselines)
    rows, failures = [], {}
    for config in args.configs:
        worker_out = out / f".worker-{config}.json"
        worker_out.unlink(missing_ok=True)
        env = dict(os.environ, **{STREAM_ENV: config})
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(root), env.get("PYTHONPATH")) if p)
        cmd = [sys.executable, "-m", "bench.tune_cuda", "--worker", config, "--worker-out", str(worker_out),
               "--rows", str(args.rows), "--classes", *map(str, args.classes), "--dtypes", *args.dtypes,
               "--warmup", str(args.warmup), "--reps", str(args.reps), "--max-time", str(args.max_time),
               "--baselines", *args.baselines]
        print(f"[tune_cuda] {STREAM_ENV}={config}", file=sys.stderr, flush=True)
        result = subprocess.run(cmd, cwd=root, env=env)
        if result.returncode != 0 or not worker_out.exists():
            failures[config] = f"worker exited with {result.returncode}"
            continue
        rows += json.loads(worker_out.read_text())
        worker_out.unlink()
    table = _markdown(rows, [c for c in args.configs if c not in failures], args.baselines)
    if failures:
        table += "\nFailed configurations:\n" + "\n".join(f"- {c}: {why}" for c, why in failures.items()) + "\n"
    data = {"meta": meta, "configs": args.configs, "failures": failures, "rows": rows}
    (out / "tune-cuda.json").write_text(json.dumps(data, indent=1))
    (out / "tune-cuda.md").write_text(table)
    print(table)
    print(f"[tune_cuda] wrote {out / 'tune-cuda.json'} and {out / 'tune-cuda.md'}", file=sys.stderr)
    return data


if __name__ == "__main__":
    main()
