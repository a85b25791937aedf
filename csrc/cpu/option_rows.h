// The rows of a call with the drop-in options (class weights w, the z-loss s · lse², soft-capping c · tanh(z / c)),
// included by uncertainty_weighted_ce_kernel.h inside its per-ISA namespace, after soft_target_rows.h. The contract is
// ../uncertainty_weighted_ce.h's; the maths is csrc/uncertainty_weights.h's soft-target block (shared with CUDA):
//
//   z' = c tanh(z / c) (or z),  p = softmax(z'),  t the row's unweighted target,  t' = w ⊙ t,  T' = Σ_k t'_k,
//   CE^w = T' lse - Σ_k t'_k z'_k,  L = u · CE^w + s · lse²   (u from t and z'),
//   dL/dz'_k = u (T' p_k - t'_k) + CE^w du/dz'_k ("loss" mode) + 2 s lse p_k,  dL/dz_k = dL/dz'_k (1 - (z'_k / c)²).
//
// Every target form (class indices as the compact row c = 0, w_y = 1; smoothing; a mix; a dense target) takes one
// general row: the target written out as a row t of C entries in a per-thread scratch row, a max sweep, an exponential
// sweep with the target sums, a gBS sweep (gBS only), and the gradient sweep, over rows that stay in L1/L2. The capped
// logits are written to a per-thread scratch row as the row is read (as 16-bit rows are widened), and the cap's
// derivative is applied in the gradient sweep. "mean" divides u · CE^w by D (Σ <w, t̄_i> for class indices, N for a
// dense target, the non-ignored rows without class weights) and the z-loss by the non-ignored rows.
#pragma once

namespace options {

using at::vec::Vectorized;

// The per-call values of the option rows (in the accumulation dtype T).
template <typename T>
struct OptionRowArgs {
  const T* class_weight;  // (C,) or null (w = 1)
  T softcap;              // c; 0: no cap
  T z_loss_scale;         // s
  T ce_scale;             // the gradient's factor of u · CE^w (1 / D for "mean")
  T z_grad_scale;         // the gradient's factor of the z-loss (1 / count for "mean")
};

// A row's two loss parts: u · CE^w and s · lse².
template <typename T>
struct OptionRowLoss {
  T weighted_ce;
  T z_loss;
};

// c tanh(z / c) of a vector. float: tanh(a) = (1 - e) / (1 + e) with e = exp(-2a), a = |z / c|, on the kernel's own
// exponential (several times cheaper than Sleef's tanhf, which the 16-bit and float32 rows would otherwise pay per
// element), and the odd series a - a³/3 + 2a⁵/15 - 17a⁷/315 below a = 1/8, where 1 - e would cancel (truncation
// error ≈ 2e-2 a⁹, a few 1e-9 relative): within a few ulps of tanhf. -inf gives -c, NaN stays NaN. double: Sleef's.
template <typename T>
Vectorized<T> soft_capped(const Vectorized<T>& z, const Vectorized<T>& cap) {
  using Vec = Vectorized<T>;
  if constexpr (std::is_same_v<T, float>) {
    const Vec x = z / cap;
    const Vec a = x.abs();
    const Vec e = exp_nonpositive(Vec(T(-2)) * a);
    const Vec one(T(1));
    const Vec a2 = a * a;
    const Vec series =
        a * at::vec::fmadd(
                a2,
                at::vec::fmadd(a2, at::vec::fmadd(a2, Vec(T(-17.0 / 315.0)), Vec(T(2.0 / 15.0))), Vec(T(-1.0 / 3.0))),
                one);
    const Vec magnitude = Vec::blendv((one - e) / (one + e), series, a < Vec(T(0.125)));
    return cap * Vec::blendv(magnitude, Vec(T(0)) - magnitude, x < Vec(T(0)));
  } else {
    return cap * (z / cap).tanh();
  }
}

// out_k = c tanh(z_k / c) for k in [0, C) (out may be z).
template <typename T>
void soft_cap_row(const T* z, T* out, int64_t C, T cap) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec cap_vec(cap);
  int64_t k = 0;
  for (; k + W <= C; k += W) soft_capped(Vec::loadu(z + k), cap_vec).store(out + k);
  if (k < C) soft_capped(Vec::loadu(z + k, C - k), cap_vec).store(out + k, C - k);
}

