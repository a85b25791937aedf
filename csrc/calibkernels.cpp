// Op schemas of calibkernels, declared once for every device (see uncertainty_weighted_ce.h for the contract).
// The device kernels register themselves in csrc/cpu/ and csrc/cuda/, the autograd kernel (eager and traced calls)
// in csrc/uncertainty_weighted_ce_autograd.cpp; the fake (meta) kernel is registered from Python, next to the typed
// wrapper in calibkernels/cpp/.
#include <Python.h>
#include <torch/library.h>

#include <limits>
#include <string>
#include <tuple>

#include "uncertainty_weighted_ce.h"

// Importing calibkernels._C loads this library, which runs the registrations below (the pytorch/extension-cpp
// pattern: no pybind11, no module functions; everything is reached through torch.ops.calibkernels).
namespace {
#ifdef CALIBKERNELS_WITH_CUDA
// calibkernels::cuda_kernels_probe(device) -> (CUDA status as an int, its name); 0 where the kernels run
std::tuple<int64_t, std::string> cuda_kernels_probe(int64_t device) {
  TORCH_CHECK_VALUE(device >= 0 && device <= std::numeric_limits<int>::max(), "cuda_kernels_probe: no CUDA device ",
                    device);
  const auto [status, name] = calibkernels::cuda_kernels_probe(static_cast<int>(device));
  return {status, name};
}
#endif
}  // namespace

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, nullptr};
  PyObject* module = PyModule_Create(&module_def);
  // calibkernels._C.WITH_CUDA: whether this build compiled csrc/cuda/ (tests check it against the registrations);
  // calibkernels._C.CPU_ISA: the CPU kernel's vector instruction set in this process (see cpu_vector_isa).
#ifdef CALIBKERNELS_WITH_CUDA
  constexpr long kWithCuda = 1;
#else
  constexpr long kWithCuda = 0;
#endif
  if (module != nullptr && (PyModule_AddIntConstant(module, "WITH_CUDA", kWithCuda) != 0 ||
                            PyModule_AddStringConstant(module, "CPU_ISA", calibkernels::cpu_vector_isa()) != 0)) {
    Py_DECREF(module);
    return nullptr;
  }
  return module;
}
}

TORCH_LIBRARY(calibkernels, m) {
  // One op for both ways of returning the gradient: out of place (grad_out None: a fresh buffer is returned) or into
  // a caller's buffer (grad_out given, e.g. the logits themselves for inplace=True; an empty tensor is returned).
  // Soft targets (label smoothing, a mix, a dense target) are arguments of the same op. The third output is the
  // device-side target flag of the GPU kernels, which never raise on a bad target value (uncertainty_weighted_ce.h).
  // loss_in_logits_dtype: the loss in the logits' dtype, written so by the kernel (an eager step's loss then costs no
  // cast launch); float32 (float64) otherwise. return_stats: the fourth and fifth outputs are the logits' top-label
  // statistics (confidence float32, prediction int64, (N,) each), computed in the CPU kernel's loss pass (on CUDA in
  // the row kernels' first pass); empty (0,) otherwise. class_weight, lse_square_scale, softcap: F.cross_entropy's
  // per-class weights, Liger-Kernel's z-loss and Gemma-2's logit soft-capping (0 is off); the sixth output is the
  // rows' z-loss where lse_square_scale is not 0.
  m.def(
      "uncertainty_weighted_ce(Tensor logits, Tensor target, Tensor? sample_weight, Tensor? gamma_per_sample, "
      "int weight, int loss_mode, float gamma, float norm, int ignore_index, int reduction, bool compute_grad, "
      "Tensor(a!)? grad_out, Tensor? mix_target=None, Tensor? mix_lambda=None, float label_smoothing=0.0, "
      "bool loss_in_logits_dtype=False, bool return_stats=False, Tensor? class_weight=None, "
      "float lse_square_scale=0.0, float softcap=0.0) -> (Tensor, Tensor, Tensor, Tensor, Tensor, Tensor)");
  // The backward on CUDA tensors in eager mode: grad *= grad_output (0-dim, or (N,) per row), in place, without
  // reading grad_output on the host.
  m.def("uncertainty_weighted_ce_scale_grad_(Tensor(a!) grad, Tensor grad_output) -> ()");
  // Frees the CPU op's kept gradient buffers (csrc/cpu/gradient_buffer_cache.h); returns the bytes freed. No tensor
  // argument, so one kernel for every dispatch key.
  m.def("release_cpu_gradient_cache() -> int", &calibkernels::release_cpu_gradient_cache);
#ifdef CALIBKERNELS_WITH_CUDA
  // The CUDA status of querying one of this build's kernels on a device (0, cudaSuccess, where they run):
  // backend="auto" must not pick a kernel the build holds no code for.
  m.def("cuda_kernels_probe(int device) -> (int, str)", &cuda_kernels_probe);
#endif
}
