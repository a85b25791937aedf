"""The reference's drop-in options of ``F.cross_entropy`` and Liger-Kernel: per-class ``weight``, the z-loss
(``lse_square_scale``, ``return_z_loss``) and ``softcap``.

With ``uncertainty="none"`` the reference is checked against ``F.cross_entropy`` itself (values and gradients, every
target kind, smoothing, ``ignore_index`` and reduction); with the other uncertainty weights, ``L_i = u_i · CE_i^w``
by composition; the z-loss and soft-capping against hand-written formulas and float64 ``gradcheck``.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import _backends
from calibkernels import reference as R
from calibkernels._validation import LossInputs, check_loss_inputs

REDUCTIONS = ["none", "mean", "sum"]
N, C = 13, 7


def _batch(dtype=torch.float64, n=N, c=C, scale=3.0):
    """Logits, class indices with two ignored rows, a probability target and positive per-class weights."""
    z = (scale * torch.randn(n, c, dtype=torch.float64)).to(dtype)
    y = torch.randint(0, c, (n,))
    y[1] = y[n // 2 + 1] = -100
    t = torch.softmax(torch.randn(n, c, dtype=torch.float64), dim=1).to(dtype)
    w = (torch.rand(c, dtype=torch.float64) + 0.2).to(dtype)
    return z, y, t, w


def _value_and_grad(loss_fn, z):
    """The loss of ``z`` and the gradient of ``<g, loss>`` for a fixed random ``g`` of the loss's shape."""
    x = z.clone().requires_grad_()
    loss = loss_fn(x)
    g = torch.randn(loss.shape, dtype=torch.float64).to(loss.dtype)
    (loss * g).sum().backward()
    return loss.detach(), x.grad, g


def _assert_close_scaled(got, expected, dtype, what, ulps=4.0):
    """|got - expected| ≤ ulps · eps(dtype) · max|expected| (float64: a few ulps of the magnitude)."""
    got, expected = got.double(), expected.double()
    bound = ulps * torch.finfo(dtype).eps * max(expected.abs().max().item(), 1.0)
    err = (got - expected).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3e} > {bound:.3e}"


# ----------------------------------------------------------------------------------------------------------------
# uncertainty="none" against F.cross_entropy itself
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
@pytest.mark.parametrize("target_kind", ["index", "probabilities"])
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no-weight"])
def test_matches_f_cross_entropy(dtype, reduction, label_smoothing, target_kind, with_weight):
    z, y, t, w = _batch(dtype)
    target = y if target_kind == "index" else t
    weight = w if with_weight else None
    kw = dict(weight=weight, label_smoothing=label_smoothing, reduction=reduction)
    got, got_grad, g = _value_and_grad(lambda x: R.uncertainty_weighted_ce(x, target, uncertainty="none", **kw), z)
    x = z.clone().requires_grad_()
    expected = F.cross_entropy(x, target, **kw)
    (expected * g).sum().backward()
    assert got.dtype == expected.dtype == dtype
    _assert_close_scaled(got, expected, dtype, "loss")
    _assert_close_scaled(got_grad, x.grad, dtype, "gradient")


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_class_weights_with_leading_dimensions(reduction):
    """``(B, T, C)`` logits (class dimension last) against F.cross_entropy on the flattened rows."""
    z, y, _, w = _batch(n=12)
    z3, y3 = z.reshape(3, 4, C), y.reshape(3, 4)
    got = R.uncertainty_weighted_ce(z3, y3, uncertainty="none", weight=w, reduction=reduction, label_smoothing=0.2)
    expected = F.cross_entropy(z, y, weight=w, reduction=reduction, label_smoothing=0.2)
    torch.testing.assert_close(got, expected.reshape(3, 4) if reduction == "none" else expected)


def test_mean_over_an_all_ignored_batch_or_zero_class_weights_is_zero_not_nan():
    z, y, _, w = _batch()
    ignored = torch.full_like(y, -100)
    zero = torch.zeros_like(w)
    for target, weight, smoothing in [(ignored, w, 0.0), (y, zero, 0.0), (y, zero, 0.1)]:
        x = z.clone().requires_grad_()
        loss = R.uncertainty_weighted_ce(x, target, uncertainty="none", weight=weight, label_smoothing=smoothing)
        loss.backward()
        assert loss.item() == 0.0
        assert torch.isfinite(x.grad).all()


