#!/usr/bin/env bash
# scripts/ci/attention_compare.sh: the CUDA backend's three attention paths side by side on one GPU
# (LLMC_ATTENTION=cudnn | gemm | flash, llmc/ops.h), run by scripts/ci/gpu_check.sh. For each shape,
# the same trainer, data, seed and steps under each path; per path the last step's loss and
# gradient norm and the mean tokens/s after the first step, and the check against gemm (the
# in-house default before cuDNN):
#   loss       |loss - loss_gemm| / loss_gemm < 1e-2: the loss bound the emulator tests put on the
#              CUDA backend (bf16 activations) against fp32 (test/cuda/test_llama_cuda.py, TOL_EXACT)
#   grad norm  relative difference < 0.15: their gradient bound (TOL_EXACT["grad"], a relative L2
#              error per tensor, here on the norm of the whole LoRA gradient)
# Then gemm and cudnn again with LLMC_CUDA_GRAPH=1 (each micro-batch's forward + backward replayed as
# one CUDA graph, llmc/cuda/graph.cuh), checked against the same path without it: gemm's must be the
# very same loss and gradient norm (the same kernels with the same arguments in the same order, bit
# for bit on the emulator), cudnn's within the bounds above (cuDNN may pick another algorithm); the
# tok/s column is the graph's gain, the measurement that decides LLMC_CUDA_GRAPH's default.
# Per-tensor gradients against the CPU backend: test_llama_cuda.py's test_cuda_attention_cudnn and
# test_cuda_attention_paths (gpu_check.sh's whole-model step).
# Shapes: the demo model at batch 4 x 128 (real data), the same with packed examples (demo-packed:
# the demo's tokens cut into documents of 3 to 60 tokens, a shard with example starts, so every
# row packs several documents and attention masks by position; cudnn runs them as cuDNN's ragged
# layout, LLMC_CUDNN_PACKED=ragged, and a cudnn row whose log says "cudnn refused" FAILS there: it
# would compare gemm with gemm), and a Llama-3-8B-shaped model cut to 2 layers (d 4096, 32 heads,
# 8 kv heads, head dim 128, f 14336, vocab 128256; --random-init, random tokens) at batch 1 x 4096,
# where the paths' speeds differ. ATTN_COMPARE_STEPS (default 4) steps.
# Prints a markdown table; exits 1 when a path failed or broke a bound.
# Usage: bash scripts/ci/attention_compare.sh [demo|packed|llama3|all, or a comma list: demo,packed]
#        (a GPU and the nvcc-built train_llama;
# ATTN_COMPARE_TRAINER=build/emu/train_llama runs the script's logic on the emulator, where cudnn is refused)
set -u
cd "$(dirname "$0")/../.." || exit 1
WHAT=${1:-all}
wants() { case ",$WHAT," in *,all,* | *,"$1",*) return 0 ;; esac; return 1; }
STEPS=${ATTN_COMPARE_STEPS:-4}
TRAIN=${ATTN_COMPARE_TRAINER:-./train_llama}
D=build/attention_compare
mkdir -p "$D/llama3_2l"
FAILED=0
echo "| shape | path | status | loss | grad norm | tok/s | vs gemm |"
echo "|---|---|---|---|---|---|---|"

cat > "$D/llama3_2l/config.json" <<'EOF'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
 "num_hidden_layers": 2, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
 "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": false,
 "hidden_act": "silu", "torch_dtype": "bfloat16"}
EOF

