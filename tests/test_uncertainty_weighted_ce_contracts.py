"""The autograd contracts of the fused loss, the same on every backend (docs/losses.md, "Contracts").

In place on a leaf, double backward, gradients of a per-sample ``gamma``, retained graphs, memory per reduction and
the hyper-parameter checks: each either works as the reference does or raises a clear error, never a plausible wrong
answer. Written once against conftest.py's ``backend`` fixture (every fused backend this install runs, with its
device; Triton on CPU tensors under ``TRITON_INTERPRET=1``), and ``backend_or_reference`` where the reference is held
to the same contract.
"""

import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends
from calibkernels import _validation as V
from calibkernels import reference as R

from _tolerance import assert_within_largest_entry

from conftest import FUSED_BACKENDS


def _targets(n, c, device, ignored=1):
    y = torch.randint(0, c, (n,), device=device)
    y[:ignored] = -100
    return y


# ---------------------------------------------------------------------------------------------------------- in place
def test_inplace_on_a_leaf_or_a_view_of_one_is_refused(backend):
    name, device = backend
    leaf = torch.randn(4, 6, device=device, requires_grad=True)
    y = torch.randint(0, 5, (4,), device=device)
    before = leaf.detach().clone()
    for logits in (leaf, leaf[:, :5], leaf.view(2, 2, 6)):
        target = y if logits.dim() == 2 else y.view(2, 2)
        with pytest.raises(ValueError, match="inplace=True.*leaf"):
            ck.uncertainty_weighted_ce(logits, target, backend=name, inplace=True)
    assert torch.equal(leaf.detach(), before), "a refused in-place call must leave the leaf untouched"


def test_inplace_on_logits_that_share_memory_is_refused(backend):
    """In place on logits whose rows share memory (an expanded row, e.g. a broadcast bias): the rows' gradients would
    overwrite each other and the logits other rows still read. Refused with ValueError on the public call and, for
    the compiled op, on its grad_out argument (also a separate buffer with shared rows); out of place it runs and
    matches the reference."""
    name, device = backend
    row = torch.randn(1, 6, device=device, requires_grad=True)
    y = torch.tensor([0, 1, 2, 3], device=device)
    with pytest.raises(ValueError, match="share memory"):
        ck.uncertainty_weighted_ce((row * 1).expand(4, 6), y, backend=name, inplace=True)
    loss = ck.uncertainty_weighted_ce((row * 1).expand(4, 6), y, backend=name)
    exact = R.uncertainty_weighted_ce(row.detach().double().expand(4, 6), y)
    torch.testing.assert_close(loss.double(), exact, rtol=1e-5, atol=1e-6)
    op = (torch.ops.calibkernels.uncertainty_weighted_ce_triton if name == "triton"
          else torch.ops.calibkernels.uncertainty_weighted_ce)
    z = torch.randn(4, 6, device=device)
    codes = (V.WEIGHT_CODES["brier"], V.MODE_CODES["grad"], 4.0, 2.0, -100, V.REDUCTION_CODES["mean"], True)
    shared = torch.zeros(1, 6, device=device).expand(4, 6)
    with pytest.raises(ValueError, match="share memory"):
        op(z, y, None, None, *codes, shared)
    assert torch.equal(shared, torch.zeros(4, 6, device=device))
    with pytest.raises(ValueError, match="shape"):  # the kernels would write rows past a smaller buffer
        op(z, y, None, None, *codes, torch.zeros(3, 6, device=device))


