#!/usr/bin/env bash
# scripts/ci/switch_compare.sh: every switch of the CUDA training step side by side on one GPU, in
# one run (issue 25), run by scripts/ci/gpu_check.sh (step 4b) and by `make bench`. Per shape, the
# same trainer, data, seed and steps with each switch flipped alone from the binary's default (the
# old form against the new), and transformers + PEFT on the same shape beside them:
#   default             nothing set: the reference of the rows below (cudnn attention where make
#                       found cuDNN, else gemm; no CUDA graph; the vectorised kernels)
#   graph               LLMC_CUDA_GRAPH=1 (each micro-batch's forward + backward as one CUDA graph)
#   gemm                LLMC_ATTENTION=gemm (the in-house attention path)
#   transformers+PEFT   scripts/bench/bench_hf.py on the same config.json, batch, sequence and rank
#   lora-fused=0, =1    LLMC_LORA_FUSED (LoRA's products in the frozen product's epilogue, or apart);
#                       both values run, whichever the default is
#   gemm+graph          the graph on gemm, against gemm: must be identical (below)
#   head-chunk=old      LLMC_HEAD_CHUNK=old (64 MiB of fp32 logits per LM head chunk; Llama only)
#   all-old             every switch above in its old form at once (attention left at the default):
#                       the step before the graph, head-chunk and fused-LoRA work
#                       (the old forms of the one-sync step, the legacy stream, synchronous uploads,
#                       per-micro-batch readback and the step's values as kernel arguments, are gone:
#                       bit-identical on the emulator and dominated by construction; so are the scalar
#                       kernels' switches, LLMC_CE_KERNEL and LLMC_ELEMWISE: dev/cuda compares those)
# in that order, the most informative first (the defaults still to decide: the graph, the attention
# path, the fused LoRA; then the comparison with transformers + PEFT; then the kernels' defaults
# already taken on the emulator's word). Per run: the last step's loss and gradient norm (log.csv of
# --out: 6 digits), the mean tokens (images) per second after the first step, its ratio to the
# reference's, and the check against the reference, with the bounds of scripts/ci/attention_compare.sh
# (the emulator tests' bounds on the CUDA backend against fp32, test/cuda/test_llama_cuda.py TOL_EXACT):
#   bounds     |loss - loss_ref| / loss_ref < 1e-2 and |gn - gn_ref| / gn_ref < 0.15 (a bf16 form
#              against another differs by less than bf16 against fp32);
#   identical  the same loss and gradient norm and the same adapter bytes (adapter_model.safetensors):
#              the graph changes how the kernels are launched, not the kernels or their order, so on
#              gemm (deterministic; cuDNN's backward may not be) they train bit for bit, as they do on
#              the emulator.
# The notes column quotes what the binary said of the switch it was given (its "attention:",
# "cuda graph:" and "LM head chunk:" lines; for LLMC_LORA_FUSED any line naming it or a fused LoRA),
# or "(not reported)" where it said nothing: a binary that ignores a switch shows as identical there.
# Shapes (weights --random-init from a config.json, random tokens or pixels; the default --mode lowmem;
# LoRA on all linears), in the order of "all":
#   llama3   Llama-3-8B cut to 2 layers (d 4096, 32 heads, 8 kv heads, head dim 128, f 14336, vocab
#            128256), batch 1 x 4096, r 16 (as attention_compare.sh)
#   vit      ViT-B/16 whole (12 layers, d 768, f 3072, 224 px), batch 64, r 4 (as make bench)
#   llama7b  LLaMA-2-7B cut to 2 layers (d 4096, 32 heads, f 11008, vocab 32000), batch 1 x 2048,
#            r 16: a layer's kernels are the whole model's, 1/16 of its layers, so the switches of
#            the layers (attention, elementwise, fused LoRA) show the same per-layer gain, a larger
#            share of the head and the start-up; 32 layers would take ~20 s per run to start
#            (13 GB of weights made and uploaded) and give the runs' budget to three rows
#   packed   the demo model at batch 4 x 128 on its data cut into seeded documents of 3 to 60 tokens
#            (micro-batches with different numbers of documents): packed examples, which the default
#            (cudnn) runs as cuDNN's ragged layout; its own rows (runs_of), the default's failing when
#            its log says cuDNN was refused
#   demo     the demo model on its own data, batch 4 x 128 (not in "all"; with packed, gpu_check.sh --smoke's)
# Time: SWITCH_COMPARE_BUDGET_S (default 1800) for the whole run; each shape gets an equal share of
# what is left when it starts, a run is skipped (said in its row) when its shape's share left is less
# than its longest run so far, and each runs under timeout with the smaller of
# SWITCH_COMPARE_RUN_LIMIT_S (150) and the budget left. SWITCH_COMPARE_STEPS (default 5) steps.
# Output: a markdown table on stdout (a row as each run ends), and in build/switch_compare/switches.md
# (SWITCH_COMPARE_DIR: the folder of the configs, data, logs and --out directories),
# rewritten after every row (and $OUT/switches.md when OUT is set); exits 1 when a run failed or broke
# its check, 2 on a bad argument.
# Usage: bash scripts/ci/switch_compare.sh [all|llama3|packed|vit|llama7b|demo]...   (a GPU, nvcc-built trainers)
# Without a GPU (test/tooling/test_switch_compare.py): SWITCH_COMPARE_LLAMA / SWITCH_COMPARE_VIT name
# the trainers (build/emu/train_llama, build/emu/train_vit: the emulator), SWITCH_COMPARE_TINY=1 gives
# every shape a tiny config of the same kind, SWITCH_COMPARE_HF the transformers + PEFT command ("0":
# none), SWITCH_COMPARE_ONLY="name ..." runs those rows alone, SWITCH_COMPARE_EXTRA="name|ref|check|VAR=v
# ...;..." appends rows (also to try a switch on a GPU without editing this file).
set -u
cd "$(dirname "$0")/../.." || exit 1
WHAT=${*:-all}
SHAPES=""
for a in $WHAT; do
    case $a in
        all) SHAPES="$SHAPES llama3 packed vit llama7b" ;;
        llama3 | packed | vit | llama7b | demo) SHAPES="$SHAPES $a" ;;
        *) echo "switch_compare.sh: unknown shape '$a' (expected all, llama3, packed, vit, llama7b or demo)" >&2; exit 2 ;;
    esac
