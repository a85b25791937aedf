"""Toy study: does an uncertainty weight track the *true* per-sample calibration error? (BSCE-GRA paper §4.3,
docs/papers.md)

Setup (paper §4.3; the unpublished details are options here, defaults documented below):

* ``C = 5`` classes, each a two-dimensional Gaussian ``N(μ_k, Σ)`` with one shared covariance ``Σ``. The means are drawn
  uniformly from the square ``[low, high]²`` (``--mean-range``, default ``[-5, 5]``, chosen so the
  Bayes-optimal accuracy is around 90%: the posterior is neither near-uniform nor near one-hot; a new draw per run,
  from the run's seed) or given explicitly (``--means``); ``Σ`` defaults to the identity (``--covariance``).
* 10,000 training and 1,000 test points per class (``--train-per-class``, ``--test-per-class``), plus 1,000 held-out
  *selection* points per class used only to pick each weight's hyper-parameters (``--select-on``).
* A two-layer network ``Linear(2, H) → ReLU → Linear(H, C)`` (H = 32) trained 5 epochs with cross-entropy (Adam,
  lr 1e-3, batch 128).
* The true posterior follows from the densities by Bayes' rule (equal priors, since the classes are equally large):
  ``p*_k(x) = π_k N(x; μ_k, Σ) / Σ_j π_j N(x; μ_j, Σ)``; with a shared ``Σ`` the normalising constants cancel, so
  ``p*(x) = softmax_k(log π_k - ½ (x - μ_k)ᵀ Σ⁻¹ (x - μ_k))``.
* True calibration error of a sample (paper Eq. 1): ``ε_i = ‖p*(x_i) - p(x_i)‖`` (L2 norm by default, ``--error-norm``).
* Uncertainty weights ``u(p_i, y_i)`` from :func:`calibkernels.reference.uncertainty_weight`: focal ``(1 - p_y)^γ``,
  dual focal ``(1 - p_y + p_j)^γ`` and the generalised Brier score ``‖p - e_y‖_q^γ``, each over a grid of γ (and q).
* Score: Pearson correlation between ``ε`` and ``u`` on the test points, per run; the paper reports the mean over
  5 runs of the best grid point (gBS 0.664 > DFL 0.638 > FL 0.550). The paper picks the grid point on the data it
  reports; here it is picked on a separate selection set by default (``--select-on selection``), which is the honest
  version of the same search (``--select-on test`` reproduces the paper's protocol).

Run ``python -m training.studies.toy_posterior --help``; the full study (5 seeds) takes a few minutes on a CPU and
writes
``toy_posterior.json``, ``toy_posterior.md`` and ``toy_posterior_scatter.png`` to ``--output-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from calibkernels.reference import uncertainty_weight

from ..arguments import CliArgumentParser, print_error

DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent / "results"
PAPER_CORRELATIONS = {"brier": 0.664, "dual_focal": 0.638, "focal": 0.550}
WEIGHT_LABELS = {"focal": "FL (1-p_y)^γ", "dual_focal": "DFL (1-p_y+p_j)^γ", "brier": "gBS ‖p-e_y‖_q^γ"}


# --------------------------------------------------------------------------------------------------------------------
# data and the analytic posterior
# --------------------------------------------------------------------------------------------------------------------
def check_covariance(covariance: torch.Tensor) -> torch.Tensor:
    """Return ``covariance`` as a float64 (2, 2) tensor after checking it is symmetric positive definite."""
    covariance = torch.as_tensor(covariance, dtype=torch.float64)
    if covariance.shape != (2, 2):
        raise ValueError(f"the shared covariance must be 2x2, got shape {tuple(covariance.shape)}")
    if not torch.allclose(covariance, covariance.T):
        raise ValueError(f"the shared covariance must be symmetric, got {covariance.tolist()}")
    if torch.linalg.eigvalsh(covariance).min() <= 0:
        raise ValueError(f"the shared covariance must be positive definite, got {covariance.tolist()}")
    return covariance


def sample_means(num_classes: int, low: float, high: float, generator: torch.Generator) -> torch.Tensor:
    """Class means drawn uniformly from the square ``[low, high]²``: ``(num_classes, 2)`` float64."""
    if not high > low:
        raise ValueError(f"--mean-range needs low < high, got [{low}, {high}]")
    return low + (high - low) * torch.rand(num_classes, 2, generator=generator, dtype=torch.float64)


def sample_gaussian_classes(means, covariance, per_class: int, generator: torch.Generator):
    """``per_class`` points from each ``N(μ_k, Σ)``: returns ``x (C·per_class, 2)`` float64 and labels ``y`` int64."""
    means = torch.as_tensor(means, dtype=torch.float64)
    cholesky = torch.linalg.cholesky(check_covariance(covariance))
    num_classes = means.shape[0]
    noise = torch.randn(num_classes, per_class, 2, generator=generator, dtype=torch.float64)
    x = means[:, None, :] + noise @ cholesky.T
    y = torch.arange(num_classes).repeat_interleave(per_class)
    return x.reshape(-1, 2), y


def true_posterior(x, means, covariance, priors=None) -> torch.Tensor:
    """Bayes posterior ``p*(k | x)`` of Gaussian classes with one shared covariance: ``(N, C)`` float64, rows sum to 1.

    ``p*_k(x) = π_k N(x; μ_k, Σ) / Σ_j π_j N(x; μ_j, Σ)``. With a shared Σ, the factor ``(2π)^{-1} |Σ|^{-1/2}`` is
    common to
    all classes and cancels, so the posterior is a softmax of ``log π_k - ½ (x - μ_k)ᵀ Σ⁻¹ (x - μ_k)`` (computed in log
    space, so far-away points do not underflow to 0/0). ``priors`` defaults to uniform.
    """
    x = torch.as_tensor(x, dtype=torch.float64)
    means = torch.as_tensor(means, dtype=torch.float64)
    if x.dim() != 2 or x.shape[1] != means.shape[1]:
        raise ValueError(f"x must be (N, {means.shape[1]}), got shape {tuple(x.shape)}")
    precision = torch.linalg.inv(check_covariance(covariance))
    diff = x[:, None, :] - means[None, :, :]  # (N, C, 2)
    mahalanobis = torch.einsum("nci,ij,ncj->nc", diff, precision, diff)
    log_joint = -0.5 * mahalanobis
    if priors is not None:
        priors = torch.as_tensor(priors, dtype=torch.float64)
        if priors.shape != (means.shape[0],) or (priors <= 0).any():
            raise ValueError(f"priors must be {means.shape[0]} positive numbers, got {priors.tolist()}")
        log_joint = log_joint + torch.log(priors / priors.sum())
    return torch.softmax(log_joint, dim=1)


# --------------------------------------------------------------------------------------------------------------------
# model
# --------------------------------------------------------------------------------------------------------------------
class ToyMLP(nn.Module):
    """The paper's "two-layer" network: ``features = ReLU(Linear(2, H))``, ``classifier = Linear(H, C)``.

    Same ``.features`` / ``.classifier`` shape as every model in :mod:`training.models`.
    """

    def __init__(self, num_classes: int, hidden: int = 32, in_features: int = 2):
        super().__init__()
        self.features = nn.Sequential(nn.Linear(in_features, hidden), nn.ReLU())
        self.classifier = nn.Linear(hidden, num_classes)

    def forward(self, x):
        return self.classifier(self.features(x))


def train_classifier(x, y, num_classes, *, hidden, epochs, lr, batch_size, seed, progress=False):
    """Train :class:`ToyMLP` with mean cross-entropy (Adam) on float32 copies of ``x``; return the model in eval
    mode."""
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)  # parameter initialisation
    model = ToyMLP(num_classes, hidden)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    x32 = x.to(torch.float32)
    for _ in tqdm(range(epochs), desc=f"seed {seed}: train", leave=False, disable=(not progress) or None):
        order = torch.randperm(x32.shape[0], generator=generator)
        for start in range(0, x32.shape[0], batch_size):
            batch = order[start:start + batch_size]
            loss = F.cross_entropy(model(x32[batch]), y[batch])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
    return model.eval()


# --------------------------------------------------------------------------------------------------------------------
# the measurement
# --------------------------------------------------------------------------------------------------------------------
def true_calibration_error(p_true, p_pred, ord: float = 2.0) -> torch.Tensor:
    """Paper Eq. 1: ``ε_i = ‖p*(x_i) - p(x_i)‖_ord`` per row, ``(N,)``."""
    return torch.linalg.vector_norm(p_true - p_pred, ord=ord, dim=1)


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    """Pearson correlation of two 1-D tensors (float64); NaN when either is constant."""
    a = a.to(torch.float64) - a.to(torch.float64).mean()
    b = b.to(torch.float64) - b.to(torch.float64).mean()
    denominator = a.norm() * b.norm()
    return float((a @ b) / denominator) if denominator > 0 else math.nan


def weight_grid(gammas, norms) -> list[dict]:
    """Every (weight, hyper-parameters) pair the search visits: γ for FL and DFL, (q, γ) for gBS."""
    grid = [{"weight": "focal", "gamma": g} for g in gammas]
    grid += [{"weight": "dual_focal", "gamma": g} for g in gammas]
    grid += [{"weight": "brier", "gamma": g, "norm": q} for q in norms for g in gammas]
    return grid


def config_key(config: dict) -> str:
    if config["weight"] == "brier":
        return f"brier(q={config['norm']:g},γ={config['gamma']:g})"
    return f"{config['weight']}(γ={config['gamma']:g})"


def weight_values(logits, target, config: dict) -> torch.Tensor:
    """``u(p_i, y_i)`` of one grid point, via the library's reference weights (float64)."""
    return uncertainty_weight(logits.to(torch.float64), target, uncertainty=config["weight"],
                              gamma=float(config["gamma"]), norm=float(config.get("norm", 2.0))).detach()


