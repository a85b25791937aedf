"""The compiled kernels (C++ CPU; CUDA C++ on a GPU) with soft targets: label smoothing, mixup/cutmix mixes and dense
probability targets, against the float64 reference and F.cross_entropy, in every weight × mode × reduction, every
dtype, odd shapes, extreme and -inf logits, in place, the streaming-store and instruction-set forms, float64
gradcheck, opcheck and torch.compile (docs/losses.md, "Soft targets"). The Triton kernel's soft targets are tested in
test_uncertainty_weighted_ce_triton_soft_targets.py."""

import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import _backends
from calibkernels import _validation as V

from _tolerance import assert_within_reference_error

WEIGHTS = ["none", "focal", "flsd", "brier", "external", "brier_flsd"]
MODES = ["loss", "grad"]
REDUCTIONS = ["none", "mean", "sum"]
KINDS = ["smooth", "mix", "mix_rows", "mix_smooth", "dense", "dense_smooth"]


def _backends_to_test():
    found = []
    if _backends.unavailable_reason("cpu", torch.device("cpu")) is None:
        found.append(("cpu", "cpu"))
    if torch.cuda.is_available() and _backends.unavailable_reason("cuda", torch.device("cuda")) is None:
        found.append(("cuda", "cuda"))
    return found or [pytest.param(None, None, marks=pytest.mark.skip("no compiled kernel in this install"))]


BACKENDS = _backends_to_test()


