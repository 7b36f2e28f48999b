"""Helpers for the LLaMA model tests: small random Hugging Face-layout model directories, random
cases (tokens, loss mask, LoRA adapters), running build/test/llama_probe, and comparing its output with
the PyTorch reference (test/model/reference_llama.py).

Case contract (see test/model/reference_llama.py): "tokens" I32 [B, T+1], "mask" F32 [B, T],
"lora.{l}.{t}.A" F32 [r, in], "lora.{l}.{t}.B" F32 [out, r].
"""
import json
import os
import shlex
import shutil  # noqa: F401  (used by the tests through this module)
import subprocess
import sys

import numpy as np

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# the Python tools the tests exercise: file formats, data preparation, exporters
sys.path[:0] = [os.path.join(REPO, "scripts", d) for d in ("formats", "data", "export")]
import reference_llama as ref  # noqa: E402
import st_io  # noqa: E402
import probe_compare  # noqa: E402
from probe_compare import compare, rel_to_max  # noqa: E402,F401  (used by the tests through this module)

ALL_TARGETS = ref.LORA_TARGETS

# Small random configs. Odd sizes on purpose (hidden 100, vocab 67, T = 11).
CONFIGS = {
    # GQA (4 q heads share 2 kv heads), untied head
    "gqa_untied": dict(hidden_size=48, intermediate_size=100, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, vocab_size=67,
                       rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False),
    # MHA, tied head, defaults for eps / theta / kv heads left out of config.json
    "mha_tied": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                     num_attention_heads=2, vocab_size=50, tie_word_embeddings=True),
    # Llama-3.1 style: rope_theta 500000 + llama3 rope scaling, one kv head, explicit head_dim.
    # original_max_position_embeddings is tiny so that the scaled frequencies matter at T = 16.
    "llama3_rope": dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=1, head_dim=16,
                        vocab_size=80, rms_norm_eps=1e-5, rope_theta=500000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0,
                                      "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                      "original_max_position_embeddings": 64},
                        tie_word_embeddings=True),
    # Qwen2/2.5: biases on q, k, v (large ones, as real Qwen2.5 k biases are), GQA, untied
    "qwen2": dict(model_type="qwen2", hidden_size=48, intermediate_size=80, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=61, rms_norm_eps=1e-6,
                  rope_theta=1000000.0, tie_word_embeddings=False, use_sliding_window=False,
                  sliding_window=4096, max_window_layers=2),
    # Qwen3: q/k norms before RoPE, head_dim 16 with 4 heads on hidden 48 (64 != 48), tied
    "qwen3": dict(model_type="qwen3", hidden_size=48, intermediate_size=72, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=59,
                  rms_norm_eps=1e-6, rope_theta=1000000.0, tie_word_embeddings=True,
                  attention_bias=False),
    # Gemma 2: head_dim 16 apart from hidden / heads, GQA, tied (the family's default), sandwich
    # norms, soft-capped logits (a cap of 2 bites on these logits) and attention scores (a cap of 0.5
    # bites on these scores), query_pre_attn_scalar 24 (a scale other than head_dim^-0.5), a window of
    # 4 on the even layer (0), shorter than the case's sequence (9)
    "gemma2": dict(model_type="gemma2", hidden_size=48, intermediate_size=88, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=71,
                   rms_norm_eps=1e-6, rope_theta=10000.0, hidden_activation="gelu_pytorch_tanh",
                   query_pre_attn_scalar=24, final_logit_softcapping=2.0, attn_logit_softcapping=0.5,
                   sliding_window=4),
    # Gemma 3 text: Gemma 2's without soft-capping, q/k norms (1 + w), local layers 0 and 1 (RoPE base
    # 10000, a window of 5 shorter than the case's sequence, 12) and a global layer 2 (base 1e6, linear
    # scaling by 4)
    "gemma3": dict(model_type="gemma3_text", hidden_size=48, intermediate_size=72, num_hidden_layers=3,
                   num_attention_heads=4, num_key_value_heads=1, head_dim=16, vocab_size=67,
                   rms_norm_eps=1e-6, rope_theta=1000000.0, rope_local_base_freq=10000.0,
                   rope_scaling={"rope_type": "linear", "factor": 4.0}, sliding_window_pattern=3,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=16,
                   final_logit_softcapping=None, attn_logit_softcapping=None, sliding_window=5),
    # LLaMA with every bias: attention_bias (q, k, v, o) and mlp_bias (gate, up, down)
    "llama_bias": dict(hidden_size=32, intermediate_size=56, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=1, vocab_size=53,
                       attention_bias=True, mlp_bias=True, tie_word_embeddings=False),
}
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM"}
# batch, sequence length (T), LoRA rank, alpha per config
SHAPES = {"gqa_untied": (2, 11, 4, 8.0), "mha_tied": (3, 7, 2, 4.0), "llama3_rope": (2, 16, 4, 6.0),
          "qwen2": (2, 9, 4, 8.0), "qwen3": (2, 10, 4, 8.0), "llama_bias": (2, 8, 2, 4.0), "gemma2": (2, 9, 4, 8.0),
          "gemma3": (2, 12, 4, 8.0)}

