"""Pure-PyTorch reference of the calibration loss family (formulas and defaults: ``docs/losses.md``). Every fast
kernel is tested against this module.

All computation happens in float32 (float64 stays float64, for ``gradcheck``), on any device; results come back in the
input dtype, as ``torch.nn.functional.cross_entropy`` does.  Gradients come from autograd, so the reference is the
independent check of the kernels' hand-written backward.

The family is ``L_i = u_i · CE_i`` with ``CE_i = logsumexp(z_i) - z_{i,y_i}`` and a per-sample uncertainty weight
``u_i = u(p_i, y_i)``:

==============  ===============================================  ==========================================
uncertainty     u(p, y)                                           source
==============  ===============================================  ==========================================
``none``        1                                                 plain cross-entropy
``focal``       (1 - p_y)^γ                                       Lin et al. 2017; Mukhoti et al. 2020
``flsd``        (1 - p_y)^γ_i, γ_i = 5 / 3 / γ for p_y < .2/.5/≥  Mukhoti et al. 2020 (FLSD-53 with γ = 3)
``dual_focal``  (1 - p_y + p_j)^γ, p_j = max{p_k : z_k < z_y}     Tao, Dong, Xu, ICML 2023
``brier``       ‖p - e_y‖_q^γ = (Σ_k |p_k - e_{y,k}|^q)^{γ/q}       BSCE-GRA paper, Eq. 3/11
``brier_flsd``  ‖p - e_y‖_q^γ_i, γ_i = 5 / 3 / γ as for ``flsd``         BSCE-GRA code (``BSCELossAdaptiveGra``)
``external``    sg[w_i] (user-supplied, always detached)          BSCE-GRA paper §4.2
==============  ===============================================  ==========================================

``mode="loss"`` differentiates through ``u`` (classic focal/dual-focal/BSCE); ``mode="grad"`` uses ``sg[u]``, so the
gradient is exactly ``u_i (p_i - e_{y_i})`` (the GRA losses). Dual focal in grad mode also has the official BSCE-GRA
code's form, ``gra_detach="p_j"``: ``(1 - p_y + sg[p_j])^γ · CE`` (only ``p_j`` detached; reference only).

Numerics (shared by every weight):

* ``1 - p_y`` is never a difference: it is ``Σ_{k≠y} p_k``, computed in the log domain as
  ``log(1 - p_y) = logsumexp_{k≠y} log p_k``, so confident rows keep full relative precision; below ``p_y = 1/2``
  it is ``log1p(-p_y)``, which keeps a small ``p_y`` that the sum of the others, rounded to 1, would lose.
* Every power ``x^a`` is taken from ``log x`` (:func:`_power_of_log`): its derivative ``a x^{a-1} dx =
  a x^a d(log x)`` is then finite for every ``a ≥ 0``, including ``a < 1`` at ``x → 0`` (a saturated row, where
  ``1 - p_y`` or a ``p_k`` underflows), where a plain ``pow`` backward gives ``inf · 0 = NaN``. At ``x = 0`` exactly the
  derivative is the limit 0 (``d(log x)/dz`` is bounded: ``|d log p_k / dz|_1 ≤ 2``).
* FLSD's band follows one float32 rule shared with the kernels (:func:`_flsd_gamma`); dual focal's ``p_j`` and its
  ties are decided on the logits (:func:`uncertainty_weight`).

Soft targets (``docs/losses.md``, "Soft targets"): a target distribution ``t_i`` per row, from class indices mixed by
``mix_target``/``mix_lambda`` (mixup, cutmix), from dense probabilities ``(..., C)``, and/or label smoothing
``t <- (1 - α) t + α / C``. Then ``CE_i = -Σ_k t_ik log p_ik`` and the weights generalise as
``focal: (1 - <t, p>)^γ``, ``flsd: (1 - <t, p>)^γ_i`` with the band of ``<t, p>``, ``brier: ‖p - t‖_q^γ``,
``brier_flsd: ‖p - t‖_q^γ_i`` with the band of ``<t, p>``
(:func:`soft_uncertainty_weight`); dual focal has no soft form and refuses non-one-hot targets. One-hot class-index
targets without smoothing run the hard-target code above, unchanged.

``F.cross_entropy`` / Liger-Kernel options (``docs/losses.md``, "Coming from F.cross_entropy / Liger-Kernel"):
per-class weights ``weight`` give ``L_i = u_i · CE_i^w`` with ``F.cross_entropy``'s weighted row and mean
(:func:`_class_weighted`); the z-loss ``s · logsumexp(z_i)^2`` (``lse_square_scale``) is added to each non-ignored
row outside both weights (:func:`_plus_z_loss`); ``softcap`` replaces the logits by ``c · tanh(z / c)`` first.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ._kernel_codes import FLSD_LOW_GAMMA, FLSD_LOW_THRESHOLD, FLSD_MID_GAMMA, FLSD_MID_THRESHOLD
from ._validation import (DUAL_FOCAL_SOFT_MESSAGE, LossInputs, check_backend, check_logits_target, check_loss_inputs,
                          check_number, check_reduction, one_hot_for_dual_focal)
from .loss_stats import check_return_stats, loss_stats_of_inputs

__all__ = [
    "uncertainty_weight",
    "soft_uncertainty_weight",
    "compact_flsd_band",
    "soft_target_distribution",
    "uncertainty_weighted_ce",
    "uncertainty_weighted_ce_from_inputs",
    "bsce_gra_loss",
    "brier_loss",
    "label_smoothing_loss",
    "mmce",
    "mmce_loss",
    "check_mmce_hyperparameters",
    "GRA_DETACH",
    "check_gra_detach",
    "MMCE_FORMS",
    "check_mmce_form",
]

# FLSD-53's thresholds (calibkernels._kernel_codes) as float32 numbers, 0.2f = 0.20000000298... and 0.5f, which the
# band's
# float32 p_y is compared with.
_FLSD_LOW_THRESHOLD_F32 = float(torch.tensor(FLSD_LOW_THRESHOLD, dtype=torch.float32))
_FLSD_MID_THRESHOLD_F32 = float(torch.tensor(FLSD_MID_THRESHOLD, dtype=torch.float32))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _masked_rows(logits2d, target1d, ignore_index):
    """Return (valid mask, logits in compute dtype with ignored rows zeroed, target with ignored rows set to 0).

    Zeroing ignored rows keeps their (discarded) loss finite, so no NaN can leak into the gradient through
    ``torch.where``'s backward.
    """
    valid = target1d != ignore_index
    z = logits2d.to(_compute_dtype(logits2d.dtype))
    z = torch.where(valid[:, None], z, torch.zeros((), dtype=z.dtype, device=z.device))
    safe_target = torch.where(valid, target1d, torch.zeros_like(target1d))
    return valid, z, safe_target


def _reduce(per_row, valid, reduction, batch_shape, out_dtype):
    return _as_output(_reduce_rows(per_row, valid, reduction), reduction, batch_shape, out_dtype)


def _reduce_rows(per_row, valid, reduction, divisor=None):
    """``per_row (N,)`` with ignored rows zeroed (``"none"``), summed, or its mean in the compute dtype: the sum over
    ``divisor`` (a 0-dim tensor; the class-weighted means), or by default over the non-ignored rows. A mean whose
    divisor is 0 (every row ignored, or every target class weighted 0) is 0, not NaN."""
    per_row = torch.where(valid, per_row, torch.zeros((), dtype=per_row.dtype, device=per_row.device))
    if reduction == "none":
        return per_row
    total = per_row.sum()
    if reduction == "sum":
        return total
    if divisor is None:
        return total / valid.sum().clamp_min(1)
    # the division sees a divisor of 1 where it is 0, so that where's backward meets no 0/0 in the unused branch
    positive = divisor > 0
    return torch.where(positive, total / torch.where(positive, divisor, torch.ones_like(divisor)),
                       torch.zeros_like(total))


def _as_output(reduced, reduction, batch_shape, out_dtype):
    return (reduced.reshape(batch_shape) if reduction == "none" else reduced).to(out_dtype)


def _soft_capped(z, softcap):
    """Gemma-2's logit soft-capping ``c · tanh(z / c)`` of ``z`` (compute dtype), or ``z`` itself (``softcap=None``).
    Applied to the masked logits, so an ignored row (zeroed) stays 0 and passes no gradient."""
    return z if softcap is None else softcap * torch.tanh(z / softcap)


def _flsd_gamma(z, target, gamma):
    """FLSD-53's sample-dependent ``γ_i (N,)`` for logits ``z (N, C)`` in the compute dtype (never differentiated).

    The band is a step function of ``p_y``, so every implementation must compute the same ``p_y`` at the thresholds;
    the rule, which the C++, CUDA and Triton kernels follow too, is::

        p_band = float32( exp(z_y - lse) ),   lse = logsumexp_k z_k      (both in the compute dtype: float32 for
                                                                          float32/float16/bfloat16 logits, float64
                                                                          for float64, then rounded to float32)
        γ_i = 5 if p_band < 0.2f,  3 if p_band < 0.5f,  γ otherwise      (0.2f, 0.5f: the float32 thresholds)

    E.g. five equal logits: float32 ``exp(-logf(5)) = 0.19999999f < 0.2f`` gives γ_i = 5; in float64
    ``exp(-log 5)`` rounds to ``0.2f``, γ_i = 3. Thresholds and the Lambert-W argument for 5: Mukhoti et al. 2020
    (``docs/losses.md``, "flsd").
    """
    z = z.detach()
    p_band = torch.exp(z.gather(1, target[:, None]).squeeze(1) - torch.logsumexp(z, dim=1)).float()
    high = torch.full_like(z[:, 0], float(gamma))
    mid = torch.full_like(high, FLSD_MID_GAMMA)
    low = torch.full_like(high, FLSD_LOW_GAMMA)
    return torch.where(p_band < _FLSD_LOW_THRESHOLD_F32, low, torch.where(p_band < _FLSD_MID_THRESHOLD_F32, mid, high))


def _flsd_band(p_band, gamma, dtype):
    """γ_i from a float32 ``p_band (N,)`` by :func:`_flsd_gamma`'s rule (soft targets: ``p_band = <t, p>``)."""
    high = torch.full(p_band.shape, float(gamma), dtype=dtype, device=p_band.device)
    mid = torch.full_like(high, FLSD_MID_GAMMA)
    low = torch.full_like(high, FLSD_LOW_GAMMA)
    return torch.where(p_band < _FLSD_LOW_THRESHOLD_F32, low, torch.where(p_band < _FLSD_MID_THRESHOLD_F32, mid, high))


