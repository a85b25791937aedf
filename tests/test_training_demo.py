"""The `digits` demo's multi-seed reporting (training/train.py ``--seeds``, training/report.py ``aggregate_reports``):
each loss is trained once per seed and the report holds mean ± sample std of T and of every metric, pre-T and post-T.
Runs are 2 epochs of the embedded recipe, a few seconds each."""

from __future__ import annotations

import json
import statistics

import pytest

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from training import train  # noqa: E402
from training.recipes import get_recipe  # noqa: E402
from training.report import METRICS, aggregate_reports  # noqa: E402

FAST = ["--no-progress", "--workers", "0", "--threads", "1", "--epochs", "2"]


def _check_aggregate(aggregate: dict, runs: list[dict]) -> None:
    assert aggregate["n_seeds"] == len(runs) == len(aggregate["runs"])
    values = [run["temperature"] for run in runs]
    assert aggregate["temperature"] == pytest.approx(statistics.fmean(values))
    assert aggregate["temperature_std"] == pytest.approx(statistics.stdev(values))
    for tag in ("pre_T", "post_T"):
        assert set(aggregate[tag]) == set(aggregate[f"{tag}_std"]) >= set(METRICS)
        for key in METRICS:
            values = [run[tag][key] for run in runs]
            assert aggregate[tag][key] == pytest.approx(statistics.fmean(values)), (tag, key)
            assert aggregate[f"{tag}_std"][key] == pytest.approx(statistics.stdev(values)), (tag, key)


def test_seeds_aggregate_one_loss(tmp_path, capsys):
    out = tmp_path / "run"
    result = train.main(train.parse_args(["--loss", "cross_entropy", "--seeds", "2", "--seed", "5",
                                          "--output-dir", str(out)] + FAST))
    runs = [json.loads((out / f"seed{seed}" / "report.json").read_text()) for seed in (5, 6)]
    assert [run["seed"] for run in runs] == [5, 6]
    assert runs[0]["pre_T"] != runs[1]["pre_T"]  # the seeds differ, so the std is not trivially 0
    saved = json.loads((out / "report.json").read_text())
    assert saved["seeds"] == [5, 6]
    _check_aggregate(saved, runs)
    _check_aggregate(result["report"], runs)
    printed = capsys.readouterr().out
    assert "over 2 seeds" in printed and "±" in printed


def test_compare_defaults_to_three_seeds_and_aggregates(tmp_path, capsys):
    out = tmp_path / "cmp"
    result = train.main(train.parse_args(["--compare", "cross_entropy,bsce_gra", "--max-steps-per-epoch", "1",
                                          "--output-dir", str(out)] + FAST))
    saved = json.loads((out / "comparison.json").read_text())
    assert set(saved) == set(result["reports"]) == {"cross_entropy", "bsce_gra"}
    for spec, tag in (("cross_entropy", "cross_entropy"), ("bsce_gra", "bsce_gra")):
        runs = [json.loads((out / tag / f"seed{seed}" / "report.json").read_text()) for seed in (0, 1, 2)]
        assert saved[spec]["seeds"] == [0, 1, 2]
        _check_aggregate(saved[spec], runs)
    table = (out / "comparison.md").read_text()
    assert "±" in table and "3 seeds" in table
    assert (out / "comparison_reliability.png").stat().st_size > 0


def test_aggregate_of_one_report_has_zero_std():
    report = {"temperature": 1.5, "n_val": 2, "n_test": 3, "n_bins": 15, "seed": 0,
              "pre_T": {"ece": 0.1}, "post_T": {"ece": 0.05}}
    aggregate = aggregate_reports([report])
    assert aggregate["temperature"] == 1.5 and aggregate["temperature_std"] == 0.0
    assert aggregate["pre_T_std"] == {"ece": 0.0} and aggregate["post_T"] == {"ece": 0.05}


def test_bad_seed_count_is_one_error_line(capsys):
    assert train.cli(["--seeds", "0"] + FAST) == 2
    assert capsys.readouterr().err.strip() == "error: --seeds must be >= 1, got 0"


def test_digits_recipe_uses_the_papers_optimiser_settings():
    recipe = get_recipe("digits")
    assert (recipe.optimizer, recipe.momentum, recipe.weight_decay) == ("sgd", 0.9, 5e-4)
    assert (recipe.reduction, recipe.clip_grad_norm) == ("sum", 2.0)
    assert (recipe.train_subset, recipe.lr, recipe.epochs) == (200, 0.05, 300)
