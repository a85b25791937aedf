// What the CUDA row kernels (row_kernels.cuh) share: the math in the accumulation type, the online-softmax
// statistics of a row and their warp/block reductions, the vector tile loads and stores, and the per-row
// coefficients of the hard-target gradient (csrc/uncertainty_weights.h).
#pragma once

#include <cstdint>
#include <limits>

#include "batch_fold.cuh"
#include "block_reduce.cuh"
#include "row_params.h"
#include "uncertainty_weighted_ce.h"
#include "uncertainty_weights.h"

namespace calibkernels {
namespace {

using cuda_rows::Acc;
using cuda_rows::Params;

// ----------------------------------------------------------------------------------------------------------------
// Math in the accumulation type A (float for fp32/fp16/bf16, double for float64). Accurate library functions, not
// the --use_fast_math intrinsics: CE near p_y → 1 and the focal/Brier weights of confident rows depend on log1p and
// on tiny 1 - p_y values that flush-to-zero and __logf would destroy.
// ----------------------------------------------------------------------------------------------------------------
__device__ __forceinline__ float exp_(float x) { return exp2f(x * 1.4426950408889634f); }
__device__ __forceinline__ double exp_(double x) { return exp(x); }
__device__ __forceinline__ float log_(float x) { return logf(x); }
__device__ __forceinline__ double log_(double x) { return log(x); }
__device__ __forceinline__ float log1p_(float x) { return log1pf(x); }
__device__ __forceinline__ double log1p_(double x) { return log1p(x); }

template <typename A>
__device__ __forceinline__ A neg_inf() {
  return -std::numeric_limits<A>::infinity();
}

// Online-softmax state of a set of non-target columns: running max m, d = Σ e^{z-m}, sq = Σ e^{q(z-m)} (Brier only),
// and dual focal's zb = max{z_k : z_k < z_y} with its tie count nt. POD so that it can live in shared memory.
template <typename A>
struct Stats {
  A m;
  A d;
  A sq;
  A zb;
  int nt;
};

template <typename A>
__device__ __forceinline__ Stats<A> empty_stats() {
  return {neg_inf<A>(), A(0), A(0), neg_inf<A>(), 0};
}

// Symmetric in (a, b) bit for bit (max, and a commutative sum of two products), so a butterfly reduction leaves the
// same value in every lane.
template <typename A>
__device__ __forceinline__ Stats<A> merge(const Stats<A>& a, const Stats<A>& b, A q, bool brier, bool dual) {
  Stats<A> r;
  r.m = a.m > b.m ? a.m : b.m;
  if (r.m == neg_inf<A>()) {  // no finite logit on either side: e^{-inf - -inf} would be NaN; each sum is 0, or
    r.d = a.d + b.d;          // NaN from a NaN logit, which must reach the row's loss
    r.sq = brier ? a.sq + b.sq : A(0);
  } else {
    r.d = a.d * exp_(a.m - r.m) + b.d * exp_(b.m - r.m);
    r.sq = brier ? a.sq * exp_(q * (a.m - r.m)) + b.sq * exp_(q * (b.m - r.m)) : A(0);
  }
  if (dual) {
    r.zb = a.zb > b.zb ? a.zb : b.zb;
    r.nt = (a.zb == b.zb) ? a.nt + b.nt : (a.zb > b.zb ? a.nt : b.nt);
  } else {
    r.zb = a.zb;
    r.nt = 0;
  }
  return r;
}

// Lane `lane ^ offset`'s statistics (the fields `brier` and `dual` use; the others are left as merge ignores them).
template <typename A>
__device__ __forceinline__ Stats<A> shuffled(const Stats<A>& s, int offset, bool brier, bool dual) {
  Stats<A> o;
  o.m = __shfl_xor_sync(0xffffffffu, s.m, offset);
  o.d = __shfl_xor_sync(0xffffffffu, s.d, offset);
  o.sq = brier ? __shfl_xor_sync(0xffffffffu, s.sq, offset) : A(0);
  o.zb = dual ? __shfl_xor_sync(0xffffffffu, s.zb, offset) : s.zb;
  o.nt = dual ? __shfl_xor_sync(0xffffffffu, s.nt, offset) : 0;
  return o;
}

template <typename A>
__device__ __forceinline__ Stats<A> warp_allreduce(Stats<A> s, A q, bool brier, bool dual) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) s = merge(s, shuffled(s, offset, brier, dual), q, brier, dual);
  return s;
}

