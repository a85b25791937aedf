"""``calibkernels.uncertainty_weighted_ce`` as a whole: which backend a call runs (``backend="auto"`` and named
backends), the reference under torch.compile, the GPU backends in memory pools and CUDA graphs, and host-side checks
that every backend shares. The value and autograd contracts every backend meets are in
``test_uncertainty_weighted_ce_contracts*.py``.
"""

import functools
import math
import types
import warnings

import pytest
import torch

import calibkernels as ck
from calibkernels import _backends
from calibkernels import reference as R


# ----------------------------------------------------------------------------------------------------------------
# Backend selection
# ----------------------------------------------------------------------------------------------------------------
def test_auto_prefers_a_compiled_kernel_on_cpu():
    if _backends.unavailable_reason("cpu", torch.device("cpu")) is not None:
        pytest.skip("the C++ extension is not built in this install")
    assert _backends.resolve("auto", torch.device("cpu")) == "cpu"
    assert "cpu" in ck.available_backends()


def test_available_backends_always_has_reference():
    backends = ck.available_backends()
    assert backends[0] == "reference"
    assert set(backends) <= {"reference", "cpu", "cuda", "triton"}


def test_named_backend_that_cannot_run_raises():
    if torch.cuda.is_available():
        pytest.skip("needs a machine without a GPU")
    with pytest.raises(RuntimeError, match="not available"):
        ck.uncertainty_weighted_ce(torch.randn(3, 4), torch.zeros(3, dtype=torch.long), backend="cuda")


def test_auto_falls_back_to_reference_with_one_warning(monkeypatch):
    monkeypatch.setattr(_backends, "_AUTO_ORDER", {"cpu": ("cpu",)})
    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: "pretend it is not built")
    monkeypatch.setattr(_backends, "_warned_fallback", set())
    monkeypatch.setattr(_backends, "_chosen", {})  # the kept choices of earlier calls
    monkeypatch.setattr(_backends, "_chosen_hard", {})
    z, y = torch.randn(4, 3), torch.randint(0, 3, (4,))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = ck.uncertainty_weighted_ce(z, y)
        ck.uncertainty_weighted_ce(z, y)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1 and "falling back" in messages[0] and "pretend it is not built" in messages[0]
    torch.testing.assert_close(first, R.uncertainty_weighted_ce(z, y))


@pytest.mark.parametrize(("num_classes", "kind", "expected"), [
    (16, "hard", "cuda"), (1000, "hard", "cuda"), (4096, "hard", "cuda"), (4097, "hard", "triton"),
    (128256, "hard", "triton"), (4096, "smooth", "cuda"), (4097, "smooth", "triton"), (1000, "mix", "cuda"),
    (32000, "mix", "cuda"), (32001, "mix", "triton"), (1000, "dense", "cuda"), (1001, "dense", "triton"),
])
def test_auto_on_a_gpu_picks_the_kernel_by_row_width_and_target_kind(monkeypatch, num_classes, kind, expected):
    """backend="auto" on CUDA tensors (a device object only: both GPU backends made to look available): the CUDA
    kernel up to AUTO_CUDA_MAX_CLASSES[kind], Triton past it; the other kernel where the first cannot run; a named
    backend as named; on the CPU the CPU kernel."""
    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: None)
    monkeypatch.setattr(_backends, "module", lambda name: types.SimpleNamespace(SOFT_TARGETS=True))
    cuda = torch.device("cuda")
    assert _backends.resolve_for_shape("auto", cuda, num_classes, kind) == expected
    other = {"cuda": "triton", "triton": "cuda"}[expected]
    monkeypatch.setattr(_backends, "unavailable_reason",
                        lambda name, device: "pretend it is not built" if name == expected else None)
    assert _backends.resolve_for_shape("auto", cuda, num_classes, kind) == other
    assert _backends.resolve_for_shape(other, cuda, num_classes, kind) == other
    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: None)
    assert _backends.resolve_for_shape("auto", torch.device("cpu"), num_classes, kind) == "cpu"


def test_auto_on_a_gpu_keeps_soft_targets_off_a_kernel_without_them(monkeypatch):
    """A soft-target call never goes to a kernel that cannot run soft targets, nor a per-sample gamma that requires
    grad to a fused kernel: the table's first choice gives way as resolve_soft_targets decides."""
    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: None)
    monkeypatch.setattr(_backends, "module",
                        lambda name: types.SimpleNamespace(SOFT_TARGETS=name != "cuda"))
    cuda = torch.device("cuda")
    assert _backends.resolve_for_shape("auto", cuda, 1000, "smooth") == "triton"
    assert _backends.resolve_for_shape("auto", cuda, 1000, "hard") == "cuda"
    monkeypatch.setattr(_backends, "module", lambda name: types.SimpleNamespace(SOFT_TARGETS=True))
    monkeypatch.setattr(_backends, "_warned_soft_targets", True)
    assert _backends.resolve_for_shape("auto", cuda, 1000, "mix", gamma_needs_grad=True) == "reference"


def test_reference_compiles_with_fullgraph():
    model = torch.nn.Linear(6, 5)
    z_in, y = torch.randn(8, 6), torch.randint(0, 5, (8,))

    def step(x, target):
        return R.uncertainty_weighted_ce(model(x), target, uncertainty="brier", mode="grad")

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(z_in, y), step(z_in, y))
    assert not math.isnan(compiled(z_in, y).item())


