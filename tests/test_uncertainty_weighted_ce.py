"""Every fused backend against ``calibkernels.reference``: values and gradients.

Parametrised over every (backend, device) pair this install can run: the reference itself through the public API
(which checks this harness and the reference's low-precision path against float64), the C++ kernel on CPU, the Triton
kernel on CPU
tensors under ``TRITON_INTERPRET=1`` (small shapes only: the interpreter is slow), and on a GPU machine the Triton and
CUDA kernels on CUDA tensors. Backend-specific checks (opcheck, torch.compile, inplace internals) live in
``test_uncertainty_weighted_ce_<backend>.py``.

Tolerance (flash-attention's rule): the kernel's error against a float64 reference may be a small multiple of the
error the reference itself makes at the input's precision, plus a few ulps of the result's magnitude.
"""

import functools
import math
import types
import warnings

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends
from calibkernels import reference as R

from _tolerance import assert_within_reference_error

WEIGHTS = ["none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd"]
MODES = ["loss", "grad"]
REDUCTIONS = ["none", "mean", "sum"]


def _backend_device_pairs():
    devices = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
    return [
        pytest.param((name, dev), id=f"{name}-{dev}")
        for name in ("reference", "cpu", "cuda", "triton")
        for dev in devices
        if _backends.unavailable_reason(name, torch.device(dev)) is None
    ]


BACKENDS = _backend_device_pairs()


def _interpreted(backend_device):
    return backend_device == ("triton", "cpu")


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
@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_every_weight_mode_reduction(backend_device, uncertainty, mode, reduction):
    backend, device = backend_device
    n, c = 13, 37
    z = (torch.randn(n, c) * 3).to(device)
    y = _targets(n, c, device)
    sw = torch.rand(n, device=device) if uncertainty == "external" else None
    gamma = {"none": 0.0, "focal": 2.0, "flsd": 3.0, "dual_focal": 5.0, "brier": 4.0, "external": 0.0,
             "brier_flsd": 2.0}[uncertainty]
    check_against_reference(backend, z, y, grad_out=_grad_out(reduction, n, device), uncertainty=uncertainty, mode=mode,
                            gamma=gamma, norm=2.0, sample_weight=sw, reduction=reduction)


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", ["focal", "dual_focal", "brier"])
@pytest.mark.parametrize("shape", [(5, 1), (7, 3), (9, 1000), (3, 4231), (2, 32000), (2, 65537)],
                         ids=lambda s: f"{s[0]}x{s[1]}")
def test_odd_shapes(backend_device, shape, uncertainty, mode):
    if _interpreted(backend_device) and shape[1] > 1000:
        pytest.skip("Triton interpreter: large C is covered on GPU and by the chunked-path test at small blocks")
    backend, device = backend_device
    n, c = shape
    z = (torch.randn(n, c) * 4).to(device)
    y = _targets(n, c, device)
    check_against_reference(backend, z, y, grad_out=torch.tensor(1.0, device=device), uncertainty=uncertainty,
                            mode=mode, gamma=3.0, reduction="mean")


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=["fp32", "bf16", "fp64"])
@pytest.mark.parametrize("uncertainty, gamma", [("focal", 0.5), ("focal", 2.5), ("focal", 3.5), ("brier", 1.0),
                                           ("brier", 3.0), ("brier", 5.0)])