template <int kGroup, typename A>
__device__ __forceinline__ Stats<A> group_allreduce(Stats<A> s, A q, bool brier, bool dual) {
  return group_reduce<kGroup>(s, empty_stats<A>(), [=](Stats<A> v) { return warp_allreduce(v, q, brier, dual); });
}

// ----------------------------------------------------------------------------------------------------------------
// The top label of a row (return_stats; the contract in ../uncertainty_weighted_ce.h): its arg-max as torch.argmax
// takes it, the first NaN where the row holds one, else the lowest index of the max, with that value. Taken in the
// row's first pass, beside the online softmax, and all-reduced with its statistics (reduce_row), so that in place it
// is read before the gradient overwrites the row.
// ----------------------------------------------------------------------------------------------------------------
template <typename A>
struct TopLabel {
  A value;
  int64_t index;
};

template <typename A>
__device__ __forceinline__ TopLabel<A> empty_top_label() {
  return {neg_inf<A>(), std::numeric_limits<int64_t>::max()};
}

// Whether `v` takes the place of the running `best` met before it: a NaN stays, a first NaN wins, else a larger value.
template <typename A>
__device__ __forceinline__ bool replaces(A v, A best) {
  return best == best && (v > best || v != v);
}

// Folds a tile into a thread's top label. A thread meets its columns in increasing order (its earlier tiles, then the
// tile's elements in order of e), so the strict comparison keeps the first of its ties. The padding reads as -inf and
// never replaces anything; neither does a -inf logit, so a row of only -inf logits keeps no index (store_top_label).
// Nothing without kStats.
template <bool kStats, typename A, int kPT, typename ColumnOf>
__device__ __forceinline__ void track_top_label(const A (&z)[kPT], ColumnOf column_of, TopLabel<A>& best) {
  if constexpr (!kStats) return;
  A tile_value = neg_inf<A>();
  int tile_element = -1;
#pragma unroll
  for (int e = 0; e < kPT; ++e) {
    if (replaces(z[e], tile_value)) {
      tile_value = z[e];
      tile_element = e;
    }
  }
  if (tile_element >= 0 && replaces(tile_value, best.value)) best = {tile_value, column_of(tile_element)};
}

// The better of two threads' top labels, symmetric in (a, b) (a NaN first, then the larger value, then the lower
// index), so that a butterfly leaves the same label in every lane.
template <typename A>
__device__ __forceinline__ TopLabel<A> better_top_label(const TopLabel<A>& a, const TopLabel<A>& b) {
  const bool a_nan = a.value != a.value, b_nan = b.value != b.value;
  if (a_nan != b_nan) return a_nan ? a : b;
  if (!a_nan && a.value != b.value) return a.value > b.value ? a : b;
  return a.index < b.index ? a : b;
}

template <typename A>
__device__ __forceinline__ TopLabel<A> warp_top_label(TopLabel<A> x) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    const TopLabel<A> other{
        __shfl_xor_sync(0xffffffffu, x.value, offset),
        static_cast<int64_t>(__shfl_xor_sync(0xffffffffu, static_cast<long long>(x.index), offset))};
    x = better_top_label(x, other);
  }
  return x;
}

// A row's statistics S and, with kStats, its top label, in one all-reduce over the row's threads (one shared-memory
// step for a block, not two); without kStats exactly group_reduce of S, and `best` untouched.
template <typename S, typename A>
struct WithTopLabel {
  S stats;
  TopLabel<A> best;
};

template <int kGroup, bool kStats, typename S, typename A, typename WarpReduce>
__device__ __forceinline__ S reduce_row(const S& s, const S& identity, WarpReduce warp_reduce, TopLabel<A>& best) {
  if constexpr (kStats) {
    using Pair = WithTopLabel<S, A>;
    const Pair r = group_reduce<kGroup>(Pair{s, best}, Pair{identity, empty_top_label<A>()},
                                        [=](Pair x) { return Pair{warp_reduce(x.stats), warp_top_label(x.best)}; });
    best = r.best;
    return r.stats;
  } else {
    return group_reduce<kGroup>(s, identity, warp_reduce);
  }
}

// group_allreduce with the top label of kStats.
template <int kGroup, bool kStats, typename A>
__device__ __forceinline__ Stats<A> group_allreduce(Stats<A> s, A q, bool brier, bool dual, TopLabel<A>& best) {
  return reduce_row<kGroup, kStats>(
      s, empty_stats<A>(), [=](Stats<A> v) { return warp_allreduce(v, q, brier, dual); }, best);
}

