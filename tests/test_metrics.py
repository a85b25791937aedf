"""calibkernels.metrics against brute-force loop implementations written here, following the reference code of the
published tables (Mukhoti et al. 2020's ECELoss / AdaptiveECELoss / ClasswiseECELoss: a Python loop over bins with
``conf.gt(lo.item()) * conf.le(hi.item())`` membership), plus the streaming meter (incl. a real 2-process DDP merge)
and the reliability diagram."""

from __future__ import annotations

import math
import os
import socket
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from calibkernels import metrics
from calibkernels.metrics import CalibrationMeter

FUNCTIONAL_BINNED = {
    "ece": metrics.ece,
    "adaece": metrics.adaptive_ece,
    "classwise_ece": metrics.classwise_ece,
    "mce": metrics.mce,
}


# ------------------------------------------------------------------------------------------------ brute force
def _confidence_correct(probs, labels):
    confidence, prediction = probs.max(dim=1)
    return confidence, prediction.eq(labels)


def _loop_binned_error(values, hits, lowers, uppers, reduce="sum"):
    """Reference loop over bins: (lo, hi] membership compared in the values' dtype, |B|/N over all N."""
    n = values.numel()
    total, worst = 0.0, 0.0
    for lo, hi in zip(lowers, uppers):
        in_bin = values.gt(float(lo)) * values.le(float(hi))
        count = int(in_bin.sum())
        if count > 0:
            gap = abs(hits[in_bin].double().mean().item() - values[in_bin].double().mean().item())
            total += gap * count / n
            worst = max(worst, gap)
    return total if reduce == "sum" else worst


def brute_ece(probs, labels, n_bins):
    confidence, correct = _confidence_correct(probs, labels)
    edges = torch.linspace(0, 1, n_bins + 1)
    return _loop_binned_error(confidence, correct, edges[:-1], edges[1:])


def brute_mce(probs, labels, n_bins):
    confidence, correct = _confidence_correct(probs, labels)
    edges = torch.linspace(0, 1, n_bins + 1)
    return _loop_binned_error(confidence, correct, edges[:-1], edges[1:], reduce="max")


def brute_adaptive_ece(probs, labels, n_bins):
    confidence, correct = _confidence_correct(probs, labels)
    x = confidence.numpy()
    n = len(x)
    edges = np.interp(np.linspace(0, n, n_bins + 1), np.arange(n), np.sort(x))
    _, edges = np.histogram(x, edges)  # the reference passes them through np.histogram (and uses only the edges)
    return _loop_binned_error(confidence, correct, edges[:-1], edges[1:])


def brute_adaptive_ece_with_tied_minimum(probs, labels, n_bins):
    """The published loop, except that when two or more samples share the minimum confidence the first bin is closed
    on the left ([lo, hi]) so they are counted in it instead of falling in no bin."""
    confidence, correct = _confidence_correct(probs, labels)
    x = confidence.numpy()
    n = len(x)
    edges = np.interp(np.linspace(0, n, n_bins + 1), np.arange(n), np.sort(x))
    lowest = confidence.eq(float(confidence.min()))
    tied = int(lowest.sum()) >= 2
    total = 0.0
    for b, (lo, hi) in enumerate(zip(edges[:-1], edges[1:])):
        in_bin = confidence.gt(float(lo)) * confidence.le(float(hi))
        if b == 0 and tied:
            in_bin = in_bin | lowest
        if bool(in_bin.any()):
            total += abs(float(correct[in_bin].double().sum() - confidence[in_bin].double().sum())) / n
    return total


def brute_classwise_ece(probs, labels, n_bins):
    edges = torch.linspace(0, 1, n_bins + 1)
    per_class = [
        _loop_binned_error(probs[:, k].contiguous(), labels.eq(k), edges[:-1], edges[1:]) for k in range(probs.shape[1])
    ]
    return sum(per_class) / len(per_class)


def brute_nll(probs, labels):
    return sum(-math.log(float(probs[i, labels[i]])) for i in range(len(labels))) / len(labels)


def brute_brier(probs, labels):
    total = 0.0
    for i in range(len(labels)):
        for k in range(probs.shape[1]):
            total += (float(probs[i, k]) - (1.0 if k == labels[i] else 0.0)) ** 2
    return total / len(labels)


