"""The Triton backend with soft targets (label smoothing, mixup / cutmix in the compact form, dense probabilities)
through the module's forward, against the reference: the two-read (chunked) path, 16-bit logits and targets, rows
above the single-read block, confident rows, FLSD's bands, per-sample γ, the soft kernel against the hard one;
runs as ``test_uncertainty_weighted_ce_triton.py`` does. Every weight × mode × reduction × kind, odd class counts,
F.cross_entropy, the op's argument checks and opcheck are in ``test_uncertainty_weighted_ce_contracts_soft_targets.py``
(the ``backend`` fixture's Triton parameters).
"""

import math

import numpy as np
import pytest
import torch
from _flsd_band import band_choices, flsd_gamma, gamma_picked
from _tolerance import assert_within_reference_error

from calibkernels import _target_checks
from calibkernels import _validation as V
from calibkernels import reference as R

from _triton_helpers import GAMMAS, DEVICES, _targets, _close

T = pytest.importorskip("calibkernels.triton.uncertainty_weighted_ce")

pytestmark = [
    # numpy (behind the interpreter) warns where the kernel deliberately takes log2(0) = -inf or divides by 0 on a
    # masked lane; the results are checked below.
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]


@pytest.fixture
def small_block(monkeypatch):
    """Force the chunked two-read path: rows over 8 classes are streamed in 4-class chunks (37 classes: 10 chunks)."""
    monkeypatch.setattr(T, "MAX_BLOCK", 8)


# ----------------------------------------------------------------------------------------------------------------
# Soft targets (label smoothing, mixup / cutmix in the compact form, dense probabilities) through the module's
# forward, against the reference (loss, and the gradient of the reduced loss by autograd)
# ----------------------------------------------------------------------------------------------------------------
SOFT_WEIGHTS = ["none", "focal", "flsd", "brier", "external", "brier_flsd"]


def _soft_case(kind, n, c, device, *, dtype=torch.float32, target_dtype=torch.float32, ignored=1):
    """Logits, target and soft keyword arguments of one kind of soft target. Ignored rows (compact kinds); per-row λ
    with some rows mixed onto their own target; a -inf logit where its target entry is 0 (never under smoothing,
    where every entry is positive and the loss would be inf)."""
    z = torch.randn(n, c, device=device) * 2
    smoothing = 0.1 if kind.endswith("smoothing") else 0.0
    kw = {"label_smoothing": smoothing}
    if kind.startswith("dense"):
        target = torch.softmax(torch.randn(n, c, device=device) * 2, dim=1)
        if c > 2:
            target[0, 1] = 0.0  # mixup of two classes: zeros elsewhere
            target[1] = 0.0
            target[1, [0, c - 1]] = torch.tensor([0.3, 0.7], device=device)
            if smoothing == 0.0:
                z[0, 1] = float("-inf")
                z[1, 2] = float("-inf")
        target = (target / target.sum(dim=1, keepdim=True)).to(target_dtype)
        return z.to(dtype), target, kw
    target = _targets(n, c, device, ignored=ignored)
    if kind != "smoothing":
        mix = torch.randint(0, c, (n,), device=device)
        if kind == "mix-scalar":
            lam = torch.tensor(0.35, device=device)
        else:
            lam = torch.rand(n, device=device)
            mix[: n // 2] = target[: n // 2]  # mix_target == target on some rows (one of them maybe ignored)
            lam[-1] = 1.0
        mix = torch.where(target == -100, torch.full_like(mix, -100), mix)  # whatever an ignored row's mix is
        kw.update(mix_target=mix, mix_lambda=lam)
        if smoothing == 0.0 and c > 3:
            row = int((target != -100).nonzero()[0])
            free = [k for k in range(c) if k not in (int(target[row]), int(mix[row]))]
            z[row, free[0]] = float("-inf")
    return z.to(dtype), target, kw


def _soft_forward(z, target, *, uncertainty, mode="grad", reduction="mean", gamma=None, norm=2.0, sample_weight=None,
                  gamma_per_sample=None, compute_grad=True, grad_out=None, **soft):
    """``(loss, grad)`` of the Triton backend's forward (the gradient of the reduced loss for grad_output = 1)."""
    gamma = GAMMAS[uncertainty] if gamma is None else gamma
    loss, grad, _ = T.forward(z, target, sample_weight, gamma_per_sample, V.WEIGHT_CODES[uncertainty],
                              V.MODE_CODES[mode],
                              float(gamma), float(norm), -100, V.REDUCTION_CODES[reduction], compute_grad, grad_out,
                              soft.get("mix_target"), soft.get("mix_lambda"), soft.get("label_smoothing", 0.0))
    return loss, grad


def _soft_reference(z, target, *, uncertainty, dtype=torch.float64, gamma=None, sample_weight=None, **kw):
    """The reference's loss and its gradient (grad_output 1 per row for "none"), the logits cast to ``dtype``."""
    x = z.detach().to(dtype).requires_grad_()
    gamma = GAMMAS[uncertainty] if gamma is None else gamma
    if sample_weight is not None:
        sample_weight = sample_weight.to(dtype)
    loss = R.uncertainty_weighted_ce(x, target, uncertainty=uncertainty, gamma=gamma, sample_weight=sample_weight, **kw)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), x.grad


