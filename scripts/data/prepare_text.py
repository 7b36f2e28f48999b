"""Tokenise text into train/val token shards (format: scripts/formats/shards.py).

    python3 scripts/data/prepare_text.py --tokenizer TOK --input FILE --out PREFIX
        [--val-frac 0.1] [--seed 0] [--chunk-chars 4096]

TOK: a llama2.c tokenizer.bin (also the byte-level one scripts/export/export_llama.py --gguf writes),
or a Hugging Face tokenizer.json (needs `pip install tokenizers`).
FILE: plain text, or .jsonl (any case) with one {"prompt": ..., "response": ...} or
{"messages": [{"role": "system|user|assistant", "content": ...}, ...]} per line (a record with both
is refused; an assistant message's "weight": 0 or 1 says whether it is trained on, as in OpenAI's
fine-tuning format); a file of another name whose first line is such an object is refused as
ambiguous unless --format says which it is. A leading UTF-8 byte order mark is not text: dropped.
Writes PREFIX_train.bin and PREFIX_val.bin (no val shard with --val-frac 0).
Invalid UTF-8 is an error naming the byte offset (--utf8-errors replace substitutes U+FFFD), and
so is a JSON escape of a lone surrogate ("\\ud800") naming the line. Shards in which no token is
a target (a chat template that renders no assistant reply) are refused, not written.

Plain text is cut at paragraph boundaries into chunks of about --chunk-chars
characters (a longer paragraph at its line breaks), each BOS + tokens, every token a target except
BOS (nothing in a chunk predicts it); val is the last val-frac of chunks, so it is text the model
did not see. A line (a JSONL example) is tokenised whole, so lines longer than MAX_LINE_CHARS are
refused. JSONL examples go through the model's own chat template (--chat-template auto, the default: the
Jinja chat_template of the tokenizer_config.json beside the tokenizer, rendered by
scripts/formats/chat_template.py with jinja2 as transformers' apply_chat_template renders it (needs
jinja2: Debian's python3-jinja2; tool calling is refused); or the fixed
chatml or llama2), or without one BOS + prompt + response + EOS; only assistant replies (up to
and including their end-of-turn token) are trained on. Examples are packed back to
back and the shards mark where each starts, so the trainer restarts positions and keeps
attention inside each example. val is a seeded random val-frac of the lines.

Preference JSONL (TRL's layouts: {"prompt", "chosen", "rejected"} as strings, or as message lists,
or "chosen"/"rejected" as whole conversations sharing their leading messages) becomes pair shards
for train_llama --objective dpo|orpo|simpo (docs/formats.md): the prompt as for SFT (its BOS), each
completion's tokens then EOS; --seq bounds prompt + completion (prompt cut from the left, then the
completions from the right), and the cuts are counted and printed.
"""
import argparse
import json
import os
import random
import re
import stat
import sys

import numpy as np

# sibling modules in scripts/<folder>/
SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(SCRIPTS, d) for d in ("formats",)]
import chat_template  # noqa: E402
import shards  # noqa: E402
from llama2c_tokenizer import Tokenizer as Llama2cTokenizer  # noqa: E402


class PrepError(Exception):
    """Bad input; reported as one line."""


class HFTokenizer:
    """Adapter giving a Hugging Face tokenizer.json the llama2.c Tokenizer interface."""

    BOS_NAMES = ("<s>", "<|begin_of_text|>", "<bos>", "<|endoftext|>")
    EOS_NAMES = ("</s>", "<|end_of_text|>", "<eos>", "<|endoftext|>")

    def __init__(self, path):
        check_tokenizer_json(path)
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise PrepError(f"{path}: reading a tokenizer.json needs the `tokenizers` package: "
                            "pip install tokenizers") from None
        try:
            self.tok = Tokenizer.from_file(path)
        except Exception as e:  # the Rust library's errors have no common Python type
            raise PrepError(f"{path}: not a valid tokenizer.json ({one_line(e)})") from None
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        names = self._special_names(path)
        self.bos_id = self._find(path, "bos", [names.get("bos_token")] + list(self.BOS_NAMES))
        self.eos_id = self._find(path, "eos", [names.get("eos_token")] + list(self.EOS_NAMES))

    @staticmethod
    def _special_names(path):
        """bos/eos token strings from a tokenizer_config.json beside the file, if any."""
        cfg = read_tokenizer_config(path)[1] or {}
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