def test_inplace_protects_other_users_of_the_logits(backend):
    """Another node that saved the logits raises at backward instead of reading the gradient written over them."""
    name, device = backend
    leaf = torch.randn(5, 7, device=device, requires_grad=True)
    for other_users in (
        lambda logits: (logits * logits).sum(),  # MulBackward saved the logits
        # exp saves its output, not the logits; pow saves the logits (as sigmoid would)
        lambda logits: logits.exp().sum() + (logits ** 2).sum(),
    ):
        logits = leaf * 2.0
        other = other_users(logits)
        loss = ck.uncertainty_weighted_ce(logits, _targets(5, 7, device), backend=name, inplace=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            (loss + other).backward()


# -------------------------------------------------------------------------------------------------- double backward
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_double_backward_raises_instead_of_contributing_nothing(backend, dtype):
    """A backward with create_graph=True raises, in every form: a gradient returned as a value whose
    differentiation raises (as before) left the second-order term out of a look-ahead step differentiated with
    torch.autograd.grad(..., inputs), where autograd runs only the nodes on a path to the inputs."""
    name, device = backend
    uncertainty = torch.randn(5, 5, device=device, dtype=dtype, requires_grad=True)
    features = torch.randn(6, 5, device=device, dtype=dtype)
    y = _targets(6, 5, device)
    for step in (
        lambda loss: torch.autograd.grad(loss, uncertainty, create_graph=True),  # the look-ahead's first step
        lambda loss: loss.backward(create_graph=True),
    ):
        loss = ck.uncertainty_weighted_ce(features @ uncertainty, y, backend=name)
        with pytest.raises(RuntimeError, match="double backward.*backend='reference'"):
            step(loss)
    # without create_graph, nothing changes
    loss = ck.uncertainty_weighted_ce(features @ uncertainty, y, backend=name)
    (grad,) = torch.autograd.grad(loss, uncertainty)
    reference = uncertainty.detach().double().requires_grad_()
    (exact,) = torch.autograd.grad(R.uncertainty_weighted_ce(features.double() @ reference, y), reference)
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(grad.double(), exact, rtol=tolerance, atol=tolerance)


def test_double_backward_works_on_the_reference():
    # mode="loss" only: in mode="grad" the weight is detached, so the gradient is not the derivative of any function
    # of the logits and a finite-difference check of its derivative does not apply
    x = torch.randn(6, 5, dtype=torch.float64, requires_grad=True)
    y = _targets(6, 5, "cpu")
    for uncertainty in ("brier", "focal", "none"):
        torch.autograd.gradgradcheck(lambda z: R.uncertainty_weighted_ce(z, y, uncertainty=uncertainty, mode="loss"),
                                     (x,))


# ------------------------------------------------------------------------------------------------ gamma as a tensor
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_per_sample_gamma_gets_the_reference_gradient(backend_or_reference, reduction):
    name, device = backend_or_reference
    n, c = 7, 6
    z = torch.randn(n, c, device=device) * 3
    z[3] = torch.tensor([200.0, 0, 0, 0, 0, 0])  # a saturated row: p_y = 1, the limit of the gradient is 0
    y = _targets(n, c, device)
    y[3] = 0
    gamma = (torch.rand(n, device=device) * 3).requires_grad_()
    grad_out = torch.rand(n, device=device) + 0.5 if reduction == "none" else torch.tensor(0.7, device=device)
    kw = dict(uncertainty="focal", mode="loss", reduction=reduction)
    x = z.clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(x, y, gamma=gamma, backend=name, **kw)
    d_logits, d_gamma = torch.autograd.grad(loss, (x, gamma), grad_out)
    x64, g64 = z.double().requires_grad_(), gamma.detach().double().requires_grad_()
    exact = torch.autograd.grad(R.uncertainty_weighted_ce(x64, y, gamma=g64, **kw), (x64, g64), grad_out.double())
    assert torch.isfinite(d_gamma).all() and d_gamma[3] == 0 and d_gamma[0] == 0  # saturated and ignored rows
    # float32 results against float64: a few ulps of float32 on the row's O(1) terms (u, CE, log(1 - p_y))
    torch.testing.assert_close(d_gamma.double(), exact[1], rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(d_logits.double(), exact[0], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("scale", [10.0, 100.0])
def test_per_sample_gamma_gradient_at_large_logits(backend, scale):
    """The fused backends' dL/dγ_i = u_i CE_i log(1 - p_y) to a few ulps of the row's own terms at logits of scale
    10 and 100, rows right and wrong: taken from z_y - logsumexp(z) it carried an ulp of the logits (1e-6 absolute at
    100: all of a confident row's digits), and log(1 - p_y) as log Σ_{k≠y} p_k lost a small p_y. Exact values: the
    float64 reference, itself checked here against log1p(-p_y) / log Σ_{k≠y} p_k in closed form (pow's gradient in
    the exponent had recomputed log x from an x rounded to 1). The float32 reference is as precise as
    F.cross_entropy, an ulp of 1 in absolute terms, not this."""
    name, device = backend
    g = torch.Generator().manual_seed(int(scale))
    z = (scale * torch.randn(64, 50, generator=g, dtype=torch.float64)).float()
    y = torch.randint(0, 50, (64,), generator=g)
    y[:32] = z[:32].argmax(dim=1)
    gamma = (0.5 + 3 * torch.rand(64, generator=g)).to(device).requires_grad_()
    z, y = z.to(device), y.to(device)
    loss = ck.uncertainty_weighted_ce(z.clone().requires_grad_(), y, uncertainty="focal", mode="loss", gamma=gamma,
                                      reduction="sum", backend=name)
    (d_gamma,) = torch.autograd.grad(loss, gamma)
    z64 = z.double()
    log_p = z64.log_softmax(dim=1)
    log_p_y = log_p.gather(1, y[:, None])[:, 0]
    others = torch.logsumexp(log_p.scatter(1, y[:, None], -float("inf")), dim=1)
    log_one_minus = torch.where(log_p_y < -0.7, torch.log1p(-log_p_y.exp()), others)
    exact = torch.exp(gamma.detach().double() * log_one_minus) * -log_p_y * log_one_minus
    g64 = gamma.detach().double().requires_grad_()
    (reference,) = torch.autograd.grad(R.uncertainty_weighted_ce(z64, y, uncertainty="focal", mode="loss", gamma=g64,
                                                                 reduction="sum"), g64)
    torch.testing.assert_close(reference, exact, rtol=1e-12, atol=0)
    # a few float32 ulps of each row's own O(1) terms, with an absolute floor far below float32's at the largest entry
    torch.testing.assert_close(d_gamma.double(), exact, rtol=4e-6, atol=1e-12)


def test_per_sample_gamma_in_grad_mode_gets_no_gradient_as_in_the_reference(backend):
    name, device = backend
    x = torch.randn(5, 4, device=device, requires_grad=True)
    y = _targets(5, 4, device)
    for impl in (name, "reference"):
        gamma = torch.full((5,), 2.0, device=device, requires_grad=True)
        ck.uncertainty_weighted_ce(x, y, uncertainty="focal", mode="grad", gamma=gamma, backend=impl).backward()
        assert gamma.grad is None or not gamma.grad.any()


def test_gamma_learned_through_the_fused_loss_matches_the_reference():
    """A gamma-Net style loop that learns gamma from the training loss itself (first order) gets the same gradient
    for its parameters on every backend."""
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 1)
    feats, logits, y = torch.randn(16, 8), torch.randn(16, 10), torch.randint(0, 10, (16,))
    grads = {}
    for backend, device in [("reference", "cpu")] + FUSED_BACKENDS:
        if device != "cpu":
            continue
        net.zero_grad()
        gamma = torch.nn.functional.softplus(net(feats)).squeeze(1)
        ck.uncertainty_weighted_ce(logits, y, uncertainty="focal", mode="loss", gamma=gamma, backend=backend).backward()
        grads[backend] = net.weight.grad.clone()
    for backend, grad in grads.items():
        torch.testing.assert_close(grad, grads["reference"], rtol=1e-4, atol=1e-7, msg=backend)


# ------------------------------------------------------------------------------------------------- retained graphs
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_retained_graph_returns_a_fresh_gradient(backend, reduction):
    """autograd.grad(retain_graph=True), the result edited in place, then a second grad: the second is unaffected."""
    name, device = backend
    x = torch.randn(6, 9, device=device, requires_grad=True)
    y = _targets(6, 9, device)
    loss = ck.uncertainty_weighted_ce(x, y, backend=name, reduction=reduction)
    grad_out = torch.ones_like(loss)
    (first,) = torch.autograd.grad(loss, x, grad_out, retain_graph=True)
    expected = first.clone()
    first.mul_(10)
    (second,) = torch.autograd.grad(loss, x, grad_out)
    torch.testing.assert_close(second, expected)


def test_backward_with_broadcast_and_unit_grad_output(backend):
    """grad_output of exactly 1 leaves the saved gradient as it is; an expanded (stride-0) per-row grad_output is
    read right; the gradient of ``.sum()`` of the rows' losses too."""
    name, device = backend
    z = torch.randn(7, 10, device=device)
    y = _targets(7, 10, device)
    focal = dict(uncertainty="focal", mode="loss", gamma=2.0)
    for reduction, grad_out, kw in (("mean", torch.tensor(1.0, device=device), focal),
                                    ("none", torch.ones(7, device=device), focal),
                                    ("none", torch.tensor(3.0, device=device).expand(7), focal),
                                    ("none", None, {})):
        x = z.clone().requires_grad_()
        loss = ck.uncertainty_weighted_ce(x, y, reduction=reduction, backend=name, **kw)
        exact_x = z.double().requires_grad_()
        exact = R.uncertainty_weighted_ce(exact_x, y, reduction=reduction, **kw)
        if grad_out is None:
            loss.sum().backward()
            exact.sum().backward()
        else:
            loss.backward(grad_out)
            exact.backward(grad_out.double())
        assert_within_largest_entry(x.grad, exact_x.grad, torch.float32, f"{reduction} gradient")


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
def test_second_backward_through_a_retained_graph_gives_the_same_gradient(backend, inplace):
    """The backward scales the saved gradient in place only when the graph is not retained; with retain_graph=True
    the buffer survives, so a second backward gives the same (right) gradient instead of a rescaled one."""
    name, device = backend
    z = torch.randn(6, 10, device=device)
    y = _targets(6, 10, device)
    leaf = z.clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(leaf * 1.0, y, backend=name, inplace=inplace)
    loss.backward(torch.tensor(2.0, device=device), retain_graph=True)
    first = leaf.grad.clone()
    exact = z.double().requires_grad_()
    R.uncertainty_weighted_ce(exact, y).backward(torch.tensor(2.0, dtype=torch.float64, device=device))
    torch.testing.assert_close(first.double(), exact.grad, rtol=1e-5, atol=1e-7)
    leaf.grad = None
    loss.backward(torch.tensor(2.0, device=device))
    torch.testing.assert_close(leaf.grad, first)


# --------------------------------------------------------------------------------------------------------- memory
_MEMORY_SCRIPT = textwrap.dedent("""
    import gc, json, sys
    import torch
    import calibkernels as ck

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    n, c = 2048, 4096
    dtype, reduction = getattr(torch, sys.argv[1]), sys.argv[2]
    z = torch.randn(n, c).to(dtype).requires_grad_()
    y = torch.randint(0, c, (n,))
    peaks = []
    for _ in range(2):
        z.grad = None
        gc.collect()
        loss = ck.uncertainty_weighted_ce(z, y, reduction=reduction, backend="cpu")
        open("/proc/self/clear_refs", "w").write("5")  # resets the peak resident size (VmHWM)
        before = status("VmRSS")
        (loss.sum() if reduction == "none" else loss).backward()
        peaks.append((status("VmHWM") - before) / (n * c * z.element_size()))
        del loss
    print(json.dumps(max(peaks)))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's /proc/self/clear_refs")
@pytest.mark.skipif(_backends.unavailable_reason("cpu", torch.device("cpu")) is not None, reason="no CPU kernel")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
@pytest.mark.parametrize("reduction", ["none", "mean"])
def test_backward_allocates_no_logits_sized_buffer(dtype, reduction):
    """The backward scales the gradient saved by the forward in place: its peak extra memory is far below one N×C
    buffer of the logits' dtype, for every reduction and dtype (measured in a child process)."""
    result = subprocess.run([sys.executable, "-c", _MEMORY_SCRIPT, dtype, reduction], capture_output=True, text=True,
                            timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert result.returncode == 0, result.stderr[-2000:]
    peak = float(result.stdout.strip().splitlines()[-1])
    assert peak < 0.25, f"backward peak {peak:.2f} x the logits' size"


# ------------------------------------------------------------------------------------------- hyper-parameter checks
def test_bad_hyper_parameters_raise(backend_or_reference, monkeypatch):
    """Bad numbers raise at the call. Bad values of a per-sample gamma or sample_weight tensor raise at the call on CPU
    tensors; on CUDA ones they are flagged on the device (no host synchronisation), so under the default (async)
    policy the error may come only at synchronize_target_checks."""
    from calibkernels import _target_checks

    monkeypatch.setattr(_target_checks, "POLICY", "async")  # whatever CALIBKERNELS_VALIDATE says
    name, device = backend_or_reference

    def call(**kwargs):
        ck.uncertainty_weighted_ce(z, y, backend=name, **kwargs)
        if device == "cuda":
            ck.synchronize_target_checks()

    z = torch.randn(4, 5, device=device)
    y = _targets(4, 5, device, ignored=0)
    for gamma in (float("inf"), float("nan"), -1.0):
        with pytest.raises(ValueError, match="gamma"):
            ck.uncertainty_weighted_ce(z, y, uncertainty="focal", gamma=gamma, backend=name)
    for bad in (float("inf"), float("nan"), -1.0):
        gamma = torch.full((4,), 2.0, device=device)
        gamma[1] = bad
        with pytest.raises(ValueError, match="per-sample gamma must be finite and >= 0"):
            call(uncertainty="focal", gamma=gamma)
        sample_weight = torch.ones(4, device=device)
        sample_weight[2] = bad
        with pytest.raises(ValueError, match="sample_weight must be finite and >= 0"):
            call(uncertainty="external", sample_weight=sample_weight)
    for norm in (float("inf"), float("nan"), 0.0):
        with pytest.raises(ValueError, match="norm"):
            ck.uncertainty_weighted_ce(z, y, uncertainty="brier", norm=norm, backend=name)


# --------------------------------------------------------------------------------- bad input, every backend alike
# The backend names a call on CPU tensors may give (Triton under the interpreter); a fused one that cannot run here
# is skipped ("auto" always runs: the reference where nothing else can).
BACKENDS = [
    pytest.param(name, id=name, marks=pytest.mark.skipif(
        name not in ("reference", "auto") and _backends.unavailable_reason(name, torch.device("cpu")) is not None,
        reason=f"the {name!r} backend cannot run CPU tensors in this install"))
    for name in ("reference", "cpu", "triton", "auto")
]


def _call(logits=None, target=None, **kwargs):
    """``(logits, target, kwargs)`` of a call on a 4 x 5 batch, with ``logits`` / ``target`` replaced where given
    (each a function of the batch's logits and target)."""
    def arguments(z, y):
        return (z if logits is None else logits(z, y)), (y if target is None else target(z, y)), kwargs
    return arguments


# (arguments, exception, message): each bad input and what the reference raises for it
BAD_CALLS = [
    pytest.param(_call(target=lambda z, y: y.float()), TypeError, "shape of class indices", id="target-float"),
    pytest.param(_call(target=lambda z, y: y.bool()), TypeError, "integer class indices", id="target-bool"),
    pytest.param(_call(target=lambda z, y: y.to(torch.complex64)), TypeError, "integer class indices",
                 id="target-complex"),
    pytest.param(_call(target=lambda z, y: y.tolist()), TypeError, "target must be a torch.Tensor", id="target-list"),
    pytest.param(_call(target=lambda z, y: y[:3]), ValueError, r"target shape \(3,\) does not match",
                 id="target-short"),
    pytest.param(_call(target=lambda z, y: y[:, None]), ValueError, r"target shape \(4, 1\) does not match",
                 id="target-2d"),
    pytest.param(_call(target=lambda z, y: torch.full_like(y, 7)), ValueError, "target value 7 is out of range",
                 id="target-out-of-range"),
    pytest.param(_call(target=lambda z, y: torch.softmax(torch.randn(4, 6), 1)), ValueError,
                 "must have the logits' shape", id="dense-target-wide"),
    pytest.param(_call(logits=lambda z, y: z[0], target=lambda z, y: y[0]), ValueError, "at least 2 dimensions",
                 id="logits-1d"),
    pytest.param(_call(logits=lambda z, y: z.view(2, 2, 5)), ValueError, r"target shape \(4,\) does not match",
                 id="logits-3d"),
    pytest.param(_call(logits=lambda z, y: z > 0), TypeError, "logits must be a floating-point", id="logits-bool"),
    pytest.param(_call(logits=lambda z, y: z.long()), TypeError, "logits must be a floating-point", id="logits-int"),
    pytest.param(_call(logits=lambda z, y: z.to(torch.complex64)), TypeError, "logits must be a floating-point",
                 id="logits-complex"),
    pytest.param(_call(logits=lambda z, y: z.tolist()), TypeError, "logits must be a torch.Tensor", id="logits-list"),
    pytest.param(_call(uncertainty="brier2"), ValueError, "unknown uncertainty", id="uncertainty"),
    pytest.param(_call(mode="gra"), ValueError, "unknown mode", id="mode"),
    pytest.param(_call(reduction="avg"), ValueError, "unknown reduction", id="reduction"),
    pytest.param(_call(gamma=-1.0), ValueError, "gamma must be finite and >= 0", id="gamma-negative"),
    pytest.param(_call(gamma="4"), TypeError, "gamma must be a number", id="gamma-str"),
    pytest.param(_call(uncertainty="brier", gamma=torch.ones(4)), ValueError, "only supported with uncertainty='focal'",
                 id="gamma-tensor-brier"),
    pytest.param(_call(uncertainty="focal", gamma=torch.ones(3, requires_grad=True)), ValueError,
                 r"per-sample gamma shape \(3,\)", id="gamma-tensor-short"),
    pytest.param(_call(norm=0.0), ValueError, "norm", id="norm-zero"),
    pytest.param(_call(norm=-2.0), ValueError, "norm", id="norm-negative"),
    pytest.param(_call(gamma=10**400), ValueError, "gamma must be finite", id="gamma-past-float"),
    pytest.param(_call(uncertainty="brier", norm=10**400), ValueError, "norm", id="norm-past-float"),
    pytest.param(_call(label_smoothing=1.5), ValueError, r"label_smoothing must be in \[0, 1\]", id="smoothing-high"),
    pytest.param(_call(label_smoothing=-0.1), ValueError, r"label_smoothing must be in \[0, 1\]", id="smoothing-low"),
    pytest.param(_call(label_smoothing="0.1"), TypeError, "label_smoothing must be a number", id="smoothing-str"),
    pytest.param(_call(mix_target=torch.zeros(4, dtype=torch.long), mix_lambda=1.5), ValueError,
                 r"mix_lambda must be in \[0, 1\]", id="lambda-high"),
    pytest.param(_call(mix_target=torch.zeros(4, dtype=torch.long), mix_lambda=-0.5), ValueError,
                 r"mix_lambda must be in \[0, 1\]", id="lambda-low"),
    pytest.param(_call(mix_target=torch.zeros(4, dtype=torch.long)), ValueError, "go together",
                 id="mix-target-alone"),
    pytest.param(_call(mix_lambda=0.3), ValueError, "go together", id="lambda-alone"),
    pytest.param(_call(mix_target=torch.zeros(3, dtype=torch.long), mix_lambda=0.3), ValueError,
                 r"mix_target shape \(3,\)", id="mix-target-short"),
    pytest.param(_call(mix_target=torch.zeros(4), mix_lambda=0.3), TypeError,
                 "mix_target must hold integer class indices", id="mix-target-float"),
    pytest.param(_call(ignore_index=1.0), TypeError, "ignore_index must be an int", id="ignore-index-float"),
    pytest.param(_call(ignore_index=True), TypeError, "ignore_index must be an int", id="ignore-index-bool"),
    pytest.param(_call(uncertainty="external", sample_weight=torch.ones(3)), ValueError,
                 r"sample_weight shape \(3,\) does not match", id="sample-weight-short"),
    pytest.param(_call(uncertainty="external"), ValueError, "needs a sample_weight", id="sample-weight-missing"),
    pytest.param(_call(sample_weight=torch.ones(4)), ValueError, "only used with uncertainty='external'",
                 id="sample-weight-unused"),
    pytest.param(_call(inplace="yes"), TypeError, "inplace must be a bool", id="inplace-str"),
    pytest.param(_call(weight="focal"), TypeError, "the uncertainty weight is now uncertainty='focal'",
                 id="weight-str"),
    pytest.param(_call(weight=torch.ones(4)), ValueError, r"weight \(the per-class weights\) must have shape \(5,\)",
                 id="weight-tensor-length"),
]

# A call that a named fused backend refuses however good its inputs (NotImplementedError: no gradient for a per-sample
# gamma with soft targets there); "auto" runs it on the reference
_REFUSED = dict(uncertainty="focal", mode="loss", label_smoothing=0.1)


def _refused_gamma():
    return torch.full((4,), 2.0, requires_grad=True)


def _batch():
    y = torch.randint(0, 5, (4,))
    y[0] = -100
    return torch.randn(4, 5), y


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("arguments,error,message", BAD_CALLS)
def test_a_bad_input_raises_the_references_error_on_every_backend(backend_name, arguments, error, message):
    logits, target, kwargs = arguments(*_batch())
    with pytest.raises(error, match=message):
        ck.uncertainty_weighted_ce(logits, target, backend=backend_name, **kwargs)


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("arguments,error,message", BAD_CALLS)
def test_a_bad_input_raises_its_own_error_before_a_backend_refuses_the_call(backend_name, arguments, error, message,
                                                                           monkeypatch):
    """The inputs are checked before the backend's refusal is raised: a bad input in a call that a named fused
    backend cannot run raises what the reference raises, not NotImplementedError."""
    monkeypatch.setattr(_backends, "_warned_soft_targets", False)  # "auto" may say it runs the reference
    logits, target, kwargs = arguments(*_batch())
    kwargs = {**_REFUSED, "gamma": _refused_gamma(), **kwargs}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        with pytest.raises(error, match=message):
            ck.uncertainty_weighted_ce(logits, target, backend=backend_name, **kwargs)


@pytest.mark.parametrize("arguments,error,message", BAD_CALLS)
def test_a_bad_input_raises_its_own_error_before_a_backend_that_cannot_run_on_its_device(arguments, error, message):
    """The "cuda" backend never runs CPU tensors (RuntimeError for good inputs): a bad input raises what the reference
    raises."""
    logits, target, kwargs = arguments(*_batch())
    with pytest.raises(error, match=message):
        ck.uncertainty_weighted_ce(logits, target, backend="cuda", **kwargs)


def _vocab_parallel(z, y, **kwargs):
    return ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, **kwargs)


def _fused_linear(z, y, **kwargs):
    return ck.fused_linear_uncertainty_weighted_ce(z, torch.eye(5), y, **kwargs)


def _fused_linear_module(z, y, **kwargs):
    return ck.losses.FusedLinearUncertaintyWeightedCE(**kwargs)(z, torch.eye(5), y)


def _module(z, y, **kwargs):
    return ck.losses.UncertaintyWeightedCE(**kwargs)(z, y)


@pytest.mark.parametrize("loss", [
    pytest.param(R.uncertainty_weighted_ce, id="reference"), pytest.param(_fused_linear, id="fused-linear"),
    pytest.param(_vocab_parallel, id="vocab-parallel"),
    pytest.param(_module, id="module"),
    pytest.param(_fused_linear_module, id="fused-linear-module"),
])
def test_weight_is_the_per_class_weight_keyword_not_the_uncertainty_weight(loss):
    """``weight`` is ``F.cross_entropy``'s per-class ``(C,)`` tensor: a string (the uncertainty weight under its
    former keyword) raises ``TypeError`` naming ``uncertainty=``, before anything else runs (the vocab-parallel loss:
    before it needs a process group). Every entry point computes class weights (the vocab-parallel loss's ranks:
    tests/test_distributed.py)."""
    z, y = _batch()
    with pytest.raises(TypeError, match=r"per-class weight tensor; the uncertainty weight is now uncertainty='brier'"):
        loss(z, y, weight="brier")
    class_weight = torch.rand(5) + 0.5
    if loss is _vocab_parallel:
        if not torch.distributed.is_initialized():  # taken: the call goes on to need its process group
            with pytest.raises(RuntimeError, match="process group"):
                loss(z, y, weight=class_weight)
    else:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "auto" says once that the reference runs them
            torch.testing.assert_close(loss(z, y, weight=class_weight),
                                       R.uncertainty_weighted_ce(z, y, weight=class_weight))
    if loss is _vocab_parallel:
        return
    torch.testing.assert_close(loss(z, y, weight=None, uncertainty="focal", mode="loss", gamma=2.0),
                               R.uncertainty_weighted_ce(z, y, uncertainty="focal", mode="loss", gamma=2.0))


@pytest.mark.parametrize("backend_name", BACKENDS)
def test_a_good_call_a_backend_cannot_run_is_still_refused(backend_name, monkeypatch):
    monkeypatch.setattr(_backends, "_warned_soft_targets", False)
    z, y = _batch()
    if backend_name in ("reference", "auto"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # "auto" says once that it runs the reference
            loss = ck.uncertainty_weighted_ce(z, y, gamma=_refused_gamma(), backend=backend_name, **_REFUSED)
        torch.testing.assert_close(loss, R.uncertainty_weighted_ce(z, y, gamma=_refused_gamma(), **_REFUSED))
    else:
        with pytest.raises(NotImplementedError, match="per-sample gamma"):
            ck.uncertainty_weighted_ce(z, y, gamma=_refused_gamma(), backend=backend_name, **_REFUSED)
    with pytest.raises(RuntimeError, match="not available for cpu tensors"):
        ck.uncertainty_weighted_ce(z, y, backend="cuda")


# ------------------------------------------------------------------------------------- ignore_index outside int64
_OUTSIDE_INT64 = [2**63, -(2**63) - 1, 2**64]
_INT64_RANGE_MESSAGE = r"ignore_index must be in the int64 range \[-9223372036854775808, 9223372036854775807\]"


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("ignore_index", _OUTSIDE_INT64)
def test_an_ignore_index_outside_int64_raises_one_value_error_on_every_path(backend_name, ignore_index):
    """The fast eager call, the general path (soft targets, a mix, a per-sample gamma, sample weights, a dense
    target), in place, the modules at construction: the same ValueError (the compiled op had raised OverflowError,
    a Triton kernel had taken 2**63 as a uint64 and the reference had run)."""
    z, y = _batch()
    mix = y.flip(0)
    dense = torch.softmax(torch.randn(4, 5), dim=1)
    calls = [
        dict(),
        dict(uncertainty="focal", mode="loss", reduction="none"),
        dict(label_smoothing=0.1),
        dict(mix_target=mix, mix_lambda=0.3),
        dict(mix_target=mix, mix_lambda=torch.full((4,), 0.3)),
        dict(mix_target=mix, mix_lambda=1.0),
        dict(uncertainty="focal", gamma=torch.full((4,), 2.0)),
        dict(uncertainty="external", sample_weight=torch.ones(4)),
    ]
    for kwargs in calls:
        with pytest.raises(ValueError, match=_INT64_RANGE_MESSAGE):
            ck.uncertainty_weighted_ce(z, y, ignore_index=ignore_index, backend=backend_name, **kwargs)
    with pytest.raises(ValueError, match=_INT64_RANGE_MESSAGE):
        ck.uncertainty_weighted_ce(z, dense, ignore_index=ignore_index, backend=backend_name)
    with pytest.raises(ValueError, match=_INT64_RANGE_MESSAGE):
        ck.bsce_gra_loss(z, y, ignore_index=ignore_index, backend=backend_name)
    leaf = z.clone().requires_grad_()
    logits = leaf * 1.0
    before = logits.detach().clone()
    with pytest.raises(ValueError, match=_INT64_RANGE_MESSAGE):
        ck.uncertainty_weighted_ce(logits, y, ignore_index=ignore_index, backend=backend_name, inplace=True)
    assert torch.equal(logits.detach(), before), "a refused in-place call must leave the logits untouched"
    for make in (lambda: ck.losses.UncertaintyWeightedCE(ignore_index=ignore_index, backend=backend_name),
                 lambda: ck.losses.build("focal_loss", ignore_index=ignore_index, backend=backend_name),
                 lambda: ck.losses.SoftTargetUncertaintyWeightedCE(ignore_index=ignore_index, backend=backend_name)):
        with pytest.raises(ValueError, match=_INT64_RANGE_MESSAGE):
            make()


@pytest.mark.parametrize("ignore_index", _OUTSIDE_INT64)
def test_every_loss_and_metric_refuses_an_ignore_index_outside_int64(ignore_index):
    """Every registry loss at construction, the reference losses and every metric at their call: the same
    ValueError (sece and dece had not checked ignore_index at all)."""
    z, y = _batch()
    y[0] = 1
    for name in ck.losses.names():
        with pytest.raises(ValueError, match=_INT64_RANGE_MESSAGE):
            ck.losses.build(name, ignore_index=ignore_index)
    metrics = ck.metrics
    calls = [
        lambda: R.uncertainty_weighted_ce(z, y, ignore_index=ignore_index),
        lambda: R.brier_loss(z, y, ignore_index=ignore_index),
        lambda: R.mmce_loss(z, y, ignore_index=ignore_index),
        lambda: metrics.ece(z, y, ignore_index=ignore_index),
        lambda: metrics.nll(z, y, ignore_index=ignore_index),
        lambda: metrics.sece(z, y, ignore_index=ignore_index),
        lambda: metrics.dece(z, y, ignore_index=ignore_index),
        lambda: metrics.smooth_ece(z, y, ignore_index=ignore_index),
        lambda: metrics.debiased_ece(z, y, ignore_index=ignore_index),
        lambda: metrics.calibration_metrics(z, y, ignore_index=ignore_index),
        lambda: metrics.bootstrap(metrics.ece, z, y, n_resamples=4, ignore_index=ignore_index),
        lambda: metrics.CalibrationMeter(ignore_index=ignore_index).update(z, y),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=_INT64_RANGE_MESSAGE):
            call()


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("ignore_index", [2**63 - 1, -(2**63)])
def test_an_ignore_index_at_the_int64_bounds_ignores_its_rows(backend_name, ignore_index):
    """The ends of the int64 range are an ignore_index like any other, with and without soft targets."""
    z, y = _batch()
    y[0], y[1] = 2, ignore_index
    for kwargs in (dict(), dict(uncertainty="focal", mode="loss", reduction="none"), dict(label_smoothing=0.1)):
        loss = ck.uncertainty_weighted_ce(z, y, ignore_index=ignore_index, backend=backend_name, **kwargs)
        expected = R.uncertainty_weighted_ce(z.double(), y, ignore_index=ignore_index, **kwargs)
        torch.testing.assert_close(loss.double(), expected, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------------------------------------------- limits
@pytest.mark.parametrize("uncertainty,norm", [("focal", 2.0), ("flsd", 2.0), ("dual_focal", 2.0), ("brier", 2.0),
                                         ("brier", 0.5)])
def test_saturated_rows_with_gamma_below_one_have_the_limit_gradient(backend, uncertainty, norm):
    """mode="loss", p_y = 1 exactly: CE du/dz is 0 · inf for gamma < 1 (or gamma < q); the gradient is its limit, 0
    on that row, on every backend as on the reference."""
    name, device = backend
    z = torch.tensor([[200.0, 0.0, 0.0], [0.5, 0.1, -0.3], [0.0, 90.0, -90.0]], device=device)
    y = torch.tensor([0, 1, 1], device=device)
    for gamma in (0.3, 0.5, 1.0, 1.5):
        kw = dict(uncertainty=uncertainty, mode="loss", gamma=gamma, norm=norm, reduction="sum")
        x = z.clone().requires_grad_()
        ck.uncertainty_weighted_ce(x, y, backend=name, **kw).backward()
        x64 = z.double().requires_grad_()
        R.uncertainty_weighted_ce(x64, y, **kw).backward()
        assert torch.isfinite(x.grad).all(), (gamma, x.grad)
        torch.testing.assert_close(x.grad.double(), x64.grad, rtol=1e-4, atol=1e-6)


def test_a_per_sample_gamma_that_requires_grad_runs_soft_targets_in_grad_mode(backend):
    """In "grad" mode the weight is detached, so a per-sample gamma gets no gradient and the fused backends run soft
    targets with it (only "loss" mode, which differentiates the weight, needs the reference's gamma gradient): the
    loss and logits' gradient as the reference's, and no gradient for gamma, as in the reference."""
    name, device = backend
    torch.manual_seed(0)
    z = torch.randn(6, 7, device=device)
    y = torch.randint(0, 7, (6,), device=device)
    results = []
    for impl in ("reference", name):
        x = z.clone().requires_grad_()
        gamma = torch.linspace(0.5, 3.0, 6, device=device).requires_grad_()
        loss = ck.uncertainty_weighted_ce(x, y, uncertainty="focal", mode="grad", gamma=gamma, label_smoothing=0.1,
                                          backend=impl)
        loss.backward()
        assert gamma.grad is None
        results.append((loss.detach(), x.grad))
    torch.testing.assert_close(results[1][0], results[0][0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(results[1][1], results[0][1], rtol=1e-5, atol=1e-6)
