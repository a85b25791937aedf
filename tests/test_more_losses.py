"""The losses beyond the fused family (calibkernels/more_losses.py): bsce_adaptive_gra, adafocal, mdca and mbls
against float64 direct formulas and hand-computed numbers, gradients against finite differences, the fused paths
against the references, the registry round trip, and AdaFocal's update."""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import more_losses

REDUCTIONS = ("mean", "sum", "none")


def _inputs(n=9, c=5, seed=0, scale=2.0, ignore=True):
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(n, c, dtype=torch.float64, generator=g) * scale
    y = torch.randint(0, c, (n,), generator=g)
    if ignore:
        y[1] = -100
    return z, y


def _reduce(per_row, y, reduction):
    per_row = torch.where(y != -100, per_row, 0.0)
    if reduction == "none":
        return per_row
    return per_row.sum() if reduction == "sum" else per_row.sum() / (y != -100).sum()


def _p_target(z, y):
    safe = torch.where(y == -100, 0, y)
    return z.softmax(1).gather(1, safe[:, None]).squeeze(1), safe


# ------------------------------------------------------------------------------------------------- bsce_adaptive_gra
def _official_bsce_adaptive(z, y, gamma, norm):
    """BSCELossAdaptiveGra written out: γ_i from the float32 p_y bands, torch.norm(e_y - p, q)^γ_i · (-log p_y)."""
    p_y, safe = _p_target(z, y)
    p32 = p_y.float()
    gamma_i = torch.where(p32 < 0.2, 5.0, torch.where(p32 < 0.5, 3.0, gamma)).double()
    one_hot = F.one_hot(safe, z.shape[1]).double()
    weight = torch.norm(one_hot - z.softmax(1), p=norm, dim=1) ** gamma_i
    return weight, -p_y.log(), gamma_i


def _banded_logits():
    """Rows with p_y in each band: ~0.1, ~0.3, ~0.8 (and an ignored row)."""
    z = torch.zeros(4, 4, dtype=torch.float64)
    y = torch.tensor([0, 0, 0, -100])
    z[0, 0], z[1, 0], z[2, 0] = math.log(1 / 3), math.log(9 / 7), math.log(12.0)  # p_y = 0.1, 0.3, 0.8
    return z, y


def test_bsce_adaptive_gamma_bands():
    z, y = _banded_logits()
    safe = torch.where(y == -100, 0, y)
    assert more_losses.bsce_adaptive_gamma(z, safe, 3.5)[:3].tolist() == [5.0, 3.0, 3.5]


def _fused_backends():
    """``(backend, dtype, tolerance)`` for the backends that run on CPU tensors here: the reference and the C++ kernel
    in float64, and Triton (under TRITON_INTERPRET=1 without a GPU) in float32, the widest type it takes."""
    from calibkernels import _backends
    runs = [("reference", torch.float64, {}), ("cpu", torch.float64, {})]
    if _backends.unavailable_reason("triton", torch.device("cpu")) is None:
        runs.append(("triton", torch.float32, dict(rtol=2e-5, atol=1e-6)))
    return runs


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("norm", (2.0, 1.0))
def test_bsce_adaptive_gra_value_and_gradient(reduction, norm):
    z, y = _inputs()
    z = torch.cat([z, _banded_logits()[0][:3, :4].repeat(1, 2)[:, :5]])  # rows in every band
    y = torch.cat([y, torch.tensor([0, 0, 0])])
    weight, ce, gamma_i = _official_bsce_adaptive(z, y, 3.0, norm)
    assert {5.0, 3.0} <= set(gamma_i[y != -100].tolist())
    expected = _reduce(weight * ce, y, reduction)
    grad_rows = (weight / (1 if reduction != "mean" else (y != -100).sum()))[:, None] * (
        z.softmax(1) - F.one_hot(torch.where(y == -100, 0, y), z.shape[1]))
    expected_grad = torch.where((y != -100)[:, None], grad_rows, 0.0)
    for backend, dtype, tol in _fused_backends():
        x = z.to(dtype, copy=True).requires_grad_()
        got = ck.losses.build("bsce_adaptive_gra", norm=norm, reduction=reduction, backend=backend)(x, y)
        torch.testing.assert_close(got.double(), expected, **tol, msg=backend)
        got.backward(torch.ones_like(got))
        torch.testing.assert_close(x.grad.double(), expected_grad, **tol, msg=backend)


