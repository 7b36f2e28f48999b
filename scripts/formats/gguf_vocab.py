"""The tokenizer of a model directory as llama.cpp's GGUF tokenizer.* metadata (scripts/export/export_gguf.py).

    from gguf_vocab import read_vocab
    vocab = read_vocab(tokenizer_dir, n_vocab, config)   # a Vocab, or VocabError (one line)

Two kinds are written, each exactly or not at all:
- byte-level BPE (tokenizer.json, model BPE): tokenizer.ggml.model "gpt2", the tokens by id, the
  merges as "left right", token types (NORMAL; added special tokens CONTROL, other added tokens
  USER_DEFINED), and tokenizer.ggml.pre, the name llama.cpp gives to the pre-tokenizer that
  tokenizer.json itself describes (PRETOKENIZERS below: its Split regex, or ByteLevel's own
  GPT-2 regex with or without single digits split first). Anything else in tokenizer.json that
  changes the ids and that llama.cpp would not reproduce (another normalizer, byte_fallback,
  ignore_merges outside llama-bpe, a dropout, an unknown pre-tokenizer) is refused.
- SentencePiece-style BPE in tokenizer.json (Llama-2's / Mistral's: BPE with byte_fallback, spaces as
  U+2581 by the normalizer Prepend + Replace or the pre-tokenizer Metaspace): tokenizer.ggml.model
  "llama" (spm_json_vocab below: what llama.cpp's SentencePiece merging needs for the same ids);
- SentencePiece-style (a llama2.c tokenizer.bin): tokenizer.ggml.model "llama", pieces with
  spaces written as U+2581 again, scores, byte tokens <0xXX> typed BYTE, <unk> UNKNOWN and the
  BOS/EOS pieces (llama2.c writes them "\\n<s>\\n", "\\n</s>\\n") CONTROL.
A byte-level tokenizer.bin (what scripts/export/export_llama.py --gguf writes) no longer holds the
merges; a tokenizer.json for it is found with --tokenizer (scripts/export/gguf_tokenizer_json.py
writes one from the original GGUF).

Rows of the embedding past the tokenizer's size (Qwen's 151,936 for 151,665 tokens) get filler
tokens "[PAD<id>]" of type UNUSED, as llama.cpp's converter writes them.
"""
import json
import os
import re

from gguf_llama import (TOKEN_BYTE, TOKEN_CONTROL, TOKEN_NORMAL, TOKEN_UNKNOWN, TOKEN_UNUSED,
                        TOKEN_USER_DEFINED)

# GPT-2's regex, which ByteLevel(use_regex=true) applies (tokenizers' byte_level.rs)
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
                r"|\s*[\r\n]+|\s+(?!\S)|\s+")
QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
               r"|\s*[\r\n]+|\s+(?!\S)|\s+")
# a pre-tokenizer, reduced to a tuple of its steps -> llama.cpp's tokenizer.ggml.pre name
# (src/llama-vocab.cpp of llama.cpp maps each name to the same regexes)
PRETOKENIZERS = {
    (("bytelevel", GPT2_REGEX),): "gpt-2",
    (("digits",), ("bytelevel", GPT2_REGEX)): "smollm",
    (("split", LLAMA3_REGEX), ("bytelevel", None)): "llama-bpe",
    (("split", QWEN2_REGEX), ("bytelevel", None)): "qwen2",
}


class VocabError(Exception):
    """A tokenizer that cannot be written exactly; reported as one line."""


class Vocab:
    def __init__(self, model, tokens, types, scores=None, merges=None, pre=None):
        self.model, self.tokens, self.types = model, tokens, types
        self.scores, self.merges, self.pre = scores, merges, pre
        self.bos = self.eos = self.pad = self.unk = None
        self.add_bos = self.add_eos = False
        self.chat_template = None
        self.filler = 0  # [PAD<id>] tokens appended
        self.add_space_prefix = None  # tokenizer.ggml.add_space_prefix where the tokenizer says it


# ---------------------------------------------------------------------------------------------
# tokenizer.json