def _case(kind, n, c, device, seed, dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, c, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
    y = torch.randint(0, c, (n,), generator=g)
    if n > 3:
        y[2] = -100
    kw = {}
    target = y.to(device)
    if kind in ("smooth", "mix_smooth", "dense_smooth"):
        kw["label_smoothing"] = 0.1
    if kind in ("mix", "mix_smooth"):
        kw.update(mix_target=y.flip(0).clamp(min=0).to(device), mix_lambda=0.35)
    if kind == "mix_rows":
        mix = torch.randint(0, c, (n,), generator=g)
        mix[0] = y[0]  # a row mixed with its own class
        lam = torch.rand(n, generator=g)
        lam[1] = 1.0
        kw.update(mix_target=mix.to(device), mix_lambda=lam.to(device))
    if kind.startswith("dense"):
        target = torch.softmax(torch.randn(n, c, generator=g) * 2, dim=1).to(device)
    return z, target, kw


def _pair(backend, z, target, uncertainty, mode, reduction, kw, norm=2.0, gamma=2.0, dtype=None):
    x = z.detach().clone()
    if dtype is not None:
        x = x.to(dtype)
    x.requires_grad_(True)
    sample_weight = None
    if uncertainty == "external":
        sample_weight = torch.linspace(0.2, 2.0, x.shape[0], dtype=torch.float64).to(x.device)
    tgt = target.to(x.dtype) if target.is_floating_point() and backend == "reference" else target
    kw = dict(kw)
    if isinstance(kw.get("mix_lambda"), torch.Tensor) and backend == "reference" and x.dtype == torch.float64:
        kw["mix_lambda"] = kw["mix_lambda"].double()
    loss = ck.uncertainty_weighted_ce(x, tgt, uncertainty=uncertainty, mode=mode, reduction=reduction, norm=norm,
                                      gamma=gamma, sample_weight=sample_weight, backend=backend, **kw)
    loss.sum().backward()
    return loss.detach(), x.grad


def _check(backend, z, target, uncertainty, mode, reduction, kw, norm=2.0, gamma=2.0, what=""):
    got = _pair(backend, z, target, uncertainty, mode, reduction, kw, norm, gamma)
    exact = _pair("reference", z, target, uncertainty, mode, reduction, kw, norm, gamma, dtype=torch.float64)
    low = _pair("reference", z, target, uncertainty, mode, reduction, kw, norm, gamma)
    assert got[0].dtype == z.dtype and got[0].shape == exact[0].shape
    assert_within_reference_error(got[0], exact[0], low[0], z.dtype, f"{what} loss")
    assert_within_reference_error(got[1], exact[1], low[1], z.dtype, f"{what} gradient")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_every_weight_mode_and_reduction_against_the_reference(backend, device, uncertainty, mode, kind):
    for i, reduction in enumerate(REDUCTIONS):
        z, target, kw = _case(kind, 19, 37, device, seed=hash((uncertainty, mode, kind, i)) % 2**31)
        _check(backend, z, target, uncertainty, mode, reduction, kw, what=f"{uncertainty}/{mode}/{kind}/{reduction}")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("norm", [1.0, 1.5, 3.0])
@pytest.mark.parametrize("kind", ["smooth", "mix_rows", "dense_smooth"])
def test_brier_norms_other_than_two(backend, device, norm, kind):
    for mode in MODES:
        z, target, kw = _case(kind, 13, 29, device, seed=int(norm * 10) + len(kind))
        _check(backend, z, target, "brier", mode, "mean", kw, norm=norm, gamma=3.0, what=f"q={norm}/{mode}/{kind}")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("c", [1, 2, 17, 1000, 4099])
def test_odd_class_counts(backend, device, c):
    for kind in ("mix_smooth", "mix_rows", "dense"):
        for uncertainty, mode in (("brier", "grad"), ("focal", "loss"), ("brier", "loss")):
            z, target, kw = _case(kind, 7, c, device, seed=c + len(kind))
            _check(backend, z, target, uncertainty, mode, "sum", kw, what=f"C={c}/{kind}/{uncertainty}/{mode}")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_every_dtype(backend, device, dtype):
    for kind in ("smooth", "mix_rows", "dense_smooth"):
        for uncertainty in ("none", "focal", "brier"):
            z, target, kw = _case(kind, 16, 33, device, seed=7, dtype=dtype)
            _check(backend, z, target, uncertainty, "loss", "mean", kw, what=f"{dtype}/{kind}/{uncertainty}")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_extreme_and_infinite_logits(backend, device):
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
            _check(backend, z, y, uncertainty, mode, "none", kw, what=f"extreme/{uncertainty}/{mode}/{sorted(kw)}")
    # -inf in columns that are neither y nor m: finite without smoothing, +inf CE with it (as the reference)
    z2 = z.clone()
    z2[:, 0] = -float("inf")
    y2 = torch.randint(1, c, (n,), device=device)
    for kw in (dict(mix_target=torch.roll(y2, 1), mix_lambda=0.6), dict(label_smoothing=0.1)):
        _check(backend, z2, y2, "brier", "grad", "none", kw, what=f"-inf/{sorted(kw)}")
    dense = torch.softmax(torch.randn(n, c, device=device), dim=1)
    dense[:, 0] = 0
    dense = dense / dense.sum(dim=1, keepdim=True)
    _check(backend, z2, dense, "focal", "loss", "none", {}, what="-inf/dense with t = 0 there")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("lam", ["number", "tensor"])
def test_a_masked_column_without_target_mass_gets_no_gradient(backend, device, lam):
    """λ = 0 gives the target class y no mass: with z_y = -inf there, p_y = t_y = 0 and its gradient is exactly 0 on
    every backend, in either mode (the CPU kernel had formed p_y - t_y as (1 - t_y) - (1 - p_y), whose 1 - p_y =
    Σ_{k≠y} e_k · (1 / d) can round one ulp off 1, leaving 2^-24 there); likewise the mix class m with λ = 1."""
    n, c = 256, 9  # enough rows that some have a sum Σ_{k≠y} e_k whose product with its reciprocal rounds off 1
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
                                              mix_lambda=mix_lambda, reduction="sum", backend=backend)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(x.grad).all(), (value, uncertainty, mode)
            assert (x.grad[rows, masked] == 0).all(), (value, uncertainty, mode, x.grad[rows, masked].tolist())


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_weight_none_matches_f_cross_entropy(backend, device):
    z, _, _ = _case("smooth", 24, 50, device, seed=11)
    y = torch.randint(0, 50, (24,), device=device)
    y[5] = -100
    for a in (0.0, 0.1, 1.0):
        got = ck.uncertainty_weighted_ce(z, y, uncertainty="none", label_smoothing=a, backend=backend)
        torch.testing.assert_close(got, F.cross_entropy(z, y, label_smoothing=a), rtol=2e-6, atol=1e-6)
    probs = torch.softmax(torch.randn(24, 50, device=device), dim=1)
    for a in (0.0, 0.2):
        for reduction in REDUCTIONS:
            got = ck.uncertainty_weighted_ce(z, probs, uncertainty="none", label_smoothing=a, reduction=reduction,
                                             backend=backend)
            want = F.cross_entropy(z, probs, label_smoothing=a, reduction=reduction)
            torch.testing.assert_close(got, want, rtol=2e-6, atol=1e-5)
    lam = 0.3
    got = ck.uncertainty_weighted_ce(z, y, uncertainty="none", mix_target=y.flip(0).clamp(min=0), mix_lambda=lam,
                                     backend=backend)
    mixed = lam * F.one_hot(y.clamp(min=0), 50).float() + (1 - lam) * F.one_hot(y.flip(0).clamp(min=0), 50).float()
    want = F.cross_entropy(z, mixed, reduction="none")
    torch.testing.assert_close(got, want[y >= 0].mean(), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("uncertainty", WEIGHTS)
def test_gradcheck_in_float64(backend, device, uncertainty):
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
                                              backend=backend, reduction="sum", **kw, **sw)
        assert torch.autograd.gradcheck(fn, (z,), eps=1e-6, atol=1e-6)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_in_place_and_inference(backend, device):
    for dtype in (torch.float32, torch.bfloat16):
        for kind in ("mix_smooth", "dense"):
            z, target, kw = _case(kind, 9, 21, device, seed=2, dtype=dtype)
            want = _pair(backend, z, target, "brier", "loss", "mean", kw)
            leaf = z.detach().clone().requires_grad_()
            h = leaf * 1.0
            loss = ck.uncertainty_weighted_ce(h, target, uncertainty="brier", mode="loss", gamma=2.0, backend=backend,
                                              inplace=True, **kw)
            loss.backward()
            torch.testing.assert_close(loss.detach(), want[0], rtol=0, atol=0)
            torch.testing.assert_close(leaf.grad, want[1], rtol=0, atol=0)
            with torch.no_grad():
                plain = ck.uncertainty_weighted_ce(z, target, uncertainty="brier", mode="loss", gamma=2.0,
                                                   backend=backend, **kw)
            torch.testing.assert_close(plain, want[0], rtol=0, atol=0)
            with pytest.raises(ValueError, match="leaf"):
                ck.uncertainty_weighted_ce(z.detach().clone().requires_grad_(), target, backend=backend, inplace=True,
                                           **kw)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("lambda_dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_strided_mix_lambda(backend, device, lambda_dtype):
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
            got = _pair(backend, z, y, "brier", "loss", "none", dict(kw, mix_target=mix, mix_lambda=view))
            want = _pair(backend, z, y, "brier", "loss", "none", dict(kw, mix_target=mix,
                                                                      mix_lambda=view.contiguous()))
            torch.testing.assert_close(got[0], want[0], rtol=0, atol=0)
            torch.testing.assert_close(got[1], want[1], rtol=0, atol=0)
    bad = triples.clone()
    bad[11, 1] = 1.5
    with pytest.raises(ValueError, match=r"mix_lambda must be in \[0, 1\]"):
        ck.uncertainty_weighted_ce(z, y, mix_target=mix, mix_lambda=bad.to(lambda_dtype).to(device)[:, 1],
                                   backend=backend)
        ck.synchronize_target_checks()  # a GPU call queues the check (calibkernels._target_checks): raised here


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_kernel_refuses_what_it_cannot_run(backend, device):
    op = torch.ops.calibkernels.uncertainty_weighted_ce.default
    z = torch.randn(4, 5, device=device)
    y = torch.tensor([0, 1, 2, 3], device=device)
    lam = torch.tensor(0.5, device=device)
    with pytest.raises(RuntimeError, match="dual-focal"):
        op(z, y, None, None, 3, 1, 2.0, 2.0, -100, 1, False, None, None, None, 0.1)
    with pytest.raises(RuntimeError, match="go together"):
        op(z, y, None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, y, None, 0.0)
    with pytest.raises(RuntimeError, match="label_smoothing"):
        op(z, y, None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, None, None, 1.5)
    with pytest.raises(RuntimeError, match="dense"):
        op(z, z.softmax(1), None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, y, lam, 0.0)
    if device == "cpu":
        with pytest.raises(ValueError, match="mix_target value 9"):
            op(z, y, None, None, 4, 1, 2.0, 2.0, -100, 1, False, None, torch.tensor([0, 9, 1, 1]), lam, 0.0)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_opcheck_and_compile(backend, device):
    op = torch.ops.calibkernels.uncertainty_weighted_ce.default
    z = torch.randn(6, 7, device=device)
    y = torch.tensor([0, 1, -100, 3, 4, 6], device=device)
    mix = torch.tensor([1, 1, 0, 2, 2, 0], device=device)
    lam = torch.rand(6, device=device)
    dense = torch.softmax(torch.randn(6, 7, device=device), dim=1)
    for args in ((z, y, None, None, 4, 0, 2.0, 2.0, -100, 1, True, None, mix, lam, 0.1),
                 (z, dense, None, None, 1, 0, 2.0, 2.0, -100, 0, True, None, None, None, 0.05)):
        torch.library.opcheck(op, args)

    def step(x, target, mix_target, mix_lambda):
        return ck.uncertainty_weighted_ce(x, target, mix_target=mix_target, mix_lambda=mix_lambda,
                                          label_smoothing=0.1, backend=backend)

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


def _cpu_isa():
    import calibkernels._C as C

    return C.CPU_ISA


@pytest.mark.skipif(not any(b[0] == "cpu" for b in BACKENDS), reason="no CPU kernel")
@pytest.mark.parametrize("uncertainty,mode", [("brier", "grad"), ("focal", "loss"), ("none", "grad"), ("brier",
                                                                                                       "loss")])
def test_streaming_stores_agree_with_ordinary_stores(uncertainty, mode, monkeypatch):
    """Compact rows write the gradient with the hard rows' streaming stores (AVX-512, out of place), and dense rows
    with their own: the arithmetic is the same, so bit-identical to ordinary stores, with y and m in partial and whole
    cache lines, and rows starting at every offset within a line."""
    if _cpu_isa() != "avx512":
        pytest.skip("the streaming stores are part of the AVX-512 sweeps")
    for c in (3, 17, 40, 1000):
        z, _, _ = _case("smooth", 37, c, "cpu", seed=c)
        y = torch.randint(0, c, (37,))
        y[0], y[1] = 0, c - 1
        y[3] = -100
        mix = torch.roll(y, 1).clamp(min=0)
        mix[5] = y[5]
        # y and m in one vector, in either order, far apart, and at the row's ends
        for row, (a, b) in zip(range(6, 12), [(20, 21), (21, 20), (2, 30), (30, 2), (c - 2, c - 1), (c - 1, 0)]):
            y[row], mix[row] = a % c, b % c
        kw = dict(mix_target=mix, mix_lambda=torch.rand(37), label_smoothing=0.1)
        unsmoothed = dict(kw, label_smoothing=0.0)  # δ = 0: the ordinary form takes the hard rows' loop
        dense = torch.softmax(torch.randn(37, c, dtype=torch.float64), dim=1).float()
        # the per-row losses too: a one-ulp difference in one row can vanish in the mean
        for (target, kwargs), reduction in itertools.product(
                ((y, kw), (y, unsmoothed), (dense, dict(label_smoothing=0.1))), ("mean", "none")):
            monkeypatch.setenv("CALIBKERNELS_CPU_STREAMING_STORES", "1")
            streamed = _pair("cpu", z, target, uncertainty, mode, reduction, kwargs)
            monkeypatch.setenv("CALIBKERNELS_CPU_STREAMING_STORES", "0")
            ordinary = _pair("cpu", z, target, uncertainty, mode, reduction, kwargs)
            what = f"C = {c}, {'dense' if target.is_floating_point() else 'compact'}, {reduction}"
            assert torch.equal(streamed[0], ordinary[0]) and torch.equal(streamed[1], ordinary[1]), what


def _run_on_instruction_set(code, isa):
    """Runs `code` in a subprocess whose CPU kernel takes the `isa` build (the CPU's best when it lacks that one)."""
    code += "import calibkernels._C as C; print(C.CPU_ISA)\n"
    env = dict(os.environ, CALIBKERNELS_CPU_ISA=isa)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip() in (isa, "default")


@pytest.mark.skipif(not any(b[0] == "cpu" for b in BACKENDS), reason="no CPU kernel")
@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_each_instruction_set_build_in_a_subprocess(isa):
    """The default and AVX2 builds (the generic sweeps) agree with the reference on soft targets, and check dense
    targets' values with the host check's errors, in place before the logits are overwritten."""
    code = (
        "import torch, calibkernels as ck\n"
        "torch.manual_seed(0)\n"
        "z = torch.randn(33, 301) * 3; y = torch.randint(0, 301, (33,)); y[4] = -100\n"
        "dense = torch.softmax(torch.randn(33, 301), 1)\n"
        "cases = [(y, dict(label_smoothing=0.1, mix_target=y.flip(0).clamp(min=0), mix_lambda=torch.rand(33))),\n"
        "         (dense, dict(label_smoothing=0.05))]\n"
        "for target, kw in cases:\n"
        "  for weight, mode in (('brier', 'grad'), ('focal', 'loss'), ('flsd', 'grad'), ('brier', 'loss')):\n"
        "    out = []\n"
        "    for backend in ('cpu', 'reference'):\n"
        "      x = z.clone().requires_grad_()\n"
        "      l = ck.uncertainty_weighted_ce(x, target, uncertainty=weight, mode=mode,\n"
        "          gamma=2.0, backend=backend, **kw); l.backward(); out.append((l, x.grad))\n"
        "    torch.testing.assert_close(out[0][0], out[1][0], rtol=2e-5, atol=1e-6)\n"
        "    torch.testing.assert_close(out[0][1], out[1][1], rtol=2e-5, atol=1e-7)\n"
        "for c in (7, 1500):\n"
        "  z = torch.randn(5, c); dense = torch.softmax(torch.randn(5, c, dtype=torch.float64), 1).float()\n"
        "  cases = [dense.clone() for _ in range(4)]\n"
        "  cases[0][1, 2] = -1e-3; cases[1][3, 0] = float('nan'); cases[2][4, 1] += 3e-4; cases[3][0, 0] += 6e-5\n"
        "  for number, target in enumerate(cases):\n"
        "    texts = []\n"
        "    for backend, inplace in (('cpu', False), ('cpu', True), ('reference', False)):\n"
        "      logits = z.clone().requires_grad_() * 1 if inplace else z\n"
        "      try:\n"
        "        ck.uncertainty_weighted_ce(logits, target, backend=backend, inplace=inplace); texts.append(None)\n"
        "      except ValueError as error:\n"
        "        texts.append(str(error))\n"
        "        assert torch.equal(logits.detach(), z), 'overwritten before the error'\n"
        "    assert texts[0] == texts[1] == texts[2] and (texts[0] is None) == (number == 3), (c, number, texts)\n"
    )
    _run_on_instruction_set(code, isa)


@pytest.mark.skipif(not any(b[0] == "cpu" for b in BACKENDS), reason="no CPU kernel")
@pytest.mark.parametrize("uncertainty", ["brier", "focal"])
@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_cpu_column_m_when_the_mix_partner_dominates(uncertainty, smoothing):
    """Rows whose mix partner m holds nearly all the probability (p_m up to 1 - 1e-13), loss mode: column m's
    gradient is formed from small quantities (1 - p_m, w_m (1 - p_m) - w_y p_y, the rest's sums taken without m),
    as column y's is; the difference form had up to 75 float32 ulps of error there."""
    g = torch.Generator().manual_seed(11)
    n, c = 48, 50
    z = torch.randn(n, c, generator=g, dtype=torch.float64)
    y = torch.randint(0, c, (n,), generator=g)
    m = (y + 1 + torch.randint(0, c - 1, (n,), generator=g)) % c
    z[torch.arange(n), m] = torch.linspace(8.0, 30.0, n, dtype=torch.float64)
    lam = torch.full((n,), 0.7, dtype=torch.float64)
    grads = []
    for dtype, backend in ((torch.float32, "cpu"), (torch.float64, "reference")):
        x = z.to(dtype).requires_grad_()
        ck.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode="loss", gamma=2.0, reduction="sum", mix_target=m,
                                   mix_lambda=lam.to(dtype), label_smoothing=smoothing, backend=backend).backward()
        grads.append(x.grad.double()[torch.arange(n), m])
    ulps = ((grads[0] - grads[1]).abs() / grads[1].abs()) / torch.finfo(torch.float32).eps
    assert float(ulps.max()) < 16, f"column m: {float(ulps.max()):.1f} ulps"


