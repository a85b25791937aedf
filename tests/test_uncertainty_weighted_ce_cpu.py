"""The compiled CPU op ``calibkernels::uncertainty_weighted_ce`` beyond value agreement (which the shared suite
``test_uncertainty_weighted_ce.py`` checks): float64 gradcheck of its loss-mode gradient against finite differences,
``torch.library.opcheck`` of the op (out of place, into a buffer, in place), ``torch.compile(fullgraph=True)``,
autocast, in-place semantics and the
kernel's own argument checks (the last line of defence under torch.compile, where Python-side checks are skipped).
"""

import os
import re
import subprocess
import sys

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends
from calibkernels import _validation as V
from calibkernels import reference as R

from _tolerance import assert_within_reference_error

pytestmark = pytest.mark.skipif(
    _backends.unavailable_reason("cpu", torch.device("cpu")) is not None,
    reason="calibkernels._C was not built with the CPU kernel",
)

WEIGHTS = ["none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd"]


def _op():
    import calibkernels.cpp.uncertainty_weighted_ce  # noqa: F401  (registers fake kernels and autograd)

    return torch.ops.calibkernels


def _op_args(z, y, uncertainty="brier", mode="grad", reduction="mean", gamma=2.0, norm=2.0, ignore_index=-100):
    sample_weight = torch.rand(z.shape[0], dtype=z.dtype) + 0.5 if uncertainty == "external" else None
    return (y, sample_weight, None, V.WEIGHT_CODES[uncertainty], V.MODE_CODES[mode], gamma, norm, ignore_index,
            V.REDUCTION_CODES[reduction])


def _targets(n, c, ignored=1):
    y = torch.randint(0, c, (n,))
    y[torch.randperm(n)[:ignored]] = -100
    return y


# ------------------------------------------------------------------------------------------------ float64 gradcheck
@pytest.mark.parametrize("uncertainty", WEIGHTS)
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_loss_mode_gradient_matches_finite_differences(uncertainty, reduction):
    """mode="loss" is the true gradient of u·CE: the kernel's analytic backward against float64 finite differences."""
    z = torch.randn(6, 7, dtype=torch.float64, requires_grad=True)
    y = _targets(6, 7)
    kw = dict(uncertainty=uncertainty, mode="loss", reduction=reduction, gamma=2.5 if uncertainty != "brier" else 3.0)
    if uncertainty == "external":
        kw["sample_weight"] = torch.rand(6, dtype=torch.float64) + 0.5
    assert torch.autograd.gradcheck(lambda x: ck.uncertainty_weighted_ce(x, y, backend="cpu", **kw), (z,))


@pytest.mark.parametrize("norm", [1.0, 1.5, 2.0, 3.0])
def test_generalised_brier_gradient_matches_finite_differences(norm):
    z = torch.randn(5, 9, dtype=torch.float64, requires_grad=True)
    y = _targets(5, 9)
    assert torch.autograd.gradcheck(
        lambda x: ck.uncertainty_weighted_ce(x, y, uncertainty="brier", mode="loss", gamma=2.0, norm=norm,
                                             backend="cpu"),
        (z,))


def test_gra_gradient_is_the_detached_weight_times_softmax_minus_onehot():
    """BSCE-GRA (mode="grad"): dL/dz = u·(p - e_y)/n exactly, with u the detached gBS (BSCE-GRA paper, Eq. 11)."""
    z = torch.randn(9, 13, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 13, (9,))
    ck.bsce_gra_loss(z, y, gamma=4.0, norm=2.0, backend="cpu").backward()
    p = torch.softmax(z.detach(), -1)
    u = R.uncertainty_weight(z.detach(), y, uncertainty="brier", gamma=4.0, norm=2.0)
    expected = u[:, None] * (p - torch.nn.functional.one_hot(y, 13)) / 9
    torch.testing.assert_close(z.grad, expected, rtol=1e-12, atol=1e-14)


# ---------------------------------------------------------------------------------------------------------- opcheck
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("uncertainty", WEIGHTS)
@pytest.mark.parametrize("mode,reduction", [("loss", "mean"), ("grad", "none"), ("loss", "sum")])
def test_opcheck(dtype, uncertainty, mode, reduction):
    """The one op in its three uses: gradient returned (grad_out None), written into a caller's buffer, and in place
    (grad_out is the logits); and with the loss in the logits' dtype (loss_in_logits_dtype). Inputs do not require
    grad: the op is mutable (grad_out is Tensor(a!)?), so its autograd lives in calibkernels/_autograd.py, not in a
    register_autograd formula that opcheck could test."""
    ops = _op()
    z = torch.randn(5, 11, dtype=dtype)
    args = _op_args(z, _targets(5, 11), uncertainty=uncertainty, mode=mode, reduction=reduction)
    op = ops.uncertainty_weighted_ce.default
    torch.library.opcheck(op, (z, *args, True, None))
    torch.library.opcheck(op, (z, *args, False, None))
    torch.library.opcheck(op, (z, *args, True, torch.empty_like(z)))
    buffer = z.clone()
    torch.library.opcheck(op, (buffer, *args, True, buffer))
    torch.library.opcheck(op, (z, *args, True, None), {"loss_in_logits_dtype": True})
    loss, _, _ = op(z, *args, True, None, loss_in_logits_dtype=True)
    wide, _, _ = op(z, *args, True, None)
    assert loss.dtype == dtype and wide.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(loss, wide.to(dtype))  # rounded once, from the float32 loss


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("soft", [{}, {"label_smoothing": 0.1}], ids=["hard", "smooth"])
def test_a_16_bit_eager_step_casts_its_loss_once_and_nothing_in_the_backward(dtype, soft):
    """The eager call (calibkernels._C.eager_loss) asks the op for its loss in the logits' dtype
    (loss_in_logits_dtype: the CPU kernel casts its float32 loss once, the CUDA kernel writes it so, with no launch of
    its own), below the op's autograd, where autograd records nothing: the backward has no ToCopyBackward to cast
    grad_output back (one node and, on a GPU, one launch per step); the scaling reads grad_output in the gradient's
    dtype. Values and gradient as the reference's."""
    z = torch.randn(6, 11).to(dtype)
    y = _targets(6, 11)
    leaf = z.clone().requires_grad_()
    logits = leaf * 1
    loss = ck.bsce_gra_loss(logits, y, **soft)
    assert loss.dtype == dtype and loss.grad_fn is not None and "ToCopy" not in type(loss.grad_fn).__name__
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        (grad,) = torch.autograd.grad(loss, logits)
    casts = [e.name for e in profile.events() if e.name in ("aten::to", "aten::_to_copy")]
    assert not casts, casts
    reference = z.double().requires_grad_()
    exact = R.uncertainty_weighted_ce(reference, y, **soft)
    (exact_grad,) = torch.autograd.grad(exact, reference)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-3
    torch.testing.assert_close(loss.double(), exact.detach(), rtol=tolerance, atol=tolerance)
    torch.testing.assert_close(grad.double(), exact_grad, rtol=tolerance, atol=tolerance)


