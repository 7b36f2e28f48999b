#!/usr/bin/env bash
# Runs the sanitizer builds (make test-asan: AddressSanitizer + UndefinedBehaviorSanitizer, leak
# checks on) through every mode and output of both trainers and through bad inputs, on the
# bundled demo data. Any sanitizer report fails the run. Usage: scripts/ci/asan_smoke.sh BUILD_DIR
set -uo pipefail
cd "$(dirname "$0")/../.."
B=${1:-build/asan}
W=$(mktemp -d)
trap 'rm -rf "$W"' EXIT
export ASAN_OPTIONS=detect_leaks=1:abort_on_error=0 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 OMP_NUM_THREADS=2
fails=0; runs=0
check() {  # expected-exit-code command...
    local want=$1; shift
    runs=$((runs + 1))
    "$@" > "$W/log" 2>&1; local rc=$?
    if grep -qE 'ERROR: (Address|Leak)Sanitizer|runtime error' "$W/log" || { [ "$want" = 0 ] && [ $rc != 0 ]; } || { [ "$want" = 1 ] && [ $rc != 1 ]; }; then
        fails=$((fails + 1)); echo "FAIL (rc=$rc, expected $want): $*"; grep -E 'ERROR|runtime error|error:' "$W/log" | head -5
    else
        local c="$*"
        [ ${#c} -gt 110 ] && c="...${c: -107}"
        echo "PASS  $c"
    fi
}
L="$B/train_llama --model data/llama_demo --data data/llama_demo_ft_train.bin --val data/llama_demo_ft_val.bin --steps 2 --batch 2 --seq 64 --val-batches 1"
check 0 $L --mode lowmem --out "$W/a" --generate 8 --prompt Licensed
check 0 $L --mode ckpt
check 0 $L --mode lowmem --recompute block --ms-lora merged
check 0 $L --mode lowmem --lora-dropout 0.1 --grad-accum 2
check 0 $L --mode baseline --swiglu-product recompute --grad-accum 2
check 0 $L --full --out "$W/f" --stop-at 1
check 0 $L --full --resume "$W/f"
check 0 $L --adapter "$W/a" --export-merged "$W/m" --steps 1
check 0 $L --mode lowmem --quant nf4 --adapter "$W/a" --export-merged "$W/q" --generate 4 --prompt Licensed
check 0 $B/train_llama --model "$W/m" --val data/llama_demo_ft_val.bin --eval-only --seq 64 --batch 2
# a bitsandbytes NF4 checkpoint (test/model/test_nf4.py's writer): a safetensors file aligns nothing,
# and here the JSON quant-state blobs leave F32 quant maps at odd offsets (a misaligned float load
# under UBSan, before the reader copied them)
/usr/bin/python3 -c "import sys; sys.path[:0] = ['test/model', 'test/cuda', 'test/system', 'test']
import test_nf4; test_nf4.write_bnb_model('data/llama_demo', sys.argv[1])" "$W/bnb"
check 0 $B/train_llama --model "$W/bnb" --data data/llama_demo_ft_train.bin --steps 2 --batch 2 --seq 64 --quant nf4 --norm std
check 0 $B/train_llama --model "$W/bnb" --export-merged "$W/bnb_m" --lora-rank 2
check 0 $B/train_llama --model data/llama_demo --dry-run --json --batch 2 --seq 64
check 1 $B/train_llama --model data/llama_demo --data data/llama_demo/config.json
check 1 $B/train_llama --model data --generate 3
# --generate through a tokenizer.json (no tokenizer.bin): SentencePiece-style and byte-level + NFC
for k in sp bl; do mkdir -p "$W/$k" && cp data/llama_demo/config.json data/llama_demo/model.safetensors "$W/$k/"; done
cat > "$W/sp/tokenizer.json" <<'JSON'
{"added_tokens": [{"id": 1, "content": "<s>", "special": true}],
 "normalizer": {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "\u2581"},
                {"type": "Replace", "pattern": {"String": " "}, "content": "\u2581"}]},
 "post_processor": {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}]},
 "decoder": {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "\u2581"}, "content": " "},
             {"type": "ByteFallback"}, {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]},
 "model": {"type": "BPE", "unk_token": "<unk>", "byte_fallback": true, "fuse_unk": true,
           "vocab": {"<unk>": 0, "<s>": 1, "<0xC3>": 2, "<0xA9>": 3, "\u2581": 4, "H": 5, "\u2581H": 6}, "merges": ["\u2581 H"]}}
