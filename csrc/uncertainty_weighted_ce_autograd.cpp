// Autograd of calibkernels::uncertainty_weighted_ce, for eager and traced calls alike (torch.compile traces it).
//
// The forward computes the gradient of the reduced loss for grad_output = 1 along with the loss (docs/losses.md,
// "Contracts"); the backward scales it. Registered under the Autograd key, an eager call from Python
// (torch.ops.calibkernels.uncertainty_weighted_ce, calibkernels/cpp/uncertainty_weighted_ce.py) with logits that
// require grad goes from the dispatcher straight here: a Python autograd.Function would cost about as much host time
// per training step as the whole of F.cross_entropy's step at classification shapes.
//
//   - in place (grad_out is the logits): the logits' version is bumped, so any other node that saved them raises at
//     backward; the gradient handed to autograd is a new alias of the overwritten logits, so AccumulateGrad adopts it
//     without a copy;
//   - a per-sample gamma that requires grad (focal, mode "loss"): dL_i/dgamma_i = u_i CE_i log(1 - p_y);
//   - backward in place on the saved gradient, except with the graph retained (a fresh tensor) or under a tracer;
//     on the CPU it skips the multiply when grad_output is the scalar 1; on CUDA the scaling op reads grad_output on
//     the device;
//   - create_graph=True raises: the gradient has no graph to differentiate.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "uncertainty_weighted_ce.h"

namespace torch::autograd {
// Whether the backward running on this thread keeps its graph (retain_graph=True): the in-place scaling of the saved
// gradient is safe only when it does not. libtorch exports this one query of its engine (TORCH_API) but declares it
// in an internal header (torch/csrc/autograd/graph_task.h), whose other contents this file has no use for.
TORCH_API bool get_current_graph_task_keep_graph();
}  // namespace torch::autograd

namespace calibkernels {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// The op below the Autograd key (the device kernel, or the fake one under a tracer), for arguments gathered in
// LossArguments: the one place in C++ that passes the schema's positional arguments on.
LossOutputs call_below_autograd(const LossArguments& a) {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("calibkernels::uncertainty_weighted_ce", "")
                                 .typed<decltype(dispatcher_entry<call_below_autograd>)>();
  const at::AutoDispatchBelowADInplaceOrView below;
  return handle.call(a.logits, a.target, a.sample_weight, a.gamma_per_sample, a.weight, a.mode, a.gamma, a.norm,
                     a.ignore_index, a.reduction, a.compute_grad, a.grad_out, a.mix_target, a.mix_lambda,
                     a.label_smoothing, a.loss_in_logits_dtype, a.return_stats, a.class_weight, a.lse_square_scale,
                     a.softcap);
}

const c10::TypedOperatorHandle<void(Tensor&, const Tensor&)>& scale_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("calibkernels::uncertainty_weighted_ce_scale_grad_", "")
                                 .typed<void(Tensor&, const Tensor&)>();
  return handle;
}

// torch::autograd::Function records every tensor argument (it needs a device), so an absent per-sample gamma is
// passed as this placeholder.
const Tensor& absent() {
  static const Tensor placeholder = at::empty({0});
  return placeholder;
}

std::optional<Tensor> detached(const std::optional<Tensor>& t) {
  return t.has_value() ? std::optional<Tensor>(t->detach()) : std::nullopt;
}

