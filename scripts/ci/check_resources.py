#!/usr/bin/env python3
"""check_resources.py: the per-kernel resource check of the CUDA sources (registers, static shared
memory, spills), from ptxas's own report, without a GPU.

Each source is compiled once, device code only (`nvcc -cubin -arch=sm_ARCH -Xptxas -v`), the
sources in parallel. Every kernel ptxas reports is then checked against three rules:
  - registers x launch block size <= 65,536 (one SM's register file; a block that needs more
    cannot launch at all). Registers are counted as the hardware allocates them: per thread rounded
    up to a multiple of 8, per block rounded up to whole warps of 32 threads.
  - static shared memory <= 48 KiB (the most a kernel may declare statically; more needs dynamic
    shared memory and an opt-in).
  - no spills (spill stores or loads) in a kernel on the training hot path; the kernels that are
    not (COLD below) only get a warning.
The launch block size of each kernel is derived from the source: every launch goes through
`launch_kernel(grid, block, shared_bytes, stream, kernel, args...)` (llmc/cuda/common.cuh) with a
block size that is a constant expression (numbers, object-like #defines, `dim3(x, y, z)`); the
calls are parsed from --launches (default: llmc/cuda/*.cuh and the sources). A kernel ptxas
reports without such a launch is an error: its block size is unknown.

Prints a table (most registers first) and exits 1 on any violation, 2 on a compile failure or
bad usage. --ptxas-log FILE checks a saved ptxas report instead of compiling (tests use it).
"""
import argparse
import glob
import os
import re
import subprocess
import sys
import tempfile
import time

REGS_PER_SM = 65536
STATIC_SMEM_MAX = 48 * 1024
# Kernels that are not on the training hot path: a spill there is reported, not fatal.
COLD = {
    "attention_cached_kernel": "generation (--generate) only",
}


def strip_comments(text):
    text = re.sub(r"/\*.*?\*/", lambda m: "\n" * m.group(0).count("\n"), text, flags=re.S)
    return re.sub(r"//[^\n]*", "", text)


def split_call_args(text, start):
    """The top-level comma-separated arguments of the call whose '(' is at text[start]."""
    depth, args, cur = 0, [], []
    for i in range(start, len(text)):
        ch = text[i]
        if ch in "([{":
            depth += 1
            if depth == 1:
                continue
        elif ch in ")]}":
            depth -= 1
            if depth == 0:
                args.append("".join(cur).strip())
                return args
        elif ch == "," and depth == 1:
            args.append("".join(cur).strip())
            cur = []
            continue
        cur.append(ch)
    raise ValueError("unbalanced parentheses")


def read_macros(paths):
    """Object-like #defines (NAME value) of all files: a name -> expression map."""
    macros = {}
    for p in paths:
        for line in strip_comments(open(p).read()).splitlines():
            m = re.match(r"\s*#\s*define\s+([A-Za-z_]\w*)\s+(.+?)\s*$", line)
            if m and not line.lstrip().startswith("#define " + m.group(1) + "("):
                macros[m.group(1)] = m.group(2)
    return macros


def eval_block(expr, macros, depth=0):
    """The number of threads of a block expression, or None when it is not a constant."""
    if depth > 20:
        return None
    expr = expr.strip()
    m = re.fullmatch(r"dim3\s*\((.*)\)", expr, flags=re.S)
    if m:
        total = 1
        for part in split_call_args("(" + m.group(1) + ")", 0):
            v = eval_block(part, macros, depth + 1)
            if v is None:
                return None
            total *= v
        return total
    names = set(re.findall(r"[A-Za-z_]\w*", expr))
    for n in names:
        if n not in macros:
            return None
        v = eval_block(macros[n], macros, depth + 1)
        if v is None:
            return None
        expr = re.sub(r"\b%s\b" % n, str(v), expr)
    if not re.fullmatch(r"[\d\s+\-*/()]+", expr):
        return None
    return int(eval(expr.replace("/", "//"), {"__builtins__": {}}))  # digits and operators only


