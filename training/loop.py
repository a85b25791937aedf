"""The training loop of one run: build the data, model, loss and optimiser of a resolved configuration, resume from a
checkpoint, train the epochs with a checkpoint and a log row after each, then report the test split's calibration.

:func:`run_training` is the whole run; it is split into the steps below, which share one :class:`TrainingRun`. The
order in which they draw from the global RNG (model initialisation, then the γ-Net of the meta methods) is part of
what makes a resumed run continue bit-for-bit, so the steps keep it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

import calibkernels as ck

from . import distributed as dist_utils
from . import meta_learning
from . import soft_targets
from .arguments import explicit_options
from .checkpoint import load_checkpoint, rng_state, save_checkpoint, set_rng_state
from .criterion import build_criterion, loss_schedule
from .data import build_datasets
from .epoch import (AMP_DTYPES, MetaBatches, ResumableDistributedSampler, StopRequest, TrainingInterrupted, evaluate,
                    compiled_forward_and_loss, forward_and_loss, train_one_epoch)
from .models import build_model
from .progress import EpochLog, RunProgress, truncate_log
from .recipes import get_recipe
from .report import calibration_report, collect_logits, format_report, save_report


# ------------------------------------------------------------------------------------------------ optimiser, schedule
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


# ------------------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class TrainingRun:
    """Everything one run builds before its first epoch, and where its epochs stand."""

    args: object
    recipe: object
    device: torch.device
    world: int
    rank: int
    output_dir: Path
    splits: object = None
    synthetic_on_device: bool = False
    per_rank_batch: int = 0
    train_sampler: ResumableDistributedSampler | None = None
    train_loader: DataLoader | None = None
    val_loader: DataLoader | None = None
    test_loader: DataLoader | None = None
    loader_kwargs: dict = dataclasses.field(default_factory=dict)
    model_without_ddp: nn.Module | None = None
    train_model: nn.Module | None = None
    eval_model: nn.Module | None = None
    step_forward: object = forward_and_loss
    criterion: nn.Module | None = None
    schedule: object = None
    optimizer: torch.optim.Optimizer | None = None
    scheduler: object = None
    ema: object = None
    scaler: object = None
    meta: object = None
    meta_iterator: MetaBatches | None = None
    start_epoch: int = 0
    first_step: int = 0
    global_step: int = 0
    # the training batches' top-label statistics since the last evaluation (reset at each)
    train_meter: ck.metrics.CalibrationMeter | None = None

    @property
    def main_process(self) -> bool:
        return self.rank == 0

    @property
    def checkpoint_path(self) -> Path:
        return self.output_dir / "checkpoint.pt"

    def checkpoint(self, epoch: int, batches_done: int, optimizer_steps: int) -> dict:
        """The state a resumed run needs to continue exactly: after ``epoch`` epochs and ``batches_done`` batches of
        the next one."""
        return {
            "model": self.model_without_ddp.state_dict(), "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(), "scaler": self.scaler.state_dict(), "epoch": epoch,
            "batches_done": batches_done, "args": {k: v for k, v in vars(self.args).items()},
            "recipe": self.recipe.to_dict(), "rng": rng_state(),
            "meta": self.meta.state_dict() if self.meta is not None else None,
            "meta_batches": self.meta_iterator.state_dict() if self.meta_iterator is not None else None,
            "world_size": self.world, "model_ema": self.ema.state_dict() if self.ema is not None else None,
            "loss_state": self.criterion.state_dict(), "optimizer_steps": optimizer_steps,
        }


def _build_data(run: TrainingRun) -> None:
    """The run's splits (seeded by ``--seed``), the training sampler and the three loaders."""
    args, recipe, device = run.args, run.recipe, run.device
    meta_fraction = float(getattr(args, "meta_fraction", 0.0) or 0.0) if args.method != "standard" else 0.0
    synthetic = bool(getattr(args, "synthetic", False))
    splits = build_datasets(recipe, args.data_root, args.seed, meta_fraction=meta_fraction, download=args.download,
                            synthetic_size=args.synthetic_size if synthetic else None)
    # Synthetic images read in this process stay on the device: a batch is then one stack of device tensors, with no
    # host copy or transfer that could hold a GPU back. Worker processes (--workers K) get them from host memory.
    run.synthetic_on_device = synthetic and args.workers == 0
    if run.synthetic_on_device:
        splits = dataclasses.replace(splits, **{name: getattr(splits, name).to(device)
                                                for name in ("train", "val", "test", "meta")
                                                if getattr(splits, name) is not None})
    run.splits = splits
    args.num_classes = splits.num_classes or recipe.num_classes
    args.model_kwargs = {"in_channels": recipe.in_channels}
    if args.arch == recipe.arch:
        args.model_kwargs.update(recipe.model_kwargs)
    if args.arch == "tv_vit_b_16":
        args.model_kwargs["image_size"] = recipe.image_size

    run.per_rank_batch = args.batch_size // run.world
    run.train_sampler = ResumableDistributedSampler(splits.train, num_replicas=run.world, rank=run.rank, shuffle=True,
                                                    seed=args.seed)
    pin = device.type == "cuda" and not run.synthetic_on_device
    run.loader_kwargs = {"num_workers": args.workers, "pin_memory": pin, "persistent_workers": args.workers > 0}
    run.train_loader = DataLoader(splits.train, batch_size=run.per_rank_batch, sampler=run.train_sampler,
                                  drop_last=False, **run.loader_kwargs)
    eval_batch = max(run.per_rank_batch, 256)
    run.val_loader = DataLoader(splits.val, batch_size=eval_batch,
                                sampler=dist_utils.UnpaddedDistributedSampler(splits.val), **run.loader_kwargs)
    run.test_loader = DataLoader(splits.test, batch_size=eval_batch,
                                 sampler=dist_utils.UnpaddedDistributedSampler(splits.test), **run.loader_kwargs)


