"""The benchmark harness (bench/harness.py) runs, and every provider it times computes the right loss and gradient.

Correctness only: no timing is ever asserted. Tiny shapes keep this under a few seconds apart from the one
``torch.compile`` of the reference (inductor on CPU).
"""

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench import harness  # noqa: E402
from bench.harness import Case, Suite  # noqa: E402

CPU_PROVIDERS = [name for name, p in harness.PROVIDERS.items() if "cpu" in p.devices]
CUDA_PROVIDERS = [name for name, p in harness.PROVIDERS.items() if "cuda" in p.devices]


def _tiny_case(provider: str, device: str, dtype: str = "fp32") -> Case:
    # odd sizes (not multiples of a vector width); weight "none" where the provider is plain cross-entropy
    weight = "none" if harness.PROVIDERS[provider].weights == ("none",) else "brier"
    return Case(37, 19, dtype, weight, "grad", device)


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


@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_cpu_provider_runs_and_matches_reference(provider):
    case = _tiny_case(provider, "cpu")
    reason = harness.unavailable_reason(harness.PROVIDERS[provider], case)
    if reason is not None:
        pytest.skip(reason)
    _assert_runs_and_matches_reference(provider, case)


@pytest.mark.parametrize("provider", ["calibkernels_cpu", "calibkernels_cpu_inplace", "torch_cross_entropy"])
def test_cpu_provider_bf16_matches_reference(provider):
    case = _tiny_case(provider, "cpu", "bf16")
    reason = harness.unavailable_reason(harness.PROVIDERS[provider], case)
    if reason is not None:
        pytest.skip(reason)
    _assert_runs_and_matches_reference(provider, case, timed=False)


@pytest.mark.gpu
@pytest.mark.parametrize("provider", CUDA_PROVIDERS)
def test_cuda_provider_runs_and_matches_reference(provider):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    case = _tiny_case(provider, "cuda")
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
    data = json.loads(out.with_suffix(".json").read_text())
    assert {"date", "torch", "cpu", "torch_threads"} <= set(data["meta"])
    by_provider = {r["provider"]: r for r in data["results"]}
    assert "torch_cross_entropy" not in by_provider  # weight "brier" is not plain cross-entropy
    reference = by_provider["reference"]
    assert reference["status"] == "ok" and reference["speedup_vs_reference"] == pytest.approx(1.0)
    table = out.with_suffix(".md").read_text()
    assert "| 16 × 7 | fp32 | brier / grad | eager reference |" in table
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
