#!/usr/bin/env python3
"""dev/restructure/measure.py: the numbers issue 35 asks for, for the files given (default: the
LLaMA driver and its model headers): each file's lines, and the longest functions (a top-level
definition from its signature's first line to the closing brace in column 0)."""
import re
import sys

DEF = re.compile(r"^(?:static |int |void )[^;()]*\b([A-Za-z_]\w*)\(")


def functions(path):
    lines = open(path, encoding="utf-8").read().split("\n")
    out, start, name = [], None, None
    for i, line in enumerate(lines):
        m = DEF.match(line)
        if start is None and m and not line.rstrip().endswith(";"):
            start, name = i, m.group(1)
        if start is not None and line.startswith("}"):
            out.append((i - start + 1, name, path))
            start = None
    return len(lines) - 1, out


files = sys.argv[1:] or ["train_llama.cu", "llmc/models/llama.h", "llmc/models/llama_plan.h", "llmc/models/llama_batch.h",
                         "llmc/models/llama_io.h", "llmc/models/llama_step.h", "llmc/models/llama_generate.h",
                         "llmc/train/run.h"]
every = []
for f in files:
    n, fns = functions(f)
    every += fns
    print(f"{n:6d} lines  {len(fns):3d} functions  {f}")
print("longest functions:")
for n, name, path in sorted(every, reverse=True)[:5]:
    print(f"{n:6d}  {name}  ({path})")