done
STEPS=${SWITCH_COMPARE_STEPS:-5}
LLAMA=${SWITCH_COMPARE_LLAMA:-./train_llama}
VIT=${SWITCH_COMPARE_VIT:-./train_vit}
BUDGET=${SWITCH_COMPARE_BUDGET_S:-1800}
RUN_LIMIT=${SWITCH_COMPARE_RUN_LIMIT_S:-150}
TINY=${SWITCH_COMPARE_TINY:-0}
HF=${SWITCH_COMPARE_HF:-python3 scripts/bench/bench_hf.py}
ONLY=${SWITCH_COMPARE_ONLY:-}
EXTRA=${SWITCH_COMPARE_EXTRA:-}
# Every switch this script sets, unset first: "default" is the binary's own default.
SWITCHES="LLMC_ATTENTION LLMC_CUDA_GRAPH LLMC_HEAD_CHUNK LLMC_LORA_FUSED"
# shellcheck disable=SC2086
unset $SWITCHES
D=${SWITCH_COMPARE_DIR:-build/switch_compare}  # configs, data, each run's log and --out
mkdir -p "$D"
T0=$(date +%s)
FAILED=0
TABLE=()

GPU=$(nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null | head -n 1)
elapsed() { echo $(( $(date +%s) - T0 )); }

