"""The value checks that a GPU call makes without reading on the host (calibkernels._target_checks).

``sample_weight`` and a per-sample ``gamma`` are checked by no kernel: with ``check_values=False`` (the GPU path) the
validation helpers flag them with device ops and queue the flag, with the host check's message. ``mix_target`` and a
``mix_lambda`` tensor are checked by the GPU kernels' scan of the targets, into the target flag's code (the Triton
kernels run here under the interpreter), or by the same device ops where no kernel reads them. On CPU tensors a
queued flag is read at once, so most of this runs without a GPU; the tests named ``cuda`` check, on a GPU, that the
call makes no host synchronisation and that the error comes at ``synchronize_target_checks``.
"""

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import calibkernels as ck
from calibkernels import _backends, _target_checks
from calibkernels import _validation as V

NAN, INF = float("nan"), float("inf")
SAMPLE_WEIGHT = "sample_weight must be finite and >= 0 everywhere"
GAMMA = "per-sample gamma must be finite and >= 0 everywhere"
LAMBDA = r"mix_lambda must be in \[0, 1\] everywhere \(NaN is refused\)"


def _mix(mix_target, mix_lambda=0.5, target=None, *, check_values=False, kernel_checks=False, num_classes=5):
    target = torch.tensor([0, 1, -100, 3]) if target is None else target
    return V.check_mix(mix_target, mix_lambda, target, target.shape, num_classes, -100, target.device,
                       check_values=check_values, kernel_checks=kernel_checks)


# ------------------------------------------------------------------------------------------------- the flags
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_finite_nonnegative_flag_names_the_first_bad_row(dtype):
    good = torch.tensor([0.0, -0.0, 2.5, 1e4], dtype=dtype)
    assert V.finite_nonnegative_flag(good).tolist() == [0, 0]
    for bad in (NAN, INF, -INF, -1e-3):
        values = good.clone()
        values[2] = bad
        values[3] = bad
        flag = V.finite_nonnegative_flag(values)
        assert flag.dtype == torch.int64 and flag.shape == (2,)
        assert flag.tolist() == [1, 2], bad


def test_finite_nonnegative_flag_of_a_tensor_that_requires_grad_adds_no_graph():
    gamma = torch.tensor([1.0, -2.0], requires_grad=True)
    flag = V.finite_nonnegative_flag(gamma)
    assert flag.tolist() == [1, 1] and not flag.requires_grad


def test_mix_target_flag_names_the_first_bad_value_of_a_non_ignored_row():
    target = torch.tensor([1, -100, 2, 2, 2, 0])
    assert V.mix_target_flag(torch.tensor([0, 4, 4, 0, 3, 1]), target, 5, -100).tolist() == [0, 0]
    # row 1's 9 is on an ignored row; the first bad one is row 2's -100 (ignore_index, on a row that is not ignored)
    assert V.mix_target_flag(torch.tensor([0, 9, -100, 7, 5, 1]), target, 5, -100).tolist() == [1, -100]
    assert V.mix_target_flag(torch.tensor([0, 9, 1, 7, -1, 1]), target, 5, -100).tolist() == [1, 7]
    assert V.mix_target_flag(torch.tensor([5, 0, 0, 0, 0, -3]), target, 5, -100).tolist() == [1, 5]


def test_lambda_flag_of_a_number_tensor_and_of_one_per_row():
    for good in (0.0, 0.3, 1.0):
        assert V.lambda_flag(torch.tensor(good)).tolist() == [0, 0]
    for bad in (NAN, -0.1, 1.5, INF):
        assert V.lambda_flag(torch.tensor(bad)).tolist() == [1, 0]
        assert V.lambda_flag(torch.tensor([0.0, 1.0, bad, bad])).tolist() == [1, 2]
    assert V.lambda_flag(torch.tensor([0.0, 0.5, 1.0], dtype=torch.float64)).tolist() == [0, 0]


