"""Training with soft targets: --label-smoothing, --mixup-alpha / --cutmix-alpha (compact and dense forms),
--model-ema and linear LR warm-up, on the embedded digits data with tiny settings."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

import calibkernels as ck
from training import soft_targets, train
from training.recipes import get_recipe

FAST = ["--no-progress", "--workers", "0", "--threads", "1"]


@pytest.fixture(autouse=True)
def _quiet_soft_target_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*soft targets run on the reference.*", category=RuntimeWarning)
        yield


def run_main(argv):
    return train.main(train.parse_args(argv))


@pytest.mark.parametrize("extra", [
    ["--label-smoothing", "0.1", "--mixup-alpha", "0.2", "--cutmix-alpha", "1.0", "--loss", "bsce_gra"],
    ["--mixup-alpha", "0.4", "--mix-dense", "--loss", "cross_entropy"],
    ["--cutmix-alpha", "1.0", "--loss", "focal_loss_gra"],
])
def test_soft_target_flags_parse_and_train(tmp_path, extra):
    out = tmp_path / "run"
    result = run_main(["--epochs", "2", "--max-steps-per-epoch", "2", "--output-dir", str(out)] + extra + FAST)
    args = json.loads((out / "args.json").read_text())
    for flag in ("label_smoothing", "mixup_alpha", "cutmix_alpha"):
        name = "--" + flag.replace("_", "-")
        if name in extra:
            assert args[flag] == float(extra[extra.index(name) + 1])
    assert args["mix_dense"] == ("--mix-dense" in extra)
    report = result["report"]
    assert 0 <= report["pre_T"]["ece"] <= 1 and report["temperature"] > 0


def test_model_ema_is_evaluated_and_reported_pre_and_post_temperature(tmp_path):
    out = tmp_path / "ema"
    result = run_main(["--loss", "bsce_gra", "--epochs", "2", "--max-steps-per-epoch", "3", "--model-ema",
                       "--model-ema-steps", "1", "--warmup-epochs", "1", "--label-smoothing", "0.1",
                       "--eval-every", "1", "--output-dir", str(out)] + FAST)
    ema_report = result["report_ema"]
    assert ema_report["model"] == "ema"
    assert {"pre_T", "post_T", "temperature"} <= set(ema_report)
    assert json.loads((out / "ema" / "report.json").read_text())["model"] == "ema"
    assert (out / "ema" / "reliability_post_T.png").is_file()
    header = (out / "log.csv").read_text().splitlines()[0].split(",")
    assert "val_ema_ece" in header and "val_ema_accuracy" in header
    checkpoint = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert checkpoint["model_ema"] is not None
    # the EMA report is of other weights than the model's: after warm-up the EMA lags the weights
    assert not torch.equal(result["test_logits"], torch.zeros(0))


def test_ema_counts_optimizer_steps_across_epochs_and_resumes_the_count(tmp_path):
    """Epochs of 2 steps with an update every 3 steps: the 3rd and 6th steps of the run update the EMA, whichever
    epoch they fall in, and a run stopped after its first epoch and resumed updates it at the same steps."""
    common = ["--loss", "bsce_gra", "--epochs", "3", "--max-steps-per-epoch", "2", "--model-ema", "--model-ema-steps",
              "3"] + FAST
    run_main(common + ["--output-dir", str(tmp_path / "full")])
    run_main(common + ["--output-dir", str(tmp_path / "split"), "--stop-after", "1"])
    run_main(common + ["--output-dir", str(tmp_path / "split"), "--resume", str(tmp_path / "split" / "checkpoint.pt")])
    full, split = (torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu", weights_only=False)
                   for name in ("full", "split"))
    assert full["optimizer_steps"] == split["optimizer_steps"] == 6
    assert int(full["model_ema"]["n_averaged"]) == int(split["model_ema"]["n_averaged"]) == 2
    for key, value in full["model_ema"].items():
        assert torch.equal(value, split["model_ema"][key]), key


def test_ema_update_is_the_exponential_average():
    model = torch.nn.Linear(3, 2)
    ema = soft_targets.make_ema(model, decay=0.9)
    ema.update_parameters(model)  # the first update copies
    before = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    ema.update_parameters(model)
    torch.testing.assert_close(ema.module.weight, 0.9 * before + 0.1 * model.weight.detach())
    assert soft_targets.ema_decay_per_update(0.99998, 32, 1024, 600) == pytest.approx(1 - 2e-5 * 1024 * 32 / 600)
    assert soft_targets.ema_decay_per_update(0.9, 32, 1024, 1) == 0.0


@pytest.mark.parametrize("scheduler", ["cosine", "multistep"])
def test_linear_warmup_learning_rates(scheduler):
    lr, epochs, warmup, decay = 0.4, 8, 3, 0.01
    optimizer = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=lr)
    sched = soft_targets.make_scheduler(optimizer, scheduler, epochs, milestones=(6,), warmup_epochs=warmup,
                                        warmup_decay=decay)
    seen = []
    for _ in range(epochs):
        seen.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        sched.step()
    for e in range(warmup):  # linear from decay·lr to lr
        assert seen[e] == pytest.approx(lr * (decay + (1 - decay) * e / warmup))
    assert seen[warmup] == pytest.approx(lr)
    if scheduler == "cosine":
        import math

        for e in range(warmup, epochs):
            assert seen[e] == pytest.approx(lr * 0.5 * (1 + math.cos(math.pi * (e - warmup) / (epochs - warmup))))
    else:
        assert seen[5] == pytest.approx(lr) and seen[6] == pytest.approx(lr * 0.1)


def test_warmup_flag_reaches_the_optimizer(tmp_path):
    out = tmp_path / "w"
    run_main(["--loss", "bsce_gra", "--epochs", "3", "--max-steps-per-epoch", "1", "--warmup-epochs", "2",
              "--warmup-decay", "0.1", "--lr", "0.05", "--output-dir", str(out)] + FAST)
    rows = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    # the log records the lr each epoch trained at: the warm-up's 0.1·lr and (0.1 + 0.9/2)·lr, then lr
    assert [row["lr"] for row in rows] == pytest.approx([0.05 * 0.1, 0.05 * 0.55, 0.05])


@pytest.mark.parametrize("weight", ["none", "focal", "flsd", "brier"])
@pytest.mark.parametrize("use_cutmix", [False, True])
def test_compact_mix_gives_the_dense_form_loss(weight, use_cutmix):
    torch.manual_seed(3)
    images = torch.randn(6, 1, 8, 8)
    target = torch.randint(0, 10, (6,))
    mixed, partner, lam = soft_targets.mix_batch(images, 0.0 if use_cutmix else 0.4, 1.0 if use_cutmix else 0.0)
    assert 0.0 <= lam <= 1.0
    if use_cutmix:  # λ is the share of pixels kept from each image
        kept = (mixed == images).all(dim=1).float().mean(dim=(1, 2))
        assert float(kept[0]) == pytest.approx(lam) or torch.equal(images[0], images[5])
    else:
        torch.testing.assert_close(mixed, lam * images + (1 - lam) * images.flip(0))
    logits = torch.randn(6, 10, dtype=torch.float64)
    criterion = ck.losses.UncertaintyWeightedCE(uncertainty=weight, gamma=2.0, label_smoothing=0.1)
    compact = criterion(logits, target, mix_target=target[partner], mix_lambda=lam)
    dense = criterion(logits, soft_targets.dense_targets(target, partner, lam, 10, torch.float64))
    torch.testing.assert_close(compact, dense, rtol=1e-12, atol=1e-12)


def test_bad_soft_target_flags_are_refused():
    base = ["--epochs", "2"] + FAST
    for extra, message in ((["--label-smoothing", "1.5"], "label-smoothing"),
                           (["--mixup-alpha", "-1"], "mixup-alpha"),
                           (["--warmup-epochs", "2"], "warmup-epochs"),
                           (["--mixup-alpha", "0.2", "--loss", "brier_loss"], "weighted CE family"),
                           (["--mixup-alpha", "0.2", "--loss", "dual_focal_loss"], "dual focal"),
                           (["--cutmix-alpha", "1.0", "--loss", "soft_target_bsce_gra"], "add --mix-dense")):
        with pytest.raises(ValueError, match=message):
            train.resolve_run_config(train.parse_args(base + extra))
    # timm's signature takes the dense form of the same mix
    train.resolve_run_config(train.parse_args(base + ["--cutmix-alpha", "1.0", "--mix-dense",
                                                      "--loss", "soft_target_bsce_gra"]))


def test_torchvision_new_recipe_variant():
    recipe = get_recipe("imagenet-resnet50-finetune-tvnew")
    assert (recipe.label_smoothing, recipe.mixup_alpha, recipe.cutmix_alpha) == (0.1, 0.2, 1.0)
    assert recipe.model_ema and (recipe.model_ema_decay, recipe.model_ema_steps) == (0.99998, 32)
    assert (recipe.warmup_epochs, recipe.warmup_decay, recipe.scheduler) == (5, 0.01, "cosine")
    assert (recipe.lr, recipe.batch_size, recipe.weight_decay, recipe.optimizer) == (0.5, 1024, 2e-5, "sgd")
