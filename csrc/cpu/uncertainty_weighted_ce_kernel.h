// The CPU kernel's rows (process_row) and their launch over a batch, compiled once per instruction set: included
// by csrc/cpu/kernel_default.cpp (x86-64 baseline, ATen's scalar Vectorized<>) and csrc/cpu/kernel_avx2.cpp (AVX2 +
// FMA for the whole translation unit, plus the AVX-512 sweeps of vec_exp.h behind target attributes), which define
// CPU_CAPABILITY and CALIBKERNELS_ISA (the namespace of their entry point, see kernel_entry.h) before including it.
//
// Fused CPU kernel of the uncertainty-weighted cross-entropy family (formulas: docs/losses.md; contract in
// ../uncertainty_weighted_ce.h).
//
//   L_i = u_i · CE_i,  CE_i = logsumexp(z_i) - z_{i,y_i},  u_i ∈ {1, (1-p_y)^γ, (1-p_y)^γ_i (FLSD), (1-p_y+p_j)^γ,
//   ‖p - e_y‖_q^γ (gBS), w_i (external)}; mode "grad" (GRA, BSCE-GRA paper Eq. 11) detaches u_i, mode "loss"
//   differentiates through it.
//
// One row at a time, rows in parallel (at::parallel_for). The common weights (none, focal, FLSD, external, gBS with
// q = 1 or 2) take the one-exponential path (exp_store_sweep + rescale_sweep, described at row_max in row_sweeps.h);
// the others make two sweeps over a row that stays in L1/L2 between them:
//   1. reduction sweep: online softmax (running max m, Σ exp(z-m)) block by block, with the target column excluded
//      so that Σ_{k≠y} p_k and Σ_{k≠y} p_k^q (the gBS accumulator S_q, rescaled by exp(-qΔm) when m moves) come
//      out without the cancellation of "1 - p_y" or "S_q - p_y^q"; the dual-focal p_j is a second max sweep;
//   2. gradient sweep: p_k = exp((z_k - m) - log d) and the gradient of the (reduced) loss for grad_output = 1, written
//      once. In every weight × mode it is  g_k = p_k (α + β (p_k^{q-1} - τ)) + [k ∈ J] c_J  for k ≠ y, plus a
//      scalar fix-up of g_y; α, β, τ, c_J and g_y are per-row scalars from csrc/uncertainty_weights.h (docs/losses.md).
// fp16/bf16 rows are widened to fp32 in a per-thread scratch row (so the two sweeps read fp32 from cache);
// float64 accumulates in double (gradcheck/opcheck). Indexing is int64 throughout; any row stride is accepted.
// The sweeps are in row_sweeps.h (generic) and vec_exp.h (AVX-512), the soft-target rows in soft_target_rows.h; this
// file holds a hard row (process_row) and the launch over a batch, hard_rows.h the hard rows' loop. Calls with the
// drop-in options (class weights, z-loss, soft-capping) on class-index rows take the hard rows (hard_rows.h), with soft
// targets the rows of option_rows.h.

#if !defined(CPU_CAPABILITY) || !defined(CALIBKERNELS_ISA)
#error "include csrc/cpu/uncertainty_weighted_ce_kernel.h from a kernel_<isa>.cpp that defines CPU_CAPABILITY"
#endif

#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/cpu/vec/vec.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/scalar_tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "uncertainty_weighted_ce.h"
#include "uncertainty_weights.h"
#include "cpu/kernel_entry.h"
#include "cpu/row_sweeps.h"
#include "cpu/vec_exp.h"

namespace calibkernels {
namespace CALIBKERNELS_ISA {
namespace {

template <typename T>
struct RowSpec {
  Weight weight;  // the weight's formula (weight_formula: FLSD's rows are focal rows, BrierFlsd's Brier rows)
  Mode mode;
  T gamma;
  T q;
  bool flsd_schedule;  // γ_i from FLSD-53's band (uses_flsd_schedule)
};

// Bound on Σ_{k≠y} exp(z_k - z_y) for the target-referenced exponentials of process_row: 2^60 keeps every e_k and
// Σ e_k² (≤ (Σ e_k)² ≤ 2^120) finite in float and 1 / Σ e_k a normal number (no denormal loss of precision).
constexpr double kTargetReferenceLimit = 1152921504606846976.0;  // 2^60

// How far ahead of its loads the exponential sweep prefetches the logits (launch() → process_row): 4 KiB, a row
// ahead at C = 1000 fp32, and ≈ 60 exponentials (≈ 1000 cycles) of lead time on longer rows. With it the
// target-referenced sweep, the first to read the row, beats a max sweep followed by the exponential sweep.
constexpr int64_t kPrefetchBytes = 4096;

// Denormal results flushed to zero (MXCSR's FTZ bit) in the calling thread while alive; the thread's own mode is
// restored after, with the exception flags raised meanwhile kept. Every parallel task of the kernel holds one. On
// Intel cores each arithmetic result that would be a denormal costs a microcode assist of some hundred cycles, and the
// calibration weights make such results common in confident rows: a BSCE-GRA row whose target logit is 40 above the
// rest has u ≈ 1e-29 and gradient entries u · p_k / N ≈ 1e-50, every one of which would underflow through an assist
// (docs/performance.md has the measurement). What changes: results below FLT_MIN (DBL_MIN for float64) become 0, and
// so do results computed from such intermediates, which stay tiny (a gradient entry of ≈ 1e-35 can come out 0 in
// float32), far below any tolerance of the loss or its gradient. Inputs that are themselves denormal are still read as
// they are (no DAZ).
class FlushDenormalResults {
 public:
#if defined(__x86_64__) || defined(_M_X64)
  FlushDenormalResults() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFlushToZero); }
  ~FlushDenormalResults() { _mm_setcsr(saved_ | (_mm_getcsr() & kExceptionFlags)); }

