"""Loss options of the training recipes (training/loss_schedules.py): the FLSc γ schedule and its switch epochs, the
cross-entropy warm-up, AdaFocal's per-epoch validation update (resumed from checkpoints), and the recipes' MMCE form
with the papers' sum-reduction balance."""

from __future__ import annotations

import csv
import math

import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import reference as R
from training import checkpoint as ckpt_utils
from training import train
from training.loss_schedules import LossSchedule, parse_epochs, switch_epochs
from training.recipes import RECIPES, get_recipe

FAST = ["--no-progress", "--workers", "0", "--threads", "1", "--max-steps-per-epoch", "1", "--eval-every", "100"]


def run_main(argv):
    return train.main(train.parse_args(argv))


def _log(path):
    with (path / "log.csv").open() as handle:
        return list(csv.DictReader(handle))


# ------------------------------------------------------------------------------------------------- switch epochs
def test_switch_epochs_follow_the_recipes_and_scale_with_the_run():
    cifar, tiny, digits = get_recipe("cifar10-resnet50"), get_recipe("tinyimagenet-resnet50"), get_recipe("digits")
    assert switch_epochs(350, cifar.gamma_schedule_epochs, cifar.epochs) == (100, 250)   # Mukhoti et al.'s CIFAR
    assert switch_epochs(100, tiny.gamma_schedule_epochs, tiny.epochs) == (30, 70)       # their Tiny-ImageNet script
    assert switch_epochs(175, cifar.gamma_schedule_epochs, cifar.epochs) == (50, 125)
    assert digits.gamma_schedule_epochs == ()
    assert switch_epochs(300, (), digits.epochs) == (86, 214)                           # CIFAR's 100/250 of 350
    assert switch_epochs(300, (), 300, given=parse_epochs("10,20")) == (10, 20)
    for bad in ("20,10", "0,5", "5,400", "5"):
        with pytest.raises(ValueError, match="gamma-schedule-epochs"):
            switch_epochs(300, (), 300, given=parse_epochs(bad))


def test_schedule_sets_gamma_by_epoch_and_warms_up_with_cross_entropy():
    focal = ck.losses.build("focal_loss")
    warm = ck.losses.build("cross_entropy")
    schedule = LossSchedule(focal, gamma_schedule="flsc-531", switch=(3, 6), ce_warmup_epochs=2,
                            warmup_criterion=warm)
    seen = [(schedule.criterion_for(e) is focal, focal.gamma) for e in range(8)]
    assert [s[0] for s in seen] == [False, False, True, True, True, True, True, True]
    assert [g for used, g in seen if used] == [5.0, 3.0, 3.0, 3.0, 1.0, 1.0]
    assert [schedule.gamma_at(e) for e in (0, 2, 3, 5, 6)] == [5.0, 5.0, 3.0, 3.0, 1.0]
    mdca = ck.losses.build("mdca", base="focal_loss")
    LossSchedule(mdca, gamma_schedule="flsc-532", switch=(1, 2)).criterion_for(5)
    assert mdca.base.gamma == 2.0
    for name in ("cross_entropy", "mmce", "adafocal", "mdca", "mbls"):
        with pytest.raises(ValueError, match="single γ"):
            LossSchedule(ck.losses.build(name), gamma_schedule="flsc-531", switch=(1, 2))


def test_run_config_takes_the_recipe_options_and_checks_them():
    args = train.resolve_run_config(train.parse_args(["--loss", "focal_loss"]))
    assert (args.gamma_schedule, args.ce_warmup_epochs, args.mmce_form) == ("none", 0, "papers_code")
    args = train.resolve_run_config(train.parse_args(["--loss", "focal_loss", "--gamma-schedule", "flsc-531",
                                                      "--ce-warmup-epochs", "4"]))
    assert (args.gamma_schedule, args.ce_warmup_epochs) == ("flsc-531", 4)
    for argv, message in ((["--loss", "bsce_gra", "--ce-warmup-epochs", "300"], "ce-warmup"),
                          (["--loss", "cross_entropy", "--gamma-schedule", "flsc-531"], "single γ"),
                          (["--loss", "focal_loss", "--gamma-schedule", "flsc-531", "--gamma-schedule-epochs", "9"],
                           "gamma-schedule-epochs"),
                          (["--method", "meta-sece", "--gamma-schedule", "flsc-531"], "method standard")):
        with pytest.raises(ValueError, match=message):
            train.resolve_run_config(train.parse_args(argv))


