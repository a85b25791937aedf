// Shared contract of the fused uncertainty-weighted cross-entropy op (formulas: docs/losses.md).
//
// The schema is declared once, in csrc/calibkernels.cpp (TORCH_LIBRARY); each device registers its kernel with
// TORCH_LIBRARY_IMPL in csrc/<device>/uncertainty_weighted_ce.*. The integer codes are declared once, in
// calibkernels/_kernel_codes.py; tests/test_kernel_codes.py checks the enums below against it.
//
//   calibkernels::uncertainty_weighted_ce(
//       Tensor logits (N, C) float32/float16/bfloat16 (float64 for gradcheck), any strides,
//       Tensor target (N,) int64, values in [0, C) or ignore_index,
//       Tensor? sample_weight (N,) float (weight == External; used detached),
//       Tensor? gamma_per_sample (N,) float (weight == Focal only; overrides gamma; never differentiated),
//       int weight, int loss_mode, float gamma, float norm, int ignore_index, int reduction, bool compute_grad,
//       Tensor(a!)? grad_out (N, C) in the logits' dtype, any strides; may be the logits themselves (in place),
//       Tensor? mix_target=None (N,) int64: a mixup/cutmix partner class per row (valid on non-ignored rows),
//       Tensor? mix_lambda=None () or (N,) float, in [0, 1]: t = λ e_target + (1 - λ) e_mix_target (with mix_target),
//       float label_smoothing=0.0 in [0, 1]: t <- (1 - a) t + a / C),
//       bool loss_in_logits_dtype=False,
//       bool return_stats=False,
//       Tensor? class_weight=None (C,) float on the logits' device: F.cross_entropy's per-class weights,
//       float lse_square_scale=0.0 >= 0: the z-loss s · logsumexp(z_i)^2 added to each non-ignored row,
//       float softcap=0.0 >= 0: the logits become c · tanh(z / c) first where c = softcap > 0)
//     -> (Tensor loss, Tensor grad, Tensor target_flag, Tensor confidence, Tensor prediction, Tensor z_loss)
//
//   The options (docs/losses.md, "Coming from F.cross_entropy / Liger-Kernel"): with t' = w ⊙ t (w = class_weight,
//   t the row's target distribution) and z' the capped logits, L_i = u_i · CE_i^w + s · lse_i², CE_i^w = -Σ_k t'_k
//   log p_k, u_i from the unweighted t; "mean" divides the first part by Σ_i <w, t̄_i> over non-ignored rows (t̄ the
//   target before smoothing; N for a dense target) and the z-loss by the non-ignored rows. The gradient goes through
//   the cap: dL/dz_k = dL/dz'_k (1 - (z'_k / c)²).
//   z_loss: the rows' s · lse_i² ((N,), 0 on ignored rows; float32, float64 for float64 logits) where
//         lse_square_scale != 0, else an empty (0,) tensor.
//
//   Soft targets (csrc/uncertainty_weights.h): the compact form above, or a dense target: a floating (N, C) `target`
//   of probabilities per row (any float dtype; no ignored rows, the mean divides by N; no mix_target). Not with the
//   dual-focal weight.
//
//   loss: float32 (float64 for float64 logits), or the logits' dtype with loss_in_logits_dtype (accumulated in
//         float32 all the same, and rounded once); 0-dim for reduction mean/sum (mean over non-ignored rows, 0 if
//         none), (N,) for none.
//   the gradient of `loss` w.r.t. logits for grad_output = 1 (already divided by the number of non-ignored rows for
//         mean), in the logits' dtype; ignored rows are 0. It is written into grad_out when given (then `grad` is an
//         empty (0,) tensor), else returned as `grad`, contiguous (N, C). Neither when compute_grad is false
//         (inference: no N x C write; `grad` is (0,)).
//   target_flag: int64 on the logits' device. On CUDA, (2,): for class indices (TargetFlag, the first bad of: a
//         target neither a class index nor ignore_index, with the largest such value; a mix_target not a class index
//         on a row whose target is not ignore_index, with the first such row's value; a mix_lambda outside [0, 1] or
//         NaN, with its first row), or (TargetFlag::None, any value); for a dense target (any bad row, the first bad
//         row): an entry < 0 or NaN, or a row sum off 1 by more than dense_row_sum_tolerance. The kernel never
//         indexes with a bad target or mix_target, and a row with a bad target, mix_target or mix_lambda is NaN; the
//         caller reads the flag when it can do so without stalling the host (calibkernels/_target_checks.py). On
//         the CPU, (0,): the kernel raises ValueError instead.
#pragma once