def test_a_class_weight_of_another_floating_dtype_is_used_in_the_compute_dtype():
    """F.cross_entropy needs the weight in the logits' dtype; the reference takes any floating weight."""
    z, y, _, w = _batch(torch.float32)
    got = R.uncertainty_weighted_ce(z, y, uncertainty="none", weight=w.double(), label_smoothing=0.1)
    torch.testing.assert_close(got, F.cross_entropy(z, y, weight=w.float(), label_smoothing=0.1))


# ----------------------------------------------------------------------------------------------------------------
# Compact mix with class weights
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_mix_with_class_weights_is_the_weighted_soft_row_and_divisor(reduction, label_smoothing):
    """``CE_i^w = -Σ_k w_k t_ik log p_ik`` of the compact target; ``"mean"`` divides by
    ``Σ (λ w_y + (1 - λ) w_m)`` over the non-ignored rows."""
    z, y, _, w = _batch()
    m = torch.randint(0, C, (N,))
    lam = torch.rand(N, dtype=torch.float64)
    got = R.uncertainty_weighted_ce(z, y, uncertainty="none", weight=w, mix_target=m, mix_lambda=lam,
                                    label_smoothing=label_smoothing, reduction=reduction)
    valid = y != -100
    safe_y = torch.where(valid, y, 0)
    t = lam[:, None] * F.one_hot(safe_y, C) + (1 - lam[:, None]) * F.one_hot(m, C)
    t_smoothed = (1 - label_smoothing) * t + label_smoothing / C
    rows = torch.where(valid, -(w * t_smoothed * torch.log_softmax(z, dim=1)).sum(dim=1), 0.0)
    divisor = torch.where(valid, lam * w[safe_y] + (1 - lam) * w[m], 0.0).sum()
    expected = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / divisor}[reduction]
    torch.testing.assert_close(got, expected)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.1])
def test_mix_with_lambda_zero_or_one_is_f_cross_entropy_of_that_class(label_smoothing):
    """The mix's divisor is linear in λ and equals the class-index divisor at λ = 0 and 1 (tensor λ: the soft path)."""
    z, y, _, w = _batch()
    m = torch.randint(0, C, (N,))
    for lam_value, chosen in [(1.0, y), (0.0, torch.where(y == -100, y, m))]:
        lam = torch.full((N,), lam_value, dtype=torch.float64)
        got = R.uncertainty_weighted_ce(z, y, uncertainty="none", weight=w, mix_target=m, mix_lambda=lam,
                                        label_smoothing=label_smoothing)
        torch.testing.assert_close(got, F.cross_entropy(z, chosen, weight=w, label_smoothing=label_smoothing))


# ----------------------------------------------------------------------------------------------------------------
# Other uncertainty weights: L_i = u_i · CE_i^w, u from the unweighted target
# ----------------------------------------------------------------------------------------------------------------
COMPOSED = ["focal", "flsd", "dual_focal", "brier", "brier_flsd", "external"]


def _targets(kind, y, t):
    if kind == "index":
        return y, {}
    if kind == "smoothed":
        return y, dict(label_smoothing=0.1)
    if kind == "mixed":
        return y, dict(mix_target=y.flip(0).clamp_min(0), mix_lambda=0.7)
    return t, {}


@pytest.mark.parametrize("mode", ["grad", "loss"])
@pytest.mark.parametrize("uncertainty,target_kind", [
    (uncertainty, kind) for uncertainty in COMPOSED for kind in ["index", "smoothed", "mixed", "probabilities"]
    if uncertainty != "dual_focal" or kind == "index"])  # dual focal has no soft form
