"""The pure-PyTorch reference seen as a backend (the interface of ``calibkernels._backends``)."""

from __future__ import annotations

from .reference import _uncertainty_weighted_ce


def is_available(name, device):
    return None  # runs on every device and dtype


def run(name, inputs, inplace):
    # ``inplace`` lets a kernel overwrite the logits with the gradient; the reference never needs to and leaves them.
    return _uncertainty_weighted_ce(inputs)
