#!/usr/bin/env bash
# scripts/ci/gpu_check.sh: everything a GPU session runs, in one go, on a bare checkout, most
# informative first (docs/gpu-testing.md):
#   1. the machine (nvidia-smi, nvcc, commit), while everything is built for sm_90 in parallel
#   2. the kernel checks: every dev/cuda program against its CPU twin, with timings
#   3. compute-sanitizer memcheck, racecheck and initcheck on the programs of the main kernels
#   4. both trainers' smoke runs: baseline, lowmem and ckpt, a few steps each, with the memory line
#   4b. every switch of the step side by side (scripts/ci/switch_compare.sh): at a 2-layer Llama-3-8B,
#      ViT-B/16 and a 2-layer LLaMA-7B shape, the default against each switch flipped alone
#      (LLMC_ATTENTION=gemm, LLMC_CUDA_GRAPH=1, LLMC_LORA_FUSED=0|1, LLMC_HEAD_CHUNK=old, ...):
#      loss and gradient norm within bounds or identical, tokens/s; transformers + PEFT beside;
#      what does not fit the step's time is skipped, said in its row; packed examples (cuDNN's
#      ragged layout) at the demo shape (--smoke: the attention rows at the demo shape and its
#      packed twin)
#   5. a subset of the whole-model GPU-vs-CPU tests (test/cuda/test_*_cuda.py, CUDA_TEST_BACKEND=gpu)
#   6. the NCCL self-test on one GPU (LLMC_NCCL_SELFTEST=1: LoRA, then --full's ZeRO-1)
#   7. the benchmark (scripts/bench/bench_gpu.sh), if time is left
# Time: everything ends by a hard deadline, GPU_CHECK_DEADLINE_S after the start (default 540 s:
# one 10-minute device call with room for the transfers). Each step runs under `timeout` with the
# smaller of its own limit and the time left minus GPU_CHECK_MARGIN_S (default 20 s, for writing
# the results); a step that would get under 5 s is skipped. A failing step does not stop the
# others.
# Results, under $OUT when it is set (else build/gpu_check/), 5 files (a device call brings back
# at most 8): summary.md, the results table, rewritten (atomically) after every step and before
# each step starts, so a killed call keeps everything that ran and says which step was running;
# gpu_check.log, everything printed; sanitizer.txt, the first lines of every sanitizer report
# (where the first error is); switches.md, the switches' table (also in summary.md); bench.md,
# the benchmark's table. Record the outcome in dev/gpu/RESULTS.md.
# Usage: bash scripts/ci/gpu_check.sh [--smoke]
#   --smoke: the same order cut to fit 4 minutes (deadline 230 s): no probes in the build, memcheck
#   and racecheck on the attention kernels only, the lowmem smoke runs, the attention paths and the
#   graph at the demo shape, the training tests only, the NCCL self-test with LoRA, no benchmark.
# Without a GPU (test/tooling/test_gpu_check.py): GPU_CHECK_FAKE_CMD='...' replaces every step's command
# by `bash -c "$GPU_CHECK_FAKE_CMD" STEP_NAME`.
set -u
cd "$(dirname "$0")/../.." || exit 1
SMOKE=0
case "${1:-}" in
    --smoke) SMOKE=1 ;;
    "") ;;
    *) echo "gpu_check.sh: unknown argument '$1' (expected nothing or --smoke)" >&2; exit 2 ;;
esac
T0=$(date +%s)
DEADLINE=${GPU_CHECK_DEADLINE_S:-$([ $SMOKE -eq 1 ] && echo 230 || echo 540)}
MARGIN=${GPU_CHECK_MARGIN_S:-20}
FAKE=${GPU_CHECK_FAKE_CMD:-}
DEST=${OUT:-$(pwd)/build/gpu_check}
WORK=build/gpu_check_work             # step logs: never under $OUT (its file count is limited)
rm -rf "$WORK"
mkdir -p "$DEST" "$WORK"
SUMMARY="$DEST/summary.md"
SANLOG="$DEST/sanitizer.txt"
: > "$DEST/gpu_check.log"
: > "$SANLOG"
exec > >(tee -a "$DEST/gpu_check.log") 2>&1

