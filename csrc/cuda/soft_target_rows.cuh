// The soft-target row kernel, soft_target_kernel, launched by row_kernels.cuh with the hard-target kernel's launch
// shapes: label_smoothing a, mix_target m with mix_lambda λ, or a floating (N, C) target; the maths is
// csrc/uncertainty_weights.h's "Soft targets", used as written there. A kernel of its own, so the hard-target kernel
// carries no soft-target code. Per row the target distribution is
//   compact  t_k = c + W_y [k=y] + W_m [k=m],  c = a/C, W_y = (1-a) λ, W_m = (1-a)(1-λ) (m = y: W_y takes both);
//   dense    t_k = (1-a) T_k + c, T read in its dtype (float32, or the logits' dtype) as the logits are read.
// Compact rows cost what a hard row does: the logits read once (twice when streamed), the gradient written once, with
// the first pass the hard path's online softmax over the columns other than y and m (so 1 - p_y and 1 - p_m are sums,
// not differences), Σ e^{2(z-m)} there for gBS with q = 2 (S and τ in closed form), and, for smoothing's
// Σ_k (lse - z_k), Σ_k (z_k - R) relative to a running R ≥ every logit (no cancellation). gBS with another q, whose
// |p_k - c|^q needs the final log-sum-exp, adds a pass for S and H over the registers (streamed: over the row, which
// the pass before it left in L2). Dense rows take a first pass for the max and Σ e, then one over the logits and the
// target for CE (= Σ t (max - z) + Σt log d), P, 1 - P, S and τ or H; a target is read once per pass (once when the
// row stays in registers). Their only column that can have p > 1/2 is a unique max, whose 1 - p is Σ_{k≠max} p_k.
#pragma once

#include <cstdint>
#include <limits>
#include <type_traits>

#include "batch_fold.cuh"
#include "block_reduce.cuh"
#include "row_params.h"
#include "row_statistics.cuh"
#include "uncertainty_weighted_ce.h"
#include "uncertainty_weights.h"

