// dev/cuda/rope_scalar.cuh: the scalar RoPE kernel (one rotated pair per thread over a 1-D grid),
// which llmc/cuda/attention.cuh's rope_apply_kernel runs only where rot, hd or the alignment rule out
// its 16-byte form, kept here alone as the reference version of the op, as llm.c keeps its numbered
// kernels: dev/cuda/attention.cu checks it against the CPU twin and, byte for byte, against the
// production kernel. Not part of the trainers. rope_apply_launch runs either form (KernelChoice).
#pragma once
#include "check.h"
#include "../../llmc/cuda/attention.cuh"

__global__ void rope_apply_scalar_kernel(bf16* x, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                                         const int* __restrict__ pos, int64_t N, int T, int nheads, int hd, int rot,
                                         int inverse) {
    for (int64_t idx = thread_index_1d(); idx < N * nheads * (rot / 2); idx += grid_stride_1d())
        rope_pair(x, cos_t, sin_t, pos, idx, T, nheads, hd, rot, inverse ? -1.0f : 1.0f);
}
static void rope_apply_launch(KernelChoice impl, bf16* x, const float* cos_t, const float* sin_t, const int* pos,
                              int64_t N, int T, int nheads, int hd, int rot, int inverse, cudaStream_t stream) {
    if (impl == KERNELS_VEC) { rope_apply_cuda(x, cos_t, sin_t, pos, N, T, nheads, hd, rot, inverse, stream); return; }
    int64_t total = N * nheads * (rot / 2);
    if (total == 0) return;
    launch_kernel(grid_for(total, 256), 256, 0, stream, rope_apply_scalar_kernel, x, cos_t, sin_t, pos, N, T, nheads,
                  hd, rot, inverse);
}
