"""The CUDA kernels' drop-in options (``csrc/cuda/option_rows.cuh``): class weights, the z-loss and soft-capping.

On a GPU machine (skipped otherwise), through the op itself: values and gradients against the reference for every
weight × mode × reduction × target kind (class indices, label smoothing, a mix, a dense target) with each option
alone and all together (float64 against the float64 reference at a few ulps; float32 and bfloat16 within the reference's
own error at their precision, on every kernel shape); ``F.cross_entropy(weight=, label_smoothing=, ignore_index=,
reduction=)`` for ``uncertainty="none"``; the per-row z-loss output; a class-weighted mean whose divisor is 0; a -inf
logit under the cap; the top-label statistics of the capped logits; in place; without a gradient; the target flag;
opcheck and ``torch.compile(fullgraph=True)`` with options.
"""

import pytest
import torch
import torch.nn.functional as F

from calibkernels import _validation as V
from calibkernels import reference as R

from _tolerance import assert_within_reference_error

from _cuda_helpers import MODES, REDUCTIONS, SHAPE_PATHS, needs_gpu, _logits, _targets, _weight_kwargs

_C = pytest.importorskip("calibkernels._C", reason="the compiled extension is not built")

# dual focal takes no options in the fused kernels (the op refuses; Python routes it to the reference)
OPTION_WEIGHTS = ["none", "focal", "flsd", "brier", "external", "brier_flsd"]
OPTIONS = ["class_weight", "z_loss", "softcap", "all"]
TARGET_KINDS = ["hard", "smoothing", "mix", "dense"]


def _options(option, c, dtype=torch.float32):
    class_weight = torch.rand(c, device="cuda", dtype=dtype) + 0.25
    return {
        "class_weight": {"class_weight": class_weight},
        "z_loss": {"lse_square_scale": 0.05},
        "softcap": {"softcap": 4.0},
        "all": {"class_weight": class_weight, "lse_square_scale": 0.05, "softcap": 4.0},
    }[option]


def _target_kwargs(kind, n, c):
    """``target`` and the soft-target arguments of a target kind."""
    if kind == "dense":
        return {"target": torch.softmax(torch.randn(n, c, device="cuda") * 2, dim=1)}
    kw = {"target": _targets(n, c)}
    if kind == "smoothing":
        kw["label_smoothing"] = 0.1
    elif kind == "mix":
        kw["mix_target"] = torch.randint(0, c, (n,), device="cuda")
        kw["mix_lambda"] = torch.rand(n, device="cuda")
    return kw


def _op_outputs(logits, target, *, uncertainty="none", mode="grad", gamma=3.0, norm=2.0, sample_weight=None,
                reduction="mean", ignore_index=-100, compute_grad=True, grad_out=None, mix_target=None, mix_lambda=None,
                label_smoothing=0.0, class_weight=None, lse_square_scale=0.0, softcap=0.0, return_stats=False,
                loss_in_logits_dtype=False):
    """The op's six outputs (loss, grad, target flag, confidence, prediction, z_loss)."""
    return torch.ops.calibkernels.uncertainty_weighted_ce(
        logits, target, sample_weight, None, V.WEIGHT_CODES[uncertainty], V.MODE_CODES[mode], float(gamma),
        float(norm), ignore_index, V.REDUCTION_CODES[reduction], compute_grad, grad_out, mix_target, mix_lambda,
        float(label_smoothing), loss_in_logits_dtype=loss_in_logits_dtype, return_stats=return_stats,
        class_weight=class_weight, lse_square_scale=float(lse_square_scale), softcap=float(softcap))


def _reference(logits, target, *, dtype, sample_weight=None, class_weight=None, softcap=0.0, **kw):
    """The reference's loss and gradient (grad_output = 1) at ``dtype``, with the op's option names."""
    x = logits.detach().to(dtype).clone().requires_grad_()
    if target.is_floating_point():
        target = target.to(dtype)
    sw = None if sample_weight is None else sample_weight.to(dtype)
    loss = R.uncertainty_weighted_ce(x, target, sample_weight=sw, weight=class_weight,
                                     softcap=softcap if softcap != 0.0 else None, **kw)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), x.grad


