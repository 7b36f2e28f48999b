"""Convert a llama2.c checkpoint or a GGUF file (llama, qwen2, qwen3, gemma2, gemma3, phi3) into a Hugging Face
model directory.

    python3 scripts/export/export_llama.py --llama2c model.bin --tokenizer tok.bin --out DIR [--dtype bf16]
    python3 scripts/export/export_llama.py --gguf model.gguf --out DIR [--dtype bf16]

DIR gets config.json, model.safetensors and tokenizer.bin (the C trainer reads the
llama2.c tokenizer for encode/decode). The trainer reads only the Hugging Face
layout, so every other source is converted here once. DIR is written whole or not at all and
replaces an earlier export whole; a DIR holding other files is refused (scripts/formats/model_dir.py).

GGUF (needs `pip install gguf`): the tensors are dequantized (scripts/formats/gguf_llama.py says
which types and how, and how each family's tensors and keys map back), the hyperparameters come from the
{arch}.* metadata, and the tokenizer
from tokenizer.ggml.*; a byte-level BPE (GPT-2 style) tokenizer is written as a tokenizer.bin
of raw-byte pieces plus tokenizer_config.json, whose "tokenizer_bin" block tells the trainer
to use byte-level conventions (llmc/text/tokenizer.h).

llama2.c rotates interleaved pairs (2i, 2i+1) in RoPE; Hugging Face rotates pairs
(i, i + head_dim/2). Permuting the rows of wq and wk within each head turns one
convention into the other, so the exported model computes the same function.
"""
import argparse
import json
import os
import shutil
import struct
import sys

import numpy as np

# sibling modules in scripts/<folder>/
SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, d) for d in ("formats",)]
import model_dir  # noqa: E402
import st_io  # noqa: E402
import gguf_llama  # noqa: E402
from gguf_llama import interleaved_to_half  # noqa: E402  (the same permutation serves both)
from llama2c_tokenizer import read_tokenizer_bin, write_tokenizer_bin  # noqa: E402

V1_MAGIC = 0x616B3432  # "ak42" read as a little-endian uint32
V1_HEADER_BYTES = 256
CONFIG_FIELDS = ("dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size",
                 "max_seq_len")


class ExportError(Exception):
    """A problem with an input file; reported as one line naming the file."""


def parse_header(path, data):
    """Return (config dict, shared_classifier, offset of the first weight, version)."""
    if len(data) < 28:
        raise ExportError(f"{path}: too short for a llama2.c header ({len(data)} bytes)")
    (magic,) = struct.unpack_from("<I", data, 0)
    if magic == V1_MAGIC:
        if len(data) < V1_HEADER_BYTES:
            raise ExportError(f"{path}: truncated version-1 header")
        (version,) = struct.unpack_from("<i", data, 4)
        if version != 1:
            raise ExportError(f"{path}: llama2.c format version {version} is not supported "
                              "(only legacy v0 and version 1 fp32)")
        cfg = dict(zip(CONFIG_FIELDS, struct.unpack_from("<7i", data, 8)))
        shared = data[36] != 0
        return cfg, shared, V1_HEADER_BYTES, 1
    cfg = dict(zip(CONFIG_FIELDS, struct.unpack_from("<7i", data, 0)))
    # legacy v0: a negative vocab_size flags an untied classifier at the end
    shared = cfg["vocab_size"] > 0
    cfg["vocab_size"] = abs(cfg["vocab_size"])
    return cfg, shared, 28, 0


