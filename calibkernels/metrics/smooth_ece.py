"""Smooth ECE with automatic bandwidth (docs/metrics.md, 'Smooth ECE').

Błasiok & Nakkiran, "Smooth ECE: Principled Reliability Diagrams via Kernel Smoothing" (ICLR 2024). The top-label
confidence ``f_i = max_k p_ik`` and the correctness ``y_i = 1[argmax_k p_ik = label_i]`` give residuals
``r_i = f_i - y_i``. Kernel-smoothing the residuals and the sample density over [0, 1] with a Gaussian kernel of
width σ, reflected at 0 and 1,

    R_σ(t) = Σ_i r_i K_σ(t, f_i),      D_σ(t) = Σ_i K_σ(t, f_i),
    K_σ(t, f) = φ_σ(t - f) + φ_σ(t + f) + φ_σ(t - (2 - f))       (φ_σ the N(0, σ²) density; images within 1/2)

gives the smoothed reliability curve ``μ(t) = t - R_σ(t) / D_σ(t)`` and the smooth ECE at bandwidth σ,

    smECE_σ = ∫ |R_σ(t)| dt / ∫ D_σ(t) dt         (the D-weighted mean of |R_σ / D_σ|).

The bandwidth is not a free parameter: the paper takes the σ* with ``smECE_σ* = σ*`` (smECE_σ does not grow with σ,
so the fixed point is unique and a bisection finds it), and reports ``smECE = smECE_σ*``.

Numerics, chosen to agree with the authors' ``relplot`` package (``relplot.smECE``) to rounding:

* The kernel is discretised. Samples are spread onto a uniform grid of ``G = max(2000, round(20/σ)) // 2 + 1``
  points on [0, 1] by linear interpolation (a sample at ``f`` puts weight ``1 - u`` on grid point ``⌊f(G-1)⌋`` and
  ``u`` on the next, ``u`` the fractional part). The grid is mirrored at both ends (point ``-j`` copies ``j``, point
  ``G-1+j`` copies ``G-1-j``) and correlated with the G kernel taps ``φ_σ(k/(G-1) - 1/2)``, k = 0..G-1: a window of
  half-width 1/2, centred on each point (half a grid step off centre when G is even, as in relplot). The correlation
  runs as an FFT product in float64.
* ``R_σ`` and ``D_σ`` are read off the grid by linear interpolation at ``T = max(round(10/σ), 200)`` evaluation points
  ``linspace(0, 1, T)``, and the integrals are sums over those points, ``smECE_σ = Σ_t |R_σ(t)| / Σ_t (D_σ(t) + 1e-4)``
  (relplot's ``1e-4`` floor on the density; ``D_σ`` is of order N, so the floor is negligible).
* σ* is found by bisection on [0, 1]: 10 halvings from the bracket (0, 1), moving the lower end up when
  ``σ < 0.001 or σ < smECE_σ`` (σ too narrow) and the upper end down otherwise; σ* is the final upper end (a multiple
  of 2^-10 with ``smECE_σ* ≤ σ*``, within 2^-10 of the fixed point) and the result is ``smECE_σ*``.

The kernel sums are linear in the samples once they are spread onto the grid, and the bisection only ever visits
about ten grid sizes (:func:`automatic_grid_sizes`), so a streaming meter keeps one spread grid of each size and
merges ranks with one all-reduce (:class:`calibkernels.metrics.SmoothECEMeter`). Everything is vectorised (no Python
loop over samples); the bisection is a loop of 10 steps, each one FFT correlation of a ``G``-point grid.
"""

from __future__ import annotations

import math

import torch

from .._validation import is_number
from .._validation.metric_inputs import prepare
from .binned import confidence_and_correct

__all__ = ["smooth_ece", "smooth_reliability_curve"]

# Bisection of the bandwidth: steps from the bracket (0, 1), and the width below which σ counts as too narrow without
# being evaluated (relplot's eps). The result is a multiple of 2^-BISECTION_STEPS.
BISECTION_STEPS = 10
MIN_AUTOMATIC_BANDWIDTH = 1e-3
# The smallest bandwidth accepted when given explicitly: the grid has ~10/σ points, 100001 at 1e-4.
MIN_BANDWIDTH = 1e-4
DENSITY_FLOOR = 1e-4


