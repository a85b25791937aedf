"""The `digits` demo: the default run (``python -m training.train`` with no loss compares cross-entropy with the
calibration losses over 3 seeds), its step-decay schedule, and the multi-seed reporting (training/train.py ``--seeds``,
training/report.py ``aggregate_reports``): each loss is trained once per seed and the report holds mean ± sample std of
T and of every metric, pre-T and post-T. Runs are 2 epochs of the embedded recipe, a few seconds each."""

from __future__ import annotations

import json
import statistics

import pytest
import torch

pytest.importorskip("sklearn")
pytest.importorskip("matplotlib")

from training import soft_targets, train  # noqa: E402
from training.arguments import DEFAULT_COMPARISON  # noqa: E402
from training.recipes import get_recipe  # noqa: E402
from training.report import COMPARISON_METRICS, METRICS, aggregate_reports  # noqa: E402

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


def test_the_first_run_compares_the_default_losses_over_three_seeds(tmp_path, capsys):
    """`python -m training.train` with no loss, at 2 epochs of one step: one table (per loss, pre-T and post-T rows of
    accuracy, ECE, AdaECE, classwise ECE, NLL, Brier and T, mean ± std), the overlaid reliability diagrams and the
    report files of every loss and run."""
    losses = DEFAULT_COMPARISON.split(",")
    assert losses[0] == "cross_entropy" and "bsce_gra" in losses
    out = tmp_path / "first"
    args = train.parse_args(["--max-steps-per-epoch", "1", "--output-dir", str(out)] + FAST)
    assert args.compare == DEFAULT_COMPARISON
    assert train.parse_args(["--loss", "cross_entropy"]).compare is None  # --loss X still trains one loss
    result = train.main(args)
    printed = capsys.readouterr().out

    table = result["table"]
    assert table in printed and printed.count("Accuracy %") == 1  # one table, no per-run ones
    header, _, *rows = table.splitlines()
    assert header.split()[:2] == ["loss", "T"]
    for key in COMPARISON_METRICS:
        assert METRICS[key][0] in header
    for index, loss in enumerate(losses):
        pre, post = rows[2 * index], rows[2 * index + 1]
        assert pre.split()[:2] == [loss, "pre-T"] and post.split()[0] == "post-T"
        assert pre.count("±") == len(COMPARISON_METRICS) and post.count("±") == len(COMPARISON_METRICS) + 1  # and T
    assert "3 seeds" in rows[-1]

    figure = out / "comparison_reliability.png"
    assert result["figure"] == str(figure) and figure.read_bytes().startswith(b"\x89PNG")
    saved = json.loads((out / "comparison.json").read_text())
    assert list(saved) == list(result["reports"]) == losses
    assert (out / "comparison.md").read_text().strip("`\n") == table
    for loss in losses:
        assert saved[loss]["seeds"] == [0, 1, 2]
        assert json.loads((out / loss / "report.json").read_text())["n_seeds"] == 3
        for seed in (0, 1, 2):
            run = out / loss / f"seed{seed}"
            for name in ("report.json", "reliability_pre_T.png", "reliability_post_T.png", "log.csv", "checkpoint.pt"):
                assert (run / name).is_file(), run / name
            assert json.loads((run / "report.json").read_text())["loss"] == loss


def test_digits_recipe_decays_the_lr_in_steps_at_the_papers_fractions():
    """The papers' CIFAR schedule, ×0.1 at epochs 150 and 250 of 350, scaled to the recipe's 300 epochs."""
    recipe = get_recipe("digits")
    assert recipe.scheduler == "multistep" and recipe.milestones == (129, 214)
    assert [round(recipe.epochs * m / 350) for m in get_recipe("cifar10-resnet110").milestones] == [129, 214]
    parameter = torch.zeros(1, requires_grad=True)
    optimizer = torch.optim.SGD([parameter], lr=recipe.lr)
    scheduler = soft_targets.make_scheduler(optimizer, recipe.scheduler, recipe.epochs, recipe.milestones)
    lrs = []
    for _ in range(recipe.epochs):
        lrs.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    assert lrs[:129] == [0.05] * 129
    assert lrs[129:214] == pytest.approx([0.005] * 85) and lrs[214:] == pytest.approx([0.0005] * 86)
