#!/usr/bin/env bash
# dev/restructure/compare.sh: evidence that a restructuring changed no behaviour (issue 35). Runs
# a baseline build (a clone of main before the change, built) and this tree's build on the same
# inputs and compares what they write, byte for byte:
#   1. `--dry-run --json` for the fixture configs (test/fixtures/*/config.json) in every memory mode
#      and option that changes the plan, on both devices: --device cpu with ./train_llama (the CPU
#      backend's layout) and --device cuda with build/emu/train_llama (the CUDA layout), plus the
#      nvcc binary's default (CUDA) plan;
#   2. the files a few training steps write (adapters, or the merged model of --full) with the
#      demo model and data (data/llama_demo), on the CPU (./train_llama --device cpu) and on the CUDA
#      emulator (build/emu/train_llama --device cuda), for LoRA and --full, every mode, offload,
#      NF4, packed data, dropout with accumulation, MLP tiles, and sequence parallelism (mpirun);
#   3. generation's text (--generate) from the same weights.
# Usage: dev/restructure/compare.sh BASELINE_DIR   (both trees with train_llama and
# build/emu/train_llama built). BASE_TRAIN=PATH takes the baseline's ./train_llama from PATH instead
# (a build of the baseline's source with the same options as this tree's: with cuDNN the CUDA plan
# holds the packed batch's document arrays, without it not). Prints one line per comparison and a
# summary; exits 1 on any difference.
set -u
BASE=$(cd "${1:?usage: dev/restructure/compare.sh BASELINE_DIR}" && pwd)
NEW=$(cd "$(dirname "$0")/../.." && pwd)
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
same=0 differ=0 refused=0
BASE_TRAIN=${BASE_TRAIN:-$BASE/train_llama}
# binary ROOT BIN: the program BIN of the tree at ROOT (the baseline's ./train_llama: BASE_TRAIN)
binary() {
    if [ "$1" = "$BASE" ] && [ "$2" = train_llama ]; then echo "$BASE_TRAIN"; else echo "$1/$2"; fi
}
for b in train_llama build/emu/train_llama; do
    for t in "$BASE" "$NEW"; do
        [ -x "$(binary "$t" $b)" ] || { echo "error: $(binary "$t" $b) is not built"; exit 2; }
    done
done

# compare NAME FILE_A FILE_B
compare() {
    if cmp -s "$2" "$3"; then same=$((same + 1)); echo "same    $1"
    else differ=$((differ + 1)); echo "DIFFER  $1"; diff <(head -c 3000 "$2") <(head -c 3000 "$3") | head -20; fi
}

