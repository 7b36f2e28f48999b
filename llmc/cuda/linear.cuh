// cuda/linear.cuh: the linear layer with its optional LoRA adapter on the CUDA backend, the twin
// of linear_forward / linear_backward in llmc/linear.h, on the same Linear: the CUDA copy of the
// layer is L->dev (LinearDevice). y (+)= x W^T + bias + scale * (x A^T) B^T.
// Frozen W and bias are bf16; the adapter's fp32 masters A, B (updated by AdamW) are used through
// their bf16 shadows A16, B16 (refreshed by the trainable arena after every optimizer step); ax =
// x A^T is kept in bf16 (rank columns per token); dA, dB and, under full fine-tuning, dW are
// accumulated in fp32 straight from the bf16 products (bf16 x bf16 -> fp32 matmul path, beta = 1
// across micro-batches). See matmul.cuh for the precision policy. An adapter behind a merged norm
// (L->norm_gamma, --ms-lora exact; llmc/linear.h says the math) applies bf16(A diag(gamma)), formed
// from the fp32 master each call, and adds bf16(A16 beta) in the product's epilogue. Training with
// --lora-dropout, the adapter reads bf16(dropout(gamma*x + beta)) formed in a scratch, forward and
// again in the backward, from the hash of llmc/lora_dropout.h (the twins are in llmc/linear.h).
// Under --quant nf4 (L->nf4) W is a shared scratch, refilled by nf4_dequantize_cuda before the
// forward product and before the input-gradient product.
#pragma once
#include "common.cuh"
#include "matmul.cuh"
#include "misc.cuh"
#include "nf4.cuh"
#include "../linear.h"

// Ag = bf16(A diag(gamma)) from the fp32 master A [r, in]: one rounding. Twin of lora_fold_gamma.
__global__ void lora_fold_gamma_kernel(bf16* __restrict__ Ag, const float* __restrict__ A,
                                       const bf16* __restrict__ gamma, int rank, int in) {
    for (int64_t i = thread_index_1d(); i < (int64_t)rank * in; i += grid_stride_1d())
        Ag[i] = f2bf(A[i] * bf2f(gamma[i % in]));
}

// dA += G diag(gamma) + colsum beta^T (beta NULL: no second term). Twin of lora_norm_grad.
__global__ void lora_norm_grad_kernel(float* dA, const float* __restrict__ G, const bf16* __restrict__ gamma,
                                      const bf16* __restrict__ beta, const float* __restrict__ colsum, int rank,
                                      int in) {
    for (int64_t k = thread_index_1d(); k < (int64_t)rank * in; k += grid_stride_1d()) {
        int64_t i = k / in, j = k % in;
        dA[k] += G[k] * bf2f(gamma[j]) + (beta ? colsum[i] * bf2f(beta[j]) : 0.0f);
    }
}

// Where a layer's masks start: the key and the stream position of its first element. Given as arguments
// (key, e0; the dev/cuda checks and the probes, which bind no device copy), or formed by the kernel
// from the micro-batch's step and first row in device memory (at, uploaded with the batch:
// llmc/lora_dropout.h) and what is fixed for the run and the shape (seed, the layer's id, an MLP tile's
// row offset), so that a captured CUDA graph draws each micro-batch's own masks. The same mixing either
// way: the same bits.
struct DropoutOrigin {
    uint64_t key, e0;         // the arguments' form (at NULL)
    const LoraDropoutAt* at;  // device memory, or NULL
    uint64_t seed;
    int64_t row_off;
    uint32_t id;
};
static DropoutOrigin lora_dropout_origin(const Linear* L) {
    const LoraDropout* d = L->drop;
    DropoutOrigin o = {0, 0, d->at, d->seed, d->row_off, L->drop_id};
    if (!d->at) { o.key = lora_dropout_layer_key(L); o.e0 = lora_dropout_layer_e0(L); }
    return o;
}
__device__ static inline void dropout_origin_resolve(const DropoutOrigin& o, int in, uint64_t* key, uint64_t* e0) {
    if (!o.at) { *key = o.key; *e0 = o.e0; return; }
    *key = lora_dropout_key(o.seed, o.at->step, o.id);
    *e0 = (uint64_t)(o.at->row0 + o.row_off) * (uint64_t)in;
}

