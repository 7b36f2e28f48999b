"""Issue 40's partial cases in the data preparation scripts, each a one-line refusal or the right
behaviour. scripts/data/prepare_text.py: a UTF-8 byte order mark (plain text and JSONL), a long
line (bounded, with advice), a long paragraph (cut at its line breaks), a record with both
"messages" and "prompt"/"response", and OpenAI's per-message "weight". scripts/data/prepare_images.py:
16-bit PNGs, a decompression bomb, an IDX header whose size overflows, a gzip bomb and a huge
--size, each one line naming the file or flag, no traceback, in bounded memory.

Run:  /usr/bin/python3 -m pytest -q test/formats/test_prepare_partial_cases.py
"""
import gzip
import json
import os
import resource
import struct
import subprocess
import sys
import zlib

import numpy as np
import pytest

import llama_cases as lc  # noqa: E402  (puts scripts/formats, data and export on sys.path)
import shards  # noqa: E402
from llama2c_tokenizer import Tokenizer  # noqa: E402
from test_prepare_text import pieces_by_mask, write_jsonl  # noqa: E402

sys.path.insert(0, os.path.join(lc.REPO, "scripts", "data"))
import prepare_images as pi  # noqa: E402
import prepare_text as pt  # noqa: E402

TOK = os.path.join(lc.REPO, "data", "llama_demo", "tokenizer.bin")
SCRIPTS = os.path.join(lc.REPO, "scripts", "data")
MEMORY_CAP = 2 << 30  # address space of each script run: a case that allocates without bound fails, not swaps


def limited():
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_CAP, MEMORY_CAP))


def run(script, *args):
    return subprocess.run([sys.executable, os.path.join(SCRIPTS, script)] + [str(a) for a in args],
                          capture_output=True, text=True, timeout=120, preexec_fn=limited)


def one_line_error(p, prefix, *needles):
    assert p.returncode == 1, f"expected failure, got {p.returncode}:\n{p.stdout}\n{p.stderr}"
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert err.startswith(prefix), err
    for n in needles:
        assert str(n) in err, f"{err!r} does not mention {n!r}"
    return err


def prepare(inp, out, *extra):
    return run("prepare_text.py", "--tokenizer", TOK, "--input", inp, "--out", out, "--val-frac", "0", *extra)


# ---- 6: a UTF-8 byte order mark --------------------------------------------------------------

def prepared_without_and_with_bom(tmp_path, body, suffix):
    """body saved as UTF-8 and as UTF-8 with a byte order mark, each prepared: the training shards
    (shards.read_shard's tuples), without the mark first."""
    for name, encoding in (("plain", "utf-8"), ("bom", "utf-8-sig")):
        (tmp_path / f"{name}{suffix}").write_text(body, encoding=encoding)
        p = prepare(tmp_path / f"{name}{suffix}", tmp_path / name)
        assert p.returncode == 0, p.stderr
    return tuple(shards.read_shard(str(tmp_path / f"{n}_train.bin")) for n in ("plain", "bom"))


def test_a_byte_order_mark_is_not_trained_on(tmp_path):
    text = "Once upon a time.\n\nThe end.\n"
    without, with_bom = prepared_without_and_with_bom(tmp_path, text, ".txt")
    want = Tokenizer(TOK).encode(text, bos=True)  # BOS + the text, no U+FEFF
    assert list(without[0]) == want
    assert list(with_bom[0]) == want


def test_a_jsonl_file_with_a_byte_order_mark_is_read(tmp_path):
    items = [{"prompt": "Hi", "response": "Hello."}, {"prompt": "Bye", "response": "Goodbye."}]
    body = "".join(json.dumps(x) + "\n" for x in items)
    a, b = prepared_without_and_with_bom(tmp_path, body, ".jsonl")
    assert all(np.array_equal(x, y) for x, y in zip(a, b))


# ---- 7: a long line ----------------------------------------------------------------------------

