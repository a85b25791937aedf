"""The autograd of the fused loss: one contract, one implementation per op.

Every backend provides the same kernel call, ``forward(logits, target, sample_weight, gamma_per_sample, uncertainty,
mode, gamma, norm, ignore_index, reduction, compute_grad, grad_out, mix_target=None, mix_lambda=None,
label_smoothing=0.0, *, loss_dtype=None) -> (loss, grad, target_flag)`` (the soft-target arguments only where the
backend's module sets ``SOFT_TARGETS``; ``target`` is then class indices or a dense ``(N, C)`` target):

* ``loss``: float32 (float64 for float64 logits), or ``loss_dtype`` where the backend writes that dtype itself (the
  logits' dtype, asked for by the calls below: a 16-bit loss then costs no cast launch, and its backward no cast of
  ``grad_output``); the caller casts what it gets. 0-dim for mean/sum, ``(N,)`` for none;
* the gradient of the reduced loss for ``grad_output = 1`` ("gradient in the forward"), written into ``grad_out`` when
  given (the logits themselves for ``inplace=True``; ``grad`` is then empty) or returned as ``grad``;
* ``target_flag``: ``None``, or a two-slot int64 device tensor ``(any bad target, a bad value)`` that
  :mod:`calibkernels._target_checks` turns into a ``ValueError`` without stalling the host.

The backward only scales the saved gradient by ``grad_output``. The compiled op (C++ CPU, CUDA C++) carries its
autograd in C++, registered under the Autograd key (``csrc/uncertainty_weighted_ce_autograd.cpp``; its module's
``loss_with_autograd``), for eager and traced calls alike: a Python ``autograd.Function`` alone costs about as much
host time per step as ``F.cross_entropy``'s whole step at classification shapes (docs/performance.md). The Triton
kernels, launched from Python, have :class:`UncertaintyWeightedCE`, the same contract; in traced code their forward
calls the registered Triton op as one graph node, eager calls launch the kernels directly.

Contracts (docs/losses.md, "Contracts"):

* ``inplace=True`` needs logits that are an intermediate result: a leaf that requires grad (or a view of one) is
  refused with ``ValueError`` on every fused backend (the reference never writes in place and ignores the flag);
  other autograd nodes that saved the logits raise at backward.
* Double backward raises: the backward with ``create_graph=True`` raises ``RuntimeError`` naming the reference
  backend, which supports it. (A gradient returned as a value whose differentiation raises would not do: autograd
  runs only the nodes on a path to the inputs asked for, so ``torch.autograd.grad(penalty, params)`` would skip the
  raising node and leave the second-order term out without a word.)
* A per-sample ``gamma`` tensor that requires grad (focal, ``mode="loss"``) gets its gradient
  ``dL_i/dγ_i = L_i · log(1 - p_{i,y})``; in ``mode="grad"`` the weight is detached, so γ gets none (as in the
  reference). ``sample_weight`` is always used detached.
* Memory: the saved gradient is the only ``N×C`` buffer (none with ``inplace=True``); the backward scales it in place
  unless the graph is retained, in which case it returns a fresh tensor (the saved one stays valid).
* Top-label statistics (:func:`run` with ``return_stats=True``, :class:`calibkernels.LossStats`): a backend module
  with ``STATS_IN_KERNEL`` (the Triton kernels) takes ``stats_out=(confidence, prediction)`` in its ``forward`` and
  writes them in the loss launch, from the logits before an in-place gradient overwrites them; for the others
  :func:`calibkernels.loss_stats.loss_stats_of_inputs` reads the logits before the kernel runs.
"""

from __future__ import annotations

import torch

from . import _target_checks
from ._target_checks import is_plain_eager
from ._kernel_codes import MODE_CODES, REDUCTION_CODES, WEIGHT_CODES
from ._row_math import gamma_gradient_factor, reduce_rows
from ._validation import LossInputs, expanded, lambda_tensor
from .loss_stats import LossStats, empty_loss_stats, loss_stats_of_inputs

__all__ = ["UncertaintyWeightedCE", "run", "scale_saved_gradient", "is_plain_eager",
           "raise_if_create_graph"]


