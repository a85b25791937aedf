// Vectorised exp for non-positive arguments, and the AVX-512 form of the CPU kernel's hot row sweeps.
//
// Why a kernel-specific exp: almost every exponential the kernel takes is exp(z - m) with m ≥ z (the row max, or lse),
// so the argument is ≤ 0 (or -inf, or NaN). The exception is the exponential sweep referenced to the target logit
// (process_row), whose arguments can be positive; it redoes from the row max any row where one exceeds ≈ 41, so
// positive arguments need the same accuracy up to there and only a finite or infinite (never a wrapped or garbage)
// result beyond: both forms clamp the argument from above (AVX-512 at 104, so exp overflows to inf; AVX2 at 88). The
// exponential bounds the kernel on a CPU (the sweep is limited by the FMA pipes), so its instruction count is the
// kernel's speed: 11 vector instructions, against ≈ 20 for ATen's exp_u20. Maximum relative error, measured against
// double exp on 2^24-point grids (normal results only; both ISAs): 2.0e-7 on [-20, 0], 3.0e-7 on [0, 42], 3.9e-7 on
// [-86, 0] (both forms return 0 below -86), i.e. at most about 3 ulps, where exp_u20 is allowed 20. The largest errors
// are on the smallest results (below e^-20, where they are negligible against the row's sum) and on the positive side
// of target-referenced rows.
//
// Algorithm: n = round(x log2 e), r = x - n ln2 in one FMA (the product n·ln2 is exact inside it, so r is off only
// by n times the rounding of ln2 to float, ≤ 3e-7 relative for |n| ≤ 150), exp(r) ≈ 1 + r + c2 r² + … + c5 r⁵ on
// |r| ≤ ln2/2 (Horner, five FMAs), then scaled by 2^n: three FMAs per vector fewer than Cephes' expf form (a two-FMA
// reduction and a degree-7 polynomial, ≤ 1.2e-7), for an error still within a few ulps.
//   * AVX2: 2^n is added to the exponent bits; x is clamped to [-86, 88] (so 2^n·exp(r) stays a normal number) and
//     results below exp(-86) ≈ 4.5e-38 (≈ FLT_MIN) are flushed to exactly 0, which also gives exp(-inf) = 0.
//   * AVX-512: vscalefps scales by 2^n with overflow to inf past exp(88.7) (x is clamped above at 104); results
//     below exp(-86) are flushed to exactly 0 by its zero-masking, as in the AVX2 form (no denormal ever comes out:
//     each one costs a microcode assist on Intel cores), so exp(-inf) = 0 and exp(+inf) = inf too.
//   * NaN propagates (the clamps take NaN from their second operand, and both flushes keep unordered lanes), so a
//     NaN logit gives a NaN row, as in the reference.
//
// Why AVX-512 sweeps with a target attribute (and not a second -march build of the whole kernel): only the three
// float sweeps of the one-exponential path (row max, exp + store + sums, rescale) are written with AVX-512
// intrinsics, in functions with internal linkage compiled for avx512f/avx512dq; the rest of the extension stays
// x86-64-v3, so no inline function of a shared header is ever emitted with AVX-512 instructions (which the linker
// could pick for a machine without them). They are used only when the CPU has AVX-512 *and* ATen uses it (so
// ATEN_CPU_CAPABILITY=avx2 turns them off, as it does for ATen's own kernels). They beat the AVX2 sweeps even on
// cores with 256-bit datapaths, such as Zen 4 (docs/performance.md).
#pragma once

#include <ATen/cpu/vec/vec.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <utility>

#if defined(__x86_64__) && defined(__GNUC__) && defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#define CALIBKERNELS_HAVE_AVX512_SWEEPS 1
#else
#define CALIBKERNELS_HAVE_AVX512_SWEEPS 0
#endif

