"""The per-row maths of the loss family that the production Python paths share: the fused backends' autograd
(:mod:`calibkernels._autograd`), the fused linear loss, the vocabulary-parallel loss and the losses of
:mod:`calibkernels.more_losses` (formulas: docs/losses.md).

:mod:`calibkernels.reference` writes its own forms of these, so that it stays an oracle independent of the code it
checks; both follow the same numerical rules (FLSD's float32 band, powers taken from their logarithm, ``1 - p_y``
without cancellation).
"""

from __future__ import annotations

import math

import torch

from ._kernel_codes import FLSD_LOW_GAMMA, FLSD_LOW_THRESHOLD, FLSD_MID_GAMMA, FLSD_MID_THRESHOLD, REDUCTION_CODES

__all__ = ["FLSD_LOW_THRESHOLD_F32", "FLSD_MID_THRESHOLD_F32", "compute_dtype", "flsd_band", "flsd_gamma",
           "gamma_gradient_factor", "masked_rows", "power_of_log", "reduce_rows", "row_log_terms", "soft_capped"]

# FLSD-53's thresholds (calibkernels._kernel_codes) as float32 numbers, 0.2f = 0.20000000298... and 0.5f, which the
# band's
# float32 p_y is compared with.
FLSD_LOW_THRESHOLD_F32 = float(torch.tensor(FLSD_LOW_THRESHOLD, dtype=torch.float32))
FLSD_MID_THRESHOLD_F32 = float(torch.tensor(FLSD_MID_THRESHOLD, dtype=torch.float32))


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype rows are computed in: float64 for float64 logits, float32 otherwise."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def masked_rows(logits2d, target1d, ignore_index):
    """``(valid (N,), z (N, C) in the compute dtype with ignored rows zeroed, target with ignored rows set to 0)``.

    Zeroing ignored rows keeps their (discarded) loss finite, so no NaN can leak into the gradient through
    ``torch.where``'s backward.
    """
    valid = target1d != ignore_index
    z = logits2d.to(compute_dtype(logits2d.dtype))
    z = torch.where(valid[:, None], z, torch.zeros((), dtype=z.dtype, device=z.device))
    safe_target = torch.where(valid, target1d, torch.zeros_like(target1d))
    return valid, z, safe_target


def soft_capped(z: torch.Tensor, softcap: float | None) -> torch.Tensor:
    """Gemma-2's logit soft-capping ``c · tanh(z / c)`` in the compute dtype (float32 for 16-bit logits), detached;
    ``z`` itself without a cap (``softcap=None``)."""
    if softcap is None:
        return z
    return softcap * torch.tanh(z.detach().to(compute_dtype(z.dtype)) / softcap)


def reduce_rows(per_row, valid, reduction: str, batch_shape, out_dtype):
    """Per-row losses reduced as ``reduction`` says, ignored rows (``~valid``) counting 0: ``"none"`` reshaped to
    ``batch_shape``, ``"sum"``, or ``"mean"`` over the valid rows (0, not NaN, when none is); in ``out_dtype``."""
    per_row = torch.where(valid, per_row, torch.zeros((), dtype=per_row.dtype, device=per_row.device))
    if reduction == "none":
        return per_row.reshape(batch_shape).to(out_dtype)
    total = per_row.sum()
    if reduction == "sum":
        return total.to(out_dtype)
    return (total / valid.sum().clamp_min(1)).to(out_dtype)


def flsd_band(p_band, gamma, dtype):
    """FLSD-53's ``γ_i (N,)`` in ``dtype`` from a float32 band value ``p_band (N,)`` (``p_y``, or ``<t, p>`` for soft
    targets): 5 below 0.2f, 3 below 0.5f, ``gamma`` above, the float32 thresholds every implementation compares with
    (docs/losses.md, "flsd")."""
    high = torch.full(p_band.shape, float(gamma), dtype=dtype, device=p_band.device)
    mid = torch.full_like(high, FLSD_MID_GAMMA)
    low = torch.full_like(high, FLSD_LOW_GAMMA)
    return torch.where(p_band < FLSD_LOW_THRESHOLD_F32, low, torch.where(p_band < FLSD_MID_THRESHOLD_F32, mid, high))


def flsd_gamma(z, target, gamma):
    """FLSD-53's ``γ_i (N,)`` for logits ``z (N, C)`` in the compute dtype and in-range targets (never
    differentiated): :func:`flsd_band` of ``p_band = float32(exp(z_y - logsumexp(z)))``, both taken in the compute
    dtype, as the kernels take them."""
    z = z.detach()
    p_band = torch.exp(z.gather(1, target[:, None]).squeeze(1) - torch.logsumexp(z, dim=1)).float()
    return flsd_band(p_band, gamma, z.dtype)


