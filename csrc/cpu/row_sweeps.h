// The generic vector sweeps over a row of the CPU kernel (ATen's Vectorized<T> at the width of the translation
// unit's instruction set): the online softmax of the two-sweep path, the dual-focal max and tie count, the gradient
// sweep, and the one-exponential path's exponential and rescaling sweeps (their AVX-512 forms are in vec_exp.h).
// Included by uncertainty_weighted_ce_kernel.h, whose process_row drives them.
#pragma once

#if !defined(CPU_CAPABILITY) || !defined(CALIBKERNELS_ISA)
#error "include csrc/cpu/row_sweeps.h from a kernel_<isa>.cpp that defines CPU_CAPABILITY"
#endif

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>

#include "cpu/vec_exp.h"

namespace calibkernels {
namespace CALIBKERNELS_ISA {
namespace {

using at::vec::Vectorized;

// How the gradient sweep needs p_k^q (the gBS weight in "loss" mode): not at all, p², p, or exp(q (z - lse)).
enum class PowQ { None, Square, Linear, General };

template <typename T>
T horizontal_sum(const Vectorized<T>& v) {
  alignas(64) T lanes[Vectorized<T>::size()];
  v.store(lanes);
  T total = 0;
  for (int64_t i = 0; i < Vectorized<T>::size(); ++i) total += lanes[i];
  return total;
}

template <typename T>
T horizontal_max(const Vectorized<T>& v) {
  alignas(64) T lanes[Vectorized<T>::size()];
  v.store(lanes);
  T best = lanes[0];
  for (int64_t i = 1; i < Vectorized<T>::size(); ++i) best = std::max(best, lanes[i]);
  return best;
}

// Running state of the online softmax over the non-target columns.
template <typename T>
struct OnlineSoftmax {
  T max = -std::numeric_limits<T>::infinity();
  Vectorized<T> sum{T(0)};        // Σ exp(z_k - max)
  Vectorized<T> sum_pow_q{T(0)};  // Σ exp(q (z_k - max))   (gBS only)
};

// Fold z[lo, hi) into the online softmax, one cache-sized block at a time: the block's max is taken first, the
// accumulators are rescaled once if it moved the running max, then the block's exponentials are summed (one exp
// per element; a per-element online update would need two).
template <typename T, PowQ kPow>
void accumulate(const T* z, int64_t lo, int64_t hi, T q, OnlineSoftmax<T>& acc) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t kBlock = 64 * W;
  const T neg_inf = -std::numeric_limits<T>::infinity();
  for (int64_t begin = lo; begin < hi; begin += kBlock) {
    const int64_t end = std::min(begin + kBlock, hi);
    Vec block_max(neg_inf);
    int64_t k = begin;
    for (; k + W <= end; k += W) block_max = at::vec::maximum(block_max, Vec::loadu(z + k));
    if (k < end) block_max = at::vec::maximum(block_max, Vec::set(Vec(neg_inf), Vec::loadu(z + k, end - k), end - k));
    const T new_max = horizontal_max(block_max);
    if (new_max > acc.max) {
      const T shift = acc.max - new_max;  // -inf on the first finite block: the sums are still 0
      acc.sum = acc.sum * Vec(std::exp(shift));
      if constexpr (kPow == PowQ::Square) acc.sum_pow_q = acc.sum_pow_q * Vec(std::exp(2 * shift));
      if constexpr (kPow == PowQ::General) acc.sum_pow_q = acc.sum_pow_q * Vec(std::exp(q * shift));
      acc.max = new_max;
    }
    // Only -inf or NaN so far: the terms are taken against 0 instead (exp(-inf - -inf) would be NaN), so that -inf
    // adds 0 and a NaN logit, which the max skips, still makes the sum (and the row) NaN.
    const Vec max_vec(acc.max == neg_inf ? T(0) : acc.max);
    const Vec q_vec(q);
    // Per-block partial sums, added to the running sums once per block: two-level summation keeps the rounding
    // error at O((block + C/block) eps) instead of O(C/W eps) for C in the 10^5 range.
    Vec block_sum(T(0)), block_sum_pow_q(T(0));
    auto add = [&](const Vec& x) {
      const Vec shifted = x - max_vec;
      const Vec e = exp_nonpositive(shifted);
      block_sum = block_sum + e;
      if constexpr (kPow == PowQ::Square) block_sum_pow_q = at::vec::fmadd(e, e, block_sum_pow_q);
      if constexpr (kPow == PowQ::General) block_sum_pow_q = block_sum_pow_q + exp_nonpositive(shifted * q_vec);
    };
    for (k = begin; k + W <= end; k += W) add(Vec::loadu(z + k));
    if (k < end) add(Vec::set(Vec(neg_inf), Vec::loadu(z + k, end - k), end - k));
    acc.sum = acc.sum + block_sum;
    if constexpr (kPow == PowQ::Square || kPow == PowQ::General) acc.sum_pow_q = acc.sum_pow_q + block_sum_pow_q;
  }
}

// max{z_k : z_k < z_y} (-inf if none) and, if wanted, how many columns attain it (the reference's amax splits its
// gradient evenly between tied maxima).
template <typename T>
T max_below(const T* z, int64_t C, T z_target) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec neg_inf(-std::numeric_limits<T>::infinity());
  const Vec zy(z_target);
  Vec best = neg_inf;
  int64_t k = 0;
  for (; k + W <= C; k += W) {
    const Vec x = Vec::loadu(z + k);
    best = at::vec::maximum(best, Vec::blendv(neg_inf, x, x < zy));
  }
  if (k < C) {
    const Vec x = Vec::set(neg_inf, Vec::loadu(z + k, C - k), C - k);
    best = at::vec::maximum(best, Vec::blendv(neg_inf, x, x < zy));
  }
  return horizontal_max(best);
}

template <typename T>
int64_t count_equal(const T* z, int64_t C, T value) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec v(value), one(T(1)), zero(T(0));
  Vec count = zero;  // exact in float up to 2^24 hits per lane
  int64_t k = 0;
  for (; k + W <= C; k += W) count = count + Vec::blendv(zero, one, Vec::loadu(z + k) == v);
  T total = horizontal_sum(count);
  for (; k < C; ++k) total += (z[k] == value) ? T(1) : T(0);
  return static_cast<int64_t>(total);
}

