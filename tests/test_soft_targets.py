"""Soft targets (label smoothing, mixup/cutmix mixes, dense probabilities): the reference against F.cross_entropy and
per-row NumPy formulas, float64 gradients, the one-hot path left bit-identical, validation and routing
(docs/losses.md, "Soft targets")."""

import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import _backends, _target_checks
from calibkernels import _validation as V
from calibkernels import reference as R

SOFT_WEIGHTS = ["none", "focal", "flsd", "brier", "external", "brier_flsd"]
MODES = ["loss", "grad"]
REDUCTIONS = ["none", "mean", "sum"]


@pytest.fixture(autouse=True)
def _quiet_soft_target_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*soft targets.*", category=RuntimeWarning)
        yield


def _inputs(n=7, c=5, dtype=torch.float64, ignore=True, seed=None):
    g = torch.Generator().manual_seed(seed if seed is not None else int(torch.randint(0, 2**31, ())))
    z = torch.randn(n, c, generator=g, dtype=torch.float64).mul_(2.0).to(dtype)
    y = torch.randint(0, c, (n,), generator=g)
    if ignore and n > 2:
        y[1] = -100
    mix = torch.randint(0, c, (n,), generator=g)
    lam = torch.rand(n, generator=g, dtype=torch.float64)
    dense = torch.softmax(torch.randn(n, c, generator=g, dtype=torch.float64) * 2, dim=1)
    w = torch.rand(n, generator=g, dtype=torch.float64) * 2
    return z, y, mix, lam, dense, w


def _target_distribution(y, mix, lam, a, c):
    """Independent construction of t (float64, one row at a time)."""
    t = np.zeros((len(y), c))
    for i in range(len(y)):
        if y[i] == -100:
            continue
        t[i, y[i]] += lam[i] if mix is not None else 1.0
        if mix is not None:
            t[i, mix[i]] += 1.0 - lam[i]
        t[i] = (1 - a) * t[i] + a / c
    return t


def _np_soft_loss(z, t, uncertainty, gamma, norm, w_ext):
    z = z - z.max()
    p = np.exp(z) / np.exp(z).sum()
    ce = -(t * np.log(p)).sum()
    tp = float((t * p).sum())
    if uncertainty == "none":
        u = 1.0
    elif uncertainty == "external":
        u = w_ext
    elif uncertainty == "focal":
        u = (1 - tp) ** gamma
    elif uncertainty == "flsd":
        g = 5.0 if tp < 0.2 else (3.0 if tp < 0.5 else gamma)
        u = (1 - tp) ** g
    else:
        if uncertainty == "brier_flsd":
            gamma = 5.0 if tp < 0.2 else (3.0 if tp < 0.5 else gamma)
        u = (np.abs(p - t) ** norm).sum() ** (gamma / norm)
    return u * ce


# ---------------------------------------------------------------------------------------------- against PyTorch
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("a", [0.0, 0.1, 1.0])
def test_weight_none_matches_f_cross_entropy_label_smoothing_with_ignored_rows(reduction, a):
    z, y, *_ = _inputs()
    y[4] = -100
    expected = F.cross_entropy(z, y, label_smoothing=a, reduction=reduction)  # ignored rows: 0; mean over the rest
    for fn in (ck.uncertainty_weighted_ce, R.uncertainty_weighted_ce):
        got = fn(z, y, uncertainty="none", label_smoothing=a, reduction=reduction)
        torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("a", [0.0, 0.2])
def test_weight_none_matches_f_cross_entropy_probability_targets(reduction, a):
    z, _, _, _, dense, _ = _inputs()
    expected = F.cross_entropy(z, dense, label_smoothing=a, reduction=reduction)  # "mean" divides by N
    got = ck.uncertainty_weighted_ce(z, dense, uncertainty="none", label_smoothing=a, reduction=reduction)
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)
    zg, zr = z.clone().requires_grad_(), z.clone().requires_grad_()
    ck.uncertainty_weighted_ce(zg, dense, uncertainty="none", label_smoothing=a, reduction="sum").backward()
    F.cross_entropy(zr, dense, label_smoothing=a, reduction="sum").backward()
    torch.testing.assert_close(zg.grad, zr.grad, rtol=1e-12, atol=1e-12)


def test_mix_equals_f_cross_entropy_of_the_mixed_losses():
    z, y, mix, _, _, _ = _inputs(ignore=False)
    lam = 0.3
    got = ck.uncertainty_weighted_ce(z, y, uncertainty="none", mix_target=mix, mix_lambda=lam, label_smoothing=0.1)
    expected = (lam * F.cross_entropy(z, y, label_smoothing=0.1)
                + (1 - lam) * F.cross_entropy(z, mix, label_smoothing=0.1))
    torch.testing.assert_close(got, expected, rtol=1e-12, atol=1e-12)


