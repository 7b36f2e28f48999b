#!/usr/bin/env bash
# scripts/ci/attention_compare.sh: the CUDA backend's attention paths side by side on one GPU
# (LLMC_ATTENTION=cudnn | gemm, llmc/ops.h) and the CUDA graph (LLMC_CUDA_GRAPH=1) on the
# default path and on gemm: the attention rows of scripts/ci/switch_compare.sh (which gpu_check.sh
# runs with every other switch), at the shapes this script always had: the demo model at batch
# 4 x 128 (real data), the same with packed examples (cuDNN's ragged layout; switch_compare.sh's
# packed rows) and a Llama-3-8B-shaped model cut to 2 layers at batch 1 x 4096. The header of
# switch_compare.sh says what is checked (loss and gradient norm within the emulator tests' bounds
# against the default, cudnn where make found cuDNN; gemm with the graph identical to gemm) and
# what the table holds. ATTN_COMPARE_STEPS (default 4) steps.
# Usage: bash scripts/ci/attention_compare.sh [demo|packed|llama3|all]    (a GPU and the nvcc-built train_llama;
# ATTN_COMPARE_TRAINER=build/emu/train_llama runs the script's logic on the emulator, where cudnn is refused)
set -u
cd "$(dirname "$0")/../.." || exit 1
case ${1:-all} in
    all) SHAPES="demo packed llama3" ;;
    demo | packed | llama3) SHAPES=$1 ;;
    *) echo "attention_compare.sh: unknown shape '$1' (expected demo, packed, llama3 or all)" >&2; exit 2 ;;
esac
# shellcheck disable=SC2086  # the shapes split into words on purpose
SWITCH_COMPARE_LLAMA=${ATTN_COMPARE_TRAINER:-./train_llama} SWITCH_COMPARE_STEPS=${ATTN_COMPARE_STEPS:-4} \
    SWITCH_COMPARE_ONLY="default gemm graph gemm+graph" SWITCH_COMPARE_HF=0 exec bash scripts/ci/switch_compare.sh $SHAPES
