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
//     target sums, a gBS sweep for S = Σ |p_k - t_k|^q and H = Σ h_k p_k, and the gradient sweep; the row and its
//     target stay in L1/L2 between the sweeps.
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
};

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
  return count == Vectorized<T>::size() ? Vectorized<T>::loadu(p)
                                        : Vectorized<T>::set(Vectorized<T>(fill), Vectorized<T>::loadu(p, count), count);
}

// CE's pieces of a compact row: lse - z_k for a column with exponential e_k = exp(z_k - ref) (e_k = 1 at the
// reference point, where log1p(denom - 1) = log1p(Σ of the other columns) keeps the precision as p_k → 1).
template <typename T>
T ce_of_column(T z_k, T ref, T denom, T others) {
  return z_k == ref ? std::log1p(others) : (ref - z_k) + std::log(denom);
}

// The row's CE, P = <t, p>, 1 - P and the FLSD band from a compact row's sums: the exponentials e_y, e_m relative to
// ref, `rest` = Σ over the columns other than y and m, `shift_sum` = Σ_k (z_k - ref) over all columns (read only
// when c > 0).
template <typename T>
struct CompactSums {
  T e_y, e_m, rest, shift_sum;
};

template <typename T>
struct CompactRow {
  T denom, p_y, p_m, one_minus_p_y, one_minus_t_y, d_y, d_m, t_y, t_m, ce, P, one_minus_P, lse;
};

template <typename T>
CompactRow<T> compact_row(const RowTarget<T>& tg, int64_t C, T z_y, T z_m, T ref, const CompactSums<T>& s) {
  CompactRow<T> r;
  const bool mixed = tg.m != tg.y;
  r.denom = s.e_y + s.e_m + s.rest;
  const T others_y = s.e_m + s.rest;  // Σ_{k≠y} e_k (e_m is 0 without a distinct m)
  r.p_y = s.e_y / r.denom;
  r.one_minus_p_y = others_y / r.denom;
  r.p_m = mixed ? s.e_m / r.denom : r.p_y;
  const T one_minus_p_m = mixed ? (s.e_y + s.rest) / r.denom : r.one_minus_p_y;
  r.lse = ref + std::log(r.denom);
  const T ce_y = ce_of_column(z_y, ref, r.denom, others_y);
  const T ce_m = mixed ? ce_of_column(z_m, ref, r.denom, s.e_y + s.rest) : ce_y;
  T ce = 0;
  if (tg.w_y > T(0)) ce += tg.w_y * ce_y;
  if (tg.w_m > T(0)) ce += tg.w_m * ce_m;
  if (tg.c > T(0)) ce += tg.c * (static_cast<T>(C) * std::log(r.denom) - s.shift_sum);
  r.ce = ce;
  const T cm1 = tg.c * static_cast<T>(C - 1);
  r.one_minus_P = tg.w_y * r.one_minus_p_y + tg.w_m * one_minus_p_m + cm1;
  r.P = tg.w_y * r.p_y + tg.w_m * r.p_m + tg.c;
  r.t_y = tg.c + tg.w_y + (mixed ? T(0) : tg.w_m);
  r.t_m = mixed ? tg.c + tg.w_m : r.t_y;
  r.one_minus_t_y = (mixed ? tg.w_m : T(0)) + cm1;
  r.d_y = r.one_minus_t_y - r.one_minus_p_y;  // p_y - t_y without cancellation as p_y → 1
  r.d_m = mixed ? r.p_m - r.t_m : r.d_y;
  return r;
}

// Σ_k exp(z_k - ref) over [lo, hi), storing the exponentials in `out`, and Σ (z_k - ref) when kShift.
template <typename T, bool kShift>
void exp_sums(const T* z, T* out, int64_t lo, int64_t hi, T ref, T& sum, T& shift_sum) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec ref_vec(ref);
  Vec total(T(0)), shifts(T(0));
  for (int64_t k = lo; k < hi; k += W) {
    const int64_t count = std::min<int64_t>(W, hi - k);
    const Vec x = load_masked(z + k, count, ref);  // padding lanes: exp(0) = 1, masked below
    const Vec shifted = x - ref_vec;
    const Vec e = Vec::set(Vec(T(0)), exp_nonpositive(shifted), count);
    e.store(out + k, count);
    total = total + e;
    if constexpr (kShift) shifts = shifts + shifted;  // padding lanes add 0
  }
  sum += horizontal_sum(total);
  if constexpr (kShift) shift_sum += horizontal_sum(shifts);
}