def test_half_integer_exponents(backend_device, uncertainty, gamma, dtype):
    # (1 - p)^γ and S^(γ/2) with a half-integer exponent (gBS with γ = 1 or 3 and q = 2: S^(1/2), S^(3/2)): the
    # kernels take a square root times repeated squaring there instead of pow. Rows whose base is exactly 0 (a target
    # logit far above the rest) must give pow's 0, and smoothing/a mix the same exponents on soft rows.
    backend, device = backend_device
    if backend == "triton" and dtype == torch.float64:
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
        check_against_reference(backend, z, y, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=2.0,
                                reduction="sum", ulps=ulps)
        check_against_reference(backend, z, y, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=2.0,
                                reduction="sum", label_smoothing=0.1, mix_target=y.flip(0), mix_lambda=0.7, ulps=ulps)


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("norm", [1.0, 1.5, 3.0])
def test_generalised_brier_norms(backend_device, norm):
    backend, device = backend_device
    z = (torch.randn(11, 29) * 2).to(device)
    y = _targets(11, 29, device)
    for mode in MODES:
        check_against_reference(backend, z, y, uncertainty="brier", mode=mode, gamma=2.5, norm=norm, reduction="sum")


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_half_precision(backend_device, dtype, uncertainty, mode):
    backend, device = backend_device
    n, c = 16, 50
    z = _distinct_logits(n, c, dtype, device)
    y = _targets(n, c, device)
    sw = torch.rand(n, device=device) if uncertainty == "external" else None
    check_against_reference(backend, z, y, grad_out=_grad_out("none", n, device), uncertainty=uncertainty, mode=mode,
                            gamma=3.0, sample_weight=sw, reduction="none", ulps=4)


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", ["none", "focal", "flsd", "dual_focal", "brier"])
def test_extreme_infinite_and_confident_rows(backend_device, uncertainty, mode):
    backend, device = backend_device
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
    check_against_reference(backend, z.to(device), y.to(device), uncertainty=uncertainty, mode=mode, gamma=3.0,
                            reduction="none")


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("uncertainty,norm", [("none", 2.0), ("focal", 2.0), ("dual_focal", 2.0), ("brier", 2.0),
                                         ("brier", 3.0)])
