// The CUDA row kernels for bfloat16 logits (row_params.h says why each dtype has a file of its own).
#include "row_kernels.cuh"

CALIBKERNELS_CUDA_ROWS_FOR(c10::BFloat16)
