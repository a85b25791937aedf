"""Vocabulary-parallel uncertainty-weighted cross-entropy: the class dimension sharded across a process group
(docs/large_vocabularies.md, "Vocabulary-parallel loss").

Rank ``r`` of the group holds the logits of a contiguous block of classes ``[o_r, o_r + C_r)`` for **all** rows (the
output of a column-parallel output layer, as in Megatron-LM's ``vocab_parallel_cross_entropy``); the blocks may
differ in size, and one may be empty. Targets (and ``sample_weight``, a per-sample ``gamma``) are global and the same
on every rank. The loss is computed from per-row statistics combined with all-reduces of ``O(N)`` numbers, never by
gathering logits:

====================  ===========================================================  ==================
statistic (per row)   local contribution                                           all-reduce
====================  ===========================================================  ==================
``m`` (max logit)     ``max_k z_k``                                                MAX   (round 1)
``z_y``               the target's logit on the rank that holds it, else ``-inf``  MAX   (round 1)
``z_j`` (dual focal)  ``max{z_k : z_k < z_y}``                                     MAX   (round 2)
``d``                 ``Σ_k e^{z_k − m}``                                          SUM   (round 3)
``d_¬y``              ``Σ_{k≠y} e^{z_k − m}``                                      SUM   (round 3)
``S_q`` (Brier)       ``Σ_{k≠y} e^{q (z_k − m)}``                                  SUM   (round 3)
ties (dual focal)     ``#{k : z_k = z_j}``                                         SUM   (round 3)
arg-max (stats)       the lowest global index ``o_r + k`` with ``z_k = m``         MIN   (round 4)
====================  ===========================================================  ==================

From them, on every rank: ``CE = (m − z_y) + log d``, ``log p_k = (z_k − m) − log d`` (relative to the max, never
through ``lse = m + log d``, whose rounding is an ulp of ``m``; ``log d = log1p(d_¬y)`` where the target holds the
max), ``1 − p_y = d_¬y / d`` (no cancellation), ``Σ_{k≠y} p_k^q = S_q / d^q`` and the weight ``u`` of
docs/losses.md. With ``return_stats`` the top-label statistics reuse ``m`` and ``d``: ``confidence = 1 / d`` (the
arg-max class's ``e^{z − m}`` is 1, as in :func:`calibkernels.loss_stats.top_label_stats`) and ``prediction`` comes
from round 4, the one all-reduce of ``N`` integers they add.
The non-ignored row count comes from the (replicated) targets, without communication; ignored rows are 0 whatever
their logits hold. Before that, one ``all_gather`` of ``(C_r, N)`` and the call's settings (uncertainty, mode,
reduction, ``ignore_index``, dtype, ``gamma``, ``norm``, which optional tensors are given) gives every rank the block
sizes (hence its offset ``o_r`` and ``C = Σ C_r``) and checks that all ranks hold the same number of rows and were
called alike, and one all-reduce (MAX) of each row's target and its negation (and of ``sample_weight``'s and a
per-sample ``gamma``'s bits) that they hold the same targets. A mismatch raises the same ``ValueError`` on every rank,
decided from the same gathered numbers, rather than a hang or a crash in a later collective of another size.

Each rank's gradient is its slice of the unsharded gradient, computed locally from the combined statistics (for
``grad_output = 1`` in the forward; the backward scales it, the contract of :mod:`calibkernels._autograd`)::

    ∂L_i/∂z_k = u_i (p_k − δ_ky)                                   (mode "grad"; p_y − 1 = −d_¬y / d)
              + CE_i ∂u_i/∂z_k                                     (mode "loss")

    focal, flsd   ∂u/∂z_k = γ_i u p_y r_k,          r_k = e^{z_k − m} / d_¬y (k ≠ y),  r_y = −1
    dual focal    ∂u/∂z_k = γ u ∂log B/∂z_k,        B = 1 − p_y + p_j,
                  ∂log B/∂z_y = −p_y,  ∂log B/∂z_k = ((p_y − p_j) p_k + p_j τ_k) / B  (k ≠ y; τ_k = 1/#ties at p_j)
    brier(_flsd)  ∂u/∂z_k = γ_i S^{γ_i/q − 1} (h_k − p_k H),  h_k = p_k^q (k ≠ y),  h_y = −p_y (1 − p_y)^{q−1},
                  H = Σ_k h_k  (h_y − p_y H = −p_y S: the target column is −γ_i u p_y)

times ``1 / n_valid`` for ``"mean"``; rows with ``CE = 0`` (saturated) take the limit 0 of the second term, as the
reference does. Pure PyTorch per rank (float32 compute for half-precision logits, float64 for float64).
"""

