"""The benchmark harness of calibkernels, in one import: ``from bench.harness import Case, Suite, PROVIDERS, main``.

What is measured: one **training step of the loss**, forward + backward, for logits ``(N, C)`` and targets (class
indices or a soft form), i.e. ``loss = f(logits, target); loss.backward()``, until the gradient sits in
``leaf.grad``, with the same rules for every provider. The harness is split by what each part holds; this module
re-exports their public names:

* :mod:`bench.cases`: cases, suites, target kinds and the inputs of a case;
* :mod:`bench.providers`: the providers (ours, the reference, ``torch.compile`` of it), whether each can run a case
  here, the correctness check against the float64 reference; :mod:`bench.competitors`: the other libraries' losses
  (``F.cross_entropy``, Liger-Kernel);
* :mod:`bench.timing`: the timing loops (timed steps, host steps, plain calls) and the peak-memory measurement, with
  the fairness rules in its docstring;
* :mod:`bench.measure`: one case's providers and target kinds measured together, whole runs, their results;
* :mod:`bench.machine`: what a run measured on (machine, versions, commit);
* :mod:`bench.tables`: the Markdown tables; :mod:`bench.history`: the result files and ``history.jsonl``;
* :mod:`bench.cli`: the command line and the pytest-benchmark body.

Bench files (``bench/bench_*.py``) only declare suites (cases × providers) and call :func:`main` or
:func:`run_pytest_benchmark`. bench/README.md describes the method, the commands and the result files.
"""

from bench.cases import DTYPES, TARGET_KINDS, Case, SoftTarget, Suite, host_case_id, make_inputs, soft_target
from bench.cli import main, run_pytest_benchmark
from bench.history import (
    HISTORY_FIELDS,
    HISTORY_FIELDS_V1,
    RESULTS_DIR,
    add_output_arguments,
    append_history,
    history_row,
    history_rows,
    output_history,
    publish,
    result_stem,
    write_json,
)
from bench.machine import GIT_DIRTY_SCOPE, REPO_ROOT, device_label, device_slug, machine_info, package_version
from bench.measure import Result, RunInterrupted, bench_case, bench_cases, bench_host_case, bench_one, run_suites
from bench.providers import (
    PROVIDERS,
    Provider,
    backend_target_kind,
    build_step,
    check_provider,
    check_tolerance,
    resolved_backend,
    unavailable_reason,
)
from bench.tables import markdown_table, rows_to_markdown
from bench.timing import (
    GPU_SLEEP_EXTRA_MS,
    GPU_SLEEP_MARGIN,
    GPU_SLEEP_MAX_MS,
    Timing,
    gpu_sleep_cycles,
    peak_extra_memory,
    time_fn,
    time_host_steps,
    time_step,
    time_steps,
)

__all__ = [
    "Case",
    "SoftTarget",
    "TARGET_KINDS",
    "Provider",
    "Suite",
    "Result",
    "Timing",
    "PROVIDERS",
    "DTYPES",
    "REPO_ROOT",
    "RESULTS_DIR",
    "GIT_DIRTY_SCOPE",
    "GPU_SLEEP_MARGIN",
    "GPU_SLEEP_EXTRA_MS",
    "GPU_SLEEP_MAX_MS",
    "make_inputs",
    "soft_target",
    "host_case_id",
    "unavailable_reason",
    "build_step",
    "time_steps",
    "time_step",
    "time_host_steps",
    "bench_case",
    "bench_cases",
    "bench_host_case",
    "time_fn",
    "rows_to_markdown",
    "peak_extra_memory",
    "check_provider",
    "check_tolerance",
    "bench_one",
    "run_suites",
    "machine_info",
    "device_label",
    "device_slug",
    "write_json",
    "markdown_table",
    "HISTORY_FIELDS",
    "HISTORY_FIELDS_V1",
    "history_row",
    "history_rows",
    "append_history",
    "result_stem",
    "publish",
    "add_output_arguments",
    "output_history",
    "RunInterrupted",
    "backend_target_kind",
    "resolved_backend",
    "gpu_sleep_cycles",
    "package_version",
    "main",
    "run_pytest_benchmark",
]
