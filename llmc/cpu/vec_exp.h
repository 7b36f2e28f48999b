// cpu/vec_exp.h: exp of 8 floats at once (GCC vector extensions), for the CPU backend's softmaxes
// (the loss head's 49k-wide rows, attention's score tiles), where libm's scalar exp was most of
// the time. Range reduction x = n ln2 + r, |r| <= ln2/2 (ln2 split in two parts so n ln2 is
// exact), e^r by its Taylor polynomial to degree 7 (truncation below 6e-9 relative), times 2^n
// built in the exponent bits: within about 2 ulp of e^x. Inputs below -87.3 (where e^x is
// denormal) give 0; above 88 they are clamped to 88 (the callers pass x <= 0). vx_erf below, for
// GELU (llmc/cpu/activations.h), likewise replaces libm's scalar erff.
#pragma once
#include <stdint.h>
#include <string.h>

typedef float vx_f8 __attribute__((vector_size(32)));
typedef int32_t vx_i8 __attribute__((vector_size(32)));

static inline vx_f8 vx_splat(float a) { return (vx_f8){a, a, a, a, a, a, a, a}; }
static inline vx_f8 vx_load(const float* p) { vx_f8 v; memcpy(&v, p, 32); return v; }
static inline void vx_store(float* p, vx_f8 v) { memcpy(p, &v, 32); }

static inline vx_f8 vx_exp(vx_f8 x) {
    vx_f8 lo = vx_splat(-87.3f), hi = vx_splat(88.0f);
    vx_i8 under = x < lo;
    x = x < lo ? lo : x;
    x = x > hi ? hi : x;
    vx_f8 round = vx_splat(12582912.0f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
    vx_f8 n = (x * vx_splat(1.44269504088896341f) + round) - round;
    vx_f8 r = x - n * vx_splat(0.693359375f) - n * vx_splat(-2.12194440e-4f);
    vx_f8 p = vx_splat(1.0f / 5040.0f);
    p = p * r + vx_splat(1.0f / 720.0f);
    p = p * r + vx_splat(1.0f / 120.0f);
    p = p * r + vx_splat(1.0f / 24.0f);
    p = p * r + vx_splat(1.0f / 6.0f);
    p = p * r + vx_splat(0.5f);
    p = p * r + vx_splat(1.0f);
    p = p * r + vx_splat(1.0f);
    vx_i8 bits = (__builtin_convertvector(n, vx_i8) + 127) << 23;
    vx_f8 scale;
    memcpy(&scale, &bits, 32);
    vx_f8 y = p * scale;
    return under ? vx_splat(0.0f) : y;
}

// c[0] x^(n-1) + c[1] x^(n-2) + ... + c[n-1], by Horner's rule (highest coefficient first).
static inline vx_f8 vx_horner(vx_f8 x, const float* c, int n) {
    vx_f8 p = vx_splat(c[0]);
    for (int i = 1; i < n; i++) p = p * x + vx_splat(c[i]);
    return p;
}

// erf of 8 floats: odd, so computed on a = |x| and the sign put back (-0 stays -0, NaN stays NaN).
// Below 1, erf(a) = a + a Q(a^2): Q fitted here (least-squares on Chebyshev nodes, reweighted
// towards minimax; relative error 1.2e-9 on [0, 1] in double) to erf(a)/a - 1, so the term a is
// added exactly once and tiny or denormal a give 2/sqrt(pi) a. On [1, 3.9375), 1 - erfc(a) with
// erfc a degree-14 polynomial in a - 2.46875 (fitted likewise for absolute error, 7e-9: erfc is
// below 0.16 there, so a fraction of an ulp of the result). From 3.9375 (inf included) erfc is
// below half an ulp of 1 and erf is 1. Within 2 ulp of erf over all floats (test/unit/vec_math.cu;
// 1.12 at worst, at 1.0003, over every float of [2^-25, 4.5)).
static inline vx_f8 vx_erf(vx_f8 x) {
    vx_i8 bits, sign;
    memcpy(&bits, &x, 32);
    sign = bits & (int32_t)0x80000000;
    bits &= 0x7fffffff;
    vx_f8 a, a2;
    memcpy(&a, &bits, 32);
    a2 = a * a;
    static const float Q[7] = {7.85390439e-05f, -0.000801020768f, 0.00518832961f, -0.0268538129f,
                               0.112835854f,    -0.37612626f,     0.128379166f};
    static const float E[15] = {-1.04693527e-06f, -2.03696203e-07f, 1.69855666e-05f, -2.30415917e-05f, -7.72348139e-05f,
                                0.00029323803f,   -0.000333735661f, -0.000483813667f, 0.00290907547f,  -0.00664589601f,
                                0.009619819f,     -0.0094906697f,   0.00628095586f,   -0.00254411274f, 0.000480604795f};
    vx_f8 small = a * vx_horner(a2, Q, 7) + a;
    vx_f8 c = vx_horner(a - vx_splat(2.46875f), E, 15);  // erfc(a) on [1, 3.9375)
    vx_f8 one = vx_splat(1.0f);
    vx_f8 r = a >= vx_splat(3.9375f) ? one : a >= one ? one - c : small;  // NaN fails both: small, NaN
    memcpy(&bits, &r, 32);
    bits |= sign;
    memcpy(&r, &bits, 32);
    return r;
}

// y[i] = e^(x[i] - shift) for i < n (x and y may be the same array); returns their sum in double
// (each group of 8 summed in float, groups in order: the order is fixed by n alone).
static double vx_exp_shifted(float* y, const float* x, int64_t n, float shift) {
    vx_f8 sh = vx_splat(shift);
    double sum = 0.0;
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        vx_f8 e = vx_exp(vx_load(x + i) - sh);
        vx_store(y + i, e);
        sum += (double)((e[0] + e[1]) + (e[2] + e[3])) + (double)((e[4] + e[5]) + (e[6] + e[7]));
    }
    if (i < n) {  // the tail through the same vector code, padded
        float t[8];
        for (int k = 0; k < 8; k++) t[k] = i + k < n ? x[i + k] : shift - 100.0f;
        vx_f8 e = vx_exp(vx_load(t) - sh);
        for (int k = 0; i + k < n; k++) { y[i + k] = e[k]; sum += e[k]; }
    }
    return sum;
}

// max of x[0..n) (n >= 1), NaNs ignored (a row of NaNs gives -FLT_MAX).
static float vx_max(const float* x, int64_t n) {
    vx_f8 m = vx_splat(-3.402823466e38f);
    int64_t i = 0;
    for (; i + 8 <= n; i += 8) { vx_f8 v = vx_load(x + i); m = v > m ? v : m; }
    float r = -3.402823466e38f;
    for (int k = 0; k < 8; k++) r = m[k] > r ? m[k] : r;
    for (; i < n; i++) r = x[i] > r ? x[i] : r;
    return r;
}
