"""A source scan for index arithmetic that can overflow 32 bits: every product of two int-typed
operands (variables and parameters declared `int`, AttnShape's and AttnTiles' int fields, CUDA's
blockIdx/blockDim/threadIdx/gridDim, int literals and upper-case macros) in the attention kernels.

A product is accepted when its left chain (the factors before it at the same precedence, `a * b`
of `a * b * c`) holds a 64-bit or floating operand: an `(int64_t)` / `(size_t)` / `(double)` /
`(float)` cast, a name declared int64_t / size_t / float / double, or a float literal; when a
factor is a constant (a tile size of at most 128 times an index below T, as in `blockIdx.x *
ATT_ROWS`: below 2^31 up to T = 2^24); or when its line carries a `// int:` comment saying why it
stays small (e.g. `s.H * s.hd`, a row's width). test_attention_long.py runs it on the attention sources and
on a planted line.
"""
import re

INT_FIELDS = {"T", "H", "KVH", "hd", "B", "causal", "rows", "keys", "x", "y", "z"}
CUDA_BUILTINS = {"blockIdx", "blockDim", "threadIdx", "gridDim"}
WIDE_TYPES = r"(?:int64_t|size_t|double|float|uint64_t|long long)"
TYPE_WORDS = {"float", "int", "bf16", "void", "char", "double", "int64_t", "size_t", "uint8_t", "const", "AttnShape",
              "AttnTiles", "AttnGemmWork", "AttnRun", "AttnBwdArgs", "unsigned", "uint64_t", "__restrict__", "auto",
              "return", "case", "vx_f8", "AttnOperandSet", "AttnBases", "AttnWorkParts", "AttnOperand", "void*",
              "cudaStream_t", "MatmulForm", "dim3", "MaxLoc", "sizeof"}
TOKEN = re.compile(r"\d+\.\d*f?|\d+[uUlL]*|[A-Za-z_]\w*|->|<<|>>|[^\s\w]")


