"""scripts/formats/chat_template.py: renders a model's chat template (the Jinja text in its
tokenizer_config.json) in the subset of Jinja that LLaMA-family templates use, as
transformers' apply_chat_template does (trim_blocks, lstrip_blocks, no trailing newline).
llmc/chat_template.h is the C twin; test/test_chat_template.py checks both against transformers.

    render(source, messages, add_generation_prompt, bos_token="", eos_token="", name="template")

The subset: text, {{ expr }}, {% if/elif/else/endif %}, {% for x in expr %}...{% endfor %} (with
loop.index, index0, first, last, length), {% set name = expr %}, {# comments #}, whitespace
control ({%- -%} {{- -}}). Expressions: string, integer, true/false/none literals, list
literals, names, x.attr, x[i], list[a:b], + - * // % ~, == != < > <= >=, in, not in, and, or, not,
a if c else b, `is [not] defined|undefined|none|string|number`, filters trim, length,
string, first, last (of lists), the string methods strip, lstrip, rstrip, startswith, endswith, and
raise_exception(msg). Integer arithmetic only (no /), list slicing only. Anything else is a
ChatTemplateError naming the construct, never a guess: statements outside the subset when the
template is read; filters, tests and calls outside it (with keyword arguments too) when reached,
so a template keeping them in branches a conversation never takes (Llama-3.1's tool calling)
renders.
"""


class ChatTemplateError(Exception):
    """A template outside the subset, or one that raised; the message is one line."""


class _Undefined:
    def __repr__(self):
        return "Undefined"


UNDEF = _Undefined()
FILTERS = ("trim", "length", "count", "string", "first", "last")
TESTS = ("defined", "undefined", "none", "string", "number")
METHODS = ("strip", "lstrip", "rstrip", "startswith", "endswith")


# ---- lexing: the template into text and tags -------------------------------------------------

def _lex(src, name):
    """[("text", s) | ("out", tokens) | ("stmt", tokens)], with Jinja's whitespace rules applied."""
    src = src.replace("\r\n", "\n")
    if src.endswith("\n"):
        src = src[:-1]  # keep_trailing_newline=False
    parts, pos, trim_next = [], 0, False
    while True:
        starts = [i for i in (src.find("{{", pos), src.find("{%", pos), src.find("{#", pos)) if i >= 0]
        at = min(starts) if starts else len(src)
        text = src[pos:at]
        line_starting = pos == 0
        if trim_next == "all":
            text = text.lstrip()
        elif trim_next == "nl" and text.startswith("\n"):
            text = text[1:]
            line_starting = True
        if at == len(src):
            parts.append(("text", text))
            return parts
        kind = src[at + 1]
        j = at + 2
        mod = src[j] if j < len(src) and src[j] in "-+" else ""
        if mod:
            j += 1
        if mod == "-":
            text = text.rstrip()
        elif kind in "%#" and mod != "+":  # lstrip_blocks: spaces from the line start to a tag
            line_start = text.rfind("\n") + 1
            if (line_start > 0 or line_starting) and text[line_start:].strip(" \t") == "":
                text = text[:line_start]  # the tag is alone on its line so far
        parts.append(("text", text))
        if kind == "#":
            end = src.find("#}", j)
            if end < 0:
                raise ChatTemplateError(f"{name}: unterminated comment at offset {at}")
            close_mod = src[end - 1] if src[end - 1] in "-+" and end - 1 >= j else ""
            pos = end + 2
        else:
            toks, pos, close_mod = _tokens(src, j, "}" if kind == "{" else "%", name)
            parts.append(("out" if kind == "{" else "stmt", toks))
        trim_next = "all" if close_mod == "-" else "nl" if kind in "%#" and close_mod != "+" else False


OPS = ("//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "|", ".", ",", ":",
       "(", ")", "[", "]", "=")
ESC = {"n": "\n", "t": "\t", "r": "\r", "\\": "\\", "'": "'", '"': '"', "0": "\0"}


