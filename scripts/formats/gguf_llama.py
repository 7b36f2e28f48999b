"""Read a GGUF file of llama.cpp's llama, qwen2, qwen3, gemma2, gemma3 or phi3 architecture as a Hugging Face model.

    from gguf_llama import load_gguf
    config, tensors, tokenizer = load_gguf("model.gguf")

The PyPI package `gguf` parses the file (metadata and raw tensor bytes); the dequantization is
our own, in numpy, so that it can be checked against the package's (test/formats/test_gguf_export.py).

Tensors. GGUF lists a tensor's dimensions innermost first (ne0 = the input features of a
linear layer), so a [ne0, ne1] matrix is the row-major [ne1, ne0] = [out, in] array that
Hugging Face stores. Quantized types hold blocks of 32 values:
  Q8_0  fp16 d, 32 x int8 q                     value = d * q
  Q4_0  fp16 d, 16 bytes of 4-bit q             value = d * (q - 8)
  Q4_1  fp16 d, fp16 m, 16 bytes of 4-bit q     value = d * q + m
  Q5_0  fp16 d, u32 high bits, 16 bytes         value = d * (q - 16)
  Q5_1  fp16 d, fp16 m, u32 high bits, 16 bytes value = d * q + m
In the 4-bit array, byte j holds element j in its low nibble and element j + 16 in its high
nibble; for the 5-bit types bit j of the u32 is the fifth bit of element j (bits 16..31 of
elements 16..31). F32, F16 and BF16 tensors are plain.

Q/K rows. llama.cpp's converter permutes the rows of every head of attn_q / attn_k so that
its RoPE can rotate adjacent pairs (2i, 2i+1); Hugging Face rotates (i, i + head_dim/2).
The inverse permutation (the same one llama2.c checkpoints need) restores HF order.

Families past llama (what scripts/export/export_gguf.py writes, turned back): gemma2 and gemma3 store every
RMSNorm weight as 1 + w (llama.cpp multiplies by it, Hugging Face's Gemma by 1 + w), so w = stored - 1; their
soft-caps, window, per-layer window pattern (gemma3: layer_types), local RoPE base and linear RoPE scaling become
the config keys. phi3's attn_qkv / ffn_up are Hugging Face's fused qkv_proj / gate_up_proj (same row order),
its rope_factors_long / _short tensors the LongRoPE rope_scaling. For these three families every {arch}.* key
of the file must be one this reader maps back; any other is refused.

Tokenizer. tokenizer.ggml.model "gpt2" is byte-level BPE: every byte is first mapped to a
printable character (GPT-2's byte alphabet), tokens are strings over that alphabet, and
tokenizer.ggml.merges lists the merges by priority. We write it as a llama2.c tokenizer.bin
whose pieces are the raw bytes and whose scores are minus the rank of the merge that makes
the token (base bytes and special tokens score below every merge), plus a "tokenizer_bin"
block in tokenizer_config.json that tells llmc/text/tokenizer.h (and scripts/formats/llama2c_tokenizer.py)
to use byte-level conventions. tokenizer.ggml.model "llama" (sentencepiece) maps "\u2581" back to
a space and keeps llama2.c's conventions.
"""
import numpy as np

INSTALL_HINT = "reading GGUF files needs the PyPI package `gguf`: python3 -m pip install gguf"

# ggml type ids (ggml.h enum ggml_type) of what we dequantize
F32, F16, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16 = 0, 1, 2, 3, 6, 7, 8, 30
TYPE_NAMES = {F32: "F32", F16: "F16", Q4_0: "Q4_0", Q4_1: "Q4_1", Q5_0: "Q5_0", Q5_1: "Q5_1",
              Q8_0: "Q8_0", BF16: "BF16"}
# (values per block, bytes per block)
BLOCK = {F32: (1, 4), F16: (1, 2), BF16: (1, 2), Q4_0: (32, 18), Q4_1: (32, 20),
         Q5_0: (32, 22), Q5_1: (32, 24), Q8_0: (32, 34)}

# gguf token types (llama.cpp's llama_token_type)
TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_CONTROL, TOKEN_USER_DEFINED, TOKEN_UNUSED, TOKEN_BYTE = 1, 2, 3, 4, 5, 6


class GGUFError(Exception):
    """A problem with the input file; reported as one line."""


