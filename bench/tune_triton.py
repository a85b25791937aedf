"""Launch-configuration search for the GPU kernels (run on a GPU machine; bench/run_on_gpu.sh's ``tune`` stage).

    python -m bench.tune_triton [--out PREFIX] [--classes 1000 32000 128256] [--dtypes bf16 fp32]

Times the kernels alone (``triton.testing.do_bench``: L2 flushed before each repetition, median), not the autograd
step around them, so the numbers say what the launch shape costs:

* the memory ceiling: a device-to-device copy of the same N×C tensor (bytes read + written over time);
* the Triton forward kernel (loss + gradient in one launch) for each (path, block, num_warps, num_stages);
* the CUDA C++ op (its launch shape is fixed by C);
* one whole autograd step (forward + backward through ``calibkernels.uncertainty_weighted_ce``), with and without the
  target read-back, to see what the Python side and the synchronisation add to the kernel.

Writes PREFIX.json and prints a table; the fastest Triton configuration per case is marked.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.tune_triton", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--classes", type=int, nargs="+", default=[1000, 4231, 10000, 32000, 128256])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--weights", nargs="+", default=["brier", "none"])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--stages", type=int, nargs="+", default=[0], help="0: Triton's default")
    parser.add_argument("--programs", type=int, nargs="+", default=[0, 1, 2, 3, 4, 6],
                        help="two-read path: programs per multiprocessor of the row-striding grid (0: one per row)")
    parser.add_argument("--grid-weights", nargs="+", default=["brier"],
                        help="weights whose launch configurations are searched (the others: default only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")

    import triton
    from triton.testing import do_bench

    import calibkernels as ck
    from calibkernels import _validation as V
    from calibkernels.triton import uncertainty_weighted_ce as tri

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    rows = []

    def record(**row):
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    def bench(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

    for c in args.classes:
        for dtype_name in args.dtypes:
            dtype = dtypes[dtype_name]
            n = args.rows
            logits = (2 * torch.randn(n, c, device="cuda")).to(dtype)
            target = torch.randint(0, c, (n,), device="cuda")
            nbytes = 2 * logits.numel() * logits.element_size()
            copy_ms = bench(lambda: logits.clone())
            record(kind="copy", c=c, dtype=dtype_name, ms=copy_ms, gbs=nbytes / copy_ms / 1e6)
            for weight in args.weights:
                code = V.WEIGHT_CODES[weight]
                common = (target, None, None, code, V.MODE_CODES["grad"], 2.0, 2.0, -100, V.REDUCTION_CODES["mean"])

                def triton_fn(chunk=None, num_warps=None, num_stages=None, programs=None):
                    return lambda: tri.uncertainty_weighted_ce_forward(
                        logits, *common, True, False, chunk=chunk, num_warps=num_warps, num_stages=num_stages,
                        programs_per_sm=programs)

                configs = []
                if weight not in args.grid_weights:
                    pass
                elif c <= tri.MAX_BLOCK:
                    block = triton.next_power_of_2(c)
                    for w in args.warps:
                        if w * 32 <= block:
                            configs.append(("single", block, w, None, None))
                for chunk in args.chunks if weight in args.grid_weights else []:
                    if chunk < c:
                        for w in args.warps:
                            if w * 32 * 4 <= chunk and w <= 16:
                                for s in args.stages:
                                    for p in args.programs:
                                        configs.append(("two-read", chunk, w, s or None, p))
                best = None
                for path, block, w, s, p in configs:
                    try:
                        ms = bench(triton_fn(None if path == "single" else block, w, s, p))
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                        record(kind="triton", c=c, dtype=dtype_name, weight=weight, path=path, block=block, warps=w,
                               stages=s, programs_per_sm=p, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    record(kind="triton", c=c, dtype=dtype_name, weight=weight, path=path, block=block, warps=w,
                           stages=s, programs_per_sm=p, ms=ms, gbs=nbytes / ms / 1e6)
                    if best is None or ms < best[0]:
                        best = (ms, path, block, w, s, p)
                default_ms = bench(triton_fn())
                record(kind="triton-default", c=c, dtype=dtype_name, weight=weight, ms=default_ms,
                       gbs=nbytes / default_ms / 1e6, best=best)
                if hasattr(torch.ops.calibkernels, "uncertainty_weighted_ce") and torch._C._dispatch_has_kernel_for_dispatch_key(
                        "calibkernels::uncertainty_weighted_ce", "CUDA"):
                    op = torch.ops.calibkernels.uncertainty_weighted_ce
                    ms = bench(lambda: op(logits, *common, True))
                    record(kind="cuda", c=c, dtype=dtype_name, weight=weight, ms=ms, gbs=nbytes / ms / 1e6)
                # whole autograd step, per target-check policy (async: the default, no host stall; sync: one stall)
                from calibkernels import _target_checks
                leaf = logits.clone().requires_grad_()
                for policy in ("async", "sync"):
                    _target_checks.POLICY = policy
                    for backend in ("triton", "cuda"):
                        if backend not in ck.available_backends():
                            continue

                        def step():
                            leaf.grad = None
                            loss = ck.uncertainty_weighted_ce(leaf, target, weight=weight, mode="grad",
                                                              backend=backend)
                            loss.backward()

                        ms = bench(step)
                        record(kind="step", c=c, dtype=dtype_name, weight=weight, backend=backend, validate=policy,
                               ms=ms, gbs=nbytes / ms / 1e6)
                _target_checks.POLICY = "async"
                del leaf
            del logits, target
            torch.cuda.empty_cache()

    # host cost of one small step (64 x 16: the GPU work is a few microseconds, so this is the launch/Python floor)
    import time

    import torch.nn.functional as F

    small = torch.randn(64, 16, device="cuda", requires_grad=True)
    small_target = torch.randint(0, 16, (64,), device="cuda")
    steps = {
        "calibkernels triton": lambda: ck.uncertainty_weighted_ce(small, small_target, backend="triton"),
        "F.cross_entropy": lambda: F.cross_entropy(small, small_target),
    }
    if "cuda" in ck.available_backends():
        steps["calibkernels cuda"] = lambda: ck.uncertainty_weighted_ce(small, small_target, backend="cuda")
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        liger = LigerCrossEntropyLoss()
        steps["liger cross-entropy"] = lambda: liger(small, small_target)
    except ImportError:
        pass
    for name, fn in steps.items():
        for _ in range(20):
            small.grad = None
            fn().backward()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            small.grad = None
            fn().backward()
        torch.cuda.synchronize()
        record(kind="host", c=16, dtype="fp32", what=name, ms=(time.perf_counter() - start) / 200 * 1e3, gbs=0.0)

    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out + ".json", "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "triton": triton.__version__, "rows": rows}, f, indent=1)
    print("| C | dtype | what | ms | GB/s |")
    print("|---|---|---|--:|--:|")
    for r in rows:
        if r["kind"] == "triton":
            continue
        what = r["kind"] + ("" if "weight" not in r else f" {r['weight']}") + (f" {r['what']}" if "what" in r else "") + (
            f" {r['backend']} validate={r['validate']}" if r["kind"] == "step" else "") + (
            f" best={r['best']}" if r["kind"] == "triton-default" else "")
        print(f"| {r['c']} | {r['dtype']} | {what} | {r['ms']:.3f} | {r['gbs']:.0f} |")


if __name__ == "__main__":
    main()