def refuse_unless_regular(path, expected):
    """Only regular files are inputs: opening a FIFO blocks until a writer comes (forever, for a
    mistaken path), and a device never ends. Refuses anything else that exists at `path`, saying
    what it is (a missing file is the caller's case)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return
    if stat.S_ISREG(mode):
        return
    kinds = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO (named pipe)"),
             (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))
    kind = next((k for test, k in kinds if test(mode)), "not a regular file")
    raise PrepError(f"{path}: is {kind}, expected {expected}")


def read_tokenizer_config(tok_path):
    """(path, dict) of the tokenizer_config.json beside the tokenizer; dict None when there is none.
    One that is not valid JSON, or not an object, is refused (transformers reads it as keyword
    arguments: a list or a number there is a broken file, not an empty configuration)."""
    cfg_path = os.path.join(os.path.dirname(os.path.abspath(tok_path)), "tokenizer_config.json")
    if not os.path.exists(cfg_path):
        return cfg_path, None
    refuse_unless_regular(cfg_path, "a tokenizer_config.json file")
    try:
        with open(cfg_path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        raise PrepError(f"{cfg_path}: cannot read ({one_line(e)})") from None
    except RecursionError:
        raise PrepError(f"{cfg_path}: nested too deeply to be a tokenizer_config.json") from None
    if not isinstance(cfg, dict):
        raise PrepError(f"{cfg_path}: expected a JSON object of tokenizer settings, found {json_kind(cfg)}")
    return cfg_path, cfg


def json_kind(v):
    """What a JSON value is, in a message."""
    names = {list: "a list", str: "a string", bool: "a boolean", int: "a number", float: "a number", dict: "an object"}
    return names.get(type(v), "null")


def one_line(e):
    """An exception's message on one line (library messages can span several)."""
    return " ".join(str(e).split())


def check_tokenizer_json(path):
    """A JSON file is only a Hugging Face tokenizer.json if it has the "model" object the
    tokenizers library reads (say so, rather than asking for the package or a cryptic parse error)."""
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise PrepError(f"{path}: starts like JSON but is not valid JSON ({one_line(e)})") from None
    if not isinstance(obj, dict) or not isinstance(obj.get("model"), dict):
        raise PrepError(f"{path}: a JSON file but not a Hugging Face tokenizer.json (no \"model\" object); "
                        "expected tokenizer.json or a llama2.c tokenizer.bin")


def load_tokenizer(path):
    """llama2.c tokenizer.bin, or a Hugging Face tokenizer.json (told apart by its content)."""
    refuse_unless_regular(path, "a tokenizer.json or tokenizer.bin file")
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


# The longest line (JSONL: example) tokenised: a text is encoded whole, and the encoders hold about
# 170 bytes of memory per character while they do (a llama2.c tokenizer's per-character merge
# state), so a 100 MB line would take 17 GB. Chunks are cut at blank lines and line breaks only:
# a cut inside a line would change the tokens at the cut.
MAX_LINE_CHARS = 1 << 20


def check_line_lengths(path, text, jsonl):
    """Refuses a line over MAX_LINE_CHARS, naming it and what to do."""
    lengths = list(map(len, text.split("\n")))  # linear (a regex for a long run of non-newlines is quadratic)
    n = max(lengths)
    if n <= MAX_LINE_CHARS:
        return
    lineno = lengths.index(n) + 1
    advice = ("split the example into shorter ones" if jsonl else
              f"break it into lines, e.g. `fold -s -w 1000 {path}` (breaks at spaces)")
    raise PrepError(f"{path}: line {lineno} has {n} characters, more than the {MAX_LINE_CHARS} a line may have "
                    f"(a line is tokenised whole, at about 170 bytes of memory per character); {advice}")


def paragraph_pieces(para, chunk_chars):
    """A paragraph, or when it is longer than chunk_chars its lines grouped into pieces of at least
    chunk_chars (the last may be short), so that no chunk grows with a long paragraph."""
    if len(para) <= chunk_chars:
        return [para]
    pieces, cur, size = [], [], 0
    for line in para.split("\n"):
        cur.append(line)
        size += len(line) + 1
        if size >= chunk_chars:
            pieces.append("\n".join(cur))
            cur, size = [], 0
    if cur:
        pieces.append("\n".join(cur))
    return pieces


