"""Streaming meters for the smooth ECE and the debiased calibration error (docs/metrics.md, 'Streaming meters'),
merged across DDP ranks.

>>> meter = SmoothECEMeter()
>>> for images, labels in loader:                      # doctest: +SKIP
...     meter.update(model(images), labels)
>>> meter.compute()                                     # doctest: +SKIP
0.0123

Both follow :class:`calibkernels.metrics.CalibrationMeter`: ``update(inputs, labels)`` with logits or probabilities
``(..., C)``, ``update_top_label(confidence, correct)`` with top-label data (e.g. a loss's ``return_stats``; NaN
confidences skipped, no host synchronisation; top-label mode only for the debiased meter), ``compute(sync=True)``
(a collective under ``torch.distributed``: every rank must call it), ``reset()``.
``compute()`` equals the batch function of the concatenated data, up to float64 summation order.

* :class:`SmoothECEMeter` keeps **constant** state. Spreading a sample onto the kernel grid is linear, so the grid of
  all samples is the sum of the grids of the batches; the automatic bandwidth's bisection visits about ten grid sizes
  (:func:`calibkernels.metrics.smooth_ece.automatic_grid_sizes`), and the meter keeps one ``(2, G)`` float64 grid of
  each (about 21,000 points, 330 kB; one grid with a fixed ``bandwidth``). Ranks merge with one ``all_reduce(SUM)``.
* :class:`DebiasedECEMeter` keeps every sample: its equal-mass bins are cut at midpoints of the *sorted* values of all
  samples, which no fixed-size summary determines. Top-label: 2 numbers per sample (confidence, correctness);
  marginal: the ``C`` probabilities and the label. Ranks are gathered with ``all_gather`` (unequal sizes allowed).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._validation.metric_inputs import check_n_bins, prepare
from .binned import confidence_and_correct
from .debiased import check_mode, marginal_error, top_label_error
from .smooth_ece import (
    _smooth_ece_of_grid,
    _spread,
    automatic_grid_sizes,
    automatic_smooth_ece_of_grids,
    check_bandwidth,
    curve_from_grid,
    grid_points,
)
from .streaming import _distributed_world_size, agree_on_width, all_gather_rows, check_top_label, communication_device

__all__ = ["DebiasedECEMeter", "SmoothECEMeter"]


class SmoothECEMeter:
    """Streaming :func:`calibkernels.metrics.smooth_ece` (top-label smooth ECE, automatic bandwidth by default).

    Args:
        bandwidth: ``None`` (automatic σ*) or a fixed σ >= 1e-4, as for :func:`~calibkernels.metrics.smooth_ece`.
        inputs_are, ignore_index: as for every metric (:mod:`calibkernels._validation.metric_inputs`).

    ``compute(sync=True, return_bandwidth=False)`` returns the smooth ECE (or ``(smECE, σ)``); ``curve(sync=True)``
    the dict of :func:`~calibkernels.metrics.smooth_reliability_curve`.
    """

    def __init__(self, bandwidth: float | None = None, *, inputs_are: str = "auto", ignore_index: int = -100):
        self.bandwidth = check_bandwidth(bandwidth)
        self.inputs_are, self.ignore_index = inputs_are, ignore_index
        self.sizes = automatic_grid_sizes() if self.bandwidth is None else [grid_points(self.bandwidth)]
        self.reset()

    def reset(self) -> None:
        """Forget every batch seen so far."""
        self._grids = None  # (2, Σ sizes) float64: residual and count grids of every size, side by side
        self._num_from_update = 0
        self._num_from_top_label = None  # float64 0-dim tensor on the grids' device, counted without a host sync

    @property
    def num_samples(self) -> int:
        """Samples added on this rank (reading it after :meth:`update_top_label` synchronises with the device)."""
        extra = 0 if self._num_from_top_label is None else int(self._num_from_top_label)
        return self._num_from_update + extra

    @torch.no_grad()
    def update(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: ``inputs (..., C)`` logits or probabilities, ``labels (...)`` class indices."""
        prepared = prepare(inputs, labels, self.inputs_are, self.ignore_index, allow_empty=True)
        if self._grids is None:
            self._grids = torch.zeros(2, sum(self.sizes), dtype=torch.float64, device=prepared.probs.device)
        if prepared.num_samples == 0:
            return
        confidence, correct = confidence_and_correct(prepared)
        spread = [_spread(confidence[None], correct[None], size)[:, 0] for size in self.sizes]
        self._grids += torch.cat(spread, dim=-1).to(self._grids.device)
        self._num_from_update += prepared.num_samples

    @torch.no_grad()
    def update_top_label(self, confidence: torch.Tensor, correct: torch.Tensor) -> None:
        """Add samples given by their top-label ``confidence (...)`` and ``correct (...)`` (bool or 0/1), e.g. a
        loss's ``stats.confidence`` and ``stats.prediction == labels``; NaN confidences (ignored rows) are skipped.
        On the device, without a host synchronisation."""
        confidence, correct = check_top_label(confidence, correct)
        if self._grids is None:
            self._grids = torch.zeros(2, sum(self.sizes), dtype=torch.float64, device=confidence.device)
            self._num_from_top_label = torch.zeros((), dtype=torch.float64, device=confidence.device)
        elif self._num_from_top_label is None:
            self._num_from_top_label = torch.zeros((), dtype=torch.float64, device=self._grids.device)
        counted = ~confidence.isnan()
        confidence = torch.where(counted, confidence, torch.zeros((), dtype=confidence.dtype,
                                                                  device=confidence.device))
        weight = counted.to(torch.float64)[None]
        spread = [_spread(confidence[None], correct[None], size, weight)[:, 0] for size in self.sizes]
        self._grids += torch.cat(spread, dim=-1).to(self._grids.device)
        self._num_from_top_label += weight.sum().to(self._grids.device)

    def _merged(self, sync: bool):
        """``(grids (2, Σ sizes), N)`` over every rank (``sync``) or this one."""
        if sync and _distributed_world_size() > 1:
            comm = communication_device()
            grids = (self._grids if self._grids is not None else
                     torch.zeros(2, sum(self.sizes), dtype=torch.float64)).to(comm)
            flat = torch.cat([grids.reshape(-1), torch.tensor([float(self.num_samples)], dtype=torch.float64,
                                                              device=comm)])
            dist.all_reduce(flat, op=dist.ReduceOp.SUM)
            grids, total = flat[:-1].view(2, -1), int(flat[-1])
        else:
            grids, total = self._grids, self.num_samples
        if total == 0:
            raise ValueError("SmoothECEMeter.compute(): no samples were added (call update() first)")
        return grids, total

    @staticmethod
    def _grid_lookup(grids, sizes):
        offsets, start = {}, 0
        for size in sizes:
            offsets[size] = (start, start + size)
            start += size
        return lambda size: grids[:, None, offsets[size][0]:offsets[size][1]]  # (2, 1, G)

    def _evaluate(self, sync: bool):
        grids, total = self._merged(sync)
        grid_of_size = self._grid_lookup(grids, self.sizes)
        if self.bandwidth is None:
            value, sigma = automatic_smooth_ece_of_grids(grid_of_size, 1, grids.device)
            value, sigma = float(value[0]), float(sigma[0])
        else:
            sigma = self.bandwidth
            value = float(_smooth_ece_of_grid(grid_of_size(self.sizes[0]), sigma)[0])
        return value, sigma, grid_of_size, total

    @torch.no_grad()
    def compute(self, *, sync: bool = True, return_bandwidth: bool = False):
        """The smooth ECE of everything seen (merged over ranks with ``sync=True``), or ``(smECE, σ)``."""
        value, sigma, _, _ = self._evaluate(sync)
        return (value, sigma) if return_bandwidth else value

    @torch.no_grad()
    def curve(self, *, sync: bool = True) -> dict:
        """The smoothed reliability curve of everything seen
        (:func:`~calibkernels.metrics.smooth_reliability_curve`)."""
        value, sigma, grid_of_size, total = self._evaluate(sync)
        return curve_from_grid(grid_of_size(grid_points(sigma)), sigma, value, total)

    def __repr__(self) -> str:
        return f"SmoothECEMeter(bandwidth={self.bandwidth}, num_samples={self.num_samples})"


