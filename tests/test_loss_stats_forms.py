"""``return_stats=True`` beyond the functional call: the fused linear loss (statistics taken chunk by chunk from each
chunk's logits) and the loss modules (``ck.losses``), against :func:`calibkernels.loss_stats.top_label_stats` of the
materialised logits. The vocabulary-parallel form is tested with its ranks in tests/test_distributed.py.

The fused linear problems hold multiples of 1/4 (hidden, weight) and 1/2 (bias), so that every logit is exact in
float32 and half precision whatever the matmul's blocking: the statistics must then equal those of ``hidden @ W.T +
b`` bit for bit, ties included.
"""

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends
from calibkernels.fused_linear import FusedLinearUncertaintyWeightedCE
from calibkernels.fused_linear import fused_linear_uncertainty_weighted_ce as fused_linear
from calibkernels.loss_stats import LossStats, top_label_stats

HAS_CPU_KERNEL = _backends.unavailable_reason("cpu", torch.device("cpu")) is None
BACKENDS = ["reference"] + (["cpu"] if HAS_CPU_KERNEL else [])
# (backend, device): the CPU's, and on a machine with a GPU its fused backends
BACKEND_DEVICES = [pytest.param((name, "cpu"), id=name) for name in BACKENDS] + [
    pytest.param((name, "cuda"), id=f"{name}-cuda") for name in ("cuda", "triton")
    if torch.cuda.is_available() and _backends.unavailable_reason(name, torch.device("cuda")) is None]


