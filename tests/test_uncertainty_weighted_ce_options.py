"""Every fused backend with the drop-in options (class weights ``weight=``, the z-loss ``lse_square_scale`` /
``return_z_loss``, soft-capping ``softcap``; docs/losses.md, "Coming from F.cross_entropy / Liger-Kernel") computed in
its kernels, against the float64 reference and F.cross_entropy.

Written once against conftest.py's ``backend`` fixture (the C++ kernel on CPU tensors, the Triton kernel on CPU tensors
under ``TRITON_INTERPRET=1``, and on a GPU machine the CUDA and Triton kernels on CUDA tensors): every uncertainty
weight but dual focal × mode × reduction × target kind (class indices with ignored rows, label smoothing, a mix, a dense
target) × each option alone and all together, in float64 where the backend takes it and float32 on Triton, and in
16-bit; ``uncertainty="none"`` as F.cross_entropy(weight=, label_smoothing=, ignore_index=, reduction=) and the z-loss
on top of it; the returned and per-row z-loss; a class-weighted mean whose divisor is 0; -inf logits under the cap; the
statistics of the capped logits; in place and without a gradient; a bad target; dual focal's refusal; opcheck of the
backend's op and torch.compile(fullgraph=True). The interpreter (slow) takes a sub-grid of each grid. Two checks
concern one kernel only: the Triton kernel's chunked path (rows wider than its block) and the CUDA kernel's launch
shapes (class counts at its thresholds).

Tolerance: at float64, 1e-10 relative per entry and 64 ulps of the largest entry; below, the reference's own error at
the logits' precision (``assert_within_reference_error``) and a fixed fraction of the largest entry
(``assert_within_largest_entry``), both from ``_tolerance.py``.
"""

import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import _backends
from calibkernels import _validation as V
from calibkernels.loss_stats import top_label_stats

from _cuda_helpers import SHAPE_PATHS
from _tolerance import assert_within_largest_entry, assert_within_reference_error

pytestmark = [
    # numpy (behind the Triton interpreter) warns where a kernel takes log2(0) or divides by 0 on a masked lane
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]

