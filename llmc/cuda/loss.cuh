// cuda/loss.cuh: final RMSNorm + LM head + cross-entropy, fused and chunked over tokens, the twin
// of llmc/cpu/loss.h: only chunk x vocab logits ever exist. Per chunk: the norm (fp32 r), the
// logits from cuBLASLt (bf16 x bf16 -> fp32, so the softmax sees unrounded logits), one block per
// row computes max/argmax, log-sum-exp, the masked loss and, in training, dlogits =
// w * (softmax - onehot) with w = mask * grad_scale (as bf16: the operand of the next product),
// then dz = dlogits W and the norm's backward ACCUMULATE into dxf. Loss, count and correct (and
// the final-norm rows whose statistics left fp32's range: a diverged run, llmc/train/health.h) are
// summed on the device in double, chunk by chunk in a fixed order (deterministic), and copied to
// the host once per call.
//
// softmax_ce_rows_cuda and loss_stats_accumulate_cuda are the pieces, usable on their own (the
// ViT head: a few rows of `classes` logits).
#pragma once
#include "common.cuh"
#include "matmul.cuh"
#include "norms.cuh"
#include "vec.cuh"
#include "../cpu/loss.h"  // LossStats, shared with the CPU twin

typedef struct {           // scratch for one chunk (and the device statistics), from the plan
    bf16* z;               // [chunk, d]
    float* r;              // [chunk]
    float* logits;         // [chunk, V] fp32
    bf16* dlogits;         // [chunk, V]
    bf16* dz;              // [chunk, d]
    float* row_stats;      // [chunk, 3]: mask * CE, mask, mask * [argmax == target]
    double* stats;         // [4]: loss_sum, count, correct, overflowed (LossStats)
} LossScratchCuda;

#define CE_THREADS 512

// Row `row`'s statistics (loss, count, correct; masked rows add nothing) from its log-sum-exp and
// argmax, by one thread. A target outside [0, V) gives a NaN loss (never a wild read).
static __device__ void ce_row_stats(float* row_stats, int64_t row, const float* x, int target, int V, float m,
                                    float lse, int64_t argmax) {
    float loss = target >= 0 && target < V ? lse - x[target] : NAN;
    row_stats[row * 3 + 0] = m != 0.0f ? m * loss : 0.0f;
    row_stats[row * 3 + 1] = m;
    row_stats[row * 3 + 2] = m != 0.0f ? m * (float)(argmax == target) : 0.0f;
}

// The gradient's weight of a row: its mask times the loss scale (read from device memory where
// grad_scale_at is given).
static __device__ float ce_row_weight(float m, float grad_scale, const float* grad_scale_at) {
    return m * (grad_scale_at ? *grad_scale_at : grad_scale);
}

// ---- the vectorised kernel: two passes over a row instead of three ------------------------
// The loss needs the row's max and sum of exponentials before any gradient element, so two
// passes are the fewest: one read (an online max and sum-exp: the sum is rescaled whenever the
// running max grows, with the first argmax alongside) and one read + write (dlogits), both in
// 16-byte vectors between a scalar head (up to the first aligned element) and tail. The old
// kernel reads the row three times (max, sum, gradient) one float at a time.

// One thread's (or a merged group's) running statistics: max m, sum of exp(x - m), first argmax i.
typedef struct { float m, s; int i; } SoftmaxRun;