def _logsumexp_or_neg_inf(x, dim):
    """``logsumexp(x, dim)``, ``-inf`` where every entry is ``-inf``, with a zero (not NaN) gradient there."""
    some_finite = (x > -math.inf).any(dim=dim)
    safe = torch.where(some_finite.unsqueeze(dim), x, torch.zeros((), dtype=x.dtype, device=x.device))
    return torch.where(some_finite, torch.logsumexp(safe, dim=dim),
                       torch.full((), -math.inf, dtype=x.dtype, device=x.device))


def _power_of_log(log_x, exponent):
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


def uncertainty_weight(z, target, *, uncertainty, gamma, norm, sample_weight=None, detach_p_j=False):
    """Differentiable per-row weight ``u_i (N,)`` for logits ``z (N, C)`` (compute dtype) and targets ``(N,)``.

    ``detach_p_j`` (dual focal only): ``(1 - p_y + sg[p_j])^γ``, the weight of the official BSCE-GRA code's
    ``DualFocalLossGra``; the gradient still flows through ``p_y``.

    Formulas: the module docstring and ``docs/losses.md`` ("The weights"). ``1 - p_y = Σ_{k≠y} p_k`` is taken in the
    log domain (``log1p(-p_y)`` below ``p_y = 1/2``), and every power through :func:`_power_of_log`, so the weight
    and its gradient stay exact and finite on saturated rows (``p_y = 1`` to working precision) for every exponent
    ``≥ 0``.
    """
    if uncertainty == "none":
        return torch.ones(z.shape[0], dtype=z.dtype, device=z.device)
    if uncertainty == "external":
        return sample_weight.detach().to(z.dtype)
    if isinstance(gamma, torch.Tensor):
        gamma = gamma.to(z.dtype)
    log_p = torch.log_softmax(z, dim=-1)
    is_target = F.one_hot(target, z.shape[1]).bool()
    neg_inf = torch.full((), -math.inf, dtype=z.dtype, device=z.device)
    # log(1 - p_y): log Σ_{k≠y} p_k where p_y ≥ 1/2 (no cancellation as p_y → 1; -inf for a single class), and
    # log1p(-p_y) below, where that sum rounds to 1 and loses a small p_y (p_y is masked to 0 where unused, so that
    # log1p's derivative stays finite on saturated rows)
    log_p_y = log_p.gather(1, target[:, None]).squeeze(1)
    small = log_p_y < -math.log(2.0)
    log_one_minus_p_target = torch.where(
        small, torch.log1p(-torch.exp(torch.where(small, log_p_y, neg_inf))),
        _logsumexp_or_neg_inf(torch.where(is_target, neg_inf, log_p), dim=1))
    if uncertainty == "focal":
        return _power_of_log(log_one_minus_p_target, gamma)
    if uncertainty == "flsd":
        return _power_of_log(log_one_minus_p_target, _flsd_gamma(z, target, gamma))
    if uncertainty == "dual_focal":
        # p_j: the largest probability strictly below p_y (0 if none), log p_j = z_j - lse with z_j the largest logit
        # strictly below z_y. Logits order classes as probabilities do, without softmax rounding merging distinct
        # values into ties; amax splits p_j's gradient evenly between tied classes, as the kernels do. The max is
        # taken over the logits themselves, not over softmax(z): Inductor (CPU) recomputes softmax's exp in the
        # backward through another exp than the forward's (vector vs scalar path, 1 ulp apart), so amax's backward
        # mask `p == max(p)` could match no class and divide by a zero count: NaN gradients
        # (pytorch/pytorch#186799, fix proposed in pytorch/pytorch#186953).
        z_target = z.gather(1, target[:, None])
        z_below_max = torch.where(z < z_target, z, neg_inf).amax(dim=1)
        log_p_j = z_below_max - torch.logsumexp(z, dim=1)
        if detach_p_j:
            log_p_j = log_p_j.detach()
        log_base = _logsumexp_or_neg_inf(torch.stack([log_one_minus_p_target, log_p_j], dim=1), dim=1)
        return _power_of_log(log_base, gamma)
    if uncertainty in ("brier", "brier_flsd"):
        # ‖p - e_y‖_q^q = Σ_{k≠y} p_k^q + (1 - p_y)^q  (no cancellation in p_y - 1), summed in the log domain
        log_terms = torch.where(is_target, norm * log_one_minus_p_target[:, None], norm * log_p)
        exponent = _flsd_gamma(z, target, gamma) if uncertainty == "brier_flsd" else gamma
        return _power_of_log(_logsumexp_or_neg_inf(log_terms, dim=1), exponent / norm)
    raise ValueError(f"unknown uncertainty {uncertainty!r}")