# dual focal takes no options in the fused kernels (the ops refuse it; Python routes it to the reference)
WEIGHTS = ["none", "focal", "flsd", "brier", "external", "brier_flsd"]
# brier_flsd's γ (the band p_y ≥ 0.5) differs from its other bands' 5 and 3, so a row in the wrong band shows
GAMMAS = {"none": 0.0, "focal": 2.0, "flsd": 3.0, "brier": 4.0, "external": 0.0, "brier_flsd": 1.5}
MODES = ["loss", "grad"]
REDUCTIONS = ["mean", "sum", "none"]
KINDS = ["indices", "smoothing", "mix", "dense"]
OPTIONS = {
    "weight": dict(weight=True),
    "z_loss": dict(lse_square_scale=0.02),
    "softcap": dict(softcap=4.0),
    "all": dict(weight=True, lse_square_scale=0.02, softcap=4.0),
}
DTYPE_IDS = {torch.float64: "fp64", torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


# ---------------------------------------------------------------------------------------------------------- helpers
def _precisions(backend):
    """The logits' dtypes the value checks take: float64 where the backend runs it, and float32 (the Triton kernels
    take no float64)."""
    return [torch.float32] if backend.name == "triton" else [torch.float64, torch.float32]


def _case(kind, n, c, device, dtype=torch.float32, seed=0):
    """``(logits, target, soft-target keywords, class weights, sample weights)`` of one target kind, every draw from a
    generator seeded with ``seed``: logits in ``dtype``; class indices with two ignored rows (also under smoothing and
    a mix, whose first non-ignored row mixes onto its own class), or a dense probability target; the floating
    arguments in float64 for float64 logits, else float32."""
    generator = torch.Generator().manual_seed(seed)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    z = (torch.randn(n, c, generator=generator, dtype=torch.float64) * 3).to(dtype)
    y = torch.randint(0, c, (n,), generator=generator)
    y[torch.randperm(n, generator=generator)[:2]] = -100
    soft = {}
    if kind == "smoothing":
        soft = {"label_smoothing": 0.1}
    elif kind == "mix":
        mix = torch.randint(0, c, (n,), generator=generator)
        own = int((y != -100).nonzero()[0])
        mix[own] = y[own]
        soft = dict(mix_target=mix.to(device), mix_lambda=torch.rand(n, generator=generator).to(wide).to(device),
                    label_smoothing=0.05)
    elif kind == "dense":
        y = torch.softmax(torch.randn(n, c, generator=generator, dtype=torch.float64) * 2, dim=1).to(wide)
    class_weight = (torch.rand(c, generator=generator, dtype=torch.float64) * 1.5 + 0.25).to(wide)
    sample_weight = (torch.rand(n, generator=generator, dtype=torch.float64) + 0.5).to(wide)
    return z.to(device), y.to(device), soft, class_weight.to(device), sample_weight.to(device)


def _options(option, class_weight):
    """The keywords of ``OPTIONS[option]``, the class weights ``class_weight`` where it takes them."""
    keywords = dict(OPTIONS[option])
    if keywords.pop("weight", False):
        keywords["weight"] = class_weight
    return keywords


def _weight_keywords(uncertainty, sample_weight):
    keywords = dict(uncertainty=uncertainty, gamma=GAMMAS[uncertainty])
    if uncertainty == "external":
        keywords["sample_weight"] = sample_weight
    return keywords


def _loss_and_grad(name, z, target, **kw):
    """``(outputs, gradient of Σ loss)`` of ``ck.uncertainty_weighted_ce`` on backend ``name``: the loss, and the
    reduced z-loss after it with ``return_z_loss=True``."""
    x = z.detach().clone().requires_grad_()
    out = ck.uncertainty_weighted_ce(x, target, backend=name, **kw)
    outputs = out if isinstance(out, tuple) else (out,)
    (grad,) = torch.autograd.grad(outputs[0].sum(), x)
    return tuple(o.detach() for o in outputs), grad


def _float64(value):
    return value.double() if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def _assert_close(got, exact, at_precision, dtype, what, largest_entry=True):
    """``got`` (logits of ``dtype``) against the float64 ``exact``: at float64 within 1e-10 relative per entry and 64
    ulps of the largest entry, below within the reference's own error ``at_precision`` (and, with ``largest_entry``,
    a fixed fraction of the largest entry)."""
    if dtype == torch.float64:
        torch.testing.assert_close(got, exact, rtol=1e-10, atol=1e-12, msg=lambda m: f"{what}: {m}")
        assert_within_reference_error(got, exact, exact, dtype, what)
        return
    assert_within_reference_error(got, exact, at_precision, dtype, what)
    if largest_entry:
        assert_within_largest_entry(got, exact, dtype, what)


def _check(backend, z, target, what="", largest_entry=True, **kw):
    """The backend's loss (and returned z-loss) and gradient of ``Σ loss`` against the float64 reference of the same
    values (:func:`_assert_close`); every output in the logits' dtype."""
    dtype = z.dtype
    got, grad = _loss_and_grad(backend.name, z, target, **kw)
    exact, exact_grad = _loss_and_grad("reference", z.double(), _float64(target),
                                       **{k: _float64(v) for k, v in kw.items()})
    low, low_grad = (exact, exact_grad) if dtype == torch.float64 else _loss_and_grad("reference", z, target, **kw)
    assert grad.dtype == dtype and all(out.dtype == dtype for out in got), f"{what}: dtypes"
    for name, g, e, lo in zip(("loss", "z_loss"), got, exact, low):
        _assert_close(g, e, lo, dtype, f"{what} {name}", largest_entry)
    _assert_close(grad, exact_grad, low_grad, dtype, f"{what} gradient", largest_entry)
    return got, grad


def _op_call(backend, logits, target, *, uncertainty="focal", mode="loss", gamma=2.0, norm=2.0, sample_weight=None,
             ignore_index=-100, reduction="mean", compute_grad=True, grad_out=None, mix_target=None, mix_lambda=None,
             label_smoothing=0.0, class_weight=None, lse_square_scale=0.0, softcap=0.0, z_loss_out=None):
    """``(args, kwargs)`` of a call of ``backend.op``; the Triton op takes ``z_loss_out``, the rows' z-loss buffer
    (the C++ op returns them), a float32 one when ``lse_square_scale`` is not 0 and none is given."""
    args = (logits, target, sample_weight, None, V.WEIGHT_CODES[uncertainty], V.MODE_CODES[mode], float(gamma),
            float(norm), ignore_index, V.REDUCTION_CODES[reduction], compute_grad, grad_out, mix_target, mix_lambda,
            float(label_smoothing))
    kwargs = dict(class_weight=class_weight, lse_square_scale=float(lse_square_scale), softcap=float(softcap))
    if backend.name == "triton":
        if z_loss_out is None and lse_square_scale != 0.0:
            z_loss_out = torch.empty(logits.shape[0], device=logits.device)
        kwargs["z_loss_out"] = z_loss_out
    return args, kwargs


def _op_outputs(backend, logits, target, **kw):
    """``(loss, grad, target flag, rows' z-loss)`` of ``backend.op`` (the z-loss ``(0,)`` when it has none)."""
    args, kwargs = _op_call(backend, logits, target, **kw)
    if backend.name != "triton":
        loss, grad, flag, _, _, z_loss = backend.op(*args, **kwargs)
        return loss, grad, flag, z_loss
    loss, grad, flag = backend.op(*args, **kwargs)
    z_loss = kwargs["z_loss_out"]
    return loss, grad, flag, logits.new_empty((0,), dtype=torch.float32) if z_loss is None else z_loss


# -------------------------------------------------------------------------------------- the grid against the reference
@pytest.mark.parametrize("option", list(OPTIONS))
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_options_match_the_reference(backend, uncertainty, kind, option):
    """Each option alone and all together, per weight, target kind, mode and reduction, in float64 (float32 on
    Triton). The interpreter takes the other weights with every option together, one mode per case (alternating
    over the options) and one reduction (cycling over the kinds and options)."""
    if backend.interpreted and uncertainty not in ("none", "focal", "brier") and option != "all":
        pytest.skip("Triton interpreter: the other weights take every option together")
    n, c = (6, 9) if backend.interpreted else (13, 37)
    dtype = _precisions(backend)[0]
    z, target, soft, class_weight, sample_weight = _case(kind, n, c, backend.device, dtype, seed=3)
    cases = [(mode, reduction) for mode in MODES for reduction in REDUCTIONS]
    if backend.interpreted:
        i, j = list(OPTIONS).index(option), KINDS.index(kind)
        cases = [(MODES[(i + j) % 2], REDUCTIONS[(i + j) % 3])]
    for mode, reduction in cases:
        _check(backend, z, target, f"{mode}/{reduction}", mode=mode, reduction=reduction,
               **_weight_keywords(uncertainty, sample_weight), **soft, **_options(option, class_weight))


@pytest.mark.parametrize("norm", [1.0, 1.5, 3.0])
@pytest.mark.parametrize("kind", KINDS)
def test_brier_norms_other_than_two(backend, norm, kind):
    """The gBS weight with norms other than 2 (its general sweep), every option, loss mode."""
    if backend.interpreted and (norm, kind) != (1.5, "mix"):
        pytest.skip("Triton interpreter: one norm and target kind")
    z, target, soft, class_weight, _ = _case(kind, 8, 9, backend.device, _precisions(backend)[0], seed=5)
    _check(backend, z, target, f"q={norm}", uncertainty="brier", mode="loss", norm=norm, gamma=3.0, **soft,
           **_options("all", class_weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_lower_precisions_match_the_float64_reference(backend, uncertainty, kind, dtype):
    """float32 and 16-bit logits (accumulated in float32; loss, z-loss and gradient in the logits' dtype) against the
    float64 reference of the same values, each option alone and all together. The interpreter takes the 16-bit
    logits with focal's weight and every option."""
    if backend.name == "triton" and dtype == torch.float32:
        pytest.skip("the Triton kernels' float32 is test_options_match_the_reference's")
    if backend.interpreted and (uncertainty != "focal" or kind not in ("indices", "dense")):
        pytest.skip("Triton interpreter: focal's weight, class indices and a dense target")
    z, target, soft, class_weight, sample_weight = _case(kind, 13, 37, backend.device, dtype, seed=7)
    options = ["all"] if backend.interpreted else list(OPTIONS)
    cases = [("loss", "mean")] if backend.interpreted else [("grad", "mean"), ("loss", "none")]
    for option in options:
        for mode, reduction in cases:
            _check(backend, z, target, f"{option}/{mode}/{reduction}", mode=mode, reduction=reduction,
                   **_weight_keywords(uncertainty, sample_weight), **soft, **_options(option, class_weight))


# ---------------------------------------------------------------------------------------- F.cross_entropy and z-loss
@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["indices", "smoothing", "dense", "dense_smoothing"])
def test_uncertainty_none_is_f_cross_entropy(backend, kind, reduction):
    """``uncertainty="none"`` with class weights is F.cross_entropy(weight=, label_smoothing=, ignore_index=,
    reduction=) (class indices with ``ignore_index=5``, or a dense target; with and without label smoothing)."""
    n, c = (7, 6) if backend.interpreted else (40, 300)
    dtype = _precisions(backend)[0]
    generator = torch.Generator().manual_seed(11)
    z = (torch.randn(n, c, generator=generator, dtype=torch.float64) * 2).to(dtype).to(backend.device)
    class_weight = (torch.rand(c, generator=generator, dtype=torch.float64) + 0.1).to(dtype).to(backend.device)
    keywords = dict(reduction=reduction, label_smoothing=0.1 if kind.endswith("smoothing") else 0.0)
    if kind.startswith("dense"):
        target = torch.softmax(torch.randn(n, c, generator=generator, dtype=torch.float64), dim=1).to(dtype)
    else:
        target = torch.randint(0, c, (n,), generator=generator)
        target[[2, 5]] = 5
        keywords["ignore_index"] = 5
    target = target.to(backend.device)
    (loss,), grad = _loss_and_grad(backend.name, z, target, uncertainty="none", weight=class_weight, **keywords)
    x = z.clone().requires_grad_()
    expected = F.cross_entropy(x, target, weight=class_weight, **keywords)
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(loss, expected.detach(), **tolerance)
    torch.testing.assert_close(grad, expected_grad, **tolerance)


@pytest.mark.parametrize("reduction", REDUCTIONS)
def test_the_z_loss_is_liger_kernels_on_top_of_f_cross_entropy(backend, reduction):
    """``uncertainty="none"`` with ``lse_square_scale=s`` is F.cross_entropy + s·logsumexp(z)² on the non-ignored rows
    (the z-loss part of a mean divided by their count); ``return_z_loss`` gives that part."""
    n, c, scale = (7, 6, 1e-2) if backend.interpreted else (33, 500, 1e-2)
    dtype = _precisions(backend)[0]
    z, target, *_ = _case("indices", n, c, backend.device, dtype, seed=13)
    valid = target != -100
    x = z.clone().requires_grad_()
    z_rows = torch.where(valid, scale * torch.logsumexp(x, dim=1).square(), torch.zeros((), dtype=dtype,
                                                                                          device=x.device))
    z_part = {"none": z_rows, "sum": z_rows.sum(), "mean": z_rows.sum() / valid.sum()}[reduction]
    expected = F.cross_entropy(x, target, reduction=reduction) + z_part
    (expected_grad,) = torch.autograd.grad(expected.sum(), x)
    (loss, z_loss), grad = _loss_and_grad(backend.name, z, target, uncertainty="none", reduction=reduction,
                                          lse_square_scale=scale, return_z_loss=True)
    tolerance = dict(rtol=1e-10, atol=1e-12) if dtype == torch.float64 else dict(rtol=2e-5, atol=1e-6)
    torch.testing.assert_close(loss, expected.detach(), **tolerance)
    torch.testing.assert_close(grad, expected_grad, **tolerance)
    torch.testing.assert_close(z_loss, z_part.detach(), **tolerance)


@pytest.mark.parametrize("reduction", REDUCTIONS)
@pytest.mark.parametrize("kind", ["indices", "dense"])
def test_return_z_loss(backend, kind, reduction):
    """``return_z_loss=True``: the reduced z-loss (of the capped logits, 0 on ignored rows) beside the loss, both as
    the reference's, with the z-loss alone and with every option."""
    for dtype in _precisions(backend):
        z, target, soft, class_weight, _ = _case(kind, 12, 10, backend.device, dtype, seed=17)
        for option in ("z_loss", "all"):
            (_, z_loss), _ = _check(backend, z, target, f"{DTYPE_IDS[dtype]}/{option}", uncertainty="focal",
                                    gamma=2.0, reduction=reduction, return_z_loss=True, **soft,
                                    **_options(option, class_weight))
            if reduction == "none" and kind == "indices":
                assert torch.all(z_loss[target == -100] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64], ids=DTYPE_IDS.get)
def test_the_op_gives_each_rows_z_loss_of_the_capped_logits(backend, dtype):
    """The op's per-row z-loss (the C++ op's sixth output, the Triton op's ``z_loss_out``): s·logsumexp(z')² of the
    capped logits z', 0 on ignored rows, float32 (float64 for float64 logits); none without a z-loss (an empty
    output; a given buffer zeroed)."""
    if backend.name == "triton" and dtype == torch.float64:
        pytest.skip("the Triton kernels take no float64 logits")
    n, c, scale, cap = (6, 9, 0.1, 3.0) if backend.interpreted else (20, 1000, 0.1, 3.0)
    logits, target, *_ = _case("indices", n, c, backend.device, dtype, seed=19)
    *_, z_loss = _op_outputs(backend, logits, target, lse_square_scale=scale, softcap=cap)
    wide = torch.float64 if dtype == torch.float64 else torch.float32
    capped = cap * torch.tanh(logits.to(wide) / cap)
    expected = torch.where(target != -100, scale * torch.logsumexp(capped, dim=1).square(), 0.0)
    assert z_loss.dtype == wide and z_loss.shape == (n,)
    torch.testing.assert_close(z_loss, expected, rtol=1e-5 if wide == torch.float32 else 1e-12, atol=0.0)
    if backend.name == "triton":
        buffer = torch.full((n,), float("nan"), device=backend.device)
        _op_outputs(backend, logits, target, softcap=cap, z_loss_out=buffer)
        assert torch.equal(buffer, torch.zeros_like(buffer))
    else:
        *_, none = _op_outputs(backend, logits, target, softcap=cap)
        assert none.shape == (0,)


@pytest.mark.parametrize("kind", ["indices", "mix"])
def test_a_class_weighted_mean_with_a_zero_divisor(backend, kind):
    """Every non-ignored row's target (and mix) class weighted 0: the class-weighted part of the mean is 0 with
    gradient 0 (a mix's smoothing still gives its rows a weighted cross-entropy), the z-loss part still divides by
    the count."""
    n, c = (5, 6) if backend.interpreted else (16, 50)
    dtype = _precisions(backend)[0]
    z, target, soft, _, _ = _case(kind, n, c, backend.device, dtype, seed=23)
    class_weight = torch.ones(c, dtype=dtype, device=backend.device)
    valid = target != -100
    class_weight[target[valid]] = 0.0
    if kind == "mix":
        class_weight[soft["mix_target"][valid]] = 0.0
    keywords = dict(uncertainty="focal", gamma=2.0, weight=class_weight, **soft)
    (loss, z_loss), _ = _check(backend, z, target, "with a z-loss", lse_square_scale=0.1, return_z_loss=True,
                               **keywords)
    torch.testing.assert_close(loss, z_loss, rtol=1e-12 if dtype == torch.float64 else 1e-5, atol=0.0)
    (loss,), grad = _check(backend, z, target, "without a z-loss", **keywords)
    assert loss.item() == 0.0 and not grad.any()


# ------------------------------------------------------------------------------------- soft-capping and statistics
@pytest.mark.parametrize("reduction", ["mean", "none"])
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=DTYPE_IDS.get)
def test_minus_inf_logits_under_the_cap(backend, dtype, reduction):
    """A -inf logit becomes -c under the cap, as in the reference, with a gradient of 0 there (single entries, most of
    a row, a whole column); the statistics are those of the capped logits (two logits saturating the cap tie: the
    first is the prediction)."""
    if dtype not in _precisions(backend):
        pytest.skip("the Triton kernels take no float64 logits")
    n, c = (6, 8) if backend.interpreted else (8, 300)
    z, target, _, class_weight, _ = _case("indices", n, c, backend.device, dtype, seed=29)
    target[target == c - 1] = 0
    z[:, c - 1] = -float("inf")
    z[0, 3] = -float("inf")
    z[1, :5] = -float("inf")
    target[1] = 6
    z[4, 2] = 1e4
    z[4, 5] = 2e4
    keywords = dict(uncertainty="focal", mode="loss", reduction=reduction, softcap=3.0, weight=class_weight,
                    lse_square_scale=0.1)
    (loss,), grad = _check(backend, z, target, reduction, **keywords)
    assert torch.isfinite(loss).all() and torch.isfinite(grad).all()
    assert grad[0, 3] == 0 and torch.all(grad[1, :5] == 0) and torch.all(grad[:, c - 1] == 0)
    _, stats = ck.uncertainty_weighted_ce(z, target, backend=backend.name, return_stats=True, **keywords)
    _, want_stats = ck.uncertainty_weighted_ce(z, target, backend="reference", return_stats=True, **keywords)
    torch.testing.assert_close(stats.confidence, want_stats.confidence, equal_nan=True)
    assert torch.equal(stats.prediction, want_stats.prediction)


