"""Train a classifier with a calibration loss, then report its calibration before and after temperature scaling.

    python -m training.train                         # the embedded `digits` demo with BSCE-GRA, CPU, one seed
    python -m training.train --compare cross_entropy,bsce_gra,flsd   # 3 seeds each: mean ± std
    python -m training.train --seeds 3               # one loss, 3 seeds: mean ± std
    python -m training.train --recipe cifar10-resnet50 --loss bsce_gra --data-root ~/data --output-dir runs/c10
    torchrun --nproc_per_node=4 -m training.train --recipe cifar100-wrn26-10 --loss flsd --data-root ~/data
    python -m training.train --list-recipes
    python -m training.train --recipe cifar10-resnet110 --synthetic   # random CIFAR-shaped images, no data set

Flat torchvision-references style: :func:`get_args_parser`, :func:`train_one_epoch`, :func:`evaluate`, :func:`main`,
:func:`cli`. Per epoch it writes ``log.csv`` / ``log.jsonl`` and an atomic ``checkpoint.pt`` (model, optimizer,
scheduler, GradScaler, epoch, RNG states); ``--resume`` continues bit-for-bit (same seed, ``--workers 0``) with the
checkpoint's settings, except the flags given again on its command line; SIGTERM/SIGINT saves a mid-epoch checkpoint
and exits with code 128 + the signal number (143 for SIGTERM). After the last epoch the temperature is fitted on the
validation split and the pre-T / post-T table of the test split is printed and saved (``report.json``,
``reliability_pre_T.png``, ``reliability_post_T.png``).

Batch size and loss reduction follow the recipe (docs/papers.md: the papers *sum* the loss over a batch of 128,
lr 0.1, clip 2). ``--batch-size`` is the global batch: under DDP each of K ranks takes batch/K and, for the sum
reduction, the loss is multiplied by K so that DDP's gradient averaging yields exactly the gradient of the global batch
sum.
"""

from __future__ import annotations

import argparse
import ast
import copy
import csv
import dataclasses
import importlib.util
import json
import math
import os
import signal
import sys
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import calibkernels as ck

from . import distributed as dist_utils
from . import soft_targets
from .loss_schedules import GAMMA_SCHEDULES, LossSchedule, parse_epochs, switch_epochs
from .checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .data import DataError, build_datasets
from .models import ARCHITECTURES, PRETRAINED_ARCHITECTURES, build_model
from .recipes import RECIPES, describe_recipes, get_recipe
from .report import (aggregate_reports, calibration_report, collect_logits, format_aggregate, format_report,
                     save_comparison, save_report)

METHODS = ("standard", "meta-sece", "meta-dece")

# The import names of the `train` extra (pyproject.toml) and their pip names; checked before anything runs.
TRAIN_EXTRA = {"tqdm": "tqdm", "torchvision": "torchvision", "matplotlib": "matplotlib", "sklearn": "scikit-learn"}

# Settings of an invocation, not of the run: --resume never takes them from the checkpoint.
_PER_INVOCATION = {"list_recipes", "compare", "seeds", "resume", "output_dir", "download", "pretrained", "device", "compile",
                   "channels_last", "workers", "stop_after", "threads", "log_every", "tensorboard", "no_progress"}
# Values derived from the others (resolve_run_config, run_training), and the record of which flags were given.
_DERIVED = {"num_classes", "model_kwargs", "reduction", "clip_grad_norm", "explicit", "mmce_form"}
# They fix the model or the data splits, so a resumed run cannot change them.
_FIXED_BY_CHECKPOINT = ("recipe", "arch", "loss", "method", "seed", "image_size", "meta_fraction", "synthetic",
                        "synthetic_size")
# Training images of a --synthetic epoch when --synthetic-size is not given: this many full batches.
SYNTHETIC_BATCHES = 100


# ------------------------------------------------------------------------------------------------------ arguments
class _ArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error: …`` line with exit code 2, like every other error of the CLI."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = _ArgumentParser(
        description="Train a calibrated classifier (calibkernels training recipes); with no arguments, trains the "
                    "embedded `digits` demo with BSCE-GRA on the CPU and prints its pre-T / post-T calibration.",
        add_help=add_help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--recipe", default="digits", choices=list(RECIPES), metavar="NAME",
                        help="training recipe (see --list-recipes)")
    parser.add_argument("--list-recipes", action="store_true", help="print the recipes and exit")
    parser.add_argument("--loss", default="bsce_gra",
                        help="loss registry name with optional hyperparameters, NAME[:KEY=VALUE[:KEY=VALUE…]], e.g. "
                             f"focal_loss:gamma=2 or bsce_gra:gamma=4:norm=2; names: {', '.join(ck.losses.names())}")
    parser.add_argument("--compare", default=None, metavar="LOSS1,LOSS2,…",
                        help="train each loss (same syntax as --loss) with the same seed; write a side-by-side table "
                             "and one figure overlaying their reliability diagrams")
    parser.add_argument("--method", default="standard", choices=METHODS,
                        help="standard training, or meta-regularisation (γ-Net) with a SECE / DECE meta objective")
    parser.add_argument("--backend", default="auto", choices=["auto", "reference", "cpu", "triton", "cuda"],
                        help="calibkernels loss backend (losses without a fused kernel ignore it)")
    parser.add_argument("--data-root", default=os.environ.get("CALIBKERNELS_DATA"),
                        help="dataset folder (not needed for digits); default $CALIBKERNELS_DATA")
    parser.add_argument("--download", action="store_true", help="let torchvision download CIFAR-10/100 if missing")
    parser.add_argument("--synthetic", action="store_true",
                        help="train on seeded random images of the recipe's shape (channels, --image-size) and "
                             "classes instead of its data set (nothing is read; --data-root is ignored): pipeline "
                             "tests and throughput measurements. With --workers 0 (its default) the images are kept "
                             "on --device")
    parser.add_argument("--synthetic-size", type=int, default=None, metavar="N",
                        help=f"training images of --synthetic (validation and test get N // 10 each; default "
                             f"{SYNTHETIC_BATCHES} x --batch-size, so an epoch is {SYNTHETIC_BATCHES} full batches)")
    parser.add_argument("--output-dir", default=None,
                        help="default runs/<recipe>-<loss> (runs/<recipe>-synthetic-<loss> with --synthetic)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the data split, initialisation and shuffling")
    parser.add_argument("--seeds", type=int, default=None, metavar="N",
                        help="train each loss N times, with seeds --seed … --seed+N-1 (each its own seeded split and "
                             "initialisation), and report mean ± sample std of T and of every metric pre-T and post-T "
                             "(default: 3 with --compare, else 1)")
    parser.add_argument("--epochs", type=int, default=None, help="override the recipe's epochs")
    parser.add_argument("--batch-size", type=int, default=None,
                        help="override the recipe's global batch size (split across DDP ranks)")
    parser.add_argument("--lr", type=float, default=None, help="override the recipe's learning rate")
    parser.add_argument("--arch", default=None, choices=list(ARCHITECTURES), help="override the recipe's model")
    parser.add_argument("--image-size", type=int, default=None,
                        help="override the recipe's input resolution (CIFAR/Tiny-ImageNet/ImageNet transforms)")
    parser.add_argument("--pretrained", default=None,
                        help="local torchvision checkpoint for the fine-tuning recipes (never downloaded)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile the training step's model and loss as one graph (fullgraph in a single "
                             "process; with --method meta-*, the model the meta step's forward runs through), and the "
                             "evaluation model")
    parser.add_argument("--amp", default=None, choices=["bf16", "fp16"],
                        help="autocast dtype (fp16 uses a GradScaler)")
    parser.add_argument("--channels-last", action="store_true", help="channels-last memory format")
    parser.add_argument("--resume", default=None, metavar="CHECKPOINT",
                        help="continue from this checkpoint with its settings; flags given again override them "
                             "(--lr, --epochs, …; not those that fix the model or the data splits)")
    parser.add_argument("--workers", type=int, default=None,
                        help="data-loading workers per process (default 0 for digits, else 4)")
    parser.add_argument("--max-steps-per-epoch", type=int, default=None,
                        help="cap the optimiser steps per epoch (smoke tests)")
    parser.add_argument("--stop-after", type=int, default=None, metavar="EPOCHS",
                        help="checkpoint and exit after this many epochs of this invocation (scheduled preemption; "
                             "continue with --resume)")
    parser.add_argument("--eval-every", type=int, default=None,
                        help="validation metrics every this many epochs and after the last (default: the recipe's)")
    parser.add_argument("--threads", type=int, default=None,
                        help="intra-op CPU threads (default: the recipe's, else torch's)")
    parser.add_argument("--n-bins", type=int, default=15, help="bins of the ECE-type metrics")
    soft = parser.add_argument_group("soft targets, EMA and warm-up (default: the recipe's; training/README.md)")
    soft.add_argument("--label-smoothing", type=float, default=None, metavar="A",
                      help="label smoothing α of the loss, t <- (1 - α) t + α / C (losses of the weighted-CE family)")
    soft.add_argument("--mixup-alpha", type=float, default=None, metavar="A", help="mixup Beta(α, α); 0 = off")
    soft.add_argument("--cutmix-alpha", type=float, default=None, metavar="A", help="cutmix Beta(α, α); 0 = off")
    soft.add_argument("--mix-dense", action="store_true",
                      help="mix with torchvision.transforms.v2.MixUp/CutMix and dense (N, C) targets instead of the "
                           "compact form (target, target.flip(0), λ)")
    soft.add_argument("--model-ema", action=argparse.BooleanOptionalAction, default=None,
                      help="keep an exponential moving average of the weights; it is evaluated and reported too")
    soft.add_argument("--model-ema-decay", type=float, default=None, help="EMA decay per image (torchvision's)")
    soft.add_argument("--model-ema-steps", type=int, default=None, help="optimiser steps between EMA updates")
    soft.add_argument("--warmup-epochs", type=int, default=None, help="linear LR warm-up epochs")
    soft.add_argument("--warmup-decay", type=float, default=None,
                      help="the warm-up's first-epoch lr factor (it rises linearly to 1)")
    schedule = parser.add_argument_group("loss schedule (default: the recipe's; training/README.md, 'Loss schedules')")
    schedule.add_argument("--gamma-schedule", default=None, choices=list(GAMMA_SCHEDULES),
                          help="the loss's exponent γ by epoch: flsc-531 is 5, then 3, then 1 (Mukhoti et al.'s "
                               "FLSc-531), switching at the recipe's epochs scaled to --epochs")
    schedule.add_argument("--gamma-schedule-epochs", default=None, metavar="A,B",
                          help="the two epochs at which the γ schedule switches; none given: the recipe's, scaled "
                               "to --epochs")
    schedule.add_argument("--ce-warmup-epochs", type=int, default=None, metavar="K",
                          help="train with cross-entropy for the first K epochs, then with --loss")
    parser.add_argument("--log-every", type=int, default=None,
                        help="print an epoch summary line every this many epochs (default: about 15 lines per run)")
    parser.add_argument("--tensorboard", action="store_true",
                        help="also log to TensorBoard (<output-dir>/tb; needs the tensorboard package)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress output (a bar on a terminal, else one stderr line per epoch)")
    return parser


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
                    mmce_form: str | None = None) -> nn.Module:
    """The loss module of ``spec`` with the recipe's reduction; ``backend`` goes to losses that have fused kernels;
    ``label_smoothing`` (> 0) needs a loss of the uncertainty-weighted CE family; ``mmce_form`` (the recipe's) is the
    MMCE form of ``mmce`` / ``mmce_weighted`` unless ``spec`` gives ``form=``."""
    name, hyperparameters = parse_loss_spec(spec)
    # The run decides these two: the recipe the reduction (the training loop scales the loss for it) and --backend the
    # kernel; a value in the spec would clash with or silently lose to them.
    if "reduction" in hyperparameters:
        raise ValueError("reduction= cannot be set in a loss spec: the recipe sets the reduction (--list-recipes)")
    if "backend" in hyperparameters:
        raise ValueError(f"backend= cannot be set in a loss spec: pass --backend {hyperparameters['backend']}")
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