def run_seed(seed: int, args, grid, progress=False) -> dict:
    """One run: draw data, train, and correlate ``ε`` with every grid point's weight on the selection and test sets."""
    generator = torch.Generator().manual_seed(seed)
    num_classes = args.num_classes
    if args.means is not None:
        means = torch.tensor(args.means, dtype=torch.float64).reshape(-1, 2)
        num_classes = means.shape[0]
    else:
        means = sample_means(num_classes, args.mean_range[0], args.mean_range[1], generator)
    covariance = check_covariance(torch.tensor(args.covariance, dtype=torch.float64).reshape(2, 2))
    x_train, y_train = sample_gaussian_classes(means, covariance, args.train_per_class, generator)
    model = train_classifier(x_train, y_train, num_classes, hidden=args.hidden, epochs=args.epochs, lr=args.lr,
                             batch_size=args.batch_size, seed=seed, progress=progress)
    record = {"seed": seed, "means": means.tolist(), "covariance": covariance.tolist()}
    splits = {"test": args.test_per_class, "selection": args.selection_per_class}
    arrays = {}
    for split, per_class in splits.items():
        x, y = sample_gaussian_classes(means, covariance, per_class, generator)
        with torch.no_grad():
            logits = model(x.to(torch.float32)).to(torch.float64)
        p_pred = torch.softmax(logits, dim=1)
        p_true = true_posterior(x, means, covariance)
        error = true_calibration_error(p_true, p_pred, args.error_norm)
        correlations = {config_key(c): pearson(error, weight_values(logits, y, c)) for c in grid}
        record[split] = {
            "model_accuracy": float((p_pred.argmax(1) == y).double().mean()),
            "bayes_accuracy": float((p_true.argmax(1) == y).double().mean()),
            "mean_true_calibration_error": float(error.mean()),
            "correlations": correlations,
        }
        arrays[split] = {"logits": logits, "target": y, "error": error}
    return record, arrays


