"""Tokenise text into train/val token shards (format: scripts/shards.py).

    python3 scripts/prepare_text.py --tokenizer TOK --input FILE --out PREFIX
        [--val-frac 0.1] [--seed 0] [--chunk-chars 4096]

TOK: a llama2.c tokenizer.bin (also the byte-level one scripts/export_llama.py --gguf writes),
or a Hugging Face tokenizer.json (needs `pip install tokenizers`).
FILE: plain text, or .jsonl with one {"prompt": ..., "response": ...} per line.
Writes PREFIX_train.bin and PREFIX_val.bin.

Plain text is cut at paragraph boundaries into chunks of about --chunk-chars
characters, each BOS + tokens, every token a target except BOS (nothing in a chunk
predicts it); val is the last val-frac of chunks, so it is text the model did not
see. JSONL gives BOS + prompt (not trained on) + response + EOS (trained on); val is
a seeded random val-frac of the lines, since instruction lines are independent.
"""
import argparse
import json
import os
import random
import re
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import shards  # noqa: E402
from llama2c_tokenizer import Tokenizer as Llama2cTokenizer  # noqa: E402


class PrepError(Exception):
    """Bad input; reported as one line."""


class HFTokenizer:
    """Adapter giving a Hugging Face tokenizer.json the llama2.c Tokenizer interface."""

    BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>")
    EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")

    def __init__(self, path):
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise PrepError(f"{path}: reading a tokenizer.json needs the `tokenizers` package: "
                            "pip install tokenizers") from None
        self.tok = Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        names = self._special_names(path)
        self.bos_id = self._find(path, "bos", [names.get("bos_token")] + list(self.BOS_NAMES))
        self.eos_id = self._find(path, "eos", [names.get("eos_token")] + list(self.EOS_NAMES))

    @staticmethod
    def _special_names(path):
        """bos/eos token strings from a tokenizer_config.json beside the file, if any."""
        cfg_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        if not os.path.exists(cfg_path):
            return {}
        with open(cfg_path) as f:
            cfg = json.load(f)
        out = {}
        for key in ("bos_token", "eos_token"):
            v = cfg.get(key)
            out[key] = v.get("content") if isinstance(v, dict) else v
        return out

    def _find(self, path, what, names):
        for name in names:
            if name and self.tok.token_to_id(name) is not None:
                return self.tok.token_to_id(name)
        raise PrepError(f"{path}: no {what} token found (tried {[n for n in names if n]})")

    def encode(self, text, bos=True, eos=False):
        ids = self.tok.encode(text, add_special_tokens=False).ids
        return ([self.bos_id] if bos else []) + ids + ([self.eos_id] if eos else [])


def load_tokenizer(path):
    """llama2.c tokenizer.bin, or a Hugging Face tokenizer.json (told apart by its content)."""
    try:
        with open(path, "rb") as f:
            head = f.read(64).lstrip()
    except OSError as e:
        raise PrepError(f"{path}: cannot read tokenizer ({e.strerror})") from None
    if head.startswith(b"{"):
        return HFTokenizer(path)
    try:
        # bos/eos ids: 1/2, or the "tokenizer_bin" block of a tokenizer_config.json beside it
        return Llama2cTokenizer(path)
    except ValueError as e:
        raise PrepError(str(e)) from None


def split_paragraph_chunks(text, chunk_chars):
    """Join blank-line-separated paragraphs into chunks of at least chunk_chars (last may be short)."""
    chunks, cur = [], []
    size = 0
    # blank lines separate paragraphs; the next paragraph keeps its indentation
    for para in re.split(r"\n(?:[ \t\r\f\v]*\n)+", text):
        if not para.strip():
            continue
        cur.append(para)
        size += len(para) + 2
        if size >= chunk_chars:
            chunks.append("\n\n".join(cur))
            cur, size = [], 0
    if cur:
        chunks.append("\n\n".join(cur))
    return chunks


