"""Meters fed top-label data (``update_top_label``), e.g. a loss's ``return_stats``, against meters fed the logits:
same bins, same ECE / MCE / AdaECE / accuracy; per-class metrics left out; ignored rows skipped; no value read back
from the device while updating; merged across two gloo ranks."""

from __future__ import annotations

import math
import os
import socket

import pytest
import torch

from calibkernels import metrics, reference
from calibkernels.metrics import CalibrationMeter, DebiasedECEMeter, SmoothECEMeter
from calibkernels.metrics.streaming import PER_CLASS_KEYS

TOP_LABEL_KEYS = tuple(key for key in metrics.METRIC_KEYS if key not in PER_CLASS_KEYS)


def _batches(num_batches=4, classes=7, ignored_share=0.15):
    """(logits (8, 9, C), labels (8, 9)) batches of an over-confident model, some rows ignored (-100)."""
    batches = []
    for _ in range(num_batches):
        labels = torch.randint(0, classes, (8, 9))
        logits = torch.randn(8, 9, classes) * 3
        logits.scatter_add_(-1, labels[..., None], torch.full((8, 9, 1), 2.0))
        labels = labels.masked_fill(torch.rand(8, 9) < ignored_share, -100)
        batches.append((logits, labels))
    return batches


def _stats(logits, labels):
    _, stats = reference.uncertainty_weighted_ce(logits, labels, return_stats=True)
    return stats.confidence, stats.prediction == labels


def _fed(meter, batches, top_label):
    for logits, labels in batches:
        if top_label:
            meter.update_top_label(*_stats(logits, labels))
        else:
            meter.update(logits, labels)
    return meter


def _concatenated(batches):
    logits = torch.cat([b[0].reshape(-1, b[0].shape[-1]) for b in batches])
    labels = torch.cat([b[1].reshape(-1) for b in batches])
    return logits, labels


@pytest.mark.parametrize("track_adaptive", [True, False])
def test_calibration_meter_from_stats_equals_meter_from_logits(track_adaptive):
    batches = _batches()
    from_logits = _fed(CalibrationMeter(n_bins=12, track_adaptive=track_adaptive), batches, top_label=False)
    from_stats = _fed(CalibrationMeter(n_bins=12, track_adaptive=track_adaptive), batches, top_label=True)
    assert from_stats.num_samples == from_logits.num_samples == int(sum((b[1] != -100).sum() for b in batches))
    assert torch.equal(from_stats._bins[0], from_logits._bins[0])  # the same samples in the same bins
    torch.testing.assert_close(from_stats._bins, from_logits._bins, rtol=1e-6, atol=1e-9)
    expected, got = from_logits.compute(), from_stats.compute()
    assert tuple(got) == TOP_LABEL_KEYS
    assert got == pytest.approx({key: expected[key] for key in TOP_LABEL_KEYS}, rel=1e-6, abs=1e-9, nan_ok=True)
    assert math.isnan(got["adaece"]) == (not track_adaptive)


def test_per_class_metrics_are_left_out_once_top_label_data_came_in():
    batches = _batches(num_batches=3)
    meter = _fed(CalibrationMeter(), batches[:2], top_label=False)
    assert tuple(meter.compute()) == metrics.METRIC_KEYS
    meter.update_top_label(*_stats(*batches[2]))
    result = meter.compute()
    assert tuple(result) == TOP_LABEL_KEYS
    logits, labels = _concatenated(batches)
    assert result["ece"] == pytest.approx(metrics.ece(logits, labels), rel=1e-6, abs=1e-9)
    assert result["adaece"] == pytest.approx(metrics.adaptive_ece(logits, labels), rel=1e-6, abs=1e-9)
    assert result["accuracy"] == pytest.approx(metrics.accuracy(logits, labels), rel=1e-12)
    # the logits fed after top-label data still find their classwise sums (allocated late)
    meter = CalibrationMeter()
    meter.update_top_label(*_stats(*batches[0]))
    meter.update(*batches[1])
    assert tuple(meter.compute()) == TOP_LABEL_KEYS and meter.num_classes == 7
    meter.reset()
    assert tuple(_fed(meter, batches, top_label=False).compute()) == metrics.METRIC_KEYS