def grid_points(sigma: float) -> int:
    """Size G of the grid the kernel is discretised on at bandwidth ``sigma``: ``max(2000, round(20/σ)) // 2 + 1``."""
    return max(2000, round(20.0 / sigma)) // 2 + 1


def evaluation_points(sigma: float) -> int:
    """Number T of points ``linspace(0, 1, T)`` the smoothed functions are summed over: ``max(round(10/σ), 200)``."""
    return max(round(10.0 / sigma), 200)


def fft_length(n: int) -> int:
    """The FFT length for a linear convolution of length ``n``: the smallest power of two >= n."""
    return 1 << (n - 1).bit_length()


def _reflected_smooth(grid: torch.Tensor, sigma: float) -> torch.Tensor:
    """Correlate each row of ``grid (B, G)`` (float64), mirrored at both ends, with the G Gaussian taps; ``(B, G)``."""
    size = grid.shape[-1]
    offsets = torch.linspace(0.0, 1.0, size, dtype=torch.float64, device=grid.device) - 0.5
    taps = torch.exp(-offsets.square() / (2.0 * sigma * sigma)) / (math.sqrt(2.0 * math.pi) * sigma)
    # Mirrored grid: points -(G-1)..2(G-1). Output i sums taps[k] * mirrored[i + k + G//2 - (G-1)], k = 0..G-1.
    mirrored = torch.cat([grid[..., 1:].flip(-1), grid, grid[..., :-1].flip(-1)], dim=-1)
    window = mirrored[..., size // 2: size // 2 + 2 * size - 1]
    # Correlation = convolution with the reversed taps; the G outputs are the fully overlapped part.
    length = fft_length(window.shape[-1] + size - 1)
    product = torch.fft.rfft(window, length) * torch.fft.rfft(taps.flip(0), length)
    return torch.fft.irfft(product, length)[..., size - 1: 2 * size - 1]


def _spread(confidence: torch.Tensor, correct: torch.Tensor, size: int,
            sample_weight: torch.Tensor | None = None) -> torch.Tensor:
    """The residuals and the sample counts of rows ``(B, N)`` spread linearly onto a ``size``-point grid:
    ``(2, B, size)`` float64 (weight ``1 - u`` on point ``j = ⌊f (G-1)⌋`` clipped to G-2, ``u`` on ``j + 1``).
    ``sample_weight (B, N)``: 1 to count a sample, 0 to leave it out (its confidence must still be finite)."""
    confidence = confidence.to(torch.float64)
    residual = confidence - correct.to(torch.float64)
    position = confidence * (size - 1)
    left = position.floor().long().clamp_(0, size - 2)
    upper_share = position - left
    weights = torch.stack([residual, torch.ones_like(residual)])  # (2, B, N): the residual and the density
    if sample_weight is not None:
        weights = weights * sample_weight.to(torch.float64)
    grid = torch.zeros(2, confidence.shape[0], size, dtype=torch.float64, device=confidence.device)
    grid.scatter_add_(-1, left.expand(2, -1, -1), weights * (1.0 - upper_share))
    grid.scatter_add_(-1, (left + 1).expand(2, -1, -1), weights * upper_share)
    return grid


def _smoothed(grid: torch.Tensor, sigma: float):
    """``(R_σ(t), D_σ(t), t)`` from a spread grid ``(2, B, G)``, G = ``grid_points(sigma)``: ``(B, T)``, ``(B, T)``,
    ``(T,)``."""
    _, rows, size = grid.shape
    smoothed = _reflected_smooth(grid.reshape(2 * rows, size), sigma).reshape(2, rows, size)
    # Linear interpolation of the grid at t = linspace(0, 1, T).
    t = torch.linspace(0.0, 1.0, evaluation_points(sigma), dtype=torch.float64, device=grid.device)
    position = t * (size - 1)
    left = position.floor().long().clamp_(0, size - 2)
    upper_share = position - left
    values = smoothed[..., left] * (1.0 - upper_share) + smoothed[..., left + 1] * upper_share
    return values[0], values[1], t


def _smooth_ece_of_grid(grid: torch.Tensor, sigma: float) -> torch.Tensor:
    residual, density, _ = _smoothed(grid, sigma)
    return residual.abs().sum(-1) / (density + DENSITY_FLOOR).sum(-1)


def smooth_ece_at(confidence: torch.Tensor, correct: torch.Tensor, sigma: float) -> torch.Tensor:
    """``smECE_σ`` of each row of ``confidence, correct (B, N)`` at one bandwidth ``sigma``; float64 ``(B,)``."""
    return _smooth_ece_of_grid(_spread(confidence, correct, grid_points(sigma)), sigma)


def automatic_smooth_ece(confidence: torch.Tensor, correct: torch.Tensor):
    """``(smECE_σ*, σ*)`` of each row of ``confidence, correct (B, N)``, both float64 ``(B,)``.

    Each row has its own bisection (module docstring); at every step the rows are grouped by their trial bandwidth
    (a multiple of 2^-step, so few distinct values) and each group is evaluated in one batched pass. The spread
    grids are computed once per grid size (every σ >= 0.01 shares G = 1001), so a step costs one FFT per group.
    """
    grids = {}  # grid size -> (2, B, G) spread grid of every row

    def grid_of_size(size):
        if size not in grids:
            grids[size] = _spread(confidence, correct, size)
        return grids[size]

    return automatic_smooth_ece_of_grids(grid_of_size, confidence.shape[0], confidence.device)


def automatic_grid_sizes() -> list[int]:
    """Every grid size the automatic bandwidth's bisection can evaluate: those of the trial bandwidths
    ``j / 2^BISECTION_STEPS >= MIN_AUTOMATIC_BANDWIDTH`` (σ = 1 included). A streaming meter keeps one spread grid of
    each size (:class:`calibkernels.metrics.SmoothECEMeter`)."""
    steps = 2 ** BISECTION_STEPS
    return sorted({grid_points(j / steps) for j in range(1, steps + 1) if j / steps >= MIN_AUTOMATIC_BANDWIDTH})


def automatic_smooth_ece_of_grids(grid_of_size, rows: int, device):
    """:func:`automatic_smooth_ece` from spread grids: ``grid_of_size(G)`` returns the ``(2, rows, G)`` grid of
    :func:`_spread` (the residuals and the counts of every sample, spread linearly; sums over samples, so grids of
    separate batches add up)."""

    def evaluate_rows(group, sigma):
        return _smooth_ece_of_grid(grid_of_size(grid_points(sigma))[:, group], sigma)

    lower = torch.zeros(rows, dtype=torch.float64, device=device)
    upper = torch.ones(rows, dtype=torch.float64, device=device)
    at_upper = torch.full((rows,), math.nan, dtype=torch.float64, device=device)  # smECE at `upper`, once known
    for _ in range(BISECTION_STEPS):
        middle = (lower + upper) / 2  # exact: dyadic
        at_middle = torch.full_like(middle, math.nan)
        evaluate = middle >= MIN_AUTOMATIC_BANDWIDTH
        for sigma in torch.unique(middle[evaluate]).tolist():
            group = evaluate & (middle == sigma)
            at_middle[group] = evaluate_rows(group, sigma)
        too_narrow = ~evaluate | (middle < at_middle)  # NaN compares False only where evaluated
        lower = torch.where(too_narrow, middle, lower)
        upper = torch.where(too_narrow, upper, middle)
        at_upper = torch.where(too_narrow, at_upper, at_middle)
    never_moved = at_upper.isnan()  # every trial was too narrow: σ* = 1, not evaluated yet
    if bool(never_moved.any()):
        at_upper[never_moved] = evaluate_rows(never_moved, 1.0)
    return at_upper, upper


def curve_from_grid(grid: torch.Tensor, sigma: float, value: float, num_samples: int) -> dict:
    """The :func:`smooth_reliability_curve` dict from the ``(2, 1, G)`` spread grid at bandwidth ``sigma``."""
    residual, density, t = _smoothed(grid, sigma)
    residual, density = residual[0], density[0]
    return {
        "confidence": t.cpu(),
        "accuracy": (t - residual / (density + DENSITY_FLOOR)).cpu(),
        "density": (density / num_samples).cpu(),
        "smooth_ece": float(value),
        "bandwidth": sigma,
    }


def check_bandwidth(bandwidth) -> float | None:
    if bandwidth is None:
        return None
    if not is_number(bandwidth):
        raise TypeError(f"bandwidth must be None (automatic) or a number, got {type(bandwidth).__name__}")
    if not (math.isfinite(bandwidth) and bandwidth >= MIN_BANDWIDTH):
        raise ValueError(f"bandwidth must be finite and >= {MIN_BANDWIDTH} (the kernel grid has about 10/bandwidth "
                         f"points), got {bandwidth!r}; pass None for the automatic choice")
    return float(bandwidth)


def _top_label(inputs, labels, inputs_are, ignore_index):
    prepared = prepare(inputs, labels, inputs_are, ignore_index)
    confidence, correct = confidence_and_correct(prepared)
    return confidence.to(torch.float64)[None], correct.to(torch.float64)[None]


def smooth_ece(inputs, labels, *, bandwidth: float | None = None, return_bandwidth: bool = False,
               inputs_are: str = "auto", ignore_index: int = -100):
    """Smooth ECE of the top-label confidence (Błasiok & Nakkiran 2024), a fraction in [0, 1].

    ``smECE_σ = ∫ |Σ_i (f_i - y_i) K_σ(t, f_i)| dt / ∫ Σ_i K_σ(t, f_i) dt`` with ``f_i`` the top-label confidence,
    ``y_i`` its correctness and ``K_σ`` a Gaussian kernel reflected at 0 and 1; by default at the bandwidth ``σ*``
    solving ``smECE_σ* = σ*`` (bisection, 2^-10 resolution). Discretised as in the authors' ``relplot`` package
    (``relplot.smECE(f, y)``), which it matches to rounding; see the module docstring for the grid.

    Args:
        inputs: ``(..., C)`` logits or probabilities (``inputs_are``, see
            :mod:`calibkernels._validation.metric_inputs`).
        labels: ``(...)`` class indices; rows equal to ``ignore_index`` are left out.
        bandwidth: ``None`` (default) for the automatic σ*, or a fixed σ >= 1e-4 (``relplot.smECE_sigma``).
        return_bandwidth: also return the σ used.

    Returns:
        ``smECE`` as a float, or ``(smECE, σ)`` with ``return_bandwidth=True``.
    """
    sigma = check_bandwidth(bandwidth)
    confidence, correct = _top_label(inputs, labels, inputs_are, ignore_index)
    if sigma is None:
        value, sigma = automatic_smooth_ece(confidence, correct)
        value, sigma = float(value[0]), float(sigma[0])
    else:
        value = float(smooth_ece_at(confidence, correct, sigma)[0])
    return (value, sigma) if return_bandwidth else value


def smooth_reliability_curve(inputs, labels, *, bandwidth: float | None = None, inputs_are: str = "auto",
                             ignore_index: int = -100) -> dict:
    """The smoothed reliability curve behind :func:`smooth_ece`, as float64 CPU tensors.

    Keys: ``confidence`` ``(T,)``, the points ``t = linspace(0, 1, T)``; ``accuracy`` ``(T,)``, the smoothed accuracy
    ``μ(t) = t - R_σ(t) / (D_σ(t) + 1e-4)``; ``density`` ``(T,)``, the reflected kernel density estimate of the
    confidences, ``D_σ / N`` (it integrates to about 1 when σ is well below 1/2, where the kernel window is cut);
    ``smooth_ece`` and ``bandwidth`` (floats, the bandwidth automatic unless given).
    """
    sigma = check_bandwidth(bandwidth)
    confidence, correct = _top_label(inputs, labels, inputs_are, ignore_index)
    if sigma is None:
        value, sigma = automatic_smooth_ece(confidence, correct)
        sigma = float(sigma[0])
    else:
        value = smooth_ece_at(confidence, correct, sigma)
    return curve_from_grid(_spread(confidence, correct, grid_points(sigma)), sigma, float(value[0]),
                           confidence.shape[1])