def summarise(records, grid, select_on: str) -> dict:
    """Best grid point per weight family (highest mean correlation on ``select_on``) and its test mean ± std."""
    summary = {}
    for weight in ("focal", "dual_focal", "brier"):
        configs = [c for c in grid if c["weight"] == weight]
        if not configs:
            continue

        def mean_on(split, config):
            return float(torch.tensor([r[split]["correlations"][config_key(config)] for r in records]).mean())

        best = max(configs, key=lambda c: mean_on(select_on, c))
        test_values = torch.tensor([r["test"]["correlations"][config_key(best)] for r in records], dtype=torch.float64)
        summary[weight] = {
            "best": best,
            "selected_on": select_on,
            "test_mean": float(test_values.mean()),
            "test_std": float(test_values.std()) if len(records) > 1 else 0.0,
            "test_per_seed": test_values.tolist(),
            "paper": PAPER_CORRELATIONS[weight],
        }
    return summary


def format_table(summary, records) -> str:
    """Markdown table of the summary (mean ± std over runs of the Pearson correlation on the test points)."""
    lines = [
        f"| weight | best hyper-parameters (picked on {next(iter(summary.values()))['selected_on']}) "
        f"| Pearson r, test, mean ± std over {len(records)} runs | paper |",
        "|---|---|---|---|",
    ]
    for weight, row in sorted(summary.items(), key=lambda item: -item[1]["test_mean"]):
        best = row["best"]
        hyper = f"q = {best['norm']:g}, γ = {best['gamma']:g}" if weight == "brier" else f"γ = {best['gamma']:g}"
        lines.append(f"| {WEIGHT_LABELS[weight]} | {hyper} | {row['test_mean']:.3f} ± {row['test_std']:.3f} "
                     f"| {row['paper']:.3f} |")
    accuracy = torch.tensor([r["test"]["model_accuracy"] for r in records])
    bayes = torch.tensor([r["test"]["bayes_accuracy"] for r in records])
    error = torch.tensor([r["test"]["mean_true_calibration_error"] for r in records])
    lines.append("")
    lines.append(f"Test accuracy {100 * accuracy.mean():.1f}% (Bayes-optimal {100 * bayes.mean():.1f}%), "
                 f"mean true calibration error ‖p* - p‖ = {error.mean():.4f}.")
    return "\n".join(lines)


