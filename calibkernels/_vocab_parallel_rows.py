"""Per-row statistics, weights and gradients of the vocabulary-parallel loss (:mod:`calibkernels.distributed`,
whose docstring has the table of statistics, their all-reduces and the gradient formulas).

Every function here works on one rank's block of classes ``z (N, C_r)`` in the compute dtype (float32, or float64
for float64 logits) and combines what it needs across the process group with all-reduces of ``O(N)`` numbers.
"""

from __future__ import annotations

import math
from types import SimpleNamespace
from typing import NamedTuple

import torch

from ._row_math import flsd_band, power_of_log, row_log_terms
from .loss_stats import LossStats

__all__ = ["RowOptions", "dist_module", "vocab_parallel_rows"]


def dist_module():
    """``torch.distributed``, once it is available and initialised (``RuntimeError`` otherwise)."""
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    if not dist.is_initialized():
        raise RuntimeError("vocab_parallel_uncertainty_weighted_ce needs an initialised process group "
                           "(torch.distributed.init_process_group)")
    return dist


class RowOptions(NamedTuple):
    """What a call computes, the same on every rank (checked by :mod:`calibkernels.distributed`)."""

    uncertainty: str
    mode: str
    norm: float
    ignore_index: int
    lse_square_scale: float = 0.0  # the z-loss scale s of s · lse_i²
    z_rows: bool = False  # compute the z-loss rows (s != 0, or return_z_loss)
    softcap: float | None = None  # logits become c · tanh(z / c) first
    return_stats: bool = False


def _log_power(log_x: torch.Tensor, exponent: float) -> torch.Tensor:
    """``exponent · log x`` with ``0 · log 0 = 0`` (``x^0 = 1``)."""
    return torch.zeros_like(log_x) if exponent == 0 else exponent * log_x


def _flsd_gamma(log_p_y: torch.Tensor, gamma: float) -> torch.Tensor:
    """FLSD-53's ``γ_i`` from ``float32(p_y)`` (:func:`calibkernels._row_math.flsd_band`)."""
    return flsd_band(torch.exp(log_p_y).float(), gamma, log_p_y.dtype)


def _top_label_prediction(z, m, offset, group):
    """Round 4: each row's arg-max over all ranks, the lowest global index among the classes equal to the global max
    ``m`` (``torch.argmax``'s tie rule; a NaN logit counts as a maximum, as there), from one all-reduce (MIN) of each
    rank's first candidate (``int64``'s largest value where it holds none)."""
    dist = dist_module()
    num_rows, num_local = z.shape
    none_here = torch.iinfo(torch.int64).max
    candidates = torch.full((num_rows,), none_here, dtype=torch.int64, device=z.device)
    if num_local > 0:
        is_max = (z == m[:, None]) | z.isnan()
        first = is_max.to(torch.uint8).argmax(dim=1)  # the first True (argmax takes the lowest index on ties)
        candidates = torch.where(is_max.any(dim=1), first + offset, candidates)
    dist.all_reduce(candidates, op=dist.ReduceOp.MIN, group=group)
    # no candidate anywhere (a NaN maximum that no rank matched): class 0, as torch.argmax gives an all -inf row
    return torch.where(candidates == none_here, torch.zeros_like(candidates), candidates)


def _row_max(x, num_rows, neg_inf):
    return x.amax(dim=1) if x.shape[1] > 0 else neg_inf.expand(num_rows).clone()