def _regex_of(step, path):
    pattern = step.get("pattern") or {}
    if "Regex" not in pattern:
        raise VocabError(f"{path}: pre-tokenizer Split on a plain string {pattern!r}: not a regex llama.cpp knows")
    if step.get("behavior") not in ("Isolated", None) or step.get("invert"):
        raise VocabError(f"{path}: pre-tokenizer Split with behavior {step.get('behavior')!r} "
                         f"invert {step.get('invert')!r}: only Isolated splits are written")
    return pattern["Regex"]


def _pretokenizer_steps(pre, path):
    steps = pre.get("pretokenizers", []) if pre.get("type") == "Sequence" else [pre]
    out = []
    for s in steps:
        kind = s.get("type")
        if kind == "ByteLevel":
            if s.get("add_prefix_space"):
                raise VocabError(f"{path}: ByteLevel add_prefix_space true is not written (llama.cpp adds no space)")
            out.append(("bytelevel", GPT2_REGEX if s.get("use_regex", True) else None))
        elif kind == "Digits" and s.get("individual_digits"):
            out.append(("digits",))
        elif kind == "Split":
            out.append(("split", _regex_of(s, path)))
        else:
            raise VocabError(f"{path}: pre-tokenizer step {kind!r} {json.dumps(s)[:80]} is not one llama.cpp "
                             "reproduces")
    return tuple(out)


def pretokenizer_name(tj, path):
    """llama.cpp's tokenizer.ggml.pre for tokenizer.json's pre_tokenizer, or VocabError."""
    pre = tj.get("pre_tokenizer")
    if not pre:
        raise VocabError(f"{path}: no pre_tokenizer: a byte-level BPE without one is not written")
    steps = _pretokenizer_steps(pre, path)
    if steps not in PRETOKENIZERS:
        shown = "; ".join(s[0] + (f" {s[1]!r}" if len(s) > 1 and s[1] else "") for s in steps)
        raise VocabError(f"{path}: pre-tokenizer [{shown[:200]}] is not one whose llama.cpp name is known "
                         f"(known: {', '.join(sorted(PRETOKENIZERS.values()))})")
    return PRETOKENIZERS[steps]


def _check_bpe_model(m, pre, path):
    if m.get("type") != "BPE":
        raise VocabError(f"{path}: tokenizer model {m.get('type')!r}: only BPE (byte-level) is written")
    if m.get("dropout") or m.get("continuing_subword_prefix") or m.get("end_of_word_suffix"):
        raise VocabError(f"{path}: BPE dropout / subword prefix / end-of-word suffix are not written")
    if bool(m.get("ignore_merges")) != (pre == "llama-bpe"):
        raise VocabError(f"{path}: ignore_merges {bool(m.get('ignore_merges'))} with pre-tokenizer {pre}: "
                         "llama.cpp ignores merges for llama-bpe only")


def _check_normalizer(tj, path):
    norm = tj.get("normalizer")
    if norm and norm.get("type") != "NFC":
        raise VocabError(f"{path}: normalizer {norm.get('type')!r} is not written (llama.cpp does not apply it)")
    if norm:  # Qwen2's: llama.cpp's converter writes it off too; NFC text (almost all text) is unaffected
        print(f"note: {path}: the NFC normalizer is not applied by llama.cpp; text already in NFC "
              "tokenizes the same")


def _check_added(added, path):
    """GGUF keeps no per-token whitespace stripping (llama.cpp sets it by model name only): refused."""
    for i, a in sorted(added.items()):
        if a.get("lstrip") or a.get("rstrip") or a.get("single_word"):
            raise VocabError(f"{path}: added token {i} {a['content']!r} strips whitespace or matches single words "
                             "(lstrip/rstrip/single_word), which GGUF cannot express")


def _token_table(tj, m, path):
    """(by_id, added, tokens) of a tokenizer.json: the model's vocabulary with the added tokens over it
    (refused where one differs from the vocabulary's), and the token of every id up to the largest, ids
    no token has (gaps) as filler tokens, as rows past the end are (add_filler); two ids sharing one
    string are refused."""
    by_id = {int(i): t for t, i in (m.get("vocab") or {}).items()}
    added = {int(a["id"]): a for a in tj.get("added_tokens") or []}
    _check_added(added, path)
    for i, a in added.items():
        if by_id.get(i, a["content"]) != a["content"]:
            raise VocabError(f"{path}: added token {i} {a['content']!r} differs from the vocabulary's {by_id[i]!r}")
        by_id[i] = a["content"]
    n = max(by_id) + 1 if by_id else 0
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(n)]
    if len(set(tokens)) != n:
        raise VocabError(f"{path}: two ids share one token string: not expressible in GGUF")
    return by_id, added, tokens


