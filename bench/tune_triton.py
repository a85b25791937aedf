"""Launch-configuration search for the GPU kernels (run on a GPU machine; bench/run_on_gpu.sh's ``tune`` stage).

    python -m bench.tune_triton [--out PREFIX] [--classes 1000 32000 128256] [--dtypes bf16 fp32]

Times the kernels alone (``triton.testing.do_bench``: L2 flushed before each repetition, median), not the autograd
step around them, so the numbers say what the launch shape costs:

* the memory ceiling: a device-to-device copy of the same N×C tensor (bytes read + written over time);
* the Triton forward (loss and gradient, ``uncertainty_weighted_ce_forward``) for each (path, block, num_warps): at
  the default 8192 rows, more than ``INLINE_COUNT_MAX_ROWS`` (1024), a mean with a gradient is two launches, a
  one-program launch that counts the mean's divisor and then the loss launch, timed together;
* the CUDA C++ op with its default launch;
* one whole autograd step (forward + backward through ``calibkernels.uncertainty_weighted_ce``), per target-check
  policy, to see what the Python side and the synchronisation add to the kernel.

The Triton launcher takes no shape arguments: its shapes come from the module constants ``MAX_BLOCK``,
``MAX_BLOCK_16BIT`` and ``TWO_READ_CHUNK`` and from ``_launch_config``, which :func:`launch_shape` sets and wraps for
one configuration at a time (and restores). Writes PREFIX.json (the rows and the machine, with the commit) after
each class count, so a run stopped part way (a wall-clock limit's SIGINT) keeps the rows measured so far
(``meta.complete`` false until the end), and prints a table; the fastest Triton configuration per case is recorded
with the default's.
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


def candidate_shapes(num_classes: int, warps: list[int], chunks: list[int]) -> list[tuple[str, int, int]]:
    """``(path, block, num_warps)`` to try for rows of ``num_classes``: the single-read block with every warp count
    that leaves a thread at least one value, and every two-read chunk below ``C`` with warps that give each thread at
    least 4 values (at most 16 warps)."""
    block = 1 << max(0, (num_classes - 1).bit_length())
    shapes = [("single", block, w) for w in warps if w * 32 <= block]
    shapes += [("two-read", chunk, w) for chunk in chunks if chunk < num_classes for w in warps
               if w * 32 * 4 <= chunk and w <= 16]
    return shapes


def _setup(args) -> dict:
    """What the sweep needs on the GPU machine: the modules (imported here: Triton and the extension need the GPU's
    environment), the machine's description, the device's compute capability and a header for the JSON."""
    import triton
    from triton.testing import do_bench

    import calibkernels as ck
    from bench.harness import machine_info
    from calibkernels import _kernel_codes as codes
    from calibkernels import _target_checks
    from calibkernels.triton import uncertainty_weighted_ce as tri

    meta = machine_info("cuda")
    return dict(triton=triton, do_bench=do_bench, ck=ck, codes=codes, target_checks=_target_checks, tri=tri,
                meta=meta, capability=torch.cuda.get_device_capability(),
                header={"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                        "triton": triton.__version__})


def write_json(out: str | None, header: dict, meta: dict, rows: list[dict], complete: bool) -> None:
    """Replace ``out``.json with the rows so far (written beside and renamed, so a run stopped while writing leaves the
    previous version); ``meta.complete``: whether the sweep ran to its end."""
    if not out:
        return
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    partial = out + ".json.partial"
    with open(partial, "w") as f:
        json.dump({**header, "meta": {**meta, "complete": complete}, "rows": rows}, f, indent=1)
    os.replace(partial, out + ".json")


def sweep_class(ctx: dict, args, c: int, record) -> None:
    """Every measurement of rows of ``c`` classes (each dtype and weight): copy, Triton shapes and default, the CUDA
    op's default launch, whole autograd steps; each row goes to ``record``."""
    do_bench, ck, codes, tri = ctx["do_bench"], ctx["ck"], ctx["codes"], ctx["tri"]
    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32, "fp16": torch.float16}
    mode, reduction = codes.MODE_CODES["grad"], codes.REDUCTION_CODES["mean"]
    gamma, norm, ignore_index = codes.DEFAULT_GAMMA, codes.DEFAULT_NORM, codes.DEFAULT_IGNORE_INDEX

    def bench(fn):
        return do_bench(fn, warmup=25, rep=100, return_mode="median")

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

                def cuda_op():
                    return op(logits, target, None, None, code, mode, gamma, norm, ignore_index, reduction, True,
                              None)

                ms = bench(cuda_op)
                record(kind="cuda", c=c, dtype=dtype_name, weight=weight, ms=ms, gbs=nbytes / ms / 1e6)
            # whole autograd step, per target-check policy (async: the default, no host stall; sync: one stall)
            leaf = logits.clone().requires_grad_()
            try:
                for policy in ("async", "sync"):
                    ctx["target_checks"].POLICY = policy
                    for backend in ("triton", "cuda"):
                        if backend not in ck.available_backends():
                            continue

                        def step():
                            leaf.grad = None
                            loss = ck.uncertainty_weighted_ce(leaf, target, uncertainty=weight, mode="grad",
                                                              backend=backend)
                            loss.backward()

                        ms = bench(step)
                        record(kind="step", c=c, dtype=dtype_name, weight=weight, backend=backend, validate=policy,
                               ms=ms, gbs=nbytes / ms / 1e6)
            finally:
                ctx["target_checks"].POLICY = "async"
            leaf = None  # released before the next dtype allocates its own
        logits = target = None
        torch.cuda.empty_cache()