def brute_accuracy(probs, labels):
    return sum(int(probs[i].argmax()) == int(labels[i]) for i in range(len(labels))) / len(labels)


BRUTE_BINNED = {
    "ece": brute_ece,
    "adaece": brute_adaptive_ece,
    "classwise_ece": brute_classwise_ece,
    "mce": brute_mce,
}


def _overconfident_logits(n, c, scale=4.0):
    """Logits whose arg-max is right ~60% of the time, so every bin is populated and the gaps are not tiny."""
    logits = torch.randn(n, c) * scale
    labels = torch.where(torch.rand(n) < 0.6, logits.argmax(1), torch.randint(0, c, (n,)))
    return logits, labels


def _quantised_probs(n, c, levels=30):
    """Probabilities on a grid of multiples of 1/levels: many confidences land exactly on 15-bin edges (k/15) — in
    float32 the edge value and k/15 coincide for some k and not for others, exercising both sides of the rule."""
    top = torch.randint(levels // c + 1, levels + 1, (n,)).float() / levels  # strictly the max when c >= 2
    rest = ((1 - top) / (c - 1))[:, None].expand(n, c - 1)
    probs = torch.cat([top[:, None], rest], dim=1)
    permutation = torch.argsort(torch.rand(n, c), dim=1)
    probs = probs.gather(1, permutation)
    labels = torch.randint(0, c, (n,))
    return probs, labels


# ------------------------------------------------------------------------------------------------ against brute force
@pytest.mark.parametrize("name", list(FUNCTIONAL_BINNED))
@pytest.mark.parametrize("n_bins", [1, 7, 15])
@pytest.mark.parametrize("given", ["logits", "probs"])
def test_binned_metrics_match_brute_force(name, n_bins, given):
    logits, labels = _overconfident_logits(400, 6)
    probs = torch.softmax(logits, dim=1)
    inputs = logits if given == "logits" else probs
    got = FUNCTIONAL_BINNED[name](inputs, labels, n_bins)
    expected = BRUTE_BINNED[name](probs, labels, n_bins)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("name", list(FUNCTIONAL_BINNED))
def test_binned_metrics_on_confidences_at_bin_edges(name):
    probs, labels = _quantised_probs(300, 3)
    got = FUNCTIONAL_BINNED[name](probs, labels, 15, inputs_are="probs")
    # Quantised confidences tie, usually at the minimum too: AdaECE then follows the documented tie rule.
    brute = brute_adaptive_ece_with_tied_minimum if name == "adaece" else BRUTE_BINNED[name]
    assert got == pytest.approx(brute(probs, labels, 15), abs=1e-6)


def test_confidences_exactly_on_float32_edges_belong_to_the_bin_below():
    edges = torch.linspace(0, 1, 16)
    # Two-class probabilities (c, 1 - c) with c exactly the float32 edges >= 0.5 (and c = 1.0, the last edge).
    top = edges[8:]
    probs = torch.stack([top, 1 - top], dim=1)
    labels = torch.zeros(len(top), dtype=torch.long)
    stats = metrics.reliability_bins(probs, labels, 15, inputs_are="probs")
    expected_count = torch.zeros(15, dtype=torch.float64)
    expected_count[7:15] = 1  # edge k (k = 8..15) is the upper end of bin k - 1
    torch.testing.assert_close(stats["count"], expected_count)


def test_confidence_exactly_one():
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    labels = torch.tensor([0, 0])  # first right with confidence 1, second wrong with confidence 1
    assert metrics.ece(probs, labels) == pytest.approx(0.5)
    assert metrics.mce(probs, labels) == pytest.approx(0.5)
    assert metrics.ece(probs[:1], labels[:1]) == 0.0
    assert metrics.ece(probs[1:], labels[1:]) == 1.0
    assert metrics.accuracy(probs, labels) == 0.5
    assert metrics.brier_score(probs, labels) == pytest.approx(1.0)  # (0 + 2) / 2
    assert metrics.nll(probs[:1], labels[:1]) == 0.0
    assert metrics.nll(probs, labels) == math.inf  # an impossible label under a probability input
    assert metrics.ece(probs, labels) == pytest.approx(brute_ece(probs, labels, 15), abs=1e-7)


def test_adaptive_ece_excludes_the_minimum_confidence():
    logits, labels = _overconfident_logits(200, 5)
    probs = torch.softmax(logits, dim=1)
    confidence, prediction = probs.max(dim=1)
    lowest = int(confidence.argmin())
    assert int((confidence == confidence[lowest]).sum()) == 1
    flipped = labels.clone()
    flipped[lowest] = prediction[lowest] if labels[lowest] != prediction[lowest] else (prediction[lowest] + 1) % 5
    # The minimum confidence falls in no (lo, hi] bin, so its correctness cannot change AdaECE (it still counts in N)
    assert metrics.adaptive_ece(probs, flipped) == pytest.approx(metrics.adaptive_ece(probs, labels), abs=1e-12)
    assert metrics.ece(probs, flipped) != pytest.approx(metrics.ece(probs, labels), abs=1e-9)


def test_adaptive_edges_match_numpy_interp():
    for n in (1, 2, 14, 15, 16, 97):
        confidence = torch.rand(n)
        for n_bins in (1, 4, 15):
            x = confidence.numpy()
            expected = np.interp(np.linspace(0, n, n_bins + 1), np.arange(n), np.sort(x)).astype(np.float32)
            got = metrics.equal_count_edges(confidence, n_bins)
            assert got.dtype == torch.float32
            np.testing.assert_array_equal(got.numpy(), expected)


def test_scalar_metrics_match_brute_force():
    logits, labels = _overconfident_logits(150, 4)
    probs = torch.softmax(logits, dim=1)
    for inputs in (logits, probs):
        assert metrics.nll(inputs, labels) == pytest.approx(brute_nll(probs, labels), rel=1e-5)
        assert metrics.brier_score(inputs, labels) == pytest.approx(brute_brier(probs, labels), rel=1e-6)
        assert metrics.accuracy(inputs, labels) == brute_accuracy(probs, labels)
    assert metrics.nll(logits, labels) == pytest.approx(float(F.cross_entropy(logits.double(), labels)), rel=1e-6)


# ------------------------------------------------------------------------------------------------ input handling
def test_auto_detection_and_explicit_kinds_agree():
    logits, labels = _overconfident_logits(200, 5)
    probs = torch.softmax(logits, dim=1)
    for name, fn in FUNCTIONAL_BINNED.items():
        by_logits = fn(logits, labels)
        assert fn(logits, labels, inputs_are="logits") == by_logits
        assert fn(probs, labels) == pytest.approx(by_logits, abs=1e-6)
        assert fn(probs, labels, inputs_are="probs") == pytest.approx(by_logits, abs=1e-6)
    # Treating probabilities as logits is a different (flatter) distribution: the choice matters.
    assert metrics.ece(probs, labels, inputs_are="logits") != pytest.approx(metrics.ece(probs, labels), abs=1e-3)


def test_leading_dimensions_ignore_index_and_half_precision():
    logits, labels = _overconfident_logits(120, 4)
    masked = labels.clone()
    masked[::5] = -100
    keep = masked != -100
    for name, fn in FUNCTIONAL_BINNED.items():
        reference = fn(logits[keep], labels[keep])
        assert fn(logits, masked) == pytest.approx(reference, abs=1e-12)
        assert fn(logits.reshape(6, 20, 4), masked.reshape(6, 20)) == pytest.approx(reference, abs=1e-12)
    for dtype in (torch.float16, torch.bfloat16):
        low = logits.to(dtype)
        assert metrics.ece(low, labels) == pytest.approx(metrics.ece(low.float(), labels), abs=1e-12)
    double = logits.double()
    assert metrics.ece(double, labels) == pytest.approx(brute_ece(torch.softmax(double, 1), labels, 15), abs=1e-12)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: metrics.ece(torch.randn(4, 3), torch.tensor([0, 1, 2, 3])), ValueError),  # label out of range
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(4)), TypeError),  # float labels
        (lambda: metrics.ece(torch.randint(0, 3, (4, 3)), torch.zeros(4, dtype=torch.long)), TypeError),
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(5, dtype=torch.long)), ValueError),  # shape
        (lambda: metrics.ece(torch.randn(4), torch.zeros(4, dtype=torch.long)), ValueError),  # no class dim
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), n_bins=0), ValueError),
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), n_bins=2.5), TypeError),
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), inputs_are="p"), ValueError),
        (lambda: metrics.ece(torch.randn(0, 3), torch.zeros(0, dtype=torch.long)), ValueError),  # empty
        (lambda: metrics.ece(torch.full((2, 3), math.nan), torch.zeros(2, dtype=torch.long)), ValueError),
        (lambda: metrics.nll([[0.5, 0.5]], torch.zeros(1, dtype=torch.long)), TypeError),
    ],
)
def test_bad_inputs_raise_clear_errors(call, error):
    with pytest.raises(error):
        call()


