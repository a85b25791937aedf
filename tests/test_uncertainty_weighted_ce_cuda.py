"""The CUDA C++ kernels (``csrc/cuda/``: the op, its row kernels launched from ``row_kernels.cuh``), backend ``"cuda"``.

* Everywhere: a build made with a CUDA toolkit (``calibkernels._C.WITH_CUDA``) registers the CUDA kernels of the op
  and of the backward's scaling,
  and a build without one registers none (so a silently skipped ``.cu`` cannot pass for a CUDA build). Set
  ``CALIBKERNELS_EXPECT_CUDA=1`` (CI with nvcc) to also require that the build compiled the CUDA kernels.
* On a GPU machine (skipped otherwise): values and gradients against the float64 reference on every kernel shape —
  warp per row (C ≤ 1024), block per row with the row in registers (C ≤ 4096) and the streaming path
  (C > 4096; 4096-column tiles, statistics pass then gradient pass) — each with 16-byte vector and
  scalar (misaligned) accesses; strided and misaligned rows with sentinels around them
  (an out-of-bounds read shows as a wrong value, an out-of-bounds write as a changed sentinel); out-of-range targets;
  dual-focal ties; in place (``grad_out`` = the logits); no host synchronisation (CUDA-graph capture, sync debug
  mode); opcheck over the kernel shapes. The Brier weight with FLSD-53's γ_i (``brier_flsd``): the Brier
  weight's rows with γ_i for γ, for hard, compact soft and dense targets, and its band decided as FLSD's.

The brier_flsd bands are in ``test_uncertainty_weighted_ce_cuda_brier_flsd.py``; the batch fold, launch
counts, host synchronisation, opcheck and the streaming path in
``test_uncertainty_weighted_ce_cuda_launch.py``.

The contract suite (``test_uncertainty_weighted_ce_contracts*.py``) runs the same checks as every other backend on
the ``cuda`` backend too.
"""

import os

import pytest
import torch

import calibkernels as ck
from calibkernels import _kernel_codes as K
from calibkernels import _validation as V

from _tolerance import assert_within_reference_error

from _cuda_helpers import (OPS, WEIGHTS, MODES, REDUCTIONS, SHAPE_PATHS, needs_gpu, _op, _op_flag, _inplace, _reference,
                           check_op, _logits, _targets, _weight_kwargs)

_C = pytest.importorskip("calibkernels._C", reason="the compiled extension is not built")


# ----------------------------------------------------------------------------------------------------------------
# Runs everywhere (no GPU needed)
# ----------------------------------------------------------------------------------------------------------------
def test_cuda_kernel_registered_exactly_when_built_with_cuda():
    with_cuda = getattr(_C, "WITH_CUDA", None)
    assert with_cuda in (0, 1), "calibkernels._C must say whether it was built with the CUDA kernels (WITH_CUDA)"
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") == bool(with_cuda), (
            f"{op}: CUDA kernel registered={not with_cuda} but calibkernels._C.WITH_CUDA={with_cuda}"
        )
    if os.environ.get("CALIBKERNELS_EXPECT_CUDA") == "1":
        assert with_cuda == 1, "CALIBKERNELS_EXPECT_CUDA=1 but the extension was built without the CUDA kernels"


def test_a_build_without_code_for_the_gpu_is_not_available(monkeypatch):
    """A CUDA build without machine code or PTX for the GPU's architecture: the 'cuda' backend reports itself
    unavailable (naming the compute capability and the CUDA status), so backend="auto" takes Triton instead of a kernel
    that cannot launch. Before CUDA is in use nothing is probed. The GPU and the build are stood in for; the real probe
    is tested on a GPU below."""
    from calibkernels import _backends
    from calibkernels.cpp import uncertainty_weighted_ce as cpp_backend

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda index=None: (12, 0))
    monkeypatch.setattr(cpp_backend, "_has_kernel", lambda key: True)
    monkeypatch.setattr(cpp_backend, "_code_missing_on", lambda index: "cudaErrorNoKernelImageForDevice")
    reason = cpp_backend.is_available("cuda", torch.device("cuda"))
    assert reason is not None and "no CUDA code for this GPU (compute capability 12.0" in reason
    assert "cudaErrorNoKernelImageForDevice" in reason
    real = _backends.unavailable_reason
    monkeypatch.setattr(_backends, "unavailable_reason",
                        lambda name, device: None if name == "triton" else real(name, device))
    assert _backends.resolve_for_shape("auto", torch.device("cuda"), 1000, "hard") == "triton"
    monkeypatch.setattr(cpp_backend, "_code_missing_on", lambda index: None)
    assert cpp_backend.is_available("cuda", torch.device("cuda")) is None
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: False)
    monkeypatch.setattr(cpp_backend, "_code_missing_on", lambda index: pytest.fail("probed before CUDA is in use"))
    assert cpp_backend.is_available("cuda", torch.device("cuda")) is None