def _global_statistics(z, raw, target, offset, options: RowOptions, group) -> SimpleNamespace:
    """Rounds 1–4 of the module table of :mod:`calibkernels.distributed` for the (capped) logits ``z``: ``valid``,
    ``is_target (N, C_r)``, ``m``, ``z_y``, ``z_j`` (dual focal), ``e = e^{z − m}``, ``d``, ``d_not_y``, ``third``
    (Brier's ``S_q`` or dual focal's tie count, else ``None``), ``tied`` (dual focal) and ``stats``. ``raw``: the
    logits before the softcap (``None`` without one), whose own max and sum give the statistics (as the reference's
    are of the logits it was given), in the same all-reduces."""
    dist = dist_module()
    num_rows, num_local = z.shape
    device, dtype = z.device, z.dtype
    neg_inf = torch.full((), -math.inf, device=device, dtype=dtype)
    valid = target != options.ignore_index
    local_target = target - offset
    in_block = valid & (local_target >= 0) & (local_target < num_local)
    safe_local = torch.where(in_block, local_target, torch.zeros_like(local_target))
    is_target = in_block[:, None] & (torch.arange(num_local, device=device)[None, :] == safe_local[:, None])
    raw_stats = options.return_stats and raw is not None

    # round 1: row max and target logit (and the raw logits' max for the statistics)
    local_z_y = neg_inf.expand(num_rows).clone()
    if num_local > 0:
        local_z_y = torch.where(in_block, z.gather(1, safe_local[:, None])[:, 0], neg_inf)
    first = torch.stack([_row_max(z, num_rows, neg_inf), local_z_y]
                        + ([_row_max(raw, num_rows, neg_inf)] if raw_stats else []))
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
    m, z_y = first[0], first[1]
    z_y = torch.where(valid, z_y, m)  # ignored rows: any finite value (their loss and gradient are zeroed)

    z_j = tied = None
    if options.uncertainty == "dual_focal":  # round 2: the largest logit strictly below the target's
        z_j = _row_max(torch.where(z < z_y[:, None], z, neg_inf), num_rows, neg_inf)
        dist.all_reduce(z_j, op=dist.ReduceOp.MAX, group=group)

    # round 3: the sums
    e = torch.exp(z - m[:, None])
    zero = torch.zeros((), device=device, dtype=dtype)
    sums = [e.sum(dim=1), torch.where(is_target, zero, e).sum(dim=1)]
    if options.uncertainty in ("brier", "brier_flsd"):
        sums.append(torch.where(is_target, zero, torch.exp(options.norm * (z - m[:, None]))).sum(dim=1))
    if options.uncertainty == "dual_focal":
        tied = (z == z_j[:, None]) & (z_j > -math.inf)[:, None]
        sums.append(tied.sum(dim=1).to(dtype))
    if raw_stats:
        sums.append(torch.exp(raw - first[2][:, None]).sum(dim=1))
    second = torch.stack(sums)
    dist.all_reduce(second, op=dist.ReduceOp.SUM, group=group)
    stats = None
    if options.return_stats:  # round 4 (the statistics' own d and m where the logits were capped)
        stats_d, stats_m, stats_z = (second[-1], first[2], raw) if raw_stats else (second[0], m, z)
        stats = LossStats(torch.where(valid, stats_d.reciprocal(), math.nan).float(),
                          torch.where(valid, _top_label_prediction(stats_z, stats_m, offset, group), -1))
    third = second[2] if options.uncertainty in ("brier", "brier_flsd", "dual_focal") else None
    return SimpleNamespace(valid=valid, is_target=is_target, m=m, z_y=z_y, z_j=z_j, e=e, d=second[0],
                           d_not_y=second[1], third=third, tied=tied, stats=stats)


def _uncertainty_weight(rows: SimpleNamespace, sample_weight, gamma, options: RowOptions) -> None:
    """Adds to ``rows`` the log terms (``log_d``, ``cross_entropy``, ``log_one_minus``, ``log_p_y``), the weight
    ``u`` (before ignored rows are zeroed), ``gamma_i`` (a number, or ``(N,)``) and what the weight's derivative
    reuses (``log_p_j``, ``log_base`` for dual focal; ``log_s`` for Brier)."""
    dtype = rows.d.dtype
    # Everything relative to the row max m rather than through lse = m + log d, whose rounding (an ulp of m) would
    # be carried into every log-probability: z - m is exact near the max
    log_d, cross_entropy, log_one_minus = row_log_terms(rows.z_y - rows.m, rows.d_not_y, rows.d)
    rows.log_d, rows.cross_entropy, rows.log_one_minus = log_d, cross_entropy, log_one_minus
    rows.log_p_y = -cross_entropy
    gamma_i = gamma  # a float, or (N,) per sample (focal)
    uncertainty = options.uncertainty
    if uncertainty == "none":
        u = torch.ones_like(rows.d)
    elif uncertainty == "external":
        u = sample_weight.to(dtype)
    elif uncertainty in ("focal", "flsd"):
        if uncertainty == "flsd":
            gamma_i = _flsd_gamma(rows.log_p_y, gamma)
        u = power_of_log(log_one_minus, gamma_i if not isinstance(gamma_i, torch.Tensor) else gamma_i.to(dtype))
    elif uncertainty == "dual_focal":
        rows.log_p_j = (rows.z_j - rows.m) - log_d
        rows.log_base = torch.logaddexp(log_one_minus, rows.log_p_j)
        u = power_of_log(rows.log_base, gamma)
    else:  # brier, brier_flsd: S = Σ_{k≠y} p_k^q + (1 - p_y)^q
        if uncertainty == "brier_flsd":
            gamma_i = _flsd_gamma(rows.log_p_y, gamma)
        rows.log_s = torch.logaddexp(torch.log(rows.third) - options.norm * log_d,
                                     _log_power(log_one_minus, options.norm))
        u = power_of_log(rows.log_s, gamma_i / options.norm)
    rows.u, rows.gamma_i = u, gamma_i