def test_adaptive_ece_counts_samples_tied_at_the_minimum_confidence():
    # Four rows at confidence 1.0, all wrong: every edge is 1.0, and (1, 1] bins would hold nobody.
    probs = torch.tensor([[1.0, 0.0]] * 4)
    labels = torch.ones(4, dtype=torch.long)
    assert metrics.ece(probs, labels) == 1.0
    assert metrics.adaptive_ece(probs, labels) == 1.0
    assert metrics.calibration_metrics(probs, labels)["adaece"] == 1.0
    # All confidences equal (0.6), 7 of 10 right: one equal-count group, |0.7 - 0.6|.
    probs = torch.tensor([[0.6, 0.4]] * 10)
    labels = torch.tensor([0] * 7 + [1] * 3)
    assert metrics.adaptive_ece(probs, labels, 15) == pytest.approx(0.1, abs=1e-6)
    assert metrics.adaptive_ece(probs, labels, 15) == pytest.approx(metrics.ece(probs, labels, 15), abs=1e-12)


@pytest.mark.parametrize("n_bins", [1, 4, 15])
@pytest.mark.parametrize("tied", [2, 5, 60])
def test_adaptive_ece_with_a_tied_minimum_matches_the_documented_rule(n_bins, tied):
    probs, labels = _quantised_probs(200, 3)
    top = probs.max(dim=1).values
    lowest = float(top.min())
    probs[:tied] = torch.tensor([lowest, (1 - lowest) / 2, (1 - lowest) / 2])  # `tied` rows at the minimum
    labels[:tied] = torch.arange(tied) % 2  # some right, some wrong
    confidence = probs.max(dim=1).values
    assert int((confidence == confidence.min()).sum()) >= tied
    got = metrics.adaptive_ece(probs, labels, n_bins, inputs_are="probs")
    assert got == pytest.approx(brute_adaptive_ece_with_tied_minimum(probs, labels, n_bins), abs=1e-9)
    meter = CalibrationMeter(n_bins, inputs_are="probs")
    for chunk_probs, chunk_labels in zip(probs.split(64), labels.split(64)):
        meter.update(chunk_probs, chunk_labels)
    assert meter.compute()["adaece"] == pytest.approx(got, abs=1e-12)


