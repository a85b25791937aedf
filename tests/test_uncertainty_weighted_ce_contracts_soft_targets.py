"""Every fused backend with soft targets: label smoothing, mixup/cutmix mixes and dense probability targets, against
the float64 reference and F.cross_entropy, in every weight × mode × reduction, every dtype, odd shapes, extreme and
-inf logits, in place, float64 gradcheck, opcheck and torch.compile (docs/losses.md, "Soft targets").

Written once against conftest.py's ``backend`` fixture; the Triton interpreter takes small shapes (it is slow). The
CPU kernel's own forms (streaming stores, instruction-set builds, its dense-target checks) are in
``test_uncertainty_weighted_ce_cpu_soft_targets.py``, the Triton kernel's chunked path and direct calls in
``test_uncertainty_weighted_ce_triton_soft_targets.py``."""

import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck

from _soft_targets_helpers import _case, _pair
from _tolerance import assert_within_reference_error

WEIGHTS = ["none", "focal", "flsd", "brier", "external", "brier_flsd"]
MODES = ["loss", "grad"]
REDUCTIONS = ["none", "mean", "sum"]
KINDS = ["smooth", "mix", "mix_rows", "mix_smooth", "dense", "dense_smooth"]


def _check(backend, z, target, uncertainty, mode, reduction, kw, norm=2.0, gamma=2.0, what=""):
    got = _pair(backend, z, target, uncertainty, mode, reduction, kw, norm, gamma)
    exact = _pair("reference", z, target, uncertainty, mode, reduction, kw, norm, gamma, dtype=torch.float64)
    low = _pair("reference", z, target, uncertainty, mode, reduction, kw, norm, gamma)
    assert got[0].dtype == z.dtype and got[0].shape == exact[0].shape
    assert_within_reference_error(got[0], exact[0], low[0], z.dtype, f"{what} loss")
    assert_within_reference_error(got[1], exact[1], low[1], z.dtype, f"{what} gradient")


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_every_weight_mode_and_reduction_against_the_reference(backend, uncertainty, mode, kind):
    n, c = (4, 7) if backend.interpreted else (19, 37)
    name, device = backend
    for i, reduction in enumerate(REDUCTIONS):
        z, target, kw = _case(kind, n, c, device, seed=hash((uncertainty, mode, kind, i)) % 2**31)
        _check(name, z, target, uncertainty, mode, reduction, kw, what=f"{uncertainty}/{mode}/{kind}/{reduction}")


@pytest.mark.parametrize("norm", [1.0, 1.5, 3.0])
@pytest.mark.parametrize("kind", ["smooth", "mix_rows", "dense_smooth"])
def test_brier_norms_other_than_two(backend, norm, kind):
    n, c = (3, 11) if backend.interpreted else (13, 29)
    name, device = backend
    for mode in MODES:
        z, target, kw = _case(kind, n, c, device, seed=int(norm * 10) + len(kind))
        _check(name, z, target, "brier", mode, "mean", kw, norm=norm, gamma=3.0, what=f"q={norm}/{mode}/{kind}")