def _dense_target_errors(z, target, **kw):
    """The error text of the CPU kernel's and of the reference's checks of a dense target (None where it passes)."""
    texts = []
    for backend in ("cpu", "reference"):
        try:
            ck.uncertainty_weighted_ce(z, target, uncertainty="brier", backend=backend, **kw)
            texts.append(None)
        except ValueError as error:
            texts.append(str(error))
    return texts


def _dense_target_error_in_place(z, target):
    """The CPU op's error text for a dense target in place (None where it passes); where it raises, the logits must
    be as they were (the op checks the target before its kernel overwrites them)."""
    x = z.detach().clone().requires_grad_()
    logits = x * 1  # a non-leaf that may be overwritten
    try:
        ck.uncertainty_weighted_ce(logits, target, uncertainty="brier", backend="cpu", inplace=True)
    except ValueError as error:
        assert torch.equal(logits.detach(), z), "the logits were overwritten before the error"
        return str(error)
    return None


def _off_by(dense, rows, amount):
    """dense with the mass of `rows` moved off 1 by `amount` (each row's largest entry changed, in the target's
    dtype)."""
    target = dense.clone()
    for row in rows:
        target[row, int(target[row].argmax())] += amount
    return target


@pytest.mark.skipif(not any(b[0] == "cpu" for b in BACKENDS), reason="no CPU kernel")
@pytest.mark.parametrize("logit_dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("target_dtype", [torch.float64, torch.float32, torch.float16, torch.bfloat16])
def test_cpu_kernel_checks_dense_targets_with_the_same_errors(logit_dtype, target_dtype):
    """The CPU kernel checks a dense target's values in the sweep that reads it, and in place in a flagging pass of
    its own before the kernel (the host check's two N×C reductions are skipped either way): the same ValueError text
    as the host check (which the reference runs) for negative, NaN and infinite entries and for rows off 1 by more
    than the dtype's tolerance, the worst row named, the logits intact in place; rows off by less than the tolerance
    pass, both where the kernel's margin flags them for the exact check and where it does not."""
    tolerance = V.DENSE_ROW_SUM_TOLERANCE[target_dtype]
    for c in (5, 301, 1500):
        g = torch.Generator().manual_seed(c)
        z = (torch.randn(9, c, generator=g, dtype=torch.float64) * 3).to(logit_dtype)
        peak = 6.0 * (torch.arange(c) == c // 3)  # room in the largest entry for the moves below
        dense = torch.softmax(torch.randn(9, c, generator=g, dtype=torch.float64) + peak, 1).to(target_dtype)
        bad_cases = [
            torch.where((torch.arange(9) == 4)[:, None] & (torch.arange(c) == c - 1), -1e-3, dense),
            torch.where((torch.arange(9) == 2)[:, None] & (torch.arange(c) == 0), float("nan"), dense),
            torch.where((torch.arange(9) == 8)[:, None] & (torch.arange(c) == c // 2), float("inf"), dense),
            torch.where((torch.arange(9) == 0)[:, None] & (torch.arange(c) == 1), float("-inf"), dense),
            _off_by(dense, [3], 3 * tolerance),
            _off_by(dense, [1, 6], -3 * tolerance),  # two rows off: the same worst row named
            _off_by(_off_by(dense, [1], 2 * tolerance), [7], 4 * tolerance),
        ]
        for number, target in enumerate(bad_cases):
            kernel, host = _dense_target_errors(z, target)
            assert host is not None and kernel == host, (c, number, kernel, host)
            assert _dense_target_error_in_place(z, target) == host, (c, number)
        # within the tolerance: flagged by the kernel's margin (a quarter of it) or not, the rows pass
        for amount in (0.6 * tolerance, -0.6 * tolerance, 0.1 * tolerance):
            target = _off_by(dense, [5], amount)
            if abs(float(target[5].double().sum()) - 1) > 0.95 * tolerance:
                continue  # the dtype rounded the change past the tolerance
            assert _dense_target_errors(z, target) == [None, None], (c, amount)
            assert _dense_target_error_in_place(z, target) is None, (c, amount)
            got = ck.uncertainty_weighted_ce(z, target, uncertainty="brier", backend="cpu")
            exact = ck.uncertainty_weighted_ce(z, target, uncertainty="brier", backend="reference")
            torch.testing.assert_close(got, exact, rtol=2e-2 if logit_dtype == torch.bfloat16 else 1e-4, atol=1e-5)


@pytest.mark.skipif(not any(b[0] == "cpu" for b in BACKENDS), reason="no CPU kernel")
@pytest.mark.parametrize("target_dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_cpu_kernel_refuses_a_negative_entry_whose_row_still_sums_to_1(target_dtype):
    """A negative entry that another entry compensates (the row sum stays within the margin, so only the entries'
    test can refuse it), in every lane position of the flagging pass: the first and second vector of a step, the
    tail, a row shorter than one vector; out of place and in place (before the logits are overwritten)."""
    for c in (3, 16, 17, 40, 301, 1500):
        for column in sorted({0, 1, 8, 9, 15, 16, 31, c // 2, c - 1} & set(range(1, c))):
            g = torch.Generator().manual_seed(c * 7919 + column)
            z = torch.randn(5, c, generator=g)
            dense = torch.zeros(5, c, dtype=torch.float64)
            dense[:, 0] = 1.0
            dense[3, column] = -1e-3
            dense[3, 0] += 1e-3
            target = dense.to(target_dtype)
            kernel, host = _dense_target_errors(z, target)
            assert host is not None and "finite and >= 0" in host and kernel == host, (c, column)
            assert _dense_target_error_in_place(z, target) == host, (c, column)


@pytest.mark.skipif(not any(b[0] == "cpu" for b in BACKENDS), reason="no CPU kernel")
def test_cpu_kernel_dense_check_in_place_past_2_to_18_columns_and_compiled(monkeypatch):
    """In place the op checks the target before its kernel, so a bad target leaves the logits intact, and the host
    check does not run; rows past 2^18 columns, and a float64 target of float32 logits (whose float32 copy the
    flagging pass cannot judge), take the exact check on every call; under torch.compile the kernel still refuses."""
    z = torch.randn(6, 40)
    dense = torch.softmax(torch.randn(6, 40), 1)
    bad = dense.clone()
    bad[2, 3] = -0.5
    with monkeypatch.context() as patch:
        patch.setattr(V, "dense_row_sums", lambda target2d: pytest.fail("the host check ran before the CPU op"))
        assert _dense_target_error_in_place(z, dense) is None
        assert "finite and >= 0" in _dense_target_error_in_place(z, bad)
    x = z.clone()
    with pytest.raises(ValueError, match="finite and >= 0"):
        ck.uncertainty_weighted_ce(x, bad, backend="cpu", inplace=True)  # no grad: nothing is overwritten
    assert torch.equal(x, z)
    c = (1 << 18) + 3
    wide = torch.full((2, c), 1.0 / c)
    z_wide = torch.randn(2, c)
    ck.uncertainty_weighted_ce(z_wide, wide, backend="cpu")
    assert _dense_target_error_in_place(z_wide, wide) is None
    wide[1, 5] += 3e-4
    kernel, host = _dense_target_errors(z_wide, wide)
    assert host is not None and "row 1 sums to" in host and kernel == host
    assert _dense_target_error_in_place(z_wide, wide) == host
    short = dense.double()
    short[4] *= 1 - 3e-6  # outside float64's 1e-6, which float32 sums of a float32 copy cannot resolve
    kernel, host = _dense_target_errors(z, short)
    assert host is not None and "row 4 sums to" in host and kernel == host
    assert _dense_target_error_in_place(z, short) == host
    compiled = torch.compile(lambda a, b: ck.uncertainty_weighted_ce(a, b, backend="cpu"), fullgraph=True)
    torch.testing.assert_close(compiled(z, dense), ck.uncertainty_weighted_ce(z, dense, backend="cpu"))
    with pytest.raises(Exception, match="finite and >= 0"):
        compiled(z, bad)