def test_adaptive_ece_rule_is_the_published_one_when_the_minimum_is_unique():
    logits, labels = _overconfident_logits(300, 5)
    probs = torch.softmax(logits, dim=1)
    assert int((probs.max(1).values == probs.max(1).values.min()).sum()) == 1
    for n_bins in (1, 7, 15):
        expected = brute_adaptive_ece(probs, labels, n_bins)
        assert brute_adaptive_ece_with_tied_minimum(probs, labels, n_bins) == pytest.approx(expected, abs=1e-12)
        assert metrics.adaptive_ece(probs, labels, n_bins) == pytest.approx(expected, abs=1e-6)


# ------------------------------------------------------------------------------------------------ probabilities
LOW_AND_HIGH_PRECISION = [torch.float16, torch.bfloat16, torch.float32, torch.float64]


@pytest.mark.parametrize("dtype", LOW_AND_HIGH_PRECISION)
def test_auto_detects_probabilities_rounded_to_their_dtype(dtype, recwarn):
    logits, labels = _overconfident_logits(2000, 10)
    probs = torch.softmax(logits.double(), dim=1)
    rounded = probs.to(dtype)
    expected = brute_ece(rounded.float(), labels, 15)
    for name, fn in FUNCTIONAL_BINNED.items():
        assert fn(rounded, labels) == fn(rounded, labels, inputs_are="probs"), name
    assert metrics.ece(rounded, labels) == pytest.approx(expected, abs=1e-6)
    assert metrics.ece(rounded, labels) == pytest.approx(metrics.ece(logits, labels), abs=2e-2)
    assert not [w for w in recwarn if "inputs_are" in str(w.message)]


