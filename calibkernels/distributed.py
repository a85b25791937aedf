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
max, sum (stats)      with ``softcap``: ``max_k z_k``, ``Σ_k e^{z_k − m}`` uncapped  MAX, SUM (1, 3)
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

``F.cross_entropy`` / Liger-Kernel options (docs/losses.md, "Coming from F.cross_entropy / Liger-Kernel"), none of
which adds a collective: per-class weights ``w`` (the whole ``(C,)`` tensor on every rank) scale row ``i``'s loss and
gradient by ``w_{y_i}``, read with the global target, and ``"mean"`` divides by ``Σ w_y`` over the non-ignored rows;
the z-loss ``s · lse_i²`` uses ``lse = m + log d`` and adds ``2 s lse_i p_k`` to the gradient (mean over
``n_valid``, outside both weights); ``softcap`` caps each rank's block, ``z' = c tanh(z / c)``, computes everything
above from ``z'`` and multiplies the gradient by ``1 − (z'/c)²``. The statistics stay those of the uncapped logits.
The row math lives in :mod:`calibkernels._vocab_parallel_rows`.
"""

from __future__ import annotations

import math
import struct
import zlib

import torch

from . import _autograd
from ._kernel_codes import MODE_CODES, REDUCTION_CODES, WEIGHT_CODES
from ._target_checks import out_of_range_message
from ._validation import (check_class_weight, check_class_weight_tensor, check_drop_in_options, check_gamma,
                          check_ignore_index, check_mode, check_norm, check_per_sample_gamma, check_reduction,
                          check_sample_weight, check_uncertainty, out_of_range_targets)
from ._vocab_parallel_rows import RowOptions, dist_module, vocab_parallel_rows
from .loss_stats import LossStats, check_return_stats

__all__ = ["vocab_parallel_uncertainty_weighted_ce"]

_DOUBLE_BACKWARD_MESSAGE = (
    "calibkernels: vocab_parallel_uncertainty_weighted_ce does not support double backward (create_graph=True; its "
    "gradient is computed in the forward, without a graph)"
)


# What every rank must pass alike, in the order of the gathered table's columns after ``(C_r, N)``.
_SETTINGS = ("uncertainty", "mode", "reduction", "ignore_index", "dtype", "gamma", "norm", "sample_weight",
             "per-sample gamma", "return_stats", "lse_square_scale", "return_z_loss", "softcap", "weight",
             "weight values")


def _float_bits(value: float) -> int:
    """A float as the int64 of its IEEE-754 bits (exact equality in an integer all_gather)."""
    return struct.unpack("<q", struct.pack("<d", float(value)))[0]


def _row_bits(values: torch.Tensor) -> torch.Tensor:
    """Per-row float values (finite, ``>= 0``: checked) as the int64 of their float64 bits; ``+ 0.0`` turns ``-0.0``
    into ``0.0``, so every pattern is ``>= 0`` and its negation fits int64."""
    return (values.detach().reshape(-1).to(torch.float64) + 0.0).view(torch.int64)


# a prime below 2^31: the weight checksum's terms stay below 2^62, their sum exact in int64 for any C < 2^31
_CHECKSUM_PRIME = 2**31 - 1


def _class_weight_checksum(weight: torch.Tensor) -> int:
    """A position-sensitive checksum of the per-class weights' float64 bits (finite, ``>= 0``: checked), in exact
    int64 arithmetic on their device and read once: ``Σ_k (lo_k a_k mod P) + (hi_k b_k mod P)`` over the low and
    high 32 bits of each entry, with per-position factors ``a_k = k + 1`` and ``b_k = 7 a_k + 3`` (mod ``P``).
    Different weights can share a checksum (then they pass unnoticed), but a changed entry, or two swapped ones,
    changes it unless its changes cancel modulo ``P``."""
    bits = _row_bits(weight)
    position = torch.arange(1, bits.shape[0] + 1, device=bits.device, dtype=torch.int64) % _CHECKSUM_PRIME
    low, high = bits & 0xFFFFFFFF, bits >> 32
    terms = (low * position) % _CHECKSUM_PRIME + (high * ((7 * position + 3) % _CHECKSUM_PRIME)) % _CHECKSUM_PRIME
    return int(terms.sum() % _CHECKSUM_PRIME)


def _settings_row(uncertainty, mode, reduction, ignore_index, dtype, gamma_value, norm, sample_weight, gamma_tensor,
                  return_stats, drop_in, class_weight):
    """The settings of :data:`_SETTINGS` as int64s: codes, the bits of ``gamma`` (weights that use it) and ``norm``
    (Brier weights), a CRC of the dtype's name (stable across processes), whether the two optional tensors are given
    and whether the statistics are (their all-reduce is one more collective), the z-loss scale's and the softcap's
    bits (0 for none), whether the z-loss is returned, and the per-class weights' length (``C + 1``, 0 without) and
    checksum (:func:`_class_weight_checksum`)."""
    uses_gamma = uncertainty not in ("none", "external") and gamma_tensor is None
    softcap = drop_in["softcap"]
    return [WEIGHT_CODES[uncertainty], MODE_CODES[mode], REDUCTION_CODES[reduction], ignore_index,
            zlib.crc32(str(dtype).encode()), _float_bits(gamma_value) if uses_gamma else 0,
            _float_bits(norm) if uncertainty in ("brier", "brier_flsd") else 0, int(sample_weight is not None),
            int(gamma_tensor is not None), int(return_stats), _float_bits(drop_in["lse_square_scale"] + 0.0),
            int(drop_in["return_z_loss"]), 0 if softcap is None else _float_bits(softcap),
            0 if class_weight is None else class_weight.shape[0] + 1,
            0 if class_weight is None else _class_weight_checksum(class_weight)]


def _block_layout(num_local: int, target1d: torch.Tensor, group, device, settings=(), row_tensors=()):
    """``(offset of this rank's block, total classes)`` from one all_gather of ``(C_r, N, *settings)``.

    The row's last column is 0 here and 1 from a rank that refused its own arguments (:func:`_share_refusal`, which
    takes part in this all_gather instead). Raises the same ``ValueError`` on every rank (each decides from the same
    gathered numbers, so none is left waiting in a later collective) if a rank refused its arguments, if the ranks'
    row counts or ``settings`` (:func:`_settings_row`) differ, if no
    rank holds a class, or then if the targets, or any of ``row_tensors`` (``(name, tensor)`` pairs: ``sample_weight``
    and a per-sample ``gamma``, compared as :func:`_row_bits`), differ on some row: one all-reduce (MAX) of each row's
    value and its negation, exact (a hash of the targets can be matched by different ones)."""
    dist = dist_module()
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


class _VocabParallelUWCE(torch.autograd.Function):
    """Forward: the loss and this rank's gradient slice for ``grad_output = 1`` (with ``return_z_loss`` also the
    z-loss, with ``return_stats`` the confidence and prediction, none of them differentiable); backward: that slice
    scaled by ``grad_output`` (a scalar, or per row for ``reduction="none"``)."""

    @staticmethod
    def forward(ctx, local_logits, target, sample_weight, gamma, class_weight, offset, options, gamma_value,
                reduction, group, return_z_loss):
        gamma_grad = gamma is not None and ctx.needs_input_grad[3] and options.mode == "loss"
        loss, z_loss, grad, gamma_factor, stats = _run(local_logits, target, sample_weight, gamma, class_weight,
                                                       offset, options, gamma_value, reduction, group, True,
                                                       gamma_grad)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad.to(local_logits.dtype),
                              None if gamma_factor is None else gamma_factor.to(gamma.dtype))
        extra = ((z_loss,) if return_z_loss else ()) + (tuple(stats) if stats is not None else ())
        if not extra:
            return loss
        ctx.mark_non_differentiable(*extra)
        return (loss, *extra)

    @staticmethod
    def backward(ctx, grad_loss, *_other_grads):
        grad, gamma_factor = ctx.saved_tensors
        _autograd.raise_if_create_graph(grad, _DOUBLE_BACKWARD_MESSAGE)
        d_logits = _autograd.scale_saved_gradient(grad, grad_loss)
        d_gamma = None
        if gamma_factor is not None and grad_loss is not None:
            d_gamma = gamma_factor * grad_loss.to(gamma_factor.dtype)
        return d_logits, None, None, d_gamma, None, None, None, None, None, None, None


def _run(local_logits, target, sample_weight, gamma, class_weight, offset, options, gamma_value, reduction, group,
         compute_grad, gamma_grad):
    """``(loss, z_loss or None, grad or None, gamma_factor or None, stats or None)`` in the compute dtype, the loss
    and z-loss reduced over the whole (replicated) batch and the gradient already scaled by the reduction."""
    compute_dtype = torch.float64 if local_logits.dtype == torch.float64 else torch.float32
    z = local_logits.detach().to(compute_dtype)
    gamma_arg = gamma_value if gamma is None else gamma.detach().to(compute_dtype)
    valid = target != options.ignore_index
    class_weight_y = None
    if class_weight is not None:  # w_y from the global target: every rank holds the whole (C,) weight
        class_weight_y = class_weight.to(compute_dtype)[torch.where(valid, target, torch.zeros_like(target))]
    ce_scale = z_scale = None
    if reduction == "mean":
        z_scale = 1.0 / valid.sum().clamp(min=1).to(compute_dtype)
        ce_scale = z_scale
        if class_weight_y is not None:  # F.cross_entropy's weighted mean: over Σ w_y of the non-ignored rows, 0 if 0
            divisor = torch.where(valid, class_weight_y, torch.zeros_like(class_weight_y)).sum()
            positive = divisor > 0
            ce_scale = torch.where(positive, 1.0 / torch.where(positive, divisor, torch.ones_like(divisor)),
                                   torch.zeros_like(divisor))
    row_loss, z_rows, grad, gamma_factor, stats = vocab_parallel_rows(
        z, target, sample_weight, gamma_arg, offset, options, group, class_weight_y=class_weight_y,
        ce_scale=ce_scale, z_scale=z_scale, compute_grad=compute_grad, gamma_grad=gamma_grad)
    loss, z_loss = _reduce(row_loss, reduction, ce_scale), None
    if z_rows is not None:
        z_loss = _reduce(z_rows, reduction, z_scale)
        if options.lse_square_scale != 0.0:
            loss = loss + z_loss
    return loss, z_loss, grad, gamma_factor, stats


def _reduce(rows, reduction, scale):
    """The rows (ignored ones 0) as they are (``"none"``), summed, or their sum times ``scale`` (``"mean"``; a
    weighted mean whose divisor is 0 has scale 0 and is 0 whatever the rows hold)."""
    if reduction == "none":
        return rows
    if reduction == "sum":
        return rows.sum()
    return torch.where(scale > 0, rows.sum() * scale, torch.zeros_like(scale))


def _local_arguments(local_logits, target, uncertainty, mode, gamma, norm, sample_weight, weight, reduction,
                     ignore_index, return_stats, drop_in_options):
    """The checks that need no other rank (types, shapes, names, values), and what the call needs from them."""
    if isinstance(weight, str):
        check_class_weight(weight)  # an uncertainty name under the former keyword: its TypeError
    check_return_stats(return_stats)
    drop_in = check_drop_in_options(**drop_in_options)
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
    class_weight = _checked_class_weight(weight, local_logits)
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
                             sample_weight, gamma_tensor, return_stats, drop_in, class_weight)
    row_tensors = [(name, t) for name, t in (("sample_weight", sample_weight), ("per-sample gamma", gamma_tensor))
                   if t is not None]
    options = RowOptions(uncertainty, mode, float(norm), ignore_index, drop_in["lse_square_scale"],
                         drop_in["lse_square_scale"] != 0.0 or drop_in["return_z_loss"], drop_in["softcap"],
                         return_stats)
    return (batch_shape, num_local, logits2d, target1d, device, sample_weight, gamma_tensor, gamma_value, class_weight,
            settings, row_tensors, options)


def _checked_class_weight(weight, local_logits):
    """The per-class weights checked as :func:`calibkernels._validation.check_class_weight_tensor` does, except their
    length: that is ``C``, the sum of every rank's block, which :func:`_block_layout` finds (and
    :func:`vocab_parallel_uncertainty_weighted_ce` then compares)."""
    if isinstance(weight, torch.Tensor) and weight.dim() != 1:
        raise ValueError(f"weight (the per-class weights) must have shape (C,), one entry per class of all ranks' "
                         f"blocks, got {tuple(weight.shape)}")
    length = weight.shape[0] if isinstance(weight, torch.Tensor) else 0
    return check_class_weight_tensor(weight, local_logits.new_empty((0, length)))


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
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    softcap: float | None = None,
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
        weight: ``F.cross_entropy``'s per-class weights: the **whole** ``(C,)`` floating tensor (finite, ``>= 0``)
            over every rank's classes, the same on every rank (its length and a checksum of its values are
            compared), on ``local_logits``'s device; each rank reads ``w_y`` of the global targets, without more
            communication. ``L_i = u_i · w_{y_i} · CE_i`` with ``u_i`` as without ``weight``, and ``"mean"`` divides
            by ``Σ w_y`` over the non-ignored rows (0 if that is 0), as :func:`calibkernels.uncertainty_weighted_ce`.
        lse_square_scale, return_z_loss, softcap: as in :func:`calibkernels.uncertainty_weighted_ce`: the z-loss
            ``s · lse_i²`` (``lse`` of the whole row, from the loss's own global max and sum) added to each
            non-ignored row outside both weights, ``"mean"`` over the non-ignored rows; ``(loss, z_loss)`` with the
            z-loss detached; the logits capped to ``c · tanh(z / c)`` on each rank's block first (gradient through
            the cap).
        uncertainty, mode, gamma, norm, sample_weight, reduction, ignore_index: as in
            :func:`calibkernels.uncertainty_weighted_ce`; all of them, and the dtype of ``local_logits``, must be
            the same on every rank (checked, values of ``sample_weight`` and a per-sample ``gamma`` included). A
            per-sample ``gamma`` that requires grad gets ``∂L/∂γ_i = L_i log(1 − p_{i,y})``
            (times the reduction's scale) in ``mode="loss"``, on every rank.
        return_stats: also return a :class:`calibkernels.LossStats` of the unsharded logits, the same on every rank:
            ``(loss, stats)``. ``confidence = 1 / Σ_k e^{z_k − m}`` from the loss's own global max and sum, and
            ``prediction`` the lowest global index of a maximum (whichever ranks hold it), from one more all-reduce
            (MIN) of ``N`` integers; NaN / -1 on ignored rows (docs/metrics.md, "Monitor calibration while
            training"). Equal to :func:`calibkernels.loss_stats.top_label_stats` of the unsharded logits, the
            confidence up to the order of the sum's terms. With ``softcap`` they are of the logits as given (not
            capped), as the reference's are: their max and sum then join rounds 1 and 3.

    Returns:
        the same loss on every rank, in ``local_logits``' dtype (a scalar, or ``target``-shaped for ``"none"``);
        ``backward`` gives each rank its slice ``∂L/∂z[..., o_r : o_r + C_r]`` of the unsharded gradient. With
        ``return_z_loss``, ``(loss, z_loss)``; with ``return_stats``, ``stats`` last (``(loss, stats)`` or ``(loss,
        z_loss, stats)``).

    Raises ``ValueError`` on every rank alike when the ranks' row counts, arguments or targets differ, or no rank
    holds a class. The checks that need no other rank (types, shapes, names, values) raise their own error on the
    rank that fails them, which first tells the others in the call's first collective: they raise a ``ValueError``
    naming that rank instead of waiting for it. Communication per call: one ``all_gather`` of 18 integers, an
    all-reduce (MAX) of ``2N`` integers (``2N`` more per optional tensor) with more than one rank, then all-reduces
    of ``2N`` (MAX; ``3N`` with ``softcap`` and ``return_stats``), ``N`` (MAX, dual focal only) and ``2N``–``4N``
    numbers (SUM), and with ``return_stats`` one of ``N`` integers (MIN). The targets (and the per-class weights)
    are checked on the host (a synchronisation on GPU). Double backward is not supported.
    """
    try:
        (batch_shape, num_local, logits2d, target1d, device, sample_weight, gamma_tensor, gamma_value, class_weight,
         settings, row_tensors, options) = _local_arguments(
            local_logits, target, uncertainty, mode, gamma, norm, sample_weight, weight, reduction, ignore_index,
            return_stats, dict(lse_square_scale=lse_square_scale, return_z_loss=return_z_loss, softcap=softcap))
    except (TypeError, ValueError, NotImplementedError):
        _share_refusal(local_logits, group)  # the other ranks raise too, in the collective they are waiting in
        raise
    offset, num_classes = _block_layout(num_local, target1d, group, device, settings, row_tensors)
    if class_weight is not None and class_weight.shape[0] != num_classes:  # the same length on every rank (checked)
        raise ValueError(f"weight (the per-class weights) must have shape ({num_classes},), one entry per class of "
                         f"all ranks' blocks (C = {num_classes}), got {tuple(class_weight.shape)}")
    bad = out_of_range_targets(target1d, num_classes, ignore_index)
    if bool(bad.any()):
        raise ValueError(out_of_range_message(int(target1d[bad][0]), num_classes, ignore_index))
    if sample_weight is not None:
        sample_weight = sample_weight.detach()
    class_weight = None if class_weight is None else class_weight.detach()

    grad_enabled = torch.is_grad_enabled()
    if grad_enabled and (logits2d.requires_grad or (gamma_tensor is not None and gamma_tensor.requires_grad)):
        out = _VocabParallelUWCE.apply(logits2d, target1d, sample_weight, gamma_tensor, class_weight, offset, options,
                                       gamma_value, reduction, group, return_z_loss)
        out = out if isinstance(out, tuple) else (out,)
        loss, z_loss = out[0], out[1] if return_z_loss else None
        stats = LossStats(*out[-2:]) if return_stats else None
    else:
        loss, z_loss, _, _, stats = _run(logits2d, target1d, sample_weight, gamma_tensor, class_weight, offset,
                                         options, gamma_value, reduction, group, False, False)
    outputs = (loss, z_loss) if return_z_loss else (loss,)
    outputs = tuple((x.reshape(batch_shape) if reduction == "none" else x).to(local_logits.dtype) for x in outputs)
    if return_stats:
        outputs += (LossStats(stats.confidence.reshape(batch_shape), stats.prediction.reshape(batch_shape)),)
    return outputs[0] if len(outputs) == 1 else outputs
