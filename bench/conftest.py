"""pytest configuration of the benchmarks: collect ``bench_*.py`` (pytest's default only collects ``test_*.py``).

Run ``pytest bench/ --benchmark-only`` without ``-n``: pytest-benchmark disables itself under xdist.
"""

import pytest


def pytest_collect_file(file_path, parent):
    if file_path.suffix == ".py" and file_path.name.startswith("bench_"):
        return pytest.Module.from_parent(parent, path=file_path)
    return None
