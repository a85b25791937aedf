"""The loss bench's suites (bench/bench_uncertainty_weighted_ce.py): the headline cases, the host-step suites and the
soft-target suites of each run."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench.cases import TARGET_KINDS  # noqa: E402

KINDS = TARGET_KINDS


def test_quick_and_full_cpu_runs_hold_the_headline_and_the_host_step_suite():
    from bench import bench_uncertainty_weighted_ce as B

    for suites in (B.SUITES["cpu"], B.QUICK_SUITES["cpu"]):
        assert any(B.HEADLINE_CPU in s.cases and "reference_compiled" in s.providers for s in suites)
        (host,) = [s for s in suites if s.name == "cpu-host-step"]
        assert host.measure == "host_step" and host.baseline == "torch_cross_entropy"
        assert {(c.n, c.c, c.dtype, c.weight, c.mode) for c in host.cases} == {(4, 10, "fp32", "brier", "grad"),
                                                                              (256, 1000, "fp32", "brier", "grad")}
        assert set(host.providers) == {"calibkernels", "torch_cross_entropy"} and set(host.threads) == {1, None}


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
