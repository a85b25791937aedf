"""bench/run_on_gpu.sh, the script that runs every GPU benchmark and the GPU tests on a GPU machine: its stages are
run from a copy whose GPU work is stood in for (a stand-in Python, or a stage's function replaced), so these tests
need no GPU. Checked: the usage, the stage names, DEADLINE (stop starting stages after N seconds), PACK (one
tarball), and what each stage runs."""

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run_script(stages, env, stand_ins=(), edits=()):
    """bench/run_on_gpu.sh run from a copy whose functions named in ``stand_ins`` ((name, body) pairs) are replaced
    (the real stages need a GPU), with the text edits ``edits`` ((old, new) pairs, each old text present), and which
    installs no wheels."""
    script = (ROOT / "bench" / "run_on_gpu.sh").read_text().replace('if compgen -G ".whl/*.whl"', 'if false', 1)
    for old, new in edits:
        assert old in script, old
        script = script.replace(old, new)
    for name, body in stand_ins:
        script = script.replace(f"{name}() {{", f"{name}() {{ {body}; }}\n_unused_{name}() {{", 1)
    fake = ROOT / "bench" / f".run_on_gpu_test_{os.getpid()}.sh"
    fake.write_text(script)
    try:
        return subprocess.run(["bash", str(fake), *stages], capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env=dict(os.environ, **env))
    finally:
        fake.unlink()


def _stand_in_python(path, body):
    """An executable shell script at ``path`` standing in for the script's Python (``$PYTHON``)."""
    path.write_text("#!/bin/sh\n" + body)
    path.chmod(0o755)
    return str(path)


def test_the_usage_names_every_stage_and_option(tmp_path):
    """--help prints the header of the script (what it runs, its stages, its options) and runs nothing."""
    proc = subprocess.run(["bash", str(ROOT / "bench" / "run_on_gpu.sh"), "--help"], capture_output=True, text=True,
                          cwd=tmp_path, timeout=60, env=dict(os.environ, OUT=str(tmp_path / "out")))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.startswith("Run every GPU benchmark (and the GPU tests) on your machine"), proc.stdout
    for stage in ("build", "test", "quick", "bench", "soft", "fused", "tune", "train", "hostprofile", "raise"):
        assert f"\n  {stage} " in proc.stdout, stage
    for option in ("OUT=", "PYTHON=", "DEADLINE=", "PACK=1", "TEST_K=", "TEST_TIMEOUT=", "FUSED_ARGS", "TRAIN_RUNS"):
        assert option in proc.stdout, option
    assert not (tmp_path / "out").exists()


def test_an_unknown_stage_runs_nothing(tmp_path):
    """A misspelt stage is named before any stage runs (exit status 2)."""
    proc = _run_script(["soft", "benhc"], dict(OUT=str(tmp_path)), [("do_soft", 'echo soft-ran')])
    assert proc.returncode == 2 and "unknown stage benhc" in proc.stdout, proc.stdout + proc.stderr
    assert "soft-ran" not in proc.stdout


def test_without_stages_every_benchmark_runs_after_the_build_and_the_tests(tmp_path):
    """No stage named: build, test, then every benchmark (bench, fused, tune, train), in that order."""
    default = ["do_build", "do_test", "do_bench", "do_fused", "do_tune", "do_train"]
    proc = _run_script([], dict(OUT=str(tmp_path)), [(name, f"echo {name}-ran") for name in default])
    ran = [line for line in proc.stdout.splitlines() if line.endswith("-ran")]
    assert ran == [f"{name}-ran" for name in default], proc.stdout + proc.stderr
    assert [line.split(":")[0] for line in (tmp_path / "summary.txt").read_text().splitlines()] == [
        "build", "test", "bench", "fused", "tune", "train"]


