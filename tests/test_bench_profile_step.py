"""Where a step's time goes (bench/profile_step.py, a GPU tool): its command line, and a run none of whose providers
can run names each skip and fails."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # `bench` lives at the repository root, not installed

from _bench_support import assert_prints_help  # noqa: E402


def test_profile_step_prints_its_help():
    assert_prints_help("bench.profile_step")


def test_profile_step_names_each_skip_and_fails_when_nothing_can_run(capsys):
    from bench import profile_step

    with pytest.raises(SystemExit) as stop:
        profile_step.main(["--device", "cpu", "--cases", "8x4-fp32-brier", "--providers", "torch_cross_entropy",
                           "liger_cross_entropy"])
    assert stop.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == "skip: cpu-8x4-fp32-brier-grad torch_cross_entropy: torch_cross_entropy does not apply to " \
                     "cpu-8x4-fp32-brier-grad"
    assert err[1].startswith("skip: cpu-8x4-fp32-brier-grad liger_cross_entropy: ")
    assert len([line for line in err if line.startswith("error:")]) == 1 and err[-1].startswith("error: ")
