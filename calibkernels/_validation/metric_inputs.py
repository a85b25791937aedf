"""Input handling shared by every metric: validation, flattening, and logits-or-probabilities resolution.

Every metric takes ``inputs (..., C)`` — logits or probabilities, class dimension last — and integer ``labels (...)``.
Rows whose label equals ``ignore_index`` are dropped before anything else is checked (they may hold anything).
``inputs_are`` says what the inputs are:

* ``"logits"``: probabilities are ``softmax(inputs)``. A ``-inf`` logit is a masked class (probability 0, exactly as
  a very negative logit); ``+inf`` or NaN logits, and rows whose every class is ``-inf``, raise ``ValueError``.
* ``"probs"``: the inputs are used as they are, after a check: no NaN, no entry below 0 or above ``1 + tol``, every
  row summing to 1 within ``tol`` (:func:`probability_sum_tolerance`), else ``ValueError``. Entries in
  ``(1, 1 + tol]`` (a float32 normalisation can leave a confidence a few ulps above 1) are taken as 1, so they land
  in the last ``(lo, 1]`` bin instead of in no bin.
* ``"auto"`` (default): probabilities when every entry is >= 0 and every row sums to 1 within ``tol``, else logits.
  When every entry lies in [0, 1] but some row misses the tolerance the inputs could be either (logits of a model
  that outputs values in [0, 1], or broken probabilities): they are treated as logits **with a UserWarning** that
  says how to choose explicitly. So are rows that sum to 1 within ``tol`` with an entry a little below 0 (at least
  ``-tol``: probabilities made as one minus the others can round below 0).

``tol`` follows the dtype the inputs arrive in, because probabilities rounded to bf16 legitimately miss a fixed
``1e-3``: see :func:`probability_sum_tolerance` and docs/metrics.md, 'Inputs: logits or probabilities'.

All arithmetic happens in float32 (float64 stays float64), whatever the input dtype: a metric of fp16/bf16 logits is
the metric of their float32 softmax.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import torch

from .arguments import check_ignore_index

INPUT_KINDS = ("auto", "logits", "probs")
# The smallest row-sum tolerance of any dtype. Probabilities normalised in float32 (and perhaps stored as float64)
# are off by far less, so float32/float64 inputs keep this fixed value; logits essentially never satisfy it.
PROBABILITY_SUM_TOLERANCE = 1e-3


def probability_sum_tolerance(dtype: torch.dtype, num_classes: int) -> float:
    """How far from 1 a row of ``num_classes`` probabilities stored in ``dtype`` may sum:
    ``max(1e-3, 2 · eps · (1 + C · tiny))`` with ``eps``, ``tiny`` from ``torch.finfo(dtype)``.

    Rounding an entry ``p_k`` of an exact distribution to ``dtype`` moves it by at most ``eps/2 · p_k`` in the normal
    range and by at most half a subnormal step, ``eps · tiny / 2``, below it (fp16 flushes entries under ~3e-8 to 0),
    so the row sum moves by at most ``eps/2 · (1 + C · tiny)``. Twice that also covers a normaliser computed in
    ``dtype``. Values: bf16 0.0156; fp16 0.00195 for C up to a few thousand, growing with C (0.0091 at C = 60000);
    float32 and float64 the 1e-3 floor.
    """
    info = torch.finfo(dtype)
    return max(PROBABILITY_SUM_TOLERANCE, 2.0 * info.eps * (1.0 + num_classes * info.tiny))


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


def check_positive_int(value, name: str) -> int:
    """``value`` if it is an int (not a bool) >= 1; else ``TypeError`` / ``ValueError`` naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}")
    return value


def check_n_bins(n_bins) -> int:
    return check_positive_int(n_bins, "n_bins")


