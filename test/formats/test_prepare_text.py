"""scripts/data/prepare_text.py on instruction data: chat templates (the model's own, rendered as
transformers renders it; the fixed ChatML and LLaMA-2 ones), loss on the assistant replies only,
examples packed with their starts marked, and train_llama training on the result with attention
kept inside each example. With a Hugging Face tokenizer.json, the tokens equal the `tokenizers`
library's, chunk by chunk and piece by piece."""
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


# ---- tokenizer.json and the model's own chat template -------------------------------------------

def hf_tok_dir(tmp_path, style, template=None, bos=None, eos=None):
    """A directory with a tokenizer.json trained by the `tokenizers` library (test_hf_tokenizer.py's
    styles, or Llama-3's special tokens) and, with a template, tokenizer_config.json."""
    import test_hf_tokenizer as th
    from test_chat_template import llama3_tokenizer
    d = tmp_path / style
    d.mkdir()
    tok = llama3_tokenizer() if style == "llama3chat" else th.STYLES[style]()
    tok.save(str(d / "tokenizer.json"))
    if template:
        (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": template, "bos_token": bos, "eos_token": eos}))
    return d, tok


@pytest.mark.parametrize("style", ["smollm2", "llama3", "qwen2", "llama2", "metaspace"])
def test_plain_text_with_tokenizer_json_equals_the_library(tmp_path, style):
    """Every chunk's tokens are BOS + the library's encoding of the chunk, on the varied corpus of
    test_hf_tokenizer.py (Unicode, emoji, whitespace runs, digits, special tokens in the text)."""
    import prepare_text
    import test_hf_tokenizer as th
    d, tok = hf_tok_dir(tmp_path, style)
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(th.CORPUS + th.CORPUS[::-1]), encoding="utf-8")
    p = prepare(d / "tokenizer.json", text, tmp_path / "c", "--chunk-chars", "300")
    assert p.returncode == 0, p.stderr
    ids, mask, _ = shards.read_shard(str(tmp_path / "c_train.bin"))
    bos = int(ids[0])
    assert tok.id_to_token(bos) in ("<|endoftext|>", "<s>")
    chunks = prepare_text.split_paragraph_chunks(prepare_text.read_text(str(text), "strict"), 300)
    assert len(chunks) > 5
    want = [t for c in chunks for t in [bos] + tok.encode(c, add_special_tokens=False).ids]
    assert [int(t) for t in ids] == want
    assert int(mask.sum()) == len(want) - len(chunks)  # every token but each chunk's BOS is a target


def check_replies(tok, ids, mask, starts, convs, reference, end_token, trim, expected=None):
    """Per example: the whole decodes to transformers' rendering; each masked run is one assistant
    reply plus its end-of-turn token (or, given, that example's replies), and each run (masked or
    not) is the library's encoding of its text."""
    bounds = list(np.flatnonzero(starts)) + [len(ids)]
    assert len(bounds) - 1 == len(convs)
    for (a, b), conv, ref in zip(zip(bounds[:-1], bounds[1:]), convs, reference):
        ex, m = [int(t) for t in ids[a:b]], [int(x) for x in mask[a:b]]
        assert tok.decode(ex, skip_special_tokens=False) == ref
        runs, at = [], 0
        for k in range(1, len(ex) + 1):
            if k == len(ex) or m[k] != m[at]:
                runs.append((m[at], ex[at:k]))
                at = k
        replies = [r[1] for r in runs if r[0]]
        want = [(c["content"].strip() if trim else c["content"]) + end_token for c in conv if c["role"] == "assistant"]
        if expected is not None:
            want = expected.pop(0)
        assert [tok.decode(r, skip_special_tokens=False) for r in replies] == want
        for _, run in runs:
            assert tok.encode(tok.decode(run, skip_special_tokens=False), add_special_tokens=False).ids == run


