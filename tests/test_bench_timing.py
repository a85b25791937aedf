"""The loss bench's timing loops and peak-memory measurement (bench/timing.py): what a step gets between
repetitions, the GPU spin before a CUDA step, and the memory method. No timing is ever asserted."""

import os
import subprocess
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench.cases import Case, make_inputs  # noqa: E402
from bench.providers import PROVIDERS, build_step  # noqa: E402
from bench.timing import (  # noqa: E402
    GPU_SLEEP_EXTRA_MS,
    GPU_SLEEP_MARGIN,
    GPU_SLEEP_MAX_MS,
    gpu_sleep_cycles,
    peak_extra_memory,
    time_host_steps,
    time_step,
)

ROOT = Path(__file__).resolve().parents[1]


def test_peak_extra_memory_counts_the_step_allocations():
    """The CPU method (profiler allocation records) sees a step that holds two N×C buffers at its peak."""
    case = Case(256, 1000, "fp32", "none", "grad", "cpu")
    leaf, target = make_inputs(case)

    def step(logits, target):
        a = torch.full_like(logits, 1.0)
        b = torch.full_like(logits, 2.0)
        del a
        c = torch.full_like(logits, 3.0)  # reuses a's block or not: either way at most two are alive
        return (b + c).sum()  # a third, short-lived N×C for the sum: peak is three buffers

    peak = peak_extra_memory(step, leaf, target)
    assert abs(peak - 3 * case.nc_bytes) < 0.05 * case.nc_bytes, (peak, case.nc_bytes)


def test_host_steps_reuse_one_leaf_and_reset_its_gradient():
    leaf = torch.randn(4, 10, requires_grad=True)
    target = torch.tensor([0, 3, 9, 1])
    seen = []

    def step(logits, tgt):
        seen.append((logits is leaf, logits.grad is None))
        loss = torch.nn.functional.cross_entropy(logits, tgt)
        loss.backward()
        return loss

    timing = time_host_steps({"ce": step}, leaf, target, reps=2, rep_ms=0.5, warmup=1)["ce"]
    assert seen and all(is_leaf and grad_reset for is_leaf, grad_reset in seen)
    assert len(seen) >= 1 + 2 * timing.steps_per_rep and leaf.grad is None


def test_cuda_timing_spins_the_gpu_over_the_hosts_issue_time_and_never_on_the_cpu(monkeypatch):
    """The spin before a CUDA step's start event covers the host's issue time with a margin (bounded); CPU timing
    never calls it."""
    assert gpu_sleep_cycles(None, 1e6) == 0 and gpu_sleep_cycles(1e-3, None) == 0
    cycles = gpu_sleep_cycles(200e-6, 1.5e6)  # 0.2 ms to issue, 1.5 GHz
    assert cycles == int((GPU_SLEEP_MARGIN * 0.2 + GPU_SLEEP_EXTRA_MS) * 1.5e6)
    assert cycles > 0.2 * 1.5e6
    assert gpu_sleep_cycles(10.0, 1.5e6) == int(GPU_SLEEP_MAX_MS * 1.5e6)

    def no_gpu(*args):
        raise AssertionError("a CPU measurement touched the GPU spin")

    monkeypatch.setattr(torch.cuda, "_sleep", no_gpu)
    monkeypatch.setattr("bench.timing._gpu_sleep_cycles_per_ms", no_gpu)
    leaf, target = make_inputs(Case(8, 5))
    timing = time_step(build_step(PROVIDERS["reference"], Case(8, 5)), leaf, target,
                               warmup=1, reps=2)
    assert timing.reps == 2 and timing.issue_ms is None


# ---------------------------------------------------------------------------------------------------------------------
# Output on a machine without a GPU (issue #19, item 15)
# ---------------------------------------------------------------------------------------------------------------------


def test_the_quick_runs_memory_measurement_prints_no_profiler_logs(tmp_path):
    """The CPU peak-memory step runs torch.profiler; its back end must not print its USDT start/stop lines or, without
    a GPU, "gpuGetDeviceCount failed". A fresh process: the profiler's logging is set up when its first run starts."""
    code = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
from bench.cases import Case, Suite
from bench.cli import main
suites = {{"cpu": [Suite("q", (Case(64, 100, "fp32", "brier", "grad", "cpu"),),
                        ("calibkernels_cpu", "calibkernels_cpu_inplace", "reference"))]}}
results = main(suites, suites, argv=["--device", "cpu", "--out", {str(tmp_path / "q")!r}, "--warmup", "0",
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