// g_k = p_k (α + β (p_k^{q-1} - τ)) + [z_k == z_j] c_J with p_k = exp((z_k - m) - log d): the max is subtracted
// first (exact for the classes that matter), where exp(z_k - lse) would carry lse's rounding, ulp(m), into every
// p_k (~1e-5 relative for logits of a few hundred, then multiplied by CE in "loss" mode). The gBS term keeps the
// difference p_k^{q-1} - τ per element (it cancels exactly for a one-hot p; folding it into α would amplify the
// rounding of α by CE·K). `out` may alias `z` (in-place gradient): each vector is loaded before it is overwritten.
template <typename T, PowQ kPow, bool kTies>
void gradient_sweep(const T* z, T* out, int64_t C, T m, T log_denom, T alpha, T beta, T q, T tau, T z_j, T c_j) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec m_vec(m), log_denom_vec(log_denom), alpha_vec(alpha), beta_vec(beta), qm1_vec(q - 1), tau_vec(tau),
      zj_vec(z_j), cj_vec(c_j), zero(T(0));
  auto grad = [&](const Vec& x) {
    const Vec shifted = (x - m_vec) - log_denom_vec;
    const Vec p = exp_nonpositive(shifted);
    Vec coef = alpha_vec;
    if constexpr (kPow == PowQ::Square) coef = at::vec::fmadd(beta_vec, p - tau_vec, coef);
    if constexpr (kPow == PowQ::General) coef = at::vec::fmadd(beta_vec, (shifted * qm1_vec).exp_u20() - tau_vec, coef);
    Vec g = p * coef;
    // where p_k underflows to 0, p_k^{q-1} (q < 1) can overflow: 0 · inf. The term is p_k^q, whose limit is 0.
    if constexpr (kPow == PowQ::General) g = Vec::blendv(g, zero, p == zero);
    if constexpr (kTies) g = g + Vec::blendv(zero, cj_vec, x == zj_vec);
    return g;
  };
  int64_t k = 0;
  for (; k + W <= C; k += W) grad(Vec::loadu(z + k)).store(out + k);
  if (k < C) grad(Vec::loadu(z + k, C - k)).store(out + k, C - k);
}

