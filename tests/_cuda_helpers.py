"""Shared helpers of the CUDA kernels' test files (test_uncertainty_weighted_ce_cuda*.py): the op names, the class
counts of every kernel shape, the GPU skip mark, calls of the op and of its in-place form, the float64
reference and random logits, targets and weight arguments.
"""

import pytest
import torch

from calibkernels import _validation as V
from calibkernels import reference as R

from _tolerance import assert_within_reference_error


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


needs_gpu = pytest.mark.skipif(
    not torch.cuda.is_available() or not _has_cuda_kernel(),
    reason="needs a CUDA device and an extension built with the CUDA kernels",
)


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