// xa = bf16(dropout(u)), u = fmaf(gamma, x, beta) in fp32 (x alone without a norm): the
// adapter's input under --lora-dropout. Twin of lora_dropout_input.
__global__ void lora_dropout_input_kernel(bf16* __restrict__ xa, const bf16* __restrict__ x,
                                          const bf16* __restrict__ gamma, const bf16* __restrict__ beta,
                                          DropoutOrigin origin, uint32_t threshold, float scale, int64_t n, int in) {
    uint64_t key, e0;
    dropout_origin_resolve(origin, in, &key, &e0);
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) {
        int j = (int)(i % in);
        float u = gamma ? fmaf(bf2f(gamma[j]), bf2f(x[i]), beta ? bf2f(beta[j]) : 0.0f) : bf2f(x[i]);
        xa[i] = f2bf(lora_dropout_keep(key, e0 + (uint64_t)i, threshold) ? u * scale : 0.0f);
    }
}

// dx += bf16(keep * scale * gamma * t), t = dax A (bf16): the input gradient through the dropout.
// Twin of lora_dropout_input_backward.
__global__ void lora_dropout_input_backward_kernel(bf16* dx, const bf16* __restrict__ t, const bf16* __restrict__ gamma,
                                                   DropoutOrigin origin, uint32_t threshold, float scale, int64_t n,
                                                   int in) {
    uint64_t key, e0;
    dropout_origin_resolve(origin, in, &key, &e0);
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d())
        if (lora_dropout_keep(key, e0 + (uint64_t)i, threshold))
            dx[i] = f2bf(fmaf(bf2f(t[i]) * scale, gamma ? bf2f(gamma[i % in]) : 1.0f, bf2f(dx[i])));
}

// LLMC_LORA_FUSED: 1 (the default) runs the adapter's output product first and lets the frozen
// product add it in its epilogue (C = x W^T + C, beta 1); 0 runs it after the frozen product,
// reading and writing y (and, in the backward, dx) once more. Why: the adapter's products are
// skinny (K = rank) and bound by memory traffic, while the frozen one is bound by compute, where
// reading C in the epilogue overlaps its math. So where the layer writes its output (accumulate
// 0) the adapter's output product writes y or dx instead of reading and writing it: at
// Llama-3-8B, batch 1 x 4096, the forward's q, k, v, gate, up and the input gradients of q, o,
// gate, down, 4096 * (34,816 + 26,624) bf16 values per layer, 16 GB per step, leave the
// memory-bound kernels for the compute-bound ones (an output added to, a residual or a second
// target's input gradient, is read either way). The folds that would remove the adapter's
// passes altogether, [x | s xA^T] [W | B]^T and [dy | s dyB] [W ; A], need activations with rank
// spare columns (every producer of x and dy writing at a wider stride); not built. Read once per
// process; the first GPU run compares the two (scripts/ci/gpu_check.sh).
typedef enum { LORA_AFTER_FROZEN, LORA_IN_FROZEN_EPILOGUE } LoraFold;
static LoraFold lora_fold_choice(void) {
    return setting_on(SETTING_LORA_FUSED) ? LORA_IN_FROZEN_EPILOGUE : LORA_AFTER_FROZEN;
}


// Whether the adapter's part of a pass runs before the frozen part (which then adds to its
// output): the fold's order, for a layer with an adapter; the backward keeps the frozen part first
// under --lora-dropout, whose mask kernel adds to the finished dx. llmc/ops.h's op_linear_forward
// and op_linear_backward run the parts in this order (dev/cuda/matmul.cu checks both orders).
typedef enum { LINEAR_FORWARD, LINEAR_BACKWARD } LinearPass;
static int lora_runs_first(const Linear* L, LoraFold fold, LinearPass pass) {
    return L->dev.A && fold == LORA_IN_FROZEN_EPILOGUE && !(pass == LINEAR_BACKWARD && lora_dropout_on(L));
}