def test_bsce_adaptive_gra_fused_float32_matches_reference():
    z, y = _inputs(64, 10, seed=3)
    z = z.float()
    ref = more_losses.bsce_adaptive_gra_loss(z, y)
    x = z.clone().requires_grad_()
    got = ck.losses.build("bsce_adaptive_gra")(x, y)
    torch.testing.assert_close(got, ref)
    got.backward()
    xr = z.clone().requires_grad_()
    more_losses.bsce_adaptive_gra_loss(xr, y).backward()
    torch.testing.assert_close(x.grad, xr.grad)


@pytest.mark.parametrize("mode", ("grad", "loss"))
def test_brier_flsd_soft_targets_use_the_band_of_t_dot_p(mode):
    """Soft targets (smoothing, a mix): γ_i comes from <t, p>'s band and the weight is ‖p - t‖_q^{γ_i}, written out
    here in float64; every backend agrees (the module is the fused op's uncertainty="brier_flsd")."""
    z, y = _inputs(12, 5, seed=5, scale=3.0)
    z = torch.cat([z, _banded_logits()[0][:3, :4].repeat(1, 2)[:, :5]])
    y = torch.cat([y, torch.tensor([0, 0, 0])])
    mix = torch.where(y == -100, 0, y).flip(0)
    lam = torch.linspace(0.0, 1.0, y.numel(), dtype=torch.float64)
    a, norm, gamma = 0.1, 1.5, 2.0
    valid = y != -100
    safe = torch.where(valid, y, 0)
    t = (1 - a) * (lam[:, None] * F.one_hot(safe, 5) + (1 - lam[:, None]) * F.one_hot(mix, 5)) + a / 5
    p = z.softmax(1)
    band = (t * p).sum(1).float()
    gamma_i = torch.where(band < 0.2, 5.0, torch.where(band < 0.5, 3.0, gamma)).double()
    assert {5.0, 3.0, gamma} <= set(gamma_i[valid].tolist())

    def weighted(x):
        q = x.softmax(1)
        u = ((q - t).abs() ** norm).sum(1) ** (gamma_i / norm)
        return torch.where(valid, (u.detach() if mode == "grad" else u) * -(t * x.log_softmax(1)).sum(1), 0.0)

    xr = z.clone().requires_grad_()
    expected = weighted(xr).sum() / valid.sum()
    expected.backward()
    for backend, dtype, tol in _fused_backends():
        module = ck.losses.UncertaintyWeightedCE(uncertainty="brier_flsd", mode=mode, gamma=gamma, norm=norm,
                                                 backend=backend, label_smoothing=a)
        modules = [module]
        if mode == "grad":
            modules.append(ck.losses.AdaptiveBSCEGRA(gamma=gamma, norm=norm, backend=backend, label_smoothing=a))
        for m in modules:
            x = z.to(dtype, copy=True).requires_grad_()
            got = m(x, y, mix_target=mix, mix_lambda=lam.to(dtype))
            torch.testing.assert_close(got.double(), expected, **tol, msg=f"{type(m).__name__} on {backend}")
            got.backward()
            torch.testing.assert_close(x.grad.double(), xr.grad, **tol, msg=f"{type(m).__name__} on {backend}")


def test_bsce_adaptive_gra_rejects_bad_hyperparameters():
    with pytest.raises(ValueError):
        ck.losses.build("bsce_adaptive_gra", gamma=-1.0)
    with pytest.raises(ValueError):
        ck.losses.build("bsce_adaptive_gra", norm=0.0)
    with pytest.raises(TypeError):
        ck.losses.build("bsce_adaptive_gra", gamma=torch.ones(3))


# ------------------------------------------------------------------------------------------------- adafocal
def test_adafocal_update_rule_by_hand():
    gamma = torch.tensor([1.0, 1.0, 0.3, -0.5, -1.0, 19.0, 0.0], dtype=torch.float64)
    gap = torch.tensor([0.1, -0.2, -1.0, 0.4, -0.1, 0.5, 0.3], dtype=torch.float64)
    got = more_losses.adafocal_next_gamma(gamma, gap, lam=1.0, switch_point=0.2, gamma_min=-2.0, gamma_max=20.0)
    expected = [
        math.exp(0.1),             # over-confident bin: γ grows
        math.exp(-0.2),            # under-confident bin: γ shrinks
        -0.2,                      # 0.3 e^-1 = 0.11 < 0.2 from above: switch to inverse focal
        -0.5 * math.exp(-0.4),     # negative γ: the exponent's sign flips
        -1.0 * math.exp(0.1),
        20.0,                      # 19 e^0.5 clipped at gamma_max
        0.2,                       # 0 stays 0, then jumps to +switch_point
    ]
    torch.testing.assert_close(got, torch.tensor(expected, dtype=torch.float64))
    below = more_losses.adafocal_next_gamma(torch.tensor([-1.9], dtype=torch.float64), torch.tensor([-1.0],
                                    dtype=torch.float64), lam=1.0, switch_point=0.2, gamma_min=-2.0, gamma_max=20.0)
    assert below.item() == -2.0  # -1.9 e^1 clipped at gamma_min


