"""calibkernels.metrics.smooth_ece: the smooth ECE of Błasiok & Nakkiran.

Without optional packages: cases whose smooth ECE is known in closed form, a direct (undiscretised) evaluation of the
reflected-kernel formula at a fixed bandwidth, the fixed-point property of the automatic bandwidth, input handling.
With the authors' ``relplot`` package: agreement of the value, the bandwidth and the smoothed curve on random logits,
on a logistic regression fitted to scikit-learn's digits, and on synthetic miscalibrated binary predictions.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from calibkernels import metrics
from calibkernels.metrics.smooth_ece import BISECTION_STEPS, automatic_smooth_ece, smooth_ece_at

STEP = 2.0 ** -BISECTION_STEPS


def _binary(confidence, correct):
    """Two-class probabilities whose top-label confidence is ``confidence`` (>= 0.5) and labels with the given
    correctness."""
    confidence = torch.as_tensor(confidence, dtype=torch.float64)
    probs = torch.stack([confidence, 1 - confidence], dim=-1)
    labels = torch.where(torch.as_tensor(correct, dtype=torch.bool), 0, 1)
    return probs, labels


def _top_label(probs, labels):
    confidence, prediction = probs.max(dim=-1)
    return confidence.double().numpy(), (prediction == labels).double().numpy()


def _continuous_smooth_ece(f, y, sigma):
    """The reflected-kernel formula evaluated directly (images at f, -f, 2 - f) on relplot's evaluation points."""
    t = np.linspace(0, 1, max(round(10 / sigma), 200))[:, None]
    gauss = lambda d: np.exp(-d ** 2 / (2 * sigma ** 2)) / (math.sqrt(2 * math.pi) * sigma)  # noqa: E731
    kernel = gauss(t - f) + gauss(t + f) + gauss(t - (2 - f))
    return np.abs(kernel @ (f - y)).sum() / kernel.sum()


# ------------------------------------------------------------------------------------------------ closed form
def test_perfect_predictions_have_zero_smooth_ece():
    probs, labels = _binary(torch.ones(50), torch.ones(50))
    value, sigma = metrics.smooth_ece(probs, labels, return_bandwidth=True)
    assert value == 0.0
    # Every trial bandwidth >= 0.001 is wide enough (0 < σ), so the bracket closes on the smallest one tried.
    assert sigma == 2 * STEP


@pytest.mark.parametrize("confidence, correct, error", [(0.7, False, 0.7), (0.7, True, 0.3), (0.55, True, 0.45)])
def test_constant_residual(confidence, correct, error):
    """Every residual f - y equal to r: R = r·D, so smECE_σ = |r| at every σ (up to the 1e-4 density floor) and the
    bisection ends on the first multiple of 2^-10 at or above |r|."""
    probs, labels = _binary(torch.full((40,), confidence), torch.full((40,), correct))
    value, sigma = metrics.smooth_ece(probs, labels, return_bandwidth=True)
    assert value == pytest.approx(error, abs=1e-5)
    assert value <= error
    assert sigma == math.ceil(value / STEP) * STEP


def test_top_label_of_many_classes():
    """Top-label confidence 0.3 of five classes, all wrong: the residual is 0.3 everywhere."""
    probs = torch.tensor([[0.3, 0.2, 0.2, 0.15, 0.15]]).repeat(30, 1)
    labels = torch.full((30,), 4)
    assert metrics.smooth_ece(probs, labels) == pytest.approx(0.3, abs=1e-5)


@pytest.mark.parametrize("sigma", [0.02, 0.05, 0.1])
def test_fixed_bandwidth_matches_the_continuous_formula(sigma):
    """The grid discretisation (linear spreading onto ~1000 points) stays within 1e-3 of the exact kernel sums."""
    confidence = torch.rand(500, dtype=torch.float64) * 0.5 + 0.5
    correct = torch.rand(500, dtype=torch.float64) < confidence ** 2
    probs, labels = _binary(confidence, correct)
    f, y = _top_label(probs, labels)
    assert metrics.smooth_ece(probs, labels, bandwidth=sigma) == pytest.approx(
        _continuous_smooth_ece(f, y, sigma), abs=1e-3)


def test_automatic_bandwidth_is_the_bisection_fixed_point():
    """σ* is a multiple of 2^-10 with smECE_σ* <= σ*, and σ* - 2^-10 is too narrow (below smECE or below 0.001)."""
    logits, labels = torch.randn(800, 6) * 3, torch.randint(0, 6, (800,))
    value, sigma = metrics.smooth_ece(logits, labels, return_bandwidth=True)
    assert sigma / STEP == round(sigma / STEP)
    assert value <= sigma
    assert value == metrics.smooth_ece(logits, labels, bandwidth=sigma)
    below = sigma - STEP
    assert below < 1e-3 or below < metrics.smooth_ece(logits, labels, bandwidth=below)


