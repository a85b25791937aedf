"""fused_linear_uncertainty_weighted_ce against the reference on explicitly materialised logits.

The loss of ``hidden @ W.T + b`` computed chunk by chunk must equal the reference's loss of the materialised logits,
and its three gradients (hidden, weight, bias) the reference's, for every weight × mode × reduction, on every backend
this install can run (Triton on CPU tensors through its interpreter); plus chunk boundaries, half precision (with the
weight gradient accumulated in float32), autograd contracts, torch.compile, input checks and the memory bound.
"""

import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends
from calibkernels import reference as R
from calibkernels.fused_linear import FusedLinearUncertaintyWeightedCE, default_chunk_size
from calibkernels.fused_linear import fused_linear_uncertainty_weighted_ce as fused_linear

WEIGHTS = ["none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd"]
MODES = ["grad", "loss"]
REDUCTIONS = ["mean", "sum", "none"]

_DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
BACKENDS = [
    pytest.param((name, dev), id=f"{name}-{dev}")
    for name in ("reference", "cpu", "cuda", "triton")
    for dev in _DEVICES
    if _backends.unavailable_reason(name, torch.device(dev)) is None
]
HAS_CPU_KERNEL = _backends.unavailable_reason("cpu", torch.device("cpu")) is None
CPU_BACKEND = "cpu" if HAS_CPU_KERNEL else "reference"


def _dtype_for(backend):
    """float64 where the backend runs it (exact comparisons), float32 on Triton."""
    return torch.float32 if backend == "triton" else torch.float64


def _problem(n, h, c, dtype, device, ignored=(1, 6)):
    hidden = torch.randn(n, h, dtype=torch.float64)
    linear_weight = torch.randn(c, h, dtype=torch.float64) / h ** 0.5 * 2
    bias = 0.5 * torch.randn(c, dtype=torch.float64)
    target = torch.randint(0, c, (n,))
    for row in ignored:
        if row < n:
            target[row] = -100
    return [t.to(dtype=dtype, device=device) for t in (hidden, linear_weight, bias)] + [target.to(device)]


def _reference(hidden, linear_weight, bias, target, grad_output, **kw):
    """Loss and gradients (hidden, weight, bias) of the reference on the materialised logits, in float64."""
    leaves = [t.detach().double().requires_grad_() for t in (hidden, linear_weight, bias)]
    logits = leaves[0] @ leaves[1].T + leaves[2]
    loss = R.uncertainty_weighted_ce(logits, target.cpu() if logits.device != target.device else target, **kw)
    return (loss.detach(),) + torch.autograd.grad(loss, leaves, grad_output.double())


def _fused(hidden, linear_weight, bias, target, grad_output, **kw):
    leaves = [t.detach().clone().requires_grad_() for t in (hidden, linear_weight, bias)]
    loss = fused_linear(leaves[0], leaves[1], target, leaves[2], **kw)
    return (loss.detach(),) + torch.autograd.grad(loss, leaves, grad_output.to(loss.dtype))


def _grad_output(reduction, shape, dtype, device):
    if reduction == "none":
        return torch.randn(shape, dtype=dtype, device=device)
    return torch.tensor(1.7, dtype=dtype, device=device)


def _assert_all_close(got, want, dtype, what):
    rtol, atol = (1e-9, 1e-11) if dtype == torch.float64 else (2e-4, 2e-5)
    for name, g, w in zip(("loss", "d hidden", "d weight", "d bias"), got, want):
        scale = max(1.0, w.abs().max().item())
        torch.testing.assert_close(g.double().cpu(), w.double().cpu(), rtol=rtol, atol=atol * scale,
                                   msg=lambda m: f"{what}, {name}: {m}")


# ------------------------------------------------------------------------------------------ against the reference
@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_matches_reference_on_materialised_logits(backend_device, uncertainty):
    """(2, 13, H) hidden, 13 classes, chunks of 7 rows (not dividing 26), ignored rows, a bias: every mode and
    reduction gives the reference's loss and its three gradients."""
    backend, device = backend_device
    dtype = _dtype_for(backend)
    hidden, linear_weight, bias, target = _problem(26, 8, 13, dtype, device)
    hidden, target = hidden.view(2, 13, 8), target.view(2, 13)
    sample_weight = torch.rand(2, 13, dtype=dtype, device=device) if uncertainty == "external" else None
    for mode, reduction in itertools.product(MODES, REDUCTIONS):
        kw = dict(uncertainty=uncertainty, mode=mode, gamma=3.0 if uncertainty == "flsd" else 2.5, reduction=reduction,
                  sample_weight=sample_weight)
        grad_output = _grad_output(reduction, target.shape, dtype, device)
        got = _fused(hidden, linear_weight, bias, target, grad_output, backend=backend, chunk_size=7, **kw)
        want = _reference(hidden, linear_weight, bias, target, grad_output, **kw)
        assert got[0].dtype == dtype and got[0].shape == want[0].shape
        _assert_all_close(got, want, dtype, f"{uncertainty} {mode} {reduction}")


