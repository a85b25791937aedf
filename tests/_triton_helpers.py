"""Shared helpers of the Triton backend's test files (test_uncertainty_weighted_ce_triton*.py): the devices it runs
on, the weights' γ, its inputs and the op's arguments, a run through the shared autograd, the float64 reference's
loss and gradient and the tolerance of a comparison.
"""

import pytest
import torch

from calibkernels import _autograd, _backends
from calibkernels import _validation as V
from calibkernels import reference as R

from _tolerance import assert_within_largest_entry as _close  # noqa: F401  (the Triton files' name for it)


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
