"""calibkernels.metrics.debiased_ece: Kumar, Liang & Ma's debiased L2 calibration error on equal-mass bins.

Without optional packages: hand-computed cases (uneven chunks, ties, bins with fewer than 2 samples, clipping at 0) and
a pure-Python loop written from the documented conventions. With the authors' ``uncertainty-calibration`` package:
agreement with ``calibration.lower_bound_scaling_ce(probs, labels, p=2, debias=True, num_bins, mode)`` to 1e-6 on
random, tied, real (scikit-learn digits) and synthetic miscalibrated inputs, top-label and marginal.
"""

from __future__ import annotations

import bisect
import math

import pytest
import torch

from calibkernels import metrics
from calibkernels.metrics.debiased import equal_mass_edges
from test_metrics_smooth_ece import digits_logits


def _binary(confidence, correct, dtype=torch.float64):
    confidence = torch.tensor(confidence, dtype=dtype)
    probs = torch.stack([confidence, 1 - confidence], dim=-1)
    return probs, torch.tensor([0 if hit else 1 for hit in correct])


def _loop_squared_error(values, targets, n_bins):
    """The documented estimator, one Python loop: array_split chunks, midpoint boundaries, (lo, hi] bins."""
    values, targets = [float(v) for v in values], [float(t) for t in targets]
    n = len(values)
    chunks = min(n_bins, n)
    ordered = sorted(values)
    size, larger = divmod(n, chunks)
    starts = [i * size + min(i, larger) for i in range(1, chunks)]
    boundaries = [(ordered[s - 1] + ordered[s]) / 2 for s in starts] + [1.0]
    members = [[] for _ in boundaries]
    for value, target in zip(values, targets):
        members[bisect.bisect_left(boundaries, value)].append((value, target))
    total = 0.0
    for bin_members in members:
        m = len(bin_members)
        if m < 2:
            continue
        p_mean = sum(v for v, _ in bin_members) / m
        y_mean = sum(t for _, t in bin_members) / m
        total += m / n * ((p_mean - y_mean) ** 2 - y_mean * (1 - y_mean) / (m - 1))
    return total


def _loop_debiased(probs, labels, n_bins, mode):
    if mode == "top-label":
        confidence, prediction = probs.max(dim=-1)
        return math.sqrt(max(_loop_squared_error(confidence, prediction == labels, n_bins), 0.0))
    per_class = [max(_loop_squared_error(probs[:, k], labels == k, n_bins), 0.0) for k in range(probs.shape[1])]
    return math.sqrt(sum(per_class) / len(per_class))


# ------------------------------------------------------------------------------------------------ by hand
def test_two_bins_by_hand():
    """Bins {0.6, 0.7, 0.8} (1 of 3 right) and {0.85, 0.9, 0.95} (1 of 3 right):
    CE² = ½ [(0.7 - 1/3)² - (1/3)(2/3)/2] + ½ [(0.9 - 1/3)² - (1/3)(2/3)/2] = ½ (21 + 189) / 900."""
    probs, labels = _binary([0.6, 0.7, 0.8, 0.85, 0.9, 0.95], [False, False, True, True, False, False])
    assert metrics.debiased_ece(probs, labels, n_bins=2) == pytest.approx(math.sqrt(105 / 900), abs=1e-12)


def test_uneven_chunks_by_hand():
    """7 values in 3 bins: chunks of 3, 2, 2 (array_split), boundaries at the midpoints between chunks."""
    values = torch.tensor([0.95, 0.6, 0.9, 0.55, 0.7, 0.8, 0.65], dtype=torch.float64)
    edges = equal_mass_edges(values, 3)
    assert edges.tolist() == [-math.inf, (0.65 + 0.7) / 2, (0.8 + 0.9) / 2, 1.0]
    probs, labels = _binary(values.tolist(), [True, False, True, False, False, False, False])
    # Bins {0.55, 0.6, 0.65} all wrong, {0.7, 0.8} both wrong, {0.9, 0.95} both right: no outcome variance.
    squared = 3 / 7 * 0.6 ** 2 + 2 / 7 * 0.75 ** 2 + 2 / 7 * (0.925 - 1.0) ** 2
    assert metrics.debiased_ece(probs, labels, n_bins=3) == pytest.approx(math.sqrt(squared), abs=1e-12)
    # One right answer in each of the first two bins: the debiased square turns negative and is clipped to 0.
    probs, labels = _binary(values.tolist(), [True, False, True, True, True, False, True])
    squared = (3 / 7 * ((0.6 - 2 / 3) ** 2 - (2 / 3) * (1 / 3) / 2)
               + 2 / 7 * ((0.75 - 0.5) ** 2 - 0.5 * 0.5 / 1)
               + 2 / 7 * ((0.925 - 1.0) ** 2 - 0.0))
    assert squared < 0
    assert metrics.debiased_ece(probs, labels, n_bins=3) == 0.0