HEADER="| shape | run | switches | status | loss | grad norm | rate | vs ref | check | notes |"
write_table() {
    {
        echo "# switch_compare.sh $WHAT ($(date -u '+%Y-%m-%d %H:%M UTC'), commit $(git rev-parse --short HEAD 2>/dev/null || echo '?'))"
        echo
        echo "GPU: ${GPU:-none found}"
        echo "$STEPS steps per run, rate: mean after the first step; vs ref: rate over the reference's."
        echo "Bounds against the reference: loss 1e-2, grad norm 0.15 relative; identical: loss, grad norm and adapter bytes."
        echo
        echo "$HEADER"
        echo "|---|---|---|---|---|---|---|---|---|---|"
        local r
        for r in "${TABLE[@]}"; do echo "$r"; done
    } > "$D/switches.md.tmp"
    mv -f "$D/switches.md.tmp" "$D/switches.md"
    [ -n "${OUT:-}" ] && cp "$D/switches.md" "$OUT/switches.md"
}

# emit CELLS...: one table row, printed and kept.
emit() {
    local row="|" c
    for c in "$@"; do row="$row ${c//|//} |"; done
    TABLE+=("$row")
    echo "$row"
    write_table
}

# ---- the shapes -------------------------------------------------------------------------------
# llama_config DIR D F LAYERS HEADS KV VOCAB THETA
llama_config() {
    mkdir -p "$1"
    cat > "$1/config.json" <<EOF
{"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": $2, "intermediate_size": $3,
 "num_hidden_layers": $4, "num_attention_heads": $5, "num_key_value_heads": $6, "vocab_size": $7,
 "rms_norm_eps": 1e-05, "rope_theta": $8, "max_position_embeddings": 8192, "tie_word_embeddings": false,
 "hidden_act": "silu", "torch_dtype": "bfloat16"}
EOF
}
# vit_config DIR D F LAYERS HEADS IMAGE PATCH
vit_config() {
    mkdir -p "$1"
    cat > "$1/config.json" <<EOF
{"architectures": ["ViTForImageClassification"], "model_type": "vit", "hidden_size": $2, "intermediate_size": $3,
 "num_hidden_layers": $4, "num_attention_heads": $5, "image_size": $6, "patch_size": $7, "num_channels": 3,
 "layer_norm_eps": 1e-12, "hidden_act": "gelu", "qkv_bias": true, "torch_dtype": "float32"}
EOF
}

