"""Input handling shared by every metric: validation, flattening, and logits-or-probabilities resolution.

Every metric takes ``inputs (..., C)`` — logits or probabilities, class dimension last — and integer ``labels (...)``.
Rows whose label equals ``ignore_index`` are dropped.  ``inputs_are`` says what the inputs are:

* ``"logits"``: probabilities are ``softmax(inputs)``;
* ``"probs"``: the inputs are used as they are;
* ``"auto"`` (default): probabilities when every entry is non-negative and every row sums to 1 (±1e-3), else logits.

All arithmetic happens in float32 (float64 stays float64), whatever the input dtype: a metric of fp16/bf16 logits is
the metric of their float32 softmax.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

INPUT_KINDS = ("auto", "logits", "probs")
# Row sums of float32 probabilities over ~1e3 classes stay well inside this; logits essentially never satisfy it.
PROBABILITY_SUM_TOLERANCE = 1e-3


@dataclass(frozen=True)
class PreparedInputs:
    """Validated, flattened metric inputs (rows with ``ignore_index`` removed)."""

    probs: torch.Tensor  # (N, C) float32 / float64
    labels: torch.Tensor  # (N,) int64
    logits: torch.Tensor | None  # (N, C) in the compute dtype when the inputs were logits (for an exact NLL)

    @property
    def num_samples(self) -> int:
        return self.probs.shape[0]

    @property
    def num_classes(self) -> int:
        return self.probs.shape[1]


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def check_n_bins(n_bins) -> int:
    if isinstance(n_bins, bool) or not isinstance(n_bins, int):
        raise TypeError(f"n_bins must be an int, got {type(n_bins).__name__}")
    if n_bins < 1:
        raise ValueError(f"n_bins must be >= 1, got {n_bins}")
    return n_bins


def looks_like_probabilities(x: torch.Tensor) -> bool:
    """True when every entry of ``x (N, C)`` is >= 0 and every row sums to 1 within ``PROBABILITY_SUM_TOLERANCE``."""
    if x.numel() == 0:
        return False
    return bool((x >= 0).all()) and bool(((x.sum(-1) - 1).abs() <= PROBABILITY_SUM_TOLERANCE).all())


def prepare(inputs, labels, inputs_are: str = "auto", ignore_index: int = -100, *, allow_empty: bool = False):
    """Validate ``inputs (..., C)`` / ``labels (...)`` and return a :class:`PreparedInputs` with rows ``(N, C)``.

    Raises ``TypeError`` for non-tensors / wrong dtypes and ``ValueError`` for bad shapes, labels out of ``[0, C)``,
    NaN probabilities, or (unless ``allow_empty``) no rows left to evaluate.
    """
    if not isinstance(inputs, torch.Tensor):
        raise TypeError(f"inputs must be a torch.Tensor of logits or probabilities, got {type(inputs).__name__}")
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor of class indices, got {type(labels).__name__}")
    if not inputs.is_floating_point():
        raise TypeError(f"inputs must be floating point (logits or probabilities), got {inputs.dtype}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must hold integer class indices, got {labels.dtype}")
    if not isinstance(inputs_are, str) or inputs_are not in INPUT_KINDS:
        raise ValueError(f"inputs_are must be one of {INPUT_KINDS}, got {inputs_are!r}")
    if isinstance(ignore_index, bool) or not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")
    if inputs.dim() < 2:
        raise ValueError(f"inputs must have shape (..., C) with the class dimension last, got {tuple(inputs.shape)}")
    if tuple(labels.shape) != tuple(inputs.shape[:-1]):
        raise ValueError(
            f"labels shape {tuple(labels.shape)} does not match inputs shape {tuple(inputs.shape)}: "
            f"expected {tuple(inputs.shape[:-1])}"
        )
    if labels.device != inputs.device:
        raise ValueError(f"labels are on {labels.device} but inputs are on {inputs.device}")
    num_classes = inputs.shape[-1]
    if num_classes < 1:
        raise ValueError("inputs have zero classes")

    x = inputs.detach().reshape(-1, num_classes).to(compute_dtype(inputs.dtype))
    y = labels.detach().reshape(-1).long()
    keep = y != ignore_index
    if not bool(keep.all()):
        x, y = x[keep], y[keep]
    if x.shape[0] == 0 and not allow_empty:
        raise ValueError("no samples to evaluate (empty inputs, or every label equals ignore_index)")
    bad = (y < 0) | (y >= num_classes)
    if bool(bad.any()):
        raise ValueError(
            f"label {int(y[bad][0])} is out of range for {num_classes} classes "
            f"(valid: 0..{num_classes - 1}, or ignore_index={ignore_index})"
        )

    if inputs_are == "auto":
        inputs_are = "probs" if looks_like_probabilities(x) else "logits"
    if inputs_are == "logits":
        logits, probs = x, torch.softmax(x, dim=-1)
    else:
        logits, probs = None, x
    if bool(probs.isnan().any()):
        raise ValueError("inputs give NaN probabilities (NaN logits/probabilities, or a row of all -inf logits)")
    return PreparedInputs(probs=probs, labels=y, logits=logits)
