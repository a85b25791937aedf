"""calibkernels.metrics against brute-force loop implementations written here, following the reference code of the
published tables (Mukhoti et al. 2020's ECELoss / AdaptiveECELoss / ClasswiseECELoss: a Python loop over bins with
``conf.gt(lo.item()) * conf.le(hi.item())`` membership), plus the streaming meter (incl. a real 2-process DDP merge)
and the reliability diagram."""

from __future__ import annotations

import math
import os
import socket
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from calibkernels import metrics
from calibkernels.metrics import CalibrationMeter

FUNCTIONAL_BINNED = {
    "ece": metrics.ece,
    "adaece": metrics.adaptive_ece,
    "classwise_ece": metrics.classwise_ece,
    "mce": metrics.mce,
}


# ------------------------------------------------------------------------------------------------ brute force
def _confidence_correct(probs, labels):
    confidence, prediction = probs.max(dim=1)
    return confidence, prediction.eq(labels)


def _loop_binned_error(values, hits, lowers, uppers, reduce="sum"):
    """Reference loop over bins: (lo, hi] membership compared in the values' dtype, |B|/N over all N."""
    n = values.numel()
    total, worst = 0.0, 0.0
    for lo, hi in zip(lowers, uppers):
        in_bin = values.gt(float(lo)) * values.le(float(hi))
        count = int(in_bin.sum())
        if count > 0:
            gap = abs(hits[in_bin].double().mean().item() - values[in_bin].double().mean().item())
            total += gap * count / n
            worst = max(worst, gap)
    return total if reduce == "sum" else worst


def brute_ece(probs, labels, n_bins):
    confidence, correct = _confidence_correct(probs, labels)
    edges = torch.linspace(0, 1, n_bins + 1)
    return _loop_binned_error(confidence, correct, edges[:-1], edges[1:])


def brute_mce(probs, labels, n_bins):
    confidence, correct = _confidence_correct(probs, labels)
    edges = torch.linspace(0, 1, n_bins + 1)
    return _loop_binned_error(confidence, correct, edges[:-1], edges[1:], reduce="max")


def brute_adaptive_ece(probs, labels, n_bins):
    confidence, correct = _confidence_correct(probs, labels)
    x = confidence.numpy()
    n = len(x)
    edges = np.interp(np.linspace(0, n, n_bins + 1), np.arange(n), np.sort(x))
    _, edges = np.histogram(x, edges)  # the reference passes them through np.histogram (and uses only the edges)
    return _loop_binned_error(confidence, correct, edges[:-1], edges[1:])


def brute_classwise_ece(probs, labels, n_bins):
    edges = torch.linspace(0, 1, n_bins + 1)
    per_class = [
        _loop_binned_error(probs[:, k].contiguous(), labels.eq(k), edges[:-1], edges[1:]) for k in range(probs.shape[1])
    ]
    return sum(per_class) / len(per_class)


def brute_nll(probs, labels):
    return sum(-math.log(float(probs[i, labels[i]])) for i in range(len(labels))) / len(labels)


def brute_brier(probs, labels):
    total = 0.0
    for i in range(len(labels)):
        for k in range(probs.shape[1]):
            total += (float(probs[i, k]) - (1.0 if k == labels[i] else 0.0)) ** 2
    return total / len(labels)


def brute_accuracy(probs, labels):
    return sum(int(probs[i].argmax()) == int(labels[i]) for i in range(len(labels))) / len(labels)


BRUTE_BINNED = {
    "ece": brute_ece,
    "adaece": brute_adaptive_ece,
    "classwise_ece": brute_classwise_ece,
    "mce": brute_mce,
}


def _overconfident_logits(n, c, scale=4.0):
    """Logits whose arg-max is right ~60% of the time, so every bin is populated and the gaps are not tiny."""
    logits = torch.randn(n, c) * scale
    labels = torch.where(torch.rand(n) < 0.6, logits.argmax(1), torch.randint(0, c, (n,)))
    return logits, labels


