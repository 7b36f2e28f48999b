#!/usr/bin/env bash
# scripts/bench/bench_gpu.sh (make bench): speed and memory of the CUDA backend on the shapes the paper
# measures, each in baseline, lowmem and ckpt modes, side by side:
#   - LLaMA-2-7B shape (d 4096, f 11008, 32 layers, 32 heads, vocab 32000), LoRA r=16 on all seven
#     linears, batch 1 x seq 2048 (BENCH_LLAMA_BATCH / BENCH_LLAMA_SEQ to change)
#   - ViT-B/16 (d 768, f 3072, 12 layers, 224 px), LoRA r=4 on all linears, batch 64
# Weights are random (--random-init: a config.json alone, no download); the data is random tokens
# and pixels (scripts/bench/bench_data.py). Reported per run: throughput over the timed steps (after
# BENCH_WARMUP steps), MFU against 989 TFLOP/s dense bf16 (H100/H200 SXM) with FLOPs per token
# = 4 N (forward 2N + input gradients 2N: LoRA trains no frozen weight) + attention 6 T d per
# layer (causal QK^T, PV and their four backward products, halved for the mask; 12 T d for ViT's
# bidirectional attention), the planned saved-activation bytes and the device memory the run
# measured (cudaMemGetInfo after training: every arena is allocated up front and held, so this
# is the peak). Beside them, the same configs in Hugging Face transformers + PEFT
# (scripts/bench/bench_hf.py: bf16 weights, fp32 adapters under autocast, SDPA attention; plain and with
# gradient checkpointing; BENCH_HF=0 skips them), the comparison of docs/gpu-testing.md.
# Writes build/bench/bench.md (and $OUT/bench.md when OUT is set). `make bench` then runs
# scripts/ci/switch_compare.sh: every switch of the step side by side, transformers + PEFT beside.
# Usage: bash scripts/bench/bench_gpu.sh [llama|vit|all]    (a GPU and an nvcc build are required)
set -u
cd "$(dirname "$0")/../.." || exit 1
WHAT=${1:-all}
STEPS=${BENCH_STEPS:-8}
WARM=${BENCH_WARMUP:-3}
LB=${BENCH_LLAMA_BATCH:-1}
LS=${BENCH_LLAMA_SEQ:-2048}
VB=${BENCH_VIT_BATCH:-64}
PY=$(command -v python3)
D=build/bench
mkdir -p "$D/llama7b" "$D/vitb16"
ROWS=()

cat > "$D/llama7b/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 11008,
 "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 32, "vocab_size": 32000,
 "rms_norm_eps": 1e-05, "rope_theta": 10000.0, "max_position_embeddings": 4096, "tie_word_embeddings": false,
 "hidden_act": "silu", "torch_dtype": "bfloat16"}
EOF
cat > "$D/vitb16/config.json" <<'EOF'
{"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": 768, "intermediate_size": 3072,
 "num_hidden_layers": 12, "num_attention_heads": 12, "image_size": 224, "patch_size": 16, "num_channels": 3,
 "layer_norm_eps": 1e-12, "hidden_act": "gelu", "qkv_bias": true, "torch_dtype": "float32"}
EOF

# mean of the per-step throughput figures after the warm-up steps
rate() { grep -o "| [0-9]* $1/s" | awk -v w="$WARM" '{ n++; if (n > w) { s += $2; k++ } } END { if (k) printf "%.0f", s / k; else print "n/a" }'; }

bench_run() {  # model mode unit flops_per_item command...
    local model=$1 mode=$2 unit=$3 fpi=$4; shift 4
    local log="$D/$model.$mode.log"
    echo "== $model $mode: $*"
    timeout 900 "$@" > "$log" 2>&1
    local rc=$?
    tail -n 4 "$log"
    local r plan saved meas mfu
    r=$(rate "$unit" < "$log")
    plan=$(sed -n 's/memory: planned \([0-9.]*\) MiB.*/\1/p' "$log" | tail -n 1)
    saved=$(sed -n 's/.*saved activations \([0-9.]*\) MiB).*/\1/p' "$log" | tail -n 1)
    meas=$(sed -n 's/.* \([0-9.]*\) MiB$/\1/p' "$log" | tail -n 1)
    mfu=$(awk -v r="$r" -v f="$fpi" 'BEGIN { if (r + 0 > 0) printf "%.1f%%", 100 * r * f / 989e12; else print "n/a" }')
    [ $rc -eq 0 ] || r="FAIL(rc=$rc)"
    ROWS+=("$model|$mode|$r $unit/s|$mfu|${saved:-?}|${plan:-?}|${meas:-?}")
}

