"""Atomic, resumable training checkpoints.

A checkpoint is a dict with keys ``"model"``, ``"optimizer"``, ``"scheduler"``, ``"scaler"``, ``"epoch"`` (epochs
completed), ``"args"`` (the CLI arguments as a dict, including ``"recipe"``, ``"loss"``, ``"arch"``,
``"num_classes"``), ``"rng"`` (Python, NumPy, torch CPU and CUDA generator states), optional ``"meta"`` (γ-Net state)
and, when a run was stopped mid-epoch by SIGTERM/SIGINT, ``"batches_done"`` (batches of epoch ``"epoch"`` already
trained). It is written to a temporary file in the same directory, flushed to disk and moved into place with
``os.replace``, so a crash never leaves a truncated checkpoint behind.
"""

from __future__ import annotations

import os
import random
import tempfile
from pathlib import Path

import numpy as np
import torch

from .models import build_model

__all__ = ["save_checkpoint", "load_checkpoint", "load_model_from_checkpoint", "rng_state", "set_rng_state"]


def rng_state() -> dict:
    """Every random generator a training step may draw from."""
    state = {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"].cpu())
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])


def save_checkpoint(checkpoint: dict, path: str | os.PathLike) -> Path:
    """Write ``checkpoint`` to ``path`` atomically (temporary file in the same directory + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as handle:
            torch.save(checkpoint, handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return path


def load_checkpoint(path: str | os.PathLike, map_location="cpu") -> dict:
    """Load a checkpoint written by :func:`save_checkpoint` (it holds RNG states and argument dicts, hence
    ``weights_only=False``: only load checkpoints you trust)."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {str(path)!r} " + ("is not a file" if path.exists() else "does not exist"))
    try:
        checkpoint = torch.load(path, map_location=map_location, weights_only=False)
    except Exception as exc:  # torch.load of a truncated, empty or foreign file raises many kinds of error
        reason = str(exc).strip().splitlines()[0].split(". ")[0] if str(exc).strip() else ""
        raise ValueError(f"{path} is not a readable checkpoint ({type(exc).__name__}"
                         + (f": {reason})" if reason else ")")) from exc
    if not isinstance(checkpoint, dict):
        raise ValueError(f"{path} is not a training checkpoint (it holds a {type(checkpoint).__name__}, not a dict)")
    missing = [k for k in ("model", "epoch", "args") if k not in checkpoint]
    if missing:
        raise ValueError(f"{path} is not a training checkpoint (missing {', '.join(missing)})")
    return checkpoint


def load_model_from_checkpoint(path: str | os.PathLike, map_location="cpu"):
    """Rebuild the model of a checkpoint via :func:`training.models.build_model` and load its weights.

    Returns ``(model, checkpoint_dict)``; the model is in eval mode on ``map_location``.
    """

    checkpoint = load_checkpoint(path, map_location=map_location)
    args = checkpoint["args"]
    # Weights come from the checkpoint itself, so a fine-tune's original --pretrained file is not needed again.
    model = build_model(args["arch"], int(args["num_classes"]), **args.get("model_kwargs", {}))
    model.load_state_dict(checkpoint["model"])
    model.to(map_location if not callable(map_location) else "cpu")
    return model.eval(), checkpoint
