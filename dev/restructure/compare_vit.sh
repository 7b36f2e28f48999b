#!/usr/bin/env bash
# dev/restructure/compare_vit.sh: evidence that moving the ViT out of train_vit.cu (issue 35)
# changed no behaviour. It runs a baseline tree's binaries and this tree's side by side and
# compares what they write, byte for byte:
#   1. `--dry-run --json` for the ViT configs the tests use (data/vit_demo, test/system/
#      test_vit_train.py's ViT-B/16, test/model/vit_cases.py's two small ones) in every mode, on
#      --device cpu and --device cuda, with the native binary (./train_vit) and the CPU emulator's
#      (build/emu/train_vit);
#   2. a few training steps on the demo model and data (data/vit_demo, scripts/demo/make_demo_vit.py)
#      on the CPU and on the emulator, LoRA and --full in each mode: every file of --out (the
#      adapter or the model, train_state.bin; log.csv without its timing columns), the merged
#      export, and the printed losses.
# Usage: dev/restructure/compare_vit.sh [BASELINE_TREE]   (default /work/baseline; both trees built
#        with the same configuration: make train_vit build/emu/train_vit). A baseline whose ./train_vit
#        was built before cuDNN was installed plans another CUDA attention workspace: its native
#        `--device cuda` dry runs differ for that reason alone; build a fresh copy then, e.g.
#        git archive 56429c5 | tar -x -C /tmp/vitbase && make -C /tmp/vitbase train_vit build/emu/train_vit
#        Exit status 0 only when everything is identical.
set -u
BASE=${1:-/work/baseline}
NEW=$(cd "$(dirname "$0")/../.." && pwd)
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
fails=0 checks=0
# COMPARE_BINS narrows the binaries (e.g. "build/emu/train_vit"); COMPARE_PARTS="dry train" the parts.
BINS=(${COMPARE_BINS:-train_vit build/emu/train_vit})
PARTS=${COMPARE_PARTS:-dry train}
for b in "${BINS[@]}"; do
    for t in "$BASE" "$NEW"; do [ -x "$t/$b" ] || { echo "missing $t/$b (build it first)"; exit 2; }; done
done

same() {  # same LABEL FILE_A FILE_B
    checks=$((checks + 1))
    if ! cmp -s "$2" "$3"; then echo "DIFFERS: $1 ($2 vs $3)"; fails=$((fails + 1)); fi
}

# ---- 1. dry runs ------------------------------------------------------------------------------
mkdir -p "$TMP/vitb16" "$TMP/square" "$TMP/nonsquare"
echo '{"hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
 "image_size": 224, "patch_size": 16, "num_channels": 3, "layer_norm_eps": 1e-12, "hidden_act": "gelu"}' \
    > "$TMP/vitb16/config.json"
echo '{"hidden_size": 24, "intermediate_size": 40, "num_hidden_layers": 2, "num_attention_heads": 3,
 "image_size": 16, "patch_size": 4, "num_channels": 3, "hidden_act": "gelu"}' > "$TMP/square/config.json"
echo '{"hidden_size": 33, "intermediate_size": 50, "num_hidden_layers": 2, "num_attention_heads": 3,
 "image_size": [12, 20], "patch_size": 4, "num_channels": 1, "layer_norm_eps": 1e-6,
 "hidden_act": "gelu_pytorch_tanh", "qkv_bias": false}' > "$TMP/nonsquare/config.json"
MODES=("--mode baseline" "--mode lowmem" "--mode ckpt" "--act approx" "--norm ms" "--mode baseline --act approx"
       "--mode baseline --norm ms" "--recompute block" "--mode lowmem --recompute block --offload host"
       "--mode ckpt --offload host" "--full" "--full --mode baseline" "--full --mode ckpt --offload host"
       "--lora-targets q,v" "--lora-targets fc1,fc2 --mode baseline" "--ms-lora merged" "--lora-dropout 0.1"
       "--full --ranks 4" "--ranks 2 --lora-rank 8" "--image-size 384" "--image-size 192x256 --mode ckpt"
       "--batch 3 --grad-accum 2")
n_dry=0
[[ $PARTS == *dry* ]] && for model in "$TMP/vitb16" "$TMP/square" "$TMP/nonsquare" "$NEW/data/vit_demo"; do
    extra=()
    [ "$model" = "$NEW/data/vit_demo" ] && extra=(--data "$NEW/data/vit_demo_ft_train.bin")
    for mode in "${MODES[@]}"; do
        case "$model:$mode" in */vit_demo:*--image-size\ 192x256*|*/vit_demo:*--image-size\ 384*) continue;; esac
        case "$model:$mode" in */square:*--image-size*|*/nonsquare:*--image-size*) continue;; esac
        for dev in cpu cuda; do
            for bin in "${BINS[@]}"; do
                # shellcheck disable=SC2086
                args=(--model "$model" --dry-run --json --device "$dev" $mode "${extra[@]}")
                "$BASE/$bin" "${args[@]}" > "$TMP/a.json" 2>&1
                echo "exit $?" >> "$TMP/a.json"
                "$NEW/$bin" "${args[@]}" > "$TMP/b.json" 2>&1
                echo "exit $?" >> "$TMP/b.json"
                same "dry run $bin $(basename "$model") $dev $mode" "$TMP/a.json" "$TMP/b.json"
                n_dry=$((n_dry + 1))
            done
        done
    done