# ---- 1. dry runs ----------------------------------------------------------------------------
MODES=(
    ""
    "--mode baseline"
    "--mode lowmem"
    "--mode ckpt"
    "--act approx"
    "--act exact --norm ms"
    "--norm ms"
    "--mode lowmem --recompute block"
    "--mode lowmem --recompute block --offload host"
    "--recompute block --offload host --gpu-mem 24"
    "--quant nf4"
    "--quant nf4 --mode lowmem --recompute block"
    "--full"
    "--full --norm std"
    "--full --ranks 4"
    "--seq-parallel 2 --ranks 2"
    "--seq-parallel 4 --ranks 8 --mode lowmem --recompute block"
    "--swiglu-product recompute"
    "--mlp-tile 512"
    "--gpu-mem 40"
    "--max-seq --gpu-mem 24"
    "--max-seq --gpu-mem 80 --seq-parallel 2 --ranks 2"
    "--generate 10"
    "--lora-dropout 0.1 --lora-rank 8"
    "--lora-targets q,v --ms-lora merged"
    "--batch 4 --seq 512"
)
# (--gpu-mem plans a CUDA card: with --device cpu it is refused, the same refusal in both trees)
for cfg in "$NEW"/test/fixtures/*/config.json; do
    name=$(basename "$(dirname "$cfg")")
    dir="$WORK/models/$name"
    mkdir -p "$dir"
    cp "$cfg" "$dir/config.json"
    for i in "${!MODES[@]}"; do
        mode=${MODES[$i]}
        # shellcheck disable=SC2086
        for dev in cpu cuda nvcc-default; do
            case $dev in
                cpu) bin=train_llama; devflag="--device cpu" ;;
                cuda) bin=build/emu/train_llama; devflag="--device cuda" ;;
                nvcc-default) bin=train_llama; devflag="" ;;
            esac
            for t in base new; do
                root=$BASE; [ $t = new ] && root=$NEW
                (cd "$root" && "$(binary "$root" $bin)" --model "$dir" --dry-run --json --batch 1 --seq 2048 $devflag $mode \
                    >"$WORK/dry.$t" 2>&1; echo "exit $?" >>"$WORK/dry.$t")
            done
            compare "dry-run $name [$mode] $dev" "$WORK/dry.base" "$WORK/dry.new"
            # a refusal (the same one-line error in both) is compared too, and counted apart
            tail -n 1 "$WORK/dry.new" | grep -q "^exit 0" || { refused=$((refused + 1)); head -1 "$WORK/dry.new"; }
        done
    done
done

# ---- 2. training runs: the written adapters / merged models --------------------------------
DATA="$NEW/data"
${PYTHON:-python3} - "$DATA/llama_demo_ft_train.bin" "$WORK/packed.bin" <<'EOF'
import sys, os
import numpy as np
sys.path.insert(0, os.path.join(os.path.dirname(sys.argv[1]), "..", "scripts", "formats"))
import shards
tokens, mask, vocab = shards.read_shard(sys.argv[1])[:3]
starts = np.zeros(tokens.size, np.uint8)
for off in (3, 6, 11, 13):  # example starts inside and across each window of 16 tokens
    starts[off::16] = 1
shards.write_shard(sys.argv[2], tokens, mask, vocab, starts=starts)
EOF
RUNS=(
    "lora-default|"
    "lora-baseline|--mode baseline"
    "lora-lowmem|--mode lowmem"
    "lora-ckpt|--mode ckpt"
    "lora-approx-std|--act approx --norm std"
    "lora-exact-ms|--act exact --norm ms"
    "lora-recompute|--mode lowmem --recompute block"
    "lora-offload|--mode lowmem --recompute block --offload host"
    "lora-nf4|--quant nf4"
    "lora-nf4-recompute|--quant nf4 --recompute block --mlp-tile 8"
    "lora-mlp-tile|--mlp-tile 8"
    "lora-product|--swiglu-product recompute"
    "lora-dropout-accum|--lora-dropout 0.2 --grad-accum 2"
    "lora-ms-merged|--ms-lora merged --lora-targets q,k,v,gate,up"
    "lora-packed|--data $WORK/packed.bin --lora-dropout 0.1"
    "full|--full --lr 1e-4"
    "full-std|--full --norm std --lr 1e-4"
    "full-recompute|--full --recompute block --lr 1e-4"
)
train() {  # train ROOT BIN DEVICE OUT NP FLAGS...
    local root=$1 bin=$2 dev=$3 out=$4 np=$5
    shift 5
    local launch=()
    [ "$np" -gt 1 ] && launch=(mpirun --allow-run-as-root --oversubscribe -np "$np")
    (cd "$root" && "${launch[@]}" "$(binary "$root" "$bin")" --model "$DATA/llama_demo" --data "$DATA/llama_demo_ft_train.bin" \
        --val "$DATA/llama_demo_ft_val.bin" --val-batches 2 --steps 3 --batch 2 --seq 16 --lora-rank 2 --lr 1e-3 \
        --device "$dev" --out "$out" "$@" >"$out.log" 2>&1)
    echo "exit $?" >>"$out.log"
}
# compare_outputs NAME DIR_A DIR_B: every tensor file, the training state and the JSON either run
# wrote, and log.csv's step and loss columns (its other columns hold timings)
compare_outputs() {
    local files
    files=$( (cd "$2" 2>/dev/null && find . -name '*.safetensors' -o -name '*.bin' -o -name '*.json'; cd "$3" 2>/dev/null \
             && find . -name '*.safetensors' -o -name '*.bin' -o -name '*.json') \
             | sort -u)
    [ -n "$files" ] || { differ=$((differ + 1)); echo "DIFFER  $1: no output"; tail -3 "$2.log" "$3.log"; return; }
    for log in "$2.log" "$3.log"; do  # a run that failed in both trees would prove nothing
        grep -q "^exit 0" "$log" || { differ=$((differ + 1)); echo "DIFFER  $1: $log failed"; tail -3 "$log"; }
    done
    for f in $files; do compare "$1 ${f#./}" "$2/$f" "$3/$f"; done
    cut -d, -f1-2 "$2/log.csv" >"$2.loss" 2>/dev/null
    cut -d, -f1-2 "$3/log.csv" >"$3.loss" 2>/dev/null
    compare "$1 log.csv losses" "$2.loss" "$3.loss"
}
for spec in "${RUNS[@]}"; do
    name=${spec%%|*}
    flags=${spec#*|}
    for dev in cpu cuda; do
        bin=train_llama; [ $dev = cuda ] && bin=build/emu/train_llama
        # shellcheck disable=SC2086
        train "$BASE" $bin $dev "$WORK/$name.$dev.base" 1 $flags
        # shellcheck disable=SC2086
        train "$NEW" $bin $dev "$WORK/$name.$dev.new" 1 $flags
        compare_outputs "train $name $dev" "$WORK/$name.$dev.base" "$WORK/$name.$dev.new"
    done
done
if command -v mpirun >/dev/null; then
    for spec in "sp2-lora|--seq-parallel 2 --lora-dropout 0.1" "sp2-packed|--seq-parallel 2 --data $WORK/packed.bin" \
                "sp2-recompute-offload|--seq-parallel 2 --recompute block --offload host" \
                "sp2-nf4-tile|--seq-parallel 2 --quant nf4 --recompute block --mlp-tile 8" \
                "sp2-full|--seq-parallel 2 --full --lr 1e-4"; do
        name=${spec%%|*}
        flags=${spec#*|}
        # shellcheck disable=SC2086
        train "$BASE" train_llama cpu "$WORK/$name.base" 2 $flags
        # shellcheck disable=SC2086
        train "$NEW" train_llama cpu "$WORK/$name.new" 2 $flags
        compare_outputs "train $name cpu (mpirun -np 2)" "$WORK/$name.base" "$WORK/$name.new"
    done
else
    differ=$((differ + 1)); echo "DIFFER  sequence parallelism: mpirun not found"
fi

# ---- 3. generation and the merged export ---------------------------------------------------
for dev in cpu cuda; do
    bin=train_llama; [ $dev = cuda ] && bin=build/emu/train_llama
    for t in base new; do
        root=$BASE; [ $t = new ] && root=$NEW
        (cd "$root" && "$(binary "$root" $bin)" --model "$DATA/llama_demo" --device $dev --generate 12 --prompt "Once upon" \
            --lora-rank 2 --adapter "$WORK/lora-default.cpu.base" --export-merged "$WORK/merged.$dev.$t" \
            >"$WORK/gen.$t" 2>&1; echo "exit $?" >>"$WORK/gen.$t")
        # the start-up line and the export's own path differ by design
        grep -v "^train_llama:" "$WORK/gen.$t" | sed "s#$WORK/merged.$dev.$t#MERGED#" >"$WORK/gen.$t.text"
    done
    grep -q "^Once upon" "$WORK/gen.new.text" && grep -q "^exit 0" "$WORK/gen.new.text" \
        || { differ=$((differ + 1)); echo "DIFFER  generate $dev: no text"; tail -3 "$WORK/gen.new.text"; }
    compare "generate $dev" "$WORK/gen.base.text" "$WORK/gen.new.text"
    compare "export-merged $dev" "$WORK/merged.$dev.base/model.safetensors" "$WORK/merged.$dev.new/model.safetensors"
done

echo "summary: $same same, $differ differ ($refused of the same dry runs were refusals in both trees)"
[ "$differ" -eq 0 ]
