"""Measuring the loss bench's cases: one case's providers (and target kinds) timed together, host-step cases, whole
runs of suites, and the :class:`Result` of each (case, provider).

Every (case, provider) pair of a run gets a :class:`Result`: ``"ok"`` with its times (:mod:`bench.timing`), or
``"skipped: <reason>"`` (the provider cannot run the case here) or ``"error: <message>"`` (it raised); a failing
provider never stops the others. A run stopped by SIGINT (a wall-clock limit, e.g. ``DEADLINE`` of
bench/run_on_gpu.sh) raises :class:`RunInterrupted` with the cases measured before it.
"""

from __future__ import annotations

import statistics
import sys
from dataclasses import asdict, dataclass, field

import torch

from bench.cases import Case, Step, Suite, host_case_id, make_inputs, soft_target
from bench.providers import PROVIDERS, Provider, build_step, resolved_backend, unavailable_reason
from bench.timing import peak_extra_memory, time_host_steps, time_steps

MB = 1e6  # reported memory is in MB (10^6 bytes), bandwidth in GB/s (10^9 bytes/s)


@dataclass
class Result:
    """One (case, provider) measurement; ``asdict`` of it is a row of a result JSON's ``results``."""

    case: dict
    case_id: str
    provider: str
    label: str
    status: str  # "ok", "skipped: <reason>", "error: <message>"
    median_ms: float | None = None
    min_ms: float | None = None
    max_ms: float | None = None
    reps: int = 0
    gb_per_s: float | None = None
    peak_extra_mb: float | None = None
    peak_extra_nc: float | None = None  # in units of one N×C buffer
    speedup_vs_reference: float | None = None
    times_ms: list[float] = field(default_factory=list)
    measure: str = "step"  # "step" or "host_step" (Suite.measure)
    threads: int | None = None  # host steps: torch threads of the measurement (step results: the run's, in meta)
    steps_per_rep: int | None = None  # host steps: back-to-back steps per repetition; times are per step
    baseline: str | None = None  # host steps: the provider the ratios are taken against
    ratio_to_baseline: float | None = None  # this median / the baseline's median
    paired_ratio_to_baseline: float | None = None  # median over repetitions of this time / the baseline's time
    ratio_to_hard: float | None = None  # soft targets: this median / the same provider's on the hard case, same run
    config: dict = field(default_factory=dict)  # other parameters of the measurement (e.g. the resolved backend)
    host_issue_ms: float | None = None  # CUDA steps: the host's time to issue one step, untimed (time_steps)


def _error_status(exc: Exception) -> str:
    message = str(exc).splitlines()[0] if str(exc) else ""
    return f"error: {type(exc).__name__}: {message}"


def bench_case(case: Case, providers: list[Provider], *, warmup: int = 2, reps: int = 10, max_time_s: float = 5.0,
               memory: bool = True, seed: int = 0) -> list[Result]:
    """Time the providers on one case, interleaved (:func:`time_steps`), then measure each one's peak extra memory.

    Unavailable providers are recorded as skipped and failing ones as errors; neither stops the others.
    """
    return bench_cases([(case, providers)], warmup=warmup, reps=reps, max_time_s=max_time_s, memory=memory, seed=seed)


def bench_cases(items: list[tuple[Case, list[Provider]]], *, warmup: int = 2, reps: int = 10,
                max_time_s: float = 5.0, memory: bool = True, seed: int = 0) -> list[Result]:
    """:func:`bench_case` for cases that differ only in their target kind (``Case.hard`` the same): one set of
    logits, each case's target (:func:`make_inputs`), and every (case, provider) step timed together, interleaved,
    so the target kinds are compared as the providers are. Results in the order of ``items``."""
    bases = {case.hard for case, _ in items}
    if len(bases) != 1:
        raise ValueError(f"bench_cases takes the target kinds of one case, got {sorted(c.id for c in bases)}")
    results: dict[tuple[Case, str], Result] = {}
    steps: dict[tuple[Case, str], Step] = {}
    for case, providers in items:
        for provider in providers:
            key = (case, provider.name)
            results[key] = result = Result(asdict(case), case.id, provider.name, provider.label, "ok")
            backend = resolved_backend(provider, case)
            if backend is not None:
                result.config["backend"] = backend
            reason = unavailable_reason(provider, case)
            if reason is not None:
                result.status = f"skipped: {reason}"
                continue
            try:
                steps[key] = build_step(provider, case)
            except Exception as exc:  # noqa: BLE001 - one failing provider must not lose the other measurements
                result.status = _error_status(exc)
    if not steps:
        return list(results.values())

    def on_error(key, exc):
        results[key].status = _error_status(exc)
        steps.pop(key, None)

    base = bases.pop()
    leaf, target = make_inputs(base, seed)
    kinds = {case: target if case.target == "hard" else soft_target(case, target, seed) for case, _ in items}
    targets = {key: kinds[key[0]] for key in steps}
    try:
        timings = time_steps(dict(steps), leaf, target, warmup=warmup, reps=reps, max_time_s=max_time_s,
                             on_error=on_error, targets=targets)
        for key, timing in timings.items():
            result = results[key]
            result.median_ms, result.min_ms, result.max_ms = timing.median_ms, timing.min_ms, timing.max_ms
            result.reps, result.times_ms = timing.reps, [round(t, 4) for t in timing.times_ms]
            result.gb_per_s = key[0].min_traffic_bytes / (timing.median_ms * 1e-3) / 1e9
            result.host_issue_ms = None if timing.issue_ms is None else round(timing.issue_ms, 4)
        if memory:
            for key in timings:
                try:
                    peak = peak_extra_memory(steps[key], leaf, targets[key])
                    results[key].peak_extra_mb = peak / MB
                    results[key].peak_extra_nc = peak / key[0].nc_bytes
                except Exception as exc:  # noqa: BLE001
                    results[key].status = _error_status(exc)
    finally:
        leaf = target = kinds = targets = steps = None  # released here; the closures above read them first
        if base.device == "cuda":
            torch.cuda.empty_cache()
    return list(results.values())




