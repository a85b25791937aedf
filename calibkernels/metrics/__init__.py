"""Calibration metrics (docs/metrics.md): functional metrics, a streaming DDP-aware meter, reliability diagrams.

>>> import torch, calibkernels as ck
>>> logits, labels = torch.randn(1000, 10), torch.randint(0, 10, (1000,))
>>> ece = ck.metrics.ece(logits, labels)              # a float in [0, 1]; tables report 100 * ece (%)
>>> table = ck.metrics.calibration_metrics(logits, labels)   # every metric at once, as a dict of floats

* :mod:`.binned` — ``ece``, ``adaptive_ece``, ``classwise_ece``, ``mce``, ``nll``, ``brier_score``, ``accuracy``.
  Inputs are logits or probabilities ``(..., C)`` (``inputs_are="auto"|"logits"|"probs"``); results are Python floats
  (fractions, not %). Conventions match the reference code of the published tables: ``(lo, hi]`` bins on a float32
  ``linspace(0, 1, 16)``, ``|B_b|/N`` over all N, and the AdaECE edge rule under which a unique minimum confidence
  falls in no bin. The one departure: samples *tied* at the minimum AdaECE confidence, which the reference drops,
  count in the first bin (see :mod:`.binned`).
  ``"auto"`` takes rows of entries >= 0 summing to 1 within a dtype-dependent tolerance for probabilities; ``-inf``
  logits are masked classes, ``+inf``/NaN logits raise ``ValueError`` (see :mod:`._inputs`).
* :mod:`.streaming` — ``CalibrationMeter`` (update / compute / reset; merged across DDP ranks) and
  ``calibration_metrics`` (all metrics of one tensor in one pass).
* :mod:`.reliability` — ``reliability_diagram`` (matplotlib, optional) and ``reliability_bins``.
* :mod:`.differentiable` — differentiable ``sece`` / ``dece`` for meta-regularisation.
* :mod:`.smooth_ece` — ``smooth_ece`` (Błasiok & Nakkiran's smECE, automatic bandwidth) and
  ``smooth_reliability_curve``; :mod:`.debiased` — ``debiased_ece`` (Kumar, Liang & Ma's debiased L2 calibration
  error on equal-mass bins); :mod:`.bootstrap` — ``bootstrap`` percentile intervals of any metric (batched for the
  package's own), ``bootstrap_distribution``, ``bin_accuracy_band``. The functions ``smooth_ece`` and ``bootstrap``
  share their modules' names, so ``calibkernels.metrics.smooth_ece`` is the function; the modules are in
  ``sys.modules`` under their full names.
* :mod:`.meters` — ``SmoothECEMeter`` (constant state: one spread kernel grid per bandwidth the bisection can try)
  and ``DebiasedECEMeter`` (keeps every sample: equal-mass bins need all of them), streaming and merged across DDP
  ranks like ``CalibrationMeter``.
"""

from .binned import (
    accuracy,
    adaptive_ece,
    brier_score,
    classwise_ece,
    ece,
    equal_count_edges,
    equal_width_edges,
    mce,
    nll,
)
from .reliability import reliability_bins, reliability_diagram
from .streaming import METRIC_KEYS, CalibrationMeter, calibration_metrics

# --- differentiable calibration errors (meta-regularisation; calibkernels/metrics/differentiable.py, meta engineer) ---
from .differentiable import dece, sece
# --- end differentiable metrics ---

# --- metrics past the anchors: smooth ECE, debiased L2 calibration error, bootstrap intervals ---
from .bootstrap import BATCHED_METRICS, bin_accuracy_band, bootstrap, bootstrap_distribution
from .debiased import debiased_ece
from .smooth_ece import smooth_ece, smooth_reliability_curve
from .meters import DebiasedECEMeter, SmoothECEMeter
# --- end metrics past the anchors ---

__all__ = [
    "METRIC_KEYS",
    "CalibrationMeter",
    "DebiasedECEMeter",
    "SmoothECEMeter",
    "BATCHED_METRICS",
    "accuracy",
    "adaptive_ece",
    "bin_accuracy_band",
    "bootstrap",
    "bootstrap_distribution",
    "brier_score",
    "calibration_metrics",
    "classwise_ece",
    "debiased_ece",
    "dece",
    "ece",
    "equal_count_edges",
    "equal_width_edges",
    "mce",
    "nll",
    "reliability_bins",
    "reliability_diagram",
    "sece",
    "smooth_ece",
    "smooth_reliability_curve",
]