def _tokens(src, i, closer, name):
    """Tokens of one tag from src[i] to its closer; returns (tokens, position after, '-'|'+'|'')."""
    toks = []
    while True:
        while i < len(src) and src[i] in " \t\n\r":
            i += 1
        if i >= len(src):
            raise ChatTemplateError(f"{name}: unterminated tag at end of template")
        for mod in ("-", "+", ""):
            if src.startswith(mod + closer + "}", i):
                return toks, i + len(mod) + 2, mod
        c = src[i]
        if c in "'\"":
            out, i = [], i + 1
            while i < len(src) and src[i] != c:
                if src[i] == "\\":
                    e = src[i + 1] if i + 1 < len(src) else ""
                    if e == "u" and len(src) >= i + 6:
                        hexa = src[i + 2:i + 6]
                        if not all(h in "0123456789abcdefABCDEF" for h in hexa):
                            raise ChatTemplateError(f"{name}: bad \\u escape at offset {i}")
                        if 0xD800 <= int(hexa, 16) < 0xE000:
                            raise ChatTemplateError(f"{name}: unsupported construct: surrogate \\u escape at offset {i}")
                        out.append(chr(int(hexa, 16)))
                        i += 6
                        continue
                    if e not in ESC:
                        raise ChatTemplateError(f"{name}: unsupported escape \\{e} in a string at offset {i}")
                    out.append(ESC[e])
                    i += 2
                    continue
                out.append(src[i])
                i += 1
            if i >= len(src):
                raise ChatTemplateError(f"{name}: unterminated string at end of template")
            toks.append(("str", "".join(out)))
            i += 1
        elif c.isdigit():
            j = i
            while j < len(src) and src[j].isdigit():
                j += 1
            if j < len(src) and src[j] == "." and j + 1 < len(src) and src[j + 1].isdigit():
                raise ChatTemplateError(f"{name}: unsupported construct: floating-point number at offset {i}")
            toks.append(("int", int(src[i:j])))
            i = j
        elif c.isalpha() or c == "_":
            j = i
            while j < len(src) and (src[j].isalnum() or src[j] == "_"):
                j += 1
            toks.append(("name", src[i:j]))
            i = j
        else:
            op = next((o for o in OPS if src.startswith(o, i)), None)
            if op is None:
                raise ChatTemplateError(f"{name}: unsupported construct: character {c!r} at offset {i}")
            toks.append(("op", op))
            i += len(op)


# ---- parsing: tokens into a tree --------------------------------------------------------------

