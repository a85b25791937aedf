"""The return_stats bench (bench/bench_loss_stats.py): its command line, and a tiny run's files and ratios."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from _bench_support import assert_prints_help  # noqa: E402


def test_bench_loss_stats_prints_its_help():
    assert_prints_help("bench.bench_loss_stats")


def test_a_tiny_run_writes_every_step_with_its_ratio(tmp_path, monkeypatch):
    from bench import bench_loss_stats as B

    monkeypatch.setattr(B, "SHAPES", {"cpu": [(32, 10)]})
    monkeypatch.setattr(B, "HIDDEN", 8)
    out, history = tmp_path / "loss-stats", tmp_path / "history.jsonl"
    B.main(["--device", "cpu", "--reps", "2", "--out", str(out), "--history", str(history)])
    data = json.loads(out.with_suffix(".json").read_text())
    steps = [r["step"] for r in data["results"]]
    assert steps == ["plain", "return_stats", "return_stats_meter", "loss_then_softmax", "fused_linear_plain",
                     "fused_linear_stats"]
    ratios = {r["step"]: r["ratio_vs_plain"] for r in data["results"]}
    assert ratios["plain"] == ratios["fused_linear_plain"] == 1.0 and all(v > 0 for v in ratios.values())
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    assert [row["provider"] for row in rows] == steps and rows[0]["kernel"] == "loss_stats"
    assert "Machine:" in out.with_suffix(".md").read_text()
