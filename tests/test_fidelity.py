"""Fidelity options: the official BSCE-GRA code's dual-focal GRA (``gra_detach="p_j"``) and the focal-loss /
BSCE-GRA code's MMCE (``form="papers_code"``), next to the defaults (the papers' definitions), on hand-computed
cases, with gradients."""

import math

import pytest
import torch

import calibkernels as ck
from calibkernels import reference as R

# rows: correct with r = 0.75, wrong with r = 0.8, correct with r = 0.9 (two classes, target 0)
_Z = torch.tensor([[math.log(3.0), 0.0], [0.0, math.log(4.0)], [math.log(9.0), 0.0]], dtype=torch.float64)
_Y = torch.zeros(3, dtype=torch.long)


def _k(r, s, bandwidth=0.4):
    return math.exp(-abs(r - s) / bandwidth)


# ---------------------------------------------------------------------------------------------- dual focal GRA


def _dual_focal_by_hand(z, y, gamma, detach_p_j):
    """``(1 - p_y + p_j)^γ · CE`` per row with explicit loops; ``p_j`` detached when ``detach_p_j``."""
    rows = []
    for i in range(z.shape[0]):
        p = torch.softmax(z[i], dim=0)
        below = [p[k] for k in range(z.shape[1]) if z[i, k] < z[i, y[i]]]
        p_j = max(below, key=lambda t: float(t.detach())) if below else torch.zeros((), dtype=z.dtype)
        if detach_p_j:
            p_j = p_j.detach()
        ce = -torch.log_softmax(z[i], dim=0)[y[i]]
        rows.append((1 - p[y[i]] + p_j) ** gamma * ce)
    return torch.stack(rows).mean()


def test_dual_focal_gra_official_value_on_a_hand_computed_row():
    z = torch.tensor([[2.0, 1.0, 0.0]], dtype=torch.float64)
    y = torch.tensor([0])
    e = [math.exp(2.0), math.exp(1.0), 1.0]
    p0, p1 = e[0] / sum(e), e[1] / sum(e)
    expected = (1 - p0 + p1) ** 2 * -math.log(p0)
    for gra_detach in ("weight", "p_j"):  # same value, different gradients
        got = R.uncertainty_weighted_ce(z, y, uncertainty="dual_focal", mode="grad", gamma=2.0, gra_detach=gra_detach)
        assert got.item() == pytest.approx(expected, rel=1e-12)


@pytest.mark.parametrize("gamma", [0.0, 1.0, 2.0, 5.0])
def test_dual_focal_gra_official_gradient_is_autograd_of_detached_p_j(gamma):
    torch.manual_seed(0)
    z = (torch.randn(7, 5, dtype=torch.float64) * 2).requires_grad_()
    y = torch.tensor([0, 1, 2, 3, 4, 0, 1])
    with torch.no_grad():
        z[3, 3] = z[3].min() - 1.0  # a row whose target is the smallest class: p_j = 0
    got = R.uncertainty_weighted_ce(z, y, uncertainty="dual_focal", mode="grad", gamma=gamma, gra_detach="p_j")
    expected = _dual_focal_by_hand(z, y, gamma, detach_p_j=True)
    torch.testing.assert_close(got, expected)
    (g_got,) = torch.autograd.grad(got, z)
    (g_expected,) = torch.autograd.grad(expected, z)
    torch.testing.assert_close(g_got, g_expected)
    module = ck.losses.build("dual_focal_loss_gra", gamma=gamma, gra_detach="p_j")
    (g_module,) = torch.autograd.grad(module(z, y), z)
    torch.testing.assert_close(g_module, g_expected)
    if gamma > 0:  # the official form keeps the gradient through p_y: not the paper's u (p - e_y)
        (g_default,) = torch.autograd.grad(ck.losses.build("dual_focal_loss_gra", gamma=gamma)(z, y), z)
        assert not torch.allclose(g_default, g_got)


def test_dual_focal_gra_default_is_unchanged():
    """The default detaches the whole weight: gradient u (p - e_y) / N, the fused kernel's and the reference's."""
    torch.manual_seed(1)
    z = (torch.randn(6, 4, dtype=torch.float64)).requires_grad_()
    y = torch.randint(0, 4, (6,))
    u = R.uncertainty_weight(z.detach(), y, uncertainty="dual_focal", gamma=5.0, norm=2.0)
    expected = u[:, None] * (torch.softmax(z.detach(), -1) - torch.nn.functional.one_hot(y, 4)) / 6
    for loss in (ck.losses.build("dual_focal_loss_gra"), ck.losses.build("dual_focal_loss_gra", gra_detach="weight"),
                 lambda a, b: R.uncertainty_weighted_ce(a, b, uncertainty="dual_focal", mode="grad", gamma=5.0)):
        (g,) = torch.autograd.grad(loss(z, y), z)
        torch.testing.assert_close(g, expected)
    assert "gra_detach" not in repr(ck.losses.build("dual_focal_loss_gra"))
    assert "gra_detach='p_j'" in repr(ck.losses.build("dual_focal_loss_gra", gra_detach="p_j"))


