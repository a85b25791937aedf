"""calibkernels: fused kernels and tools for training calibrated classifiers.

>>> import torch, calibkernels as ck
>>> logits = torch.randn(8, 10, requires_grad=True)
>>> target = torch.randint(0, 10, (8,))
>>> loss = ck.bsce_gra_loss(logits, target)        # BSCE-GRA, γ = 4, q = 2, mean reduction
>>> loss.backward()

See ``SPEC.md`` §2 for the loss family and :mod:`calibkernels.reference` for the readable definitions.
"""

from . import calibration, losses, metrics, reference
from ._backends import available_backends
from ._target_checks import synchronize_target_checks
from .functional import bsce_gra_loss, uncertainty_weighted_ce
from .gamma_net import GammaNet

__version__ = "0.1.0"

__all__ = [
    "GammaNet",
    "available_backends",
    "bsce_gra_loss",
    "calibration",
    "losses",
    "metrics",
    "reference",
    "synchronize_target_checks",
    "uncertainty_weighted_ce",
]
