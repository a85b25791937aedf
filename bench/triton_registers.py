"""Registers and spills of the Triton kernels' launches, compiled for a GPU architecture on a machine without one.

    python -m bench.triton_registers [--classes 1000 16384 32000 128256] [--dtypes bf16 fp32] [--arch 90]
                                     [--targets hard compact dense] [--json OUT]

For each row width, logits dtype, target kind (class indices; ``compact``: label smoothing and a mix; ``dense``: a
float32 probability target), weight and mode it takes the launch shape the launcher itself picks
(``_launch_config``), compiles the forward kernel with ``triton.compile`` for ``sm_<arch>`` (no GPU, no driver) and
reads the cubin's resource usage with the ``cuobjdump`` that Triton ships: registers per thread, stack frame and the
spill stores and loads in the machine code. A memory-bound row kernel that spills moves its registers through local
memory; at the largest register-resident blocks that traffic can exceed the row's own (docs/performance.md,
"Registers"). This measures no time: it says where a launch shape cannot hold what it computes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile

from calibkernels._kernel_codes import MODE_CODES as MODES
from calibkernels._kernel_codes import WEIGHT_CODES

# the weights whose kernel code differs: none, the focal formula with and without FLSD's bands, the Brier score
WEIGHTS = {name: WEIGHT_CODES[name] for name in ("none", "focal", "flsd", "brier")}
TARGETS = ("hard", "compact", "dense")

_COMMON = {"logits_row_stride": "i32", "sample_weight_ptr": "*fp32", "gamma_ptr": "*fp32", "row_loss_ptr": "*fp32",
           "grad_row_stride": "i32", "confidence_ptr": "*fp32", "prediction_ptr": "*i64", "valid_count_ptr": "*i64",
           "loss_ptr": "*fp32", "error_ptr": "*i64", "counter_ptr": "*i32", "num_rows": "i32", "num_classes": "i32",
           "gamma": "fp32", "norm": "fp32", "ignore_index": "i32"}


def _cuobjdump() -> str:
    import triton

    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no cuobjdump in this Triton install ({path})")
    return path


def cubin_resources(cubin: bytes) -> dict:
    """``{"registers", "stack", "spill_stores", "spill_loads"}`` of a one-kernel cubin (``STL`` / ``LDL`` counted in its
    machine code)."""
    tool = _cuobjdump()
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        usage = subprocess.run([tool, "-res-usage", path], capture_output=True, text=True, check=True).stdout
        sass = subprocess.run([tool, "-sass", path], capture_output=True, text=True, check=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage)
    if found is None:
        raise RuntimeError(f"no resource line in cuobjdump's output:\n{usage}")
    return {"registers": int(found.group(1)), "stack": int(found.group(2)),
            "spill_stores": len(re.findall(r"\bSTL(?:\.\w+)*\s", sass)),
            "spill_loads": len(re.findall(r"\bLDL(?:\.\w+)*\s", sass))}


def _specialisation(arg_names, signature, values) -> dict:
    """The attributes Triton's JIT would attach at a launch: 16-byte divisibility for every pointer (torch's
    allocations are aligned) and for each integer argument whose value is a multiple of 16. Without them the compiler
    cannot prove a row's alignment and loads one element per instruction, so the registers and spills it reports
    would not be the launch's."""
    attrs = {}
    for index, name in enumerate(arg_names):
        kind = signature[name]
        if kind.startswith("*") or (kind[0] == "i" and name in values and values[name] % 16 == 0):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return attrs