def labelled_rows(x: torch.Tensor, y: torch.Tensor, ignore_index: int, num_classes: int, fitted: str):
    """The rows of ``x (N, C)``, ``y (N,)`` whose label is not ``ignore_index``: ``(x, y, rows)``, ``rows`` the kept
    rows' numbers in the inputs (for error messages; ``None`` when every row is kept). ``ValueError`` when no row is
    left to fit ``fitted`` on, or a label is outside ``[0, num_classes)``."""
    keep = y != ignore_index
    rows = None
    if not bool(keep.all()):
        rows = keep.nonzero().squeeze(1)
        x, y = x[keep], y[keep]
    if x.shape[0] == 0:
        raise ValueError(f"cannot fit {fitted} on zero samples (empty inputs, or every label equals "
                         f"ignore_index={ignore_index})")
    if bool(((y < 0) | (y >= num_classes)).any()):
        raise ValueError(f"labels must lie in [0, {num_classes}) for {num_classes} classes, or equal "
                         f"ignore_index={ignore_index}")
    return x, y, rows


def _first_row(row_mask: torch.Tensor, rows: torch.Tensor | None) -> str:
    """Names the first row where ``row_mask`` holds, numbered as in the caller's inputs flattened to ``(N, C)``."""
    first = int(row_mask.nonzero()[0, 0])
    return f"row {first if rows is None else int(rows[first])} of the inputs flattened to (N, C)"