def _build_training(run: TrainingRun) -> None:
    """Model, loss and its schedule, optimiser and lr schedule, EMA, GradScaler, the meta methods' batches and
    regulariser, DDP and ``--compile``, in the order that fixes their draws from the global RNG."""
    args, recipe, device = run.args, run.recipe, run.device
    model = build_model(args.arch, args.num_classes, pretrained=args.pretrained, **args.model_kwargs).to(device)
    if args.channels_last:
        model = model.to(memory_format=torch.channels_last)
    run.model_without_ddp = model
    run.criterion = build_criterion(args.loss, args.reduction, args.backend, getattr(args, "label_smoothing", 0.0),
                                    getattr(args, "mmce_form", recipe.mmce_form), return_stats=True)
    # constant memory (no AdaECE): bins and sums on the device, read once per evaluation
    run.train_meter = ck.metrics.CalibrationMeter(n_bins=args.n_bins, track_adaptive=False)
    run.schedule = loss_schedule(args, run.criterion, recipe)
    run.optimizer = _make_optimizer(recipe, model, args.lr)
    run.scheduler = soft_targets.make_scheduler(run.optimizer, recipe.scheduler, args.epochs, recipe.milestones,
                                                getattr(args, "warmup_epochs", 0), getattr(args, "warmup_decay", 0.01))
    if getattr(args, "model_ema", False):
        decay = soft_targets.ema_decay_per_update(args.model_ema_decay, args.model_ema_steps, args.batch_size,
                                                  args.epochs)
        run.ema = soft_targets.make_ema(model, decay, device=device)
    run.scaler = torch.amp.GradScaler(device.type, enabled=args.amp == "fp16")

    if args.method != "standard":
        if run.splits.meta is None:
            raise ValueError(f"--method {args.method} needs a meta split: pass --meta-fraction > 0")
        meta_batch = (getattr(args, "meta_batch_size", None) or args.batch_size) // run.world
        run.meta_iterator = MetaBatches(run.splits.meta, max(1, meta_batch), args.seed + 17 + run.rank,
                                        **run.loader_kwargs)

    distributed = dist_utils.is_distributed()
    if distributed:
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    # --compile: the standard step compiles model and loss together (compiled_forward_and_loss); the meta methods'
    # steps call the model themselves, so there the model alone is compiled, and their step runs through it (the
    # γ-Net's look-ahead is a functional call of the classifier layer, outside the compiled model)
    run.step_forward = forward_and_loss
    if args.compile and args.method == "standard":
        run.train_model = model
        # fullgraph for the fused family's losses (one op each); other losses may hold data-dependent Python
        # (AdaFocal's state checks), which may split the graph
        fused_only = all(isinstance(module, ck.losses.UncertaintyWeightedCE)
                         for module in (run.schedule.criterion, run.schedule.warmup_criterion) if module is not None)
        run.step_forward = compiled_forward_and_loss(fullgraph=not distributed and fused_only)
    else:
        run.train_model = torch.compile(model) if args.compile else model
    run.eval_model = run.train_model if args.compile and not distributed and run.step_forward is forward_and_loss \
        else (torch.compile(run.model_without_ddp) if args.compile else run.model_without_ddp)
    if args.method != "standard":
        run.meta = meta_learning.MetaRegularizer(run.train_model, args.num_classes, args.method.split("-", 1)[1], args,
                                               device)


