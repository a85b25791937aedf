"""Benchmarks of calibkernels (not part of the installed package): ``bench/harness.py`` holds the providers, timing,
memory measurement and result writing; ``bench/bench_*.py`` only declare cases and providers. See bench/README.md."""
