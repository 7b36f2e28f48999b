"""Every repository path that the code, its comments and the docs cite exists (issue 35): a reader
who follows `llmc/nf4.h` from a comment, or `test/model/test_nf4.py` from docs/testing.md, finds
it. The scan reads every tracked source and document (git ls-files) and picks out the words that
start at one of the repository's top-level folders (llmc/, test/, scripts/, docs/, dev/, data/,
.ci/) or name a top-level file (train_llama.cu, README.md, Makefile, ...). Each must be a tracked
file or a folder holding one. What a cited path is not:
- a path inside another one (`build/test/x`, `$SHARED/data/x`, `../shared/models/x`, a URL): the
  word must start the path, so build outputs and files outside the repository are never read as
  citations of its files;
- a glob (`test/cuda/test_*_cuda.py`, a Makefile's `dev/cuda/%.cu`): it must match a tracked file;
- a placeholder (`dev/cuda/<family>.cu`, `f"test/{name}"`, `dev/cuda/$(X)`): its folder must exist;
- a program (`dev/cuda/norms`, `dev/cpu/gemm`): its source (the path + .cu) must exist;
- a Markdown link's target (`[memory.md](memory.md)`): relative to the linking file;
- a header by its path inside llmc/ (`cuda/nf4.cuh`, `train/loop.h`): it must exist under llmc/ or beside
  the file citing it;
- the few cases in NOT_CITATIONS below, each with its reason.
A failure lists every missing path as file:line: path, so each can be fixed where it stands."""
import fnmatch
import os
import re
import subprocess

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCANNED_SUFFIXES = (".h", ".cuh", ".cu", ".c", ".py", ".sh", ".md")
SCANNED_NAMES = ("Makefile", ".ci/run")
TOP_FOLDERS = ("llmc", "test", "scripts", "docs", "dev", "data", ".ci")
TOP_FILES = r"train_\w+\.cu|README\.md|Makefile"
PATH_CHARS = r"[\w.+/-]"
# A cited path starts a word: not after a path character, `$`, `~` or `{` (so `build/test/x`,
# `$SHARED/data/x`, `../shared/x` and `https://.../dev/x` are never read as paths of this repository).
CITED = re.compile(r"(?<![\w./$~{}-])(?:(?:" + "|".join(re.escape(t) for t in TOP_FOLDERS) + r")/" + PATH_CHARS
                   + r"*|(?:" + TOP_FILES + r")(?!" + PATH_CHARS + r"))")
