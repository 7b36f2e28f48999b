"""Write a model directory (Hugging Face layout, as train_llama reads and --export-merged writes) as one GGUF
file for llama.cpp, optionally with a PEFT LoRA adapter folded in.

    python3 scripts/export/export_gguf.py MODEL_DIR --outfile OUT.gguf --outtype f32|f16|bf16|q8_0|q4_k_m|q5_k_m|q6_k
                                          [--adapter ADAPTER_DIR] [--tokenizer DIR]

Families (model_type): llama and mistral (both as llama.cpp's "llama"), qwen2, qwen3, gemma2, gemma3_text (as
llama.cpp's "gemma3"), phi3. llama.cpp's "llama" applies
RoPE to adjacent pairs (2i, 2i+1), so the rows of attn_q / attn_k (weights and biases) are permuted within each
head as llama.cpp's converter does (scripts/formats/gguf_llama.py, half_to_interleaved); qwen2, qwen3, gemma2,
gemma3 and phi3 use NEOX RoPE, the Hugging Face order, and are written as they are. A tied head writes no output.weight
(llama.cpp reuses token_embd). Llama-3.1 RoPE scaling is written as the rope_freqs tensor of per-frequency
divisors; a sliding window is written by capping the context length at the window for llama, qwen2 and phi3
(which attend to every earlier position in llama.cpp) and as the sliding_window key for gemma2 (even layers).
gemma2: every RMSNorm weight is written plus one (Hugging Face's Gemma norm multiplies by 1 + w, llama.cpp's by
w), the two soft-capping keys, pre/post norms of attention and MLP. gemma3: as gemma2 (q/k norms plus one too)
without attention soft-capping (llama.cpp's gemma3 has none; the final cap when set), the local layers as the
per-layer sliding_window_pattern array (layer_types, else every sliding_window_pattern-th layer global), their
RoPE base as rope.freq_base_swa, linear rope_scaling (global layers) as rope.scaling.type/factor.
phi3: the fused qkv_proj and gate_up_proj as attn_qkv and ffn_up (llama.cpp splits them in the same order),
LongRoPE as the rope_factors_long/short tensors with the original context length and the attention factor
sqrt(1 + ln(s) / ln(original)).

Types: f32, f16, bf16 and q8_0 are written here with the gguf package; norms, biases and rope_freqs stay f32,
and a matrix whose rows are not a multiple of 32 values stays f16 under q8_0 (llama.cpp's converter falls
back the same way). q4_k_m, q5_k_m and q6_k are made by llama.cpp's own quantizer (llama-cpp-python's
llama_model_quantize) from an f32 file, and are refused without that package.

The tokenizer (scripts/formats/gguf_vocab.py) and the chat template are embedded. Anything that changes the
model's outputs and is not written exactly is refused with one line `error: ...`; nothing is written then.
"""
import argparse
import json
import math
import os
import sys
import tempfile

import numpy as np

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, "formats")]
import gguf_llama  # noqa: E402
import gguf_vocab  # noqa: E402
import st_io  # noqa: E402
from gguf_llama import half_to_interleaved  # noqa: E402

ARCH = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
        "gemma3_text": "gemma3", "phi3": "phi3"}