def import_gguf():
    try:
        import gguf
    except ImportError:
        raise GGUFError(INSTALL_HINT) from None
    return gguf


# ---------------------------------------------------------------------------------------------
# dequantization

def _f16(blocks, start):
    """The fp16 at byte offset `start` of every block, as float32 [n_blocks, 1]."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view("<f2").astype(np.float32)


def _nibbles(qs):
    """[n, 16] bytes -> [n, 32] values: low nibbles are elements 0..15, high ones 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _fifth_bits(blocks, start):
    """The u32 of high bits at `start` -> [n, 32] values 0 or 16 (bit j for element j)."""
    qh = np.ascontiguousarray(blocks[:, start:start + 4]).view("<u4")
    return (((qh >> np.arange(32, dtype=np.uint32)) & 1) << 4).astype(np.uint8)


def dequantize(raw, ggml_type, n_values):
    """Raw tensor bytes (any shape of uint8) of a ggml type -> float32 [n_values]."""
    if ggml_type not in BLOCK:
        raise GGUFError(f"tensor type {ggml_type} is not supported (supported: "
                        f"{', '.join(TYPE_NAMES.values())})")
    per_block, block_bytes = BLOCK[ggml_type]
    raw = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    if n_values % per_block or raw.size != n_values // per_block * block_bytes:
        raise GGUFError(f"{TYPE_NAMES[ggml_type]} data of {raw.size} bytes does not hold "
                        f"{n_values} values")
    if ggml_type == F32:
        return raw.view("<f4").astype(np.float32)
    if ggml_type == F16:
        return raw.view("<f2").astype(np.float32)
    if ggml_type == BF16:
        return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    b = raw.reshape(-1, block_bytes)
    if ggml_type == Q8_0:
        out = _f16(b, 0) * b[:, 2:].view(np.int8).astype(np.float32)
    elif ggml_type == Q4_0:
        out = _f16(b, 0) * (_nibbles(b[:, 2:]).astype(np.float32) - 8)
    elif ggml_type == Q4_1:
        out = _f16(b, 0) * _nibbles(b[:, 4:]).astype(np.float32) + _f16(b, 2)
    elif ggml_type == Q5_0:
        q = _nibbles(b[:, 6:]) | _fifth_bits(b, 2)
        out = _f16(b, 0) * (q.astype(np.float32) - 16)
    else:  # Q5_1
        q = _nibbles(b[:, 8:]) | _fifth_bits(b, 4)
        out = _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)
    return out.reshape(-1)


def tensor_array(t):
    """A gguf ReaderTensor -> float32 array in row-major HF order (GGUF dims reversed)."""
    shape = tuple(int(x) for x in reversed(list(t.shape)))
    n = int(np.prod(shape)) if shape else 1
    try:
        values = dequantize(t.data, int(t.tensor_type), n)
    except GGUFError as e:
        raise GGUFError(f"tensor {t.name}: {e}") from None
    return values.reshape(shape)


# ---------------------------------------------------------------------------------------------
# q/k permutation