@pytest.mark.parametrize("chunked", [False, True], ids=["one-block", "chunked"])
def test_statistics_of_capped_logits(backend, monkeypatch, chunked):
    """``return_stats=True``: the top-label statistics of the capped logits (NaN / -1 on ignored rows), as the float64
    reference's over 19 classes, and over 1000 classes (most logits past the cap: near ties at the logits' precision)
    as top_label_stats of c·tanh(z / c) at that precision; ``chunked``: the Triton kernel reading rows of 19 classes
    in 4-class chunks."""
    if chunked:
        if backend.name != "triton":
            pytest.skip("the Triton kernels' chunked path")
        monkeypatch.setattr(_backends.module("triton"), "MAX_BLOCK", 8)
    cap = 2.0
    z, target, _, class_weight, _ = _case("indices", 6, 19, backend.device, seed=31)
    keywords = dict(uncertainty="brier", softcap=cap, return_stats=True, weight=class_weight)
    loss, stats = ck.uncertainty_weighted_ce(z, target, backend=backend.name, **keywords)
    want_loss, want_stats = ck.uncertainty_weighted_ce(z.double(), target, backend="reference",
                                                       **dict(keywords, weight=class_weight.double()))
    assert_within_largest_entry(loss, want_loss, torch.float32, "loss")
    assert_within_largest_entry(stats.confidence, want_stats.confidence, torch.float32, "confidence")
    assert torch.equal(stats.prediction, want_stats.prediction)
    if backend.interpreted or chunked:
        return
    n, c = 30, 1000
    z, target, *_ = _case("indices", n, c, backend.device, seed=32)
    z = z * 4 / 3
    _, stats = ck.uncertainty_weighted_ce(z, target, backend=backend.name, softcap=cap, return_stats=True)
    expected = top_label_stats(cap * torch.tanh(z / cap), target == -100, (n,))
    torch.testing.assert_close(stats.confidence, expected.confidence, rtol=1e-5, atol=0.0, equal_nan=True)
    assert torch.equal(stats.prediction, expected.prediction)