#include <ATen/core/Tensor.h>
#include <ATen/MemoryOverlap.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>

#include <cmath>
#include <cstdint>
#include <optional>
#include <tuple>
#include <utility>

namespace calibkernels {

enum class Weight : int64_t { None = 0, Focal = 1, Flsd = 2, DualFocal = 3, Brier = 4, External = 5, BrierFlsd = 6 };

// The weights whose γ is FLSD-53's band schedule (γ_i from the band of p_y, or of <t, p> for soft targets): the focal
// weight's (Flsd) and the Brier weight's (BrierFlsd, the BSCE-GRA code's BSCELossAdaptiveGra).
constexpr bool uses_flsd_schedule(Weight w) { return w == Weight::Flsd || w == Weight::BrierFlsd; }
// The weight's formula with the schedule set aside: BrierFlsd is a Brier weight, Flsd a focal one.
constexpr Weight weight_formula(Weight w) {
  return w == Weight::BrierFlsd ? Weight::Brier : (w == Weight::Flsd ? Weight::Focal : w);
}
enum class Mode : int64_t { Loss = 0, Grad = 1 };
// Same numbering as at::Reduction.
enum class Reduction : int64_t { None = 0, Mean = 1, Sum = 2 };
// The first slot of a class-index target flag (above): what the kernel found bad, in the host checks' order.
enum class TargetFlag : int64_t { None = 0, Target = 1, MixTarget = 2, MixLambda = 3 };

// Vector instruction set of the CPU kernel's hot loops in this process: "avx512" (float sweeps of the
// one-exponential path; the CPU has AVX-512 and ATen uses it), "avx2" or "default". Exposed as calibkernels._C.CPU_ISA.
const char* cpu_vector_isa();

// Frees the CPU op's kept gradient buffers (csrc/cpu/gradient_buffer_cache.h); returns the bytes freed.
int64_t release_cpu_gradient_cache();

#ifdef CALIBKERNELS_WITH_CUDA
// Whether this build's CUDA kernels can run on CUDA device `device` (the op calibkernels::cuda_kernels_probe; in
// csrc/cuda/uncertainty_weighted_ce.cu): the CUDA status of querying one of its kernels there and the status's
// name; cudaErrorNoKernelImageForDevice (or another image error) on a GPU the build compiled no code for.
std::pair<int, const char*> cuda_kernels_probe(int device);
#endif

// The op's arguments, in the schema's order (csrc/calibkernels.cpp declares the schema): the device kernels and the
// autograd kernel take them as this one struct.
struct LossArguments {
  at::Tensor logits;
  at::Tensor target;
  std::optional<at::Tensor> sample_weight;
  std::optional<at::Tensor> gamma_per_sample;
  int64_t weight;
  int64_t mode;
  double gamma;
  double norm;
  int64_t ignore_index;
  int64_t reduction;
  bool compute_grad;
  std::optional<at::Tensor> grad_out;
  std::optional<at::Tensor> mix_target;
  std::optional<at::Tensor> mix_lambda;
  double label_smoothing;
  bool loss_in_logits_dtype;
  bool return_stats;
  std::optional<at::Tensor> class_weight;
  double lse_square_scale;
  double softcap;

