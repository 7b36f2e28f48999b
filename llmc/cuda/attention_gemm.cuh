// cuda/attention_gemm.cuh: attention forward and backward on tensor cores, the twin of
// llmc/cpu/attention.h like the flash kernels of attention.cuh (same layout, AttnShape, lse), but
// with the products done by batched cuBLAS GEMMs (bf16 operands, fp32 accumulation) a chunk of
// query rows at a time, and the softmax between them by small kernels:
//   forward, per chunk of c query rows:  S = scale Q K^T (fp32) -> P = softmax(S), lse -> O = P V
//   backward, per chunk:                 S again -> P = exp(S - lse) -> dV += P^T dO -> dP = dO V^T
//                                        -> dS = P (dP - D) -> dQ = scale dS K -> dK += scale dS^T Q
// Only c x T scores per (batch, head) exist at a time (c is chosen so that S and P take at most
// ~128 MiB), never the whole T x T matrix, and nothing but q, k, v, o and lse is kept for the
// backward, as with the flash kernels. Causal chunks multiply only the keys up to their last row.
// dK and dV are summed over chunks in fp32 and rounded to bf16 once. Grouped-query heads read
// their kv head through the pointer arrays; their dK/dV sums run one query head of each group at
// a time, so no two entries of a batched product write the same rows.
//
// Why: the flash kernels of attention.cuh run fp32 arithmetic on CUDA cores (~10-25 TFLOP/s on an
// H200); here the FLOPs go to tensor cores, at the price of writing and reading the scores once
// per product (memory traffic that a fused tensor-core flash kernel would avoid: the next step).
#pragma once
#include "common.cuh"
#include "matmul.cuh"
#include "attention.cuh"
#include "../memory/cuda_workspace.h"  // attn_gemm_chunk, attn_gemm_work_bytes

typedef struct {
    float* S;              // [B*H, chunk, T] scores, then dP (fp32)
    bf16* P;               // [B*H, chunk, T] probabilities, then dS
    float *dk32, *dv32;    // [B*T, KVH*hd] dK and dV sums (backward)
    float* D;              // [B, H, T] rowsum(dO * O) (backward)
    void** ptrs;           // every batched product's A, B, C pointer arrays (3 x B*H each)
    int chunk;
} AttnGemmWork;

static AttnGemmWork attn_gemm_work(void* base, const AttnShape* s, int backward) {
    int64_t bh = (int64_t)s->B * s->H, nk = (int64_t)s->B * s->T * s->KVH * s->hd;
    AttnGemmWork w;
    memset(&w, 0, sizeof(w));
    w.chunk = attn_gemm_chunk(s);
    uint8_t* p = (uint8_t*)base;
    w.S = (float*)p; p += round_up(bh * w.chunk * s->T * 4, 256);
    w.P = (bf16*)p; p += round_up(bh * w.chunk * s->T * 2, 256);
    w.ptrs = (void**)p; p += round_up(attn_gemm_products(s) * 3 * bh * sizeof(void*), 256);
    if (backward) {
        w.dk32 = (float*)p; p += round_up(nk * 4, 256);
        w.dv32 = (float*)p; p += round_up(nk * 4, 256);
        w.D = (float*)p;
    }
    return w;
}

// ---- kernels ---------------------------------------------------------------------------------

// One warp per query row of the chunk [r0, r0 + rows): the row's allowed keys (causal: up to the
// row, and from the start of its packed example; all T otherwise) among the first kc. forward = 1:
// lse from the row's scores, written to lse; else lse is read. P = exp(S - lse) there, 0 elsewhere.
__global__ void attn_probs_kernel(bf16* __restrict__ P, float* __restrict__ lse, const float* __restrict__ S, int r0,
                                  int rows, int chunk, int kc, AttnShape s, int forward) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= (int64_t)s.B * s.H * rows) return;
    int64_t e = row / rows;
    int ii = (int)(row % rows), i = r0 + ii, b = (int)(e / s.H);
    int j0 = s.causal && s.pos ? i - s.pos[(int64_t)b * s.T + i] : 0, j1 = s.causal ? i + 1 : s.T;
    if (j1 > kc) j1 = kc;
    const float* Sr = S + (e * chunk + ii) * (int64_t)s.T;
    bf16* Pr = P + (e * chunk + ii) * (int64_t)s.T;
    float* L = lse + (e * s.T + i);
    float l;
    if (forward) {
        float mx = -INFINITY;
        for (int j = j0 + lane; j < j1; j += 32) mx = fmaxf(mx, Sr[j]);
        mx = warp_reduce_max(mx);
        float sum = 0.0f;
        for (int j = j0 + lane; j < j1; j += 32) sum += expf(Sr[j] - mx);
        sum = warp_reduce_sum(sum);
        l = mx + logf(sum);
        if (lane == 0) *L = l;
    } else {
        l = *L;
    }
    for (int j = lane; j < kc; j += 32) Pr[j] = f2bf(j >= j0 && j < j1 ? expf(Sr[j] - l) : 0.0f);
}

