"""Fitting the temperature of temperature scaling (docs/metrics.md, 'Temperature scaling'; Guo et al., "On Calibration
of Modern Neural Networks", ICML 2017); public as :mod:`calibkernels.calibration`, and the fit of
:class:`calibkernels.posthoc.TemperatureScaling`.

Calibrated probabilities are ``softmax(z / T)`` with one scalar ``T > 0`` fitted on a held-out split (never the test
split). ``T`` does not change the arg-max, so accuracy is unchanged. Two objectives:

* ``"ece"`` (default; what the BSCE-GRA paper and Mukhoti et al. report): ``T* = argmin_{T ∈ grid} ECE(z / T)`` over a
  grid, default 0.01, 0.02, …, 10.00. The ECE of every grid point is computed in one vectorised pass — the
  confidences of a chunk of temperatures at once, ``(G_chunk, N)`` from a ``(G_chunk, C, N)`` block, the chunk sized
  to bound memory (:func:`ece_over_temperatures`) — and ties go to the smallest T.
* ``"nll"``: ``T* = argmin_T NLL(z / T)`` by L-BFGS on ``log T`` (so T stays positive), in float64.

Report "pre-T" and "post-T" metrics with the same T for every metric (:func:`evaluate_temperature_scaling`).

Non-finite logits follow the metrics' policy (:mod:`calibkernels._validation.metric_inputs`), for both objectives:
``-inf`` is a masked class, probability 0 at every T (the fit equals the fit with the class's logit made very negative);
``+inf`` or NaN logits, and rows whose every class is ``-inf``, raise ``ValueError``. A label on a masked class is a
wrong prediction for the ECE objective; for the NLL objective it makes the NLL infinite at every T and raises
``ValueError``. Rows whose label equals ``ignore_index`` (default -100, as the metrics) are left out and may hold
anything. A fit needs ``C >= 2`` classes (with one class every T gives the same probabilities).
"""

from __future__ import annotations

import math
import os
import sys
import warnings

import torch
import torch.nn.functional as F

from ._validation import check_ignore_index, is_number
from .metrics import calibration_metrics
from ._validation.metric_inputs import check_logits, check_n_bins, check_positive_int, compute_dtype, labelled_rows
from .metrics.binned import bin_sums, calibration_error_from_sums, equal_width_edges

__all__ = [
    "DEFAULT_GRID_STEP",
    "ece_over_temperatures",
    "evaluate_temperature_scaling",
    "fit_temperature",
    "temperature_grid",
]

OBJECTIVES = ("ece", "nll")
DEFAULT_GRID_START, DEFAULT_GRID_STOP, DEFAULT_GRID_STEP = 0.01, 10.0, 0.01
# Elements of the (temperatures, N, C) block evaluated at once: 2^24 float32 = 64 MiB per temporary.
DEFAULT_CHUNK_ELEMENTS = 2**24


def temperature_grid(start: float = DEFAULT_GRID_START, stop: float = DEFAULT_GRID_STOP,
                     step: float = DEFAULT_GRID_STEP) -> torch.Tensor:
    """``start, start + step, …`` up to ``stop`` (inclusive, to within a rounding of the division) as float64, every
    value in ``[start, stop]``.

    Where ``start`` is a multiple ``k · step`` of the step, each value is the nearest double to ``j · step``, built as
    integers ``k, k + 1, …`` times ``step`` (divided by ``1 / step`` where that is an integer), so 0.07 is 0.07, not
    0.07000000000000001; otherwise ``start + j · step``. ``start``, ``stop`` and ``step`` must be finite numbers
    (``TypeError`` for non-numbers).
    """
    for name, value in (("start", start), ("stop", stop), ("step", step)):
        if not is_number(value):
            raise TypeError(f"temperature grid {name} must be a number, got {type(value).__name__}")
    if not (step > 0 and start > 0 and stop >= start and math.isfinite(stop) and math.isfinite(step)):
        raise ValueError(f"temperature grid needs finite 0 < start <= stop and step > 0, got {start}, {stop}, {step}")
    slack = 1e-9  # relative to the step: stop/step = 999.9999999999999 still reaches stop
    ratio = start / step
    if abs(ratio - round(ratio)) >= slack:
        count = math.floor((stop - start) / step + slack) + 1
        return (start + step * torch.arange(count, dtype=torch.float64)).clamp(max=stop)
    first = round(ratio)
    steps = torch.arange(first, math.floor(stop / step + slack) + 1, dtype=torch.float64)
    # Dividing by 1/step keeps decimal steps exact (7 / 100 == 0.07, whereas 7 * 0.01 == 0.07000000000000001).
    inverse = 1.0 / step
    grid = steps / inverse if abs(inverse - round(inverse)) < 1e-9 else steps * step
    return grid.clamp(max=stop)


