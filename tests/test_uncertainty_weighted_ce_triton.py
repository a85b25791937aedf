"""Triton backend internals: the chunked two-read path, inplace, the device-side target check, the backward's
scaling, opcheck, torch.compile; soft targets (label smoothing, compact mixes, dense targets) through the module's
forward against the reference.

Runs on CPU tensors through ``TRITON_INTERPRET=1`` (set by conftest.py when no GPU is present; small shapes only, the
interpreter is slow) and again on CUDA tensors when a GPU is present. The value checks against the reference for every
weight × mode × reduction through the public API live in ``test_uncertainty_weighted_ce.py``; here the kernel is also
called directly, below the public API's host-side target check.
"""

import math
import os

import numpy as np
import pytest
import torch
from _flsd_band import band_choices, flsd_gamma, gamma_picked
from _tolerance import assert_within_reference_error

import calibkernels as ck
from calibkernels import _autograd, _backends, _target_checks
from calibkernels import _validation as V
from calibkernels import reference as R

T = pytest.importorskip("calibkernels.triton.uncertainty_weighted_ce")

pytestmark = [
    # numpy (behind the interpreter) warns where the kernel deliberately takes log2(0) = -inf or divides by 0 on a
    # masked lane; the results are checked below.
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

WEIGHTS = ["none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd"]
# brier_flsd's γ (the band p_y ≥ 0.5) differs from its other bands' 5 and 3, so a row in the wrong band shows
GAMMAS = {"none": 0.0, "focal": 2.0, "flsd": 3.0, "dual_focal": 5.0, "brier": 4.0, "external": 0.0, "brier_flsd": 1.5}


def _devices():
    devices = []
    for dev in ("cpu", "cuda"):
        reason = _backends.unavailable_reason("triton", torch.device(dev))
        marks = [pytest.mark.gpu] if dev == "cuda" else []
        if dev == "cuda" and not torch.cuda.is_available():
            marks.append(pytest.mark.skip(reason="no CUDA device"))
        elif reason is not None:
            marks.append(pytest.mark.skip(reason=reason))
        devices.append(pytest.param(dev, id=dev, marks=marks))
    return devices


DEVICES = _devices()


def _targets(n, c, device, ignored=2):
    y = torch.randint(0, c, (n,), device=device)
    y[torch.randperm(n, device=device)[:ignored]] = -100
    return y


def _inputs(z, y, *, uncertainty="brier", mode="grad", gamma=None, norm=2.0, sample_weight=None, reduction="mean",
            ignore_index=-100):
    gamma = GAMMAS[uncertainty] if gamma is None else gamma
    return V.check_loss_inputs(z, y, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=norm,
                               sample_weight=sample_weight,
                               reduction=reduction, ignore_index=ignore_index, check_values=False)


def _op_args(z, y, *, uncertainty="brier", mode="grad", gamma=None, norm=2.0, sample_weight=None, reduction="mean",
             ignore_index=-100):
    gamma = GAMMAS[uncertainty] if gamma is None else gamma
    per_sample = gamma if isinstance(gamma, torch.Tensor) else None
    return (y, sample_weight, per_sample, V.WEIGHT_CODES[uncertainty], V.MODE_CODES[mode],
            0.0 if per_sample is not None else float(gamma), float(norm), ignore_index, V.REDUCTION_CODES[reduction])


def _run(inputs, inplace):
    """The loss through the Triton backend and the shared autograd (below the public API's host-side checks)."""
    return _autograd.run(_backends.module("triton"), inputs, inplace)


def _reference_loss_and_grad(z, y, grad_out, **kw):
    """float64 reference: the loss and the gradient of ``loss·grad_out``."""
    x = z.detach().double().requires_grad_()
    kw.setdefault("gamma", GAMMAS[kw.get("uncertainty", "brier")])  # the same defaults as _inputs
    sw = kw.get("sample_weight")
    if sw is not None:
        kw = dict(kw, sample_weight=sw.double())
    loss = R.uncertainty_weighted_ce(x, y, **kw)
    loss.backward(grad_out.double().expand_as(loss))
    return loss.detach(), x.grad


def _triton_loss_and_grad(z, y, grad_out, **kw):
    x = z.detach().clone().requires_grad_()
    loss = _run(_inputs(x, y, **kw), False)
    loss.backward(grad_out.to(loss.dtype).expand_as(loss))
    return loss.detach(), x.grad


def _close(got, exact, dtype, what):
    # fp32 kernels against a float64 reference: relative to the largest entry (a few thousand ulps of fp32 at most
    # for these shapes; 16-bit outputs carry their own rounding)
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    got, exact = got.double().cpu(), exact.double().cpu()
    assert torch.equal(torch.isfinite(got), torch.isfinite(exact)), f"{what}: non-finite entries differ"
    finite = torch.isfinite(exact)
    scale = exact[finite].abs().max().item() if finite.any() else 0.0
    err = (got[finite] - exact[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= tol * max(scale, 1e-30) + 1e-30, f"{what}: max error {err:.3e} (scale {scale:.3e}, tol {tol})"


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


@pytest.mark.parametrize("device", DEVICES)
def test_inplace_writes_stay_inside_a_strided_view(device):
    """Row stride > C: inplace must write only the view's columns, never the padding between rows."""
    n, c, pad = 5, 11, 4
    buffer = torch.full((n, c + pad), 123.0, device=device)
    view = buffer[:, :c]
    view.copy_(torch.randn(n, c, device=device))
    y = _targets(n, c, device)
    expected_grad = _reference_loss_and_grad(view.clone(), y, torch.tensor(1.0, device=device))[1]
    loss, grad, _ = torch.ops.calibkernels.uncertainty_weighted_ce_triton(view, *_op_args(view, y), True, view)
    assert torch.isfinite(loss) and grad.shape == (0,)
    assert (buffer[:, c:] == 123.0).all(), "padding between rows was written"
    _close(view, expected_grad, torch.float32, "in-place gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_no_gradient_buffer_without_grad(device):
    z = torch.randn(6, 13, device=device)
    y = _targets(6, 13, device)
    loss, grad, flag = torch.ops.calibkernels.uncertainty_weighted_ce_triton(z, *_op_args(z, y), False, None)
    assert grad.shape == (0,), "compute_grad=False must not write an N×C gradient"
    assert flag.tolist()[0] == 0 and flag.shape == (2,), "the target flag: two slots, no bad target"
    torch.testing.assert_close(loss, R.uncertainty_weighted_ce(z, y), rtol=1e-5, atol=1e-6)
    with torch.no_grad():  # requires_grad logits under no_grad: no gradient either, and inplace leaves them intact
        x = z.clone().requires_grad_()
        before = x.detach().clone()
        _run(_inputs(x, y), True)
        assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
def test_second_backward_through_a_retained_graph_gives_the_same_gradient(device, inplace):
    """Backward scales the saved gradient in place only when the graph is not retained; with retain_graph=True the
    buffer survives, so a second backward gives the same (right) gradient instead of a rescaled one."""
    z = torch.randn(4, 9, device=device)
    y = _targets(4, 9, device, ignored=0)
    leaf = z.clone().requires_grad_()
    loss = _run(_inputs(leaf * 1.0, y), inplace)
    loss.backward(torch.tensor(2.0, device=device), retain_graph=True)
    first = leaf.grad.clone()
    _close(first, _reference_loss_and_grad(z, y, torch.tensor(2.0, device=device))[1], torch.float32, "gradient")
    leaf.grad = None
    loss.backward(torch.tensor(2.0, device=device))
    torch.testing.assert_close(leaf.grad, first)


@pytest.mark.parametrize("device", DEVICES)
def test_backward_with_broadcast_and_unit_grad_output(device):
    """grad_output of exactly 1 leaves the buffer as is; an expanded (stride-0) per-row grad_output is read right."""
    z = torch.randn(7, 10, device=device)
    y = _targets(7, 10, device)
    for reduction, grad_out in (("mean", torch.tensor(1.0, device=device)),
                                ("none", torch.ones(7, device=device)),
                                ("none", torch.tensor(3.0, device=device).expand(7))):
        x = z.clone().requires_grad_()
        loss = _run(_inputs(x, y, uncertainty="focal", mode="loss", reduction=reduction), False)
        loss.backward(grad_out)
        exact = _reference_loss_and_grad(z, y, grad_out, uncertainty="focal", mode="loss", reduction=reduction)[1]
        _close(x.grad, exact, torch.float32, f"{reduction} gradient")
    x = z.clone().requires_grad_()
    _run(_inputs(x, y, reduction="none"), False).sum().backward()
    _close(x.grad, _reference_loss_and_grad(z, y, torch.ones(7, device=device), reduction="none")[1],
           torch.float32, "gradient of .sum()")


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
# Registration: opcheck, torch.compile, backend interface
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("uncertainty,mode,reduction", [("brier", "loss", "mean"), ("focal", "grad", "none"),
                                                   ("dual_focal", "loss", "sum")])
def test_opcheck(device, uncertainty, mode, reduction):
    # The op mutates its grad_out argument, so it has no registered autograd (calibkernels._autograd is its autograd
    # in every mode): opcheck it on inputs that do not require grad, returning the gradient, writing it into a
    # separate buffer, and in place.
    z = torch.randn(5, 11, device=device)
    y = _targets(5, 11, device, ignored=1)
    args = _op_args(z, y, uncertainty=uncertainty, mode=mode, reduction=reduction)
    op = torch.ops.calibkernels.uncertainty_weighted_ce_triton.default
    torch.library.opcheck(op, (z, *args, True, None))
    torch.library.opcheck(op, (z, *args, False, None))
    torch.library.opcheck(op, (z, *args, True, torch.empty_like(z)))
    logits = z.clone()
    torch.library.opcheck(op, (logits, *args, True, logits))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
def test_compiles_with_fullgraph(device, inplace):
    """The op stays in one graph; forward and the parameters' gradients match eager."""
    torch._dynamo.reset()
    model = torch.nn.Linear(6, 9).to(device)
    x, y = torch.randn(8, 6, device=device), _targets(8, 9, device)

    def step(features, target):
        inputs = V.check_loss_inputs(model(features), target, uncertainty="brier", mode="loss", check_values=False)
        return _run(inputs, inplace)

    # Inductor on GPU; on CPU the graph is checked with aot_eager (Inductor's C++ build adds nothing here)
    compiled = torch.compile(step, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    compiled_loss = compiled(x, y)
    compiled_loss.backward()
    compiled_grad = model.weight.grad.clone()
    model.weight.grad = None
    eager_loss = step(x, y)
    eager_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss)
    torch.testing.assert_close(compiled_grad, model.weight.grad)


def test_backend_interface():
    assert T.is_available("triton", torch.device("meta")) is not None
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert T.is_available("triton", torch.device("cpu")) is None
        assert "triton" in _backends.available_backends()
    with pytest.raises(TypeError, match="float64"):
        _run(_inputs(torch.randn(3, 4, dtype=torch.float64), torch.zeros(3, dtype=torch.long)), False)


# ----------------------------------------------------------------------------------------------------------------
# Soft targets (label smoothing, mixup / cutmix in the compact form, dense probabilities) through the module's
# forward, against the reference (loss, and the gradient of the reduced loss by autograd)
# ----------------------------------------------------------------------------------------------------------------
SOFT_WEIGHTS = ["none", "focal", "flsd", "brier", "external", "brier_flsd"]
SOFT_KINDS = ["smoothing", "mix-scalar", "mix-per-row", "mix-smoothing", "dense", "dense-smoothing"]


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
@pytest.mark.parametrize("kind", SOFT_KINDS)
@pytest.mark.parametrize("mode", ["loss", "grad"])
@pytest.mark.parametrize("uncertainty", SOFT_WEIGHTS)
def test_soft_targets_match_reference(device, uncertainty, mode, kind):
    n, c = 4, 7
    z, target, soft = _soft_case(kind, n, c, device)
    sw = torch.rand(n, device=device) if uncertainty == "external" else None
    for reduction in ("none", "mean", "sum"):
        _check_soft(z, target, uncertainty=uncertainty, mode=mode, reduction=reduction, sample_weight=sw,
                    what=reduction, **soft)


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
@pytest.mark.parametrize("c", [1, 2, 33])
@pytest.mark.parametrize("kind", ["mix-per-row", "mix-smoothing", "dense-smoothing"])
def test_soft_targets_odd_class_counts(device, c, kind):
    z, target, soft = _soft_case(kind, 5, c, device)
    for uncertainty, mode in (("brier", "loss"), ("focal", "loss"), ("flsd", "grad")):
        _check_soft(z, target, uncertainty=uncertainty, mode=mode, reduction="mean", what=f"{uncertainty}/{mode}",
                    **soft)


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


@pytest.mark.parametrize("device", DEVICES)
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
def test_soft_targets_against_f_cross_entropy(device):
    """Weight none is cross-entropy: F.cross_entropy with label_smoothing (ignored rows: the mean over the others),
    with probability targets (the mean over all N rows), and mixup as λ CE(y) + (1 - λ) CE(m)."""
    import torch.nn.functional as F

    n, c = 6, 9
    z = torch.randn(n, c, device=device) * 2
    y = _targets(n, c, device, ignored=2)
    probabilities = torch.softmax(torch.randn(n, c, device=device), dim=1)
    every_row = torch.randint(0, c, (n,), device=device)
    mix = torch.randint(0, c, (n,), device=device)
    lam = 0.3
    cases = [
        (y, dict(label_smoothing=0.2), lambda x: F.cross_entropy(x, y, label_smoothing=0.2)),
        (probabilities, {}, lambda x: F.cross_entropy(x, probabilities)),
        (probabilities, dict(label_smoothing=0.1), lambda x: F.cross_entropy(x, probabilities, label_smoothing=0.1)),
        (every_row, dict(mix_target=mix, mix_lambda=torch.tensor(lam, device=device)),
         lambda x: lam * F.cross_entropy(x, every_row) + (1 - lam) * F.cross_entropy(x, mix)),
    ]
    for target, soft, expected_of in cases:
        loss, grad = _soft_forward(z, target, uncertainty="none", reduction="mean", **soft)
        x = z.double().requires_grad_()
        expected = expected_of(x)
        expected.backward()
        _close(loss, expected.detach(), torch.float32, f"{sorted(soft)} loss")
        _close(grad, x.grad, torch.float32, f"{sorted(soft)} gradient")


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
            torch.testing.assert_close(loss, hard_loss, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(grad, hard_grad, rtol=1e-5, atol=1e-6)


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
def test_soft_target_arguments_are_checked(device):
    z = torch.randn(4, 5, device=device)
    y = torch.tensor([0, 1, 2, 3], device=device)
    lam = torch.rand(4, device=device)
    with pytest.raises(ValueError, match="dual-focal"):
        _soft_forward(z, y, uncertainty="dual_focal", label_smoothing=0.1)
    with pytest.raises(ValueError, match="dual-focal"):
        _soft_forward(z, torch.softmax(z, dim=1), uncertainty="dual_focal")
    with pytest.raises(ValueError, match="dual-focal"):
        torch.ops.calibkernels.uncertainty_weighted_ce_triton(z, *_op_args(z, y, uncertainty="dual_focal"), True, None,
                                                              y, lam, 0.0)
    with pytest.raises(ValueError, match="go together"):
        _soft_forward(z, y, uncertainty="brier", mix_target=y)
    with pytest.raises(ValueError, match="dense"):
        _soft_forward(z, torch.softmax(z, dim=1), uncertainty="brier", mix_target=y, mix_lambda=lam)
    with pytest.raises(ValueError, match="mix_lambda"):
        _soft_forward(z, y, uncertainty="brier", mix_target=y, mix_lambda=lam[:3])
    with pytest.raises(ValueError, match="label_smoothing"):
        _soft_forward(z, y, uncertainty="brier", label_smoothing=1.5)
    # a number λ is taken as a 0-dim tensor
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


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["mix-smoothing", "dense"])
def test_soft_targets_opcheck(device, kind):
    z, target, soft = _soft_case(kind, 5, 11, device)
    uncertainty, reduction = ("brier", "mean") if kind == "dense" else ("focal", "none")
    args = _op_args(z, target, uncertainty=uncertainty, mode="loss", reduction=reduction)
    tail = (soft.get("mix_target"), soft.get("mix_lambda"), soft["label_smoothing"])
    op = torch.ops.calibkernels.uncertainty_weighted_ce_triton.default
    torch.library.opcheck(op, (z, *args, True, None, *tail))
    torch.library.opcheck(op, (z, *args, False, None, *tail))
    logits = z.clone()
    torch.library.opcheck(op, (logits, *args, True, logits, *tail))
    loss, grad, _ = op(z, *args, True, None, *tail)
    exact_loss, exact_grad = _soft_reference(z, target, uncertainty=uncertainty, mode="loss", reduction=reduction,
                                             **soft)
    _close(loss, exact_loss, torch.float32, "loss")
    _close(grad, exact_grad, torch.float32, "gradient")


def test_soft_targets_flag():
    assert T.SOFT_TARGETS is True


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
# Without a GPU: compile the real kernels ahead of time for sm_80 and sm_90 (Triton's bundled ptxas), so a kernel
# that only works under the interpreter (a type error, an unsupported op, a bad constexpr branch) fails CI here.
# ----------------------------------------------------------------------------------------------------------------
_AOT_SCRIPT = r'''
import itertools, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from calibkernels._kernel_codes import WEIGHT_CODES
from calibkernels.triton import uncertainty_weighted_ce as T

assert not T._INTERPRETED, "the kernels must be real triton.jit functions here, not interpreted ones"

def fwd(dtype, weight, mode, reduction, block, single_read, per_sample_gamma, arch, num_warps=None):
    signature = {"logits_ptr": f"*{dtype}", "logits_row_stride": "i64", "target_ptr": "*i64",
                 "sample_weight_ptr": "*fp32", "gamma_ptr": "*fp32", "row_loss_ptr": "*fp32",
                 "grad_ptr": f"*{dtype}", "grad_row_stride": "i64", "valid_count_ptr": "*i64",
                 "loss_ptr": f"*{dtype}", "error_ptr": "*i64", "counter_ptr": "*i32",
                 "num_rows": "i32", "num_classes": "i32", "gamma": "fp32", "norm": "fp32", "ignore_index": "i64"}
    # the mean's divisor counted in every program (a small batch) or loaded; the last program's fold of the batch
    count = T.COUNT_INLINE if reduction != T.REDUCTION_MEAN or block <= 1024 else T.COUNT_LOADED
    constexprs = dict(WEIGHT=weight, MODE=mode, REDUCTION=reduction, COMPUTE_GRAD=True,
                      PER_SAMPLE_GAMMA=per_sample_gamma, BLOCK=block, SINGLE_READ=single_read,
                      NORM_IS_TWO=weight in (T.WEIGHT_BRIER, T.WEIGHT_BRIER_FLSD), COUNT=count,
                      CHECK_TARGETS=count == T.COUNT_INLINE, FINISH_BLOCK=min(4096, 256 * (num_warps or 4)))
    signature.update({name: "constexpr" for name in constexprs})
    triton.compile(ASTSource(fn=T._uncertainty_weighted_ce_fwd_kernel, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps or T._num_warps(block)})

def small_kernels(dtype, arch):
    scale = {"grad_ptr": f"*{dtype}", "grad_row_stride": "i64", "grad_output_ptr": f"*{dtype}",
             "grad_output_stride": "i64", "num_rows": "i32", "num_classes": "i32", "PER_ROW": "constexpr",
             "BLOCK": "constexpr"}
    for per_row in (False, True):
        triton.compile(ASTSource(fn=T._uncertainty_weighted_ce_scale_grad_kernel, signature=scale,
                                 constexprs={"PER_ROW": per_row, "BLOCK": 4096}),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
    targets = {"target_ptr": "*i64", "mix_ptr": "*i64", "lambda_ptr": "*fp32", "lambda_stride": "i64",
               "num_rows": "i32", "num_classes": "i32", "ignore_index": "i64", "valid_count_ptr": "*i64",
               "error_ptr": "*i64", "CHECK_MIX": "constexpr", "BLOCK": "constexpr"}
    for check_mix in (False, True):
        triton.compile(ASTSource(fn=T._uncertainty_weighted_ce_targets_kernel, signature=targets,
                                 constexprs={"CHECK_MIX": check_mix, "BLOCK": 4096}),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})

for weight, mode in itertools.product(sorted(WEIGHT_CODES.values()), range(2)):  # every weight x mode, both paths
    fwd("fp32", weight, mode, 1, 1024, True, False, 90)
    fwd("bf16", weight, mode, 0, 4096, False, False, 90, num_warps=4)
fwd("bf16", 4, 1, 1, 8192, False, False, 90, num_warps=8)         # a long two-read chunk
fwd("fp32", 4, 1, 2, T.MAX_BLOCK, True, False, 90, num_warps=16)  # the largest single-read block (C = 32000)
fwd("fp16", 1, 0, 1, 2048, True, True, 90)                         # per-sample gamma (the gamma-Net)
fwd("bf16", 4, 1, 1, 1024, True, False, 80)
fwd("fp32", 3, 0, 1, 4096, False, False, 80, num_warps=8)


def soft(dtype, target_dtype, weight, mode, block, single_read, dense, has_mix, smooth, norm_is_two, arch, num_warps,
         num_rows=None, count=None):
    signature = {"logits_ptr": f"*{dtype}", "logits_row_stride": "i64", "target_ptr": f"*{target_dtype}",
                 "target_row_stride": "i64", "mix_ptr": "*i64", "lambda_ptr": "*fp32", "lambda_stride": "i64",
                 "sample_weight_ptr": "*fp32", "gamma_ptr": "*fp32", "row_loss_ptr": "*fp32",
                 "grad_ptr": f"*{dtype}", "grad_row_stride": "i64", "valid_count_ptr": "*i64",
                 "dense_bad_ptr": "*i8", "loss_ptr": "*fp32", "error_ptr": "*i64", "counter_ptr": "*i32",
                 "num_rows": "i32", "num_classes": "i32", "gamma": "fp32", "norm": "fp32",
                 "ignore_index": "i64", "smoothing": "fp32", "dense_tolerance": "fp32"}
    if count is None:
        count = T.COUNT_ROWS if dense else (T.COUNT_LOADED if has_mix else T.COUNT_INLINE)
    constexprs = dict(WEIGHT=weight, MODE=mode, REDUCTION=1, COMPUTE_GRAD=True, PER_SAMPLE_GAMMA=False, BLOCK=block,
                      SINGLE_READ=single_read, NORM_IS_TWO=norm_is_two, DENSE=dense, HAS_MIX=has_mix, SMOOTH=smooth,
                      DENSE_FLAGS=dense and target_dtype != "fp64", COUNT=count,
                      CHECK_TARGETS=count == T.COUNT_INLINE, FINISH_BLOCK=min(4096, 256 * num_warps))
    if num_rows is not None:  # an integer argument equal to 1 arrives as a constant
        constexprs["num_rows"] = num_rows
    signature.update({name: "constexpr" for name in constexprs})
    triton.compile(ASTSource(fn=T._soft_target_ce_fwd_kernel, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})

small_kernels("bf16", 90)
small_kernels("fp32", 80)
# soft targets: compact and dense, single read and two reads, the weights with loss-mode terms
soft("fp32", "i64", 4, 0, 1024, True, False, True, True, True, 90, 8)      # compact, Brier q = 2, in registers
soft("bf16", "i64", 2, 0, 2048, False, False, True, True, False, 90, 4)    # compact, FLSD, two reads
soft("bf16", "fp32", 4, 0, 2048, False, True, False, True, False, 80, 4)   # dense, Brier q != 2: the extra read
soft("fp16", "fp16", 1, 0, 4096, True, True, False, False, False, 90, 16)  # dense focal, in registers
soft("bf16", "i64", 6, 0, 2048, False, False, True, True, True, 90, 4)     # compact, Brier-FLSD q = 2, two reads
soft("fp32", "fp32", 6, 0, 1024, True, True, False, False, False, 80, 8)   # dense, Brier-FLSD q != 2, in registers
soft("fp32", "fp64", 4, 1, 2048, False, True, False, True, True, 90, 4)    # dense float64 target: no row flags
soft("fp32", "fp32", 4, 1, 1024, True, True, False, False, True, 90, 8, num_rows=1)  # a one-row dense mean
soft("bf16", "i64", 4, 1, 1024, True, False, True, False, True, 90, 4,
     count=T.COUNT_INLINE)  # a mix checked in the fold
print("compiled")
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the real kernels run in the tests above")
def test_kernels_compile_for_sm80_and_sm90_without_a_gpu():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=900)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests above run these launches")
@pytest.mark.parametrize("classes,target", [
    (["32000"], "compact"),         # the largest compact blocks held in registers, and the capped variant's chunks
    (["16384", "32000"], "dense"),  # the largest dense blocks, and a dense row's chunks
])
def test_soft_float32_launches_keep_their_registers_on_sm90(tmp_path, classes, target):
    """The launch shapes the launcher picks for float32 soft rows, compiled for sm_90 as the JIT specialises them:
    none spills. With every soft row of up to 32768 classes in registers, the dense blocks had spilled 80-1100 stores
    and the compact loss-mode ones 160 (bench/triton_registers.py)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "registers.json"
    result = subprocess.run([sys.executable, "-m", "bench.triton_registers", "--dtypes", "fp32", "--json", str(out),
                             "--classes", *classes, "--targets", target], capture_output=True, text=True, env=env,
                            timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 8 * len(classes)  # four weights x two modes per width
    for row in rows:
        assert row["registers"] <= 128 and row["spill_stores"] == 0 and row["spill_loads"] == 0, row


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
