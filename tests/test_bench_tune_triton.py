"""The Triton launch-shape sweep (bench/tune_triton.py, a GPU tool): its command line, the launch-shape override, and
a sweep stopped part way. The GPU work is stood in for where a test needs none."""

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from _bench_support import assert_prints_help  # noqa: E402


def test_tune_triton_prints_its_help():
    assert_prints_help("bench.tune_triton")


def test_tune_triton_sets_each_launch_shape_and_restores_the_defaults():
    T = pytest.importorskip("calibkernels.triton.uncertainty_weighted_ce")
    from bench.tune_triton import candidate_shapes, launch_shape

    defaults = (T.MAX_BLOCK, T.MAX_BLOCK_16BIT, dict(T.TWO_READ_CHUNK), T._launch_config)
    for c in (1000, 4231, 32000, 128256):
        shapes = candidate_shapes(c, [4, 8, 16, 32], [2048, 4096, 8192, 16384])
        assert ("single", 1 << (c - 1).bit_length(), 4) in shapes
        for element_size in (2, 4):
            for path, block, warps in shapes:
                with launch_shape(T, path, block, warps, c, element_size) as effective:
                    assert effective == (path == "single", block, warps)
                    assert T._launch_config(c, element_size) == effective
                assert (T.MAX_BLOCK, T.MAX_BLOCK_16BIT, dict(T.TWO_READ_CHUNK), T._launch_config) == defaults
    with pytest.raises(ValueError, match="smaller than the row"):
        with launch_shape(T, "two-read", 4096, 4, 1000, 4):
            pass
    assert (T.MAX_BLOCK, T.MAX_BLOCK_16BIT, dict(T.TWO_READ_CHUNK), T._launch_config) == defaults


def test_an_interrupted_tune_triton_keeps_the_class_counts_measured_so_far(tmp_path, monkeypatch):
    """tune_triton rewrites its JSON after each class count: stopped in the second, the file holds the first's rows
    with meta.complete false; a sweep that ends writes complete true. (The GPU work is stood in for.)"""
    from bench import tune_triton as T

    monkeypatch.setattr(T.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(T, "_setup", lambda args: {"meta": {"date": "d"}, "header": {"device": "stand-in"}})

    def sweep(ctx, args, c, record):
        if c == 32000:
            raise KeyboardInterrupt
        record(kind="copy", c=c, dtype="bf16", ms=1.0, gbs=2.0)

    monkeypatch.setattr(T, "sweep_class", sweep)
    monkeypatch.setattr(T, "host_floor", lambda ctx, record: record(kind="host", c=16, dtype="fp32", what="x",
                                                                   ms=0.1, gbs=0.0))
    out = str(tmp_path / "tune")
    with pytest.raises(KeyboardInterrupt):
        T.main(["--out", out, "--classes", "1000", "4096", "32000", "128256"])
    data = json.loads(Path(out + ".json").read_text())
    assert data["device"] == "stand-in" and data["meta"]["complete"] is False
    assert [row["c"] for row in data["rows"]] == [1000, 4096]
    T.main(["--out", out, "--classes", "1000"])
    data = json.loads(Path(out + ".json").read_text())
    assert data["meta"]["complete"] is True and [row["kind"] for row in data["rows"]] == ["copy", "host"]