def test_logits_of_a_few_thousand_keep_full_precision(backend_device, uncertainty, norm):
    """Rows with a large common offset: p_k must come from (z_k - max) - log d, while e^{z_k - lse} carries the
    rounding of lse (half an ulp of 2000, ~6e-5) into every p_k, far above the reference's own error (this is what
    failed on an H200 for the CUDA kernel). GRA mode: its gradient u (p - e_y) is well conditioned."""
    backend, device = backend_device
    n, c = 8, 300
    z = torch.randn(n, c) * 3 + 2000  # a large common offset: lse ≈ 2000, ulp(2000) = 1.2e-4
    z[1] -= 4000
    y = torch.randint(0, c, (n,))
    y[0] = int(z[0].argmax())  # a confident row whose target is the max
    check_against_reference(backend, z.to(device), y.to(device), uncertainty=uncertainty, mode="grad", gamma=3.0,
                            norm=norm, reduction="sum")


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("uncertainty", ["none", "focal", "dual_focal", "brier"])
def test_nan_logits_give_nan_rows_and_leave_the_others_alone(backend_device, uncertainty):
    """A NaN logit makes its row's loss and gradient NaN (as in the reference), never a plausible number, and does not
    leak into other rows: a NaN beside finite logits, the target itself, a NaN alone in the last (partial) vector of
    its row, a NaN among -inf logits (a thread whose max stays -inf: the GPU kernels' sums must still take it), and a
    two-class row; for dense targets too (not dual focal, which takes none)."""
    backend, device = backend_device
    z = torch.randn(6, 37)
    z[1, 5] = float("nan")  # one NaN, not the target
    z[2, 0] = float("nan")  # the target itself
    z[4, 36] = float("nan")  # alone in the row's last vector (4 float32 columns: 36 is the only one)
    z[5] = float("-inf")
    z[5, 9], z[5, 20] = 1.0, float("nan")  # the one other finite logit is the target
    y = torch.tensor([3, 9, 0, 36, 9, 9])
    loss, grad = _run(backend, z.to(device), y.to(device), uncertainty=uncertainty, reduction="none")
    loss, grad = loss.cpu(), grad.cpu()
    bad = [1, 2, 4, 5]
    assert torch.isnan(loss[bad]).all() and torch.isnan(grad[bad]).all()
    pair = torch.tensor([[0.0, float("nan")], [float("nan"), 0.0]])
    pair_loss, pair_grad = _run(backend, pair.to(device), torch.tensor([0, 0], device=device), uncertainty=uncertainty,
                                reduction="none")
    assert torch.isnan(pair_loss).all() and torch.isnan(pair_grad).all()
    if uncertainty != "dual_focal":
        dense = torch.zeros(2, 5)
        dense[:, :2] = 0.5
        wide = torch.randn(2, 5)
        wide[0, 4] = float("nan")  # a column the target does not weigh, alone in its vector
        dense_loss, dense_grad = _run(backend, wide.to(device), dense.to(device), uncertainty=uncertainty,
                                      reduction="none")
        dense_loss, dense_grad = dense_loss.cpu(), dense_grad.cpu()
        assert torch.isnan(dense_loss[0]) and torch.isnan(dense_grad[0]).all()
        assert torch.isfinite(dense_loss[1]) and torch.isfinite(dense_grad[1]).all()
    good = [0, 3]
    exact_loss, exact_grad = _reference(z[good].double(), y[good], uncertainty=uncertainty, reduction="none")
    low_loss, low_grad = _reference(z[good], y[good], uncertainty=uncertainty, reduction="none")
    assert_within_reference_error(loss[good], exact_loss, low_loss, torch.float32, "loss of the finite rows")
    assert_within_reference_error(grad[good], exact_grad, low_grad, torch.float32, "gradient of the finite rows")


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_per_sample_gamma(backend_device):
    backend, device = backend_device
    z = (torch.randn(10, 17) * 2).to(device)
    y = _targets(10, 17, device)
    gamma = (torch.rand(10) * 5).to(device)
    for mode in MODES:
        check_against_reference(backend, z, y, uncertainty="focal", mode=mode, gamma=gamma, reduction="mean")


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_non_contiguous_rows_and_columns(backend_device):
    backend, device = backend_device
    wide = torch.randn(12, 50, device=device)
    y = _targets(12, 40, device)
    check_against_reference(backend, wide[:, 5:45], y, uncertainty="brier", mode="loss",
                            reduction="sum")  # row stride 50
    check_against_reference(backend, wide[::2, :40], y[:6], uncertainty="dual_focal", mode="grad", reduction="sum")
    tall = torch.randn(40, 12, device=device)
    check_against_reference(backend, tall.t(), y, uncertainty="focal", mode="loss",
                            reduction="mean")  # column stride 12
    before = wide.clone()
    _run(backend, wide[:, 5:45], y, uncertainty="brier")
    assert torch.equal(wide, before), "a non-inplace call must not modify its input"


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_leading_dimensions(backend_device):
    backend, device = backend_device
    z = torch.randn(2, 3, 4, 11, device=device)
    y = torch.randint(0, 11, (2, 3, 4), device=device)
    loss = ck.uncertainty_weighted_ce(z, y, backend=backend, reduction="none")
    assert loss.shape == (2, 3, 4)
    torch.testing.assert_close(loss, R.uncertainty_weighted_ce(z, y, reduction="none"), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("backend_device", BACKENDS)
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_rows_ignored_gives_zero_not_nan(backend_device, reduction):
    backend, device = backend_device
    z = torch.randn(5, 7, device=device)
    y = torch.full((5,), -100, device=device)
    loss, grad = _run(backend, z, y, reduction=reduction)
    assert (loss == 0).all() and (grad == 0).all()


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_custom_ignore_index_and_no_grad(backend_device):
    backend, device = backend_device
    z = torch.randn(8, 6, device=device)
    y = torch.randint(0, 6, (8,), device=device)
    y[2] = 6  # ignore_index may equal C
    check_against_reference(backend, z, y, uncertainty="brier", ignore_index=6)
    with torch.no_grad():
        got = ck.uncertainty_weighted_ce(z, y, backend=backend, ignore_index=6, reduction="none")
    torch.testing.assert_close(got, R.uncertainty_weighted_ce(z, y, ignore_index=6, reduction="none"))


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_inplace_gradient_matches(backend_device):
    backend, device = backend_device
    z = torch.randn(9, 23, device=device)
    y = _targets(9, 23, device)
    leaf = z.clone().requires_grad_()
    logits = leaf * 1.0  # a non-leaf activation, as a model's output would be
    loss = ck.uncertainty_weighted_ce(logits, y, backend=backend, uncertainty="brier", mode="grad", inplace=True)
    loss.backward(torch.tensor(0.5, device=device))
    exact_loss, exact_grad = _reference(z.double(), y, torch.tensor(0.5, dtype=torch.float64), uncertainty="brier")
    torch.testing.assert_close(loss.double(), exact_loss, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(leaf.grad.double(), exact_grad, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_inplace_gradient_is_adopted_without_a_copy(backend_device):
    """inplace=True promises no extra N×C buffer: the leaf's .grad must be the overwritten logits' own memory, also
    while the caller still holds the logits (AccumulateGrad copies a gradient that something else references)."""
    backend, device = backend_device
    if backend == "reference":
        pytest.skip("the reference does not write in place")
    leaf = torch.randn(16, 40, device=device, requires_grad=True)
    logits = leaf.clone()  # non-leaf; CloneBackward passes the gradient on as it is
    ck.uncertainty_weighted_ce(logits, _targets(16, 40, device), backend=backend, inplace=True).backward()
    assert leaf.grad.data_ptr() == logits.data_ptr()


@pytest.mark.parametrize("backend_device", BACKENDS)
def test_out_of_range_targets_raise(backend_device):
    backend, device = backend_device
    z = torch.randn(4, 5, device=device)
    for bad in (5, -1, 1000):
        y = torch.tensor([0, bad, 1, 2], device=device)
        with pytest.raises((ValueError, RuntimeError), match="out of range"):
            loss = ck.uncertainty_weighted_ce(z, y, backend=backend)
            ck.synchronize_target_checks()  # GPU backends raise without stalling the host, so possibly only here
            loss.item()


# ----------------------------------------------------------------------------------------------------------------
# Backend selection
# ----------------------------------------------------------------------------------------------------------------
def test_auto_prefers_a_compiled_kernel_on_cpu():
    if _backends.unavailable_reason("cpu", torch.device("cpu")) is not None:
        pytest.skip("the C++ extension is not built in this install")
    assert _backends.resolve("auto", torch.device("cpu")) == "cpu"
    assert "cpu" in ck.available_backends()


def test_available_backends_always_has_reference():
    backends = ck.available_backends()
    assert backends[0] == "reference"
    assert set(backends) <= {"reference", "cpu", "cuda", "triton"}


def test_named_backend_that_cannot_run_raises():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    with pytest.raises(RuntimeError, match="not available"):
        ck.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), backend="cuda")


def test_auto_falls_back_to_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(_backends, "_AUTO_ORDER", {"cpu": ("cpu",)})
    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: "pretend it is not built")
    monkeypatch.setattr(_backends, "_warned_fallback", set())
    monkeypatch.setattr(_backends, "_chosen", {})  # the kept choices of earlier calls
    monkeypatch.setattr(_backends, "_chosen_hard", {})
    z, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ck.uncertainty_weighted_ce(z, y)
        ck.uncertainty_weighted_ce(z, y)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "falling back" in messages[0] and "pretend it is not built" in messages[0]
    torch.testing.assert_close(first, R.uncertainty_weighted_ce(z, y))