def uncertainty_weighted_ce(
    logits,
    target,
    *,
    uncertainty="brier",
    mode="grad",
    gamma=4.0,
    norm=2.0,
    sample_weight=None,
    weight=None,
    reduction="mean",
    ignore_index=-100,
    backend="reference",
    label_smoothing=0.0,
    mix_target=None,
    mix_lambda=None,
    gra_detach="weight",
    lse_square_scale=0.0,
    return_z_loss=False,
    softcap=None,
    return_stats=False,
):
    """Uncertainty-weighted cross-entropy ``L_i = u_i · CE_i`` (``mode="loss"``) or ``sg[u_i] · CE_i`` (``"grad"``).

    Args:
        logits: ``(..., C)`` float tensor (class dimension last).
        target: ``(...)`` int64 class indices in ``[0, C)`` or ``ignore_index``; or a floating ``(..., C)`` tensor of
            probabilities (each row ≥ 0, summing to 1), as ``F.cross_entropy`` accepts (no ``ignore_index`` then).
        label_smoothing: α in [0, 1]: ``t <- (1 - α) t + α / C`` (``F.cross_entropy``'s convention).
        mix_target, mix_lambda: ``(...)`` int64 second class and λ in [0, 1] (a number, or one per row):
            ``t = λ e_target + (1 - λ) e_mix_target`` (mixup / cutmix with ``mix_target = target.flip(0)``).
        uncertainty: the uncertainty weight ``u``, ``"none" | "focal" | "flsd" | "dual_focal" | "brier" |
            "external" | "brier_flsd"`` (table in the module docstring; FLSD's band rule, which ``brier_flsd``
            shares: :func:`_flsd_gamma`).
        mode: ``"grad"`` (GRA: weight detached, gradient ``u (p - e_y)``) or ``"loss"`` (weight differentiated).
        gamma: exponent γ, finite and ≥ 0; for ``uncertainty="focal"`` also a per-sample tensor of the target's shape
            (differentiable: ``dL_i/dγ_i = L_i log(1 - p_{i,y})``, 0 where ``1 - p_y = 0``).
        norm: q > 0 of the generalised Brier score (``uncertainty="brier"`` or ``"brier_flsd"``).
        sample_weight: ``(...)`` per-sample weight for ``uncertainty="external"``, used as ``sg[w]``.
        weight: ``F.cross_entropy``'s per-class weights, a floating ``(C,)`` tensor (finite, ``>= 0``) or ``None``:
            ``L_i = u_i · CE_i^w`` with ``CE_i^w`` the row of ``F.cross_entropy(weight=w, reduction="none")``
            (``w_y · CE_i`` for class indices; ``-Σ_k w_k t_k log p_k`` for smoothed, mixed or dense targets);
            ``u_i`` is computed from the unweighted target as without ``w``. ``"mean"`` divides by ``Σ w_y`` over
            the non-ignored rows (class indices, smoothed or not), by ``Σ (λ w_y + (1 - λ) w_mix_target)`` for a
            mix, by N for dense targets (:func:`_class_weighted`).
        reduction: ``"mean"`` (over non-ignored rows; 0 if none), ``"sum"`` or ``"none"`` (ignored rows → 0).
        lse_square_scale: z-loss scale ``s >= 0`` (Liger-Kernel's name): ``s · logsumexp(z_i)^2`` is added to each
            non-ignored row outside the uncertainty weight and the class weight; ``"mean"`` divides it by the
            number of non-ignored rows.
        return_z_loss: return ``(loss, z_loss)``, the z-loss reduced as the loss is (and included in it), detached.
        softcap: ``None`` or ``c > 0``: the logits become ``c · tanh(z / c)`` before anything else (Gemma-2).
        gra_detach: what grad mode detaches. ``"weight"`` (default; the BSCE-GRA paper's definition of GRA,
            every weight): ``sg[u] · CE``. ``"p_j"`` (``uncertainty="dual_focal"``, ``mode="grad"`` only; the official
            BSCE-GRA code's ``DualFocalLossGra``, which produced the paper's DFL-GRA numbers):
            ``(1 - p_y + sg[p_j])^γ · CE``, so the gradient is ``u (p - e_y) + CE · ∂u/∂z`` with ``∂u/∂z_k =
            -γ (1 - p_y + p_j)^{γ-1} p_y (δ_ky - p_k)``. The fused kernels implement ``"weight"`` only.
        backend: accepted for signature parity with :func:`calibkernels.uncertainty_weighted_ce`; must be
            ``"reference"`` or ``"auto"``.
        return_stats: also return the logits' top-label statistics (:func:`calibkernels.loss_stats.top_label_stats`).

    Returns:
        the loss in the logits' dtype: a scalar, or ``target``-shaped for ``reduction="none"``; with
        ``return_z_loss=True`` a pair ``(loss, z_loss)``; with ``return_stats=True`` also ``stats`` last (``(loss,
        stats)`` or ``(loss, z_loss, stats)``), a :class:`calibkernels.LossStats` of the target's batch shape
        (confidence ``max_k p_k`` in float32, prediction ``argmax_k z_k``; NaN / -1 on ignored rows).
    """
    check_backend(backend)
    if backend not in ("reference", "auto"):
        raise ValueError(f"calibkernels.reference only runs backend='reference', not {backend!r}")
    inputs = check_loss_inputs(
        logits, target, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=norm, sample_weight=sample_weight,
        weight=weight, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
        mix_target=mix_target, mix_lambda=mix_lambda, lse_square_scale=lse_square_scale, return_z_loss=return_z_loss,
        softcap=softcap, class_weight_supported=True,
    )
    detach_p_j = check_gra_detach(gra_detach, uncertainty=inputs.uncertainty, mode=inputs.mode) == "p_j"
    return uncertainty_weighted_ce_from_inputs(inputs, detach_p_j=detach_p_j,
                                               return_stats=check_return_stats(return_stats))