def _quantised_probs(n, c, levels=30):
    """Probabilities on a grid of multiples of 1/levels: many confidences land exactly on 15-bin edges (k/15) — in
    float32 the edge value and k/15 coincide for some k and not for others, exercising both sides of the rule."""
    top = torch.randint(levels // c + 1, levels + 1, (n,)).float() / levels  # strictly the max when c >= 2
    rest = ((1 - top) / (c - 1))[:, None].expand(n, c - 1)
    probs = torch.cat([top[:, None], rest], dim=1)
    permutation = torch.argsort(torch.rand(n, c), dim=1)
    probs = probs.gather(1, permutation)
    labels = torch.randint(0, c, (n,))
    return probs, labels


# ------------------------------------------------------------------------------------------------ against brute force
@pytest.mark.parametrize("name", list(FUNCTIONAL_BINNED))
@pytest.mark.parametrize("n_bins", [1, 7, 15])
@pytest.mark.parametrize("given", ["logits", "probs"])
def test_binned_metrics_match_brute_force(name, n_bins, given):
    logits, labels = _overconfident_logits(400, 6)
    probs = torch.softmax(logits, dim=1)
    inputs = logits if given == "logits" else probs
    got = FUNCTIONAL_BINNED[name](inputs, labels, n_bins)
    expected = BRUTE_BINNED[name](probs, labels, n_bins)
    assert isinstance(got, float)
    assert got == pytest.approx(expected, abs=1e-6)


@pytest.mark.parametrize("name", list(FUNCTIONAL_BINNED))
def test_binned_metrics_on_confidences_at_bin_edges(name):
    probs, labels = _quantised_probs(300, 3)
    got = FUNCTIONAL_BINNED[name](probs, labels, 15, inputs_are="probs")
    assert got == pytest.approx(BRUTE_BINNED[name](probs, labels, 15), abs=1e-6)


def test_confidences_exactly_on_float32_edges_belong_to_the_bin_below():
    edges = torch.linspace(0, 1, 16)
    # Two-class probabilities (c, 1 - c) with c exactly the float32 edges >= 0.5 (and c = 1.0, the last edge).
    top = edges[8:]
    probs = torch.stack([top, 1 - top], dim=1)
    labels = torch.zeros(len(top), dtype=torch.long)
    stats = metrics.reliability_bins(probs, labels, 15, inputs_are="probs")
    expected_count = torch.zeros(15, dtype=torch.float64)
    expected_count[7:15] = 1  # edge k (k = 8..15) is the upper end of bin k - 1
    torch.testing.assert_close(stats["count"], expected_count)


def test_confidence_exactly_one():
    probs = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    labels = torch.tensor([0, 0])  # first right with confidence 1, second wrong with confidence 1
    assert metrics.ece(probs, labels) == pytest.approx(0.5)
    assert metrics.mce(probs, labels) == pytest.approx(0.5)
    assert metrics.ece(probs[:1], labels[:1]) == 0.0
    assert metrics.ece(probs[1:], labels[1:]) == 1.0
    assert metrics.accuracy(probs, labels) == 0.5
    assert metrics.brier_score(probs, labels) == pytest.approx(1.0)  # (0 + 2) / 2
    assert metrics.nll(probs[:1], labels[:1]) == 0.0
    assert metrics.nll(probs, labels) == math.inf  # an impossible label under a probability input
    assert metrics.ece(probs, labels) == pytest.approx(brute_ece(probs, labels, 15), abs=1e-7)


def test_adaptive_ece_excludes_the_minimum_confidence():
    logits, labels = _overconfident_logits(200, 5)
    probs = torch.softmax(logits, dim=1)
    confidence, prediction = probs.max(dim=1)
    lowest = int(confidence.argmin())
    assert int((confidence == confidence[lowest]).sum()) == 1
    flipped = labels.clone()
    flipped[lowest] = prediction[lowest] if labels[lowest] != prediction[lowest] else (prediction[lowest] + 1) % 5
    # The minimum confidence falls in no (lo, hi] bin, so its correctness cannot change AdaECE (it still counts in N)
    assert metrics.adaptive_ece(probs, flipped) == pytest.approx(metrics.adaptive_ece(probs, labels), abs=1e-12)
    assert metrics.ece(probs, flipped) != pytest.approx(metrics.ece(probs, labels), abs=1e-9)


def test_adaptive_edges_match_numpy_interp():
    for n in (1, 2, 14, 15, 16, 97):
        confidence = torch.rand(n)
        for n_bins in (1, 4, 15):
            x = confidence.numpy()
            expected = np.interp(np.linspace(0, n, n_bins + 1), np.arange(n), np.sort(x)).astype(np.float32)
            got = metrics.equal_count_edges(confidence, n_bins)
            assert got.dtype == torch.float32
            np.testing.assert_array_equal(got.numpy(), expected)


def test_scalar_metrics_match_brute_force():
    logits, labels = _overconfident_logits(150, 4)
    probs = torch.softmax(logits, dim=1)
    for inputs in (logits, probs):
        assert metrics.nll(inputs, labels) == pytest.approx(brute_nll(probs, labels), rel=1e-5)
        assert metrics.brier_score(inputs, labels) == pytest.approx(brute_brier(probs, labels), rel=1e-6)
        assert metrics.accuracy(inputs, labels) == brute_accuracy(probs, labels)
    assert metrics.nll(logits, labels) == pytest.approx(float(F.cross_entropy(logits.double(), labels)), rel=1e-6)


# ------------------------------------------------------------------------------------------------ input handling
def test_auto_detection_and_explicit_kinds_agree():
    logits, labels = _overconfident_logits(200, 5)
    probs = torch.softmax(logits, dim=1)
    for name, fn in FUNCTIONAL_BINNED.items():
        by_logits = fn(logits, labels)
        assert fn(logits, labels, inputs_are="logits") == by_logits
        assert fn(probs, labels) == pytest.approx(by_logits, abs=1e-6)
        assert fn(probs, labels, inputs_are="probs") == pytest.approx(by_logits, abs=1e-6)
    # Treating probabilities as logits is a different (flatter) distribution: the choice matters.
    assert metrics.ece(probs, labels, inputs_are="logits") != pytest.approx(metrics.ece(probs, labels), abs=1e-3)


def test_leading_dimensions_ignore_index_and_half_precision():
    logits, labels = _overconfident_logits(120, 4)
    masked = labels.clone()
    masked[::5] = -100
    keep = masked != -100
    for name, fn in FUNCTIONAL_BINNED.items():
        reference = fn(logits[keep], labels[keep])
        assert fn(logits, masked) == pytest.approx(reference, abs=1e-12)
        assert fn(logits.reshape(6, 20, 4), masked.reshape(6, 20)) == pytest.approx(reference, abs=1e-12)
    for dtype in (torch.float16, torch.bfloat16):
        low = logits.to(dtype)
        assert metrics.ece(low, labels) == pytest.approx(metrics.ece(low.float(), labels), abs=1e-12)
    double = logits.double()
    assert metrics.ece(double, labels) == pytest.approx(brute_ece(torch.softmax(double, 1), labels, 15), abs=1e-12)


@pytest.mark.parametrize(
    "call, error",
    [
        (lambda: metrics.ece(torch.randn(4, 3), torch.tensor([0, 1, 2, 3])), ValueError),  # label out of range
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(4)), TypeError),  # float labels
        (lambda: metrics.ece(torch.randint(0, 3, (4, 3)), torch.zeros(4, dtype=torch.long)), TypeError),
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(5, dtype=torch.long)), ValueError),  # shape
        (lambda: metrics.ece(torch.randn(4), torch.zeros(4, dtype=torch.long)), ValueError),  # no class dim
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), n_bins=0), ValueError),
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), n_bins=2.5), TypeError),
        (lambda: metrics.ece(torch.randn(4, 3), torch.zeros(4, dtype=torch.long), inputs_are="p"), ValueError),
        (lambda: metrics.ece(torch.randn(0, 3), torch.zeros(0, dtype=torch.long)), ValueError),  # empty
        (lambda: metrics.ece(torch.full((2, 3), math.nan), torch.zeros(2, dtype=torch.long)), ValueError),
        (lambda: metrics.nll([[0.5, 0.5]], torch.zeros(1, dtype=torch.long)), TypeError),
    ],
)
def test_bad_inputs_raise_clear_errors(call, error):
    with pytest.raises(error):
        call()


