#!/usr/bin/env bash
# Run every GPU benchmark (and the GPU tests) on your machine: build the extension for its GPU, run the tests that
# involve the GPU, then the benchmarks, and print a short summary of the stages.
#
#   bash bench/run_on_gpu.sh [STAGE ...]      # from anywhere; stages run in the order given
#   bash bench/run_on_gpu.sh --help
#
# Stages (none named: build test bench fused tune train, every benchmark):
#   build        build calibkernels._C in place for this GPU's compute capability (setup.py build_ext --inplace);
#                an extension built elsewhere for this machine is used instead when `python -m bench.prebuilt check`
#                accepts it (bench/prebuilt.py). Fails when the extension has no CUDA kernels; a failed build stops
#                the run.
#   test         the test files with GPU cases, their GPU cases only (pytest -k "cuda or triton or gpu")
#   quick        the loss bench's headline cases and host-step suite (bench_uncertainty_weighted_ce --quick)
#   bench        the loss bench's full GPU run (all shapes, dtypes, losses, target kinds, the host-step suite)
#   soft         the loss bench's soft-target suite alone (--only-suites cuda-soft-targets)
#   fused        the fused linear + loss bench (bench_fused_linear) at 8192 x 4096 x 128256 bf16
#   tune         the Triton launch-shape sweep, the CUDA op's default launch and whole steps (tune_triton)
#   train        ResNet-50 training throughput on synthetic data, then a CIFAR-shaped recipe end to end
#   hostprofile  a cProfile of the host side of eager steps at the classification shapes (profile_step)
#   raise        a bad argument to each op must raise, not crash the process (raise.txt)
#
# Logs and results go to $OUT (default bench/results/gpu-run-<date>). The benches write <suite>-<gpu>-<date>.json/.md
# and $OUT/history.jsonl (rows naming bench/results/<file>); to keep them in the repository, copy the result files
# into bench/results/ (git rm the earlier ones of the same suite and GPU) and append $OUT/history.jsonl to
# bench/results/history.jsonl.
#
# Options (environment variables):
#   OUT=<dir>            where logs and results go
#   PYTHON=<python>      the interpreter (default python3; it needs torch and triton)
#   DEADLINE=<seconds>   stop starting stages after this many seconds: the stage running then is interrupted
#                        (SIGINT: the benches write what they measured; SIGKILL 10 s later), the later ones are
#                        skipped, and the summary still prints
#   PACK=1               pack the results into a tarball: $OUT then holds only gpu-run.tgz (every log and result but
#                        training checkpoints, *.pt) and summary.txt
#   MAX_JOBS=<n>         parallel compile jobs of `build` (default 16)
#   TEST_K=<expr>        pytest -k of `test` (default "cuda or triton or gpu"; empty: every test of the files)
#   TEST_TIMEOUT=<s>     stop pytest with SIGINT after this long (default 540), so its log still ends with the
#                        failures so far; TEST_GRACE=<s> (default 20) later it is killed
#   TEST_WORKERS=<n>     pytest-xdist workers (default 8); TEST_ARGS: more pytest arguments
#   BENCH_ARGS           more arguments of the loss bench (quick, bench)
#   FUSED_ARGS           more arguments of `fused`, last, e.g. '--providers calibkernels_fused_linear
#                        chunked_reference_compiled' (torch.compile, which compiles for minutes at that size)
#   FUSED_CHUNKS         the chunk sizes `fused` also times ours at (default "256 2048"; empty: the default only)
#   TRAIN_RUNS           `train`'s "loss backend" pairs, separated by commas; TRAIN_EPOCHS (default 2), TRAIN_ARGS
#                        (more flags of each run); TRAIN_CIFAR=0 leaves out the CIFAR-shaped recipe
#
# Wheels in .whl/ (e.g. liger-kernel, for the Liger provider, on a machine without network access) are installed into
# /tmp/site first and put on PYTHONPATH.
set -uo pipefail
case "${1:-}" in
  -h|--help) sed -n '2,/^set /{/^#/s/^# \{0,1\}//p}' "$0"; exit 0 ;;
