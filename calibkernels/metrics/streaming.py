"""Streaming calibration metrics for evaluation loops, merged across DDP ranks.

>>> meter = CalibrationMeter(n_bins=15)
>>> for images, labels in loader:                      # doctest: +SKIP
...     meter.update(model(images), labels)
>>> meter.compute()                                     # doctest: +SKIP
{'accuracy': 0.93, 'ece': 0.012, 'adaece': 0.011, 'classwise_ece': 0.002, 'mce': 0.08, 'nll': 0.24, 'brier': 0.11}

State (all float64, on the device of the first batch):

* equal-width bins: per-bin count, Σ confidence, Σ correct — ``3·M`` numbers (ECE, MCE);
* classwise: the same per class and bin — ``3·C·M`` numbers;
* scalars: N, Σ NLL, Σ Brier, Σ correct.

These are sums, so merging ranks is one ``all_reduce(SUM)``, and ``compute()`` equals the functional metrics of the
concatenated data (up to float64 summation order). **AdaECE is the exception**: its equal-count edges need the sorted
confidences of *all* samples, so the meter keeps every sample's confidence and correctness (O(N) memory: 2 numbers per
sample) and gathers them across ranks with ``all_gather`` (ranks may hold different numbers of samples). Pass
``track_adaptive=False`` to keep the memory constant; ``compute()["adaece"]`` is then NaN.

**Top-label data.** ``update_top_label(confidence, correct)`` adds samples known only by their top-label confidence and
correctness, e.g. the statistics a loss returns with ``return_stats=True`` (docs/metrics.md, 'Monitor calibration
while training'): the same equal-width bins and scalars, with no host synchronisation. ECE, MCE, accuracy and AdaECE
need nothing else; classwise ECE, NLL and the Brier score need every class's probability, so once any sample came in
this way ``compute()`` leaves those three keys out (:data:`PER_CLASS_KEYS`) rather than report them over part of the
samples.

Under ``torch.distributed`` (initialised, world size > 1) ``compute()`` is a collective: every rank must call it. The
communication runs on CUDA for the NCCL backend and on CPU otherwise (gloo, mpi).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .._validation.metric_inputs import check_n_bins, prepare
from .binned import (
    adaptive_calibration_error,
    bin_sums,
    brier_sum,
    calibration_error_from_sums,
    classwise_sums,
    confidence_and_correct,
    equal_width_edges,
    max_calibration_error_from_sums,
    nll_sum,
)

__all__ = ["CalibrationMeter", "METRIC_KEYS", "PER_CLASS_KEYS", "calibration_metrics", "all_gather_rows",
           "agree_on_width", "communication_device", "check_top_label"]

METRIC_KEYS = ("accuracy", "ece", "adaece", "classwise_ece", "mce", "nll", "brier")
# The metrics that need every class's probability, not just the top label's (left out after update_top_label).
PER_CLASS_KEYS = ("classwise_ece", "nll", "brier")
_NUM_SCALARS = 4  # N, Σ NLL, Σ Brier, Σ correct


def _distributed_world_size() -> int:
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return 1


# ----------------------------------------------------------------------------------------------- DDP helpers
def communication_device():
    """Where collectives run: the current CUDA device for NCCL, the CPU otherwise (gloo, mpi)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def agree_on_width(known: int | None, comm, owner: str, what: str = "classes", *, allow_unknown: bool = False) -> int:
    """The width (number of classes) every rank agrees on; a rank that saw no batch passes ``None``. Raises
    ``ValueError`` when two ranks disagree (mismatched shapes would hang a later collective) or no rank knows it;
    with ``allow_unknown`` the latter returns 0 (meters fed top-label data only never learn the class count)."""
    known = known or 0
    width_range = torch.tensor([known, -(known or 2**62)], dtype=torch.int64, device=comm)
    dist.all_reduce(width_range, op=dist.ReduceOp.MAX)
    width, smallest_known = int(width_range[0]), -int(width_range[1])
    if width == 0:
        if allow_unknown:
            return 0
        raise ValueError(f"{owner}.compute(): no rank has seen any samples")
    if smallest_known != width:
        raise ValueError(f"ranks disagree on the number of {what} ({smallest_known} vs {width})")
    return width


