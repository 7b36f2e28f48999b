#!/usr/bin/env bash
# The paper's LLaMA recipe (QLoRA's, with the paper's lowmem layers) at toy scale, runnable on a
# laptop: NF4 frozen weights (--quant nf4), --mode lowmem, LoRA r=64 alpha=16 with dropout 0.1 on
# every linear of every block (the head is never adapted), gradient clipping at 0.3, a constant
# learning rate (--warmup 0 --min-lr-frac 1), on instruction data whose loss counts the responses
# only (scripts/data/prepare_text.py's JSONL shards). The instruction set is made here: "Repeat:
# <words>" answered by the words, a task a small model learns within a few dozen steps.
#
# Environment: MODEL (default data/llama_demo: the bundled tiny model; any model directory with a
# tokenizer.bin or tokenizer.json, e.g. stories260K exported by scripts/export/export_llama.py),
# OUT (build/recipe), STEPS (60), BATCH (8), SEQ (128), LR (2e-4 is the paper's for 7B; the toy
# model needs more: default 3e-3), DEVICE (auto), THREADS (0 = all cores).
# Without --quant nf4 in this build of train_llama the run says so and keeps the frozen weights as
# they are; everything else is the recipe.
set -euo pipefail
cd "$(dirname "$0")/../.."
PYTHON=${PYTHON:-/usr/bin/python3}
MODEL=${MODEL:-data/llama_demo}
OUT=${OUT:-build/recipe}
STEPS=${STEPS:-60}
BATCH=${BATCH:-8}
SEQ=${SEQ:-128}
LR=${LR:-3e-3}
DEVICE=${DEVICE:-auto}
THREADS=${THREADS:-0}
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
TOK=$MODEL/tokenizer.json
[ -f "$TOK" ] || TOK=$MODEL/tokenizer.bin
[ -f "$TOK" ] || { echo "recipe: $MODEL has no tokenizer.json or tokenizer.bin" >&2; exit 1; }
mkdir -p "$OUT"

# 600 instructions: "Repeat: w1 w2 ..." -> "w1 w2 ...", 3 to 6 words from a fixed list (seeded)
"$PYTHON" - "$OUT/instructions.jsonl" <<'EOF'
import json, random, sys
words = ("license software copyright permission notice warranty source code free use copy modify "
         "merge publish distribute sell rights holders work terms conditions").split()
rng = random.Random(0)
with open(sys.argv[1], "w") as f:
    for _ in range(600):
        w = " ".join(rng.choice(words) for _ in range(rng.randint(3, 6)))
        f.write(json.dumps({"prompt": f"Repeat: {w}\n", "response": w}) + "\n")
EOF
"$PYTHON" scripts/data/prepare_text.py --tokenizer "$TOK" --input "$OUT/instructions.jsonl" --out "$OUT/instr" \
    --chat-template none --val-frac 0.1

QUANT=()
if ./train_llama --help | grep -- '--quant ' > /dev/null; then  # not -q: an early exit would fail the pipe
    QUANT=(--quant nf4)
else
    echo "recipe: this train_llama has no --quant flag (NF4 frozen weights): running the rest of the recipe without it"
fi
RECIPE=(--mode lowmem --lora-rank 64 --lora-alpha 16 --lora-dropout 0.1 --lora-targets q,k,v,o,gate,up,down
        --grad-clip 0.3 --lr "$LR" --warmup 0 --min-lr-frac 1 --weight-decay 0)
echo "recipe: ./train_llama --model $MODEL ${QUANT[*]} ${RECIPE[*]} ..."
rm -rf "$OUT/run"  # a new run: the trainer refuses an --out that holds an earlier one
./train_llama --model "$MODEL" "${QUANT[@]}" "${RECIPE[@]}" --data "$OUT/instr_train.bin" --val "$OUT/instr_val.bin" \
    --steps "$STEPS" --batch "$BATCH" --seq "$SEQ" --val-every 20 --device "$DEVICE" --threads "$THREADS" --out "$OUT/run"
