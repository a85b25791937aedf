"""The cost of a loss call's top-label statistics (``return_stats=True``) in a training step, as ratios to the plain
step, in one interleaved run.

    python -m bench.bench_loss_stats [--device cpu|cuda] [--quick] [--reps R] [--results-dir DIR | --out PREFIX]

Steps timed (forward + backward of the mean, BSCE-GRA, default backend), per shape ``(N, C)``:

* ``plain``: ``ck.uncertainty_weighted_ce(logits, target).backward()``;
* ``return_stats``: the same with ``return_stats=True`` (the confidence and prediction per row);
* ``return_stats_meter``: calib-train's pattern, the statistics into a ``CalibrationMeter(track_adaptive=False)``
  (``update_top_label``, on the device, read once per evaluation);
* ``loss_then_softmax``: what a user writes without it: the plain step, then ``softmax(logits).max(-1)`` for the
  confidence and the prediction (one more pass over the ``N × C`` logits and an ``N × C`` temporary);
* the fused linear path (``hidden (N, H) @ W.T``, ``H`` = :data:`HIDDEN`): ``fused_linear_plain`` and
  ``fused_linear_stats``.

Each group of steps is timed interleaved; results and history rows as :mod:`bench.step_ratios` writes them
(``loss-stats-<device type>[-quick]-<device>-<date>``).
"""

from __future__ import annotations

import torch

import calibkernels as ck
from bench import step_ratios
from bench.timing import time_steps

SHAPES = {"cpu": [(4096, 1000), (1024, 32000)], "cuda": [(8192, 1000), (8192, 32000)]}
HIDDEN = 256  # the fused linear path's hidden size
DTYPE = torch.float32


def _logits_steps():
    """Steps ``(logits, target)`` on the materialised logits."""

    def plain(logits, target):
        ck.uncertainty_weighted_ce(logits, target).backward()

    def return_stats(logits, target):
        loss, stats = ck.uncertainty_weighted_ce(logits, target, return_stats=True)
        loss.backward()
        return stats

    meter = ck.metrics.CalibrationMeter(track_adaptive=False)

    def return_stats_meter(logits, target):
        loss, stats = ck.uncertainty_weighted_ce(logits, target, return_stats=True)
        loss.backward()
        meter.update_top_label(stats.confidence, stats.prediction == target)

    def loss_then_softmax(logits, target):
        ck.uncertainty_weighted_ce(logits, target).backward()
        with torch.no_grad():
            return torch.softmax(logits, dim=-1).max(dim=-1)

    return {"plain": plain, "return_stats": return_stats, "return_stats_meter": return_stats_meter,
            "loss_then_softmax": loss_then_softmax}


def _fused_linear_steps(linear_weight):
    """Steps ``(hidden, target)`` of the fused linear loss with the output layer's ``linear_weight``."""

    def fused_linear_plain(hidden, target):
        ck.fused_linear_uncertainty_weighted_ce(hidden, linear_weight, target).backward()

    def fused_linear_stats(hidden, target):
        loss, stats = ck.fused_linear_uncertainty_weighted_ce(hidden, linear_weight, target, return_stats=True)
        loss.backward()
        return stats

    return {"fused_linear_plain": fused_linear_plain, "fused_linear_stats": fused_linear_stats}


def _measure(n, c, device, reps):
    """``[(step, Timing, ratio to its group's plain step)]`` of one shape."""
    generator = torch.Generator().manual_seed(0)
    target = torch.randint(0, c, (n,), generator=generator).to(device)
    logits = (3 * torch.randn(n, c, generator=generator)).to(device, DTYPE).requires_grad_()
    timings = time_steps(_logits_steps(), logits, target, warmup=1, reps=reps, min_reps=min(3, reps),
                         max_time_s=60.0)
    del logits
    records = [(name, t, t.median_ms / timings["plain"].median_ms) for name, t in timings.items()]
    hidden = torch.randn(n, HIDDEN, generator=generator).to(device, DTYPE).requires_grad_()
    linear_weight = (torch.randn(c, HIDDEN, generator=generator) / HIDDEN ** 0.5).to(device, DTYPE)
    fused = time_steps(_fused_linear_steps(linear_weight.requires_grad_()), hidden, target, warmup=1, reps=reps,
                       min_reps=min(3, reps), max_time_s=60.0)
    records += [(name, t, t.median_ms / fused["fused_linear_plain"].median_ms) for name, t in fused.items()]
    return records


def main(argv=None):
    return step_ratios.main(
        argv, prog="python -m bench.bench_loss_stats", description=__doc__.splitlines()[0],
        suite_prefix="loss-stats", kernel="loss_stats", shapes=SHAPES, measure=_measure,
        caption=f"fp32, BSCE-GRA, forward + backward; fused linear with H = {HIDDEN}",
        fields_of=lambda step: dict(weight="brier", mode="grad", target="hard",
                                    config={"hidden": HIDDEN} if step.startswith("fused_linear") else {}))


if __name__ == "__main__":
    main()
