"""Calibration after training (docs/metrics.md, 'Temperature scaling' and 'Post-hoc calibration'): the public
namespace of the temperature fit and of the post-hoc calibrators.

* Temperature scaling (Guo et al., ICML 2017), from :mod:`calibkernels._temperature_fit`: :func:`fit_temperature`
  (ECE over a grid, or NLL by L-BFGS), :func:`ece_over_temperatures`, :func:`temperature_grid`, and
  :func:`evaluate_temperature_scaling` (every metric pre-T and post-T with one T).
* The post-hoc calibrators, from :mod:`calibkernels.posthoc`: :class:`TemperatureScaling` (also an ``nn.Module``),
  :class:`VectorScaling`, :class:`MatrixScaling`, :class:`DirichletCalibration`, :class:`HistogramBinning`,
  :class:`IsotonicCalibration`, one interface (``fit`` / ``transform`` / ``log_transform``), and
  :data:`POSTHOC_METHODS`, their names.
"""

from __future__ import annotations

from ._temperature_fit import (DEFAULT_CHUNK_ELEMENTS, DEFAULT_GRID_START, DEFAULT_GRID_STEP,  # noqa: F401
                               DEFAULT_GRID_STOP, OBJECTIVES, ece_over_temperatures, evaluate_temperature_scaling,
                               fit_temperature, temperature_grid)
from .posthoc import (POSTHOC_METHODS, DirichletCalibration, HistogramBinning, IsotonicCalibration, MatrixScaling,
                      PosthocCalibrator, TemperatureScaling, VectorScaling)

__all__ = [
    # calibkernels._temperature_fit
    "DEFAULT_GRID_STEP",
    "ece_over_temperatures",
    "evaluate_temperature_scaling",
    "fit_temperature",
    "temperature_grid",
    # calibkernels.posthoc
    "POSTHOC_METHODS",
    "DirichletCalibration",
    "HistogramBinning",
    "IsotonicCalibration",
    "MatrixScaling",
    "PosthocCalibrator",
    "TemperatureScaling",
    "VectorScaling",
]