def scale_saved_gradient(grad: torch.Tensor, grad_output, scale_inplace=None) -> torch.Tensor | None:
    """``grad · grad_output`` (a scalar, or ``(N,)`` per row), reusing the saved buffer when that is safe.

    Traced, or with the graph retained (``retain_graph=True``: gradcheck, several backwards through one graph): a
    fresh tensor, so the saved buffer stays valid and the caller may edit the result. Plain eager otherwise: in place,
    skipped on the CPU when ``grad_output`` is the scalar 1; on a GPU ``scale_inplace(grad, grad_output)`` reads
    ``grad_output`` on the device (no host synchronisation) and leaves rows whose factor is 1 untouched.
    """
    if grad_output is None:  # the loss was not used (set_materialize_grads(False) passes None)
        return None
    if not is_plain_eager(grad, grad_output) or torch._C._autograd._get_current_graph_task_keep_graph():
        return grad * _factor(grad, grad_output)
    if grad_output.device.type == "cpu":
        if grad_output.numel() == 1 and grad_output.item() == 1.0:
            return grad
        return grad.mul_(_factor(grad, grad_output))
    if scale_inplace is not None:  # reads grad_output as it is, on the device: no cast launch first
        scale_inplace(grad, grad_output)
        return grad
    return grad.mul_(_factor(grad, grad_output))


