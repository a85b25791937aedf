// Soft-target rows of the CPU kernel (label smoothing, a mixup/cutmix mix, dense probability targets), included by
// uncertainty_weighted_ce_kernel.h inside its per-ISA namespace. The maths is csrc/uncertainty_weights.h's "Soft
// targets" block (shared with the CUDA kernel; formulas in docs/losses.md):
//
//   t_k = c + w_y [k = y] + w_m [k = m]   (compact: c = a/C, w_y = (1-a) λ, w_m = (1-a)(1-λ))   or   (1-a) T_k + c,
//   L = u · CE,  CE = -Σ_k t_k log p_k,  gradient u (p - t) (+ CE du/dz in mode "loss").
//
// Two forms of a row:
//   * compact_soft_row: compact targets with the weights none / external / focal / FLSD / gBS with q = 2: the
//     hard-target path's two sweeps (exponentials stored once, then rescaled into the gradient; the AVX-512 forms
//     where the hard path has them), the sums taken with columns y and m left out so that 1 - p_y, the gBS sum and
//     the CE need no cancelling subtraction, and the columns y and m written exactly afterwards. The same memory
//     traffic as a hard row: one read of the logits, one write of the gradient.
//   * general_soft_row: dense targets, and gBS with any other norm: a max sweep, the exponential sweep with the
//     target sums, a gBS sweep for S = Σ |p_k - t_k|^q and H = Σ h_k p_k (q ≠ 2 only), and the gradient sweep; the
//     row and its target stay in L1/L2 between the sweeps. Dense float rows take AVX-512 sweeps where the CPU has
//     them (the gBS sweep with q ≠ 2 stays at the generic width).
#pragma once

namespace soft {

using at::vec::Vectorized;

template <typename T>
struct RowTarget {
  const T* dense;  // the row's dense target T_k (in T), or nullptr for the compact form
  T keep;          // 1 - a (dense: t_k = keep T_k + c)
  T c;             // a / C
  T w_y, w_m;      // compact: the weights of columns y and m (m == y without a mix)
  int64_t y, m;
  // dense: set when T_k < 0 or NaN somewhere, or |Σ T_k - 1| > flag_tolerance (the caller then runs the exact
  // check, check_dense_target_values, and raises its error or goes on)
  std::atomic<bool>* invalid = nullptr;
  T flag_tolerance = 0;
};

// Whether a dense target row may fail the exact check: an entry < 0 or NaN, or |Σ T_k - 1| > tolerance (also NaN).
template <typename T>
bool dense_row_flagged(T given_sum, bool not_nonneg, T tolerance) {
  return not_nonneg || !(std::abs(given_sum - T(1)) <= tolerance);
}

// Whether a lane of the running minimum of a row's entries is < 0 or NaN.
template <typename T>
bool any_lane_not_nonneg(const Vectorized<T>& low) {
  alignas(64) T lanes[Vectorized<T>::size()];
  low.store(lanes);
  bool not_nonneg = false;
  for (const T v : lanes) not_nonneg = not_nonneg || !(v >= T(0));
  return not_nonneg;
}

// The dense target's value check, folded into the exponential sweep that reads T anyway.
template <typename T>
void flag_dense_target(const RowTarget<T>& tg, T given_sum, bool not_nonneg) {
  if (tg.invalid != nullptr && dense_row_flagged(given_sum, not_nonneg, tg.flag_tolerance)) {
    tg.invalid->store(true, std::memory_order_relaxed);
  }
}

// The same value check as a pass of its own over a dense target row (the in-place pre-check, which must see every
// row before the kernel overwrites the logits): whether T_k < 0 or NaN somewhere, or |Σ T_k - 1| > tolerance, with
// Σ T_k taken in blocks of 64 vectors as in the exponential sweeps. Two accumulators, so that the add chain keeps up
// with the loads.
template <typename T>
bool dense_row_may_fail(const T* row, int64_t C, T tolerance) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec zero(T(0));
  Vec sum(T(0)), block_a(T(0)), block_b(T(0)), low_a(T(0)), low_b(T(0));
  int64_t k = 0;
  for (; k + 2 * W <= C; k += 2 * W) {
    if (k % (64 * W) == 0) {
      sum = sum + (block_a + block_b);
      block_a = block_b = zero;
    }
    const Vec a = Vec::loadu(row + k), b = Vec::loadu(row + k + W);
    block_a = block_a + a;
    block_b = block_b + b;
    low_a = at::vec::minimum(low_a, a);  // propagates NaN
    low_b = at::vec::minimum(low_b, b);
  }
  for (; k < C; k += W) {
    const int64_t count = std::min<int64_t>(W, C - k);
    const Vec a = Vec::set(zero, Vec::loadu(row + k, count), count);
    block_a = block_a + a;
    low_a = at::vec::minimum(low_a, a);
  }
  return dense_row_flagged(horizontal_sum(sum + (block_a + block_b)),
                           any_lane_not_nonneg(at::vec::minimum(low_a, low_b)), tolerance);
}