JSON
cat > "$W/bl/tokenizer.json" <<'JSON'
{"added_tokens": [{"id": 4, "content": "<|e|>", "special": true}], "normalizer": {"type": "NFC"},
 "pre_tokenizer": {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": true},
   {"type": "Split", "pattern": {"Regex": "(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+"}, "behavior": "Isolated", "invert": false},
   {"type": "ByteLevel", "add_prefix_space": false, "use_regex": false}]},
 "decoder": {"type": "ByteLevel"},
 "model": {"type": "BPE", "vocab": {"H": 0, "\u00c3": 1, "\u00a9": 2, "\u00c3\u00a9": 3, "<|e|>": 4}, "merges": [["\u00c3", "\u00a9"]]}}
JSON
check 0 $B/train_llama --model "$W/sp" --generate 6 --seq 64 --prompt $'He\xcc\x81 H 12<s>'
check 0 $B/train_llama --model "$W/bl" --generate 6 --seq 64 --prompt $'He\xcc\x81 H 12<|e|>'
# --chat through the chat template renderer (llmc/text/chat_template.h): the subset-wide template of
# test/fixtures/chat_subset.jinja, then one outside the subset
python3 -c "import json, sys; json.dump({'chat_template': open(sys.argv[1]).read(), 'bos_token': 'H', \
  'eos_token': '<|e|>'}, open(sys.argv[2], 'w'))" test/fixtures/chat_subset.jinja "$W/bl/tokenizer_config.json"
check 0 $B/train_llama --model "$W/bl" --generate 3 --seq 128 --chat --system ' H ' --prompt $'H\xc3\xa9'
echo '{"chat_template": "{{ messages | tojson }}"}' > "$W/bl/tokenizer_config.json"
check 1 $B/train_llama --model "$W/bl" --generate 3 --seq 64 --chat --prompt H
check 1 $L --resume "$W/a" --lora-rank 4
check 1 $B/train_llama --model data/llama_demo --data data   # a directory where a file is expected
mkdir -p "$W/ad" && cp "$W/a/adapter_config.json" "$W/ad/" && mkdir "$W/ad/adapter_model.safetensors"
check 1 $L --adapter "$W/ad"
# a save killed between its renames (SIGKILL: no sanitizer report to read), finished by the resume;
# then one flipped byte in the state, refused
(LLMC_FAULT_KILL_SAVE=2:state $L --out "$W/k" --save-every 1; true) > /dev/null 2>&1
check 0 $L --resume "$W/k" --save-every 1
printf 'X' | dd of="$W/k/train_state.bin" bs=1 seek=2000 conv=notrunc 2>/dev/null
check 1 $L --resume "$W/k" --save-every 1
V="$B/train_vit --model data/vit_demo --data data/vit_demo_ft_train.bin --val data/vit_demo_ft_val.bin --steps 2 --batch 8 --val-batches 1"
check 0 $V --mode lowmem --out "$W/v" --export-merged "$W/vm"
check 0 $V --mode lowmem --lora-dropout 0.1
check 0 $V --mode ckpt --lora-targets q,v
check 0 $V --mode lowmem --ms-lora merged --out "$W/vp"
check 0 $V --mode lowmem --adapter "$W/vp" --recompute block
check 0 $V --full --mode baseline
check 0 $B/train_vit --model "$W/vm" --val data/vit_demo_ft_val.bin --eval-only --batch 8 --val-batches 1
check 1 $B/train_vit --model data/vit_demo --data data/llama_demo_ft_train.bin
check 1 $B/train_vit --model data/vit_demo --data data
check 0 $B/test_units
echo "asan-smoke: $((runs - fails)) passed, $fails failed"
[ $fails = 0 ]
