"""Python side of the compiled (C++/CUDA) kernels in csrc/: typed wrappers, fake kernels, autograd."""