def _merges(m, path):
    out = []
    for r, mg in enumerate(m.get("merges") or []):
        a, b = (mg.split(" ", 1) if isinstance(mg, str) else mg)
        if " " in a or " " in b:
            raise VocabError(f"{path}: merge {r} {mg!r} has a space inside a token: not expressible as GGUF's "
                             "\"left right\" merges")
        out.append(f"{a} {b}")
    return out


def bpe_vocab(path):
    """A Vocab from tokenizer.json at path (byte-level BPE), without filler tokens."""
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    m = tj.get("model") or {}
    pre = pretokenizer_name(tj, path)
    _check_bpe_model(m, pre, path)
    _check_normalizer(tj, path)
    by_id, added, tokens = _token_table(tj, m, path)
    n = len(tokens)
    types = [TOKEN_NORMAL if i in by_id else TOKEN_UNUSED for i in range(n)]
    for i, a in added.items():
        types[i] = TOKEN_CONTROL if a.get("special") else TOKEN_USER_DEFINED
    v = Vocab("gpt2", tokens, types, merges=_merges(m, path), pre=pre)
    v.post_processor = tj.get("post_processor")
    return v


def _template_ends(pp, path, id_of):
    """(first, last) special token ids that a TemplateProcessing's single template adds, or None each."""
    if not pp:
        return None, None
    if pp.get("type") == "Sequence":
        steps = [p for p in pp.get("processors", []) if p.get("type") != "ByteLevel"]
        if len(steps) > 1:
            raise VocabError(f"{path}: post_processor with several templates is not written")
        pp = steps[0] if steps else None
        if not pp:
            return None, None
    if pp.get("type") == "ByteLevel":
        return None, None
    if pp.get("type") != "TemplateProcessing":
        raise VocabError(f"{path}: post_processor {pp.get('type')!r} is not written")
    single = pp.get("single") or []
    specials = [s["SpecialToken"]["id"] for s in single if "SpecialToken" in s]
    seq = [i for i, s in enumerate(single) if "Sequence" in s]
    if len(seq) != 1 or len(specials) != len(single) - 1 or len(specials) > 2:
        raise VocabError(f"{path}: post_processor template {json.dumps(single)[:80]} is not BOS? $A EOS?")
    first = id_of(single[0]["SpecialToken"]["id"]) if seq[0] > 0 else None
    last = id_of(single[-1]["SpecialToken"]["id"]) if seq[0] < len(single) - 1 else None
    return first, last


# ---------------------------------------------------------------------------------------------
# SentencePiece-style tokenizer.json (BPE with byte_fallback)
#
# llama.cpp's "llama" tokenizer (llm_tokenizer_spm in its src/llama-vocab.cpp) writes every space as U+2581
# (with one before the text and after each special token when add_space_prefix), splits the text into
# characters and merges, again and again, the adjacent pair whose concatenation is a token, the one of the
# highest score first (leftmost among equals); a character that is no token ends as its UTF-8 bytes <0xXX>.
# The `tokenizers` library's BPE merges the adjacent pair of the lowest merge rank first, and only pairs
# listed as merges. Scores -rank(first merge making the token) give the same ids when
#   - every split of a token into two tokens (or single characters) is one of the merges (a merge llama.cpp
#     would find, the library must find too: true of the merges converted from a SentencePiece model),
#   - the merges making one token have consecutive ranks (no other merge ranks between them), and
#   - two of them that can overlap (x+y = y+z = token) rank the left one first (llama.cpp goes leftmost).
# Anything else is refused.

SPACE = "\u2581"
REPLACE_SPACE = {"type": "Replace", "pattern": {"String": " "}, "content": SPACE}


def _byte_fallback(path):
    with open(path, encoding="utf-8") as f:
        return bool((json.load(f).get("model") or {}).get("byte_fallback"))


