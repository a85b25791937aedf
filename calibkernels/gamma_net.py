"""γ-Net: a per-sample focal-loss exponent predicted from penultimate features.

Wang & Golebiowski's meta-regularisation (docs/papers.md, "Meta-regularisation").

For features ``x ∈ R^{b×d}`` (the backbone's penultimate layer), with learnable ``A ∈ R^{d×k}`` and ``W ∈ R^{d×1}``::

    a = x A            (b, k)   attention scores of each sample against k learned prototypes (the columns of A)
    p = softmax(a)     (b, k)
    x̃ = p Aᵀ           (b, d)   the sample re-expressed as a convex mix of the prototypes
    γ = |x̃ W| / τ      (b,)     one focal exponent per sample, ≥ 0 by construction

The γs feed the focal loss ``-(1 - p_t)^{γ_i} log p_t`` (``calibkernels.uncertainty_weighted_ce(...,
uncertainty="focal", gamma=γ)``); the γ-Net's parameters φ = (A, W) are meta-learned to lower a differentiable
calibration error (SECE or DECE, :mod:`calibkernels.metrics.differentiable`) on held-out data
(``training/meta_learning.py``).

k, τ and the initialisation are not published; the choices here are documented on :class:`GammaNet`.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ._validation import is_number

__all__ = ["GammaNet"]


class GammaNet(nn.Module):
    """Attention-style γ-Net: penultimate features ``(N, d)`` → per-sample focal exponents ``γ ≥ 0`` of shape ``(N,)``.

    Args:
        in_features: d, the width of the penultimate features (``model.classifier.in_features``).
        num_prototypes: k, the number of attention prototypes (columns of ``A``). Default 16: enough distinct γ
            "regimes" for 10–200 classes while keeping the γ-Net tiny (``d·(k+1)`` parameters). With ``k = 1`` the
            softmax over one prototype is 1 for every sample, so ``x̃ = A`` and γ is one learned scalar shared by
            the whole batch (no per-sample γ; an ablation, not the method).
        tau: τ, the temperature dividing ``|x̃ W|``; a finite number > 0. Default 1.0.
        init_gamma: the typical γ at initialisation. ``W`` is drawn ``N(0, s²)`` with ``s`` chosen so that
            ``E|x̃ W| / τ = init_gamma`` when the attention is uniform (``‖x̃‖ ≈ 1/√k``; half-normal mean
            ``s·‖x̃‖·sqrt(2/π)``); a sample whose attention is one-hot starts at up to ``√k·init_gamma``. Default 1.0:
            training starts close to a mild focal loss (γ spread over about [0, 4] for k = 16) rather than at plain
            CE (γ = 0) or everywhere at a heavy γ = 5. Must be > 0: ``init_gamma = 0`` would make ``W = 0``, where
            ``γ = |x̃ W| / τ`` is 0 for every sample and has zero gradient in both ``W`` (``x̃ W = 0`` and
            ``d|u|/du = 0`` at ``u = 0``) and ``A`` (it reaches γ only through ``W``): φ could never move, and
            meta-training would silently be plain cross-entropy. Start from a small positive value for a γ near 0.
            The standard deviation of ``W``, ``init_gamma·τ·sqrt(π k / 2)``, must be a normal float32 (the
            parameters are float32): otherwise ``W`` would be 0 or infinite and γ 0 or NaN, so it raises.

    ``A`` is drawn ``N(0, 1/d)`` so the attention scores ``x A`` are O(1) for features whose entries are O(1),
    i.e. the softmax starts neither uniform nor one-hot.

    The γ-Net should be fed *detached* features (``gamma_net(features.detach())``): its training signal is the
    meta-validation calibration error, and letting that gradient into the backbone would make the backbone learn to
    produce features that give convenient γs instead of features that classify (``training/meta_learning.py`` does so).

    Shapes: input ``(N, d)`` (or ``(..., d)``), output ``(N,)`` (or ``(...)``), in the input's dtype.
    """

    def __init__(self, in_features: int, num_prototypes: int = 16, tau: float = 1.0, init_gamma: float = 1.0):
        super().__init__()
        for name, value in (("in_features", in_features), ("num_prototypes", num_prototypes)):
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name} must be an int, got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        for name, value in (("tau", tau), ("init_gamma", init_gamma)):
            if not is_number(value):
                raise TypeError(f"{name} must be a number, got {type(value).__name__}")
        if not (tau > 0 and math.isfinite(tau)):
            raise ValueError(f"tau must be a finite number > 0, got {tau!r}")
        if not (init_gamma > 0 and math.isfinite(init_gamma)):
            raise ValueError(f"init_gamma must be a finite number > 0 (γ = |x̃W|/τ with W = 0 has no gradient, so γ "
                             f"would stay 0), got {init_gamma!r}")
        float32 = torch.finfo(torch.float32)
        if tau < float32.tiny:
            # the parameters and the features are at most float32 in practice: a smaller τ rounds to 0 there
            raise ValueError(f"tau must be at least {float32.tiny:.3g} (the smallest normal float32), got {tau!r}")
        std = self._projection_std(init_gamma, tau, num_prototypes)
        # W ~ N(0, std²) is drawn in float32: a std outside the normal float32 range would draw W = 0 or ±inf
        if not float32.tiny <= std <= float32.max / 64:
            raise ValueError(f"init_gamma·tau·sqrt(π k / 2) = {std:.3g} (the standard deviation of W) is outside the "
                             f"float32 range [{float32.tiny:.3g}, {float32.max / 64:.3g}]: W would be 0 or infinite; "
                             f"got init_gamma={init_gamma!r}, tau={tau!r}, num_prototypes={num_prototypes}")
        self.in_features = in_features
        self.num_prototypes = num_prototypes
        self.tau = float(tau)
        self.init_gamma = float(init_gamma)
        self.prototypes = nn.Parameter(torch.empty(in_features, num_prototypes))  # A (d, k)
        self.projection = nn.Parameter(torch.empty(in_features, 1))  # W (d, 1)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        with torch.no_grad():
            self.prototypes.normal_(0.0, 1.0 / math.sqrt(self.in_features))
            # A's columns have norm ≈ 1 and near-orthogonal directions, so x̃ (a convex mix of them) has norm
            # between ≈ 1/√k (uniform attention) and ≈ 1 (one-hot attention).
            self.projection.normal_(0.0, self._projection_std(self.init_gamma, self.tau, self.num_prototypes))

    @staticmethod
    def _projection_std(init_gamma: float, tau: float, num_prototypes: int) -> float:
        """``s = init_gamma · τ · sqrt(π/2) · √k``: ``E|x̃ W| / τ = s ‖x̃‖ sqrt(2/π) / τ = init_gamma`` for
        ``‖x̃‖ = 1/√k`` (uniform attention) and ``W ~ N(0, s²)``."""
        return init_gamma * tau * math.sqrt(math.pi / 2.0) * math.sqrt(num_prototypes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"features must be a torch.Tensor, got {type(features).__name__}")
        if not features.is_floating_point():
            raise TypeError(f"features must be floating point, got {features.dtype}")
        if features.dim() < 1 or features.shape[-1] != self.in_features:
            raise ValueError(
                f"features must have shape (..., {self.in_features}) (the penultimate width), got "
                f"{tuple(features.shape)}"
            )
        prototypes = self.prototypes.to(features.dtype)
        attention = torch.softmax(features @ prototypes, dim=-1)  # (..., k)
        mixed = attention @ prototypes.transpose(0, 1)  # (..., d)
        return (mixed @ self.projection.to(features.dtype)).squeeze(-1).abs() / self.tau

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, num_prototypes={self.num_prototypes}, tau={self.tau}"
