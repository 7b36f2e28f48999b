"""scripts/formats/chat_template.py: renders a model's chat template (the Jinja text in its
tokenizer_config.json) as transformers' apply_chat_template does, with jinja2 itself: the
sandboxed environment transformers builds (ImmutableSandboxedEnvironment, trim_blocks,
lstrip_blocks, no trailing newline, the loopcontrols extension and {% generation %} blocks), its
raise_exception and strftime_now globals and its tojson filter (json.dumps without ASCII escaping
or key sorting, with indent/separators/sort_keys arguments). Any template
transformers renders renders here, not only the subset of llmc/text/chat_template.h (the C renderer of
--chat); test/formats/test_chat_template.py checks both against transformers.

    render(source, messages, add_generation_prompt, bos_token="", eos_token="", name="template", **variables)
    parse(source, name="template")  # compiles; a syntax error is a ChatTemplateError

Limits, the same as the C renderer's (docs/formats.md): blocks ({% if %}, {% for %}, each elif) nest
at most 100 deep, expressions as deep as jinja2's parser recurses, for-loops run at most 1,000,000
iterations in one rendering, the output is at most 64 MiB, and a string or list repeated with * is
at most 64 MiB. Beyond them a rendering is refused in one line, never left to hang or exhaust
memory.

Tool calling is not supported: a `tools` variable, a message with role "tool" or with
"tool_calls" is refused by name, never rendered. Errors are ChatTemplateError, one line starting
with name: a syntax error, the template's raise_exception(msg) ("the template raised: msg"),
anything else jinja2 raises while rendering, and jinja2 missing (Debian: python3-jinja2).
"""
import functools
import json

MAX_DEPTH = 100              # nested blocks, as CT_MAX_DEPTH of llmc/text/chat_template.h
MAX_ITERATIONS = 1_000_000   # for-loop iterations in one rendering, all loops together
MAX_TEXT = 64 << 20          # characters of output, and of a string or list made by *


class ChatTemplateError(Exception):
    """A template that does not compile or raised, tools, or no jinja2; the message is one line."""


def _one_line(text):
    return " ".join(str(text).split())


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # transformers' override of jinja2's tojson, which would HTML-escape and sort keys
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _Raised(Exception):
    """raise_exception(msg) called by the template."""


def _raise_exception(message):
    raise _Raised(message)


def _strftime_now(fmt):
    # transformers' global: the current local time, formatted (Llama-3.2's date line)
    import datetime
    return datetime.datetime.now().strftime(fmt)


def _generation_extension(jinja2):
    """{% generation %}...{% endgeneration %}: transformers marks the assistant's tokens with it
    (return_assistant_tokens_mask); the text renders as it is, which is all a rendering sees."""
    from jinja2 import nodes
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()
    return Generation


class _Budget:
    """The iterations left to the rendering in progress (render resets it)."""
    left = MAX_ITERATIONS


def _counted(iterable):
    # every for-loop's sequence goes through here (_limit_loops): each item costs one iteration
    for item in iterable:
        _Budget.left -= 1
        if _Budget.left < 0:
            raise ChatTemplateError(f"more than {MAX_ITERATIONS} loop iterations in one rendering")
        yield item


def _sandbox_class(jinja2_sandbox):
    class Sandbox(jinja2_sandbox.ImmutableSandboxedEnvironment):
        """transformers' sandbox, with * and ** bounded: 'x' * 10**9 or 10 ** 10**9 would take
        the memory or the time of the machine before any other limit is reached."""
        intercepted_binops = frozenset(["*", "**"])

        def call_binop(self, context, operator, left, right):
            if operator == "*":
                for seq, n in ((left, right), (right, left)):
                    if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_TEXT:
                        raise ChatTemplateError(f"a {type(seq).__name__} repeated past {MAX_TEXT >> 20} MiB")
            if operator == "**" and isinstance(left, int) and isinstance(right, int) and abs(left) > 1:
                if right > 0 and left.bit_length() * right > 8 * MAX_TEXT:
                    raise ChatTemplateError(f"an integer power past {MAX_TEXT >> 20} MiB")
            return super().call_binop(context, operator, left, right)
    return Sandbox