# ---------------------------------------------------------------------------------- in place, without a gradient
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("kind", KINDS)
def test_in_place_and_without_gradient(backend, kind, dtype):
    """In place (the gradient overwrites the logits) and under no_grad, every option: the out-of-place call's loss and
    gradient exactly; the statistics of the capped logits taken before the gradient overwrites them."""
    if dtype == torch.float64 and backend.name == "triton":
        pytest.skip("the Triton kernels take no float64 logits")
    if backend.interpreted and (dtype != torch.float32 or kind == "smoothing"):
        pytest.skip("Triton interpreter: float32, three target kinds")
    z, target, soft, class_weight, _ = _case(kind, 9, 21, backend.device, dtype, seed=37)
    for uncertainty in ["focal"] if backend.interpreted else ["brier", "focal"]:
        keywords = dict(uncertainty=uncertainty, gamma=2.0, mode="loss", **soft, **_options("all", class_weight))
        (loss,), grad = _loss_and_grad(backend.name, z, target, **keywords)
        leaf = z.clone().requires_grad_()
        logits = leaf * 1.0
        in_place = ck.uncertainty_weighted_ce(logits, target, backend=backend.name, inplace=True, **keywords)
        in_place.backward()
        torch.testing.assert_close(in_place.detach(), loss, rtol=0, atol=0)
        torch.testing.assert_close(leaf.grad, grad, rtol=0, atol=0)
        _, stats = ck.uncertainty_weighted_ce(z.clone().requires_grad_() * 1.0, target, backend=backend.name,
                                              inplace=True, return_stats=True, **keywords)
        _, want_stats = ck.uncertainty_weighted_ce(z, target, backend="reference", return_stats=True, **keywords)
        torch.testing.assert_close(stats.confidence, want_stats.confidence, equal_nan=True, rtol=1e-5, atol=1e-6)
        assert torch.equal(stats.prediction, want_stats.prediction)
        with torch.no_grad():
            without = ck.uncertainty_weighted_ce(z.clone().requires_grad_(), target, backend=backend.name, **keywords)
        torch.testing.assert_close(without, loss, rtol=0, atol=0)