def test_a_call_leaves_nothing_in_a_memory_pool(backend):
    """A pool that takes the thread's allocations (``torch.cuda.use_mem_pool``; torch.compile's CUDA-graph warm-up
    routes them the same way) holds nothing once the call's outputs are gone, also on a stream that no call has used,
    whose ticket counter the call creates: the backends keep those counters outside every pool."""
    if backend.device != "cuda":
        pytest.skip("memory pools need a GPU")
    name = backend.name
    pool = torch.cuda.MemPool()
    z = torch.randn(64, 1000, device="cuda", requires_grad=True)
    y = torch.randint(0, 1000, (64,), device="cuda")
    with torch.cuda.stream(torch.cuda.Stream()), torch.cuda.use_mem_pool(pool):
        loss = ck.uncertainty_weighted_ce(z, y, uncertainty="brier", backend=name)
        loss.backward()
        del loss
    torch.cuda.synchronize()
    ck.synchronize_target_checks()
    z.grad = None
    live = [block for segment in pool.snapshot(include_traces=False) for block in segment["blocks"]
            if block["state"] == "active_allocated"]
    assert live == [], live


def test_a_step_with_the_loss_inside_reduce_overhead_compilation(backend):
    """A linear model and the fused loss compiled together with mode="reduce-overhead" (CUDA graphs, fullgraph): the
    replayed steps give the eager step's loss and gradients, with a mix and without; the eager calls make no host
    synchronisation (torch.cuda.set_sync_debug_mode("error"))."""
    if backend.device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    name = backend.name
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1000, device="cuda")

    def forward(x, y, mix_target, mix_lambda):
        return ck.uncertainty_weighted_ce(model(x), y, uncertainty="brier", backend=name, mix_target=mix_target,
                                          mix_lambda=mix_lambda)

    compiled_forward = torch.compile(forward, mode="reduce-overhead", fullgraph=True)

    def step(run, *args):  # the backward of the compiled forward runs as a compiled graph too
        loss = run(*args)
        loss.backward()
        return loss.detach()

    compiled = functools.partial(step, compiled_forward)
    eager = functools.partial(step, forward)
    for _ in range(4):  # warm-up, recording, replays with new data
        x = torch.randn(256, 64, device="cuda")
        y = torch.randint(0, 1000, (256,), device="cuda")
        lam = torch.rand((), device="cuda")
        model.zero_grad(set_to_none=True)
        got = compiled(x, y, y.flip(0), lam).clone()
        got_grad = model.weight.grad.clone()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            expected = eager(x, y, y.flip(0), lam)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_grad, model.weight.grad, rtol=1e-4, atol=1e-5)


def test_dual_focal_soft_targets_have_their_values_checked_on_every_backend(backend_or_reference):
    """The dual-focal weight takes soft targets only when they are one-hot, and turns them into class indices before
    any kernel runs, so no kernel sees their values: a mix class out of range or a dense row that is not a
    distribution raises on every backend (the CPU backend had left both to its kernel, which never saw them)."""
    name, device = backend_or_reference
    z = torch.randn(4, 5, device=device)
    with pytest.raises(ValueError, match="mix_target value 99 is out of range"):
        ck.uncertainty_weighted_ce(z, torch.tensor([0, 1, 2, 3], device=device), uncertainty="dual_focal",
                                   backend=name, mix_target=torch.tensor([1, 2, 99, 0], device=device),
                                   mix_lambda=torch.tensor([1., 0., 1., 1.], device=device))
        ck.synchronize_target_checks()  # GPU backends raise without stalling the host, so possibly only here
    dense = torch.eye(5, device=device)[:4].clone()
    dense[1, 2] = 1.0  # sums to 2
    with pytest.raises(ValueError, match="row 1 sums to 2"):
        ck.uncertainty_weighted_ce(z, dense, uncertainty="dual_focal", backend=name)


def test_a_dense_target_call_checks_ignore_index_like_a_class_index_call(backend_or_reference):
    """``ignore_index`` must be an int whatever the target: a dense target had skipped the check (a float was taken
    silently by some backends, refused by the CPU op's schema with a RuntimeError)."""
    name, device = backend_or_reference
    z, dense = torch.randn(3, 4, device=device), torch.softmax(torch.randn(3, 4, device=device), dim=1)
    for bad in (-100.0, True, 1.5):
        with pytest.raises(TypeError, match="ignore_index must be an int"):
            ck.uncertainty_weighted_ce(z, dense, ignore_index=bad, backend=name)


def test_one_class_logits_with_any_column_stride(backend_or_reference):
    """(N, 1) logits whose column stride is not 1 (a transposed row): every backend gives the loss of one class, 0,
    with a zero gradient (Triton had refused them: PyTorch's contiguous() keeps the stride of a size-1 dimension)."""
    name, device = backend_or_reference
    x = torch.randn(1, 4, device=device).t().requires_grad_()
    assert x.stride(1) != 1
    loss = ck.uncertainty_weighted_ce(x, torch.zeros(4, dtype=torch.long, device=device), backend=name)
    loss.backward()
    assert loss.item() == 0.0 and (x.grad == 0).all()