def _check(logits, target, ulps=64, **kw):
    """The op's loss and gradient against the float64 reference, within the reference's own error at the logits'
    precision (at float64: ``ulps`` ulps of the largest entry)."""
    dtype = logits.dtype
    loss, grad, *_ = _op_outputs(logits, target, **kw)
    assert loss.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert grad.dtype == dtype and grad.shape == logits.shape
    exact_loss, exact_grad = _reference(logits, target, dtype=torch.float64, **kw)
    low_loss, low_grad = _reference(logits, target, dtype=dtype, **kw)
    assert_within_reference_error(loss, exact_loss, low_loss, dtype, "loss", ulps=ulps)
    assert_within_reference_error(grad, exact_grad, low_grad, dtype, "gradient", ulps=ulps)
    return loss, grad


@needs_gpu
@pytest.mark.parametrize("option", OPTIONS)
@pytest.mark.parametrize("kind", TARGET_KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", OPTION_WEIGHTS)
def test_options_match_the_reference_in_float64(uncertainty, mode, kind, option):
    torch.manual_seed(0)
    n, c = 24, 37
    logits = _logits(n, c, torch.float64)
    kw = dict(_weight_kwargs(uncertainty, n), mode=mode, **_options(option, c, torch.float64))
    kw.update(_target_kwargs(kind, n, c))
    target = kw.pop("target")
    for reduction in REDUCTIONS:
        _check(logits, target, reduction=reduction, **kw)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("path", ["warp-scalar", "warp-large-smallest", "warp-max", "block-smallest",
                                  "stream-smallest-now", "stream-scalar"])
@pytest.mark.parametrize("kind", TARGET_KINDS)
def test_options_on_every_kernel_shape(path, kind, dtype):
    torch.manual_seed(1)
    n, c = 12, SHAPE_PATHS[path]
    logits = _logits(n, c, dtype)
    for uncertainty, mode in (("brier", "loss"), ("focal", "grad"), ("none", "grad")):
        kw = dict(_weight_kwargs(uncertainty, n), mode=mode, **_options("all", c))
        kw.update(_target_kwargs(kind, n, c))
        target = kw.pop("target")
        for reduction in REDUCTIONS:
            _check(logits, target, reduction=reduction, **kw)


@needs_gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["hard", "smoothing", "dense"])
def test_uncertainty_none_is_f_cross_entropy_with_its_options(kind, reduction):
    torch.manual_seed(2)
    n, c = 40, 300
    logits = _logits(n, c, torch.float64)
    class_weight = torch.rand(c, device="cuda", dtype=torch.float64) + 0.1
    kw = _target_kwargs(kind, n, c)
    target = kw["target"].to(torch.float64) if kind == "dense" else kw["target"]
    smoothing = kw.get("label_smoothing", 0.0)
    x = logits.clone().requires_grad_()
    expected = F.cross_entropy(x, target, weight=class_weight, label_smoothing=smoothing, ignore_index=-100,
                               reduction=reduction)
    expected.backward(torch.ones_like(expected))
    loss, grad, *_ = _op_outputs(logits, target, reduction=reduction, label_smoothing=smoothing,
                                 class_weight=class_weight)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-12)