# Headers are also cited by their path inside llmc/ (`cuda/nf4.cuh`, `train/loop.h`, a header's first line): a
# word starting at one of llmc/'s folders and naming a header or CUDA source must exist under llmc/ or beside the
# file that cites it.
LLMC_FOLDERS = ("cpu", "cuda", "train", "memory", "formats", "text", "vision", "models", "emu")
LLMC_CITED = re.compile(r"(?<![\w./$~{}-])(?:" + "|".join(LLMC_FOLDERS) + r")/[\w.+/-]*\.(?:h|cuh|cu)(?![\w.+/-])")
# A Markdown link to a file, `[text](testing.md)` or `[text](#section)`'s file part: relative to the linking file.
MD_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+)(?:#[^)\s]*)?\)")
GLOB_CHARS = "*?[%"          # a glob (fnmatch's, or a Makefile pattern's %) continues the path
PLACEHOLDER_CHARS = "{$<("   # f-string, shell or Makefile variable, <name>: only the folder is cited

# Words that look like cited paths but are not, each with why: (citing file, None for any; the cited path, an
# fnmatch pattern; the reason).
NOT_CITATIONS = [
    ("test/tooling/test_resource_check.py", "test/no_such_file.cu", "the absent file the test feeds the checker"),
    ("test/unit/formats.cu", "test/tmp_units*", "scratch files the unit test writes and removes"),
    ("Makefile", "test/test_units", "the target of a relative symlink made inside build/asan/"),
    ("scripts/bench/compare_nf4.sh", "data/tinyshakespeare.txt", "a file under LLMC_SHARED_DIR, said so there"),
    (None, "data/corpus*", "what the documented example `prepare_text.py --out data/corpus` writes"),
    (None, "data/chats*", "what the documented example `prepare_text.py --out data/chats` writes"),
    (None, "data/instr*", "what the documented example `prepare_text.py --out data/instr` writes"),
    ("scripts/data/prepare_images.py", "data/fmnist_5to9_train.bin", "the output of the example in its --help"),
]


def tracked_files():
    out = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout
    files = [f for f in out.decode().split("\0") if f]
    assert len(files) > 100, files  # the tree itself
    return files


def scanned(files):
    """The files read for citations; not this one, whose paths are the examples and the list above."""
    this = os.path.relpath(os.path.abspath(__file__), REPO)
    return [f for f in files if (f.endswith(SCANNED_SUFFIXES) or f in SCANNED_NAMES) and f != this]


def not_a_citation(citing, path):
    return any((who is None or who == citing) and fnmatch.fnmatchcase(path, pattern)
               for who, pattern, _ in NOT_CITATIONS)


def citations(text, markdown=True):
    """(line number, cited path, kind) for each cited path in text; kind is "path", "glob", "placeholder",
    "llmc-relative" or, in Markdown, "link"."""
    for number, line in enumerate(text.split("\n"), 1):
        for m in CITED.finditer(line):
            path, end = m.group(0), m.end()
            following = line[end] if end < len(line) else ""
            if following in GLOB_CHARS and following:
                glob = re.match(r"(?:" + PATH_CHARS + r"|[*?%\[\]])*", line[m.start():]).group(0)
                yield number, glob.rstrip("."), "glob"
            elif following in PLACEHOLDER_CHARS and following:
                yield number, path, "placeholder"
            else:
                yield number, path.rstrip("."), "path"
        for m in LLMC_CITED.finditer(line):
            yield number, m.group(0), "llmc-relative"
        for m in MD_LINK.finditer(line) if markdown else ():
            yield number, m.group(1), "link"


def exists(path, kind, files, folders, citing=""):
    if kind == "link":
        target = os.path.normpath(os.path.join(os.path.dirname(citing), path))
        return target in files or target in folders
    if kind == "llmc-relative":
        return any(os.path.normpath(os.path.join(d, path)) in files for d in ("llmc", os.path.dirname(citing)))
    if kind == "glob":
        pattern = path.replace("%", "*").rstrip("/")
        return any(fnmatch.fnmatchcase(f, pattern) for f in files) or any(fnmatch.fnmatchcase(d, pattern)
                                                                         for d in folders)
    if kind == "placeholder":
        return os.path.dirname(path) in folders or os.path.dirname(path) == ""
    path = path.rstrip("/")
    return path in files or path in folders or path + ".cu" in files or path + ".c" in files


def missing_citations(files):
    folders = {os.path.dirname(f) for f in files}
    folders |= {os.path.dirname(d) for d in list(folders)}
    while True:  # every folder above a tracked file
        above = {os.path.dirname(d) for d in folders} - folders
        if not above:
            break
        folders |= above
    file_set = set(files)
    missing = []
    for f in scanned(files):
        with open(os.path.join(REPO, f), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        for number, path, kind in citations(text, f.endswith(".md")):
            if not exists(path, kind, file_set, folders, f) and not not_a_citation(f, path):
                missing.append(f"{f}:{number}: {path}")
    return missing


def test_every_cited_repository_path_exists():
    missing = missing_citations(tracked_files())
    why = f"{len(missing)} cited paths are no tracked file or folder (file:line: path):\n"
    assert not missing, why + "\n".join(missing)


def test_not_citations_are_still_needed():
    """Each entry of NOT_CITATIONS still matches a word of the file it names (or of some file), so the
    list cannot grow stale and hide a real citation later."""
    files = tracked_files()
    seen = set()
    for f in scanned(files):
        with open(os.path.join(REPO, f), encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        for _, path, _ in citations(text, f.endswith(".md")):
            for i, (who, pattern, _) in enumerate(NOT_CITATIONS):
                if (who is None or who == f) and fnmatch.fnmatchcase(path, pattern):
                    seen.add(i)
    unused = [NOT_CITATIONS[i] for i in range(len(NOT_CITATIONS)) if i not in seen]
    assert not unused, f"entries of NOT_CITATIONS that match no cited word: {unused}"


def test_the_extraction_reads_what_it_should():
    """The scanner on made-up text: what is a citation, a glob, a placeholder, and what is not one."""
    text = "\n".join([
        "see llmc/formats/nf4.h. and `test/model/test_nf4.py::test_x`, train_llama.cu",
        "build/test/test_units $SHARED/data/x.txt ../shared/models/a.bin https://x.org/dev/cuda/y.cu",
        "test/cuda/test_*_cuda.py dev/cuda/%.cu dev/cuda/<family>.cu f\"test/{name}\" dev/cuda/$(X)",
        "metadata/x unit-test/y llmc/ cuda/nf4.cuh: train/loop.h, llmc/cuda/x.cuh",
        "[memory](memory.md#plan) [x](https://x.org/a.md) [y](#z)",
    ])
    assert list(citations(text)) == [
        (1, "llmc/formats/nf4.h", "path"), (1, "test/model/test_nf4.py", "path"), (1, "train_llama.cu", "path"),
        (3, "test/cuda/test_*_cuda.py", "glob"), (3, "dev/cuda/%.cu", "glob"),
        (3, "dev/cuda/", "placeholder"), (3, "test/", "placeholder"), (3, "dev/cuda/", "placeholder"),
        (4, "llmc/", "path"), (4, "llmc/cuda/x.cuh", "path"),
        (4, "cuda/nf4.cuh", "llmc-relative"), (4, "train/loop.h", "llmc-relative"),
        (5, "memory.md", "link"),
    ]
    files = {"llmc/nf4.h", "dev/cuda/norms.cu", "test/cuda/test_llama_cuda.py"}
    folders = {"", "llmc", "dev", "dev/cuda", "test", "test/cuda"}
    assert not exists("llmc/formats/nf4.h", "path", files, folders)
    assert exists("llmc/nf4.h", "path", files, folders) and exists("llmc/", "path", files, folders)
    assert exists("dev/cuda/norms", "path", files, folders)  # a program built from dev/cuda/norms.cu
    assert exists("test/cuda/test_*_cuda.py", "glob", files, folders)
    assert not exists("test/resource_planted*.cu", "glob", files, folders)
    assert exists("dev/cuda/", "placeholder", files, folders) and not exists("docs/x", "placeholder", files, folders)
    assert exists("nf4.h", "llmc-relative", files, folders, "docs/a.md")  # under llmc/
    assert exists("cuda/norms.cu", "llmc-relative", files, folders, "dev/b.md")  # beside the citing file
    assert not exists("cuda/nf4.cuh", "llmc-relative", files, folders, "test/c.py")
    assert exists("../llmc/nf4.h", "link", files, folders, "docs/a.md")
    assert not exists("nf4.h", "link", files, folders, "docs/a.md")


# README.md and docs/ cite no file outside the repository. What they may name outside it: the folder of outside
# artifacts, by its setting (LLMC_SHARED_DIR, default ../shared: test/conftest.py), and scratch files under /tmp
# that an example command writes and reads.
OUTSIDE = re.compile(r"(?<![\w/.-])(?:/[\w.+-]+){2,}/?|(?<![\w/.-])(?:\.\./|~/)[\w.+/-]*")
OUTSIDE_ALLOWED = re.compile(r"\.\./shared/?|/tmp/[\w.+-]+")


def test_readme_and_docs_cite_nothing_outside_the_repository():
    docs = [f for f in tracked_files() if f == "README.md" or (f.startswith("docs/") and f.endswith(".md"))]
    assert "docs/architecture.md" in docs, docs
    outside = []
    for f in docs:
        with open(os.path.join(REPO, f), encoding="utf-8") as fh:
            for number, line in enumerate(fh, 1):
                outside += [f"{f}:{number}: {m.group(0)}" for m in OUTSIDE.finditer(line)
                            if not OUTSIDE_ALLOWED.fullmatch(m.group(0))]
    assert not outside, "paths outside the repository (file:line: path):\n" + "\n".join(outside)
