"""Epoch-level loss options of a run (training/README.md, "Loss schedules"): the focal-loss paper's γ schedule
(FLSc-531), a cross-entropy warm-up, and AdaFocal's per-epoch update from the validation split.

* ``--gamma-schedule flsc-531``: γ = 5 for epochs [0, s₁), 3 for [s₁, s₂), 1 from s₂ on (Mukhoti et al. 2020,
  "FLSc-531"; ``flsc-532`` ends at 2). The switch epochs are the recipe's ``gamma_schedule_epochs`` (the published
  ones: 100 and 250 of the CIFAR recipes' 350 epochs, 30 and 70 of Tiny-ImageNet's 100, as in the official scripts),
  scaled to the run's length: ``s_k = floor(E · s_k,recipe / E_recipe + 1/2)``. A recipe without published epochs
  scales the CIFAR ones (100 and 250 of 350): ``digits``' 300 epochs switch at 86 and 214. ``--gamma-schedule-epochs
  A,B`` gives them directly. The schedule sets the loss's single exponent γ (``focal_loss`` is the paper's FLSc; any
  loss with one γ accepts it: ``focal_loss_gra``, ``dual_focal_loss*``, ``bsce*``, ``flsd*`` (its γ for p_y >= 0.5),
  ``bsce_adaptive_gra``, or ``mdca`` over one of them).
* ``--ce-warmup-epochs K``: plain cross-entropy (same reduction, backend and label smoothing) for epochs [0, K), then
  the chosen loss.
* A loss with an ``update(val_logits, val_labels)`` step (``adafocal``) gets it after every epoch in which it trained,
  with the logits of the whole validation split gathered from every rank.
"""

from __future__ import annotations

import math

from torch import nn

import calibkernels as ck

__all__ = ["GAMMA_SCHEDULES", "LossSchedule", "gamma_holder", "parse_epochs", "switch_epochs"]

# name -> the exponents of its three phases
GAMMA_SCHEDULES = {"none": None, "flsc-531": (5.0, 3.0, 1.0), "flsc-532": (5.0, 3.0, 2.0)}
# Mukhoti et al.'s CIFAR switch epochs, scaled for recipes that publish none
REFERENCE_SWITCH_EPOCHS, REFERENCE_EPOCHS = (100, 250), 350


def parse_epochs(text) -> tuple[int, ...]:
    """``"100,250"`` (or a sequence) → ``(100, 250)``; ``None`` / ``""`` → ``()``."""
    if text is None or text == "":
        return ()
    if isinstance(text, str):
        try:
            return tuple(int(part) for part in text.split(","))
        except ValueError as exc:
            raise ValueError(f"--gamma-schedule-epochs takes two epochs A,B, got {text!r}") from exc
    return tuple(int(part) for part in text)


def switch_epochs(epochs: int, recipe_switch: tuple = (), recipe_epochs: int | None = None,
                  given: tuple = ()) -> tuple[int, int]:
    """The two epochs at which the γ schedule moves on (module docstring): ``given`` as it is, else the recipe's (or
    the CIFAR reference's) scaled to ``epochs``."""
    if given:
        first, second = given if len(given) == 2 else (None, None)
        if first is None or not 0 < first < second <= epochs:
            raise ValueError(f"--gamma-schedule-epochs needs two epochs 0 < A < B <= --epochs ({epochs}), got {given}")
        return first, second
    reference, length = (recipe_switch, recipe_epochs) if recipe_switch else (REFERENCE_SWITCH_EPOCHS,
                                                                              REFERENCE_EPOCHS)
    return tuple(math.floor(epochs * step / length + 0.5) for step in reference)


def gamma_holder(criterion: nn.Module):
    """The module whose single number ``gamma`` a γ schedule sets, or ``None`` if the loss has no such exponent."""
    if isinstance(criterion, ck.losses.MDCALoss):
        return None if criterion.base is None else gamma_holder(criterion.base)
    scheduled = ("focal", "flsd", "dual_focal", "brier", "brier_flsd")
    if isinstance(criterion, ck.losses.UncertaintyWeightedCE) and criterion.uncertainty in scheduled:
        return criterion
    return None


class LossSchedule:
    """Which loss module trains each epoch, with which γ (module docstring)."""

    def __init__(self, criterion: nn.Module, *, gamma_schedule: str = "none", switch: tuple[int, int] | None = None,
                 ce_warmup_epochs: int = 0, warmup_criterion: nn.Module | None = None):
        if gamma_schedule not in GAMMA_SCHEDULES:
            raise ValueError(f"unknown --gamma-schedule {gamma_schedule!r}; expected one of "
                             f"{', '.join(GAMMA_SCHEDULES)}")
        self.criterion, self.warmup_criterion = criterion, warmup_criterion
        self.gammas = GAMMA_SCHEDULES[gamma_schedule]
        self.gamma_schedule, self.switch, self.ce_warmup_epochs = gamma_schedule, switch, int(ce_warmup_epochs)
        self.holder = gamma_holder(criterion) if self.gammas else None
        if self.gammas and self.holder is None:
            raise ValueError(f"--gamma-schedule {gamma_schedule} sets the loss's exponent γ, but "
                             f"{type(criterion).__name__} has no single γ (use focal_loss, focal_loss_gra, "
                             "dual_focal_loss*, bsce*, flsd*, bsce_adaptive_gra, or mdca over one of them)")
        if self.gammas and (switch is None or len(switch) != 2):
            raise ValueError("a γ schedule needs its two switch epochs")
        if self.ce_warmup_epochs < 0:
            raise ValueError(f"--ce-warmup-epochs must be >= 0, got {ce_warmup_epochs}")
        if self.ce_warmup_epochs and warmup_criterion is None:
            raise ValueError("a cross-entropy warm-up needs its cross-entropy module")

    def gamma_at(self, epoch: int) -> float | None:
        """The scheduled γ of ``epoch`` (0-based), or ``None`` without a schedule."""
        if not self.gammas:
            return None
        first, second = self.switch
        return self.gammas[0] if epoch < first else self.gammas[1] if epoch < second else self.gammas[2]

    def criterion_for(self, epoch: int) -> nn.Module:
        """The module that trains ``epoch``, its γ set by the schedule."""
        if epoch < self.ce_warmup_epochs:
            return self.warmup_criterion
        gamma = self.gamma_at(epoch)
        if gamma is not None:
            self.holder.gamma = gamma
        return self.criterion

    def updates_after(self, epoch: int) -> bool:
        """Whether the loss takes a validation update after ``epoch`` (it has one and it trained that epoch)."""
        return epoch >= self.ce_warmup_epochs and callable(getattr(self.criterion, "update", None))

    def describe(self) -> str:
        parts = []
        if self.ce_warmup_epochs:
            parts.append(f"cross-entropy for epochs 1-{self.ce_warmup_epochs}")
        if self.gammas:
            first, second = self.switch
            g1, g2, g3 = (f"{g:g}" for g in self.gammas)
            parts.append(f"γ {g1} for epochs 1-{first}, {g2} to {second}, {g3} after ({self.gamma_schedule})")
        if callable(getattr(self.criterion, "update", None)):
            parts.append("γ per bin updated from the validation split after every epoch")
        return "; ".join(parts)
