// cuda/activations.cuh: SwiGLU and GELU, exact and 2-bit approximate (ReSiLU2 / ReGELU2), the
// twins of llmc/cpu/activations.h. The per-element math (exact functions, the code rule, the four
// levels, the packing) is llmc/approx_act.h, shared with the CPU, so codes agree bit for bit.
// Forward is always the exact function; the approximate variants write, in the same pass, the
// packed 2-bit codes of the pre-activation (4 per byte, element i in byte i>>2 at bits 2*(i&3)),
// which is all their backward reads besides dy.
//
// Each thread owns whole code bytes: 4 consecutive elements, so codes are written with plain
// byte stores, no atomics, and a ragged tail (n % 4 != 0) is just a short last group.
#pragma once
#include "common.cuh"
#include "vec.cuh"
#include "../approx_act.h"

// ---- SwiGLU ----------------------------------------------------------------------------------

// The per-element work of both paths of the kernels below (16-byte vectors, one code byte), and of
// dev/cuda's reference kernels, so they agree bit for bit.
// sg = silu(g), p = sg * u (from the unrounded silu, as the CPU); returns the element's 2-bit code.
static __device__ __forceinline__ uint8_t swiglu_forward_elem(float gv, float uv, bf16* p, bf16* sg, Relu3Fit fit) {
    float s = silu_f(gv);
    *sg = f2bf(s);
    *p = f2bf(s * uv);
    return (uint8_t)relu3_code(gv, fit);
}
// du = dp * sg; dg = dp * u * (silu'(g) exact, or the code's level when has_g is 0).
static __device__ __forceinline__ void swiglu_backward_elem(float dpv, float sgv, float uv, float gv, int has_g,
                                                            uint8_t code, bf16* dg, bf16* du, Relu3Fit fit) {
    float dsg = dpv * uv;
    *du = f2bf(dpv * sgv);
    float grad = has_g ? silu_grad_f(gv) : relu3_level(code, fit);
    *dg = f2bf(dsg * grad);
}

// Code byte b (elements 4b .. 4b+3, fewer at the end) of the forward, one element at a time.
static __device__ __forceinline__ void swiglu_forward_byte(bf16* p, bf16* sg, uint8_t* codes, const bf16* g,
                                                           const bf16* u, int64_t n, int64_t b, Relu3Fit fit) {
    uint8_t byte = 0;
    for (int k = 0; k < 4; k++) {
        int64_t i = 4 * b + k;
        if (i >= n) break;
        byte |= (uint8_t)(swiglu_forward_elem(bf2f(g[i]), bf2f(u[i]), p + i, sg + i, fit) << (2 * k));
    }
    if (codes) codes[b] = byte;
}
static __device__ __forceinline__ void swiglu_backward_byte(bf16* dg, bf16* du, const bf16* dp, const bf16* sg,
                                                            const bf16* u, const bf16* g, const uint8_t* codes,
                                                            int64_t n, int64_t b, Relu3Fit fit) {
    uint8_t byte = g ? 0 : codes[b];
    for (int k = 0; k < 4; k++) {
        int64_t i = 4 * b + k;
        if (i >= n) break;
        swiglu_backward_elem(bf2f(dp[i]), bf2f(sg[i]), bf2f(u[i]), g ? bf2f(g[i]) : 0.0f, g != NULL,
                             (uint8_t)((byte >> (2 * k)) & 3), dg + i, du + i, fit);
    }
}