def test_rows_are_independent_problems():
    """The batched bisection (rows grouped by trial bandwidth) gives each row the value it has alone."""
    confidence = torch.rand(7, 300, dtype=torch.float64) * 0.6 + 0.4
    correct = (torch.rand(7, 300, dtype=torch.float64) < confidence ** torch.linspace(0.3, 3, 7)[:, None]).double()
    values, sigmas = automatic_smooth_ece(confidence, correct)
    for row in range(7):
        alone, sigma = automatic_smooth_ece(confidence[row:row + 1], correct[row:row + 1])
        assert sigmas[row] == sigma[0]
        assert values[row] == pytest.approx(float(alone[0]), abs=1e-14)
        assert values[row] == pytest.approx(float(smooth_ece_at(confidence[row:row + 1], correct[row:row + 1],
                                                                float(sigma[0]))[0]), abs=1e-14)


def test_curve_is_consistent_with_the_value():
    logits, labels = torch.randn(600, 4) * 2, torch.randint(0, 4, (600,))
    curve = metrics.smooth_reliability_curve(logits, labels)
    value, sigma = metrics.smooth_ece(logits, labels, return_bandwidth=True)
    assert curve["smooth_ece"] == value and curve["bandwidth"] == sigma
    t, mu, density = curve["confidence"], curve["accuracy"], curve["density"]
    assert t.shape == mu.shape == density.shape and t.dtype == torch.float64
    assert t[0] == 0 and t[-1] == 1
    # |t - μ| (D + 1e-4) = |R|, so the floor-weighted mean distance to the diagonal is the smooth ECE.
    weight = density * labels.shape[0] + 1e-4
    assert float(((t - mu).abs() * weight).sum() / weight.sum()) == pytest.approx(value, rel=1e-9)


def test_density_integrates_to_one_for_narrow_kernels():
    probs, labels = _binary(torch.rand(400, dtype=torch.float64) * 0.4 + 0.55, torch.rand(400) < 0.7)
    curve = metrics.smooth_reliability_curve(probs, labels, bandwidth=0.02)
    assert float(torch.trapezoid(curve["density"], curve["confidence"])) == pytest.approx(1.0, abs=5e-3)


# ------------------------------------------------------------------------------------------------ inputs
def test_logits_probabilities_ignore_index_and_shapes():
    logits, labels = torch.randn(4, 50, 5), torch.randint(0, 5, (4, 50))
    value = metrics.smooth_ece(logits, labels)
    assert metrics.smooth_ece(torch.softmax(logits, -1), labels, inputs_are="probs") == pytest.approx(value, abs=1e-12)
    assert metrics.smooth_ece(logits.reshape(-1, 5), labels.reshape(-1)) == value
    padded_logits = torch.cat([logits.reshape(-1, 5), torch.full((9, 5), math.nan)])
    padded_labels = torch.cat([labels.reshape(-1), torch.full((9,), -1)])
    assert metrics.smooth_ece(padded_logits, padded_labels, ignore_index=-1) == value


@pytest.mark.parametrize("bandwidth, error", [(0.0, ValueError), (-0.1, ValueError), (math.nan, ValueError),
                                              (math.inf, ValueError), (1e-5, ValueError), (True, TypeError),
                                              ("0.1", TypeError)])
def test_bad_bandwidth(bandwidth, error):
    with pytest.raises(error, match="bandwidth"):
        metrics.smooth_ece(torch.randn(10, 3), torch.randint(0, 3, (10,)), bandwidth=bandwidth)


def test_bad_inputs():
    with pytest.raises(ValueError, match="out of range"):
        metrics.smooth_ece(torch.randn(10, 3), torch.full((10,), 3))
    with pytest.raises(TypeError):
        metrics.smooth_ece(np.zeros((10, 3)), torch.zeros(10, dtype=torch.long))
    with pytest.raises(ValueError, match="no samples"):
        metrics.smooth_ece(torch.randn(3, 3), torch.full((3,), -100))
    with pytest.raises(ValueError, match="NaN"):
        metrics.smooth_ece(torch.full((3, 3), math.nan), torch.zeros(3, dtype=torch.long))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_cuda_matches_cpu(dtype, tolerance):
    # the confidences are softmaxes in the logits' dtype, computed by each device's own kernel: float32 ones differ
    # by an ulp or so (1.5e-9 in smECE was seen on an H200), float64 ones by float64 rounding
    logits, labels = (torch.randn(3000, 10) * 2).to(dtype), torch.randint(0, 10, (3000,))
    value, sigma = metrics.smooth_ece(logits, labels, return_bandwidth=True)
    cuda_value, cuda_sigma = metrics.smooth_ece(logits.cuda(), labels.cuda(), return_bandwidth=True)
    assert cuda_sigma == pytest.approx(sigma, abs=tolerance) and cuda_value == pytest.approx(value, abs=tolerance)


