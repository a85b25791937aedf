"""Shared test setup.

* Random inputs are drawn fresh on every run: the session seed is random unless ``CALIBKERNELS_TEST_SEED`` is set, and
  it is printed in the header so a failure can be replayed exactly (each test is seeded with seed + hash(test id)).
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

SESSION_SEED = int(os.environ.get("CALIBKERNELS_TEST_SEED", random.SystemRandom().randrange(2**31)))


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

