"""The compiled CPU op with soft targets, beyond the contracts every backend meets
(``test_uncertainty_weighted_ce_contracts_soft_targets.py``): its streaming stores against ordinary ones, each
instruction-set build in a subprocess, the mix partner's column, and the op's own checks of dense targets.
"""

import itertools
import os
import subprocess
import sys

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends
from calibkernels import _validation as V

from _soft_targets_helpers import _case, _pair

pytestmark = pytest.mark.skipif(
    _backends.unavailable_reason("cpu", torch.device("cpu")) is not None,
    reason="calibkernels._C was not built with the CPU kernel",
)


def _cpu_isa():
    import calibkernels._C as C

    return C.CPU_ISA


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