def loss_tag(spec: str) -> str:
    """A file-system friendly name of a loss spec (``focal_loss:gamma=2`` → ``focal_loss-gamma=2``)."""
    return spec.strip().replace(":", "-").replace("/", "_")


def default_output_dir(args, tail: str) -> Path:
    """``runs/<recipe>-<tail>``, or ``runs/<recipe>-synthetic-<tail>`` for ``--synthetic``, so that a run on
    synthetic images never writes into (or appends to the log of) a run on the recipe's data set."""
    return Path("runs") / f"{args.recipe}{'-synthetic' if getattr(args, 'synthetic', False) else ''}-{tail}"


def resolve_run_config(args) -> argparse.Namespace:
    """Fill the recipe's values into ``args`` (epochs, batch size, lr, arch, …) and check they make sense."""
    recipe = get_recipe(args.recipe)
    args = copy.copy(args)
    args.epochs = recipe.epochs if args.epochs is None else args.epochs
    args.batch_size = recipe.batch_size if args.batch_size is None else args.batch_size
    args.lr = recipe.lr if args.lr is None else args.lr
    args.arch = recipe.arch if args.arch is None else args.arch
    if args.image_size is not None and args.image_size < 1:
        raise ValueError(f"--image-size must be >= 1, got {args.image_size}")
    synthetic = bool(getattr(args, "synthetic", False))
    args.synthetic = synthetic
    if args.image_size is not None and recipe.dataset == "digits" and not synthetic:
        raise ValueError(f"--image-size applies to the CIFAR, Tiny-ImageNet and ImageNet transforms; recipe "
                         f"{recipe.name!r} trains on 8x8 digits as they are")
    if args.arch == "tv_vit_b_16" and (args.image_size or recipe.image_size) % 16:
        raise ValueError(f"--image-size {args.image_size or recipe.image_size}: tv_vit_b_16 cuts images into 16x16 "
                         "patches, so the size must be a multiple of 16")
    if args.pretrained is not None and args.arch not in PRETRAINED_ARCHITECTURES:
        raise ValueError(f"--pretrained: architecture {args.arch!r} takes no pretrained weights (only "
                         f"{', '.join(PRETRAINED_ARCHITECTURES)} do)")
    if args.backend != "auto":
        reason = ck._backends.unavailable_reason(args.backend, torch.device(args.device))
        if reason is not None:
            raise ValueError(f"--backend {args.backend} cannot run on --device {args.device}: {reason}")
    if getattr(args, "synthetic_size", None) is not None and not synthetic:
        raise ValueError("--synthetic-size needs --synthetic")
    if synthetic and args.download:
        raise ValueError("--download fetches a data set and --synthetic reads none: pass one of them")
    if synthetic and getattr(args, "synthetic_size", None) is None:
        args.synthetic_size = SYNTHETIC_BATCHES * args.batch_size
    args.workers = (0 if recipe.dataset == "digits" or synthetic else 4) if args.workers is None else args.workers
    args.eval_every = recipe.eval_every if args.eval_every is None else args.eval_every
    args.threads = recipe.num_threads if args.threads is None else args.threads
    args.reduction = recipe.reduction
    args.clip_grad_norm = recipe.clip_grad_norm
    for name in ("label_smoothing", "mixup_alpha", "cutmix_alpha", "model_ema", "model_ema_decay", "model_ema_steps",
                 "warmup_epochs", "warmup_decay", "gamma_schedule", "ce_warmup_epochs"):
        if getattr(args, name, None) is None:
            setattr(args, name, getattr(recipe, name))
    args.mmce_form = recipe.mmce_form
    args.mix_dense = bool(getattr(args, "mix_dense", False))
    for name in ("label_smoothing", "mixup_alpha", "cutmix_alpha"):
        value = getattr(args, name)
        if not (value >= 0 and math.isfinite(value)) or (name == "label_smoothing" and value > 1):
            raise ValueError(f"--{name.replace('_', '-')} must be {'in [0, 1]' if name == 'label_smoothing' else '>= 0'}"
                             f", got {value}")
    if not 0 <= args.model_ema_decay < 1 or args.model_ema_steps < 1:
        raise ValueError(f"--model-ema-decay must be in [0, 1) and --model-ema-steps >= 1, got {args.model_ema_decay} "
                         f"and {args.model_ema_steps}")
    if args.warmup_epochs < 0 or (args.warmup_epochs and args.warmup_epochs >= args.epochs):
        raise ValueError(f"--warmup-epochs must be >= 0 and < --epochs ({args.epochs}), got {args.warmup_epochs}")
    if not 0 < args.warmup_decay <= 1:
        raise ValueError(f"--warmup-decay must be in (0, 1], got {args.warmup_decay}")
    mixing = args.mixup_alpha > 0 or args.cutmix_alpha > 0
    if (mixing or args.label_smoothing) and args.method != "standard":
        raise ValueError("--label-smoothing, --mixup-alpha and --cutmix-alpha need --method standard")
    if args.method != "standard":
        from . import meta as meta_module

        meta_module.check_meta_args(args)
    for name in ("epochs", "batch_size", "eval_every", "n_bins", "threads", "log_every", "synthetic_size"):
        if getattr(args, name, None) is not None and getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.workers < 0:
        raise ValueError(f"--workers must be >= 0, got {args.workers}")
    if not (args.lr > 0 and math.isfinite(args.lr)):
        raise ValueError(f"--lr must be finite and > 0, got {args.lr}")
    if args.max_steps_per_epoch is not None and args.max_steps_per_epoch < 1:
        raise ValueError("--max-steps-per-epoch must be >= 1")
    if args.stop_after is not None and args.stop_after < 1:
        raise ValueError("--stop-after must be >= 1")
    if (recipe.pretrained_required and args.pretrained is None and args.arch == recipe.arch and args.resume is None
            and not synthetic):
        raise ValueError(f"recipe {recipe.name!r} fine-tunes a pretrained model: pass --pretrained PATH "
                         "(a local torchvision checkpoint)")
    if args.output_dir is None:
        args.output_dir = str(default_output_dir(args, loss_tag(args.loss)))
    _check_output_dir(Path(args.output_dir))
    if args.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ValueError("--tensorboard needs the tensorboard package (pip install tensorboard)")
    check_loss_spec(args.loss, args.label_smoothing, mixing, getattr(args, "mix_dense", False))
    schedule = loss_schedule(args, build_criterion(args.loss, "mean", "auto", args.label_smoothing), recipe)
    if schedule.switch is not None:
        # Recorded with the run's settings: a resumed run with more --epochs keeps the switch epochs it started
        # with instead of scaling them to the new length (which would move γ back up in the middle of the run).
        args.gamma_schedule_epochs = ",".join(str(epoch) for epoch in schedule.switch)
    return args


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
                                           getattr(args, "label_smoothing", 0.0))
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
                         "--cutmix-alpha need a loss of the uncertainty-weighted CE family (cross_entropy, focal_loss*, "
                         "flsd*, bsce*)")
    if mixing and criterion.weight == "dual_focal":
        raise ValueError(f"loss {spec!r}: dual focal has no soft-target form, so it cannot train on mixed batches")
    if mixing and not mix_dense and isinstance(criterion, ck.losses.SoftTargetUncertaintyWeightedCE):
        raise ValueError(f"loss {spec!r} has timm's SoftTargetCrossEntropy signature, forward(x, target), and takes a "
                         "mixed batch as dense targets: add --mix-dense, or use its compact-form loss (e.g. bsce_gra)")


