"""Reliability diagrams (Guo et al. 2017, Fig. 1): per-bin accuracy against confidence, with the gap and a histogram.

matplotlib is an optional dependency (``pip install calibkernels[train]`` or ``pip install matplotlib``); it is imported
only when a diagram is drawn. The figure is built with :class:`matplotlib.figure.Figure` directly, not ``pyplot``, so
drawing diagrams in a loop leaks no global figures and needs no display.
"""

from __future__ import annotations

import math

import torch

from .._validation.metric_inputs import check_n_bins, prepare
from .binned import bin_sums, calibration_error_from_sums, confidence_and_correct, equal_width_edges
from .bootstrap import bin_accuracy_band
from .smooth_ece import smooth_reliability_curve

__all__ = ["reliability_diagram", "reliability_bins"]


def _import_matplotlib():
    try:
        import matplotlib  # noqa: F401
        from matplotlib.figure import Figure
    except ImportError as error:
        raise ImportError(
            "reliability_diagram needs matplotlib, an optional dependency of calibkernels: "
            "pip install matplotlib (or pip install 'calibkernels[train]')"
        ) from error
    return Figure


def reliability_bins(inputs, labels, n_bins: int = 15, *, inputs_are: str = "auto", ignore_index: int = -100) -> dict:
    """Per-bin numbers behind the diagram, as float64 CPU tensors of shape ``(n_bins,)`` plus the ECE.

    Keys: ``edges`` (``n_bins + 1``), ``count``, ``accuracy`` and ``confidence`` (bin means; 0 for empty bins),
    ``ece`` (float), ``num_samples`` (int). Bins are the ECE's equal-width ``(lo, hi]`` bins.
    """
    check_n_bins(n_bins)
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    confidence, correct = confidence_and_correct(prepared)
    edges = equal_width_edges(n_bins, dtype=confidence.dtype, device=confidence.device)
    count, conf_sum, correct_sum = bin_sums(confidence, correct, edges)
    safe_count = count.clamp_min(1)
    return {
        "edges": edges.to(torch.float64).cpu(),
        "count": count.cpu(),
        "accuracy": (correct_sum / safe_count).cpu(),
        "confidence": (conf_sum / safe_count).cpu(),
        "ece": float(calibration_error_from_sums(conf_sum, correct_sum, prepared.num_samples)),
        "num_samples": prepared.num_samples,
    }