namespace calibkernels {
namespace {

// exp(r) ≈ 1 + r + c2 r² + c3 r³ + c4 r⁴ + c5 r⁵ on |r| ≤ ln2/2: the minimax polynomial for relative error with the
// constant and linear terms held at 1 (so exp(0) = 1 exactly), computed by linear programming (scipy linprog) on 4001
// points of the interval and rounded to float; its own error is 7.4e-8.
constexpr float kExpC2 = 0.49999040365219116f;
constexpr float kExpC3 = 0.16666938364505768f;
constexpr float kExpC4 = 0.041908301413059235f;
constexpr float kExpC5 = 0.008325801230967045f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2 = 0.693147180559945309f;

// Generic form: ATen's exp (float64, builds without AVX2). Only the float AVX2 overload below is specialised.
template <typename T>
at::vec::Vectorized<T> exp_nonpositive(const at::vec::Vectorized<T>& x) {
  return x.exp_u20();
}

#if defined(CPU_CAPABILITY_AVX2)
inline at::vec::Vectorized<float> exp_nonpositive(const at::vec::Vectorized<float>& vec) {
  const __m256 x_in = vec;
  const __m256 lowest = _mm256_set1_ps(-86.0f);
  // true for x ≥ -86 and for NaN (unordered), so NaN survives the flush below
  const __m256 keep = _mm256_cmp_ps(x_in, lowest, _CMP_NLT_UQ);
  // NaN in the second operand is returned as is. The upper clamp keeps 2^n in the exponent field for the positive
  // arguments of target-referenced rows (exp(88) ≈ 1.7e38 is past their range check, so it decides nothing).
  const __m256 x = _mm256_min_ps(_mm256_set1_ps(88.0f), _mm256_max_ps(lowest, x_in));
  const __m256 n =
      _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(kLn2), x);
  __m256 p = _mm256_fmadd_ps(_mm256_set1_ps(kExpC5), r, _mm256_set1_ps(kExpC4));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC3));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(kExpC2));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.0f));
  const __m256i two_to_n = _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23);
  const __m256 result = _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), two_to_n));
  return _mm256_and_ps(result, keep);
}
#endif

#if CALIBKERNELS_HAVE_AVX512_SWEEPS
namespace avx512 {

#define CALIBKERNELS_AVX512 __attribute__((target("avx512f,avx512dq")))

constexpr int64_t kWidth = 16;
// Two-level summation, as in the generic sweeps: per-block partial sums keep the rounding error at
// O((block + C/block) eps) for C in the 10^5 range.
constexpr int64_t kBlock = 64 * kWidth;

CALIBKERNELS_AVX512 inline __mmask16 tail_mask(int64_t count) { return static_cast<__mmask16>((1u << count) - 1u); }

// kBelowMax: x is z - max z of its row, so the upper clamp has nothing to do and is left out (a NaN in the row may
// lose the max and leave a positive x; that row's sums are NaN anyway).
template <bool kBelowMax = false>
CALIBKERNELS_AVX512 inline __m512 exp_nonpositive(__m512 x) {
  // Results below exp(-86) ≈ 4.5e-38 (just above FLT_MIN) are flushed to exactly 0 by zero-masking, as the AVX2 form
  // does: vscalefps would round them through the denormals, and on Intel cores each denormal or underflowing result
  // costs a microcode assist of some hundred cycles. That matters for the lanes past a row (-inf), which every row
  // whose C is not a multiple of 16 has (ImageNet's 1000 classes, CIFAR's 10 and 100). The mask keeps NaN
  // (unordered), so a NaN logit still gives a NaN row. -inf and arguments too negative for the range reduction are
  // masked from the reduction's FMA on (where -inf would compute inf - inf) to the scaling, so those lanes raise no
  // floating-point exception and their garbage never reaches the result. The upper clamp at 104 (exp overflows to inf
  // past 88.7) keeps positive arguments of target-referenced rows finite through the reduction, so +inf gives inf; it
  // returns NaN from its second operand.
  const __mmask16 keep = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-86.0f), _CMP_NLT_UQ);
  if constexpr (!kBelowMax) x = _mm512_min_ps(_mm512_set1_ps(104.0f), x);
  const __m512 n =
      _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(kLog2e)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_maskz_fnmadd_ps(keep, n, _mm512_set1_ps(kLn2), x);
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(kExpC5), r, _mm512_set1_ps(kExpC4));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC3));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(kExpC2));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_maskz_scalef_ps(keep, p, n);
}

