"""Binned calibration metrics (docs/metrics.md): ECE, AdaECE, classwise ECE, MCE, plus NLL, Brier score and accuracy.

Confidence is the maximum probability ``c_i = max_k p_ik``, the prediction its arg-max, ``acc_i = 1[pred_i = y_i]``.
With bins ``B_1..B_M`` (default M = 15):

* ECE (Guo et al. 2017; Naeini et al. 2015):
  ``Σ_b (|B_b|/N) |acc(B_b) - conf(B_b)| = (1/N) Σ_b |Σ_{i∈B_b} (acc_i - c_i)|`` over equal-width bins.
* AdaECE (Nguyen & O'Connor 2015; Mukhoti et al. 2020): the same sum over equal-count bins.
* Classwise ECE (Kull et al. 2019): ``(1/C) Σ_k ECE_k``, where ``ECE_k`` bins ``p_ik`` against ``1[y_i = k]``.
* MCE: ``max_b |acc(B_b) - conf(B_b)|`` over non-empty equal-width bins (0 if every bin is empty).
* NLL: ``(1/N) Σ_i -log p_{i,y_i}`` (from ``log_softmax`` when given logits); Brier score:
  ``(1/N) Σ_i Σ_k (p_ik - 1[y_i = k])²``; accuracy: ``(1/N) Σ_i acc_i``.

Conventions, chosen to reproduce the published tables (the reference code of Mukhoti et al. 2020, used by the
BSCE-GRA paper) exactly:

* Bins are half-open ``(lo, hi]``; equal-width edges are ``torch.linspace(0, 1, M + 1)`` **in float32** (so a
  confidence exactly on an edge such as ``float32(0.2) = 0.20000000298`` belongs to the bin below it, and a confidence
  of exactly 1.0 to the last bin).  A value of exactly 0 falls in no bin (it cannot be a max-probability, but a
  classwise ``p_ik`` can underflow to 0; such entries then count in N but in no bin, as in the reference).
* ``|B_b|/N`` divides by all N samples, including any that fall in no bin.
* AdaECE edges ``e_0..e_M`` are ``np.interp(linspace(0, N, M + 1), arange(N), sort(c))`` computed in float64 and
  compared in the confidences' dtype; membership is ``(lo, hi]`` too. ``e_0`` is the minimum confidence, so under
  the reference's rule every sample *equal to* the minimum falls in no bin (while still counted in N); every other
  sample lands in exactly one bin, ties or not (a value tied at ``v > e_0`` goes to the bin ``(e_j, v]``, and the
  degenerate ``(v, v]`` bins stay empty). See docs/metrics.md, 'AdaECE' / 'Ties'.

  - **Unique minimum** (the usual case with continuous confidences): we keep the reference's rule on purpose, so the
    numbers match the published code exactly; the one left-out sample moves AdaECE by at most ``|acc_i - c_i|/N``.
  - **Minimum shared by k >= 2 samples** (e.g. a saturated model whose confidences are all 1.0: every edge is 1.0,
    every bin ``(1, 1]`` is empty, and the reference returns AdaECE 0 for four wrong predictions at confidence 1):
    we count those k samples in the first bin, closed on the left, ``[e_0, e_1]`` (when ``e_1 = e_0`` it holds just
    the tied group). This is the only place where we differ from the published code, which silently drops all k;
    the two values then differ by at most ``k/N``.
* Classwise ECE averages over all C columns of ``inputs`` (the reference uses ``max(labels) + 1`` classes, which is the
  same whenever the last class occurs in the labels).

All metrics are vectorised (``bucketize`` + ``scatter_add``; no Python loop over samples, bins or classes), accumulate
bin sums in float64, and return Python floats (fractions in [0, 1], not percentages). See :mod:`._inputs` for the
accepted inputs (``inputs_are``, ``ignore_index``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .._validation.metric_inputs import PreparedInputs, check_n_bins, prepare

__all__ = [
    "accuracy",
    "adaptive_ece",
    "bin_sums",
    "brier_score",
    "classwise_ece",
    "ece",
    "equal_count_edges",
    "equal_width_edges",
    "mce",
    "nll",
]


# --------------------------------------------------------------------------------------------------------- primitives
def equal_width_edges(n_bins: int = 15, *, dtype=torch.float32, device=None) -> torch.Tensor:
    """The ``n_bins + 1`` equal-width edges on [0, 1]: ``torch.linspace(0, 1, n_bins + 1)`` in float32, cast to
    ``dtype``.

    The float32 values are the convention (docs/metrics.md, 'ECE'): e.g. the 4th edge of 15 bins is ``0.20000002``,
    not ``0.2``.
    """
    check_n_bins(n_bins)
    return torch.linspace(0.0, 1.0, n_bins + 1, dtype=torch.float32, device=device).to(dtype)


def equal_count_edges(confidences: torch.Tensor, n_bins: int = 15) -> torch.Tensor:
    """AdaECE edges: ``np.interp(np.linspace(0, N, n_bins + 1), np.arange(N), np.sort(confidences))``, in torch.

    Reproduces numpy's arithmetic in float64 (positions ``i · (N / M)``, last position exactly N; values beyond the
    last sample clamp to the maximum), then casts to the confidences' dtype, because the reference compares float32
    confidences with the float64 edges in float32. Shape ``(n_bins + 1,)``; needs N >= 1.
    """
    check_n_bins(n_bins)
    n = confidences.numel()
    if n == 0:
        raise ValueError("equal-count edges need at least one confidence")
    sorted_conf = confidences.reshape(-1).sort().values.to(torch.float64)
    positions = torch.arange(n_bins + 1, dtype=torch.float64, device=confidences.device) * (n / n_bins)
    positions[-1] = n
    lower = positions.floor().long().clamp_(0, n - 1)
    upper = (lower + 1).clamp_(max=n - 1)
    slope = sorted_conf[upper] - sorted_conf[lower]
    edges = slope * (positions - lower.to(torch.float64)) + sorted_conf[lower]
    return edges.to(confidences.dtype)


def bin_sums(values: torch.Tensor, targets: torch.Tensor, edges: torch.Tensor):
    """Per-bin ``(count, Σ values, Σ targets)`` for ``(lo, hi]`` bins, batched over leading dimensions.

    ``values`` and ``targets`` have shape ``(..., n)``; ``edges`` is ``(M + 1,)`` ascending (repeats allowed) or
    ``(..., M + 1)`` with the same leading shape. Returns three float64 tensors of shape ``(..., M)``. Values at or
    below the first edge or above the last fall in no bin.
    """
    n_bins = edges.shape[-1] - 1
    values = values.contiguous()
    edges = edges.to(values.dtype)
    if edges.dim() == 1:
        # bucketize gives i with edges[i-1] < v <= edges[i]: exactly (lo, hi] membership of bin i-1.
        bin_index = torch.bucketize(values, edges, right=False) - 1
    else:
        bin_index = torch.searchsorted(edges.contiguous(), values, right=False) - 1
    outside = (bin_index < 0) | (bin_index >= n_bins)
    bin_index = bin_index.masked_fill(outside, n_bins)  # an overflow slot, dropped below
    shape = (*values.shape[:-1], n_bins + 1)
    zeros = torch.zeros(shape, dtype=torch.float64, device=values.device)
    count = zeros.scatter_add(-1, bin_index, torch.ones_like(values, dtype=torch.float64))
    value_sum = zeros.scatter_add(-1, bin_index, values.to(torch.float64))
    target_sum = zeros.scatter_add(-1, bin_index, targets.to(torch.float64))
    return count[..., :n_bins], value_sum[..., :n_bins], target_sum[..., :n_bins]


def calibration_error_from_sums(value_sum: torch.Tensor, target_sum: torch.Tensor, num_samples) -> torch.Tensor:
    """``(1/N) Σ_b |Σ targets - Σ values|`` over the last dimension (ECE from per-bin sums, float64)."""
    return (target_sum - value_sum).abs().sum(-1) / num_samples


def max_calibration_error_from_sums(count, value_sum, target_sum) -> torch.Tensor:
    """``max_b |acc_b - conf_b|`` over non-empty bins (last dimension); 0 when every bin is empty."""
    gap = (target_sum - value_sum).abs() / count.clamp_min(1)
    return gap.amax(-1)  # empty bins have gap 0, so they never win


def confidence_and_correct(prepared: PreparedInputs):
    """``(c (N,), acc (N,) as c's dtype)``: max probability and whether its arg-max is the label."""
    confidence, prediction = prepared.probs.max(dim=-1)
    return confidence, (prediction == prepared.labels).to(confidence.dtype)


def adaptive_calibration_error(confidence: torch.Tensor, correct: torch.Tensor, n_bins: int) -> torch.Tensor:
    """AdaECE of 1-D confidences/correctness (float64 0-dim tensor).

    ``(1/N) Σ_b |Σ_{i∈B_b} (acc_i - c_i)|`` over the equal-count ``(lo, hi]`` bins of :func:`equal_count_edges`,
    except that samples tied at the minimum confidence (two or more) count in the first bin, ``[e_0, e_1]``; a unique
    minimum stays in no bin, as in the reference (module docstring).
    """
    edges = equal_count_edges(confidence, n_bins)
    _, value_sum, target_sum = bin_sums(confidence, correct, edges)
    at_minimum = confidence == edges[0]  # e_0 is the minimum exactly (interpolation at position 0)
    tied = (at_minimum.sum() >= 2).to(torch.float64)  # 0 or 1, so no host sync
    weight = at_minimum.to(torch.float64) * tied
    value_sum[0] += (weight * confidence.to(torch.float64)).sum()
    target_sum[0] += (weight * correct.to(torch.float64)).sum()
    return calibration_error_from_sums(value_sum, target_sum, confidence.numel())


def classwise_sums(prepared: PreparedInputs, n_bins: int):
    """Per-class, per-bin sums ``(C, M)`` of ``p_ik`` and ``1[y_i = k]`` on the equal-width bins."""
    probs = prepared.probs
    one_hot = F.one_hot(prepared.labels, probs.shape[1]).to(probs.dtype)
    edges = equal_width_edges(n_bins, dtype=probs.dtype, device=probs.device)
    return bin_sums(probs.T, one_hot.T, edges)


# --------------------------------------------------------------------------------------------------------- metrics
def ece(inputs, labels, n_bins: int = 15, *, inputs_are: str = "auto", ignore_index: int = -100) -> float:
    """Expected calibration error on ``n_bins`` equal-width ``(lo, hi]`` bins (Guo et al. 2017), a fraction.

    ``inputs (..., C)`` logits or probabilities, ``labels (...)`` class indices.
    """
    check_n_bins(n_bins)
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    confidence, correct = confidence_and_correct(prepared)
    edges = equal_width_edges(n_bins, dtype=confidence.dtype, device=confidence.device)
    _, value_sum, target_sum = bin_sums(confidence, correct, edges)
    return float(calibration_error_from_sums(value_sum, target_sum, prepared.num_samples))


def adaptive_ece(inputs, labels, n_bins: int = 15, *, inputs_are: str = "auto", ignore_index: int = -100) -> float:
    """Adaptive ECE on ``n_bins`` equal-count bins (Mukhoti et al. 2020's AdaECE), a fraction.

    ``(1/N) Σ_b |Σ_{i∈B_b} (acc_i - c_i)|`` with ``(lo, hi]`` bins between the equal-count edges of
    :func:`equal_count_edges`. A unique minimum confidence falls in no bin (the reference's convention, kept so the
    published numbers are reproduced); two or more samples tied at the minimum count in the first bin ``[e_0, e_1]``
    instead of vanishing (the reference drops them). See the module docstring and docs/metrics.md, 'AdaECE' / 'Ties'.
    """
    check_n_bins(n_bins)
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    confidence, correct = confidence_and_correct(prepared)
    return float(adaptive_calibration_error(confidence, correct, n_bins))


def classwise_ece(inputs, labels, n_bins: int = 15, *, inputs_are: str = "auto", ignore_index: int = -100) -> float:
    """Classwise ECE (Kull et al. 2019): mean over the C classes of the ECE of ``p_k`` against ``1[y = k]``."""
    check_n_bins(n_bins)
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    _, value_sum, target_sum = classwise_sums(prepared, n_bins)
    return float(calibration_error_from_sums(value_sum, target_sum, prepared.num_samples).mean())


def mce(inputs, labels, n_bins: int = 15, *, inputs_are: str = "auto", ignore_index: int = -100) -> float:
    """Maximum calibration error: the largest ``|acc - conf|`` over non-empty equal-width bins, a fraction."""
    check_n_bins(n_bins)
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    confidence, correct = confidence_and_correct(prepared)
    edges = equal_width_edges(n_bins, dtype=confidence.dtype, device=confidence.device)
    return float(max_calibration_error_from_sums(*bin_sums(confidence, correct, edges)))


def nll_sum(prepared: PreparedInputs) -> torch.Tensor:
    """``Σ_i -log p_{i,y_i}`` in float64 (exact ``log_softmax`` for logits; ``inf`` if a given probability is 0)."""
    if prepared.logits is not None:
        return F.cross_entropy(prepared.logits, prepared.labels, reduction="none").to(torch.float64).sum()
    return -prepared.probs.gather(1, prepared.labels[:, None]).to(torch.float64).log().sum()


def brier_sum(prepared: PreparedInputs) -> torch.Tensor:
    """``Σ_i Σ_k (p_ik - 1[y_i = k])²`` in float64, as ``Σ_k p_ik² - 2 p_iy + 1`` (no one-hot materialised)."""
    probs = prepared.probs.to(torch.float64)
    target_prob = probs.gather(1, prepared.labels[:, None]).squeeze(1)
    return (probs.square().sum(1) - 2 * target_prob + 1).sum()


def nll(inputs, labels, *, inputs_are: str = "auto", ignore_index: int = -100) -> float:
    """Mean negative log-likelihood ``(1/N) Σ_i -log p_{i,y_i}`` (``inf`` if a given probability of a label is 0)."""
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    return float(nll_sum(prepared) / prepared.num_samples)


def brier_score(inputs, labels, *, inputs_are: str = "auto", ignore_index: int = -100) -> float:
    """Multi-class Brier score ``(1/N) Σ_i Σ_k (p_ik - 1[y_i = k])²`` (Brier 1950), in [0, 2]."""
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    return float(brier_sum(prepared) / prepared.num_samples)


def accuracy(inputs, labels, *, inputs_are: str = "auto", ignore_index: int = -100) -> float:
    """Top-1 accuracy ``(1/N) Σ_i 1[argmax_k p_ik = y_i]`` (error = 1 - accuracy)."""
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    _, correct = confidence_and_correct(prepared)
    return float(correct.to(torch.float64).mean())
