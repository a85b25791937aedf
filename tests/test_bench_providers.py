"""Every provider the loss bench times (bench/providers.py) computes the right loss and gradient, and says when it
cannot run a case.

Correctness only: no timing is ever asserted. Tiny shapes keep this under a few seconds apart from the one
``torch.compile`` of the reference (inductor on CPU).
"""

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench.cases import TARGET_KINDS, Case, make_inputs  # noqa: E402
from bench.measure import bench_case, bench_one  # noqa: E402
from bench.providers import (  # noqa: E402
    PROVIDERS,
    backend_target_kind,
    build_step,
    check_provider,
    check_tolerance,
    resolved_backend,
    unavailable_reason,
)
from bench.timing import peak_extra_memory, time_step  # noqa: E402

CPU_PROVIDERS = [name for name, p in PROVIDERS.items() if "cpu" in p.devices]
CUDA_PROVIDERS = [name for name, p in PROVIDERS.items() if "cuda" in p.devices]
KINDS = TARGET_KINDS


def _tiny_case(provider: str, device: str, dtype: str = "fp32", target: str = "hard") -> Case:
    # odd sizes (not multiples of a vector width); weight "none" where the provider is plain cross-entropy
    weight = "none" if PROVIDERS[provider].weights == ("none",) else "brier"
    return Case(37, 19, dtype, weight, "grad", device, target)


def _assert_runs_and_matches_reference(provider: str, case: Case, timed: bool = True):
    """One harness timing + memory measurement, then one step compared with the float64 reference.

    The same step object is used for both (``torch.compile`` compiles once)."""
    step = build_step(PROVIDERS[provider], case)
    if timed:
        leaf, target = make_inputs(case)
        timing = time_step(step, leaf, target, warmup=1, reps=2)
        assert timing.reps == 2 and math.isfinite(timing.median_ms) and timing.median_ms > 0
        assert peak_extra_memory(step, leaf, target) >= 0
    loss, grad, ref_loss, ref_grad = check_provider(PROVIDERS[provider], case, seed=1234, step=step)
    assert loss.shape == ref_loss.shape and grad.shape == ref_grad.shape == (case.n, case.c)
    rtol, atol = check_tolerance(case.dtype)
    torch.testing.assert_close(loss.double().cpu(), ref_loss.cpu(), rtol=rtol, atol=atol)
    torch.testing.assert_close(grad.double().cpu(), ref_grad.cpu(), rtol=rtol, atol=atol)


@pytest.mark.parametrize("target", KINDS)
@pytest.mark.parametrize("provider", CPU_PROVIDERS)
def test_cpu_provider_runs_and_matches_reference(provider, target):
    case = _tiny_case(provider, "cpu", target=target)
    reason = unavailable_reason(PROVIDERS[provider], case)
    if reason is not None:
        pytest.skip(reason)
    _assert_runs_and_matches_reference(provider, case)


@pytest.mark.parametrize("target", KINDS)
@pytest.mark.parametrize("provider", ["calibkernels_cpu", "calibkernels_cpu_inplace", "torch_cross_entropy"])
def test_cpu_provider_bf16_matches_reference(provider, target):
    case = _tiny_case(provider, "cpu", "bf16", target)  # a dense target stays float32, as timm builds it
    reason = unavailable_reason(PROVIDERS[provider], case)
    if reason is not None:
        pytest.skip(reason)
    _assert_runs_and_matches_reference(provider, case, timed=False)


@pytest.mark.gpu
@pytest.mark.parametrize("target", KINDS)
@pytest.mark.parametrize("provider", CUDA_PROVIDERS)
def test_cuda_provider_runs_and_matches_reference(provider, target):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    case = _tiny_case(provider, "cuda", target=target)
    reason = unavailable_reason(PROVIDERS[provider], case)
    if reason is not None:
        pytest.skip(reason)
    _assert_runs_and_matches_reference(provider, case)


def test_inapplicable_and_unknown_providers_are_reported():
    liger, ce = PROVIDERS["liger_cross_entropy"], PROVIDERS["torch_cross_entropy"]
    cpu_brier = Case(8, 4, "fp32", "brier", "grad", "cpu")
    assert unavailable_reason(liger, cpu_brier) is not None
    assert "does not apply" in unavailable_reason(ce, cpu_brier)
    result = bench_one(ce, cpu_brier)
    assert result.status.startswith("skipped") and result.median_ms is None
    with pytest.raises(RuntimeError, match="cannot run"):
        build_step(ce, cpu_brier)
    with pytest.raises(ValueError, match="dtype"):
        Case(8, 4, "fp64")


def test_providers_apply_to_the_target_kinds_they_compute():
    ce, liger = PROVIDERS["torch_cross_entropy"], PROVIDERS["liger_cross_entropy"]
    for kind in KINDS:
        assert ce.applies_to(Case(8, 4, "fp32", "none", "grad", "cpu", kind))
        assert liger.applies_to(Case(8, 4, "fp32", "none", "grad", "cuda", kind)) == (kind in ("hard", "smooth"))
        assert PROVIDERS["calibkernels_triton"].applies_to(Case(8, 4, device="cuda", target=kind))


def test_the_default_call_records_the_backend_its_call_runs(monkeypatch):
    """Provider `calibkernels` is labelled with what `ck.uncertainty_weighted_ce(..., backend="auto")` runs on the
    case: on CUDA the kernel AUTO_CUDA_MAX_CLASSES names for the row width and target kind (both GPU backends
    pretended available here), not the device's first backend."""
    from calibkernels import _backends

    monkeypatch.setattr(_backends, "unavailable_reason", lambda name, device: None)
    default = PROVIDERS["calibkernels"]
    expected = {(16, "hard"): "cuda", (1000, "dense"): "cuda", (32000, "hard"): "triton", (32000, "smooth"): "triton",
                (32000, "mix"): "cuda", (32000, "mix_smooth"): "cuda", (32000, "dense"): "triton"}
    for (c, kind), backend in expected.items():
        case = Case(64, c, "bf16", "brier", "grad", "cuda", kind)
        assert resolved_backend(default, case) == backend, (c, kind)
        kind = backend_target_kind(case)
        assert _backends.resolve_for_shape("auto", torch.device("cuda"), c, kind) == backend
    assert [backend_target_kind(Case(8, 4, target=kind)) for kind in KINDS] == [
        "hard", "smooth", "mix", "mix", "dense"]
    assert resolved_backend(PROVIDERS["calibkernels_cpu"], Case(8, 4)) is None
    # and a step row of the provider carries it
    (result,) = bench_case(Case(8, 5, "fp32", "brier", "grad", "cpu"), [default], warmup=0, reps=1,
                                   memory=False)
    assert result.config["backend"] == _backends.resolve_for_shape("auto", torch.device("cpu"), 5, "hard")
