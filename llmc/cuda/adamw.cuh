// cuda/adamw.cuh: the optimizer step and gradient-norm helpers over one flat fp32 array on the
// device, the twins of llmc/cpu/adamw.h. Master weights, gradients and both moments are fp32
// (LoRA adapters and a head, or under --full every weight, ZeRO-1 sharding the moments across
// ranks: llmc/train/zero.h). The bias corrections are computed on the
// host exactly as the CPU twin does, so both backends apply the same update to ~1 ulp (FMA
// contraction on the device is the only difference).
#pragma once
#include "common.cuh"

// What changes from one optimizer step to the next: the learning rate, the two bias corrections
// and the factor clipping multiplies the gradients by. The trainer keeps them in device memory
// (adamw_update_dev_cuda and scale_inplace_dev_cuda read them there), so that the step's kernels
// take no argument that changes per step (a CUDA graph replays its kernels with the arguments they
// were captured with); they are computed on the host exactly as the CPU twin computes them, so
// reading them from memory changes no bit of the update.
typedef struct {
    float lr, bc1, bc2;
    float clip;  // the gradients' factor on a step that clips (grad_clip / norm), else 1
} AdamWStep;
#define ADAMW_STEP_DOUBLES 2  // an AdamWStep fits in this many doubles (the trainer's scratch)

static AdamWStep adamw_step_values(float lr, float beta1, float beta2, int t) {
    AdamWStep s = {lr, 1.0f - powf(beta1, (float)t), 1.0f - powf(beta2, (float)t), 1.0f};
    return s;
}

// Decoupled AdamW (Loshchilov & Hutter). The step's values come from device memory (`at`), or,
// when `at` is NULL, from the argument `arg` (t is the 1-based step of the bias corrections).
__global__ void adamw_update_kernel(float* __restrict__ p, const float* __restrict__ g, float* __restrict__ m,
                                    float* __restrict__ v, int64_t n, const AdamWStep* __restrict__ at, AdamWStep arg,
                                    float beta1, float beta2, float eps, float weight_decay) {
    AdamWStep s = at ? *at : arg;
    float lr = s.lr, bc1 = s.bc1, bc2 = s.bc2;
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) {
        float gi = g[i];
        float mi = beta1 * m[i] + (1.0f - beta1) * gi;
        float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
        m[i] = mi;
        v[i] = vi;
        p[i] -= lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + weight_decay * p[i]);
    }
}
// The step's values read from device memory `at` (written there before, in stream order): every
// argument is the same at every step.
static void adamw_update_dev_cuda(float* p, const float* g, float* m, float* v, int64_t n, const AdamWStep* at,
                                  float beta1, float beta2, float eps, float weight_decay, cudaStream_t stream) {
    if (n == 0) return;
    const AdamWStep unused = {0.0f, 1.0f, 1.0f, 1.0f};
    launch_kernel(grid_for(n, 256), 256, 0, stream, adamw_update_kernel, p, g, m, v, n, at, unused, beta1, beta2,
                  eps, weight_decay);
}

// Sum of squares in double, in two deterministic stages: SUMSQ_BLOCKS partial sums (each block
// a grid-stride slice), then one block adds them in order.
#define SUMSQ_BLOCKS 512
#define SUM_SQUARES_SCRATCH (SUMSQ_BLOCKS + 1)  // doubles of scratch sum_squares_into_cuda needs

__global__ void sum_squares_partial_kernel(double* __restrict__ partial, const float* __restrict__ g, int64_t n) {
    double s = 0.0;
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) s += (double)g[i] * g[i];
    s = block_reduce_sum_double(s);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}
// *out = sum of the partials, or *out += it when accumulate (the host's `s += range` in order).
__global__ void sum_partials_kernel(double* __restrict__ out, const double* __restrict__ partial, int count,
                                    int accumulate) {
    double s = 0.0;
    for (int i = threadIdx.x; i < count; i += blockDim.x) s += partial[i];
    s = block_reduce_sum_double(s);
    if (threadIdx.x == 0) *out = accumulate ? *out + s : s;
}

// sum g^2 into device *out (added to it when `accumulate` is SUMSQ_ADD), with no readback.
// scratch: SUM_SQUARES_SCRATCH doubles.
enum { SUMSQ_SET = 0, SUMSQ_ADD = 1 };
static void sum_squares_into_cuda(double* out, int accumulate, const float* g, int64_t n, double* scratch,
                                  cudaStream_t stream) {
    launch_kernel(SUMSQ_BLOCKS, 256, 0, stream, sum_squares_partial_kernel, scratch, g, n);
    launch_kernel(1, 256, 0, stream, sum_partials_kernel, out, scratch, SUMSQ_BLOCKS, accumulate);
}

// x *= s, s read from device memory `at` when it is not NULL.
__global__ void scale_inplace_kernel(float* x, int64_t n, const float* __restrict__ at, float s) {
    if (at) s = *at;
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) x[i] *= s;
}
// x *= *at, the factor in device memory (clipping's, AdamWStep.clip).
static void scale_inplace_dev_cuda(float* x, int64_t n, const float* at, cudaStream_t stream) {
    if (n == 0) return;
    launch_kernel(grid_for(n, 256), 256, 0, stream, scale_inplace_kernel, x, n, at, 1.0f);
}
