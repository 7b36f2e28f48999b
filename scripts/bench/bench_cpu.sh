#!/usr/bin/env bash
# The CPU benchmark: our LoRA training step (train_llama --device cpu) against the same step in
# PyTorch CPU (scripts/bench/bench_cpu.py), same config, same thread count, one run, side by side.
# Then the SmolLM2-135M shape (d 576, f 1536, 30 layers, 9/3 heads, vocab 49,152 tied; random weights
# from a config.json, --random-init; LoRA r=16 on all linears, batch 1 x 512, lowmem) in one run,
# side by side: the machine's sgemm rate (OpenBLAS, the same threads; dev/cpu/gemm, which also
# times our products at the model's shapes against it, interleaved), our step, and Hugging Face
# transformers + PEFT (scripts/bench/bench_hf.py, build/hfvenv) on the same BLAS and threads.
# Model work per token: 4 FLOPs per frozen weight, LoRA's products, attention 6 T d per layer
# (train_llama's MFU convention). All three with OMP_WAIT_POLICY=passive (train_llama sets it itself).
# BENCH_SMOL=0 skips it (it takes about 3 minutes on 2 cores).
# Usage: scripts/bench/bench_cpu.sh [THREADS] (default: all cores).
# Debian's python3-torch calls the system BLAS, which by default is the slow reference BLAS; a
# comparison against that flatters us. So PyTorch runs with OpenBLAS: PYTORCH_BLAS_LIB names a
# directory with its libblas.so.3, else Debian's libopenblas0-pthread is unpacked into
# build/openblas (apt-get download; nothing is installed system-wide). The BLAS PyTorch used is
# printed.
set -euo pipefail
cd "$(dirname "$0")/../.."
THREADS=${1:-$(nproc)}
PY=${PYTHON:-/usr/bin/python3}
CFG=(--dim 256 --hidden 688 --layers 4 --heads 8 --kv-heads 4 --vocab 512)
B=4; T=256; R=16; STEPS=5
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -x ./train_llama ] || make -s train_llama
if [ -z "${PYTORCH_BLAS_LIB:-}" ]; then
  PYTORCH_BLAS_LIB=$PWD/build/openblas/root/usr/lib/x86_64-linux-gnu/openblas-pthread
  if [ ! -e "$PYTORCH_BLAS_LIB/libblas.so.3" ]; then
    mkdir -p build/openblas
    (cd build/openblas && apt-get download -q libopenblas0-pthread >/dev/null 2>&1 && dpkg -x libopenblas0-pthread_*.deb root) ||
      { echo "bench_cpu: could not fetch OpenBLAS; PyTorch uses the system BLAS (likely the slow reference one)"; PYTORCH_BLAS_LIB=; }
  fi
fi
echo "PyTorch BLAS: ${PYTORCH_BLAS_LIB:-system default}"
$PY scripts/bench/bench_cpu.py "${CFG[@]}" --write-model "$work/model" --write-only >/dev/null
$PY - "$work/data.bin" <<'PY'
import sys, numpy as np
sys.path.insert(0, "scripts/formats")
import shards
rng = np.random.default_rng(0)
toks = rng.integers(3, 512, size=200000).astype(np.uint32)
shards.write_shard(sys.argv[1], toks, np.ones(toks.size, np.uint8), 512)
PY
echo "config: d=256 f=688 layers=4 heads=8/4 vocab=512, batch $B x seq $T, LoRA r=$R on all linears, $THREADS threads"
for mode in baseline lowmem; do
  out=$(OMP_NUM_THREADS=$THREADS ./train_llama --model "$work/model" --data "$work/data.bin" --steps $((STEPS + 1)) \
        --batch $B --seq $T --lora-rank $R --mode $mode --threads "$THREADS" --log-every 1)
  # median step throughput after the first (warm-up) step
  ours=$(echo "$out" | awk '/^step /{for(i=1;i<=NF;i++) if($i=="tok/s") print $(i-1)}' | tail -n +2 | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')
  act=exact; norm=std; [ $mode = lowmem ] && act=approx && norm=ms
  theirs_line=$(OMP_NUM_THREADS=$THREADS LD_LIBRARY_PATH=${PYTORCH_BLAS_LIB:-} $PY scripts/bench/bench_cpu.py --model "$work/model" \
        --batch $B --seq $T --lora-rank $R --act $act --norm $norm --threads "$THREADS" --steps $STEPS --warmup 1 2>/dev/null | grep '^pytorch')
  theirs=$(echo "$theirs_line" | sed 's/.*tok_s=\([0-9.]*\).*/\1/')
  printf "%-9s train_llama %8.0f tok/s | pytorch %8.0f tok/s | ratio %.2fx\n" $mode "$ours" "$theirs" "$(awk -v a="$ours" -v b="$theirs" 'BEGIN{print a/b}')"
done

[ "${BENCH_SMOL:-1}" = 1 ] || exit 0
# ---- SmolLM2-135M shape ----
D=build/bench/smollm2-shape
mkdir -p "$D"
cat > "$D/config.json" <<'EOF2'
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536,
 "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152,
 "rms_norm_eps": 1e-05, "rope_theta": 100000.0, "max_position_embeddings": 2048, "tie_word_embeddings": true,
 "hidden_act": "silu", "torch_dtype": "float32"}