  // Whether the call asks for any of the drop-in options (class weights, z-loss, soft-capping).
  bool has_options() const { return class_weight.has_value() || lse_square_scale != 0.0 || softcap != 0.0; }
};

// (loss, grad, target_flag, confidence, prediction, z_loss): see the contract above.
using LossOutputs = std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor>;

// A kernel of the op as the dispatcher calls it: the schema's positional arguments, gathered into LossArguments for
// `Kernel` (registered as m.impl("uncertainty_weighted_ce", &dispatcher_entry<the kernel>)).
template <LossOutputs (*Kernel)(const LossArguments&)>
LossOutputs dispatcher_entry(const at::Tensor& logits, const at::Tensor& target,
                             const std::optional<at::Tensor>& sample_weight,
                             const std::optional<at::Tensor>& gamma_per_sample, int64_t weight, int64_t mode,
                             double gamma, double norm, int64_t ignore_index, int64_t reduction, bool compute_grad,
                             const std::optional<at::Tensor>& grad_out, const std::optional<at::Tensor>& mix_target,
                             const std::optional<at::Tensor>& mix_lambda, double label_smoothing,
                             bool loss_in_logits_dtype, bool return_stats,
                             const std::optional<at::Tensor>& class_weight, double lse_square_scale, double softcap) {
  return Kernel(LossArguments{logits,
                              target,
                              sample_weight,
                              gamma_per_sample,
                              weight,
                              mode,
                              gamma,
                              norm,
                              ignore_index,
                              reduction,
                              compute_grad,
                              grad_out,
                              mix_target,
                              mix_lambda,
                              label_smoothing,
                              loss_in_logits_dtype,
                              return_stats,
                              class_weight,
                              lse_square_scale,
                              softcap});
}

// The GPU kernels check a dense target's rows in their own float32 reads up to this many columns (calibkernels/
// _kernel_codes.py DENSE_KERNEL_CHECK_MAX_CLASSES); wider rows are checked by device reductions with pairwise sums.
constexpr int64_t kDenseKernelCheckMaxClasses = 262144;

// FLSD-53 schedule (Mukhoti et al. 2020): gamma_i = 5 if p_y < 0.2, 3 if p_y < 0.5, else `gamma`.
constexpr double kFlsdLowThreshold = 0.2;
constexpr double kFlsdLowGamma = 5.0;
constexpr double kFlsdMidThreshold = 0.5;
constexpr double kFlsdMidGamma = 3.0;

// How far a dense target's row may sum from 1 in its dtype: calibkernels._target_checks.DENSE_ROW_SUM_TOLERANCE (tests
// hold the two to the same boundaries).
inline double dense_row_sum_tolerance(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return 1e-6;
    case at::kFloat:
      return 1e-4;
    case at::kHalf:
      return 1e-2;
    case at::kBFloat16:
      return 2e-2;
    default:
      return 1e-4;
  }
}

// A dense target's row sums as its value check takes them (calibkernels._validation.dense_row_sums): float64 sums of
// a float64 target, float32 sums otherwise (a 16-bit sum is not rounded back to its dtype), returned in float64.
inline at::Tensor dense_row_sums(const at::Tensor& target) {
  return target.sum(1, false, target.scalar_type() == at::kDouble ? at::kDouble : at::kFloat).to(at::kDouble);
}

// The argument checks every device's kernel makes after checking the devices of `logits` and `target` (the kernels
// are the last line of defence: under torch.compile the Python-side checks are skipped). `op` prefixes the messages.
inline void check_arguments(const char* op, const at::Tensor& logits, const at::Tensor& target,
                            const std::optional<at::Tensor>& sample_weight,
                            const std::optional<at::Tensor>& gamma_per_sample, int64_t weight, int64_t mode,
                            double gamma, double norm, int64_t reduction) {
  TORCH_CHECK(logits.dim() == 2, op, "logits must be 2-D (N, C), got ", logits.dim(), " dims");
  const auto dtype = logits.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kDouble || dtype == at::kHalf || dtype == at::kBFloat16, op,
              "logits must be float32, float64, float16 or bfloat16, got ", dtype);
  TORCH_CHECK(logits.size(1) >= 1, op, "logits have zero classes");
  if (target.is_floating_point()) {
    TORCH_CHECK(target.sizes() == logits.sizes(), op, "a dense (probability) target must have the logits' shape ",
                logits.sizes(), ", got ", target.sizes());
  } else {
    TORCH_CHECK(target.dim() == 1 && target.size(0) == logits.size(0), op, "target must have shape (", logits.size(0),
                ",), got ", target.sizes());
    TORCH_CHECK(target.scalar_type() == at::kLong, op, "target must be int64 (or a floating dense target), got ",
                target.scalar_type());
  }
  TORCH_CHECK(weight >= 0 && weight <= 6, op, "unknown weight code ", weight);
  TORCH_CHECK(mode == 0 || mode == 1, op, "unknown mode code ", mode);
  TORCH_CHECK(reduction >= 0 && reduction <= 2, op, "unknown reduction code ", reduction);
  TORCH_CHECK(gamma >= 0, op, "gamma must be >= 0, got ", gamma);
  TORCH_CHECK(norm > 0, op, "norm must be > 0, got ", norm);
  for (const auto* opt : {&sample_weight, &gamma_per_sample}) {
    if (opt->has_value()) {
      const at::Tensor& t = opt->value();
      TORCH_CHECK(t.device() == logits.device() && t.is_floating_point() && t.dim() == 1 && t.size(0) == logits.size(0),
                  op, "per-sample tensors must be floating point tensors of shape (", logits.size(0), ",) on ",
                  logits.device(), ", got ", t.scalar_type(), " ", t.sizes(), " on ", t.device());
    }
  }
  const auto w = static_cast<Weight>(weight);
  TORCH_CHECK(sample_weight.has_value() == (w == Weight::External), op,
              "sample_weight is required by, and only allowed with, the external weight");
  TORCH_CHECK(!gamma_per_sample.has_value() || w == Weight::Focal, op,
              "a per-sample gamma is only supported with the focal weight");
}