@pytest.mark.parametrize("c", [10, 2000, 20000])
@pytest.mark.parametrize("kind", KINDS)
def test_the_op_in_place_and_without_a_gradient(backend, kind, c):
    """The op with every option, the gradient written over the logits (grad_out = logits) and not computed
    (compute_grad=False): the out-of-place loss, gradient and rows' z-loss exactly, no gradient returned."""
    if backend.interpreted and (c != 10 or kind in ("smoothing", "mix")):
        pytest.skip("Triton interpreter: 10 classes, class indices and a dense target")
    logits, target, soft, class_weight, _ = _case(kind, 10, c, backend.device, seed=41)
    kw = dict(uncertainty="brier", mode="loss", gamma=2.0, class_weight=class_weight, lse_square_scale=0.02,
              softcap=4.0, **soft)
    loss, grad, _, z_loss = _op_outputs(backend, logits, target, **kw)
    in_place = logits.clone()
    loss_in_place, empty, _, z_in_place = _op_outputs(backend, in_place, target, grad_out=in_place, **kw)
    assert empty.shape == (0,)
    assert torch.equal(loss_in_place, loss) and torch.equal(in_place, grad) and torch.equal(z_in_place, z_loss)
    loss_only, no_grad, *_ = _op_outputs(backend, logits, target, compute_grad=False, **kw)
    assert no_grad.shape == (0,) and torch.equal(loss_only, loss)