// max_k z[k] over [0, C). A NaN may or may not win the max; either way exp_store_sweep turns it into a NaN sum.
CALIBKERNELS_AVX512 inline float row_max(const float* z, int64_t C) {
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  __m512 best = neg_inf;
  int64_t k = 0;
  for (; k + kWidth <= C; k += kWidth) best = _mm512_max_ps(best, _mm512_loadu_ps(z + k));
  if (k < C) best = _mm512_max_ps(best, _mm512_mask_loadu_ps(neg_inf, tail_mask(C - k), z + k));
  return _mm512_reduce_max_ps(best);
}

// out[k] = exp(z[k] - m) for every k in [0, C) (kStore; out may alias z); returns Σ_{k≠skip} exp(z[k] - m) and
// (kSquare) Σ_{k≠skip} exp(z[k] - m)². The target column `skip` is left out of the sums lane-wise, so a row needs
// one sweep and the sums carry no "total - e_y" cancellation.
// z[k + ahead] is prefetched alongside (process_row: a row's first sweep, whose reads would otherwise start cold;
// ahead = 0 touches only the line being loaded). kShift (soft targets with label smoothing): also adds
// Σ_k (z[k] - m) over every column to *shift_sum.
template <bool kSquare, bool kStore, bool kShift = false>
CALIBKERNELS_AVX512 void exp_store_sweep(const float* z, float* out, int64_t C, int64_t skip, float m, float& sum,
                                         float& sum_sq, int64_t ahead, float* shift_sum = nullptr) {
  const __m512 max_vec = _mm512_set1_ps(m);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const int64_t skip_vec = skip - skip % kWidth;
  const __mmask16 skip_lane_off = static_cast<__mmask16>(~(1u << (skip % kWidth)));
  __m512 total = _mm512_setzero_ps(), total_sq = _mm512_setzero_ps(), shifts = _mm512_setzero_ps();
  for (int64_t begin = 0; begin < C; begin += kBlock) {
    const int64_t end = begin + kBlock < C ? begin + kBlock : C;
    __m512 block = _mm512_setzero_ps(), block_sq = _mm512_setzero_ps();
    auto add = [&](__m512 e, __mmask16 lanes) CALIBKERNELS_AVX512 {
      block = _mm512_mask_add_ps(block, lanes, block, e);
      if constexpr (kSquare) block_sq = _mm512_mask3_fmadd_ps(e, e, block_sq, lanes);
    };
    int64_t k = begin;
    for (; k + kWidth <= end; k += kWidth) {
      _mm_prefetch(reinterpret_cast<const char*>(z + k + ahead), _MM_HINT_T0);
      const __m512 shifted = _mm512_sub_ps(_mm512_loadu_ps(z + k), max_vec);
      if constexpr (kShift) shifts = _mm512_add_ps(shifts, shifted);
      const __m512 e = exp_nonpositive(shifted);
      if constexpr (kStore) _mm512_storeu_ps(out + k, e);
      add(e, k == skip_vec ? skip_lane_off : static_cast<__mmask16>(0xFFFF));
    }
    if (k < end) {
      // lanes past the row are -inf, so their exponential is 0 (and they are masked out of the store and sums)
      const __mmask16 lanes = tail_mask(end - k);
      const __m512 shifted = _mm512_sub_ps(_mm512_mask_loadu_ps(neg_inf, lanes, z + k), max_vec);
      if constexpr (kShift) shifts = _mm512_mask_add_ps(shifts, lanes, shifts, shifted);
      const __m512 e = exp_nonpositive(shifted);
      if constexpr (kStore) _mm512_mask_storeu_ps(out + k, lanes, e);
      add(e, k == skip_vec ? static_cast<__mmask16>(lanes & skip_lane_off) : lanes);
    }
    total = _mm512_add_ps(total, block);
    if constexpr (kSquare) total_sq = _mm512_add_ps(total_sq, block_sq);
  }
  sum += _mm512_reduce_add_ps(total);
  if constexpr (kSquare) sum_sq += _mm512_reduce_add_ps(total_sq);
  if constexpr (kShift) *shift_sum += _mm512_reduce_add_ps(shifts);
}

