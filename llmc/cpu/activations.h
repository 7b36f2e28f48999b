// cpu/activations.h: SwiGLU and GELU, exact and 2-bit approximate (ReSiLU2 / ReGELU2).
// Forward is always the exact function. The approximate variants also write the packed 2-bit
// codes of the pre-activation, which is all their backward needs; the exact variants need the
// pre-activation itself.
// Elementwise passes run 8 lanes at a time (GCC vectors), in groups of 8 elements = 2 code bytes,
// so the parallel split never shares a byte; a ragged tail goes through the same vector code,
// padded. SiLU, GELU and their derivatives use vx_exp and vx_erf (llmc/cpu/vec_exp.h, within a few
// ulp of libm), so they stay the exact functions to fp32 rounding. The codes
// are strict comparisons of the pre-activation, the same bits as relu3_code; the approximate
// backward forms dy * level with the same fp32 operations as the scalar rule (and the CUDA twin).
#pragma once
#include <stdint.h>
#include <string.h>
#include "../approx_act.h"
#include "vec_exp.h"

#define ACT_PAR 32768  // elements below which a pass stays on one thread

// 8 elements from x + i (i + 8 <= n) or, at a ragged tail, the n - i left and `pad` after them.
static inline vx_f8 act_load(const float* x, int64_t i, int64_t n, float pad) {
    if (i + 8 <= n) return vx_load(x + i);
    float t[8];
    for (int k = 0; k < 8; k++) t[k] = i + k < n ? x[i + k] : pad;
    return vx_load(t);
}
// Stores the lanes of v that fall below n.
static inline void act_store(float* y, int64_t i, int64_t n, vx_f8 v) {
    if (i + 8 <= n) { vx_store(y + i, v); return; }
    for (int k = 0; i + k < n; k++) y[i + k] = v[k];
}

// The codes of 8 pre-activations (relu3_code lane by lane) packed into 2 bytes, element i in
// bits 2*(i&3) of byte i>>2. A ragged tail is padded with -inf, whose code is 0.
static inline void act_codes8(uint8_t* out, int64_t i, int64_t n, vx_f8 x, Relu3Fit fit) {
    vx_i8 c =
        -((x > vx_splat(fit.c1)) + (x > vx_splat(fit.c2)) + (x > vx_splat(fit.c3)));  // each comparison is 0 or -1
    c = c << (vx_i8){0, 2, 4, 6, 0, 2, 4, 6};
    uint8_t b[2] = {(uint8_t)(c[0] | c[1] | c[2] | c[3]), (uint8_t)(c[4] | c[5] | c[6] | c[7])};
    int64_t nb = packed_codes_bytes(n) - i / 4;
    memcpy(out + i / 4, b, nb < 2 ? nb : 2);
}
// The derivative levels of 8 codes read from the packed bytes (relu3_level lane by lane).
static inline vx_f8 act_levels8(const uint8_t* codes, int64_t i, int64_t n, Relu3Fit fit) {
    int64_t nb = packed_codes_bytes(n) - i / 4;
    int32_t b0 = codes[i / 4], b1 = nb > 1 ? codes[i / 4 + 1] : 0;
    vx_i8 c = ((vx_i8){b0, b0, b0, b0, b1, b1, b1, b1} >> (vx_i8){0, 2, 4, 6, 0, 2, 4, 6}) & 3;
    float l1 = fit.a1, l2 = l1 + fit.a2, l3 = l2 + fit.a3;
    vx_f8 z = vx_splat(0.0f);
    return c == 1 ? vx_splat(l1) : c == 2 ? vx_splat(l2) : c == 3 ? vx_splat(l3) : z;
}

// silu(x) = x / (1 + e^-x) and its derivative s (1 + x (1 - s)), s = 1 / (1 + e^-x): the formulas
// of silu_f / silu_grad_f with vx_exp for expf. (vx_exp clamps -x above 88: silu(x < -88) is then
// about -1e-37 where it is -5e-37 or less; both round to nothing next to the other terms.)
static inline vx_f8 vx_silu(vx_f8 x) { return x / (vx_splat(1.0f) + vx_exp(-x)); }
static inline vx_f8 vx_silu_grad(vx_f8 x) {
    vx_f8 one = vx_splat(1.0f), s = one / (one + vx_exp(-x));
    return s * (one + x * (one - s));
}

// sg = silu(g), p = sg * u; codes (ReSiLU2) written when non-NULL, in the same pass.
static void swiglu_forward(float* p, float* sg, uint8_t* codes, const float* g, const float* u, int64_t n) {
    Relu3Fit fit = RESILU2_FIT;
#pragma omp parallel for schedule(static) if (n > ACT_PAR)
    for (int64_t i = 0; i < n; i += 8) {
        vx_f8 x = act_load(g, i, n, -INFINITY), s = vx_silu(x);
        act_store(sg, i, n, s);
        act_store(p, i, n, s * act_load(u, i, n, 0.0f));
        if (codes) act_codes8(codes, i, n, x, fit);
    }
}