def test_a_stage_running_at_the_deadline_is_stopped_and_the_rest_skipped(tmp_path):
    """bench/run_on_gpu.sh with DEADLINE: the summary still prints, naming the stopped and the skipped stages; a
    `timeout` inside a stage ends by the deadline too; with PACK the output folder holds the archive of everything and
    the summary. """
    import tarfile

    # stand-in stages: one that writes with $PY into $OUT and ends in a failing pipeline (whose status the stage must
    # keep, as the build stage's check does), one whose own `timeout` (as the test stage's) outlasts the deadline, one
    # left no time
    proc = _run_script(["soft", "quick", "bench"],
                             dict(OUT=str(tmp_path), DEADLINE="18", PACK="1", PYTHON=sys.executable),
                             [("do_soft", '$PY -c "print(7 * 6)" > "$OUT/soft.txt"; false | cat'),
                              ("do_quick", 'timeout "$(within_stage 100)" sleep 40'),
                              ("do_bench", "echo bench-ran")])
    lines = proc.stdout.strip().splitlines()
    assert lines[-3].startswith("soft: rc=1,"), proc.stdout + proc.stderr
    assert lines[-2].startswith("quick: rc=124") and "stopped at DEADLINE" in lines[-2], proc.stdout + proc.stderr
    assert int(lines[-2].split(", ")[1].removesuffix(" s")) <= 22, lines[-2]  # not the 10 s of SIGKILL's grace
    assert lines[-1].startswith("bench: skipped"), proc.stdout
    assert "bench-ran" not in proc.stdout
    assert sorted(os.listdir(tmp_path)) == ["gpu-run.tgz", "summary.txt"]
    assert (tmp_path / "summary.txt").read_text().splitlines() == lines[-3:]
    with tarfile.open(tmp_path / "gpu-run.tgz") as archive:
        assert "./summary.txt" in archive.getnames()
        assert archive.extractfile("./soft.txt").read() == b"42\n"


def test_the_training_stage_runs_the_runs_it_is_given(tmp_path):
    """bench/run_on_gpu.sh train with TRAIN_RUNS and TRAIN_CIFAR=0, its Python a stand-in that logs its arguments:
    each run is stopped at its last epoch's progress line (on stderr), before the evaluation that would follow, and
    that line is its result; a run that ends before it fails the stage and says so."""
    import time

    stand_in = _stand_in_python(tmp_path / "python", """echo "$@" >> "$OUT/calls.txt"
case "$*" in *"--backend cuda"*) echo "Traceback: no CUDA" >&2; exit 1 ;; esac
echo "epoch 1/2  100 steps  loss 6.9  lr 0.1  12 img/s  80.0 s" >&2
echo "epoch    1/2  loss 6.9  train acc 0.10%  12 img/s"
echo "epoch 2/2  100 steps  loss 6.8  lr 0.1  2500 img/s  10.2 s" >&2
sleep 60  # the evaluation, which the stage does not wait for
echo "evaluated" >> "$OUT/calls.txt"
""")
    out = tmp_path / "out"
    start = time.monotonic()
    proc = _run_script(["train"], dict(OUT=str(out), PYTHON=stand_in, TRAIN_CIFAR="0",
                                             TRAIN_RUNS="bsce_gra triton,cross_entropy cuda"))
    assert time.monotonic() - start < 30, "the stage waited for the evaluation"
    assert proc.stdout.strip().splitlines()[-1].startswith("train: rc=1"), proc.stdout + proc.stderr
    calls = (out / "calls.txt").read_text().splitlines()
    assert len(calls) == 2 and all("--recipe imagenet-resnet50-finetune" in c for c in calls), calls
    assert all("--epochs 2 --eval-every 3" in c for c in calls), calls  # no evaluation after epoch 1
    assert "--loss bsce_gra --backend triton" in calls[0] and "--loss cross_entropy --backend cuda" in calls[1]
    assert (out / "train-throughput.txt").read_text().splitlines() == [
        "bsce_gra / triton: epoch 2/2  100 steps  loss 6.8  lr 0.1  2500 img/s  10.2 s",
        f"cross_entropy / cuda: no epoch finished (see {out}/train-r50-cross_entropy-cuda.log)"]