def _soft_backends():
    """The backends that run soft targets (their module sets SOFT_TARGETS), and the reference."""
    return [p for p in BACKENDS if p.values[0][0] == "reference"
            or getattr(_backends.module(p.values[0][0]), "SOFT_TARGETS", False)]


@pytest.mark.parametrize("backend_device", _soft_backends())
@pytest.mark.parametrize("uncertainty", ["none", "focal", "flsd", "brier", "external"])
def test_soft_targets_match_reference_on_materialised_logits(backend_device, uncertainty):
    """Label smoothing, a mix with one λ per row (a row mixed with its own class), a scalar-λ mix with smoothing and
    a dense target, in chunks of 7 rows over 26 (a chunk boundary inside the mix), every mode and reduction."""
    backend, device = backend_device
    dtype = _dtype_for(backend)
    hidden, linear_weight, bias, target = _problem(26, 8, 13, dtype, device)
    g = torch.Generator().manual_seed(3)
    mix = torch.randint(0, 13, (26,), generator=g).to(device)
    mix[0] = target[0]
    lam = torch.rand(26, generator=g, dtype=torch.float64).to(dtype=dtype, device=device)
    dense = torch.softmax(torch.randn(26, 13, generator=g, dtype=torch.float64), dim=1).to(dtype=dtype, device=device)
    sample_weight = torch.rand(26, dtype=dtype, device=device) if uncertainty == "external" else None
    forms = [(target, dict(label_smoothing=0.1)), (target, dict(mix_target=mix, mix_lambda=lam)),
             (target, dict(mix_target=mix, mix_lambda=0.3, label_smoothing=0.05)), (dense, dict(label_smoothing=0.1))]
    reductions = REDUCTIONS
    if backend == "triton":  # the interpreter is slow: the per-row mix and the dense form, one reduction
        forms, reductions = [forms[1], forms[3]], ["sum"]
    for (tgt, soft), mode, reduction in itertools.product(forms, MODES, reductions):
        kw = dict(uncertainty=uncertainty, mode=mode, gamma=2.5, reduction=reduction, sample_weight=sample_weight,
                  **soft)
        grad_output = _grad_output(reduction, (26,), dtype, device)
        got = _fused(hidden, linear_weight, bias, tgt, grad_output, backend=backend, chunk_size=7, **kw)
        ref_kw = dict(kw)
        if isinstance(ref_kw.get("mix_lambda"), torch.Tensor):
            ref_kw["mix_lambda"] = ref_kw["mix_lambda"].double()
        want = _reference(hidden, linear_weight, bias, tgt.double() if tgt.is_floating_point() else tgt, grad_output,
                          **ref_kw)
        _assert_all_close(got, want, dtype, f"{uncertainty} {mode} {reduction} {sorted(soft)}")


def test_soft_target_module_and_refusals():
    hidden, linear_weight, bias, target = _problem(9, 4, 6, torch.float64, "cpu")
    criterion = FusedLinearUncertaintyWeightedCE(label_smoothing=0.1, chunk_size=4)
    assert "label_smoothing=0.1" in repr(criterion)
    mix = torch.roll(target, 1).clamp(min=0)
    got = criterion(hidden, linear_weight, target, bias, mix_target=mix, mix_lambda=0.4)
    want = R.uncertainty_weighted_ce(hidden @ linear_weight.T + bias, target, label_smoothing=0.1, mix_target=mix,
                                     mix_lambda=0.4)
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match="dual_focal"):
        fused_linear(hidden, linear_weight, target, bias, uncertainty="dual_focal", label_smoothing=0.1)
    with pytest.raises(ValueError, match="dense target must have shape"):
        fused_linear(hidden, linear_weight, torch.rand(9, 5, dtype=torch.float64), bias)
    with pytest.raises(ValueError, match="label_smoothing"):
        fused_linear(hidden, linear_weight, target, bias, label_smoothing=2.0)
    with pytest.raises(ValueError, match="mix_target"):
        fused_linear(hidden, linear_weight, target, bias, mix_target=mix)


