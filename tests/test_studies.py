"""Tests of the two studies (training/studies): the toy study's analytic posterior, the closed-form per-sample
last-layer gradient norm, and both command-line scripts end to end at a tiny size."""

import json
import math

import pytest
import torch

from training.studies import gradient_vs_uncertainty as gvu
from training.studies import toy_posterior as toy

scipy_stats = pytest.importorskip("scipy.stats")


# ------------------------------------------------------------------------------------------------------ toy posterior
def test_true_posterior_rows_sum_to_one_even_far_from_the_means():
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    means = toy.sample_means(5, -3.0, 3.0, generator)
    covariance = torch.tensor([[1.5, 0.4], [0.4, 0.7]], dtype=torch.float64)
    x = torch.cat([torch.randn(200, 2, dtype=torch.float64) * 3, torch.tensor([[1e3, -1e3], [-500.0, 200.0]])])
    posterior = toy.true_posterior(x, means, covariance)
    assert posterior.shape == (202, 5)
    assert torch.isfinite(posterior).all() and (posterior >= 0).all()
    torch.testing.assert_close(posterior.sum(dim=1), torch.ones(202, dtype=torch.float64))


def test_true_posterior_matches_bayes_rule_by_hand():
    # Two unit-variance classes at (0, 0) and (2, 0); at x = (0, 0) the densities are ∝ e^0 and e^{-2}.
    means = torch.tensor([[0.0, 0.0], [2.0, 0.0]], dtype=torch.float64)
    covariance = torch.eye(2, dtype=torch.float64)
    posterior = toy.true_posterior(torch.zeros(1, 2), means, covariance)
    expected_first = 1.0 / (1.0 + math.exp(-2.0))
    torch.testing.assert_close(posterior[0], torch.tensor([expected_first, 1 - expected_first], dtype=torch.float64))
    # Unequal priors 3:1 multiply the odds by 3.
    posterior = toy.true_posterior(torch.zeros(1, 2), means, covariance, priors=[3.0, 1.0])
    expected_first = 3.0 / (3.0 + math.exp(-2.0))
    torch.testing.assert_close(posterior[0, 0], torch.tensor(expected_first, dtype=torch.float64))


def test_true_posterior_matches_scipy_densities():
    means = torch.randn(4, 2, dtype=torch.float64) * 2
    a = torch.randn(2, 2, dtype=torch.float64)
    covariance = a @ a.T + 0.5 * torch.eye(2, dtype=torch.float64)
    priors = torch.rand(4, dtype=torch.float64) + 0.1
    x = torch.randn(50, 2, dtype=torch.float64) * 2
    densities = torch.stack([torch.from_numpy(scipy_stats.multivariate_normal(m.numpy(), covariance.numpy()).pdf(
        x.numpy())) for m in means], dim=1) * priors
    expected = densities / densities.sum(dim=1, keepdim=True)
    torch.testing.assert_close(toy.true_posterior(x, means, covariance, priors=priors), expected)


def test_sampled_classes_have_the_requested_moments():
    generator = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    means = torch.tensor([[1.0, -2.0], [-3.0, 0.5]], dtype=torch.float64)
    covariance = torch.tensor([[2.0, 0.6], [0.6, 0.5]], dtype=torch.float64)
    x, y = toy.sample_gaussian_classes(means, covariance, 20_000, generator)
    assert x.shape == (40_000, 2) and torch.equal(torch.bincount(y), torch.tensor([20_000, 20_000]))
    for k in range(2):
        points = x[y == k]
        torch.testing.assert_close(points.mean(0), means[k], atol=0.05, rtol=0)
        torch.testing.assert_close(torch.cov(points.T), covariance, atol=0.08, rtol=0)


@pytest.mark.parametrize("covariance", [[[1.0, 0.5], [0.0, 1.0]], [[1.0, 2.0], [2.0, 1.0]], [[1.0]]])
def test_bad_covariance_is_rejected(covariance):
    with pytest.raises(ValueError, match="covariance"):
        toy.check_covariance(torch.tensor(covariance))