def test_bfloat16_probabilities_whose_rows_miss_1e_3_are_still_probabilities():
    logits, labels = _overconfident_logits(2000, 10)
    rounded = torch.softmax(logits, dim=1).bfloat16()
    assert float((rounded.float().sum(1) - 1).abs().max()) > 1e-3  # the old fixed tolerance would call them logits
    assert metrics.ece(rounded, labels) == pytest.approx(metrics.ece(logits, labels), abs=1e-2)
    assert metrics.calibration_metrics(rounded, labels)["ece"] == pytest.approx(metrics.ece(logits, labels), abs=1e-2)
    from calibkernels.metrics import sece

    assert float(sece(rounded, labels)) == float(sece(rounded, labels, inputs_are="probs"))


def test_float16_probabilities_that_lost_subnormal_mass_are_still_probabilities():
    # A distribution whose 60000 smallest entries are each just under half fp16's smallest subnormal: rounding to
    # fp16 flushes them to 0 and the row loses ~1.7e-3 of its mass (more than a fixed 1e-3 allows).
    tail = 60000
    row = torch.full((tail + 1,), 2.9e-8, dtype=torch.float64)
    row[0] = 1 - tail * 2.9e-8
    probs = row.expand(3, -1).to(torch.float16)
    assert float((probs.double().sum(1) - 1).abs().max()) > 1e-3
    labels = torch.tensor([0, 1, 0])
    assert metrics.ece(probs, labels) == pytest.approx(brute_ece(probs.float(), labels, 15), abs=1e-6)
    assert metrics.accuracy(probs, labels, inputs_are="probs") == pytest.approx(2 / 3)


def test_probability_tolerance_follows_the_dtype():
    from calibkernels._validation.metric_inputs import probability_sum_tolerance

    tolerances = {dtype: probability_sum_tolerance(dtype, 10) for dtype in LOW_AND_HIGH_PRECISION}
    assert tolerances[torch.bfloat16] > tolerances[torch.float16] > tolerances[torch.float32] > 0
    assert tolerances[torch.bfloat16] >= torch.finfo(torch.bfloat16).eps  # a bf16 row may be off by eps / 2
    assert tolerances[torch.float64] <= 1e-3 and tolerances[torch.float32] <= 1e-3
    # fp16 subnormals: each entry below fp16's normal range can lose up to half a subnormal step
    assert probability_sum_tolerance(torch.float16, 100000) > probability_sum_tolerance(torch.float16, 10)


def test_auto_warns_when_values_in_0_1_do_not_sum_to_1():
    inputs = torch.rand(50, 4)  # in [0, 1], rows summing to ~2: logits or broken probabilities?
    labels = torch.randint(0, 4, (50,))
    with pytest.warns(UserWarning, match="inputs_are='logits'"):
        got = metrics.ece(inputs, labels)
    assert got == metrics.ece(inputs, labels, inputs_are="logits")
    with pytest.warns(UserWarning, match="treated as logits"):
        CalibrationMeter().update(inputs, labels)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics.ece(inputs, labels, inputs_are="logits")  # explicit: no warning
        metrics.ece(inputs - 0.5, labels)  # negative entries: plainly logits, no warning
        metrics.ece(torch.softmax(inputs, 1), labels)  # plainly probabilities


def test_auto_warns_when_rows_summing_to_1_have_an_entry_a_rounding_below_0():
    """Probabilities made as one minus the others can round below 0: "auto" reads them as logits, as its rule says,
    and warns, since the rows sum to 1; an explicit inputs_are does not warn."""
    generator = torch.Generator().manual_seed(0)
    probs = torch.softmax(3 * torch.randn(100, 10, generator=generator), 1)
    labels = torch.randint(0, 10, (100,), generator=generator)
    probs[0, 1] += probs[0, 0] + 1e-7  # the row still sums to 1
    probs[0, 0] = -1e-7
    with pytest.warns(UserWarning, match="smallest is -1e-07"):
        got = metrics.ece(probs, labels)
    assert got == metrics.ece(probs, labels, inputs_are="logits")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        metrics.ece(probs.clamp(min=0), labels, inputs_are="probs")


