#!/usr/bin/env bash
# scripts/ci/gpu_check.sh: everything a GPU session runs, in one go, on a bare checkout (see
# docs/gpu-testing.md). About 9 minutes on an H200, most important first:
#   1. the machine: nvidia-smi, nvcc, commit
#   2. one parallel build for sm_90: every dev/cuda check, both trainers, both probes
#   3. make test-gpu-kernels: each kernel family against its CPU twin, with timings
#   4. make test-gpu-models: both trainers, CUDA against the CPU backend in every mode, with the
#      measured device memory against the plan (test/test_cuda_*.py, CUDA_TEST_BACKEND=gpu)
#   5. the NCCL path on one GPU (LLMC_NCCL_SELFTEST=1)
#   6. scripts/bench/bench_gpu.sh: LLaMA-7B shape and ViT-B/16, baseline / lowmem / ckpt
#   7. any failing kernel program again with synchronous launches (LLMC_CUDA_SYNC=1)
#   8. compute-sanitizer memcheck on every check, racecheck on the shared-memory kernels
# Each step is timed and a failing step does not stop the later ones; steps 6-8 are skipped once
# GPU_CHECK_BUDGET_S (default 420) seconds have gone, so the whole fits one 10-minute call. A results
# table (steps, then the kernel figures and the benchmark) is printed last and written, with the
# full log, to $OUT when it is set (else build/gpu_check/). Record the outcome in
# dev/gpu/RESULTS.md.
# Usage: bash scripts/ci/gpu_check.sh            (from the repository root or anywhere inside it)
set -u
cd "$(dirname "$0")/../.." || exit 1
ROOT=$(pwd)
DEST=${OUT:-$ROOT/build/gpu_check}
mkdir -p "$DEST" "$ROOT/build"
LOG="$DEST/gpu_check.log"
TABLE="$DEST/gpu_check_results.md"
: > "$LOG"
exec > >(tee -a "$LOG") 2>&1

T_START=$(date +%s)
BUDGET_S=${GPU_CHECK_BUDGET_S:-420}   # optional steps are skipped once this much time has gone
JOBS=$(nproc 2>/dev/null || echo 8)
ROWS=()                               # "step|status|seconds|detail"

elapsed() { echo $(( $(date +%s) - T_START )); }
row() { ROWS+=("$1|$2|$3|$4"); }

# run_step NAME TIMEOUT_S CMD...: runs CMD with a timeout, logs it, records PASS/FAIL/TIMEOUT.
run_step() {
    local name=$1 limit=$2; shift 2
    echo
    echo "==== $name ($(date -u +%H:%M:%S), t=$(elapsed)s): $*"
    local s=$(date +%s.%N)
    timeout "$limit" "$@"
    local rc=$?
    STEP_SECONDS=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $s }")
    if [ $rc -eq 0 ]; then STEP_STATUS=PASS; elif [ $rc -eq 124 ]; then STEP_STATUS=TIMEOUT; else STEP_STATUS="FAIL(rc=$rc)"; fi
    echo "==== $name: $STEP_STATUS in ${STEP_SECONDS}s"
    return $rc
}

# ---- 1. the machine -----------------------------------------------------------------------------
echo "gpu_check.sh: $(date -u '+%Y-%m-%d %H:%M:%S UTC')"
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no .git)")
DIRTY=$(git status --porcelain 2>/dev/null | grep -v '^??' | head -1)
[ -n "$DIRTY" ] && COMMIT="$COMMIT+local changes"
echo "commit: $COMMIT"
GPU="none found"
if run_step "nvidia-smi" 30 nvidia-smi; then
    GPU=$(nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>/dev/null | head -1)
    row "nvidia-smi" PASS "$STEP_SECONDS" "$GPU"
else
    row "nvidia-smi" "$STEP_STATUS" "$STEP_SECONDS" "no GPU visible: everything below will fail"
fi
HAVE_NVCC=0
if command -v nvcc >/dev/null 2>&1; then
    HAVE_NVCC=1
    NVCC_VER=$(nvcc --version | tail -n 2 | head -n 1)
    echo "nvcc: $NVCC_VER"
    row "nvcc" PASS 0 "$NVCC_VER"
else
    row "nvcc" FAIL 0 "nvcc not on PATH: cannot build (prebuilt dev/cuda binaries are used if present)"
fi