def split_paragraph_chunks(text, chunk_chars):
    """Join blank-line-separated paragraphs into chunks of at least chunk_chars (last may be short);
    a paragraph longer than chunk_chars is cut at its line breaks (paragraph_pieces)."""
    chunks, cur = [], []
    size = 0
    # blank lines separate paragraphs; the next paragraph keeps its indentation
    for para in re.split(r"\n(?:[ \t\r\f\v]*\n)+", text):
        if not para.strip():
            continue
        pieces = paragraph_pieces(para, chunk_chars)
        if len(pieces) > 1:  # each a chunk of its own; the last goes on as a paragraph
            if cur:
                chunks.append("\n\n".join(cur))
                cur, size = [], 0
            chunks.extend(pieces[:-1])
            para = pieces[-1]
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


# Chat templates: how a conversation becomes text. "auto" renders the model's own Jinja template
# (tokenizer_config.json's chat_template, with jinja2 through scripts/formats/chat_template.py: any
# template transformers renders, also outside the subset --chat renders in C).
# Two fixed ones remain for tokenizers without a template: "chatml":
# <|im_start|>role\ncontent<|im_end|>\n per message (SmolLM2, Qwen); "llama2": <s>[INST] <<SYS>>\n
# system\n<</SYS>>\n\nuser [/INST] assistant </s> per exchange. Only assistant turns (and their
# end marker) are trained on.
CHAT_TEMPLATES = ("chatml", "llama2")


class ModelTemplate:
    """A model's chat template with the bos_token and eos_token strings it renders with."""

    def __init__(self, cfg_path, source, bos, eos):
        self.cfg_path, self.source, self.bos, self.eos = cfg_path, source, bos, eos
        chat_template.parse(source, self.name())  # a syntax error or no jinja2: say so now, not at line 1000

    def name(self):
        return f"{self.cfg_path}: chat_template"

    def render(self, messages, add_generation_prompt):
        messages = [{k: v for k, v in m.items() if k != "weight"} for m in messages]  # ours, not the template's
        try:
            return chat_template.render(self.source, messages, add_generation_prompt, self.bos, self.eos, self.name())
        except chat_template.ChatTemplateError as e:  # raise_exception, another error while rendering, or tools
            raise PrepError(str(e)) from None


def token_string(v):
    """tokenizer_config.json's bos_token / eos_token: a string or {"content": string}."""
    v = v.get("content") if isinstance(v, dict) else v
    return v if isinstance(v, str) else ""


def load_model_template(tok_path):
    """The chat template of a tokenizer_config.json beside the tokenizer, or None."""
    cfg_path, cfg = read_tokenizer_config(tok_path)
    if cfg is None:
        return None
    tmpl = cfg.get("chat_template")
    if isinstance(tmpl, list):  # named templates: the default one
        tmpl = next((t.get("template") for t in tmpl if isinstance(t, dict) and t.get("name") == "default"), None)
    if not tmpl:
        return None
    if not isinstance(tmpl, str):
        raise PrepError(f"{cfg_path}: chat_template must be a string or a list of {{name, template}}")
    try:
        return ModelTemplate(cfg_path, tmpl, token_string(cfg.get("bos_token")), token_string(cfg.get("eos_token")))
    except chat_template.ChatTemplateError as e:
        raise PrepError(str(e)) from None


def check_pieces_encode_alone(tok, what):
    """Encoding a conversation piece by piece gives the whole's tokens only when the tokenizer adds
    nothing to a piece's start (a SentencePiece-style tokenizer.json prepends "▁")."""
    inner = getattr(tok, "tok", None)
    if inner is None:  # a tokenizer.bin: llama2.c's SentencePiece encoding adds a dummy-prefix space
        if not tok.byte_level:
            raise PrepError(f"{what}: a SentencePiece tokenizer.bin adds a space before every piece of text, so a "
                            "rendered conversation cannot be tokenised turn by turn; use --chat-template llama2 (or chatml)")
        return
    probe = "x"
    if inner.normalizer is not None:
        probe = inner.normalizer.normalize_str(probe)
    if inner.pre_tokenizer is not None:
        probe = "".join(p for p, _ in inner.pre_tokenizer.pre_tokenize_str(probe))
    if probe != "x":
        raise PrepError(f"{what}: this tokenizer.json adds {probe[:-1]!r} before every piece of text, so a rendered "
                        "conversation cannot be tokenised turn by turn; use --chat-template llama2 (or chatml)")


def trained(message):
    """Whether an assistant message is trained on: its "weight" (0 or 1, read_jsonl checks), 1 when absent."""
    return message.get("weight", 1) == 1


