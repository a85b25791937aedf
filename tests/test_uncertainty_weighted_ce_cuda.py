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
  mode); opcheck and torch.compile(fullgraph=True). The Brier weight with FLSD-53's γ_i (``brier_flsd``): the Brier
  weight's rows with γ_i for γ, for hard, compact soft and dense targets, and its band decided as FLSD's.

The shared backend-vs-reference suite (``test_uncertainty_weighted_ce.py``) runs the same checks as every other backend
on ``("cuda", "cuda")`` too.
"""

import math
import os

import numpy as np
import pytest
import torch

import calibkernels as ck
from calibkernels import _kernel_codes as K
from calibkernels import _validation as V
from calibkernels import reference as R

from _flsd_band import band_choices, flsd_gammas, gamma_picked
from _tolerance import assert_within_reference_error

_C = pytest.importorskip("calibkernels._C", reason="the compiled extension is not built")

OPS = ("calibkernels::uncertainty_weighted_ce", "calibkernels::uncertainty_weighted_ce_scale_grad_")
WEIGHTS = ["none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd"]
MODES = ["loss", "grad"]
REDUCTIONS = ["none", "mean", "sum"]

# Class counts around the kernel shapes' thresholds, with aligned (vector) and misaligned (scalar) rows: for float32,
# C * 4 bytes is a multiple of 16 exactly when C is a multiple of 4. The names are those of an earlier layout (block
# path up to 16384, shared-memory streaming above); today's thresholds are 1024 and 4096 (the .cu header), so
# "block-max-now"/"stream-smallest-now" sit at the block/streaming boundary and the larger "block-*" counts exercise
# the streaming path with one to four tiles.
SHAPE_PATHS = {
    "warp-scalar": 10,
    "warp-small-max": 256,
    "warp-large-smallest": 257,
    "warp-vector": 1000,
    "warp-scalar-tail": 1023,
    "warp-max": 1024,
    "block-smallest": 1025,
    "block-max-now": 4096,
    "stream-smallest-now": 4097,
    "block-vector": 5000,
    "block-scalar": 4099,
    "block-max": 16384,
    "stream-smallest": 16385,
    "stream-vector": 40000,
    "stream-scalar": 40001,
    "stream-two-reads": 70001,
}


def _has_cuda_kernel():
    return all(torch._C._dispatch_has_kernel_for_dispatch_key(op, "CUDA") for op in OPS)


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
    import types

    from calibkernels.cpp import uncertainty_weighted_ce as cpp_backend

    answers = {0: (0, "cudaSuccess"), 1: (209, "cudaErrorNoKernelImageForDevice"), 2: (2, "cudaErrorMemoryAllocation")}
    asked = []
    monkeypatch.setattr(cpp_backend, "_C", types.SimpleNamespace(
        cuda_kernels_probe=lambda index: asked.append(index) or answers[index]))
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
needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not _has_cuda_kernel(),
    reason="needs a CUDA device and an extension built with the CUDA kernels",
)


@needs_gpu
def test_the_build_has_code_for_this_gpu():
    """The probe behind the 'cuda' backend's availability (a kernel's attributes, which exist only where the build
    holds code for the device) says yes on the GPU the tests run on."""
    from calibkernels import _backends

    assert _C.cuda_kernels_probe(torch.cuda.current_device()) == (0, "cudaSuccess")
    assert _backends.unavailable_reason("cuda", torch.device("cuda")) is None


def _op(logits, target, *, uncertainty="brier", mode="grad", gamma=4.0, norm=2.0, sample_weight=None,
        gamma_per_sample=None, reduction="mean", ignore_index=-100, compute_grad=True, grad_out=None,
        mix_target=None, mix_lambda=None, label_smoothing=0.0):
    """The op's ``(loss, grad)``; :func:`_op_flag` gives its target flag."""
    return _op_outputs(**locals())[:2]


def _op_flag(logits, target, **kw):
    """The op's target flag (two device slots: a bad target seen, the largest bad value / the first bad row)."""
    return _op_outputs(logits, target, **kw)[2]


def _op_outputs(logits, target, *, uncertainty="brier", mode="grad", gamma=4.0, norm=2.0, sample_weight=None,
                gamma_per_sample=None, reduction="mean", ignore_index=-100, compute_grad=True, grad_out=None,
                mix_target=None, mix_lambda=None, label_smoothing=0.0):
    return torch.ops.calibkernels.uncertainty_weighted_ce(
        logits, target, sample_weight, gamma_per_sample, V.WEIGHT_CODES[uncertainty], V.MODE_CODES[mode], float(gamma),
        float(norm), ignore_index, V.REDUCTION_CODES[reduction], compute_grad, grad_out, mix_target, mix_lambda,
        float(label_smoothing))