def test_pearson_matches_numpy():
    a, b = torch.randn(100), torch.randn(100)
    b = b + 0.5 * a
    assert toy.pearson(a, b) == pytest.approx(float(torch.corrcoef(torch.stack([a, b]))[0, 1]), abs=1e-6)
    assert math.isnan(toy.pearson(a, torch.ones(100)))


def test_toy_study_runs_end_to_end(tmp_path, capsys):
    result = toy.main(["--seeds", "3", "4", "--train-per-class", "200", "--test-per-class", "60",
                       "--selection-per-class", "60", "--epochs", "2", "--gammas", "1", "2", "--norms", "1", "2",
                       "--output-dir", str(tmp_path)])
    table = capsys.readouterr().out
    for label in ("FL", "DFL", "gBS"):
        assert label in table
    saved = json.loads((tmp_path / "toy_posterior.json").read_text())
    assert set(saved["summary"]) == {"focal", "dual_focal", "brier"}
    for row in saved["summary"].values():
        assert len(row["test_per_seed"]) == 2 and all(-1 <= r <= 1 for r in row["test_per_seed"])
    # gBS with q = 1 is 2^γ · FL, so the same correlation: the searched gBS family can never lose to FL's.
    run = result["runs"][0]["test"]["correlations"]
    assert run["brier(q=1,γ=2)"] == pytest.approx(run["focal(γ=2)"], abs=1e-9)
    assert (tmp_path / "toy_posterior.md").read_text().count("|") > 10
    assert (tmp_path / "toy_posterior_scatter.png").stat().st_size > 1000


def test_toy_cli_rejects_odd_means():
    with pytest.raises(ValueError, match="--means"):
        toy.main(["--means", "0", "0", "1", "--no-plot"])


# --------------------------------------------------------------------------------------------- gradient vs uncertainty
@pytest.mark.parametrize("loss_name", ["CE", "FL", "DFL", "BSCE-GRA"])
@pytest.mark.parametrize("include_bias", [True, False])
def test_closed_form_last_layer_gradient_norm_matches_autograd(loss_name, include_bias):
    n, d, c = 7, 5, 4
    features = torch.randn(n, d, dtype=torch.float64)
    classifier = torch.nn.Linear(d, c, bias=include_bias).double()
    target = torch.randint(0, c, (n,))
    spec = gvu.loss_specs()[loss_name]
    with torch.no_grad():
        logits = classifier(features)
    closed_form = gvu.last_layer_gradient_norms(
        features, gvu.per_sample_logit_gradients(logits, target, **spec), include_bias=include_bias)

    from calibkernels.reference import uncertainty_weighted_ce

    for i in range(n):  # the per-sample loop the closed form avoids, as the independent check
        loss = uncertainty_weighted_ce(classifier(features[i:i + 1]), target[i:i + 1], reduction="sum", **spec)
        grads = torch.autograd.grad(loss, list(classifier.parameters()))
        expected = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        torch.testing.assert_close(closed_form[i], expected)


def test_focal_logit_gradient_is_g_times_the_ce_gradient():
    """Mukhoti et al.: ∂L_FL/∂z = g(p_y, γ) (p - e_y), which checks both g(p, γ) and the loss-mode autograd path."""
    logits = torch.randn(32, 6, dtype=torch.float64) * 2
    target = torch.randint(0, 6, (32,))
    gamma = float(torch.empty(()).uniform_(0.5, 5))
    focal = gvu.per_sample_logit_gradients(logits, target, uncertainty="focal", mode="loss", gamma=gamma, norm=2.0)
    ce = gvu.per_sample_logit_gradients(logits, target, uncertainty="none", mode="grad", gamma=0.0, norm=2.0)
    p_target = torch.softmax(logits, 1).gather(1, target[:, None]).squeeze(1)
    torch.testing.assert_close(focal, gvu.focal_gradient_weight(p_target, gamma)[:, None] * ce)