def template_spans(tmpl, messages):
    """The rendered conversation and the [start, end) character span of each assistant reply: from
    the end of the rendering of the turns before it with add_generation_prompt, to the end of the
    rendering that includes it (less trailing whitespace). Every such rendering must be a prefix of
    the whole, else the reply's tokens cannot be told apart: refused, never guessed. (Qwen3's
    template renders a reply with its <think> block only while no user turn follows it, so its
    conversations must have one assistant reply, at the end.)"""
    full = tmpl.render(messages, False)
    spans, done = [], 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        before = tmpl.render(messages[:i], True)
        upto = tmpl.render(messages[:i + 1], False).rstrip()
        if not (full.startswith(before) and upto.startswith(before) and len(before) >= done):
            raise PrepError(f"{tmpl.name()}: rendering the turns before assistant message {i + 1} (with "
                            "add_generation_prompt) does not give a prefix of the whole conversation, so the "
                            "reply's tokens cannot be found")
        if not full.startswith(upto):
            raise PrepError(f"{tmpl.name()}: assistant message {i + 1} renders differently once later turns "
                            "follow it (as Qwen3's template drops earlier replies' <think> blocks), so its tokens "
                            "cannot be found; give such conversations one assistant reply, at the end")
        if len(upto) > len(before):
            if trained(m):
                spans.append((len(before), len(upto)))
            done = len(upto)
    return full, spans


def encode_with_template(tok, messages, tmpl):
    """A conversation through the model's template -> (ids, mask): each piece of the rendering
    tokenised alone (no BOS added: a template that wants one renders it), the assistant replies
    trained on (but those of "weight": 0). A prompt piece thus has the tokens --chat feeds for it."""
    full, spans = template_spans(tmpl, messages)
    ids, mask, at = [], [], 0
    for a, b in spans + [(len(full), len(full))]:
        for text, train in ((full[at:a], 0), (full[a:b], 1)):
            if text:
                t = tok.encode(text, bos=False)
                ids.extend(t)
                mask.extend([train] * len(t))
        at = b
    return ids, mask


def encode_chat(tok, messages, template):
    """A conversation -> (ids, mask) with loss on the assistant turns only."""
    if isinstance(template, ModelTemplate):
        return encode_with_template(tok, messages, template)
    ids, mask = [], []

    def add(text, train, bos=False):
        t = tok.encode(text, bos=bos)
        ids.extend(t)
        mask.extend([1 if train else 0] * len(t))

    if template == "chatml":
        for m in messages:
            add(f"<|im_start|>{m['role']}\n", False)
            train = m["role"] == "assistant" and trained(m)
            add(m["content"] + "<|im_end|>", train)
            add("\n", False)
        return ids, mask
    # llama2: [INST] blocks; a system message goes into the first user turn
    system = ""
    for m in messages:
        if m["role"] == "system":
            system = f"<<SYS>>\n{m['content']}\n<</SYS>>\n\n"
        elif m["role"] == "user":
            add(f"[INST] {system}{m['content']} [/INST]", False, bos=True)
            system = ""
        else:
            t = tok.encode(m["content"], bos=False, eos=True)  # the dummy-prefix space separates it from [/INST]
            ids.extend(t)
            mask.extend([int(trained(m))] * len(t))
    return ids, mask


def read_text(path, utf8_errors):
    """The file's text. Invalid UTF-8 is an error naming the byte offset (and line) unless
    utf8_errors is "replace": silently substituted characters would train the model on garbage."""
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        if utf8_errors != "replace":
            line = data.count(b"\n", 0, e.start) + 1
            raise PrepError(f"{path}: invalid UTF-8 at byte offset {e.start} (line {line}): {e.reason}; "
                            "fix the file or pass --utf8-errors replace to substitute U+FFFD") from None
        text = data.decode("utf-8", errors="replace")
    # a byte order mark says how the file is encoded, it is not text: trained on it would be three
    # byte tokens, and json.loads refuses a line that starts with one
    text = text[1:] if text.startswith("\ufeff") else text
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as open() in text mode


def check_unicode(obj, where):
    """Python's json turns an escaped lone surrogate ("\\ud800", half of a UTF-16 pair) into a
    string no UTF-8 can hold; the tokenizers would make invalid tokens of it. Refused, naming it."""
    todo = [obj]
    while todo:
        v = todo.pop()
        if isinstance(v, dict):
            todo.extend(v.keys())
            todo.extend(v.values())
        elif isinstance(v, list):
            todo.extend(v)
        elif isinstance(v, str):
            try:
                v.encode("utf-8")
            except UnicodeEncodeError as e:
                raise PrepError(f"{where}: the escape \\u{ord(v[e.start]):04x} is a lone surrogate, not a "
                                "character (a \\uD8xx escape must be followed by a \\uDCxx one)") from None


