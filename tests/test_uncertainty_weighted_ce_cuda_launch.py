"""The CUDA kernels' launches on a GPU: the last block folds every row, an eager forward is one launch, no host
synchronisation (CUDA-graph capture), opcheck over the kernel shapes, the backward's scaling op, and the streaming
path (C > 4096): the kernel that ``auto`` runs and large rows against the reference. All-ignored batches, no
gradient buffer without a gradient and torch.compile(fullgraph=True) are in the contract suite
(``test_uncertainty_weighted_ce_contracts*.py``).
"""


import pytest
import torch

import calibkernels as ck
from calibkernels import reference as R

from _tolerance import assert_within_reference_error

from _cuda_helpers import REDUCTIONS, needs_gpu, _op, _op_flag, _inplace, _reference, check_op, _logits, _targets

_C = pytest.importorskip("calibkernels._C", reason="the compiled extension is not built")


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
        loss, *_ = op(*args, None, loss_in_logits_dtype=True)
        wide, *_ = op(*args, None)
        assert loss.dtype == args[0].dtype and torch.equal(loss, wide.to(loss.dtype))  # rounded once


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
