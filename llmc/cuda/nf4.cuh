// cuda/nf4.cuh: dequantization of an NF4 weight (llmc/nf4.h) into a bf16 scratch matrix on the
// CUDA backend, just before the cuBLASLt product that reads it (llmc/cuda/linear.cuh). Twin of
// nf4_dequantize (llmc/nf4.h): the same fp32 values, rounded once to bf16.
#pragma once
#include "common.cuh"
#include "../nf4.h"

// One thread per packed byte: both of its weights lie in the same 64-block (64 is even), so one
// absmax decode serves two outputs. tables: NF4's 16 values, then the 256-entry dynamic map.
__global__ void nf4_dequantize_kernel(bf16* __restrict__ w, const uint8_t* __restrict__ buf,
                                      const float* __restrict__ tables, int64_t n) {
    Nf4View q = nf4_view((void*)buf, n);
    float offset = *q.offset;
    for (int64_t j = thread_index_1d(); j < (n + 1) / 2; j += grid_stride_1d()) {
        int64_t i = 2 * j;
        float a = nf4_absmax_at(q.qabsmax, q.nested, offset, tables + 16, i / NF4_BLOCK);
        uint8_t b = q.codes[j];
        w[i] = f2bf(tables[b >> 4] * a);
        if (i + 1 < n) w[i + 1] = f2bf(tables[b & 15] * a);
    }
}

static void nf4_dequantize_cuda(bf16* w, const void* buf, const float* tables, int64_t n, cudaStream_t stream) {
    launch_kernel(grid_for((n + 1) / 2, 256), 256, 0, stream, nf4_dequantize_kernel, w, (const uint8_t*)buf, tables, n);
}
