"""calibkernels: fused kernels and tools for training calibrated classifiers.

>>> import torch, calibkernels as ck
>>> logits = torch.randn(8, 10, requires_grad=True)
>>> target = torch.randint(0, 10, (8,))
>>> loss = ck.bsce_gra_loss(logits, target)        # BSCE-GRA, γ = 4, q = 2, mean reduction
>>> loss.backward()

See ``docs/losses.md`` for the loss family and :mod:`calibkernels.reference` for the readable definitions.
"""

import torch

from . import _backends, calibration, distributed, losses, metrics, reference
from ._backends import available_backends
from ._target_checks import synchronize_target_checks
from .functional import bsce_gra_loss, uncertainty_weighted_ce
from .fused_linear import fused_linear_uncertainty_weighted_ce
from .gamma_net import GammaNet
from .loss_stats import LossStats

__version__ = "0.1.0"

# Load the compiled op (torch.ops.calibkernels.*) together with its fake kernel at import, as torchvision does: an op
# called directly, traced by torch.compile or checked by opcheck must never exist without it. A missing or broken
# extension is only recorded here; backend "auto" falls back to the reference with one warning when it is first used.
_backends.unavailable_reason("cpu", torch.device("cpu"))


def release_cpu_gradient_cache() -> int:
    """Free the gradient buffers that the CPU kernel keeps for reuse between steps (at most two, see
    ``csrc/cpu/gradient_buffer_cache.h``), as ``torch.cuda.empty_cache()`` does for the GPU; returns the bytes freed
    (0 without the compiled extension). ``CALIBKERNELS_CPU_GRAD_CACHE=0`` turns the reuse off."""
    if _backends.unavailable_reason("cpu", torch.device("cpu")) is not None:
        return 0
    return int(torch.ops.calibkernels.release_cpu_gradient_cache())


__all__ = [
    "GammaNet",
    "LossStats",
    "available_backends",
    "bsce_gra_loss",
    "calibration",
    "distributed",
    "fused_linear_uncertainty_weighted_ce",
    "losses",
    "metrics",
    "reference",
    "synchronize_target_checks",
    "release_cpu_gradient_cache",
    "uncertainty_weighted_ce",
]