// A row's top-label statistics from its top label (all-reduced) and d = Σ_k e^{z_k - M} relative to the row's max
// M = best.value: confidence 1 / d (float32), NaN where M is not finite (a NaN, +inf, or only -inf logits: no
// distribution); prediction the arg-max, 0 for a row of only -inf logits (torch.argmax's first maximum).
template <typename A>
__device__ __forceinline__ void store_top_label(const BatchFold& F, int64_t row, const TopLabel<A>& best, A d) {
  const bool finite = best.value > neg_inf<A>() && best.value < std::numeric_limits<A>::infinity();
  F.confidence[row] = finite ? static_cast<float>(A(1) / d) : std::numeric_limits<float>::quiet_NaN();
  F.prediction[row] = best.value == neg_inf<A>() ? 0 : best.index;
}

// store_top_label by the row's first thread (lane 0), with kStats; nothing without.
template <bool kStats, typename A>
__device__ __forceinline__ void store_top_label_at(const BatchFold& F, int64_t row, int lane, const TopLabel<A>& best,
                                                   A d) {
  if constexpr (kStats) {
    if (lane == 0) store_top_label(F, row, best, d);
  }
}

// An ignored row's: NaN and -1.
__device__ __forceinline__ void store_ignored_top_label(const BatchFold& F, int64_t row) {
  F.confidence[row] = std::numeric_limits<float>::quiet_NaN();
  F.prediction[row] = -1;
}

template <typename scalar_t, int V>
struct alignas(sizeof(scalar_t) * V) Pack {
  scalar_t v[V];
};

// A thread's share of a tile of kGroup·kPT columns starting at `base`: kPT/V vectors of V = 16 bytes / element
// consecutive columns; vector j of thread t starts at column base + (j·kGroup + t)·V, so a warp's vector load
// covers 512 contiguous bytes. Columns ≥ C read as -inf (they then contribute nothing to any statistic).
template <typename scalar_t, typename A, int kGroup, int kPT>
struct Tile {
  static constexpr int V = 16 / sizeof(scalar_t);
  static constexpr int kVecs = kPT / V;
  static_assert(kPT % V == 0, "values per thread must be a multiple of the vector width");

  __device__ __forceinline__ static int64_t column(int64_t base, int t, int e) {
    return base + (static_cast<int64_t>(e / V) * kGroup + t) * V + (e % V);
  }

  // kLast: the last read of these bytes (the gradient pass), an evict-first load (ld.global.cs).
  template <bool kLast = false>
  __device__ __forceinline__ static void load(const scalar_t* row, bool aligned, int64_t base, int t, int64_t C,
                                              A (&z)[kPT]) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int64_t c0 = base + (static_cast<int64_t>(j) * kGroup + t) * V;
      if (aligned && c0 + V <= C) {
        Pack<scalar_t, V> p;
        const int4* src = reinterpret_cast<const int4*>(row + c0);
        *reinterpret_cast<int4*>(&p) = kLast ? __ldcs(src) : *src;
#pragma unroll
        for (int v = 0; v < V; ++v) z[j * V + v] = static_cast<A>(p.v[v]);
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) z[j * V + v] = (c0 + v < C) ? static_cast<A>(row[c0 + v]) : neg_inf<A>();
      }
    }
  }

  // Column `col`'s element of the row set to g, if thread t's share of the tile at `base` holds it.
  __device__ __forceinline__ static void overwrite(scalar_t* row, int64_t base, int t, int64_t col, A g) {
    const int64_t offset = col - base;
    if (offset >= 0 && offset < static_cast<int64_t>(kGroup) * kPT && (offset / V) % kGroup == t) {
      row[col] = static_cast<scalar_t>(g);
    }
  }

  __device__ __forceinline__ static void store(scalar_t* row, bool aligned, int64_t base, int t, int64_t C,
                                               const A (&g)[kPT]) {
#pragma unroll
    for (int j = 0; j < kVecs; ++j) {
      const int64_t c0 = base + (static_cast<int64_t>(j) * kGroup + t) * V;
      if (aligned && c0 + V <= C) {
        Pack<scalar_t, V> p;
#pragma unroll
        for (int v = 0; v < V; ++v) p.v[v] = static_cast<scalar_t>(g[j * V + v]);
        __stcs(reinterpret_cast<int4*>(row + c0), *reinterpret_cast<const int4*>(&p));  // streaming: evict first
      } else {
#pragma unroll
        for (int v = 0; v < V; ++v) {
          if (c0 + v < C) row[c0 + v] = static_cast<scalar_t>(g[j * V + v]);
        }
      }
    }
  }
};

__device__ __forceinline__ bool aligned16(const void* p) { return (reinterpret_cast<uintptr_t>(p) & 15u) == 0; }

