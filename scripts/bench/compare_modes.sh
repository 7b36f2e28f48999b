#!/usr/bin/env bash
# Runs the same short fine-tuning in baseline, lowmem and ckpt modes and prints one side-by-side
# table: planned saved-activation bytes, planned total, measured peak memory, step time,
# throughput, final train and validation loss. Writes OUT/compare_modes.csv and the plans as
# OUT/plan_<mode>.json for scripts/bench/plot_modes.py.
# Usage: scripts/bench/compare_modes.sh OUT_DIR BINARY --model DIR --data TRAIN.bin [--val VAL.bin] [more train flags]
# (BINARY is ./train_llama or ./train_vit.) On the CPU backend "peak" is the process's peak RSS,
# which includes the weights, the program and the memory-mapped checkpoint.
set -euo pipefail
[ $# -ge 3 ] || { echo "usage: $0 OUT_DIR BINARY --model DIR --data FILE [train flags]" >&2; exit 2; }
OUT=$1; BIN=$2; shift 2
mkdir -p "$OUT"
csv="$OUT/compare_modes.csv"
echo "mode,saved_act_mib,planned_total_mib,peak_mib,throughput,final_loss,val_loss" > "$csv.tmp"
for mode in baseline lowmem ckpt; do
  log="$OUT/run_$mode.log"
  "$BIN" "$@" --mode "$mode" --log-every 1 > "$log"
  "$BIN" "$@" --mode "$mode" --dry-run --json --device cpu > "$OUT/plan_$mode.json"
  awk -v mode="$mode" '
    /^step / { for (i = 1; i <= NF; i++) { if ($i == "loss" && $(i-1) == "|") loss = $(i+1);
                                            if ($i == "tok/s" || $i == "img/s") { tp[++n] = $(i-1); unit = $i }
                                            if ($i == "val" && $(i+1) == "loss") vloss = $(i+2) } }
    /^memory: planned/ { planned = $3; saved = $7; sub(/\)/, "", saved); peak = $(NF-1) }
    END { # median throughput after the first (warm-up) step
          m = 0; for (i = 2; i <= n; i++) v[++m] = tp[i]; if (m == 0) { v[1] = tp[1]; m = 1 }
          for (i = 1; i <= m; i++) for (j = i + 1; j <= m; j++) if (v[j] < v[i]) { t = v[i]; v[i] = v[j]; v[j] = t }
          med = v[int((m + 1) / 2)]
          printf "%s,%s,%s,%s,%s,%s,%s\n", mode, saved, planned, peak, med, loss, (vloss == "" ? "nan" : vloss) }' "$log" >> "$csv.tmp"
done
mv "$csv.tmp" "$csv"
printf "%-9s %16s %14s %12s %12s %11s %10s\n" mode "saved act (MiB)" "planned (MiB)" "peak (MiB)" "throughput" "final loss" "val loss"
tail -n +2 "$csv" | while IFS=, read -r mode saved planned peak tp loss vloss; do
  printf "%-9s %16s %14s %12s %12s %11s %10s\n" "$mode" "$saved" "$planned" "$peak" "$tp" "$loss" "$vloss"
done
echo "(throughput: median per-step tokens or images per second after the first step; peak: process peak RSS on the CPU)"
echo "wrote $csv and $OUT/plan_{baseline,lowmem,ckpt}.json"