@pytest.mark.parametrize(("num_classes", "kind", "expected"), [
    (16, "hard", "cuda"), (1000, "hard", "cuda"), (4096, "hard", "cuda"), (4097, "hard", "triton"),
    (128256, "hard", "triton"), (4096, "smooth", "cuda"), (4097, "smooth", "triton"), (1000, "mix", "cuda"),
    (32000, "mix", "cuda"), (32001, "mix", "triton"), (1000, "dense", "cuda"), (1001, "dense", "triton"),
])
def test_auto_on_a_gpu_picks_the_kernel_by_row_width_and_target_kind(monkeypatch, num_classes, kind, expected):
    """backend="auto" on CUDA tensors (a device object only: both GPU backends made to look available): the CUDA
    kernel up to AUTO_CUDA_MAX_CLASSES[kind], Triton past it; the other kernel where the first cannot run; a named
    backend as named; on the CPU the CPU kernel."""
    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: None)
    monkeypatch.setattr(_backends, "module", lambda name: types.SimpleNamespace(SOFT_TARGETS=True))
    cuda = torch.device("cuda")
    assert _backends.resolve_for_shape("auto", cuda, num_classes, kind) == expected
    other = {"cuda": "triton", "triton": "cuda"}[expected]
    monkeypatch.setattr(_backends, "unavailable_reason",
                        lambda name, device: "pretend it is not built" if name == expected else None)
    assert _backends.resolve_for_shape("auto", cuda, num_classes, kind) == other
    assert _backends.resolve_for_shape(other, cuda, num_classes, kind) == other
    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: None)
    assert _backends.resolve_for_shape("auto", torch.device("cpu"), num_classes, kind) == "cpu"


