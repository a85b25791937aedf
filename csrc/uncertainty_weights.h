// The uncertainty weights and their gradient coefficients, written once for every C++ kernel (csrc/cpu, csrc/cuda):
// a new weight is added here, and each kernel's sweeps apply the coefficients. Formulas: docs/losses.md.
//
// Per row, with p = softmax(z), p_y the target's probability, 1 - p_y computed without cancellation (Σ_{k≠y} p_k),
// CE = lse - z_y, the kernels compute u and the gradient of u·CE (mode "loss") or sg[u]·CE (mode "grad") as
//
//     g_k = p_k (α + β (p_k^{q-1} - τ)) + [k ∈ J] c_J     (k ≠ y),      g_y given separately,
//
// with the per-row scalars below (J: the dual-focal classes tied at p_j = max{p_k : z_k < z_y}):
//   none / external  u = 1 / w_i;  α = u,  g_y = -u (1-p_y)
//   focal / FLSD     u = (1-p_y)^γ;  α = u + CE·A,  A = γ (1-p_y)^{γ-1} p_y (loss mode; du/dz_k = -A (δ_ky - p_k)),
//                    g_y = -α (1-p_y)
//   dual focal       u = (1-p_y+p_j)^γ;  G = CE·γ (1-p_y+p_j)^{γ-1} (loss mode),
//                    du/dz_k = G/CE [(p_y - p_j) p_k + (p_j / n_J) [k∈J] - p_y δ_ky]:
//                    α = u + G (p_y - p_j),  c_J = G p_j / n_J,  g_y = -u (1-p_y) - G (p_y (1-p_y) + p_j p_y)
//   Brier (gBS)      S = Σ_{k≠y} p_k^q + (1-p_y)^q,  u = S^{γ/q};  K = CE (γ/q) S^{γ/q-1} (loss mode),
//                    dS/dz_k = q p_k^q - p_k T (k≠y), p_y (-q (1-p_y)^{q-1} - T) (k=y), T = q Σ_{k≠y} p_k^q -
//                    q p_y (1-p_y)^{q-1}: α = u, β = K q, τ = T / q, g_y = -u (1-p_y) + K p_y (-q (1-p_y)^{q-1} - T);
//                    for q = 1 (p_k^{q-1} = 1) the β term folds into α = u + K (q - T), β = 0.
// In mode "grad" every CE term is 0 (α = u, g_y = -u (1-p_y), β = c_J = 0).
#pragma once

#include <c10/macros/Macros.h>

#include <math.h>

#include "uncertainty_weighted_ce.h"