def test_opcheck_per_sample_gamma():
    ops = _op()
    z = torch.randn(6, 5, requires_grad=True)
    y = _targets(6, 5)
    gammas = torch.rand(6) * 4
    args = (y, None, gammas, V.WEIGHT_CODES["focal"], V.MODE_CODES["loss"], 0.0, 2.0, -100, V.REDUCTION_CODES["mean"])
    torch.library.opcheck(ops.uncertainty_weighted_ce.default, (z.detach(), *args, True, None))
    buffer = z.detach().clone()
    torch.library.opcheck(ops.uncertainty_weighted_ce.default, (buffer, *args, True, buffer))


# ---------------------------------------------------------------------------------------------------- torch.compile
@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
def test_model_and_loss_compile_with_fullgraph(inplace):
    """A model + the fused loss trace into one graph (fullgraph=True) and give eager's loss and parameter gradients."""
    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.ReLU(), torch.nn.Linear(16, 9))
    x, y = torch.randn(8, 6), _targets(8, 9)

    def step(features, target):
        return ck.uncertainty_weighted_ce(model(features), target, uncertainty="brier", mode="grad", backend="cpu",
                                          inplace=inplace)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    compiled_loss = compiled(x, y)
    compiled_loss.backward()
    compiled_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    eager_loss = step(x, y)
    eager_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss)
    for got, expected in zip(compiled_grads, [p.grad for p in model.parameters()]):
        torch.testing.assert_close(got, expected)


# --------------------------------------------------------------------------------------------------------- autocast
def test_autocast_bf16_logits_are_computed_in_fp32():
    """Under autocast the op gets the bf16 logits the layer produced and matches the reference on exactly those."""
    model = torch.nn.Linear(12, 10)
    x, y = torch.randn(16, 12), _targets(16, 10, ignored=2)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        logits = model(x)
        loss = ck.bsce_gra_loss(logits, y, backend="cpu")
    assert logits.dtype == torch.bfloat16
    exact = R.bsce_gra_loss(logits.detach().double(), y)
    torch.testing.assert_close(loss.double(), exact, rtol=2e-2, atol=1e-3)


# --------------------------------------------------------------------------------------------------------- in-place
def test_inplace_writes_the_gradient_into_the_logits_buffer():
    ops = _op()
    z = torch.randn(7, 33)
    y = _targets(7, 33)
    buffer = z.clone()
    loss, returned, _ = ops.uncertainty_weighted_ce(buffer, *_op_args(z, y, reduction="sum"), True, buffer)
    assert returned.numel() == 0
    exact_loss, exact_grad, _ = ops.uncertainty_weighted_ce(z, *_op_args(z, y, reduction="sum"), True, None)
    torch.testing.assert_close(loss, exact_loss)
    torch.testing.assert_close(buffer, exact_grad)
    into = torch.full_like(z, float("nan"))
    loss, returned, _ = ops.uncertainty_weighted_ce(z, *_op_args(z, y, reduction="sum"), True, into)
    assert returned.numel() == 0
    torch.testing.assert_close(loss, exact_loss)
    torch.testing.assert_close(into, exact_grad)


def test_inplace_on_column_strided_logits_writes_back():
    ops = _op()
    base = torch.randn(9, 6)
    view = base.t()  # (6, 9), column stride 6
    y = _targets(6, 9)
    expected_loss, expected_grad, _ = ops.uncertainty_weighted_ce(view.contiguous(), *_op_args(view, y), True, None)
    loss, _, _ = ops.uncertainty_weighted_ce(view, *_op_args(view, y), True, view)
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(base.t(), expected_grad)