# ---- 2. build -----------------------------------------------------------------------------------
BUILD_OK=0
if [ $HAVE_NVCC -eq 1 ]; then  # -k: one program that does not compile leaves the others to run
    run_step "build (sm_90)" 300 make -k -j"$JOBS" GPU_ARCH=90 cuda-dev train_llama train_vit test/llama_probe test/vit_probe && BUILD_OK=1
    row "build dev/cuda, trainers, probes for sm_90" "$STEP_STATUS" "$STEP_SECONDS" "make -k -j$JOBS GPU_ARCH=90 cuda-dev train_llama train_vit test/*_probe"
fi
BINS=()
for src in dev/cuda/*.cu; do
    b=${src%.cu}
    [ -x "$b" ] && BINS+=("$b")
done
echo "built: ${BINS[*]:-nothing}"

# ---- 3. make test-gpu-kernels -------------------------------------------------------------------
if [ $BUILD_OK -eq 1 ]; then
    run_step "make test-gpu-kernels" 300 make GPU_ARCH=90 test-gpu-kernels
    row "make test-gpu-kernels" "$STEP_STATUS" "$STEP_SECONDS" "each dev/cuda program below"
else  # no compiler, or a build failure: run whatever binaries exist, the way test-gpu would
    for b in "${BINS[@]}"; do
        log="build/$(basename "$b").gpu.log"
        s=$(date +%s.%N); timeout 120 "./$b" > "$log" 2>&1; rc=$?; cat "$log"
        echo "test-gpu: $b rc=$rc seconds=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $s }") $(tail -n 1 "$log")"
    done
fi
FAILED_BINS=()
for b in "${BINS[@]}"; do
    line=$(grep -a "^test-gpu: $b rc=" "$LOG" | tail -n 1)
    if [ -z "$line" ]; then row "  $b" "NOT RUN" 0 ""; FAILED_BINS+=("$b"); continue; fi
    rc=$(echo "$line" | sed -n 's/.* rc=\([0-9]*\) .*/\1/p')
    secs=$(echo "$line" | sed -n 's/.* seconds=\([0-9.]*\) .*/\1/p')
    last=$(echo "$line" | sed 's/.* seconds=[0-9.]* //')
    if [ "$rc" = "0" ]; then row "  $b" PASS "$secs" "$last"
    else  # the counts if it got to the end, else the error that stopped it; then the first FAILs
        blog="build/$(basename "$b").gpu.log"
        grep -aq 'passed, .* failed$' "$blog" 2>/dev/null || last=$(grep -a '^error:' "$blog" 2>/dev/null | tail -n 1)
        fails=$(grep -a '^FAIL' "$blog" 2>/dev/null | head -3 | sed 's/  */ /g' | tr '\n' ';')
        row "  $b" "FAIL(rc=$rc)" "$secs" "$last $fails"
        FAILED_BINS+=("$b")
    fi
done

# ---- 4-6. the trainers on the GPU ---------------------------------------------------------------
if [ -x ./train_llama ] && [ -x ./test/llama_probe ]; then
    run_step "make test-gpu-models" 300 make GPU_ARCH=90 test-gpu-models
    row "whole models, CUDA vs CPU backend, every mode; measured vs planned memory" "$STEP_STATUS" "$STEP_SECONDS" \
        "$(grep -a -v '^====' "$LOG" | grep -a -E '(passed|failed|error)' | tail -n 1); $(grep -a -E '^(FAILED|ERROR) ' "$LOG" | head -n 3 | tr '\n' ';')"
    # a one-rank communicator: LoRA's gradients all-reduced, --full's reduce-scattered with the fp32
    # master sharded and the bf16 weights all-gathered (test_cuda_nccl_selftest_one_rank_changes_nothing,
    # in the step above, also checks both equal a plain run bit for bit)
    run_step "NCCL on one GPU" 120 env LLMC_NCCL_SELFTEST=1 ./train_llama --model data/llama_demo --data data/llama_demo_ft_train.bin \
        --device cuda --steps 3 --batch 4 --seq 128
    row "NCCL path, one rank (LLMC_NCCL_SELFTEST=1), LoRA" "$STEP_STATUS" "$STEP_SECONDS" "$(grep -a -E '^data parallel|step    3/3' "$LOG" | tail -n 2 | tr '\n' ' ')"
    run_step "NCCL on one GPU, --full" 120 env LLMC_NCCL_SELFTEST=1 ./train_llama --model data/llama_demo --data data/llama_demo_ft_train.bin \
        --device cuda --steps 3 --batch 4 --seq 128 --full --lr 1e-3
    row "NCCL path, one rank (LLMC_NCCL_SELFTEST=1), --full (ZeRO-1)" "$STEP_STATUS" "$STEP_SECONDS" "$(grep -a -E '^data parallel|step    3/3' "$LOG" | tail -n 2 | tr '\n' ' ')"
    if [ "$(elapsed)" -gt "$BUDGET_S" ]; then
        row "bench (7B-shaped LLaMA, ViT-B/16)" SKIPPED 0 "time budget"
    else
        run_step "bench" 300 env BENCH_STEPS=${BENCH_STEPS:-5} bash scripts/bench/bench_gpu.sh
        row "bench (7B-shaped LLaMA, ViT-B/16; table below)" "$STEP_STATUS" "$STEP_SECONDS" "build/bench/bench.md"
    fi