// f(lo, hi) over [0, C) without the columns a and b (which may be equal).
template <typename F>
void for_columns_except(int64_t C, int64_t a, int64_t b, F&& f) {
  const int64_t lo = std::min(a, b), hi = std::max(a, b);
  f(int64_t(0), lo);
  if (hi != lo) f(lo + 1, hi);
  f(hi + 1, C);
}

template <typename T>
Vectorized<T> load_masked(const T* p, int64_t count, T fill) {
  return count == Vectorized<T>::size()
             ? Vectorized<T>::loadu(p)
             : Vectorized<T>::set(Vectorized<T>(fill), Vectorized<T>::loadu(p, count), count);
}

// The row's CE, P = <t, p>, 1 - P and the FLSD band from a compact row's sums: the exponentials e_y, e_m relative to
// ref, `others` = Σ_{k≠y} e_k (e_m included), `rest` = Σ over the columns other than y and m, `shift_sum` =
// Σ_k (z_k - ref) over all columns (read only when c > 0).
template <typename T>
struct CompactSums {
  T e_y, e_m, others, rest, shift_sum;
};

template <typename T>
struct CompactRow {
  T denom, inv, p_y, p_m, one_minus_p_y, one_minus_p_m, d_y, d_m, t_y, t_m, P, one_minus_P;  // inv = 1 / denom
  // CE = ce_offset + ce_scale · L with L = log(denom) = log1p(log_arg): the logarithm can wait for the vectorised
  // pass of finish_row_losses when nothing in the row needs the CE (mode "grad", no FLSD band)
  T ce_offset, ce_scale, log_arg;
};

template <typename T>
inline __attribute__((always_inline)) CompactRow<T> compact_row(const RowTarget<T>& tg, int64_t C, T z_y, T z_m, T ref,
                                                                const CompactSums<T>& s) {
  CompactRow<T> r;
  const bool mixed = tg.m != tg.y;
  // from the sweep's sum rather than e_m + rest: the division, which everything after it waits for, starts one add
  // earlier (and the sum of positive terms loses nothing to rest's subtraction)
  r.denom = s.e_y + s.others;
  r.inv = T(1) / r.denom;
  const T inv = r.inv;
  const T others_y = s.others;  // Σ_{k≠y} e_k
  r.p_y = s.e_y * inv;
  r.one_minus_p_y = others_y * inv;
  r.p_m = mixed ? s.e_m * inv : r.p_y;
  r.one_minus_p_m = mixed ? (s.e_y + s.rest) * inv : r.one_minus_p_y;
  const T one_minus_p_m = r.one_minus_p_m;
  // denom - 1 exactly where the reference column's exponential is 1 (the target's, or m's when it is the row max),
  // so log1p keeps lse - z accurate as p → 1
  r.log_arg = (mixed && z_m == ref && z_y != ref) ? (s.e_m - T(1)) + (s.e_y + s.rest) : (s.e_y - T(1)) + others_y;
  // CE = Σ_k t_k (lse - z_k) = w_y (ref - z_y) + w_m (ref - z_m) + c Σ_k (ref - z_k) + (w_y + w_m + c C) L
  T offset = 0, scale = 0;
  if (tg.w_y > T(0)) {
    offset += tg.w_y * (ref - z_y);
    scale += tg.w_y;
  }
  if (tg.w_m > T(0)) {
    offset += tg.w_m * (ref - z_m);
    scale += tg.w_m;
  }
  if (tg.c > T(0)) {
    offset -= tg.c * s.shift_sum;
    scale += tg.c * static_cast<T>(C);
  }
  r.ce_offset = offset;
  r.ce_scale = scale;
  const T cm1 = tg.c * static_cast<T>(C - 1);
  r.one_minus_P = tg.w_y * r.one_minus_p_y + tg.w_m * one_minus_p_m + cm1;
  r.P = tg.w_y * r.p_y + tg.w_m * r.p_m + tg.c;
  r.t_y = tg.c + tg.w_y + (mixed ? T(0) : tg.w_m);
  r.t_m = mixed ? tg.c + tg.w_m : r.t_y;
  const T one_minus_t_y = (mixed ? tg.w_m : T(0)) + cm1;
  // p_y - t_y; as p_y → 1 from the small quantities (no cancellation), else directly: Σ_{k≠y} e_k · (1 / d) can
  // round 1 ulp off 1 where p_y = 0, which would leave a gradient on a column the row gives no mass
  r.d_y = r.p_y > T(0.5) ? one_minus_t_y - r.one_minus_p_y : r.p_y - r.t_y;
  // p_m - t_m; as p_m → 1 from the small quantities, as for column y
  r.d_m = !mixed ? r.d_y : (r.p_m <= T(0.5) ? r.p_m - r.t_m : (tg.w_y + cm1) - one_minus_p_m);
  return r;
}