@pytest.mark.parametrize(
    "probs, message",
    [
        (torch.tensor([[2.0, 0.5], [0.3, 0.7]]), "above 1"),
        (torch.tensor([[1.2, -0.2], [0.3, 0.7]]), "negative"),
        (torch.tensor([[0.5, 0.4], [0.3, 0.7]]), "sum to 1"),
        (torch.tensor([[math.inf, 0.0], [0.3, 0.7]]), "above 1"),
        (torch.tensor([[math.nan, 0.5], [0.3, 0.7]]), "NaN"),
        (torch.tensor([[0.5, 0.5], [0.6, 0.6]]).bfloat16(), "sum to 1"),
    ],
)
def test_explicit_probabilities_are_checked(probs, message):
    labels = torch.tensor([0, 1])
    for fn in (*FUNCTIONAL_BINNED.values(), metrics.nll, metrics.brier_score, metrics.accuracy,
               metrics.calibration_metrics, metrics.reliability_bins, metrics.sece, metrics.dece):
        with pytest.raises(ValueError, match=message):
            fn(probs, labels, inputs_are="probs")


def test_explicit_probabilities_within_rounding_of_1_are_accepted():
    # Normalising in float32 can leave a confidence a few ulps above 1; it counts as 1 (the last bin), not as no bin.
    probs = torch.tensor([[1.0000001, 0.0], [0.0, 1.0000001]])
    labels = torch.tensor([0, 0])
    assert metrics.ece(probs, labels, inputs_are="probs") == pytest.approx(0.5)
    assert metrics.reliability_bins(probs, labels, inputs_are="probs")["count"].sum() == 2


# ------------------------------------------------------------------------------------------------ infinities
def test_masked_logits_are_probability_zero():
    logits, labels = _overconfident_logits(300, 6)
    masked = torch.rand(300, 6) < 0.3
    masked[torch.arange(300), labels] = False  # never the label
    with_minus_inf = logits.masked_fill(masked, -math.inf)
    very_negative = logits.masked_fill(masked, -1e30)
    for name, fn in {**FUNCTIONAL_BINNED, "nll": metrics.nll, "brier": metrics.brier_score}.items():
        assert fn(with_minus_inf, labels) == pytest.approx(fn(very_negative, labels), abs=1e-12), name
    result = metrics.calibration_metrics(with_minus_inf, labels)
    assert all(math.isfinite(v) for v in result.values())


@pytest.mark.parametrize("value, message", [(math.inf, r"\+inf"), (math.nan, "NaN")])
def test_positive_infinite_or_nan_logits_raise(value, message):
    logits, labels = _overconfident_logits(20, 4)
    logits[3, 1] = value
    for fn in (*FUNCTIONAL_BINNED.values(), metrics.nll, metrics.brier_score, metrics.accuracy,
               metrics.calibration_metrics, metrics.reliability_bins, metrics.sece, metrics.dece):
        for inputs_are in ("auto", "logits"):
            with pytest.raises(ValueError, match=message):
                fn(logits, labels, inputs_are=inputs_are)
    with pytest.raises(ValueError, match="row 3"):
        metrics.ece(logits, labels)


def test_a_row_of_only_masked_logits_raises():
    logits, labels = _overconfident_logits(20, 4)
    logits[5] = -math.inf
    with pytest.raises(ValueError, match="every class"):
        metrics.ece(logits, labels)
    labels[5] = -100  # an ignored row may be anything
    assert math.isfinite(metrics.ece(logits, labels))