// Per row, d(reduced loss)/dgamma_i for grad_output = 1 of the focal loss (1 - p_y)^gamma_i CE_i, 0 on ignored rows
// and where u_i CE_i = 0 (the limit at p_y = 1). Computed before an in-place kernel overwrites the logits.
Tensor gamma_gradient_factor(const Tensor& logits, const Tensor& target, const Tensor& gamma, int64_t ignore_index,
                             int64_t reduction) {
  const at::NoGradGuard no_grad;
  const Tensor z =
      (logits.scalar_type() == at::kHalf || logits.scalar_type() == at::kBFloat16) ? logits.to(at::kFloat) : logits;
  const Tensor valid = target.ne(ignore_index);
  const Tensor safe = at::where(valid, target, 0).unsqueeze(1);
  // Relative to the row max, with 1 - p_y = d_not_y / d and, where the target holds the max, CE = log1p(d_not_y):
  // log p_y = z_y - logsumexp(z) would carry an ulp of the logits into both, all of a confident row's digits.
  const Tensor shifted = z - z.amax({1}, /*keepdim=*/true);
  const Tensor shifted_y = shifted.gather(1, safe).squeeze(1);
  const Tensor d_not_y = at::exp(shifted).scatter(1, safe, 0.0).sum(1);
  const Tensor log_d = at::where(shifted_y.eq(0), at::log1p(d_not_y), at::log(at::exp(shifted_y) + d_not_y));
  const Tensor ce = (log_d - shifted_y).clamp_min(0);
  // log(1 - p_y): log1p(-p_y) below p_y = 1/2, log d_not_y - log d above (each exact where the other cancels)
  const Tensor log_one_minus = at::where(ce.gt(std::log(2.0)), at::log1p(-at::exp(ce.neg())), at::log(d_not_y) - log_d);
  const Tensor weighted_ce = at::exp(gamma.to(z.scalar_type()) * log_one_minus) * ce;
  Tensor factor = at::where(valid.logical_and(weighted_ce.ne(0)), weighted_ce * log_one_minus, at::zeros_like(ce));
  if (static_cast<Reduction>(reduction) == Reduction::Mean) factor = factor / valid.sum().clamp_min(1);
  return factor;
}

bool is_plain(const Tensor& t) {
  // not a FakeTensor / functional tensor / other subclass: its values can be read and it can be written in place
  return !t.key_set().has_any(c10::DispatchKeySet({c10::DispatchKey::Python, c10::DispatchKey::Functionalize}));
}

// grad_output == 1, read without a dispatcher round trip (item()): the usual loss.backward()
bool scalar_is_one(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kFloat:
      return *t.const_data_ptr<float>() == 1.0f;
    case at::kDouble:
      return *t.const_data_ptr<double>() == 1.0;
    case at::kHalf:
      return static_cast<float>(*t.const_data_ptr<at::Half>()) == 1.0f;
    case at::kBFloat16:
      return static_cast<float>(*t.const_data_ptr<at::BFloat16>()) == 1.0f;
    default:
      return t.item<double>() == 1.0;
  }
}

Tensor scale_saved_gradient(Tensor grad, const Tensor& grad_output) {
  // the CUDA op reads grad_output as it is; the others take it as a column in the gradient's dtype
  const auto factor = [&] {
    const Tensor column = grad_output.dim() == 1 ? grad_output.unsqueeze(1) : grad_output;
    return column.scalar_type() == grad.scalar_type() ? column : column.to(grad.scalar_type());
  };
  if (!is_plain(grad) || !is_plain(grad_output) || torch::autograd::get_current_graph_task_keep_graph()) {
    return grad * factor();  // the saved buffer must survive, or a tracer needs a functional op
  }
  if (grad_output.is_cpu()) {
    if (grad_output.numel() == 1 && scalar_is_one(grad_output)) return grad;
    return grad.mul_(factor());
  }
  if (grad.is_cuda() && grad.scalar_type() != at::kDouble) {
    scale_op().call(grad, grad_output);
    return grad;
  }
  return grad.mul_(factor());
}

// Raised by a backward run with create_graph=True, rather than returning a gradient whose differentiation raises:
// autograd runs only the nodes on a path to the inputs that torch.autograd.grad asks for, and a raising node hanging
// off a detached alias is on no such path, so a second-order term would be left out without a word.
constexpr const char* kDoubleBackwardMessage =
    "calibkernels: the fused kernels do not support double backward (create_graph=True: differentiating a gradient of "
    "the loss, e.g. a gradient penalty or a look-ahead step); use backend='reference' for that loss";

