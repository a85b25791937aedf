"""The Triton backend with the drop-in options (per-class weights, the z-loss, logit soft-capping) in its kernels,
against the float64 reference and F.cross_entropy: every weight formula × mode × target kind (class indices with
ignored rows, label smoothing, a mix, a dense target) × each option alone and all together, the reductions, the
returned z-loss, the chunked (two-read) path, the capped logits' statistics, in place, no gradient, a zero
class-weighted divisor, a bad target, dual focal's refusal and opcheck of the registered op with options; runs as
``test_uncertainty_weighted_ce_triton.py`` does (CPU tensors under ``TRITON_INTERPRET=1``).
"""

import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import _validation as V

from _triton_helpers import DEVICES, GAMMAS, _close

T = pytest.importorskip("calibkernels.triton.uncertainty_weighted_ce")

pytestmark = [
    # numpy (behind the interpreter) warns where the kernel takes log2(0) or divides by 0 on a masked lane
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

OPTIONS = {
    "weight": dict(weight=True),
    "z_loss": dict(lse_square_scale=0.02),
    "softcap": dict(softcap=4.0),
    "all": dict(weight=True, lse_square_scale=0.02, softcap=4.0),
}
KINDS = ["indices", "smoothing", "mix", "dense"]
REDUCTIONS = ["mean", "sum", "none"]


@pytest.fixture
def small_block(monkeypatch):
    """Force the chunked path: rows over 8 classes are read in 4-class chunks."""
    monkeypatch.setattr(T, "MAX_BLOCK", 8)


def _case(kind, n, c, device, seed=0):
    """``(logits, target, keyword arguments)`` of one target kind, seeded: class indices with two ignored rows (also
    under smoothing and a mix, some rows mixed onto their own class), or a dense probability target."""
    generator = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, c, generator=generator) * 3).to(device)
    if kind == "dense":
        target = torch.softmax(torch.randn(n, c, generator=generator) * 2, dim=1).to(device)
        return z, target, {}
    y = torch.randint(0, c, (n,), generator=generator)
    y[torch.randperm(n, generator=generator)[:2]] = -100
    kw = {"label_smoothing": 0.1} if kind == "smoothing" else {}
    if kind == "mix":
        mix = torch.randint(0, c, (n,), generator=generator)
        mix[0] = y[0]
        kw = dict(mix_target=mix.to(device), mix_lambda=torch.rand(n, generator=generator).to(device),
                  label_smoothing=0.05)
    return z, y.to(device), kw


def _option_keywords(option, c, device, seed=1):
    kw = dict(OPTIONS[option])
    if kw.pop("weight", False):
        kw["weight"] = (torch.rand(c, generator=torch.Generator().manual_seed(seed)) * 1.5 + 0.25).to(device)
    return kw


def _loss_and_grad(z, target, backend, dtype, **kw):
    """The loss (and the returned z-loss) and the gradient of ``Σ loss`` for ``backend`` with logits in ``dtype``."""
    x = z.detach().to(dtype).requires_grad_()
    if kw.get("sample_weight") is not None:
        kw = dict(kw, sample_weight=kw["sample_weight"].to(dtype))
    if kw.get("weight") is not None:
        kw = dict(kw, weight=kw["weight"].to(dtype))
    out = ck.uncertainty_weighted_ce(x, target, backend=backend, **kw)
    loss = out[0] if isinstance(out, tuple) else out
    loss.sum().backward()
    return out, x.grad


def _check(z, target, what="", **kw):
    """The Triton backend against the float64 reference: the loss (and z-loss) and the gradient."""
    got, got_grad = _loss_and_grad(z, target, "triton", torch.float32, **kw)
    want, want_grad = _loss_and_grad(z, target, "reference", torch.float64, **kw)
    got, want = (got, want) if isinstance(got, tuple) else ((got,), (want,))
    for name, g, w in zip(("loss", "z_loss"), got, want):
        assert g.dtype == torch.float32
        _close(g.detach(), w.detach(), torch.float32, f"{what} {name}")
    _close(got_grad, want_grad, torch.float32, f"{what} gradient")