// The row's unweighted target t written out: the compact form c + w_y [k = y] + w_m [k = m], or (1 - a) T + c for a
// dense one. Returns where it lies (a dense target without smoothing is read where it is).
template <typename T>
const T* target_row(const soft::RowTarget<T>& tg, T* out, int64_t C) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  if (tg.dense != nullptr) {
    if (tg.c == T(0) && tg.keep == T(1)) return tg.dense;
    int64_t k = 0;
    for (; k < C; k += W) {
      const int64_t count = std::min<int64_t>(W, C - k);
      soft::target_vector(tg, k, count).store(out + k, count);
    }
    return out;
  }
  std::fill(out, out + C, tg.c);
  out[tg.y] += tg.w_y;
  out[tg.m] += tg.w_m;
  return out;
}

// The exponential sweep's sums (all relative to the row max ref).
template <typename T>
struct OptionSums {
  T e = 0;            // Σ e_k
  T te = 0;           // Σ t_k e_k = P · denom
  T rest_e = 0;       // Σ (1 - t_k) e_k = (1 - P) · denom for Σ t = 1, without cancellation
  T t = 0;            // Σ t_k
  T weighted_t = 0;   // T' = Σ w_k t_k
  T weighted_tz = 0;  // Σ_{t_k > 0} w_k t_k (z_k - ref)
};

// e_k = exp(z_k - ref) into exps, and the sums of OptionSums.
template <typename T>
OptionSums<T> option_exp_sweep(const T* z, const T* t, const T* w, T* exps, int64_t C, T ref) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec ref_vec(ref), zero(T(0)), one(T(1));
  Vec e_sum(zero), te_sum(zero), rest_sum(zero), t_sum(zero), wt_sum(zero), wtz_sum(zero);
  for (int64_t k = 0; k < C; k += W) {
    const int64_t count = std::min<int64_t>(W, C - k);
    const Vec shifted = soft::load_masked(z + k, count, ref) - ref_vec;
    const Vec e = Vec::set(zero, exp_nonpositive(shifted), count);
    e.store(exps + k, count);
    const Vec tv = Vec::loadu(t + k, count);  // lanes past the row are 0
    const Vec wt = w != nullptr ? Vec::loadu(w + k, count) * tv : tv;
    e_sum = e_sum + e;
    te_sum = at::vec::fmadd(tv, e, te_sum);
    rest_sum = at::vec::fmadd(one - tv, e, rest_sum);  // lanes past the row: e = 0
    t_sum = t_sum + tv;
    wt_sum = wt_sum + wt;
    // 0 · log 0 = 0 where t_k = 0, also for a -inf logit
    wtz_sum = wtz_sum + Vec::blendv(zero, wt * shifted, tv > zero);
  }
  return {horizontal_sum(e_sum), horizontal_sum(te_sum), horizontal_sum(rest_sum),
          horizontal_sum(t_sum), horizontal_sum(wt_sum), horizontal_sum(wtz_sum)};
}

// gBS's S = Σ |p_k - t_k|^q and, for "loss" mode, H (q = 2: Σ p_k², the caller subtracts P; else Σ h_k p_k).
template <typename T>
void option_brier_sums(const T* exps, const T* t, int64_t C, T inv_denom, T q, bool loss_mode, T& S, T& H) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec inv(inv_denom), q_vec(q), zero(T(0));
  const bool square = q == T(2);
  Vec sum_s(zero), sum_h(zero);
  for (int64_t k = 0; k < C; k += W) {
    const int64_t count = std::min<int64_t>(W, C - k);
    const Vec p = Vec::loadu(exps + k, count) * inv;
    const Vec d = Vec::set(zero, p - Vec::loadu(t + k, count), count);
    if (square) {
      sum_s = at::vec::fmadd(d, d, sum_s);
      sum_h = at::vec::fmadd(p, p, sum_h);  // lanes past the row: p = 0
    } else {
      const Vec a = d.abs();
      const Vec aq = Vec::blendv(a.pow(q_vec), zero, a == zero);
      sum_s = sum_s + aq;
      if (loss_mode) sum_h = sum_h + Vec::blendv(q_vec * aq * p / d, zero, d == zero);
    }
  }
  S = horizontal_sum(sum_s);
  H = horizontal_sum(sum_h);
}

