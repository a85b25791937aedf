"""FLSD-53's band rule and the "which γ did it pick" probe, shared by the FLSD test files (the reference's, and the CPU,
CUDA and Triton backends').

The rule every implementation follows (``calibkernels.reference._flsd_gamma``, ``csrc/uncertainty_weights.h``,
constants in ``calibkernels._kernel_codes``): the band value ``p_band`` (``p_y``, or ``<t, p>`` for soft targets) is
rounded to
float32 and compared with the float32 thresholds, ``γ_i = 5 if p_band < 0.2f, 3 if p_band < 0.5f, else γ`` (the loss's
argument). 0.2f is 0.20000000298..., so a band value of 0.19999999f (float32 ``exp(-logf(5))``) is in the low band.

Everything here runs on the CPU in float64 (the rule's result included), whatever device its tensor arguments are on.
"""

import numpy as np
import torch

from calibkernels import _kernel_codes as K

# The thresholds as float32 numbers (0.2f = 0.20000000298..., 0.5f).
LOW_THRESHOLD_F32 = np.float32(K.FLSD_LOW_THRESHOLD)
MID_THRESHOLD_F32 = np.float32(K.FLSD_MID_THRESHOLD)


def band_choices(gamma):
    """The three γ_i, lowest band first: ``(5, 3, gamma)``; ``gamma`` (the top band's) should differ from 5 and 3."""
    return (K.FLSD_LOW_GAMMA, K.FLSD_MID_GAMMA, gamma)


def flsd_gammas(p_band, gamma):
    """γ_i of band values ``p_band`` (a tensor on any device, a list or a number): their float32 rounding against the
    float32 thresholds. Returns a float64 CPU tensor of ``p_band``'s shape."""
    p = torch.as_tensor(p_band).float().cpu()
    low = torch.tensor(LOW_THRESHOLD_F32, dtype=torch.float32)
    mid = torch.tensor(MID_THRESHOLD_F32, dtype=torch.float32)
    low_gamma, mid_gamma, high_gamma = band_choices(gamma)
    high = torch.full(p.shape, float(high_gamma), dtype=torch.float64)
    return torch.where(p < low, low_gamma, torch.where(p < mid, mid_gamma, high))


def flsd_gamma(p_band, gamma):
    """:func:`flsd_gammas` of one band value (a Python or numpy number), as a Python float."""
    return flsd_gammas(p_band, gamma).item()


def loss_candidates(uncertainty, z, t, gammas, norm=2.0):
    """Each row's loss for each γ of ``gammas``, ``(len(gammas), N)`` float64 on the CPU, from the logits' exact values
    ``z (N, C)`` and the target distribution ``t (N, C)`` (one-hot rows for class targets), with CE = -<t, log p>:

    ``flsd``        ``(Σ_k t_k (1 - p_k))^γ · CE``, i.e. ``(1 - <t, p>)^γ · CE``
    ``brier_flsd``  ``‖p - t‖_q^γ · CE = (Σ_k |p_k - t_k|^q)^(γ/q) · CE``, q = ``norm``
    """
    log_p = torch.log_softmax(z.double().cpu(), dim=1)
    p = log_p.exp()
    t = t.double().cpu()
    cross_entropy = -torch.where(t > 0, t * log_p, 0.0).sum(dim=1)
    if uncertainty == "flsd":
        base = (t * (1 - p)).sum(dim=1)
        return torch.stack([base.pow(g) * cross_entropy for g in gammas])
    if uncertainty == "brier_flsd":
        brier_s = (p - t).abs().pow(norm).sum(dim=1)
        return torch.stack([brier_s.pow(g / norm) * cross_entropy for g in gammas])
    raise ValueError(f"no FLSD band in weight {uncertainty!r}")


def pick_gamma(got, candidates, gammas, *, rtol=1e-5, atol=0.0, what=""):
    """Which γ of ``gammas`` explains each entry of ``got (N,)`` (any device): the nearest row of ``candidates
    (len(gammas), N)`` (float64, CPU), the candidates differing by far more than rounding. With ``rtol`` (not None),
    every value must also be close (``torch.isclose(rtol, atol)``) to the candidate it picked."""
    got = got.double().cpu()
    picked = (candidates - got).abs().argmin(dim=0)
    if rtol is not None:
        close = torch.isclose(candidates.gather(0, picked[None])[0], got, rtol=rtol, atol=atol)
        assert close.all(), f"{what}: {got} is none of the {len(gammas)} FLSD values {candidates} (γ {gammas})"
    return [gammas[i] for i in picked.tolist()]


def gamma_picked(loss, z, t, uncertainty, gammas, *, norm=2.0, rtol=1e-5, atol=0.0):
    """Which γ of ``gammas`` a backend's per-row ``loss`` (reduction ``"none"``, any device) of ``weight`` (``"flsd"``
    or ``"brier_flsd"``) used on each row: :func:`pick_gamma` over :func:`loss_candidates`."""
    return pick_gamma(loss, loss_candidates(uncertainty, z, t, gammas, norm), gammas, rtol=rtol, atol=atol,
                      what=uncertainty)
