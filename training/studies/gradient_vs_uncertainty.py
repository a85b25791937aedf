"""Gradient magnitude against uncertainty (BSCE-GRA paper §5.2, Figure 4) and focal loss's gradient weight
(§4.1, Figure 1).

**Figure 4.** For a trained classifier ``z = W h + b`` (``h = model.features(x)``, ``(W, b) = model.classifier``), the
per-sample gradient of the loss with respect to the last linear layer is ``∂L_i/∂W = g_i h_iᵀ``, ``∂L_i/∂b = g_i`` with
``g_i = ∂L_i/∂z_i``, so its Frobenius norm is, in closed form and for every sample at once,

    ‖∂L_i/∂(W, b)‖ = ‖g_i‖ · sqrt(‖h_i‖² + 1)        (without the bias term: ‖g_i‖ · ‖h_i‖).

``g_i`` per loss (docs/losses.md):

* CE: ``p_i - e_{y_i}``;
* BSCE-GRA (``mode="grad"``): ``u_i (p_i - e_{y_i})`` with ``u_i = ‖p_i - e_{y_i}‖_q^γ`` (γ = 4, q = 2);
* FL (γ = 3) and DFL (γ = 5) in ``mode="loss"``: ``u_i (p_i - e_{y_i}) + CE_i ∂u_i/∂z_i``, obtained for all rows at once
  from one autograd call on the summed per-row loss w.r.t. the logits (rows are independent, so the gradient of the sum
  with respect to row i's logits is row i's own gradient — no per-sample backward loop).

Each sample's uncertainty is its Brier score ``Σ_k (p_ik - e_{y_i,k})²``; the figure is a 2-D density (log colour scale)
of gradient norm against Brier score, one panel per loss, one row per checkpoint. The paper's reading: BSCE-GRA's
gradient is a narrow, monotone function of the Brier score, DFL's is the most dispersed. "Narrow" is measured by the
correlation ratio η² (share of the gradient norm's variance explained by the Brier score, 40 bins) and monotone by
Spearman's ρ; Pearson's r is reported too.

**Figure 1.** Focal loss ``L_F = -(1 - p)^γ log p`` has ``∂L_F/∂θ = g(p, γ) ∂L_CE/∂θ`` with (Mukhoti et al. 2020)

    g(p, γ) = (1 - p)^γ - γ p (1 - p)^{γ-1} log p,

which *rises* with p up to a point p₀(γ) and falls after it: the samples FL pushes hardest are the moderately
uncertain ones, not the most uncertain. The GRA weight ``(1 - p)^γ`` (dashed) decreases monotonically.

Run ``python -m training.studies.gradient_vs_uncertainty --help``. Without ``--checkpoint`` only Figure 1 is drawn.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from tqdm.auto import tqdm

from calibkernels.reference import uncertainty_weight, uncertainty_weighted_ce

from ..arguments import CliArgumentParser, check_device, print_error
from ..checkpoint import load_model_from_checkpoint
from ..data import DataError
from ..evaluate import rebuild_splits

DEFAULT_OUTPUT_DIR = Path(__file__).resolve().parent / "results"
SPLITS = ("train", "val", "test")


# --------------------------------------------------------------------------------------------------------------------
# closed forms
# --------------------------------------------------------------------------------------------------------------------
def loss_specs(focal_gamma=3.0, dual_focal_gamma=5.0, bsce_gamma=4.0, bsce_norm=2.0) -> dict[str, dict]:
    """The four losses of Figure 4 as :func:`calibkernels.reference.uncertainty_weighted_ce` keyword sets."""
    return {
        "CE": {"uncertainty": "none", "mode": "grad", "gamma": 0.0, "norm": 2.0},
        "FL": {"uncertainty": "focal", "mode": "loss", "gamma": float(focal_gamma), "norm": 2.0},
        "DFL": {"uncertainty": "dual_focal", "mode": "loss", "gamma": float(dual_focal_gamma), "norm": 2.0},
        "BSCE-GRA": {"uncertainty": "brier", "mode": "grad", "gamma": float(bsce_gamma), "norm": float(bsce_norm)},
    }


def per_sample_logit_gradients(logits, target, *, uncertainty, mode, gamma, norm) -> torch.Tensor:
    """``g_i = ∂L_i/∂z_i`` for every row, ``(N, C)`` float64, where ``L_i`` is the per-row uncertainty-weighted CE.

    ``mode="grad"`` (and plain CE) uses the closed form ``sg[u_i] (p_i - e_y)``; ``mode="loss"`` differentiates the
    reference loss once, summed over rows (row i's loss depends only on row i's logits, so this is every row's own
    gradient).
    """
    z = logits.detach().to(torch.float64)
    if mode == "grad":
        p = torch.softmax(z, dim=1)
        residual = p - torch.nn.functional.one_hot(target, z.shape[1]).to(z.dtype)
        u = uncertainty_weight(z, target, uncertainty=uncertainty, gamma=gamma, norm=norm)
        return u[:, None] * residual
    if mode != "loss":
        raise ValueError(f"unknown mode {mode!r}; expected 'grad' or 'loss'")
    z.requires_grad_(True)
    total = uncertainty_weighted_ce(z, target, uncertainty=uncertainty, mode="loss", gamma=gamma, norm=norm,
                                    reduction="sum")
    (gradient,) = torch.autograd.grad(total, z)
    return gradient


def last_layer_gradient_norms(features, logit_gradients, include_bias: bool = True) -> torch.Tensor:
    """``‖∂L_i/∂(W, b)‖_F = ‖g_i‖ · sqrt(‖h_i‖² + 1)`` (``‖g_i‖ · ‖h_i‖`` without bias), ``(N,)`` float64.

    ``features``: ``(N, d)`` penultimate activations ``h``; ``logit_gradients``: ``(N, C)`` ``g = ∂L/∂z``.
    """
    if features.dim() != 2 or logit_gradients.dim() != 2 or features.shape[0] != logit_gradients.shape[0]:
        raise ValueError(f"features must be (N, d) and logit gradients (N, C) with the same N, got "
                         f"{tuple(features.shape)} and {tuple(logit_gradients.shape)}")
    squared_feature_norm = features.to(torch.float64).pow(2).sum(dim=1) + (1.0 if include_bias else 0.0)
    return logit_gradients.to(torch.float64).norm(dim=1) * squared_feature_norm.sqrt()


def brier_scores(logits, target) -> torch.Tensor:
    """Per-sample Brier score ``Σ_k (p_k - e_{y,k})²`` (the uncertainty axis of Figure 4), ``(N,)`` float64."""
    return uncertainty_weight(logits.detach().to(torch.float64), target, uncertainty="brier", gamma=2.0, norm=2.0)


def focal_gradient_weight(p, gamma) -> torch.Tensor:
    """Mukhoti et al.'s ``g(p, γ) = (1 - p)^γ - γ p (1 - p)^{γ-1} log p``: ``∂L_FL/∂θ = g(p, γ) ∂L_CE/∂θ``."""
    p = torch.as_tensor(p, dtype=torch.float64)
    if gamma == 0:
        return torch.ones_like(p)
    return (1 - p).pow(gamma) - gamma * p * (1 - p).pow(gamma - 1) * torch.log(p)


