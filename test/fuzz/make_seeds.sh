#!/usr/bin/env bash
# test/fuzz/make_seeds.sh OUT [PYTHON]: writes the seed inputs of `make fuzz` into the folder OUT
# (emptied first). test/fuzz/fuzz_parsers.cu reads an input's first byte as the parser to run
# (0 JSON, 1 safetensors, 2 token shard, 3 tokenizer.bin, 4 image shard, 5 tokenizer.json,
# 6 training state, 7 chat template) and the rest as the file, so each seed is that byte before
# a bundled file or a small valid input written here: libFuzzer then starts from inputs that
# every parser accepts and mutates them into the corners. PYTHON (default python3) writes the
# seeds that carry checksums.
# no pipefail: `head -c` closes its pipe early by design, and the cat before it dies of SIGPIPE
set -eu
OUT=${1:?usage: test/fuzz/make_seeds.sh OUT [PYTHON]}
PY=${2:-python3}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
DATA=$ROOT/data
FIXTURES=$ROOT/test/fixtures

rm -rf "$OUT"
mkdir -p "$OUT"
printf '\000' | cat - "$DATA/llama_demo/config.json" > "$OUT/json"
printf '\001' | cat - "$DATA/vit_demo/model.safetensors" | head -c 4096 > "$OUT/safetensors_head"
# safetensors written by hand: 8 bytes of header length, the header, the data
printf '\001\070\000\000\000\000\000\000\000{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}  ' \
  > "$OUT/safetensors"
printf '\001\000\000\000\000\000\200\077' >> "$OUT/safetensors"
printf '\001\160\000\000\000\000\000\000\000{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},'\
'"b":{"dtype":"BF16","shape":[2],"data_offsets":[4,8]}}    ' > "$OUT/safetensors2"
printf '\000\000\200\077\200\077\000\300' >> "$OUT/safetensors2"
printf '\001\120\000\000\000\000\000\000\000{"a":{"dtype":"F32","shape":[4294967296,4294967296],'\
'"data_offsets":[0,0]}}      ' > "$OUT/safetensors_overflow"
printf '\002' | cat - "$DATA/llama_demo_ft_val.bin" > "$OUT/shard"
printf '\003' | cat - "$DATA/llama_demo/tokenizer.bin" > "$OUT/tokenizer"
printf '\004' | cat - "$DATA/vit_demo_ft_val.bin" | head -c 20000 > "$OUT/images"
# tokenizer.json: a byte-level BPE (SmolLM2's and Llama-3's kind) and a SentencePiece-style one
printf '\005{"added_tokens":[{"id":4,"content":"<s>","special":true}],"pre_tokenizer":{"type":"Sequence",'\
'"pretokenizers":[{"type":"Digits","individual_digits":true},{"type":"ByteLevel","add_prefix_space":false,'\
'"use_regex":true}]},"decoder":{"type":"ByteLevel"},"model":{"type":"BPE","vocab":{"f":0,"u":1,"fu":2,"z":3,'\
'"<s>":4},"merges":[["f","u"]]}}' > "$OUT/tokenizer_json"
printf '\007' | cat - "$FIXTURES/chat_subset.jinja" > "$OUT/chat_template"
printf '\007' | cat - "$FIXTURES/chat_qwen3.jinja" > "$OUT/chat_template_qwen3"
printf '\005{"added_tokens":[{"id":1,"content":"<s>","special":true}],"normalizer":{"type":"Sequence",'\
'"normalizers":[{"type":"Prepend","prepend":"\\u2581"},{"type":"Replace","pattern":{"String":" "},'\
'"content":"\\u2581"}]},"post_processor":{"type":"TemplateProcessing","single":[{"SpecialToken":{"id":"<s>",'\
'"type_id":0}},{"Sequence":{"id":"A","type_id":0}}]},"decoder":{"type":"Sequence","decoders":[{"type":'\
'"Replace","pattern":{"String":"\\u2581"},"content":" "},{"type":"ByteFallback"},{"type":"Fuse"},{"type":'\
'"Strip","content":" ","start":1,"stop":0}]},"model":{"type":"BPE","unk_token":"<unk>","byte_fallback":true,'\
'"vocab":{"<unk>":0,"<s>":1,"<0x66>":2,"\\u2581":3,"f":4,"\\u2581f":5},"merges":["\\u2581 f"]}}' \
  > "$OUT/tokenizer_json_sp"
# a training state of 4 trainable values, and a safetensors file recording its data's CRC-32
"$PY" - "$OUT" <<'EOF'
import os, struct, sys, zlib
out = sys.argv[1]
b = (b'LMFTSTAT' + struct.pack('<Iqq', 2, 1, 0) + bytes(8) + b'fuzz'.ljust(1024, b'\0') +
     struct.pack('<q', 4) + bytes(72) + struct.pack('<12f', *range(12)))
open(os.path.join(out, 'state'), 'wb').write(b'\6' + b + struct.pack('<I', zlib.crc32(b)))
d = struct.pack('<2f', 1, 2)
h = ('{"__metadata__":{"llmc_crc32":"%08x"},"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'
     % zlib.crc32(d)).encode()
open(os.path.join(out, 'safetensors_crc'), 'wb').write(b'\1' + struct.pack('<Q', len(h)) + h + d)
EOF