def bench_host_case(case: Case, providers: list[Provider], *, threads: tuple[int | None, ...] = (None,),
                    baseline: str | None = None, reps: int = 100, rep_ms: float = 20.0, warmup: int = 20,
                    seed: int = 0) -> list[Result]:
    """Host cost of the providers' eager steps on ``case`` (:func:`time_host_steps`), once per entry of ``threads``
    (``torch.set_num_threads``; ``None``: the count in effect when called, restored afterwards), with each provider's
    ratio to ``baseline``: of the medians, and the median of the per-repetition ratios.

    Every provider runs the case's shape and dtype whatever its loss (``Provider.computed_case``)."""
    default_threads = torch.get_num_threads()
    results: list[Result] = []
    try:
        for wanted in threads:
            count = default_threads if wanted is None else int(wanted)
            torch.set_num_threads(count)
            results += _bench_host_case_at(case, providers, count, baseline, reps, rep_ms, warmup, seed)
    finally:
        torch.set_num_threads(default_threads)
    return results


def _bench_host_case_at(case, providers, threads, baseline, reps, rep_ms, warmup, seed) -> list[Result]:
    results = {}
    steps: dict[str, Step] = {}
    for provider in providers:
        result = Result(asdict(provider.computed_case(case)), host_case_id(case), provider.name, provider.label, "ok",
                        measure="host_step", threads=threads, baseline=baseline)
        backend = resolved_backend(provider, case)
        if backend is not None:
            result.config["backend"] = backend
        results[provider.name] = result
        reason = unavailable_reason(provider, case, any_weight=True)
        if reason is not None:
            result.status = f"skipped: {reason}"
            continue
        try:
            steps[provider.name] = build_step(provider, case, any_weight=True)
        except Exception as exc:  # noqa: BLE001 - one failing provider must not lose the other measurements
            result.status = _error_status(exc)
    if steps:
        # every provider its own leaf of the same values: an in-place provider (Liger) writes its gradient into its
        # logits, which must not become the next provider's input
        inputs = {name: make_inputs(case, seed) for name in steps}
        inplace = {provider.name for provider in providers if provider.inplace}
        timings = time_host_steps(steps, None, None, reps=reps, rep_ms=rep_ms, warmup=warmup, inputs=inputs,
                                  inplace=inplace,
                                  on_error=lambda name, exc: setattr(results[name], "status", _error_status(exc)))
        for name, timing in timings.items():
            result = results[name]
            result.median_ms, result.min_ms, result.max_ms = timing.median_ms, timing.min_ms, timing.max_ms
            result.reps, result.times_ms = timing.reps, [round(t, 6) for t in timing.times_ms]
            result.steps_per_rep = timing.steps_per_rep
        if baseline in timings:
            base = timings[baseline]
            for name, timing in timings.items():
                pairs = [t / b for t, b in zip(timing.times_ms, base.times_ms)]
                results[name].ratio_to_baseline = timing.median_ms / base.median_ms
                results[name].paired_ratio_to_baseline = statistics.median(pairs)
        del inputs
    return list(results.values())


def bench_one(provider: Provider, case: Case, **kwargs) -> Result:
    """:func:`bench_case` for a single provider."""
    return bench_case(case, [provider], **kwargs)[0]


def selected_pairs(suites, providers_filter, cases_filter, targets_filter=None):
    """``(suite, case, provider)`` of every pair the filters keep, in the suites' order: case ids containing one of
    ``cases_filter`` (a host-step case by :func:`~bench.cases.host_case_id`), target kinds in ``targets_filter``,
    providers named in ``providers_filter`` (each ``None`` or empty: no filter), providers that apply to the case."""
    for suite in suites:
        host = suite.measure == "host_step"
        for case in suite.cases:
            case_id = host_case_id(case) if host else case.id
            if cases_filter and not any(f in case_id for f in cases_filter):
                continue
            if targets_filter and case.target not in targets_filter:
                continue
            for name in suite.providers:
                if providers_filter and name not in providers_filter:
                    continue
                if PROVIDERS[name].applies_to(case, any_weight=host):
                    yield suite, case, PROVIDERS[name]


