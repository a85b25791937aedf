"""The drop-in criterion inside a timm-style training step (docs/losses.md, "Using it in timm / torchvision
recipes"): ``timm.data.Mixup`` produces dense soft targets; ``SoftTargetUncertaintyWeightedCE(uncertainty="none")``
matches ``timm.loss.SoftTargetCrossEntropy`` in value and gradient, and BSCE-GRA trains a tiny timm model."""

import warnings

import pytest
import torch

import calibkernels as ck

timm = pytest.importorskip("timm")
from timm.data import Mixup  # noqa: E402
from timm.loss import SoftTargetCrossEntropy  # noqa: E402

NUM_CLASSES = 5


@pytest.fixture(autouse=True)
def _quiet_soft_target_warning():
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*soft targets run on the reference.*", category=RuntimeWarning)
        yield


def _tiny_model():
    return timm.create_model("resnet10t", pretrained=False, num_classes=NUM_CLASSES)


def _mixed_batch(seed, mixup_alpha=0.8, cutmix_alpha=1.0, smoothing=0.1):
    torch.manual_seed(seed)
    images = torch.randn(8, 3, 32, 32)
    target = torch.randint(0, NUM_CLASSES, (8,))
    mixup = Mixup(mixup_alpha=mixup_alpha, cutmix_alpha=cutmix_alpha, label_smoothing=smoothing,
                  num_classes=NUM_CLASSES)
    return mixup(images, target)  # images mixed in place, dense (8, C) float32 targets


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_drop_in_with_weight_none_matches_soft_target_cross_entropy(seed):
    images, soft = _mixed_batch(seed)
    assert soft.shape == (8, NUM_CLASSES) and soft.dtype == torch.float32
    logits = (torch.randn(8, NUM_CLASSES, dtype=torch.float64) * 3).float()
    ours_x, timm_x = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    ours = ck.losses.SoftTargetUncertaintyWeightedCE(uncertainty="none")(ours_x, soft)
    theirs = SoftTargetCrossEntropy()(timm_x, soft)
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6)
    ours.backward()
    theirs.backward()
    torch.testing.assert_close(ours_x.grad, timm_x.grad, rtol=1e-5, atol=1e-7)
    registry = ck.losses.build("soft_target_cross_entropy")
    torch.testing.assert_close(registry(logits, soft), theirs, rtol=1e-6, atol=1e-6)


def test_drop_in_on_a_timm_model_matches_in_value_and_parameter_gradients():
    images, soft = _mixed_batch(3)
    model = _tiny_model()
    grads = []
    for criterion in (ck.losses.SoftTargetUncertaintyWeightedCE(uncertainty="none"), SoftTargetCrossEntropy()):
        model.zero_grad(set_to_none=True)
        loss = criterion(model(images), soft)
        loss.backward()
        grads.append((loss.detach(), [p.grad.clone() for p in model.parameters() if p.grad is not None]))
    torch.testing.assert_close(grads[0][0], grads[1][0], rtol=1e-5, atol=1e-6)
    for ours, theirs in zip(grads[0][1], grads[1][1]):
        torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-6)


def test_bsce_gra_drop_in_trains_a_timm_model():
    torch.manual_seed(0)
    model = _tiny_model()
    train_loss_fn = ck.losses.build("soft_target_bsce_gra")  # in place of timm's SoftTargetCrossEntropy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    mixup = Mixup(mixup_alpha=0.8, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=NUM_CLASSES)
    images = torch.randn(16, 3, 32, 32)
    target = torch.arange(16) % NUM_CLASSES
    model.train()
    for _ in range(3):
        x, t = mixup(images.clone(), target)
        loss = train_loss_fn(model(x), t)
        optimizer.zero_grad()
        loss.backward()
        assert torch.isfinite(loss)
        assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
        optimizer.step()
    # validate_loss_fn in timm is a plain CE on class indices; the drop-in takes those too
    model.eval()
    with torch.no_grad():
        logits = model(images)
    torch.testing.assert_close(ck.losses.build("soft_target_cross_entropy")(logits, target),
                               torch.nn.functional.cross_entropy(logits, target))
    # the BSCE-GRA gradient is u_i (p_i - t_i) / N with u_i = ||p_i - t_i||_2^4
    x, t = mixup(images.clone(), target)
    logits = model(x).detach().requires_grad_()
    train_loss_fn(logits, t).backward()
    p = logits.detach().softmax(-1)
    u = ((p - t) ** 2).sum(-1) ** 2
    torch.testing.assert_close(logits.grad, u[:, None] * (p - t) / 16, rtol=1e-4, atol=1e-8)


def test_torchvision_reference_criterion_swap():
    """torchvision's references: ``criterion = nn.CrossEntropyLoss(label_smoothing=args.label_smoothing)`` becomes
    ``ck.losses.build("cross_entropy" | "bsce_gra", label_smoothing=...)``, with v2.MixUp/CutMix's dense targets."""
    from torchvision.transforms import v2

    torch.manual_seed(4)
    mixer = v2.RandomChoice([v2.MixUp(alpha=0.2, num_classes=NUM_CLASSES), v2.CutMix(alpha=1.0,
                                                                                   num_classes=NUM_CLASSES)])
    images, target = mixer(torch.randn(8, 3, 16, 16), torch.randint(0, NUM_CLASSES, (8,)))
    logits = torch.randn(8, NUM_CLASSES)
    theirs = torch.nn.CrossEntropyLoss(label_smoothing=0.1)(logits, target)
    ours = ck.losses.build("cross_entropy", label_smoothing=0.1)(logits, target)
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    assert torch.isfinite(ck.losses.build("bsce_gra", label_smoothing=0.1)(logits, target))