// Folds one tile into a thread's statistics: the tile's max first, the running sums rescaled once if it moved the
// max, then one exponential per element. The target column is excluded (1 - p_y = d_¬y / d then never cancels).
template <typename A, int kPT, typename ColumnOf>
__device__ __forceinline__ void accumulate(const A (&z)[kPT], ColumnOf column_of, int64_t C, int64_t y, A z_y, A q,
                                           bool brier, bool dual, Stats<A>& s) {
  // The max keeps a NaN (z != z), so that it reaches the sums below and the row's loss, as on every other backend,
  // even where a thread's other columns are -inf or padding.
  A tile_max = neg_inf<A>();
#pragma unroll
  for (int e = 0; e < kPT; ++e) {
    if (column_of(e) != y) tile_max = (z[e] > tile_max || z[e] != z[e]) ? z[e] : tile_max;
  }
  if (!(tile_max <= s.m)) {
    const A shift = s.m - tile_max;  // -inf on the first non-empty tile, when the sums are still 0
    s.d *= exp_(shift);
    if (brier) s.sq *= exp_(q * shift);
    s.m = tile_max;
  }
  if (s.m != neg_inf<A>()) {
#pragma unroll
    for (int e = 0; e < kPT; ++e) {
      if (column_of(e) == y) continue;
      const A shifted = z[e] - s.m;  // -inf for padding and masked classes: e^{-inf} = 0
      const A ex = exp_(shifted);
      s.d += ex;
      if (brier) s.sq += (q == A(2)) ? ex * ex : exp_(q * shifted);
    }
  }
  if (dual) {
#pragma unroll
    for (int e = 0; e < kPT; ++e) {
      // padding (column ≥ C) is -inf but is no class: it must not count as a tie of zb = -inf
      if (column_of(e) < C && z[e] < z_y) {
        if (z[e] > s.zb) {
          s.zb = z[e];
          s.nt = 1;
        } else if (z[e] == s.zb) {
          ++s.nt;
        }
      }
    }
  }
}

// The top-label statistics of a row whose loss pass reads none of its logits (a bad target or mix: the row's loss
// and gradient are NaN): a pass of their own, over the logits as transform(z, base) leaves a tile (the option
// kernel's soft-capping), before the row's fill (which in place overwrites the logits: the reduction orders every read
// before it).
template <typename scalar_t, int kGroup, int kPT, typename A, typename Transform>
__device__ __forceinline__ void top_label_only(const BatchFold& F, const scalar_t* z_row, int64_t row, int64_t C,
                                               int lane, Transform transform) {
  using T = Tile<scalar_t, A, kGroup, kPT>;
  constexpr int64_t kTileCols = static_cast<int64_t>(kGroup) * kPT;
  const bool aligned = aligned16(z_row);
  Stats<A> s = empty_stats<A>();
  TopLabel<A> best = empty_top_label<A>();
  A z[kPT];
  for (int64_t base = 0; base < C; base += kTileCols) {  // one tile where the row fits in one
    T::load(z_row, aligned, base, lane, C, z);
    transform(z, base);
    const auto column_of = [&](int e) { return T::column(base, lane, e); };
    accumulate(z, column_of, C, int64_t(-1), A(0), A(1), false, false, s);
    track_top_label<true>(z, column_of, best);
  }
  if constexpr (kGroup == 32) __syncwarp();
  s = group_allreduce<kGroup, true>(s, A(1), false, false, best);
  if (lane == 0) store_top_label(F, row, best, s.d);
}

// -log p_k = lse - z_k from e_k = e^{z_k - m} and rest = Σ_{j≠k} e^{z_j - m} (d = e_k + rest): for a confident
// class (p_k > 1/2) log1p(rest / e_k) keeps the digits that (m - z_k) + log d would cancel.
template <typename A>
__device__ __forceinline__ A class_ce(A p, A e, A rest, A m, A z, A log_d) {
  return (p > A(0.5)) ? log1p_(rest / e) : (m - z) + log_d;
}

// The gradient's factor for grad_output = 1: 1 / mean_divisor for the mean, else 1 (and 1 where no gradient is
// written: a block of a launch without one has no count of its own).
template <typename A>
__device__ __forceinline__ A gradient_scale(const Params<A>& P) {
  return (P.reduction == static_cast<int>(Reduction::Mean) && P.grad != nullptr)
             ? A(1) / static_cast<A>(mean_divisor(P))
             : A(1);
}