NOT_EXPORTED = {
    "gemma": "Gemma 1 is not a family train_llama loads",
    "gemma3": "a Gemma 3 multimodal config (text_config inside) is not exported: its text model's model_type is "
              "gemma3_text",
}
# llama.cpp's LLAMA_FTYPE_MOSTLY_* of the k-quants (include/llama.h)
KQUANT_FTYPE = {"q4_k_m": 15, "q5_k_m": 17, "q6_k": 18}
OUTTYPES = ("f32", "f16", "bf16", "q8_0") + tuple(KQUANT_FTYPE)
KQUANT_HINT = "pip install llama-cpp-python (scripts/ci/install_deps.sh installs it)"
# config.json keys read here or that leave the computation alone; any other key is refused
CONFIG_KEYS = {
    "model_type", "architectures", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
    "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "rope_theta",
    "rope_scaling", "tie_word_embeddings", "hidden_act", "attention_bias", "mlp_bias", "attention_dropout",
    "sliding_window", "use_sliding_window", "max_window_layers", "layer_types", "partial_rotary_factor",
    "bos_token_id", "eos_token_id", "pad_token_id", "torch_dtype", "dtype", "transformers_version", "use_cache",
    "initializer_range", "pretraining_tp", "_name_or_path", "quantization_config",
    "auto_map",  # remote-code class names (Phi-3's checkpoints carry them)
}
# keys of one family only (read there, or leaving its computation alone)
FAMILY_KEYS = {
    "gemma2": {"hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
               "cache_implementation"},
    "gemma3_text": {"hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping",
                    "cache_implementation", "rope_local_base_freq", "sliding_window_pattern",
                    "use_bidirectional_attention"},
    "phi3": {"original_max_position_embeddings", "resid_pdrop", "embd_pdrop"},
}
HF_LAYER = {
    "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down",
}
# per llama.cpp architecture: its layer tensors (gguf's tensor names for the arch)
LAYER_NAMES = {
    "llama": HF_LAYER, "qwen2": HF_LAYER, "qwen3": HF_LAYER,
    "gemma2": {k: v for k, v in HF_LAYER.items() if "_norm" not in k} | {
        "input_layernorm": "attn_norm", "post_attention_layernorm": "post_attention_norm",
        "pre_feedforward_layernorm": "ffn_norm", "post_feedforward_layernorm": "post_ffw_norm"},
    "phi3": {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
             "self_attn.qkv_proj": "attn_qkv", "self_attn.o_proj": "attn_output",
             "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"},
}
LAYER_NAMES["gemma3"] = dict(LAYER_NAMES["gemma2"], **{"self_attn.q_norm": "attn_q_norm",
                                                       "self_attn.k_norm": "attn_k_norm"})
GEMMA = ("gemma2", "gemma3")


class ExportError(Exception):
    """What cannot be written exactly; reported as one line."""


# ---------------------------------------------------------------------------------------------
# model directory and adapter

def load_tensors(model_dir):
    single = os.path.join(model_dir, "model.safetensors")
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.isfile(single):
        return st_io.load(single)
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
        out = {}
        for name in files:
            out.update(st_io.load(os.path.join(model_dir, name)))
        return out
    raise ExportError(f"{model_dir}: neither model.safetensors nor model.safetensors.index.json")


# adapter_config.json: keys whose value leaves the math alone, and keys that must hold their default
ADAPTER_NEUTRAL = {"peft_type", "task_type", "base_model_name_or_path", "revision", "inference_mode",
                   "auto_mapping", "target_modules", "lora_dropout", "peft_version", "runtime_config",
                   "r", "lora_alpha", "use_rslora", "init_lora_weights", "megatron_core", "qalora_group_size"}
ADAPTER_DEFAULT_ONLY = {"fan_in_fan_out", "use_dora", "layers_to_transform", "layers_pattern", "rank_pattern",
                        "alpha_pattern", "exclude_modules", "megatron_config", "loftq_config", "eva_config",
                        "corda_config", "layer_replication", "lora_bias", "trainable_token_indices", "use_qalora",
                        "target_parameters", "enable_lora", "merge_weights", "modules_to_save"}


