"""Named training recipes (``python -m training.train --list-recipes``).

The CIFAR and Tiny-ImageNet recipes are the calibration papers' (Mukhoti et al. 2020; the BSCE-GRA paper;
docs/papers.md): SGD momentum 0.9, weight decay 5e-4, **sum** reduction over the batch, gradient-norm clipping at 2,
lr 0.1 → 0.01 → 0.001 at epochs 150/250 of 350 (CIFAR, batch 128, 45k/5k train/validation split) or 40/60 of 100
(Tiny-ImageNet, batch 64, 50 train images per class held out as validation, the official val set as test).

Loss options every recipe carries (training/loss_schedules.py): ``gamma_schedule`` (FLSc-531 and the like; off by
default) with the switch epochs the papers' scripts used for this recipe (CIFAR 100/250 of 350, Tiny-ImageNet 30/70 of
100; scaled from CIFAR's otherwise), ``ce_warmup_epochs`` (0), and ``mmce_form="papers_code"``: ``--loss mmce`` and
``--loss mmce_weighted`` use the form of the focal-loss / BSCE-GRA code, on which λ = 2 was tuned and from which the
published MMCE numbers come, unless the spec names ``form=``. With the recipes' sum reduction the MMCE loss is
``Σ CE + λ·m·MMCE``, exactly the papers' ``len(data) · (mean CE + λ·MMCE)``.

The fine-tuning recipes' optimiser settings beyond "Adam, cosine, 90 epochs" (ImageNet) and "50 epochs" (ViT) are not
published; the values below are this project's choice and are marked as such.

``digits`` is the embedded CPU demo (docs/papers.md, "regime matters"): 200 training images of scikit-learn's 8×8
digits, a small CNN without batch norm, 300 epochs with the papers' optimiser settings (SGD momentum 0.9, weight decay
5e-4, sum reduction, clip 2) and schedule shape (lr 0.05, ×0.1 at epochs 129 and 214: CIFAR's 150 and 250 of 350
scaled to 300) — an over-fitting regime in which plain cross-entropy becomes over-confident, its fitted T > 1 (on easy
data with batch norm it is not, and the calibration losses then make the model under-confident; docs/papers.md).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Recipe:
    """Everything a run needs besides the loss: data, model, optimiser, schedule."""

    name: str
    dataset: str                       # "digits" | "cifar10" | "cifar100" | "tinyimagenet" | "imagenet"
    arch: str                          # a training.models.build_model name
    num_classes: int
    epochs: int
    batch_size: int
    lr: float
    optimizer: str = "sgd"             # "sgd" | "adam"
    momentum: float = 0.9
    weight_decay: float = 5e-4
    scheduler: str = "multistep"       # "multistep" (×0.1 at each milestone) | "cosine" (per epoch, to 0)
    milestones: tuple[int, ...] = ()
    reduction: str = "sum"             # the loss's batch reduction (the papers sum over the batch)
    clip_grad_norm: float | None = 2.0
    image_size: int = 32
    in_channels: int = 3
    pretrained_required: bool = False  # fine-tunes need --pretrained PATH (a local torchvision checkpoint)
    train_subset: int | None = None    # digits: how many training images to keep (the over-fitting regime)
    eval_every: int = 1                # validation metrics every this many epochs (and after the last)
    num_threads: int | None = None     # intra-op CPU threads (None: torch's default)
    label_smoothing: float = 0.0       # α of the loss's smoothed targets (needs a loss of the weighted-CE family)
    mixup_alpha: float = 0.0           # Beta(α, α) of mixup; 0 = off
    cutmix_alpha: float = 0.0          # Beta(α, α) of cutmix; 0 = off (both on: one per batch, p = 1/2)
    model_ema: bool = False            # keep and evaluate an exponential moving average of the weights
    model_ema_decay: float = 0.99998   # torchvision's per-image decay, rescaled per update (training/soft_targets.py)
    model_ema_steps: int = 32          # optimiser steps between EMA updates
    warmup_epochs: int = 0             # linear LR warm-up epochs (from warmup_decay · lr), then the main schedule
    warmup_decay: float = 0.01
    # loss options (training/loss_schedules.py)
    gamma_schedule: str = "none"       # "none" | "flsc-531" | "flsc-532": the focal exponent by epoch (Mukhoti et al.)
    gamma_schedule_epochs: tuple[int, ...] = ()  # the published switch epochs of FLSc at `epochs` (else scaled)
    ce_warmup_epochs: int = 0          # cross-entropy for these first epochs, then the chosen loss
    mmce_form: str = "papers_code"     # MMCE's form when --loss mmce* does not say (λ = 2 was tuned on this one)
    notes: str = ""
    model_kwargs: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def _cifar(dataset: str, arch_name: str, arch: str, num_classes: int) -> Recipe:
    return Recipe(name=f"{dataset}-{arch_name}", dataset=dataset, arch=arch, num_classes=num_classes, epochs=350,
                  batch_size=128, lr=0.1, milestones=(150, 250), gamma_schedule_epochs=(100, 250),
                  notes="Mukhoti et al. 2020 / BSCE-GRA paper recipe; 45k/5k seeded train/validation split")


# The papers' CIFAR schedule decays the lr x0.1 at epochs 150 and 250 of 350 (3/7 and 5/7 of the run); `digits`
# keeps that shape over its 300 epochs, each milestone rounded to the nearest epoch as the FLSc switch epochs are
# (training/loss_schedules.py).
DIGITS_EPOCHS = 300
DIGITS_MILESTONES = tuple(int(DIGITS_EPOCHS * m / 350 + 0.5) for m in (150, 250))  # (129, 214)

RECIPES: dict[str, Recipe] = {}
for _dataset, _classes in (("cifar10", 10), ("cifar100", 100)):
    for _arch_name, _arch in (("resnet50", "resnet50"), ("resnet110", "resnet110"), ("wrn26-10", "wide_resnet26_10"),
                              ("densenet121", "densenet121")):
        _recipe = _cifar(_dataset, _arch_name, _arch, _classes)
        RECIPES[_recipe.name] = _recipe

RECIPES["tinyimagenet-resnet50"] = Recipe(
    name="tinyimagenet-resnet50", dataset="tinyimagenet", arch="tv_resnet50", num_classes=200, epochs=100,
    batch_size=64, lr=0.1, milestones=(40, 60), image_size=64, gamma_schedule_epochs=(30, 70),
    notes="torchvision ResNet-50 from scratch on 64 px; 50 train images/class held out as validation, official val "
          "as test")
RECIPES["imagenet-resnet50-finetune"] = Recipe(
    name="imagenet-resnet50-finetune", dataset="imagenet", arch="tv_resnet50", num_classes=1000, epochs=90,
    batch_size=256, lr=1e-4, optimizer="adam", weight_decay=0.0, scheduler="cosine", reduction="mean",
    image_size=224, pretrained_required=True,
    notes="torchvision ResNet-50 from a local pretrained checkpoint (--pretrained), Adam + cosine, 90 epochs "
          "(published); lr 1e-4, mean reduction, batch 256 and 10 train images/class as validation are this "
          "project's choice")
RECIPES["imagenet-resnet50-finetune-tvnew"] = Recipe(
    name="imagenet-resnet50-finetune-tvnew", dataset="imagenet", arch="tv_resnet50", num_classes=1000, epochs=90,
    batch_size=1024, lr=0.5, optimizer="sgd", momentum=0.9, weight_decay=2e-5, scheduler="cosine", reduction="mean",
    clip_grad_norm=None, image_size=224, pretrained_required=True, label_smoothing=0.1, mixup_alpha=0.2,
    cutmix_alpha=1.0, model_ema=True, model_ema_decay=0.99998, model_ema_steps=32, warmup_epochs=5,
    warmup_decay=0.01,
    notes="torchvision's ResNet-50 'new recipe' (references/classification README): SGD momentum 0.9, lr 0.5 for a "
          "global batch 1024 (8 x 128), cosine after 5 linear warm-up epochs from 0.01 lr, weight decay 2e-5, label "
          "smoothing 0.1, mixup 0.2, cutmix 1.0, EMA (decay 0.99998, every 32 steps), no clipping; here from a local "
          "pretrained checkpoint (--pretrained) for 90 epochs (this project's choice; torchvision trains 600 from "
          "scratch). Not reproduced: TrivialAugmentWide, random erasing 0.1, no weight decay on norm layers, "
          "repeated-augment sampler, 176 px train / 232-224 px eval crops")
RECIPES["cifar10-vit-b16-finetune"] = Recipe(
    name="cifar10-vit-b16-finetune", dataset="cifar10", arch="tv_vit_b_16", num_classes=10, epochs=50,
    batch_size=128, lr=0.01, weight_decay=0.0, scheduler="cosine", reduction="mean", clip_grad_norm=1.0,
    image_size=224, pretrained_required=True,
    notes="torchvision ViT-B/16 from a local checkpoint (--pretrained), CIFAR-10 resized to 224 px, 50 epochs "
          "(published); SGD lr 0.01 cosine, mean reduction, clip 1 are this project's choice")
RECIPES["digits"] = Recipe(
    name="digits", dataset="digits", arch="small_cnn", num_classes=10, epochs=DIGITS_EPOCHS, batch_size=50, lr=0.05,
    weight_decay=5e-4, milestones=DIGITS_MILESTONES, reduction="sum", clip_grad_norm=2.0, image_size=8,
    in_channels=1, train_subset=200, eval_every=10, num_threads=1, model_kwargs={"width": 16, "batch_norm": False},
    notes="embedded CPU demo: scikit-learn's 8x8 digits, 200 training images, 500 validation, 1097 test (a seeded "
          "split per --seed); a small CNN without batch norm (width 16), 300 epochs at lr 0.05 decayed x0.1 at "
          "epochs 129 and 214 (the CIFAR recipes' 150 and 250 of 350, scaled to 300) with the papers' optimiser "
          "settings (SGD momentum 0.9, weight decay 5e-4, sum reduction, clip 2): an over-fitting regime; one CPU "
          "thread (a model this small only loses from intra-op threading), validation metrics every 10 epochs")


def get_recipe(name: str) -> Recipe:
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; expected one of {', '.join(RECIPES)}")
    return RECIPES[name]


def describe_recipes() -> str:
    """A table of every recipe for ``--list-recipes``."""
    header = (f"{'recipe':28s} {'data':12s} {'arch':17s} {'ep':>4s} {'bs':>4s} {'opt':4s} {'lr':>7s} {'sched':10s} "
              "red  clip")
    lines = [header, "-" * len(header)]
    for r in RECIPES.values():
        sched = r.scheduler + ("@" + "/".join(map(str, r.milestones)) if r.milestones else "")
        if r.scheduler == "multistep" and not r.milestones:
            sched = "constant"
        lines.append(f"{r.name:28s} {r.dataset:12s} {r.arch:17s} {r.epochs:4d} {r.batch_size:4d} {r.optimizer:4s} "
                     f"{r.lr:7g} {sched:10s} {r.reduction:4s} {r.clip_grad_norm}")
    return "\n".join(lines)
