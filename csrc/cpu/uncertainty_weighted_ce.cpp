// The CPU op calibkernels::uncertainty_weighted_ce (contract in ../uncertainty_weighted_ce.h; formulas:
// docs/losses.md): argument checks, the gradient's destination, and the choice, once per process, of the kernel
// build that runs the rows (uncertainty_weighted_ce_kernel.h):
//   "default"  kernel_default.cpp: the build's baseline (x86-64: SSE2), for any CPU;
//   "avx2"     kernel_avx2.cpp: AVX2 + FMA (x86-64-v3);
//   "avx512"   kernel_avx2.cpp with its AVX-512 sweeps of the one-exponential path (vec_exp.h).
// The best the CPU supports, lowered to what ATen itself uses (ATEN_CPU_CAPABILITY=avx2 or default turns the wider
// paths off, as for ATen's kernels) and to CALIBKERNELS_CPU_ISA=default|avx2|avx512 when set (how the tests run
// each path in a subprocess on one machine). This file is compiled for the baseline, so the extension loads on any
// x86-64 CPU.
#include <ATen/Version.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/util/Exception.h>
#include <torch/library.h>

#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

#include "uncertainty_weighted_ce.h"
#include "cpu/gradient_buffer_cache.h"
#include "cpu/kernel_entry.h"

namespace calibkernels {
namespace {

enum class CpuIsa { Default = 0, Avx2 = 1, Avx512 = 2 };

CpuIsa detect_isa() {
  CpuIsa best = CpuIsa::Default;
#if CALIBKERNELS_HAVE_AVX2_KERNEL
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c") &&
      __builtin_cpu_supports("bmi2") && __builtin_cpu_supports("popcnt")) {
    best = CpuIsa::Avx2;
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) best = CpuIsa::Avx512;
  }
#endif
  const std::string aten = at::get_cpu_capability();
  if (aten == "DEFAULT" && best > CpuIsa::Default) best = CpuIsa::Default;
  if (aten == "AVX2" && best > CpuIsa::Avx2) best = CpuIsa::Avx2;
  if (const char* flag = std::getenv("CALIBKERNELS_CPU_ISA"); flag != nullptr && flag[0] != '\0') {
    CpuIsa requested = best;
    if (std::strcmp(flag, "default") == 0) {
      requested = CpuIsa::Default;
    } else if (std::strcmp(flag, "avx2") == 0) {
      requested = CpuIsa::Avx2;
    } else if (std::strcmp(flag, "avx512") == 0) {
      requested = CpuIsa::Avx512;
    } else {
      TORCH_WARN("calibkernels: CALIBKERNELS_CPU_ISA=\"", flag, "\" is not one of default, avx2, avx512; ignored");
    }
    if (requested < best) best = requested;  // never a path the CPU (or ATen) does not run
  }
  return best;
}

CpuIsa selected_isa() {
  static const CpuIsa isa = detect_isa();
  return isa;
}

// Validates targets (the kernel is the last line of defence: under torch.compile the Python range check is
// skipped) and counts the non-ignored rows for the mean; raises the reference's ValueError, with the same text.
// With a mix, mix_target must be a class on every non-ignored row. `target` and `mix_target` are contiguous (the
// caller's copies: a strided target, e.g. y[::2], must be read as its own rows, not its storage's).
int64_t check_targets(const at::Tensor& target, int64_t num_classes, int64_t ignore_index,
                      const std::optional<at::Tensor>& mix_target) {
  if (target.is_floating_point()) return target.size(0);  // dense: every row counts
  const int64_t* t = target.const_data_ptr<int64_t>();
  const int64_t* m = mix_target.has_value() ? mix_target->const_data_ptr<int64_t>() : nullptr;
  const int64_t n = target.numel();
  // a first pass without branches (the compiler vectorises it): the count, and whether any row is out of range (an
  // unsigned compare catches negative values too); only a call that has a bad row takes the loop that names it.
  // Without a mix the target stands in for mix_target (checked twice, so that one loop serves both).
  const int64_t* const partner = m != nullptr ? m : t;
  const auto classes = static_cast<uint64_t>(num_classes);
  int64_t valid = 0;
  bool bad = false;
  for (int64_t i = 0; i < n; ++i) {
    const bool counted = t[i] != ignore_index;
    valid += counted;
    bad |= counted & ((static_cast<uint64_t>(t[i]) >= classes) | (static_cast<uint64_t>(partner[i]) >= classes));
  }
  if (!bad) return valid;
  for (int64_t i = 0; i < n; ++i) {
    if (t[i] == ignore_index) continue;
    TORCH_CHECK_VALUE(t[i] >= 0 && t[i] < num_classes, "target value ", t[i], " is out of range for ", num_classes,
                      " classes (valid: 0..", num_classes - 1, ", or ignore_index=", ignore_index, ")");
    if (m != nullptr) {
      TORCH_CHECK_VALUE(m[i] >= 0 && m[i] < num_classes, "mix_target value ", m[i], " is out of range for ",
                        num_classes, " classes (valid: 0..", num_classes - 1,
                        " on every row whose target is not ignore_index)",
                        m[i] == ignore_index ? " (it is ignore_index, but the row's target is not ignored)" : "");
    }
  }
  return valid;  // not reached: the loop raises for the row the first pass found
}

