"""The CUDA kernels' Brier weight with FLSD-53's γ_i (``brier_flsd``) on a GPU: its rows are Brier rows with the
band's γ for hard, compact soft and dense targets, and its band is decided as FLSD's, at the thresholds too.
"""

import math

import numpy as np
import pytest
import torch

from calibkernels import _kernel_codes as K

from _flsd_band import band_choices, flsd_gammas, gamma_picked

from _cuda_helpers import MODES, needs_gpu, _op, check_op

_C = pytest.importorskip("calibkernels._C", reason="the compiled extension is not built")


# ----------------------------------------------------------------------------------------------------------------
# brier_flsd: the Brier weight with FLSD-53's γ_i
# ----------------------------------------------------------------------------------------------------------------
BAND_GAMMA = 2.0  # γ of the top band (p ≥ 0.5): distinct from FLSD-53's 3 and 5
BANDS = band_choices(BAND_GAMMA)


def _rows_in_every_band(n, c):
    """float32 logits whose target probabilities sweep (0, 1) clear of FLSD-53's thresholds, and their targets."""
    g = torch.Generator().manual_seed(c)
    z = torch.randn(n, c, generator=g, dtype=torch.float64)
    y = torch.randint(0, c, (n,), generator=g)
    p_y = torch.linspace(0.013, 0.987, n, dtype=torch.float64)  # 0.2 and 0.5 fall between two rows
    others = z.scatter(1, y[:, None], float("-inf")).logsumexp(dim=1)
    z[torch.arange(n), y] = others + torch.log(p_y / (1 - p_y))
    return z.float().cuda(), y.cuda()


def _target_of(kind, y, c, seed=0):
    """The op's target and soft arguments for class indices `y` (hard, compact: a mix and smoothing, or dense), and
    the target distribution t they stand for (float64, CPU)."""
    one_hot = torch.nn.functional.one_hot(y.cpu(), c).double()
    if kind == "hard":
        return y, {}, one_hot
    if kind == "compact":
        mix, lam, a = (y + 1) % c, 0.85, 0.05
        t = a / c + (1 - a) * (lam * one_hot + (1 - lam) * torch.nn.functional.one_hot(mix.cpu(), c).double())
        lambdas = torch.full(y.shape, lam, device="cuda")
        return y, dict(mix_target=mix, mix_lambda=lambdas, label_smoothing=a), t
    g = torch.Generator().manual_seed(seed)
    dense = (0.9 * one_hot + 0.1 * torch.softmax(torch.randn(len(y), c, generator=g, dtype=torch.float64), 1)).float()
    return dense.cuda(), {}, dense.double()


@needs_gpu
@pytest.mark.parametrize("c", [10, 1000, 3001, 20000])
@pytest.mark.parametrize("kind", ["hard", "compact", "dense"])
def test_brier_flsd_rows_are_brier_rows_with_their_band_gamma(kind, c):
    """A brier_flsd row is, bit for bit, the Brier weight's row with γ = its γ_i (the kernels run the Brier code with
    γ_i in place of γ), for hard, compact soft and dense targets on every launch shape, in both modes, with q = 2 and
    the general-q path; and the whole against the reference."""
    n = 40
    z, y = _rows_in_every_band(n, c)
    target, soft, t = _target_of(kind, y, c, seed=c)
    p_band = (t * torch.softmax(z.double().cpu(), dim=1)).sum(dim=1)  # p_y, or <t, p>
    clear = ((p_band - K.FLSD_LOW_THRESHOLD).abs() > 1e-4) & ((p_band - K.FLSD_MID_THRESHOLD).abs() > 1e-4)
    expected = flsd_gammas(p_band, BAND_GAMMA)
    assert set(expected[clear].tolist()) == set(BANDS), "the rows should reach every band"
    for mode in MODES:
        for norm in (2.0, 1.5):
            kw = dict(mode=mode, norm=norm, **soft)
            loss, grad = _op(z, target, uncertainty="brier_flsd", gamma=BAND_GAMMA, reduction="none", **kw)
            for g in BANDS:
                rows = (clear & (expected == g)).cuda()
                want_loss, want_grad = _op(z, target, uncertainty="brier", gamma=g, reduction="none", **kw)
                assert torch.equal(loss[rows], want_loss[rows]), f"{kind}/{mode}/q={norm}: loss of the γ={g} rows"
                assert torch.equal(grad[rows], want_grad[rows]), f"{kind}/{mode}/q={norm}: gradient of the γ={g} rows"
            check_op(z, target, uncertainty="brier_flsd", gamma=BAND_GAMMA, reduction="sum", **kw)


