"""Triton backend internals: the chunked two-read path, inplace, the device-side target check, the backward's
scaling, the GPU's real block sizes and CUDA graphs, the target-check policies. Soft
targets are in ``test_uncertainty_weighted_ce_triton_soft_targets.py``, the ahead-of-time compilation in
``test_uncertainty_weighted_ce_triton_aot.py``.

Runs on CPU tensors through ``TRITON_INTERPRET=1`` (set by conftest.py when no GPU is present; small shapes only, the
interpreter is slow) and again on CUDA tensors when a GPU is present. The value checks against the reference for every
weight × mode × reduction through the public API, opcheck and torch.compile live in
``test_uncertainty_weighted_ce_contracts*.py``; here the kernel is also
called directly, below the public API's host-side target check.
"""

import os

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends, _target_checks
from calibkernels import reference as R

from _triton_helpers import (WEIGHTS, DEVICES, _targets, _inputs, _op_args, _run, _reference_loss_and_grad,
                             _triton_loss_and_grad, _close)

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
# The chunked (two-read) path against the reference, every weight × mode × reduction
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", ["none", "mean", "sum"])
@pytest.mark.parametrize("mode", ["loss", "grad"])
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_chunked_path_matches_reference(small_block, device, uncertainty, mode, reduction):
    n, c = 7, 37
    assert c > T.MAX_BLOCK, "the fixture must force several chunks"
    z = torch.randn(n, c, device=device) * 3
    z[0, 5] = float("-inf")  # a masked class, usually in another chunk than the max
    y = _targets(n, c, device)
    y[1] = 36  # target in the last, partial chunk
    sw = torch.rand(n, device=device) if uncertainty == "external" else None
    grad_out = torch.rand(n, device=device) + 0.5 if reduction == "none" else torch.tensor(0.75, device=device)
    kw = dict(uncertainty=uncertainty, mode=mode, reduction=reduction, sample_weight=sw)
    loss, grad = _triton_loss_and_grad(z, y, grad_out, **kw)
    exact_loss, exact_grad = _reference_loss_and_grad(z, y, grad_out, **kw)
    _close(loss, exact_loss, torch.float32, "loss")
    _close(grad, exact_grad, torch.float32, "gradient")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", ["loss", "grad"])
def test_dual_focal_ties_across_chunks(small_block, device, mode):
    """p_j's ties split the gradient (as amax's backward does) also when the tied classes sit in different chunks."""
    c = 23
    z = torch.randn(4, c, device=device)
    y = torch.tensor([0, 1, 2, 3], device=device)
    z[:, :4] = 3.0
    z[0, [7, 15, 22]] = 2.5  # three-way tie for p_j, in three chunks
    z[1, [2, 9]] = 2.0  # target 1 (3.0) ties with 0, 2, 3: p_j comes from below, a tie at 2.0
    z[1, 2] = 3.0
    z[2] = 1.0  # all tied with the target: nothing below, p_j = 0
    z[3, 3] = 5.0  # target is the max; below it the four-way tie at 3.0 and the rest
    kw = dict(uncertainty="dual_focal", mode=mode, reduction="sum", gamma=2.0)
    one = torch.tensor(1.0, device=device)
    loss, grad = _triton_loss_and_grad(z, y, one, **kw)
    exact_loss, exact_grad = _reference_loss_and_grad(z, y, one, **kw)
    _close(loss, exact_loss, torch.float32, "loss")
    _close(grad, exact_grad, torch.float32, "gradient")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("uncertainty", ["focal", "dual_focal", "brier"])