def check_chat_keys(obj, where):
    """What a record's keys mean must be one thing: "messages" beside "prompt"/"response" would
    train on one and drop the other silently; "weight" (OpenAI's fine-tuning format) is 0 or 1 on
    an assistant message, and means nothing elsewhere."""
    both = [k for k in ("prompt", "response") if k in obj]
    if both:
        raise PrepError(f"{where}: has both \"messages\" and {' and '.join(repr(k) for k in both)}; a record is "
                        "either a conversation or a prompt/response pair, not both")
    for i, m in enumerate(obj["messages"] if isinstance(obj["messages"], list) else [], 1):
        if not isinstance(m, dict) or "weight" not in m:
            continue
        w = m["weight"]
        if m.get("role") != "assistant":
            raise PrepError(f"{where}: message {i} ({m.get('role')!r}) has a \"weight\"; only assistant messages "
                            "are weighted (0: not trained on, 1: trained on)")
        if type(w) is not int or w not in (0, 1):
            raise PrepError(f"{where}: message {i} has \"weight\": {json.dumps(w)}; expected 0 (not trained on) "
                            "or 1 (trained on)")


def read_jsonl(path, utf8_errors="strict"):
    """Yield each non-empty line as ("pair", prompt, response) or ("chat", messages), with
    errors naming file and line."""
    text = read_text(path, utf8_errors)
    check_line_lengths(path, text, jsonl=True)
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise PrepError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
        except RecursionError:
            raise PrepError(f"{path}:{lineno}: JSON nested too deeply") from None
        check_unicode(obj, f"{path}:{lineno}")
        if isinstance(obj, dict) and ("chosen" in obj or "rejected" in obj):
            yield read_preference(obj, f"{path}:{lineno}")
            continue
        if isinstance(obj, dict) and "messages" in obj:
            check_chat_keys(obj, f"{path}:{lineno}")
        if isinstance(obj, dict) and isinstance(obj.get("messages"), list):
            msgs = obj["messages"]
            ok = msgs and all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                              and isinstance(m.get("content"), str) for m in msgs)
            if not ok or not any(m["role"] == "assistant" for m in msgs):
                raise PrepError(f"{path}:{lineno}: \"messages\" must be a list of {{\"role\": system|user|assistant, "
                                f"\"content\": str}} with at least one assistant turn")
            yield ("chat", msgs)
            continue
        if (not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str)
                or not isinstance(obj.get("response"), str)):
            raise PrepError(f"{path}:{lineno}: expected {{\"prompt\": str, \"response\": str}} or {{\"messages\": [...]}}")
        yield ("pair", obj["prompt"], obj["response"])


# ---- preference pairs (TRL's layouts) -> pair shards (scripts/formats/shards.py, write_pair_shard) ----

def is_messages(v):
    return (isinstance(v, list) and v and all(isinstance(m, dict) and m.get("role") in ("system", "user", "assistant")
                                               and isinstance(m.get("content"), str) for m in v))


def read_preference(obj, where):
    """A TRL preference record -> ("pref", prompt, chosen, rejected): standard (strings) or
    conversational (message lists; without "prompt", chosen and rejected are whole conversations
    whose common leading messages are the prompt, as TRL's extract_prompt takes it)."""
    if not ("chosen" in obj and "rejected" in obj):
        raise PrepError(f"{where}: a preference record needs both \"chosen\" and \"rejected\"")
    p, c, r = obj.get("prompt"), obj["chosen"], obj["rejected"]
    if isinstance(p, str) and isinstance(c, str) and isinstance(r, str):
        return ("pref", p, c, r)
    if p is None and is_messages(c) and is_messages(r):
        n = 0
        while n < min(len(c), len(r)) - 1 and c[n] == r[n]:
            n += 1
        if n == 0:
            raise PrepError(f"{where}: \"chosen\" and \"rejected\" share no leading message (the implicit prompt)")
        p, c, r = c[:n], c[n:], r[n:]
    if is_messages(p) and is_messages(c) and is_messages(r):
        return ("pref", p, c, r)
    raise PrepError(f"{where}: expected TRL's preference layouts: {{\"prompt\": str, \"chosen\": str, \"rejected\": str}}, "
                    "or prompt/chosen/rejected as lists of {\"role\", \"content\"} messages (or chosen/rejected as "
                    "whole conversations)")