static __device__ __forceinline__ void softmax_run_add(SoftmaxRun* r, float x, int v) {
    if (x > r->m) {  // a new max (strict: ties keep the lower index, visited first)
        r->s = r->s * expf(r->m - x) + 1.0f;
        r->m = x;
        r->i = v;
    } else if (x != -INFINITY) {  // exp(-inf) adds nothing (and -inf - -inf would be NaN); NaN poisons s
        r->s += expf(x - r->m);
    }
}
static __device__ __forceinline__ SoftmaxRun softmax_run_merge(SoftmaxRun a, SoftmaxRun b) {
    SoftmaxRun r;
    r.m = fmaxf(a.m, b.m);
    r.s = r.m == -INFINITY ? 0.0f : a.s * expf(a.m - r.m) + b.s * expf(b.m - r.m);
    r.i = (b.m > a.m || (b.m == a.m && b.i < a.i)) ? b.i : a.i;
    if (a.s != a.s || b.s != b.s) r.s = NAN;  // a NaN logit makes the loss NaN, as the old kernel's
    return r;
}
static __device__ SoftmaxRun block_reduce_softmax_run(SoftmaxRun r) {
    __shared__ float pm[32], ps[32];
    __shared__ int pi[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    for (int o = 16; o > 0; o >>= 1) {
        SoftmaxRun other = {__shfl_xor_sync(0xffffffffu, r.m, o), __shfl_xor_sync(0xffffffffu, r.s, o),
                            __shfl_xor_sync(0xffffffffu, r.i, o)};
        r = softmax_run_merge(r, other);
    }
    __syncthreads();
    if (lane == 0) { pm[warp] = r.m; ps[warp] = r.s; pi[warp] = r.i; }
    __syncthreads();
    SoftmaxRun none = {-INFINITY, 0.0f, INT_MAX};
    r = lane < nwarps ? SoftmaxRun{pm[lane], ps[lane], pi[lane]} : none;
    for (int o = 16; o > 0; o >>= 1) {
        SoftmaxRun other = {__shfl_xor_sync(0xffffffffu, r.m, o), __shfl_xor_sync(0xffffffffu, r.s, o),
                            __shfl_xor_sync(0xffffffffu, r.i, o)};
        r = softmax_run_merge(r, other);
    }
    return r;
}

// One block per row of logits [rows, V]: writes row_stats[row] and, when grad, dlogits[row] (the
// same per-element gradient formula as the CPU twin). A target outside [0, V) gives a NaN loss
// (never a wild read), so it cannot pass unnoticed.
template <class T>
__global__ void __launch_bounds__(CE_THREADS)
    softmax_ce_rows_vec_kernel(T* __restrict__ dlogits, float* __restrict__ row_stats,
                               const float* __restrict__ logits, const int* __restrict__ targets,
                               const float* __restrict__ mask, int V, float grad_scale,
                               const float* __restrict__ grad_scale_at, int grad) {
    int64_t row = blockIdx.x;
    const float* x = logits + row * V;
    float m = mask ? mask[row] : 1.0f;
    int target = targets[row];
    int tid = threadIdx.x, nt = blockDim.x;

    // pass 1: head (scalar, to the first 16-byte aligned float), body (float4), tail (scalar), each
    // thread's elements in increasing order
    SoftmaxRun run = {-INFINITY, 0.0f, INT_MAX};
    int head = elems_to_align16(x);
    if (head > V) head = V;
    int nvec = (V - head) / 4, tail0 = head + 4 * nvec;
    if (tid < head) softmax_run_add(&run, x[tid], tid);
    for (int k = tid; k < nvec; k += nt) {
        Vec16<float> f = load_vec16(x + head + 4 * k);
        for (int j = 0; j < 4; j++) softmax_run_add(&run, f.v[j], head + 4 * k + j);
    }
    if (tail0 + tid < V) softmax_run_add(&run, x[tail0 + tid], tail0 + tid);
    run = block_reduce_softmax_run(run);
    float lse = run.m + logf(run.s);

    if (tid == 0) ce_row_stats(row_stats, row, x, target, V, m, lse, run.i);
    if (!grad) return;

    // pass 2: dlogits in vectors of G = 16 / sizeof(T) elements (8 bf16, 4 fp32), the logits read
    // as G / 4 float4; the head aligns dlogits, and then the logits too (same flat index, wider
    // elements) unless a caller passed a logits pointer out of step with dlogits: then scalar
    float w = ce_row_weight(m, grad_scale, grad_scale_at);
    T* dl = dlogits + row * V;
    const int G = Vec16<T>::n;
    int h2 = elems_to_align16(dl);
    if (h2 > V || !aligned16(x + h2)) h2 = V;  // no common alignment: the whole row scalar
    int ngrp = (V - h2) / G, t2 = h2 + G * ngrp;
    for (int v = tid; v < h2; v += nt) dl[v] = (T)(w * expf(x[v] - lse) - (v == target ? w : 0.0f));
    for (int k = tid; k < ngrp; k += nt) {
        int v0 = h2 + G * k;
        Vec16<T> out;
        for (int q = 0; q < G / 4; q++) {
            Vec16<float> f = load_vec16(x + v0 + 4 * q);
            for (int j = 0; j < 4; j++) {
                int v = v0 + 4 * q + j;
                out.v[4 * q + j] = (T)(w * expf(f.v[j] - lse) - (v == target ? w : 0.0f));
            }
        }
        store_vec16(dl + v0, out);
    }
    for (int v = t2 + tid; v < V; v += nt) dl[v] = (T)(w * expf(x[v] - lse) - (v == target ? w : 0.0f));
}

// (The single-pass scalar kernel it replaced is dev/cuda/loss_scalar.cuh's, checked against this one.)
template <class T>
static void softmax_ce_rows_launch(T* dlogits, float* row_stats, const float* logits, const int* targets,
                                   const float* mask, int64_t rows, int V, float grad_scale, const float* grad_scale_at,
                                   int grad, cudaStream_t stream) {
    if (rows == 0) return;
    launch_kernel((unsigned)rows, CE_THREADS, 0, stream, softmax_ce_rows_vec_kernel<T>, dlogits, row_stats, logits,
                  targets, mask, V, grad_scale, grad_scale_at, grad);
}
// grad_scale_at (device memory, or NULL: grad_scale): the scale read by the kernel, so that a
// captured CUDA graph need not change when it does (llmc/cuda/graph.cuh)
static void softmax_ce_rows_cuda(bf16* dlogits, float* row_stats, const float* logits, const int* targets,
                                 const float* mask, int64_t rows, int V, float grad_scale, int grad,
                                 cudaStream_t stream, const float* grad_scale_at = NULL) {
    softmax_ce_rows_launch(dlogits, row_stats, logits, targets, mask, rows, V, grad_scale, grad_scale_at, grad, stream);
}
static void softmax_ce_rows_cuda(float* dlogits, float* row_stats, const float* logits, const int* targets,
                                 const float* mask, int64_t rows, int V, float grad_scale, int grad,
                                 cudaStream_t stream, const float* grad_scale_at = NULL) {
    softmax_ce_rows_launch(dlogits, row_stats, logits, targets, mask, rows, V, grad_scale, grad_scale_at, grad, stream);
}

// stats[k] += sum over rows of row_stats[row, k] (k = loss, count, correct), in double, by one
// block: a fixed summation order, so repeated runs give identical statistics.
__global__ void loss_stats_accumulate_kernel(double* stats, const float* __restrict__ row_stats, int64_t rows) {
    for (int k = 0; k < 3; k++) {
        double s = 0.0;
        for (int64_t r = threadIdx.x; r < rows; r += blockDim.x) s += row_stats[r * 3 + k];
        s = block_reduce_sum_double(s);
        if (threadIdx.x == 0) stats[k] += s;
    }
}
static void loss_stats_accumulate_cuda(double* stats, const float* row_stats, int64_t rows, cudaStream_t stream) {
    if (rows == 0) return;
    launch_kernel(1, 256, 0, stream, loss_stats_accumulate_kernel, stats, row_stats, rows);
}

// acc[k] += stats[k], k < n: one call's statistics into the step's, on the device (no readback).
// The same double additions, in the same order, as the host's sum over micro-batches.
__global__ void loss_stats_fold_kernel(double* acc, const double* stats, int n) {
    if (threadIdx.x == 0)
        for (int k = 0; k < n; k++) acc[k] += stats[k];
}
static void loss_stats_fold_cuda(double* acc, const double* stats, int n, cudaStream_t stream) {
    launch_kernel(1, 32, 0, stream, loss_stats_fold_kernel, acc, stats, n);
}

// Soft-capping of the logits (Gemma 2's final_logit_softcapping, llmc/softcap.h), the twins of
// lm_head_loss's loops: the fp32 logits capped in place, and the gradient w.r.t. the logits
// before the cap from the capped ones (which the CE kernel leaves as they are).
__global__ void softcap_kernel(float* logits, int64_t n, float cap) {
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) logits[i] = softcap_f(logits[i], cap);
}
__global__ void softcap_backward_kernel(bf16* dlogits, const float* __restrict__ logits, int64_t n, float cap) {
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d())
        dlogits[i] = f2bf(softcap_grad_f(bf2f(dlogits[i]), logits[i], cap));
}