def test_class_weighted_loss_is_the_uncertainty_weight_times_the_weighted_ce(uncertainty, target_kind, mode):
    z, y, t, w = _batch()
    target, soft = _targets(target_kind, y, t)
    kw = dict(uncertainty=uncertainty, mode=mode, gamma=2.0, **soft)
    if uncertainty == "external":
        kw["sample_weight"] = torch.rand(N, dtype=torch.float64)
    weighted_rows = R.uncertainty_weighted_ce(z, target, weight=w, reduction="none", **kw)
    # u_i = (unweighted loss) / (plain CE), both from the reference without class weights
    u = (R.uncertainty_weighted_ce(z, target, reduction="none", **kw)
         / R.uncertainty_weighted_ce(z, target, uncertainty="none", reduction="none", **soft).clamp_min(1e-300))
    ce_w = R.uncertainty_weighted_ce(z, target, uncertainty="none", weight=w, reduction="none", **soft)
    if target_kind != "mixed":  # F.cross_entropy has no compact mix
        torch.testing.assert_close(ce_w, F.cross_entropy(z, target, weight=w, reduction="none", **soft))
    torch.testing.assert_close(weighted_rows, u * ce_w)
    # "mean" divides u · CE^w by Σ w_y (class indices, smoothed or not), Σ λ w_y + (1 - λ) w_m (a mix), N (dense)
    valid = y != -100
    safe_y = torch.where(valid, y, 0)
    divisor = {"index": w[safe_y][valid].sum(), "smoothed": w[safe_y][valid].sum(), "probabilities": N,
               "mixed": (0.7 * w[safe_y] + 0.3 * w[soft.get("mix_target", safe_y)])[valid].sum()}[target_kind]
    torch.testing.assert_close(R.uncertainty_weighted_ce(z, target, weight=w, **kw), (u * ce_w).sum() / divisor)


@pytest.mark.parametrize("uncertainty", ["focal", "brier", "dual_focal", "external"])
def test_gra_gradient_with_class_weights_is_u_w_y_times_p_minus_onehot(uncertainty):
    z, y, _, w = _batch()
    sample_weight = torch.rand(N, dtype=torch.float64) if uncertainty == "external" else None
    x = z.clone().requires_grad_()
    R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, gamma=2.0, sample_weight=sample_weight, weight=w,
                              reduction="sum").backward()
    valid = y != -100
    safe_y = torch.where(valid, y, 0)
    u = R.uncertainty_weight(z, safe_y, uncertainty=uncertainty, gamma=2.0, norm=2.0, sample_weight=sample_weight)
    expected = (valid * u * w[safe_y])[:, None] * (torch.softmax(z, dim=1) - F.one_hot(safe_y, C))
    torch.testing.assert_close(x.grad, expected)


def test_dense_one_hot_target_with_dual_focal_keeps_the_dense_mean_divisor():
    """A dense one-hot target that dual focal reads as class indices still divides its weighted mean by N."""
    z, y, _, w = _batch()
    y = y.clamp_min(0)
    dense = F.one_hot(y, C).double()
    kw = dict(uncertainty="dual_focal", gamma=2.0, weight=w)
    total = R.uncertainty_weighted_ce(z, y, reduction="sum", **kw)
    torch.testing.assert_close(R.uncertainty_weighted_ce(z, dense, **kw), total / N)
    torch.testing.assert_close(R.uncertainty_weighted_ce(z, y, **kw), total / w[y].sum())


# ----------------------------------------------------------------------------------------------------------------
# z-loss and soft-capping
# ----------------------------------------------------------------------------------------------------------------
def _z_loss_rows(z, valid, scale):
    return torch.where(valid, scale * torch.logsumexp(z, dim=1) ** 2, 0.0)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("with_weight", [True, False], ids=["weight", "no-weight"])
@pytest.mark.parametrize("uncertainty", ["none", "brier", "focal"])
def test_z_loss_is_added_outside_both_weights(uncertainty, with_weight, reduction):
    z, y, _, w = _batch()
    weight = w if with_weight else None
    scale = 1e-2
    kw = dict(uncertainty=uncertainty, gamma=2.0, weight=weight, reduction=reduction)
    loss, z_loss = R.uncertainty_weighted_ce(z, y, lse_square_scale=scale, return_z_loss=True, **kw)
    without = R.uncertainty_weighted_ce(z, y, **kw)
    rows = _z_loss_rows(z, y != -100, scale)
    expected_z = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / (y != -100).sum()}[reduction]
    torch.testing.assert_close(z_loss, expected_z)
    torch.testing.assert_close(loss, without + expected_z)
    torch.testing.assert_close(R.uncertainty_weighted_ce(z, y, lse_square_scale=scale, **kw), loss)


