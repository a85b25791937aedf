"""What a run shows and writes while it trains: a progress bar on a terminal or one line per evaluation in a log
(:class:`RunProgress`), and the per-epoch log files (``log.csv``, ``log.jsonl``, TensorBoard; :class:`EpochLog`)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path


def format_loss(value: float) -> str:
    """A training loss with three significant digits, in exponent form when small (``3.2e-05``): an over-fitted
    run's loss is far below the ``0.0000`` a fixed number of decimals would print."""
    return f"{value:.3g}"


def _is_a_terminal(stream) -> bool:
    isatty = getattr(stream, "isatty", None)
    return bool(isatty and isatty())


class RunProgress:
    """What one run shows while it trains, on ``stream`` (stdout).

    On a terminal: one tqdm bar over the run's optimiser steps, whose postfix carries the running training loss, the
    lr and, after each evaluation, the validation accuracy and ECE; it is removed when the run ends. Elsewhere (a log
    file, a pipe, CI), or with ``bar=False`` (``--no-progress``): no bar, whose redraws would fill a log, but one line
    per evaluation (every ``log_every``-th evaluation, and always the last epoch's), none for the epochs in between.
    ``label`` (a comparison's member) starts each line and names the bar. Only rank 0 shows anything (``enabled``).
    """

    def __init__(self, epochs: int, steps_per_epoch: int, start_epoch: int = 0, first_step: int = 0, *,
                 label: str | None = None, enabled: bool = True, bar: bool = True, log_every: int = 1, stream=None):
        self.epochs, self.label, self.log_every = epochs, label, max(1, int(log_every))
        self.enabled, self.stream = enabled, stream if stream is not None else sys.stdout
        self.evaluations = 0
        self._postfix = {"loss": "", "lr": "", "val": ""}
        self.bar = None
        if enabled and bar and _is_a_terminal(self.stream):
            from tqdm import tqdm

            self.bar = tqdm(total=epochs * steps_per_epoch, initial=start_epoch * steps_per_epoch + first_step,
                            desc=label or "training", file=self.stream, leave=False, dynamic_ncols=True,
                            unit="step")

    def step(self, mean_loss: float | None = None, lr: float | None = None) -> None:
        """One optimiser step done; ``mean_loss`` (the epoch's running mean per sample) and ``lr`` when known."""
        if self.bar is None:
            return
        if mean_loss is not None:
            self._postfix.update(loss=f"loss {format_loss(mean_loss)}", lr=f"lr {lr:.3g}")
            self.bar.set_postfix_str("  ".join(text for text in self._postfix.values() if text), refresh=False)
        self.bar.update(1)

    def epoch_done(self, epoch: int, stats: dict, val: dict) -> None:
        """After epoch ``epoch`` (0-based) with its training ``stats`` and, on an evaluation epoch, the validation
        metrics ``val`` (empty otherwise)."""
        if self.bar is not None:
            self.bar.set_description(f"{self.label or 'training'} (epoch {epoch + 1}/{self.epochs})", refresh=False)
            if val:
                self._postfix["val"] = f"val acc {100 * val['accuracy']:.1f}% ECE {100 * val['ece']:.2f}%"
            return
        if not self.enabled or not val:
            return
        self.evaluations += 1
        if self.evaluations % self.log_every and epoch + 1 != self.epochs:
            return
        # the training batches' ECE since the previous evaluation, from the loss's statistics (when it gave them)
        train_ece = f"ECE {100 * stats['batch_ece']:.2f}%  " if "batch_ece" in stats else ""
        line = (f"epoch {epoch + 1:{len(str(self.epochs))}d}/{self.epochs}  train loss {format_loss(stats['loss'])}  "
                f"acc {100 * stats['accuracy']:.2f}%  {train_ece}lr {stats['lr']:.3g}  "
                f"{stats['images_per_s']:.0f} img/s  "
                f"val acc {100 * val['accuracy']:.2f}%  ECE {100 * val['ece']:.2f}%  NLL {val['nll']:.4g}")
        print(f"{self.label}  {line}" if self.label else line, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


class EpochLog:
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


def truncate_log(output_dir: Path, completed_epochs: int) -> None:
    """On resume, drop log rows of epochs after the checkpoint (they will be trained again)."""
    for path in (output_dir / "log.csv", output_dir / "log.jsonl"):
        if not path.is_file():
            continue
        lines = path.read_text().splitlines(keepends=True)
        header = lines[:1] if path.suffix == ".csv" else []
        rows = lines[len(header):]
        path.write_text("".join(header + rows[:completed_epochs]))