// The one-exponential path (used whenever the gradient sweep needs nothing but p_k): e_k = exp(z_k - m) is computed
// once, with m the target logit (or, for rows where that would leave the sums' range, the row max below; see
// process_row), summed into the accumulators and, when a gradient is written, stored in the gradient row; the
// gradient sweep then only rescales e_k (p_k = e_k / denom) instead of evaluating a second exponential. The row is in
// L1/L2 between the sweeps, and exp is what bounds the kernel on a CPU (so one exponential per element, where the
// two-sweep form takes two; without a gradient too, the online softmax of `accumulate`, which rescales per block, is
// the slower form). `out` may alias `z` (in-place gradient).
template <typename T>
T row_max(const T* z, int64_t C) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec neg_inf(-std::numeric_limits<T>::infinity());
  Vec best = neg_inf;
  int64_t k = 0;
  for (; k + W <= C; k += W) best = at::vec::maximum(best, Vec::loadu(z + k));
  if (k < C) best = at::vec::maximum(best, Vec::set(neg_inf, Vec::loadu(z + k, C - k), C - k));
  return horizontal_max(best);
}

// The logits' top label of a row, for the op's return_stats (calibkernels.loss_stats.top_label_stats): the row max
// (NaN when the row holds a NaN: at::vec::maximum propagates it) and the first column holding it (the first NaN's), as
// torch.amax and torch.argmax. A max sweep and a scan that stops at the first maximum, over a row the loss sweeps read
// next (or just read): cache traffic, no exponential.
template <typename T>
struct TopLabel {
  T max;
  int64_t index;
};

// The normaliser of a row's softmax as its loss pass took it: denom = Σ_k exp(z_k - ref) for the reference point
// `ref` of its exponentials (the target logit or the row max), so that max_k p_k = exp(max z - ref) / denom.
template <typename T>
struct RowNormaliser {
  T ref;
  T denom;
};

template <typename T>
TopLabel<T> row_top_label(const T* z, int64_t C) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec neg_inf(-std::numeric_limits<T>::infinity());
  // four running maxima: one would be a chain of dependent NaN-propagating maxima (a max, a compare and an or each)
  Vec best0 = neg_inf, best1 = neg_inf, best2 = neg_inf, best3 = neg_inf;
  int64_t k = 0;
  for (; k + 4 * W <= C; k += 4 * W) {
    best0 = at::vec::maximum(best0, Vec::loadu(z + k));
    best1 = at::vec::maximum(best1, Vec::loadu(z + k + W));
    best2 = at::vec::maximum(best2, Vec::loadu(z + k + 2 * W));
    best3 = at::vec::maximum(best3, Vec::loadu(z + k + 3 * W));
  }
  for (; k + W <= C; k += W) best0 = at::vec::maximum(best0, Vec::loadu(z + k));
  if (k < C) best1 = at::vec::maximum(best1, Vec::set(neg_inf, Vec::loadu(z + k, C - k), C - k));
  const Vec best = at::vec::maximum(at::vec::maximum(best0, best1), at::vec::maximum(best2, best3));
  alignas(64) T lanes[W];
  best.store(lanes);
  T top = lanes[0];
  bool has_nan = false;
  for (int64_t i = 0; i < W; ++i) {
    has_nan |= std::isnan(lanes[i]);
    top = std::max(top, lanes[i]);
  }
  if (has_nan) {
    for (k = 0; k < C; ++k) {
      if (std::isnan(z[k])) return {std::numeric_limits<T>::quiet_NaN(), k};
    }
  }
  // zero_mask() of a compare has a bit set for each lane that is not equal (all-ones lanes are not 0)
  const Vec top_vec(top);
  constexpr int kAllLanes = (1 << W) - 1;
  for (k = 0; k + W <= C; k += W) {
    const int not_equal = (Vec::loadu(z + k) == top_vec).zero_mask();
    if (not_equal != kAllLanes) return {top, k + __builtin_ctz(static_cast<unsigned>(~not_equal & kAllLanes))};
  }
  for (; k < C; ++k) {
    if (z[k] == top) return {top, k};
  }
  return {top, 0};  // not reached: some column holds the max
}