// The soft-target arguments (after check_arguments): mix_target (N,) int64 with mix_lambda () or (N,) float on the
// logits' device, only with class-index targets; label_smoothing in [0, 1]; never with the dual-focal weight.
// Returns whether the row targets are soft.
inline bool check_soft_arguments(const char* op, const at::Tensor& logits, const at::Tensor& target,
                                 const std::optional<at::Tensor>& mix_target,
                                 const std::optional<at::Tensor>& mix_lambda, double label_smoothing, int64_t weight) {
  const bool dense = target.is_floating_point();
  TORCH_CHECK(mix_target.has_value() == mix_lambda.has_value(), op, "mix_target and mix_lambda go together");
  if (mix_target.has_value()) {
    TORCH_CHECK(!dense, op, "mix_target mixes class-index targets, not a dense target");
    const at::Tensor& m = *mix_target;
    TORCH_CHECK(
        m.device() == logits.device() && m.scalar_type() == at::kLong && m.dim() == 1 && m.size(0) == logits.size(0),
        op, "mix_target must be an int64 tensor of shape (", logits.size(0), ",) on ", logits.device(), ", got ",
        m.scalar_type(), " ", m.sizes(), " on ", m.device());
    const at::Tensor& l = *mix_lambda;
    TORCH_CHECK(l.device() == logits.device() && l.is_floating_point() &&
                    (l.dim() == 0 || (l.dim() == 1 && l.size(0) == logits.size(0))),
                op, "mix_lambda must be a floating tensor of shape () or (", logits.size(0), ",) on ", logits.device(),
                ", got ", l.scalar_type(), " ", l.sizes(), " on ", l.device());
  }
  TORCH_CHECK(label_smoothing >= 0.0 && label_smoothing <= 1.0, op, "label_smoothing must be in [0, 1], got ",
              label_smoothing);
  const bool soft = dense || mix_target.has_value() || label_smoothing != 0.0;
  TORCH_CHECK(!soft || static_cast<Weight>(weight) != Weight::DualFocal, op,
              "the dual-focal weight has no soft-target form");
  return soft;
}

// The drop-in options' arguments (after check_arguments): class_weight a floating (C,) tensor on the logits' device
// (its values are checked by the Python callers: reading them costs a GPU a host synchronisation); lse_square_scale
// and softcap finite and >= 0 (softcap 0: no cap); not with the dual-focal weight.
inline void check_options(const char* op, const LossArguments& a) {
  if (a.class_weight.has_value()) {
    const at::Tensor& w = *a.class_weight;
    TORCH_CHECK(
        w.device() == a.logits.device() && w.is_floating_point() && w.dim() == 1 && w.size(0) == a.logits.size(1), op,
        "class_weight must be a floating tensor of shape (", a.logits.size(1), ",) on ", a.logits.device(), ", got ",
        w.scalar_type(), " ", w.sizes(), " on ", w.device());
  }
  TORCH_CHECK(std::isfinite(a.lse_square_scale) && a.lse_square_scale >= 0.0, op,
              "lse_square_scale must be finite and >= 0, got ", a.lse_square_scale);
  TORCH_CHECK(std::isfinite(a.softcap) && a.softcap >= 0.0, op, "softcap must be finite and > 0 (0: no cap), got ",
              a.softcap);
  TORCH_CHECK(!a.has_options() || static_cast<Weight>(a.weight) != Weight::DualFocal, op,
              "the dual-focal weight takes no class weights, z-loss or soft-capping in the fused kernels");
}