// y (+)= x W^T + bias: the frozen product (under --quant nf4 the caller refills W first,
// nf4_dequantize_cuda), its bias in the epilogue or added right after.
static void frozen_forward_cuda(bf16* y, const bf16* x, const Linear* L, int64_t N, int accumulate,
                                cudaStream_t stream) {
    const LinearDevice* D = &L->dev;
    const bf16* bias = (const bf16*)D->bias;
    if (matmul_generic_cuda(MM_NT, y, CUDA_R_16BF, x, D->W, CUDA_R_16BF, bias, (int)N, L->out, L->in, 1.0f, accumulate,
                            stream) == MM_BIAS_LEFT)
        launch_kernel(grid_for(N * L->out, 256), 256, 0, stream, add_bias_rows_kernel<bf16>, y, bias, N, L->out);
}

// The adapter's forward: ax = u A^T, kept for its backward, then y (+)= scale * ax B^T. u =
// dropout(x) while training with --lora-dropout; behind a merged norm, gamma*x + beta, as
// (A diag(gamma)) x + A beta; else x.
static void lora_forward_cuda(bf16* y, const bf16* x, const Linear* L, bf16* ax, int64_t N, int rank, float scale,
                              int accumulate, cudaStream_t stream) {
    const LinearDevice* D = &L->dev;
    if (lora_dropout_on(L)) {
        const LoraDropout* d = L->drop;
        bf16* xa = (bf16*)d->work;
        int64_t n = N * L->in;
        launch_kernel(grid_for(n, 256), 256, 0, stream, lora_dropout_input_kernel, xa, x, (const bf16*)L->norm_gamma,
                      (const bf16*)L->norm_beta, lora_dropout_origin(L), d->threshold, d->scale, n, L->in);
        matmul_nt_cuda(ax, xa, (const bf16*)D->A16, (int)N, rank, L->in, 1.0f, 0, stream);
    } else if (L->norm_gamma) {
        LoraNormWork w = lora_norm_work(L, rank, 2);
        launch_kernel(grid_for((int64_t)rank * L->in, 256), 256, 0, stream, lora_fold_gamma_kernel, (bf16*)w.Ag, D->A,
                      (const bf16*)L->norm_gamma, rank, L->in);
        if (L->norm_beta) {  // c = A16 beta, the bias of the product
            const bf16* c = (const bf16*)w.c;
            matmul_nt_cuda((bf16*)w.c, (const bf16*)L->norm_beta, (const bf16*)D->A16, 1, rank, L->in, 1.0f, 0, stream);
            if (matmul_generic_cuda(MM_NT, ax, CUDA_R_16BF, x, w.Ag, CUDA_R_16BF, c, (int)N, rank, L->in, 1.0f, 0,
                                    stream) == MM_BIAS_LEFT)
                launch_kernel(grid_for(N * rank, 256), 256, 0, stream, add_bias_rows_kernel<bf16>, ax, c, N, rank);
        } else {
            matmul_nt_cuda(ax, x, (const bf16*)w.Ag, (int)N, rank, L->in, 1.0f, 0, stream);
        }
    } else {
        matmul_nt_cuda(ax, x, (const bf16*)D->A16, (int)N, rank, L->in, 1.0f, 0, stream);
    }
    matmul_nt_cuda(y, ax, (const bf16*)D->B16, (int)N, L->out, rank, scale, accumulate, stream);
}

// The frozen part of the backward: dx (+)= dy W (dx NULL: none; under --quant nf4 the caller
// refills W first), and under full fine-tuning dW += dy^T x and (with dbias) db += sum_n dy.
static void frozen_backward_cuda(bf16* dx, const bf16* dy, const bf16* x, const Linear* L, int64_t N, int accumulate,
                                 cudaStream_t stream) {
    const LinearDevice* D = &L->dev;
    if (dx) matmul_nn_cuda(dx, dy, (const bf16*)D->W, (int)N, L->in, L->out, 1.0f, accumulate, stream);
    if (D->dW) matmul_tn_cuda(D->dW, dy, x, L->out, L->in, (int)N, 1.0f, 1, stream);
    if (D->dbias)
        launch_kernel(column_sums_grid(L->out), COLUMN_SUMS_BLOCK, 0, stream, column_sums_kernel<BiasGradTerm<bf16>>,
                      D->dbias, (float*)NULL, BiasGradTerm<bf16>{dy, L->out}, N, L->out);
}