# setup SHAPE: CMD (the trainer's command without --out), UNIT, HF_ARGS (bench_hf.py's, none: no row),
# LABEL; writes the config and the data.
setup() {
    local s=$1 dir=$D/$1 b t r v n data classes img
    mkdir -p "$dir"
    HF_ARGS=()
    case $s in
    llama3 | llama7b)
        if [ "$TINY" = 1 ]; then  # the same kind of model (GQA and theta 5e5, or MHA), tiny
            b=1 t=64 r=4
            if [ "$s" = llama3 ]; then v=1024; llama_config "$dir" 64 160 2 4 2 $v 500000.0
            else v=512; llama_config "$dir" 64 172 2 4 4 $v 10000.0; fi
        elif [ "$s" = llama3 ]; then b=1 t=4096 r=16 v=128256; llama_config "$dir" 4096 14336 2 32 8 $v 500000.0
        else b=1 t=2048 r=16 v=32000; llama_config "$dir" 4096 11008 2 32 32 $v 10000.0; fi
        n=$(( (STEPS + 2) * b * (t + 1) )) data="$dir/tokens_${v}_$n.bin"  # per vocabulary and length
        [ -f "$data" ] || python3 scripts/bench/bench_data.py tokens "$data" $v $n
        CMD=("$LLAMA" --model "$dir" --random-init --device cuda --data "$data" --batch "$b" --seq "$t"
             --lora-rank "$r" --lr 1e-4 --seed 5 --steps "$STEPS" --log-every 1)
        UNIT=tok HF_ARGS=(llama --batch "$b" --seq "$t" --rank "$r")
        LABEL="$s$([ "$TINY" = 1 ] && echo ' (tiny)') ${b}x$t" ;;
    vit)
        if [ "$TINY" = 1 ]; then b=4 img=32 classes=10; vit_config "$dir" 64 128 2 4 32 8
        else b=64 img=224 classes=100; vit_config "$dir" 768 3072 12 12 224 16; fi
        n=$(( (STEPS + 1) * b )) data="$dir/images_${img}_${classes}_$n.bin"
        [ -f "$data" ] || python3 scripts/bench/bench_data.py images "$data" $n $img $classes
        CMD=("$VIT" --model "$dir" --random-init --device cuda --data "$data" --batch "$b"
             --lora-rank 4 --lr 1e-4 --seed 5 --steps "$STEPS" --log-every 1)
        UNIT=img HF_ARGS=(vit --batch "$b" --rank 4)
        LABEL="vit$([ "$TINY" = 1 ] && echo ' (tiny)') batch $b" ;;
    demo)
        CMD=("$LLAMA" --model data/llama_demo --data data/llama_demo_ft_train.bin --device cuda --batch 4 --seq 128
             --lora-rank 8 --lr 1e-3 --seed 5 --steps "$STEPS" --log-every 1)
        UNIT=tok LABEL="demo 4x128" ;;  # no transformers row: its weights are real, bench_hf.py's random
    packed)  # the demo's tokens with a document start every 3..60 tokens (seeded)
        data="$dir/packed.bin"
        [ -f "$data" ] || python3 - "$data" <<'PY'
import sys
import numpy as np
sys.path.insert(0, "scripts/formats")
import shards
toks, mask, vocab = shards.read_shard("data/llama_demo_ft_train.bin")[:3]
ends = np.cumsum(np.random.default_rng(7).integers(3, 61, size=toks.size))
starts = np.zeros(toks.size, np.uint8)
starts[ends[ends < toks.size]] = 1
starts[0] = 1
shards.write_shard(sys.argv[1], toks.astype(np.uint32), mask, vocab, starts=starts)
PY
        if [ "$TINY" = 1 ]; then b=2 t=32; else b=4 t=128; fi
        CMD=("$LLAMA" --model data/llama_demo --data "$data" --device cuda --batch "$b" --seq "$t"
             --lora-rank 8 --lr 1e-3 --seed 5 --steps "$STEPS" --log-every 1)
        UNIT=tok LABEL="packed$([ "$TINY" = 1 ] && echo ' (tiny)') ${b}x$t (the demo)" ;;
    esac
}

# The rows of a shape, in order: "name|reference|check|VAR=value ...". ViT has no LM head (no
# head-chunk row).
OLD_KERNELS="LLMC_CUDA_GRAPH=0 LLMC_LORA_FUSED=0"
runs_of() {
    local llama=1
    [ "$1" = vit ] && llama=0
    if [ "$1" = packed ]; then  # the attention rows of packed examples
        echo "default||reference|"
        echo "graph|default|bounds|LLMC_CUDA_GRAPH=1"
        echo "gemm|default|bounds|LLMC_ATTENTION=gemm"
        echo "cudnn-packed=gemm|default|bounds|LLMC_CUDNN_PACKED=gemm"
        echo "gemm+graph|gemm|identical|LLMC_ATTENTION=gemm LLMC_CUDA_GRAPH=1"
        return
    fi
    echo "default||reference|"
    echo "graph|default|bounds|LLMC_CUDA_GRAPH=1"
    echo "gemm|default|bounds|LLMC_ATTENTION=gemm"
    echo "transformers+PEFT|default|hf|"
    echo "lora-fused=0|default|bounds|LLMC_LORA_FUSED=0"
    echo "lora-fused=1|default|bounds|LLMC_LORA_FUSED=1"
    echo "gemm+graph|gemm|identical|LLMC_ATTENTION=gemm LLMC_CUDA_GRAPH=1"
    [ $llama = 1 ] && echo "head-chunk=old|default|bounds|LLMC_HEAD_CHUNK=old"
    if [ $llama = 1 ]; then echo "all-old|default|bounds|$OLD_KERNELS LLMC_HEAD_CHUNK=old"
    else echo "all-old|default|bounds|$OLD_KERNELS"; fi
    if [ -n "$EXTRA" ]; then echo "$EXTRA" | tr ';' '\n'; fi
}