// g_k = p_k (α + β (p_k - τ)) (kSquare) or α p_k, plus δ (kDelta: soft targets' constant target columns), with
// p_k = e_k · inv_denom: the gradient that both rescale sweeps write, in one place so that their results are
// bit-identical (test_streaming_stores_agree_with_ordinary_stores).
template <bool kSquare, bool kDelta = false>
CALIBKERNELS_AVX512 inline __m512 gradient_of_exponential(__m512 e, __m512 inv_denom, __m512 alpha, __m512 beta,
                                                          __m512 tau, __m512 delta = _mm512_setzero_ps()) {
  const __m512 p = _mm512_mul_ps(e, inv_denom);
  const __m512 coef = kSquare ? _mm512_fmadd_ps(beta, _mm512_sub_ps(p, tau), alpha) : alpha;
  if constexpr (kDelta) return _mm512_fmadd_ps(p, coef, delta);
  return _mm512_mul_ps(p, coef);
}

// out = gradient_of_exponential(e) (out may be e).
template <bool kSquare, bool kDelta = false>
CALIBKERNELS_AVX512 void rescale_sweep(const float* e, float* out, int64_t C, float inv_denom, float alpha, float beta,
                                       float tau, float delta = 0.0f) {
  const __m512 inv_vec = _mm512_set1_ps(inv_denom), alpha_vec = _mm512_set1_ps(alpha), beta_vec = _mm512_set1_ps(beta),
               tau_vec = _mm512_set1_ps(tau), delta_vec = _mm512_set1_ps(delta);
  auto grad = [&](__m512 x) CALIBKERNELS_AVX512 {
    return gradient_of_exponential<kSquare, kDelta>(x, inv_vec, alpha_vec, beta_vec, tau_vec, delta_vec);
  };
  int64_t k = 0;
  for (; k + kWidth <= C; k += kWidth) _mm512_storeu_ps(out + k, grad(_mm512_loadu_ps(e + k)));
  if (k < C) {
    const __mmask16 lanes = tail_mask(C - k);
    _mm512_mask_storeu_ps(out + k, lanes, grad(_mm512_maskz_loadu_ps(lanes, e + k)));
  }
}