def host_floor(ctx: dict, record) -> None:
    """Host cost of one small step (64 x 16: the GPU work is a few microseconds, so this is the launch/Python
    floor)."""
    import time

    import torch.nn.functional as F

    ck = ctx["ck"]
    small = torch.randn(64, 16, device="cuda", requires_grad=True)
    small_target = torch.randint(0, 16, (64,), device="cuda")
    # name -> (the leaf the step reads, the step's loss)
    steps = {
        "calibkernels triton": (small, lambda: ck.uncertainty_weighted_ce(small, small_target, backend="triton")),
        "F.cross_entropy": (small, lambda: F.cross_entropy(small, small_target)),
    }
    if "cuda" in ck.available_backends():
        steps["calibkernels cuda"] = (small, lambda: ck.uncertainty_weighted_ce(small, small_target, backend="cuda"))
    try:
        from liger_kernel.transformers import LigerCrossEntropyLoss

        liger = LigerCrossEntropyLoss()
        # Liger writes the gradient into its input: a leaf of its own, so the other steps keep their logits
        liger_small = small.detach().clone().requires_grad_()
        steps["liger cross-entropy"] = (liger_small, lambda: liger(liger_small, small_target))
    except ImportError:
        pass
    for name, (leaf, fn) in steps.items():
        for _ in range(20):
            leaf.grad = None
            fn().backward()
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(200):
            leaf.grad = None
            fn().backward()
        torch.cuda.synchronize()
        record(kind="host", c=16, dtype="fp32", what=name, ms=(time.perf_counter() - start) / 200 * 1e3, gbs=0.0)


def print_table(rows: list[dict]) -> None:
    print("| C | dtype | what | ms | GB/s |")
    print("|---|---|---|--:|--:|")
    for r in rows:
        if r["kind"] == "triton" or "ms" not in r:
            continue
        what = r["kind"] + (f" {r['weight']}" if "weight" in r else "") + (f" {r['what']}" if "what" in r else "")
        if r["kind"] == "step":
            what += f" {r['backend']} validate={r['validate']}"
        elif r["kind"] == "triton-default":
            what += f" {r['path']} {r['block']}x{r['warps']} best={r['best']}"
        print(f"| {r['c']} | {r['dtype']} | {what} | {r['ms']:.3f} | {r['gbs']:.0f} |")


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

    ctx = _setup(args)
    rows = []

    def record(**row):
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    try:
        for c in args.classes:
            sweep_class(ctx, args, c, record)
            write_json(args.out, ctx["header"], ctx["meta"], rows, complete=False)
        host_floor(ctx, record)
    except KeyboardInterrupt:  # a wall-clock limit's SIGINT: keep what was measured
        write_json(args.out, ctx["header"], ctx["meta"], rows, complete=False)
        print(f"[tune] interrupted: {args.out}.json holds the {len(rows)} rows measured so far (complete = false)"
              if args.out else "[tune] interrupted", file=sys.stderr, flush=True)
        raise
    write_json(args.out, ctx["header"], ctx["meta"], rows, complete=True)
    print_table(rows)


if __name__ == "__main__":
    main()
