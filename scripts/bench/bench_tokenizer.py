"""Prompt-encoding and tokenizer-loading times of the C tokenizers (build/test/tokenizer_probe, make
build/test/tokenizer_probe): a long prompt through a llama2.c tokenizer.bin (llmc/text/tokenizer.h) and
through a SentencePiece-style tokenizer.json whose normalizer leaves it one word (llmc/text/hf_tokenizer.h),
and a tokenizer.json with many added tokens, loaded and used. One line per case: wall seconds of the
probe's whole run, and the token count. Needs the `tokenizers` package for the tokenizer.json cases.

usage: python3 scripts/bench/bench_tokenizer.py [--bin TOKENIZER.bin] [--kb 34] [--added 100000] [--probe PATH]
  --bin: a llama2.c tokenizer.bin (default: ../shared/models/tokenizer.bin, test/conftest.py's folder)
  --probe: another build of build/test/tokenizer_probe (an older commit's, to compare)"""
import argparse
import os
import random
import subprocess
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROBE = os.path.join(REPO, "build", "test", "tokenizer_probe")
WORDS = "the quick brown fox jumps over a lazy dog while it's raining 1234 times, café Straße".split()


def prompt(kb, seed=0):
    rng = random.Random(seed)
    text = ""
    while len(text.encode()) < kb * 1000:
        text += rng.choice(WORDS) + rng.choice([" ", " ", " ", "\n", ", "])
    return text


def timed(*args):
    t0 = time.perf_counter()
    p = subprocess.run([PROBE, *map(str, args)], capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"bench_tokenizer: {PROBE} failed: {p.stderr.strip()}")
    return time.perf_counter() - t0, len(p.stdout.split())


def sentencepiece_json(d):
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers, pre_tokenizers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="always", split=True)
    tok.train_from_iterator([prompt(50, 1)], trainers.BpeTrainer(vocab_size=400, show_progress=False))
    tok.pre_tokenizer = None  # Llama-2's normalizer alone: the whole prompt is one word
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    os.makedirs(d)
    tok.save(os.path.join(d, "tokenizer.json"))
    return d


def added_json(d, n):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    tok = Tokenizer(models.BPE(vocab={chr(c): c - 32 for c in range(32, 127)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    rng = random.Random(2)
    tok.add_special_tokens([f"<|{rng.choice(WORDS)}_{k}|>" for k in range(n)])
    os.makedirs(d)
    tok.save(os.path.join(d, "tokenizer.json"))
    return d


def main():
    global PROBE
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--bin", default=os.path.join(REPO, "..", "shared", "models", "tokenizer.bin"))
    ap.add_argument("--kb", type=int, default=34)
    ap.add_argument("--added", type=int, default=100000)
    ap.add_argument("--probe", default=PROBE)
    a = ap.parse_args()
    PROBE = a.probe
    text = prompt(a.kb)
    if os.path.isfile(a.bin):
        s, n = timed(a.bin, "encode", text)
        print(f"tokenizer.bin {a.bin}: {a.kb} KB prompt: {s:.2f} s, {n} tokens")
    with tempfile.TemporaryDirectory() as tmp:
        d = sentencepiece_json(os.path.join(tmp, "sp"))
        s, n = timed(d, "encode", text)
        print(f"tokenizer.json, SentencePiece style (one word): {a.kb} KB prompt: {s:.2f} s, {n} tokens")
        d = added_json(os.path.join(tmp, "added"), a.added)
        s, n = timed(d, "encode", "<|the_7|> hello")
        print(f"tokenizer.json with {a.added} added tokens: load and a short prompt: {s:.2f} s, {n} tokens")
        s, n = timed(d, "encode", text)
        print(f"tokenizer.json with {a.added} added tokens: load and a {a.kb} KB prompt: {s:.2f} s, {n} tokens")


if __name__ == "__main__":
    main()