// The z_loss output: (N,) for the kernel to write where lse_square_scale != 0, else an empty (0,) tensor.
inline at::Tensor z_loss_output(const LossArguments& a) {
  const auto dtype = a.logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  return at::empty({a.lse_square_scale != 0.0 ? a.logits.size(0) : 0}, a.logits.options().dtype(dtype));
}

// Checks a caller's gradient buffer (the op's grad_out argument). It may be the logits themselves (in place) but must
// not partially overlap them, nor have elements that share memory (an expanded tensor): rows written at once would
// overwrite each other, and in place overwrite logits another row has still to read.
inline void check_grad_out(const char* op, const at::Tensor& logits, const at::Tensor& grad_out) {
  TORCH_CHECK_VALUE(grad_out.sizes() == logits.sizes(), op, "grad_out must have the logits' shape ", logits.sizes(),
                    ", got ", grad_out.sizes());
  TORCH_CHECK_VALUE(grad_out.scalar_type() == logits.scalar_type() && grad_out.device() == logits.device(), op,
                    "grad_out must have the logits' dtype and device (", logits.scalar_type(), " on ", logits.device(),
                    "), got ", grad_out.scalar_type(), " on ", grad_out.device());
  const bool same_view =
      grad_out.is_same(logits) || (grad_out.data_ptr() == logits.data_ptr() && grad_out.strides() == logits.strides());
  TORCH_CHECK_VALUE(same_view || !grad_out.is_alias_of(logits) ||
                        at::get_overlap_status(grad_out, logits) == at::MemOverlapStatus::No,
                    op, "grad_out partially overlaps the logits; pass the logits themselves or a separate buffer");
  TORCH_CHECK_VALUE(at::has_internal_overlap(grad_out) != at::MemOverlap::Yes, op,
                    "grad_out has elements that share memory (e.g. an expanded tensor), so its rows would overwrite "
                    "each other; for the gradient in place, the logits must not share memory either (use "
                    "inplace=False, or clone() them)");
}

// Where a device kernel writes the gradient (the op's grad_out contract; `z` is the logits, or their contiguous copy
// when their columns are strided): nowhere (an empty tensor) without compute_grad; `fresh()`, a new (N, C) buffer,
// without grad_out; the caller's buffer when its columns are contiguous (the logits themselves in place); else a
// contiguous buffer whose contents finish_gradient copies into grad_out, which is the copy z itself when grad_out is
// the logits (that copy is ours to overwrite).
template <typename Fresh>
at::Tensor gradient_destination(const at::Tensor& logits, const at::Tensor& z, bool compute_grad,
                                const std::optional<at::Tensor>& grad_out, Fresh fresh) {
  if (!compute_grad) return at::empty({0}, z.options());
  if (!grad_out.has_value()) return fresh();
  if (grad_out->stride(1) == 1 || grad_out->size(1) == 1) return *grad_out;
  const bool z_is_a_copy = !z.is_same(logits);
  return (z_is_a_copy && grad_out->is_alias_of(logits)) ? z : at::empty({z.size(0), z.size(1)}, z.options());
}

// The top-label statistics' outputs (confidence float32, prediction int64) on the logits' device: (N,) each to be
// written by the kernel with return_stats, else empty (0,) tensors.
struct StatsOutputs {
  at::Tensor confidence, prediction;
};
inline StatsOutputs stats_outputs(const at::Tensor& logits, bool return_stats) {
  const int64_t rows = return_stats ? logits.size(0) : 0;
  return {at::empty({rows}, logits.options().dtype(at::kFloat)), at::empty({rows}, logits.options().dtype(at::kLong))};
}

// The op's outputs: (loss, the gradient buffer, flag, stats), or (loss, an empty tensor, flag, stats) once the
// gradient is in grad_out.
inline LossOutputs finish_gradient(const at::Tensor& loss, const at::Tensor& dest, bool compute_grad,
                                   const std::optional<at::Tensor>& grad_out, const at::Tensor& target_flag,
                                   const StatsOutputs& stats, const at::Tensor& z_loss) {
  if (!compute_grad || !grad_out.has_value()) {
    return {loss, dest, target_flag, stats.confidence, stats.prediction, z_loss};
  }
  if (!dest.is_same(*grad_out)) grad_out->copy_(dest);
  return {loss, at::empty({0}, dest.options()), target_flag, stats.confidence, stats.prediction, z_loss};
}

}  // namespace calibkernels