def format_grid_table(records, grid, gammas) -> str:
    """Markdown table of the mean test correlation of every grid point (rows: weight / q, columns: γ)."""
    def mean_test(config):
        return float(torch.tensor([r["test"]["correlations"][config_key(config)] for r in records]).mean())

    lines = ["| weight \\ γ | " + " | ".join(f"{g:g}" for g in gammas) + " |", "|---" * (len(gammas) + 1) + "|"]
    rows = {}
    for config in grid:
        label = f"gBS q = {config['norm']:g}" if config["weight"] == "brier" else WEIGHT_LABELS[config["weight"]]
        rows.setdefault(label, {})[config["gamma"]] = mean_test(config)
    for label, by_gamma in rows.items():
        lines.append(f"| {label} | " + " | ".join(f"{by_gamma[g]:.3f}" for g in gammas) + " |")
    return "\n".join(lines)


def save_scatter(path, arrays, summary, seed, error_norm):
    """One panel per weight family: true calibration error against the weight (best grid point), test points of a
    run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    weights = [w for w in ("focal", "dual_focal", "brier") if w in summary]
    fig, axes = plt.subplots(1, len(weights), figsize=(4.2 * len(weights), 3.8), sharey=True, squeeze=False)
    test = arrays["test"]
    for ax, weight in zip(axes[0], weights):
        best = summary[weight]["best"]
        u = weight_values(test["logits"], test["target"], best)
        r = pearson(test["error"], u)
        ax.scatter(u.numpy(), test["error"].numpy(), s=3, alpha=0.3, linewidths=0)
        ax.set_title(f"{config_key(best)}\nr = {r:.3f} (seed {seed})", fontsize=10)
        ax.set_xlabel("uncertainty weight u(p, y)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel(f"true calibration error ‖p* - p‖_{error_norm:g}")
    fig.suptitle("Toy study: 5 Gaussian classes, true posterior from the densities")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:

    parser = CliArgumentParser(
        prog="python -m training.studies.toy_posterior",
        description="BSCE-GRA paper §4.3 toy study: Pearson correlation between the true per-sample calibration "
                    "error ‖p* - p‖ (known posterior of 2-D Gaussian classes) and the focal, dual-focal and "
                    "generalised-Brier uncertainty weights, with a grid search over their hyper-parameters.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    data = parser.add_argument_group("data")
    data.add_argument("--num-classes", type=int, default=5, help="number of Gaussian classes (ignored with --means)")
    data.add_argument("--mean-range", type=float, nargs=2, default=[-5.0, 5.0], metavar=("LOW", "HIGH"),
                      help="class means are drawn uniformly from [LOW, HIGH]^2, anew for each seed")
    data.add_argument("--means", type=float, nargs="+", default=None,
                      help="explicit class means x1 y1 x2 y2 ... (overrides --mean-range and --num-classes)")
    data.add_argument("--covariance", type=float, nargs=4, default=[1.0, 0.0, 0.0, 1.0],
                      metavar=("S11", "S12", "S21", "S22"), help="shared covariance, row-major")
    data.add_argument("--train-per-class", type=int, default=10_000)
    data.add_argument("--test-per-class", type=int, default=1_000)
    data.add_argument("--selection-per-class", type=int, default=1_000,
                      help="held-out points per class used only to pick each weight's hyper-parameters")
    model = parser.add_argument_group("model and training")
    model.add_argument("--hidden", type=int, default=32, help="hidden width of the two-layer network")
    model.add_argument("--epochs", type=int, default=5)
    model.add_argument("--lr", type=float, default=1e-3, help="Adam learning rate")
    model.add_argument("--batch-size", type=int, default=128)
    study = parser.add_argument_group("study")
    study.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4], help="one run per seed")
    study.add_argument("--gammas", type=float, nargs="+", default=[0.1, 0.25, 0.5, 1, 2, 3, 4, 5, 6],
                       help="γ grid (all three weights)")
    study.add_argument("--norms", type=float, nargs="+", default=[1, 1.5, 2, 3, 4], help="q grid (gBS)")
    study.add_argument("--error-norm", type=float, default=2.0, help="order of the norm in ε = ‖p* - p‖ (paper Eq. 1)")
    study.add_argument("--select-on", choices=("selection", "test"), default="selection",
                       help="split on which the best grid point is chosen ('test' = the paper's protocol)")
    study.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    study.add_argument("--no-plot", action="store_true", help="skip the scatter-plot PNG")
    study.add_argument("--threads", type=int, default=1,
                       help="torch intra-op threads; the network is tiny, so more threads only add contention")
    return parser


def validate_args(args) -> None:
    if args.means is not None and (len(args.means) < 4 or len(args.means) % 2):
        raise ValueError(f"--means needs an even number (>= 4) of values x1 y1 x2 y2 ..., got {len(args.means)}")
    if args.means is None and args.num_classes < 2:
        raise ValueError(f"--num-classes must be >= 2, got {args.num_classes}")
    for name in ("train_per_class", "test_per_class", "selection_per_class", "hidden", "epochs", "batch_size",
                 "threads"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if any(g < 0 for g in args.gammas) or any(q <= 0 for q in args.norms):
        raise ValueError("--gammas must be >= 0 and --norms > 0")
    check_covariance(torch.tensor(args.covariance, dtype=torch.float64).reshape(2, 2))


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    validate_args(args)
    previous_threads = torch.get_num_threads()
    torch.set_num_threads(args.threads)
    try:
        return _run_study(args, argv)
    finally:
        torch.set_num_threads(previous_threads)


def _run_study(args, argv) -> dict:
    grid = weight_grid(args.gammas, args.norms)
    started = time.perf_counter()
    records, first_arrays = [], None
    for seed in tqdm(args.seeds, desc="toy study runs", disable=None):  # bars on a terminal only
        record, arrays = run_seed(seed, args, grid, progress=True)
        records.append(record)
        first_arrays = first_arrays or arrays
        tqdm.write(f"seed {seed}: test accuracy {record['test']['model_accuracy']:.3f} "
                   f"(Bayes {record['test']['bayes_accuracy']:.3f}), mean ‖p*-p‖ "
                   f"{record['test']['mean_true_calibration_error']:.4f}")
    summary = summarise(records, grid, args.select_on)
    table = format_table(summary, records)
    elapsed = time.perf_counter() - started
    print(table)
    print(f"({len(records)} runs in {elapsed:.0f} s)")

    args.output_dir.mkdir(parents=True, exist_ok=True)
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    result = {"config": config, "summary": summary, "runs": records, "seconds": elapsed}
    (args.output_dir / "toy_posterior.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    (args.output_dir / "toy_posterior.md").write_text(
        "# Toy study (BSCE-GRA paper §4.3)\n\n" + table
        + "\n\nMean test Pearson r of every grid point:\n\n" + format_grid_table(records, grid, args.gammas)
        + "\n\nCommand: `python -m training.studies.toy_posterior "
        + " ".join(argv if argv is not None else sys.argv[1:]) + "`\n", encoding="utf-8")
    if not args.no_plot:
        save_scatter(args.output_dir / "toy_posterior_scatter.png", first_arrays, summary, records[0]["seed"],
                     args.error_norm)
    return result


def cli(argv=None) -> int:
    """Command-line entry point: exit code 0, or 2 with one ``error: …`` line on stderr for a bad argument."""

    try:
        main(argv)
    except (ValueError, OSError) as exc:
        return print_error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