namespace calibkernels {
namespace {

using cuda_rows::Acc;
using cuda_rows::BatchFold;
using cuda_rows::Params;
using cuda_rows::SoftParams;

// Online statistics of a compact row: the hard path's Stats over the columns other than y and m (sq: Σ e^{2(z-max)}
// for gBS with q = 2), and label smoothing's Σ_k (z_k - R) over the finite logits seen, with how many it holds,
// relative to R = max(that max, z_y, z_m) (`top`: z_y and z_m are read before the pass), which is ≥ each of them. The
// sum follows R like d follows the max (minus count · ΔR), so it stays a sum of non-positive terms. Finite logits, not
// columns < C: the padding reads as -inf, and a per-element column test kept 32 comparisons live through the kernel
// (twice the registers); a row with a -inf logit has fewer than C.
template <typename A>
struct SoftStats {
  Stats<A> base;
  A offsets;
  int count;
};

template <typename A>
__device__ __forceinline__ A reference_point(A m, A top) {
  return m > top ? m : top;
}

// `offsets` taken from the reference point `from` to `to` ≥ from.
template <typename A>
__device__ __forceinline__ A moved_offsets(A offsets, int count, A from, A to) {
  return (count == 0 || from == to) ? offsets : offsets - static_cast<A>(count) * (to - from);
}

template <typename A>
__device__ __forceinline__ SoftStats<A> merge_soft(const SoftStats<A>& a, const SoftStats<A>& b, A q, bool squares,
                                                   A top) {
  SoftStats<A> r;
  r.base = merge(a.base, b.base, q, squares, false);
  const A to = reference_point(r.base.m, top);
  r.offsets = moved_offsets(a.offsets, a.count, reference_point(a.base.m, top), to) +
              moved_offsets(b.offsets, b.count, reference_point(b.base.m, top), to);
  r.count = a.count + b.count;
  return r;
}

// With kStats, the row's top label in the same all-reduce (reduce_row).
template <int kGroup, bool kStats, typename A>
__device__ __forceinline__ SoftStats<A> soft_allreduce(const SoftStats<A>& s, A q, bool squares, A top,
                                                       TopLabel<A>& best) {
  auto warp_reduce = [=](SoftStats<A> x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
      SoftStats<A> o;
      o.base = shuffled(x.base, offset, squares, false);
      o.offsets = __shfl_xor_sync(0xffffffffu, x.offsets, offset);
      o.count = __shfl_xor_sync(0xffffffffu, x.count, offset);
      x = merge_soft(x, o, q, squares, top);
    }
    return x;
  };
  return reduce_row<kGroup, kStats>(s, SoftStats<A>{empty_stats<A>(), A(0), 0}, warp_reduce, best);
}

// Folds a tile into a compact row's statistics: `accumulate` (above) with the mix column mapped onto y, so that both
// are left out, then (`offsets`: smoothing) z - R of every finite logit.
template <typename A, int kPT, typename ColumnOf>
__device__ __forceinline__ void accumulate_soft(const A (&z)[kPT], ColumnOf column_of, int64_t C, int64_t y,
                                                int64_t mix, A z_y, A top, A q, bool squares, bool offsets,
                                                SoftStats<A>& s) {
  const A r_before = reference_point(s.base.m, top);
  accumulate(
      z,
      [&](int e) {
        const int64_t col = column_of(e);
        return col == mix ? y : col;
      },
      C, y, z_y, q, squares, false, s.base);
  if (!offsets) return;
  const A r = reference_point(s.base.m, top);
  s.offsets = moved_offsets(s.offsets, s.count, r_before, r);
#pragma unroll
  for (int e = 0; e < kPT; ++e) {
    if (z[e] > neg_inf<A>()) {  // then R ≥ z[e] is finite
      s.offsets += z[e] - r;
      ++s.count;
    }
  }
}

// A dense target's entries as read (before smoothing), summed with an entry < 0 or NaN counted as NaN: one thread's
// share of the row's value check (the row passes where the sum is within the tolerance of 1, which a NaN or an
// infinite sum never is), made in the kernel's first read of the target instead of two reductions over N × C after
// it. One accumulator: a separate count of bad entries cost the register-resident rows a spill.
template <typename A>
struct TargetCheck {
  A sum = A(0);
  __device__ __forceinline__ void add(A value) { sum += value >= A(0) ? value : std::numeric_limits<A>::quiet_NaN(); }
};

// A dense target's values in a Tile's layout (the columns of the thread's logits), as t = keep · T + add on the
// columns < C and 0 on the padding. target_t is float32 or the logits' type, so each logits vector's columns are
// 16 or 32 bytes of target, read as one or two 16-byte vectors. `check`, when given, takes the entries as read.
template <typename scalar_t, typename target_t, typename A, int kGroup, int kPT>
struct TargetTile {
  static constexpr int V = Tile<scalar_t, A, kGroup, kPT>::V;
  static constexpr int kChunks = static_cast<int>(V * sizeof(target_t) / 16);
  static_assert(V * sizeof(target_t) % 16 == 0, "a logits vector's target columns must be whole 16-byte vectors");

  template <bool kLast = false>
  __device__ __forceinline__ static void load(const target_t* row, bool aligned, int64_t base, int t, int64_t C, A keep,
                                              A add, A (&out)[kPT], TargetCheck<A>* check = nullptr) {
    TargetCheck<A> tile;  // the tile's own sum first: a streamed row's running sum then takes one add per tile
#pragma unroll
    for (int j = 0; j < kPT / V; ++j) {
      const int64_t c0 = base + (static_cast<int64_t>(j) * kGroup + t) * V;
      if (aligned && c0 + V <= C) {
        Pack<target_t, V> p;
        const int4* src = reinterpret_cast<const int4*>(row + c0);
#pragma unroll
        for (int k = 0; k < kChunks; ++k) reinterpret_cast<int4*>(&p)[k] = kLast ? __ldcs(src + k) : src[k];
#pragma unroll
        for (int v = 0; v < V; ++v) {
          const A value = static_cast<A>(p.v[v]);
          if (check != nullptr) tile.add(value);
          out[j * V + v] = keep * value + add;
        }
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          if (c0 + v < C) {
            const A value = static_cast<A>(row[c0 + v]);
            if (check != nullptr) tile.add(value);
            out[j * V + v] = keep * value + add;
          } else {
            out[j * V + v] = A(0);
          }
        }
      }
    }
    if (check != nullptr) check->sum += tile.sum;
  }
};