JOBS=$(nproc 2>/dev/null || echo 8)
COMMIT=$(git rev-parse --short HEAD 2>/dev/null || echo "unknown (no .git)")
[ -n "$(git status --porcelain 2>/dev/null | grep -v '^??' | head -1)" ] && COMMIT="$COMMIT+local changes"
GPU="(not yet known)"
ROWS=()       # "step|status|seconds|detail", in the order run
RUNNING=""    # the step in progress, for the summary of a killed call

elapsed() { echo $(( $(date +%s) - T0 )); }

# The results so far, to $SUMMARY through a temporary file, so that a kill leaves the last whole one.
write_summary() {
    {
        echo "# gpu_check.sh$([ $SMOKE -eq 1 ] && echo ' --smoke') results"
        echo
        echo "- commit $COMMIT, GPU: $GPU"
        echo "- started $(date -u -d "@$T0" '+%Y-%m-%d %H:%M:%S UTC'), deadline ${DEADLINE} s, written at t=$(elapsed) s"
        if [ -n "$RUNNING" ]; then echo "- state: RUNNING $RUNNING (if this is the last summary, the call was killed there)"
        else echo "- state: ${STATE:-starting}"; fi
        echo
        echo "| step | status | s | detail |"
        echo "|---|---|---|---|"
        local r a b c d
        for r in "${ROWS[@]}"; do
            IFS='|' read -r a b c d <<< "$r"
            echo "| $a | $b | $c | $d |"
        done
        if grep -a -q '^TIME' "$WORK/kernels.log" 2>/dev/null; then
            echo
            echo "## kernel figures (H200 ceilings: copy ~4300 GB/s, dense bf16 matmul ~790 TFLOP/s)"
            echo
            echo '```'
            grep -a '^TIME' "$WORK/kernels.log" | sed 's/^TIME  *//' | head -n 80
            echo '```'
        fi
        if [ -s "$WORK/switches.md" ]; then
            echo
            echo "## switches side by side (scripts/ci/switch_compare.sh)"
            echo
            cat "$WORK/switches.md"
        fi
        if [ -s "$WORK/memory.txt" ]; then
            echo
            echo "## memory lines of the smoke runs (planned vs measured)"
            echo
            echo '```'
            cat "$WORK/memory.txt"
            echo '```'
        fi
    } > "$SUMMARY.tmp"
    mv -f "$SUMMARY.tmp" "$SUMMARY"
}

# step NAME LIMIT_S CMD...: CMD under `timeout` (at most LIMIT_S, less when the deadline is near),
# its output in $STEP_LOG and the log. Sets STEP_STATUS and STEP_SECONDS; finish_step records them.
step() {
    STEP_NAME=$1
    local limit=$2 left
    shift 2
    left=$(( DEADLINE - $(elapsed) - MARGIN ))
    [ "$limit" -gt "$left" ] && limit=$left
    STEP_LOG="$WORK/step.log"
    : > "$STEP_LOG"
    STEP_SECONDS=0
    if [ "$limit" -lt 5 ]; then
        STEP_STATUS=SKIPPED
        echo "==== $STEP_NAME: SKIPPED (t=$(elapsed) s of the ${DEADLINE} s deadline)"
        return 125
    fi
    [ -n "$FAKE" ] && set -- bash -c "$FAKE" "$STEP_NAME"
    RUNNING="'$STEP_NAME' since t=$(elapsed) s (limit $limit s): $*"
    write_summary
    echo
    echo "==== $STEP_NAME (t=$(elapsed) s, limit $limit s): $*"
    local s rc
    s=$(date +%s.%N)
    timeout -k 5 "$limit" "$@" > "$STEP_LOG" 2>&1
    rc=$?
    cat "$STEP_LOG"
    STEP_SECONDS=$(awk "BEGIN { printf \"%.1f\", $(date +%s.%N) - $s }")
    if [ $rc -eq 0 ]; then STEP_STATUS=PASS
    elif [ $rc -eq 124 ] || [ $rc -eq 137 ]; then STEP_STATUS="TIMEOUT(${limit}s)"
    else STEP_STATUS="FAIL(rc=$rc)"; fi
    echo "==== $STEP_NAME: $STEP_STATUS in ${STEP_SECONDS} s"
    RUNNING=""
    return $rc
}

