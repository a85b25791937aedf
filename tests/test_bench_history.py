"""The result files and ``history.jsonl`` (bench/history.py): one well-formed row per measured case, earlier files of
a suite replaced once their rows are in the history, rows of files from before target kinds, and the repository's own
history."""

import datetime as dt
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench.cases import TARGET_KINDS, Case, Suite  # noqa: E402
from bench.cli import main  # noqa: E402
from bench.history import HISTORY_FIELDS, HISTORY_FIELDS_V1, history_rows, result_stem  # noqa: E402
from bench.machine import device_slug, machine_info  # noqa: E402
from bench.measure import Result  # noqa: E402
from bench.providers import PROVIDERS  # noqa: E402
from bench.tables import markdown_table  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def test_rows_of_result_files_from_before_target_kinds_are_hard():
    meta = dict(machine_info("cpu"), date="2000-01-01T00:00:00+00:00")
    old = {"case": {"n": 16, "c": 7, "dtype": "fp32", "weight": "brier", "mode": "grad", "device": "cpu"},
           "case_id": "cpu-16x7-fp32-brier-grad", "provider": "reference", "label": "eager reference",
           "status": "ok", "median_ms": 1.0, "min_ms": 0.5, "max_ms": 2.0, "reps": 2, "times_ms": [1.0, 2.0]}
    (row,) = history_rows(meta, [old], "old", "bench/results/old.json")
    assert row["target"] == "hard" and row["case_id"] == old["case_id"]
    assert "| hard |" in markdown_table(meta, [Result(**old)])


def _assert_well_formed_history_row(row: dict, source_file: str):
    assert tuple(row) == HISTORY_FIELDS  # every field, in the documented order
    assert row["schema"] == 2 and row["kernel"] == "uncertainty_weighted_ce" and row["device_type"] == "cpu"
    assert row["target"] in TARGET_KINDS and row["case_id"].endswith(
        "" if row["target"] == "hard" else f"-{row['target']}")
    assert row["source_file"] == source_file and row["status"] == "ok"
    dt.datetime.fromisoformat(row["date"])
    assert row["commit"] is None or (len(row["commit"]) == 7 and int(row["commit"], 16) >= 0)
    assert row["dirty"] in (True, False, None)
    assert row["device"].endswith(" torch threads)") and row["torch"] == torch.__version__
    assert row["case_id"].startswith(f"cpu-{row['n']}x{row['c']}-{row['dtype']}")
    assert row["measure"] in ("step", "host_step") and row["config"]["reduction"] == "mean"
    assert isinstance(row["reps"], int) and len(row["times_ms"]) == row["reps"]
    assert all(isinstance(t, float) for t in row["times_ms"]) and row["min_ms"] <= row["median_ms"] <= row["max_ms"]
    assert row["extra"]["label"] == PROVIDERS[row["provider"]].label
    if row["measure"] == "host_step":
        assert row["gb_per_s"] is None and row["speedup_vs_reference"] is None
        assert f"({os.cpu_count()} cores, {row['config']['torch_threads']} torch threads)" in row["device"]
        assert row["config"]["steps_per_rep"] >= 1 and row["extra"]["paired_ratio_to_baseline"] > 0
    else:
        assert row["gb_per_s"] > 0 and row["speedup_vs_reference"] > 0