 private:
  static constexpr unsigned kFlushToZero = 0x8000;
  static constexpr unsigned kExceptionFlags = 0x3f;  // the sticky flags IE, DE, ZE, OE, UE, PE
  unsigned saved_;
#else
  FlushDenormalResults() {}  // other architectures keep their default mode
#endif
  FlushDenormalResults(const FlushDenormalResults&) = delete;
  FlushDenormalResults& operator=(const FlushDenormalResults&) = delete;
};

// at::parallel_for's grain for rows of c columns: enough columns per task that scheduling is amortised.
inline int64_t row_grain(int64_t c) { return std::max<int64_t>(1, 16384 / c); }

// Streaming (non-temporal) stores for the out-of-place gradient. A fresh gradient buffer is not in the cache, so an
// ordinary store first reads each line from DRAM and later writes it back, evicting the logits the sweep still reads;
// a streaming store writes the line once, without reading it. The row's exponentials then go to a per-thread scratch
// row instead (launch) and the rescaling sweep streams the gradient out of it. Used where they pay (fp32, out of
// place, AVX-512; docs/performance.md): rows of 1–16 KiB, i.e. C = 256…4096; not below (the row being mostly scalar
// work) nor above (the scratch row would not fit L1); and only for gradients of at least 4 MiB, since a smaller one
// would still be in the cache for whatever reads it next.
// CALIBKERNELS_CPU_STREAMING_STORES=0 / =1 forces them off / on for every out-of-place float row the AVX-512 path
// stores: a testing hook (tests/test_uncertainty_weighted_ce_cpu_sweeps.py compares both forms bit for bit over rows
// the automatic choice would not stream), not a user setting; read on every call so that one process can test both.
constexpr int64_t kStreamMinRowBytes = 1024;
constexpr int64_t kStreamMaxRowBytes = 16384;
constexpr int64_t kStreamMinGradientBytes = int64_t(4) << 20;

bool use_streaming_stores(int64_t n, int64_t c, int64_t element_bytes) {
  if (const char* flag = std::getenv("CALIBKERNELS_CPU_STREAMING_STORES"); flag != nullptr && flag[0] != '\0') {
    return flag[0] != '0';
  }
  const int64_t row_bytes = c * element_bytes;
  return row_bytes >= kStreamMinRowBytes && row_bytes <= kStreamMaxRowBytes && n * row_bytes >= kStreamMinGradientBytes;
}

// A row's loss as weight · (ce_offset + log1p(ce_log1p_arg)): rows whose CE logarithm can wait leave it to one
// vectorised pass over a chunk of rows (finish_row_losses) instead of a scalar log per row, a large share of the op
// at small C. A row that computed its loss already stores {1, loss, 0}.
template <typename T>
struct RowLoss {
  T weight;
  T ce_offset;
  T ce_log1p_arg;
};

// loss[i] = weight · (ce_offset + log1p(ce_log1p_arg)) for the rows of [begin, end).
template <typename T>
void finish_row_losses(const RowLoss<T>* parts, T* loss, int64_t begin, int64_t end) {
  using Vec = at::vec::Vectorized<T>;
  constexpr int64_t W = Vec::size();
  T weight[W], offset[W], arg[W];
  int64_t i = begin;
  for (; i < end; i += W) {
    const int64_t count = std::min<int64_t>(W, end - i);
    for (int64_t l = 0; l < count; ++l) {
      weight[l] = parts[i + l].weight;
      offset[l] = parts[i + l].ce_offset;
      arg[l] = parts[i + l].ce_log1p_arg;
    }
    const Vec result = Vec::loadu(weight, count) * (Vec::loadu(offset, count) + Vec::loadu(arg, count).log1p());
    result.store(loss + i, count);
  }
}

// Whether a row takes the one-exponential path (exp_store_sweep + rescale_sweep: every weight but dual focal and gBS
// norms other than 1 and 2), and whether that path runs as the AVX-512 sweeps (float rows, when kAvx512 was chosen at
// run time; only these have the streaming-store form).
template <PowQ kPow, bool kDual>
constexpr bool kOneExponentialPath = !kDual && kPow != PowQ::General;
template <typename T, PowQ kPow, bool kDual, bool kAvx512>
constexpr bool kAvx512OneExponentialPath =
    kAvx512 && kOneExponentialPath<kPow, kDual> && std::is_same_v<T, float> && CALIBKERNELS_HAVE_AVX512_SWEEPS;

// Loss of one non-ignored row, as RowLoss parts (see finish_row_losses); if `grad` is non-null also writes
// scale · dL_i/dz_i there (may alias z). kAvx512: the one-exponential path's sweeps are the AVX-512 ones (float only).
// `ahead`: how many elements past its loads the exponential sweep prefetches (0 when z is an L1-resident scratch row).
// `exp_row`: a scratch row of C elements for the exponentials, required when `grad` aliases `z` or `stream` is set:
// the row-max fallback re-reads z after the first exponential sweep, so that sweep must not overwrite it.
// `stream`: write the gradient with streaming stores (AVX-512 sweeps only; see use_streaming_stores).
// `normaliser`: where to leave the row's softmax normaliser for return_stats (null: not asked for).
// kZLoss (calls with the drop-in options): `z_loss` adds the row's s · lse² to *z_loss.out and its gradient
// 2 s lse p_k (times z_loss.grad_scale / (2 s)) to α (z_loss.out null: no z-loss).
template <typename T>
struct ZLossTerm {
  T scale;       // s
  T grad_scale;  // the gradient's factor of lse · p_k: 2 s (over the non-ignored rows for "mean")
  T* out;        // the row's s · lse²; null: no z-loss
};

template <typename T, PowQ kPow, bool kDual, bool kAvx512, bool kZLoss = false>
RowLoss<T> process_row(const T* z, T* grad, int64_t C, int64_t y, const RowSpec<T>& spec, T gamma, T external_weight,
                       T scale, int64_t ahead, T* exp_row, bool stream, RowNormaliser<T>* normaliser,
                       ZLossTerm<T> z_loss = {}) {
  const T inf = std::numeric_limits<T>::infinity();
  const T q = spec.q;
  const T z_y = z[y];

  // The one-exponential path needs a finite reference point m (an all -inf row takes the general path and its NaN
  // rules).
  constexpr bool kCanStore = kOneExponentialPath<kPow, kDual>;
  constexpr bool kWide = kAvx512OneExponentialPath<T, kPow, kDual, kAvx512>;
  auto max_of_row = [&]() -> T {
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
    if constexpr (kWide) return avx512::row_max(z, C);
#endif
    return row_max(z, C);
  };
  // The exponentials are taken relative to the target logit, e_k = exp(z_k - z_y), rather than to the row max: any
  // reference point gives the same p_k = e_k / Σ e, and this one needs no max sweep before the exponential sweep.
  // It is kept only while the sums stay in range (Σ_{k≠y} e_k ≤ kTargetReferenceLimit, i.e. no column more than ≈ 41
  // above the target); past that, or for a non-finite target logit or NaN, the row is done again from its max.
  T m = -inf;
  bool target_reference = false;
  if constexpr (kCanStore) {
    target_reference = std::isfinite(z_y);
    m = target_reference ? z_y : max_of_row();
  }
  const bool one_exp = kCanStore && m != -inf;
  const bool stored = one_exp && grad != nullptr;
  const bool streamed = kWide && stored && stream;
  // The exponentials go to the scratch row when they must not overwrite z (in place, or a widened row whose scratch
  // copy is also its gradient) or when the gradient is streamed out of it.
  const bool via_scratch = stored && (streamed || static_cast<const void*>(grad) == static_cast<const void*>(z));
  T* const exps = via_scratch ? exp_row : grad;
  T sum_others = 0;        // Σ_{k≠y} exp(z_k - m)
  T sum_pow_q_others = 0;  // Σ_{k≠y} exp(q (z_k - m))
  if (one_exp) {
    constexpr bool kSquare = kPow == PowQ::Square;
    auto sweep = [&](auto store_tag, T* out, int64_t distance) {
      constexpr bool kStore = decltype(store_tag)::value;
      sum_others = 0;
      sum_pow_q_others = 0;
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
      if constexpr (kWide) {
        avx512::exp_store_sweep<kSquare, kStore>(z, out, C, y, m, sum_others, sum_pow_q_others, distance);
      }
#endif
      if constexpr (!kWide) {
        exp_store_sweep<T, kSquare, kStore>(z, out, 0, y, m, sum_others, sum_pow_q_others, distance);
        exp_store_sweep<T, kSquare, kStore>(z, out, y + 1, C, m, sum_others, sum_pow_q_others, distance);
      }
    };
    auto sweep_row = [&](int64_t distance) {
      if (stored) {
        sweep(std::true_type{}, exps, distance);
      } else {
        sweep(std::false_type{}, nullptr, distance);
      }
    };
    // Without a max sweep, the exponential sweep is the first to read the row: at one load per exponential it
    // cannot keep enough misses in flight, so it prefetches `ahead` elements on (the rest of the row and the next).
    sweep_row(ahead);
    if (target_reference && !(sum_others <= T(kTargetReferenceLimit))) {  // also NaN
      m = max_of_row();
      sweep_row(0);  // the row has just been read
    }
  } else {
    OnlineSoftmax<T> acc;
    accumulate<T, kPow>(z, 0, y, q, acc);
    accumulate<T, kPow>(z, y + 1, C, q, acc);
    sum_others = horizontal_sum(acc.sum);
    sum_pow_q_others = horizontal_sum(acc.sum_pow_q);
    m = acc.max;
  }
  // The AVX-512 sweep stores exp(z_k - m) for the target column too (the generic sweeps skip it): reuse it.
  const bool e_y_stored = kWide && stored && z_y <= m;
  if (!(z_y <= m)) {  // the target is the row max (or the only finite column): move the max to it
    if (m != -inf) {  // else the other columns' sums are 0, or NaN from a NaN logit: kept as they are
      sum_others *= std::exp(m - z_y);
      sum_pow_q_others *= (kPow == PowQ::Square) ? std::exp(2 * (m - z_y)) : std::exp(q * (m - z_y));
    }
    m = z_y;
  }
  const T e_y = e_y_stored ? exps[y] : std::exp(z_y - m);
  const T denom = e_y + sum_others;
  if (normaliser != nullptr) *normaliser = {m, denom};
  const bool loss_mode = spec.mode == Mode::Loss;
  // CE = lse - z_y = (m - z_y) + log1p(denom - 1); denom - 1 = Σ_{k≠y} e_k exactly when the target is the max, so
  // log1p keeps full precision as p_y → 1. Outside "loss" mode nothing in the row needs the CE, so on the stored
  // path its logarithm is left to finish_row_losses.
  const bool defer_ce = stored && !loss_mode;
  const T ce_offset = (z_y == m) ? T(0) : m - z_y;
  const T ce_log1p_arg = (e_y - T(1)) + sum_others;
  const T ce = defer_ce ? T(0) : ce_offset + std::log1p(ce_log1p_arg);
  // Read only by the paths that recompute p_k: dual focal, a general norm q, the unstored gradient sweep.
  const T log_denom = stored ? T(0) : std::log(denom);
  const T p_y = e_y / denom;
  const T one_minus_p_y = sum_others / denom;  // exact 1 - p_y, no cancellation

  // Per-row weight u and, in "loss" mode, the coefficients of CE · du/dz (csrc/uncertainty_weights.h).
  RowQuantities<T> row{p_y, one_minus_p_y, ce, gamma, q, external_weight, T(0), T(1), T(0)};
  T z_j = -inf;
  if (spec.flsd_schedule) row.gamma = flsd_gamma(flsd_band_probability(z_y, m + std::log(denom)), gamma);
  if constexpr (kDual) {
    z_j = max_below(z, C, z_y);
    row.p_j = (z_j == -inf) ? T(0) : std::exp((z_j - m) - log_denom);
    if (loss_mode && row.p_j > 0) row.tie_count = static_cast<T>(count_equal(z, C, z_j));
  }
  if (spec.weight == Weight::Brier) {
    if constexpr (kPow == PowQ::Square) {
      row.pow_q_others = sum_pow_q_others / (denom * denom);
    } else if constexpr (kPow == PowQ::Linear) {
      row.pow_q_others = one_minus_p_y;
    } else {
      row.pow_q_others = sum_pow_q_others * std::exp(-q * log_denom);
    }
  }
  const WeightCoefficients<T> coefs = weight_coefficients(spec.weight, loss_mode, row, kPow == PowQ::Linear);
  const T u = coefs.u, beta = coefs.beta, tau = coefs.tau, c_j = coefs.c_tie;
  // the gradient's α and target column, of the reduced loss (scale), with the z-loss's 2 s lse p_k folded in
  T alpha_scaled = scale * coefs.alpha, g_y_scaled = scale * coefs.g_y;
  if constexpr (kZLoss) {
    if (z_loss.out != nullptr) {
      const T lse = m + (stored ? std::log(denom) : log_denom);
      *z_loss.out = z_loss.scale * lse * lse;
      alpha_scaled += z_loss.grad_scale * lse;
      g_y_scaled += z_loss.grad_scale * lse * p_y;
    }
  }

  if (grad != nullptr && stored) {
    if constexpr (kCanStore) {
      auto rescale = [&](auto square_tag, T beta_scaled, T tau_value) {
        constexpr bool kSquare = decltype(square_tag)::value;
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
        if constexpr (kWide) {
          if (streamed) {
            avx512::rescale_stream_sweep<kSquare>(exps, grad, C, T(1) / denom, alpha_scaled, beta_scaled, tau_value, y,
                                                  g_y_scaled);
          } else {
            avx512::rescale_sweep<kSquare>(exps, grad, C, T(1) / denom, alpha_scaled, beta_scaled, tau_value);
          }
        }
#endif
        if constexpr (!kWide) {
          rescale_sweep<T, kSquare>(exps, grad, C, T(1) / denom, alpha_scaled, beta_scaled, tau_value);
        }
      };
      if (beta != 0) {
        rescale(std::bool_constant<kPow == PowQ::Square>{}, scale * beta, tau);
      } else {
        rescale(std::false_type{}, T(0), T(0));
      }
    }
    if (!streamed) grad[y] = g_y_scaled;
  } else if (grad != nullptr) {
    const bool ties = kDual && c_j != 0;
    if (ties) {
      gradient_sweep<T, PowQ::None, kDual>(z, grad, C, m, log_denom, alpha_scaled, T(0), q, T(0), z_j, scale * c_j);
    } else if (beta != 0) {
      gradient_sweep<T, kPow, false>(z, grad, C, m, log_denom, alpha_scaled, scale * beta, q, tau, z_j, T(0));
    } else {
      gradient_sweep<T, PowQ::None, false>(z, grad, C, m, log_denom, alpha_scaled, T(0), q, T(0), z_j, T(0));
    }
    grad[y] = g_y_scaled;
  }
  if (defer_ce) return {u, ce_offset, ce_log1p_arg};
  return {T(1), u * ce, T(0)};
}

#include "cpu/soft_target_rows.h"

// return_stats (the op's contract in ../uncertainty_weighted_ce.h), row by row in a chunk of the row loop: the row's
// top label (row_top_label), taken before the row's loss pass where that pass overwrites the row (in place, or a
// widened scratch row), after it otherwise (the row is then in the cache); the normaliser that pass leaves; then the
// confidence max_k p_k = exp(max - ref) / denom (1 / denom where the pass referenced its exponentials to the max), NaN
// for a row without a finite max, and ignored rows' NaN / -1, as calibkernels.loss_stats.top_label_stats. Each step
// is a no-op without return_stats (null outputs).
template <typename T>
class RowStatsWriter {
 public:
  RowStatsWriter(float* confidence, int64_t* prediction) : confidence_(confidence), prediction_(prediction) {}
  // where the row's loss pass leaves its normaliser (null: not asked for)
  RowNormaliser<T>* normaliser() { return confidence_ != nullptr ? &normaliser_ : nullptr; }
  void take_top_label(const T* row, int64_t C) {
    if (confidence_ != nullptr) top_ = row_top_label(row, C);
  }
  void write(int64_t i) const {
    if (confidence_ == nullptr) return;
    // exp(0) = 1 needs no exponential: the pass referenced to the max, or to a target that holds it
    const T top_over_ref = top_.max == normaliser_.ref ? T(1) : std::exp(top_.max - normaliser_.ref);
    confidence_[i] = std::isfinite(top_.max) ? static_cast<float>(top_over_ref / normaliser_.denom)
                                             : std::numeric_limits<float>::quiet_NaN();
    prediction_[i] = top_.index;
  }
  void write_ignored(int64_t i) const {
    if (confidence_ == nullptr) return;
    confidence_[i] = std::numeric_limits<float>::quiet_NaN();
    prediction_[i] = -1;
  }