def encode_preference(tok, item, template):
    """(prompt ids, chosen ids, rejected ids) as TRL tokenises them: the prompt as the tokenizer
    encodes it (with its BOS, as for SFT), each completion's tokens, then EOS. Conversational
    records render through the chat template: the prompt with add_generation_prompt, a completion
    as the rest of the rendered prompt + completion."""
    _, p, c, r = item
    if isinstance(p, str):
        return tok.encode(p, bos=True), tok.encode(c, bos=False, eos=True), tok.encode(r, bos=False, eos=True)
    if not isinstance(template, ModelTemplate):
        raise PrepError("conversational preference records need the model's chat template (a chat_template in "
                        "the tokenizer_config.json beside the tokenizer, --chat-template auto)")
    prompt = template.render(p, True)
    out = [tok.encode(prompt, bos=False)]
    for comp in (c, r):
        whole = template.render(p + comp, False)
        if not whole.startswith(prompt):
            raise PrepError(f"{template.name()}: the prompt's rendering is not a prefix of prompt + completion's")
        out.append(tok.encode(whole[len(prompt):], bos=False, eos=True))
    return tuple(out)


def truncate_pair(pair, seq, counts):
    """--seq bounds prompt + completion: the prompt cut from the left (to leave room for the longer
    completion, keeping at least one token), then each completion from the right. Each cut is
    counted; None for a pair a completion of which is then empty (counted, skipped)."""
    p, c, r = pair
    longest = max(len(c), len(r))
    if len(p) + longest > seq and len(p) > 1:
        keep = max(1, seq - longest)
        if keep < len(p):
            p = p[len(p) - keep:]
            counts["prompts cut"] += 1
    room = seq - len(p)
    if room < 1:
        counts["pairs skipped (a completion empty after truncation)"] += 1
        return None
    out = [p]
    for comp in (c, r):
        if len(comp) > room:
            comp = comp[:room]
            counts["completions cut"] += 1
        out.append(comp)
    return tuple(out)


def prepare_pairs(tok, items, template, seq, val_frac, seed):
    """Preference items -> (train pairs, val pairs, counts), the val split as for JSONL examples."""
    counts = {"prompts cut": 0, "completions cut": 0, "pairs skipped (a completion empty after truncation)": 0}
    pairs = [truncate_pair(encode_preference(tok, it, template), seq, counts) for it in items]
    pairs = [q for q in pairs if q is not None]
    order = list(range(len(pairs)))
    random.Random(seed).shuffle(order)
    val_idx = set(order[:n_val_items(len(pairs), val_frac)])
    train = [q for i, q in enumerate(pairs) if i not in val_idx]
    val = [q for i, q in enumerate(pairs) if i in val_idx]
    return train, val, counts


def write_pairs(prefix, train, val, vocab_size, counts, seq):
    written = []
    for name, pairs in (("train", train), ("val", val)):
        path = f"{prefix}_{name}.bin"
        if not pairs:
            print(f"{path}: not written (no validation split: --val-frac 0)")
            continue
        try:
            shards.write_pair_shard(path, pairs, vocab_size)
        except OSError as e:
            for q in written:
                os.remove(q)
            raise PrepError(f"{path}: cannot write ({e.strerror or one_line(e)})") from None
        written.append(path)
        print(f"{path}: {len(pairs)} pairs, {sum(len(p) + len(c) + len(r) for p, c, r in pairs)} tokens")
    print(f"truncation to --seq {seq}: " + ", ".join(f"{v} {k}" for k, v in counts.items()))


def main_pairs(args, tok, template, items):
    if any(it[0] != "pref" for it in items):
        raise PrepError(f"{args.input}: mixes preference records (chosen/rejected) with other examples")
    train, val, counts = prepare_pairs(tok, items, template, args.seq, args.val_frac, args.seed)
    if not train:
        raise PrepError(f"{args.input}: no pair left to train on after truncation to --seq {args.seq}")
    if args.val_frac > 0 and not val:
        raise PrepError(f"{args.input}: only {len(train)} pair, too little for a validation split (more pairs, or "
                        "--val-frac 0 for no validation shard)")
    write_pairs(args.out, train, val, tok.vocab_size, counts, args.seq)