// gradient_of_exponential from the exponentials in `e` (a scratch row) to `out`, with column `target` set to
// `target_value`: streaming stores for the 64-byte lines wholly inside the row, masked ordinary stores for the partial
// lines at its ends (shared with the neighbouring rows, possibly another thread's). Callers fence with stream_fence().
// kDelta (soft targets): δ added to every column, and a second exact column `second` (-1: none) set to
// `second_value` the same way.
// The whole lines are streamed in one run without the exact columns, and the (at most two) lines holding them are
// streamed again afterwards with the exact values blended in. A later streaming store of a whole line to the same
// address replaces the earlier one, and no line is read back (an ordinary store into a streamed line would fetch it).
// Splitting the run at each exact column instead costs a mispredicted loop exit per split, more than the re-streamed
// lines (docs/performance.md).
template <bool kSquare, bool kDelta = false>
CALIBKERNELS_AVX512 void rescale_stream_sweep(const float* e, float* out, int64_t C, float inv_denom, float alpha,
                                              float beta, float tau, int64_t target, float target_value,
                                              float delta = 0.0f, int64_t second = -1, float second_value = 0.0f) {
  const __m512 inv_vec = _mm512_set1_ps(inv_denom), alpha_vec = _mm512_set1_ps(alpha), beta_vec = _mm512_set1_ps(beta),
               tau_vec = _mm512_set1_ps(tau), target_vec = _mm512_set1_ps(target_value),
               delta_vec = _mm512_set1_ps(delta), second_vec = _mm512_set1_ps(second_value);
  auto grad = [&](__m512 x) CALIBKERNELS_AVX512 {
    return gradient_of_exponential<kSquare, kDelta>(x, inv_vec, alpha_vec, beta_vec, tau_vec, delta_vec);
  };
  // the one-lane mask of `column` in the vector starting at k, or 0
  auto lane_of = [](int64_t column, int64_t k) {
    const uint64_t lane = static_cast<uint64_t>(column - k);  // wraps to a huge value for column < k (or -1)
    return static_cast<__mmask16>(lane < static_cast<uint64_t>(kWidth) ? 1u << lane : 0u);
  };
  auto with_target = [&](__m512 g, int64_t k) CALIBKERNELS_AVX512 {
    g = _mm512_mask_mov_ps(g, lane_of(target, k), target_vec);
    if constexpr (kDelta) g = _mm512_mask_mov_ps(g, lane_of(second, k), second_vec);
    return g;
  };
  const int64_t misalign = static_cast<int64_t>((reinterpret_cast<uintptr_t>(out) & 63) / sizeof(float));
  int64_t k = 0;
  if (misalign != 0) {
    const int64_t head = std::min<int64_t>(C, kWidth - misalign);
    const __mmask16 lanes = tail_mask(head);
    _mm512_mask_storeu_ps(out, lanes, with_target(grad(_mm512_maskz_loadu_ps(lanes, e)), 0));
    k = head;
  }
  const int64_t body = k, full_end = k + (C - k) / kWidth * kWidth;
  for (; k < full_end; k += kWidth) _mm512_stream_ps(out + k, grad(_mm512_loadu_ps(e + k)));
  auto line_of = [&](int64_t column) -> int64_t {  // the whole line holding `column`, or -1
    return column >= body && column < full_end ? body + (column - body) / kWidth * kWidth : int64_t(-1);
  };
  auto restream = [&](int64_t start) CALIBKERNELS_AVX512 {
    _mm512_stream_ps(out + start, with_target(grad(_mm512_loadu_ps(e + start)), start));
  };
  const int64_t target_line = line_of(target);
  if (target_line >= 0) restream(target_line);
  if constexpr (kDelta) {
    const int64_t second_line = line_of(second);
    if (second_line >= 0 && second_line != target_line) restream(second_line);
  }
  if (k < C) {
    const __mmask16 lanes = tail_mask(C - k);
    _mm512_mask_storeu_ps(out + k, lanes, with_target(grad(_mm512_maskz_loadu_ps(lanes, e + k)), k));
  }
}

// Dense soft targets, t_k = keep · T_k + c (soft_target_rows.h): the row's sums over [0, C) in one sweep.
struct DenseSums {
  float e = 0, t = 0, tz = 0, te = 0, ee = 0, tt = 0;  // Σ e, Σ t, Σ_{t>0} t (z - m), Σ t e, Σ e², Σ t²
  float given = 0;          // Σ T_k of the target as given (before smoothing), for its value check
  bool not_nonneg = false;  // some T_k < 0 or NaN
};

