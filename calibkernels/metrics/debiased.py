"""Debiased L2 calibration error on equal-mass bins (docs/metrics.md, 'Debiased calibration error').

Kumar, Liang & Ma, "Verified Uncertainty Calibration" (NeurIPS 2019), Section 5. The plugin estimate of the squared
L2 calibration error over bins ``B_b``, ``Σ_b (n_b/N) (p̄_b - ȳ_b)²``, is biased upwards: even a calibrated model's
bin means differ by sampling noise, whose variance is about ``ȳ_b (1 - ȳ_b) / n_b``. Subtracting an unbiased
estimate of it per bin gives

    CE² = Σ_b (n_b / N) [ (p̄_b - ȳ_b)² - ȳ_b (1 - ȳ_b) / (n_b - 1) ],      over bins with n_b >= 2,
    CE  = sqrt(max(CE², 0)),

``p̄_b`` and ``ȳ_b`` the bin's mean probability and mean outcome. A bin holding fewer than 2 samples adds 0 (its
variance is not estimable). The result is the **L2 error, not its square**, clipped at 0: the debiased square can be
negative for a well calibrated model, and then CE is 0.

* ``mode="top-label"``: one problem, ``p_i`` the top-label confidence ``max_k p_ik`` and ``y_i`` its correctness.
* ``mode="marginal"``: one problem per class k, ``p_i = p_ik`` against ``y_i = 1[label_i = k]``, each with its own
  bins; ``CE = sqrt((1/C) Σ_k max(CE_k², 0))``.

Conventions of the authors' ``uncertainty-calibration`` package (``calibration.lower_bound_scaling_ce(probs, labels,
p=2, debias=True, num_bins=15, mode=...)``), reproduced exactly:

* **Equal-mass bins.** With ``B = min(n_bins, N)``, the sorted values are cut into B consecutive chunks as
  ``numpy.array_split`` does: the first ``N mod B`` chunks hold ``⌊N/B⌋ + 1`` values, the others ``⌊N/B⌋``. The
  boundary between two chunks is the midpoint ``(last of one + first of the next) / 2``, computed in the values' dtype
  (float32 for float32 inputs); the last boundary is 1.
* **Membership** is ``(lo, hi]``: a value equal to a boundary belongs to the bin below it, the first bin is
  ``(-inf, b_1]``. Tied values therefore stay in one bin, and a chunk made only of values tied with the previous
  chunk's boundary leaves its bin empty (weight 0).
* ``n_b / N`` divides by all N samples (every sample lands in some bin).

Everything is vectorised (sort, ``searchsorted``, ``scatter_add``; the marginal mode handles all classes in one
batch) and accumulated in float64. The equal-mass boundaries need every sample at once, so the streaming form
(:class:`calibkernels.metrics.DebiasedECEMeter`) keeps every sample and gathers them across DDP ranks.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._validation.metric_inputs import check_n_bins, prepare
from .binned import bin_sums, confidence_and_correct

__all__ = ["debiased_ece", "DEBIASED_MODES"]

DEBIASED_MODES = ("top-label", "marginal")


def equal_mass_edges(values: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Edges ``(..., B + 1)`` of the equal-mass bins of each row of ``values (..., N)``: ``-inf``, the ``B - 1``
    chunk midpoints, then 1; ``B = min(n_bins, N)``, in the values' dtype (module docstring)."""
    n = values.shape[-1]
    chunks = min(n_bins, n)
    ordered = values.sort(dim=-1).values
    size, larger = divmod(n, chunks)
    # First index of chunks 1..B-1: array_split gives the first `larger` chunks one extra value.
    starts = torch.arange(1, chunks, device=values.device)
    starts = starts * size + starts.clamp(max=larger)
    midpoints = (ordered[..., starts - 1] + ordered[..., starts]) / 2
    low = torch.full((*values.shape[:-1], 1), -math.inf, dtype=values.dtype, device=values.device)
    return torch.cat([low, midpoints, torch.ones_like(low)], dim=-1)


def debiased_squared_error(values: torch.Tensor, targets: torch.Tensor, n_bins: int) -> torch.Tensor:
    """``CE²`` (not clipped) of each row of ``values, targets (..., N)`` on its equal-mass bins; float64 ``(...)``."""
    count, value_sum, target_sum = bin_sums(values, targets, equal_mass_edges(values, n_bins))
    estimable = count >= 2
    safe_count = count.clamp_min(1)
    value_mean, target_mean = value_sum / safe_count, target_sum / safe_count
    noise = target_mean * (1 - target_mean) / (count - 1).clamp_min(1)
    per_bin = torch.where(estimable, (value_mean - target_mean).square() - noise, 0.0)
    return (count * per_bin).sum(-1) / values.shape[-1]


def top_label_error(confidence: torch.Tensor, correct: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Top-label CE of rows of ``confidence, correct (..., N)``; float64 ``(...)``."""
    return debiased_squared_error(confidence, correct, n_bins).clamp_min(0).sqrt()


def marginal_error(probs: torch.Tensor, labels: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Marginal CE of ``probs (..., N, C)`` against ``labels (..., N)``; float64 ``(...)``."""
    one_hot = F.one_hot(labels, probs.shape[-1]).to(probs.dtype)
    per_class = debiased_squared_error(probs.transpose(-1, -2), one_hot.transpose(-1, -2), n_bins)  # (..., C)
    return per_class.clamp_min(0).mean(-1).sqrt()


def check_mode(mode) -> str:
    if not isinstance(mode, str) or mode not in DEBIASED_MODES:
        raise ValueError(f"mode must be one of {DEBIASED_MODES}, got {mode!r}")
    return mode


def debiased_ece(inputs, labels, n_bins: int = 15, mode: str = "top-label", *, inputs_are: str = "auto",
                 ignore_index: int = -100) -> float:
    """Debiased L2 calibration error on equal-mass bins (Kumar, Liang & Ma 2019), a fraction in [0, 1].

    ``CE = sqrt(max(0, Σ_b (n_b/N) [(p̄_b - ȳ_b)² - ȳ_b (1 - ȳ_b) / (n_b - 1)]))`` over ``min(n_bins, N)``
    equal-mass ``(lo, hi]`` bins, bins with fewer than 2 samples adding 0; ``mode="marginal"`` takes
    ``sqrt(mean_k max(0, CE_k²))`` over the one-vs-rest problems of the C classes. Equals
    ``calibration.lower_bound_scaling_ce(probs, labels, p=2, debias=True, num_bins=n_bins, mode=mode)`` of the
    ``uncertainty-calibration`` package; the binning conventions are in the module docstring.

    Args:
        inputs: ``(..., C)`` logits or probabilities (``inputs_are``, see
            :mod:`calibkernels._validation.metric_inputs`).
        labels: ``(...)`` class indices; rows equal to ``ignore_index`` are left out.
        n_bins: the number of equal-mass bins (default 15; N when there are fewer samples).
        mode: ``"top-label"`` (default) or ``"marginal"``.
    """
    check_n_bins(n_bins)
    check_mode(mode)
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    if mode == "marginal":
        return float(marginal_error(prepared.probs, prepared.labels, n_bins))
    confidence, correct = confidence_and_correct(prepared)
    return float(top_label_error(confidence, correct, n_bins))
