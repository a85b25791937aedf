"""SECE and DECE (calibkernels.metrics.differentiable) against brute-force loop versions, limits, gradcheck, errors."""

import math

import pytest
import torch

from calibkernels.metrics import differentiable
from calibkernels.metrics.differentiable import dece, sece


def _confidence_and_correct(logits, labels):
    probs = torch.softmax(logits.double(), dim=-1).tolist()
    confidences, correct = [], []
    for row, label in zip(probs, labels.tolist()):
        best = max(range(len(row)), key=lambda k: row[k])
        confidences.append(row[best])
        correct.append(1.0 if best == label else 0.0)
    return probs, confidences, correct


def _sece_loop(logits, labels, bandwidth):
    """docs/metrics.md, 'SECE', literally: sACC_i = Σ_j acc_j k(c_i, c_j) / Σ_j k(c_i, c_j);
    SECE = mean_i |sACC_i - c_i|."""
    _, conf, acc = _confidence_and_correct(logits, labels)
    total = 0.0
    for c_i in conf:
        numerator = denominator = 0.0
        for c_j, a_j in zip(conf, acc):
            k = math.exp(-((c_i - c_j) ** 2) / (2 * bandwidth**2))
            numerator += a_j * k
            denominator += k
        total += abs(numerator / denominator - c_i)
    return total / len(conf)


def _dece_loop(logits, labels, n_bins, t_a, t_b):
    """Bohdal et al.'s DECE literally: soft bins, soft-rank accuracy, Σ_m (|B_m|/N) |acc_m - conf_m|."""
    probs, conf, _ = _confidence_and_correct(logits, labels)
    n = len(conf)
    cut_points = [m / n_bins for m in range(n_bins)]
    offsets, running = [], 0.0
    for cut in cut_points:
        running -= cut
        offsets.append(running)
    memberships, accuracies = [], []
    for row, label, c in zip(probs, labels.tolist(), conf):
        scores = [(c * (m + 1) + offsets[m]) / t_b for m in range(n_bins)]
        top = max(scores)
        exps = [math.exp(s - top) for s in scores]
        memberships.append([e / sum(exps) for e in exps])
        rank = 0.0
        for p_k in row:  # all-pairs soft rank, the k = y term included
            rank += 1.0 / (1.0 + math.exp(-t_a * (p_k - row[label])))
        rank += 0.5
        accuracies.append(max(0.0, 2.0 - rank))
    total = 0.0
    for m in range(n_bins):
        size = sum(o[m] for o in memberships)
        if size == 0.0:
            continue
        acc_m = sum(o[m] * a for o, a in zip(memberships, accuracies)) / size
        conf_m = sum(o[m] * c for o, c in zip(memberships, conf)) / size
        total += size / n * abs(acc_m - conf_m)
    return total


def _random_problem(n=40, c=6, scale=3.0):
    return torch.randn(n, c, dtype=torch.float64) * scale, torch.randint(0, c, (n,))


