"""The compiled CPU op with the drop-in options (class weights ``weight=``, the z-loss ``lse_square_scale``,
soft-capping ``softcap``; docs/losses.md, "Coming from F.cross_entropy / Liger-Kernel") against the reference: every
uncertainty weight but dual focal, both modes, every reduction, class indices with ignored rows, label smoothing, a
mix and a dense target, each option alone and all together; F.cross_entropy for ``uncertainty="none"``; the returned
z-loss; in place; -inf logits under the cap; opcheck and torch.compile.
"""

import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import _validation as V

from _tolerance import assert_within_largest_entry

pytestmark = pytest.mark.skipif("cpu" not in ck.available_backends(), reason="the CPU extension is not built")

WEIGHTS = ["none", "focal", "flsd", "brier", "external", "brier_flsd"]
TARGETS = ["indices", "smoothing", "mix", "dense"]
OPTIONS = {
    "class_weight": dict(weight=True),
    "z_loss": dict(lse_square_scale=1e-2),
    "softcap": dict(softcap=4.0),
    "all": dict(weight=True, lse_square_scale=1e-2, softcap=4.0),
}


def _problem(n, c, target_form, dtype, seed):
    """Logits, target and the soft-target keywords of one case (class indices with two ignored rows)."""
    generator = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, c, generator=generator, dtype=torch.float64) * 3).to(dtype)
    y = torch.randint(0, c, (n,), generator=generator)
    y[torch.randperm(n, generator=generator)[:2]] = -100
    kwargs = {}
    if target_form == "smoothing":
        kwargs["label_smoothing"] = 0.1
    elif target_form == "mix":
        kwargs["mix_target"] = torch.randint(0, c, (n,), generator=generator)
        kwargs["mix_lambda"] = torch.rand(n, generator=generator, dtype=torch.float64).to(
            torch.float64 if dtype == torch.float64 else torch.float32)
        kwargs["label_smoothing"] = 0.05
    elif target_form == "dense":
        y = torch.softmax(torch.randn(n, c, generator=generator, dtype=torch.float64) * 2, dim=1)
        y = y.to(torch.float64 if dtype == torch.float64 else torch.float32)
    class_weight = torch.rand(c, generator=generator, dtype=torch.float64) + 0.25
    sample_weight = torch.rand(n, generator=generator, dtype=torch.float64) + 0.5
    return z, y, kwargs, class_weight, sample_weight


def _options(option, class_weight, dtype):
    keywords = dict(OPTIONS[option])
    if keywords.pop("weight", False):
        keywords["weight"] = class_weight.to(torch.float64 if dtype == torch.float64 else torch.float32)
    return keywords


def _loss_and_grad(z, y, backend, **kwargs):
    leaf = z.clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(leaf, y, backend=backend, **kwargs)
    (grad,) = torch.autograd.grad(loss.sum(), leaf)
    return loss.detach(), grad


def _case_keywords(uncertainty, mode, reduction, sample_weight):
    keywords = dict(uncertainty=uncertainty, mode=mode, reduction=reduction, gamma=2.0)
    if uncertainty == "external":
        keywords["sample_weight"] = sample_weight
    return keywords


@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("target_form", TARGETS)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_float64_matches_the_reference(uncertainty, target_form, option):
    """Values and gradients in float64, tight, for both modes and every reduction."""
    z, y, soft, class_weight, sample_weight = _problem(9, 11, target_form, torch.float64, seed=3)
    for mode in ("grad", "loss"):
        for reduction in ("mean", "sum", "none"):
            keywords = dict(_case_keywords(uncertainty, mode, reduction, sample_weight), **soft,
                            **_options(option, class_weight, torch.float64))
            loss, grad = _loss_and_grad(z, y, "cpu", **keywords)
            want_loss, want_grad = _loss_and_grad(z, y, "reference", **keywords)
            what = f"{mode}/{reduction}"
            torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what} loss: {m}")
            torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12, msg=lambda m: f"{what} grad: {m}")