def test_single_and_two_read_paths_agree_in_half_precision(monkeypatch, device, dtype, uncertainty):
    """Same fp32 statistics either way, so the two paths agree to the 16-bit output's rounding."""
    c = 300
    z = (torch.randn(6, c, device=device) * 4).to(dtype)
    y = _targets(6, c, device)
    for mode in ("loss", "grad"):
        one = torch.tensor(1.0, device=device)
        kw = dict(uncertainty=uncertainty, mode=mode, reduction="sum")
        single_loss, single_grad = _triton_loss_and_grad(z, y, one, **kw)
        monkeypatch.setattr(T, "MAX_BLOCK", 32)  # 16-class chunks: 19 of them
        chunked_loss, chunked_grad = _triton_loss_and_grad(z, y, one, **kw)
        monkeypatch.undo()
        assert single_loss.dtype == dtype and single_grad.dtype == dtype
        torch.testing.assert_close(chunked_loss.float(), single_loss.float(), rtol=1e-2, atol=1e-3)
        torch.testing.assert_close(chunked_grad.float(), single_grad.float(), rtol=1e-2, atol=2e-3)
        exact_loss, exact_grad = _reference_loss_and_grad(z, y, one, **kw)
        _close(single_grad, exact_grad, dtype, f"{mode} gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_confident_and_infinite_rows_in_chunks(small_block, device):
    c = 19
    z = torch.randn(4, c, device=device)
    z[0, 17] = 40.0  # confident, target in the last chunk: 1 - p_y ≈ 1e-17 must not cancel
    z[1, [0, 1, 2, 3, 4, 5, 6, 7]] = float("-inf")  # whole chunks of -inf before the first finite value
    z[2, 3] = 1e4  # extreme logits; target far below the max
    z[2, 9] = -1e4
    y = torch.tensor([17, 10, 9, -100], device=device)
    for uncertainty in ("focal", "dual_focal", "brier", "brier_flsd"):
        for mode in ("loss", "grad"):
            kw = dict(uncertainty=uncertainty, mode=mode, reduction="none", gamma=3.0)
            ones = torch.ones(4, device=device)
            loss, grad = _triton_loss_and_grad(z, y, ones, **kw)
            exact_loss, exact_grad = _reference_loss_and_grad(z, y, ones, **kw)
            _close(loss, exact_loss, torch.float32, f"{uncertainty}/{mode} loss")
            _close(grad, exact_grad, torch.float32, f"{uncertainty}/{mode} gradient")
    confident_loss, _ = _triton_loss_and_grad(z, y, ones, uncertainty="focal", mode="loss", reduction="none", gamma=0.5)
    assert confident_loss[0] > 0, "the confident row's weight (1 - p_y)^γ must not round to 0"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("norm", [2.0, 3.0])
def test_chunked_path_keeps_precision_with_logits_of_a_few_thousand(small_block, device, norm):
    """The two-read path's p_k = 2^{(z_k - m) log2 e - log2 d}, not 2^{(z_k - lse) log2 e} (see the kernel), in GRA
    mode (well conditioned; see test_logits_of_a_few_thousand_keep_full_precision in the shared suite)."""
    n, c = 6, 41
    z = torch.randn(n, c, device=device) * 3 + 2000  # a large common offset, as in the shared suite
    y = _targets(n, c, device, ignored=0)
    one = torch.tensor(1.0, device=device)
    for uncertainty in ("none", "brier", "dual_focal"):
        kw = dict(uncertainty=uncertainty, mode="grad", reduction="sum", gamma=3.0, norm=norm)
        loss, grad = _triton_loss_and_grad(z, y, one, **kw)
        exact_loss, exact_grad = _reference_loss_and_grad(z, y, one, **kw)
        _close(loss, exact_loss, torch.float32, f"{uncertainty} loss")
        _close(grad, exact_grad, torch.float32, f"{uncertainty} gradient")


# ----------------------------------------------------------------------------------------------------------------
# Inplace, no-grad, backward scaling, version counter
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [False, True], ids=["single-read", "two-read"])
@pytest.mark.parametrize("uncertainty,mode", [("brier", "grad"), ("brier", "loss"), ("dual_focal", "loss")])
def test_inplace_overwrites_logits_with_gradient(monkeypatch, device, chunked, uncertainty, mode):
    if chunked:
        monkeypatch.setattr(T, "MAX_BLOCK", 8)
    n, c = 6, 21
    z = torch.randn(n, c, device=device) * 2
    y = _targets(n, c, device)
    leaf = z.clone().requires_grad_()
    logits = leaf * 1.0  # an activation, as a model's output is
    storage = logits.data_ptr()
    loss = _run(_inputs(logits, y, uncertainty=uncertainty, mode=mode), True)
    grad_out = torch.tensor(0.5, device=device)
    loss.backward(grad_out)
    exact_loss, exact_grad = _reference_loss_and_grad(z, y, grad_out, uncertainty=uncertainty, mode=mode)
    _close(loss, exact_loss, torch.float32, "loss")
    _close(leaf.grad, exact_grad, torch.float32, "gradient")
    # the logits buffer now holds the (scaled) gradient: no separate N×C buffer was allocated
    assert logits.data_ptr() == storage
    _close(logits.detach(), exact_grad, torch.float32, "gradient left in the logits buffer")