from __future__ import annotations

import math
import struct
import zlib

import torch

from . import _autograd
from ._kernel_codes import MODE_CODES, REDUCTION_CODES, WEIGHT_CODES
from .loss_stats import LossStats, check_return_stats
from ._row_math import flsd_band, power_of_log, row_log_terms
from ._target_checks import out_of_range_message
from ._validation import (check_class_weight, check_gamma, check_ignore_index, check_mode, check_norm,
                          check_per_sample_gamma, check_reduction, check_sample_weight, check_uncertainty,
                          out_of_range_targets)

__all__ = ["vocab_parallel_uncertainty_weighted_ce"]

_DOUBLE_BACKWARD_MESSAGE = (
    "calibkernels: vocab_parallel_uncertainty_weighted_ce does not support double backward (create_graph=True; its "
    "gradient is computed in the forward, without a graph)"
)


def _dist():
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    if not dist.is_initialized():
        raise RuntimeError("vocab_parallel_uncertainty_weighted_ce needs an initialised process group "
                           "(torch.distributed.init_process_group)")
    return dist


# What every rank must pass alike, in the order of the gathered table's columns after ``(C_r, N)``.
_SETTINGS = ("uncertainty", "mode", "reduction", "ignore_index", "dtype", "gamma", "norm", "sample_weight",
             "per-sample gamma", "return_stats")