@pytest.mark.parametrize("backend", ["reference"] + (["cpu"] if HAS_CPU_KERNEL else []))
def test_one_hot_soft_forms_run_as_class_indices(backend):
    """A number ``mix_lambda`` of exactly 0 (``t = e_mix_target``) or 1 (``t = e_target``) is a one-hot target: the
    per-sample gamma's gradient, which reads the target as class indices, must use the mixed-in class; dual focal
    takes it, a ``mix_lambda`` tensor of 0s and 1s and a one-hot dense target, as the op does (and refuses the
    other soft forms with the op's ``ValueError``)."""
    hidden, linear_weight, bias, target = _problem(9, 4, 6, torch.float64, "cpu", ignored=(2,))
    mix = (target + 1).remainder(6)
    dense = torch.nn.functional.one_hot(target.clamp(min=0), 6).double()
    cases = [dict(uncertainty="focal", mode="loss", gamma=0.5 + torch.rand(9, dtype=torch.float64), mix_target=mix,
                  mix_lambda=lam) for lam in (0.0, 1.0)]
    cases += [dict(uncertainty="dual_focal", mode="loss", mix_target=mix, mix_lambda=lam, reduction=reduction)
              for lam in (0.0, 1.0, torch.tensor([0.0, 1.0, 0.3] + [1.0, 0.0] * 3, dtype=torch.float64))
              for reduction in ("mean", "none")]
    cases.append(dict(uncertainty="dual_focal", mode="loss", target=dense, reduction="sum"))
    for kw in cases:
        tgt = kw.pop("target", target)
        grad_output = _grad_output(kw.get("reduction", "mean"), (9,), torch.float64, "cpu")
        gamma = kw.pop("gamma", None)
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, linear_weight, bias)]
        extra = {} if gamma is None else dict(gamma=gamma.clone().requires_grad_())
        loss = fused_linear(leaves[0], leaves[1], tgt, leaves[2], backend=backend, chunk_size=4, **kw, **extra)
        inputs = leaves + list(extra.values())
        got = (loss.detach(),) + torch.autograd.grad(loss, inputs, grad_output)
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, linear_weight, bias)]
        extra = {} if gamma is None else dict(gamma=gamma.clone().requires_grad_())
        want = R.uncertainty_weighted_ce(leaves[0] @ leaves[1].T + leaves[2], tgt, **kw, **extra)
        inputs = leaves + list(extra.values())
        want = (want.detach(),) + torch.autograd.grad(want, inputs, grad_output)
        for name, g, w in zip(("loss", "d hidden", "d weight", "d bias", "d gamma"), got, want):
            torch.testing.assert_close(g, w, rtol=1e-9, atol=1e-11, msg=lambda m: f"{kw}: {name}: {m}")
    for kw in (dict(mix_target=mix, mix_lambda=0.5), dict(label_smoothing=0.1)):
        with pytest.raises(ValueError, match="dual_focal"):
            fused_linear(hidden, linear_weight, target, bias, uncertainty="dual_focal", backend=backend, **kw)
    with pytest.raises(ValueError, match="not one-hot"):
        fused_linear(hidden, linear_weight, torch.softmax(dense, 1), bias, uncertainty="dual_focal", backend=backend)


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_per_sample_gamma_gets_the_reference_gradient(backend_device, reduction):
    backend, device = backend_device
    dtype = _dtype_for(backend)
    hidden, linear_weight, bias, target = _problem(11, 5, 9, dtype, device)
    gamma = (0.5 + 3 * torch.rand(11, dtype=dtype, device=device)).requires_grad_()
    grad_output = _grad_output(reduction, (11,), dtype, device)
    for mode in MODES:
        g = gamma.detach().clone().requires_grad_()
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, linear_weight)]
        loss = fused_linear(leaves[0], leaves[1], target, bias, uncertainty="focal", mode=mode, gamma=g,
                            reduction=reduction, backend=backend, chunk_size=4)
        loss.backward(grad_output)
        g64 = gamma.detach().double().requires_grad_()
        leaves64 = [t.detach().double().requires_grad_() for t in (hidden, linear_weight)]
        want = R.uncertainty_weighted_ce(leaves64[0] @ leaves64[1].T + bias.double(), target, uncertainty="focal",
                                         mode=mode, gamma=g64, reduction=reduction)
        want.backward(grad_output.double())
        tol = dict(rtol=1e-9, atol=1e-11) if dtype == torch.float64 else dict(rtol=2e-4, atol=2e-5)
        torch.testing.assert_close(loss.double(), want.detach(), **tol)
        for got, exp in ((leaves[0].grad, leaves64[0].grad), (leaves[1].grad, leaves64[1].grad)):
            torch.testing.assert_close(got.double(), exp, **tol)
        if mode == "loss":
            torch.testing.assert_close(g.grad.double(), g64.grad, **tol)
        else:  # the weight is detached: no gradient reaches gamma, as in the reference
            assert g.grad is None or g.grad.abs().sum() == 0
            assert g64.grad is None or g64.grad.abs().sum() == 0


@pytest.mark.parametrize("backend", ["reference"] + (["cpu"] if HAS_CPU_KERNEL else []))
@pytest.mark.parametrize("uncertainty,mode,reduction", [("brier", "loss", "mean"), ("dual_focal", "loss", "none"),
                                                   ("none", "grad", "sum"), ("flsd", "loss", "none"),
                                                   ("focal", "loss", "sum")])
def test_gradcheck_float64(backend, uncertainty, mode, reduction):
    """Finite differences of the fused loss itself (hidden, weight and bias at once), chunks of 2 over 5 rows. (Only
    where the gradient is the loss's derivative: mode="grad" scales the cross-entropy gradient by a detached weight.)"""
    hidden, linear_weight, bias, target = _problem(5, 3, 4, torch.float64, "cpu", ignored=(2,))
    leaves = [t.requires_grad_() for t in (hidden, linear_weight, bias)]

    def loss(h, w, b):
        return fused_linear(h, w, target, b, uncertainty=uncertainty, mode=mode, gamma=2.0, reduction=reduction,
                            backend=backend, chunk_size=2)

    assert torch.autograd.gradcheck(loss, leaves, eps=1e-6, atol=1e-7, rtol=1e-5)


