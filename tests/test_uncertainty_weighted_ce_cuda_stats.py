"""The CUDA kernels' top-label statistics (``return_stats=True``), written by the row launch in each row's first pass:
against :func:`calibkernels.loss_stats.top_label_stats` of the same logits (taken before an in-place gradient
overwrites them; of the soft-capped logits where the call caps them) on every launch shape — warp rows of small and
large C, block rows held in registers, streamed rows of one to many tiles — for the hard-target kernel, the
soft-target kernel (smoothing, a mix, a dense target) and the option kernel (class weights, z-loss, soft-capping),
in every logits dtype. The rows hold the arg-max's hard cases: ties across threads, vectors and tiles (the lowest
index wins), a tie with the target column, -inf columns, a row of only -inf logits (NaN, 0), +inf (NaN, the first
+inf), NaN (NaN, the first NaN), an ignored row (NaN, -1) and rows with a bad target or mix_target, whose statistics
are any row's. The loss and the gradient are bitwise those of the same call without the statistics, in place too.

Skipped without a GPU (the CUDA kernels cannot run); collected everywhere.
"""

import pytest
import torch

from calibkernels import _validation as V
from calibkernels.loss_stats import top_label_stats

from _cuda_helpers import SHAPE_PATHS, needs_gpu

_C = pytest.importorskip("calibkernels._C", reason="the compiled extension is not built")

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.float64]
# one class count per launch shape: warp rows of 8 and 32 values per lane, block rows in registers (float64 streams
# past 1024), streamed rows of one tile and a bit, of many tiles, and of a vector-misaligned width
SHAPES = ["warp-scalar", "warp-small-max", "warp-vector", "block-smallest", "block-max-now", "stream-smallest-now",
          "stream-vector", "stream-scalar"]
KINDS = ["hard", "smoothing", "mix", "dense", "options", "dense-options"]
SOFTCAP = 30.0
N = 16
IGNORED_ROW, BAD_TARGET_ROW, BAD_MIX_ROW, TARGET_TIE_ROW = 9, 10, 11, 7