def _check_soft(z, target, *, what="", **kw):
    """The forward against the float64 reference: fp32 logits by ``_close``; 16-bit logits by the shared rule (a
    small multiple of the reference's own error at that precision)."""
    loss, grad = _soft_forward(z, target, **kw)
    exact_loss, exact_grad = _soft_reference(z, target, **kw)
    if z.dtype == torch.float32:
        _close(loss, exact_loss, torch.float32, f"{what} loss")
        _close(grad, exact_grad, torch.float32, f"{what} gradient")
    else:
        assert loss.dtype == torch.float32 and grad.dtype == z.dtype
        low_loss, low_grad = _soft_reference(z, target, dtype=z.dtype, **kw)
        assert_within_reference_error(loss, exact_loss, low_loss, z.dtype, f"{what} loss")
        assert_within_reference_error(grad, exact_grad, low_grad, z.dtype, f"{what} gradient")
    return loss, grad


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mix-per-row", "mix-smoothing", "dense-smoothing"])
@pytest.mark.parametrize("mode", ["loss", "grad"])
@pytest.mark.parametrize("uncertainty", SOFT_WEIGHTS)
def test_soft_targets_on_the_two_read_path(small_block, device, uncertainty, mode, kind):
    """Rows over 8 classes streamed in 4-class chunks: the statistics pass's online sums (rescaled as the max moves)
    and the gradient pass."""
    n, c = 5, 19
    z, target, soft = _soft_case(kind, n, c, device)
    z[2, 17] = 9.0  # a late maximum: every running sum is rescaled
    sw = torch.rand(n, device=device) if uncertainty == "external" else None
    reduction = ("none", "mean", "sum")[SOFT_WEIGHTS.index(uncertainty) % 3]
    _check_soft(z, target, uncertainty=uncertainty, mode=mode, reduction=reduction, sample_weight=sw, **soft)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [False, True], ids=["single-read", "two-read"])
@pytest.mark.parametrize("kind", ["mix-scalar", "mix-smoothing", "dense", "dense-smoothing"])
@pytest.mark.parametrize("norm", [2.0, 1.5, 1.0])
def test_soft_targets_brier_norms(monkeypatch, device, norm, kind, chunked):
    """The Brier weight ‖p - t‖_q^γ for q = 2 (one pass: Σp² and Σp from the statistics), q = 1.5 and q = 1
    (|p_k - t_k|^q: in registers, from Σ e^q without smoothing, or a further read of the row on the two-read path)."""
    if chunked:
        monkeypatch.setattr(T, "MAX_BLOCK", 8)
    z, target, soft = _soft_case(kind, 3, 11, device)
    for mode in ("loss", "grad"):
        _check_soft(z, target, uncertainty="brier", mode=mode, reduction="sum", norm=norm, gamma=3.0, what=mode, **soft)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("kind", ["mix-smoothing", "dense", "dense-logits-dtype"])