def adapter_scale(path):
    with open(path) as f:
        ac = json.load(f)
    if ac.get("peft_type") != "LORA":
        raise ExportError(f"{path}: peft_type {ac.get('peft_type')!r}: only LORA is folded")
    for k, v in ac.items():
        if k in ADAPTER_DEFAULT_ONLY and v not in (None, False, {}, []):
            raise ExportError(f"{path}: {k} is set ({json.dumps(v)[:60]}), which is not implemented: refused")
        if k not in ADAPTER_NEUTRAL | ADAPTER_DEFAULT_ONLY | {"bias"}:
            raise ExportError(f"{path}: unknown key {k!r} (it may change what the adapter computes): refused")
    if ac.get("bias") not in (None, "none"):
        raise ExportError(f"{path}: bias {ac['bias']!r}: trained biases are not folded (only bias \"none\")")
    r, alpha = int(ac["r"]), float(ac["lora_alpha"])
    return alpha / math.sqrt(r) if ac.get("use_rslora") else alpha / r


def fold_adapter(tensors, adapter_dir):
    """W += s B A for every lora pair of adapter_model.safetensors (float64 sums, stored as float32)."""
    scale = adapter_scale(os.path.join(adapter_dir, "adapter_config.json"))
    path = os.path.join(adapter_dir, "adapter_model.safetensors")
    if not os.path.isfile(path):
        raise ExportError(f"{adapter_dir}: no adapter_model.safetensors")
    ad = st_io.load(path)
    prefix = "base_model.model."
    for name in sorted(ad):
        if not (name.startswith(prefix) and name.endswith((".lora_A.weight", ".lora_B.weight"))):
            raise ExportError(f"{path}: tensor {name} is not a LoRA pair (base_model.model.X.lora_A/B.weight)")
        if name.endswith(".lora_B.weight"):
            continue
        module = name[len(prefix):-len(".lora_A.weight")]
        a, b = ad[name], ad.get(f"{prefix}{module}.lora_B.weight")
        w = tensors.get(module + ".weight")
        if b is None or w is None:
            raise ExportError(f"{path}: {module}: " + ("no lora_B" if b is None else "no such module in the model"))
        if a.shape[0] != b.shape[1] or w.shape != (b.shape[0], a.shape[1]):
            raise ExportError(f"{path}: {module}: A {list(a.shape)} B {list(b.shape)} do not fit W {list(w.shape)}")
        merged = w.astype(np.float64) + scale * (b.astype(np.float64) @ a.astype(np.float64))
        tensors[module + ".weight"] = merged.astype(np.float32)
    return tensors


# ---------------------------------------------------------------------------------------------
# config -> llama.cpp hyperparameters