// sg = silu(g), p = sg * u; codes (ReSiLU2) when non-NULL. 8 elements per thread: one 16-byte
// vector of each bf16 operand and two code bytes, where vec says every operand is 16-byte aligned
// (swiglu_forward_cuda); the rest (the last n % 8 elements, or all of them when not aligned) one
// code byte (4 elements) at a time. The per-element work is shared, so either path gives the same
// bits (dev/cuda/activations_scalar.cuh keeps the per-byte kernel alone as the reference version).
__global__ void swiglu_forward_kernel(bf16* __restrict__ p, bf16* __restrict__ sg, uint8_t* __restrict__ codes,
                                      const bf16* __restrict__ g, const bf16* __restrict__ u, int64_t n, int vec) {
    Relu3Fit fit = RESILU2_FIT;
    int64_t nv = vec ? n / 8 : 0;
    for (int64_t k = thread_index_1d(); k < nv; k += grid_stride_1d()) {
        Vec16<bf16> gv = load_vec16(g + 8 * k), uv = load_vec16(u + 8 * k), pv, sv;
        unsigned bits = 0;
        for (int j = 0; j < 8; j++)
            bits |= (unsigned)swiglu_forward_elem(bf2f(gv.v[j]), bf2f(uv.v[j]), &pv.v[j], &sv.v[j], fit) << (2 * j);
        store_vec16(p + 8 * k, pv);
        store_vec16(sg + 8 * k, sv);
        if (codes) { codes[2 * k] = (uint8_t)bits; codes[2 * k + 1] = (uint8_t)(bits >> 8); }
    }
    int64_t nb = (n + 3) / 4;
    for (int64_t b = 2 * nv + thread_index_1d(); b < nb; b += grid_stride_1d())
        swiglu_forward_byte(p, sg, codes, g, u, n, b, fit);
}
// dg, du from dp. Exact: silu'(g) from the kept g. Approx (g NULL): the level of the code. The
// same split as the forward: 16-byte vectors where vec, then one code byte at a time.
__global__ void swiglu_backward_kernel(bf16* __restrict__ dg, bf16* __restrict__ du, const bf16* __restrict__ dp,
                                       const bf16* __restrict__ sg, const bf16* __restrict__ u,
                                       const bf16* __restrict__ g, const uint8_t* __restrict__ codes, int64_t n,
                                       int vec) {
    Relu3Fit fit = RESILU2_FIT;
    int64_t nv = vec ? n / 8 : 0;
    for (int64_t k = thread_index_1d(); k < nv; k += grid_stride_1d()) {
        Vec16<bf16> dpv = load_vec16(dp + 8 * k), sgv = load_vec16(sg + 8 * k), uv = load_vec16(u + 8 * k), gv,
                    dgv, duv;
        unsigned bits = 0;
        if (g) gv = load_vec16(g + 8 * k);
        else bits = codes[2 * k] | (unsigned)codes[2 * k + 1] << 8;
        for (int j = 0; j < 8; j++)
            swiglu_backward_elem(bf2f(dpv.v[j]), bf2f(sgv.v[j]), bf2f(uv.v[j]), g ? bf2f(gv.v[j]) : 0.0f, g != NULL,
                                 (uint8_t)((bits >> (2 * j)) & 3), &dgv.v[j], &duv.v[j], fit);
        store_vec16(dg + 8 * k, dgv);
        store_vec16(du + 8 * k, duv);
    }
    int64_t nb = (n + 3) / 4;
    for (int64_t b = 2 * nv + thread_index_1d(); b < nb; b += grid_stride_1d())
        swiglu_backward_byte(dg, du, dp, sg, u, g, codes, n, b, fit);
}

// One launch of each kernel: its 16-byte path where every bf16 operand is aligned for it.
static void swiglu_forward_cuda(bf16* p, bf16* sg, uint8_t* codes, const bf16* g, const bf16* u, int64_t n,
                                cudaStream_t stream) {
    if (n == 0) return;
    int vec = aligned16(p) && aligned16(sg) && aligned16(g) && aligned16(u);
    launch_kernel(grid_for(vec ? (n + 7) / 8 : (n + 3) / 4, 256), 256, 0, stream, swiglu_forward_kernel, p, sg, codes,
                  g, u, n, vec);
}
static void swiglu_backward_cuda(bf16* dg, bf16* du, const bf16* dp, const bf16* sg, const bf16* u, const bf16* g,
                                 const uint8_t* codes, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    if (!g && !codes) fail("swiglu_backward_cuda: needs g (exact) or codes (ReSiLU2)");
    int vec = aligned16(dg) && aligned16(du) && aligned16(dp) && aligned16(sg) && aligned16(u) && (!g || aligned16(g));
    launch_kernel(grid_for(vec ? (n + 7) / 8 : (n + 3) / 4, 256), 256, 0, stream, swiglu_backward_kernel, dg, du, dp,
                  sg, u, g, codes, n, vec);
}

// ---- GELU ------------------------------------------------------------------------------------

// The per-element work of both paths of the kernels below and of dev/cuda's reference, so they
// agree bit for bit:
// y = gelu(x) (erf form, or tanh form when tanh_form), returning x's 2-bit code; and
// dy * gelu'(x) (exact, has_x) or dy * level(code).
static __device__ __forceinline__ uint8_t gelu_forward_elem(float xv, bf16* y, int tanh_form, Relu3Fit fit) {
    *y = f2bf(tanh_form ? gelu_tanh_f(xv) : gelu_f(xv));
    return (uint8_t)relu3_code(xv, fit);
}
static __device__ __forceinline__ bf16 gelu_backward_elem(float dyv, float xv, int has_x, uint8_t code, int tanh_form,
                                                          Relu3Fit fit) {
    float gr = has_x ? (tanh_form ? gelu_tanh_grad_f(xv) : gelu_grad_f(xv)) : relu3_level(code, fit);
    return f2bf(dyv * gr);
}
static __device__ __forceinline__ void gelu_forward_byte(bf16* y, uint8_t* codes, const bf16* x, int64_t n, int64_t b,
                                                         int tanh_form, Relu3Fit fit) {
    uint8_t byte = 0;
    for (int k = 0; k < 4; k++) {
        int64_t i = 4 * b + k;
        if (i >= n) break;
        byte |= (uint8_t)(gelu_forward_elem(bf2f(x[i]), y + i, tanh_form, fit) << (2 * k));
    }
    if (codes) codes[b] = byte;
}
static __device__ __forceinline__ void gelu_backward_byte(bf16* dx, const bf16* dy, const bf16* x, const uint8_t* codes,
                                                          int64_t n, int64_t b, int tanh_form, Relu3Fit fit) {
    uint8_t byte = x ? 0 : codes[b];
    for (int k = 0; k < 4; k++) {
        int64_t i = 4 * b + k;
        if (i >= n) break;
        dx[i] = gelu_backward_elem(bf2f(dy[i]), x ? bf2f(x[i]) : 0.0f, x != NULL, (uint8_t)((byte >> (2 * k)) & 3),
                                   tanh_form, fit);
    }
}