def test_update_top_label_skips_nan_and_accepts_numeric_correctness():
    confidence = torch.tensor([0.9, math.nan, 0.55, 0.3, math.nan, 1.0])
    correct = torch.tensor([True, True, False, True, False, True])
    reference_meter = CalibrationMeter(n_bins=5, inputs_are="probs")
    kept = ~confidence.isnan()
    top = confidence[kept][:, None]
    probs = torch.cat([top, ((1 - top) / 3).expand(-1, 3)], dim=1)  # class 0 is the top label of each row
    labels = torch.where(correct[kept], 0, 1)
    reference_meter.update(probs, labels)
    expected = reference_meter.compute()
    for as_type in (torch.bool, torch.int64, torch.float32, torch.float16):
        meter = CalibrationMeter(n_bins=5)
        meter.update_top_label(confidence.reshape(2, 3), correct.reshape(2, 3).to(as_type))
        assert meter.num_samples == 4
        assert meter.compute() == pytest.approx({key: expected[key] for key in TOP_LABEL_KEYS}, abs=1e-7)
    meter = CalibrationMeter()
    meter.update_top_label(torch.full((3,), math.nan), torch.ones(3, dtype=torch.bool))
    with pytest.raises(ValueError, match="no samples"):
        meter.compute()


def test_update_top_label_checks_its_arguments():
    meter = CalibrationMeter()
    with pytest.raises(ValueError, match="shape"):
        meter.update_top_label(torch.rand(4), torch.ones(5, dtype=torch.bool))
    with pytest.raises(TypeError, match="floating point"):
        meter.update_top_label(torch.ones(4, dtype=torch.long), torch.ones(4, dtype=torch.bool))
    with pytest.raises(TypeError, match="tensors"):
        meter.update_top_label([0.5], torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="marginal"):
        DebiasedECEMeter(mode="marginal").update_top_label(torch.rand(4), torch.ones(4, dtype=torch.bool))


def test_update_top_label_reads_no_value_back(monkeypatch):
    """Every way Python code reads a tensor's value back to the host raises while the meters update: they must
    accumulate on the device without synchronising with it (and without branching on data)."""
    batches = _batches(num_batches=2)
    stats = [_stats(*batch) for batch in batches]
    meters = [CalibrationMeter(), CalibrationMeter(track_adaptive=False), SmoothECEMeter(), SmoothECEMeter(0.05),
              DebiasedECEMeter()]

    def read_back(*args, **kwargs):
        raise AssertionError("a tensor value was read back to the host")

    with monkeypatch.context() as patch:
        for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy"):
            patch.setattr(torch.Tensor, name, read_back)
        for meter in meters:
            for confidence, correct in stats:
                meter.update_top_label(confidence, correct)
    for meter in meters:
        assert meter.num_samples == sum(int((~confidence.isnan()).sum()) for confidence, _ in stats)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_update_top_label_does_not_synchronize_on_cuda():
    logits, labels = _batches(num_batches=1)[0]
    confidence, correct = (t.cuda() for t in _stats(logits, labels))
    meters = [CalibrationMeter(), SmoothECEMeter(), DebiasedECEMeter()]
    for meter in meters:  # the first update allocates the state
        meter.update_top_label(confidence, correct)
    torch.cuda.set_sync_debug_mode("error")
    try:
        for meter in meters:
            meter.update_top_label(confidence, correct)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    expected = CalibrationMeter()
    expected.update(logits.cuda(), labels.cuda())
    expected.update(logits.cuda(), labels.cuda())
    assert meters[0].compute()["ece"] == pytest.approx(expected.compute()["ece"], rel=1e-6, abs=1e-9)


