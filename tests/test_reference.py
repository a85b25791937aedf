"""The pure-PyTorch reference against independent NumPy formulas, closed-form cases and float64 finite differences.

Everything else in the project is tested against ``calibkernels.reference``, so this file checks the reference with
code that shares nothing with it: per-row NumPy loops written from the formulas of ``docs/losses.md``.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import reference as R

WEIGHTS = ["none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd"]
MODES = ["loss", "grad"]
REDUCTIONS = ["none", "mean", "sum"]


# ----------------------------------------------------------------------------------------------------------------
# Independent NumPy implementation (float64, one row at a time)
# ----------------------------------------------------------------------------------------------------------------
def np_weight(z, y, uncertainty, gamma, norm, w_ext):
    p = np.exp(z - z.max())
    p /= p.sum()
    if uncertainty == "none":
        return 1.0
    if uncertainty == "external":
        return w_ext
    if uncertainty == "focal":
        return (1.0 - p[y]) ** gamma
    if uncertainty == "flsd":
        g = 5.0 if p[y] < 0.2 else (3.0 if p[y] < 0.5 else gamma)
        return (1.0 - p[y]) ** g
    if uncertainty == "dual_focal":
        below = [p[k] for k in range(len(p)) if z[k] < z[y]]
        p_j = max(below) if below else 0.0
        return (1.0 - p[y] + p_j) ** gamma
    if uncertainty in ("brier", "brier_flsd"):
        e = np.zeros_like(p)
        e[y] = 1.0
        if uncertainty == "brier_flsd":
            gamma = 5.0 if p[y] < 0.2 else (3.0 if p[y] < 0.5 else gamma)
        return (np.abs(p - e) ** norm).sum() ** (gamma / norm)
    raise AssertionError(uncertainty)


def np_row_loss(z, y, uncertainty, gamma, norm, w_ext):
    m = z.max()
    ce = m + math.log(np.exp(z - m).sum()) - z[y]
    return np_weight(z, y, uncertainty, gamma, norm, w_ext) * ce


def np_loss_and_grad(z, y, *, uncertainty, mode, gamma, norm, w_ext, reduction, ignore_index=-100):
    """Loss and d(loss)/dz: GRA analytically (u (p - e_y)), loss mode by central differences of the NumPy loss."""
    n, c = z.shape
    rows = np.zeros(n)
    grad = np.zeros_like(z)
    valid = y != ignore_index
    for i in range(n):
        if not valid[i]:
            continue
        wi = None if w_ext is None else w_ext[i]
        rows[i] = np_row_loss(z[i], y[i], uncertainty, gamma, norm, wi)
        if mode == "grad" or uncertainty in ("none", "external"):
            p = np.exp(z[i] - z[i].max())
            p /= p.sum()
            e = np.zeros(c)
            e[y[i]] = 1.0
            grad[i] = np_weight(z[i], y[i], uncertainty, gamma, norm, wi) * (p - e)
        else:
            h = 1e-6
            for k in range(c):
                zp, zm = z[i].copy(), z[i].copy()
                zp[k] += h
                zm[k] -= h
                grad[i, k] = (np_row_loss(zp, y[i], uncertainty, gamma, norm, wi)
                              - np_row_loss(zm, y[i], uncertainty, gamma, norm, wi)) / (2 * h)
    if reduction == "none":
        return rows, grad
    if reduction == "sum":
        return rows.sum(), grad
    count = max(valid.sum(), 1)
    return rows.sum() / count, grad / count


def _inputs(n, c, *, ignore=True):
    z = torch.randn(n, c, dtype=torch.float64) * 2.0
    y = torch.randint(0, c, (n,))
    if ignore and n > 2:
        y[1] = -100
    w = torch.rand(n, dtype=torch.float64)
    return z, y, w


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_value_and_gradient_match_numpy(uncertainty, mode, reduction):
    z, y, w = _inputs(6, 5)
    gamma = 2.5 if uncertainty != "flsd" else 3.0
    norm = 1.5 if uncertainty == "brier" else 2.0
    x = z.clone().requires_grad_()
    loss = R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=norm,
                                     sample_weight=w if uncertainty == "external" else None, reduction=reduction)
    loss.sum().backward()
    want_loss, want_grad = np_loss_and_grad(
        z.numpy(), y.numpy(), uncertainty=uncertainty, mode=mode, gamma=gamma, norm=norm,
        w_ext=w.numpy() if uncertainty == "external" else None, reduction=reduction)
    np.testing.assert_allclose(loss.detach().numpy(), want_loss, rtol=1e-10, atol=1e-12)
    np.testing.assert_allclose(x.grad.numpy(), want_grad, rtol=1e-6, atol=1e-8)


# ----------------------------------------------------------------------------------------------------------------
# Closed-form cases
# ----------------------------------------------------------------------------------------------------------------
def test_uniform_logits_closed_form():
    c, gamma = 7, 4.0
    z = torch.zeros(3, c, dtype=torch.float64)
    y = torch.tensor([0, 3, 6])
    ce = math.log(c)
    brier_sq = (c - 1) / c**2 + (1 - 1 / c) ** 2
    expected = {
        "none": ce,
        "focal": (1 - 1 / c) ** gamma * ce,
        "dual_focal": (1 - 1 / c) ** gamma * ce,  # every class ties with p_y: none is strictly below, p_j = 0
        "flsd": (1 - 1 / c) ** 5 * ce,  # p_y = 1/7 < 0.2 → γ = 5
        "brier": brier_sq ** (gamma / 2) * ce,
    }
    for uncertainty, value in expected.items():
        got = R.uncertainty_weighted_ce(z, y, uncertainty=uncertainty, gamma=gamma, reduction="none")
        torch.testing.assert_close(got, torch.full((3,), value, dtype=torch.float64), rtol=1e-12, atol=0)


def test_dual_focal_takes_largest_probability_strictly_below_target():
    p = torch.tensor([[0.5, 0.3, 0.2]] * 3, dtype=torch.float64)
    z = p.log()
    y = torch.tensor([0, 1, 2])
    u = R.uncertainty_weight(z, y, uncertainty="dual_focal", gamma=1.0, norm=2.0)
    # y = 0: p_j = 0.3 (the largest non-target); y = 1: p_j = 0.2, not 0.5; y = 2: nothing below → 0
    torch.testing.assert_close(u, torch.tensor([1 - 0.5 + 0.3, 1 - 0.3 + 0.2, 1 - 0.2 + 0.0], dtype=torch.float64))


def test_flsd_gamma_schedule():
    c = 4
    targets = torch.zeros(3, dtype=torch.long)
    p_targets = torch.tensor([0.1, 0.3, 0.9], dtype=torch.float64)
    rest = (1 - p_targets) / (c - 1)
    p = torch.cat([p_targets[:, None], rest[:, None].expand(3, c - 1)], dim=1)
    u = R.uncertainty_weight(p.log(), targets, uncertainty="flsd", gamma=3.0, norm=2.0)
    torch.testing.assert_close(u, torch.tensor([0.9**5, 0.7**3, 0.1**3], dtype=torch.float64))
    u_gamma1 = R.uncertainty_weight(p.log(), targets, uncertainty="flsd", gamma=1.0, norm=2.0)
    assert u_gamma1[2].item() == pytest.approx(0.1)  # γ only applies when p_y ≥ 0.5


def test_brier_gamma2_norm2_is_brier_score_and_norm_q_generalises():
    z = torch.randn(9, 6, dtype=torch.float64)
    y = torch.randint(0, 6, (9,))
    p, e = z.softmax(-1), F.one_hot(y, 6).double()
    u = R.uncertainty_weight(z, y, uncertainty="brier", gamma=2.0, norm=2.0)
    torch.testing.assert_close(u, ((p - e) ** 2).sum(1))
    u = R.uncertainty_weight(z, y, uncertainty="brier", gamma=3.0, norm=1.0)
    torch.testing.assert_close(u, (p - e).abs().sum(1) ** 3)
    torch.testing.assert_close(R.brier_loss(z, y, reduction="none"), ((p - e) ** 2).sum(1))


def test_confident_rows_keep_relative_precision():
    # p_y = 1 - 1e-12: "1 - p_y" by subtraction, or from log p_y (whose log(1 + 1e-12) keeps the rounding of 1 + 1e-12,
    # and is 0 in float32), loses most digits; the reference sums the other probabilities instead.
    eps = 1e-12
    z = torch.tensor([[0.0, math.log(eps)]], dtype=torch.float64)  # p_1 = eps / (1 + eps)
    y = torch.tensor([0])
    u = R.uncertainty_weight(z, y, uncertainty="focal", gamma=1.0, norm=2.0)
    assert u.item() == pytest.approx(eps / (1 + eps), rel=1e-13, abs=0)
    u = R.uncertainty_weight(z, y, uncertainty="focal", gamma=0.5, norm=2.0)
    assert u.item() == pytest.approx(math.sqrt(eps / (1 + eps)), rel=1e-13, abs=0)
    # float32: the logit log(1e-12) is rounded to float32 (relative error ~1e-6 in p_1)
    u32 = R.uncertainty_weight(z.float(), y, uncertainty="brier", gamma=2.0, norm=2.0)
    assert u32.item() == pytest.approx(2 * eps**2, rel=1e-5, abs=0)
    u32 = R.uncertainty_weight(z.float(), y, uncertainty="dual_focal", gamma=1.0, norm=2.0)
    assert u32.item() == pytest.approx(2 * eps, rel=1e-5, abs=0)


def test_cross_entropy_at_large_float32_logits_has_f_cross_entropys_precision():
    # CE as logsumexp(z) - z_y carries an ulp of the logits (1.2e-4 near 1000 in float32); -log_softmax subtracts
    # the row max first, as F.cross_entropy does, so a confident row's CE is off by an ulp of 1 at most
    g = torch.Generator().manual_seed(0)
    z = (1000 * torch.randn(64, 100, generator=g, dtype=torch.float64)).float()
    y = z.argmax(dim=1)
    y[32:] = torch.randint(0, 100, (32,), generator=g)
    got = R.uncertainty_weighted_ce(z, y, uncertainty="none", reduction="none")
    z64 = z.double()
    exact = -z64.log_softmax(dim=1).gather(1, y[:, None])[:, 0]
    error = (got.double() - exact).abs()
    assert (error <= 2.0**-22 * exact.clamp(min=1)).all()  # two ulps of the row's CE (or of 1)
    assert error[:32].max().item() <= 2.0**-23  # the confident rows: an ulp of 1


# ----------------------------------------------------------------------------------------------------------------
# Gradients: GRA exactness, loss mode = autograd through the weight, float64 gradcheck for every loss
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("uncertainty", ["none", "focal", "flsd", "dual_focal", "brier"])
def test_gra_gradient_is_weight_times_p_minus_onehot(uncertainty):
    z, y, _ = _inputs(8, 5)
    x = z.clone().requires_grad_()
    R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode="grad", gamma=2.0, reduction="sum").backward()
    valid = y != -100
    safe = torch.where(valid, y, 0)
    u = R.uncertainty_weight(z, safe, uncertainty=uncertainty, gamma=2.0, norm=2.0)
    expected = u[:, None] * (z.softmax(-1) - F.one_hot(safe, 5)) * valid[:, None]
    torch.testing.assert_close(x.grad, expected, rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("uncertainty", ["focal", "flsd", "dual_focal", "brier"])
def test_loss_mode_differentiates_through_the_weight(uncertainty):
    z, y, _ = _inputs(5, 4, ignore=False)
    x = z.clone().requires_grad_()
    R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode="loss", gamma=2.0, reduction="sum").backward()
    z2 = z.clone().requires_grad_()
    u = R.uncertainty_weight(z2, y, uncertainty=uncertainty, gamma=2.0, norm=2.0)
    (u * F.cross_entropy(z2, y, reduction="none")).sum().backward()
    torch.testing.assert_close(x.grad, z2.grad)
    gra = z.clone().requires_grad_()
    R.uncertainty_weighted_ce(gra, y, uncertainty=uncertainty, mode="grad", gamma=2.0, reduction="sum").backward()
    assert not torch.allclose(gra.grad, x.grad), "loss and grad modes must differ for a non-constant weight"


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("uncertainty", ["none", "focal", "flsd", "dual_focal", "brier", "external"])
def test_gradcheck_loss_mode(uncertainty, reduction):
    z, y, w = _inputs(5, 4)
    x = z.clone().requires_grad_()
    kw = dict(uncertainty=uncertainty, mode="loss", gamma=2.5, norm=3.0, reduction=reduction,
              sample_weight=w if uncertainty == "external" else None)
    assert torch.autograd.gradcheck(lambda t: R.uncertainty_weighted_ce(t, y, **kw), (x,))


def test_gradcheck_per_sample_gamma():
    z, y, _ = _inputs(5, 4)
    gamma = torch.rand(5, dtype=torch.float64) * 4
    x = z.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda t: R.uncertainty_weighted_ce(t, y, uncertainty="focal", mode="loss", gamma=gamma, reduction="sum"), (x,))
    per_row = R.uncertainty_weighted_ce(z, y, uncertainty="focal", gamma=gamma, reduction="none")
    for i in range(5):
        if y[i] != -100:
            single = R.uncertainty_weighted_ce(z[i:i + 1], y[i:i + 1], uncertainty="focal", gamma=gamma[i].item(),
                                               reduction="sum")
            torch.testing.assert_close(per_row[i], single)


@pytest.mark.parametrize("name", ck.losses.names())
def test_every_registry_loss_passes_gradcheck_when_differentiable(name):
    z, y, _ = _inputs(6, 4)
    module = ck.losses.build(name, backend="reference")
    x = z.clone().requires_grad_()
    if name.endswith("_gra"):
        # GRA losses are not the gradient of their value by design; check the defining property instead.
        module(x, y).backward()
        assert torch.isfinite(x.grad).all()
        return
    assert torch.autograd.gradcheck(lambda t: module(t, y), (x,))


# ----------------------------------------------------------------------------------------------------------------
# Other members of the family
# ----------------------------------------------------------------------------------------------------------------
def test_label_smoothing_matches_pytorch_variant():
    z, y, _ = _inputs(7, 5)
    got = R.label_smoothing_loss(z, y, alpha=0.05)
    torch.testing.assert_close(got, F.cross_entropy(z, y, label_smoothing=0.05))
    q = torch.full((7, 5), 0.05 / 5, dtype=torch.float64)
    safe = torch.where(y == -100, 0, y)
    q[torch.arange(7), safe] += 0.95
    per_row = -(q * z.log_softmax(-1)).sum(1)
    torch.testing.assert_close(R.label_smoothing_loss(z, y, reduction="none"), per_row * (y != -100))


def _mmce_loops(z, y, weighted, bandwidth=0.4):
    p = z.softmax(-1)
    r, pred = p.max(-1)
    c = (pred == y).double()
    m = len(y)
    k = lambda a, b: math.exp(-abs(a - b) / bandwidth)
    if not weighted:
        s = sum((c[i] - r[i]) * (c[j] - r[j]) * k(r[i], r[j]) for i in range(m) for j in range(m))
        return math.sqrt(s / m**2 + 1e-10)
    ok = [i for i in range(m) if c[i] == 1]
    bad = [i for i in range(m) if c[i] == 0]
    if not ok or not bad:
        return 0.0
    s = sum((1 - r[i]) * (1 - r[j]) * k(r[i], r[j]) for i in ok for j in ok) / len(ok) ** 2
    s += sum(r[i] * r[j] * k(r[i], r[j]) for i in bad for j in bad) / len(bad) ** 2
    s -= 2 * sum((1 - r[i]) * r[j] * k(r[i], r[j]) for i in ok for j in bad) / (len(ok) * len(bad))
    return math.sqrt(max(float(s), 0.0) + 1e-10)


@pytest.mark.parametrize("weighted", [False, True])
def test_mmce_matches_pairwise_loops(weighted):
    z = torch.randn(12, 3, dtype=torch.float64)
    y = z.argmax(-1).clone()
    y[:5] = (y[:5] + 1) % 3  # a mix of correct and wrong predictions
    assert R.mmce(z, y, weighted=weighted).item() == pytest.approx(_mmce_loops(z, y, weighted), rel=1e-9)
    ce = F.cross_entropy(z, y)
    assert R.mmce_loss(z, y, weighted=weighted).item() == pytest.approx(
        ce.item() + 2.0 * _mmce_loops(z, y, weighted), rel=1e-9)
    assert R.mmce_loss(z, y, weighted=weighted, reduction="sum").item() == pytest.approx(
        12 * R.mmce_loss(z, y, weighted=weighted).item(), rel=1e-9)


def test_mmce_weighted_is_zero_when_all_correct():
    z = torch.randn(6, 4, dtype=torch.float64)
    assert R.mmce(z, z.argmax(-1), weighted=True).item() == 0.0


# ----------------------------------------------------------------------------------------------------------------
# Reductions, ignore_index, dtypes, shapes
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("uncertainty", ["none", "focal", "brier", "dual_focal"])
def test_ignored_rows_contribute_nothing_and_all_ignored_is_zero(uncertainty):
    z, y, _ = _inputs(6, 4, ignore=False)
    y_ign = y.clone()
    y_ign[[0, 3]] = 7  # custom ignore_index
    x = z.clone().requires_grad_()
    loss = R.uncertainty_weighted_ce(x, y_ign, uncertainty=uncertainty, ignore_index=7, reduction="mean")
    loss.backward()
    keep = torch.tensor([1, 2, 4, 5])
    torch.testing.assert_close(loss, R.uncertainty_weighted_ce(z[keep], y[keep], uncertainty=uncertainty))
    assert (x.grad[[0, 3]] == 0).all()
    none = R.uncertainty_weighted_ce(z, y_ign, uncertainty=uncertainty, ignore_index=7, reduction="none")
    assert (none[[0, 3]] == 0).all()
    x = z.clone().requires_grad_()
    all_ignored = R.uncertainty_weighted_ce(x, torch.full_like(y, -100), uncertainty=uncertainty)
    all_ignored.backward()
    assert all_ignored.item() == 0.0 and (x.grad == 0).all()


def test_leading_dimensions_are_flattened_and_restored():
    z = torch.randn(2, 3, 5, 7)
    y = torch.randint(0, 7, (2, 3, 5))
    none = R.uncertainty_weighted_ce(z, y, reduction="none")
    assert none.shape == (2, 3, 5)
    torch.testing.assert_close(none.reshape(-1), R.uncertainty_weighted_ce(z.reshape(-1, 7), y.reshape(-1),
                                                                           reduction="none"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_inputs_compute_in_float32_and_return_input_dtype(dtype):
    z = torch.randn(16, 11).to(dtype)
    y = torch.randint(0, 11, (16,))
    for reduction in REDUCTIONS:
        out = R.uncertainty_weighted_ce(z, y, reduction=reduction)
        assert out.dtype == dtype
        exact = R.uncertainty_weighted_ce(z.double(), y, reduction=reduction)
        torch.testing.assert_close(out.double(), exact, rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
    x = z.clone().requires_grad_()
    R.uncertainty_weighted_ce(x, y).backward()
    assert x.grad.dtype == dtype


def test_extreme_and_negative_infinite_logits_stay_finite():
    z = torch.tensor([[1e4, -1e4, 0.0], [0.0, float("-inf"), 1.0], [-1e4, 1e4, 3.0]])
    y = torch.tensor([0, 2, 0])
    for uncertainty in ["none", "focal", "flsd", "dual_focal", "brier"]:
        for mode in MODES:
            x = z.clone().requires_grad_()
            loss = R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode=mode, reduction="none")
            loss.sum().backward()
            assert torch.isfinite(loss).all() and torch.isfinite(x.grad).all(), (uncertainty, mode)
            assert loss[0].item() == 0.0  # p_y = 1 exactly in float32
    # row 2: the target is 2e4 below the max, CE = 2e4 exactly
    assert R.uncertainty_weighted_ce(z, y, uncertainty="none", reduction="none")[2].item() == pytest.approx(2e4)


def test_single_class_has_zero_loss():
    z = torch.randn(4, 1, requires_grad=True)
    loss = R.uncertainty_weighted_ce(z, torch.zeros(4, dtype=torch.long), uncertainty="brier", mode="loss")
    loss.backward()
    assert loss.item() == 0.0 and (z.grad == 0).all()


def test_bsce_gra_is_brier_grad_mode():
    z, y, _ = _inputs(7, 6)
    torch.testing.assert_close(R.bsce_gra_loss(z, y, gamma=3.0),
                               R.uncertainty_weighted_ce(z, y, uncertainty="brier", mode="grad", gamma=3.0))
    torch.testing.assert_close(ck.bsce_gra_loss(z, y, gamma=3.0, backend="reference"), R.bsce_gra_loss(z, y, gamma=3.0))


# ----------------------------------------------------------------------------------------------------------------
# Bad input: clear errors naming the problem
# ----------------------------------------------------------------------------------------------------------------
BAD_INPUTS = [
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.tensor([0, 4, 1])), ValueError, "out of range"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.tensor([0, -1, 1])), ValueError, "out of range"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.tensor([0.0, 1.0, 1.0])), TypeError, "integer"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.tensor([0, 1])), ValueError, "shape"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(4), torch.tensor([0, 1, 1, 2])), ValueError, "at least 2"),
    (lambda: R.uncertainty_weighted_ce(torch.randint(0, 3, (3, 4)), torch.tensor([0, 1, 2])), TypeError, "floating"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(0, 4), torch.zeros(0, dtype=torch.long)), ValueError, "empty"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), uncertainty="fcal"),
     ValueError, "uncertainty"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), mode="both"),
     ValueError, "mode"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), reduction="avg"),
     ValueError, "reduction"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), gamma=-1.0),
     ValueError, "gamma"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), norm=0.0),
     ValueError, "norm"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), uncertainty="external"),
     ValueError, "sample_weight"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long),
                                       sample_weight=torch.ones(3)), ValueError, "external"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), uncertainty="external",
                                       sample_weight=torch.ones(2)), ValueError, "shape"),
    (lambda: R.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), uncertainty="brier",
                                       gamma=torch.ones(3)), ValueError, "focal"),
    (lambda: ck.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), backend="gpu"),
     ValueError, "backend"),
    (lambda: R.mmce_loss(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), reduction="none"), ValueError, "batch"),
    (lambda: ck.losses.build("focal"), ValueError, "unknown loss"),
    (lambda: ck.losses.build("brier_loss", backend="cpu"), ValueError, "no fused kernel"),
    (lambda: ck.losses.build("focal_loss", gama=2.0), TypeError, "gama"),
]


@pytest.mark.parametrize("call, error, words", BAD_INPUTS, ids=[f"bad{i}" for i in range(len(BAD_INPUTS))])
def test_bad_input_raises_clear_error(call, error, words):
    with pytest.raises(error, match=words):
        call()
