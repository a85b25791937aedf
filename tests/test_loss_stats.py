"""Top-label statistics of a loss call (calibkernels.loss_stats) and the reference loss's ``return_stats``."""

import math

import pytest
import torch

import calibkernels as ck
from calibkernels import reference
from calibkernels.loss_stats import LossStats, top_label_stats

NEG_INF = -math.inf


def _expected(logits2d, ignored=None):
    """softmax(logits).max(-1) and argmax in float32 (float64 for float64 logits), NaN / -1 on ignored rows."""
    z = logits2d.double() if logits2d.dtype == torch.float64 else logits2d.float()
    confidence = torch.softmax(z, dim=-1).amax(dim=-1).float()
    prediction = z.argmax(dim=-1)
    if ignored is not None:
        confidence = confidence.masked_fill(ignored, math.nan)
        prediction = prediction.masked_fill(ignored, -1)
    return confidence, prediction


def _assert_stats_equal(stats, confidence, prediction, rtol=1e-6):  # a few float32 ulps: summation order
    assert isinstance(stats, LossStats)
    assert stats.confidence.dtype == torch.float32 and stats.prediction.dtype == torch.int64
    assert not stats.confidence.requires_grad and not stats.prediction.requires_grad
    torch.testing.assert_close(stats.confidence, confidence, rtol=rtol, atol=0, equal_nan=True)
    assert torch.equal(stats.prediction, prediction)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_stats_equal_softmax_max_and_argmax(dtype):
    logits = (torch.randn(64, 37) * 4).to(dtype)
    stats = top_label_stats(logits, None, (64,))
    _assert_stats_equal(stats, *_expected(logits))
    assert bool(((stats.confidence >= 1 / 37) & (stats.confidence <= 1)).all())


def test_ties_take_the_lowest_index_as_torch_argmax():
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [5.0, -1.0, 5.0, 5.0], [0.0, 0.0, 0.0, 7.0]])
    stats = top_label_stats(logits, None, (4,))
    assert stats.prediction.tolist() == [1, 0, 0, 3]
    _assert_stats_equal(stats, *_expected(logits))
    assert stats.confidence[1] == 0.25
    # half-precision logits that tie only after rounding to their dtype tie in the statistics too
    half = torch.tensor([[1.0, 1.0001, 0.5]]).half()
    assert half[0, 0] == half[0, 1]
    assert top_label_stats(half, None, (1,)).prediction.tolist() == [0]


def test_masked_classes_and_rows_without_a_distribution():
    logits = torch.tensor([
        [0.0, NEG_INF, 0.0],          # a masked class: confidence 1/2
        [NEG_INF, 3.0, NEG_INF],      # one class left: confidence 1
        [NEG_INF, NEG_INF, NEG_INF],  # no class left: NaN, and torch.argmax's 0
    ])
    stats = top_label_stats(logits, None, (3,))
    assert stats.confidence[:2].tolist() == [0.5, 1.0]
    assert math.isnan(stats.confidence[2])
    assert stats.prediction.tolist() == [0, 1, 0]
    _assert_stats_equal(stats, *_expected(logits))


def test_extreme_logits_stay_finite():
    logits = torch.tensor([[1e4, -1e4, 0.0], [-3e38, -3e38, -3e38], [80.0, 80.0 - 1e-3, -200.0]])
    stats = top_label_stats(logits, None, (3,))
    _assert_stats_equal(stats, *_expected(logits))
    assert stats.confidence[0] == 1.0 and stats.confidence[1] == pytest.approx(1 / 3)


def test_ignored_rows_and_batch_shape():
    logits = torch.randn(2, 5, 11)
    ignored = torch.zeros(10, dtype=torch.bool)
    ignored[[0, 7]] = True
    stats = top_label_stats(logits.reshape(10, 11), ignored, (2, 5))
    assert stats.confidence.shape == stats.prediction.shape == (2, 5)
    confidence, prediction = _expected(logits.reshape(10, 11), ignored)
    _assert_stats_equal(stats, confidence.reshape(2, 5), prediction.reshape(2, 5))
    assert stats.prediction[0, 0] == -1 and math.isnan(stats.confidence[1, 2])