def test_gradcheck_per_sample_gamma():
    hidden, linear_weight, _, target = _problem(5, 3, 4, torch.float64, "cpu", ignored=(2,))
    gamma = (0.5 + torch.rand(5, dtype=torch.float64)).requires_grad_()
    hidden.requires_grad_()

    def loss(h, g):
        return fused_linear(h, linear_weight, target, uncertainty="focal", mode="loss", gamma=g, reduction="none",
                            backend=CPU_BACKEND, chunk_size=2)

    assert torch.autograd.gradcheck(loss, (hidden, gamma), eps=1e-6, atol=1e-7, rtol=1e-5)


# ---------------------------------------------------------------------------------------------- chunk boundaries
@pytest.mark.parametrize("chunk_size", [1, 3, 16, 17, 40, None])
def test_every_chunk_size_gives_the_same_result(chunk_size):
    hidden, linear_weight, bias, target = _problem(17, 6, 10, torch.float64, "cpu")
    for reduction in REDUCTIONS:
        grad_output = _grad_output(reduction, (17,), torch.float64, "cpu")
        kw = dict(uncertainty="brier", mode="loss", reduction=reduction)
        got = _fused(hidden, linear_weight, bias, target, grad_output, backend=CPU_BACKEND, chunk_size=chunk_size,
                     **kw)
        _assert_all_close(got, _reference(hidden, linear_weight, bias, target, grad_output, **kw), torch.float64,
                          f"chunk {chunk_size} {reduction}")


def test_a_chunk_whose_rows_are_all_ignored():
    """Rows 0..4 (the whole first chunk) and 10..14 ignored: the mean still divides by the batch's valid rows."""
    hidden, linear_weight, bias, target = _problem(18, 6, 10, torch.float64, "cpu", ignored=())
    target[:5] = -100
    target[10:15] = -100
    for reduction in REDUCTIONS:
        grad_output = _grad_output(reduction, (18,), torch.float64, "cpu")
        kw = dict(uncertainty="focal", mode="loss", reduction=reduction)
        got = _fused(hidden, linear_weight, bias, target, grad_output, backend=CPU_BACKEND, chunk_size=5, **kw)
        _assert_all_close(got, _reference(hidden, linear_weight, bias, target, grad_output, **kw), torch.float64,
                          f"ignored chunk {reduction}")
        assert got[1][:5].abs().sum() == 0 and got[1][10:15].abs().sum() == 0


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_every_row_ignored_gives_zero_loss_and_zero_gradients(backend_device):
    backend, device = backend_device
    hidden, linear_weight, bias, target = _problem(7, 4, 5, _dtype_for(backend), device, ignored=())
    target.fill_(-100)
    for reduction in REDUCTIONS:
        grad_output = _grad_output(reduction, (7,), hidden.dtype, device)
        loss, *grads = _fused(hidden, linear_weight, bias, target, grad_output, backend=backend, chunk_size=3,
                              reduction=reduction)
        assert torch.all(loss == 0), (reduction, loss)
        for grad in grads:
            assert torch.all(grad == 0) and torch.isfinite(grad).all(), reduction


def test_chunk_size_takes_any_integer_type():
    """A NumPy integer (e.g. from a config computed with NumPy) is an int here, in the function and in the module."""
    np = pytest.importorskip("numpy")
    torch.manual_seed(0)
    hidden, uncertainty = torch.randn(7, 5, dtype=torch.float64), torch.randn(9, 5, dtype=torch.float64)
    target = torch.randint(0, 9, (7,))
    want = ck.fused_linear_uncertainty_weighted_ce(hidden, uncertainty, target, chunk_size=3)
    for size in (np.int64(3), np.int32(3), torch.tensor(3)):
        got = ck.fused_linear_uncertainty_weighted_ce(hidden, uncertainty, target, chunk_size=size)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        module = ck.losses.FusedLinearUncertaintyWeightedCE(chunk_size=size)
        assert type(module.chunk_size) is int and "chunk_size=3" in repr(module)
        torch.testing.assert_close(module(hidden, uncertainty, target), want, rtol=0, atol=0)
    with pytest.raises(TypeError, match="chunk_size"):
        ck.fused_linear_uncertainty_weighted_ce(hidden, uncertainty, target, chunk_size=np.float64(3))