// Calls visit(base) for each tile of a row: the one tile of a register-resident row, or the kTileCols-column tiles
// of a streamed row, first to last or (reverse) last to first. Each streamed pass runs the other way from the pass
// before it, so that it starts on the tiles the likeliest still in L2.
template <bool kResident, int64_t kTileCols, typename Visit>
__device__ __forceinline__ void for_each_tile(int64_t C, bool reverse, Visit visit) {
  if constexpr (kResident) {
    visit(int64_t(0));
  } else if (reverse) {
    for (int64_t base = ((C - 1) / kTileCols) * kTileCols; base >= 0; base -= kTileCols) visit(base);
  } else {
    for (int64_t base = 0; base < C; base += kTileCols) visit(base);
  }
}

// One column's terms of gBS's S = Σ |d_k|^q and of τ = Σ p_k d_k (q = 2, `square`) or H = Σ h_k p_k (any other q),
// d = p - t.
template <typename A>
__device__ __forceinline__ void add_brier_terms(A p, A d, A q, bool square, A& S, A& H) {
  if (square) {
    S += d * d;
    H += p * d;
  } else {
    S += weight_power(d < A(0) ? -d : d, q);
    if (p != A(0)) H += p * soft_brier_h(d, q);  // h may overflow where p underflowed (q < 1)
  }
}

// γ of a row: the argument, the focal weight's per-sample γ, or FLSD-53's γ_i (FLSD, Brier-FLSD) from the band value
// band() of P.
template <typename A, typename Band>
__device__ __forceinline__ A row_gamma(const Params<A>& P, int64_t row, Band band) {
  const auto weight = static_cast<Weight>(P.weight);
  if (weight == Weight::Focal && P.gamma_per_sample != nullptr) return P.gamma_per_sample[row];
  if (P.flsd_schedule) return flsd_gamma(band(), P.gamma);
  return P.gamma;
}

// The row's weight coefficients and loss (written by the group's first thread) from its soft quantities, whose
// gamma and external fields are filled here.
template <typename scalar_t, typename A, typename Band>
__device__ __forceinline__ SoftCoefficients<A> soft_row_coefficients(const Params<A>& P, int64_t row, int lane,
                                                                     SoftRowQuantities<A> r, Band band) {
  r.gamma = row_gamma(P, row, band);
  r.q = P.norm;
  r.external = static_cast<Weight>(P.weight) == Weight::External ? P.sample_weight[row] : A(1);
  const SoftCoefficients<A> cf =
      soft_weight_coefficients(static_cast<Weight>(P.weight), P.mode == static_cast<int>(Mode::Loss), r, r.q == A(2));
  if (lane == 0) store_row_loss<scalar_t>(P, row, cf.u * r.ce);
  return cf;
}

