"""The fused backends' tolerance rule, shared by the backend test files (flash-attention's rule).

A kernel's error against a float64 reference may be a small multiple of the error the reference itself makes at the
input's precision, plus a few ulps of the result's magnitude.
"""

import torch


def assert_within_reference_error(got, exact, at_precision, dtype, what, ulps=64):
    """|got - exact| ≤ 4·(reference's own error at this precision) + ulps·eps·max|exact| (elementwise maximum).

    ``exact`` is the float64 reference, ``at_precision`` the reference run at the input's ``dtype``; non-finite
    entries must coincide.
    """
    got, exact, at_precision = got.double().cpu(), exact.double().cpu(), at_precision.double().cpu()
    assert got.shape == exact.shape, f"{what}: shape {tuple(got.shape)} != {tuple(exact.shape)}"
    finite = torch.isfinite(exact)
    assert torch.equal(torch.isfinite(got), finite), f"{what}: non-finite entries differ"
    if not finite.any():
        return
    got, exact, at_precision = got[finite], exact[finite], at_precision[finite]
    own_error = (at_precision - exact).abs().max().item()
    bound = 4 * own_error + ulps * torch.finfo(dtype).eps * exact.abs().max().item() + 1e-30
    err = (got - exact).abs().max().item()
    assert err <= bound, f"{what}: max error {err:.3e} > bound {bound:.3e} (reference's own error {own_error:.3e})"