hf_run() {  # model kind mode unit flops_per_item bench_hf.py-arguments...: the same config in transformers + PEFT
    local model=$1 kind=$2 mode=$3 unit=$4 fpi=$5; shift 5
    local log="$D/$model.hf-$mode.log"
    [ "${BENCH_HF:-1}" = 1 ] || return 0
    echo "== $model transformers+PEFT $mode"
    timeout 600 $PY scripts/bench/bench_hf.py --model "$D/$model" "$kind" --mode "$mode" --steps "$STEPS" --warmup "$WARM" "$@" > "$log" 2>&1
    local rc=$? line r peak mfu
    line=$(grep '^HF ' "$log" | tail -n 1)
    echo "${line:-$(tail -n 3 "$log")}"
    r=$(echo "$line" | sed -n "s/.*: \([0-9]*\) $unit\/s.*/\1/p")
    peak=$(echo "$line" | sed -n 's/.*peak \([0-9.]*\) MiB.*/\1/p')
    mfu=$(awk -v r="${r:-0}" -v f="$fpi" 'BEGIN { if (r + 0 > 0) printf "%.1f%%", 100 * r * f / 989e12; else print "n/a" }')
    [ $rc -eq 0 ] && [ -n "$r" ] || r="FAIL(rc=$rc)"
    ROWS+=("$model|transformers+PEFT, $mode|${r} $unit/s|$mfu|-|-|${peak:-?} (torch peak allocated)")
}

if [ "$WHAT" = all ] || [ "$WHAT" = llama ]; then
    [ -f "$D/tokens.bin" ] || $PY scripts/bench/bench_data.py tokens "$D/tokens.bin" 32000 $(( (STEPS + 2) * LB * (LS + 1) ))
    # N = 6.74e9 parameters; attention 6 * T * d * layers per token
    F=$(awk -v T="$LS" 'BEGIN { printf "%.0f", 4 * 6.738e9 + 6 * T * 4096 * 32 }')
    for mode in baseline lowmem ckpt; do
        bench_run llama7b $mode tok "$F" ./train_llama --model "$D/llama7b" --random-init --device cuda --data "$D/tokens.bin" \
            --mode $mode --batch "$LB" --seq "$LS" --steps "$STEPS" --lora-rank 16 --lora-alpha 32 --lr 1e-4
    done
    for mode in plain ckpt; do hf_run llama7b llama $mode tok "$F" --batch "$LB" --seq "$LS" --rank 16; done
fi
if [ "$WHAT" = all ] || [ "$WHAT" = vit ]; then
    [ -f "$D/images.bin" ] || $PY scripts/bench/bench_data.py images "$D/images.bin" $(( (STEPS + 1) * VB )) 224 100
    # N = 85.8e6 parameters, T = 197 tokens, bidirectional attention 12 * T * d * layers per image token
    F=$(awk 'BEGIN { printf "%.0f", 197 * (4 * 85.8e6 + 12 * 197 * 768 * 12) }')
    for mode in baseline lowmem ckpt; do
        bench_run vitb16 $mode img "$F" ./train_vit --model "$D/vitb16" --random-init --device cuda --data "$D/images.bin" \
            --mode $mode --batch "$VB" --steps "$STEPS" --lora-rank 4 --lr 1e-4
    done
    for mode in plain ckpt; do hf_run vitb16 vit $mode img "$F" --batch "$VB" --rank 4; done
fi

{
    echo "# make bench ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
    echo
    echo "GPU: $(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -1)"
    echo "LLaMA-7B shape: batch $LB x seq $LS, LoRA r=16 all linears; ViT-B/16: batch $VB, 224 px, LoRA r=4."
    echo "Throughput: mean over steps $((WARM + 1))..$STEPS. MFU: 989 TFLOP/s, 4N + attention FLOPs per token."
    echo
    echo "| model | mode | throughput | MFU | saved activations (plan, MiB) | planned total (MiB) | measured device (MiB) |"
    echo "|---|---|---|---|---|---|---|"
    for r in "${ROWS[@]}"; do echo "| ${r//|/ | } |"; done
} > "$D/bench.md"
cat "$D/bench.md"
[ -n "${OUT:-}" ] && cp "$D/bench.md" "$OUT/bench.md"
if grep -q FAIL "$D/bench.md"; then echo "bench: some runs failed (logs in $D/*.log)"; exit 1; fi
exit 0