def test_only_definite_probe_answers_are_kept(monkeypatch):
    """The probe's status: success, or an image error (no code for the device), is kept per device; any other failure
    (e.g. out of memory making the context) says nothing about the build and is asked again next time."""
    from calibkernels.cpp import uncertainty_weighted_ce as cpp_backend

    answers = {0: (0, "cudaSuccess"), 1: (209, "cudaErrorNoKernelImageForDevice"), 2: (2, "cudaErrorMemoryAllocation")}
    asked = []
    monkeypatch.setattr(cpp_backend, "_cuda_kernels_probe",
                        lambda: lambda index: asked.append(index) or answers[index])
    monkeypatch.setattr(cpp_backend, "_missing_code", {})
    for _ in range(2):
        assert cpp_backend._code_missing_on(0) is None
        assert cpp_backend._code_missing_on(1) == "cudaErrorNoKernelImageForDevice"
        assert cpp_backend._code_missing_on(2) is None
    assert asked == [0, 1, 2, 2]


def test_target_check_of_a_device_flag(monkeypatch):
    """A device flag of the form the CUDA op returns (the kernels only NaN-poison bad rows; here
    calibkernels._validation.target_flag's, which the fused linear loss uses) names the bad value through
    calibkernels._target_checks, lets ignore_index through, and is ignored with CALIBKERNELS_VALIDATE=0. On CPU tensors
    the flag is read at once, which lets this run without a GPU."""
    from calibkernels import _target_checks

    def submit(target):
        _target_checks.submit(V.target_flag(target, 6, -100), 6, -100)

    for bad in (6, -1, 1000):
        target = torch.tensor([0, -100, bad, 5])
        with pytest.raises(ValueError, match=f"target value {bad} is out of range for 6 classes"):
            submit(target)
        monkeypatch.setattr(_target_checks, "POLICY", "off")
        submit(target)
        monkeypatch.setattr(_target_checks, "POLICY", "async")
    submit(torch.tensor([0, -100, 3, 5]))


# ----------------------------------------------------------------------------------------------------------------
# GPU tests
# ----------------------------------------------------------------------------------------------------------------
@needs_gpu
def test_the_build_has_code_for_this_gpu():
    """The probe behind the 'cuda' backend's availability (a kernel's attributes, which exist only where the build
    holds code for the device) says yes on the GPU the tests run on."""
    from calibkernels import _backends

    assert torch.ops.calibkernels.cuda_kernels_probe(torch.cuda.current_device()) == (0, "cudaSuccess")
    assert _backends.unavailable_reason("cuda", torch.device("cuda")) is None


@needs_gpu
@pytest.mark.parametrize("path", list(SHAPE_PATHS))
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_every_kernel_shape_against_reference(path, uncertainty, mode):
    c = SHAPE_PATHS[path]
    n = 37 if c <= 1024 else 6
    for reduction in REDUCTIONS:
        check_op(_logits(n, c), _targets(n, c), mode=mode, reduction=reduction, **_weight_kwargs(uncertainty, n))


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64],
                         ids=["fp32", "fp16", "bf16", "fp64"])
@pytest.mark.parametrize("c", [7, 1000, 3001, 20000])
@pytest.mark.parametrize("uncertainty", ["focal", "dual_focal", "brier", "brier_flsd"])
def test_dtypes(dtype, c, uncertainty):
    n = 16 if c <= 1024 else 4
    for mode in MODES:
        check_op(_logits(n, c, dtype), _targets(n, c), mode=mode, **_weight_kwargs(uncertainty, n))