@functools.lru_cache(maxsize=1)
def _environment():
    try:
        import jinja2
        import jinja2.ext
        import jinja2.sandbox
    except ImportError:
        return None
    if int(jinja2.__version__.split(".")[0]) < 3:
        return f"jinja2 {jinja2.__version__} is too old (transformers needs 3.0 or later)"
    # as transformers builds it: break/continue, {% generation %}, raise_exception, tojson, strftime_now
    env = _sandbox_class(jinja2.sandbox)(trim_blocks=True, lstrip_blocks=True,
                                          extensions=[_generation_extension(jinja2), jinja2.ext.loopcontrols])
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.filters["tojson"] = _tojson
    env.globals["__llmc_counted"] = _counted
    return env


def _block_depth(node, depth=0):
    """The deepest nesting of blocks below node: an if, a for, and each elif of a chain count one."""
    from jinja2 import nodes
    here = depth + (1 + len(node.elif_) if isinstance(node, nodes.If) else 1 if isinstance(node, nodes.For) else 0)
    return max([here] + [_block_depth(child, here) for child in node.iter_child_nodes()])


def _limit_loops(tree):
    """Every for-loop iterates through __llmc_counted (_counted), which counts the iterations."""
    from jinja2 import nodes
    for loop in tree.find_all(nodes.For):
        loop.iter = nodes.Call(nodes.Name("__llmc_counted", "load"), [loop.iter], [], None, None)


@functools.lru_cache(maxsize=16)
def _compile(source):
    env = _environment()
    if not hasattr(env, "from_string"):
        raise ChatTemplateError(env or "rendering chat templates needs the jinja2 package "
                                "(Debian: apt-get install python3-jinja2; or pip install jinja2)")
    try:
        tree = env.parse(source)
        depth = _block_depth(tree)
    except RecursionError:
        raise ChatTemplateError(f"expressions or blocks nested deeper than Python's recursion allows") from None
    if depth > MAX_DEPTH:
        raise ChatTemplateError(f"blocks nested more than {MAX_DEPTH} deep (each elif counts)")
    _limit_loops(tree)
    code = env.compile(tree)
    return env.template_class.from_code(env, code, env.make_globals(None), None)


def parse(source, name="template"):
    """The compiled template; a syntax error (or no jinja2) is a ChatTemplateError."""
    try:
        return _compile(source)
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{name}: {e}") from None
    except Exception as e:  # jinja2.TemplateSyntaxError (which has lineno), or whatever else compiling raised
        line = f" at line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise ChatTemplateError(f"{name}: template syntax error{line}: {_one_line(e)}") from None


def _refuse_tools(messages, variables, name):
    if variables.get("tools") is not None:
        raise ChatTemplateError(f"{name}: tool calling is not supported (a tools list was given)")
    for i, m in enumerate(messages):
        if isinstance(m, dict) and (m.get("role") == "tool" or m.get("tool_calls")):
            what = 'role "tool"' if m.get("role") == "tool" else "tool_calls"
            raise ChatTemplateError(f"{name}: tool calling is not supported (message {i + 1} has {what})")


def _bounded_output(pieces):
    out, n = [], 0
    for piece in pieces:
        n += len(piece)
        if n > MAX_TEXT:
            raise ChatTemplateError(f"the rendering grows past {MAX_TEXT >> 20} MiB")
        out.append(piece)
    return "".join(out)


def render(source, messages, add_generation_prompt, bos_token="", eos_token="", name="template", **variables):
    """The template's text for messages ([{"role", "content", ...}]), as
    apply_chat_template(tokenize=False); variables are further template variables (e.g. Qwen3's
    enable_thinking), as newer transformers passes its keyword arguments."""
    _refuse_tools(messages, variables, name)
    template = parse(source, name)
    _Budget.left = MAX_ITERATIONS
    try:
        return _bounded_output(template.generate(messages=messages, add_generation_prompt=add_generation_prompt,
                                                 bos_token=bos_token, eos_token=eos_token, **variables))
    except ChatTemplateError as e:
        raise ChatTemplateError(f"{name}: {e}") from None
    except RecursionError:
        raise ChatTemplateError(f"{name}: rendering nested deeper than Python's recursion allows") from None
    except _Raised as e:
        raise ChatTemplateError(f"{name}: the template raised: {_one_line(e)}") from None
    except Exception as e:  # jinja2's UndefinedError, SecurityError, a TypeError inside the template, ...
        raise ChatTemplateError(f"{name}: rendering failed: {type(e).__name__}: {_one_line(e)}") from None
