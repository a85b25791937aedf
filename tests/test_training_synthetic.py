"""``--synthetic``: the training CLI on seeded random images of a recipe's shape instead of its data set.

The whole pipeline (train, evaluate, temperature fit, calibration report, ``--compare``, soft targets, ``--resume``)
runs on them unchanged and reads no file; the same seed gives the same images and the same first batch; contradictory
flags are one ``error:`` line with exit code 2. Runs are one optimiser step on the CPU at small image sizes.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from test_training_cli import _log_rows, _one_error_line
from training import data, train
from training.data import SyntheticImages, build_datasets
from training.recipes import get_recipe

FAST = ["--no-progress", "--threads", "1", "--epochs", "1", "--max-steps-per-epoch", "1"]


def _assert_finished_run(output_dir: Path) -> dict:
    """The run's report, figures and log exist and every number in them is finite; returns the report."""
    report = json.loads((output_dir / "report.json").read_text())
    assert report["data"] == "synthetic"
    assert math.isfinite(report["temperature"]) and report["temperature"] > 0
    for tag in ("pre_T", "post_T"):
        assert report[tag] and all(math.isfinite(value) for value in report[tag].values()), report[tag]
    for name in ("reliability_pre_T.png", "reliability_post_T.png", "checkpoint.pt", "args.json"):
        assert (output_dir / name).is_file(), name
    (row,) = _log_rows(output_dir)
    for key in ("train_loss", "train_accuracy", "images_per_s", "val_accuracy", "val_ece", "val_nll"):
        assert math.isfinite(float(row[key])), (key, row)
    assert float(row["images_per_s"]) > 0
    assert json.loads((output_dir / "args.json").read_text())["synthetic"] is True
    return report


