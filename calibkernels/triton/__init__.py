"""Triton GPU kernels (run on CPU tensors under TRITON_INTERPRET=1 for testing)."""
