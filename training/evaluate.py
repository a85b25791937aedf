"""Calibration report of a trained checkpoint: fit T on the validation split, pre-T / post-T table of the test split.

    python -m training.evaluate --checkpoint runs/digits-bsce_gra/checkpoint.pt
    python -m training.evaluate --checkpoint runs/c10/checkpoint.pt --data-root ~/data --output-dir runs/c10/eval

The splits are rebuilt from the checkpoint's recipe and seed (so validation and test are the very images the run held
out), the temperature is fitted for ECE on validation, and accuracy, ECE, AdaECE, classwise ECE, MCE, NLL and Brier
score of the test split are printed and written as ``report.json`` with reliability diagrams
``reliability_pre_T.png`` / ``reliability_post_T.png``. The post-hoc calibrators of ``--posthoc`` (default: vector and
matrix scaling, Dirichlet calibration, histogram binning, isotonic regression; ``none`` to skip) are fitted on the
same validation split and reported beside post-T (``report.json`` key ``"posthoc"``, a second printed table).
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from pathlib import Path

import torch
from torch.utils.data import DataLoader

from .arguments import CliArgumentParser, check_device, print_error
from .checkpoint import load_model_from_checkpoint
from .data import DataError, build_datasets
from .recipes import get_recipe
from .report import POSTHOC, calibration_report, collect_logits, format_report, save_report


def posthoc_names(text: str) -> tuple:
    """``--posthoc`` value: comma-separated names of ``calibkernels.calibration.POSTHOC_METHODS``, or ``none``."""
    import calibkernels as ck

    if text.strip().lower() == "none":
        return ()
    names = tuple(name.strip() for name in text.split(",") if name.strip())
    unknown = [name for name in names if name not in ck.calibration.POSTHOC_METHODS]
    if unknown or not names:
        raise argparse.ArgumentTypeError(f"unknown post-hoc calibrator(s) {unknown or [text]}; choose from "
                                         f"{', '.join(ck.calibration.POSTHOC_METHODS)} or none")
    return names


def get_args_parser(add_help: bool = True) -> argparse.ArgumentParser:

    parser = CliArgumentParser(description=__doc__.splitlines()[0], add_help=add_help,
                             formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="checkpoint.pt written by training.train")
    parser.add_argument("--data-root", default=None, help="dataset folder (default: the one the run used)")
    parser.add_argument("--output-dir", default=None, help="default: the checkpoint's folder")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--n-bins", type=int, default=15)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--posthoc", type=posthoc_names, default=",".join(POSTHOC), metavar="NAMES",
                        help="post-hoc calibrators fitted on validation and reported beside post-T (comma-separated, "
                             "or none)")
    return parser


def rebuild_splits(saved: dict, data_root=None, seed: int | None = None):
    """The splits a run trained and was evaluated on, from its checkpoint's ``args`` (``saved``): its recipe at its
    ``--image-size``, its seed (unless ``seed`` is given), its meta split (which the meta methods carve out of train)
    and its synthetic images, from ``data_root`` or else the run's ``--data-root``."""
    if "recipe" not in saved:
        raise ValueError("the checkpoint's args have no 'recipe'; was it written by python -m training.train?")
    recipe = get_recipe(saved["recipe"])
    if saved.get("image_size"):
        recipe = dataclasses.replace(recipe, image_size=int(saved["image_size"]))
    data_root = data_root if data_root is not None else saved.get("data_root")
    meta_fraction = float(saved.get("meta_fraction") or 0.0) if saved.get("method", "standard") != "standard" else 0.0
    seed = int(saved.get("seed", 0)) if seed is None else int(seed)
    return build_datasets(recipe, data_root, seed, meta_fraction=meta_fraction,
                          synthetic_size=saved.get("synthetic_size") if saved.get("synthetic") else None)


def main(args) -> dict:

    check_device(args.device)
    device = torch.device(args.device)
    model, checkpoint = load_model_from_checkpoint(args.checkpoint, map_location="cpu")
    model.to(device)
    saved = checkpoint["args"]
    splits = rebuild_splits(saved, args.data_root)
    amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, None: None}[saved.get("amp")]
    loaders = [DataLoader(split, batch_size=args.batch_size, shuffle=False, num_workers=args.workers)
               for split in (splits.val, splits.test)]
    val_logits, val_labels = collect_logits(model, loaders[0], device, amp_dtype)
    test_logits, test_labels = collect_logits(model, loaders[1], device, amp_dtype)
    report = calibration_report(val_logits, val_labels, test_logits, test_labels, n_bins=args.n_bins,
                                posthoc=getattr(args, "posthoc", POSTHOC))
    report.update(recipe=saved["recipe"], loss=saved.get("loss"), method=saved.get("method", "standard"),
                  arch=saved["arch"], seed=saved["seed"],
                  epochs=int(checkpoint["epoch"]), checkpoint=str(args.checkpoint))
    output_dir = Path(args.output_dir) if args.output_dir else Path(args.checkpoint).resolve().parent
    method = saved.get('method', 'standard')
    title = f"{saved['recipe']} {saved.get('loss', '') if method == 'standard' else method}".strip()
    report = save_report(report, test_logits, test_labels, output_dir, title=title)
    print(format_report(report, title=f"== {title} (epoch {checkpoint['epoch']}): test calibration =="))
    print(f"wrote {output_dir / 'report.json'}, {output_dir / 'reliability_pre_T.png'}, "
          f"{output_dir / 'reliability_post_T.png'}")
    return report


def cli(argv=None) -> int:
    """Exit code 0, or 2 with one ``error: …`` line on stderr for a bad argument, device, data path or checkpoint."""

    args = get_args_parser().parse_args(argv)
    try:
        main(args)
    except (DataError, ValueError, OSError) as exc:
        return print_error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