@needs_gpu
@pytest.mark.parametrize("c", [33, 1000, 4096, 30000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("column_offset", [0, 1, 3, 8])
def test_strided_and_misaligned_rows_read_and_write_in_bounds(c, dtype, column_offset):
    """Rows inside a wider buffer with sentinels on both sides: a read past a row's ends would change the result, a
    write past them (in-place op) would change a sentinel."""
    n, pad = 5, 24
    sentinel = 7.0
    buffer = torch.full((n, c + pad), sentinel, device="cuda", dtype=dtype)
    logits = buffer[:, column_offset:column_offset + c]
    logits.copy_(_logits(n, c, dtype))
    y = _targets(n, c, ignore=False)
    for uncertainty in ("brier", "dual_focal"):
        check_op(logits, y, uncertainty=uncertainty, mode="loss", gamma=3.0)
    # The in-place op writes the gradient through the row stride, and nowhere else.
    exact_loss, exact_grad = _reference(logits, y, dtype=torch.float64, uncertainty="brier", mode="grad")
    low_loss, low_grad = _reference(logits, y, dtype=dtype, uncertainty="brier", mode="grad")
    outside = torch.ones_like(buffer, dtype=torch.bool)
    outside[:, column_offset:column_offset + c] = False
    loss = _inplace(logits, y, reduction="mean")
    assert torch.all(buffer[outside] == sentinel), "the in-place op wrote outside the logits"
    assert_within_reference_error(loss, exact_loss, low_loss, dtype, "in-place loss")
    assert_within_reference_error(logits, exact_grad, low_grad, dtype, "in-place gradient")


@needs_gpu
@pytest.mark.parametrize("c", [5, 1000, 5000, 20001])
def test_non_unit_class_stride_is_copied_not_misread(c):
    base = _logits(c, 4)  # (c, 4): its transpose has class stride 4
    logits = base.t()
    y = _targets(4, c, ignore=False)
    check_op(logits, y, uncertainty="focal", mode="loss", gamma=2.0)


@needs_gpu
@pytest.mark.parametrize("c", [9, 1000, 5000, 20000])
def test_out_of_range_targets_poison_only_their_row(c):
    n = 6
    z = _logits(n, c)
    y = _targets(n, c, ignore=False)
    bad_rows = [1, 4]
    y[1], y[4] = c, -7  # just past the end, and negative but not ignore_index
    buffer = torch.full((n, c + 16), 3.0, device="cuda")
    logits = buffer[:, 8:8 + c]
    logits.copy_(z)
    loss, grad = _op(logits, y, reduction="none")
    good = torch.ones(n, dtype=torch.bool)
    good[bad_rows] = False
    assert torch.isnan(loss[bad_rows]).all() and torch.isnan(grad[bad_rows]).all()
    safe_y = torch.where(good.cuda(), y, 0)
    exact_loss, exact_grad = _reference(logits, safe_y, dtype=torch.float64, uncertainty="brier", mode="grad",
                                        reduction="none")
    low_loss, low_grad = _reference(logits, safe_y, dtype=torch.float32, uncertainty="brier", mode="grad",
                                    reduction="none")
    assert_within_reference_error(loss[good], exact_loss[good], low_loss[good], torch.float32,
                                  "loss of the good rows")
    assert_within_reference_error(grad[good], exact_grad[good], low_grad[good], torch.float32,
                                  "gradient of the good rows")
    mean_loss, _ = _op(logits, y, reduction="mean")
    assert torch.isnan(mean_loss), "a reduced loss over a bad target must not look finite"
    # The in-place op poisons the bad rows too, and writes nowhere outside the logits.
    _inplace(logits, y, reduction="sum")
    assert torch.all(buffer[:, :8] == 3.0) and torch.all(buffer[:, 8 + c:] == 3.0)
    assert torch.isnan(logits[bad_rows]).all()


@needs_gpu
def test_asynchronous_checks_reuse_their_buffers_and_read_fresh_flags():
    """A check's pinned buffer and event are reused once read, and a reused buffer reports the new call's flag."""
    from calibkernels import _target_checks

    z = _logits(4, 50)
    good = torch.tensor([0, 3, 1, -100], device="cuda")
    ck.uncertainty_weighted_ce(z, good, backend="cuda")
    ck.synchronize_target_checks()
    spare = _target_checks._spare[z.device.index]
    buffers = {id(host) for _, host in spare}
    assert buffers
    for bad in (50, 77):
        with pytest.raises(ValueError, match=f"target value {bad} is out of range"):
            ck.uncertainty_weighted_ce(z, torch.tensor([0, bad, 1, -100], device="cuda"), backend="cuda")
            ck.synchronize_target_checks()
        ck.uncertainty_weighted_ce(z, good, backend="cuda")
        ck.synchronize_target_checks()  # a bad flag left in a reused buffer would raise here
    assert {id(host) for _, host in _target_checks._spare[z.device.index]} == buffers


@needs_gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_target_flag_output(reduction):
    """The op's third output is calibkernels._validation.target_flag of class indices (from the count launch of a
    mean with a gradient over more than 1024 rows, else from the row launch's last block), on every reduction, in
    place too (a dense target's flag: test_dense_target_flag_output)."""
    n, c = 3000, 50  # rows past one pass of the check's block
    z = _logits(n, c)
    y = _targets(n, c)
    for bad in (None, (7, [c]), (11, [-1, c + 5, 10**9])):
        target = y.clone()
        if bad is not None:
            rows = torch.arange(len(bad[1])) * bad[0]
            target[rows.cuda()] = torch.tensor(bad[1], device="cuda")
        want = V.target_flag(target, c, -100)
        for grad_out in (None, z.clone()):
            flag = _op_flag(grad_out if grad_out is not None else z, target, reduction=reduction, grad_out=grad_out)
            assert flag.dtype == torch.int64 and flag.device == z.device and flag.shape == (2,)
            assert int(flag[0]) == int(want[0]) == (bad is not None)
            if bad is not None:
                assert int(flag[1]) == int(want[1]) == max(bad[1])
    valid = y != -100
    mean_loss, _ = _op(z, y, reduction="mean")
    sum_loss, _ = _op(z, y, reduction="sum")
    torch.testing.assert_close(mean_loss, sum_loss / valid.sum())


@needs_gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("c", [50, 700, 2000, 5000])  # warp per row (8 and 32 values a lane), block per row, streamed
@pytest.mark.parametrize("dtypes", [(torch.float32, torch.float32), (torch.bfloat16, torch.float32),
                                    (torch.float16, torch.float16), (torch.float32, torch.bfloat16),
                                    (torch.float32, torch.float64), (torch.float64, torch.float64)])
def test_dense_target_flag_output(reduction, c, dtypes):
    """A dense target's flag, (any bad row, the first bad row), from the soft kernel's own reads of the target (the
    launch's last block folds the row flags), or from device reductions for
    a float64 target of lower-precision logits: dense_target_flag's answer on every path, in place too and with
    label smoothing (the check takes the target as given). A bfloat16 target of float32 logits is read converted to
    float32 and keeps bfloat16's tolerance. Every call under test follows a call with another answer: the row flags'
    buffer is most likely the block that call freed, so a path that left its flags unwritten would report the other
    call's answer, not a copy of its own."""
    logits_dtype, target_dtype = dtypes
    n = 1500  # rows past one pass of the fold's block
    z = _logits(n, c).to(logits_dtype)
    dense = torch.softmax(torch.randn(n, c, device="cuda", dtype=torch.float64), 1).to(target_dtype)
    tolerance = V.dense_row_sum_tolerance(target_dtype)
    decoy_bad = dense.clone()
    decoy_bad[n // 2, 0] = float("nan")

    def flag(logits, target, want, **kw):
        decoy, decoy_want = (decoy_bad, [1, n // 2]) if want[0] == 0 else (dense, [0, n])
        assert _op_flag(z, decoy, reduction=reduction).tolist() == decoy_want
        got = _op_flag(logits, target, reduction=reduction, **kw)
        assert got.dtype == torch.int64 and got.shape == (2,)
        assert got.tolist() == list(want), (want, kw.keys())

    for smoothing in (0.0, 0.1):
        for grad_out in (None, z.clone()):
            flag(grad_out if grad_out is not None else z, dense, [0, n], grad_out=grad_out, label_smoothing=smoothing)
    cases = [((700, 3, float("nan")),), ((5, 0, -0.5), (1499, 3, float("nan"))), ((1499, 1, float("inf")),),
             ((9, 2, float("-inf")),), ((300, 0, -0.25), (300, 1, None)),  # None: the row still sums to 1
             ((42, -1, -0.5),)]  # the row's last column: the scalar tail, or the last streamed tile
    for entries in cases:
        target = dense.clone()
        for row, col, value in entries:
            target[row, col] = value if value is not None else target[row, col] + 0.25 + float(dense[row, 0])
        want = V.dense_target_flag(target)
        assert want.tolist() == [1, min(row for row, _, _ in entries)]
        for grad_out in (None, z.clone()):
            flag(grad_out if grad_out is not None else z, target, want.tolist(), grad_out=grad_out)
        flag(z, target, want.tolist(), compute_grad=False)
    for row, factor in ((17, 1 + 3 * tolerance), (1200, 1 - 3 * tolerance)):  # rows off 1 by 3 tolerances
        target = dense.clone()
        target[row] *= factor
        flag(z, target, [1, row], label_smoothing=0.1)
    one = dense[:1].clone()  # a single row, and an empty batch (the op called directly; the API refuses it)
    assert _op_flag(z[:1], one, reduction=reduction).tolist() == [0, 1]
    one[0, 0] = -1.0
    assert _op_flag(z[:1], one, reduction=reduction).tolist() == [1, 0]
    assert _op_flag(z[:0], dense[:0], reduction=reduction).tolist() == [0, 0]


@needs_gpu
def test_dense_target_flag_of_rows_past_the_kernels_check_width():
    """Past DENSE_KERNEL_CHECK_MAX_CLASSES columns the CUDA op checks a dense target by device reductions (pairwise
    sums), with the same answer."""
    c = K.DENSE_KERNEL_CHECK_MAX_CLASSES + 16
    z = torch.zeros(2, c, device="cuda")
    target = torch.full((2, c), 1.0 / c, device="cuda")
    assert _op_flag(z, target, reduction="none").tolist() == [0, 2]
    target[1, 5] = -1e-3
    assert _op_flag(z, target, reduction="none").tolist() == [1, 1]


@needs_gpu
@pytest.mark.parametrize("rows", [9, 2000], ids=["checked in the fold", "checked by the count launch"])
@pytest.mark.parametrize("lambda_dtype", [torch.float32, torch.float64])
def test_the_target_flag_checks_a_mix(rows, lambda_dtype):
    """The op checks a mix in its scan of the targets (the row launch's fold, or the count launch of a mean with a
    gradient over more than 1024 rows): the flag's code (calibkernels._kernel_codes.TARGET_FLAG_CODES) and value as the
    host
    checks raise them, a bad target first, then a mix_target (the first bad row's value), then a λ (its first row);
    the rows with a bad mix_target or λ are NaN, the others as with a good mix. Float64 logits with a float64 λ too."""
    torch.manual_seed(0)
    c = 7
    logits_dtype = torch.float64 if lambda_dtype == torch.float64 else torch.float32
    z = torch.randn(rows, c, device="cuda", dtype=logits_dtype)
    y = torch.randint(0, c, (rows,), device="cuda")
    y[1] = -100
    mix = torch.randint(0, c, (rows,), device="cuda")
    lam = torch.rand(rows, device="cuda", dtype=lambda_dtype)
    bad_mix, bad_lam, bad_y = mix.clone(), lam.clone(), y.clone()
    bad_mix[[1, 3, rows - 1]] = torch.tensor([9, -100, 7], device="cuda")  # row 1 is ignored
    bad_lam[[1, 4, rows - 2]] = torch.tensor([1.5, float("nan"), -0.25], device="cuda", dtype=lambda_dtype)
    bad_y[[2, 5]] = torch.tensor([8, 12], device="cuda")
    for reduction in REDUCTIONS:
        def flag(target=y, m=mix, lam_=lam):
            return _op_flag(z, target, reduction=reduction, mix_target=m, mix_lambda=lam_).tolist()

        assert flag()[0] == 0, reduction
        assert flag(m=bad_mix) == [2, -100], reduction
        assert flag(lam_=bad_lam) == [3, 1], reduction
        assert flag(lam_=torch.tensor(float("nan"), device="cuda", dtype=lambda_dtype)) == [3, 0], reduction
        assert flag(m=bad_mix, lam_=bad_lam) == [2, -100], reduction
        assert flag(target=bad_y, m=bad_mix, lam_=bad_lam) == [1, 12], reduction
    good, _ = _op(z, y, reduction="none", mix_target=mix, mix_lambda=lam)
    mixed, grad = _op(z, y, reduction="none", mix_target=bad_mix, mix_lambda=bad_lam)
    nan_rows = sorted({3, 4, rows - 1, rows - 2})
    assert mixed.isnan().nonzero().flatten().tolist() == nan_rows
    assert grad[nan_rows].isnan().all() and not grad[[0, 1, 2]].isnan().any()
    keep = [i for i in range(rows) if i not in nan_rows]
    torch.testing.assert_close(mixed[keep], good[keep], rtol=0, atol=0)


@needs_gpu
@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("value", [1 + 1e-12, -1e-300], ids=["just above 1", "just below 0"])
def test_a_float64_lambda_just_outside_the_unit_interval_raises_beside_float32_logits(backend, value):
    """A float64 λ a rounding outside [0, 1] is refused by the GPU backends as by the host check, though in the
    logits' float32 it would be 1 or 0: the CUDA op, whose kernels read λ in float32, makes it NaN first; Triton
    compares it in float64. The row is NaN and the flag names λ's row."""
    if backend not in ck.available_backends():
        pytest.skip(f"{backend} backend not built")
    z = torch.randn(5, 7, device="cuda")
    y = torch.randint(0, 7, (5,), device="cuda")
    lam = torch.full((5,), 0.5, dtype=torch.float64, device="cuda")
    lam[3] = value
    kw = dict(mix_target=y.roll(1), mix_lambda=lam)
    with pytest.raises(ValueError, match="mix_lambda"):
        ck.uncertainty_weighted_ce(z.cpu(), y.cpu(), mix_target=y.roll(1).cpu(), mix_lambda=lam.cpu())
    ck.synchronize_target_checks()
    with pytest.raises(ValueError, match="mix_lambda"):
        ck.uncertainty_weighted_ce(z, y, backend=backend, **kw)
        ck.synchronize_target_checks()
    rows = ck.uncertainty_weighted_ce(z, y, backend=backend, reduction="none", **kw)
    assert rows.isnan().nonzero().flatten().tolist() == [3]
    with pytest.raises(ValueError, match="mix_lambda"):
        ck.synchronize_target_checks()
    if backend == "cuda":
        assert _op_flag(z, y, reduction="mean", **kw).tolist() == [K.TARGET_FLAG_CODES["mix_lambda"], 3]


@needs_gpu
def test_eager_calls_with_the_common_checks_give_the_full_checks_results(monkeypatch):
    """backend="cuda" eager calls: the same loss, gradient and errors whether the common call's few type tests or
    every check run; a bad target raises through the op's own flag."""
    from calibkernels import _validation

    common = _validation.loss_inputs._common_call
    z, y = _logits(64, 100), _targets(64, 100)
    dense = torch.softmax(torch.randn(64, 100, device="cuda"), 1)

    def step(target, **kw):
        leaf = z.clone().requires_grad_()
        logits = leaf * 1.0
        loss = ck.uncertainty_weighted_ce(logits, target, backend="cuda", **kw)
        loss.sum().backward()
        return loss.detach(), leaf.grad

    mix, lam = y.roll(1).clamp(min=0), torch.rand(64, device="cuda")
    for target, kw in ((y, {}), (y, {"label_smoothing": 0.1, "inplace": True}), (dense, {"uncertainty": "focal"}),
                       (y, {"reduction": "none", "mode": "loss"}), (y, {"mix_target": mix, "mix_lambda": lam}),
                       (y, {"mix_target": mix, "mix_lambda": 0.3, "label_smoothing": 0.1})):
        common_checks = step(target, **kw)
        monkeypatch.setattr(_validation.loss_inputs, "_common_call", lambda *args: None)
        full_checks = step(target, **kw)
        monkeypatch.setattr(_validation.loss_inputs, "_common_call", common)
        for a, b in zip(common_checks, full_checks):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    bad = y.clone()
    bad[3] = 100
    bad_dense = dense.clone()
    bad_dense[9, 0] = -1.0
    bad_mix, bad_lam = mix.clone(), lam.clone()
    bad_mix[5], bad_lam[7] = -3, float("nan")
    for target, kw, match in ((bad, {}, "target value 100 is out of range"), (bad_dense, {}, "row 9 is not"),
                              (y, {"mix_target": bad_mix, "mix_lambda": lam}, "mix_target value -3 is out of range"),
                              (y, {"mix_target": mix, "mix_lambda": bad_lam}, r"mix_lambda must be in \[0, 1\]")):
        with pytest.raises(ValueError, match=match):
            ck.uncertainty_weighted_ce(z, target, backend="cuda", **kw)
            ck.synchronize_target_checks()
    leaf = z.clone().requires_grad_()
    for call, error in ((lambda: ck.uncertainty_weighted_ce(z, y.cpu(), backend="cuda"), ValueError),
                        (lambda: ck.uncertainty_weighted_ce(z, dense, backend="cuda", ignore_index=3), ValueError),
                        (lambda: ck.uncertainty_weighted_ce(leaf, y, backend="cuda", inplace=True), ValueError),
                        (lambda: ck.uncertainty_weighted_ce(z, y, backend=["cuda"]), ValueError)):
        with pytest.raises(error):
            call()


@needs_gpu
@pytest.mark.parametrize("c", [6, 600, 6000, 24000])
def test_dual_focal_ties_split_the_gradient(c):
    """Integer logits from a few values make many tied p_j; the reference's amax splits the gradient between them."""
    n = 12
    z = torch.randint(-3, 4, (n, c), device="cuda").float()
    y = _targets(n, c)
    for reduction in REDUCTIONS:
        check_op(z, y, uncertainty="dual_focal", mode="loss", gamma=3.0, reduction=reduction)


@needs_gpu
@pytest.mark.parametrize("c", [10, 1000, 5000, 20000])
def test_extreme_infinite_and_confident_rows(c):
    n = 8
    z = _logits(n, c)
    z[0, 1:] = float("-inf")  # only the target-to-be (class 0) is finite: p_y = 1
    z[1, : c // 2] = float("-inf")
    z[2] *= 40  # very confident rows
    z[3, 3 % c] = 60.0
    y = torch.randint(0, c, (n,), device="cuda")
    y[0], y[3] = 0, 3 % c
    y[1] = c - 1
    for uncertainty in ("none", "focal", "flsd", "dual_focal", "brier", "brier_flsd"):
        for mode in MODES:
            check_op(z, y, uncertainty=uncertainty, mode=mode)


@needs_gpu
@pytest.mark.parametrize("c", [10, 1000, 5000, 20000])
def test_per_sample_gamma(c):
    n = 9
    gamma = torch.rand(n, device="cuda") * 4
    gamma[0] = 0.0
    for mode in MODES:
        check_op(_logits(n, c), _targets(n, c), uncertainty="focal", mode=mode, gamma_per_sample=gamma)


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["hard", "dense"])
def test_op_returns_the_top_label_stats(kind, dtype):
    """return_stats: the op's confidence and prediction are calibkernels.loss_stats.top_label_stats of the logits
    (those before an in-place gradient overwrote them), NaN / -1 on ignored rows; loss and gradient unchanged."""
    from calibkernels.loss_stats import top_label_stats

    z = _logits(64, 37, dtype)
    z[0, 1] = z[0, 3] = z[0].max() + 1  # a tie: the lower index
    z[1, :10] = float("-inf")
    y = _targets(64, 37) if kind == "hard" else torch.softmax(torch.randn(64, 37, device="cuda"), 1).to(dtype)
    if kind == "hard":
        y[1] = 20
    op = torch.ops.calibkernels.uncertainty_weighted_ce
    args = (y, None, None, V.WEIGHT_CODES["brier"], 1, 2.0, 2.0, -100, 1, True)
    loss, grad, _, confidence, prediction, _ = op(z, *args, None, return_stats=True)
    want = top_label_stats(z, None if kind == "dense" else y == -100, (64,))
    assert torch.equal(prediction, want.prediction)
    torch.testing.assert_close(confidence, want.confidence, rtol=1e-5, atol=0, equal_nan=True)
    plain_loss, plain_grad, *_ = op(z, *args, None)
    assert torch.equal(loss, plain_loss) and torch.equal(grad, plain_grad)
    buffer = z.clone()
    _, _, _, confidence, prediction, _ = op(buffer, *args, buffer, return_stats=True)
    assert torch.equal(prediction, want.prediction) and torch.equal(buffer, grad)
    torch.testing.assert_close(confidence, want.confidence, rtol=1e-5, atol=0, equal_nan=True)