def test_ties_leave_a_bin_empty():
    """Chunks {0.6, 0.6}, {0.6, 0.6}, {0.9, 0.9}: boundaries 0.6, 0.75, 1, so (-inf, 0.6] holds all four 0.6s and
    (0.6, 0.75] is empty."""
    values = [0.6, 0.6, 0.6, 0.6, 0.9, 0.9]
    assert equal_mass_edges(torch.tensor(values, dtype=torch.float64), 3).tolist() == [-math.inf, 0.6, 0.75, 1.0]
    probs, labels = _binary(values, [False, False, False, True, False, False])
    squared = 4 / 6 * ((0.6 - 0.25) ** 2 - 0.25 * 0.75 / 3) + 2 / 6 * (0.9 ** 2 - 0.0)
    assert metrics.debiased_ece(probs, labels, n_bins=3) == pytest.approx(math.sqrt(squared), abs=1e-12)


def test_singleton_bins_add_nothing():
    probs, labels = _binary([0.6, 0.7, 0.8, 0.9], [False, False, False, False])
    assert metrics.debiased_ece(probs, labels, n_bins=15) == 0.0  # 4 bins of one sample each
    # Bins {0.6, 0.7}, {0.8}, {0.9}: only the first counts.
    probs, labels = _binary([0.6, 0.7, 0.8, 0.9], [False, False, False, False])
    assert metrics.debiased_ece(probs, labels, n_bins=3) == pytest.approx(math.sqrt(2 / 4 * 0.65 ** 2), abs=1e-12)


def test_marginal_by_hand():
    """Two classes, one bin each: class 0 has p = 0.8, 0.6 against outcomes 1, 0; class 1 the complements."""
    probs = torch.tensor([[0.8, 0.2], [0.6, 0.4]], dtype=torch.float64)
    labels = torch.tensor([0, 1])
    per_class = (0.7 - 0.5) ** 2 - 0.25  # the same for both classes (p̄ = 0.3 against ȳ = 0.5 for class 1)
    assert per_class < 0
    assert metrics.debiased_ece(probs, labels, n_bins=1, mode="marginal") == 0.0
    probs = torch.tensor([[0.9, 0.1], [0.8, 0.2], [0.7, 0.3]], dtype=torch.float64)
    labels = torch.tensor([1, 1, 0])
    class_0 = (0.8 - 1 / 3) ** 2 - (1 / 3) * (2 / 3) / 2
    class_1 = (0.2 - 2 / 3) ** 2 - (2 / 3) * (1 / 3) / 2
    assert metrics.debiased_ece(probs, labels, n_bins=1, mode="marginal") == pytest.approx(
        math.sqrt((class_0 + class_1) / 2), abs=1e-12)


@pytest.mark.parametrize("mode", ["top-label", "marginal"])
@pytest.mark.parametrize("n, classes, n_bins", [(1, 3, 15), (2, 2, 15), (37, 4, 5), (500, 10, 15), (300, 3, 40)])
def test_against_loop(mode, n, classes, n_bins):
    logits = torch.randn(n, classes, dtype=torch.float64) * 3
    if n > 100:
        logits = logits.round(decimals=1)  # ties
    labels = torch.where(torch.rand(n) < 0.6, logits.argmax(-1), torch.randint(0, classes, (n,)))
    probs = torch.softmax(logits, -1)
    assert metrics.debiased_ece(probs, labels, n_bins, mode) == pytest.approx(
        _loop_debiased(probs, labels, n_bins, mode), abs=1e-12)