def test_inplace_refuses_a_leaf_and_protects_other_users_of_the_logits():
    leaf = torch.randn(4, 5, requires_grad=True)
    y = _targets(4, 5, ignored=0)
    with pytest.raises(ValueError, match="leaf"):
        ck.uncertainty_weighted_ce(leaf, y, backend="cpu", inplace=True)
    logits = leaf * 2.0
    other = (logits.exp()).sum()  # exp saves its output, not the logits; sigmoid/pow would save the input
    squared = (logits ** 2).sum()  # pow saves the logits: after they are overwritten its backward must refuse
    loss = ck.uncertainty_weighted_ce(logits, y, backend="cpu", inplace=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (loss + squared + other).backward()


@pytest.mark.parametrize("kind", ["hard", "smooth", "mix", "mix_smooth", "dense", "dense_smooth"])
@pytest.mark.parametrize("dtype,reduction", [(torch.float32, "mean"), (torch.float32, "none"),
                                             (torch.bfloat16, "sum")])
def test_inplace_eager_call_takes_the_fast_path_with_the_general_paths_results(kind, dtype, reduction, monkeypatch):
    from calibkernels import functional

    z = (torch.randn(11, 29) * 3).to(dtype)
    y = _targets(11, 29)
    kw = {}
    if kind in ("smooth", "mix_smooth", "dense_smooth"):
        kw["label_smoothing"] = 0.1
    if kind in ("mix", "mix_smooth"):
        kw.update(mix_target=y.flip(0).clamp(min=0), mix_lambda=torch.rand(11))
    if kind.startswith("dense"):  # a bfloat16 target for bfloat16 logits, float64 for float32 ones
        y = torch.softmax(torch.randn(11, 29, dtype=torch.float64), 1).to(
            torch.bfloat16 if dtype == torch.bfloat16 else torch.float64)

    def step():
        leaf = z.clone().requires_grad_()
        logits = leaf * 1.0
        loss = ck.uncertainty_weighted_ce(logits, y, uncertainty="focal", mode="loss", gamma=2.0, reduction=reduction,
                                          inplace=True, **kw)
        loss.sum().backward()
        return loss.detach(), leaf.grad, logits._version

    assert functional._compiled_kernel("auto", torch.device("cpu"))
    calls = []
    fast_op = functional._EAGER_LOSS
    monkeypatch.setattr(functional, "_EAGER_LOSS", lambda *args: calls.append(args) or fast_op(*args))
    fast = step()
    assert len(calls) == 1 and calls[0][-1] is True, "the in-place eager CPU call should take the fast path"
    monkeypatch.setattr(functional, "_fast_call", lambda *args: None)
    general = step()
    for a, b in zip(fast, general):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert fast[2] > 0, "the overwritten logits' version is bumped"
    # a leaf, or a view of one, is refused on either path; without grad the logits are left alone
    monkeypatch.undo()
    for logits in (z.clone().requires_grad_(), z.clone().requires_grad_()[:, :]):
        with pytest.raises(ValueError, match="leaf"):
            ck.uncertainty_weighted_ce(logits, y, inplace=True, **kw)
    plain = z.clone()
    with torch.no_grad():
        ck.uncertainty_weighted_ce(plain.requires_grad_(), y, inplace=True, **kw)
    assert torch.equal(plain.detach(), z)
    with pytest.raises(TypeError, match="inplace must be a bool"):  # as the general path: not taken for 0 / 1
        ck.uncertainty_weighted_ce(z.clone(), y, inplace=0, **kw)


def _error_text(call):
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return type(error).__name__, str(error)
    return None


@pytest.mark.parametrize("inplace", [False, True])
def test_dense_targets_take_the_fast_path_with_the_general_paths_results_and_errors(inplace, monkeypatch):
    """A dense target on CPU tensors goes straight into the compiled op like class indices: the general path's
    values, and its errors (values, shapes, dtypes, a target that requires grad, ignore_index, a mix) whichever path
    the call takes."""
    from calibkernels import functional

    z = torch.randn(9, 13) * 2
    dense = torch.softmax(torch.randn(9, 13), 1)
    negative = dense.clone()
    negative[3, 4] = -0.1
    off = dense.clone()
    off[7] *= 1.01
    cases = [
        (dense, {}), (dense.half(), dict(label_smoothing=0.2)), (dense, dict(uncertainty="flsd", reduction="none")),
        (negative, {}), (off, {}), (dense.clone().requires_grad_(), {}), (dense, dict(ignore_index=3)),
        (dense[:, :12], {}), (dense.to(torch.int32), {}), (dense, dict(uncertainty="dual_focal")),
        (dense, dict(mix_target=torch.zeros(9, dtype=torch.int64), mix_lambda=0.5)),
        (torch.softmax(torch.randn(9, 13, dtype=torch.complex64).abs(), 1).to(torch.complex64), {}),
    ]
    z_empty = torch.randn(9, 0)  # zero classes: the general path's error either way
    for target in (torch.ones(9, 0), torch.zeros(9, dtype=torch.int64)):
        fast = _error_text(lambda: ck.uncertainty_weighted_ce(z_empty, target))
        with monkeypatch.context() as patch:
            patch.setattr(functional, "_fast_call", lambda *args: None)
            assert fast == _error_text(lambda: ck.uncertainty_weighted_ce(z_empty, target)) == (
                "ValueError", "logits have zero classes")

    def run(target, kw):
        leaf = z.clone().requires_grad_()
        logits = leaf * 1.0 if inplace else leaf
        loss = ck.uncertainty_weighted_ce(logits, target, uncertainty=kw.pop("uncertainty", "brier"), inplace=inplace,
                                          **kw)
        loss.sum().backward()
        return loss.detach(), leaf.grad

    calls = []
    fast_op = functional._EAGER_LOSS if functional._compiled_kernel("auto", torch.device("cpu")) else None
    for number, (target, kw) in enumerate(cases):
        monkeypatch.setattr(functional, "_EAGER_LOSS", lambda *args: calls.append(args) or fast_op(*args))
        fast = _error_text(lambda: run(target, dict(kw))) or run(target, dict(kw))
        took_fast = len(calls) > 0
        calls.clear()
        monkeypatch.setattr(functional, "_fast_call", lambda *args: None)
        general = _error_text(lambda: run(target, dict(kw))) or run(target, dict(kw))
        monkeypatch.undo()
        if number < 5:  # valid targets, and bad values that the op refuses itself
            assert took_fast, f"case {number} should take the fast path"
        if number < 3:
            for a, b in zip(fast, general):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
        else:
            assert fast == general, (number, fast, general)


def test_fast_path_leaves_a_backend_that_is_not_a_string_to_the_general_path():
    z, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    for backend in (["cpu"], None, 3):
        with pytest.raises(ValueError, match="unknown backend"):
            ck.uncertainty_weighted_ce(z, y, backend=backend)


# -------------------------------------------------------------------------------------- the kernel's own arguments
@pytest.mark.parametrize("bad", [5, -1, 2**40])
def test_kernel_rejects_out_of_range_targets_without_python_checks(bad):
    ops = _op()
    z = torch.randn(4, 5)
    y = torch.tensor([0, bad, 1, -100])
    *_, flag = ops.uncertainty_weighted_ce(z, *_op_args(z, y.clamp(0, 4)), True, None)
    assert flag.dtype == torch.int64 and flag.shape == (0,), "the CPU op raises; its target flag is empty"
    with pytest.raises(ValueError, match=f"target value {bad} is out of range for 5 classes"):
        ops.uncertainty_weighted_ce(z, *_op_args(z, y), True, None)
    buffer = z.clone()
    with pytest.raises(ValueError, match=f"target value {bad} is out of range for 5 classes"):
        ops.uncertainty_weighted_ce(buffer, *_op_args(z, y), True, buffer)


@pytest.mark.parametrize("soft", [{}, {"label_smoothing": 0.1}, {"mix": True}])
def test_strided_targets_read_as_their_rows(soft):
    """A target that is a strided view (every other entry of a longer tensor) counts and checks its own rows, not its
    storage's: the gaps hold ignore_index and out-of-range values, which must neither change the mean's count nor
    raise."""
    n, c = 37, 6
    z = torch.randn(n, c)
    storage = torch.full((2 * n,), -100, dtype=torch.int64)
    storage[1::4] = 99  # out of range, in the gaps only
    storage[0::2] = torch.randint(0, c, (n,))
    storage[4] = -100  # one ignored row of the view itself
    target = storage[0::2]
    assert not target.is_contiguous()
    kw = dict(soft)
    if kw.pop("mix", False):
        mix_storage = torch.full((2 * n,), 99, dtype=torch.int64)
        mix_storage[0::2] = torch.randint(0, c, (n,))
        kw.update(mix_target=mix_storage[0::2], mix_lambda=torch.rand(n))
    for reduction in ("mean", "sum", "none"):
        for uncertainty in ("brier", "none"):
            got = ck.uncertainty_weighted_ce(z, target, uncertainty=uncertainty, reduction=reduction, backend="cpu",
                                             **kw)
            contiguous = {k: (v.contiguous() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()}
            want = ck.uncertainty_weighted_ce(z, target.contiguous(), uncertainty=uncertainty, reduction=reduction,
                                              backend="cpu", **contiguous)
            torch.testing.assert_close(got, want, rtol=0, atol=0)
            ref = ck.uncertainty_weighted_ce(z.double(), target, uncertainty=uncertainty, reduction=reduction,
                                             backend="reference", **kw)
            torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("at", [0, 37, 1036])
def test_kernel_checks_every_row_of_a_mix(at):
    """The op's own target, mix_target and mix_lambda checks over a long batch (their first pass has no branches):
    one bad value anywhere raises and is named; a mix_target on an ignored row may be anything."""
    op = torch.ops.calibkernels.uncertainty_weighted_ce.default
    n, c = 1037, 5
    z = torch.randn(n, c)
    y = torch.randint(0, c, (n,))
    mix = torch.randint(0, c, (n,))
    ignored = (at + 1) % n
    y[ignored], mix[ignored] = -100, 123  # an ignored row's mix_target is not checked
    base = torch.rand(2 * n)
    lam = base[::2]  # a strided per-row λ, as a Beta sample's column is

    def call(t, m, l):
        return op(z, t, None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, m, l, 0.1)

    assert torch.isfinite(call(y, mix, lam)[0])  # valid as it stands
    for bad in (c, -1, 2**40):
        t = y.clone()
        t[at] = bad
        with pytest.raises(ValueError, match=f"target value {bad} is out of range for {c} classes"):
            call(t, mix, lam)
        m = mix.clone()
        m[at] = bad
        with pytest.raises(ValueError, match=f"mix_target value {bad} is out of range for {c} classes"):
            call(y, m, lam)
    m = mix.clone()
    m[at] = -100
    with pytest.raises(ValueError, match="it is ignore_index, but the row's target is not ignored"):
        call(y, m, lam)
    for bad in (-0.25, 1.5, float("nan")):
        for dtype in (torch.float32, torch.float64):
            strided = base.to(dtype)
            strided[2 * at] = bad
            with pytest.raises(ValueError, match=r"mix_lambda must be in \[0, 1\] everywhere"):
                call(y, mix, strided[::2])


def test_kernel_rejects_malformed_arguments():
    ops = _op()
    z, y = torch.randn(4, 5), torch.tensor([0, 1, 2, 3])
    with pytest.raises(RuntimeError, match="2-D"):
        ops.uncertainty_weighted_ce(torch.randn(4), *_op_args(z, y), True, None)
    with pytest.raises(RuntimeError, match="int64"):
        ops.uncertainty_weighted_ce(z, *_op_args(z, y.int()), True, None)
    with pytest.raises(RuntimeError, match="target must have shape"):
        ops.uncertainty_weighted_ce(z, *_op_args(z, y[:3]), True, None)
    with pytest.raises(RuntimeError, match="float32, float64"):
        ops.uncertainty_weighted_ce(z.int(), *_op_args(z, y), True, None)
    with pytest.raises(RuntimeError, match="gamma must be >= 0"):
        ops.uncertainty_weighted_ce(z, *_op_args(z, y, gamma=-1.0), True, None)
    with pytest.raises(RuntimeError, match="norm must be > 0"):
        ops.uncertainty_weighted_ce(z, *_op_args(z, y, norm=0.0), True, None)
    with pytest.raises(RuntimeError, match="sample_weight"):
        ops.uncertainty_weighted_ce(z, y, None, None, V.WEIGHT_CODES["external"], 1, 1.0, 2.0, -100, 1, True, None)
    with pytest.raises(ValueError, match="grad_out must have the logits' shape"):
        ops.uncertainty_weighted_ce(z, *_op_args(z, y), True, torch.empty(4, 4))
    with pytest.raises(ValueError, match="grad_out must have the logits' dtype"):
        ops.uncertainty_weighted_ce(z, *_op_args(z, y), True, torch.empty(4, 5, dtype=torch.float64))
    wide = torch.randn(4, 6)
    with pytest.raises(ValueError, match="partially overlaps"):
        ops.uncertainty_weighted_ce(wide[:, :5], *_op_args(z, y), True, wide[:, 1:])


def test_large_row_count_uses_every_thread_and_stays_exact():
    """Enough rows for at::parallel_for to split the batch: the result must not depend on the split."""
    z = torch.randn(3000, 37)
    y = _targets(3000, 37, ignored=300)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = ck.bsce_gra_loss(z, y, reduction="none", backend="cpu")
        torch.set_num_threads(max(threads, 2))
        multi = ck.bsce_gra_loss(z, y, reduction="none", backend="cpu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, multi)


def test_retain_graph_backward_twice_gives_the_same_gradient():
    """The backward scales the saved gradient in place only when the graph is not retained."""
    z = torch.randn(6, 10, requires_grad=True)
    y = _targets(6, 10)
    loss = ck.bsce_gra_loss(z, y, backend="cpu")
    first, = torch.autograd.grad(loss, z, torch.tensor(2.0), retain_graph=True)
    second, = torch.autograd.grad(loss, z, torch.tensor(2.0))
    torch.testing.assert_close(first, second)
    expected, = torch.autograd.grad(R.bsce_gra_loss(z, y), z, torch.tensor(2.0))
    torch.testing.assert_close(first, expected)


# ------------------------------------------------------------------------------- vector sweeps and their exponential
def _isa():
    import calibkernels._C

    return calibkernels._C.CPU_ISA


@pytest.mark.parametrize("mode", ["grad", "loss"])
@pytest.mark.parametrize("uncertainty", ["none", "brier"])
@pytest.mark.parametrize("c", [1, 2, 15, 16, 17, 31, 33, 1000, 1031, 2049])
def test_every_target_lane_and_row_tail(c, uncertainty, mode):
    """The vector sweeps leave the target column out of the sums lane by lane and mask the row's tail: the target in
    every lane of the first, a middle and the last (partial) vector, for widths around the 8 / 16 float lanes and the
    1024-column summation block."""
    positions = sorted({p for p in [*range(min(c, 34)), *range(max(c - 34, 0), c), c // 2, 1023, 1024] if 0 <= p < c})
    y = torch.tensor(positions)
    z = torch.randn(len(positions), c) * 4
    if c > 3:
        z[:, -2] = float("-inf")  # masked column in the tail vector (never a target here unless c is tiny)
        y[y == c - 2] = c - 1
    exact = _reference_pair(z, y, uncertainty, mode, torch.float64)
    low = _reference_pair(z, y, uncertainty, mode, torch.float32)
    got = _kernel_pair(z, y, uncertainty, mode)
    assert_within_reference_error(got[0], exact[0], low[0], torch.float32, f"loss ({_isa()})")
    assert_within_reference_error(got[1], exact[1], low[1], torch.float32, f"gradient ({_isa()})")


def _reference_pair(z, y, uncertainty, mode, dtype):
    x = z.detach().to(dtype).clone().requires_grad_()
    loss = R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode=mode, gamma=3.0, reduction="none")
    loss.sum().backward()
    return loss.detach(), x.grad


def _kernel_pair(z, y, uncertainty, mode):
    x = z.detach().clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode=mode, gamma=3.0, reduction="none",
                                      backend="cpu")
    loss.sum().backward()
    return loss.detach(), x.grad


# (weight, norm q): every weight, and the gBS norms of the kernel's three p^q forms (q = 2, 1, other)
RANGE_WEIGHTS = [("none", 2.0), ("focal", 2.0), ("flsd", 2.0), ("dual_focal", 2.0), ("brier", 2.0), ("brier", 1.0),
                 ("brier", 3.0), ("external", 2.0), ("brier_flsd", 2.0)]
# what each logits dtype can hold: fp16 stops at 65504
RANGE_MARGINS = [0.0, 5.0, 30.0, 41.0, 41.5, 42.0, 44.0, 50.0, 60.0, 87.0, 88.0, 88.5, 89.0, 100.0, 1e3, 1e4]
RANGE_MARGINS_WIDE = [5e6, 1e7, 1e10, 1e20, 1e30]


def _assert_rows_close(got, exact, at_precision, dtype, what):
    """assert_within_reference_error row by row, so that a row with a loss of 1e30 does not set the bound of the
    others. For float64 the reference at the input's precision is the exact one (no own error to scale by), and two
    float64 evaluations of a loss-mode gradient (CE of up to 1e3 times du/dz) differ by more than 64 ulps: 4096."""
    ulps = 4096 if dtype == torch.float64 else 64
    for row in range(exact.shape[0]):
        assert_within_reference_error(got[row:row + 1], exact[row:row + 1], at_precision[row:row + 1], dtype,
                                      f"{what}, row {row}", ulps=ulps)


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
@pytest.mark.parametrize("mode", ["grad", "loss"])
@pytest.mark.parametrize("uncertainty,norm", RANGE_WEIGHTS, ids=[f"{w}-q{q:g}" for w, q in RANGE_WEIGHTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_target_reference_and_its_row_max_fallback(dtype, uncertainty, norm, mode, inplace):
    """The kernel takes a row's exponentials relative to the target logit and redoes the row from its max when the sums
    leave range (Σ_{k≠y} e^{z_k - z_y} > 2^60, a column ≈ 41.6 above the target). Rows on both sides of that limit:
    one column 0 … 1e4 above the target (1e30 where the dtype holds it), crossing 2^60, the exponential's overflow at
    88.7, the AVX2 clamp at 88, and past ≈ 5e6 the range where its reduction x - n ln2 is accurate; and 999 columns
    together just below and just above it (999·e^34 < 2^60 < 999·e^36). The redo re-reads the logits, so the first
    sweep must not have overwritten them: widened fp16/bf16 rows and in-place rows once gave e^margin (NaN past 89).
    Every dtype, weight, mode, in and out of place, op level, against the float64 reference of the same logits."""
    ops = _op()
    c = 1000
    margins = RANGE_MARGINS + ([] if dtype == torch.float16 else RANGE_MARGINS_WIDE)
    rows = len(margins) + 2
    z = torch.randn(rows, c) * 2
    y = torch.randint(0, c, (rows,))
    for row, margin in enumerate(margins):
        z[row, y[row]] = 0.0
        z[row, (y[row] + 1) % c] = margin
    for row, level in ((len(margins), 34.0), (len(margins) + 1, 36.0)):
        z[row] = level + torch.rand(c) * 1e-3
        z[row, y[row]] = 0.0
    z = z.to(dtype)
    sample_weight = torch.rand(rows) + 0.5 if uncertainty == "external" else None
    codes = (V.WEIGHT_CODES[uncertainty], V.MODE_CODES[mode], 3.0, norm, -100, V.REDUCTION_CODES["none"])
    buffer = z.clone()
    loss, grad, _ = ops.uncertainty_weighted_ce(buffer, y, sample_weight, None, *codes, True,
                                                buffer if inplace else None)
    if inplace:
        grad = buffer

    def reference(precision):
        x = z.to(precision, copy=True).requires_grad_()
        w = sample_weight.to(precision) if sample_weight is not None else None
        ref = R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode=mode, gamma=3.0, norm=norm, sample_weight=w,
                                        reduction="none")
        ref.sum().backward()
        return ref.detach(), x.grad

    exact = reference(torch.float64)
    # the kernel accumulates fp16/bf16 in float32 and returns a float32 loss; its gradient is rounded to the dtype
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    low = reference(accumulate)
    what = f"{uncertainty} q={norm:g} {mode} {dtype} {'in place' if inplace else 'out of place'} ({_isa()})"
    assert torch.isfinite(loss).all() and torch.isfinite(grad.double()).all(), what
    _assert_rows_close(loss, exact[0], low[0], accumulate, f"loss, {what}")
    _assert_rows_close(grad, exact[1], low[1].to(dtype), dtype, f"gradient, {what}")


@pytest.mark.parametrize("uncertainty, mode", [("brier", "grad"), ("brier", "loss"), ("none", "grad"), ("focal",
                                                                                                        "loss")])
def test_streaming_stores_agree_with_ordinary_stores(uncertainty, mode, monkeypatch):
    """Out of place, the AVX-512 path may write the gradient with streaming stores from a per-thread scratch row
    (automatically for rows of 1–16 KiB and gradients of at least 4 MiB; CALIBKERNELS_CPU_STREAMING_STORES=1/0 forces
    it on/off). The arithmetic is the same, so the gradients must agree bit for bit with ordinary stores, over rows
    that start at every offset within a cache line (C not a multiple of 16), targets in a row's partial first and last
    lines and in whole lines, an ignored row and a row redone from its max; and match the float64 reference."""
    if _isa() != "avx512":
        pytest.skip("the streaming stores are part of the AVX-512 sweeps")
    cases = [(37, c, "1") for c in (1, 3, 16, 17, 40, 1000, 4231)] + [(1100, 1000, "")]  # "": the automatic choice
    for n, c, flag in cases:
        z = torch.randn(n, c) * 3
        y = torch.randint(0, c, (n,))
        y[0], y[1], y[2] = 0, c - 1, min(c - 1, 20)
        y[3] = -100  # ignore_index
        if c > 1:
            z[4, (int(y[4]) + 1) % c] = z[4, y[4]] + 100.0  # past the target reference's range: the row-max fallback
        monkeypatch.setenv("CALIBKERNELS_CPU_STREAMING_STORES", flag)
        streamed = _kernel_pair(z, y, uncertainty, mode)
        monkeypatch.setenv("CALIBKERNELS_CPU_STREAMING_STORES", "0")
        ordinary = _kernel_pair(z, y, uncertainty, mode)
        assert torch.equal(streamed[1], ordinary[1]), f"gradients differ at C = {c}"
        assert torch.equal(streamed[0], ordinary[0]), f"losses differ at C = {c}"
        if n <= 64:
            exact = _reference_pair(z, y, uncertainty, mode, torch.float64)
            low = _reference_pair(z, y, uncertainty, mode, torch.float32)
            assert_within_reference_error(streamed[1], exact[1], low[1], torch.float32, f"gradient, C = {c}")


def test_softmax_gradient_is_accurate_element_by_element():
    """The kernel's exponential (csrc/cpu/vec_exp.h) is within about 3 ulps: every probability of a row spanning 80
    nats, down to e^-80, is within a few ulps of float64 (much stricter than the shared suite's bound, which is
    relative to the largest gradient entry)."""
    c = 4231
    z = torch.linspace(-80.0, 0.0, c)[torch.randperm(c)].reshape(1, c)
    y = torch.tensor([int(z.argmin())])  # the target far below the max: p_y ≈ e^-80, so 1 - p_y is exactly 1
    x = z.clone().requires_grad_()
    ck.uncertainty_weighted_ce(x, y, uncertainty="none", reduction="sum", backend="cpu").backward()
    p = torch.softmax(z.double(), dim=1)
    expected = p - torch.nn.functional.one_hot(y, c).double()
    others = torch.arange(c) != y
    rel = ((x.grad.double() - expected).abs() / expected.abs())[0, others]
    assert rel.max().item() < 8 * torch.finfo(torch.float32).eps, (
        f"worst relative error {rel.max().item():.2e} ({_isa()})")


def _skip_without_flush_to_zero():
    """The kernel flushes denormal results only on x86-64 (MXCSR), and the tests below need a caller that does not."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the kernel keeps the default floating-point mode on {platform.machine()}")
    if (torch.tensor([1e-39]) * 0.5).item() == 0.0:
        pytest.skip("this process already flushes denormals (the tests compare against a caller that does not)")


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
@pytest.mark.parametrize("uncertainty", ["none", "brier"])
@pytest.mark.parametrize("kind", ["hard", "mix", "dense"])
@pytest.mark.parametrize("c", [10, 1000, 1031])
def test_exponentials_below_the_float_range_flush_to_zero(c, kind, uncertainty, inplace):
    """Both vector exponentials (csrc/cpu/vec_exp.h) return exactly 0 below exp(-86), never a denormal (on Intel
    cores every denormal result costs a microcode assist, and the lanes past a row whose C is not a multiple of 16
    are -inf); the default build's exponential keeps denormals, which the kernel's flush-to-zero mode turns into 0.
    Columns 88-103 nats below the reference column get a gradient of exactly 0 (their target is 0), and no gradient
    entry of any row is subnormal."""
    _skip_without_flush_to_zero()
    g = torch.Generator().manual_seed(c)
    n = 6
    z = -88.0 - 15.0 * torch.rand(n, c, generator=g)
    z[:, :4] = torch.tensor([0.0, 0.0, -1.0, -2.0])
    z = z[:, torch.randperm(c, generator=g)]  # the in-range columns anywhere in their vectors
    live = z > -10.0
    y = torch.stack([torch.nonzero(row)[i % 3, 0] for i, row in enumerate(live)])  # sometimes not the row max
    kwargs = {}
    if kind == "mix":
        kwargs = dict(mix_target=torch.stack([torch.nonzero(row)[3, 0] for row in live]),
                      mix_lambda=torch.rand(n, generator=g))
    elif kind == "dense":
        t = torch.rand(n, c, generator=g) * live
        y = t / t.sum(1, keepdim=True)
    x = z.clone().requires_grad_()
    if inplace:
        loss = ck.uncertainty_weighted_ce(x * 1.0, y, uncertainty=uncertainty, inplace=True, backend="cpu", **kwargs)
    else:
        loss = ck.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, backend="cpu", **kwargs)
    loss.backward()
    grad = x.grad
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[~live] == 0).all(), f"largest deep-column gradient {grad[~live].abs().max().item():.3e} ({_isa()})"
    subnormal = (grad != 0) & (grad.abs() < torch.finfo(torch.float32).tiny)
    assert not subnormal.any(), f"{int(subnormal.sum())} subnormal gradient entries ({_isa()})"
    x64 = z.double().requires_grad_()
    expected = ck.uncertainty_weighted_ce(x64, y.double() if kind == "dense" else y, uncertainty=uncertainty,
                                          backend="reference", **kwargs)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), x64.grad, rtol=0, atol=1e-6)


# the cases whose gradient had denormal entries before the flush (the rest came out normal or 0 without it)
CONFIDENT_ROW_CASES = [(w, m, k, d) for w, m in [("brier", "grad"), ("brier", "loss"), ("focal", "grad")]
                       for k in ["hard", "smooth", "dense"] for d in [torch.float32, torch.bfloat16, torch.float64]
                       if not (w == "brier" and k == "dense") and not (d == torch.float64 and k != "hard")]


@pytest.mark.parametrize("uncertainty,mode,kind,dtype", CONFIDENT_ROW_CASES,
                         ids=[f"{w}-{m}-{k}-{str(d)[6:]}" for w, m, k, d in CONFIDENT_ROW_CASES])
def test_confident_rows_gradients_underflow_to_zero_and_the_callers_mode_is_kept(uncertainty, mode, kind, dtype):
    """Rows whose target logit is far above the rest have a tiny weight (u ≈ 1e-19 for BSCE-GRA 25 nats apart), so
    their gradient entries u p_k / N fall below the smallest normal number: without a flush about 50000 of these
    64000 float32 entries (64000 of float64's at 150 nats) came out denormal. The kernel flushes such results to 0
    (each denormal result costs a microcode assist on Intel cores), and only inside its own tasks: the calling thread
    still computes denormals after the op."""
    _skip_without_flush_to_zero()
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    n, c, gap = 64, 1000, 25.0 if dtype != torch.float64 else 150.0
    y = torch.randint(0, c, (n,), generator=g)
    z = torch.randn(n, c, generator=g) + gap * torch.nn.functional.one_hot(y, c)
    target = {"hard": y, "smooth": y, "dense": torch.nn.functional.one_hot(y, c).float()}[kind]
    kwargs = dict(label_smoothing=0.0 if kind != "smooth" else 1e-30)
    x = z.to(dtype).clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(x, target, uncertainty=uncertainty, mode=mode, backend="cpu", **kwargs)
    loss.backward()
    grad = x.grad.float() if dtype == torch.bfloat16 else x.grad
    finfo = torch.finfo(grad.dtype)
    subnormal = (grad != 0) & (grad.abs() < finfo.tiny)
    assert not subnormal.any(), f"{int(subnormal.sum())} subnormal gradient entries"
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (tiny * 0.5).item() != 0.0, "the op left the calling thread flushing denormals"
    x64 = z.double().clone().requires_grad_()
    expected = ck.uncertainty_weighted_ce(x64, target.double() if kind == "dense" else target, uncertainty=uncertainty,
                                          mode=mode, backend="reference", **kwargs)
    expected.backward()
    torch.testing.assert_close(grad.double(), x64.grad, rtol=0, atol=1e-12)


_TRAP_INVALID_CHILD = """
import ctypes, torch, calibkernels as ck
torch.set_num_threads(1)  # every row on this thread, the one whose traps feenableexcept sets
libm = ctypes.CDLL("libm.so.6")
g = torch.Generator().manual_seed(0)
for c in (10, 16, 1000, 1031):
    for weight, mode in [("none", "grad"), ("brier", "grad"), ("brier", "loss"), ("focal", "loss"), ("flsd", "grad")]:
        for kind in ("hard", "smooth", "mix", "dense"):
            for inplace in (False, True):
                z = torch.randn(64, c, generator=g) * 3
                y = torch.randint(0, c, (64,), generator=g)
                kw = dict(label_smoothing=0.1) if kind == "smooth" else {}
                if kind == "mix":
                    kw = dict(mix_target=y.flip(0), mix_lambda=0.3)
                t = torch.softmax(torch.randn(64, c, generator=g), 1) if kind == "dense" else y
                x = z.clone().requires_grad_()
                h = x * 1.0 if inplace else x
                # FE_INVALID traps (SIGFPE) around the op's forward only, where the kernel computes the loss and the
                # gradient: the inputs' generation and autograd's own ops are torch's, not what this test checks
                libm.feenableexcept(1)
                loss = ck.uncertainty_weighted_ce(h, t, uncertainty=weight, mode=mode, backend="cpu", inplace=inplace,
                                                  **kw)
                libm.fedisableexcept(1)
                loss.sum().backward()
print("no trap")
"""


@pytest.mark.parametrize("isa", ["native", "avx2", "default"])
def test_finite_inputs_raise_no_invalid_operation(isa):
    """On finite logits the kernel raises no invalid-operation exception, so a process that traps them (SIGFPE)
    survives a step: the lanes past a row (-inf) stay out of every unmasked operation that would form inf - inf or
    0 · inf. Hard, smoothed, mixed and dense targets, C with and without a partial vector, in place and not, each
    instruction-set build (glibc's feenableexcept, in a child process, on one thread, around the op's forward only;
    with the trap set over the whole loop, torch's input generation and backward included, the child intermittently
    died with SIGFPE on loaded machines, cause not found)."""
    import platform

    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("feenableexcept is glibc's, and the trap is checked on x86-64")
    env = dict(os.environ)
    if isa != "native":
        env["CALIBKERNELS_CPU_ISA"] = isa
        if isa == "avx2" and _isa() == "default":
            pytest.skip("this CPU (or ATen) does not run AVX2")
    run = subprocess.run([sys.executable, "-c", _TRAP_INVALID_CHILD], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "no trap" in run.stdout, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])


def test_cpu_isa_is_reported_and_follows_aten():
    """calibkernels._C.CPU_ISA names the vector path in use; AVX-512 is used only when ATen uses it."""
    from torch.backends import cpu as torch_cpu

    isa = _isa()
    assert isa in ("avx512", "avx2", "default")
    if torch_cpu.get_cpu_capability() != "AVX512":
        assert isa != "avx512"


def test_avx2_sweeps_agree_with_the_reference_in_a_subprocess():
    """This process runs the AVX-512 sweeps when the CPU has them; the AVX2 ones (the path on CPUs without AVX-512)
    are checked in a child process where ATEN_CPU_CAPABILITY=avx2 turns AVX-512 off, over the shared suite's CPU
    cases and this file's lane / accuracy tests."""
    if _isa() != "avx512":
        pytest.skip(f"this process already runs the {_isa()} sweeps")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    probe = subprocess.run([sys.executable, "-c", "import calibkernels._C as c; print(c.CPU_ISA)"], env=env,
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "avx2"
    # "cpu-cpu": the C++ backend's parametrisations only (not the reference's or the interpreted Triton's)
    selection = ("(cpu-cpu and (every_weight or odd_shapes or extreme or half_precision or nan_logits or "
                 "non_contiguous)) or every_target_lane or accurate_element or target_reference or flush_to_zero")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-x",
         os.path.join(here, "test_uncertainty_weighted_ce.py"), os.path.join(here,
                                                                             "test_uncertainty_weighted_ce_cpu.py"),
         "-k", selection],
        env=env, capture_output=True, text=True, cwd=here)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) > 100 and " failed" not in run.stdout, run.stdout[-2000:]


# ------------------------------------------------------------------------------------- gradient-buffer reuse (cache)
def _release_cache():
    import calibkernels._C

    return calibkernels._C.release_cpu_gradient_cache()


def _gradient(ops, z, y):
    return ops.uncertainty_weighted_ce(z, *_op_args(z, y), True, None)[1]


def test_freed_gradient_buffers_are_reused_and_live_ones_never_shared():
    ops = _op()
    _release_cache()
    n, c = 512, 1000  # 2 MB: above the cache's 1 MB floor
    z, y = torch.randn(n, c), _targets(n, c)
    first = _gradient(ops, z, y)
    expected = first.clone()
    second = _gradient(ops, z * 2, y)  # `first` is alive: a different buffer, and `first` is untouched
    assert second.data_ptr() != first.data_ptr()
    assert torch.equal(first, expected)
    reused_ptr = second.data_ptr()
    del second
    third = _gradient(ops, z, y)  # takes the buffer `second` gave back, fully overwritten
    assert third.data_ptr() == reused_ptr
    assert torch.equal(third, expected)
    del first, third
    assert _release_cache() == 2 * n * c * 4  # both freed buffers were kept (at most two)
    assert _release_cache() == 0
    small = _gradient(ops, torch.randn(8, 10), _targets(8, 10))  # below the floor: an ordinary allocation
    del small
    assert _release_cache() == 0


def test_cached_gradient_is_counted_by_the_memory_profiler():
    """A gradient handed out from the cache shows in the profiler's memory records while it lives (allocation and
    free, as for any CPU tensor), which the bench's peak-memory column relies on."""
    from torch.profiler import ProfilerActivity, profile

    ops = _op()
    n, c = 512, 1000
    z, y = torch.randn(n, c), _targets(n, c)
    warm = _gradient(ops, z, y)
    del warm  # back to the cache: the gradient below is a reused buffer
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        grad = _gradient(ops, z, y)
        del grad
    records = [event.nbytes() for event in prof.profiler.kineto_results.events() if event.name() == "[memory]"]
    assert n * c * 4 in records and -n * c * 4 in records, records


def test_gradient_cache_can_be_turned_off():
    code = ("import torch, calibkernels.cpp.uncertainty_weighted_ce; ops = torch.ops.calibkernels\n"
            "z = torch.randn(512, 1000); y = torch.randint(0, 1000, (512,))\n"
            "g = ops.uncertainty_weighted_ce(z, y, None, None, 4, 1, 2.0, 2.0, -100, 1, True, None)[1]; del g\n"
            "import calibkernels._C; print(calibkernels._C.release_cpu_gradient_cache())\n")
    env = dict(os.environ, CALIBKERNELS_CPU_GRAD_CACHE="0")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "0"


def test_ops_and_their_fake_kernels_exist_right_after_import():
    # A fresh process, so no other test has imported the wrapper module: `import calibkernels` alone must load the
    # compiled ops together with their register_fake / register_autograd halves (opcheck fails without the fake).
    code = ("import torch, calibkernels\n"
            "z = torch.randn(4, 5); y = torch.tensor([0, 1, 2, -100])\n"
            "args = (z, y, None, None, 4, 1, 2.0, 2.0, -100, 1)\n"
            "op = torch.ops.calibkernels.uncertainty_weighted_ce.default\n"
            "torch.library.opcheck(op, args + (True, None))\n"
            "b = z.clone(); torch.library.opcheck(op, (b,) + args[1:] + (True, b),\n"
            "                                     test_utils=('test_schema', 'test_faketensor'))\n"
            "print('checked')\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().splitlines()[-1] == "checked"


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_each_instruction_set_build_agrees_with_the_reference_in_a_subprocess(isa):
    """The extension is compiled for the x86-64 baseline with AVX2 (and AVX-512) kernels chosen at run time;
    CALIBKERNELS_CPU_ISA=default|avx2 forces a lower one (read once per process), so each build of the kernel runs
    this file's reference comparisons (every dtype x weight x mode x in place range test, target lanes, accuracy)."""
    if isa == "avx2" and _isa() == "default":
        pytest.skip("this CPU (or ATen) does not run AVX2")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, CALIBKERNELS_CPU_ISA=isa)
    probe = subprocess.run([sys.executable, "-c", "import calibkernels._C as c; print(c.CPU_ISA)"], env=env,
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == isa
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-x",
         os.path.join(here, "test_uncertainty_weighted_ce_cpu.py"),
         os.path.join(here, "test_uncertainty_weighted_ce_cpu_flsd.py"),
         "-k", "every_target_lane or target_reference or flsd or threshold or opcheck or confident_rows or "
         "flush_to_zero"],
        env=env, capture_output=True, text=True, cwd=here)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " failed" not in run.stdout and "passed" in run.stdout, run.stdout[-2000:]
