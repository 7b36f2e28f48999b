"""scripts/export/export_llama.py: the exported Hugging Face layout computes the same model.

Run with /usr/bin/python3 -m pytest test/formats/test_export_llama.py (needs torch).
A llama2.c-style forward (interleaved RoPE) of the raw checkpoint and an
HF-style forward (rotate-half RoPE) of the exported weights must give the same
logits; that is what proves the q/k row permutation right.
"""
import json
import os
import struct
import subprocess
import sys

import numpy as np
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [os.path.join(ROOT, "scripts", d) for d in ("formats", "export")]

import export_llama  # noqa: E402
import st_io  # noqa: E402
from llama2c_tokenizer import Tokenizer  # noqa: E402

EPS = 1e-5


def rmsnorm(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def attention(q, k, v, n_heads, n_kv):
    """Causal attention, q: [T, H, hd], k/v: [T, KV, hd]; kv heads shared by index."""
    rep = n_heads // n_kv
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    T, _, hd = q.shape
    s = torch.einsum("thd,shd->hts", q, k) / hd ** 0.5
    s = s.masked_fill(torch.triu(torch.ones(T, T, dtype=torch.bool), 1), float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(-1), v).reshape(T, -1)


def rope_interleaved(x, pos):
    """llama2.c run.c: rotate pairs (2i, 2i+1) of each head by pos * theta^(-2i/hd)."""
    hd = x.shape[-1]
    freq = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=x.dtype) / hd)
    ang = pos[:, None, None] * freq
    a, b = x[..., 0::2], x[..., 1::2]
    out = torch.empty_like(x)
    out[..., 0::2] = a * ang.cos() - b * ang.sin()
    out[..., 1::2] = a * ang.sin() + b * ang.cos()
    return out