def _space_prefix(tj, path):
    """tokenizer.ggml.add_space_prefix for tokenizer.json's way of writing spaces as U+2581, or VocabError."""
    norm, pre = tj.get("normalizer"), tj.get("pre_tokenizer")
    steps = norm.get("normalizers", []) if norm and norm.get("type") == "Sequence" else [norm] if norm else []
    prepend = {"type": "Prepend", "prepend": SPACE}
    if pre is None and steps in ([REPLACE_SPACE], [prepend, REPLACE_SPACE], [REPLACE_SPACE, prepend]):
        return prepend in steps  # Llama-2's: U+2581 before every piece of text (around special tokens too)
    if steps == [] and pre and pre.get("type") == "Metaspace" and pre.get("replacement") == SPACE:
        scheme = pre.get("prepend_scheme", "always" if pre.get("add_prefix_space", True) else "never")
        if pre.get("split"):
            raise VocabError(f"{path}: Metaspace with split true is not written (llama.cpp splits no words)")
        if scheme == "never":
            return False
        # "first" puts no U+2581 after a special token, and no scheme one before text that starts with a space;
        # llama.cpp (add_space_prefix) does both
        raise VocabError(f"{path}: Metaspace prepend_scheme {scheme!r} is not written: it adds U+2581 where "
                         "llama.cpp does not (and the reverse), which changes the ids; only \"never\" is")
    raise VocabError(f"{path}: a byte_fallback BPE whose normalizer {json.dumps(norm)[:80]} / pre-tokenizer "
                     f"{json.dumps(pre)[:80]} does not write spaces as U+2581 the way llama.cpp does")


def _merge_groups(merges, id_of, path):
    """{token: (first rank, last rank)} of the merges making it, checked to be consecutive."""
    groups = {}
    for r, (a, b) in enumerate(merges):
        t = a + b
        if a not in id_of or b not in id_of or t not in id_of:
            raise VocabError(f"{path}: merge {r} {a!r} {b!r}: a part or the result is not a token")
        lo, hi = groups.get(t, (r, r - 1))
        if hi != r - 1:
            raise VocabError(f"{path}: the merges making {t!r} are not consecutive (ranks {hi} and {r}): "
                             "llama.cpp's SentencePiece scores cannot order them")
        groups[t] = (lo, r)
    return groups


def _check_splits(tokens, id_of, pairs, path):
    """Every split llama.cpp could merge is a merge, and overlapping ones of a token rank left first."""
    for t in tokens:
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if (a in id_of or len(a) == 1) and (b in id_of or len(b) == 1) and (a, b) not in pairs:
                raise VocabError(f"{path}: {a!r} + {b!r} make the token {t!r} but are not a merge: llama.cpp's "
                                 "SentencePiece tokenizer would merge them (merges not converted from SentencePiece)")
            z = t[len(b):]  # x y z with x + y = y + z = t, x = a, y = b
            if t.startswith(b) and (a, b) in pairs and pairs.get((b, z), len(pairs)) < pairs[(a, b)]:
                raise VocabError(f"{path}: the merges {b!r}+{z!r} and {a!r}+{b!r} of {t!r} overlap with the "
                                 "right one first: llama.cpp merges the left one")


