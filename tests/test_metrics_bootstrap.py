"""calibkernels.metrics.bootstrap: percentile bootstrap intervals, the batched path against the per-resample loop,
seeding, ignored rows, argument checks, and the reliability diagram's bootstrap band."""

from __future__ import annotations

import functools
import math

import numpy as np
import pytest
import torch

from calibkernels import metrics
from calibkernels.metrics.bootstrap import _batched_plan

BATCHED = [
    metrics.ece,
    metrics.adaptive_ece,
    metrics.mce,
    metrics.classwise_ece,
    metrics.nll,
    metrics.brier_score,
    metrics.accuracy,
    metrics.smooth_ece,
    metrics.debiased_ece,
    functools.partial(metrics.ece, n_bins=7),
    functools.partial(metrics.adaptive_ece, n_bins=4, inputs_are="logits"),
    functools.partial(metrics.smooth_ece, bandwidth=0.05),
    functools.partial(metrics.debiased_ece, n_bins=5, mode="marginal"),
]


def _name(metric):
    if isinstance(metric, functools.partial):
        return f"{metric.func.__name__}({', '.join(f'{k}={v}' for k, v in metric.keywords.items())})"
    return metric.__name__


def _looped(metric):
    return lambda x, labels: metric(x, labels)


def _data(n=240, classes=5):
    logits = torch.randn(n, classes) * 2.5
    labels = torch.where(torch.rand(n) < 0.6, logits.argmax(-1), torch.randint(0, classes, (n,)))
    labels[::11] = -100  # ignored rows
    return logits, labels


@pytest.mark.parametrize("metric", BATCHED, ids=_name)
def test_batched_path_equals_the_loop(metric):
    assert _batched_plan(metric, -100) is not None
    logits, labels = _data()
    batched = metrics.bootstrap_distribution(metric, logits, labels, n_resamples=40, seed=5)
    looped = metrics.bootstrap_distribution(_looped(metric), logits, labels, n_resamples=40, seed=5)
    assert batched.shape == (40,) and batched.dtype == torch.float64
    base = metric.func if isinstance(metric, functools.partial) else metric
    # NLL of logits: the metric sums float32 cross-entropies in float32, the batched path in float64.
    tolerance = 1e-6 if base is metrics.nll else 1e-12
    torch.testing.assert_close(batched, looped, rtol=tolerance, atol=tolerance)
    assert batched.std() > 0  # the resamples differ


def test_probability_inputs_and_ties_batched():
    """Probabilities with many tied confidences (AdaECE's tie rule, debiased ECE's empty bins) and an infinite NLL."""
    probs = torch.tensor([[0.5, 0.5, 0.0], [0.8, 0.2, 0.0], [0.8, 0.1, 0.1], [1.0, 0.0, 0.0]]).repeat(30, 1)
    labels = torch.tensor([0, 1, 0, 2]).repeat(30)
    for metric in (metrics.adaptive_ece, metrics.debiased_ece, metrics.ece, metrics.brier_score):
        batched = metrics.bootstrap_distribution(metric, probs, labels, n_resamples=30, seed=1)
        looped = metrics.bootstrap_distribution(_looped(metric), probs, labels, n_resamples=30, seed=1)
        torch.testing.assert_close(batched, looped, rtol=1e-12, atol=1e-12)
    low, high = metrics.bootstrap(metrics.nll, probs, labels, n_resamples=30)  # a label with probability 0
    assert low == high == math.inf


def test_which_metrics_are_batched():
    assert set(metrics.BATCHED_METRICS) == {"ece", "adaptive_ece", "mce", "classwise_ece", "nll", "brier_score",
                                            "accuracy", "smooth_ece", "debiased_ece"}
    assert _batched_plan(lambda x, y: 0.0, -100) is None
    assert _batched_plan(functools.partial(metrics.ece, torch.zeros(1)), -100) is None  # positional argument bound
    assert _batched_plan(functools.partial(metrics.smooth_ece, return_bandwidth=True), -100) is None
    assert _batched_plan(metrics.sece, -100) is None
    with pytest.raises(ValueError, match="ignore_index"):
        _batched_plan(functools.partial(metrics.ece, ignore_index=-1), -100)