# ------------------------------------------------------------------------------------------------ refused calls
def test_a_bad_target_under_the_options(backend):
    """A target (or mix target) out of range under every option: the C++ CPU op raises; the CUDA and Triton ops
    (which never raise from the device) give the row a NaN loss and gradient and name it in the target flag, without
    reading out of bounds; an ignored row stays 0."""
    n, c = 4, 5
    logits, *_ = _case("indices", n, c, backend.device, seed=43)
    target = torch.tensor([0, c + 2, -100, 2], device=backend.device)
    mix = torch.tensor([1, 1, 0, -3], device=backend.device)
    good = torch.tensor([0, 1, -100, 2], device=backend.device)
    options = dict(class_weight=torch.ones(c, device=backend.device), lse_square_scale=0.1, softcap=3.0)
    mixed = dict(mix_target=mix, mix_lambda=torch.rand(n, generator=torch.Generator().manual_seed(43)).to(
        backend.device), class_weight=options["class_weight"])
    if backend.name == "cpu":
        with pytest.raises(ValueError, match="target value 7 is out of range"):
            _op_outputs(backend, logits, target, reduction="none", **options)
        with pytest.raises(ValueError, match="mix_target value -3 is out of range"):
            _op_outputs(backend, logits, good, **mixed)
        return
    loss, grad, flag, _ = _op_outputs(backend, logits, target, reduction="none", **options)
    assert torch.isnan(loss[1]) and torch.isfinite(loss[[0, 2, 3]]).all() and loss[2] == 0
    assert torch.isnan(grad[1]).all() and torch.isfinite(grad[[0, 2, 3]]).all() and (grad[2] == 0).all()
    assert flag.tolist() == [1, c + 2]
    *_, flag, _ = _op_outputs(backend, logits, good, **mixed)
    assert flag.tolist() == [2, -3]