 private:
  float* confidence_;
  int64_t* prediction_;
  TopLabel<T> top_{};
  RowNormaliser<T> normaliser_{};
};

template <typename T>
std::optional<at::Tensor> per_sample(const std::optional<at::Tensor>& t) {
  if (!t.has_value()) return std::nullopt;
  return t->detach().to(c10::CppTypeToScalarType<T>::value).contiguous();
}

// Σ_i loss_i in double, in a fixed order (deterministic whatever the thread count), with four accumulators and out of
// line: one accumulator is a chain of dependent adds, and inside launch the compiler kept it on the stack, a store
// and a reload on the chain for every row (docs/performance.md).
template <typename T>
__attribute__((noinline)) double total_of_row_losses(const T* loss, int64_t n) {
  double a = 0, b = 0, c = 0, d = 0;
  int64_t i = 0;
  for (; i + 4 <= n; i += 4) {
    a += static_cast<double>(loss[i]);
    b += static_cast<double>(loss[i + 1]);
    c += static_cast<double>(loss[i + 2]);
    d += static_cast<double>(loss[i + 3]);
  }
  for (; i < n; ++i) a += static_cast<double>(loss[i]);
  return (a + b) + (c + d);
}

#include "cpu/option_rows.h"
#include "cpu/hard_rows.h"

// The rows of a call with soft targets (soft_target_rows.h); writes each row's loss to loss_ptr.
template <typename scalar_t, typename acc_t>
void launch_soft_rows(const at::Tensor& z, scalar_t* grad_ptr, int64_t grad_stride, const int64_t* t_ptr,
                      const acc_t* weight_ptr, const acc_t* gamma_ptr, const RowSpec<acc_t>& spec,
                      const KernelArgs& args, acc_t scale, acc_t* loss_ptr, bool avx512) {
  constexpr bool kWiden = !std::is_same_v<scalar_t, acc_t>;
  const int64_t n = z.size(0), c = z.size(1), z_stride = z.stride(0);
  const SoftTargetArgs& st = args.soft;
  const scalar_t* z_ptr = z.const_data_ptr<scalar_t>();
  const acc_t* dense_ptr = st.dense != nullptr ? st.dense->template const_data_ptr<acc_t>() : nullptr;
  const acc_t a = static_cast<acc_t>(st.smoothing);
  const acc_t keep = acc_t(1) - a, uniform = a / static_cast<acc_t>(c);
  std::vector<RowLoss<acc_t>> row_parts(n);
  // compact targets with the weights whose gradient sweep needs only p_k take the hard path's sweeps
  const bool compact = dense_ptr == nullptr && (spec.weight != Weight::Brier || args.norm == 2.0);
  const bool square = spec.weight == Weight::Brier;
  // streaming stores as for hard rows (use_streaming_stores): float rows out of place, on the AVX-512 sweeps
  const bool stream = (compact || dense_ptr != nullptr) && !kWiden && std::is_same_v<acc_t, float> &&
                      CALIBKERNELS_HAVE_AVX512_SWEEPS && avx512 && grad_ptr != nullptr &&
                      static_cast<const void*>(grad_ptr) != static_cast<const void*>(z_ptr) &&
                      use_streaming_stores(n, c, static_cast<int64_t>(sizeof(scalar_t)));
  // The row loop, instantiated once per row form (`row_fn`) so that the form is chosen once per call, and with the
  // per-call values copied into locals of the chunk: read through the closure's references they were reloaded for
  // every row (a row's stores may alias them), a cost that counts at small C.
  auto run_rows = [&](auto row_fn) {
    at::parallel_for(0, n, row_grain(c), [&, row_fn](int64_t begin, int64_t end) {
      const FlushDenormalResults flush_denormals;
      const int64_t classes = c, ignore_index = args.ignore_index, lambda_stride = st.lambda_stride;
      const int64_t zs = z_stride, gs = grad_stride;
      const int64_t* const targets = t_ptr;
      const int64_t* const mix = st.mix;
      const float* const lambda_float = st.lambda_float;
      const double* const lambda_double = st.lambda_double;
      const acc_t* const dense_rows = dense_ptr;
      const acc_t* const gammas = gamma_ptr;
      const acc_t* const weights = weight_ptr;
      const acc_t row_keep = keep, row_uniform = uniform, default_gamma = spec.gamma;
      const scalar_t* const logits = z_ptr;
      scalar_t* const grads = grad_ptr;
      std::vector<acc_t> scratch(kWiden ? classes : 0);
      // the exponentials' scratch row, 64-byte aligned for the AVX-512 sweeps
      std::vector<acc_t> exp_storage(classes + 64 / sizeof(acc_t));
      const auto misalign = reinterpret_cast<uintptr_t>(exp_storage.data()) % 64;
      acc_t* const exps = exp_storage.data() + (misalign == 0 ? 0 : (64 - misalign) / sizeof(acc_t));
      RowLoss<acc_t>* const parts = row_parts.data();
      RowStatsWriter<acc_t> stats(args.confidence, args.prediction);
      for (int64_t i = begin; i < end; ++i) {
        scalar_t* const grad_row = grads ? grads + i * gs : nullptr;
        soft::RowTarget<acc_t> tg{nullptr, row_keep, row_uniform, acc_t(0), acc_t(0), 0, 0};
        if (dense_rows != nullptr) {
          tg.dense = dense_rows + i * classes;
          tg.invalid = st.dense_invalid;
          tg.flag_tolerance = static_cast<acc_t>(st.dense_flag_tolerance);
        } else {
          const int64_t y = targets[i];
          if (y == ignore_index) {
            parts[i] = {acc_t(1), acc_t(0), acc_t(0)};
            if (grad_row) std::fill(grad_row, grad_row + classes, scalar_t(0));
            stats.write_ignored(i);
            continue;
          }
          const acc_t lam = lambda_float != nullptr    ? static_cast<acc_t>(lambda_float[i * lambda_stride])
                            : lambda_double != nullptr ? static_cast<acc_t>(lambda_double[i * lambda_stride])
                                                       : acc_t(1);
          tg.y = y;
          tg.m = mix != nullptr ? mix[i] : y;
          tg.w_y = row_keep * lam;
          tg.w_m = row_keep * (acc_t(1) - lam);
        }
        const acc_t gamma = gammas ? gammas[i] : default_gamma;
        const acc_t ext = weights ? weights[i] : acc_t(1);
        const scalar_t* const z_row = logits + i * zs;
        if constexpr (kWiden) {
          at::vec::convert(z_row, scratch.data(), classes);
          stats.take_top_label(scratch.data(), classes);
          parts[i] =
              row_fn(scratch.data(), grad_row ? scratch.data() : nullptr, tg, gamma, ext, exps, 0, stats.normaliser());
          if (grad_row) at::vec::convert(scratch.data(), grad_row, classes);
        } else {
          // the top label before the row pass when it overwrites the row (in place), else after it, from the cache
          const bool in_place = static_cast<const void*>(grad_row) == static_cast<const void*>(z_row);
          if (in_place) stats.take_top_label(z_row, classes);
          parts[i] = row_fn(z_row, grad_row, tg, gamma, ext, exps, kPrefetchBytes / static_cast<int64_t>(sizeof(acc_t)),
                            stats.normaliser());
          if (!in_place) stats.take_top_label(z_row, classes);
        }
        stats.write(i);
      }
#if CALIBKERNELS_HAVE_AVX512_SWEEPS
      if (stream) avx512::stream_fence();  // make the streamed rows visible before the op returns
#endif
      finish_row_losses(parts, loss_ptr, begin, end);
    });
  };
  const RowSpec<acc_t> row_spec = spec;
  const int64_t classes = c;
  const acc_t row_scale = scale;
  if (!compact) {
    auto general = [&](auto avx512_tag) {
      run_rows([row_spec, classes, row_scale, stream](
                   const acc_t* z_row, acc_t* grad_row, const soft::RowTarget<acc_t>& tg, acc_t gamma, acc_t ext,
                   acc_t* exps, int64_t, RowNormaliser<acc_t>* normaliser) -> RowLoss<acc_t> {
        return soft::general_soft_row<acc_t, decltype(avx512_tag)::value>(z_row, grad_row, classes, tg, row_spec, gamma,
                                                                          ext, row_scale, exps, stream, normaliser);
      });
    };
    if (CALIBKERNELS_HAVE_AVX512_SWEEPS && avx512) {
      general(std::true_type{});
    } else {
      general(std::false_type{});
    }
    return;
  }
  auto go_with = [&](auto family_tag, auto loss_tag, auto avx512_tag) {
    run_rows([row_spec, classes, row_scale, stream](
                 const acc_t* z_row, acc_t* grad_row, const soft::RowTarget<acc_t>& tg, acc_t gamma, acc_t ext,
                 acc_t* exps, int64_t ahead, RowNormaliser<acc_t>* normaliser) -> RowLoss<acc_t> {
      return soft::compact_soft_row<acc_t, decltype(family_tag)::value, decltype(loss_tag)::value,
                                    decltype(avx512_tag)::value>(z_row, grad_row, classes, tg, row_spec, gamma, ext,
                                                                 row_scale, exps, ahead, stream, normaliser);
    });
  };
  auto go = [&](auto family_tag, auto avx512_tag) {
    if (spec.mode == Mode::Loss) {
      go_with(family_tag, std::true_type{}, avx512_tag);
    } else {
      go_with(family_tag, std::false_type{}, avx512_tag);
    }
  };
  auto with_family = [&](auto avx512_tag) {
    using soft::SoftFamily;
    if (square) {
      go(std::integral_constant<SoftFamily, SoftFamily::Square>{}, avx512_tag);
    } else if (spec.weight == Weight::Focal || spec.weight == Weight::Flsd) {
      go(std::integral_constant<SoftFamily, SoftFamily::Focal>{}, avx512_tag);
    } else {
      go(std::integral_constant<SoftFamily, SoftFamily::Plain>{}, avx512_tag);
    }
  };
  if (CALIBKERNELS_HAVE_AVX512_SWEEPS && avx512) {
    with_family(std::true_type{});
  } else {
    with_family(std::false_type{});
  }
}

// Runs the kernel over all rows of `z` (stride(1) == 1). Writes the gradient rows to `grad_ptr` (row stride
// `grad_stride`, may alias z) when non-null; returns the loss tensor (float32, or float64 for float64 logits).
template <typename scalar_t>
at::Tensor launch(const at::Tensor& z, scalar_t* grad_ptr, int64_t grad_stride, const at::Tensor& target,
                  const std::optional<at::Tensor>& sample_weight, const std::optional<at::Tensor>& gamma_per_sample,
                  const KernelArgs& args, bool avx512) {
  using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
  const int64_t n = z.size(0), c = z.size(1), z_stride = z.stride(0);
  const int64_t valid = args.valid_rows;
  const auto loss_dtype = c10::CppTypeToScalarType<acc_t>::value;
  at::Tensor row_loss = at::empty({n}, z.options().dtype(loss_dtype));

  const auto weights = per_sample<acc_t>(sample_weight);
  const auto gammas = per_sample<acc_t>(gamma_per_sample);
  const acc_t* weight_ptr = weights ? weights->template const_data_ptr<acc_t>() : nullptr;
  const acc_t* gamma_ptr = gammas ? gammas->template const_data_ptr<acc_t>() : nullptr;
  const int64_t* t_ptr = target.scalar_type() == at::kLong ? target.const_data_ptr<int64_t>() : nullptr;
  acc_t* loss_ptr = row_loss.mutable_data_ptr<acc_t>();
  const RowSpec<acc_t> spec{weight_formula(args.weight), args.mode, static_cast<acc_t>(args.gamma),
                            static_cast<acc_t>(args.norm), uses_flsd_schedule(args.weight)};

  // Class-index rows take the hard rows with every option (hard_rows.h); soft targets with options the option rows.
  const OptionArgs& opt = args.options;
  const bool hard_options = opt.active && !args.soft.active;
  if (opt.active && !hard_options) {
    return launch_option_rows<scalar_t, acc_t>(z, grad_ptr, grad_stride, t_ptr, weight_ptr, gamma_ptr, spec, args,
                                               row_loss);
  }
  const acc_t* const class_weight = static_cast<const acc_t*>(opt.class_weight);
  const double divisor = hard_options ? option_mean_divisor(args, t_ptr, class_weight, n) : static_cast<double>(valid);
  const bool mean = args.reduction == Reduction::Mean;
  const acc_t scale = !mean          ? acc_t(1)
                      : hard_options ? (divisor > 0 ? static_cast<acc_t>(1.0 / divisor) : acc_t(0))
                                     : acc_t(1) / acc_t(std::max<int64_t>(valid, 1));
  if (args.soft.active) {
    launch_soft_rows<scalar_t, acc_t>(z, grad_ptr, grad_stride, t_ptr, weight_ptr, gamma_ptr, spec, args, scale,
                                      loss_ptr, avx512);
  } else {
    const acc_t s = static_cast<acc_t>(opt.lse_square_scale);
    const acc_t z_grad_scale =
        mean ? static_cast<acc_t>(2.0 * opt.lse_square_scale / static_cast<double>(std::max<int64_t>(valid, 1)))
             : acc_t(2) * s;
    const HardRowCall<scalar_t, acc_t> call{z.const_data_ptr<scalar_t>(),
                                            grad_ptr,
                                            c,
                                            z_stride,
                                            grad_stride,
                                            args.ignore_index,
                                            t_ptr,
                                            gamma_ptr,
                                            weight_ptr,
                                            spec,
                                            args.norm,
                                            scale,
                                            class_weight,
                                            s,
                                            z_grad_scale,
                                            static_cast<acc_t*>(opt.z_loss),
                                            static_cast<acc_t>(opt.softcap),
                                            false,
                                            nullptr,
                                            args.confidence,
                                            args.prediction};
    const HardOptions options = !hard_options      ? HardOptions::None
                                : opt.softcap != 0 ? HardOptions::Capped
                                                   : HardOptions::Uncapped;
    launch_hard_rows<scalar_t, acc_t>(call, n, options, loss_ptr, avx512);
  }
  if (hard_options) {
    return option_loss<acc_t>(args, loss_ptr, static_cast<const acc_t*>(opt.z_loss), divisor, row_loss);
  }

  if (args.reduction == Reduction::None) return row_loss;
  double total = total_of_row_losses(loss_ptr, n);
  if (mean) total = valid > 0 ? total / static_cast<double>(valid) : 0.0;
  return at::scalar_tensor(total, z.options().dtype(loss_dtype));
}

}  // namespace