GRA_DETACH = ("weight", "p_j")


def check_gra_detach(gra_detach, *, uncertainty, mode):
    """``gra_detach`` is ``"weight"`` (any loss) or ``"p_j"`` (dual focal in grad mode only); returns it."""
    if not isinstance(gra_detach, str):
        raise TypeError(f"gra_detach must be one of {GRA_DETACH}, got {type(gra_detach).__name__}")
    if gra_detach not in GRA_DETACH:
        raise ValueError(f"gra_detach must be one of {GRA_DETACH}, got {gra_detach!r}")
    if gra_detach == "p_j" and (uncertainty != "dual_focal" or mode != "grad"):
        raise ValueError(f"gra_detach='p_j' (the official DualFocalLossGra) needs uncertainty='dual_focal' and "
                         f"mode='grad', got uncertainty={uncertainty!r}, mode={mode!r}")
    return gra_detach


def uncertainty_weighted_ce_from_inputs(inputs: LossInputs, detach_p_j=False, return_stats=False):
    """:func:`uncertainty_weighted_ce` of inputs already validated by
    :func:`calibkernels._validation.check_loss_inputs` (what the ``"reference"`` backend runs); ``detach_p_j``: dual
    focal's official-code GRA, ``(1 - p_y + sg[p_j])^γ · CE`` (weight not detached as a whole); ``return_stats``:
    the statistics last (:func:`calibkernels.loss_stats.loss_stats_of_inputs`)."""
    if return_stats:
        loss = uncertainty_weighted_ce_from_inputs(inputs, detach_p_j=detach_p_j)
        stats = loss_stats_of_inputs(inputs)
        return (*loss, stats) if isinstance(loss, tuple) else (loss, stats)
    # a dense target's class-weighted mean divides by N (F.cross_entropy's rule), also where dual focal reads its
    # one-hot rows as class indices below
    dense = inputs.dense
    if inputs.soft:
        if inputs.uncertainty == "dual_focal":
            inputs = one_hot_for_dual_focal(inputs)
        if inputs.soft:
            return _soft_target_ce(inputs)
    valid, z, safe_target = _masked_rows(inputs.logits, inputs.target, inputs.ignore_index)
    z = _soft_capped(z, inputs.softcap)
    # -log_softmax rather than logsumexp(z) - z_y (equal in exact arithmetic): log_softmax subtracts the row max
    # first, so a confident row's CE carries an absolute error of an ulp of 1, as F.cross_entropy's does, not an ulp
    # of the logits (1e-4 at logits near 1000 in float32), and the backends' tests measured against it stay tight
    cross_entropy = -torch.log_softmax(z, dim=-1).gather(1, safe_target[:, None]).squeeze(1)
    divisor = None
    if inputs.class_weight is not None:
        weight_of_target = inputs.class_weight.to(z.dtype)[safe_target]
        cross_entropy = weight_of_target * cross_entropy
        if not dense:
            divisor = torch.where(valid, weight_of_target, torch.zeros_like(weight_of_target)).sum()
    return _weighted_reduced(inputs, valid, cross_entropy, lambda sample_weight: uncertainty_weight(
        z, safe_target, uncertainty=inputs.uncertainty, gamma=inputs.gamma, norm=inputs.norm,
        sample_weight=sample_weight, detach_p_j=detach_p_j), detach_weight=not detach_p_j, z=z, divisor=divisor)


