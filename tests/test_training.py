"""End-to-end tests of the training package on tiny fixture datasets written here in each real on-disk format
(torchvision's CIFAR-10/100 pickles, the official Tiny-ImageNet layout, ImageFolder), plus the embedded digits recipe,
checkpoint/resume equivalence, SIGTERM handling, --compile / --amp bf16 on CPU, --compare and the data-path errors.

Runs are a few optimiser steps of the small CNN (``--arch small_cnn``) so the file stays within its CI time budget.
"""

from __future__ import annotations

import json
import os
import pickle
import signal
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from training import checkpoint as ckpt_utils
from training import evaluate as evaluate_cli
from training import loop as training_loop
from training import train
from training.data import DataError, build_datasets
from training.distributed import UnpaddedDistributedSampler
from training.models import build_model
from training.recipes import RECIPES, get_recipe

FAST = ["--no-progress", "--workers", "0", "--threads", "1"]


# ------------------------------------------------------------------------------------------------- fixtures on disk
def _write_pickle(path: Path, obj) -> None:
    with path.open("wb") as handle:
        pickle.dump(obj, handle)


def write_cifar(root: Path, num_classes: int, per_batch: int = 12, n_test: int = 16) -> Path:
    """torchvision's CIFAR python format: pickled dicts of uint8 rows (3·32·32, channel-major) and labels."""
    rng = np.random.default_rng(0)
    if num_classes == 10:
        folder = root / "cifar-10-batches-py"
        folder.mkdir(parents=True)
        for index in range(1, 6):
            _write_pickle(folder / f"data_batch_{index}", {
                "data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                "labels": rng.integers(0, 10, per_batch).tolist()})
        _write_pickle(folder / "test_batch", {"data": rng.integers(0, 256, (n_test, 3072), dtype=np.uint8),
                                              "labels": rng.integers(0, 10, n_test).tolist()})
        _write_pickle(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)]})
    else:
        folder = root / "cifar-100-python"
        folder.mkdir(parents=True)
        _write_pickle(folder / "train", {"data": rng.integers(0, 256, (5 * per_batch, 3072), dtype=np.uint8),
                                         "fine_labels": rng.integers(0, 100, 5 * per_batch).tolist()})
        _write_pickle(folder / "test", {"data": rng.integers(0, 256, (n_test, 3072), dtype=np.uint8),
                                        "fine_labels": rng.integers(0, 100, n_test).tolist()})
        _write_pickle(folder / "meta", {"fine_label_names": [f"c{i}" for i in range(100)]})
    return root


def _write_image(path: Path, size: int, rng) -> None:
    from PIL import Image

    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size, size, 3), dtype=np.uint8)).save(path)


def write_tinyimagenet(root: Path, wnids=("n01", "n02", "n03"), train_per_class: int = 10,
                       val_per_class: int = 2, size: int = 16) -> Path:
    """The official layout: wnids.txt, train/<wnid>/images/*.JPEG (+ boxes file), val/images + val_annotations.txt."""
    rng = np.random.default_rng(1)
    base = root / "tiny-imagenet-200"
    (base / "wnids.txt").parent.mkdir(parents=True)
    (base / "wnids.txt").write_text("\n".join(wnids) + "\n")
    for wnid in wnids:
        for i in range(train_per_class):
            _write_image(base / "train" / wnid / "images" / f"{wnid}_{i}.JPEG", size, rng)
        (base / "train" / wnid / f"{wnid}_boxes.txt").write_text("")
    lines = []
    for wnid in wnids:
        for i in range(val_per_class):
            name = f"val_{wnid}_{i}.JPEG"
            _write_image(base / "val" / "images" / name, size, rng)
            lines.append(f"{name}\t{wnid}\t0\t0\t{size - 1}\t{size - 1}")
    (base / "val" / "val_annotations.txt").write_text("\n".join(lines) + "\n")
    return root


def write_imagefolder(root: Path, classes=("cat", "dog"), train_per_class: int = 12, val_per_class: int = 3,
                      size: int = 16) -> Path:
    rng = np.random.default_rng(2)
    for split, count in (("train", train_per_class), ("val", val_per_class)):
        for cls in classes:
            for i in range(count):
                _write_image(root / split / cls / f"{i}.png", size, rng)
    return root


def run_main(argv):
    return train.main(train.parse_args(argv))