# What the binary said of the switches in $1 (VAR=value ...), from log $2; of more than two, those
# it said nothing of are counted, not named.
reported() {
    local kv var pat line notes="" silent=0 count
    count=$(echo "$1" | wc -w)
    for kv in $1; do
        var=${kv%%=*}
        case $var in
            LLMC_CUDA_GRAPH) pat='^cuda graph:' ;;
            LLMC_ATTENTION) pat='^attention:' ;;
            LLMC_HEAD_CHUNK) pat='LM head chunk:' ;;
            LLMC_LORA_FUSED) pat='LLMC_LORA_FUSED|[Ff]used LoRA|LoRA[^|]*fused' ;;
            *) pat=$var ;;
        esac
        line=$(grep -a -m 1 -E "$pat" "$2" 2>/dev/null | sed 's/^ *//' | cut -c1-110)
        if [ -n "$line" ]; then case "$notes" in *" $line;"*) continue ;; esac; fi  # one line may answer two
        if [ -n "$line" ]; then notes="$notes $line;"
        elif [ "$count" -gt 2 ]; then silent=$(( silent + 1 ))
        else notes="$notes $kv (not reported);"; fi
    done
    [ $silent -gt 0 ] && notes="$notes $silent more not reported;"
    echo "${notes# }"
}

# ---- one run ----------------------------------------------------------------------------------
# Per shape, by run name: status, loss, grad norm, rate, and the output directory.
declare -A R_STATUS R_LOSS R_GN R_RATE R_OUT
SHAPE_END=0   # when this shape's share of the budget ends (seconds since T0)
LONGEST=0     # its longest trainer run so far; HF_LONGEST the transformers run's
HF_LONGEST=0

# time_for LONGEST: sets LIMIT, the timeout of the next run, or fails (why in SKIP_WHY) when it
# cannot fit: under 5 s or under LONGEST (seconds) left of this shape's share.
time_for() {
    local want=$1 shape_left=$(( SHAPE_END - $(elapsed) )) left=$(( BUDGET - $(elapsed) ))
    if [ $shape_left -lt 5 ] || [ $shape_left -lt "$want" ]; then
        SKIP_WHY="SKIPPED: $shape_left s of this shape's budget share left, a run here took up to $want s"
        return 1
    fi
    LIMIT=$RUN_LIMIT
    [ "$LIMIT" -gt "$left" ] && LIMIT=$left
    return 0
}