def interleaved_to_half(w, n_heads):
    """Rows of a q/k projection from interleaved RoPE pairs to HF rotate-half pairs: within a
    head, row 2i goes to row i and row 2i+1 to row i + head_dim/2."""
    rows, cols = w.shape
    return w.reshape(n_heads, rows // n_heads // 2, 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


def half_to_interleaved(w, n_heads):
    """The inverse: what llama.cpp's converter does to HF q/k weights."""
    rows, cols = w.shape
    return w.reshape(n_heads, 2, rows // n_heads // 2, cols).transpose(0, 2, 1, 3).reshape(rows, cols)


# ---------------------------------------------------------------------------------------------
# metadata

def field_value(field):
    """A ReaderField's value: a Python scalar, str, or list of them."""
    if hasattr(field, "contents"):
        return field.contents()
    gguf = import_gguf()  # older gguf releases: decode the parts ourselves
    vt = gguf.GGUFValueType
    last = field.types[-1]
    items = [field.parts[i] for i in field.data]
    vals = [bytes(p).decode("utf-8") if last == vt.STRING else p.tolist()[0] for p in items]
    return vals if field.types[0] == vt.ARRAY else vals[0]


def read_metadata(reader):
    return {k: field_value(f) for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def _f32(x):
    """A float32 metadata value as the shortest decimal that reads back the same float32."""
    return float(str(np.float32(x)))


# general.architecture -> (Hugging Face model_type, architectures entry); qwen2 and qwen3 apply NEOX RoPE
# (rotate-half, Hugging Face's row order), llama interleaved RoPE (rows permuted by llama.cpp's converter)
ARCHS = {"llama": ("llama", "LlamaForCausalLM"), "qwen2": ("qwen2", "Qwen2ForCausalLM"),
         "qwen3": ("qwen3", "Qwen3ForCausalLM"), "gemma2": ("gemma2", "Gemma2ForCausalLM"),
         "gemma3": ("gemma3_text", "Gemma3ForCausalLM"), "phi3": ("phi3", "Phi3ForCausalLM")}
GEMMA = ("gemma2", "gemma3")
# {arch}.* keys read back for every family, and per family the keys of its own
COMMON_KEYS = {"context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count",
               "attention.head_count_kv", "attention.layer_norm_rms_epsilon", "rope.freq_base",
               "rope.dimension_count", "attention.key_length", "attention.value_length", "vocab_size"}
FAMILY_KEYS = {
    "gemma2": {"attention.sliding_window", "attn_logit_softcapping", "final_logit_softcapping"},
    "gemma3": {"attention.sliding_window", "attention.sliding_window_pattern", "final_logit_softcapping",
               "rope.freq_base_swa", "rope.scaling.type", "rope.scaling.factor"},
    "phi3": {"rope.scaling.original_context_length", "rope.scaling.attn_factor", "attention.sliding_window"},
}


def hf_config(path, meta, n_vocab, tied, dtype, biases=()):
    arch = meta.get("general.architecture")
    if arch not in ARCHS:
        raise GGUFError(f"{path}: general.architecture is {arch!r}; supported: {', '.join(ARCHS)}")

    def req(key):
        if f"{arch}.{key}" not in meta:
            raise GGUFError(f"{path}: metadata {arch}.{key} is missing")
        return meta[f"{arch}.{key}"]

    def opt(key, default):
        return meta.get(f"{arch}.{key}", default)

    dim, heads = int(req("embedding_length")), int(req("attention.head_count"))
    kv = int(opt("attention.head_count_kv", heads))
    head_dim = int(opt("attention.key_length", dim // heads))
    if dim % heads and f"{arch}.attention.key_length" not in meta:
        raise GGUFError(f"{path}: embedding_length {dim} is not a multiple of head_count {heads}")
    if head_dim % 2 or heads % kv:
        raise GGUFError(f"{path}: head_dim {head_dim} must be even and head_count {heads} a "
                        f"multiple of head_count_kv {kv}")
    if arch in FAMILY_KEYS:
        unknown = sorted(k for k in meta if k.startswith(arch + ".") and k[len(arch) + 1:] not in
                         COMMON_KEYS | FAMILY_KEYS[arch])
        if unknown:
            raise GGUFError(f"{path}: metadata {unknown[0]} is not read back into a {arch} config: refused")
    if int(opt("attention.value_length", head_dim)) != head_dim:
        raise GGUFError(f"{path}: attention.value_length differs from key_length {head_dim}: not expressible")
    rot = int(opt("rope.dimension_count", head_dim))
    if rot != head_dim:
        raise GGUFError(f"{path}: partial RoPE (rope.dimension_count {rot} of head_dim "
                        f"{head_dim}) is not supported")
    scaling = opt("rope.scaling.type", "none")
    if scaling not in ("none", None) and not (arch == "gemma3" and scaling == "linear"):
        raise GGUFError(f"{path}: rope scaling {scaling!r} is not supported")
    if opt("vocab_size", n_vocab) != n_vocab:
        raise GGUFError(f"{path}: {arch}.vocab_size {opt('vocab_size', None)} but the "
                        f"embedding has {n_vocab} rows")
    config = {
        "architectures": [ARCHS[arch][1]],
        "model_type": ARCHS[arch][0],
        "hidden_size": dim,
        "intermediate_size": int(req("feed_forward_length")),
        "num_hidden_layers": int(req("block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "vocab_size": n_vocab,
        "rms_norm_eps": _f32(opt("attention.layer_norm_rms_epsilon", 1e-5)),
        "rope_theta": _f32(opt("rope.freq_base", 10000.0)),
        "max_position_embeddings": int(opt("context_length", 2048)),
        "tie_word_embeddings": bool(tied),
        "bos_token_id": int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        "eos_token_id": int(meta.get("tokenizer.ggml.eos_token_id", 2)),
        "hidden_act": "silu",
        "torch_dtype": "bfloat16" if dtype == "bf16" else "float32",
    }
    if head_dim != dim // heads or arch in ("qwen3",) + GEMMA:
        config["head_dim"] = head_dim
    _bias_config(path, arch, config, set(biases))
    if arch in FAMILY_KEYS:  # absent, these families' configs default to a pad row (Gemma 0, Phi-3 32000)
        pad = meta.get("tokenizer.ggml.padding_token_id")
        config["pad_token_id"] = int(pad) if pad is not None else None
    if arch in GEMMA:
        _gemma_config(path, arch, config, opt)
    if arch == "phi3":
        config["original_max_position_embeddings"] = int(opt("rope.scaling.original_context_length",
                                                             config["max_position_embeddings"]))
        # export_gguf.py writes a window as the context length; llama.cpp's converter writes the key (which its
        # phi3 does not apply): the Hugging Face model it came from had that window
        window = opt("attention.sliding_window", None)
        config["sliding_window"] = int(window) if window is not None else None
    return config


def _gemma_config(path, arch, config, opt):
    """Gemma 2 / 3 keys as scripts/export/export_gguf.py read them: the query scale llama.cpp applies (head_dim,
    or hidden/heads for the 27B's layer count), soft-caps, window, gemma3's pattern and RoPE of local layers."""
    config.pop("hidden_act")
    config["hidden_activation"] = "gelu_pytorch_tanh"  # llama.cpp's gemma2/3 GeGLU
    big = 62 if arch == "gemma3" else 46
    heads, layers = config["num_attention_heads"], config["num_hidden_layers"]
    if layers == big and config["hidden_size"] % heads:
        raise GGUFError(f"{path}: {arch} of {big} layers scales queries by hidden/heads, not an integer here")
    config["query_pre_attn_scalar"] = config["hidden_size"] // heads if layers == big else config["head_dim"]
    window = opt("attention.sliding_window", None)
    config["sliding_window"] = int(window) if window is not None else None  # null: no window (not 4096)
    final = opt("final_logit_softcapping", None)
    config["final_logit_softcapping"] = _f32(final) if final is not None else None
    if arch == "gemma2":
        cap = opt("attn_logit_softcapping", None)
        if cap is None or final is None:
            raise GGUFError(f"{path}: gemma2 without both soft-caps: llama.cpp's gemma2 always applies them")
        config["attn_logit_softcapping"] = _f32(cap)
        return
    config["attn_logit_softcapping"] = None
    if window is None:
        raise GGUFError(f"{path}: gemma3 without attention.sliding_window: its local layers' window is unknown")
    pattern = opt("attention.sliding_window_pattern", 6)  # llama.cpp's gemma3 default: every 6th layer global
    if isinstance(pattern, list):
        if len(pattern) != layers:
            raise GGUFError(f"{path}: gemma3 sliding_window_pattern of {len(pattern)} entries for {layers} layers")
        local = [bool(x) for x in pattern]
    else:
        local = [(l + 1) % int(pattern) != 0 for l in range(layers)]
    config["layer_types"] = ["sliding_attention" if x else "full_attention" for x in local]
    config["rope_local_base_freq"] = _f32(opt("rope.freq_base_swa", 10000.0))
    if opt("rope.scaling.type", "none") == "linear":
        config["rope_scaling"] = {"rope_type": "linear", "factor": _f32(opt("rope.scaling.factor", 1.0))}


def _bias_config(path, arch, config, biases):
    """attention_bias / mlp_bias from the bias tensors present (qwen2's q, k, v biases are implied)."""
    if biases and arch not in ("llama", "qwen2", "qwen3"):
        raise GGUFError(f"{path}: {arch} with biases ({sorted(biases)}) has no Hugging Face form here")
    attn, mlp = biases & {"attn_q", "attn_k", "attn_v", "attn_output"}, biases & {"ffn_gate", "ffn_up", "ffn_down"}
    if arch == "qwen2":
        if attn != {"attn_q", "attn_k", "attn_v"} or mlp:
            raise GGUFError(f"{path}: qwen2 needs biases on attn_q, attn_k and attn_v only (has {sorted(biases)})")
        return
    if attn and attn != {"attn_q", "attn_k", "attn_v", "attn_output"}:
        raise GGUFError(f"{path}: biases on {sorted(attn)}: Hugging Face's attention_bias puts them on q, k, v and o")
    if mlp and mlp != {"ffn_gate", "ffn_up", "ffn_down"}:
        raise GGUFError(f"{path}: biases on {sorted(mlp)}: Hugging Face's mlp_bias puts them on gate, up and down")
    if attn:
        config["attention_bias"] = True
    if mlp:
        config["mlp_bias"] = True


# ---------------------------------------------------------------------------------------------
# tensors

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
}


def bias_tensors(reader):
    """Names (attn_q, ffn_up, ...) of the block linears that carry a .bias tensor."""
    return {t.name.split(".")[2] for t in reader.tensors if t.name.startswith("blk.") and t.name.endswith(".bias")}


_GEMMA_LAYER_NAMES = {k: v for k, v in _LAYER_NAMES.items() if "norm" not in k} | {
    "attn_norm": "input_layernorm", "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm", "post_ffw_norm": "post_feedforward_layernorm"}
# per architecture: GGUF block tensor -> Hugging Face module (phi3's fused ones as Hugging Face fuses them)
LAYER_NAMES = {
    "llama": {k: v for k, v in _LAYER_NAMES.items() if k not in ("attn_q_norm", "attn_k_norm")},
    "qwen3": _LAYER_NAMES,
    "gemma2": _GEMMA_LAYER_NAMES,
    "gemma3": dict(_GEMMA_LAYER_NAMES, attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm"),
    "phi3": {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_qkv": "self_attn.qkv_proj",
             "attn_output": "self_attn.o_proj", "ffn_up": "mlp.gate_up_proj", "ffn_down": "mlp.down_proj"},
}
LAYER_NAMES["qwen2"] = LAYER_NAMES["llama"]
# phi3's LongRoPE factors, read into config.json's rope_scaling (phi3_rope_scaling), not into the weights
ROPE_FACTORS = ("rope_factors_long.weight", "rope_factors_short.weight")


def _hf_name(path, name, n_layers, arch):
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    if name in top:
        return top[name]
    parts, names = name.split("."), LAYER_NAMES[arch]
    if (len(parts) == 4 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in names
            and parts[3] in ("weight", "bias") and not (parts[2].endswith("norm") and parts[3] == "bias")):
        if int(parts[1]) >= n_layers:
            raise GGUFError(f"{path}: tensor {name} beyond block_count {n_layers}")
        return f"model.layers.{parts[1]}.{names[parts[2]]}.{parts[3]}"
    if name == "rope_freqs.weight":
        raise GGUFError(f"{path}: has rope_freqs.weight (Llama-3 RoPE scaling baked into "
                        "the file), which is not supported")
    raise GGUFError(f"{path}: unexpected tensor {name}")


def hf_tensors(path, reader, n_layers, heads, kv_heads, arch="llama"):
    """Dequantized Hugging Face tensors and a {type name: count} summary."""
    out, types = {}, {}
    for t in reader.tensors:
        name = t.name
        if arch == "phi3" and name in ROPE_FACTORS:
            continue
        parts, hf = name.split("."), _hf_name(path, name, n_layers, arch)
        w = tensor_array(t)
        types[TYPE_NAMES[int(t.tensor_type)]] = types.get(TYPE_NAMES[int(t.tensor_type)], 0) + 1
        if arch == "llama" and parts[-2:-1] in (["attn_q"], ["attn_k"]):  # biases too: [out] as [out, 1]
            w = interleaved_to_half(w.reshape(w.shape[0], -1), heads if parts[2] == "attn_q" else kv_heads)
            w = w.reshape(-1) if parts[3] == "bias" else w
        if arch in GEMMA and name.endswith("norm.weight"):  # the file holds 1 + w (llama.cpp scales by it)
            w = (w.astype(np.float64) - 1.0).astype(np.float32)
        out[hf] = np.ascontiguousarray(w, dtype=np.float32)
    if arch in GEMMA and "lm_head.weight" in out:
        raise GGUFError(f"{path}: {arch} with output.weight: Gemma's head is the embedding (tied), not expressible")
    if arch == "phi3" and np.array_equal(out.get("lm_head.weight"), out["model.embed_tokens.weight"]):
        del out["lm_head.weight"]  # export_gguf.py writes a tied phi3 head as output.weight too
    need = ["model.embed_tokens.weight", "model.norm.weight"] + [
        f"model.layers.{i}.{m}.weight" for i in range(n_layers) for m in LAYER_NAMES[arch].values()]
    missing = [k for k in need if k not in out]
    if missing:
        raise GGUFError(f"{path}: missing tensors for {missing[0]}"
                        + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return out, types


def phi3_rope_scaling(path, meta, config, names):
    """phi3's LongRoPE back: rope_factors_long / _short into rope_scaling, the attention factor checked against
    the one transformers derives (sqrt(1 + ln(s) / ln(original)), s = context / original)."""
    got = [n for n in ROPE_FACTORS if n in names]
    attn = meta.get("phi3.rope.scaling.attn_factor")
    if not got:
        if attn is not None and abs(float(attn) - 1.0) > 1e-6:
            raise GGUFError(f"{path}: phi3 rope.scaling.attn_factor {attn} without rope factors: not expressible")
        return
    if len(got) != 2:
        raise GGUFError(f"{path}: phi3 has {got[0]} alone (LongRoPE needs both rope_factors_long and _short)")
    long, short = (tensor_array(names[n]).reshape(-1) for n in ROPE_FACTORS)
    half = config.get("head_dim", config["hidden_size"] // config["num_attention_heads"]) // 2
    if long.shape != (half,) or short.shape != (half,):
        raise GGUFError(f"{path}: phi3 rope factors of {long.size}/{short.size} values, not head_dim/2 = {half}")
    orig, ctx = config["original_max_position_embeddings"], config["max_position_embeddings"]
    want = np.sqrt(1 + np.log(ctx / orig) / np.log(orig)) if ctx > orig else 1.0
    if attn is not None and abs(float(attn) - want) > 1e-6 * want:
        raise GGUFError(f"{path}: phi3 rope.scaling.attn_factor {attn} is not transformers' {want:.7g} for context "
                        f"{ctx} over original {orig}: not expressible")
    config["rope_scaling"] = {"type": "longrope", "short_factor": [_f32(x) for x in short],
                              "long_factor": [_f32(x) for x in long]}


# ---------------------------------------------------------------------------------------------
# tokenizer

def gpt2_byte_alphabet():
    """GPT-2's byte -> printable character map: bytes that are printable Latin-1 characters
    ('!'..'~', '\u00a1'..'\u00ac', '\u00ae'..'\u00ff') stand for themselves; the other 68
    bytes, in increasing order, take the characters from U+0100 on."""
    keep = set(range(0x21, 0x7F)) | set(range(0xA1, 0xAD)) | set(range(0xAE, 0x100))
    table, extra = {}, 0
    for b in range(256):
        if b in keep:
            table[b] = chr(b)
        else:
            table[b] = chr(0x100 + extra)
            extra += 1
    return table


def byte_level_tokenizer(path, tokens, types, merges):
    """GGUF gpt2 tokens/merges -> (pieces as raw bytes, scores, special token ids)."""
    char_to_byte = {c: b for b, c in gpt2_byte_alphabet().items()}
    rank = {}
    for r, m in enumerate(merges):
        a, sep, b = m.partition(" ")
        if not sep:
            raise GGUFError(f"{path}: merge {r} {m!r} is not two space-separated tokens")
        rank.setdefault(a + b, r)
    base = -float(len(merges) + 1)  # below every merge: single bytes are never merge results
    pieces, scores, special = [], [], []
    for i, tok in enumerate(tokens):
        ttype = types[i] if types else TOKEN_NORMAL
        if ttype in (TOKEN_CONTROL, TOKEN_USER_DEFINED) or any(c not in char_to_byte for c in tok):
            # matched literally in text, never produced by merges
            pieces.append(tok.encode("utf-8"))
            scores.append(base)
            special.append(i)
            continue
        pieces.append(bytes(char_to_byte[c] for c in tok))
        scores.append(-float(rank[tok]) if tok in rank else base)
    return pieces, scores, special


def sentencepiece_tokenizer(tokens, scores):
    """GGUF llama (sentencepiece) tokens -> llama2.c pieces: U+2581 back to a space."""
    pieces = [t.replace("\u2581", " ").encode("utf-8") for t in tokens]
    return pieces, [float(s) for s in (scores or [0.0] * len(tokens))]


# tokenizer.ggml.pre -> our pre-tokenizer: GPT-2's regex, and for these models (llama.cpp's list
# that splits on \p{N} first) with every digit alone
PRETOKENIZER = {"gpt-2": "gpt2", "smollm": "gpt2_digits", "starcoder": "gpt2_digits",
                "refact": "gpt2_digits", "codeshell": "gpt2_digits"}


def tokenizer_from_metadata(path, meta, n_vocab):
    """Return (pieces, scores, tokenizer_config dict) for tokenizer.bin + tokenizer_config.json."""
    model = meta.get("tokenizer.ggml.model")
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise GGUFError(f"{path}: no tokenizer.ggml.tokens in the metadata")
    if len(tokens) != n_vocab:
        raise GGUFError(f"{path}: {len(tokens)} tokens but the embedding has {n_vocab} rows")
    types = meta.get("tokenizer.ggml.token_type")
    bos = int(meta.get("tokenizer.ggml.bos_token_id", 1))
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    if model == "gpt2":
        pieces, scores, special = byte_level_tokenizer(path, tokens, types,
                                                       meta.get("tokenizer.ggml.merges") or [])
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
        pre = meta.get("tokenizer.ggml.pre", "gpt-2")
        block = {"type": "byte_level", "bos_id": bos, "eos_id": eos, "add_bos": add_bos,
                 "special_ids": special, "pretokenizer": PRETOKENIZER.get(pre, "none")}
        if pre not in PRETOKENIZER:
            print(f"note: {path}: pre-tokenizer {pre!r} is not reproduced; prompts are encoded "
                  "without a pre-split (an approximation, decoding is exact)")
    elif model == "llama":
        pieces, scores = sentencepiece_tokenizer(tokens, meta.get("tokenizer.ggml.scores"))
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
        block = {"type": "sentencepiece", "bos_id": bos, "eos_id": eos, "add_bos": add_bos}
    else:
        raise GGUFError(f"{path}: tokenizer.ggml.model {model!r} is not supported "
                        "(gpt2 byte-level BPE or llama sentencepiece)")
    config = {
        "bos_token": tokens[bos] if 0 <= bos < len(tokens) else None,
        "eos_token": tokens[eos] if 0 <= eos < len(tokens) else None,
        "add_bos_token": add_bos,
        "model_max_length": int(meta.get(f"{meta.get('general.architecture')}.context_length", 2048)),
    }
    if "tokenizer.chat_template" in meta:
        config["chat_template"] = meta["tokenizer.chat_template"]
    # read by llmc/text/tokenizer.h and scripts/formats/llama2c_tokenizer.py; other tools ignore it
    config["tokenizer_bin"] = block
    return pieces, scores, config


# ---------------------------------------------------------------------------------------------

def load_gguf(path, dtype="f32"):
    """Return (config.json dict, HF tensors, (pieces, scores, tokenizer_config dict), summary)."""
    gguf = import_gguf()
    try:
        reader = gguf.GGUFReader(path, "r")
    except OSError as e:
        raise GGUFError(f"{path}: cannot read ({e.strerror})") from None
    except Exception as e:  # the package raises ValueError/AssertionError etc. on bad files
        raise GGUFError(f"{path}: not a readable GGUF file ({type(e).__name__}: {e})") from None
    meta = read_metadata(reader)
    names = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in names:
        raise GGUFError(f"{path}: no token_embd.weight tensor")
    n_vocab = int(names["token_embd.weight"].shape[1])
    config = hf_config(path, meta, n_vocab, "output.weight" not in names, dtype, bias_tensors(reader))
    arch = meta["general.architecture"]
    if arch == "phi3":
        phi3_rope_scaling(path, meta, config, names)
    tensors, types = hf_tensors(path, reader, config["num_hidden_layers"],
                                config["num_attention_heads"], config["num_key_value_heads"], arch)
    if arch == "phi3" and "lm_head.weight" not in tensors:
        config["tie_word_embeddings"] = True
    tokenizer = tokenizer_from_metadata(path, meta, n_vocab)
    return config, tensors, tokenizer, types
