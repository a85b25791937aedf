// Op schemas of calibkernels, declared once for every device (see uncertainty_weighted_ce.h for the contract).
// The device kernels register themselves in csrc/cpu/ and csrc/cuda/, the eager autograd kernel in
// csrc/uncertainty_weighted_ce_autograd.cpp; the fake (meta) kernel is registered from Python, next to the typed
// wrapper in calibkernels/cpp/, and traced code uses the autograd of calibkernels/_autograd.py.
#include <Python.h>
#include <torch/library.h>

#include <exception>
#include <limits>
#include <utility>

#include "uncertainty_weighted_ce.h"

// Importing calibkernels._C loads this library, which runs the registrations below (the pytorch/extension-cpp
// pattern: no pybind11, ops reached through torch.ops.calibkernels); the module holds a few plain functions.
namespace {
// calibkernels._C.release_cpu_gradient_cache(): a module function rather than an op, since it takes no tensor.
PyObject* release_cpu_gradient_cache(PyObject*, PyObject*) {
  return PyLong_FromLongLong(static_cast<long long>(calibkernels::release_cpu_gradient_cache()));
}

#ifdef CALIBKERNELS_WITH_CUDA
// calibkernels._C.cuda_kernels_probe(device_index) -> (CUDA status as an int, its name); 0 where the kernels run
PyObject* cuda_kernels_probe(PyObject*, PyObject* arg) {
  const long device = PyLong_AsLong(arg);
  if (device == -1 && PyErr_Occurred()) return nullptr;
  if (device < 0 || device > std::numeric_limits<int>::max()) {
    PyErr_Format(PyExc_ValueError, "cuda_kernels_probe: no CUDA device %ld", device);
    return nullptr;
  }
  try {  // a C++ exception must not cross into the interpreter (it would terminate the process)
    const auto [status, name] = calibkernels::cuda_kernels_probe(static_cast<int>(device));
    return Py_BuildValue("(is)", status, name);
  } catch (const std::exception& error) {
    PyErr_SetString(PyExc_RuntimeError, error.what());
    return nullptr;
  }
}
#endif

PyMethodDef methods[] = {
    {"release_cpu_gradient_cache", release_cpu_gradient_cache, METH_NOARGS,
     "Free the CPU op's kept gradient buffers; return the bytes freed."},
    {"eager_loss", calibkernels::eager_loss, METH_VARARGS,
     "eager_loss(logits, target, weight, mode, gamma, norm, ignore_index, reduction[, mix_target, mix_lambda, "
     "label_smoothing, inplace]): the fused loss of an eager call without per-sample tensors, in the logits' dtype "
     "(csrc/uncertainty_weighted_ce_autograd.cpp)."},
#ifdef CALIBKERNELS_WITH_CUDA
    {"cuda_kernels_probe", cuda_kernels_probe, METH_O,
     "cuda_kernels_probe(device_index) -> (status, name): the CUDA status of querying one of this build's kernels "
     "on that device (0, cudaSuccess, where they run)."},
#endif
    {nullptr, nullptr, 0, nullptr}};
}  // namespace

extern "C" {
PyObject* PyInit__C(void) {
  static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "_C", nullptr, -1, methods};
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
  // cast launch); float32 (float64) otherwise.
  m.def(
      "uncertainty_weighted_ce(Tensor logits, Tensor target, Tensor? sample_weight, Tensor? gamma_per_sample, "
      "int weight, int loss_mode, float gamma, float norm, int ignore_index, int reduction, bool compute_grad, "
      "Tensor(a!)? grad_out, Tensor? mix_target=None, Tensor? mix_lambda=None, float label_smoothing=0.0, "
      "bool loss_in_logits_dtype=False) -> (Tensor, Tensor, Tensor)");
  // The backward on CUDA tensors in eager mode: grad *= grad_output (0-dim, or (N,) per row), in place, without
  // reading grad_output on the host.
  m.def("uncertainty_weighted_ce_scale_grad_(Tensor(a!) grad, Tensor grad_output) -> ()");
}