KernelArgs check_args(const at::Tensor& logits, const at::Tensor& target,
                      const std::optional<at::Tensor>& sample_weight, const std::optional<at::Tensor>& gamma_per_sample,
                      int64_t weight, int64_t mode, double gamma, double norm, int64_t ignore_index, int64_t reduction,
                      const std::optional<at::Tensor>& mix_target, const std::optional<at::Tensor>& mix_lambda,
                      double label_smoothing) {
  const char* op = "calibkernels::uncertainty_weighted_ce: ";
  TORCH_CHECK(logits.device().is_cpu() && target.device().is_cpu(), op, "expected CPU tensors");
  check_arguments(op, logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, reduction);
  const bool soft = check_soft_arguments(op, logits, target, mix_target, mix_lambda, label_smoothing, weight);
  KernelArgs args{static_cast<Weight>(weight),
                  static_cast<Mode>(mode),
                  gamma,
                  norm,
                  ignore_index,
                  static_cast<Reduction>(reduction),
                  check_targets(target, logits.size(1), ignore_index, mix_target)};
  args.soft.active = soft;
  args.soft.smoothing = label_smoothing;
  return args;
}

// The kernel's view of the soft-target tensors (kept alive by the caller).
struct SoftTargetTensors {
  at::Tensor dense, mix, lambda;
};

// The dtype's name as Python spells it in the error messages.
std::string python_dtype_name(at::ScalarType dtype) {
  switch (dtype) {
    case at::kDouble:
      return "torch.float64";
    case at::kFloat:
      return "torch.float32";
    case at::kHalf:
      return "torch.float16";
    case at::kBFloat16:
      return "torch.bfloat16";
    default:
      return std::string("torch.") + c10::toString(dtype);
  }
}

// The kernel checks a dense target's values in its exponential sweep, which reads T anyway (soft::flag_dense_target),
// with a margin: it flags a row whose sum is off 1 by more than a quarter of the tolerance, so that the rounding of its
// float sums can never pass a row the exact check refuses. Where float sums cannot promise that (a float64 target in a
// float32 kernel; rows past 2^18 columns) every call takes the exact check. A negative margin flags every row.
double dense_flag_tolerance(at::ScalarType target_dtype, at::ScalarType acc_dtype, int64_t num_classes) {
  if (target_dtype == at::kDouble && acc_dtype != at::kDouble) return -1;
  if (num_classes > (int64_t{1} << 18)) return -1;
  return dense_row_sum_tolerance(target_dtype) / 4;
}

