// What turns a launch of row kernels (row_kernels.cuh) into the whole forward: the mean's divisor, counted by every
// block of a small batch before its rows (no count launch before the row launch), and the batch's fold, made after
// its rows by the block that finishes last (a ticket drawn from a counter): the loss (the rows' mean or sum), the op's
// target flag, and the counter's reset for the next launch on the stream. Also the scan of class-index targets that
// the count launch of a large batch (uncertainty_weighted_ce.cu) shares with the fold.
//
// The ticket: each block's threads meet at a barrier, then its first thread fences (__threadfence) and adds 1 to the
// counter; the block that draws gridDim.x - 1 fences again, and its threads read the other blocks' row losses and
// flags past L1 (__ldcg). This is the order cooperative_groups' grid barrier relies on; the fences are cumulative over
// the barrier, so every thread's stores of a block precede its ticket.
#pragma once

#include <cstdint>
#include <limits>

#include "block_reduce.cuh"
#include "row_params.h"
#include "uncertainty_weighted_ce.h"

namespace calibkernels {
namespace {

using cuda_rows::BatchFold;
using cuda_rows::Params;

// A scan of class-index targets by a block of kThreads threads (every thread takes rows t, t + kThreads, ...): how
// many are not ignore_index (the mean's divisor) and, with `check`, how many are neither ignore_index nor a class
// (bad) and the largest such value (std::numeric_limits<int64_t>::min() when none is).
struct TargetScan {
  int64_t valid, bad, worst;
};

// A mix's scan (scan_mix): the first row whose mix_target is not a class where its target is not ignore_index, its
// value, and the first row whose λ is outside [0, 1] or NaN (num_rows where none is).
struct MixScan {
  int64_t mix_row, mix_value, lambda_row;
};

// The op's target flag (2,) of class indices: (TargetFlag, value), the first bad of: a target (the largest bad
// value), a mix_target (the first bad row's value), a λ (its first bad row); (TargetFlag::None, the scan's `worst`)
// when none is.
__device__ __forceinline__ void store_target_flag(int64_t* flag, const TargetScan& scan, const MixScan& mix,
                                                  int64_t num_rows) {
  TargetFlag code = TargetFlag::None;
  int64_t value = scan.worst;
  if (scan.bad > 0) {
    code = TargetFlag::Target;
  } else if (mix.mix_row < num_rows) {
    code = TargetFlag::MixTarget;
    value = mix.mix_value;
  } else if (mix.lambda_row < num_rows) {
    code = TargetFlag::MixLambda;
    value = mix.lambda_row;
  }
  flag[0] = static_cast<int64_t>(code);
  flag[1] = value;
}

template <int kThreads>
__device__ __forceinline__ TargetScan scan_targets(const int64_t* target, int64_t num_rows, int64_t num_classes,
                                                   int64_t ignore_index, bool check) {
  __shared__ long long worst;  // atomicMax has no overload for int64_t (long) on LP64
  if (check) {                 // uniform over the block
    if (threadIdx.x == 0) worst = std::numeric_limits<long long>::min();
    __syncthreads();
  }
  int64_t valid = 0, bad = 0;
#pragma unroll 8
  for (int64_t i = threadIdx.x; i < num_rows; i += kThreads) {
    const int64_t y = target[i];
    const bool ignored = y == ignore_index;
    valid += ignored ? 0 : 1;
    if (check && !ignored && (y < 0 || y >= num_classes)) {
      ++bad;
      atomicMax(&worst, static_cast<long long>(y));
    }
  }
  // group_sum's barrier orders every atomicMax before the reads of `worst`
  const Sums<int64_t, 2> total = group_sum<kThreads>(Sums<int64_t, 2>{{valid, bad}});
  return {total.v[0], total.v[1], check ? static_cast<int64_t>(worst) : std::numeric_limits<int64_t>::min()};
}

// Whether a mix weight λ is outside [0, 1] or NaN (NaN fails both comparisons): the row's NaN (soft_row) and the
// target flag (scan_mix) test the same condition.
template <typename A>
__device__ __forceinline__ bool lambda_out_of_range(A lambda) {
  return !(lambda >= A(0) && lambda <= A(1));
}

// The scan of a mix by a block of kThreads threads, as the host checks read it: mix_target on the rows whose target
// is not ignore_index, λ = lambda[i * lambda_stride] on every row (in the accumulation type, into which the op's
// wrapper converts a float64 λ so that a value outside [0, 1] stays outside). Every thread of the block calls it.
// Not inlined: its state beside the fold's made ptxas spill in the soft kernels' row code (where registers are capped
// by the launch bounds); as a call it costs the launch's last block a call and a second read of the targets (from
// L2), and the other blocks nothing.
template <int kThreads, typename A>
__device__ __noinline__ MixScan scan_mix(const int64_t* target, const int64_t* mix, const A* lambda,
                                         int64_t lambda_stride, int64_t num_rows, int64_t num_classes,
                                         int64_t ignore_index) {
  __shared__ long long first_mix, first_lambda;  // atomicMin has no overload for int64_t (long) on LP64
  if (threadIdx.x == 0) first_mix = first_lambda = static_cast<long long>(num_rows);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < num_rows; i += kThreads) {
    const int64_t m = mix[i];
    if (target[i] != ignore_index && (m < 0 || m >= num_classes)) atomicMin(&first_mix, static_cast<long long>(i));
    if (lambda_out_of_range(lambda[i * lambda_stride])) atomicMin(&first_lambda, static_cast<long long>(i));
  }
  __syncthreads();
  const MixScan scan{static_cast<int64_t>(first_mix), 0, static_cast<int64_t>(first_lambda)};
  __syncthreads();  // every thread has read them before a later call of this block resets them
  return {scan.mix_row, scan.mix_row < num_rows ? mix[scan.mix_row] : 0, scan.lambda_row};
}

// The block's count of non-ignored targets where it counts them itself (Params::count_inline), for its rows'
// gradient scale.
__device__ __forceinline__ int64_t& inline_count() {
  __shared__ int64_t count;
  return count;
}

// The mean's divisor: the non-ignored rows (the block's own count, or the count launch's), or every row (a dense
// target); at least 1, so that a batch of ignored rows has a loss of 0, never NaN.
template <typename A>
__device__ __forceinline__ int64_t mean_divisor(const Params<A>& P) {
  const int64_t count = P.count_inline ? inline_count() : (P.valid_count != nullptr ? *P.valid_count : P.num_rows);
  return count > 1 ? count : int64_t(1);
}

// The start of every block of a row launch, before its rows: with count_inline, a mean's gradient scale needs the
// count before any row is written, so each block counts the targets itself (N ≤ kInlineCountMaxRows: at most 8 KiB
// of targets per block, from L2).
template <int kThreads, typename A>
__device__ __forceinline__ void begin_rows(const Params<A>& P) {
  if (P.count_inline && P.grad != nullptr && P.reduction == static_cast<int>(Reduction::Mean)) {  // uniform
    const TargetScan scan = scan_targets<kThreads>(P.target, P.num_rows, P.num_classes, P.ignore_index, false);
    if (threadIdx.x == 0) inline_count() = scan.valid;
    __syncthreads();
  }
}

// A dense target's row flags folded into the op's target flag: (whether some row is flagged, the first flagged row,
// num_rows if none), as calibkernels._validation.first_flagged_row makes it.
template <int kThreads>
__device__ __forceinline__ void fold_row_flags(const int8_t* row_flags, int64_t num_rows, int64_t* flag) {
  __shared__ long long first;  // atomicMin has no overload for int64_t (long) on LP64
  if (threadIdx.x == 0) first = static_cast<long long>(num_rows);
  __syncthreads();
  for (int64_t i = threadIdx.x; i < num_rows; i += kThreads) {
    if (__ldcg(reinterpret_cast<const signed char*>(row_flags) + i) != 0) {
      atomicMin(&first, static_cast<long long>(i));
      break;  // a thread's later rows come after this one
    }
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    flag[0] = first < num_rows ? 1 : 0;
    flag[1] = static_cast<int64_t>(first);
  }
}

// Entry i of a loss output of the op: A, or the logits' type with loss_in_logits_dtype.
template <typename scalar_t, typename A>
__device__ __forceinline__ void store_loss(const Params<A>& P, void* out, int64_t i, A value) {
  if (P.loss_in_logits_dtype) {
    static_cast<scalar_t*>(out)[i] = static_cast<scalar_t>(value);
  } else {
    static_cast<A*>(out)[i] = value;
  }
}

// A row's loss L_i into row_loss: A where the fold reduces the rows (mean, sum), or as the op's output ("none").
template <typename scalar_t, typename A>
__device__ __forceinline__ void store_row_loss(const Params<A>& P, int64_t row, A value) {
  if (P.reduction == static_cast<int>(Reduction::None)) {
    store_loss<scalar_t>(P, P.row_loss, row, value);
  } else {
    static_cast<A*>(P.row_loss)[row] = value;
  }
}

// The end of every block of a row launch, after its rows (every thread of the block calls it; none may have left the
// kernel). The last block to finish folds the batch:
//   * the loss (F.loss): Σ_i L_i over row_loss in a fixed order (thread t takes rows t, t + kThreads, ..., then the
//     block's tree), so the loss is reproducible bit for bit; ÷ the mean's divisor for the mean;
//   * count_inline: the targets' flag (store_target_flag; with a mix, `mix_target` not nullptr, its values checked
//     too) into F.target_flag, and the divisor (the block's inline_count, which a launch without a gradient has not
//     counted before its rows);
//   * row_flags (the soft kernel's, of a dense target; nullptr otherwise): the target's flag into F.target_flag;
// then resets the ticket counter to 0.
template <int kThreads, typename scalar_t, typename A>
__device__ __forceinline__ void finish_rows(const Params<A>& P, const BatchFold& F, const int8_t* row_flags,
                                            const int64_t* mix_target = nullptr, const A* mix_lambda = nullptr,
                                            int64_t lambda_stride = 0) {
  __shared__ bool last;
  __syncthreads();  // the block's row losses and flags are stored
  if (threadIdx.x == 0) {
    __threadfence();  // ... and visible to the device before the ticket
    last = atomicAdd(F.ticket, 1u) == gridDim.x - 1;
    if (last) __threadfence();  // the other blocks' stores, ordered before their tickets, before the reads below
  }
  __syncthreads();
  if (!last) return;
  if (P.count_inline) {
    const TargetScan scan = scan_targets<kThreads>(P.target, P.num_rows, P.num_classes, P.ignore_index, true);
    MixScan mix{P.num_rows, 0, P.num_rows};
    if (mix_target != nullptr) {  // uniform over the block
      mix = scan_mix<kThreads>(P.target, mix_target, mix_lambda, lambda_stride, P.num_rows, P.num_classes,
                               P.ignore_index);
    }
    if (threadIdx.x == 0) {  // the thread that divides below: the count needs no barrier
      store_target_flag(F.target_flag, scan, mix, P.num_rows);
      inline_count() = scan.valid;
    }
  }
  if (F.loss != nullptr) {
    A total = A(0);
#pragma unroll 8
    for (int64_t i = threadIdx.x; i < P.num_rows; i += kThreads) total += __ldcg(static_cast<const A*>(P.row_loss) + i);
    total = group_sum<kThreads>(Sums<A, 1>{{total}}).v[0];
    if (threadIdx.x == 0) {
      const bool mean = P.reduction == static_cast<int>(Reduction::Mean);
      store_loss<scalar_t>(P, F.loss, 0, mean ? total / static_cast<A>(mean_divisor(P)) : total);
    }
  }
  if (row_flags != nullptr) fold_row_flags<kThreads>(row_flags, P.num_rows, F.target_flag);
  if (threadIdx.x == 0) *F.ticket = 0u;
}

}  // namespace
}  // namespace calibkernels