def _exact_problem(n=11, h=8, c=9, dtype=torch.float32, seed=0, device="cpu"):
    """``(hidden, weight, bias, target)`` whose logits are exact in ``dtype``; rows 2 and 7 ignored; row 4 has tied
    maxima (classes 1 and 6), row 5 every class tied."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randint(-3, 4, (n, h), generator=g) * 0.25
    weight = torch.randint(-3, 4, (c, h), generator=g) * 0.25
    bias = torch.randint(-2, 3, (c,), generator=g) * 0.5
    hidden[4] = 0.0
    hidden[4, 0] = 1.0
    weight[:, 0] = 0.0
    weight[1, 0] = weight[6, 0] = 1.0
    hidden[5] = 0.0
    bias[:] = 0.0  # with hidden[5] = 0, row 5's logits are all 0
    target = torch.randint(0, c, (n,), generator=g)
    target[2] = target[7] = -100
    return hidden.to(device, dtype), weight.to(device, dtype), bias.to(device, dtype), target.to(device)


def _logits(hidden, weight, bias):
    return (hidden.double() @ weight.double().T + bias.double()).to(hidden.dtype)


def _assert_same_stats(got: LossStats, want: LossStats, what: str):
    assert isinstance(got, LossStats), what
    assert got.confidence.dtype == torch.float32 and got.prediction.dtype == torch.int64, what
    assert not got.confidence.requires_grad, what
    assert torch.equal(got.prediction, want.prediction), (what, got.prediction, want.prediction)
    # a kernel's sum of exponentials may round its last bit otherwise than top_label_stats' (ignored rows NaN)
    torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-6, atol=0, equal_nan=True, msg=what)


# ------------------------------------------------------------------------------------------------- fused linear
@pytest.mark.parametrize("backend_device", BACKEND_DEVICES)
@pytest.mark.parametrize("chunk_size", [1, 2, 4, 5, 11, None])
def test_fused_linear_stats_equal_those_of_the_full_logits_at_every_chunk_size(backend_device, chunk_size):
    backend, device = backend_device
    hidden, weight, bias, target = _exact_problem(device=device)
    logits = _logits(hidden, weight, bias)
    assert logits[4, 1] == logits[4, 6] == logits[4].max() and (logits[5] == 0).all()
    want = top_label_stats(logits, target == -100, (11,))
    for reduction in ("mean", "sum", "none"):
        leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        kw = dict(uncertainty="focal", mode="loss", gamma=2.0, reduction=reduction, backend=backend,
                  chunk_size=chunk_size)
        loss, stats = fused_linear(leaves[0], leaves[1], target, leaves[2], return_stats=True, **kw)
        _assert_same_stats(stats, want, f"{backend} chunk {chunk_size} {reduction}")
        # the loss and the gradients are those of the plain call
        plain = fused_linear(*(t.detach().requires_grad_() for t in (hidden, weight)), target,
                             bias.detach().requires_grad_(), **kw)
        torch.testing.assert_close(loss, plain, rtol=0, atol=0)
        grad_output = (torch.linspace(0.5, 1.5, 11) if reduction == "none" else torch.tensor(1.3)).to(device)
        got_grads = torch.autograd.grad(loss, leaves, grad_output)
        plain_leaves = [t.clone().requires_grad_() for t in (hidden, weight, bias)]
        want_grads = torch.autograd.grad(fused_linear(plain_leaves[0], plain_leaves[1], target, plain_leaves[2],
                                                      **kw), plain_leaves, grad_output)
        for got_grad, want_grad in zip(got_grads, want_grads):
            torch.testing.assert_close(got_grad, want_grad, rtol=0, atol=0)
        with torch.no_grad():
            _, stats = fused_linear(hidden, weight, target, bias, return_stats=True, **kw)
        _assert_same_stats(stats, want, f"{backend} chunk {chunk_size} {reduction} no_grad")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_stats_of_a_chunk_whose_rows_are_all_ignored(backend):
    hidden, weight, bias, target = _exact_problem()
    target[:4] = -100
    _, stats = fused_linear(hidden.requires_grad_(), weight, target, bias, backend=backend, chunk_size=4,
                            return_stats=True)
    _assert_same_stats(stats, top_label_stats(_logits(hidden, weight, bias), target == -100, (11,)), backend)
    assert stats.confidence[:4].isnan().all() and (stats.prediction[:4] == -1).all()


@pytest.mark.parametrize("backend_device", BACKEND_DEVICES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fused_linear_stats_in_half_precision(backend_device, dtype):
    backend, device = backend_device
    hidden, weight, bias, target = _exact_problem(dtype=dtype, device=device)
    want = top_label_stats(_logits(hidden, weight, bias), target == -100, (11,))
    loss, stats = fused_linear(hidden.requires_grad_(), weight, target, bias, backend=backend, chunk_size=3,
                               return_stats=True)
    assert loss.dtype == dtype
    _assert_same_stats(stats, want, f"{backend} {dtype}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_stats_with_soft_targets_are_the_logits_own_top_label(backend):
    hidden, weight, bias, target = _exact_problem()
    logits = _logits(hidden, weight, bias)
    valid = target.clamp(min=0)
    dense = torch.softmax(torch.randn(11, 9, generator=torch.Generator().manual_seed(1)), dim=1)
    for what, target_arg, kw, ignored in [
            ("dense", dense, {}, None),
            ("label smoothing", target, dict(label_smoothing=0.1), target == -100),
            ("mix", valid, dict(mix_target=valid.flip(0), mix_lambda=0.7), None)]:
        _, stats = fused_linear(hidden.requires_grad_(), weight, target_arg, bias, backend=backend, chunk_size=4,
                                return_stats=True, uncertainty="brier", **kw)
        _assert_same_stats(stats, top_label_stats(logits, ignored, (11,)), f"{backend} {what}")


def test_fused_linear_stats_take_the_target_batch_shape_and_check_the_flag():
    hidden, weight, bias, target = _exact_problem(n=12)
    _, stats = fused_linear(hidden.view(3, 4, -1), weight, target.view(3, 4), bias, chunk_size=5, return_stats=True)
    assert stats.confidence.shape == stats.prediction.shape == (3, 4)
    with pytest.raises(TypeError, match="return_stats"):
        fused_linear(hidden, weight, target, bias, return_stats="yes")
    with pytest.raises(TypeError, match="return_stats"):
        FusedLinearUncertaintyWeightedCE(return_stats=1)


def test_fused_linear_module_returns_the_stats():
    hidden, weight, bias, target = _exact_problem()
    module = FusedLinearUncertaintyWeightedCE(backend=BACKENDS[-1], chunk_size=3, return_stats=True)
    assert "return_stats=True" in repr(module)
    loss, stats = module(hidden, weight, target, bias)
    torch.testing.assert_close(loss, fused_linear(hidden, weight, target, bias, backend=BACKENDS[-1], chunk_size=3))
    _assert_same_stats(stats, top_label_stats(_logits(hidden, weight, bias), target == -100, (11,)), "module")


# ------------------------------------------------------------------------------------------------ loss modules
@pytest.mark.parametrize("name", ["cross_entropy", "focal_loss", "dual_focal_loss_gra", "bsce_gra",
                                  "bsce_adaptive_gra", "soft_target_bsce_gra"])
def test_loss_modules_return_the_stats_of_the_functional_call(name):
    g = torch.Generator().manual_seed(2)
    logits = torch.randn(6, 5, generator=g)
    target = torch.tensor([0, 3, -100, 1, 4, 2])
    plain = ck.losses.build(name)
    module = ck.losses.build(name, return_stats=True)
    assert "return_stats=True" in repr(module) and "return_stats" not in repr(plain)
    loss, stats = module(logits, target)
    torch.testing.assert_close(loss, plain(logits, target))
    _assert_same_stats(stats, top_label_stats(logits, target == -100, (6,)), name)


def test_official_dual_focal_gra_returns_the_stats_from_the_reference():
    logits = torch.randn(6, 5, generator=torch.Generator().manual_seed(3))
    target = torch.tensor([0, 3, -100, 1, 4, 2])
    module = ck.losses.build("dual_focal_loss_gra", gra_detach="p_j", return_stats=True)
    loss, stats = module(logits, target)
    torch.testing.assert_close(loss, ck.losses.build("dual_focal_loss_gra", gra_detach="p_j")(logits, target))
    _assert_same_stats(stats, top_label_stats(logits, target == -100, (6,)), "p_j")


def test_loss_module_flag_checks():
    with pytest.raises(TypeError, match="return_stats"):
        ck.losses.UncertaintyWeightedCE(return_stats=None)
    with pytest.raises(TypeError, match="hyper-parameter"):
        ck.losses.build("brier_loss", return_stats=True)  # no functional call, no statistics
    with pytest.raises(ValueError, match="return_stats"):
        ck.losses.build("mdca", base="focal_loss", return_stats=True)