// e_m above this multiple of the other columns' sum: compact_soft_row sums the rest again (the difference
// Σ_{k≠y} e_k - e_m would carry more than 6 bits of cancellation).
constexpr double kDominantPartner = 64.0;

// Σ e_k and Σ e_k² over [0, C) without the columns a and b, from a stored row of exponentials.
template <typename T>
void rest_sums(const T* e, int64_t C, int64_t a, int64_t b, T& sum, T& sum_sq) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  Vec s(T(0)), s2(T(0));
  for_columns_except(C, a, b, [&](int64_t lo, int64_t hi) {
    for (int64_t k = lo; k < hi; k += W) {
      const int64_t count = std::min<int64_t>(W, hi - k);
      const Vec v = Vec::set(Vec(T(0)), Vec::loadu(e + k, count), count);
      s = s + v;
      s2 = at::vec::fmadd(v, v, s2);
    }
  });
  sum = horizontal_sum(s);
  sum_sq = horizontal_sum(s2);
}

template <typename T, bool kAvx512 = false>
RowLoss<T> general_soft_row(const T* z, T* grad, int64_t C, const RowTarget<T>& tg, const RowSpec<T>& spec, T gamma,
                            T external, T scale, T* exps, bool stream = false, RowNormaliser<T>* normaliser = nullptr);

// The weight families of compact_soft_row, a template parameter (with the mode, kLoss) so that each row's scalar code
// holds only its own weight's terms (with the weight chosen at run time, every row would also carry the dead terms of
// the other families; docs/performance.md).
enum class SoftFamily {
  Plain,  // none / external: u is a constant of the row
  Focal,  // focal / FLSD: u = (1 - P)^γ
  Square  // gBS with q = 2: u = S^{γ/2}
};