// The gradient sweep's coefficients: g_k = p_k (a + b (d_k - τ) - f t_k) - v t'_k [+ K p_k (h_k - H)] (d = p - t),
// times the cap's derivative.
template <typename T>
struct OptionGradient {
  T inv_denom, a, b, tau, f, v, k, H, q, cap;
};

// grad_k from the stored exponentials (grad may be z: each vector is read before it is written).
template <typename T>
void option_gradient_sweep(const T* z, const T* exps, const T* t, const T* w, T* grad, int64_t C,
                           const OptionGradient<T>& c) {
  using Vec = Vectorized<T>;
  constexpr int64_t W = Vec::size();
  const Vec inv(c.inv_denom), a(c.a), b(c.b), tau(c.tau), f(c.f), v(c.v), kk(c.k), H(c.H), q_vec(c.q), zero(T(0)),
      one(T(1)), inv_cap(c.cap == T(0) ? T(0) : T(1) / c.cap);
  const bool general = c.k != T(0);
  for (int64_t k = 0; k < C; k += W) {
    const int64_t count = std::min<int64_t>(W, C - k);
    const Vec p = Vec::loadu(exps + k, count) * inv;
    const Vec tv = Vec::loadu(t + k, count);
    const Vec wt = w != nullptr ? Vec::loadu(w + k, count) * tv : tv;
    const Vec d = p - tv;
    Vec g = p * (a + b * (d - tau) - f * tv) - v * wt;
    if (general) {
      const Vec abs_d = d.abs();
      const Vec h = Vec::blendv(q_vec * abs_d.pow(q_vec - one), zero, abs_d == zero);
      const Vec signed_h = Vec::blendv(h, zero - h, d < zero);
      g = g + Vec::blendv(kk * p * (signed_h - H), zero, p == zero);
    }
    if (c.cap != T(0)) {
      const Vec ratio = Vec::loadu(z + k, count) * inv_cap;  // z'_k / c
      g = g * (one - ratio * ratio);
    }
    g.store(grad + k, count);
  }
}

// One non-ignored row of an option call on its (capped, widened) logits z: the loss parts, and if grad is non-null
// the gradient of the reduced loss (ce_scale / z_grad_scale folded in; may alias z). `t_row` and `exps`: scratch rows
// of C elements.
template <typename T>
OptionRowLoss<T> option_row(const T* z, T* grad, int64_t C, const soft::RowTarget<T>& tg, const OptionRowArgs<T>& o,
                            const RowSpec<T>& spec, T gamma, T external, T* t_row, T* exps,
                            RowNormaliser<T>* normaliser) {
  const bool loss_mode = spec.mode == Mode::Loss;
  const bool dense = tg.dense != nullptr;
  if (dense && tg.invalid != nullptr && soft::dense_row_may_fail(tg.dense, C, tg.flag_tolerance)) {
    tg.invalid->store(true, std::memory_order_relaxed);
  }
  const T* const t = target_row(tg, t_row, C);
  const T ref = row_max(z, C);
  const OptionSums<T> s = option_exp_sweep(z, t, o.class_weight, exps, C, ref);
  const T denom = s.e;
  if (normaliser != nullptr) *normaliser = {ref, denom};
  const T log_denom = std::log(denom);
  const T lse = ref + log_denom;
  const T inv_denom = T(1) / denom;
  SoftRowQuantities<T> r{};
  r.gamma = gamma;
  r.q = spec.q;
  r.external = external;
  r.ce = s.weighted_t * log_denom - s.weighted_tz;
  r.P = s.te * inv_denom;
  // Σ_k t_k (1 - p_k), as the reference sums it: a dense target's Σ t may be off 1 by its rounding
  r.one_minus_P = s.rest_e * inv_denom + (dense ? s.t - T(1) : T(0));
  if (spec.flsd_schedule) {
    r.gamma = dense ? flsd_gamma(static_cast<float>(r.P), gamma)
                    : flsd_gamma(soft_flsd_band_probability(z[tg.y], z[tg.m], lse, tg.w_y, tg.w_m, tg.c), gamma);
  }
  const bool square = spec.q == T(2);
  if (spec.weight == Weight::Brier) {
    option_brier_sums(exps, t, C, inv_denom, spec.q, loss_mode, r.S, r.H);
    if (square) r.H -= r.P;
  }
  const SoftCoefficients<T> coefs = soft_weight_coefficients(spec.weight, loss_mode, r, square);
  const T z_loss = o.z_loss_scale * lse * lse;
  if (grad != nullptr) {
    OptionGradient<T> g;
    g.inv_denom = inv_denom;
    g.a = o.ce_scale * (coefs.u * s.weighted_t + coefs.focal * coefs.P) + o.z_grad_scale * T(2) * o.z_loss_scale * lse;
    g.b = o.ce_scale * coefs.beta;
    g.tau = coefs.tau;
    g.f = o.ce_scale * coefs.focal;
    g.v = o.ce_scale * coefs.u;
    g.k = o.ce_scale * coefs.k;
    g.H = coefs.H;
    g.q = spec.q;
    g.cap = o.softcap;
    option_gradient_sweep(z, exps, t, o.class_weight, grad, C, g);
  }
  return {coefs.u * r.ce, z_loss};
}

}  // namespace options