def _restore(run: TrainingRun, checkpoint: dict | None) -> dict:
    """Load ``--resume``'s checkpoint into the run (model, optimiser, schedule, scaler, EMA, meta state, loss state)
    and set where its epochs stand; returns the checkpoint."""
    args = run.args
    if checkpoint is None:
        checkpoint = load_checkpoint(args.resume, map_location="cpu")
    saved = checkpoint["args"]
    for key in ("recipe", "arch", "num_classes", "loss"):
        if saved.get(key) != getattr(args, key):
            raise ValueError(f"--resume {args.resume}: checkpoint has {key}={saved.get(key)!r} but this run has "
                             f"{getattr(args, key)!r}")
    saved_warmup = "_schedulers" in (checkpoint.get("scheduler") or {})  # a warm-up's SequentialLR
    if saved_warmup != isinstance(run.scheduler, torch.optim.lr_scheduler.SequentialLR):
        raise ValueError(f"--resume {args.resume}: the checkpoint's lr schedule has {'a' if saved_warmup else 'no'}"
                         f" warm-up and this run's has {'none' if saved_warmup else 'one'}; a warm-up can be "
                         "added, removed or changed only when a run starts")
    try:
        run.model_without_ddp.load_state_dict(checkpoint["model"])
        run.optimizer.load_state_dict(checkpoint["optimizer"])
        run.scheduler.load_state_dict(checkpoint["scheduler"])
    except (KeyError, RuntimeError, ValueError) as exc:
        raise ValueError(f"--resume {args.resume}: the checkpoint does not fit this run's model or optimizer "
                         f"({str(exc).splitlines()[0] if str(exc) else type(exc).__name__})") from exc
    if run.scaler.is_enabled() and checkpoint.get("scaler"):  # an --amp fp16 GradScaler's state
        run.scaler.load_state_dict(checkpoint["scaler"])
    if run.ema is not None and checkpoint.get("model_ema") is not None:
        run.ema.load_state_dict(checkpoint["model_ema"])
    explicit = explicit_options(args)
    if "lr" in explicit:
        _override_lr(run.optimizer, run.scheduler, args.lr)
    if "epochs" in explicit:
        _retime_cosine(run.scheduler, args.epochs, getattr(args, "warmup_epochs", 0) or 0)
    if run.meta is not None and checkpoint.get("meta") is not None:
        run.meta.load_state_dict(checkpoint["meta"])
    if run.meta_iterator is not None and checkpoint.get("meta_batches") is not None:
        run.meta_iterator.load_state_dict(checkpoint["meta_batches"])
    if checkpoint.get("loss_state"):  # a loss with state of its own (AdaFocal's γ table)
        run.criterion.load_state_dict(checkpoint["loss_state"])
    run.start_epoch, run.first_step = int(checkpoint["epoch"]), int(checkpoint.get("batches_done", 0))
    steps_per_epoch = min(len(run.train_loader), args.max_steps_per_epoch or len(run.train_loader))
    # a checkpoint that did not count its optimiser steps: those of the epochs and batches it trained
    run.global_step = int(checkpoint.get("optimizer_steps", run.start_epoch * steps_per_epoch + run.first_step))
    if run.main_process:
        truncate_log(run.output_dir, run.start_epoch)
        print(f"resumed from {args.resume}: epoch {run.start_epoch}"
              + (f", batch {run.first_step}" if run.first_step else ""))
    return checkpoint