def _inplace(logits, target, *, reduction="mean"):
    """The op in place (the gradient of BSCE-GRA overwrites ``logits``); returns the loss."""
    loss, grad = _op(logits, target, reduction=reduction, grad_out=logits)
    assert grad.shape == (0,)
    return loss


def _reference(logits, target, *, dtype, sample_weight=None, gamma=4.0, **kw):
    """Loss and gradient (for grad_output = 1) of the reference at ``dtype``."""
    x = logits.detach().to(dtype).clone().requires_grad_()
    if isinstance(gamma, torch.Tensor):
        gamma = gamma.to(torch.float64 if dtype == torch.float64 else gamma.dtype)
    sw = None if sample_weight is None else sample_weight.to(dtype)
    loss = R.uncertainty_weighted_ce(x, target, sample_weight=sw, gamma=gamma, **kw)
    loss.backward(torch.ones_like(loss))
    return loss.detach(), x.grad


def check_op(logits, target, **kw):
    """The op's loss and gradient against the float64 reference (tolerance from the reference at the input dtype)."""
    dtype = logits.dtype
    loss, grad = _op(logits, target, **kw)
    expected_loss_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    assert loss.dtype == expected_loss_dtype and grad.dtype == dtype and grad.is_contiguous()
    assert grad.shape == logits.shape
    ref_kw = {k: v for k, v in kw.items() if k not in ("gamma_per_sample", "compute_grad")}
    if kw.get("gamma_per_sample") is not None:
        ref_kw["gamma"] = kw["gamma_per_sample"]
    exact_loss, exact_grad = _reference(logits, target, dtype=torch.float64, **ref_kw)
    low_loss, low_grad = _reference(logits, target, dtype=dtype, **ref_kw)
    assert_within_reference_error(loss, exact_loss, low_loss, dtype, "loss")
    assert_within_reference_error(grad, exact_grad, low_grad, dtype, "gradient")
    return loss, grad


def _logits(n, c, dtype=torch.float32, scale=3.0):
    return (torch.randn(n, c, device="cuda") * scale).to(dtype)