// dS = P (dP - D) over the chunk's rows and first kc keys, written over P (bf16). Masked keys
// have P = 0, hence dS = 0.
__global__ void attn_dscores_kernel(bf16* __restrict__ P, const float* __restrict__ dP, const float* __restrict__ D,
                                    int r0, int rows, int chunk, int kc, AttnShape s) {
    int64_t total = (int64_t)s.B * s.H * rows * kc;
    for (int64_t idx = thread_index_1d(); idx < total; idx += grid_stride_1d()) {
        int j = (int)(idx % kc);
        int64_t row = idx / kc, e = row / rows;
        int ii = (int)(row % rows);
        int64_t at = (e * chunk + ii) * (int64_t)s.T + j;
        P[at] = f2bf(bf2f(P[at]) * (dP[at] - D[e * s.T + r0 + ii]));
    }
}

// ---- one batched product over (batch, head) entries --------------------------------------------

typedef enum { AT_Q, AT_K, AT_V, AT_O, AT_DO, AT_DQ, AT_DK32, AT_DV32, AT_S, AT_P } AttnOperand;

// A call runs its loop twice: first recording every product's pointer arrays on the host, which
// go to the device in one copy, then issuing the products and kernels. (A copy from pageable
// memory waits for the stream; one per product would stall the GPU between products.)
typedef struct {           // where each operand of entry (b, h) starts, chunk rows from r0
    const AttnShape* s;
    const AttnGemmWork* w;
    const void *q, *k, *v, *o, *dout;
    void* dq;
    int r0;
    void** host;           // recording pass: the pointer arrays; NULL when issuing
    int64_t slot;          // the next product's arrays: w->ptrs + slot * 3 * B*H
} AttnOperands;

static void* attn_operand(const AttnOperands* a, AttnOperand which, int b, int h) {
    const AttnShape* s = a->s;
    int kh = h / (s->H / s->KVH);
    int64_t e = (int64_t)b * s->H + h, qrow = ((int64_t)b * s->T + a->r0) * s->H * s->hd + (int64_t)h * s->hd,
            krow = (int64_t)b * s->T * s->KVH * s->hd + (int64_t)kh * s->hd, sc = e * a->w->chunk * s->T;
    switch (which) {
    case AT_Q: return (bf16*)a->q + qrow;
    case AT_O: return (bf16*)a->o + qrow;
    case AT_DO: return (bf16*)a->dout + qrow;
    case AT_DQ: return (bf16*)a->dq + qrow;
    case AT_K: return (bf16*)a->k + krow;
    case AT_V: return (bf16*)a->v + krow;
    case AT_DK32: return a->w->dk32 + krow;
    case AT_DV32: return a->w->dv32 + krow;
    case AT_S: return a->w->S + sc;
    default: return a->w->P + sc;
    }
}

// C = alpha op(A) op(B) (+ C) for every head h = group_slot + g * (H/KVH) of every batch row when
// group_slot >= 0 (one head per kv group: dK/dV sums), else for all heads.
static void attn_batched(const AttnOperands* a, MatmulForm form, AttnOperand A, AttnOperand B, AttnOperand C,
                         cudaDataType_t ctype, int M, int N, int K, int lda, int ldb, int ldc, float alpha,
                         int accumulate, int group_slot, cudaStream_t st) {
    const AttnShape* s = a->s;
    int group = s->H / s->KVH, n = group_slot >= 0 ? s->B * s->KVH : s->B * s->H;
    int64_t bh = (int64_t)s->B * s->H;
    AttnOperands* mut = (AttnOperands*)a;
    int64_t at = 3 * bh * mut->slot++;
    if (a->host) {
        void** h = a->host + at;
        for (int b = 0, e = 0; b < s->B; b++)
            for (int i = 0; i < n / s->B; i++, e++) {
                int head = group_slot >= 0 ? i * group + group_slot : i;
                h[e] = attn_operand(a, A, b, head);
                h[bh + e] = attn_operand(a, B, b, head);
                h[2 * bh + e] = attn_operand(a, C, b, head);
            }
        return;
    }
    void** d = a->w->ptrs + at;
    matmul_batched_cuda(form, d + 2 * bh, ctype, (const void* const*)d, (const void* const*)(d + bh), M, N, K, lda, ldb,
                        ldc, alpha, accumulate, n, st);
}

// ---- forward and backward --------------------------------------------------------------------

