"""Helpers shared by the bench's tests (tests/test_bench_*.py)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def interrupted_after_one_call(timer):
    """``timer`` that runs once, then raises ``KeyboardInterrupt`` as a wall-clock limit's SIGINT would."""
    calls = []

    def timed_once(*args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            raise KeyboardInterrupt
        return timer(*args, **kwargs)

    return timed_once


def assert_prints_help(module: str) -> None:
    """``python -m <module> --help`` ends well and prints a usage (the GPU tools, also on a machine without a GPU)."""
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT,
                          timeout=300)
    assert proc.returncode == 0 and "usage:" in proc.stdout, proc.stdout + proc.stderr