// out[k] = exp(z[k] - m) (out must not alias z or target) and the DenseSums (Σ e², Σ t² only when kSquare: gBS with
// q = 2 takes S = Σ p² - 2 P + Σ t² from them). The sums are taken over T as given and turned into sums over
// t = keep T + c at the end (Σ t = keep Σ T + c C, Σ t e = keep Σ T e + c Σ e, ...), which saves forming t per
// vector; Σ t (z - m) is keep Σ_{T>0} T (z - m) + c Σ (z - m), so a -inf logit with no target mass adds 0, not NaN,
// and with smoothing (c > 0, kSmooth) it makes the CE +inf, as every column then has mass. Two-level summation as in
// exp_store_sweep. The target's value check rides along: Σ T_k as given, and whether any T_k fails T_k >= 0 (NaN
// included; +inf shows in the sum).
template <bool kSquare, bool kSmooth>
CALIBKERNELS_AVX512 void dense_exp_sweep(const float* z, const float* target, float keep, float c, float* out,
                                         int64_t C, float m, DenseSums& sums) {
  const __m512 m_vec = _mm512_set1_ps(m);
  const __m512 neg_inf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), zero = _mm512_setzero_ps();
  __m512 total_e = zero, total_tz = zero, total_te = zero, total_ee = zero, total_tt = zero, total_given = zero,
         total_shift = zero;
  __mmask16 negative = 0;
  for (int64_t begin = 0; begin < C; begin += kBlock) {
    const int64_t end = begin + kBlock < C ? begin + kBlock : C;
    __m512 se = zero, stz = zero, ste = zero, see = zero, stt = zero, sg = zero, ss = zero;
    auto step = [&](int64_t k, __mmask16 lanes) CALIBKERNELS_AVX512 {
      const __m512 shifted = _mm512_sub_ps(_mm512_mask_loadu_ps(neg_inf, lanes, z + k), m_vec);
      const __m512 e = exp_nonpositive<true>(shifted);  // 0 in the lanes past the row
      _mm512_mask_storeu_ps(out + k, lanes, e);
      const __m512 given = _mm512_maskz_loadu_ps(lanes, target + k);  // 0 in the lanes past the row
      sg = _mm512_add_ps(sg, given);
      negative |= _mm512_cmp_ps_mask(given, zero, _CMP_NGE_UQ);
      se = _mm512_add_ps(se, e);
      // only where T > 0, as a zero-masked product: 0 · (-inf) in a lane past the row, or for a -inf logit with a 0
      // target, would be NaN and raise an invalid-operation exception; the other lanes add 0
      stz = _mm512_add_ps(stz, _mm512_maskz_mul_ps(_mm512_cmp_ps_mask(given, zero, _CMP_GT_OQ), given, shifted));
      if constexpr (kSmooth) ss = _mm512_mask_add_ps(ss, lanes, ss, shifted);
      ste = _mm512_fmadd_ps(given, e, ste);
      if constexpr (kSquare) {
        see = _mm512_fmadd_ps(e, e, see);
        stt = _mm512_fmadd_ps(given, given, stt);
      }
    };
    int64_t k = begin;
    for (; k + kWidth <= end; k += kWidth) step(k, static_cast<__mmask16>(0xFFFF));
    if (k < end) step(k, tail_mask(end - k));
    total_e = _mm512_add_ps(total_e, se);
    total_given = _mm512_add_ps(total_given, sg);
    total_tz = _mm512_add_ps(total_tz, stz);
    total_te = _mm512_add_ps(total_te, ste);
    if constexpr (kSmooth) total_shift = _mm512_add_ps(total_shift, ss);
    if constexpr (kSquare) {
      total_ee = _mm512_add_ps(total_ee, see);
      total_tt = _mm512_add_ps(total_tt, stt);
    }
  }
  const float columns = static_cast<float>(C);
  sums.e = _mm512_reduce_add_ps(total_e);
  sums.given = _mm512_reduce_add_ps(total_given);
  sums.not_nonneg = negative != 0;
  sums.t = keep * sums.given + c * columns;
  // keep = 0 (label smoothing 1): T takes no part, also where T (z - m) is -inf
  sums.tz = keep != 0.0f ? keep * _mm512_reduce_add_ps(total_tz) : 0.0f;
  if constexpr (kSmooth) sums.tz += c * _mm512_reduce_add_ps(total_shift);
  sums.te = keep * _mm512_reduce_add_ps(total_te) + c * sums.e;
  if constexpr (kSquare) {
    sums.ee = _mm512_reduce_add_ps(total_ee);
    sums.tt = keep * keep * _mm512_reduce_add_ps(total_tt) + c * (2.0f * keep * sums.given + c * columns);
  }
}