class _Parser:
    """Recursive descent over one tag's tokens, Jinja's precedence: condexpr < or < and < not <
    comparisons < + - < ~ < * / // % < unary - < primary with .attr [i] (call) | filter is test."""

    def __init__(self, toks, name):
        self.t, self.i, self.name = toks, 0, name

    def peek(self, kind=None, val=None, k=0):
        if self.i + k >= len(self.t):
            return None
        tk = self.t[self.i + k]
        if (kind and tk[0] != kind) or (val is not None and tk[1] != val):
            return None
        return tk

    def take(self, kind=None, val=None):
        tk = self.peek(kind, val)
        if tk:
            self.i += 1
        return tk

    def need(self, kind, val=None):
        tk = self.take(kind, val)
        if not tk:
            got = self.t[self.i][1] if self.i < len(self.t) else "end of tag"
            raise ChatTemplateError(f"{self.name}: expected {val or kind}, got {got!r}")
        return tk

    def done(self):
        if self.i < len(self.t):
            raise ChatTemplateError(f"{self.name}: unsupported construct: unexpected {self.t[self.i][1]!r}")

    def expr(self):
        e = self.or_()
        if self.take("name", "if"):
            cond = self.or_()
            other = self.expr() if self.take("name", "else") else ("lit", UNDEF)
            return ("cond", cond, e, other)
        return e

    def or_(self):
        e = self.and_()
        while self.take("name", "or"):
            e = ("or", e, self.and_())
        return e

    def and_(self):
        e = self.not_()
        while self.take("name", "and"):
            e = ("and", e, self.not_())
        return e

    def not_(self):
        if self.take("name", "not"):
            return ("not", self.not_())
        return self.compare()

    def compare(self):
        e = self.add()
        while True:
            tk = self.peek("op")
            if tk and tk[1] in ("==", "!=", "<", ">", "<=", ">="):
                self.i += 1
                e = ("bin", tk[1], e, self.add())
            elif self.take("name", "in"):
                e = ("bin", "in", e, self.add())
            elif self.peek("name", "not") and self.peek("name", "in", 1):
                self.i += 2
                e = ("not", ("bin", "in", e, self.add()))
            else:
                return e

    def add(self):
        e = self.concat()
        while self.peek("op", "+") or self.peek("op", "-"):
            op = self.take()[1]
            e = ("bin", op, e, self.concat())
        return e

    def concat(self):
        e = self.mul()
        while self.take("op", "~"):
            e = ("bin", "~", e, self.mul())
        return e

    def mul(self):
        e = self.unary()
        while any(self.peek("op", o) for o in ("*", "/", "//", "%")):
            op = self.take()[1]
            e = ("bin", op, e, self.unary())
        return e

    def unary(self):
        if self.take("op", "-"):
            return ("bin", "-", ("lit", 0), self.unary())
        return self.filters(self.postfix(self.primary()))

    def primary(self):
        tk = self.take()
        if not tk:
            raise ChatTemplateError(f"{self.name}: expected an expression, got end of tag")
        if tk[0] in ("str", "int"):
            e = ("lit", tk[1])
            while self.peek("str"):  # adjacent literals join, as in Jinja
                e = ("lit", e[1] + self.take()[1])
            return e
        if tk[0] == "name":
            lits = {"true": True, "True": True, "false": False, "False": False, "none": None, "None": None}
            if tk[1] in lits:
                return ("lit", lits[tk[1]])
            return ("var", tk[1])
        if tk == ("op", "("):
            e = self.expr()
            self.need("op", ")")
            return e
        if tk == ("op", "["):
            items = []
            while not self.take("op", "]"):
                items.append(self.expr())
                if not self.take("op", ","):
                    self.need("op", "]")
                    break
            return ("list", items)
        raise ChatTemplateError(f"{self.name}: unsupported construct: {tk[1]!r} in an expression")

    def args(self):
        """Arguments up to ")" (the "(" taken): (expressions, keyword names). Keyword arguments are
        read so that a template may hold them in branches it never renders (Llama-3.1's tojson(indent=4))."""
        out, kws = [], []
        while not self.take("op", ")"):
            if self.peek("name") and self.peek("op", "=", 1):
                kws.append(self.take()[1])
                self.take()
            out.append(self.expr())
            if not self.take("op", ","):
                self.need("op", ")")
                break
        return out, kws

    def postfix(self, e):
        while True:
            if self.take("op", "."):
                e = ("item", e, ("lit", self.need("name")[1]))
            elif self.take("op", "["):
                lo = None if self.peek("op", ":") else self.expr()
                if self.take("op", ":"):
                    hi = None if self.peek("op", "]") else self.expr()
                    if self.peek("op", ":"):
                        raise ChatTemplateError(f"{self.name}: unsupported construct: slice step")
                    e = ("slice", e, lo, hi)
                else:
                    e = ("item", e, lo)
                self.need("op", "]")
            elif self.take("op", "("):
                e = self.call(e)
            else:
                return e

    def call(self, fn):
        """fn(args): raise_exception(msg) and the string methods render; any other call is read
        and fails when rendered (a template may guard one with `is defined`, as Llama-3.2's strftime_now)."""
        args, kws = self.args()
        return ("call", fn, args, kws)

    def filters(self, e):
        while True:
            if self.take("op", "|"):  # any filter is read; one outside the subset fails when rendered
                f = self.need("name")[1]
                e = ("filter", f, e, self.args() if self.take("op", "(") else None)
            elif self.take("name", "is"):
                neg = bool(self.take("name", "not"))
                t = self.need("name")[1]
                e = ("test", t, e, self.args() if self.take("op", "(") else None)
                if neg:
                    e = ("not", e)
            else:
                return e


def _parse_body(parts, i, name, ends):
    """Statements from parts[i] until a stmt tag whose keyword is in ends; returns (body, i, keyword tokens)."""
    body = []
    while i < len(parts):
        kind, val = parts[i]
        i += 1
        if kind == "text":
            if val:
                body.append(("text", val))
        elif kind == "out":
            p = _Parser(val, name)
            body.append(("out", p.expr()))
            p.done()
        else:
            if not val or val[0][0] != "name":
                raise ChatTemplateError(f"{name}: empty or malformed {{% %}} tag")
            kw = val[0][1]
            if kw in ends:
                return body, i, val
            p = _Parser(val[1:], name)
            if kw == "if":
                body.append(_parse_if(parts, i, name, p))
                i = body[-1][-1]
                body[-1] = body[-1][:-1]
            elif kw == "for":
                var = [p.need("name")[1]]
                while p.take("op", ","):  # read, and refused when rendered
                    var.append(p.need("name")[1])
                p.need("name", "in")
                it = p.expr()
                p.done()
                inner, i, end = _parse_body(parts, i, name, ("endfor", "else"))
                if end[0][1] != "endfor":
                    raise ChatTemplateError(f"{name}: unsupported construct: for ... else")
                body.append(("for", var, it, inner))
            elif kw == "set":
                var = p.need("name")[1]
                if not p.take("op", "="):
                    raise ChatTemplateError(f"{name}: unsupported construct: set of {var} without = (block set or attribute)")
                body.append(("set", var, p.expr()))
                p.done()
            else:
                raise ChatTemplateError(f"{name}: unsupported construct: {{% {kw} %}}")
    if ends:
        raise ChatTemplateError(f"{name}: missing {{% {ends[0]} %}} at end of template")
    return body, i, None


