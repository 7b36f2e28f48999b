// dev/cuda/loss_scalar.cuh: the single-pass scalar cross-entropy kernel that llmc/cuda/loss.cuh's
// softmax_ce_rows_vec_kernel replaced (three passes over each row: max, sum of exponentials,
// gradient), kept here as the reference version of the op, as llm.c keeps its numbered kernels:
// dev/cuda/loss.cu checks it against the CPU twin and against the production kernel. Not part of the
// trainers (it was their LLMC_CE_KERNEL=scalar until issue 35).
#pragma once
#include "../../llmc/cuda/loss.cuh"

// One block per row of logits [rows, V]: writes row_stats[row] and, when grad, dlogits[row].
// A target outside [0, V) gives a NaN loss (never a wild read), so it cannot pass unnoticed.
template <class T>
__global__ void __launch_bounds__(CE_THREADS)
    softmax_ce_rows_kernel(T* __restrict__ dlogits, float* __restrict__ row_stats, const float* __restrict__ logits,
                           const int* __restrict__ targets, const float* __restrict__ mask, int V, float grad_scale,
                           const float* __restrict__ grad_scale_at, int grad) {
    int64_t row = blockIdx.x;
    const float* x = logits + row * V;
    float m = mask ? mask[row] : 1.0f;
    int target = targets[row];

    MaxLoc best = {-INFINITY, INT64_MAX};
    for (int v = threadIdx.x; v < V; v += blockDim.x)
        if (x[v] > best.v) best = MaxLoc{x[v], (int64_t)v};  // increasing v: keeps this thread's first max
    best = block_reduce_maxloc(best);
    float mx = best.v;

    float sum = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) sum += expf(x[v] - mx);
    sum = block_reduce_sum(sum);
    float lse = mx + logf(sum);

    if (threadIdx.x == 0) ce_row_stats(row_stats, row, x, target, V, m, lse, best.i);
    if (!grad) return;
    float w = ce_row_weight(m, grad_scale, grad_scale_at);
    T* dl = dlogits + row * V;
    for (int v = threadIdx.x; v < V; v += blockDim.x) {
        float g = w * expf(x[v] - lse) - (v == target ? w : 0.0f);
        dl[v] = (T)g;
    }
}

template <class T>
static void softmax_ce_rows_scalar_launch(T* dlogits, float* row_stats, const float* logits, const int* targets,
                                          const float* mask, int64_t rows, int V, float grad_scale,
                                          const float* grad_scale_at, int grad, cudaStream_t stream) {
    if (rows == 0) return;
    launch_kernel((unsigned)rows, CE_THREADS, 0, stream, softmax_ce_rows_kernel<T>, dlogits, row_stats, logits, targets,
                  mask, V, grad_scale, grad_scale_at, grad);
}