# finish_step DETAIL: the row of the last step; the summary rewritten.
finish_step() {
    local detail=$1
    [ "$STEP_STATUS" = SKIPPED ] && detail="deadline: $(( DEADLINE - $(elapsed) )) s left"
    ROWS+=("$STEP_NAME|$STEP_STATUS|$STEP_SECONDS|${detail//|//}")
    STATE="between steps, after '$STEP_NAME' (if this is the last summary, the call was killed there)"
    [ "$STEP_STATUS" = SKIPPED ] || write_summary  # past the deadline only the final summary is written
}

# row NAME STATUS SECONDS DETAIL: a row that is not a step of its own (a kernel program's result).
row() { ROWS+=("$1|$2|$3|${4//|//}"); }

# The first N lines of a file that match a pattern, joined by ' ; ' (for a table cell).
first_lines() { grep -a -E "$2" "$1" 2>/dev/null | head -n "$3" | sed 's/  */ /g' | tr '\n' ';' | sed 's/;$//; s/;/ ; /g'; }

# ---- 1. the machine, while everything is built ------------------------------------------------
machine_info() {
    if [ -n "$FAKE" ]; then bash -c "$FAKE" machine; return; fi
    timeout 20 nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap --format=csv,noheader 2>&1 | head -n 1
    timeout 20 nvcc --version 2>&1 | grep -o 'release [0-9.]*' || echo "nvcc not on PATH"
    timeout 20 nvidia-smi 2>&1 | head -n 20
}
echo "gpu_check.sh$([ $SMOKE -eq 1 ] && echo ' --smoke'): $(date -u '+%Y-%m-%d %H:%M:%S UTC'), commit $COMMIT, deadline ${DEADLINE} s"
write_summary
export -f machine_info
export FAKE
MACHINE_LIMIT=$(( DEADLINE - MARGIN < 30 ? DEADLINE - MARGIN : 30 ))
timeout -k 2 "$MACHINE_LIMIT" bash -c machine_info > "$WORK/machine.txt" 2>&1 &
MACHINE_PID=$!
BUILD=(cuda-dev train_llama train_vit)
[ $SMOKE -eq 0 ] && BUILD+=(build/test/llama_probe build/test/vit_probe)
step "build for sm_90 (make -k -j$JOBS)" 420 make -k -j"$JOBS" GPU_ARCH=90 "${BUILD[@]}"
BUILD_STATUS=$STEP_STATUS BUILD_SECONDS=$STEP_SECONDS
BUILD_DETAIL="$(first_lines "$STEP_LOG" '^make: (nvcc|MPI|NCCL)' 3) $(first_lines "$STEP_LOG" 'error' 3)"
wait $MACHINE_PID
GPU=$(head -n 1 "$WORK/machine.txt")
[ -n "$GPU" ] || GPU="none found"
STEP_NAME="machine" STEP_STATUS=$([ -s "$WORK/machine.txt" ] && echo PASS || echo FAIL) STEP_SECONDS=0
finish_step "$(head -n 2 "$WORK/machine.txt" | tr '\n' ';')"
STEP_NAME="build for sm_90 (${BUILD[*]})" STEP_STATUS=$BUILD_STATUS STEP_SECONDS=$BUILD_SECONDS
finish_step "$BUILD_DETAIL"