def rope_half(x, pos):
    """Hugging Face: rotate pairs (i, i + hd/2)."""
    hd = x.shape[-1]
    freq = 1.0 / 10000.0 ** (torch.arange(0, hd, 2, dtype=x.dtype) / hd)
    ang = torch.cat([freq, freq]) * pos[:, None, None]
    rotated = torch.cat([-x[..., hd // 2:], x[..., :hd // 2]], -1)
    return x * ang.cos() + rotated * ang.sin()


def forward_llama2c(cfg, w, tokens):
    """Forward of the raw llama2.c arrays (as named in export_llama.weight_shapes)."""
    t = lambda a: torch.from_numpy(np.array(a, dtype=np.float64))  # noqa: E731
    H, KV = cfg["n_heads"], cfg["n_kv_heads"]
    hd = cfg["dim"] // H
    T = len(tokens)
    pos = torch.arange(T, dtype=torch.float64)
    x = t(w["tok_embeddings"])[tokens]
    for i in range(cfg["n_layers"]):
        xb = rmsnorm(x, t(w["rms_att"][i]))
        q = rope_interleaved((xb @ t(w["wq"][i]).T).view(T, H, hd), pos)
        k = rope_interleaved((xb @ t(w["wk"][i]).T).view(T, KV, hd), pos)
        v = (xb @ t(w["wv"][i]).T).view(T, KV, hd)
        x = x + attention(q, k, v, H, KV) @ t(w["wo"][i]).T
        xb = rmsnorm(x, t(w["rms_ffn"][i]))
        h = torch.nn.functional.silu(xb @ t(w["w1"][i]).T) * (xb @ t(w["w3"][i]).T)
        x = x + h @ t(w["w2"][i]).T
    x = rmsnorm(x, t(w["rms_final"]))
    return x @ t(w.get("wcls", w["tok_embeddings"])).T


def forward_hf(config, tensors, tokens):
    """Forward of an exported model directory's tensors, Hugging Face conventions."""
    g = lambda name: torch.from_numpy(tensors[name].astype(np.float64))  # noqa: E731
    H, KV = config["num_attention_heads"], config["num_key_value_heads"]
    hd = config["hidden_size"] // H
    T = len(tokens)
    pos = torch.arange(T, dtype=torch.float64)
    x = g("model.embed_tokens.weight")[tokens]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        xb = rmsnorm(x, g(p + "input_layernorm.weight"))
        q = rope_half((xb @ g(p + "self_attn.q_proj.weight").T).view(T, H, hd), pos)
        k = rope_half((xb @ g(p + "self_attn.k_proj.weight").T).view(T, KV, hd), pos)
        v = (xb @ g(p + "self_attn.v_proj.weight").T).view(T, KV, hd)
        x = x + attention(q, k, v, H, KV) @ g(p + "self_attn.o_proj.weight").T
        xb = rmsnorm(x, g(p + "post_attention_layernorm.weight"))
        gate = torch.nn.functional.silu(xb @ g(p + "mlp.gate_proj.weight").T)
        x = x + (gate * (xb @ g(p + "mlp.up_proj.weight").T)) @ g(p + "mlp.down_proj.weight").T
    x = rmsnorm(x, g("model.norm.weight"))
    head = "model.embed_tokens.weight" if config["tie_word_embeddings"] else "lm_head.weight"
    return x @ g(head).T


def raw_llama2c(path):
    """Read the raw arrays of a llama2.c file with the exporter's own parser."""
    data = open(path, "rb").read()
    cfg, shared, offset, version = export_llama.parse_header(path, data)
    w = export_llama.read_weights(path, data, offset,
                                  export_llama.weight_shapes(cfg, shared, version))
    return cfg, shared, w


def run_export(tmp_path, ckpt, tok, *extra):
    out = str(tmp_path / "model")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "export", "export_llama.py"),
           "--llama2c", ckpt, "--tokenizer", tok, "--out", out, *extra]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return res, out


def load_dir(out):
    with open(os.path.join(out, "config.json")) as f:
        config = json.load(f)
    return config, st_io.load(os.path.join(out, "model.safetensors"))


def test_stories260k_exports_same_logits(tmp_path, stories260k):
    ckpt, tok = stories260k.ckpt, stories260k.tok
    res, out = run_export(tmp_path, ckpt, tok)
    assert res.returncode == 0, res.stderr
    config, tensors = load_dir(out)
    assert config["hidden_size"] == 64 and config["intermediate_size"] == 172
    assert config["num_hidden_layers"] == 5 and config["num_attention_heads"] == 8
    assert config["num_key_value_heads"] == 4 and config["vocab_size"] == 512
    assert config["tie_word_embeddings"] is True and "lm_head.weight" not in tensors
    assert len(tensors) == 2 + 9 * 5
    assert open(os.path.join(out, "tokenizer.bin"), "rb").read() == open(tok, "rb").read()

    cfg, _, w = raw_llama2c(ckpt)
    tokens = Tokenizer(tok).encode("Once upon a time, there was a little girl named Lily.")
    ref = forward_llama2c(cfg, w, tokens)
    got = forward_hf(config, tensors, tokens)
    assert (got - ref).abs().max().item() < 1e-9
    # the raw forward must itself be a sane model: a story model predicts its own text
    loss = torch.nn.functional.cross_entropy(ref[:-1], torch.tensor(tokens[1:]))
    assert loss.item() < 3.0, loss.item()
    # and the permutation matters: unpermuted q/k would not match
    tensors_bad = dict(tensors)
    for i in range(5):
        for m in ("q", "k"):
            name = f"model.layers.{i}.self_attn.{m}_proj.weight"
            tensors_bad[name] = np.asarray(w["w" + m][i])
    assert (forward_hf(config, tensors_bad, tokens) - ref).abs().max().item() > 1e-3


def write_v1(path, cfg, w, shared):
    """Write a llama2.c version-1 checkpoint from raw arrays."""
    header = struct.pack("<Ii7iB", export_llama.V1_MAGIC, 1,
                         *[cfg[k] for k in export_llama.CONFIG_FIELDS], int(shared))
    order = ["rms_att", "rms_ffn", "rms_final", "tok_embeddings",
             "wq", "wk", "wv", "wo", "w1", "w2", "w3"] + ([] if shared else ["wcls"])
    with open(path, "wb") as f:
        f.write(header.ljust(export_llama.V1_HEADER_BYTES, b"\0"))
        for name in order:
            f.write(np.asarray(w[name], dtype="<f4").tobytes())


def test_version1_and_untied_match_legacy(tmp_path, stories260k):
    ckpt, tok = stories260k.ckpt, stories260k.tok
    cfg, _, w = raw_llama2c(ckpt)
    res, out = run_export(tmp_path, ckpt, tok)
    assert res.returncode == 0, res.stderr
    _, ref = load_dir(out)

    v1 = str(tmp_path / "v1.bin")
    write_v1(v1, cfg, w, shared=True)
    res, out = run_export(tmp_path / "a", v1, tok)
    assert res.returncode == 0, res.stderr
    _, got = load_dir(out)
    assert got.keys() == ref.keys()
    assert all(np.array_equal(got[k], ref[k]) for k in ref)

    # legacy untied: negative vocab_size, classifier appended after the rope tables
    wcls = np.arange(512 * 64, dtype=np.float32).reshape(512, 64) / 1000
    data = bytearray(open(ckpt, "rb").read())
    struct.pack_into("<i", data, 20, -512)
    untied = tmp_path / "untied.bin"
    untied.write_bytes(bytes(data) + wcls.tobytes())
    res, out = run_export(tmp_path / "b", str(untied), tok)
    assert res.returncode == 0, res.stderr
    config, got = load_dir(out)
    assert config["tie_word_embeddings"] is False
    assert np.array_equal(got["lm_head.weight"], wcls)


def test_bf16_export_rounds_to_nearest(tmp_path, stories260k):
    ckpt, tok = stories260k.ckpt, stories260k.tok
    res, out = run_export(tmp_path, ckpt, tok, "--dtype", "bf16")
    assert res.returncode == 0, res.stderr
    header = st_io.read_header(os.path.join(out, "model.safetensors"))[0]
    assert {e["dtype"] for e in header.values()} == {"BF16"}
    _, f32 = load_dir(run_export(tmp_path / "f", ckpt, tok)[1])
    _, b16 = load_dir(out)
    for k in f32:
        err = np.abs(b16[k] - f32[k])
        assert np.all(err <= np.abs(f32[k]) * 2.0 ** -8), k


def test_bad_inputs_fail_with_one_line(tmp_path, stories260k, shared):
    ckpt, tok, big_tok = stories260k.ckpt, stories260k.tok, shared("models/tokenizer.bin")
    trunc = tmp_path / "trunc.bin"
    trunc.write_bytes(open(ckpt, "rb").read()[:100000])
    res, out = run_export(tmp_path, str(trunc), tok)
    assert res.returncode == 1 and "truncated" in res.stderr and str(trunc) in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1 and not os.path.exists(out)
    # a tokenizer of the wrong size
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "export", "export_llama.py"), "--llama2c", ckpt,
           "--tokenizer", big_tok, "--out", str(tmp_path / "m2")]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 1 and "32000" in res.stderr and big_tok in res.stderr