// calibkernels._validation.check_dense_target's value check, with its reductions and its error messages; run when the
// kernel flagged a row.
void check_dense_target_values(const at::Tensor& target) {
  const at::Tensor row_sums = dense_row_sums(target);
  TORCH_CHECK_VALUE(target.amin().item<double>() >= 0 && row_sums.isfinite().all().item<bool>(),
                    "a dense target must be finite and >= 0 everywhere (a probability distribution per row)");
  const double tolerance = dense_row_sum_tolerance(target.scalar_type());
  const at::Tensor error = row_sums.sub(1.0).abs();
  if (error.max().item<double>() > tolerance) {
    const int64_t row = error.argmax().item<int64_t>();
    const double sum = target.select(0, row).to(at::kDouble).sum().item<double>();
    char text[64];
    std::snprintf(text, sizeof(text), "%.8g", sum);
    char tol[32];
    std::snprintf(tol, sizeof(tol), "%g", tolerance);
    TORCH_CHECK_VALUE(false, "every row of a dense target must sum to 1 (within ", tol, " for ",
                      python_dtype_name(target.scalar_type()), "); row ", row, " sums to ", text);
  }
}

SoftTargetTensors prepare_soft_targets(KernelArgs& args, const at::Tensor& z, const at::Tensor& target,
                                       const std::optional<at::Tensor>& mix_target,
                                       const std::optional<at::Tensor>& mix_lambda) {
  SoftTargetTensors held;
  if (!args.soft.active) return held;
  if (target.is_floating_point()) {
    const auto dtype = target.scalar_type();
    TORCH_CHECK_TYPE(dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kFloat || dtype == at::kDouble,
                     "a dense target must be float16, bfloat16, float32 or float64, got ", python_dtype_name(dtype));
    const auto acc = z.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
    held.dense = target.to(acc).contiguous();
    args.soft.dense = &held.dense;
    args.soft.dense_flag_tolerance = dense_flag_tolerance(target.scalar_type(), acc, z.size(1));
  }
  if (mix_target.has_value()) {
    held.mix = *mix_target;  // contiguous (the caller's copy)
    // λ is read where it lies when float32/float64, strided too (a per-row λ is often a strided view: a Beta sample
    // is a column of a Dirichlet's); a plain loop checks the range (a copy or a few ATen ops on N values would cost
    // a few percent of the whole op at classification shapes)
    const auto dtype = mix_lambda->scalar_type();
    held.lambda =
        dtype == at::kFloat || dtype == at::kDouble ? mix_lambda->detach() : mix_lambda->detach().to(at::kFloat);
    const int64_t count = held.lambda.numel();
    const int64_t stride = held.lambda.dim() == 0 ? 0 : held.lambda.stride(0);
    auto check_range = [&](const auto* lam) {
      bool in_range = true;  // without branches first (NaN fails both compares), then the loop that names the value
      for (int64_t i = 0; i < count; ++i) in_range &= (lam[i * stride] >= 0) & (lam[i * stride] <= 1);
      if (in_range) return;
      for (int64_t i = 0; i < count; ++i) {
        const auto value = lam[i * stride];
        TORCH_CHECK_VALUE(value >= 0 && value <= 1, "mix_lambda must be in [0, 1] everywhere (NaN is refused), got ",
                          value);
      }
    };
    if (held.lambda.scalar_type() == at::kDouble) {
      args.soft.lambda_double = held.lambda.const_data_ptr<double>();
      check_range(args.soft.lambda_double);
    } else {
      args.soft.lambda_float = held.lambda.const_data_ptr<float>();
      check_range(args.soft.lambda_float);
    }
    args.soft.mix = held.mix.const_data_ptr<int64_t>();
    args.soft.lambda_stride = stride;
  }
  return held;
}