def test_z_loss_with_a_dense_target_divides_by_every_row():
    z, _, t, w = _batch()
    loss, z_loss = R.uncertainty_weighted_ce(z, t, uncertainty="none", weight=w, lse_square_scale=0.5,
                                             return_z_loss=True)
    rows = _z_loss_rows(z, torch.ones(N, dtype=torch.bool), 0.5)
    torch.testing.assert_close(z_loss, rows.mean())
    torch.testing.assert_close(loss, F.cross_entropy(z, t, weight=w) + rows.mean())


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_z_loss_gradient_is_two_s_lse_p(reduction):
    z, y, _, _ = _batch()
    scale = 0.3
    with_z, grad_with, g = _value_and_grad(
        lambda x: R.uncertainty_weighted_ce(x, y, uncertainty="brier", lse_square_scale=scale, reduction=reduction), z)
    x = z.clone().requires_grad_()
    (R.uncertainty_weighted_ce(x, y, uncertainty="brier", reduction=reduction) * g).sum().backward()
    valid = y != -100
    row_scale = {"none": g, "sum": g.expand(N), "mean": g.expand(N) / valid.sum()}[reduction]
    expected = (valid * row_scale * 2 * scale * torch.logsumexp(z, dim=1))[:, None] * torch.softmax(z, dim=1)
    torch.testing.assert_close(grad_with - x.grad, expected)


def test_return_z_loss_without_a_scale_returns_zeros_and_leaves_the_loss():
    z, y, _, _ = _batch()
    x = z.clone().requires_grad_()
    loss, z_loss = R.uncertainty_weighted_ce(x, y, return_z_loss=True, reduction="none")
    torch.testing.assert_close(loss, R.uncertainty_weighted_ce(z, y, reduction="none"))
    assert z_loss.shape == loss.shape and not z_loss.requires_grad and (z_loss == 0).all()
    assert loss.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_return_z_loss_comes_back_in_the_logits_dtype_and_detached(dtype):
    z, y, _, _ = _batch(dtype)
    x = z.clone().requires_grad_()
    loss, z_loss = R.uncertainty_weighted_ce(x, y, lse_square_scale=1e-3, return_z_loss=True)
    assert loss.dtype == z_loss.dtype == dtype
    assert loss.requires_grad and not z_loss.requires_grad


@pytest.mark.parametrize("target_kind", ["index", "smoothed", "mixed", "probabilities"])
@pytest.mark.parametrize("uncertainty", ["none", "focal", "brier"])
def test_softcap_is_the_loss_of_the_capped_logits(uncertainty, target_kind):
    z, y, t, w = _batch(scale=20.0)
    target, soft = _targets(target_kind, y, t)
    cap = 15.0
    kw = dict(uncertainty=uncertainty, gamma=2.0, weight=w, reduction="none", **soft)
    got, grad, g = _value_and_grad(lambda x: R.uncertainty_weighted_ce(x, target, softcap=cap, **kw), z)
    capped = (cap * torch.tanh(z / cap)).requires_grad_()
    expected = R.uncertainty_weighted_ce(capped, target, **kw)
    (expected * g).sum().backward()
    torch.testing.assert_close(got, expected.detach())
    # chain rule through c·tanh(z/c): d/dz = 1 - tanh(z/c)^2
    torch.testing.assert_close(grad, capped.grad * (1 - torch.tanh(z / cap) ** 2))


@pytest.mark.parametrize("uncertainty", ["focal", "brier"])
def test_gra_gradient_with_every_option_is_u_w_y_times_p_minus_onehot_plus_z_loss_through_the_cap(uncertainty):
    """grad mode with class weights, z-loss and soft-capping: ``(u w_y (p - e_y) + 2 s lse p) · (1 - tanh²(z/c))``
    with ``p``, ``lse`` and ``u`` of the capped logits."""
    z, y, _, w = _batch(scale=10.0)
    cap, scale = 8.0, 0.05
    x = z.clone().requires_grad_()
    R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, gamma=2.0, weight=w, lse_square_scale=scale,
                              softcap=cap, reduction="sum").backward()
    valid = y != -100
    safe_y = torch.where(valid, y, 0)
    capped = cap * torch.tanh(z / cap)
    u = R.uncertainty_weight(capped, safe_y, uncertainty=uncertainty, gamma=2.0, norm=2.0)
    p = torch.softmax(capped, dim=1)
    d_capped = (u * w[safe_y])[:, None] * (p - F.one_hot(safe_y, C)) + (
        2 * scale * torch.logsumexp(capped, dim=1))[:, None] * p
    torch.testing.assert_close(x.grad, valid[:, None] * d_capped * (1 - torch.tanh(z / cap) ** 2))