done
echo "dry runs: $n_dry compared"

# ---- 2. a few training steps ------------------------------------------------------------------
# log.csv's columns that time the run (ms, throughput, MFU) differ run to run: dropped by name.
strip_log() {
    python3 - "$1" <<'EOF'
import csv, sys
rows = list(csv.reader(open(sys.argv[1])))
timed = [i for i, h in enumerate(rows[0]) if any(k in h for k in ("ms", "time", "per_s", "mfu", "sec", "comm"))]
for r in rows:
    print(",".join(v for i, v in enumerate(r) if i not in timed))
EOF
}
# what a run prints, without its timings and its own temporary paths
losses() {
    sed -E -e 's/[0-9.]+ img\/s//g' -e 's/in [0-9.]+ s \([0-9.]+ s in all-reduce\)//' -e 's/measured peak RSS.*//' \
        -e "s#$TMP/[ab]/##g" "$1"
}

RUNS=("--mode baseline" "--mode lowmem" "--mode ckpt" "--act approx --mode baseline" "--norm ms --mode baseline"
      "--mode lowmem --recompute block --offload host" "--ms-lora merged" "--lora-dropout 0.2 --lora-targets q,v,fc2"
      "--full --mode baseline" "--full --mode lowmem" "--full --mode ckpt" "--full --norm ms --mode baseline"
      "--batch 4 --grad-accum 2" "--image-size 35 --mode baseline")
D=$NEW/data
n_run=0
[[ $PARTS == *train* ]] && for mode in "${RUNS[@]}"; do
    for dev in cpu cuda; do
        bin=train_vit
        [ "$dev" = cuda ] && bin=build/emu/train_vit
        [[ " ${BINS[*]} " == *" $bin "* ]] || continue
        for side in a b; do
            tree=$BASE
            [ $side = b ] && tree=$NEW
            out="$TMP/$side/out"
            rm -rf "$TMP/$side"
            mkdir -p "$TMP/$side"
            # shellcheck disable=SC2086
            "$tree/$bin" --model "$D/vit_demo" --data "$D/vit_demo_ft_train.bin" --val "$D/vit_demo_ft_val.bin" \
                --device "$dev" --steps 3 --batch 8 --lr 1e-3 --seed 3 --hflip --out "$out" $mode \
                > "$TMP/$side/stdout" 2>&1
            echo "exit $?" >> "$TMP/$side/stdout"
            losses "$TMP/$side/stdout" > "$TMP/$side/losses"
            if ! [[ "$mode" == *--full* ]] && [ -f "$out/adapter_model.safetensors" ]; then
                "$tree/$bin" --model "$D/vit_demo" --adapter "$out" --export-merged "$TMP/$side/merged" \
                    --device "$dev" $mode > "$TMP/$side/export.stdout" 2>&1
                echo "exit $?" >> "$TMP/$side/export.stdout"
                "$tree/$bin" --model "$D/vit_demo" --adapter "$out" --val "$D/vit_demo_ft_val.bin" --eval-only \
                    --device "$dev" $mode > "$TMP/$side/eval.stdout" 2>&1
                echo "exit $?" >> "$TMP/$side/eval.stdout"
                losses "$TMP/$side/eval.stdout" > "$TMP/$side/eval.losses"
            fi
        done
        label="train $dev $mode"
        same "$label: losses" "$TMP/a/losses" "$TMP/b/losses"
        [ -s "$TMP/a/losses" ] || { echo "NO LOSSES: $label"; tail -3 "$TMP/a/stdout"; fails=$((fails + 1)); }
        (cd "$TMP/a" && find out merged -type f 2>/dev/null | sort) > "$TMP/files.a"
        (cd "$TMP/b" && find out merged -type f 2>/dev/null | sort) > "$TMP/files.b"
        same "$label: file list" "$TMP/files.a" "$TMP/files.b"
        while read -r f; do
            if [[ "$f" == */log.csv ]]; then
                strip_log "$TMP/a/$f" > "$TMP/la"; strip_log "$TMP/b/$f" > "$TMP/lb"
                same "$label: $f (untimed columns)" "$TMP/la" "$TMP/lb"
            else
                same "$label: $f" "$TMP/a/$f" "$TMP/b/$f"
            fi
        done < "$TMP/files.a"
        [ -f "$TMP/a/eval.losses" ] && same "$label: eval-only" "$TMP/a/eval.losses" "$TMP/b/eval.losses"
        n_run=$((n_run + 1))
    done
done
echo "training runs: $n_run compared ($checks comparisons in all)"
if [ $fails -ne 0 ]; then echo "compare_vit: $fails DIFFER"; exit 1; fi
echo "compare_vit: all identical"
