#!/usr/bin/env bash
# The CPU backend's measured peak RSS against its memory plan at long sequences: the SmolLM2-135M
# shape (written here as a config.json; --random-init, so no checkpoint is needed), batch 1, one
# LoRA step, for each SEQ and memory flag set. The plan's total covers the arenas it lays out;
# beside them it states the heap scratch a CPU kernel takes for one call (the attention's packed keys
# and partial sums, "percall"). What neither names is the process itself (code, libraries, OpenMP
# threads' stacks) and the token shard: the "gap" column is peak - planned - percall, in MiB and per
# token, so a gap that grows with the sequence shows memory the plan misses.
# Usage: scripts/bench/rss_vs_plan.sh [OUT_DIR] [SEQ ...]   (default build/bench_rss, 8192 16384 32768)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT=${1:-build/bench_rss}; shift || true
SEQS=("$@"); [ ${#SEQS[@]} -gt 0 ] || SEQS=(8192 16384 32768)
BIN=${TRAIN_LLAMA:-./train_llama}
[ -x "$BIN" ] || { echo "rss_vs_plan: $BIN not built (make train_llama)" >&2; exit 1; }
mkdir -p "$OUT/smollm2_135m"
cat > "$OUT/smollm2_135m/config.json" <<'JSON'
{"model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
 "num_attention_heads": 9, "num_key_value_heads": 3, "vocab_size": 49152, "rms_norm_eps": 1e-05,
 "max_position_embeddings": 8192, "rope_theta": 100000.0, "tie_word_embeddings": true}
JSON
max=0; for s in "${SEQS[@]}"; do [ "$s" -gt "$max" ] && max=$s; done
/usr/bin/python3 - "$OUT/tokens.bin" "$max" <<'PY'
import sys
import numpy as np
sys.path.insert(0, "scripts/formats")
import shards
n = int(sys.argv[2]) + 1
tokens = np.random.default_rng(0).integers(0, 49152, n, dtype=np.int64)
shards.write_shard(sys.argv[1], tokens, np.ones(n, np.uint8), 49152)
PY
FLAGSETS=("--mode lowmem" "--mode lowmem --recompute block" "--mode lowmem --recompute block --offload host")
printf "%-7s %-46s %12s %11s %12s %8s %10s\n" seq flags planned_MiB percall_MiB peak_RSS_MiB gap_MiB gap_B/tok
for s in "${SEQS[@]}"; do
  for f in "${FLAGSETS[@]}"; do
    # shellcheck disable=SC2086
    line=$("$BIN" --model "$OUT/smollm2_135m" --random-init --data "$OUT/tokens.bin" --device cpu --batch 1 \
             --seq "$s" --steps 1 --lora-rank 16 $f 2>/dev/null | grep '^memory: planned' || true)
    [ -n "$line" ] || { printf "%-7s %-46s (did not run)\n" "$s" "$f"; continue; }
    planned=$(echo "$line" | awk '{print $3}'); peak=$(echo "$line" | awk '{print $(NF-1)}')
    percall=$(echo "$line" | sed -n 's/.*per-call scratch up to \([0-9.]*\) MiB.*/\1/p'); percall=${percall:-0}
    awk -v s="$s" -v f="$f" -v p="$planned" -v c="$percall" -v m="$peak" \
      'BEGIN { g = m - p - c; printf "%-7s %-46s %12.1f %11.1f %12.1f %8.1f %10.0f\n", s, f, p, c, m, g, g * 1048576 / s }'
  done
done
