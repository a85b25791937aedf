"""The compiled CPU op's vector sweeps against the reference: every target lane and row tail, the target
reference and its row-max fallback over the whole float range, streaming against ordinary stores, the softmax
gradient's accuracy, exponentials that flush to zero, confident rows, no floating-point invalid operation on
finite inputs, and each instruction-set build (AVX-512, AVX2, baseline) in a subprocess.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends
from calibkernels import _validation as V
from calibkernels import reference as R

from _tolerance import assert_within_reference_error

from _cpu_helpers import _op

pytestmark = pytest.mark.skipif(
    _backends.unavailable_reason("cpu", torch.device("cpu")) is not None,
    reason="calibkernels._C was not built with the CPU kernel",
)


# ------------------------------------------------------------------------------- vector sweeps and their exponential
def _isa():
    import calibkernels._C

    return calibkernels._C.CPU_ISA


@pytest.mark.parametrize("mode", ["grad", "loss"])
@pytest.mark.parametrize("uncertainty", ["none", "brier"])
@pytest.mark.parametrize("c", [1, 2, 15, 16, 17, 31, 33, 1000, 1031, 2049])
def test_every_target_lane_and_row_tail(c, uncertainty, mode):
    """The vector sweeps leave the target column out of the sums lane by lane and mask the row's tail: the target in
    every lane of the first, a middle and the last (partial) vector, for widths around the 8 / 16 float lanes and the
    1024-column summation block."""
    positions = sorted({p for p in [*range(min(c, 34)), *range(max(c - 34, 0), c), c // 2, 1023, 1024] if 0 <= p < c})
    y = torch.tensor(positions)
    z = torch.randn(len(positions), c) * 4
    if c > 3:
        z[:, -2] = float("-inf")  # masked column in the tail vector (never a target here unless c is tiny)
        y[y == c - 2] = c - 1
    exact = _reference_pair(z, y, uncertainty, mode, torch.float64)
    low = _reference_pair(z, y, uncertainty, mode, torch.float32)
    got = _kernel_pair(z, y, uncertainty, mode)
    assert_within_reference_error(got[0], exact[0], low[0], torch.float32, f"loss ({_isa()})")
    assert_within_reference_error(got[1], exact[1], low[1], torch.float32, f"gradient ({_isa()})")


def _reference_pair(z, y, uncertainty, mode, dtype):
    x = z.detach().to(dtype).clone().requires_grad_()
    loss = R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode=mode, gamma=3.0, reduction="none")
    loss.sum().backward()
    return loss.detach(), x.grad


def _kernel_pair(z, y, uncertainty, mode):
    x = z.detach().clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode=mode, gamma=3.0, reduction="none",
                                      backend="cpu")
    loss.sum().backward()
    return loss.detach(), x.grad


# (weight, norm q): every weight, and the gBS norms of the kernel's three p^q forms (q = 2, 1, other)
RANGE_WEIGHTS = [("none", 2.0), ("focal", 2.0), ("flsd", 2.0), ("dual_focal", 2.0), ("brier", 2.0), ("brier", 1.0),
                 ("brier", 3.0), ("external", 2.0), ("brier_flsd", 2.0)]
# what each logits dtype can hold: fp16 stops at 65504
RANGE_MARGINS = [0.0, 5.0, 30.0, 41.0, 41.5, 42.0, 44.0, 50.0, 60.0, 87.0, 88.0, 88.5, 89.0, 100.0, 1e3, 1e4]
RANGE_MARGINS_WIDE = [5e6, 1e7, 1e10, 1e20, 1e30]


def _assert_rows_close(got, exact, at_precision, dtype, what):
    """assert_within_reference_error row by row, so that a row with a loss of 1e30 does not set the bound of the
    others. For float64 the reference at the input's precision is the exact one (no own error to scale by), and two
    float64 evaluations of a loss-mode gradient (CE of up to 1e3 times du/dz) differ by more than 64 ulps: 4096."""
    ulps = 4096 if dtype == torch.float64 else 64
    for row in range(exact.shape[0]):
        assert_within_reference_error(got[row:row + 1], exact[row:row + 1], at_precision[row:row + 1], dtype,
                                      f"{what}, row {row}", ulps=ulps)


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
@pytest.mark.parametrize("mode", ["grad", "loss"])
@pytest.mark.parametrize("uncertainty,norm", RANGE_WEIGHTS, ids=[f"{w}-q{q:g}" for w, q in RANGE_WEIGHTS])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64], ids=str)
def test_target_reference_and_its_row_max_fallback(dtype, uncertainty, norm, mode, inplace):
    """The kernel takes a row's exponentials relative to the target logit and redoes the row from its max when the sums
    leave range (Σ_{k≠y} e^{z_k - z_y} > 2^60, a column ≈ 41.6 above the target). Rows on both sides of that limit:
    one column 0 … 1e4 above the target (1e30 where the dtype holds it), crossing 2^60, the exponential's overflow at
    88.7, the AVX2 clamp at 88, and past ≈ 5e6 the range where its reduction x - n ln2 is accurate; and 999 columns
    together just below and just above it (999·e^34 < 2^60 < 999·e^36). The redo re-reads the logits, so the first
    sweep must not have overwritten them: widened fp16/bf16 rows and in-place rows once gave e^margin (NaN past 89).
    Every dtype, weight, mode, in and out of place, op level, against the float64 reference of the same logits."""
    ops = _op()
    c = 1000
    margins = RANGE_MARGINS + ([] if dtype == torch.float16 else RANGE_MARGINS_WIDE)
    rows = len(margins) + 2
    z = torch.randn(rows, c) * 2
    y = torch.randint(0, c, (rows,))
    for row, margin in enumerate(margins):
        z[row, y[row]] = 0.0
        z[row, (y[row] + 1) % c] = margin
    for row, level in ((len(margins), 34.0), (len(margins) + 1, 36.0)):
        z[row] = level + torch.rand(c) * 1e-3
        z[row, y[row]] = 0.0
    z = z.to(dtype)
    sample_weight = torch.rand(rows) + 0.5 if uncertainty == "external" else None
    codes = (V.WEIGHT_CODES[uncertainty], V.MODE_CODES[mode], 3.0, norm, -100, V.REDUCTION_CODES["none"])
    buffer = z.clone()
    loss, grad, *_ = ops.uncertainty_weighted_ce(buffer, y, sample_weight, None, *codes, True,
                                                buffer if inplace else None)
    if inplace:
        grad = buffer

    def reference(precision):
        x = z.to(precision, copy=True).requires_grad_()
        w = sample_weight.to(precision) if sample_weight is not None else None
        ref = R.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, mode=mode, gamma=3.0, norm=norm, sample_weight=w,
                                        reduction="none")
        ref.sum().backward()
        return ref.detach(), x.grad

    exact = reference(torch.float64)
    # the kernel accumulates fp16/bf16 in float32 and returns a float32 loss; its gradient is rounded to the dtype
    accumulate = torch.float64 if dtype == torch.float64 else torch.float32
    low = reference(accumulate)
    what = f"{uncertainty} q={norm:g} {mode} {dtype} {'in place' if inplace else 'out of place'} ({_isa()})"
    assert torch.isfinite(loss).all() and torch.isfinite(grad.double()).all(), what
    _assert_rows_close(loss, exact[0], low[0], accumulate, f"loss, {what}")
    _assert_rows_close(grad, exact[1], low[1].to(dtype), dtype, f"gradient, {what}")


@pytest.mark.parametrize("uncertainty, mode", [("brier", "grad"), ("brier", "loss"), ("none", "grad"), ("focal",
                                                                                                        "loss")])
def test_streaming_stores_agree_with_ordinary_stores(uncertainty, mode, monkeypatch):
    """Out of place, the AVX-512 path may write the gradient with streaming stores from a per-thread scratch row
    (automatically for rows of 1–16 KiB and gradients of at least 4 MiB; CALIBKERNELS_CPU_STREAMING_STORES=1/0 forces
    it on/off). The arithmetic is the same, so the gradients must agree bit for bit with ordinary stores, over rows
    that start at every offset within a cache line (C not a multiple of 16), targets in a row's partial first and last
    lines and in whole lines, an ignored row and a row redone from its max; and match the float64 reference."""
    if _isa() != "avx512":
        pytest.skip("the streaming stores are part of the AVX-512 sweeps")
    cases = [(37, c, "1") for c in (1, 3, 16, 17, 40, 1000, 4231)] + [(1100, 1000, "")]  # "": the automatic choice
    for n, c, flag in cases:
        z = torch.randn(n, c) * 3
        y = torch.randint(0, c, (n,))
        y[0], y[1], y[2] = 0, c - 1, min(c - 1, 20)
        y[3] = -100  # ignore_index
        if c > 1:
            z[4, (int(y[4]) + 1) % c] = z[4, y[4]] + 100.0  # past the target reference's range: the row-max fallback
        monkeypatch.setenv("CALIBKERNELS_CPU_STREAMING_STORES", flag)
        streamed = _kernel_pair(z, y, uncertainty, mode)
        monkeypatch.setenv("CALIBKERNELS_CPU_STREAMING_STORES", "0")
        ordinary = _kernel_pair(z, y, uncertainty, mode)
        assert torch.equal(streamed[1], ordinary[1]), f"gradients differ at C = {c}"
        assert torch.equal(streamed[0], ordinary[0]), f"losses differ at C = {c}"
        if n <= 64:
            exact = _reference_pair(z, y, uncertainty, mode, torch.float64)
            low = _reference_pair(z, y, uncertainty, mode, torch.float32)
            assert_within_reference_error(streamed[1], exact[1], low[1], torch.float32, f"gradient, C = {c}")


def test_softmax_gradient_is_accurate_element_by_element():
    """The kernel's exponential (csrc/cpu/vec_exp.h) is within about 3 ulps: every probability of a row spanning 80
    nats, down to e^-80, is within a few ulps of float64 (much stricter than the shared suite's bound, which is
    relative to the largest gradient entry)."""
    c = 4231
    z = torch.linspace(-80.0, 0.0, c)[torch.randperm(c)].reshape(1, c)
    y = torch.tensor([int(z.argmin())])  # the target far below the max: p_y ≈ e^-80, so 1 - p_y is exactly 1
    x = z.clone().requires_grad_()
    ck.uncertainty_weighted_ce(x, y, uncertainty="none", reduction="sum", backend="cpu").backward()
    p = torch.softmax(z.double(), dim=1)
    expected = p - torch.nn.functional.one_hot(y, c).double()
    others = torch.arange(c) != y
    rel = ((x.grad.double() - expected).abs() / expected.abs())[0, others]
    assert rel.max().item() < 8 * torch.finfo(torch.float32).eps, (
        f"worst relative error {rel.max().item():.2e} ({_isa()})")


def _skip_without_flush_to_zero():
    """The kernel flushes denormal results only on x86-64 (MXCSR), and the tests below need a caller that does not."""
    import platform

    if platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip(f"the kernel keeps the default floating-point mode on {platform.machine()}")
    if (torch.tensor([1e-39]) * 0.5).item() == 0.0:
        pytest.skip("this process already flushes denormals (the tests compare against a caller that does not)")


@pytest.mark.parametrize("inplace", [False, True], ids=["out-of-place", "inplace"])
@pytest.mark.parametrize("uncertainty", ["none", "brier"])
@pytest.mark.parametrize("kind", ["hard", "mix", "dense"])
@pytest.mark.parametrize("c", [10, 1000, 1031])
def test_exponentials_below_the_float_range_flush_to_zero(c, kind, uncertainty, inplace):
    """Both vector exponentials (csrc/cpu/vec_exp.h) return exactly 0 below exp(-86), never a denormal (on Intel
    cores every denormal result costs a microcode assist, and the lanes past a row whose C is not a multiple of 16
    are -inf); the default build's exponential keeps denormals, which the kernel's flush-to-zero mode turns into 0.
    Columns 88-103 nats below the reference column get a gradient of exactly 0 (their target is 0), and no gradient
    entry of any row is subnormal."""
    _skip_without_flush_to_zero()
    g = torch.Generator().manual_seed(c)
    n = 6
    z = -88.0 - 15.0 * torch.rand(n, c, generator=g)
    z[:, :4] = torch.tensor([0.0, 0.0, -1.0, -2.0])
    z = z[:, torch.randperm(c, generator=g)]  # the in-range columns anywhere in their vectors
    live = z > -10.0
    y = torch.stack([torch.nonzero(row)[i % 3, 0] for i, row in enumerate(live)])  # sometimes not the row max
    kwargs = {}
    if kind == "mix":
        kwargs = dict(mix_target=torch.stack([torch.nonzero(row)[3, 0] for row in live]),
                      mix_lambda=torch.rand(n, generator=g))
    elif kind == "dense":
        t = torch.rand(n, c, generator=g) * live
        y = t / t.sum(1, keepdim=True)
    x = z.clone().requires_grad_()
    if inplace:
        loss = ck.uncertainty_weighted_ce(x * 1.0, y, uncertainty=uncertainty, inplace=True, backend="cpu", **kwargs)
    else:
        loss = ck.uncertainty_weighted_ce(x, y, uncertainty=uncertainty, backend="cpu", **kwargs)
    loss.backward()
    grad = x.grad
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (grad[~live] == 0).all(), f"largest deep-column gradient {grad[~live].abs().max().item():.3e} ({_isa()})"
    subnormal = (grad != 0) & (grad.abs() < torch.finfo(torch.float32).tiny)
    assert not subnormal.any(), f"{int(subnormal.sum())} subnormal gradient entries ({_isa()})"
    x64 = z.double().requires_grad_()
    expected = ck.uncertainty_weighted_ce(x64, y.double() if kind == "dense" else y, uncertainty=uncertainty,
                                          backend="reference", **kwargs)
    expected.backward()
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad.double(), x64.grad, rtol=0, atol=1e-6)


# the cases whose gradient had denormal entries before the flush (the rest came out normal or 0 without it)
CONFIDENT_ROW_CASES = [(w, m, k, d) for w, m in [("brier", "grad"), ("brier", "loss"), ("focal", "grad")]
                       for k in ["hard", "smooth", "dense"] for d in [torch.float32, torch.bfloat16, torch.float64]
                       if not (w == "brier" and k == "dense") and not (d == torch.float64 and k != "hard")]


@pytest.mark.parametrize("uncertainty,mode,kind,dtype", CONFIDENT_ROW_CASES,
                         ids=[f"{w}-{m}-{k}-{str(d)[6:]}" for w, m, k, d in CONFIDENT_ROW_CASES])
def test_confident_rows_gradients_underflow_to_zero_and_the_callers_mode_is_kept(uncertainty, mode, kind, dtype):
    """Rows whose target logit is far above the rest have a tiny weight (u ≈ 1e-19 for BSCE-GRA 25 nats apart), so
    their gradient entries u p_k / N fall below the smallest normal number: without a flush about 50000 of these
    64000 float32 entries (64000 of float64's at 150 nats) came out denormal. The kernel flushes such results to 0
    (each denormal result costs a microcode assist on Intel cores), and only inside its own tasks: the calling thread
    still computes denormals after the op."""
    _skip_without_flush_to_zero()
    tiny = torch.tensor([1e-39], dtype=torch.float32)
    g = torch.Generator().manual_seed(7)
    n, c, gap = 64, 1000, 25.0 if dtype != torch.float64 else 150.0
    y = torch.randint(0, c, (n,), generator=g)
    z = torch.randn(n, c, generator=g) + gap * torch.nn.functional.one_hot(y, c)
    target = {"hard": y, "smooth": y, "dense": torch.nn.functional.one_hot(y, c).float()}[kind]
    kwargs = dict(label_smoothing=0.0 if kind != "smooth" else 1e-30)
    x = z.to(dtype).clone().requires_grad_()
    loss = ck.uncertainty_weighted_ce(x, target, uncertainty=uncertainty, mode=mode, backend="cpu", **kwargs)
    loss.backward()
    grad = x.grad.float() if dtype == torch.bfloat16 else x.grad
    finfo = torch.finfo(grad.dtype)
    subnormal = (grad != 0) & (grad.abs() < finfo.tiny)
    assert not subnormal.any(), f"{int(subnormal.sum())} subnormal gradient entries"
    assert torch.isfinite(loss) and torch.isfinite(grad).all()
    assert (tiny * 0.5).item() != 0.0, "the op left the calling thread flushing denormals"
    x64 = z.double().clone().requires_grad_()
    expected = ck.uncertainty_weighted_ce(x64, target.double() if kind == "dense" else target, uncertainty=uncertainty,
                                          mode=mode, backend="reference", **kwargs)
    expected.backward()
    torch.testing.assert_close(grad.double(), x64.grad, rtol=0, atol=1e-12)


_TRAP_INVALID_CHILD = """
import ctypes, torch, calibkernels as ck
torch.set_num_threads(1)  # every row on this thread, the one whose traps feenableexcept sets
libm = ctypes.CDLL("libm.so.6")
g = torch.Generator().manual_seed(0)
for c in (10, 16, 1000, 1031):
    for weight, mode in [("none", "grad"), ("brier", "grad"), ("brier", "loss"), ("focal", "loss"), ("flsd", "grad")]:
        for kind in ("hard", "smooth", "mix", "dense"):
            for inplace in (False, True):
                z = torch.randn(64, c, generator=g) * 3
                y = torch.randint(0, c, (64,), generator=g)
                kw = dict(label_smoothing=0.1) if kind == "smooth" else {}
                if kind == "mix":
                    kw = dict(mix_target=y.flip(0), mix_lambda=0.3)
                t = torch.softmax(torch.randn(64, c, generator=g), 1) if kind == "dense" else y
                x = z.clone().requires_grad_()
                h = x * 1.0 if inplace else x
                # FE_INVALID traps (SIGFPE) around the op's forward only, where the kernel computes the loss and the
                # gradient: the inputs' generation and autograd's own ops are torch's, not what this test checks
                libm.feenableexcept(1)
                loss = ck.uncertainty_weighted_ce(h, t, uncertainty=weight, mode=mode, backend="cpu", inplace=inplace,
                                                  **kw)
                libm.fedisableexcept(1)
                loss.sum().backward()
print("no trap")
"""


@pytest.mark.parametrize("isa", ["native", "avx2", "default"])
def test_finite_inputs_raise_no_invalid_operation(isa):
    """On finite logits the kernel raises no invalid-operation exception, so a process that traps them (SIGFPE)
    survives a step: the lanes past a row (-inf) stay out of every unmasked operation that would form inf - inf or
    0 · inf. Hard, smoothed, mixed and dense targets, C with and without a partial vector, in place and not, each
    instruction-set build (glibc's feenableexcept, in a child process, on one thread, around the op's forward only;
    with the trap set over the whole loop, torch's input generation and backward included, the child intermittently
    died with SIGFPE on loaded machines, cause not found)."""
    import platform

    if platform.system() != "Linux" or platform.machine().lower() not in ("x86_64", "amd64"):
        pytest.skip("feenableexcept is glibc's, and the trap is checked on x86-64")
    env = dict(os.environ)
    if isa != "native":
        env["CALIBKERNELS_CPU_ISA"] = isa
        if isa == "avx2" and _isa() == "default":
            pytest.skip("this CPU (or ATen) does not run AVX2")
    run = subprocess.run([sys.executable, "-c", _TRAP_INVALID_CHILD], env=env, capture_output=True, text=True)
    assert run.returncode == 0 and "no trap" in run.stdout, (run.returncode, run.stdout[-2000:], run.stderr[-2000:])


def test_cpu_isa_is_reported_and_follows_aten():
    """calibkernels._C.CPU_ISA names the vector path in use; AVX-512 is used only when ATen uses it."""
    from torch.backends import cpu as torch_cpu

    isa = _isa()
    assert isa in ("avx512", "avx2", "default")
    if torch_cpu.get_cpu_capability() != "AVX512":
        assert isa != "avx512"


def test_avx2_sweeps_agree_with_the_reference_in_a_subprocess():
    """This process runs the AVX-512 sweeps when the CPU has them; the AVX2 ones (the path on CPUs without AVX-512)
    are checked in a child process where ATEN_CPU_CAPABILITY=avx2 turns AVX-512 off, over the shared suite's CPU
    cases and the lane / accuracy tests of this file."""
    if _isa() != "avx512":
        pytest.skip(f"this process already runs the {_isa()} sweeps")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, ATEN_CPU_CAPABILITY="avx2")
    probe = subprocess.run([sys.executable, "-c", "import calibkernels._C as c; print(c.CPU_ISA)"], env=env,
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == "avx2"
    # "cpu-cpu": the C++ backend's parametrisations only (not the reference's or the interpreted Triton's)
    selection = ("(cpu-cpu and (every_weight or odd_shapes or extreme or half_precision or nan_logits or "
                 "non_contiguous)) or every_target_lane or accurate_element or target_reference or flush_to_zero")
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-x",
         os.path.join(here, "test_uncertainty_weighted_ce.py"),
         os.path.join(here, "test_uncertainty_weighted_ce_cpu.py"),
         os.path.join(here, "test_uncertainty_weighted_ce_cpu_sweeps.py"),
         "-k", selection],
        env=env, capture_output=True, text=True, cwd=here)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    passed = re.search(r"(\d+) passed", run.stdout)
    assert passed and int(passed.group(1)) > 100 and " failed" not in run.stdout, run.stdout[-2000:]


@pytest.mark.parametrize("isa", ["default", "avx2"])
def test_each_instruction_set_build_agrees_with_the_reference_in_a_subprocess(isa):
    """The extension is compiled for the x86-64 baseline with AVX2 (and AVX-512) kernels chosen at run time;
    CALIBKERNELS_CPU_ISA=default|avx2 forces a lower one (read once per process), so each build of the kernel runs
    this file's reference comparisons (every dtype x weight x mode x in place range test, target lanes, accuracy)."""
    if isa == "avx2" and _isa() == "default":
        pytest.skip("this CPU (or ATen) does not run AVX2")
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(os.environ, CALIBKERNELS_CPU_ISA=isa)
    probe = subprocess.run([sys.executable, "-c", "import calibkernels._C as c; print(c.CPU_ISA)"], env=env,
                           capture_output=True, text=True, check=True)
    assert probe.stdout.strip() == isa
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:randomly", "-x",
         os.path.join(here, "test_uncertainty_weighted_ce_cpu.py"),
         os.path.join(here, "test_uncertainty_weighted_ce_cpu_sweeps.py"),
         os.path.join(here, "test_uncertainty_weighted_ce_cpu_flsd.py"),
         "-k", "every_target_lane or target_reference or flsd or threshold or opcheck or confident_rows or "
         "flush_to_zero"],
        env=env, capture_output=True, text=True, cwd=here)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " failed" not in run.stdout and "passed" in run.stdout, run.stdout[-2000:]
