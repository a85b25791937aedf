"""The loss bench's entry points: the command line (``python -m bench.bench_uncertainty_weighted_ce``, :func:`main`)
and the body of its pytest-benchmark tests (:func:`run_pytest_benchmark`).

The bench files (``bench/bench_*.py``) only declare suites (cases × providers) and call :func:`main` or
:func:`run_pytest_benchmark`.
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import asdict

import torch

from bench.cases import TARGET_KINDS, Case, Suite, fresh_logits, host_case_id, make_inputs
from bench.history import add_output_arguments, history_rows, output_history, publish
from bench.machine import machine_info
from bench.measure import MB, Result, RunInterrupted, run_suites, selected_pairs
from bench.providers import PROVIDERS, build_step, unavailable_reason
from bench.tables import markdown_table
from bench.timing import peak_extra_memory, sync


def _parser(prog: str | None, description: str) -> argparse.ArgumentParser:
    """The loss bench's options (bench/README.md, "Running")."""
    parser = argparse.ArgumentParser(prog=prog, description=description)
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
    return parser


def _chosen_suites(parser: argparse.ArgumentParser, args, suites: dict[str, list[Suite]],
                   quick_suites: dict[str, list[Suite]]) -> list[Suite]:
    """The suites the options select (``--device``, ``--quick``, ``--only-suites``), after checking the options that
    can be wrong (a ``parser.error`` names the first); ``--threads`` is applied here."""
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
    return chosen


def _run_name(args, chosen: list[Suite]) -> str:
    """The run's name (``suite`` of its history rows, start of its file names): ``--suite``; else the one suite
    ``--only-suites`` names; else the device type, ``-quick``; ``-subset`` added when options select."""
    subset = bool(args.cases or args.providers or args.targets)
    if args.suite:
        return args.suite
    if args.only_suites and len(chosen) == 1:
        return chosen[0].name + ("-subset" if subset else "")
    return args.device + ("-quick" if args.quick else "") + ("-subset" if subset or args.only_suites else "")


def main(suites: dict[str, list[Suite]], quick_suites: dict[str, list[Suite]], argv: list[str] | None = None,
         prog: str | None = None) -> list[Result]:
    """``python -m bench.bench_<op> [--device cpu|cuda] [--quick] [--results-dir DIR | --out PREFIX] ...``: measure,
    print the Markdown tables, write the results (``<suite>-<device>-<date>.json`` and ``.md`` in bench/results, the
    earlier files of that suite and device removed) and append one row per measured case to
    bench/results/history.jsonl."""
    parser = _parser(prog, main.__doc__)
    args = parser.parse_args(argv)
    chosen = _chosen_suites(parser, args, suites, quick_suites)
    if args.list:
        for suite, case, provider in selected_pairs(chosen, args.providers, args.cases, args.targets):
            host = suite.measure == "host_step"
            print(host_case_id(case) + " host_step" if host else case.id, provider.name,
                  unavailable_reason(provider, case, any_weight=host) or "")
        return []
    warmup = args.warmup if args.warmup is not None else 2
    reps = args.reps if args.reps is not None else (60 if args.device == "cpu" else 50)
    max_time = args.max_time if args.max_time is not None else 5.0
    suite_name = _run_name(args, chosen)
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
        return (fresh_logits(leaf), target), {}

    def timed(logits, tgt):
        step(logits, tgt)
        sync(case.device)

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