@pytest.mark.parametrize("which", ["smollm2", "llama3", "llama31"])
def test_jsonl_through_the_models_own_template(tmp_path, which):
    """SmolLM2's template (from its GGUF) with a SmolLM2-style tokenizer.json, Llama-3's and
    Llama-3.1's with Llama-3's special tokens: prepare_text.py's examples are transformers'
    renderings, trained on the assistant replies (and their end-of-turn token) only."""
    from test_chat_template import CONVERSATIONS as TURNS, LLAMA3, LLAMA31, smollm2_template, transformers_render
    if which == "smollm2":
        d, tok = hf_tok_dir(tmp_path, "smollm2", smollm2_template(), "<|im_start|>", "<|im_end|>")
        end, bos, eos = "<|im_end|>", "<|im_start|>", "<|im_end|>"
    else:
        d, tok = hf_tok_dir(tmp_path, "llama3chat", LLAMA3 if which == "llama3" else LLAMA31, "<|begin_of_text|>",
                            "<|end_of_text|>")
        end, bos, eos = "<|eot_id|>", "<|begin_of_text|>", "<|end_of_text|>"
    convs = [c for c in TURNS if any(m["role"] == "assistant" for m in c)]
    convs += [c + [{"role": "assistant", "content": " Ünïcode 😀 42 <|im_start|> reply "}] for c in TURNS if c[-1]["role"] == "user"]
    items = [{"messages": c} for c in convs] + [{"prompt": "Name a permissive license.", "response": "MIT."}]
    convs.append([{"role": "user", "content": "Name a permissive license."}, {"role": "assistant", "content": "MIT."}])
    jsonl = tmp_path / "chat.jsonl"
    write_jsonl(jsonl, items)
    p = prepare(d / "tokenizer.json", jsonl, tmp_path / "chat")
    assert p.returncode == 0, p.stderr
    ids, mask, _, starts = shards.read_shard(str(tmp_path / "chat_train.bin"), with_starts=True)
    cases = [dict(template=json.loads((d / "tokenizer_config.json").read_text())["chat_template"], messages=c,
                  add_generation_prompt=False, bos_token=bos, eos_token=eos) for c in convs]
    check_replies(tok, ids, mask, starts, convs, transformers_render(cases), end, trim=which != "smollm2")


def test_jsonl_through_qwen_templates(tmp_path):
    """The templates that render as Qwen2.5's and Qwen3's (test/fixtures/chat_qwen25.jinja, chat_qwen3.jinja)
    with a Qwen2-style tokenizer.json: examples are transformers' renderings; Qwen2.5's replies are
    their content and <|im_end|>; Qwen3's (one per conversation, at the end) are what follows
    transformers' rendering of the turns before with add_generation_prompt: the <think> block too."""
    from test_chat_template import CONVERSATIONS as TURNS, QWEN25, QWEN3, QWEN_CONVERSATIONS, QWEN_TOKENS, transformers_render
    reply = {"role": "assistant", "content": " Ünïcode 😀 42 <|im_start|> reply "}
    for which, template in (("qwen25", QWEN25), ("qwen3", QWEN3)):
        d, tok = hf_tok_dir(tmp_path, "qwen2", template, QWEN_TOKENS["bos_token"], QWEN_TOKENS["eos_token"])
        if which == "qwen25":
            convs = [c for c in TURNS + QWEN_CONVERSATIONS if any(m["role"] == "assistant" for m in c)]
            convs = [c[:max(i + 1 for i, m in enumerate(c) if m["role"] == "assistant")] for c in convs]
        else:
            convs = [QWEN_CONVERSATIONS[0], QWEN_CONVERSATIONS[3]]
        convs += [c + [reply] for c in TURNS if all(m["role"] != "assistant" for m in c)]
        write_jsonl(tmp_path / "chat.jsonl", [{"messages": c} for c in convs])
        p = prepare(d / "tokenizer.json", tmp_path / "chat.jsonl", tmp_path / which)
        assert p.returncode == 0, p.stderr
        ids, mask, _, starts = shards.read_shard(str(tmp_path / f"{which}_train.bin"), with_starts=True)
        refs = transformers_render([dict(template=template, messages=c, add_generation_prompt=False, **QWEN_TOKENS)
                                    for c in convs])
        replies = None
        if which == "qwen3":
            prompts = transformers_render([dict(template=template, messages=c[:-1], add_generation_prompt=True,
                                                **QWEN_TOKENS) for c in convs])
            assert all(r.startswith(q) for q, r in zip(prompts, refs))
            replies = [[r[len(q):].rstrip()] for q, r in zip(prompts, refs)]
            assert replies[0] == ["<think>\nAdd them.\n</think>\n\n4<|im_end|>"]
        check_replies(tok, ids, mask, starts, convs, refs, "<|im_end|>", trim=False, expected=replies)
        (tmp_path / "qwen2").rename(tmp_path / f"{which}_tok")
    # Qwen3's template drops an earlier reply's <think> block once a user turn follows: refused
    d = tmp_path / "qwen3_tok"
    write_jsonl(tmp_path / "multi.jsonl", [{"messages": QWEN_CONVERSATIONS[1][:5]}])
    p = prepare(d / "tokenizer.json", tmp_path / "multi.jsonl", tmp_path / "multi")
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1 and not list(tmp_path.glob("multi_*")), err
    assert "chat_template: assistant message 3 renders differently once later turns follow it" in err, err