// The adapter's backward: dB += scale dy^T ax, dax = scale dy B, dA += dax^T u, and dx (+)= the
// input gradient through the adapter (dx NULL: none). Under --lora-dropout the input gradient goes
// through the mask kernel, which adds to dx (dx_accumulate must be 1 there).
static void lora_backward_cuda(bf16* dx, const bf16* dy, const bf16* x, const bf16* ax, const Linear* L, bf16* dax,
                               int64_t N, int rank, float scale, int dx_accumulate, cudaStream_t stream) {
    const LinearDevice* D = &L->dev;
    int64_t n = N * L->in;
    matmul_tn_cuda(D->dB, dy, ax, L->out, rank, (int)N, scale, 1, stream);
    matmul_nn_cuda(dax, dy, (const bf16*)D->B16, (int)N, rank, L->out, scale, 0, stream);
    if (lora_dropout_on(L)) {  // the forward's adapter input, mask regenerated, then back through it
        if (dx && !dx_accumulate) fail("lora_backward_cuda: the dropout's input gradient adds to dx");
        const LoraDropout* d = L->drop;
        bf16* xa = (bf16*)d->work;
        launch_kernel(grid_for(n, 256), 256, 0, stream, lora_dropout_input_kernel, xa, x, (const bf16*)L->norm_gamma,
                      (const bf16*)L->norm_beta, lora_dropout_origin(L), d->threshold, d->scale, n, L->in);
        matmul_tn_cuda(D->dA, dax, xa, rank, L->in, (int)N, 1.0f, 1, stream);
        if (!dx) return;
        matmul_nn_cuda(xa, dax, (const bf16*)D->A16, (int)N, L->in, rank, 1.0f, 0, stream);
        launch_kernel(grid_for(n, 256), 256, 0, stream, lora_dropout_input_backward_kernel, dx, xa,
                      (const bf16*)L->norm_gamma, lora_dropout_origin(L), d->threshold, d->scale, n, L->in);
        return;
    }
    if (L->norm_gamma) {  // behind a merged norm: dA += (dax^T x) diag(gamma) + (sum_n dax_n) beta^T
        LoraNormWork w = lora_norm_work(L, rank, 2);
        const bf16 *gamma = (const bf16*)L->norm_gamma, *beta = (const bf16*)L->norm_beta;
        int64_t ri = (int64_t)rank * L->in;
        matmul_tn_cuda(w.G, dax, x, rank, L->in, (int)N, 1.0f, 0, stream);
        if (beta) {
            CUDA_CHECK(cudaMemsetAsync(w.colsum, 0, sizeof(float) * rank, stream));
            launch_kernel(column_sums_grid(rank), COLUMN_SUMS_BLOCK, 0, stream,
                          column_sums_kernel<BiasGradTerm<bf16>>, w.colsum, (float*)NULL, BiasGradTerm<bf16>{dax, rank},
                          N, rank);
        }
        launch_kernel(grid_for(ri, 256), 256, 0, stream, lora_norm_grad_kernel, D->dA, w.G, gamma, beta, w.colsum,
                      rank, L->in);
        if (!dx) return;
        launch_kernel(grid_for(ri, 256), 256, 0, stream, lora_fold_gamma_kernel, (bf16*)w.Ag, D->A, gamma, rank, L->in);
        matmul_nn_cuda(dx, dax, (const bf16*)w.Ag, (int)N, L->in, rank, 1.0f, dx_accumulate, stream);
        return;
    }
    matmul_tn_cuda(D->dA, dax, x, rank, L->in, (int)N, 1.0f, 1, stream);
    if (dx) matmul_nn_cuda(dx, dax, (const bf16*)D->A16, (int)N, L->in, rank, 1.0f, dx_accumulate, stream);
}