def _weighted_reduced(inputs: LossInputs, valid, cross_entropy, weight_of, detach_weight=True, *, z, divisor=None):
    """``reduce(u · CE)`` with ``u = weight_of(sample_weight with ignored rows zeroed)``, detached in grad mode
    (unless ``detach_weight=False``: the weight then detaches what it must itself), plus the z-loss of the
    (capped) logits ``z`` (:func:`_plus_z_loss`); ``"mean"`` divides ``u · CE`` by ``divisor`` where given."""
    sample_weight = inputs.sample_weight
    if sample_weight is not None:
        sample_weight = torch.where(valid, sample_weight, torch.zeros((), dtype=sample_weight.dtype,
                                                                       device=sample_weight.device))
    u = weight_of(sample_weight)
    if inputs.mode == "grad" and detach_weight:
        u = u.detach()
    return _plus_z_loss(inputs, valid, _reduce_rows(u * cross_entropy, valid, inputs.reduction, divisor), z)


def _plus_z_loss(inputs: LossInputs, valid, reduced_loss, z):
    """The reduced loss plus the reduced z-loss ``s · lse_i²`` (``s = lse_square_scale``, ``lse_i =
    logsumexp(z_i)`` of the capped logits) over the non-ignored rows, in the logits' dtype; ``(loss, z_loss)`` with
    ``return_z_loss``. The z-loss's gradient ``2 s lse_i p_i`` comes by autograd; it is neither uncertainty- nor
    class-weighted (as in Liger-Kernel), and its ``"mean"`` divides by the non-ignored rows whatever the class
    weights. The returned ``z_loss`` is detached: the loss already carries its gradient."""
    scale = inputs.lse_square_scale
    z_loss = None
    if scale != 0.0 or inputs.return_z_loss:
        z_loss = _reduce_rows(scale * torch.logsumexp(z, dim=1).square(), valid, inputs.reduction)
        if scale != 0.0:
            reduced_loss = reduced_loss + z_loss
    loss = _as_output(reduced_loss, inputs.reduction, inputs.batch_shape, inputs.logits.dtype)
    if not inputs.return_z_loss:
        return loss
    return loss, _as_output(z_loss.detach(), inputs.reduction, inputs.batch_shape, inputs.logits.dtype)


def soft_target_distribution(z, target, *, valid=None, mix_target=None, mix_lambda=None, label_smoothing=0.0,
                             dense=False):
    """The target distribution ``t (N, C)`` in ``z``'s dtype (``docs/losses.md``, "Soft targets").

    Class indices ``target (N,)`` (ignored rows already replaced by a valid class; ``valid`` marks the others):
    ``t = λ e_target + (1 - λ) e_mix_target`` with ``mix_lambda`` a number or ``(N,)``; a dense ``target (N, C)`` is
    used as given. Then label smoothing: ``t <- (1 - α) t + α / C`` (``F.cross_entropy``'s; mixing and smoothing
    commute). ``t`` is a constant (no gradient).
    """
    num_classes = z.shape[1]
    if dense:
        t = target.detach().to(z.dtype)
    else:
        t = F.one_hot(target, num_classes).to(z.dtype)
        if mix_target is not None:
            safe_mix = mix_target if valid is None else torch.where(valid, mix_target, torch.zeros_like(mix_target))
            lam = mix_lambda.to(z.dtype)[:, None] if isinstance(mix_lambda, torch.Tensor) else float(mix_lambda)
            t = lam * t + (1.0 - lam) * F.one_hot(safe_mix, num_classes).to(z.dtype)
    if label_smoothing != 0.0:
        t = (1.0 - label_smoothing) * t + label_smoothing / num_classes
    return t


def _log_one_minus_softmax(log_p):
    """``log(1 - p_k) (N, C)`` without cancellation: the arg-max class (the only one that can have ``p_k > 1/2``)
    takes ``log Σ_{j≠k} p_j``, the others ``log1p(-p_k)`` (accurate for ``p_k ≤ 1/2``)."""
    neg_inf = torch.full((), -math.inf, dtype=log_p.dtype, device=log_p.device)
    is_max = F.one_hot(log_p.argmax(dim=1), log_p.shape[1]).bool()
    at_max = _logsumexp_or_neg_inf(torch.where(is_max, neg_inf, log_p), dim=1)
    p_others = torch.where(is_max, torch.zeros((), dtype=log_p.dtype, device=log_p.device), torch.exp(log_p))
    return torch.where(is_max, at_max[:, None], torch.log1p(-p_others))


def compact_flsd_band(z, target, *, mix_target=None, mix_lambda=None, label_smoothing=0.0):
    """FLSD's band value of ``<t, p>`` for class-index (compact) soft targets, float32 ``(N,)``: the closed form every
    implementation uses (C++, CUDA and Triton kernels too), in the compute dtype of ``z (N, C)``::

        p_band = float32( (w_y exp(z_y - lse) + w_m exp(z_m - lse)) + c ),
        w_y = (1 - a) λ,   w_m = (1 - a)(1 - λ),   c = a / C      (without a mix: λ = 1, m = y)

    so that a row at a band boundary (e.g. equal logits) falls in the same band everywhere; a dense target's band is
    ``float32(Σ_k t_k exp(z_k - lse))``, equal up to summation order.
    """
    z = z.detach()
    one = torch.ones((), dtype=z.dtype, device=z.device)
    a = torch.full((), label_smoothing, dtype=z.dtype, device=z.device)
    keep = one - a
    c = a / z.shape[1]
    lse = torch.logsumexp(z, dim=1)
    p_y = torch.exp(z.gather(1, target[:, None]).squeeze(1) - lse)
    if mix_target is None:
        return (keep * p_y + c).float()
    lam = mix_lambda.to(z.dtype) if isinstance(mix_lambda, torch.Tensor) else torch.full((), mix_lambda, dtype=z.dtype,
                                                                                        device=z.device)
    p_m = torch.exp(z.gather(1, mix_target[:, None]).squeeze(1) - lse)
    return ((keep * lam * p_y + keep * (one - lam) * p_m) + c).float()