def rank(values: torch.Tensor) -> torch.Tensor:
    """Ranks 0..N-1 (ties broken by position; enough for a summary statistic on continuous values)."""
    ranks = torch.empty_like(values, dtype=torch.float64)
    ranks[values.argsort()] = torch.arange(values.numel(), dtype=torch.float64)
    return ranks


def explained_variance(values, brier, n_bins: int = 40) -> float:
    """Correlation ratio η² = Var(E[values | Brier bin]) / Var(values), equal-width Brier bins on [0, 2].

    1 when the gradient norm is a function of the Brier score (a "narrow" band in Figure 4, whatever its shape),
    near 0 when it is unrelated; unlike Pearson's r it does not reward linearity.
    """
    values = values.to(torch.float64)
    bins = (brier.to(torch.float64) / 2.0 * n_bins).long().clamp(0, n_bins - 1)
    counts = torch.bincount(bins, minlength=n_bins).to(torch.float64)
    bin_means = torch.bincount(bins, weights=values, minlength=n_bins) / counts.clamp_min(1)
    total = (values - values.mean()).pow(2).sum()
    between = (counts * (bin_means - values.mean()).pow(2)).sum()
    return float(between / total) if total > 0 else math.nan


def correlation(a, b) -> float:
    a = a.to(torch.float64) - a.to(torch.float64).mean()
    b = b.to(torch.float64) - b.to(torch.float64).mean()
    denominator = a.norm() * b.norm()
    return float((a @ b) / denominator) if denominator > 0 else math.nan