// The divisor D of "mean"'s u · CE^w part: with class weights and class indices, Σ over the non-ignored rows of w_y
// (λ w_y + (1 - λ) w_m with a mix: the target before smoothing); else the non-ignored rows (N for a dense target).
template <typename acc_t>
double option_mean_divisor(const KernelArgs& args, const int64_t* targets, const acc_t* w, int64_t n) {
  const SoftTargetArgs& st = args.soft;
  if (w == nullptr || st.dense != nullptr) return static_cast<double>(args.valid_rows);
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t y = targets[i];
    if (y == args.ignore_index) continue;
    if (st.mix == nullptr) {
      total += static_cast<double>(w[y]);
      continue;
    }
    const double lam = st.lambda_float != nullptr
                           ? static_cast<double>(static_cast<acc_t>(st.lambda_float[i * st.lambda_stride]))
                           : static_cast<double>(static_cast<acc_t>(st.lambda_double[i * st.lambda_stride]));
    total += lam * static_cast<double>(w[y]) + (1.0 - lam) * static_cast<double>(w[st.mix[i]]);
  }
  return total;
}

// The loss of a call with options from its rows' parts: (N,) u · CE^w + s · lse² for reduction none (into row_loss),
// else Σ u · CE^w / D + Σ s · lse² / count for "mean" (0 where its divisor is 0), or the plain sums. z_rows null:
// no z-loss.
template <typename acc_t>
at::Tensor option_loss(const KernelArgs& args, const acc_t* ce_rows, const acc_t* z_rows, double divisor,
                       at::Tensor row_loss) {
  const int64_t n = row_loss.size(0);
  if (args.reduction == Reduction::None) {
    acc_t* loss = row_loss.mutable_data_ptr<acc_t>();  // may be ce_rows
    for (int64_t i = 0; i < n; ++i) loss[i] = z_rows != nullptr ? ce_rows[i] + z_rows[i] : ce_rows[i];
    return row_loss;
  }
  double ce_total = total_of_row_losses(ce_rows, n);
  double z_total = z_rows != nullptr ? total_of_row_losses(z_rows, n) : 0.0;
  if (args.reduction == Reduction::Mean) {
    ce_total = divisor > 0 ? ce_total / divisor : 0.0;
    z_total = args.valid_rows > 0 ? z_total / static_cast<double>(args.valid_rows) : 0.0;
  }
  return at::scalar_tensor(ce_total + z_total, row_loss.options());
}

