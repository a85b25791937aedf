"""Every argument check of the package, with its message, in one place (the device-flag queue that the GPU checks
feed is :mod:`calibkernels._target_checks`, which imports nothing from here):

* :mod:`.arguments`: choices, numbers, per-sample tensors, targets, soft targets, the drop-in options;
* :mod:`.loss_inputs`: the loss call's checks gathered into :class:`LossInputs` (:func:`check_loss_inputs`);
* :mod:`.metric_inputs`: the metrics' inputs (logits or probabilities, labels, bins);
* :mod:`.fused_linear`: the fused linear loss's tensors and backend choice (imported from there, not re-exported
  here: it needs the backends, which need these checks).

The names below are the package's own re-exports of the first two.
"""

from .._kernel_codes import BACKENDS, MODE_CODES, REDUCTION_CODES, WEIGHT_CODES
from .._target_checks import DENSE_ROW_SUM_TOLERANCE, dense_row_sum_tolerance, is_plain_eager
from .arguments import (INT64_MAX, INT64_MIN, check_backend, check_class_weight, check_class_weight_tensor,
                        check_dense_target, check_drop_in_options, check_gamma, check_ignore_index,
                        check_label_smoothing, check_logits_target, check_mix, check_mode, check_norm, check_number,
                        check_per_sample_gamma, check_reduction, check_sample_weight, check_scalar_gamma,
                        check_target_values, check_uncertainty, class_weight_message, dense_row_sums, dense_target_flag,
                        device_target_flag, drop_in_option_names, expanded, finite_nonnegative_flag, first_flagged_row,
                        is_number, lambda_flag, lambda_tensor, mix_target_flag, out_of_range_targets,
                        soft_target_request, target_flag)
from .loss_inputs import (DUAL_FOCAL_SOFT_MESSAGE, LossInputs, check_loss_inputs, one_hot_for_dual_focal)

__all__ = ["BACKENDS", "DENSE_ROW_SUM_TOLERANCE", "DUAL_FOCAL_SOFT_MESSAGE", "INT64_MAX", "INT64_MIN", "LossInputs",
           "MODE_CODES", "REDUCTION_CODES", "WEIGHT_CODES", "check_backend", "check_class_weight",
           "check_class_weight_tensor", "check_dense_target", "check_drop_in_options", "check_gamma",
           "check_ignore_index", "check_label_smoothing", "check_logits_target", "check_loss_inputs", "check_mix",
           "check_mode", "check_norm", "check_number", "check_per_sample_gamma", "check_reduction",
           "check_sample_weight", "check_scalar_gamma", "check_target_values", "check_uncertainty",
           "class_weight_message", "dense_row_sum_tolerance", "dense_row_sums", "dense_target_flag",
           "device_target_flag", "drop_in_option_names", "expanded", "finite_nonnegative_flag", "first_flagged_row",
           "is_number", "is_plain_eager", "lambda_flag", "lambda_tensor", "mix_target_flag", "one_hot_for_dual_focal",
           "out_of_range_targets", "soft_target_request", "target_flag"]