def check_config(path, cfg):
    """Reject headers that cannot describe a real model (also catches non-llama2.c files)."""
    for k, v in cfg.items():
        if v <= 0 or v > 1 << 24:
            raise ExportError(f"{path}: header field {k} = {v} is out of range")
    if cfg["dim"] % cfg["n_heads"] or (cfg["dim"] // cfg["n_heads"]) % 2:
        raise ExportError(f"{path}: dim {cfg['dim']} is not n_heads {cfg['n_heads']} "
                          "times an even head_dim")
    if cfg["n_heads"] % cfg["n_kv_heads"]:
        raise ExportError(f"{path}: n_heads {cfg['n_heads']} is not a multiple of "
                          f"n_kv_heads {cfg['n_kv_heads']}")


def weight_shapes(cfg, shared, version):
    """Ordered list of (name, shape) as stored in the file; None names are skipped."""
    d, h, L, v = cfg["dim"], cfg["hidden_dim"], cfg["n_layers"], cfg["vocab_size"]
    head_dim = d // cfg["n_heads"]
    kv_dim = head_dim * cfg["n_kv_heads"]
    norms = [("rms_att", (L, d)), ("rms_ffn", (L, d)), ("rms_final", (d,))]
    emb = [("tok_embeddings", (v, d))]
    mats = [("wq", (L, d, d)), ("wk", (L, kv_dim, d)), ("wv", (L, kv_dim, d)),
            ("wo", (L, d, d)), ("w1", (L, h, d)), ("w2", (L, d, h)), ("w3", (L, h, d))]
    cls = [] if shared else [("wcls", (v, d))]
    if version == 1:
        return norms + emb + mats + cls
    rope = (cfg["max_seq_len"], head_dim // 2)  # precomputed freq_cis tables, unused
    return (emb + [norms[0]] + mats[:4] + [norms[1]] + mats[4:] + [norms[2]]
            + [(None, rope), (None, rope)] + cls)


def read_weights(path, data, offset, shapes):
    """Slice the float32 arrays out of data; the sizes must match the file exactly."""
    need = offset + 4 * sum(int(np.prod(s)) for _, s in shapes)
    if len(data) != need:
        what = "truncated" if len(data) < need else "has trailing bytes"
        raise ExportError(f"{path}: file {what}: {len(data)} bytes, header implies {need}")
    out = {}
    for name, shape in shapes:
        count = int(np.prod(shape))
        if name is not None:
            out[name] = np.frombuffer(data, "<f4", count, offset).reshape(shape)
        offset += 4 * count
    return out


def to_hf_tensors(cfg, w, shared):
    """Map llama2.c arrays to Hugging Face LlamaForCausalLM parameter names."""
    t = {"model.embed_tokens.weight": w["tok_embeddings"], "model.norm.weight": w["rms_final"]}
    for i in range(cfg["n_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = interleaved_to_half(w["wq"][i], cfg["n_heads"])
        t[p + "self_attn.k_proj.weight"] = interleaved_to_half(w["wk"][i], cfg["n_kv_heads"])
        t[p + "self_attn.v_proj.weight"] = w["wv"][i]
        t[p + "self_attn.o_proj.weight"] = w["wo"][i]
        t[p + "mlp.gate_proj.weight"] = w["w1"][i]
        t[p + "mlp.down_proj.weight"] = w["w2"][i]
        t[p + "mlp.up_proj.weight"] = w["w3"][i]
        t[p + "input_layernorm.weight"] = w["rms_att"][i]
        t[p + "post_attention_layernorm.weight"] = w["rms_ffn"][i]
    if not shared:
        t["lm_head.weight"] = w["wcls"]
    return {k: np.ascontiguousarray(v, dtype=np.float32) for k, v in t.items()}


def hf_config(cfg, shared, dtype):
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": cfg["dim"],
        "intermediate_size": cfg["hidden_dim"],
        "num_hidden_layers": cfg["n_layers"],
        "num_attention_heads": cfg["n_heads"],
        "num_key_value_heads": cfg["n_kv_heads"],
        "vocab_size": cfg["vocab_size"],
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "max_position_embeddings": cfg["max_seq_len"],
        "tie_word_embeddings": bool(shared),
        "bos_token_id": 1,
        "eos_token_id": 2,
        "hidden_act": "silu",
        "torch_dtype": "bfloat16" if dtype == "bf16" else "float32",
    }


def load_llama2c(path):
    """Read a llama2.c checkpoint: return (cfg, shared, Hugging Face tensors)."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as e:
        raise ExportError(f"{path}: cannot read ({e.strerror})") from None
    cfg, shared, offset, version = parse_header(path, data)
    check_config(path, cfg)
    w = read_weights(path, data, offset, weight_shapes(cfg, shared, version))
    return cfg, shared, to_hf_tensors(cfg, w, shared)


def check_tokenizer(path, vocab_size):
    try:
        pieces, _, _ = read_tokenizer_bin(path)
    except OSError as e:
        raise ExportError(f"{path}: cannot read ({e.strerror})") from None
    except ValueError as e:
        raise ExportError(str(e)) from None
    if len(pieces) != vocab_size:
        raise ExportError(f"{path}: tokenizer has {len(pieces)} tokens but the model's "
                          f"vocab_size is {vocab_size}")


def write_json(path, obj):
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, ensure_ascii=False)
        f.write("\n")


def write_model_dir(out, config, tensors, tokenizer, dtype):
    """Write everything into a staging directory that then takes OUT's place (model_dir.py).

    tokenizer: a tokenizer.bin path to copy, or (pieces, scores, tokenizer_config dict)."""
    try:
        with model_dir.staged(out) as tmp:
            with open(os.path.join(tmp, "config.json"), "w") as f:
                json.dump(config, f, indent=2)
                f.write("\n")
            st_io.save(os.path.join(tmp, "model.safetensors"), tensors, metadata={"format": "pt"},
                       bf16=(dtype == "bf16"))
            if isinstance(tokenizer, str):
                shutil.copyfile(tokenizer, os.path.join(tmp, "tokenizer.bin"))
            else:
                pieces, scores, tok_config = tokenizer
                write_tokenizer_bin(os.path.join(tmp, "tokenizer.bin"), pieces, scores)
                write_json(os.path.join(tmp, "tokenizer_config.json"), tok_config)
    except model_dir.ModelDirError as e:
        raise ExportError(str(e)) from None


def export_gguf(args):
    try:
        config, tensors, tokenizer, types = gguf_llama.load_gguf(args.gguf, args.dtype)
    except gguf_llama.GGUFError as e:
        raise ExportError(str(e)) from None
    try:
        write_model_dir(args.out, config, tensors, tokenizer, args.dtype)
    except OSError as e:
        raise ExportError(f"{args.out}: cannot write output ({e.strerror})") from None
    n_params = sum(t.size for t in tensors.values())
    shape = {k: config[k] for k in ("hidden_size", "intermediate_size", "num_hidden_layers",
                                    "num_attention_heads", "num_key_value_heads", "vocab_size")}
    print(f"wrote {args.out}: {shape}, tied={config['tie_word_embeddings']}, {n_params} "
          f"parameters dequantized from {types}, {args.dtype}, tokenizer "
          f"{tokenizer[2]['tokenizer_bin']['type']}")


def export(args):
    try:
        model_dir.check(args.out)  # before the conversion, not after it
    except model_dir.ModelDirError as e:
        raise ExportError(str(e)) from None
    if args.gguf:
        return export_gguf(args)
    cfg, shared, tensors = load_llama2c(args.llama2c)
    check_tokenizer(args.tokenizer, cfg["vocab_size"])
    config = hf_config(cfg, shared, args.dtype)
    try:
        write_model_dir(args.out, config, tensors, args.tokenizer, args.dtype)
    except OSError as e:
        raise ExportError(f"{args.out}: cannot write output ({e.strerror})") from None
    n_params = sum(t.size for t in tensors.values())
    print(f"wrote {args.out}: {cfg}, tied={shared}, {n_params} parameters, {args.dtype}")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_argument_group("source checkpoint (exactly one)")
    src.add_argument("--llama2c", metavar="FILE.bin",
                     help="llama2.c checkpoint (legacy v0 or version-1 fp32)")
    src.add_argument("--gguf", metavar="FILE.gguf",
                     help="llama.cpp GGUF file of a llama, qwen2, qwen3, gemma2, gemma3 or phi3 model "
                          "(F32/F16/BF16/Q8_0/Q4_0/Q4_1/Q5_0/Q5_1 tensors; needs `pip install gguf`); "
                          "its tokenizer comes along")
    ap.add_argument("--tokenizer", metavar="TOK.bin",
                    help="llama2.c tokenizer.bin matching the model's vocabulary (--llama2c only)")
    ap.add_argument("--out", required=True, metavar="DIR", help="output model directory")
    ap.add_argument("--dtype", choices=("f32", "bf16"), default="f32",
                    help="dtype of the weights in model.safetensors (default f32)")
    args = ap.parse_args(argv)
    if bool(args.llama2c) == bool(args.gguf):
        ap.error("exactly one source checkpoint is required: --llama2c FILE.bin or --gguf FILE.gguf")
    if args.llama2c and not args.tokenizer:
        ap.error("--llama2c needs --tokenizer TOK.bin")
    if args.gguf and args.tokenizer:
        ap.error("--tokenizer is for --llama2c; a GGUF file carries its own tokenizer")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        export(args)
    except ExportError as e:
        print(f"export_llama: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