def soft_uncertainty_weight(z, t, *, uncertainty, gamma, norm, sample_weight=None, flsd_band=None):
    """Differentiable per-row weight ``u_i (N,)`` for logits ``z (N, C)`` and a target distribution ``t (N, C)``.

    ============  ==========================================================================================
    ``none``      1
    ``focal``     ``(1 - <t, p>)^γ``, with ``1 - <t, p> = Σ_k t_k (1 - p_k)`` summed in the log domain
    ``flsd``      ``(1 - <t, p>)^γ_i``; γ_i from ``float32(Σ_k t_k exp(z_k - lse))`` by :func:`_flsd_gamma`'s rule
    ``brier``     ``‖p - t‖_q^γ``; the arg-max class's ``p_k - t_k`` is taken as ``(1 - t_k) - (1 - p_k)``
    ``brier_flsd`` ``‖p - t‖_q^γ_i``, γ_i by ``flsd``'s band of ``<t, p>``
    ``external``  ``sg[w_i]``
    ============  ==========================================================================================

    With a one-hot ``t`` each equals :func:`uncertainty_weight` (up to rounding); dual focal has no soft form.
    ``flsd_band``: FLSD's float32 band value per row when the target is compact (:func:`compact_flsd_band`).
    """
    if uncertainty == "none":
        return torch.ones(z.shape[0], dtype=z.dtype, device=z.device)
    if uncertainty == "external":
        return sample_weight.detach().to(z.dtype)
    if uncertainty == "dual_focal":
        raise ValueError(DUAL_FOCAL_SOFT_MESSAGE)
    if isinstance(gamma, torch.Tensor):
        gamma = gamma.to(z.dtype)
    t = t.detach()
    neg_inf = torch.full((), -math.inf, dtype=z.dtype, device=z.device)
    log_p = torch.log_softmax(z, dim=-1)
    log_one_minus_p = _log_one_minus_softmax(log_p)
    if uncertainty in ("focal", "flsd"):
        # log(1 - <t, p>) = log Σ_k t_k (1 - p_k)   (Σ_k t_k = 1)
        log_t = torch.where(t > 0, torch.log(torch.where(t > 0, t, torch.ones_like(t))), neg_inf)
        log_base = _logsumexp_or_neg_inf(log_t + log_one_minus_p, dim=1)
        if uncertainty == "focal":
            return _power_of_log(log_base, gamma)
        return _power_of_log(log_base, _soft_flsd_gamma(z, t, gamma, flsd_band))
    if uncertainty in ("brier", "brier_flsd"):
        is_max = F.one_hot(log_p.argmax(dim=1), log_p.shape[1]).bool()
        diff = torch.where(is_max, (1.0 - t) - torch.exp(log_one_minus_p), torch.exp(log_p) - t)
        nonzero = diff != 0
        log_abs = torch.where(nonzero, torch.log(torch.where(nonzero, diff.abs(), torch.ones_like(diff))), neg_inf)
        exponent = _soft_flsd_gamma(z, t, gamma, flsd_band) if uncertainty == "brier_flsd" else gamma
        return _power_of_log(_logsumexp_or_neg_inf(norm * log_abs, dim=1), exponent / norm)
    raise ValueError(f"unknown uncertainty {uncertainty!r}")


def _soft_flsd_gamma(z, t, gamma, flsd_band=None):
    """FLSD's γ_i ``(N,)`` for soft targets: the band of ``<t, p>``, given (``flsd_band``, compact targets:
    :func:`compact_flsd_band`) or computed as ``float32(Σ_k t_k exp(z_k - lse))`` (dense targets)."""
    zd = z.detach()
    p_band = flsd_band
    if p_band is None:
        p_band = (t * torch.exp(zd - torch.logsumexp(zd, dim=1, keepdim=True))).sum(dim=1).float()
    return _flsd_band(p_band, gamma, zd.dtype)


def _soft_target_ce(inputs: LossInputs):
    """``L_i = u_i · CE_i`` with ``CE_i = -Σ_k t_ik log p_ik`` for validated soft-target inputs."""
    logits = inputs.logits
    if inputs.dense:
        valid = torch.ones(logits.shape[0], dtype=torch.bool, device=logits.device)
        z = logits.to(_compute_dtype(logits.dtype))
        target = inputs.target
    else:
        valid, z, target = _masked_rows(logits, inputs.target, inputs.ignore_index)
    z = _soft_capped(z, inputs.softcap)
    t = soft_target_distribution(z, target, valid=valid, mix_target=inputs.mix_target, mix_lambda=inputs.mix_lambda,
                                 label_smoothing=inputs.label_smoothing, dense=inputs.dense)
    cross_entropy, divisor = _class_weighted(inputs, z, t, target, valid)
    band = None
    if inputs.uncertainty in ("flsd", "brier_flsd") and not inputs.dense:
        safe_mix = None if inputs.mix_target is None else torch.where(valid, inputs.mix_target, 0)
        band = compact_flsd_band(z, target, mix_target=safe_mix, mix_lambda=inputs.mix_lambda,
                                 label_smoothing=inputs.label_smoothing)
    return _weighted_reduced(inputs, valid, cross_entropy, lambda sample_weight: soft_uncertainty_weight(
        z, t, uncertainty=inputs.uncertainty, gamma=inputs.gamma, norm=inputs.norm, sample_weight=sample_weight,
        flsd_band=band), z=z, divisor=divisor)