def parse_launches(paths, macros):
    """kernel base name -> (largest block size or None, 'file:line' of that launch)."""
    launches = {}
    for p in paths:
        text = strip_comments(open(p).read())
        for m in re.finditer(r"\blaunch_kernel\s*\(", text):
            line_start = text.rfind("\n", 0, m.start()) + 1
            if text[line_start:m.start()].lstrip().startswith("#"):
                continue  # the macro's own definition
            args = split_call_args(text, m.end() - 1)
            if len(args) < 5:
                continue
            kernel = re.sub(r"<.*", "", args[4]).strip()
            block = eval_block(args[1], macros)
            where = "%s:%d" % (os.path.relpath(p), text.count("\n", 0, m.start()) + 1)
            launches.setdefault(kernel, []).append((block, where))
    # a launch whose block size is not a constant wins (it is reported); else the largest block
    def pick(v):
        unknown = [x for x in v if x[0] is None]
        return unknown[0] if unknown else max(v, key=lambda x: x[0])
    return {k: pick(v) for k, v in launches.items()}


def base_name(mangled):
    """The kernel's name from its Itanium mangling (_Z<len><name>...), or the symbol itself."""
    m = re.match(r"_Z(\d+)", mangled)
    return mangled[m.end():m.end() + int(m.group(1))] if m else mangled


def parse_ptxas(text):
    """[{symbol, regs, smem, spill_stores, spill_loads}] of each entry function ptxas reports."""
    kernels, cur = [], None
    for line in text.splitlines():
        m = re.search(r"Compiling entry function '([^']+)'", line)
        if m:
            cur = {"symbol": m.group(1), "regs": 0, "smem": 0, "spill_stores": 0, "spill_loads": 0}
            kernels.append(cur)
            continue
        if cur is None:
            continue
        m = re.search(r"Function properties for (\S+)", line)
        if m and m.group(1) != cur["symbol"]:
            cur = None  # a non-inlined device function's properties, not the kernel's
            continue
        m = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", line)
        if m:
            cur["spill_stores"], cur["spill_loads"] = int(m.group(1)), int(m.group(2))
        m = re.search(r"Used (\d+) registers", line)
        if m:
            cur["regs"] = int(m.group(1))
            s = re.search(r"(\d+) bytes smem", line)
            cur["smem"] = int(s.group(1)) if s else 0
    return kernels


def compile_all(nvcc, arch, sources, flags):
    """Runs nvcc -Xptxas -v on every source at once; returns ({source: ptxas text}, seconds, errors)."""
    tmp = tempfile.mkdtemp(prefix="check_resources.")
    procs, t0 = {}, time.time()
    for i, src in enumerate(sources):
        cmd = [nvcc, "-cubin", "-arch=sm_%s" % arch, "-O3", "-std=c++17", "-Xptxas", "-v"] + flags + \
              [src, "-o", os.path.join(tmp, "%d.cubin" % i)]
        procs[src] = (cmd, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    logs, errors = {}, []
    for src, (cmd, p) in procs.items():
        out, _ = p.communicate()
        logs[src] = out
        if p.returncode != 0:
            errors.append("%s: nvcc failed (rc=%d): %s\n%s" % (src, p.returncode, " ".join(cmd),
                          "\n".join(l for l in out.splitlines() if "error" in l.lower())[:2000]))
    for f in glob.glob(os.path.join(tmp, "*")):
        os.remove(f)
    os.rmdir(tmp)
    return logs, time.time() - t0, errors


def demangle(symbols):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(symbols), capture_output=True, text=True).stdout.splitlines()
        if len(out) == len(symbols):
            return {s: re.sub(r"^void ", "", d) for s, d in zip(symbols, out)}
    except OSError:
        pass
    return {s: s for s in symbols}


