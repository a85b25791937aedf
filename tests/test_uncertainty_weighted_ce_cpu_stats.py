"""The compiled CPU op's top-label statistics (``return_stats=True``: the op's fourth and fifth outputs, written in its
loss pass) against their definition, :func:`calibkernels.loss_stats.top_label_stats`: every target kind and weight
path, ties, masked (-inf) columns, rows without a finite max, ignored rows, each dtype, strided rows, in place (the
statistics of the logits before the gradient overwrites them), with the loss and gradient unchanged; the backend's
``loss_with_autograd`` and ``forward``; opcheck and torch.compile; each instruction-set build in a subprocess.
"""

import math
import os
import subprocess
import sys

import pytest
import torch

from calibkernels import _validation as V
from calibkernels.loss_stats import LossStats, top_label_stats

from _cpu_helpers import _op

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TARGET_KINDS = ["hard", "smoothed", "mixed", "dense"]
# (weight, norm): each row form of the kernel (one-exponential path, two-sweep path with a general norm, dual focal)
WEIGHT_FORMS = [("none", 2.0), ("focal", 2.0), ("brier", 2.0), ("brier", 1.0), ("brier", 1.5), ("external", 2.0),
                ("dual_focal", 2.0), ("flsd", 2.0)]


def _logits(n, c, dtype=torch.float32, scale=3.0):
    """Logits with the rows the statistics must get right: a tie for the max, masked (-inf) columns, a column far
    above the target (the kernel's target-referenced sums fall back to the row max), a row of equal logits."""
    z = torch.randn(n, c, dtype=torch.float64) * scale
    if c >= 4 and n >= 4:
        z[0, 1] = z[0, 3] = z[0].max() + 1  # tie: the lower index
        z[1, : c // 2] = -math.inf
        z[2, c - 1] = z[2].max() + 60
        z[3] = 0.5  # all tied: index 0
    return z.to(dtype)


def _targets(z, kind, ignored=True):
    """(target, mix_target, mix_lambda, label_smoothing) of a target kind; class-index targets ignore a row and
    avoid the masked columns of row 1 (a -inf target logit makes the loss inf there)."""
    n, c = z.shape
    y = torch.randint(c // 2, c, (n,)) if c >= 2 else torch.zeros(n, dtype=torch.int64)
    if ignored and n > 5:
        y[5] = -100
    if kind == "dense":
        return torch.softmax(torch.randn(n, c, dtype=torch.float64), 1).to(z.dtype), None, None, 0.0
    if kind == "smoothed":
        return y, None, None, 0.1
    if kind == "mixed":
        mix = torch.randint(c // 2, c, (n,)) if c >= 2 else torch.zeros(n, dtype=torch.int64)
        return y, mix, torch.rand(n), 0.0
    return y, None, None, 0.0


def _call(z, target, mix=None, lam=None, smoothing=0.0, *, weight="none", norm=2.0, mode="grad", reduction="mean",
          compute_grad=True, grad_out=None, return_stats=True):
    sample_weight = torch.rand(z.shape[0], dtype=torch.float32) + 0.5 if weight == "external" else None
    # the first five outputs: the sixth, the rows' z-loss, is empty without lse_square_scale
    return _op().uncertainty_weighted_ce(z, target, sample_weight, None, V.WEIGHT_CODES[weight], V.MODE_CODES[mode],
                                         2.0, norm, -100, V.REDUCTION_CODES[reduction], compute_grad, grad_out, mix,
                                         lam, smoothing, False, return_stats)[:5]


def _expected(z, target):
    ignored = None if target.is_floating_point() else target == -100
    return top_label_stats(z, ignored, (z.shape[0],))


def _assert_stats(confidence, prediction, z, target):
    want = _expected(z, target)
    assert confidence.dtype == torch.float32 and prediction.dtype == torch.int64
    assert confidence.shape == prediction.shape == (z.shape[0],)
    assert not confidence.requires_grad and not prediction.requires_grad
    assert torch.equal(prediction, want.prediction)
    # the kernel's normaliser is referenced to the target logit where it can be: a few ulps apart from the oracle's
    rtol = 1e-12 if z.dtype == torch.float64 else 1e-5
    torch.testing.assert_close(confidence, want.confidence, rtol=rtol, atol=0, equal_nan=True)


def _assert_same(*pairs):
    """Bit for bit (NaN where NaN: a masked column under a dense target makes that row's loss non-finite)."""
    for got, want in pairs:
        torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", TARGET_KINDS)
@pytest.mark.parametrize("weight,norm", WEIGHT_FORMS)
def test_stats_match_the_oracle_and_leave_loss_and_gradient_unchanged(weight, norm, kind, dtype):
    if weight == "dual_focal" and kind != "hard":
        pytest.skip("the dual-focal weight has no soft-target form")
    for n, c in [(9, 7), (6, 33), (5, 1000)]:
        z = _logits(n, c, dtype)
        target, mix, lam, smoothing = _targets(z, kind)
        torch.manual_seed(1)  # the external weight's sample weights alike in both calls
        loss, grad, _, confidence, prediction = _call(z, target, mix, lam, smoothing, weight=weight, norm=norm,
                                                      reduction="none")
        _assert_stats(confidence, prediction, z, target)
        torch.manual_seed(1)
        plain_loss, plain_grad, _, no_conf, no_pred = _call(z, target, mix, lam, smoothing, weight=weight, norm=norm,
                                                            reduction="none", return_stats=False)
        assert no_conf.shape == no_pred.shape == (0,)
        _assert_same((loss, plain_loss), (grad, plain_grad))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", TARGET_KINDS)
def test_rows_without_a_finite_max_follow_the_oracle(kind, dtype):
    """NaN confidence for a row holding NaN or +inf or only -inf; the prediction torch.argmax's (the first NaN, the
    first +inf, 0)."""
    z = _logits(8, 6, dtype)
    z[4] = -math.inf
    z[6, 2] = z[6, 4] = math.nan
    z[7, 1] = z[7, 3] = math.inf
    target, mix, lam, smoothing = _targets(z, kind, ignored=False)
    _, _, _, confidence, prediction = _call(z, target, mix, lam, smoothing, reduction="none", compute_grad=False)
    _assert_stats(confidence, prediction, z, target)
    assert prediction[4] == 0 and prediction[6] == 2 and prediction[7] == 1
    assert confidence[4:].isnan().tolist() == [True, False, True, True]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", TARGET_KINDS)
def test_in_place_stats_are_those_of_the_logits_before_the_gradient(kind, dtype):
    z = _logits(12, 40, dtype)
    target, mix, lam, smoothing = _targets(z, kind)
    loss, grad, *_ = _call(z, target, mix, lam, smoothing, weight="brier", return_stats=False)
    buffer = z.clone()
    in_place_loss, empty, _, confidence, prediction = _call(buffer, target, mix, lam, smoothing, weight="brier",
                                                            grad_out=buffer)
    assert empty.shape == (0,)
    _assert_stats(confidence, prediction, z, target)
    _assert_same((in_place_loss, loss), (buffer, grad))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("layout", ["strided rows", "strided columns"])
def test_strided_logits(layout, dtype):
    wide = _logits(10, 64, dtype)
    z = wide[:, 5:30] if layout == "strided rows" else wide[:, ::2]
    y = torch.randint(0, z.shape[1], (10,))
    y[3] = -100
    loss, grad, _, confidence, prediction = _call(z, y, weight="focal", mode="loss")
    _assert_stats(confidence, prediction, z, y)
    plain_loss, plain_grad, *_ = _call(z.contiguous(), y, weight="focal", mode="loss", return_stats=False)
    _assert_same((loss, plain_loss), (grad, plain_grad))


@pytest.mark.parametrize("kind", TARGET_KINDS)
def test_streamed_gradient_rows(kind, monkeypatch):
    """The AVX-512 path's streaming-store form of the float rows (forced on: a testing hook of the kernel)."""
    monkeypatch.setenv("CALIBKERNELS_CPU_STREAMING_STORES", "1")
    z = _logits(16, 300)
    target, mix, lam, smoothing = _targets(z, kind)
    loss, grad, _, confidence, prediction = _call(z, target, mix, lam, smoothing)
    _assert_stats(confidence, prediction, z, target)
    plain_loss, plain_grad, *_ = _call(z, target, mix, lam, smoothing, return_stats=False)
    _assert_same((loss, plain_loss), (grad, plain_grad))


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_every_reduction_and_an_empty_batch(reduction):
    z = _logits(7, 5)
    y = torch.tensor([0, 1, -100, 3, 4, -100, 2])
    _, _, _, confidence, prediction = _call(z, y, reduction=reduction, compute_grad=False)
    _assert_stats(confidence, prediction, z, y)
    assert prediction[2] == prediction[5] == -1 and confidence[2].isnan() and confidence[5].isnan()
    empty = torch.empty(0, 5)
    _, _, _, confidence, prediction = _call(empty, torch.empty(0, dtype=torch.int64), reduction=reduction)
    assert confidence.shape == prediction.shape == (0,)


def test_loss_with_autograd_returns_the_kernels_stats():
    from calibkernels.cpp import uncertainty_weighted_ce as backend

    z = _logits(9, 11)
    y = torch.randint(0, 11, (9,))
    y[2] = -100
    codes = (V.WEIGHT_CODES["brier"], V.MODE_CODES["grad"], 2.0, 2.0, -100, V.REDUCTION_CODES["mean"])
    leaf = z.clone().requires_grad_()
    loss, flag, stats = backend.loss_with_autograd(leaf, y, None, None, *codes, False, return_stats=True)
    assert isinstance(stats, LossStats) and flag is None
    _assert_stats(stats.confidence, stats.prediction, z, y)
    loss.backward()
    plain = z.clone().requires_grad_()
    plain_loss, _, no_stats = backend.loss_with_autograd(plain, y, None, None, *codes, False)
    assert no_stats is None
    plain_loss.backward()
    _assert_same((loss, plain_loss), (leaf.grad, plain.grad))
    assert backend.loss_with_autograd(z, y, None, None, *codes, False, return_stats=False)[2] is None

    # in place: the statistics of the logits before the gradient overwrote them
    weights = z.clone().requires_grad_()
    activations = weights * 1
    loss, _, stats = backend.loss_with_autograd(activations, y, None, None, *codes, True, return_stats=True)
    _assert_stats(stats.confidence, stats.prediction, z, y)
    loss.backward()
    _assert_same((weights.grad, plain.grad))


def test_forward_below_autograd_returns_the_kernels_stats():
    from calibkernels.cpp import uncertainty_weighted_ce as backend

    z = _logits(6, 8)
    y = torch.softmax(torch.randn(6, 8), 1)
    codes = (V.WEIGHT_CODES["focal"], V.MODE_CODES["loss"], 2.0, 2.0, -100, V.REDUCTION_CODES["sum"])
    loss, grad, flag, stats = backend.forward(z, y, None, None, *codes, True, None, return_stats=True)
    _assert_stats(stats.confidence, stats.prediction, z, y)
    assert len(backend.forward(z, y, None, None, *codes, True, None)) == 3
    assert backend.forward(z, y, None, None, *codes, True, None, return_stats=False)[3] is None


def test_opcheck_with_stats():
    op = _op().uncertainty_weighted_ce.default
    z = _logits(6, 5)
    # no ignored row: opcheck compares outputs with assert_close, which takes their NaN confidence as a mismatch
    y = torch.tensor([0, 1, 2, 2, 4, 3])
    args = (z, y, None, None, V.WEIGHT_CODES["brier"], 1, 2.0, 2.0, -100, 1)
    torch.library.opcheck(op, args + (True, None), {"return_stats": True})
    torch.library.opcheck(op, args + (False, None, None, None, 0.1), {"return_stats": True})
    buffer = z.clone()
    torch.library.opcheck(op, (buffer,) + args[1:] + (True, buffer), {"return_stats": True},
                          test_utils=("test_schema", "test_faketensor"))


def test_torch_compile_fullgraph_with_stats():
    op = _op().uncertainty_weighted_ce

    def loss_and_stats(z, y):
        loss, _, _, confidence, prediction, _ = op(z, y, None, None, V.WEIGHT_CODES["focal"], 1, 2.0, 2.0, -100, 1,
                                                z.requires_grad, None, return_stats=True)
        return loss, confidence, prediction

    compiled = torch.compile(loss_and_stats, fullgraph=True, backend="aot_eager")
    z = _logits(10, 7)
    y = torch.randint(0, 7, (10,))
    y[4] = -100
    leaf = z.clone().requires_grad_()
    loss, confidence, prediction = compiled(leaf, y)
    _assert_stats(confidence, prediction, z, y)
    loss.backward()
    eager = z.clone().requires_grad_()
    eager_loss, *_ = loss_and_stats(eager, y)
    eager_loss.backward()
    torch.testing.assert_close(loss, eager_loss, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, eager.grad, rtol=0, atol=0)


@pytest.mark.parametrize("isa", ["avx2", "default"])
def test_every_isa_in_a_subprocess(isa):
    """This process runs the widest path the CPU has; the narrower builds run this file's kernel tests in a child
    process (CALIBKERNELS_CPU_ISA)."""
    env = dict(os.environ, CALIBKERNELS_CPU_ISA=isa)
    probe = subprocess.run([sys.executable, "-c", "import calibkernels._C as c; print(c.CPU_ISA)"], env=env,
                           capture_output=True, text=True, check=True)
    if probe.stdout.strip() != isa:
        pytest.skip(f"this CPU (or ATen) does not run the {isa} path")
    here = os.path.dirname(os.path.abspath(__file__))
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", os.path.abspath(__file__),
         "-k", "oracle or finite_max or in_place or strided or streamed"],
        env=env, cwd=os.path.dirname(here), capture_output=True, text=True)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