def _check_logits_labels(logits, labels, ignore_index: int = -100):
    """``(z (N, C), y (N,))`` of the rows whose label is not ``ignore_index``: ``z`` in the metrics' compute dtype."""
    if not isinstance(logits, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("logits and labels must be torch.Tensors")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must hold integer class indices, got {labels.dtype}")
    check_ignore_index(ignore_index)
    if logits.dim() < 2 or tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"expected logits (..., C) and labels (...), got {tuple(logits.shape)} and "
                         f"{tuple(labels.shape)}")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits are on {logits.device}")
    num_classes = logits.shape[-1]
    if num_classes < 2:
        # softmax(z / T) = 1 for every T: no fit to make (the NLL fit would stop at T = 1, the ECE one at the grid's
        # smallest T, and both would look like answers)
        raise ValueError(f"temperature scaling needs at least 2 classes, got {num_classes}")
    z = logits.detach().reshape(-1, num_classes).to(compute_dtype(logits.dtype))
    y = labels.detach().reshape(-1).long()
    z, y, rows = labelled_rows(z, y, ignore_index, num_classes, "a temperature")
    check_logits(z, rows)  # -inf (masked) is fine; +inf, NaN and fully masked rows raise
    return z, y


def _outside_stacklevel() -> int:
    """``stacklevel`` for ``warnings.warn`` called right here that names the first frame outside this module and
    :mod:`calibkernels.posthoc`, i.e. the user's call, whichever public function was entered."""
    ours = {os.path.normcase(os.path.abspath(__file__)),
            os.path.normcase(os.path.join(os.path.dirname(os.path.abspath(__file__)), "posthoc.py"))}
    frame, level = sys._getframe(1), 1
    while frame is not None and os.path.normcase(os.path.abspath(frame.f_code.co_filename)) in ours:
        frame, level = frame.f_back, level + 1
    return level


def check_grid(grid) -> torch.Tensor:
    """A grid of temperatures as a 1-D float64 CPU tensor (``None``: :func:`temperature_grid`'s default); every
    temperature positive and finite."""
    if grid is None:
        return temperature_grid()
    try:
        grid = torch.as_tensor(grid, dtype=torch.float64).detach().cpu().reshape(-1)
    except (TypeError, ValueError, RuntimeError) as error:
        raise TypeError(f"grid must be a 1-D tensor (or sequence) of temperatures, got "
                        f"{type(grid).__name__}") from error
    if grid.numel() == 0:
        raise ValueError("the temperature grid is empty")
    if not bool(((grid > 0) & grid.isfinite()).all()):
        raise ValueError("every temperature in the grid must be positive and finite")
    return grid


