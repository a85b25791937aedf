// The hard-target row kernel (class indices, no smoothing or mix): uncertainty_weighted_ce_kernel, launched by
// row_kernels.cuh with one of its launch shapes (a warp or a block per row, the row in registers or streamed).
#pragma once

#include <cstdint>
#include <limits>

#include "batch_fold.cuh"
#include "row_params.h"
#include "row_statistics.cuh"
#include "uncertainty_weighted_ce.h"

namespace calibkernels {
namespace {

using cuda_rows::Acc;
using cuda_rows::BatchFold;
using cuda_rows::Params;

// One row of hard targets (the block's share of the launch): kGroup threads per row (32: a warp per row, 8 rows per
// block; > 32: the whole block), kPT values per thread per tile; kResident: the row is one tile, kept in registers
// between the statistics and the gradient (single read); otherwise the row is streamed tile by tile, twice. kStats:
// the row's top-label statistics into F's (return_stats), taken in the first pass.
template <typename scalar_t, int kGroup, int kPT, bool kResident, bool kStats>
__device__ __forceinline__ void hard_row(const Params<Acc<scalar_t>>& P, const BatchFold& F) {
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
  scalar_t* grad_row = P.grad != nullptr ? static_cast<scalar_t*>(P.grad) + row * P.grad_row_stride : nullptr;

  const scalar_t* z_row = static_cast<const scalar_t*>(P.logits) + row * P.logits_row_stride;
  if (ignored || bad) {  // no read of the logits for the loss; `y` is never used as an index
    if constexpr (kStats) {
      if (bad) {
        top_label_only<scalar_t, kGroup, kPT, A>(F, z_row, row, C, t, [](A(&)[kPT], int64_t) {});
      } else if (t == 0) {
        store_ignored_top_label(F, row);
      }
    }
    fill_row<kGroup>(P, row, t, grad_row, bad ? std::numeric_limits<A>::quiet_NaN() : A(0));
    return;
  }

  const bool in_aligned = aligned16(z_row);
  const bool out_aligned = grad_row != nullptr && aligned16(grad_row);
  const bool brier = P.weight == static_cast<int>(Weight::Brier);
  const bool dual = P.weight == static_cast<int>(Weight::DualFocal);
  const A z_y = static_cast<A>(z_row[y]);

  Stats<A> s = empty_stats<A>();
  TopLabel<A> best = empty_top_label<A>();
  A z[kPT];
  if constexpr (kResident) {
    T::load(z_row, in_aligned, 0, t, C, z);
    accumulate(z, [&](int e) { return T::column(0, t, e); }, C, y, z_y, q, brier, dual, s);
    track_top_label<kStats>(z, [&](int e) { return T::column(0, t, e); }, best);
  } else {
    for (int64_t base = 0; base < C; base += kTileCols) {
      T::load(z_row, in_aligned, base, t, C, z);
      accumulate(z, [&](int e) { return T::column(base, t, e); }, C, y, z_y, q, brier, dual, s);
      track_top_label<kStats>(z, [&](int e) { return T::column(base, t, e); }, best);
    }
  }
  // Also orders every thread's reads of the row (z_y included) before any gradient write, which matters when the
  // gradient overwrites the logits (inplace op): the warp path synchronises explicitly, the block path inside.
  if constexpr (kGroup == 32) __syncwarp();
  s = group_allreduce<kGroup, kStats>(s, q, brier, dual, best);
  const RowCoefs<A> r = row_coefficients(P, row, s, z_y);
  if (t == 0) {
    store_row_loss<scalar_t>(P, row, r.loss);
    if constexpr (kStats) store_top_label(F, row, best, r.d);  // r.m is the row's max
  }
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
template <typename scalar_t, int kGroup, int kPT, bool kResident, bool kStats>
__global__ void __launch_bounds__(kBlockThreads<kGroup>)
    uncertainty_weighted_ce_kernel(const Params<Acc<scalar_t>> P, const BatchFold F) {
  begin_rows<kBlockThreads<kGroup>>(P);
  hard_row<scalar_t, kGroup, kPT, kResident, kStats>(P, F);
  finish_rows<kBlockThreads<kGroup>, scalar_t>(P, F, nullptr);
}

}  // namespace
}  // namespace calibkernels
