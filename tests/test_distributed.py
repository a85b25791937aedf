"""The vocabulary-parallel loss (calibkernels.distributed) against the unsharded reference, on 2 and 3 gloo processes.

Each rank holds a contiguous block of classes (unequal blocks, one of them empty) of the same logits; every weight ×
mode × reduction must give every rank the reference's loss and, as its gradient, its slice of the reference's
gradient. Bad input (a target out of range, different targets on different ranks) raises the same ``ValueError`` on
every rank. The ranks run as subprocesses (``init_method=file://``), each checking everything and printing the list of
what failed.
"""

import json
import os
import subprocess
import sys

import pytest
import torch

import calibkernels as ck

pytestmark = pytest.mark.skipif(not torch.distributed.is_available(), reason="torch.distributed not built")

_WORKER = r"""
import datetime, itertools, json, sys
import torch
import torch.distributed as dist
from calibkernels import reference as R
from calibkernels.loss_stats import top_label_stats
from calibkernels.distributed import vocab_parallel_uncertainty_weighted_ce as vocab_parallel

rank, world, init_method = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
layouts, seed = json.loads(sys.argv[4]), int(sys.argv[5])
# a short timeout: a collective left waiting by a rank that raised alone fails the test instead of hanging it
dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                        timeout=datetime.timedelta(seconds=60))
failures = []
everyone = dist.new_group(list(range(world)))


def close(name, got, want, rtol, atol):
    if got.shape != want.shape or not torch.allclose(got.double(), want.double(), rtol=rtol, atol=atol):
        err = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else "shape"
        failures.append(f"{name}: {err}")


def inputs(num_classes, dtype):
    g = torch.Generator().manual_seed(seed + num_classes)
    n = 9
    z = 3 * torch.randn(n, num_classes, generator=g, dtype=torch.float64)
    y = torch.randint(0, num_classes, (n,), generator=g)
    y[4] = y[7] = -100
    z[1] = 0.0                      # every other class tied below the target (ties across ranks)
    z[1, y[1]] = 2.0
    z[2, 0] = z[2, -1] = z[2, y[2]] - 0.25  # two tied classes, on the first and last blocks, just below the target
    if y[2] in (0, num_classes - 1):
        y[2] = num_classes // 2
        z[2, y[2]] = z[2, 0] + 0.25
    z[3, y[3]] = 800.0              # saturated row: p_y = 1 and 1 - p_y = 0 exactly
    sample_weight = torch.rand(n, generator=g, dtype=torch.float64)
    grad_output = torch.randn(n, generator=g, dtype=torch.float64)
    return z.to(dtype), y, sample_weight, grad_output


for sizes in layouts:
    num_classes, offset = sum(sizes), sum(sizes[:rank])
    local_slice = slice(offset, offset + sizes[rank])
    z, y, sample_weight, grad_output = inputs(num_classes, torch.float64)
    for uncertainty, mode, reduction in itertools.product(["none", "focal", "flsd", "dual_focal", "brier", "external",
                                                      "brier_flsd"],
                                                     ["grad", "loss"], ["mean", "sum", "none"]):
        for norm in ([2.0, 1.5] if uncertainty in ("brier", "brier_flsd") else [2.0]):
            kw = dict(uncertainty=uncertainty, mode=mode, gamma=3.0 if uncertainty == "flsd" else 2.5, norm=norm,
                      reduction=reduction, sample_weight=sample_weight if uncertainty == "external" else None)
            name = f"{sizes} {uncertainty} {mode} {reduction} q={norm}"
            full = z.clone().requires_grad_()
            want = R.uncertainty_weighted_ce(full, y, **kw)
            go = grad_output if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
            (want_grad,) = torch.autograd.grad(want, full, go)
            local = z[:, local_slice].clone().requires_grad_()
            got = vocab_parallel(local, y, **kw)
            (got_grad,) = torch.autograd.grad(got, local, go)
            close(name + " loss", got.detach(), want.detach(), 1e-10, 1e-12)
            close(name + " grad", got_grad, want_grad[:, local_slice], 1e-9, 1e-12)
            with torch.no_grad():
                close(name + " no_grad loss", vocab_parallel(z[:, local_slice], y, **kw), want.detach(), 1e-10, 1e-12)
                if reduction == "none" and mode == "loss":  # an explicit group: the same as the default one
                    close(name + " explicit group", vocab_parallel(z[:, local_slice], y, group=everyone, **kw),
                          want.detach(), 1e-10, 1e-12)

    # F.cross_entropy / Liger-Kernel options: per-class weights (the whole (C,) tensor on every rank), the z-loss
    # (returned, and added), the softcap, and all of them at once
    class_weight = torch.rand(num_classes, generator=torch.Generator().manual_seed(seed + 2), dtype=torch.float64)
    class_weight[0] = 0.0  # a class that counts for nothing in the weighted mean's divisor
    for uncertainty, mode, reduction, options in itertools.product(
            ["none", "focal", "flsd", "dual_focal", "brier", "external"], ["grad", "loss"], ["mean", "sum", "none"],
            [dict(weight=class_weight), dict(lse_square_scale=0.3, return_z_loss=True),
             dict(weight=class_weight, lse_square_scale=1e-2, softcap=4.0, return_z_loss=True)]):
        kw = dict(uncertainty=uncertainty, mode=mode, gamma=3.0 if uncertainty == "flsd" else 2.5, reduction=reduction,
                  sample_weight=sample_weight if uncertainty == "external" else None, **options)
        name = f"{sizes} {uncertainty} {mode} {reduction} {sorted(options)}"
        full = z.clone().requires_grad_()
        want = R.uncertainty_weighted_ce(full, y, **kw)
        go = grad_output if reduction == "none" else torch.tensor(1.7, dtype=torch.float64)
        (want_grad,) = torch.autograd.grad(want[0] if isinstance(want, tuple) else want, full, go)
        local = z[:, local_slice].clone().requires_grad_()
        got = vocab_parallel(local, y, **kw)
        (got_grad,) = torch.autograd.grad(got[0] if isinstance(got, tuple) else got, local, go)
        if isinstance(got, tuple) != isinstance(want, tuple):
            failures.append(f"{name}: returned {type(got).__name__}")
            continue
        for what, got_value, want_value in zip(("loss", "z_loss"), *[x if isinstance(x, tuple) else (x,)
                                                                     for x in (got, want)]):
            close(f"{name} {what}", got_value.detach(), want_value.detach(), 1e-10, 1e-12)
        close(f"{name} grad", got_grad, want_grad[:, local_slice], 1e-9, 1e-12)
        if isinstance(got, tuple) and got[1].requires_grad:
            failures.append(f"{name}: the z-loss requires grad")
        with torch.no_grad():
            plain = vocab_parallel(z[:, local_slice], y, **kw)
            close(f"{name} no_grad loss", plain[0] if isinstance(plain, tuple) else plain,
                  want[0].detach() if isinstance(want, tuple) else want.detach(), 1e-10, 1e-12)
    # every non-ignored target weighted 0: the weighted mean is 0 (F.cross_entropy's NaN aside), the z-loss remains
    for options in (dict(), dict(lse_square_scale=0.5)):
        zero_weight = class_weight.clone()
        zero_weight[y[y != -100]] = 0.0
        full = z.clone().requires_grad_()
        want = R.uncertainty_weighted_ce(full, y, uncertainty="focal", weight=zero_weight, **options)
        (want_grad,) = torch.autograd.grad(want, full)
        local = z[:, local_slice].clone().requires_grad_()
        got = vocab_parallel(local, y, uncertainty="focal", weight=zero_weight, **options)
        (got_grad,) = torch.autograd.grad(got, local)
        close(f"{sizes} zero class weights {options} loss", got.detach(), want.detach(), 1e-10, 1e-12)
        close(f"{sizes} zero class weights {options} grad", got_grad, want_grad[:, local_slice], 1e-9, 1e-12)

    # a per-sample gamma that requires grad (focal, mode="loss"), and (..., C) logits; with class weights too
    gamma = (0.5 + 3 * torch.rand(9, generator=torch.Generator().manual_seed(seed), dtype=torch.float64))
    for reduction, weight in (("mean", None), ("none", None), ("mean", class_weight)):
        full, g_full = z.clone().requires_grad_(), gamma.clone().requires_grad_()
        want = R.uncertainty_weighted_ce(full.view(3, 3, num_classes), y.view(3, 3), uncertainty="focal", mode="loss",
                                         gamma=g_full.view(3, 3), reduction=reduction, weight=weight)
        go = torch.ones_like(want) if reduction == "mean" else grad_output.view(3, 3)
        want_grads = torch.autograd.grad(want, (full, g_full), go)
        local, g_local = z[:, local_slice].clone().requires_grad_(), gamma.clone().requires_grad_()
        got = vocab_parallel(local.view(3, 3, sizes[rank]), y.view(3, 3), uncertainty="focal", mode="loss",
                             gamma=g_local.view(3, 3), reduction=reduction, weight=weight)
        got_grads = torch.autograd.grad(got, (local, g_local), go)
        name = f"{sizes} gamma tensor {reduction} weight={weight is not None}"
        close(f"{name} loss", got.detach(), want.detach(), 1e-10, 1e-12)
        close(f"{name} grad", got_grads[0], want_grads[0][:, local_slice], 1e-9, 1e-12)
        close(f"{name} dgamma", got_grads[1], want_grads[1], 1e-9, 1e-12)

    # half precision: the same numbers as the reference on the same bfloat16 logits (both compute in float32)
    zb, y, _, _ = inputs(num_classes, torch.bfloat16)
    for uncertainty, mode in (("brier", "grad"), ("dual_focal", "loss"), ("focal", "loss")):
        full = zb.clone().float().requires_grad_()
        want = R.uncertainty_weighted_ce(full, y, uncertainty=uncertainty, mode=mode)
        (want_grad,) = torch.autograd.grad(want, full)
        local = zb[:, local_slice].clone().requires_grad_()
        got = vocab_parallel(local, y, uncertainty=uncertainty, mode=mode)
        (got_grad,) = torch.autograd.grad(got, local)
        if got.dtype != torch.bfloat16 or got_grad.dtype != torch.bfloat16:
            failures.append(f"{sizes} bf16 dtypes {got.dtype} {got_grad.dtype}")
        close(f"{sizes} bf16 {uncertainty} {mode} loss", got.detach().float(), want.detach().bfloat16().float(), 1e-2,
              1e-6)
        close(f"{sizes} bf16 {uncertainty} {mode} grad", got_grad.float(), want_grad[:, local_slice], 1e-2, 1e-4)

    # float32 at large logit scales: within the backends' tolerance rule of the float64 reference (4x the float32
    # reference's own error + 64 ulps of the largest entry). Half the rows have the target at the max (a confident,
    # tiny CE, whose S can underflow while CE does not), the others are mostly confidently wrong (the Brier
    # derivative's cancellation times a CE in the hundreds).
    g = torch.Generator().manual_seed(seed + 1)
    for scale in (10.0, 100.0, 1000.0):
        z32 = (scale * torch.randn(16, num_classes, generator=g, dtype=torch.float64)).float()
        y32 = torch.randint(0, num_classes, (16,), generator=g)
        y32[:8] = z32[:8].argmax(dim=1)
        for uncertainty, mode in itertools.product(["none", "focal", "flsd", "dual_focal", "brier", "brier_flsd"],
                                              ["grad", "loss"]):
            kw = dict(uncertainty=uncertainty, mode=mode, gamma=3.0, reduction="none")
            results = []
            for dtype in (torch.float64, torch.float32):
                full = z32.to(dtype).requires_grad_()
                want = R.uncertainty_weighted_ce(full, y32, **kw)
                results.append((want.detach().double(), torch.autograd.grad(want.sum(), full)[0].double()))
            local = z32[:, local_slice].clone().requires_grad_()
            got = vocab_parallel(local, y32, **kw)
            (got_grad,) = torch.autograd.grad(got.sum(), local)
            if uncertainty == "none":  # a confident row's CE to its relative precision, not to an ulp of the max logit
                # (CE = log1p(Σ_{k≠y} e^{z_k − z_y}) in float64: the reference's lse − z_y has that ulp, 3e-14 at 200)
                z64 = z32[:8].double()
                others = torch.exp(z64 - z64.gather(1, y32[:8, None])).scatter(1, y32[:8, None], 0.0)
                exact_ce, got_ce = torch.log1p(others.sum(dim=1)), got.detach()[:8].double()
                normal = exact_ce > 1e-30
                relative = ((got_ce - exact_ce).abs() / exact_ce)[normal]
                if relative.numel() and not relative.max().item() <= 1e-5:
                    failures.append(f"{sizes} float32 scale {scale} confident CE: relative {relative.max().item():.2e}")
            # the bound's scale is the whole tensor's largest entry (all classes), as for the unsharded backends: a
            # rank's slice may hold only underflowed classes, where even the float64 reference is off by its ulps.
            # Brier in "loss" mode adds, per row, 16 ulps of c = CE γ_i S^{γ_i/2 − 1} (the largest over FLSD's γ_i):
            # a confidently wrong row's derivative is c times a difference of two numbers near 1 (docs/losses.md)
            cancellation = 0.0
            if uncertainty in ("brier", "brier_flsd") and mode == "loss":
                z64 = z32.double()
                brier = ((z64.softmax(dim=1) - torch.nn.functional.one_hot(y32, num_classes)) ** 2).sum(dim=1)
                ce = -z64.log_softmax(dim=1).gather(1, y32[:, None])[:, 0]
                cancellation = 16 * 2.0**-23 * torch.maximum(3 * ce * brier**0.5, 5 * ce * brier**1.5)[:, None]
            for what, value, exact, low in (("loss", got.detach(), results[0][0], results[1][0]),
                                            ("grad", got_grad, results[0][1], results[1][1])):
                scale_of = exact.abs().max().item()
                if what == "grad":
                    exact, low = exact[:, local_slice], low[:, local_slice]
                if exact.numel() == 0:  # a rank without classes: no gradient to compare
                    continue
                bound = 4 * (low - exact).abs().max().item() + 64 * 2.0**-23 * scale_of + 1e-30
                if what == "grad":
                    bound = bound + cancellation
                excess = ((value.double() - exact).abs() - bound).max().item()
                if not excess <= 0:
                    failures.append(f"{sizes} float32 scale {scale} {uncertainty} {mode} {what}: {excess:.3e} past "
                                    "the bound")

    # return_stats: the unsharded logits' top-label statistics, the same on every rank, whichever ranks hold the max
    zs = z.clone()
    zs[0] = -1.0
    zs[0, 0] = zs[0, -1] = 5.0      # tied maxima on the first and the last class (the first and the last block)
    zs[2, num_classes // 2] = 60.0  # the max inside a middle block
    zs[5] = 0.0                     # every class tied: class 0
    zs[6, -1] = 50.0                # the max on the last class
    zs[8] = -float("inf")           # no distribution: NaN confidence, prediction 0 (torch.argmax's)
    zs[8, 0] = -float("inf")
    want_stats = top_label_stats(zs, y == -100, (9,))
    local = zs[:, local_slice]
    for reduction, dtype, grad in (("none", torch.float64, False), ("mean", torch.float64, True),
                                   ("sum", torch.bfloat16, True)):
        name = f"{sizes} stats {reduction} {dtype} grad={grad}"
        want_stats_here = want_stats if dtype == torch.float64 else top_label_stats(zs.to(dtype), y == -100, (9,))
        leaf = local.to(dtype).clone().requires_grad_(grad)
        loss, stats = vocab_parallel(leaf, y, uncertainty="focal", reduction=reduction, return_stats=True)
        if stats.confidence.dtype != torch.float32 or stats.prediction.dtype != torch.int64:
            failures.append(f"{name}: dtypes {stats.confidence.dtype} {stats.prediction.dtype}")
        if stats.confidence.requires_grad:
            failures.append(f"{name}: the confidence requires grad")
        if not torch.equal(stats.prediction, want_stats_here.prediction):
            failures.append(f"{name}: prediction {stats.prediction.tolist()} != {want_stats_here.prediction.tolist()}")
        if not torch.allclose(stats.confidence, want_stats_here.confidence, rtol=1e-6, atol=0, equal_nan=True):
            failures.append(f"{name}: confidence {stats.confidence.tolist()} != "
                            f"{want_stats_here.confidence.tolist()}")
        everyone_stats = [torch.empty(2, 9, dtype=torch.float64) for _ in range(world)]
        dist.all_gather(everyone_stats, torch.stack([stats.confidence.double(), stats.prediction.double()]))
        if not all(torch.equal(other.nan_to_num(-7.0), everyone_stats[0].nan_to_num(-7.0))
                   for other in everyone_stats):
            failures.append(f"{name}: the ranks' statistics differ")
        plain = vocab_parallel(leaf, y, uncertainty="focal", reduction=reduction)
        if not torch.equal(loss.detach().nan_to_num(), plain.detach().nan_to_num()):
            failures.append(f"{name}: the loss changed")
        if grad:
            (with_stats,) = torch.autograd.grad(loss, leaf, retain_graph=True)
            (without,) = torch.autograd.grad(plain, leaf)
            if not torch.equal(with_stats.nan_to_num(), without.nan_to_num()):
                failures.append(f"{name}: the gradient changed")
    # with softcap, the statistics of the logits as given (the reference's), the loss as without return_stats
    for softcap in (0.5, 30.0):
        want_stats = top_label_stats(zs, y == -100, (9,))
        leaf = zs[:, local_slice].clone().requires_grad_()
        loss, z_loss, stats = vocab_parallel(leaf, y, softcap=softcap, lse_square_scale=0.1, return_z_loss=True,
                                             return_stats=True)
        plain, plain_z_loss = vocab_parallel(leaf, y, softcap=softcap, lse_square_scale=0.1, return_z_loss=True)
        name = f"{sizes} stats softcap={softcap}"
        if not torch.equal(stats.prediction, want_stats.prediction):
            failures.append(f"{name}: prediction {stats.prediction.tolist()} != {want_stats.prediction.tolist()}")
        if not torch.allclose(stats.confidence, want_stats.confidence, rtol=1e-6, atol=0, equal_nan=True):
            failures.append(f"{name}: confidence {stats.confidence.tolist()} != {want_stats.confidence.tolist()}")
        if not (torch.equal(loss.detach(), plain.detach()) and torch.equal(z_loss, plain_z_loss)):
            failures.append(f"{name}: the loss changed")
        (with_stats,) = torch.autograd.grad(loss, leaf)
        (without,) = torch.autograd.grad(plain, leaf)
        if not torch.equal(with_stats, without):
            failures.append(f"{name}: the gradient changed")
    # (..., C) logits: stats shaped like the target
    _, stats = vocab_parallel(z[:, local_slice].reshape(3, 3, -1), y.view(3, 3), return_stats=True)
    if tuple(stats.prediction.shape) != (3, 3):
        failures.append(f"{sizes} stats shape {tuple(stats.prediction.shape)}")

    # every row ignored: mean 0, zero gradient
    local = z[:, local_slice].clone().requires_grad_()
    loss = vocab_parallel(local, torch.full_like(y, -100))
    loss.backward()
    if loss.item() != 0.0 or local.grad.abs().sum().item() != 0.0:
        failures.append(f"{sizes} all ignored: loss {loss.item()}")

    def expect(error, message, what, call, *args, **kwargs):
        try:
            call(*args, **kwargs)
            failures.append(f"{sizes} {what} accepted")
        except error as exc:
            if message not in str(exc):
                failures.append(f"{sizes} {what} message: {exc}")

    # double backward raises (at the backward with create_graph=True) instead of contributing nothing
    local = z[:, local_slice].clone().requires_grad_()
    expect(RuntimeError, "double backward", "double backward", torch.autograd.grad,
           vocab_parallel(local, y, uncertainty="brier", mode="loss"), local, create_graph=True)

    # bad input raises the same ValueError on every rank (and no rank is left waiting)
    bad = y.clone()
    bad[0] = num_classes
    expect(ValueError, "out of range", "out-of-range target", vocab_parallel, z[:, local_slice], bad)
    different = y.clone()
    if rank == world - 1:
        different[0] = (int(y[0]) + 1) % num_classes
    expect(ValueError, "targets differ", "different targets", vocab_parallel, z[:, local_slice], different)
    # an argument that only one rank refuses (its own checks, before any collective): that rank raises its own error,
    # the others a ValueError naming it, instead of waiting for it in the first collective until the timeout
    last = rank == world - 1
    for what, error, message, kw in [
            ("unknown uncertainty", ValueError, "unknown uncertainty", dict(uncertainty="nope")),
            ("target shape", ValueError, "target shape", dict(target=y[:-1])),
            ("logits dtype", TypeError, "floating-point", dict(local_logits=z[:, local_slice].long())),
            ("negative sample_weight", ValueError, "sample_weight", dict(uncertainty="external",
                                                                         sample_weight=-sample_weight)),
            ("negative class weight", ValueError, "per-class weights", dict(weight=-class_weight)),
            ("softcap 0", ValueError, "softcap", dict(softcap=0.0))]:
        args = dict(local_logits=z[:, local_slice], target=y)
        if last:
            args.update(kw)
        elif "sample_weight" in kw:
            args.update(uncertainty="external", sample_weight=sample_weight)
        elif "weight" in kw:
            args.update(weight=class_weight)
        call_args = (args.pop("local_logits"), args.pop("target"))
        if last:
            expect(error, message, f"{what} on one rank (that rank)", vocab_parallel, *call_args, **args)
        else:
            expect(ValueError, f"rank {world - 1} refused its arguments", f"{what} on one rank (the others)",
                   vocab_parallel, *call_args, **args)
    # targets differing by (+1, -2, +1) on three rows (which a linear hash with evenly spaced row weights misses)
    different = y.clone()
    different[:3] = torch.tensor([1, 4, 1]) if rank == world - 1 else torch.tensor([2, 2, 2])
    expect(ValueError, "targets differ", "targets differing by (+1, -2, +1)", vocab_parallel, z[:, local_slice],
           different)

    # arguments that differ between ranks raise the same ValueError on every rank, not a hang, a crash in the
    # collectives (a different weight or dtype changes their number or size) or a different loss per rank
    last = rank == world - 1
    local = z[:, local_slice]
    for what, message, kw in [
            ("uncertainty", "different uncertainty", dict(uncertainty="dual_focal" if last else "brier")),
            ("dtype", "different dtype", dict(local_logits=local.float() if last else local)),
            ("ignore_index", "different ignore_index", dict(ignore_index=-1 if last else -100)),
            ("reduction", "different reduction", dict(reduction="none" if last else "mean")),
            ("mode", "different mode", dict(mode="loss" if last else "grad")),
            ("gamma", "different gamma", dict(uncertainty="focal", gamma=2.5 if last else 2.0)),
            ("sample_weight", "sample_weight values differ",
             dict(uncertainty="external", sample_weight=sample_weight + (0.5 if last else 0.0))),
            ("per-sample gamma", "per-sample gamma values differ",
             dict(uncertainty="focal", gamma=sample_weight + (0.5 if last else 0.0))),
            ("return_stats", "different return_stats", dict(return_stats=last)),
            ("lse_square_scale", "different lse_square_scale", dict(lse_square_scale=0.1 if last else 0.0)),
            ("return_z_loss", "different return_z_loss", dict(return_z_loss=last)),
            ("softcap", "different softcap", dict(softcap=5.0 if last else None)),
            ("weight given", "different weight", dict(weight=class_weight if last else None)),
            ("weight values", "different weight values",
             dict(weight=class_weight.flip(0) if last and num_classes > 1 else class_weight)),
            ("weight entry", "different weight values",
             dict(weight=class_weight + torch.eye(num_classes, dtype=torch.float64)[-1] * (1e-12 if last else 0.0)))]:
        expect(ValueError, message, f"different {what}", vocab_parallel, kw.pop("local_logits", local), y, **kw)

    # per-class weights of the wrong length (the same on every rank): every rank raises, naming C
    expect(ValueError, f"must have shape ({num_classes},)", "class weights of the wrong length", vocab_parallel, local,
           y, weight=torch.ones(num_classes + 1, dtype=torch.float64))

    # ignored rows are 0 whatever their logits hold, as in the reference (NaN or inf there must not reach the mean)
    for value in (float("nan"), float("inf")):
        bad_z = z.clone()
        bad_z[4] = value  # row 4 is ignored
        full = bad_z.clone().requires_grad_()
        want = R.uncertainty_weighted_ce(full, y, uncertainty="focal", mode="loss")
        (want_grad,) = torch.autograd.grad(want, full)
        local = bad_z[:, local_slice].clone().requires_grad_()
        got = vocab_parallel(local, y, uncertainty="focal", mode="loss")
        (got_grad,) = torch.autograd.grad(got, local)
        close(f"{sizes} {value} on an ignored row: loss", got.detach(), want.detach(), 1e-10, 1e-12)
        close(f"{sizes} {value} on an ignored row: grad", got_grad, want_grad[:, local_slice], 1e-9, 1e-12)

# no class on any rank: the unsharded loss has none either (not NaN)
expect(ValueError, "no rank holds a class", "zero classes everywhere", vocab_parallel, torch.zeros(3, 0),
       torch.full((3,), -100))
# a group this process is not a member of (new_group is collective: every rank creates it)
first_only = dist.new_group([0])
if rank != 0:
    expect(ValueError, "not a member", "not a member", vocab_parallel, torch.zeros(3, 2), torch.zeros(3).long(),
           group=first_only)

dist.destroy_process_group()
print(json.dumps(failures))
"""