// A compact row (y and m valid; m == y without a mix). Pass 1 is the hard path's online softmax over the columns
// other than y and m, plus smoothing's offsets; z_y and z_m come from one load each. gBS with q ≠ 2 adds a pass for
// S and H over those columns (from registers, or over the L2-resident row when streamed). kStats: the row's top-label
// statistics into F's, from pass 1.
template <typename scalar_t, int kGroup, int kPT, bool kResident, bool kStats, typename A>
__device__ __forceinline__ void compact_soft_row(const SoftParams<A>& SP, const BatchFold& F, int64_t row, int lane,
                                                 int64_t y, int64_t mix, scalar_t* grad_row) {
  using T = Tile<scalar_t, A, kGroup, kPT>;
  constexpr int64_t kTileCols = static_cast<int64_t>(kGroup) * kPT;
  const Params<A>& P = SP.hard;
  const int64_t C = P.num_classes;
  const A q = P.norm;
  const bool brier = P.weight == static_cast<int>(Weight::Brier);
  const bool square = q == A(2);
  const bool general = brier && !square;  // S and H need their own pass
  const A a = SP.smoothing;
  const A c = a / static_cast<A>(C);
  const A lambda = SP.mix_target != nullptr ? SP.mix_lambda[row * SP.lambda_stride] : A(1);
  const A w_y = (A(1) - a) * lambda, w_m = (A(1) - a) * (A(1) - lambda);
  const bool two = mix != y;  // a mix onto y itself merges its weight into y's
  const A W_y = two ? w_y : w_y + w_m, W_m = two ? w_m : A(0);

  const scalar_t* z_row = static_cast<const scalar_t*>(P.logits) + row * P.logits_row_stride;
  const bool in_aligned = aligned16(z_row);
  const bool out_aligned = grad_row != nullptr && aligned16(grad_row);
  const A z_y = static_cast<A>(z_row[y]);
  const A z_m = static_cast<A>(z_row[mix]);
  const A top = z_y > z_m ? z_y : z_m;

  SoftStats<A> s{empty_stats<A>(), A(0), 0};
  TopLabel<A> best = empty_top_label<A>();
  A z[kPT];
  for_each_tile<kResident, kTileCols>(C, false, [&](int64_t base) {
    T::load(z_row, in_aligned, base, lane, C, z);
    const auto column_of = [&](int e) { return T::column(base, lane, e); };
    accumulate_soft(z, column_of, C, y, mix, z_y, top, q, brier && square, c != A(0), s);
    track_top_label<kStats>(z, column_of, best);
  });
  if constexpr (kGroup == 32) __syncwarp();  // every read of the row (z_y, z_m included) before any write
  s = soft_allreduce<kGroup, kStats>(s, q, brier && square, top, best);

  // The row's max M over every column (= R); the other columns' sums moved to it.
  const A m_o = s.base.m;
  const A M = reference_point(m_o, top);
  A d_o = s.base.d, sq_o = s.base.sq;  // with m_o = -inf: 0, or NaN from a NaN logit, kept as they are
  if (m_o != neg_inf<A>() && m_o != M) {
    const A f = exp_(m_o - M);
    d_o *= f;
    sq_o *= f * f;
  }
  const A e_y = exp_(z_y - M), e_m = two ? exp_(z_m - M) : A(0);
  const A d = d_o + e_m + e_y;
  const A log_d = log_(d);
  store_top_label_at<kStats>(F, row, lane, best, d);
  // 1 - p of y and m as sums over the other classes, never a difference
  const A rest_y = d_o + e_m, rest_m = d_o + e_y;
  const A p_y = e_y / d, p_m = e_m / d;
  const A omp_y = rest_y / d, omp_m = rest_m / d;
  const A spread = c * static_cast<A>(C - 1);  // Σ_k c (1 - p_k), and 1 - t_k without y's or m's own weight
  const A t_y = c + W_y, t_m = c + W_m;
  // p - t of y and m, as (1 - t) - (1 - p) where p > 1/2 (where p - t would cancel)
  const A d_y = p_y > A(0.5) ? (spread + W_m) - omp_y : p_y - t_y;
  const A d_m = p_m > A(0.5) ? (spread + W_y) - omp_m : p_m - t_m;

  // CE = W_y (-log p_y) + W_m (-log p_m) + c Σ_k (lse - z_k), Σ_k (lse - z_k) = C log d - Σ_k (z_k - M) (+inf with a
  // -inf logit); a term of weight 0 takes no part (a -inf logit there would make it 0 · inf)
  A ce = A(0);
  if (W_y != A(0)) ce += W_y * class_ce(p_y, e_y, rest_y, M, z_y, log_d);
  if (W_m != A(0)) ce += W_m * class_ce(p_m, e_m, rest_m, M, z_m, log_d);
  if (c != A(0)) {
    ce += c * (s.count == C ? static_cast<A>(C) * log_d - s.offsets : std::numeric_limits<A>::infinity());
  }

  A S = A(0), H = A(0);
  if (brier) {
    if (square) {
      // Σ_{k∉{y,m}} (p_k - c)² = R2 - 2c R1 + n c² and Σ_{k∉{y,m}} p_k (p_k - c) = R2 - c R1 (τ = Σ_j p_j (p_j - t_j))
      const A r1 = d_o / d, r2 = sq_o / (d * d);
      const A n = static_cast<A>(C - 1 - (two ? 1 : 0));
      S = (r2 - A(2) * c * r1) + n * c * c;
      S = S > A(0) ? S : A(0);
      H = r2 - c * r1;
    } else {
      Sums<A, 2> b{};
      for_each_tile<kResident, kTileCols>(C, true, [&](int64_t base) {
        if constexpr (!kResident) T::load(z_row, in_aligned, base, lane, C, z);
#pragma unroll
        for (int e = 0; e < kPT; ++e) {
          const int64_t col = T::column(base, lane, e);
          if (col >= C || col == y || col == mix) continue;
          const A p = exp_((z[e] - M) - log_d);
          add_brier_terms(p, p - c, q, false, b.v[0], b.v[1]);
        }
      });
      b = group_sum<kGroup>(b);
      S = b.v[0];
      H = b.v[1];
    }
    add_brier_terms(p_y, d_y, q, square, S, H);
    if (two) add_brier_terms(p_m, d_m, q, square, S, H);
  }

  const A omP = (W_y * omp_y + W_m * omp_m) + spread;
  const A P_row = (W_y * p_y + W_m * p_m) + c;
  const SoftCoefficients<A> cf =
      soft_row_coefficients<scalar_t>(P, row, lane, SoftRowQuantities<A>{omP, P_row, ce, A(0), q, A(1), S, H},
                                      [&] { return soft_flsd_band_probability(z_y, z_m, M + log_d, w_y, w_m, c); });
  if (grad_row == nullptr) return;

  const A scale = gradient_scale(P);
  const A g_y = soft_gradient_element(cf, p_y, t_y, d_y, q) * scale;
  const A g_m = soft_gradient_element(cf, p_m, t_m, d_m, q) * scale;
  const UniformColumnCoefficients<A> uc = soft_uniform_columns(cf, c);
  for_each_tile<kResident, kTileCols>(C, !general, [&](int64_t base) {
    if constexpr (!kResident) T::template load<true>(z_row, in_aligned, base, lane, C, z);
#pragma unroll
    for (int e = 0; e < kPT; ++e) {
      const A p = exp_((z[e] - M) - log_d);
      const A g =
          general ? soft_gradient_element(cf, p, c, p - c, q) : p * (uc.alpha + uc.beta * (p - uc.tau)) + uc.delta;
      z[e] = g * scale;
    }
    T::store(grad_row, out_aligned, base, lane, C, z);
    // y's and m's own values over the ones just stored, by the thread that stored them (so in program order): a
    // per-element choice in the loop above kept every column's comparison live and doubled the registers
    T::overwrite(grad_row, base, lane, y, g_y);
    if (two) T::overwrite(grad_row, base, lane, mix, g_m);
  });
}