else
    row "trainers on the GPU" "NOT RUN" 0 "the build did not produce ./train_llama and test/llama_probe"
fi

# ---- 7. failures again, launches synchronous ----------------------------------------------------
for b in "${FAILED_BINS[@]}"; do
    [ -x "$b" ] || continue
    if [ "$(elapsed)" -gt "$BUDGET_S" ]; then row "sync rerun $b" SKIPPED 0 "time budget"; continue; fi
    run_step "rerun $b, LLMC_CUDA_SYNC=1" 120 env LLMC_CUDA_SYNC=1 LLMC_DEV_NO_TIMING=1 "./$b"
    err=$(grep -a '^error:' "$LOG" | tail -n 1)
    row "sync rerun $b" "$STEP_STATUS" "$STEP_SECONDS" "${err:-no CUDA error reported}"
done

# ---- 8. compute-sanitizer -----------------------------------------------------------------------
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
if [ -z "$SAN" ]; then
    row "compute-sanitizer" SKIPPED 0 "not installed"
else
    for b in "${BINS[@]}"; do
        if [ "$(elapsed)" -gt "$BUDGET_S" ]; then row "memcheck $b" SKIPPED 0 "time budget"; continue; fi
        slog="build/$(basename "$b").memcheck.log"
        run_step "memcheck $b" 60 env LLMC_DEV_NO_TIMING=1 "$SAN" --tool memcheck --error-exitcode 3 "./$b" > "$slog" 2>&1
        st=$STEP_STATUS; sec=$STEP_SECONDS
        tail -n 3 "$slog"
        row "memcheck $b" "$st" "$sec" "$(grep -a 'ERROR SUMMARY' "$slog" | tail -n 1)"
    done
    for name in attention common norms loss; do  # the kernels that use shared memory
        b=dev/cuda/$name
        [ -x "$b" ] || continue
        if [ "$(elapsed)" -gt "$BUDGET_S" ]; then row "racecheck $b" SKIPPED 0 "time budget"; continue; fi
        slog="build/$name.racecheck.log"
        run_step "racecheck $b" 60 env LLMC_DEV_NO_TIMING=1 "$SAN" --tool racecheck --error-exitcode 3 "./$b" > "$slog" 2>&1
        st=$STEP_STATUS; sec=$STEP_SECONDS
        tail -n 3 "$slog"
        row "racecheck $b" "$st" "$sec" "$(grep -a 'RACECHECK SUMMARY\|ERROR SUMMARY' "$slog" | tail -n 1)"
    done
fi

# ---- results table ------------------------------------------------------------------------------
{
    echo "# gpu_check results"
    echo
    echo "- date: $(date -u '+%Y-%m-%d %H:%M UTC')"
    echo "- commit: $COMMIT"
    echo "- GPU: $GPU"
    echo "- total: $(elapsed) s"
    echo
    echo "| step | status | s | detail |"
    echo "|---|---|---|---|"
    for r in "${ROWS[@]}"; do
        IFS='|' read -r a b c d <<< "$r"
        echo "| $a | $b | $c | ${d//|//} |"
    done
    echo
    echo "## kernel figures (H200 ceilings: copy ~4300 GB/s, dense bf16 matmul ~790 TFLOP/s)"
    echo
    echo '```'
    grep -a -h '^TIME' build/*.gpu.log 2>/dev/null | sed 's/^TIME  //' || true
    echo '```'
    echo
    [ -f build/bench/bench.md ] && sed 's/^# /## /' build/bench/bench.md
} > "$TABLE.tmp"
mv "$TABLE.tmp" "$TABLE"
echo
echo "==================================================================================================="
cat "$TABLE"
echo "(table: $TABLE; full log: $LOG)"
exec >&- 2>&-
wait  # let tee finish writing the log