# --------------------------------------------------------------------------------------------------------- recipes
def test_recipes_carry_the_papers_hyperparameters():
    expected = {f"{d}-{a}" for d in ("cifar10", "cifar100") for a in ("resnet50", "resnet110", "wrn26-10",
                                                                      "densenet121")}
    expected |= {"tinyimagenet-resnet50", "imagenet-resnet50-finetune", "cifar10-vit-b16-finetune", "digits"}
    assert expected <= set(RECIPES)
    for name in expected:
        recipe = get_recipe(name)
        if name.startswith("cifar") and "finetune" not in name:
            assert (recipe.epochs, recipe.lr, recipe.milestones, recipe.batch_size) == (350, 0.1, (150, 250), 128)
            assert (recipe.optimizer, recipe.momentum, recipe.weight_decay) == ("sgd", 0.9, 5e-4)
            assert (recipe.reduction, recipe.clip_grad_norm) == ("sum", 2.0)
            assert recipe.num_classes == (100 if name.startswith("cifar100") else 10)
    tiny = get_recipe("tinyimagenet-resnet50")
    assert (tiny.epochs, tiny.milestones, tiny.batch_size, tiny.reduction, tiny.num_classes) == (100, (40, 60), 64,
                                                                                                 "sum", 200)
    imagenet = get_recipe("imagenet-resnet50-finetune")
    assert (imagenet.optimizer, imagenet.scheduler, imagenet.epochs, imagenet.pretrained_required) == (
        "adam", "cosine", 90, True)
    assert get_recipe("cifar10-vit-b16-finetune").epochs == 50
    with pytest.raises(ValueError, match="unknown recipe"):
        get_recipe("cifar11-resnet50")


def test_list_recipes_prints_every_recipe(capsys):
    assert train.cli(["--list-recipes"]) == 0
    out = capsys.readouterr().out
    assert all(name in out for name in RECIPES)


def test_fine_tune_recipes_require_a_local_pretrained_checkpoint(tmp_path, capsys):
    rc = train.cli(["--recipe", "imagenet-resnet50-finetune", "--data-root", str(tmp_path)] + FAST)
    assert rc == 2 and "--pretrained" in capsys.readouterr().err


def test_loss_spec_parsing_builds_the_registry_loss_with_its_hyperparameters():
    criterion = train.build_criterion("focal_loss:gamma=2", reduction="sum", backend="reference")
    assert (criterion.uncertainty, criterion.mode, criterion.gamma, criterion.reduction, criterion.backend) == (
        "focal", "loss", 2.0, "sum", "reference")
    criterion = train.build_criterion("bsce_gra:gamma=3:norm=1.5", reduction="mean", backend="auto")
    assert (criterion.gamma, criterion.norm) == (3.0, 1.5)
    assert train.build_criterion("label_smoothing:alpha=0.1", "sum", "auto").alpha == 0.1
    with pytest.raises(ValueError, match="unknown loss"):
        train.parse_loss_spec("focal")
    with pytest.raises(ValueError, match="KEY=VALUE"):
        train.parse_loss_spec("focal_loss:2")
    with pytest.raises(TypeError, match="focal_loss"):
        train.build_criterion("focal_loss:gamma_typo=2", "sum", "auto")


# ---------------------------------------------------------------------------------------------------------- models
@pytest.mark.parametrize("arch", ["small_cnn", "resnet110", "resnet50", "wide_resnet26_10", "densenet121"])
def test_models_expose_features_and_classifier(arch):
    num_classes = int(torch.randint(2, 20, ()).item())
    model = build_model(arch, num_classes, in_channels=3).eval()
    images = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        features = model.features(images)
        logits = model(images)
    assert isinstance(model.classifier, torch.nn.Linear)
    assert features.shape == (2, model.classifier.in_features)
    assert logits.shape == (2, num_classes)
    torch.testing.assert_close(logits, model.classifier(features), rtol=0, atol=0)


def test_build_model_rejects_unknown_architectures():
    with pytest.raises(ValueError, match="unknown architecture"):
        build_model("resnet51", 10)
    with pytest.raises(ValueError, match="num_classes"):
        build_model("small_cnn", 1)