# ---------------------------------------------------------------------------------------------- against NumPy
@pytest.mark.parametrize("uncertainty", SOFT_WEIGHTS)
@pytest.mark.parametrize("kind", ["mix", "mix_smooth", "smooth", "dense", "dense_smooth"])
def test_soft_weights_match_per_row_formulas(uncertainty, kind):
    z, y, mix, lam, dense, w = _inputs(n=9, c=6)
    a = 0.15 if "smooth" in kind else 0.0
    kw = dict(uncertainty=uncertainty, gamma=2.5, norm=1.5, reduction="none", label_smoothing=a,
              sample_weight=w if uncertainty == "external" else None)
    if kind.startswith("dense"):
        got = R.uncertainty_weighted_ce(z, dense, **kw)
        t = (1 - a) * dense.numpy() + a / 6
        valid = np.ones(9, bool)
    else:
        mixed = kind.startswith("mix")
        got = R.uncertainty_weighted_ce(z, y, mix_target=mix if mixed else None, mix_lambda=lam if mixed else None,
                                        **kw)
        t = _target_distribution(y.numpy(), mix.numpy() if mixed else None, lam.numpy(), a, 6)
        valid = (y != -100).numpy()
    for i in range(9):
        expected = _np_soft_loss(z[i].numpy(), t[i], uncertainty, 2.5, 1.5, float(w[i])) if valid[i] else 0.0
        assert float(got[i]) == pytest.approx(expected, rel=1e-10, abs=1e-12)


@pytest.mark.parametrize("uncertainty", SOFT_WEIGHTS)
def test_dense_one_hot_targets_agree_with_the_index_path(uncertainty):
    z, y, _, _, _, w = _inputs(ignore=False)
    kw = dict(uncertainty=uncertainty, gamma=2.0, reduction="none",
              sample_weight=w if uncertainty == "external" else None)
    soft = R.uncertainty_weighted_ce(z, F.one_hot(y, 5).double(), **kw)
    torch.testing.assert_close(soft, R.uncertainty_weighted_ce(z, y, **kw), rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------- one-hot: unchanged
@pytest.mark.parametrize("uncertainty", ["none", "focal", "flsd", "dual_focal", "brier"])
@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_one_hot_targets_without_smoothing_are_bit_identical(uncertainty, backend):
    z, y, mix, *_ = _inputs(n=16, c=10, dtype=torch.float32)

    def run(**kw):
        x = z.clone().requires_grad_()
        loss = ck.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, gamma=2.0, backend=backend, reduction="sum",
                                          **kw)
        loss.backward()
        return loss, x.grad

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the one-hot path never takes the soft-target fallback
        base = run()
        for kw in (dict(label_smoothing=0.0), dict(label_smoothing=0), dict(mix_target=mix, mix_lambda=1.0),
                   dict(mix_target=mix, mix_lambda=1)):
            loss, grad = run(**kw)
            assert torch.equal(loss, base[0]) and torch.equal(grad, base[1])
        swapped = run(mix_target=mix, mix_lambda=0.0)
        y_mix = torch.where(y == -100, y, mix)
        x = z.clone().requires_grad_()
        loss = ck.uncertainty_weighted_ce(x, y_mix, uncertainty=uncertainty, gamma=2.0, backend=backend,
                                          reduction="sum")
        loss.backward()
        assert torch.equal(swapped[0], loss) and torch.equal(swapped[1], x.grad)


# ---------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("uncertainty", SOFT_WEIGHTS)
@pytest.mark.parametrize("dense", [False, True])
def test_gradcheck_loss_mode_soft_targets(uncertainty, reduction, dense):
    z, y, mix, lam, t, w = _inputs(n=5, c=4)
    kw = dict(uncertainty=uncertainty, mode="loss", gamma=2.5, norm=3.0, reduction=reduction, label_smoothing=0.1,
              sample_weight=w[:5] if uncertainty == "external" else None)
    x = z.clone().requires_grad_()
    if dense:
        assert torch.autograd.gradcheck(lambda v: R.uncertainty_weighted_ce(v, t, **kw), (x,))
    else:
        assert torch.autograd.gradcheck(
            lambda v: R.uncertainty_weighted_ce(v, y, mix_target=mix, mix_lambda=lam, **kw), (x,))


