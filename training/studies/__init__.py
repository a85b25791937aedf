"""Analyses from the BSCE-GRA paper that judge an uncertainty weight (docs/papers.md; paper §4.1, §4.3, §5.2).

* :mod:`training.studies.toy_posterior` — Gaussian toy problem with a known posterior: how well does each weight
  (focal, dual focal, generalised Brier score) track the true per-sample calibration error? (paper §4.3)
* :mod:`training.studies.gradient_vs_uncertainty` — per-sample last-layer gradient norm against the Brier score for
  CE, FL, DFL and BSCE-GRA on a trained checkpoint (paper §5.2, Figure 4), and the focal gradient weight
  ``g(p, γ)`` curves (paper §4.1, Figure 1).

Both are command-line tools: ``python -m training.studies.<name> --help``.
"""
