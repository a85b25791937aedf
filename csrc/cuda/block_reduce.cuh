// Reductions over the threads that share a row (a warp or a block), used by the row kernels (row_kernels.cuh) and by
// the batch's count and fold (batch_fold.cuh).
#pragma once

#include <cstdint>

namespace calibkernels {
namespace {

// All-reduce over the kGroup threads that share a row: a warp (`warp_reduce`, shuffles only) or the whole block
// (then one shared-memory step between the warps, padded with `identity`). S is POD.
template <int kGroup, typename S, typename WarpReduce>
__device__ __forceinline__ S group_reduce(S s, const S& identity, WarpReduce warp_reduce) {
  s = warp_reduce(s);
  if constexpr (kGroup > 32) {
    constexpr int kWarps = kGroup / 32;
    __shared__ S partial[kWarps + 1];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) partial[warp] = s;
    __syncthreads();
    if (warp == 0) {
      S t = lane < kWarps ? partial[lane] : identity;
      t = warp_reduce(t);
      if (lane == 0) partial[kWarps] = t;
    }
    __syncthreads();
    s = partial[kWarps];
  }
  return s;
}

// Sums of K values over a row's threads (the statistics passes after the row's max and log d are known).
template <typename A, int K>
struct Sums {
  A v[K];
};

template <int kGroup, typename A, int K>
__device__ __forceinline__ Sums<A, K> group_sum(const Sums<A, K>& s) {
  auto warp_sum = [](Sums<A, K> x) {
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) {
#pragma unroll
      for (int k = 0; k < K; ++k) x.v[k] += __shfl_xor_sync(0xffffffffu, x.v[k], offset);
    }
    return x;
  };
  return group_reduce<kGroup>(s, Sums<A, K>{}, warp_sum);
}

}  // namespace
}  // namespace calibkernels
