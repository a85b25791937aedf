// The entry point of the CPU kernel, compiled once per instruction set (uncertainty_weighted_ce_kernel.h, included
// by kernel_default.cpp and kernel_avx2.cpp) and chosen at run time by uncertainty_weighted_ce.cpp.
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <optional>

#include "uncertainty_weighted_ce.h"

namespace calibkernels {

// Soft targets of the rows (soft_target_rows.h): label smoothing, a mix, or a dense target. The tensors are the
// caller's, alive for the call.
struct SoftTargetArgs {
  bool active = false;
  const at::Tensor* dense = nullptr;    // (N, C) probabilities, contiguous, in the accumulation dtype
  const int64_t* mix = nullptr;         // (N,) partner classes
  const float* lambda_float = nullptr;  // λ of row i at lambda_*[i * lambda_stride], float32 or float64
  const double* lambda_double = nullptr;
  int64_t lambda_stride = 0;
  double smoothing = 0;  // a
  // dense: the rows' value check (soft::flag_dense_target) sets *dense_invalid when a row may fail it
  std::atomic<bool>* dense_invalid = nullptr;
  double dense_flag_tolerance = 0;
};

// The drop-in options (option_rows.h); `active` when any is asked for. The tensors are the caller's, alive for the
// call.
struct OptionArgs {
  bool active = false;
  const void* class_weight = nullptr;  // (C,) contiguous, in the accumulation dtype; null: no class weights
  double lse_square_scale = 0;         // s; 0: no z-loss
  double softcap = 0;                  // c; 0: no cap
  void* z_loss = nullptr;              // (N,) in the accumulation dtype: the rows' s · lse²; null when s == 0
};

struct KernelArgs {
  Weight weight;
  Mode mode;
  double gamma;
  double norm;
  int64_t ignore_index;
  Reduction reduction;
  int64_t valid_rows;  // non-ignored rows (the mean's divisor), counted by the caller's target check
  SoftTargetArgs soft = {};
  OptionArgs options = {};
  // return_stats: the rows' top-label statistics, (N,) each (uncertainty_weighted_ce.h); null when not asked for
  float* confidence = nullptr;
  int64_t* prediction = nullptr;
};

// Runs the kernel over all rows of `z` (stride(1) == 1). Writes the gradient rows to `grad_ptr` (the logits' dtype,
// row stride `grad_stride`, may alias z) when non-null; returns the loss (float32, or float64 for float64 logits;
// (N,) for reduction none, else 0-dim). `avx512`: run the AVX-512 sweeps (avx2 build only; the caller checked the
// CPU). The caller has checked the arguments and targets.
// dense_target_may_fail: the kernel's dense-target flag (soft::flag_dense_target) as a pass of its own over a
// contiguous (N, C) float32/float64 target, rows in parallel; true when some row may fail the exact check.
#define CALIBKERNELS_DECLARE_RUN_KERNEL(isa)                                                                     \
  namespace isa {                                                                                                \
  at::Tensor run_kernel(const at::Tensor& z, void* grad_ptr, int64_t grad_stride, const at::Tensor& target,      \
                        const std::optional<at::Tensor>& sample_weight,                                          \
                        const std::optional<at::Tensor>& gamma_per_sample, const KernelArgs& args, bool avx512); \
  bool dense_target_may_fail(const at::Tensor& dense, double tolerance);                                         \
  }
CALIBKERNELS_DECLARE_RUN_KERNEL(isa_default)
CALIBKERNELS_DECLARE_RUN_KERNEL(isa_avx2)
#undef CALIBKERNELS_DECLARE_RUN_KERNEL

// Whether kernel_avx2.cpp was compiled with AVX2 (GCC on x86-64; otherwise it is an empty translation unit).
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define CALIBKERNELS_HAVE_AVX2_KERNEL 1
#else
#define CALIBKERNELS_HAVE_AVX2_KERNEL 0
#endif

}  // namespace calibkernels