def _parse_if(parts, i, name, p):
    branches = []
    cond = p.expr()
    p.done()
    while True:
        inner, i, end = _parse_body(parts, i, name, ("endif", "elif", "else"))
        branches.append((cond, inner))
        kw = end[0][1]
        if kw == "endif":
            return ("if", branches, i)
        q = _Parser(end[1:], name)
        cond = q.expr() if kw == "elif" else ("lit", True)
        q.done()


def parse(src, name="template"):
    body, _, _ = _parse_body(_lex(src, name), 0, name, ())
    return body


# ---- evaluation ------------------------------------------------------------------------------

def _truthy(v):
    return False if v is UNDEF else bool(v)


def _text(v, name):
    if v is UNDEF:
        return ""
    if isinstance(v, bool) or v is None:
        return str(v)
    if isinstance(v, (str, int)):
        return str(v)
    raise ChatTemplateError(f"{name}: unsupported construct: printing a {type(v).__name__}")


def _binop(op, a, b, name):
    if op == "~":
        return _text(a, name) + _text(b, name)
    if op in ("==", "!="):
        eq = (a is b) if (a is UNDEF or b is UNDEF) else a == b  # Python's ==, as Jinja
        return eq if op == "==" else not eq
    if op == "in":
        if isinstance(b, str) and isinstance(a, str) or isinstance(b, list) or isinstance(b, dict) and isinstance(a, str):
            return a in b
        raise ChatTemplateError(f"{name}: 'in' needs a string, list or mapping on its right")
    both_int = all(isinstance(x, int) and not isinstance(x, bool) for x in (a, b))
    both_str = isinstance(a, str) and isinstance(b, str)
    if op == "+" and (both_int or both_str):
        return a + b
    if op in ("<", ">", "<=", ">=") and (both_int or both_str):
        return {"<": a < b, ">": a > b, "<=": a <= b, ">=": a >= b}[op]
    if op in ("-", "*", "%", "//") and both_int:
        if op in ("%", "//") and b == 0:
            raise ChatTemplateError(f"{name}: division by zero")
        return {"-": a - b, "*": a * b, "%": a % b, "//": a // b}[op]
    raise ChatTemplateError(f"{name}: unsupported operation {op!r} between {type(a).__name__} and {type(b).__name__}")


def _item(obj, key, name):
    if isinstance(obj, dict):
        return obj.get(key, UNDEF) if isinstance(key, str) else UNDEF
    if isinstance(obj, list) and isinstance(key, int) and not isinstance(key, bool):
        return obj[key] if -len(obj) <= key < len(obj) else UNDEF
    if obj is UNDEF:
        raise ChatTemplateError(f"{name}: indexing an undefined value")
    return UNDEF


def _filter(f, v, args, name):
    if f not in FILTERS:
        raise ChatTemplateError(f"{name}: unsupported construct: filter {f}")
    if args is not None:
        raise ChatTemplateError(f"{name}: unsupported construct: arguments to filter {f}")
    if f == "trim":
        return _text(v, name).strip()
    if f == "string":
        return _text(v, name)
    if f in ("length", "count"):
        if isinstance(v, (str, list, dict)):
            return len(v)
    if f in ("first", "last") and isinstance(v, list):
        return (v[0] if f == "first" else v[-1]) if v else UNDEF
    raise ChatTemplateError(f"{name}: filter {f} of a {type(v).__name__}")


def _test(t, v, args, name):
    if t not in TESTS or args is not None:
        raise ChatTemplateError(f"{name}: unsupported construct: test 'is {t}'" + (" with arguments" if t in TESTS else ""))
    if t == "defined":
        return v is not UNDEF
    if t == "undefined":
        return v is UNDEF
    if t == "none":
        return v is None
    if t == "string":
        return isinstance(v, str)
    return isinstance(v, int) and not isinstance(v, bool)


def _method(m, obj, args, name):
    if not isinstance(obj, str):
        raise ChatTemplateError(f"{name}: method {m}() of a {type(obj).__name__}")
    if m in ("strip", "lstrip", "rstrip") and not args:
        return getattr(obj, m)()
    if m in ("startswith", "endswith") and len(args) == 1 and isinstance(args[0], str):
        return getattr(obj, m)(args[0])
    raise ChatTemplateError(f"{name}: unsupported arguments to {m}()")


def _eval(e, scopes, name):
    k = e[0]
    if k == "lit":
        return e[1]
    if k == "var":
        for s in reversed(scopes):
            if e[1] in s:
                return s[e[1]]
        return UNDEF
    if k == "list":
        return [_eval(x, scopes, name) for x in e[1]]
    if k == "item":
        return _item(_eval(e[1], scopes, name), _eval(e[2], scopes, name), name)
    if k == "slice":
        obj = _eval(e[1], scopes, name)
        lo = None if e[2] is None else _eval(e[2], scopes, name)
        hi = None if e[3] is None else _eval(e[3], scopes, name)
        if not isinstance(obj, list) or any(x is not None and (not isinstance(x, int) or isinstance(x, bool)) for x in (lo, hi)):
            raise ChatTemplateError(f"{name}: slicing needs a list and integer bounds")
        return obj[lo:hi]
    if k == "or":
        a = _eval(e[1], scopes, name)
        return a if _truthy(a) else _eval(e[2], scopes, name)
    if k == "and":
        a = _eval(e[1], scopes, name)
        return _eval(e[2], scopes, name) if _truthy(a) else a
    if k == "not":
        return not _truthy(_eval(e[1], scopes, name))
    if k == "cond":
        return _eval(e[2] if _truthy(_eval(e[1], scopes, name)) else e[3], scopes, name)
    if k == "bin":
        return _binop(e[1], _eval(e[2], scopes, name), _eval(e[3], scopes, name), name)
    if k == "filter":
        return _filter(e[1], _eval(e[2], scopes, name), e[3], name)
    if k == "test":
        return _test(e[1], _eval(e[2], scopes, name), e[3], name)
    if k == "call":
        return _call(e, scopes, name)
    raise AssertionError(k)


def _call(e, scopes, name):
    fn, args, kws = e[1], e[2], e[3]
    method = fn[0] == "item" and fn[2][0] == "lit" and isinstance(fn[2][1], str)
    what = fn[1] if fn[0] == "var" else fn[2][1] if method else "a call"
    known = fn == ("var", "raise_exception") or method and what in METHODS
    if not known or kws:
        raise ChatTemplateError(f"{name}: unsupported construct: call of {what}()" + (" with keyword arguments" if known else ""))
    if method:
        return _method(what, _eval(fn[1], scopes, name), [_eval(a, scopes, name) for a in args], name)
    if len(args) != 1:
        raise ChatTemplateError(f"{name}: unsupported construct: call of raise_exception() with {len(args)} arguments")
    raise ChatTemplateError(f"{name}: the template raised: {_text(_eval(args[0], scopes, name), name)}")


def _run(body, scopes, out, name):
    for st in body:
        k = st[0]
        if k == "text":
            out.append(st[1])
        elif k == "out":
            out.append(_text(_eval(st[1], scopes, name), name))
        elif k == "set":
            scopes[-1][st[1]] = _eval(st[2], scopes, name)
        elif k == "if":
            for cond, inner in st[1]:
                if _truthy(_eval(cond, scopes, name)):
                    _run(inner, scopes, out, name)
                    break
        elif k == "for":
            if len(st[1]) > 1:
                raise ChatTemplateError(f"{name}: unsupported construct: for with several variables")
            seq = _eval(st[2], scopes, name)
            if not isinstance(seq, list):
                raise ChatTemplateError(f"{name}: for over a {type(seq).__name__}; only lists are supported")
            for i, x in enumerate(seq):
                loop = {"index0": i, "index": i + 1, "first": i == 0, "last": i == len(seq) - 1,
                        "length": len(seq), "revindex": len(seq) - i, "revindex0": len(seq) - i - 1}
                scopes.append({st[1][0]: x, "loop": loop})
                _run(st[3], scopes, out, name)
                scopes.pop()


def render(source, messages, add_generation_prompt, bos_token="", eos_token="", name="template"):
    """The template's text for messages ([{"role", "content"}]), as apply_chat_template(tokenize=False)."""
    body = parse(source, name)
    scopes = [{"messages": messages, "add_generation_prompt": add_generation_prompt,
               "bos_token": bos_token, "eos_token": eos_token}]
    out = []
    _run(body, scopes, out, name)
    return "".join(out)