def test_interval_is_the_percentiles_of_the_distribution():
    logits, labels = _data()
    values = metrics.bootstrap_distribution(metrics.ece, logits, labels, n_resamples=101, seed=3).numpy()
    for confidence in (0.5, 0.9, 0.95):
        low, high = metrics.bootstrap(metrics.ece, logits, labels, n_resamples=101, confidence=confidence, seed=3)
        assert low == pytest.approx(np.percentile(values, 50 * (1 - confidence)), abs=1e-15)
        assert high == pytest.approx(np.percentile(values, 50 * (1 + confidence)), abs=1e-15)
        assert low <= high


def test_seeding():
    logits, labels = _data()
    first = metrics.bootstrap(metrics.adaptive_ece, logits, labels, n_resamples=200, seed=7)
    assert metrics.bootstrap(metrics.adaptive_ece, logits, labels, n_resamples=200, seed=7) == first
    assert metrics.bootstrap(metrics.adaptive_ece, logits, labels, n_resamples=200, seed=8) != first


def test_ignored_rows_are_dropped_before_resampling():
    logits, labels = _data()
    keep = labels != -100
    for metric in (metrics.ece, _looped(metrics.ece)):
        assert metrics.bootstrap(metric, logits, labels, n_resamples=50) == metrics.bootstrap(
            metric, logits[keep], labels[keep], n_resamples=50)
    assert metrics.bootstrap(metrics.ece, logits.reshape(4, 60, 5), labels.reshape(4, 60), n_resamples=50) == \
        metrics.bootstrap(metrics.ece, logits, labels, n_resamples=50)


def test_accuracy_interval_by_hand():
    """200 right and 200 wrong: the resampled accuracy is Binomial(400, 1/2)/400, so the 95% interval is about
    0.5 ± 1.96·sqrt(0.25/400) = 0.5 ± 0.049."""
    logits = torch.tensor([[2.0, 0.0]]).repeat(400, 1)
    labels = torch.arange(400) % 2
    low, high = metrics.bootstrap(metrics.accuracy, logits, labels, n_resamples=2000, seed=0)
    assert low < 0.5 < high
    assert 0.44 < low < 0.47 and 0.53 < high < 0.56
    everything_right = metrics.bootstrap(metrics.accuracy, logits, torch.zeros(400, dtype=torch.long))
    assert everything_right == (1.0, 1.0)


def test_one_dimensional_inputs_and_tensor_results():
    confidence = torch.rand(300)
    correct = (torch.rand(300) < confidence).long()
    low, high = metrics.bootstrap(lambda c, a: (c - a).mean().abs(), confidence, correct, n_resamples=100)
    assert 0 <= low <= high
    point = float((confidence - correct).mean().abs())
    assert low - 0.1 < point < high + 0.1


def test_bad_arguments():
    logits, labels = _data(50)
    with pytest.raises(TypeError, match="callable"):
        metrics.bootstrap("ece", logits, labels)
    for confidence in (0, 1, 1.5, -0.1, math.nan):
        with pytest.raises(ValueError, match="confidence"):
            metrics.bootstrap(metrics.ece, logits, labels, confidence=confidence)
    with pytest.raises(TypeError, match="confidence"):
        metrics.bootstrap(metrics.ece, logits, labels, confidence="95%")
    with pytest.raises(ValueError, match="n_resamples"):
        metrics.bootstrap(metrics.ece, logits, labels, n_resamples=0)
    with pytest.raises(TypeError, match="n_resamples"):
        metrics.bootstrap(metrics.ece, logits, labels, n_resamples=10.0)
    with pytest.raises(ValueError, match="seed"):
        metrics.bootstrap(metrics.ece, logits, labels, seed=-1)
    with pytest.raises(ValueError, match="same samples"):
        metrics.bootstrap(metrics.ece, logits, labels[:-1])
    with pytest.raises(ValueError, match="no samples"):
        metrics.bootstrap(metrics.ece, logits, torch.full_like(labels, -100))
    with pytest.raises(TypeError, match="float"):
        metrics.bootstrap(lambda x, y: "0.5", logits, labels, n_resamples=3)
    with pytest.raises(ValueError, match="NaN"):
        metrics.bootstrap(lambda x, y: math.nan, logits, labels, n_resamples=3)
    with pytest.raises(ValueError, match="out of range"):
        metrics.bootstrap(metrics.ece, logits, torch.full_like(labels, 9))
    with pytest.raises(ValueError, match="mode"):
        metrics.bootstrap(functools.partial(metrics.debiased_ece, mode="top"), logits, labels)