namespace calibkernels {
// Internal linkage: each kernel translation unit (the CPU kernel is compiled once per instruction set) keeps its own
// copy, so no out-of-line copy compiled for AVX2 can be chosen by the linker for the baseline kernel.
namespace {

C10_HOST_DEVICE inline float pow_of(float base, float exponent) { return ::powf(base, exponent); }
C10_HOST_DEVICE inline double pow_of(double base, double exponent) { return ::pow(base, exponent); }
C10_HOST_DEVICE inline float exp_of(float x) { return ::expf(x); }
C10_HOST_DEVICE inline double exp_of(double x) { return ::exp(x); }
C10_HOST_DEVICE inline float sqrt_of(float x) { return ::sqrtf(x); }
C10_HOST_DEVICE inline double sqrt_of(double x) { return ::sqrt(x); }

// base^exponent; small non-negative integer and half-integer exponents (γ = 2, 3, 4, 5, and gBS's γ/q with q = 2, as
// in every published setting) by repeated squaring, times sqrt(base) for the half, which is several times cheaper than
// pow and within a few ulps of it. pow costs about as much as a row's whole vector sweep at small C on a CPU, and a
// row takes up to four of them; it also sits on the row's chain of dependent scalar operations between its two
// sweeps, so its latency is paid in full. Every caller's base is >= 0 or NaN; for a half-integer exponent a negative
// base gives NaN as pow does, except -inf (NaN here, +inf from pow).
template <typename A>
C10_HOST_DEVICE inline A weight_power(A base, A exponent) {
  if (!(exponent >= A(0) && exponent <= A(16))) return pow_of(base, exponent);  // also NaN, before the cast
  const int twice = static_cast<int>(exponent * A(2));
  if (exponent * A(2) != static_cast<A>(twice)) return pow_of(base, exponent);
  A result = 1;
  if (twice & 1) {
    base += A(0);  // pow(-0, n + 1/2) is +0, where sqrt(-0) and (-0)^n for odd n are -0; +0 changes nothing else
    result = sqrt_of(base);
  }
  for (int bits = twice >> 1; bits != 0; bits >>= 1) {
    if (bits & 1) result *= base;
    base *= base;
  }
  return result;
}

// FLSD-53's band value of p_y, the same in every implementation: float32(exp(z_y - lse)), evaluated at the
// accumulation precision A (float for float32/float16/bfloat16 logits, double for float64) and rounded to float32.
// The kernels' own p_y = e_y / Σ e can differ from it in the last ulp (at z = [0, 0, 0, 0, 0]: 0.2f exactly,
// against exp(-logf(5)) = 0.19999999f), which would put a row at the boundary in the other band.
template <typename A>
C10_HOST_DEVICE inline float flsd_band_probability(A z_y, A lse) {
  return static_cast<float>(exp_of(z_y - lse));
}

// γ_i = 5 if p_y < 0.2f, 3 if p_y < 0.5f, else γ: float32 p_y against the float32 thresholds.
template <typename A>
C10_HOST_DEVICE inline A flsd_gamma(float p_band, A gamma) {
  return p_band < static_cast<float>(kFlsdLowThreshold)
             ? A(kFlsdLowGamma)
             : (p_band < static_cast<float>(kFlsdMidThreshold) ? A(kFlsdMidGamma) : gamma);
}

// What a row's weight needs from the row (the kernels' reductions).
template <typename A>
struct RowQuantities {
  A p_y;
  A one_minus_p_y;  // Σ_{k≠y} p_k, no cancellation
  A ce;             // CE = lse - z_y; read only in "loss" mode
  A gamma;          // γ of the row: the argument, a per-sample γ (focal), or flsd_gamma (FLSD)
  A q;              // the Brier norm
  A external;       // w_i (external)
  A p_j;            // dual focal: max{p_k : z_k < z_y}, 0 if none
  A tie_count;      // dual focal: how many classes attain p_j (≥ 1)
  A pow_q_others;   // Brier: Σ_{k≠y} p_k^q
};

template <typename A>
struct WeightCoefficients {
  A u = 1, alpha = 0, beta = 0, tau = 0, c_tie = 0, g_y = 0;
};

// The weight u and the gradient coefficients of the file header (for grad_output = 1, unscaled). `fold_linear`:
// q = 1 and the caller applies no β term (p_k^{q-1} = 1 is folded into α).
template <typename A>
C10_HOST_DEVICE inline WeightCoefficients<A> weight_coefficients(Weight weight, bool loss_mode,
                                                                 const RowQuantities<A>& r, bool fold_linear) {
  WeightCoefficients<A> c;
  const A omp = r.one_minus_p_y;
  switch (weight) {
    case Weight::None:
    case Weight::External: {
      c.u = weight == Weight::External ? r.external : A(1);
      c.alpha = c.u;
      c.g_y = -c.u * omp;
      break;
    }
    case Weight::Focal:
    case Weight::Flsd: {
      const A g = r.gamma;
      c.u = weight_power(omp, g);
      A a = 0;
      if (loss_mode && g != A(0) && omp > A(0)) a = g * weight_power(omp, g - A(1)) * r.p_y;
      c.alpha = c.u + r.ce * a;
      c.g_y = -c.alpha * omp;
      break;
    }
    case Weight::DualFocal: {
      const A base = omp + r.p_j;
      c.u = weight_power(base, r.gamma);
      A cg = 0;
      if (loss_mode && r.gamma != A(0) && base > A(0)) cg = r.ce * r.gamma * weight_power(base, r.gamma - A(1));
      c.alpha = c.u + cg * (r.p_y - r.p_j);
      c.g_y = -c.u * omp - cg * (r.p_y * omp + r.p_j * r.p_y);
      if (cg != A(0) && r.p_j > A(0)) c.c_tie = cg * r.p_j / r.tie_count;
      break;
    }
    case Weight::Brier:
    case Weight::BrierFlsd: {  // r.gamma is the row's γ_i
      const A q = r.q;
      const A s = r.pow_q_others + weight_power(omp, q);
      c.u = weight_power(s, r.gamma / q);
      c.alpha = c.u;
      c.g_y = -c.u * omp;
      if (loss_mode && r.gamma != A(0) && s > A(0)) {
        const A omp_qm1 = (omp > A(0) || q >= A(1)) ? weight_power(omp, q - A(1)) : A(0);
        const A t = q * r.pow_q_others - q * r.p_y * omp_qm1;
        const A k = r.ce * (r.gamma / q) * weight_power(s, r.gamma / q - A(1));
        if (fold_linear) {
          c.alpha = c.u + k * (q - t);
        } else {
          c.beta = k * q;
          c.tau = t / q;
        }
        c.g_y = -c.u * omp + k * r.p_y * (-q * omp_qm1 - t);
      }
      break;
    }
  }
  return c;
}

// g_k (k ≠ y) of one element from p_k and p_k^{q-1} (the scalar form of the kernels' sweeps).
template <typename A>
C10_HOST_DEVICE inline A gradient_element(const WeightCoefficients<A>& c, A p, A p_qm1, bool tied) {
  // p_k = 0 (underflow): p_k^{q-1} may be inf for q < 1, and the term, p_k^q, tends to 0
  A g = p == A(0) ? A(0) : p * (c.alpha + c.beta * (p_qm1 - c.tau));
  if (tied) g += c.c_tie;
  return g;
}

// ---------------------------------------------------------------------------------------------------------------------
// Soft targets (docs/losses.md, "Soft targets"): a target distribution t per row, Σ_k t_k = 1, given compactly as
//     t_k = c + w_y [k = y] + w_m [k = m]      (c = a/C, w_y = (1-a) λ, w_m = (1-a)(1-λ); m may equal y)
// (class indices, a mixup/cutmix mix, label smoothing a), or densely as t_k = (1-a) T_k + a/C. With P = <t, p>:
//   CE = -Σ_k t_k log p_k;   u = 1 | w_i (external) | (1 - P)^γ (focal; FLSD's γ_i from the band of P) |
//   S^{γ/q}, S = Σ_k |p_k - t_k|^q (gBS);
//   g_k = u (p_k - t_k) + L_k, the "loss"-mode term (0 in mode "grad"):
//     focal / FLSD   L_k = -A p_k (t_k - P),               A = CE γ (1-P)^{γ-1}
//     gBS, q = 2     L_k = β p_k ((p_k - t_k) - τ),        β = CE γ S^{γ/2-1}, τ = Σ_j p_j² - P
//     gBS, any q     L_k = K p_k (h_k - H),                K = CE (γ/q) S^{γ/q-1}, H = Σ_j h_j p_j,
//                                                          h_k = q |p_k - t_k|^{q-1} sign(p_k - t_k)
// (dS/dz_k = p_k (h_k - H) and dP/dz_k = p_k (t_k - P)). Dual focal has no soft form: the kernels refuse it.
// ---------------------------------------------------------------------------------------------------------------------

// What a soft row's weight needs from the row's reductions.
template <typename A>
struct SoftRowQuantities {
  A one_minus_P;  // 1 - <t, p> = Σ_k t_k (1 - p_k), summed without cancellation where the kernel can
  A P;            // <t, p>
  A ce;           // -Σ_k t_k log p_k; read only in "loss" mode
  A gamma;        // γ of the row (FLSD: flsd_gamma of the band value of P)
  A q;            // the Brier norm
  A external;     // w_i (external)
  A S;            // gBS: Σ_k |p_k - t_k|^q
  A H;            // gBS: q = 2: τ = Σ_j p_j² - P;  any other q: H = Σ_j h_j p_j
};

template <typename A>
struct SoftCoefficients {
  A u = 1;
  A focal = 0;  // A of focal / FLSD
  A P = 0;
  A beta = 0;  // β of gBS with q = 2
  A tau = 0;
  A k = 0;  // K of gBS with any other q
  A H = 0;
};

// u and the loss-mode coefficients of a soft row (for grad_output = 1, unscaled). `square`: the gBS norm is 2 and the
// caller uses β, τ (otherwise K, H).
template <typename A>
C10_HOST_DEVICE inline SoftCoefficients<A> soft_weight_coefficients(Weight weight, bool loss_mode,
                                                                    const SoftRowQuantities<A>& r, bool square) {
  SoftCoefficients<A> c;
  c.P = r.P;
  switch (weight) {
    case Weight::None:
    case Weight::External:
      c.u = weight == Weight::External ? r.external : A(1);
      break;
    case Weight::Focal:
    case Weight::Flsd: {
      const A base = r.one_minus_P;
      c.u = weight_power(base, r.gamma);
      if (loss_mode && r.gamma != A(0) && base > A(0)) c.focal = r.ce * r.gamma * weight_power(base, r.gamma - A(1));
      break;
    }
    case Weight::Brier:
    case Weight::BrierFlsd: {  // r.gamma is the row's γ_i
      const A q = r.q;
      c.u = weight_power(r.S, r.gamma / q);
      if (loss_mode && r.gamma != A(0) && r.S > A(0)) {
        const A kk = r.ce * (r.gamma / q) * weight_power(r.S, r.gamma / q - A(1));
        if (square) {
          c.beta = kk * A(2);
          c.tau = r.H;
        } else {
          c.k = kk;
          c.H = r.H;
        }
      }
      break;
    }
    case Weight::DualFocal:
      break;  // refused before any row is processed
  }
  return c;
}

// h_k = q |d|^{q-1} sign(d) of gBS for d = p_k - t_k (0 at d = 0: the subgradient, and the limit for q > 1).
template <typename A>
C10_HOST_DEVICE inline A soft_brier_h(A d, A q) {
  if (d == A(0)) return A(0);
  const A magnitude = q * weight_power(d < A(0) ? -d : d, q - A(1));
  return d < A(0) ? -magnitude : magnitude;
}

// g_k of one element from p_k, t_k and d = p_k - t_k (which the caller may form more accurately than p - t, e.g. as
// (1 - t_y) - (1 - p_y) for the target column).
template <typename A>
C10_HOST_DEVICE inline A soft_gradient_element(const SoftCoefficients<A>& c, A p, A t, A d, A q) {
  A g = c.u * d;
  if (c.focal != A(0)) g -= c.focal * p * (t - c.P);
  if (c.beta != A(0)) g += c.beta * p * (d - c.tau);
  if (c.k != A(0) && p != A(0)) g += c.k * p * (soft_brier_h(d, q) - c.H);
  return g;
}

// The same for the columns whose target is the constant c (the compact form's other columns, q = 2 or no gBS) as the
// affine-quadratic form of the vector sweeps, g_k = p_k (α + β (p_k - τ)) + δ.
template <typename A>
struct UniformColumnCoefficients {
  A alpha, beta, tau, delta;
};

template <typename A>
C10_HOST_DEVICE inline UniformColumnCoefficients<A> soft_uniform_columns(const SoftCoefficients<A>& c, A t) {
  // u (p - t) - A p (t - P) + β p (p - t - τ) = p (u + A (P - t) + β (p - (t + τ))) - u t
  return {c.u + c.focal * (c.P - t), c.beta, t + c.tau, -c.u * t};
}

// FLSD's band value of P = <t, p> for compact targets, the same closed form in every implementation (the reference
// included): float32((w_y exp(z_y - lse) + w_m exp(z_m - lse)) + c), evaluated at the accumulation precision A
// (without a mix: w_m = 0, m = y). Dense targets use float32(Σ_k t_k exp(z_k - lse)), equal up to summation order.
template <typename A>
C10_HOST_DEVICE inline float soft_flsd_band_probability(A z_y, A z_m, A lse, A w_y, A w_m, A c) {
  return static_cast<float>((w_y * exp_of(z_y - lse) + w_m * exp_of(z_m - lse)) + c);
}

}  // namespace
}  // namespace calibkernels