def test_a_line_too_long_to_tokenise_whole_is_refused_with_advice(tmp_path):
    """A line is tokenised whole, at ~170 bytes of memory per character: one over MAX_LINE_CHARS is
    refused in one line, naming the line and how to break it (the old advice, --chunk-chars, could
    not help: chunks are cut at line breaks). Run under a 2 GiB address-space cap."""
    words = "the cat sat on a mat "
    line = (words * (pt.MAX_LINE_CHARS // len(words) + 2))[:pt.MAX_LINE_CHARS + 1]
    (tmp_path / "long.txt").write_text("A first line.\n" + line + "\n")
    one_line_error(prepare(tmp_path / "long.txt", tmp_path / "o"), "prepare_text: ", "long.txt", "line 2",
                   pt.MAX_LINE_CHARS + 1, "fold -s")
    assert not os.path.exists(tmp_path / "o_train.bin")


def test_a_one_line_text_gets_advice_that_helps(tmp_path):
    (tmp_path / "one.txt").write_text("a single line of text " * 50)
    one_line_error(run("prepare_text.py", "--tokenizer", TOK, "--input", tmp_path / "one.txt", "--out",
                       tmp_path / "o", "--chunk-chars", "100"), "prepare_text: ", "one line", "--val-frac 0")


def test_a_long_paragraph_is_cut_at_its_line_breaks(tmp_path):
    """A paragraph longer than --chunk-chars was one chunk whatever its length (and a validation split
    of it impossible); it is now cut at line breaks into chunks of about --chunk-chars. Expected
    chunks: the lines, grouped greedily until a group reaches 300 characters, each BOS + its text."""
    lines = [f"line {i} of a paragraph that goes on without a blank line" for i in range(40)]
    (tmp_path / "para.txt").write_text("\n".join(lines))
    p = prepare(tmp_path / "para.txt", tmp_path / "o", "--chunk-chars", "300")
    assert p.returncode == 0, p.stderr
    groups, cur = [], []
    for line in lines:
        cur.append(line)
        if sum(len(x) + 1 for x in cur) >= 300:
            groups.append("\n".join(cur))
            cur = []
    groups += ["\n".join(cur)] if cur else []
    tok = Tokenizer(TOK)
    want = [t for g in groups for t in tok.encode(g, bos=True)]
    ids, _, _ = shards.read_shard(str(tmp_path / "o_train.bin"))
    assert len(groups) > 5 and list(ids) == want


# ---- 8: ambiguous JSONL keys, and OpenAI's weight --------------------------------------------

CHAT = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!", "weight": 0},
        {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]


@pytest.mark.parametrize("record,needles", [
    ({"messages": CHAT, "prompt": "x", "response": "y"}, ["'prompt'", "'response'", "messages"]),
    ({"messages": CHAT, "prompt": "x"}, ["'prompt'", "messages"]),
    ({"messages": [{"role": "user", "content": "Hi", "weight": 1}, {"role": "assistant", "content": "Yo"}]},
     ["message 1", "weight"]),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo", "weight": 0.5}]},
     ["message 2", "0.5"]),
], ids=["both", "messages-and-prompt", "weight-on-user", "weight-half"])
def test_ambiguous_records_are_refused_naming_the_line(tmp_path, record, needles):
    write_jsonl(tmp_path / "c.jsonl", [{"prompt": "ok", "response": "fine"}, record])
    one_line_error(prepare(tmp_path / "c.jsonl", tmp_path / "o", "--chat-template", "llama2"), "prepare_text: ",
                   "c.jsonl:2", *needles)


@pytest.mark.parametrize("template", ["llama2", "chatml"])
def test_weight_zero_is_not_trained_on(tmp_path, template):
    """OpenAI's fine-tuning format: an assistant message with "weight": 0 is context, not a target."""
    write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    p = prepare(tmp_path / "c.jsonl", tmp_path / "o", "--chat-template", template)
    assert p.returncode == 0, p.stderr
    ids, mask, _, starts = shards.read_shard(str(tmp_path / "o_train.bin"), with_starts=True)
    tok = Tokenizer(TOK)
    end = tok.decode([2]) if template == "llama2" else "<|im_end|>"
    lead = " "  # a llama2.c tokenizer's dummy prefix, on every piece encoded
    assert pieces_by_mask(tok, ids, mask, starts) == [f"{lead}Goodbye.{end}"]
    assert "Hello!" in tok.decode([int(t) for t in ids])  # still in the context
    # weight 1 is the default: the same as no weight
    write_jsonl(tmp_path / "d.jsonl", [{"messages": [dict(m, weight=1) if m["role"] == "assistant" else m
                                                     for m in CHAT]}])
    assert prepare(tmp_path / "d.jsonl", tmp_path / "d", "--chat-template", template).returncode == 0
    ids, mask, _, starts = shards.read_shard(str(tmp_path / "d_train.bin"), with_starts=True)
    assert pieces_by_mask(tok, ids, mask, starts) == [f"{lead}Hello!{end}{lead}Goodbye.{end}"]


# ---- 9: 16-bit PNGs ------------------------------------------------------------------------------

@pytest.mark.parametrize("channels", [1, 3])
def test_16_bit_png_is_scaled_not_clipped(tmp_path, channels):
    """PIL opens a 16-bit grayscale PNG as 32-bit integers, and convert() clipped every value over
    255 to white. Reduced by the high byte (as PIL reduces 16-bit RGB), v >> 8."""
    from PIL import Image
    rng = np.random.default_rng(0)
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    (tmp_path / "imgs" / "b").mkdir(parents=True)
    a16 = rng.integers(0, 65536, (5, 6), dtype=np.uint16)
    Image.fromarray(a16).save(tmp_path / "imgs" / "a" / "x.png")
    assert Image.open(tmp_path / "imgs" / "a" / "x.png").mode in ("I", "I;16")  # a 16-bit PNG as PIL sees it
    Image.fromarray(np.zeros((5, 6), np.uint8)).save(tmp_path / "imgs" / "b" / "y.png")
    p = run("prepare_images.py", "--folder", tmp_path / "imgs", "--channels", channels, "--out", tmp_path / "s.bin")
    assert p.returncode == 0, p.stderr
    images, labels, _ = pi.read_shard(str(tmp_path / "s.bin"))
    got = images[list(labels).index(0)]
    want = (a16 >> 8).astype(np.uint8)
    assert all(np.array_equal(got[..., c], want) for c in range(channels))


# ---- 10: hostile inputs to prepare_images.py --------------------------------------------------

def png(path, w, h, body=b""):
    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d))
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(body)) +
                     chunk(b"IEND", b""))