def test_the_host_profile_stage_profiles_the_classification_shapes(tmp_path):
    """bench/run_on_gpu.sh hostprofile: profile_step's cProfile of the default call, the CUDA backend and
    F.cross_entropy at 256 and 8192 x 1000 bf16, into host-profile.txt, of which it prints the headings."""
    stand_in = _stand_in_python(tmp_path / "python", """echo "$@" >> "$OUT/calls.txt"
echo "== host profile: cuda-256x1000-bf16-brier-grad · calibkernels, 300 steps"
echo "         14400 function calls in 0.5 seconds"
echo "   ncalls  tottime"
""")
    out = tmp_path / "out"
    proc = _run_script(["hostprofile"], dict(OUT=str(out), PYTHON=stand_in))
    lines = proc.stdout.strip().splitlines()
    assert lines[-1].startswith("hostprofile: rc=0"), proc.stdout + proc.stderr
    assert lines[-3:-1] == ["== host profile: cuda-256x1000-bf16-brier-grad · calibkernels, 300 steps",
                            "         14400 function calls in 0.5 seconds"], proc.stdout
    (call,) = (out / "calls.txt").read_text().splitlines()
    assert call.startswith("-m bench.profile_step --cases 256x1000-bf16-brier 256x1000-bf16-none") and (
        "--host-profile --providers calibkernels calibkernels_cuda torch_cross_entropy" in call), call
    assert "ncalls" in (out / "host-profile.txt").read_text()


def test_the_build_stage_forces_the_device_kernels_and_fails_without_them(tmp_path):
    """The build stage compiles with CALIBKERNELS_FORCE_CUDA=1 (setup.py would otherwise build without the CUDA
    kernels where it finds no nvcc) and fails, with one line saying why, when the extension it leaves has none on a
    machine with a GPU. The stand-in Python answers each of the stage's calls; the copy deletes no build."""
    stand_in = _stand_in_python(tmp_path / "python", """\
echo "$* FORCE=${CALIBKERNELS_FORCE_CUDA:-unset}" >> "$OUT/calls.txt"
case "$*" in
  *"bench.prebuilt check"*) exit 1 ;;
  *get_device_capability*) echo 9.0 ;;
  *"raise SystemExit"*) exit "$KERNELS_MISSING" ;;
  *) echo stand-in ;;
esac
""")
    keep_the_build = [("rm -rf build calibkernels/_C.*.so calibkernels/_C.prebuilt.json", ": rm")]
    for missing in (1, 0):
        out = tmp_path / f"out{missing}"
        proc = _run_script(["build"], dict(OUT=str(out), PYTHON=stand_in, KERNELS_MISSING=str(missing)),
                                 edits=keep_the_build)
        lines = proc.stdout.strip().splitlines()
        assert lines[-1].startswith(f"build: rc={missing},"), proc.stdout + proc.stderr
        calls = (out / "calls.txt").read_text().splitlines()
        (setup,) = [call for call in calls if call.startswith("setup.py")]
        assert setup.endswith("FORCE=1"), calls
        said = [line for line in lines if "has no CUDA kernels" in line]
        assert len(said) == missing, proc.stdout


def test_the_test_stage_stops_pytest_with_sigint_and_keeps_its_summary(tmp_path):
    """The test stage's own timeout (TEST_TIMEOUT) sends SIGINT, on which pytest writes its summary (the failures so
    far, short tracebacks): the log holds it and the stage prints its FAILED lines; a pytest that ignores SIGINT is
    killed TEST_GRACE s later. The stand-in pytest answers SIGINT as pytest does, and notes the signal it got."""
    summary = ("=== FAILURES ===; tests/test_a.py:3: in test_x; E   AssertionError: boom; "
               "=== short test summary info ===; FAILED tests/test_a.py::test_x - AssertionError: boom; "
               "=== 1 failed, 2 passed in 2.00s ===")
    answers = _stand_in_python(tmp_path / "python", f"""echo "$@" > "$OUT/args.txt"
trap 'echo INT > "$OUT/signal.txt"; printf "%s\\n" "{summary}" | tr ";" "\\n" | sed "s/^ //"; exit 2' INT
trap 'echo TERM > "$OUT/signal.txt"; exit 143' TERM
echo "tests/test_a.py::test_x FAILED"
while :; do sleep 0.1; done
""")
    out = tmp_path / "out"
    proc = _run_script(["test"], dict(OUT=str(out), PYTHON=answers, TEST_TIMEOUT="2", TEST_GRACE="2"))
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("test: rc=124,") and int(last.split(", ")[1].removesuffix(" s")) < 4, proc.stdout
    assert (out / "signal.txt").read_text() == "INT\n"
    log = (out / "pytest.log").read_text()
    assert "short test summary info" in log and "E   AssertionError: boom" in log, log
    assert "FAILED tests/test_a.py::test_x - AssertionError: boom" in proc.stdout.splitlines(), proc.stdout
    assert "pytest stopped after 2 s (rc=124" in proc.stdout and "1 failed, 2 passed in 2.00s" in proc.stdout
    args = (out / "args.txt").read_text().split()
    assert "--tb=short" in args and "-rfE" in args, args

    deaf = _stand_in_python(tmp_path / "deaf-python", "trap '' INT\nwhile :; do sleep 0.1; done\n")
    proc = _run_script(["test"], dict(OUT=str(out), PYTHON=deaf, TEST_TIMEOUT="1", TEST_GRACE="2"))
    last = proc.stdout.strip().splitlines()[-1]
    assert last.startswith("test: rc=137,") and int(last.split(", ")[1].removesuffix(" s")) < 5, proc.stdout