// xf [N,d] final-norm input; W [V,d] head; dxf [N,d] accumulated when non-NULL; logits_out
// [N,V] (device, fp32) receives the logits when non-NULL (tests). targets [N] and mask [N] (NULL:
// all ones) live on the device. grad_scale = 1 / (masked tokens of the whole step). gamma NULL
// means an MS final norm (backward from z and r). Synchronises the stream once, to return st; st
// NULL: no readback, the statistics stay in sc.stats (a trainer's step adds them up on the device).
// Full fine-tuning: dW [V,d] and dgamma [d] (fp32) accumulate when non-NULL. softcap > 0: the
// logits are soft-capped.
static void lm_head_loss_cuda(const bf16* xf, const bf16* gamma, float eps, const bf16* W, int V, int d,
                              const int* targets, const float* mask, int64_t N, int chunk, float grad_scale, bf16* dxf,
                              float* logits_out, LossScratchCuda sc, LossStats* st, cudaStream_t stream,
                              float* dW = NULL, float* dgamma = NULL, const float* grad_scale_at = NULL,
                              float softcap = 0.0f) {
    if (chunk <= 0) fail("lm_head_loss_cuda: chunk must be positive");
    CUDA_CHECK(cudaMemsetAsync(sc.stats, 0, 4 * sizeof(double), stream));
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        int c = (int)(N - n0 < chunk ? N - n0 : chunk);
        rmsnorm_forward_cuda(sc.z, sc.r, xf + n0 * d, gamma, c, d, eps, stream);
        norm_overflowed_rows_cuda(sc.stats + 3, sc.r, c, stream);
        matmul_nt_cuda(sc.logits, sc.z, W, c, V, d, 1.0f, 0, stream);
        if (softcap > 0.0f)
            launch_kernel(grid_for((int64_t)c * V, 256), 256, 0, stream, softcap_kernel, sc.logits, (int64_t)c * V,
                          softcap);
        if (logits_out)
            CUDA_CHECK(cudaMemcpyAsync(logits_out + n0 * V, sc.logits, sizeof(float) * c * V, cudaMemcpyDeviceToDevice,
                                       stream));
        softmax_ce_rows_cuda(sc.dlogits, sc.row_stats, sc.logits, targets + n0, mask ? mask + n0 : NULL, c, V,
                             grad_scale, dxf != NULL, stream, grad_scale_at);
        loss_stats_accumulate_cuda(sc.stats, sc.row_stats, c, stream);
        if (!dxf) continue;
        if (softcap > 0.0f)
            launch_kernel(grid_for((int64_t)c * V, 256), 256, 0, stream, softcap_backward_kernel, sc.dlogits, sc.logits,
                          (int64_t)c * V, softcap);
        if (dW) matmul_tn_cuda(dW, sc.dlogits, sc.z, V, d, c, 1.0f, 1, stream);  // trained head: dW += dlogits^T z
        matmul_nn_cuda(sc.dz, sc.dlogits, W, c, d, V, 1.0f, 0, stream);
        if (dgamma) rmsnorm_gamma_grad_cuda(dgamma, sc.dz, xf + n0 * d, sc.r, c, d, stream);
        if (gamma) rmsnorm_backward_cuda(dxf + n0 * d, sc.dz, xf + n0 * d, sc.r, gamma, c, d, stream);
        else rmsnorm_ms_backward_cuda(dxf + n0 * d, sc.dz, sc.z, sc.r, c, d, stream);
    }
    if (!st) return;
    double h[4];
    CUDA_CHECK(cudaMemcpyAsync(h, sc.stats, sizeof(h), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    st->loss_sum += h[0];
    st->count += h[1];
    st->correct += h[2];
    st->overflowed += h[3];
}