def _ce_times_weight_derivative(z, rows: SimpleNamespace, p, options: RowOptions) -> torch.Tensor:
    """``CE_i ∂u_i/∂z_k (N, C_r)`` (mode ``"loss"``; formulas in :mod:`calibkernels.distributed`'s docstring)."""
    device, dtype = z.device, z.dtype
    is_target, cross_entropy, u = rows.is_target, rows.cross_entropy, rows.u
    p_y = torch.exp(rows.log_p_y)
    gamma_row = rows.gamma_i.to(dtype) if isinstance(rows.gamma_i, torch.Tensor) else rows.gamma_i
    if options.uncertainty in ("focal", "flsd"):
        d_not_y = rows.d_not_y
        share = torch.where(is_target, -torch.ones((), device=device, dtype=dtype),
                            rows.e / torch.where(d_not_y > 0, d_not_y, torch.ones_like(d_not_y))[:, None])
        return cross_entropy[:, None] * (gamma_row * u * p_y)[:, None] * share
    if options.uncertainty == "dual_focal":
        p_j = torch.exp(rows.log_p_j)
        log_b = rows.log_base[:, None]
        p_over_b = torch.exp((z - rows.m[:, None]) - rows.log_d[:, None] - log_b)
        tau = rows.tied.to(dtype) / rows.third.clamp(min=1)[:, None]
        pj_over_b = torch.exp(rows.log_p_j[:, None] - log_b)
        dlog_b = torch.where(is_target, -p_y[:, None], (p_y - p_j)[:, None] * p_over_b + pj_over_b * tau)
        return cross_entropy[:, None] * (gamma_row * u)[:, None] * dlog_b
    # brier, brier_flsd: CE ∂u/∂z_k = c (h_k − p_k H) with c = CE γ_i S^{γ_i/q − 1} (module docstring)
    # k = y: h_y − p_y H = −p_y S exactly, so that column is −CE γ_i u p_y (no cancellation as p_y → 1)
    # k ≠ y: p_k^q − p_k H, formed at O(1) magnitudes before c multiplies it (dividing h and H by S instead
    # overflows where S underflows: a confident row, whose CE is tiny but not 0)
    norm = options.norm
    log_h_y = rows.log_p_y + _log_power(rows.log_one_minus, norm - 1.0)  # h_y = −p_y (1 − p_y)^{q−1} = −exp(log_h_y)
    big_h = rows.third / rows.d.pow(norm) - torch.exp(log_h_y)  # H = Σ_{k≠y} p_k^q + h_y
    bracket = p.pow(norm) - p * big_h[:, None]
    # c applied as two factors √c: c itself can overflow (log c up to ~115 in float32, S ≥ its smallest
    # subnormal) where √c and the product do not
    root_c = torch.exp(0.5 * (torch.log(cross_entropy * gamma_row) + (gamma_row / norm - 1.0) * rows.log_s))
    return torch.where(is_target, -(cross_entropy * gamma_row * u * p_y)[:, None],
                       bracket * root_c[:, None] * root_c[:, None])