# ------------------------------------------------------------------------------------------------ streaming
def test_meter_over_batches_equals_functional_metrics():
    logits, labels = _overconfident_logits(500, 7)
    meter = CalibrationMeter(n_bins=10)
    for chunk_logits, chunk_labels in zip(logits.split(64), labels.split(64)):
        meter.update(chunk_logits, chunk_labels)
    result = meter.compute()
    assert set(result) == set(metrics.METRIC_KEYS)
    assert all(isinstance(v, float) for v in result.values())
    expected = {
        "accuracy": metrics.accuracy(logits, labels),
        "ece": metrics.ece(logits, labels, 10),
        "adaece": metrics.adaptive_ece(logits, labels, 10),
        "classwise_ece": metrics.classwise_ece(logits, labels, 10),
        "mce": metrics.mce(logits, labels, 10),
        "nll": metrics.nll(logits, labels),
        "brier": metrics.brier_score(logits, labels),
    }
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert result == pytest.approx(metrics.calibration_metrics(logits, labels, 10), rel=1e-6, abs=1e-9)
    probs = torch.softmax(logits, dim=1)
    assert result["adaece"] == pytest.approx(brute_adaptive_ece(probs, labels, 10), abs=1e-6)

    meter.reset()
    with pytest.raises(ValueError):
        meter.compute()
    meter.update(logits[:50], labels[:50])
    assert meter.num_samples == 50
    assert meter.compute()["ece"] == pytest.approx(metrics.ece(logits[:50], labels[:50], 10), abs=1e-9)
    with pytest.raises(ValueError):
        meter.update(torch.randn(3, 4), torch.zeros(3, dtype=torch.long))  # class count changed


@pytest.mark.parametrize("track_adaptive", [True, False])
def test_meter_state_saves_restores_and_merges(tmp_path, track_adaptive):
    """state_dict / load_state_dict round-trip through torch.save (weights only) part-way through a stream, and
    merge_state of two meters over two shards (one of them also given a meter that saw nothing) computes what one
    meter over the whole stream does; meters with other settings or classes are refused."""
    logits, labels = _overconfident_logits(300, 6)
    whole = CalibrationMeter(n_bins=12, track_adaptive=track_adaptive)
    whole.update(logits, labels)
    expected = whole.compute()

    first = CalibrationMeter(n_bins=12, track_adaptive=track_adaptive)
    first.update(logits[:100], labels[:100])
    torch.save(first.state_dict(), tmp_path / "meter.pt")
    resumed = CalibrationMeter(n_bins=12, track_adaptive=track_adaptive)
    resumed.load_state_dict(torch.load(tmp_path / "meter.pt", weights_only=True))
    resumed.update(logits[100:], labels[100:])
    assert resumed.compute() == pytest.approx(expected, rel=1e-6, abs=1e-9, nan_ok=True)

    second = CalibrationMeter(n_bins=12, track_adaptive=track_adaptive)
    second.update(logits[100:], labels[100:])
    first.merge_state(second)
    first.merge_state(CalibrationMeter(n_bins=12, track_adaptive=track_adaptive))
    assert first.num_samples == 300
    assert first.compute() == pytest.approx(expected, rel=1e-6, abs=1e-9, nan_ok=True)
    empty = CalibrationMeter(n_bins=12, track_adaptive=track_adaptive)
    empty.merge_state(second.state_dict())
    assert empty.num_samples == 200

    with pytest.raises(ValueError, match="n_bins=15, this one n_bins=12"):
        first.merge_state(CalibrationMeter(track_adaptive=track_adaptive))
    other_classes = CalibrationMeter(n_bins=12, track_adaptive=track_adaptive)
    other_classes.update(torch.randn(4, 3), torch.zeros(4, dtype=torch.long))
    with pytest.raises(ValueError, match="3 classes, this one 6"):
        first.merge_state(other_classes)
    with pytest.raises(TypeError, match="CalibrationMeter or its state_dict"):
        first.merge_state({"bins": 1})


