"""``bench.harness``, the loss bench's harness in one import: every name it exports is the object of the module that
defines it (bench/cases.py, providers.py, timing.py, measure.py, machine.py, tables.py, history.py, cli.py)."""

import importlib
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench import harness  # noqa: E402

MODULES = ("cases", "providers", "timing", "measure", "machine", "tables", "history", "cli")


def test_the_harness_exports_the_objects_of_its_modules():
    modules = [importlib.import_module(f"bench.{name}") for name in MODULES]
    for name in harness.__all__:
        owners = [module for module in modules if name in vars(module)]
        assert owners, f"{name} is defined in none of the harness's modules"
        assert all(getattr(module, name) is getattr(harness, name) for module in owners), name
