"""Saturated rows (p_y = 1 to working precision) in ``mode="loss"``: the reference's gradient is the exact one.

At such a row ``1 - p_y``, the Brier terms ``p_k`` and the dual-focal base round to 0, where ``x^a`` with ``a < 1`` has
an infinite derivative; the exact gradient of ``u · CE`` is nevertheless finite and tends to 0 (``u · CE ~ ε^{γ+1}``
for ``ε = 1 - p_y``). The expected values come from an independent 60-digit evaluation of the loss (mpmath), written
without cancellation (``1 - p_y = Σ_{k≠y} p_k``, ``CE = log1p(Σ_{k≠y} e^{z_k - z_y})``), differentiated numerically.
"""

import mpmath
import pytest
import torch

from calibkernels import reference as R

mpmath.mp.dps = 60

# (logits, target): saturated rows, a row whose 1 - p_y is below the dtype's resolution, and ordinary rows
ROWS = {
    torch.float32: [([200.0, 0.0, 0.0], 0), ([20.0, 0.0, 0.0, -3.0], 0), ([0.0, 200.0, 5.0], 1),
                    ([100.0, 0.0, 99.5], 0), ([1.0, -0.5, 0.3], 2), ([0.2, 2.5, -1.0, 0.7], 1)],
    torch.float64: [([800.0, 0.0, 0.0], 0), ([200.0, 0.0, 0.0], 0), ([40.0, 0.0, 0.0, -3.0], 0),
                    ([0.0, 800.0, 5.0], 1), ([1.0, -0.5, 0.3], 2), ([0.2, 2.5, -1.0, 0.7], 1)],
}

CASES = [("focal", g, 2.0) for g in (0.0, 0.01, 0.25, 0.5, 0.99)] + [
    ("flsd", 0.0, 2.0), ("flsd", 0.5, 2.0), ("dual_focal", 0.0, 2.0), ("dual_focal", 0.5, 2.0),
    ("brier", 0.5, 2.0), ("brier", 2.0, 0.5), ("brier", 0.3, 0.7),
]


def _mp_row_loss(z, y, uncertainty, gamma, norm):
    """u · CE of one row in 60-digit arithmetic, cancellation-free."""
    z = [mpmath.mpf(v) for v in z]
    rel = [mpmath.exp(v - z[y]) for v in z]  # e^{z_k - z_y}
    denom = mpmath.fsum(rel)
    p = [r / denom for r in rel]
    others = mpmath.fsum(rel[k] for k in range(len(z)) if k != y)
    one_minus_p_y = others / denom
    ce = mpmath.log1p(others)
    g = mpmath.mpf(gamma)
    if uncertainty == "focal":
        u = one_minus_p_y ** g
    elif uncertainty == "flsd":
        g = 5 if p[y] < 0.2 else (3 if p[y] < 0.5 else g)
        u = one_minus_p_y ** g
    elif uncertainty == "dual_focal":
        below = [p[k] for k in range(len(z)) if z[k] < z[y]]
        u = (one_minus_p_y + (max(below) if below else 0)) ** g
    else:
        q = mpmath.mpf(norm)
        s = mpmath.fsum(p[k] ** q for k in range(len(z)) if k != y) + one_minus_p_y ** q
        u = s ** (g / q)
    return u * ce


def _mp_gradient(z, y, uncertainty, gamma, norm):
    grad = []
    for k in range(len(z)):
        def along_k(t, k=k):
            moved = list(z)
            moved[k] = t
            return _mp_row_loss(moved, y, uncertainty, gamma, norm)
        grad.append(float(mpmath.diff(along_k, mpmath.mpf(z[k]))))
    return grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("uncertainty, gamma, norm", CASES)
def test_saturated_rows_have_the_exact_loss_mode_gradient(uncertainty, gamma, norm, dtype):
    eps = torch.finfo(dtype).eps
    for z, y in ROWS[dtype]:
        logits = torch.tensor([z], dtype=dtype, requires_grad=True)
        loss = R.uncertainty_weighted_ce(logits, torch.tensor([y]), uncertainty=uncertainty, mode="loss", gamma=gamma,
                                         norm=norm, reduction="sum", backend="reference")
        loss.backward()
        exact = torch.tensor([_mp_gradient(z, y, uncertainty, gamma, norm)], dtype=torch.float64)
        got = logits.grad.double()
        assert torch.isfinite(got).all(), f"{uncertainty} γ={gamma} q={norm} row {z}: gradient {got}"
        bound = 64 * eps * max(1.0, exact.abs().max().item())
        err = (got - exact).abs().max().item()
        assert err <= bound, (
            f"{uncertainty} γ={gamma} q={norm} row {z}: gradient {got} vs exact {exact} (err {err:.3e})")
        exact_loss = float(_mp_row_loss(z, y, uncertainty, gamma, norm))
        assert abs(loss.item() - exact_loss) <= 64 * eps * max(1.0, abs(exact_loss))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_saturated_rows_per_sample_gamma_gradients_are_the_limit(dtype):
    """A per-sample γ that requires grad: dL/dγ = u · log(1 - p_y) · CE → 0 at a saturated row, as dL/dz does."""
    rows = ROWS[dtype]
    width = max(len(z) for z, _ in rows)
    logits = torch.full((len(rows), width), -torch.inf, dtype=dtype)
    for i, (z, _) in enumerate(rows):
        logits[i, :len(z)] = torch.tensor(z, dtype=dtype)
    logits.requires_grad_()
    target = torch.tensor([y for _, y in rows])
    gamma = (torch.rand(len(rows), dtype=dtype) * 0.9).requires_grad_()
    loss = R.uncertainty_weighted_ce(logits, target, uncertainty="focal", mode="loss", gamma=gamma, reduction="sum",
                                     backend="reference")
    grad_logits, grad_gamma = torch.autograd.grad(loss, (logits, gamma))
    assert torch.isfinite(grad_logits).all() and torch.isfinite(grad_gamma).all()
    eps = torch.finfo(dtype).eps
    for i, (z, y) in enumerate(rows):
        g = gamma[i].item()
        exact = _mp_gradient(z, y, "focal", g, 2.0)
        torch.testing.assert_close(grad_logits[i, :len(z)].double(), torch.tensor(exact, dtype=torch.float64),
                                   rtol=64 * eps, atol=64 * eps)
        exact_dgamma = float(mpmath.diff(lambda t: _mp_row_loss(z, y, "focal", t, 2.0), mpmath.mpf(g)))
        assert abs(grad_gamma[i].item() - exact_dgamma) <= 64 * eps * max(1.0, abs(exact_dgamma)), (z, g)