def _check_output_dir(path: Path) -> None:
    """An output folder must be a folder, or creatable: its nearest existing ancestor must be a folder."""
    for candidate in (path, *path.parents):
        if candidate.exists():
            if not candidate.is_dir():
                raise ValueError(f"--output-dir {path}: {candidate} is a file, not a folder")
            return


def explicit_options(args) -> set[str]:
    """The options given on the command line (recorded by :func:`parse_args`; for a namespace built in code, those
    that differ from the parser's defaults)."""
    if getattr(args, "explicit", None) is not None:
        return set(args.explicit)
    defaults = vars(get_args_parser().parse_args([]))
    return {key for key, value in vars(args).items() if key in defaults and value != defaults[key]}


def args_from_checkpoint(args, checkpoint: dict) -> argparse.Namespace:
    """``args`` for continuing ``checkpoint``: the run's settings are the checkpoint's, except the flags given on the
    command line, which override them (``--lr``, ``--epochs``, ``--batch-size``, …); the output folder defaults to
    the checkpoint's. Raises ValueError for flags that contradict the checkpoint: those that fix the model or the data
    splits, fewer epochs than it has trained, or another batch size or process count in the middle of an epoch."""
    args = copy.copy(args)
    saved = checkpoint["args"]
    explicit = explicit_options(args)
    args.explicit = sorted(explicit)  # decided here, before the recipe's values fill in what was not given
    # a checkpoint written before --synthetic existed trained on the recipe's data
    saved = {"synthetic": False, "synthetic_size": None, **saved}
    for key in _FIXED_BY_CHECKPOINT:
        if key in explicit and key in saved and saved[key] != getattr(args, key):
            raise ValueError(f"--resume {args.resume}: checkpoint has {key}={saved[key]!r} but this run has "
                             f"{getattr(args, key)!r} (it fixes the model or the data splits)")
    if "warmup_epochs" in explicit and int(saved.get("warmup_epochs") or 0) != (args.warmup_epochs or 0):
        raise ValueError(f"--resume {args.resume}: the checkpoint's lr schedule has "
                         f"{int(saved.get('warmup_epochs') or 0)} warm-up epoch(s) and --warmup-epochs "
                         f"{args.warmup_epochs} would change it; a warm-up can be added, removed or changed only when "
                         "a run starts")
    for key, value in saved.items():
        if key not in explicit and key not in _PER_INVOCATION and key not in _DERIVED:
            setattr(args, key, value)
    if (saved.get("gamma_schedule") or "none") != "none" and not saved.get("gamma_schedule_epochs") \
            and "gamma_schedule_epochs" not in explicit and saved.get("epochs"):
        # a checkpoint that did not record its switch epochs: those its own length gave
        recipe = get_recipe(saved["recipe"])
        args.gamma_schedule_epochs = ",".join(str(epoch) for epoch in switch_epochs(
            int(saved["epochs"]), recipe.gamma_schedule_epochs, recipe.epochs))
    if "output_dir" not in explicit:
        args.output_dir = str(Path(args.resume).parent)
    done, batches_done = int(checkpoint["epoch"]), int(checkpoint.get("batches_done", 0))
    if args.epochs is not None and args.epochs < done + (1 if batches_done else 0):
        raise ValueError(f"--resume {args.resume}: --epochs {args.epochs} but the checkpoint has already trained "
                         f"{done} epoch(s)" + (f" and {batches_done} batch(es) of the next" if batches_done else ""))
    world, saved_world = dist_utils.world_size(), int(checkpoint.get("world_size", dist_utils.world_size()))
    if batches_done and (args.batch_size != saved.get("batch_size") or world != saved_world):
        raise ValueError(f"--resume {args.resume}: the checkpoint was saved mid-epoch (epoch {done + 1}, after batch "
                         f"{batches_done}) with --batch-size {saved.get('batch_size')} on {saved_world} process(es); "
                         f"resume it with that batch size and process count (change them at an epoch boundary, "
                         f"after a --stop-after 1 run)")
    return args


# --------------------------------------------------------------------------------------------------------- loops
class _StopRequest:
    """Set by SIGTERM / SIGINT; the training loop checks it after every step, saves and exits cleanly."""

    def __init__(self):
        self.signal_name = None
        self.signum = None
        self._previous = {}

    def __bool__(self):
        return self.signal_name is not None

    def requested(self) -> bool:
        """Whether any rank was signalled (all ranks must stop at the same step, or DDP would hang)."""
        if not dist_utils.is_distributed():
            return bool(self)
        flag = torch.tensor([1 if self else 0])
        torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX)
        if flag.item() and self.signal_name is None:
            self.signal_name, self.signum = "SIGTERM (on another rank)", int(signal.SIGTERM)
        return bool(flag.item())

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C aborts at once
        self.signal_name, self.signum = signal.Signals(signum).name, int(signum)

    def install(self):
        if threading_is_main():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class TrainingInterrupted(Exception):
    """Raised once a signalled run has saved its checkpoint; :func:`cli` exits with 128 + the signal number, so that a
    scheduler can tell a preempted run (143 for SIGTERM) from a finished one (0)."""

    def __init__(self, signal_name: str, signum: int):
        super().__init__(f"stopped by {signal_name}")
        self.signum = signum


def threading_is_main() -> bool:
    import threading

    return threading.current_thread() is threading.main_thread()


