"""The calibration report with post-hoc calibrators beside temperature scaling (training/report.py) and the
``--posthoc`` option of ``training.evaluate``: the pre-T / post-T part is unchanged, each calibrator is fitted on the
validation split and measured on the test split, and the printed and saved reports carry them."""

from __future__ import annotations

import json
import math

import pytest
import torch

import calibkernels as ck
from training import evaluate as evaluate_cli
from training import train
from training.report import METRICS, POSTHOC, calibration_report, format_report, posthoc_metrics, save_report

FAST = ["--no-progress", "--workers", "0", "--threads", "1"]


def _splits(seed=0, n_val=600, n_test=500, c=6):
    """Over-confident float32 logits (labels drawn from softmax(z / 3)) for a validation and a test split, drawn from
    a generator seeded with ``seed``."""
    generator = torch.Generator().manual_seed(seed)
    z = torch.randn(n_val + n_test, c, generator=generator) * 6
    labels = torch.multinomial(torch.softmax(z / 3, dim=1), 1, generator=generator).squeeze(1)
    return z[:n_val], labels[:n_val], z[n_val:], labels[n_val:]


def test_report_without_posthoc_is_unchanged():
    report = calibration_report(*_splits())
    assert set(report) == {"temperature", "n_val", "n_test", "n_bins", "pre_T", "post_T"}
    assert "post-hoc" not in format_report(report)


# Seed 718: its isotonic fit gives one test sample the confidence 3/5 exactly, the edge 9/15 of the ECE's bins.
@pytest.mark.parametrize("seed", [0, 718])
def test_posthoc_rows_are_each_calibrator_fitted_on_validation_and_measured_on_test(seed):
    val_logits, val_labels, test_logits, test_labels = _splits(seed)
    plain = calibration_report(val_logits, val_labels, test_logits, test_labels)
    report = calibration_report(val_logits, val_labels, test_logits, test_labels, posthoc=POSTHOC)
    for key in ("temperature", "pre_T", "post_T"):
        assert report[key] == plain[key]
    assert list(report["posthoc"]) == list(POSTHOC)
    for name, values in report["posthoc"].items():
        assert set(values) == set(METRICS)
        calibrator = ck.calibration.POSTHOC_METHODS[name]().fit(val_logits, val_labels)
        # Measured as the report measures it, from the calibrated log-probabilities. A confidence exactly on a bin edge
        # (isotonic regression's block means, such as 3/5 = 9/15) falls on one side of it or the other by its last
        # bit, and the float32 probabilities of transform() and the metrics' softmax of log_transform() differ there.
        log_probabilities = calibrator.log_transform(test_logits)
        assert values["ece"] == pytest.approx(ck.metrics.ece(log_probabilities, test_labels, inputs_are="logits"),
                                              abs=1e-6)
        assert values["accuracy"] == pytest.approx(
            float((log_probabilities.argmax(1) == test_labels).double().mean()), abs=1e-12)
        if name in ("vector", "matrix", "dirichlet"):
            assert math.isfinite(values["nll"])
            assert values["nll"] < report["pre_T"]["nll"]  # the logits are far too confident
        assert values["ece"] < report["pre_T"]["ece"]


def test_unknown_posthoc_names_raise():
    with pytest.raises(ValueError, match="unknown post-hoc calibrator"):
        posthoc_metrics(*_splits(), methods=("vector", "platt"))


def test_format_report_keeps_the_pre_post_table_and_appends_the_posthoc_table():
    val_logits, val_labels, test_logits, test_labels = _splits()
    plain = calibration_report(val_logits, val_labels, test_logits, test_labels)
    report = calibration_report(val_logits, val_labels, test_logits, test_labels, posthoc=("vector", "isotonic"))
    old_text, new_text = format_report(plain, title="t"), format_report(report, title="t")
    assert new_text.startswith(old_text + "\n\npost-hoc calibrators")
    extra = new_text[len(old_text):].strip().splitlines()
    assert extra[1].split() == ["metric", "post-T", "vector", "isotonic"]
    assert len(extra) == 2 + len(METRICS)
    ece_row = next(line for line in extra if line.startswith("ECE %"))
    assert ece_row.split()[-1] == f"{100 * report['posthoc']['isotonic']['ece']:.2f}"


def test_saved_report_round_trips_the_posthoc_metrics(tmp_path):
    val_logits, val_labels, test_logits, test_labels = _splits()
    report = calibration_report(val_logits, val_labels, test_logits, test_labels, posthoc=POSTHOC)
    save_report(report, test_logits, test_labels, tmp_path)
    saved = json.loads((tmp_path / "report.json").read_text())
    assert saved["posthoc"] == report["posthoc"]  # json writes a binning method's infinite NLL as Infinity
    assert (tmp_path / "reliability_pre_T.png").is_file() and (tmp_path / "reliability_post_T.png").is_file()


def test_posthoc_option_parsing():
    parser = evaluate_cli.get_args_parser()
    assert parser.parse_args(["--checkpoint", "c.pt"]).posthoc == POSTHOC
    assert parser.parse_args(["--checkpoint", "c.pt", "--posthoc", "none"]).posthoc == ()
    assert parser.parse_args(["--checkpoint", "c.pt", "--posthoc", "isotonic, vector"]).posthoc == ("isotonic",
                                                                                                       "vector")
    with pytest.raises(SystemExit):
        parser.parse_args(["--checkpoint", "c.pt", "--posthoc", "vector,platt"])


def test_evaluate_cli_reports_the_posthoc_calibrators_beside_temperature_scaling(tmp_path, capsys):
    out = tmp_path / "digits"
    train.main(train.parse_args(["--loss", "bsce_gra", "--epochs", "1", "--max-steps-per-epoch", "2", "--output-dir",
                                 str(out)] + FAST))
    trained = json.loads((out / "report.json").read_text())
    assert "posthoc" not in trained  # training's own report is unchanged
    capsys.readouterr()

    assert evaluate_cli.cli(["--checkpoint", str(out / "checkpoint.pt"), "--output-dir", str(tmp_path / "eval"),
                             "--posthoc", "vector,histogram"]) == 0
    printed = capsys.readouterr().out
    assert "pre-T" in printed and "post-hoc calibrators" in printed
    report = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert list(report["posthoc"]) == ["vector", "histogram"]
    assert report["temperature"] == pytest.approx(trained["temperature"])
    for tag in ("pre_T", "post_T"):
        for key, value in trained[tag].items():
            assert report[tag][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (tag, key)

    assert evaluate_cli.cli(["--checkpoint", str(out / "checkpoint.pt"), "--output-dir", str(tmp_path / "none"),
                             "--posthoc", "none"]) == 0
    assert "posthoc" not in json.loads((tmp_path / "none" / "report.json").read_text())