def test_diagram_with_smooth_curve(tmp_path):
    pytest.importorskip("matplotlib")
    logits, labels = torch.randn(500, 5) * 2, torch.randint(0, 5, (500,))
    path = tmp_path / "smooth.png"
    figure = metrics.reliability_diagram(logits, labels, path, smooth=True)
    assert path.stat().st_size > 10_000
    reliability_ax = figure.axes[0]
    assert any(text.get_text().startswith("Smoothed accuracy") for text in reliability_ax.get_legend().get_texts())
    assert f"smECE = {100 * metrics.smooth_ece(logits, labels):.2f}%" in reliability_ax.get_title()


# ------------------------------------------------------------------------------------------------ relplot
def _compare_with_relplot(relplot, probs, labels):
    """Automatic and fixed-bandwidth smooth ECE against relplot. The bandwidths must agree exactly, except that a
    bisection decision taken within rounding of the fixed point may go the other way (then they are one step apart
    and the values within 1e-3)."""
    f, y = _top_label(probs, labels)
    value, sigma = metrics.smooth_ece(probs, labels, inputs_are="probs", return_bandwidth=True)
    expected, expected_sigma = relplot.smECE(f, y, return_width=True)
    if sigma == expected_sigma:
        assert value == pytest.approx(expected, abs=1e-9)
    else:
        assert abs(sigma - expected_sigma) == STEP
        assert value == pytest.approx(expected, abs=1e-3)
    fixed = metrics.smooth_ece(probs, labels, inputs_are="probs", bandwidth=0.037)
    assert fixed == pytest.approx(relplot.smECE_sigma(f, y, 0.037), abs=1e-9)


@pytest.mark.parametrize("n, classes, scale", [(30, 3, 1.0), (700, 10, 4.0), (2500, 5, 0.5), (5000, 100, 8.0)])
def test_relplot_random_logits(n, classes, scale):
    relplot = pytest.importorskip("relplot")
    logits, labels = torch.randn(n, classes, dtype=torch.float64) * scale, torch.randint(0, classes, (n,))
    labels = torch.where(torch.rand(n) < 0.5, logits.argmax(-1), labels)  # some signal: accuracy above chance
    _compare_with_relplot(relplot, torch.softmax(logits, -1), labels)
    # float32 probabilities: relplot gets the same float32 confidences, widened.
    _compare_with_relplot(relplot, torch.softmax(logits.float(), -1), labels)


@functools.lru_cache(maxsize=1)
def _digits_model():
    sklearn_datasets = pytest.importorskip("sklearn.datasets")
    from sklearn.linear_model import LogisticRegression

    features, targets = sklearn_datasets.load_digits(return_X_y=True)
    model = LogisticRegression(max_iter=100).fit(features[:1000] / 16, targets[:1000])
    return torch.tensor(model.decision_function(features[1000:] / 16)), torch.tensor(targets[1000:])


def digits_logits(temperature):
    """Held-out logits (797 × 10, float64) of a logistic regression fitted to 1000 of scikit-learn's digits, divided
    by ``temperature`` (below 1: over-confident), and their labels. Also used by tests/test_metrics_debiased.py."""
    logits, labels = _digits_model()
    return logits / temperature, labels


@pytest.mark.parametrize("temperature", [0.3, 1.0, 4.0])
def test_relplot_digits_logistic_regression(temperature):
    relplot = pytest.importorskip("relplot")
    logits, labels = digits_logits(temperature)
    _compare_with_relplot(relplot, torch.softmax(logits, -1), labels)
    assert metrics.smooth_ece(logits, labels) == pytest.approx(
        metrics.smooth_ece(torch.softmax(logits, -1), labels), abs=1e-12)


@pytest.mark.parametrize("power", [0.5, 1.0, 2.0, 4.0])
def test_relplot_synthetic_miscalibration(power):
    """Binary predictions f whose true frequency is f^power: over-confident for power > 1, under- for power < 1."""
    relplot = pytest.importorskip("relplot")
    confidence = torch.rand(3000, dtype=torch.float64) * 0.5 + 0.5
    probs, labels = _binary(confidence, torch.rand(3000, dtype=torch.float64) < confidence ** power)
    _compare_with_relplot(relplot, probs, labels)


def test_relplot_curve():
    pytest.importorskip("relplot")
    from relplot.kernels import ReflectedGaussianKernel

    logits, labels = torch.randn(1500, 8, dtype=torch.float64) * 3, torch.randint(0, 8, (1500,))
    labels = torch.where(torch.rand(1500) < 0.6, logits.argmax(-1), labels)
    curve = metrics.smooth_reliability_curve(logits, labels)
    f, y = _top_label(torch.softmax(logits, -1), labels)
    t = curve["confidence"].numpy()
    smoothed, _ = ReflectedGaussianKernel(curve["bandwidth"]).smooth(f, y - f, t)
    np.testing.assert_allclose(curve["accuracy"].numpy(), t + smoothed, rtol=0, atol=1e-9)