def test_meter_without_adaptive_tracking_keeps_constant_state():
    logits, labels = _overconfident_logits(200, 4)
    meter = CalibrationMeter(track_adaptive=False)
    meter.update(logits, labels)
    result = meter.compute()
    assert math.isnan(result["adaece"])
    assert result["ece"] == pytest.approx(metrics.ece(logits, labels), abs=1e-9)
    assert meter._confidences == []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_worker(rank, world_size, port, shards, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        meter = CalibrationMeter(n_bins=15)
        others = {"smooth": metrics.SmoothECEMeter(), "top-label": metrics.DebiasedECEMeter(),
                  "marginal": metrics.DebiasedECEMeter(mode="marginal")}
        logits, labels = shards[rank]
        for chunk_logits, chunk_labels in zip(logits.split(50), labels.split(50)):
            meter.update(chunk_logits, chunk_labels)
            for other in others.values():
                other.update(chunk_logits, chunk_labels)
        merged = meter.compute()
        local = meter.compute(sync=False) if meter.num_samples else None
        merged_others = {"smooth": others["smooth"].compute(return_bandwidth=True),
                         **{mode: others[mode].compute() for mode in ("top-label", "marginal")}}
        torch.save({"merged": merged, "local": local, "others": merged_others}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_meter_merges_across_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    logits, labels = _overconfident_logits(330, 5)
    # Unequal shards with different data on each rank.
    shards = [(logits[:130].clone(), labels[:130].clone()), (logits[130:].clone(), labels[130:].clone())]
    mp.spawn(_ddp_worker, args=(2, _free_port(), shards, str(tmp_path)), nprocs=2, join=True)
    expected = metrics.calibration_metrics(logits, labels)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for key in metrics.METRIC_KEYS:
            assert result["merged"][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), (rank, key)
    value, sigma = metrics.smooth_ece(logits, labels, return_bandwidth=True)
    for rank in range(2):  # the smooth ECE and debiased meters (tests/test_metrics_streaming_smooth.py) merge exactly
        others = torch.load(tmp_path / f"rank{rank}.pt")["others"]
        assert others["smooth"][1] == sigma and others["smooth"][0] == pytest.approx(value, rel=1e-12)
        for mode in ("top-label", "marginal"):
            assert others[mode] == pytest.approx(metrics.debiased_ece(logits, labels, mode=mode), rel=1e-12), mode
    rank0_alone = metrics.calibration_metrics(*shards[0])
    assert torch.load(tmp_path / "rank0.pt")["local"]["ece"] == pytest.approx(rank0_alone["ece"], abs=1e-9)


# ------------------------------------------------------------------------------------------------ reliability diagram
def test_reliability_diagram_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    logits, labels = _overconfident_logits(300, 5)
    path = tmp_path / "reliability.png"
    figure = metrics.reliability_diagram(logits, labels, path=path, title="synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000
    reliability_axes = figure.axes[0]
    assert f"{100 * metrics.ece(logits, labels):.2f}%" in reliability_axes.get_title()
    assert "synthetic" in reliability_axes.get_title()

    from matplotlib.figure import Figure

    host = Figure()
    ax = host.add_subplot()
    assert metrics.reliability_diagram(logits, labels, ax=ax, n_bins=10) is host
    assert "ECE" in ax.get_title()


def test_reliability_bins_match_brute_force():
    logits, labels = _overconfident_logits(250, 4)
    probs = torch.softmax(logits, dim=1)
    confidence, correct = _confidence_correct(probs, labels)
    edges = torch.linspace(0, 1, 9)
    stats = metrics.reliability_bins(logits, labels, 8)
    for b in range(8):
        in_bin = confidence.gt(float(edges[b])) & confidence.le(float(edges[b + 1]))
        assert stats["count"][b] == int(in_bin.sum())
        if in_bin.any():
            assert float(stats["accuracy"][b]) == pytest.approx(correct[in_bin].double().mean().item())
            assert float(stats["confidence"][b]) == pytest.approx(confidence[in_bin].double().mean().item())
    assert stats["ece"] == pytest.approx(brute_ece(probs, labels, 8), abs=1e-6)


def test_reliability_diagram_saves_in_the_format_of_the_suffix(tmp_path):
    """A ``.pdf`` or ``.svg`` path gets that format (it had been written as PNG bytes whatever the suffix)."""
    pytest.importorskip("matplotlib")
    logits, labels = _overconfident_logits(100, 4)
    for suffix, magic in ((".pdf", b"%PDF"), (".svg", b"<?xml"), (".png", b"\x89PNG")):
        path = tmp_path / f"reliability{suffix}"
        metrics.reliability_diagram(logits, labels, path=path)
        assert path.read_bytes().startswith(magic), suffix


def test_reliability_diagram_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        metrics.reliability_diagram(torch.randn(10, 3), torch.randint(0, 3, (10,)))