def _float_bits(value: float) -> int:
    """A float as the int64 of its IEEE-754 bits (exact equality in an integer all_gather)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _row_bits(values: torch.Tensor) -> torch.Tensor:
    """Per-row float values (finite, ``>= 0``: checked) as the int64 of their float64 bits; ``+ 0.0`` turns ``-0.0``
    into ``0.0``, so every pattern is ``>= 0`` and its negation fits int64."""
    return (values.detach().reshape(-1).to(torch.float64) + 0.0).view(torch.int64)


def _settings_row(uncertainty, mode, reduction, ignore_index, dtype, gamma_value, norm, sample_weight, gamma_tensor,
                  return_stats=False):
    """The settings of :data:`_SETTINGS` as int64s: codes, the bits of ``gamma`` (weights that use it) and ``norm``
    (Brier weights), a CRC of the dtype's name (stable across processes), whether the two optional tensors are given
    and whether the statistics are (their all-reduce is one more collective)."""
    uses_gamma = uncertainty not in ("none", "external") and gamma_tensor is None
    return [WEIGHT_CODES[uncertainty], MODE_CODES[mode], REDUCTION_CODES[reduction], ignore_index,
            zlib.crc32(str(dtype).encode()), _float_bits(gamma_value) if uses_gamma else 0,
            _float_bits(norm) if uncertainty in ("brier", "brier_flsd") else 0, int(sample_weight is not None),
            int(gamma_tensor is not None), int(return_stats)]


def _block_layout(num_local: int, target1d: torch.Tensor, group, device, settings=(), row_tensors=()):
    """``(offset of this rank's block, total classes)`` from one all_gather of ``(C_r, N, *settings)``.

    The row's last column is 0 here and 1 from a rank that refused its own arguments (:func:`_share_refusal`, which
    takes part in this all_gather instead). Raises the same ``ValueError`` on every rank (each decides from the same
    gathered numbers, so none is left waiting in a later collective) if a rank refused its arguments, if the ranks'
    row counts or ``settings`` (:func:`_settings_row`) differ, if no
    rank holds a class, or then if the targets, or any of ``row_tensors`` (``(name, tensor)`` pairs: ``sample_weight``
    and a per-sample ``gamma``, compared as :func:`_row_bits`), differ on some row: one all-reduce (MAX) of each row's
    value and its negation, exact (a hash of the targets can be matched by different ones)."""
    dist = _dist()
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("vocab-parallel loss: this process is not a member of the process group it was given")
    mine = torch.tensor([num_local, target1d.shape[0], *settings, 0], device=device, dtype=torch.int64)
    gathered = [torch.empty_like(mine) for _ in range(world)]
    dist.all_gather(gathered, mine, group=group)
    rows = torch.stack(gathered).cpu().tolist()
    table = [row[:-1] for row in rows]
    refused = [r for r, row in enumerate(rows) if row[-1]]
    if refused:
        raise ValueError(f"vocab-parallel loss: rank {refused[0]} refused its arguments (its own error says why); "
                         "no rank computed the loss")
    if any(row[1] != table[0][1] for row in table):
        raise ValueError(f"vocab-parallel loss: the ranks hold different numbers of rows {[r[1] for r in table]}; "
                         "every rank must hold all rows of its class block")
    differing = [name for column, name in enumerate(_SETTINGS[:len(settings)], start=2)
                 if any(row[column] != table[0][column] for row in table)]
    if differing:
        ranks = [r for r, row in enumerate(table) if row[2:] != table[0][2:]]
        raise ValueError(f"vocab-parallel loss: the ranks were called with different {', '.join(differing)} (rank 0 "
                         f"and rank {ranks[0]} differ); every rank must pass the same arguments")
    sizes = [row[0] for row in table]
    if sum(sizes) == 0:
        raise ValueError("vocab-parallel loss: no rank holds a class (every block has C_r = 0)")
    if world > 1:
        rows = [("targets", target1d.to(device=device, dtype=torch.int64))]
        rows += [(name, _row_bits(t).to(device)) for name, t in row_tensors]
        extremes = torch.cat([torch.stack((r, -r)) for _, r in rows])
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX, group=group)
        for index, (name, _) in enumerate(rows):
            differ = extremes[2 * index] != -extremes[2 * index + 1]
            if bool(differ.any()):  # the same answer on every rank: all raise, none waits
                row = int(differ.nonzero()[0, 0])
                what = "targets" if index == 0 else f"{name} values"
                raise ValueError(f"vocab-parallel loss: the {what} differ between ranks (first at row {row}); every "
                                 f"rank must pass the same (global) {name}")
    return sum(sizes[:rank]), sum(sizes)


def _share_refusal(local_logits, group) -> None:
    """Take part in :func:`_block_layout`'s all_gather with a row that says this rank refused its arguments, so that
    the other ranks raise there too instead of waiting for this one until the group's timeout. Nothing to do
    without an initialised process group, or in a group this process is not a member of."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_rank(group) < 0:
        return
    if isinstance(local_logits, torch.Tensor):
        device = local_logits.device
    elif dist.get_backend(group) == "nccl":  # whose collectives take CUDA tensors only
        device = torch.device("cuda", torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    mine = torch.zeros(3 + len(_SETTINGS), dtype=torch.int64, device=device)
    mine[-1] = 1
    dist.all_gather([torch.empty_like(mine) for _ in range(dist.get_world_size(group))], mine, group=group)


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
    dist = _dist()
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


def _vocab_parallel_rows(z, target, sample_weight, gamma, offset, uncertainty, mode, norm, ignore_index, group,
                         compute_grad, gamma_grad, return_stats=False):
    """``(row_loss (N,), gradient of Σ_i L_i w.r.t. the local logits (N, C_r) or None, dL_i/dγ_i (N,) or None,
    stats)`` in the compute dtype (module docstring for the statistics and formulas); ``stats`` an ``(N,)``
    :class:`LossStats` with ``return_stats`` (the same on every rank), else ``None``."""
    dist = _dist()
    num_rows, num_local = z.shape
    device, dtype = z.device, z.dtype
    neg_inf = torch.full((), -math.inf, device=device, dtype=dtype)
    valid = target != ignore_index
    local_target = target - offset
    in_block = valid & (local_target >= 0) & (local_target < num_local)
    safe_local = torch.where(in_block, local_target, torch.zeros_like(local_target))
    is_target = in_block[:, None] & (torch.arange(num_local, device=device)[None, :] == safe_local[:, None])

    # round 1: row max and target logit
    if num_local > 0:
        local_max = z.amax(dim=1)
        local_z_y = torch.where(in_block, z.gather(1, safe_local[:, None])[:, 0], neg_inf)
    else:
        local_max = local_z_y = torch.full((num_rows,), -math.inf, device=device, dtype=dtype)
    first = torch.stack((local_max, local_z_y))
    dist.all_reduce(first, op=dist.ReduceOp.MAX, group=group)
    m, z_y = first[0], first[1]
    z_y = torch.where(valid, z_y, m)  # ignored rows: any finite value (their loss and gradient are zeroed)

    # round 2 (dual focal): the largest logit strictly below the target's
    if uncertainty == "dual_focal":
        below = torch.where(z < z_y[:, None], z, neg_inf)
        z_j = below.amax(dim=1) if num_local > 0 else torch.full((num_rows,), -math.inf, device=device, dtype=dtype)
        dist.all_reduce(z_j, op=dist.ReduceOp.MAX, group=group)

    # round 3: the sums
    e = torch.exp(z - m[:, None])
    zero = torch.zeros((), device=device, dtype=dtype)
    sums = [e.sum(dim=1), torch.where(is_target, zero, e).sum(dim=1)]
    if uncertainty in ("brier", "brier_flsd"):
        sums.append(torch.where(is_target, zero, torch.exp(norm * (z - m[:, None]))).sum(dim=1))
    if uncertainty == "dual_focal":
        tied = (z == z_j[:, None]) & (z_j > -math.inf)[:, None]
        sums.append(tied.sum(dim=1).to(dtype))
    second = torch.stack(sums)
    dist.all_reduce(second, op=dist.ReduceOp.SUM, group=group)
    d, d_not_y = second[0], second[1]
    stats = None
    if return_stats:
        stats = LossStats(torch.where(valid, d.reciprocal(), math.nan).float(),
                          torch.where(valid, _top_label_prediction(z, m, offset, group), -1))

    # Everything relative to the row max m rather than through lse = m + log d, whose rounding (an ulp of m) would
    # be carried into every log-probability: z - m is exact near the max
    log_d, cross_entropy, log_one_minus = row_log_terms(z_y - m, d_not_y, d)
    log_p_y = -cross_entropy
    gamma_i = gamma  # a float, or (N,) per sample (focal)
    if uncertainty == "none":
        u = torch.ones_like(d)
    elif uncertainty == "external":
        u = sample_weight.to(dtype)
    elif uncertainty in ("focal", "flsd"):
        if uncertainty == "flsd":
            gamma_i = _flsd_gamma(log_p_y, gamma)
        u = power_of_log(log_one_minus, gamma_i if not isinstance(gamma_i, torch.Tensor) else gamma_i.to(dtype))
    elif uncertainty == "dual_focal":
        log_p_j = (z_j - m) - log_d
        log_base = torch.logaddexp(log_one_minus, log_p_j)
        u = power_of_log(log_base, gamma)
    else:  # brier, brier_flsd: S = Σ_{k≠y} p_k^q + (1 - p_y)^q
        if uncertainty == "brier_flsd":
            gamma_i = _flsd_gamma(log_p_y, gamma)
        log_s = torch.logaddexp(torch.log(second[2]) - norm * log_d, _log_power(log_one_minus, norm))
        u = power_of_log(log_s, gamma_i / norm)
    # ignored rows are 0 whatever their logits hold (NaN or inf there must not reach the loss, as in the reference)
    row_loss = torch.where(valid, u * cross_entropy, zero)
    u = torch.where(valid, u, zero)

    gamma_factor = None
    if gamma_grad:  # focal with a per-sample gamma, mode "loss": dL_i/dγ_i = L_i log(1 - p_y), 0 where L_i = 0
        gamma_factor = torch.where(row_loss != 0, row_loss * log_one_minus, zero)
    if not compute_grad:
        return row_loss, None, gamma_factor, stats

    p = e / d[:, None]
    base = torch.where(is_target, -(d_not_y / d)[:, None], p)  # p_k - δ_ky, without cancellation at k = y
    grad = u[:, None] * base
    if mode == "loss" and uncertainty not in ("none", "external"):
        p_y = torch.exp(log_p_y)
        gamma_row = gamma_i.to(dtype) if isinstance(gamma_i, torch.Tensor) else gamma_i
        if uncertainty in ("focal", "flsd"):
            share = torch.where(is_target, -torch.ones((), device=device, dtype=dtype),
                                e / torch.where(d_not_y > 0, d_not_y, torch.ones_like(d_not_y))[:, None])
            ce_du = cross_entropy[:, None] * (gamma_row * u * p_y)[:, None] * share
        elif uncertainty == "dual_focal":
            p_j = torch.exp(log_p_j)
            log_b = log_base[:, None]
            p_over_b = torch.exp((z - m[:, None]) - log_d[:, None] - log_b)
            tau = tied.to(dtype) / second[2].clamp(min=1)[:, None]
            pj_over_b = torch.exp(log_p_j[:, None] - log_b)
            dlog_b = torch.where(is_target, -p_y[:, None], (p_y - p_j)[:, None] * p_over_b + pj_over_b * tau)
            ce_du = cross_entropy[:, None] * (gamma * u)[:, None] * dlog_b
        else:  # brier, brier_flsd: CE ∂u/∂z_k = c (h_k − p_k H) with c = CE γ_i S^{γ_i/q − 1} (module docstring)
            # k = y: h_y − p_y H = −p_y S exactly, so that column is −CE γ_i u p_y (no cancellation as p_y → 1)
            # k ≠ y: p_k^q − p_k H, formed at O(1) magnitudes before c multiplies it (dividing h and H by S instead
            # overflows where S underflows: a confident row, whose CE is tiny but not 0)
            log_h_y = log_p_y + _log_power(log_one_minus, norm - 1.0)  # h_y = −p_y (1 − p_y)^{q−1} = −exp(log_h_y)
            big_h = second[2] / d.pow(norm) - torch.exp(log_h_y)  # H = Σ_{k≠y} p_k^q + h_y
            bracket = p.pow(norm) - p * big_h[:, None]
            # c applied as two factors √c: c itself can overflow (log c up to ~115 in float32, S ≥ its smallest
            # subnormal) where √c and the product do not
            root_c = torch.exp(0.5 * (torch.log(cross_entropy * gamma_row) + (gamma_row / norm - 1.0) * log_s))
            ce_du = torch.where(is_target, -(cross_entropy * gamma_row * u * p_y)[:, None],
                                bracket * root_c[:, None] * root_c[:, None])
        differentiable = valid & (cross_entropy > 0)
        grad = grad + torch.where(differentiable[:, None], ce_du, zero)
    grad = torch.where(valid[:, None], grad, zero)
    return row_loss, grad, gamma_factor, stats


class _VocabParallelUWCE(torch.autograd.Function):
    """Forward: the loss and this rank's gradient slice for ``grad_output = 1`` (with ``return_stats`` also the
    confidence and prediction, not differentiable); backward: that slice scaled by ``grad_output`` (a scalar, or per
    row for ``reduction="none"``)."""

    @staticmethod
    def forward(ctx, local_logits, target, sample_weight, gamma, offset, uncertainty, mode, gamma_value, norm,
                reduction, ignore_index, group, return_stats=False):
        gamma_grad = gamma is not None and ctx.needs_input_grad[3] and mode == "loss"
        row_loss, grad, gamma_factor, stats = _run(local_logits, target, sample_weight, gamma, offset, uncertainty,
                                                   mode, gamma_value, norm, ignore_index, group, True, gamma_grad,
                                                   return_stats)
        loss, scale = _reduce(row_loss, target, reduction, ignore_index)
        if scale is not None:
            grad = grad * scale
            gamma_factor = None if gamma_factor is None else gamma_factor * scale
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad.to(local_logits.dtype),
                              None if gamma_factor is None else gamma_factor.to(gamma.dtype))
        if stats is None:
            return loss
        ctx.mark_non_differentiable(*stats)
        return (loss, *stats)

    @staticmethod
    def backward(ctx, grad_loss, *_stats_grads):
        grad, gamma_factor = ctx.saved_tensors
        _autograd.raise_if_create_graph(grad, _DOUBLE_BACKWARD_MESSAGE)
        d_logits = _autograd.scale_saved_gradient(grad, grad_loss)
        d_gamma = None
        if gamma_factor is not None and grad_loss is not None:
            d_gamma = gamma_factor * grad_loss.to(gamma_factor.dtype)
        return d_logits, None, None, d_gamma, None, None, None, None, None, None, None, None, None