esac
[ $# -eq 0 ] && set -- build test bench fused tune train
STAGES="build test quick bench soft fused tune train hostprofile raise"
for s in "$@"; do
  case " $STAGES " in *" $s "*) ;; *) echo "unknown stage $s (stages: $STAGES)"; exit 2 ;; esac
done
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu-run-$(date +%F)}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
export OUT PY

if compgen -G ".whl/*.whl" >/dev/null; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
    && export PYTHONPATH="$PYTHONPATH:/tmp/site"
fi

summary=()
# stage NAME FUNCTION: runs the function and notes its time. With DEADLINE: in a child shell with this one's options,
# under `timeout` (SIGINT at DEADLINE, SIGKILL 10 s later), with STAGE_LEFT, the seconds left, for within_stage.
stage() {
  local name=$1 fn=$2 t0=$SECONDS rc left=
  if [ -n "${DEADLINE:-}" ]; then
    left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 15 ]; then summary+=("$name: skipped, ${left} s left before DEADLINE"); return 1; fi
    STAGE_LEFT=$left timeout --signal=INT --kill-after=10 "$left" bash -uo pipefail -c "$fn"
  else
    "$fn"
  fi
  rc=$?
  local note=""
  if [ -n "$left" ] && [ "$rc" -ne 0 ] && [ $((SECONDS - t0)) -ge $((left - 1)) ]; then note=", stopped at DEADLINE"; fi
  summary+=("$name: rc=$rc, $((SECONDS - t0)) s$note")
  return $rc
}

# within_stage LIMIT: LIMIT, or the seconds left before DEADLINE if fewer. For a `timeout` inside a stage: it runs its
# command in a process group of its own, which the stage's own timeout does not signal.
within_stage() {
  if [ -n "${STAGE_LEFT:-}" ] && [ "$STAGE_LEFT" -lt "$1" ]; then echo "$STAGE_LEFT"; else echo "$1"; fi
}

do_build() {
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv | tee "$OUT/nvidia-smi.txt"
  $PY -c "import torch, triton, sys; print('python', sys.version.split()[0], 'torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())" | tee -a "$OUT/nvidia-smi.txt"
  local cc
  cc=$($PY -c "import torch; print('%d.%d' % torch.cuda.get_device_capability())")
  local rc=0
  # a build made elsewhere for this machine (bench/prebuilt.py): its stamp matches, and it loads with its CUDA kernels
  if $PY -m bench.prebuilt check | tee "$OUT/build.log" \
      && $PY -c "import calibkernels._C as C; assert C.WITH_CUDA" >>"$OUT/build.log" 2>&1; then
    :
  else
    rm -rf build calibkernels/_C.*.so calibkernels/_C.prebuilt.json
    # CALIBKERNELS_FORCE_CUDA: without it setup.py quietly builds a CPU-only extension where it finds no nvcc
    CALIBKERNELS_FORCE_CUDA=1 CALIBKERNELS_CUDA_ARCHS="$cc" MAX_JOBS="${MAX_JOBS:-16}" \
      $PY setup.py -q build_ext --inplace >>"$OUT/build.log" 2>&1
    rc=$?
    tail -n 5 "$OUT/build.log"
  fi
  $PY -c "import calibkernels, calibkernels._C as C; print('WITH_CUDA', C.WITH_CUDA, calibkernels.available_backends())"
  # every later stage measures the CUDA kernels: a build without them (or one that does not load) fails this stage
  if [ "$rc" -eq 0 ] && ! $PY -c "import torch, calibkernels._C as C
raise SystemExit(0 if C.WITH_CUDA or not torch.cuda.is_available() else 1)" >>"$OUT/build.log" 2>&1; then
    echo "build: calibkernels._C has no CUDA kernels on this CUDA machine (WITH_CUDA false, or it does not load; see build.log)"
    rc=1
  fi
  return $rc
}

