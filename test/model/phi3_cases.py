"""Phi-3 test models and cases (model_type phi3), shared by test/model/test_phi3_model.py,
test/cuda/test_phi3_cuda.py and test/system/test_phi3_system.py: small random checkpoints in Phi-3's
own layout (qkv_proj and gate_up_proj fused), their configs (Phi-3-mini's shape, Phi-3-128k's
LongRoPE, Phi-4-mini's partial rotary), and cases whose LoRA adapters are PEFT's, one per fused
module (A shared by its parts, B's rows split among them)."""
import json
import os

import numpy as np

import llama_cases as lc

ref = lc.ref

_rng = np.random.default_rng(5)
_PAIRS = 6  # rotated pairs of the LongRoPE configs: head_dim 12 (phi3_longrope), 16 * 0.75 (phi4_mini)
LONGROPE = {"type": "longrope", "long_factor": [float(x) for x in 1.0 + 7.0 * _rng.random(_PAIRS)],
            "short_factor": [float(x) for x in 1.0 + 0.5 * _rng.random(_PAIRS)]}
CONFIGS = {
    # Phi-3-mini's shape in small: GQA, untied head, a sliding window no shorter than the sequence
    "phi3": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=61, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=False, sliding_window=64, max_position_embeddings=256,
                 original_max_position_embeddings=256),
    # Phi-3-mini-4k's sliding window (2,047) in small: a window of 4 shorter than the sequence
    "phi3_window": dict(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=61, rms_norm_eps=1e-5, rope_theta=10000.0,
                        tie_word_embeddings=False, sliding_window=4, max_position_embeddings=256,
                        original_max_position_embeddings=256),
    # Phi-3-128k's LongRoPE: original context 8, so a sequence of 6 takes the short factors and one
    # of 12 the long ones; attention factor sqrt(1 + ln 8 / ln 8) from max_position_embeddings 64
    "phi3_longrope": dict(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=4, vocab_size=53, rms_norm_eps=1e-5, rope_theta=10000.0,
                          tie_word_embeddings=False, max_position_embeddings=64,
                          original_max_position_embeddings=8, rope_scaling=LONGROPE),
    # Phi-4-mini: partial_rotary_factor 0.75 (12 of 16 dims), LongRoPE, tied embeddings, GQA
    "phi4_mini": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=59, rms_norm_eps=1e-5, rope_theta=10000.0,
                      tie_word_embeddings=True, max_position_embeddings=64, original_max_position_embeddings=8,
                      rope_scaling=LONGROPE, partial_rotary_factor=0.75),
    # partial rotary over 16 of 32 dims: the CUDA backend's vectorised RoPE (rot a multiple of 16)
    "phi_partial_vec": dict(hidden_size=64, intermediate_size=80, num_hidden_layers=2, num_attention_heads=2,
                            num_key_value_heads=1, vocab_size=47, rms_norm_eps=1e-5, rope_theta=10000.0,
                            tie_word_embeddings=False, max_position_embeddings=64, partial_rotary_factor=0.5),
}
# (batch, sequence) per case; the LongRoPE configs at both lengths
CASES = [("phi3", 2, 10), ("phi3_longrope", 2, 6), ("phi3_longrope", 2, 12), ("phi4_mini", 2, 6),
         ("phi4_mini", 2, 12), ("phi_partial_vec", 2, 9), ("phi3_window", 2, 10)]
RANK, ALPHA = 4, 8.0
FUSED = {"qkv": ("q", "k", "v"), "gate_up": ("gate", "up"), "o": ("o",), "down": ("down",)}


def model_config(name):
    # Phi3Config's default pad_token_id (32000) lies beyond these vocabularies (a padding index only
    # shapes the embedding's gradient, which no test here takes)
    return dict(CONFIGS[name], model_type="phi3", architectures=["Phi3ForCausalLM"], torch_dtype="float32",
                pad_token_id=0, bos_token_id=1, eos_token_id=2)


def write_phi3_model(model_dir, config, seed=0):
    """config.json + model.safetensors (F32) of a random Phi-3 in its own layout: qkv_proj and
    gate_up_proj fused. Weights as llama_cases.write_model draws them (N(0, 0.1), every 4th gate
    row wide so the gate pre-activations reach the outer ReSiLU2 breakpoints, gammas 1 + 0.3 N)."""
    os.makedirs(model_dir, exist_ok=True)
    cfg = ref.LlamaConfig(config)
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    def gamma():
        return (1.0 + 0.3 * rng.standard_normal(cfg.dim)).astype(np.float32)

    t = {"model.embed_tokens.weight": normal((cfg.vocab, cfg.dim), 0.2)}
    for l in range(cfg.n_layers):
        p = f"model.layers.{l}."
        w = {n: normal(cfg.in_out(n)[::-1], 0.1) for n in ref.LORA_TARGETS}
        w["gate"][::4] *= 10.0
        t[p + "self_attn.qkv_proj.weight"] = np.concatenate([w["q"], w["k"], w["v"]])
        t[p + "self_attn.o_proj.weight"] = w["o"]
        t[p + "mlp.gate_up_proj.weight"] = np.concatenate([w["gate"], w["up"]])
        t[p + "mlp.down_proj.weight"] = w["down"]
        t[p + "input_layernorm.weight"] = gamma()
        t[p + "post_attention_layernorm.weight"] = gamma()
    t["model.norm.weight"] = gamma()
    if not cfg.tied:
        t["lm_head.weight"] = normal((cfg.vocab, cfg.dim), 0.1)
    lc.st_io.save(os.path.join(model_dir, "model.safetensors"), t, metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return cfg


def make_phi3_case(cfg, batch, seq, seed):
    """llama_cases.make_case with PEFT's fused adapters: one A per fused module, the same under
    every part's name, and B's rows per part."""
    case = lc.make_case(cfg, batch, seq, RANK, seed=seed)
    for parts in FUSED.values():
        for l in range(cfg.n_layers):
            for t in parts[1:]:
                case[f"lora.{l}.{t}.A"] = case[f"lora.{l}.{parts[0]}.A"]
    return case


