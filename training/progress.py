"""What a run shows and writes while it trains: the per-epoch progress on stderr and the per-epoch log files
(``log.csv``, ``log.jsonl``, TensorBoard)."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path


class EpochProgress:
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