def test_softcap_bounds_the_logits_it_sees():
    """Capped at c, no logit exceeds c in magnitude: a row of huge logits has the loss of a row at ±c."""
    z = torch.tensor([[1e4, -1e4, 0.0]], dtype=torch.float64)
    y = torch.tensor([1])
    got = R.uncertainty_weighted_ce(z, y, uncertainty="none", softcap=5.0)
    torch.testing.assert_close(got, F.cross_entropy(torch.tensor([[5.0, -5.0, 0.0]], dtype=torch.float64), y))


# grad mode's gradient is not the value's derivative (the weight is detached), except for a constant weight
@pytest.mark.parametrize("uncertainty,mode", [("none", "grad"), ("focal", "loss"), ("brier", "loss"),
                                              ("dual_focal", "loss"), ("flsd", "loss")])
def test_gradcheck_with_class_weights_z_loss_and_softcap(uncertainty, mode):
    z, y, _, w = _batch(n=5, c=4, scale=2.0)
    x = z.clone().requires_grad_()
    kw = dict(uncertainty=uncertainty, mode=mode, gamma=2.0, weight=w, lse_square_scale=0.1, softcap=3.0,
              reduction="sum")
    assert torch.autograd.gradcheck(lambda v: R.uncertainty_weighted_ce(v, y, **kw), (x,))


@pytest.mark.parametrize("target_kind", ["smoothed", "mixed", "probabilities"])
def test_gradcheck_soft_targets_with_the_drop_in_options(target_kind):
    z, y, t, w = _batch(n=5, c=4, scale=2.0)
    target, soft = _targets(target_kind, y, t)
    x = z.clone().requires_grad_()
    kw = dict(uncertainty="brier", mode="loss", gamma=2.0, weight=w, lse_square_scale=0.1, softcap=3.0, **soft)
    assert torch.autograd.gradcheck(lambda v: R.uncertainty_weighted_ce(v, target, **kw), (x,))


# ----------------------------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------------------------
def _weight_requiring_grad():
    return torch.ones(C, dtype=torch.float64, requires_grad=True)