class Hparams:
    """What llama.cpp's {arch}.* keys say, from config.json, checked for what is written exactly."""

    def __init__(self, cfg, path):
        family = cfg.get("model_type", "llama")
        if family in NOT_EXPORTED:
            raise ExportError(f"{path}: model_type {family!r} is not exported: {NOT_EXPORTED[family]}")
        if family not in ARCH:
            raise ExportError(f"{path}: model_type {family!r} is not supported ({', '.join(ARCH)})")
        unknown = sorted(set(cfg) - CONFIG_KEYS - FAMILY_KEYS.get(family, set()))
        if unknown:
            raise ExportError(f"{path}: config key {unknown[0]!r} is not known to this exporter: refused")
        self.family, self.arch = family, ARCH[family]
        self.dim, self.ff = int(cfg["hidden_size"]), int(cfg["intermediate_size"])
        self.layers, self.heads = int(cfg["num_hidden_layers"]), int(cfg["num_attention_heads"])
        self.kv_heads = int(cfg.get("num_key_value_heads") or self.heads)
        self.head_dim = int(cfg.get("head_dim") or (256 if family.startswith("gemma") else self.dim // self.heads))
        self.eps = float(cfg.get("rms_norm_eps", 1e-6))
        self.theta = float(cfg.get("rope_theta", 10000.0))
        self.ctx = int(cfg.get("max_position_embeddings", 2048))
        # transformers' default when config.json leaves it out (save_pretrained omits the base class's True)
        self.tied = bool(cfg.get("tie_word_embeddings", family.startswith("gemma")))
        self.attention_bias, self.mlp_bias = bool(cfg.get("attention_bias")), bool(cfg.get("mlp_bias"))
        self.swa = self.softcaps = self.longrope = self.gemma3_rope = self.local_layers = None
        self.check(cfg, path)
        if self.arch in GEMMA:
            self.gemma2(cfg, path)
        self.rope_factors = None
        if self.arch == "gemma3":
            self.gemma3(cfg, path)
        elif self.arch == "phi3":
            self.longrope = self.phi3_longrope(cfg, path)
        else:
            self.rope_factors = self.llama3_factors(cfg.get("rope_scaling"), path)
        self.sliding_window(cfg, path)

    def check(self, cfg, path):
        gemma = self.arch in GEMMA
        act = cfg.get("hidden_activation", cfg.get("hidden_act")) if gemma else cfg.get("hidden_act")
        want = "gelu_pytorch_tanh" if gemma else "silu"  # llama.cpp's gemma2/3: tanh-approximate GELU
        if (act or want) != want:
            raise ExportError(f"{path}: hidden activation {act!r} is not written ({want} for {self.family})")
        if float(cfg.get("partial_rotary_factor", 1.0)) != 1.0 or float(cfg.get("attention_dropout") or 0) != 0:
            raise ExportError(f"{path}: partial_rotary_factor / attention_dropout are not written")
        if cfg.get("quantization_config"):
            raise ExportError(f"{path}: a quantized checkpoint (quantization_config) is not exported")
        if self.arch == "qwen2" and (self.mlp_bias or self.heads * self.head_dim != self.dim):
            raise ExportError(f"{path}: qwen2 with mlp_bias or heads*head_dim != hidden_size has no llama.cpp form")
        if self.arch == "qwen3" and (self.attention_bias or self.mlp_bias):
            raise ExportError(f"{path}: qwen3 with attention_bias/mlp_bias is not loaded by llama.cpp's qwen3")
        if self.arch in ("gemma2", "gemma3", "phi3") and (self.attention_bias or self.mlp_bias):
            raise ExportError(f"{path}: {self.arch} with attention_bias/mlp_bias has no llama.cpp form")

    def gemma2(self, cfg, path):
        """Gemma 2's soft-capping and query scale as llama.cpp's gemma2 has them (both caps always applied; q
        scaled by head_dim^-0.5, or by (hidden/heads)^-0.5 for the 46-layer 27B); Gemma 3's query scale as
        llama.cpp's gemma3 has it (the same, the 62-layer 27B taking hidden/heads)."""
        big = 62 if self.arch == "gemma3" else 46
        scalar = float(cfg.get("query_pre_attn_scalar", 256 if self.arch == "gemma3" else 224))
        llama_cpp = self.dim / self.heads if self.layers == big else self.head_dim
        if scalar != llama_cpp:
            raise ExportError(f"{path}: {self.arch} query_pre_attn_scalar {scalar:g}: llama.cpp's {self.arch} scales "
                              f"queries by {llama_cpp:g}^-0.5 for {self.layers} layers")
        if not self.tied:
            raise ExportError(f"{path}: {self.arch} with an untied head: llama.cpp's {self.arch} reads the embedding "
                              "as the head")
        if self.arch == "gemma3":
            return
        # transformers' defaults where config.json leaves a key out; an explicit null turns the cap off there
        caps = cfg.get("attn_logit_softcapping", 50.0), cfg.get("final_logit_softcapping", 30.0)
        if None in caps:
            raise ExportError(f"{path}: gemma2 without attn_logit_softcapping / final_logit_softcapping: llama.cpp's "
                              "gemma2 always soft-caps")
        self.softcaps = tuple(float(c) for c in caps)
        if cfg.get("rope_scaling"):
            raise ExportError(f"{path}: gemma2 with rope_scaling is not written")

    def gemma3(self, cfg, path):
        """Gemma 3 text (transformers' Gemma3TextConfig defaults where config.json leaves a key out): no attention
        soft-cap (llama.cpp's gemma3 applies none), the final cap when set, which layers are local (layer_types,
        else all but every sliding_window_pattern-th), the local RoPE base, linear scaling of the global RoPE."""
        if cfg.get("attn_logit_softcapping") is not None:
            raise ExportError(f"{path}: gemma3 with attn_logit_softcapping: llama.cpp's gemma3 does not soft-cap "
                              "attention scores")
        if cfg.get("use_bidirectional_attention"):
            raise ExportError(f"{path}: gemma3 with use_bidirectional_attention: llama.cpp's gemma3 is causal")
        final = cfg.get("final_logit_softcapping")
        self.softcaps = (None, float(final)) if final is not None else None
        if "rope_theta" not in cfg:
            self.theta = 1000000.0
        if cfg.get("sliding_window") is None:
            raise ExportError(f"{path}: gemma3 without sliding_window: its local layers' window is not written")
        self.swa = int(cfg["sliding_window"])
        types = cfg.get("layer_types")
        if types:
            if len(types) != self.layers or set(types) - {"sliding_attention", "full_attention"}:
                raise ExportError(f"{path}: layer_types: {self.layers} of sliding_attention/full_attention expected")
            self.local_layers = [t == "sliding_attention" for t in types]
        else:
            pattern = int(cfg.get("sliding_window_pattern", 6))
            self.local_layers = [(l + 1) % pattern != 0 for l in range(self.layers)]
        rs = cfg.get("rope_scaling")
        kind = (rs or {}).get("rope_type", (rs or {}).get("type"))
        if rs and (kind not in ("linear", "default") or set(rs) - {"rope_type", "type", "factor"}):
            raise ExportError(f"{path}: gemma3 rope_scaling {json.dumps(rs)[:80]}: only linear (factor) is written")
        factor = float(rs["factor"]) if rs and kind == "linear" else None
        self.gemma3_rope = {"local_base": float(cfg.get("rope_local_base_freq", 10000.0)), "linear": factor}

    def phi3_longrope(self, cfg, path):
        """Phi-3's LongRoPE (transformers 4.46: the short factors up to original_max_position_embeddings, the
        long ones past it, cos/sin times sqrt(1 + ln(s) / ln(original)), s = max / original): llama.cpp's
        rope_factors_short / _long (it picks by its context size) and rope.scaling.attn_factor."""
        rs = cfg.get("rope_scaling")
        if not rs:
            return None
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "longrope" or set(rs) - {"type", "rope_type", "short_factor", "long_factor"}:
            raise ExportError(f"{path}: phi3 rope_scaling {json.dumps(rs)[:80]}: only longrope with short_factor and "
                              "long_factor is written")
        short, long = (np.array(rs[k], np.float32) for k in ("short_factor", "long_factor"))
        if short.shape != (self.head_dim // 2,) or long.shape != short.shape:
            raise ExportError(f"{path}: phi3 longrope factors of {short.size}/{long.size} values, not head_dim/2 "
                              f"= {self.head_dim // 2}")
        orig = int(cfg["original_max_position_embeddings"])
        scale = self.ctx / orig
        attn = math.sqrt(1 + math.log(scale) / math.log(orig)) if scale > 1 else 1.0
        return {"short": short, "long": long, "orig": orig, "attn_factor": attn}

    def llama3_factors(self, rs, path):
        """Llama-3.1 RoPE scaling as llama.cpp reads it: rope_freqs, each frequency's divisor."""
        if not rs or rs.get("rope_type", rs.get("type")) == "default":
            return None
        kind = rs.get("rope_type", rs.get("type"))
        if kind != "llama3" or self.arch != "llama":
            raise ExportError(f"{path}: rope_scaling type {kind!r} is not written (llama3 on llama, or none)")
        factor, lo, hi = float(rs["factor"]), float(rs["low_freq_factor"]), float(rs["high_freq_factor"])
        old = float(rs["original_max_position_embeddings"])
        out = []
        for i in range(0, self.head_dim, 2):
            wavelen = 2 * math.pi * self.theta ** (i / self.head_dim)
            if wavelen < old / hi:
                out.append(1.0)
            elif wavelen > old / lo:
                out.append(factor)
            else:  # between: 1/divisor interpolates between 1/factor and 1
                smooth = (old / wavelen - lo) / (hi - lo)
                out.append(1.0 / ((1 - smooth) / factor + smooth))
        return np.array(out, np.float32)

    def sliding_window(self, cfg, path):
        if self.arch == "gemma2":  # llama.cpp's sliding_window key: gemma2's even layers, as transformers'
            self.swa = int(cfg["sliding_window"]) if cfg.get("sliding_window") is not None else None
            return
        if self.arch == "gemma3":  # gemma3(): the window with its per-layer pattern
            return
        # llama.cpp's phi3 reads no window (measured: it attends to every earlier position), like llama/qwen2
        active = self.family in ("mistral", "phi3") or bool(cfg.get("use_sliding_window"))
        active |= "sliding_attention" in (cfg.get("layer_types") or [])
        w = cfg.get("sliding_window")
        if active and w is not None and int(w) < self.ctx:
            print(f"note: {path}: sliding window {w}: context length written as {w} (llama.cpp's {self.arch} "
                  "attends to every earlier position; within the window that is the same)")
            self.ctx = int(w)

    def write(self, w):
        gguf = gguf_llama.import_gguf()
        w.add_context_length(self.ctx)
        w.add_embedding_length(self.dim)
        w.add_block_count(self.layers)
        w.add_feed_forward_length(self.ff)
        w.add_head_count(self.heads)
        w.add_head_count_kv(self.kv_heads)
        w.add_layer_norm_rms_eps(self.eps)
        w.add_rope_freq_base(self.theta)
        w.add_rope_dimension_count(self.head_dim)
        w.add_key_length(self.head_dim)
        w.add_value_length(self.head_dim)
        if self.swa is not None:
            w.add_sliding_window(self.swa)
        if self.softcaps and self.softcaps[0] is not None:
            w.add_attn_logit_softcapping(self.softcaps[0])
        if self.softcaps:
            w.add_final_logit_softcapping(self.softcaps[1])
        if self.local_layers is not None:  # llama.cpp's default for gemma3 is every 6th layer global
            w.add_sliding_window_pattern(self.local_layers)
        if self.gemma3_rope:
            w.add_rope_freq_base_swa(self.gemma3_rope["local_base"])
            if self.gemma3_rope["linear"] is not None:
                w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
                w.add_rope_scaling_factor(self.gemma3_rope["linear"])
        if self.longrope:
            w.add_rope_scaling_orig_ctx_len(self.longrope["orig"])
            w.add_rope_scaling_attn_factors(self.longrope["attn_factor"])


# ---------------------------------------------------------------------------------------------
# tensors

def gguf_name(hf, hp):
    """llama.cpp's name of a Hugging Face tensor, or ExportError."""
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    parts = hf.split(".")
    if len(parts) >= 5 and parts[:2] == ["model", "layers"] and parts[2].isdigit() and int(parts[2]) < hp.layers:
        module, kind, names = ".".join(parts[3:-1]), parts[-1], LAYER_NAMES[hp.arch]
        if module in names and kind in ("weight", "bias"):
            return f"blk.{parts[2]}.{names[module]}.{kind}"
    raise ExportError(f"tensor {hf} has no llama.cpp {hp.arch} name")


def gguf_tensors(tensors, hp):
    """[(gguf name, float32 array)] in llama.cpp's row order."""
    out = []
    if hp.arch == "phi3" and hp.tied:  # written as output.weight too, which llama.cpp's phi3 reads
        tensors = dict(tensors, **{"lm_head.weight": tensors["model.embed_tokens.weight"]})
    elif hp.tied and "lm_head.weight" in tensors:
        if not np.array_equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]):
            raise ExportError("tie_word_embeddings is true but lm_head.weight differs from the embedding")
        tensors = {k: v for k, v in tensors.items() if k != "lm_head.weight"}
    elif not hp.tied and "lm_head.weight" not in tensors:
        raise ExportError("tie_word_embeddings is false but there is no lm_head.weight")
    for hf in sorted(tensors, key=_order):
        name, arr = gguf_name(hf, hp), np.asarray(tensors[hf], np.float32)
        if hp.arch == "llama" and ".attn_q." in name:
            arr = permute_rows(arr, hp.heads)
        elif hp.arch == "llama" and ".attn_k." in name:
            arr = permute_rows(arr, hp.kv_heads)
        elif hp.arch in GEMMA and name.endswith("norm.weight"):
            arr = (arr.astype(np.float64) + 1.0).astype(np.float32)  # Gemma's norms (q/k too): x * (1 + w)
        check_shape(name, arr, hp)
        out.append((name, np.ascontiguousarray(arr)))
    if hp.rope_factors is not None:
        out.append(("rope_freqs.weight", hp.rope_factors))
    if hp.longrope:
        out += [("rope_factors_long.weight", hp.longrope["long"]), ("rope_factors_short.weight", hp.longrope["short"])]
    return out


def check_shape(name, arr, hp):
    """phi3's fused matrices: rows q, k, v and gate, up (llama.cpp splits them at these sizes)."""
    rows = {".attn_qkv.": (hp.heads + 2 * hp.kv_heads) * hp.head_dim, ".ffn_up.": 2 * hp.ff}
    for part, n in rows.items():
        if hp.arch == "phi3" and part in name and arr.shape[0] != n:
            raise ExportError(f"tensor {name}: {arr.shape[0]} rows, phi3 needs {n}")


def _order(hf):
    parts = hf.split(".")
    layer = int(parts[2]) if len(parts) > 3 and parts[1] == "layers" and parts[2].isdigit() else -1
    return (hf != "model.embed_tokens.weight", layer, hf)


def permute_rows(arr, heads):
    """Weights [out, in] or biases [out]: rotate-half pairs to llama.cpp's interleaved pairs per head."""
    if arr.ndim == 1:
        return half_to_interleaved(arr[:, None], heads)[:, 0]
    return half_to_interleaved(arr, heads)


def tensor_type(gguf, name, arr, outtype):
    """(data, raw ggml type or None) as llama.cpp's converter stores it for outtype."""
    qt = gguf.GGMLQuantizationType
    if arr.ndim == 1 or outtype == "f32":
        return arr.astype(np.float32), None
    if outtype == "f16" or (outtype == "q8_0" and arr.shape[-1] % 32):
        return arr.astype(np.float16), None
    if outtype == "bf16":
        return gguf.quants.quantize(arr, qt.BF16), qt.BF16
    return gguf.quants.quantize(arr, qt.Q8_0), qt.Q8_0


# ---------------------------------------------------------------------------------------------

FILE_TYPE = {"f32": 0, "f16": 1, "q8_0": 7, "bf16": 32}


def write_gguf(path, hp, named, vocab, outtype, name):
    gguf = gguf_llama.import_gguf()
    w = gguf.GGUFWriter(path, hp.arch)
    w.add_name(name)
    w.add_file_type(FILE_TYPE[outtype])
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)
    hp.write(w)
    w.add_vocab_size(len(vocab.tokens))
    gguf_vocab.add_to_writer(w, vocab)
    for tname, arr in named:
        data, raw = tensor_type(gguf, tname, arr, outtype)
        w.add_tensor(tname, data, raw_dtype=raw)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def kquantize(src, dst, outtype):
    try:
        import llama_cpp
    except ImportError:  # main() refuses before any work; this guards a direct call
        raise ExportError(f"--outtype {outtype} needs llama.cpp's quantizer: {KQUANT_HINT}") from None
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = KQUANT_FTYPE[outtype]
    rc = llama_cpp.llama_model_quantize(src.encode(), dst.encode(), params)
    if rc != 0:
        raise ExportError(f"llama_model_quantize {outtype} failed (return code {rc})")


