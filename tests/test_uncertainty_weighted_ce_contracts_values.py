"""Every fused backend against ``calibkernels.reference``: values and gradients, the compiled op under
``torch.library.opcheck`` and the loss under ``torch.compile(fullgraph=True)``.

Written once against conftest.py's ``backend`` fixture (every fused backend this install runs, with its device: the
C++ kernel on CPU tensors, the Triton kernel on CPU tensors under ``TRITON_INTERPRET=1`` (small shapes only: the
interpreter is slow), and on a GPU machine the Triton and CUDA kernels on CUDA tensors); the value checks run on the
reference too (``backend_or_reference``), which checks this harness and the reference's low-precision path against
float64. Kernel internals live in ``test_uncertainty_weighted_ce_<backend>*.py``.

Tolerance (flash-attention's rule): the kernel's error against a float64 reference may be a small multiple of the
error the reference itself makes at the input's precision, plus a few ulps of the result's magnitude.
"""

import pytest
import torch

import calibkernels as ck
from calibkernels import _validation as V
from calibkernels import reference as R

from _tolerance import assert_within_reference_error

WEIGHTS = ["none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd"]
MODES = ["loss", "grad"]
REDUCTIONS = ["none", "mean", "sum"]


def _distinct_logits(n, c, dtype, device, spread=0.125):
    """Rows of distinct values that are exact in fp16/bf16 (for c ≤ 256), so no ties change dual focal's p_j."""
    rows = torch.stack([torch.randperm(c) for _ in range(n)]).to(torch.float64)
    return ((rows - c / 2) * spread).to(dtype).to(device)


def _run(backend, z, y, grad_out=None, **kw):
    x = z.detach().clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(x, y, backend=backend, **kw)
    loss.backward(torch.ones_like(loss) if grad_out is None else grad_out.to(loss.dtype))
    return loss.detach(), x.grad


def _reference(z, y, grad_out=None, **kw):
    x = z.detach().clone().requires_grad_()
    loss = R.uncertainty_weighted_ce(x, y, **kw)
    loss.backward(torch.ones_like(loss) if grad_out is None else grad_out.to(loss.dtype))
    return loss.detach(), x.grad


def check_against_reference(backend, z, y, *, grad_out=None, ulps=64, **kw):
    dtype = z.dtype
    sw = kw.pop("sample_weight", None)
    gamma = kw.pop("gamma", 4.0 if kw.get("uncertainty", "brier") == "brier" else 2.0)
    loss, grad = _run(backend, z, y, grad_out, sample_weight=sw, gamma=gamma, **kw)
    assert loss.dtype == dtype and grad.dtype == dtype
    exact_loss, exact_grad = _reference(
        z.double(), y, None if grad_out is None else grad_out.double(),
        sample_weight=None if sw is None else sw.double(),
        gamma=gamma.double() if isinstance(gamma, torch.Tensor) else gamma, **kw)
    low_loss, low_grad = _reference(z, y, grad_out, sample_weight=sw, gamma=gamma, **kw)
    assert_within_reference_error(loss, exact_loss, low_loss, dtype, "loss", ulps)
    assert_within_reference_error(grad, exact_grad, low_grad, dtype, "gradient", ulps)