# csv_last LOG COLUMN: the column named COLUMN of log.csv's last row; csv_rate LOG COLUMN: its mean after row 1.
csv_col() { awk -F, -v c="$2" -v mode="$3" 'NR == 1 { for (i = 1; i <= NF; i++) if ($i == c) k = i; next }
    k && $k != "" { last = $k; n++; if (n > 1) { s += $k; m++ } }
    END { if (mode == "last") print last; else if (m) printf "%.1f", s / m; else if (n) printf "%.1f", last }' "$1" 2>/dev/null; }

ratio_of() { awk -v a="$1" -v b="$2" 'BEGIN { if (b > 0) printf "%.2fx", a / b; else print "-" }'; }

trainer_run() {
    local shape=$1 name=$2 ref=$3 check=$4 envs=$5 out log limit rc t start loss gn rate verdict status ratio notes
    out="$D/$shape/$name.out" log="$D/$shape/$name.log"
    rm -rf "$out"
    if ! time_for $LONGEST; then
        emit "$LABEL" "$name" "${envs:-(none)}" SKIPPED - - - - "$SKIP_WHY" ""
        return
    fi
    limit=$LIMIT start=$(date +%s)
    # shellcheck disable=SC2086  # the assignments split into words on purpose
    env $envs timeout -k 5 "$limit" "${CMD[@]}" --out "$out" > "$log" 2>&1
    rc=$?
    t=$(( $(date +%s) - start ))
    [ $t -gt $LONGEST ] && LONGEST=$t
    loss=$(csv_col "$out/log.csv" loss last)
    gn=$(csv_col "$out/log.csv" grad_norm last)
    rate=$(csv_col "$out/log.csv" "$([ "$UNIT" = img ] && echo images || echo tokens)_per_s" mean)
    ratio=-
    if [ $rc -ne 0 ] || [ -z "$loss" ]; then
        status="FAIL(rc=$rc)"
        verdict="$(grep -a -E '^(error|cuDNN|LLMC_|CUDA error)' "$log" | head -n 1 | cut -c1-110)"
        if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
            status="TIMEOUT(${limit}s)" verdict="killed at the smaller of SWITCH_COMPARE_RUN_LIMIT_S and the budget left"
        fi
        FAILED=1
    else
        status=PASS
        R_STATUS[$name]=PASS R_LOSS[$name]=$loss R_GN[$name]=$gn R_RATE[$name]=$rate R_OUT[$name]=$out
        if [ "$check" = reference ]; then
            verdict=reference
        elif [ "${R_STATUS[$ref]:-}" != PASS ]; then
            verdict="no $ref reference (it did not run or failed)"
        else
            ratio=$(ratio_of "$rate" "${R_RATE[$ref]}")
            if [ "$check" = identical ]; then
                if [ "$loss" = "${R_LOSS[$ref]}" ] && [ "$gn" = "${R_GN[$ref]}" ] \
                    && cmp -s "$out/adapter_model.safetensors" "${R_OUT[$ref]}/adapter_model.safetensors"; then
                    verdict="identical to $ref (adapter bytes too)"
                else
                    verdict="DIFFERS from $ref (loss ${R_LOSS[$ref]}, grad norm ${R_GN[$ref]}$(cmp -s "$out/adapter_model.safetensors" \
                        "${R_OUT[$ref]}/adapter_model.safetensors" || echo ', adapter bytes differ')): must be identical"
                    FAILED=1
                fi
            else
                verdict=$(awk -v a="$loss" -v b="${R_LOSS[$ref]}" -v g="$gn" -v h="${R_GN[$ref]}" -v r="$ref" 'BEGIN {
                    dl = (a - b) / b; if (dl < 0) dl = -dl; dg = (g - h) / h; if (dg < 0) dg = -dg
                    if (dl == 0 && dg == 0) { printf "ok: the same loss and grad norm as %s", r; exit }
                    printf "%s loss %.1e grad norm %.1e vs %s", (dl < 1e-2 && dg < 0.15) ? "ok:" : "OUT OF BOUNDS:", dl, dg, r }')
                case $verdict in OUT*) FAILED=1 ;; esac
            fi
        fi
    fi
    if [ "$name" = default ]; then notes=$(reported "LLMC_ATTENTION=default LLMC_LORA_FUSED=default" "$log")
    else notes=$(reported "$envs" "$log"); fi
    grep -a -q 'cudnn refused' "$log" && notes="$notes $(grep -a -m 1 -o 'cudnn refused.*' "$log" | cut -c1-110);"
    if [ "$shape" = packed ] && [ "$name" = default ] && [ "$status" = PASS ] && grep -a -q 'cudnn refused' "$log"; then
        status=FAIL verdict="packed examples not on cuDNN's ragged path" FAILED=1  # the row this shape is for
    fi
    emit "$LABEL" "$name" "${envs:-(none)}" "$status" "${loss:-?}" "${gn:-?}" "${rate:+$rate $UNIT/s}" "$ratio" "$verdict" "$notes"
}

