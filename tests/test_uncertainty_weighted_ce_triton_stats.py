"""The Triton backend's top-label statistics (``return_stats=True``), written by the loss launch itself: against
:func:`calibkernels.loss_stats.top_label_stats` of the same logits for hard, smoothed, mixed and dense targets, on
both read paths, ties, -inf columns, rows without a distribution, ignored rows and 16-bit logits; the loss and the
gradient unchanged by them; the registered op's opcheck and ``torch.compile(fullgraph=True)`` with them; the launch
shapes with them and the kernels with them compiled ahead of time for sm_90 (no spills).

Runs as ``test_uncertainty_weighted_ce_triton.py`` does: on CPU tensors through ``TRITON_INTERPRET=1`` (small shapes),
and on CUDA tensors when a GPU is present.
"""

import dataclasses
import os

import pytest
import torch

from calibkernels import _autograd, _backends
from calibkernels import _validation as V
from calibkernels.loss_stats import LossStats, top_label_stats

from _triton_helpers import DEVICES, _op_args

T = pytest.importorskip("calibkernels.triton.uncertainty_weighted_ce")

pytestmark = [
    # numpy (behind the interpreter) warns where the kernel deliberately takes log2(0) = -inf or divides by 0 on a
    # masked lane, and on the rows without a distribution below; the results are checked.
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

KINDS = ["hard", "smoothing", "mix", "dense"]
PATHS = ["single-read", "two-read"]


def _force_path(monkeypatch, path):
    """The two-read path: rows over 8 classes streamed in chunks of 4 (13 classes: 4 chunks)."""
    if path == "two-read":
        monkeypatch.setattr(T, "MAX_BLOCK", 8)
        monkeypatch.setattr(T, "MAX_BLOCK_16BIT", 8)


def _logits(n, c, device, dtype=torch.float32):
    """Random logits with the arg-max's hard cases: a tie across chunks (the first wins), a tie inside one chunk, a
    max that rises chunk by chunk and is then tied, and -inf columns before the max (and one in the max's chunk)."""
    z = torch.randn(n, c, device=device) * 2
    z[1, 3] = z[1, 7] = 9.0  # chunks 0 and 1 of the two-read path
    z[2, :5] = float("-inf")
    z[2, 9] = z[2, 10] = 8.0  # one chunk
    z[2, 11] = float("-inf")
    z[3, 1], z[3, 6], z[3, 11] = 5.0, 7.0, 7.0  # the running max rises in chunk 1, tied in chunk 2
    return z.to(dtype)


def _loss_inputs(kind, z, device, *, reduction="mean", ignore_index=-100):
    """Checked loss inputs of one target kind, with an ignored row for class-index targets."""
    c = z.shape[-1]
    y = torch.randint(0, c, z.shape[:-1], device=device)
    kw = {}
    if kind != "dense":
        y.view(-1)[0] = ignore_index
        y.view(-1)[2] = 9  # not a -inf column
    if kind == "smoothing":
        kw["label_smoothing"] = 0.1
    elif kind == "mix":
        mix = torch.randint(0, c, z.shape[:-1], device=device)
        mix.view(-1)[2] = 10
        kw.update(mix_target=mix, mix_lambda=0.7)
    elif kind == "dense":
        masked = z.detach() == float("-inf")  # no mass there, but on a row of only -inf logits
        y = torch.softmax(torch.randn(z.shape, device=device), dim=-1)
        y = y.masked_fill(masked & ~masked.all(dim=-1, keepdim=True), 0.0)
        y = y / y.sum(dim=-1, keepdim=True)
    return V.check_loss_inputs(z, y, uncertainty="focal", mode="loss", gamma=2.0, reduction=reduction,
                               ignore_index=ignore_index, check_values=False, **kw)


def _expected(inputs):
    """The oracle's statistics of the inputs' logits (captured before any kernel runs)."""
    ignored = None if inputs.dense else inputs.target == inputs.ignore_index
    return top_label_stats(inputs.logits.detach().clone(), ignored, inputs.batch_shape)


def _assert_stats(got, expected):
    assert isinstance(got, LossStats)
    assert got.confidence.dtype == torch.float32 and got.prediction.dtype == torch.int64
    assert got.confidence.shape == expected.confidence.shape and got.prediction.shape == expected.prediction.shape
    assert not got.confidence.requires_grad and not got.prediction.requires_grad
    torch.testing.assert_close(got.confidence.cpu(), expected.confidence.cpu(), rtol=1e-5, atol=1e-7,
                               equal_nan=True)
    assert torch.equal(got.prediction.cpu(), expected.prediction.cpu())


def _run(inputs, inplace=False, return_stats=False):
    return _autograd.run(_backends.module("triton"), inputs, inplace, return_stats)


# ----------------------------------------------------------------------------------------------------------------
# Values against the oracle; the loss and the gradient unchanged
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", KINDS)
def test_statistics_match_the_oracle_and_leave_loss_and_gradient_alone(monkeypatch, device, kind, path):
    _force_path(monkeypatch, path)
    z = _logits(6, 13, device)
    leaf = z.clone().requires_grad_()
    inputs = _loss_inputs(kind, leaf, device)
    loss, stats = _run(inputs, return_stats=True)
    loss.backward()
    _assert_stats(stats, _expected(inputs))

    # the same call without the statistics: bitwise the same loss and gradient
    plain = z.clone().requires_grad_()
    plain_loss = _run(dataclasses.replace(inputs, logits=plain))
    plain_loss.backward()
    # (a smoothed row with -inf logits has an infinite loss: NaN where it meets the gradient)
    torch.testing.assert_close(loss.detach(), plain_loss.detach(), rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(leaf.grad, plain.grad, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("kind", ["hard", "dense"])
def test_rows_without_a_distribution(monkeypatch, device, kind, path):
    """A row of only -inf logits (NaN, class 0), one holding +inf (NaN, the first +inf), NaN after or before the max
    (NaN, the first NaN), as the oracle; without a gradient (the no-autograd launch), reduction "none"."""
    _force_path(monkeypatch, path)
    z = _logits(6, 13, device)
    z[0] = float("-inf")
    z[1, 10] = float("inf")
    z[1, 12] = float("inf")
    z[4, 9] = float("nan")
    z[4, 11] = float("nan")
    z[5, 0] = float("nan")
    inputs = _loss_inputs(kind, z, device, reduction="none")
    with torch.no_grad():
        _, stats = _run(inputs, return_stats=True)
    expected = _expected(inputs)
    if kind == "hard":
        assert expected.prediction[0] == -1  # the ignored row: -1 whatever its logits
    else:
        assert expected.prediction[0] == 0 and expected.confidence[0].isnan()
    assert expected.prediction[1] == 10 and expected.prediction[4] == 9 and expected.prediction[5] == 0
    _assert_stats(stats, expected)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(monkeypatch, device, dtype, path):
    """16-bit logits, read as float32 as the oracle reads them; coarse values, so ties are common."""
    _force_path(monkeypatch, path)
    z = _logits(5, 13, device, dtype)
    z[4] = torch.randint(-2, 3, (13,), device=device).to(dtype)  # many tied maxima
    for kind in ("hard", "mix"):
        inputs = _loss_inputs(kind, z.clone().requires_grad_(), device)
        loss, stats = _run(inputs, return_stats=True)
        loss.backward()
        _assert_stats(stats, _expected(inputs))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("path", PATHS)
def test_batch_shape_and_gradient_in_place(monkeypatch, device, path):
    """(2, 3, C) logits give (2, 3) statistics; with ``inplace=True`` they are the logits' before the gradient
    overwrites them (on the two-read path the statistics pass reads the whole row before the gradient pass writes)."""
    _force_path(monkeypatch, path)
    x = _logits(6, 13, device).reshape(2, 3, 13).requires_grad_()
    logits = x * 1.0  # an intermediate: inplace=True overwrites it
    inputs = _loss_inputs("hard", logits, device, reduction="sum")
    expected = _expected(inputs)
    loss, stats = _run(inputs, inplace=True, return_stats=True)
    loss.backward()
    assert stats.confidence.shape == (2, 3)
    _assert_stats(stats, expected)


@pytest.mark.parametrize("device", DEVICES)
def test_without_stats_the_call_returns_the_loss_alone(device):
    z = _logits(4, 13, device)
    inputs = _loss_inputs("hard", z, device)
    loss = _run(inputs)
    assert isinstance(loss, torch.Tensor) and loss.dim() == 0


def test_a_module_without_kernel_statistics_reads_the_logits_first(monkeypatch):
    """A backend module without STATS_IN_KERNEL: the statistics come from the logits before its kernel runs (in place
    too)."""
    if _backends.unavailable_reason("cpu", torch.device("cpu")) is not None:
        pytest.skip("the compiled CPU extension is not available")
    module = _backends.module("cpu")
    monkeypatch.setattr(module, "STATS_IN_KERNEL", False)
    x = torch.randn(6, 13, requires_grad=True)
    logits = x * 1.0
    inputs = _loss_inputs("hard", logits, "cpu")
    expected = _expected(inputs)
    loss, stats = _autograd.run(module, inputs, True, return_stats=True)
    loss.backward()
    _assert_stats(stats, expected)


# ----------------------------------------------------------------------------------------------------------------
# The launcher's buffers, the registered op, torch.compile
# ----------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("device", DEVICES)
def test_stats_buffers_are_checked(device):
    z = torch.randn(4, 13, device=device)
    y = torch.randint(0, 13, (4,), device=device)
    args = (y, None, None, T.WEIGHT_NONE, T.MODE_GRAD, 0.0, 2.0, -100, T.REDUCTION_MEAN, False)
    good = (torch.empty(4, device=device), torch.empty(4, dtype=torch.int64, device=device))
    for bad in [(good[0].double(), good[1]), (good[0], good[1].int()), (good[0][:3], good[1]),
                (torch.empty(4, 2, device=device)[:, 0], good[1]), (good[0],)]:
        with pytest.raises(ValueError, match="confidence|prediction|stats_out"):
            T.uncertainty_weighted_ce_forward(z, *args, stats_out=bad)
    with pytest.raises(ValueError, match="go together"):
        torch.ops.calibkernels.uncertainty_weighted_ce_triton(z, *_op_args(z, y), False, None, None, None, 0.0,
                                                              good[0])
    T.uncertainty_weighted_ce_forward(z, *args, stats_out=good)
    expected = top_label_stats(z, None, (4,))
    _assert_stats(LossStats(*good), expected)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_stats(device):
    z = torch.randn(5, 11, device=device)
    y = torch.randint(0, 11, (5,), device=device)
    y[2] = -100
    op = torch.ops.calibkernels.uncertainty_weighted_ce_triton.default

    def buffers():
        return torch.empty(5, device=device), torch.empty(5, dtype=torch.int64, device=device)

    args = _op_args(z, y, uncertainty="focal", mode="loss")
    torch.library.opcheck(op, (z, *args, True, None, None, None, 0.0, *buffers()))
    logits = z.clone()
    torch.library.opcheck(op, (logits, *args, True, logits, None, None, 0.0, *buffers()))
    mix = torch.randint(0, 11, (5,), device=device)
    torch.library.opcheck(op, (z, *args, True, None, mix, torch.tensor(0.6, device=device), 0.1, *buffers()))
    confidence, prediction = buffers()
    op(z, *args, False, None, None, None, 0.0, confidence, prediction)
    _assert_stats(LossStats(confidence, prediction), top_label_stats(z, y == -100, (5,)))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
def test_compiles_with_fullgraph_and_stats(device, inplace):
    """The op with its statistics buffers stays in one graph; loss, statistics and gradients match eager."""
    torch._dynamo.reset()
    model = torch.nn.Linear(6, 9).to(device)
    x, y = torch.randn(8, 6, device=device), torch.randint(0, 9, (8,), device=device)
    y[3] = -100

    def step(features, target):
        inputs = V.check_loss_inputs(model(features), target, uncertainty="brier", mode="loss", check_values=False)
        return _run(inputs, inplace, return_stats=True)

    compiled = torch.compile(step, fullgraph=True, backend="inductor" if device == "cuda" else "aot_eager")
    compiled_loss, compiled_stats = compiled(x, y)
    compiled_loss.backward()
    compiled_grad = model.weight.grad.clone()
    model.weight.grad = None
    eager_loss, eager_stats = step(x, y)
    eager_loss.backward()
    torch.testing.assert_close(compiled_loss, eager_loss)
    torch.testing.assert_close(compiled_grad, model.weight.grad)
    _assert_stats(LossStats(*compiled_stats), eager_stats)
    with torch.no_grad():
        _assert_stats(eager_stats, top_label_stats(model(x), y == -100, (8,)))


# ----------------------------------------------------------------------------------------------------------------
# Without a GPU: the kernels with the statistics compiled for sm_90, and the largest float32 blocks' registers
# ----------------------------------------------------------------------------------------------------------------
def test_soft_brier_launches_with_stats_stream_past_their_caps():
    """The soft Brier blocks that spilled with the statistics (T.STATS_BLOCK_CAPS) take the two-read path with them,
    the same rows without them stay in registers."""
    for (target, _, mode_name), cap in T.STATS_BLOCK_CAPS.items():
        mode = T.MODE_LOSS if mode_name == "loss" else T.MODE_GRAD
        classes = 2 * cap
        with_stats = T._launch_config(classes, 4, target, T.WEIGHT_BRIER, mode, stats=True)
        without = T._launch_config(classes, 4, target, T.WEIGHT_BRIER, mode)
        assert not with_stats[0] and with_stats[1] <= cap
        assert without[0] or T.SOFT_BLOCK_CAPS.get((target, "brier", mode_name), classes) < classes
    assert T._launch_config(32000, 4, "hard", T.WEIGHT_BRIER, T.MODE_GRAD, stats=True)[0]


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the real kernels run in the tests above")
@pytest.mark.parametrize("classes,target,weights", [
    (["32000"], "hard", ["none", "focal", "flsd"]),  # the hard Brier block of 32768 spills a few with or without them
    (["32000"], "compact", ["none", "focal", "flsd", "brier"]),
    (["16384", "32000"], "dense", ["none", "focal", "flsd", "brier"]),
])
def test_kernels_with_stats_compile_without_spills_on_sm90(tmp_path, classes, target, weights):
    """The float32 launches with ``return_stats=True`` compile for sm_90 as the JIT specialises them
    (bench/triton_registers.py --stats) and none spills: the largest blocks, where the first column of the max and
    the rare re-read of a NaN row meet the row held in registers."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "registers.json"
    result = subprocess.run([sys.executable, "-m", "bench.triton_registers", "--stats", "--dtypes", "fp32", "--json",
                             str(out), "--classes", *classes, "--targets", target, "--weights", *weights],
                            capture_output=True, text=True, env=env, timeout=900,
                            cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 2 * len(weights) * len(classes)
    for row in rows:
        assert row["registers"] <= 128 and row["spill_stores"] == 0 and row["spill_loads"] == 0, row