def _class_weighted(inputs: LossInputs, z, t, target, valid):
    """``(CE_i^w (N,), the "mean"'s divisor or None)`` for a soft target ``t (N, C)`` and per-class weights ``w``
    (``inputs.class_weight``; ``w = 1`` without)::

        CE_i^w = -Σ_k w_k t_ik log p_ik          (F.cross_entropy's row, for probability targets and smoothing)

    ``"mean"`` divides as ``F.cross_entropy`` does: by N for a dense target; for class indices by ``Σ_i <w, t̄_i>``
    over the non-ignored rows, ``t̄`` the target before smoothing: ``Σ w_y`` (``F.cross_entropy``'s divisor with
    label smoothing), and ``Σ (λ w_y + (1 - λ) w_mix_target)`` for a mix, which is linear in λ and equals the
    class-index divisor at λ = 0 and 1. ``None``: the non-ignored rows (no class weights, or a dense target).
    """
    log_p = torch.log_softmax(z, dim=-1)
    zero = torch.zeros((), dtype=z.dtype, device=z.device)
    if inputs.class_weight is None:
        # 0 · log p = 0 where t_k = 0, also for a -inf logit (a masked class)
        return -torch.where(t > 0, t * log_p, zero).sum(dim=1), None
    w = inputs.class_weight.to(z.dtype)
    cross_entropy = -torch.where(t > 0, w * t * log_p, zero).sum(dim=1)
    if inputs.dense:
        return cross_entropy, None
    unsmoothed = soft_target_distribution(z, target, valid=valid, mix_target=inputs.mix_target,
                                          mix_lambda=inputs.mix_lambda)
    return cross_entropy, torch.where(valid, (unsmoothed * w).sum(dim=1), zero).sum()


def bsce_gra_loss(logits, target, *, gamma=4.0, norm=2.0, reduction="mean", ignore_index=-100, backend="reference",
                  label_smoothing=0.0, mix_target=None, mix_lambda=None):
    """BSCE-GRA: ``sg[‖p - t‖_q^γ] · CE`` (BSCE-GRA paper Eq. 11 with ``t = e_y``); gradient ``‖p - t‖_q^γ (p - t)``.
    Soft targets (``label_smoothing``, ``mix_target``/``mix_lambda``, dense ``target``): see
    :func:`uncertainty_weighted_ce`."""
    return uncertainty_weighted_ce(logits, target, uncertainty="brier", mode="grad", gamma=gamma, norm=norm,
                                   reduction=reduction, ignore_index=ignore_index, backend=backend,
                                   label_smoothing=label_smoothing, mix_target=mix_target, mix_lambda=mix_lambda)


def brier_loss(logits, target, *, reduction="mean", ignore_index=-100):
    """Brier loss ``Σ_k (p_k - e_{y,k})²`` per sample (Brier 1950; a proper scoring rule, not CE-weighted)."""
    check_reduction(reduction)
    logits2d, target1d, batch_shape = check_logits_target(logits, target, ignore_index=ignore_index)
    valid, z, safe_target = _masked_rows(logits2d, target1d, ignore_index)
    u = uncertainty_weight(z, safe_target, uncertainty="brier", gamma=2.0, norm=2.0)
    return _reduce(u, valid, reduction, batch_shape, logits2d.dtype)


def label_smoothing_loss(logits, target, *, alpha=0.05, reduction="mean", ignore_index=-100):
    """Cross-entropy against the smoothed target ``(1 - α) e_y + α / C`` (Szegedy et al. 2016).

    This is the variant of ``F.cross_entropy(label_smoothing=α)``: the α mass is spread over all C classes, the
    target included. Per sample: ``-(1 - α) log p_y - (α / C) Σ_k log p_k``.
    """
    check_reduction(reduction)
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"label smoothing alpha must be in [0, 1], got {alpha}")
    logits2d, target1d, batch_shape = check_logits_target(logits, target, ignore_index=ignore_index)
    valid, z, safe_target = _masked_rows(logits2d, target1d, ignore_index)
    log_p = torch.log_softmax(z, dim=-1)
    nll = -log_p.gather(1, safe_target[:, None]).squeeze(1)
    smooth = -log_p.mean(dim=-1)
    return _reduce((1.0 - alpha) * nll + alpha * smooth, valid, reduction, batch_shape, logits2d.dtype)


def check_mmce_hyperparameters(*, lam=None, bandwidth=None):
    """MMCE's trade-off weight ``lam`` (finite, ≥ 0) and kernel bandwidth (finite, > 0); ``None`` is not checked."""
    if lam is not None:
        check_number("MMCE weight lam (λ)", lam)
    if bandwidth is not None:
        check_number("MMCE kernel bandwidth", bandwidth, positive=True)


MMCE_FORMS = ("kumar", "papers_code")


def check_mmce_form(form):
    """MMCE's ``form``: ``"kumar"`` or ``"papers_code"`` (``TypeError`` / ``ValueError`` otherwise); returns it."""
    if not isinstance(form, str):
        raise TypeError(f"MMCE form must be one of {MMCE_FORMS}, got {type(form).__name__}")
    if form not in MMCE_FORMS:
        raise ValueError(f"MMCE form must be one of {MMCE_FORMS}, got {form!r}")
    return form


