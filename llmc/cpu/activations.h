// cpu/activations.h: SwiGLU and GELU, exact and 2-bit approximate (ReSiLU2 / ReGELU2).
// Forward is always the exact function. The approximate variants also write the packed 2-bit
// codes of the pre-activation, which is all their backward needs; the exact variants need the
// pre-activation itself.
#pragma once
#include <stdint.h>
#include "../approx_act.h"

// Packs the codes of x[0..n) into out[(n+3)/4], 4 per byte (ragged tail zero-padded).
static void pack_codes_2bit(uint8_t* out, const float* x, int64_t n, Relu3Fit fit) {
    int64_t nb = packed_codes_bytes(n);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t b = 0; b < nb; b++) {
        uint8_t c[4] = {0, 0, 0, 0};
        int cnt = (int)(n - 4 * b < 4 ? n - 4 * b : 4);
        for (int k = 0; k < cnt; k++) c[k] = relu3_code(x[4 * b + k], fit);
        out[b] = codes_pack4(c, cnt);
    }
}

// sg = silu(g), p = sg * u; codes (ReSiLU2) written when non-NULL.
static void swiglu_forward(float* p, float* sg, uint8_t* codes, const float* g, const float* u, int64_t n) {
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) {
        float s = silu_f(g[i]);
        sg[i] = s;
        p[i] = s * u[i];
    }
    if (codes) {
        Relu3Fit fit = RESILU2_FIT;
        pack_codes_2bit(codes, g, n, fit);
    }
}

// dg, du from dp. Exact: silu'(g) from the kept g. Approx (g NULL): the level of the code.
static void swiglu_backward(float* dg, float* du, const float* dp, const float* sg, const float* u, const float* g,
                            const uint8_t* codes, int64_t n) {
    Relu3Fit fit = RESILU2_FIT;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) {
        float dsg = dp[i] * u[i];
        du[i] = dp[i] * sg[i];
        dg[i] = dsg * (g ? silu_grad_f(g[i]) : relu3_level(codes_get(codes, i), fit));
    }
}

// y = gelu(x) (erf form, or tanh form when tanh_form); codes (ReGELU2) written when non-NULL.
static void gelu_forward(float* y, uint8_t* codes, const float* x, int64_t n, int tanh_form) {
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) y[i] = tanh_form ? gelu_tanh_f(x[i]) : gelu_f(x[i]);
    if (codes) {
        Relu3Fit fit = REGELU2_FIT;
        pack_codes_2bit(codes, x, n, fit);
    }
}

// dx = dy * gelu'(x) (exact, x kept) or dy * level(code) (approx, x NULL). Overwrites dx.
static void gelu_backward(float* dx, const float* dy, const float* x, const uint8_t* codes, int64_t n, int tanh_form) {
    Relu3Fit fit = REGELU2_FIT;
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) {
        float gr = x ? (tanh_form ? gelu_tanh_grad_f(x[i]) : gelu_grad_f(x[i])) : relu3_level(codes_get(codes, i), fit);
        dx[i] = dy[i] * gr;
    }
}