@pytest.mark.parametrize("side", [10000, 30000], ids=["over-max-pixels", "over-twice-max-pixels"])
def test_a_decompression_bomb_is_one_line(tmp_path, side):
    """A PNG whose header claims side x side pixels: over PIL's MAX_IMAGE_PIXELS PIL warns (a
    multi-line warning, then decodes), over twice it raises (a traceback)."""
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    png(tmp_path / "imgs" / "a" / "bomb.png", side, side)
    one_line_error(run("prepare_images.py", "--folder", tmp_path / "imgs", "--out", tmp_path / "s.bin"), "error: ",
                   "bomb.png", "decompression bomb")


def idx_dir(tmp_path, images_bytes, gz=True):
    d = tmp_path / "fm"
    d.mkdir()
    (d / "train-images-idx3-ubyte.gz").write_bytes(gzip.compress(images_bytes) if gz else images_bytes)
    labels = bytes([0, 0, 8, 1]) + struct.pack(">I", 2) + bytes([0, 1])
    (d / "train-labels-idx1-ubyte.gz").write_bytes(gzip.compress(labels))
    return d


def test_an_idx_header_whose_size_overflows_is_one_line(tmp_path):
    """Dimensions 2^31 x 2^31 x 4: numpy's int64 product wraps to 0, which matched a file of no
    data, and the reshape ended in a traceback. The exact count is checked against the file."""
    head = bytes([0, 0, 8, 3]) + struct.pack(">3I", 2**31, 2**31, 4)
    d = idx_dir(tmp_path, head)
    one_line_error(run("prepare_images.py", "--fashion-mnist", d, "--out", tmp_path / "s.bin"), "error: ",
                   "train-images-idx3-ubyte.gz", "need")


def test_a_gzip_bomb_is_refused_past_the_cap(tmp_path, monkeypatch, capsys):
    """A gzip'd IDX whose unpacked size passes MAX_DECOMPRESSED_BYTES is refused while unpacking,
    not held in memory (the cap lowered to 1 MiB here, the bomb 2 MiB of zeros; a consistent
    header, so only the cap refuses it)."""
    monkeypatch.setattr(pi, "MAX_DECOMPRESSED_BYTES", 1 << 20, raising=False)
    n = (2 << 20) // 784
    d = idx_dir(tmp_path, bytes([0, 0, 8, 3]) + struct.pack(">3I", n, 28, 28) + bytes(n * 784))
    assert pi.main(["--fashion-mnist", str(d), "--out", str(tmp_path / "s.bin")]) == 1
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "train-images-idx3-ubyte.gz" in err and str(1 << 20) in err, err


def test_a_huge_size_is_refused(tmp_path):
    """--size 100000 would hold every image at 100000 x 100000 x 3 bytes (30 GB each)."""
    from PIL import Image
    (tmp_path / "imgs" / "a").mkdir(parents=True)
    Image.fromarray(np.zeros((4, 4, 3), np.uint8)).save(tmp_path / "imgs" / "a" / "x.png")
    one_line_error(run("prepare_images.py", "--folder", tmp_path / "imgs", "--size", "100000", "--out",
                       tmp_path / "s.bin"), "error: ", "--size", "100000", pi.MAX_SIDE)


def test_weight_zero_through_the_models_own_template(tmp_path):
    """The same through a model's own chat_template (rendered by jinja2, spans found by rendering
    prefixes): the weight-0 reply is rendered but not a target, and the template never sees the key."""
    from test_gguf_export import export, need_gguf, write_tiny_gguf
    need_gguf()
    write_tiny_gguf(tmp_path / "tiny.gguf")
    res = export(tmp_path / "tiny.gguf", tmp_path / "model")
    assert res.returncode == 0, res.stderr
    tok_path = tmp_path / "model" / "tokenizer.bin"
    write_jsonl(tmp_path / "c.jsonl", [{"messages": CHAT}])
    p = run("prepare_text.py", "--tokenizer", tok_path, "--input", tmp_path / "c.jsonl", "--out", tmp_path / "o",
            "--val-frac", "0")
    assert p.returncode == 0, p.stderr
    ids, mask, _, starts = shards.read_shard(str(tmp_path / "o_train.bin"), with_starts=True)
    tok = Tokenizer(str(tok_path))
    assert pieces_by_mask(tok, ids, mask, starts) == ["Goodbye.<|im_end|>"]
    assert "<|im_start|>assistant\nHello!<|im_end|>" in tok.decode([int(t) for t in ids])