def mmce(logits, target, *, weighted=False, bandwidth=0.4, ignore_index=-100, form="kumar"):
    """Maximum mean calibration error of a batch (Kumar, Sarawagi, Jain, ICML 2018), differentiable.

    With confidence ``r_i = max_k p_ik``, correctness ``c_i = 1[argmax p_i = y_i]`` (a constant), the Laplacian
    kernel ``k(r, r') = exp(-|r - r'| / bandwidth)``, over the ``m`` non-ignored rows of which ``n₁`` are correct and
    ``n₀`` wrong, with ``a_i = (1 - r_i)`` on correct rows and ``b_i = r_i`` on wrong rows:

    ``form="kumar"`` (default; Kumar et al.'s definitions):

    * unweighted (Eq. 1): ``MMCE = sqrt(Σ_ij (c_i - r_i)(c_j - r_j) k(r_i, r_j)) / m``;
    * weighted (Eq. 5): the correct and wrong rows compared as two distributions,
      ``MMCE_w = sqrt(Σ a a' k / n₁² + Σ b b' k / n₀² - 2 Σ a b' k / (n₁ n₀))``.

    ``form="papers_code"`` (the focal-loss paper's code, classes ``MMCE`` and ``MMCE_weighted``, which the
    BSCE-GRA code copies; λ = 2 was tuned on it and the published MMCE numbers come from it):

    * unweighted (``MMCE``): ``Σ_ij (c_i - r_i)(c_j - r_j) k(r_i, r_j) / m²``, **no** square root;
    * weighted (``MMCE_weighted``): each pair sum is first averaged (``torch.mean`` over the pair matrix) and then
      divided again, by ``m² + 1e-5``, ``n² + 1e-5`` and ``mn + 1e-5`` with the code's ``m = n₁``, ``n = n₀``:
      ``sqrt(Σ a a' k / (n₁² (n₁² + 1e-5)) + Σ b b' k / (n₀² (n₀² + 1e-5)) - 2 Σ a b' k / (n₁n₀ (n₁n₀ + 1e-5)))``,
      i.e. about ``n₁⁴``, ``n₀⁴`` and ``(n₁n₀)²`` where Kumar's form has ``n₁²``, ``n₀²``, ``n₁n₀``.

    Both weighted forms are 0 when either group is empty (as the code's ``cond_k · cond_k_p``), every form is 0 when
    every row is ignored, and the weighted forms' radicand is
    clamped at 0 (a negative rounding residue would make the code's ``sqrt`` NaN). A ``1e-10`` inside every square root
    keeps its gradient finite at 0 (as in the code). Ignored rows take no part. ``logits (..., C)``, ``target (...)``;
    returns a 0-dim tensor. Formulas and conventions: ``docs/losses.md`` ("MMCE").
    """
    check_mmce_hyperparameters(bandwidth=bandwidth)
    check_mmce_form(form)
    logits2d, target1d, _ = check_logits_target(logits, target, ignore_index=ignore_index)
    valid, z, safe_target = _masked_rows(logits2d, target1d, ignore_index)
    p = torch.softmax(z, dim=-1)
    confidence, prediction = p.max(dim=-1)
    correct = (prediction == safe_target).to(p.dtype)
    mask = valid.to(p.dtype)
    kernel = torch.exp(-(confidence[:, None] - confidence[None, :]).abs() / bandwidth)
    if not weighted:
        residual = (correct - confidence) * mask
        m_valid = mask.sum()
        m = m_valid.clamp_min(1)
        quadratic = (residual[:, None] * residual[None, :] * kernel).sum() / (m * m)
        if form == "papers_code":
            return quadratic
        # 0 for a batch with no row to compare (the 1e-10 alone would give 1e-5)
        return (m_valid > 0).to(p.dtype) * torch.sqrt(quadratic + 1e-10)
    is_correct = correct * mask
    is_wrong = (1.0 - correct) * mask
    n_correct, n_wrong = is_correct.sum(), is_wrong.sum()
    a = (1.0 - confidence) * is_correct  # under-confidence of correct samples
    b = confidence * is_wrong  # over-confidence of wrong samples
    n1, n0, n10 = n_correct.clamp_min(1) ** 2, n_wrong.clamp_min(1) ** 2, (n_correct * n_wrong).clamp_min(1)
    if form == "papers_code":
        n1, n0, n10 = n1 * (n1 + 1e-5), n0 * (n0 + 1e-5), n10 * (n10 + 1e-5)
    squared = (
        (a[:, None] * a[None, :] * kernel).sum() / n1
        + (b[:, None] * b[None, :] * kernel).sum() / n0
        - 2.0 * (a[:, None] * b[None, :] * kernel).sum() / n10
    )
    both_groups = ((n_correct > 0) & (n_wrong > 0)).to(p.dtype)
    return both_groups * torch.sqrt(squared.clamp_min(0) + 1e-10)


def mmce_loss(logits, target, *, lam=2.0, weighted=False, bandwidth=0.4, reduction="mean", ignore_index=-100,
              form="kumar"):
    """Cross-entropy + λ·MMCE (Kumar et al. 2018; λ = ``lam`` = 2 as in Mukhoti et al.'s runs), see :func:`mmce`.

    ``form``: ``"kumar"`` (default) or ``"papers_code"``, the MMCE of the focal-loss / BSCE-GRA code on which λ = 2
    was tuned (see :func:`mmce`).

    MMCE is a batch-level term, so ``reduction="none"`` is not defined. ``"mean"``: mean CE + λ·MMCE;
    ``"sum"``: sum CE + λ·n·MMCE (n non-ignored rows), i.e. n times the mean form, so the paper recipes'
    sum reduction keeps the same balance between the two terms. ``lam`` must be finite and ≥ 0, ``bandwidth``
    finite and > 0 (``ValueError`` otherwise).
    """
    check_reduction(reduction)
    check_mmce_hyperparameters(lam=lam, bandwidth=bandwidth)
    check_mmce_form(form)
    if reduction == "none":
        raise ValueError("MMCE is a batch-level loss: reduction='none' is not supported (use 'mean' or 'sum')")
    ce = uncertainty_weighted_ce(logits, target, uncertainty="none", reduction=reduction, ignore_index=ignore_index)
    penalty = mmce(logits, target, weighted=weighted, bandwidth=bandwidth, ignore_index=ignore_index, form=form)
    if reduction == "sum":
        penalty = penalty * (target.reshape(-1) != ignore_index).sum()
    return ce + (lam * penalty).to(ce.dtype)