def _targets(n, c, ignore=True):
    y = torch.randint(0, c, (n,), device="cuda")
    if ignore and n >= 4:
        y[torch.randperm(n, device="cuda")[: n // 4]] = -100
    return y


def _weight_kwargs(uncertainty, n):
    # brier_flsd: a γ for the top band (p_y ≥ 0.5) other than FLSD-53's 3 and 5
    kw = {"uncertainty": uncertainty, "gamma": {"brier": 4.0, "brier_flsd": 2.0}.get(uncertainty, 3.0)}
    if uncertainty == "external":
        kw["sample_weight"] = torch.rand(n, device="cuda") + 0.1
    return kw


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
def test_out_of_range_targets_raise_through_the_public_api():
    z = _logits(4, 50)
    for bad in (50, -1, 10**6):
        y = torch.tensor([0, bad, 1, -100], device="cuda")
        with pytest.raises(ValueError, match="out of range"):
            ck.uncertainty_weighted_ce(z, y, backend="cuda")
            ck.synchronize_target_checks()  # the default policy raises without stalling, i.e. a little later


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
def test_eager_calls_take_the_fast_path(monkeypatch):
    """backend="cuda" eager calls go straight to the op's C++ autograd (functional._fast_call), with the same loss,
    gradient and errors as the general path; a bad target raises through the op's own flag."""
    from calibkernels import functional

    assert functional._compiled_kernel("cuda", torch.device("cuda"))
    _fast_call = functional._fast_call
    calls = []
    fast_op = functional._EAGER_LOSS
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
        monkeypatch.setattr(functional, "_EAGER_LOSS", lambda *args: calls.append(args) or fast_op(*args))
        fast = step(target, **kw)
        assert len(calls) == 1, kw
        calls.clear()
        monkeypatch.setattr(functional, "_fast_call", lambda *args: None)
        general = step(target, **kw)
        monkeypatch.undo()
        for a, b in zip(fast, general):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
    bad = y.clone()
    bad[3] = 100
    bad_dense = dense.clone()
    bad_dense[9, 0] = -1.0
    monkeypatch.setattr(functional, "_EAGER_LOSS", lambda *args: calls.append(args) or fast_op(*args))
    bad_mix, bad_lam = mix.clone(), lam.clone()
    bad_mix[5], bad_lam[7] = -3, float("nan")
    for target, kw, match in ((bad, {}, "target value 100 is out of range"), (bad_dense, {}, "row 9 is not"),
                              (y, {"mix_target": bad_mix, "mix_lambda": lam}, "mix_target value -3 is out of range"),
                              (y, {"mix_target": mix, "mix_lambda": bad_lam}, r"mix_lambda must be in \[0, 1\]")):
        with pytest.raises(ValueError, match=match):
            ck.uncertainty_weighted_ce(z, target, backend="cuda", **kw)
            ck.synchronize_target_checks()
        assert len(calls) == 1, "the bad target should have taken the fast path"
        calls.clear()
    # what the fast path hands to the general path fails there with the general path's error
    leaf = z.clone().requires_grad_()
    for call in (lambda: ck.uncertainty_weighted_ce(z, y.cpu(), backend="cuda"),
                 lambda: ck.uncertainty_weighted_ce(z, dense, backend="cuda", ignore_index=3),
                 lambda: ck.uncertainty_weighted_ce(leaf, y, backend="cuda", inplace=True),
                 lambda: ck.uncertainty_weighted_ce(z, y, backend=["cuda"])):
        with pytest.raises((ValueError, TypeError)) as fast_error:
            call()
        monkeypatch.setattr(functional, "_fast_call", lambda *args: None)
        with pytest.raises((ValueError, TypeError)) as general_error:
            call()
        monkeypatch.setattr(functional, "_fast_call", _fast_call)
        assert str(fast_error.value) == str(general_error.value)
    assert not calls


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


# ----------------------------------------------------------------------------------------------------------------
# brier_flsd: the Brier weight with FLSD-53's γ_i
# ----------------------------------------------------------------------------------------------------------------
BAND_GAMMA = 2.0  # γ of the top band (p ≥ 0.5): distinct from FLSD-53's 3 and 5
BANDS = band_choices(BAND_GAMMA)


def _rows_in_every_band(n, c):
    """float32 logits whose target probabilities sweep (0, 1) clear of FLSD-53's thresholds, and their targets."""
    g = torch.Generator().manual_seed(c)
    z = torch.randn(n, c, generator=g, dtype=torch.float64)
    y = torch.randint(0, c, (n,), generator=g)
    p_y = torch.linspace(0.013, 0.987, n, dtype=torch.float64)  # 0.2 and 0.5 fall between two rows
    others = z.scatter(1, y[:, None], float("-inf")).logsumexp(dim=1)
    z[torch.arange(n), y] = others + torch.log(p_y / (1 - p_y))
    return z.float().cuda(), y.cuda()


def _target_of(kind, y, c, seed=0):
    """The op's target and soft arguments for class indices `y` (hard, compact: a mix and smoothing, or dense), and
    the target distribution t they stand for (float64, CPU)."""
    one_hot = torch.nn.functional.one_hot(y.cpu(), c).double()
    if kind == "hard":
        return y, {}, one_hot
    if kind == "compact":
        mix, lam, a = (y + 1) % c, 0.85, 0.05
        t = a / c + (1 - a) * (lam * one_hot + (1 - lam) * torch.nn.functional.one_hot(mix.cpu(), c).double())
        lambdas = torch.full(y.shape, lam, device="cuda")
        return y, dict(mix_target=mix, mix_lambda=lambdas, label_smoothing=a), t
    g = torch.Generator().manual_seed(seed)
    dense = (0.9 * one_hot + 0.1 * torch.softmax(torch.randn(len(y), c, generator=g, dtype=torch.float64), 1)).float()
    return dense.cuda(), {}, dense.double()


@needs_gpu
@pytest.mark.parametrize("c", [10, 1000, 3001, 20000])
@pytest.mark.parametrize("kind", ["hard", "compact", "dense"])
def test_brier_flsd_rows_are_brier_rows_with_their_band_gamma(kind, c):
    """A brier_flsd row is, bit for bit, the Brier weight's row with γ = its γ_i (the kernels run the Brier code with
    γ_i in place of γ), for hard, compact soft and dense targets on every launch shape, in both modes, with q = 2 and
    the general-q path; and the whole against the reference."""
    n = 40
    z, y = _rows_in_every_band(n, c)
    target, soft, t = _target_of(kind, y, c, seed=c)
    p_band = (t * torch.softmax(z.double().cpu(), dim=1)).sum(dim=1)  # p_y, or <t, p>
    clear = ((p_band - K.FLSD_LOW_THRESHOLD).abs() > 1e-4) & ((p_band - K.FLSD_MID_THRESHOLD).abs() > 1e-4)
    expected = flsd_gammas(p_band, BAND_GAMMA)
    assert set(expected[clear].tolist()) == set(BANDS), "the rows should reach every band"
    for mode in MODES:
        for norm in (2.0, 1.5):
            kw = dict(mode=mode, norm=norm, **soft)
            loss, grad = _op(z, target, uncertainty="brier_flsd", gamma=BAND_GAMMA, reduction="none", **kw)
            for g in BANDS:
                rows = (clear & (expected == g)).cuda()
                want_loss, want_grad = _op(z, target, uncertainty="brier", gamma=g, reduction="none", **kw)
                assert torch.equal(loss[rows], want_loss[rows]), f"{kind}/{mode}/q={norm}: loss of the γ={g} rows"
                assert torch.equal(grad[rows], want_grad[rows]), f"{kind}/{mode}/q={norm}: gradient of the γ={g} rows"
            check_op(z, target, uncertainty="brier_flsd", gamma=BAND_GAMMA, reduction="sum", **kw)


def _picked_by_both(z, target, t, **soft):
    """γ_i per row as flsd picks it and as brier_flsd picks it (grad mode, no gradient): which γ of BANDS explains each
    row's loss (flsd: (1 - <t, p>)^γ CE; brier_flsd with q = 2: ‖p - t‖^γ CE, in float64 from the logits' exact values;
    the three losses differ by far more than rounding)."""
    picked = []
    for uncertainty in ("flsd", "brier_flsd"):
        loss, _ = _op(z, target, uncertainty=uncertainty, gamma=BAND_GAMMA, reduction="none", compute_grad=False,
                      **soft)
        picked.append(gamma_picked(loss, z, t, uncertainty, BANDS))  # float64 on the CPU
    return picked


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_brier_flsd_band_is_flsd_band_at_the_thresholds(dtype):
    """Rows whose exact p_y or <t, p> is a threshold, or a few float32 ulps from one: brier_flsd takes the band flsd
    takes. Equal logits give a band value of exp(-log C) as the device rounds it (torch's exp and log on the device
    are the kernel's), float32(exp(-log 5)) being 0.19999999 on a CPU; the rows 16 and 64 ulps away take the band of
    their exact value."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for c in (5, 2):
        device_band = torch.exp(-torch.log(torch.tensor(float(c), dtype=acc, device="cuda"))).float()
        z = torch.zeros(3, c, dtype=dtype, device="cuda")
        y = torch.tensor([0, 1, c - 1], device="cuda")
        flsd, brier_flsd = _picked_by_both(z, y, torch.nn.functional.one_hot(y.cpu(), c).double())
        assert brier_flsd == flsd == [flsd_gammas(device_band, BAND_GAMMA).item()] * 3, (c, device_band.item())
    for threshold in (K.FLSD_LOW_THRESHOLD, K.FLSD_MID_THRESHOLD):
        t32 = np.float32(threshold)
        ulp = float(np.spacing(t32))
        exact = [float(t32) + k * ulp for k in (-64, -16, 16, 64)]
        z = torch.zeros(len(exact), 2, dtype=torch.float64)
        z[:, 1] = torch.tensor([math.log((1 - p) / p) for p in exact], dtype=torch.float64)
        z = z.to(dtype).cuda()
        y = torch.zeros(len(exact), dtype=torch.long, device="cuda")
        p_y = torch.softmax(z.double().cpu(), dim=1)[:, 0]
        flsd, brier_flsd = _picked_by_both(z, y, torch.nn.functional.one_hot(y.cpu(), 2).double())
        assert brier_flsd == flsd == flsd_gammas(p_y, BAND_GAMMA).tolist(), (threshold, p_y.tolist())


@needs_gpu
def test_brier_flsd_band_of_compact_targets_is_flsd_band():
    """Equal logits with mixes and smoothing (<t, p> = 0.2 exactly): brier_flsd takes flsd's band, that of the closed
    form float32((w_y e^{z_y - lse} + w_m e^{z_m - lse}) + c), evaluated here with the device's float32 exp and log."""
    c = 5
    z = torch.zeros(3, c, device="cuda")
    y = torch.tensor([0, 1, 2], device="cuda")
    mix = torch.tensor([3, 1, 4], device="cuda")
    lam = torch.tensor([0.5, 0.25, 1.0], device="cuda")
    e = torch.exp(-torch.log(torch.tensor(float(c), device="cuda")))
    for a in (0.0, 0.5):
        one = torch.tensor(1.0, device="cuda")
        keep, add = one - a, torch.tensor(a, device="cuda") / c
        band = ((keep * lam) * e + (keep * (one - lam)) * e) + add
        t = a / c + (1 - a) * (lam.double().cpu()[:, None] * torch.nn.functional.one_hot(y.cpu(), c).double()
                               + (1 - lam.double().cpu()[:, None]) * torch.nn.functional.one_hot(mix.cpu(), c).double())
        flsd, brier_flsd = _picked_by_both(z, y, t, mix_target=mix, mix_lambda=lam, label_smoothing=a)
        assert brier_flsd == flsd == flsd_gammas(band, BAND_GAMMA).tolist(), (a, band.tolist())


@needs_gpu
@pytest.mark.parametrize("n", [1, 9, 1024, 1025, 5000],
                         ids=["1 row", "9 rows", "divisor counted in every block", "count launch", "count launch, "
                              "several passes of the fold"])
@pytest.mark.parametrize("c", [16, 1000, 3001, 5000])  # warp per row (8 and 32 values a lane), block per row, streamed
def test_the_last_block_folds_every_row(n, c):
    """Blocks finish in an order the GPU picks; the one that draws the last ticket must see every other block's row
    losses (the fences around the ticket, the reads past L1), and leave the counter at 0 for the next launch on the
    stream. Back-to-back calls on the default stream and on a side stream: each mean and sum equal to the float64 sum
    of the same rows' losses (reduction "none"), through both sources of the mean's divisor (each block's own count up
    to 1024 rows, the count launch above), with and without a gradient, and the mean's gradient as the reference's;
    the target flag of a bad target at the batch's start, middle and end."""
    torch.manual_seed(n + c)
    side = torch.cuda.Stream()
    for stream in (torch.cuda.current_stream(), side):
        with torch.cuda.stream(stream):
            for _ in range(10):
                z = _logits(n, c)
                y = _targets(n, c)
                valid = int((y != -100).sum())
                rows, _ = _op(z, y, uncertainty="focal", reduction="none")
                for compute_grad in (True, False):
                    total, _ = _op(z, y, uncertainty="focal", reduction="sum", compute_grad=compute_grad)
                    mean, mean_grad = _op(z, y, uncertainty="focal", reduction="mean", compute_grad=compute_grad)
                    torch.testing.assert_close(total.double(), rows.double().sum(), rtol=1e-5, atol=1e-6)
                    torch.testing.assert_close(mean.double(), rows.double().sum() / max(valid, 1), rtol=1e-5,
                                               atol=1e-6)
                    if compute_grad:  # (without, the op returns an empty gradient)
                        grad = mean_grad
            exact_loss, exact_grad = _reference(z, y, dtype=torch.float64, uncertainty="focal", gamma=4.0)
            torch.testing.assert_close(grad.double(), exact_grad, rtol=1e-4, atol=1e-6)
            for row in sorted({0, n // 2, n - 1}):
                bad = y.clone()
                bad[row] = c + row
                for reduction in REDUCTIONS:
                    flag = _op_flag(z, bad, uncertainty="focal", reduction=reduction)
                    assert flag.tolist() == [1, c + row], (row, reduction)
                    loss, _ = _op(z, bad, uncertainty="focal", reduction=reduction)
                    assert torch.isnan(loss).any()
                assert _op_flag(z, y, uncertainty="focal").tolist()[0] == 0
    torch.cuda.synchronize()


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("target", ["hard", "smooth", "mix", "dense"])
@pytest.mark.parametrize("batch", [256, 8192])
def test_an_eager_forward_is_one_launch(dtype, target, batch):
    """What an eager forward with a gradient costs the device: the row launch alone (its last block reduces the batch,
    writes the loss in the logits' dtype and makes the target flag, a mix's values checked with the targets), and the
    count launch before it for a mean over more than 1024 rows of class indices; the backward of the mean loss one
    scaling launch (it reads grad_output on the device). Counted by the profiler's device kernels."""
    from torch.profiler import ProfilerActivity, profile

    c = 1000
    z = _logits(batch, c, dtype)
    y = _targets(batch, c)
    kwargs = {"label_smoothing": 0.1} if target == "smooth" else {}
    if target == "mix":
        kwargs = {"mix_target": y.roll(1).clamp(min=0), "mix_lambda": torch.rand(batch, device="cuda")}
    if target == "dense":
        y = torch.softmax(torch.randn(batch, c, device="cuda"), 1)
    x = z.clone().requires_grad_()
    ck.bsce_gra_loss(x, y, backend="cuda", **kwargs).backward()  # warm-up: the ticket counter, the target checks
    torch.cuda.synchronize()

    def kernels(step):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            out = step()
            torch.cuda.synchronize()
        return out, [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]

    x = z.clone().requires_grad_()
    loss, forward = kernels(lambda: ck.bsce_gra_loss(x, y, backend="cuda", **kwargs))
    rows = [name for name in forward if "soft_target_kernel" in name or "uncertainty_weighted_ce_kernel" in name]
    counts = [name for name in forward if "check_targets_kernel" in name]
    # the target flag's asynchronous copy to pinned host memory (calibkernels._target_checks): a copy-engine
    # transfer on the stream, not a launch, and the host does not wait for it
    flag_copies = [name for name in forward if name.startswith("Memcpy DtoH")]
    assert len(rows) == 1 and len(counts) == (1 if target != "dense" and batch > 1024 else 0), forward
    assert len(flag_copies) == 1 and len(forward) == len(rows) + len(counts) + len(flag_copies), forward
    _, backward = kernels(lambda: loss.backward())
    assert len(backward) == 1 and "scale_grad_kernel" in backward[0], backward
    assert loss.dtype == dtype
    exact = R.uncertainty_weighted_ce(z.double(), y.double() if target == "dense" else y, **kwargs)
    tolerance = 1e-5 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(loss.double(), exact, rtol=tolerance, atol=tolerance)


@needs_gpu
@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_all_ignored_rows_give_zero_loss_and_gradient(reduction):
    z = _logits(5, 300)
    y = torch.full((5,), -100, device="cuda")
    loss, grad = _op(z, y, reduction=reduction)
    assert torch.all(loss == 0) and torch.all(grad == 0)


@needs_gpu
def test_without_gradient_no_buffer_is_written():
    loss, grad = _op(_logits(6, 100), _targets(6, 100), compute_grad=False)
    assert grad.shape == (0,) and loss.shape == ()


@needs_gpu
# 32000: the streaming path
@pytest.mark.parametrize("c", [1000, 32000])
def test_no_host_synchronisation_and_cuda_graph_capture(c):
    n = 64
    z = _logits(n, c)
    y = _targets(n, c)
    expected_loss, expected_grad = _op(z, y, uncertainty="brier", mode="loss", reduction="mean")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for reduction in REDUCTIONS:
            _op(z, y, uncertainty="dual_focal", mode="loss", reduction=reduction)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        _op(z, y, uncertainty="brier", mode="loss", reduction="mean")  # warm-up outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        loss, grad = _op(z, y, uncertainty="brier", mode="loss", reduction="mean")
    z.copy_(_logits(n, c))
    graph.replay()
    torch.cuda.synchronize()
    fresh_loss, fresh_grad = _op(z, y, uncertainty="brier", mode="loss", reduction="mean")
    assert torch.equal(loss, fresh_loss) and torch.equal(grad, fresh_grad)
    assert not torch.equal(grad, expected_grad)  # the replay really recomputed from the new logits


@needs_gpu
def test_opcheck():
    n, c = 8, 300
    samples = [
        (_logits(n, c), _targets(n, c), None, None, 4, 1, 4.0, 2.0, -100, 1, True),
        (_logits(n, c, torch.bfloat16), _targets(n, c), None, None, 3, 0, 5.0, 2.0, -100, 0, True),
        (_logits(n, c), _targets(n, c), None, torch.rand(n, device="cuda") * 3, 1, 0, 0.0, 2.0, -100, 2, True),
        (_logits(n, c), _targets(n, c), torch.rand(n, device="cuda"), None, 5, 1, 0.0, 2.0, -100, 1, False),
        (_logits(n, 20000), _targets(n, 20000), None, None, 2, 0, 3.0, 2.0, -100, 1, True),
        (_logits(n, c), _targets(n, c), None, None, 6, 0, 2.0, 1.5, -100, 0, True),
    ]
    op = torch.ops.calibkernels.uncertainty_weighted_ce.default
    for args in samples:
        torch.library.opcheck(op, args + (None,))
        logits = args[0].clone()
        torch.library.opcheck(op, (logits,) + args[1:-1] + (True, logits))  # in place
        torch.library.opcheck(op, args + (None,), {"loss_in_logits_dtype": True})
        loss, _, _ = op(*args, None, loss_in_logits_dtype=True)
        wide, _, _ = op(*args, None)
        assert loss.dtype == args[0].dtype and torch.equal(loss, wide.to(loss.dtype))  # rounded once


@needs_gpu
def test_compiles_with_fullgraph_and_matches_eager():
    model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1000)).cuda()
    x = torch.randn(128, 32, device="cuda")
    y = _targets(128, 1000)

    def step(inputs):
        return ck.uncertainty_weighted_ce(model(inputs), y, uncertainty="brier", mode="grad", backend="cuda")

    compiled = torch.compile(step, fullgraph=True)
    eager_loss = step(x)
    eager_grads = torch.autograd.grad(eager_loss, list(model.parameters()))
    compiled_loss = compiled(x)
    compiled_grads = torch.autograd.grad(compiled_loss, list(model.parameters()))
    torch.testing.assert_close(compiled_loss, eager_loss)
    for got, want in zip(compiled_grads, eager_grads):
        torch.testing.assert_close(got, want)


@needs_gpu
def test_scale_grad_op_passes_opcheck():
    """The backward's in-place scaling op (skipped on the device when grad_output is 1), with grad_output in float32,
    in the gradient's dtype (read as it is) and in another dtype (cast first), a scalar or one factor per row."""
    op = torch.ops.calibkernels.uncertainty_weighted_ce_scale_grad_.default
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        grad = torch.randn(8, 300, device="cuda", dtype=dtype)
        for grad_output in (torch.tensor(1.0, device="cuda"), torch.tensor(-3.0, device="cuda", dtype=dtype),
                            torch.tensor(1.0, device="cuda", dtype=dtype), torch.rand(8, device="cuda") + 0.5,
                            (torch.rand(8, device="cuda") + 0.5).to(dtype),
                            torch.tensor(0.75, device="cuda", dtype=torch.float16)):
            torch.library.opcheck(op, (grad.clone(), grad_output))
            scaled = grad.clone()
            op(scaled, grad_output)
            factor = grad_output.float()[:, None] if grad_output.dim() == 1 else grad_output.float()
            torch.testing.assert_close(scaled.float(), (grad.float() * factor).to(dtype).float())
    # float64 keeps its digits: a factor that float32 rounds to 1 still scales, and the product is float64's
    grad = torch.randn(8, 300, device="cuda", dtype=torch.float64)
    for grad_output in (torch.tensor(1 + 1e-12, device="cuda", dtype=torch.float64),
                        torch.rand(8, device="cuda", dtype=torch.float64) + 0.5):
        scaled = grad.clone()
        op(scaled, grad_output)
        factor = grad_output[:, None] if grad_output.dim() == 1 else grad_output
        torch.testing.assert_close(scaled, grad * factor, rtol=1e-15, atol=0)
        assert not torch.equal(scaled, grad)


# ----------------------------------------------------------------------------------------------------------------
# The streaming path (C > 4096)
# ----------------------------------------------------------------------------------------------------------------
def _streaming_rows(n, c, dtype, column_offset):
    """Logits (a slice starting at ``column_offset`` of a sentinel-filled buffer, or the whole tensor for None) and
    targets with ignored rows, a row half -inf whose target sits in the last column (the last tile's tail) and a row
    whose only finite entry is its target. The buffer's rows are a multiple of 8 elements wide (16 bytes for 16-bit
    types, 32 for float32), so offset 0 gives 16-byte aligned rows and offset 1 misaligned ones."""
    z = _logits(n, c, dtype)
    z[2, : c // 2] = float("-inf")
    z[4, 1:] = float("-inf")
    y = torch.randint(0, c, (n,), device="cuda")
    y[1] = y[3] = -100
    y[2], y[4] = c - 1, 0
    if column_offset is None:
        return None, z, y
    buffer = torch.full((n, -(-c // 8) * 8 + 8), 7.0, device="cuda", dtype=dtype)
    logits = buffer[:, column_offset:column_offset + c]
    logits.copy_(z)
    return buffer, logits, y


def _kernel_names(logits, target):
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _op(logits, target)
        torch.cuda.synchronize()
    return {e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
            and "calibkernels" in e.name and "_kernel" in e.name}


@needs_gpu
@pytest.mark.parametrize(("c", "target_kind"), [(1000, "hard"), (4097, "hard"), (4096, "smooth"), (4097, "smooth"),
                                               (32000, "mix"), (32001, "mix"), (1000, "dense"), (1001, "dense")])
def test_auto_on_cuda_runs_the_kernel_its_table_names(c, target_kind):
    """backend="auto" on CUDA tensors, eager forward + backward: the CUDA C++ kernels where
    _backends.auto_prefers_cuda says so for the row width and target kind, the Triton kernels otherwise (told apart by
    the names of the device kernels that ran), with the loss of the backend named explicitly."""
    from calibkernels import _backends
    from torch.profiler import ProfilerActivity, profile

    if _backends.unavailable_reason("triton", torch.device("cuda")) is not None:
        pytest.skip("needs both GPU backends")
    expected = "cuda" if _backends.auto_prefers_cuda(c, target_kind) else "triton"
    z = _logits(8, c, torch.bfloat16)
    y = _targets(8, c, ignore=False)
    kw = {}
    if target_kind == "smooth":
        kw = dict(label_smoothing=0.1)
    elif target_kind == "mix":
        kw = dict(mix_target=y.flip(0), mix_lambda=0.3)
    elif target_kind == "dense":
        y = torch.softmax(torch.randn(8, c, device="cuda"), 1)

    def step(backend):
        x = z.clone().requires_grad_()
        loss = ck.uncertainty_weighted_ce(x, y, uncertainty="brier", backend=backend, **kw)
        loss.backward()
        return loss.detach(), x.grad

    step("auto")  # Triton compiles on first use, outside the profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        got = step("auto")
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    cuda_ran = any("calibkernels::" in name for name in names)
    triton_ran = any(name.startswith(("_uncertainty_weighted_ce", "_soft_target_ce")) for name in names)
    assert (cuda_ran, triton_ran) == (expected == "cuda", expected == "triton"), names
    for actual, wanted in zip(got, step(expected)):
        torch.testing.assert_close(actual, wanted)


@needs_gpu
def test_large_rows_against_reference():
    """C > 4096, the streaming path: aligned and misaligned rows (a slice from column 1, with sentinels around it),
    ignored and -inf rows, fp32 and bf16, in place. The kernel that ran is checked by name."""
    n = 6
    # one mostly-padding tile; several tiles; a ragged tail; 32 tiles of 4096; 64 tiles (fp32 only)
    for c in (4097, 32000, 70000, 131072, 262144):
        names = _kernel_names(*_streaming_rows(n, c, torch.float32, None)[1:])
        assert any("uncertainty_weighted_ce_kernel" in name for name in names), sorted(names)
        for dtype in (torch.float32,) if c == 262144 else (torch.float32, torch.bfloat16):
            for column_offset in (None, 0, 1):
                buffer, logits, y = _streaming_rows(n, c, dtype, column_offset)
                for uncertainty, mode in (("brier", "grad"), ("brier", "loss"), ("dual_focal", "loss"), ("focal",
                                                                                                         "loss"),
                                     ("none", "grad")):
                    check_op(logits, y, uncertainty=uncertainty, mode=mode, gamma=3.0)
                check_op(logits, y, uncertainty="brier", mode="grad", reduction="none")
                kw = dict(uncertainty="focal", mode="loss", gamma=3.0, reduction="sum")
                loss_only, no_grad = _op(logits, y, compute_grad=False, **kw)
                assert no_grad.numel() == 0
                torch.testing.assert_close(loss_only, _op(logits, y, **kw)[0], rtol=0, atol=0)
                if buffer is None:
                    continue
                # In place, on aligned (vector) and misaligned rows: each thread overwrites only what it read itself,
                # after every read of the target column.
                exact_loss, exact_grad = _reference(logits, y, dtype=torch.float64, uncertainty="brier", mode="grad")
                low_loss, low_grad = _reference(logits, y, dtype=dtype, uncertainty="brier", mode="grad")
                outside = torch.ones_like(buffer, dtype=torch.bool)
                outside[:, column_offset:column_offset + c] = False
                loss = _inplace(logits, y, reduction="mean")
                assert torch.all(buffer[outside] == 7.0), f"C={c} {dtype}: the in-place op wrote outside the logits"
                assert_within_reference_error(loss, exact_loss, low_loss, dtype, "in-place loss")
                assert_within_reference_error(logits, exact_grad, low_grad, dtype, "in-place gradient")
