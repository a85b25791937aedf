"""Meta-regularised calibration (Wang & Golebiowski, "Towards Unbiased Calibration using Meta-Regularization";
docs/papers.md).

``--method meta-sece`` / ``--method meta-dece`` train any recipe with a focal loss whose exponent is predicted per
sample by a γ-Net (:class:`calibkernels.GammaNet`, parameters φ) from the penultimate features, while φ is meta-learned
to lower a differentiable calibration error (SECE or DECE, :mod:`calibkernels.metrics.differentiable`) on a held-out
meta-validation split. One step of the slides' Algorithm 1, as :meth:`MetaRegularizer.train_step` runs it:

1. training batch ``(x_t, y_t)``: features ``h_t = f(x_t)``, logits ``z_t = g_θc(h_t)``, ``γ = f^γ_φ(sg[h_t])``;
2. θ update: ``L = Σ_i (1 - p_{i,y})^{sg[γ_i]} CE_i`` (the fused op, ``backend="auto"``, γ detached) — the given
   optimizer steps the whole classifier network (backbone and classifier layer);
3. differentiable look-ahead of the classifier layer only (``torch.func.functional_call`` +
   ``torch.autograd.grad(create_graph=True)``, from the classifier's parameters *before* step 2):
   ``θc'(φ) = θc - η ∇_θc L(θc, γ(φ))`` where η is the optimizer's learning rate (so θc' is the step the optimizer
   just took, as a function of φ, up to momentum and weight decay) and the gradient is scaled by the same
   gradient-clipping factor as the real step;
4. φ update: ``SECE(g_θc'(f(x_v)), y_v)`` (or DECE) on a meta-validation batch, backpropagated to φ through
   θc'(φ) and γ(φ); Adam, lr 1e-3.

Why the look-ahead is over the classifier layer only: it is the part whose update depends on γ most directly, and it
makes the second-order term cheap (a d×C matrix instead of the backbone's Hessian-vector products). The γ-Net reads
detached features so the calibration signal on φ never reaches the backbone (the backbone is trained only by the
γ-weighted focal loss, as in Algorithm 1). Meta-validation features are computed with the model in eval mode under
``torch.no_grad()``: the calibration that matters is the model's at test time, and eval mode keeps the meta batch out
of BatchNorm's running statistics (the meta split must stay unseen by θ).

Defaults (not published; chosen and documented here): k = 16 prototypes, τ = 1, initial γ ≈ 1, SECE bandwidth 0.05,
DECE 15 bins with t_a = 100, t_b = 0.01, meta lr 1e-3 (Adam), meta split 10 % of the training set.
"""

from __future__ import annotations

import argparse
import math

import torch
from torch.func import functional_call

import calibkernels as ck
from calibkernels.gamma_net import GammaNet
from calibkernels.metrics.differentiable import (
    DECE_DEFAULT_BINS,
    DECE_DEFAULT_T_A,
    DECE_DEFAULT_T_B,
    SECE_DEFAULT_BANDWIDTH,
    dece,
    sece,
)

__all__ = ["META_METHODS", "META_DEFAULTS", "add_meta_args", "check_meta_args", "focal_loss_with_gamma_grad",
           "MetaRegularizer"]

META_METHODS = {"meta-sece": "sece", "meta-dece": "dece"}

META_DEFAULTS = {
    "meta_k": 16,
    "meta_tau": 1.0,
    "meta_init_gamma": 1.0,
    "meta_bandwidth": SECE_DEFAULT_BANDWIDTH,
    "meta_lr": 1e-3,
    "meta_fraction": 0.1,
    "meta_batch_size": None,
    "meta_lookahead_lr": None,
    "meta_dece_bins": DECE_DEFAULT_BINS,
    "meta_dece_t_a": DECE_DEFAULT_T_A,
    "meta_dece_t_b": DECE_DEFAULT_T_B,
}

# Keys of the training loop's loss_kwargs that configure the θ step here. The focal loss's own hyper-parameters
# (gamma, weight, mode, norm) are accepted and ignored: under meta-regularisation γ comes from the γ-Net and the loss is
# always focal.
_STEP_KEYS = {"reduction", "ignore_index", "backend", "max_grad_norm", "loss_scale", "amp_dtype", "scaler"}
_IGNORED_LOSS_KEYS = {"gamma", "weight", "mode", "norm", "name", "loss"}
_CLIP_ALIASES = ("clip_grad_norm", "grad_clip", "clip")