class _CountedLaunches:
    """Stands in for a Triton kernel of the module: counts its launches by name, then launches it."""

    def __init__(self, kernel, name, counts):
        self.kernel, self.name, self.counts = kernel, name, counts

    def __getitem__(self, grid):
        self.counts[self.name] = self.counts.get(self.name, 0) + 1
        return self.kernel[grid]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("target", ["hard", "smooth", "dense"])
@pytest.mark.parametrize("batch", ["small", "large"])
def test_an_eager_step_runs_its_kernels_and_no_casts(monkeypatch, device, dtype, target, batch):
    """What a plain eager step (the public call, then the backward of its mean loss) costs the host: one launch in the
    forward, whose last program writes the loss in the logits' dtype (no cast in the forward, hence none of
    ``grad_output`` in the backward), two for a batch of class indices larger than ``INLINE_COUNT_MAX_ROWS`` (the
    targets' count first), and in the backward the scaling launch on a GPU, which reads ``grad_output`` there, or
    nothing on the CPU, which reads it on the host and finds 1. Values as the reference's."""
    counts = {}
    for name in dir(T):
        if name.startswith("_") and name.endswith("_kernel"):
            monkeypatch.setattr(T, name, _CountedLaunches(getattr(T, name), name.strip("_"), counts))
    if batch == "large":
        monkeypatch.setattr(T, "INLINE_COUNT_MAX_ROWS", 5)
    z = torch.randn(6, 37, device=device).to(dtype)
    y = _targets(6, 37, device, ignored=1 if target != "dense" else 0)
    kwargs = {"label_smoothing": 0.1} if target == "smooth" else {}
    if target == "dense":
        y = torch.softmax(torch.randn(6, 37, device=device), dim=1)
    leaf = z.clone().requires_grad_()
    logits = leaf * 1  # not a leaf, so that the gradient below stops at the loss's own node
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as forward_profile:
        loss = ck.bsce_gra_loss(logits, y, backend="triton", **kwargs)
    forward = dict(counts)
    counts.clear()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as backward_profile:
        (grad,) = torch.autograd.grad(loss, logits)
    ops = [e.name for p in (forward_profile, backward_profile) for e in p.events()]
    assert loss.dtype == dtype
    expected = {"uncertainty_weighted_ce_targets_kernel": 1} if target != "dense" and batch == "large" else {}
    expected["soft_target_ce_fwd_kernel" if target != "hard" else "uncertainty_weighted_ce_fwd_kernel"] = 1
    assert forward == expected
    assert counts == ({"uncertainty_weighted_ce_scale_grad_kernel": 1} if device == "cuda" else {})
    assert not [op for op in ops if op in ("aten::to", "aten::_to_copy")], ops
    reference = z.double().requires_grad_()
    exact = R.uncertainty_weighted_ce(reference, y.double() if target == "dense" else y, **kwargs)
    (exact_grad,) = torch.autograd.grad(exact, reference)
    torch.testing.assert_close(loss.double(), exact.detach(), rtol=_TOL[dtype], atol=_TOL[dtype])
    torch.testing.assert_close(grad.double(), exact_grad, rtol=_TOL[dtype], atol=_TOL[dtype])


