"""Phi-3 / Phi-4 (model_type phi3, issue 36): build/test/llama_probe against transformers' own
Phi3ForCausalLM with PEFT's LoRA on the fused modules (test/model/phi3_hf_reference.py, float64,
in the venv of transformers 4.46: build/hfvenv, or HF_PYTHON), and against the independent
PyTorch reference (test/model/reference_llama.py) where 4.46 is not the reference: Phi-4-mini's
partial_rotary_factor (4.46 ignores the key; current transformers rotates the first factor*head_dim
dims, as the reference does) and the memory modes whose backward is the paper's (ReSiLU2). The
reference itself is checked against transformers on the configs 4.46 computes as current
transformers does (full rotary; LongRoPE at both lengths).

The checkpoints are random, written in Phi-3's layout (qkv_proj, gate_up_proj); the case's LoRA
adapters are PEFT's, one per fused module (A shared by its parts, B's rows split among them).
Tolerances: the probe is fp32 against fp64 (test/model/llama_cases.py's TOL, as for the other
families). The reference against transformers is fp64 against fp64 but for RoPE's tables, which
transformers computes in fp32 (inv_freq, the angles, cos and sin) and only then casts: each entry
off by up to a few 2^-24 relative, which the two blocks carry to ~1e-6 in the logits and ~3e-6 in
single gradients (measured; more with LongRoPE's larger scale); TOL_F64 allows 10x that, and a wiring error (a wrong row block, a
swapped gate and up, the other factor list) is O(1e-2) or more."""
import functools
import os
import subprocess

import numpy as np
import pytest

import llama_cases as lc

ref = lc.ref
HF_PYTHON = os.environ.get("HF_PYTHON", os.path.join(lc.REPO, "build", "hfvenv", "bin", "python"))
HF_SCRIPT = os.path.join(lc.REPO, "test", "model", "phi3_hf_reference.py")
TOL_F64 = {"logits": 1e-5, "loss": 1e-6, "grad": 5e-5}

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
}
# (batch, sequence) per case; the LongRoPE configs at both lengths
CASES = [("phi3", 2, 10), ("phi3_longrope", 2, 6), ("phi3_longrope", 2, 12), ("phi4_mini", 2, 6),
         ("phi4_mini", 2, 12)]
CASE_IDS = [f"{n}-T{t}" for n, _, t in CASES]
RANK, ALPHA = 4, 8.0
MODES = [("exact", "std", "none"), ("exact", "ms", "none"), ("approx", "ms", "none"), ("approx", "std", "none"),
         ("approx", "ms", "block"), ("exact", "std", "block")]
MODE_IDS = ["-".join(m) for m in MODES]
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
        import json
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


class Setup:
    def __init__(self, root, name, batch, seq):
        self.dir = os.path.join(root, name)
        if not os.path.exists(os.path.join(self.dir, "config.json")):
            write_phi3_model(self.dir, model_config(name), seed=1)
        self.model = ref.LlamaModel.load(self.dir)
        for k in range(50):  # away from the ReSiLU2 breakpoints in both norm modes (llama_cases.make_safe_case)
            self.case = make_phi3_case(self.model.cfg, batch, seq, 7 + 1000 * k)
            if all(lc.margin_ok(ref.run_case(self.model, self.case, "exact", n, RANK, ALPHA)["stats"])
                   for n in ("std", "ms")):
                break
        self.case_path = os.path.join(root, f"{name}.T{seq}.case.safetensors")
        lc.st_io.save(self.case_path, self.case)

    def probe(self, act, norm, recompute, extra=()):
        out = self.case_path + f".{act}.{norm}.{recompute}.out"
        return lc.run_probe(self.dir, self.case_path, out, act, norm, recompute, RANK, ALPHA, extra=extra)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("phi3_model"))


@functools.lru_cache(maxsize=None)
def _setup(root, name, batch, seq):
    return Setup(root, name, batch, seq)


@functools.lru_cache(maxsize=None)
def _transformers(root, name, batch, seq):
    """transformers + PEFT's logits, loss and adapter gradients on the case (float64)."""
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")
    s = _setup(root, name, batch, seq)
    out = s.case_path + ".transformers.out"
    p = subprocess.run([HF_PYTHON, HF_SCRIPT, "--model", s.dir, "--case", s.case_path, "--out", out, "--rank", str(RANK),
                        "--alpha", repr(ALPHA)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return lc.st_io.load(out)


HF_CASES = [c for c in CASES if c[0] != "phi4_mini"]  # 4.46 ignores partial_rotary_factor


@pytest.mark.parametrize("norm", ["std", "ms"])
@pytest.mark.parametrize("name,batch,seq", HF_CASES, ids=[f"{n}-T{t}" for n, _, t in HF_CASES])
def test_probe_matches_transformers(workdir, name, batch, seq, norm):
    """The trainer (fp32) against Phi3ForCausalLM + PEFT (fp64): logits, loss and every adapter
    gradient, under standard norms and MS norms (exact SiLU: both are transformers' function)."""
    want = _transformers(workdir, name, batch, seq)
    got = _setup(workdir, name, batch, seq).probe("exact", norm, "none")
    lc.check_errors(lc.compare(want, got), f"{name} T{seq} {norm} vs transformers")


@pytest.mark.parametrize("name,batch,seq", HF_CASES, ids=[f"{n}-T{t}" for n, _, t in HF_CASES])
def test_reference_matches_transformers(workdir, name, batch, seq):
    """The reference's Phi-3 (fused adapters, LongRoPE at both lengths) is transformers', in fp64."""
    want = _transformers(workdir, name, batch, seq)
    s = _setup(workdir, name, batch, seq)
    got = ref.run_case(s.model, s.case, "exact", "std", RANK, ALPHA)
    got.pop("stats")
    probe_compare_f64 = lc.compare(want, got)
    lc.probe_compare.check_errors(probe_compare_f64, TOL_F64, f"{name} T{seq} reference vs transformers")


@pytest.mark.parametrize("mode", MODES, ids=MODE_IDS)
@pytest.mark.parametrize("name,batch,seq", CASES, ids=CASE_IDS)
def test_probe_matches_reference(workdir, name, batch, seq, mode):
    """Every case (Phi-4-mini's partial rotary included) in the memory modes, against the reference."""
    act, norm, recompute = mode
    s = _setup(workdir, name, batch, seq)
    want = ref.run_case(s.model, s.case, act, norm, RANK, ALPHA)
    lc.check_errors(lc.compare(want, s.probe(act, norm, recompute)), f"{name} T{seq} {act} {norm} {recompute}")


def test_fused_targets_are_whole_modules(workdir):
    """An adapter on q alone would not be PEFT's (one adapter over qkv_proj): refused in one line."""
    s = _setup(workdir, "phi3", 2, 10)
    p = subprocess.run([lc.probe_path(), "--model", s.dir, "--case", s.case_path, "--out-file", s.case_path + ".bad",
                        "--lora-targets", "q,o"], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0 and "qkv_proj" in p.stderr and p.stderr.count("\n") == 1, p.stderr
    assert not os.path.exists(s.case_path + ".bad")
