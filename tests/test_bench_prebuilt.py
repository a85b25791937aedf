"""An extension built on another machine (bench/prebuilt.py) is used only where its stamp matches these sources, this
interpreter, torch and the GPU's compute capability."""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed


def _prebuilt_tree(tmp_path, monkeypatch):
    """A tree with sources and a stamped build for this interpreter and torch, as `bench.prebuilt build` leaves it."""
    import sysconfig

    from bench import prebuilt

    (tmp_path / "csrc" / "cuda").mkdir(parents=True)
    (tmp_path / "csrc" / "op.cpp").write_text("int op();\n")
    (tmp_path / "csrc" / "cuda" / "rows.cu").write_text("__global__ void k() {}\n")
    (tmp_path / "setup.py").write_text("# setup\n")
    (tmp_path / "calibkernels").mkdir()
    so = f"_C{sysconfig.get_config_var('EXT_SUFFIX')}"
    (tmp_path / "calibkernels" / so).write_bytes(b"\x7fELF")
    monkeypatch.setattr(prebuilt, "ROOT", tmp_path)
    monkeypatch.setattr(prebuilt, "STAMP", tmp_path / "calibkernels" / "_C.prebuilt.json")
    archs = "%d.%d" % torch.cuda.get_device_capability() if torch.cuda.is_available() else "9.0"
    stamp = {"sources": prebuilt.sources_hash(tmp_path), "suffix": sysconfig.get_config_var("EXT_SUFFIX"),
             "torch": torch.__version__, "archs": archs, "file": so, "file_sha256": prebuilt._file_hash(
                 tmp_path / "calibkernels" / so)}
    prebuilt.STAMP.write_text(json.dumps(stamp))
    return prebuilt, stamp


def test_a_prebuilt_extension_is_used_only_where_its_stamp_matches(tmp_path, monkeypatch, capsys):
    prebuilt, stamp = _prebuilt_tree(tmp_path, monkeypatch)
    assert prebuilt.check() == 0, capsys.readouterr().out
    # an edited, added or renamed source file: compile again
    for change in ("edit", "add", "rename"):
        cu = tmp_path / "csrc" / "cuda" / "rows.cu"
        original = cu.read_text()
        if change == "edit":
            cu.write_text(original + "// one more line\n")
        elif change == "add":
            (tmp_path / "csrc" / "extra.h").write_text("\n")
        else:
            cu.rename(tmp_path / "csrc" / "cuda" / "rows2.cu")
        capsys.readouterr()
        assert prebuilt.check() == 1
        assert "the sources changed" in capsys.readouterr().out
        (tmp_path / "csrc" / "extra.h").unlink(missing_ok=True)
        if change == "rename":
            (tmp_path / "csrc" / "cuda" / "rows2.cu").rename(cu)
        cu.write_text(original)
        assert prebuilt.check() == 0
    # another torch, another interpreter, a missing library, no stamp
    for key, value, reason in [("torch", "2.0.0", "built against torch 2.0.0"),
                               ("suffix", ".cpython-39-x86_64-linux-gnu.so", "built for .cpython-39")]:
        prebuilt.STAMP.write_text(json.dumps(dict(stamp, **{key: value})))
        capsys.readouterr()
        assert prebuilt.check() == 1 and reason in capsys.readouterr().out
    prebuilt.STAMP.write_text(json.dumps(stamp))
    # an editor's backup beside the sources is not a source
    (tmp_path / "csrc" / "op.cpp~").write_text("old\n")
    assert prebuilt.check() == 0
    # a library built again after the stamp, or none
    library = tmp_path / "calibkernels" / stamp["file"]
    library.write_bytes(b"\x7fELF again")
    capsys.readouterr()
    assert prebuilt.check() == 1 and "is not the stamped build" in capsys.readouterr().out
    library.unlink()
    capsys.readouterr()
    assert prebuilt.check() == 1 and f"no calibkernels/{library.name}" in capsys.readouterr().out
    prebuilt.STAMP.unlink()
    assert prebuilt.check() == 1


@pytest.mark.parametrize("archs,capability,usable", [("9.0", (9, 0), True), ("8.0;9.0a", (9, 0), True),
                                                      ("9.0+PTX", (9, 0), True), ("8.0 9.0", (9, 0), True),
                                                      ("9.0", (8, 0), False), ("8.6;9.0", (8, 0), False)])
def test_a_prebuilt_extension_needs_the_devices_compute_capability(tmp_path, monkeypatch, capsys, archs, capability,
                                                                     usable):
    prebuilt, stamp = _prebuilt_tree(tmp_path, monkeypatch)
    prebuilt.STAMP.write_text(json.dumps(dict(stamp, archs=archs)))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    assert prebuilt.check() == (0 if usable else 1), capsys.readouterr().out