def test_soft_targets_in_half_precision(device, dtype, kind):
    """16-bit logits (computed in fp32, the gradient written in the logits' dtype); a float32 dense target or one in
    the logits' dtype."""
    target_dtype = dtype if kind == "dense-logits-dtype" else torch.float32
    z, target, soft = _soft_case(kind.replace("-logits-dtype", ""), 6, 40, device, dtype=dtype,
                                 target_dtype=target_dtype)
    for uncertainty, mode in (("none", "grad"), ("focal", "loss"), ("brier", "loss"), ("brier", "grad")):
        _check_soft(z, target, uncertainty=uncertainty, mode=mode, reduction="sum", what=f"{uncertainty}/{mode}",
                    **soft)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mix-smoothing", "dense"])
def test_soft_targets_above_the_single_read_block(device, kind):
    """C = MAX_BLOCK_16BIT + 1 with bf16 logits: the two-read path with the launcher's own chunk shape."""
    c = T.MAX_BLOCK_16BIT + 1
    assert not T._launch_config(c, 2)[0]
    z, target, soft = _soft_case(kind, 2, c, device, dtype=torch.bfloat16)
    for uncertainty, mode in (("brier", "loss"), ("focal", "loss")):
        _check_soft(z, target, uncertainty=uncertainty, mode=mode, reduction="sum", what=f"{uncertainty}/{mode}",
                    **soft)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [False, True], ids=["single-read", "two-read"])
def test_label_smoothing_with_a_masked_class(monkeypatch, device, chunked):
    """A -inf logit under smoothing: t_k = a/C > 0 there, so CE = inf (as in the reference and F.cross_entropy); the
    GRA gradient u (p - t) stays finite and right."""
    if chunked:
        monkeypatch.setattr(T, "MAX_BLOCK", 8)
    z, target, soft = _soft_case("mix-smoothing", 4, 11, device, ignored=0)
    z[1, 4] = float("-inf")
    for uncertainty in ("none", "focal", "brier"):
        loss, grad = _soft_forward(z, target, uncertainty=uncertainty, mode="grad", reduction="none", **soft)
        exact_loss, exact_grad = _soft_reference(z, target, uncertainty=uncertainty, mode="grad", reduction="none",
                                                 **soft)
        assert torch.isinf(loss[1]) and torch.isinf(exact_loss[1])
        _close(loss, exact_loss, torch.float32, f"{uncertainty} loss")
        _close(grad, exact_grad, torch.float32, f"{uncertainty} gradient")


def _confident_compact_oracle(z, target, mix, lam, uncertainty, gamma):
    """float64 loss and target-column GRA gradient of compact rows whose target class dominates, from the odds
    o_k = e^{z_k - z_y} (a plain log-softmax loses -log p_y ≈ Σ o_k to the rounding of lse, even in float64)."""
    z = z.double().cpu()
    losses, grads = [], []
    for row, (y, m, w) in enumerate(zip(target.tolist(), mix.tolist(), lam.double().tolist())):
        odds = torch.exp(z[row] - z[row, y])
        odds[y] = 0.0
        rest = odds.sum()
        p = odds / (1 + rest)
        p[y] = 1 / (1 + rest)
        one_minus_p_y = rest / (1 + rest)
        w_m = (1 - w) if m != y else 0.0
        cross_entropy = (1 - w_m) * torch.log1p(rest) + w_m * (torch.log1p(rest) + z[row, y] - z[row, m])
        delta = p.clone()
        delta[y] = w_m - one_minus_p_y  # p_y - t_y
        if m != y:
            delta[m] = p[m] - w_m
            one_minus_P = (1 - w_m) * one_minus_p_y + w_m * (1 - p[m])
        else:
            one_minus_P = one_minus_p_y
        u = one_minus_P ** gamma if uncertainty == "focal" else (delta ** 2).sum() ** (gamma / 2)
        losses.append(u * cross_entropy)
        grads.append(u * delta[y])
    return torch.stack(losses), torch.stack(grads)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [False, True], ids=["single-read", "two-read"])
