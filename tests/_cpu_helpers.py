"""Shared helpers of the compiled CPU op's test files (test_uncertainty_weighted_ce_cpu*.py): the op namespace, its
positional arguments and hard targets with ignored rows.
"""

import torch

from calibkernels import _validation as V


WEIGHTS = ["none", "focal", "flsd", "dual_focal", "brier", "external", "brier_flsd"]


def _op():
    import calibkernels.cpp.uncertainty_weighted_ce  # noqa: F401  (registers fake kernels and autograd)

    return torch.ops.calibkernels


def _op_args(z, y, uncertainty="brier", mode="grad", reduction="mean", gamma=2.0, norm=2.0, ignore_index=-100):
    sample_weight = torch.rand(z.shape[0], dtype=z.dtype) + 0.5 if uncertainty == "external" else None
    return (y, sample_weight, None, V.WEIGHT_CODES[uncertainty], V.MODE_CODES[mode], gamma, norm, ignore_index,
            V.REDUCTION_CODES[reduction])


def _targets(n, c, ignored=1):
    y = torch.randint(0, c, (n,))
    y[torch.randperm(n)[:ignored]] = -100
    return y
