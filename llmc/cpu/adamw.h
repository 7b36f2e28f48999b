// cpu/adamw.h: the optimizer step and gradient-norm helpers over one flat fp32 parameter array.
#pragma once
#include <math.h>
#include <stdint.h>

static double sum_squares(const float* g, int64_t n) {
    double s = 0.0;
#pragma omp parallel for reduction(+ : s) schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) s += (double)g[i] * g[i];
    return s;
}

static void scale_inplace(float* x, int64_t n, float s) {
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) x[i] *= s;
}

// Decoupled AdamW (Loshchilov & Hutter); t is the 1-based step for bias correction.
static void adamw_update(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1, float beta2,
                         float eps, float weight_decay, int t) {
    float bc1 = 1.0f - powf(beta1, (float)t), bc2 = 1.0f - powf(beta2, (float)t);
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) {
        float mi = beta1 * m[i] + (1.0f - beta1) * g[i];
        float vi = beta2 * v[i] + (1.0f - beta2) * g[i] * g[i];
        m[i] = mi;
        v[i] = vi;
        p[i] -= lr * ((mi / bc1) / (sqrtf(vi / bc2) + eps) + weight_decay * p[i]);
    }
}