def _special_logits(c, dtype, n=N):
    """Random logits with the arg-max's hard cases in rows 0-8 (a column index is taken modulo C, so every C has
    them, some merged where C is small)."""
    z = torch.randn(n, c, device="cuda", dtype=torch.float64) * 3

    def col(k):
        return k % c

    z[0, col(1)] = z[0, c - 1] = 50.0  # a tie between the row's first and last vectors (other lanes, other tiles)
    z[1, : c // 2] = float("-inf")  # masked classes before the max
    z[1, col(c // 2 + 3)] = 20.0
    z[2] = float("-inf")  # no finite logit: NaN, 0
    z[3, col(c // 3)] = float("nan")  # the first NaN, a larger logit and a second NaN after it
    z[3, c - 2 if c > 2 else 0] = float("nan")
    z[3, c - 1] = 90.0
    z[4, col(5)] = z[4, c - 1] = float("inf")  # the first +inf, confidence NaN
    z[5, col(6)] = z[5, col(7)] = 40.0  # a tie inside one vector of one lane
    z[6, col(c // 2)] = z[6, col(c // 4)] = z[6, c - 1] = 45.0  # a tie over three lanes: the lowest, c // 4
    z[TARGET_TIE_ROW, col(2)] = z[TARGET_TIE_ROW, c - 1] = 45.0  # the target (c - 1) tied with a lower column
    z[8, col(c // 2 + 1)] = 35.0  # a unique max; the target's there too
    return z.to(dtype)


def _target_kwargs(kind, z):
    """The op's target arguments of a target kind: class indices with an ignored row, a bad target and a tie at the
    target, or a dense target."""
    n, c = z.shape
    if kind in ("dense", "dense-options"):
        return {"target": torch.softmax(torch.randn(n, c, device="cuda"), dim=1).to(z.dtype)}
    y = torch.randint(0, c, (n,), device="cuda")
    y[TARGET_TIE_ROW], y[8] = c - 1, (c // 2 + 1) % c
    y[IGNORED_ROW] = -100
    y[BAD_TARGET_ROW] = c + 5  # not a class: the row's loss is NaN, its statistics those of its logits
    kw = {"target": y}
    if kind == "smoothing":
        kw["label_smoothing"] = 0.1
    elif kind == "mix":
        mix = torch.randint(0, c, (n,), device="cuda")
        mix[BAD_MIX_ROW] = -3
        kw.update(mix_target=mix, mix_lambda=torch.tensor(0.7, device="cuda"))
    return kw


def _option_kwargs(kind, c):
    if kind not in ("options", "dense-options"):
        return {}
    return {"class_weight": torch.rand(c, device="cuda") + 0.25, "lse_square_scale": 1e-4, "softcap": SOFTCAP}


def _op(z, kw, *, grad_out=None, return_stats=False, uncertainty="focal"):
    """The op's (loss, grad, confidence, prediction) with the focal weight in loss mode and a mean."""
    kw = dict(kw)
    target = kw.pop("target")
    loss, grad, _, confidence, prediction, _ = torch.ops.calibkernels.uncertainty_weighted_ce(
        z, target, None, None, V.WEIGHT_CODES[uncertainty], V.MODE_CODES["loss"], 2.0, 2.0, -100,
        V.REDUCTION_CODES["mean"], True, grad_out, return_stats=return_stats, **kw)
    return loss, grad, confidence, prediction


def _expected(z, kw):
    """The oracle's statistics: of the capped logits c · tanh(z / c) where the call caps them, computed as
    calibkernels.loss_stats.loss_stats_of_inputs does; ignored rows those whose target is ignore_index."""
    logits = z.detach().clone()
    if "softcap" in kw:
        compute = torch.float64 if z.dtype == torch.float64 else torch.float32
        logits = kw["softcap"] * torch.tanh(logits.to(compute) / kw["softcap"])
    target = kw["target"]
    ignored = None if target.is_floating_point() else target == -100
    return top_label_stats(logits, ignored, (z.shape[0],))


def _assert_stats(confidence, prediction, expected):
    assert confidence.dtype == torch.float32 and prediction.dtype == torch.int64
    assert confidence.shape == expected.confidence.shape and prediction.shape == expected.prediction.shape
    assert torch.equal(prediction, expected.prediction), (prediction, expected.prediction)
    torch.testing.assert_close(confidence, expected.confidence, rtol=1e-5, atol=0, equal_nan=True)


def _assert_same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@needs_gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", SHAPES)
def test_statistics_on_every_launch_shape(shape, kind, dtype):
    c = SHAPE_PATHS[shape]
    z = _special_logits(c, dtype)
    kw = {**_target_kwargs(kind, z), **_option_kwargs(kind, c)}
    expected = _expected(z, kw)
    loss, grad, confidence, prediction = _op(z, kw, return_stats=True)
    _assert_stats(confidence, prediction, expected)
    assert prediction[0] == 1 % c and prediction[2] == 0 and prediction[TARGET_TIE_ROW] == 2 % c
    if kind not in ("dense", "dense-options"):
        assert prediction[IGNORED_ROW] == -1 and confidence[IGNORED_ROW].isnan()
    # the same call without them: the same loss and gradient, bit for bit, and empty statistics
    plain_loss, plain_grad, no_confidence, no_prediction = _op(z, kw)
    _assert_same(loss, plain_loss)
    _assert_same(grad, plain_grad)
    assert no_confidence.shape == (0,) and no_prediction.shape == (0,)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape", ["warp-scalar", "warp-vector", "block-max-now", "stream-scalar"])
def test_statistics_in_place_are_of_the_logits_before_the_gradient(shape, kind, dtype):
    """grad_out = the logits: every row's statistics are taken before any of its elements is overwritten (the bad
    target rows' too, which their NaN fill overwrites)."""
    c = SHAPE_PATHS[shape]
    z = _special_logits(c, dtype)
    kw = {**_target_kwargs(kind, z), **_option_kwargs(kind, c)}
    expected = _expected(z, kw)
    _, grad, _, _ = _op(z, kw)
    buffer = z.clone()
    _, empty, confidence, prediction = _op(buffer, kw, grad_out=buffer, return_stats=True)
    assert empty.shape == (0,)
    _assert_stats(confidence, prediction, expected)
    _assert_same(buffer, grad)


@needs_gpu
@pytest.mark.parametrize("uncertainty", ["none", "dual_focal", "brier", "flsd"])
@pytest.mark.parametrize("shape", ["warp-scalar", "warp-vector", "block-smallest", "stream-vector"])
def test_statistics_of_hard_targets_whatever_the_weight(shape, uncertainty):
    """The hard-target kernel's row statistics differ by weight (dual focal's tie count, Brier's Σ p^q); the top label
    is the same for all of them."""
    c = SHAPE_PATHS[shape]
    z = _special_logits(c, torch.float32)
    kw = _target_kwargs("hard", z)
    _, _, confidence, prediction = _op(z, kw, return_stats=True, uncertainty=uncertainty)
    _assert_stats(confidence, prediction, _expected(z, kw))


@needs_gpu
@pytest.mark.parametrize("kind", ["hard", "mix", "options"])
def test_statistics_of_a_batch_with_a_count_launch(kind):
    """More than 1024 rows of class indices for a mean with a gradient: the count runs in a launch of its own before
    the rows' (not for the option kernel, which counts with device ops); the statistics come from the row launch."""
    z = _special_logits(10, torch.float16, n=1500)
    kw = {**_target_kwargs(kind, z), **_option_kwargs(kind, 10)}
    _, _, confidence, prediction = _op(z, kw, return_stats=True)
    _assert_stats(confidence, prediction, _expected(z, kw))


@needs_gpu
def test_statistics_of_strided_rows():
    """Rows with a stride larger than C (a column slice) and a misaligned start: the kernels read them in place."""
    wide = _special_logits(1003, torch.float32)
    z = wide[:, 1:1001]
    kw = _target_kwargs("hard", z.contiguous())
    _, _, confidence, prediction = _op(z, kw, return_stats=True)
    _assert_stats(confidence, prediction, _expected(z, kw))