def reliability_diagram(inputs, labels, path=None, n_bins: int = 15, title: str | None = None, ax=None, *,
                        inputs_are: str = "auto", ignore_index: int = -100, dpi: int = 150, smooth: bool = False,
                        band: bool = False, n_resamples: int = 200, band_confidence: float = 0.95, seed: int = 0):
    """Draw a reliability diagram and return the matplotlib ``Figure`` (saved to ``path`` when given, in the format
    its suffix names: ``.png``, ``.pdf``, ``.svg``, …; PNG without a suffix).

    Top panel: bars of bin accuracy over equal-width confidence bins, the gap to the bin's mean confidence (red,
    hatched; above the bar = over-confident), and the diagonal of perfect calibration. Bottom panel: the share of
    samples per confidence bin, with dashed lines at the mean confidence and the accuracy. The title carries the ECE
    (in %). With ``ax`` given, the reliability panel is drawn on it and the histogram goes on a twin y-axis.

    ``smooth=True`` overlays the smoothed reliability curve of the smooth ECE (Błasiok & Nakkiran; see
    :func:`~calibkernels.metrics.smooth_ece.smooth_reliability_curve`), drawn where the kernel density of the
    confidences reaches half the peak of one isolated sample, and adds the smECE to the title. ``band=True`` draws,
    over each occupied bin, the percentile bootstrap interval of the bin's accuracy at level ``band_confidence``
    from ``n_resamples`` resamples drawn with ``seed`` (:func:`~calibkernels.metrics.bootstrap.bin_accuracy_band`).

    ``inputs (..., C)`` logits or probabilities, ``labels (...)``.
    """
    Figure = _import_matplotlib()
    stats = reliability_bins(inputs, labels, n_bins, inputs_are=inputs_are, ignore_index=ignore_index)
    edges = stats["edges"].numpy()
    lefts, width = edges[:-1], 1.0 / n_bins
    count = stats["count"].numpy()
    occupied = count > 0
    accuracy = stats["accuracy"].numpy()
    confidence = stats["confidence"].numpy()
    share = count / stats["num_samples"]
    mean_confidence = float((confidence * count).sum() / stats["num_samples"])
    mean_accuracy = float((accuracy * count).sum() / stats["num_samples"])

    if ax is None:
        figure = Figure(figsize=(5, 6), layout="constrained")
        reliability_ax, histogram_ax = figure.subplots(
            2, 1, sharex=True, gridspec_kw={"height_ratios": [3, 1]}
        )
    else:
        figure, reliability_ax = ax.figure, ax
        histogram_ax = ax.twinx()
        # Keep the faint histogram behind the reliability bars.
        reliability_ax.set_zorder(histogram_ax.get_zorder() + 1)
        reliability_ax.patch.set_visible(False)

    reliability_ax.bar(lefts[occupied], accuracy[occupied], width=width, align="edge", color="tab:blue",
                       edgecolor="black", linewidth=0.6, label="Accuracy")
    gap = confidence - accuracy
    reliability_ax.bar(lefts[occupied], gap[occupied], bottom=accuracy[occupied], width=width, align="edge",
                       color="tab:red", alpha=0.35, edgecolor="tab:red", hatch="//", linewidth=0.6,
                       label="Gap (confidence − accuracy)")
    if band:
        interval = bin_accuracy_band(inputs, labels, n_bins, n_resamples, band_confidence, seed,
                                     inputs_are=inputs_are, ignore_index=ignore_index)
        low, high = interval["low"].numpy(), interval["high"].numpy()
        reliability_ax.errorbar((lefts + width / 2)[occupied], ((low + high) / 2)[occupied],
                                yerr=((high - low) / 2)[occupied], fmt="none", ecolor="black", elinewidth=1.2,
                                capsize=3, label=f"{100 * band_confidence:g}% bootstrap interval of the accuracy")
    reliability_ax.plot([0, 1], [0, 1], linestyle="--", color="gray", linewidth=1, label="Perfect calibration")
    if smooth:
        curve = smooth_reliability_curve(inputs, labels, inputs_are=inputs_are, ignore_index=ignore_index)
        # Where the confidences have no data the curve is meaningless: hide it below half the density peak of one
        # isolated sample, 1 / (N sqrt(2π) σ).
        floor = 0.5 / (stats["num_samples"] * math.sqrt(2 * math.pi) * curve["bandwidth"])
        smoothed = torch.where(curve["density"] >= floor, curve["accuracy"], math.nan).numpy()
        reliability_ax.plot(curve["confidence"].numpy(), smoothed, color="tab:orange", linewidth=2,
                            label=f"Smoothed accuracy (σ = {curve['bandwidth']:.3f})")
    reliability_ax.set_xlim(0, 1)
    reliability_ax.set_ylim(0, 1)
    reliability_ax.set_ylabel("Accuracy")
    reliability_ax.legend(loc="upper left", fontsize="small")
    heading = f"ECE = {100 * stats['ece']:.2f}%  (N = {stats['num_samples']}, {n_bins} bins)"
    if smooth:
        heading = f"{heading}\nsmECE = {100 * curve['smooth_ece']:.2f}%"
    reliability_ax.set_title(f"{title}\n{heading}" if title else heading)

    if ax is None:
        histogram_ax.bar(lefts, share, width=width, align="edge", color="tab:gray", edgecolor="black", linewidth=0.6)
        histogram_ax.axvline(mean_confidence, color="tab:red", linestyle="--", linewidth=1,
                             label=f"mean confidence {mean_confidence:.3f}")
        histogram_ax.axvline(mean_accuracy, color="tab:blue", linestyle="--", linewidth=1,
                             label=f"accuracy {mean_accuracy:.3f}")
        histogram_ax.set_ylabel("Share of samples")
        histogram_ax.set_xlabel("Confidence")
        histogram_ax.legend(loc="upper left", fontsize="small")
    else:
        histogram_ax.bar(lefts, share, width=width, align="edge", color="tab:gray", alpha=0.25, zorder=0)
        histogram_ax.set_ylabel("Share of samples")
        histogram_ax.set_ylim(0, max(1.0, float(share.max())))
        reliability_ax.set_xlabel("Confidence")

    if path is not None:
        figure.savefig(path, dpi=dpi)  # the format from the suffix: a .pdf path must not hold PNG bytes
    return figure
