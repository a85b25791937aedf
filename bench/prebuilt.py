"""The compiled extension built on this machine for another machine's Python and torch, and the check there.

A GPU machine's time is better spent on the GPU than on nvcc: the CUDA kernels take several minutes of a single core to
compile. With a virtual environment holding that machine's Python and torch (same versions, same CUDA major version;
no GPU needed), build here and copy the result over:

    python -m bench.prebuilt build --python /path/to/venv/bin/python [--archs 9.0]
    python -m bench.prebuilt check        # on the GPU machine; exit status 0: the copied build is usable

``build`` compiles a copy of the working tree (``setup.py build_ext --inplace``) with that interpreter and puts its
``calibkernels/_C<suffix>`` into this tree's ``calibkernels/`` with a stamp, ``calibkernels/_C.prebuilt.json``: the hash
of the sources (``csrc/`` and ``setup.py``), the interpreter's extension suffix, torch's version, the CUDA architectures
and the library's own hash. ``check`` accepts the build only where all of them match (the hash against the sources
beside it, the architectures against the current GPU's compute capability), so a source edited after the build is
compiled again (``bench/run_on_gpu.sh build``) instead of testing stale kernels.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = ROOT / "calibkernels" / "_C.prebuilt.json"


SOURCE_SUFFIXES = {".c", ".cc", ".cpp", ".cu", ".cuh", ".h", ".hpp"}


def sources_hash(root: Path | None = None) -> str:
    """SHA-256 over the relative paths and contents of the files the extension is built from (under ``root``, by
    default this tree): the C++/CUDA sources and headers of ``csrc/`` (not an editor's backup beside them) and
    ``setup.py``."""
    root = ROOT if root is None else root
    files = sorted(p for p in (root / "csrc").rglob("*") if p.is_file() and p.suffix in SOURCE_SUFFIXES)
    files.append(root / "setup.py")
    digest = hashlib.sha256()
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def _file_hash(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _archs(text: str) -> set[str]:
    """Compute capabilities of an arch list as TORCH_CUDA_ARCH_LIST writes it ("8.0;9.0a", "9.0+PTX", "8.0 9.0"):
    "9.0a" and "9.0+PTX" run on a 9.0 device."""
    return {a.removesuffix("+PTX").rstrip("a") for a in text.replace(",", ";").replace(" ", ";").split(";") if a}


def _interpreter_facts(python: str) -> dict:
    script = "import json, sysconfig, torch; print(json.dumps({'suffix': sysconfig.get_config_var('EXT_SUFFIX'), " \
             "'torch': torch.__version__, 'cuda': torch.version.cuda}))"
    out = subprocess.run([python, "-c", script], check=True, capture_output=True, text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def _tracked_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=root, check=True,
                         capture_output=True).stdout
    return [name for name in out.decode().split("\0") if name and (root / name).is_file()]


def build(python: str, archs: str, jobs: int) -> int:
    facts = _interpreter_facts(python)
    if facts["cuda"] is None:
        print(f"error: {python}'s torch {facts['torch']} has no CUDA", file=sys.stderr)
        return 2
    with tempfile.TemporaryDirectory(prefix="calibkernels-prebuild-") as tmp:
        tree = Path(tmp)
        for name in _tracked_files(ROOT):
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
        # the CUDA kernels or a failed build, never a quiet CPU-only one; the default CPU flags (no -march)
        env = dict(os.environ, CALIBKERNELS_CUDA_ARCHS=archs, CALIBKERNELS_FORCE_CUDA="1", MAX_JOBS=str(jobs))
        env.setdefault("CUDA_HOME", "/usr/local/cuda")
        for name in ("CALIBKERNELS_NO_CUDA", "CALIBKERNELS_SKIP_EXT", "CALIBKERNELS_DEBUG", "CALIBKERNELS_CPU_ARCH"):
            env.pop(name, None)
        result = subprocess.run([python, "setup.py", "-q", "build_ext", "--inplace"], cwd=tree, env=env)
        if result.returncode != 0:
            return result.returncode
        built = tree / "calibkernels" / f"_C{facts['suffix']}"
        if not built.is_file():
            print(f"error: the build made no {built.name}", file=sys.stderr)
            return 1
        dest = ROOT / "calibkernels" / built.name
        shutil.copy2(built, dest)
        if shutil.which("strip"):  # the host code's DWARF is most of the file, and the file travels
            subprocess.run(["strip", "--strip-debug", str(dest)], check=True)
        stamp = {"sources": sources_hash(tree), "suffix": facts["suffix"], "torch": facts["torch"],
                 "archs": archs, "file": built.name, "file_sha256": _file_hash(dest)}
    STAMP.write_text(json.dumps(stamp, indent=1) + "\n")
    print(f"calibkernels/{stamp['file']} ({dest.stat().st_size >> 20} MiB) and "
          f"{STAMP.relative_to(ROOT)}: torch {stamp['torch']}, archs {archs}")
    return 0


def check() -> int:
    """Exit status 0 when the copied build matches this machine and these sources; otherwise says why (one line)."""
    if not STAMP.is_file():
        print("prebuilt: no stamp")
        return 1
    stamp = json.loads(STAMP.read_text())
    import torch

    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    library = ROOT / "calibkernels" / f"_C{suffix}"
    reasons = []
    if stamp.get("suffix") != suffix:
        reasons.append(f"built for {stamp.get('suffix')}, this Python wants {suffix}")
    elif not library.is_file():
        reasons.append(f"no calibkernels/{library.name}")
    elif stamp.get("file_sha256") != _file_hash(library):
        reasons.append(f"calibkernels/{library.name} is not the stamped build")
    if stamp.get("torch") != torch.__version__:
        reasons.append(f"built against torch {stamp.get('torch')}, this is {torch.__version__}")
    if stamp.get("sources") != sources_hash():
        reasons.append("the sources changed after the build")
    if torch.cuda.is_available():
        capability = "%d.%d" % torch.cuda.get_device_capability()
        if capability not in _archs(stamp.get("archs", "")):
            reasons.append(f"built for {stamp.get('archs')}, this GPU is {capability}")
    if reasons:
        print("prebuilt: not usable: " + "; ".join(reasons))
        return 1
    print(f"prebuilt: usable ({stamp['file']}, torch {stamp['torch']}, archs {stamp['archs']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.prebuilt", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build with another interpreter and stamp the result")
    b.add_argument("--python", required=True, help="the interpreter of the target machine's Python and torch")
    b.add_argument("--archs", default="9.0", help="CUDA compute capabilities, ';'-separated (default 9.0)")
    b.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compile jobs")
    sub.add_parser("check", help="exit 0 if the stamped build suits this machine and these sources")
    args = parser.parse_args(argv)
    if args.command == "build":
        return build(args.python, args.archs, args.jobs)
    return check()


if __name__ == "__main__":
    sys.exit(main())