def test_the_dual_focal_weight_refuses_options(backend):
    """The ops compute no option with dual focal's weight (Python routes such calls to the reference)."""
    logits, target, *_ = _case("indices", 4, 10, backend.device, seed=47)
    with pytest.raises((RuntimeError, NotImplementedError), match="dual.focal"):
        _op_outputs(backend, logits, target, uncertainty="dual_focal", softcap=2.0)


# ----------------------------------------------------------------------------------------- opcheck, torch.compile
@pytest.mark.parametrize("option", list(OPTIONS))
def test_opcheck_with_each_option(backend, option):
    """``backend.op`` with each option under opcheck: gradient returned (with the Triton op's z-loss buffer), none
    computed, in place; class indices with a smoothed mix and a dense target; the C++ op also in bfloat16, over 20000
    classes, and with the loss in the logits' dtype and the statistics (no ignored row there: opcheck's comparison
    refuses its NaN confidence). The interpreter takes every option together, class indices."""
    if backend.interpreted and option != "all":
        pytest.skip("Triton interpreter: every option together")
    device = backend.device
    generator = torch.Generator().manual_seed(53)
    n, c = 6, 7
    z = torch.randn(n, c, generator=generator).to(device)
    y = torch.tensor([0, 1, -100, 3, 4, 6], device=device)
    dense = torch.softmax(torch.randn(n, c, generator=generator), dim=1).to(device)
    soft = dict(mix_target=torch.tensor([1, 1, 0, 2, 2, 0], device=device),
                mix_lambda=torch.rand(n, generator=generator).to(device), label_smoothing=0.1)
    class_weight = (torch.rand(c, generator=generator) + 0.5).to(device)
    samples = [(z, y, class_weight, dict(uncertainty="brier", mode="grad", **soft)),
               (z, dense, class_weight, dict(uncertainty="focal", mode="loss", reduction="none", label_smoothing=0.05))]
    if backend.interpreted:
        samples = samples[:1]
    elif backend.name != "triton":
        wide = torch.randn(n, 20000, generator=generator).to(device)
        samples += [(z.bfloat16(), y, class_weight, dict(uncertainty="focal", mode="loss", reduction="none")),
                    (wide, torch.randint(0, 20000, (n,), generator=generator).to(device),
                     (torch.rand(20000, generator=generator) + 0.5).to(device),
                     dict(uncertainty="none", mode="grad", reduction="sum"))]
    for logits, target, weights, kw in samples:
        keywords = _options(option, weights)
        options = dict(class_weight=keywords.pop("weight", None), **keywords)
        for extra in (dict(), dict(compute_grad=False)):
            args, kwargs = _op_call(backend, logits, target, **kw, **extra, **options)
            torch.library.opcheck(backend.op, args, kwargs)
        buffer = logits.clone()
        args, kwargs = _op_call(backend, buffer, target, grad_out=buffer, **kw, **options)
        if backend.name == "triton":
            kwargs["z_loss_out"] = None
        torch.library.opcheck(backend.op, args, kwargs)
        if backend.name != "triton":
            every_row = target if target.is_floating_point() else target.clamp_min(0)
            args, kwargs = _op_call(backend, logits, every_row, **kw, **options)
            torch.library.opcheck(backend.op, args, dict(kwargs, loss_in_logits_dtype=True, return_stats=True))


