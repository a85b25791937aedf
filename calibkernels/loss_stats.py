"""Top-label statistics of a loss call's logits, for monitoring calibration while training (docs/metrics.md,
'Monitor calibration while training').

``uncertainty_weighted_ce(..., return_stats=True)`` returns ``(loss, stats)`` with a :class:`LossStats` of the rows
the loss saw; ``calibkernels.metrics.CalibrationMeter.update_top_label(stats.confidence, stats.prediction == y)``
turns them into ECE, MCE and accuracy without a second softmax over the logits. :func:`top_label_stats` is the
definition every backend's statistics are tested against.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ._row_math import soft_capped

__all__ = ["LossStats", "check_return_stats", "empty_loss_stats", "loss_stats_of_inputs", "top_label_stats"]


class LossStats(NamedTuple):
    """Per-row top-label statistics of the logits ``z`` of a loss call, shaped like the target's batch shape ``(...)``.

    Attributes:
        confidence: float32, the top-label probability ``max_k p_k = max_k softmax(z)_k``; NaN on ignored rows.
        prediction: int64, ``argmax_k z_k``, the lowest index among tied maxima (as ``torch.argmax``); -1 on ignored
            rows.

    Both are detached. They describe the logits only, whatever the target: with soft targets (probability targets,
    mixup / cutmix, label smoothing) they are still the logits' own top label, and ``prediction == labels`` against
    the hard labels gives the correctness a calibration meter needs.
    """

    confidence: torch.Tensor
    prediction: torch.Tensor


def empty_loss_stats(num_rows: int, device) -> LossStats:
    """Uninitialised ``(N,)`` float32 confidence and int64 prediction buffers, for a kernel (or a loop over chunks)
    to write the rows' statistics into."""
    return LossStats(torch.empty(num_rows, dtype=torch.float32, device=device),
                     torch.empty(num_rows, dtype=torch.int64, device=device))


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.no_grad()
def top_label_stats(logits2d: torch.Tensor, ignored: torch.Tensor | None, batch_shape) -> LossStats:
    """:class:`LossStats` of logits ``(N, C)``, reshaped to ``batch_shape`` (with ``prod(batch_shape) = N``).

    ``ignored``: ``(N,)`` bool, the rows whose target is ``ignore_index`` (class-index targets), or ``None`` (no row
    ignored, e.g. probability targets).

    In the compute dtype (float32 for float16 / bfloat16 / float32 logits, float64 for float64), with
    ``m = max_k z_k``::

        confidence = 1 / Σ_k exp(z_k - m)        (the summand of the arg-max class is exp(0) = 1, so this is
                                                  softmax's largest entry, without forming the other probabilities)
        prediction = argmax_k z_k                (torch.argmax: lowest index on ties)

    then ``confidence`` is rounded to float32. The sum is at least 1, so the result lies in ``[1/C, 1]`` and never
    overflows; a ``-inf`` logit (a masked class) adds ``exp(-inf) = 0``. Rows without a finite maximum have no
    distribution: a row of only ``-inf`` logits (``m = -inf``, ``z - m`` is NaN) or one holding ``+inf`` or NaN gives
    confidence NaN, which calibration meters skip as they skip ignored rows; its prediction stays ``torch.argmax``'s
    (0 for an all ``-inf`` row, the ``+inf`` / first NaN class otherwise). Ignored rows give NaN / -1.
    """
    z = logits2d.detach().to(_compute_dtype(logits2d.dtype))
    top_logit = z.amax(dim=1)
    prediction = z.argmax(dim=1)  # the first maximum (torch.max's index on ties is not documented to be)
    confidence = torch.exp(z - top_logit[:, None]).sum(dim=1).reciprocal().float()
    if ignored is not None:
        confidence = confidence.masked_fill(ignored, math.nan)
        prediction = prediction.masked_fill(ignored, -1)
    return LossStats(confidence.reshape(batch_shape), prediction.reshape(batch_shape))


def loss_stats_of_inputs(inputs) -> LossStats:
    """:func:`top_label_stats` of validated loss inputs (``calibkernels._validation.LossInputs``): class-index
    targets ignore the rows whose target is ``ignore_index``, probability targets (``inputs.dense``) none; of the
    soft-capped logits where the call caps them."""
    ignored = None if inputs.dense else inputs.target == inputs.ignore_index
    # the capped logits are the model's
    return top_label_stats(soft_capped(inputs.logits, inputs.softcap), ignored, inputs.batch_shape)


def check_return_stats(return_stats) -> bool:
    """``return_stats`` must be a ``bool`` (``TypeError`` otherwise): a truthy tensor or string would change what the
    loss function returns."""
    if not isinstance(return_stats, bool):
        raise TypeError(f"return_stats must be a bool, got {type(return_stats).__name__}")
    return return_stats
