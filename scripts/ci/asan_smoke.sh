#!/usr/bin/env bash
# Runs the sanitizer builds (make test-asan: AddressSanitizer + UndefinedBehaviorSanitizer, leak
# checks on) through every mode and output of both trainers and through bad inputs, on the
# bundled demo data. Any sanitizer report fails the run. Usage: scripts/ci/asan_smoke.sh BUILD_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build/asan}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 OMP_NUM_THREADS=2
fails=0; runs=0
check() {  # expected-exit-code command...
    local want=$1; shift
    runs=$((runs + 1))
    "$@" > "$W/log" 2>&1; local rc=$?
    if grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error' "$W/log" || { [ "$want" = 0 ] && [ $rc != 0 ]; } || { [ "$want" = 1 ] && [ $rc != 1 ]; }; then
        fails=$((fails + 1)); echo "FAIL (rc=$rc, expected $want): $*"; grep -E 'ERROR|runtime error|error:' "$W/log" | head -5
    else
        local c="$*"
        [ ${#c} -gt 110 ] && c="...${c: -107}"
        echo "PASS  $c"
    fi
}
L="$B/train_llama --model data/llama_demo --data data/llama_demo_ft_train.bin --val data/llama_demo_ft_val.bin --steps 2 --batch 2 --seq 64 --val-batches 1"
check 0 $L --mode lowmem --out "$W/a" --generate 8 --prompt Licensed
check 0 $L --mode ckpt
check 0 $L --mode baseline --swiglu-product recompute --grad-accum 2
check 0 $L --full --out "$W/f" --stop-at 1
check 0 $L --full --resume "$W/f"
check 0 $L --adapter "$W/a" --export-merged "$W/m" --steps 1
check 0 $B/train_llama --model "$W/m" --val data/llama_demo_ft_val.bin --eval-only --seq 64 --batch 2
check 0 $B/train_llama --model data/llama_demo --dry-run --json --batch 2 --seq 64
check 1 $B/train_llama --model data/llama_demo --data data/llama_demo/config.json
check 1 $B/train_llama --model data --generate 3
check 1 $L --resume "$W/a" --lora-rank 4
check 1 $B/train_llama --model data/llama_demo --data data   # a directory where a file is expected
mkdir -p "$W/ad" && cp "$W/a/adapter_config.json" "$W/ad/" && mkdir "$W/ad/adapter_model.safetensors"
check 1 $L --adapter "$W/ad"
V="$B/train_vit --model data/vit_demo --data data/vit_demo_ft_train.bin --val data/vit_demo_ft_val.bin --steps 2 --batch 8 --val-batches 1"
check 0 $V --mode lowmem --out "$W/v" --export-merged "$W/vm"
check 0 $V --mode ckpt --lora-targets q,v
check 0 $V --full --mode baseline
check 0 $B/train_vit --model "$W/vm" --val data/vit_demo_ft_val.bin --eval-only --batch 8 --val-batches 1
check 1 $B/train_vit --model data/vit_demo --data data/llama_demo_ft_train.bin
check 1 $B/train_vit --model data/vit_demo --data data
check 0 $B/test_units
echo "asan-smoke: $((runs - fails)) passed, $fails failed"
[ $fails = 0 ]