@pytest.mark.parametrize("c", [1, 2, 17, 1000, 4099])
def test_odd_class_counts(backend, c):
    if backend.interpreted and c >= 1000:
        pytest.skip("Triton interpreter: wide rows are covered on a GPU")
    name, device = backend
    for kind in ("mix_smooth", "mix_rows", "dense"):
        for uncertainty, mode in (("brier", "grad"), ("focal", "loss"), ("brier", "loss")):
            z, target, kw = _case(kind, 7, c, device, seed=c + len(kind))
            _check(name, z, target, uncertainty, mode, "sum", kw, what=f"C={c}/{kind}/{uncertainty}/{mode}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_every_dtype(backend, dtype):
    if backend.name == "triton" and dtype == torch.float64:
        pytest.skip("the Triton backend takes no float64 logits")
    n = 6 if backend.interpreted else 16
    name, device = backend
    for kind in ("smooth", "mix_rows", "dense_smooth"):
        for uncertainty in ("none", "focal", "brier"):
            z, target, kw = _case(kind, n, 33, device, seed=7, dtype=dtype)
            _check(name, z, target, uncertainty, "loss", "mean", kw, what=f"{dtype}/{kind}/{uncertainty}")


def test_extreme_and_infinite_logits(backend):
    name, device = backend
    n, c = 12, 40
    z, _, _ = _case("smooth", n, c, device, seed=3)
    y = torch.randint(0, c, (n,), device=device)
    z[0, (int(y[0]) + 1) % c] = z[0, y[0]] + 1e4  # past the target-referenced range: the row-max form
    z[1, y[1]] = z[1, y[1]] + 1e4  # a saturated target
    z[3] = z[3] * 1e3
    mix = torch.roll(y, 1)
    for kw in (dict(label_smoothing=0.2), dict(mix_target=mix, mix_lambda=0.7),
               dict(mix_target=mix, mix_lambda=0.7, label_smoothing=0.05)):
        for uncertainty, mode in (("brier", "grad"), ("focal", "loss"), ("flsd", "loss"), ("brier", "loss")):
            _check(name, z, y, uncertainty, mode, "none", kw, what=f"extreme/{uncertainty}/{mode}/{sorted(kw)}")
    # -inf in columns that are neither y nor m: finite without smoothing, +inf CE with it (as the reference)
    z2 = z.clone()
    z2[:, 0] = -float("inf")
    y2 = torch.randint(1, c, (n,), device=device)
    for kw in (dict(mix_target=torch.roll(y2, 1), mix_lambda=0.6), dict(label_smoothing=0.1)):
        _check(name, z2, y2, "brier", "grad", "none", kw, what=f"-inf/{sorted(kw)}")
    dense = torch.softmax(torch.randn(n, c, device=device), dim=1)
    dense[:, 0] = 0
    dense = dense / dense.sum(dim=1, keepdim=True)
    _check(name, z2, dense, "focal", "loss", "none", {}, what="-inf/dense with t = 0 there")


@pytest.mark.parametrize("lam", ["number", "tensor"])
def test_a_masked_column_without_target_mass_gets_no_gradient(backend, lam):
    """λ = 0 gives the target class y no mass: with z_y = -inf there, p_y = t_y = 0 and its gradient is exactly 0 on
    every backend, in either mode (the CPU kernel had formed p_y - t_y as (1 - t_y) - (1 - p_y), whose 1 - p_y =
    Σ_{k≠y} e_k · (1 / d) can round one ulp off 1, leaving 2^-24 there); likewise the mix class m with λ = 1."""
    # enough rows that some have a sum Σ_{k≠y} e_k whose product with its reciprocal rounds off 1 (fewer through the
    # Triton interpreter, which is slow)
    n, c = 32 if backend.interpreted else 256, 9
    name, device = backend
    z = (3 * torch.randn(n, c, generator=torch.Generator().manual_seed(5))).to(device)
    y = torch.randint(0, c, (n,), generator=torch.Generator().manual_seed(6)).to(device)
    m = (y + 1) % c
    rows = torch.arange(n, device=device)
    for value, masked in ((0.0, y), (1.0, m)):
        masked_z = z.clone()
        masked_z[rows, masked] = -float("inf")
        mix_lambda = value if lam == "number" else torch.full((n,), value, device=device)
        for uncertainty, mode in (("none", "grad"), ("brier", "grad"), ("focal", "loss"), ("brier", "loss")):
            x = masked_z.clone().requires_grad_()
            loss = ck.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode=mode, mix_target=m,
                                              mix_lambda=mix_lambda, reduction="sum", backend=name)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(x.grad).all(), (value, uncertainty, mode)
            assert (x.grad[rows, masked] == 0).all(), (value, uncertainty, mode, x.grad[rows, masked].tolist())