def test_default_chunk_size():
    # Liger's heuristic: the chunk's logits about as large as hidden, within 16..256 MiB of logits
    assert default_chunk_size(8192, 32000, 256, 4) == 256  # the 16 MiB floor, rounded up to a power of two
    assert default_chunk_size(8192, 128256, 4096, 2) == 256  # next_pow2(8192 / ceil(128256 / 4096))
    assert default_chunk_size(100, 1000, 64, 4) == 100  # small problems run in one chunk
    assert default_chunk_size(10**6, 256000, 16384, 2) * 256000 * 2 <= 256 << 20  # the cap
    assert default_chunk_size(1, 10**9, 8, 4) == 1
    # on a GPU at least 1024 rows (the float32 weight-gradient accumulator's traffic per chunk), within the bounds
    assert default_chunk_size(8192, 128256, 4096, 2, "cuda") == 1024
    assert default_chunk_size(8192, 128256, 4096, 4, "cuda") == (256 << 20) // (128256 * 4)  # the cap
    assert default_chunk_size(100, 1000, 64, 4, "cuda") == 100


# ---------------------------------------------------------------------------------------------------- half precision
@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_accumulates_the_weight_gradient_in_float32(backend_device, dtype):
    """One row per chunk over 192 rows: each gradient's error is within ``eps · (|G| @ |X| + |exact|)`` of the exact
    chain rule through the half-precision logits (``G`` the float64 reference gradient of those logits), plus, for
    entries of ``G`` in float16's subnormal range (confident rows), the smallest subnormal times ``1 @ |X|``. Summing
    the 192 per-chunk products in the half dtype instead exceeds that bound (by 1.3-2.6x at these sizes)."""
    backend, device = backend_device
    if backend == "triton":
        pytest.skip("one Triton launch per row is too slow under the interpreter")
    n, h, c = 192, 16, 40
    hidden, linear_weight, bias, target = _problem(n, h, c, torch.float64, device, ignored=range(0, n, 9))
    hidden, linear_weight, bias = (t.to(dtype) for t in (hidden, linear_weight, bias))
    eps = torch.finfo(dtype).eps
    for uncertainty, mode in (("brier", "grad"), ("focal", "loss"), ("none", "grad")):
        kw = dict(uncertainty=uncertainty, mode=mode, gamma=2.0, reduction="sum")
        loss, d_hidden, d_weight, d_bias = _fused(hidden, linear_weight, bias, target, torch.tensor(1.0),
                                                  backend=backend, chunk_size=1, **kw)
        assert (loss.dtype, d_hidden.dtype, d_weight.dtype, d_bias.dtype) == (dtype,) * 4
        with torch.no_grad():
            logits = torch.addmm(bias, hidden, linear_weight.t())
        logits64 = logits.double().requires_grad_()
        want = R.uncertainty_weighted_ce(logits64, target, **kw)
        (g,) = torch.autograd.grad(want, logits64)
        x, w = hidden.double(), linear_weight.double()
        # a gradient entry below the dtype's smallest normal number (a confident row's, in float16) is rounded to a
        # multiple of the smallest subnormal `tiny`, not to eps relative: each one adds up to `tiny` (over 2) to a
        # product, times the other factor's magnitude
        tiny, ones = torch.finfo(dtype).smallest_normal * eps, torch.ones_like(g)
        for what, got, exact, magnitude, floor in (
                ("d hidden", d_hidden, g @ w, g.abs() @ w.abs(), ones @ w.abs()),
                ("d weight", d_weight, g.t() @ x, g.abs().t() @ x.abs(), ones.t() @ x.abs()),
                ("d bias", d_bias, g.sum(0), g.abs().sum(0), ones.sum(0))):
            ratio = (got.double() - exact).abs() / (eps * (magnitude + exact.abs()) + tiny * floor + 1e-30)
            assert ratio.max() < 1.0, f"{dtype} {uncertainty} {mode} {what}: error {ratio.max():.2f} x the bound"
        assert abs(loss.double() - want.detach()) <= 4 * eps * want.abs() + 1e-6


# ------------------------------------------------------------------------------------------------ autograd contracts
def test_only_the_inputs_that_require_grad_get_gradients():
    hidden, linear_weight, bias, target = _problem(9, 4, 6, torch.float64, "cpu")
    for reduction in ("mean", "none"):
        w = linear_weight.clone().requires_grad_()
        loss = fused_linear(hidden, w, target, bias, reduction=reduction, backend=CPU_BACKEND, chunk_size=4)
        (d_weight,) = torch.autograd.grad(loss.sum(), w)
        want = _reference(hidden, linear_weight, bias, target, torch.ones(() if reduction == "mean" else (9,)),
                          reduction=reduction)
        torch.testing.assert_close(d_weight, want[2])


def test_sample_weight_never_gets_a_gradient():
    hidden, linear_weight, _, target = _problem(6, 4, 5, torch.float64, "cpu")
    sample_weight = torch.rand(6, dtype=torch.float64, requires_grad=True)
    hidden.requires_grad_()
    fused_linear(hidden, linear_weight, target, uncertainty="external", sample_weight=sample_weight,
                 backend=CPU_BACKEND).backward()
    assert hidden.grad is not None and sample_weight.grad is None


