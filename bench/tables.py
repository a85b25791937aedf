"""The Markdown tables a bench run prints and writes beside its JSON (``<suite>-<device>-<date>.md``)."""

from __future__ import annotations

import math

from bench.measure import Result
from bench.providers import PROVIDERS


def rows_to_markdown(headers: list[str], rows: list[list[object]]) -> str:
    """A plain Markdown table (numbers already formatted by the caller)."""
    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(str(cell) for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"


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
