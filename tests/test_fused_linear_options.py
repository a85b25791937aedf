"""The drop-in options of the fused linear loss (class weights, z-loss, soft-capping) against the reference on
materialised logits, and against ``F.cross_entropy(weight=...)`` for ``uncertainty="none"``.

Each backend this install runs that computes the options in its kernel (``OPTIONS_IN_KERNEL``), and the reference
per chunk; chunk sizes that split the batch unevenly, so that every option meets a chunk boundary; the "mean"
divisors (class-weighted targets, the z-loss over the rows) across chunks.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import _backends
from calibkernels.fused_linear import fused_linear_uncertainty_weighted_ce as fused_linear

from _tolerance import assert_within_largest_entry
from conftest import FUSED_BACKENDS


def _option_backends():
    """The reference, and each fused backend whose kernel computes the options (float64 where it runs it)."""
    names = [("reference", "cpu")] + [(b.name, b.device) for b in FUSED_BACKENDS
                                      if getattr(_backends.module(b.name), "OPTIONS_IN_KERNEL", False)]
    return [pytest.param(pair, id=f"{pair[0]}-{pair[1]}") for pair in names]


OPTIONS = {
    "class weights": dict(weight=True),
    "z-loss": dict(lse_square_scale=0.03, return_z_loss=True),
    "softcap": dict(softcap=2.5),
    "all, smoothed": dict(weight=True, lse_square_scale=0.03, return_z_loss=True, softcap=2.5, label_smoothing=0.1),
}


def _problem(n, h, c, device, dtype):
    hidden = torch.randn(n, h, dtype=torch.float64)
    linear_weight = torch.randn(c, h, dtype=torch.float64) / h ** 0.5 * 2
    bias = 0.5 * torch.randn(c, dtype=torch.float64)
    target = torch.randint(0, c, (n,))
    target[[1, 6]] = -100
    class_weight = torch.rand(c, dtype=torch.float64) + 0.25
    return [t.to(device=device, dtype=dtype) for t in (hidden, linear_weight, bias)] + [target.to(device),
                                                                                       class_weight.to(device)]


def _call_options(options, class_weight):
    kwargs = dict(options)
    if kwargs.pop("weight", False):
        kwargs["weight"] = class_weight
    return kwargs


def _reference(hidden, linear_weight, bias, target, grad_output, **kwargs):
    """The reference on the materialised float64 logits: loss (and z-loss), gradients of hidden, weight, bias."""
    leaves = [t.detach().double().cpu().requires_grad_() for t in (hidden, linear_weight, bias)]
    if kwargs.get("weight") is not None:
        kwargs["weight"] = kwargs["weight"].double().cpu()
    out = ck.uncertainty_weighted_ce(leaves[0] @ leaves[1].T + leaves[2], target.cpu(), backend="reference",
                                     **kwargs)
    loss, *rest = out if isinstance(out, tuple) else (out,)
    return (loss.detach(), *rest), torch.autograd.grad(loss, leaves, grad_output.double().cpu())


@pytest.mark.parametrize("backend", _option_backends())
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("uncertainty,mode", [("none", "grad"), ("brier", "grad"), ("focal", "loss")])
def test_options_match_the_reference_across_chunks(backend, option, reduction, uncertainty, mode):
    name, device = backend
    dtype = torch.float32 if name == "triton" else torch.float64
    n, h, c = (13, 8, 11) if name == "triton" else (29, 12, 23)
    hidden, linear_weight, bias, target, class_weight = _problem(n, h, c, device, dtype)
    kwargs = dict(_call_options(OPTIONS[option], class_weight), uncertainty=uncertainty, mode=mode,
                  reduction=reduction)
    leaves = [t.detach().requires_grad_() for t in (hidden, linear_weight, bias)]
    out = fused_linear(leaves[0], leaves[1], target, leaves[2], backend=name, chunk_size=5, **kwargs)
    loss, *rest = out if isinstance(out, tuple) else (out,)
    grad_output = torch.rand_like(loss) + 0.5
    grads = torch.autograd.grad(loss, leaves, grad_output)
    (want_loss, *want_rest), want_grads = _reference(hidden, linear_weight, bias, target, grad_output, **kwargs)
    what = f"{name} {option} {uncertainty} {mode} {reduction}"
    check = (lambda got, want, w: torch.testing.assert_close(got.double().cpu(), want, rtol=1e-10, atol=1e-12,
                                                             msg=w)) if dtype == torch.float64 else (
        lambda got, want, w: assert_within_largest_entry(got, want, dtype, w))
    check(loss, want_loss, f"{what}: loss")
    for got, want, part in zip(rest, want_rest, ["z_loss"]):
        check(got, want.detach(), f"{what}: {part}")
    for got, want, part in zip(grads, want_grads, ["hidden", "weight", "bias"]):
        check(got, want, f"{what}: d {part}")


@pytest.mark.parametrize("backend", _option_backends())
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_class_weights_match_f_cross_entropy(backend, reduction):
    """``uncertainty="none"`` with class weights and label smoothing is F.cross_entropy on the logits."""
    name, device = backend
    dtype = torch.float32 if name == "triton" else torch.float64
    hidden, linear_weight, bias, target, class_weight = _problem(21, 8, 9, device, dtype)
    class_weight = class_weight.to(dtype)
    got = fused_linear(hidden, linear_weight, target, bias, uncertainty="none", weight=class_weight,
                       label_smoothing=0.05, reduction=reduction, backend=name, chunk_size=4)
    want = F.cross_entropy(hidden @ linear_weight.T + bias, target, weight=class_weight, label_smoothing=0.05,
                           reduction=reduction)
    torch.testing.assert_close(got, want, rtol=1e-5 if dtype == torch.float32 else 1e-10, atol=1e-6)


def test_a_zero_class_weight_sum_leaves_the_z_loss():
    """Every target class weighted 0: the class-weighted part is 0 (not NaN) and the z-loss is still the mean over
    the rows, gradients included."""
    torch.manual_seed(3)
    hidden, linear_weight, bias, target, _ = _problem(17, 6, 7, "cpu", torch.float64)
    class_weight = torch.ones(7, dtype=torch.float64)
    class_weight[target[target != -100].unique()] = 0.0
    leaves = [t.detach().requires_grad_() for t in (hidden, linear_weight, bias)]
    loss, z_loss = fused_linear(leaves[0], leaves[1], target, leaves[2], weight=class_weight, lse_square_scale=0.1,
                                return_z_loss=True, backend="reference", chunk_size=4)
    torch.testing.assert_close(loss, z_loss)
    valid = target != -100
    logits = leaves[0] @ leaves[1].T + leaves[2]
    want = 0.1 * torch.logsumexp(logits, 1)[valid].square().mean()
    torch.testing.assert_close(loss, want)
    torch.testing.assert_close(torch.autograd.grad(loss, leaves), torch.autograd.grad(want, leaves))


def test_return_z_loss_and_stats_come_in_order():
    """``(loss, z_loss, stats)``, the statistics of the capped logits."""
    hidden, linear_weight, bias, target, _ = _problem(11, 6, 5, "cpu", torch.float64)
    loss, z_loss, stats = fused_linear(hidden, linear_weight, target, bias, lse_square_scale=1e-2,
                                       return_z_loss=True, softcap=1.5, return_stats=True, backend="reference",
                                       chunk_size=3)
    capped = 1.5 * torch.tanh((hidden @ linear_weight.T + bias) / 1.5)
    confidence, prediction = torch.softmax(capped, 1).max(1)
    valid = target != -100
    torch.testing.assert_close(stats.confidence[valid], confidence[valid].float())
    assert torch.equal(stats.prediction[valid], prediction[valid])
    assert z_loss.shape == () and z_loss.requires_grad is False and loss.shape == ()


@pytest.mark.parametrize("kwargs,error,match", [
    (dict(weight=torch.ones(4)), ValueError, "shape"),
    (dict(weight=-torch.ones(5, dtype=torch.float64)), ValueError, "finite and >= 0"),
    (dict(weight=torch.ones(5, dtype=torch.int64)), TypeError, "floating"),
    (dict(lse_square_scale=-1.0), ValueError, "lse_square_scale"),
    (dict(softcap=0.0), ValueError, "softcap"),
    (dict(return_z_loss=1), TypeError, "return_z_loss"),
])
def test_bad_options_raise(kwargs, error, match):
    hidden, linear_weight, bias, target, _ = _problem(8, 4, 5, "cpu", torch.float64)
    with pytest.raises(error, match=match):
        fused_linear(hidden, linear_weight, target, bias, backend="reference", **kwargs)


def test_a_fused_backend_without_the_options_refuses_them_by_name():
    """A named backend whose kernel lacks the options raises NotImplementedError; "auto" runs the reference with
    a RuntimeWarning. (Dual focal takes no options in the kernels.)"""
    hidden, linear_weight, bias, target, class_weight = _problem(8, 4, 5, "cpu", torch.float64)
    if "cpu" not in ck.available_backends():
        pytest.skip("no compiled CPU kernel in this install")
    with pytest.raises(NotImplementedError, match="per-class weights"):
        fused_linear(hidden, linear_weight, target, bias, uncertainty="dual_focal", weight=class_weight,
                     backend="cpu")
    _backends._warned_reference_only.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = fused_linear(hidden, linear_weight, target, bias, uncertainty="dual_focal", weight=class_weight)
    assert any("per-class weights" in str(w.message) for w in caught)
    want = ck.uncertainty_weighted_ce(hidden @ linear_weight.T + bias, target, uncertainty="dual_focal",
                                      weight=class_weight, backend="reference")
    torch.testing.assert_close(got, want)
