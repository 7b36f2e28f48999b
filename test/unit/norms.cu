// test/unit/norms.cu: RMSNorm and LayerNorm, standard and MS (memory-sharing) backward against the
// explicit Jacobian, the affine merge, and rows whose squares overflow fp32.
#include "unit.h"
#include "../../llmc/cpu/matmul.h"
#include "../../llmc/cpu/norms.h"

// ---- norms ---------------------------------------------------------------------------------

// dx via the explicit Jacobian of z = normalise(x) in double (LayerNorm when center).
static void norm_jacobian_backward(double* dx, const float* x, const float* dz, int d, float eps, int center) {
    double mu = 0, var = 0;
    if (center) { for (int i = 0; i < d; i++) mu += x[i]; mu /= d; }
    for (int i = 0; i < d; i++) var += (x[i] - mu) * (x[i] - mu);
    var /= d;
    double r = 1.0 / sqrt(var + eps);
    for (int j = 0; j < d; j++) {
        double s = 0;
        for (int i = 0; i < d; i++) {
            double ci = x[i] - mu, cj = x[j] - mu;
            double jac = r * ((i == j) - (center ? 1.0 / d : 0.0)) - ci * cj * r * r * r / d;
            s += dz[i] * jac;
        }
        dx[j] = s;
    }
}

void test_norm_backward(int layernorm) {
    Rng r = rng_seeded(4 + layernorm, 0);
    int N = 7, d = 45;
    float eps = 1e-5f;
    float *x = randn(N * d, &r, 2.0f), *gamma = randn(d, &r, 0.5f), *beta = randn(d, &r, 0.5f), *dy = randn(N * d, &r, 1.0f);
    for (int i = 0; i < d; i++) gamma[i] += 1.0f;
    float *y = randn(N * d, &r, 1), *z = randn(N * d, &r, 1), *rr = randn(N, &r, 1), *mean = randn(N, &r, 1);
    float* dx_std = (float*)xcalloc(N * d, sizeof(float));
    float* dx_ms = (float*)xcalloc(N * d, sizeof(float));
    float* dz = (float*)xmalloc(sizeof(float) * N * d);
    double* ref = (double*)xmalloc(sizeof(double) * N * d);
    if (layernorm) {
        layernorm_forward(y, rr, mean, x, gamma, beta, N, d, eps);
        layernorm_backward(dx_std, dy, x, mean, rr, gamma, N, d);
        layernorm_forward(z, rr, NULL, x, NULL, NULL, N, d, eps);
    } else {
        rmsnorm_forward(y, rr, x, gamma, N, d, eps);
        rmsnorm_backward(dx_std, dy, x, rr, gamma, N, d);
        rmsnorm_forward(z, rr, x, NULL, N, d, eps);
    }
    for (int i = 0; i < N * d; i++) dz[i] = dy[i] * gamma[i % d];  // the merged layer sees dz = dy*gamma
    if (layernorm) layernorm_ms_backward(dx_ms, dz, z, rr, N, d);
    else rmsnorm_ms_backward(dx_ms, dz, z, rr, N, d);
    for (int n = 0; n < N; n++) norm_jacobian_backward(ref + n * d, x + n * d, dz + n * d, d, eps, layernorm);
    double e_std = rel_err(dx_std, ref, N * d), e_ms = rel_err(dx_ms, ref, N * d);
    check(e_std < 1e-5, layernorm ? "LayerNorm backward matches the explicit Jacobian" : "RMSNorm backward matches the explicit Jacobian", e_std);
    check(e_ms < 1e-5, layernorm ? "MS-LN backward (from z, r only) equals LayerNorm backward" : "MS-RMSNorm backward (from z, r only) equals RMSNorm backward", e_ms);
    // merging gamma (and beta) into the next linear leaves its output unchanged
    int out = 11;
    float *W = randn(out * d, &r, 0.3f), *Wm = (float*)xmalloc(sizeof(float) * out * d), *bm = (float*)xcalloc(out, sizeof(float));
    for (int o = 0; o < out; o++)
        for (int i = 0; i < d; i++) { Wm[o * d + i] = W[o * d + i] * gamma[i]; bm[o] += W[o * d + i] * (layernorm ? beta[i] : 0.0f); }
    float *y1 = (float*)xmalloc(sizeof(float) * N * out), *y2 = (float*)xmalloc(sizeof(float) * N * out);
    matmul_nt(y1, y, W, N, out, d, 1.0f, 0);
    matmul_nt(y2, z, Wm, N, out, d, 1.0f, 0);
    double me = 0, mx = 0;
    for (int n = 0; n < N; n++)
        for (int o = 0; o < out; o++) { me = fmax(me, fabs(y1[n * out + o] - y2[n * out + o] - bm[o])); mx = fmax(mx, fabs(y1[n * out + o])); }
    check(me / mx < 1e-5, layernorm ? "merging gamma, beta into the next linear leaves the forward unchanged" : "merging gamma into the next linear leaves the forward unchanged", me / mx);
    free(x); free(gamma); free(beta); free(dy); free(y); free(z); free(rr); free(mean); free(dx_std); free(dx_ms); free(dz); free(ref);
    free(W); free(Wm); free(bm); free(y1); free(y2);
}