# --------------------------------------------------------------------- queued checks (read at once on the CPU)
@pytest.mark.parametrize("bad", [NAN, INF, -1.0])
def test_queued_sample_weight_and_gamma_checks_raise_the_host_message(bad):
    values = torch.ones(2, 3)
    values[1, 2] = bad
    for check_values in (True, False):
        with pytest.raises(ValueError, match=SAMPLE_WEIGHT):
            V.check_sample_weight(values, "external", (2, 3), values.device, check_values=check_values)
        with pytest.raises(ValueError, match=GAMMA):
            V.check_per_sample_gamma(values, "focal", (2, 3), values.device, check_values=check_values)
    good = torch.ones(2, 3)
    assert V.check_sample_weight(good, "external", (2, 3), good.device, check_values=False).shape == (6,)
    assert V.check_per_sample_gamma(good, "focal", (2, 3), good.device, check_values=False).shape == (6,)


def test_queued_mix_checks_raise_the_host_message():
    for check_values in (True, False):
        with pytest.raises(ValueError, match="mix_target value 7 is out of range for 5 classes"):
            _mix(torch.tensor([0, 7, 9, 1]), check_values=check_values)  # row 2's 9 is on an ignored row
        with pytest.raises(ValueError, match="mix_target value -100 .*it is ignore_index, but the row's target"):
            _mix(torch.tensor([-100, 0, 0, 1]), check_values=check_values)
        for lam in (torch.tensor(NAN), torch.tensor(1.5), torch.tensor([0.5, 0.5, -0.5, 0.5])):
            with pytest.raises(ValueError, match=LAMBDA):
                _mix(torch.tensor([0, 1, 9, 1]), lam, check_values=check_values)
    mix1d, lam = _mix(torch.tensor([0, 1, 9, 1]), torch.tensor(0.25))
    assert mix1d.tolist() == [0, 1, 9, 1] and lam.tolist() == [0.25] * 4


def test_a_kernel_that_checks_the_mix_gets_it_unchecked_unless_the_mix_is_dropped():
    """kernel_checks (the C++ CPU op checks the mix itself): nothing is checked here for a mix it receives; a number
    λ of 0 or 1 drops the mix before the kernel, so then the mix is checked here, with the mix's own message."""
    bad = torch.tensor([0, 7, 0, 1])
    _mix(bad, 0.5, kernel_checks=True, check_values=True)
    _mix(bad, torch.tensor(2.0), kernel_checks=True, check_values=True)
    for lam in (0.0, 1.0):
        with pytest.raises(ValueError, match="mix_target value 7"):
            _mix(bad, lam, kernel_checks=True, check_values=True)


@pytest.mark.skipif(_backends.unavailable_reason("cpu", torch.device("cpu")) is not None, reason="no CPU kernel")
def test_cpu_kernel_with_a_dropped_mix_names_the_mix_target():
    z, y = torch.randn(4, 5), torch.tensor([0, 1, -100, 3])
    with pytest.raises(ValueError, match="mix_target value 7 is out of range"):
        ck.uncertainty_weighted_ce(z, y, mix_target=torch.tensor([0, 7, 0, 1]), mix_lambda=0.0, backend="cpu")


def test_the_gpu_path_leaves_the_target_range_to_the_kernel_with_a_mix_too():
    """check_values=False reads no target value, with a mix as without (the kernels flag the range); a number λ of 0
    replaces the target, so its range is queued then, with the target's message."""
    z, y = torch.randn(4, 5), torch.tensor([0, 7, -100, 3])
    mix = torch.tensor([1, 2, 3, 4])
    for lam in (0.5, torch.tensor(0.5), 1.0):
        inputs = V.check_loss_inputs(z, y, check_values=False, mix_target=mix, mix_lambda=lam)
        assert inputs.target.tolist() == [0, 7, -100, 3]
    with pytest.raises(ValueError, match="target value 7 is out of range for 5 classes"):
        V.check_loss_inputs(z, y, check_values=False, mix_target=mix, mix_lambda=0.0)
    inputs = V.check_loss_inputs(z, torch.tensor([0, 4, -100, 3]), check_values=False, mix_target=mix, mix_lambda=0.0)
    assert inputs.target.tolist() == [1, 2, -100, 4] and inputs.mix_target is None


