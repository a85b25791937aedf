"""The drop-in options of the loss modules (``ck.losses.UncertaintyWeightedCE`` and its subclasses,
``ck.FusedLinearUncertaintyWeightedCE``): ``F.cross_entropy``'s per-class ``weight`` (a buffer, as
``nn.CrossEntropyLoss`` keeps it) and Liger-Kernel's ``lse_square_scale``, ``softcap`` and ``return_z_loss``, checked
once at construction, passed to each call and shown in the module's repr."""

from __future__ import annotations

import torch
from torch import nn

from ._validation import check_class_weight, check_class_weight_tensor, check_drop_in_options

__all__ = ["DropInOptions"]


class DropInOptions(nn.Module):
    """A loss module with the drop-in options (docs/losses.md, "Coming from F.cross_entropy / Liger-Kernel")."""

    def _init_drop_in(self, weight, lse_square_scale, softcap, return_z_loss) -> None:
        """Check and keep the options; ``weight`` becomes the buffer ``self.weight`` (``None`` when not given: not in
        the state dict then, so state dicts of modules without it still load)."""
        self.register_buffer("weight", _class_weight_buffer(weight))
        drop_in = check_drop_in_options(lse_square_scale=lse_square_scale, return_z_loss=return_z_loss,
                                        softcap=softcap)
        self.lse_square_scale, self.softcap = drop_in["lse_square_scale"], drop_in["softcap"]
        self.return_z_loss = drop_in["return_z_loss"]

    def _drop_in_options(self) -> dict:
        """The ``F.cross_entropy`` / Liger-Kernel keywords of a call, only those given (the common call stays the
        fused backends' fast path)."""
        options = {}
        if self.weight is not None:
            options["weight"] = self.weight
        if self.lse_square_scale != 0.0:
            options["lse_square_scale"] = self.lse_square_scale
        if self.softcap is not None:
            options["softcap"] = self.softcap
        if self.return_z_loss:
            options["return_z_loss"] = True
        return options

    def _drop_in_repr(self) -> list:
        """The options' part of :meth:`extra_repr`."""
        parts = []
        if self.weight is not None:
            parts.append(f"weight=<({self.weight.shape[0]},) {str(self.weight.dtype).removeprefix('torch.')}>")
        if self.lse_square_scale != 0.0:
            parts.append(f"lse_square_scale={self.lse_square_scale}")
        if self.softcap is not None:
            parts.append(f"softcap={self.softcap}")
        if self.return_z_loss:
            parts.append("return_z_loss=True")
        return parts


def _class_weight_buffer(weight) -> torch.Tensor | None:
    """The module's per-class weights, checked as :func:`calibkernels._validation.check_class_weight_tensor` checks
    them at a call, except their length (the logits' ``C``, checked at each call). A string raises the
    :func:`calibkernels._validation.check_class_weight` ``TypeError`` naming ``uncertainty=``."""
    if isinstance(weight, str):
        check_class_weight(weight)
    if isinstance(weight, torch.Tensor) and weight.dim() != 1:
        raise ValueError(f"weight (the per-class weights) must have shape (C,), one entry per class, got "
                         f"{tuple(weight.shape)}")
    length = weight.shape[0] if isinstance(weight, torch.Tensor) else 0
    return check_class_weight_tensor(weight, torch.empty((0, length), device=getattr(weight, "device", "cpu")))