@pytest.mark.parametrize("norm", [1.0, 1.5, 3.0])
@pytest.mark.parametrize("target_form", TARGETS)
def test_float64_brier_norms(norm, target_form):
    """The gBS weight with norms other than 2 (its general sweep), every option, loss mode."""
    z, y, soft, class_weight, _ = _problem(8, 9, target_form, torch.float64, seed=5)
    keywords = dict(uncertainty="brier", mode="loss", norm=norm, gamma=3.0, **soft,
                    **_options("all", class_weight, torch.float64))
    loss, grad = _loss_and_grad(z, y, "cpu", **keywords)
    want_loss, want_grad = _loss_and_grad(z, y, "reference", **keywords)
    torch.testing.assert_close(loss, want_loss, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, want_grad, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("target_form", TARGETS)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_lower_precisions_match_the_float64_reference(uncertainty, target_form, dtype):
    """float32 and 16-bit logits (accumulated in float32) against the float64 reference of the same values, with
    every option and with each alone, relative to the largest entry."""
    z, y, soft, class_weight, sample_weight = _problem(13, 37, target_form, dtype, seed=7)
    exact_y = y.double() if y.is_floating_point() else y
    exact_soft = {k: (v.double() if k == "mix_lambda" else v) for k, v in soft.items()}
    for option in OPTIONS:
        for mode, reduction in (("grad", "mean"), ("loss", "none")):
            keywords = dict(_case_keywords(uncertainty, mode, reduction, sample_weight.to(torch.float32)),
                            **_options(option, class_weight, dtype))
            loss, grad = _loss_and_grad(z, y, "cpu", **keywords, **soft)
            exact = dict(keywords, **exact_soft)
            if "weight" in exact:
                exact["weight"] = class_weight
            if "sample_weight" in exact:
                exact["sample_weight"] = sample_weight.to(torch.float32).double()
            want_loss, want_grad = _loss_and_grad(z.double(), exact_y, "reference", **exact)
            what = f"{option}/{mode}/{reduction}"
            assert grad.dtype == dtype
            loss_tolerance = torch.float32 if dtype == torch.float32 else dtype
            assert_within_largest_entry(loss.double(), want_loss, loss_tolerance, f"{what} loss")
            assert_within_largest_entry(grad.double(), want_grad, dtype, f"{what} grad")


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_matches_f_cross_entropy(reduction, label_smoothing):
    """uncertainty="none" with class weights is F.cross_entropy(weight=, label_smoothing=, ignore_index=)."""
    generator = torch.Generator().manual_seed(11)
    z = torch.randn(10, 6, generator=generator, dtype=torch.float64) * 2
    y = torch.randint(0, 6, (10,), generator=generator)
    y[[2, 7]] = 5
    class_weight = torch.rand(6, generator=generator, dtype=torch.float64) + 0.5
    keywords = dict(reduction=reduction, label_smoothing=label_smoothing)
    loss, grad = _loss_and_grad(z, y, "cpu", uncertainty="none", weight=class_weight, ignore_index=5, **keywords)
    leaf = z.clone().requires_grad_()
    expected = F.cross_entropy(leaf, y, weight=class_weight, ignore_index=5, **keywords)
    (expected_grad,) = torch.autograd.grad(expected.sum(), leaf)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)
    dense = torch.softmax(torch.randn(10, 6, generator=generator, dtype=torch.float64), dim=1)
    loss, grad = _loss_and_grad(z, dense, "cpu", uncertainty="none", weight=class_weight, **keywords)
    leaf = z.clone().requires_grad_()
    expected = F.cross_entropy(leaf, dense, weight=class_weight, **keywords)
    (expected_grad,) = torch.autograd.grad(expected.sum(), leaf)
    torch.testing.assert_close(loss, expected.detach(), rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(grad, expected_grad, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_return_z_loss(reduction, dtype):
    """return_z_loss gives the reference's reduced z-loss (of the capped logits, 0 on ignored rows), with the loss."""
    z, y, _, class_weight, _ = _problem(12, 10, "indices", dtype, seed=13)
    keywords = dict(uncertainty="focal", reduction=reduction, lse_square_scale=3e-3, return_z_loss=True,
                    weight=class_weight.to(dtype), softcap=5.0)
    loss, z_loss = ck.uncertainty_weighted_ce(z, y, backend="cpu", **keywords)
    want_loss, want_z_loss = ck.uncertainty_weighted_ce(z, y, backend="reference", **keywords)
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(z_loss, want_z_loss, **tolerance)
    torch.testing.assert_close(loss, want_loss, **tolerance)
    if reduction == "none":
        assert torch.all(z_loss[y == -100] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("target_form", TARGETS)
def test_in_place_and_without_gradient(target_form, dtype):
    """In place (the gradient overwrites the logits) and compute_grad false give the out-of-place call's values."""
    z, y, soft, class_weight, _ = _problem(9, 21, target_form, dtype, seed=17)
    keywords = dict(uncertainty="brier", mode="loss", **soft, **_options("all", class_weight, dtype))
    loss, grad = _loss_and_grad(z, y, "cpu", **keywords)
    leaf = z.clone().requires_grad_()
    logits = leaf * 1.0
    in_place = ck.uncertainty_weighted_ce(logits, y, backend="cpu", inplace=True, **keywords)
    in_place.backward()
    torch.testing.assert_close(in_place.detach(), loss)
    torch.testing.assert_close(leaf.grad, grad)
    # the statistics of the capped logits, taken before the gradient overwrites them
    _, stats = ck.uncertainty_weighted_ce(z.clone().requires_grad_() * 1.0, y, backend="cpu", inplace=True,
                                          return_stats=True, **keywords)
    _, want_stats = ck.uncertainty_weighted_ce(z, y, backend="reference", return_stats=True, **keywords)
    torch.testing.assert_close(stats.confidence, want_stats.confidence, equal_nan=True, rtol=1e-5, atol=1e-6)
    assert torch.equal(stats.prediction, want_stats.prediction)
    with torch.no_grad():
        torch.testing.assert_close(ck.uncertainty_weighted_ce(z, y, backend="cpu", **keywords), loss)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_minus_inf_logits_under_the_cap(dtype):
    """A -inf logit becomes -c under the cap, as in the reference, with a gradient of 0 there; the statistics are
    those of the capped logits."""
    z, y, _, class_weight, _ = _problem(6, 8, "indices", dtype, seed=19)
    z[0, 3] = -float("inf")
    z[1, :5] = -float("inf")
    y[1] = 6
    z[4, 2] = 1e4  # saturates the cap together with the next column: the first of the tie is the prediction
    z[4, 5] = 2e4
    keywords = dict(uncertainty="focal", mode="loss", softcap=3.0, weight=class_weight.to(dtype), lse_square_scale=0.1)
    loss, grad = _loss_and_grad(z, y, "cpu", **keywords)
    want_loss, want_grad = _loss_and_grad(z, y, "reference", **keywords)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(loss, want_loss, **tolerance)
    torch.testing.assert_close(grad, want_grad, **tolerance)
    assert grad[0, 3] == 0 and torch.all(grad[1, :5] == 0)
    _, stats = ck.uncertainty_weighted_ce(z, y, backend="cpu", return_stats=True, **keywords)
    _, want_stats = ck.uncertainty_weighted_ce(z, y, backend="reference", return_stats=True, **keywords)
    torch.testing.assert_close(stats.confidence, want_stats.confidence, equal_nan=True)
    assert torch.equal(stats.prediction, want_stats.prediction)


def test_opcheck_with_each_option():
    """The op under opcheck with each option (gradient returned, none computed, in place), class indices with a
    smoothed mix and a dense target (without return_stats, whose NaN on ignored rows opcheck's comparison refuses)."""
    op = torch.ops.calibkernels.uncertainty_weighted_ce.default
    generator = torch.Generator().manual_seed(23)
    z = torch.randn(6, 7, generator=generator)
    y = torch.tensor([0, 1, -100, 3, 4, 6])
    mix = torch.tensor([1, 1, 0, 2, 2, 0])
    lam = torch.rand(6, generator=generator)
    dense = torch.softmax(torch.randn(6, 7, generator=generator), dim=1)
    class_weight = torch.rand(7, generator=generator) + 0.5
    for options in ((class_weight, 0.0, 0.0), (None, 1e-3, 0.0), (None, 0.0, 5.0), (class_weight, 1e-3, 5.0)):
        for target, head, tail in ((y, (V.WEIGHT_CODES["brier"], 1, 2.0, 2.0, -100, 1), (mix, lam, 0.1)),
                                   (dense, (V.WEIGHT_CODES["focal"], 0, 2.0, 2.0, -100, 0), (None, None, 0.05))):
            torch.library.opcheck(op, (z, target, None, None, *head, True, None, *tail, False, False, *options))
            torch.library.opcheck(op, (z, target, None, None, *head, False, None, *tail, False, False, *options))
            logits = z.clone()
            torch.library.opcheck(op, (logits, target, None, None, *head, True, logits, *tail, False, False, *options))


def test_compiled_call_with_the_options():
    """ck.uncertainty_weighted_ce with every option under torch.compile(fullgraph=True), as eager."""
    generator = torch.Generator().manual_seed(29)
    z = torch.randn(8, 9, generator=generator)
    y = torch.randint(0, 9, (8,), generator=generator)
    y[3] = -100
    class_weight = torch.rand(9, generator=generator) + 0.5

    def step(x, target, weight):
        return ck.uncertainty_weighted_ce(x, target, backend="cpu", uncertainty="focal", weight=weight,
                                          lse_square_scale=1e-3, return_z_loss=True, softcap=4.0, label_smoothing=0.1)

    compiled = torch.compile(step, fullgraph=True)
    x1 = z.clone().requires_grad_()
    x2 = z.clone().requires_grad_()
    got, got_z = compiled(x1, y, class_weight)
    want, want_z = step(x2, y, class_weight)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_z, want_z)
    got.backward()
    want.backward()
    torch.testing.assert_close(x1.grad, x2.grad)
