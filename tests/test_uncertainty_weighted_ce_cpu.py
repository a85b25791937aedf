"""The compiled CPU op ``calibkernels::uncertainty_weighted_ce`` beyond the contracts every backend meets (values,
opcheck and torch.compile in ``test_uncertainty_weighted_ce_contracts*.py``): float64 gradcheck of its loss-mode
gradient against finite differences, the loss in the logits' dtype, autocast, in-place semantics and the eager fast
path, the kernel's own argument checks (the last line of defence under torch.compile, where
Python-side checks are skipped) and the gradient-buffer cache.

The vector sweeps, their exponential and the instruction-set builds are in
``test_uncertainty_weighted_ce_cpu_sweeps.py``.
"""

import os
import subprocess
import sys

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends
from calibkernels import _validation as V
from calibkernels import reference as R


from _cpu_helpers import WEIGHTS, _op, _op_args, _targets

pytestmark = pytest.mark.skipif(
    _backends.unavailable_reason("cpu", torch.device("cpu")) is not None,
    reason="calibkernels._C was not built with the CPU kernel",
)


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


# ---------------------------------------------------------------------------------------- the loss in the logits' dtype
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("soft", [{}, {"label_smoothing": 0.1}], ids=["hard", "smooth"])
def test_a_16_bit_eager_step_casts_its_loss_once_and_nothing_in_the_backward(dtype, soft):
    """The eager call asks the op for its loss in the logits' dtype
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


# --------------------------------------------------------------------------------------------- the eager fast path
@pytest.mark.parametrize("kind", ["hard", "smooth", "mix", "mix_smooth", "dense", "dense_smooth"])
@pytest.mark.parametrize("dtype,reduction", [(torch.float32, "mean"), (torch.float32, "none"),
                                             (torch.bfloat16, "sum")])
def test_inplace_eager_call_gives_the_out_of_place_results(kind, dtype, reduction):
    """In place the op writes the gradient over the logits: the same loss and gradient, bit for bit, as out of place,
    the overwritten logits' version bumped; a leaf (or a view of one) is refused; without grad the logits are left
    alone."""
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

    def step(inplace):
        leaf = z.clone().requires_grad_()
        logits = leaf * 1.0
        loss = ck.uncertainty_weighted_ce(logits, y, uncertainty="focal", mode="loss", gamma=2.0, reduction=reduction,
                                          inplace=inplace, **kw)
        loss.sum().backward()
        return loss.detach(), leaf.grad, logits._version

    written, separate = step(True), step(False)
    for a, b in zip(written[:2], separate[:2]):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert written[2] > separate[2], "the overwritten logits' version is bumped"
    for logits in (z.clone().requires_grad_(), z.clone().requires_grad_()[:, :]):
        with pytest.raises(ValueError, match="leaf"):
            ck.uncertainty_weighted_ce(logits, y, inplace=True, **kw)
    plain = z.clone()
    with torch.no_grad():
        ck.uncertainty_weighted_ce(plain.requires_grad_(), y, inplace=True, **kw)
    assert torch.equal(plain.detach(), z)
    with pytest.raises(TypeError, match="inplace must be a bool"):
        ck.uncertainty_weighted_ce(z.clone(), y, inplace=0, **kw)


def test_the_common_call_gives_the_full_checks_results(monkeypatch):
    """The common call (class indices, numbers for gamma and norm) is checked in a few type tests and leaves the
    target values to the kernel: the same loss and gradient as with every check run."""
    from calibkernels import _validation

    z = torch.randn(11, 29) * 3
    y = _targets(11, 29)

    def step():
        leaf = z.clone().requires_grad_()
        loss = ck.uncertainty_weighted_ce(leaf * 1.0, y, uncertainty="focal", gamma=2.0, inplace=True)
        loss.backward()
        return loss.detach(), leaf.grad

    served = []
    common = _validation.loss_inputs._common_call
    monkeypatch.setattr(_validation.loss_inputs, "_common_call", lambda *args: served.append(1) or common(*args))
    fast = step()
    assert served, "the common call should take the common checks"
    monkeypatch.setattr(_validation.loss_inputs, "_common_call", lambda *args: None)
    for a, b in zip(fast, step()):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def _error_text(call):
    try:
        call()
    except (ValueError, TypeError, RuntimeError) as error:
        return type(error).__name__, str(error)
    return None


@pytest.mark.parametrize("inplace", [False, True])
def test_dense_targets_checked_by_the_op_give_the_references_results_and_errors(inplace):
    """A dense target on CPU tensors has its values checked by the compiled op itself, in the sweep that reads it:
    the reference's values, and its errors (values, shapes, dtypes, a target that requires grad, ignore_index, a
    mix)."""
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
    z_empty = torch.randn(9, 0)
    for target in (torch.ones(9, 0), torch.zeros(9, dtype=torch.int64)):
        assert _error_text(lambda: ck.uncertainty_weighted_ce(z_empty, target, backend="cpu")) == (
            "ValueError", "logits have zero classes")

    def run(target, kw, backend):
        leaf = z.clone().requires_grad_()
        logits = leaf * 1.0 if inplace else leaf
        loss = ck.uncertainty_weighted_ce(logits, target, uncertainty=kw.pop("uncertainty", "brier"),
                                          inplace=inplace, backend=backend, **kw)
        loss.sum().backward()
        return loss.detach(), leaf.grad

    for number, (target, kw) in enumerate(cases):
        kernel = _error_text(lambda: run(target, dict(kw), "cpu")) or run(target, dict(kw), "cpu")
        reference = _error_text(lambda: run(target, dict(kw), "reference")) or run(target, dict(kw), "reference")
        if number < 3:
            for a, b in zip(kernel, reference):
                torch.testing.assert_close(a, b)
        else:
            assert kernel == reference, (number, kernel, reference)


def test_a_backend_that_is_not_a_string_is_refused():
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
    _, _, flag, *_ = ops.uncertainty_weighted_ce(z, *_op_args(z, y.clamp(0, 4)), True, None)
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


# ------------------------------------------------------------------------------------- gradient-buffer reuse (cache)
def _release_cache():
    return torch.ops.calibkernels.release_cpu_gradient_cache()


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
            "print(ops.release_cpu_gradient_cache())\n")
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