@pytest.mark.parametrize("bandwidth", [0.02, 0.05, 0.3])
def test_sece_matches_loop(bandwidth):
    logits, labels = _random_problem()
    expected = _sece_loop(logits, labels, bandwidth)
    assert sece(logits, labels, bandwidth=bandwidth).item() == pytest.approx(expected, rel=1e-9, abs=1e-12)
    # float32 logits and probability inputs give the same value
    assert sece(logits.float(), labels, bandwidth=bandwidth).item() == pytest.approx(expected, rel=1e-4, abs=1e-6)
    probs = torch.softmax(logits, dim=-1)
    assert sece(probs, labels, bandwidth=bandwidth).item() == pytest.approx(expected, rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("n_bins,t_a,t_b", [(15, 100.0, 0.01), (5, 10.0, 0.1)])
def test_dece_matches_loop(n_bins, t_a, t_b):
    logits, labels = _random_problem()
    expected = _dece_loop(logits, labels, n_bins, t_a, t_b)
    got = dece(logits, labels, n_bins=n_bins, t_a=t_a, t_b=t_b).item()
    assert got == pytest.approx(expected, rel=1e-9, abs=1e-12)
    probs = torch.softmax(logits, dim=-1)
    assert dece(probs, labels, n_bins=n_bins, t_a=t_a, t_b=t_b, inputs_are="probs").item() == pytest.approx(
        expected, rel=1e-9, abs=1e-12)


def _hard_ece(logits, labels, n_bins=15):
    probs, conf, acc = _confidence_and_correct(logits, labels)
    total = 0.0
    for b in range(n_bins):
        lo, hi = b / n_bins, (b + 1) / n_bins
        members = [i for i, c in enumerate(conf) if lo < c <= hi]
        if members:
            gap = sum(acc[i] - conf[i] for i in members) / len(members)
            total += len(members) / len(conf) * abs(gap)
    return total


def test_dece_tends_to_hard_ece_when_sharp():
    logits, labels = _random_problem(n=200, c=5, scale=2.0)
    _, conf, _ = _confidence_and_correct(logits, labels)
    # keep confidences away from bin edges so a sharp-but-finite soft binning is still effectively hard, and the
    # target's probability away from every other class's so that the soft rank (sigmoid(t_a (p_k - p_y))) is too:
    # a gap under about 1e-5 leaves it between 0 and 1 at t_a = 1e6 (about 1 seed in 1000 drew one)
    probs = torch.softmax(logits, dim=-1)
    gaps = (probs - probs.gather(1, labels[:, None])).abs()
    gaps.scatter_(1, labels[:, None], 1.0)
    keep = torch.tensor([abs(c * 15 - round(c * 15)) > 0.05 for c in conf]) & (gaps.min(dim=1).values > 1e-4)
    logits, labels = logits[keep], labels[keep]
    sharp = dece(logits, labels, n_bins=15, t_a=1e6, t_b=1e-5).item()
    assert sharp == pytest.approx(_hard_ece(logits, labels), abs=1e-6)


def test_sece_zero_when_each_confidence_level_is_calibrated():
    # every sample has confidence 0.6 and exactly 60 % are right: sACC_i = 0.6 = c_i for all i
    n, c = 50, 4
    probs = torch.full((n, c), 0.4 / (c - 1), dtype=torch.float64)
    probs[:, 0] = 0.6
    labels = torch.zeros(n, dtype=torch.long)
    labels[: n * 2 // 5] = 1 + torch.randint(0, c - 1, (n * 2 // 5,))
    labels = labels[torch.randperm(n)]
    assert sece(probs, labels).item() == pytest.approx(0.0, abs=1e-12)
    # …and equals |0.6 - accuracy| when the accuracy is off
    labels[:] = 0
    assert sece(probs, labels).item() == pytest.approx(0.4, abs=1e-12)


def test_sece_wide_bandwidth_is_global_accuracy_gap():
    logits, labels = _random_problem()
    _, conf, acc = _confidence_and_correct(logits, labels)
    accuracy = sum(acc) / len(acc)
    expected = sum(abs(accuracy - c) for c in conf) / len(conf)
    assert sece(logits, labels, bandwidth=1e4).item() == pytest.approx(expected, rel=1e-6)


def test_sece_row_chunks_give_the_same_value(monkeypatch):
    logits, labels = _random_problem(n=53)
    whole = sece(logits, labels)
    monkeypatch.setattr(differentiable, "_SECE_ROW_CHUNK", 7)
    assert sece(logits, labels).item() == pytest.approx(whole.item(), rel=1e-12)


@pytest.mark.parametrize("metric", [sece, dece])
def test_confidence_form_matches_logit_form(metric):
    logits, labels = _random_problem()
    probs = torch.softmax(logits, dim=-1)
    confidence, prediction = probs.max(dim=-1)
    from_confidences = metric(confidence, prediction == labels).item()
    if metric is sece:
        assert from_confidences == pytest.approx(metric(logits, labels).item(), rel=1e-12)
    else:
        # DECE's soft accuracy differs from hard correctness only by sigmoid tails at t_a = 100
        assert from_confidences == pytest.approx(metric(logits, labels).item(), abs=0.05)
        assert from_confidences == pytest.approx(metric(logits, labels, t_a=1e7).item(), abs=1e-6)


@pytest.mark.parametrize("metric", [sece, dece])
def test_ignore_index_drops_rows(metric):
    logits, labels = _random_problem()
    masked = labels.clone()
    masked[::3] = -100
    keep = masked != -100
    assert metric(logits, masked).item() == pytest.approx(metric(logits[keep], labels[keep]).item(), rel=1e-12)
    assert metric(logits, torch.full_like(labels, -100)).item() == 0.0


@pytest.mark.parametrize("metric,kwargs", [(sece, {"bandwidth": 0.1}), (dece, {"t_a": 20.0, "t_b": 0.05})])
def test_gradcheck(metric, kwargs):
    logits, labels = _random_problem(n=12, c=4, scale=1.5)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: metric(z, labels, inputs_are="logits", **kwargs), (logits,))


def test_gradcheck_default_dece_and_gradient_is_nonzero():
    logits, labels = _random_problem(n=10, c=3, scale=1.0)
    logits.requires_grad_(True)
    assert torch.autograd.gradcheck(lambda z: dece(z, labels, inputs_are="logits"), (logits,), atol=1e-5)
    for metric in (sece, dece):
        (grad,) = torch.autograd.grad(metric(logits, labels), logits)
        assert grad.abs().sum() > 0


def test_bad_input_raises():
    logits, labels = _random_problem(n=8, c=3)
    with pytest.raises(ValueError, match="bandwidth"):
        sece(logits, labels, bandwidth=0.0)
    with pytest.raises(ValueError, match="n_bins"):
        dece(logits, labels, n_bins=0)
    with pytest.raises(ValueError, match="t_b"):
        dece(logits, labels, t_b=-1.0)
    with pytest.raises(ValueError, match="does not match"):
        sece(logits, labels[:-1])
    with pytest.raises(ValueError, match="out of range"):
        dece(logits, torch.full_like(labels, 3))
    with pytest.raises(TypeError, match="integer"):
        sece(logits, labels.float())
    with pytest.raises(ValueError, match="inputs_are"):
        sece(logits, labels, inputs_are="logit")
    with pytest.raises(ValueError, match="correctness"):
        sece(torch.rand(8), torch.full((8,), 2))
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dece(torch.rand(8) + 1.0, torch.ones(8, dtype=torch.bool))