# llama.cpp changes a vocabulary's token attributes by general.name (src/llama-vocab.cpp of llama.cpp: a name
# holding "phi3" or "phi-3" gets Phi-3's whitespace stripping around special tokens, and needs <|endoftext|>);
# what is written here is tokenizer.json's own behaviour, so such a name is not written as it is
NAME_KEYED = ("phi3", "phi-3")


def model_name(model_dir):
    name = os.path.basename(os.path.normpath(model_dir))
    if any(k in name.lower() for k in NAME_KEYED):
        safe = name.lower()
        for k in NAME_KEYED:
            safe = safe.replace(k, "phi_3")
        print(f"note: general.name written as {safe!r}, not {name!r}: llama.cpp changes the tokenizer of a model "
              "so named")
        return safe
    return name


def export(args):
    cfg_path = os.path.join(args.model_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ExportError(f"{args.model_dir}: no config.json (expected a Hugging Face model directory)")
    with open(cfg_path) as f:
        cfg = json.load(f)
    hp = Hparams(cfg, cfg_path)
    tensors = load_tensors(args.model_dir)
    if args.adapter:
        tensors = fold_adapter(tensors, args.adapter)
    named = gguf_tensors(tensors, hp)
    n_vocab = tensors["model.embed_tokens.weight"].shape[0]
    vocab = gguf_vocab.read_vocab(args.tokenizer or args.model_dir, n_vocab, cfg)
    name = model_name(args.model_dir)
    out_dir = os.path.dirname(os.path.abspath(args.outfile))
    # written beside OUT and renamed into place: a failure leaves no partial OUT
    fd, tmp = tempfile.mkstemp(suffix=".gguf.tmp", dir=out_dir)
    os.close(fd)
    try:
        if args.outtype in KQUANT_FTYPE:
            fd, f32 = tempfile.mkstemp(suffix=".f32.gguf.tmp", dir=out_dir)
            os.close(fd)
            try:
                write_gguf(f32, hp, named, vocab, "f32", name)
                kquantize(f32, tmp, args.outtype)
            finally:
                os.unlink(f32)
        else:
            write_gguf(tmp, hp, named, vocab, args.outtype, name)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp's file is private; the output gets the usual mode
        os.replace(tmp, args.outfile)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    print(f"wrote {args.outfile}: {hp.arch} ({hp.family}), {args.outtype}, {len(named)} tensors, "
          f"{len(vocab.tokens)} tokens ({vocab.model}{', pre ' + vocab.pre if vocab.pre else ''}"
          f"{f', {vocab.filler} filler' if vocab.filler else ''})")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model_dir", help="model directory: config.json, model.safetensors, tokenizer files")
    ap.add_argument("--outfile", required=True, help="the .gguf file to write")
    ap.add_argument("--outtype", default="f16", choices=OUTTYPES, help="tensor type of the matrices (default f16)")
    ap.add_argument("--adapter", help="a PEFT LoRA adapter directory to fold in (adapter_config.json, "
                                      "adapter_model.safetensors)")
    ap.add_argument("--tokenizer", help="directory of tokenizer.json / tokenizer_config.json (default: MODEL_DIR)")
    return ap.parse_args(argv)


def main(argv=None):
    args = parse_args(argv)
    try:
        if args.outtype in KQUANT_FTYPE:  # refused before any work
            try:
                import llama_cpp  # noqa: F401
            except ImportError:
                raise ExportError(f"--outtype {args.outtype} needs llama.cpp's quantizer: {KQUANT_HINT}") from None
        export(args)
    except (ExportError, gguf_vocab.VocabError, gguf_llama.GGUFError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except (OSError, KeyError, ValueError) as e:
        print(f"error: {args.model_dir}: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
