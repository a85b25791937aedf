"""Measuring cases (bench/measure.py): a failing provider is recorded and the others still measured, host-step cases
per thread count with paired ratios, the target kinds of a case timed together, an in-place provider's own logits."""

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench.cases import Case, make_inputs  # noqa: E402
from bench.measure import bench_case, bench_cases, bench_host_case  # noqa: E402
from bench.providers import PROVIDERS, Provider  # noqa: E402


def test_a_failing_provider_is_recorded_and_the_others_still_measured():
    def broken(case):
        def step(logits, target):
            raise RuntimeError("kernel exploded")

        return step

    bad = Provider("broken", "broken", ("cpu",), broken)
    case = Case(8, 5, "fp32", "brier", "grad", "cpu")
    results = bench_case(case, [bad, PROVIDERS["reference"]], warmup=1, reps=2)
    by_name = {r.provider: r for r in results}
    assert by_name["broken"].status == "error: RuntimeError: kernel exploded" and by_name["broken"].median_ms is None
    assert by_name["reference"].status == "ok" and by_name["reference"].reps == 2


# ---------------------------------------------------------------------------------------------------------------------
# Host-step suites (issue #20)
# ---------------------------------------------------------------------------------------------------------------------


def test_host_step_measures_every_provider_per_thread_count_with_paired_ratios():
    case = Case(4, 10, "fp32", "brier", "grad", "cpu")
    providers = [PROVIDERS["calibkernels"], PROVIDERS["torch_cross_entropy"]]
    threads_before = torch.get_num_threads()
    results = bench_host_case(case, providers, threads=(1, None), baseline="torch_cross_entropy", reps=3,
                                      rep_ms=1.0, warmup=2)
    assert torch.get_num_threads() == threads_before
    assert [(r.provider, r.threads) for r in results] == [
        ("calibkernels", 1), ("torch_cross_entropy", 1),
        ("calibkernels", threads_before), ("torch_cross_entropy", threads_before)]
    for r in results:
        assert r.status == "ok" and r.measure == "host_step" and r.case_id == "cpu-4x10-fp32", r
        assert r.reps == 3 and len(r.times_ms) == 3 and r.steps_per_rep >= 1 and r.min_ms <= r.median_ms <= r.max_ms
        assert r.baseline == "torch_cross_entropy" and r.ratio_to_baseline > 0 and r.paired_ratio_to_baseline > 0
    by = {(r.provider, r.threads): r for r in results}
    assert by["torch_cross_entropy", 1].ratio_to_baseline == by["torch_cross_entropy", 1].paired_ratio_to_baseline == 1
    # each row says which loss its provider computed
    assert by["calibkernels", 1].case["weight"] == "brier" and by["torch_cross_entropy", 1].case["weight"] == "none"
    ck_times, ce_times = by["calibkernels", 1].times_ms, by["torch_cross_entropy", 1].times_ms
    assert by["calibkernels", 1].paired_ratio_to_baseline == pytest.approx(
        sorted(a / b for a, b in zip(ck_times, ce_times))[1], rel=1e-3)  # times are rounded to 1 ns in the result


def _inplace_stand_in(seen):
    """A provider whose forward writes the gradient into its input's storage, as Liger's cross-entropy does (autograd
    is not told: no version bump), noting each input it gets."""
    import torch.nn.functional as F

    class WritesGradient(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, y):
            loss = F.cross_entropy(x, y)
            x.copy_((torch.softmax(x, 1) - F.one_hot(y, x.shape[1])) / x.shape[0])
            ctx.save_for_backward(x)
            return loss

        @staticmethod
        def backward(ctx, grad_output):
            (g,) = ctx.saved_tensors
            return g * grad_output, None

    def make(case):
        def step(logits, target):
            seen.append((logits.grad_fn is not None, logits.detach().clone()))
            loss = WritesGradient.apply(logits.data if logits.is_leaf else logits, target)
            if loss.requires_grad:
                loss.backward()
            return loss

        return step

    return Provider("writes_gradient", "in-place stand-in", ("cpu",), make, inplace=True)


def test_host_steps_give_each_provider_its_own_logits_and_an_inplace_one_fresh_copies():
    """Host-step suites: an in-place provider (Liger) runs on a non-leaf copy per step, and what it writes into its
    logits reaches neither its own next step nor any other provider's (F.cross_entropy's logits stay the inputs)."""
    case = Case(6, 5, "fp32", "none", "grad", "cpu")
    original, _ = make_inputs(case)
    seen_inplace, seen_ce = [], []

    def ce(case):
        def step(logits, target):
            seen_ce.append((logits.is_leaf, logits.detach().clone()))
            loss = torch.nn.functional.cross_entropy(logits, target)
            loss.backward()
            return loss

        return step

    providers = [_inplace_stand_in(seen_inplace), Provider("ce", "ce", ("cpu",), ce)]
    results = bench_host_case(case, providers, reps=2, rep_ms=0.2, warmup=2)
    assert [r.status for r in results] == ["ok", "ok"]
    assert seen_inplace and all(non_leaf for non_leaf, _ in seen_inplace)
    assert seen_ce and all(is_leaf for is_leaf, _ in seen_ce)
    for _, values in seen_inplace + seen_ce:
        assert torch.equal(values, original.detach())


# ---------------------------------------------------------------------------------------------------------------------
# Soft targets
# ---------------------------------------------------------------------------------------------------------------------


def test_the_target_kinds_of_a_case_are_timed_together_interleaved():
    seen = []

    def recorder(case):
        def step(logits, target):
            seen.append((case.target, type(target).__name__))
            loss = logits.sum()
            loss.backward()
            return loss

        return step

    provider = Provider("recorder", "recorder", ("cpu",), recorder)
    cases = [Case(8, 5, "fp32", "brier", "grad", "cpu", kind) for kind in ("hard", "smooth", "dense")]
    results = bench_cases([(case, [provider]) for case in cases], warmup=0, reps=3, memory=False)
    assert [(r.case_id, r.status, r.reps) for r in results] == [(c.id, "ok", 3) for c in cases]
    assert all(r.case["target"] == c.target for r, c in zip(results, cases))
    assert set(seen) == {("hard", "Tensor"), ("smooth", "SoftTarget"), ("dense", "SoftTarget")}
    for r in range(3):  # each repetition runs every kind once before the next repetition starts
        assert {kind for kind, _ in seen[3 * r:3 * r + 3]} == {"hard", "smooth", "dense"}
    with pytest.raises(ValueError, match="target kinds of one case"):
        bench_cases([(cases[0], [provider]), (Case(8, 6, target="smooth"), [provider])])
