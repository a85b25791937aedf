"""The Triton backend's kernels compiled ahead of time for sm_80 and sm_90 without a GPU (Triton's bundled ptxas),
and the registers of the float32 soft launches on sm_90.
"""

import os

import pytest
import torch


T = pytest.importorskip("calibkernels.triton.uncertainty_weighted_ce")

pytestmark = [
    # numpy (behind the interpreter) warns where the kernel deliberately takes log2(0) = -inf or divides by 0 on a
    # masked lane; the results are checked below.
    pytest.mark.filterwarnings("ignore:divide by zero:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning"),
    pytest.mark.filterwarnings("ignore:overflow:RuntimeWarning"),
]


# ----------------------------------------------------------------------------------------------------------------
# Without a GPU: compile the real kernels ahead of time for sm_80 and sm_90 (Triton's bundled ptxas), so a kernel
# that only works under the interpreter (a type error, an unsupported op, a bad constexpr branch) fails CI here.
# ----------------------------------------------------------------------------------------------------------------
_AOT_SCRIPT = r'''
import itertools, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from calibkernels._kernel_codes import WEIGHT_CODES
from calibkernels.triton import uncertainty_weighted_ce as T

assert not T._INTERPRETED, "the kernels must be real triton.jit functions here, not interpreted ones"

def fwd(dtype, weight, mode, reduction, block, single_read, per_sample_gamma, arch, num_warps=None):
    signature = {"logits_ptr": f"*{dtype}", "logits_row_stride": "i64", "target_ptr": "*i64",
                 "sample_weight_ptr": "*fp32", "gamma_ptr": "*fp32", "row_loss_ptr": "*fp32",
                 "grad_ptr": f"*{dtype}", "grad_row_stride": "i64", "confidence_ptr": "*fp32",
                 "prediction_ptr": "*i64", "valid_count_ptr": "*i64", "loss_ptr": f"*{dtype}", "error_ptr": "*i64",
                 "counter_ptr": "*i32",
                 "num_rows": "i32", "num_classes": "i32", "gamma": "fp32", "norm": "fp32", "ignore_index": "i64"}
    # the mean's divisor counted in every program (a small batch) or loaded; the last program's fold of the batch
    count = T.COUNT_INLINE if reduction != T.REDUCTION_MEAN or block <= 1024 else T.COUNT_LOADED
    constexprs = dict(WEIGHT=weight, MODE=mode, REDUCTION=reduction, COMPUTE_GRAD=True,
                      PER_SAMPLE_GAMMA=per_sample_gamma, BLOCK=block, SINGLE_READ=single_read,
                      NORM_IS_TWO=weight in (T.WEIGHT_BRIER, T.WEIGHT_BRIER_FLSD), COUNT=count,
                      CHECK_TARGETS=count == T.COUNT_INLINE, FINISH_BLOCK=min(4096, 256 * (num_warps or 4)),
                      STATS=False)
    signature.update({name: "constexpr" for name in constexprs})
    triton.compile(ASTSource(fn=T._uncertainty_weighted_ce_fwd_kernel, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps or T._num_warps(block)})

def small_kernels(dtype, arch):
    scale = {"grad_ptr": f"*{dtype}", "grad_row_stride": "i64", "grad_output_ptr": f"*{dtype}",
             "grad_output_stride": "i64", "num_rows": "i32", "num_classes": "i32", "PER_ROW": "constexpr",
             "BLOCK": "constexpr"}
    for per_row in (False, True):
        triton.compile(ASTSource(fn=T._uncertainty_weighted_ce_scale_grad_kernel, signature=scale,
                                 constexprs={"PER_ROW": per_row, "BLOCK": 4096}),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": 8})
    targets = {"target_ptr": "*i64", "mix_ptr": "*i64", "lambda_ptr": "*fp32", "lambda_stride": "i64",
               "num_rows": "i32", "num_classes": "i32", "ignore_index": "i64", "valid_count_ptr": "*i64",
               "error_ptr": "*i64", "CHECK_MIX": "constexpr", "BLOCK": "constexpr"}
    for check_mix in (False, True):
        triton.compile(ASTSource(fn=T._uncertainty_weighted_ce_targets_kernel, signature=targets,
                                 constexprs={"CHECK_MIX": check_mix, "BLOCK": 4096}),
                       target=GPUTarget("cuda", arch, 32), options={"num_warps": 4})

for weight, mode in itertools.product(sorted(WEIGHT_CODES.values()), range(2)):  # every weight x mode, both paths
    fwd("fp32", weight, mode, 1, 1024, True, False, 90)
    fwd("bf16", weight, mode, 0, 4096, False, False, 90, num_warps=4)
fwd("bf16", 4, 1, 1, 8192, False, False, 90, num_warps=8)         # a long two-read chunk
fwd("fp32", 4, 1, 2, T.MAX_BLOCK, True, False, 90, num_warps=16)  # the largest single-read block (C = 32000)
fwd("fp16", 1, 0, 1, 2048, True, True, 90)                         # per-sample gamma (the gamma-Net)
fwd("bf16", 4, 1, 1, 1024, True, False, 80)
fwd("fp32", 3, 0, 1, 4096, False, False, 80, num_warps=8)


def soft(dtype, target_dtype, weight, mode, block, single_read, dense, has_mix, smooth, norm_is_two, arch, num_warps,
         num_rows=None, count=None):
    signature = {"logits_ptr": f"*{dtype}", "logits_row_stride": "i64", "target_ptr": f"*{target_dtype}",
                 "target_row_stride": "i64", "mix_ptr": "*i64", "lambda_ptr": "*fp32", "lambda_stride": "i64",
                 "sample_weight_ptr": "*fp32", "gamma_ptr": "*fp32", "row_loss_ptr": "*fp32",
                 "grad_ptr": f"*{dtype}", "grad_row_stride": "i64", "confidence_ptr": "*fp32",
                 "prediction_ptr": "*i64", "valid_count_ptr": "*i64", "dense_bad_ptr": "*i8", "loss_ptr": "*fp32",
                 "error_ptr": "*i64", "counter_ptr": "*i32",
                 "num_rows": "i32", "num_classes": "i32", "gamma": "fp32", "norm": "fp32",
                 "ignore_index": "i64", "smoothing": "fp32", "dense_tolerance": "fp32"}
    if count is None:
        count = T.COUNT_ROWS if dense else (T.COUNT_LOADED if has_mix else T.COUNT_INLINE)
    constexprs = dict(WEIGHT=weight, MODE=mode, REDUCTION=1, COMPUTE_GRAD=True, PER_SAMPLE_GAMMA=False, BLOCK=block,
                      SINGLE_READ=single_read, NORM_IS_TWO=norm_is_two, DENSE=dense, HAS_MIX=has_mix, SMOOTH=smooth,
                      DENSE_FLAGS=dense and target_dtype != "fp64", COUNT=count,
                      CHECK_TARGETS=count == T.COUNT_INLINE, FINISH_BLOCK=min(4096, 256 * num_warps), STATS=False)
    if num_rows is not None:  # an integer argument equal to 1 arrives as a constant
        constexprs["num_rows"] = num_rows
    signature.update({name: "constexpr" for name in constexprs})
    triton.compile(ASTSource(fn=T._soft_target_ce_fwd_kernel, signature=signature, constexprs=constexprs),
                   target=GPUTarget("cuda", arch, 32), options={"num_warps": num_warps})

small_kernels("bf16", 90)
small_kernels("fp32", 80)
# soft targets: compact and dense, single read and two reads, the weights with loss-mode terms
soft("fp32", "i64", 4, 0, 1024, True, False, True, True, True, 90, 8)      # compact, Brier q = 2, in registers
soft("bf16", "i64", 2, 0, 2048, False, False, True, True, False, 90, 4)    # compact, FLSD, two reads
soft("bf16", "fp32", 4, 0, 2048, False, True, False, True, False, 80, 4)   # dense, Brier q != 2: the extra read
soft("fp16", "fp16", 1, 0, 4096, True, True, False, False, False, 90, 16)  # dense focal, in registers
soft("bf16", "i64", 6, 0, 2048, False, False, True, True, True, 90, 4)     # compact, Brier-FLSD q = 2, two reads
soft("fp32", "fp32", 6, 0, 1024, True, True, False, False, False, 80, 8)   # dense, Brier-FLSD q != 2, in registers
soft("fp32", "fp64", 4, 1, 2048, False, True, False, True, True, 90, 4)    # dense float64 target: no row flags
soft("fp32", "fp32", 4, 1, 1024, True, True, False, False, True, 90, 8, num_rows=1)  # a one-row dense mean
soft("bf16", "i64", 4, 1, 1024, True, False, True, False, True, 90, 4,
     count=T.COUNT_INLINE)  # a mix checked in the fold
print("compiled")
'''


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the real kernels run in the tests above")
def test_kernels_compile_for_sm80_and_sm90_without_a_gpu():
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", _AOT_SCRIPT], capture_output=True, text=True, env=env,
                            timeout=900)
    assert result.returncode == 0 and "compiled" in result.stdout, result.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU tests above run these launches")
@pytest.mark.parametrize("classes,target", [
    (["32000"], "compact"),         # the largest compact blocks held in registers, and the capped variant's chunks
    (["16384", "32000"], "dense"),  # the largest dense blocks, and a dense row's chunks
])
def test_soft_float32_launches_keep_their_registers_on_sm90(tmp_path, classes, target):
    """The launch shapes the launcher picks for float32 soft rows, compiled for sm_90 as the JIT specialises them:
    none spills. With every soft row of up to 32768 classes in registers, the dense blocks had spilled 80-1100 stores
    and the compact loss-mode ones 160 (bench/triton_registers.py)."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = tmp_path / "registers.json"
    result = subprocess.run([sys.executable, "-m", "bench.triton_registers", "--dtypes", "fp32", "--json", str(out),
                             "--classes", *classes, "--targets", target], capture_output=True, text=True, env=env,
                            timeout=900, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert result.returncode == 0, result.stderr[-4000:]
    rows = json.loads(out.read_text())
    assert len(rows) == 8 * len(classes)  # four weights x two modes per width
    for row in rows:
        assert row["registers"] <= 128 and row["spill_stores"] == 0 and row["spill_loads"] == 0, row
