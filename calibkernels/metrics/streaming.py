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

Under ``torch.distributed`` (initialised, world size > 1) ``compute()`` is a collective: every rank must call it. The
communication runs on CUDA for the NCCL backend and on CPU otherwise (gloo, mpi).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ._inputs import check_n_bins, prepare
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

__all__ = ["CalibrationMeter", "METRIC_KEYS", "calibration_metrics", "all_gather_rows", "agree_on_width",
           "communication_device"]

METRIC_KEYS = ("accuracy", "ece", "adaece", "classwise_ece", "mce", "nll", "brier")
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


def agree_on_width(known: int | None, comm, owner: str, what: str = "classes") -> int:
    """The width (number of classes) every rank agrees on; a rank that saw no batch passes ``None``. Raises
    ``ValueError`` when no rank knows it or two ranks disagree (mismatched shapes would hang a later collective)."""
    known = known or 0
    width_range = torch.tensor([known, -(known or 2**62)], dtype=torch.int64, device=comm)
    dist.all_reduce(width_range, op=dist.ReduceOp.MAX)
    width, smallest_known = int(width_range[0]), -int(width_range[1])
    if width == 0:
        raise ValueError(f"{owner}.compute(): no rank has seen any samples")
    if smallest_known != width:
        raise ValueError(f"ranks disagree on the number of {what} ({smallest_known} vs {width})")
    return width


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
        inputs_are: ``"auto" | "logits" | "probs"``, decided per batch (see :mod:`calibkernels.metrics._inputs`).
        ignore_index: label of rows to skip.
        track_adaptive: keep per-sample confidences for AdaECE (O(N) memory); ``False`` makes the memory constant.

    ``update(inputs, labels)`` takes ``(..., C)`` logits or probabilities and ``(...)`` labels; ``compute()`` returns a
    dict of Python floats with keys :data:`METRIC_KEYS` (fractions, not percentages); ``reset()`` clears the state;
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

    @property
    def num_samples(self) -> int:
        """Samples accumulated on this rank."""
        return 0 if self._scalars is None else int(self._scalars[0])

    def _allocate(self, num_classes: int, device) -> None:
        self.num_classes = num_classes
        self._bins = torch.zeros(3, self.n_bins, dtype=torch.float64, device=device)
        self._classwise = torch.zeros(3, num_classes, self.n_bins, dtype=torch.float64, device=device)
        self._scalars = torch.zeros(_NUM_SCALARS, dtype=torch.float64, device=device)

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

    # ----------------------------------------------------------------------------------------------- state
    def state_dict(self) -> dict:
        """The accumulated state (tensors and Python numbers; ``torch.save`` / ``torch.load(weights_only=True)``
        round-trip it), e.g. to checkpoint a long evaluation part-way: :meth:`load_state_dict` restores it."""
        return {"n_bins": self.n_bins, "track_adaptive": self.track_adaptive, "num_classes": self.num_classes,
                "bins": self._bins, "classwise": self._classwise, "scalars": self._scalars,
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
        if state["num_classes"] is None:
            return  # the other meter saw no batch
        if self.num_classes is None:
            self._allocate(int(state["num_classes"]), state["bins"].device)
        elif state["num_classes"] != self.num_classes:
            raise ValueError(f"merge_state: the other meter has {state['num_classes']} classes, this one "
                             f"{self.num_classes}")
        device = self._bins.device
        self._bins += state["bins"].to(device, torch.float64)
        self._classwise += state["classwise"].to(device, torch.float64)
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
        """``(bins, classwise, scalars, confidences, correct)`` summed / concatenated over every rank."""
        local_conf = torch.cat(self._confidences) if self._confidences else None
        local_correct = torch.cat(self._correct) if self._correct else None
        comm = communication_device()
        # Agree on C first: a rank that saw no batch has no state yet, and mismatched shapes would hang all_reduce.
        num_classes = agree_on_width(self.num_classes, comm, "CalibrationMeter")
        if self.num_classes is None:
            self._allocate(num_classes, comm)

        flat = torch.cat([self._bins.reshape(-1), self._classwise.reshape(-1), self._scalars]).to(comm)
        dist.all_reduce(flat, op=dist.ReduceOp.SUM)
        bins_size, classwise_size = self._bins.numel(), self._classwise.numel()
        bins = flat[:bins_size].view_as(self._bins)
        classwise = flat[bins_size:bins_size + classwise_size].view_as(self._classwise)
        scalars = flat[bins_size + classwise_size:]

        if not self.track_adaptive:
            return bins, classwise, scalars, None, None
        # Pack (confidence, correct) in float64 — exact for float32 confidences — and gather unequal sizes by padding.
        if local_conf is None:
            packed = torch.zeros(0, 2, dtype=torch.float64, device=comm)
        else:
            packed = torch.stack([local_conf.to(torch.float64), local_correct.to(torch.float64)], dim=1).to(comm)
        everything = all_gather_rows(packed)
        if everything.shape[0] == 0:
            return bins, classwise, scalars, None, None
        return bins, classwise, scalars, everything[:, 0].to(self._confidence_dtype), everything[:, 1]

    # ----------------------------------------------------------------------------------------------- results
    @torch.no_grad()
    def compute(self, *, sync: bool = True) -> dict:
        """Metrics over everything seen, as Python floats keyed by :data:`METRIC_KEYS`.

        With ``sync=True`` (default) and an initialised process group of more than one rank, the state of every rank is
        merged first (a collective: all ranks must call it); ``sync=False`` reports this rank's samples only.
        """
        if sync and _distributed_world_size() > 1:
            bins, classwise, scalars, confidences, correct = self._merged_state()
        else:
            if self.num_samples == 0:
                raise ValueError("CalibrationMeter.compute(): no samples were added (call update() first)")
            bins, classwise, scalars = self._bins, self._classwise, self._scalars
            confidences = torch.cat(self._confidences) if self._confidences else None
            correct = torch.cat(self._correct) if self._correct else None
        num_samples, nll_total, brier_total, correct_total = scalars.tolist()
        if num_samples == 0:
            raise ValueError("CalibrationMeter.compute(): no samples were added on any rank")
        count, conf_sum, correct_sum = bins
        if confidences is not None:
            adaece = float(adaptive_calibration_error(confidences, correct.to(confidences.dtype), self.n_bins))
        else:
            adaece = math.nan
        return {
            "accuracy": correct_total / num_samples,
            "ece": float(calibration_error_from_sums(conf_sum, correct_sum, num_samples)),
            "adaece": adaece,
            "classwise_ece": float(calibration_error_from_sums(classwise[1], classwise[2], num_samples).mean()),
            "mce": float(max_calibration_error_from_sums(count, conf_sum, correct_sum)),
            "nll": nll_total / num_samples,
            "brier": brier_total / num_samples,
        }

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