// g_k over [lo, hi) from the stored exponentials for the columns whose target is the constant `uc` describes:
// g_k = scale (p_k (α + β (p_k - τ)) + δ).
template <typename T>
void uniform_gradient(const T* e, T* out, int64_t lo, int64_t hi, T inv_denom, const UniformColumnCoefficients<T>& uc,
                      T scale) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec inv(inv_denom), alpha(scale * uc.alpha), beta(scale * uc.beta), tau(uc.tau), delta(scale * uc.delta);
  for (int64_t k = lo; k < hi; k += W) {
    const int64_t count = std::min<int64_t>(W, hi - k);
    const Vec p = Vec::loadu(e + k, count) * inv;
    const Vec g = at::vec::fmadd(p, at::vec::fmadd(beta, p - tau, alpha), delta);
    g.store(out + k, count);
  }
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

template <typename T>
RowLoss<T> general_soft_row(const T* z, T* grad, int64_t C, const RowTarget<T>& tg, const RowSpec<T>& spec, T gamma,
                            T external, T scale, T* exps) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const bool dense = tg.dense != nullptr;
  const bool loss_mode = spec.mode == Mode::Loss;
  const T q = spec.q;
  const T ref = row_max(z, C);
  const Vec ref_vec(ref), zero(T(0));

  SoftRowQuantities<T> r{};
  r.gamma = gamma;
  r.q = q;
  r.external = external;
  T denom = 0, lse = 0;
  T t_total = 1;  // Σ_k t_k: CE's gradient is Σt p - t, and a dense target's sum may be off 1 by its rounding
  CompactRow<T> cr{};
  if (dense) {
    // Σ e_k, Σ t_k, Σ t_k (z_k - ref) over t_k > 0 (0 · log 0 = 0, also for a -inf logit), Σ t_k e_k
    Vec sum_e(T(0)), sum_t(T(0)), sum_tz(T(0)), sum_te(T(0));
    for (int64_t k = 0; k < C; k += W) {
      const int64_t count = std::min<int64_t>(W, C - k);
      const Vec shifted = load_masked(z + k, count, ref) - ref_vec;
      const Vec e = Vec::set(zero, exp_nonpositive(shifted), count);
      e.store(exps + k, count);
      const Vec t = Vec::set(zero, target_vector(tg, k, count), count);
      sum_e = sum_e + e;
      sum_t = sum_t + t;
      sum_tz = sum_tz + Vec::blendv(zero, t * shifted, t > zero);
      sum_te = at::vec::fmadd(t, e, sum_te);
    }
    denom = horizontal_sum(sum_e);
    const T log_denom = std::log(denom);
    lse = ref + log_denom;
    t_total = horizontal_sum(sum_t);
    r.ce = t_total * log_denom - horizontal_sum(sum_tz);
    r.P = horizontal_sum(sum_te) / denom;
    r.one_minus_P = t_total - r.P;
    if (spec.weight == Weight::Flsd) r.gamma = flsd_gamma(static_cast<float>(r.P), gamma);
  } else {
    const T z_y = z[tg.y], z_m = z[tg.m];
    CompactSums<T> s{std::exp(z_y - ref), tg.m != tg.y ? std::exp(z_m - ref) : T(0), T(0), T(0)};
    for_columns_except(C, tg.y, tg.m, [&](int64_t lo, int64_t hi) {
      if (tg.c > T(0)) {
        exp_sums<T, true>(z, exps, lo, hi, ref, s.rest, s.shift_sum);
      } else {
        exp_sums<T, false>(z, exps, lo, hi, ref, s.rest, s.shift_sum);
      }
    });
    s.shift_sum += (z_y - ref) + (tg.m != tg.y ? z_m - ref : T(0));
    cr = compact_row(tg, C, z_y, z_m, ref, s);
    denom = cr.denom;
    lse = cr.lse;
    r.ce = cr.ce;
    r.P = cr.P;
    r.one_minus_P = cr.one_minus_P;
    if (spec.weight == Weight::Flsd) {
      r.gamma = flsd_gamma(soft_flsd_band_probability(z_y, z_m, lse, tg.w_y, tg.w_m, tg.c), gamma);
    }
  }
  const T inv_denom = T(1) / denom;
  const bool square = q == T(2);
  if (spec.weight == Weight::Brier) {
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
      sweep(0, C);
    } else {
      for_columns_except(C, tg.y, tg.m, sweep);
      grad[tg.y] = scale * soft_gradient_element(coefs, cr.p_y, cr.t_y, cr.d_y, q);
      if (tg.m != tg.y) grad[tg.m] = scale * soft_gradient_element(coefs, cr.p_m, cr.t_m, cr.d_m, q);
    }
  }
  (void)lse;
  return {T(1), coefs.u * r.ce, T(0)};
}

}  // namespace soft