BAD_DROP_IN = [
    pytest.param(dict(weight=torch.ones(C + 1, dtype=torch.float64)), ValueError, r"must have shape \(7,\)",
                 id="weight-length"),
    pytest.param(dict(weight=torch.ones(1, C, dtype=torch.float64)), ValueError, r"must have shape \(7,\)",
                 id="weight-2d"),
    pytest.param(dict(weight=torch.ones(C, dtype=torch.long)), TypeError, "floating-point tensor, got torch.int64",
                 id="weight-int"),
    pytest.param(dict(weight=[1.0] * C), TypeError, "floating .C,. tensor, got list", id="weight-list"),
    pytest.param(dict(weight=torch.ones(C, device="meta")), ValueError, "is on meta but logits are on cpu",
                 id="weight-device"),
    pytest.param(dict(weight=torch.tensor([1.0, -0.5, 1, 1, 1, 1, 1])), ValueError, "finite and >= 0.*entry 1",
                 id="weight-negative"),
    pytest.param(dict(weight=torch.tensor([1.0, 1, 1, float("nan"), 1, 1, 1])), ValueError,
                 "finite and >= 0.*entry 3", id="weight-nan"),
    pytest.param(dict(weight=torch.tensor([1.0, 1, 1, 1, 1, 1, float("inf")])), ValueError,
                 "finite and >= 0.*entry 6", id="weight-inf"),
    pytest.param(dict(weight="focal"), TypeError, "the uncertainty weight is now uncertainty='focal'",
                 id="weight-str"),
    pytest.param(dict(softcap=0.0), ValueError, "softcap must be finite and > 0", id="softcap-zero"),
    pytest.param(dict(softcap=-1.0), ValueError, "softcap must be finite and > 0", id="softcap-negative"),
    pytest.param(dict(softcap=float("inf")), ValueError, "softcap must be finite and > 0", id="softcap-inf"),
    pytest.param(dict(softcap=float("nan")), ValueError, "softcap must be finite and > 0", id="softcap-nan"),
    pytest.param(dict(softcap="30"), TypeError, "softcap must be a number", id="softcap-str"),
    pytest.param(dict(lse_square_scale=-1e-4), ValueError, r"lse_square_scale \(the z-loss scale\) must be finite",
                 id="z-scale-negative"),
    pytest.param(dict(lse_square_scale=float("nan")), ValueError, "lse_square_scale", id="z-scale-nan"),
    pytest.param(dict(lse_square_scale=float("inf")), ValueError, "lse_square_scale", id="z-scale-inf"),
    pytest.param(dict(lse_square_scale=None), TypeError, "lse_square_scale .* must be a number", id="z-scale-none"),
    pytest.param(dict(return_z_loss=1), TypeError, "return_z_loss must be a bool, got int", id="return-z-int"),
    pytest.param(dict(return_z_loss="yes"), TypeError, "return_z_loss must be a bool, got str", id="return-z-str"),
    pytest.param(dict(return_z_loss=None), TypeError, "return_z_loss must be a bool", id="return-z-none"),
]


@pytest.mark.parametrize("target_kind", ["index", "probabilities"])
@pytest.mark.parametrize("kwargs,error,message", BAD_DROP_IN)
def test_a_bad_drop_in_option_raises_a_clear_error(kwargs, error, message, target_kind):
    z, y, t, _ = _batch()
    with pytest.raises(error, match=message):
        R.uncertainty_weighted_ce(z, y if target_kind == "index" else t, **kwargs)


def test_a_class_weight_that_requires_grad_raises():
    z, y, _, _ = _batch()
    with pytest.raises(ValueError, match=r"requires grad.*weight.detach\(\)"):
        R.uncertainty_weighted_ce(z, y, weight=_weight_requiring_grad())
    with torch.no_grad():
        R.uncertainty_weighted_ce(z, y, weight=_weight_requiring_grad())


def test_the_functional_api_computes_class_weights_on_the_reference():
    """Only the reference computes class weights so far: the public call on backend="reference" is its result."""
    z, y, _, w = _batch()
    torch.testing.assert_close(ck.uncertainty_weighted_ce(z, y, weight=w, backend="reference"),
                               R.uncertainty_weighted_ce(z, y, weight=w))


def test_check_loss_inputs_records_the_drop_in_options():
    z, y, t, w = _batch()
    plain = check_loss_inputs(z, y)
    assert (plain.class_weight, plain.lse_square_scale, plain.return_z_loss, plain.softcap) == (None, 0.0, False, None)
    with pytest.raises(NotImplementedError, match="per-class weights are not supported yet"):
        check_loss_inputs(z, y, weight=w)
    for target in (y, t):
        inputs = check_loss_inputs(target=target, logits=z, weight=w, lse_square_scale=1, return_z_loss=True,
                                   softcap=30, class_weight_supported=True)
        assert inputs.class_weight is w
        assert (inputs.lse_square_scale, inputs.return_z_loss, inputs.softcap) == (1.0, True, 30.0)
        assert type(inputs.lse_square_scale) is float and type(inputs.softcap) is float
    # constructions without the new fields keep working
    old_style = LossInputs(z, y, "none", "grad", 4.0, 2.0, None, "mean", -100, (N,))
    assert old_style.class_weight is None and old_style.softcap is None
    torch.testing.assert_close(R.uncertainty_weighted_ce_from_inputs(old_style),
                               F.cross_entropy(z, y))


