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
// Soft targets (label_smoothing a, mix_target m with mix_lambda λ, or a floating (N, C) target; the maths is
// csrc/uncertainty_weights.h's "Soft targets", used as written there) run a second kernel, soft_target_kernel, with
// the same launch shapes, so the hard-target kernel carries no soft-target code. Per row the target distribution is
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
//
//
// Included by rows_<dtype>.cu, one translation unit per logits dtype (row_params.h), each of which defines the two
// launches, cuda_rows::launch_hard_targets and launch_soft_targets, for its dtype (CALIBKERNELS_CUDA_ROWS_FOR).
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <limits>
#include <type_traits>

#include "batch_fold.cuh"
#include "block_reduce.cuh"
#include "row_params.h"
#include "uncertainty_weighted_ce.h"
#include "uncertainty_weights.h"

namespace calibkernels {
namespace {

using cuda_rows::Acc;
using cuda_rows::BatchFold;
using cuda_rows::Params;
using cuda_rows::SoftParams;

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
  A m, log_d, zb, grad_target, scale, loss;
  bool tie;
};

template <typename A>
__device__ __forceinline__ RowCoefs<A> row_coefficients(const Params<A>& P, int64_t row, Stats<A> s, A z_y) {
  const A q = P.norm;
  const bool loss_mode = P.mode == static_cast<int>(Mode::Loss);
  A m = s.m, d_others = s.d, sq_others = s.sq;
  if (!(z_y <= m)) {  // the target is the row max (or the only finite class): move the max to it
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
  const A omp = d_others / d;  // 1 - p_y without cancellation
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

// One row of hard targets (the block's share of the launch): kGroup threads per row (32: a warp per row, 8 rows per
// block; > 32: the whole block), kPT values per thread per tile; kResident: the row is one tile, kept in registers
// between the statistics and the gradient (single read); otherwise the row is streamed tile by tile, twice.
template <typename scalar_t, int kGroup, int kPT, bool kResident>
__device__ __forceinline__ void hard_row(const Params<Acc<scalar_t>>& P) {
  using A = Acc<scalar_t>;
  using T = Tile<scalar_t, A, kGroup, kPT>;
  constexpr int kRowsPerBlock = kGroup == 32 ? 8 : 1;
  constexpr int64_t kTileCols = static_cast<int64_t>(kGroup) * kPT;

  const int t = kGroup == 32 ? (threadIdx.x & 31) : threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (kGroup == 32 ? (threadIdx.x >> 5) : 0);
  if (row >= P.num_rows) return;  // uniform over the row's group (a whole warp, or the block)
  const int64_t C = P.num_classes;
  const A q = P.norm;
  const int64_t y = P.target[row];
  const bool ignored = y == P.ignore_index;
  const bool bad = !ignored && (y < 0 || y >= C);
  scalar_t* grad_row =
      P.grad != nullptr ? static_cast<scalar_t*>(P.grad) + row * P.grad_row_stride : nullptr;

  if (ignored || bad) {  // no read of the logits at all; `y` is never used as an index
    fill_row<kGroup>(P, row, t, grad_row, bad ? std::numeric_limits<A>::quiet_NaN() : A(0));
    return;
  }

  const scalar_t* z_row = static_cast<const scalar_t*>(P.logits) + row * P.logits_row_stride;
  const bool in_aligned = aligned16(z_row);
  const bool out_aligned = grad_row != nullptr && aligned16(grad_row);
  const bool brier = P.weight == static_cast<int>(Weight::Brier);
  const bool dual = P.weight == static_cast<int>(Weight::DualFocal);
  const A z_y = static_cast<A>(z_row[y]);

  Stats<A> s = empty_stats<A>();
  A z[kPT];
  if constexpr (kResident) {
    T::load(z_row, in_aligned, 0, t, C, z);
    accumulate(z, [&](int e) { return T::column(0, t, e); }, C, y, z_y, q, brier, dual, s);
  } else {
    for (int64_t base = 0; base < C; base += kTileCols) {
      T::load(z_row, in_aligned, base, t, C, z);
      accumulate(z, [&](int e) { return T::column(base, t, e); }, C, y, z_y, q, brier, dual, s);
    }
  }
  // Also orders every thread's reads of the row (z_y included) before any gradient write, which matters when the
  // gradient overwrites the logits (inplace op): the warp path synchronises explicitly, the block path inside.
  if constexpr (kGroup == 32) __syncwarp();
  s = group_allreduce<kGroup>(s, q, brier, dual);
  const RowCoefs<A> r = row_coefficients(P, row, s, z_y);
  if (t == 0) store_row_loss<scalar_t>(P, row, r.loss);
  if (grad_row == nullptr) return;

  auto gradient_tile = [&](int64_t base) {
#pragma unroll
    for (int e = 0; e < kPT; ++e) {
      const int64_t col = T::column(base, t, e);
      z[e] = (col == y) ? r.grad_target : grad_element(r, z[e], z_y, q);
    }
    T::store(grad_row, out_aligned, base, t, C, z);
  };
  if constexpr (kResident) {
    gradient_tile(0);
  } else {
    // last tile first: the tiles the statistics pass read last are the likeliest still in L2
    for (int64_t base = ((C - 1) / kTileCols) * kTileCols; base >= 0; base -= kTileCols) {
      T::template load<true>(z_row, in_aligned, base, t, C, z);
      gradient_tile(base);
    }
  }
}

// The hard-target launch: the block's count (batch_fold.cuh), its rows, then the batch's fold in the last block.
template <typename scalar_t, int kGroup, int kPT, bool kResident>
__global__ void __launch_bounds__(kBlockThreads<kGroup>) uncertainty_weighted_ce_kernel(const Params<Acc<scalar_t>> P,
                                                                                         const BatchFold F) {
  begin_rows<kBlockThreads<kGroup>>(P);
  hard_row<scalar_t, kGroup, kPT, kResident>(P);
  finish_rows<kBlockThreads<kGroup>, scalar_t>(P, F, nullptr);
}

// ----------------------------------------------------------------------------------------------------------------
// Soft targets (csrc/uncertainty_weights.h, "Soft targets"): a separate kernel, so the hard-target kernel above is
// untouched. Per row, t_k = c + W_y [k = y] + W_m [k = m] (compact: class indices, an optional mix m with λ, label
// smoothing a; c = a/C) or t_k = (1-a) T_k + c (dense: a floating (N, C) target T).
// ----------------------------------------------------------------------------------------------------------------

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

template <int kGroup, typename A>
__device__ __forceinline__ SoftStats<A> soft_allreduce(const SoftStats<A>& s, A q, bool squares, A top) {
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
  return group_reduce<kGroup>(s, SoftStats<A>{empty_stats<A>(), A(0), 0}, warp_reduce);
}

// Folds a tile into a compact row's statistics: `accumulate` (above) with the mix column mapped onto y, so that both
// are left out, then (`offsets`: smoothing) z - R of every finite logit.
template <typename A, int kPT, typename ColumnOf>
__device__ __forceinline__ void accumulate_soft(const A (&z)[kPT], ColumnOf column_of, int64_t C, int64_t y,
                                                int64_t mix, A z_y, A top, A q, bool squares, bool offsets,
                                                SoftStats<A>& s) {
  const A r_before = reference_point(s.base.m, top);
  accumulate(z, [&](int e) { const int64_t col = column_of(e); return col == mix ? y : col; }, C, y, z_y, q, squares,
             false, s.base);
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
  __device__ __forceinline__ static void load(const target_t* row, bool aligned, int64_t base, int t, int64_t C,
                                              A keep, A add, A (&out)[kPT], TargetCheck<A>* check = nullptr) {
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
  const SoftCoefficients<A> cf = soft_weight_coefficients(static_cast<Weight>(P.weight),
                                                          P.mode == static_cast<int>(Mode::Loss), r,
                                                          r.q == A(2));
  if (lane == 0) store_row_loss<scalar_t>(P, row, cf.u * r.ce);
  return cf;
}

// A compact row (y and m valid; m == y without a mix). Pass 1 is the hard path's online softmax over the columns
// other than y and m, plus smoothing's offsets; z_y and z_m come from one load each. gBS with q ≠ 2 adds a pass for
// S and H over those columns (from registers, or over the L2-resident row when streamed).
template <typename scalar_t, int kGroup, int kPT, bool kResident, typename A>
__device__ __forceinline__ void compact_soft_row(const SoftParams<A>& SP, int64_t row, int lane, int64_t y,
                                                 int64_t mix, scalar_t* grad_row) {
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
  A z[kPT];
  for_each_tile<kResident, kTileCols>(C, false, [&](int64_t base) {
    T::load(z_row, in_aligned, base, lane, C, z);
    accumulate_soft(z, [&](int e) { return T::column(base, lane, e); }, C, y, mix, z_y, top, q, brier && square,
                    c != A(0), s);
  });
  if constexpr (kGroup == 32) __syncwarp();  // every read of the row (z_y, z_m included) before any write
  s = soft_allreduce<kGroup>(s, q, brier && square, top);

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
  const SoftCoefficients<A> cf = soft_row_coefficients<scalar_t>(
      P, row, lane, SoftRowQuantities<A>{omP, P_row, ce, A(0), q, A(1), S, H},
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
      const A g = general ? soft_gradient_element(cf, p, c, p - c, q)
                          : p * (uc.alpha + uc.beta * (p - uc.tau)) + uc.delta;
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
// as Σ_{k≠max} p_k, summed in pass 2, and that column's terms are added after it.
template <typename scalar_t, typename target_t, int kGroup, int kPT, bool kResident, typename A>
__device__ __forceinline__ void dense_soft_row(const SoftParams<A>& SP, int64_t row, int lane, scalar_t* grad_row) {
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
  A z[kPT], t[kPT];
  TargetCheck<A> check;  // in the target's first read: pass 1 of a resident row, pass 2 of a streamed one
  for_each_tile<kResident, kTileCols>(C, false, [&](int64_t base) {
    T::load(z_row, in_aligned, base, lane, C, z);
    if constexpr (kResident) TT::load(t_row, t_aligned, base, lane, C, keep, add, t, &check);
    accumulate(z, [&](int e) { return T::column(base, lane, e); }, C, int64_t(-1), A(0), q, false, false, s);
  });
  if constexpr (kGroup == 32) __syncwarp();
  s = group_allreduce<kGroup>(s, q, false, false);
  const A M = s.m, d = s.d;
  const A log_d = log_(d);
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
  const A rest = r.v[kRest];                    // 1 - p_max of a unique max
  const A t_max = r.v[kTargetAtMax];
  const A d_max = (A(1) - t_max) - rest;        // its p - t
  A omP = r.v[kOneMinusP], S = r.v[kS], H = r.v[kH];
  if (unique_max) {
    omP += t_max * rest;
    if (brier) add_brier_terms(exp_(-log_d), d_max, q, square, S, H);  // p_max as the gradient pass computes it
  }
  const A ce = r.v[kGap] + r.v[kTargetSum] * log_d;
  const SoftCoefficients<A> cf = soft_row_coefficients<scalar_t>(
      P, row, lane, SoftRowQuantities<A>{omP, r.v[kP], ce, A(0), q, A(1), S, H},
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
// `SoftParams::hard.target`), else the element type of the dense target. Launch shape as for the hard kernel.
template <typename scalar_t, typename target_t, int kGroup, int kPT, bool kResident>
__device__ __forceinline__ void soft_row(const SoftParams<Acc<scalar_t>>& SP) {
  using A = Acc<scalar_t>;
  constexpr int kRowsPerBlock = kGroup == 32 ? 8 : 1;
  const Params<A>& P = SP.hard;
  const int lane = kGroup == 32 ? (threadIdx.x & 31) : threadIdx.x;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + (kGroup == 32 ? (threadIdx.x >> 5) : 0);
  if (row >= P.num_rows) return;  // uniform over the row's group
  scalar_t* grad_row =
      P.grad != nullptr ? static_cast<scalar_t*>(P.grad) + row * P.grad_row_stride : nullptr;
  if constexpr (std::is_same<target_t, int64_t>::value) {
    const int64_t C = P.num_classes;
    const int64_t y = P.target[row];
    if (y == P.ignore_index) {  // whatever its mix_target
      fill_row<kGroup>(P, row, lane, grad_row, A(0));
      return;
    }
    const int64_t mix = SP.mix_target != nullptr ? SP.mix_target[row] : y;
    const A lambda = SP.mix_target != nullptr ? SP.mix_lambda[row * SP.lambda_stride] : A(1);
    // a bad target or mix_target is never used as an index; a λ outside [0, 1] (or NaN) makes the row NaN too
    if (y < 0 || y >= C || mix < 0 || mix >= C || lambda_out_of_range(lambda)) {
      fill_row<kGroup>(P, row, lane, grad_row, std::numeric_limits<A>::quiet_NaN());
      return;
    }
    compact_soft_row<scalar_t, kGroup, kPT, kResident>(SP, row, lane, y, mix, grad_row);
  } else {
    dense_soft_row<scalar_t, target_t, kGroup, kPT, kResident>(SP, row, lane, grad_row);
  }
}

// The soft-target launch: the block's count (batch_fold.cuh: class indices), its rows, then the batch's fold in the
// last block (a dense target's row flags included).
template <typename scalar_t, typename target_t, int kGroup, int kPT, bool kResident>
__global__ void __launch_bounds__(kBlockThreads<kGroup>) soft_target_kernel(const SoftParams<Acc<scalar_t>> SP,
                                                                                     const BatchFold F) {
  begin_rows<kBlockThreads<kGroup>>(SP.hard);
  soft_row<scalar_t, target_t, kGroup, kPT, kResident>(SP);
  if constexpr (std::is_same<target_t, int64_t>::value) {  // class indices: a mix is checked with them
    finish_rows<kBlockThreads<kGroup>, scalar_t>(SP.hard, F, SP.row_flags, SP.mix_target, SP.mix_lambda,
                                                 SP.lambda_stride);
  } else {  // a dense target has no mix: no scan of one in its kernels (whose rows are short of registers)
    finish_rows<kBlockThreads<kGroup>, scalar_t>(SP.hard, F, SP.row_flags);
  }
}

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
    using S = decltype(shape);
    launch_rows<S::kGroup>(uncertainty_weighted_ce_kernel<scalar_t, S::kGroup, S::kPT, S::kResident>, P.num_rows, P,
                           F);
  });
}

// target_t: int64_t (class indices) or a dense target's element type, float32 or the logits' (dense_target_for).
template <typename scalar_t, typename target_t, typename A>
void launch_soft(const SoftParams<A>& SP, const BatchFold& F) {
  with_shape<scalar_t>(SP.hard.num_classes, [&](auto shape) {
    using S = decltype(shape);
    launch_rows<S::kGroup>(soft_target_kernel<scalar_t, target_t, S::kGroup, S::kPT, S::kResident>,
                           SP.hard.num_rows, SP, F);
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

}  // namespace
}  // namespace calibkernels

// The two launches for logits of type T (row_params.h), each defined once: the whole of rows_<dtype>.cu.
#define CALIBKERNELS_CUDA_ROWS_FOR(T)                                                                                \
  void calibkernels::cuda_rows::launch_hard_targets(Logits<T>, const Params<Acc<T>>& P, const BatchFold& F) {     \
    launch<T>(P, F);                                                                                                 \
  }                                                                                                                  \
  void calibkernels::cuda_rows::launch_soft_targets(Logits<T>, const SoftParams<Acc<T>>& SP, const BatchFold& F,     \
                                                    at::ScalarType dense_dtype) {                                    \
    if (SP.dense_target != nullptr) {                                                                                \
      launch_dense<T>(SP, F, dense_dtype);                                                                           \
    } else {                                                                                                         \
      launch_soft<T, int64_t>(SP, F);                                                                                \
    }                                                                                                                \
  }