def test_gra_detach_rejects_bad_options():
    z, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="gra_detach"):
        R.uncertainty_weighted_ce(z, y, uncertainty="focal", mode="grad", gra_detach="p_j")
    with pytest.raises(ValueError, match="gra_detach"):
        R.uncertainty_weighted_ce(z, y, uncertainty="dual_focal", mode="loss", gra_detach="p_j")
    with pytest.raises(ValueError, match="gra_detach"):
        R.uncertainty_weighted_ce(z, y, uncertainty="dual_focal", mode="grad", gra_detach="pj")
    with pytest.raises(TypeError, match="gra_detach"):
        R.uncertainty_weighted_ce(z, y, uncertainty="dual_focal", mode="grad", gra_detach=True)
    with pytest.raises(ValueError, match="fused kernel"):
        ck.losses.build("dual_focal_loss_gra", gra_detach="p_j", backend="cpu")
    with pytest.raises(ValueError, match="gra_detach"):
        ck.losses.UncertaintyWeightedCE(uncertainty="brier", mode="grad", gra_detach="p_j")
    with pytest.raises(TypeError, match="gra_detach"):
        ck.losses.build("focal_loss_gra", gra_detach="p_j")  # only dual focal's GRA has the option


# ------------------------------------------------------------------------------------------------------- MMCE


def _mmce_hand_values():
    """The three-row batch of ``_Z``: c = (1, 0, 1), r = (0.75, 0.8, 0.9); m = 3, n₁ = 2, n₀ = 1."""
    r, c = (0.75, 0.8, 0.9), (1, 0, 1)
    s = sum((c[i] - r[i]) * (c[j] - r[j]) * _k(r[i], r[j]) for i in range(3) for j in range(3))
    a, b = {0: 0.25, 2: 0.1}, {1: 0.8}  # 1 - r on correct rows, r on wrong rows
    aa = sum(a[i] * a[j] * _k(r[i], r[j]) for i in a for j in a)
    bb = sum(b[i] * b[j] * _k(r[i], r[j]) for i in b for j in b)
    ab = sum(a[i] * b[j] * _k(r[i], r[j]) for i in a for j in b)
    return s, aa, bb, ab


def test_mmce_forms_on_a_hand_computed_batch():
    s, aa, bb, ab = _mmce_hand_values()
    assert R.mmce(_Z, _Y).item() == pytest.approx(math.sqrt(s / 9 + 1e-10), rel=1e-12)  # Kumar: sqrt(S) / m
    assert R.mmce(_Z, _Y, form="papers_code").item() == pytest.approx(s / 9, rel=1e-12)  # code: S / m², no sqrt
    kumar_w = math.sqrt(aa / 2 ** 2 + bb / 1 ** 2 - 2 * ab / (2 * 1) + 1e-10)
    assert R.mmce(_Z, _Y, weighted=True).item() == pytest.approx(kumar_w, rel=1e-12)
    code_w = math.sqrt(aa / (4 * (4 + 1e-5)) + bb / (1 * (1 + 1e-5)) - 2 * ab / (2 * (2 + 1e-5)) + 1e-10)
    assert R.mmce(_Z, _Y, weighted=True, form="papers_code").item() == pytest.approx(code_w, rel=1e-12)
    assert abs(code_w - kumar_w) > 1e-3  # the two weighted normalisations differ on this batch


def _papers_code_mmce_weighted(z, y):
    """The focal-loss paper code's ``MMCE_weighted.forward``, transcribed: each pair matrix is averaged
    (``torch.mean``) and then divided by ``m² + 1e-5``, ``n² + 1e-5``, ``mn + 1e-5``."""
    probs, labels = torch.softmax(z, dim=1).max(dim=1)
    correct_mask = (labels == y).to(z.dtype)
    m, n = correct_mask.sum(), (1 - correct_mask).sum()
    if m == 0 or n == 0:
        return torch.zeros((), dtype=z.dtype)
    cp, ip = probs[correct_mask.bool()], probs[~correct_mask.bool()]

    def kernel(u, v):
        return torch.exp(-(u[:, None] - v[None, :]).abs() / 0.4)

    cc = torch.mean(kernel(cp, cp) * torch.outer(1 - cp, 1 - cp))
    ii = torch.mean(kernel(ip, ip) * torch.outer(ip, ip))
    ci = torch.mean(kernel(cp, ip) * torch.outer(1 - cp, ip))
    mmd = cc / (m * m + 1e-5) + ii / (n * n + 1e-5) - 2.0 * ci / (m * n + 1e-5)
    return torch.sqrt(mmd + 1e-10)