def check_logits(x: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """Raise ``ValueError`` unless every row of ``x (N, C)`` is finite or ``-inf`` with at least one finite entry.

    ``-inf`` is a masked class (softmax probability exactly 0). ``+inf`` has no probability distribution (softmax
    gives NaN) and NaN is no logit, so both raise, as does a row whose every class is masked. ``rows`` maps the rows
    of ``x`` to the caller's row numbers (after ``ignore_index`` rows were dropped). One reduction when all is well.
    """
    if x.numel() == 0 or bool(torch.isfinite(x.amax(dim=-1)).all()):  # amax propagates NaN
        return
    if bool(x.isnan().any()):
        raise ValueError(f"logits contain NaN ({_first_row(x.isnan().any(-1), rows)})")
    if bool(x.isposinf().any()):
        raise ValueError(f"logits contain +inf ({_first_row(x.isposinf().any(-1), rows)}): softmax of +inf is "
                         "undefined. Only -inf is accepted, as a masked class with probability 0")
    raise ValueError(f"{_first_row(x.amax(-1) == -math.inf, rows)} has every class masked (all logits -inf), so it "
                     "has no probability distribution; drop it or set its label to ignore_index")


def resolve_inputs_kind(x: torch.Tensor, inputs_are: str, dtype: torch.dtype,
                        rows: torch.Tensor | None = None) -> str:
    """``"logits"`` or ``"probs"`` for ``x (N, C)`` (detached, compute dtype), checked as the module docstring says.

    ``dtype`` is the dtype the inputs arrived in (it sets the row-sum tolerance); ``rows`` maps rows of ``x`` to the
    caller's row numbers for error messages. Raises ``ValueError`` for invalid logits or probabilities; warns when
    ``"auto"`` meets entries in [0, 1] whose rows do not sum to 1.
    """
    if not isinstance(inputs_are, str) or inputs_are not in INPUT_KINDS:
        raise ValueError(f"inputs_are must be one of {INPUT_KINDS}, got {inputs_are!r}")
    if x.numel() == 0:
        return "probs" if inputs_are == "probs" else "logits"
    if inputs_are == "logits":
        check_logits(x, rows)
        return "logits"
    num_classes = x.shape[-1]
    tolerance = probability_sum_tolerance(dtype, num_classes)
    row_error = (x.sum(dim=-1) - 1).abs()
    lowest, highest = torch.aminmax(x)
    lowest, highest, worst = torch.stack([lowest, highest, row_error.max()]).tolist()  # one device sync
    if inputs_are == "auto":
        if lowest >= 0 and worst <= tolerance:  # False for NaN
            return "probs"
        if lowest >= 0 and highest <= 1:
            warnings.warn(
                f"inputs_are='auto': every entry is in [0, 1] but some rows do not sum to 1 within {tolerance:.3g} "
                f"(the tolerance for {dtype} probabilities over {num_classes} classes), so the inputs are treated as "
                "logits and passed through softmax. Pass inputs_are='logits' to confirm, or inputs_are='probs' if "
                "they are probabilities (renormalise them first: p / p.sum(-1, keepdim=True)).",
                UserWarning,
                stacklevel=4,
            )
        elif -tolerance <= lowest < 0 and highest <= 1 + tolerance and worst <= tolerance:
            # probabilities made as 1 - (sum of the others) can come out a rounding below 0
            warnings.warn(
                f"inputs_are='auto': every row sums to 1 within {tolerance:.3g} and every entry is in "
                f"[{-tolerance:.3g}, 1], but the smallest is {lowest:.3g} (below 0), so the inputs are treated as "
                "logits and passed through softmax. Pass inputs_are='logits' to confirm, or, if they are "
                "probabilities, clamp them (p.clamp(min=0)) and pass inputs_are='probs'.",
                UserWarning,
                stacklevel=4,
            )
        check_logits(x, rows)
        return "logits"
    if math.isnan(lowest) or math.isnan(highest):
        raise ValueError(f"inputs_are='probs' but the inputs contain NaN ({_first_row(x.isnan().any(-1), rows)})")
    if lowest < 0:
        raise ValueError(f"inputs_are='probs' but an entry is negative ({lowest:.6g}, "
                         f"{_first_row((x < 0).any(-1), rows)}); probabilities lie in [0, 1]. Pass "
                         "inputs_are='logits' if these are logits")
    if highest > 1 + tolerance:
        raise ValueError(f"inputs_are='probs' but an entry is above 1 ({highest:.6g}, "
                         f"{_first_row((x > 1 + tolerance).any(-1), rows)}); probabilities lie in [0, 1]. "
                         "Pass inputs_are='logits' if these are logits")
    if worst > tolerance:
        bad = row_error > tolerance
        total = float(x[bad.nonzero()[0, 0]].sum())
        raise ValueError(f"inputs_are='probs' but the rows do not all sum to 1: {_first_row(bad, rows)} sums to "
                         f"{total:.6g}, beyond the tolerance {tolerance:.3g} for {dtype} probabilities over "
                         f"{num_classes} classes. Renormalise them (p / p.sum(-1, keepdim=True)) or pass "
                         "inputs_are='logits' if these are logits")
    return "probs"


def prepare(inputs, labels, inputs_are: str = "auto", ignore_index: int = -100, *, allow_empty: bool = False):
    """Validate ``inputs (..., C)`` / ``labels (...)`` and return a :class:`PreparedInputs` with rows ``(N, C)``.

    Raises ``TypeError`` for non-tensors / wrong dtypes and ``ValueError`` for bad shapes, labels out of ``[0, C)``,
    logits or probabilities that break the module docstring's rules (``+inf`` / NaN logits, a fully masked row,
    probabilities outside [0, 1] or not summing to 1), or (unless ``allow_empty``) no rows left to evaluate.
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
    check_ignore_index(ignore_index)
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
    rows = None  # row numbers of x in the caller's flattened inputs, when ignored rows were dropped
    if not bool(keep.all()):
        rows = keep.nonzero().squeeze(1)
        x, y = x[keep], y[keep]
    if x.shape[0] == 0 and not allow_empty:
        raise ValueError("no samples to evaluate (empty inputs, or every label equals ignore_index)")
    bad = (y < 0) | (y >= num_classes)
    if bool(bad.any()):
        raise ValueError(
            f"label {int(y[bad][0])} is out of range for {num_classes} classes "
            f"(valid: 0..{num_classes - 1}, or ignore_index={ignore_index})"
        )

    if resolve_inputs_kind(x, inputs_are, inputs.dtype, rows) == "logits":
        logits, probs = x, torch.softmax(x, dim=-1)
    else:
        logits, probs = None, x.clamp(max=1.0)  # entries in (1, 1 + tol] are rounding: they count as 1
    return PreparedInputs(probs=probs, labels=y, logits=logits)