def _weight_kw(uncertainty, n, device, seed=2):
    kw = dict(uncertainty=uncertainty, gamma=GAMMAS[uncertainty])
    if uncertainty == "external":
        kw["sample_weight"] = torch.rand(n, generator=torch.Generator().manual_seed(seed)).to(device)
    return kw


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["loss", "grad"])
@pytest.mark.parametrize("uncertainty", ["none", "focal", "brier"])
def test_options_against_reference(device, uncertainty, mode, kind, option):
    """Each option alone and all together, per weight formula, mode and target kind (the reduction cycles)."""
    n, c = 6, 9
    z, target, kw = _case(kind, n, c, device)
    reduction = REDUCTIONS[(KINDS.index(kind) + list(OPTIONS).index(option)) % 3]
    _check(z, target, f"{uncertainty} {mode} {kind} {option} {reduction}", mode=mode, reduction=reduction,
           **_weight_kw(uncertainty, n, device), **kw, **_option_keywords(option, c, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["loss", "grad"])
@pytest.mark.parametrize("uncertainty", ["flsd", "brier_flsd", "external"])
def test_all_options_other_weights(device, uncertainty, mode, kind):
    n, c = 6, 9
    z, target, kw = _case(kind, n, c, device, seed=3)
    reduction = REDUCTIONS[KINDS.index(kind) % 3]
    _check(z, target, f"{uncertainty} {mode} {kind}", mode=mode, reduction=reduction,
           **_weight_kw(uncertainty, n, device), **kw, **_option_keywords("all", c, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["indices", "smoothing", "dense"])
def test_matches_cross_entropy(device, kind, reduction):
    """``uncertainty="none"`` with class weights is F.cross_entropy(weight=, label_smoothing=, ignore_index=)."""
    n, c = 7, 6
    z, target, kw = _case(kind, n, c, device, seed=4)
    w = _option_keywords("weight", c, device)["weight"]
    smoothing = kw.get("label_smoothing", 0.0)
    x = z.clone().requires_grad_()
    x_ref = z.clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(x, target, uncertainty="none", weight=w, reduction=reduction,
                                      backend="triton", **kw)
    want = F.cross_entropy(x_ref, target, weight=w, label_smoothing=smoothing, reduction=reduction,
                           ignore_index=-100)
    loss.sum().backward()
    want.sum().backward()
    torch.testing.assert_close(loss, want, rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=2e-5, atol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["indices", "dense"])
def test_return_z_loss(device, kind, reduction):
    """``return_z_loss=True``: the reduced z-loss beside the loss (both as the reference's), with and without the
    other options."""
    n, c = 6, 9
    z, target, kw = _case(kind, n, c, device, seed=5)
    for option in ("z_loss", "all"):
        _check(z, target, f"{kind} {reduction} {option}", uncertainty="focal", gamma=2.0, reduction=reduction,
               return_z_loss=True, **kw, **_option_keywords(option, c, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", ["loss", "grad"])
@pytest.mark.parametrize("uncertainty", ["focal", "brier", "flsd"])
def test_chunked_rows(small_block, device, uncertainty, mode, kind):
    """Rows of 19 classes read in 4-class chunks, a late maximum: the online max and sums across chunks."""
    n, c = 5, 19
    z, target, kw = _case(kind, n, c, device, seed=6)
    z[2, 17] = 9.0
    reduction = REDUCTIONS[KINDS.index(kind) % 3]
    _check(z, target, f"{uncertainty} {mode} {kind}", mode=mode, reduction=reduction,
           **_weight_kw(uncertainty, n, device), **kw, **_option_keywords("all", c, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("chunked", [False, True], ids=["one-block", "chunked"])
def test_statistics_of_capped_logits(monkeypatch, device, chunked):
    """``return_stats=True``: the top-label statistics of the capped logits, NaN / -1 on ignored rows."""
    if chunked:
        monkeypatch.setattr(T, "MAX_BLOCK", 8)
    n, c = 6, 19
    z, target, _ = _case("indices", n, c, device, seed=7)
    kw = dict(uncertainty="brier", softcap=2.0, return_stats=True, **_option_keywords("weight", c, device))
    loss, stats = ck.uncertainty_weighted_ce(z, target, backend="triton", **kw)
    want_loss, want_stats = ck.uncertainty_weighted_ce(z.double(), target, backend="reference",
                                                       **dict(kw, weight=kw["weight"].double()))
    _close(loss, want_loss, torch.float32, "loss")
    _close(stats.confidence, want_stats.confidence, torch.float32, "confidence")
    assert torch.equal(stats.prediction, want_stats.prediction)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", ["indices", "mix", "dense"])
def test_in_place_and_without_gradient(device, kind):
    """In place, the gradient overwrites the logits as the out-of-place call's; without a gradient the loss is the
    same."""
    n, c = 6, 9
    z, target, kw = _case(kind, n, c, device, seed=8)
    kw = dict(kw, uncertainty="focal", gamma=2.0, mode="loss", **_option_keywords("all", c, device))
    x = z.clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(x, target, backend="triton", **kw)
    loss.backward()
    leaf = z.clone().requires_grad_()
    logits = leaf * 1.0
    logits.retain_grad()
    in_place = ck.uncertainty_weighted_ce(logits, target, backend="triton", inplace=True, **kw)
    in_place.backward()
    torch.testing.assert_close(in_place, loss, rtol=0, atol=0)
    torch.testing.assert_close(leaf.grad, x.grad, rtol=0, atol=0)
    with torch.no_grad():
        torch.testing.assert_close(ck.uncertainty_weighted_ce(z, target, backend="triton", **kw), loss.detach(),
                                   rtol=0, atol=0)


@pytest.mark.parametrize("device", DEVICES)
def test_zero_class_weighted_divisor(device):
    """Every non-ignored target's class weighted 0: the class-weighted mean is 0 with gradient 0 (the z-loss part
    still divides by the count)."""
    n, c = 5, 6
    z, target, _ = _case("indices", n, c, device, seed=9)
    w = torch.ones(c, device=device)
    w[target[target != -100]] = 0.0
    _check(z, target, "zero divisor", uncertainty="focal", gamma=2.0, weight=w)
    _check(z, target, "zero divisor, z-loss", uncertainty="focal", gamma=2.0, weight=w, lse_square_scale=0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_bad_target_row_is_nan_and_flagged(device):
    """A target out of range: its row's loss and gradient are NaN and the flag names it (no out-of-bounds read)."""
    n, c = 4, 5
    z, _, _ = _case("indices", n, c, device, seed=10)
    target = torch.tensor([0, 7, -100, 2], device=device)
    loss, grad, flag = T.forward(z, target, None, None, V.WEIGHT_CODES["focal"], V.MODE_CODES["loss"], 2.0, 2.0, -100,
                                 V.REDUCTION_CODES["none"], True, None, class_weight=torch.ones(c, device=device),
                                 lse_square_scale=0.1, softcap=3.0)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all() and loss[2] == 0
    assert torch.isnan(grad[1]).all() and torch.isfinite(grad[[0, 2, 3]]).all() and (grad[2] == 0).all()
    assert flag.tolist() == [1, 7]


@pytest.mark.parametrize("device", DEVICES)
def test_dual_focal_with_options_is_not_implemented(device):
    z, target, _ = _case("indices", 4, 5, device, seed=11)
    with pytest.raises(NotImplementedError):
        T.forward(z, target, None, None, V.WEIGHT_CODES["dual_focal"], V.MODE_CODES["loss"], 2.0, 2.0, -100,
                  V.REDUCTION_CODES["mean"], True, None, softcap=3.0)


@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_with_options(device):
    """The registered op with every option (and the rows' z-loss buffer) under opcheck: gradient returned, none
    computed, in place."""
    op = torch.ops.calibkernels.uncertainty_weighted_ce_triton.default
    n, c = 6, 7
    z, target, _ = _case("indices", n, c, device, seed=12)
    w = _option_keywords("weight", c, device)["weight"]
    head = (V.WEIGHT_CODES["focal"], V.MODE_CODES["loss"], 2.0, 2.0, -100, V.REDUCTION_CODES["mean"])
    tail = (None, None, 0.1, None, None, w, 0.02, 4.0)
    torch.library.opcheck(op, (z, target, None, None, *head, True, None, *tail,
                               torch.empty(n, device=device)))
    torch.library.opcheck(op, (z, target, None, None, *head, False, None, *tail, None))
    logits = z.clone()
    torch.library.opcheck(op, (logits, target, None, None, *head, True, logits, *tail, None))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", ["indices", "dense"])
def test_16_bit_logits(device, kind, dtype):
    """16-bit logits accumulate in float32: the loss and gradient in the logits' dtype, within that dtype's
    tolerance of the float64 reference."""
    n, c = 6, 9
    z, target, kw = _case(kind, n, c, device, seed=13)
    z = z.to(dtype).float()  # the values the 16-bit logits hold
    kw = dict(kw, uncertainty="focal", gamma=2.0, mode="loss", **_option_keywords("all", c, device))
    (loss, grad), (want, want_grad) = (_loss_and_grad(z, target, "triton", dtype, **kw),
                                       _loss_and_grad(z, target, "reference", torch.float64, **kw))
    assert loss.dtype == dtype and grad.dtype == dtype
    _close(loss.detach(), want.detach(), dtype, "loss")
    _close(grad, want_grad, dtype, "gradient")


@pytest.mark.parametrize("device", DEVICES)
def test_compiled_call_with_options(device):
    """Under torch.compile(fullgraph=True) the options go through the registered op: the eager loss, z-loss and
    gradient."""
    n, c = 6, 7
    z, target, _ = _case("indices", n, c, device, seed=14)
    kw = dict(uncertainty="brier", return_z_loss=True, **_option_keywords("all", c, device))

    def step(x):
        return ck.uncertainty_weighted_ce(x, target, backend="triton", **kw)

    compiled = torch.compile(step, fullgraph=True)
    x1 = z.clone().requires_grad_()
    x2 = z.clone().requires_grad_()
    got, got_z = compiled(x1)
    got.backward()
    want, want_z = step(x2)
    want.backward()
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_z, want_z)
    torch.testing.assert_close(x1.grad, x2.grad)