def n_val_items(n, val_frac):
    """How many of n items go to val: at least one when asked for and possible."""
    if val_frac <= 0 or n < 2:
        return 0
    return min(n - 1, max(1, round(n * val_frac)))


def concat(docs):
    """List of (ids, mask) -> three flat numpy arrays: ids, mask, example starts."""
    ids = np.array([t for d, _ in docs for t in d], dtype=np.int64)
    mask = np.array([m for _, ms in docs for m in ms], dtype=np.uint8)
    starts = np.array([int(i == 0) for d, _ in docs for i in range(len(d))], dtype=np.uint8)
    return ids, mask, starts


def encode_item(tok, item, template):
    """One JSONL item -> (ids, mask): a chat through its template; a pair through the template
    as a user/assistant exchange, or as BOS + prompt + response + EOS without one."""
    if item[0] == "pref":
        raise PrepError("the file mixes preference records (chosen/rejected) with other examples")
    if item[0] == "pair":
        if template is None:
            return encode_pair(tok, item[1], item[2])
        item = ("chat", [{"role": "user", "content": item[1]}, {"role": "assistant", "content": item[2]}])
    if template is None:
        raise PrepError("a \"messages\" line needs a chat template: --chat-template chatml|llama2 "
                        "(no chat_template in a tokenizer_config.json beside the tokenizer)")
    return encode_chat(tok, item[1], template)


def looks_like_jsonl(path):
    """Whether the file's first non-blank line is a JSON object of an example (messages, or prompt
    and response)."""
    with open(path, "rb") as f:
        for raw in f:
            if raw.strip():
                try:
                    obj = json.loads(raw)
                except (ValueError, RecursionError):
                    return False
                return isinstance(obj, dict) and ("messages" in obj or "prompt" in obj or "chosen" in obj)
    return False


def input_is_jsonl(path, fmt):
    """--format jsonl or text as given; auto: a name ending in .jsonl, in any case. A file named
    otherwise whose first line is an example object is ambiguous: tokenised as text, its JSON syntax
    and user turns would become targets, silently; refused instead."""
    if fmt != "auto":
        return fmt == "jsonl"
    if os.path.splitext(path)[1].lower() == ".jsonl":
        return True
    if looks_like_jsonl(path):
        raise PrepError(f"{path}: its first line is a JSON example object but its name does not end in .jsonl; "
                        "pass --format jsonl to train on the examples, or --format text to train on the file as text")
    return False


def prepare_docs(tok, path, val_frac, seed, chunk_chars, template=None, utf8_errors="strict", jsonl=None):
    """Return (train docs, val docs) for a text or JSONL file (jsonl: which; None: by its name)."""
    if jsonl is None:
        jsonl = input_is_jsonl(path, "auto")
    if jsonl:
        docs = [encode_item(tok, item, template) for item in read_jsonl(path, utf8_errors)]
        order = list(range(len(docs)))
        random.Random(seed).shuffle(order)
        val_idx = set(order[:n_val_items(len(docs), val_frac)])
        train = [d for i, d in enumerate(docs) if i not in val_idx]
        val = [d for i, d in enumerate(docs) if i in val_idx]
        return train, val
    text = read_text(path, utf8_errors)
    check_line_lengths(path, text, jsonl=False)
    chunks = split_paragraph_chunks(text, chunk_chars)
    docs = encode_text_chunks(tok, chunks)
    n_val = n_val_items(len(docs), val_frac)
    return docs[:len(docs) - n_val], docs[len(docs) - n_val:]


def write_split(prefix, train, val, vocab_size, packed=False):
    """Write PREFIX_train.bin and PREFIX_val.bin (the latter only when val has documents); print
    what went where. packed: instruction examples, so the shards mark where each starts (the
    trainer keeps attention inside one). A failed write (a full disk) names the file and leaves
    neither shard behind."""
    written = []
    for name, docs in (("train", train), ("val", val)):
        path = f"{prefix}_{name}.bin"
        if not docs:
            print(f"{path}: not written (no validation split: --val-frac 0)")
            continue
        ids, mask, starts = concat(docs)
        try:
            shards.write_shard(path, ids, mask, vocab_size, starts if packed else None)
        except OSError as e:
            for p in written:
                os.remove(p)
            raise PrepError(f"{path}: cannot write ({e.strerror or one_line(e)})") from None
        written.append(path)
        print(f"{path}: {len(docs)} docs, {ids.size} tokens, {int(mask.sum())} targets")