do_test() {
  # every test file with GPU cases (kernels, soft targets, fused linear, metrics on the device, the bench's providers
  # and Triton launch shapes); the whole suite is CI's job on a CPU machine. --durations: the slowest tests in the
  # summary
  local k=${TEST_K-cuda or triton or gpu} select=() grace=${TEST_GRACE:-20} total
  [ -n "$k" ] && select=(-k "$k")
  # SIGINT at the timeout: pytest stops and still writes its summary (the failures so far, their tracebacks), which a
  # SIGTERM would lose; SIGKILL `grace` s later if it has not ended. Both within the stage's time, so pytest has
  # ended by DEADLINE.
  total=$(within_stage $((${TEST_TIMEOUT:-540} + grace)))
  [ "$total" -lt $((2 * grace)) ] && grace=$((total / 2))
  timeout --signal=INT --kill-after="$grace" "$((total - grace))" \
    $PY -m pytest -q -n "${TEST_WORKERS:-8}" -p no:cacheprovider --tb=short -rfE --durations=30 "${select[@]}" \
    tests/test_uncertainty_weighted_ce.py tests/test_uncertainty_weighted_ce_cuda.py \
    tests/test_uncertainty_weighted_ce_cuda_brier_flsd.py tests/test_uncertainty_weighted_ce_cuda_launch.py \
    tests/test_uncertainty_weighted_ce_triton.py tests/test_uncertainty_weighted_ce_triton_soft_targets.py \
    tests/test_uncertainty_weighted_ce_triton_aot.py tests/test_uncertainty_weighted_ce_soft_targets.py \
    tests/test_uncertainty_weighted_ce_contracts.py tests/test_uncertainty_weighted_ce_faults.py \
    tests/test_soft_targets.py tests/test_target_checks.py tests/test_fused_linear.py \
    tests/test_calibration_posthoc.py tests/test_metrics_bootstrap.py tests/test_metrics_debiased.py \
    tests/test_metrics_smooth_ece.py tests/test_meta.py tests/test_bench_providers.py tests/test_bench_tune_triton.py \
    ${TEST_ARGS:-} \
    >"$OUT/pytest.log" 2>&1
  local rc=$?
  if [ "$rc" -eq 124 ] || [ "$rc" -eq 137 ]; then
    # the counts line of pytest's summary (the log may end with the KeyboardInterrupt's traceback)
    echo "pytest stopped after $((total - grace)) s (rc=$rc: 124 ended on SIGINT, 137 killed ${grace} s later):" \
      "$(grep -E "(passed|failed|error|no tests ran).* in [0-9.]+s" "$OUT/pytest.log" | tail -n 1)"
  fi
  grep -E "^(FAILED|ERROR)" "$OUT/pytest.log" | head -n 30
  tail -n 3 "$OUT/pytest.log"
  return $rc
}

do_raise() {
  # An error raised inside this extension's ops must reach Python as an exception: on some hosts (torch builds) it
  # killed the process (SIGSEGV) instead. Calls each op with a target of the wrong length (a TORCH_CHECK in the shared
  # argument checks), plain, with C++ stack traces on, and under gdb for the native backtrace when gdb is installed.
  local snippet='import torch, calibkernels
x, t = torch.randn(4, 5), torch.tensor([0, 1, 2])
for dev in ["cpu"] + (["cuda"] if torch.cuda.is_available() else []):
    try:
        torch.ops.calibkernels.uncertainty_weighted_ce(x.to(dev), t.to(dev), None, None, 4, 1, 4.0, 2.0, -100, 1, True,
                                                       None)
        print(dev, "raised nothing")
    except Exception as exc:
        print(dev, "raised", type(exc).__name__, str(exc).splitlines()[0])'
  {
    echo "== plain"; $PY -X faulthandler -c "$snippet" 2>&1 | tail -n 25; echo "rc=${PIPESTATUS[0]}"
    echo "== TORCH_SHOW_CPP_STACKTRACES=1"
    TORCH_SHOW_CPP_STACKTRACES=1 $PY -X faulthandler -c "$snippet" 2>&1 | tail -n 25; echo "rc=${PIPESTATUS[0]}"
    if command -v gdb >/dev/null; then
      # the interpreter binary itself (python3 may be a wrapper script, which gdb cannot run)
      local exe
      exe=$($PY -c "import sys; print(sys.executable)")
      echo "== gdb"; gdb -q -batch -ex run -ex bt --args "$exe" -c "$snippet" 2>&1 | grep -v "^\[New Thread\|^\[Thread" | tail -n 60
    else
      echo "== gdb: not installed"
    fi
  } >"$OUT/raise.txt" 2>&1
  tail -n 40 "$OUT/raise.txt"
}