def spm_json_vocab(path):
    """A Vocab (tokenizer.ggml.model "llama") from a SentencePiece-style tokenizer.json, or VocabError."""
    with open(path, encoding="utf-8") as f:
        tj = json.load(f)
    m = tj.get("model") or {}
    if m.get("type") != "BPE" or m.get("dropout") or m.get("continuing_subword_prefix") \
            or m.get("end_of_word_suffix") or m.get("ignore_merges"):
        raise VocabError(f"{path}: byte_fallback with a model other than plain BPE (dropout, subword prefix, "
                         "end-of-word suffix, ignore_merges) is not written")
    space_prefix = _space_prefix(tj, path)
    by_id, added, tokens = _token_table(tj, m, path)
    n = len(tokens)
    id_of = {t: i for i, t in enumerate(tokens)}
    if any(f"<0x{b:02X}>" not in id_of for b in range(256)):
        raise VocabError(f"{path}: byte_fallback without all 256 <0xXX> byte tokens is not written")
    merges = [tuple(mg.split(" ", 1)) if isinstance(mg, str) else tuple(mg) for mg in m.get("merges") or []]
    groups = _merge_groups(merges, id_of, path)
    pairs = {p: r for r, p in enumerate(merges)}
    _check_splits([by_id[i] for i in sorted(by_id)], id_of, pairs, path)
    types = [TOKEN_NORMAL if i in by_id else TOKEN_UNUSED for i in range(n)]
    for i, t in enumerate(tokens):
        if BYTE_PIECE.fullmatch(t):
            types[i] = TOKEN_BYTE
    for i, a in added.items():
        types[i] = TOKEN_CONTROL if a.get("special") else TOKEN_USER_DEFINED
    unk = id_of.get(m.get("unk_token")) if m.get("unk_token") else None
    if unk is not None:
        types[unk] = TOKEN_UNKNOWN
    # a token no merge makes is never the result of llama.cpp's merging either (_check_splits): its score is unused
    scores = [-float(groups[t][0]) if t in groups else 0.0 for t in tokens]
    v = Vocab("llama", tokens, types, scores=scores)
    v.unk, v.add_space_prefix, v.post_processor = unk, space_prefix, tj.get("post_processor")
    return v


# ---------------------------------------------------------------------------------------------
# llama2.c tokenizer.bin (SentencePiece)

LLAMA2C_SPECIAL = {b"\n<s>\n": "<s>", b"\n</s>\n": "</s>"}
BYTE_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


def sentencepiece_vocab(path, block):
    """A Vocab from a llama2.c tokenizer.bin (block: the tokenizer_bin entry of tokenizer_config.json)."""
    from llama2c_tokenizer import read_tokenizer_bin
    pieces, scores, _ = read_tokenizer_bin(path)
    bos, eos = int(block.get("bos_id", 1)), int(block.get("eos_id", 2))
    tokens, types = [], []
    for i, p in enumerate(pieces):
        try:
            text = LLAMA2C_SPECIAL.get(p) or p.decode("utf-8")
        except UnicodeDecodeError:
            raise VocabError(f"{path}: piece {i} {p!r} is not UTF-8: not expressible as a GGUF token") from None
        tokens.append(text.replace(" ", "\u2581"))
        kind = TOKEN_NORMAL
        if i == 0 and text == "<unk>":
            kind = TOKEN_UNKNOWN
        elif i in (bos, eos):
            kind = TOKEN_CONTROL
        elif BYTE_PIECE.fullmatch(text):
            kind = TOKEN_BYTE
        types.append(kind)
    if sum(BYTE_PIECE.fullmatch(t) is not None for t in tokens) != 256:
        raise VocabError(f"{path}: a SentencePiece vocabulary without all 256 <0xXX> byte tokens is not written")
    v = Vocab("llama", tokens, types, scores=[float(s) for s in scores])
    v.bos, v.eos, v.unk = bos, eos, 0 if types[0] == TOKEN_UNKNOWN else None
    v.add_bos = bool(block.get("add_bos", True))
    return v


# ---------------------------------------------------------------------------------------------
# special tokens, chat template, filler

def _token_text(t):
    return t.get("content") if isinstance(t, dict) else t


def _special_ids(v, tc, config, path):
    """BOS / EOS / PAD ids: tokenizer_config.json's token strings first, then config.json's ids."""
    id_of = {t: i for i, t in enumerate(v.tokens)}
    for key in ("bos", "eos", "pad", "unk"):
        text = _token_text(tc.get(f"{key}_token"))
        if text is not None:
            if text not in id_of:
                raise VocabError(f"{path}: {key}_token {text!r} is not in the vocabulary")
            setattr(v, key, id_of[text])
        elif getattr(v, key) is None and config.get(f"{key}_token_id") is not None:
            ids = config[f"{key}_token_id"]
            setattr(v, key, int(ids[0] if isinstance(ids, list) else ids))
    return id_of


