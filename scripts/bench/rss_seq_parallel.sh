#!/usr/bin/env bash
# --seq-parallel on the CPU backend: one rank's measured peak RSS against its memory plan, and
# against the single process's, at one long sequence. A LLaMA shape small enough to step in about
# a minute on two cores at 16k tokens (d 512, 8 heads, 4 key/value heads, 8 layers; --random-init,
# written here as a config.json), batch 1, one LoRA step, --mode lowmem, for P = 1 (one process)
# and P = 2 (mpirun -np 2 --seq-parallel 2; rank 0 prints its own plan and peak). The saved
# activations are what --seq-parallel divides by P; the rest (weights, the exchanges' scratch,
# attention's per-call scratch, the process itself) does not shrink with it.
# Usage: scripts/bench/rss_seq_parallel.sh [OUT_DIR] [SEQ]   (default build/bench_rss_sp, 16384)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-build/bench_rss_sp}
SEQ=${2:-16384}
BIN=${TRAIN_LLAMA:-./train_llama}
[ -x "$BIN" ] || { echo "rss_seq_parallel: $BIN not built (make train_llama)" >&2; exit 1; }
command -v mpirun >/dev/null || { echo "rss_seq_parallel: mpirun not found (openmpi-bin)" >&2; exit 1; }
mkdir -p "$OUT/model"
cat > "$OUT/model/config.json" <<JSON
{"model_type": "llama", "hidden_size": 512, "intermediate_size": 1536, "num_hidden_layers": 8,
 "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 8192, "rms_norm_eps": 1e-05,
 "max_position_embeddings": $SEQ, "rope_theta": 10000.0, "tie_word_embeddings": true}
JSON
/usr/bin/python3 - "$OUT/tokens.bin" "$SEQ" <<'PY'
import sys
import numpy as np
sys.path.insert(0, "scripts/formats")
import shards
n = int(sys.argv[2]) + 1
tokens = np.random.default_rng(0).integers(0, 8192, n, dtype=np.int64)
shards.write_shard(sys.argv[1], tokens, np.ones(n, np.uint8), 8192)
PY
ARGS=(--model "$OUT/model" --random-init --data "$OUT/tokens.bin" --device cpu --batch 1 --seq "$SEQ" --steps 1
      --lora-rank 16 --mode lowmem --threads 1)
printf "%-3s %12s %16s %11s %12s %8s\n" P planned_MiB saved_acts_MiB percall_MiB peak_RSS_MiB gap_MiB
for P in 1 2; do
  if [ "$P" = 1 ]; then cmd=("$BIN" "${ARGS[@]}")
  else cmd=(mpirun --allow-run-as-root --oversubscribe -np "$P" "$BIN" "${ARGS[@]}" --seq-parallel "$P"); fi
  line=$("${cmd[@]}" 2>/dev/null | grep '^memory: planned' || true)
  [ -n "$line" ] || { printf "%-3s (did not run)\n" "$P"; continue; }
  planned=$(echo "$line" | awk '{print $3}'); peak=$(echo "$line" | awk '{print $(NF-1)}')
  saved=$(echo "$line" | sed -n 's/.*(saved activations \([0-9.]*\) MiB).*/\1/p')
  percall=$(echo "$line" | sed -n 's/.*per-call scratch up to \([0-9.]*\) MiB.*/\1/p'); percall=${percall:-0}
  awk -v P="$P" -v p="$planned" -v s="$saved" -v c="$percall" -v m="$peak" \
    'BEGIN { printf "%-3s %12.1f %16.1f %11.1f %12.1f %8.1f\n", P, p, s, c, m, m - p - c }'
done