def _factor(grad: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """``grad_output`` shaped and typed to multiply ``grad``: a column for a per-row ``(N,)`` one."""
    factor = grad_output[:, None] if grad_output.dim() == 1 else grad_output
    return factor if factor.dtype == grad.dtype else factor.to(grad.dtype)


class UncertaintyWeightedCE(torch.autograd.Function):
    """Autograd of the fused loss for every compiled backend: the forward computes the loss and the gradient of the
    reduced loss in one kernel; the backward scales that gradient by ``grad_output``."""

    @staticmethod
    def forward(ctx, logits, target, sample_weight, gamma_per_sample, uncertainty, mode, gamma, norm, ignore_index,
                reduction, inplace, backend_module, mix_target=None, mix_lambda=None, label_smoothing=0.0,
                loss_dtype=None, return_stats=False, options=None):
        # return_stats (a backend with STATS_IN_KERNEL): (loss, confidence, prediction), the last two without gradient
        gamma_factor = None
        if gamma_per_sample is not None and ctx.needs_input_grad[3] and mode == MODE_CODES["loss"]:
            # read the logits before an in-place kernel overwrites them
            gamma_factor = gamma_gradient_factor(logits, target, gamma_per_sample, ignore_index, reduction)
        stats = empty_loss_stats(logits.shape[0], logits.device) if return_stats else None
        loss, grad, flag = backend_module.forward(logits, target, sample_weight, gamma_per_sample, uncertainty, mode,
                                                  gamma, norm, ignore_index, reduction, True,
                                                  logits if inplace else None,
                                                  *_soft_arguments(mix_target, mix_lambda, label_smoothing),
                                                  loss_dtype=loss_dtype, **_stats_keyword(stats), **(options or {}))
        if flag is not None:
            _target_checks.submit(flag, logits.shape[-1], ignore_index, _dense_dtype(target))
        if inplace:
            # Autograd is off in here, so the dispatcher does not bump the mutated logits' version: do it, so that
            # any other node that saved the logits raises at backward instead of reading the gradient.
            torch.autograd.graph.increment_version(logits)
            # A new alias of the overwritten logits: AccumulateGrad adopts a gradient as .grad without a copy only
            # when nothing else references its TensorImpl, and the caller still holds the logits.
            grad = logits.detach()
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(grad, gamma_factor)
        ctx.scale_inplace = getattr(backend_module, "scale_grad_", None)
        ctx.on_gpu = logits.device.type == "cuda"
        if stats is None:
            return loss
        ctx.mark_non_differentiable(*stats)
        return loss, *stats

    @staticmethod
    def backward(ctx, grad_loss, *_statistics):
        if ctx.on_gpu and not torch.compiler.is_compiling():
            _target_checks.poll()  # raise for a bad target that this or an earlier call flagged
        grad, gamma_factor = ctx.saved_tensors
        raise_if_create_graph(grad)
        d_logits = scale_saved_gradient(grad, grad_loss, ctx.scale_inplace)
        d_gamma = None
        if gamma_factor is not None and grad_loss is not None:
            d_gamma = gamma_factor * grad_loss.to(gamma_factor.dtype)
        return (d_logits, None, None, d_gamma, None, None, None, None, None, None, None, None, None, None, None, None,
                None, None)


DOUBLE_BACKWARD_MESSAGE = (
    "calibkernels: the fused kernels do not support double backward (create_graph=True: differentiating a gradient "
    "of the loss, e.g. a gradient penalty or a look-ahead step); use backend='reference' for that loss"
)


def raise_if_create_graph(saved: torch.Tensor, message: str = DOUBLE_BACKWARD_MESSAGE) -> None:
    """Raise ``RuntimeError(message)`` in a plain eager backward run with ``create_graph=True`` (grad mode on), since
    the gradient has no graph to differentiate. Not a value whose differentiation raises: autograd runs only the
    nodes on a path to the inputs a ``torch.autograd.grad`` call asks for, and a raising node hanging off a detached
    alias is on no such path, so the second-order term would be left out silently."""
    if torch.is_grad_enabled() and is_plain_eager(saved):
        raise RuntimeError(message)


def _dense_dtype(target: torch.Tensor) -> torch.dtype | None:
    """A dense target's dtype (its device flag names a row, not a class index), ``None`` for class indices."""
    return target.dtype if target.is_floating_point() else None


def _soft_arguments(mix_target=None, mix_lambda=None, label_smoothing=0.0) -> tuple:
    """The soft-target arguments of a backend forward: none at all for hard targets (the backends' defaults)."""
    if mix_target is None and mix_lambda is None and label_smoothing == 0.0:
        return ()
    return mix_target, mix_lambda, label_smoothing


def _option_keywords(inputs: LossInputs) -> tuple:
    """``(keywords, z_rows)``: the drop-in options of a backend forward (class weights, z-loss, soft-capping; none at
    all without them, the backends' defaults), and the ``(N,)`` buffer that receives the rows' z-loss where the call
    returns it (``z_loss_out``), else ``None``."""
    if inputs.class_weight is None and inputs.lse_square_scale == 0.0 and inputs.softcap is None:
        return {}, None
    keywords = {"class_weight": inputs.class_weight, "lse_square_scale": float(inputs.lse_square_scale),
                "softcap": 0.0 if inputs.softcap is None else float(inputs.softcap)}
    z_rows = None
    if inputs.return_z_loss and inputs.lse_square_scale != 0.0:
        logits = inputs.logits
        z_rows = logits.new_empty((logits.shape[0],), dtype=torch.float64 if logits.dtype == torch.float64
                                  else torch.float32)
        keywords["z_loss_out"] = z_rows
    return keywords, z_rows


def _reduced_z_loss(inputs: LossInputs, z_rows) -> torch.Tensor:
    """The z-loss reduced as the loss is (the mean over the non-ignored rows, 0 if none) in the logits' dtype and
    batch shape, from the rows' values (``None``: a zero z-loss scale)."""
    logits = inputs.logits
    if z_rows is None:
        z_rows = torch.zeros(logits.shape[0], dtype=torch.float32, device=logits.device)
    valid = (torch.ones_like(z_rows, dtype=torch.bool) if inputs.dense
             else inputs.target != inputs.ignore_index)
    return reduce_rows(z_rows, valid, inputs.reduction, inputs.batch_shape, logits.dtype)


def _stats_keyword(stats) -> dict:
    """The backend forward's ``stats_out`` keyword: none at all without statistics (the backends' default)."""
    return {} if stats is None else {"stats_out": stats}


def _is_leaf_or_view_of_leaf(tensor: torch.Tensor) -> bool:
    if tensor.is_leaf:
        return True
    base = tensor._base
    return base is not None and base.is_leaf and base.requires_grad


def run(backend_module, inputs: LossInputs, inplace: bool, return_stats: bool = False):
    """The loss of validated ``inputs`` through the fused backend whose module is ``backend_module`` (what
    :func:`calibkernels._backends.module` returns), in the logits' dtype and batch shape: the compiled op with its
    C++ autograd, or the Triton kernels with :class:`UncertaintyWeightedCE`.

    ``return_stats``: ``(loss, LossStats)``, the rows' top-label statistics in the batch shape
    (:func:`calibkernels.loss_stats.top_label_stats`), written by the loss launch itself where the module has
    ``STATS_IN_KERNEL``, else read from the logits before the kernel runs."""
    logits = inputs.logits
    compute_grad = logits.requires_grad and torch.is_grad_enabled()
    gamma = inputs.gamma
    gamma_per_sample = gamma if type(gamma) is not float else None
    if inplace and compute_grad:
        if _is_leaf_or_view_of_leaf(logits):
            raise ValueError(
                "inplace=True overwrites the logits with their gradient, so the logits must be an intermediate "
                "result (e.g. a layer's output), not a leaf tensor that requires grad (or a view of one); "
                "use inplace=False"
            )
        if expanded(logits):
            raise ValueError(
                "inplace=True overwrites the logits with their gradient, but elements of these logits share memory "
                "(e.g. an expanded tensor), so their rows would overwrite each other; use inplace=False (or clone() "
                "them)"
            )
    soft = ()
    if inputs.dense or inputs.mix_target is not None or inputs.label_smoothing != 0.0:
        lam = inputs.mix_lambda
        if lam is not None:
            lam = lambda_tensor(lam, logits.dtype, logits.device)
        soft = (inputs.mix_target, lam, inputs.label_smoothing)
    reduction = REDUCTION_CODES[inputs.reduction]
    codes = (WEIGHT_CODES[inputs.uncertainty], MODE_CODES[inputs.mode], 0.0 if gamma_per_sample is not None else gamma,
             inputs.norm, inputs.ignore_index, reduction)
    inplace = inplace and compute_grad
    flag = None  # the target flag, where this function (not UncertaintyWeightedCE.forward) ran the kernel
    stats = None
    stats_in_kernel = return_stats and getattr(backend_module, "STATS_IN_KERNEL", False)
    if return_stats and not stats_in_kernel:
        stats = loss_stats_of_inputs(inputs)  # before an in-place kernel overwrites the logits
    options, z_rows = _option_keywords(inputs)
    if hasattr(backend_module, "loss_with_autograd"):
        # the compiled op with its own autograd kernel (csrc/uncertainty_weighted_ce_autograd.cpp), eager or traced
        loss, flag, kernel_stats = backend_module.loss_with_autograd(
            logits, inputs.target, inputs.sample_weight, gamma_per_sample, *codes, inplace,
            *(soft or (None, None, 0.0)), return_stats=stats_in_kernel, **options)
        if stats_in_kernel:
            stats = kernel_stats
    elif compute_grad or (gamma_per_sample is not None and gamma_per_sample.requires_grad and torch.is_grad_enabled()):
        # autograd.Function.apply takes positional arguments only: the soft-target defaults spelled out
        loss = UncertaintyWeightedCE.apply(logits, inputs.target, inputs.sample_weight, gamma_per_sample, *codes,
                                           inplace, backend_module, *(soft or (None, None, 0.0)), logits.dtype,
                                           stats_in_kernel, options)
        if stats_in_kernel:
            loss, *stats = loss
    else:
        # no autograd: the kernel skips the gradient entirely (no N×C write)
        buffers = empty_loss_stats(logits.shape[0], logits.device) if stats_in_kernel else None
        loss, _, flag = backend_module.forward(logits, inputs.target, inputs.sample_weight, gamma_per_sample, *codes,
                                               False, None, *soft, loss_dtype=logits.dtype, **_stats_keyword(buffers),
                                               **options)
        if stats_in_kernel:
            stats = buffers
    if flag is not None:
        _target_checks.submit(flag, logits.shape[-1], inputs.ignore_index, _dense_dtype(inputs.target))
    if reduction == _NONE and loss.shape != inputs.batch_shape:
        loss = loss.reshape(inputs.batch_shape)
    loss = loss if loss.dtype == logits.dtype else loss.to(logits.dtype)
    if inputs.return_z_loss:
        loss = (loss, _reduced_z_loss(inputs, z_rows))
    if not return_stats:
        return loss
    if stats_in_kernel:
        stats = LossStats(stats[0].reshape(inputs.batch_shape), stats[1].reshape(inputs.batch_shape))
    return (*loss, stats) if inputs.return_z_loss else (loss, stats)


_NONE = REDUCTION_CODES["none"]
