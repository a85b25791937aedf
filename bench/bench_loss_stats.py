"""The cost of a loss call's top-label statistics (``return_stats=True``) in a training step, as ratios to the plain
step, in one interleaved run.

    python -m bench.bench_loss_stats [--device cpu|cuda] [--quick] [--reps R] [--results-dir DIR | --out PREFIX]

Steps timed (forward + backward of the mean, BSCE-GRA, default backend), per shape ``(N, C)``:

* ``plain``: ``ck.uncertainty_weighted_ce(logits, target).backward()``;
* ``return_stats``: the same with ``return_stats=True`` (the confidence and prediction per row);
* ``loss_then_softmax``: what a user writes without it: the plain step, then ``softmax(logits).max(-1)`` for the
  confidence and the prediction (one more pass over the ``N × C`` logits and an ``N × C`` temporary);
* the fused linear path (``hidden (N, H) @ W.T``, ``H`` = :data:`HIDDEN`): ``fused_linear_plain`` and
  ``fused_linear_stats``.

Each group of steps is timed interleaved (:func:`bench.timing.time_steps`: repetition ``r`` runs every step once,
in a rotated order), so the ratios compare steps that met the same machine load. Results:
``loss-stats-<device type>[-quick]-<device>-<date>.json`` / ``.md`` in bench/results and one ``history.jsonl`` row per
(shape, step) (:func:`bench.history.publish`; ``extra.ratio_vs_plain``).
"""

from __future__ import annotations

import argparse
import sys

import torch

import calibkernels as ck
from bench.history import add_output_arguments, history_row, output_history, publish
from bench.machine import machine_info
from bench.tables import rows_to_markdown
from bench.timing import time_steps

SHAPES = {"cpu": [(4096, 1000), (1024, 32000)], "cuda": [(8192, 1000), (8192, 32000)]}
HIDDEN = 256  # the fused linear path's hidden size
DTYPE = torch.float32


def _logits_steps():
    """Steps ``(logits, target)`` on the materialised logits."""

    def plain(logits, target):
        ck.uncertainty_weighted_ce(logits, target).backward()

    def return_stats(logits, target):
        loss, stats = ck.uncertainty_weighted_ce(logits, target, return_stats=True)
        loss.backward()
        return stats

    def loss_then_softmax(logits, target):
        ck.uncertainty_weighted_ce(logits, target).backward()
        with torch.no_grad():
            return torch.softmax(logits, dim=-1).max(dim=-1)

    return {"plain": plain, "return_stats": return_stats, "loss_then_softmax": loss_then_softmax}


def _fused_linear_steps(linear_weight):
    """Steps ``(hidden, target)`` of the fused linear loss with the output layer's ``linear_weight``."""

    def fused_linear_plain(hidden, target):
        ck.fused_linear_uncertainty_weighted_ce(hidden, linear_weight, target).backward()

    def fused_linear_stats(hidden, target):
        loss, stats = ck.fused_linear_uncertainty_weighted_ce(hidden, linear_weight, target, return_stats=True)
        loss.backward()
        return stats

    return {"fused_linear_plain": fused_linear_plain, "fused_linear_stats": fused_linear_stats}


def _measure(n, c, device, reps):
    """``[(step, Timing, ratio to its group's plain step)]`` of one shape."""
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, c, (n,), generator=generator).to(device)
    logits = (3 * torch.randn(n, c, generator=generator)).to(device, DTYPE).requires_grad_()
    timings = time_steps(_logits_steps(), logits, target, warmup=1, reps=reps, min_reps=min(3, reps),
                         max_time_s=60.0)
    del logits
    records = [(name, t, t.median_ms / timings["plain"].median_ms) for name, t in timings.items()]
    hidden = torch.randn(n, HIDDEN, generator=generator).to(device, DTYPE).requires_grad_()
    linear_weight = (torch.randn(c, HIDDEN, generator=generator) / HIDDEN ** 0.5).to(device, DTYPE)
    fused = time_steps(_fused_linear_steps(linear_weight.requires_grad_()), hidden, target, warmup=1, reps=reps,
                       min_reps=min(3, reps), max_time_s=60.0)
    records += [(name, t, t.median_ms / fused["fused_linear_plain"].median_ms) for name, t in fused.items()]
    return records


def _history_rows(payload: dict, suite: str, source_file: str) -> list[dict]:
    meta = payload["meta"]
    return [history_row(
        meta, suite, source_file, kernel="loss_stats", case_id=f"{meta['device']}-{r['n']}x{r['c']}-fp32-{r['step']}",
        n=r["n"], c=r["c"], dtype="fp32", weight="brier", mode="grad", target="hard", provider=r["step"],
        config={"hidden": HIDDEN} if r["step"].startswith("fused_linear") else {}, measure="step",
        median_ms=r["median_ms"], min_ms=r["min_ms"], max_ms=r["max_ms"], reps=r["reps"], status="ok",
        times_ms=r["times_ms"], extra={"ratio_vs_plain": r["ratio_vs_plain"],
                                       "load_average_1min": meta.get("load_average_1min")})
        for r in payload["results"]]


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.bench_loss_stats", description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--quick", action="store_true", help="the first shape only")
    parser.add_argument("--reps", type=int, default=10, help="timed repetitions of each step (default 10)")
    add_output_arguments(parser)
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: torch.cuda.is_available() is False on this machine")
    if args.out is not None and args.results_dir is not None:
        parser.error("--out and --results-dir are exclusive")
    suite = args.suite or f"loss-stats-{args.device}{'-quick' if args.quick else ''}"
    meta = machine_info(args.device)
    records = []
    for n, c in SHAPES[args.device][:1 if args.quick else None]:
        for name, timing, ratio in _measure(n, c, args.device, args.reps):
            records.append(dict(n=n, c=c, step=name, median_ms=timing.median_ms, min_ms=timing.min_ms,
                                max_ms=timing.max_ms, reps=timing.reps, ratio_vs_plain=round(ratio, 4),
                                times_ms=[round(t, 4) for t in timing.times_ms]))
            print(f"[bench] {n}x{c} {name}: {timing.median_ms:.2f} ms (x{ratio:.3f})", file=sys.stderr)
    meta["complete"] = True
    meta["suite"] = suite
    machine = meta.get("gpu") or meta["cpu"]
    table = (f"Machine: {machine} ({meta['torch_threads']} torch threads); torch {meta['torch']}; "
             f"{meta['date']}; commit {meta.get('git_commit')}; fp32, BSCE-GRA, forward + backward, median of "
             f"{args.reps} interleaved repetitions; fused linear with H = {HIDDEN}\n\n"
             + rows_to_markdown(["N × C", "step", "time (ms)", "ratio to its plain step"],
                                [[f"{r['n']} × {r['c']}", r["step"], f"{r['median_ms']:.2f}",
                                  f"{r['ratio_vs_plain']:.3f}"] for r in records]))
    written = publish({"meta": meta, "results": records}, table, suite=suite,
                      rows_of=lambda payload, source: _history_rows(payload, suite, source),
                      results_dir=args.results_dir, out=args.out, history=output_history(args))
    print(table)
    print(f"[bench] wrote {written['json']} and {written['md']}"
          + (f"; appended {len(records)} rows to {written['history']}" if written["history"] else ""),
          file=sys.stderr)
    return records


if __name__ == "__main__":
    main()