def _describe_run(run: TrainingRun) -> str:
    """The run's first line: recipe, model, data and splits, loss, reduction, length, batch, lr, processes."""
    args, recipe, splits = run.args, run.recipe, run.splits
    loss_text = (f"loss {args.loss}" if args.method == "standard" else
                 f"{args.method}: focal loss with the γ-Net's per-sample γ ({len(splits.meta)} meta-validation)")
    if getattr(run.criterion, "form", None) is not None:
        loss_text += f" (MMCE form {run.criterion.form})"
    if run.schedule.describe():
        loss_text += f" [{run.schedule.describe()}]"
    data_text = recipe.dataset
    if getattr(args, "synthetic", False):
        where = ", kept on the device" if run.synthetic_on_device else ""
        covered = min(len(splits.train.targets), args.num_classes)  # a pool of P images has P classes at most
        classes = f"{args.num_classes} classes" + (f", images of {covered} of them" if covered < args.num_classes
                                                   else "")
        data_text = (f"synthetic {recipe.dataset}-shaped images ({recipe.in_channels}x{recipe.image_size}x"
                     f"{recipe.image_size}, {classes}{where})")
    return (f"{recipe.name}: {args.arch} on {data_text} ({len(splits.train)} train / {len(splits.val)} val / "
            f"{len(splits.test)} test), {loss_text} ({args.reduction} reduction), {args.epochs} epochs, "
            f"batch {args.batch_size}, lr {args.lr}, {run.world} process(es) on {run.device}")


# The training batches' metrics logged at each evaluation (train_batch_<key>), from the loss's statistics
TRAIN_BATCH_KEYS = ("accuracy", "ece")


def _log_row(run: TrainingRun, epoch: int, stats: dict, val: dict, val_ema: dict) -> dict:
    """The epoch's row of ``log.csv`` / ``log.jsonl``: ``train_batch_accuracy`` / ``train_batch_ece`` are those of
    the training batches since the previous evaluation (NaN on the epochs between evaluations), as the model was
    when it trained on each."""
    row = {"epoch": epoch + 1, "lr": stats["lr"], "train_loss": stats["loss"],  # the lr it trained at
           "train_accuracy": stats["accuracy"], "images_per_s": stats["images_per_s"],
           **{f"train_batch_{k}": stats.get(f"batch_{k}", math.nan) for k in TRAIN_BATCH_KEYS},
           **{f"val_{k}": val.get(k, math.nan) for k in ck.metrics.METRIC_KEYS}}
    if run.ema is not None:
        row.update({f"val_ema_{k}": val_ema.get(k, math.nan) for k in ck.metrics.METRIC_KEYS})
    if run.meta is not None:
        row["gamma"] = run.meta.gamma_histogram()
    schedule = run.schedule
    if schedule.gammas or schedule.ce_warmup_epochs:
        warming_up = epoch < schedule.ce_warmup_epochs
        row["loss_phase"] = "ce_warmup" if warming_up else "loss"
        row["loss_gamma"] = schedule.gamma_at(epoch) if schedule.gammas and not warming_up else math.nan
    if isinstance(run.criterion, ck.losses.AdaFocalLoss):
        row["adafocal_gamma"] = run.criterion.gamma.tolist()  # log.jsonl only (a list)
    return row


def _training_batch_metrics(meter: ck.metrics.CalibrationMeter) -> dict:
    """``{"batch_accuracy", "batch_ece"}`` of the training batches ``meter`` took since the last evaluation (merged
    over DDP ranks: a collective), then reset; ``{}`` if no rank took a batch (a run resumed at an evaluation)."""
    try:
        metrics = meter.compute()
    except ValueError:  # no samples on any rank: every rank raises alike
        return {}
    finally:
        meter.reset()
    return {f"batch_{key}": metrics[key] for key in TRAIN_BATCH_KEYS}


