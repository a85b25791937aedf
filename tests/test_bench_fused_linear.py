"""The fused linear + loss bench (bench/bench_fused_linear.py): other chunk sizes beside the default, the compiled
providers measured last with results written after each case, a provider's error recorded, Cut Cross-Entropy run
exact."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed


def test_the_fused_linear_bench_times_other_chunk_sizes_beside_the_default(tmp_path, monkeypatch):
    """--chunk-sizes adds calibkernels_fused_linear at those chunks, right after the default provider, each row's
    config naming its chunk (the default's the one default_chunk_size picked), with the same loss and gradient; a
    chunk that is not a positive row count is one error line and exit status 2."""
    from bench import bench_fused_linear as B
    from calibkernels.fused_linear import default_chunk_size

    monkeypatch.setattr(B, "PROVIDERS", dict(B.PROVIDERS))
    monkeypatch.setattr(B, "PROVIDER_CONFIG", dict(B.PROVIDER_CONFIG))
    B.main(["--device", "cpu", "--n", "12", "--h", "8", "--c", "20", "--reps", "2", "--warmup", "1", "--no-memory",
            "--weights", "brier/grad", "--out", str(tmp_path / "fl"), "--chunk-sizes", "5", "12", "5",
            "--providers", "materialized_calibkernels", "calibkernels_fused_linear"])
    rows = json.loads((tmp_path / "fl.json").read_text())["results"]
    assert [(r["provider"], r.get("config")) for r in rows] == [
        ("materialized_calibkernels", None),
        ("calibkernels_fused_linear", {"chunk_size": default_chunk_size(12, 20, 8, 4, "cpu")}),
        ("calibkernels_fused_linear_chunk5", {"chunk_size": 5}),
        ("calibkernels_fused_linear_chunk12", {"chunk_size": 12})]
    assert all(r["status"] == "ok" and r["loss_rel_diff"] < 1e-6 and r["grad_hidden_rel_diff"] < 1e-5 for r in rows)
    with pytest.raises(SystemExit) as exit_info:
        B.main(["--device", "cpu", "--chunk-sizes", "0"])
    assert exit_info.value.code == 2


def _fused_linear_main(tmp_path, monkeypatch, factories, providers):
    """bench_fused_linear's main on a tiny CPU case with two weights, some providers' factories replaced; the
    (provider, weight) of each factory call in order, and what it raised (None if nothing)."""
    from bench import bench_fused_linear as B

    for suffix in (".json", ".md"):  # each run's files are its own
        (tmp_path / f"fl{suffix}").unlink(missing_ok=True)
    calls = []
    for name in list(B.PROVIDERS):
        factory = factories.get(name, B.PROVIDERS[name])
        monkeypatch.setitem(B.PROVIDERS, name, lambda case, name=name, factory=factory: (
            calls.append((name, case["weight"])), factory(case))[1])
    argv = ["--device", "cpu", "--n", "12", "--h", "8", "--c", "20", "--reps", "3", "--warmup", "1", "--no-memory",
            "--weights", "brier/grad", "none/grad", "--out", str(tmp_path / "fl"), "--providers", *providers]
    try:
        B.main(argv)
    except KeyboardInterrupt as exc:
        return calls, exc
    return calls, None


def test_the_fused_linear_bench_measures_compiled_providers_last_and_writes_after_each_case(tmp_path, monkeypatch):
    """bench_fused_linear: the providers that compile are warmed up and timed after every other provider of every
    case (here a plain step stands in for the compiled one, still compared with the fused op's result); the results
    are rewritten after each case, so a run stopped in the compilation, or in the second case, keeps what it
    measured (meta.complete false, and each history row's extra.run_complete false)."""
    from bench import bench_fused_linear as B

    providers = ["chunked_reference_compiled", "calibkernels_fused_linear", "materialized_torch"]

    def read():
        data = json.loads((tmp_path / "fl.json").read_text())
        assert "complete" not in data  # where the harness's files keep it too: meta
        for r in data["results"]:
            assert r["history_row"]["extra"].get("run_complete", True) is data["meta"]["complete"]
        return data["meta"]["complete"], [(r["provider"], r["case"]["weight"], r["status"][:7])
                                          for r in data["results"]]

    calls, stopped = _fused_linear_main(tmp_path, monkeypatch, {"chunked_reference_compiled": B._fused_linear},
                                        providers)
    assert stopped is None
    assert calls == [("calibkernels_fused_linear", "brier"), ("materialized_torch", "brier"),
                     ("calibkernels_fused_linear", "none"), ("materialized_torch", "none"),
                     ("chunked_reference_compiled", "brier"), ("chunked_reference_compiled", "none")]
    complete, rows = read()
    assert complete and rows == [(p, w, "skipped" if (p, w) == ("materialized_torch", "brier") else "ok")
                                 for w in ("brier", "none") for p in providers]
    results = json.loads((tmp_path / "fl.json").read_text())["results"]
    assert all(r["loss_rel_diff"] < 1e-5 for r in results if r["status"] == "ok")
    assert (tmp_path / "fl.md").read_text().count("| chunked_reference_compiled |") == 2

    def interrupt(case):
        raise KeyboardInterrupt  # a wall-clock limit's SIGINT

    _, stopped = _fused_linear_main(tmp_path, monkeypatch, {"chunked_reference_compiled": interrupt}, providers)
    assert stopped is not None
    assert read() == (False, [("calibkernels_fused_linear", "brier", "ok"), ("materialized_torch", "brier", "skipped"),
                              ("calibkernels_fused_linear", "none", "ok"), ("materialized_torch", "none", "ok")])
    _, stopped = _fused_linear_main(tmp_path, monkeypatch, {"materialized_torch": lambda case: interrupt(case) if case[
        "weight"] == "none" else B._materialized_torch(case)}, providers[1:])
    assert stopped is not None
    assert read() == (False, [("calibkernels_fused_linear", "brier", "ok"), ("materialized_torch", "brier", "skipped")])
    assert "| materialized_torch | skipped" in (tmp_path / "fl.md").read_text()


def test_the_fused_linear_bench_records_a_providers_error_in_timing_or_memory_and_goes_on(monkeypatch):
    from bench import bench_fused_linear as B

    def failing_at(call_number):
        def factory(case):
            calls = []
            fused = B._fused_linear(case)

            def step(hidden, w, target):
                calls.append(1)
                if len(calls) == call_number:
                    raise RuntimeError("kernel exploded")
                return fused(hidden, w, target)

            return step

        return factory

    monkeypatch.setitem(B.PROVIDERS, "fails_timed", failing_at(2))  # warm-up 1, then the first timed repetition
    monkeypatch.setitem(B.PROVIDERS, "fails_memory", failing_at(4))  # warm-up 1, 2 timed, then the memory step
    case = dict(n=12, h=8, c=20, dtype="fp32", weight="none", mode="grad", device="cpu")
    results, _ = B.run_case(case, ["fails_timed", "calibkernels_fused_linear", "fails_memory"], warmup=1, reps=2,
                            max_time_s=60, memory=True)
    assert results["fails_timed"]["status"] == "error: RuntimeError: kernel exploded"
    assert results["fails_memory"]["status"] == "error: RuntimeError: kernel exploded"
    assert len(results["fails_memory"]["times_ms"]) == 2
    ok = results["calibkernels_fused_linear"]
    assert ok["status"] == "ok" and ok["reps"] == 2 and ok["peak_extra_mb"] >= 0


def test_cut_cross_entropy_runs_exact_and_says_so(monkeypatch):
    """Cut Cross-Entropy's default filter_eps="auto" filters the gradient (less work than an exact one): the provider
    passes filter_eps=None and its rows' config records it."""
    import importlib.machinery
    import types

    from bench import bench_fused_linear as B

    calls = []
    fake = types.ModuleType("cut_cross_entropy")
    fake.__spec__ = importlib.machinery.ModuleSpec("cut_cross_entropy", None)
    fake.linear_cross_entropy = lambda e, c, targets, **kw: calls.append(kw) or (e @ c.T).sum()
    monkeypatch.setitem(sys.modules, "cut_cross_entropy", fake)
    case = dict(n=4, h=3, c=5, dtype="fp32", weight="none", mode="grad", device="cuda")
    B._cut_cross_entropy(case)(torch.randn(4, 3), torch.randn(5, 3), torch.zeros(4, dtype=torch.long))
    assert calls == [{"filter_eps": None}]
    row = B._history_row({"cpu": "x", "cpu_count": 2, "torch_threads": 2, "date": "d", "git_commit": None,
                          "git_dirty": None, "torch": "t", "load_average_1min": None}, case, "cut_cross_entropy",
                         {"status": "ok", "config": dict(B.PROVIDER_CONFIG["cut_cross_entropy"])}, "f.json")
    assert row["config"]["filter_eps"] is None and "filter_eps" in row["config"]