// The gradient of a dense row from the exponentials `e`: out[k] = scale · (u d + x p - A p (t - P) + β p (d - τ)),
// p = e · inv_denom, d = p - t (x: u (Σ t - 1), the CE gradient's Σt p - t). out may alias e, not target.
// Taken as p (u' + x' - A' (t - P) + β' (d - τ)) - u' t (primes: times scale), nine instructions per vector where
// the formula as written takes twelve (the dense rows are bound by instructions, not by memory). The focal and Brier
// terms keep their factors t - P and d - τ: A and β grow with the CE in "loss" mode, and expanded they cancel to the
// rounding of A p t (a focal row with a logit 1e4 above the rest lost three digits). Only u d becomes u p - u t,
// whose rounding where p ≈ t is that of u p, what p - t carries from p's own rounding.
// kStream: streaming stores for the 64-byte lines wholly inside the row, as rescale_stream_sweep (callers fence).
template <bool kStream>
CALIBKERNELS_AVX512 inline void dense_gradient_sweep(const float* e, const float* target, float keep, float c,
                                                     float* out, int64_t C, float inv_denom, float u, float excess,
                                                     float focal, float P, float beta, float tau, float scale) {
  const __m512 inv_vec = _mm512_set1_ps(inv_denom), keep_vec = _mm512_set1_ps(keep), c_vec = _mm512_set1_ps(c),
               own_vec = _mm512_set1_ps(scale * (u + excess)), u_vec = _mm512_set1_ps(scale * u),
               focal_vec = _mm512_set1_ps(scale * focal), P_vec = _mm512_set1_ps(P),
               beta_vec = _mm512_set1_ps(scale * beta), tau_vec = _mm512_set1_ps(tau);
  auto step = [&](int64_t k, __mmask16 lanes) CALIBKERNELS_AVX512 {
    const __m512 p = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, e + k), inv_vec);
    const __m512 t = _mm512_fmadd_ps(keep_vec, _mm512_maskz_loadu_ps(lanes, target + k), c_vec);
    __m512 factor = _mm512_fnmadd_ps(focal_vec, _mm512_sub_ps(t, P_vec), own_vec);
    factor = _mm512_fmadd_ps(beta_vec, _mm512_sub_ps(_mm512_sub_ps(p, t), tau_vec), factor);
    const __m512 g = _mm512_fnmadd_ps(u_vec, t, _mm512_mul_ps(p, factor));
    if (kStream && lanes == static_cast<__mmask16>(0xFFFF)) {
      _mm512_stream_ps(out + k, g);
    } else {
      _mm512_mask_storeu_ps(out + k, lanes, g);
    }
  };
  int64_t k = 0;
  if constexpr (kStream) {  // the partial line at the row's start, with ordinary stores
    const int64_t misalign = static_cast<int64_t>((reinterpret_cast<uintptr_t>(out) & 63) / sizeof(float));
    if (misalign != 0) {
      k = std::min<int64_t>(C, kWidth - misalign);
      step(0, tail_mask(k));
    }
  }
  for (; k + kWidth <= C; k += kWidth) step(k, static_cast<__mmask16>(0xFFFF));
  if (k < C) step(k, tail_mask(C - k));
}

