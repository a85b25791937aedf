"""Benchmark of the fused uncertainty-weighted cross-entropy (issues 3, 4, 5): forward + backward, side by side.

Two ways to run (see bench/README.md):

    python -m bench.bench_uncertainty_weighted_ce [--device cpu|cuda] [--quick] [--suite NAME]
    pytest bench/ --benchmark-only            # pytest-benchmark, one group per case (never with -n / xdist)

This file only declares what is measured; how it is measured is in the harness (bench/harness.py lists its
modules).
"""

from __future__ import annotations

import pytest

# run from the repository root (python -m bench...., pytest bench/)
from bench.cases import TARGET_KINDS, Case, Suite
from bench.cli import main, run_pytest_benchmark
from bench.providers import PROVIDERS

# ---------------------------------------------------------------------------------------------------------------
# CPU (issue 3)
# ---------------------------------------------------------------------------------------------------------------
CPU_SHAPES = [(4096, 1000), (1024, 32000), (256, 128256)]  # ImageNet classes; LLaMA-2 / LLaMA-3 vocabularies
CPU_DTYPES = ["fp32", "bf16"]
HEADLINE_CPU = Case(4096, 1000, "fp32", "brier", "grad", "cpu")  # BSCE-GRA, the target case

CPU_FUSED = ["calibkernels_cpu", "calibkernels_cpu_inplace", "reference", "reference_compiled"]
CPU_CE = ["calibkernels_cpu", "calibkernels_cpu_inplace", "torch_cross_entropy", "reference", "reference_compiled"]


def _cpu_cases(weight: str, mode: str = "grad") -> tuple[Case, ...]:
    return tuple(Case(n, c, dtype, weight, mode, "cpu") for n, c in CPU_SHAPES for dtype in CPU_DTYPES)


def _soft_target_cases(shapes, dtype: str, device: str, weights=("brier", "none")) -> tuple[Case, ...]:
    """Every target kind (hard, smooth, mix, mix_smooth, dense) of each shape and weight (mode "grad"): a case's kinds
    are timed together, interleaved (bench.measure.bench_cases)."""
    return tuple(Case(n, c, dtype, weight, "grad", device, target)
                 for n, c in shapes for weight in weights for target in TARGET_KINDS)


# Soft targets: the compact forms (label smoothing, a per-row mix, both) and the dense (N, C) form against class
# indices, same shape, dtype and loss; F.cross_entropy on weight "none" (with label_smoothing=, the per-row mix of two
# CEs, or probabilities). --quick: BSCE-GRA only.
CPU_SOFT = ["calibkernels_cpu", "calibkernels_cpu_inplace", "reference_compiled", "torch_cross_entropy"]
CPU_SOFT_TARGETS = Suite("cpu-soft-targets", _soft_target_cases([(4096, 1000)], "fp32", "cpu"), tuple(CPU_SOFT))
CPU_SOFT_TARGETS_QUICK = Suite("cpu-soft-targets-quick",
                               _soft_target_cases([(4096, 1000)], "fp32", "cpu", weights=("brier",)),
                               tuple(CPU_SOFT[:3]))


# Host cost (issue #20): the eager training step as a user writes it, ck.uncertainty_weighted_ce(logits, target)
# (BSCE-GRA, default backend), against F.cross_entropy's step, at a shape where the kernels' work is negligible and at
# a small real one; one torch thread and the default count. One reused leaf, leaf.grad = None between steps.
CPU_HOST_STEP = Suite(
    "cpu-host-step",
    (Case(4, 10, "fp32", "brier", "grad", "cpu"), Case(256, 1000, "fp32", "brier", "grad", "cpu")),
    ("calibkernels", "torch_cross_entropy"),
    measure="host_step", threads=(1, None), baseline="torch_cross_entropy", reps=100,
)

CPU_SUITES = [
    Suite("cpu-bsce-gra", _cpu_cases("brier"), tuple(CPU_FUSED)),
    # weight "none" is plain cross-entropy: the kernel against F.cross_entropy
    Suite("cpu-ce", _cpu_cases("none"), tuple(CPU_CE)),
    CPU_SOFT_TARGETS,
    CPU_HOST_STEP,
]
CPU_QUICK_SUITES = [
    Suite("cpu-bsce-gra-quick", (HEADLINE_CPU,), tuple(CPU_FUSED)),
    Suite("cpu-ce-quick", (Case(4096, 1000, "fp32", "none", "grad", "cpu"),), tuple(CPU_CE)),
    CPU_SOFT_TARGETS_QUICK,
    CPU_HOST_STEP,
]