// The differentiable inputs are passed as tensors (logits, and a per-sample gamma or the placeholder), so that
// autograd records their edges; the rest of the op's arguments ride along in `args`.
struct FusedLoss : public torch::autograd::Function<FusedLoss> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& gamma_per_sample,
                               LossArguments args) {
    const bool logits_grad = ctx->needs_input_grad(0);
    Tensor gamma_factor;
    if (args.gamma_per_sample.has_value() && ctx->needs_input_grad(1) && static_cast<Mode>(args.mode) == Mode::Loss) {
      // the hard-target factor; calibkernels._backends sends soft targets with a γ that requires grad to the reference
      TORCH_CHECK(!args.target.is_floating_point() && !args.mix_target.has_value() && args.label_smoothing == 0.0,
                  "calibkernels::uncertainty_weighted_ce: the gradient of a per-sample gamma is not implemented for "
                  "soft targets; use backend='reference'");
      gamma_factor = gamma_gradient_factor(logits, args.target, gamma_per_sample, args.ignore_index, args.reduction);
    }
    const bool write_logits = args.grad_out.has_value() && logits_grad;
    args.logits = logits;
    args.sample_weight = detached(args.sample_weight);
    args.gamma_per_sample = detached(args.gamma_per_sample);
    args.mix_target = detached(args.mix_target);
    args.mix_lambda = detached(args.mix_lambda);
    args.class_weight = detached(args.class_weight);
    args.compute_grad = logits_grad;
    if (!write_logits) args.grad_out = std::nullopt;
    auto [loss, grad, target_flag, confidence, prediction, z_loss] = call_below_autograd(args);
    Tensor saved = grad;
    if (write_logits) {
      torch::autograd::impl::bump_version(logits);
      saved = logits.detach();
    }
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({logits_grad ? saved : Tensor(), gamma_factor});
    // z_loss: the rows' z-loss, reported beside the loss that carries its gradient already
    ctx->mark_non_differentiable({grad, target_flag, confidence, prediction, z_loss});
    // loss_in_logits_dtype: the kernel writes the loss in the logits' dtype, so no cast launch (nor, outside, a
    // cast's ToCopyBackward node casting grad_output back: the scaling reads grad_output in the gradient's dtype)
    return {loss, grad, target_flag, confidence, prediction, z_loss};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& grad_loss = grad_outputs[0];
    variable_list grads(3);  // logits, gamma_per_sample, the other arguments
    if (!grad_loss.defined()) return grads;
    TORCH_CHECK(!at::GradMode::is_enabled(), kDoubleBackwardMessage);
    if (saved[0].defined()) grads[0] = scale_saved_gradient(saved[0], grad_loss);
    if (saved[1].defined()) grads[1] = saved[1] * grad_loss.to(saved[1].scalar_type());
    return grads;
  }
};

// The op's autograd kernel: the op below autograd when nothing needs a gradient, else FusedLoss.
LossOutputs uncertainty_weighted_ce_autograd(const LossArguments& a) {
  const bool grad_mode = at::GradMode::is_enabled();
  const bool logits_grad = grad_mode && a.compute_grad && a.logits.requires_grad();
  const bool gamma_grad = grad_mode && a.gamma_per_sample.has_value() && a.gamma_per_sample->requires_grad();
  if (!logits_grad && !gamma_grad) return call_below_autograd(a);
  TORCH_CHECK_VALUE(!a.grad_out.has_value() || a.grad_out->is_same(a.logits),
                    "calibkernels::uncertainty_weighted_ce: with logits that require grad, grad_out must be the "
                    "logits themselves (in place) or None");
  auto outputs = FusedLoss::apply(a.logits, a.gamma_per_sample.has_value() ? *a.gamma_per_sample : absent(), a);
  return {outputs[0], outputs[1], outputs[2], outputs[3], outputs[4], outputs[5]};
}

}  // namespace

}  // namespace calibkernels

TORCH_LIBRARY_IMPL(calibkernels, Autograd, m) {
  m.impl("uncertainty_weighted_ce", &calibkernels::dispatcher_entry<calibkernels::uncertainty_weighted_ce_autograd>);
}
