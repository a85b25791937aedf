"""Benchmarks of calibkernels (not part of the installed package). ``bench/harness.py`` names the harness's modules
(cases, providers, timing, measurement, result files, command line) and re-exports them; ``bench/bench_*.py`` only
declare cases and providers. See bench/README.md."""
