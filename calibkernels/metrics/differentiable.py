"""Differentiable calibration errors for meta-regularisation: SECE and DECE (docs/metrics.md, 'Differentiable
calibration errors').

Both are batch-level, differentiable surrogates of ECE (docs/metrics.md, 'ECE') that a meta-learner can descend. They
take logits or probabilities ``(N, C)`` and integer labels ``(N,)``; confidence ``c_i = max_k p_ik``; fractions in
[0, 1]. Inputs are resolved and checked as for every metric (:mod:`._inputs`): -inf logits are masked classes, +inf or
NaN logits and invalid probabilities raise ``ValueError``.

* :func:`sece` — smooth ECE of Wang & Golebiowski (the slides' "sECE"): every sample is its own bin centre,
  ``sACC_i = Σ_j acc_j k(c_i, c_j) / Σ_j k(c_i, c_j)`` with a Gaussian kernel ``k(c, c') = exp(-(c - c')² / (2h²))``,
  ``SECE = (1/N) Σ_i |sACC_i - c_i|``. ``acc_j = 1[argmax p_j = y_j]`` is a constant; the gradient flows through the
  confidences (in the kernel weights and in ``c_i``).
* :func:`dece` — differentiable ECE of Bohdal, Yang & Hospedales, "Meta-Calibration" (2021/2023): M soft bins with
  membership ``o_i = softmax((c_i w + b) / t_b)``, ``w = [1, …, M]``, ``b = cumsum(-[0, 1/M, …, (M-1)/M])`` (soft
  binning of Yang et al.'s Deep Neural Decision Trees: bin m+1 beats bin m exactly when ``c > m/M``), and a soft
  accuracy ``a_i = relu(2 - r_i)`` from the soft rank of the target's probability
  ``r_i = 1/2 + Σ_k σ(t_a (p_ik - p_iy))`` (1 when the target is the clear argmax, 2 or more when another class beats
  it). Then ``DECE = Σ_m (|B_m|/N) |acc_m - conf_m|`` with soft counts ``|B_m| = Σ_i o_im``, which is
  ``(1/N) Σ_m |Σ_i o_im (a_i - c_i)|`` — computed in that form, so an empty soft bin needs no ε.
"""

from __future__ import annotations

import torch

from .._validation import check_ignore_index, is_number
from .._validation.metric_inputs import resolve_inputs_kind

__all__ = ["sece", "dece", "SECE_DEFAULT_BANDWIDTH", "DECE_DEFAULT_BINS", "DECE_DEFAULT_T_A", "DECE_DEFAULT_T_B"]

# Bandwidth of the Gaussian kernel on confidences (not published). 0.05 is a third of one of ECE's 15 equal-width bins
# (1/15 ≈ 0.067): narrow enough that sACC follows the accuracy-vs-confidence curve as closely as 15-bin ECE does, wide
# enough that a meta batch of ~100 samples has several neighbours inside one bandwidth.
SECE_DEFAULT_BANDWIDTH = 0.05
DECE_DEFAULT_BINS = 15
DECE_DEFAULT_T_A = 100.0
DECE_DEFAULT_T_B = 0.01
# Rows of the N×N kernel matrix built at a time: bounds SECE's memory to O(chunk · N) for large N.
_SECE_ROW_CHUNK = 2048


def _probabilities(inputs: torch.Tensor, inputs_are: str, rows: torch.Tensor | None) -> torch.Tensor:
    """Probabilities of ``inputs`` (N, C) in float32/float64, by the metrics' ``inputs_are`` convention and checks
    (:mod:`._inputs`: -inf logits are masked classes, +inf / NaN logits and invalid probabilities raise)."""
    x = inputs if inputs.dtype == torch.float64 else inputs.float()
    with torch.no_grad():
        inputs_are = resolve_inputs_kind(x.detach(), inputs_are, inputs.dtype, rows)
    return x if inputs_are == "probs" else torch.softmax(x, dim=-1)


