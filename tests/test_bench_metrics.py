"""The metrics bench (bench/bench_metrics.py): its command line, and a run stopped part way writes what it measured."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from _bench_support import assert_prints_help, interrupted_after_one_call  # noqa: E402

from bench.timing import time_fn  # noqa: E402


def test_bench_metrics_prints_its_help():
    assert_prints_help("bench.bench_metrics")


def test_an_interrupted_metrics_bench_writes_what_it_measured(tmp_path, monkeypatch):
    """bench_metrics stopped by SIGINT after its first measurement: the result file holds that measurement with
    meta.complete false, and the interrupt still ends the run."""
    from bench import bench_metrics as M

    monkeypatch.setattr(M, "time_fn", interrupted_after_one_call(time_fn))
    monkeypatch.setattr(M, "QUICK_SHAPES", {"cpu": [(64, 5)]})
    out = tmp_path / "metrics"
    with pytest.raises(KeyboardInterrupt):
        M.main(["--device", "cpu", "--quick", "--out", str(out), "--history", str(tmp_path / "history.jsonl")])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["complete"] is False
    assert [(r["metric"], r["provider"]) for r in data["results"]] == [("ece", "calibkernels")]