def check_top_label(confidence, correct):
    """Validate top-label data for a meter's ``update_top_label``: ``confidence (...)`` floating, ``correct (...)``
    bool or 0/1 numbers, same shape and device. Returns both flattened, ``confidence`` in float32 (float64 stays
    float64) and ``correct`` in the same dtype. No values are checked (that would synchronise with the device)."""
    if not isinstance(confidence, torch.Tensor) or not isinstance(correct, torch.Tensor):
        raise TypeError(f"confidence and correct must be tensors, got {type(confidence).__name__} and "
                        f"{type(correct).__name__}")
    if not confidence.is_floating_point():
        raise TypeError(f"confidence must be floating point, got {confidence.dtype}")
    if correct.is_complex():
        raise TypeError(f"correct must be bool or 0/1 numbers, got {correct.dtype}")
    if tuple(correct.shape) != tuple(confidence.shape):
        raise ValueError(f"correct has shape {tuple(correct.shape)} but confidence has {tuple(confidence.shape)}")
    if correct.device != confidence.device:
        raise ValueError(f"correct is on {correct.device} but confidence is on {confidence.device}")
    dtype = torch.float64 if confidence.dtype == torch.float64 else torch.float32
    confidence = confidence.detach().reshape(-1).to(dtype)
    return confidence, correct.detach().reshape(-1).to(dtype)


def all_gather_rows(packed: torch.Tensor) -> torch.Tensor:
    """Concatenate the ``(n_r, w)`` float64 rows of every rank in rank order, on every rank (``n_r`` may differ:
    padded to the longest, then trimmed). ``packed`` lives on the communication device."""
    world = dist.get_world_size()
    size = torch.tensor([packed.shape[0]], dtype=torch.int64, device=packed.device)
    sizes = [torch.zeros_like(size) for _ in range(world)]
    dist.all_gather(sizes, size)
    sizes = [int(s) for s in sizes]
    padded = torch.zeros(max(sizes), packed.shape[1], dtype=packed.dtype, device=packed.device)
    padded[: packed.shape[0]] = packed
    gathered = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(gathered, padded)
    return torch.cat([g[:s] for g, s in zip(gathered, sizes)])