def _check_confidences(confidences, correct):
    """1-D form: ``confidences (N,)`` in [0, 1] and ``correct (N,)`` bool or 0/1 (1 = the prediction was right)."""
    if not isinstance(correct, torch.Tensor):
        raise TypeError(f"with 1-D confidences, labels must be a (N,) correctness tensor, got {type(correct).__name__}")
    if correct.shape != confidences.shape:
        raise ValueError(f"correctness shape {tuple(correct.shape)} does not match confidences shape "
                         f"{tuple(confidences.shape)}")
    if correct.device != confidences.device:
        raise ValueError(f"correctness is on {correct.device} but confidences are on {confidences.device}")
    dtype = torch.float64 if confidences.dtype == torch.float64 else torch.float32
    correct = correct.to(dtype)
    if bool(((correct != 0) & (correct != 1)).any()):
        raise ValueError("with 1-D confidences, labels must be correctness values (bool or 0/1)")
    with torch.no_grad():
        if bool(((confidences < 0) | (confidences > 1) | confidences.isnan()).any()):
            raise ValueError("1-D confidences must lie in [0, 1]")
    return confidences.to(dtype), correct


def _check(inputs, labels, ignore_index):
    if not isinstance(inputs, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("inputs and labels must be torch.Tensors")
    if not inputs.is_floating_point():
        raise TypeError(f"inputs must be floating point (logits, probabilities or confidences), got {inputs.dtype}")
    if inputs.dim() != 2:
        raise ValueError(f"inputs must be (N, C) logits or probabilities (or (N,) confidences), "
                         f"got shape {tuple(inputs.shape)}")
    if labels.is_floating_point() or labels.dtype == torch.bool or labels.is_complex():
        raise TypeError(f"labels must be integer class indices, got {labels.dtype}")
    if labels.shape != inputs.shape[:1]:
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match inputs shape {tuple(inputs.shape)}")
    if labels.device != inputs.device:
        raise ValueError(f"labels are on {labels.device} but inputs are on {inputs.device}")
    check_ignore_index(ignore_index)
    keep = labels != ignore_index
    if bool(((labels < 0) | (labels >= inputs.shape[1]))[keep].any()):
        raise ValueError(f"labels out of range for {inputs.shape[1]} classes (valid: 0..{inputs.shape[1] - 1} "
                         f"or ignore_index={ignore_index})")
    if bool(keep.all()):
        return inputs, labels.long(), None
    return inputs[keep], labels[keep].long(), keep.nonzero().squeeze(1)


def sece(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    bandwidth: float = SECE_DEFAULT_BANDWIDTH,
    inputs_are: str = "auto",
    ignore_index: int = -100,
) -> torch.Tensor:
    """Smooth ECE (Wang & Golebiowski; docs/metrics.md, 'SECE'), differentiable through the confidences.

    ``SECE = (1/N) Σ_i |sACC_i - c_i|``, ``sACC_i = Σ_j acc_j k_ij / Σ_j k_ij``, ``k_ij = exp(-(c_i - c_j)² / (2h²))``
    (j runs over all samples, i included, so the denominator is ≥ 1). The normalised kernel row is computed as a
    softmax of ``-(c_i - c_j)² / (2h²)``, which is exact and cannot underflow to 0/0.

    Args:
        inputs: ``(N, C)`` logits or probabilities (``inputs_are``: the metrics' rule and checks, see
            :mod:`calibkernels._validation.metric_inputs`), or ``(N,)`` confidences in [0, 1].
        labels: ``(N,)`` integer labels (rows equal to ``ignore_index`` are left out); with 1-D confidences, the
            ``(N,)`` correctness instead (bool or 0/1).
        bandwidth: h, the kernel's standard deviation on the confidence scale (default 0.05, see
            ``SECE_DEFAULT_BANDWIDTH``).

    Returns:
        a 0-dim tensor in float32 (float64 for float64 inputs); 0 when every row is ignored.
    """
    if not is_number(bandwidth) or not bandwidth > 0:
        raise ValueError(f"bandwidth must be a number > 0, got {bandwidth!r}")
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 1:
        confidence, correct = _check_confidences(inputs, labels)
    else:
        inputs, labels, rows = _check(inputs, labels, ignore_index)
        probs = _probabilities(inputs, inputs_are, rows)
        confidence, prediction = probs.max(dim=-1)
        correct = (prediction == labels).to(probs.dtype)
    if confidence.shape[0] == 0:
        return confidence.sum() * 0.0
    scale = -0.5 / (bandwidth * bandwidth)
    gaps = []
    for start in range(0, confidence.shape[0], _SECE_ROW_CHUNK):
        centres = confidence[start:start + _SECE_ROW_CHUNK]
        weights = torch.softmax(scale * (centres[:, None] - confidence[None, :]).square(), dim=-1)
        gaps.append((weights @ correct - centres).abs())
    return torch.cat(gaps).mean()


def dece(
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    n_bins: int = DECE_DEFAULT_BINS,
    t_a: float = DECE_DEFAULT_T_A,
    t_b: float = DECE_DEFAULT_T_B,
    inputs_are: str = "auto",
    ignore_index: int = -100,
) -> torch.Tensor:
    """Differentiable ECE (Bohdal, Yang & Hospedales, "Meta-Calibration"; docs/metrics.md, 'DECE'), soft bins and
    soft accuracy.

    ``DECE = (1/N) Σ_m |Σ_i o_im (a_i - c_i)|`` with soft bin membership ``o_i = softmax((c_i w + b) / t_b)``
    (``w = [1..M]``, ``b = cumsum(-[0, 1/M, …, (M-1)/M])``) and soft accuracy ``a_i = relu(2 - r_i)``,
    ``r_i = 1/2 + Σ_k σ(t_a (p_ik - p_iy))`` (the all-pairs soft rank of the target, the k = y term giving the 1/2).

    Args:
        inputs: ``(N, C)`` logits or probabilities, or ``(N,)`` confidences in [0, 1].
        labels: ``(N,)`` integer labels (rows equal to ``ignore_index`` are left out); with 1-D confidences, the
            ``(N,)`` correctness (bool or 0/1), used as a hard accuracy in place of the soft rank.
        n_bins: M (default 15). t_a: sharpness of the soft rank (default 100). t_b: temperature of the soft
            binning (default 0.01); as ``t_b → 0`` and ``t_a → ∞`` DECE tends to the hard equal-width ECE.

    Returns:
        a 0-dim tensor in float32 (float64 for float64 inputs); 0 when every row is ignored.
    """
    if isinstance(n_bins, bool) or not isinstance(n_bins, int) or n_bins < 1:
        raise ValueError(f"n_bins must be an int >= 1, got {n_bins!r}")
    for name, value in (("t_a", t_a), ("t_b", t_b)):
        if not is_number(value) or not value > 0:
            raise ValueError(f"{name} must be a number > 0, got {value!r}")
    if isinstance(inputs, torch.Tensor) and inputs.dim() == 1:
        confidence, soft_accuracy = _check_confidences(inputs, labels)  # no probabilities to rank: hard accuracy
    else:
        inputs, labels, rows = _check(inputs, labels, ignore_index)
        probs = _probabilities(inputs, inputs_are, rows)
        confidence = probs.amax(dim=-1)
        p_target = probs.gather(1, labels[:, None])
        soft_rank = 0.5 + torch.sigmoid(t_a * (probs - p_target)).sum(dim=-1)
        soft_accuracy = torch.relu(2.0 - soft_rank)
    if confidence.shape[0] == 0:
        return confidence.sum() * 0.0
    slopes = torch.arange(1, n_bins + 1, dtype=confidence.dtype, device=confidence.device)
    cut_points = torch.arange(n_bins, dtype=confidence.dtype, device=confidence.device) / n_bins
    offsets = torch.cumsum(-cut_points, dim=0)
    membership = torch.softmax((confidence[:, None] * slopes + offsets) / t_b, dim=-1)  # (N, M)
    per_bin_gap = membership.transpose(0, 1) @ (soft_accuracy - confidence)  # (M,)
    return per_bin_gap.abs().sum() / confidence.shape[0]