// A compact row (class indices, a mix, smoothing) with the weights none / external / focal / FLSD / gBS with q = 2
// (kFamily; kLoss: mode "loss"): the hard path's exponential sweep (referenced to the target logit while the sums stay
// in range, like process_row; the AVX-512 form for float rows when kAvx512), then one sweep writing the gradient, and
// the columns y and m written exactly. `exps` is a scratch row of C elements (z may be the gradient row: in place).
template <typename T, SoftFamily kFamily, bool kLoss, bool kAvx512>
RowLoss<T> compact_soft_row(const T* z, T* grad, int64_t C, const RowTarget<T>& tg, const RowSpec<T>& spec, T gamma,
                            T external, T scale, T* exps, int64_t ahead, bool stream, RowNormaliser<T>* normaliser) {
  constexpr bool kWide = kAvx512 && std::is_same_v<T, float> && CALIBKERNELS_HAVE_AVX512_SWEEPS;
  constexpr bool kSquare = kFamily == SoftFamily::Square;
  const int64_t y = tg.y, m = tg.m;
  const bool mixed = m != y;
  const T z_y = z[y];
  // the exponentials go straight to a fresh gradient row (rescaled there in place, as on the hard path); through the
  // scratch row when the gradient is streamed out of it or overwrites z
  T* const e_row = (grad != nullptr && !stream && static_cast<const T*>(grad) != z) ? grad : exps;
  T sum_others = 0, sum_sq_others = 0;  // Σ_{k≠y} e_k and Σ_{k≠y} e_k²
  T shift_sum = 0;                      // Σ_k (z_k - ref), for label smoothing's CE term
  auto sweep_with = [&](auto shift_tag, T ref, int64_t distance) {
    constexpr bool kShift = decltype(shift_tag)::value;
    sum_others = 0;
    sum_sq_others = 0;
    shift_sum = 0;
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
    if constexpr (kWide) {
      avx512::exp_store_sweep<kSquare, true, kShift>(z, e_row, C, y, ref, sum_others, sum_sq_others, distance,
                                                     &shift_sum);
    }
#endif
    if constexpr (!kWide) {  // the generic sweeps leave column y out (its shift is z_y - ref)
      exp_store_sweep<T, kSquare, true, kShift>(z, e_row, 0, y, ref, sum_others, sum_sq_others, distance, &shift_sum);
      exp_store_sweep<T, kSquare, true, kShift>(z, e_row, y + 1, C, ref, sum_others, sum_sq_others, distance,
                                                &shift_sum);
      shift_sum += z_y - ref;
    }
  };
  auto sweep = [&](T ref, int64_t distance) {
    if (tg.c > T(0)) {
      sweep_with(std::true_type{}, ref, distance);
    } else {
      sweep_with(std::false_type{}, ref, distance);
    }
  };
  T ref = z_y;
  bool target_reference = std::isfinite(z_y);
  if (!target_reference) ref = row_max(z, C);
  if (ref == -std::numeric_limits<T>::infinity() || std::isnan(ref)) {
    // the reference's NaN/-inf rules
    return general_soft_row(z, grad, C, tg, spec, gamma, external, scale, exps, false, normaliser);
  }
  sweep(ref, ahead);
  if (target_reference && !(sum_others <= T(kTargetReferenceLimit))) {  // also NaN
    ref = row_max(z, C);
    target_reference = false;
    sweep(ref, 0);
  }
  const T z_m = z[m];  // read after the sweep, which brought the row into the cache
  const T e_y = target_reference ? T(1) : std::exp(z_y - ref);
  const T e_m = mixed ? e_row[m] : T(0);
  // Σ e_k and Σ e_k² over the columns other than y and m
  T rest = sum_others - e_m, rest_sq = kSquare ? sum_sq_others - e_m * e_m : T(0);
  if (mixed && e_m > T(kDominantPartner) * rest) {
    // the mix partner holds nearly all the probability: those differences have lost the bits that 1 - p_m and
    // column m's terms are made of, so the rest is summed again from the stored exponentials (rare rows; the row is
    // in L1)
    rest_sums(e_row, C, y, m, rest, rest_sq);
  }
  const CompactRow<T> cr = compact_row(tg, C, z_y, z_m, ref, CompactSums<T>{e_y, e_m, sum_others, rest, shift_sum});
  if (normaliser != nullptr) *normaliser = {ref, cr.denom};

  constexpr bool loss_mode = kLoss;  // the caller's dispatch on spec.mode
  const bool need_log = loss_mode || spec.flsd_schedule;
  const T log_denom = need_log ? std::log1p(cr.log_arg) : T(0);
  SoftRowQuantities<T> r{};
  r.one_minus_P = cr.one_minus_P;
  r.P = cr.P;
  r.ce = cr.ce_offset + cr.ce_scale * log_denom;
  r.gamma = spec.flsd_schedule
                ? flsd_gamma(soft_flsd_band_probability(z_y, z_m, ref + log_denom, tg.w_y, tg.w_m, tg.c), gamma)
                : gamma;
  r.q = spec.q;
  r.external = external;
  if constexpr (kSquare) {
    // S = Σ_{k∉{y,m}} (p_k - c)² + d_y² + d_m², the first sum from Σ p_k² and Σ p_k over those columns. S is on
    // the chain of dependent operations from the sweep's sums to the gradient sweep's coefficients, so its terms
    // are grouped to start as early as they can: c's terms from rest_p, the two exact columns' squares apart.
    const T inv = cr.inv;
    const T rest_p = std::max(T(0), rest) * inv;
    const T n_rest = static_cast<T>(C - (mixed ? 2 : 1));
    const T uniform_terms = n_rest * tg.c * tg.c - T(2) * tg.c * rest_p;  // Σ (c² - 2 c p_k) over those columns
    const T uniform_part = std::max(T(0), std::max(T(0), rest_sq) * inv * inv + uniform_terms);
    const T exact_part = mixed ? cr.d_y * cr.d_y + cr.d_m * cr.d_m : cr.d_y * cr.d_y;
    r.S = uniform_part + exact_part;
    if constexpr (kLoss) r.H = (sum_sq_others + e_y * e_y) * (inv * inv) - cr.P;  // τ = Σ p² - P
  }
  SoftCoefficients<T> coefs;
  if constexpr (kFamily == SoftFamily::Plain) {
    coefs.u = spec.weight == Weight::External ? external : T(1);  // what soft_weight_coefficients gives, nothing else
  } else {
    coefs = soft_weight_coefficients(spec.weight, loss_mode, r, true);
  }
  if (grad != nullptr) {
    // plain, and every family in mode "grad": soft_uniform_columns with A = β = τ = 0, whose u + 0 · (P - t) is
    // u + 0 (P ≥ t = c here, so the product is +0, and u = -0 gives +0 as before)
    const UniformColumnCoefficients<T> uc =
        kFamily == SoftFamily::Plain || !kLoss
            ? UniformColumnCoefficients<T>{coefs.u + T(0), T(0), tg.c, -coefs.u * tg.c}
            : soft_uniform_columns(coefs, tg.c);
    // column y without cancellation when p_y → 1: t_y - P = w_y (1 - p_y) ∓ w_m p_m, and (p_y - t_y) - τ =
    // p_y (1 - p_y) - Σ_{k≠y} p_k² - (t_y - P) (τ = Σ p² - P), where the generic form subtracts numbers near 1 and
    // the loss mode multiplies the difference by β = CE γ S^{γ/2-1}
    // column m the same way: t_m - P = w_m (1 - p_m) - w_y p_y, (p_m - t_m) - τ = p_m (1 - p_m) - Σ_{k≠m} p_k² -
    // (t_m - P). `others_sq_e`: Σ e_k² over the other columns.
    const T inv = cr.inv;
    auto exact_column = [&](T p, T one_minus_p, T d, T t_minus_P, T others_sq_e) {
      T g = coefs.u * d;
      if constexpr (kFamily == SoftFamily::Focal && kLoss) g -= coefs.focal * p * t_minus_P;
      if constexpr (kSquare && kLoss) g += coefs.beta * p * (p * one_minus_p - others_sq_e * inv * inv - t_minus_P);
      return g * scale;
    };
    const T g_y =
        exact_column(cr.p_y, cr.one_minus_p_y, cr.d_y,
                     tg.w_y * cr.one_minus_p_y + (mixed ? -tg.w_m * cr.p_m : tg.w_m * cr.one_minus_p_y), sum_sq_others);
    const T g_m = !mixed ? g_y
                         : exact_column(cr.p_m, cr.one_minus_p_m, cr.d_m, tg.w_m * cr.one_minus_p_m - tg.w_y * cr.p_y,
                                        std::max(T(0), rest_sq) + e_y * e_y);
    bool streamed = false;
    const T alpha = scale * uc.alpha, beta = scale * uc.beta, delta = scale * uc.delta;
    // kDelta: the uniform columns' δ term; without smoothing (δ = -0) the hard rows' loops, whose p · coef is
    // fma(p, coef, -0) bit for bit (signed zeros too). The streamed form always adds δ: its kDelta also patches m.
    auto rescale = [&](auto square_tag, auto delta_tag) {
      constexpr bool kSq = decltype(square_tag)::value, kDelta = decltype(delta_tag)::value;
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
      if constexpr (kWide) {
        if (stream) {
          avx512::rescale_stream_sweep<kSq, true>(e_row, grad, C, inv, alpha, beta, uc.tau, y, g_y, delta,
                                                  mixed ? m : int64_t(-1), g_m);
        } else {
          avx512::rescale_sweep<kSq, kDelta>(e_row, grad, C, inv, alpha, beta, uc.tau, delta);
        }
        streamed = stream;
      }
#endif
      if constexpr (!kWide) rescale_sweep<T, kSq, kDelta>(e_row, grad, C, inv, alpha, beta, uc.tau, delta);
    };
    auto rescale_with = [&](auto delta_tag) {
      if (beta != T(0)) {
        rescale(std::true_type{}, delta_tag);
      } else {
        rescale(std::false_type{}, delta_tag);
      }
    };
    if (delta != T(0)) {
      rescale_with(std::true_type{});
    } else {
      rescale_with(std::false_type{});
    }
    if (!streamed) {
      grad[y] = g_y;
      if (mixed) grad[m] = g_m;
    }
  }
  if (need_log) return {T(1), coefs.u * r.ce, T(0)};
  // u · (offset + scale · L) as weight · (offset' + log1p(arg)) for finish_row_losses (scale > 0: Σ_k t_k = 1)
  return {coefs.u * cr.ce_scale, cr.ce_offset / cr.ce_scale, cr.log_arg};
}