class ResumableDistributedSampler(DistributedSampler):
    """``DistributedSampler`` (seeded shuffle per epoch via ``set_epoch``) that can skip the first ``skip`` samples of
    its shard, so a run interrupted mid-epoch resumes with exactly the batches it had not trained on."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.skip = 0

    def __iter__(self):
        indices = list(super().__iter__())
        return iter(indices[self.skip:])

    def __len__(self):
        return self.num_samples - self.skip


def forward_and_loss(model, criterion, images, targets, mix_kwargs, amp_dtype):
    """A training step's forward: the logits under autocast, then the loss outside it (the fused kernels take
    bf16/fp16 logits and accumulate in fp32); ``(logits, loss)``. One function, so that ``--compile`` traces the model
    and the loss into one graph (:func:`compiled_forward_and_loss`)."""
    with torch.autocast(images.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        logits = model(images)
    return logits, criterion(logits, targets, **mix_kwargs)


def compiled_forward_and_loss(fullgraph: bool):
    """:func:`forward_and_loss` under ``torch.compile``: the model and the loss in one graph; ``fullgraph=True``
    makes a graph break an error instead of a silent split (single-process runs; under DDP, its optimiser splits the
    graph at the gradient buckets). A mix's λ reaches it as a 0-dim tensor, so a new λ per batch is not a new
    graph."""
    return torch.compile(forward_and_loss, fullgraph=fullgraph)


def train_one_epoch(model, criterion, optimizer, loader, device, epoch, args, scaler, stop: _StopRequest,
                    first_step: int = 0, meta=None, meta_iterator=None, ema=None,
                    step_forward=forward_and_loss, global_step: int = 0) -> dict:
    """One pass over ``loader`` (starting at batch ``first_step`` when resuming mid-epoch).

    With ``args.mixup_alpha`` / ``args.cutmix_alpha`` each batch is mixed with its reversal: compact form
    (``criterion(logits, target, mix_target=target.flip(0), mix_lambda=λ)``, :func:`training.soft_targets.mix_batch`)
    or, with ``args.mix_dense``, torchvision's ``MixUp``/``CutMix`` and dense targets. ``ema`` (an ``AveragedModel``)
    is updated after every ``args.model_ema_steps``-th optimiser step of the run, standard or meta step alike:
    ``global_step`` (the steps of the epochs before) keeps the count across epochs, so an epoch shorter than
    ``model_ema_steps`` still updates it and no epoch's last steps are skipped; during the warm-up epochs it keeps
    copying the weights (torchvision's reference does the same). ``step_forward``: the step's forward and loss
    (:func:`forward_and_loss`, or with ``--compile`` :func:`compiled_forward_and_loss`).

    Returns ``{"loss", "accuracy", "samples", "images_per_s", "steps_done", "interrupted", "lr", "global_step"}``
    where ``loss`` is the mean per-sample training loss, merged over DDP ranks, ``lr`` the learning rate this epoch
    trained at and ``global_step`` the run's optimiser steps so far."""
    model.train()
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]
    # Sum reduction under DDP: DDP averages gradients over ranks, so scale by K to get the global batch's sum.
    loss_scale = float(dist_utils.world_size()) if args.reduction == "sum" else 1.0
    total_steps = len(loader) + first_step
    if args.max_steps_per_epoch is not None:
        total_steps = min(total_steps, args.max_steps_per_epoch)
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    correct = torch.zeros((), dtype=torch.int64, device=device)
    samples = 0
    step = first_step
    lr = optimizer.param_groups[0]["lr"]
    start = time.perf_counter()
    progress = _EpochProgress(f"epoch {epoch + 1}/{args.epochs}", total_steps, first_step,
                              enabled=not args.no_progress and dist_utils.is_main_process())
    mixup_alpha, cutmix_alpha = getattr(args, "mixup_alpha", 0.0), getattr(args, "cutmix_alpha", 0.0)
    mixing = mixup_alpha > 0 or cutmix_alpha > 0
    dense_mixer = None
    if mixing and getattr(args, "mix_dense", False):
        dense_mixer = soft_targets.dense_mixer(args.num_classes, mixup_alpha, cutmix_alpha)
    for images, targets in loader:
        if step >= total_steps:
            break
        images = images.to(device, non_blocking=True)
        targets = targets.to(device, non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        if meta is not None:
            meta_images, meta_targets = next(meta_iterator)
            out = meta.train_step(images, targets, meta_images.to(device), meta_targets.to(device), optimizer,
                                  {"reduction": args.reduction, "backend": args.backend, "loss_scale": loss_scale,
                                   "clip_grad_norm": args.clip_grad_norm, "amp_dtype": amp_dtype, "scaler": scaler})
            batch_loss = torch.tensor(out["loss"], dtype=torch.float64, device=device)
            if args.reduction == "sum":
                batch_loss = batch_loss / images.shape[0]
            logits = out.get("logits")
        else:
            loss_targets, mix_kwargs = targets, {}
            if dense_mixer is not None:
                images, loss_targets = dense_mixer(images, targets)
            elif mixing:
                images, partner, lam = soft_targets.mix_batch(images, mixup_alpha, cutmix_alpha)
                # λ as a device tensor (a fill, no copy from the host): a compiled step takes it as an input
                mix_kwargs = {"mix_target": targets[partner],
                              "mix_lambda": torch.full((), lam, dtype=torch.float32, device=device)}
            logits, loss = step_forward(model, criterion, images, loss_targets, mix_kwargs, amp_dtype)
            optimizer.zero_grad(set_to_none=True)
            scaler.scale(loss * loss_scale).backward()
            if args.clip_grad_norm:
                scaler.unscale_(optimizer)
                nn.utils.clip_grad_norm_(model.parameters(), args.clip_grad_norm)
            scaler.step(optimizer)
            scaler.update()
            batch_loss = loss.detach().double() / (images.shape[0] if args.reduction == "sum" else 1)
        global_step += 1
        if ema is not None and global_step % args.model_ema_steps == 0:
            network = getattr(model, "_orig_mod", model)  # through torch.compile's and DDP's wrappers
            ema.update_parameters(network.module if isinstance(network, nn.parallel.DistributedDataParallel)
                                  else network)
            if epoch < args.warmup_epochs:
                ema.n_averaged.fill_(0)  # the next update copies the weights again
        loss_sum += batch_loss * images.shape[0]
        if logits is not None:
            correct += (logits.detach().argmax(dim=1) == targets).sum()
        samples += images.shape[0]
        step += 1
        if progress.bar is not None and (step % 10 == 0 or step == total_steps):
            elapsed = time.perf_counter() - start
            progress.bar.set_postfix(loss=f"{loss_sum.item() / samples:.4f}", lr=f"{lr:.3g}",
                                     img_s=f"{samples * dist_utils.world_size() / max(elapsed, 1e-9):.0f}")
        progress.update()
        if stop.requested():
            break
    if device.type == "cuda":
        torch.cuda.synchronize(device)  # img/s counts finished steps, not steps still queued on the GPU
    elapsed = time.perf_counter() - start
    totals = torch.stack([loss_sum, correct.double(), torch.tensor(float(samples), dtype=torch.float64,
                                                                   device=device)])
    if dist_utils.is_distributed():
        torch.distributed.all_reduce(totals)
    n = max(totals[2].item(), 1.0)
    stats = {"loss": totals[0].item() / n, "accuracy": totals[1].item() / n, "samples": int(totals[2].item()),
             "images_per_s": totals[2].item() / max(elapsed, 1e-9), "steps_done": step,
             "interrupted": bool(stop) and step < total_steps, "lr": lr, "global_step": global_step}
    progress.close(f"{step - first_step} steps  loss {stats['loss']:.4f}  lr {lr:.3g}  "
                   f"{stats['images_per_s']:.0f} img/s  {elapsed:.1f} s")
    return stats


class _EpochProgress:
    """Progress of one epoch on stderr: a tqdm bar when stderr is a terminal; otherwise (a log file, a pipe, CI) no
    bar, whose redraws would fill the log, but one plain line when the epoch ends."""

    def __init__(self, desc: str, total: int, initial: int, enabled: bool):
        self.desc, self.enabled, self.bar = desc, enabled, None
        if enabled and _stderr_is_a_terminal():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=initial, desc=desc, leave=False, dynamic_ncols=True)

    def update(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def close(self, summary: str) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled:
            print(f"{self.desc}  {summary}", file=sys.stderr, flush=True)


def _stderr_is_a_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


@torch.no_grad()
def evaluate(model, loader, device, args, n_bins: int = 15) -> dict:
    """Calibration metrics of ``loader`` via the streaming ``CalibrationMeter`` (merged exactly across DDP ranks;
    the loader's ``UnpaddedDistributedSampler`` counts every sample once)."""
    model.eval()
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]
    meter = ck.metrics.CalibrationMeter(n_bins=n_bins)
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        meter.update(logits.float(), targets.to(device))
    return {k: float(v) for k, v in meter.compute().items()}