def strip(src):
    """The source without comments and strings, line structure kept; `// int:` lines remembered."""
    allowed, out = set(), []
    for n, line in enumerate(src.split("\n"), 1):
        if re.search(r"//\s*int:", line):
            allowed.add(n)
        out.append(line)
    text = "\n".join(out)
    text = re.sub(r"/\*.*?\*/", lambda m: re.sub(r"[^\n]", " ", m.group(0)), text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    text = re.sub(r'"(?:\\.|[^"\\])*"', '""', text)
    return text, allowed


def declared(body):
    """Names declared int, and names declared with a wide or floating type, in one top-level item."""
    ints, wide = set(), set()
    for m in re.finditer(r"(?<![\w])(int|" + WIDE_TYPES + r")\s*\**\s+(\w+)|(?<![\w])(int|" + WIDE_TYPES +
                         r")\s*\*\s*(\w+)", body):
        typ, name = (m.group(1), m.group(2)) if m.group(1) else (m.group(3), m.group(4))
        target = ints if typ == "int" and "*" not in m.group(0) else wide
        target.add(name)
        # the declarators after the first, at paren depth 0 up to the ';' (not in parameter lists)
        depth, i, seg_start = 0, m.end(), m.end()
        while i < len(body) and body[i] != ";":
            c = body[i]
            if c in "([{":
                depth += 1
            elif c in ")]}":
                depth -= 1
                if depth < 0:
                    break
            elif c == "," and depth == 0:
                nm = re.match(r"\s*(\**)\s*(\w+)", body[i + 1:])
                if nm and nm.group(2) not in TYPE_WORDS:
                    (ints if typ == "int" and not nm.group(1) else wide).add(nm.group(2))
            i += 1
    return ints - wide, wide


def items(text):
    """Top-level items (functions, structs) with their first line number: split where braces close."""
    depth, start, line, start_line = 0, 0, 1, 1
    for i, c in enumerate(text):
        if c == "\n":
            line += 1
        elif c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                yield start_line, text[start:i + 1]
                start, start_line = i + 1, line
    yield start_line, text[start:]


def primary_kind(tokens, ints, wide):
    """'wide', 'int', 'const' or 'other' for one primary's tokens (a name chain, a number, a group)."""
    if not tokens:
        return "other"
    joined = " ".join(tokens)
    if re.search(r"\(\s*" + WIDE_TYPES + r"\s*\)", joined) or any(t in wide for t in tokens):
        return "wide"
    if any(re.fullmatch(r"\d+\.\d*f?", t) for t in tokens):
        return "wide"
    if tokens[0] == "(":  # a group: int if it holds an int name, field or builtin
        inner = [t for t in tokens if re.fullmatch(r"[A-Za-z_]\w*", t)]
        if any(t in ints or t in CUDA_BUILTINS for t in inner):
            return "int"
        return "const" if all(t.isupper() or t in INT_FIELDS for t in inner) and inner else "other"
    if re.fullmatch(r"\d+[uUlL]*", tokens[0]):
        return "wide" if re.search(r"[lL]", tokens[0]) else "const"
    if tokens[0] in CUDA_BUILTINS:
        return "int"
    if len(tokens) >= 3 and tokens[-2] in (".", "->") and tokens[-1] in INT_FIELDS:
        return "int"
    if len(tokens) == 1 and tokens[0] in ints:
        return "int"
    if len(tokens) == 1 and re.fullmatch(r"[A-Z][A-Z0-9_]+", tokens[0]):
        return "const"
    return "other"


def primary_before(toks, j):
    """The primary ending at token j (inclusive): (start index, tokens)."""
    if toks[j] in (")", "]"):
        close, opn, depth, i = toks[j], "(" if toks[j] == ")" else "[", 0, j
        while i >= 0:
            depth += toks[i] == close
            depth -= toks[i] == opn
            if depth == 0:
                break
            i -= 1
        if toks[j] == "]" or (i > 0 and re.fullmatch(r"\w+", toks[i - 1]) and toks[i - 1] not in TYPE_WORDS):
            s, _ = primary_before(toks, i - 1)  # an index or a call: x[...] / f(...)
            return s, ["call"]
        # a cast in front: (int64_t) name
        if i > 0 and toks[i - 1] == ")" and re.fullmatch(r"\(\w+\)", "".join(toks[i - 3:i])):
            return i - 3, toks[i - 3:j + 1]
        return i, toks[i:j + 1]
    i = j
    while i >= 2 and toks[i - 1] in (".", "->") and re.fullmatch(r"\w+", toks[i - 2]):
        i -= 2
    if i >= 3 and toks[i - 1] == ")" and toks[i - 3] == "(" and re.fullmatch(r"\w+", toks[i - 2]):
        return i - 3, toks[i - 3:j + 1]  # (int64_t)b
    if i >= 4 and toks[i - 4:i] == ["(", "long", "long", ")"]:
        return i - 4, toks[i - 4:j + 1]
    return i, toks[i:j + 1]


def primary_after(toks, j):
    if j >= len(toks):
        return []
    if toks[j] == "(":
        depth, i = 0, j
        while i < len(toks):
            depth += toks[i] == "("
            depth -= toks[i] == ")"
            if depth == 0:
                break
            i += 1
        inner = toks[j:i + 1]
        if re.fullmatch(r"\(\w+\)", "".join(inner)) and i + 1 < len(toks):  # a cast: (int64_t)x
            return inner + primary_after(toks, i + 1)
        return inner
    i = j
    while i + 2 < len(toks) and toks[i + 1] in (".", "->"):
        i += 2
    if i + 1 < len(toks) and toks[i + 1] in ("[", "("):
        return ["call"]
    return toks[j:i + 1]


def scan(src):
    """[(line, text)] of the int x int products of a source text."""
    text, allowed = strip(src)
    found = []
    for first_line, body in items(text):
        ints, wide = declared(body)
        for k, line in enumerate(body.split("\n")):
            n = first_line + k
            if n in allowed:
                continue
            toks = TOKEN.findall(line)
            for j, t in enumerate(toks):
                if t != "*" or j == 0 or j + 1 >= len(toks):
                    continue
                if not re.fullmatch(r"\w+|\)|\]", toks[j - 1]) or toks[j - 1] in TYPE_WORDS:
                    continue  # a pointer declaration or a dereference
                if toks[j + 1] in ("=", ")", ",", ";", "*"):
                    continue  # *= or a type like float*)
                # the left chain: primaries joined by * / % at the same precedence
                kinds, end = [], j - 1
                while end >= 0:
                    s, ptoks = primary_before(toks, end)
                    kinds.append(primary_kind(ptoks, ints, wide))
                    if s >= 2 and toks[s - 1] in ("*", "/", "%") and re.fullmatch(r"[\w.]+|\)|\]", toks[s - 2]) \
                            and toks[s - 2] not in TYPE_WORDS:
                        end = s - 2
                        continue
                    break
                right = primary_kind(primary_after(toks, j + 1), ints, wide)
                if "wide" in kinds or "other" in kinds or right in ("wide", "other"):
                    continue
                if "const" in kinds or right == "const":
                    continue  # a constant factor (a tile size) times an index below T: see the docstring
                found.append((n, line.strip()))
                break
    return found