def test_focal_gradient_weight_rises_then_falls():
    p = torch.linspace(0.001, 0.999, 999, dtype=torch.float64)
    g = gvu.focal_gradient_weight(p, 3.0)
    peak = int(g.argmax())
    assert 0 < peak < 998 and g[peak] > 1.0
    assert (g[1:peak + 1] >= g[:peak]).all() and (g[peak + 1:] <= g[peak:-1]).all()


def test_brier_scores_match_definition():
    logits = torch.randn(10, 3)
    target = torch.randint(0, 3, (10,))
    expected = (torch.softmax(logits.double(), 1) - torch.nn.functional.one_hot(target, 3)).pow(2).sum(1)
    torch.testing.assert_close(gvu.brier_scores(logits, target), expected)


def test_gradient_study_runs_end_to_end_on_a_digits_checkpoint(tmp_path):
    from training.checkpoint import save_checkpoint
    from training.models import build_model

    model = build_model("small_cnn", 10, in_channels=1)
    args = {"recipe": "digits", "loss": "cross_entropy", "arch": "small_cnn", "num_classes": 10, "seed": 0,
            "model_kwargs": {"in_channels": 1}}
    path = save_checkpoint({"model": model.state_dict(), "epoch": 0, "args": args}, tmp_path / "digits.pt")
    out = tmp_path / "out"
    result = gvu.main(["--checkpoint", str(path), "--max-samples", "48", "--batch-size", "16",
                       "--output-dir", str(out), "--figure1-gammas", "1", "3"])
    (row,) = result["checkpoints"]
    assert row["samples"] == 48 and set(row["losses"]) == {"CE", "FL", "DFL", "BSCE-GRA"}
    assert all(math.isfinite(v["mean_grad_norm"]) and v["mean_grad_norm"] > 0 for v in row["losses"].values())
    for name in ("focal_gradient_weight.png", "gradient_vs_uncertainty.png"):
        assert (out / name).stat().st_size > 1000
    assert json.loads((out / "gradient_vs_uncertainty.json").read_text())["checkpoints"][0]["samples"] == 48


def test_explained_variance_is_one_for_a_function_of_the_bin_and_small_for_noise():
    brier = torch.rand(4000, dtype=torch.float64) * 2
    bin_index = (brier / 2 * 40).floor()
    assert gvu.explained_variance(torch.sin(bin_index), brier) == pytest.approx(1.0, abs=1e-9)
    assert gvu.explained_variance(torch.randn(4000, dtype=torch.float64), brier) < 0.05


def test_gradient_study_rebuilds_the_split_the_run_used():
    """The run's --image-size, --synthetic images and (meta methods) meta split, as training.evaluate rebuilds them."""
    args = {"recipe": "cifar10-resnet50", "seed": 3, "image_size": 16, "synthetic": True, "synthetic_size": 40,
            "method": "meta-sece", "meta_fraction": 0.25}
    test = gvu.load_split({"args": args}, "test", None, None)
    train = gvu.load_split({"args": args}, "train", None, None)
    assert test[0][0].shape == (3, 16, 16) and len(train) == 30  # 40 less the meta split's quarter


@pytest.mark.parametrize("study, argv, expected", [
    ("gradient", ["--checkpoint", "{tmp}/missing.pt"], "does not exist"),
    ("gradient", ["--checkpoint", "{tmp}/missing.pt", "--device", "cpu:7x"], "not a device"),
    ("toy", ["--gammas", "-1"], "--gammas"),
    ("toy", ["--epochs", "two"], "--epochs"),
])
def test_study_command_line_errors_are_one_line(tmp_path, capsys, study, argv, expected):
    cli = gvu.cli if study == "gradient" else toy.cli
    argv = [arg.format(tmp=tmp_path) for arg in argv] + ["--output-dir", str(tmp_path / "out")]
    try:
        rc = cli(argv)
    except SystemExit as exc:  # an argparse usage error
        rc = exc.code
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()