# ------------------------------------------------------------------------------------- the public call's routing
def test_the_public_call_runs_the_options_on_the_reference():
    """``ck.uncertainty_weighted_ce`` takes the options: the CPU kernel computes them (``backend="cpu"``, and
    ``"auto"`` on CPU tensors, without a warning) and matches ``F.cross_entropy`` (uncertainty="none"); dual focal,
    which no fused kernel computes with options, runs them on the reference with one warning under ``"auto"``, and a
    named fused backend refuses it clearly."""
    z = torch.randn(7, 5, dtype=torch.float64, requires_grad=True)
    y = torch.tensor([0, 4, 2, -100, 1, 3, 3])
    class_weight = torch.rand(5, dtype=torch.float64) + 0.5
    expected = F.cross_entropy(z, y, weight=class_weight, label_smoothing=0.1)
    (expected_grad,) = torch.autograd.grad(expected, z)
    backends = ["auto"] + (["cpu"] if "cpu" in ck.available_backends() else [])
    for backend in backends:
        _backends._warned_reference_only.clear()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = ck.uncertainty_weighted_ce(z, y, uncertainty="none", weight=class_weight, label_smoothing=0.1,
                                              backend=backend)
            ck.uncertainty_weighted_ce(z, y, uncertainty="none", weight=class_weight, backend=backend)
        on_reference = "cpu" not in ck.available_backends()
        assert sum("does not compute per-class weights" in str(w.message) for w in caught) == int(on_reference)
        torch.testing.assert_close(loss, expected)
        (grad,) = torch.autograd.grad(loss, z)
        torch.testing.assert_close(grad, expected_grad)
    dual = dict(uncertainty="dual_focal", mode="loss")
    _backends._warned_reference_only.clear()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loss = ck.uncertainty_weighted_ce(z, y, weight=class_weight, **dual)
        ck.uncertainty_weighted_ce(z, y, weight=class_weight, **dual)
    assert sum("does not compute per-class weights" in str(w.message) for w in caught) == 1
    torch.testing.assert_close(loss, ck.uncertainty_weighted_ce(z, y, weight=class_weight, backend="reference", **dual))
    if "cpu" in ck.available_backends():
        for kwargs, what in ((dict(weight=class_weight), "per-class weights"), (dict(softcap=30.0), "soft-capping"),
                             (dict(lse_square_scale=1e-4), "z-loss"), (dict(return_z_loss=True), "z-loss")):
            ck.uncertainty_weighted_ce(z.float(), y, backend="cpu", **kwargs)  # computed by the CPU kernel
            with pytest.raises(NotImplementedError, match=what):
                ck.uncertainty_weighted_ce(z.float(), y, backend="cpu", **dual, **kwargs)
        with pytest.raises(ValueError, match="softcap"):  # a bad value is the checks' error
            ck.uncertainty_weighted_ce(z.float(), y, backend="cpu", softcap=-1.0)


@pytest.mark.parametrize("inplace", [False, True])
def test_return_stats_on_every_backend_are_the_references(inplace):
    """``return_stats=True`` gives the reference's statistics on every backend (taken before a kernel overwrites the
    logits in place), and the loss and gradient of the call without them."""
    import calibkernels as ck

    z = torch.randn(9, 6) * 3
    y = torch.tensor([0, 5, 2, -100, 1, 3, 3, 4, 0])
    _, expected = ck.reference.uncertainty_weighted_ce(z, y, return_stats=True)
    for backend in ck.available_backends():
        if backend == "cuda":
            continue
        leaf = z.clone().requires_grad_()
        logits = leaf * 1.0
        loss, stats = ck.uncertainty_weighted_ce(logits, y, backend=backend, inplace=inplace, return_stats=True)
        torch.testing.assert_close(stats.confidence, expected.confidence, equal_nan=True)
        assert torch.equal(stats.prediction, expected.prediction)
        loss.backward()
        plain = z.clone().requires_grad_()
        ck.uncertainty_weighted_ce(plain, y, backend=backend).backward()
        torch.testing.assert_close(leaf.grad, plain.grad)
    loss, stats = ck.bsce_gra_loss(z, y, return_stats=True)
    torch.testing.assert_close(loss, ck.bsce_gra_loss(z, y))
    assert torch.equal(stats.prediction, expected.prediction)
    with pytest.raises(TypeError, match="return_stats must be a bool"):
        ck.uncertainty_weighted_ce(z, y, return_stats=1)