at::Tensor run_kernel(const at::Tensor& z, void* grad_ptr, int64_t grad_stride, const at::Tensor& target,
                      const std::optional<at::Tensor>& sample_weight, const std::optional<at::Tensor>& gamma_per_sample,
                      const KernelArgs& args, bool avx512) {
  // the dtype was checked by the caller (no AT_DISPATCH: its error message would be one more c10 template emitted
  // out of line in this translation unit, see kernel_avx2.cpp)
  auto run = [&](auto tag) {
    using scalar_t = decltype(tag);
    return launch<scalar_t>(z, static_cast<scalar_t*>(grad_ptr), grad_stride, target, sample_weight, gamma_per_sample,
                            args, avx512);
  };
  switch (z.scalar_type()) {
    case at::kDouble:
      return run(double{});
    case at::kHalf:
      return run(at::Half{});
    case at::kBFloat16:
      return run(at::BFloat16{});
    default:
      return run(float{});
  }
}

bool dense_target_may_fail(const at::Tensor& dense, double tolerance) {
  std::atomic<bool> flagged{false};
  auto run = [&](const auto* data) {
    using T = std::remove_const_t<std::remove_pointer_t<decltype(data)>>;
    const int64_t n = dense.size(0), c = dense.size(1);
    at::parallel_for(0, n, row_grain(c), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end && !flagged.load(std::memory_order_relaxed); ++i) {
        if (soft::dense_row_may_fail(data + i * c, c, static_cast<T>(tolerance))) {
          flagged.store(true, std::memory_order_relaxed);
        }
      }
    });
  };
  if (dense.scalar_type() == at::kDouble) {
    run(dense.const_data_ptr<double>());
  } else {
    run(dense.const_data_ptr<float>());
  }
  return flagged.load();
}

}  // namespace CALIBKERNELS_ISA
}  // namespace calibkernels
