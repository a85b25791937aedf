// Fused CUDA kernel of the uncertainty-weighted cross-entropy family (formulas: docs/losses.md; contract in
// ../uncertainty_weighted_ce.h). Registered for the CUDA dispatch key of the schema in ../calibkernels.cpp.
//
//   L_i = u_i · CE_i,  CE_i = lse_i - z_{i,y_i},  p_i = softmax(z_i),
//   u_i ∈ {1, (1-p_y)^γ (focal; γ per sample optional), (1-p_y)^{γ_i} (FLSD-53), (1-p_y+p_j)^γ (dual focal),
//          (Σ_{k≠y} p_k^q + (1-p_y)^q)^{γ/q} (generalised Brier), w_i (external)}.
//   mode "grad" (GRA): dL_i/dz_ik = u_i (p_ik - δ_ky);  mode "loss": + CE_i du_i/dz_ik with
//     focal / FLSD  du/dz_k = -γ (1-p_y)^{γ-1} p_y (δ_ky - p_k)                      (γ_i of FLSD not differentiated)
//     dual focal    du/dz_k = γ (1-p_y+p_j)^{γ-1} ((p_y - p_j) p_k + p_j τ_k - p_y δ_ky), τ_k = 1/n on the n classes
//                   tied at p_j = max{p_k : z_k < z_y} (how amax's backward splits its gradient in the reference)
//     Brier         du/dz_k = γ S^{γ/q-1} (p_k^q - p_k H) (k≠y),  du/dz_y = -γ S^{γ/q-1} p_y S,
//                   H = Σ_{k≠y} p_k^q - p_y (1-p_y)^{q-1}
//   (Lin et al. 2017; Mukhoti et al. 2020; Tao, Dong & Xu, ICML 2023; BSCE-GRA paper Eq. 3/11; the same formulas as
//   csrc/cpu/uncertainty_weighted_ce.cpp and calibkernels/triton/uncertainty_weighted_ce.py.)
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
//                 shared-memory-resident row of a 1024-thread block (on an H200, 256 threads × 16 values per thread
//                 was the fastest of 256/512 threads × 16/32 values).
//   float64 (gradcheck/opcheck only) has the two warp paths and, above C = 1024, the streaming path (512 threads).
// Every path: 16-byte vector loads/stores for a row whose address is 16-byte aligned (a scalar fallback otherwise and
// for the row's tail), fp32 accumulation for fp16/bf16 (float64 stays float64, for gradcheck), exp2f, int64 offsets,
// any row stride, launched on the current stream with no host synchronisation (the mean's non-ignored count is a
// device tensor that the kernel reads).
//
// Target policy (the Triton kernel's, see calibkernels/cpp/uncertainty_weighted_ce.py VALIDATE_TARGETS): a target
// outside [0, C) that is not ignore_index is never used as an index; that row's loss and gradient are NaN (so a
// mean/sum becomes NaN), and the Python wrapper raises ValueError in eager mode.
#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "uncertainty_weighted_ce.h"
#include "uncertainty_weights.h"

