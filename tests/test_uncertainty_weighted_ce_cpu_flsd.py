"""FLSD-53's band choice at its thresholds in the compiled CPU op, for both weights on the schedule: ``flsd`` (the
focal weight) and ``brier_flsd`` (the Brier weight, BSCE-GRA's adaptive form).

The rule every implementation follows (csrc/uncertainty_weights.h, calibkernels/_kernel_codes.py): the band value of
p_y is
float32(exp(z_y - lse)), evaluated at the accumulation precision (float32 for float32/float16/bfloat16 logits, float64
for float64) and rounded to float32; γ_i = 5 if it is < 0.2f, 3 if it is < 0.5f, else γ. At z = [0, 0, 0, 0, 0] the
exact p_y is 0.2 and the kernel's own e_y / Σ e is 0.2f exactly, but float32 exp(-log 5) is 0.19999999f: the band is
the low one (γ = 5), which the kernel used to miss (it compared e_y / Σ e, γ = 3).
"""

import math

import numpy as np
import pytest
import torch

from calibkernels import _backends
from calibkernels import _kernel_codes as K

from _flsd_band import band_choices, flsd_gamma, gamma_picked

pytestmark = pytest.mark.skipif(
    _backends.unavailable_reason("cpu", torch.device("cpu")) is not None,
    reason="calibkernels._C was not built with the CPU kernel",
)

GAMMA = 1.0  # the argument γ, used above the mid threshold: distinct from 3 and 5
BANDS = band_choices(GAMMA)


def _op():
    import calibkernels.cpp.uncertainty_weighted_ce  # noqa: F401  (registers the fake kernels)

    return torch.ops.calibkernels


SCHEDULED = ["flsd", "brier_flsd"]


def _kernel_loss(z, y, uncertainty):
    loss, *_ = _op().uncertainty_weighted_ce(z, y, None, None, K.WEIGHT_CODES[uncertainty], K.MODE_CODES["grad"],
                                               GAMMA,
                                            2.0, -100, K.REDUCTION_CODES["none"], False, None)
    return loss.double()


def _gamma_picked(z, y, uncertainty):
    """Which of the three γ explains the kernel's loss (u · CE in float64 from the logits' exact values, u = (1 - p_y)^γ
    or ‖p - e_y‖_2^γ; the three give losses that differ by far more than rounding)."""
    one_hot = torch.nn.functional.one_hot(y, z.shape[1])
    return gamma_picked(_kernel_loss(z, y, uncertainty), z, one_hot, uncertainty, BANDS, atol=1e-7)


@pytest.mark.parametrize("uncertainty", SCHEDULED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.float64], ids=str)
def test_exact_thresholds_follow_the_float32_rule(dtype, uncertainty):
    """Rows whose exact p_y is the threshold itself: [0]*5 (p_y = 0.2) and [0, 0] (p_y = 0.5). Every logit is 0, so
    every implementation's lse is log(C) rounded once and the band value is exp(-log C) rounded, which the rule
    decides: float32: exp(-logf(5)) = 0.19999999f < 0.2f (γ = 5); exp(-logf(2)) = 0.5f (γ = the argument). float64:
    exp(-log 5) rounds to 0.2f (γ = 3)."""
    if dtype == torch.float64:
        bands = [float(np.float32(math.exp(-math.log(c)))) for c in (5, 2)]
    else:
        bands = [float(np.float32(math.exp(-float(np.float32(math.log(c)))))) for c in (5, 2)]
    assert bands[0] == float(np.float32(0.19999999)) if dtype != torch.float64 else bands[0] == float(np.float32(0.2))
    expected = [flsd_gamma(p, GAMMA) for p in bands]
    got = [_gamma_picked(torch.zeros(1, c, dtype=dtype), torch.tensor([0]), uncertainty)[0] for c in (5, 2)]
    assert got == expected, f"{dtype}: bands {bands}, expected γ {expected}, kernel picked {got}"


@pytest.mark.parametrize("threshold", [K.FLSD_LOW_THRESHOLD, K.FLSD_MID_THRESHOLD])
@pytest.mark.parametrize("uncertainty", SCHEDULED)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=str)
def test_rows_a_few_ulps_either_side_of_a_threshold(threshold, dtype, uncertainty):
    """Two-class rows [0, s] (target 0) with p_y = 1 / (1 + e^s) just below and just above each threshold: 4 to 64
    float32 ulps of p_y away (a margin the rounding of the logits, lse and exp cannot cross), and the nearest float32
    (float64) logits to the exact boundary on both sides, whose band is whatever the float32 rule gives for their exact
    p_y when that is more than 2 ulps from the threshold."""
    t32 = np.float32(threshold)
    ulp = float(np.spacing(t32))
    rows = []
    for k in (-64, -16, -4, 4, 16, 64):
        p = float(t32) + k * ulp
        rows.append(math.log((1 - p) / p))  # s with 1 / (1 + e^s) = p
    boundary = math.log((1 - threshold) / threshold)
    finfo = np.float32 if dtype == torch.float32 else np.float64
    rows += [float(np.nextafter(finfo(boundary), finfo(-10))), float(finfo(boundary)),
             float(np.nextafter(finfo(boundary), finfo(10)))]
    z = torch.zeros(len(rows), 2, dtype=dtype)
    z[:, 1] = torch.tensor(rows, dtype=torch.float64).to(dtype)
    y = torch.zeros(len(rows), dtype=torch.long)
    exact_p = torch.softmax(z.double(), dim=1)[:, 0].tolist()
    got = _gamma_picked(z, y, uncertainty)
    for row, p in enumerate(exact_p):
        if abs(p - float(t32)) <= 2 * ulp:
            continue  # within the implementations' last-ulp differences: either band is the rule's
        rule = flsd_gamma(p, GAMMA)
        assert got[row] == rule, f"row {row}: exact p_y {p!r}, picked γ {got[row]}, rule γ {rule}"
    # the rows well inside each side are on their side
    assert got[:3] == [flsd_gamma(float(t32) - ulp, GAMMA)] * 3 and got[3:6] == [flsd_gamma(float(t32), GAMMA)] * 3