def test_templates_that_hide_the_replies_are_refused(tmp_path):
    conv = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]}]
    jsonl = tmp_path / "chat.jsonl"
    write_jsonl(jsonl, conv)
    cases = [  # a footer after the last message: the turns before a reply are not a prefix of the whole
        ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% if loop.last %} END{% endif %}\n{% endfor %}",
         "smollm2", ["tokenizer_config.json: chat_template", "not give a prefix"]),
        # errors of the template or jinja2, and tool calls, name what happened
        ("{% for m in messages %}{{ raise_exception('no ' ~ m.role) }}{% endfor %}", "smollm2",
         ["tokenizer_config.json: chat_template: the template raised: no user"]),
        ("{% for m in messages %}{{ m.content | nosuchfilter }}{% endfor %}", "smollm2",
         ["tokenizer_config.json: chat_template: template syntax error at line 1", "nosuchfilter"]),
        ("{{ messages[0].content.nosuchmethod() }}", "smollm2",
         ["tokenizer_config.json: chat_template: rendering failed: UndefinedError", "nosuchmethod"]),
        # a SentencePiece-style tokenizer.json prepends "▁" to each piece it encodes
        ("{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}", "llama2",
         ["tokenizer.json", "--chat-template llama2"]),
    ]
    for k, (template, style, needles) in enumerate(cases):
        (tmp_path / str(k)).mkdir()
        d, _ = hf_tok_dir(tmp_path / str(k), style, template, "<s>", "</s>")
        p = prepare(d / "tokenizer.json", jsonl, tmp_path / f"bad{k}")
        err = p.stderr.strip()
        assert p.returncode == 1 and len(err.splitlines()) == 1, err
        assert all(n in err for n in needles), err
        assert not list(tmp_path.glob(f"bad{k}*"))


def test_tool_calls_and_a_missing_jinja2_are_one_line(tmp_path):
    from test_chat_template import QWEN3, QWEN_TOKENS
    d, _ = hf_tok_dir(tmp_path, "qwen2", QWEN3, QWEN_TOKENS["bos_token"], QWEN_TOKENS["eos_token"])
    call = {"name": "weather", "arguments": {"city": "Paris"}}
    write_jsonl(tmp_path / "tools.jsonl", [{"messages": [{"role": "user", "content": "Weather?"},
                                                         {"role": "assistant", "content": "", "tool_calls": [call]}]}])
    write_jsonl(tmp_path / "chat.jsonl", CONVERSATIONS[:1])
    hidden = tmp_path / "nojinja"  # a jinja2 that cannot be imported, first on the path
    hidden.mkdir()
    (hidden / "jinja2.py").write_text("raise ImportError('No module named jinja2')\n")
    for jsonl, env, needle in ((tmp_path / "tools.jsonl", None, "tool calling is not supported (message 2 has tool_calls)"),
                               (tmp_path / "chat.jsonl", dict(os.environ, PYTHONPATH=str(hidden)),
                                "needs the jinja2 package (Debian: apt-get install python3-jinja2")):
        p = subprocess.run([sys.executable, PREP, "--tokenizer", str(d / "tokenizer.json"), "--input", str(jsonl),
                            "--out", str(tmp_path / "out"), "--val-frac", "0"], capture_output=True, text=True,
                           timeout=120, env=env)
        err = p.stderr.strip()
        assert p.returncode == 1 and len(err.splitlines()) == 1 and err.startswith("prepare_text: "), err
        assert needle in err and not list(tmp_path.glob("out_*")), err


# ---- inputs refused in one line, not tokenised into something else (issue 28) -------------------

def one_line_refusal(p, *needles):
    err = p.stderr.strip()
    assert p.returncode == 1 and len(err.splitlines()) == 1 and err.startswith("prepare_text: "), (p.returncode, err)
    assert all(n in err for n in needles), err