def test_soft_targets_confident_rows_keep_precision(monkeypatch, device, chunked):
    """Confident compact rows: 1 - P = c (C-1) + w_y (1 - p_y) + w_m (1 - p_m) with 1 - p_y, 1 - p_m summed over the
    other classes, -log p_y as log1p and p_y - t_y as (1 - t_y) - (1 - p_y): the loss and the target column's
    gradient keep their relative precision (a dense target has F.cross_entropy's precision there: its CE takes
    log d with d ≈ 1)."""
    if chunked:
        monkeypatch.setattr(T, "MAX_BLOCK", 8)
    c = 19
    z = torch.randn(3, c, device=device)
    z[:, 4] = 30.0
    target = torch.tensor([4, 4, 4], device=device)
    mix = torch.tensor([4, 2, 17], device=device)
    lam = torch.tensor([1.0, 1.0, 1.0 - 2**-20], device=device)
    for uncertainty in ("focal", "brier"):
        loss, grad = _soft_forward(z, target, uncertainty=uncertainty, mode="grad", reduction="none", gamma=0.5,
                                   mix_target=mix, mix_lambda=lam)
        exact_loss, exact_grad = _confident_compact_oracle(z, target, mix, lam, uncertainty, 0.5)
        assert (loss > 0).all()
        torch.testing.assert_close(loss.double().cpu(), exact_loss, rtol=1e-5, atol=0)
        torch.testing.assert_close(grad[:, 4].double().cpu(), exact_grad, rtol=1e-5, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_soft_targets_with_per_sample_gamma(device):
    z, target, soft = _soft_case("mix-smoothing", 6, 7, device)
    gamma = torch.rand(6, device=device) * 4
    for mode in ("loss", "grad"):
        loss, grad = _soft_forward(z, target, uncertainty="focal", mode=mode, reduction="mean", gamma=0.0,
                                   gamma_per_sample=gamma, **soft)
        exact_loss, exact_grad = _soft_reference(z, target, uncertainty="focal", mode=mode, reduction="mean",
                                                 gamma=gamma.double(), **soft)
        _close(loss, exact_loss, torch.float32, f"{mode} loss")
        _close(grad, exact_grad, torch.float32, f"{mode} gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_soft_kernel_with_one_hot_targets_agrees_with_the_hard_kernel(device):
    """λ = 1 on every row and a dense one-hot target are one-hot: the soft kernel gives the hard kernel's results."""
    n, c = 5, 12
    z = torch.randn(n, c, device=device) * 3
    y = _targets(n, c, device, ignored=0)
    sw = torch.rand(n, device=device)
    one_hot = torch.nn.functional.one_hot(y, c).float()
    for uncertainty in SOFT_WEIGHTS:
        kw = dict(uncertainty=uncertainty, mode="loss", reduction="none",
                  sample_weight=sw if uncertainty == "external" else None)
        hard_loss, hard_grad = _soft_forward(z, y, **kw)
        for target, soft in ((y, dict(mix_target=(y + 1) % c, mix_lambda=torch.ones(n, device=device))),
                             (one_hot, {})):
            loss, grad = _soft_forward(z, target, **kw, **soft)
            # The two kernels sum in different orders: a few float32 ulps of the row's largest term, so the absolute
            # tolerance scales with it (Brier rows reach 25 here, where one ulp is 2e-6).
            for got, want in ((loss, hard_loss), (grad, hard_grad)):
                scale = 1.0 + want.abs().max().item()
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * scale)


@pytest.mark.parametrize("device", [d for d in DEVICES if d.id == "cpu"])
def test_flsd_band_of_compact_targets_is_the_closed_form(device):
    """FLSD's band value for compact targets is float32((w_y e^{z_y - lse} + w_m e^{z_m - lse}) + c): with five equal
    logits the exact <t, p> is 0.2, but float32 exp(-log 5) = 0.19999999 puts the row in the γ = 5 band; a smoothed
    row's closed form, evaluated here in float32 as the rule says, decides the same way in the kernel. (Interpreter
    only: its exp is numpy's, as in the float32 evaluation here.)"""
    c, gamma = 5, 1.5
    z = torch.zeros(3, c, device=device)
    target = torch.tensor([0, 1, 2], device=device)
    mix = torch.tensor([3, 1, 4], device=device)
    lam = torch.tensor([0.5, 0.25, 1.0], device=device)
    for smoothing in (0.0, 0.5):
        loss, _ = _soft_forward(z, target, uncertainty="flsd", mode="grad", reduction="none", gamma=gamma,
                                mix_target=mix, mix_lambda=lam, label_smoothing=smoothing)
        e = np.float32(np.exp(np.float32(0.0) - np.float32(np.log(np.float32(c)))))
        expected = []
        for i in range(3):
            w_y = np.float32(1.0 - smoothing) * np.float32(lam[i].item())
            w_m = np.float32(1.0 - smoothing) * (np.float32(1.0) - np.float32(lam[i].item()))
            band = (w_y * e + w_m * e) + np.float32(smoothing) / np.float32(c)
            g = flsd_gamma(band, gamma)
            expected.append(0.8 ** g * math.log(c))  # <t, p> = 0.2 exactly, CE = log 5
        torch.testing.assert_close(loss.double().cpu(), torch.tensor(expected, dtype=torch.float64), rtol=1e-5,
                                   atol=0)


def _brier_flsd_gamma_picked(loss, z, t, norm):
    """Which of FLSD's three γ (5, 3, the argument) explains each row's ``‖p - t‖_q^γ · CE`` (float64, from the
    logits; the three losses differ by far more than rounding). The nearest only: the caller compares the kernel's
    pick with the reference's."""
    return gamma_picked(loss, z, t, "brier_flsd", band_choices(GAMMAS["brier_flsd"]), norm=norm, rtol=None)


@pytest.mark.parametrize("device", [d for d in DEVICES if d.id == "cpu"])
@pytest.mark.parametrize("norm", [2.0, 1.5])
@pytest.mark.parametrize("chunked", [False, True], ids=["single-read", "two-read"])
def test_brier_flsd_bands_and_their_boundaries(monkeypatch, device, chunked, norm):
    """``uncertainty="brier_flsd"``, ``‖p - t‖_q^{γ_i} · CE`` with FLSD's γ_i (5 / 3 / γ below 0.2f / 0.5f / above), on
    rows in each band and at both boundaries, hard and soft targets: the reference's loss and gradient in both modes,
    and the γ_i each row got. Five equal logits: exact p_y = 0.2, but float32 exp(-logf(5)) = 0.19999999f, so γ_i = 5;
    two equal logits (the rest e^{-200} = 0 in float32): exp(-logf(2)) = 0.5f, γ_i = γ. The mixes put 3/4 on the
    target and 1/4 on a class of the same or a common logit, exact in float32, so <t, p> keeps each row's band.

    The reference runs on the float32 logits: the band rule evaluates p_y at the logits' precision (float64 logits put
    the first row at 0.2f, γ_i = 3). A dense target's band on the two-read path is Σ e t / d from the statistics
    pass, the rule's value up to rounding only, so the exact boundary is checked there on the single-read path.
    (Interpreter only: its exp and log are numpy's, as the float32 reference's are on the CPU.)"""
    if chunked:
        monkeypatch.setattr(T, "MAX_BLOCK", 4)  # 2-class chunks
    gamma = GAMMAS["brier_flsd"]
    z = torch.zeros(6, 5, device=device)
    z[1, 2:] = -200.0
    z[2, 2], z[3, 3], z[4, 4] = -0.8, 0.6, 2.8  # p_y = 0.10, 0.31, 0.80
    target = torch.tensor([0, 1, 2, 3, 4, -100], device=device)
    mix = torch.tensor([1, 0, 0, 0, 0, -100], device=device)
    lam = torch.full((6,), 0.75, device=device)
    designed = [5.0, gamma, 5.0, 3.0, gamma]
    one_hot = torch.nn.functional.one_hot(target.clamp(min=0), 5).float()
    dense = one_hot * 0.75
    dense[torch.arange(6), mix.clamp(min=0)] += 0.25
    cases = [("hard", target, {}, designed), ("mix", target, dict(mix_target=mix, mix_lambda=lam), designed),
             ("mix-smoothing", target, dict(mix_target=mix, mix_lambda=lam, label_smoothing=0.1), None)]
    if not chunked:
        cases.append(("dense", dense, {}, designed + [designed[0]]))  # no ignored rows: the last row is row 0's
    for kind, t, soft, expected in cases:
        # the rows' target distributions, for the γ_i each row's loss shows (the compact kinds' last row is ignored)
        rows = torch.arange(6 if kind == "dense" else 5)
        smoothing = soft.get("label_smoothing", 0.0)
        distribution = (1 - smoothing) * (one_hot if kind == "hard" else dense) + smoothing / 5
        for mode in ("loss", "grad"):
            kw = dict(uncertainty="brier_flsd", mode=mode, reduction="none", gamma=gamma, norm=norm, **soft)
            loss, grad = _soft_forward(z, t, **kw)
            exact_loss, exact_grad = _soft_reference(z, t, dtype=torch.float32, **kw)
            what = f"{kind}/{mode}"
            _close(loss, exact_loss, torch.float32, f"{what} loss")
            _close(grad, exact_grad, torch.float32, f"{what} gradient")
            picked = _brier_flsd_gamma_picked(loss[rows], z[rows], distribution[rows], norm)
            assert picked == _brier_flsd_gamma_picked(exact_loss[rows], z[rows], distribution[rows], norm), what
            if expected is not None:
                assert picked == expected, f"{what}: γ_i {picked}, the bands give {expected}"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [False, True], ids=["single-read", "two-read"])