def check_targets(path, train, val):
    """Shards without a target train on nothing (and a validation loss of no tokens is no number):
    a chat template that renders no assistant reply does that. Refused before anything is written."""
    for split, docs in (("", train), ("validation ", val)):
        if docs and not any(any(mask) for _, mask in docs):
            raise PrepError(f"{path}: no {split}example has a target (a token trained on): does the chat template "
                            "render the assistant replies?")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose errors are one line (its default prints the usage first, 3-4 lines)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (--help lists the flags)\n")


def parse_args(argv=None):
    ap = OneLineArgumentParser(prog="prepare_text", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokenizer", required=True, help="llama2.c tokenizer.bin or HF tokenizer.json")
    ap.add_argument("--input", required=True, help="text file, or .jsonl of prompt/response")
    ap.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX_{train,val}.bin")
    ap.add_argument("--val-frac", type=float, default=0.1, help="fraction held out (default 0.1)")
    ap.add_argument("--seed", type=int, default=0, help="seed of the JSONL val split")
    ap.add_argument("--chat-template", choices=("auto", "none") + CHAT_TEMPLATES, default="auto",
                    help="JSONL: how conversations become text (auto: the model's own chat_template of the "
                         "tokenizer_config.json beside the tokenizer, rendered as transformers does; none: BOS + "
                         "prompt + response + EOS; chatml, llama2: fixed templates)")
    ap.add_argument("--chunk-chars", type=int, default=4096,
                    help="target characters per plain-text chunk (default 4096)")
    ap.add_argument("--format", choices=("auto", "text", "jsonl"), default="auto",
                    help="what --input holds (auto, the default: JSONL when its name ends in .jsonl in any case; "
                         "a file named otherwise that starts with a JSON example is refused as ambiguous)")
    ap.add_argument("--utf8-errors", choices=("strict", "replace"), default="strict",
                    help="invalid UTF-8 in the input: an error naming the byte offset (strict, the default), "
                         "or substitute U+FFFD (replace)")
    ap.add_argument("--seq", type=int, default=1024,
                    help="preference JSONL: the most tokens of prompt + completion (TRL's max_length; default 1024)")
    args = ap.parse_args(argv)
    if args.seq < 2:
        ap.error(f"--seq must be at least 2, got {args.seq}")
    if not 0 <= args.val_frac < 1:
        ap.error(f"--val-frac must be in [0, 1), got {args.val_frac}")
    if args.chunk_chars < 1:
        ap.error("--chunk-chars must be positive")
    return args


def main(argv=None):
    args = parse_args(argv)
    try:
        tok = load_tokenizer(args.tokenizer)
        refuse_unless_regular(args.input, "a text or .jsonl file")
        if not os.path.isfile(args.input):
            raise PrepError(f"{args.input}: no such input file")
        jsonl = input_is_jsonl(args.input, args.format)
        template = {"auto": None, "none": None}.get(args.chat_template, args.chat_template)
        if args.chat_template == "auto" and jsonl:
            template = load_model_template(args.tokenizer)
            if template:
                check_pieces_encode_alone(tok, args.tokenizer)
        if jsonl:
            items = list(read_jsonl(args.input, args.utf8_errors))
            if items and items[0][0] == "pref":
                main_pairs(args, tok, template, items)
                return 0
        train, val = prepare_docs(tok, args.input, args.val_frac, args.seed, args.chunk_chars, template,
                                  args.utf8_errors, jsonl)
        if not train:
            raise PrepError(f"{args.input}: no text to tokenise")
        check_targets(args.input, train, val)
        if args.val_frac > 0 and not val:
            # an empty val shard would only be refused later by the trainer
            what = "example" if jsonl else f"chunk of --chunk-chars {args.chunk_chars}"
            fix = "more examples" if jsonl else "lower --chunk-chars"
            # chunks are cut at blank lines and line breaks: one line is one chunk whatever --chunk-chars
            if not jsonl and "\n" not in read_text(args.input, args.utf8_errors).strip():
                fix = "the text is one line: break it into lines"
            raise PrepError(f"{args.input}: only {len(train)} {what}, too little for a validation split "
                            f"({fix}, or --val-frac 0 for no validation shard)")
        write_split(args.out, train, val, tok.vocab_size, packed=jsonl)
    except (PrepError, ValueError, OSError) as e:
        print(f"prepare_text: {one_line(e)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