// A dense row. Pass 1: max and d over every column (the hard path's accumulate, no column left out). Pass 2, with
// the row's max M and log d known: the target's sums (CE, P, 1 - P, gBS's S and τ or H). The row's only column that
// can have p > 1/2 is its unique max (d < 2: a second column at the max would add e^0 = 1 to d): there 1 - p is taken
// as Σ_{k≠max} p_k, summed in pass 2, and that column's terms are added after it. kStats: the row's top-label
// statistics into F's, from pass 1.
template <typename scalar_t, typename target_t, int kGroup, int kPT, bool kResident, bool kStats, typename A>
__device__ __forceinline__ void dense_soft_row(const SoftParams<A>& SP, const BatchFold& F, int64_t row, int lane,
                                               scalar_t* grad_row) {
  using T = Tile<scalar_t, A, kGroup, kPT>;
  using TT = TargetTile<scalar_t, target_t, A, kGroup, kPT>;
  constexpr int64_t kTileCols = static_cast<int64_t>(kGroup) * kPT;
  enum { kTargetSum, kGap, kOneMinusP, kP, kRest, kS, kH, kTargetAtMax, kCheckSum, kNumSums };
  const Params<A>& P = SP.hard;
  const int64_t C = P.num_classes;
  const A q = P.norm;
  const bool brier = P.weight == static_cast<int>(Weight::Brier);
  const bool square = q == A(2);
  const A keep = A(1) - SP.smoothing, add = SP.smoothing / static_cast<A>(C);

  const scalar_t* z_row = static_cast<const scalar_t*>(P.logits) + row * P.logits_row_stride;
  const target_t* t_row = static_cast<const target_t*>(SP.dense_target) + row * SP.dense_row_stride;
  const bool in_aligned = aligned16(z_row), t_aligned = aligned16(t_row);
  const bool out_aligned = grad_row != nullptr && aligned16(grad_row);

  Stats<A> s = empty_stats<A>();
  TopLabel<A> best = empty_top_label<A>();
  A z[kPT], t[kPT];
  TargetCheck<A> check;  // in the target's first read: pass 1 of a resident row, pass 2 of a streamed one
  for_each_tile<kResident, kTileCols>(C, false, [&](int64_t base) {
    T::load(z_row, in_aligned, base, lane, C, z);
    if constexpr (kResident) TT::load(t_row, t_aligned, base, lane, C, keep, add, t, &check);
    const auto column_of = [&](int e) { return T::column(base, lane, e); };
    accumulate(z, column_of, C, int64_t(-1), A(0), q, false, false, s);
    track_top_label<kStats>(z, column_of, best);
  });
  if constexpr (kGroup == 32) __syncwarp();
  s = group_allreduce<kGroup, kStats>(s, q, false, false, best);
  const A M = s.m, d = s.d;
  const A log_d = log_(d);
  store_top_label_at<kStats>(F, row, lane, best, d);
  const bool unique_max = d < A(2);

  // Σt, Σ t (M - z) (CE = Σ t (M - z) + Σt log d, non-negative terms; t = 0 takes no part, also at z = -inf), then
  // over the columns other than a unique max: Σ t (1 - p), Σ p (= 1 - p_max), S, τ or H; and P = Σ t p, t_max.
  Sums<A, kNumSums> r{};
  for_each_tile<kResident, kTileCols>(C, true, [&](int64_t base) {
    if constexpr (!kResident) {
      T::load(z_row, in_aligned, base, lane, C, z);
      TT::load(t_row, t_aligned, base, lane, C, keep, add, t, &check);
    }
#pragma unroll
    for (int e = 0; e < kPT; ++e) {
      const A p = exp_((z[e] - M) - log_d);  // 0 on the padding, where t = 0
      r.v[kTargetSum] += t[e];
      r.v[kP] += t[e] * p;
      if (t[e] > A(0)) r.v[kGap] += t[e] * (M - z[e]);
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
  if (SP.row_flags != nullptr && lane == 0) {
    const A off = r.v[kCheckSum] - A(1);
    SP.row_flags[row] = (off < A(0) ? -off : off) <= SP.dense_tolerance ? 0 : 1;  // NaN: flagged
  }
  const A rest = r.v[kRest];  // 1 - p_max of a unique max
  const A t_max = r.v[kTargetAtMax];
  const A d_max = (A(1) - t_max) - rest;  // its p - t
  A omP = r.v[kOneMinusP], S = r.v[kS], H = r.v[kH];
  if (unique_max) {
    omP += t_max * rest;
    if (brier) add_brier_terms(exp_(-log_d), d_max, q, square, S, H);  // p_max as the gradient pass computes it
  }
  const A ce = r.v[kGap] + r.v[kTargetSum] * log_d;
  const SoftCoefficients<A> cf =
      soft_row_coefficients<scalar_t>(P, row, lane, SoftRowQuantities<A>{omP, r.v[kP], ce, A(0), q, A(1), S, H},
                                      [&] { return static_cast<float>(r.v[kP]); });
  if (grad_row == nullptr) return;

  const A scale = gradient_scale(P);
  // CE's gradient is Σt p - t: a row's sum may be off 1 by its rounding (u (Σt - 1) p beside the header's u (p - t))
  const A excess = cf.u * (r.v[kTargetSum] - A(1));
  for_each_tile<kResident, kTileCols>(C, false, [&](int64_t base) {
    if constexpr (!kResident) {
      T::template load<true>(z_row, in_aligned, base, lane, C, z);
      TT::template load<true>(t_row, t_aligned, base, lane, C, keep, add, t);
    }
#pragma unroll
    for (int e = 0; e < kPT; ++e) {
      const A p = exp_((z[e] - M) - log_d);
      const A delta = (unique_max && z[e] == M) ? d_max : p - t[e];
      z[e] = (soft_gradient_element(cf, p, t[e], delta, q) + excess * p) * scale;
    }
    T::store(grad_row, out_aligned, base, lane, C, z);
  });
}

// One soft-target row (the block's share of the launch): target_t is int64_t for the compact form (class indices,
// `SoftParams::hard.target`), else the element type of the dense target. Launch shape as for the hard kernel;
// kStats: the rows' top-label statistics into F's.
template <typename scalar_t, typename target_t, int kGroup, int kPT, bool kResident, bool kStats>
__device__ __forceinline__ void soft_row(const SoftParams<Acc<scalar_t>>& SP, const BatchFold& F) {
  using A = Acc<scalar_t>;
  constexpr int kRowsPerBlock = kGroup == 32 ? 8 : 1;
  const Params<A>& P = SP.hard;
  const int lane = kGroup == 32 ? (threadIdx.x & 31) : threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (kGroup == 32 ? (threadIdx.x >> 5) : 0);
  if (row >= P.num_rows) return;  // uniform over the row's group
  scalar_t* grad_row = P.grad != nullptr ? static_cast<scalar_t*>(P.grad) + row * P.grad_row_stride : nullptr;
  if constexpr (std::is_same<target_t, int64_t>::value) {
    const int64_t C = P.num_classes;
    const int64_t y = P.target[row];
    if (y == P.ignore_index) {  // whatever its mix_target
      if constexpr (kStats) {
        if (lane == 0) store_ignored_top_label(F, row);
      }
      fill_row<kGroup>(P, row, lane, grad_row, A(0));
      return;
    }
    const int64_t mix = SP.mix_target != nullptr ? SP.mix_target[row] : y;
    const A lambda = SP.mix_target != nullptr ? SP.mix_lambda[row * SP.lambda_stride] : A(1);
    // a bad target or mix_target is never used as an index; a λ outside [0, 1] (or NaN) makes the row NaN too
    if (y < 0 || y >= C || mix < 0 || mix >= C || lambda_out_of_range(lambda)) {
      if constexpr (kStats) {
        const scalar_t* z_row = static_cast<const scalar_t*>(P.logits) + row * P.logits_row_stride;
        top_label_only<scalar_t, kGroup, kPT, A>(F, z_row, row, C, lane, [](A(&)[kPT], int64_t) {});
      }
      fill_row<kGroup>(P, row, lane, grad_row, std::numeric_limits<A>::quiet_NaN());
      return;
    }
    compact_soft_row<scalar_t, kGroup, kPT, kResident, kStats>(SP, F, row, lane, y, mix, grad_row);
  } else {
    dense_soft_row<scalar_t, target_t, kGroup, kPT, kResident, kStats>(SP, F, row, lane, grad_row);
  }
}

// The soft-target launch: the block's count (batch_fold.cuh: class indices), its rows, then the batch's fold in the
// last block (a dense target's row flags included).
template <typename scalar_t, typename target_t, int kGroup, int kPT, bool kResident, bool kStats>
__global__ void __launch_bounds__(kBlockThreads<kGroup>)
    soft_target_kernel(const SoftParams<Acc<scalar_t>> SP, const BatchFold F) {
  begin_rows<kBlockThreads<kGroup>>(SP.hard);
  soft_row<scalar_t, target_t, kGroup, kPT, kResident, kStats>(SP, F);
  if constexpr (std::is_same<target_t, int64_t>::value) {  // class indices: a mix is checked with them
    finish_rows<kBlockThreads<kGroup>, scalar_t>(SP.hard, F, SP.row_flags, SP.mix_target, SP.mix_lambda,
                                                 SP.lambda_stride);
  } else {  // a dense target has no mix: no scan of one in its kernels (whose rows are short of registers)
    finish_rows<kBlockThreads<kGroup>, scalar_t>(SP.hard, F, SP.row_flags);
  }
}

}  // namespace
}  // namespace calibkernels
