"""The training batches' accuracy and ECE that calib-train logs at each evaluation (``train_batch_accuracy``,
``train_batch_ece`` in log.csv, log.jsonl and TensorBoard), taken from the loss's top-label statistics
(``return_stats=True``) and reset at each evaluation: they must equal a ``CalibrationMeter`` fed the training logits.

Runs are a few optimiser steps of the embedded ``digits`` recipe (its small CNN, one thread).
"""

from __future__ import annotations

import csv
import json
import math

import pytest
import torch

import calibkernels as ck
from training import loop as training_loop
from training import train

FAST = ["--no-progress", "--workers", "0", "--threads", "1"]


def _recording_criterion(monkeypatch, calls: list):
    """Make the run's loss record each step's logits and targets (as the loss saw them) in ``calls``."""
    real_build = training_loop.build_criterion

    def build_and_record(*args, **kwargs):
        criterion = real_build(*args, **kwargs)
        forward = criterion.forward

        def recording_forward(logits, target, *rest, **kw):
            calls.append((logits.detach().float().clone(), target.clone()))
            return forward(logits, target, *rest, **kw)

        criterion.forward = recording_forward
        return criterion

    monkeypatch.setattr(training_loop, "build_criterion", build_and_record)


def _rows(output_dir):
    with (output_dir / "log.csv").open() as handle:
        csv_rows = list(csv.DictReader(handle))
    json_rows = [json.loads(line) for line in (output_dir / "log.jsonl").read_text().splitlines()]
    return csv_rows, json_rows


def _meter_of(calls):
    meter = ck.metrics.CalibrationMeter(n_bins=15)
    for logits, target in calls:
        meter.update(logits, target)
    return meter.compute()


@pytest.mark.parametrize("loss", ["bsce_gra", "mmce"])  # with the loss's statistics, and from the logits
def test_train_batch_metrics_equal_a_meter_fed_the_logits(tmp_path, monkeypatch, loss):
    calls = []
    _recording_criterion(monkeypatch, calls)
    out = tmp_path / "run"
    train.main(train.parse_args(["--loss", loss, "--epochs", "3", "--max-steps-per-epoch", "2", "--eval-every", "2",
                                 "--output-dir", str(out)] + FAST))
    assert len(calls) == 6
    csv_rows, json_rows = _rows(out)
    assert len(csv_rows) == len(json_rows) == 3
    for row in csv_rows + json_rows:
        assert {"train_batch_accuracy", "train_batch_ece"} <= set(row), sorted(row)
    # no evaluation after epoch 1; epoch 2's covers the batches of epochs 1 and 2, epoch 3's (the last) epoch 3's
    assert math.isnan(float(csv_rows[0]["train_batch_ece"])) and math.isnan(json_rows[0]["train_batch_accuracy"])
    for index, period in ((1, calls[:4]), (2, calls[4:])):
        want = _meter_of(period)
        for rows in (csv_rows, json_rows):
            assert float(rows[index]["train_batch_accuracy"]) == want["accuracy"]
            assert float(rows[index]["train_batch_ece"]) == pytest.approx(want["ece"], rel=1e-5, abs=1e-7)
    # with one evaluation per epoch the period is the epoch: the accuracy is the epoch's training accuracy
    assert float(csv_rows[2]["train_batch_accuracy"]) == pytest.approx(float(csv_rows[2]["train_accuracy"]))


def test_criterion_returns_the_stats_only_where_the_run_asks_for_them():
    assert isinstance(train.build_criterion("bsce_gra", "mean", "auto", return_stats=True)(
        torch.randn(4, 3), torch.tensor([0, 1, 2, 0])), tuple)
    assert isinstance(train.build_criterion("bsce_gra", "mean", "auto")(torch.randn(4, 3), torch.tensor([0, 1, 2, 0])),
                      torch.Tensor)
    # losses without a functional call return the loss alone
    assert isinstance(train.build_criterion("brier_loss", "mean", "auto", return_stats=True)(
        torch.randn(4, 3), torch.tensor([0, 1, 2, 0])), torch.Tensor)
    with pytest.raises(ValueError, match="return_stats"):
        train.build_criterion("bsce_gra:return_stats=True", "mean", "auto")


def test_train_batch_metrics_reach_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out = tmp_path / "tb-run"
    train.main(train.parse_args(["--loss", "cross_entropy", "--epochs", "1", "--max-steps-per-epoch", "1",
                                 "--tensorboard", "--output-dir", str(out)] + FAST))
    events = EventAccumulator(str(out / "tb"))
    events.Reload()
    assert {"train_batch_accuracy", "train_batch_ece"} <= set(events.Tags()["scalars"])


def test_model_and_loss_with_stats_trace_into_one_graph():
    """--compile's step (fullgraph=True for the fused family) holds the statistics too, without a graph break."""
    from torch._dynamo import explain

    from training.models import build_model

    model = build_model("small_cnn", 10, in_channels=1)
    criterion = train.build_criterion("bsce_gra", "mean", "auto", return_stats=True)
    images, targets = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    report = explain(train.forward_and_loss)(model, criterion, images, targets, {}, None)
    assert report.graph_count == 1 and report.graph_break_count == 0, report.break_reasons
