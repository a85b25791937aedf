"""What a run records about its machine (bench/machine.py): device names in file names, package versions, and
whether the measured code had uncommitted changes."""

import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from bench.machine import device_slug, machine_info, package_version  # noqa: E402


def test_device_slugs_name_the_model_without_vendor_words():
    assert device_slug({"device": "cuda", "gpu": "NVIDIA H200"}) == "h200"
    assert device_slug({"device": "cuda", "gpu": "NVIDIA H100 80GB HBM3"}) == "h100-80gb-hbm3"
    assert device_slug({"device": "cpu", "cpu": "AMD EPYC"}) == "epyc"
    assert device_slug({"device": "cpu", "cpu": "Intel(R) Xeon(R) Processor"}) == "xeon"
    assert device_slug({"device": "cpu", "cpu": "AMD EPYC 7763 64-Core Processor"}) == "epyc-7763"


def test_versions_come_from_the_installed_distributions_and_bench_changes_make_a_run_dirty(tmp_path, monkeypatch):
    from importlib import metadata

    assert package_version("torch") == metadata.version("torch")
    assert package_version("surely_not_an_installed_module_xyz") is None
    # git_dirty: a change under bench/ counts, one under bench/results/ (results, not code) does not
    repo = tmp_path / "repo"
    (repo / "bench" / "results").mkdir(parents=True)
    (repo / "bench" / "py").write_text("x = 1\n")
    (repo / "bench" / "results" / "history.jsonl").write_text("{}\n")

    def git(*args):
        subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                       capture_output=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-q", "-m", "init")
    monkeypatch.setattr("bench.machine.REPO_ROOT", repo)
    monkeypatch.setattr("bench.machine._cpu_model", lambda: "stand-in CPU")  # lscpu is slow and beside the point
    assert machine_info("cpu")["git_dirty"] is False
    (repo / "bench" / "results" / "history.jsonl").write_text("{}\n{}\n")
    assert machine_info("cpu")["git_dirty"] is False
    (repo / "bench" / "py").write_text("x = 2\n")
    meta = machine_info("cpu")
    assert meta["git_dirty"] is True and meta["git_dirty_paths"] == ["bench/py"]
    assert "bench" in meta["git_dirty_scope"]