// out[k] = exp(z[k] - m) for k in [lo, hi) (kStore; nothing is written otherwise); returns Σ exp(z[k] - m) and
// (kSquare) Σ exp(z[k] - m)², block-wise two-level sums. Prefetches z[k + ahead] along the way (0: nothing new).
// kShift (soft targets with label smoothing): also adds Σ (z[k] - m) over [lo, hi) to *shift_sum.
template <typename T, bool kSquare, bool kStore, bool kShift = false>
void exp_store_sweep(const T* z, T* out, int64_t lo, int64_t hi, T m, T& sum, T& sum_sq, int64_t ahead,
                     T* shift_sum = nullptr) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr int64_t kBlock = 64 * W;
  const Vec max_vec(m);
  Vec total(T(0)), total_sq(T(0)), shifts(T(0));
  for (int64_t begin = lo; begin < hi; begin += kBlock) {
    const int64_t end = std::min(begin + kBlock, hi);
    Vec block(T(0)), block_sq(T(0));
    int64_t k = begin;
    for (; k + W <= end; k += W) {
      __builtin_prefetch(z + k + ahead);
      const Vec shifted = Vec::loadu(z + k) - max_vec;
      if constexpr (kShift) shifts = shifts + shifted;
      const Vec e = exp_nonpositive(shifted);
      if constexpr (kStore) e.store(out + k);
      block = block + e;
      if constexpr (kSquare) block_sq = at::vec::fmadd(e, e, block_sq);
    }
    if (k < end) {
      const int64_t rest = end - k;
      // lanes past `rest` are loaded as 0 by loadu(ptr, count); mask them out of the sums
      const Vec shifted = Vec::loadu(z + k, rest) - max_vec;
      if constexpr (kShift) shifts = shifts + Vec::set(Vec(T(0)), shifted, rest);
      const Vec e = Vec::set(Vec(T(0)), exp_nonpositive(shifted), rest);
      if constexpr (kStore) e.store(out + k, rest);
      block = block + e;
      if constexpr (kSquare) block_sq = at::vec::fmadd(e, e, block_sq);
    }
    total = total + block;
    if constexpr (kSquare) total_sq = total_sq + block_sq;
  }
  sum += horizontal_sum(total);
  if constexpr (kSquare) sum_sq += horizontal_sum(total_sq);
  if constexpr (kShift) *shift_sum += horizontal_sum(shifts);
}

// out_k = g_k = p_k (α + β (p_k - τ)) with p_k = e_k · inv_denom, from the stored exponentials `e` (out may be e);
// plus δ (kDelta: soft targets' constant target columns).
template <typename T, bool kSquare, bool kDelta = false>
void rescale_sweep(const T* e, T* out, int64_t C, T inv_denom, T alpha, T beta, T tau, T delta = T(0)) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec inv_vec(inv_denom), alpha_vec(alpha), beta_vec(beta), tau_vec(tau), delta_vec(delta);
  auto grad = [&](const Vec& x) {
    const Vec p = x * inv_vec;
    const Vec coef = kSquare ? at::vec::fmadd(beta_vec, p - tau_vec, alpha_vec) : alpha_vec;
    if constexpr (kDelta) return at::vec::fmadd(p, coef, delta_vec);
    return p * coef;
  };
  int64_t k = 0;
  for (; k + W <= C; k += W) grad(Vec::loadu(e + k)).store(out + k);
  if (k < C) grad(Vec::loadu(e + k, C - k)).store(out + k, C - k);
}

}  // namespace
}  // namespace CALIBKERNELS_ISA
}  // namespace calibkernels
