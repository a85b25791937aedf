"""What a bench run measured on: the machine, the library and its versions, the commit (and whether the measured code
had uncommitted changes), and the device's names in result rows and file names."""

from __future__ import annotations

import datetime as _dt
import importlib.util
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

import calibkernels as ck

REPO_ROOT = Path(__file__).resolve().parents[1]


def _cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
        model = fields.get("Model name", "").strip()
        if model:
            return model
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return platform.processor() or platform.machine()


# what `git status` looks at for meta.git_dirty (pathspecs): the kernels' sources and the bench, not its results
GIT_DIRTY_SCOPE = ("csrc", "calibkernels", "setup.py", "bench", ":(exclude)bench/results")


def package_version(module: str) -> str | None:
    """The installed version of the distribution that provides ``module`` (``importlib.metadata``: the version pip
    installed, also for packages without a ``__version__``), or ``None`` when ``module`` is not importable. A module
    whose distribution cannot be found is reported as ``"unknown"``."""
    if importlib.util.find_spec(module) is None:
        return None
    from importlib import metadata

    names = [module, module.replace("_", "-")]
    try:
        names += metadata.packages_distributions().get(module, [])
    except Exception:  # noqa: BLE001 - a lookup aid, never a reason to fail
        pass
    for name in names:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return "unknown"


def machine_info(device: str) -> dict:
    """The ``meta`` of a run on ``device``: date (UTC), host, versions, CPU and threads, the shared machine's load, the
    environment variables that change CPU results, the GPU, the commit and the uncommitted changes in
    :data:`GIT_DIRTY_SCOPE`, and the compiled extension's modification time."""
    info = {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "calibkernels": getattr(ck, "__version__", "unknown"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        # a shared machine's load at the start: other processes competing for the cores inflate CPU timings
        "load_average_1min": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None,
        "device": device,
        # settings that change CPU results (threads; glibc malloc returning freed blocks to the OS, which makes every
        # fresh N×C buffer page-fault on first touch): recorded so a run can be reproduced
        "env": {k: v for k, v in os.environ.items()
                if k in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "GLIBC_TUNABLES", "LD_PRELOAD", "TRITON_INTERPRET",
                         "CUDA_VISIBLE_DEVICES") or k.startswith("MALLOC_")},
    }
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name()
        info["cuda"] = torch.version.cuda
    for module in ("triton", "liger_kernel"):
        version = package_version(module)
        if version is not None:
            info[module] = version
    try:
        def git(*args):
            return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=REPO_ROOT).stdout

        full = git("rev-parse", "HEAD").strip()
        if full:
            info["git_commit"] = full[:7]
            info["git_commit_full"] = full
            # uncommitted changes to the code measured: the kernels (the extension is built from csrc/) and the
            # bench itself, whose providers and timing decide what a number means; result files are not code
            info["git_dirty_scope"] = list(GIT_DIRTY_SCOPE)
            info["git_dirty_paths"] = [line[3:] for line in git("status", "--porcelain", "--", *GIT_DIRTY_SCOPE)
                                       .splitlines() if line.strip()]
            info["git_dirty"] = bool(info["git_dirty_paths"])
    except (OSError, subprocess.SubprocessError):
        pass
    so = sorted(Path(ck.__file__).parent.glob("_C*.so"))
    if so:
        info["extension_mtime"] = _dt.datetime.fromtimestamp(so[0].stat().st_mtime, _dt.timezone.utc).isoformat(
            timespec="seconds")
    return info


def device_label(meta: dict, threads: int | None = None) -> str:
    """The ``device`` of a history row: the GPU's name, or ``"<CPU model> (<cores> cores, <threads> torch threads)"``
    (``threads``: the measurement's, default the run's)."""
    if meta.get("device") == "cuda" and meta.get("gpu"):
        return meta["gpu"]
    return f"{meta['cpu']} ({meta['cpu_count']} cores, {threads or meta['torch_threads']} torch threads)"


def device_slug(meta: dict) -> str:
    """The device in result file names: the GPU or CPU model without vendor and trademark words, lower case
    (``NVIDIA H200`` → ``h200``, ``AMD EPYC`` → ``epyc``, ``Intel(R) Xeon(R) Processor`` → ``xeon``)."""
    name = meta.get("gpu") if meta.get("device") == "cuda" else meta.get("cpu")
    text = re.sub(r"\((?:R|TM)\)|@.*$|\b(?:NVIDIA|Intel|AMD|CPU|Processor|\d+-Core)\b", " ", name or "", flags=re.I)
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or str(meta.get("device") or "unknown")

