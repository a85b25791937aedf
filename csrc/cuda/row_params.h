// The parameters of the CUDA row kernels (row_kernels.cuh) as the op's host side (uncertainty_weighted_ce.cu) fills
// them, and the two launches it calls. Each logits dtype's kernels are instantiated in a translation unit of their
// own (rows_float.cu, rows_half.cu, rows_bfloat16.cu, rows_double.cu), so that a parallel build (MAX_JOBS) compiles
// them side by side instead of in one long nvcc process.
#pragma once

#include <c10/core/ScalarType.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <type_traits>

namespace calibkernels {
namespace cuda_rows {

// The accumulation type of a logits dtype: float64 stays float64 (gradcheck), the others accumulate in float32.
template <typename scalar_t>
using Acc = typename std::conditional<std::is_same<scalar_t, double>::value, double, float>::type;

template <typename A>
struct Params {
  const void* logits;
  int64_t logits_row_stride;  // elements
  void* grad;                 // nullptr: no gradient (inference)
  int64_t grad_row_stride;
  const int64_t* target;
  const A* sample_weight;      // (N,) or nullptr
  const A* gamma_per_sample;   // (N,) or nullptr
  const int64_t* valid_count;  // 0-dim, the count launch's (a large batch's mean with a gradient); nullptr: see
                               // count_inline, else every row counts (a dense target)
  void* row_loss;              // (N,) A, or the logits' type for reduction "none" with loss_in_logits_dtype
  int64_t num_rows;
  int64_t num_classes;
  int64_t ignore_index;
  A gamma;
  A norm;
  int weight;  // the weight's formula (weight_formula of the op's code), which the kernels branch on
  int mode;
  int reduction;
  bool flsd_schedule;  // γ_i from FLSD-53's band (uses_flsd_schedule of the op's code) instead of `gamma`
  bool count_inline;   // class indices without a count launch: each block counts the mean's divisor itself (where
                       // its rows need it), and the last block checks the targets into BatchFold::target_flag
  bool loss_in_logits_dtype;  // the op's losses in the logits' type (rounded once, from A)
};

// Params stays within 128 bytes: past that, nvcc reads the kernel argument through its address and makes none of the
// specialised copies of the streaming path's column loops (β = 0, q = 2, no ties), so every tile runs the general
// loop's extra instructions.
static_assert(sizeof(Params<float>) <= 128 && sizeof(Params<double>) <= 128,
              "Params past 128 bytes loses the column loops' specialised copies: put new fields in BatchFold");

// The batch's fold by the launch's last block (batch_fold.cuh), which makes the row launch the forward's only one;
// a kernel argument of its own, beside Params.
struct BatchFold {
  unsigned int* ticket;  // the launch's ticket counter: 0 before the launch, and reset to 0 by the last block
  void* loss;            // 0-dim, the mean or sum (A, or the logits' type with loss_in_logits_dtype); nullptr for
                         // reduction "none" (the rows' losses are the result)
  int64_t* target_flag;  // (2,): the op's target flag, made by the last block (count_inline or a dense target's row
                         // flags); or nullptr where the count launch or host-side ATen ops made it
  float* confidence;     // (N,): the rows' top-label confidence (return_stats), written in the rows' first pass; or
                         // nullptr: not asked for, and the launch runs the kernels without the statistics' code
  int64_t* prediction;   // (N,): their arg-max, -1 on an ignored row; set with `confidence`
};

template <typename A>
struct SoftParams {
  Params<A> hard;             // `target` holds the class indices (compact form); nullptr with a dense target
  const int64_t* mix_target;  // (N,), or nullptr: no mix (λ = 1, m = y)
  const A* mix_lambda;        // λ of row i at mix_lambda[i * lambda_stride] (stride 0: one λ for every row)
  int64_t lambda_stride;
  const void* dense_target;  // (N, C) in the kernel's target_t, columns contiguous; nullptr for class indices
  int64_t dense_row_stride;  // elements
  A smoothing;               // a
  A dense_tolerance;         // how far a row's sum may be off 1 (dense_row_sum_tolerance of the target's dtype)
  int8_t* row_flags;         // (N,): a dense target's row flags, 1 where a row fails its value check (written by
                             // the rows, folded into BatchFold::target_flag by the last block), or nullptr
};

// The option kernel's parameters (option_rows.cuh): the drop-in options (class weights, z-loss, soft-capping) over
// the soft kernel's rows, class indices without smoothing or a mix being the compact row with c = 0 and w_y = 1.
template <typename A>
struct OptionParams {
  SoftParams<A> soft;
  const A* class_weight;  // (C,) in A, or nullptr: every w_k = 1
  const A* divisors;      // a mean's [D, count] (D: Σ <w, t̄_i> over the non-ignored rows, or count without class
                          // weights; count: the non-ignored rows), device values; nullptr: [N, N] (a dense target)
  A* z_loss;              // (N,): the rows' s · lse², or nullptr where s = 0
  A lse_square_scale;     // s
  A softcap;              // c > 0, or 0: no cap
};

// A logits dtype as an overload tag: the launches of each dtype are plain functions, each defined once, in the
// dtype's rows_<dtype>.cu (CALIBKERNELS_CUDA_ROWS_FOR in row_kernels.cuh), and called by the op's dtype dispatch.
template <typename scalar_t>
struct Logits {};

// Launches the kernel of hard targets (class indices, no smoothing, no mix) over P's rows, on the current stream.
void launch_hard_targets(Logits<float>, const Params<float>& P, const BatchFold& F);
void launch_hard_targets(Logits<c10::Half>, const Params<float>& P, const BatchFold& F);
void launch_hard_targets(Logits<c10::BFloat16>, const Params<float>& P, const BatchFold& F);
void launch_hard_targets(Logits<double>, const Params<double>& P, const BatchFold& F);

// Launches the soft-target kernel over SP's rows, on the current stream: class indices with smoothing or a mix
// (SP.dense_target == nullptr), or a dense target whose elements are of `dense_dtype`.
void launch_soft_targets(Logits<float>, const SoftParams<float>& SP, const BatchFold& F, c10::ScalarType dense_dtype);
void launch_soft_targets(Logits<c10::Half>, const SoftParams<float>& SP, const BatchFold& F,
                         c10::ScalarType dense_dtype);
void launch_soft_targets(Logits<c10::BFloat16>, const SoftParams<float>& SP, const BatchFold& F,
                         c10::ScalarType dense_dtype);
void launch_soft_targets(Logits<double>, const SoftParams<double>& SP, const BatchFold& F, c10::ScalarType dense_dtype);

// Launches the option kernel over OP's rows, on the current stream: class indices (OP.soft.dense_target == nullptr;
// with or without smoothing and a mix) or a dense target whose elements are of `dense_dtype`.
void launch_option_rows(Logits<float>, const OptionParams<float>& OP, const BatchFold& F, c10::ScalarType dense_dtype);
void launch_option_rows(Logits<c10::Half>, const OptionParams<float>& OP, const BatchFold& F,
                        c10::ScalarType dense_dtype);
void launch_option_rows(Logits<c10::BFloat16>, const OptionParams<float>& OP, const BatchFold& F,
                        c10::ScalarType dense_dtype);
void launch_option_rows(Logits<double>, const OptionParams<double>& OP, const BatchFold& F,
                        c10::ScalarType dense_dtype);

}  // namespace cuda_rows
}  // namespace calibkernels