def test_no_grad_and_inputs_without_grad_give_the_same_loss():
    hidden, linear_weight, bias, target = _problem(9, 4, 6, torch.float64, "cpu")
    want = R.uncertainty_weighted_ce(hidden @ linear_weight.T + bias, target, uncertainty="dual_focal", mode="loss")
    got = fused_linear(hidden, linear_weight, target, bias, uncertainty="dual_focal", mode="loss", chunk_size=2)
    assert not got.requires_grad
    torch.testing.assert_close(got, want)
    with torch.no_grad():
        hidden.requires_grad_()
        torch.testing.assert_close(fused_linear(hidden, linear_weight, target, bias, uncertainty="dual_focal",
                                                mode="loss", chunk_size=2), want)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_retained_graph_gives_the_same_gradient_twice(reduction):
    hidden, linear_weight, bias, target = _problem(7, 4, 6, torch.float64, "cpu")
    leaves = [t.requires_grad_() for t in (hidden, linear_weight, bias)]
    loss = fused_linear(*leaves[:2], target, leaves[2], reduction=reduction, backend=CPU_BACKEND, chunk_size=3)
    grad_output = _grad_output(reduction, (7,), torch.float64, "cpu")
    first = torch.autograd.grad(loss, leaves, grad_output, retain_graph=True)
    second = torch.autograd.grad(loss, leaves, grad_output)
    for a, b in zip(first, second):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_double_backward_raises(reduction):
    """create_graph=True raises at once: a look-ahead step differentiated with torch.autograd.grad(..., inputs) would
    otherwise leave the second-order term out (the raising node of a gradient returned as a value is on no path to
    the inputs asked for)."""
    hidden, linear_weight, _, target = _problem(5, 3, 4, torch.float64, "cpu")
    hidden.requires_grad_()
    linear_weight.requires_grad_()
    loss = fused_linear(hidden, linear_weight, target, backend=CPU_BACKEND, reduction=reduction).sum()
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(loss, linear_weight, create_graph=True)
    loss = fused_linear(hidden, linear_weight, target, backend=CPU_BACKEND, reduction=reduction).sum()
    with pytest.raises(RuntimeError, match="double backward"):
        loss.backward(create_graph=True)


@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_torch_compile_fullgraph_matches_eager(reduction):
    torch._dynamo.reset()
    hidden, linear_weight, bias, target = _problem(13, 5, 7, torch.float32, "cpu")

    def step(h, w, b, y):
        return fused_linear(h, w, y, b, uncertainty="brier", mode="loss", reduction=reduction, backend=CPU_BACKEND,
                            chunk_size=4)

    compiled = torch.compile(step, fullgraph=True)
    results = []
    for fn in (compiled, step):
        leaves = [t.detach().clone().requires_grad_() for t in (hidden, linear_weight, bias)]
        loss = fn(*leaves, target)
        loss.sum().backward()
        results.append([loss.detach()] + [t.grad for t in leaves])
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------------------------------------- module
def test_module_and_exports():
    hidden, linear_weight, bias, target = _problem(8, 4, 6, torch.float64, "cpu")
    module = FusedLinearUncertaintyWeightedCE(uncertainty="focal", mode="loss", gamma=2.0, reduction="sum",
                                              backend=CPU_BACKEND, chunk_size=3)
    want = fused_linear(hidden, linear_weight, target, bias, uncertainty="focal", mode="loss", gamma=2.0,
                        reduction="sum", backend=CPU_BACKEND, chunk_size=3)
    torch.testing.assert_close(module(hidden, linear_weight, target, bias), want)
    assert "chunk_size=3" in repr(module) and "uncertainty='focal'" in repr(module)
    assert ck.losses.FusedLinearUncertaintyWeightedCE is FusedLinearUncertaintyWeightedCE
    assert ck.fused_linear_uncertainty_weighted_ce is fused_linear
    with pytest.raises(ValueError, match="chunk_size"):
        FusedLinearUncertaintyWeightedCE(chunk_size=0)
    with pytest.raises(ValueError, match="gamma"):
        FusedLinearUncertaintyWeightedCE(gamma=float("nan"))


