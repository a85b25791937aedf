"""Shared test setup.

* Every random draw is seeded: each test with the session seed + hash(test id). The session seed is 0, so a run is
  repeatable; ``CALIBKERNELS_TEST_SEED=<n>`` picks another and ``CALIBKERNELS_TEST_SEED=random`` draws one (a fuzzing
  run). The header prints it so a failure can be replayed exactly.
* Without a GPU, Triton kernels run on CPU tensors through the Triton interpreter; the variable must be set before
  any Triton kernel is defined, hence here, before calibkernels is imported.
"""

import os
import random
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

_SEED_SETTING = os.environ.get("CALIBKERNELS_TEST_SEED", "0")
SESSION_SEED = random.SystemRandom().randrange(2**31) if _SEED_SETTING == "random" else int(_SEED_SETTING)


def pytest_report_header(config):
    return f"calibkernels test seed: {SESSION_SEED} (replay with CALIBKERNELS_TEST_SEED={SESSION_SEED})"


@pytest.fixture(autouse=True)
def _seed_each_test(request):
    seed = (SESSION_SEED + zlib.crc32(request.node.nodeid.encode())) % 2**31
    torch.manual_seed(seed)
    random.seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass
    yield
    # A GPU loss's target check that a test left pending (async policy) must not raise in the next test.
    from calibkernels import _target_checks

    _target_checks._pending.clear()

