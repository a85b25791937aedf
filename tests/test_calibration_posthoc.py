"""Post-hoc calibrators (calibkernels/posthoc.py): the shared interface and input policy, closed-form and first-order
checks of the scaling fits (hand-solved vector scaling, ODIR stationarity, the scalar constraint equal to temperature
scaling), exact agreement of the binning methods with loop references and scikit-learn's isotonic regression,
agreement with netcal where it implements the same method, and better held-out calibration on load_digits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import calibkernels as ck
from calibkernels import metrics, posthoc
from calibkernels.calibration import fit_temperature
from calibkernels.posthoc import (
    LOG_EPS,
    POSTHOC_METHODS,
    DirichletCalibration,
    HistogramBinning,
    IsotonicCalibration,
    MatrixScaling,
    TemperatureScaling,
    VectorScaling,
)

SCALING = ("temperature", "vector", "matrix", "dirichlet")
BINNING = ("histogram", "isotonic")


def _synthetic(n, c, *, scale=2.0, mixing=None, bias=None, generator=None, dtype=torch.float64):
    """Logits ``z`` and labels drawn from ``softmax(A z + b)`` (``A = mixing``, identity by default): calibrated when
    ``A = I, b = 0``, miscalibrated otherwise."""
    z = torch.randn(n, c, generator=generator, dtype=torch.float64) * scale
    true_logits = z if mixing is None else z @ mixing.T
    if bias is not None:
        true_logits = true_logits + bias
    labels = torch.multinomial(torch.softmax(true_logits, dim=1), 1, generator=generator).squeeze(1)
    return z.to(dtype), labels


def _miscalibrated(n, c, generator=None):
    mixing = 0.4 * torch.eye(c, dtype=torch.float64) + 0.05 * torch.randn(c, c, generator=generator,
                                                                           dtype=torch.float64)
    bias = 0.3 * torch.randn(c, generator=generator, dtype=torch.float64)
    return _synthetic(n, c, scale=3.0, mixing=mixing, bias=bias, generator=generator)


def _nll(probabilities, labels):
    return float(F.nll_loss(torch.as_tensor(probabilities).log(), labels))


# ------------------------------------------------------------------------------------------------- the interface
def test_calibrators_are_reexported_from_calibration():
    for name in ("TemperatureScaling", "VectorScaling", "MatrixScaling", "DirichletCalibration", "HistogramBinning",
                 "IsotonicCalibration", "PosthocCalibrator"):
        assert getattr(ck.calibration, name) is getattr(posthoc, name)
        assert name in ck.calibration.__all__
    assert not hasattr(ck.calibration, "TemperatureScaler")  # one temperature scaling class: TemperatureScaling


@pytest.mark.parametrize("name", list(POSTHOC_METHODS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_interface_shapes_dtypes_and_rows_summing_to_one(name, dtype):
    logits, labels = _miscalibrated(600, 5)
    calibrator = POSTHOC_METHODS[name]()
    assert calibrator.fit(logits.to(dtype).reshape(3, 200, 5), labels.reshape(3, 200)) is calibrator
    test = torch.randn(2, 7, 5, dtype=torch.float64).mul(3).to(dtype)
    probabilities = calibrator.transform(test)
    assert probabilities.shape == (2, 7, 5)
    assert probabilities.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert bool((probabilities >= 0).all())
    torch.testing.assert_close(probabilities.double().sum(-1), torch.ones(2, 7, dtype=torch.float64),
                               rtol=0, atol=1e-6 if dtype != torch.float64 else 1e-12)
    if name == "temperature":  # also an nn.Module, whose call returns the scaled logits z / T
        assert calibrator(test).dtype == dtype
        torch.testing.assert_close(calibrator(test.double()).softmax(-1).to(probabilities.dtype), probabilities,
                                   rtol=0, atol=0)
    else:
        torch.testing.assert_close(calibrator(test), probabilities, rtol=0, atol=0)  # __call__ is transform
    log_probabilities = calibrator.log_transform(test)
    torch.testing.assert_close(log_probabilities.exp(), probabilities, rtol=1e-5, atol=1e-7)
    assert calibrator.transform(torch.zeros(0, 5, dtype=dtype)).shape == (0, 5)
    assert "fitted" in repr(calibrator)


@pytest.mark.parametrize("name", list(POSTHOC_METHODS))
def test_float32_logits_fit_exactly_as_their_float64_values(name):
    logits, labels = _miscalibrated(500, 4)
    single = logits.float()
    a = POSTHOC_METHODS[name]().fit(single, labels).transform(single)
    b = POSTHOC_METHODS[name]().fit(single.double(), labels).transform(single.double())
    torch.testing.assert_close(a, b.float(), rtol=0, atol=0)  # float64 arithmetic inside, rounded once


@pytest.mark.parametrize("name", list(POSTHOC_METHODS))
def test_bad_inputs_raise_clear_errors(name):
    make = POSTHOC_METHODS[name]
    logits, labels = _miscalibrated(50, 3)
    with pytest.raises(TypeError, match="torch.Tensor"):
        make().fit(logits.numpy(), labels)
    with pytest.raises(TypeError, match="labels"):
        make().fit(logits, labels.numpy())
    with pytest.raises(TypeError, match="floating point"):
        make().fit(logits.long(), labels)
    with pytest.raises(TypeError, match="integer class indices"):
        make().fit(logits, labels.double())
    with pytest.raises(ValueError, match="does not match"):
        make().fit(logits, labels[:-1])
    with pytest.raises(ValueError, match=r"labels must lie in \[0, 3\)"):
        make().fit(logits, torch.full_like(labels, 3))
    with pytest.raises(ValueError, match="zero samples"):
        make().fit(logits[:0], labels[:0])
    with pytest.raises(ValueError, match="at least 2 classes"):
        make().fit(logits[:, :1], labels.zero_())
    for bad, message in ((math.nan, "NaN"), (math.inf, r"\+inf")):
        broken = logits.clone()
        broken[7, 1] = bad
        with pytest.raises(ValueError, match=message):
            make().fit(broken, labels)
    masked_row = logits.clone()
    masked_row[4] = -math.inf
    with pytest.raises(ValueError, match="every class masked"):
        make().fit(masked_row, labels)
    if name == "temperature":  # T alone is the map: the constructor's (1, the identity) until a fit
        torch.testing.assert_close(make().transform(logits), torch.softmax(logits, 1), rtol=0, atol=0)
    else:
        with pytest.raises(RuntimeError, match="not fitted"):
            make().transform(logits)
    fitted = make().fit(logits, labels)
    with pytest.raises(ValueError, match="fitted for 3 classes"):
        fitted.transform(torch.randn(4, 5))
    with pytest.raises(ValueError, match="NaN"):
        fitted.transform(torch.full((2, 3), math.nan))


def test_bad_hyper_parameters_raise():
    with pytest.raises(ValueError, match="reg_lambda"):
        MatrixScaling(reg_lambda=-1.0)
    with pytest.raises(ValueError, match="reg_mu"):
        DirichletCalibration(reg_mu=math.inf)
    with pytest.raises(TypeError, match="reg_lambda"):
        MatrixScaling(reg_lambda="0.1")
    with pytest.raises(TypeError, match="bias"):
        VectorScaling(bias=1)
    with pytest.raises(ValueError, match="max_iter"):
        VectorScaling(max_iter=0)
    with pytest.raises(ValueError, match="binning"):
        HistogramBinning(binning="quantile")
    with pytest.raises(ValueError, match="n_bins"):
        HistogramBinning(n_bins=0)
    with pytest.raises(TypeError, match="n_bins"):
        HistogramBinning(n_bins=2.5)
    with pytest.raises(ValueError, match="objective"):
        TemperatureScaling(objective="brier")


# -------------------------------------------------------------------------------------------------- masked classes
@pytest.mark.parametrize("name", list(POSTHOC_METHODS))
def test_masked_classes_keep_probability_zero(name):
    logits, labels = _miscalibrated(400, 4)
    mask = torch.zeros_like(logits, dtype=torch.bool)
    mask[::3, 2] = True
    mask = mask & (labels[:, None] != torch.arange(4))  # never mask the label
    masked = logits.masked_fill(mask, -math.inf)
    calibrator = POSTHOC_METHODS[name]().fit(masked, labels)
    probabilities = calibrator.transform(masked)
    assert bool((probabilities[mask] == 0).all())
    assert bool(probabilities.isfinite().all())
    torch.testing.assert_close(probabilities.sum(1), torch.ones(400, dtype=torch.float64), rtol=0, atol=1e-12)
    assert bool((calibrator.log_transform(masked)[mask] == -math.inf).all())


@pytest.mark.parametrize("name", SCALING)
def test_a_label_on_a_masked_class_has_no_nll_fit(name):
    logits, labels = _miscalibrated(100, 3)
    logits[5, labels[5]] = -math.inf
    with pytest.raises(ValueError, match="masked class"):
        POSTHOC_METHODS[name]().fit(logits, labels)


@pytest.mark.parametrize("name", BINNING)
def test_binning_methods_accept_a_label_on_a_masked_class(name):
    logits, labels = _miscalibrated(100, 3)
    logits[5, labels[5]] = -math.inf
    probabilities = POSTHOC_METHODS[name]().fit(logits, labels).transform(logits)
    assert probabilities[5, labels[5]] == 0


# ------------------------------------------------------------------------------------------------ scaling methods
def test_vector_scaling_with_two_classes_matches_the_hand_solution():
    """Three distinct logit vectors and three parameters that matter (w_0, w_1 and b_1 − b_0): the maximum-likelihood
    fit reproduces the three empirical frequencies exactly, so (w, b_1 − b_0) solve
    ``w_1 z_1 − w_0 z_0 + (b_1 − b_0) = logit(f)`` at each point."""
    points = torch.tensor([[0.5, 1.0], [-1.0, 0.3], [0.2, -0.8]], dtype=torch.float64)
    counts, positives = 40, torch.tensor([30, 12, 8])
    logits = points.repeat_interleave(counts, dim=0)
    labels = torch.cat([torch.cat([torch.ones(int(k)), torch.zeros(counts - int(k))]) for k in positives]).long()
    frequency = positives.double() / counts
    design = torch.stack([-points[:, 0], points[:, 1], torch.ones(3, dtype=torch.float64)], dim=1)
    expected = torch.linalg.solve(design, torch.logit(frequency))
    calibrator = VectorScaling().fit(logits, labels)
    w, b = calibrator.weight, calibrator.bias_vector
    torch.testing.assert_close(torch.stack([w[0], w[1], b[1] - b[0]]), expected, rtol=0, atol=1e-6)
    torch.testing.assert_close(calibrator.transform(points)[:, 1], frequency, rtol=0, atol=1e-8)


def test_matrix_scaling_constrained_to_a_scalar_is_temperature_scaling():
    logits, labels = _synthetic(2000, 6, scale=4.0)
    masked = torch.zeros_like(logits, dtype=torch.bool)
    weight, shift = posthoc._fit_affine(logits, labels, masked, "scalar", False, 0.0, 0.0, 500)
    assert weight.shape == () and bool((shift == 0).all())
    temperature = fit_temperature(logits, labels, objective="nll")
    assert 1.0 / float(weight) == pytest.approx(temperature, rel=1e-6)
    assert float(TemperatureScaling().fit(logits, labels).temperature) == pytest.approx(temperature, rel=1e-12)


def test_matrix_scaling_with_strong_odir_penalties_tends_to_vector_scaling_without_bias():
    # The off-diagonal weights, the bias and the gap to vector scaling without bias shrink like 1/λ.
    logits, labels = _miscalibrated(1500, 4)
    vector = VectorScaling(bias=False).fit(logits, labels).transform(logits)
    gaps = []
    for strength in (1e3, 1e4):
        strong = MatrixScaling(reg_lambda=strength, reg_mu=strength).fit(logits, labels)
        off_diagonal = strong.weight[~torch.eye(4, dtype=torch.bool)]
        assert float(off_diagonal.abs().max()) < 10 / strength and float(strong.bias_vector.abs().max()) < 10 / strength
        gaps.append(float((strong.transform(logits) - vector).abs().max()))
    assert gaps[1] < 1e-3 and gaps[1] < 0.2 * gaps[0], gaps


@pytest.mark.parametrize("cls", [VectorScaling, MatrixScaling, DirichletCalibration])
def test_scaling_fits_are_stationary_points_of_the_odir_objective(cls):
    """The gradient of ``mean NLL + λ/(C(C−1)) Σ_{i≠j} W_ij² + μ/C Σ b_j²``, written out by hand, vanishes at the fit:
    ``(Q − Y)ᵀ X / N + 2λ/(C(C−1)) · offdiag(W) = 0`` and ``mean(Q − Y) + 2μ/C · b = 0``."""
    c = 5
    logits, labels = _miscalibrated(3000, c)
    reg_lambda, reg_mu = 0.7, 0.3
    calibrator = cls(reg_mu=reg_mu) if cls is VectorScaling else cls(reg_lambda=reg_lambda, reg_mu=reg_mu)
    calibrator.fit(logits, labels)
    features = logits if cls is not DirichletCalibration else torch.log_softmax(logits, 1).clamp(min=LOG_EPS)
    residual = calibrator.transform(logits) - F.one_hot(labels, c).double()
    weight_gradient = residual.T @ features / len(labels)
    if cls is VectorScaling:
        weight_gradient = weight_gradient.diagonal()
    else:
        off_diagonal = ~torch.eye(c, dtype=torch.bool)
        weight_gradient = weight_gradient + 2 * reg_lambda / (c * (c - 1)) * calibrator.weight * off_diagonal
    bias_gradient = residual.mean(0) + 2 * reg_mu / c * calibrator.bias_vector
    assert float(weight_gradient.abs().max()) < 1e-7
    assert float(bias_gradient.abs().max()) < 1e-7


def test_a_scaling_fit_that_runs_out_of_iterations_warns():
    logits, labels = _miscalibrated(500, 4)
    with pytest.warns(RuntimeWarning, match="max_iter=2"):
        MatrixScaling(reg_lambda=0.0, reg_mu=0.0, max_iter=2).fit(logits, labels)


@pytest.mark.parametrize("make", [VectorScaling, lambda: MatrixScaling(reg_lambda=0.0, reg_mu=0.0),
                                  lambda: DirichletCalibration(reg_lambda=0.0, reg_mu=0.0)],
                         ids=["vector", "matrix", "dirichlet"])
def test_a_scaling_fit_on_a_separable_split_warns(make):
    """Labels that are the rows' arg-max make a separable split: the unpenalised NLL falls towards 0 as the weights
    grow, and L-BFGS stops on the flat NLL before its max_iter. The fit says the map is not an optimum."""
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(200, 5, generator=generator, dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="nearly\\) separable"):
        make().fit(logits, logits.argmax(1))


@pytest.mark.parametrize("cls", [MatrixScaling, DirichletCalibration])
def test_unregularised_matrix_and_dirichlet_match_multinomial_logistic_regression(cls):
    """Without penalty both are maximum-likelihood multinomial logistic regressions (on z, resp. ln p), which
    scikit-learn fits independently (lbfgs): same probabilities, and our NLL is at least as low."""
    LogisticRegression = pytest.importorskip("sklearn.linear_model").LogisticRegression
    logits, labels = _miscalibrated(3000, 5)
    ours = cls(reg_lambda=0.0, reg_mu=0.0).fit(logits, labels).transform(logits)
    features = logits if cls is MatrixScaling else torch.log_softmax(logits, 1).clamp(min=LOG_EPS)
    reference = LogisticRegression(C=np.inf, tol=1e-12, max_iter=100_000).fit(features.numpy(), labels.numpy())
    theirs = torch.from_numpy(reference.predict_proba(features.numpy()))
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-5)
    assert _nll(ours, labels) <= _nll(theirs, labels) + 1e-10


# ------------------------------------------------------------------------------------------------ binning methods
def _histogram_reference(p_val, y_val, p_test, n_bins, equal_mass):
    """Per class with numpy: np.quantile / linspace edges, (lo, hi] bins with 0 in the first, bin frequencies (the
    midpoint for an empty bin), then renormalised."""
    num_classes = p_val.shape[1]
    scores = np.zeros_like(p_test)
    for k in range(num_classes):
        if equal_mass:
            edges = np.quantile(p_val[:, k], np.linspace(0, 1, n_bins + 1))
            edges[0], edges[-1] = 0.0, 1.0
        else:
            edges = np.linspace(0, 1, n_bins + 1)
        fit_bins = np.clip(np.digitize(p_val[:, k], edges[1:-1], right=True), 0, n_bins - 1)
        values = np.array([(y_val[fit_bins == b] == k).mean() if (fit_bins == b).any()
                           else (edges[b] + edges[b + 1]) / 2 for b in range(n_bins)])
        scores[:, k] = values[np.digitize(p_test[:, k], edges[1:-1], right=True)]
    total = scores.sum(1, keepdims=True)
    return np.where(total > 0, scores / np.where(total > 0, total, 1), 1 / num_classes)


@pytest.mark.parametrize("binning", ["equal_width", "equal_mass"])
@pytest.mark.parametrize("n_bins", [1, 7, 15])
def test_histogram_binning_matches_a_per_class_loop(binning, n_bins):
    logits, labels = _miscalibrated(800, 4)
    test = torch.randn(300, 4, dtype=torch.float64) * 3
    calibrator = HistogramBinning(n_bins, binning=binning).fit(logits, labels)
    assert calibrator.edges.shape == (4, n_bins + 1) and calibrator.bin_values.shape == (4, n_bins)
    expected = _histogram_reference(torch.softmax(logits, 1).numpy(), labels.numpy(), torch.softmax(test, 1).numpy(),
                                    n_bins, binning == "equal_mass")
    torch.testing.assert_close(calibrator.transform(test), torch.from_numpy(expected), rtol=0, atol=1e-12)


def test_histogram_bins_are_lo_hi_closed_like_the_metrics():
    # Two classes, two bins (0, 0.5] and (0.5, 1]: p = 0.5 exactly (equal logits) belongs to the lower bin.
    logits = torch.tensor([[0.0, 0.0]] * 4 + [[0.0, 2.0]] * 4, dtype=torch.float64)
    labels = torch.tensor([1, 1, 1, 0, 1, 1, 0, 0])
    calibrator = HistogramBinning(n_bins=2).fit(logits, labels)
    # class 1: lower bin holds the four p = 0.5 rows (3 positives), upper bin the four p = 0.88 rows (2 positives).
    torch.testing.assert_close(calibrator.bin_values[1], torch.tensor([0.75, 0.5], dtype=torch.float64))
    # class 0: every p_0 (0.5 and 0.12) is in the lower bin: 3 positives of 8; the upper bin is empty (midpoint).
    torch.testing.assert_close(calibrator.bin_values[0], torch.tensor([3 / 8, 0.75], dtype=torch.float64))


def test_rows_whose_scores_are_all_zero_become_uniform():
    # Every calibration label is its row's arg-max with p > 0.5, so each class's lower bin (0, 0.5] has frequency 0:
    # a test row with every p <= 0.5 scores 0 everywhere and falls back to the uniform distribution.
    logits = torch.tensor([[3.0, 0.0, 0.0], [0.0, 3.0, 0.0], [0.0, 0.0, 3.0]], dtype=torch.float64).repeat(5, 1)
    labels = torch.tensor([0, 1, 2]).repeat(5)
    calibrator = HistogramBinning(n_bins=2).fit(logits, labels)
    uniform = calibrator.transform(torch.zeros(1, 3, dtype=torch.float64), inputs_are="logits")  # not ambiguous
    torch.testing.assert_close(uniform, torch.full((1, 3), 1 / 3, dtype=torch.float64), rtol=0, atol=0)
    masked = calibrator.transform(torch.tensor([[0.0, 0.0, -math.inf]], dtype=torch.float64))
    torch.testing.assert_close(masked, torch.tensor([[0.5, 0.5, 0.0]], dtype=torch.float64), rtol=0, atol=0)


def test_isotonic_matches_scikit_learn_per_class_with_ties():
    IsotonicRegression = pytest.importorskip("sklearn.isotonic").IsotonicRegression
    logits, labels = _miscalibrated(1500, 5)
    logits = (logits * 4).round() / 4  # many tied probabilities
    test = torch.cat([torch.randn(400, 5, dtype=torch.float64) * 3, logits[:100]])  # also exactly on thresholds
    calibrator = IsotonicCalibration().fit(logits, labels)
    p_val, p_test = torch.softmax(logits, 1).numpy(), torch.softmax(test, 1).numpy()
    scores = np.stack([IsotonicRegression(out_of_bounds="clip").fit(p_val[:, k], labels.numpy() == k)
                       .predict(p_test[:, k]) for k in range(5)], axis=1)
    total = scores.sum(1, keepdims=True)
    assert bool((total > 0).all())
    # Up to rounding of the interpolation weight (p − x_l)/(x_r − x_l) between close thresholds (scipy and torch
    # round it differently): about 1e-12 at worst.
    torch.testing.assert_close(calibrator.transform(test), torch.from_numpy(scores / total), rtol=0, atol=1e-10)


def test_vectorised_pool_adjacent_violators_is_exact_on_hard_orders():
    isotonic_regression = pytest.importorskip("sklearn.isotonic").isotonic_regression
    rows = [
        [1.0] * 200 + [0.0] * 3 + sum(([1.0] * a + [0.0] * (s - a) for s in range(2, 12) for a in range(1, s)), []),
        [1.0, 0.0] * 150 + [0.0] * 3 + [1.0] * 200,
        torch.rand(503).round().tolist(),
    ]
    length = min(len(r) for r in rows)
    values = torch.tensor([r[:length] for r in rows], dtype=torch.float64)
    fitted = posthoc._pool_adjacent_violators(values, torch.ones_like(values, dtype=torch.bool))
    expected = np.stack([isotonic_regression(row) for row in values.numpy()])
    torch.testing.assert_close(fitted, torch.from_numpy(expected), rtol=0, atol=1e-12)


# ----------------------------------------------------------------------------------------- calibration behaviour
@pytest.mark.parametrize("name", list(POSTHOC_METHODS))
def test_calibrated_inputs_stay_calibrated(name):
    logits, labels = _synthetic(20_000, 4)
    test = torch.randn(5000, 4, dtype=torch.float64) * 2
    calibrated = POSTHOC_METHODS[name]().fit(logits, labels).transform(test)
    error = float((calibrated - torch.softmax(test, 1)).abs().mean())
    # Sampling noise of 20000 labels; histogram binning also rounds each probability to its bin's frequency.
    assert error < {"histogram": 0.03, "isotonic": 0.02}.get(name, 0.01), error


@pytest.fixture(scope="module")
def digits_logits():
    """An over-confident classifier on load_digits: a weakly regularised logistic regression fitted on 400 images,
    logits multiplied by 4, on fixed calibration (700) and test (697) splits."""
    datasets = pytest.importorskip("sklearn.datasets")
    LogisticRegression = pytest.importorskip("sklearn.linear_model").LogisticRegression
    images, targets = datasets.load_digits(return_X_y=True)
    order = np.random.default_rng(0).permutation(len(targets))
    train, val, test = order[:400], order[400:1100], order[1100:]
    model = LogisticRegression(C=100.0, max_iter=5000).fit(images[train] / 16, targets[train])

    def logits(rows):
        return 4 * torch.from_numpy(model.decision_function(images[rows] / 16))

    return logits(val), torch.from_numpy(targets[val]), logits(test), torch.from_numpy(targets[test])


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the default fits converge
@pytest.mark.parametrize("name", list(POSTHOC_METHODS))
def test_fitting_on_validation_improves_held_out_calibration_on_digits(name, digits_logits):
    val_logits, val_labels, test_logits, test_labels = digits_logits
    before = metrics.calibration_metrics(test_logits, test_labels)
    calibrator = POSTHOC_METHODS[name]().fit(val_logits, val_labels)
    after = metrics.calibration_metrics(calibrator.log_transform(test_logits), test_labels, inputs_are="logits")
    assert after["ece"] < 0.75 * before["ece"], (before["ece"], after["ece"])
    if name in SCALING:
        assert after["nll"] < 0.75 * before["nll"], (before["nll"], after["nll"])


# ------------------------------------------------------------------------------------------------- other devices
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("name", list(POSTHOC_METHODS))
def test_cuda_fit_and_transform_match_the_cpu(name):
    logits, labels = _miscalibrated(1000, 6)
    test = torch.randn(200, 6, dtype=torch.float64) * 3
    on_cpu = POSTHOC_METHODS[name]().fit(logits, labels)
    on_gpu = POSTHOC_METHODS[name]().fit(logits.cuda(), labels.cuda())
    result = on_gpu.transform(test.cuda())
    assert result.device.type == "cuda"
    tolerance = 1e-6 if name in SCALING else 1e-12  # L-BFGS stops on a tolerance; binning is exact arithmetic
    torch.testing.assert_close(result.cpu(), on_cpu.transform(test), rtol=0, atol=tolerance)
    torch.testing.assert_close(on_gpu.transform(test), on_cpu.transform(test), rtol=0, atol=tolerance)  # moves


# ---------------------------------------------------------------------------------------------------------- netcal
@pytest.fixture(scope="module")
def netcal_data():
    pytest.importorskip("netcal")
    generator = torch.Generator().manual_seed(1)
    logits, labels = _miscalibrated(3000, 5, generator=generator)
    test = torch.randn(1000, 5, generator=generator, dtype=torch.float64) * 3
    return logits, labels, test


def test_temperature_scaling_matches_netcal(netcal_data):
    from netcal.scaling import TemperatureScaling as NetcalTemperature

    logits, labels, test = netcal_data
    # netcal fits on probabilities, scaling ln(clip(p, eps, 1 - eps)): equal to z / T when no p is below eps.
    reference = NetcalTemperature().fit(torch.softmax(logits, 1).numpy(), labels.numpy())
    ours = TemperatureScaling().fit(logits, labels)
    assert float(ours.temperature) == pytest.approx(1.0 / float(reference.temperature[0]), rel=1e-4)
    theirs = torch.from_numpy(reference.transform(torch.softmax(test, 1).numpy()))
    torch.testing.assert_close(ours.transform(test), theirs, rtol=0, atol=1e-5)
    fitted = torch.from_numpy(reference.transform(torch.softmax(logits, 1).numpy()))
    assert _nll(ours.transform(logits), labels) <= _nll(fitted, labels) + 1e-10


def test_netcal_logistic_calibration_is_vector_scaling_of_log_probabilities(netcal_data):
    from netcal.scaling import LogisticCalibration

    logits, labels, test = netcal_data
    # netcal's multiclass LogisticCalibration is softmax(w ⊙ ln p + b): vector scaling of the log-probabilities
    # (Dirichlet calibration with a diagonal matrix), not of the logits.
    reference = LogisticCalibration().fit(torch.softmax(logits, 1).numpy(), labels.numpy())
    features = torch.log_softmax(logits, 1).clamp(min=LOG_EPS)
    ours = VectorScaling().fit(features, labels)
    test_features = torch.log_softmax(test, 1).clamp(min=LOG_EPS)
    theirs = torch.from_numpy(reference.transform(torch.softmax(test, 1).numpy()))
    torch.testing.assert_close(ours.transform(test_features), theirs, rtol=0, atol=5e-4)  # scipy's looser stop
    fitted = torch.from_numpy(reference.transform(torch.softmax(logits, 1).numpy()))
    assert _nll(ours.transform(features), labels) <= _nll(fitted, labels) + 1e-10


@pytest.mark.parametrize("n_bins", [5, 15])
def test_histogram_binning_matches_netcal(netcal_data, n_bins):
    from netcal.binning import HistogramBinning as NetcalHistogram

    logits, labels, test = netcal_data
    reference = NetcalHistogram(bins=n_bins).fit(torch.softmax(logits, 1).numpy(), labels.numpy())
    theirs = torch.from_numpy(reference.transform(torch.softmax(test, 1).numpy()))
    ours = HistogramBinning(n_bins).fit(logits, labels).transform(test)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


def test_isotonic_calibration_matches_netcal(netcal_data):
    from netcal.binning import IsotonicRegression as NetcalIsotonic

    logits, labels, test = netcal_data
    reference = NetcalIsotonic().fit(torch.softmax(logits, 1).numpy(), labels.numpy())
    theirs = torch.from_numpy(reference.transform(torch.softmax(test, 1).numpy()))
    ours = IsotonicCalibration().fit(logits, labels).transform(test)
    torch.testing.assert_close(ours, theirs, rtol=0, atol=1e-12)


# ------------------------------------------------------------------------------------- probabilities, ignore_index
@pytest.mark.parametrize("name", list(POSTHOC_METHODS))
def test_probabilities_are_calibrated_as_their_logarithm(name):
    """``inputs_are`` as in the metrics: probabilities (detected by "auto", or named) are fitted as ``ln p``. Fitting
    them as if they were logits, softmax(p / T) and the like, was a silent wrong answer."""
    logits, labels = _miscalibrated(150, 3)
    test = torch.randn(40, 3, dtype=torch.float64) * 3
    probabilities, test_probabilities = torch.softmax(logits, 1), torch.softmax(test, 1)
    # fitted on ln p itself, not on log_softmax(logits): the two differ by rounding, and an iterative fit (Dirichlet's
    # L-BFGS) carries a rounding-level change of its inputs to its stopping tolerance (up to 8e-8 over 200 draws)
    on_log = POSTHOC_METHODS[name]().fit(probabilities.log(), labels)
    expected = on_log.transform(test_probabilities.log())
    on_probabilities = POSTHOC_METHODS[name]().fit(probabilities, labels)  # "auto" finds probabilities
    assert on_probabilities.fitted_on == "probs"
    for inputs_are in ("auto", "probs"):
        got = on_probabilities.transform(test_probabilities, inputs_are=inputs_are)
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-9)
    # logits go through log_softmax first: the same calibrated probabilities
    torch.testing.assert_close(on_probabilities.transform(test), expected, rtol=0, atol=1e-9)
    torch.testing.assert_close(on_probabilities.log_transform(test_probabilities).exp(), expected,
                               rtol=0, atol=1e-9)
    on_logits = POSTHOC_METHODS[name]().fit(logits, labels)
    assert on_logits.fitted_on == "logits"
    if POSTHOC_METHODS[name].shift_invariant:  # softmax(z) only: probabilities stand in for the logits
        torch.testing.assert_close(on_logits.transform(test_probabilities), on_logits.transform(test),
                                   rtol=0, atol=1e-9)
    else:  # w ⊙ z + b, W z + b: ln p is a shifted z, and the shift is lost
        with pytest.raises(ValueError, match="fitted on logits but transform got probabilities"):
            on_logits.transform(test_probabilities)
        on_logits.transform(test_probabilities, inputs_are="logits")  # taken at their word


def test_zero_probabilities_are_masked_classes_and_bad_probabilities_raise():
    logits, labels = _miscalibrated(200, 3)
    zeroed = (torch.arange(200) % 4 == 0) & (labels != 2)
    probabilities = torch.softmax(logits, 1)
    probabilities[zeroed, 2] = 0.0
    probabilities = probabilities / probabilities.sum(1, keepdim=True)
    assert bool((IsotonicCalibration().fit(probabilities, labels).transform(probabilities)[zeroed, 2] == 0).all())
    named = TemperatureScaling().fit(probabilities, labels, inputs_are="probs")
    assert float(named.temperature) == float(TemperatureScaling().fit(probabilities.log(), labels).temperature)
    assert bool((named.transform(probabilities)[zeroed, 2] == 0).all())
    on_a_zero = labels.clone()
    on_a_zero[zeroed.nonzero()[0, 0]] = 2
    with pytest.raises(ValueError, match="masked class"):
        TemperatureScaling().fit(probabilities, on_a_zero)
    with pytest.raises(ValueError, match="do not all sum to 1"):
        TemperatureScaling().fit(probabilities * 0.5, labels, inputs_are="probs")
    with pytest.raises(ValueError, match="inputs_are"):
        TemperatureScaling().fit(logits, labels, inputs_are="log_probs")


@pytest.mark.parametrize("name", list(POSTHOC_METHODS))
def test_rows_labelled_ignore_index_are_left_out_of_the_fit(name):
    logits, labels = _miscalibrated(200, 3)
    test = torch.randn(30, 3, dtype=torch.float64) * 3
    expected = POSTHOC_METHODS[name]().fit(logits, labels).transform(test)
    padded = torch.cat([logits, torch.full((4, 3), math.nan)])  # ignored rows may hold anything
    got = POSTHOC_METHODS[name]().fit(padded, torch.cat([labels, torch.full((4,), -100)])).transform(test)
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    got = POSTHOC_METHODS[name]().fit(padded, torch.cat([labels, torch.full((4,), 5)]), ignore_index=5)
    torch.testing.assert_close(got.transform(test), expected, rtol=0, atol=0)
    with pytest.raises(ValueError, match="ignore_index"):
        POSTHOC_METHODS[name]().fit(logits, torch.full_like(labels, -100))
    with pytest.raises(TypeError, match="ignore_index"):
        POSTHOC_METHODS[name]().fit(logits, labels, ignore_index=None)


def test_the_unbounded_temperature_warning_names_the_callers_line():
    logits = 3 * torch.randn(50, 4, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    with pytest.warns(RuntimeWarning, match="no minimum") as record:
        TemperatureScaling().fit(logits, logits.argmax(1))
    assert record[0].filename == __file__


# ---------------------------------------------------------------------------------- independent float64 references
def test_scaling_fits_on_digits_match_scipy_in_float64(digits_logits):
    """The NLL-optimal T (a bounded scalar search on log T) and the ODIR optimum of matrix scaling (L-BFGS-B), both by
    scipy in float64 on load_digits: our L-BFGS reaches the same T and an objective no higher."""
    optimize = pytest.importorskip("scipy.optimize")
    from scipy.special import logsumexp

    val_logits, val_labels, _, _ = digits_logits
    z, y = val_logits.numpy(), val_labels.numpy()
    rows = np.arange(len(y))

    def nll(scaled):
        return np.mean(logsumexp(scaled, axis=1) - scaled[rows, y])

    search = optimize.minimize_scalar(lambda log_t: nll(z / np.exp(log_t)), bounds=(-5, 5), method="bounded",
                                      options={"xatol": 1e-10})
    fitted = float(TemperatureScaling().fit(val_logits, val_labels).temperature)
    assert fitted == pytest.approx(np.exp(search.x), rel=1e-6)

    c, reg = z.shape[1], 10.0
    off_diagonal = ~np.eye(c, dtype=bool)

    def odir(params):
        weight, bias = params[:c * c].reshape(c, c), params[c * c:]
        return (nll(z @ weight.T + bias) + reg / (c * (c - 1)) * np.square(weight[off_diagonal]).sum()
                + reg / c * np.square(bias).sum())

    def odir_gradient(params):
        weight, bias = params[:c * c].reshape(c, c), params[c * c:]
        scaled = z @ weight.T + bias
        residual = np.exp(scaled - logsumexp(scaled, axis=1, keepdims=True))
        residual[rows, y] -= 1.0
        residual /= len(y)
        weight_gradient = residual.T @ z + 2 * reg / (c * (c - 1)) * weight * off_diagonal
        return np.r_[weight_gradient.ravel(), residual.sum(0) + 2 * reg / c * bias]

    reference = optimize.minimize(odir, np.r_[np.eye(c).ravel(), np.zeros(c)], jac=odir_gradient,
                                  method="L-BFGS-B", options={"maxiter": 10_000, "ftol": 1e-15, "gtol": 1e-10})
    assert reference.success
    ours = MatrixScaling(reg, reg).fit(val_logits, val_labels)
    assert odir(np.r_[ours.weight.numpy().ravel(), ours.bias_vector.numpy()]) <= reference.fun + 1e-10