def _evaluate_epoch(run: TrainingRun, epoch: int) -> tuple[dict, dict]:
    """After an epoch's optimiser steps: the lr schedule's step, AdaFocal's γ update, and the validation metrics of
    the model (and of the EMA) on an evaluation epoch; ``({}, {})`` on the others."""
    args = run.args
    run.scheduler.step()
    _sync_buffers(run.model_without_ddp)
    if run.schedule.updates_after(epoch):  # AdaFocal: the γ table from the validation split, on every rank
        run.criterion.update(*collect_logits(run.eval_model, run.val_loader, run.device, AMP_DTYPES[args.amp],
                                             args.channels_last))
    val, val_ema = {}, {}
    if (epoch + 1) % args.eval_every == 0 or epoch + 1 == args.epochs:
        val = evaluate(run.eval_model, run.val_loader, run.device, args, n_bins=args.n_bins)
        if run.ema is not None:
            _sync_buffers(run.ema.module)
            val_ema = evaluate(run.ema.module, run.val_loader, run.device, args, n_bins=args.n_bins)
    return val, val_ema


def _train_epochs(run: TrainingRun, checkpoint: dict | None, log: EpochLog | None, label: str | None = None) -> bool:
    """The epochs from ``run.start_epoch`` on, each followed by its checkpoint and log row, with a progress bar or
    one line per evaluation (:class:`training.progress.RunProgress`). Returns whether the run reached its last epoch
    (False when ``--stop-after`` stopped it); raises :class:`TrainingInterrupted` once a signalled run has saved its
    checkpoint."""
    args = run.args
    steps_per_epoch = min(len(run.train_loader), args.max_steps_per_epoch or len(run.train_loader))
    progress = RunProgress(args.epochs, steps_per_epoch, run.start_epoch, run.first_step, label=label,
                           enabled=run.main_process, bar=not args.no_progress, log_every=args.log_every or 1)
    stop = StopRequest().install()
    epochs_this_run = 0
    try:
        if checkpoint is not None:
            set_rng_state(checkpoint["rng"])  # after every other draw, so resumed == uninterrupted
        for epoch in range(run.start_epoch, args.epochs):
            run.train_sampler.set_epoch(epoch)
            run.train_sampler.skip = run.first_step * run.per_rank_batch
            stats = train_one_epoch(run.train_model, run.schedule.criterion_for(epoch), run.optimizer,
                                    run.train_loader, run.device, epoch, args, run.scaler, stop,
                                    first_step=run.first_step, meta=run.meta, meta_iterator=run.meta_iterator,
                                    ema=run.ema, step_forward=run.step_forward, global_step=run.global_step,
                                    progress=progress, train_meter=run.train_meter)
            run.first_step, run.global_step = 0, stats["global_step"]
            run.train_sampler.skip = 0
            if stats["interrupted"]:
                progress.close()
                if run.main_process:
                    save_checkpoint(run.checkpoint(epoch, stats["steps_done"], run.global_step), run.checkpoint_path)
                    print(f"{stop.signal_name}: saved {run.checkpoint_path} at epoch {epoch + 1}, batch "
                          f"{stats['steps_done']}; continue with --resume {run.checkpoint_path}", flush=True)
                raise TrainingInterrupted(stop.signal_name, stop.signum)
            val, val_ema = _evaluate_epoch(run, epoch)
            if val:
                stats.update(_training_batch_metrics(run.train_meter))
            epochs_this_run += 1
            if run.main_process:
                log.write(_log_row(run, epoch, stats, val, val_ema))
                save_checkpoint(run.checkpoint(epoch + 1, 0, run.global_step), run.checkpoint_path)
            progress.epoch_done(epoch, stats, val)
            if stop.requested() or (args.stop_after is not None and epochs_this_run >= args.stop_after
                                    and epoch + 1 < args.epochs):
                progress.close()
                if run.main_process:
                    why = stop.signal_name or f"--stop-after {args.stop_after}"
                    print(f"{why}: stopped after epoch {epoch + 1}; continue with --resume {run.checkpoint_path}",
                          flush=True)
                if stop:
                    raise TrainingInterrupted(stop.signal_name, stop.signum)
                return False
    finally:
        progress.close()
        stop.restore()
    return True


