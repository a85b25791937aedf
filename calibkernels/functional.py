"""Functional API: pick a backend, check the arguments, run the op (docs/losses.md)."""

from __future__ import annotations

import torch

from . import _backends
from . import reference as _reference
from ._validation import check_loss_inputs, drop_in_option_names
from .loss_stats import check_return_stats

__all__ = ["uncertainty_weighted_ce", "bsce_gra_loss", "brier_loss", "label_smoothing_loss", "mmce_loss"]


def uncertainty_weighted_ce(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    uncertainty: str = "brier",
    mode: str = "grad",
    gamma: float | torch.Tensor = 4.0,
    norm: float = 2.0,
    sample_weight: torch.Tensor | None = None,
    weight: torch.Tensor | None = None,
    reduction: str = "mean",
    ignore_index: int = -100,
    backend: str = "auto",
    inplace: bool = False,
    label_smoothing: float = 0.0,
    mix_target: torch.Tensor | None = None,
    mix_lambda: float | torch.Tensor | None = None,
    lse_square_scale: float = 0.0,
    return_z_loss: bool = False,
    softcap: float | None = None,
    return_stats: bool = False,
):
    """Uncertainty-weighted cross-entropy ``L_i = u_i · CE_i``, fused (softmax + weight + CE + backward in one pass).

    ``mode="grad"`` (default, the GRA losses) uses ``sg[u_i]``: gradient ``u_i (p_i - e_{y_i})``.
    ``mode="loss"`` differentiates through ``u_i`` as the classic focal / dual-focal / BSCE losses do.
    The weights ``u(p, y)`` are listed in :mod:`calibkernels.reference`; the defaults (``uncertainty="brier"``,
    ``gamma=4``, ``norm=2``, ``mode="grad"``) are BSCE-GRA as run in the BSCE-GRA paper.

    Args:
        logits: ``(..., C)`` float32/float16/bfloat16 (float64 on the reference), class dimension last.
        target: ``(...)`` int64 class indices in ``[0, C)`` or ``ignore_index``; or a floating ``(..., C)`` tensor
            of probabilities per row (soft targets, as ``F.cross_entropy`` accepts; no ``ignore_index`` then).
        uncertainty, mode, gamma, norm, sample_weight: see :func:`calibkernels.reference.uncertainty_weighted_ce`.
        weight: ``F.cross_entropy``'s per-class ``(C,)`` weights: ``L_i = u_i · CE_i^w`` (docs/losses.md, "Coming
            from F.cross_entropy / Liger-Kernel"). A string raises ``TypeError`` (the uncertainty weight's keyword is
            ``uncertainty=``).
        lse_square_scale, return_z_loss: the z-loss ``s · logsumexp(z_i)²`` added to each non-ignored row (Liger's
            names); ``return_z_loss=True`` returns ``(loss, z_loss)``.
        softcap: ``c``: the logits become ``c · tanh(z / c)`` first (Gemma-2's soft-capping).
            The fused kernels compute class weights, the z-loss and soft-capping in their pass over the rows, except
            with ``uncertainty="dual_focal"`` (and on a backend whose kernel lacks them): ``backend="auto"`` then
            runs the reference with one ``RuntimeWarning``, a named fused backend raises ``NotImplementedError``.
        return_stats: also return a :class:`calibkernels.LossStats` (top-label confidence and prediction per row,
            NaN / -1 on ignored rows), last: ``(loss, stats)``; docs/metrics.md, "Monitor calibration while training".
        label_smoothing: α in [0, 1]; the target becomes ``(1 - α) t + α / C`` (``F.cross_entropy``'s convention).
        mix_target, mix_lambda: mixup / cutmix in O(N): ``t = λ e_target + (1 - λ) e_mix_target`` with
            ``mix_target`` int64 of the target's shape (usually ``target.flip(0)``) and ``λ`` in [0, 1], a number
            or one per row. The fused kernels take these compact forms in one pass (O(N) target data); a dense
            target costs one more read of ``N×C``. ``uncertainty="dual_focal"`` refuses soft targets
            (docs/losses.md, "Soft targets").
        reduction: ``"mean"`` (default; over non-ignored rows, 0 if none), ``"sum"`` or ``"none"``.
        ignore_index: target value whose rows contribute neither loss nor gradient.
        backend: ``"auto"`` (fastest available for the tensors' device; warns once if it must fall back to the
            reference), ``"reference"``, ``"cpu"``, ``"triton"`` or ``"cuda"``. A named backend that cannot run
            raises ``RuntimeError``.
        inplace: allow the kernel to overwrite ``logits`` with the gradient (no extra ``N×C`` memory). The logits
            are garbage afterwards. Backends that do not need to (the reference) leave them intact.

    Returns:
        the loss in the logits' dtype: a scalar, or ``target``-shaped for ``reduction="none"``; with
        ``return_z_loss`` and/or ``return_stats``, a tuple ``(loss, [z_loss,] [stats])``.
    """
    # The route of every call: which backend runs it, the argument checks (those of values where that backend does not
    # make them itself), the op.
    options = None
    if not (weight is None and softcap is None and return_z_loss is False and type(lse_square_scale) is float
            and lse_square_scale == 0.0):
        options = drop_in_option_names(weight, lse_square_scale, return_z_loss, softcap)
    name, cannot_run = _backends.choose_for_call(backend, logits, target, mode, gamma, label_smoothing, mix_target,
                                                 mix_lambda, options, uncertainty)
    inputs = check_loss_inputs(
        logits, target, uncertainty=uncertainty, mode=mode, gamma=gamma, norm=norm, sample_weight=sample_weight,
        weight=weight, reduction=reduction, ignore_index=ignore_index, label_smoothing=label_smoothing,
        mix_target=mix_target, mix_lambda=mix_lambda, checked_by=name, lse_square_scale=lse_square_scale,
        return_z_loss=return_z_loss, softcap=softcap, class_weight_supported=True)
    if type(inplace) is not bool:
        raise TypeError(f"inplace must be a bool, got {type(inplace).__name__}")
    if return_stats is not False:
        check_return_stats(return_stats)
    if cannot_run is not None:
        # Bad inputs raise what the reference raises, whichever backend was asked for: the inputs are checked first,
        # and a named backend that cannot run this call says so only once they pass
        raise cannot_run
    return _backends.run(name, inputs, inplace, return_stats)


