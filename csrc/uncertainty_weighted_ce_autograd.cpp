// Autograd of calibkernels::uncertainty_weighted_ce for eager calls, in C++.
//
// The same contract as calibkernels/_autograd.py (docs/losses.md, "Contracts"), which serves the Triton backend and
// traced code: the forward computes the gradient of the reduced loss for grad_output = 1, the backward scales it.
// It is written in C++ because a Python autograd.Function costs about as much host time per training step as the
// whole of F.cross_entropy's step at classification shapes; registered under the Autograd key, an eager call with
// logits that require grad goes from the dispatcher straight here.
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
#include <torch/csrc/autograd/graph_task.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/utils/pybind.h>
#include <torch/library.h>

#include <cmath>
#include <tuple>

#include "uncertainty_weighted_ce.h"

namespace calibkernels {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

using OpSignature = std::tuple<Tensor, Tensor, Tensor>(const Tensor&, const Tensor&, const std::optional<Tensor>&,
                                                       const std::optional<Tensor>&, int64_t, int64_t, double, double,
                                                       int64_t, int64_t, bool, const std::optional<Tensor>&,
                                                       const std::optional<Tensor>&, const std::optional<Tensor>&,
                                                       double, bool);

const c10::TypedOperatorHandle<OpSignature>& fused_op() {
  static const auto handle =
      c10::Dispatcher::singleton().findSchemaOrThrow("calibkernels::uncertainty_weighted_ce", "").typed<OpSignature>();
  return handle;
}

const c10::TypedOperatorHandle<void(Tensor&, const Tensor&)>& scale_op() {
  static const auto handle = c10::Dispatcher::singleton()
                                 .findSchemaOrThrow("calibkernels::uncertainty_weighted_ce_scale_grad_", "")
                                 .typed<void(Tensor&, const Tensor&)>();
  return handle;
}

// torch::autograd::Function records every tensor argument (it needs a device), so an absent optional argument is
// passed as this placeholder.
const Tensor& absent() {
  static const Tensor placeholder = at::empty({0});
  return placeholder;
}

std::optional<Tensor> detached_or_none(const Tensor& t) {
  return t.is_same(absent()) ? std::nullopt : std::optional<Tensor>(t.detach());
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

struct FusedLoss : public torch::autograd::Function<FusedLoss> {
  static variable_list forward(AutogradContext* ctx, const Tensor& logits, const Tensor& target,
                               const Tensor& sample_weight, const Tensor& gamma_per_sample, int64_t weight,
                               int64_t mode, double gamma, double norm, int64_t ignore_index, int64_t reduction,
                               bool inplace, const Tensor& mix_target, const Tensor& mix_lambda, double label_smoothing,
                               bool loss_in_logits_dtype) {
    const bool logits_grad = ctx->needs_input_grad(0);
    Tensor gamma_factor;
    if (!gamma_per_sample.is_same(absent()) && ctx->needs_input_grad(3) && static_cast<Mode>(mode) == Mode::Loss) {
      // the hard-target factor; calibkernels._backends sends soft targets with a γ that requires grad to the reference
      TORCH_CHECK(!target.is_floating_point() && mix_target.is_same(absent()) && label_smoothing == 0.0,
                  "calibkernels::uncertainty_weighted_ce: the gradient of a per-sample gamma is not implemented for "
                  "soft targets; use backend='reference'");
      gamma_factor = gamma_gradient_factor(logits, target, gamma_per_sample, ignore_index, reduction);
    }
    const bool write_logits = inplace && logits_grad;
    Tensor loss, grad, target_flag;
    {
      const at::AutoDispatchBelowADInplaceOrView below;
      std::tie(loss, grad, target_flag) = fused_op().call(
          logits, target, detached_or_none(sample_weight), detached_or_none(gamma_per_sample), weight, mode, gamma,
          norm, ignore_index, reduction, logits_grad, write_logits ? std::optional<Tensor>(logits) : std::nullopt,
          detached_or_none(mix_target), detached_or_none(mix_lambda), label_smoothing, loss_in_logits_dtype);
    }
    Tensor saved = grad;
    if (write_logits) {
      torch::autograd::impl::bump_version(logits);
      saved = logits.detach();
    }
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({logits_grad ? saved : Tensor(), gamma_factor});
    ctx->mark_non_differentiable({grad, target_flag});
    // loss_in_logits_dtype: the kernel writes the loss in the logits' dtype, so no cast launch (nor, outside, a
    // cast's ToCopyBackward node casting grad_output back: the scaling reads grad_output in the gradient's dtype)
    return {loss, grad, target_flag};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grad_outputs) {
    const auto saved = ctx->get_saved_variables();
    const Tensor& grad_loss = grad_outputs[0];
    variable_list grads(15);
    if (!grad_loss.defined()) return grads;
    TORCH_CHECK(!at::GradMode::is_enabled(), kDoubleBackwardMessage);
    if (saved[0].defined()) grads[0] = scale_saved_gradient(saved[0], grad_loss);
    if (saved[1].defined()) grads[3] = saved[1] * grad_loss.to(saved[1].scalar_type());
    return grads;
  }
};

// The op's autograd, for the op's arguments.
std::tuple<Tensor, Tensor, Tensor> autograd_call(
    const Tensor& logits, const Tensor& target, const std::optional<Tensor>& sample_weight,
    const std::optional<Tensor>& gamma_per_sample, int64_t weight, int64_t mode, double gamma, double norm,
    int64_t ignore_index, int64_t reduction, bool compute_grad, const std::optional<Tensor>& grad_out,
    const std::optional<Tensor>& mix_target, const std::optional<Tensor>& mix_lambda, double label_smoothing,
    bool loss_in_logits_dtype) {
  const bool grad_mode = at::GradMode::is_enabled();
  const bool logits_grad = grad_mode && compute_grad && logits.requires_grad();
  const bool gamma_grad = grad_mode && gamma_per_sample.has_value() && gamma_per_sample->requires_grad();
  if (!logits_grad && !gamma_grad) {
    const at::AutoDispatchBelowADInplaceOrView below;
    return fused_op().call(logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, ignore_index,
                           reduction, compute_grad, grad_out, mix_target, mix_lambda, label_smoothing,
                           loss_in_logits_dtype);
  }
  const bool inplace = grad_out.has_value();
  TORCH_CHECK_VALUE(!inplace || grad_out->is_same(logits),
                    "calibkernels::uncertainty_weighted_ce: with logits that require grad, grad_out must be the "
                    "logits themselves (in place) or None");
  auto outputs =
      FusedLoss::apply(logits, target, sample_weight.has_value() ? *sample_weight : absent(),
                       gamma_per_sample.has_value() ? *gamma_per_sample : absent(), weight, mode, gamma, norm,
                       ignore_index, reduction, inplace, mix_target.has_value() ? *mix_target : absent(),
                       mix_lambda.has_value() ? *mix_lambda : absent(), label_smoothing, loss_in_logits_dtype);
  return {outputs[0], outputs[1], outputs[2]};
}

std::tuple<Tensor, Tensor, Tensor> uncertainty_weighted_ce_autograd(
    const Tensor& logits, const Tensor& target, const std::optional<Tensor>& sample_weight,
    const std::optional<Tensor>& gamma_per_sample, int64_t weight, int64_t mode, double gamma, double norm,
    int64_t ignore_index, int64_t reduction, bool compute_grad, const std::optional<Tensor>& grad_out,
    const std::optional<Tensor>& mix_target, const std::optional<Tensor>& mix_lambda, double label_smoothing,
    bool loss_in_logits_dtype) {
  return autograd_call(logits, target, sample_weight, gamma_per_sample, weight, mode, gamma, norm, ignore_index,
                       reduction, compute_grad, grad_out, mix_target, mix_lambda, label_smoothing,
                       loss_in_logits_dtype);
}

}  // namespace

// calibkernels._C.eager_loss(logits, target, weight, mode, gamma, norm, ignore_index, reduction[, mix_target,
// mix_lambda, label_smoothing, inplace]) -> (loss, target_flag): the common eager call (no sample weight, no
// per-sample gamma; class-index targets, optionally mixed and smoothed, or a dense target, optionally smoothed)
// through the op and its autograd above; the loss in the logits' dtype, and the op's target flag (empty on the CPU,
// whose kernel raises instead).
// A plain function rather than torch.ops: the boxed call of a fifteen-argument op from Python costs microseconds that
// a small training step notices. mix_target is None or a tensor; mix_lambda None, a tensor or a number (a 0-dim
// tensor is made for it here). inplace: the gradient overwrites the logits when they need one (the caller has
// refused a leaf, or a view of one, that requires grad).
PyObject* eager_loss(PyObject* /*module*/, PyObject* args) {
  HANDLE_TH_ERRORS
  PyObject* logits_obj = nullptr;
  PyObject* target_obj = nullptr;
  PyObject* mix_obj = Py_None;
  PyObject* lambda_obj = Py_None;
  long long weight = 0, mode = 0, ignore_index = 0, reduction = 0;
  double gamma = 0, norm = 0, label_smoothing = 0;
  int inplace = 0;
  if (!PyArg_ParseTuple(args, "OOLLddLL|OOdp", &logits_obj, &target_obj, &weight, &mode, &gamma, &norm, &ignore_index,
                        &reduction, &mix_obj, &lambda_obj, &label_smoothing, &inplace)) {
    return nullptr;
  }
  TORCH_CHECK_TYPE(THPVariable_Check(logits_obj) && THPVariable_Check(target_obj),
                   "eager_loss: logits and target must be tensors");
  const Tensor& logits = THPVariable_Unpack(logits_obj);
  const Tensor& target = THPVariable_Unpack(target_obj);
  std::optional<Tensor> mix_target, mix_lambda;
  if (mix_obj != Py_None) {
    TORCH_CHECK_TYPE(THPVariable_Check(mix_obj), "eager_loss: mix_target must be a tensor or None");
    mix_target = THPVariable_Unpack(mix_obj);
  }
  if (lambda_obj != Py_None) {
    if (THPVariable_Check(lambda_obj)) {
      mix_lambda = THPVariable_Unpack(lambda_obj);
    } else {
      const double lam = PyFloat_AsDouble(lambda_obj);
      if (lam == -1.0 && PyErr_Occurred()) return nullptr;
      mix_lambda = at::scalar_tensor(
          lam, logits.options().dtype(logits.scalar_type() == at::kDouble ? at::kDouble : at::kFloat));
    }
  }
  const bool compute_grad = at::GradMode::is_enabled() && logits.requires_grad();
  Tensor loss, target_flag;
  {
    const pybind11::gil_scoped_release no_gil;
    const std::optional<Tensor> grad_out = inplace && compute_grad ? std::optional<Tensor>(logits) : std::nullopt;
    if (torch::jit::tracer::isTracing()) {
      // the tracer records the op where the dispatcher passes its Tracer key, above the Autograd key
      std::tie(loss, std::ignore, target_flag) =
          fused_op().call(logits, target, std::nullopt, std::nullopt, weight, mode, gamma, norm, ignore_index,
                          reduction, compute_grad, grad_out, mix_target, mix_lambda, label_smoothing, true);
    } else {
      // the op's autograd directly (what the dispatcher would call for plain tensors)
      std::tie(loss, std::ignore, target_flag) =
          autograd_call(logits, target, std::nullopt, std::nullopt, weight, mode, gamma, norm, ignore_index, reduction,
                        compute_grad, grad_out, mix_target, mix_lambda, label_smoothing, true);
    }
  }
  PyObject* loss_obj = THPVariable_Wrap(std::move(loss));
  if (loss_obj == nullptr) return nullptr;
  PyObject* flag_obj = THPVariable_Wrap(std::move(target_flag));
  if (flag_obj == nullptr) {
    Py_DECREF(loss_obj);
    return nullptr;
  }
  PyObject* result = PyTuple_New(2);
  if (result == nullptr) {
    Py_DECREF(loss_obj);
    Py_DECREF(flag_obj);
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 0, loss_obj);  // steals the references
  PyTuple_SET_ITEM(result, 1, flag_obj);
  return result;
  END_HANDLE_TH_ERRORS
}

}  // namespace calibkernels

TORCH_LIBRARY_IMPL(calibkernels, Autograd, m) {
  m.impl("uncertainty_weighted_ce", &calibkernels::uncertainty_weighted_ce_autograd);
}
