"""Where a bench run's results go: ``<suite>-<device>-<date>.json`` and ``.md`` (replacing the earlier files of the
same suite and device) and the append-only ``history.jsonl``, one row per measured case (format: bench/README.md,
"history.jsonl").

A run stopped by SIGINT still writes them, with the cases measured before it and ``meta.complete`` false."""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Callable

from bench.machine import REPO_ROOT, device_label, device_slug
from bench.measure import Result

RESULTS_DIR = REPO_ROOT / "bench" / "results"


def write_json(path: Path, meta: dict, results: list[Result]) -> None:
    """``{"meta": meta, "results": [...]}`` at ``path``, one result per (case, provider), as :func:`publish` writes
    the loss bench's JSON."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"meta": meta, "results": [asdict(r) for r in results]}, indent=1) + "\n")


# Version 2 added ``target`` (the target kind); version-1 rows, earlier in the append-only file, have every other field
# and only hard targets.
HISTORY_SCHEMA = 2
HISTORY_FIELDS = ("schema", "suite", "kernel", "device", "device_type", "date", "commit", "dirty", "torch", "triton",
                  "case_id", "n", "c", "dtype", "weight", "mode", "target", "provider", "config", "measure",
                  "median_ms", "min_ms", "max_ms", "mean_ms", "reps", "gb_per_s", "peak_extra_mb", "peak_extra_nc",
                  "speedup_vs_reference", "value", "status", "times_ms", "extra", "source_file")
HISTORY_FIELDS_V1 = tuple(name for name in HISTORY_FIELDS if name != "target")
HOST_STEP_TIMING = ("host clock; per repetition the mean of steps_per_rep back-to-back steps on one leaf "
                    "(leaf.grad = None between steps); median over repetitions")


def history_row(meta: dict, suite: str, source_file: str, **fields) -> dict:
    """One ``history.jsonl`` row: the run's fields from ``meta``, then ``fields``; every field present (``None``
    where it does not apply), in the documented order."""
    triton = meta.get("triton")
    row = dict.fromkeys(HISTORY_FIELDS)
    row.update(schema=HISTORY_SCHEMA, suite=suite, device=device_label(meta), device_type=meta.get("device"),
               date=meta.get("date"), commit=meta.get("git_commit") or None, dirty=meta.get("git_dirty"),
               torch=meta.get("torch"), triton=triton if triton and triton not in ("installed", "unknown") else None,
               source_file=source_file)
    unknown = set(fields) - set(HISTORY_FIELDS)
    if unknown:
        raise ValueError(f"not history.jsonl fields: {sorted(unknown)}")
    row.update(fields)
    return row


def history_rows(meta: dict, results: list, suite: str, source_file: str) -> list[dict]:
    """The ``history.jsonl`` rows of a loss bench run: one per result (:class:`Result`, or its dict from a result
    JSON)."""
    rows = []
    for r in results:
        r = asdict(r) if isinstance(r, Result) else r
        case, measure = r["case"], r.get("measure", "step")
        config = {"reduction": "mean"}
        if meta.get("env"):
            config["env"] = dict(meta["env"])
        config.update(r.get("config") or {})
        extra = {"load_average_1min": meta.get("load_average_1min"), "label": r.get("label")}
        if meta.get("git_commit_full"):
            extra["commit_full"] = meta["git_commit_full"]
        if r.get("ratio_to_hard") is not None:
            extra["ratio_to_hard"] = r["ratio_to_hard"]
        if r.get("host_issue_ms") is not None:
            extra["host_issue_ms"] = r["host_issue_ms"]
        if meta.get("complete") is False:
            extra["run_complete"] = False
        if measure == "host_step":
            config.update(torch_threads=r.get("threads"), steps_per_rep=r.get("steps_per_rep"))
            extra.update(timing=HOST_STEP_TIMING, baseline=r.get("baseline"),
                         ratio_to_baseline=r.get("ratio_to_baseline"),
                         paired_ratio_to_baseline=r.get("paired_ratio_to_baseline"))
        row = history_row(
            meta, suite, source_file, kernel="uncertainty_weighted_ce", case_id=r["case_id"], n=case["n"],
            c=case["c"], dtype=case["dtype"], weight=case["weight"], mode=case["mode"],
            target=case.get("target", "hard"), provider=r["provider"],
            config=config, measure=measure, median_ms=r.get("median_ms"), min_ms=r.get("min_ms"),
            max_ms=r.get("max_ms"), reps=r.get("reps") or None, gb_per_s=r.get("gb_per_s"),
            peak_extra_mb=r.get("peak_extra_mb"), peak_extra_nc=r.get("peak_extra_nc"),
            speedup_vs_reference=r.get("speedup_vs_reference"), status=r.get("status"),
            times_ms=r.get("times_ms") or None, extra=extra)
        if measure == "host_step" or r.get("threads"):
            row["device"] = device_label(meta, r.get("threads"))
        rows.append(row)
    return rows


def append_history(rows: list[dict], path: Path) -> None:
    """Append ``rows`` to ``path`` (one compact JSON object per line); earlier lines are never touched."""
    if not rows:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    text = "".join(json.dumps(row, separators=(",", ":")) + "\n" for row in rows)
    if path.exists() and path.stat().st_size:
        with path.open("rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                text = "\n" + text
    with path.open("a", encoding="utf-8") as f:
        f.write(text)


def read_history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]


def result_stem(suite: str, meta: dict) -> str:
    """``<suite>-<device>-<YYYY-MM-DD>``: the name of a run's result files (date of the run's start, UTC)."""
    return f"{suite}-{device_slug(meta)}-{str(meta['date'])[:10]}"


def _repo_relative(path: Path) -> str:
    path = path.resolve()
    try:
        return path.relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def _retire_earlier(directory: Path, suite: str, meta: dict, keep: str, history: Path,
                    rows_of: Callable[[dict, str], list[dict]]) -> list[str]:
    """Delete the earlier result files of ``suite`` on this device in ``directory`` (``<suite>-<device>-<date>[-tag]``
    ``.json`` / ``.md``, other than ``keep``), after appending to ``history`` the rows of any whose run (suite and
    start time) it does not hold yet. A JSON that cannot be read is kept. Returns the deleted names."""
    name = re.escape(f"{suite}-{device_slug(meta)}-")
    pattern = re.compile(name + r"\d{4}-\d{2}-\d{2}(?:-[A-Za-z0-9]+)?")
    stems = sorted({f.stem for f in directory.glob("*") if f.suffix in (".json", ".md") and
                    pattern.fullmatch(f.stem)} - {keep})
    recorded = None
    removed = []
    for stem in stems:
        js = directory / f"{stem}.json"
        if js.exists():
            try:
                old = json.loads(js.read_text())
                if recorded is None:
                    recorded = {(row.get("suite"), row.get("date")) for row in read_history(history)}
                if (suite, old["meta"]["date"]) not in recorded:
                    append_history(rows_of(old, f"bench/results/{js.name}"), history)
                    recorded.add((suite, old["meta"]["date"]))
            except (OSError, ValueError, KeyError, TypeError) as exc:
                print(f"[bench] kept {js.name}: cannot read its rows ({type(exc).__name__}: {exc})", file=sys.stderr)
                continue
        for suffix in (".json", ".md"):
            path = directory / f"{stem}{suffix}"
            if path.exists():
                path.unlink()
                removed.append(path.name)
    return removed


# publish's ``history`` when the caller names no file: ``history.jsonl`` of the results folder (``None`` means none)
DEFAULT_HISTORY = object()


def publish(payload: dict, markdown: str, *, suite: str, rows_of: Callable[[dict, str], list[dict]],
            results_dir: Path | None = None, out: Path | None = None, history=DEFAULT_HISTORY) -> dict:
    """Write a run's ``.json`` (``payload``, with ``payload["meta"]``) and ``.md`` and append its rows to the history.

    * Default (``out`` None): ``<results_dir>/<suite>-<device>-<date>.json`` / ``.md`` (``results_dir`` default
      ``bench/results``), replacing the earlier files of the same suite and device there (:func:`_retire_earlier`),
      rows appended to ``<results_dir>/history.jsonl``; the rows' ``source_file`` is ``bench/results/<name>``, the
      name the file has (or will have, when copied from a device machine's folder) in the repository.
    * ``out``: exactly ``out.json`` / ``out.md``, nothing replaced, rows appended only to an explicit ``history``.

    ``history``: a path overrides the history file; ``None`` appends nothing (and then nothing is replaced either).
    ``rows_of(payload, source_file)`` makes the rows. Returns the paths written and the names removed.
    """
    meta = payload["meta"]
    removed: list[str] = []
    if out is not None:
        json_path, md_path = out.with_suffix(".json"), out.with_suffix(".md")
        source_file = _repo_relative(json_path)
        history_path = None if history is DEFAULT_HISTORY else history
    else:
        directory = Path(results_dir) if results_dir is not None else RESULTS_DIR
        directory.mkdir(parents=True, exist_ok=True)
        stem = result_stem(suite, meta)
        json_path, md_path = directory / f"{stem}.json", directory / f"{stem}.md"
        source_file = f"bench/results/{json_path.name}"
        history_path = directory / "history.jsonl" if history is DEFAULT_HISTORY else history
        if history_path is not None:
            removed = _retire_earlier(directory, suite, meta, stem, Path(history_path), rows_of)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(payload, indent=1) + "\n")
    md_path.write_text(markdown)
    if history_path is not None:
        append_history(rows_of(payload, source_file), Path(history_path))
    return {"json": json_path, "md": md_path, "history": history_path, "removed": removed}


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--suite``, ``--results-dir``, ``--out``, ``--history``, ``--no-history``: where a run's results go
    (:func:`publish`)."""
    parser.add_argument("--suite", default=None,
                        help="name of the run: the `suite` of its history rows and the start of its file names "
                             "(default: the device, plus -quick, plus -subset when --cases/--providers select)")
    parser.add_argument("--results-dir", type=Path, default=None,
                        help="write <suite>-<device>-<date>.json/.md here (default bench/results), replacing the "
                             "earlier files of the same suite and device, and append to history.jsonl here")
    parser.add_argument("--out", type=Path, default=None,
                        help="write exactly PREFIX.json and PREFIX.md instead (nothing replaced; history rows only "
                             "with --history)")
    parser.add_argument("--history", type=Path, default=None, help="append the history rows to this file instead")
    parser.add_argument("--no-history", action="store_true",
                        help="append no history rows (and replace no earlier result file)")


def output_history(args) -> object:
    """The ``history`` argument of :func:`publish` from :func:`add_output_arguments`' options."""
    if args.no_history:
        return None
    return args.history if args.history is not None else DEFAULT_HISTORY