# ---------------------------------------------------------------------------------------------------- end to end
@pytest.mark.parametrize("recipe, extra, shape", [
    ("cifar10-resnet110", ["--batch-size", "8", "--synthetic-size", "40"], (3, 32, 32)),
    ("imagenet-resnet50-finetune", ["--batch-size", "4", "--synthetic-size", "20", "--image-size", "32"],
     (3, 32, 32)),
], ids=["cifar-shaped", "imagenet-shaped"])
def test_synthetic_recipe_trains_evaluates_and_reports_both_losses(tmp_path, capsys, recipe, extra, shape):
    """The recipe's own model, one step with each loss (``--compare``, one seed), then temperature fit and report;
    the data root points nowhere and the fine-tuning recipe runs without ``--pretrained``."""
    base = tmp_path / "compare"
    rc = train.cli(["--recipe", recipe, "--synthetic", "--compare", "cross_entropy,bsce_gra", "--seeds", "1",
                    "--data-root", str(tmp_path / "nowhere"), "--output-dir", str(base)] + extra + FAST)
    out = capsys.readouterr().out
    assert rc == 0, out
    classes = get_recipe(recipe).num_classes
    shape_text = "x".join(map(str, shape))
    assert f"synthetic {get_recipe(recipe).dataset}-shaped images ({shape_text}, {classes} classes" in out
    size = int(extra[extra.index("--synthetic-size") + 1])
    assert f"({size} train / {size // 10} val / {size // 10} test)" in out
    for loss in ("cross_entropy", "bsce_gra"):
        report = _assert_finished_run(base / loss)
        assert (report["loss"], report["n_test"]) == (loss, size // 10)
    assert set(json.loads((base / "comparison.json").read_text())) == {"cross_entropy", "bsce_gra"}
    assert not (tmp_path / "nowhere").exists()


@pytest.mark.parametrize("soft", [
    ["--label-smoothing", "0.1", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"],
    ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--mix-dense", "--workers", "1"],
], ids=["compact-mix-smoothing", "dense-mix-worker"])
def test_soft_targets_train_on_synthetic_images(tmp_path, capsys, soft):
    """Mixup / cutmix (compact and dense) and label smoothing on synthetic batches, from the device-held pool and from
    a worker process."""
    out_dir = tmp_path / "run"
    rc = train.cli(["--recipe", "cifar10-resnet110", "--arch", "small_cnn", "--synthetic", "--synthetic-size", "16",
                    "--batch-size", "8", "--image-size", "16", "--loss", "bsce_gra", "--output-dir", str(out_dir)]
                   + soft + FAST)
    out = capsys.readouterr().out
    assert rc == 0, out
    assert ("kept on the device" in out) == ("--workers" not in soft)
    _assert_finished_run(out_dir)


# --------------------------------------------------------------------------------------------------- determinism
def _first_batch(seed: int, size: int = 64, batch: int = 16):
    """The first training batch as :func:`training.train.run_training` draws it (its sampler, seeded by ``seed``)."""
    splits = build_datasets("cifar100-resnet110", None, seed, synthetic_size=size)
    sampler = train.ResumableDistributedSampler(splits.train, num_replicas=1, rank=0, shuffle=True, seed=seed)
    return next(iter(DataLoader(splits.train, batch_size=batch, sampler=sampler)))


def test_same_seed_gives_the_same_images_and_first_batch():
    images, targets = _first_batch(seed=3)
    again_images, again_targets = _first_batch(seed=3)
    assert images.shape == (16, 3, 32, 32) and images.dtype == torch.float32
    assert torch.equal(images, again_images) and torch.equal(targets, again_targets)
    other_images, _ = _first_batch(seed=4)
    assert not torch.equal(images, other_images)
    assert int(targets.min()) >= 0 and int(targets.max()) < 100


def test_same_seed_gives_the_same_first_step(tmp_path):
    """Two CLI runs with one seed train the same first step (same loss), another seed does not."""
    def first_loss(name, seed):
        out_dir = tmp_path / name
        assert train.cli(["--synthetic", "--synthetic-size", "20", "--batch-size", "10", "--loss", "cross_entropy",
                          "--seed", str(seed), "--output-dir", str(out_dir)] + FAST) == 0
        return float(_log_rows(out_dir)[0]["train_loss"])

    assert first_loss("a", 5) == first_loss("b", 5) != first_loss("c", 6)


def test_splits_are_distinct_pools_of_the_recipe_shape(monkeypatch):
    """Validation, test and meta images are their own draws, not training images; a pool holds at most
    ``SYNTHETIC_POOL_BYTES`` and the samples cycle through it."""
    recipe = get_recipe("tinyimagenet-resnet50")
    splits = build_datasets(recipe, None, 0, meta_fraction=0.25, synthetic_size=40)
    assert (len(splits.train), len(splits.meta), len(splits.val), len(splits.test)) == (30, 10, 4, 4)
    assert splits.num_classes == 200 and splits.train[0][0].shape == (3, 64, 64)
    pools = [split.images for split in (splits.train, splits.val, splits.test, splits.meta)]
    for i, pool in enumerate(pools):
        for other in pools[i + 1:]:
            assert not torch.isclose(pool[:, None], other[None]).flatten(2).all(-1).any()
    monkeypatch.setattr(data, "SYNTHETIC_POOL_BYTES", 10 * 4 * 3 * 64 * 64)  # 10 images of 3 x 64 x 64
    big = build_datasets(recipe, None, 0, synthetic_size=100).train
    assert isinstance(big, SyntheticImages) and len(big) == 100 and len(big.images) == 10
    assert torch.equal(big[12][0], big[2][0]) and int(big[12][1]) == int(big[2][1])
    assert sorted(big.targets.tolist()) == list(range(10))  # balanced: here 10 of the 200 classes, once each
    with pytest.raises(IndexError):
        big[100]


def test_run_says_how_many_classes_a_small_pool_holds(tmp_path, capsys, monkeypatch):
    """A pool smaller than the number of classes (ImageNet's 1000 at 224 px: 111 images) holds only that many of
    them; the run's first line says so instead of claiming images of every class."""
    monkeypatch.setattr(data, "SYNTHETIC_POOL_BYTES", 30 * 4 * 3 * 4 * 4)  # 30 images of 3 x 4 x 4
    assert train.cli(["--loss", "bsce_gra", "--recipe", "cifar100-resnet110", "--arch", "small_cnn", "--synthetic",
                      "--image-size", "4", "--synthetic-size", "40", "--batch-size", "20",
                      "--output-dir", str(tmp_path / "run")] + FAST) == 0
    assert "(3x4x4, 100 classes, images of 30 of them" in capsys.readouterr().out
    recipe = dataclasses.replace(get_recipe("cifar100-resnet110"), image_size=4)
    for pool in (build_datasets(recipe, None, 0, synthetic_size=400).train, build_datasets(recipe, None, 1,
                                                                                          synthetic_size=400).test):
        assert sorted(pool.targets.tolist()) == list(range(30))  # classes 0 … 29, in every split and seed


def test_resume_keeps_synthetic_data(tmp_path, capsys):
    out_dir = tmp_path / "run"
    assert train.cli(["--loss", "bsce_gra", "--synthetic", "--synthetic-size", "20", "--batch-size", "10",
                      "--epochs", "2", "--max-steps-per-epoch", "1", "--stop-after", "1", "--no-progress",
                      "--threads", "1", "--output-dir", str(out_dir)]) == 0
    capsys.readouterr()
    assert train.cli(["--resume", str(out_dir / "checkpoint.pt"), "--no-progress", "--threads", "1"]) == 0
    assert "synthetic digits-shaped images (1x8x8, 10 classes" in capsys.readouterr().out
    assert len(_log_rows(out_dir)) == 2
    assert json.loads((out_dir / "report.json").read_text())["data"] == "synthetic"


def test_evaluate_re_reads_the_synthetic_images_of_a_checkpoint(tmp_path, capsys):
    """training.evaluate rebuilds the run's synthetic splits (same seed, same size), not the recipe's real data."""
    from training import evaluate

    out_dir = tmp_path / "run"
    assert train.cli(["--loss", "bsce_gra", "--synthetic", "--synthetic-size", "20", "--batch-size", "10", *FAST,
                      "--output-dir", str(out_dir)]) == 0
    trained = json.loads((out_dir / "report.json").read_text())
    capsys.readouterr()
    assert evaluate.cli(["--checkpoint", str(out_dir / "checkpoint.pt"), "--output-dir", str(tmp_path / "eval"),
                         "--device", "cpu"]) == 0
    again = json.loads((tmp_path / "eval" / "report.json").read_text())
    splits = build_datasets("digits", None, 0, synthetic_size=20)
    assert again["n_test"] == len(splits.test) == trained["n_test"]
    assert again["pre_T"]["ece"] == pytest.approx(trained["pre_T"]["ece"], abs=1e-6)


# -------------------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("case", ["size-without-synthetic", "size-0", "with-download", "resume-real-run"])
def test_bad_synthetic_arguments_are_one_error_line_and_leave_no_run_folder(tmp_path, capsys, case):
    out = tmp_path / "runs" / "x"
    if case == "resume-real-run":
        real = tmp_path / "real"
        assert train.cli(["--loss", "bsce_gra", "--output-dir", str(real)] + FAST) == 0  # digits, its own data
        capsys.readouterr()
    argv = {
        "size-without-synthetic": ["--synthetic-size", "100"],
        "size-0": ["--synthetic", "--synthetic-size", "0"],
        "with-download": ["--recipe", "cifar10-resnet110", "--synthetic", "--download"],
        "resume-real-run": ["--resume", str(tmp_path / "real" / "checkpoint.pt"), "--synthetic"],
    }[case]
    expected = {"size-without-synthetic": "--synthetic-size needs --synthetic", "size-0": "--synthetic-size must be",
                "with-download": "--download", "resume-real-run": "synthetic"}[case]
    rc = train.cli(argv + ["--output-dir", str(out)] + FAST)
    assert rc == 2 and expected in _one_error_line(capsys.readouterr().err)
    assert not (tmp_path / "runs").exists()


def test_non_integer_synthetic_size_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.cli(["--synthetic", "--synthetic-size", "many"])
    assert exit_info.value.code == 2
    assert "--synthetic-size" in _one_error_line(capsys.readouterr().err)