EOF2
[ -f "$D/tokens.bin" ] || $PY scripts/bench/bench_data.py tokens "$D/tokens.bin" 49152 20000
SB=1; ST=512; SR=16; SSTEPS=${BENCH_SMOL_STEPS:-6}
# model FLOPs per token (llama_flops_per_token in llmc/models/llama_step.h)
fpt=$(awk -v d=576 -v f=1536 -v kv=192 -v L=30 -v V=49152 -v r=$SR -v T=$ST 'BEGIN {
  split(d" "d" "d" "kv" "d" "kv" "d" "d" "d" "f" "d" "f" "f" "d, a, " ");
  s = 0; for (i = 1; i <= 14; i += 2) s += 4 * a[i] * a[i+1] + 6 * r * (a[i] + a[i+1]);
  printf "%.0f", L * s + 4 * d * V + L * 6 * T * d }')
echo "== SmolLM2-135M shape: d 576 f 1536 30 layers 9/3 heads vocab 49152 tied, LoRA r=$SR all linears, batch $SB x $ST, lowmem, $THREADS threads; load: $(cut -d' ' -f1-3 /proc/loadavg)"
make -s dev/cpu/gemm
blas_so=${PYTORCH_BLAS_LIB:+$PYTORCH_BLAS_LIB/libblas.so.3}
OMP_WAIT_POLICY=passive OMP_NUM_THREADS=$THREADS OPENBLAS_NUM_THREADS=$THREADS ./dev/cpu/gemm ${blas_so:+--blas "$blas_so"} | tee "$D/gemm.txt"
ceil=$(sed -n 's/^gemm ceiling: \([0-9.]*\).*/\1/p' "$D/gemm.txt")
out=$(OMP_NUM_THREADS=$THREADS ./train_llama --model "$D" --random-init --data "$D/tokens.bin" --steps $SSTEPS --batch $SB --seq $ST \
      --lora-rank $SR --mode lowmem --threads "$THREADS" --profile 2>&1)
echo "$out" | sed -n '/^step /p;/^profile:/,$p'
ours=$(echo "$out" | awk '/^step /{for(i=1;i<=NF;i++) if($i=="tok/s") print $(i-1)}' | tail -n +2 | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')
hf=n/a
if [ -x build/hfvenv/bin/python ]; then
  hf_line=$(OMP_WAIT_POLICY=passive OMP_NUM_THREADS=$THREADS LD_LIBRARY_PATH=${PYTORCH_BLAS_LIB:-} build/hfvenv/bin/python scripts/bench/bench_hf.py --model "$D" llama \
            --device cpu --batch $SB --seq $ST --rank $SR --steps 3 --warmup 1 2>/dev/null | grep '^HF ' || true)
  hf=$(echo "$hf_line" | sed -n 's/.*: \([0-9.]*\) tok\/s.*/\1/p'); hf=${hf:-n/a}
else
  echo "(build/hfvenv missing: bash scripts/ci/install_deps.sh makes it; Hugging Face + PEFT skipped)"
fi
awk -v o="$ours" -v h="$hf" -v c="$ceil" -v f="$fpt" -v l="$(cut -d' ' -f1 /proc/loadavg)" 'BEGIN {
  g = o * f * 1e-9;
  printf "smollm2-shape: train_llama %.1f tok/s = %.1f GFLOP/s model work (%.0f MFLOP/token)", o, g, f * 1e-6;
  if (c + 0 > 0) printf " = %.0f%% of the machine sgemm %.1f GFLOP/s", 100 * g / c, c;
  # the same model work for both (frozen forward and input gradients, LoRA, attention), so the HF
  # share of the same sgemm bounds any ratio to it: ours / HF <= 100 % / (HF share)
  if (h + 0 > 0) {
    printf " | transformers+PEFT %.1f tok/s", h;
    if (c + 0 > 0) printf " = %.0f%% of sgemm", 100 * h * f * 1e-9 / c;
    printf " | ratio %.2fx", o / h;
  } else printf " | transformers+PEFT %s", h;
  printf " | load %s\n", l }'