def bsce_gra_loss(
    logits: torch.Tensor,
    target: torch.Tensor,
    *,
    gamma: float = 4.0,
    norm: float = 2.0,
    reduction: str = "mean",
    ignore_index: int = -100,
    backend: str = "auto",
    inplace: bool = False,
    label_smoothing: float = 0.0,
    mix_target: torch.Tensor | None = None,
    mix_lambda: float | torch.Tensor | None = None,
    return_stats: bool = False,
):
    """BSCE-GRA (BSCE-GRA paper, Eq. 11): ``L_i = sg[‖p_i - e_{y_i}‖_q^γ] · CE_i``.

    The detached generalised Brier score scales the cross-entropy *gradient*: ``∂L_i/∂z_i = ‖p_i - e_{y_i}‖_q^γ
    (p_i - e_{y_i})``, so confident, correct samples stop pushing their logits apart. Defaults γ = 4, q = 2.
    With soft targets ``t`` (``label_smoothing``, ``mix_target``/``mix_lambda``, a dense ``target``) ``e_y``
    becomes ``t``: ``L_i = sg[‖p_i - t_i‖_q^γ] · CE_i``, gradient ``‖p_i - t_i‖_q^γ (p_i - t_i)``
    (see :func:`uncertainty_weighted_ce`). ``return_stats=True`` returns ``(loss, stats)``, the rows' top-label
    statistics (:class:`calibkernels.LossStats`).
    """
    return uncertainty_weighted_ce(logits, target, uncertainty="brier", mode="grad", gamma=gamma, norm=norm,
                                   reduction=reduction, ignore_index=ignore_index, backend=backend, inplace=inplace,
                                   label_smoothing=label_smoothing, mix_target=mix_target, mix_lambda=mix_lambda,
                                   return_stats=return_stats)


# Batch-level and non-CE-weighted members of the family have no fused kernel; they are the reference's.
brier_loss = _reference.brier_loss
label_smoothing_loss = _reference.label_smoothing_loss
mmce_loss = _reference.mmce_loss