# ---- 2. the kernel checks ---------------------------------------------------------------------
step "kernel checks (make test-gpu-kernels)" 240 make GPU_ARCH=90 test-gpu-kernels
cp "$STEP_LOG" "$WORK/kernels.log"
finish_step "each dev/cuda program below"
for line in $(grep -a -o '^test-gpu: dev/cuda/[a-z_]* rc=[0-9]*' "$WORK/kernels.log" | tr ' ' '#'); do
    prog=$(echo "$line" | sed 's/^test-gpu:#//; s/#rc=.*//')
    full=$(grep -a "^test-gpu: $prog rc=" "$WORK/kernels.log" | tail -n 1)
    rc=${line##*rc=}
    secs=$(echo "$full" | sed -n 's/.* seconds=\([0-9.]*\).*/\1/p')
    last=$(echo "$full" | sed 's/.* seconds=[0-9.]* //')
    blog="build/$(basename "$prog").gpu.log"
    if [ "$rc" = 0 ]; then row "  $prog" PASS "$secs" "$last"
    else row "  $prog" "FAIL(rc=$rc)" "$secs" "$last $(first_lines "$blog" '^(FAIL|error)' 3)"; fi
done
write_summary

# ---- 3. compute-sanitizer on the main kernels -------------------------------------------------
SAN=$(command -v compute-sanitizer || ls /usr/local/cuda/bin/compute-sanitizer 2>/dev/null || true)
[ -n "$FAKE" ] && SAN=compute-sanitizer
if [ $SMOKE -eq 1 ]; then
    SAN_RUNS="memcheck:attention racecheck:attention"
    SAN_BUDGET=40
else  # memcheck where the indexing is; racecheck where shared memory is; initcheck on the outputs
    SAN_RUNS="memcheck:attention memcheck:norms memcheck:loss memcheck:activations memcheck:misc memcheck:adamw
              racecheck:attention racecheck:norms racecheck:loss racecheck:common initcheck:attention initcheck:loss initcheck:norms"
    SAN_BUDGET=170
fi
SAN_END=$(( $(elapsed) + SAN_BUDGET ))
for run in $SAN_RUNS; do
    tool=${run%%:*} prog=dev/cuda/${run#*:}
    if [ -z "$SAN" ] || { [ -z "$FAKE" ] && [ ! -x "$prog" ]; }; then
        row "$tool $prog" "NOT RUN" 0 "$([ -z "$SAN" ] && echo 'compute-sanitizer not found' || echo "$prog was not built")"
        write_summary
        continue
    fi
    limit=$(( SAN_END - $(elapsed) ))
    [ $limit -gt 60 ] && limit=60
    step "$tool $prog" $limit env LLMC_DEV_NO_TIMING=1 "$SAN" --tool "$tool" --error-exitcode 3 --print-limit 20 "./$prog"
    # the first lines of the report (the banner skipped): where the first error is
    { echo "== $tool $prog: $STEP_STATUS"; grep -a '^=========' "$STEP_LOG" | grep -a -v 'COMPUTE-SANITIZER' | head -n 24; echo; } >> "$SANLOG"
    finish_step "$(first_lines "$STEP_LOG" '(ERROR|RACECHECK) SUMMARY' 1) $(first_lines "$STEP_LOG" '^========= [A-Z][a-z]+' 1)"
done

# ---- 4. both trainers' smoke runs -------------------------------------------------------------
LLAMA=(./train_llama --model data/llama_demo --data data/llama_demo_ft_train.bin --batch 4 --seq 128 --lora-rank 8)
VIT=(./train_vit --model data/vit_demo --data data/vit_demo_ft_train.bin --batch 16 --lora-rank 4)
MODES="baseline lowmem ckpt"
[ $SMOKE -eq 1 ] && MODES="lowmem"
for t in llama vit; do
    for mode in $MODES; do
        if [ $t = llama ]; then cmd=("${LLAMA[@]}"); else cmd=("${VIT[@]}"); fi
        step "smoke $t --mode $mode" 60 "${cmd[@]}" --device cuda --mode "$mode" --steps 3 --lr 1e-3
        mem=$(grep -a '^memory: ' "$STEP_LOG" | tail -n 1)
        [ -n "$mem" ] && echo "$t $mode: $mem" >> "$WORK/memory.txt"
        finish_step "$(grep -a -E '^step +3/3' "$STEP_LOG" | tail -n 1 | cut -c1-60) $(echo "$mem" | sed 's/ (cudaMemGetInfo[^)]*)//') $(first_lines "$STEP_LOG" '^error' 1)"
    done
done

# ---- 4b. every switch side by side ---------------------------------------------------------------
# The default against each switch flipped alone (scripts/ci/switch_compare.sh: loss and gradient norm
# within the emulator tests' bounds, or identical where only the arguments' source changes; tokens/s;
# transformers + PEFT beside), most informative first; the script's budget ends 10 s before the
# step's limit, so that what did not fit is skipped with its reason, not cut. --smoke: the
# attention paths and the graph at the demo shape.
SW_LIMIT=$([ $SMOKE -eq 1 ] && echo 90 || echo 240)
SW_LEFT=$(( DEADLINE - $(elapsed) - MARGIN ))
[ "$SW_LEFT" -lt "$SW_LIMIT" ] && SW_LIMIT=$SW_LEFT
if [ $SMOKE -eq 1 ]; then SW_ARGS=(env SWITCH_COMPARE_ONLY="default gemm graph gemm+graph" SWITCH_COMPARE_HF=0); SW_SHAPES="demo packed"
else SW_ARGS=(env); SW_SHAPES=all; fi
step "switches side by side ($SW_SHAPES)" "$SW_LIMIT" "${SW_ARGS[@]}" OUT="$DEST" SWITCH_COMPARE_BUDGET_S=$(( SW_LIMIT - 10 )) \
    bash scripts/ci/switch_compare.sh $SW_SHAPES
grep -a '^|' "$STEP_LOG" > "$WORK/switches.md"
finish_step "$(grep -a -c '| PASS |' "$STEP_LOG") runs passed, $(grep -a -c '| SKIPPED |' "$STEP_LOG") skipped; $(first_lines "$STEP_LOG" '(FAIL|TIMEOUT|OUT OF BOUNDS|DIFFERS)' 3)"

# ---- 5. the whole-model tests, GPU against CPU ------------------------------------------------
# cuda_attention: the in-house paths and cuDNN's (test_cuda_attention_cudnn), gradients against the CPU;
# cuda_graph: LLMC_CUDA_GRAPH=1 bit for bit against the eager step, and a real capture refusing a readback
if [ $SMOKE -eq 1 ]; then K=${GPU_CHECK_PYTEST_K:-"training_tracks_cpu or attention_cudnn"}
else K=${GPU_CHECK_PYTEST_K:-"training_tracks_cpu or probe_matches_cpu_probe or probe_cuda_matches_cpu or full_finetuning or cuda_attention or cuda_graph"}; fi
step "whole models GPU vs CPU (pytest -k '$K')" 200 env CUDA_TEST_BACKEND=gpu PYTHONUNBUFFERED=1 python3 -m pytest -v -p no:cacheprovider \
    test/cuda/test_llama_cuda.py test/cuda/test_vit_cuda.py -k "$K"
finish_step "$(grep -a -c ' PASSED' "$STEP_LOG") passed, $(grep -a -c ' FAILED' "$STEP_LOG") failed so far; $(first_lines "$STEP_LOG" '^(FAILED|ERROR) ' 3)"

# ---- 6. the NCCL self-test on one GPU ---------------------------------------------------------
NCCL_RUNS=("LoRA:")
[ $SMOKE -eq 0 ] && NCCL_RUNS+=("--full (ZeRO-1):--full --lr 1e-3")
for r in "${NCCL_RUNS[@]}"; do
    # shellcheck disable=SC2086  # the flags split into words on purpose
    step "NCCL self-test, one rank, ${r%%:*}" 60 env LLMC_NCCL_SELFTEST=1 "${LLAMA[@]}" --device cuda --steps 3 ${r#*:}
    finish_step "$(first_lines "$STEP_LOG" '^(data parallel|step +3/3|error)' 3)"
done

# ---- 7. the benchmark, if time is left --------------------------------------------------------
if [ $SMOKE -eq 0 ]; then
    step "benchmark (scripts/bench/bench_gpu.sh)" 300 env BENCH_STEPS="${BENCH_STEPS:-5}" OUT="$DEST" bash scripts/bench/bench_gpu.sh
    finish_step "table in bench.md"
fi

STATE="finished at t=$(elapsed) s (deadline ${DEADLINE} s); $(ls "$DEST" | wc -l) files under $DEST: $(ls "$DEST" | tr '\n' ' ')"
write_summary
echo
cat "$SUMMARY"
echo "(summary: $SUMMARY; full log: $DEST/gpu_check.log; sanitizer reports: $SANLOG)"
exec >&- 2>&-
wait  # let tee finish writing the log