class RunInterrupted(KeyboardInterrupt):
    """SIGINT (a wall-clock limit's, as bench/run_on_gpu.sh's DEADLINE sends) during :func:`run_suites`: ``results``
    holds the cases measured before it, the one in progress left out."""

    def __init__(self, results: list[Result]):
        super().__init__()
        self.results = results


def run_suites(suites: list[Suite], *, warmup: int = 2, reps: int = 10, max_time_s: float = 5.0, memory: bool = True,
               providers_filter: list[str] | None = None, cases_filter: list[str] | None = None,
               progress: bool = True, host_reps: int | None = None, host_rep_ms: float = 20.0,
               targets_filter: list[str] | None = None) -> list[Result]:
    """Measure every (case, provider) pair of the suites; fills ``speedup_vs_reference`` when the eager reference
    ran on the same case, and ``ratio_to_hard`` when the provider ran the case's hard targets. Host-step suites run
    with ``host_reps`` repetitions (default: the suite's ``reps``, else 100) of about ``host_rep_ms`` each.

    A ``KeyboardInterrupt`` (SIGINT) ends the run: :class:`RunInterrupted` is raised with the cases measured so far."""
    # group the pairs by case (in order), the target kinds of a case together: a group's providers and target kinds
    # are timed together, interleaved (bench_cases); a host-step suite's cases are measured on their own (its
    # threads, baseline and repetitions)
    groups: dict[tuple, dict[Case, list[Provider]]] = {}
    for suite, case, provider in selected_pairs(suites, providers_filter, cases_filter, targets_filter):
        key = ("step", case.hard, None) if suite.measure == "step" else ("host_step", case, suite)
        providers = groups.setdefault(key, {}).setdefault(case, [])
        if provider not in providers:
            providers.append(provider)
    try:
        from tqdm import tqdm
    except ImportError:  # tqdm is optional: fall back to one line per case
        tqdm = None
    items = list(groups.items())
    bar = tqdm(items, desc="bench", unit="case", file=sys.stderr, disable=not progress) if tqdm else items
    results = []
    try:
        _run_groups(bar, tqdm, progress, results, warmup, reps, max_time_s, memory, host_reps, host_rep_ms)
        interrupted = False
    except KeyboardInterrupt:
        interrupted = True
        if tqdm:
            bar.close()
    steps = [r for r in results if r.status == "ok" and r.measure == "step"]
    reference_ms = {r.case_id: r.median_ms for r in steps if r.provider == "reference"}
    hard_ms = {(r.case_id, r.provider): r.median_ms for r in steps if r.case.get("target", "hard") == "hard"}
    for r in steps:
        if r.case_id in reference_ms:
            r.speedup_vs_reference = reference_ms[r.case_id] / r.median_ms
        hard_id = Case(**r.case).hard.id
        if hard_id != r.case_id and (hard_id, r.provider) in hard_ms:
            r.ratio_to_hard = r.median_ms / hard_ms[hard_id, r.provider]
    if interrupted:
        raise RunInterrupted(results)
    return results


def _run_groups(bar, tqdm, progress, results, warmup, reps, max_time_s, memory, host_reps, host_rep_ms) -> None:
    """:func:`run_suites`' loop over the groups of ``bar``; each group's results are appended to ``results`` once
    the whole group is measured."""
    for (measure, case, suite), by_case in bar:
        label = case.id if measure == "step" else f"{host_case_id(case)} host step"
        kinds = [c.target for c in by_case if c.target != "hard"]
        label += f" (+ targets {', '.join(kinds)})" if kinds else ""
        if tqdm:
            bar.set_postfix_str(f"{label} ({len({p.name for ps in by_case.values() for p in ps})} providers)")
        elif progress:
            print(f"[bench] {label}", file=sys.stderr, flush=True)
        if measure == "step":
            case_results = bench_cases(list(by_case.items()), warmup=warmup, reps=reps, max_time_s=max_time_s,
                                       memory=memory)
        else:
            (providers,) = by_case.values()
            case_results = bench_host_case(
                case, providers, threads=suite.threads,
                baseline=suite.baseline if any(p.name == suite.baseline for p in providers) else None,
                reps=host_reps if host_reps is not None else (suite.reps or 100), rep_ms=host_rep_ms)
        for result in case_results:
            if result.status != "ok" and progress:
                print(f"[bench] {result.case_id} {result.provider}: {result.status}", file=sys.stderr, flush=True)
        results.extend(case_results)