@needs_gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_z_loss_is_liger_kernels_on_top_of_f_cross_entropy(reduction):
    torch.manual_seed(3)
    n, c, scale = 33, 500, 1e-2
    logits = _logits(n, c, torch.float64)
    target = _targets(n, c)
    valid = target != -100
    x = logits.clone().requires_grad_()
    z_rows = torch.where(valid, scale * torch.logsumexp(x, dim=1).square(), torch.zeros((), dtype=x.dtype,
                                                                                          device=x.device))
    ce = F.cross_entropy(x, target, reduction=reduction)
    z_part = {"none": z_rows, "sum": z_rows.sum(), "mean": z_rows.sum() / valid.sum()}[reduction]
    expected = ce + z_part
    expected.backward(torch.ones_like(expected))
    loss, grad, *_, z_loss = _op_outputs(logits, target, reduction=reduction, lse_square_scale=scale)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, x.grad, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(z_loss, z_rows.detach(), rtol=1e-12, atol=0.0)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_the_z_loss_output_is_per_row_of_the_capped_logits(dtype):
    torch.manual_seed(4)
    n, c, scale, cap = 20, 1000, 0.1, 3.0
    logits = _logits(n, c, dtype)
    target = _targets(n, c)
    *_, z_loss = _op_outputs(logits, target, lse_square_scale=scale, softcap=cap)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    capped = cap * torch.tanh(logits.to(acc) / cap)
    expected = torch.where(target != -100, scale * torch.logsumexp(capped, dim=1).square(), 0.0)
    assert z_loss.dtype == acc and z_loss.shape == (n,)
    torch.testing.assert_close(z_loss, expected, rtol=1e-5 if acc == torch.float32 else 1e-12, atol=0.0)
    *_, none = _op_outputs(logits, target, softcap=cap)
    assert none.shape == (0,)


@needs_gpu
@pytest.mark.parametrize("kind", ["hard", "mix"])
def test_a_class_weighted_mean_with_a_zero_divisor_is_its_z_loss(kind):
    n, c = 16, 50
    logits = _logits(n, c, torch.float64)
    kw = _target_kwargs(kind, n, c)
    class_weight = torch.zeros(c, device="cuda", dtype=torch.float64)
    loss, grad, *_, z_loss = _op_outputs(logits, class_weight=class_weight, lse_square_scale=0.1, **kw)
    valid = kw["target"] != -100
    torch.testing.assert_close(loss, z_loss.sum() / valid.sum(), rtol=1e-12, atol=0.0)
    _check(logits, class_weight=class_weight, lse_square_scale=0.1, **kw)
    loss, grad, *_ = _op_outputs(logits, class_weight=class_weight, **kw)
    assert loss.item() == 0.0 and not grad.any()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_a_minus_infinite_logit_is_minus_the_cap_with_no_gradient(dtype):
    n, c = 8, 300
    logits = _logits(n, c, dtype)
    logits[:, 5] = -float("inf")
    target = torch.randint(6, c, (n,), device="cuda")
    loss, grad = _check(logits, target, uncertainty="focal", mode="loss", softcap=2.0, reduction="none",
                        lse_square_scale=0.01)
    assert torch.isfinite(loss).all() and (grad[:, 5] == 0).all()


@needs_gpu
def test_return_stats_are_of_the_capped_logits():
    from calibkernels.loss_stats import top_label_stats

    n, c, cap = 30, 1000, 2.0
    logits = _logits(n, c) * 4
    target = _targets(n, c)
    *_, confidence, prediction, _ = _op_outputs(logits, target, softcap=cap, return_stats=True)
    ignored = target == -100
    expected = top_label_stats(cap * torch.tanh(logits / cap), ignored, (n,))
    torch.testing.assert_close(confidence, expected.confidence, rtol=1e-5, atol=0.0, equal_nan=True)
    assert torch.equal(prediction, expected.prediction)