def ece_over_temperatures(logits, labels, temperatures, n_bins: int = 15, *,
                          chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, ignore_index: int = -100) -> torch.Tensor:
    """``ECE(softmax(z / T))`` for every ``T`` in ``temperatures (G,)``, as a float64 CPU tensor ``(G,)``; rows whose
    label is ``ignore_index`` are left out.

    Same definition and conventions as :func:`calibkernels.metrics.ece` (float32 ``(lo, hi]`` equal-width bins,
    ``|B_b|/N`` over all N). Vectorised over the grid: chunks of ``G_c = chunk_elements // (N·C)`` temperatures are
    evaluated at once on the logits' device.

    Two facts make one pass cheap: the arg-max (hence correctness) does not depend on ``T > 0``, and the confidence is
    ``max_k softmax(z / T)_k = 1 / Σ_k exp((z_k - z_max) / T)``, one ``exp`` per logit and temperature over a
    contiguous ``(G_c, C, N)`` block. This form is slightly *more* accurate than ``softmax(z / T)`` in float32 (it
    subtracts the max before scaling), so it agrees with ``metrics.ece(z / T)`` up to float32 rounding of the
    confidences (exactly, for practical purposes, with float64 logits).
    """
    check_n_bins(n_bins)
    check_positive_int(chunk_elements, "chunk_elements")
    z, y = _check_logits_labels(logits, labels, ignore_index)
    temperatures = check_grid(temperatures)
    num_samples, num_classes = z.shape
    edges = equal_width_edges(n_bins, dtype=z.dtype, device=z.device)
    max_logit, prediction = z.max(dim=1)
    correct = (prediction == y).to(z.dtype)
    # exp((z - max) / T) with z = max contributes exactly 1; -inf logits (masked classes) contribute exactly 0.
    below_max = (z - max_logit[:, None]).T.contiguous()  # (C, N): the class reduction runs over contiguous rows
    chunk = max(1, chunk_elements // (num_samples * num_classes))
    results = []
    for block in temperatures.split(chunk):  # a loop over blocks of the grid (to bound memory), not over samples
        inverse_t = (1.0 / block).to(device=z.device, dtype=z.dtype)
        confidence = torch.exp(below_max[None] * inverse_t[:, None, None]).sum(dim=1).reciprocal_()  # (G_c, N)
        _, value_sum, target_sum = bin_sums(confidence, correct.expand_as(confidence), edges)
        results.append(calibration_error_from_sums(value_sum, target_sum, num_samples))
    return torch.cat(results).cpu()


def _fit_nll_temperature(z: torch.Tensor, y: torch.Tensor, max_iter: int = 100) -> float:
    """argmin_T mean CE(z / T, y) by L-BFGS (strong Wolfe line search) on log T, from T = 1, in float64.

    ``-inf`` logits (masked classes) stay ``-inf`` at every T: they are scaled as 0 and put back afterwards, because
    ``-inf · exp(-log T)`` has a NaN derivative in ``log T``.
    """
    masked = z == -math.inf
    label_masked = masked.gather(1, y[:, None]).squeeze(1)
    if bool(label_masked.any()):
        row = int(label_masked.nonzero()[0, 0])
        raise ValueError(f"the label of row {row} (of the rows fitted) is a masked class (logit -inf, or "
                         "probability 0): its NLL is +inf at every temperature, so there is no NLL-optimal T. Drop "
                         "such rows (or set their labels to ignore_index) or use objective='ece'")
    any_masked = bool(masked.any())
    z64 = z.to(torch.float64).masked_fill(masked, 0.0)
    log_temperature = torch.zeros((), dtype=torch.float64, device=z.device, requires_grad=True)
    optimizer = torch.optim.LBFGS([log_temperature], lr=1.0, max_iter=max_iter, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-12, tolerance_change=1e-14)

    def closure():
        optimizer.zero_grad()
        scaled = z64 * torch.exp(-log_temperature)
        loss = F.cross_entropy(scaled.masked_fill(masked, -math.inf) if any_masked else scaled, y)
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
    temperature = math.exp(float(log_temperature.detach()))
    if not math.isfinite(temperature) or temperature <= 0:
        raise RuntimeError(f"NLL temperature fit diverged (T = {temperature}); are the logits finite?")
    why = _unbounded_nll_temperature(z64, y, masked)
    if why is not None:
        warnings.warn(f"the NLL of softmax(z / T) has no minimum at a finite T > 0 on this calibration split: {why}; "
                      f"T = {temperature:.3g} is where L-BFGS stopped, not an optimum (use objective='ece', or a "
                      "larger calibration split)", RuntimeWarning, stacklevel=_outside_stacklevel())
    return temperature


def _unbounded_nll_temperature(z64: torch.Tensor, y: torch.Tensor, masked: torch.Tensor) -> str | None:
    """Why the mean NLL of ``softmax(z / T)`` has no minimiser at a finite ``T > 0``, or ``None``.

    In ``β = 1/T`` the NLL is convex, with derivative ``mean_i (E_{p_β}[z_i] - z_{i,y_i})``. As ``β → ∞`` that tends
    to ``mean_i (max_k z_ik - z_{i,y_i}) >= 0``, which is 0 exactly when every label holds its row's largest logit:
    the NLL then falls all the way to ``T → 0``. At ``β = 0`` it is ``mean_i (mean_k z_ik - z_{i,y_i})`` (the mean
    over the unmasked classes); where that is ``>= 0`` the NLL only rises from ``T = ∞``. ``z64`` has its masked
    entries (``masked``) set to 0.
    """
    z_label = z64.gather(1, y[:, None]).squeeze(1)
    if bool((z_label >= z64.masked_fill(masked, -math.inf).amax(dim=1)).all()):
        return "every label is its row's largest logit (the NLL falls all the way to T -> 0)"
    row_means = z64.sum(dim=1) / (~masked).sum(dim=1)
    if float((row_means - z_label).mean()) >= 0:
        return ("the labels' logits are at or below their rows' mean logit on average (the NLL falls all the way "
                "to T -> infinity)")
    return None


def fit_temperature(logits, labels, objective: str = "ece", grid=None, n_bins: int = 15, *,
                    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS, ignore_index: int = -100) -> float:
    """Fit the temperature ``T`` of ``softmax(logits / T)`` on held-out ``logits (..., C)`` / ``labels (...)``.

    ``objective="ece"``: the grid point (default 0.01…10.00, step 0.01; any 1-D positive ``grid`` accepted) with the
    lowest ECE (``n_bins`` bins), the smallest such T on ties. ``objective="nll"``: L-BFGS on ``log T`` (``grid`` and
    ``n_bins`` unused). Returns a Python float. Rows whose label is ``ignore_index`` are left out.

    ``-inf`` logits are masked classes (probability 0); ``+inf`` or NaN logits, a row of only ``-inf``, fewer than 2
    classes and (NLL objective) a label on a masked class raise ``ValueError``. ``T`` is a temperature of **logits**:
    to calibrate probabilities ``p``, pass ``ln p`` and apply ``T`` to ``ln p`` (or use
    :class:`calibkernels.posthoc.TemperatureScaling`, which takes either).
    """
    if not isinstance(objective, str) or objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    check_n_bins(n_bins)
    check_positive_int(chunk_elements, "chunk_elements")
    z, y = _check_logits_labels(logits, labels, ignore_index)
    if objective == "nll":
        return _fit_nll_temperature(z, y)
    temperatures = check_grid(grid)
    errors = ece_over_temperatures(z, y, temperatures, n_bins, chunk_elements=chunk_elements)
    best = temperatures[errors == errors.min()].min()
    return float(best)


def evaluate_temperature_scaling(calibration_logits, calibration_labels, test_logits, test_labels,
                                 objective: str = "ece", grid=None, n_bins: int = 15, *,
                                 ignore_index: int = -100) -> dict:
    """Fit T on the calibration split, then every metric on the test split before and after scaling by that same T.

    Returns ``{"temperature": T, "pre": {...}, "post": {...}}`` with the keys of
    :data:`calibkernels.metrics.METRIC_KEYS` (fractions). Rows labelled ``ignore_index`` are left out of both splits.
    The two splits must be different data (docs/metrics.md, 'Temperature scaling').
    """
    temperature = fit_temperature(calibration_logits, calibration_labels, objective=objective, grid=grid,
                                  n_bins=n_bins, ignore_index=ignore_index)
    return {
        "temperature": temperature,
        "pre": calibration_metrics(test_logits, test_labels, n_bins, inputs_are="logits", ignore_index=ignore_index),
        # scaled in the metrics' compute dtype: a 16-bit z / T would round the scaled logits first
        "post": calibration_metrics(test_logits.to(compute_dtype(test_logits.dtype)) / temperature, test_labels,
                                    n_bins, inputs_are="logits", ignore_index=ignore_index),
    }
