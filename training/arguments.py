"""The training command line: its parser, the checks that run before anything trains, and the run's settings.

:func:`parse_args` reads the command line (the ``--meta-*`` options exist only with ``--method meta-*``);
:func:`resolve_run_config` fills the recipe's values into what was not given and refuses what cannot train;
:func:`args_from_checkpoint` merges a checkpoint's settings for ``--resume``. Every usage error, bad value or missing
file is one ``error: …`` line on stderr with exit code 2 (:class:`CliArgumentParser`, :func:`print_error`).
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import math
import os
import sys
from pathlib import Path

import torch

import calibkernels as ck

from . import distributed as dist_utils
from . import meta_learning
from .criterion import build_criterion, check_loss_spec, loss_schedule
from .loss_schedules import GAMMA_SCHEDULES, switch_epochs
from .models import ARCHITECTURES, PRETRAINED_ARCHITECTURES
from .recipes import RECIPES, get_recipe

METHODS = ("standard", "meta-sece", "meta-dece")

# The import names of the `train` extra (pyproject.toml) and their pip names; checked before anything runs.
TRAIN_EXTRA = {"tqdm": "tqdm", "torchvision": "torchvision", "matplotlib": "matplotlib", "sklearn": "scikit-learn"}

# Settings of an invocation, not of the run: --resume never takes them from the checkpoint.
_PER_INVOCATION = {"list_recipes", "compare", "seeds", "resume", "output_dir", "download", "pretrained", "device",
                   "compile", "channels_last", "workers", "stop_after", "threads", "log_every", "tensorboard",
                   "no_progress"}
# Values derived from the others (resolve_run_config, run_training), and the record of which flags were given.
_DERIVED = {"num_classes", "model_kwargs", "reduction", "clip_grad_norm", "explicit", "mmce_form"}
# They fix the model or the data splits, so a resumed run cannot change them.
_FIXED_BY_CHECKPOINT = ("recipe", "arch", "loss", "method", "seed", "image_size", "meta_fraction", "synthetic",
                        "synthetic_size")
# What a run without --loss, --compare or --resume trains (--method standard): cross-entropy against the calibration
# losses, each over the default 3 seeds, reported side by side (training/README.md, "The first run").
DEFAULT_COMPARISON = "cross_entropy,bsce_gra,flsd"
# The loss of a single run that names none: --method meta-* (which trains its own focal loss and records this name)
# and a --resume of a checkpoint written without --loss.
DEFAULT_LOSS = "bsce_gra"
# Training images of a --synthetic epoch when --synthetic-size is not given: this many full batches.
SYNTHETIC_BATCHES = 100


# ------------------------------------------------------------------------------------------------------ arguments
class CliArgumentParser(argparse.ArgumentParser):
    """argparse whose usage errors are one ``error: …`` line with exit code 2, like every other error of the CLI."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:
    parser = CliArgumentParser(
        description="Train a calibrated classifier (calibkernels training recipes). With no arguments, trains the "
                    f"embedded `digits` recipe on the CPU with each loss of {DEFAULT_COMPARISON} over 3 seeds and "
                    "prints their pre-T / post-T calibration side by side; --loss NAME trains one loss.",
        add_help=add_help, formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--recipe", default="digits", choices=list(RECIPES), metavar="NAME",
                        help="training recipe (see --list-recipes)")
    parser.add_argument("--list-recipes", action="store_true", help="print the recipes and exit")
    parser.add_argument("--loss", default=DEFAULT_LOSS,
                        help="train this one loss: a registry name with optional hyperparameters, "
                             "NAME[:KEY=VALUE[:KEY=VALUE…]], e.g. focal_loss:gamma=2 or bsce_gra:gamma=4:norm=2; "
                             f"names: {', '.join(ck.losses.names())}. Without --loss, --compare and --resume, the run "
                             f"is --compare {DEFAULT_COMPARISON}")
    parser.add_argument("--compare", default=None, metavar="LOSS1,LOSS2,…",
                        help="train each loss (same syntax as --loss) with the same seeds; print one side-by-side "
                             "table (mean ± std over the seeds), write it and one figure overlaying their reliability "
                             f"diagrams (default without --loss: {DEFAULT_COMPARISON})")
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
    parser.add_argument("--log-every", type=int, default=None, metavar="N",
                        help="without a progress bar, print every N-th evaluation's line and the last (default: "
                             "every evaluation's; --eval-every sets how often a run evaluates)")
    parser.add_argument("--tensorboard", action="store_true",
                        help="also log to TensorBoard (<output-dir>/tb; needs the tensorboard package)")
    parser.add_argument("--no-progress", action="store_true",
                        help="no progress bar on a terminal: one line per evaluation instead, as in a log (stdout "
                             "not a terminal)")
    return parser


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
            bound = "in [0, 1]" if name == "label_smoothing" else ">= 0"
            raise ValueError(f"--{name.replace('_', '-')} must be {bound}, got {value}")
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
        meta_learning.check_meta_args(args)
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
        meta_learning.add_meta_args(parser)
    args = parser.parse_args(argv)
    # Parsing again into a namespace whose every attribute is already set keeps argparse from filling in defaults:
    # what it overwrites is what the command line gave.
    given = parser.parse_args(argv, namespace=argparse.Namespace(**{key: _UNSET for key in vars(args)}))
    args.explicit = sorted(key for key, value in vars(given).items() if value is not _UNSET)
    if (args.method == "standard" and args.compare is None and args.resume is None and not args.list_recipes
            and "loss" not in args.explicit):
        args.compare = DEFAULT_COMPARISON
    return args


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


def print_error(message) -> int:
    """Print ``message`` as the one line ``error: …`` on stderr; return the exit code 2."""
    lines = [line.strip() for line in str(message).splitlines() if line.strip()]
    print(f"error: {'; '.join(lines) or type(message).__name__}", file=sys.stderr, flush=True)
    return 2
