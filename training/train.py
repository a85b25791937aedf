"""Train a classifier with a calibration loss, then report its calibration before and after temperature scaling.

    python -m training.train                         # digits: cross-entropy, BSCE-GRA and FLSD-53, 3 seeds each
    python -m training.train --loss bsce_gra         # one loss, one seed
    python -m training.train --loss bsce_gra --seeds 3   # one loss, 3 seeds: mean ± std
    python -m training.train --compare cross_entropy,focal_loss:gamma=3,flsd   # 3 seeds each: mean ± std
    python -m training.train --recipe cifar10-resnet50 --loss bsce_gra --data-root ~/data --output-dir runs/c10
    torchrun --nproc_per_node=4 -m training.train --recipe cifar100-wrn26-10 --loss flsd --data-root ~/data
    python -m training.train --list-recipes
    python -m training.train --recipe cifar10-resnet110 --loss bsce_gra --synthetic   # random CIFAR-shaped images

The command line is :mod:`training.arguments` (parser, checks, ``--resume``'s settings) and :mod:`training.criterion`
(the loss spec); one run is :func:`training.loop.run_training`, its epochs :mod:`training.epoch`, its progress and log
files :mod:`training.progress`, its report :mod:`training.report`. This module runs the seeds and the losses of a
comparison and is the console entry point (:func:`cli`).

Per epoch a run writes ``log.csv`` / ``log.jsonl`` and an atomic ``checkpoint.pt`` (model, optimizer, scheduler,
GradScaler, epoch, RNG states); ``--resume`` continues bit-for-bit (same seed, ``--workers 0``) with the checkpoint's
settings, except the flags given again on its command line; SIGTERM/SIGINT saves a mid-epoch checkpoint and exits with
code 128 + the signal number (143 for SIGTERM). After the last epoch the temperature is fitted on the validation split
and the pre-T / post-T table of the test split is printed and saved (``report.json``, ``reliability_pre_T.png``,
``reliability_post_T.png``).

Batch size and loss reduction follow the recipe (docs/papers.md: the papers *sum* the loss over a batch of 128,
lr 0.1, clip 2). ``--batch-size`` is the global batch: under DDP each of K ranks takes batch/K and, for the sum
reduction, the loss is multiplied by K so that DDP's gradient averaging yields exactly the gradient of the global batch
sum.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

import torch

from . import distributed as dist_utils
from .arguments import (METHODS, SYNTHETIC_BATCHES, TRAIN_EXTRA, CliArgumentParser, args_from_checkpoint,
                        check_device, default_output_dir, explicit_options, get_args_parser, loss_tag, parse_args,
                        print_error, resolve_run_config)
from .checkpoint import load_checkpoint
from .criterion import build_criterion, check_loss_spec, loss_schedule, parse_loss_spec
from .data import DataError
from .epoch import (ResumableDistributedSampler, StopRequest, TrainingInterrupted, compiled_forward_and_loss,
                    evaluate, forward_and_loss, train_one_epoch)
from .loop import run_training
from .recipes import describe_recipes
from .report import aggregate_reports, format_aggregate, save_comparison

# The names the training command line has always offered here (tests, scripts and the studies import them from
# training.train); they live in the modules above.
__all__ = ["METHODS", "SYNTHETIC_BATCHES", "TRAIN_EXTRA", "CliArgumentParser", "DataError",
           "ResumableDistributedSampler", "StopRequest", "TrainingInterrupted", "args_from_checkpoint",
           "build_criterion", "check_device", "check_loss_spec", "cli", "compiled_forward_and_loss",
           "default_output_dir", "evaluate", "explicit_options", "forward_and_loss", "get_args_parser",
           "loss_schedule", "loss_tag", "main", "missing_train_extra", "parse_args", "parse_loss_spec",
           "resolve_run_config", "run_training", "train_one_epoch"]


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
        return _run_comparison(args, seeds)
    finally:
        dist_utils.cleanup()


def _run_comparison(args, seeds: list[int]) -> dict | None:
    """Train every loss of ``--compare`` with each of ``seeds``, in ``<output-dir>/<loss>[/seed<s>]/``; write the
    side-by-side table and the overlaid reliability diagrams (:func:`training.report.save_comparison`)."""
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
    if dist_utils.is_main_process():
        seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"seeds {seeds[0]}-{seeds[-1]}"
        print(f"{args.recipe}: {', '.join(specs)}; {seed_text} ({len(specs) * len(seeds)} runs) in {base}", flush=True)
    runs_done = 0
    for spec in specs:
        results = []
        for seed, run_args in zip(seeds, members[spec]):
            runs_done += 1
            label = f"[{runs_done}/{len(specs) * len(seeds)}] {spec} seed {seed}"
            results.append(run_training(run_args, label=label))
        if all(result is not None for result in results):
            if len(seeds) > 1:
                reports[spec] = _save_aggregate(results, base / loss_tag(spec), f"{args.recipe} {spec}", show=False)
                outputs[spec] = [(r["test_logits"], r["test_labels"]) for r in results]
            else:
                reports[spec] = results[0]["report"]
                outputs[spec] = (results[0]["test_logits"], results[0]["test_labels"])
    if dist_utils.is_main_process() and len(reports) == len(specs):
        saved = save_comparison(reports, outputs, base, n_bins=args.n_bins, title=args.recipe)
        seed_text = f"seed {seeds[0]}" if len(seeds) == 1 else f"mean ± std over seeds {seeds[0]}-{seeds[-1]}"
        print(f"\n== {args.recipe}: test split ({reports[specs[0]]['n_test']} samples), {seed_text}; T fitted for ECE "
              f"on the validation split; accuracy and ECE-type metrics in % ==")
        print(saved["table"])
        print(f"wrote {base / 'comparison.md'}, {base / 'comparison.json'}, {saved['figure']}, and each run's "
              f"report, reliability diagrams, log and checkpoint in {base}/<loss>/"
              f"{'seed<s>/' if len(seeds) > 1 else ''} ({time.perf_counter() - start:.0f} s)", flush=True)
        return {"reports": reports, **saved}
    return None


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


def _save_aggregate(results: list[dict], output_dir: Path, title: str, show: bool = True) -> dict:
    """Aggregate the seeds' reports (mean ± std) and write them as ``output_dir/report.json``; ``show``: print the
    table too."""
    report = aggregate_reports([result["report"] for result in results])
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / "report.json").write_text(json.dumps(report, indent=2))
    if show:
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
        results.append(run_training(run_args, label=f"[{len(results) + 1}/{len(seeds)}] seed {seed}"))
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
            return print_error(f"the training CLI needs the `train` extra ({', '.join(missing)} missing): {install}")
        main(args)
    except TrainingInterrupted as exc:
        return 128 + exc.signum
    except ModuleNotFoundError as exc:
        if (exc.name or "").split(".")[0] not in TRAIN_EXTRA:
            raise
        return print_error(f"the training CLI needs the `train` extra ({exc.name} missing): {install}")
    except (DataError, ValueError, OSError) as exc:
        return print_error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