# --------------------------------------------------------------------------------------------------------------------
# data
# --------------------------------------------------------------------------------------------------------------------
@torch.no_grad()
def collect_features_and_logits(model, loader, device, max_samples=None, progress=True):
    """Run ``model.features`` then ``model.classifier`` over ``loader``; return ``h (N, d)``, ``z (N, C)``,
    ``y (N,)``."""
    for name in ("features", "classifier"):
        if not hasattr(model, name):
            raise TypeError(f"the model must expose .features and .classifier (training.models contract); "
                            f"{type(model).__name__} has no .{name}")
    features, logits, targets = [], [], []
    seen = 0
    for images, labels in tqdm(loader, desc="features", disable=(not progress) or None, leave=False):
        h = model.features(images.to(device))
        features.append(h.float().cpu())
        logits.append(model.classifier(h).float().cpu())
        targets.append(labels.cpu())
        seen += labels.shape[0]
        if max_samples is not None and seen >= max_samples:
            break
    features, logits, targets = torch.cat(features), torch.cat(logits), torch.cat(targets)
    if max_samples is not None:
        features, logits, targets = features[:max_samples], logits[:max_samples], targets[:max_samples]
    return features, logits, targets


def analyse(features, logits, target, specs, include_bias=True) -> dict:
    """Brier score and per-loss last-layer gradient norms for every sample, plus summary statistics."""
    brier = brier_scores(logits, target)
    norms, summary = {}, {}
    for name, spec in specs.items():
        gradients = per_sample_logit_gradients(logits, target, **spec)
        norms[name] = last_layer_gradient_norms(features, gradients, include_bias)
        summary[name] = {
            "mean_grad_norm": float(norms[name].mean()),
            "pearson_vs_brier": correlation(norms[name], brier),
            "spearman_vs_brier": correlation(rank(norms[name]), rank(brier)),
            "eta_squared_vs_brier": explained_variance(norms[name], brier),
        }
    return {"brier": brier, "norms": norms, "summary": summary}


# --------------------------------------------------------------------------------------------------------------------
# figures
# --------------------------------------------------------------------------------------------------------------------
def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_focal_gradient_weight(path, gammas=(1, 2, 3, 4, 5)):
    """Figure 1: ``g(p, γ)`` against p (solid, its maximum p₀ marked) and the GRA weight ``(1 - p)^γ`` (dashed)."""
    plt = _pyplot()
    p = torch.linspace(1e-4, 1 - 1e-4, 2000, dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(5.6, 4.0))
    ax.axhline(1.0, color="black", lw=1, label="CE (γ = 0)")
    for index, gamma in enumerate(gammas):
        colour = f"C{index}"
        g = focal_gradient_weight(p, gamma)
        peak = int(g.argmax())
        ax.plot(p, g, color=colour, label=f"FL g(p, γ={gamma:g})")
        ax.plot(p, (1 - p).pow(gamma), color=colour, ls="--", lw=1)
        ax.plot(p[peak], g[peak], "o", color=colour, ms=4)
    ax.plot([], [], color="grey", ls="--", lw=1, label="GRA weight (1 - p)^γ")
    ax.set_xlabel("p (probability of the true class)")
    ax.set_ylabel("weight on the CE gradient")
    ax.set_title("Focal loss's gradient weight (BSCE-GRA paper Fig. 1)")
    ax.set_ylim(0, 1.6)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