_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("uncertainty", ["focal", "flsd"])
@pytest.mark.parametrize("chunked", [False, True], ids=["single-read", "two-read"])
def test_a_dense_target_summing_off_one_keeps_the_loss_mode_gradient(monkeypatch, device, uncertainty, chunked):
    """A bfloat16 dense target whose rows sum to s != 1 within its dtype's tolerance, with an entry above 1/2: the
    focal weights' loss-mode gradient as the reference's on the same target. (The kernel formed t - P on such columns
    as (Σt - P) - (1 - t), off by s - 1: 5e-3 here.)"""
    if chunked:
        monkeypatch.setattr(T, "MAX_BLOCK", 4)  # rows of 6 classes in chunks of 2
    z = torch.tensor([[1.0, -0.5, 0.3, 2.0, 0.1, -1.0], [0.2, 3.0, -1.0, 0.5, 0.0, 1.0]], device=device)
    t = torch.tensor([[0.8, 0.1, 0.05, 0.02, 0.01, 0.011], [0.05, 0.7, 0.1, 0.1, 0.02, 0.02]],
                     dtype=torch.bfloat16, device=device)
    assert (t.double().sum(dim=1) - 1).abs().min() > 1e-3  # off one, within bfloat16's tolerance
    x = z.clone().requires_grad_()
    ck.uncertainty_weighted_ce(x, t, uncertainty=uncertainty, mode="loss", gamma=2.0, backend="triton").backward()
    exact_x = z.double().requires_grad_()
    R.uncertainty_weighted_ce(exact_x, t, uncertainty=uncertainty, mode="loss",
                              gamma=2.0).backward()  # t: its own tolerance
    _close(x.grad, exact_x.grad, torch.float32, f"{uncertainty} loss-mode gradient")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("count", ["inline", "loaded"])