// Rows far beyond the normal range but finite, against fp64 references: |x| ~ 1e30, whose square
// (1e60) fp32 cannot hold, and, for LayerNorm, a row near FLT_MAX whose centred values overflow
// fp32 (mean ~ +3e38, one element -3e38). The forward's z and r, both backwards and the affine
// gradients must equal the fp64 formulas as they do for normal rows: the tolerance is the one of
// the normal-range checks above (1e-5), while fp32 rounding of these d = 45 term sums is ~1e-7
// relative; without the fix r is 0 (or NaN) and every error is 1 or infinite.
static void fill_huge_rows(float* x, int N, int d, Rng* r, int layernorm) {
    for (int i = 0; i < N * d; i++) x[i] = 1e30f * rng_normal(r);
    if (!layernorm) return;
    float* last = x + (int64_t)(N - 1) * d;
    for (int i = 0; i < d; i++) last[i] = 3.0e38f * (1.0f - 0.1f * fabsf(rng_normal(r)));
    last[0] = -3.0e38f;
}

void test_norm_huge_rows(int layernorm) {
    Rng r = rng_seeded(40 + layernorm, 0);
    int N = 5, d = 45;
    float eps = 1e-5f;
    float *x = randn(N * d, &r, 1), *dz = randn(N * d, &r, 1.0f), *gamma = randn(d, &r, 0.5f), *beta = randn(d, &r, 0.5f);
    fill_huge_rows(x, N, d, &r, layernorm);
    for (int i = 0; i < d; i++) gamma[i] += 1.0f;
    float *z = (float*)xmalloc(sizeof(float) * N * d), *rr = (float*)xmalloc(sizeof(float) * N), *mean = (float*)xmalloc(sizeof(float) * N);
    float *dx_ms = (float*)xcalloc(N * d, sizeof(float)), *dx_std = (float*)xcalloc(N * d, sizeof(float));
    float *dy = (float*)xmalloc(sizeof(float) * N * d), *dg = (float*)xcalloc(d, sizeof(float)), *db = (float*)xcalloc(d, sizeof(float));
    double *zref = (double*)xmalloc(sizeof(double) * N * d), *rref = (double*)xmalloc(sizeof(double) * N);
    double *dxref = (double*)xmalloc(sizeof(double) * N * d), *dgref = (double*)xcalloc(d, sizeof(double));
    for (int i = 0; i < N * d; i++) dy[i] = dz[i] / gamma[i % d];  // the standard form's dy*gamma is the MS form's dz
    if (layernorm) {
        layernorm_forward(z, rr, mean, x, NULL, NULL, N, d, eps);
        layernorm_ms_backward(dx_ms, dz, z, rr, N, d);
        layernorm_backward(dx_std, dy, x, mean, rr, gamma, N, d);
        layernorm_affine_grad(dg, db, dy, x, mean, rr, N, d);
    } else {
        rmsnorm_forward(z, rr, x, NULL, N, d, eps);
        rmsnorm_ms_backward(dx_ms, dz, z, rr, N, d);
        rmsnorm_backward(dx_std, dy, x, rr, gamma, N, d);
        rmsnorm_gamma_grad(dg, dy, x, rr, N, d);
    }
    for (int n = 0; n < N; n++) {
        const float* xr = x + (int64_t)n * d;
        double mu = 0, var = 0;
        if (layernorm) { for (int i = 0; i < d; i++) mu += xr[i]; mu /= d; }
        for (int i = 0; i < d; i++) var += ((double)xr[i] - mu) * ((double)xr[i] - mu);
        rref[n] = 1.0 / sqrt(var / d + eps);
        for (int i = 0; i < d; i++) {
            zref[n * d + i] = ((double)xr[i] - mu) * rref[n];
            dgref[i] += (double)dy[n * d + i] * zref[n * d + i];
        }
        norm_jacobian_backward(dxref + n * d, xr, dz + n * d, d, eps, layernorm);
    }
    double e_z = rel_err(z, zref, N * d), e_ms = 0, e_std = 0, e_g = rel_err(dg, dgref, d), e_r = 0;
    for (int n = 0; n < N; n++) {  // per row: the rows' r and dx differ by orders of magnitude
        e_r = fmax(e_r, rel_err(rr + n, rref + n, 1));
        e_ms = fmax(e_ms, rel_err(dx_ms + n * d, dxref + n * d, d));
        e_std = fmax(e_std, rel_err(dx_std + n * d, dxref + n * d, d));
    }
    const char* name = layernorm ? "LayerNorm" : "RMSNorm";
    char what[96];
    snprintf(what, sizeof(what), "%s of finite rows beyond fp32 squares: z and r", name);
    check(e_z < 1e-5 && e_r < 1e-5, what, fmax(e_z, e_r));
    snprintf(what, sizeof(what), "%s of finite rows beyond fp32 squares: MS and std backward", name);
    check(e_ms < 1e-5 && e_std < 1e-5, what, fmax(e_ms, e_std));
    snprintf(what, sizeof(what), "%s of finite rows beyond fp32 squares: gamma gradient", name);
    check(e_g < 1e-5, what, e_g);
    free(x); free(dz); free(gamma); free(beta); free(z); free(rr); free(mean); free(dx_ms); free(dx_std); free(dy); free(dg); free(db);
    free(zref); free(rref); free(dxref); free(dgref);
}