def power_of_log(log_x, exponent):
    """``x^a`` for ``x = exp(log_x) ≥ 0`` and ``a ≥ 0`` (a number or a per-row tensor), with an exact, finite gradient.

    The value is ``pow(x, a)`` (``0^0 = 1``, ``0^a = 0``); the gradient is ``a x^a d(log x)`` (and ``x^a log x`` for a
    tensor ``a``), taken through ``pow`` where ``x`` is a normal number (``x^{a-1} ≤ 1/tiny`` is finite) and through
    ``exp(a log x)`` below (subnormal ``x``, where ``x^{a-1}`` would overflow), with the limit 0 at ``x = 0``.
    """
    tiny = torch.finfo(log_x.dtype).tiny
    x = torch.exp(log_x)
    normal = x >= tiny
    positive = log_x > -math.inf
    one = torch.ones((), dtype=log_x.dtype, device=log_x.device)
    tensor_exponent = isinstance(exponent, torch.Tensor)
    # each branch sees only its own rows' values (1 or 0 elsewhere), so no unselected inf reaches a backward as inf · 0
    by_pow = torch.where(normal, x, one).pow(exponent.detach() if tensor_exponent else exponent)
    by_exp = torch.exp(exponent * torch.where(positive & ~normal, log_x, torch.zeros_like(one)))
    if tensor_exponent:
        at_zero = (exponent == 0).to(log_x.dtype)
    else:
        at_zero = one if exponent == 0 else torch.zeros_like(one)
    value = torch.where(normal, by_pow, torch.where(positive, by_exp, at_zero))
    if tensor_exponent and exponent.requires_grad:
        # pow's own gradient in the exponent, x^a log x, would recompute log x from the rounded x: 0 for an x that
        # rounds to 1 (1 - p_y = 1 - 4e-19), where log x = -4e-19. Taken from log_x instead, through a term of value 0
        slope = by_pow * torch.where(normal, log_x, torch.zeros_like(one))  # by_pow is 1 where x is not normal
        value = value + (exponent - exponent.detach()) * slope.detach()
    return value


def row_log_terms(shifted_y, d_not_y, d):
    """``(log d, CE, log(1 - p_y))`` per row from the row's statistics relative to its max ``m``: ``shifted_y = z_y -
    m``, ``d_not_y = Σ_{k≠y} e^{z_k - m}`` and ``d = e^{z_y - m} + d_not_y``, each to its own relative precision
    (through ``z_y - logsumexp(z)`` they would carry an ulp of the logits: all of a confident row's digits). Where the
    target holds the max, ``d = 1 + d_not_y`` and ``log d = log1p(d_not_y)``; ``log(1 - p_y)`` is ``log1p(-p_y)``
    below ``p_y = 1/2`` and ``log d_not_y - log d`` above (each exact where the other cancels; ``-inf`` when every
    other class underflows)."""
    log_d = torch.where(shifted_y == 0, torch.log1p(d_not_y), torch.log(d))
    ce = (log_d - shifted_y).clamp(min=0)
    log_one_minus = torch.where(ce > math.log(2.0), torch.log1p(-torch.exp(-ce)), torch.log(d_not_y) - log_d)
    return log_d, ce, log_one_minus


def gamma_gradient_factor(logits, target, gamma, ignore_index, reduction_code) -> torch.Tensor:
    """Per row, ``d(reduced loss)/dγ_i`` for ``grad_output = 1`` of the focal loss ``(1 - p_y)^γ_i · CE_i``:
    ``u_i CE_i log(1 - p_y) · scale`` (scale 1/#valid for mean), 0 on ignored and saturated rows (the limit)."""
    with torch.no_grad():
        z = logits.float() if logits.dtype in (torch.float16, torch.bfloat16) else logits
        valid = target != ignore_index
        safe = torch.where(valid, target, 0)[:, None]
        # relative to the row max, with 1 - p_y = d_¬y / d and, where the target holds the max, CE = log1p(d_¬y):
        # log p_y = z_y - logsumexp(z) would carry an ulp of the logits into both, all of a confident row's digits
        shifted = z - z.amax(dim=1, keepdim=True)
        shifted_y = shifted.gather(1, safe)[:, 0]
        d_not_y = torch.exp(shifted).scatter(1, safe, 0.0).sum(dim=1)
        _, ce, log_one_minus = row_log_terms(shifted_y, d_not_y, torch.exp(shifted_y) + d_not_y)
        g = gamma.to(z.dtype)
        weighted_ce = torch.exp(g * log_one_minus) * ce
        factor = torch.where(valid & (weighted_ce != 0), weighted_ce * log_one_minus, 0.0)
        if reduction_code == REDUCTION_CODES["mean"]:
            factor = factor / valid.sum().clamp(min=1)
        return factor
