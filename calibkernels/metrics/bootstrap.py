"""Percentile bootstrap intervals for any metric (docs/metrics.md, 'Bootstrap intervals').

Efron's percentile bootstrap (Efron & Tibshirani, "An Introduction to the Bootstrap", 1993, ch. 13): draw R
resamples of the N evaluated samples with replacement, evaluate the metric on each, and report the ``(1 - γ)/2`` and
``(1 + γ)/2`` quantiles of the R values (linear interpolation between order statistics, numpy's default) as the
γ-confidence interval.

>>> low, high = bootstrap(ece, logits, labels, n_resamples=1000, confidence=0.95, seed=0)   # doctest: +SKIP

* **Samples.** ``inputs (..., C)`` and ``labels (...)`` give N = prod(...) rows; rows whose label equals
  ``ignore_index`` are dropped *before* resampling, so every resample holds N evaluated rows. (1-D ``inputs (N,)``
  with ``labels (N,)``, e.g. confidences with correctness, are resampled entry by entry.)
* **Randomness.** Resample indices come from ``torch.randint`` with a ``torch.Generator`` on the inputs' device seeded
  with ``seed``, drawn in blocks of rows whose size depends only on N: the same seed, N, R and device give the same
  resamples, and so the same interval. CPU and CUDA generators are different streams, so the two devices give
  different (equally valid) intervals.
* **Batched metrics.** For the package's own metrics — :func:`~.binned.ece`, :func:`~.binned.adaptive_ece`,
  :func:`~.binned.mce`, :func:`~.binned.classwise_ece`, :func:`~.binned.nll`, :func:`~.binned.brier_score`,
  :func:`~.binned.accuracy`, :func:`~.smooth_ece.smooth_ece` and :func:`~.debiased.debiased_ece`, called directly
  or through ``functools.partial`` with keyword arguments only — the inputs are resolved once (one softmax) and all
  resamples of a block are evaluated in one batched pass on the inputs' device (``bin_sums`` over ``(R, N)``,
  ``vmap`` for AdaECE, a batched bisection for the smooth ECE). The values are those of the metric called on each
  resample, up to float64 summation order (NLL of logits sums per-sample float32 cross-entropies in float64, where
  the metric sums them in float32: a relative difference of about 1e-7).
* **Any other callable** ``metric(x, labels) -> float`` (a lambda, a metric with a positional argument bound, a
  user's function) is called once per resample on the resampled rows ``x[idx] (N, C)``, ``labels[idx] (N,)`` (in
  their own dtype), with the same indices as the batched path.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F

from .._validation import check_ignore_index, is_number
from .._validation.metric_inputs import check_n_bins, prepare
from .binned import (
    accuracy,
    adaptive_calibration_error,
    adaptive_ece,
    bin_sums,
    brier_score,
    calibration_error_from_sums,
    classwise_ece,
    confidence_and_correct,
    ece,
    equal_width_edges,
    max_calibration_error_from_sums,
    mce,
    nll,
)
from .debiased import check_mode, debiased_ece, marginal_error, top_label_error
from .smooth_ece import (
    BISECTION_STEPS,
    automatic_smooth_ece,
    check_bandwidth,
    fft_length,
    grid_points,
    smooth_ece,
    smooth_ece_at,
)

__all__ = ["BATCHED_METRICS", "bin_accuracy_band", "bootstrap", "bootstrap_distribution"]

# Index entries drawn per block (rows of N indices); also bounds the per-sample temporaries of a batched pass.
_BLOCK_ENTRIES = 1 << 22

# metric -> the keyword arguments its batched path understands.
_BATCHED = {
    accuracy: ("inputs_are", "ignore_index"),
    nll: ("inputs_are", "ignore_index"),
    brier_score: ("inputs_are", "ignore_index"),
    ece: ("n_bins", "inputs_are", "ignore_index"),
    adaptive_ece: ("n_bins", "inputs_are", "ignore_index"),
    mce: ("n_bins", "inputs_are", "ignore_index"),
    classwise_ece: ("n_bins", "inputs_are", "ignore_index"),
    smooth_ece: ("bandwidth", "inputs_are", "ignore_index"),
    debiased_ece: ("n_bins", "mode", "inputs_are", "ignore_index"),
}
BATCHED_METRICS = tuple(metric.__name__ for metric in _BATCHED)


# ------------------------------------------------------------------------------------------------ arguments
def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def _check_confidence(confidence) -> float:
    if not is_number(confidence):
        raise TypeError(f"confidence must be a number in (0, 1), got {type(confidence).__name__}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1) (0.95 for a 95% interval), got {confidence!r}")
    return float(confidence)


def _rows(inputs, labels, ignore_index):
    """``(x, y)``: the evaluated rows, ``x (N, C)`` or ``(N,)`` and ``y (N,)``, detached, ignored rows dropped."""
    if not isinstance(inputs, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError(f"inputs and labels must be torch.Tensors, got {type(inputs).__name__} and "
                        f"{type(labels).__name__}")
    check_ignore_index(ignore_index)
    if labels.device != inputs.device:
        raise ValueError(f"labels are on {labels.device} but inputs are on {inputs.device}")
    if inputs.dim() == 1 and labels.shape == inputs.shape:
        x, y = inputs.detach(), labels.detach()
    elif inputs.dim() >= 2 and labels.shape == inputs.shape[:-1]:
        x, y = inputs.detach().reshape(-1, inputs.shape[-1]), labels.detach().reshape(-1)
    else:
        raise ValueError(f"inputs {tuple(inputs.shape)} and labels {tuple(labels.shape)} do not describe the same "
                         "samples: expected inputs (..., C) with labels (...), or inputs (N,) with labels (N,)")
    keep = y != ignore_index
    if not bool(keep.all()):
        x, y = x[keep], y[keep]
    if y.shape[0] == 0:
        raise ValueError("no samples to resample (empty inputs, or every label equals ignore_index)")
    return x, y


def _index_blocks(n: int, n_resamples: int, seed: int, device):
    """Resample indices ``(rows, n)`` in blocks, from one generator seeded with ``seed`` on ``device``."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    rows = max(1, _BLOCK_ENTRIES // n)
    for start in range(0, n_resamples, rows):
        yield torch.randint(0, n, (min(rows, n_resamples - start), n), generator=generator, device=device)