def encode_text_chunks(tok, chunks):
    """Each chunk -> (ids, mask): BOS + tokens, BOS not a target."""
    docs = []
    for chunk in chunks:
        ids = tok.encode(chunk, bos=True)
        docs.append((ids, [0] + [1] * (len(ids) - 1)))
    return docs


def encode_pair(tok, prompt, response):
    """BOS + prompt (mask 0) then response + EOS (mask 1): train on answers only."""
    p = tok.encode(prompt, bos=True)
    r = tok.encode(response, bos=False, eos=True)
    return p + r, [0] * len(p) + [1] * len(r)


def read_jsonl(path):
    """Yield (prompt, response) per non-empty line, with errors naming file and line."""
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise PrepError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if (not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str)
                    or not isinstance(obj.get("response"), str)):
                raise PrepError(f"{path}:{lineno}: expected {{\"prompt\": str, \"response\": str}}")
            yield obj["prompt"], obj["response"]


def n_val_items(n, val_frac):
    """How many of n items go to val: at least one when asked for and possible."""
    if val_frac <= 0 or n < 2:
        return 0
    return min(n - 1, max(1, round(n * val_frac)))


def concat(docs):
    """List of (ids, mask) -> two flat numpy arrays."""
    ids = np.array([t for d, _ in docs for t in d], dtype=np.int64)
    mask = np.array([m for _, ms in docs for m in ms], dtype=np.uint8)
    return ids, mask


def prepare_docs(tok, path, val_frac, seed, chunk_chars):
    """Return (train docs, val docs) for a text or JSONL file."""
    if path.endswith(".jsonl"):
        docs = [encode_pair(tok, p, r) for p, r in read_jsonl(path)]
        order = list(range(len(docs)))
        random.Random(seed).shuffle(order)
        val_idx = set(order[:n_val_items(len(docs), val_frac)])
        train = [d for i, d in enumerate(docs) if i not in val_idx]
        val = [d for i, d in enumerate(docs) if i in val_idx]
        return train, val
    with open(path, encoding="utf-8", errors="replace") as f:
        chunks = split_paragraph_chunks(f.read(), chunk_chars)
    docs = encode_text_chunks(tok, chunks)
    n_val = n_val_items(len(docs), val_frac)
    return docs[:len(docs) - n_val], docs[len(docs) - n_val:]


def write_split(prefix, train, val, vocab_size):
    """Write PREFIX_train.bin and PREFIX_val.bin; print what went where."""
    for name, docs in (("train", train), ("val", val)):
        ids, mask = concat(docs)
        path = f"{prefix}_{name}.bin"
        shards.write_shard(path, ids, mask, vocab_size)
        print(f"{path}: {len(docs)} docs, {ids.size} tokens, {int(mask.sum())} targets")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="llama2.c tokenizer.bin or HF tokenizer.json")
    ap.add_argument("--input", required=True, help="text file, or .jsonl of prompt/response")
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX_{train,val}.bin")
    ap.add_argument("--val-frac", type=float, default=0.1, help="fraction held out (default 0.1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the JSONL val split")
    ap.add_argument("--chunk-chars", type=int, default=4096,
                    help="target characters per plain-text chunk (default 4096)")
    args = ap.parse_args(argv)
    if not 0 <= args.val_frac < 1:
        ap.error(f"--val-frac must be in [0, 1), got {args.val_frac}")
    if args.chunk_chars < 1:
        ap.error("--chunk-chars must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        tok = load_tokenizer(args.tokenizer)
        if not os.path.isfile(args.input):
            raise PrepError(f"{args.input}: no such input file")
        train, val = prepare_docs(tok, args.input, args.val_frac, args.seed, args.chunk_chars)
        if not train:
            raise PrepError(f"{args.input}: no text to tokenise")
        write_split(args.out, train, val, tok.vocab_size)
    except (PrepError, ValueError, OSError) as e:
        print(f"prepare_text: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