# ------------------------------------------------------------------------------------------------------ data splits
def test_cifar_splits_are_seeded_disjoint_and_cover_train(tmp_path):
    root = write_cifar(tmp_path, 10, per_batch=20)
    splits = build_datasets("cifar10-resnet50", root, seed=3)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (90, 10, 16)
    assert not set(splits.train.indices) & set(splits.val.indices)
    assert sorted(splits.train.indices + splits.val.indices) == list(range(100))
    again = build_datasets("cifar10-resnet50", root, seed=3)
    assert again.val.indices == splits.val.indices
    image, label = splits.train[0]
    assert image.shape == (3, 32, 32) and 0 <= label < 10
    with_meta = build_datasets("cifar10-resnet50", root, seed=3, meta_fraction=0.2)
    assert len(with_meta.meta) == 18 and len(with_meta.train) == 72
    assert not set(with_meta.meta.indices) & (set(with_meta.train.indices) | set(with_meta.val.indices))
    assert splits.meta is None


def test_tinyimagenet_validation_is_held_out_train_and_test_is_official_val(tmp_path):
    root = write_tinyimagenet(tmp_path, train_per_class=10, val_per_class=2)
    splits = build_datasets("tinyimagenet-resnet50", root, seed=0)
    assert splits.num_classes == 3
    assert len(splits.test) == 6 and len(splits.val) == 3 * 2 and len(splits.train) == 3 * 8
    assert not set(splits.train.indices) & set(splits.val.indices)
    assert splits.val.dataset is not splits.test.dataset  # validation never the test split
    val_labels = [splits.val.dataset.targets[i] for i in splits.val.indices]
    assert np.bincount(val_labels).tolist() == [2, 2, 2]
    test_labels = [splits.test[i][1] for i in range(len(splits.test))]
    assert sorted(test_labels) == [0, 0, 1, 1, 2, 2]