def _mukhoti_adaptive_bins(confidences, predictions, labels, n_bins):
    """The official code's adaECE_error_mukhoti bin statistics (numpy edges, float32 tensor comparisons)."""
    conf = torch.tensor(confidences, dtype=torch.float32)
    acc = torch.tensor(predictions).eq(torch.tensor(labels))
    edges = np.interp(np.linspace(0, len(conf), n_bins + 1), np.arange(len(conf)), np.sort(conf.numpy()))
    gaps = []
    for lo, hi in zip(edges[:-1], edges[1:]):
        in_bin = conf.gt(lo.item()) * conf.le(hi.item())
        if in_bin.float().mean().item() > 0:
            gaps.append(conf[in_bin].mean().item() - acc[in_bin].float().mean().item())
        else:
            gaps.append(0.0)
    return edges, gaps


def test_adafocal_validation_bins_match_the_official_statistics():
    z, y = _inputs(200, 6, seed=5, ignore=False)
    z = z.float()
    edges, gap = more_losses.adafocal_bins_from_validation(z, y, 7)
    p = z.softmax(1)
    conf, pred = p.max(1)
    ref_edges, ref_gap = _mukhoti_adaptive_bins(conf.tolist(), pred.tolist(), y.tolist(), 7)
    np.testing.assert_allclose(edges.numpy(), ref_edges, rtol=0, atol=1e-15)
    np.testing.assert_allclose(gap.numpy(), ref_gap, atol=1e-6)


def test_adafocal_sample_gamma_uses_the_bin_of_p_y():
    loss = ck.losses.build("adafocal", n_bins=4)
    loss.gamma = torch.tensor([4.0, 3.0, 2.0, 1.0], dtype=torch.float64)
    z = torch.log(torch.tensor([[0.1, 0.9], [0.25, 0.75], [0.6, 0.4], [0.99, 0.01], [0.5, 0.5]]))
    y = torch.zeros(5, dtype=torch.long)
    # equal-width bins [0, .25), [.25, .5), [.5, .75), [.75, 1]: p_y = 0.1, 0.25, 0.6, 0.99, 0.5
    assert loss.sample_gamma(z, y).tolist() == [4.0, 3.0, 2.0, 1.0, 2.0]
    loss.edges = torch.tensor([0.0, 0.05, 0.2, 0.95, 1.0], dtype=torch.float64)  # after an update: any edges
    assert loss.sample_gamma(z, y).tolist() == [3.0, 2.0, 2.0, 1.0, 2.0]


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_adafocal_value_and_gradient_focal_and_inverse(reduction):
    z, y = _inputs(12, 4, seed=7)
    loss = ck.losses.build("adafocal", n_bins=3, reduction=reduction)
    loss.gamma = torch.tensor([2.5, -1.5, 0.7], dtype=torch.float64)
    p_y, _ = _p_target(z, y)
    gamma_i = loss.gamma[torch.bucketize(p_y, torch.tensor([1 / 3, 2 / 3], dtype=torch.float64), right=True)]
    assert (gamma_i < 0).any() and (gamma_i > 0).any()
    for backend in ("reference", "cpu"):
        loss.backend = backend
        x = z.clone().requires_grad_()
        got = loss(x, y)
        p = x.softmax(1).gather(1, torch.where(y == -100, 0, y)[:, None]).squeeze(1)
        direct = -torch.where(gamma_i >= 0, (1 - p) ** gamma_i.clamp_min(0), (1 + p) ** gamma_i.abs()) * p.log()
        expected = _reduce(direct, y, reduction)
        torch.testing.assert_close(got, expected)
        (g,) = torch.autograd.grad(got.sum(), x)
        (e,) = torch.autograd.grad(expected.sum(), x)
        torch.testing.assert_close(g, e)