def plot_gradient_density(path, analyses, row_labels, bins=40):
    """Figure 4: one 2-D density (hexbin, log colour) of gradient norm against Brier score per (checkpoint, loss)."""
    plt = _pyplot()
    names = list(analyses[0]["norms"])
    fig, axes = plt.subplots(len(analyses), len(names), figsize=(3.9 * len(names), 3.1 * len(analyses)),
                             squeeze=False)
    for row, (analysis, label) in enumerate(zip(analyses, row_labels)):
        brier = analysis["brier"].numpy()
        for column, name in enumerate(names):
            ax = axes[row][column]
            norms = analysis["norms"][name].numpy()
            # hexbin with a log count scale: most samples sit at Brier ≈ 0, the interesting ones are few
            cells = ax.hexbin(brier, norms, gridsize=bins, extent=(0, 2, 0, max(float(norms.max()), 1e-12) * 1.02),
                              bins="log", mincnt=1, cmap="viridis")
            fig.colorbar(cells, ax=ax, pad=0.01).set_label("samples", fontsize=7)
            summary = analysis["summary"][name]
            ax.set_title(f"{name}: η² = {summary['eta_squared_vs_brier']:.2f}, "
                         f"Spearman ρ = {summary['spearman_vs_brier']:.2f}", fontsize=8)
            ax.set_xlabel("Brier score")
            if column == 0:
                ax.set_ylabel(f"{label}\n‖∂L/∂(W, b)‖", fontsize=8)
    fig.suptitle("Last-layer gradient norm against Brier score (BSCE-GRA paper Fig. 4)")
    fig.tight_layout()
    fig.savefig(path, dpi=130)
    plt.close(fig)


# --------------------------------------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------------------------------------
def format_table(result) -> str:
    """Markdown table: per checkpoint and loss, mean gradient norm and how tightly it follows the Brier score."""
    lines = ["| checkpoint | split (samples, accuracy) | loss | mean ‖∂L/∂(W, b)‖ | η² vs Brier | Spearman ρ "
             "| Pearson r |", "|---|---|---|---|---|---|---|"]
    for row in result["checkpoints"]:
        where = f"{row['split']} ({row['samples']}, {100 * row['accuracy']:.1f}%)"
        for name, stats in row["losses"].items():
            lines.append(f"| {row['label']} | {where} | {name} | {stats['mean_grad_norm']:.4g} "
                         f"| {stats['eta_squared_vs_brier']:.3f} | {stats['spearman_vs_brier']:.3f} "
                         f"| {stats['pearson_vs_brier']:.3f} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:

    parser = CliArgumentParser(
        prog="python -m training.studies.gradient_vs_uncertainty",
        description="Per-sample last-layer gradient norm against Brier score for CE, FL, DFL and BSCE-GRA on trained "
                    "checkpoints (BSCE-GRA paper Fig. 4), and focal loss's gradient weight g(p, γ) (Fig. 1).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    parser.add_argument("--checkpoint", type=Path, nargs="*", default=[],
                        help="checkpoint(s) written by python -m training.train (one figure row each, e.g. several "
                             "epochs of one run); none = only Figure 1")
    parser.add_argument("--split", choices=SPLITS, default="test", help="which split of the checkpoint's recipe")
    parser.add_argument("--data-root", default=None,
                        help="dataset folder (default: the checkpoint's --data-root; digits needs none)")
    parser.add_argument("--seed", type=int, default=None, help="split seed (default: the checkpoint's seed)")
    parser.add_argument("--max-samples", type=int, default=None, help="use at most this many samples")
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--no-bias", action="store_true",
                        help="report ‖∂L/∂W‖ only (default includes the bias: ‖∂L/∂(W, b)‖)")
    parser.add_argument("--focal-gamma", type=float, default=3.0)
    parser.add_argument("--dual-focal-gamma", type=float, default=5.0)
    parser.add_argument("--bsce-gamma", type=float, default=4.0)
    parser.add_argument("--bsce-norm", type=float, default=2.0)
    parser.add_argument("--figure1-gammas", type=float, nargs="+", default=[1, 2, 3, 4, 5])
    parser.add_argument("--output-dir", type=Path, default=DEFAULT_OUTPUT_DIR)
    parser.add_argument("--prefix", default="", help="prefix of the output file names")
    return parser