static void attention_forward_gemm_cuda(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v, AttnShape s,
                                        void* work, cudaStream_t st) {
    if ((int64_t)s.B * s.T * s.H == 0) return;
    AttnGemmWork w = attn_gemm_work(work, &s, 0);
    int qld = s.H * s.hd, kld = s.KVH * s.hd;
    float scale = 1.0f / sqrtf((float)s.hd);
    AttnOperands a = {&s, &w, q, k, v, o, NULL, NULL, 0, NULL, 0};
    void** host = (void**)xmalloc(sizeof(void*) * 3 * (int64_t)s.B * s.H * attn_gemm_products(&s));
    for (int pass = 0; pass < 2; pass++) {
        a.host = pass == 0 ? host : NULL;
        a.slot = 0;
        if (pass == 1)
            CUDA_CHECK(cudaMemcpyAsync(w.ptrs, host, sizeof(void*) * 3 * (int64_t)s.B * s.H * attn_gemm_products(&s),
                                       cudaMemcpyHostToDevice, st));
        for (int r0 = 0; r0 < s.T; r0 += w.chunk) {
            int rows = s.T - r0 < w.chunk ? s.T - r0 : w.chunk, kc = s.causal ? r0 + rows : s.T;
            a.r0 = r0;
            attn_batched(&a, MM_NT, AT_Q, AT_K, AT_S, CUDA_R_32F, rows, kc, s.hd, qld, kld, s.T, scale, 0, -1, st);
            int64_t nrows = (int64_t)s.B * s.H * rows;
            if (pass == 1)
                launch_kernel(ceil_div(nrows * 32, 256), 256, 0, st, attn_probs_kernel, w.P, lse, w.S, r0, rows,
                              w.chunk, kc, s, 1);
            attn_batched(&a, MM_NN, AT_P, AT_V, AT_O, CUDA_R_16BF, rows, s.hd, kc, s.T, kld, qld, 1.0f, 0, -1, st);
        }
    }
    free(host);
}

static void attention_backward_gemm_cuda(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                                         const bf16* v, const bf16* o, const float* lse, AttnShape s, void* work,
                                         cudaStream_t st) {
    if ((int64_t)s.B * s.T * s.H == 0) return;
    AttnGemmWork w = attn_gemm_work(work, &s, 1);
    int qld = s.H * s.hd, kld = s.KVH * s.hd, group = s.H / s.KVH;
    int64_t nk = (int64_t)s.B * s.T * kld;
    float scale = 1.0f / sqrtf((float)s.hd);
    CUDA_CHECK(cudaMemsetAsync(w.dk32, 0, sizeof(float) * nk, st));
    CUDA_CHECK(cudaMemsetAsync(w.dv32, 0, sizeof(float) * nk, st));
    int64_t all_rows = (int64_t)s.B * s.T * s.H;
    launch_kernel(grid_for(all_rows * 32, 256), 256, 0, st, attention_backward_preprocess_kernel, w.D, dout, o, s);
    AttnOperands a = {&s, &w, q, k, v, o, dout, dq, 0, NULL, 0};
    int64_t ptr_count = 3 * (int64_t)s.B * s.H * attn_gemm_products(&s);
    void** host = (void**)xmalloc(sizeof(void*) * ptr_count);
    for (int pass = 0; pass < 2; pass++) {
        int run = pass == 1;
        a.host = run ? NULL : host;
        a.slot = 0;
        if (run) CUDA_CHECK(cudaMemcpyAsync(w.ptrs, host, sizeof(void*) * ptr_count, cudaMemcpyHostToDevice, st));
        for (int r0 = 0; r0 < s.T; r0 += w.chunk) {
            int rows = s.T - r0 < w.chunk ? s.T - r0 : w.chunk, kc = s.causal ? r0 + rows : s.T;
            int64_t nrows = (int64_t)s.B * s.H * rows;
            a.r0 = r0;
            attn_batched(&a, MM_NT, AT_Q, AT_K, AT_S, CUDA_R_32F, rows, kc, s.hd, qld, kld, s.T, scale, 0, -1, st);
            if (run)
                launch_kernel(ceil_div(nrows * 32, 256), 256, 0, st, attn_probs_kernel, w.P, (float*)lse, w.S, r0, rows,
                              w.chunk, kc, s, 0);
            for (int g = 0; g < group; g++)
                attn_batched(&a, MM_TN, AT_P, AT_DO, AT_DV32, CUDA_R_32F, kc, s.hd, rows, s.T, qld, kld, 1.0f, 1, g,
                             st);
            attn_batched(&a, MM_NT, AT_DO, AT_V, AT_S, CUDA_R_32F, rows, kc, s.hd, qld, kld, s.T, 1.0f, 0, -1, st);
            if (run)
                launch_kernel(grid_for(nrows * kc, 256), 256, 0, st, attn_dscores_kernel, w.P, w.S, w.D, r0, rows,
                              w.chunk, kc, s);
            attn_batched(&a, MM_NN, AT_P, AT_K, AT_DQ, CUDA_R_16BF, rows, s.hd, kc, s.T, kld, qld, scale, 0, -1, st);
            for (int g = 0; g < group; g++)
                attn_batched(&a, MM_TN, AT_P, AT_Q, AT_DK32, CUDA_R_32F, kc, s.hd, rows, s.T, qld, kld, scale, 1, g,
                             st);
        }
    }
    free(host);
    cast_f32_to_bf16_cuda(dk, w.dk32, nk, st);
    cast_f32_to_bf16_cuda(dv, w.dv32, nk, st);
}