def test_jsonl_is_told_by_its_extension_in_any_case(tmp_path):
    d, _ = hf_tok_dir(tmp_path, "smollm2")
    tok = d / "tokenizer.json"
    lower, upper, txt = tmp_path / "a.jsonl", tmp_path / "b.JSONL", tmp_path / "c.txt"
    for path in (lower, upper, txt):
        write_jsonl(path, CONVERSATIONS)
    assert prepare(tok, lower, tmp_path / "lower", "--chat-template", "chatml").returncode == 0
    assert prepare(tok, upper, tmp_path / "upper", "--chat-template", "chatml").returncode == 0
    assert (tmp_path / "upper_train.bin").read_bytes() == (tmp_path / "lower_train.bin").read_bytes()
    # a file named otherwise that starts with an example: ambiguous, unless --format says
    one_line_refusal(prepare(tok, txt, tmp_path / "txt", "--chat-template", "chatml"), str(txt), "--format jsonl")
    assert not list(tmp_path.glob("txt_*"))
    assert prepare(tok, txt, tmp_path / "txt", "--chat-template", "chatml", "--format", "jsonl").returncode == 0
    assert (tmp_path / "txt_train.bin").read_bytes() == (tmp_path / "lower_train.bin").read_bytes()
    assert prepare(tok, txt, tmp_path / "as_text", "--format", "text").returncode == 0
    assert shards.read_shard(str(tmp_path / "as_text_train.bin"), with_starts=True)[3] is None  # plain text: not packed


def test_a_template_that_renders_no_reply_is_refused(tmp_path):
    # every rendering is a prefix of the next, but the replies vanish: shards of no target
    template = ("{% for m in messages %}{% if m.role == 'user' %}<|im_start|>{{ m.content }}<|im_end|>{% endif %}"
                "{% endfor %}")
    d, _ = hf_tok_dir(tmp_path, "smollm2", template, "<|endoftext|>", "<|im_end|>")
    jsonl = tmp_path / "chat.jsonl"
    write_jsonl(jsonl, CONVERSATIONS)
    one_line_refusal(prepare(d / "tokenizer.json", jsonl, tmp_path / "out"), str(jsonl), "no example has a target")
    assert not list(tmp_path.glob("out_*"))


def test_a_lone_surrogate_escape_is_refused_naming_its_line(tmp_path):
    d, _ = hf_tok_dir(tmp_path, "smollm2")
    jsonl = tmp_path / "chat.jsonl"
    for bad in ({"prompt": "x \ud800 y", "response": "z"}, {"prompt": "x", "response": "\udfff"},
                {"messages": [{"role": "user", "content": "a\ud83d"}, {"role": "assistant", "content": "b"}]}):
        write_jsonl(jsonl, [CONVERSATIONS[1], bad])
        assert "\\ud" in jsonl.read_text()  # json.dumps escapes it, as a file from elsewhere would
        one_line_refusal(prepare(d / "tokenizer.json", jsonl, tmp_path / "out", "--chat-template", "chatml"),
                         f"{jsonl}:2", "lone surrogate")
        assert not list(tmp_path.glob("out_*"))
    write_jsonl(jsonl, [{"prompt": "a pair \ud83d\ude00 is one character", "response": "ok"}])
    assert prepare(d / "tokenizer.json", jsonl, tmp_path / "ok", "--chat-template", "chatml").returncode == 0


@pytest.mark.parametrize("config", ["[]", "[{\"chat_template\": \"x\"}]", "3", "\"text\"", "[" * 100000],
                         ids=["list", "list_of_templates", "number", "string", "deep"])
def test_a_tokenizer_config_that_is_not_an_object_is_one_line(tmp_path, config):
    d, _ = hf_tok_dir(tmp_path, "smollm2")
    (d / "tokenizer_config.json").write_text(config)
    text, jsonl = tmp_path / "t.txt", tmp_path / "c.jsonl"
    text.write_text("Some text.\n\nMore text.\n")
    write_jsonl(jsonl, CONVERSATIONS)
    for path in (text, jsonl):
        one_line_refusal(prepare(d / "tokenizer.json", path, tmp_path / "out"), str(d / "tokenizer_config.json"))
        assert not list(tmp_path.glob("out_*"))


@pytest.mark.parametrize("which", ["input", "tokenizer", "tokenizer_config"])
def test_inputs_that_are_fifos_are_refused_not_waited_on(tmp_path, which):
    """A FIFO at an input's path used to block prepare_text.py forever in open() (the tokenizer and
    its tokenizer_config.json) or be called missing (--input). Each is now one line saying what it
    is; the timeout turns a hang back into a failure."""
    d, _ = hf_tok_dir(tmp_path, "smollm2")
    text = tmp_path / "t.txt"
    text.write_text("Some text.\n\nMore text.\n")
    fifo = {"input": text, "tokenizer": d / "tokenizer.json", "tokenizer_config": d / "tokenizer_config.json"}[which]
    if fifo.exists():
        fifo.unlink()
    os.mkfifo(fifo)
    try:
        p = prepare(d / "tokenizer.json", text, tmp_path / "out")
    except subprocess.TimeoutExpired:
        pytest.fail(f"{which}: still waiting on the FIFO after 120 s")
    one_line_refusal(p, str(fifo), "FIFO")
    assert not list(tmp_path.glob("out_*"))
