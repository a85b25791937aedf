// The CUDA row kernels of the uncertainty-weighted cross-entropy family (formulas: docs/losses.md; contract in
// ../uncertainty_weighted_ce.h), and their launches; the op's host side is uncertainty_weighted_ce.cu.
//
//   L_i = u_i · CE_i,  CE_i = lse_i - z_{i,y_i},  p_i = softmax(z_i),
//   u_i ∈ {1, (1-p_y)^γ (focal; γ per sample optional), (1-p_y)^{γ_i} (FLSD-53), (1-p_y+p_j)^γ (dual focal),
//          (Σ_{k≠y} p_k^q + (1-p_y)^q)^{γ/q} (generalised Brier), the same to γ_i/q (Brier with FLSD-53's γ_i),
//          w_i (external)}.
//   mode "grad" (GRA): dL_i/dz_ik = u_i (p_ik - δ_ky);  mode "loss": + CE_i du_i/dz_ik with
//     focal / FLSD  du/dz_k = -γ (1-p_y)^{γ-1} p_y (δ_ky - p_k)                      (γ_i of FLSD not differentiated)
//     dual focal    du/dz_k = γ (1-p_y+p_j)^{γ-1} ((p_y - p_j) p_k + p_j τ_k - p_y δ_ky), τ_k = 1/n on the n classes
//                   tied at p_j = max{p_k : z_k < z_y} (how amax's backward splits its gradient in the reference)
//     Brier         du/dz_k = γ S^{γ/q-1} (p_k^q - p_k H) (k≠y),  du/dz_y = -γ S^{γ/q-1} p_y S,
//                   H = Σ_{k≠y} p_k^q - p_y (1-p_y)^{q-1}                       (γ_i of Brier-FLSD not differentiated)
//   (Lin et al. 2017; Mukhoti et al. 2020; Tao, Dong & Xu, ICML 2023; BSCE-GRA paper Eq. 3/11; the same formulas as
//   csrc/cpu/uncertainty_weighted_ce.cpp and calibkernels/triton/uncertainty_weighted_ce.py.)
// The kernels see a weight as its formula (weight_formula: FLSD runs as focal, Brier-FLSD as Brier) and a flag for
// FLSD-53's γ_i (uses_flsd_schedule), both set on the host: the schedule costs the rows of the other weights nothing
// but the flag's test, and Brier-FLSD's rows run Brier's code with γ_i in place of γ.
//
// Shape of the launch, chosen by C (the number of classes):
//   * C ≤ 1024:   a warp per row (8 rows per 256-thread block), the row held in registers, shuffle reductions only;
//   * C ≤ 4096:   a 256-thread block per row, the row held in registers (16 values per thread), warp shuffles + one
//                 shared-memory step; read once, gradient written once;
//   * larger C:   a 256-thread block per row streaming the row in 4096-column tiles: a statistics pass (the
//                 online-softmax state rescaled once per tile), then a gradient pass over the tiles in reverse order
//                 with evict-first loads and stores, so the tiles read last in the first pass (the likeliest still in
//                 L2) are re-read first and the gradient does not push the row out of L2. Small blocks keep several
//                 rows in flight per multiprocessor, which hides memory latency better than one register- or
//                 shared-memory-resident row of a 1024-thread block.
//   float64 (gradcheck/opcheck only) has the two warp paths and, above C = 1024, the streaming path (512 threads).
// Every path: 16-byte vector loads/stores for a row whose address is 16-byte aligned (a scalar fallback otherwise and
// for the row's tail), fp32 accumulation for fp16/bf16 (float64 stays float64, for gradcheck), exp2f, int64 offsets,
// any row stride, launched on the current stream with no host synchronisation. Every launch is the forward's whole
// work but for a large batch's count (batch_fold.cuh): each block of a small batch counts the mean's divisor itself,
// and the block that finishes last reduces the rows' losses and makes the target flag.
//
// Soft targets (label_smoothing, mix_target, or a floating (N, C) target) run a second kernel with the same launch
// shapes, so the hard-target kernel carries no soft-target code (soft_target_rows.cuh).
//
// Calls with a drop-in option (class weights, z-loss, soft-capping) run a third kernel, again with the same launch
// shapes (option_rows.cuh), so neither of the others carries option code.
//
// return_stats: each kernel has a second copy (kStats) that also writes the rows' top-label statistics, confidence
// and arg-max, taken in the row's first pass beside its online softmax (the arg-max's (value, index) pair all-reduced
// with the row's statistics), so that in place they are read before the gradient overwrites the row; the calls
// without them run the copy without their code.
//
// Files: row_statistics.cuh (what every row kernel shares), hard_target_rows.cuh, soft_target_rows.cuh and
// option_rows.cuh (the kernels), this file (the launch shape for C and the launches).
//
// Included by rows_<dtype>.cu, one translation unit per logits dtype (row_params.h), each of which defines the three
// launches, cuda_rows::launch_hard_targets, launch_soft_targets and launch_option_rows, for its dtype
// (CALIBKERNELS_CUDA_ROWS_FOR).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "batch_fold.cuh"
#include "hard_target_rows.cuh"
#include "option_rows.cuh"
#include "row_params.h"
#include "soft_target_rows.cuh"

