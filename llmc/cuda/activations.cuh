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
#include "../approx_act.h"

// ---- SwiGLU ----------------------------------------------------------------------------------

// sg = silu(g), p = sg * u (from the unrounded silu, as the CPU); codes (ReSiLU2) when non-NULL.
__global__ void swiglu_forward_kernel(bf16* __restrict__ p, bf16* __restrict__ sg, uint8_t* __restrict__ codes,
                                      const bf16* __restrict__ g, const bf16* __restrict__ u, int64_t n) {
    Relu3Fit fit = RESILU2_FIT;
    int64_t nb = (n + 3) / 4;
    for (int64_t b = thread_index_1d(); b < nb; b += grid_stride_1d()) {
        uint8_t byte = 0;
        for (int k = 0; k < 4; k++) {
            int64_t i = 4 * b + k;
            if (i >= n) break;
            float gv = bf2f(g[i]), s = silu_f(gv);
            sg[i] = f2bf(s);
            p[i] = f2bf(s * bf2f(u[i]));
            byte |= (uint8_t)(relu3_code(gv, fit) << (2 * k));
        }
        if (codes) codes[b] = byte;
    }
}

// dg, du from dp. Exact: silu'(g) from the kept g. Approx (g NULL): the level of the code.
__global__ void swiglu_backward_kernel(bf16* __restrict__ dg, bf16* __restrict__ du, const bf16* __restrict__ dp,
                                       const bf16* __restrict__ sg, const bf16* __restrict__ u,
                                       const bf16* __restrict__ g, const uint8_t* __restrict__ codes, int64_t n) {
    Relu3Fit fit = RESILU2_FIT;
    int64_t nb = (n + 3) / 4;
    for (int64_t b = thread_index_1d(); b < nb; b += grid_stride_1d()) {
        uint8_t byte = g ? 0 : codes[b];
        for (int k = 0; k < 4; k++) {
            int64_t i = 4 * b + k;
            if (i >= n) break;
            float dpv = bf2f(dp[i]), dsg = dpv * bf2f(u[i]);
            du[i] = f2bf(dpv * bf2f(sg[i]));
            float grad = g ? silu_grad_f(bf2f(g[i])) : relu3_level((uint8_t)((byte >> (2 * k)) & 3), fit);
            dg[i] = f2bf(dsg * grad);
        }
    }
}

static void swiglu_forward_cuda(bf16* p, bf16* sg, uint8_t* codes, const bf16* g, const bf16* u, int64_t n,
                                cudaStream_t stream) {
    if (n == 0) return;
    launch_kernel(grid_for((n + 3) / 4, 256), 256, 0, stream, swiglu_forward_kernel, p, sg, codes, g, u, n);
}

static void swiglu_backward_cuda(bf16* dg, bf16* du, const bf16* dp, const bf16* sg, const bf16* u, const bf16* g,
                                 const uint8_t* codes, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    if (!g && !codes) fail("swiglu_backward_cuda: needs g (exact) or codes (ReSiLU2)");
    launch_kernel(grid_for((n + 3) / 4, 256), 256, 0, stream, swiglu_backward_kernel, dg, du, dp, sg, u, g, codes, n);
}

// ---- GELU ------------------------------------------------------------------------------------

// y = gelu(x) (erf form, or tanh form when tanh_form); codes (ReGELU2) written when non-NULL.
__global__ void gelu_forward_kernel(bf16* __restrict__ y, uint8_t* __restrict__ codes, const bf16* __restrict__ x,
                                    int64_t n, int tanh_form) {
    Relu3Fit fit = REGELU2_FIT;
    int64_t nb = (n + 3) / 4;
    for (int64_t b = thread_index_1d(); b < nb; b += grid_stride_1d()) {
        uint8_t byte = 0;
        for (int k = 0; k < 4; k++) {
            int64_t i = 4 * b + k;
            if (i >= n) break;
            float xv = bf2f(x[i]);
            y[i] = f2bf(tanh_form ? gelu_tanh_f(xv) : gelu_f(xv));
            byte |= (uint8_t)(relu3_code(xv, fit) << (2 * k));
        }
        if (codes) codes[b] = byte;
    }
}

// dx = dy * gelu'(x) (exact, x kept) or dy * level(code) (approx, x NULL). dx may alias dy (the
// models run it in place), so neither is __restrict__.
__global__ void gelu_backward_kernel(bf16* dx, const bf16* dy, const bf16* __restrict__ x,
                                     const uint8_t* __restrict__ codes, int64_t n, int tanh_form) {
    Relu3Fit fit = REGELU2_FIT;
    int64_t nb = (n + 3) / 4;
    for (int64_t b = thread_index_1d(); b < nb; b += grid_stride_1d()) {
        uint8_t byte = x ? 0 : codes[b];
        for (int k = 0; k < 4; k++) {
            int64_t i = 4 * b + k;
            if (i >= n) break;
            float gr;
            if (x) {
                float xv = bf2f(x[i]);
                gr = tanh_form ? gelu_tanh_grad_f(xv) : gelu_grad_f(xv);
            } else {
                gr = relu3_level((uint8_t)((byte >> (2 * k)) & 3), fit);
            }
            dx[i] = f2bf(bf2f(dy[i]) * gr);
        }
    }
}

static void gelu_forward_cuda(bf16* y, uint8_t* codes, const bf16* x, int64_t n, int tanh_form, cudaStream_t stream) {
    if (n == 0) return;
    launch_kernel(grid_for((n + 3) / 4, 256), 256, 0, stream, gelu_forward_kernel, y, codes, x, n, tanh_form);
}

static void gelu_backward_cuda(bf16* dx, const bf16* dy, const bf16* x, const uint8_t* codes, int64_t n, int tanh_form,
                               cudaStream_t stream) {
    if (n == 0) return;
    if (!x && !codes) fail("gelu_backward_cuda: needs x (exact) or codes (ReGELU2)");
    launch_kernel(grid_for((n + 3) / 4, 256), 256, 0, stream, gelu_backward_kernel, dx, dy, x, codes, n, tanh_form);
}
