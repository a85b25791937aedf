"""The fused backends' tolerance rules, shared by the backend test files.

Flash-attention's rule (``assert_within_reference_error``): a kernel's error against a float64 reference may be a
small multiple of the error the reference itself makes at the input's precision, plus a few ulps of the result's
magnitude. ``assert_within_largest_entry``: a fixed fraction of the result's largest entry, by dtype.
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


def assert_within_largest_entry(got, exact, dtype, what):
    """|got - exact| ≤ tol·max|exact| with tol 2e-5 (float32), 4e-3 (float16), 2e-2 (bfloat16): fp32 kernels against a
    float64 reference, relative to the largest entry (a few thousand ulps of fp32 at most for the shapes tested;
    16-bit outputs carry their own rounding); non-finite entries must coincide."""
    tol = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 2e-2}[dtype]
    got, exact = got.double().cpu(), exact.double().cpu()
    assert torch.equal(torch.isfinite(got), torch.isfinite(exact)), f"{what}: non-finite entries differ"
    finite = torch.isfinite(exact)
    scale = exact[finite].abs().max().item() if finite.any() else 0.0
    err = (got[finite] - exact[finite]).abs().max().item() if finite.any() else 0.0
    assert err <= tol * max(scale, 1e-30) + 1e-30, f"{what}: max error {err:.3e} (scale {scale:.3e}, tol {tol})"
