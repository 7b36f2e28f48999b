#!/usr/bin/env bash
# The CPU benchmark: our LoRA training step (train_llama --device cpu) against the same step in
# PyTorch CPU (scripts/bench/bench_cpu.py), same config, same thread count, one run, side by side.
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