# ------------------------------------------------------------------------------------------ reference loss
@pytest.mark.parametrize("uncertainty", ["brier", "focal", "none", "dual_focal"])
def test_reference_loss_returns_its_stats(uncertainty):
    logits = torch.randn(4, 6, 9, requires_grad=True)  # (N, T, C)
    target = torch.randint(0, 9, (4, 6))
    target[1, 2] = target[3, 0] = -100
    loss, stats = reference.uncertainty_weighted_ce(logits, target, uncertainty=uncertainty, return_stats=True)
    expected_loss = reference.uncertainty_weighted_ce(logits, target, uncertainty=uncertainty)
    assert torch.equal(loss, expected_loss)
    loss.backward()  # the statistics take no part in the graph
    ignored = (target == -100).reshape(-1)
    confidence, prediction = _expected(logits.detach().reshape(-1, 9), ignored)
    _assert_stats_equal(stats, confidence.reshape(4, 6), prediction.reshape(4, 6))
    assert stats.prediction[1, 2] == -1 and math.isnan(stats.confidence[3, 0])


@pytest.mark.parametrize("reduction", ["none", "sum"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_reference_stats_of_half_precision_logits(dtype, reduction):
    logits = (torch.randn(32, 13) * 3).to(dtype)
    target = torch.randint(0, 13, (32,))
    loss, stats = reference.uncertainty_weighted_ce(logits, target, reduction=reduction, return_stats=True)
    assert loss.dtype == dtype
    assert torch.equal(loss, reference.uncertainty_weighted_ce(logits, target, reduction=reduction))
    _assert_stats_equal(stats, *_expected(logits))


def test_reference_stats_with_soft_targets_are_the_logits_own():
    logits = torch.randn(3, 5, 8)
    labels = torch.randint(0, 8, (3, 5))
    labels[0, 1] = -100
    ignored = (labels == -100).reshape(-1)
    confidence, prediction = _expected(logits.reshape(-1, 8), ignored)
    cases = {
        "smoothing": dict(label_smoothing=0.1),
        "mix": dict(mix_target=labels.flip(0).clamp_min(0), mix_lambda=0.7),
    }
    for name, soft in cases.items():
        loss, stats = reference.uncertainty_weighted_ce(logits, labels, return_stats=True, **soft)
        assert torch.equal(loss, reference.uncertainty_weighted_ce(logits, labels, **soft)), name
        _assert_stats_equal(stats, confidence.reshape(3, 5), prediction.reshape(3, 5))
    # probability targets ignore no row
    dense = torch.softmax(torch.randn(3, 5, 8), dim=-1)
    loss, stats = reference.uncertainty_weighted_ce(logits, dense, uncertainty="focal", return_stats=True)
    assert torch.equal(loss, reference.uncertainty_weighted_ce(logits, dense, uncertainty="focal"))
    confidence, prediction = _expected(logits.reshape(-1, 8))
    _assert_stats_equal(stats, confidence.reshape(3, 5), prediction.reshape(3, 5))


def test_reference_stats_from_validated_inputs_and_argument_check():
    from calibkernels._validation import check_loss_inputs

    logits, target = torch.randn(6, 4), torch.tensor([0, 1, -100, 3, 2, 1])
    inputs = check_loss_inputs(logits, target, uncertainty="brier", mode="grad", gamma=4.0, norm=2.0,
                               sample_weight=None, weight=None, reduction="mean", ignore_index=-100)
    loss, stats = reference.uncertainty_weighted_ce_from_inputs(inputs, return_stats=True)
    assert torch.equal(loss, reference.uncertainty_weighted_ce_from_inputs(inputs))
    _assert_stats_equal(stats, *_expected(logits, target == -100))
    with pytest.raises(TypeError, match="return_stats must be a bool"):
        reference.uncertainty_weighted_ce(logits, target, return_stats=1)
    assert ck.LossStats is LossStats