def _final_report(run: TrainingRun, label: str | None = None, started: float | None = None) -> dict | None:
    """Fit T on the validation split and report the test split pre-T / post-T (and the EMA's); rank 0 saves it,
    prints it (a comparison's member, ``label``, prints one summary line instead of the table) and returns
    ``{"report", "test_logits", "test_labels"[, "report_ema"]}``, the other ranks ``None``."""
    args, device = run.args, run.device
    _sync_buffers(run.model_without_ddp)
    amp_dtype = AMP_DTYPES[args.amp]
    val_logits, val_labels = collect_logits(run.eval_model, run.val_loader, device, amp_dtype, args.channels_last)
    test_logits, test_labels = collect_logits(run.eval_model, run.test_loader, device, amp_dtype, args.channels_last)
    ema_logits = None
    if run.ema is not None:  # collected on every rank (a collective under DDP)
        _sync_buffers(run.ema.module)
        ema_logits = [collect_logits(run.ema.module, loader, device, amp_dtype, args.channels_last)
                      for loader in (run.val_loader, run.test_loader)]
    if not run.main_process:
        return None
    report = calibration_report(val_logits, val_labels, test_logits, test_labels, n_bins=args.n_bins)
    report.update(recipe=args.recipe, loss=args.loss if args.method == "standard" else "focal_loss (per-sample γ)",
                  method=args.method, arch=args.arch, seed=args.seed, epochs=args.epochs)
    title = f"{args.recipe} {args.loss if args.method == 'standard' else args.method}"
    if getattr(args, "synthetic", False):
        report["data"] = "synthetic"
        title += " (synthetic data)"
    output_dir = run.output_dir
    report = save_report(report, test_logits, test_labels, output_dir, title=title)
    if label is None:
        print(format_report(report, title=f"== {title}: test calibration =="))
        print(f"wrote {output_dir / 'report.json'}, {output_dir / 'reliability_pre_T.png'}, "
              f"{output_dir / 'reliability_post_T.png'}, {output_dir / 'log.csv'}, {run.checkpoint_path}")
    else:
        pre, post = report["pre_T"], report["post_T"]
        took = f", {time.perf_counter() - started:.0f} s" if started is not None else ""
        print(f"{label}: test accuracy {100 * pre['accuracy']:.2f}%, ECE {100 * pre['ece']:.2f}% pre-T, "
              f"{100 * post['ece']:.2f}% post-T (T = {report['temperature']:.2f}){took}", flush=True)
    result = {"report": report, "test_logits": test_logits, "test_labels": test_labels}
    if ema_logits is not None:
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


def run_training(args, checkpoint: dict | None = None, label: str | None = None) -> dict | None:
    """Train one loss per ``args`` (resolved by :func:`training.arguments.resolve_run_config`; with ``--resume``,
    from ``checkpoint``, whose settings :func:`training.arguments.args_from_checkpoint` merged into ``args``); return
    the calibration report with the test logits on rank 0 (``None`` elsewhere, or when ``--stop-after`` stopped the
    run before its last epoch). ``label`` names a member of a comparison or of a series of seeds: it starts the run's
    lines, and the run ends with one summary line instead of its report table (the report files are the same).

    Raises :class:`training.epoch.TrainingInterrupted` after saving a checkpoint when SIGTERM/SIGINT stopped the run.
    The output folder is created only once the data, the model and the checkpoint have loaded, so a failed start
    leaves none."""
    started = time.perf_counter()
    recipe = get_recipe(args.recipe)
    if args.image_size is not None:
        recipe = dataclasses.replace(recipe, image_size=args.image_size)
    world = dist_utils.world_size()
    if args.batch_size % world:
        raise ValueError(f"--batch-size {args.batch_size} must be divisible by the {world} DDP processes")
    run = TrainingRun(args=args, recipe=recipe, device=torch.device(args.device), world=world,
                      rank=dist_utils.rank(), output_dir=Path(args.output_dir))
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    # Each rank draws different augmentations; the model's initial weights are rank 0's (DDP broadcasts them).
    torch.manual_seed(args.seed + run.rank)
    _build_data(run)
    _build_training(run)
    if args.resume:
        checkpoint = _restore(run, checkpoint)

    log = None
    if run.main_process:
        run.output_dir.mkdir(parents=True, exist_ok=True)
        log = EpochLog(run.output_dir, args.tensorboard, append=bool(args.resume))
        (run.output_dir / "args.json").write_text(json.dumps(vars(args), indent=2, default=str))
        print(f"{label}: {_describe_run(run)}" if label else _describe_run(run), flush=True)
    try:
        finished = _train_epochs(run, checkpoint, log, label)
    finally:
        if log is not None:
            log.close()
    return _final_report(run, label, started) if finished else None
