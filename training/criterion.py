"""The run's loss: a ``--loss`` spec (``NAME[:KEY=VALUE…]``) parsed, checked and built with the recipe's reduction,
and its schedule over the epochs (γ schedule, cross-entropy warm-up; :mod:`training.loss_schedules`)."""

from __future__ import annotations

import ast

from torch import nn

import calibkernels as ck

from .loss_schedules import LossSchedule, parse_epochs, switch_epochs

def parse_loss_spec(spec: str) -> tuple[str, dict]:
    """``"focal_loss:gamma=2"`` → ``("focal_loss", {"gamma": 2})``; values are Python literals or strings."""
    name, *assignments = spec.strip().split(":")
    if name not in ck.losses.names():
        raise ValueError(f"unknown loss {name!r} in {spec!r}; expected one of {', '.join(ck.losses.names())}")
    hyperparameters = {}
    for item in assignments:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ValueError(f"loss hyperparameter {item!r} in {spec!r} is not KEY=VALUE")
        try:
            hyperparameters[key] = ast.literal_eval(raw)
        except (ValueError, SyntaxError):
            hyperparameters[key] = raw
    return name, hyperparameters


# Loss modules with a fused kernel (the others run the reference and keep backend "auto").
_FUSED_MODULES = (ck.losses.UncertaintyWeightedCE, ck.losses.AdaptiveBSCEGRA, ck.losses.AdaFocalLoss,
                  ck.losses.MbLSLoss, ck.losses.MDCALoss)


def build_criterion(spec: str, reduction: str, backend: str, label_smoothing: float = 0.0,
                    mmce_form: str | None = None, return_stats: bool = False) -> nn.Module:
    """The loss module of ``spec`` with the recipe's reduction; ``backend`` goes to losses that have fused kernels;
    ``label_smoothing`` (> 0) needs a loss of the uncertainty-weighted CE family; ``mmce_form`` (the recipe's) is the
    MMCE form of ``mmce`` / ``mmce_weighted`` unless ``spec`` gives ``form=``. ``return_stats``: losses that call
    the functional loss (those whose registry entry takes ``return_stats``) return ``(loss, stats)``, the top-label
    statistics the training loop's calibration meter takes; the others return the loss alone."""
    name, hyperparameters = parse_loss_spec(spec)
    # The run decides these two: the recipe the reduction (the training loop scales the loss for it) and --backend the
    # kernel; a value in the spec would clash with or silently lose to them.
    if "reduction" in hyperparameters:
        raise ValueError("reduction= cannot be set in a loss spec: the recipe sets the reduction (--list-recipes)")
    if "backend" in hyperparameters:
        raise ValueError(f"backend= cannot be set in a loss spec: pass --backend {hyperparameters['backend']}")
    if "return_stats" in hyperparameters:
        raise ValueError("return_stats= cannot be set in a loss spec: the training loop asks for the statistics")
    if return_stats and "return_stats" in getattr(ck.losses.REGISTRY[name], "accepted", ()):
        hyperparameters["return_stats"] = True
    if label_smoothing:
        if "label_smoothing" in hyperparameters:
            raise ValueError(f"label smoothing given twice: --label-smoothing and in the loss {spec!r}")
        hyperparameters["label_smoothing"] = label_smoothing
    if mmce_form is not None and name in ("mmce", "mmce_weighted"):
        hyperparameters.setdefault("form", mmce_form)
    criterion = ck.losses.build(name, reduction=reduction, **hyperparameters)
    for module in criterion.modules():
        if isinstance(module, _FUSED_MODULES):
            module.backend = backend
    return criterion


def loss_schedule(args, criterion: nn.Module, recipe) -> LossSchedule:
    """The run's :class:`training.loss_schedules.LossSchedule` (γ schedule, cross-entropy warm-up) around
    ``criterion``; raises ValueError for options that do not fit the loss, the method or the run's length."""
    gamma_schedule = getattr(args, "gamma_schedule", "none") or "none"
    warmup = int(getattr(args, "ce_warmup_epochs", 0) or 0)
    if (gamma_schedule != "none" or warmup) and args.method != "standard":
        raise ValueError("--gamma-schedule and --ce-warmup-epochs need --method standard")
    if warmup < 0 or (warmup and warmup >= args.epochs):
        raise ValueError(f"--ce-warmup-epochs must be >= 0 and < --epochs ({args.epochs}), got {warmup}")
    switch = None
    if gamma_schedule != "none":
        switch = switch_epochs(args.epochs, recipe.gamma_schedule_epochs, recipe.epochs,
                               parse_epochs(getattr(args, "gamma_schedule_epochs", None)))
    warmup_criterion = None
    if warmup:
        warmup_criterion = build_criterion("cross_entropy", args.reduction, args.backend,
                                           getattr(args, "label_smoothing", 0.0), return_stats=True)
    return LossSchedule(criterion, gamma_schedule=gamma_schedule, switch=switch, ce_warmup_epochs=warmup,
                        warmup_criterion=warmup_criterion)


def check_loss_spec(spec: str, label_smoothing: float = 0.0, mixing: bool = False, mix_dense: bool = False) -> None:
    """Raise a ValueError naming ``spec`` if it does not build a loss (unknown name, misspelt hyperparameter, …), or
    if it cannot take the soft targets that label smoothing or mixing (compact, or dense with ``mix_dense``) give
    it."""
    try:
        criterion = build_criterion(spec, reduction="mean", backend="auto", label_smoothing=label_smoothing)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad loss {spec!r}: {exc}") from exc
    if (label_smoothing or mixing) and not isinstance(criterion, ck.losses.UncertaintyWeightedCE):
        raise ValueError(f"loss {spec!r} takes class-index targets only: --label-smoothing, --mixup-alpha and "
                         "--cutmix-alpha need a loss of the uncertainty-weighted CE family (cross_entropy, "
                         "focal_loss*, flsd*, bsce*)")
    if mixing and criterion.uncertainty == "dual_focal":
        raise ValueError(f"loss {spec!r}: dual focal has no soft-target form, so it cannot train on mixed batches")
    if mixing and not mix_dense and isinstance(criterion, ck.losses.SoftTargetUncertaintyWeightedCE):
        raise ValueError(f"loss {spec!r} has timm's SoftTargetCrossEntropy signature, forward(x, target), and takes a "
                         "mixed batch as dense targets: add --mix-dense, or use its compact-form loss (e.g. bsce_gra)")
