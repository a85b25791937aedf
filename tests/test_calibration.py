"""Temperature scaling: the vectorised ECE grid search against a loop over the grid, tie-breaking, recovery of a
known temperature on synthetic data (ECE grid and NLL/L-BFGS), and TemperatureScaling as an nn.Module."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F

from calibkernels import metrics
from calibkernels.calibration import (
    TemperatureScaling,
    ece_over_temperatures,
    evaluate_temperature_scaling,
    fit_temperature,
    temperature_grid,
)


def _synthetic_with_known_temperature(n, c, true_temperature):
    """Labels drawn from softmax(z), logits reported as z · T0: the calibrating temperature is T0 by construction."""
    z = torch.randn(n, c) * 1.5
    labels = torch.multinomial(torch.softmax(z, dim=1), 1).squeeze(1)
    return z * true_temperature, labels


def test_default_grid_is_001_to_10_step_001():
    grid = temperature_grid()
    assert grid.dtype == torch.float64 and grid.numel() == 1000
    assert float(grid[0]) == 0.01 and float(grid[-1]) == 10.0
    assert [float(t) for t in grid[:8]] == [0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08]
    assert float(grid[699]) == 7.0
    assert torch.all(grid.diff() > 0)


@pytest.mark.parametrize("start, stop, step, expected", [
    (0.05, 1.0, 0.1, [0.05 + 0.1 * k for k in range(10)]),  # start not a multiple of the step
    (1.0, 2.0, 0.3, [1.0, 1.3, 1.6, 1.9]),                 # neither end a multiple
    (0.5, 3.0, 0.25, [0.25 * k for k in range(2, 13)]),     # both multiples: j * step
    (0.5, 0.5, 0.1, [0.5]),
])
def test_a_grid_stays_within_its_ends(start, stop, step, expected):
    """Every value in [start, stop], from start in steps of step: a start or stop that is not a multiple of the step
    is not rounded to one (which had put T = 0 into temperature_grid(0.05, 1.0, 0.1), and 0.9 and 2.1 into
    temperature_grid(1, 2, 0.3))."""
    grid = temperature_grid(start, stop, step)
    torch.testing.assert_close(grid, torch.tensor(expected, dtype=torch.float64), rtol=0, atol=1e-12)
    assert float(grid.min()) >= start and float(grid.max()) <= stop
    long = temperature_grid(0.01, 10.0, 0.03)  # 9.99 / 0.03 rounds below 333 in float64: stop is still reached
    assert long.numel() == 334 and float(long[-1]) == 10.0 and float(long[0]) == 0.01


def test_an_nll_fit_without_a_finite_optimum_warns():
    """On a split where every label is its row's largest logit the NLL falls all the way to T -> 0; where the
    labels' logits lie below their rows' mean it falls to T -> infinity: the T returned is where L-BFGS stopped, and
    the fit says so. A split with a finite optimum fits without a warning."""
    generator = torch.Generator().manual_seed(0)
    logits = 3 * torch.randn(200, 5, generator=generator)
    with pytest.warns(RuntimeWarning, match="every label is its row's largest logit"):
        assert fit_temperature(logits, logits.argmax(1), objective="nll") < 0.01
    with pytest.warns(RuntimeWarning, match="below their rows' mean logit"):
        assert fit_temperature(logits, logits.argmin(1), objective="nll") > 100
    labels = logits.argmax(1)
    labels[:60] = torch.randint(0, 5, (60,), generator=generator)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert 0.5 < fit_temperature(logits, labels, objective="nll") < 5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_post_scaling_metrics_of_16_bit_logits_are_those_of_their_float32_values(dtype):
    """The "post" metrics are of z / T computed in float32, as every metric of 16-bit logits computes: a 16-bit
    division would round the scaled logits first."""
    logits, labels = _synthetic_with_known_temperature(2000, 20, 0.6)
    logits = logits.to(dtype)
    report = evaluate_temperature_scaling(logits[:1000], labels[:1000], logits[1000:], labels[1000:])
    expected = metrics.calibration_metrics(logits[1000:].float() / report["temperature"], labels[1000:])
    assert report["post"] == expected


def test_grid_ece_matches_a_loop_over_the_grid():
    logits, labels = _synthetic_with_known_temperature(300, 5, 2.0)
    logits = logits.double()  # float64: the grid's confidence form and softmax agree to ~1e-16, no edge flips
    grid = torch.linspace(0.2, 4.0, 39, dtype=torch.float64)
    looped = torch.tensor([metrics.ece(logits / float(t), labels, 12) for t in grid], dtype=torch.float64)
    vectorised = ece_over_temperatures(logits, labels, grid, n_bins=12, chunk_elements=300 * 5 * 7)  # 6 chunks
    torch.testing.assert_close(vectorised, looped, rtol=0, atol=1e-12)
    chosen = fit_temperature(logits, labels, grid=grid, n_bins=12)
    best = looped.min()
    assert chosen == float(grid[looped <= best + 1e-12][0])


def test_grid_ece_float32_is_close_to_float64():
    logits, labels = _synthetic_with_known_temperature(400, 6, 1.5)
    grid = temperature_grid(0.5, 3.0, 0.25)
    single = ece_over_temperatures(logits, labels, grid)
    double = ece_over_temperatures(logits.double(), labels, grid)
    # float32 confidences differ by ~1e-7 relative; a rare sample at an edge may switch bins (≤ 2/N each).
    torch.testing.assert_close(single, double, rtol=0, atol=2 * 2 / 400)


def test_ties_go_to_the_smallest_temperature():
    # Equal logits: every confidence is 1/C at every T, so every grid point has the same ECE.
    logits = torch.zeros(50, 4)
    labels = torch.randint(0, 4, (50,))
    assert fit_temperature(logits, labels, grid=[3.0, 1.5, 0.7, 2.0, 0.7]) == 0.7
    assert fit_temperature(logits, labels) == 0.01


@pytest.mark.parametrize("objective, tolerance", [("nll", 0.08), ("ece", 0.15)])
def test_fit_recovers_a_known_temperature(objective, tolerance):
    true_temperature = 2.5
    logits, labels = _synthetic_with_known_temperature(6000, 10, true_temperature)
    fitted = fit_temperature(logits, labels, objective=objective)
    assert isinstance(fitted, float)
    assert fitted == pytest.approx(true_temperature, rel=tolerance)
    # and an over-confident model really is calibrated by it
    assert metrics.ece(logits / fitted, labels) < metrics.ece(logits, labels) / 3


def test_nll_fit_is_a_stationary_point_of_the_nll():
    logits, labels = _synthetic_with_known_temperature(1000, 5, 0.6)  # under-confident: T < 1
    fitted = fit_temperature(logits, labels, objective="nll")
    log_t = torch.tensor(math.log(fitted), dtype=torch.float64, requires_grad=True)
    loss = F.cross_entropy(logits.double() * torch.exp(-log_t), labels)
    (gradient,) = torch.autograd.grad(loss, log_t)
    assert abs(float(gradient)) < 1e-6
    for nearby in (fitted * 0.98, fitted * 1.02):
        assert float(F.cross_entropy(logits.double() / nearby, labels)) > float(loss.detach())


def test_temperature_scaling_module():
    logits, labels = _synthetic_with_known_temperature(2000, 5, 2.0)
    scaler = TemperatureScaling()
    assert float(scaler.temperature) == 1.0
    torch.testing.assert_close(scaler(logits), logits)
    assert scaler.fit(logits, labels, objective="ece") is scaler
    fitted = float(scaler.temperature)
    assert fitted == fit_temperature(logits, labels, objective="ece")
    torch.testing.assert_close(scaler(logits), logits / fitted)
    assert scaler(logits.half()).dtype == torch.float16
    assert "temperature" in scaler.state_dict()
    restored = TemperatureScaling()
    restored.load_state_dict(scaler.state_dict())
    assert float(restored.temperature) == fitted
    for bad in (0.0, -2.0, float("inf"), float("nan")):  # a checkpoint's T as the constructor would take it
        with pytest.raises(ValueError, match="temperature must be positive and finite"):
            restored.load_state_dict({"temperature": torch.tensor(bad, dtype=torch.float64)})
        assert float(restored.temperature) == fitted
    scaler.fit(logits, labels, objective="nll")
    assert float(scaler.temperature) == pytest.approx(fit_temperature(logits, labels, objective="nll"), rel=1e-6)
    with pytest.raises(ValueError):
        TemperatureScaling(0.0)


def test_pre_and_post_temperature_report_uses_one_temperature():
    logits, labels = _synthetic_with_known_temperature(1200, 4, 3.0)
    report = evaluate_temperature_scaling(logits[:600], labels[:600], logits[600:], labels[600:])
    temperature = report["temperature"]
    assert temperature == fit_temperature(logits[:600], labels[:600])
    assert report["pre"] == pytest.approx(metrics.calibration_metrics(logits[600:], labels[600:]))
    assert report["post"] == pytest.approx(metrics.calibration_metrics(logits[600:] / temperature, labels[600:]))
    assert report["post"]["accuracy"] == report["pre"]["accuracy"]
    assert report["post"]["ece"] < report["pre"]["ece"]


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"objective": "brier"}, ValueError),
        ({"grid": [1.0, -0.5]}, ValueError),
        ({"grid": []}, ValueError),
        ({"grid": [1.0, math.inf]}, ValueError),
        ({"n_bins": 0}, ValueError),
    ],
)
def test_fit_temperature_rejects_bad_arguments(kwargs, error):
    with pytest.raises(error):
        fit_temperature(torch.randn(10, 3), torch.randint(0, 3, (10,)), **kwargs)


def test_fit_temperature_rejects_bad_inputs():
    with pytest.raises(ValueError):
        fit_temperature(torch.randn(10, 3), torch.full((10,), 3))
    with pytest.raises(TypeError):
        fit_temperature(torch.randn(10, 3), torch.zeros(10))
    with pytest.raises(ValueError):
        fit_temperature(torch.randn(10, 3), torch.zeros(9, dtype=torch.long))


# ------------------------------------------------------------------------------------------------ infinities
def _masked_logits(n, c, masked_share=0.3):
    """Logits with a random share of classes masked (never the label, never a whole row), as -inf and as -1e30."""
    logits, labels = _synthetic_with_known_temperature(n, c, 2.0)
    masked = torch.rand(n, c) < masked_share
    masked[torch.arange(n), labels] = False
    return logits.masked_fill(masked, -math.inf), logits.masked_fill(masked, -1e30), labels


@pytest.mark.parametrize("objective", ["nll", "ece"])
def test_masked_logits_fit_the_temperature_of_very_negative_logits(objective):
    with_minus_inf, very_negative, labels = _masked_logits(3000, 8)
    fitted = fit_temperature(with_minus_inf, labels, objective=objective)
    assert math.isfinite(fitted) and fitted > 0
    assert fitted == pytest.approx(fit_temperature(very_negative, labels, objective=objective), rel=1e-9)
    assert fitted == pytest.approx(2.0, rel=0.2)
    scaler = TemperatureScaling().fit(with_minus_inf, labels, objective=objective)
    assert float(scaler.temperature) == pytest.approx(fitted, rel=1e-9)


def test_masked_logits_ece_grid_matches_the_metric():
    with_minus_inf, _, labels = _masked_logits(400, 6)
    grid = torch.tensor([0.5, 1.0, 2.0, 4.0], dtype=torch.float64)
    looped = torch.tensor([metrics.ece(with_minus_inf.double() / float(t), labels) for t in grid],
                          dtype=torch.float64)
    torch.testing.assert_close(ece_over_temperatures(with_minus_inf.double(), labels, grid), looped,
                               rtol=0, atol=1e-12)


@pytest.mark.parametrize("value, message", [(math.inf, r"\+inf"), (math.nan, "NaN")])
@pytest.mark.parametrize("objective", ["nll", "ece"])
def test_positive_infinite_or_nan_logits_raise_for_both_objectives(objective, value, message):
    logits, labels = _synthetic_with_known_temperature(200, 5, 2.0)
    logits[7, 2] = value
    with pytest.raises(ValueError, match=message):
        fit_temperature(logits, labels, objective=objective)
    with pytest.raises(ValueError, match=message):
        TemperatureScaling().fit(logits, labels, objective=objective)
    with pytest.raises(ValueError, match=message):
        evaluate_temperature_scaling(logits, labels, logits, labels, objective=objective)
    with pytest.raises(ValueError, match=message):
        metrics.ece(logits, labels)


@pytest.mark.parametrize("objective", ["nll", "ece"])
def test_a_row_of_only_masked_logits_raises_for_both_objectives(objective):
    logits, labels = _synthetic_with_known_temperature(200, 5, 2.0)
    logits[11] = -math.inf
    with pytest.raises(ValueError, match="every class"):
        fit_temperature(logits, labels, objective=objective)


def test_nll_fit_rejects_a_label_on_a_masked_class():
    # The NLL is +inf at every temperature: there is nothing to minimise. (The ECE objective counts it as a miss.)
    logits, labels = _synthetic_with_known_temperature(200, 5, 2.0)
    logits[4, labels[4]] = -math.inf
    with pytest.raises(ValueError, match="masked"):
        fit_temperature(logits, labels, objective="nll")
    assert math.isfinite(fit_temperature(logits, labels, objective="ece"))


# ------------------------------------------------------------------------------------------- contract checks
@pytest.mark.parametrize("objective", ["nll", "ece"])
def test_one_class_has_no_temperature_to_fit(objective):
    """softmax(z / T) = 1 for every T when C = 1: the NLL fit used to stop at T = 1 and the ECE one at the grid's
    smallest T, both looking like answers."""
    logits, labels = torch.randn(20, 1), torch.zeros(20, dtype=torch.long)
    with pytest.raises(ValueError, match="at least 2 classes"):
        fit_temperature(logits, labels, objective=objective)
    with pytest.raises(ValueError, match="at least 2 classes"):
        TemperatureScaling().fit(logits, labels, objective=objective)


@pytest.mark.parametrize("objective", ["nll", "ece"])
def test_rows_labelled_ignore_index_are_left_out_of_the_fit(objective):
    logits, labels = _synthetic_with_known_temperature(300, 4, 2.0)
    expected = fit_temperature(logits, labels, objective=objective)
    padded = torch.cat([logits, torch.full((5, 4), math.nan)])  # ignored rows may hold anything
    assert fit_temperature(padded, torch.cat([labels, torch.full((5,), -100)]), objective=objective) == expected
    assert fit_temperature(padded, torch.cat([labels, torch.full((5,), 9)]), objective=objective,
                           ignore_index=9) == expected
    scaler = TemperatureScaling().fit(padded, torch.cat([labels, torch.full((5,), -100)]), objective=objective)
    assert float(scaler.temperature) == expected
    with pytest.raises(ValueError, match="ignore_index"):
        fit_temperature(logits, torch.full_like(labels, -100), objective=objective)
    with pytest.raises(TypeError, match="ignore_index"):
        fit_temperature(logits, labels, objective=objective, ignore_index=1.5)


def test_ece_curve_and_report_leave_out_ignored_rows():
    logits, labels = _synthetic_with_known_temperature(300, 4, 2.0)
    grid = torch.tensor([0.5, 1.0, 2.0], dtype=torch.float64)
    padded = torch.cat([logits, torch.full((5, 4), math.inf)])
    padded_labels = torch.cat([labels, torch.full((5,), -100)])
    torch.testing.assert_close(ece_over_temperatures(padded, padded_labels, grid),
                               ece_over_temperatures(logits, labels, grid), rtol=0, atol=0)
    report = evaluate_temperature_scaling(padded, padded_labels, padded, padded_labels)
    assert report == evaluate_temperature_scaling(logits, labels, logits, labels)


def test_grid_and_chunk_arguments_raise_clear_errors():
    with pytest.raises(ValueError, match="finite"):
        temperature_grid(0.01, math.inf)  # was an OverflowError
    with pytest.raises(TypeError, match="start must be a number"):
        temperature_grid("0.01")
    with pytest.raises(TypeError, match="grid must be"):
        fit_temperature(torch.randn(10, 3), torch.randint(0, 3, (10,)), grid="fine")
    for bad, error in ((10.5, TypeError), ("many", TypeError), (0, ValueError)):
        with pytest.raises(error, match="chunk_elements"):
            fit_temperature(torch.randn(10, 3), torch.randint(0, 3, (10,)), chunk_elements=bad)
        with pytest.raises(error, match="chunk_elements"):
            ece_over_temperatures(torch.randn(10, 3), torch.randint(0, 3, (10,)), [1.0], chunk_elements=bad)


def test_the_unbounded_nll_warning_names_the_callers_line():
    logits = 3 * torch.randn(50, 4, generator=torch.Generator().manual_seed(1))
    for fit in (lambda: fit_temperature(logits, logits.argmax(1), objective="nll"),
                lambda: TemperatureScaling().fit(logits, logits.argmax(1), objective="nll")):
        with pytest.warns(RuntimeWarning, match="no minimum") as record:
            fit()
        assert record[0].filename == __file__