def vocab_parallel_rows(z, target, sample_weight, gamma, offset, options: RowOptions, group, *, class_weight_y=None,
                        ce_scale=None, z_scale=None, compute_grad=True, gamma_grad=False):
    """One rank's part of the loss: ``(row_loss, z_rows, grad, gamma_factor, stats)`` in the compute dtype of ``z``.

    * ``row_loss (N,)``: ``u_i · w_{y_i} · CE_i`` (``w_{y_i} = class_weight_y``, 1 without), 0 on ignored rows;
    * ``z_rows (N,)`` or ``None`` (``options.z_rows`` false): the z-loss ``s · lse_i²``, 0 on ignored rows;
    * ``grad (N, C_r)`` (``compute_grad``, else ``None``): the gradient of ``ce_scale · Σ_i row_loss_i + z_scale ·
      Σ_i z_rows_i`` with respect to this rank's logits (before the softcap; a scale ``None`` is 1);
    * ``gamma_factor (N,)`` (``gamma_grad``: a per-sample ``gamma``, mode ``"loss"``, else ``None``):
      ``d(ce_scale · row_loss_i)/dγ_i = ce_scale · row_loss_i log(1 − p_y)``, 0 where ``row_loss_i = 0``;
    * ``stats``: an ``(N,)`` :class:`LossStats` with ``options.return_stats`` (the same on every rank), else ``None``.

    With ``options.softcap = c`` every statistic is of ``c · tanh(z / c)``, except ``stats`` (of ``z`` itself), and
    the gradient is carried back through the cap: ``∂/∂z = (1 − (z'/c)²) ∂/∂z'``.
    """
    raw = None
    if options.softcap is not None:
        raw, z = z, options.softcap * torch.tanh(z / options.softcap)
    rows = _global_statistics(z, raw, target, offset, options, group)
    _uncertainty_weight(rows, sample_weight, gamma, options)
    zero = torch.zeros((), device=z.device, dtype=z.dtype)
    valid = rows.valid
    weighted_ce = rows.cross_entropy if class_weight_y is None else class_weight_y * rows.cross_entropy
    # ignored rows are 0 whatever their logits hold (NaN or inf there must not reach the loss, as in the reference)
    row_loss = torch.where(valid, rows.u * weighted_ce, zero)
    u = torch.where(valid, rows.u, zero)
    scale = options.lse_square_scale
    z_rows = lse = None
    if options.z_rows:
        lse = rows.m + rows.log_d
        z_rows = torch.where(valid, scale * lse.square(), zero)

    gamma_factor = None
    if gamma_grad:  # focal with a per-sample gamma, mode "loss": dL_i/dγ_i = L_i log(1 - p_y), 0 where L_i = 0
        gamma_factor = torch.where(row_loss != 0, row_loss * rows.log_one_minus, zero)
        gamma_factor = gamma_factor if ce_scale is None else gamma_factor * ce_scale
    if not compute_grad:
        return row_loss, z_rows, None, gamma_factor, rows.stats

    p = rows.e / rows.d[:, None]
    base = torch.where(rows.is_target, -(rows.d_not_y / rows.d)[:, None], p)  # p_k - δ_ky, exact at k = y
    grad = u[:, None] * base
    if options.mode == "loss" and options.uncertainty not in ("none", "external"):
        differentiable = valid & (rows.cross_entropy > 0)
        grad = grad + torch.where(differentiable[:, None], _ce_times_weight_derivative(z, rows, p, options), zero)
    if class_weight_y is not None:
        grad = grad * class_weight_y[:, None]
    if ce_scale is not None:
        grad = grad * ce_scale
    if scale != 0.0:  # ∂(s lse²)/∂z_k = 2 s lse p_k, outside both weights
        z_factor = 2.0 * scale * lse if z_scale is None else 2.0 * scale * lse * z_scale
        grad = grad + torch.where(valid, z_factor, zero)[:, None] * p
    grad = torch.where(valid[:, None], grad, zero)
    if options.softcap is not None:  # d(c tanh(z / c))/dz = 1 - tanh² = 1 - (z'/c)²
        grad = grad * (1.0 - (z / options.softcap).square())
    return row_loss, z_rows, grad, gamma_factor, rows.stats