def test_adafocal_gradcheck_both_signs():
    z, y = _inputs(6, 4, seed=11)
    loss = ck.losses.build("adafocal", n_bins=2)
    loss.gamma = torch.tensor([-1.2, 2.0], dtype=torch.float64)
    for backend in ("reference", "cpu"):
        loss.backend = backend
        assert torch.autograd.gradcheck(lambda t: loss(t, y), (z.clone().requires_grad_(),))


def test_adafocal_fused_float32_matches_reference_with_all_gamma_positive():
    z, y = _inputs(64, 10, seed=2)
    z = z.float()
    loss = ck.losses.build("adafocal")
    loss.gamma = torch.linspace(0.5, 5.0, 15, dtype=torch.float64)
    reference = ck.losses.build("adafocal", backend="reference")
    reference.load_state_dict(loss.state_dict())
    torch.testing.assert_close(loss(z, y), reference(z, y))


def test_adafocal_update_moves_gamma_and_round_trips_through_state_dict():
    val_z, val_y = _inputs(300, 5, seed=4, scale=4.0, ignore=False)  # over-confident: large logits, random labels
    loss = ck.losses.build("adafocal", n_bins=5, lam=1.0)
    edges, gap = more_losses.adafocal_bins_from_validation(val_z, val_y, 5)
    returned = loss.update(val_z, val_y)
    torch.testing.assert_close(loss.gamma, torch.exp(gap))  # from γ = 1: γ' = e^{gap} (no switch, no clip here)
    torch.testing.assert_close(returned, loss.gamma)
    assert (gap > 0).all() and (loss.gamma > 1).all() and loss.updates == 1
    torch.testing.assert_close(loss.edges, edges)
    loss.update(val_z, val_y)
    assert loss.updates == 2
    fresh = ck.losses.build("adafocal", n_bins=5)
    fresh.load_state_dict(loss.state_dict())
    assert fresh.updates == 2 and torch.equal(fresh.gamma, loss.gamma) and torch.equal(fresh.edges, loss.edges)
    z, y = _inputs(16, 5, seed=9)
    torch.testing.assert_close(fresh(z, y), loss(z, y))
    with pytest.raises(ValueError, match="bins"):
        ck.losses.build("adafocal", n_bins=3).load_state_dict(loss.state_dict())


def test_adafocal_rejects_bad_hyperparameters():
    for bad in ({"n_bins": 0}, {"lam": -1.0}, {"gamma_initial": 30.0}, {"gamma_min": float("nan")},
                {"switch_point": -0.1}):
        with pytest.raises((ValueError, TypeError)):
            ck.losses.build("adafocal", **bad)


# ------------------------------------------------------------------------------------------------- mdca
def _mdca_loops(z, y):
    keep = [i for i in range(len(y)) if y[i] != -100]
    p = z.softmax(1)
    total = 0.0
    for j in range(z.shape[1]):
        confidence = sum(p[i, j].item() for i in keep) / len(keep)
        accuracy = sum(float(y[i] == j) for i in keep) / len(keep)
        total += abs(confidence - accuracy)
    return total / z.shape[1]


def test_mdca_value_by_hand():
    z = torch.log(torch.tensor([[0.7, 0.2, 0.1], [0.1, 0.6, 0.3]], dtype=torch.float64))
    y = torch.tensor([0, 2])
    # mean p = (0.4, 0.4, 0.2), class frequencies (0.5, 0, 0.5): (0.1 + 0.4 + 0.3) / 3
    torch.testing.assert_close(more_losses.mdca(z, y), torch.tensor(0.8 / 3, dtype=torch.float64))
    z, y = _inputs(11, 4, seed=1)
    assert more_losses.mdca(z, y).item() == pytest.approx(_mdca_loops(z, y), abs=1e-12)


@pytest.mark.parametrize("reduction", ("mean", "sum"))
def test_mdca_loss_and_base(reduction):
    z, y = _inputs(10, 4, seed=6)
    m = int((y != -100).sum())
    ce = F.cross_entropy(z, y, reduction=reduction)
    scale = m if reduction == "sum" else 1
    for backend in ("reference", "cpu"):
        got = ck.losses.build("mdca", beta=2.0, reduction=reduction, backend=backend)(z, y)
        torch.testing.assert_close(got, ce + 2.0 * scale * more_losses.mdca(z, y))
    torch.testing.assert_close(more_losses.mdca_loss(z, y, beta=2.0, reduction=reduction),
                               ce + 2.0 * scale * more_losses.mdca(z, y))
    focal = ck.losses.build("focal_loss", gamma=1.0, reduction=reduction)(z, y)
    got = ck.losses.build("mdca", base="focal_loss", gamma=1.0, reduction=reduction)(z, y)
    torch.testing.assert_close(got, focal + scale * more_losses.mdca(z, y))
    with pytest.raises(ValueError, match="batch-level"):
        ck.losses.build("mdca", reduction="none")