def add_meta_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``--meta-*`` options (used by ``--method meta-sece|meta-dece``) to ``parser``; returns it."""
    group = parser.add_argument_group("meta-regularisation (--method meta-sece | meta-dece; docs/papers.md)")
    d = META_DEFAULTS
    group.add_argument("--meta-k", type=int, default=d["meta_k"],
                       help="γ-Net prototypes k (columns of A ∈ R^{d×k}) (default: %(default)s)")
    group.add_argument("--meta-tau", type=float, default=d["meta_tau"],
                       help="γ-Net temperature τ in γ = |x̃W|/τ (default: %(default)s)")
    group.add_argument("--meta-init-gamma", type=float, default=d["meta_init_gamma"],
                       help="typical γ at initialisation, > 0 (default: %(default)s)")
    group.add_argument("--meta-bandwidth", type=float, default=d["meta_bandwidth"],
                       help="SECE Gaussian kernel bandwidth on confidences (default: %(default)s)")
    group.add_argument("--meta-lr", type=float, default=d["meta_lr"],
                       help="Adam learning rate of the γ-Net (default: %(default)s)")
    group.add_argument("--meta-fraction", type=float, default=d["meta_fraction"],
                       help="fraction of the training set carved out as the meta-validation split, disjoint from "
                            "validation and test (default: %(default)s)")
    group.add_argument("--meta-batch-size", type=int, default=d["meta_batch_size"],
                       help="meta-validation batch size (default: the training batch size)")
    group.add_argument("--meta-lookahead-lr", type=float, default=d["meta_lookahead_lr"],
                       help="step size η of the differentiable look-ahead (default: the optimizer's current lr)")
    group.add_argument("--meta-dece-bins", type=int, default=d["meta_dece_bins"],
                       help="DECE soft bins (default: %(default)s)")
    group.add_argument("--meta-dece-t-a", type=float, default=d["meta_dece_t_a"],
                       help="DECE soft-rank sharpness t_a (default: %(default)s)")
    group.add_argument("--meta-dece-t-b", type=float, default=d["meta_dece_t_b"],
                       help="DECE soft-binning temperature t_b (default: %(default)s)")
    return parser


def check_meta_args(args) -> None:
    """Raise a ValueError naming the flag for a ``--meta-*`` option that cannot train, before anything runs (a bad
    bandwidth or bin count would otherwise fail at the first step, once the run folder exists)."""
    def positive(name, value, integer=False):
        if value is None:
            return
        if integer:
            if value < 1:
                raise ValueError(f"--{name} must be >= 1, got {value}")
        elif not (value > 0 and math.isfinite(value)):
            raise ValueError(f"--{name} must be finite and > 0, got {value}")

    for name in ("meta_k", "meta_dece_bins", "meta_batch_size"):
        positive(name.replace("_", "-"), getattr(args, name, None), integer=True)
    for name in ("meta_tau", "meta_init_gamma", "meta_bandwidth", "meta_lr", "meta_lookahead_lr", "meta_dece_t_a",
                 "meta_dece_t_b"):
        positive(name.replace("_", "-"), getattr(args, name, None))
    fraction = getattr(args, "meta_fraction", None)
    if fraction is not None and not 0 < fraction < 1:
        raise ValueError(f"--meta-fraction must be in (0, 1): the meta methods need a meta split, got {fraction}")


def focal_loss_with_gamma_grad(logits, targets, gamma, *, reduction="mean", ignore_index=-100):
    """Focal loss ``(1 - p_y)^{γ_i} CE_i`` differentiable in a per-sample ``γ (N,)`` as well as in the logits.

    Same value as ``calibkernels.reference.uncertainty_weighted_ce(uncertainty="focal", mode="loss", gamma=γ)``, but
    ``1 - p_y`` is floored at the dtype's smallest normal number before ``(.)^γ``: for a sample predicted with
    ``p_y`` = 1 to machine precision, ``∂/∂γ x^γ = x^γ log x`` would otherwise be ``0 · (-inf) = NaN`` and poison φ.
    """
    if reduction not in ("mean", "sum", "none"):
        raise ValueError(f"unknown reduction {reduction!r}")
    valid = targets != ignore_index
    safe_targets = torch.where(valid, targets, torch.zeros_like(targets))
    log_p = torch.log_softmax(logits, dim=-1)
    log_p_target = log_p.gather(1, safe_targets[:, None]).squeeze(1)
    one_minus_p_target = (-torch.expm1(log_p_target)).clamp_min(torch.finfo(log_p.dtype).tiny)
    per_sample = torch.exp(gamma.to(log_p.dtype) * torch.log(one_minus_p_target)) * (-log_p_target)
    per_sample = torch.where(valid, per_sample, torch.zeros((), dtype=per_sample.dtype, device=per_sample.device))
    if reduction == "none":
        return per_sample
    if reduction == "sum":
        return per_sample.sum()
    return per_sample.sum() / valid.sum().clamp_min(1)


def _option(args, name):
    value = getattr(args, name, None) if args is not None else None
    return META_DEFAULTS[name] if value is None else value


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _average_gradients_across_ranks(module) -> None:
    """Under DDP every rank holds a γ-Net replica; averaging φ's gradients keeps the replicas identical."""
    if not _distributed():
        return
    world = torch.distributed.get_world_size()
    for parameter in module.parameters():
        torch.distributed.all_reduce(parameter.grad)
        parameter.grad.div_(world)


