// The option kernel, option_rows_kernel: the drop-in options of F.cross_entropy / Liger-Kernel (class weights w,
// the z-loss s · lse², soft-capping z' = c · tanh(z / c)) over any row target, launched by row_kernels.cuh with the
// hard-target kernel's launch shapes for the calls that ask for an option; the other calls never reach it, so the
// hard and soft kernels carry no option code. Per row, with t the unweighted target distribution (class indices as
// the compact row c = 0, W_y = 1; smoothing and a mix as in soft_target_rows.cuh; a dense target as read there),
// t' = w ⊙ t, W = Σ_k t'_k, p = softmax(z'), lse = logsumexp(z'):
//   L_i = u_i · CE_i^w + s · lse²,  CE_i^w = Σ_k t'_k (lse - z'_k),  u_i from t (csrc/uncertainty_weights.h);
//   dL_i/dz'_k = [u (W p_k - t'_k) + CE^w du/dz'_k] / D + 2 s lse p_k / count  ("mean"; 1 for a sum or "none"),
//   dL_i/dz_k  = dL_i/dz'_k · (1 - (z'_k / c)²).
// D is the mean's divisor of the weighted part (Σ_i <w, t̄_i> over the non-ignored rows, t̄ the target before
// smoothing; N for a dense target; the count without class weights), computed by device ops before the launch;
// a mean whose D is 0 is 0. Three passes over a row: max and Σ e of z' (the hard path's online softmax over every
// column), the target's sums, the gradient; a streamed row re-reads (and re-caps) its logits in each, a
// register-resident one keeps z' and t. W p_k - t'_k is taken as W (p_k - t_k) + (W t_k - t'_k), p - t of a unique
// max as (1 - t_max) - Σ_{k≠max} p_k, so that a confident class keeps its digits as in the dense soft rows.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "batch_fold.cuh"
#include "block_reduce.cuh"
#include "row_params.h"
#include "row_statistics.cuh"
#include "soft_target_rows.cuh"
#include "uncertainty_weighted_ce.h"
#include "uncertainty_weights.h"

