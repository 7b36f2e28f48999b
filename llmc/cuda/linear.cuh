// cuda/linear.cuh: the linear layer with its optional LoRA adapter on the CUDA backend, the twin
// of linear_forward / linear_backward in llmc/lora.h, on the same Linear: the CUDA copy of the
// layer is L->dev (LinearDevice). y (+)= x W^T + bias + scale * (x A^T) B^T.
// Frozen W and bias are bf16; the adapter's fp32 masters A, B (updated by AdamW) are used through
// their bf16 shadows A16, B16 (refreshed by the trainable arena after every optimizer step); ax =
// x A^T is kept in bf16 (rank columns per token); dA, dB and, under full fine-tuning, dW are
// accumulated in fp32 straight from the bf16 products (bf16 x bf16 -> fp32 matmul path, beta = 1
// across micro-batches). See matmul.cuh for the precision policy.
#pragma once
#include "common.cuh"
#include "matmul.cuh"
#include "misc.cuh"
#include "../lora.h"

// y (+)= x W^T + bias + scale * (x A^T) B^T, keeping ax = x A^T for the LoRA backward.
// accumulate = 1 adds to y (a residual connection), bias included.
static void linear_forward_cuda(bf16* y, const bf16* x, const Linear* L, bf16* ax, int64_t N, int rank, float scale, int accumulate,
                                cudaStream_t stream) {
    const LinearDevice* D = &L->dev;
    if (D->bias) matmul_nt_bias_cuda(y, x, (const bf16*)D->W, (const bf16*)D->bias, (int)N, L->out, L->in, 1.0f, accumulate, stream);
    else matmul_nt_cuda(y, x, (const bf16*)D->W, (int)N, L->out, L->in, 1.0f, accumulate, stream);
    if (!D->A) return;
    matmul_nt_cuda(ax, x, (const bf16*)D->A16, (int)N, rank, L->in, 1.0f, 0, stream);
    matmul_nt_cuda(y, ax, (const bf16*)D->B16, (int)N, L->out, rank, scale, 1, stream);
}

// Given dy [N, out]: LoRA grads accumulate (fp32); dx (+)= dy W + scale * (dy B) A; under full
// fine-tuning dW += dy^T x and (with dbias) db += sum_n dy. dax is a [N, rank] bf16 scratch.
// dx NULL: no input gradient (the patch embedding).
static void linear_backward_cuda(bf16* dx, const bf16* dy, const bf16* x, const bf16* ax, const Linear* L, bf16* dax, int64_t N,
                                 int rank, float scale, int accumulate, cudaStream_t stream) {
    const LinearDevice* D = &L->dev;
    if (dx) matmul_nn_cuda(dx, dy, (const bf16*)D->W, (int)N, L->in, L->out, 1.0f, accumulate, stream);
    if (D->dW) matmul_tn_cuda(D->dW, dy, x, L->out, L->in, (int)N, 1.0f, 1, stream);
    if (D->dbias) bias_grad_rows_cuda(D->dbias, dy, N, L->out, stream);
    if (!D->A) return;
    matmul_tn_cuda(D->dB, dy, ax, L->out, rank, (int)N, scale, 1, stream);
    matmul_nn_cuda(dax, dy, (const bf16*)D->B16, (int)N, rank, L->out, scale, 0, stream);
    matmul_tn_cuda(D->dA, dax, x, rank, L->in, (int)N, 1.0f, 1, stream);
    matmul_nn_cuda(dx, dax, (const bf16*)D->A16, (int)N, L->in, rank, 1.0f, 1, stream);
}
