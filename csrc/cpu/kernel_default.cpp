// The CPU kernel for any CPU of the build's architecture (x86-64 baseline: SSE2; ATen's DEFAULT Vectorized<>).
#define CPU_CAPABILITY DEFAULT
#define CALIBKERNELS_ISA isa_default
#include "cpu/uncertainty_weighted_ce_kernel.h"
