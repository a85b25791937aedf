"""The training command line as a user and a batch scheduler meet it: every error is one ``error:`` line on stderr with
exit code 2 and leaves no run folder behind, ``--resume`` honours the flags given on its command line, a missing
``train`` extra is named, progress is a bar on a terminal and one line per evaluation in a log (SIGTERM's exit code 143
is checked by tests/test_training.py's SIGTERM test).

Runs are one or two optimiser steps of the embedded ``digits`` recipe (its small CNN, one thread).
"""

from __future__ import annotations

import csv
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from training import checkpoint as ckpt_utils
from training import train
from training.progress import RunProgress, format_loss

ROOT = Path(__file__).resolve().parents[1]
FAST = ["--no-progress", "--workers", "0", "--threads", "1"]


def _one_error_line(err: str) -> str:
    """The single line of stderr, which must start with ``error:``."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def _log_rows(output_dir: Path) -> list[dict]:
    with (output_dir / "log.csv").open() as handle:
        return list(csv.DictReader(handle))


def _stopped_run(output_dir: Path, *extra) -> Path:
    """A digits run of 2 epochs (one step each) stopped after its first epoch; returns its checkpoint."""
    assert train.cli(["--loss", "bsce_gra", "--epochs", "2", "--max-steps-per-epoch", "1", "--stop-after", "1",
                      "--output-dir", str(output_dir), *extra] + FAST) == 0
    return output_dir / "checkpoint.pt"


# ------------------------------------------------------------------------------------------------------------ resume
def test_resume_trains_with_the_lr_given_on_its_command_line(tmp_path, capsys):
    checkpoint = _stopped_run(tmp_path / "run")
    capsys.readouterr()
    assert train.cli(["--resume", str(checkpoint), "--lr", "0.2", "--output-dir", str(tmp_path / "run")] + FAST) == 0
    assert "lr 0.2," in capsys.readouterr().out
    rows = _log_rows(tmp_path / "run")
    assert [float(row["lr"]) for row in rows] == [0.05, 0.2]  # digits: constant lr 0.05, then the new one
    saved = ckpt_utils.load_checkpoint(checkpoint)
    assert [group["lr"] for group in saved["optimizer"]["param_groups"]] == [0.2]
    assert saved["scheduler"]["base_lrs"] == [0.2] and saved["args"]["lr"] == 0.2


def test_resume_keeps_the_checkpoint_settings_not_given_again(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a default runs/ folder would land here, not in the checkout
    checkpoint = _stopped_run(tmp_path / "run", "--lr", "0.2", "--seed", "3")
    capsys.readouterr()
    # Neither --lr, --epochs nor --max-steps-per-epoch again: the run continues with the checkpoint's values, and
    # without --output-dir it writes next to its checkpoint.
    assert train.cli(["--resume", str(checkpoint)] + FAST) == 0
    assert "2 epochs, batch 50, lr 0.2," in capsys.readouterr().out
    assert [float(row["lr"]) for row in _log_rows(tmp_path / "run")] == [0.2, 0.2]
    saved = ckpt_utils.load_checkpoint(checkpoint)
    assert (saved["epoch"], saved["args"]["seed"], saved["args"]["max_steps_per_epoch"]) == (2, 3, 1)


def test_resume_with_a_new_lr_during_the_warmup_scales_every_phase(tmp_path):
    checkpoint = _stopped_run(tmp_path / "run", "--epochs", "3", "--warmup-epochs", "2")
    assert train.cli(["--resume", str(checkpoint), "--lr", "0.01"] + FAST) == 0
    # the warm-up's ramp (0.01, 0.505, then 1 × the base) with base 0.05, then 0.01 from the resumed epoch on
    assert [float(row["lr"]) for row in _log_rows(tmp_path / "run")] == pytest.approx([0.0005, 0.00505, 0.01])


def test_resume_with_more_epochs_re_times_the_cosine_after_the_warmup(tmp_path):
    run = ["--loss", "bsce_gra", "--recipe", "imagenet-resnet50-finetune-tvnew", "--synthetic", "--arch", "small_cnn",
           "--image-size", "8", "--synthetic-size", "64", "--batch-size", "32", "--max-steps-per-epoch", "1",
           "--warmup-epochs", "1", "--output-dir", str(tmp_path / "run")] + FAST
    assert train.cli(run + ["--epochs", "4", "--stop-after", "2"]) == 0
    assert train.cli(["--resume", str(tmp_path / "run" / "checkpoint.pt"), "--epochs", "8"] + FAST) == 0
    lrs = [float(row["lr"]) for row in _log_rows(tmp_path / "run")]
    assert len(lrs) == 8 and lrs[1] == pytest.approx(0.5)  # warm-up epoch 1, then the cosine from the base lr
    # from the lr it had reached, the cosine now falls to 0 at the new last epoch instead of climbing back up
    assert all(later < earlier for earlier, later in zip(lrs[1:], lrs[2:])) and 0 < lrs[-1] < 0.05, lrs


def test_resume_refuses_to_change_the_warmup_in_one_clear_line(tmp_path, capsys):
    checkpoint = _stopped_run(tmp_path / "run")
    capsys.readouterr()
    assert train.cli(["--resume", str(checkpoint), "--warmup-epochs", "1"] + FAST) == 2
    line = _one_error_line(capsys.readouterr().err)
    assert "warm-up" in line and "_schedulers" not in line


def test_resume_that_adds_columns_rewrites_the_log_under_one_header(tmp_path):
    checkpoint = _stopped_run(tmp_path / "run", "--epochs", "3")
    assert train.cli(["--resume", str(checkpoint), "--model-ema", "--model-ema-steps", "1", "--stop-after", "1"]
                     + FAST) == 0
    assert train.cli(["--resume", str(checkpoint), "--no-model-ema"] + FAST) == 0
    with (tmp_path / "run" / "log.csv").open() as handle:
        header, *rows = list(csv.reader(handle))
    assert "val_ema_ece" in header and [len(row) for row in rows] == [len(header)] * 3
    by_epoch = _log_rows(tmp_path / "run")
    assert [row["val_ema_ece"] == "" for row in by_epoch] == [True, False, True]  # blank where it has no value
    assert all(None not in row for row in by_epoch)  # no value beyond the header


def test_resume_refuses_a_different_seed(tmp_path, capsys):
    checkpoint = _stopped_run(tmp_path / "run")
    capsys.readouterr()
    assert train.cli(["--resume", str(checkpoint), "--seed", "1"] + FAST) == 2
    assert "seed" in _one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize("batch_size", [25, 200])
def test_mid_epoch_checkpoint_with_another_batch_size_is_refused_in_one_line(tmp_path, capsys, batch_size):
    checkpoint = _stopped_run(tmp_path / "run", "--batch-size", "50", "--max-steps-per-epoch", "4")
    state = ckpt_utils.load_checkpoint(checkpoint)
    state.update(epoch=1, batches_done=3)  # as if SIGTERM had come after the third of four batches of epoch 2
    ckpt_utils.save_checkpoint(state, checkpoint)
    capsys.readouterr()
    rc = train.cli(["--resume", str(checkpoint), "--batch-size", str(batch_size)] + FAST)
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and "--batch-size 50" in line and "mid-epoch" in line


@pytest.mark.parametrize("content", ["truncated", "empty", "random", "tensor"])
def test_unreadable_checkpoint_is_one_error_line(tmp_path, capsys, content):
    checkpoint = _stopped_run(tmp_path / "run")
    data = checkpoint.read_bytes()
    bad = tmp_path / "bad.pt"
    if content == "tensor":
        torch.save(torch.zeros(3), bad)
    else:
        bad.write_bytes({"truncated": data[:len(data) // 2], "empty": b"",
                         "random": os.urandom(4096)}[content])
    capsys.readouterr()
    assert train.cli(["--resume", str(bad), "--output-dir", str(tmp_path / "new")] + FAST) == 2
    assert str(bad) in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "new").exists()


# ---------------------------------------------------------------------------------------- errors, one line, no folder
# The case, its arguments and a text its error line must hold.
BAD_ARGUMENTS = {
    "output-dir-is-a-file": (["--output-dir", "{tmp}/a-file"], "a-file"),
    "threads-0": (["--threads", "0"], "--threads"),
    "loss-typo": (["--loss", "focal_loss:gama=2"], "gama"),
    "missing-data": (["--recipe", "cifar10-resnet110", "--data-root", "{tmp}/nowhere"], "cifar-10-batches-py"),
    "n-bins-0": (["--n-bins", "0"], "--n-bins"),
    "log-every-0": (["--log-every", "0"], "--log-every"),
    "workers-negative": (["--workers", "-1"], "--workers"),
    "backend-cuda-on-cpu": (["--backend", "cuda", "--device", "cpu"], "--backend cuda cannot run on --device cpu"),
    "device-typo": (["--device", "nope"], "--device 'nope'"),
    "pretrained-for-small-cnn": (["--pretrained", "{tmp}/nowhere.pth"], "'small_cnn' takes no pretrained"),
    "loss-bool-as-text": (["--loss", "bsce_gra:inplace=no"], "inplace"),
    "loss-float-index": (["--loss", "bsce_gra:ignore_index=1.5"], "ignore_index"),
    "loss-backend": (["--loss", "bsce_gra:backend=reference"], "--backend reference"),
    "loss-reduction": (["--loss", "bsce_gra:reduction=none"], "the recipe sets the reduction"),
    "lr-inf": (["--lr", "inf"], "--lr must be finite"),
    "lr-nan": (["--lr", "nan"], "--lr must be finite"),
    "meta-lr-inf": (["--method", "meta-sece", "--meta-lr", "inf"], "--meta-lr must be finite"),
    "meta-init-gamma-0": (["--method", "meta-sece", "--meta-init-gamma", "0"], "--meta-init-gamma"),
    "meta-bandwidth-0": (["--method", "meta-sece", "--meta-bandwidth", "0"], "--meta-bandwidth"),
    "meta-dece-bins-0": (["--method", "meta-dece", "--meta-dece-bins", "0"], "--meta-dece-bins"),
    "meta-lookahead-lr-nan": (["--method", "meta-sece", "--meta-lookahead-lr", "nan"], "--meta-lookahead-lr"),
    "meta-batch-size-0": (["--method", "meta-sece", "--meta-batch-size", "0"], "--meta-batch-size"),
    "meta-fraction-0": (["--method", "meta-sece", "--meta-fraction", "0"], "--meta-fraction"),
    "vit-image-size": (["--recipe", "cifar10-vit-b16-finetune", "--synthetic", "--image-size", "40"],
                       "multiple of 16"),
    "image-size-digits": (["--image-size", "16"], "--image-size"),
    "compare-twice": (["--compare", "bsce_gra, bsce_gra", "--seeds", "1"], "'bsce_gra' twice"),
    "compare-resume": (["--compare", "bsce_gra,cross_entropy", "--resume", "{tmp}/a-file"],
                       "resume a --compare member"),
}


@pytest.mark.parametrize("case", list(BAD_ARGUMENTS))
def test_bad_arguments_are_one_error_line_and_leave_no_run_folder(tmp_path, capsys, case):
    out = tmp_path / "runs" / "x"
    argv, expected = BAD_ARGUMENTS[case]
    argv = [arg.format(tmp=tmp_path) for arg in argv]
    (tmp_path / "a-file").write_text("not a folder")
    rc = train.cli(["--epochs", "1", "--max-steps-per-epoch", "1", "--no-progress", "--output-dir", str(out)] + argv)
    assert rc == 2 and expected in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_cuda_device_without_a_gpu_is_one_error_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    rc = train.cli(["--device", "cuda", "--output-dir", str(tmp_path / "run")] + FAST)
    assert rc == 2 and "CUDA is not available" in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device, expected", [("cuda", "CUDA is not available"), ("cpu:7x", "not a device")])
def test_evaluate_with_a_bad_device_is_one_error_line(tmp_path, capsys, monkeypatch, device, expected):
    from training import evaluate

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    checkpoint = _stopped_run(tmp_path / "run")
    capsys.readouterr()
    assert evaluate.cli(["--checkpoint", str(checkpoint), "--device", device]) == 2
    assert expected in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "run" / "report.json").exists()


@pytest.mark.parametrize("content", ["random", "empty"])
def test_unreadable_pretrained_weights_are_one_error_line(tmp_path, capsys, content):
    weights = tmp_path / "resnet50.pth"
    weights.write_bytes(os.urandom(2048) if content == "random" else b"")
    rc = train.cli(["--recipe", "imagenet-resnet50-finetune", "--synthetic", "--synthetic-size", "4", "--batch-size",
                    "2", "--image-size", "32", "--pretrained", str(weights), "--output-dir", str(tmp_path / "run")]
                   + FAST)
    line = _one_error_line(capsys.readouterr().err)
    assert rc == 2 and str(weights) in line and "not a readable" in line
    assert not (tmp_path / "run").exists()


def test_a_new_run_in_an_old_folder_starts_new_logs(tmp_path):
    run = ["--loss", "bsce_gra", "--epochs", "1", "--max-steps-per-epoch", "1", "--output-dir", str(tmp_path / "run")]
    run += FAST
    assert train.cli(run + ["--model-ema"]) == 0
    assert train.cli(run) == 0  # other options, other columns
    rows = _log_rows(tmp_path / "run")
    assert [row["epoch"] for row in rows] == ["1"] and not any(key.startswith("val_ema") for key in rows[0])
    assert len((tmp_path / "run" / "log.jsonl").read_text().splitlines()) == 1


def test_argument_parser_errors_are_one_line(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.cli(["--threads", "two"])
    assert exit_info.value.code == 2
    assert "--threads" in _one_error_line(capsys.readouterr().err)


# ------------------------------------------------------------------------------------------ missing extra, progress
def _run(code_or_args, tmp_path, **kwargs):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, *code_or_args], cwd=ROOT, env=env, timeout=600, **kwargs)


def test_missing_train_extra_names_the_install_command(tmp_path):
    code = ("import sys; sys.modules['tqdm'] = None\n"  # `import tqdm` now fails as if tqdm were not installed
            "from training.train import cli\n"
            f"sys.exit(cli(['--epochs', '1', '--output-dir', {str(tmp_path / 'run')!r}]))\n")
    result = _run(["-c", code], tmp_path, capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    line = _one_error_line(result.stderr)
    assert 'pip install "calibkernels[train]"' in line and "tqdm" in line
    assert not (tmp_path / "run").exists()


def test_a_backend_that_cannot_run_on_the_device_is_one_error_line(tmp_path):
    # In a process of its own, without the Triton interpreter that tests/conftest.py turns on for CPU-only machines.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "training.train", "--backend", "triton", "--device", "cpu",
                             "--output-dir", str(tmp_path / "run")] + FAST, cwd=ROOT, env=env, timeout=600,
                            capture_output=True, text=True)
    assert result.returncode == 2, result.stderr
    assert "--backend triton cannot run on --device cpu" in _one_error_line(result.stderr)
    assert not (tmp_path / "run").exists()


def test_progress_in_a_log_is_one_line_per_evaluation(tmp_path):
    """stdout a file: no bar, one line per evaluation (epochs 2 and 4 of 4 with --eval-every 2), none per epoch,
    nothing on stderr; the training loss with significant digits, not a fixed number of decimals."""
    out_path, err_path = tmp_path / "stdout.txt", tmp_path / "stderr.txt"
    with out_path.open("w") as out, err_path.open("w") as err:
        result = _run(["-m", "training.train", "--loss", "cross_entropy", "--epochs", "4", "--eval-every", "2",
                       "--max-steps-per-epoch", "2", "--workers", "0", "--output-dir", str(tmp_path / "run")],
                      tmp_path, stdout=out, stderr=err)
    text, errors = out_path.read_bytes().decode(), err_path.read_bytes().decode()  # bytes: keep any "\r"
    assert result.returncode == 0, text + errors
    assert "\r" not in text + errors and "\x1b" not in text + errors  # no bar redrawn in place, no escapes
    progress = [line for line in text.splitlines() if line.startswith("epoch ")]
    assert [line.split()[1] for line in progress] == ["2/4", "4/4"], text
    for line in progress:
        loss = line.split("train loss ")[1].split()[0]
        assert float(loss) > 0 and loss == format_loss(float(loss)), line  # three significant digits
    assert "epoch" not in errors, errors


class _Terminal(io.StringIO):
    def isatty(self):
        return True


STATS = {"loss": 3.2e-05, "accuracy": 1.0, "lr": 0.05, "images_per_s": 1000.0}
VAL = {"accuracy": 0.9, "ece": 0.031, "nll": 0.25}


def test_run_progress_on_a_terminal_is_one_bar_and_no_lines():
    stream = _Terminal()
    progress = RunProgress(4, 3, label="cross_entropy seed 0", stream=stream)
    assert progress.bar is not None
    for epoch in range(4):
        for _ in range(3):
            progress.step(STATS["loss"], STATS["lr"])
        progress.epoch_done(epoch, STATS, VAL if epoch % 2 else {})
    progress.bar.refresh()
    text = stream.getvalue()
    progress.close()
    assert "\r" in text and "cross_entropy seed 0" in text and "loss 3.2e-05" in text and "ECE 3.10%" in text
    assert "train loss" not in text  # no log lines under the bar


def test_run_progress_in_a_log_prints_every_nth_evaluation_and_the_last():
    stream = io.StringIO()
    progress = RunProgress(7, 3, label="[2/9] bsce_gra seed 1", stream=stream, log_every=2)
    assert progress.bar is None
    for epoch in range(7):
        progress.step(1.0, 0.05)
        progress.epoch_done(epoch, STATS, VAL if epoch in (0, 2, 4, 6) else {})
    lines = stream.getvalue().splitlines()
    assert [line.split("epoch ")[1].split()[0] for line in lines] == ["3/7", "7/7"]  # evaluations 2 and 4 (last)
    assert all(line.startswith("[2/9] bsce_gra seed 1  epoch") for line in lines)
    assert "train loss 3.2e-05" in lines[0] and "ECE 3.10%" in lines[0]
    assert RunProgress(7, 3, stream=_Terminal(), bar=False).bar is None  # --no-progress: lines, as in a log


def test_losses_print_with_significant_digits():
    assert [format_loss(value) for value in (3.2e-05, 1.23456, 0.000123456, 12.5)] == ["3.2e-05", "1.23",
                                                                                       "0.000123", "12.5"]


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_help_with_a_meta_method_lists_the_meta_options(flag, capsys):
    """The --meta-* options exist only with --method meta-*; the help of such a command line lists them (the first
    parsing pass, which reads --method, must not answer the help request itself)."""
    with pytest.raises(SystemExit) as stop:
        train.parse_args(["--method", "meta-sece", flag])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert "--meta-k" in out and "--meta-lr" in out
    with pytest.raises(SystemExit):
        train.parse_args([flag])
    assert "--meta-k" not in capsys.readouterr().out