namespace calibkernels {
namespace {

using cuda_rows::OptionParams;

__device__ __forceinline__ float tanh_(float x) { return tanhf(x); }
__device__ __forceinline__ double tanh_(double x) { return tanh(x); }

// z' = c tanh(z / c) of the columns < C of a thread's tile (the padding stays -inf: it is no class, where a -inf
// logit becomes -c); c = 0: no cap.
template <typename scalar_t, int kGroup, int kPT, typename A>
__device__ __forceinline__ void cap_tile(A (&z)[kPT], int64_t base, int lane, int64_t C, A softcap) {
  if (softcap == A(0)) return;
  using T = Tile<scalar_t, A, kGroup, kPT>;
#pragma unroll
  for (int e = 0; e < kPT; ++e) {
    if (T::column(base, lane, e) < C) z[e] = softcap * tanh_(z[e] / softcap);
  }
}

template <typename A>
__device__ __forceinline__ A capped(A z, A softcap) {
  return softcap == A(0) ? z : softcap * tanh_(z / softcap);
}

// A compact row's target t_k = c + W_y [k=y] + W_m [k=m] (W_m = 0 where m = y), in a Tile's layout, 0 on the padding.
template <typename A>
struct CompactTarget {
  int64_t y, mix;
  A c, W_y, W_m;
};

template <typename scalar_t, int kGroup, int kPT, typename A>
__device__ __forceinline__ void compact_target_tile(const CompactTarget<A>& ct, int64_t base, int lane, int64_t C,
                                                    A (&t)[kPT]) {
  using T = Tile<scalar_t, A, kGroup, kPT>;
#pragma unroll
  for (int e = 0; e < kPT; ++e) {
    const int64_t col = T::column(base, lane, e);
    t[e] = col < C ? (ct.c + (col == ct.y ? ct.W_y : A(0))) + (col == ct.mix ? ct.W_m : A(0)) : A(0);
  }
}

// t'_k = w_k t_k of column `col` (< C wherever t ≠ 0); a 0 target reads no weight.
template <typename A>
__device__ __forceinline__ A class_weighted(const OptionParams<A>& O, A t, int64_t col) {
  return (O.class_weight == nullptr || t == A(0)) ? t : t * O.class_weight[col];
}

// The gradient's factors for grad_output = 1: the weighted part's 1 / D and the z-loss's 1 / count for a mean (a D
// of 0 gives 0, a count of 0 is taken as 1), else 1.
template <typename A>
__device__ __forceinline__ A weighted_divisor(const OptionParams<A>& O) {
  return O.divisors != nullptr ? O.divisors[0] : static_cast<A>(O.soft.hard.num_rows);
}
template <typename A>
__device__ __forceinline__ A z_loss_divisor(const OptionParams<A>& O) {
  const A count = O.divisors != nullptr ? O.divisors[1] : static_cast<A>(O.soft.hard.num_rows);
  return count > A(1) ? count : A(1);
}
template <typename A>
__device__ __forceinline__ bool option_mean(const OptionParams<A>& O) {
  return O.soft.hard.reduction == static_cast<int>(Reduction::Mean);
}

// A row's losses: the z-loss into O.z_loss, and into row_loss the whole L_i for "none", else u · CE^w alone (the
// fold adds the z-loss with its own divisor).
template <typename scalar_t, typename A>
__device__ __forceinline__ void store_option_loss(const OptionParams<A>& O, int64_t row, A weighted_ce, A z_loss) {
  const Params<A>& P = O.soft.hard;
  if (O.z_loss != nullptr) O.z_loss[row] = z_loss;
  store_row_loss<scalar_t>(P, row,
                           P.reduction == static_cast<int>(Reduction::None) ? weighted_ce + z_loss : weighted_ce);
}

// An ignored (0) or invalid (NaN) row: its losses and gradient row, without reading the logits.
template <int kGroup, typename scalar_t, typename A>
__device__ __forceinline__ void option_fill_row(const OptionParams<A>& O, int64_t row, int lane, scalar_t* grad_row,
                                                A fill) {
  if (lane == 0) store_option_loss<scalar_t>(O, row, fill, fill);
  if (grad_row != nullptr) {
    for (int64_t c = lane; c < O.soft.hard.num_classes; c += kGroup) grad_row[c] = static_cast<scalar_t>(fill);
  }
}

// What the second pass sums over a row.
enum OptionSum { kWeightedSum, kGap, kOneMinusP, kP, kRest, kS, kH, kTargetAtMax, kCheckSum, kNumOptionSums };

// One row with options. load_target(base, t, check) fills the tile's unweighted target (check: a dense target's value
// check, or nullptr); band(lse, P) is FLSD's band value of the row. Pass 1: M and d of z' over every column (kStats:
// and the top label of z', the row's top-label statistics into F's). Pass 2: W, Σ t' (M - z'), 1 - P, P, gBS's S and
// τ or H, with a unique max's terms taken after the pass. Pass 3: the gradient.
template <typename scalar_t, int kGroup, int kPT, bool kResident, bool kStats, typename A, typename LoadTarget,
          typename Band>
__device__ __forceinline__ void option_row(const OptionParams<A>& O, const BatchFold& F, int64_t row, int lane,
                                           scalar_t* grad_row, LoadTarget load_target, Band band) {
  using T = Tile<scalar_t, A, kGroup, kPT>;
  constexpr int64_t kTileCols = static_cast<int64_t>(kGroup) * kPT;
  const Params<A>& P = O.soft.hard;
  const int64_t C = P.num_classes;
  const A q = P.norm;
  const bool brier = P.weight == static_cast<int>(Weight::Brier);
  const bool square = q == A(2);
  const scalar_t* z_row = static_cast<const scalar_t*>(P.logits) + row * P.logits_row_stride;
  const bool in_aligned = aligned16(z_row);
  const bool out_aligned = grad_row != nullptr && aligned16(grad_row);

  Stats<A> s = empty_stats<A>();
  TopLabel<A> best = empty_top_label<A>();
  A z[kPT], t[kPT];
  TargetCheck<A> check;  // in the target's first read: pass 1 of a resident row, pass 2 of a streamed one
  for_each_tile<kResident, kTileCols>(C, false, [&](int64_t base) {
    T::load(z_row, in_aligned, base, lane, C, z);
    cap_tile<scalar_t, kGroup, kPT>(z, base, lane, C, O.softcap);
    if constexpr (kResident) load_target(base, t, &check);
    const auto column_of = [&](int e) { return T::column(base, lane, e); };
    accumulate(z, column_of, C, int64_t(-1), A(0), q, false, false, s);
    track_top_label<kStats>(z, column_of, best);
  });
  if constexpr (kGroup == 32) __syncwarp();  // every read of the row before any write (in place)
  s = group_allreduce<kGroup, kStats>(s, q, false, false, best);
  const A M = s.m, log_d = log_(s.d);
  store_top_label_at<kStats>(F, row, lane, best, s.d);
  const bool unique_max = s.d < A(2);

  Sums<A, kNumOptionSums> r{};
  for_each_tile<kResident, kTileCols>(C, true, [&](int64_t base) {
    if constexpr (!kResident) {
      T::load(z_row, in_aligned, base, lane, C, z);
      cap_tile<scalar_t, kGroup, kPT>(z, base, lane, C, O.softcap);
      load_target(base, t, &check);
    }
#pragma unroll
    for (int e = 0; e < kPT; ++e) {
      const A p = exp_((z[e] - M) - log_d);  // 0 on the padding, where t = 0
      const A tw = class_weighted(O, t[e], T::column(base, lane, e));
      r.v[kWeightedSum] += tw;
      r.v[kP] += t[e] * p;
      if (tw != A(0)) r.v[kGap] += tw * (M - z[e]);  // a 0 weight takes no part, also at z' = -inf
      if (unique_max && z[e] == M) {
        r.v[kTargetAtMax] += t[e];
        continue;
      }
      r.v[kRest] += p;
      r.v[kOneMinusP] += t[e] * (A(1) - p);
      if (brier) add_brier_terms(p, p - t[e], q, square, r.v[kS], r.v[kH]);
    }
  });
  r.v[kCheckSum] = check.sum;
  r = group_sum<kGroup>(r);
  if (O.soft.row_flags != nullptr && lane == 0) {
    const A off = r.v[kCheckSum] - A(1);
    O.soft.row_flags[row] = (off < A(0) ? -off : off) <= O.soft.dense_tolerance ? 0 : 1;  // NaN: flagged
  }
  const A rest = r.v[kRest];  // 1 - p_max of a unique max
  const A d_max = (A(1) - r.v[kTargetAtMax]) - rest;
  A omP = r.v[kOneMinusP], S = r.v[kS], H = r.v[kH];
  if (unique_max) {
    omP += r.v[kTargetAtMax] * rest;
    if (brier) add_brier_terms(exp_(-log_d), d_max, q, square, S, H);
  }
  const A W = r.v[kWeightedSum];
  const A ce = r.v[kGap] + W * log_d;
  const A lse = M + log_d;
  const A s_z = O.lse_square_scale;
  SoftRowQuantities<A> rq{omP, r.v[kP], ce, A(0), q, A(1), S, H};
  rq.gamma = row_gamma(P, row, [&] { return band(lse, r.v[kP]); });
  if (static_cast<Weight>(P.weight) == Weight::External) rq.external = P.sample_weight[row];
  const SoftCoefficients<A> cf =
      soft_weight_coefficients(static_cast<Weight>(P.weight), P.mode == static_cast<int>(Mode::Loss), rq, square);
  if (lane == 0) store_option_loss<scalar_t>(O, row, cf.u * ce, s_z != A(0) ? s_z * lse * lse : A(0));
  if (grad_row == nullptr) return;

  const bool mean = option_mean(O);
  const A divisor = weighted_divisor(O);
  const A scale = mean ? (divisor > A(0) ? A(1) / divisor : A(0)) : A(1);
  const A z_coef = s_z != A(0) ? A(2) * s_z * lse / (mean ? z_loss_divisor(O) : A(1)) : A(0);
  SoftCoefficients<A> loss_terms = cf;  // CE^w du/dz' alone
  loss_terms.u = A(0);
  for_each_tile<kResident, kTileCols>(C, false, [&](int64_t base) {
    if constexpr (!kResident) {
      T::template load<true>(z_row, in_aligned, base, lane, C, z);
      cap_tile<scalar_t, kGroup, kPT>(z, base, lane, C, O.softcap);
      load_target(base, t, nullptr);
    }
#pragma unroll
    for (int e = 0; e < kPT; ++e) {
      const A p = exp_((z[e] - M) - log_d);
      const A tw = class_weighted(O, t[e], T::column(base, lane, e));
      const A delta = (unique_max && z[e] == M) ? d_max : p - t[e];
      const A g = cf.u * (W * delta + (W * t[e] - tw)) + soft_gradient_element(loss_terms, p, t[e], delta, q);
      A dz = g * scale + z_coef * p;
      if (O.softcap != A(0)) {
        const A ratio = z[e] / O.softcap;
        dz *= A(1) - ratio * ratio;
      }
      z[e] = dz;
    }
    T::store(grad_row, out_aligned, base, lane, C, z);
  });
}

// One row of the option launch (the block's share): target_t is int64_t for class indices (compact rows), else
// the element type of the dense target. kStats: the rows' top-label statistics (of the capped logits) into F's.
template <typename scalar_t, typename target_t, int kGroup, int kPT, bool kResident, bool kStats>
__device__ __forceinline__ void option_block_row(const OptionParams<Acc<scalar_t>>& O, const BatchFold& F) {
  using A = Acc<scalar_t>;
  constexpr int kRowsPerBlock = kGroup == 32 ? 8 : 1;
  const SoftParams<A>& SP = O.soft;
  const Params<A>& P = SP.hard;
  const int lane = kGroup == 32 ? (threadIdx.x & 31) : threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (kGroup == 32 ? (threadIdx.x >> 5) : 0);
  if (row >= P.num_rows) return;  // uniform over the row's group
  scalar_t* grad_row = P.grad != nullptr ? static_cast<scalar_t*>(P.grad) + row * P.grad_row_stride : nullptr;
  const int64_t C = P.num_classes;
  if constexpr (std::is_same<target_t, int64_t>::value) {
    const int64_t y = P.target[row];
    if (y == P.ignore_index) {  // whatever its mix_target
      if constexpr (kStats) {
        if (lane == 0) store_ignored_top_label(F, row);
      }
      option_fill_row<kGroup>(O, row, lane, grad_row, A(0));
      return;
    }
    const int64_t mix = SP.mix_target != nullptr ? SP.mix_target[row] : y;
    const A lambda = SP.mix_target != nullptr ? SP.mix_lambda[row * SP.lambda_stride] : A(1);
    // a bad target or mix_target is never used as an index; a λ outside [0, 1] (or NaN) makes the row NaN too
    if (y < 0 || y >= C || mix < 0 || mix >= C || lambda_out_of_range(lambda)) {
      if constexpr (kStats) {
        const scalar_t* z_row = static_cast<const scalar_t*>(P.logits) + row * P.logits_row_stride;
        top_label_only<scalar_t, kGroup, kPT, A>(F, z_row, row, C, lane, [&](A(&z)[kPT], int64_t base) {
          cap_tile<scalar_t, kGroup, kPT>(z, base, lane, C, O.softcap);
        });
      }
      option_fill_row<kGroup>(O, row, lane, grad_row, std::numeric_limits<A>::quiet_NaN());
      return;
    }
    const A a = SP.smoothing;
    const A c = a / static_cast<A>(C);
    const A w_y = (A(1) - a) * lambda, w_m = (A(1) - a) * (A(1) - lambda);
    const bool two = mix != y;  // a mix onto y itself merges its weight into y's
    const CompactTarget<A> ct{y, mix, c, two ? w_y : w_y + w_m, two ? w_m : A(0)};
    A z_y = A(0), z_m = A(0);  // FLSD's band (the compact closed form) only; read before any write of the row
    if (P.flsd_schedule) {
      const scalar_t* z_row = static_cast<const scalar_t*>(P.logits) + row * P.logits_row_stride;
      z_y = capped(static_cast<A>(z_row[y]), O.softcap);
      z_m = capped(static_cast<A>(z_row[mix]), O.softcap);
    }
    option_row<scalar_t, kGroup, kPT, kResident, kStats>(
        O, F, row, lane, grad_row,
        [&](int64_t base, A(&t)[kPT], TargetCheck<A>*) {
          compact_target_tile<scalar_t, kGroup, kPT>(ct, base, lane, C, t);
        },
        [&](A lse, A) { return soft_flsd_band_probability(z_y, z_m, lse, w_y, w_m, c); });
  } else {
    using TT = TargetTile<scalar_t, target_t, A, kGroup, kPT>;
    const target_t* t_row = static_cast<const target_t*>(SP.dense_target) + row * SP.dense_row_stride;
    const bool t_aligned = aligned16(t_row);
    const A keep = A(1) - SP.smoothing, add = SP.smoothing / static_cast<A>(C);
    option_row<scalar_t, kGroup, kPT, kResident, kStats>(
        O, F, row, lane, grad_row,
        [&](int64_t base, A(&t)[kPT], TargetCheck<A>* check) {
          TT::load(t_row, t_aligned, base, lane, C, keep, add, t, check);
        },
        [](A, A P_row) { return static_cast<float>(P_row); });
  }
}

// The end of every block of the option launch (every thread of the block calls it), as finish_rows (batch_fold.cuh)
// with the options' fold: the last block makes the target flag (class indices: the targets and a mix scanned; a
// dense target: its row flags) and the loss, Σ u · CE^w / D + Σ s lse² / count for a mean (a D of 0: the first part
// is 0), the two sums added for a sum; then resets the ticket counter.
template <int kThreads, typename scalar_t, typename A>
__device__ __forceinline__ void finish_option_rows(const OptionParams<A>& O, const BatchFold& F) {
  const SoftParams<A>& SP = O.soft;
  const Params<A>& P = SP.hard;
  __shared__ bool last;
  __syncthreads();  // the block's row losses and flags are stored
  if (threadIdx.x == 0) {
    __threadfence();  // ... and visible to the device before the ticket
    last = atomicAdd(F.ticket, 1u) == gridDim.x - 1;
    if (last) __threadfence();  // the other blocks' stores, ordered before their tickets, before the reads below
  }
  __syncthreads();
  if (!last) return;
  if (F.target_flag != nullptr && SP.dense_target == nullptr) {  // uniform over the block
    const TargetScan scan = scan_targets<kThreads>(P.target, P.num_rows, P.num_classes, P.ignore_index, true);
    MixScan mix{P.num_rows, 0, P.num_rows};
    if (SP.mix_target != nullptr) {
      mix = scan_mix<kThreads>(P.target, SP.mix_target, SP.mix_lambda, SP.lambda_stride, P.num_rows, P.num_classes,
                               P.ignore_index);
    }
    if (threadIdx.x == 0) store_target_flag(F.target_flag, scan, mix, P.num_rows);
  }
  if (F.loss != nullptr) {
    A weighted = A(0), z_total = A(0);
#pragma unroll 4
    for (int64_t i = threadIdx.x; i < P.num_rows; i += kThreads) {
      weighted += __ldcg(static_cast<const A*>(P.row_loss) + i);
      if (O.z_loss != nullptr) z_total += __ldcg(O.z_loss + i);
    }
    const Sums<A, 2> total = group_sum<kThreads>(Sums<A, 2>{{weighted, z_total}});
    if (threadIdx.x == 0) {
      A value = total.v[0] + total.v[1];
      if (option_mean(O)) {
        const A divisor = weighted_divisor(O);
        value = (divisor > A(0) ? total.v[0] / divisor : A(0)) + total.v[1] / z_loss_divisor(O);
      }
      store_loss<scalar_t>(P, F.loss, 0, value);
    }
  }
  if (SP.row_flags != nullptr) fold_row_flags<kThreads>(SP.row_flags, P.num_rows, F.target_flag);
  if (threadIdx.x == 0) *F.ticket = 0u;
}

// The option launch: the block's rows, then the batch's fold in the last block.
template <typename scalar_t, typename target_t, int kGroup, int kPT, bool kResident, bool kStats>
__global__ void __launch_bounds__(kBlockThreads<kGroup>)
    option_rows_kernel(const OptionParams<Acc<scalar_t>> O, const BatchFold F) {
  option_block_row<scalar_t, target_t, kGroup, kPT, kResident, kStats>(O, F);
  finish_option_rows<kBlockThreads<kGroup>, scalar_t>(O, F);
}

}  // namespace
}  // namespace calibkernels