def _picked_by_both(z, target, t, **soft):
    """γ_i per row as flsd picks it and as brier_flsd picks it (grad mode, no gradient): which γ of BANDS explains each
    row's loss (flsd: (1 - <t, p>)^γ CE; brier_flsd with q = 2: ‖p - t‖^γ CE, in float64 from the logits' exact values;
    the three losses differ by far more than rounding)."""
    picked = []
    for uncertainty in ("flsd", "brier_flsd"):
        loss, _ = _op(z, target, uncertainty=uncertainty, gamma=BAND_GAMMA, reduction="none", compute_grad=False,
                      **soft)
        picked.append(gamma_picked(loss, z, t, uncertainty, BANDS))  # float64 on the CPU
    return picked


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["fp32", "fp64"])
def test_brier_flsd_band_is_flsd_band_at_the_thresholds(dtype):
    """Rows whose exact p_y or <t, p> is a threshold, or a few float32 ulps from one: brier_flsd takes the band flsd
    takes. Equal logits give a band value of exp(-log C) as the device rounds it (torch's exp and log on the device
    are the kernel's), float32(exp(-log 5)) being 0.19999999 on a CPU; the rows 16 and 64 ulps away take the band of
    their exact value."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    for c in (5, 2):
        device_band = torch.exp(-torch.log(torch.tensor(float(c), dtype=acc, device="cuda"))).float()
        z = torch.zeros(3, c, dtype=dtype, device="cuda")
        y = torch.tensor([0, 1, c - 1], device="cuda")
        flsd, brier_flsd = _picked_by_both(z, y, torch.nn.functional.one_hot(y.cpu(), c).double())
        assert brier_flsd == flsd == [flsd_gammas(device_band, BAND_GAMMA).item()] * 3, (c, device_band.item())
    for threshold in (K.FLSD_LOW_THRESHOLD, K.FLSD_MID_THRESHOLD):
        t32 = np.float32(threshold)
        ulp = float(np.spacing(t32))
        exact = [float(t32) + k * ulp for k in (-64, -16, 16, 64)]
        z = torch.zeros(len(exact), 2, dtype=torch.float64)
        z[:, 1] = torch.tensor([math.log((1 - p) / p) for p in exact], dtype=torch.float64)
        z = z.to(dtype).cuda()
        y = torch.zeros(len(exact), dtype=torch.long, device="cuda")
        p_y = torch.softmax(z.double().cpu(), dim=1)[:, 0]
        flsd, brier_flsd = _picked_by_both(z, y, torch.nn.functional.one_hot(y.cpu(), 2).double())
        assert brier_flsd == flsd == flsd_gammas(p_y, BAND_GAMMA).tolist(), (threshold, p_y.tolist())


@needs_gpu
def test_brier_flsd_band_of_compact_targets_is_flsd_band():
    """Equal logits with mixes and smoothing (<t, p> = 0.2 exactly): brier_flsd takes flsd's band, that of the closed
    form float32((w_y e^{z_y - lse} + w_m e^{z_m - lse}) + c), evaluated here with the device's float32 exp and log."""
    c = 5
    z = torch.zeros(3, c, device="cuda")
    y = torch.tensor([0, 1, 2], device="cuda")
    mix = torch.tensor([3, 1, 4], device="cuda")
    lam = torch.tensor([0.5, 0.25, 1.0], device="cuda")
    e = torch.exp(-torch.log(torch.tensor(float(c), device="cuda")))
    for a in (0.0, 0.5):
        one = torch.tensor(1.0, device="cuda")
        keep, add = one - a, torch.tensor(a, device="cuda") / c
        band = ((keep * lam) * e + (keep * (one - lam)) * e) + add
        t = a / c + (1 - a) * (lam.double().cpu()[:, None] * torch.nn.functional.one_hot(y.cpu(), c).double()
                               + (1 - lam.double().cpu()[:, None]) * torch.nn.functional.one_hot(mix.cpu(), c).double())
        flsd, brier_flsd = _picked_by_both(z, y, t, mix_target=mix, mix_lambda=lam, label_smoothing=a)
        assert brier_flsd == flsd == flsd_gammas(band, BAND_GAMMA).tolist(), (a, band.tolist())