def _add_bos_eos(v, tc, path, id_of):
    """add_bos / add_eos: tokenizer_config.json's flags, else what tokenizer.json's post-processor adds."""
    if not hasattr(v, "post_processor"):
        return  # a llama2.c tokenizer.bin: its tokenizer_bin block said add_bos
    first, last = _template_ends(getattr(v, "post_processor", None), path, lambda t: id_of[t])
    if first is not None and v.bos is not None and first != v.bos:
        raise VocabError(f"{path}: the post-processor adds token {first}, not the BOS {v.bos}")
    if first is not None and v.bos is None:
        v.bos = first
    v.add_bos = bool(tc.get("add_bos_token", first is not None))
    v.add_eos = bool(tc.get("add_eos_token", last is not None))


def _chat_template(tok_dir, tc, path):
    jinja = os.path.join(tok_dir, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            return f.read()
    t = tc.get("chat_template")
    if isinstance(t, list):  # [{"name": ..., "template": ...}]: the default one
        named = {e.get("name"): e.get("template") for e in t}
        if "default" not in named:
            raise VocabError(f"{path}: chat_template is a list without a \"default\" entry")
        t = named["default"]
    return t


def add_filler(v, n_vocab, path):
    """Pad to the embedding's rows with [PAD<id>] tokens of type UNUSED."""
    n = len(v.tokens)
    if n > n_vocab:
        raise VocabError(f"{path}: {n} tokens but the embedding has only {n_vocab} rows")
    v.tokens = v.tokens + [f"[PAD{i}]" for i in range(n, n_vocab)]
    v.types = v.types + [TOKEN_UNUSED] * (n_vocab - n)
    if v.scores is not None:
        v.scores = v.scores + [0.0] * (n_vocab - n)
    if len(set(v.tokens)) != n_vocab:
        raise VocabError(f"{path}: a filler token [PAD<id>] is already a token of the vocabulary")
    v.filler = n_vocab - n


def read_vocab(tok_dir, n_vocab, config):
    """The Vocab of the tokenizer files in tok_dir for an embedding of n_vocab rows."""
    tc_path = os.path.join(tok_dir, "tokenizer_config.json")
    tc = {}
    if os.path.isfile(tc_path):
        with open(tc_path, encoding="utf-8") as f:
            tc = json.load(f)
    tj, tb = os.path.join(tok_dir, "tokenizer.json"), os.path.join(tok_dir, "tokenizer.bin")
    block = tc.get("tokenizer_bin")
    if os.path.isfile(tb) and (not block or block.get("type") == "sentencepiece"):
        v, path = sentencepiece_vocab(tb, block or {}), tb
    elif os.path.isfile(tj):
        v, path = (spm_json_vocab(tj) if _byte_fallback(tj) else bpe_vocab(tj)), tj
    elif os.path.isfile(tb):
        raise VocabError(f"{tb}: a byte-level tokenizer.bin keeps no merges; pass --tokenizer DIR with the "
                         "tokenizer.json (scripts/export/gguf_tokenizer_json.py writes it from the original GGUF)")
    else:
        raise VocabError(f"{tok_dir}: neither tokenizer.json nor tokenizer.bin")
    id_of = _special_ids(v, tc, config, tc_path if tc else path)
    _add_bos_eos(v, tc, path, id_of)
    v.chat_template = _chat_template(tok_dir, tc, tc_path)
    add_filler(v, n_vocab, path)
    return v


def add_to_writer(w, v):
    """Write the Vocab into a gguf.GGUFWriter as tokenizer.ggml.* and tokenizer.chat_template."""
    w.add_tokenizer_model(v.model)
    if v.pre:
        w.add_tokenizer_pre(v.pre)
    w.add_token_list(v.tokens)
    w.add_token_types(v.types)
    if v.scores is not None:
        w.add_token_scores(v.scores)
    if v.merges is not None:
        w.add_token_merges(v.merges)
    if v.add_space_prefix is not None:
        w.add_add_space_prefix(v.add_space_prefix)
    for key, add in (("bos", w.add_bos_token_id), ("eos", w.add_eos_token_id), ("pad", w.add_pad_token_id),
                     ("unk", w.add_unk_token_id)):
        if getattr(v, key) is not None:
            add(getattr(v, key))
    w.add_add_bos_token(v.add_bos)
    w.add_add_eos_token(v.add_eos)
    if v.chat_template:
        w.add_chat_template(v.chat_template)