def test_training_runs_the_schedule_epoch_by_epoch(tmp_path):
    out = tmp_path / "flsc"
    run_main(["--loss", "focal_loss", "--gamma-schedule", "flsc-531", "--gamma-schedule-epochs", "2,3",
              "--ce-warmup-epochs", "1", "--epochs", "4", "--output-dir", str(out)] + FAST)
    rows = _log(out)
    assert [row["loss_phase"] for row in rows] == ["ce_warmup", "loss", "loss", "loss"]
    assert rows[0]["loss_gamma"] == "nan" and [float(r["loss_gamma"]) for r in rows[1:]] == [5.0, 3.0, 1.0]


def test_resume_with_more_epochs_keeps_the_switch_epochs_it_started_with(tmp_path):
    out = tmp_path / "flsc"
    run_main(["--loss", "focal_loss", "--gamma-schedule", "flsc-531", "--epochs", "4", "--stop-after", "2",
              "--output-dir", str(out)] + FAST)  # 4 epochs: switches at 1 and 3 (CIFAR's 100, 250 of 350)
    assert ckpt_utils.load_checkpoint(out / "checkpoint.pt")["args"]["gamma_schedule_epochs"] == "1,3"
    run_main(["--resume", str(out / "checkpoint.pt"), "--epochs", "6"] + FAST)  # 6 epochs alone would switch at 2, 4
    assert [float(row["loss_gamma"]) for row in _log(out)] == [5.0, 3.0, 3.0, 1.0, 1.0, 1.0]


# ------------------------------------------------------------------------------------------------- AdaFocal
def test_adafocal_updates_every_epoch_and_resumes_its_table(tmp_path):
    common = ["--loss", "adafocal", "--epochs", "2", "--seed", "2"] + FAST
    run_main(common + ["--output-dir", str(tmp_path / "full")])
    full = ckpt_utils.load_checkpoint(tmp_path / "full" / "checkpoint.pt")["loss_state"]["_extra_state"]
    assert full["updates"] == 2 and full["gamma"] != [1.0] * 15
    run_main(common + ["--output-dir", str(tmp_path / "split"), "--stop-after", "1"])
    first = ckpt_utils.load_checkpoint(tmp_path / "split" / "checkpoint.pt")["loss_state"]["_extra_state"]
    assert first["updates"] == 1
    run_main(common + ["--output-dir", str(tmp_path / "split"), "--resume", str(tmp_path / "split" / "checkpoint.pt")])
    resumed = ckpt_utils.load_checkpoint(tmp_path / "split" / "checkpoint.pt")["loss_state"]["_extra_state"]
    assert resumed == full


# ------------------------------------------------------------------------------------------------- MMCE form
def test_recipes_pin_the_mmce_form_of_the_published_numbers():
    for recipe in RECIPES.values():
        assert recipe.mmce_form == "papers_code"
        for name in ("mmce", "mmce_weighted"):
            assert train.build_criterion(name, recipe.reduction, "auto", mmce_form=recipe.mmce_form).form == \
                "papers_code"
    assert train.build_criterion("mmce_weighted:form=kumar", "sum", "auto", mmce_form="papers_code").form == "kumar"
    assert train.build_criterion("bsce_gra", "sum", "auto", mmce_form="papers_code").gamma == 4.0  # others untouched


@pytest.mark.parametrize("weighted", [False, True])
def test_summed_mmce_is_the_papers_batch_size_times_mean_ce_plus_lambda_mmce(weighted):
    """The focal-loss / BSCE-GRA code trains MMCE with ``len(data) * (F.cross_entropy(logits, y) + λ · MMCE)``."""
    g = torch.Generator().manual_seed(0)
    z, y = torch.randn(32, 10, dtype=torch.float64, generator=g) * 3, torch.randint(0, 10, (32,), generator=g)
    name = "mmce_weighted" if weighted else "mmce"
    criterion = train.build_criterion(f"{name}:lam=2", "sum", "auto", mmce_form="papers_code")
    papers = len(z) * (F.cross_entropy(z, y) + 2.0 * R.mmce(z, y, weighted=weighted, form="papers_code"))
    torch.testing.assert_close(criterion(z, y), papers)


def test_mmce_run_says_which_form_it_trains(tmp_path, capsys):
    run_main(["--loss", "mmce_weighted:lam=2", "--epochs", "1", "--output-dir", str(tmp_path / "m")] + FAST)
    assert "(MMCE form papers_code)" in capsys.readouterr().out
    assert math.isfinite(float(_log(tmp_path / "m")[0]["train_loss"]))