# compare SHAPE COMMAND...: COMMAND under each path, one table row each.
compare() {
    local shape=$1 path log rc loss gn rate ref_loss="" ref_gn="" verdict
    shift
    local -A row_loss row_gn
    for path in gemm cudnn flash gemm+graph cudnn+graph; do  # gemm first: the reference
        log="$D/$shape.$path.log"
        LLMC_ATTENTION=${path%+graph} LLMC_CUDA_GRAPH=$([ "${path%+graph}" != "$path" ] && echo 1 || echo 0) \
            timeout 300 "$@" > "$log" 2>&1
        rc=$?
        loss=$(sed -n 's/^step *[0-9]*\/[0-9]* | loss \([0-9.naif-]*\) .*/\1/p' "$log" | tail -n 1)
        gn=$(sed -n 's/.* | grad norm \([0-9.naif-]*\) .*/\1/p' "$log" | tail -n 1)
        rate=$(grep -o '| [0-9]* tok/s' "$log" | awk 'NR > 1 { s += $2; k++ } END { if (k) printf "%.0f", s / k; else print "n/a" }')
        if [ $rc -ne 0 ] || [ -z "$loss" ]; then
            verdict="FAIL(rc=$rc): $(grep -a -E '^(error|cuDNN|LLMC_ATTENTION)' "$log" | head -n 1 | cut -c1-100)"
            FAILED=1
        elif [ $path = gemm ]; then
            ref_loss=$loss ref_gn=$gn verdict="reference"
        elif [ $path = gemm+graph ]; then  # bit for bit: the very same printed values
            if [ "$loss" = "${row_loss[gemm]:-}" ] && [ "$gn" = "${row_gn[gemm]:-}" ]; then verdict="identical to gemm"
            else verdict="DIFFERS from gemm without the graph"; FAILED=1; fi
        elif [ $path = cudnn+graph ] && [ -z "${row_loss[cudnn]:-}" ]; then
            verdict="no cudnn reference"
        elif [ -z "$ref_loss" ]; then
            verdict="no gemm reference"
        else
            [ $path = cudnn+graph ] && ref_loss=${row_loss[cudnn]} ref_gn=${row_gn[cudnn]}
            verdict=$(awk -v a="$loss" -v b="$ref_loss" -v g="$gn" -v h="$ref_gn" 'BEGIN {
                dl = (a - b) / b; if (dl < 0) dl = -dl; dg = (g - h) / h; if (dg < 0) dg = -dg;
                ok = dl < 1e-2 && dg < 0.15; printf "%s loss %.1e grad norm %.1e", ok ? "ok:" : "OUT OF BOUNDS:", dl, dg }')
            case $verdict in OUT*) FAILED=1 ;; esac
        fi
        [ $rc -eq 0 ] && [ -n "$loss" ] && status=PASS || status="FAIL"
        [ $status = PASS ] && row_loss[$path]=$loss row_gn[$path]=$gn
        grep -a -q 'cuda graph: off' "$log" && verdict="$verdict; $(grep -a -m 1 -o 'cuda graph: off.*' "$log")"
        grep -a -q 'cudnn refused' "$log" && verdict="$verdict; $(grep -a -m 1 -o 'cudnn refused.*' "$log")"
        if [ "$shape" = demo-packed ] && [ "${path%+graph}" = cudnn ] && grep -a -q 'cudnn refused' "$log"; then
            verdict="FAIL: packed examples not on cuDNN's ragged path; $verdict"; FAILED=1
        fi
        echo "| $shape | $path | $status | ${loss:-?} | ${gn:-?} | $rate | $verdict |"
    done
}

if wants demo; then
    compare demo "$TRAIN" --model data/llama_demo --data data/llama_demo_ft_train.bin --device cuda --batch 4 --seq 128 \
        --lora-rank 8 --lr 1e-3 --seed 5 --steps "$STEPS" --log-every 1
fi
if wants packed; then
    # documents of 3..60 tokens (seeded), so micro-batches hold different numbers of documents
    [ -f "$D/packed.bin" ] || python3 - "$D/packed.bin" <<'PY' || FAILED=1
import sys
import numpy as np
sys.path.insert(0, "scripts/formats")
import shards
toks, mask, vocab = shards.read_shard("data/llama_demo_ft_train.bin")[:3]
lens = np.random.default_rng(7).integers(3, 61, size=toks.size)
starts = np.zeros(toks.size, np.uint8)
starts[np.cumsum(lens)[np.cumsum(lens) < toks.size]] = 1
starts[0] = 1
shards.write_shard(sys.argv[1], toks.astype(np.uint32), mask, vocab, starts=starts)
PY
    compare demo-packed "$TRAIN" --model data/llama_demo --data "$D/packed.bin" --device cuda --batch 4 --seq 128 \
        --lora-rank 8 --lr 1e-3 --seed 5 --steps "$STEPS" --log-every 1
fi
if wants llama3; then
    [ -f "$D/tokens.bin" ] || python3 scripts/bench/bench_data.py tokens "$D/tokens.bin" 128256 $(( (STEPS + 2) * 4097 ))
    compare llama3-8b-2layers "$TRAIN" --model "$D/llama3_2l" --random-init --device cuda --data "$D/tokens.bin" \
        --batch 1 --seq 4096 --lora-rank 16 --lr 1e-4 --seed 5 --steps "$STEPS" --log-every 1
fi
exit $FAILED