def test_auto_on_a_gpu_keeps_soft_targets_off_a_kernel_without_them(monkeypatch):
    """A soft-target call never goes to a kernel that cannot run soft targets, nor a per-sample gamma that requires
    grad to a fused kernel: the table's first choice gives way as resolve_soft_targets decides."""
    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: None)
    monkeypatch.setattr(_backends, "module",
                        lambda name: types.SimpleNamespace(SOFT_TARGETS=name != "cuda"))
    cuda = torch.device("cuda")
    assert _backends.resolve_for_shape("auto", cuda, 1000, "smooth") == "triton"
    assert _backends.resolve_for_shape("auto", cuda, 1000, "hard") == "cuda"
    monkeypatch.setattr(_backends, "module", lambda name: types.SimpleNamespace(SOFT_TARGETS=True))
    monkeypatch.setattr(_backends, "_warned_soft_targets", True)
    assert _backends.resolve_for_shape("auto", cuda, 1000, "mix", gamma_needs_grad=True) == "reference"


def test_reference_compiles_with_fullgraph():
    model = torch.nn.Linear(6, 5)
    z_in, y = torch.randn(8, 6), torch.randint(0, 5, (8,))

    def step(x, target):
        return R.uncertainty_weighted_ce(model(x), target, uncertainty="brier", mode="grad")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(z_in, y), step(z_in, y))
    assert not math.isnan(compiled(z_in, y).item())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="memory pools need a GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_a_call_leaves_nothing_in_a_memory_pool(backend):
    """A pool that takes the thread's allocations (``torch.cuda.use_mem_pool``; torch.compile's CUDA-graph warm-up
    routes them the same way) holds nothing once the call's outputs are gone, also on a stream that no call has used,
    whose ticket counter the call creates: the backends keep those counters outside every pool."""
    if backend not in ck.available_backends():
        pytest.skip(f"{backend} backend not built")
    pool = torch.cuda.MemPool()
    z = torch.randn(64, 1000, device="cuda", requires_grad=True)
    y = torch.randint(0, 1000, (64,), device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.use_mem_pool(pool):
        loss = ck.uncertainty_weighted_ce(z, y, uncertainty="brier", backend=backend)
        loss.backward()
        del loss
    torch.cuda.synchronize()
    ck.synchronize_target_checks()
    z.grad = None
    live = [block for segment in pool.snapshot(include_traces=False) for block in segment["blocks"]
            if block["state"] == "active_allocated"]
    assert live == [], live


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_a_step_with_the_loss_inside_reduce_overhead_compilation(backend):
    """A linear model and the fused loss compiled together with mode="reduce-overhead" (CUDA graphs, fullgraph): the
    replayed steps give the eager step's loss and gradients, with a mix and without; the eager calls make no host
    synchronisation (torch.cuda.set_sync_debug_mode("error"))."""
    if backend not in ck.available_backends():
        pytest.skip(f"{backend} backend not built")
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1000, device="cuda")

    def forward(x, y, mix_target, mix_lambda):
        return ck.uncertainty_weighted_ce(model(x), y, uncertainty="brier", backend=backend, mix_target=mix_target,
                                          mix_lambda=mix_lambda)

    compiled_forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)

    def step(run, *args):  # the backward of the compiled forward runs as a compiled graph too
        loss = run(*args)
        loss.backward()
        return loss.detach()

    compiled = functools.partial(step, compiled_forward)
    eager = functools.partial(step, forward)
    for _ in range(4):  # warm-up, recording, replays with new data
        x = torch.randn(256, 64, device="cuda")
        y = torch.randint(0, 1000, (256,), device="cuda")
        lam = torch.rand((), device="cuda")
        model.zero_grad(set_to_none=True)
        got = compiled(x, y, y.flip(0), lam).clone()
        got_grad = model.weight.grad.clone()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            expected = eager(x, y, y.flip(0), lam)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_grad, model.weight.grad, rtol=1e-4, atol=1e-5)


