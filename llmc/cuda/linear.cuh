// cuda/linear.cuh: the linear layer with its optional LoRA adapter on the CUDA backend, the twin
// of linear_forward / linear_backward in llmc/lora.h: y (+)= x W^T + bias + scale * (x A^T) B^T.
// Frozen W and bias are bf16; the adapter's fp32 masters A, B (updated by AdamW) are used through
// bf16 shadows A16, B16 (lora_refresh_shadows_cuda after every optimizer step); ax = x A^T is kept
// in bf16 (rank columns per token); dA and dB are accumulated in fp32 straight from the bf16
// products (bf16 x bf16 -> fp32 matmul path, beta = 1 across micro-batches). See matmul.cuh for the
// precision policy.
#pragma once
#include "common.cuh"
#include "matmul.cuh"
#include "misc.cuh"

typedef struct {
    int in, out;
    const bf16* W;         // [out, in] frozen
    const bf16* bias;      // [out] frozen, or NULL
    float *A, *B;          // LoRA masters [r, in], [out, r] fp32; NULL when not a target
    bf16 *A16, *B16;       // their bf16 shadows, what the products read
    float *dA, *dB;        // gradients, fp32, accumulated over micro-batches
} LinearCuda;

// Copies the fp32 masters into the bf16 shadows (after each optimizer step, and at init).
static void lora_refresh_shadows_cuda(const LinearCuda* L, int rank, cudaStream_t stream) {
    if (!L->A) return;
    cast_f32_to_bf16_cuda(L->A16, L->A, (int64_t)rank * L->in, stream);
    cast_f32_to_bf16_cuda(L->B16, L->B, (int64_t)rank * L->out, stream);
}

// y (+)= x W^T + bias + scale * (x A^T) B^T, keeping ax = x A^T for the LoRA backward.
// accumulate = 1 adds to y (a residual connection), bias included.
static void linear_forward_cuda(bf16* y, const bf16* x, const LinearCuda* L, bf16* ax, int64_t N, int rank, float scale,
                                int accumulate, cudaStream_t stream) {
    if (L->bias) matmul_nt_bias_cuda(y, x, L->W, L->bias, (int)N, L->out, L->in, 1.0f, accumulate, stream);
    else matmul_nt_cuda(y, x, L->W, (int)N, L->out, L->in, 1.0f, accumulate, stream);
    if (!L->A) return;
    matmul_nt_cuda(ax, x, L->A16, (int)N, rank, L->in, 1.0f, 0, stream);
    matmul_nt_cuda(y, ax, L->B16, (int)N, L->out, rank, scale, 1, stream);
}

// Given dy [N, out]: LoRA grads accumulate (fp32); dx (+)= dy W + scale * (dy B) A. dax is a
// [N, rank] bf16 scratch. W and the bias are frozen: no gradient.
static void linear_backward_cuda(bf16* dx, const bf16* dy, const bf16* x, const bf16* ax, const LinearCuda* L, bf16* dax,
                                 int64_t N, int rank, float scale, int accumulate, cudaStream_t stream) {
    matmul_nn_cuda(dx, dy, L->W, (int)N, L->in, L->out, 1.0f, accumulate, stream);
    if (!L->A) return;
    matmul_tn_cuda(L->dB, dy, ax, L->out, rank, (int)N, scale, 1, stream);
    matmul_nn_cuda(dax, dy, L->B16, (int)N, rank, L->out, scale, 0, stream);
    matmul_tn_cuda(L->dA, dax, x, rank, L->in, (int)N, 1.0f, 1, stream);
    matmul_nn_cuda(dx, dax, L->A16, (int)N, L->in, rank, 1.0f, 1, stream);
}