# ------------------------------------------------------------------------------------------------ streaming
def test_meter_over_batches_equals_functional_metrics():
    logits, labels = _overconfident_logits(500, 7)
    meter = CalibrationMeter(n_bins=10)
    for chunk_logits, chunk_labels in zip(logits.split(64), labels.split(64)):
        meter.update(chunk_logits, chunk_labels)
    result = meter.compute()
    assert set(result) == set(metrics.METRIC_KEYS)
    assert all(isinstance(v, float) for v in result.values())
    expected = {
        "accuracy": metrics.accuracy(logits, labels),
        "ece": metrics.ece(logits, labels, 10),
        "adaece": metrics.adaptive_ece(logits, labels, 10),
        "classwise_ece": metrics.classwise_ece(logits, labels, 10),
        "mce": metrics.mce(logits, labels, 10),
        "nll": metrics.nll(logits, labels),
        "brier": metrics.brier_score(logits, labels),
    }
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key
    assert result == pytest.approx(metrics.calibration_metrics(logits, labels, 10), rel=1e-6, abs=1e-9)
    probs = torch.softmax(logits, dim=1)
    assert result["adaece"] == pytest.approx(brute_adaptive_ece(probs, labels, 10), abs=1e-6)

    meter.reset()
    with pytest.raises(ValueError):
        meter.compute()
    meter.update(logits[:50], labels[:50])
    assert meter.num_samples == 50
    assert meter.compute()["ece"] == pytest.approx(metrics.ece(logits[:50], labels[:50], 10), abs=1e-9)
    with pytest.raises(ValueError):
        meter.update(torch.randn(3, 4), torch.zeros(3, dtype=torch.long))  # class count changed