@pytest.mark.parametrize("target", ["hard", "mix", "dense"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_the_last_program_folds_the_batch(monkeypatch, device, count, target, reduction):
    """The loss launch's last program sums the rows, divides by the mean's divisor and makes the target flag: batches
    from 1 row to several widths of its pass (narrowed to 4 rows here), with ignored rows (all but one, and all) and
    one bad target, through both divisors: every program counting the targets itself ("inline") and the targets kernel
    counting them first ("loaded", a batch over INLINE_COUNT_MAX_ROWS). Loss and gradient as the reference's; the
    ticket counter back at 0 after every launch."""
    if count == "loaded":
        monkeypatch.setattr(T, "INLINE_COUNT_MAX_ROWS", 0)
    monkeypatch.setattr(T, "_finish_block", lambda num_rows, num_warps: min(T._next_power_of_2(num_rows), 4))
    monkeypatch.setattr(_target_checks, "POLICY", "sync")
    c = 11
    for n, ignored in ((1, 0), (2, 1), (4, 0), (5, 2), (9, 8), (9, 9), (33, 5)):
        z = torch.randn(n, c, device=device) * 3
        y = _targets(n, c, device, ignored=0 if target == "dense" else ignored)
        kwargs = {}
        if target == "mix":
            kwargs = dict(mix_target=torch.randint(0, c, (n,), device=device), mix_lambda=torch.rand(n, device=device))
        if target == "dense":
            y = torch.softmax(torch.randn(n, c, device=device), dim=1)
        x = z.clone().requires_grad_()
        loss = ck.uncertainty_weighted_ce(x, y, reduction=reduction, backend="triton", **kwargs)
        loss.sum().backward()
        exact_x = z.double().requires_grad_()
        exact_kwargs = {k: (v.double() if v.is_floating_point() else v) for k, v in kwargs.items()}
        exact = R.uncertainty_weighted_ce(exact_x, y.double() if target == "dense" else y, reduction=reduction,
                                          **exact_kwargs)
        exact.sum().backward()
        where = f"{n} rows, {ignored} ignored"
        _close(loss, exact.detach(), torch.float32, f"loss ({where})")
        _close(x.grad, exact_x.grad, torch.float32, f"gradient ({where})")
        assert all(int(counter) == 0 for counter in T._counters.values()), where
        if target != "dense" and n > 1:
            bad = y.clone()
            bad[n // 2] = c + 3
            with pytest.raises(ValueError, match=f"target value {c + 3} is out of range"):
                ck.uncertainty_weighted_ce(z, bad, reduction=reduction, backend="triton", **kwargs)
            assert all(int(counter) == 0 for counter in T._counters.values()), where


# ----------------------------------------------------------------------------------------------------------------
# Target checking
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [False, True], ids=["single-read", "two-read"])
def test_out_of_range_target_raises_on_device_check(monkeypatch, device, chunked):
    if chunked:
        monkeypatch.setattr(T, "MAX_BLOCK", 4)
    z = torch.randn(4, 7, device=device, requires_grad=True)
    for bad in (7, -1, 10**9):
        y = torch.tensor([0, bad, 3, -100], device=device)
        with pytest.raises(ValueError, match=f"target value {bad} is out of range for 7 classes"):
            _run(_inputs(z, y), False)
            _target_checks.synchronize_target_checks()  # on CUDA the default policy raises without stalling


@pytest.mark.parametrize("device", DEVICES)
def test_out_of_range_target_without_validation_poisons_only_its_row(monkeypatch, device):
    """validate off: no error, no out-of-bounds write, the bad row is NaN and every other row is right."""
    monkeypatch.setattr(_target_checks, "POLICY", "off")
    n, c, pad = 5, 8, 3
    buffer = torch.full((n, c + pad), 7.0, device=device)
    buffer[:, :c] = torch.randn(n, c, device=device)
    view = buffer[:, :c]
    y = torch.tensor([1, 10**6, 2, -5, -100], device=device)
    rows_loss = _run(_inputs(view, y, reduction="none"), False)
    good = torch.tensor([0, 2, 4], device=device)
    assert torch.isnan(rows_loss[1]) and torch.isnan(rows_loss[3])
    torch.testing.assert_close(rows_loss[good], R.uncertainty_weighted_ce(view[good], y[good], reduction="none"))
    loss, _, _ = torch.ops.calibkernels.uncertainty_weighted_ce_triton(view, *_op_args(view, y), True, view)
    assert torch.isnan(loss), "a bad target must never give a plausible-looking loss"
    assert (buffer[:, c:] == 7.0).all(), "out-of-range target wrote outside its row"
    assert torch.isnan(view[1]).all() and torch.isnan(view[3]).all() and (view[4] == 0).all()


# ----------------------------------------------------------------------------------------------------------------
# Backend interface
# ----------------------------------------------------------------------------------------------------------------
def test_backend_interface():
    assert T.is_available("triton", torch.device("meta")) is not None
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert T.is_available("triton", torch.device("cpu")) is None
        assert "triton" in _backends.available_backends()
    with pytest.raises(TypeError, match="float64"):
        _run(_inputs(torch.randn(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.long)), False)


# ----------------------------------------------------------------------------------------------------------------
# GPU only: real block sizes and CUDA graphs
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("c", [32000, 65537, 128256])
def test_large_vocabularies_on_gpu(c):
    z = (torch.randn(16, c, device="cuda") * 4).to(torch.bfloat16)
    y = _targets(16, c, "cuda")
    one = torch.tensor(1.0, device="cuda")
    for uncertainty, mode in (("brier", "grad"), ("brier", "loss"), ("dual_focal", "loss")):
        loss, grad = _triton_loss_and_grad(z, y, one, uncertainty=uncertainty, mode=mode)
        exact_loss, exact_grad = _reference_loss_and_grad(z, y, one, uncertainty=uncertainty, mode=mode)
        _close(loss, exact_loss, torch.bfloat16, "loss")
        _close(grad, exact_grad, torch.bfloat16, "gradient")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
@pytest.mark.parametrize("n", [1000, 5000], ids=["divisor counted in every program", "divisor from the targets kernel"])
def test_the_last_program_sees_every_row_on_the_gpu(n):
    """Thousands of programs finish in an order the GPU picks; the one that draws the last ticket must see every other
    row's loss (the acquire-release ticket after each program's barrier, the reads past L1) and leave the counter at 0
    for the next launch. Back-to-back calls: each mean and sum equal to the float64 sum of the same rows' losses
    (``reduction="none"``), and the mean's gradient as the reference's."""
    torch.manual_seed(0)
    for c in (16, 1000):
        for _ in range(20):
            z = torch.randn(n, c, device="cuda")
            y = _targets(n, c, "cuda", ignored=n // 10)
            rows = ck.uncertainty_weighted_ce(z, y, reduction="none", backend="triton").double()
            total = ck.uncertainty_weighted_ce(z, y, reduction="sum", backend="triton")
            mean = ck.uncertainty_weighted_ce(z, y, backend="triton")
            torch.testing.assert_close(total.double(), rows.sum(), rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(mean.double(), rows.sum() / (y != -100).sum(), rtol=1e-5, atol=1e-6)
        x = z.clone().requires_grad_()
        ck.uncertainty_weighted_ce(x, y, backend="triton").backward()
        _close(x.grad, _reference_loss_and_grad(z, y, torch.tensor(1.0, device="cuda"))[1], torch.float32,
               f"gradient ({n} x {c})")
    assert all(int(counter) == 0 for counter in T._counters.values())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_graph_capture_and_replay():
    """No host synchronisation on the hot path: forward and backward capture into a CUDA graph and replay right."""
    z = torch.randn(32, 1000, device="cuda")
    y = _targets(32, 1000, "cuda")
    x = z.clone().requires_grad_()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up (Triton compiles) outside the capture
        for _ in range(2):
            x.grad = None
            _run(_inputs(x, y), False).backward()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    x.grad = None
    with torch.cuda.graph(graph):
        loss = _run(_inputs(x, y), False)
        loss.backward()
    new_z = torch.randn(32, 1000, device="cuda")
    with torch.no_grad():
        x.copy_(new_z)
    graph.replay()
    torch.cuda.synchronize()
    exact_loss, exact_grad = _reference_loss_and_grad(new_z, y, torch.tensor(1.0, device="cuda"))
    _close(loss, exact_loss, torch.float32, "loss")
    _close(x.grad, exact_grad, torch.float32, "gradient")


# ----------------------------------------------------------------------------------------------------------------
# Target-check policies on a GPU (calibkernels._target_checks): async (default) never stalls and raises later,
# sync raises at once, off never raises; the bad row is NaN under every policy.
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the policies differ only on a GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_target_check_policies_on_the_gpu(monkeypatch, backend):
    import calibkernels as ck

    if backend not in ck.available_backends():
        pytest.skip(f"{backend} backend not built")
    z = torch.randn(6, 300, device="cuda", requires_grad=True)
    bad_y = torch.tensor([0, 1, 300, 2, -100, 3], device="cuda")
    good_y = torch.tensor([0, 1, 2, 2, -100, 3], device="cuda")
    ck.synchronize_target_checks()

    monkeypatch.setattr(_target_checks, "POLICY", "async")
    loss = ck.uncertainty_weighted_ce(z, bad_y, backend=backend)  # no stall, no error yet
    assert torch.isnan(loss).item()
    with pytest.raises(ValueError, match="target value 300 is out of range for 300 classes"):
        ck.synchronize_target_checks()
    ck.uncertainty_weighted_ce(z, bad_y, backend=backend)
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match="target value 300.*earlier call"):
        ck.uncertainty_weighted_ce(z, good_y, backend=backend)  # the next call reports the finished check
    ck.synchronize_target_checks()  # nothing left pending

    monkeypatch.setattr(_target_checks, "POLICY", "sync")
    with pytest.raises(ValueError, match="target value 300 is out of range"):
        ck.uncertainty_weighted_ce(z, bad_y, backend=backend)

    monkeypatch.setattr(_target_checks, "POLICY", "off")
    assert torch.isnan(ck.uncertainty_weighted_ce(z, bad_y, backend=backend)).item()
    torch.cuda.synchronize()
    ck.synchronize_target_checks()
    ck.uncertainty_weighted_ce(z, good_y, backend=backend).backward()
    assert torch.isfinite(z.grad).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("backend", ["triton", "cuda"])
def test_backward_scaling_kernel(backend):
    """The device-side backward scaling: skipped for grad_output 1, applied for any other scalar or per-row factor."""
    import calibkernels as ck

    if backend not in ck.available_backends():
        pytest.skip(f"{backend} backend not built")
    z = torch.randn(37, 5000, device="cuda", dtype=torch.bfloat16)
    y = torch.randint(0, 5000, (37,), device="cuda")
    for reduction, grad_out in [("mean", torch.tensor(1.0)), ("sum", torch.tensor(-2.5)),
                                ("none", torch.rand(37) + 0.5)]:
        leaf = z.clone().requires_grad_()
        loss = ck.uncertainty_weighted_ce(leaf, y, reduction=reduction, backend=backend)
        loss.backward(grad_out.to(device="cuda", dtype=loss.dtype))
        exact = z.double().requires_grad_()
        R.uncertainty_weighted_ce(exact, y, reduction=reduction).backward(grad_out.double().cuda())
        torch.testing.assert_close(leaf.grad.double(), exact.grad, rtol=2e-2, atol=2e-2 * exact.grad.abs().max().item())