def _run(local_logits, target, sample_weight, gamma, offset, uncertainty, mode, gamma_value, norm, ignore_index,
         group, compute_grad, gamma_grad, return_stats=False):
    compute_dtype = torch.float64 if local_logits.dtype == torch.float64 else torch.float32
    z = local_logits.detach().to(compute_dtype)
    gamma_arg = gamma_value if gamma is None else gamma.detach().to(compute_dtype)
    return _vocab_parallel_rows(z, target, sample_weight, gamma_arg, offset, uncertainty, mode, norm, ignore_index,
                                group, compute_grad, gamma_grad, return_stats)


def _reduce(row_loss, target, reduction, ignore_index):
    """``(loss, scale of the gradient or None)``: the row losses reduced over the whole (replicated) batch."""
    if reduction == "none":
        return row_loss, None
    if reduction == "sum":
        return row_loss.sum(), None
    scale = 1.0 / (target != ignore_index).sum().clamp(min=1).to(row_loss.dtype)
    return row_loss.sum() * scale, scale


def _local_arguments(local_logits, target, uncertainty, mode, gamma, norm, sample_weight, weight, reduction,
                     ignore_index, return_stats=False):
    """The checks that need no other rank (types, shapes, names, values), and what the call needs from them."""
    check_class_weight(weight)
    check_return_stats(return_stats)
    check_uncertainty(uncertainty)
    check_mode(mode)
    check_reduction(reduction)
    check_gamma(gamma)
    check_norm(norm)
    if not isinstance(local_logits, torch.Tensor):
        raise TypeError(f"local_logits must be a torch.Tensor, got {type(local_logits).__name__}")
    if not isinstance(target, torch.Tensor):
        raise TypeError(f"target must be a torch.Tensor, got {type(target).__name__}")
    if not local_logits.is_floating_point():
        raise TypeError(f"local_logits must be a floating-point tensor, got {local_logits.dtype}")
    if target.is_floating_point() or target.is_complex() or target.dtype == torch.bool:
        raise TypeError(f"target must hold integer class indices (int64), got {target.dtype}")
    if local_logits.dim() < 2:
        raise ValueError(f"local_logits must have at least 2 dimensions (..., C_r), got shape "
                         f"{tuple(local_logits.shape)}")
    if tuple(target.shape) != tuple(local_logits.shape[:-1]):
        raise ValueError(f"target shape {tuple(target.shape)} does not match local_logits shape "
                         f"{tuple(local_logits.shape)}: expected {tuple(local_logits.shape[:-1])}")
    if target.device != local_logits.device:
        raise ValueError(f"target is on {target.device} but local_logits are on {local_logits.device}")
    check_ignore_index(ignore_index)
    batch_shape = tuple(target.shape)
    num_local = local_logits.shape[-1]
    logits2d = local_logits.reshape(math.prod(batch_shape), num_local)  # -1 is ambiguous for an empty block
    if logits2d.shape[0] == 0:
        raise ValueError("empty batch: local_logits have no rows")
    target1d = target.reshape(-1).long()
    device = local_logits.device
    sample_weight = check_sample_weight(sample_weight, uncertainty, batch_shape, device)
    gamma = check_per_sample_gamma(gamma, uncertainty, batch_shape, device)
    gamma_tensor = gamma if isinstance(gamma, torch.Tensor) else None
    gamma_value = 0.0 if gamma_tensor is not None else float(gamma)

    settings = _settings_row(uncertainty, mode, reduction, ignore_index, local_logits.dtype, gamma_value, float(norm),
                             sample_weight, gamma_tensor, return_stats)
    row_tensors = [(name, t) for name, t in (("sample_weight", sample_weight), ("per-sample gamma", gamma_tensor))
                   if t is not None]
    return (batch_shape, num_local, logits2d, target1d, device, sample_weight, gamma_tensor, gamma_value, settings,
            row_tensors)