@needs_gpu
@pytest.mark.parametrize("c", [10, 2000, 20000])
@pytest.mark.parametrize("kind", TARGET_KINDS)
def test_options_in_place_and_without_a_gradient(kind, c):
    torch.manual_seed(5)
    n = 10
    logits = _logits(n, c)
    kw = dict(uncertainty="brier", mode="loss", gamma=2.0, **_options("all", c))
    kw.update(_target_kwargs(kind, n, c))
    target = kw.pop("target")
    loss, grad, *_, z_loss = _op_outputs(logits, target, **kw)
    in_place = logits.clone()
    loss_in_place, empty, *_, z_in_place = _op_outputs(in_place, target, grad_out=in_place, **kw)
    assert empty.shape == (0,)
    assert torch.equal(loss_in_place, loss) and torch.equal(in_place, grad) and torch.equal(z_in_place, z_loss)
    loss_only, no_grad, *_ = _op_outputs(logits, target, compute_grad=False, **kw)
    assert no_grad.shape == (0,) and torch.equal(loss_only, loss)


@needs_gpu
def test_options_keep_the_target_flag_and_the_bad_rows_nan():
    n, c = 12, 40
    logits = _logits(n, c)
    target = _targets(n, c, ignore=False)
    target[3] = c + 7
    loss, grad, flag, *_ = _op_outputs(logits, target, reduction="none", lse_square_scale=0.1, softcap=3.0)
    assert flag.tolist() == [1, c + 7]
    others = torch.arange(n, device="cuda") != 3
    assert torch.isnan(loss[3]) and torch.isnan(grad[3]).all() and torch.isfinite(loss[others]).all()
    mix = torch.randint(0, c, (n,), device="cuda")
    mix[5] = -3
    target[3] = 0
    *_, flag, _, _, _ = _op_outputs(logits, target, mix_target=mix, mix_lambda=torch.rand(n, device="cuda"),
                                    class_weight=torch.ones(c, device="cuda"))
    assert flag.tolist() == [2, -3]


@needs_gpu
def test_the_dual_focal_weight_refuses_options():
    logits, target = _logits(4, 10), _targets(4, 10)
    with pytest.raises(RuntimeError, match="dual-focal"):
        _op_outputs(logits, target, uncertainty="dual_focal", softcap=2.0)


@needs_gpu
def test_opcheck_with_options():
    torch.manual_seed(6)
    n, c = 8, 300
    op = torch.ops.calibkernels.uncertainty_weighted_ce.default
    class_weight = torch.rand(c, device="cuda") + 0.5
    options = {"class_weight": class_weight, "lse_square_scale": 0.01, "softcap": 5.0}
    samples = [
        (_logits(n, c), _targets(n, c), None, None, 4, 1, 4.0, 2.0, -100, 1, True),
        (_logits(n, c, torch.bfloat16), _targets(n, c), None, None, 1, 0, 2.0, 2.0, -100, 0, True),
        (_logits(n, 20000), _targets(n, 20000), None, None, 0, 1, 0.0, 2.0, -100, 2, True),
        (_logits(n, c), torch.softmax(_logits(n, c), 1), None, None, 2, 0, 3.0, 2.0, -100, 1, False),
    ]
    for args in samples:
        torch.library.opcheck(op, args + (None,), options)
        logits = args[0].clone()
        torch.library.opcheck(op, (logits,) + args[1:-1] + (True, logits), options)  # in place
        torch.library.opcheck(op, args + (None,), {**options, "loss_in_logits_dtype": True, "return_stats": True})


@needs_gpu
def test_options_compile_fullgraph():
    torch.manual_seed(7)
    n, c = 16, 700
    logits, target = _logits(n, c), _targets(n, c)
    class_weight = torch.rand(c, device="cuda") + 0.5

    def loss_and_grad(z, y, w):
        loss, grad, _, _, _, z_loss = _op_outputs(z, y, uncertainty="focal", mode="loss", class_weight=w,
                                                  lse_square_scale=0.02, softcap=6.0, label_smoothing=0.05)
        return loss, grad, z_loss

    compiled = torch.compile(loss_and_grad, fullgraph=True)
    for got, expected in zip(compiled(logits, target, class_weight), loss_and_grad(logits, target, class_weight)):
        torch.testing.assert_close(got, expected, rtol=0.0, atol=0.0)
