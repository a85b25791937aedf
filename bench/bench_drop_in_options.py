"""The cost of the drop-in options (per-class weights, z-loss, logit soft-capping) in a training step, as ratios to
the plain step, in one interleaved run; ``F.cross_entropy`` (with and without ``weight=``) and, on CUDA where it is
importable, Liger-Kernel's ``LigerCrossEntropyLoss(lse_square_scale=, softcap=)`` beside them.

    python -m bench.bench_drop_in_options [--device cpu|cuda] [--quick] [--reps R] [--results-dir DIR | --out PREFIX]

Steps timed (forward + backward of the mean, fp32), per shape ``(N, C)``, each against ``plain``
(``ck.uncertainty_weighted_ce(logits, target)``, BSCE-GRA on the default backend of the device):

* ``class_weight``: ``weight=w`` (per-class, ``(C,)``); ``z_loss``: ``lse_square_scale=1e-4``; ``softcap``:
  ``softcap=30``; ``all_options``: the three together;
* ``f_cross_entropy`` and ``f_cross_entropy_weight``: ``F.cross_entropy(logits, target[, weight=w])``;
* ``liger_z_loss_softcap`` (CUDA, ``liger_kernel`` importable): ``LigerCrossEntropyLoss(lse_square_scale=1e-4,
  softcap=30)``.

A step whose options the chosen kernel does not compute fails (the reference would run it, with a
``RuntimeWarning`` made an error here) and is left out of the table. Results and history rows as
:mod:`bench.step_ratios` writes them (``drop-in-options-<device type>[-quick]-<device>-<date>``).
"""

from __future__ import annotations

import importlib.util
import sys
import warnings

import torch
import torch.nn.functional as F

import calibkernels as ck
from bench import step_ratios
from bench.timing import time_steps

SHAPES = {"cpu": [(4096, 1000), (1024, 32000)], "cuda": [(8192, 1000), (8192, 32000)]}
DTYPE = torch.float32
LSE_SQUARE_SCALE = 1e-4
SOFTCAP = 30.0


def _steps(class_weight, device: str) -> dict:
    """The steps ``(logits, target)`` of one shape."""
    backend = "cpu" if device == "cpu" else "auto"

    def loss_step(**options):
        def step(logits, target):
            with warnings.catch_warnings():
                warnings.simplefilter("error", RuntimeWarning)  # a reference fallback is not this kernel's cost
                out = ck.uncertainty_weighted_ce(logits, target, backend=backend, **options)
            out.backward()

        return step

    def f_cross_entropy(logits, target):
        F.cross_entropy(logits, target).backward()

    def f_cross_entropy_weight(logits, target):
        F.cross_entropy(logits, target, weight=class_weight).backward()

    steps = {"plain": loss_step(), "class_weight": loss_step(weight=class_weight),
             "z_loss": loss_step(lse_square_scale=LSE_SQUARE_SCALE), "softcap": loss_step(softcap=SOFTCAP),
             "all_options": loss_step(weight=class_weight, lse_square_scale=LSE_SQUARE_SCALE, softcap=SOFTCAP),
             "f_cross_entropy": f_cross_entropy, "f_cross_entropy_weight": f_cross_entropy_weight}
    if device == "cuda" and importlib.util.find_spec("liger_kernel") is not None:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        criterion = LigerCrossEntropyLoss(lse_square_scale=LSE_SQUARE_SCALE, softcap=SOFTCAP)

        def liger_z_loss_softcap(logits, target):
            loss = criterion(logits, target)
            (loss[0] if isinstance(loss, tuple) else loss).backward()

        steps["liger_z_loss_softcap"] = liger_z_loss_softcap
    return steps


def _measure(n, c, device, reps):
    """``[(step, Timing, ratio to plain)]`` of one shape; steps that fail are reported and left out."""
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, c, (n,), generator=generator).to(device)
    logits = (3 * torch.randn(n, c, generator=generator)).to(device, DTYPE).requires_grad_()
    class_weight = (torch.rand(c, generator=generator) + 0.5).to(device, DTYPE)

    def report(name, exc):
        print(f"[bench] {n}x{c} {name}: left out ({type(exc).__name__}: {exc})", file=sys.stderr)

    timings = time_steps(_steps(class_weight, device), logits, target, warmup=1, reps=reps, min_reps=min(3, reps),
                         max_time_s=60.0, on_error=report)
    return [(name, t, t.median_ms / timings["plain"].median_ms) for name, t in timings.items()]


def _fields_of(step: str) -> dict:
    options = {"class_weight": {"weight": "per-class"}, "z_loss": {"lse_square_scale": LSE_SQUARE_SCALE},
               "softcap": {"softcap": SOFTCAP},
               "all_options": {"weight": "per-class", "lse_square_scale": LSE_SQUARE_SCALE, "softcap": SOFTCAP}}
    plain_ce = step.startswith(("f_cross_entropy", "liger"))
    return dict(weight="none" if plain_ce else "brier", mode="grad", target="hard", config=options.get(step, {}))


def main(argv=None):
    return step_ratios.main(
        argv, prog="python -m bench.bench_drop_in_options", description=__doc__.splitlines()[0],
        suite_prefix="drop-in-options", kernel="drop_in_options", shapes=SHAPES, measure=_measure,
        caption="fp32, BSCE-GRA (F.cross_entropy / Liger: plain CE), forward + backward", fields_of=_fields_of,
        ratio_header="ratio to plain")


if __name__ == "__main__":
    main()
