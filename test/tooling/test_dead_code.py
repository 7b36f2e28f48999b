"""No dead code in the library: every function defined in llmc/ (the emulator aside, which is test
infrastructure) is called by the trainers or by another llmc/ function, not only by the checks and
tests that exist to test it. The build keeps -Wno-unused-function because each trainer includes
headers whose other half serves the other model (ops.h, resample.h, ...): an unused function is
normal per binary, and this test is what keeps one unused by every binary from hiding there."""
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# a definition: at the start of a line, a static or __global__ function's name before its '('
DEF = re.compile(r"^(?:template\s*<[^>]*>\s*)?(?:static|__global__)\b[^;=()]*?\b([A-Za-z_]\w*)\s*\(", re.M)


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", " ", text, flags=re.S)
    return re.sub(r"//[^\n]*", " ", text)


def sources(*roots, exts=(".h", ".cuh", ".cu")):
    for root in roots:
        path = os.path.join(REPO, root)
        if os.path.isfile(path):
            yield path
            continue
        for d, _, files in os.walk(path):
            for f in files:
                if f.endswith(exts):
                    yield os.path.join(d, f)


def read(path):
    with open(path, encoding="utf-8", errors="replace") as f:
        return strip_comments(f.read())


def library_definitions():
    defs = {}
    for path in sources("llmc"):
        if os.sep + "emu" + os.sep in path:
            continue
        for m in DEF.finditer(read(path)):
            defs.setdefault(m.group(1), path)
    return defs


def test_every_library_function_is_used_by_the_product():
    defs = library_definitions()
    assert len(defs) > 200, f"the definition pattern found only {len(defs)} functions: it no longer matches the code"
    product = " ".join(read(p) for p in sources("llmc", "train_llama.cu", "train_vit.cu")
                       if os.sep + "emu" + os.sep not in p)
    counts = {}
    for name in re.findall(r"\b[A-Za-z_]\w*\b", product):
        counts[name] = counts.get(name, 0) + 1
    # the definition itself counts once (a forward declaration or a template's specialisations once more)
    dead = sorted(f"{name} ({os.path.relpath(path, REPO)})" for name, path in defs.items() if counts.get(name, 0) < 2)
    assert not dead, "defined in llmc/ but used by neither trainer nor any other llmc/ function: " + ", ".join(dead)