def _run_ranks(world, layouts, tmp_path):
    init_method = f"file://{tmp_path / 'rendezvous'}"
    seed = int(torch.randint(0, 2**30, ()).item())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen([sys.executable, "-c", _WORKER, str(rank), str(world), init_method,
                                   json.dumps(layouts), str(seed)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, env=env) for rank in range(world)]
    outputs = []
    try:
        for process in processes:
            outputs.append(process.communicate(timeout=180))
    finally:
        for process in processes:
            if process.poll() is None:
                process.kill()
    for rank, (process, (out, err)) in enumerate(zip(processes, outputs)):
        assert process.returncode == 0, f"rank {rank} (seed {seed}): {err[-3000:]}"
        failures = json.loads(out.strip().splitlines()[-1])
        assert not failures, f"rank {rank} (seed {seed}): {failures[:20]}"


def test_two_ranks_with_unequal_blocks_match_the_unsharded_reference(tmp_path):
    _run_ranks(2, [[3, 8]], tmp_path)


def test_three_ranks_with_unequal_and_empty_blocks_match_the_unsharded_reference(tmp_path):
    _run_ranks(3, [[5, 0, 6], [2, 7, 4]], tmp_path)


def test_bad_input_raises_before_any_collective():
    """Checks that need no other rank run first, without an initialised process group."""
    z = torch.randn(4, 3)
    y = torch.tensor([0, 1, 2, -100])
    with pytest.raises(ValueError, match="target shape"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y[:3])
    with pytest.raises(TypeError, match="integer class indices"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y.float())
    with pytest.raises(TypeError, match="floating-point"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z.long(), y)
    with pytest.raises(ValueError, match="unknown uncertainty"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, uncertainty="nope")
    with pytest.raises(ValueError, match="sample_weight"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, uncertainty="external")
    with pytest.raises(TypeError, match="return_stats"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, return_stats=1)
    with pytest.raises(TypeError, match="uncertainty='focal'"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, weight="focal")
    with pytest.raises(ValueError, match=r"shape \(C,\)"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, weight=torch.ones(1, 3))
    with pytest.raises(TypeError, match="floating-point"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, weight=torch.ones(3, dtype=torch.long))
    with pytest.raises(ValueError, match="entry 1"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, weight=torch.tensor([1.0, float("nan"), 1.0]))
    with pytest.raises(ValueError, match="lse_square_scale"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, lse_square_scale=-1.0)
    with pytest.raises(TypeError, match="return_z_loss"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, return_z_loss=1)
    with pytest.raises(ValueError, match="softcap"):
        ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y, softcap=-2.0)
    if not torch.distributed.is_initialized():
        with pytest.raises(RuntimeError, match="process group"):
            ck.distributed.vocab_parallel_uncertainty_weighted_ce(z, y)
