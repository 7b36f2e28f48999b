#!/usr/bin/env bash
# The ViT CPU benchmark: our LoRA training step (train_vit --device cpu) against the same step in
# PyTorch CPU (scripts/bench/bench_vit_cpu.py), same config, same thread count, one run, side by side.
# Usage: scripts/bench/bench_vit_cpu.sh [THREADS] (default: all cores). Env PYTORCH_BLAS_LIB may name a
# directory holding a faster libblas for PyTorch (Debian's torch uses the system BLAS).
set -euo pipefail
cd "$(dirname "$0")/../.."
THREADS=${1:-$(nproc)}
PY=${PYTHON:-/usr/bin/python3}
CFG=(--dim 192 --hidden 768 --layers 6 --heads 3 --image 64 --patch 8)
B=16; R=4; STEPS=5
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
[ -x ./train_vit ] || make -s train_vit
$PY scripts/bench/bench_vit_cpu.py "${CFG[@]}" --write-model "$work/model" --write-data "$work/data.bin" --write-only
echo "config: ViT d=192 f=768 layers=6 heads=3, 64x64 px patch 8 (65 tokens), batch $B, LoRA r=$R on all linears + head, $THREADS threads"
for mode in baseline lowmem; do
  out=$(OMP_NUM_THREADS=$THREADS ./train_vit --model "$work/model" --data "$work/data.bin" --steps $((STEPS + 1)) \
        --batch $B --lora-rank $R --lora-alpha 8 --mode $mode --threads "$THREADS" --log-every 1)
  # median step throughput after the first (warm-up) step
  ours=$(echo "$out" | awk '/^step .*img\/s/{for(i=1;i<=NF;i++) if($i=="img/s") print $(i-1)}' | tail -n +2 | sort -n | awk '{a[NR]=$1} END{print a[int((NR+1)/2)]}')
  act=exact; norm=std; [ $mode = lowmem ] && act=approx && norm=ms
  theirs_line=$(OMP_NUM_THREADS=$THREADS LD_LIBRARY_PATH=${PYTORCH_BLAS_LIB:-} $PY scripts/bench/bench_vit_cpu.py --model "$work/model" \
        --batch $B --lora-rank $R --act $act --norm $norm --threads "$THREADS" --steps $STEPS --warmup 1 2>/dev/null | grep '^pytorch')
  theirs=$(echo "$theirs_line" | sed 's/.*img_s=\([0-9.]*\).*/\1/')
  printf "%-9s train_vit %8.1f img/s | pytorch %8.1f img/s | ratio %.2fx\n" $mode "$ours" "$theirs" "$(awk -v a="$ours" -v b="$theirs" 'BEGIN{print a/b}')"
done
