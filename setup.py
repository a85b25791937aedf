"""Build of calibkernels' compiled extension ``calibkernels._C`` (metadata lives in pyproject.toml).

Install without build isolation, after torch, so the extension is compiled against the torch you run:

    pip install torch==2.14.1 && pip install --no-build-isolation -e .

Build flags (all prefixed, printed at build time):

    CALIBKERNELS_SKIP_EXT=1        build no extension (pure-Python install; the reference backend still works)
    CALIBKERNELS_FORCE_CUDA=1      build the CUDA kernels even if no CUDA toolkit is detected (fails without nvcc)
    CALIBKERNELS_NO_CUDA=1         never build the CUDA kernels
    CALIBKERNELS_CUDA_ARCHS="8.0;9.0"  compute capabilities to compile for (default sm_80 and sm_90)
    CALIBKERNELS_CPU_ARCH=...      -march for every C++ file (default: none, so the extension runs on any CPU of the
                                   architecture; the CPU kernel's AVX2 and AVX-512 paths are chosen at run time)
    CALIBKERNELS_DEBUG=1           -O0 -g, no NDEBUG
    MAX_JOBS=N                     parallel compile jobs (honoured by torch's ninja build)
"""

import glob
import os

from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def _flag(name, default=""):
    return os.environ.get(name, default)


def _truthy(name):
    return _flag(name).lower() in ("1", "true", "yes", "on")


def _extensions():
    if _truthy("CALIBKERNELS_SKIP_EXT"):
        print("calibkernels: CALIBKERNELS_SKIP_EXT=1, building no extension")
        return [], {}
    # torch guesses CUDA_HOME from `which nvcc`, which can be a wrapper outside the toolkit; the standard toolkit
    # location wins unless the user set CUDA_HOME.
    if "CUDA_HOME" not in os.environ and "CUDA_PATH" not in os.environ and os.path.exists("/usr/local/cuda/bin/nvcc"):
        os.environ["CUDA_HOME"] = "/usr/local/cuda"
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError as error:
        # pip's default build isolation builds in a fresh environment without the user's torch (and torch is not a
        # build requirement on purpose: the extension must be compiled against the torch it will run with).
        raise SystemExit(
            f"calibkernels: building the C++/CUDA extension needs PyTorch ({error}); run `pip install torch` first, "
            "then `pip install --no-build-isolation .` (or set CALIBKERNELS_SKIP_EXT=1 for a pure-Python install)."
        ) from None

    debug = _truthy("CALIBKERNELS_DEBUG")
    cpu_arch = _flag("CALIBKERNELS_CPU_ARCH", "")
    cuda_archs = _flag("CALIBKERNELS_CUDA_ARCHS", "8.0;9.0")
    cuda_home = cpp_extension.CUDA_HOME
    nvcc_found = cuda_home is not None and os.path.exists(os.path.join(cuda_home, "bin", "nvcc"))
    with_cuda = not _truthy("CALIBKERNELS_NO_CUDA") and (_truthy("CALIBKERNELS_FORCE_CUDA") or nvcc_found)
    if with_cuda and torch.version.cuda is None:
        raise RuntimeError("calibkernels: CUDA kernels requested but this torch is a CPU-only build")

    rel = lambda pattern: sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, pattern)))
    # csrc/cpu/kernel_default.cpp and kernel_avx2.cpp: the CPU kernel for the baseline and for AVX2 (the latter
    # compiled for AVX2 by a pragma; see that file for why it shares no out-of-line code with the others).
    kernels = [os.path.join("csrc", "cpu", "kernel_default.cpp"), os.path.join("csrc", "cpu", "kernel_avx2.cpp")]
    sources = [p for p in rel("csrc/*.cpp") + rel("csrc/cpu/*.cpp") if p not in kernels] + kernels
    cuda_sources = rel("csrc/cuda/*.cu") + rel("csrc/cuda/*.cpp")

    cxx = ["-O0", "-g"] if debug else ["-O3", "-DNDEBUG"]
    cxx.append("-fopenmp")  # the C++ standard is torch's own (C++20 for torch 2.14)
    if cpu_arch:
        cxx.append(f"-march={cpu_arch}")
    # No --use_fast_math: it swaps logf/expf/powf/log1pf for approximate intrinsics and flushes denormals, which the
    # CUDA kernel's log1p (CE of confident rows) and tiny 1 - p_y values depend on; the kernel calls exp2f itself.
    nvcc = ["-O0", "-g", "-G"] if debug else ["-O3", "-DNDEBUG", "-lineinfo"]
    nvcc.append("--expt-relaxed-constexpr")
    define_macros = []
    if with_cuda:
        os.environ["TORCH_CUDA_ARCH_LIST"] = cuda_archs
        define_macros.append(("CALIBKERNELS_WITH_CUDA", None))
        sources = cuda_sources + sources

    print("calibkernels build flags:")
    print(f"  CALIBKERNELS_DEBUG={int(debug)}  CALIBKERNELS_CPU_ARCH={cpu_arch!r}")
    print(f"  CUDA kernels: {'yes' if with_cuda else 'no'} (CUDA_HOME={cuda_home}, nvcc found: {nvcc_found}, "
          f"CALIBKERNELS_FORCE_CUDA={_flag('CALIBKERNELS_FORCE_CUDA', '0')}, "
          f"CALIBKERNELS_NO_CUDA={_flag('CALIBKERNELS_NO_CUDA', '0')})")
    if with_cuda:
        print(f"  CALIBKERNELS_CUDA_ARCHS={cuda_archs!r}")
    print(f"  MAX_JOBS={_flag('MAX_JOBS', '(torch default)')}")
    print(f"  sources: {', '.join(sources)}")

    extension = cpp_extension.CUDAExtension if with_cuda else cpp_extension.CppExtension
    ext = extension(
        name="calibkernels._C",
        sources=sources,
        include_dirs=[os.path.join(ROOT, "csrc")],
        define_macros=define_macros,
        extra_compile_args={"cxx": cxx, "nvcc": nvcc} if with_cuda else {"cxx": cxx},
        extra_link_args=["-fopenmp"],
    )
    return [ext], {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = _extensions()
setup(ext_modules=ext_modules, cmdclass=cmdclass)