def test_check_loss_inputs_queues_every_value_check_on_the_gpu_path():
    z, y = torch.randn(4, 5), torch.tensor([0, 1, -100, 3])
    bad_rows = torch.tensor([1.0, -1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match=SAMPLE_WEIGHT):
        V.check_loss_inputs(z, y, uncertainty="external", sample_weight=bad_rows, check_values=False)
    with pytest.raises(ValueError, match=GAMMA):
        V.check_loss_inputs(z, y, uncertainty="focal", gamma=bad_rows, check_values=False)
    with pytest.raises(ValueError, match="mix_target value 5"):
        V.check_loss_inputs(z, y, mix_target=torch.tensor([0, 5, 0, 1]), mix_lambda=0.5, check_values=False)
    with pytest.raises(ValueError, match=LAMBDA):
        V.check_loss_inputs(z, y, mix_target=y.clamp(min=0), mix_lambda=bad_rows, check_values=False)


def test_no_flag_is_computed_when_nothing_reads_it(monkeypatch):
    bad = torch.tensor([1.0, NAN])
    real = {name: getattr(V, name) for name in ("finite_nonnegative_flag", "mix_target_flag", "lambda_flag")}

    def never(*args):
        raise AssertionError("a flag was computed that nothing reads")

    monkeypatch.setattr(_target_checks, "POLICY", "off")
    for name in real:
        monkeypatch.setattr(V, name, never)
    assert not _target_checks.checking(bad)
    V.check_sample_weight(bad, "external", (2,), bad.device, check_values=False)
    V.check_per_sample_gamma(bad, "focal", (2,), bad.device, check_values=False)
    _mix(torch.tensor([0, 7, 0, 1]), torch.tensor(NAN))
    monkeypatch.setattr(_target_checks, "POLICY", "async")
    for name, function in real.items():
        monkeypatch.setattr(V, name, function)
    assert _target_checks.checking(bad)
    with FakeTensorMode() as mode:  # a trace (here a dispatch mode): no host copy of a flag
        fake = mode.from_tensor(bad)
        assert not _target_checks.checking(fake) and not _target_checks.checking(bad)
        V.check_sample_weight(fake, "external", (2,), fake.device, check_values=False)


def test_a_target_flag_code_names_what_was_bad():
    """The first slot of a class-index target flag is a code (calibkernels._kernel_codes.TARGET_FLAG_CODES): each
    raises the
    host check's message for what it names; 0 raises nothing."""
    what = (5, -100, None)
    _target_checks._raise([0, -(2**63)], what, late=False)
    with pytest.raises(ValueError, match=r"^target value 7 is out of range for 5 classes"):
        _target_checks._raise([1, 7], what, late=False)
    with pytest.raises(ValueError, match=r"^mix_target value -100 is out of range .*but the row's target is not"):
        _target_checks._raise([2, -100], what, late=False)
    with pytest.raises(ValueError, match=LAMBDA + r" \(in an earlier call; that loss and its gradient rows are NaN\)"):
        _target_checks._raise([3, 4], what, late=True)


T = None
try:
    from calibkernels.triton import uncertainty_weighted_ce as T
except ImportError:  # no Triton
    pass


def _triton_flag_and_rows(z, y, mix, lam, reduction, compute_grad):
    """The Triton forward's target flag and, for reduction "none", its rows' losses."""
    loss, _, flag = T.uncertainty_weighted_ce_forward(
        z, y, None, None, V.WEIGHT_CODES["brier"], V.MODE_CODES["grad"], 4.0, 2.0, -100,
        V.REDUCTION_CODES[reduction], compute_grad, mix_target=mix, mix_lambda=lam)
    return flag.tolist(), loss


@pytest.mark.skipif(T is None, reason="no Triton")
@pytest.mark.parametrize("reduction, inline_rows", [("none", 1024), ("mean", 1024), ("mean", 4)],
                         ids=["checked by the loss launch", "counted by every program",
                              "checked by the targets kernel"])
def test_the_triton_scan_of_the_targets_checks_a_mix(reduction, inline_rows, monkeypatch):
    """A mix's values are checked where the targets are (the loss launch's last program, or the targets kernel of a
    large batch's mean with a gradient: here past a lowered INLINE_COUNT_MAX_ROWS, since the interpreter runs a real
    large batch slowly): the flag's code and value as the host checks raise them (a target before a mix_target before
    a λ; the largest bad target, the first bad row's mix_target, the first bad λ's row); rows with a bad mix_target
    or λ are NaN, the others as with a good mix. Checked against the host checks' own flags."""
    monkeypatch.setattr(T, "INLINE_COUNT_MAX_ROWS", inline_rows)
    targets_kernel, launches = T._uncertainty_weighted_ce_targets_kernel, []

    class Spy:  # counts the targets kernel's launches
        def __getitem__(self, grid):
            launches.append(grid)
            return targets_kernel[grid]

    monkeypatch.setattr(T, "_uncertainty_weighted_ce_targets_kernel", Spy())
    torch.manual_seed(0)
    rows, c = 9, 5
    z = torch.randn(rows, c)
    y = torch.randint(0, c, (rows,))
    y[1] = -100
    good_mix, good_lam = torch.randint(0, c, (rows,)), torch.rand(rows)
    compute_grad = reduction == "mean"

    def case(target=y, mix=good_mix, lam=good_lam):
        return _triton_flag_and_rows(z, target, mix, lam, reduction, compute_grad)

    assert case()[0][0] == 0
    bad_mix = good_mix.clone()
    bad_mix[[1, 3, 6]] = torch.tensor([9, -100, 7])  # row 1 is ignored: its mix_target is not read
    assert V.mix_target_flag(bad_mix, y, c, -100).tolist() == [1, -100]
    assert case(mix=bad_mix)[0] == [2, -100]
    bad_lam = good_lam.clone()
    bad_lam[[1, 4, 7]] = torch.tensor([1.5, float("nan"), -0.25])  # λ is read on every row, ignored or not
    assert V.lambda_flag(bad_lam).tolist() == [1, 1]
    assert case(lam=bad_lam)[0] == [3, 1]
    assert case(lam=torch.tensor(float("nan")))[0] == [3, 0]  # one λ for every row
    near = good_lam.double()
    near[[2, 5]] = torch.tensor([1 + 1e-12, -1e-300], dtype=torch.float64)  # 1 and -0 in float32: read as float64
    assert case(lam=near)[0] == [3, 2]
    assert case(mix=bad_mix, lam=bad_lam)[0] == [2, -100]  # the mix_target's check comes first
    bad_target = y.clone()
    bad_target[[2, 5]] = torch.tensor([8, 6])
    assert case(target=bad_target, mix=bad_mix, lam=bad_lam)[0] == [1, 8]  # and the target's before it
    if reduction == "none":
        _, good_rows = case()
        _, mixed = case(mix=bad_mix, lam=bad_lam)
        nan_rows = {3, 4, 6, 7}  # the non-ignored rows with a bad mix_target or λ
        assert mixed.isnan().nonzero().flatten().tolist() == sorted(nan_rows)
        keep = [i for i in range(rows) if i not in nan_rows]
        torch.testing.assert_close(mixed[keep], good_rows[keep])
        assert mixed[1].item() == 0.0  # the ignored row, whatever its mix
    assert bool(launches) == (inline_rows < rows)


def test_submit_check_reads_a_cpu_flag_at_once_with_its_message(monkeypatch):
    _target_checks.submit_check(torch.tensor([0, 3]), lambda value: f"never {value}")
    with pytest.raises(ValueError, match="^row 3 is bad$"):
        _target_checks.submit_check(torch.tensor([1, 3]), lambda value: f"row {value} is bad")
    monkeypatch.setattr(_target_checks, "POLICY", "off")
    _target_checks.submit_check(torch.tensor([1, 3]), lambda value: f"row {value} is bad")


# ------------------------------------------------------------------------------------------------------ GPU
GPU_BACKENDS = [
    name for name in ("cuda", "triton")
    if torch.cuda.is_available() and _backends.unavailable_reason(name, torch.device("cuda")) is None
]


def _bad_calls():
    """(keyword arguments, message) of calls whose one bad value no kernel checks, on 4 rows of 5 classes."""
    rows = torch.tensor([1.0, 1.0, -1.0, 1.0], device="cuda")
    mix = torch.tensor([1, 2, 3, 4], device="cuda")
    return [
        (dict(uncertainty="external", sample_weight=rows), SAMPLE_WEIGHT),
        (dict(uncertainty="focal", gamma=rows), GAMMA),
        (dict(mix_target=torch.tensor([1, 9, 3, 4], device="cuda"), mix_lambda=0.5),
         "mix_target value 9 is out of range for 5 classes"),
        (dict(mix_target=mix, mix_lambda=torch.tensor(NAN, device="cuda")), LAMBDA),
        (dict(mix_target=mix, mix_lambda=rows.clamp(max=0.5)), LAMBDA),
    ]


def _call_without_synchronisation(z, y, backend, **kwargs):
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        return ck.uncertainty_weighted_ce(z, y, backend=backend, **kwargs)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_BACKENDS, reason="needs a GPU backend on a CUDA device")
@pytest.mark.parametrize("backend", GPU_BACKENDS or ["none"])
def test_cuda_bad_values_raise_at_synchronize_without_a_host_synchronisation(monkeypatch, backend):
    monkeypatch.setattr(_target_checks, "POLICY", "async")
    z = torch.randn(4, 5, device="cuda", requires_grad=True)
    y = torch.tensor([0, 1, -100, 3], device="cuda")
    ck.synchronize_target_checks()
    for without_synchronisation in (False, True):  # first a warm-up: the first launches compile the kernels
        for kwargs, message in _bad_calls():
            # the call itself may raise already, if its check has landed when the kernel's launch polls the queue;
            # a host synchronisation would raise RuntimeError
            with pytest.raises(ValueError, match=message):
                if without_synchronisation:
                    _call_without_synchronisation(z, y, backend, **kwargs)
                else:
                    ck.uncertainty_weighted_ce(z, y, backend=backend, **kwargs)
                ck.synchronize_target_checks()
            ck.synchronize_target_checks()  # nothing else pending
    good = dict(mix_target=torch.tensor([1, 2, 9, 4], device="cuda"), mix_lambda=torch.rand(4, device="cuda"))
    loss = _call_without_synchronisation(z, y, backend, **good)  # 9 is on the ignored row
    assert torch.isfinite(loss).item()
    ck.synchronize_target_checks()


