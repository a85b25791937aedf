"""Calibration metrics: ``calibkernels.metrics`` against torchmetrics' ``MulticlassCalibrationError`` (optional).

    python -m bench.bench_metrics [--device cpu|cuda] [--quick] [--results-dir DIR | --out PREFIX]

Times ECE (15 equal-width bins, L1), MCE (max), AdaECE (15 equal-count bins) and classwise ECE of logits ``(N, C)``,
and prints each value next to torchmetrics' where torchmetrics has the metric (ECE: ``norm="l1"``, MCE:
``norm="max"``; it has no AdaECE or classwise ECE). torchmetrics is *not* a dependency of calibkernels: install it
only to run this comparison (``pip install torchmetrics``); without it, only calibkernels' metrics are timed.
Both libraries receive the same logits and apply the softmax themselves. Timing: :func:`bench.timing.time_fn`.
Results: ``metrics-<device type>[-quick]-<device>-<date>.json`` / ``.md`` in bench/results and one history row per
(shape, metric, provider), as the loss bench writes them (:func:`bench.history.publish`).
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

import torch

import calibkernels as ck
from bench.history import add_output_arguments, history_row, output_history, publish
from bench.machine import machine_info, package_version
from bench.tables import rows_to_markdown
from bench.timing import time_fn

# (N, C): CIFAR-100 test set, ImageNet validation subset (the full 50000 × 1000 set on a GPU)
SHAPES = {"cpu": [(10000, 100), (10000, 1000)], "cuda": [(10000, 100), (50000, 1000)]}
QUICK_SHAPES = {"cpu": [(10000, 100)], "cuda": [(10000, 100)]}
N_BINS = 15


def _torchmetrics_fn(norm: str):
    from torchmetrics.functional.classification import multiclass_calibration_error

    def fn(logits, labels):
        return float(multiclass_calibration_error(logits, labels, num_classes=logits.shape[1], n_bins=N_BINS,
                                                  norm=norm))

    return fn


# metric -> {provider: fn(logits, labels) -> float}
METRICS = {
    "ece": {"calibkernels": lambda z, y: ck.metrics.ece(z, y, N_BINS, inputs_are="logits"),
            "torchmetrics": lambda: _torchmetrics_fn("l1")},
    "mce": {"calibkernels": lambda z, y: ck.metrics.mce(z, y, N_BINS, inputs_are="logits"),
            "torchmetrics": lambda: _torchmetrics_fn("max")},
    "adaptive_ece": {"calibkernels": lambda z, y: ck.metrics.adaptive_ece(z, y, N_BINS, inputs_are="logits")},
    "classwise_ece": {"calibkernels": lambda z, y: ck.metrics.classwise_ece(z, y, N_BINS, inputs_are="logits")},
}


def _inputs(n: int, c: int, device: str, seed: int = 0):
    # over-confident logits (scale 4), labels agreeing with the argmax 60% of the time: a realistic calibration gap
    generator = torch.Generator().manual_seed(seed)
    logits = 4.0 * torch.randn(n, c, generator=generator)
    labels = torch.where(torch.rand(n, generator=generator) < 0.6, logits.argmax(1),
                         torch.randint(0, c, (n,), generator=generator))
    return logits.to(device), labels.to(device)


def history_rows(payload: dict, suite: str, source_file: str) -> list[dict]:
    """One ``history.jsonl`` row per (shape, metric, provider) of a metrics result JSON (bench/README.md)."""
    meta = payload["meta"]
    extra = {"load_average_1min": meta.get("load_average_1min")}
    if meta.get("torchmetrics"):
        extra["torchmetrics"] = meta["torchmetrics"]
    if meta.get("git_commit_full"):
        extra["commit_full"] = meta["git_commit_full"]
    return [history_row(
        meta, suite, source_file, kernel="calibration_metrics",
        case_id=f"{meta['device']}-{r['n']}x{r['c']}-{r['metric']}", n=r["n"], c=r["c"], dtype="fp32",
        provider=r["provider"], config={"metric": r["metric"], "n_bins": N_BINS},
        measure="metric", median_ms=r.get("median_ms"), min_ms=r.get("min_ms"), max_ms=r.get("max_ms"),
        reps=r.get("reps"), value=r.get("value"), status="ok", times_ms=r.get("times_ms"), extra=dict(extra))
        for r in payload["results"]]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.bench_metrics", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.out is not None and args.results_dir is not None:
        parser.error("--out and --results-dir are exclusive")
    suite = args.suite or f"metrics-{args.device}{'-quick' if args.quick else ''}"
    have_torchmetrics = importlib.util.find_spec("torchmetrics") is not None
    if not have_torchmetrics:
        print("[bench] torchmetrics is not installed: timing calibkernels' metrics only", file=sys.stderr)
    meta = machine_info(args.device)
    if have_torchmetrics:
        meta["torchmetrics"] = package_version("torchmetrics")
    records, stopped = [], None
    try:
        for n, c in (QUICK_SHAPES if args.quick else SHAPES)[args.device]:
            logits, labels = _inputs(n, c, args.device)
            for metric, providers in METRICS.items():
                for provider, make in providers.items():
                    if provider == "torchmetrics":
                        if not have_torchmetrics:
                            continue
                        fn = make()
                    else:
                        fn = make
                    value = fn(logits, labels)
                    timing = time_fn(lambda: fn(logits, labels), args.device, warmup=1,
                                             reps=5 if args.quick else 10, max_time_s=3.0)
                    records.append(dict(n=n, c=c, metric=metric, provider=provider, value=value,
                                        median_ms=timing.median_ms, min_ms=timing.min_ms, max_ms=timing.max_ms,
                                        reps=timing.reps, times_ms=[round(t, 4) for t in timing.times_ms]))
                    print(f"[bench] {n}x{c} {metric} {provider}: {timing.median_ms:.2f} ms", file=sys.stderr)
    except KeyboardInterrupt as exc:  # a wall-clock limit's SIGINT (run_on_gpu.sh): publish what was measured
        stopped = exc
    # false: the run was stopped part way, and its files hold the measurements made before that
    meta["complete"] = stopped is None
    rows = []
    for r in records:
        other = [o for o in records if (o["n"], o["c"], o["metric"]) == (r["n"], r["c"], r["metric"])
                 and {o["provider"], r["provider"]} == {"calibkernels", "torchmetrics"}]
        diff = abs(r["value"] - other[0]["value"]) if other else None
        rows.append([f"{r['n']} × {r['c']}", r["metric"], r["provider"], f"{100 * r['value']:.4f}",
                     "–" if diff is None else f"{100 * diff:.1e}", f"{r['median_ms']:.2f}"])
    table = (f"Machine: {meta.get('gpu') or meta['cpu']} ({meta['torch_threads']} torch threads); torch "
             f"{meta['torch']}; torchmetrics {meta.get('torchmetrics', 'not installed')}; {meta['date']}\n\n"
             + rows_to_markdown(["N × C", "metric", "provider", "value (%)",
                                         "abs. difference to torchmetrics (pp)", "time (ms)"], rows))
    meta["suite"] = suite
    written = publish({"meta": meta, "results": records}, table, suite=suite,
                              rows_of=lambda payload, source: history_rows(payload, suite, source),
                              results_dir=args.results_dir, out=args.out, history=output_history(args))
    print(table)
    print(f"[bench] wrote {written['json']} and {written['md']}"
          + (f"; appended {len(records)} rows to {written['history']}" if written["history"] else "")
          + (f"; removed {', '.join(written['removed'])}" if written["removed"] else ""), file=sys.stderr)
    if stopped is not None:
        raise stopped
    return records


if __name__ == "__main__":
    main()