@pytest.mark.parametrize("uncertainty", ["focal", "flsd", "brier"])
def test_gradcheck_soft_weight_itself(uncertainty):
    z, y, mix, lam, _, _ = _inputs(n=5, c=4, ignore=False)
    t = R.soft_target_distribution(z, y, mix_target=mix, mix_lambda=lam, label_smoothing=0.05)
    x = z.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda v: R.soft_uncertainty_weight(v, t, uncertainty=uncertainty, gamma=1.5, norm=0.7), (x,))


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("uncertainty", SOFT_WEIGHTS)
def test_grad_mode_gradient_is_weight_times_p_minus_t(uncertainty, reduction):
    z, y, mix, lam, _, w = _inputs(n=8, c=5)
    sw = w[:8] if uncertainty == "external" else None
    x = z.clone().requires_grad_()
    loss = R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode="grad", gamma=2.0, reduction=reduction,
                                     label_smoothing=0.1, mix_target=mix, mix_lambda=lam, sample_weight=sw)
    grad_out = torch.rand(8, dtype=torch.float64) if reduction == "none" else torch.tensor(1.0, dtype=torch.float64)
    loss.backward(grad_out)
    valid = y != -100
    safe = torch.where(valid, y, 0)
    t = R.soft_target_distribution(z, safe, valid=valid, mix_target=mix, mix_lambda=lam, label_smoothing=0.1)
    u = R.soft_uncertainty_weight(z, t, uncertainty=uncertainty, gamma=2.0, norm=2.0, sample_weight=sw)
    scale = {"none": grad_out, "sum": torch.ones(8, dtype=torch.float64),
             "mean": torch.full((8,), 1.0 / int(valid.sum()), dtype=torch.float64)}[reduction]
    expected = (u * scale * valid)[:, None] * (z.softmax(-1) - t)
    torch.testing.assert_close(x.grad, expected, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------- shapes and dtypes
@pytest.mark.parametrize("uncertainty", SOFT_WEIGHTS)
def test_leading_dimensions_and_tiny_class_counts(uncertainty):
    for c in (1, 2, 3):
        z = torch.randn(2, 3, c, dtype=torch.float64)
        y = torch.randint(0, c, (2, 3))
        mix = torch.randint(0, c, (2, 3))
        lam = torch.rand(2, 3, dtype=torch.float64)
        w = torch.rand(2, 3, dtype=torch.float64) if uncertainty == "external" else None
        kw = dict(uncertainty=uncertainty, gamma=2.0, sample_weight=w, label_smoothing=0.1)
        out = R.uncertainty_weighted_ce(z, y, mix_target=mix, mix_lambda=lam, reduction="none", **kw)
        assert out.shape == (2, 3) and torch.isfinite(out).all()
        flat = R.uncertainty_weighted_ce(z.reshape(6, c), y.reshape(6), mix_target=mix.reshape(6),
                                         mix_lambda=lam.reshape(6), reduction="none",
                                         **{**kw, "sample_weight": None if w is None else w.reshape(6)})
        torch.testing.assert_close(out.reshape(6), flat, rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("uncertainty", SOFT_WEIGHTS)
def test_half_precision_computes_in_float32(uncertainty, dtype):
    z, y, mix, lam, dense, w = _inputs(n=6, c=5, dtype=dtype)
    sw = w.float() if uncertainty == "external" else None
    kw = dict(uncertainty=uncertainty, gamma=2.0, reduction="none", label_smoothing=0.1, sample_weight=sw)
    half = R.uncertainty_weighted_ce(z, y, mix_target=mix, mix_lambda=lam.float(), **kw)
    single = R.uncertainty_weighted_ce(z.float(), y, mix_target=mix, mix_lambda=lam.float(), **kw)
    assert half.dtype == dtype
    torch.testing.assert_close(half, single.to(dtype), rtol=0, atol=0)
    dense_half = R.uncertainty_weighted_ce(z, dense.to(dtype), **kw)
    assert dense_half.dtype == dtype and torch.isfinite(dense_half).all()


# ---------------------------------------------------------------------------------------------- dual focal
def test_dual_focal_refuses_soft_targets_with_the_reason():
    z, y, mix, lam, dense, _ = _inputs()
    lam = lam.clamp(0.1, 0.9)
    for kw in (dict(label_smoothing=0.1), dict(mix_target=mix, mix_lambda=0.5), dict(mix_target=mix, mix_lambda=lam)):
        with pytest.raises(ValueError, match="no published soft-target form"):
            ck.uncertainty_weighted_ce(z, y, uncertainty="dual_focal", **kw)
    with pytest.raises(ValueError, match="no published soft-target form"):
        ck.uncertainty_weighted_ce(z, dense, uncertainty="dual_focal")
    with pytest.raises(ValueError, match="no published soft-target form"):
        ck.losses.build("dual_focal_loss", label_smoothing=0.1)


def test_dual_focal_accepts_truly_one_hot_targets():
    z, y, mix, _, _, _ = _inputs(ignore=False)
    kw = dict(uncertainty="dual_focal", gamma=2.0, reduction="none", backend="reference")
    base = ck.uncertainty_weighted_ce(z, y, **kw)
    lam = (torch.rand(7) < 0.5).double()
    got = ck.uncertainty_weighted_ce(z, y, mix_target=mix, mix_lambda=lam, **kw)
    torch.testing.assert_close(got, ck.uncertainty_weighted_ce(z, torch.where(lam == 1, y, mix), **kw),
                               rtol=0, atol=0)
    torch.testing.assert_close(ck.uncertainty_weighted_ce(z, F.one_hot(y, 5).double(), **kw), base, rtol=0, atol=0)


# ---------------------------------------------------------------------------------------------- input checks
def test_bad_soft_target_inputs_raise_clear_errors():
    z, y, mix, lam, dense, _ = _inputs()
    call = ck.uncertainty_weighted_ce
    cases = [
        (ValueError, "label_smoothing must be in", dict(label_smoothing=1.5)),
        (ValueError, "label_smoothing must be in", dict(label_smoothing=float("nan"))),
        (TypeError, "label_smoothing must be a number", dict(label_smoothing=True)),
        (ValueError, "mix_lambda must be in", dict(mix_target=mix, mix_lambda=-0.1)),
        (ValueError, "mix_lambda must be in", dict(mix_target=mix, mix_lambda=float("nan"))),
        (ValueError, r"mix_lambda must be in \[0, 1\] everywhere", dict(mix_target=mix, mix_lambda=lam + 1)),
        (ValueError, r"mix_lambda must be in \[0, 1\] everywhere",
         dict(mix_target=mix, mix_lambda=torch.full((7,), float("nan"), dtype=torch.float64))),
        (ValueError, "go together", dict(mix_target=mix)),
        (ValueError, "go together", dict(mix_lambda=0.5)),
        (TypeError, "integer class indices", dict(mix_target=mix.double(), mix_lambda=0.5)),
        (ValueError, "mix_target shape", dict(mix_target=mix[:3], mix_lambda=0.5)),
        (ValueError, "mix_lambda must be a number, a 0-dim tensor", dict(mix_target=mix, mix_lambda=lam[:3])),
        (TypeError, "mix_lambda tensor must be floating", dict(mix_target=mix, mix_lambda=torch.ones(7).long())),
        (ValueError, "mix_target value 5 is out of range",
         dict(mix_target=torch.where(torch.arange(7) == 3, 5, mix), mix_lambda=0.5)),
        (ValueError, "it is ignore_index",
         dict(mix_target=torch.where(torch.arange(7) == 3, -100, mix), mix_lambda=0.5)),
    ]
    for error, message, kw in cases:
        with pytest.raises(error, match=message):
            call(z, y, uncertainty="none", **kw)
    # mix_target may be anything on ignored rows
    call(z, y, uncertainty="none", mix_target=torch.where(y == -100, -100, mix), mix_lambda=0.5)
    dense_cases = [
        (ValueError, "must have the logits' shape", dense[:, :3]),
        (ValueError, "finite and >= 0", torch.where(torch.arange(5) == 0, -0.1, dense)),
        (ValueError, "sum to 1", dense * 1.01),
        (ValueError, "finite and >= 0", torch.full_like(dense, float("nan"))),
    ]
    for error, message, target in dense_cases:
        with pytest.raises(error, match=message):
            call(z, target, uncertainty="none")
    with pytest.raises(ValueError, match="applies to class-index targets only"):
        call(z, dense, uncertainty="none", ignore_index=0)
    with pytest.raises(ValueError, match="mix a dense target yourself"):
        call(z, dense, uncertainty="none", mix_target=mix, mix_lambda=0.5)
    with pytest.raises(ValueError, match="targets are constants"):
        call(z, dense.clone().requires_grad_(), uncertainty="none")
    # a learnable (or scheduled) lambda would get no gradient: refused, as a dense target that requires grad is
    for backend in ["reference"] + [b for b in ("cpu", "triton") if b in ck.available_backends()]:
        for lam_grad in (lam.clone().requires_grad_(), torch.tensor(0.3, dtype=lam.dtype, requires_grad=True)):
            with pytest.raises(ValueError, match="mix_lambda tensor requires grad"):
                call(z, y, uncertainty="none", mix_target=mix, mix_lambda=lam_grad, backend=backend)
        with torch.no_grad():  # nothing to differentiate: accepted
            call(z, y, uncertainty="none", mix_target=mix, mix_lambda=lam_grad, backend="reference")
    with pytest.raises(ValueError, match="label_smoothing must be in"):
        ck.losses.build("bsce_gra", label_smoothing=-0.1)


# ---------------------------------------------------------------------------------------------- routing
def test_auto_runs_the_fused_kernel_without_a_warning():
    z, y, mix, lam, dense, _ = _inputs(dtype=torch.float32)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for kw in (dict(label_smoothing=0.1), dict(mix_target=mix, mix_lambda=lam.float())):
            torch.testing.assert_close(ck.uncertainty_weighted_ce(z, y, **kw),
                                       R.uncertainty_weighted_ce(z, y, **kw), rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(ck.uncertainty_weighted_ce(z, dense.float()),
                                   R.uncertainty_weighted_ce(z, dense.float()), rtol=1e-5, atol=1e-6)


def test_auto_falls_back_once_and_named_kernels_refuse_what_they_cannot_run(monkeypatch):
    z, y, mix, _, dense, _ = _inputs(dtype=torch.float32)
    monkeypatch.setattr(_backends, "_warned_soft_targets", False)
    monkeypatch.setattr(_backends.module("cpu"), "SOFT_TARGETS", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ck.uncertainty_weighted_ce(z, y, label_smoothing=0.1)
        ck.uncertainty_weighted_ce(z, dense.float(), uncertainty="focal")
        ck.uncertainty_weighted_ce(z, y, mix_target=mix, mix_lambda=0.3)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "does not support soft targets" in messages[0]
    torch.testing.assert_close(first, R.uncertainty_weighted_ce(z, y, label_smoothing=0.1), rtol=0, atol=0)
    for kw in (dict(label_smoothing=0.1), dict(mix_target=mix, mix_lambda=0.3)):
        with pytest.raises(NotImplementedError, match="backend='reference'"):
            ck.uncertainty_weighted_ce(z, y, backend="cpu", **kw)
    with pytest.raises(NotImplementedError, match="backend='reference'"):
        ck.uncertainty_weighted_ce(z, dense.float(), backend="cpu")


def test_a_per_sample_gamma_that_requires_grad_runs_on_the_reference(monkeypatch):
    z, y, *_ = _inputs(dtype=torch.float32)
    monkeypatch.setattr(_backends, "_warned_soft_targets", False)
    gamma = torch.full((z.shape[0],), 2.0, requires_grad=True)
    with pytest.warns(RuntimeWarning, match="per-sample gamma"):
        loss = ck.uncertainty_weighted_ce(z, y, uncertainty="focal", mode="loss", gamma=gamma, label_smoothing=0.1)
    loss.backward()
    expected_gamma = gamma.detach().clone().requires_grad_()
    R.uncertainty_weighted_ce(z, y, uncertainty="focal", mode="loss", gamma=expected_gamma,
                              label_smoothing=0.1).backward()
    torch.testing.assert_close(gamma.grad, expected_gamma.grad)
    with pytest.raises(NotImplementedError, match="per-sample gamma"):
        ck.uncertainty_weighted_ce(z, y, uncertainty="focal", mode="loss", gamma=gamma, label_smoothing=0.1,
                                   backend="cpu")


def test_modules_take_soft_targets():
    z, y, mix, lam, dense, _ = _inputs(dtype=torch.float32)
    criterion = ck.losses.build("bsce_gra", label_smoothing=0.1)
    assert "label_smoothing=0.1" in repr(criterion)
    expected = ck.bsce_gra_loss(z, y, label_smoothing=0.1, mix_target=mix, mix_lambda=lam.float())
    torch.testing.assert_close(criterion(z, y, mix_target=mix, mix_lambda=lam.float()), expected, rtol=0, atol=0)
    torch.testing.assert_close(
        R.bsce_gra_loss(z, y, label_smoothing=0.1, mix_target=mix, mix_lambda=lam.float()), expected)
    drop_in = ck.losses.build("soft_target_bsce_gra")
    assert isinstance(drop_in, ck.losses.SoftTargetUncertaintyWeightedCE)
    torch.testing.assert_close(drop_in(z, dense.float()), ck.bsce_gra_loss(z, dense.float()), rtol=0, atol=0)
    plain = ck.losses.build("soft_target_cross_entropy")
    torch.testing.assert_close(plain(z, dense.float()), F.cross_entropy(z, dense.float()))
    with pytest.raises(TypeError, match="accepts only"):
        ck.losses.build("soft_target_bsce_gra", inplace=True)
    with pytest.raises(ValueError, match="class-index targets only"):
        ck.losses.build("soft_target_bsce_gra", ignore_index=3)(z, dense.float())


# ---------------------------------------------------------------------------------------------- dense values on GPUs
def _triton_device():
    """Where the Triton kernels run here: CUDA tensors on a GPU machine, else CPU tensors under the interpreter
    (conftest.py sets TRITON_INTERPRET=1 only without a GPU, and compiled kernels cannot take CPU tensors); ``None``
    where neither."""
    devices = (["cuda"] if torch.cuda.is_available() else []) + ["cpu"]
    return next((dev for dev in devices if _backends.unavailable_reason("triton", torch.device(dev)) is None), None)


TRITON_DEVICE = _triton_device()
needs_triton = pytest.mark.skipif(
    TRITON_DEVICE is None, reason=f"the Triton kernels cannot run here: "
                                  f"{_backends.unavailable_reason('triton', torch.device('cpu'))}")


def _bad_dense_targets(dense, tolerance=1e-4):
    """(name, target, first bad row) for each way a dense target can fail its value check (rows off 1 by 3 and 2
    times the `tolerance` of their sums)."""
    cases = []
    for name, row, col, value in (("negative", 4, 2, -1e-3), ("nan", 2, 0, float("nan")), ("inf", 6, 1, float("inf")),
                                  ("-inf", 0, 3, float("-inf"))):
        target = dense.clone()
        target[row, col] = value
        cases.append((name, target, row))
    for name, rows, amount in (("sum high", [5], 3 * tolerance), ("sums low", [3, 1], -2 * tolerance)):
        target = dense.clone()
        for row in rows:
            target[row, int(target[row].argmax())] += amount
        cases.append((name, target, min(rows)))
    return cases


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_the_device_flag_of_a_dense_target_agrees_with_the_host_check(dtype):
    """The GPU backends' check of a dense target (device reductions, no synchronisation) refuses exactly what the host
    check refuses, and names the first bad row."""
    z, _, _, _, dense, _ = _inputs(n=8, c=6, ignore=False, seed=5)
    dense = dense.to(dtype)
    flag = V.dense_target_flag(dense)
    assert flag.tolist() == [0, 8]
    V.check_dense_target(z, dense, -100)
    for name, target, row in _bad_dense_targets(dense, V.DENSE_ROW_SUM_TOLERANCE[dtype]):
        with pytest.raises(ValueError):
            V.check_dense_target(z, target, -100)
        assert V.dense_target_flag(target).tolist() == [1, row], (name, dtype)
        with pytest.raises(ValueError, match=rf"row {row} is not") as raised:
            _target_checks.submit(V.dense_target_flag(target), 6, -100, dtype)  # a CPU flag is read at once
        assert f"for {dtype}" in str(raised.value)


@pytest.mark.skipif(not torch.cuda.is_available() or "triton" not in ck.available_backends(),
                    reason="the compiled Triton kernels need a GPU")
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("target_dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_triton_dense_flag_folds_rows_past_one_block_on_the_gpu(reduction, target_dtype):
    """Compiled on a GPU, the fold of the row flags loops over blocks of 4096 rows: a bad row in the second block,
    and with a bad row in each block the first, against dense_target_flag; 16-bit targets are read in float32."""
    from calibkernels.triton import uncertainty_weighted_ce as T

    n, c = 5000, 50
    g = torch.Generator(device="cuda").manual_seed(11)
    z = torch.randn(n, c, device="cuda", generator=g)
    dense = torch.softmax(torch.randn(n, c, device="cuda", dtype=torch.float64, generator=g), 1).to(target_dtype)
    code = V.REDUCTION_CODES[reduction]

    def flag(target):
        return T.uncertainty_weighted_ce_forward(z, target, None, None, 4, 1, 4.0, 2.0, -100, code, True)[2].tolist()

    assert flag(dense) == [0, n]
    for rows in ([4500], [4999], [4500, 17]):
        target = dense.clone()
        for row in rows:
            target[row, 3] = -0.5
        assert flag(target) == V.dense_target_flag(target).tolist() == [1, min(rows)]


@needs_triton
@pytest.mark.parametrize("kind", ["hard", "smooth", "mix", "dense"])
def test_triton_kernels_take_an_empty_batch_like_the_cpu_op(kind):
    """The op called directly with no rows (the public API refuses an empty batch), on the device the Triton kernels
    run on: the loss the CPU op gives (0 for mean and sum, an empty vector for none), an empty (0, C) gradient on that
    device, and a flag that says no target is bad."""
    from calibkernels.triton import uncertainty_weighted_ce as T

    z = torch.zeros(0, 6)
    target = torch.zeros(0, 6) if kind == "dense" else torch.zeros(0, dtype=torch.int64)
    soft = dict(label_smoothing=0.1) if kind == "smooth" else {}
    if kind == "mix":
        soft = dict(mix_target=torch.zeros(0, dtype=torch.int64), mix_lambda=0.5)
    on_device = {k: v.to(TRITON_DEVICE) if isinstance(v, torch.Tensor) else v for k, v in soft.items()}
    cpu = torch.ops.calibkernels.uncertainty_weighted_ce.default if _backends.unavailable_reason(
        "cpu", torch.device("cpu")) is None else None
    for reduction in V.REDUCTION_CODES.values():
        loss, grad, flag = T.uncertainty_weighted_ce_forward(z.to(TRITON_DEVICE), target.to(TRITON_DEVICE), None, None,
                                                             4, 1, 4.0, 2.0, -100, reduction, True, **on_device)
        assert loss.device.type == grad.device.type == flag.device.type == TRITON_DEVICE
        assert grad.shape == (0, 6) and int(flag[0]) == 0
        assert loss.shape == ((0,) if reduction == V.REDUCTION_CODES["none"] else ())
        if reduction != V.REDUCTION_CODES["none"]:
            assert loss.item() == 0.0
        if cpu is not None:  # the CPU op on CPU copies of the same (empty) inputs
            mix = (soft["mix_target"], torch.tensor(0.5)) if kind == "mix" else (None, None)
            expected = cpu(z, target, None, None, 4, 1, 4.0, 2.0, -100, reduction, True, None, *mix,
                           soft.get("label_smoothing", 0.0))[0]
            torch.testing.assert_close(loss.cpu(), expected)


@needs_triton
@pytest.mark.parametrize("read", ["single read", "chunked", "past the check's width"])
@pytest.mark.parametrize("target_dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_triton_flags_a_bad_dense_target_on_the_device(read, target_dtype, monkeypatch):
    """The Triton kernel's own check of a dense target's values, on the device the kernels run on: the ``(any bad
    row, first bad row)`` flag it returns, in one read of the row and in chunks, and the error that flag becomes; a
    half-precision target is read in float32 and judged with its own dtype's tolerance. A float64 target's flag comes
    from float64 reductions instead (its tolerance is below what the kernel's float32 sums can tell), and so does that
    of rows wider than DENSE_KERNEL_CHECK_MAX_CLASSES (here lowered to 4). Through the public API the call skips the
    host check and raises from that flag (read at the call here: the synchronous policy), on CUDA tensors and on CPU
    tensors under the interpreter alike (the common call leaves the values to the kernel)."""
    from calibkernels.triton import uncertainty_weighted_ce as T

    if read == "chunked":
        monkeypatch.setattr(T, "MAX_BLOCK", 4)  # rows of 6 classes in chunks of 2
    if read == "past the check's width":
        monkeypatch.setattr(T, "DENSE_KERNEL_CHECK_MAX_CLASSES", 4)
    monkeypatch.setattr(_target_checks, "POLICY", "sync")  # a CUDA flag raises at its call, as a CPU one does
    z, _, _, _, dense, _ = _inputs(n=8, c=6, ignore=False, seed=6)
    z, dense = z.float().to(TRITON_DEVICE), dense.to(target_dtype).to(TRITON_DEVICE)
    assert T._launch_config(6, 4)[0] == (read != "chunked")

    reductions_used = []  # whether each flag came from the device reductions instead of the kernel's own check
    real_flag = V.dense_target_flag
    monkeypatch.setattr(V, "dense_target_flag", lambda target: reductions_used.append(True) or real_flag(target))
    fallback = read == "past the check's width" or target_dtype == torch.float64

    def device_flag(target, reduction=1):  # weight brier, mode grad; the mean's and sum's reduction folds the row flags
        reductions_used.clear()
        result = T.uncertainty_weighted_ce_forward(z, target, None, None, 4, 1, 4.0, 2.0, -100, reduction,
                                                   True)[2]
        assert result.device.type == TRITON_DEVICE
        assert bool(reductions_used) == fallback, (read, target_dtype)
        return result

    def flag(target, reduction=1):
        return device_flag(target, reduction).tolist()

    for reduction in V.REDUCTION_CODES.values():
        assert flag(dense, reduction) == [0, 8]
    for reduction in ("mean", "sum", "none"):
        reductions_used.clear()
        torch.testing.assert_close(ck.uncertainty_weighted_ce(z, dense, backend="triton", reduction=reduction),
                                   ck.uncertainty_weighted_ce(z, dense, backend="reference", reduction=reduction),
                                   rtol=1e-5, atol=1e-6)
        assert bool(reductions_used) == fallback, (read, target_dtype, reduction)  # the public call's flag, alike
    for name, target, row in _bad_dense_targets(dense, V.dense_row_sum_tolerance(target_dtype)):
        # each reduction folds the rows' flags its own way, whatever made a row bad: all three for the case of two
        # bad rows (the first is named), the mean's alone for the others (the interpreter runs each launch slowly)
        reductions = V.REDUCTION_CODES.values() if name == "sums low" else [V.REDUCTION_CODES["mean"]]
        flags = {reduction: device_flag(target, reduction) for reduction in reductions}
        assert [f.tolist() for f in flags.values()] == [[1, row]] * len(flags), name
        with pytest.raises(ValueError, match=rf"dense target must be finite and >= 0 and sum to 1.*row {row} is not"):
            _target_checks.submit(flags[V.REDUCTION_CODES["mean"]], 6, -100, target.dtype)
        reductions_used.clear()
        # the kernel's flag (or the reductions' where they decide) names the first bad row
        with pytest.raises(ValueError, match=rf"row {row} is not"):
            ck.uncertainty_weighted_ce(z, target, backend="triton")
        assert bool(reductions_used) == fallback, name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the asynchronous policy differs only on a GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_gpu_backends_flag_a_bad_dense_target_without_a_synchronisation(backend, monkeypatch):
    if backend not in ck.available_backends():
        pytest.skip(f"{backend} backend not built")
    z, _, _, _, dense, _ = _inputs(n=8, c=6, ignore=False, seed=7)
    z, dense = z.float().cuda(), dense.float().cuda()
    ck.synchronize_target_checks()
    monkeypatch.setattr(_target_checks, "POLICY", "async")
    for name, target, row in _bad_dense_targets(dense):
        ck.uncertainty_weighted_ce(z, target, backend=backend)  # no stall, no error yet
        with pytest.raises(ValueError, match=rf"row {row} is not"):
            ck.synchronize_target_checks()
    monkeypatch.setattr(_target_checks, "POLICY", "sync")
    with pytest.raises(ValueError, match="row 4 is not"):
        ck.uncertainty_weighted_ce(z, _bad_dense_targets(dense)[0][1], backend=backend)
    ck.uncertainty_weighted_ce(z, dense, backend=backend)


def _boundary_dense_rows():
    """(name, target, host decision) for rows at the edge of the row-sum tolerance, where a sum rounded to the
    target's dtype, or a float32 sum of a float64 target, would decide differently from the real sum."""
    c = 131072
    exact = torch.full((1, c), 1.4e-11, dtype=torch.float64)
    exact[0, 0] = 1 - (c - 1) * 1.4e-11  # sums to 1 (float64)
    short = torch.full((1, c), 1.49e-11, dtype=torch.float64)
    short[0, 0] = 1 - (c - 1) * 1.49e-11 - 1.5e-6  # sums to 1 - 1.5e-6: outside 1e-6
    return [
        ("bf16 row summing to 1.0199 (inside 0.02)", torch.tensor([[0.5, 0.5, 0.0199, 0.0]]).bfloat16(), True),
        ("fp16 row summing to 0.98999 (outside 0.01; 0.99023 rounded to float16)",
         torch.tensor([[0.5, 0.489990234375, 0.0, 0.0]]).half(), False),
        ("float64 wide row summing to 1", exact, True),
        ("float64 wide row summing to 1 - 1.5e-6", short, False),
    ]


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_the_kernels_dense_checks_decide_the_boundary_rows_as_the_host_check(backend, monkeypatch):
    """The row sums behind every check are the same real sums (float32, float64 for a float64 target): rows at the
    edge of the tolerance are accepted or refused alike by the host check, the C++ kernel's (and its in-place
    pre-check's) and Triton's. Triton runs where its kernels run: on CUDA tensors its flag decides (the host check
    is skipped there; the synchronous policy reads the flag at the call), under the interpreter on CPU tensors the
    host check comes first."""
    device = "cpu" if backend == "cpu" else TRITON_DEVICE
    if device is None or _backends.unavailable_reason(backend, torch.device(device)) is not None:
        pytest.skip(f"{backend} backend not available")
    monkeypatch.setattr(_target_checks, "POLICY", "sync")
    for name, target, accepted in _boundary_dense_rows():
        target = target.to(device)
        z = torch.zeros(target.shape, dtype=torch.float32, device=device)
        calls = [lambda: ck.uncertainty_weighted_ce(z, target, backend=backend)]
        if backend == "cpu":
            calls.append(lambda: ck.uncertainty_weighted_ce(z.clone().requires_grad_() * 1, target, backend=backend,
                                                            inplace=True))
        if accepted:
            V.check_dense_target(z, target, -100)
            for call in calls:
                call()
        else:
            with pytest.raises(ValueError, match="sum to 1"):
                V.check_dense_target(z, target, -100)
            for call in calls:
                with pytest.raises(ValueError, match="sum to 1"):
                    call()


def test_a_dense_target_of_another_floating_dtype_is_refused():
    z = torch.zeros(2, 3)
    target = torch.full((2, 3), 1 / 3)
    for dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        with pytest.raises(TypeError, match="float16, bfloat16, float32 or float64"):
            ck.uncertainty_weighted_ce(z, target.to(dtype))
