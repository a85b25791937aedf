"""Launch-configuration search for the GPU kernels (run on a GPU machine; bench/run_on_gpu.sh's ``tune`` stage).

    python -m bench.tune_triton [--out PREFIX] [--classes 1000 32000 128256] [--dtypes bf16 fp32]

Times the kernels alone (``triton.testing.do_bench``: L2 flushed before each repetition, median), not the autograd
step around them, so the numbers say what the launch shape costs:

* the memory ceiling: a device-to-device copy of the same N×C tensor (bytes read + written over time);
* the Triton forward kernel (loss + gradient in one launch) for each (path, block, num_warps);
* the CUDA C++ op with its default launch and, past 4096 classes, each row split (the streaming path, each
  thread-block cluster tile; ``CALIBKERNELS_CUDA_ROW_CLUSTER``);
* one whole autograd step (forward + backward through ``calibkernels.uncertainty_weighted_ce``), per target-check
  policy, to see what the Python side and the synchronisation add to the kernel.

The Triton launcher takes no shape arguments: its shapes come from the module constants ``MAX_BLOCK``,
``MAX_BLOCK_16BIT`` and ``TWO_READ_CHUNK`` and from ``_launch_config``, which :func:`launch_shape` sets and wraps for
one configuration at a time (and restores). Writes PREFIX.json (the rows and the machine, with the commit) and prints
a table; the fastest Triton configuration per case is recorded with the default's.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch


@contextlib.contextmanager
def launch_shape(module, path: str, block: int, num_warps: int, num_classes: int, element_size: int):
    """Make ``module`` (``calibkernels.triton.uncertainty_weighted_ce``) launch rows of ``num_classes`` with one shape.

    ``path="single"``: the whole row in one block (``BLOCK = next_power_of_2(C)``; ``block`` is ignored);
    ``path="two-read"``: chunks of ``block`` classes (``block < C``). ``num_warps`` replaces the launcher's choice.
    Yields the effective ``(single_read, BLOCK, num_warps)`` that ``_launch_config`` now returns (callers check it:
    the two-read chunk is clamped below ``C``). The constants and ``_launch_config`` are restored on exit."""
    saved = {name: getattr(module, name) for name in ("MAX_BLOCK", "MAX_BLOCK_16BIT", "MAX_BLOCK_DENSE",
                                                      "SOFT_BLOCK_CAPS", "TWO_READ_CHUNK", "_launch_config")}
    original = saved["_launch_config"]
    try:
        if path == "single":
            cap = 1 << max(0, (num_classes - 1).bit_length())  # next power of two >= C: the row fits one block
            module.MAX_BLOCK = module.MAX_BLOCK_16BIT = module.MAX_BLOCK_DENSE = max(cap, 1)
            module.SOFT_BLOCK_CAPS = {}
        elif path == "two-read":
            if block >= num_classes:
                raise ValueError(f"a two-read chunk must be smaller than the row: chunk {block}, C = {num_classes}")
            # rows longer than the cap take the two-read path; the launcher clamps the chunk to
            # next_power_of_2(cap) // 2, which a cap of C - 1 keeps at or above every power of two below C - 1
            module.MAX_BLOCK = module.MAX_BLOCK_16BIT = num_classes - 1
            module.MAX_BLOCK_DENSE = max(block, num_classes - 1)
            module.SOFT_BLOCK_CAPS = {}
            module.TWO_READ_CHUNK = {element_size: (block, num_warps)}
        else:
            raise ValueError(f"unknown path {path!r}; expected 'single' or 'two-read'")

        def config(classes, size, *args):
            single_read, chunk, _ = original(classes, size, *args)
            return single_read, chunk, num_warps

        module._launch_config = config
        yield module._launch_config(num_classes, element_size)
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


# CALIBKERNELS_CUDA_ROW_CLUSTER values besides "auto": the CUDA kernel's streaming path and its cluster tile shapes
ROW_SPLITS = ("off", "256x16", "256x32", "512x16", "512x32")


@contextlib.contextmanager
def row_split_setting(value: str):
    """Set CALIBKERNELS_CUDA_ROW_CLUSTER for the CUDA op's launches inside the block (restored on exit)."""
    saved = os.environ.get("CALIBKERNELS_CUDA_ROW_CLUSTER")
    os.environ["CALIBKERNELS_CUDA_ROW_CLUSTER"] = value
    try:
        yield
    finally:
        if saved is None:
            del os.environ["CALIBKERNELS_CUDA_ROW_CLUSTER"]
        else:
            os.environ["CALIBKERNELS_CUDA_ROW_CLUSTER"] = saved


