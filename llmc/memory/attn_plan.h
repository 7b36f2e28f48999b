// attn_plan.h: the workspace of the CUDA backend's tensor-core attention (llmc/cuda/
// attention_gemm.cuh) as plain arithmetic: how many query rows go in one chunk, how many batched
// products a call makes, and how many bytes it needs. Separate from the kernels because the
// memory plan needs these sizes in every build, a CPU-only one planning the CUDA layout included.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include "../common.h"
#include "../cpu/attention.h"  // AttnShape

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