def test_the_output_directory_is_replaced_whole_or_left_alone(tmp_path, stories260k):
    """--out is staged beside OUT and renamed into place (scripts/formats/model_dir.py): a second
    export replaces OUT whole (a tokenizer.json left by an earlier export would otherwise sit beside
    the new tokenizer.bin), a full disk (RLIMIT_FSIZE) leaves no OUT, and an OUT holding files an
    export does not write is refused in one line, untouched (it used to be deleted whole)."""
    import resource
    import signal
    res, out = run_export(tmp_path, stories260k.ckpt, stories260k.tok)
    assert res.returncode == 0, res.stderr
    first = {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)}
    with open(os.path.join(out, "tokenizer.json"), "w") as f:
        f.write("{}")  # stale
    res, out = run_export(tmp_path, stories260k.ckpt, stories260k.tok)
    assert res.returncode == 0, res.stderr
    assert {n: open(os.path.join(out, n), "rb").read() for n in os.listdir(out)} == first
    assert sorted(os.listdir(tmp_path)) == ["model"]
    with open(os.path.join(out, "notes.txt"), "w") as f:
        f.write("mine")
    res, _ = run_export(tmp_path, stories260k.ckpt, stories260k.tok)
    err = res.stderr.strip()
    assert res.returncode == 1 and len(err.splitlines()) == 1 and "notes.txt" in err and out in err, err
    assert set(os.listdir(out)) == set(first) | {"notes.txt"} and sorted(os.listdir(tmp_path)) == ["model"]

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG
        resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))

    new = str(tmp_path / "new")
    cmd = [sys.executable, os.path.join(ROOT, "scripts", "export", "export_llama.py"),
           "--llama2c", stories260k.ckpt, "--tokenizer", stories260k.tok, "--out", new]
    res = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=small_files)
    err = res.stderr.strip()
    assert res.returncode == 1 and len(err.splitlines()) == 1 and "cannot write" in err, err
    assert sorted(os.listdir(tmp_path)) == ["model"]

def test_safetensors_round_trip_and_validation(tmp_path):
    x = {"a": np.array([[1.0, -2.5], [np.pi, 1e30]], np.float32),
         "b": np.arange(5, dtype=np.int32), "c": np.zeros((0, 3), np.float32)}
    path = str(tmp_path / "x.safetensors")
    st_io.save(path, x, metadata={"k": "v"})
    got, meta = st_io.load(path, with_metadata=True)
    assert meta == {"k": "v"} and all(np.array_equal(got[k], x[k]) for k in x)
    # bf16: ties go to even, values round to nearest
    v = np.array([1.0 + 2 ** -8, 1.0 + 3 * 2 ** -8, 1.0 + 2 ** -7 + 2 ** -9], np.float32)
    assert list(st_io.bf16_bits_to_f32(st_io.f32_to_bf16_bits(v))) == [1.0, 1.0 + 2 ** -6,
                                                                        1.0 + 2 ** -7]
    data = bytearray(open(path, "rb").read())
    (tmp_path / "cut.safetensors").write_bytes(bytes(data[:-4]))
    try:
        st_io.load(str(tmp_path / "cut.safetensors"))
        assert False, "truncated file accepted"
    except ValueError as e:
        assert "cut.safetensors" in str(e)


def test_tokenizer_matches_llama_sentencepiece(shared):
    big_tok = shared("models/tokenizer.bin")
    # known LLaMA ids for this sentence; the dummy prefix and merges must match llama2.c
    tok = Tokenizer(big_tok)
    ids = tok.encode("Once upon a time")
    assert ids == [1, 9038, 2501, 263, 931]
    text = "Héllo wörld 🙂, two  spaces\nnew line"
    assert tok.decode(tok.encode(text))[len("\n<s>\n"):] == text