def load_split(checkpoint: dict, split: str, data_root, seed):
    """The ``split`` dataset of the checkpoint's run, rebuilt as ``training.evaluate`` does (the run's recipe at its
    ``--image-size``, its meta split, its synthetic images), with the run's seed unless ``seed`` is given."""

    return getattr(rebuild_splits(checkpoint["args"], data_root, seed), split)


def main(argv=None) -> dict:
    args = build_parser().parse_args(argv)
    if args.max_samples is not None and args.max_samples < 1:
        raise ValueError(f"--max-samples must be >= 1, got {args.max_samples}")
    if args.batch_size < 1:
        raise ValueError(f"--batch-size must be >= 1, got {args.batch_size}")

    check_device(args.device)
    # Every checkpoint and its data are loaded before anything is written: a bad one stops the study up front.
    runs = []
    for path in args.checkpoint:
        model, checkpoint = load_model_from_checkpoint(path, map_location=args.device)
        runs.append((path, model, checkpoint, load_split(checkpoint, args.split, args.data_root, args.seed)))
    args.output_dir.mkdir(parents=True, exist_ok=True)
    figure1 = args.output_dir / f"{args.prefix}focal_gradient_weight.png"
    plot_focal_gradient_weight(figure1, args.figure1_gammas)
    print(f"wrote {figure1}")
    result = {"config": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
              "checkpoints": []}
    result["config"]["checkpoint"] = [str(c) for c in args.checkpoint]
    if not args.checkpoint:
        return result

    specs = loss_specs(args.focal_gamma, args.dual_focal_gamma, args.bsce_gamma, args.bsce_norm)
    analyses, labels = [], []
    for path, model, checkpoint, dataset in tqdm(runs, desc="checkpoints", disable=None):  # a bar on a terminal only
        loader = torch.utils.data.DataLoader(dataset, batch_size=args.batch_size, shuffle=False)
        features, logits, target = collect_features_and_logits(model, loader, args.device, args.max_samples)
        analysis = analyse(features, logits, target, specs, include_bias=not args.no_bias)
        ckpt_args = checkpoint["args"]
        label = f"{ckpt_args.get('recipe')} / {ckpt_args.get('loss')} / epoch {checkpoint['epoch']}"
        analyses.append(analysis)
        labels.append(label)
        result["checkpoints"].append({
            "path": str(path), "label": label, "split": args.split, "samples": int(target.numel()),
            "accuracy": float((logits.argmax(1) == target).double().mean()),
            "mean_brier": float(analysis["brier"].mean()), "losses": analysis["summary"]})
        tqdm.write(f"{label}: {target.numel()} {args.split} samples")
        for name, row in analysis["summary"].items():
            tqdm.write(f"  {name:9s} mean ‖∇‖ {row['mean_grad_norm']:.4g}  Pearson vs Brier "
                       f"{row['pearson_vs_brier']:+.3f}  Spearman {row['spearman_vs_brier']:+.3f}  "
                       f"η² {row['eta_squared_vs_brier']:.3f}")

    figure4 = args.output_dir / f"{args.prefix}gradient_vs_uncertainty.png"
    plot_gradient_density(figure4, analyses, labels)
    (args.output_dir / f"{args.prefix}gradient_vs_uncertainty.json").write_text(json.dumps(result, indent=1))
    (args.output_dir / f"{args.prefix}gradient_vs_uncertainty.md").write_text(format_table(result), encoding="utf-8")
    print(f"wrote {figure4}")
    return result


def cli(argv=None) -> int:
    """Command-line entry point: exit code 0, or 2 with one ``error: …`` line on stderr for a bad argument,
    checkpoint or data path."""

    try:
        main(argv)
    except (DataError, ValueError, OSError) as exc:
        return print_error(exc)
    return 0


if __name__ == "__main__":
    sys.exit(cli())
