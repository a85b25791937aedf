"""Bad targets and values on the GPU: how device-side flags become Python errors without a host synchronisation.

The GPU kernels (Triton and CUDA C++) never use an out-of-range target as an index: such a row's loss and gradient
are NaN (so a mean or sum is NaN too), and a two-slot int64 device flag ``(code, value)``, made by the launch that
counts the mean's divisor and returned by the op as its third output, records it: code 1 for a bad target (the value:
the largest bad one). The same scan checks a mix (``mix_target`` and a ``mix_lambda`` tensor; a bad mix row is NaN
too): code 2 for a ``mix_target`` that is not a class index on a non-ignored row (the first such row's value), 3 for
a ``mix_lambda`` outside [0, 1] or NaN; 0 when all is well (:data:`calibkernels._kernel_codes.TARGET_FLAG_CODES`).
A dense target's values (entries >= 0, rows summing to 1) are checked the same way: the Triton and CUDA kernels flag
the rows in their own reads of the target (device reductions, :func:`calibkernels._validation.dense_target_flag`,
where the kernels' float32 sums cannot decide), and the flag is ``(any bad row, the first bad row)``; those rows are
computed from the target as given.
Reading that flag on the host is a synchronisation, which would stall the CPU once per call, so the policy is set by
the environment variable ``CALIBKERNELS_VALIDATE`` (read at import; :data:`POLICY` may be changed at run time):

* ``async`` (default): no synchronisation. The flag is copied to pinned host memory on the stream and checked as
  soon as the copy has landed, without waiting: at the backward of the same loss, or at the next call of any
  calibkernels GPU loss, whichever first finds it done. The ``ValueError`` then names the bad value (it can come
  one training step late; the loss of the bad step is already NaN). :func:`synchronize_target_checks` waits for
  every pending check and raises, e.g. at the end of an epoch or in tests.
* ``sync``: read the flag back right after the kernel and raise at once (one host synchronisation per call).
* ``0`` (or ``off``): never read the flag; bad rows stay NaN.

The same queue carries the value checks that no kernel makes, of the optional tensors: on the GPU path
(``check_values=False`` in :mod:`calibkernels._validation`) each is a few device ops to a flag ``(any bad, a value)``,
handed to :func:`submit_check` with the function that writes the host check's message from the value:

* ``sample_weight`` and a per-sample ``gamma``: finite and ``>= 0`` (the flag's value: the first bad row);
* ``mix_target`` and a ``mix_lambda`` tensor where no kernel reads them (the dual-focal weight, whose soft targets
  become class indices first; a GPU call of the reference): the checks the kernels' scan makes, as device ops.

A number ``mix_lambda`` is checked on the host, where it is.

So a GPU call reads none of these values on the host, nor its class-index targets (the kernels flag those). Their
errors come as a target's do (that call's loss is wrong or NaN: a bad mix row is NaN). The host checks
(``check_values=True``: the reference, CPU tensors) raise at once instead.

While a CUDA graph is being captured, under ``torch.compile`` and (for the value checks) under a dispatch mode such as
FakeTensor, no check is queued (the NaN rows stay). On CPU tensors (the Triton interpreter) the flag is read at once:
there is no device to stall.
"""

from __future__ import annotations

import collections
import os
import threading

import torch

from ._kernel_codes import TARGET_FLAG_CODES

__all__ = ["POLICY", "submit", "submit_check", "checking", "poll", "synchronize_target_checks"]

# Row sums of a dense probability target must be 1 within this tolerance, per target dtype: a few roundings of each
# entry plus the producer's own arithmetic (timm's Mixup builds its targets in float32).
DENSE_ROW_SUM_TOLERANCE = {torch.float64: 1e-6, torch.float32: 1e-4, torch.float16: 1e-2, torch.bfloat16: 2e-2}


def dense_row_sum_tolerance(dtype: torch.dtype) -> float:
    """How far a dense target's row may sum from 1 in ``dtype`` (:data:`DENSE_ROW_SUM_TOLERANCE`)."""
    return DENSE_ROW_SUM_TOLERANCE.get(dtype, 1e-4)


# The ValueError texts of the checks, one per check, the same whether the host reads the values at once
# (calibkernels._validation) or a device flag is read here later: every backend raises the same error.
def out_of_range_message(value: int, num_classes: int, ignore_index: int) -> str:
    """The ``ValueError`` text for an out-of-range target, the same from every backend."""
    return (f"target value {value} is out of range for {num_classes} classes "
            f"(valid: 0..{num_classes - 1}, or ignore_index={ignore_index})")


def mix_target_message(value: int, num_classes: int, ignore_index: int) -> str:
    """The ``ValueError`` text for a ``mix_target`` value that is not a class index on a row whose target is not
    ``ignore_index``, from the host check and the queued one alike."""
    why = " (it is ignore_index, but the row's target is not ignored)" if value == ignore_index else ""
    return (f"mix_target value {value} is out of range for {num_classes} classes "
            f"(valid: 0..{num_classes - 1} on every row whose target is not ignore_index){why}")


def lambda_message(_index=None) -> str:
    return "mix_lambda must be in [0, 1] everywhere (NaN is refused)"


def sample_weight_message(_index=None) -> str:
    return "sample_weight must be finite and >= 0 everywhere (it scales each row's loss and gradient)"


def gamma_message(_index=None) -> str:
    return "per-sample gamma must be finite and >= 0 everywhere"