class CalibrationMeter:
    """Accumulates ECE, AdaECE, classwise ECE, MCE, NLL, Brier score and accuracy over batches (docs/metrics.md).

    Args:
        n_bins: bins of every binned metric (equal-width ``(lo, hi]`` bins on float32 ``linspace(0, 1, n_bins + 1)``,
            equal-count bins for AdaECE; see :mod:`calibkernels.metrics.binned`).
        inputs_are: ``"auto" | "logits" | "probs"``, decided per batch (see
            :mod:`calibkernels._validation.metric_inputs`).
        ignore_index: label of rows to skip.
        track_adaptive: keep per-sample confidences for AdaECE (O(N) memory); ``False`` makes the memory constant.

    ``update(inputs, labels)`` takes ``(..., C)`` logits or probabilities and ``(...)`` labels;
    ``update_top_label(confidence, correct)`` takes top-label data instead (module docstring); ``compute()`` returns a
    dict of Python floats with keys :data:`METRIC_KEYS` (fractions, not percentages; without :data:`PER_CLASS_KEYS`
    once top-label data was added); ``reset()`` clears the state;
    ``state_dict()`` / ``load_state_dict()`` save and restore it, ``merge_state(other)`` adds another meter's samples.
    """

    def __init__(self, n_bins: int = 15, *, inputs_are: str = "auto", ignore_index: int = -100,
                 track_adaptive: bool = True):
        self.n_bins = check_n_bins(n_bins)
        self.inputs_are = inputs_are
        self.ignore_index = ignore_index
        self.track_adaptive = bool(track_adaptive)
        self.reset()

    def reset(self) -> None:
        """Forget every batch seen so far."""
        self.num_classes: int | None = None
        self._bins = None  # (3, M): count, Σ confidence, Σ correct
        self._classwise = None  # (3, C, M): count, Σ p_k, Σ 1[y = k]
        self._scalars = None  # (4,): N, Σ NLL, Σ Brier, Σ correct
        self._confidences: list[torch.Tensor] = []
        self._correct: list[torch.Tensor] = []
        self._confidence_dtype = torch.float32
        self._fed_top_label = False  # some samples came through update_top_label: no per-class metrics

    @property
    def num_samples(self) -> int:
        """Samples accumulated on this rank."""
        return 0 if self._scalars is None else int(self._scalars[0])

    def _allocate(self, num_classes: int | None, device) -> None:
        """The bins and scalars on ``device`` if not there yet, then (``num_classes`` given) the classwise sums."""
        if self._bins is None:
            self._bins = torch.zeros(3, self.n_bins, dtype=torch.float64, device=device)
            self._scalars = torch.zeros(_NUM_SCALARS, dtype=torch.float64, device=device)
        if num_classes is not None:
            self.num_classes = num_classes
            self._classwise = torch.zeros(3, num_classes, self.n_bins, dtype=torch.float64, device=self._bins.device)

    @torch.no_grad()
    def update(self, inputs: torch.Tensor, labels: torch.Tensor) -> None:
        """Add a batch: ``inputs (..., C)`` logits or probabilities, ``labels (...)`` class indices."""
        prepared = prepare(inputs, labels, self.inputs_are, self.ignore_index, allow_empty=True)
        if self.num_classes is None:
            self._allocate(prepared.num_classes, prepared.probs.device)
        elif prepared.num_classes != self.num_classes:
            raise ValueError(f"batch has {prepared.num_classes} classes, earlier batches had {self.num_classes}")
        if prepared.num_samples == 0:
            return
        device = self._bins.device
        confidence, correct = confidence_and_correct(prepared)
        edges = equal_width_edges(self.n_bins, dtype=confidence.dtype, device=confidence.device)
        self._bins += torch.stack(bin_sums(confidence, correct, edges)).to(device)
        self._classwise += torch.stack(classwise_sums(prepared, self.n_bins)).to(device)
        self._scalars += torch.stack([
            torch.tensor(float(prepared.num_samples), dtype=torch.float64, device=confidence.device),
            nll_sum(prepared),
            brier_sum(prepared),
            correct.to(torch.float64).sum(),
        ]).to(device)
        if self.track_adaptive:
            self._confidence_dtype = confidence.dtype
            self._confidences.append(confidence.to(device))
            self._correct.append(correct.to(torch.bool).to(device))

    @torch.no_grad()
    def update_top_label(self, confidence: torch.Tensor, correct: torch.Tensor) -> None:
        """Add samples given by their top-label ``confidence (...)`` (``max_k p_k``) and ``correct (...)`` (bool or
        0/1: whether the top label is the true one), e.g. a loss's ``stats.confidence`` and
        ``stats.prediction == labels``.

        NaN confidences (the rows a loss ignored) are skipped. The samples go into the same bins and sums as
        :meth:`update`'s, on the device, without synchronising with it (no value is read back, so nothing is
        checked: a confidence outside ``(0, 1]`` counts in N and in no bin, as 0 does in :meth:`update`). From then
        on :meth:`compute` leaves out :data:`PER_CLASS_KEYS`, which need every class's probability.
        """
        confidence, correct = check_top_label(confidence, correct)
        self._allocate(None, confidence.device)
        self._fed_top_label = True
        device = self._bins.device
        counted = ~confidence.isnan()
        # a skipped row goes to confidence 0, at the first edge: in no (lo, hi] bin (bin_sums's overflow slot)
        confidence = torch.where(counted, confidence, torch.zeros((), dtype=confidence.dtype,
                                                                  device=confidence.device))
        correct = torch.where(counted, correct, torch.zeros((), dtype=correct.dtype, device=correct.device))
        edges = equal_width_edges(self.n_bins, dtype=confidence.dtype, device=confidence.device)
        self._bins += torch.stack(bin_sums(confidence, correct, edges)).to(device)
        no_sum = torch.zeros((), dtype=torch.float64, device=confidence.device)
        self._scalars += torch.stack([counted.to(torch.float64).sum(), no_sum, no_sum,
                                      correct.to(torch.float64).sum()]).to(device)
        if self.track_adaptive:
            # kept with their NaNs (dropping them here would read the mask back); compute() drops them
            self._confidence_dtype = confidence.dtype
            self._confidences.append(torch.where(counted, confidence, math.nan).to(device))
            self._correct.append(correct.to(torch.bool).to(device))

    # ----------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The accumulated state (tensors and Python numbers; ``torch.save`` / ``torch.load(weights_only=True)``
        round-trip it), e.g. to checkpoint a long evaluation part-way: :meth:`load_state_dict` restores it."""
        return {"n_bins": self.n_bins, "track_adaptive": self.track_adaptive, "num_classes": self.num_classes,
                "top_label": self._fed_top_label, "bins": self._bins, "classwise": self._classwise,
                "scalars": self._scalars,
                "confidences": torch.cat(self._confidences) if self._confidences else None,
                "correct": torch.cat(self._correct) if self._correct else None}

    def load_state_dict(self, state: dict) -> None:
        """Replace this meter's state by ``state`` (from :meth:`state_dict` of a meter with the same ``n_bins`` and
        ``track_adaptive``; ``ValueError`` otherwise)."""
        self._check_compatible(state, "load_state_dict")
        self.reset()
        self.merge_state(state)

    def merge_state(self, other) -> None:
        """Add the samples of another meter (or its :meth:`state_dict`) to this one, as if its batches had been
        passed to :meth:`update` here: the merged :meth:`compute` equals that of one meter over both streams. For
        shards evaluated apart without ``torch.distributed``; under a process group, ``compute()`` merges the ranks
        itself."""
        state = other.state_dict() if isinstance(other, CalibrationMeter) else other
        self._check_compatible(state, "merge_state")
        if state["bins"] is None:
            return  # the other meter saw no batch
        other_classes = state["num_classes"]
        if other_classes is not None and self.num_classes is not None and other_classes != self.num_classes:
            raise ValueError(f"merge_state: the other meter has {other_classes} classes, this one "
                             f"{self.num_classes}")
        self._allocate(None, state["bins"].device)
        if other_classes is not None:
            if self.num_classes is None:
                self._allocate(int(other_classes), self._bins.device)
            self._classwise += state["classwise"].to(self._bins.device, torch.float64)
        self._fed_top_label = self._fed_top_label or bool(state.get("top_label", False))
        device = self._bins.device
        self._bins += state["bins"].to(device, torch.float64)
        self._scalars += state["scalars"].to(device, torch.float64)
        if self.track_adaptive and state["confidences"] is not None:
            self._confidence_dtype = state["confidences"].dtype
            self._confidences.append(state["confidences"].to(device))
            self._correct.append(state["correct"].to(device, torch.bool))

    def _check_compatible(self, state, what: str) -> None:
        if not isinstance(state, dict) or not {"n_bins", "track_adaptive", "num_classes"} <= state.keys():
            raise TypeError(f"{what}: expected a CalibrationMeter or its state_dict(), got {type(state).__name__}")
        for key in ("n_bins", "track_adaptive"):
            if state[key] != getattr(self, key):
                raise ValueError(f"{what}: the other meter has {key}={state[key]!r}, this one "
                                 f"{key}={getattr(self, key)!r}")

    # ----------------------------------------------------------------------------------------------- DDP merging
    def _merged_state(self):
        """``(bins, classwise, scalars, confidences, correct, fed_top_label)`` summed / concatenated over every rank
        (``fed_top_label``: whether any rank took top-label data)."""
        local_conf = torch.cat(self._confidences) if self._confidences else None
        local_correct = torch.cat(self._correct) if self._correct else None
        comm = communication_device()
        fed_top_label = torch.tensor([int(self._fed_top_label)], dtype=torch.int64, device=comm)
        dist.all_reduce(fed_top_label, op=dist.ReduceOp.MAX)
        fed_top_label = bool(fed_top_label)
        # Agree on C first: a rank that saw no batch has no state yet, and mismatched shapes would hang all_reduce.
        # Meters fed top-label data only know no C (0 then: no classwise sums to merge).
        num_classes = agree_on_width(self.num_classes, comm, "CalibrationMeter", allow_unknown=fed_top_label)
        self._allocate(None, comm)
        if self.num_classes is None and num_classes > 0:
            self._allocate(num_classes, comm)
        classwise = self._classwise if self._classwise is not None else torch.zeros(3, 0, self.n_bins,
                                                                                     dtype=torch.float64)

        flat = torch.cat([self._bins.reshape(-1), classwise.to(self._bins.device).reshape(-1), self._scalars]).to(comm)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        bins_size, classwise_size = self._bins.numel(), classwise.numel()
        bins = flat[:bins_size].view_as(self._bins)
        classwise = flat[bins_size:bins_size + classwise_size].view_as(classwise)
        scalars = flat[bins_size + classwise_size:]

        if not self.track_adaptive:
            return bins, classwise, scalars, None, None, fed_top_label
        # Pack (confidence, correct) in float64 — exact for float32 confidences — and gather unequal sizes by padding.
        if local_conf is None:
            packed = torch.zeros(0, 2, dtype=torch.float64, device=comm)
        else:
            packed = torch.stack([local_conf.to(torch.float64), local_correct.to(torch.float64)], dim=1).to(comm)
        everything = all_gather_rows(packed)
        if everything.shape[0] == 0:
            return bins, classwise, scalars, None, None, fed_top_label
        return bins, classwise, scalars, everything[:, 0].to(self._confidence_dtype), everything[:, 1], fed_top_label

    # ----------------------------------------------------------------------------------------------- results
    @torch.no_grad()
    def compute(self, *, sync: bool = True) -> dict:
        """Metrics over everything seen, as Python floats keyed by :data:`METRIC_KEYS`; once any rank took samples
        through :meth:`update_top_label`, without :data:`PER_CLASS_KEYS` (classwise ECE, NLL, Brier score).

        With ``sync=True`` (default) and an initialised process group of more than one rank, the state of every rank is
        merged first (a collective: all ranks must call it); ``sync=False`` reports this rank's samples only.
        """
        if sync and _distributed_world_size() > 1:
            bins, classwise, scalars, confidences, correct, fed_top_label = self._merged_state()
        else:
            if self.num_samples == 0:
                raise ValueError("CalibrationMeter.compute(): no samples were added (call update() first)")
            bins, classwise, scalars = self._bins, self._classwise, self._scalars
            confidences = torch.cat(self._confidences) if self._confidences else None
            correct = torch.cat(self._correct) if self._correct else None
            fed_top_label = self._fed_top_label
        num_samples, nll_total, brier_total, correct_total = scalars.tolist()
        if num_samples == 0:
            raise ValueError("CalibrationMeter.compute(): no samples were added on any rank")
        count, conf_sum, correct_sum = bins
        if confidences is not None and fed_top_label:
            counted = ~confidences.isnan()  # update_top_label keeps its skipped rows as NaN
            confidences, correct = confidences[counted], correct[counted]
        if confidences is not None:
            adaece = float(adaptive_calibration_error(confidences, correct.to(confidences.dtype), self.n_bins))
        else:
            adaece = math.nan
        result = {
            "accuracy": correct_total / num_samples,
            "ece": float(calibration_error_from_sums(conf_sum, correct_sum, num_samples)),
            "adaece": adaece,
            "mce": float(max_calibration_error_from_sums(count, conf_sum, correct_sum)),
        }
        if not fed_top_label:
            result.update({
                "classwise_ece": float(calibration_error_from_sums(classwise[1], classwise[2], num_samples).mean()),
                "nll": nll_total / num_samples,
                "brier": brier_total / num_samples,
            })
        return {key: result[key] for key in METRIC_KEYS if key in result}

    def __repr__(self) -> str:
        return (f"CalibrationMeter(n_bins={self.n_bins}, num_classes={self.num_classes}, "
                f"num_samples={self.num_samples}, track_adaptive={self.track_adaptive})")


def calibration_metrics(inputs, labels, n_bins: int = 15, *, inputs_are: str = "auto",
                        ignore_index: int = -100) -> dict:
    """Every metric of :data:`METRIC_KEYS` for one set of predictions, in one pass (one softmax), as floats.

    Local to this process even under DDP (use :class:`CalibrationMeter` to merge ranks).
    """
    meter = CalibrationMeter(n_bins, inputs_are=inputs_are, ignore_index=ignore_index)
    meter.update(inputs, labels)
    return meter.compute(sync=False)