def vocab_parallel_uncertainty_weighted_ce(
    local_logits: torch.Tensor,
    target: torch.Tensor,
    *,
    group=None,
    uncertainty: str = "brier",
    mode: str = "grad",
    gamma: float | torch.Tensor = 4.0,
    norm: float = 2.0,
    sample_weight: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    return_stats: bool = False,
):
    """:func:`calibkernels.uncertainty_weighted_ce` of logits whose class dimension is sharded across ``group``.

    Args:
        local_logits: ``(..., C_r)``: this rank's contiguous block of classes (rank order = class order; block sizes
            may differ between ranks, ``C_r = 0`` allowed) for every row. float32/float16/bfloat16/float64.
        target: ``(...)`` global class indices in ``[0, C)`` (``C = Σ_r C_r``) or ``ignore_index``, the same on every
            rank (checked).
        group: the process group (``None``: the default group). Works with any backend whose collectives accept
            tensors on ``local_logits``'s device (gloo for CPU, NCCL for CUDA tensors).
        uncertainty, mode, gamma, norm, sample_weight, weight, reduction, ignore_index: as in
            :func:`calibkernels.uncertainty_weighted_ce`; all of them, and the dtype of ``local_logits``, must be
            the same on every rank (checked, values of ``sample_weight`` and a per-sample ``gamma`` included). A
            per-sample ``gamma`` that requires grad gets ``∂L/∂γ_i = L_i log(1 − p_{i,y})``
            (times the reduction's scale) in ``mode="loss"``, on every rank.
        return_stats: also return a :class:`calibkernels.LossStats` of the unsharded logits, the same on every rank:
            ``(loss, stats)``. ``confidence = 1 / Σ_k e^{z_k − m}`` from the loss's own global max and sum, and
            ``prediction`` the lowest global index of a maximum (whichever ranks hold it), from one more all-reduce
            (MIN) of ``N`` integers; NaN / -1 on ignored rows (docs/metrics.md, "Monitor calibration while
            training"). Equal to :func:`calibkernels.loss_stats.top_label_stats` of the unsharded logits, the
            confidence up to the order of the sum's terms.

    Returns:
        the same loss on every rank, in ``local_logits``' dtype (a scalar, or ``target``-shaped for ``"none"``);
        ``backward`` gives each rank its slice ``∂L/∂z[..., o_r : o_r + C_r]`` of the unsharded gradient. With
        ``return_stats``, ``(loss, stats)``.

    Raises ``ValueError`` on every rank alike when the ranks' row counts, arguments or targets differ, or no rank
    holds a class. The checks that need no other rank (types, shapes, names, values) raise their own error on the
    rank that fails them, which first tells the others in the call's first collective: they raise a ``ValueError``
    naming that rank instead of waiting for it. Communication per call: one ``all_gather`` of 13 integers, an
    all-reduce (MAX) of ``2N`` integers (``2N`` more per optional tensor) with more than one rank, then all-reduces
    of ``2N`` (MAX), ``N`` (MAX, dual focal only) and ``2N``–``3N`` numbers (SUM), and with ``return_stats`` one of
    ``N`` integers (MIN). The targets are checked on the
    host (a synchronisation on GPU). Double backward is not supported.
    """
    try:
        (batch_shape, num_local, logits2d, target1d, device, sample_weight, gamma_tensor, gamma_value, settings,
         row_tensors) = _local_arguments(local_logits, target, uncertainty, mode, gamma, norm, sample_weight, weight,
                                         reduction, ignore_index, return_stats)
    except (TypeError, ValueError, NotImplementedError):
        _share_refusal(local_logits, group)  # the other ranks raise too, in the collective they are waiting in
        raise
    offset, num_classes = _block_layout(num_local, target1d, group, device, settings, row_tensors)
    bad = out_of_range_targets(target1d, num_classes, ignore_index)
    if bool(bad.any()):
        raise ValueError(out_of_range_message(int(target1d[bad][0]), num_classes, ignore_index))
    if sample_weight is not None:
        sample_weight = sample_weight.detach()

    grad_enabled = torch.is_grad_enabled()
    if grad_enabled and (logits2d.requires_grad or (gamma_tensor is not None and gamma_tensor.requires_grad)):
        out = _VocabParallelUWCE.apply(logits2d, target1d, sample_weight, gamma_tensor, offset, uncertainty, mode,
                                       gamma_value, float(norm), reduction, ignore_index, group, return_stats)
        loss, stats = (out[0], LossStats(*out[1:])) if return_stats else (out, None)
    else:
        row_loss, _, _, stats = _run(logits2d, target1d, sample_weight, gamma_tensor, offset, uncertainty, mode,
                                     gamma_value, float(norm), ignore_index, group, False, False, return_stats)
        loss, _ = _reduce(row_loss, target1d, reduction, ignore_index)
    if reduction == "none":
        loss = loss.reshape(batch_shape)
    loss = loss if loss.dtype == local_logits.dtype else loss.to(local_logits.dtype)
    if not return_stats:
        return loss
    return loss, LossStats(stats.confidence.reshape(batch_shape), stats.prediction.reshape(batch_shape))