def test_logits_probabilities_and_ignore_index():
    logits, labels = torch.randn(3, 80, 6), torch.randint(0, 6, (3, 80))
    for mode in ("top-label", "marginal"):
        value = metrics.debiased_ece(logits, labels, mode=mode)
        assert metrics.debiased_ece(torch.softmax(logits, -1), labels, mode=mode, inputs_are="probs") == value
        padded = torch.cat([logits.reshape(-1, 6), torch.full((5, 6), math.inf)])
        padded_labels = torch.cat([labels.reshape(-1), torch.full((5,), -100)])
        assert metrics.debiased_ece(padded, padded_labels, mode=mode) == value


def test_bad_arguments():
    logits, labels = torch.randn(10, 3), torch.randint(0, 3, (10,))
    with pytest.raises(ValueError, match="mode"):
        metrics.debiased_ece(logits, labels, mode="classwise")
    with pytest.raises(ValueError, match="n_bins"):
        metrics.debiased_ece(logits, labels, n_bins=0)
    with pytest.raises(TypeError, match="n_bins"):
        metrics.debiased_ece(logits, labels, n_bins=2.5)
    with pytest.raises(ValueError, match="out of range"):
        metrics.debiased_ece(logits, torch.full((10,), 7))
    with pytest.raises(ValueError, match="sum"):
        metrics.debiased_ece(torch.full((10, 3), 0.5), labels, inputs_are="probs")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_matches_cpu():
    logits, labels = torch.randn(5000, 20), torch.randint(0, 20, (5000,))
    for mode in ("top-label", "marginal"):
        assert metrics.debiased_ece(logits.cuda(), labels.cuda(), mode=mode) == pytest.approx(
            metrics.debiased_ece(logits, labels, mode=mode), abs=1e-9)


# ------------------------------------------------------------------------------------------------ the package
def _assert_matches_package(calibration, probs, labels, n_bins=15):
    for mode in ("top-label", "marginal"):
        expected = calibration.lower_bound_scaling_ce(probs.numpy(), labels.numpy(), p=2, debias=True,
                                                      num_bins=n_bins, mode=mode)
        assert metrics.debiased_ece(probs, labels, n_bins, mode, inputs_are="probs") == pytest.approx(
            expected, abs=1e-6), mode


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("n, classes, n_bins, scale, rounded",
                         [(5, 3, 15, 1.0, False), (200, 4, 15, 2.0, False), (1001, 10, 15, 5.0, False),
                          (3000, 7, 40, 1.0, False), (800, 5, 15, 3.0, True), (64, 2, 1, 1.0, False)])
def test_package_random(dtype, n, classes, n_bins, scale, rounded):
    calibration = pytest.importorskip("calibration")
    logits = torch.randn(n, classes, dtype=torch.float64) * scale
    if rounded:
        logits = logits.round()  # many exact ties among the probabilities
    labels = torch.where(torch.rand(n) < 0.5, logits.argmax(-1), torch.randint(0, classes, (n,)))
    _assert_matches_package(calibration, torch.softmax(logits, -1).to(dtype), labels, n_bins)


@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
def test_package_digits_logistic_regression(temperature):
    calibration = pytest.importorskip("calibration")
    logits, labels = digits_logits(temperature)
    _assert_matches_package(calibration, torch.softmax(logits, -1), labels)


@pytest.mark.parametrize("power", [0.5, 2.0, 4.0])
def test_package_synthetic_miscalibration(power):
    calibration = pytest.importorskip("calibration")
    confidence = torch.rand(4000, dtype=torch.float64) * 0.5 + 0.5
    correct = torch.rand(4000, dtype=torch.float64) < confidence ** power
    probs = torch.stack([confidence, 1 - confidence], dim=-1)
    _assert_matches_package(calibration, probs, torch.where(correct, 0, 1))
    assert metrics.debiased_ece(probs, torch.where(correct, 0, 1)) > 0.05  # clearly miscalibrated
