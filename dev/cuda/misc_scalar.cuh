// dev/cuda/misc_scalar.cuh: the scalar forms of llmc/cuda/misc.cuh's element-wise kernels (the
// product, the column scale, the fp32 <-> bf16 casts: one element per thread), which the production
// kernels run only where their operands are not aligned for 16-byte vectors, kept here alone as the
// reference version of each op, as llm.c keeps its numbered kernels: dev/cuda/misc.cu checks them
// against the CPU twin and the production kernels. Not part of the trainers. The *_launch functions
// run either form (KernelChoice).
#pragma once
#include "check.h"
#include "../../llmc/cuda/misc.cuh"

__global__ void multiply_scalar_kernel(bf16* out, const bf16* a, const bf16* b, int64_t n) {
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) out[i] = f2bf(bf2f(a[i]) * bf2f(b[i]));
}
// y may be x
__global__ void scale_columns_scalar_kernel(bf16* y, const bf16* x, const bf16* __restrict__ g, int64_t n, int d) {
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) y[i] = f2bf(bf2f(x[i]) * bf2f(g[i % d]));
}
__global__ void cast_f32_to_bf16_scalar_kernel(bf16* __restrict__ dst, const float* __restrict__ src, int64_t n) {
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) dst[i] = f2bf(src[i]);
}
__global__ void cast_bf16_to_f32_scalar_kernel(float* __restrict__ dst, const bf16* __restrict__ src, int64_t n) {
    for (int64_t i = thread_index_1d(); i < n; i += grid_stride_1d()) dst[i] = bf2f(src[i]);
}

static void multiply_launch(KernelChoice impl, bf16* out, const bf16* a, const bf16* b, int64_t n,
                            cudaStream_t stream) {
    if (impl == KERNELS_VEC) { multiply_cuda(out, a, b, n, stream); return; }
    if (n == 0) return;
    launch_kernel(grid_for(n, 256), 256, 0, stream, multiply_scalar_kernel, out, a, b, n);
}
static void scale_columns_launch(KernelChoice impl, bf16* y, const bf16* x, const bf16* g, int64_t rows, int d,
                                 cudaStream_t stream) {
    if (impl == KERNELS_VEC) { scale_columns_cuda(y, x, g, rows, d, stream); return; }
    if (rows * d == 0) return;
    launch_kernel(grid_for(rows * d, 256), 256, 0, stream, scale_columns_scalar_kernel, y, x, g, rows * d, d);
}
static void cast_f32_to_bf16_launch(KernelChoice impl, bf16* dst, const float* src, int64_t n, cudaStream_t stream) {
    if (impl == KERNELS_VEC) { cast_f32_to_bf16_cuda(dst, src, n, stream); return; }
    if (n == 0) return;
    launch_kernel(grid_for(n, 256), 256, 0, stream, cast_f32_to_bf16_scalar_kernel, dst, src, n);
}
static void cast_bf16_to_f32_launch(KernelChoice impl, float* dst, const bf16* src, int64_t n, cudaStream_t stream) {
    if (impl == KERNELS_VEC) { cast_bf16_to_f32_cuda(dst, src, n, stream); return; }
    if (n == 0) return;
    launch_kernel(grid_for(n, 256), 256, 0, stream, cast_bf16_to_f32_scalar_kernel, dst, src, n);
}