def compile_forward(num_classes: int, dtype: str, target: str, weight: str, mode: str, arch: int = 90,
                    num_rows: int = 8192, stats: bool = False) -> dict:
    """Compile the forward kernel that the launcher would run for ``num_rows`` contiguous rows of ``num_classes``
    (``dtype`` ``bf16`` / ``fp16`` / ``fp32``; ``target`` one of :data:`TARGETS`; compact rows with a mix and
    smoothing; ``stats``: with the top-label statistics of ``return_stats=True``), specialised as the JIT would
    specialise that launch, and return its launch shape and :func:`cubin_resources`."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from calibkernels.triton import uncertainty_weighted_ce as T

    element_size = 4 if dtype == "fp32" else 2
    single_read, block, num_warps = T._launch_config(num_classes, element_size, target, WEIGHTS[weight],
                                                     MODES[mode], stats)
    # the mean's divisor as the launcher takes it: every row for a dense target, else counted in each program for
    # a small batch or loaded from the targets kernel's count
    count = (T.COUNT_ROWS if target == "dense" else
             T.COUNT_INLINE if num_rows <= T.INLINE_COUNT_MAX_ROWS else T.COUNT_LOADED)
    constexprs = dict(WEIGHT=WEIGHTS[weight], MODE=MODES[mode], REDUCTION=1, COMPUTE_GRAD=True,
                      PER_SAMPLE_GAMMA=False, BLOCK=block, SINGLE_READ=single_read,
                      NORM_IS_TWO=weight == "brier", COUNT=count, CHECK_TARGETS=count == T.COUNT_INLINE,
                      FINISH_BLOCK=T._finish_block(num_rows, num_warps), STATS=stats)
    signature = dict(_COMMON, logits_ptr=f"*{dtype}", grad_ptr=f"*{dtype}", target_ptr="*i64")
    if target == "hard":
        kernel = T._uncertainty_weighted_ce_fwd_kernel
    else:
        kernel = T._soft_target_ce_fwd_kernel
        dense = target == "dense"
        signature.update(target_ptr="*fp32" if dense else "*i64", target_row_stride="i32", mix_ptr="*i64",
                         lambda_ptr="*fp32", lambda_stride="i32", dense_bad_ptr="*i8", smoothing="fp32",
                         dense_tolerance="fp32")
        constexprs.update(DENSE=dense, HAS_MIX=not dense, SMOOTH=True, DENSE_FLAGS=dense)
    # the integer arguments' values in a launch on contiguous (num_rows, C) logits, for the JIT's specialisation
    values = dict(logits_row_stride=num_classes, grad_row_stride=num_classes, num_classes=num_classes,
                  num_rows=num_rows, ignore_index=-100, lambda_stride=0,
                  target_row_stride=num_classes if target == "dense" else 0)
    signature = {name: ("constexpr" if name in constexprs else signature[name]) for name in kernel.arg_names}
    compiled = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constexprs,
                                        attrs=_specialisation(kernel.arg_names, signature, values)),
                              target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})
    return {"single_read": single_read, "block": block, "num_warps": num_warps,
            **cubin_resources(compiled.asm["cubin"])}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--classes", type=int, nargs="+", default=[1000, 4096, 16384, 32000, 128256])
    parser.add_argument("--dtypes", nargs="+", default=["bf16", "fp32"], choices=["bf16", "fp16", "fp32"])
    parser.add_argument("--targets", nargs="+", default=list(TARGETS), choices=TARGETS)
    parser.add_argument("--weights", nargs="+", default=list(WEIGHTS), choices=list(WEIGHTS))
    parser.add_argument("--arch", type=int, default=90, help="compute capability x 10 (default 90: H100 / H200)")
    parser.add_argument("--json", help="also write the rows to this JSON file")
    parser.add_argument("--stats", action="store_true", help="the launches with return_stats=True")
    args = parser.parse_args(argv)
    if any(c < 1 for c in args.classes):
        print("error: --classes must be positive", file=sys.stderr)
        return 2
    rows = []
    print("| C | dtype | target | weight | mode | path | block x warps | registers | stack (B) | spill st / ld |")
    print("|--:|---|---|---|---|---|---|--:|--:|--:|")
    for c, dtype, target, weight, mode in itertools.product(args.classes, args.dtypes, args.targets, args.weights,
                                                            MODES):
        r = compile_forward(c, dtype, target, weight, mode, args.arch, stats=args.stats)
        rows.append(dict(classes=c, dtype=dtype, target=target, weight=weight, mode=mode, arch=args.arch, **r))
        print(f"| {c} | {dtype} | {target} | {weight} | {mode} | {'single' if r['single_read'] else 'two-read'} | "
              f"{r['block']} x {r['num_warps']} | {r['registers']} | {r['stack']} | "
              f"{r['spill_stores']} / {r['spill_loads']} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