# ---------------------------------------------------------------------------------------------------- input checks
def test_bad_input_raises():
    hidden, linear_weight, bias, target = _problem(6, 4, 5, torch.float32, "cpu")
    cases = [
        (dict(hidden=hidden[:, :3]), ValueError, "linear_weight shape"),
        (dict(linear_weight=linear_weight[None]), ValueError, "2-D"),
        (dict(hidden=hidden[0]), ValueError, "at least 2 dimensions"),
        (dict(target=target[:5]), ValueError, "target shape"),
        (dict(target=target.float()), TypeError, "integer class indices"),
        (dict(hidden=hidden.long()), TypeError, "floating-point"),
        (dict(linear_weight=linear_weight.double()), TypeError, "linear_weight dtype"),
        (dict(linear_bias=bias[:4]), ValueError, "linear_bias shape"),
        (dict(linear_bias=bias.double()), TypeError, "linear_bias dtype"),
        (dict(hidden=hidden[:0], target=target[:0]), ValueError, "empty batch"),
        (dict(target=torch.full_like(target, 5)), ValueError, "out of range"),
        (dict(chunk_size=0), ValueError, "chunk_size"),
        (dict(chunk_size=-3), ValueError, "chunk_size"),
        (dict(chunk_size=2.0), TypeError, "chunk_size"),
        (dict(chunk_size=True), TypeError, "chunk_size"),
        (dict(uncertainty="nope"), ValueError, "unknown uncertainty"),
        (dict(reduction="avg"), ValueError, "unknown reduction"),
        (dict(gamma=-1.0), ValueError, "gamma"),
        (dict(norm=0.0), ValueError, "norm"),
        (dict(uncertainty="external"), ValueError, "sample_weight"),
        (dict(sample_weight=torch.ones(6)), ValueError, "sample_weight"),
        (dict(gamma=torch.ones(6)), ValueError, "per-sample gamma"),
        (dict(backend="nope"), ValueError, "unknown backend"),
    ]
    for change, error, message in cases:
        args = dict(hidden=hidden, linear_weight=linear_weight, target=target, linear_bias=bias)
        args.update(change)
        kwargs = {k: args.pop(k) for k in list(args) if k not in ("hidden", "linear_weight", "target",
                                                                    "linear_bias")}
        with pytest.raises(error, match=message):
            fused_linear(args["hidden"], args["linear_weight"], args["target"], args["linear_bias"], **kwargs)


def test_inputs_on_different_devices_raise_without_a_gpu():
    """The device checks, with the meta device standing in for a second one."""
    hidden, linear_weight, bias, target = _problem(6, 4, 5, torch.float32, "cpu")
    meta = {name: t.to("meta") for name, t in (("hidden", hidden), ("w", linear_weight), ("b", bias), ("y", target))}
    cases = [((hidden, meta["w"], target, None), {}, "linear_weight is on meta"),
             ((meta["hidden"], linear_weight, meta["y"], None), {}, "linear_weight is on cpu"),
             ((hidden, linear_weight, meta["y"], None), {}, "target is on meta"),
             ((hidden, linear_weight, target, meta["b"]), {}, "linear_bias is on meta"),
             ((hidden, linear_weight, target, bias),
              dict(uncertainty="external", sample_weight=torch.ones(6, device="meta")), "sample_weight is on meta"),
             ((hidden, linear_weight, target, bias), dict(uncertainty="focal", gamma=torch.ones(6, device="meta")),
              "gamma is on meta"),
             ((hidden, linear_weight, target, bias), dict(mix_target=meta["y"], mix_lambda=0.5),
              "mix_target is on meta")]
    for args, kwargs, message in cases:
        with pytest.raises(ValueError, match=message):
            fused_linear(*args, **kwargs)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_inputs_on_different_devices_raise():
    hidden, linear_weight, _, target = _problem(6, 4, 5, torch.float32, "cpu")
    with pytest.raises(ValueError, match="linear_weight is on"):
        fused_linear(hidden, linear_weight.cuda(), target)
    with pytest.raises(ValueError, match="target is on"):
        fused_linear(hidden, linear_weight, target.cuda())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["cuda", "triton"])
def test_a_mix_on_cuda_is_checked_on_the_device(backend):
    """A fused-linear call with a mix on CUDA tensors reads nothing on the host (sync debug mode "error" around the
    call); a mix_target out of range, or a mix_lambda outside [0, 1], raises at synchronize_target_checks()."""
    if _backends.unavailable_reason(backend, torch.device("cuda")) is not None:
        pytest.skip(f"{backend} backend not available")
    hidden, linear_weight, bias, target = _problem(16, 8, 50, torch.float32, "cuda")
    mix = target.flip(0).clamp(min=0)
    lam = torch.rand(16, device="cuda")
    ck.synchronize_target_checks()

    def call(mix_target, mix_lambda):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return fused_linear(hidden, linear_weight, target, bias, backend=backend, mix_target=mix_target,
                                mix_lambda=mix_lambda)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    call(mix, lam)
    ck.synchronize_target_checks()
    bad_mix = mix.clone()
    bad_mix[3] = 50
    with pytest.raises(ValueError, match="mix_target value 50"):
        call(bad_mix, lam)
        ck.synchronize_target_checks()
    bad_lam = lam.clone()
    bad_lam[2] = 1.5
    with pytest.raises(ValueError, match="mix_lambda"):
        call(mix, bad_lam)
        ck.synchronize_target_checks()