# ---------------------------------------------------------------------------------------------------------- setup
def _make_optimizer(recipe, model, lr):
    if recipe.optimizer == "sgd":
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=recipe.momentum, weight_decay=recipe.weight_decay)
    if recipe.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr, weight_decay=recipe.weight_decay)
    raise ValueError(f"unknown optimizer {recipe.optimizer!r}")


def _phases(scheduler) -> list:
    """The schedulers that set the lr: a warm-up's ``SequentialLR`` holds them (``LinearLR``, then the main one)."""
    return list(getattr(scheduler, "_schedulers", None) or [scheduler])


def _override_lr(optimizer, scheduler, lr: float) -> None:
    """Make ``lr`` the base learning rate of a resumed run: each group keeps the schedule's current factor (the
    warm-up's ramp, the MultiStep decays or the cosine already applied) times the new base, and every phase of the
    schedule continues from it (a phase that starts later starts from the new base)."""
    phases = _phases(scheduler)
    for group, base in zip(optimizer.param_groups, phases[0].base_lrs):
        group["lr"] = lr * (group["lr"] / base)
        group["initial_lr"] = lr
    last = [group["lr"] for group in optimizer.param_groups]
    for phase in phases:
        phase.base_lrs = [lr] * len(optimizer.param_groups)
    for each in {id(s): s for s in (scheduler, *phases)}.values():
        each._last_lr = list(last)


def _retime_cosine(scheduler, epochs: int, warmup_epochs: int) -> None:
    """A resumed run with another ``--epochs``: its cosine (bare, or after the warm-up inside ``SequentialLR``) now
    reaches 0 at the new last epoch, continuing from the current lr; other schedules keep their milestones."""
    main = _phases(scheduler)[-1]
    if isinstance(main, torch.optim.lr_scheduler.CosineAnnealingLR):
        main.T_max = epochs - (warmup_epochs if main is not scheduler else 0)


def _sync_buffers(model: nn.Module) -> None:
    """Make every rank's buffers (BatchNorm running statistics) rank 0's, so that evaluation on the shards uses the
    same model that rank 0 checkpoints."""
    if dist_utils.is_distributed():
        for buffer in model.buffers():
            torch.distributed.broadcast(buffer, src=0)


class MetaBatches:
    """The meta methods' endless meta-validation batches: the meta split reshuffled every pass by a seeded generator
    of its own (``seed``; each rank its own).

    Its position (:meth:`state_dict`: the passes begun and the samples taken from the current one) is saved with the
    checkpoint. :meth:`load_state_dict` re-draws the permutations of those passes and carries on at that sample, so
    a resumed run meets the very batches the uninterrupted one would, and no skipped image is loaded. Every rank
    takes one batch per step from a split of the same size, so rank 0's position is every rank's."""

    def __init__(self, dataset, batch_size: int, seed: int, **loader_kwargs):
        self.size, self.seed = len(dataset), int(seed)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.passes, self.taken, self._iterator = 0, 0, None
        self._order: list[int] = []  # the DataLoader's sampler, refilled in place at each pass
        # the loader's own generator only seeds its workers (no draw from the global RNG, which the training owns)
        self.loader = DataLoader(dataset, batch_size=batch_size, sampler=self._order, drop_last=False,
                                 generator=torch.Generator().manual_seed(self.seed), **loader_kwargs)

    def _begin_pass(self, skip: int = 0) -> None:
        order = torch.randperm(self.size, generator=self.generator).tolist()
        self._order[:] = order[skip:]
        self.passes, self.taken = self.passes + 1, skip
        self._iterator = iter(self.loader)

    def __iter__(self):
        return self

    def __next__(self):
        if self._iterator is None:
            self._begin_pass()
        try:
            images, targets = next(self._iterator)
        except StopIteration:
            self._begin_pass()
            images, targets = next(self._iterator)
        self.taken += len(targets)
        return images, targets

    def state_dict(self) -> dict:
        return {"passes": self.passes, "taken": self.taken}

    def load_state_dict(self, state: dict) -> None:
        passes, taken = int(state["passes"]), int(state["taken"])
        self.generator.manual_seed(self.seed)
        self.passes, self.taken, self._iterator = 0, 0, None
        for _ in range(passes - 1):  # the permutations of the passes already over
            torch.randperm(self.size, generator=self.generator)
            self.passes += 1
        if passes:
            self._begin_pass(skip=min(taken, self.size))


class _EpochLog:
    """Rank-0 per-epoch log: ``log.csv`` (one row per epoch), ``log.jsonl`` and optionally TensorBoard."""

    def __init__(self, output_dir: Path, tensorboard: bool, append: bool):
        self.csv_path, self.jsonl_path = output_dir / "log.csv", output_dir / "log.jsonl"
        if not append:  # a new run in an old folder: its rows (and CSV columns) are not this run's
            for path in (self.csv_path, self.jsonl_path):
                path.unlink(missing_ok=True)
        self.writer = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                raise RuntimeError("--tensorboard needs the tensorboard package (pip install tensorboard)") from exc
            self.writer = SummaryWriter(str(output_dir / "tb"))

    def write(self, row: dict) -> None:
        flat = {k: v for k, v in row.items() if not isinstance(v, (dict, list))}
        header = []
        if self.csv_path.is_file():
            with self.csv_path.open(newline="") as handle:
                header = next(csv.reader(handle), [])
        columns = header + [key for key in flat if key not in header]
        if header and columns != header:
            # A resumed run with other options (--model-ema added, …) has other columns: the file is rewritten
            # under the union of both, earlier rows blank where they have no value, so every row keeps its header.
            with self.csv_path.open(newline="") as handle:
                rows = list(csv.DictReader(handle))
            self._write_csv(columns, rows, "w")
        self._write_csv(columns, [flat], "a" if header else "w", header=not header)
        with self.jsonl_path.open("a") as handle:
            handle.write(json.dumps(row) + "\n")
        if self.writer is not None:
            for key, value in flat.items():
                if key != "epoch" and isinstance(value, (int, float)):
                    self.writer.add_scalar(key, value, row["epoch"])

    def _write_csv(self, columns: list, rows: list, mode: str, header: bool = True) -> None:
        with self.csv_path.open(mode, newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=columns, restval="")
            if header:
                writer.writeheader()
            writer.writerows(rows)

    def close(self):
        if self.writer is not None:
            self.writer.close()


def _truncate_log(output_dir: Path, completed_epochs: int) -> None:
    """On resume, drop log rows of epochs after the checkpoint (they will be trained again)."""
    for path in (output_dir / "log.csv", output_dir / "log.jsonl"):
        if not path.is_file():
            continue
        lines = path.read_text().splitlines(keepends=True)
        header = lines[:1] if path.suffix == ".csv" else []
        rows = lines[len(header):]
        path.write_text("".join(header + rows[:completed_epochs]))


