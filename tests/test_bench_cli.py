"""The loss bench's command line (bench/cli.py, ``python -m bench.bench_uncertainty_weighted_ce``): the files a run
writes, its target-kind options, and a run stopped part way."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from _bench_support import interrupted_after_one_call  # noqa: E402

from bench.cases import TARGET_KINDS, Case, Suite  # noqa: E402
from bench.cli import main  # noqa: E402
from bench.history import HISTORY_FIELDS  # noqa: E402
from bench.timing import time_steps  # noqa: E402

KINDS = TARGET_KINDS


def test_script_writes_json_and_markdown(tmp_path, capsys):
    case = Case(16, 7, "fp32", "brier", "grad", "cpu")
    suites = {"cpu": [Suite("tiny", (case,), ("calibkernels_cpu", "reference", "torch_cross_entropy"))]}
    out = tmp_path / "tiny"
    main(suites, suites, argv=["--device", "cpu", "--out", str(out), "--warmup", "0", "--reps", "2"])
    assert sorted(f.name for f in tmp_path.iterdir()) == ["tiny.json", "tiny.md"]  # --out: no history without --history
    data = json.loads(out.with_suffix(".json").read_text())
    assert {"date", "torch", "cpu", "torch_threads"} <= set(data["meta"])
    by_provider = {r["provider"]: r for r in data["results"]}
    assert "torch_cross_entropy" not in by_provider  # weight "brier" is not plain cross-entropy
    reference = by_provider["reference"]
    assert reference["status"] == "ok" and reference["speedup_vs_reference"] == pytest.approx(1.0)
    table = out.with_suffix(".md").read_text()
    assert "| 16 × 7 | fp32 | brier / grad | hard | eager reference |" in table
    assert "time / hard" not in table  # the column of runs with soft targets
    if by_provider["calibkernels_cpu"]["status"] == "ok":
        assert "calibkernels C++ (cpu)" in table


def test_a_run_with_soft_targets_reports_the_ratio_to_hard_targets(tmp_path):
    cases = tuple(Case(16, 7, "fp32", "none", "grad", "cpu", kind) for kind in KINDS)
    suites = {"cpu": [Suite("tiny-soft", cases, ("calibkernels_cpu", "reference", "torch_cross_entropy"))]}
    out, history = tmp_path / "soft", tmp_path / "history.jsonl"
    results = main(suites, suites, argv=["--device", "cpu", "--out", str(out), "--history", str(history),
                                                 "--warmup", "0", "--reps", "2", "--no-memory",
                                                 "--targets", "hard", "mix", "dense"])
    ok = [r for r in results if r.status == "ok"]
    assert {r.case["target"] for r in results} == {"hard", "mix", "dense"}
    assert {r.provider for r in ok} >= {"reference", "torch_cross_entropy"}
    for r in ok:
        hard = r.case["target"] == "hard"
        assert (r.ratio_to_hard is None) == hard and r.speedup_vs_reference > 0
    table = out.with_suffix(".md").read_text()
    assert "time / hard" in table and "| 16 × 7 | fp32 | none / grad | mix | F.cross_entropy |" in table
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    assert len(rows) == len(results) and all(tuple(row) == HISTORY_FIELDS for row in rows)
    assert {(row["case_id"], row["target"]) for row in rows} == {
        ("cpu-16x7-fp32-none-grad", "hard"), ("cpu-16x7-fp32-none-grad-mix", "mix"),
        ("cpu-16x7-fp32-none-grad-dense", "dense")}
    assert all(("ratio_to_hard" in row["extra"]) == (row["target"] != "hard") for row in rows)
    meta = json.loads(out.with_suffix(".json").read_text())["meta"]
    assert meta["suite"] == "cpu-subset" and meta["targets"] == ["hard", "mix", "dense"]


def test_an_interrupted_bench_run_writes_the_cases_measured_so_far(tmp_path, monkeypatch):
    """SIGINT (a wall-clock limit's) after the first case: the result files and the history rows hold that case,
    with meta.complete false, and the interrupt still ends the run; a run that ends has meta.complete true."""
    cases = (Case(8, 5, "fp32", "brier", "grad", "cpu"), Case(8, 6, "fp32", "brier", "grad", "cpu"))
    suites = {"cpu": [Suite("tiny", cases, ("reference",))]}
    real = time_steps
    monkeypatch.setattr("bench.measure.time_steps", interrupted_after_one_call(real))
    out, history = tmp_path / "run", tmp_path / "history.jsonl"
    argv = ["--device", "cpu", "--out", str(out), "--history", str(history), "--warmup", "0", "--reps", "1",
            "--no-memory"]
    with pytest.raises(KeyboardInterrupt):
        main(suites, suites, argv=argv)
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["complete"] is False
    assert [(r["case_id"], r["status"]) for r in data["results"]] == [(cases[0].id, "ok")]
    assert "stopped part way" in out.with_suffix(".md").read_text()
    (row,) = [json.loads(line) for line in history.read_text().splitlines()]
    assert row["case_id"] == cases[0].id and row["extra"]["run_complete"] is False

    monkeypatch.setattr("bench.measure.time_steps", real)
    main(suites, suites, argv=argv[:4] + argv[6:])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["complete"] is True and len(data["results"]) == 2
