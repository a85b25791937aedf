"""The benchmark harness (bench/harness.py) runs, and every provider it times computes the right loss and gradient.

Correctness only: no timing is ever asserted. Tiny shapes keep this under a few seconds apart from the one
``torch.compile`` of the reference (inductor on CPU).
"""

import datetime as dt
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench import harness  # noqa: E402
from bench.harness import Case, Suite  # noqa: E402
from calibkernels import reference as ck_reference  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

CPU_PROVIDERS = [name for name, p in harness.PROVIDERS.items() if "cpu" in p.devices]
CUDA_PROVIDERS = [name for name, p in harness.PROVIDERS.items() if "cuda" in p.devices]
KINDS = harness.TARGET_KINDS


def _tiny_case(provider: str, device: str, dtype: str = "fp32", target: str = "hard") -> Case:
    # odd sizes (not multiples of a vector width); weight "none" where the provider is plain cross-entropy
    weight = "none" if harness.PROVIDERS[provider].weights == ("none",) else "brier"
    return Case(37, 19, dtype, weight, "grad", device, target)


def _assert_runs_and_matches_reference(provider: str, case: Case, timed: bool = True):
    """One harness timing + memory measurement, then one step compared with the float64 reference.

    The same step object is used for both (``torch.compile`` compiles once)."""
    step = harness.build_step(harness.PROVIDERS[provider], case)
    if timed:
        leaf, target = harness.make_inputs(case)
        timing = harness.time_step(step, leaf, target, warmup=1, reps=2)
        assert timing.reps == 2 and math.isfinite(timing.median_ms) and timing.median_ms > 0
        assert harness.peak_extra_memory(step, leaf, target) >= 0
    loss, grad, ref_loss, ref_grad = harness.check_provider(harness.PROVIDERS[provider], case, seed=1234, step=step)
    assert loss.shape == ref_loss.shape and grad.shape == ref_grad.shape == (case.n, case.c)
    rtol, atol = harness.check_tolerance(case.dtype)
    torch.testing.assert_close(loss.double().cpu(), ref_loss.cpu(), rtol=rtol, atol=atol)
    torch.testing.assert_close(grad.double().cpu(), ref_grad.cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("target", KINDS)
@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_cpu_provider_runs_and_matches_reference(provider, target):
    case = _tiny_case(provider, "cpu", target=target)
    reason = harness.unavailable_reason(harness.PROVIDERS[provider], case)
    if reason is not None:
        pytest.skip(reason)
    _assert_runs_and_matches_reference(provider, case)


@pytest.mark.parametrize("target", KINDS)
@pytest.mark.parametrize("provider", ["calibkernels_cpu", "calibkernels_cpu_inplace", "torch_cross_entropy"])
def test_cpu_provider_bf16_matches_reference(provider, target):
    case = _tiny_case(provider, "cpu", "bf16", target)  # a dense target stays float32, as timm builds it
    reason = harness.unavailable_reason(harness.PROVIDERS[provider], case)
    if reason is not None:
        pytest.skip(reason)
    _assert_runs_and_matches_reference(provider, case, timed=False)


@pytest.mark.gpu
@pytest.mark.parametrize("target", KINDS)
@pytest.mark.parametrize("provider", CUDA_PROVIDERS)
def test_cuda_provider_runs_and_matches_reference(provider, target):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    case = _tiny_case(provider, "cuda", target=target)
    reason = harness.unavailable_reason(harness.PROVIDERS[provider], case)
    if reason is not None:
        pytest.skip(reason)
    _assert_runs_and_matches_reference(provider, case)


def test_peak_extra_memory_counts_the_step_allocations():
    """The CPU method (profiler allocation records) sees a step that holds two N×C buffers at its peak."""
    case = Case(256, 1000, "fp32", "none", "grad", "cpu")
    leaf, target = harness.make_inputs(case)

    def step(logits, target):
        a = torch.full_like(logits, 1.0)
        b = torch.full_like(logits, 2.0)
        del a
        c = torch.full_like(logits, 3.0)  # reuses a's block or not: either way at most two are alive
        return (b + c).sum()  # a third, short-lived N×C for the sum: peak is three buffers

    peak = harness.peak_extra_memory(step, leaf, target)
    assert abs(peak - 3 * case.nc_bytes) < 0.05 * case.nc_bytes, (peak, case.nc_bytes)


def test_inapplicable_and_unknown_providers_are_reported():
    liger, ce = harness.PROVIDERS["liger_cross_entropy"], harness.PROVIDERS["torch_cross_entropy"]
    cpu_brier = Case(8, 4, "fp32", "brier", "grad", "cpu")
    assert harness.unavailable_reason(liger, cpu_brier) is not None
    assert "does not apply" in harness.unavailable_reason(ce, cpu_brier)
    result = harness.bench_one(ce, cpu_brier)
    assert result.status.startswith("skipped") and result.median_ms is None
    with pytest.raises(RuntimeError, match="cannot run"):
        harness.build_step(ce, cpu_brier)
    with pytest.raises(ValueError, match="dtype"):
        Case(8, 4, "fp64")


def test_script_writes_json_and_markdown(tmp_path, capsys):
    case = Case(16, 7, "fp32", "brier", "grad", "cpu")
    suites = {"cpu": [Suite("tiny", (case,), ("calibkernels_cpu", "reference", "torch_cross_entropy"))]}
    out = tmp_path / "tiny"
    harness.main(suites, suites, argv=["--device", "cpu", "--out", str(out), "--warmup", "0", "--reps", "2"])
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


def test_a_failing_provider_is_recorded_and_the_others_still_measured():
    def broken(case):
        def step(logits, target):
            raise RuntimeError("kernel exploded")

        return step

    bad = harness.Provider("broken", "broken", ("cpu",), broken)
    case = Case(8, 5, "fp32", "brier", "grad", "cpu")
    results = harness.bench_case(case, [bad, harness.PROVIDERS["reference"]], warmup=1, reps=2)
    by_name = {r.provider: r for r in results}
    assert by_name["broken"].status == "error: RuntimeError: kernel exploded" and by_name["broken"].median_ms is None
    assert by_name["reference"].status == "ok" and by_name["reference"].reps == 2


# ---------------------------------------------------------------------------------------------------------------------
# Host-step suite (issue #20)
# ---------------------------------------------------------------------------------------------------------------------
def test_quick_and_full_cpu_runs_hold_the_headline_and_the_host_step_suite():
    from bench import bench_uncertainty_weighted_ce as B

    for suites in (B.SUITES["cpu"], B.QUICK_SUITES["cpu"]):
        assert any(B.HEADLINE_CPU in s.cases and "reference_compiled" in s.providers for s in suites)
        (host,) = [s for s in suites if s.name == "cpu-host-step"]
        assert host.measure == "host_step" and host.baseline == "torch_cross_entropy"
        assert {(c.n, c.c, c.dtype, c.weight, c.mode) for c in host.cases} == {(4, 10, "fp32", "brier", "grad"),
                                                                              (256, 1000, "fp32", "brier", "grad")}
        assert set(host.providers) == {"calibkernels", "torch_cross_entropy"} and set(host.threads) == {1, None}


def test_host_step_measures_every_provider_per_thread_count_with_paired_ratios():
    case = Case(4, 10, "fp32", "brier", "grad", "cpu")
    providers = [harness.PROVIDERS["calibkernels"], harness.PROVIDERS["torch_cross_entropy"]]
    threads_before = torch.get_num_threads()
    results = harness.bench_host_case(case, providers, threads=(1, None), baseline="torch_cross_entropy", reps=3,
                                      rep_ms=1.0, warmup=2)
    assert torch.get_num_threads() == threads_before
    assert [(r.provider, r.threads) for r in results] == [
        ("calibkernels", 1), ("torch_cross_entropy", 1),
        ("calibkernels", threads_before), ("torch_cross_entropy", threads_before)]
    for r in results:
        assert r.status == "ok" and r.measure == "host_step" and r.case_id == "cpu-4x10-fp32", r
        assert r.reps == 3 and len(r.times_ms) == 3 and r.steps_per_rep >= 1 and r.min_ms <= r.median_ms <= r.max_ms
        assert r.baseline == "torch_cross_entropy" and r.ratio_to_baseline > 0 and r.paired_ratio_to_baseline > 0
    by = {(r.provider, r.threads): r for r in results}
    assert by["torch_cross_entropy", 1].ratio_to_baseline == by["torch_cross_entropy", 1].paired_ratio_to_baseline == 1
    # each row says which loss its provider computed
    assert by["calibkernels", 1].case["weight"] == "brier" and by["torch_cross_entropy", 1].case["weight"] == "none"
    ck_times, ce_times = by["calibkernels", 1].times_ms, by["torch_cross_entropy", 1].times_ms
    assert by["calibkernels", 1].paired_ratio_to_baseline == pytest.approx(
        sorted(a / b for a, b in zip(ck_times, ce_times))[1], rel=1e-3)  # times are rounded to 1 ns in the result


def test_host_steps_reuse_one_leaf_and_reset_its_gradient():
    leaf = torch.randn(4, 10, requires_grad=True)
    target = torch.tensor([0, 3, 9, 1])
    seen = []

    def step(logits, tgt):
        seen.append((logits is leaf, logits.grad is None))
        loss = torch.nn.functional.cross_entropy(logits, tgt)
        loss.backward()
        return loss

    timing = harness.time_host_steps({"ce": step}, leaf, target, reps=2, rep_ms=0.5, warmup=1)["ce"]
    assert seen and all(is_leaf and grad_reset for is_leaf, grad_reset in seen)
    assert len(seen) >= 1 + 2 * timing.steps_per_rep and leaf.grad is None


# ---------------------------------------------------------------------------------------------------------------------
# Soft targets
# ---------------------------------------------------------------------------------------------------------------------
def test_soft_target_kinds_share_the_logits_and_keep_the_hard_ids():
    hard = Case(37, 19, "fp32", "brier", "grad", "cpu")
    assert hard.id == "cpu-37x19-fp32-brier-grad" and hard.target == "hard" and hard.hard is hard
    with pytest.raises(ValueError, match="target kind"):
        Case(8, 4, target="onehot")
    leaf, y = harness.make_inputs(hard, seed=3)
    assert isinstance(y, torch.Tensor) and y.dtype == torch.int64
    soft = {}
    for kind in KINDS[1:]:
        case = Case(37, 19, "fp32", "brier", "grad", "cpu", kind)
        assert case.id == f"{hard.id}-{kind}" and case.hard == hard
        logits, soft[kind] = harness.make_inputs(case, seed=3)
        assert torch.equal(logits, leaf) and isinstance(soft[kind], harness.SoftTarget) and soft[kind].kind == kind
    assert torch.equal(soft["smooth"].target, y) and soft["smooth"].kwargs == {"label_smoothing": 0.1}
    mix = soft["mix"].kwargs
    assert set(mix) == {"mix_target", "mix_lambda"} and torch.equal(mix["mix_target"], y.flip(0))
    lam = mix["mix_lambda"]
    assert lam.shape == (37,) and lam.dtype == torch.float32 and bool(((lam >= 0) & (lam <= 1)).all())
    assert lam.unique().numel() > 30  # one lambda per row
    assert torch.equal(lam, harness.make_inputs(Case(37, 19, target="mix"), seed=3)[1].kwargs["mix_lambda"])
    assert soft["mix_smooth"].kwargs["label_smoothing"] == 0.1 and torch.equal(soft["mix_smooth"].kwargs["mix_lambda"],
                                                                               lam)
    dense = soft["dense"]
    assert dense.kwargs == {} and dense.target.shape == (37, 19) and dense.target.dtype == torch.float32
    torch.testing.assert_close(dense.target.double().sum(1), torch.ones(37, dtype=torch.float64))
    # the dense target is the dense form of "mix_smooth": the same loss and gradient in float64
    z = leaf.detach().double()
    compact = ck_reference.uncertainty_weighted_ce(z, y, **soft["mix_smooth"].kwargs)
    torch.testing.assert_close(ck_reference.uncertainty_weighted_ce(z, dense.target.double()), compact, rtol=1e-6,
                               atol=0)
    assert Case(37, 19, target="dense").min_traffic_bytes == 2 * hard.nc_bytes + 37 * 19 * 4


def test_providers_apply_to_the_target_kinds_they_compute():
    ce, liger = harness.PROVIDERS["torch_cross_entropy"], harness.PROVIDERS["liger_cross_entropy"]
    for kind in KINDS:
        assert ce.applies_to(Case(8, 4, "fp32", "none", "grad", "cpu", kind))
        assert liger.applies_to(Case(8, 4, "fp32", "none", "grad", "cuda", kind)) == (kind in ("hard", "smooth"))
        assert harness.PROVIDERS["calibkernels_triton"].applies_to(Case(8, 4, device="cuda", target=kind))


def test_the_target_kinds_of_a_case_are_timed_together_interleaved():
    seen = []

    def recorder(case):
        def step(logits, target):
            seen.append((case.target, type(target).__name__))
            loss = logits.sum()
            loss.backward()
            return loss

        return step

    provider = harness.Provider("recorder", "recorder", ("cpu",), recorder)
    cases = [Case(8, 5, "fp32", "brier", "grad", "cpu", kind) for kind in ("hard", "smooth", "dense")]
    results = harness.bench_cases([(case, [provider]) for case in cases], warmup=0, reps=3, memory=False)
    assert [(r.case_id, r.status, r.reps) for r in results] == [(c.id, "ok", 3) for c in cases]
    assert all(r.case["target"] == c.target for r, c in zip(results, cases))
    assert set(seen) == {("hard", "Tensor"), ("smooth", "SoftTarget"), ("dense", "SoftTarget")}
    for r in range(3):  # each repetition runs every kind once before the next repetition starts
        assert {kind for kind, _ in seen[3 * r:3 * r + 3]} == {"hard", "smooth", "dense"}
    with pytest.raises(ValueError, match="target kinds of one case"):
        harness.bench_cases([(cases[0], [provider]), (Case(8, 6, target="smooth"), [provider])])


def test_a_run_with_soft_targets_reports_the_ratio_to_hard_targets(tmp_path):
    cases = tuple(Case(16, 7, "fp32", "none", "grad", "cpu", kind) for kind in KINDS)
    suites = {"cpu": [Suite("tiny-soft", cases, ("calibkernels_cpu", "reference", "torch_cross_entropy"))]}
    out, history = tmp_path / "soft", tmp_path / "history.jsonl"
    results = harness.main(suites, suites, argv=["--device", "cpu", "--out", str(out), "--history", str(history),
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
    assert len(rows) == len(results) and all(tuple(row) == harness.HISTORY_FIELDS for row in rows)
    assert {(row["case_id"], row["target"]) for row in rows} == {
        ("cpu-16x7-fp32-none-grad", "hard"), ("cpu-16x7-fp32-none-grad-mix", "mix"),
        ("cpu-16x7-fp32-none-grad-dense", "dense")}
    assert all(("ratio_to_hard" in row["extra"]) == (row["target"] != "hard") for row in rows)
    meta = json.loads(out.with_suffix(".json").read_text())["meta"]
    assert meta["suite"] == "cpu-subset" and meta["targets"] == ["hard", "mix", "dense"]


def test_rows_of_result_files_from_before_target_kinds_are_hard():
    meta = dict(harness.machine_info("cpu"), date="2000-01-01T00:00:00+00:00")
    old = {"case": {"n": 16, "c": 7, "dtype": "fp32", "weight": "brier", "mode": "grad", "device": "cpu"},
           "case_id": "cpu-16x7-fp32-brier-grad", "provider": "reference", "label": "eager reference",
           "status": "ok", "median_ms": 1.0, "min_ms": 0.5, "max_ms": 2.0, "reps": 2, "times_ms": [1.0, 2.0]}
    (row,) = harness.history_rows(meta, [old], "old", "bench/results/old.json")
    assert row["target"] == "hard" and row["case_id"] == old["case_id"]
    assert "| hard |" in harness.markdown_table(meta, [harness.Result(**old)])


def test_the_soft_target_suites():
    from bench import bench_uncertainty_weighted_ce as B

    def suite(runs, name):
        (found,) = [s for s in runs if s.name == name]
        return found

    full, quick = suite(B.SUITES["cpu"], "cpu-soft-targets"), suite(B.QUICK_SUITES["cpu"], "cpu-soft-targets-quick")
    assert {(c.n, c.c, c.dtype, c.weight, c.target) for c in full.cases} == {
        (4096, 1000, "fp32", weight, kind) for weight in ("brier", "none") for kind in KINDS}
    assert set(full.providers) == {"calibkernels_cpu", "calibkernels_cpu_inplace", "reference_compiled",
                                   "torch_cross_entropy"}
    assert {(c.weight, c.target) for c in quick.cases} == {("brier", kind) for kind in KINDS}
    assert B.HEADLINE_CPU in quick.cases and "torch_cross_entropy" not in quick.providers
    gpu = suite(B.SUITES["cuda"], "cuda-soft-targets")
    assert {(c.n, c.c, c.dtype, c.weight, c.target) for c in gpu.cases} == {
        (8192, c, "bf16", weight, kind) for c in (1000, 32000) for weight in ("brier", "none") for kind in KINDS}
    assert {"calibkernels_triton", "calibkernels_cuda", "torch_cross_entropy", "liger_cross_entropy"} <= set(
        gpu.providers)


# ---------------------------------------------------------------------------------------------------------------------
# Result files and history.jsonl
# ---------------------------------------------------------------------------------------------------------------------
def _assert_well_formed_history_row(row: dict, source_file: str):
    assert tuple(row) == harness.HISTORY_FIELDS  # every field, in the documented order
    assert row["schema"] == 2 and row["kernel"] == "uncertainty_weighted_ce" and row["device_type"] == "cpu"
    assert row["target"] in harness.TARGET_KINDS and row["case_id"].endswith(
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
    assert row["extra"]["label"] == harness.PROVIDERS[row["provider"]].label
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
    meta = harness.machine_info("cpu")
    slug = harness.device_slug(meta)
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

    results = harness.main(suites, suites, argv=[
        "--device", "cpu", "--suite", "tinyrun", "--results-dir", str(tmp_path), "--warmup", "0", "--reps", "2",
        "--host-rep-ms", "1", "--no-memory"])

    stem = harness.result_stem("tinyrun", meta)
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
    harness.main(suites, suites, argv=[
        "--device", "cpu", "--suite", "tinyrun", "--results-dir", str(tmp_path), "--warmup", "0", "--reps", "2",
        "--host-rep-ms", "1", "--no-memory", "--providers", "reference", "calibkernels"])
    names = sorted(f.name for f in tmp_path.glob(f"tinyrun-{slug}-*"))
    assert names == [f"{stem}.json", f"{stem}.md"]
    assert len(history.read_text().splitlines()) == 1 + 1 + len(results) + 3


def test_device_slugs_name_the_model_without_vendor_words():
    assert harness.device_slug({"device": "cuda", "gpu": "NVIDIA H200"}) == "h200"
    assert harness.device_slug({"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}) == "h100-80gb-hbm3"
    assert harness.device_slug({"device": "cpu", "cpu": "AMD EPYC"}) == "epyc"
    assert harness.device_slug({"device": "cpu", "cpu": "Intel(R) Xeon(R) Processor"}) == "xeon"
    assert harness.device_slug({"device": "cpu", "cpu": "AMD EPYC 7763 64-Core Processor"}) == "epyc-7763"


def test_the_repositorys_history_rows_are_well_formed_and_hold_every_run_of_the_bench_writer():
    """Every history.jsonl row has every field of its version, in order (version 1: all but ``target``); every
    result JSON that the writer made (``meta.suite``) is named ``<suite>-<device>-<date>`` and its run (suite and start
    time) is in the history."""
    results = ROOT / "bench" / "results"
    history = [json.loads(line) for line in (results / "history.jsonl").read_text().splitlines()]
    fields = {1: harness.HISTORY_FIELDS_V1, 2: harness.HISTORY_FIELDS}
    assert history and all(tuple(row) == fields[row["schema"]] for row in history)
    runs = {(row["suite"], row["date"]) for row in history}
    for path in sorted(results.glob("*.json")):
        meta = json.loads(path.read_text()).get("meta")
        if isinstance(meta, dict) and meta.get("suite") and (meta.get("cpu") or meta.get("gpu")):
            assert path.stem == harness.result_stem(meta["suite"], meta), path.name
            assert (meta["suite"], meta["date"]) in runs, f"{path.name}: its run is not in history.jsonl"


# ---------------------------------------------------------------------------------------------------------------------
# Output on a machine without a GPU (issue #19, item 15)
# ---------------------------------------------------------------------------------------------------------------------
def test_the_quick_runs_memory_measurement_prints_no_profiler_logs(tmp_path):
    """The CPU peak-memory step runs torch.profiler; its back end must not print its USDT start/stop lines or, without
    a GPU, "gpuGetDeviceCount failed". A fresh process: the profiler's logging is set up when its first run starts."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from bench import harness
from bench.harness import Case, Suite
suites = {{"cpu": [Suite("q", (Case(64, 100, "fp32", "brier", "grad", "cpu"),),
                        ("calibkernels_cpu", "calibkernels_cpu_inplace", "reference"))]}}
results = harness.main(suites, suites, argv=["--device", "cpu", "--out", {str(tmp_path / "q")!r}, "--warmup", "0",
                                             "--reps", "1"])
assert all(r.peak_extra_mb is not None for r in results if r.status == "ok"), results
print("measured", sum(r.status == "ok" for r in results))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("KINETO_LOG_LEVEL", "TORCH_CPP_LOG_LEVEL")}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output
    assert "measured" in proc.stdout
    assert "USDT" not in output and "gpuGetDeviceCount" not in output, output


# ---------------------------------------------------------------------------------------------------------------------
# GPU tools (they need a GPU to run; here: their command lines and the Triton launch-shape override)
# ---------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("module", ["bench.tune_triton", "bench.profile_step", "bench.bench_metrics"])
def test_gpu_tools_print_their_help(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stdout + proc.stderr


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


def _prebuilt_tree(tmp_path, monkeypatch):
    """A tree with sources and a stamped build for this interpreter and torch, as `bench.prebuilt build` leaves it."""
    import sysconfig

    from bench import prebuilt

    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    (tmp_path / "csrc" / "op.cpp").write_text("int op();\n")
    (tmp_path / "csrc" / "cuda" / "rows.cu").write_text("__global__ void k() {}\n")
    (tmp_path / "setup.py").write_text("# setup\n")
    (tmp_path / "calibkernels").mkdir()
    so = f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    (tmp_path / "calibkernels" / so).write_bytes(b"\x7fELF")
    monkeypatch.setattr(prebuilt, "ROOT", tmp_path)
    monkeypatch.setattr(prebuilt, "STAMP", tmp_path / "calibkernels" / "_C.prebuilt.json")
    archs = "%d.%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else "9.0"
    stamp = {"sources": prebuilt.sources_hash(tmp_path), "suffix": sysconfig.get_config_var("EXT_SUFFIX"),
             "torch": torch.__version__, "archs": archs, "file": so, "file_sha256": prebuilt._file_hash(
                 tmp_path / "calibkernels" / so)}
    prebuilt.STAMP.write_text(json.dumps(stamp))
    return prebuilt, stamp


def test_a_prebuilt_extension_is_used_only_where_its_stamp_matches(tmp_path, monkeypatch, capsys):
    prebuilt, stamp = _prebuilt_tree(tmp_path, monkeypatch)
    assert prebuilt.check() == 0, capsys.readouterr().out
    # an edited, added or renamed source file: compile again
    for change in ("edit", "add", "rename"):
        cu = tmp_path / "csrc" / "cuda" / "rows.cu"
        original = cu.read_text()
        if change == "edit":
            cu.write_text(original + "// one more line\n")
        elif change == "add":
            (tmp_path / "csrc" / "extra.h").write_text("\n")
        else:
            cu.rename(tmp_path / "csrc" / "cuda" / "rows2.cu")
        capsys.readouterr()
        assert prebuilt.check() == 1
        assert "the sources changed" in capsys.readouterr().out
        (tmp_path / "csrc" / "extra.h").unlink(missing_ok=True)
        if change == "rename":
            (tmp_path / "csrc" / "cuda" / "rows2.cu").rename(cu)
        cu.write_text(original)
        assert prebuilt.check() == 0
    # another torch, another interpreter, a missing library, no stamp
    for key, value, reason in [("torch", "2.0.0", "built against torch 2.0.0"),
                               ("suffix", ".cpython-39-x86_64-linux-gnu.so", "built for .cpython-39")]:
        prebuilt.STAMP.write_text(json.dumps(dict(stamp, **{key: value})))
        capsys.readouterr()
        assert prebuilt.check() == 1 and reason in capsys.readouterr().out
    prebuilt.STAMP.write_text(json.dumps(stamp))
    # an editor's backup beside the sources is not a source
    (tmp_path / "csrc" / "op.cpp~").write_text("old\n")
    assert prebuilt.check() == 0
    # a library built again after the stamp, or none
    library = tmp_path / "calibkernels" / stamp["file"]
    library.write_bytes(b"\x7fELF again")
    capsys.readouterr()
    assert prebuilt.check() == 1 and "is not the stamped build" in capsys.readouterr().out
    library.unlink()
    capsys.readouterr()
    assert prebuilt.check() == 1 and f"no calibkernels/{library.name}" in capsys.readouterr().out
    prebuilt.STAMP.unlink()
    assert prebuilt.check() == 1


@pytest.mark.parametrize("archs,capability,usable", [("9.0", (9, 0), True), ("8.0;9.0a", (9, 0), True),
                                                      ("9.0+PTX", (9, 0), True), ("8.0 9.0", (9, 0), True),
                                                      ("9.0", (8, 0), False), ("8.6;9.0", (8, 0), False)])
def test_a_prebuilt_extension_needs_the_devices_compute_capability(tmp_path, monkeypatch, capsys, archs, capability,
                                                                     usable):
    prebuilt, stamp = _prebuilt_tree(tmp_path, monkeypatch)
    prebuilt.STAMP.write_text(json.dumps(dict(stamp, archs=archs)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert prebuilt.check() == (0 if usable else 1), capsys.readouterr().out


def _run_lease_script(stages, env, stand_ins=(), edits=()):
    """bench/run_on_gpu.sh run from a copy whose functions named in ``stand_ins`` ((name, body) pairs) are replaced
    (the real stages need a GPU), with the text edits ``edits`` ((old, new) pairs, each old text present), and which
    installs no wheels."""
    script = (ROOT / "bench" / "run_on_gpu.sh").read_text().replace('if compgen -G ".whl/*.whl"', 'if false', 1)
    for old, new in edits:
        assert old in script, old
        script = script.replace(old, new)
    for name, body in stand_ins:
        script = script.replace(f"{name}() {{", f"{name}() {{ {body}; }}\n_unused_{name}() {{", 1)
    fake = ROOT / "bench" / f".run_on_gpu_test_{os.getpid()}.sh"
    fake.write_text(script)
    try:
        return subprocess.run(["bash", str(fake), *stages], capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env=dict(os.environ, **env))
    finally:
        fake.unlink()


def test_the_lease_script_stops_a_stage_at_its_deadline_and_skips_the_rest(tmp_path):
    """bench/run_on_gpu.sh with DEADLINE: the summary still prints, naming the stopped and the skipped stages; a
    `timeout` inside a stage ends by the deadline too; with PACK the output folder holds the archive of everything and
    the summary. (The name leaves out the words of run_on_gpu.sh's test selection, which would run it there.)"""
    import tarfile

    # stand-in stages: one that writes with $PY into $OUT and ends in a failing pipeline (whose status the stage must
    # keep, as the build stage's check does), one whose own `timeout` (as the test stage's) outlasts the deadline, one
    # left no time
    proc = _run_lease_script(["soft", "quick", "bench"],
                             dict(OUT=str(tmp_path), DEADLINE="18", PACK="1", PYTHON=sys.executable),
                             [("do_soft", '$PY -c "print(7 * 6)" > "$OUT/soft.txt"; false | cat'),
                              ("do_quick", 'timeout "$(within_stage 100)" sleep 40'),
                              ("do_bench", "echo bench-ran")])
    lines = proc.stdout.strip().splitlines()
    assert lines[-3].startswith("soft: rc=1,"), proc.stdout + proc.stderr
    assert lines[-2].startswith("quick: rc=124") and "stopped at DEADLINE" in lines[-2], proc.stdout + proc.stderr
    assert int(lines[-2].split(", ")[1].removesuffix(" s")) <= 22, lines[-2]  # not the 10 s of SIGKILL's grace
    assert lines[-1].startswith("bench: skipped"), proc.stdout
    assert "bench-ran" not in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["gpu-run.tgz", "summary.txt"]
    assert (tmp_path / "summary.txt").read_text().splitlines() == lines[-3:]
    with tarfile.open(tmp_path / "gpu-run.tgz") as archive:
        assert "./summary.txt" in archive.getnames()
        assert archive.extractfile("./soft.txt").read() == b"42\n"


def test_the_lease_scripts_training_stage_runs_the_runs_it_is_given(tmp_path):
    """bench/run_on_gpu.sh train with TRAIN_RUNS and TRAIN_CIFAR=0, its Python a stand-in that logs its arguments:
    each run is stopped at its last epoch's progress line (on stderr), before the evaluation that would follow, and
    that line is its result; a run that ends before it fails the stage and says so."""
    import time

    stand_in = _stand_in_python(tmp_path / "python", """echo "$@" >> "$OUT/calls.txt"
case "$*" in *"--backend cuda"*) echo "Traceback: no CUDA" >&2; exit 1 ;; esac
echo "epoch 1/2  100 steps  loss 6.9  lr 0.1  12 img/s  80.0 s" >&2
echo "epoch    1/2  loss 6.9  train acc 0.10%  12 img/s"
echo "epoch 2/2  100 steps  loss 6.8  lr 0.1  2500 img/s  10.2 s" >&2
sleep 60  # the evaluation, which the stage does not wait for
echo "evaluated" >> "$OUT/calls.txt"
""")
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _run_lease_script(["train"], dict(OUT=str(out), PYTHON=stand_in, TRAIN_CIFAR="0",
                                             TRAIN_RUNS="bsce_gra triton,cross_entropy cuda"))
    assert time.monotonic() - start < 30, "the stage waited for the evaluation"
    assert proc.stdout.strip().splitlines()[-1].startswith("train: rc=1"), proc.stdout + proc.stderr
    calls = (out / "calls.txt").read_text().splitlines()
    assert len(calls) == 2 and all("--recipe imagenet-resnet50-finetune" in c for c in calls), calls
    assert all("--epochs 2 --eval-every 3" in c for c in calls), calls  # no evaluation after epoch 1
    assert "--loss bsce_gra --backend triton" in calls[0] and "--loss cross_entropy --backend cuda" in calls[1]
    assert (out / "train-throughput.txt").read_text().splitlines() == [
        "bsce_gra / triton: epoch 2/2  100 steps  loss 6.8  lr 0.1  2500 img/s  10.2 s",
        f"cross_entropy / cuda: no epoch finished (see {out}/train-r50-cross_entropy-cuda.log)"]


def test_the_lease_scripts_host_profile_stage_profiles_the_classification_shapes(tmp_path):
    """bench/run_on_gpu.sh hostprofile: profile_step's cProfile of the default call, the CUDA backend and
    F.cross_entropy at 256 and 8192 x 1000 bf16, into host-profile.txt, of which it prints the headings."""
    stand_in = _stand_in_python(tmp_path / "python", """echo "$@" >> "$OUT/calls.txt"
echo "== host profile: cuda-256x1000-bf16-brier-grad · calibkernels, 300 steps"
echo "         14400 function calls in 0.5 seconds"
echo "   ncalls  tottime"
""")
    out = tmp_path / "out"
    proc = _run_lease_script(["hostprofile"], dict(OUT=str(out), PYTHON=stand_in))
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("hostprofile: rc=0"), proc.stdout + proc.stderr
    assert lines[-3:-1] == ["== host profile: cuda-256x1000-bf16-brier-grad · calibkernels, 300 steps",
                            "         14400 function calls in 0.5 seconds"], proc.stdout
    (call,) = (out / "calls.txt").read_text().splitlines()
    assert call.startswith("-m bench.profile_step --cases 256x1000-bf16-brier 256x1000-bf16-none") and (
        "--host-profile --providers calibkernels calibkernels_cuda torch_cross_entropy" in call), call
    assert "ncalls" in (out / "host-profile.txt").read_text()


def test_the_lease_scripts_build_stage_forces_the_device_kernels_and_fails_without_them(tmp_path):
    """The build stage compiles with CALIBKERNELS_FORCE_CUDA=1 (setup.py would otherwise build without the CUDA
    kernels where it finds no nvcc) and fails, with one line saying why, when the extension it leaves has none on a
    machine with a GPU. The stand-in Python answers each of the stage's calls; the copy deletes no build."""
    stand_in = _stand_in_python(tmp_path / "python", """\
echo "$* FORCE=${CALIBKERNELS_FORCE_CUDA:-unset}" >> "$OUT/calls.txt"
case "$*" in
  *"bench.prebuilt check"*) exit 1 ;;
  *get_device_capability*) echo 9.0 ;;
  *"raise SystemExit"*) exit "$KERNELS_MISSING" ;;
  *) echo stand-in ;;
esac
""")
    keep_the_build = [("rm -rf build calibkernels/_C.*.so calibkernels/_C.prebuilt.json", ": rm")]
    for missing in (1, 0):
        out = tmp_path / f"out{missing}"
        proc = _run_lease_script(["build"], dict(OUT=str(out), PYTHON=stand_in, KERNELS_MISSING=str(missing)),
                                 edits=keep_the_build)
        lines = proc.stdout.strip().splitlines()
        assert lines[-1].startswith(f"build: rc={missing},"), proc.stdout + proc.stderr
        calls = (out / "calls.txt").read_text().splitlines()
        (setup,) = [call for call in calls if call.startswith("setup.py")]
        assert setup.endswith("FORCE=1"), calls
        said = [line for line in lines if "has no CUDA kernels" in line]
        assert len(said) == missing, proc.stdout


def _stand_in_python(path, body):
    """An executable shell script at ``path`` standing in for the lease script's Python (``$PYTHON``)."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_the_lease_scripts_test_stage_stops_pytest_with_sigint_and_keeps_its_summary(tmp_path):
    """The test stage's own timeout (TEST_TIMEOUT) sends SIGINT, on which pytest writes its summary (the failures so
    far, short tracebacks): the log holds it and the stage prints its FAILED lines; a pytest that ignores SIGINT is
    killed TEST_GRACE s later. The stand-in pytest answers SIGINT as pytest does, and notes the signal it got."""
    summary = ("=== FAILURES ===; tests/test_a.py:3: in test_x; E   AssertionError: boom; "
               "=== short test summary info ===; FAILED tests/test_a.py::test_x - AssertionError: boom; "
               "=== 1 failed, 2 passed in 2.00s ===")
    answers = _stand_in_python(tmp_path / "python", f"""echo "$@" > "$OUT/args.txt"
trap 'echo INT > "$OUT/signal.txt"; printf "%s\\n" "{summary}" | tr ";" "\\n" | sed "s/^ //"; exit 2' INT
trap 'echo TERM > "$OUT/signal.txt"; exit 143' TERM
echo "tests/test_a.py::test_x FAILED"
while :; do sleep 0.1; done
""")
    out = tmp_path / "out"
    proc = _run_lease_script(["test"], dict(OUT=str(out), PYTHON=answers, TEST_TIMEOUT="2", TEST_GRACE="2"))
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("test: rc=124,") and int(last.split(", ")[1].removesuffix(" s")) < 4, proc.stdout
    assert (out / "signal.txt").read_text() == "INT\n"
    log = (out / "pytest.log").read_text()
    assert "short test summary info" in log and "E   AssertionError: boom" in log, log
    assert "FAILED tests/test_a.py::test_x - AssertionError: boom" in proc.stdout.splitlines(), proc.stdout
    assert "pytest stopped after 2 s (rc=124" in proc.stdout and "1 failed, 2 passed in 2.00s" in proc.stdout
    args = (out / "args.txt").read_text().split()
    assert "--tb=short" in args and "-rfE" in args, args

    deaf = _stand_in_python(tmp_path / "deaf-python", "trap '' INT\nwhile :; do sleep 0.1; done\n")
    proc = _run_lease_script(["test"], dict(OUT=str(out), PYTHON=deaf, TEST_TIMEOUT="1", TEST_GRACE="2"))
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("test: rc=137,") and int(last.split(", ")[1].removesuffix(" s")) < 5, proc.stdout


def test_the_lease_scripts_archive_leaves_out_checkpoints(tmp_path):
    """PACK=1: the training's checkpoints (*.pt, and a partial write of one) stay out of gpu-run.tgz (their gzip
    outlasted a call's limit), and are gone from the output folder with the rest; its logs go in."""
    import tarfile

    write = ('mkdir -p "$OUT/train/r50"; echo log > "$OUT/train/r50/log.csv"; echo w > "$OUT/train/r50/checkpoint.pt"'
             '; echo w > "$OUT/train/r50/.checkpoint.pt.x1y2.tmp"')
    proc = _run_lease_script(["train"], dict(OUT=str(tmp_path), PACK="1"), [("do_train", write)])
    assert proc.stdout.strip().splitlines()[-1].startswith("train: rc=0"), proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["gpu-run.tgz", "summary.txt"]
    with tarfile.open(tmp_path / "gpu-run.tgz") as archive:
        names = archive.getnames()
    assert "./train/r50/log.csv" in names and not [n for n in names if ".pt" in n], names


def test_the_lease_scripts_fused_stage_leaves_torch_compile_to_fused_args(tmp_path):
    """The fused stage names the fused providers and eager materialised logits, not the torch.compile provider (its
    compilation took the stage's whole time), and ours at chunks of 256 and 2048 rows too (FUSED_CHUNKS="": none);
    FUSED_ARGS comes last, so its --providers replaces the list."""
    stand_in = _stand_in_python(tmp_path / "python", 'if [ "$1" = -c ]; then echo h100; exit 0; fi\n'
                                                     'echo "$@" >> "$OUT/calls.txt"\n')
    out = tmp_path / "out"
    for fused_args in ("", "--providers calibkernels_fused_linear chunked_reference_compiled"):
        (out / "calls.txt").unlink(missing_ok=True)
        proc = _run_lease_script(["fused"], dict(OUT=str(out), PYTHON=stand_in, FUSED_ARGS=fused_args))
        assert proc.stdout.strip().splitlines()[-1].startswith("fused: rc=0"), proc.stdout + proc.stderr
        call = (out / "calls.txt").read_text().split()
        assert call[:4] == ["-m", "bench.bench_fused_linear", "--device", "cuda"], call
        at = call.index("--chunk-sizes")  # ours at other chunks beside the default
        assert call[at + 1:at + 4] == ["256", "2048", "--providers"], call
        last = len(call) - call[::-1].index("--providers")
        providers = call[last:]
        if fused_args:
            assert providers == ["calibkernels_fused_linear", "chunked_reference_compiled"], call
        else:
            assert providers == ["calibkernels_fused_linear", "liger_fused_linear_cross_entropy", "cut_cross_entropy",
                                 "materialized_calibkernels", "materialized_torch"], call
    proc = _run_lease_script(["fused"], dict(OUT=str(out), PYTHON=stand_in, FUSED_CHUNKS=""))
    assert "--chunk-sizes" not in (out / "calls.txt").read_text().splitlines()[-1], proc.stdout + proc.stderr


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


# ---------------------------------------------------------------------------------------------------------------------
# What a row says it measured (bench audit)
# ---------------------------------------------------------------------------------------------------------------------
def test_tune_triton_times_only_the_row_splits_the_cuda_op_launches_as_clusters():
    """The rowsplit stage labels a time with a cluster tile only where the CUDA op would launch that tile: its limits
    are those of csrc/cuda/row_kernels.cuh (read here), a tile needing more than 16 CTAs per row is skipped with the
    reason, and "auto" is timed only where no row split applies (past 4096 classes it streams, as "off" does)."""
    import re

    from bench import tune_triton as T

    source = (ROOT / "csrc" / "cuda" / "row_kernels.cuh").read_text()
    assert int(re.search(r"kMaxClusterCtas = (\d+);", source).group(1)) == T.MAX_CLUSTER_CTAS
    assert re.search(r"kBlock256MaxC = (\d+) \* (\d+);", source).groups() == ("256", "16")
    assert T.RESIDENT_MAX_CLASSES == 256 * 16
    tiles = re.findall(r'\{(\d+), (\d+), "(\d+x\d+)"\}', source)
    assert [name for _, _, name in tiles] == list(T.ROW_SPLITS[1:])
    assert all(name == f"{t}x{v}" for t, v, name in tiles)
    assert "cluster_ctas(C, kClusterShapes[i]) <= kMaxClusterCtas ? i : -1" in source  # the fallback mirrored
    assert "P.num_classes > kBlock256MaxC && launch_row_clusters" in source

    assert T.cluster_ctas(128256, "256x16") == 32 and T.cluster_ctas(65536, "256x16") == 16
    assert T.cluster_skip_reason(65536, "256x16") is None  # exactly 16 CTAs: a cluster
    assert "17 CTAs" in T.cluster_skip_reason(65537, "256x16")
    assert "register-resident" in T.cluster_skip_reason(4096, "512x32")
    assert T.cluster_skip_reason(4097, "512x32", "bf16", (9, 0)) is None
    assert "8.0 < 9.0" in T.cluster_skip_reason(32000, "256x16", "fp32", (8, 0))
    assert "always streams" in T.cluster_skip_reason(32000, "256x16", "fp64")
    assert T.row_splits_to_time(1000, "bf16", (9, 0)) == T.row_splits_to_time(4096, "bf16", (9, 0)) == [("auto", None)]
    timed = {c: [split for split, reason in T.row_splits_to_time(c, "bf16", (9, 0)) if reason is None]
             for c in (10000, 32000, 128256, 262144)}
    assert timed == {10000: list(T.ROW_SPLITS), 32000: list(T.ROW_SPLITS),
                     128256: ["off", "256x32", "512x16", "512x32"], 262144: ["off", "512x32"]}
    skipped = dict(T.row_splits_to_time(262144, "bf16", (9, 0)))
    assert "64 CTAs" in skipped["256x16"] and "32 CTAs" in skipped["256x32"] and "32 CTAs" in skipped["512x16"]
    assert all(reason for split, reason in T.row_splits_to_time(32000, "fp32", (8, 0)) if split != "off")


def test_the_default_call_records_the_backend_its_call_runs(monkeypatch):
    """Provider `calibkernels` is labelled with what `ck.uncertainty_weighted_ce(..., backend="auto")` runs on the
    case: on CUDA the kernel AUTO_CUDA_MAX_CLASSES names for the row width and target kind (both GPU backends
    pretended available here), not the device's first backend."""
    from calibkernels import _backends

    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: None)
    default = harness.PROVIDERS["calibkernels"]
    expected = {(16, "hard"): "cuda", (1000, "dense"): "cuda", (32000, "hard"): "triton", (32000, "smooth"): "triton",
                (32000, "mix"): "cuda", (32000, "mix_smooth"): "cuda", (32000, "dense"): "triton"}
    for (c, kind), backend in expected.items():
        case = Case(64, c, "bf16", "brier", "grad", "cuda", kind)
        assert harness._resolved_backend(default, case) == backend, (c, kind)
        kind = harness.backend_target_kind(case)
        assert _backends.resolve_for_shape("auto", torch.device("cuda"), c, kind) == backend
    assert [harness.backend_target_kind(Case(8, 4, target=kind)) for kind in KINDS] == [
        "hard", "smooth", "mix", "mix", "dense"]
    assert harness._resolved_backend(harness.PROVIDERS["calibkernels_cpu"], Case(8, 4)) is None
    # and a step row of the provider carries it
    (result,) = harness.bench_case(Case(8, 5, "fp32", "brier", "grad", "cpu"), [default], warmup=0, reps=1,
                                   memory=False)
    assert result.config["backend"] == _backends.resolve_for_shape("auto", torch.device("cpu"), 5, "hard")


def _inplace_stand_in(seen):
    """A provider whose forward writes the gradient into its input's storage, as Liger's cross-entropy does (autograd
    is not told: no version bump), noting each input it gets."""
    import torch.nn.functional as F

    class WritesGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            loss = F.cross_entropy(x, y)
            x.copy_((torch.softmax(x, 1) - F.one_hot(y, x.shape[1])) / x.shape[0])
            ctx.save_for_backward(x)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            (g,) = ctx.saved_tensors
            return g * grad_output, None

    def make(case):
        def step(logits, target):
            seen.append((logits.grad_fn is not None, logits.detach().clone()))
            loss = WritesGradient.apply(logits.data if logits.is_leaf else logits, target)
            if loss.requires_grad:
                loss.backward()
            return loss

        return step

    return harness.Provider("writes_gradient", "in-place stand-in", ("cpu",), make, inplace=True)


def test_host_steps_give_each_provider_its_own_logits_and_an_inplace_one_fresh_copies():
    """Host-step suites: an in-place provider (Liger) runs on a non-leaf copy per step, and what it writes into its
    logits reaches neither its own next step nor any other provider's (F.cross_entropy's logits stay the inputs)."""
    case = Case(6, 5, "fp32", "none", "grad", "cpu")
    original, _ = harness.make_inputs(case)
    seen_inplace, seen_ce = [], []

    def ce(case):
        def step(logits, target):
            seen_ce.append((logits.is_leaf, logits.detach().clone()))
            loss = torch.nn.functional.cross_entropy(logits, target)
            loss.backward()
            return loss

        return step

    providers = [_inplace_stand_in(seen_inplace), harness.Provider("ce", "ce", ("cpu",), ce)]
    results = harness.bench_host_case(case, providers, reps=2, rep_ms=0.2, warmup=2)
    assert [r.status for r in results] == ["ok", "ok"]
    assert seen_inplace and all(non_leaf for non_leaf, _ in seen_inplace)
    assert seen_ce and all(is_leaf for is_leaf, _ in seen_ce)
    for _, values in seen_inplace + seen_ce:
        assert torch.equal(values, original.detach())


def _interrupted_after_one_call(timer):
    """``timer`` that runs once, then raises ``KeyboardInterrupt`` as a wall-clock limit's SIGINT would."""
    calls = []

    def timed_once(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return timer(*args, **kwargs)

    return timed_once


def test_an_interrupted_bench_run_writes_the_cases_measured_so_far(tmp_path, monkeypatch):
    """SIGINT (a wall-clock limit's) after the first case: the result files and the history rows hold that case,
    with meta.complete false, and the interrupt still ends the run; a run that ends has meta.complete true."""
    cases = (Case(8, 5, "fp32", "brier", "grad", "cpu"), Case(8, 6, "fp32", "brier", "grad", "cpu"))
    suites = {"cpu": [Suite("tiny", cases, ("reference",))]}
    real = harness.time_steps
    monkeypatch.setattr(harness, "time_steps", _interrupted_after_one_call(real))
    out, history = tmp_path / "run", tmp_path / "history.jsonl"
    argv = ["--device", "cpu", "--out", str(out), "--history", str(history), "--warmup", "0", "--reps", "1",
            "--no-memory"]
    with pytest.raises(KeyboardInterrupt):
        harness.main(suites, suites, argv=argv)
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["complete"] is False
    assert [(r["case_id"], r["status"]) for r in data["results"]] == [(cases[0].id, "ok")]
    assert "stopped part way" in out.with_suffix(".md").read_text()
    (row,) = [json.loads(line) for line in history.read_text().splitlines()]
    assert row["case_id"] == cases[0].id and row["extra"]["run_complete"] is False

    monkeypatch.setattr(harness, "time_steps", real)
    harness.main(suites, suites, argv=argv[:4] + argv[6:])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["complete"] is True and len(data["results"]) == 2


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


def test_cuda_timing_spins_the_gpu_over_the_hosts_issue_time_and_never_on_the_cpu(monkeypatch):
    """The spin before a CUDA step's start event covers the host's issue time with a margin (bounded); CPU timing
    never calls it."""
    assert harness.gpu_sleep_cycles(None, 1e6) == 0 and harness.gpu_sleep_cycles(1e-3, None) == 0
    cycles = harness.gpu_sleep_cycles(200e-6, 1.5e6)  # 0.2 ms to issue, 1.5 GHz
    assert cycles == int((harness.GPU_SLEEP_MARGIN * 0.2 + harness.GPU_SLEEP_EXTRA_MS) * 1.5e6)
    assert cycles > 0.2 * 1.5e6
    assert harness.gpu_sleep_cycles(10.0, 1.5e6) == int(harness.GPU_SLEEP_MAX_MS * 1.5e6)

    def no_gpu(*args):
        raise AssertionError("a CPU measurement touched the GPU spin")

    monkeypatch.setattr(torch.cuda, "_sleep", no_gpu)
    monkeypatch.setattr(harness, "_gpu_sleep_cycles_per_ms", no_gpu)
    leaf, target = harness.make_inputs(Case(8, 5))
    timing = harness.time_step(harness.build_step(harness.PROVIDERS["reference"], Case(8, 5)), leaf, target,
                               warmup=1, reps=2)
    assert timing.reps == 2 and timing.issue_ms is None


def test_profile_step_names_each_skip_and_fails_when_nothing_can_run(capsys):
    from bench import profile_step

    with pytest.raises(SystemExit) as stop:
        profile_step.main(["--device", "cpu", "--cases", "8x4-fp32-brier", "--providers", "torch_cross_entropy",
                           "liger_cross_entropy"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "skip: cpu-8x4-fp32-brier-grad torch_cross_entropy: torch_cross_entropy does not apply to " \
                     "cpu-8x4-fp32-brier-grad"
    assert err[1].startswith("skip: cpu-8x4-fp32-brier-grad liger_cross_entropy: ")
    assert len([line for line in err if line.startswith("error:")]) == 1 and err[-1].startswith("error: ")


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


def test_versions_come_from_the_installed_distributions_and_bench_changes_make_a_run_dirty(tmp_path, monkeypatch):
    from importlib import metadata

    assert harness.package_version("torch") == metadata.version("torch")
    assert harness.package_version("surely_not_an_installed_module_xyz") is None
    # git_dirty: a change under bench/ counts, one under bench/results/ (results, not code) does not
    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "bench" / "harness.py").write_text("x = 1\n")
    (repo / "bench" / "results" / "history.jsonl").write_text("{}\n")

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                       capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "init")
    monkeypatch.setattr(harness, "REPO_ROOT", repo)
    monkeypatch.setattr(harness, "_cpu_model", lambda: "stand-in CPU")  # lscpu is slow and beside the point
    assert harness.machine_info("cpu")["git_dirty"] is False
    (repo / "bench" / "results" / "history.jsonl").write_text("{}\n{}\n")
    assert harness.machine_info("cpu")["git_dirty"] is False
    (repo / "bench" / "harness.py").write_text("x = 2\n")
    meta = harness.machine_info("cpu")
    assert meta["git_dirty"] is True and meta["git_dirty_paths"] == ["bench/harness.py"]
    assert "bench" in meta["git_dirty_scope"]


def test_an_interrupted_metrics_bench_writes_what_it_measured(tmp_path, monkeypatch):
    """bench_metrics stopped by SIGINT after its first measurement: the result file holds that measurement with
    meta.complete false, and the interrupt still ends the run."""
    from bench import bench_metrics as M

    monkeypatch.setattr(harness, "time_fn", _interrupted_after_one_call(harness.time_fn))
    monkeypatch.setattr(M, "QUICK_SHAPES", {"cpu": [(64, 5)]})
    out = tmp_path / "metrics"
    with pytest.raises(KeyboardInterrupt):
        M.main(["--device", "cpu", "--quick", "--out", str(out), "--history", str(tmp_path / "history.jsonl")])
    data = json.loads(out.with_suffix(".json").read_text())
    assert data["meta"]["complete"] is False
    assert [(r["metric"], r["provider"]) for r in data["results"]] == [("ece", "calibkernels")]