def test_the_archive_leaves_out_checkpoints(tmp_path):
    """PACK=1: the training's checkpoints (*.pt, and a partial write of one) stay out of gpu-run.tgz (their gzip
    outlasted a call's limit), and are gone from the output folder with the rest; its logs go in."""
    import tarfile

    write = ('mkdir -p "$OUT/train/r50"; echo log > "$OUT/train/r50/log.csv"; echo w > "$OUT/train/r50/checkpoint.pt"'
             '; echo w > "$OUT/train/r50/.checkpoint.pt.x1y2.tmp"')
    proc = _run_script(["train"], dict(OUT=str(tmp_path), PACK="1"), [("do_train", write)])
    assert proc.stdout.strip().splitlines()[-1].startswith("train: rc=0"), proc.stdout + proc.stderr
    assert sorted(os.listdir(tmp_path)) == ["gpu-run.tgz", "summary.txt"]
    with tarfile.open(tmp_path / "gpu-run.tgz") as archive:
        names = archive.getnames()
    assert "./train/r50/log.csv" in names and not [n for n in names if ".pt" in n], names


def test_the_fused_stage_leaves_torch_compile_to_fused_args(tmp_path):
    """The fused stage names the fused providers and eager materialised logits, not the torch.compile provider (its
    compilation took the stage's whole time), and ours at chunks of 256 and 2048 rows too (FUSED_CHUNKS="": none);
    FUSED_ARGS comes last, so its --providers replaces the list."""
    stand_in = _stand_in_python(tmp_path / "python", 'if [ "$1" = -c ]; then echo h100; exit 0; fi\n'
                                                     'echo "$@" >> "$OUT/calls.txt"\n')
    out = tmp_path / "out"
    for fused_args in ("", "--providers calibkernels_fused_linear chunked_reference_compiled"):
        (out / "calls.txt").unlink(missing_ok=True)
        proc = _run_script(["fused"], dict(OUT=str(out), PYTHON=stand_in, FUSED_ARGS=fused_args))
        assert proc.stdout.strip().splitlines()[-1].startswith("fused: rc=0"), proc.stdout + proc.stderr
        call = (out / "calls.txt").read_text().split()
        assert call[:4] == ["-m", "bench.bench_fused_linear", "--device", "cuda"], call
        at = call.index("--chunk-sizes")  # ours at other chunks beside the default
        assert call[at + 1:at + 4] == ["256", "2048", "--providers"], call
        last = len(call) - call[::-1].index("--providers")
        providers = call[last:]
        if fused_args:
            assert providers == ["calibkernels_fused_linear", "chunked_reference_compiled"], call
        else:
            assert providers == ["calibkernels_fused_linear", "liger_fused_linear_cross_entropy", "cut_cross_entropy",
                                 "materialized_calibkernels", "materialized_torch"], call
    proc = _run_script(["fused"], dict(OUT=str(out), PYTHON=stand_in, FUSED_CHUNKS=""))
    assert "--chunk-sizes" not in (out / "calls.txt").read_text().splitlines()[-1], proc.stdout + proc.stderr