def dense_target_message(row: int, dtype: torch.dtype) -> str:
    """The ``ValueError`` text for a dense target row that a device check flagged
    (:func:`calibkernels._validation.dense_target_flag`)."""
    tolerance = dense_row_sum_tolerance(dtype)
    return (f"every row of a dense target must be finite and >= 0 and sum to 1 (within {tolerance:g} for {dtype}); "
            f"row {row} is not")


_POLICIES = {"async": "async", "1": "async", "sync": "sync", "0": "off", "off": "off"}
POLICY = _POLICIES.get(os.environ.get("CALIBKERNELS_VALIDATE", "async").strip().lower(), "async")

# (event, pinned host copy of the flag, device index, what), oldest first; what: (number of classes, ignore_index,
# dense target dtype) of a target's flag (submit), or the message function of a value check (submit_check)
_pending: collections.deque = collections.deque()
# device index -> [(event, pinned two-slot buffer)] of checks already read: submit reuses them, since a pinned
# allocation and a new event cost host time on every training step
_spare: dict = {}
# several threads may run losses (one per device): the queue and the buffers are shared
_lock = threading.Lock()


def _raise(flag, what, late: bool) -> None:
    has_bad, bad_value = (int(v) for v in flag)
    if has_bad:
        if callable(what):  # a value check's message function (submit_check)
            raise ValueError(what(bad_value) + (" (in an earlier call)" if late else ""))
        num_classes, ignore_index, dense_dtype = what
        if dense_dtype is None:  # class indices: the flag's code says what was bad (TARGET_FLAG_CODES)
            when = " (in an earlier call; that loss and its gradient rows are NaN)" if late else ""
            if has_bad == TARGET_FLAG_CODES["mix_target"]:
                raise ValueError(mix_target_message(bad_value, num_classes, ignore_index) + when)
            if has_bad == TARGET_FLAG_CODES["mix_lambda"]:
                raise ValueError(lambda_message() + when)
            raise ValueError(out_of_range_message(bad_value, num_classes, ignore_index) + when)
        when = " (in an earlier call)" if late else ""
        raise ValueError(dense_target_message(bad_value, dense_dtype) + when)


def is_plain_eager(*tensors: torch.Tensor) -> bool:
    """True outside any tracer (Dynamo, make_fx/AOTAutograd, FakeTensor mode) when every tensor given is a plain
    ``torch.Tensor`` (no subclass): the calls whose device flags this module reads."""
    return (not torch.compiler.is_compiling() and torch._C._len_torch_dispatch_stack() == 0
            and all(type(t) is torch.Tensor for t in tensors))


def checking(tensor: torch.Tensor) -> bool:
    """Whether a flag of ``tensor``'s values handed to :func:`submit_check` now would be read: the policy is not
    ``off`` and nothing traces the call (``torch.compile``, a dispatch mode, a CUDA graph capture). Asked before the
    flag is computed, so that no device op runs for a flag nobody reads."""
    return (POLICY != "off" and is_plain_eager(tensor)
            and not (tensor.is_cuda and torch.cuda.is_current_stream_capturing()))


def submit(error: torch.Tensor, num_classes: int, ignore_index: int, dense_dtype: torch.dtype | None = None) -> None:
    """Hand over a kernel's ``(any bad, bad value)`` device flag according to :data:`POLICY`; ``dense_dtype``: the
    flag is a dense target's ``(any bad row, a bad row)`` (:func:`calibkernels._validation.dense_target_flag`)."""
    _submit(error, (num_classes, ignore_index, dense_dtype))


def submit_check(flag: torch.Tensor, message) -> None:
    """Hand over a value check's ``(2,)`` int64 device flag ``(any bad, a value)`` according to :data:`POLICY`;
    ``message(value) -> str`` writes the ``ValueError``'s text (the host check's, so both raise the same error).
    Flags are read in the order they were handed over, targets' and values' alike."""
    _submit(flag, message)


def _submit(error: torch.Tensor, what) -> None:
    if POLICY == "off" or torch.compiler.is_compiling():
        return
    if error.device.type != "cuda":
        _raise(error.tolist(), what, late=False)
        return
    if torch.cuda.is_current_stream_capturing():
        return
    if POLICY == "sync":
        _raise(error.tolist(), what, late=False)
        return
    index = error.device.index
    with _lock:
        spare = _spare.get(index)
        if spare:
            event, host = spare.pop()
        else:  # an event belongs to the device it is first recorded on
            event, host = torch.cuda.Event(), torch.empty(2, dtype=torch.int64, pin_memory=True)
        host.copy_(error, non_blocking=True)  # on the flag's device's current stream, where the event goes too
        event.record(torch.cuda.current_stream(error.device))
        _pending.append((event, host, index, what))


def _read_oldest() -> tuple:
    """Take the oldest pending check (its copy has landed), return its buffers for reuse; ``(flag, what)``. Called
    with the lock held."""
    event, host, index, what = _pending.popleft()
    flag = host.tolist()
    _spare.setdefault(index, []).append((event, host))
    return flag, what


def poll() -> None:
    """Raise for the first finished check that saw a bad target or value; never waits for the device."""
    while True:
        with _lock:
            # an event query is not allowed while the current stream is being captured into a CUDA graph
            if not _pending or torch.cuda.is_current_stream_capturing() or not _pending[0][0].query():
                return
            flag, what = _read_oldest()
        _raise(flag, what, late=True)


def synchronize_target_checks() -> None:
    """Wait for every pending check of the GPU losses (targets, and the values of :func:`submit_check`) and raise
    ``ValueError`` for the first that saw a bad one."""
    while True:
        with _lock:
            if not _pending:
                return
            _pending[0][0].synchronize()
            flag, what = _read_oldest()
        _raise(flag, what, late=True)