def candidate_shapes(num_classes: int, warps: list[int], chunks: list[int]) -> list[tuple[str, int, int]]:
    """``(path, block, num_warps)`` to try for rows of ``num_classes``: the single-read block with every warp count
    that leaves a thread at least one value, and every two-read chunk below ``C`` with warps that give each thread at
    least 4 values (at most 16 warps)."""
    block = 1 << max(0, (num_classes - 1).bit_length())
    shapes = [("single", block, w) for w in warps if w * 32 <= block]
    shapes += [("two-read", chunk, w) for chunk in chunks if chunk < num_classes for w in warps
               if w * 32 * 4 <= chunk and w <= 16]
    return shapes


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m bench.tune_triton", description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="output prefix: PREFIX.json")
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--classes", type=int, nargs="+", default=[1000, 4231, 10000, 32000, 128256])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"])
    parser.add_argument("--weights", nargs="+", default=["brier", "none"])
    parser.add_argument("--warps", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--chunks", type=int, nargs="+", default=[2048, 4096, 8192, 16384])
    parser.add_argument("--grid-weights", nargs="*", default=["brier"],
                        help="weights whose Triton launch configurations are searched (the others, and all of them "
                             "when none is given: the default launch only)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")

    import triton
    from triton.testing import do_bench

    import calibkernels as ck
    from bench.harness import machine_info
    from calibkernels import _codes as codes
    from calibkernels import _target_checks
    from calibkernels.triton import uncertainty_weighted_ce as tri

    meta = machine_info("cuda")
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    mode, reduction = codes.MODE_CODES["grad"], codes.REDUCTION_CODES["mean"]
    gamma, norm, ignore_index = codes.DEFAULT_GAMMA, codes.DEFAULT_NORM, codes.DEFAULT_IGNORE_INDEX
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
                code = codes.WEIGHT_CODES[weight]

                def kernel():
                    return tri.uncertainty_weighted_ce_forward(logits, target, None, None, code, mode, gamma, norm,
                                                               ignore_index, reduction, True)

                best = None
                shapes = candidate_shapes(c, args.warps, args.chunks) if weight in args.grid_weights else []
                for path, block, warps in shapes:
                    row = dict(kind="triton", c=c, dtype=dtype_name, weight=weight, path=path)
                    try:
                        with launch_shape(tri, path, block, warps, c, logits.element_size()) as effective:
                            single_read, block_used, warps_used = effective
                            row.update(block=block_used, warps=warps_used)
                            if single_read != (path == "single") or (path == "two-read" and block_used != block):
                                record(**row, error=f"launcher clamped the shape to {effective}")
                                continue
                            ms = bench(kernel)
                    except Exception as exc:  # noqa: BLE001 - a config that does not compile is reported
                        record(**row, error=f"{type(exc).__name__}: {str(exc)[:200]}")
                        continue
                    record(**row, ms=ms, gbs=nbytes / ms / 1e6)
                    if best is None or ms < best[0]:
                        best = (ms, path, block_used, warps_used)
                single_read, block_used, warps_used = tri._launch_config(c, logits.element_size())
                default_ms = bench(kernel)
                record(kind="triton-default", c=c, dtype=dtype_name, weight=weight,
                       path="single" if single_read else "two-read", block=block_used, warps=warps_used,
                       ms=default_ms, gbs=nbytes / default_ms / 1e6, best=best)
                if hasattr(torch.ops.calibkernels, "uncertainty_weighted_ce") and \
                        torch._C._dispatch_has_kernel_for_dispatch_key("calibkernels::uncertainty_weighted_ce", "CUDA"):
                    op = torch.ops.calibkernels.uncertainty_weighted_ce
                    # the .cu's launch chooser (CALIBKERNELS_CUDA_ROW_CLUSTER, read at every launch): its default,
                    # then the streaming path and each cluster tile, where C is past the register-resident block
                    for row_split in ("auto", *(ROW_SPLITS if c > 4096 else ())):
                        with row_split_setting(row_split):
                            ms = bench(lambda: op(logits, target, None, None, code, mode, gamma, norm, ignore_index,
                                                  reduction, True, None))
                        record(kind="cuda", c=c, dtype=dtype_name, weight=weight, row_split=row_split, ms=ms,
                               gbs=nbytes / ms / 1e6)
                # whole autograd step, per target-check policy (async: the default, no host stall; sync: one stall)
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
                       "triton": triton.__version__, "meta": meta, "rows": rows}, f, indent=1)
    print("| C | dtype | what | ms | GB/s |")
    print("|---|---|---|--:|--:|")
    for r in rows:
        if r["kind"] == "triton" or "ms" not in r:
            continue
        what = r["kind"] + (f" {r['weight']}" if "weight" in r else "") + (f" {r['what']}" if "what" in r else "")
        if r["kind"] == "step":
            what += f" {r['backend']} validate={r['validate']}"
        elif r["kind"] == "cuda":
            what += f" row_split={r['row_split']}"
        elif r["kind"] == "triton-default":
            what += f" {r['path']} {r['block']}x{r['warps']} best={r['best']}"
        print(f"| {r['c']} | {r['dtype']} | {what} | {r['ms']:.3f} | {r['gbs']:.0f} |")


if __name__ == "__main__":
    main()
