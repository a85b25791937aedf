"""Soft-target cases of the loss shared by the contract suite and the CPU kernel's soft-target tests: logits, a
target and the soft keyword arguments of each kind, and one backend's loss and gradient.
"""

import torch

import calibkernels as ck


def _case(kind, n, c, device, seed, dtype=torch.float32, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    z = (torch.randn(n, c, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)
    y = torch.randint(0, c, (n,), generator=g)
    if n > 3:
        y[2] = -100
    kw = {}
    target = y.to(device)
    if kind in ("smooth", "mix_smooth", "dense_smooth"):
        kw["label_smoothing"] = 0.1
    if kind in ("mix", "mix_smooth"):
        kw.update(mix_target=y.flip(0).clamp(min=0).to(device), mix_lambda=0.35)
    if kind == "mix_rows":
        mix = torch.randint(0, c, (n,), generator=g)
        mix[0] = y[0]  # a row mixed with its own class
        lam = torch.rand(n, generator=g)
        lam[1] = 1.0
        kw.update(mix_target=mix.to(device), mix_lambda=lam.to(device))
    if kind.startswith("dense"):
        target = torch.softmax(torch.randn(n, c, generator=g) * 2, dim=1).to(device)
    return z, target, kw


def _pair(backend, z, target, uncertainty, mode, reduction, kw, norm=2.0, gamma=2.0, dtype=None):
    x = z.detach().clone()
    if dtype is not None:
        x = x.to(dtype)
    x.requires_grad_(True)
    sample_weight = None
    if uncertainty == "external":
        sample_weight = torch.linspace(0.2, 2.0, x.shape[0], dtype=torch.float64).to(x.device)
    tgt = target.to(x.dtype) if target.is_floating_point() and backend == "reference" else target
    kw = dict(kw)
    if isinstance(kw.get("mix_lambda"), torch.Tensor) and backend == "reference" and x.dtype == torch.float64:
        kw["mix_lambda"] = kw["mix_lambda"].double()
    loss = ck.uncertainty_weighted_ce(x, tgt, uncertainty=uncertainty, mode=mode, reduction=reduction, norm=norm,
                                      gamma=gamma, sample_weight=sample_weight, backend=backend, **kw)
    loss.sum().backward()
    return loss.detach(), x.grad