def _targets(n, c, device, ignore=True):
    y = torch.randint(0, c, (n,), device=device)
    if ignore and n >= 4:
        y[torch.randperm(n)[: n // 4]] = -100
    return y


def _grad_out(reduction, n, device):
    # not 1, so the backward's scaling by grad_output is exercised
    return torch.rand(n, device=device) + 0.5 if reduction == "none" else torch.tensor(0.75, device=device)


# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_every_weight_mode_reduction(backend_or_reference, uncertainty, mode, reduction):
    name, device = backend_or_reference
    n, c = 13, 37
    z = (torch.randn(n, c) * 3).to(device)
    y = _targets(n, c, device)
    sw = torch.rand(n, device=device) if uncertainty == "external" else None
    gamma = {"none": 0.0, "focal": 2.0, "flsd": 3.0, "dual_focal": 5.0, "brier": 4.0, "external": 0.0,
             "brier_flsd": 2.0}[uncertainty]
    check_against_reference(name, z, y, grad_out=_grad_out(reduction, n, device), uncertainty=uncertainty, mode=mode,
                            gamma=gamma, norm=2.0, sample_weight=sw, reduction=reduction)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", ["focal", "dual_focal", "brier"])
@pytest.mark.parametrize("shape", [(5, 1), (7, 3), (9, 1000), (3, 4231), (2, 32000), (2, 65537)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_odd_shapes(backend_or_reference, shape, uncertainty, mode):
    if backend_or_reference.interpreted and shape[1] > 1000:
        pytest.skip("Triton interpreter: large C is covered on GPU and by the chunked-path test at small blocks")
    name, device = backend_or_reference
    n, c = shape
    z = (torch.randn(n, c) * 4).to(device)
    y = _targets(n, c, device)
    check_against_reference(name, z, y, grad_out=torch.tensor(1.0, device=device), uncertainty=uncertainty,
                            mode=mode, gamma=3.0, reduction="mean")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("uncertainty, gamma", [("focal", 0.5), ("focal", 2.5), ("focal", 3.5), ("brier", 1.0),
                                           ("brier", 3.0), ("brier", 5.0)])
def test_half_integer_exponents(backend_or_reference, uncertainty, gamma, dtype):
    # (1 - p)^γ and S^(γ/2) with a half-integer exponent (gBS with γ = 1 or 3 and q = 2: S^(1/2), S^(3/2)): the
    # kernels take a square root times repeated squaring there instead of pow. Rows whose base is exactly 0 (a target
    # logit far above the rest) must give pow's 0, and smoothing/a mix the same exponents on soft rows.
    name, device = backend_or_reference
    if name == "triton" and dtype == torch.float64:
        pytest.skip("the Triton backend takes no float64 logits")
    z = (torch.randn(12, 33, dtype=dtype) * 3)
    z[0, 4] = 200.0  # saturated rows: 1 - p_y and S underflow to 0
    z[1, 7] = 200.0
    y = torch.randint(0, 33, (12,))
    y[0], y[1] = 4, 7
    z, y = z.to(device), y.to(device)
    # float64: "loss" mode's focal gradient on rows with p_y near 1e-6 (CE near 14) is about 100 ulps off the float64
    # reference, with pow as with the square root (the same bits); the reference then has no error of its own to scale
    for mode in MODES:
        ulps = 256 if dtype == torch.float64 and uncertainty == "focal" and mode == "loss" else 64
        check_against_reference(name, z, y, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=2.0,
                                reduction="sum", ulps=ulps)
        check_against_reference(name, z, y, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=2.0,
                                reduction="sum", label_smoothing=0.1, mix_target=y.flip(0), mix_lambda=0.7, ulps=ulps)


@pytest.mark.parametrize("norm", [1.0, 1.5, 3.0])
def test_generalised_brier_norms(backend_or_reference, norm):
    name, device = backend_or_reference
    z = (torch.randn(11, 29) * 2).to(device)
    y = _targets(11, 29, device)
    for mode in MODES:
        check_against_reference(name, z, y, uncertainty="brier", mode=mode, gamma=2.5, norm=norm, reduction="sum")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_half_precision(backend_or_reference, dtype, uncertainty, mode):
    name, device = backend_or_reference
    n, c = 16, 50
    z = _distinct_logits(n, c, dtype, device)
    y = _targets(n, c, device)
    sw = torch.rand(n, device=device) if uncertainty == "external" else None
    check_against_reference(name, z, y, grad_out=_grad_out("none", n, device), uncertainty=uncertainty, mode=mode,
                            gamma=3.0, sample_weight=sw, reduction="none", ulps=4)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", ["none", "focal", "flsd", "dual_focal", "brier"])
def test_extreme_infinite_and_confident_rows(backend_or_reference, uncertainty, mode):
    name, device = backend_or_reference
    c = 9
    z = torch.randn(6, c)
    z[0, 0], z[0, 1] = 1e4, -1e4  # extreme logits, target 0: p_y = 1 exactly
    z[1, 3] = -1e4  # extreme, target far below the max
    z[1, 5] = 1e4
    z[2, [1, 4, 7]] = float("-inf")  # masked classes (never the target)
    z[3, 2] = 40.0  # confident: 1 - p_y ≈ 1e-17, must not cancel to 0 in the weight's derivative
    z[4, 6] = 12.0  # p_y → 1 but representable
    z[5] = 0.0  # uniform row: all classes tie with the target
    y = torch.tensor([0, 3, 0, 2, 6, 4])
    check_against_reference(name, z.to(device), y.to(device), uncertainty=uncertainty, mode=mode, gamma=3.0,
                            reduction="none")


@pytest.mark.parametrize("uncertainty,norm", [("none", 2.0), ("focal", 2.0), ("dual_focal", 2.0), ("brier", 2.0),
                                         ("brier", 3.0)])
def test_logits_of_a_few_thousand_keep_full_precision(backend_or_reference, uncertainty, norm):
    """Rows with a large common offset: p_k must come from (z_k - max) - log d, while e^{z_k - lse} carries the
    rounding of lse (half an ulp of 2000, ~6e-5) into every p_k, far above the reference's own error (this is what
    failed on an H200 for the CUDA kernel). GRA mode: its gradient u (p - e_y) is well conditioned."""
    name, device = backend_or_reference
    n, c = 8, 300
    z = torch.randn(n, c) * 3 + 2000  # a large common offset: lse ≈ 2000, ulp(2000) = 1.2e-4
    z[1] -= 4000
    y = torch.randint(0, c, (n,))
    y[0] = int(z[0].argmax())  # a confident row whose target is the max
    check_against_reference(name, z.to(device), y.to(device), uncertainty=uncertainty, mode="grad", gamma=3.0,
                            norm=norm, reduction="sum")


@pytest.mark.parametrize("uncertainty", ["none", "focal", "dual_focal", "brier"])
def test_nan_logits_give_nan_rows_and_leave_the_others_alone(backend_or_reference, uncertainty):
    """A NaN logit makes its row's loss and gradient NaN (as in the reference), never a plausible number, and does not
    leak into other rows: a NaN beside finite logits, the target itself, a NaN alone in the last (partial) vector of
    its row, a NaN among -inf logits (a thread whose max stays -inf: the GPU kernels' sums must still take it), and a
    two-class row; for dense targets too (not dual focal, which takes none)."""
    name, device = backend_or_reference
    z = torch.randn(6, 37)
    z[1, 5] = float("nan")  # one NaN, not the target
    z[2, 0] = float("nan")  # the target itself
    z[4, 36] = float("nan")  # alone in the row's last vector (4 float32 columns: 36 is the only one)
    z[5] = float("-inf")
    z[5, 9], z[5, 20] = 1.0, float("nan")  # the one other finite logit is the target
    y = torch.tensor([3, 9, 0, 36, 9, 9])
    loss, grad = _run(name, z.to(device), y.to(device), uncertainty=uncertainty, reduction="none")
    loss, grad = loss.cpu(), grad.cpu()
    bad = [1, 2, 4, 5]
    assert torch.isnan(loss[bad]).all() and torch.isnan(grad[bad]).all()
    pair = torch.tensor([[0.0, float("nan")], [float("nan"), 0.0]])
    pair_loss, pair_grad = _run(name, pair.to(device), torch.tensor([0, 0], device=device), uncertainty=uncertainty,
                                reduction="none")
    assert torch.isnan(pair_loss).all() and torch.isnan(pair_grad).all()
    if uncertainty != "dual_focal":
        dense = torch.zeros(2, 5)
        dense[:, :2] = 0.5
        wide = torch.randn(2, 5)
        wide[0, 4] = float("nan")  # a column the target does not weigh, alone in its vector
        dense_loss, dense_grad = _run(name, wide.to(device), dense.to(device), uncertainty=uncertainty,
                                      reduction="none")
        dense_loss, dense_grad = dense_loss.cpu(), dense_grad.cpu()
        assert torch.isnan(dense_loss[0]) and torch.isnan(dense_grad[0]).all()
        assert torch.isfinite(dense_loss[1]) and torch.isfinite(dense_grad[1]).all()
    good = [0, 3]
    exact_loss, exact_grad = _reference(z[good].double(), y[good], uncertainty=uncertainty, reduction="none")
    low_loss, low_grad = _reference(z[good], y[good], uncertainty=uncertainty, reduction="none")
    assert_within_reference_error(loss[good], exact_loss, low_loss, torch.float32, "loss of the finite rows")
    assert_within_reference_error(grad[good], exact_grad, low_grad, torch.float32, "gradient of the finite rows")


def test_per_sample_gamma(backend_or_reference):
    name, device = backend_or_reference
    z = (torch.randn(10, 17) * 2).to(device)
    y = _targets(10, 17, device)
    gamma = (torch.rand(10) * 5).to(device)
    for mode in MODES:
        check_against_reference(name, z, y, uncertainty="focal", mode=mode, gamma=gamma, reduction="mean")


def test_non_contiguous_rows_and_columns(backend_or_reference):
    name, device = backend_or_reference
    wide = torch.randn(12, 50, device=device)
    y = _targets(12, 40, device)
    check_against_reference(name, wide[:, 5:45], y, uncertainty="brier", mode="loss",
                            reduction="sum")  # row stride 50
    check_against_reference(name, wide[::2, :40], y[:6], uncertainty="dual_focal", mode="grad", reduction="sum")
    tall = torch.randn(40, 12, device=device)
    check_against_reference(name, tall.t(), y, uncertainty="focal", mode="loss",
                            reduction="mean")  # column stride 12
    before = wide.clone()
    _run(name, wide[:, 5:45], y, uncertainty="brier")
    assert torch.equal(wide, before), "a non-inplace call must not modify its input"


def test_leading_dimensions(backend_or_reference):
    name, device = backend_or_reference
    z = torch.randn(2, 3, 4, 11, device=device)
    y = torch.randint(0, 11, (2, 3, 4), device=device)
    loss = ck.uncertainty_weighted_ce(z, y, backend=name, reduction="none")
    assert loss.shape == (2, 3, 4)
    torch.testing.assert_close(loss, R.uncertainty_weighted_ce(z, y, reduction="none"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored_gives_zero_not_nan(backend_or_reference, reduction):
    name, device = backend_or_reference
    z = torch.randn(5, 7, device=device)
    y = torch.full((5,), -100, device=device)
    loss, grad = _run(name, z, y, reduction=reduction)
    assert (loss == 0).all() and (grad == 0).all()


def test_custom_ignore_index_and_no_grad(backend_or_reference):
    name, device = backend_or_reference
    z = torch.randn(8, 6, device=device)
    y = torch.randint(0, 6, (8,), device=device)
    y[2] = 6  # ignore_index may equal C
    check_against_reference(name, z, y, uncertainty="brier", ignore_index=6)
    with torch.no_grad():
        got = ck.uncertainty_weighted_ce(z, y, backend=name, ignore_index=6, reduction="none")
    torch.testing.assert_close(got, R.uncertainty_weighted_ce(z, y, ignore_index=6, reduction="none"))


def test_inplace_gradient_matches(backend_or_reference):
    name, device = backend_or_reference
    z = torch.randn(9, 23, device=device)
    y = _targets(9, 23, device)
    leaf = z.clone().requires_grad_()
    logits = leaf * 1.0  # a non-leaf activation, as a model's output would be
    loss = ck.uncertainty_weighted_ce(logits, y, backend=name, uncertainty="brier", mode="grad", inplace=True)
    loss.backward(torch.tensor(0.5, device=device))
    exact_loss, exact_grad = _reference(z.double(), y, torch.tensor(0.5, dtype=torch.float64), uncertainty="brier")
    torch.testing.assert_close(loss.double(), exact_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), exact_grad, rtol=1e-5, atol=1e-7)


def test_inplace_gradient_is_adopted_without_a_copy(backend):
    """inplace=True promises no extra N×C buffer: the leaf's .grad must be the overwritten logits' own memory, also
    while the caller still holds the logits (AccumulateGrad copies a gradient that something else references).
    (The reference does not write in place.)"""
    name, device = backend
    leaf = torch.randn(16, 40, device=device, requires_grad=True)
    logits = leaf.clone()  # non-leaf; CloneBackward passes the gradient on as it is
    ck.uncertainty_weighted_ce(logits, _targets(16, 40, device), backend=name, inplace=True).backward()
    assert leaf.grad.data_ptr() == logits.data_ptr()


def test_out_of_range_targets_raise(backend_or_reference):
    name, device = backend_or_reference
    z = torch.randn(4, 5, device=device)
    for bad in (5, -1, 1000, 10**6):
        y = torch.tensor([0, bad, 1, 2], device=device)
        with pytest.raises((ValueError, RuntimeError), match="out of range"):
            loss = ck.uncertainty_weighted_ce(z, y, backend=name)
            ck.synchronize_target_checks()  # GPU backends raise without stalling the host, so possibly only here
            loss.item()


# ----------------------------------------------------------------------------------------------------------------
# The compiled op under opcheck, the loss under torch.compile
# ----------------------------------------------------------------------------------------------------------------
# The op's (dtype, uncertainty, mode, reduction) cases that every backend takes under opcheck; the C++ CPU op takes the
# whole grid below (a launch on a GPU or through the interpreter costs far more than a CPU call)
_OPCHECK_EVERY_BACKEND = {(torch.float32, "brier", "loss", "mean"), (torch.float32, "focal", "grad", "none"),
                          (torch.float32, "dual_focal", "loss", "sum")}


def _op_args(z, y, *, uncertainty="brier", mode="grad", reduction="mean", gamma=4.0, norm=2.0, gamma_per_sample=None):
    """The op's positional arguments after the logits, up to (not with) ``compute_grad``."""
    sample_weight = torch.rand(z.shape[0], device=z.device) + 0.5 if uncertainty == "external" else None
    return (y, sample_weight, gamma_per_sample, V.WEIGHT_CODES[uncertainty], V.MODE_CODES[mode],
            0.0 if gamma_per_sample is not None else gamma, norm, -100, V.REDUCTION_CODES[reduction])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=["fp32", "fp64", "bf16"])
@pytest.mark.parametrize("uncertainty", WEIGHTS)
@pytest.mark.parametrize("mode,reduction", [("loss", "mean"), ("grad", "none"), ("loss", "sum")])
def test_opcheck(backend, dtype, uncertainty, mode, reduction):
    """The one op in its uses: gradient returned (grad_out None), none computed, written into a caller's buffer, and in
    place (grad_out is the logits); the compiled C++ op also with the loss in the logits' dtype (loss_in_logits_dtype,
    rounded once from the float32 loss). Inputs do not require grad: the op is mutable (grad_out is Tensor(a!)?), so
    its autograd lives in calibkernels/_autograd.py, not in a register_autograd formula that opcheck could test."""
    if backend.name != "cpu" and (dtype, uncertainty, mode, reduction) not in _OPCHECK_EVERY_BACKEND:
        pytest.skip("the C++ CPU op's grid; a GPU or interpreted kernel takes the few cases every backend takes")
    z = torch.randn(5, 11, dtype=dtype, device=backend.device)
    y = _targets(5, 11, backend.device)  # one ignored row
    args = _op_args(z, y, uncertainty=uncertainty, mode=mode, reduction=reduction)
    op = backend.op
    torch.library.opcheck(op, (z, *args, True, None))
    torch.library.opcheck(op, (z, *args, False, None))
    torch.library.opcheck(op, (z, *args, True, torch.empty_like(z)))
    buffer = z.clone()
    torch.library.opcheck(op, (buffer, *args, True, buffer))
    if backend.name == "triton":
        return  # the Triton op writes its loss in float32 only
    torch.library.opcheck(op, (z, *args, True, None), {"loss_in_logits_dtype": True})
    loss, *_ = op(z, *args, True, None, loss_in_logits_dtype=True)
    wide, *_ = op(z, *args, True, None)
    assert loss.dtype == dtype and wide.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(loss, wide.to(dtype))  # rounded once, from the float32 loss


def test_opcheck_per_sample_gamma(backend):
    z = torch.randn(6, 5, device=backend.device)
    y = _targets(6, 5, backend.device)
    args = _op_args(z, y, uncertainty="focal", mode="loss", gamma_per_sample=torch.rand(6, device=backend.device) * 4)
    torch.library.opcheck(backend.op, (z, *args, True, None))
    buffer = z.clone()
    torch.library.opcheck(backend.op, (buffer, *args, True, buffer))


def test_inplace_op_writes_the_gradient_only_inside_the_logits(backend):
    """The op with grad_out = the logits, a view whose rows are wider than C: the loss as out of place, the gradient
    left in the view and nowhere else (the padding between rows intact), no gradient returned; with grad_out a
    separate buffer, the same loss and gradient there. The C++ CPU op also writes back through a transposed
    (column-strided) view; the Triton op refuses one (its kernels need a unit column stride)."""
    device = backend.device
    n, c, pad = 5, 11, 4
    buffer = torch.full((n, c + pad), 123.0, device=device)
    view = buffer[:, :c]
    view.copy_(torch.randn(n, c, device=device))
    logits = view.clone()
    y = _targets(n, c, device)
    args = _op_args(logits, y, reduction="sum")
    expected_loss, expected_grad, *_ = backend.op(logits, *args, True, None)
    loss, returned, *_ = backend.op(view, *args, True, view)
    assert returned.numel() == 0
    assert (buffer[:, c:] == 123.0).all(), "padding between rows was written"
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(view, expected_grad)
    into = torch.full_like(logits, float("nan"))
    loss, returned, *_ = backend.op(logits, *args, True, into)
    assert returned.numel() == 0
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(into, expected_grad)
    base = torch.randn(9, 6, device=device)
    transposed = base.t()  # (6, 9), column stride 6
    args = _op_args(transposed, _targets(6, 9, device))
    if backend.name == "triton":
        with pytest.raises(ValueError, match="unit column stride"):
            backend.op(transposed, *args, True, transposed)
    elif backend.name == "cpu":
        expected_loss, expected_grad, *_ = backend.op(transposed.contiguous(), *args, True, None)
        loss, *_ = backend.op(transposed, *args, True, transposed)
        torch.testing.assert_close(loss, expected_loss)
        torch.testing.assert_close(base.t(), expected_grad)


def test_no_gradient_buffer_without_grad(backend):
    """compute_grad=False writes no N×C gradient, and the loss is the reference's; the target flag is empty from the
    C++ CPU op (which raises on a bad target) and two slots, no bad target, from the GPU and Triton ops. Logits that
    require grad under no_grad: no gradient either, and inplace=True leaves them intact."""
    z = torch.randn(6, 13, device=backend.device)
    y = _targets(6, 13, backend.device)
    loss, grad, flag, *_ = backend.op(z, *_op_args(z, y), False, None)
    assert grad.shape == (0,) and loss.shape == (), "compute_grad=False must not write an N×C gradient"
    if backend.name == "cpu":
        assert flag.shape == (0,)
    else:
        assert flag.shape == (2,) and flag.tolist()[0] == 0
    torch.testing.assert_close(loss, R.uncertainty_weighted_ce(z, y), rtol=1e-5, atol=1e-6)
    with torch.no_grad():
        x = z.clone().requires_grad_()
        before = x.detach().clone()
        ck.uncertainty_weighted_ce(x, y, backend=backend.name, inplace=True)
        assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
def test_model_and_loss_compile_with_fullgraph(backend, inplace):
    """A model + the fused loss trace into one graph (fullgraph=True) and give eager's loss and parameter gradients
    (Inductor on a GPU; on the CPU the graph is checked with aot_eager, Inductor's C++ build adds nothing here)."""
    torch._dynamo.reset()
    device = backend.device
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 9)).to(device)
    x, y = torch.randn(8, 6, device=device), _targets(8, 9, device)

    def step(features, target):
        return ck.uncertainty_weighted_ce(model(features), target, uncertainty="brier", mode="grad",
                                          backend=backend.name, inplace=inplace)

    compiled = torch.compile(step, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    compiled_loss = compiled(x, y)
    compiled_loss.backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager_loss = step(x, y)
    eager_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss)
    for got, expected in zip(compiled_grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, expected)