@pytest.mark.parametrize("image_size", [32, 64, 128])
def test_tinyimagenet_trains_and_evaluates_at_one_scale_at_any_image_size(image_size):
    """A 32-px object in a 64-px image: training crops and evaluation see it at the same scale (scaled by
    image_size / 64), and a size above the images' 64 px is upsampled instead of failing to crop."""
    from PIL import Image

    from training.data import _imagenet_style_transforms

    pixels = np.zeros((64, 64, 3), np.uint8)
    pixels[16:48, 16:48] = 255
    train_tf, test_tf = _imagenet_style_transforms("tinyimagenet", image_size)
    object_pixels = lambda x: int((x[0] > 0).sum())  # noqa: E731
    expected = (32 * image_size // 64) ** 2
    evaluated = test_tf(Image.fromarray(pixels))
    assert evaluated.shape == (3, image_size, image_size)
    assert object_pixels(evaluated) == pytest.approx(expected, rel=0.1)
    for _ in range(5):
        trained = train_tf(Image.fromarray(pixels))
        assert trained.shape == (3, image_size, image_size)
        assert object_pixels(trained) <= 1.1 * expected  # a crop never shows it larger than evaluation does


def test_digits_split_sizes_and_meta_split():
    splits = build_datasets("digits", None, seed=0)
    assert (len(splits.train), len(splits.val), len(splits.test)) == (200, 500, 1097)
    with_meta = build_datasets("digits", None, seed=0, meta_fraction=0.25)
    assert (len(with_meta.train), len(with_meta.meta)) == (150, 50)
    def rows(dataset):
        return sorted(tuple(x.flatten().tolist()) + (int(y),) for x, y in dataset)

    # The meta split is carved out of train: together they are exactly the original training images.
    assert sorted(rows(with_meta.train) + rows(with_meta.meta)) == rows(splits.train)


# ------------------------------------------------------------------------------------------------ clear data errors
@pytest.mark.parametrize("recipe,expected", [
    ("cifar10-resnet50", "cifar-10-batches-py"),
    ("cifar100-resnet110", "cifar-100-python"),
    ("tinyimagenet-resnet50", "tiny-imagenet-200"),
])
def test_missing_data_gives_one_clear_message(tmp_path, capsys, recipe, expected):
    missing = tmp_path / "nowhere"
    assert train.cli(["--recipe", recipe, "--data-root", str(missing)] + FAST) == 2
    err = capsys.readouterr().err
    assert "does not exist" in err and expected in err and "Traceback" not in err
    tmp_path.joinpath("empty").mkdir()
    assert train.cli(["--recipe", recipe, "--data-root", str(tmp_path / "empty")] + FAST) == 2
    assert expected in capsys.readouterr().err


def test_corrupt_cifar_and_malformed_layouts_give_clear_messages(tmp_path):
    root = write_cifar(tmp_path / "c10", 10)
    (root / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"this is not a pickle")
    with pytest.raises(DataError, match="cifar-10-batches-py.*expected"):
        build_datasets("cifar10-resnet50", root, seed=0)
    tiny = write_tinyimagenet(tmp_path / "tiny")
    annotations = tiny / "tiny-imagenet-200" / "val" / "val_annotations.txt"
    annotations.write_text("val_n01_0.JPEG\tn99\t0\t0\t1\t1\n")
    with pytest.raises(DataError, match="val_annotations.txt line 1"):
        build_datasets("tinyimagenet-resnet50", tiny, seed=0)
    folder = write_imagefolder(tmp_path / "inet")
    for path in (folder / "val").rglob("*.png"):
        path.unlink()
    with pytest.raises(DataError, match="ImageFolder"):
        build_datasets("imagenet-resnet50-finetune", folder, seed=0)
    with pytest.raises(DataError, match="train/ and val/"):
        build_datasets("imagenet-resnet50-finetune", tmp_path / "absent", seed=0)


# ------------------------------------------------------------------------------------------ end-to-end, each format
@pytest.mark.parametrize("fmt", ["cifar10", "cifar100", "tinyimagenet", "imagefolder"])
def test_end_to_end_on_each_on_disk_format(tmp_path, fmt):
    if fmt in ("cifar10", "cifar100"):
        root = write_cifar(tmp_path / "data", 10 if fmt == "cifar10" else 100)
        recipe, n_test, n_classes = f"{fmt}-resnet110", 16, 10 if fmt == "cifar10" else 100
        extra = []
    elif fmt == "tinyimagenet":
        root = write_tinyimagenet(tmp_path / "data")
        recipe, n_test, n_classes = "tinyimagenet-resnet50", 6, 3
        extra = ["--image-size", "16"]
    else:
        root = write_imagefolder(tmp_path / "data")
        recipe, n_test, n_classes = "imagenet-resnet50-finetune", 6, 2
        extra = ["--image-size", "16"]
    out = tmp_path / "run"
    result = run_main(["--recipe", recipe, "--data-root", str(root), "--arch", "small_cnn", "--loss", "bsce_gra",
                       "--epochs", "1", "--max-steps-per-epoch", "2", "--batch-size", "4", "--output-dir", str(out)]
                      + extra + FAST)
    report = result["report"]
    assert report["n_test"] == n_test and result["test_logits"].shape == (n_test, n_classes)
    for tag in ("pre_T", "post_T"):
        assert set(report[tag]) == {"accuracy", "ece", "adaece", "classwise_ece", "mce", "nll", "brier"}
        assert all(np.isfinite(v) for v in report[tag].values())
    assert report["pre_T"]["accuracy"] == report["post_T"]["accuracy"]  # T never changes the arg-max
    assert report["temperature"] > 0
    for name in ("report.json", "reliability_pre_T.png", "reliability_post_T.png", "log.csv", "log.jsonl",
                 "checkpoint.pt"):
        assert (out / name).is_file(), name
    checkpoint = ckpt_utils.load_checkpoint(out / "checkpoint.pt")
    assert checkpoint["epoch"] == 1 and checkpoint["args"]["num_classes"] == n_classes
    assert {"model", "optimizer", "scheduler", "scaler", "epoch", "args", "rng"} <= set(checkpoint)


# -------------------------------------------------------------------------------- digits: trains, reports, evaluates
def test_digits_recipe_trains_reports_and_evaluate_reproduces_the_report(tmp_path, capsys):
    out = tmp_path / "digits"
    run_main(["--loss", "bsce_gra", "--epochs", "40", "--output-dir", str(out)] + FAST)
    printed = capsys.readouterr().out
    assert "pre-T" in printed and "post-T" in printed and "ECE %" in printed
    report = json.loads((out / "report.json").read_text())
    assert report["recipe"] == "digits" and report["loss"] == "bsce_gra"
    assert (report["n_val"], report["n_test"]) == (500, 1097)
    # Without batch norm the small CNN starts slowly (about 12% after 15 epochs) and reaches about 77% at epoch 40.
    assert report["pre_T"]["accuracy"] > 0.5
    rows = (out / "log.csv").read_text().splitlines()
    assert len(rows) == 1 + 40 and rows[0].startswith("epoch,lr,train_loss")
    assert len((out / "log.jsonl").read_text().splitlines()) == 40

    # The evaluate CLI rebuilds the same held-out splits from the checkpoint and reproduces the numbers.
    assert evaluate_cli.cli(["--checkpoint", str(out / "checkpoint.pt"), "--output-dir", str(tmp_path / "eval")]) == 0
    again = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert again["temperature"] == pytest.approx(report["temperature"])
    for tag in ("pre_T", "post_T"):
        for key, value in report[tag].items():
            assert again[tag][key] == pytest.approx(value, rel=1e-5, abs=1e-6), (tag, key)
    model, checkpoint = ckpt_utils.load_model_from_checkpoint(out / "checkpoint.pt")
    assert not model.training and checkpoint["args"]["arch"] == "small_cnn"


def test_compare_writes_one_table_and_one_overlay_figure(tmp_path, capsys):
    out = tmp_path / "cmp"
    result = run_main(["--compare", "cross_entropy,flsd:gamma=2", "--epochs", "1", "--max-steps-per-epoch", "1",
                       "--output-dir", str(out)] + FAST)
    assert set(result["reports"]) == {"cross_entropy", "flsd:gamma=2"}
    table = capsys.readouterr().out
    assert "cross_entropy" in table and "flsd:gamma=2" in table
    saved = json.loads((out / "comparison.json").read_text())
    assert set(saved) == {"cross_entropy", "flsd:gamma=2"}
    assert (out / "comparison_reliability.png").stat().st_size > 0 and (out / "comparison.md").is_file()
    assert (out / "cross_entropy" / "report.json").is_file() and (out / "flsd-gamma=2" / "report.json").is_file()


# ---------------------------------------------------------------------------------------------- checkpoint / resume
def _state(path):
    return ckpt_utils.load_checkpoint(path)


def _assert_same_training_state(a, b):
    assert a["epoch"] == b["epoch"]
    assert a["model"].keys() == b["model"].keys()
    for key in a["model"]:
        assert torch.equal(a["model"][key], b["model"][key]), key
    for sa, sb in zip(a["optimizer"]["state"].values(), b["optimizer"]["state"].values()):
        assert torch.equal(sa["momentum_buffer"], sb["momentum_buffer"])


def test_interrupted_and_resumed_run_matches_uninterrupted(tmp_path):
    common = ["--epochs", "3", "--max-steps-per-epoch", "2", "--loss", "focal_loss", "--seed", "5"] + FAST
    run_main(common + ["--output-dir", str(tmp_path / "full")])
    run_main(common + ["--output-dir", str(tmp_path / "split"), "--stop-after", "1"])
    assert _state(tmp_path / "split" / "checkpoint.pt")["epoch"] == 1
    assert not (tmp_path / "split" / "report.json").exists()
    run_main(common + ["--output-dir", str(tmp_path / "split"), "--resume", str(tmp_path / "split" / "checkpoint.pt"),
                       "--stop-after", "1"])
    run_main(common + ["--output-dir", str(tmp_path / "split"), "--resume", str(tmp_path / "split" / "checkpoint.pt")])
    _assert_same_training_state(_state(tmp_path / "full" / "checkpoint.pt"),
                                _state(tmp_path / "split" / "checkpoint.pt"))
    assert len((tmp_path / "split" / "log.csv").read_text().splitlines()) == 1 + 3
    full = json.loads((tmp_path / "full" / "report.json").read_text())
    split = json.loads((tmp_path / "split" / "report.json").read_text())
    assert full["pre_T"] == split["pre_T"] and full["temperature"] == split["temperature"]


@pytest.mark.skipif(threading.current_thread() is not threading.main_thread(), reason="signals need the main thread")
def test_sigterm_mid_epoch_saves_and_resume_matches_uninterrupted(tmp_path, monkeypatch):
    common = ["--epochs", "2", "--loss", "cross_entropy", "--seed", "1", "--batch-size", "64"] + FAST  # 4 steps/epoch
    run_main(common + ["--output-dir", str(tmp_path / "full")])

    real_build = train.build_criterion
    calls = {"n": 0}

    def build_and_signal(*args, **kwargs):
        criterion = real_build(*args, **kwargs)

        def forward_then_maybe_signal(logits, target):
            calls["n"] += 1
            if calls["n"] == 3:  # the third step of the first epoch
                os.kill(os.getpid(), signal.SIGTERM)
            return type(criterion).forward(criterion, logits, target)

        criterion.forward = forward_then_maybe_signal
        return criterion

    monkeypatch.setattr(training_loop, "build_criterion", build_and_signal)  # where run_training looks it up
    out = tmp_path / "interrupted"
    # Exit code 143 = 128 + SIGTERM, after the checkpoint is saved: a scheduler tells a preempted run from a finished
    # one.
    assert train.cli(common + ["--output-dir", str(out)]) == 128 + signal.SIGTERM
    assert not (out / "report.json").exists()
    saved = _state(out / "checkpoint.pt")
    assert (saved["epoch"], saved["batches_done"]) == (0, 3)
    assert signal.getsignal(signal.SIGTERM) is not None  # handler restored, process alive
    monkeypatch.setattr(training_loop, "build_criterion", real_build)
    run_main(common + ["--output-dir", str(out), "--resume", str(out / "checkpoint.pt")])
    _assert_same_training_state(_state(tmp_path / "full" / "checkpoint.pt"), _state(out / "checkpoint.pt"))


def test_resume_rejects_a_checkpoint_of_another_run(tmp_path):
    run_main(["--loss", "bsce_gra", "--epochs", "1", "--max-steps-per-epoch", "1", "--output-dir", str(tmp_path / "a")]
             + FAST)
    with pytest.raises(ValueError, match="loss"):
        run_main(["--epochs", "2", "--loss", "cross_entropy", "--output-dir", str(tmp_path / "a"),
                  "--resume", str(tmp_path / "a" / "checkpoint.pt")] + FAST)


def test_checkpoint_is_written_atomically(tmp_path, monkeypatch):
    path = tmp_path / "ck.pt"
    ckpt_utils.save_checkpoint({"model": {}, "epoch": 1, "args": {}}, path)
    before = path.read_bytes()

    def failing_save(obj, handle):
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", failing_save)
    with pytest.raises(OSError, match="disk full"):
        ckpt_utils.save_checkpoint({"model": {}, "epoch": 2, "args": {}}, path)
    assert path.read_bytes() == before  # the old checkpoint survives a failed write
    assert [p.name for p in tmp_path.iterdir()] == ["ck.pt"]  # and no temporary file is left behind


# ----------------------------------------------------------------------------------------------- compile, amp, ddp
def test_amp_bf16_and_channels_last_on_cpu(tmp_path):
    result = run_main(["--loss", "bsce_gra", "--amp", "bf16", "--channels-last", "--epochs", "1",
                       "--max-steps-per-epoch", "2", "--output-dir", str(tmp_path / "bf16")] + FAST)
    assert result["test_logits"].dtype == torch.float32
    assert all(np.isfinite(v) for v in result["report"]["pre_T"].values())


@pytest.mark.slow
def test_compile_on_cpu(tmp_path):
    result = run_main(["--compile", "--epochs", "1", "--max-steps-per-epoch", "2", "--loss", "cross_entropy",
                       "--output-dir", str(tmp_path / "compiled")] + FAST)
    assert np.isfinite(result["report"]["pre_T"]["nll"])
    checkpoint = _state(tmp_path / "compiled" / "checkpoint.pt")
    assert not any(k.startswith("_orig_mod") for k in checkpoint["model"])  # the plain model's weights are saved


@pytest.mark.parametrize("loss", ["bsce_gra", "cross_entropy", "focal_loss"])
def test_model_and_loss_trace_into_one_graph(loss):
    """--compile's step function holds the model and the fused loss in one graph, without a graph break, so that
    torch.compile(fullgraph=True) accepts it; with a mix (λ a 0-dim tensor) too."""
    from torch._dynamo import explain

    model = build_model("small_cnn", 10, in_channels=1)
    criterion = train.build_criterion(loss, "mean", "auto")
    images, targets = torch.randn(6, 1, 8, 8), torch.randint(0, 10, (6,))
    mix = {"mix_target": targets.flip(0), "mix_lambda": torch.full((), 0.3)}
    for mix_kwargs in ({}, mix):
        report = explain(train.forward_and_loss)(model, criterion, images, targets, mix_kwargs, None)
        assert report.graph_count == 1 and report.graph_break_count == 0, report.break_reasons
        # the fused op, in the graph or in the body of the autograd.Function that wraps it
        ops = {str(node.target) for graph in report.graphs for module in graph.modules()
               if isinstance(module, torch.fx.GraphModule) for node in module.graph.nodes}
        assert any("calibkernels" in op for op in ops), sorted(ops)


@pytest.mark.slow
def test_compiled_step_with_mixup_compiles_model_and_loss_once(tmp_path):
    """A --compile run with mixup and cutmix: the step (model + loss, fullgraph=True) is traced once, not once per λ,
    with no graph break."""
    from torch._dynamo.utils import counters

    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    counters.clear()
    torch._dynamo.reset()
    result = run_main(["--compile", "--epochs", "2", "--max-steps-per-epoch", "4", "--loss", "bsce_gra",
                       "--mixup-alpha", "0.4", "--cutmix-alpha", "1.0", "--output-dir", str(tmp_path / "mixed")] + FAST)
    assert np.isfinite(result["report"]["pre_T"]["nll"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    # the step function itself was compiled, once for its 8 steps and 8 λ
    assert len(_debug_get_cache_entry_list(train.forward_and_loss.__code__)) == 1
    # the step, the evaluation model, and at most one more for the evaluation's last (smaller) batch
    assert counters["stats"]["unique_graphs"] <= 3, dict(counters["stats"])


@pytest.mark.slow
def test_compile_with_a_loss_that_splits_the_graph_still_trains(tmp_path):
    """AdaFocal's state checks split the compiled step (fullgraph is only asked of the fused family's losses)."""
    result = run_main(["--compile", "--epochs", "1", "--max-steps-per-epoch", "2", "--loss", "adafocal",
                       "--output-dir", str(tmp_path / "adafocal")] + FAST)
    assert np.isfinite(result["report"]["pre_T"]["nll"])


@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_unpadded_sampler_visits_every_sample_exactly_once(world):
    length = int(torch.randint(1, 50, ()).item())
    dataset = list(range(length))
    seen = [i for r in range(world) for i in UnpaddedDistributedSampler(dataset, num_replicas=world, rank_=r)]
    assert sorted(seen) == dataset
    assert sum(len(UnpaddedDistributedSampler(dataset, world, r)) for r in range(world)) == length


# ----------------------------------------------------------------------------------------------------------------- DDP
def test_two_process_gloo_ddp_run_reports_exactly_what_one_process_evaluates(tmp_path):
    """torchrun with 2 CPU processes (gloo): one report, written by rank 0, whose metrics — merged across ranks without
    padded duplicates — equal a single-process evaluation of the same checkpoint."""
    import subprocess
    import sys

    out = tmp_path / "ddp"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "-m", "training.train",
           "--loss", "bsce_gra", "--epochs", "2", "--max-steps-per-epoch", "2", "--eval-every", "1",
           "--output-dir", str(out)] + FAST
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600,
                            cwd=Path(__file__).resolve().parents[1])
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert result.stdout.count("test calibration") == 1, "only rank 0 reports"
    report = json.loads((out / "report.json").read_text())
    assert report["n_test"] == 1097 and report["n_val"] == 500
    assert "2 process(es)" in result.stdout
    assert evaluate_cli.cli(["--checkpoint", str(out / "checkpoint.pt"), "--output-dir", str(tmp_path / "eval")]) == 0
    single = json.loads((tmp_path / "eval" / "report.json").read_text())
    assert single["temperature"] == pytest.approx(report["temperature"])
    for tag in ("pre_T", "post_T"):
        for key, value in report[tag].items():
            assert single[tag][key] == pytest.approx(value, rel=1e-4, abs=1e-6), (tag, key)


def test_save_comparison_refuses_outputs_that_do_not_match_the_report_runs(tmp_path):
    """One (logits, labels) per run of an aggregated report, in its order: fewer would pool fewer seeds than the
    title says, more would fail inside the metrics with a shape error that does not name the cause."""
    pytest.importorskip("matplotlib")
    from training.report import save_comparison

    logits, labels = torch.randn(40, 3), torch.randint(0, 3, (40,))
    report = {"runs": [{"temperature": 1.5}, {"temperature": 2.0}, {"temperature": 1.0}],
              "pre_T": {"ece": 0.1}, "post_T": {"ece": 0.05}}
    for given in (2, 4):
        with pytest.raises(ValueError, match=f"'bsce_gra' has test outputs of {given} seed"):
            save_comparison({"bsce_gra": report}, {"bsce_gra": [(logits, labels)] * given}, tmp_path)
