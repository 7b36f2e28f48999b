// cpu/misc.h: the small memory-bound loops of the CPU backend, twins of kernels in cuda/misc.cuh:
// an elementwise product and sum, a strided row copy and the sum of replicated heads' blocks. fp32.
#pragma once
#include <stdint.h>
#include <string.h>

// out = a * b elementwise (rebuilding SwiGLU's down input from silu(g) and u).
static void multiply(float* out, const float* a, const float* b, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) out[i] = a[i] * b[i];
}

// y += x elementwise (Gemma's post-normed branch outputs onto the residual stream).
static void add_inplace(float* y, const float* x, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) y[i] += x[i];
}

// y[n, i] = x[n, i] * g[i], rows of d (Qwen3's q/k norm gamma, applied apart from the norm under MS
// norms; y may be x).
static void scale_columns(float* y, const float* x, const float* g, int64_t rows, int d) {
#pragma omp parallel for schedule(static) if (rows * d > 32768)
    for (int64_t n = 0; n < rows; n++)
        for (int i = 0; i < d; i++) y[n * d + i] = x[n * d + i] * g[i];
}

// dst[r*dst_stride + c] = src[r*src_stride + c], rows x d values (strides in elements).
static void copy_rows(float* dst, int64_t dst_stride, const float* src, int64_t src_stride, int64_t rows, int d) {
    for (int64_t r = 0; r < rows; r++) memcpy(dst + r * dst_stride, src + r * src_stride, sizeof(float) * d);
}

// The sum of replicated heads' blocks (--seq-parallel with fewer key/value heads than ranks,
// llmc/train/seq_parallel.h): src holds `blocks` blocks [rows, bw] one after the other, block j a
// partial sum for the column chunk j / rep of dst (its replica j % rep); dst [rows, blocks / rep *
// bw] gets each chunk's replicas summed, in replica order.
static void sum_replica_blocks(float* dst, const float* src, int64_t rows, int blocks, int rep, int bw) {
    int chunks = blocks / rep;
    for (int64_t r = 0; r < rows; r++)
        for (int ch = 0; ch < chunks; ch++)
            for (int c = 0; c < bw; c++) {
                float sum = 0.0f;
                for (int i = 0; i < rep; i++) sum += src[((int64_t)(ch * rep + i) * rows + r) * bw + c];
                dst[(r * chunks + ch) * bw + c] = sum;
            }
}