@pytest.mark.gpu
@pytest.mark.skipif(not GPU_BACKENDS, reason="needs a GPU backend on a CUDA device")
@pytest.mark.parametrize("backend", GPU_BACKENDS or ["none"])
def test_cuda_bad_values_under_the_sync_policy_raise_at_the_call_and_late_ones_say_so(monkeypatch, backend):
    z = torch.randn(4, 5, device="cuda")
    y = torch.tensor([0, 1, -100, 3], device="cuda")
    ck.synchronize_target_checks()
    monkeypatch.setattr(_target_checks, "POLICY", "sync")
    for kwargs, message in _bad_calls():
        with pytest.raises(ValueError, match=message):
            ck.uncertainty_weighted_ce(z, y, backend=backend, **kwargs)
    monkeypatch.setattr(_target_checks, "POLICY", "async")
    bad = torch.tensor([1.0, NAN, 1.0, 1.0], device="cuda")
    V.check_sample_weight(bad, "external", (4,), bad.device, check_values=False)  # queues the check, reads nothing
    torch.cuda.synchronize()
    with pytest.raises(ValueError, match=SAMPLE_WEIGHT + r".*\(in an earlier call\)"):
        ck.uncertainty_weighted_ce(z, y, backend=backend)  # the next call reports the finished check
    ck.synchronize_target_checks()