def test_weight_none_matches_f_cross_entropy(backend):
    name, device = backend
    z, _, _ = _case("smooth", 24, 50, device, seed=11)
    y = torch.randint(0, 50, (24,), device=device)
    y[5] = -100
    for a in (0.0, 0.1, 1.0):
        got = ck.uncertainty_weighted_ce(z, y, uncertainty="none", label_smoothing=a, backend=name)
        torch.testing.assert_close(got, F.cross_entropy(z, y, label_smoothing=a), rtol=2e-6, atol=1e-6)
    probs = torch.softmax(torch.randn(24, 50, device=device), dim=1)
    for a in (0.0, 0.2):
        for reduction in REDUCTIONS:
            got = ck.uncertainty_weighted_ce(z, probs, uncertainty="none", label_smoothing=a, reduction=reduction,
                                             backend=name)
            want = F.cross_entropy(z, probs, label_smoothing=a, reduction=reduction)
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-5)
    lam = 0.3
    got = ck.uncertainty_weighted_ce(z, y, uncertainty="none", mix_target=y.flip(0).clamp(min=0), mix_lambda=lam,
                                     backend=name)
    mixed = lam * F.one_hot(y.clamp(min=0), 50).float() + (1 - lam) * F.one_hot(y.flip(0).clamp(min=0), 50).float()
    want = F.cross_entropy(z, mixed, reduction="none")
    torch.testing.assert_close(got, want[y >= 0].mean(), rtol=2e-6, atol=1e-6)
    # the gradient of the mean too, against float64 F.cross_entropy (a mix as λ CE(y) + (1 - λ) CE(m), λ a tensor):
    # within 2e-5 of its largest entry, a few thousand float32 ulps at most for these shapes
    every_row = torch.randint(0, 50, (24,), device=device)
    mix = torch.randint(0, 50, (24,), device=device)
    cases = [
        (y, dict(label_smoothing=0.2), lambda x: F.cross_entropy(x, y, label_smoothing=0.2)),
        (probs, {}, lambda x: F.cross_entropy(x, probs.double())),
        (probs, dict(label_smoothing=0.1), lambda x: F.cross_entropy(x, probs.double(), label_smoothing=0.1)),
        (every_row, dict(mix_target=mix, mix_lambda=torch.tensor(lam, device=device)),
         lambda x: lam * F.cross_entropy(x, every_row) + (1 - lam) * F.cross_entropy(x, mix)),
    ]
    for target, soft, expected_of in cases:
        x = z.clone().requires_grad_()
        loss = ck.uncertainty_weighted_ce(x, target, uncertainty="none", backend=name, **soft)
        loss.backward()
        exact_x = z.double().requires_grad_()
        expected = expected_of(exact_x)
        expected.backward()
        for what, got, want in (("loss", loss, expected), ("gradient", x.grad, exact_x.grad)):
            err = (got.detach().double().cpu() - want.detach().cpu()).abs().max().item()
            scale = want.detach().abs().max().item()
            assert err <= 2e-5 * scale, f"{sorted(soft)} {what}: max error {err:.3e} (scale {scale:.3e})"


@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_gradcheck_in_float64(backend, uncertainty):
    if backend.name == "triton":
        pytest.skip("the Triton backend takes no float64 logits")
    name, device = backend
    g = torch.Generator().manual_seed(5)
    z = torch.randn(5, 6, generator=g, dtype=torch.float64).to(device).requires_grad_()
    y = torch.tensor([0, 3, -100, 5, 2], device=device)
    mix = torch.tensor([1, 3, 0, 4, 0], device=device)
    lam = torch.rand(5, generator=g, dtype=torch.float64).to(device)
    dense = torch.softmax(torch.randn(5, 6, generator=g, dtype=torch.float64), dim=1).to(device)
    sw = {"sample_weight": torch.rand(5, generator=g,
                                      dtype=torch.float64).to(device)} if uncertainty == "external" else {}
    for target, kw in ((y, dict(mix_target=mix, mix_lambda=lam, label_smoothing=0.1)), (dense, {})):
        def fn(x):
            return ck.uncertainty_weighted_ce(x, target, uncertainty=uncertainty, mode="loss", gamma=2.0,
                                              backend=name, reduction="sum", **kw, **sw)
        assert torch.autograd.gradcheck(fn, (z,), eps=1e-6, atol=1e-6)


def test_in_place_and_inference(backend):
    name, device = backend
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("mix_smooth", "dense"):
            z, target, kw = _case(kind, 9, 21, device, seed=2, dtype=dtype)
            want = _pair(name, z, target, "brier", "loss", "mean", kw)
            leaf = z.detach().clone().requires_grad_()
            h = leaf * 1.0
            loss = ck.uncertainty_weighted_ce(h, target, uncertainty="brier", mode="loss", gamma=2.0, backend=name,
                                              inplace=True, **kw)
            loss.backward()
            torch.testing.assert_close(loss.detach(), want[0], rtol=0, atol=0)
            torch.testing.assert_close(leaf.grad, want[1], rtol=0, atol=0)
            with torch.no_grad():
                plain = ck.uncertainty_weighted_ce(z, target, uncertainty="brier", mode="loss", gamma=2.0,
                                                   backend=name, **kw)
            torch.testing.assert_close(plain, want[0], rtol=0, atol=0)
            with pytest.raises(ValueError, match="leaf"):
                ck.uncertainty_weighted_ce(z.detach().clone().requires_grad_(), target, backend=name, inplace=True,
                                           **kw)