do_quick() { $PY -m bench.bench_uncertainty_weighted_ce --device cuda --quick --results-dir "$OUT" ${BENCH_ARGS:-} 2>"$OUT/quick.err"; }
do_bench() { $PY -m bench.bench_uncertainty_weighted_ce --device cuda --results-dir "$OUT" ${BENCH_ARGS:-} 2>"$OUT/bench.err"; }
do_tune() { $PY -m bench.tune_triton --out "$OUT/tune-triton" 2>"$OUT/tune.err"; }
# where the host's time of an eager step goes at the classification shapes (whose steps are host-bound): a cProfile of
# 300 steps per shape and provider (bench/profile_step.py --host-profile), the default call and the CUDA backend
# beside F.cross_entropy
do_hostprofile() {
  $PY -m bench.profile_step --cases 256x1000-bf16-brier 256x1000-bf16-none 8192x1000-bf16-brier 8192x1000-bf16-none \
    --host-profile \
    --providers calibkernels calibkernels_cuda torch_cross_entropy >"$OUT/host-profile.txt" 2>&1
  local rc=$?
  grep -E "^== host profile|function calls in" "$OUT/host-profile.txt"
  return $rc
}
# soft targets beside hard ones (label smoothing, mixes, dense) on the fused GPU kernels, F.cross_entropy and Liger
do_soft() {
  $PY -m bench.bench_uncertainty_weighted_ce --device cuda --only-suites cuda-soft-targets --results-dir "$OUT" \
    2>"$OUT/soft.err"
}
# fused linear + loss at 8192 x 4096 x 128256 bf16 against materialised logits, Liger and Cut Cross-Entropy, ours also
# at chunks of 256 and 2048 rows beside its default (FUSED_CHUNKS; empty: the default only). Not
# chunked_reference_compiled by default: inductor compiles it for minutes at this size (FUSED_ARGS='--providers ...
# chunked_reference_compiled' adds it; the script measures it last). The script rewrites its results after each case,
# so a stage stopped at DEADLINE keeps the rows measured so far.
do_fused() {
  local chunks=${FUSED_CHUNKS-256 2048}
  $PY -m bench.bench_fused_linear --device cuda --out "$OUT/fused-linear-$($PY -c "import torch; print(torch.cuda.get_device_name().split()[1].lower())")-$(date +%F)" \
    ${chunks:+--chunk-sizes $chunks} \
    --providers calibkernels_fused_linear liger_fused_linear_cross_entropy cut_cross_entropy materialized_calibkernels \
    materialized_torch ${FUSED_ARGS:-} 2>"$OUT/fused.err"
}