# ---------------------------------------------------------------------------------------------------------------
# GPU (issues 4, 5): N = 8192, C in {1000, 32000, 128256}, bf16 and fp32; plus the large-batch ImageNet case
# ---------------------------------------------------------------------------------------------------------------
GPU_N = 8192
GPU_CLASSES = [1000, 32000, 128256]
GPU_DTYPES = ["bf16", "fp32"]
HEADLINE_CUDA = Case(GPU_N, 32000, "bf16", "brier", "grad", "cuda")

CUDA_FUSED = ["calibkernels_triton", "calibkernels_triton_inplace", "calibkernels_cuda", "calibkernels_cuda_inplace",
              "reference", "reference_compiled"]
CUDA_CE = CUDA_FUSED + ["torch_cross_entropy", "liger_cross_entropy"]
CUDA_KERNELS_ONLY = ["calibkernels_triton", "calibkernels_triton_inplace", "calibkernels_cuda",
                     "calibkernels_cuda_inplace"]
# soft targets on the GPU: the fused kernels, F.cross_entropy and Liger (hard and "smooth" only) on weight "none"
CUDA_SOFT = CUDA_KERNELS_ONLY + ["torch_cross_entropy", "liger_cross_entropy"]


def _cuda_cases(weight: str, mode: str = "grad") -> tuple[Case, ...]:
    return tuple(Case(GPU_N, c, dtype, weight, mode, "cuda") for c in GPU_CLASSES for dtype in GPU_DTYPES)


# Host cost on the GPU (issue #22): the eager training step (forward + backward of the mean, one reused leaf) of
# the default call and of each fused backend against F.cross_entropy's, back to back with a synchronisation per
# repetition, so a step's time is the larger of its host time and its GPU time: 64 x 16 (host time alone), the
# ImageNet widths at batch 256 and 8192 (host-bound), 65536 (whose bytes take about 0.06 ms to move).
CUDA_HOST_STEP = Suite(
    "cuda-host-step",
    (Case(64, 16, "fp32", "brier", "grad", "cuda"), Case(256, 1000, "bf16", "brier", "grad", "cuda"),
     Case(GPU_N, 1000, "bf16", "brier", "grad", "cuda"), Case(65536, 1000, "bf16", "brier", "grad", "cuda")),
    ("calibkernels", "calibkernels_triton", "calibkernels_cuda", "torch_cross_entropy", "liger_cross_entropy"),
    measure="host_step", threads=(None,), baseline="torch_cross_entropy", reps=40,
)

CUDA_SUITES = [
    Suite("cuda-bsce-gra", _cuda_cases("brier"), tuple(CUDA_FUSED)),
    Suite("cuda-ce", _cuda_cases("none"), tuple(CUDA_CE)),
    # large-batch ImageNet: CUDA vs Triton (issue 5)
    Suite("cuda-imagenet-large-batch",
          (Case(65536, 1000, "bf16", "brier", "grad", "cuda"), Case(65536, 1000, "bf16", "none", "grad", "cuda")),
          tuple(CUDA_KERNELS_ONLY)),
    Suite("cuda-soft-targets", _soft_target_cases([(GPU_N, 1000), (GPU_N, 32000)], "bf16", "cuda"), tuple(CUDA_SOFT)),
    CUDA_HOST_STEP,
]
CUDA_QUICK_SUITES = [
    Suite("cuda-bsce-gra-quick", (HEADLINE_CUDA,), tuple(CUDA_FUSED)),
    Suite("cuda-ce-quick", (Case(GPU_N, 32000, "bf16", "none", "grad", "cuda"),), tuple(CUDA_CE)),
    CUDA_HOST_STEP,
]

SUITES = {"cpu": CPU_SUITES, "cuda": CUDA_SUITES}
QUICK_SUITES = {"cpu": CPU_QUICK_SUITES, "cuda": CUDA_QUICK_SUITES}


# ---------------------------------------------------------------------------------------------------------------
# pytest-benchmark: `pytest bench/ --benchmark-only` (add `-k cpu`, `-k 4096x1000`, ... to select)
# ---------------------------------------------------------------------------------------------------------------
def _pairs():
    for suites in SUITES.values():
        for suite in suites:
            if suite.measure != "step":  # host steps: the script only (pytest-benchmark times one step at a time)
                continue
            for case in suite.cases:
                for name in suite.providers:
                    if PROVIDERS[name].applies_to(case):
                        yield pytest.param(case, name, id=f"{case.id}-{name}")


@pytest.mark.parametrize(("case", "provider"), list(_pairs()))
def test_uncertainty_weighted_ce(benchmark, case, provider):
    run_pytest_benchmark(benchmark, provider, case)


if __name__ == "__main__":
    main(SUITES, QUICK_SUITES, prog="python -m bench.bench_uncertainty_weighted_ce")