# fp32 probe vs fp64 reference
TOL = {"logits": 1e-4, "loss": 1e-5, "grad": 1e-3}
# approx mode: a gate pre-activation closer than this to a ReSiLU2 breakpoint could get a different
# code in fp32 than in fp64; cases are re-drawn until none is (in both norm modes and under the
# paper's --ms-lora merged, whose pre-activations differ: the same LoRA A sees z there, gamma*z
# in std and in ms with the default --ms-lora exact). The fp32 vs fp64
# pre-activation error measured on these configs (reference run in float32) is <= 2e-5.
BREAKPOINT_MARGIN = 2e-4


def model_config(name):
    d = dict(CONFIGS[name])
    d.setdefault("model_type", "llama")
    d.update(architectures=[ARCHITECTURES[d["model_type"]]], torch_dtype="float32", max_position_embeddings=256)
    return d


def write_model(model_dir, config, seed=0):
    """Write config.json + model.safetensors (F32) for a random LLaMA of the given config dict.

    Weights ~ N(0, 0.1); norm gammas 1 + 0.3 N(0, 1) (so merging them matters); every 4th row of
    each gate_proj has std 1.0 so that gate pre-activations reach the outer ReSiLU2 breakpoints
    (+-6.3) as well as the middle one."""
    os.makedirs(model_dir, exist_ok=True)
    cfg = ref.LlamaConfig(config)
    rng = np.random.default_rng(seed)

    def normal(shape, std):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    off = 1.0 if cfg.gemma else 0.0  # Gemma stores w and scales by 1 + w: the same gammas 1 + 0.3 N(0, 1)

    def gamma():
        return (1.0 - off + 0.3 * rng.standard_normal(cfg.dim)).astype(np.float32)

    t = {"model.embed_tokens.weight": normal((cfg.vocab, cfg.dim), 0.2)}
    for l in range(cfg.n_layers):
        p = f"model.layers.{l}."
        for name, module in ref._MODULE_OF.items():
            i, o = cfg.in_out(name)
            w = normal((o, i), 0.1)
            if name == "gate":
                w[::4] *= 10.0
            t[p + module + ".weight"] = w
            if cfg.bias[name]:  # k's large, as in real Qwen2.5 checkpoints
                t[p + module + ".bias"] = normal((o,), 1.0 if name == "k" else 0.2)
        if cfg.qk_norm:  # per-head gammas, wide (and one zero) so that they matter
            for n in ("q_norm", "k_norm"):
                g = (1.0 + 0.5 * rng.standard_normal(cfg.head_dim)).astype(np.float32)
                g[3] = 0.0
                g -= off  # (Gemma 3 stores w)
                t[p + f"self_attn.{n}.weight"] = g
        t[p + "input_layernorm.weight"] = gamma()
        t[p + "post_attention_layernorm.weight"] = gamma()
        if cfg.gemma:  # the sandwich norms
            t[p + "pre_feedforward_layernorm.weight"] = gamma()
            t[p + "post_feedforward_layernorm.weight"] = gamma()
    t["model.norm.weight"] = gamma()
    if not cfg.tied:
        t["lm_head.weight"] = normal((cfg.vocab, cfg.dim), 0.1)
    st_io.save(os.path.join(model_dir, "model.safetensors"), t, metadata={"format": "pt"})
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=1)
    return cfg


