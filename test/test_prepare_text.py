"""scripts/data/prepare_text.py on instruction data: chat templates (ChatML, LLaMA-2), loss on the
assistant replies only, examples packed with their starts marked, and train_llama training on
the result with attention kept inside each example."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import llama_cases as lc  # noqa: E402  (puts scripts/formats, data and export on sys.path)
import shards  # noqa: E402
from llama2c_tokenizer import Tokenizer  # noqa: E402
from test_gguf_export import export, need_gguf, write_tiny_gguf  # noqa: E402

PREP = os.path.join(lc.REPO, "scripts", "data", "prepare_text.py")
CONVERSATIONS = [
    {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the GPL?"},
                  {"role": "assistant", "content": "A copyleft license."}]},
    {"prompt": "Name a permissive license.", "response": "MIT."},
    {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"},
                  {"role": "user", "content": "Bye"}, {"role": "assistant", "content": "Goodbye."}]},
]
REPLIES = ["A copyleft license.", "MIT.", "Hello!", "Goodbye."]


def prepare(tok, jsonl, out, *extra):
    p = subprocess.run([sys.executable, PREP, "--tokenizer", str(tok), "--input", str(jsonl), "--out", str(out),
                        "--val-frac", "0", *extra], capture_output=True, text=True, timeout=120)
    return p


def write_jsonl(path, items):
    path.write_text("".join(json.dumps(x) + "\n" for x in items))


def pieces_by_mask(tok, ids, mask, starts):
    """Decoded trained spans, per example."""
    out = []
    bounds = list(np.flatnonzero(starts)) + [len(ids)]
    for a, b in zip(bounds[:-1], bounds[1:]):
        out.append(tok.decode([int(t) for t, m in zip(ids[a:b], mask[a:b]) if m]))
    return out


def test_chatml_template_trains_on_replies_only(tmp_path):
    need_gguf()
    write_tiny_gguf(tmp_path / "tiny.gguf")
    res = export(tmp_path / "tiny.gguf", tmp_path / "model")
    assert res.returncode == 0, res.stderr
    jsonl = tmp_path / "chat.jsonl"
    write_jsonl(jsonl, CONVERSATIONS)
    p = prepare(tmp_path / "model" / "tokenizer.bin", jsonl, tmp_path / "chat")  # template from tokenizer_config.json
    assert p.returncode == 0, p.stderr
    ids, mask, _, starts = shards.read_shard(str(tmp_path / "chat_train.bin"), with_starts=True)
    tok = Tokenizer(str(tmp_path / "model" / "tokenizer.bin"))
    text = tok.decode([int(t) for t in ids])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is the GPL?<|im_end|>\n"
                           "<|im_start|>assistant\nA copyleft license.<|im_end|>\n")
    assert pieces_by_mask(tok, ids, mask, starts) == ["A copyleft license.<|im_end|>", "MIT.<|im_end|>",
                                                      "Hello!<|im_end|>Goodbye.<|im_end|>"]
    assert starts.sum() == 3 and starts[0] == 1
    assert all(mask[i] == 0 for i in np.flatnonzero(starts))


def test_llama2_template_and_plain_pairs(tmp_path):
    tok_path = os.path.join(lc.REPO, "data", "llama_demo", "tokenizer.bin")
    jsonl = tmp_path / "chat.jsonl"
    write_jsonl(jsonl, CONVERSATIONS)
    p = prepare(tok_path, jsonl, tmp_path / "l2", "--chat-template", "llama2")
    assert p.returncode == 0, p.stderr
    ids, mask, _, starts = shards.read_shard(str(tmp_path / "l2_train.bin"), with_starts=True)
    tok = Tokenizer(tok_path)
    eos = tok.decode([2])  # llama2.c's EOS piece is "\n</s>\n"
    assert pieces_by_mask(tok, ids, mask, starts) == [f" A copyleft license.{eos}", f" MIT.{eos}", f" Hello!{eos} Goodbye.{eos}"]
    assert list(ids).count(1) == 4 and list(ids).count(2) == 4  # a BOS per exchange, an EOS per reply
    whole = tok.decode([int(t) for t in ids])
    assert "[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\nWhat is the GPL? [/INST]" in whole
    # without a template, pairs are BOS + prompt + response + EOS and a chat line is an error
    write_jsonl(jsonl, CONVERSATIONS[1:2])
    assert prepare(tok_path, jsonl, tmp_path / "plain").returncode == 0
    ids, mask, _ = shards.read_shard(str(tmp_path / "plain_train.bin"))
    assert tok.decode([int(t) for t, m in zip(ids, mask) if m]) == f" MIT.{eos}"
    write_jsonl(jsonl, CONVERSATIONS[:1])
    p = prepare(tok_path, jsonl, tmp_path / "bad")
    assert p.returncode != 0 and "chat template" in p.stderr and len(p.stderr.strip().splitlines()) == 1
    jsonl.write_text('{"messages": [{"role": "user", "content": "no reply"}]}\n')
    p = prepare(tok_path, jsonl, tmp_path / "bad", "--chat-template", "chatml")
    assert p.returncode != 0 and "chat.jsonl:1" in p.stderr


def test_train_llama_on_packed_instruction_data(tmp_path):
    """The demo model fine-tuned on packed prompt/response data: the loss (on replies only) falls."""
    tok_path = os.path.join(lc.REPO, "data", "llama_demo", "tokenizer.bin")
    rng = np.random.default_rng(0)
    items = []
    for i in range(120):
        a, b = int(rng.integers(2, 50)), int(rng.integers(2, 50))
        items.append({"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."})
    jsonl = tmp_path / "sums.jsonl"
    write_jsonl(jsonl, items)
    assert prepare(tok_path, jsonl, tmp_path / "sums", "--val-frac", "0.1", "--chat-template", "llama2").returncode == 0
    p = subprocess.run([os.path.join(lc.REPO, "train_llama"), "--model", os.path.join(lc.REPO, "data", "llama_demo"),
                        "--data", str(tmp_path / "sums_train.bin"), "--val", str(tmp_path / "sums_val.bin"), "--steps", "30",
                        "--batch", "4", "--seq", "64", "--lr", "5e-3", "--lora-rank", "8", "--val-every", "10", "--threads", "2"],
                       capture_output=True, text=True, timeout=300, env=dict(os.environ, OMP_WAIT_POLICY="passive"))
    assert p.returncode == 0, p.stderr
    vl = [float(l.split("val loss ")[1].split()[0]) for l in p.stdout.splitlines() if "val loss" in l]
    print("val loss on replies:", vl)
    assert vl[-1] < 0.8 * vl[0]