def test_top_label_state_saves_restores_and_merges(tmp_path):
    batches = _batches(num_batches=4)
    whole = _fed(CalibrationMeter(), batches, top_label=False).compute()
    first = _fed(CalibrationMeter(), batches[:2], top_label=True)
    torch.save(first.state_dict(), tmp_path / "meter.pt")
    resumed = CalibrationMeter()
    resumed.load_state_dict(torch.load(tmp_path / "meter.pt", weights_only=True))
    assert resumed.num_classes is None and resumed.state_dict()["top_label"]
    second = _fed(CalibrationMeter(), batches[2:], top_label=False)
    resumed.merge_state(second)
    assert resumed.num_classes == 7
    second.merge_state(first)  # per-class sums of part of the samples: left out there too
    for meter in (resumed, second):
        assert meter.compute() == pytest.approx({key: whole[key] for key in TOP_LABEL_KEYS}, rel=1e-6, abs=1e-9)


def test_smooth_and_debiased_meters_from_stats_equal_meters_from_logits():
    batches = _batches()
    logits, labels = _concatenated(batches)
    smooth_value, sigma = metrics.smooth_ece(logits, labels, return_bandwidth=True)
    for meter in (SmoothECEMeter(), SmoothECEMeter(bandwidth=0.05)):
        from_logits = _fed(type(meter)(meter.bandwidth), batches, top_label=False)
        _fed(meter, batches, top_label=True)
        assert meter.num_samples == from_logits.num_samples
        value, bandwidth = meter.compute(return_bandwidth=True)
        expected_value, expected_bandwidth = from_logits.compute(return_bandwidth=True)
        assert bandwidth == expected_bandwidth and value == pytest.approx(expected_value, rel=1e-6)
        curve, expected_curve = meter.curve(), from_logits.curve()
        torch.testing.assert_close(curve["density"], expected_curve["density"], rtol=1e-6, atol=1e-9)
    assert _fed(SmoothECEMeter(), batches, top_label=True).compute() == pytest.approx(smooth_value, rel=1e-6)

    debiased = _fed(DebiasedECEMeter(n_bins=10), batches, top_label=True)
    assert debiased.num_samples == int((labels != -100).sum())
    assert debiased.compute() == pytest.approx(metrics.debiased_ece(logits, labels, n_bins=10), rel=1e-5)
    mixed = _fed(DebiasedECEMeter(n_bins=10), batches[:2], top_label=False)
    _fed(mixed, batches[2:], top_label=True)
    assert mixed.compute() == pytest.approx(debiased.compute(), rel=1e-5)


# ------------------------------------------------------------------------------------------------ two gloo ranks
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _ddp_worker(rank, world_size, port, shards, out_dir):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        results = {}
        # "mixed": rank 0 feeds top-label data, rank 1 logits; "stats": both ranks top-label data
        for case, top_label in (("mixed", rank == 0), ("stats", True)):
            meters = {"calibration": CalibrationMeter(), "smooth": SmoothECEMeter(), "debiased": DebiasedECEMeter()}
            for meter in meters.values():
                _fed(meter, shards[rank], top_label=top_label)
            results[case] = {"calibration": meters["calibration"].compute(),
                             "smooth": meters["smooth"].compute(return_bandwidth=True),
                             "debiased": meters["debiased"].compute()}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")
def test_top_label_meters_merge_across_two_gloo_ranks(tmp_path):
    import torch.multiprocessing as mp

    batches = _batches(num_batches=5)
    shards = [batches[:2], batches[2:]]
    mp.spawn(_ddp_worker, args=(2, _free_port(), shards, str(tmp_path)), nprocs=2, join=True)
    expected = _fed(CalibrationMeter(), batches, top_label=False).compute()
    logits, labels = _concatenated(batches)
    smooth_value, sigma = metrics.smooth_ece(logits, labels, return_bandwidth=True)
    debiased = metrics.debiased_ece(logits, labels)
    for rank in range(2):
        results = torch.load(tmp_path / f"rank{rank}.pt")
        for case, result in results.items():
            assert tuple(result["calibration"]) == TOP_LABEL_KEYS, case
            for key in TOP_LABEL_KEYS:
                assert result["calibration"][key] == pytest.approx(expected[key], rel=1e-6, abs=1e-9), (case, key)
            assert result["smooth"][1] == sigma and result["smooth"][0] == pytest.approx(smooth_value, rel=1e-6)
            assert result["debiased"] == pytest.approx(debiased, rel=1e-5), case