def test_compiled_call_with_the_options(backend):
    """ck.uncertainty_weighted_ce with every option and ``return_z_loss`` under torch.compile(fullgraph=True): eager's
    loss, z-loss and gradient."""
    torch._dynamo.reset()
    z, target, _, class_weight, _ = _case("indices", 8, 9, backend.device, seed=59)

    def step(x):
        return ck.uncertainty_weighted_ce(x, target, backend=backend.name, uncertainty="focal", weight=class_weight,
                                          lse_square_scale=1e-3, return_z_loss=True, softcap=4.0,
                                          label_smoothing=0.1)

    compiled = torch.compile(step, fullgraph=True)
    x1 = z.clone().requires_grad_()
    x2 = z.clone().requires_grad_()
    got, got_z = compiled(x1)
    want, want_z = step(x2)
    torch.testing.assert_close(got, want)
    torch.testing.assert_close(got_z, want_z)
    got.backward()
    want.backward()
    torch.testing.assert_close(x1.grad, x2.grad)


# -------------------------------------------------------------------------------------- one kernel's own shapes
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", ["focal", "brier", "flsd"])
def test_triton_chunked_rows(backend, monkeypatch, uncertainty, mode, kind):
    """The Triton kernels' chunked path: rows of 19 classes read in 4-class chunks (MAX_BLOCK 8), a late maximum, so
    the online maximum and sums carry across chunks; every option."""
    if backend.name != "triton":
        pytest.skip("the Triton kernels' chunked path")
    monkeypatch.setattr(_backends.module("triton"), "MAX_BLOCK", 8)
    n, c = 5, 19
    z, target, soft, class_weight, sample_weight = _case(kind, n, c, backend.device, seed=61)
    z[2, 17] = 9.0
    reduction = REDUCTIONS[KINDS.index(kind) % 3]
    _check(backend, z, target, f"{reduction}", mode=mode, reduction=reduction,
           **_weight_keywords(uncertainty, sample_weight), **soft, **_options("all", class_weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=DTYPE_IDS.get)
@pytest.mark.parametrize("path", ["warp-scalar", "warp-large-smallest", "warp-max", "block-smallest",
                                  "stream-smallest-now", "stream-scalar"])
def test_cuda_kernel_shapes(backend, path, dtype):
    """Every option on each of the CUDA kernel's launch shapes (class counts at its thresholds, aligned and not),
    every target kind and reduction, within the reference's own error at the logits' precision."""
    if backend.name != "cuda":
        pytest.skip("the CUDA kernel's launch shapes")
    n, c = 12, SHAPE_PATHS[path]
    for kind in KINDS:
        z, target, soft, class_weight, sample_weight = _case(kind, n, c, backend.device, dtype, seed=67)
        for uncertainty, mode in (("brier", "loss"), ("focal", "grad"), ("none", "grad")):
            for reduction in REDUCTIONS:
                _check(backend, z, target, f"{kind}/{uncertainty}/{mode}/{reduction}", largest_entry=False,
                       mode=mode, reduction=reduction, **_weight_keywords(uncertainty, sample_weight), **soft,
                       **_options("all", class_weight))
