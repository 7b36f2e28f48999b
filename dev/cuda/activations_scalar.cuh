// dev/cuda/activations_scalar.cuh: the scalar SwiGLU and GELU kernels (one code byte, 4 elements,
// per thread) that llmc/cuda/activations.cuh's kernels run only where their operands are not
// 16-byte aligned, kept here alone as the reference version of each op, as llm.c keeps its numbered
// kernels: dev/cuda/activations.cu checks them against the CPU twin and, byte for byte, against the
// production kernels. Not part of the trainers. The *_launch functions run either form (KernelChoice).
#pragma once
#include "check.h"
#include "../../llmc/cuda/activations.cuh"

__global__ void swiglu_forward_scalar_kernel(bf16* __restrict__ p, bf16* __restrict__ sg, uint8_t* __restrict__ codes,
                                             const bf16* __restrict__ g, const bf16* __restrict__ u, int64_t n) {
    Relu3Fit fit = RESILU2_FIT;
    int64_t nb = (n + 3) / 4;
    for (int64_t b = thread_index_1d(); b < nb; b += grid_stride_1d())
        swiglu_forward_byte(p, sg, codes, g, u, n, b, fit);
}
__global__ void swiglu_backward_scalar_kernel(bf16* __restrict__ dg, bf16* __restrict__ du,
                                              const bf16* __restrict__ dp, const bf16* __restrict__ sg,
                                              const bf16* __restrict__ u, const bf16* __restrict__ g,
                                              const uint8_t* __restrict__ codes, int64_t n) {
    Relu3Fit fit = RESILU2_FIT;
    int64_t nb = (n + 3) / 4;
    for (int64_t b = thread_index_1d(); b < nb; b += grid_stride_1d())
        swiglu_backward_byte(dg, du, dp, sg, u, g, codes, n, b, fit);
}
__global__ void gelu_forward_scalar_kernel(bf16* __restrict__ y, uint8_t* __restrict__ codes,
                                           const bf16* __restrict__ x, int64_t n, int tanh_form) {
    Relu3Fit fit = REGELU2_FIT;
    int64_t nb = (n + 3) / 4;
    for (int64_t b = thread_index_1d(); b < nb; b += grid_stride_1d())
        gelu_forward_byte(y, codes, x, n, b, tanh_form, fit);
}
// dx may alias dy (as the models run it), so neither is __restrict__
__global__ void gelu_backward_scalar_kernel(bf16* dx, const bf16* dy, const bf16* __restrict__ x,
                                            const uint8_t* __restrict__ codes, int64_t n, int tanh_form) {
    Relu3Fit fit = REGELU2_FIT;
    int64_t nb = (n + 3) / 4;
    for (int64_t b = thread_index_1d(); b < nb; b += grid_stride_1d())
        gelu_backward_byte(dx, dy, x, codes, n, b, tanh_form, fit);
}

static void swiglu_forward_launch(KernelChoice impl, bf16* p, bf16* sg, uint8_t* codes, const bf16* g, const bf16* u,
                                  int64_t n, cudaStream_t stream) {
    if (impl == KERNELS_VEC) { swiglu_forward_cuda(p, sg, codes, g, u, n, stream); return; }
    if (n == 0) return;
    launch_kernel(grid_for((n + 3) / 4, 256), 256, 0, stream, swiglu_forward_scalar_kernel, p, sg, codes, g, u, n);
}
static void swiglu_backward_launch(KernelChoice impl, bf16* dg, bf16* du, const bf16* dp, const bf16* sg, const bf16* u,
                                   const bf16* g, const uint8_t* codes, int64_t n, cudaStream_t stream) {
    if (impl == KERNELS_VEC) { swiglu_backward_cuda(dg, du, dp, sg, u, g, codes, n, stream); return; }
    if (n == 0) return;
    launch_kernel(grid_for((n + 3) / 4, 256), 256, 0, stream, swiglu_backward_scalar_kernel, dg, du, dp, sg, u, g,
                  codes, n);
}
static void gelu_forward_launch(KernelChoice impl, bf16* y, uint8_t* codes, const bf16* x, int64_t n, int tanh_form,
                                cudaStream_t stream) {
    if (impl == KERNELS_VEC) { gelu_forward_cuda(y, codes, x, n, tanh_form, stream); return; }
    if (n == 0) return;
    launch_kernel(grid_for((n + 3) / 4, 256), 256, 0, stream, gelu_forward_scalar_kernel, y, codes, x, n, tanh_form);
}
static void gelu_backward_launch(KernelChoice impl, bf16* dx, const bf16* dy, const bf16* x, const uint8_t* codes,
                                 int64_t n, int tanh_form, cudaStream_t stream) {
    if (impl == KERNELS_VEC) { gelu_backward_cuda(dx, dy, x, codes, n, tanh_form, stream); return; }
    if (n == 0) return;
    launch_kernel(grid_for((n + 3) / 4, 256), 256, 0, stream, gelu_backward_scalar_kernel, dx, dy, x, codes, n,
                  tanh_form);
}
