#!/usr/bin/env python3
"""dev/restructure/call_depth.py: how many calls each CUDA kernel of llmc/ lies below the model
(issue 35: "no kernel is more than 3 calls below the model"). Reads the top-level functions of the
tracked C/CUDA sources outside dev/ and test/ (a definition from its signature at column 0 to the
next '}' at column 0, or a one-line definition `f(args) { body }` alone; comments and string
literals dropped), links each to the functions and
kernels it names, and prints, per __global__ kernel reached, the longest call path from the roots
(default: block_forward and block_backward of llmc/models/llama.h and llmc/models/vit.h) and from
the first function outside llmc/models/ on that path ("below the model": op -> launcher -> kernel
is 3). A launch through the launch_kernel macro counts as the last call.
Usage: python3 dev/restructure/call_depth.py [REPO] [--all]   (--all: every kernel, else the worst 15)"""
import os
import re
import subprocess
import sys

args = [a for a in sys.argv[1:] if not a.startswith("--")]
REPO = os.path.abspath(args[0] if args else ".")
SHOW_ALL = "--all" in sys.argv
ROOTS = [("llmc/models/llama.h", "block_forward"), ("llmc/models/llama.h", "block_backward"),
         ("llmc/models/vit.h", "block_forward"), ("llmc/models/vit.h", "block_backward")]
SIG = re.compile(r"^(?:template\s*<[^>]*>\s*)?"
                 r"(?:(?:static|__global__|__device__|__host__|inline|__forceinline__|const)\s+)*"
                 r"[A-Za-z_][\w\s\*<>:,]*?\b(\w+)\s*\(")


def strip(text):
    text = re.sub(r"//[^\n]*", "", text)
    return re.sub(r'"(?:\\.|[^"\\\n])*"', '""', text)


def definitions():
    files = subprocess.run(["git", "ls-files", "*.h", "*.cuh", "*.cu"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.split()
    defs, kernels = {}, set()
    for f in files:
        if f.startswith(("dev/", "test/")):
            continue
        lines = strip(open(os.path.join(REPO, f), encoding="utf-8", errors="replace").read()).split("\n")
        i = 0
        while i < len(lines):
            m = SIG.match(lines[i])
            if m and not lines[i].startswith(("typedef", "struct", "#", "return")):
                j = i
                while j < len(lines) and not lines[j].rstrip().endswith(("{", ";", "}")):
                    j += 1
                one = lines[j].rstrip() if j < len(lines) else ""
                if one.endswith("}") and re.search(r"\)\s*(?:const\s*)?\{", one) and one.count("{") == one.count("}"):
                    # a definition on one line, `... f(args) { body }`: its body is that line alone
                    defs[(f, m.group(1))] = one[one.index("{", one.index("(")):]
                    i = j
                elif j < len(lines) and lines[j].rstrip().endswith("{") and not lines[j].rstrip().endswith("= {"):
                    k = j + 1
                    while k < len(lines) and not lines[k].startswith("}"):
                        k += 1
                    key = (f, m.group(1))
                    if "__global__" in " ".join(lines[i:j + 1]):
                        kernels.add(m.group(1))
                    defs[key] = "\n".join(lines[j:k + 1])
                    i = k
            i += 1
    return defs, kernels


def main():
    defs, kernels = definitions()
    by_name = {}
    for f, n in defs:
        by_name.setdefault(n, []).append((f, n))
    ident = re.compile(r"\b([A-Za-z_]\w*)\b")
    callees = {}
    for key, body in defs.items():
        names = set(ident.findall(body)) - {key[1]}
        out = []
        for n in names:
            for target in by_name.get(n, []):
                # a model file's own function of that name, else any definition outside llmc/models/
                if target[0].startswith("llmc/models/") and target[0] != key[0]:
                    continue
                out.append(target)
        callees[key] = out
    worst = {}

    def walk(node, path):
        for c in callees.get(node, []):
            if c in path:
                continue
            p = path + [c]
            if c[1] in kernels:
                below = next(i for i, x in enumerate(p) if not x[0].startswith("llmc/models/"))
                depth, under = len(p) - 1, len(p) - below
                if (depth, under) > worst.get(c[1], (0, 0, None))[:2]:
                    worst[c[1]] = (depth, under, p)
            else:
                walk(c, p)

    for root in ROOTS:
        if root in defs:
            walk(root, [root])
    rows = sorted(worst.items(), key=lambda kv: (-kv[1][0], -kv[1][1], kv[0]))
    print(f"kernels reached from the model's blocks: {len(rows)} of {len(kernels)}")
    print(f"most calls from block_forward/backward: {max(v[0] for _, v in rows)}; "
          f"most calls below the model: {max(v[1] for _, v in rows)}; "
          f"kernels more than 3 calls below the model: {sum(1 for _, v in rows if v[1] > 3)}")
    for name, (depth, under, path) in rows if SHOW_ALL else rows[:15]:
        print(f"{depth:3d} {under:3d}  {name}: " + " -> ".join(n for _, n in path))


main()