LossOutputs uncertainty_weighted_ce_cpu(const LossArguments& a) {
  // the class-index tensors made contiguous once, for the target check and the kernel alike
  const at::Tensor t = a.target.contiguous();
  const std::optional<at::Tensor> mix =
      a.mix_target.has_value() ? std::optional<at::Tensor>(a.mix_target->contiguous()) : std::nullopt;
  KernelArgs args = check_args(a.logits, t, a.sample_weight, a.gamma_per_sample, a.weight, a.mode, a.gamma, a.norm,
                               a.ignore_index, a.reduction, mix, a.mix_lambda, a.label_smoothing);
  const char* op = "calibkernels::uncertainty_weighted_ce: ";
  check_options(op, a);
  if (a.compute_grad && a.grad_out.has_value()) check_grad_out(op, a.logits, *a.grad_out);
  // Rows may be strided; columns must be contiguous for the vector loads.
  const bool direct = a.logits.stride(1) == 1 || a.logits.size(1) == 1;
  const at::Tensor z = direct ? a.logits : a.logits.contiguous();
  const SoftTargetTensors soft_targets = prepare_soft_targets(args, z, t, mix, a.mix_lambda);
  const CpuIsa isa = selected_isa();
  std::atomic<bool> dense_invalid{false};
  args.soft.dense_invalid = &dense_invalid;
  if (soft_targets.dense.defined() && a.compute_grad && a.grad_out.has_value() && a.grad_out->is_alias_of(a.logits)) {
    // In place a bad dense target must raise before the kernel overwrites the logits: one flagging pass over the
    // target (the kernel's flag, with its margin), then the exact check only when it flags a row; the kernel need
    // not flag again.
    const double tolerance = args.soft.dense_flag_tolerance;
    const at::Tensor& dense = soft_targets.dense;
    if (tolerance < 0 || (isa == CpuIsa::Default ? isa_default::dense_target_may_fail(dense, tolerance)
                                                 : isa_avx2::dense_target_may_fail(dense, tolerance))) {
      check_dense_target_values(t);
    }
    args.soft.dense_invalid = nullptr;
  }
  // In place each row is read before it is overwritten. A fresh gradient comes from the reused buffers (no page
  // faults for a new N×C each step, see gradient_buffer_cache.h).
  const at::Tensor dest = gradient_destination(a.logits, z, a.compute_grad, a.grad_out, [&] {
    return GradientBufferCache::instance().empty({z.size(0), z.size(1)}, z.options());
  });
  // the top-label statistics are written by the row loop, each row's before its gradient overwrites it in place
  const StatsOutputs stats = stats_outputs(a.logits, a.return_stats);
  if (a.return_stats) {
    args.confidence = stats.confidence.mutable_data_ptr<float>();
    args.prediction = stats.prediction.mutable_data_ptr<int64_t>();
  }
  // the drop-in options: the class weights in the accumulation dtype, the rows' z-loss written by the kernel
  const at::Tensor z_loss = z_loss_output(a);
  at::Tensor class_weight;
  if (a.has_options()) {
    args.options.active = true;
    if (a.class_weight.has_value()) {
      class_weight = a.class_weight->detach().to(z_loss.scalar_type()).contiguous();
      args.options.class_weight = class_weight.const_data_ptr();
    }
    args.options.lse_square_scale = a.lse_square_scale;
    args.options.softcap = a.softcap;
    if (z_loss.numel() > 0) args.options.z_loss = z_loss.mutable_data_ptr();
  }
  void* grad_ptr = a.compute_grad ? dest.data_ptr() : nullptr;
  const int64_t grad_stride = a.compute_grad ? dest.stride(0) : 0;
  at::Tensor loss = isa == CpuIsa::Default ? isa_default::run_kernel(z, grad_ptr, grad_stride, t, a.sample_weight,
                                                                     a.gamma_per_sample, args, false)
                                           : isa_avx2::run_kernel(z, grad_ptr, grad_stride, t, a.sample_weight,
                                                                  a.gamma_per_sample, args, isa == CpuIsa::Avx512);
  if (dense_invalid.load()) check_dense_target_values(t);
  if (a.loss_in_logits_dtype && loss.scalar_type() != a.logits.scalar_type()) loss = loss.to(a.logits.scalar_type());
  // no flag: every bad target value has raised above
  return finish_gradient(loss, dest, a.compute_grad, a.grad_out, at::empty({0}, t.options().dtype(at::kLong)), stats,
                         z_loss);
}

}  // namespace

const char* cpu_vector_isa() {
  switch (selected_isa()) {
    case CpuIsa::Avx512:
      return "avx512";
    case CpuIsa::Avx2:
      return "avx2";
    default:
      return "default";
  }
}

int64_t release_cpu_gradient_cache() { return GradientBufferCache::instance().release(); }

}  // namespace calibkernels

TORCH_LIBRARY_IMPL(calibkernels, CPU, m) {
  m.impl("uncertainty_weighted_ce", &calibkernels::dispatcher_entry<calibkernels::uncertainty_weighted_ce_cpu>);
}