namespace calibkernels {
namespace {

using cuda_rows::Acc;
using cuda_rows::BatchFold;
using cuda_rows::OptionParams;
using cuda_rows::Params;
using cuda_rows::SoftParams;

// Largest C of each path (float32/float16/bfloat16); float64 has only the warp and streaming paths.
constexpr int64_t kWarpSmallMaxC = 32 * 8;
constexpr int64_t kWarpMaxC = 32 * 32;
constexpr int64_t kBlock256MaxC = 256 * 16;

template <int kGroup_, int kPT_, bool kResident_>
struct Shape {
  static constexpr int kGroup = kGroup_;
  static constexpr int kPT = kPT_;
  static constexpr bool kResident = kResident_;
};

// Calls launch(Shape<kGroup, kPT, kResident>{}) with the launch shape of rows of C classes.
template <typename scalar_t, typename Launch>
void with_shape(int64_t C, Launch launch) {
  if (C <= kWarpSmallMaxC) {
    launch(Shape<32, 8, true>{});
  } else if (C <= kWarpMaxC) {
    launch(Shape<32, 32, true>{});
  } else if constexpr (std::is_same<scalar_t, double>::value) {
    launch(Shape<512, 8, false>{});  // 1024 threads would cap double at 64 registers and spill
  } else if (C <= kBlock256MaxC) {
    launch(Shape<256, 16, true>{});
  } else {
    launch(Shape<256, 16, false>{});
  }
}

// Calls launch(std::bool_constant<kStats>{}) with kStats whether the launch writes the rows' top-label statistics
// (return_stats): each row kernel has a copy without their code, which the calls without them run.
template <typename Launch>
void with_stats(const BatchFold& F, Launch launch) {
  if (F.confidence != nullptr) {
    launch(std::true_type{});
  } else {
    launch(std::false_type{});
  }
}

// Launches `kernel` (kGroup threads per row) over num_rows rows on the current stream.
template <int kGroup, typename KernelParams>
void launch_rows(void (*kernel)(KernelParams, BatchFold), int64_t num_rows, const KernelParams& params,
                 const BatchFold& fold) {
  constexpr int kRowsPerBlock = kGroup == 32 ? 8 : 1;
  constexpr int kThreads = kGroup * kRowsPerBlock;
  const int64_t blocks = (num_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "calibkernels::uncertainty_weighted_ce: too many rows");
  kernel<<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(params, fold);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename scalar_t, typename A>
void launch(const Params<A>& P, const BatchFold& F) {
  with_shape<scalar_t>(P.num_classes, [&](auto shape) {
    with_stats(F, [&](auto stats) {
      using S = decltype(shape);
      constexpr bool kStats = decltype(stats)::value;
      launch_rows<S::kGroup>(uncertainty_weighted_ce_kernel<scalar_t, S::kGroup, S::kPT, S::kResident, kStats>,
                             P.num_rows, P, F);
    });
  });
}

// target_t: int64_t (class indices) or a dense target's element type, float32 or the logits' (dense_target_for).
template <typename scalar_t, typename target_t, typename A>
void launch_soft(const SoftParams<A>& SP, const BatchFold& F) {
  with_shape<scalar_t>(SP.hard.num_classes, [&](auto shape) {
    with_stats(F, [&](auto stats) {
      using S = decltype(shape);
      constexpr bool kStats = decltype(stats)::value;
      launch_rows<S::kGroup>(soft_target_kernel<scalar_t, target_t, S::kGroup, S::kPT, S::kResident, kStats>,
                             SP.hard.num_rows, SP, F);
    });
  });
}

// A dense target in `target_dtype`: the logits' dtype, or float32 with 16-bit logits (dense_target_for).
template <typename scalar_t, typename A>
void launch_dense(const SoftParams<A>& SP, const BatchFold& F, at::ScalarType target_dtype) {
  if constexpr (std::is_same<scalar_t, float>::value || std::is_same<scalar_t, double>::value) {
    launch_soft<scalar_t, scalar_t>(SP, F);
  } else if (target_dtype == at::kFloat) {
    launch_soft<scalar_t, float>(SP, F);
  } else {
    launch_soft<scalar_t, scalar_t>(SP, F);
  }
}

// The option kernel (option_rows.cuh) for class indices (target_t int64_t) or a dense target of target_t.
template <typename scalar_t, typename target_t, typename A>
void launch_options_for(const OptionParams<A>& OP, const BatchFold& F) {
  with_shape<scalar_t>(OP.soft.hard.num_classes, [&](auto shape) {
    with_stats(F, [&](auto stats) {
      using S = decltype(shape);
      constexpr bool kStats = decltype(stats)::value;
      launch_rows<S::kGroup>(option_rows_kernel<scalar_t, target_t, S::kGroup, S::kPT, S::kResident, kStats>,
                             OP.soft.hard.num_rows, OP, F);
    });
  });
}

template <typename scalar_t, typename A>
void launch_options(const OptionParams<A>& OP, const BatchFold& F, at::ScalarType dense_dtype) {
  if (OP.soft.dense_target == nullptr) {
    launch_options_for<scalar_t, int64_t>(OP, F);
  } else if constexpr (std::is_same<scalar_t, float>::value || std::is_same<scalar_t, double>::value) {
    launch_options_for<scalar_t, scalar_t>(OP, F);
  } else if (dense_dtype == at::kFloat) {
    launch_options_for<scalar_t, float>(OP, F);
  } else {
    launch_options_for<scalar_t, scalar_t>(OP, F);
  }
}

}  // namespace
}  // namespace calibkernels

// The three launches for logits of type T (row_params.h), each defined once: the whole of rows_<dtype>.cu.
#define CALIBKERNELS_CUDA_ROWS_FOR(T)                                                                             \
  void calibkernels::cuda_rows::launch_hard_targets(Logits<T>, const Params<Acc<T>>& P, const BatchFold& F) {     \
    launch<T>(P, F);                                                                                              \
  }                                                                                                               \
  void calibkernels::cuda_rows::launch_soft_targets(Logits<T>, const SoftParams<Acc<T>>& SP, const BatchFold& F,  \
                                                    at::ScalarType dense_dtype) {                                 \
    if (SP.dense_target != nullptr) {                                                                             \
      launch_dense<T>(SP, F, dense_dtype);                                                                        \
    } else {                                                                                                      \
      launch_soft<T, int64_t>(SP, F);                                                                             \
    }                                                                                                             \
  }                                                                                                               \
  void calibkernels::cuda_rows::launch_option_rows(Logits<T>, const OptionParams<Acc<T>>& OP, const BatchFold& F, \
                                                   at::ScalarType dense_dtype) {                                  \
    launch_options<T>(OP, F, dense_dtype);                                                                        \
  }
