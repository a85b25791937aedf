"""The loss family's constants, declared once for Python, Triton and C++.

The integer codes are what the kernels receive; ``csrc/uncertainty_weighted_ce.h`` declares the same enums and FLSD
constants for the C++ and CUDA kernels, and ``tests/test_kernel_codes.py`` checks the header against this file.
Formulas and
sources: ``docs/losses.md``.
"""

from __future__ import annotations

WEIGHT_CODES = {"none": 0, "focal": 1, "flsd": 2, "dual_focal": 3, "brier": 4, "external": 5, "brier_flsd": 6}
MODE_CODES = {"loss": 0, "grad": 1}
# Same numbering as torch's internal Reduction enum (at::Reduction).
REDUCTION_CODES = {"none": 0, "mean": 1, "sum": 2}
BACKENDS = ("auto", "reference", "cpu", "triton", "cuda")
# The first slot of the GPU kernels' target flag for class-index targets, (code, value): what was found bad, in the
# order the host checks raise (a target before a mix_target before a mix_lambda); the value is the largest bad
# target, the first bad row's mix_target, or the first bad row of mix_lambda. (A dense target's flag is
# (any bad row, the first bad row).)
TARGET_FLAG_CODES = {"none": 0, "target": 1, "mix_target": 2, "mix_lambda": 3}

# FLSD-53 (Mukhoti et al. 2020): gamma_i = 5 if p_y < 0.2, 3 if p_y < 0.5, else the loss's gamma. Every implementation
# compares the float32 value of p_y with the float32 thresholds, so all of them pick the same band.
FLSD_LOW_THRESHOLD = 0.2
FLSD_LOW_GAMMA = 5.0
FLSD_MID_THRESHOLD = 0.5
FLSD_MID_GAMMA = 3.0

# The GPU kernels check a dense target's rows in their own float32 reads up to this many columns (2^18, the CPU
# kernel's limit too); wider rows are checked by device reductions with pairwise sums instead. A thread's running sum
# of its tiles drifts one way on a near one-hot row: at 2^22 columns a model of the CUDA order put it 2.6e-5 off,
# a quarter of float32's tolerance of 1e-4, where the check would disagree with the reference's on rows that close.
DENSE_KERNEL_CHECK_MAX_CLASSES = 262144

# Defaults of ck.uncertainty_weighted_ce: BSCE-GRA as run in the BSCE-GRA paper.
DEFAULT_WEIGHT = "brier"
DEFAULT_MODE = "grad"
DEFAULT_GAMMA = 4.0
DEFAULT_NORM = 2.0
DEFAULT_REDUCTION = "mean"
DEFAULT_IGNORE_INDEX = -100