def check(kernels, launches, arch):
    """Rows of the table and the list of violations."""
    rows, bad, seen = [], [], set()
    names = demangle(sorted({k["symbol"] for k in kernels}))
    for k in kernels:
        if k["symbol"] in seen:  # the same kernel from two sources
            continue
        seen.add(k["symbol"])
        name = base_name(k["symbol"])
        block, where = launches.get(name, (None, None))
        status = []
        regs_block = None
        if block is None:
            status.append("FAIL: no launch_kernel call with a constant block size" if where is None else
                          "FAIL: block size at %s is not a constant expression" % where)
        else:
            regs_block = -(-k["regs"] // 8) * 8 * (-(-block // 32) * 32)
            if regs_block > REGS_PER_SM:
                status.append("FAIL: %d registers x %d threads = %d > %d" % (k["regs"], block, regs_block, REGS_PER_SM))
        if k["smem"] > STATIC_SMEM_MAX:
            status.append("FAIL: %d bytes of static shared memory > %d" % (k["smem"], STATIC_SMEM_MAX))
        spills = k["spill_stores"] + k["spill_loads"]
        if spills:
            if name in COLD:
                status.append("warning: spills (not on the hot path: %s)" % COLD[name])
            else:
                status.append("FAIL: spills on the training hot path (%d bytes stored, %d loaded)" % (k["spill_stores"], k["spill_loads"]))
        rows.append((k["regs"], names[k["symbol"]], block, regs_block, k["smem"], k["spill_stores"], k["spill_loads"],
                     "; ".join(status) or "ok"))
        bad += ["sm_%s %s: %s" % (arch, names[k["symbol"]], s[6:]) for s in status if s.startswith("FAIL")]
    rows.sort(key=lambda r: (-r[0], r[1]))
    return rows, bad


def print_table(rows, arch):
    print("%-64s %6s %5s %12s %7s %13s  %s" % ("kernel (sm_%s)" % arch, "block", "regs", "regs x block", "smem", "spill st/ld", "status"))
    for regs, name, block, rb, smem, st, ld, status in rows:
        short = name if len(name) <= 64 else name[:61] + "..."
        print("%-64s %6s %5d %12s %7d %13s  %s" % (short, block if block is not None else "?", regs,
              rb if rb is not None else "?", smem, "%d/%d" % (st, ld), status))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("sources", nargs="*", default=["train_llama.cu", "train_vit.cu"])
    ap.add_argument("--nvcc", default="nvcc")
    ap.add_argument("--arch", default="90")
    ap.add_argument("--launches", nargs="*", help="files whose launch_kernel calls give the block sizes "
                    "(default: llmc/cuda/*.cuh and the sources)")
    ap.add_argument("--ptxas-log", help="check this saved ptxas -v report instead of compiling")
    ap.add_argument("-I", dest="includes", action="append", default=[])
    a = ap.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/ci/ -> the repository
    for s in a.sources + ([a.ptxas_log] if a.ptxas_log else []):
        if not os.path.isfile(s):
            print("check_resources.py: %s: no such file (expected a CUDA source or a ptxas report)" % s, file=sys.stderr)
            return 2
    lfiles = a.launches if a.launches is not None else sorted(glob.glob(os.path.join(root, "llmc/cuda/*.cuh"))) + a.sources
    macros = read_macros(sorted(glob.glob(os.path.join(root, "llmc/cuda/*.cuh"))) + lfiles)
    launches = parse_launches(lfiles, macros)
    if a.ptxas_log:
        text, seconds, errors = open(a.ptxas_log).read(), 0.0, []
        what = a.ptxas_log
    else:
        logs, seconds, errors = compile_all(a.nvcc, a.arch, a.sources, ["-I" + i for i in a.includes])
        text, what = "\n".join(logs.values()), " ".join(a.sources)
    for e in errors:
        print("check_resources.py: FAIL: " + e, file=sys.stderr)
    kernels = parse_ptxas(text)
    rows, bad = check(kernels, launches, a.arch)
    print_table(rows, a.arch)
    print("check_resources.py: %d kernels of %s, sm_%s, compiled in %.1f s (once per source, in parallel)"
          % (len(rows), what, a.arch, seconds))
    unused = sorted(set(launches) - {base_name(k["symbol"]) for k in kernels})
    if unused and not a.ptxas_log:
        print("check_resources.py: launched but not compiled by these sources (not checked): " + ", ".join(unused))
    for b in bad:
        print("check_resources.py: FAIL: " + b)
    if errors:
        return 2
    if not kernels:
        print("check_resources.py: FAIL: ptxas reported no kernel", file=sys.stderr)
        return 2
    if bad:
        return 1
    print("check_resources.py: every kernel within 65,536 registers per block and 48 KiB of static shared memory; no spill on the hot path")
    return 0


if __name__ == "__main__":
    sys.exit(main())
