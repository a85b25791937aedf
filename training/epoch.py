"""One training epoch and one evaluation pass, and the pieces a resumable loop needs around them.

:func:`train_one_epoch` runs the optimiser steps of an epoch (mixing, AMP, clipping, the EMA, the meta methods' step);
:func:`evaluate` streams the calibration metrics of a loader; :class:`StopRequest` turns SIGTERM / SIGINT into a clean
stop after the current step; :class:`ResumableDistributedSampler` and :class:`MetaBatches` resume mid-epoch on the very
batches an uninterrupted run would have drawn.
"""

from __future__ import annotations

import signal
import time

import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

import calibkernels as ck
from calibkernels.loss_stats import top_label_stats

from . import distributed as dist_utils
from . import soft_targets

# --amp's autocast dtypes
AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}

class StopRequest:
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
    bf16/fp16 logits and accumulate in fp32); ``(logits, loss, stats)``, ``stats`` the loss's
    :class:`calibkernels.LossStats` where the criterion returns them (built with ``return_stats=True``), else
    ``None``. One function, so that ``--compile`` traces the model and the loss into one graph
    (:func:`compiled_forward_and_loss`)."""
    with torch.autocast(images.device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
        logits = model(images)
    out = criterion(logits, targets, **mix_kwargs)
    loss, stats = out if isinstance(out, tuple) else (out, None)
    return logits, loss, stats


def batch_top_label(logits, stats, targets):
    """``(confidence, correct)`` of a training batch for :meth:`calibkernels.metrics.CalibrationMeter.update_top_label`
    against the hard labels ``targets`` (a mixed batch's unmixed labels): from the loss's ``stats`` where it returned
    them (no pass over the logits), else from the ``logits`` (losses without statistics, the meta methods' step)."""
    if stats is None:
        logits = logits.detach()
        stats = top_label_stats(logits.reshape(-1, logits.shape[-1]), None, targets.shape)
    return stats.confidence, stats.prediction == targets


class TopLabelBuffer:
    """Batches' ``(confidence, correct)`` on their way to a :class:`calibkernels.metrics.CalibrationMeter`, handed
    to its ``update_top_label`` concatenated every ``flush_every`` batches (and by :meth:`flush`): one meter update
    (a dozen small ops) costs about as much as a small model's whole step on the CPU, so it is paid once per
    ``flush_every`` steps, for ``flush_every`` batches of rows held meanwhile."""

    def __init__(self, meter, flush_every: int = 64):
        self.meter, self.flush_every = meter, flush_every
        self._confidence: list[torch.Tensor] = []
        self._correct: list[torch.Tensor] = []

    def add(self, confidence: torch.Tensor, correct: torch.Tensor) -> None:
        self._confidence.append(confidence.reshape(-1))
        self._correct.append(correct.reshape(-1))
        if len(self._confidence) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if self._confidence:
            self.meter.update_top_label(torch.cat(self._confidence), torch.cat(self._correct))
            self._confidence.clear()
            self._correct.clear()


def compiled_forward_and_loss(fullgraph: bool):
    """:func:`forward_and_loss` under ``torch.compile``: the model and the loss in one graph; ``fullgraph=True``
    makes a graph break an error instead of a silent split (single-process runs; under DDP, its optimiser splits the
    graph at the gradient buckets). A mix's λ reaches it as a 0-dim tensor, so a new λ per batch is not a new
    graph."""
    return torch.compile(forward_and_loss, fullgraph=fullgraph)


def train_one_epoch(model, criterion, optimizer, loader, device, epoch, args, scaler, stop: StopRequest,
                    first_step: int = 0, meta=None, meta_iterator=None, ema=None,
                    step_forward=forward_and_loss, global_step: int = 0, progress=None, train_meter=None) -> dict:
    """One pass over ``loader`` (starting at batch ``first_step`` when resuming mid-epoch).

    With ``args.mixup_alpha`` / ``args.cutmix_alpha`` each batch is mixed with its reversal: compact form
    (``criterion(logits, target, mix_target=target.flip(0), mix_lambda=λ)``, :func:`training.soft_targets.mix_batch`)
    or, with ``args.mix_dense``, torchvision's ``MixUp``/``CutMix`` and dense targets. ``ema`` (an ``AveragedModel``)
    is updated after every ``args.model_ema_steps``-th optimiser step of the run, standard or meta step alike:
    ``global_step`` (the steps of the epochs before) keeps the count across epochs, so an epoch shorter than
    ``model_ema_steps`` still updates it and no epoch's last steps are skipped; during the warm-up epochs it keeps
    copying the weights (torchvision's reference does the same). ``step_forward``: the step's forward and loss
    (:func:`forward_and_loss`, or with ``--compile`` :func:`compiled_forward_and_loss`). ``progress``: a
    :class:`training.progress.RunProgress` told of every step (or None). ``train_meter``: a
    :class:`calibkernels.metrics.CalibrationMeter` fed every batch's top-label confidence and correctness
    (:func:`batch_top_label`, through a :class:`TopLabelBuffer` flushed by the epoch's end), without a
    synchronisation (or None).

    Returns ``{"loss", "accuracy", "samples", "images_per_s", "steps_done", "interrupted", "lr", "global_step"}``
    where ``loss`` is the mean per-sample training loss, merged over DDP ranks, ``lr`` the learning rate this epoch
    trained at and ``global_step`` the run's optimiser steps so far."""
    model.train()
    amp_dtype = AMP_DTYPES[args.amp]
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
    mixup_alpha, cutmix_alpha = getattr(args, "mixup_alpha", 0.0), getattr(args, "cutmix_alpha", 0.0)
    mixing = mixup_alpha > 0 or cutmix_alpha > 0
    dense_mixer = None
    train_top_label = TopLabelBuffer(train_meter) if train_meter is not None else None
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
            logits, stats = out.get("logits"), None
        else:
            loss_targets, mix_kwargs = targets, {}
            if dense_mixer is not None:
                images, loss_targets = dense_mixer(images, targets)
            elif mixing:
                images, partner, lam = soft_targets.mix_batch(images, mixup_alpha, cutmix_alpha)
                # λ as a device tensor (a fill, no copy from the host): a compiled step takes it as an input
                mix_kwargs = {"mix_target": targets[partner],
                              "mix_lambda": torch.full((), lam, dtype=torch.float32, device=device)}
            logits, loss, stats = step_forward(model, criterion, images, loss_targets, mix_kwargs, amp_dtype)
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
            confidence, hit = batch_top_label(logits, stats, targets)
            correct += hit.sum()
            if train_top_label is not None:
                train_top_label.add(confidence, hit)
        samples += images.shape[0]
        step += 1
        if progress is not None and progress.bar is not None:
            # the running loss only every 10th step: reading it waits for the device
            progress.step(loss_sum.item() / samples if step % 10 == 0 or step == total_steps else None, lr)
        if stop.requested():
            break
    if train_top_label is not None:
        train_top_label.flush()
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
    return stats


@torch.no_grad()
def evaluate(model, loader, device, args, n_bins: int = 15) -> dict:
    """Calibration metrics of ``loader`` via the streaming ``CalibrationMeter`` (merged exactly across DDP ranks;
    the loader's ``UnpaddedDistributedSampler`` counts every sample once)."""
    model.eval()
    amp_dtype = AMP_DTYPES[args.amp]
    meter = ck.metrics.CalibrationMeter(n_bins=n_bins)
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        if args.channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            logits = model(images)
        meter.update(logits.float(), targets.to(device))
    return {k: float(v) for k, v in meter.compute().items()}


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