hf_run() {
    local shape=$1 log="$D/$1/hf.log" limit rc t start line rate ratio peak status verdict
    if [ "$HF" = 0 ] || [ ${#HF_ARGS[@]} -eq 0 ]; then
        emit "$LABEL" transformers+PEFT "-" "NOT RUN" - - - - \
            "$([ "$HF" = 0 ] && echo 'SWITCH_COMPARE_HF=0' || echo 'real weights here: bench_hf.py makes random ones')" ""
        return
    fi
    # a first transformers run: the imports and the model's build, about half a minute
    if ! time_for $(( HF_LONGEST > 0 ? HF_LONGEST : (LONGEST > 30 ? LONGEST : 30) )); then
        emit "$LABEL" transformers+PEFT "-" SKIPPED - - - - "$SKIP_WHY" ""
        return
    fi
    limit=$LIMIT start=$(date +%s)
    # shellcheck disable=SC2086  # the command splits into words on purpose
    timeout -k 5 "$limit" $HF --model "$D/$shape" "${HF_ARGS[0]}" --mode plain "${HF_ARGS[@]:1}" --steps "$STEPS" \
        --warmup 1 > "$log" 2>&1
    rc=$?
    t=$(( $(date +%s) - start ))
    [ $t -gt $HF_LONGEST ] && HF_LONGEST=$t
    line=$(grep -a '^HF ' "$log" | tail -n 1)
    rate=$(echo "$line" | sed -n "s/.*: \([0-9.]*\) $UNIT\/s.*/\1/p")
    peak=$(echo "$line" | sed -n 's/.*peak \([0-9.]*\) MiB.*/\1/p')
    ratio=-
    if [ $rc -eq 0 ] && [ -n "$rate" ]; then
        status=PASS verdict="transformers + PEFT, bf16 weights, SDPA, no checkpointing; its own random weights"
        [ "${R_STATUS[default]:-}" = PASS ] && ratio=$(ratio_of "$rate" "${R_RATE[default]}")
    elif grep -a -q -E "No module named '(torch|transformers|peft)'" "$log"; then  # not ours to fail
        status="NOT RUN" verdict=$(grep -a -m 1 -o -E "No module named '[a-z]+'" "$log")
    else
        status="FAIL(rc=$rc)" verdict=$(tail -n 1 "$log" | cut -c1-110)
        [ $rc -eq 124 ] || [ $rc -eq 137 ] && status="TIMEOUT(${limit}s)"
        FAILED=1
    fi
    emit "$LABEL" transformers+PEFT "(bench_hf.py --mode plain)" "$status" - - "${rate:+$rate $UNIT/s}" "$ratio" "$verdict" \
        "${peak:+peak $peak MiB (torch max_memory_allocated)}"
}

# ---- the run ----------------------------------------------------------------------------------
echo "$HEADER"
echo "|---|---|---|---|---|---|---|---|---|---|"
write_table
# shellcheck disable=SC2086
set -- $SHAPES
n=$#
i=0
for shape in $SHAPES; do
    R_STATUS=() R_LOSS=() R_GN=() R_RATE=() R_OUT=()
    LONGEST=0 HF_LONGEST=0
    SHAPE_END=$(( $(elapsed) + (BUDGET - $(elapsed)) / (n - i) ))
    i=$(( i + 1 ))
    setup "$shape"
    while IFS='|' read -r name ref check envs; do
        [ -z "$name" ] && continue
        if [ -n "$ONLY" ]; then case " $ONLY " in *" $name "*) ;; *) continue ;; esac; fi
        if [ "$check" = hf ]; then hf_run "$shape"
        else trainer_run "$shape" "$name" "$ref" "$check" "$envs"; fi
    done < <(runs_of "$shape")
done
exit $FAILED
