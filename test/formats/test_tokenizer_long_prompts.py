"""Long prompts and large special-token sets through llmc/text/tokenizer.h (the llama2.c tokenizer.bin
encoder, run through build/test/tokenizer_probe): the ids equal scripts/formats/llama2c_tokenizer.py's,
token for token. The C encoder once rescanned every pair after each merge (minutes for a 34 KB prompt)
and every special token at each byte; it now merges through a heap (llmc/text/bpe_merge.h) and matches
specials in a trie (llmc/text/literal_trie.h). These tests hold the ids unchanged; the timings are in
scripts/bench/bench_tokenizer.py, not asserted here."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(REPO, "scripts", "formats"))
from llama2c_tokenizer import Tokenizer, write_tokenizer_bin  # noqa: E402

PROBE = os.path.join(REPO, "build", "test", "tokenizer_probe")
WORDS = ("the quick brown fox jumps over lazy dog café naïve Straße Жили были 中文 😀 it's "
         "don't 1234 3.14 x=y+z; (a) [b] {c}\n\tindent").split(" ")


def c_encode(path, text):
    if not os.path.exists(PROBE):
        pytest.fail(f"{PROBE} is missing: build it with `make build/test/tokenizer_probe`")
    p = subprocess.run([PROBE, str(path), "encode", text], capture_output=True, timeout=120)
    assert p.returncode == 0, p.stderr.decode()
    return [int(x) for x in p.stdout.split()]


def long_texts(seed, n_words=6000):
    rng = np.random.default_rng(seed)
    words = [WORDS[k] for k in rng.integers(0, len(WORDS), n_words)]
    seps = [" ", "  ", "\n", "", " "]
    return ["".join(w + seps[k] for w, k in zip(words, rng.integers(0, len(seps), n_words))),
            "ab" * 20000, " " * 30000 + "the end"]


def pieces_of_words():
    """The words' characters and their parts of 2 to 5 characters (with a leading space too)."""
    pieces = {c for w in WORDS for c in w} | {" "}
    for w in WORDS + [" " + w for w in WORDS]:
        pieces |= {w[a:a + k] for a in range(len(w)) for k in range(2, 6) if a + k <= len(w)}
    return sorted(pieces)


def sentencepiece_bin(path, seed=0):
    """A llama2.c tokenizer.bin: <unk> <s> </s>, the 256 byte tokens, then pieces with scores."""
    rng = np.random.default_rng(seed)
    rest = pieces_of_words()
    pieces = [b"<unk>", b"<s>", b"</s>"] + [f"<0x{b:02X}>".encode() for b in range(256)] + [p.encode() for p in rest]
    scores = [0.0] * 259 + [float(np.float32(rng.normal())) for _ in rest]
    scores[-5:] = [scores[-6]] * 5  # ties: the leftmost pair merges first
    write_tokenizer_bin(str(path), pieces, scores)
    return path


def byte_level_bin(d, n_special, seed=1):
    """A byte-level tokenizer.bin (pieces raw bytes, scores minus a rank) with n_special specials,
    some prefixes of others, given by tokenizer_config.json's tokenizer_bin block."""
    rng = np.random.default_rng(seed)
    merged = [p.encode() for p in pieces_of_words() if len(p.encode()) > 1]
    rng.shuffle(merged)  # ranks
    specials = sorted({"<|" + "".join(rng.choice(list("abcde|<>"), int(rng.integers(0, 6)))) for _ in range(n_special)})
    pieces = [bytes([b]) for b in range(256)] + merged + [s.encode() for s in specials]
    scores = [0.0] * 256 + [-float(i) for i in range(len(merged))] + [0.0] * len(specials)
    write_tokenizer_bin(str(d / "tokenizer.bin"), pieces, scores)
    first = 256 + len(merged)
    block = {"type": "byte_level", "bos_id": first, "eos_id": first, "add_bos": False, "pretokenizer": "gpt2",
             "special_ids": list(range(first, len(pieces)))}
    (d / "tokenizer_config.json").write_text(json.dumps({"tokenizer_bin": block}))
    return d / "tokenizer.bin", specials


def test_sentencepiece_long_prompts_equal_the_reference(tmp_path):
    path = sentencepiece_bin(tmp_path / "tokenizer.bin")
    tok = Tokenizer(str(path))
    for text in long_texts(0):
        want = tok.encode(text)
        assert len(want) > 5000
        assert c_encode(path, text) == want, text[:60]


def test_byte_level_long_prompts_with_many_specials_equal_the_reference(tmp_path):
    path, specials = byte_level_bin(tmp_path, 3000)
    tok = Tokenizer(str(path))
    rng = np.random.default_rng(5)
    for text in long_texts(1, 3000):
        mixed = "".join(w + (specials[int(rng.integers(0, len(specials)))] if rng.random() < 0.1 else "")
                        for w in text.split(" "))
        assert c_encode(path, mixed) == tok.encode(mixed), mixed[:60]


def test_llama2c_tokenizer_on_a_long_prompt(shared):
    """llama2.c's own 32000-token tokenizer.bin on 20 KB of text (LLMC_SHARED_DIR, test/conftest.py)."""
    path = shared("models/tokenizer.bin")
    text = " ".join(long_texts(2, 4000)[:1])[:20000]
    assert c_encode(path, text) == Tokenizer(path).encode(text)