// The rows of a call with any of the drop-in options (option_row), every target form; returns the loss tensor
// (row_loss: the (N,) buffer of reduction none) and writes the rows' z-loss to args.options.z_loss when given.
template <typename scalar_t, typename acc_t>
at::Tensor launch_option_rows(const at::Tensor& z, scalar_t* grad_ptr, int64_t grad_stride, const int64_t* t_ptr,
                              const acc_t* weight_ptr, const acc_t* gamma_ptr, const RowSpec<acc_t>& spec,
                              const KernelArgs& args, at::Tensor row_loss) {
  constexpr bool kWiden = !std::is_same_v<scalar_t, acc_t>;
  const int64_t n = z.size(0), c = z.size(1), z_stride = z.stride(0);
  const SoftTargetArgs& st = args.soft;
  const OptionArgs& opt = args.options;
  const scalar_t* z_ptr = z.const_data_ptr<scalar_t>();
  const acc_t* class_weight = static_cast<const acc_t*>(opt.class_weight);
  const acc_t* dense_ptr = st.dense != nullptr ? st.dense->template const_data_ptr<acc_t>() : nullptr;
  const acc_t keep = acc_t(1) - static_cast<acc_t>(st.smoothing);
  const acc_t uniform = static_cast<acc_t>(st.smoothing) / static_cast<acc_t>(c);
  const double divisor = option_mean_divisor(args, t_ptr, class_weight, n);
  const bool mean = args.reduction == Reduction::Mean;
  const options::OptionRowArgs<acc_t> o{
      class_weight, static_cast<acc_t>(opt.softcap), static_cast<acc_t>(opt.lse_square_scale),
      mean ? (divisor > 0 ? static_cast<acc_t>(1.0 / divisor) : acc_t(0)) : acc_t(1),
      mean ? static_cast<acc_t>(1.0 / static_cast<double>(std::max<int64_t>(args.valid_rows, 1))) : acc_t(1)};
  std::vector<acc_t> ce_rows(n);
  std::vector<acc_t> z_local(opt.z_loss != nullptr ? 0 : n);
  acc_t* const z_rows = opt.z_loss != nullptr ? static_cast<acc_t*>(opt.z_loss) : z_local.data();
  at::parallel_for(0, n, row_grain(c), [&](int64_t begin, int64_t end) {
    const FlushDenormalResults flush_denormals;
    const bool capped = o.softcap != acc_t(0);
    std::vector<acc_t> logits_row(kWiden || capped ? c : 0), t_row(c), exps(c);
    RowStatsWriter<acc_t> stats(args.confidence, args.prediction);
    for (int64_t i = begin; i < end; ++i) {
      scalar_t* const grad_row = grad_ptr != nullptr ? grad_ptr + i * grad_stride : nullptr;
      soft::RowTarget<acc_t> tg{nullptr, keep, uniform, acc_t(0), acc_t(0), 0, 0};
      if (dense_ptr != nullptr) {
        tg.dense = dense_ptr + i * c;
        tg.invalid = st.dense_invalid;
        tg.flag_tolerance = static_cast<acc_t>(st.dense_flag_tolerance);
      } else {
        const int64_t y = t_ptr[i];
        if (y == args.ignore_index) {
          ce_rows[i] = acc_t(0);
          z_rows[i] = acc_t(0);
          if (grad_row != nullptr) std::fill(grad_row, grad_row + c, scalar_t(0));
          stats.write_ignored(i);
          continue;
        }
        const acc_t lam = st.lambda_float != nullptr    ? static_cast<acc_t>(st.lambda_float[i * st.lambda_stride])
                          : st.lambda_double != nullptr ? static_cast<acc_t>(st.lambda_double[i * st.lambda_stride])
                                                        : acc_t(1);
        tg.y = y;
        tg.m = st.mix != nullptr ? st.mix[i] : y;
        tg.w_y = keep * lam;
        tg.w_m = keep * (acc_t(1) - lam);
      }
      const acc_t gamma = gamma_ptr != nullptr ? gamma_ptr[i] : spec.gamma;
      const acc_t external = weight_ptr != nullptr ? weight_ptr[i] : acc_t(1);
      const scalar_t* const z_row = z_ptr + i * z_stride;
      const acc_t* logits = nullptr;
      acc_t* gradient = nullptr;
      if constexpr (kWiden) {
        at::vec::convert(z_row, logits_row.data(), c);
        if (capped) options::soft_cap_row(logits_row.data(), logits_row.data(), c, o.softcap);
        logits = logits_row.data();
        gradient = grad_row != nullptr ? logits_row.data() : nullptr;  // widened back below
      } else {
        if (capped) options::soft_cap_row(z_row, logits_row.data(), c, o.softcap);
        logits = capped ? logits_row.data() : z_row;
        gradient = grad_row;
      }
      // the top label of the capped logits, before an in-place gradient overwrites them
      stats.take_top_label(logits, c);
      const options::OptionRowLoss<acc_t> parts = options::option_row(logits, gradient, c, tg, o, spec, gamma, external,
                                                                      t_row.data(), exps.data(), stats.normaliser());
      if constexpr (kWiden) {
        if (grad_row != nullptr) at::vec::convert(logits_row.data(), grad_row, c);
      }
      ce_rows[i] = parts.weighted_ce;
      z_rows[i] = parts.z_loss;
      stats.write(i);
    }
  });
  return option_loss(args, ce_rows.data(), z_rows, divisor, row_loss);
}