def make_case(cfg, batch, seq, rank, targets=ALL_TARGETS, seed=0):
    """Random tokens [B, T+1], a mask with zeros (a "prompt" at the start of sequence 0 plus random
    holes), and random LoRA A and nonzero B for every layer and target."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, cfg.vocab, size=(batch, seq + 1)).astype(np.int32)
    tokens[0, -1] = cfg.vocab - 1  # the largest id appears
    mask = (rng.random((batch, seq)) > 0.25).astype(np.float32)
    mask[0, :3] = 0.0
    mask[-1, -1] = 1.0
    case = {"tokens": tokens, "mask": mask}
    for l in range(cfg.n_layers):
        for t in ref.parse_targets(targets):
            i, o = cfg.in_out(t)
            case[f"lora.{l}.{t}.A"] = (rng.standard_normal((rank, i)) / np.sqrt(i)).astype(np.float32)
            case[f"lora.{l}.{t}.B"] = (0.1 * rng.standard_normal((o, rank))).astype(np.float32)
    return case


def margin_ok(stats):
    """True when no gate pre-activation lies within BREAKPOINT_MARGIN of a breakpoint."""
    return stats["min_margin"] > BREAKPOINT_MARGIN


def make_safe_case(model, batch, seq, rank, alpha, targets=ALL_TARGETS, seed=0, tries=50, ms_model=None):
    """make_case, re-drawn (seed, seed+1000, ...) until no gate pre-activation is near a ReSiLU2
    breakpoint in either norm mode (and the paper's --ms-lora merged). ms_model: the model the MS
    runs use where it is not `model` (NF4 quantizes the weights after the MS merge, so its MS
    model's pre-activations are not the standard one's). Returns (case, seed used, {norm: stats})."""
    ms_model = ms_model or model
    for k in range(tries):
        s = seed + 1000 * k
        case = make_case(model.cfg, batch, seq, rank, targets, s)
        stats = {"std": ref.run_case(model, case, "exact", "std", rank, alpha, targets)["stats"],
                 "ms": ref.run_case(ms_model, case, "exact", "ms", rank, alpha, targets)["stats"]}
        stats["ms-merged"] = ref.run_case(ms_model, case, "exact", "ms", rank, alpha, targets,
                                          ms_lora="merged")["stats"]
        if all(margin_ok(st) for st in stats.values()):
            return case, s, stats
    raise RuntimeError("could not draw a case away from the ReSiLU2 breakpoints")


def probe_path():
    return os.environ.get("LLAMA_PROBE", os.path.join(REPO, "build", "test", "llama_probe"))


def run_probe(model_dir, case_path, out_path, act, norm, recompute, rank, alpha,
              targets=ALL_TARGETS, timeout=300, ms_lora="exact", extra=()):
    """Run build/test/llama_probe and return its OUT tensors. Extra flags: `extra`, or (e.g. a device)
    the environment variable LLAMA_PROBE_ARGS."""
    exe = probe_path()
    if not os.path.isfile(exe):
        raise AssertionError(f"{exe} is missing: build it with `make build/test/llama_probe`")
    cmd = [exe, "--model", str(model_dir), "--case", str(case_path), "--out-file", str(out_path),
           "--act", act, "--norm", norm, "--recompute", recompute, "--ms-lora", ms_lora,
           "--lora-rank", str(rank), "--lora-alpha", repr(float(alpha)),
           "--lora-targets", ",".join(ref.parse_targets(targets))] + [str(a) for a in extra]
    cmd += shlex.split(os.environ.get("LLAMA_PROBE_ARGS", ""))
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", "2")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if p.returncode != 0:
        raise AssertionError(f"probe failed (exit {p.returncode}): {' '.join(cmd)}\n"
                             f"stdout: {p.stdout[-2000:]}\nstderr: {p.stderr[-2000:]}")
    return st_io.load(str(out_path))


def check_errors(errs, label=""):
    """Print the worst errors on one line and assert them against TOL."""
    return probe_compare.check_errors(errs, TOL, label)


# --mlp-tile auto's candidate tiles, written apart from the trainer (llama_mlp_equal_tile)
def equal_tile(n, k):
    """n tokens in k equal tiles: ceil(n / k) rounded up to 64, or n where that reaches n."""
    return min(n, -(-(-(-n // k)) // 64) * 64)


AUTO_MIN = 1024  # auto's tiles are at least this many tokens (MLP_TILE_AUTO_MIN), or the whole sequence


def auto_candidates(n):
    """--mlp-tile auto's tiles for n tokens, written apart from the trainer (llama_mlp_equal_tile):
    k = 1, 2, ... equal tiles, down to k = n // AUTO_MIN (floor, so each tile holds at least
    AUTO_MIN tokens; one tile, the whole sequence, where n is shorter)."""
    return sorted({equal_tile(n, k) for k in range(1, max(1, n // AUTO_MIN) + 1)})


def auto_smallest_tile(n):
    """The smallest tile auto takes for n tokens: a length fits under auto exactly when it does."""
    return auto_candidates(n)[0]
