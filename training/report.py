"""Calibration report: fit the temperature on the validation split, then accuracy, ECE, AdaECE, classwise ECE, MCE,
NLL and Brier score of the test split before ("pre-T") and after ("post-T") temperature scaling (docs/metrics.md).

The same T (``calibkernels.calibration.fit_temperature``, ECE objective over a grid, fitted on validation logits)
is used for every metric; validation and test are always different splits. Metrics come from
:mod:`calibkernels.metrics` as fractions; tables print ECE-type metrics and accuracy as percentages.

On request (``posthoc=``, on by default in ``training.evaluate``) the report also holds the same metrics of the test
split after each post-hoc calibrator of :mod:`calibkernels.posthoc` (vector and matrix scaling, Dirichlet calibration,
histogram binning, isotonic regression), each fitted with its defaults on the same validation split, under the key
``"posthoc"``, and :func:`format_report` prints them beside post-T in a second table.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

import calibkernels as ck

from . import distributed as dist_utils

__all__ = ["collect_logits", "calibration_metrics", "calibration_report", "format_report", "save_report",
           "format_comparison", "save_comparison", "aggregate_reports", "METRICS", "COMPARISON_METRICS", "POSTHOC",
           "posthoc_metrics"]

# metric key -> (label, shown as a percentage)
METRICS = {
    "accuracy": ("Accuracy %", True),
    "ece": ("ECE %", True),
    "adaece": ("AdaECE %", True),
    "classwise_ece": ("Classwise ECE %", True),
    "mce": ("MCE %", True),
    "nll": ("NLL", False),
    "brier": ("Brier", False),
}

# Post-hoc calibrators reported beside temperature scaling: names of calibkernels.calibration.POSTHOC_METHODS.
POSTHOC = ("vector", "matrix", "dirichlet", "histogram", "isotonic")


@torch.no_grad()
def collect_logits(model, loader, device, amp_dtype=None, channels_last: bool = False):
    """Float32 logits and labels of every sample of ``loader``, on the CPU, gathered from all DDP ranks.

    Under DDP ``loader`` must use :class:`training.distributed.UnpaddedDistributedSampler` so each sample is counted
    exactly once."""
    model.eval()
    logits, labels = [], []
    for images, targets in loader:
        images = images.to(device, non_blocking=True)
        if channels_last:
            images = images.contiguous(memory_format=torch.channels_last)
        with torch.autocast(device.type, dtype=amp_dtype, enabled=amp_dtype is not None):
            out = model(images)
        logits.append(out.float())
        labels.append(targets.to(device))
    num_classes = logits[0].shape[1] if logits else 0
    logits = torch.cat(logits) if logits else torch.zeros(0, num_classes, device=device)
    labels = torch.cat(labels) if labels else torch.zeros(0, dtype=torch.int64, device=device)
    return dist_utils.gather_tensors(logits).cpu(), dist_utils.gather_tensors(labels).cpu()


def calibration_metrics(logits: torch.Tensor, labels: torch.Tensor, n_bins: int = 15) -> dict:
    """All report metrics of ``logits`` (fractions in [0, 1] for accuracy and the ECE family), in one pass."""
    return {k: float(v) for k, v in ck.metrics.calibration_metrics(logits, labels, n_bins=n_bins).items()}


def posthoc_metrics(val_logits, val_labels, test_logits, test_labels, methods=POSTHOC, n_bins: int = 15) -> dict:
    """``{name: metrics of the test split}`` after each calibrator of ``methods`` (names of
    ``calibkernels.calibration.POSTHOC_METHODS``, built with their defaults), fitted on the validation split.

    Metrics are computed from the calibrated log-probabilities (``log_transform``), so the NLL of a scaling method
    stays finite where a probability underflows; a binning method that gives a test label probability 0 has NLL inf.
    Unlike T, these calibrators may change the arg-max, hence the accuracy.
    """
    methods = tuple(methods)
    unknown = [name for name in methods if name not in ck.calibration.POSTHOC_METHODS]
    if unknown:
        raise ValueError(f"unknown post-hoc calibrator(s) {unknown}; "
                         f"choose from {list(ck.calibration.POSTHOC_METHODS)}")
    results = {}
    for name in methods:
        calibrator = ck.calibration.POSTHOC_METHODS[name]().fit(val_logits, val_labels)
        log_probabilities = calibrator.log_transform(test_logits)
        results[name] = {key: float(value) for key, value in ck.metrics.calibration_metrics(
            log_probabilities, test_labels, n_bins=n_bins, inputs_are="logits").items()}
    return results


def calibration_report(val_logits, val_labels, test_logits, test_labels, n_bins: int = 15, posthoc=()) -> dict:
    """Pre-T / post-T metrics of the test logits, with T fitted (ECE objective) on the validation logits; with
    ``posthoc`` (names, e.g. :data:`POSTHOC`) also ``"posthoc": {name: metrics}`` (:func:`posthoc_metrics`)."""
    temperature = float(ck.calibration.fit_temperature(val_logits, val_labels, objective="ece", n_bins=n_bins))
    report = {
        "temperature": temperature,
        "n_val": int(val_labels.numel()),
        "n_test": int(test_labels.numel()),
        "n_bins": n_bins,
        "pre_T": calibration_metrics(test_logits, test_labels, n_bins),
        "post_T": calibration_metrics(test_logits / temperature, test_labels, n_bins),
    }
    if posthoc:
        report["posthoc"] = posthoc_metrics(val_logits, val_labels, test_logits, test_labels, posthoc, n_bins)
    return report


def _cell(key: str, value: float) -> str:
    return f"{100 * value:.2f}" if METRICS[key][1] else f"{value:.4f}"


def format_report(report: dict, title: str = "") -> str:
    """A plain-text pre-T / post-T table (ECE-type metrics and accuracy in %)."""
    lines = [title] if title else []
    lines.append(f"test split: {report['n_test']} samples; T = {report['temperature']:.2f} "
                 f"(fitted for ECE on the {report['n_val']}-sample validation split)")
    lines.append(f"{'metric':16s} {'pre-T':>9s} {'post-T':>9s}")
    for key, (label, _) in METRICS.items():
        lines.append(f"{label:16s} {_cell(key, report['pre_T'][key]):>9s} {_cell(key, report['post_T'][key]):>9s}")
    posthoc = report.get("posthoc")
    if posthoc:
        names = list(posthoc)
        lines.append("")
        lines.append(f"post-hoc calibrators fitted (defaults of calibkernels.posthoc) on the {report['n_val']}-sample "
                     "validation split, same test split:")
        lines.append(f"{'metric':16s} {'post-T':>9s}" + "".join(f" {name:>9s}" for name in names))
        for key, (label, _) in METRICS.items():
            cells = "".join(f" {_cell(key, posthoc[name][key]):>9s}" for name in names)
            lines.append(f"{label:16s} {_cell(key, report['post_T'][key]):>9s}{cells}")
    return "\n".join(lines)


def save_report(report: dict, test_logits, test_labels, output_dir, title: str = "") -> dict:
    """Write ``report.json`` and reliability diagrams ``reliability_pre_T.png`` / ``reliability_post_T.png``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    temperature = report["temperature"]
    files = {}
    for tag, logits in (("pre_T", test_logits), ("post_T", test_logits / temperature)):
        path = output_dir / f"reliability_{tag}.png"
        label = "pre-T" if tag == "pre_T" else f"post-T (T = {temperature:.2f})"
        figure = ck.metrics.reliability_diagram(logits, test_labels, path=str(path), n_bins=report["n_bins"],
                                                title=f"{title} {label}".strip())
        plt.close(figure)
        files[tag] = str(path)
    report = dict(report, figures=files)
    (output_dir / "report.json").write_text(json.dumps(report, indent=2))
    return report


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation (n - 1 in the denominator; 0 for a single value)."""
    values = [float(v) for v in values]
    return statistics.fmean(values), (statistics.stdev(values) if len(values) > 1 else 0.0)


def aggregate_reports(reports: list[dict]) -> dict:
    """One report of several seeds' reports of the same loss: ``temperature``, ``pre_T`` and ``post_T`` hold the
    means over seeds (so the result reads like a single report), ``temperature_std``, ``pre_T_std`` and
    ``post_T_std`` the sample standard deviations, ``seeds`` the seeds and ``runs`` each seed's temperature and
    metrics."""
    if not reports:
        raise ValueError("aggregate_reports needs at least one report")
    mean_t, std_t = _mean_std([r["temperature"] for r in reports])
    result = {"temperature": mean_t, "temperature_std": std_t, "n_seeds": len(reports),
              "seeds": [r.get("seed") for r in reports]}
    for key in ("n_val", "n_test", "n_bins"):
        result[key] = reports[0][key]
    for tag in ("pre_T", "post_T"):
        means, stds = {}, {}
        for metric in reports[0][tag]:
            means[metric], stds[metric] = _mean_std([r[tag][metric] for r in reports])
        result[tag], result[f"{tag}_std"] = means, stds
    for key in ("recipe", "loss", "method", "arch", "epochs"):
        if key in reports[0]:
            result[key] = reports[0][key]
    result["runs"] = [{"seed": r.get("seed"), "temperature": r["temperature"], "pre_T": r["pre_T"],
                       "post_T": r["post_T"]} for r in reports]
    return result


def _cell_pm(key: str, report: dict, tag: str) -> str:
    """``mean ± std`` of a metric of an aggregated report (just the value for a single report)."""
    text = _cell(key, report[tag][key])
    std = report.get(f"{tag}_std")
    return text if std is None else f"{text} ± {_cell(key, std[key])}"


def format_aggregate(report: dict, title: str = "") -> str:
    """A plain-text pre-T / post-T table of :func:`aggregate_reports` (mean ± sample std over seeds)."""
    lines = [title] if title else []
    lines.append(f"test split: {report['n_test']} samples, {report['n_seeds']} seeds {report['seeds']} (each its own "
                 f"seeded split and initialisation); T = {report['temperature']:.2f} ± {report['temperature_std']:.2f} "
                 f"(fitted for ECE on each {report['n_val']}-sample validation split); mean ± sample std over seeds")
    lines.append(f"{'metric':16s} {'pre-T':>18s} {'post-T':>18s}")
    for key, (label, _) in METRICS.items():
        lines.append(f"{label:16s} {_cell_pm(key, report, 'pre_T'):>18s} {_cell_pm(key, report, 'post_T'):>18s}")
    return "\n".join(lines)


def _reliability_curve(logits: torch.Tensor, labels: torch.Tensor, n_bins: int):
    """Mean confidence and accuracy of the non-empty equal-width bins (for overlay plots)."""
    bins = ck.metrics.reliability_bins(logits, labels, n_bins=n_bins)
    keep = bins["count"] > 0
    return bins["confidence"][keep].tolist(), bins["accuracy"][keep].tolist()


# The metrics of the comparison table, in its column order (report.json and comparison.json hold MCE too).
COMPARISON_METRICS = ("accuracy", "ece", "adaece", "classwise_ece", "nll", "brier")


def format_comparison(reports: dict[str, dict]) -> str:
    """Side-by-side table of several losses: two rows per loss, pre-T and post-T (the post-T row carries the fitted
    T), one column per metric of :data:`COMPARISON_METRICS`; for aggregated reports (:func:`aggregate_reports`)
    every cell is ``mean ± std`` over the seeds. Columns are as wide as their widest cell."""
    rows = []
    for loss, rep in reports.items():
        temperature = f"{rep['temperature']:.2f}"
        if "temperature_std" in rep:
            temperature += f" ± {rep['temperature_std']:.2f}"
        for tag, stage, t_cell in (("pre_T", "pre-T", ""), ("post_T", "post-T", temperature)):
            rows.append([loss if tag == "pre_T" else "", stage, t_cell]
                        + [_cell_pm(key, rep, tag) for key in COMPARISON_METRICS])
    header = ["loss", "", "T"] + [METRICS[key][0] for key in COMPARISON_METRICS]
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells):
        return "  ".join(cell.ljust(width) if i < 2 else cell.rjust(width)
                         for i, (cell, width) in enumerate(zip(cells, widths))).rstrip()

    lines = [line(header), "-" * len(line(header))] + [line(row) for row in rows]
    if any("pre_T_std" in rep for rep in reports.values()):
        seeds = next(iter(reports.values()))["seeds"]
        lines.append(f"mean ± sample std over {len(seeds)} seeds {seeds}; accuracy and ECE-type metrics in %")
    return "\n".join(lines)


def save_comparison(reports: dict[str, dict], test_outputs: dict[str, tuple], output_dir, n_bins: int = 15,
                    title: str = "") -> dict:
    """Write ``comparison.json``, ``comparison.md`` and ``comparison_reliability.png`` (one panel pre-T, one post-T,
    each overlaying every loss's reliability curve on the diagonal of perfect calibration).

    ``test_outputs[loss]`` is ``(logits, labels)``, or for an aggregated report a list of them, one per seed in the
    order of ``reports[loss]["runs"]``: the curve then pools every seed's test predictions, each divided by its own
    seed's T in the post-T panel, and the legend gives the mean ECE over seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    output_dir = Path(output_dir)
    output_dir.mkdir(parents=True, exist_ok=True)
    figure, axes = plt.subplots(1, 2, figsize=(11, 5), sharey=True)
    for ax, tag in zip(axes, ("pre_T", "post_T")):
        ax.plot([0, 1], [0, 1], "k--", linewidth=1, label="perfect calibration")
        for loss, outputs in test_outputs.items():
            report = reports[loss]
            per_seed = list(outputs) if isinstance(outputs, list) else [outputs]
            temperatures = ([run["temperature"] for run in report["runs"]] if "runs" in report
                            else [report["temperature"]])
            if len(per_seed) != len(temperatures):
                raise ValueError(f"save_comparison: {loss!r} has test outputs of {len(per_seed)} seed(s) but its "
                                 f"report has {len(temperatures)} run(s); give one (logits, labels) per run, in the "
                                 "report's order")
            scaled = [logits / (t if tag == "post_T" else 1.0) for (logits, _), t in zip(per_seed, temperatures)]
            labels = torch.cat([labels for _, labels in per_seed])
            conf, acc = _reliability_curve(torch.cat(scaled), labels, n_bins)
            ece = 100 * report[tag]["ece"]
            label = f"{loss} (ECE {ece:.2f}"
            if f"{tag}_std" in report:
                label += f" ± {100 * report[f'{tag}_std']['ece']:.2f}"
            label += "%" + (f", T={report['temperature']:.2f})" if tag == "post_T" else ")")
            ax.plot(conf, acc, marker="o", markersize=3, label=label)
        seeds = next(iter(reports.values())).get("n_seeds")
        pooled = f" ({seeds} seeds pooled)" if seeds and seeds > 1 else ""
        ax.set_title(f"{title} {'pre-T' if tag == 'pre_T' else 'post-T'}{pooled}".strip())
        ax.set_xlabel("confidence")
        ax.set_xlim(0, 1)
        ax.set_ylim(0, 1)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    axes[0].set_ylabel("accuracy")
    figure.tight_layout()
    figure_path = output_dir / "comparison_reliability.png"
    figure.savefig(figure_path, dpi=120)
    plt.close(figure)
    table = format_comparison(reports)
    (output_dir / "comparison.md").write_text("```\n" + table + "\n```\n")
    (output_dir / "comparison.json").write_text(json.dumps(reports, indent=2))
    return {"table": table, "figure": str(figure_path)}
