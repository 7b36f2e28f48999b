// cpu/norms.h: RMSNorm and LayerNorm, standard and memory-sharing (MS) variants, fp32.
// Forward writes z (times gamma/beta for the standard norm, plain for MS, where the affine lives
// in the next linears) and r = 1/sqrt(var + eps) per row. Backward:
//   MS-RMSNorm: dx = r * (dz - z * mean(dz*z))                  from z and r only
//   MS-LN:      dx = r * (dz - mean(dz) - z * mean(dz*z))
//   standard:   the same with dz <- dy*gamma and z recomputed from the kept input x.
// All backward kernels ACCUMULATE into dx (it already holds the residual-path gradient).
// Statistics cannot overflow for finite inputs (../norm_math.h): sums in fp64, r formed in fp64
// when the mean square is beyond fp32.
#pragma once
#include <math.h>
#include <stdint.h>
#include "../norm_math.h"

// y = x * r (* gamma); gamma NULL means the MS (parameter-free) form.
static void rmsnorm_forward(float* y, float* r_out, const float* x, const float* gamma, int64_t N, int d, float eps) {
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int64_t n = 0; n < N; n++) {
        const float* xr = x + n * d;
        float* yr = y + n * d;
        double ss = 0.0;
        for (int i = 0; i < d; i++) ss += (double)xr[i] * xr[i];
        float r = norm_inv_rms(ss, d, eps);
        r_out[n] = r;
        for (int i = 0; i < d; i++) yr[i] = xr[i] * r * (gamma ? gamma[i] : 1.0f);
    }
}

// One row of the MS backward: dx += r * (dz - z * mean(dz*z)) (- mean(dz) for LayerNorm).
static inline void norm_row_backward(float* dx, const float* dz, const float* z, float r, int d, int center) {
    double sdz = 0.0, sdzz = 0.0;
    for (int i = 0; i < d; i++) { sdz += dz[i]; sdzz += (double)dz[i] * z[i]; }
    float mdz = center ? (float)(sdz / d) : 0.0f, mdzz = (float)(sdzz / d);
    for (int i = 0; i < d; i++) dx[i] += r * (dz[i] - mdz - z[i] * mdzz);
}

static void rmsnorm_ms_backward(float* dx, const float* dz, const float* z, const float* r, int64_t N, int d) {
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int64_t n = 0; n < N; n++) norm_row_backward(dx + n * d, dz + n * d, z + n * d, r[n], d, 0);
}

// Standard RMSNorm backward from the kept input x: z = x*r and dz = dy*gamma are rebuilt per row.
static void rmsnorm_backward(float* dx, const float* dy, const float* x, const float* r, const float* gamma, int64_t N,
                             int d) {
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int64_t n = 0; n < N; n++) {
        float zbuf[d > 0 ? d : 1], dzbuf[d > 0 ? d : 1];
        for (int i = 0; i < d; i++) { zbuf[i] = x[n * d + i] * r[n]; dzbuf[i] = dy[n * d + i] * gamma[i]; }
        norm_row_backward(dx + n * d, dzbuf, zbuf, r[n], d, 0);
    }
}

// dgamma[i] += sum_n dy[n, i] * x[n, i] * r[n]: the gradient of a trained RMSNorm gamma (full
// fine-tuning). Columns in parallel, rows in order: deterministic.
static void rmsnorm_gamma_grad(float* dgamma, const float* dy, const float* x, const float* r, int64_t N, int d) {
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int i = 0; i < d; i++) {
        double s = 0.0;
        for (int64_t n = 0; n < N; n++) s += (double)dy[n * d + i] * x[n * d + i] * r[n];
        dgamma[i] += (float)s;
    }
}

// A LayerNorm row's mean and r, two-pass. The centred values are fp32 as ever; only when one of
// them overflowed (|x| near FLT_MAX) is the variance formed again from fp64 differences.
static float layernorm_row_stats(const float* x, int d, float eps, float* mean) {
    double s = 0.0, ss = 0.0;
    for (int i = 0; i < d; i++) s += x[i];
    float mu = (float)(s / d);
    for (int i = 0; i < d; i++) { float c = x[i] - mu; ss += (double)c * c; }
    if (isinf(ss)) {
        ss = 0.0;
        for (int i = 0; i < d; i++) { double c = (double)x[i] - mu; ss += c * c; }
    }
    *mean = mu;
    return norm_inv_rms(ss, d, eps);
}

// LayerNorm: z = (x - mean) * r (* gamma + beta); mean is returned only for the standard form.
static void layernorm_forward(float* y, float* r_out, float* mean_out, const float* x, const float* gamma,
                              const float* beta, int64_t N, int d, float eps) {
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int64_t n = 0; n < N; n++) {
        const float* xr = x + n * d;
        float* yr = y + n * d;
        float mu;
        float r = layernorm_row_stats(xr, d, eps, &mu);
        r_out[n] = r;
        if (mean_out) mean_out[n] = mu;
        for (int i = 0; i < d; i++) {
            float z = norm_normalise(xr[i], mu, r);
            yr[i] = gamma ? z * gamma[i] + (beta ? beta[i] : 0.0f) : z;
        }
    }
}

// dgamma[i] += sum_n dy[n, i] * (x[n, i] - mean[n]) * r[n] and dbeta[i] += sum_n dy[n, i]: a
// trained LayerNorm affine (full fine-tuning, standard norm). Columns in parallel, rows in order.
static void layernorm_affine_grad(float* dgamma, float* dbeta, const float* dy, const float* x, const float* mean,
                                  const float* r, int64_t N, int d) {
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int i = 0; i < d; i++) {
        double sg = 0.0, sb = 0.0;
        for (int64_t n = 0; n < N; n++) {
            double g = dy[n * d + i];
            sg += g * ((double)x[n * d + i] - mean[n]) * r[n];
            sb += g;
        }
        dgamma[i] += (float)sg;
        dbeta[i] += (float)sb;
    }
}

static void layernorm_ms_backward(float* dx, const float* dz, const float* z, const float* r, int64_t N, int d) {
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int64_t n = 0; n < N; n++) norm_row_backward(dx + n * d, dz + n * d, z + n * d, r[n], d, 1);
}

static void layernorm_backward(float* dx, const float* dy, const float* x, const float* mean, const float* r,
                               const float* gamma, int64_t N, int d) {
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int64_t n = 0; n < N; n++) {
        float zbuf[d > 0 ? d : 1], dzbuf[d > 0 ? d : 1];
        for (int i = 0; i < d; i++) {
            zbuf[i] = norm_normalise(x[n * d + i], mean[n], r[n]);
            dzbuf[i] = dy[n * d + i] * gamma[i];
        }
        norm_row_backward(dx + n * d, dzbuf, zbuf, r[n], d, 1);
    }
}

// How many of n rows' statistics left fp32's range (norm_stats_overflowed): diverged activations.
static double norm_overflowed_rows(const float* r, int64_t n) {
    double count = 0.0;
    for (int64_t i = 0; i < n; i++) count += norm_stats_overflowed(r[i]);
    return count;
}
