// Shared contract of the fused uncertainty-weighted cross-entropy op (SPEC §2, §8).
//
// The schema is declared once, in csrc/calibkernels.cpp (TORCH_LIBRARY); each device registers its kernel with
// TORCH_LIBRARY_IMPL in csrc/<device>/uncertainty_weighted_ce.*. The integer codes mirror
// calibkernels/_validation.py (WEIGHT_CODES, MODE_CODES, REDUCTION_CODES) and must stay in sync with it.
//
//   calibkernels::uncertainty_weighted_ce(
//       Tensor logits (N, C) float32/float16/bfloat16 (float64 for gradcheck), any row stride,
//       Tensor target (N,) int64, values in [0, C) or ignore_index,
//       Tensor? sample_weight (N,) float (weight == External; used detached),
//       Tensor? gamma_per_sample (N,) float (weight == Focal only; overrides gamma; never differentiated),
//       int weight, int loss_mode, float gamma, float norm, int ignore_index, int reduction, bool compute_grad)
//     -> (Tensor loss, Tensor grad)
//
//   loss: float32 (float64 for float64 logits); 0-dim for reduction mean/sum (mean over non-ignored rows, 0 if none), (N,) for none.
//   grad: the gradient of `loss` w.r.t. logits for grad_output = 1 (so already divided by the number of
//         non-ignored rows for mean), in the logits' dtype, contiguous (N, C); ignored rows are 0.
//         Shape (0,) when compute_grad is false (inference: no N x C write).
//
//   calibkernels::uncertainty_weighted_ce_inplace_(Tensor(a!) logits, <same arguments, no compute_grad>) -> Tensor
//     Same loss; the gradient overwrites the logits buffer (zero extra memory).
#pragma once

#include <cstdint>

namespace calibkernels {

enum class Weight : int64_t { None = 0, Focal = 1, Flsd = 2, DualFocal = 3, Brier = 4, External = 5 };
enum class Mode : int64_t { Loss = 0, Grad = 1 };
// Same numbering as at::Reduction.
enum class Reduction : int64_t { None = 0, Mean = 1, Sum = 2 };

// FLSD-53 schedule (Mukhoti et al. 2020): gamma_i = 5 if p_y < 0.2, 3 if p_y < 0.5, else `gamma`.
constexpr double kFlsdLowThreshold = 0.2;
constexpr double kFlsdLowGamma = 5.0;
constexpr double kFlsdMidThreshold = 0.5;
constexpr double kFlsdMidGamma = 3.0;

}  // namespace calibkernels