# ---------------------------------------------------------------------------------------------------------- memory
_MEMORY_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import torch
    from calibkernels.fused_linear import fused_linear_uncertainty_weighted_ce

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024

    n, h, c = 8192, 256, 32000
    reduction, backend = sys.argv[1], sys.argv[2]
    hidden = torch.randn(n, h, requires_grad=True)
    weight = (torch.randn(c, h) / 16).requires_grad_()
    target = torch.randint(0, c, (n,))
    target[::7] = -100
    gc.collect()
    open("/proc/self/clear_refs", "w").write("5")  # resets the peak resident size (VmHWM)
    before = status("VmRSS")
    loss = fused_linear_uncertainty_weighted_ce(hidden, weight, target, reduction=reduction, backend=backend)
    (loss.sum() if reduction == "none" else loss).backward()
    peak = status("VmHWM") - before
    gradients = (hidden.grad.numel() + weight.grad.numel()) * 4
    assert torch.isfinite(hidden.grad).all() and torch.isfinite(weight.grad).all()
    print(json.dumps((peak - gradients) / (n * c * 4)))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.skipif(not HAS_CPU_KERNEL, reason="no CPU kernel")
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_peak_memory_is_far_below_the_materialised_logits(reduction):
    """(8192 × 256) @ (32000 × 256)ᵀ fp32, forward + backward in a child process: the peak resident memory above the
    inputs and their gradients stays below 1/8 of the 1 GiB of logits that materialising them would take."""
    result = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, reduction, "cpu"], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    peak = float(result.stdout.strip().splitlines()[-1])
    assert peak < 1 / 8, f"peak {peak:.3f} x the logits' size"


@pytest.mark.parametrize("accum_dtype", [None, torch.float32, torch.bfloat16])
def test_accum_dtype_sets_the_weight_gradient_accumulator(accum_dtype):
    """``accum_dtype`` (Liger-Kernel's name): the weight and bias gradients are summed over the chunks in that dtype;
    float32 (the default for 16-bit inputs) matches the float64 reference closely, bfloat16 within its rounding of
    each chunk's sum."""
    torch.manual_seed(0)
    hidden = torch.randn(12, 8, dtype=torch.bfloat16, requires_grad=True)
    weight = (torch.randn(6, 8) * 0.3).to(torch.bfloat16).requires_grad_()
    bias = torch.zeros(6, dtype=torch.bfloat16, requires_grad=True)
    target = torch.randint(0, 6, (12,))
    loss = ck.fused_linear_uncertainty_weighted_ce(hidden, weight, target, bias, chunk_size=3, backend="reference",
                                                   accum_dtype=accum_dtype)
    loss.backward()
    exact_w = weight.detach().double().requires_grad_()
    exact_b = bias.detach().double().requires_grad_()
    logits = hidden.detach().double() @ exact_w.T + exact_b
    ck.reference.uncertainty_weighted_ce(logits, target).backward()
    tolerance = 2e-2 if accum_dtype == torch.bfloat16 else 1e-2
    torch.testing.assert_close(weight.grad.double(), exact_w.grad, rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(bias.grad.double(), exact_b.grad, rtol=tolerance, atol=tolerance)
    with pytest.raises(TypeError, match="accum_dtype"):
        ck.fused_linear_uncertainty_weighted_ce(hidden, weight, target, accum_dtype="float32")


def test_the_module_passes_accum_dtype_through():
    """``FusedLinearUncertaintyWeightedCE(accum_dtype=...)``: the function's gradients with that accumulator, checked
    when built, shown in the repr."""
    torch.manual_seed(0)
    hidden = torch.randn(64, 8, dtype=torch.bfloat16)
    weight = (torch.randn(6, 8) * 0.3).to(torch.bfloat16)
    target = torch.randint(0, 6, (64,))
    for accum_dtype in (None, torch.bfloat16):
        module = FusedLinearUncertaintyWeightedCE(chunk_size=1, reduction="sum", backend="reference",
                                                  accum_dtype=accum_dtype)
        w_module, w_function = weight.clone().requires_grad_(), weight.clone().requires_grad_()
        module(hidden, w_module, target).backward()
        fused_linear(hidden, w_function, target, chunk_size=1, reduction="sum", backend="reference",
                     accum_dtype=accum_dtype).backward()
        assert torch.equal(w_module.grad, w_function.grad), accum_dtype
        assert ("accum_dtype=torch.bfloat16" in repr(module)) == (accum_dtype is not None)
    with pytest.raises(TypeError, match="accum_dtype"):
        FusedLinearUncertaintyWeightedCE(accum_dtype="float32")


def test_a_bfloat16_accumulator_rounds_each_chunks_sum():
    """The accumulator's dtype is the one asked for: over many one-row chunks a bfloat16 sum rounds where float32
    does not."""
    torch.manual_seed(0)
    hidden = torch.randn(64, 8, dtype=torch.bfloat16)
    weight = (torch.randn(6, 8) * 0.3).to(torch.bfloat16)
    target = torch.randint(0, 6, (64,))
    grads = {}
    for accum_dtype in (torch.float32, torch.bfloat16):
        w = weight.clone().requires_grad_()
        ck.fused_linear_uncertainty_weighted_ce(hidden, w, target, chunk_size=1, reduction="sum",
                                                accum_dtype=accum_dtype).backward()
        grads[accum_dtype] = w.grad
    assert not torch.equal(grads[torch.float32], grads[torch.bfloat16])
    torch.testing.assert_close(grads[torch.bfloat16], grads[torch.float32], rtol=5e-2, atol=5e-2)
