"""Training recipes for calibrated classifiers built on :mod:`calibkernels`.

* ``python -m training.train`` (console script ``calib-train``) — train a recipe with any registry loss, then report
  pre-T / post-T calibration; with no arguments it runs the embedded CPU demo ``digits``.
* ``python -m training.evaluate --checkpoint …`` — the calibration report of a saved checkpoint.
* :mod:`training.recipes` (named recipes), :mod:`training.data` (on-disk datasets and splits),
  :mod:`training.models` (``build_model``), :mod:`training.checkpoint`, :mod:`training.distributed`,
  :mod:`training.report`.

See ``training/README.md`` for the exact command of every recipe.
"""