@pytest.mark.parametrize("kind", ["mix-smoothing", "dense-smoothing"])
def test_soft_targets_in_place_and_without_gradient(monkeypatch, device, chunked, kind):
    if chunked:
        monkeypatch.setattr(T, "MAX_BLOCK", 8)
    z, target, soft = _soft_case(kind, 5, 21, device)
    kw = dict(uncertainty="brier", mode="loss", reduction="mean", **soft)
    exact_loss, exact_grad = _soft_reference(z, target, **kw)
    logits = z.clone()
    loss, grad = _soft_forward(logits, target, grad_out=logits, **kw)
    assert grad.shape == (0,)
    _close(loss, exact_loss, torch.float32, "in-place loss")
    _close(logits, exact_grad, torch.float32, "gradient written over the logits")
    loss, grad = _soft_forward(z, target, compute_grad=False, **kw)
    assert grad.shape == (0,), "compute_grad=False must not write an N×C gradient"
    _close(loss, exact_loss, torch.float32, "loss without gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_a_number_mix_lambda_is_taken_as_a_0_dim_tensor(device):
    """The forward takes a number λ as a 0-dim tensor (the op's own argument checks are in the contract suite)."""
    z = torch.randn(4, 5, device=device)
    y = torch.tensor([0, 1, 2, 3], device=device)
    loss, _ = _soft_forward(z, y, uncertainty="brier", mix_target=y.flip(0), mix_lambda=0.25, reduction="none")
    torch.testing.assert_close(loss, _soft_forward(z, y, uncertainty="brier", mix_target=y.flip(0), reduction="none",
                                                   mix_lambda=torch.tensor(0.25, device=device))[0])


@pytest.mark.parametrize("device", DEVICES)
def test_soft_target_bad_indices_poison_their_rows(monkeypatch, device):
    """An out-of-range target is flagged on the device as for hard targets; an out-of-range mix_target on a row that
    is not ignored (the host checks it first) is never read either: both rows are NaN, the others right."""
    monkeypatch.setattr(_target_checks, "POLICY", "off")
    z = torch.randn(5, 6, device=device)
    y = torch.tensor([1, 10**6, 2, 3, -100], device=device)
    mix = torch.tensor([0, 1, 99, 2, -5], device=device)
    lam = torch.full((5,), 0.5, device=device)
    loss, grad, flag = T.forward(z, y, None, None, V.WEIGHT_CODES["brier"], V.MODE_CODES["loss"], 4.0, 2.0, -100,
                                 V.REDUCTION_CODES["none"], True, None, mix, lam, 0.1)
    assert flag.tolist() == [1, 10**6]
    assert torch.isnan(loss[1]) and torch.isnan(loss[2]) and torch.isnan(grad[1]).all() and torch.isnan(grad[2]).all()
    assert loss[4] == 0 and (grad[4] == 0).all()
    good = torch.tensor([0, 3], device=device)
    exact_loss, exact_grad = _soft_reference(z[good], y[good], uncertainty="brier", mode="loss", reduction="none",
                                             mix_target=mix[good], mix_lambda=lam[good], label_smoothing=0.1)
    _close(loss[good], exact_loss, torch.float32, "loss")
    _close(grad[good], exact_grad, torch.float32, "gradient")


def test_soft_targets_flag():
    assert T.SOFT_TARGETS is True