def run_training(args, checkpoint: dict | None = None) -> dict | None:
    """Train one loss per ``args`` (resolved by :func:`resolve_run_config`; with ``--resume``, from ``checkpoint``,
    whose settings :func:`args_from_checkpoint` merged into ``args``); return the calibration report with the test
    logits on rank 0 (``None`` elsewhere, or when ``--stop-after`` stopped the run before its last epoch).

    Raises :class:`TrainingInterrupted` after saving a checkpoint when SIGTERM/SIGINT stopped the run. The output
    folder is created only once the data, the model and the checkpoint have loaded, so a failed start leaves none."""
    recipe = get_recipe(args.recipe)
    if args.image_size is not None:
        recipe = dataclasses.replace(recipe, image_size=args.image_size)
    device = torch.device(args.device)
    distributed = dist_utils.is_distributed()
    world, rank = dist_utils.world_size(), dist_utils.rank()
    main_process = rank == 0
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be divisible by the {world} DDP processes")
    output_dir = Path(args.output_dir)

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # Each rank draws different augmentations; the model's initial weights are rank 0's (DDP broadcasts them).
    torch.manual_seed(args.seed + rank)
    meta_fraction = float(getattr(args, "meta_fraction", 0.0) or 0.0) if args.method != "standard" else 0.0
    synthetic = bool(getattr(args, "synthetic", False))
    splits = build_datasets(recipe, args.data_root, args.seed, meta_fraction=meta_fraction, download=args.download,
                            synthetic_size=args.synthetic_size if synthetic else None)
    # Synthetic images read in this process stay on the device: a batch is then one stack of device tensors, with no
    # host copy or transfer that could hold a GPU back. Worker processes (--workers K) get them from host memory.
    synthetic_on_device = synthetic and args.workers == 0
    if synthetic_on_device:
        splits = dataclasses.replace(splits, **{name: getattr(splits, name).to(device)
                                                for name in ("train", "val", "test", "meta")
                                                if getattr(splits, name) is not None})
    num_classes = splits.num_classes or recipe.num_classes
    args.num_classes = num_classes
    args.model_kwargs = {"in_channels": recipe.in_channels}
    if args.arch == recipe.arch:
        args.model_kwargs.update(recipe.model_kwargs)
    if args.arch == "tv_vit_b_16":
        args.model_kwargs["image_size"] = recipe.image_size

    per_rank_batch = args.batch_size // world
    train_sampler = ResumableDistributedSampler(splits.train, num_replicas=world, rank=rank, shuffle=True,
                                                seed=args.seed)
    pin = device.type == "cuda" and not synthetic_on_device
    loader_kwargs = {"num_workers": args.workers, "pin_memory": pin, "persistent_workers": args.workers > 0}
    train_loader = DataLoader(splits.train, batch_size=per_rank_batch, sampler=train_sampler, drop_last=False,
                              **loader_kwargs)
    eval_batch = max(per_rank_batch, 256)
    val_loader = DataLoader(splits.val, batch_size=eval_batch,
                            sampler=dist_utils.UnpaddedDistributedSampler(splits.val), **loader_kwargs)
    test_loader = DataLoader(splits.test, batch_size=eval_batch,
                             sampler=dist_utils.UnpaddedDistributedSampler(splits.test), **loader_kwargs)

    model = build_model(args.arch, num_classes, pretrained=args.pretrained, **args.model_kwargs).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    model_without_ddp = model
    criterion = build_criterion(args.loss, args.reduction, args.backend, getattr(args, "label_smoothing", 0.0),
                                getattr(args, "mmce_form", recipe.mmce_form))
    schedule = loss_schedule(args, criterion, recipe)
    optimizer = _make_optimizer(recipe, model, args.lr)
    scheduler = soft_targets.make_scheduler(optimizer, recipe.scheduler, args.epochs, recipe.milestones,
                                            getattr(args, "warmup_epochs", 0), getattr(args, "warmup_decay", 0.01))
    ema = None
    if getattr(args, "model_ema", False):
        decay = soft_targets.ema_decay_per_update(args.model_ema_decay, args.model_ema_steps, args.batch_size,
                                                  args.epochs)
        ema = soft_targets.make_ema(model_without_ddp, decay, device=device)
    scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    meta = meta_iterator = None
    if args.method != "standard":
        from . import meta as meta_module  # imported only when chosen (owned by the meta-regularisation work)

        if splits.meta is None:
            raise ValueError(f"--method {args.method} needs a meta split: pass --meta-fraction > 0")
        meta_batch = (getattr(args, "meta_batch_size", None) or args.batch_size) // world
        meta_iterator = MetaBatches(splits.meta, max(1, meta_batch), args.seed + 17 + rank, **loader_kwargs)

    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    # --compile: the standard step compiles model and loss together (compiled_forward_and_loss); the meta methods'
    # steps call the model themselves, so there the model alone is compiled, and their step runs through it (the
    # γ-Net's look-ahead is a functional call of the classifier layer, outside the compiled model)
    step_forward = forward_and_loss
    if args.compile and args.method == "standard":
        train_model = model
        # fullgraph for the fused family's losses (one op each); other losses may hold data-dependent Python
        # (AdaFocal's state checks), which may split the graph
        fused_only = all(isinstance(module, ck.losses.UncertaintyWeightedCE)
                         for module in (schedule.criterion, schedule.warmup_criterion) if module is not None)
        step_forward = compiled_forward_and_loss(fullgraph=not distributed and fused_only)
    else:
        train_model = torch.compile(model) if args.compile else model
    eval_model = train_model if args.compile and not distributed and step_forward is forward_and_loss else (
        torch.compile(model_without_ddp) if args.compile else model_without_ddp)
    if args.method != "standard":
        meta = meta_module.MetaRegularizer(train_model, num_classes, args.method.split("-", 1)[1], args, device)

    start_epoch, first_step, global_step = 0, 0, 0
    if args.resume:
        if checkpoint is None:
            checkpoint = load_checkpoint(args.resume, map_location="cpu")
        saved = checkpoint["args"]
        for key in ("recipe", "arch", "num_classes", "loss"):
            if saved.get(key) != getattr(args, key):
                raise ValueError(f"--resume {args.resume}: checkpoint has {key}={saved.get(key)!r} but this run has "
                                 f"{getattr(args, key)!r}")
        saved_warmup = "_schedulers" in (checkpoint.get("scheduler") or {})  # a warm-up's SequentialLR
        if saved_warmup != isinstance(scheduler, torch.optim.lr_scheduler.SequentialLR):
            raise ValueError(f"--resume {args.resume}: the checkpoint's lr schedule has {'a' if saved_warmup else 'no'}"
                             f" warm-up and this run's has {'none' if saved_warmup else 'one'}; a warm-up can be "
                             "added, removed or changed only when a run starts")
        try:
            model_without_ddp.load_state_dict(checkpoint["model"])
            optimizer.load_state_dict(checkpoint["optimizer"])
            scheduler.load_state_dict(checkpoint["scheduler"])
        except (KeyError, RuntimeError, ValueError) as exc:
            raise ValueError(f"--resume {args.resume}: the checkpoint does not fit this run's model or optimizer "
                             f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
        if scaler.is_enabled() and checkpoint.get("scaler"):  # an --amp fp16 GradScaler's state
            scaler.load_state_dict(checkpoint["scaler"])
        if ema is not None and checkpoint.get("model_ema") is not None:
            ema.load_state_dict(checkpoint["model_ema"])
        explicit = explicit_options(args)
        if "lr" in explicit:
            _override_lr(optimizer, scheduler, args.lr)
        if "epochs" in explicit:
            _retime_cosine(scheduler, args.epochs, getattr(args, "warmup_epochs", 0) or 0)
        if meta is not None and checkpoint.get("meta") is not None:
            meta.load_state_dict(checkpoint["meta"])
        if meta_iterator is not None and checkpoint.get("meta_batches") is not None:
            meta_iterator.load_state_dict(checkpoint["meta_batches"])
        if checkpoint.get("loss_state"):  # a loss with state of its own (AdaFocal's γ table)
            criterion.load_state_dict(checkpoint["loss_state"])
        start_epoch, first_step = int(checkpoint["epoch"]), int(checkpoint.get("batches_done", 0))
        steps_per_epoch = min(len(train_loader), args.max_steps_per_epoch or len(train_loader))
        # a checkpoint that did not count its optimiser steps: those of the epochs and batches it trained
        global_step = int(checkpoint.get("optimizer_steps", start_epoch * steps_per_epoch + first_step))
        if main_process:
            _truncate_log(output_dir, start_epoch)
            print(f"resumed from {args.resume}: epoch {start_epoch}" + (f", batch {first_step}" if first_step else ""))

    def make_checkpoint(epoch: int, batches_done: int, optimizer_steps: int) -> dict:
        return {
            "model": model_without_ddp.state_dict(), "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(), "scaler": scaler.state_dict(), "epoch": epoch,
            "batches_done": batches_done, "args": {k: v for k, v in vars(args).items()},
            "recipe": recipe.to_dict(), "rng": rng_state(), "meta": meta.state_dict() if meta is not None else None,
            "meta_batches": meta_iterator.state_dict() if meta_iterator is not None else None,
            "world_size": world, "model_ema": ema.state_dict() if ema is not None else None,
            "loss_state": criterion.state_dict(), "optimizer_steps": optimizer_steps,
        }

    if main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
    log = _EpochLog(output_dir, args.tensorboard, append=bool(args.resume)) if main_process else None
    log_every = args.log_every or max(1, math.ceil(args.epochs / 15))
    checkpoint_path = output_dir / "checkpoint.pt"
    if main_process:
        (output_dir / "args.json").write_text(json.dumps(vars(args), indent=2, default=str))
        loss_text = (f"loss {args.loss}" if args.method == "standard" else
                     f"{args.method}: focal loss with the γ-Net's per-sample γ ({len(splits.meta)} meta-validation)")
        if getattr(criterion, "form", None) is not None:
            loss_text += f" (MMCE form {criterion.form})"
        if schedule.describe():
            loss_text += f" [{schedule.describe()}]"
        data_text = recipe.dataset
        if synthetic:
            where = ", kept on the device" if synthetic_on_device else ""
            covered = min(len(splits.train.targets), num_classes)  # a pool of P images has P classes at most
            classes = f"{num_classes} classes" + (f", images of {covered} of them" if covered < num_classes else "")
            data_text = (f"synthetic {recipe.dataset}-shaped images ({recipe.in_channels}x{recipe.image_size}x"
                         f"{recipe.image_size}, {classes}{where})")
        print(f"{recipe.name}: {args.arch} on {data_text} ({len(splits.train)} train / {len(splits.val)} val / "
              f"{len(splits.test)} test), {loss_text} ({args.reduction} reduction), {args.epochs} epochs, "
              f"batch {args.batch_size}, lr {args.lr}, {world} process(es) on {device}")

    stop = _StopRequest().install()
    epochs_this_run = 0
    try:
        if checkpoint is not None:
            set_rng_state(checkpoint["rng"])  # after every other draw, so resumed == uninterrupted
        for epoch in range(start_epoch, args.epochs):
            train_sampler.set_epoch(epoch)
            train_sampler.skip = first_step * per_rank_batch
            epoch_criterion = schedule.criterion_for(epoch)
            stats = train_one_epoch(train_model, epoch_criterion, optimizer, train_loader, device, epoch, args, scaler,
                                    stop, first_step=first_step, meta=meta, meta_iterator=meta_iterator, ema=ema,
                                    step_forward=step_forward, global_step=global_step)
            first_step, global_step = 0, stats["global_step"]
            train_sampler.skip = 0
            if stats["interrupted"]:
                if main_process:
                    save_checkpoint(make_checkpoint(epoch, stats["steps_done"], global_step), checkpoint_path)
                    print(f"{stop.signal_name}: saved {checkpoint_path} at epoch {epoch + 1}, batch "
                          f"{stats['steps_done']}; continue with --resume {checkpoint_path}", flush=True)
                raise TrainingInterrupted(stop.signal_name, stop.signum)
            scheduler.step()
            _sync_buffers(model_without_ddp)
            if schedule.updates_after(epoch):  # AdaFocal: the γ table from the validation split, on every rank
                amp = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]
                criterion.update(*collect_logits(eval_model, val_loader, device, amp, args.channels_last))
            last = epoch + 1 == args.epochs
            val, val_ema = {}, {}
            if (epoch + 1) % args.eval_every == 0 or last:
                val = evaluate(eval_model, val_loader, device, args, n_bins=args.n_bins)
                if ema is not None:
                    _sync_buffers(ema.module)
                    val_ema = evaluate(ema.module, val_loader, device, args, n_bins=args.n_bins)
            epochs_this_run += 1
            if main_process:
                row = {"epoch": epoch + 1, "lr": stats["lr"], "train_loss": stats["loss"],  # the lr it trained at
                       "train_accuracy": stats["accuracy"], "images_per_s": stats["images_per_s"],
                       **{f"val_{k}": val.get(k, math.nan) for k in ck.metrics.METRIC_KEYS}}
                if ema is not None:
                    row.update({f"val_ema_{k}": val_ema.get(k, math.nan) for k in ck.metrics.METRIC_KEYS})
                if meta is not None:
                    row["gamma"] = meta.gamma_histogram()
                if schedule.gammas or schedule.ce_warmup_epochs:
                    warming_up = epoch < schedule.ce_warmup_epochs
                    row["loss_phase"] = "ce_warmup" if warming_up else "loss"
                    row["loss_gamma"] = schedule.gamma_at(epoch) if schedule.gammas and not warming_up else math.nan
                if isinstance(criterion, ck.losses.AdaFocalLoss):
                    row["adafocal_gamma"] = criterion.gamma.tolist()  # log.jsonl only (a list)
                log.write(row)
                save_checkpoint(make_checkpoint(epoch + 1, 0, global_step), checkpoint_path)
                if (epoch + 1) % log_every == 0 or last or epoch == start_epoch:
                    summary = (f"epoch {epoch + 1:4d}/{args.epochs}  loss {stats['loss']:.4f}  "
                               f"train acc {100 * stats['accuracy']:.2f}%  {stats['images_per_s']:.0f} img/s")
                    if val:
                        summary += (f"  val acc {100 * val['accuracy']:.2f}%  val ECE {100 * val['ece']:.2f}%  "
                                    f"val NLL {val['nll']:.4f}")
                    print(summary, flush=True)
            if stop.requested() or (args.stop_after is not None and epochs_this_run >= args.stop_after
                        and epoch + 1 < args.epochs):
                if main_process:
                    why = stop.signal_name or f"--stop-after {args.stop_after}"
                    print(f"{why}: stopped after epoch {epoch + 1}; continue with --resume {checkpoint_path}",
                          flush=True)
                if stop:
                    raise TrainingInterrupted(stop.signal_name, stop.signum)
                return None
    finally:
        stop.restore()
        if log is not None:
            log.close()

    _sync_buffers(model_without_ddp)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[args.amp]
    val_logits, val_labels = collect_logits(eval_model, val_loader, device, amp_dtype, args.channels_last)
    test_logits, test_labels = collect_logits(eval_model, test_loader, device, amp_dtype, args.channels_last)
    ema_logits = None
    if ema is not None:  # collected on every rank (a collective under DDP)
        _sync_buffers(ema.module)
        ema_logits = [collect_logits(ema.module, loader, device, amp_dtype, args.channels_last)
                      for loader in (val_loader, test_loader)]
    if not main_process:
        return None
    report = calibration_report(val_logits, val_labels, test_logits, test_labels, n_bins=args.n_bins)
    report.update(recipe=args.recipe, loss=args.loss if args.method == "standard" else "focal_loss (per-sample γ)",
                  method=args.method, arch=args.arch, seed=args.seed, epochs=args.epochs)
    title = f"{args.recipe} {args.loss if args.method == 'standard' else args.method}"
    if synthetic:
        report["data"] = "synthetic"
        title += " (synthetic data)"
    report = save_report(report, test_logits, test_labels, output_dir, title=title)
    print(format_report(report, title=f"== {title}: test calibration =="))
    print(f"wrote {output_dir / 'report.json'}, {output_dir / 'reliability_pre_T.png'}, "
          f"{output_dir / 'reliability_post_T.png'}, {output_dir / 'log.csv'}, {checkpoint_path}")
    result = {"report": report, "test_logits": test_logits, "test_labels": test_labels}
    if ema is not None:
        result["report_ema"] = _report_ema(ema_logits, report, args, output_dir / "ema", title)
    return result