def test_meter_without_adaptive_tracking_keeps_constant_state():
    logits, labels = _overconfident_logits(200, 4)
    meter = CalibrationMeter(track_adaptive=False)
    meter.update(logits, labels)
    result = meter.compute()
    assert math.isnan(result["adaece"])
    assert result["ece"] == pytest.approx(metrics.ece(logits, labels), abs=1e-9)
    assert meter._confidences == []


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_worker(rank, world_size, port, shards, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        meter = CalibrationMeter(n_bins=15)
        logits, labels = shards[rank]
        for chunk_logits, chunk_labels in zip(logits.split(50), labels.split(50)):
            meter.update(chunk_logits, chunk_labels)
        merged = meter.compute()
        local = meter.compute(sync=False) if meter.num_samples else None
        torch.save({"merged": merged, "local": local}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_meter_merges_across_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    logits, labels = _overconfident_logits(330, 5)
    # Unequal shards with different data on each rank.
    shards = [(logits[:130].clone(), labels[:130].clone()), (logits[130:].clone(), labels[130:].clone())]
    mp.spawn(_ddp_worker, args=(2, _free_port(), shards, str(tmp_path)), nprocs=2, join=True)
    expected = metrics.calibration_metrics(logits, labels)
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt")
        for key in metrics.METRIC_KEYS:
            assert result["merged"][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), (rank, key)
    rank0_alone = metrics.calibration_metrics(*shards[0])
    assert torch.load(tmp_path / "rank0.pt")["local"]["ece"] == pytest.approx(rank0_alone["ece"], abs=1e-9)


# ------------------------------------------------------------------------------------------------ reliability diagram
def test_reliability_diagram_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    logits, labels = _overconfident_logits(300, 5)
    path = tmp_path / "reliability.png"
    figure = metrics.reliability_diagram(logits, labels, path=path, title="synthetic")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert path.stat().st_size > 5000
    reliability_axes = figure.axes[0]
    assert f"{100 * metrics.ece(logits, labels):.2f}%" in reliability_axes.get_title()
    assert "synthetic" in reliability_axes.get_title()

    from matplotlib.figure import Figure

    host = Figure()
    ax = host.add_subplot()
    assert metrics.reliability_diagram(logits, labels, ax=ax, n_bins=10) is host
    assert "ECE" in ax.get_title()


def test_reliability_bins_match_brute_force():
    logits, labels = _overconfident_logits(250, 4)
    probs = torch.softmax(logits, dim=1)
    confidence, correct = _confidence_correct(probs, labels)
    edges = torch.linspace(0, 1, 9)
    stats = metrics.reliability_bins(logits, labels, 8)
    for b in range(8):
        in_bin = confidence.gt(float(edges[b])) & confidence.le(float(edges[b + 1]))
        assert stats["count"][b] == int(in_bin.sum())
        if in_bin.any():
            assert float(stats["accuracy"][b]) == pytest.approx(correct[in_bin].double().mean().item())
            assert float(stats["confidence"][b]) == pytest.approx(confidence[in_bin].double().mean().item())
    assert stats["ece"] == pytest.approx(brute_ece(probs, labels, 8), abs=1e-6)


def test_reliability_diagram_without_matplotlib_says_how_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    monkeypatch.setitem(sys.modules, "matplotlib.figure", None)
    with pytest.raises(ImportError, match="pip install matplotlib"):
        metrics.reliability_diagram(torch.randn(10, 3), torch.randint(0, 3, (10,)))