def test_bin_accuracy_band():
    logits, labels = _data(600)
    band = metrics.bin_accuracy_band(logits, labels, n_bins=10, n_resamples=300, seed=2)
    stats = metrics.reliability_bins(logits, labels, n_bins=10)
    occupied = stats["count"] > 0
    low, high = band["low"], band["high"]
    assert low.shape == high.shape == (10,)
    assert torch.isnan(low[~occupied]).all() and torch.isnan(high[~occupied]).all()
    assert (low[occupied] <= high[occupied]).all()
    assert (low[occupied] >= 0).all() and (high[occupied] <= 1).all()
    busy = stats["count"] >= 20  # well-populated bins: the interval covers the bin's accuracy
    assert ((low[busy] <= stats["accuracy"][busy]) & (stats["accuracy"][busy] <= high[busy])).all()
    again = metrics.bin_accuracy_band(logits, labels, n_bins=10, n_resamples=300, seed=2)
    assert torch.equal(again["low"].nan_to_num(), low.nan_to_num())


def test_bin_accuracy_band_by_hand():
    """A bin whose samples are all right has the interval (1, 1); one that is all wrong (0, 0)."""
    probs = torch.tensor([[0.95, 0.05]] * 30 + [[0.55, 0.45]] * 30)
    labels = torch.tensor([0] * 30 + [1] * 30)
    band = metrics.bin_accuracy_band(probs, labels, n_bins=4, n_resamples=50)
    assert band["low"][2:].tolist() == [0.0, 1.0] and band["high"][2:].tolist() == [0.0, 1.0]
    assert band["low"][:2].isnan().all()  # empty bins


def test_diagram_with_band_and_smooth_curve(tmp_path):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    logits, labels = _data(800)
    path = tmp_path / "band.png"
    figure = metrics.reliability_diagram(logits, labels, path, smooth=True, band=True, n_resamples=100)
    assert path.stat().st_size > 10_000
    legend = [text.get_text() for text in figure.axes[0].get_legend().get_texts()]
    assert "95% bootstrap interval of the accuracy" in legend
    assert any(entry.startswith("Smoothed accuracy") for entry in legend)
    ax = Figure().subplots()
    assert metrics.reliability_diagram(logits, labels, ax=ax, band=True, band_confidence=0.8) is ax.figure
    assert "80% bootstrap interval of the accuracy" in [text.get_text() for text in ax.get_legend().get_texts()]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda():
    logits, labels = _data(2000)
    logits, labels = logits.cuda(), labels.cuda()
    for metric in (metrics.ece, metrics.adaptive_ece, metrics.smooth_ece, metrics.debiased_ece, metrics.nll):
        batched = metrics.bootstrap_distribution(metric, logits, labels, n_resamples=20, seed=4)
        looped = metrics.bootstrap_distribution(_looped(metric), logits, labels, n_resamples=20, seed=4)
        torch.testing.assert_close(batched, looped, rtol=1e-6, atol=1e-9)
    assert metrics.bootstrap(metrics.ece, logits, labels, n_resamples=50) == metrics.bootstrap(
        metrics.ece, logits, labels, n_resamples=50)