def test_mdca_gradcheck_and_base_checks():
    z, y = _inputs(6, 4, seed=8)
    for spec in ({}, {"base": "focal_loss"}, {"base": "label_smoothing", "alpha": 0.1}):
        loss = ck.losses.build("mdca", backend="reference", **spec)
        assert torch.autograd.gradcheck(lambda t: loss(t, y), (z.clone().requires_grad_(),))
    for bad in ("mdca", "adafocal", "soft_target_bsce_gra", "nope", 3):
        with pytest.raises(ValueError, match="registry name"):
            ck.losses.build("mdca", base=bad)
    with pytest.raises(TypeError, match=r"gamma.*beta, base"):
        ck.losses.build("mdca", gamma=2.0)  # cross_entropy takes no gamma
    with pytest.raises(ValueError, match="inplace"):
        ck.losses.build("mdca", inplace=True)


# ------------------------------------------------------------------------------------------------- mbls
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_mbls_value_by_hand_and_gradient(reduction):
    z = torch.tensor([[15.0, 0.0, 3.0], [1.0, 2.0, 0.5], [0.0, 0.0, 20.0], [30.0, 0.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0, 1, 0, -100])
    # relu(distance to the max - 10): row 0 (0, 5, 2) -> 7/3; row 1 none -> 0; row 2 (10, 10, 0) -> 20/3
    penalty = torch.tensor([7 / 3, 0.0, 20 / 3, 0.0], dtype=torch.float64)
    expected = _reduce(F.cross_entropy(z, y, reduction="none") + 0.1 * penalty, y, reduction)
    for backend in ("reference", "cpu"):
        x = z.clone().requires_grad_()
        got = ck.losses.build("mbls", reduction=reduction, backend=backend)(x, y)
        torch.testing.assert_close(got, expected)
    z, y = _inputs(6, 4, seed=12, scale=8.0)
    for backend in ("reference", "cpu"):
        loss = ck.losses.build("mbls", margin=3.0, lam=0.5, backend=backend)
        assert torch.autograd.gradcheck(lambda t: loss(t, y), (z.clone().requires_grad_(),))


def test_mbls_masked_classes_add_nothing_to_the_penalty():
    """A masked class (-inf logit) has no margin to keep: it adds 0 to the penalty (its infinite distance had made the
    loss infinite), the other classes keep theirs, and the gradient stays finite; a NaN logit still gives NaN."""
    z = torch.tensor([[15.0, 0.0, float("-inf")], [1.0, float("-inf"), 0.5]], dtype=torch.float64)
    y = torch.tensor([0, 0])
    penalty = torch.tensor([5 / 3, 0.0], dtype=torch.float64)  # row 0: relu(15 - 10) over C = 3
    expected = F.cross_entropy(z, y, reduction="none") + 0.1 * penalty
    for backend in ("reference", "cpu"):
        x = z.clone().requires_grad_()
        got = ck.losses.build("mbls", reduction="none", backend=backend)(x, y)
        torch.testing.assert_close(got, expected)
        got.sum().backward()
        assert torch.isfinite(x.grad).all()
    z[1, 0] = float("nan")
    assert torch.isnan(more_losses.mbls_loss(z, y, reduction="none")[1])


def test_mbls_fused_float32_matches_reference():
    z, y = _inputs(32, 10, seed=13, scale=6.0)
    z = z.float()
    torch.testing.assert_close(ck.losses.build("mbls", margin=5.0)(z, y),
                               more_losses.mbls_loss(z, y, margin=5.0))


# ------------------------------------------------------------------------------------------------- registry
@pytest.mark.parametrize("name,hyperparameters,attributes", [
    ("bsce_adaptive_gra", {"gamma": 2.0, "norm": 1.0}, {"gamma": 2.0, "norm": 1.0}),
    ("adafocal", {"n_bins": 10, "lam": 0.5, "gamma_initial": 2.0, "gamma_max": 10.0, "gamma_min": -1.0,
                  "switch_point": 0.3}, {"n_bins": 10, "lam": 0.5, "gamma_initial": 2.0, "switch_point": 0.3}),
    ("mdca", {"beta": 5.0}, {"beta": 5.0}),
    ("mbls", {"margin": 6.0, "lam": 0.2}, {"margin": 6.0, "lam": 0.2}),
])
def test_registry_round_trip(name, hyperparameters, attributes):
    from training.train import build_criterion, parse_loss_spec

    module = ck.losses.build(name, reduction="sum", **hyperparameters)
    for key, value in attributes.items():
        assert getattr(module, key) == value, key
    assert module.reduction == "sum" and type(module).__name__ in repr(module)
    spec = ":".join([name] + [f"{k}={v}" for k, v in hyperparameters.items()])
    assert parse_loss_spec(spec) == (name, hyperparameters)
    assert repr(build_criterion(spec, "sum", "auto")) == repr(module)
    z, y = _inputs(8, 5)
    assert torch.isfinite(module(z, y))


def test_mdca_spec_with_a_base_and_its_hyperparameters():
    from training.train import build_criterion

    module = build_criterion("mdca:beta=1:base=focal_loss:gamma=1", "sum", "auto")
    assert module.base.uncertainty == "focal" and module.base.gamma == 1.0 and module.base.reduction == "sum"


@pytest.mark.parametrize("name", ["bsce_adaptive_gra", "adafocal", "mdca", "mbls"])
def test_bad_targets_raise_the_fused_ops_error(name):
    for backend in ("cpu", "reference"):
        with pytest.raises(ValueError, match="out of range"):
            ck.losses.build(name, backend=backend)(torch.randn(3, 4), torch.tensor([0, 5, 1]))


def test_mdca_refuses_a_base_that_reduces_other_rows_or_otherwise():
    """A base module with another reduction or ignore_index than MDCA's would add a mean loss to a summed MDCA term,
    or drop rows the MDCA term counts: refused, naming the attribute; the registry builds them consistently."""
    from calibkernels.more_losses import MDCALoss

    with pytest.raises(ValueError, match="reduction='mean' and MDCA reduction='sum'"):
        MDCALoss(base=ck.losses.build("focal_loss", gamma=1.0), reduction="sum")
    with pytest.raises(ValueError, match="ignore_index=0 and MDCA ignore_index=-100"):
        MDCALoss(base=ck.losses.build("cross_entropy", ignore_index=0))
    z, y = torch.randn(6, 5), torch.randint(0, 5, (6,))
    consistent = MDCALoss(base=ck.losses.build("focal_loss", gamma=1.0, reduction="sum"), reduction="sum")
    torch.testing.assert_close(consistent(z, y), ck.losses.build("mdca", base="focal_loss", gamma=1.0,
                                                                 reduction="sum")(z, y))


def test_adafocal_loss_checks_its_per_sample_gamma():
    """As the fused op's per-sample γ: a non-finite γ used to give a NaN loss (NaN) or a zero focal weight (+inf)."""
    z, y = _inputs(6, 4, seed=3, ignore=False)
    for bad in (math.nan, math.inf, -math.inf):
        gamma = torch.ones(6, dtype=torch.float64)
        gamma[2] = bad
        with pytest.raises(ValueError, match="finite"):
            more_losses.adafocal_loss(z, y, gamma)
    with pytest.raises(TypeError, match="tensor"):
        more_losses.adafocal_loss(z, y, [1.0] * 6)
    with pytest.raises(TypeError, match="floating point"):
        more_losses.adafocal_loss(z, y, torch.ones(6, dtype=torch.long))
    with pytest.raises(ValueError, match="shape"):
        more_losses.adafocal_loss(z, y, torch.ones(5, dtype=torch.float64))
    more_losses.adafocal_loss(z, y, torch.full((6,), -1.5, dtype=torch.float64))  # negative: inverse focal


def test_adafocal_refuses_a_state_update_could_not_produce():
    loss = ck.losses.build("adafocal", n_bins=3)
    state = loss.get_extra_state()
    for gamma, edges in (([1.0, math.nan, 1.0], state["edges"]), (state["gamma"], [0.0, 0.7, 0.3, 1.0])):
        with pytest.raises(ValueError, match="AdaFocal state"):
            loss.set_extra_state({"gamma": gamma, "edges": edges})
    loss.set_extra_state(state)