# ResNet-50 training throughput on synthetic ImageNet-shaped data (training/README.md, "Synthetic data"): the loss
# compiled with the model, torch's own ops (the reference backend) against the fused kernels; then a CIFAR-shaped
# recipe end to end (train, evaluate, temperature, report). img/s of the last epoch (epoch 1 includes compilation),
# from the epoch's progress line; each throughput run is stopped there, before the evaluation that the last epoch
# would start (a second compilation, of the model in eval mode, then the test split), and evaluates no earlier epoch.
# TRAIN_RUNS picks the runs, TRAIN_EPOCHS their epochs, TRAIN_ARGS adds flags to them (later flags win: e.g. a small
# model for a trial of the stage on a CPU); TRAIN_CIFAR=0 leaves out the CIFAR-shaped recipe.
do_train() {
  local epochs=${TRAIN_EPOCHS:-2}
  local r50="$PY -m training.train --recipe imagenet-resnet50-finetune --synthetic --arch tv_resnet50 --batch-size 256
             --epochs $epochs --eval-every $((epochs + 1)) --compile --amp bf16 --channels-last ${TRAIN_ARGS:-}"
  local rc=0 run log pid line
  : >"$OUT/train-throughput.txt"
  # TRAIN_RUNS: "loss backend" pairs separated by commas (each one a torch.compile of ResNet-50 and its loss)
  local runs
  IFS=, read -r -a runs <<<"${TRAIN_RUNS:-cross_entropy reference,cross_entropy triton,bsce_gra triton,bsce_gra cuda}"
  for run in "${runs[@]}"; do
    set -- $run
    log="$OUT/train-r50-$1-$2.log"
    # stderr is a file, so each epoch ends with one plain progress line: "epoch E/EPOCHS  S steps  loss ... img/s"
    $r50 --loss "$1" --backend "$2" --output-dir "$OUT/train/r50-$1-$2" >"$log" 2>&1 &
    pid=$!
    line=
    while kill -0 "$pid" 2>/dev/null; do
      line=$(grep -E "^epoch $epochs/$epochs  [0-9]+ steps .* img/s" "$log" | tail -n 1)
      if [ -n "$line" ]; then kill -9 "$pid" 2>/dev/null; break; fi
      sleep 1
    done
    wait "$pid" 2>/dev/null
    [ -n "$line" ] || { line=$(grep -E "^epoch [0-9]+/$epochs  [0-9]+ steps .* img/s" "$log" | tail -n 1); rc=1; }
    echo "$1 / $2: ${line:-no epoch finished (see $log)}" | tee -a "$OUT/train-throughput.txt"
  done
  if [ "${TRAIN_CIFAR:-1}" != 0 ]; then
    $PY -m training.train --recipe cifar10-resnet50 --synthetic --epochs 2 --amp bf16 --compile --loss bsce_gra \
      --no-progress --output-dir "$OUT/train/cifar-bsce_gra" >"$OUT/train-cifar.log" 2>&1 || rc=$?
    tail -n 15 "$OUT/train-cifar.log"
  fi
  return $rc
}

export -f within_stage do_build do_test do_raise do_quick do_bench do_tune do_soft do_fused do_train do_hostprofile

for s in "$@"; do
  case $s in
    build) stage build do_build || break ;;
    test) stage test do_test ;;
    quick) stage quick do_quick ;;
    bench) stage bench do_bench ;;
    soft) stage soft do_soft ;;
    fused) stage fused do_fused ;;
    train) stage train do_train ;;
    tune) stage tune do_tune ;;
    raise) stage raise do_raise ;;
    hostprofile) stage hostprofile do_hostprofile ;;
    *) echo "unknown stage $s"; exit 2 ;;
  esac
done
printf '%s\n' "${summary[@]}" | tee "$OUT/summary.txt"
if [ -n "${PACK:-}" ]; then
  # one archive in place of the many logs and result files, to copy off the machine in one piece (tar's exit status
  # 1: a file changed while it was read, e.g. a log a stopped stage's process still wrote). Without the training's
  # checkpoints (*.pt, and their partial writes): about 100 MB each for ResNet-50, no result, and slow to compress.
  archive=$(mktemp /tmp/gpu-run.XXXXXX)
  tar -C "$OUT" -czf "$archive" --warning=no-file-changed --exclude='*.pt' --exclude='.*.pt.*.tmp' .
  if [ $? -le 1 ]; then
    find "$OUT" -mindepth 1 -delete
    mv "$archive" "$OUT/gpu-run.tgz" && printf '%s\n' "${summary[@]}" >"$OUT/summary.txt"
  fi
fi
