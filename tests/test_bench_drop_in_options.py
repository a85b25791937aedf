"""The drop-in options bench (bench/bench_drop_in_options.py): its command line, and a tiny run's files and
ratios."""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

import calibkernels as ck  # noqa: E402
from _bench_support import assert_prints_help  # noqa: E402


def test_bench_drop_in_options_prints_its_help():
    assert_prints_help("bench.bench_drop_in_options")


def test_a_tiny_run_writes_every_step_with_its_ratio(tmp_path, monkeypatch):
    from bench import bench_drop_in_options as B
    from calibkernels import _backends

    monkeypatch.setattr(B, "SHAPES", {"cpu": [(32, 10)]})
    out, history = tmp_path / "drop-in", tmp_path / "history.jsonl"
    B.main(["--device", "cpu", "--reps", "2", "--out", str(out), "--history", str(history)])
    data = json.loads(out.with_suffix(".json").read_text())
    steps = [r["step"] for r in data["results"]]
    in_kernel = "cpu" in ck.available_backends() and _backends.module("cpu").OPTIONS_IN_KERNEL
    options = ["class_weight", "z_loss", "softcap", "all_options"] if in_kernel else []
    assert steps == ["plain", *options, "f_cross_entropy", "f_cross_entropy_weight"]
    ratios = {r["step"]: r["ratio_vs_plain"] for r in data["results"]}
    assert ratios["plain"] == 1.0 and all(v > 0 for v in ratios.values())
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    assert [row["provider"] for row in rows] == steps and rows[0]["kernel"] == "drop_in_options"
    assert "Machine:" in out.with_suffix(".md").read_text()