def _report_ema(ema_logits, report, args, output_dir: Path, title: str):
    """The EMA weights' pre-T / post-T report (its own temperature, fitted on validation), in ``output_dir``."""
    (ema_val_logits, ema_val_labels), (ema_test_logits, ema_test_labels) = ema_logits
    ema_report = calibration_report(ema_val_logits, ema_val_labels, ema_test_logits, ema_test_labels,
                                    n_bins=args.n_bins)
    ema_report.update({k: report[k] for k in ("recipe", "loss", "method", "arch", "seed", "epochs")},
                      model="ema", model_ema_decay=args.model_ema_decay, model_ema_steps=args.model_ema_steps)
    ema_report = save_report(ema_report, ema_test_logits, ema_test_labels, output_dir, title=f"{title} (EMA)")
    print(format_report(ema_report, title=f"== {title} (EMA weights): test calibration =="))
    print(f"wrote {output_dir / 'report.json'}")
    return ema_report


# ----------------------------------------------------------------------------------------------------------- main
_UNSET = object()


def parse_args(argv=None) -> argparse.Namespace:
    """Parse the CLI; the meta-regularisation flags exist only with ``--method meta-*`` (their module is imported
    only then). ``args.explicit`` lists the options given on the command line (``--resume`` lets them override the
    checkpoint's settings)."""
    parser = get_args_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    # the first pass only reads --method; a help request answered there would list no --meta-* option
    known, _ = parser.parse_known_args([arg for arg in argv if arg not in ("-h", "--help")])
    if known.method != "standard":
        from . import meta as meta_module

        meta_module.add_meta_args(parser)
    args = parser.parse_args(argv)
    # Parsing again into a namespace whose every attribute is already set keeps argparse from filling in defaults:
    # what it overwrites is what the command line gave.
    given = parser.parse_args(argv, namespace=argparse.Namespace(**{key: _UNSET for key in vars(args)}))
    args.explicit = sorted(key for key, value in vars(given).items() if value is not _UNSET)
    return args


