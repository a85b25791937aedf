// The CUDA implementation of the op torch.ops.calibkernels.uncertainty_weighted_ce (schema in ../calibkernels.cpp,
// contract in ../uncertainty_weighted_ce.h): the argument checks, the targets' count and flag, the launch of the row
// kernels (row_kernels.cuh: the formulas and the launch shapes), the reduction and the backward's in-place scaling.
// Registered for the CUDA dispatch key. Calls with class weights, a z-loss or soft-capping run the option kernel
// (option_rows.cuh) whatever their target; the others never reach it.
//
// Target policy (the Triton kernel's, see calibkernels/_target_checks.py): a target (or, with a mix, a mix_target)
// outside [0, C) on a row that is not ignore_index is never used as an index; that row's loss and gradient are NaN
// (so a mean/sum becomes NaN), as are a row's with a λ outside [0, 1], and the target flag says which (TargetFlag),
// which the Python wrapper turns into a ValueError in eager mode.
// A dense target has no ignored rows.

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/arange.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/index_select.h>
#include <ATen/ops/stack.h>
#include <ATen/ops/where.h>
#include <ATen/ops/zeros.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>
#include <utility>

#include "batch_fold.cuh"
#include "block_reduce.cuh"
#include "row_params.h"
#include "uncertainty_weighted_ce.h"
#include "uncertainty_weights.h"

