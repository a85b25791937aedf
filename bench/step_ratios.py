"""The command line and the result files shared by the benches that time a few variants of one training step as
ratios to a baseline step, interleaved in one run (bench/bench_loss_stats.py, bench/bench_drop_in_options.py).

A bench provides its shapes and ``measure(n, c, device, reps) -> [(step, Timing, ratio to its group's baseline)]``
(:func:`bench.timing.time_steps` times each group of steps interleaved: repetition ``r`` runs every step once, in a
rotated order, so the ratios compare steps that met the same machine load); :func:`main` runs the shapes and writes
``<suite>-<device>-<date>.json`` / ``.md`` in bench/results and one ``history.jsonl`` row per (shape, step)
(:func:`bench.history.publish`; ``extra.ratio_vs_plain``).
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable

import torch

from bench.history import add_output_arguments, history_row, output_history, publish
from bench.machine import machine_info
from bench.tables import rows_to_markdown


def _history_rows(payload: dict, suite: str, source_file: str, kernel: str, fields_of: Callable) -> list[dict]:
    meta = payload["meta"]
    return [history_row(
        meta, suite, source_file, kernel=kernel, case_id=f"{meta['device']}-{r['n']}x{r['c']}-fp32-{r['step']}",
        n=r["n"], c=r["c"], dtype="fp32", provider=r["step"], measure="step", median_ms=r["median_ms"],
        min_ms=r["min_ms"], max_ms=r["max_ms"], reps=r["reps"], status="ok", times_ms=r["times_ms"],
        extra={"ratio_vs_plain": r["ratio_vs_plain"], "load_average_1min": meta.get("load_average_1min")},
        **fields_of(r["step"]))
        for r in payload["results"]]


def main(argv, *, prog: str, description: str, suite_prefix: str, kernel: str, shapes: dict, measure: Callable,
         caption: str, fields_of: Callable[[str], dict], ratio_header: str = "ratio to its plain step") -> list[dict]:
    """Parse ``argv``, time ``shapes[device]`` (the first only with ``--quick``) with ``measure``, print and write
    the table; ``caption`` follows the machine's line; ``fields_of(step)`` gives a step's history fields (weight,
    mode, target, config)."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions of each step (default 10)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.out is not None and args.results_dir is not None:
        parser.error("--out and --results-dir are exclusive")
    suite = args.suite or f"{suite_prefix}-{args.device}{'-quick' if args.quick else ''}"
    meta = machine_info(args.device)
    records = []
    for n, c in shapes[args.device][:1 if args.quick else None]:
        for name, timing, ratio in measure(n, c, args.device, args.reps):
            records.append(dict(n=n, c=c, step=name, median_ms=timing.median_ms, min_ms=timing.min_ms,
                                max_ms=timing.max_ms, reps=timing.reps, ratio_vs_plain=round(ratio, 4),
                                times_ms=[round(t, 4) for t in timing.times_ms]))
            print(f"[bench] {n}x{c} {name}: {timing.median_ms:.2f} ms (x{ratio:.3f})", file=sys.stderr)
    meta["complete"] = True
    meta["suite"] = suite
    machine = meta.get("gpu") or meta["cpu"]
    table = (f"Machine: {machine} ({meta['torch_threads']} torch threads); torch {meta['torch']}; "
             f"{meta['date']}; commit {meta.get('git_commit')}; {caption}, median of {args.reps} interleaved "
             "repetitions\n\n"
             + rows_to_markdown(["N × C", "step", "time (ms)", ratio_header],
                                [[f"{r['n']} × {r['c']}", r["step"], f"{r['median_ms']:.2f}",
                                  f"{r['ratio_vs_plain']:.3f}"] for r in records]))
    written = publish({"meta": meta, "results": records}, table, suite=suite,
                      rows_of=lambda payload, source: _history_rows(payload, suite, source, kernel, fields_of),
                      results_dir=args.results_dir, out=args.out, history=output_history(args))
    print(table)
    print(f"[bench] wrote {written['json']} and {written['md']}"
          + (f"; appended {len(records)} rows to {written['history']}" if written["history"] else ""),
          file=sys.stderr)
    return records