// y = gelu(x); codes (ReGELU2) written when non-NULL. 8 elements per thread in 16-byte vectors and
// two code bytes where vec (every bf16 operand 16-byte aligned, gelu_forward_cuda); the rest (the
// last n % 8 elements, or all when not aligned) one code byte (4 elements) at a time, by the same
// per-element work (dev/cuda/activations_scalar.cuh keeps the per-byte kernel as the reference).
__global__ void gelu_forward_kernel(bf16* __restrict__ y, uint8_t* __restrict__ codes, const bf16* __restrict__ x,
                                    int64_t n, int tanh_form, int vec) {
    Relu3Fit fit = REGELU2_FIT;
    int64_t nv = vec ? n / 8 : 0;
    for (int64_t k = thread_index_1d(); k < nv; k += grid_stride_1d()) {
        Vec16<bf16> xv = load_vec16(x + 8 * k), yv;
        unsigned bits = 0;
        for (int j = 0; j < 8; j++)
            bits |= (unsigned)gelu_forward_elem(bf2f(xv.v[j]), &yv.v[j], tanh_form, fit) << (2 * j);
        store_vec16(y + 8 * k, yv);
        if (codes) { codes[2 * k] = (uint8_t)bits; codes[2 * k + 1] = (uint8_t)(bits >> 8); }
    }
    int64_t nb = (n + 3) / 4;
    for (int64_t b = 2 * nv + thread_index_1d(); b < nb; b += grid_stride_1d())
        gelu_forward_byte(y, codes, x, n, b, tanh_form, fit);
}
// dx = dy * gelu'(x) (exact, x kept) or dy * level(code) (approx, x NULL), split as the forward.
// dx may alias dy (the models run it in place), so neither is __restrict__: each thread reads its
// vector (or byte) of dy before it writes the same elements of dx.
__global__ void gelu_backward_kernel(bf16* dx, const bf16* dy, const bf16* __restrict__ x,
                                     const uint8_t* __restrict__ codes, int64_t n, int tanh_form, int vec) {
    Relu3Fit fit = REGELU2_FIT;
    int64_t nv = vec ? n / 8 : 0;
    for (int64_t k = thread_index_1d(); k < nv; k += grid_stride_1d()) {
        Vec16<bf16> dyv = load_vec16(dy + 8 * k), xv, out;
        unsigned bits = 0;
        if (x) xv = load_vec16(x + 8 * k);
        else bits = codes[2 * k] | (unsigned)codes[2 * k + 1] << 8;
        for (int j = 0; j < 8; j++)
            out.v[j] = gelu_backward_elem(bf2f(dyv.v[j]), x ? bf2f(xv.v[j]) : 0.0f, x != NULL,
                                          (uint8_t)((bits >> (2 * j)) & 3), tanh_form, fit);
        store_vec16(dx + 8 * k, out);
    }
    int64_t nb = (n + 3) / 4;
    for (int64_t b = 2 * nv + thread_index_1d(); b < nb; b += grid_stride_1d())
        gelu_backward_byte(dx, dy, x, codes, n, b, tanh_form, fit);
}

// One launch of each kernel: its 16-byte path where the bf16 operands are aligned for it.
static void gelu_forward_cuda(bf16* y, uint8_t* codes, const bf16* x, int64_t n, int tanh_form, cudaStream_t stream) {
    if (n == 0) return;
    int vec = aligned16(y) && aligned16(x);
    launch_kernel(grid_for(vec ? (n + 7) / 8 : (n + 3) / 4, 256), 256, 0, stream, gelu_forward_kernel, y, codes, x, n,
                  tanh_form, vec);
}
static void gelu_backward_cuda(bf16* dx, const bf16* dy, const bf16* x, const uint8_t* codes, int64_t n, int tanh_form,
                               cudaStream_t stream) {
    if (n == 0) return;
    if (!x && !codes) fail("gelu_backward_cuda: needs x (exact) or codes (ReGELU2)");
    int vec = aligned16(dx) && aligned16(dy) && (!x || aligned16(x));
    launch_kernel(grid_for(vec ? (n + 7) / 8 : (n + 3) / 4, 256), 256, 0, stream, gelu_backward_kernel, dx, dy, x,
                  codes, n, tanh_form, vec);
}