namespace calibkernels {
namespace {

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
  if (r.m == neg_inf<A>()) {  // both empty: e^{-inf - -inf} would be NaN
    r.d = A(0);
    r.sq = A(0);
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

template <typename A>
__device__ __forceinline__ Stats<A> warp_allreduce(Stats<A> s, A q, bool brier, bool dual) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) {
    Stats<A> o;
    o.m = __shfl_xor_sync(0xffffffffu, s.m, offset);
    o.d = __shfl_xor_sync(0xffffffffu, s.d, offset);
    o.sq = brier ? __shfl_xor_sync(0xffffffffu, s.sq, offset) : A(0);
    o.zb = dual ? __shfl_xor_sync(0xffffffffu, s.zb, offset) : s.zb;
    o.nt = dual ? __shfl_xor_sync(0xffffffffu, s.nt, offset) : 0;
    s = merge(s, o, q, brier, dual);
  }
  return s;
}

// All-reduce over the kGroup threads that share a row: a warp (shuffles only) or the whole block.
template <int kGroup, typename A>
__device__ __forceinline__ Stats<A> group_allreduce(Stats<A> s, A q, bool brier, bool dual) {
  s = warp_allreduce(s, q, brier, dual);
  if constexpr (kGroup > 32) {
    constexpr int kWarps = kGroup / 32;
    __shared__ Stats<A> partial[kWarps + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = s;
    __syncthreads();
    if (warp == 0) {
      Stats<A> t = lane < kWarps ? partial[lane] : empty_stats<A>();
      t = warp_allreduce(t, q, brier, dual);
      if (lane == 0) partial[kWarps] = t;
    }
    __syncthreads();
    s = partial[kWarps];
  }
  return s;
}

template <typename A>
struct Params {
  const void* logits;
  int64_t logits_row_stride;  // elements
  void* grad;                 // nullptr: no gradient (inference)
  int64_t grad_row_stride;
  const int64_t* target;
  const A* sample_weight;     // (N,) or nullptr
  const A* gamma_per_sample;  // (N,) or nullptr
  const int64_t* valid_count; // 0-dim, read only for the mean
  A* row_loss;
  int64_t num_rows;
  int64_t num_classes;
  int64_t ignore_index;
  A gamma;
  A norm;
  int weight;
  int mode;
  int reduction;
};

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
  A tile_max = neg_inf<A>();
#pragma unroll
  for (int e = 0; e < kPT; ++e) {
    if (column_of(e) != y) tile_max = z[e] > tile_max ? z[e] : tile_max;
  }
  if (tile_max > s.m) {
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
    if (m == neg_inf<A>()) {
      d_others = A(0);
      sq_others = A(0);
    } else {
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
  // CE = -log p_y; for confident rows log1p(d_¬y / e_y) keeps the digits that m + log(d) - z_y would cancel.
  const A ce = (p_y > A(0.5)) ? log1p_(d_others / e_y) : (m - z_y) + log_d;

  const auto weight = static_cast<Weight>(P.weight);
  RowQuantities<A> w{p_y, omp, ce, P.gamma, q, A(1), A(0), A(1), A(0)};
  if (weight == Weight::External) w.external = P.sample_weight[row];
  if (weight == Weight::Focal && P.gamma_per_sample != nullptr) w.gamma = P.gamma_per_sample[row];
  if (weight == Weight::Flsd) w.gamma = flsd_gamma(flsd_band_probability(z_y, m + log_d), P.gamma);
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
  r.scale = (P.reduction == static_cast<int>(Reduction::Mean))
                ? A(1) / static_cast<A>(*P.valid_count > 1 ? *P.valid_count : int64_t(1))
                : A(1);
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

// kGroup threads per row (32: a warp per row, 8 rows per block; > 32: the whole block), kPT values per thread per
// tile; kResident: the row is one tile, kept in registers between the statistics and the gradient (single read);
// otherwise the row is streamed tile by tile, twice.
template <typename scalar_t, int kGroup, int kPT, bool kResident>
__global__ void __launch_bounds__(kGroup == 32 ? 256 : kGroup)
    uncertainty_weighted_ce_kernel(const Params<typename std::conditional<std::is_same<scalar_t, double>::value,
                                                                          double, float>::type> P) {
  using A = typename std::conditional<std::is_same<scalar_t, double>::value, double, float>::type;
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
    const A fill = bad ? std::numeric_limits<A>::quiet_NaN() : A(0);
    if (t == 0) P.row_loss[row] = fill;
    if (grad_row != nullptr) {
      for (int64_t c = t; c < C; c += kGroup) grad_row[c] = static_cast<scalar_t>(fill);
    }
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
  if (t == 0) P.row_loss[row] = r.loss;
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

template <typename scalar_t, int kGroup, int kPT, bool kResident, typename A>
void launch_config(const Params<A>& P) {
  constexpr int kRowsPerBlock = kGroup == 32 ? 8 : 1;
  constexpr int kThreads = kGroup * kRowsPerBlock;
  const int64_t blocks = (P.num_rows + kRowsPerBlock - 1) / kRowsPerBlock;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "calibkernels::uncertainty_weighted_ce: too many rows");
  uncertainty_weighted_ce_kernel<scalar_t, kGroup, kPT, kResident>
      <<<static_cast<unsigned>(blocks), kThreads, 0, c10::cuda::getCurrentCUDAStream()>>>(P);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Largest C of each path (float32/float16/bfloat16); float64 has only the warp and streaming paths.
constexpr int64_t kWarpSmallMaxC = 32 * 8;
constexpr int64_t kWarpMaxC = 32 * 32;
constexpr int64_t kBlock256MaxC = 256 * 16;

template <typename scalar_t, typename A>
void launch(const Params<A>& P) {
  const int64_t C = P.num_classes;
  if (C <= kWarpSmallMaxC) {
    launch_config<scalar_t, 32, 8, true>(P);
  } else if (C <= kWarpMaxC) {
    launch_config<scalar_t, 32, 32, true>(P);
  } else if constexpr (std::is_same<scalar_t, double>::value) {
    launch_config<scalar_t, 512, 8, false>(P);  // 1024 threads would cap double at 64 registers and spill
  } else if (C <= kBlock256MaxC) {
    launch_config<scalar_t, 256, 16, true>(P);
  } else {
    launch_config<scalar_t, 256, 16, false>(P);
  }
}

// ----------------------------------------------------------------------------------------------------------------
// Host side
// ----------------------------------------------------------------------------------------------------------------
struct Args {
  int64_t weight, mode, reduction, ignore_index;
  double gamma, norm;
};

Args check_args(const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& sample_weight,
                const std::optional<at::Tensor>& gamma_per_sample, int64_t weight, int64_t mode, double gamma,
                double norm, int64_t ignore_index, int64_t reduction) {
  const char* op = "calibkernels::uncertainty_weighted_ce (CUDA): ";
  TORCH_CHECK(logits.is_cuda() && target.device() == logits.device(), op,
              "expected logits and target on the same CUDA device, got ", logits.device(), " and ", target.device());
  check_arguments(op, logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, reduction);
  return {weight, mode, reduction, ignore_index, gamma, norm};
}

// Runs the kernel on `z` (stride(1) == 1 or C == 1, any row stride), writing the gradient to `grad_ptr` (row stride
// `grad_stride`, may alias z) when non-null. Returns the loss: float32 (float64 for float64 logits), 0-dim for
// mean/sum, (N,) for none; the reductions are device ops (no host synchronisation).
at::Tensor run(const at::Tensor& z, void* grad_ptr, int64_t grad_stride, const at::Tensor& target,
               const std::optional<at::Tensor>& sample_weight, const std::optional<at::Tensor>& gamma_per_sample,
               const Args& args) {
  const int64_t n = z.size(0);
  const auto acc_dtype = z.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  at::Tensor row_loss = at::empty({n}, z.options().dtype(acc_dtype));
  const at::Tensor t = target.contiguous();
  // The mean's divisor, counted on the device and read by the kernel (scale of the gradient) and by the division below.
  at::Tensor valid_count;
  if (args.reduction == static_cast<int64_t>(Reduction::Mean)) valid_count = t.ne(args.ignore_index).sum();
  at::Tensor weights, gammas;
  if (sample_weight.has_value()) weights = sample_weight->detach().to(acc_dtype).contiguous();
  if (gamma_per_sample.has_value()) gammas = gamma_per_sample->detach().to(acc_dtype).contiguous();

  if (n > 0) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "uncertainty_weighted_ce_cuda", [&] {
      using A = typename std::conditional<std::is_same<scalar_t, double>::value, double, float>::type;
      Params<A> P;
      P.logits = z.const_data_ptr();
      P.logits_row_stride = z.stride(0);
      P.grad = grad_ptr;
      P.grad_row_stride = grad_stride;
      P.target = t.const_data_ptr<int64_t>();
      P.sample_weight = weights.defined() ? weights.const_data_ptr<A>() : nullptr;
      P.gamma_per_sample = gammas.defined() ? gammas.const_data_ptr<A>() : nullptr;
      P.valid_count = valid_count.defined() ? valid_count.const_data_ptr<int64_t>() : nullptr;
      P.row_loss = row_loss.mutable_data_ptr<A>();
      P.num_rows = n;
      P.num_classes = z.size(1);
      P.ignore_index = args.ignore_index;
      P.gamma = static_cast<A>(args.gamma);
      P.norm = static_cast<A>(args.norm);
      P.weight = static_cast<int>(args.weight);
      P.mode = static_cast<int>(args.mode);
      P.reduction = static_cast<int>(args.reduction);
      launch<scalar_t>(P);
    });
  }
  if (args.reduction == static_cast<int64_t>(Reduction::None)) return row_loss;
  at::Tensor total = row_loss.sum();
  if (args.reduction == static_cast<int64_t>(Reduction::Sum)) return total;
  return total.div(valid_count.clamp_min(1));  // all rows ignored: 0 / 1 = 0, never NaN
}

std::tuple<at::Tensor, at::Tensor> uncertainty_weighted_ce_cuda(
    const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& sample_weight,
    const std::optional<at::Tensor>& gamma_per_sample, int64_t weight, int64_t mode, double gamma, double norm,
    int64_t ignore_index, int64_t reduction, bool compute_grad, const std::optional<at::Tensor>& grad_out) {
  const Args args = check_args(logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm,
                               ignore_index, reduction);
  const char* op = "calibkernels::uncertainty_weighted_ce (CUDA): ";
  if (compute_grad && grad_out.has_value()) check_grad_out(op, logits, *grad_out);
  const c10::cuda::CUDAGuard guard(logits.device());
  // Rows may be strided; columns must be contiguous for the vector loads.
  const bool direct = logits.stride(1) == 1 || logits.size(1) == 1;
  const at::Tensor z = direct ? logits : logits.contiguous();
  // In place each thread overwrites only the elements it read itself, after the row's reduction.
  const at::Tensor dest = gradient_destination(logits, z, compute_grad, grad_out,
                                               [&] { return at::empty({z.size(0), z.size(1)}, z.options()); });
  const at::Tensor loss = run(z, compute_grad ? dest.data_ptr() : nullptr, compute_grad ? dest.stride(0) : 0, target,
                              sample_weight, gamma_per_sample, args);
  return finish_gradient(loss, dest, compute_grad, grad_out);
}

// grad[i, :] *= factor[i · factor_stride] (stride 0: one scalar), skipping rows whose factor is exactly 1: the usual
// loss.backward() (grad_output = 1) then reads one number per block and writes nothing. A persistent grid of a few
// blocks per multiprocessor strides over the rows.
template <typename scalar_t>
__global__ void __launch_bounds__(256) scale_grad_kernel(scalar_t* grad, int64_t num_rows, int64_t num_classes,
                                                         int64_t row_stride, const float* factor,
                                                         int64_t factor_stride) {
  if (factor_stride == 0 && *factor == 1.0f) return;
  for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
    const float f = factor[row * factor_stride];
    if (f == 1.0f) continue;
    scalar_t* g = grad + row * row_stride;
    for (int64_t c = threadIdx.x; c < num_classes; c += blockDim.x) {
      g[c] = static_cast<scalar_t>(static_cast<float>(g[c]) * f);
    }
  }
}

void uncertainty_weighted_ce_scale_grad_cuda(at::Tensor& grad, const at::Tensor& grad_output) {
  const char* op = "calibkernels::uncertainty_weighted_ce_scale_grad_ (CUDA): ";
  TORCH_CHECK(grad.is_cuda() && grad_output.device() == grad.device(), op, "expected grad and grad_output on the same "
              "CUDA device, got ", grad.device(), " and ", grad_output.device());
  TORCH_CHECK(grad.dim() == 2 && (grad.size(1) <= 1 || grad.stride(1) == 1), op, "expected a 2-D gradient with unit "
              "column stride, got shape ", grad.sizes(), " and strides ", grad.strides());
  TORCH_CHECK(grad_output.numel() == 1 || (grad_output.dim() == 1 && grad_output.size(0) == grad.size(0)), op,
              "grad_output must be a scalar or have one entry per row, got shape ", grad_output.sizes());
  if (grad.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  const at::Tensor factor = grad_output.to(at::kFloat).reshape({-1});
  const int64_t factor_stride = factor.numel() == 1 ? 0 : factor.stride(0);
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, grad.get_device()));
  const int64_t blocks = std::min<int64_t>(grad.size(0), 4 * static_cast<int64_t>(sms > 0 ? sms : 1));
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, grad.scalar_type(), "uncertainty_weighted_ce_scale_grad", [&] {
    scale_grad_kernel<scalar_t><<<static_cast<unsigned>(blocks), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
        grad.mutable_data_ptr<scalar_t>(), grad.size(0), grad.size(1), grad.stride(0), factor.const_data_ptr<float>(),
        factor_stride);
  });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace
}  // namespace calibkernels

TORCH_LIBRARY_IMPL(calibkernels, CUDA, m) {
  m.impl("uncertainty_weighted_ce", &calibkernels::uncertainty_weighted_ce_cuda);
  m.impl("uncertainty_weighted_ce_scale_grad_", &calibkernels::uncertainty_weighted_ce_scale_grad_cuda);
}