def _batched_plan(metric, ignore_index):
    """``(metric, keyword arguments)`` when ``metric`` has a batched path, else ``None``."""
    keywords = {}
    if isinstance(metric, functools.partial):
        if metric.args:
            return None
        metric, keywords = metric.func, dict(metric.keywords)
        if isinstance(metric, functools.partial):
            return None
    try:
        allowed = _BATCHED.get(metric)
    except TypeError:  # unhashable callable
        return None
    if allowed is None or not set(keywords) <= set(allowed):
        return None
    if keywords.get("ignore_index", ignore_index) != ignore_index:
        raise ValueError(f"the metric's ignore_index ({keywords['ignore_index']}) differs from bootstrap's "
                         f"({ignore_index}); pass ignore_index to bootstrap, which drops those rows before resampling")
    return metric, keywords


# ------------------------------------------------------------------------------------------------ batched path
def _batched_statistics(metric, keywords, x, y, ignore_index, blocks) -> torch.Tensor:
    prepared = prepare(x, y, keywords.get("inputs_are", "auto"), ignore_index)  # no row of y is ignored any more
    n = prepared.num_samples
    confidence, correct = confidence_and_correct(prepared)
    n_bins = check_n_bins(keywords.get("n_bins", 15)) if "n_bins" in _BATCHED[metric] else None
    mode = check_mode(keywords.get("mode", "top-label")) if metric is debiased_ece else None
    sigma = check_bandwidth(keywords.get("bandwidth")) if metric is smooth_ece else None
    row_entries = n  # per-resample size of the batched temporaries
    if metric is nll:
        if prepared.logits is not None:
            per_sample = F.cross_entropy(prepared.logits, prepared.labels, reduction="none").to(torch.float64)
        else:
            per_sample = -prepared.probs.gather(1, prepared.labels[:, None]).squeeze(1).to(torch.float64).log()
    elif metric is brier_score:
        probs = prepared.probs.to(torch.float64)
        per_sample = probs.square().sum(1) - 2 * probs.gather(1, prepared.labels[:, None]).squeeze(1) + 1
    elif metric is accuracy:
        per_sample = correct.to(torch.float64)
    elif metric is classwise_ece or mode == "marginal":
        row_entries = n * prepared.num_classes
    elif metric is smooth_ece:  # grids at the narrowest bandwidth tried
        narrowest = sigma if sigma is not None else 2.0 ** (1 - BISECTION_STEPS)
        row_entries = n + 8 * fft_length(3 * grid_points(narrowest))  # FFT buffers and the cached grids
    edges = equal_width_edges(n_bins, dtype=confidence.dtype, device=confidence.device) if n_bins else None

    def evaluate(idx):
        if metric in (nll, brier_score, accuracy):
            return per_sample[idx].sum(-1) / n
        c, a = confidence[idx], correct[idx]
        if metric is ece:
            _, value_sum, target_sum = bin_sums(c, a, edges)
            return calibration_error_from_sums(value_sum, target_sum, n)
        if metric is mce:
            return max_calibration_error_from_sums(*bin_sums(c, a, edges))
        if metric is adaptive_ece:
            return torch.vmap(adaptive_calibration_error, in_dims=(0, 0, None))(c, a, n_bins)
        if metric is smooth_ece:
            return automatic_smooth_ece(c, a)[0] if sigma is None else smooth_ece_at(c, a, sigma)
        if mode == "top-label":
            return top_label_error(c, a, n_bins)
        if mode == "marginal":
            return marginal_error(prepared.probs[idx], prepared.labels[idx], n_bins)
        one_hot = F.one_hot(prepared.labels[idx], prepared.num_classes).to(prepared.probs.dtype)
        _, value_sum, target_sum = bin_sums(prepared.probs[idx].transpose(-1, -2), one_hot.transpose(-1, -2), edges)
        return calibration_error_from_sums(value_sum, target_sum, n).mean(-1)  # classwise ECE

    rows = max(1, _BLOCK_ENTRIES // row_entries)
    return torch.cat([evaluate(idx[start:start + rows]).to(torch.float64)
                      for idx in blocks for start in range(0, idx.shape[0], rows)])


def _looped_statistics(metric, x, y, blocks) -> torch.Tensor:
    values = []
    for idx in blocks:
        for row in idx:
            value = metric(x[row], y[row])
            if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_complex():
                value = value.item()
            if not is_number(value):
                raise TypeError(f"metric must return a float (or a one-element tensor), got {type(value).__name__}")
            values.append(float(value))
    return torch.tensor(values, dtype=torch.float64)


# ------------------------------------------------------------------------------------------------ public
def bootstrap_distribution(metric, inputs, labels, n_resamples: int = 1000, seed: int = 0, *,
                           ignore_index: int = -100) -> torch.Tensor:
    """The metric on each of ``n_resamples`` bootstrap resamples: a float64 CPU tensor ``(n_resamples,)``.

    ``metric(x, labels) -> float``; batched for the package's metrics (module docstring), called once per resample
    otherwise. ``inputs (..., C)`` with ``labels (...)`` (or ``(N,)`` with ``(N,)``); rows labelled ``ignore_index``
    are dropped before resampling. Deterministic for a given ``seed`` on a given device.
    """
    if not callable(metric):
        raise TypeError(f"metric must be a callable metric(x, labels) -> float, got {type(metric).__name__}")
    _check_int("n_resamples", n_resamples, 1)
    _check_int("seed", seed, 0)
    x, y = _rows(inputs, labels, ignore_index)
    blocks = _index_blocks(y.shape[0], n_resamples, seed, x.device)
    plan = _batched_plan(metric, ignore_index)
    if plan is not None and x.dim() == 2:
        statistics = _batched_statistics(*plan, x, y, ignore_index, blocks)
    else:
        statistics = _looped_statistics(metric, x, y, blocks)
    return statistics.cpu()


def _quantile(ordered: torch.Tensor, q: float) -> float:
    """Linear interpolation between the order statistics of sorted ``ordered`` at ``q`` (numpy's default method);
    equal neighbours return their value, so infinite statistics give infinite bounds, not NaN."""
    position = q * (ordered.shape[0] - 1)
    low = math.floor(position)
    high = min(low + 1, ordered.shape[0] - 1)
    below, above = float(ordered[low]), float(ordered[high])
    return below if below == above else below + (position - low) * (above - below)


def bootstrap(metric, inputs, labels, n_resamples: int = 1000, confidence: float = 0.95, seed: int = 0, *,
              ignore_index: int = -100) -> tuple[float, float]:
    """Percentile bootstrap interval ``(low, high)`` of ``metric(inputs, labels)`` at level ``confidence``.

    ``low`` and ``high`` are the ``(1 - confidence)/2`` and ``(1 + confidence)/2`` quantiles (linear interpolation,
    as ``numpy.percentile``) of the metric over ``n_resamples`` resamples of the evaluated rows drawn with
    replacement (Efron & Tibshirani 1993, ch. 13). See the module docstring for which metrics are evaluated in one
    batched pass and for the seeding.

    Args:
        metric: ``metric(x, labels) -> float``, e.g. ``ck.metrics.ece`` or ``functools.partial(ck.metrics.ece,
            n_bins=10)``.
        inputs: ``(..., C)`` logits or probabilities (or ``(N,)`` values); labels ``(...)`` (or ``(N,)``).
        n_resamples: R (default 1000). confidence: the interval's level in (0, 1) (default 0.95).
        seed: seeds the resampling generator on the inputs' device (default 0).
        ignore_index: rows with this label are dropped before resampling (default -100).

    Raises ``ValueError`` when the metric is NaN on some resample.
    """
    confidence = _check_confidence(confidence)
    statistics = bootstrap_distribution(metric, inputs, labels, n_resamples, seed, ignore_index=ignore_index)
    undefined = int(statistics.isnan().sum())
    if undefined:
        raise ValueError(f"the metric is NaN on {undefined} of {statistics.shape[0]} resamples; a percentile "
                         "interval of it is undefined")
    ordered = statistics.sort().values
    return _quantile(ordered, (1 - confidence) / 2), _quantile(ordered, (1 + confidence) / 2)


def bin_accuracy_band(inputs, labels, n_bins: int = 15, n_resamples: int = 200, confidence: float = 0.95,
                      seed: int = 0, *, inputs_are: str = "auto", ignore_index: int = -100) -> dict:
    """Percentile bootstrap band of the accuracy of each equal-width ECE bin (for reliability diagrams).

    For bin b, the ``(1 ∓ confidence)/2`` quantiles of ``acc(B_b)`` over the resamples in which the bin is not empty
    (``torch.nanquantile``, linear). Returns float64 CPU tensors ``low``, ``high`` of shape ``(n_bins,)``; NaN for
    a bin that is empty in the data.
    """
    check_n_bins(n_bins)
    confidence = _check_confidence(confidence)
    _check_int("n_resamples", n_resamples, 1)
    _check_int("seed", seed, 0)
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    scores, correct = confidence_and_correct(prepared)
    edges = equal_width_edges(n_bins, dtype=scores.dtype, device=scores.device)
    accuracies = []
    for idx in _index_blocks(prepared.num_samples, n_resamples, seed, scores.device):
        count, _, correct_sum = bin_sums(scores[idx], correct[idx], edges)
        accuracies.append(torch.where(count > 0, correct_sum / count.clamp_min(1), math.nan))
    q = torch.tensor([(1 - confidence) / 2, (1 + confidence) / 2], dtype=torch.float64, device=scores.device)
    low, high = torch.nanquantile(torch.cat(accuracies), q, dim=0).cpu()
    return {"low": low, "high": high}