def main(args) -> dict | None:
    """Run what ``args`` asks: list recipes, train one loss, or ``--compare`` several. Returns rank 0's result."""
    if args.list_recipes:
        print(describe_recipes())
        return None
    check_device(args.device)
    dist_utils.init_distributed(torch.device(args.device).type)
    if dist_utils.is_distributed() and torch.device(args.device).type == "cuda":
        args.device = f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}"
    try:
        if args.compare and args.resume:  # before the seed count, which --compare's default of 3 seeds would trip
            raise ValueError("--resume resumes one run; resume a --compare member with --loss and its --output-dir")
        seeds = _seed_list(args)
        if not args.compare:
            if len(seeds) > 1:
                return _run_seeds(args, seeds)
            checkpoint = None
            if args.resume:
                checkpoint = load_checkpoint(args.resume, map_location="cpu")
                args = args_from_checkpoint(args, checkpoint)
            return run_training(resolve_run_config(args), checkpoint)
        specs = [s.strip() for s in args.compare.split(",") if s.strip()]
        if len(specs) < 2:
            raise ValueError(f"--compare needs at least two losses, got {args.compare!r}")
        tags = {}
        for spec in specs:  # a loss's folder is its tag, so two specs of one tag would train into one folder
            tag = loss_tag(spec)
            if tag in tags:
                raise ValueError(f"--compare lists the loss {spec!r} twice" if tags[tag] == spec else
                                 f"--compare losses {tags[tag]!r} and {spec!r} would share the folder {tag}")
            tags[tag] = spec
        base = Path(args.output_dir or default_output_dir(args, "compare"))
        # Every member is checked before the first one trains.
        members = {spec: [resolve_run_config(argparse.Namespace(**{
            **vars(args), "loss": spec, "compare": None, "seed": seed,
            "output_dir": str(_seed_dir(base / loss_tag(spec), seed, len(seeds)))})) for seed in seeds]
            for spec in specs}
        reports, outputs = {}, {}
        start = time.perf_counter()
        for index, spec in enumerate(specs):
            results = []
            for seed, run_args in zip(seeds, members[spec]):
                if dist_utils.is_main_process() and len(seeds) > 1:
                    print(f"\n-- --compare: loss {index + 1}/{len(specs)} {spec}, seed {seed} "
                          f"({len(seeds)} seeds) --", flush=True)
                results.append(run_training(run_args))
            if all(result is not None for result in results):
                if len(seeds) > 1:
                    reports[spec] = _save_aggregate(results, base / loss_tag(spec), f"{args.recipe} {spec}")
                    outputs[spec] = [(r["test_logits"], r["test_labels"]) for r in results]
                else:
                    reports[spec] = results[0]["report"]
                    outputs[spec] = (results[0]["test_logits"], results[0]["test_labels"])
        if dist_utils.is_main_process() and len(reports) == len(specs):
            saved = save_comparison(reports, outputs, base, n_bins=args.n_bins, title=args.recipe)
            seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}, mean ± std"
            print(f"\n== {args.recipe}: {len(specs)} losses, {seed_text}, test split "
                  f"(ECE-type metrics and accuracy in %) ==")
            print(saved["table"])
            print(f"wrote {base / 'comparison.md'}, {base / 'comparison.json'}, {saved['figure']} "
                  f"({time.perf_counter() - start:.0f} s)")
            return {"reports": reports, **saved}
        return None
    finally:
        dist_utils.cleanup()


def check_device(device: str) -> None:
    """Raise a ValueError unless ``device`` names a device this machine has (checked before anything runs)."""
    try:
        parsed = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        raise ValueError(f"--device {device!r} is not a device ({str(exc).strip().splitlines()[0]})") from exc
    if parsed.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"--device {device}: CUDA is not available on this machine (use --device cpu)")
        if parsed.index is not None and parsed.index >= torch.cuda.device_count():
            raise ValueError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")


def _seed_list(args) -> list[int]:
    """The seeds of ``--seeds`` (default 3 with ``--compare``, else 1), from ``--seed`` on."""
    count = args.seeds if getattr(args, "seeds", None) is not None else (3 if args.compare else 1)
    if count < 1:
        raise ValueError(f"--seeds must be >= 1, got {count}")
    if count > 1 and args.resume:
        raise ValueError("--resume resumes one run; resume one seed's run with --seed and its --output-dir")
    return [args.seed + offset for offset in range(count)]


def _seed_dir(base: Path, seed: int, count: int) -> Path:
    """A run's folder: ``base`` itself for a single seed, else ``base/seed<seed>``."""
    return base if count == 1 else base / f"seed{seed}"


def _save_aggregate(results: list[dict], output_dir: Path, title: str) -> dict:
    """Aggregate the seeds' reports (mean ± std), print the table and write it as ``output_dir/report.json``."""
    report = aggregate_reports([result["report"] for result in results])
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "report.json").write_text(json.dumps(report, indent=2))
    print(format_aggregate(report, title=f"== {title}: test calibration over {len(results)} seeds =="))
    print(f"wrote {output_dir / 'report.json'}", flush=True)
    return report


def _run_seeds(args, seeds: list[int]) -> dict | None:
    """One loss trained with each of ``seeds``, in ``<output-dir>/seed<s>/``; the mean ± std report in
    ``<output-dir>/report.json``."""
    base = Path(args.output_dir or default_output_dir(args, loss_tag(args.loss)))
    members = [resolve_run_config(argparse.Namespace(**{**vars(args), "seed": seed,
                                                        "output_dir": str(_seed_dir(base, seed, len(seeds)))}))
               for seed in seeds]
    results = []
    for seed, run_args in zip(seeds, members):
        if dist_utils.is_main_process():
            print(f"\n-- seed {seed} ({len(results) + 1}/{len(seeds)}) --", flush=True)
        results.append(run_training(run_args))
    if not dist_utils.is_main_process() or any(result is None for result in results):
        return None
    title = f"{args.recipe} {args.loss if args.method == 'standard' else args.method}"
    report = _save_aggregate(results, base, title)
    return {"report": report, "runs": results}


def missing_train_extra() -> list[str]:
    """The pip names of the `train` extra's packages that are not installed."""
    missing = []
    for module, package in TRAIN_EXTRA.items():
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            missing.append(package)
    return missing


def _error(message) -> int:
    """Print ``message`` as the one line ``error: …`` on stderr; return the exit code 2."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    print(f"error: {'; '.join(lines) or type(message).__name__}", file=sys.stderr, flush=True)
    return 2


def cli(argv=None) -> int:
    """Console entry point (``calib-train``, ``python -m training.train``). Exit code 0 when the run finished or
    ``--stop-after`` stopped it; 2 with one ``error: …`` line on stderr for a bad argument, data path or checkpoint,
    or a missing `train` extra; 128 + N once signal N stopped the run and its checkpoint is saved (143 for SIGTERM,
    130 for SIGINT)."""
    args = parse_args(argv)  # a usage error exits here: one error line, exit code 2
    install = 'pip install "calibkernels[train]"'
    try:
        missing = [] if args.list_recipes else missing_train_extra()
        if missing:
            return _error(f"the training CLI needs the `train` extra ({', '.join(missing)} missing): {install}")
        main(args)
    except TrainingInterrupted as exc:
        return 128 + exc.signum
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in TRAIN_EXTRA:
            raise
        return _error(f"the training CLI needs the `train` extra ({exc.name} missing): {install}")
    except (DataError, ValueError, OSError) as exc:
        return _error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