// Soft-capping (hard rows with the drop-in options, hard_rows.h): c tanh(z / c) of a vector, as options::soft_capped
// (tanh(a) = (1 - e) / (1 + e), e = exp(-2a), a = |z / c|, and the odd series below a = 1/8), with the reciprocal of
// 1 + e ∈ [1, 2] from rcp14 and one Newton step (relative error ≈ 2^-28 before rounding) instead of a division.
// -inf gives -c, NaN stays NaN.
CALIBKERNELS_AVX512 inline __m512 soft_capped(__m512 z, __m512 cap, __m512 inv_cap) {
  const __m512 one = _mm512_set1_ps(1.0f);
  const __m512 x = _mm512_mul_ps(z, inv_cap);
  const __m512 a = _mm512_abs_ps(x);
  const __m512 e = exp_nonpositive<true>(_mm512_mul_ps(_mm512_set1_ps(-2.0f), a));
  const __m512 d = _mm512_add_ps(one, e);
  __m512 r = _mm512_rcp14_ps(d);
  r = _mm512_mul_ps(r, _mm512_fnmadd_ps(d, r, _mm512_set1_ps(2.0f)));
  const __m512 by_exp = _mm512_mul_ps(_mm512_sub_ps(one, e), r);
  const __m512 a2 = _mm512_mul_ps(a, a);
  __m512 series = _mm512_fmadd_ps(a2, _mm512_set1_ps(-17.0f / 315.0f), _mm512_set1_ps(2.0f / 15.0f));
  series = _mm512_fmadd_ps(a2, series, _mm512_set1_ps(-1.0f / 3.0f));
  series = _mm512_mul_ps(a, _mm512_fmadd_ps(a2, series, one));
  const __m512 magnitude =
      _mm512_mask_mov_ps(by_exp, _mm512_cmp_ps_mask(a, _mm512_set1_ps(0.125f), _CMP_LT_OQ), series);
  return _mm512_mul_ps(cap, _mm512_or_ps(magnitude, _mm512_and_ps(x, _mm512_set1_ps(-0.0f))));
}

// out[k] = c tanh(z[k] / c) for k in [0, C) (out may be z).
CALIBKERNELS_AVX512 inline void soft_cap_row(const float* z, float* out, int64_t C, float cap) {
  const __m512 cap_vec = _mm512_set1_ps(cap), inv_cap = _mm512_set1_ps(1.0f / cap);
  int64_t k = 0;
  for (; k + kWidth <= C; k += kWidth) _mm512_storeu_ps(out + k, soft_capped(_mm512_loadu_ps(z + k), cap_vec, inv_cap));
  if (k < C) {
    const __mmask16 lanes = tail_mask(C - k);
    _mm512_mask_storeu_ps(out + k, lanes, soft_capped(_mm512_maskz_loadu_ps(lanes, z + k), cap_vec, inv_cap));
  }
}

// The cap's chain rule: out[k] = g[k] (1 - (z'[k] / c)²) from the gradient g of the capped logits z' (out may be g).
// kStream: streaming stores for the 64-byte lines wholly inside the row, as rescale_stream_sweep (callers fence).
template <bool kStream>
CALIBKERNELS_AVX512 inline void cap_gradient_sweep(const float* g, const float* capped, float* out, int64_t C,
                                                   float inv_cap) {
  const __m512 one = _mm512_set1_ps(1.0f), inv_vec = _mm512_set1_ps(inv_cap);
  auto step = [&](int64_t k, __mmask16 lanes) CALIBKERNELS_AVX512 {
    const __m512 ratio = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, capped + k), inv_vec);
    const __m512 result = _mm512_mul_ps(_mm512_maskz_loadu_ps(lanes, g + k), _mm512_fnmadd_ps(ratio, ratio, one));
    if (kStream && lanes == static_cast<__mmask16>(0xFFFF)) {
      _mm512_stream_ps(out + k, result);
    } else {
      _mm512_mask_storeu_ps(out + k, lanes, result);
    }
  };
  int64_t k = 0;
  if constexpr (kStream) {  // the partial line at the row's start, with ordinary stores
    const int64_t misalign = static_cast<int64_t>((reinterpret_cast<uintptr_t>(out) & 63) / sizeof(float));
    if (misalign != 0) {
      k = std::min<int64_t>(C, kWidth - misalign);
      step(0, tail_mask(k));
    }
  }
  for (; k + kWidth <= C; k += kWidth) step(k, static_cast<__mmask16>(0xFFFF));
  if (k < C) step(k, tail_mask(C - k));
}

CALIBKERNELS_AVX512 inline void stream_fence() { _mm_sfence(); }

#undef CALIBKERNELS_AVX512

}  // namespace avx512
#endif

}  // namespace
}  // namespace calibkernels