// An ignored (fill 0) or invalid (fill NaN) row: its loss and gradient row, without reading the logits.
template <int kGroup, typename scalar_t, typename A>
__device__ __forceinline__ void fill_row(const Params<A>& P, int64_t row, int t, scalar_t* grad_row, A fill) {
  if (t == 0) store_row_loss<scalar_t>(P, row, fill);
  if (grad_row != nullptr) {
    for (int64_t c = t; c < P.num_classes; c += kGroup) grad_row[c] = static_cast<scalar_t>(fill);
  }
}

// Per-row scalars of the gradient (csrc/uncertainty_weights.h): for k ≠ y
//   g_k = scale · (p_k (α + β (p_k^{q-1} - τ)) + [tie] (z_k < z_y ∧ z_k = zb) c_J),
// and g_y = grad_target.
// p_k = e^{(z_k - m) - log d}: subtracting the max first keeps z_k - m exact for the classes that matter (Sterbenz);
// e^{z_k - lse} would carry the rounding of lse = m + log d, an absolute error of ulp(m) in the exponent, i.e. a
// relative error of ~1e-5 in p_k for logits of a few hundred, which a loss-mode Brier gradient multiplies by CE.
template <typename A>
struct RowCoefs {
  WeightCoefficients<A> c;
  A m, d, log_d, zb, grad_target, scale, loss;  // d: Σ_k e^{z_k - m}
  bool tie;
};

template <typename A>
__device__ __forceinline__ RowCoefs<A> row_coefficients(const Params<A>& P, int64_t row, Stats<A> s, A z_y) {
  const A q = P.norm;
  const bool loss_mode = P.mode == static_cast<int>(Mode::Loss);
  A m = s.m, d_others = s.d, sq_others = s.sq;
  if (!(z_y <= m)) {          // the target is the row max (or the only finite class): move the max to it
    if (m != neg_inf<A>()) {  // else the other columns' sums are 0, or NaN from a NaN logit: kept as they are
      d_others *= exp_(m - z_y);
      sq_others *= exp_(q * (m - z_y));
    }
    m = z_y;
  }
  const A e_y = exp_(z_y - m);
  const A d = e_y + d_others;
  const A log_d = log_(d);
  const A p_y = e_y / d;
  const A omp = d_others / d;                                // 1 - p_y without cancellation
  const A ce = class_ce(p_y, e_y, d_others, m, z_y, log_d);  // CE = -log p_y

  const auto weight = static_cast<Weight>(P.weight);
  RowQuantities<A> w{p_y, omp, ce, P.gamma, q, A(1), A(0), A(1), A(0)};
  if (weight == Weight::External) w.external = P.sample_weight[row];
  if (weight == Weight::Focal && P.gamma_per_sample != nullptr) w.gamma = P.gamma_per_sample[row];
  if (P.flsd_schedule) w.gamma = flsd_gamma(flsd_band_probability(z_y, m + log_d), P.gamma);
  if (weight == Weight::DualFocal) {
    w.p_j = (s.zb == neg_inf<A>()) ? A(0) : exp_((s.zb - m) - log_d);
    w.tie_count = static_cast<A>(s.nt > 1 ? s.nt : 1);
  }
  // Σ_{k≠y} p_k^q = Σ_{k≠y} e^{q(z-m)} / d^q, with d ≥ 1 so d^{-q} cannot overflow
  if (weight == Weight::Brier) w.pow_q_others = sq_others == A(0) ? A(0) : sq_others * exp_(-q * log_d);

  RowCoefs<A> r;
  r.c = weight_coefficients(weight, loss_mode, w, q == A(1));
  r.m = m;
  r.d = d;
  r.log_d = log_d;
  r.zb = s.zb;
  r.tie = r.c.c_tie != A(0);
  r.scale = gradient_scale(P);
  r.grad_target = r.c.g_y * r.scale;
  r.loss = r.c.u * ce;
  return r;
}

template <typename A>
__device__ __forceinline__ A grad_element(const RowCoefs<A>& r, A z, A z_y, A q) {
  const A shifted = (z - r.m) - r.log_d;
  const A p = exp_(shifted);
  // p_k^{q-1}, read only when β ≠ 0 (Brier, loss mode, q ≠ 1)
  const A p_qm1 = r.c.beta == A(0) ? A(0) : (q == A(2) ? p : exp_((q - A(1)) * shifted));
  return gradient_element(r.c, p, p_qm1, r.tie && z < z_y && z == r.zb) * r.scale;
}

// The threads of a block of the row kernels: 8 rows of a warp each (kGroup 32), or one row of kGroup threads.
template <int kGroup>
constexpr int kBlockThreads = kGroup == 32 ? 256 : kGroup;

}  // namespace
}  // namespace calibkernels