def test_a_run_appends_one_well_formed_history_row_per_measured_case_and_replaces_its_earlier_files(tmp_path):
    step_case = Case(16, 7, "fp32", "brier", "grad", "cpu")
    suites = {"cpu": [
        Suite("tiny", (step_case,), ("calibkernels_cpu", "reference")),
        Suite("tiny-host", (Case(4, 10, "fp32", "brier", "grad", "cpu"),), ("calibkernels", "torch_cross_entropy"),
              measure="host_step", threads=(1, None), baseline="torch_cross_entropy"),
    ]}
    meta = machine_info("cpu")
    slug = device_slug(meta)
    history = tmp_path / "history.jsonl"
    history.write_text('{"schema":1,"suite":"earlier"}')  # a file whose last line has no newline yet
    # an earlier run of the same suite and device whose rows the history lacks, and one of another suite
    earlier_meta = dict(meta, date="2000-01-01T00:00:00+00:00")
    earlier = {"meta": earlier_meta, "results": [{
        "case": {"n": 16, "c": 7, "dtype": "fp32", "weight": "brier", "mode": "grad", "device": "cpu"},
        "case_id": step_case.id, "provider": "reference", "label": "eager reference", "status": "ok",
        "median_ms": 1.0, "min_ms": 0.5, "max_ms": 2.0, "reps": 2, "times_ms": [1.0, 2.0]}]}
    for stem in (f"tinyrun-{slug}-2000-01-01", f"other-{slug}-2000-01-01"):
        (tmp_path / f"{stem}.json").write_text(json.dumps(earlier))
        (tmp_path / f"{stem}.md").write_text("earlier\n")

    results = main(suites, suites, argv=[
        "--device", "cpu", "--suite", "tinyrun", "--results-dir", str(tmp_path), "--warmup", "0", "--reps", "2",
        "--host-rep-ms", "1", "--no-memory"])

    stem = result_stem("tinyrun", meta)
    assert stem.startswith(f"tinyrun-{slug}-") and not (tmp_path / f"tinyrun-{slug}-2000-01-01.json").exists()
    assert not (tmp_path / f"tinyrun-{slug}-2000-01-01.md").exists()
    assert (tmp_path / f"other-{slug}-2000-01-01.json").exists()  # another suite's latest file stays
    data = json.loads((tmp_path / f"{stem}.json").read_text())
    assert data["meta"]["suite"] == "tinyrun" and len(data["results"]) == len(results) == 2 + 4
    assert "Host cost of an eager training step" in (tmp_path / f"{stem}.md").read_text()

    lines = history.read_text().splitlines()
    assert json.loads(lines[0]) == {"schema": 1, "suite": "earlier"}  # earlier lines untouched
    rows = [json.loads(line) for line in lines[1:]]
    retired, new = rows[:1], rows[1:]
    assert retired[0]["source_file"] == f"bench/results/tinyrun-{slug}-2000-01-01.json"
    assert retired[0]["date"] == "2000-01-01T00:00:00+00:00" and retired[0]["median_ms"] == 1.0
    assert len(new) == len(results)
    for row in new:
        _assert_well_formed_history_row(row, f"bench/results/{stem}.json")
        assert row["suite"] == "tinyrun" and row["date"] == data["meta"]["date"]
        assert row["commit"] == data["meta"].get("git_commit") and row["dirty"] == data["meta"].get("git_dirty")
    assert {(r["provider"], r["measure"], r["config"].get("torch_threads")) for r in new} == {
        ("calibkernels_cpu", "step", None), ("reference", "step", None),
        ("calibkernels", "host_step", 1), ("torch_cross_entropy", "host_step", 1),
        ("calibkernels", "host_step", torch.get_num_threads()),
        ("torch_cross_entropy", "host_step", torch.get_num_threads())}

    # a second run the same day replaces the first's files (same name) and appends its rows again
    main(suites, suites, argv=[
        "--device", "cpu", "--suite", "tinyrun", "--results-dir", str(tmp_path), "--warmup", "0", "--reps", "2",
        "--host-rep-ms", "1", "--no-memory", "--providers", "reference", "calibkernels"])
    names = sorted(f.name for f in tmp_path.glob(f"tinyrun-{slug}-*"))
    assert names == [f"{stem}.json", f"{stem}.md"]
    assert len(history.read_text().splitlines()) == 1 + 1 + len(results) + 3


def test_the_repositorys_history_rows_are_well_formed_and_hold_every_run_of_the_bench_writer():
    """Every history.jsonl row has every field of its version, in order (version 1: all but ``target``); every
    result JSON that the writer made (``meta.suite``) is named ``<suite>-<device>-<date>`` and its run (suite and start
    time) is in the history."""
    results = ROOT / "bench" / "results"
    history = [json.loads(line) for line in (results / "history.jsonl").read_text().splitlines()]
    fields = {1: HISTORY_FIELDS_V1, 2: HISTORY_FIELDS}
    assert history and all(tuple(row) == fields[row["schema"]] for row in history)
    runs = {(row["suite"], row["date"]) for row in history}
    for path in sorted(results.glob("*.json")):
        meta = json.loads(path.read_text()).get("meta")
        if isinstance(meta, dict) and meta.get("suite") and (meta.get("cpu") or meta.get("gpu")):
            assert path.stem == result_stem(meta["suite"], meta), path.name
            assert (meta["suite"], meta["date"]) in runs, f"{path.name}: its run is not in history.jsonl"