namespace calibkernels {
namespace {

using cuda_rows::BatchFold;
using cuda_rows::Params;
using cuda_rows::SoftParams;

// ----------------------------------------------------------------------------------------------------------------
// The count launch of a large batch (more than kInlineCountMaxRows rows of class indices, for a mean with a
// gradient): the mean's divisor, which the row launch's gradient scale and fold read, and the target flag, in one
// 1024-thread block. Smaller batches need no launch before the row launch (batch_fold.cuh: each of its blocks
// counts the targets itself, and its last block checks them).
// ----------------------------------------------------------------------------------------------------------------
constexpr int kReduceThreads = 1024;

// Every block re-reads all N targets (8 N bytes, from L2) where it counts them itself: up to this N that costs less
// than a launch of its own (the Triton kernel's INLINE_COUNT_MAX_ROWS).
constexpr int64_t kInlineCountMaxRows = 1024;

// counts = [the op's target flag (store_target_flag: a target neither a class index nor ignore_index, with a
// mix (`mix` not nullptr) a bad mix_target or λ too; calibkernels._validation.target_flag without its dozen small
// torch ops); the mean's divisor: the rows whose target is not ignore_index]. A: λ's type.
template <typename A>
__global__ void __launch_bounds__(kReduceThreads)
    check_targets_kernel(const int64_t* target, int64_t num_rows, int64_t num_classes, int64_t ignore_index,
                         const int64_t* mix, const A* lambda, int64_t lambda_stride, int64_t* counts) {
  const TargetScan scan = scan_targets<kReduceThreads>(target, num_rows, num_classes, ignore_index, true);
  MixScan mix_scan{num_rows, 0, num_rows};
  if (mix != nullptr) {
    mix_scan = scan_mix<kReduceThreads>(target, mix, lambda, lambda_stride, num_rows, num_classes, ignore_index);
  }
  if (threadIdx.x == 0) {
    store_target_flag(counts, scan, mix_scan, num_rows);
    counts[2] = scan.valid;
  }
}

// The row launch's ticket counter (batch_fold.cuh), zero between launches since the launch's last block resets it.
// One per device and stream, since the launches of a stream run one after another; allocated once and kept for the
// process's life (a leaked map: no CUDA call at exit). It comes from cudaMalloc, not torch's caching allocator: while
// a memory pool takes this thread's allocations (torch.compile's CUDA-graph warm-up, torch.cuda.use_mem_pool), a
// buffer from the allocator would land in that pool and outlive the call, which the CUDA-graph trees refuse. During
// CUDA-graph capture each launch takes a fresh zeroed counter instead, whose zeroing is captured with it, so a replay
// starts from zero whatever ran before it; `captured` holds it until the launch is enqueued.
unsigned int* launch_ticket(const at::Tensor& like, cudaStream_t stream, at::Tensor& captured) {
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  C10_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  if (capture != cudaStreamCaptureStatusNone) {
    captured = at::zeros({1}, like.options().dtype(at::kInt));
    return reinterpret_cast<unsigned int*>(captured.mutable_data_ptr<int32_t>());
  }
  static std::mutex mutex;
  static auto* tickets = new std::map<std::pair<int, cudaStream_t>, unsigned int*>();
  const std::lock_guard<std::mutex> lock(mutex);
  unsigned int*& ticket = (*tickets)[{like.get_device(), stream}];
  if (ticket == nullptr) {
    const c10::cuda::CUDAGuard guard(like.device());
    void* memory = nullptr;
    C10_CUDA_CHECK(cudaMalloc(&memory, sizeof(unsigned int)));
    C10_CUDA_CHECK(cudaMemsetAsync(memory, 0, sizeof(unsigned int), stream));  // ordered before the launch
    ticket = static_cast<unsigned int*>(memory);
  }
  return ticket;
}

// ----------------------------------------------------------------------------------------------------------------
// Host side
// ----------------------------------------------------------------------------------------------------------------
struct Args {
  int64_t weight, mode, reduction, ignore_index;
  double gamma, norm;
  bool soft = false;  // check_soft_arguments: the soft-target kernel
  double label_smoothing = 0.0;
  bool loss_in_logits_dtype = false;
  bool options = false;  // LossArguments::has_options: the option kernel
  double lse_square_scale = 0.0, softcap = 0.0;
};

// The option kernel's tensors (option_rows.cuh): the class weights in the accumulation type (undefined: none), a
// mean's divisors (undefined: a dense target's, or no mean) and the z_loss output (empty where s = 0).
struct OptionTensors {
  at::Tensor class_weight, divisors, z_loss;
};

// A mean's [D, count] of class indices in the accumulation type, by device ops (no host synchronisation): count the
// rows whose target is not ignore_index, D = Σ over them of <w, t̄_i> = w_y, or λ w_y + (1 - λ) w_m with a mix (the
// count without class weights). A target or mix_target that is not a class reads w_0 instead (its row is NaN).
at::Tensor option_divisors(const at::Tensor& target, const at::Tensor& class_weight, const at::Tensor& mixes,
                           const at::Tensor& lambdas, int64_t ignore_index, at::ScalarType acc_dtype) {
  const at::Tensor valid = target.ne(ignore_index);
  const at::Tensor count = valid.sum().to(acc_dtype);
  if (!class_weight.defined()) return at::stack({count, count});
  const int64_t num_classes = class_weight.size(0);
  const auto weight_of = [&](const at::Tensor& k) {
    const at::Tensor usable = valid.logical_and(k.ge(0)).logical_and(k.lt(num_classes));
    return class_weight.index_select(0, at::where(usable, k, 0));
  };
  at::Tensor per_row = weight_of(target);
  if (mixes.defined()) per_row = per_row.mul(lambdas).add_(weight_of(mixes).mul(lambdas.neg().add_(1.0)));
  return at::stack({at::where(valid, per_row, 0).sum(), count});
}

Args check_args(const at::Tensor& logits, const at::Tensor& target, const std::optional<at::Tensor>& sample_weight,
                const std::optional<at::Tensor>& gamma_per_sample, int64_t weight, int64_t mode, double gamma,
                double norm, int64_t ignore_index, int64_t reduction) {
  const char* op = "calibkernels::uncertainty_weighted_ce (CUDA): ";
  TORCH_CHECK(logits.is_cuda() && target.device() == logits.device(), op,
              "expected logits and target on the same CUDA device, got ", logits.device(), " and ", target.device());
  check_arguments(op, logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, reduction);
  return {weight, mode, reduction, ignore_index, gamma, norm};
}

// calibkernels._validation.dense_target_flag in ATen ops on the device (no host synchronisation): (any bad row, the
// first bad row) of a dense target, a row being bad where an entry is < 0 or NaN, or where its sum (float32, float64
// for a float64 target) is not within dense_row_sum_tolerance of 1.
// Other floating dtypes are checked in float32 (the tolerance of their dtype still applies). Only where the kernel
// does not check the target in its own reads (kernel_checks_dense_target): a float64 target of lower-precision
// logits, rows wider than kDenseKernelCheckMaxClasses, an empty batch.
at::Tensor dense_target_flag(const at::Tensor& target) {
  const int64_t n = target.size(0);
  if (n == 0) return at::zeros({2}, target.options().dtype(at::kLong));
  const auto dtype = target.scalar_type();
  const bool standard = dtype == at::kDouble || dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  const at::Tensor t = standard ? target : target.to(at::kFloat);
  const at::Tensor row_sums = dense_row_sums(t);
  const at::Tensor bad = t.amin(1).ge(0).logical_not().logical_or(
      row_sums.sub(1.0).abs().le(dense_row_sum_tolerance(dtype)).logical_not());
  const at::Tensor rows = at::arange(n, target.options().dtype(at::kLong));
  return at::stack({bad.any().to(at::kLong), at::where(bad, rows, n).min()});
}

// A dense target as the soft kernel reads it: float32 or the logits' dtype as given, any other floating dtype
// converted to the accumulation dtype; columns contiguous, any row stride.
at::Tensor dense_target_for(const at::Tensor& z, const at::Tensor& target) {
  const auto dtype = target.scalar_type();
  const bool native = dtype == z.scalar_type() || (dtype == at::kFloat && z.scalar_type() != at::kDouble);
  const at::Tensor t = native ? target : target.to(z.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
  return (t.stride(1) == 1 || t.size(1) == 1) ? t : t.contiguous();
}

// A mix's λ as the kernels read it: () or (N,), read at i * stride, in the accumulation type. A float64 λ beside
// lower-precision logits: a value just outside [0, 1] (1 + 1e-12) would round into it and pass the kernels' range
// check, which the host check and the Triton kernels (comparing λ in its own dtype) fail, so such values become NaN
// first (a few device ops, on that pairing only).
at::Tensor lambdas_for(const at::Tensor& mix_lambda, at::ScalarType acc_dtype) {
  const at::Tensor lam = mix_lambda.detach();
  return (lam.scalar_type() == at::kDouble && acc_dtype != at::kDouble)
             ? at::where(lam.ge(0).logical_and_(lam.le(1)), lam, std::numeric_limits<double>::quiet_NaN()).to(acc_dtype)
             : lam.to(acc_dtype);
}

// Whether the soft kernel checks a dense target's values itself: it sums each row in its accumulation type, which
// a float64 target's tolerance needs float64 logits for (dense_target_for reads it in float32 otherwise), and whose
// float32 rounding past kDenseKernelCheckMaxClasses columns nears float32's tolerance. An empty batch runs no kernel.
bool kernel_checks_dense_target(const at::Tensor& z, const at::Tensor& target) {
  if (z.size(0) == 0) return false;
  if (z.scalar_type() == at::kDouble) return true;
  return target.scalar_type() != at::kDouble && z.size(1) <= kDenseKernelCheckMaxClasses;
}

// Launches the option kernel (option_rows.cuh) over the soft kernel's parameters S with the options of `args`.
template <typename scalar_t, typename A>
void launch_with_options(const SoftParams<A>& S, const BatchFold& F, const OptionTensors& options, const Args& args,
                         at::ScalarType target_dtype) {
  cuda_rows::OptionParams<A> O;
  O.soft = S;
  O.class_weight = options.class_weight.defined() ? options.class_weight.const_data_ptr<A>() : nullptr;
  O.divisors = options.divisors.defined() ? options.divisors.const_data_ptr<A>() : nullptr;
  O.z_loss = options.z_loss.numel() > 0 ? options.z_loss.mutable_data_ptr<A>() : nullptr;
  O.lse_square_scale = static_cast<A>(args.lse_square_scale);
  O.softcap = static_cast<A>(args.softcap);
  cuda_rows::launch_option_rows(cuda_rows::Logits<scalar_t>{}, O, F, target_dtype);
}

// Runs the kernel on `z` (stride(1) == 1 or C == 1, any row stride), writing the gradient to `grad_ptr` (row stride
// `grad_stride`, may alias z) when non-null. Returns (loss, target_flag): the loss float32 (float64 for float64
// logits) or, with args.loss_in_logits_dtype, the logits' dtype, 0-dim for mean/sum, (N,) for none; the flag as the
// op returns it. One launch (the row kernels, whose last block reduces the batch and makes the flag), two for a mean
// with a gradient over more than kInlineCountMaxRows rows of class indices (the count first); no host
// synchronisation. With args.soft the soft-target kernel runs (a dense target: every row counts for the mean). With
// args.options the option kernel runs whatever the target, after a mean's divisors of class indices (a few device
// ops, no count launch: its last block makes the flag), with options.class_weight in the accumulation type, writing
// the rows' z-loss into options.z_loss where it is not empty. Where stats' tensors are not empty (return_stats), the
// row launch writes the rows' top-label statistics into them.
std::tuple<at::Tensor, at::Tensor> run(const at::Tensor& z, void* grad_ptr, int64_t grad_stride,
                                       const at::Tensor& target, const std::optional<at::Tensor>& sample_weight,
                                       const std::optional<at::Tensor>& gamma_per_sample,
                                       const std::optional<at::Tensor>& mix_target,
                                       const std::optional<at::Tensor>& mix_lambda, const Args& args,
                                       OptionTensors options, const StatsOutputs& stats) {
  const int64_t n = z.size(0);
  const auto acc_dtype = z.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  const auto loss_dtype = args.loss_in_logits_dtype ? z.scalar_type() : acc_dtype;
  const bool mean = args.reduction == static_cast<int64_t>(Reduction::Mean);
  const bool reduced = args.reduction != static_cast<int64_t>(Reduction::None);
  // the rows' losses: what the fold reduces (A), or the op's output
  at::Tensor row_loss = at::empty({n}, z.options().dtype(reduced ? acc_dtype : loss_dtype));
  const bool dense = target.is_floating_point();
  const at::Tensor t = dense ? dense_target_for(z, target) : target.contiguous();
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream();
  at::Tensor loss = reduced ? at::empty({}, z.options().dtype(loss_dtype)) : row_loss;
  if (n == 0) {  // no launch: a mean or sum of no rows is 0, and no target is bad
    if (reduced) loss.zero_();
    return {loss, dense ? dense_target_flag(target) : at::zeros({2}, z.options().dtype(at::kLong))};
  }
  // a mix's values are checked with the targets (TargetScan), by the launch that checks those
  at::Tensor mixes, lambdas;
  if (mix_target.has_value()) {
    mixes = mix_target->contiguous();
    lambdas = lambdas_for(*mix_lambda, acc_dtype);
  }
  const int64_t lambda_stride = (lambdas.defined() && lambdas.dim() == 1) ? lambdas.stride(0) : 0;
  if (args.options && mean && !dense) {
    options.divisors = option_divisors(t, options.class_weight, mixes, lambdas, args.ignore_index, acc_dtype);
  }
  // The target flag: made by the row launch's last block (class indices without a count launch; a dense target's
  // row flags, where the kernel checks its values), by the count launch (which also counts the mean's divisor before
  // the rows need it), or by device ATen ops (dense targets the kernel does not check).
  at::Tensor counts, target_flag, row_flags;
  bool count_inline = false;
  if (dense && kernel_checks_dense_target(z, target)) {
    row_flags = at::empty({n}, t.options().dtype(at::kChar));
    target_flag = at::empty({2}, t.options().dtype(at::kLong));
  } else if (dense) {
    target_flag = dense_target_flag(target);
  } else if (mean && grad_ptr != nullptr && n > kInlineCountMaxRows && !args.options) {
    counts = at::empty({3}, t.options());
    const int64_t* mix = mixes.defined() ? mixes.const_data_ptr<int64_t>() : nullptr;
    if (acc_dtype == at::kDouble) {
      check_targets_kernel<double>
          <<<1, kReduceThreads, 0, stream>>>(t.const_data_ptr<int64_t>(), n, z.size(1), args.ignore_index, mix,
                                             lambdas.defined() ? lambdas.const_data_ptr<double>() : nullptr,
                                             lambda_stride, counts.mutable_data_ptr<int64_t>());
    } else {
      check_targets_kernel<float>
          <<<1, kReduceThreads, 0, stream>>>(t.const_data_ptr<int64_t>(), n, z.size(1), args.ignore_index, mix,
                                             lambdas.defined() ? lambdas.const_data_ptr<float>() : nullptr,
                                             lambda_stride, counts.mutable_data_ptr<int64_t>());
    }
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    target_flag = counts.slice(0, 0, 2);  // at the buffer's start, as the fake kernel's
  } else {
    count_inline = true;
    target_flag = at::empty({2}, t.options());
  }
  // a soft row's count of finite logits is an int
  TORCH_CHECK(!args.soft || z.size(1) <= std::numeric_limits<int32_t>::max(),
              "calibkernels::uncertainty_weighted_ce (CUDA): soft targets take at most 2^31 - 1 classes");
  at::Tensor weights, gammas;
  if (sample_weight.has_value()) weights = sample_weight->detach().to(acc_dtype).contiguous();
  if (gamma_per_sample.has_value()) gammas = gamma_per_sample->detach().to(acc_dtype).contiguous();
  at::Tensor captured_ticket;
  unsigned int* ticket = launch_ticket(z, stream, captured_ticket);

  AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, z.scalar_type(), "uncertainty_weighted_ce_cuda", [&] {
    using A = typename std::conditional<std::is_same<scalar_t, double>::value, double, float>::type;
    Params<A> P;
    P.logits = z.const_data_ptr();
    P.logits_row_stride = z.stride(0);
    P.grad = grad_ptr;
    P.grad_row_stride = grad_stride;
    P.target = dense ? nullptr : t.const_data_ptr<int64_t>();
    P.sample_weight = weights.defined() ? weights.const_data_ptr<A>() : nullptr;
    P.gamma_per_sample = gammas.defined() ? gammas.const_data_ptr<A>() : nullptr;
    P.valid_count = counts.defined() ? counts.const_data_ptr<int64_t>() + 2 : nullptr;
    P.row_loss = row_loss.mutable_data_ptr();
    P.num_rows = n;
    P.num_classes = z.size(1);
    P.ignore_index = args.ignore_index;
    P.gamma = static_cast<A>(args.gamma);
    P.norm = static_cast<A>(args.norm);
    P.weight = static_cast<int>(weight_formula(static_cast<Weight>(args.weight)));
    P.flsd_schedule = uses_flsd_schedule(static_cast<Weight>(args.weight));
    P.mode = static_cast<int>(args.mode);
    P.reduction = static_cast<int>(args.reduction);
    P.count_inline = count_inline;
    P.loss_in_logits_dtype = args.loss_in_logits_dtype;
    BatchFold F;
    F.ticket = ticket;
    F.loss = reduced ? loss.mutable_data_ptr() : nullptr;
    F.target_flag = (count_inline || row_flags.defined()) ? target_flag.mutable_data_ptr<int64_t>() : nullptr;
    const bool with_stats = stats.confidence.numel() > 0;
    F.confidence = with_stats ? stats.confidence.mutable_data_ptr<float>() : nullptr;
    F.prediction = with_stats ? stats.prediction.mutable_data_ptr<int64_t>() : nullptr;
    if (!args.soft && !args.options) {
      cuda_rows::launch_hard_targets(cuda_rows::Logits<scalar_t>{}, P, F);
      return;
    }
    SoftParams<A> S;
    S.hard = P;
    S.mix_target = mixes.defined() ? mixes.const_data_ptr<int64_t>() : nullptr;
    S.mix_lambda = lambdas.defined() ? lambdas.const_data_ptr<A>() : nullptr;
    S.lambda_stride = lambda_stride;
    S.dense_target = dense ? t.const_data_ptr() : nullptr;
    S.dense_row_stride = dense ? t.stride(0) : 0;
    S.smoothing = static_cast<A>(args.label_smoothing);
    S.dense_tolerance = static_cast<A>(dense_row_sum_tolerance(target.scalar_type()));
    S.row_flags = row_flags.defined() ? row_flags.mutable_data_ptr<int8_t>() : nullptr;
    if (args.options) {  // class indices without smoothing or a mix: the compact row with c = 0, W_y = 1
      launch_with_options<scalar_t>(S, F, options, args, t.scalar_type());
      return;
    }
    cuda_rows::launch_soft_targets(cuda_rows::Logits<scalar_t>{}, S, F, t.scalar_type());
  });
  return {loss, target_flag};
}

LossOutputs uncertainty_weighted_ce_cuda(const LossArguments& a) {
  Args args = check_args(a.logits, a.target, a.sample_weight, a.gamma_per_sample, a.weight, a.mode, a.gamma, a.norm,
                         a.ignore_index, a.reduction);
  const char* op = "calibkernels::uncertainty_weighted_ce (CUDA): ";
  args.soft = check_soft_arguments(op, a.logits, a.target, a.mix_target, a.mix_lambda, a.label_smoothing, a.weight);
  check_options(op, a);
  args.label_smoothing = a.label_smoothing;
  args.loss_in_logits_dtype = a.loss_in_logits_dtype;
  args.options = a.has_options();
  args.lse_square_scale = a.lse_square_scale;
  args.softcap = a.softcap;
  if (a.compute_grad && a.grad_out.has_value()) check_grad_out(op, a.logits, *a.grad_out);
  const c10::cuda::CUDAGuard guard(a.logits.device());
  // Rows may be strided; columns must be contiguous for the vector loads.
  const bool direct = a.logits.stride(1) == 1 || a.logits.size(1) == 1;
  const at::Tensor z = direct ? a.logits : a.logits.contiguous();
  // return_stats: written by the row launch, in the rows' first pass (before an in-place gradient overwrites them)
  const StatsOutputs stats = stats_outputs(a.logits, a.return_stats);
  // In place each thread overwrites only the elements it read itself, after the row's reduction.
  const at::Tensor dest = gradient_destination(a.logits, z, a.compute_grad, a.grad_out,
                                               [&] { return at::empty({z.size(0), z.size(1)}, z.options()); });
  OptionTensors options{at::Tensor(), at::Tensor(), z_loss_output(a)};
  if (a.class_weight.has_value()) {
    options.class_weight = a.class_weight->detach().to(z.scalar_type() == at::kDouble ? at::kDouble : at::kFloat);
    options.class_weight = options.class_weight.contiguous();
  }
  const auto [loss, target_flag] =
      run(z, a.compute_grad ? dest.data_ptr() : nullptr, a.compute_grad ? dest.stride(0) : 0, a.target, a.sample_weight,
          a.gamma_per_sample, a.mix_target, a.mix_lambda, args, options, stats);
  return finish_gradient(loss, dest, a.compute_grad, a.grad_out, target_flag, stats, options.z_loss);
}

// grad[i, :] *= factor[i · factor_stride] (stride 0: one scalar), skipping rows whose factor is exactly 1: the usual
// loss.backward() (grad_output = 1) then reads one number per block and writes nothing. A persistent grid of a few
// blocks per multiprocessor strides over the rows. factor_t is float32 or the gradient's type (grad_output of a
// 16-bit loss), read as it is, without a cast's launch. The product is taken in the accumulation type: float64 stays
// float64 (a factor such as 1 + 1e-12 is not 1, and the gradient keeps its digits).
template <typename scalar_t, typename factor_t>
__global__ void __launch_bounds__(256)
    scale_grad_kernel(scalar_t* grad, int64_t num_rows, int64_t num_classes, int64_t row_stride, const factor_t* factor,
                      int64_t factor_stride) {
  using A = cuda_rows::Acc<scalar_t>;
  if (factor_stride == 0 && static_cast<A>(*factor) == A(1)) return;
  for (int64_t row = blockIdx.x; row < num_rows; row += gridDim.x) {
    const A f = static_cast<A>(factor[row * factor_stride]);
    if (f == A(1)) continue;
    scalar_t* g = grad + row * row_stride;
    for (int64_t c = threadIdx.x; c < num_classes; c += blockDim.x) {
      g[c] = static_cast<scalar_t>(static_cast<A>(g[c]) * f);
    }
  }
}

void uncertainty_weighted_ce_scale_grad_cuda(at::Tensor& grad, const at::Tensor& grad_output) {
  const char* op = "calibkernels::uncertainty_weighted_ce_scale_grad_ (CUDA): ";
  TORCH_CHECK(grad.is_cuda() && grad_output.device() == grad.device(), op,
              "expected grad and grad_output on the same CUDA device, got ", grad.device(), " and ",
              grad_output.device());
  TORCH_CHECK(grad.dim() == 2 && (grad.size(1) <= 1 || grad.stride(1) == 1), op,
              "expected a 2-D gradient with unit column stride, got shape ", grad.sizes(), " and strides ",
              grad.strides());
  TORCH_CHECK(grad_output.numel() == 1 || (grad_output.dim() == 1 && grad_output.size(0) == grad.size(0)), op,
              "grad_output must be a scalar or have one entry per row, got shape ", grad_output.sizes());
  if (grad.numel() == 0) return;
  const c10::cuda::CUDAGuard guard(grad.device());
  const bool native = grad_output.scalar_type() == at::kFloat || grad_output.scalar_type() == grad.scalar_type();
  const at::Tensor factor = (native ? grad_output : grad_output.to(at::kFloat)).reshape({-1});
  const int64_t factor_stride = factor.numel() == 1 ? 0 : factor.stride(0);
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, grad.get_device()));
  const int64_t blocks = std::min<int64_t>(grad.size(0), 4 * static_cast<int64_t>(sms > 0 ? sms : 1));
  AT_DISPATCH_FLOATING_TYPES_AND2(
      at::kHalf, at::kBFloat16, grad.scalar_type(), "uncertainty_weighted_ce_scale_grad", [&] {
        const auto launch_with = [&](const auto* factor_ptr) {
          scale_grad_kernel<<<static_cast<unsigned>(blocks), 256, 0, c10::cuda::getCurrentCUDAStream()>>>(
              grad.mutable_data_ptr<scalar_t>(), grad.size(0), grad.size(1), grad.stride(0), factor_ptr, factor_stride);
        };
        if (factor.scalar_type() == at::kFloat) {
          launch_with(factor.const_data_ptr<float>());
        } else {
          launch_with(factor.const_data_ptr<scalar_t>());
        }
      });
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

std::pair<int, const char*> cuda_kernels_probe(int device) {
  // A kernel's attributes exist only where the library holds machine code for the device's architecture or PTX the
  // driver can compile for it; otherwise every launch would fail with "no kernel image is available". Plain runtime
  // calls rather than a device guard, which throws.
  cudaError_t status = cudaPeekAtLastError();
  if (status != cudaSuccess) return {static_cast<int>(status), cudaGetErrorName(status)};  // someone else's error
  int previous = 0;
  status = cudaGetDevice(&previous);
  if (status == cudaSuccess && previous != device) status = cudaSetDevice(device);
  if (status == cudaSuccess) {
    cudaFuncAttributes attributes;
    status = cudaFuncGetAttributes(&attributes, check_targets_kernel<float>);
  }
  (void)cudaGetLastError();  // this probe's own error (none was pending before it), not one for the next launch
  if (previous != device) {
    // back to the caller's device without creating a context there (as PyTorch's own guards do)
    (void)c10::cuda::MaybeSetDevice(static_cast<c10::DeviceIndex>(previous));
    (void)cudaGetLastError();
  }
  return {static_cast<int>(status), cudaGetErrorName(status)};
}

}  // namespace calibkernels

TORCH_LIBRARY_IMPL(calibkernels, CUDA, m) {
  m.impl("uncertainty_weighted_ce", &calibkernels::dispatcher_entry<calibkernels::uncertainty_weighted_ce_cuda>);
  m.impl("uncertainty_weighted_ce_scale_grad_", &calibkernels::uncertainty_weighted_ce_scale_grad_cuda);
}
