// cuda_workspace.h: the scratch the CUDA backend's library calls and attention need, as plain
// arithmetic: the workspace cuBLAS and cuBLASLt share, and the chunking and workspace of the
// tensor-core attention (llmc/cuda/attention_gemm.cuh). Both are buffers of the memory plan, so
// --dry-run and the measured-vs-planned line count them; the plan is made in every build, a CPU-only
// one planning the CUDA layout included, hence a header without CUDA.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include "../common.h"
#include "../cpu/attention.h"  // AttnShape

// The workspace cuBLAS and cuBLASLt share (op_plan_matmul_workspace).
// 32 MiB: what cuBLAS recommends on Hopper (sm_90) for its own workspace and what cuBLASLt's
// Hopper kernels ask for at most; smaller GPUs need less and use what they need of it.
#define BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
// cublasSetWorkspace requires a 256-byte aligned pointer; cudaMalloc's are, so the plan aligns
// the buffer's offset inside its arena.
#define BLAS_WORKSPACE_ALIGN 256

// The tensor-core attention's chunks and workspace.
// Query rows per chunk: S (fp32) and P (bf16) of all heads within ~128 MiB, a multiple of 64.
// LLMC_ATTN_CHUNK=n in the environment caps it (tests use it to get many chunks at small sizes).
static int attn_gemm_chunk(const AttnShape* s) {
    int64_t per_row = (int64_t)s->B * s->H * s->T * 6;
    int64_t c = per_row > 0 ? (128ll << 20) / per_row : 1;
    if (c >= 64) c -= c % 64;
    const char* cap = getenv("LLMC_ATTN_CHUNK");
    if (cap && atoi(cap) > 0 && atoi(cap) < c) c = atoi(cap);
    if (c < 1) c = 1;
    return (int)(c > s->T ? s->T : c);
}

// Batched products of one call: 2 per chunk forward, 4 + 2 per query head of a kv group backward.
static int64_t attn_gemm_products(const AttnShape* s) {
    int64_t c = attn_gemm_chunk(s), chunks = (s->T + c - 1) / c;
    return chunks * (4 + 2 * (s->H / s->KVH));
}

// Bytes of workspace for the forward (backward = 0) or both passes; carved by attn_gemm_work.
static size_t attn_gemm_work_bytes(const AttnShape* s, int backward) {
    int64_t bh = (int64_t)s->B * s->H, c = attn_gemm_chunk(s), nk = (int64_t)s->B * s->T * s->KVH * s->hd;
    size_t b = round_up(bh * c * s->T * 4, 256) + round_up(bh * c * s->T * 2, 256) +
               round_up(attn_gemm_products(s) * 3 * bh * sizeof(void*), 256);
    if (backward) b += 2 * round_up(nk * 4, 256) + round_up(bh * s->T * 4, 256);
    return b;
}


// The workspace cuDNN's fused attention (llmc/cuda/attention_cudnn.cu) is planned with. cuDNN says
// what a plan needs only once the plan is built, and that needs the GPU (its heuristics ask the
// device), while the memory plan is made before, in every build. So the plan holds this bound,
// which covers what the FlashAttention-2 style backward keeps in fp32 (a dQ accumulator
// [B, H, T, hd], dK and dV accumulators at up to H heads for grouped queries, two [B, H, T] row
// statistics), each with T rounded up to a 128-row tile, plus 16 MiB for the engines' own
// scratch. It is an upper estimate, not cuDNN's figure: at run time the built plan's own need
// is compared with the planned bytes, and a larger one sends the shape to the GEMM path
// (llmc/ops.h says so in one line). Not yet compared with cuDNN's figure on a GPU.
static size_t attn_cudnn_work_bound(const AttnShape* s) {
    int64_t t = (s->T + 127) / 128 * 128, bht = (int64_t)s->B * s->H * t;
    return round_up(3 * bht * s->hd * 4, 256) + round_up(2 * bht * 4, 256) + ((size_t)16 << 20);
}
