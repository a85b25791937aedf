"""Shared test setup.

* Every random draw is seeded: each test with the session seed + hash(test id). The session seed is 0, so a run is
  repeatable; ``CALIBKERNELS_TEST_SEED=<n>`` picks another and ``CALIBKERNELS_TEST_SEED=random`` draws one (a fuzzing
  run). The header prints it so a failure can be replayed exactly.
* Without a GPU, Triton kernels run on CPU tensors through the Triton interpreter; the variable must be set before
  any Triton kernel is defined, hence here, before calibkernels is imported.
* ``backend``: every fused backend of the loss this install can run, each on the device of its tensors (the C++
  kernel on CPU tensors, the CUDA and Triton kernels on CUDA tensors, Triton on CPU tensors under the interpreter
  when there is no GPU); a backend that cannot run here has no parameter. ``backend_or_reference`` adds the
  reference on CPU tensors.
"""

import os
import random
import typing
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import calibkernels as ck  # noqa: E402  (after TRITON_INTERPRET)
from calibkernels import _backends  # noqa: E402

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
    # The backend choices kept from earlier calls: a test that patches what a backend can run asks afresh.
    _backends._chosen.clear()
    _backends._chosen_hard.clear()
    yield
    # A GPU loss's target check that a test left pending (async policy) must not raise in the next test.
    from calibkernels import _target_checks

    _target_checks._pending.clear()



class Backend(typing.NamedTuple):
    """A backend of the loss and the device of the tensors it runs on."""

    name: str
    device: str

    @property
    def interpreted(self):
        """Triton on CPU tensors: the interpreter runs it, slowly, so its tests take small shapes."""
        return self.name == "triton" and self.device == "cpu"

    @property
    def op(self):
        """The backend's compiled op: ``calibkernels::uncertainty_weighted_ce`` (C++ CPU and CUDA) or its Triton
        twin ``calibkernels::uncertainty_weighted_ce_triton``."""
        if self.name == "triton":
            return torch.ops.calibkernels.uncertainty_weighted_ce_triton.default
        import calibkernels.cpp.uncertainty_weighted_ce  # noqa: F401  (registers the op's fake kernel and autograd)

        return torch.ops.calibkernels.uncertainty_weighted_ce.default


_BACKEND_IDS = {("cpu", "cpu"): "cpu", ("cuda", "cuda"): "cuda", ("triton", "cuda"): "triton-cuda",
                ("triton", "cpu"): "triton-interpreter", ("reference", "cpu"): "reference"}


def _fused_backends():
    """Each fused backend in ``ck.available_backends()`` with the device of its tensors, where it runs there."""
    devices = {"cpu": "cpu", "cuda": "cuda", "triton": "cuda" if torch.cuda.is_available() else "cpu"}
    pairs = [Backend(name, devices[name]) for name in ck.available_backends() if name != "reference"]
    return [pair for pair in pairs if _backends.unavailable_reason(pair.name, torch.device(pair.device)) is None]


FUSED_BACKENDS = _fused_backends()


@pytest.fixture(params=FUSED_BACKENDS, ids=lambda pair: _BACKEND_IDS[tuple(pair)])
def backend(request):
    """A fused backend this machine runs (``.name``, ``.device``; ``.interpreted`` for Triton's interpreter)."""
    return request.param


@pytest.fixture(params=[Backend("reference", "cpu")] + FUSED_BACKENDS, ids=lambda pair: _BACKEND_IDS[tuple(pair)])
def backend_or_reference(request):
    """As ``backend``, and the reference on CPU tensors (which checks a test's harness against float64 too)."""
    return request.param