def _unwrap(model):
    """The module exposing ``.features`` / ``.classifier`` (through torch.compile's and a DataParallel/DDP wrapper if
    any)."""
    inner = getattr(model, "_orig_mod", model)
    inner = getattr(inner, "module", inner)
    for name in ("features", "classifier"):
        if not hasattr(inner, name):
            raise TypeError(f"meta-regularisation needs a model with .features and .classifier (the training/models "
                            f"contract); {type(inner).__name__} has no .{name}")
    if not isinstance(inner.classifier, torch.nn.Linear):
        raise TypeError(f"model.classifier must be an nn.Linear, got {type(inner.classifier).__name__}")
    return inner


class MetaRegularizer:
    """γ-Net + SECE/DECE meta-regularisation around a model and its optimizer (module docstring: the algorithm).

    Args:
        model: a training/models model (``.features``: input → ``(N, d)``, ``.classifier``: ``nn.Linear(d, C)``),
            possibly wrapped by DDP and/or ``torch.compile``: the θ step's forward goes through ``model`` as given,
            so a compiled model trains compiled (the features reach the γ-Net through a forward hook on the
            classifier, registered once, which Dynamo traces into the graph).
        num_classes: C (checked against the classifier).
        objective: ``"sece"`` or ``"dece"``, the meta-validation calibration error.
        args: an argparse namespace with the ``--meta-*`` options (:func:`add_meta_args`); missing ones take
            ``META_DEFAULTS``. ``None`` uses the defaults.
        device: where the γ-Net lives (the model's device).
    """

    def __init__(self, model, num_classes: int, objective: str = "sece", args=None, device="cpu"):
        if objective not in ("sece", "dece"):
            raise ValueError(f"objective must be 'sece' or 'dece', got {objective!r}")
        self.model = model
        self.network = _unwrap(model)
        classifier = self.network.classifier
        if classifier.out_features != num_classes:
            raise ValueError(f"model.classifier has {classifier.out_features} outputs but num_classes={num_classes}")
        self.num_classes = num_classes
        self.objective = objective
        self.bandwidth = float(_option(args, "meta_bandwidth"))
        self.dece_bins = int(_option(args, "meta_dece_bins"))
        self.dece_t_a = float(_option(args, "meta_dece_t_a"))
        self.dece_t_b = float(_option(args, "meta_dece_t_b"))
        self.lookahead_lr = getattr(args, "meta_lookahead_lr", None) if args is not None else None
        meta_lr = float(_option(args, "meta_lr"))
        if not (meta_lr > 0 and math.isfinite(meta_lr)):
            raise ValueError(f"--meta-lr must be finite and > 0, got {meta_lr}")
        self.gamma_net = GammaNet(
            classifier.in_features,
            num_prototypes=int(_option(args, "meta_k")),
            tau=float(_option(args, "meta_tau")),
            init_gamma=float(_option(args, "meta_init_gamma")),
        ).to(device=device, dtype=classifier.weight.dtype)
        if _distributed():  # ranks are seeded differently: start every γ-Net replica from rank 0's φ
            for parameter in self.gamma_net.parameters():
                torch.distributed.broadcast(parameter.data, src=0)
        self.meta_optimizer = torch.optim.Adam(self.gamma_net.parameters(), lr=meta_lr)
        self._epoch_gammas: list[torch.Tensor] = []
        # One hook for the regulariser's lifetime, storing only during the θ step's forward: a hook added and removed
        # every step would change what a compiled model's graph guards on, and recompile it at every step.
        self._capturing, self._captured = False, []
        self._hook = classifier.register_forward_hook(self._capture_features)

    def _capture_features(self, module, inputs, output):
        if self._capturing:
            self._captured.append(inputs[0])

    # -- pieces of the step, public so they can be tested and reused ---------------------------------------------

    def calibration_error(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The differentiable meta objective (SECE or DECE) of ``logits (N, C)`` against ``targets (N,)``."""
        if self.objective == "sece":
            return sece(logits, targets, bandwidth=self.bandwidth, inputs_are="logits")
        return dece(logits, targets, n_bins=self.dece_bins, t_a=self.dece_t_a, t_b=self.dece_t_b, inputs_are="logits")

    def lookahead_objective(self, features, targets, gamma, meta_features, meta_targets, *, lr, classifier_params=None,
                            reduction="mean", ignore_index=-100, grad_scale=1.0):
        """Meta objective after a differentiable one-step look-ahead of the classifier layer, as a function of γ.

        ``θc' = θc - lr · grad_scale · ∇_θc focal(g_θc(features), targets; γ)``, then the calibration error of
        ``g_θc'(meta_features)``. ``features`` / ``meta_features`` are used detached; ``classifier_params`` (default:
        the classifier's current parameters) are detached too, so the result depends on φ only through ``gamma``.
        """
        classifier = self.network.classifier
        if classifier_params is None:
            classifier_params = dict(classifier.named_parameters())
        params = {name: p.detach().requires_grad_(True) for name, p in classifier_params.items()}
        logits = functional_call(classifier, params, (features.detach(),))
        loss = focal_loss_with_gamma_grad(logits, targets, gamma, reduction=reduction, ignore_index=ignore_index)
        grads = torch.autograd.grad(loss, tuple(params.values()), create_graph=True)
        step = lr * grad_scale
        updated = {name: p - step * g for (name, p), g in zip(params.items(), grads)}
        meta_logits = functional_call(classifier, updated, (meta_features.detach(),))
        return self.calibration_error(meta_logits, meta_targets)

    def meta_features(self, meta_images: torch.Tensor) -> torch.Tensor:
        """Penultimate features of the meta batch in eval mode, without gradient (see the module docstring)."""
        was_training = self.network.training
        self.network.eval()
        try:
            with torch.no_grad():
                return self.network.features(meta_images)
        finally:
            self.network.train(was_training)

    # -- the training hook --------------------------------------------------------------------------------------

    def train_step(self, images, targets, meta_images, meta_targets, optimizer, loss_kwargs=None) -> dict:
        """One step of Algorithm 1: θ update with the γ-weighted focal loss, then the φ update from SECE/DECE.

        ``loss_kwargs`` may hold ``reduction`` (default ``"mean"``; the paper recipes use ``"sum"``),
        ``ignore_index``, ``backend`` (of the fused op, default ``"auto"``) and ``max_grad_norm`` (gradient-norm
        clipping of the θ step; aliases ``clip_grad_norm``, ``grad_clip``, ``clip``). The focal hyper-parameters
        (``gamma`` …) are ignored: γ comes from the γ-Net. Other keys raise ``ValueError``.

        the training loop's extra keys: ``loss_scale`` (multiplies the loss before backward; DDP sum reduction),
        ``amp_dtype`` (autocast dtype of the model forward, or None) and ``scaler`` (a ``torch.amp.GradScaler``).

        Returns floats: ``loss`` (the θ-step loss), ``meta_loss`` (the look-ahead SECE/DECE before the φ step),
        ``gamma_mean``, ``gamma_std``, ``gamma_min``, ``gamma_max``, ``correct`` (training-batch hits) and ``count``;
        plus ``logits`` (the detached training-batch logits, for running accuracy).
        """
        options = self._step_options(loss_kwargs)
        classifier = self.network.classifier
        self.model.train()
        self.gamma_net.train()

        # Forward through the (possibly DDP-wrapped) model so DDP synchronises the θ gradients; the penultimate
        # features are the classifier's input, captured by a hook.
        self._captured.clear()
        self._capturing = True
        try:
            with torch.autocast(images.device.type, dtype=options["amp_dtype"],
                                enabled=options["amp_dtype"] is not None):
                logits = self.model(images)
        finally:
            self._capturing = False
        captured = list(self._captured)
        self._captured.clear()
        if len(captured) != 1:
            raise RuntimeError(f"model.classifier ran {len(captured)} times in one forward; meta-regularisation needs "
                               "forward(x) == classifier(features(x))")
        features = captured[0].detach().to(classifier.weight.dtype)
        gamma = self.gamma_net(features)  # keeps its graph to φ for the meta step

        # θ step (whole network) with γ as a constant: the fused kernel when one is available.
        classifier_before = {name: p.detach().clone() for name, p in classifier.named_parameters()}
        lr = self._classifier_lr(optimizer) if self.lookahead_lr is None else float(self.lookahead_lr)
        loss = ck.uncertainty_weighted_ce(logits, targets, uncertainty="focal", mode="loss", gamma=gamma.detach(),
                                          reduction=options["reduction"], ignore_index=options["ignore_index"],
                                          backend=options["backend"])
        optimizer.zero_grad(set_to_none=True)
        scaler = options["scaler"]
        scaled = loss * options["loss_scale"] if options["loss_scale"] != 1.0 else loss
        (scaler.scale(scaled) if scaler is not None else scaled).backward()
        # The look-ahead mirrors the real step: the same loss scale (DDP sum reduction) and clipping factor.
        grad_scale = float(options["loss_scale"])
        if options["max_grad_norm"] is not None:
            if scaler is not None:
                scaler.unscale_(optimizer)
            total_norm = float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), options["max_grad_norm"]))
            # clip_grad_norm_ scales by max_norm / (norm + 1e-6) when the norm exceeds max_norm
            if math.isfinite(total_norm) and total_norm > options["max_grad_norm"]:
                grad_scale *= options["max_grad_norm"] / (total_norm + 1e-6)
        if scaler is not None:
            scaler.step(optimizer)
            scaler.update()
        else:
            optimizer.step()

        # φ step: SECE/DECE of the looked-ahead classifier on the (updated) backbone's meta features.
        meta_features = self.meta_features(meta_images).to(classifier.weight.dtype)
        meta_loss = self.lookahead_objective(
            features, targets, gamma, meta_features, meta_targets, lr=lr,
            classifier_params=classifier_before, reduction=options["reduction"],
            ignore_index=options["ignore_index"], grad_scale=grad_scale,
        )
        self.meta_optimizer.zero_grad(set_to_none=True)
        phi_grads = torch.autograd.grad(meta_loss, tuple(self.gamma_net.parameters()), allow_unused=True)
        for parameter, grad in zip(self.gamma_net.parameters(), phi_grads):
            parameter.grad = torch.zeros_like(parameter) if grad is None else grad
        _average_gradients_across_ranks(self.gamma_net)
        self.meta_optimizer.step()

        gamma = gamma.detach()
        valid = targets != options["ignore_index"]
        self._epoch_gammas.append(gamma[valid].float().cpu())
        with torch.no_grad():
            correct = int(((logits.argmax(dim=-1) == targets) & valid).sum())
        return {
            "loss": float(loss.detach()),
            "meta_loss": float(meta_loss.detach()),
            "gamma_mean": float(gamma.mean()),
            "gamma_std": float(gamma.std()) if gamma.numel() > 1 else 0.0,
            "gamma_min": float(gamma.min()),
            "gamma_max": float(gamma.max()),
            "correct": correct,
            "count": int(valid.sum()),
            "logits": logits.detach(),
        }

    def _step_options(self, loss_kwargs):
        options = {"reduction": "mean", "ignore_index": -100, "backend": "auto", "max_grad_norm": None,
                   "loss_scale": 1.0, "amp_dtype": None, "scaler": None}
        for key, value in (loss_kwargs or {}).items():
            if key in _CLIP_ALIASES:
                key = "max_grad_norm"
            if key in _STEP_KEYS:
                options[key] = value
            elif key not in _IGNORED_LOSS_KEYS:
                raise ValueError(f"MetaRegularizer.train_step: unsupported loss_kwargs key {key!r} "
                                 f"(supported: {sorted(_STEP_KEYS | set(_CLIP_ALIASES))})")
        if options["max_grad_norm"] is not None:
            options["max_grad_norm"] = float(options["max_grad_norm"])
            if not options["max_grad_norm"] > 0:
                options["max_grad_norm"] = None  # 0 / negative means "no clipping", as in the recipes' CLI
        return options

    def _classifier_lr(self, optimizer) -> float:
        """The learning rate the optimizer applies to the classifier layer (its param group's ``lr``)."""
        weight = self.network.classifier.weight
        for group in optimizer.param_groups:
            if any(p is weight for p in group["params"]):
                return float(group["lr"])
        raise ValueError("the optimizer does not update model.classifier.weight; meta-regularisation needs it to")

    # -- logging and checkpointing ------------------------------------------------------------------------------

    def gamma_histogram(self, bins: int = 10, reset: bool = True) -> dict:
        """Distribution of the γs used since the last call (one epoch when called per epoch), as plain numbers.

        Returns ``{"count", "mean", "std", "min", "max", "quantiles": {"p05", "p25", "p50", "p75", "p95"},
        "bin_edges": [bins + 1 floats], "counts": [bins ints]}`` (equal-width bins over [min, max]);
        ``{"count": 0}`` when no step was taken. ``reset`` starts a new epoch.
        """
        if not self._epoch_gammas or sum(g.numel() for g in self._epoch_gammas) == 0:
            if reset:
                self._epoch_gammas = []
            return {"count": 0}
        values = torch.cat(self._epoch_gammas).double()
        if reset:
            self._epoch_gammas = []
        low, high = float(values.min()), float(values.max())
        counts, edges = torch.histogram(values, bins=bins, range=(low, high if high > low else low + 1e-12))
        levels = torch.tensor([0.05, 0.25, 0.5, 0.75, 0.95], dtype=values.dtype)
        quantiles = torch.quantile(values, levels).tolist()
        return {
            "count": int(values.numel()),
            "mean": float(values.mean()),
            "std": float(values.std()) if values.numel() > 1 else 0.0,
            "min": low,
            "max": high,
            "quantiles": dict(zip(("p05", "p25", "p50", "p75", "p95"), quantiles)),
            "bin_edges": edges.tolist(),
            "counts": [int(c) for c in counts.tolist()],
        }

    def state_dict(self) -> dict:
        """γ-Net and its Adam state (the checkpoint's ``"meta"`` entry)."""
        return {
            "objective": self.objective,
            "gamma_net": self.gamma_net.state_dict(),
            "meta_optimizer": self.meta_optimizer.state_dict(),
            "gamma_net_config": {"in_features": self.gamma_net.in_features,
                                 "num_prototypes": self.gamma_net.num_prototypes, "tau": self.gamma_net.tau},
        }

    def load_state_dict(self, state: dict) -> None:
        config = state.get("gamma_net_config", {})
        mine = {"in_features": self.gamma_net.in_features, "num_prototypes": self.gamma_net.num_prototypes,
                "tau": self.gamma_net.tau}
        mismatched = {k: (v, mine[k]) for k, v in config.items() if k in mine and v != mine[k]}
        if mismatched:
            raise ValueError(f"checkpoint γ-Net configuration differs from this run's (saved, current): {mismatched}")
        if state.get("objective", self.objective) != self.objective:
            raise ValueError(f"checkpoint was trained with meta objective {state['objective']!r}, "
                             f"this run uses {self.objective!r}")
        self.gamma_net.load_state_dict(state["gamma_net"])
        self.meta_optimizer.load_state_dict(state["meta_optimizer"])