// ---------------------------------------------------------------------------------------------------------------------
// The general form (dense targets; gBS with a norm other than 2; and every compact row when the fast form does not
// apply).
// ---------------------------------------------------------------------------------------------------------------------

// t_k of a vector of columns [k, k + count) whose target is not one of the compact exceptions.
template <typename T>
Vectorized<T> target_vector(const RowTarget<T>& tg, int64_t k, int64_t count) {
  using Vec = Vectorized<T>;
  if (tg.dense == nullptr) return Vec(tg.c);
  return at::vec::fmadd(Vec(tg.keep), Vec::loadu(tg.dense + k, count), Vec(tg.c));
}

// kAvx512: dense rows take the AVX-512 sweeps (float rows; the max, exponential and gradient sweeps at 16 lanes), and
// `stream` has them write the gradient with streaming stores (out of place; see use_streaming_stores).
template <typename T, bool kAvx512>
RowLoss<T> general_soft_row(const T* z, T* grad, int64_t C, const RowTarget<T>& tg, const RowSpec<T>& spec, T gamma,
                            T external, T scale, T* exps, bool stream, RowNormaliser<T>* normaliser) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  constexpr bool kWide = kAvx512 && std::is_same_v<T, float> && CALIBKERNELS_HAVE_AVX512_SWEEPS;
  const bool dense = tg.dense != nullptr;
  const bool loss_mode = spec.mode == Mode::Loss;
  const T q = spec.q;
  T ref;
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
  if constexpr (kWide) ref = avx512::row_max(z, C);
