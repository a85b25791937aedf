"""FLSD-53's γ band in the reference: the float32 rule that every implementation follows.

The band is a step function of p_y, so all backends must compute the same p_y at the thresholds. The rule
(``calibkernels.reference._flsd_gamma``, ``csrc/uncertainty_weights.h``): ``p_band = float32(exp(z_y - lse))``, with
``z_y - lse`` and the exponential in the compute dtype (float32 for float32/float16/bfloat16 logits, float64 for
float64), then ``γ_i = 5 if p_band < 0.2f, 3 if p_band < 0.5f, else γ``.
"""

import math

import numpy as np
import pytest
import torch

from calibkernels import _row_math as row_math
from calibkernels import reference as R

from _flsd_band import LOW_THRESHOLD_F32 as LOW32
from _flsd_band import MID_THRESHOLD_F32 as MID32
from _flsd_band import band_choices, flsd_gamma, flsd_gammas, pick_gamma

GAMMA = 1.5  # the argument γ, used at and above the mid threshold: distinct from 3 and 5
BANDS = band_choices(GAMMA)


def _flsd_weight(logits, target, gamma=GAMMA):
    return R.uncertainty_weight(logits.to(R._compute_dtype(logits.dtype)), target, uncertainty="flsd", gamma=gamma,
                                norm=2.0)


def _weight_with(z, y, gamma):
    """(1 - p_y)^γ in float64 from the logits' exact values (1 - p_y summed over the other classes, no cancellation)."""
    p = torch.softmax(z.double(), dim=1)
    return p.scatter(1, y[:, None], 0.0).sum(dim=1) ** gamma


def _gamma_picked(z, y):
    """Which of the three γ explains the reference's weight (the three differ by far more than rounding)."""
    candidates = torch.stack([_weight_with(z, y, g) for g in BANDS])
    tol = 1e-2 if z.dtype in (torch.float16, torch.bfloat16) else 1e-5  # atol: torch.isclose's default
    return pick_gamma(_flsd_weight(z, y), candidates, BANDS, rtol=tol, atol=1e-8, what="reference weight")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_rows_whose_exact_p_y_is_a_threshold(dtype):
    """Equal logits: p_y = 1/5 and 1/2 exactly; lse = log C rounded once, so the band value is exp(-log C) rounded.
    float32: exp(-logf(5)) = 0.19999999f < 0.2f (γ = 5), exp(-logf(2)) = 0.5f (γ); float64: exp(-log 5) rounds to
    0.2f (γ = 3), exp(-log 2) = 0.5 (γ)."""
    if dtype == torch.float64:
        bands = [np.float32(math.exp(-math.log(c))) for c in (5, 2)]
        assert bands == [LOW32, MID32]
    else:
        bands = [np.float32(math.exp(-float(np.float32(math.log(c))))) for c in (5, 2)]
        assert bands[0] < LOW32 and bands[1] == MID32
    for c, band in zip((5, 2), bands):
        z = torch.zeros(3, c, dtype=dtype)
        assert _gamma_picked(z, torch.tensor([0, 1, c - 1])) == [flsd_gamma(band, GAMMA)] * 3, (dtype, c)


def test_float64_logits_take_the_band_of_the_float32_rounding_of_p_y():
    # p_y = 1 / (4 + e^{1e-12}) is 1e-14 below 0.2 in float64, but rounds to 0.2f: the band is 3, not 5
    z = torch.tensor([[0.0, 0.0, 0.0, 0.0, 1e-12]], dtype=torch.float64)
    y = torch.tensor([0])
    assert 1.0 / (4.0 + math.exp(1e-12)) < 0.2 and np.float32(1.0 / (4.0 + math.exp(1e-12))) == LOW32
    assert _gamma_picked(z, y) == [3.0]
    u = _flsd_weight(z, y)
    assert u.dtype == torch.float64
    torch.testing.assert_close(u, _weight_with(z, y, 3.0), rtol=1e-14, atol=0)


@pytest.mark.parametrize("threshold", [0.2, 0.5])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rows_a_few_ulps_either_side_of_a_threshold(threshold, dtype):
    """Two-class rows [0, s] (target 0) with p_y = 1 / (1 + e^s) 4 to 64 float32 ulps of p_y from the threshold (a
    margin the rounding of lse and exp cannot cross) take the rule's band for their exact p_y."""
    t32 = np.float32(threshold)
    ulp = float(np.spacing(t32))
    ps = [float(t32) + k * ulp for k in (-64, -16, -4, 4, 16, 64)]
    z = torch.zeros(len(ps), 2, dtype=dtype)
    z[:, 1] = torch.tensor([math.log((1 - p) / p) for p in ps], dtype=torch.float64).to(dtype)
    exact = torch.softmax(z.double(), dim=1)[:, 0].tolist()
    rule = [flsd_gamma(p, GAMMA) for p in exact]
    assert _gamma_picked(z, torch.zeros(len(ps), dtype=torch.long)) == rule
    assert rule == [flsd_gamma(float(t32) - ulp, GAMMA)] * 3 + [flsd_gamma(float(t32), GAMMA)] * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_random_rows_reach_every_band_and_take_the_band_of_their_p_y(dtype):
    n, c = 400, 6
    z = (torch.randn(n, c, dtype=torch.float64) * torch.rand(n, 1, dtype=torch.float64) * 4).to(dtype)
    y = torch.randint(0, c, (n,))
    p_y = torch.softmax(z.double(), dim=1).gather(1, y[:, None])[:, 0]
    clear = ((p_y - 0.2).abs() > 1e-5) & ((p_y - 0.5).abs() > 1e-5)  # away from the thresholds' rounding
    expected = flsd_gammas(p_y[clear], GAMMA).tolist()
    assert {5.0, 3.0, GAMMA} <= set(expected), "the random rows should reach every band"
    band = R._flsd_gamma(z.to(R._compute_dtype(z.dtype)), y, GAMMA)
    assert band[clear].tolist() == expected
    # and the weight is (1 - p_y) to that band
    single = dtype == torch.float32
    torch.testing.assert_close(_flsd_weight(z, y).double(), _weight_with(z, y, band.double()),
                               rtol=1e-5 if single else 1e-12, atol=1e-7 if single else 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_production_row_maths_take_the_references_band_and_powers(dtype):
    """calibkernels._row_math (the fused linear, vocab-parallel and more-losses paths) writes FLSD's band and the
    powers of a logarithm apart from the reference: the same values, and the same gradients of the powers."""
    n, c = 400, 6
    z = (torch.randn(n, c, dtype=torch.float64) * torch.rand(n, 1, dtype=torch.float64) * 4).to(dtype)
    y = torch.randint(0, c, (n,))
    compute = R._compute_dtype(z.dtype)
    assert row_math.compute_dtype(z.dtype) == compute
    assert torch.equal(row_math.flsd_gamma(z.to(compute), y, GAMMA), R._flsd_gamma(z.to(compute), y, GAMMA))
    log_x = torch.cat([torch.log(torch.rand(50, dtype=compute)), torch.tensor([-math.inf, 0.0, -800.0], dtype=compute)])
    for exponent in (0.0, 0.5, 2.0, torch.rand(log_x.shape[0], dtype=compute) * 3):
        ours = log_x.clone().requires_grad_()
        theirs = log_x.clone().requires_grad_()
        got, want = row_math.power_of_log(ours, exponent), R._power_of_log(theirs, exponent)
        assert torch.equal(got, want)
        got.sum().backward()
        want.sum().backward()
        assert torch.equal(ours.grad, theirs.grad)