class DebiasedECEMeter:
    """Streaming :func:`calibkernels.metrics.debiased_ece` (Kumar, Liang & Ma's debiased L2 calibration error).

    Args:
        n_bins: equal-mass bins (``min(n_bins, N)``), as for :func:`~calibkernels.metrics.debiased_ece`.
        mode: ``"top-label"`` (keeps 2 numbers per sample) or ``"marginal"`` (keeps ``C + 1`` per sample).
        inputs_are, ignore_index: as for every metric.
    """

    def __init__(self, n_bins: int = 15, mode: str = "top-label", *, inputs_are: str = "auto",
                 ignore_index: int = -100):
        self.n_bins = check_n_bins(n_bins)
        self.mode = check_mode(mode)
        self.inputs_are, self.ignore_index = inputs_are, ignore_index
        self.reset()

    def reset(self) -> None:
        """Forget every batch seen so far."""
        self.num_classes: int | None = None
        self._values: list[torch.Tensor] = []  # top-label: confidence; marginal: probabilities (n, C)
        self._targets: list[torch.Tensor] = []  # top-label: correctness; marginal: labels
        self._dtype = torch.float32
        self._fed_top_label = False  # update_top_label's batches keep their skipped rows as NaN confidences

    @property
    def num_samples(self) -> int:
        """Samples added on this rank (reading it after :meth:`update_top_label` synchronises with the device)."""
        if self._fed_top_label:
            return sum(int((~values.isnan()).sum()) for values in self._values)
        return sum(values.shape[0] for values in self._values)

    @torch.no_grad()
    def update(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: ``inputs (..., C)`` logits or probabilities, ``labels (...)`` class indices."""
        prepared = prepare(inputs, labels, self.inputs_are, self.ignore_index, allow_empty=True)
        if self.num_classes is None:
            self.num_classes = prepared.num_classes
        elif prepared.num_classes != self.num_classes:
            raise ValueError(f"batch has {prepared.num_classes} classes, earlier batches had {self.num_classes}")
        if prepared.num_samples == 0:
            return
        self._dtype = prepared.probs.dtype
        if self.mode == "marginal":
            self._values.append(prepared.probs)
            self._targets.append(prepared.labels)
        else:
            confidence, correct = confidence_and_correct(prepared)
            self._values.append(confidence)
            self._targets.append(correct)

    @torch.no_grad()
    def update_top_label(self, confidence: torch.Tensor, correct: torch.Tensor) -> None:
        """Add samples given by their top-label ``confidence (...)`` and ``correct (...)`` (bool or 0/1), e.g. a
        loss's ``stats.confidence`` and ``stats.prediction == labels``; NaN confidences (ignored rows) are skipped
        (kept until :meth:`compute`, so that adding them needs no host synchronisation). ``mode="top-label"`` only:
        the marginal error needs every class's probability (``ValueError``)."""
        if self.mode != "top-label":
            raise ValueError("DebiasedECEMeter(mode='marginal') needs every class's probability: pass logits or "
                             "probabilities to update(), or use mode='top-label' for top-label data")
        confidence, correct = check_top_label(confidence, correct)
        self._fed_top_label = True
        self._dtype = confidence.dtype
        self._values.append(confidence)
        self._targets.append(correct.to(confidence.dtype))

    def _local(self):
        """This rank's samples as ``(n, w)`` float64 rows: (confidence, correct) or (p_1..p_C, label)."""
        if not self._values:
            return None
        values, targets = torch.cat(self._values), torch.cat(self._targets)
        values = values[:, None] if values.dim() == 1 else values
        rows = torch.cat([values.to(torch.float64), targets.to(torch.float64)[:, None]], dim=1)
        return rows[~rows[:, 0].isnan()] if self._fed_top_label else rows

    @torch.no_grad()
    def compute(self, *, sync: bool = True) -> float:
        """The debiased calibration error of everything seen (merged over ranks with ``sync=True``)."""
        rows = self._local()
        if sync and _distributed_world_size() > 1:
            comm = communication_device()
            # a rank fed top-label data only knows no class count; the top-label rows are 2 wide regardless
            num_classes = agree_on_width(self.num_classes, comm, "DebiasedECEMeter",
                                         allow_unknown=self.mode == "top-label")
            width = num_classes + 1 if self.mode == "marginal" else 2
            local = rows if rows is not None else torch.zeros(0, width, dtype=torch.float64)
            rows = all_gather_rows(local.to(comm))
        if rows is None or rows.shape[0] == 0:
            raise ValueError("DebiasedECEMeter.compute(): no samples were added (call update() first)")
        values, targets = rows[:, :-1].to(self._dtype), rows[:, -1]
        if self.mode == "marginal":
            return float(marginal_error(values, targets.long(), self.n_bins))
        return float(top_label_error(values[:, 0], targets.to(self._dtype), self.n_bins))

    def __repr__(self) -> str:
        return f"DebiasedECEMeter(n_bins={self.n_bins}, mode={self.mode!r}, num_samples={self.num_samples})"