def _papers_code_mmce(z, y):
    """The focal-loss paper code's ``MMCE.forward``, transcribed: ``Σ (c - r)(c' - r') k / N²``."""
    probs, labels = torch.softmax(z, dim=1).max(dim=1)
    c_minus_r = (labels == y).to(z.dtype) - probs
    kernel = torch.exp(-(probs[:, None] - probs[None, :]).abs() / 0.4)
    return (torch.outer(c_minus_r, c_minus_r) * kernel).sum() / z.shape[0] ** 2


@pytest.mark.parametrize("weighted", [False, True])
def test_mmce_papers_code_form_matches_the_code_with_gradients(weighted):
    torch.manual_seed(2)
    z = (torch.randn(16, 5, dtype=torch.float64) * 2).requires_grad_()
    y = torch.randint(0, 5, (16,))
    expected = (_papers_code_mmce_weighted if weighted else _papers_code_mmce)(z, y)
    got = R.mmce(z, y, weighted=weighted, form="papers_code")
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got, z)[0],
                               torch.autograd.grad(expected, z, retain_graph=True)[0])
    # the loss: mean CE + λ·MMCE, module and reference alike
    name = "mmce_weighted" if weighted else "mmce"
    module = ck.losses.build(name, form="papers_code")
    assert "form='papers_code'" in repr(module)
    loss = module(z, y)
    expected_loss = torch.nn.functional.cross_entropy(z, y) + 2.0 * expected
    torch.testing.assert_close(loss, expected_loss)
    torch.testing.assert_close(torch.autograd.grad(loss, z)[0], torch.autograd.grad(expected_loss, z)[0])
    torch.testing.assert_close(R.mmce_loss(z, y, weighted=weighted, form="papers_code", reduction="sum"),
                               16 * expected_loss)


@pytest.mark.parametrize("weighted", [False, True])
def test_mmce_kumar_form_gradient_matches_hand_formula(weighted):
    torch.manual_seed(3)
    z = (torch.randn(10, 4, dtype=torch.float64) * 2).requires_grad_()
    y = torch.randint(0, 4, (10,))
    probs, labels = torch.softmax(z, dim=1).max(dim=1)
    c = (labels == y).to(z.dtype)
    kernel = torch.exp(-(probs[:, None] - probs[None, :]).abs() / 0.4)
    if weighted:
        a, b = (1 - probs) * c, probs * (1 - c)
        n1, n0 = c.sum(), (1 - c).sum()
        assert n1 > 0 and n0 > 0
        expected = torch.sqrt((torch.outer(a, a) * kernel).sum() / n1 ** 2 + (torch.outer(b, b) * kernel).sum()
                              / n0 ** 2 - 2 * (torch.outer(a, b) * kernel).sum() / (n1 * n0) + 1e-10)
    else:
        expected = torch.sqrt((torch.outer(c - probs, c - probs) * kernel).sum() / 100 + 1e-10)
    got = R.mmce(z, y, weighted=weighted)
    assert torch.equal(got, R.mmce(z, y, weighted=weighted, form="kumar"))  # the default
    torch.testing.assert_close(got, expected)
    torch.testing.assert_close(torch.autograd.grad(got, z)[0], torch.autograd.grad(expected, z)[0])


def test_mmce_weighted_papers_code_is_zero_with_one_group_empty():
    z = torch.randn(5, 3, dtype=torch.float64)
    assert R.mmce(z, z.argmax(-1), weighted=True, form="papers_code").item() == 0.0
    assert R.mmce(z, (z.argmax(-1) + 1) % 3, weighted=True, form="papers_code").item() == 0.0


def test_mmce_form_rejects_bad_options():
    z, y = torch.randn(3, 4), torch.tensor([0, 1, 2])
    with pytest.raises(ValueError, match="form"):
        R.mmce(z, y, form="paper")
    with pytest.raises(TypeError, match="form"):
        R.mmce_loss(z, y, form=None)
    with pytest.raises(ValueError, match="form"):
        ck.losses.build("mmce_weighted", form="squared")
    with pytest.raises(TypeError, match="form"):
        ck.losses.MMCELoss(form=2)
    with pytest.raises(TypeError, match="form"):
        ck.losses.build("brier_loss", form="papers_code")  # only the MMCE losses have a form
