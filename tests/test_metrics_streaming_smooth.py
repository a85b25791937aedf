"""Streaming meters of calibkernels.metrics.meters: SmoothECEMeter and DebiasedECEMeter give the batch functions'
results on the concatenated data, batch by batch, with ignored rows, and merged across two gloo ranks."""

from __future__ import annotations

import pytest
import torch

from calibkernels import metrics
from calibkernels.metrics.smooth_ece import automatic_grid_sizes, grid_points


def _overconfident(n, c, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, c, generator=g) * 3, torch.randint(0, c, (n,), generator=g)


def _calibrated_binary(n, seed):
    """Two-class probabilities whose confidence is exactly calibrated in distribution: small smooth ECE, small σ*."""
    g = torch.Generator().manual_seed(seed)
    confidence = 0.5 + 0.5 * torch.rand(n, generator=g, dtype=torch.float64)
    correct = torch.rand(n, generator=g, dtype=torch.float64) < confidence
    probs = torch.stack([confidence, 1 - confidence], dim=1)
    return probs, torch.where(correct, 0, 1)


def _feed(meter, inputs, labels, chunk):
    for x, y in zip(inputs.split(chunk), labels.split(chunk)):
        meter.update(x, y)
    meter.update(inputs[:0], labels[:0])  # an empty batch changes nothing
    return meter


def test_grid_sizes_cover_every_bisection_step():
    sizes = automatic_grid_sizes()
    assert sizes[0] == grid_points(1.0) == 1001 and len(sizes) == 10
    assert grid_points(2 / 1024) == max(sizes)


@pytest.mark.parametrize("case", ["overconfident", "calibrated"])
def test_smooth_ece_meter_equals_the_batch_function(case):
    if case == "overconfident":
        inputs, labels = _overconfident(700, 6, seed=1)
        labels[::17] = -100
    else:
        inputs, labels = _calibrated_binary(20000, seed=2)
    meter = _feed(metrics.SmoothECEMeter(), inputs, labels, 333)
    value, sigma = meter.compute(return_bandwidth=True)
    expected, expected_sigma = metrics.smooth_ece(inputs, labels, return_bandwidth=True)
    assert sigma == expected_sigma
    assert value == pytest.approx(expected, rel=1e-12, abs=1e-15)
    if case == "calibrated":
        assert sigma < 0.01  # the bisection used the larger grids
    assert meter.num_samples == int((labels != -100).sum())


def test_smooth_ece_meter_fixed_bandwidth_and_curve():
    inputs, labels = _overconfident(500, 4, seed=3)
    meter = _feed(metrics.SmoothECEMeter(bandwidth=0.05), inputs, labels, 128)
    assert meter.sizes == [grid_points(0.05)]
    assert meter.compute() == pytest.approx(metrics.smooth_ece(inputs, labels, bandwidth=0.05), rel=1e-12)
    automatic = _feed(metrics.SmoothECEMeter(), inputs, labels, 99)
    got, expected = automatic.curve(), metrics.smooth_reliability_curve(inputs, labels)
    assert got["bandwidth"] == expected["bandwidth"]
    assert got["smooth_ece"] == pytest.approx(expected["smooth_ece"], rel=1e-12)
    for key in ("confidence", "accuracy", "density"):
        torch.testing.assert_close(got[key], expected[key], rtol=1e-10, atol=1e-12)


def test_meters_reset_and_refuse_to_compute_nothing():
    inputs, labels = _overconfident(50, 3, seed=4)
    for meter in (metrics.SmoothECEMeter(), metrics.DebiasedECEMeter()):
        with pytest.raises(ValueError, match="no samples"):
            meter.compute()
        meter.update(inputs, labels)
        meter.reset()
        assert meter.num_samples == 0
        with pytest.raises(ValueError, match="no samples"):
            meter.compute()
    meter = metrics.DebiasedECEMeter()
    meter.update(inputs, labels)
    with pytest.raises(ValueError, match="classes"):
        meter.update(torch.randn(3, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError):
        metrics.DebiasedECEMeter(mode="classwise")


@pytest.mark.parametrize("mode", ["top-label", "marginal"])
@pytest.mark.parametrize("n_bins", [15, 4])
def test_debiased_meter_equals_the_batch_function(mode, n_bins):
    inputs, labels = _overconfident(600, 5, seed=5)
    labels[::13] = -100
    meter = _feed(metrics.DebiasedECEMeter(n_bins, mode), inputs, labels, 97)
    expected = metrics.debiased_ece(inputs, labels, n_bins, mode)
    assert meter.compute() == pytest.approx(expected, rel=1e-12, abs=1e-15)
    probs = torch.softmax(inputs.double(), dim=1)  # probabilities in, float64 kept
    meter = _feed(metrics.DebiasedECEMeter(n_bins, mode), probs, labels, 200)
    assert meter.compute() == pytest.approx(metrics.debiased_ece(probs, labels, n_bins, mode), rel=1e-12, abs=1e-15)


# Merging across DDP ranks is checked in tests/test_metrics.py::test_meter_merges_across_two_gloo_ranks, whose two
# gloo processes feed these meters too (one process start-up for every meter).
