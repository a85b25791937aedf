"""Meta-regularised calibration: the γ-Net, the per-sample-γ focal loss, the meta step (training/meta_learning.py),
end to end."""

import argparse
import copy
import math

import pytest
import torch
from torch import nn

import calibkernels as ck
from calibkernels import GammaNet
from training.meta_learning import META_DEFAULTS, MetaRegularizer, add_meta_args, focal_loss_with_gamma_grad


class TinyNet(nn.Module):
    """The training/models contract in miniature: ``forward = classifier ∘ features``."""

    def __init__(self, in_dim=6, width=12, num_classes=4):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(in_dim, width), nn.ReLU())
        self.classifier = nn.Linear(width, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


# ---------------------------------------------------------------------------------------------------------- γ-Net


def test_gamma_net_shape_sign_and_formula():
    d, k, tau = 10, 5, 0.7
    net = GammaNet(d, num_prototypes=k, tau=tau).double()
    x = torch.randn(33, d, dtype=torch.float64)
    gamma = net(x)
    assert gamma.shape == (33,) and gamma.dtype == torch.float64
    assert (gamma >= 0).all() and gamma.sum() > 0
    # the meta-regularisation step of docs/papers.md, step by step
    a = x @ net.prototypes
    mixed = torch.softmax(a, dim=1) @ net.prototypes.T
    expected = (mixed @ net.projection).abs().squeeze(1) / tau
    torch.testing.assert_close(gamma, expected)
    # leading dimensions are kept, float32 works, τ divides
    assert net(torch.randn(2, 3, d, dtype=torch.float64)).shape == (2, 3)
    assert net.float()(x.float()).dtype == torch.float32
    net.tau = 2 * tau
    torch.testing.assert_close(net.double()(x), expected / 2)


def test_gamma_net_gradient_reaches_both_parameters():
    net = GammaNet(8, num_prototypes=4)
    net(torch.randn(16, 8)).sum().backward()
    assert net.prototypes.grad.abs().sum() > 0 and net.projection.grad.abs().sum() > 0


def test_gamma_net_bad_arguments():
    with pytest.raises(ValueError, match="in_features"):
        GammaNet(0)
    with pytest.raises(TypeError, match="num_prototypes"):
        GammaNet(4, num_prototypes=2.5)
    with pytest.raises(ValueError, match="tau"):
        GammaNet(4, tau=0.0)
    net = GammaNet(4)
    with pytest.raises(ValueError, match=r"\(\.\.\., 4\)"):
        net(torch.randn(3, 5))
    with pytest.raises(TypeError, match="floating"):
        net(torch.ones(3, 4, dtype=torch.long))


# ------------------------------------------------------------------------------------- focal loss with per-sample γ


def test_focal_with_gamma_grad_matches_reference_and_fused_op():
    logits = torch.randn(20, 5, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 5, (20,))
    targets[3] = -100
    gamma = torch.rand(20, dtype=torch.float64) * 4
    for reduction in ("mean", "sum", "none"):
        ours = focal_loss_with_gamma_grad(logits, targets, gamma, reduction=reduction)
        reference = ck.reference.uncertainty_weighted_ce(logits, targets, uncertainty="focal", mode="loss", gamma=gamma,
                                                         reduction=reduction)
        torch.testing.assert_close(ours, reference)
        grad_ours, = torch.autograd.grad(ours.sum(), logits)
        grad_reference, = torch.autograd.grad(reference.sum(), logits)
        torch.testing.assert_close(grad_ours, grad_reference)
    # the public op (fused kernel where a backend exists, else the reference) agrees in float32
    z = logits.detach().float().requires_grad_(True)
    fused = ck.uncertainty_weighted_ce(z, targets, uncertainty="focal", mode="loss", gamma=gamma.float(),
                                       backend="auto")
    torch.testing.assert_close(fused, focal_loss_with_gamma_grad(logits, targets, gamma).float(), rtol=1e-5,
                               atol=1e-6)


def test_focal_gamma_gradient_is_finite_for_certain_predictions():
    logits = torch.tensor([[80.0, 0.0, 0.0], [0.0, 1.0, 0.0]], requires_grad=True)
    gamma = torch.tensor([2.0, 0.0], requires_grad=True)
    loss = focal_loss_with_gamma_grad(logits, torch.tensor([0, 1]), gamma, reduction="sum")
    grad_logits, grad_gamma = torch.autograd.grad(loss, (logits, gamma))
    assert torch.isfinite(grad_logits).all() and torch.isfinite(grad_gamma).all()
    assert grad_gamma[1] < 0  # raising γ lowers the weight (1 - p_y)^γ < 1 of an uncertain sample


# ------------------------------------------------------------------------------------------------------ meta step


def _problem(n_train=48, n_meta=40, in_dim=6, num_classes=4):
    x = torch.randn(n_train, in_dim, dtype=torch.float64)
    y = torch.randint(0, num_classes, (n_train,))
    xv = torch.randn(n_meta, in_dim, dtype=torch.float64)
    yv = torch.randint(0, num_classes, (n_meta,))
    return x, y, xv, yv


def _meta_objective(regularizer, model, x, y, xv, yv, lr):
    with torch.no_grad():
        features, meta_features = model.features(x), model.features(xv)
    gamma = regularizer.gamma_net(features)
    return regularizer.lookahead_objective(features, y, gamma, meta_features, yv, lr=lr)


def test_meta_step_moves_phi_downhill_on_meta_sece():
    """Backbone frozen (the optimizer holds the classifier only), so the look-ahead objective J(φ) is exactly what
    the step differentiates; one step must lower J and move φ against ∇J, which must match finite differences."""
    x, y, xv, yv = _problem()
    model = TinyNet().double()
    lr = 0.5
    optimizer = torch.optim.SGD(model.classifier.parameters(), lr=lr)
    regularizer = MetaRegularizer(model, 4, "sece", argparse.Namespace(meta_bandwidth=0.1), device="cpu")
    theta_before = copy.deepcopy(model.state_dict())
    phi_before = [p.detach().clone() for p in regularizer.gamma_net.parameters()]

    objective = _meta_objective(regularizer, model, x, y, xv, yv, lr)
    gradient = torch.autograd.grad(objective, tuple(regularizer.gamma_net.parameters()))
    assert sum(g.abs().sum() for g in gradient) > 0, "the meta objective must depend on φ"
    # the φ-gradient through the second-order look-ahead matches a central finite difference
    direction = [torch.randn_like(p) for p in phi_before]
    eps = 1e-6
    values = []
    for sign in (1.0, -1.0):
        with torch.no_grad():
            for p, p0, v in zip(regularizer.gamma_net.parameters(), phi_before, direction):
                p.copy_(p0 + sign * eps * v)
        values.append(_meta_objective(regularizer, model, x, y, xv, yv, lr).item())
    with torch.no_grad():
        for p, p0 in zip(regularizer.gamma_net.parameters(), phi_before):
            p.copy_(p0)
    analytic = sum((g * v).sum() for g, v in zip(gradient, direction)).item()
    assert (values[0] - values[1]) / (2 * eps) == pytest.approx(analytic, rel=1e-4, abs=1e-9)

    stats = regularizer.train_step(x, y, xv, yv, optimizer, {"reduction": "mean"})
    assert stats["meta_loss"] == pytest.approx(objective.item(), rel=1e-10)
    phi_after = [p.detach().clone() for p in regularizer.gamma_net.parameters()]
    step = [a - b for a, b in zip(phi_after, phi_before)]
    assert sum(s.abs().sum() for s in step) > 0
    assert sum((s * g).sum() for s, g in zip(step, gradient)) < 0  # a descent direction of J

    # J falls along the step from the same θ. A short way along it: whether the optimizer's whole first step (Adam,
    # lr-sized in every coordinate) overshoots depends on the random problem, not on the gradient being right.
    model.load_state_dict(theta_before)
    with torch.no_grad():
        for p, p0, s in zip(regularizer.gamma_net.parameters(), phi_before, step):
            p.copy_(p0 + 1e-3 * s)
    assert _meta_objective(regularizer, model, x, y, xv, yv, lr).item() < objective.item()


def test_theta_step_is_focal_sgd_with_detached_gamma_and_meta_leaves_backbone_alone():
    x, y, xv, yv = _problem()
    model = TinyNet().double()
    twin = copy.deepcopy(model)
    regularizer = MetaRegularizer(model, 4, "dece", None)
    with torch.no_grad():
        gamma = regularizer.gamma_net(twin.features(x))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    stats = regularizer.train_step(x, y, xv, yv, optimizer, {"reduction": "sum", "max_grad_norm": 1e6,
                                                             "gamma": 3.0})
    twin_loss = focal_loss_with_gamma_grad(twin(x), y, gamma, reduction="sum")
    twin_loss.backward()
    assert stats["loss"] == pytest.approx(twin_loss.item(), rel=1e-10)
    assert stats["gamma_mean"] == pytest.approx(gamma.mean().item(), rel=1e-10)
    for (name, p), q in zip(model.named_parameters(), twin.parameters()):
        # the meta step added nothing to the model's gradients: they are the focal loss's alone
        torch.testing.assert_close(p.grad, q.grad, msg=name)
        torch.testing.assert_close(p.detach(), (q - 0.1 * q.grad).detach(), msg=name)
    assert all(torch.isfinite(p).all() for p in regularizer.gamma_net.parameters())


def test_gradient_clipping_is_applied_to_the_real_step():
    x, y, xv, yv = _problem()
    model = TinyNet().double()
    regularizer = MetaRegularizer(model, 4, "sece", None)
    before = [p.detach().clone() for p in model.parameters()]
    regularizer.train_step(x, y, xv, yv, torch.optim.SGD(model.parameters(), lr=1.0),
                           {"reduction": "sum", "clip_grad_norm": 1e-3})
    moved = math.sqrt(sum(((p.detach() - b) ** 2).sum().item() for p, b in zip(model.parameters(), before)))
    assert moved == pytest.approx(1e-3, rel=1e-3)


def test_histogram_state_dict_and_arguments():
    parser = add_meta_args(argparse.ArgumentParser())
    args = parser.parse_args(["--meta-k", "3", "--meta-tau", "2.0"])
    assert args.meta_lr == META_DEFAULTS["meta_lr"] == 1e-3 and args.meta_bandwidth == 0.05
    x, y, xv, yv = _problem()
    model = TinyNet().double()
    regularizer = MetaRegularizer(model, 4, "sece", args)
    assert regularizer.gamma_net.num_prototypes == 3 and regularizer.gamma_net.tau == 2.0
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    y_ignored = y.clone()
    y_ignored[:5] = -100
    for _ in range(2):
        regularizer.train_step(x, y_ignored, xv, yv, optimizer, {})
    histogram = regularizer.gamma_histogram(bins=5)
    assert histogram["count"] == 2 * (len(y) - 5) == sum(histogram["counts"])
    assert 0 <= histogram["min"] <= histogram["quantiles"]["p50"] <= histogram["max"]
    assert len(histogram["bin_edges"]) == 6
    assert regularizer.gamma_histogram() == {"count": 0}  # reset for the next epoch

    restored = MetaRegularizer(model, 4, "sece", args)
    restored.load_state_dict(regularizer.state_dict())
    features = model.features(x).detach()
    torch.testing.assert_close(restored.gamma_net(features), regularizer.gamma_net(features))
    with pytest.raises(ValueError, match="num_prototypes"):
        MetaRegularizer(model, 4, "sece", None).load_state_dict(regularizer.state_dict())
    with pytest.raises(ValueError, match="objective"):
        MetaRegularizer(model, 4, "dece", args).load_state_dict(regularizer.state_dict())


def test_bad_configuration_raises():
    model = TinyNet()
    with pytest.raises(ValueError, match="objective"):
        MetaRegularizer(model, 4, "ece", None)
    with pytest.raises(ValueError, match="num_classes"):
        MetaRegularizer(model, 5, "sece", None)
    with pytest.raises(TypeError, match="classifier"):
        MetaRegularizer(nn.Linear(3, 4), 4, "sece", None)
    x, y, xv, yv = _problem()
    regularizer = MetaRegularizer(model.double(), 4, "sece", None)
    with pytest.raises(ValueError, match="loss_kwargs"):
        regularizer.train_step(x, y, xv, yv, torch.optim.SGD(model.parameters(), lr=0.1), {"label_smoothing": 0.1})
    with pytest.raises(ValueError, match="classifier"):
        regularizer.train_step(x, y, xv, yv, torch.optim.SGD(model.features.parameters(), lr=0.1), {})


# ------------------------------------------------------------------------------------------------------ end to end
@pytest.mark.parametrize("method", ["meta-sece", "meta-dece"])
def test_digits_recipe_end_to_end_with_meta_regularisation(tmp_path, method):
    """`python -m training.train --method meta-*` on digits: trains, logs the γ distribution every epoch, saves the
    γ-Net with the checkpoint, resumes from it, and writes the pre-/post-T report."""
    import json

    from training import checkpoint as ckpt_utils
    from training import train

    out = tmp_path / method
    common = ["--method", method, "--epochs", "2", "--max-steps-per-epoch", "2", "--eval-every", "1",
              "--no-progress", "--workers", "0", "--threads", "1", "--output-dir", str(out)]
    train.main(train.parse_args(common + ["--stop-after", "1"]))
    first = ckpt_utils.load_checkpoint(out / "checkpoint.pt")
    assert first["epoch"] == 1 and first["meta"] is not None
    train.main(train.parse_args(common + ["--resume", str(out / "checkpoint.pt")]))

    report = json.loads((out / "report.json").read_text())
    assert report["method"] == method and 0.0 <= report["pre_T"]["ece"] <= 1.0
    epochs = [json.loads(line) for line in (out / "log.jsonl").read_text().splitlines()]
    assert [row["epoch"] for row in epochs] == [1, 2]
    for row in epochs:
        gamma = row["gamma"]
        assert gamma["count"] > 0 and 0.0 <= gamma["min"] <= gamma["mean"] <= gamma["max"]
    final = ckpt_utils.load_checkpoint(out / "checkpoint.pt")
    changed = [not torch.equal(a, b) for a, b in zip(first["meta"]["gamma_net"].values(),
                                                     final["meta"]["gamma_net"].values())]
    assert changed and any(changed), "the γ-Net did not move in the resumed epoch"


META_RUN = ["--method", "meta-sece", "--no-progress", "--workers", "0", "--threads", "1"]


def test_meta_steps_update_the_model_ema(tmp_path):
    from training import train

    out = tmp_path / "ema"
    train.main(train.parse_args(META_RUN + ["--model-ema", "--model-ema-steps", "1", "--epochs", "1",
                                            "--max-steps-per-epoch", "3", "--output-dir", str(out)]))
    saved = torch.load(out / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert int(saved["model_ema"]["n_averaged"]) == 3
    ema_weights = {k[len("module."):]: v for k, v in saved["model_ema"].items() if k.startswith("module.")}
    assert not torch.equal(ema_weights["classifier.weight"], saved["model"]["classifier.weight"])  # an average


def test_meta_run_stopped_and_resumed_matches_the_uninterrupted_run(tmp_path):
    """Meta batches of 3 from a 20-image meta split: the stop after epoch 1 (4 steps) falls in the middle of a pass
    over it, so the resumed run must carry on at that pass's 13th image, and begin the next pass as the
    uninterrupted run does."""
    from training import train

    common = META_RUN + ["--meta-batch-size", "3", "--epochs", "3", "--eval-every", "3"]
    train.main(train.parse_args(common + ["--output-dir", str(tmp_path / "full")]))
    train.main(train.parse_args(common + ["--output-dir", str(tmp_path / "split"), "--stop-after", "1"]))
    train.main(train.parse_args(["--resume", str(tmp_path / "split" / "checkpoint.pt")] + META_RUN))
    full, split = (torch.load(tmp_path / name / "checkpoint.pt", map_location="cpu", weights_only=False)
                   for name in ("full", "split"))
    assert full["meta_batches"] == split["meta_batches"] == {"passes": 2, "taken": 15}  # 12 steps x 3 = 20 + 16
    for part, key in [("model", None), ("meta", "gamma_net")]:
        a, b = (full[part], split[part]) if key is None else (full[part][key], split[part][key])
        for name in a:
            torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=f"{part} {name}")


def test_compile_runs_the_meta_step_through_the_compiled_model(tmp_path, monkeypatch):
    """With --compile the θ step's forward is the compiled model's (a stand-in for torch.compile records it)."""
    from training import train

    calls = []

    class Compiled(nn.Module):
        def __init__(self, module):
            super().__init__()
            self._orig_mod = module

        def forward(self, *args, **kwargs):
            calls.append(self._orig_mod.training)
            return self._orig_mod(*args, **kwargs)

    monkeypatch.setattr(torch, "compile", lambda model=None, **kw: Compiled(model) if isinstance(model, nn.Module)
                        else model)
    train.main(train.parse_args(META_RUN + ["--compile", "--epochs", "1", "--max-steps-per-epoch", "2",
                                            "--output-dir", str(tmp_path / "compiled")]))
    assert calls.count(True) == 2  # the two training steps (evaluation runs it in eval mode)


def test_gamma_net_refuses_an_initial_gamma_of_zero():
    """W = 0 would give γ = 0 with no gradient to φ: the γ-Net could never move."""
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="init_gamma"):
            GammaNet(4, init_gamma=bad)
    net = GammaNet(4, num_prototypes=3, init_gamma=1e-3)
    net(torch.randn(5, 4)).sum().backward()
    assert net.projection.grad.abs().sum() > 0 and net.prototypes.grad.abs().sum() > 0


def test_gamma_net_refuses_a_scale_that_gives_nan_gammas():
    """τ = inf or an init_gamma·τ whose W overflows float32 used to build, then return NaN γ for every sample; a τ
    below float32's range divided by 0."""
    for kwargs in ({"tau": float("inf")}, {"tau": 1e-320}, {"init_gamma": 1e300}, {"init_gamma": 1e-30, "tau": 1e-10}):
        with pytest.raises(ValueError, match="tau|init_gamma"):
            GammaNet(4, **kwargs)
    for kwargs in ({"tau": "1.0"}, {"tau": True}, {"tau": torch.tensor(1.0)}, {"init_gamma": "1"}):
        with pytest.raises(TypeError, match="tau|init_gamma"):
            GammaNet(4, **kwargs)
    net = GammaNet(4, tau=1e-3, init_gamma=1e3)
    assert bool(net(torch.randn(5, 4)).isfinite().all())


def test_gamma_net_with_one_prototype_is_one_shared_gamma():
    """softmax over one prototype is 1: x̃ = A for every sample (documented, not per-sample)."""
    gamma = GammaNet(6, num_prototypes=1)(torch.randn(7, 6))
    torch.testing.assert_close(gamma, gamma[:1].expand(7))