#endif
  if constexpr (!kWide) ref = row_max(z, C);
  const Vec ref_vec(ref), zero(T(0));

  SoftRowQuantities<T> r{};
  r.gamma = gamma;
  r.q = q;
  r.external = external;
  T denom = 0;
  T t_total = 1;  // Σ_k t_k: CE's gradient is Σt p - t, and a dense target's sum may be off 1 by its rounding
  CompactRow<T> cr{};
  if (dense) {
    // Σ e_k, Σ t_k, Σ t_k (z_k - ref) over t_k > 0 (0 · log 0 = 0, also for a -inf logit), Σ t_k e_k
    // gBS with q = 2 takes S = Σ p² - 2 P + Σ t² from these sums (no S sweep; its cancellation where p ≈ t is
    // absolute, ≈ eps, where u = S^{γ/2} is negligible anyway)
    const bool square_sums = spec.weight == Weight::Brier && spec.q == T(2);
    T total_e = 0, total_tz = 0, total_te = 0, total_ee = 0, total_tt = 0;
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
    if constexpr (kWide) {
      avx512::DenseSums sums;
      auto sweep = [&](auto square_tag, auto smooth_tag) {
        avx512::dense_exp_sweep<decltype(square_tag)::value, decltype(smooth_tag)::value>(z, tg.dense, tg.keep, tg.c,
                                                                                          exps, C, ref, sums);
      };
      auto with_smoothing = [&](auto square_tag) {
        if (tg.c > T(0)) {
          sweep(square_tag, std::true_type{});
        } else {
          sweep(square_tag, std::false_type{});
        }
      };
      if (square_sums) {
        with_smoothing(std::true_type{});
      } else {
        with_smoothing(std::false_type{});
      }
      total_e = sums.e, t_total = sums.t, total_tz = sums.tz, total_te = sums.te, total_ee = sums.ee;
      total_tt = sums.tt;
      flag_dense_target(tg, sums.given, sums.not_nonneg);
    }
#endif
    if constexpr (!kWide) {
      Vec sum_e(T(0)), sum_t(T(0)), sum_tz(T(0)), sum_te(T(0)), sum_ee(T(0)), sum_tt(T(0)), sum_given(T(0)),
          block_given(T(0)), min_given(T(0));
      for (int64_t k = 0; k < C; k += W) {
        if (k % (64 * W) == 0) {  // Σ T_k in blocks of 64 vectors, so its rounding stays far below the check's margin
          sum_given = sum_given + block_given;
          block_given = Vec(T(0));
        }
        const int64_t count = std::min<int64_t>(W, C - k);
        const Vec shifted = load_masked(z + k, count, ref) - ref_vec;
        const Vec e = Vec::set(zero, exp_nonpositive(shifted), count);
        e.store(exps + k, count);
        const Vec given = Vec::set(zero, Vec::loadu(tg.dense + k, count), count);
        block_given = block_given + given;
        min_given = at::vec::minimum(min_given, given);  // propagates NaN
        const Vec t = Vec::set(zero, at::vec::fmadd(Vec(tg.keep), given, Vec(tg.c)), count);
        sum_e = sum_e + e;
        sum_t = sum_t + t;
        sum_tz = sum_tz + Vec::blendv(zero, t * shifted, t > zero);
        sum_te = at::vec::fmadd(t, e, sum_te);
        if (square_sums) {
          sum_ee = at::vec::fmadd(e, e, sum_ee);
          sum_tt = at::vec::fmadd(t, t, sum_tt);
        }
      }
      total_e = horizontal_sum(sum_e), t_total = horizontal_sum(sum_t), total_tz = horizontal_sum(sum_tz);
      total_te = horizontal_sum(sum_te), total_ee = horizontal_sum(sum_ee), total_tt = horizontal_sum(sum_tt);
      flag_dense_target(tg, horizontal_sum(sum_given + block_given), any_lane_not_nonneg(min_given));
    }
    denom = total_e;
    const T log_denom = std::log(denom);
    r.ce = t_total * log_denom - total_tz;
    r.P = total_te / denom;
    r.one_minus_P = t_total - r.P;
    if (spec.flsd_schedule) r.gamma = flsd_gamma(static_cast<float>(r.P), gamma);
    if (square_sums) {
      const T sum_p2 = total_ee / (denom * denom);
      r.S = std::max(T(0), sum_p2 - T(2) * r.P + total_tt);
      r.H = sum_p2 - r.P;
    }
  } else {
    const T z_y = z[tg.y], z_m = z[tg.m];
    CompactSums<T> s{std::exp(z_y - ref), tg.m != tg.y ? std::exp(z_m - ref) : T(0), T(0), T(0), T(0)};
    T unused_sq = 0;
    for_columns_except(C, tg.y, tg.m, [&](int64_t lo, int64_t hi) {
      if (tg.c > T(0)) {
        exp_store_sweep<T, false, true, true>(z, exps, lo, hi, ref, s.rest, unused_sq, 0, &s.shift_sum);
      } else {
        exp_store_sweep<T, false, true>(z, exps, lo, hi, ref, s.rest, unused_sq, 0);
      }
    });
    s.shift_sum += (z_y - ref) + (tg.m != tg.y ? z_m - ref : T(0));
    s.others = s.e_m + s.rest;
    cr = compact_row(tg, C, z_y, z_m, ref, s);
    denom = cr.denom;
    const T log_denom = std::log1p(cr.log_arg);
    r.ce = cr.ce_offset + cr.ce_scale * log_denom;
    r.P = cr.P;
    r.one_minus_P = cr.one_minus_P;
    if (spec.flsd_schedule) {
      r.gamma = flsd_gamma(soft_flsd_band_probability(z_y, z_m, ref + log_denom, tg.w_y, tg.w_m, tg.c), gamma);
    }
  }
  if (normaliser != nullptr) *normaliser = {ref, denom};
  const T inv_denom = T(1) / denom;
  const bool square = q == T(2);
  if (spec.weight == Weight::Brier && !(dense && square)) {
    // S = Σ |p_k - t_k|^q and, for the "loss" mode, Σ p_k² (q = 2) or H = Σ h_k p_k
    Vec sum_s(T(0)), sum_h(T(0));
    const Vec inv(inv_denom), q_vec(q);
    auto sweep = [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; k += W) {
        const int64_t count = std::min<int64_t>(W, hi - k);
        const Vec p = Vec::loadu(exps + k, count) * inv;
        const Vec d = Vec::set(zero, p - target_vector(tg, k, count), count);
        if (square) {
          sum_s = at::vec::fmadd(d, d, sum_s);
          sum_h = at::vec::fmadd(p, p, sum_h);  // padding lanes: p = 0
        } else {
          const Vec a = d.abs();
          const Vec aq = Vec::blendv(a.pow(q_vec), zero, a == zero);
          sum_s = sum_s + aq;
          if (loss_mode) sum_h = sum_h + Vec::blendv(q_vec * aq * p / d, zero, d == zero);
        }
      }
    };
    if (dense) {
      sweep(0, C);
    } else {
      for_columns_except(C, tg.y, tg.m, sweep);
    }
    T S = horizontal_sum(sum_s), H = horizontal_sum(sum_h);
    if (!dense) {
      const bool mixed = tg.m != tg.y;
      auto add = [&](T p, T d) {
        if (square) {
          S += d * d;
          H += p * p;
        } else {
          S += d == T(0) ? T(0) : weight_power(d < T(0) ? -d : d, q);
          H += soft_brier_h(d, q) * p;
        }
      };
      add(cr.p_y, cr.d_y);
      if (mixed) add(cr.p_m, cr.d_m);
    }
    r.S = S;
    r.H = square ? H - r.P : H;
  }
  const SoftCoefficients<T> coefs = soft_weight_coefficients(spec.weight, loss_mode, r, square);

  if (grad != nullptr) {
    const Vec inv(inv_denom), q_vec(q), u(coefs.u), focal(coefs.focal), P(coefs.P), beta(coefs.beta), tau(coefs.tau),
        kk(coefs.k), H(coefs.H), scale_vec(scale), excess(coefs.u * (t_total - T(1)));
    const bool general = coefs.k != T(0);
    auto sweep = [&](int64_t lo, int64_t hi) {
      for (int64_t k = lo; k < hi; k += W) {
        const int64_t count = std::min<int64_t>(W, hi - k);
        const Vec p = Vec::loadu(exps + k, count) * inv;
        const Vec t = target_vector(tg, k, count);
        const Vec d = p - t;
        Vec g = u * d + excess * p - focal * p * (t - P) + beta * p * (d - tau);
        if (general) {
          const Vec a = d.abs();
          const Vec h = Vec::blendv(q_vec * a.pow(q_vec - Vec(T(1))), zero, a == zero);
          const Vec signed_h = Vec::blendv(h, zero - h, d < zero);
          g = g + Vec::blendv(kk * p * (signed_h - H), zero, p == zero);
        }
        (g * scale_vec).store(grad + k, count);
      }
    };
    if (dense) {
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
      if constexpr (kWide) {
        if (!general) {
          auto write = [&](auto stream_tag) {
            avx512::dense_gradient_sweep<decltype(stream_tag)::value>(exps, tg.dense, tg.keep, tg.c, grad, C, inv_denom,
                                                                      coefs.u, coefs.u * (t_total - T(1)), coefs.focal,
                                                                      coefs.P, coefs.beta, coefs.tau, scale);
          };
          if (stream) {
            write(std::true_type{});
          } else {
            write(std::false_type{});
          }
          return {T(1), coefs.u * r.ce, T(0)};
        }
      }
#endif
      sweep(0, C);
    } else {
      for_columns_except(C, tg.y, tg.m, sweep);
      grad[tg.y] = scale * soft_gradient_element(coefs, cr.p_y, cr.t_y, cr.d_y, q);
      if (tg.m != tg.y) grad[tg.m] = scale * soft_gradient_element(coefs, cr.p_m, cr.t_m, cr.d_m, q);
    }
  }
  return {T(1), coefs.u * r.ce, T(0)};
}

}  // namespace soft
