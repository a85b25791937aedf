"""Post-hoc calibrators, temperature scaling among them (docs/metrics.md, 'Post-hoc calibration').

Every calibrator maps the logits of a trained classifier to calibrated probabilities and is fitted on a held-out
split (never the test split) with one interface::

    calibrator = VectorScaling().fit(val_logits, val_labels)     # -> self
    probs = calibrator.transform(test_logits)                      # (..., C) probabilities; calibrator(z) is the same

(:class:`TemperatureScaling` is also an ``nn.Module``: calling it returns the scaled logits ``z / T``.)

============================  =======================================================  ================================
class                         calibrated probabilities ``q``                           paper
============================  =======================================================  ================================
:class:`TemperatureScaling`   ``softmax(z / T)``                                       Guo et al., ICML 2017
:class:`VectorScaling`        ``softmax(w ⊙ z + b)``, ``w, b ∈ R^C``                   Guo et al., ICML 2017
:class:`MatrixScaling`        ``softmax(W z + b)``, ``W ∈ R^{C×C}``, ODIR              Guo et al. 2017; Kull et al. 2019
:class:`DirichletCalibration` ``softmax(W ln p + b)``, ``p = softmax(z)``, ODIR         Kull et al., NeurIPS 2019
:class:`HistogramBinning`     one-vs-rest bin frequencies, renormalised                Zadrozny & Elkan, ICML 2001
:class:`IsotonicCalibration`  one-vs-rest isotonic regression, renormalised            Zadrozny & Elkan, KDD 2002
============================  =======================================================  ================================

Conventions shared by all of them:

* **Inputs.** ``x (..., C)`` (any floating dtype, ``C >= 2``) and integer ``labels (...)`` in ``[0, C)`` on the
  same device; rows whose label equals ``ignore_index`` (default -100, as the metrics) are left out of the fit and
  may hold anything. ``inputs_are="auto" | "logits" | "probs"`` (default ``"auto"``) is resolved exactly as by the
  metrics (:func:`calibkernels._validation.metric_inputs.resolve_inputs_kind`): probabilities are mapped to their
  logarithm (``softmax(ln p) = p``; ``ln 0 = -inf`` is a masked class) and the calibrators work on logits from there on.
  Input policy of the metrics (:mod:`calibkernels._validation.metric_inputs`): a ``-inf`` logit is a **masked
  class** with probability 0, and it stays masked: its calibrated probability is exactly 0. ``+inf`` or NaN logits,
  rows whose every class is ``-inf`` and invalid probabilities raise ``ValueError``; non-tensors and wrong dtypes raise
  ``TypeError``. :class:`VectorScaling` and :class:`MatrixScaling` are not invariant to adding a constant to a row
  (``ln p = z − logsumexp(z)`` is such a shift): fitted on probabilities, their ``transform`` maps logits to
  ``log_softmax(z)`` first (exact); fitted on logits, it refuses probabilities (``ValueError``: the logits cannot be
  recovered). The other calibrators depend on ``softmax(z)`` only and take either kind.
* **Arithmetic.** Fitting and transforming run in float64 on the logits' device (CPU or CUDA). ``transform``
  returns float64 for float64 logits and float32 otherwise, with the shape of its input.
* **Scaling methods** (temperature, vector, matrix, Dirichlet) minimise the mean negative log-likelihood on the
  calibration split, plus the ODIR penalty where it applies, by L-BFGS (strong Wolfe line search) started at the
  identity map. A label on a masked class makes the NLL infinite and raises ``ValueError``.
* **Binning methods** (histogram, isotonic) fit one binary calibrator per class on ``(p_ik, 1[y_i = k])``,
  ``p = softmax(z)``, and renormalise ``q_ik = g_k(p_ik) / Σ_j g_j(p_ij)``. A row whose scores are all 0 gets the
  uniform distribution over its unmasked classes (as scikit-learn's ``CalibratedClassifierCV`` does). They may give
  a true class probability 0 (then the NLL is infinite) and may change the arg-max.
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from ._temperature_fit import OBJECTIVES, check_grid, fit_temperature
from ._validation import check_ignore_index, check_number, is_number
from ._validation.metric_inputs import check_n_bins, compute_dtype, labelled_rows, resolve_inputs_kind

__all__ = [
    "POSTHOC_METHODS",
    "DirichletCalibration",
    "HistogramBinning",
    "IsotonicCalibration",
    "MatrixScaling",
    "PosthocCalibrator",
    "TemperatureScaling",
    "VectorScaling",
]

# ln(float64 eps) = -36.04: Dirichlet calibration's floor on log-probabilities (netcal and early versions of the
# reference implementation clip probabilities to [eps, 1 - eps] before the log), also used for masked classes entering
# a full weight matrix.
LOG_EPS = math.log(torch.finfo(torch.float64).eps)
BINNINGS = ("equal_width", "equal_mass")
# A scaling fit that used all its L-BFGS iterations warns when an entry of its gradient is still above this.
UNCONVERGED_GRADIENT = 1e-5
# A fitted scaling map whose mean NLL on its calibration split is below this puts all but 1e-6 of every label's
# probability on it: the split is (nearly) separable, and the unpenalised optimum is at infinite weights.
SEPARABLE_NLL = 1e-6


# ---------------------------------------------------------------------------------------------------- input checks
def _check_inputs_tensor(logits, num_classes: int | None = None) -> int:
    """Type and shape checks of ``x (..., C)``; returns ``C``."""
    if not isinstance(logits, torch.Tensor):
        raise TypeError(f"logits must be a torch.Tensor, got {type(logits).__name__}")
    if not logits.is_floating_point():
        raise TypeError(f"logits must be floating point, got {logits.dtype}")
    if logits.dim() < 2:
        raise ValueError(f"logits must have shape (..., C) with the class dimension last, got {tuple(logits.shape)}")
    classes = logits.shape[-1]
    if num_classes is not None and classes != num_classes:
        raise ValueError(f"the calibrator was fitted for {num_classes} classes but the logits have {classes}")
    if classes < 2:
        raise ValueError(f"calibration needs at least 2 classes, got {classes}")
    return classes


def _in_log_space(x: torch.Tensor, kind: str) -> torch.Tensor:
    """Logits of ``x (N, C)`` float64 of the resolved ``kind``: ``x`` itself, or ``ln p`` (``-inf`` where ``p = 0``;
    entries in ``(1, 1 + tol]``, a normalisation's rounding, count as 1, as in the metrics)."""
    return x if kind == "logits" else x.clamp(max=1.0).log()


def _as_logits(logits, inputs_are: str, num_classes: int | None = None) -> tuple[torch.Tensor, str]:
    """``x (..., C)`` checked, flattened to float64 ``(N, C)`` (detached, same device) and mapped to logits; returns
    ``(z, kind)`` with ``kind`` the resolved ``inputs_are`` (``"logits"`` or ``"probs"``)."""
    classes = _check_inputs_tensor(logits, num_classes)
    x = logits.detach().reshape(-1, classes).to(torch.float64)
    # called straight from fit / transform, so that an "auto" warning points at the caller's line (stacklevel 4)
    kind = resolve_inputs_kind(x, inputs_are, logits.dtype)  # -inf (masked) is fine; +inf, NaN, bad probs raise
    return _in_log_space(x, kind), kind


def _as_fit_inputs(logits, labels, inputs_are: str, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor, str]:
    """``(z (N, C) float64 logits, y (N,) int64, kind)`` of the rows whose label is not ``ignore_index``."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a torch.Tensor of class indices, got {type(labels).__name__}")
    if labels.is_floating_point() or labels.is_complex() or labels.dtype == torch.bool:
        raise TypeError(f"labels must hold integer class indices, got {labels.dtype}")
    check_ignore_index(ignore_index)
    num_classes = _check_inputs_tensor(logits)
    if tuple(labels.shape) != tuple(logits.shape[:-1]):
        raise ValueError(f"labels shape {tuple(labels.shape)} does not match logits shape {tuple(logits.shape)}: "
                         f"expected {tuple(logits.shape[:-1])}")
    if labels.device != logits.device:
        raise ValueError(f"labels are on {labels.device} but logits are on {logits.device}")
    x = logits.detach().reshape(-1, num_classes).to(torch.float64)
    y = labels.detach().reshape(-1).long()
    x, y, rows = labelled_rows(x, y, ignore_index, num_classes, "a calibrator")
    kind = resolve_inputs_kind(x, inputs_are, logits.dtype, rows)  # stacklevel 4: the caller of fit
    return _in_log_space(x, kind), y, kind


def _check_count(name: str, value, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


# ------------------------------------------------------------------------------------------------------ interface
class PosthocCalibrator:
    """Base class: ``fit(x (..., C), labels (...)) -> self`` and ``transform(x (..., C)) -> (..., C)``.

    ``x`` is logits or probabilities (``inputs_are``, resolved as by the metrics; probabilities become ``ln p``).
    Subclasses implement ``_fit(z, y)`` and ``_transform(z)`` on checked float64 logits ``z (N, C)`` / int64
    ``y (N,)``. Fitted tensors live on the device of the fitting logits and follow the logits to ``transform``'s
    device. A new ``fit`` replaces the whole fitted state.
    """

    num_classes: int | None = None
    # the resolved ``inputs_are`` of the last fit ("logits" or "probs")
    fitted_on: str | None = None
    # whether the map depends on softmax(z) only, so that logits and log-probabilities give the same result
    shift_invariant = True

    def fit(self, logits: torch.Tensor, labels: torch.Tensor, *, inputs_are: str = "auto",
            ignore_index: int = -100) -> "PosthocCalibrator":
        """Fit on held-out ``logits (..., C)`` (or probabilities, ``inputs_are``) and ``labels (...)``; rows whose
        label is ``ignore_index`` are left out. Returns ``self``."""
        z, y, kind = _as_fit_inputs(logits, labels, inputs_are, ignore_index)
        self._fit(z, y)
        self.num_classes, self.fitted_on = z.shape[1], kind
        return self

    def transform(self, logits: torch.Tensor, *, inputs_are: str = "auto") -> torch.Tensor:
        """Calibrated probabilities ``(..., C)`` of ``logits (..., C)`` (or probabilities, ``inputs_are``); every row
        sums to 1, masked classes (``-inf`` logits, zero probabilities) are 0."""
        self._check_fitted()
        z, kind = _as_logits(logits, inputs_are, self.num_classes)
        z = self._aligned(z, kind)
        probabilities = self._transform(z) if z.shape[0] else z.new_zeros(z.shape)
        return probabilities.to(compute_dtype(logits.dtype)).reshape(logits.shape)

    __call__ = transform

    def log_transform(self, logits: torch.Tensor, *, inputs_are: str = "auto") -> torch.Tensor:
        """``ln`` of :meth:`transform`, computed without underflow where the method allows it.

        The scaling methods return ``log_softmax`` of their calibrated logits, finite even where a probability
        underflows to 0 (so an NLL computed from it is finite); the binning methods return ``ln q`` (``-inf`` where
        ``q = 0``). Masked classes are ``-inf``. Same shape and dtype rules as :meth:`transform`; the result is a
        valid logit tensor for :mod:`calibkernels.metrics` (``inputs_are="logits"``).
        """
        self._check_fitted()
        z, kind = _as_logits(logits, inputs_are, self.num_classes)
        z = self._aligned(z, kind)
        out = self._log_transform(z) if z.shape[0] else z.new_zeros(z.shape)
        return out.to(compute_dtype(logits.dtype)).reshape(logits.shape)

    def _check_fitted(self) -> None:
        if self.num_classes is None:
            raise RuntimeError(f"{type(self).__name__} is not fitted: call fit(val_logits, val_labels) first")

    def _aligned(self, z: torch.Tensor, kind: str) -> torch.Tensor:
        """``z`` as the kind of input ``fit`` saw. Logits become log-probabilities exactly (``log_softmax``), so a map
        fitted on probabilities takes logits too; log-probabilities cannot become the logits they came from (the row
        shift is lost), so a shift-dependent map fitted on logits refuses probabilities."""
        if self.shift_invariant or kind == self.fitted_on or z.shape[0] == 0:
            return z
        if self.fitted_on == "probs":
            return torch.log_softmax(z, dim=1)
        raise ValueError(f"{type(self).__name__} was fitted on logits but transform got probabilities: its map is not "
                         "invariant to adding a constant to a row (ln p = z - logsumexp(z) is such a shift), so "
                         "probabilities cannot stand in for the logits it was fitted on. Pass the logits, or fit on "
                         "probabilities")

    def _fit(self, z: torch.Tensor, y: torch.Tensor) -> None:  # pragma: no cover - abstract
        raise NotImplementedError

    def _transform(self, z: torch.Tensor) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def _log_transform(self, z: torch.Tensor) -> torch.Tensor:
        return self._transform(z).log()

    def __repr__(self) -> str:
        state = "fitted" if self.num_classes is not None else "not fitted"
        return f"{type(self).__name__}({self._describe()}{', ' if self._describe() else ''}{state})"

    def _describe(self) -> str:
        return ""


def _masked_labels_raise(masked: torch.Tensor, y: torch.Tensor) -> None:
    label_masked = masked.gather(1, y[:, None]).squeeze(1)
    if bool(label_masked.any()):
        row = int(label_masked.nonzero()[0, 0])
        raise ValueError(f"the label of row {row} (of the rows fitted) is a masked class (logit -inf, or probability "
                         "0): its NLL is +inf for every calibration map, so the NLL fit has no minimum. Drop such "
                         "rows, or set their labels to ignore_index")


# -------------------------------------------------------------------------------------------- temperature scaling
class TemperatureScaling(nn.Module, PosthocCalibrator):
    """Temperature scaling (Guo et al., ICML 2017): ``q = softmax(z / T)`` with one scalar ``T > 0`` fitted on a
    held-out split by :func:`calibkernels.calibration.fit_temperature`.

    Both a calibrator of this module's interface and an ``nn.Module``:

    * ``fit(x, labels, objective=None, grid=None, n_bins=None, *, inputs_are="auto", ignore_index=-100)`` fits ``T``
      and returns ``self``; ``objective``, ``grid`` and ``n_bins`` default to the constructor's. ``"nll"`` (default,
      as in Guo et al.) minimises the NLL by L-BFGS on ``log T``; ``"ece"`` takes the grid point of lowest ECE
      (``n_bins`` bins; default grid 0.01 … 10.00), the ECE taken in the logits' own compute dtype, as
      :func:`calibkernels.calibration.fit_temperature` takes it. Fitted on probabilities, ``T`` is the temperature of
      ``ln p``: ``q = softmax(ln p / T) ∝ p^{1/T}``.
    * ``transform`` / ``log_transform`` return ``softmax(z / T)`` / ``log_softmax(z / T)`` (float64 inside).
    * Calling it (``forward``) returns the scaled **logits** ``z / T`` elementwise, in the logits' dtype, without
      checks (no host synchronisation at inference; ``-inf`` stays ``-inf``): ``nn.Sequential(model, scaler)``.

    ``T`` is the buffer ``temperature`` (float64, saved in ``state_dict``; a checkpoint's ``T`` must be positive and
    finite), ``temperature`` at construction (1: the identity) until a fit replaces it; ``transform`` uses the
    current ``T`` fitted or not.

    >>> scaler = TemperatureScaling(objective="ece").fit(val_logits, val_labels)   # doctest: +SKIP
    >>> probs = scaler.transform(test_logits)       # = scaler(test_logits).softmax(-1)  # doctest: +SKIP
    """

    temperature: torch.Tensor

    def __init__(self, temperature: float = 1.0, *, objective: str = "nll", n_bins: int = 15, grid=None):
        super().__init__()
        _check_temperature(temperature)
        self.objective = _check_objective(objective)
        self.n_bins = check_n_bins(n_bins)
        self.grid = None if grid is None else check_grid(grid)
        self.register_buffer("temperature", torch.tensor(float(temperature), dtype=torch.float64))

    def fit(self, logits: torch.Tensor, labels: torch.Tensor, objective: str | None = None, grid=None,
            n_bins: int | None = None, *, inputs_are: str = "auto", ignore_index: int = -100) -> "TemperatureScaling":
        """Fit ``T`` on held-out ``logits (..., C)`` (or probabilities, ``inputs_are``) and ``labels (...)``; rows
        whose label is ``ignore_index`` are left out. Returns ``self``."""
        objective = self.objective if objective is None else _check_objective(objective)
        n_bins = self.n_bins if n_bins is None else check_n_bins(n_bins)
        grid = self.grid if grid is None else grid
        z, y, kind = _as_fit_inputs(logits, labels, inputs_are, ignore_index)
        if kind == "logits":  # as given: the ECE objective bins the confidences in the logits' compute dtype
            fitted = fit_temperature(logits, labels, objective=objective, grid=grid, n_bins=n_bins,
                                     ignore_index=ignore_index)
        else:
            fitted = fit_temperature(z, y, objective=objective, grid=grid, n_bins=n_bins)
        self.temperature.fill_(fitted)
        self.num_classes, self.fitted_on = z.shape[1], kind
        return self

    def _check_fitted(self) -> None:
        pass  # T alone is the map: the constructor's until a fit

    def _transform(self, z):
        return torch.softmax(z / self.temperature.to(z.device), dim=1)

    def _log_transform(self, z):
        return torch.log_softmax(z / self.temperature.to(z.device), dim=1)

    def forward(self, logits: torch.Tensor) -> torch.Tensor:
        """``logits / T`` (no checks here, to keep inference free of host syncs)."""
        return logits / self.temperature

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # a checkpoint's T must be one the constructor and fit could have made: positive and finite
        value = state_dict.get(prefix + "temperature")
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            t = float(value)
            if not (t > 0 and math.isfinite(t)):
                raise ValueError(f"temperature must be positive and finite, got {t} in the state_dict")
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)

    def extra_repr(self) -> str:
        state = "fitted" if self.num_classes is not None else "not fitted"
        return f"temperature={float(self.temperature):.4g}, objective={self.objective!r}, {state}"


def _check_temperature(temperature) -> None:
    if not is_number(temperature):
        raise TypeError(f"temperature must be a number, got {type(temperature).__name__}")
    if not (temperature > 0 and math.isfinite(temperature)):
        raise ValueError(f"temperature must be positive and finite, got {temperature}")


def _check_objective(objective) -> str:
    if not isinstance(objective, str) or objective not in OBJECTIVES:
        raise ValueError(f"objective must be one of {OBJECTIVES}, got {objective!r}")
    return objective


# --------------------------------------------------------------------------------------------- linear (NLL) scaling
def _fit_affine(x, y, masked, structure: str, bias: bool, reg_lambda: float, reg_mu: float, max_iter: int):
    """Minimise ``mean_i -ln softmax(a(x_i))_{y_i} + λ/(C(C−1)) Σ_{i≠j} W_ij² + μ/C Σ_j b_j²`` over ``(W, b)``.

    ``a(x) = W x + b`` with ``W`` a scalar times the identity (``structure="scalar"``), diagonal (``"diagonal"``) or
    full (``"full"``); masked classes get ``a_k = -inf``. ``x (N, C)`` float64 with finite entries, ``y (N,)``.
    L-BFGS (strong Wolfe) from the identity map ``W = I, b = 0``, in float64 on ``x``'s device, for at most
    ``max_iter`` iterations (``2 max_iter`` evaluations): a ``RuntimeWarning`` says so when they run out with a
    gradient entry above :data:`UNCONVERGED_GRADIENT` (e.g. unpenalised weights on separable data grow without
    bound). Returns ``(W, b)`` with ``W`` of shape ``()``, ``(C,)`` or ``(C, C)`` and ``b (C,)`` (zeros without
    ``bias``).
    """
    num_classes = x.shape[1]
    options = dict(dtype=torch.float64, device=x.device)
    shapes = {"scalar": (), "diagonal": (num_classes,), "full": (num_classes, num_classes)}
    weight = (torch.eye(num_classes, **options) if structure == "full" else torch.ones(shapes[structure], **options))
    weight.requires_grad_(True)
    shift = torch.zeros(num_classes, **options, requires_grad=bias)
    params = [weight, shift] if bias else [weight]
    any_masked = bool(masked.any())
    off_diagonal = ~torch.eye(num_classes, dtype=torch.bool, device=x.device) if structure == "full" else None
    max_eval = 2 * max_iter
    optimizer = torch.optim.LBFGS(params, lr=1.0, max_iter=max_iter, max_eval=max_eval, line_search_fn="strong_wolfe",
                                  tolerance_grad=1e-10, tolerance_change=1e-15, history_size=50)
    nll = [None]  # the unpenalised mean NLL at the last parameters evaluated (a tensor: no host read per call)

    def closure():
        optimizer.zero_grad()
        out = _affine(x, weight, shift, structure)
        loss = F.cross_entropy(out.masked_fill(masked, -math.inf) if any_masked else out, y)
        nll[0] = loss.detach()
        if reg_lambda and structure == "full":
            loss = loss + reg_lambda / (num_classes * (num_classes - 1)) * weight[off_diagonal].square().sum()
        if reg_mu and bias:
            loss = loss + reg_mu / num_classes * shift.square().sum()
        loss.backward()
        return loss

    with torch.enable_grad():
        optimizer.step(closure)
        closure()  # the gradient at the parameters returned
    if not all(bool(p.isfinite().all()) for p in params):
        raise RuntimeError("the NLL fit of the calibration map diverged (non-finite parameters)")
    gradient = max(float(p.grad.abs().max()) for p in params)
    state = optimizer.state[weight]
    out_of_budget = state.get("n_iter", 0) >= max_iter or state.get("func_evals", 0) >= max_eval
    if out_of_budget and gradient > UNCONVERGED_GRADIENT:
        warnings.warn(f"L-BFGS ran out of its max_iter={max_iter} iterations with a gradient of {gradient:.2g} "
                      f"(largest entry), so the calibration map is not at its optimum: raise max_iter, or the ODIR "
                      "penalties if the calibration split is (nearly) separable", RuntimeWarning, stacklevel=4)
    elif float(nll[0]) < SEPARABLE_NLL:
        # L-BFGS also stops on a flat NLL: on a separable split that is the map sending every label's probability to
        # 1 with weights still growing, an optimum nowhere (nll: from the closure's call at the parameters returned)
        warnings.warn(f"the fitted calibration map gives every label of the calibration split a probability "
                      f"above 1 - {SEPARABLE_NLL:g} (mean NLL {float(nll[0]):.2g}): the split is (nearly) separable, "
                      "and the map's weights would grow without bound; use the ODIR penalties (reg_lambda, reg_mu), "
                      "a larger calibration split, or temperature scaling", RuntimeWarning, stacklevel=4)
    return weight.detach(), shift.detach()


def _affine(x, weight, shift, structure):
    if structure == "full":
        return torch.addmm(shift, x, weight.T)
    return x * weight + shift


class _AffineCalibrator(PosthocCalibrator):
    """``q = softmax(W x + b)`` on features ``x(z)`` (see :func:`_fit_affine`); subclasses set the structure."""

    structure = "full"

    def __init__(self, reg_lambda: float, reg_mu: float, bias: bool = True, max_iter: int = 500):
        if not isinstance(bias, bool):
            raise TypeError(f"bias must be a bool, got {type(bias).__name__}")
        self.reg_lambda = check_number("reg_lambda", reg_lambda)
        self.reg_mu = check_number("reg_mu", reg_mu)
        self.bias, self.max_iter = bias, _check_count("max_iter", max_iter)
        self.weight: torch.Tensor | None = None
        self.shift: torch.Tensor | None = None

    def _features(self, z: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        return z.masked_fill(masked, 0.0)  # elementwise maps: a masked class's input never reaches another class

    def _fit(self, z, y):
        masked = z == -math.inf
        _masked_labels_raise(masked, y)
        self.weight, self.shift = _fit_affine(self._features(z, masked), y, masked, self.structure, self.bias,
                                              self.reg_lambda, self.reg_mu, self.max_iter)

    def _calibrated_logits(self, z):
        masked = z == -math.inf
        weight, shift = self.weight.to(z.device), self.shift.to(z.device)
        return _affine(self._features(z, masked), weight, shift, self.structure).masked_fill(masked, -math.inf)

    def _transform(self, z):
        return torch.softmax(self._calibrated_logits(z), dim=1)

    def _log_transform(self, z):
        return torch.log_softmax(self._calibrated_logits(z), dim=1)

    @property
    def bias_vector(self) -> torch.Tensor | None:
        """The fitted ``b (C,)`` (zeros when ``bias=False``)."""
        return self.shift

    def _describe(self):
        return f"reg_lambda={self.reg_lambda:g}, reg_mu={self.reg_mu:g}, bias={self.bias}"


class VectorScaling(_AffineCalibrator):
    """Vector scaling (Guo et al., "On Calibration of Modern Neural Networks", ICML 2017):
    ``q = softmax(w ⊙ z + b)`` with ``w, b ∈ R^C`` (``weight (C,)``, ``bias_vector (C,)``).

    Fitted by minimising ``mean_i -ln q_{i,y_i} + μ/C Σ_j b_j²`` (``reg_mu``, default 0: the plain NLL of the paper;
    ``bias=False`` fixes ``b = 0``). A masked class (``-inf`` logit) keeps probability 0.
    """

    structure = "diagonal"
    shift_invariant = False  # w ⊙ (z + c1) = w ⊙ z + c w

    def __init__(self, bias: bool = True, reg_mu: float = 0.0, max_iter: int = 500):
        super().__init__(0.0, reg_mu, bias, max_iter)

    def _describe(self):
        return f"reg_mu={self.reg_mu:g}, bias={self.bias}"


class MatrixScaling(_AffineCalibrator):
    """Matrix scaling (Guo et al., ICML 2017) with off-diagonal and intercept regularisation (ODIR; Kull et al.,
    "Beyond temperature scaling: Obtaining well-calibrated multiclass probabilities with Dirichlet calibration",
    NeurIPS 2019): ``q = softmax(W z + b)``, ``W (C, C)``, ``b (C,)``, fitted by minimising

        ``L(W, b) = (1/N) Σ_i -ln q_{i,y_i} + λ/(C(C−1)) Σ_{i≠j} W_ij² + μ/C Σ_j b_j²``

    with ``λ = reg_lambda``, ``μ = reg_mu``. ``W`` and ``b`` are unconstrained (no reference class), so the penalty
    also picks, among the ``(W + 1vᵀ, b + c1)`` that give the same probabilities, the one of least penalty.
    ``λ = μ = 0`` is the unregularised matrix scaling of Guo et al. (it over-fits when ``C²`` approaches the size of
    the calibration split); ``λ, μ → ∞`` leave vector scaling without bias. The defaults ``λ = μ = 10`` are a
    conservative choice, not a tuned one (weaker penalties over-fit calibration splits of a few hundred samples):
    Kull et al. choose ``λ`` and ``μ`` by cross-validation on the calibration split.

    A masked class (``-inf`` logit) keeps probability 0 and enters ``W z`` as the logit ``max_k z_k + ln(eps)``
    (``eps`` of float64: the logit of a probability of about 2.2e-16 next to the top class).
    """

    shift_invariant = False  # W (z + c1) = W z + c W1

    def __init__(self, reg_lambda: float = 10.0, reg_mu: float = 10.0, bias: bool = True, max_iter: int = 500):
        super().__init__(reg_lambda, reg_mu, bias, max_iter)

    def _features(self, z, masked):
        if not bool(masked.any()):
            return z
        return torch.where(masked, z.amax(dim=1, keepdim=True) + LOG_EPS, z)


class DirichletCalibration(_AffineCalibrator):
    """Dirichlet calibration (Kull et al., "Beyond temperature scaling: Obtaining well-calibrated multiclass
    probabilities with Dirichlet calibration", NeurIPS 2019): a linear layer on log-probabilities,

        ``q = softmax(W ln p + b)``,  ``p = softmax(z)``,  ``ln p`` floored at ``ln(eps) = -36.04`` (float64 eps),

    fitted with the ODIR penalty of :class:`MatrixScaling`:
    ``(1/N) Σ_i -ln q_{i,y_i} + λ/(C(C−1)) Σ_{i≠j} W_ij² + μ/C Σ_j b_j²``. ``W = I, b = 0`` is the identity map.
    The floor matches netcal and early versions of the reference implementation (``dirichletcal``), which clip ``p``
    to ``[eps, 1 − eps]`` before the log (its current version clips at the smallest normal double instead, a floor of
    ``-708``); it keeps the features of a confident network bounded. The reference code parameterises ``W`` relative
    to its last row (a reference class) and, unless ``reg_norm=True``, omits the ``1/(C(C−1))`` and ``1/C``
    factors; here ``W`` is unconstrained and the factors are those of the paper. Defaults as :class:`MatrixScaling`
    (conservative, untuned). A masked class has ``p = 0``, so it enters as ``ln(eps)``, and keeps probability 0.
    """

    def __init__(self, reg_lambda: float = 10.0, reg_mu: float = 10.0, bias: bool = True, max_iter: int = 500):
        super().__init__(reg_lambda, reg_mu, bias, max_iter)

    def _features(self, z, masked):
        return torch.log_softmax(z, dim=1).clamp(min=LOG_EPS)


# ---------------------------------------------------------------------------------------------- binning methods
def _one_vs_rest(z: torch.Tensor, y: torch.Tensor | None = None):
    """``p.T (C, N)`` contiguous, ``p = softmax(z)`` in float64, and the one-vs-rest targets ``1[y_i = k]`` (C, N)."""
    probabilities = torch.softmax(z, dim=1).T.contiguous()
    if y is None:
        return probabilities
    targets = torch.zeros_like(probabilities)
    targets[y, torch.arange(y.numel(), device=y.device)] = 1.0
    return probabilities, targets


def _renormalise(scores: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
    """``scores (N, C) / row sums``, masked classes 0; a row summing to 0 becomes uniform over its unmasked classes."""
    scores = scores.masked_fill(masked, 0.0)
    total = scores.sum(dim=1, keepdim=True)
    allowed = (~masked).to(scores.dtype)
    uniform = allowed / allowed.sum(dim=1, keepdim=True)
    return torch.where(total > 0, scores / total.clamp(min=torch.finfo(scores.dtype).tiny), uniform)


def _equal_mass_edges(sorted_values: torch.Tensor, n_bins: int) -> torch.Tensor:
    """Quantiles ``j / n_bins``, ``j = 0…n_bins``, of each row of ``sorted_values (C, N)``, numpy's default linear
    interpolation (``np.quantile``), with the first edge set to 0 and the last to 1. Returns ``(C, n_bins + 1)``."""
    num_samples = sorted_values.shape[1]
    position = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=sorted_values.device) * (num_samples - 1)
    below = position.floor().long().clamp(max=num_samples - 1)
    above = (below + 1).clamp(max=num_samples - 1)
    fraction = (position - below).expand(sorted_values.shape[0], -1)
    lower = sorted_values[:, below]
    edges = torch.lerp(lower, sorted_values[:, above], fraction)
    edges[:, 0], edges[:, -1] = 0.0, 1.0
    return edges


class HistogramBinning(PosthocCalibrator):
    """Histogram binning (Zadrozny & Elkan, "Obtaining calibrated probability estimates from decision trees and
    naive Bayesian classifiers", ICML 2001), one-vs-rest and renormalised.

    For each class ``k``, the probabilities ``p_ik = softmax(z_i)_k`` of the calibration split are put in ``M`` bins
    (``n_bins``) and bin ``B`` maps to the frequency of class ``k`` in it: ``g_k(B) = Σ_{i∈B} 1[y_i = k] / |B|``; an
    empty bin maps to its midpoint. Then ``q_ik = g_k(p_ik) / Σ_j g_j(p_ij)`` (uniform over unmasked classes when
    every ``g_j`` is 0).

    ``binning="equal_width"`` (default; the bins of Guo et al. 2017 and netcal): edges ``0, 1/M, …, 1`` in float64.
    ``binning="equal_mass"``: per class, the quantiles ``j/M`` of ``p_·k`` on the calibration split (linear
    interpolation, as ``np.quantile``), first and last edges 0 and 1; ties may leave bins empty. Bins are ``(lo, hi]``
    (as the metrics' bins), the first one closed: ``[0, hi]``. Fitted: ``edges (C, M + 1)``, ``bin_values (C, M)``.
    Vectorised over samples and classes (one ``searchsorted`` and one ``index_add`` per call).
    """

    def __init__(self, n_bins: int = 15, binning: str = "equal_width"):
        if not isinstance(binning, str) or binning not in BINNINGS:
            raise ValueError(f"binning must be one of {BINNINGS}, got {binning!r}")
        self.n_bins, self.binning = check_n_bins(n_bins), binning
        self.edges: torch.Tensor | None = None
        self.bin_values: torch.Tensor | None = None

    def _bin_index(self, probabilities: torch.Tensor, edges: torch.Tensor) -> torch.Tensor:
        """Bin ``b`` of each entry of ``probabilities (C, N)``: ``edges[b] < p <= edges[b + 1]``, 0 for ``p <= e_1``."""
        return torch.searchsorted(edges[:, 1:-1].contiguous(), probabilities, right=False)

    def _fit(self, z, y):
        probabilities, targets = _one_vs_rest(z, y)
        num_classes, n_bins = probabilities.shape[0], self.n_bins
        if self.binning == "equal_width":
            edges = torch.linspace(0, 1, n_bins + 1, dtype=torch.float64, device=z.device).expand(num_classes, -1)
        else:
            edges = _equal_mass_edges(probabilities.sort(dim=1).values, n_bins)
        flat = (self._bin_index(probabilities, edges)
                + n_bins * torch.arange(num_classes, device=z.device)[:, None]).reshape(-1)
        counts = torch.zeros(num_classes * n_bins, dtype=torch.float64, device=z.device)
        counts.index_add_(0, flat, torch.ones_like(flat, dtype=torch.float64))
        hits = torch.zeros_like(counts).index_add_(0, flat, targets.reshape(-1))
        midpoints = ((edges[:, :-1] + edges[:, 1:]) / 2).reshape(-1)
        self.bin_values = torch.where(counts > 0, hits / counts.clamp(min=1), midpoints).view(num_classes, n_bins)
        self.edges = edges.contiguous()

    def _transform(self, z):
        probabilities = _one_vs_rest(z)
        edges, values = self.edges.to(z.device), self.bin_values.to(z.device)
        scores = values.gather(1, self._bin_index(probabilities, edges)).T
        return _renormalise(scores, z == -math.inf)

    def _describe(self):
        return f"n_bins={self.n_bins}, binning={self.binning!r}"


def _pool_adjacent_violators(values: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Isotonic (non-decreasing) least-squares fit of every row of ``values (C, N)``, given in increasing order of
    the regressor, with initial blocks starting where ``start (C, N)`` is True (tied regressor values share a block).

    Pool-adjacent-violators, vectorised over rows and blocks: each round recomputes every block mean with one
    ``index_add`` and merges every run of adjacent blocks whose means do not increase. Merging such a run is a
    sequence of ordinary PAV pooling steps (after pooling a violating pair the merged mean still violates with the
    next block of the run), and pooling two adjacent blocks with equal means never changes the solution, so the
    result is the unique isotonic fit. Each round with a violation removes at least one block, so there are at most
    ``N`` rounds; on classifier outputs the count grows like ``log N`` (about 10 to 15 rounds for ``N = 10^4`` to
    ``10^5``), while contrived orders (a long run of positives followed by many short blocks of slowly increasing
    frequency) need hundreds. Returns the fitted value of every entry ``(C, N)``.
    """
    num_rows, num_samples = values.shape
    offsets = num_samples * torch.arange(num_rows, device=values.device)[:, None]
    flat_values = values.reshape(-1)
    ones = torch.ones_like(flat_values)
    for _ in range(num_samples):
        block = (start.cumsum(dim=1) - 1 + offsets).reshape(-1)
        sums = torch.zeros_like(flat_values).index_add_(0, block, flat_values)
        counts = torch.zeros_like(flat_values).index_add_(0, block, ones)
        fitted = (sums / counts.clamp(min=1))[block].view(num_rows, num_samples)
        previous, current = fitted[:, :-1], fitted[:, 1:]
        if not bool((start[:, 1:] & (previous > current)).any()):
            return fitted
        start = torch.cat([start[:, :1], start[:, 1:] & (previous < current)], dim=1)
    raise RuntimeError("pool-adjacent-violators did not converge")  # unreachable: each round removes a block


# numpy.finfo(dtype).resolution, scikit-learn's tie tolerance for isotonic regression
_TIE_RESOLUTION = {torch.float64: 1e-15, torch.float32: 1e-6}


class IsotonicCalibration(PosthocCalibrator):
    """Isotonic-regression calibration (Zadrozny & Elkan, "Transforming classifier scores into accurate multiclass
    probability estimates", KDD 2002), one-vs-rest and renormalised.

    For each class ``k``, ``g_k`` is the non-decreasing function minimising ``Σ_i (g_k(p_ik) − 1[y_i = k])²`` on the
    calibration split (``p = softmax(z)`` in float64; tied ``p_ik`` pooled), computed by a vectorised
    pool-adjacent-violators over all classes at once on the logits' device (:func:`_pool_adjacent_violators`; no
    scikit-learn needed). Between the fitted points ``g_k`` is interpolated linearly and outside them it is clipped
    to the end values, as scikit-learn's ``IsotonicRegression(out_of_bounds="clip")`` (which netcal uses) does.
    Then ``q_ik = g_k(p_ik) / Σ_j g_j(p_ij)`` (uniform over unmasked classes when every ``g_j`` is 0).

    Fitted: ``thresholds (C, N)`` (each class's sorted calibration probabilities) and ``fitted_values (C, N)``.
    """

    def __init__(self):
        self.thresholds: torch.Tensor | None = None
        self.fitted_values: torch.Tensor | None = None

    def _fit(self, z, y):
        probabilities, targets = _one_vs_rest(z, y)
        thresholds, order = probabilities.sort(dim=1, stable=True)
        # ties: values closer than the dtype's resolution (1e-15 in float64) are one point, as scikit-learn's
        # IsotonicRegression pools them (its _make_unique); e.g. probabilities 1 - 1e-16 and 1 from different rows
        start = torch.ones_like(thresholds, dtype=torch.bool)
        start[:, 1:] = (thresholds[:, 1:] - thresholds[:, :-1]) >= _TIE_RESOLUTION[thresholds.dtype]
        self.fitted_values = _pool_adjacent_violators(targets.gather(1, order), start)
        self.thresholds = thresholds

    def _transform(self, z):
        probabilities = _one_vs_rest(z)
        thresholds, fitted = self.thresholds.to(z.device), self.fitted_values.to(z.device)
        last = thresholds.shape[1] - 1
        above = torch.searchsorted(thresholds, probabilities, right=False)  # first threshold >= p
        right = above.clamp(max=last)
        left = (above - 1).clamp(min=0)
        x_left, x_right = thresholds.gather(1, left), thresholds.gather(1, right)
        width = x_right - x_left
        fraction = torch.where(width > 0, (probabilities - x_left) / width.clamp(min=torch.finfo(z.dtype).tiny), 1.0)
        scores = torch.lerp(fitted.gather(1, left), fitted.gather(1, right), fraction.clamp(0.0, 1.0))
        return _renormalise(scores.T, z == -math.inf)


POSTHOC_METHODS = {
    "temperature": TemperatureScaling,
    "vector": VectorScaling,
    "matrix": MatrixScaling,
    "dirichlet": DirichletCalibration,
    "histogram": HistogramBinning,
    "isotonic": IsotonicCalibration,
}
"""Name -> calibrator class; every class builds with no arguments (its defaults)."""