def _backends_here():
    return [b for b in ("cpu", "triton", "reference") if b == "reference" or b in ck.available_backends()
            and _backends.unavailable_reason(b, torch.device("cpu")) is None]


@pytest.mark.parametrize("backend", _backends_here())
def test_dual_focal_soft_targets_have_their_values_checked_on_every_backend(backend):
    """The dual-focal weight takes soft targets only when they are one-hot, and turns them into class indices before
    any kernel runs, so no kernel sees their values: a mix class out of range or a dense row that is not a
    distribution raises on every backend (the CPU backend had left both to its kernel, which never saw them)."""
    z = torch.randn(4, 5)
    with pytest.raises(ValueError, match="mix_target value 99 is out of range"):
        ck.uncertainty_weighted_ce(z, torch.tensor([0, 1, 2, 3]), uncertainty="dual_focal", backend=backend,
                                   mix_target=torch.tensor([1, 2, 99, 0]), mix_lambda=torch.tensor([1., 0., 1., 1.]))
    dense = torch.eye(5)[:4].clone()
    dense[1, 2] = 1.0  # sums to 2
    with pytest.raises(ValueError, match="row 1 sums to 2"):
        ck.uncertainty_weighted_ce(z, dense, uncertainty="dual_focal", backend=backend)


@pytest.mark.parametrize("backend", _backends_here())
def test_a_dense_target_call_checks_ignore_index_like_a_class_index_call(backend):
    """``ignore_index`` must be an int whatever the target: a dense target had skipped the check (a float was taken
    silently by some backends, refused by the CPU op's schema with a RuntimeError)."""
    z, dense = torch.randn(3, 4), torch.softmax(torch.randn(3, 4), dim=1)
    for bad in (-100.0, True, 1.5):
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            ck.uncertainty_weighted_ce(z, dense, ignore_index=bad, backend=backend)


@pytest.mark.parametrize("backend", _backends_here())
def test_one_class_logits_with_any_column_stride(backend):
    """(N, 1) logits whose column stride is not 1 (a transposed row): every backend gives the loss of one class, 0,
    with a zero gradient (Triton had refused them: PyTorch's contiguous() keeps the stride of a size-1 dimension)."""
    x = torch.randn(1, 4).t().requires_grad_()
    assert x.stride(1) != 1
    loss = ck.uncertainty_weighted_ce(x, torch.zeros(4, dtype=torch.long), backend=backend)
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all()