@pytest.mark.parametrize("lambda_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_strided_mix_lambda(backend, lambda_dtype):
    name, device = backend
    # A per-row λ is often a strided view (torch.distributions.Beta(a, a).sample((N,)) is a column of a Dirichlet
    # sample); the kernels read it where it lies: same results, bit for bit, as a contiguous copy, and the range check
    # sees the view's values only, not the ones between them.
    z, y, _ = _case("mix", 23, 37, device, seed=4)
    mix = y.flip(0).clamp(min=0)
    triples = torch.rand(23, 3, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    triples[:, 0] = triples[:, 2] = 7.0  # out of range, outside the views
    views = (triples.to(lambda_dtype).to(device)[:, 1],  # stride 3, storage offset 1
             torch.tensor(0.3, dtype=lambda_dtype, device=device).expand(23))  # stride 0
    assert views[0].stride(0) == 3 and views[1].stride(0) == 0
    for view in views:
        for kw in (dict(label_smoothing=0.0), dict(label_smoothing=0.1)):
            got = _pair(name, z, y, "brier", "loss", "none", dict(kw, mix_target=mix, mix_lambda=view))
            want = _pair(name, z, y, "brier", "loss", "none", dict(kw, mix_target=mix,
                                                                      mix_lambda=view.contiguous()))
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    bad = triples.clone()
    bad[11, 1] = 1.5
    with pytest.raises(ValueError, match=r"mix_lambda must be in \[0, 1\]"):
        ck.uncertainty_weighted_ce(z, y, mix_target=mix, mix_lambda=bad.to(lambda_dtype).to(device)[:, 1],
                                   backend=name)
        ck.synchronize_target_checks()  # a GPU call queues the check (calibkernels._target_checks): raised here


def test_kernel_refuses_what_it_cannot_run(backend):
    """The op's own checks of its soft-target arguments (the C++ op raises RuntimeError, the Triton op ValueError):
    no soft form of the dual-focal weight, a mix needs both its halves and class-index targets, λ of a wrong shape,
    smoothing past 1; the C++ CPU op also names a mix_target out of range (the GPU kernels flag it on the device)."""
    op = backend.op
    name, device = backend
    error = ValueError if name == "triton" else RuntimeError
    z = torch.randn(4, 5, device=device)
    y = torch.tensor([0, 1, 2, 3], device=device)
    lam = torch.tensor(0.5, device=device)
    rows_lam = torch.rand(4, device=device)
    for target, mix, mix_lambda, smoothing in ((y, None, None, 0.1), (z.softmax(1), None, None, 0.0),
                                               (y, y, rows_lam, 0.0)):
        with pytest.raises(error, match="dual-focal"):
            op(z, target, None, None, 3, 1, 2.0, 2.0, -100, 1, False, None, mix, mix_lambda, smoothing)
    with pytest.raises(error, match="go together"):
        op(z, y, None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, y, None, 0.0)
    with pytest.raises(error, match="label_smoothing"):
        op(z, y, None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, None, None, 1.5)
    with pytest.raises(error, match="dense"):
        op(z, z.softmax(1), None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, y, lam, 0.0)
    with pytest.raises(error, match="mix_lambda"):
        op(z, y, None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, y, rows_lam[:3], 0.0)
    if name == "cpu":
        with pytest.raises(ValueError, match="mix_target value 9"):
            op(z, y, None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, torch.tensor([0, 9, 1, 1]), lam, 0.0)


def test_opcheck_and_compile(backend):
    """The op with a smoothed mix and a smoothed dense target under opcheck (gradient returned, none computed, in
    place), and the loss with a new λ per batch under torch.compile(fullgraph=True), as eager."""
    op = backend.op
    name, device = backend
    z = torch.randn(6, 7, device=device)
    y = torch.tensor([0, 1, -100, 3, 4, 6], device=device)
    mix = torch.tensor([1, 1, 0, 2, 2, 0], device=device)
    lam = torch.rand(6, device=device)
    dense = torch.softmax(torch.randn(6, 7, device=device), dim=1)
    for target, head, tail in ((y, (4, 0, 2.0, 2.0, -100, 1), (mix, lam, 0.1)),
                               (dense, (1, 0, 2.0, 2.0, -100, 0), (None, None, 0.05))):
        torch.library.opcheck(op, (z, target, None, None, *head, True, None, *tail))
        torch.library.opcheck(op, (z, target, None, None, *head, False, None, *tail))
        logits = z.clone()
        torch.library.opcheck(op, (logits, target, None, None, *head, True, logits, *tail))

    def step(x, target, mix_target, mix_lambda):
        return ck.uncertainty_weighted_ce(x, target, mix_target=mix_target, mix_lambda=mix_lambda,
                                          label_smoothing=0.1, backend=name)

    compiled = torch.compile(step, fullgraph=True)
    for lam_value in (0.3, 0.8):  # a new λ per batch, as mixup draws it
        lam_t = torch.full((), lam_value, device=device)
        x1 = z.clone().requires_grad_()
        x2 = z.clone().requires_grad_()
        got = compiled(x1, y, mix, lam_t)
        got.backward()
        want = step(x2, y, mix, lam_t)
        want.backward()
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-6, atol=1e-7)