// dg, du from dp. Exact: silu'(g) from the kept g. Approx (g NULL): the level of the code.
static void swiglu_backward(float* dg, float* du, const float* dp, const float* sg, const float* u, const float* g,
                            const uint8_t* codes, int64_t n) {
    Relu3Fit fit = RESILU2_FIT;
#pragma omp parallel for schedule(static) if (n > ACT_PAR)
    for (int64_t i = 0; i < n; i += 8) {
        vx_f8 d = act_load(dp, i, n, 0.0f), dsg = d * act_load(u, i, n, 0.0f);
        act_store(du, i, n, d * act_load(sg, i, n, 0.0f));
        act_store(dg, i, n, dsg * (g ? vx_silu_grad(act_load(g, i, n, 0.0f)) : act_levels8(codes, i, n, fit)));
    }
}

// GELU, erf form: gelu_f's formula 0.5 x (1 + erf(x / sqrt 2)) with vx_erf for erff. Its
// derivative (gelu_grad_f) 0.5 (1 + erf(x / sqrt 2)) + x phi(x), phi(x) = e^(-x^2/2) / sqrt(2 pi)
// by vx_exp; where that underflows to 0 (|x| > 13.2, inf included) the second term is 0, so
// gelu'(+-inf) is 1 and 0 rather than libm's NaN from inf * 0.
static inline vx_f8 vx_gelu(vx_f8 x) {
    return vx_splat(0.5f) * x * (vx_splat(1.0f) + vx_erf(x * vx_splat(0.70710678118654752f)));
}
static inline vx_f8 vx_gelu_grad(vx_f8 x) {
    vx_f8 z = vx_splat(0.0f), e = vx_exp(vx_splat(-0.5f) * x * x);
    vx_f8 phi = e == z ? z : x * vx_splat(0.39894228040143268f) * e;
    return vx_splat(0.5f) * (vx_splat(1.0f) + vx_erf(x * vx_splat(0.70710678118654752f))) + phi;
}
// GELU, tanh form: 0.5 (1 + tanh u) = 1 / (1 + e^(-2u)), u = sqrt(2/pi) (x + 0.044715 x^3), so
// gelu_tanh_f(x) = x s with s = 1 / (1 + e^(-2u)), which never subtracts near tanh = -1; the
// derivative's 1 - tanh^2 = 4 s (1 - s) with 1 - s = e^(-2u) s, exactly formed too. Where
// -2u > 88 (x below about -10, vx_exp's clamp) the function and derivative are 0 (below 1e-37
// in truth); where e^(-2u) is 0 (x above about 10, inf included) s is 1 and the derivative 1.
static inline vx_f8 vx_gelu_tanh_s(vx_f8 x, vx_f8* e) {
    vx_f8 u = vx_splat(0.79788456080286536f) * (x + vx_splat(0.044715f) * x * x * x);
    *e = vx_exp(vx_splat(-2.0f) * u);
    return vx_splat(1.0f) / (vx_splat(1.0f) + *e);
}
static inline vx_f8 vx_gelu_tanh(vx_f8 x) {
    vx_f8 e, s = vx_gelu_tanh_s(x, &e);
    return e > vx_splat(1e38f) ? vx_splat(-0.0f) : x * s;  // e^88 = 1.65e38: clamped
}
static inline vx_f8 vx_gelu_tanh_grad(vx_f8 x) {
    vx_f8 e, s = vx_gelu_tanh_s(x, &e), z = vx_splat(0.0f);
    vx_f8 d = vx_splat(2.0f) * x * s * (e * s) * vx_splat(0.79788456080286536f) *
              (vx_splat(1.0f) + vx_splat(3.0f * 0.044715f) * x * x);
    return e > vx_splat(1e38f) ? z : e == z ? vx_splat(1.0f) : s + d;
}

// y = gelu(x) (erf form, or tanh form when tanh_form); codes (ReGELU2) written when non-NULL.
static void gelu_forward(float* y, uint8_t* codes, const float* x, int64_t n, int tanh_form) {
    Relu3Fit fit = REGELU2_FIT;
#pragma omp parallel for schedule(static) if (n > ACT_PAR)
    for (int64_t i = 0; i < n; i += 8) {
        vx_f8 v = act_load(x, i, n, -INFINITY);
        act_store(y, i, n, tanh_form ? vx_gelu_tanh(v) : vx_gelu(v));
        if (codes) act_codes8(codes, i, n, v, fit);
    }
}

// dx = dy * gelu'(x) (exact, x kept) or dy * level(code) (approx, x NULL). Overwrites dx.
static void gelu_backward(float* dx, const float* dy, const float* x, const uint8_t* codes, int64_t n, int tanh_form) {
    Relu3Fit fit = REGELU2_FIT;
#pragma omp parallel for schedule(static) if (n > ACT_PAR)
    for (int64_t i = 0; i < n; i += 8) {
        vx_f8 d = act_load(dy, i, n, 0.0f);
        if (x) {
            vx_f8 v = act_load(x, i, n, 0.0f);
            act_store(dx, i, n, d * (tanh_form ? vx_gelu_tanh_grad(v) : vx_gelu_grad(v)));
        } else {
            act_store(dx, i, n, d * act_levels8(codes, i, n, fit));
        }
    }
}
