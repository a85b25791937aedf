"""Faults of the fused loss: every error the extension raises reaches Python as an exception (checked in a child
process, so that a crash fails the test instead of the test run), and rows past 2^31 logits elements are indexed
correctly on a GPU. Written against conftest.py's ``backend`` fixture (every fused backend this install runs, with its
device); the large-tensor test needs a GPU."""

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import calibkernels as ck
from calibkernels import reference as R

# Each case calls the loss with one bad input and prints the exception's type and first line. On a GPU the target
# checks are synchronous here (CALIBKERNELS_VALIDATE=sync), so the error comes from the call that made it.
_CHILD = textwrap.dedent("""
    import json, sys, torch
    import calibkernels as ck
    backend, device = sys.argv[1], sys.argv[2]
    z = torch.randn(4, 5, device=device)
    y = torch.tensor([0, 1, 2, 3], device=device)
    dense = torch.softmax(torch.randn(4, 5, device=device), 1)
    bad_dense = dense.clone()
    bad_dense[2, 1] = -0.5
    op = torch.ops.calibkernels.uncertainty_weighted_ce
    cases = {
        "target of the wrong length (the op's own check)":
            lambda: op(z, y[:3], None, None, 4, 1, 4.0, 2.0, -100, 1, True, None),
        "out-of-range target": lambda: ck.uncertainty_weighted_ce(z, torch.tensor([0, 7, 1, 2], device=device),
                                                                  backend=backend),
        "out-of-range mix_target": lambda: ck.uncertainty_weighted_ce(
            z, y, mix_target=torch.tensor([0, 1, 9, 2], device=device), mix_lambda=0.5, backend=backend),
        "mix_lambda outside [0, 1]": lambda: ck.uncertainty_weighted_ce(
            z, y, mix_target=y.flip(0), mix_lambda=torch.full((4,), 1.5, device=device), backend=backend),
        "dense target with a negative entry": lambda: ck.uncertainty_weighted_ce(z, bad_dense, backend=backend),
        "dual focal with a soft target": lambda: ck.uncertainty_weighted_ce(
            z, y, uncertainty="dual_focal", label_smoothing=0.1, backend=backend),
    }
    if backend == "triton":
        del cases["target of the wrong length (the op's own check)"]  # the compiled op's check, not Triton's
    out = {}
    for name, call in cases.items():
        try:
            loss = call()
            ck.synchronize_target_checks()
            out[name] = "raised nothing: " + repr(loss)
        except Exception as exc:
            out[name] = type(exc).__name__ + ": " + str(exc).splitlines()[0]
    print(json.dumps(out))
""")


def test_every_error_reaches_python_as_an_exception(backend):
    """An error from the op's C++ checks, the kernels' target checks (on a GPU: the device flag, read synchronously
    here) or the Python checks is an exception in the caller, with its message, and the process survives (an
    extension built against another torch than the one it runs with can die with SIGSEGV there instead)."""
    name, device = backend
    env = dict(os.environ, CALIBKERNELS_VALIDATE="sync", TORCH_SHOW_CPP_STACKTRACES="0")
    result = subprocess.run([sys.executable, "-X", "faulthandler", "-c", _CHILD, name, device],
                            capture_output=True, text=True, env=env, timeout=600)
    assert result.returncode == 0, f"the child process died ({result.returncode}): {result.stderr[-3000:]}"
    outcome = json.loads(result.stdout.strip().splitlines()[-1])
    expected = {
        "target of the wrong length (the op's own check)": ("RuntimeError", "ValueError"),
        "out-of-range target": ("ValueError",),
        "out-of-range mix_target": ("ValueError",),
        "mix_lambda outside [0, 1]": ("ValueError",),
        "dense target with a negative entry": ("ValueError",),
        "dual focal with a soft target": ("ValueError",),
    }
    for name, text in outcome.items():
        assert text.split(":")[0] in expected[name], (name, text)
    assert "out of range" in outcome["out-of-range target"] and "7" in outcome["out-of-range target"]
    assert "mix_target value 9" in outcome["out-of-range mix_target"]
    assert "finite and >= 0" in outcome["dense target with a negative entry"]


def test_rows_past_2_to_31_logits_elements_on_the_gpu(backend):
    """65537 × 32769 bf16 logits (2^31 + 98305 elements): the rows whose offsets pass 2^31 get their own loss and
    gradient, as the reference computes them on those rows alone."""
    if backend.device != "cuda":
        pytest.skip("needs a GPU with about 20 GB free")
    name = backend.name
    n, c = 65537, 32769
    assert n * c > 2**31
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(n, c, device="cuda", dtype=torch.bfloat16, generator=g).mul_(3)
    target = torch.randint(0, c, (n,), device="cuda", generator=g)
    rows = torch.tensor([0, 1, (2**31) // c - 1, (2**31) // c, (2**31) // c + 1, n - 2, n - 1], device="cuda")
    for uncertainty in ("none", "brier"):
        x = logits.detach().requires_grad_()
        loss = ck.uncertainty_weighted_ce(x, target, uncertainty=uncertainty, reduction="none", backend=name)
        loss.sum().backward()
        z_rows = logits[rows].float().requires_grad_()
        expected = R.uncertainty_weighted_ce(z_rows, target[rows], uncertainty=uncertainty, reduction="none")
        expected.sum().backward()
        torch.testing.assert_close(loss[rows].float(), expected, rtol=2e-2, atol=2e-2)
        torch.testing.assert_close(x.grad[rows].float(), z_rows.grad, rtol=2e-2, atol=2e-3)
        assert torch.isfinite(loss).all()
        del x, loss
        torch.cuda.empty_cache()
