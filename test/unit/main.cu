// test/unit/main.cu: unit tests of the CPU kernels and formats against independent references:
// naive loops in double precision, explicit Jacobians, finite differences, and the paper's
// step rule written out longhand. Prints "N passed, M failed" and exits non-zero on any failure.
#include "../../llmc/common.h"
#include "../../llmc/formats/json.h"
#include "../../llmc/formats/safetensors.h"
#include "../../llmc/rng.h"
#include "../../llmc/cpu/matmul.h"
#include "../../llmc/cpu/norms.h"
#include "../../llmc/cpu/activations.h"
#include "../../llmc/cpu/attention.h"
#include "../../llmc/cpu/loss.h"
#include "../../llmc/train/trainable.h"
#include "../../llmc/memory/plan.h"
#include "../../llmc/memory/blas_plan.h"
#include "../../llmc/lora.h"

static int g_pass = 0, g_fail = 0;

static void check(int ok, const char* what, double err) {
    if (ok) g_pass++;
    else g_fail++;
    printf("%s  %-62s (worst error %.3g)\n", ok ? "PASS" : "FAIL", what, err);
}

static float* randn(int64_t n, Rng* r, float scale) {
    float* x = (float*)xmalloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) x[i] = scale * rng_normal(r);
    return x;
}

// max |a-b| / max(max|b|, tiny)
static double rel_err(const float* a, const double* b, int64_t n) {
    double e = 0, m = 1e-30;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        e = fmax(e, fabs(a[i] - b[i]));
        m = fmax(m, fabs(b[i]));
    }
    return e / m;
}

// ---- 2-bit codes ---------------------------------------------------------------------------

static void test_pack_roundtrip(void) {
    Rng r = rng_seeded(1, 0);
    int sizes[] = {1, 2, 3, 4, 5, 7, 8, 13, 1001, 4099};
    int ok = 1;
    Relu3Fit fit = RESILU2_FIT;
    for (int s = 0; s < 10; s++) {
        int n = sizes[s];
        float* x = randn(n, &r, 5.0f);
        x[0] = fit.c1; if (n > 1) x[1] = fit.c2; if (n > 2) x[2] = fit.c3;  // ties: strict >
        int64_t nb = packed_codes_bytes(n);
        uint8_t* packed = (uint8_t*)xmalloc(nb + 1);
        packed[nb] = 0xAB;  // a canary past the end
        for (int64_t i = 0; i < n; i += 8) act_codes8(packed, i, n, act_load(x, i, n, -INFINITY), fit);  // as the forwards do
        for (int i = 0; i < n; i++) {
            int expect = (x[i] > fit.c1 ? 1 : 0) + (x[i] > fit.c2 ? 1 : 0) + (x[i] > fit.c3 ? 1 : 0);
            if (codes_get(packed, i) != expect) ok = 0;
        }
        if ((n % 4) && (packed[nb - 1] >> (2 * (n % 4))) != 0) ok = 0;  // ragged tail padded with zeros
        if (packed[nb] != 0xAB) ok = 0;
        if (nb != (n + 3) / 4) ok = 0;
        free(x); free(packed);
    }
    check(ok, "2-bit packing round-trips at ragged sizes (1..4099), ties strict", 0);
}

// The step rule, written out independently: dx = dy * {0, a1, a1+a2, a1+a2+a3}[code].
static double step_level(double x, const double a[3], const double c[3]) {
    float l1 = (float)a[0], l2 = l1 + (float)a[1], l3 = l2 + (float)a[2];
    if (x > c[2]) return l3;
    if (x > c[1]) return l2;
    if (x > c[0]) return l1;
    return 0.0;
}

static void test_resilu2_backward(void) {
    const double a[3] = {-0.04060357190528599, 1.080925428529668, -0.040321856624382146};
    const double c[3] = {-6.3050461001646445, -0.0008684942046214787, 6.325815242089708};
    Rng r = rng_seeded(2, 0);
    int n = 10007;
    float *g = randn(n, &r, 6.0f), *u = randn(n, &r, 1.0f), *dp = randn(n, &r, 1.0f);
    float *p = randn(n, &r, 1), *sg = randn(n, &r, 1), *dg = randn(n, &r, 1), *du = randn(n, &r, 1);
    uint8_t* codes = (uint8_t*)xmalloc(packed_codes_bytes(n));
    swiglu_forward(p, sg, codes, g, u, n);
    swiglu_backward(dg, du, dp, sg, u, NULL, codes, n);
    int exact = 1;
    double fwd = 0;
    for (int i = 0; i < n; i++) {
        float expect_dg = dp[i] * u[i] * (float)step_level(g[i], a, c);
        if (dg[i] != expect_dg) exact = 0;
        if (du[i] != dp[i] * sg[i]) exact = 0;
        double silu = g[i] / (1.0 + exp(-(double)g[i]));
        fwd = fmax(fwd, fabs(sg[i] - silu) / fmax(1.0, fabs(silu)));
    }
    check(exact, "ReSiLU2 backward equals the step rule exactly", 0);
    check(fwd < 1e-6, "ReSiLU2 forward is the exact SiLU", fwd);
    // The levels of the fit, against docs/architecture.md: {0, -0.040603572, 1.0403218, 1.0}
    Relu3Fit fit = RESILU2_FIT;
    double le = fmax(fabs(relu3_level(1, fit) + 0.040603572), fmax(fabs(relu3_level(2, fit) - 1.0403218), fabs(relu3_level(3, fit) - 1.0)));
    check(le < 1e-6, "ReSiLU2 levels match the published levels", le);
    Relu3Fit gf = REGELU2_FIT;
    le = fmax(fabs(relu3_level(1, gf) + 0.049222611), fmax(fabs(relu3_level(2, gf) - 1.0487406), fabs(relu3_level(3, gf) - 1.0)));
    check(le < 1e-6, "ReGELU2 levels match the published levels", le);
    free(g); free(u); free(dp); free(p); free(sg); free(dg); free(du); free(codes);
}

static void test_regelu2_backward(void) {
    const double a[3] = {-0.04922261145617846, 1.0979632065417297, -0.048740595085551286};
    const double c[3] = {-3.1858810036855245, -0.001178821281161997, 3.190832613414926};
    Rng r = rng_seeded(3, 0);
    int n = 5003;
    float *x = randn(n, &r, 3.0f), *dy = randn(n, &r, 1.0f), *y = randn(n, &r, 1), *dx = randn(n, &r, 1), *dxe = randn(n, &r, 1);
    uint8_t* codes = (uint8_t*)xmalloc(packed_codes_bytes(n));
    gelu_forward(y, codes, x, n, 0);
    gelu_backward(dx, dy, NULL, codes, n, 0);
    gelu_backward(dxe, dy, x, NULL, n, 0);
    int exact = 1;
    double fwd = 0, ge = 0;
    for (int i = 0; i < n; i++) {
        if (dx[i] != dy[i] * (float)step_level(x[i], a, c)) exact = 0;
        double ref = 0.5 * x[i] * (1.0 + erf(x[i] / sqrt(2.0)));
        fwd = fmax(fwd, fabs(y[i] - ref));
        double h = 1e-3, num = (0.5 * (x[i] + h) * (1 + erf((x[i] + h) / sqrt(2.0))) - 0.5 * (x[i] - h) * (1 + erf((x[i] - h) / sqrt(2.0)))) / (2 * h);
        ge = fmax(ge, fabs(dxe[i] - dy[i] * num));
    }
    check(exact, "ReGELU2 backward equals the step rule exactly", 0);
    check(fwd < 1e-5, "GELU forward (erf form) is exact", fwd);
    check(ge < 1e-4, "exact GELU backward matches finite differences", ge);
    free(x); free(dy); free(y); free(dx); free(dxe); free(codes);
}

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

static void test_norm_backward(int layernorm) {
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

static void test_norm_huge_rows(int layernorm) {
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

// ---- matmul --------------------------------------------------------------------------------

static void test_matmul(void) {
    Rng r = rng_seeded(6, 0);
    int M = 13, N = 301, K = 37;
    float *A = randn(M * K, &r, 1), *Bt = randn(N * K, &r, 1), *Bn = randn(K * N, &r, 1), *At = randn(K * M, &r, 1);
    float* C = randn(M * N, &r, 1);
    float* C0 = (float*)xmalloc(sizeof(float) * M * N);
    memcpy(C0, C, sizeof(float) * M * N);
    double* ref = (double*)xmalloc(sizeof(double) * M * N);
    for (int form = 0; form < 3; form++) {
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double s = 0;
                for (int k = 0; k < K; k++) {
                    double a = form == 2 ? At[k * M + m] : A[m * K + k];
                    double b = form == 0 ? Bt[n * K + k] : Bn[k * N + n];
                    s += a * b;
                }
                ref[m * N + n] = C0[m * N + n] + 0.5 * s;
            }
        memcpy(C, C0, sizeof(float) * M * N);
        if (form == 0) matmul_nt(C, A, Bt, M, N, K, 0.5f, 1);
        if (form == 1) matmul_nn(C, A, Bn, M, N, K, 0.5f, 1);
        if (form == 2) matmul_tn(C, At, Bn, M, N, K, 0.5f, 1);
        const char* names[3] = {"matmul_nt (C += a A B^T) matches a naive loop", "matmul_nn (C += a A B) matches a naive loop",
                                "matmul_tn (C += a A^T B) matches a naive loop"};
        double e = rel_err(C, ref, M * N);
        check(e < 1e-5, names[form], e);
    }
    free(A); free(Bt); free(Bn); free(At); free(C); free(C0); free(ref);
}

// The packed GEMM at the shapes that exercise its tiling: several k blocks (K > 256), row blocks
// with a ragged last sliver, column blocks (few row blocks: LoRA's r-row dA), skinny N (r), store
// (accumulate = 0) and accumulate, every transposition. Per element the bound of a length-K fp32
// dot product in any order, (K + 2) * 2^-24 * (|alpha| sum_k |a_k b_k| + |C0|) (Higham's gamma_n with
// n = K plus the scale and the add), against a double reference. Then the thread-count claim:
// 1, 2 and 3 threads give the same bits.
static void test_matmul_shapes(void) {
    Rng r = rng_seeded(61, 0);
    // Skinny (LoRA's r = 16 on either side: operands read in place, an edge panel of B read in
    // place, a partial sliver of A read in place), ordinary, and B too large to pack whole (more
    // than MM_WHOLE_B floats): rounds of columns over all of K (N = 66001) and rounds of k blocks
    // over all columns (K = 90000), 17 rounds each, the last with an edge panel or a short k block.
    static const int shapes[][3] = {{512, 16, 576}, {16, 576, 512}, {576, 16, 512}, {100, 20, 700}, {16, 100, 300}, {100, 1536, 600},
                                    {7, 3, 1000},   {97, 40, 16},   {1, 1, 1},      {30, 66001, 64}, {30, 40, 90000}};
    int nthreads = omp_get_max_threads();
    for (size_t si = 0; si < sizeof(shapes) / sizeof(shapes[0]); si++) {
        int M = shapes[si][0], N = shapes[si][1], K = shapes[si][2];
        float *A = randn((int64_t)M * K, &r, 1), *B = randn((int64_t)N * K, &r, 1), *C0 = randn((int64_t)M * N, &r, 1);
        float* C = (float*)xmalloc(sizeof(float) * M * N);
        float* C1 = (float*)xmalloc(sizeof(float) * M * N);
        // the exact products in double (every form and mode computes these numbers) and the sums of
        // the magnitudes of their terms, for the bound
        double *ref = (double*)xmalloc(sizeof(double) * M * N), *mag = (double*)xmalloc(sizeof(double) * M * N);
        for (int m = 0; m < M; m++)
            for (int n = 0; n < N; n++) {
                double sp = 0, sa = 0;
                for (int k = 0; k < K; k++) {
                    double q = (double)A[(int64_t)m * K + k] * B[(int64_t)n * K + k];
                    sp += q;
                    sa += fabs(q);
                }
                ref[(int64_t)m * N + n] = sp;
                mag[(int64_t)m * N + n] = sa;
            }
        for (int form = 0; form < 3; form++)
            for (int acc = 0; acc < 2; acc++) {
                // the same numbers in each layout: a(m,k) = A[m*K+k]; b(k,n) = B[n*K+k]
                float *Af = A, *Bf = B, *tA = NULL, *tB = NULL;
                if (form == 2) {  // A^T stored [K, M]
                    tA = (float*)xmalloc(sizeof(float) * M * K);
                    for (int m = 0; m < M; m++) for (int k = 0; k < K; k++) tA[(int64_t)k * M + m] = A[(int64_t)m * K + k];
                    Af = tA;
                }
                if (form != 0) {  // B stored [K, N]
                    tB = (float*)xmalloc(sizeof(float) * N * K);
                    for (int n = 0; n < N; n++) for (int k = 0; k < K; k++) tB[(int64_t)k * N + n] = B[(int64_t)n * K + k];
                    Bf = tB;
                }
                double worst = 0.0;
                int same = 1;
                for (int th = 1; th <= 3; th++) {
                    omp_set_num_threads(th);
                    memcpy(C, C0, sizeof(float) * M * N);
                    if (form == 0) matmul_nt(C, Af, Bf, M, N, K, 0.75f, acc);
                    if (form == 1) matmul_nn(C, Af, Bf, M, N, K, 0.75f, acc);
                    if (form == 2) matmul_tn(C, Af, Bf, M, N, K, 0.75f, acc);
                    if (th == 1) memcpy(C1, C, sizeof(float) * M * N);
                    else same &= memcmp(C, C1, sizeof(float) * M * N) == 0;
                }
                omp_set_num_threads(nthreads);
                for (int64_t i = 0; i < (int64_t)M * N; i++) {
                    double c0 = acc ? C0[i] : 0.0;
                    double bound = (K + 2) * 0x1p-24 * (0.75 * mag[i] + fabs(c0));
                    double e = fabs(C1[i] - (c0 + 0.75 * ref[i])) / (bound > 0 ? bound : 1e-30);
                    worst = fmax(worst, e);
                }
                char what[160];
                snprintf(what, sizeof(what), "matmul_%s %dx%dx%d %s: within the fp32 dot-product bound (error / bound)",
                         form == 0 ? "nt" : form == 1 ? "nn" : "tn", M, N, K, acc ? "accumulating" : "storing");
                check(worst <= 1.0, what, worst);
                snprintf(what, sizeof(what), "matmul_%s %dx%dx%d %s: 1, 2 and 3 threads give the same bits",
                         form == 0 ? "nt" : form == 1 ? "nn" : "tn", M, N, K, acc ? "accumulating" : "storing");
                check(same, what, 0);
                free(tA); free(tB);
            }
        free(A); free(B); free(C0); free(C); free(C1); free(ref); free(mag);
    }
}

// ---- attention and RoPE --------------------------------------------------------------------

static double attn_loss(const float* q, const float* k, const float* v, const float* w, AttnShape s, float* o, float* lse) {
    attention_forward(o, lse, q, k, v, s);
    double L = 0;
    for (int64_t i = 0; i < (int64_t)s.B * s.T * s.H * s.hd; i++) L += (double)o[i] * w[i];
    return L;
}

// causal = 2: causal with packed examples (positions restart; a query sees only its example).
// causal = 3: causal without GQA (H = KVH: the backward writes dk, dv directly, no partial sums).
static void test_attention(int causal) {
    Rng r = rng_seeded(7 + causal, 0);
    static const int packed_pos[2 * 5] = {0, 1, 2, 0, 1, 0, 0, 1, 2, 3};
    AttnShape s = {2, 5, 4, causal == 3 ? 4 : 2, 6, causal != 0, causal == 2 ? packed_pos : NULL};
    int64_t nq = (int64_t)s.B * s.T * s.H * s.hd, nk = (int64_t)s.B * s.T * s.KVH * s.hd;
    float *q = randn(nq, &r, 1), *k = randn(nk, &r, 1), *v = randn(nk, &r, 1), *w = randn(nq, &r, 1);
    float *o = randn(nq, &r, 1), *lse = randn(s.B * s.H * s.T, &r, 1);
    float *dq = randn(nq, &r, 1), *dk = randn(nk, &r, 1), *dv = randn(nk, &r, 1);
    attn_loss(q, k, v, w, s, o, lse);
    attention_backward(dq, dk, dv, w, q, k, v, o, lse, s);
    // naive forward in double
    double fe = 0;
    double scale = 1.0 / sqrt((double)s.hd);
    for (int b = 0; b < s.B; b++)
        for (int h = 0; h < s.H; h++)
            for (int t = 0; t < s.T; t++) {
                int kh = h / (s.H / s.KVH), tend = causal ? t + 1 : s.T, j0 = causal == 2 ? t - packed_pos[b * s.T + t] : 0;
                double p[16], mx = -1e300, sum = 0;
                for (int j = j0; j < tend; j++) {
                    double d = 0;
                    for (int i = 0; i < s.hd; i++) d += (double)q[((b * s.T + t) * s.H + h) * s.hd + i] * k[((b * s.T + j) * s.KVH + kh) * s.hd + i];
                    p[j] = d * scale;
                    mx = fmax(mx, p[j]);
                }
                for (int j = j0; j < tend; j++) { p[j] = exp(p[j] - mx); sum += p[j]; }
                for (int i = 0; i < s.hd; i++) {
                    double acc = 0;
                    for (int j = j0; j < tend; j++) acc += p[j] / sum * v[((b * s.T + j) * s.KVH + kh) * s.hd + i];
                    fe = fmax(fe, fabs(acc - o[((b * s.T + t) * s.H + h) * s.hd + i]));
                }
            }
    const char* fw[4] = {"bidirectional GQA attention forward matches a naive softmax", "causal GQA attention forward matches a naive softmax",
                         "packed-example attention forward matches a per-example softmax", "causal attention forward (H = KVH) matches a naive softmax"};
    check(fe < 1e-5, fw[causal], fe);
    // central finite differences on every input element
    float* tmp_o = (float*)xmalloc(sizeof(float) * nq);
    float* tmp_l = (float*)xmalloc(sizeof(float) * s.B * s.H * s.T);
    double ge = 0, gm = 0;
    float* ins[3] = {q, k, v};
    float* grads[3] = {dq, dk, dv};
    int64_t ns[3] = {nq, nk, nk};
    for (int which = 0; which < 3; which++)
        for (int64_t i = 0; i < ns[which]; i++) {
            float keep = ins[which][i], h = 1e-2f;
            ins[which][i] = keep + h;
            double lp = attn_loss(q, k, v, w, s, tmp_o, tmp_l);
            ins[which][i] = keep - h;
            double lm = attn_loss(q, k, v, w, s, tmp_o, tmp_l);
            ins[which][i] = keep;
            double num = (lp - lm) / (2 * h);
            ge = fmax(ge, fabs(num - grads[which][i]));
            gm = fmax(gm, fabs(num));
        }
    const char* bw[4] = {"bidirectional attention backward matches finite differences", "causal attention backward (recomputed scores) matches finite differences",
                         "packed-example attention backward matches finite differences",
                         "causal attention backward, H = KVH (dk, dv written directly), matches finite differences"};
    check(ge / gm < 2e-3, bw[causal], ge / gm);
    free(q); free(k); free(v); free(w); free(o); free(lse); free(dq); free(dk); free(dv); free(tmp_o); free(tmp_l);
}

// Attention across several 64-row blocks, forward and backward against a double-precision
// reference of the same formulas (P = softmax(scale q k^T), dS = P (dP - D), dq = scale dS k,
// dk = scale dS^T q, dv = P^T do). Tolerance: each output is a sum of at most T products of
// magnitude-bounded terms computed in fp32 (scores as length-hd dot products, exp within 2 ulp):
// we allow 64 T 2^-24 of the largest reference magnitude, about 6e-4 relative at T = 150; a wrong
// mask, block edge or partial sum gives O(1) errors. Then 1, 2 and 3 threads give the same bits.
// The cases cover the one-pass backward's layouts (llmc/cpu/attention.h): partial dk, dv summed
// over the group's heads and over query chunks (GQA group 2 and 3, and group 1 with several
// chunks per head), and dk, dv written directly (group 1, one chunk per head); causal with packed
// examples whose starts are not on a 16-key panel, causal, bidirectional; T not a multiple of 64;
// hd not a multiple of 16.
typedef struct { int B, T, H, KVH, hd, causal, packed; const char* name; } AttnCase;

static void test_attention_blocks_case(AttnCase c) {
    Rng r = rng_seeded(71 + c.T + c.H, 0);
    const int B = c.B, T = c.T, H = c.H, KVH = c.KVH, hd_ = c.hd;
    int* pos = (int*)xmalloc(sizeof(int) * B * T);
    for (int b = 0; b < B; b++)  // sequence 0 of a packed case: examples of 70 and T - 70 tokens
        for (int t = 0; t < T; t++) pos[b * T + t] = b == 0 && c.packed && t >= 70 ? t - 70 : t;
    AttnShape s = {B, T, H, KVH, hd_, c.causal, c.packed ? pos : NULL};
    int64_t nq = (int64_t)B * T * H * hd_, nk = (int64_t)B * T * KVH * hd_;
    float *q = randn(nq, &r, 1), *k = randn(nk, &r, 1), *v = randn(nk, &r, 1), *dout = randn(nq, &r, 1);
    float* out[3][5];  // per thread count: o, lse, dq, dk, dv
    int64_t n5[5] = {nq, (int64_t)B * H * T, nq, nk, nk};
    int nthreads = omp_get_max_threads();
    for (int th = 0; th < 3; th++) {
        for (int w = 0; w < 5; w++) out[th][w] = (float*)xmalloc(4 * n5[w]);
        omp_set_num_threads(th + 1);
        attention_forward(out[th][0], out[th][1], q, k, v, s);
        attention_backward(out[th][2], out[th][3], out[th][4], dout, q, k, v, out[th][0], out[th][1], s);
    }
    omp_set_num_threads(nthreads);
    double *ro = (double*)calloc(nq, 8), *rdq = (double*)calloc(nq, 8), *rdk = (double*)calloc(nk, 8), *rdv = (double*)calloc(nk, 8);
    double scale = 1.0 / sqrt((double)hd_);
    double* P = (double*)xmalloc(sizeof(double) * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                int kh = h / (H / KVH), j0 = c.causal ? t - pos[b * T + t] : 0, j1 = c.causal ? t : T - 1;
                const float *qi = q + ((int64_t)(b * T + t) * H + h) * hd_, *doi = dout + ((int64_t)(b * T + t) * H + h) * hd_;
                double mx = -1e300, sum = 0, D = 0;
                for (int j = j0; j <= j1; j++) {
                    double d = 0;
                    for (int i = 0; i < hd_; i++) d += (double)qi[i] * k[((int64_t)(b * T + j) * KVH + kh) * hd_ + i];
                    P[j] = d * scale;
                    mx = fmax(mx, P[j]);
                }
                for (int j = j0; j <= j1; j++) { P[j] = exp(P[j] - mx); sum += P[j]; }
                for (int j = j0; j <= j1; j++) P[j] /= sum;
                double* oi = ro + ((int64_t)(b * T + t) * H + h) * hd_;
                for (int j = j0; j <= j1; j++)
                    for (int i = 0; i < hd_; i++) oi[i] += P[j] * v[((int64_t)(b * T + j) * KVH + kh) * hd_ + i];
                for (int i = 0; i < hd_; i++) D += doi[i] * oi[i];
                for (int j = j0; j <= j1; j++) {
                    const float *kj = k + ((int64_t)(b * T + j) * KVH + kh) * hd_, *vj = v + ((int64_t)(b * T + j) * KVH + kh) * hd_;
                    double dp = 0;
                    for (int i = 0; i < hd_; i++) dp += (double)doi[i] * vj[i];
                    double ds = P[j] * (dp - D) * scale;
                    for (int i = 0; i < hd_; i++) {
                        rdq[((int64_t)(b * T + t) * H + h) * hd_ + i] += ds * kj[i];
                        rdk[((int64_t)(b * T + j) * KVH + kh) * hd_ + i] += ds * qi[i];
                        rdv[((int64_t)(b * T + j) * KVH + kh) * hd_ + i] += P[j] * doi[i];
                    }
                }
            }
    const double* want[4] = {ro, rdq, rdk, rdv};
    const int slot[4] = {0, 2, 3, 4};
    const char* names[4] = {"o", "dq", "dk", "dv"};
    double worst = 0;
    for (int w = 0; w < 4; w++) {
        double err = 0, mag = 0;
        const float* got = out[1][slot[w]];
        for (int64_t i = 0; i < n5[slot[w]]; i++) { err = fmax(err, fabs(got[i] - want[w][i])); mag = fmax(mag, fabs(want[w][i])); }
        double e = err / (64.0 * T * 0x1p-24 * mag);
        if (e > worst || isnan(e)) worst = isnan(e) ? INFINITY : e;
        if (!(e <= 1.0)) fprintf(stderr, "  %s: %s off by %g of the bound\n", c.name, names[w], e);
    }
    char what[200];
    snprintf(what, sizeof(what), "attention blocks, %s: o, dq, dk, dv match a double reference (error / 64 T 2^-24 max)", c.name);
    check(worst <= 1.0, what, worst);
    int same = 1;
    for (int th = 0; th < 3; th += 2)
        for (int w = 0; w < 5; w++) same &= !memcmp(out[th][w], out[1][w], 4 * n5[w]);
    snprintf(what, sizeof(what), "attention blocks, %s: 1, 2 and 3 threads give the same bits", c.name);
    check(same, what, 0);
    for (int th = 0; th < 3; th++)
        for (int w = 0; w < 5; w++) free(out[th][w]);
    free(q); free(k); free(v); free(dout); free(pos); free(P);
    free(ro); free(rdq); free(rdk); free(rdv);
}

static void test_attention_blocks(void) {
    const AttnCase cases[] = {
        {2, 150, 4, 2, 16, 1, 1, "T=150 causal packed, GQA group 2 (partial dk, dv, 2 chunks)"},
        {1, 130, 6, 2, 24, 0, 0, "T=130 bidirectional, GQA group 3, hd 24 (partial, 3 chunks)"},
        {1, 200, 2, 2, 16, 1, 1, "T=200 causal packed, group 1 (partial, 4 chunks per head)"},
        {2, 100, 8, 8, 16, 1, 0, "T=100 causal, group 1 (dk, dv written directly)"},
        {2, 70, 8, 8, 8, 0, 0, "T=70 bidirectional, group 1, hd 8 (direct)"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) test_attention_blocks_case(cases[i]);
}

// ---- exp -----------------------------------------------------------------------------------

// vx_exp (llmc/cpu/vec_exp.h) against libm's double exp over the range the softmaxes use,
// [-87.3, 0], and a little above: within 4 ulp relative (the header claims about 2); 0 below -87.3.
static void test_vec_exp(void) {
    double worst = 0;
    for (int i = 0; i <= 400000; i++) {
        float x = -87.3f + 95.0f * i / 400000.0f;
        if (x > 8.0f) break;
        float y = vx_exp(vx_splat(x))[0];
        double ref = exp((double)x);
        worst = fmax(worst, fabs(y - ref) / ref / 0x1p-23);
    }
    check(worst <= 4.0, "vx_exp within 4 ulp of exp on [-87.3, 8] (worst in ulp)", worst);
    check(vx_exp(vx_splat(-100.0f))[0] == 0.0f && vx_exp(vx_splat(-88.0f))[0] == 0.0f, "vx_exp gives 0 below -87.3", 0);
}

// ---- erf, GELU ------------------------------------------------------------------------------

// The fp32 ulp at |d|: 2^(e-24) for |d| in [2^(e-1), 2^e), 2^-149 among the denormals.
static double ulp_f32(double d) {
    int e;
    frexp(d, &e);
    return ldexp(1.0, (e < -125 ? -125 : e) - 24);
}
static float f32_of_bits(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// vx_erf (llmc/cpu/vec_exp.h) against double erf, in ulps of the result: every 2^8-th float of
// both signs (2^23 per sign, zero to inf), every float within 2^12 of the boundaries of its pieces
// (1, 3.9375), and the edge values. Bound 2: the fitted pieces are 1e-9 relative and 7e-9 absolute
// (beside results of at least 0.84), so what remains is fp32 rounding: half an ulp at the end, a
// fraction of one from a^2 and the polynomial's steps (1 - erfc keeps erfc's error below 0.16 of
// the result's). It reaches 1.12 here, as over every float of [2^-25, 4.5); libm's erff 0.92.
static void test_vec_erf(void) {
    double worst = 0, worst_at = 0, lworst = 0;
    float xs[8];
    int k = 0, ok = 1;
    auto flush = [&](int m) {
        vx_f8 y = vx_erf(vx_load(xs));
        for (int j = 0; j < m; j++) {
            double ref = erf((double)xs[j]);
            double e = isnan(y[j]) ? INFINITY : fabs(y[j] - ref) / ulp_f32(ref);  // no NaN input in the sweep
            if (e > worst) { worst = e; worst_at = xs[j]; }
            lworst = fmax(lworst, fabs(erff(xs[j]) - ref) / ulp_f32(ref));
        }
    };
    auto add = [&](float x) { xs[k++] = x; if (k == 8) { flush(8); k = 0; } };
    for (uint32_t sg = 0; sg < 2; sg++) {
        for (uint32_t u = 0; u < 0x7f800000u; u += 256) add(f32_of_bits(u | sg << 31));
        const float bounds[2] = {1.0f, 3.9375f}, edges[5] = {1.4e-45f, 1.1754942e-38f, 1.1754944e-38f, 1e-30f, 3.4028235e38f};
        for (float b : bounds)
            for (int d = -4096; d <= 4096; d++) {
                uint32_t u;
                memcpy(&u, &b, 4);
                add(f32_of_bits((u + d) | sg << 31));
            }
        for (float x : edges) add(sg ? -x : x);
    }
    if (k) flush(k);
    char name[128];
    snprintf(name, sizeof(name), "vx_erf within 2 ulp of erf over fp32 (worst at %.9g; erff's %.2f)", worst_at, lworst);
    check(worst <= 2.0, name, worst);
    vx_f8 e = vx_erf((vx_f8){0.0f, -0.0f, INFINITY, -INFINITY, NAN, -NAN, 3.4028235e38f, -1.4e-45f});
    ok = e[0] == 0.0f && !signbit(e[0]) && e[1] == 0.0f && signbit(e[1]) && e[2] == 1.0f && e[3] == -1.0f &&
         isnan(e[4]) && isnan(e[5]) && e[6] == 1.0f && e[7] < 0.0f && e[7] == (float)(-1.4e-45 * 1.1283791670955126);
    check(ok, "vx_erf edges: +-0 keep their sign, +-inf -> +-1, NaN -> NaN, denormals", 0);
}

// The vector GELUs (llmc/cpu/activations.h) against double references, every 2^10-th finite float
// of both signs (2^21 per sign). The forwards in ulps of max(|gelu(x)|, |x|/2): ulp of the result
// for x >= 0; for x < 0 the erf form's 1 + erf(x/sqrt 2) cancels, as gelu_f's does, leaving an
// error of a few ulp of 1 times |x|/2 (the tanh form forms 1 / (1 + e^(-2u)) and does not
// cancel). The derivatives in ulps of max(|gelu'(x)|, 1/2), i.e. units of 2^-24 below 1: they
// subtract x phi(x) from Phi(x) for x < 0, and x^2's rounding (relative 2^-24 x^2/2 in e^(-x^2/2))
// is there too. Reached here: 1.51, 1.52, 2.36, 2.35 (libm's scalar gelu_f and friends, the same
// formulas with erff/tanhf/expf, printed alongside: 1.51, 1.75, 2.24, 9.14). Bounds: 3, 3, 5, 5, about
// twice that, so a change of rounding order passes and a wrong coefficient or piece does not.
static void test_vec_gelu(void) {
    const double k = sqrt(2.0 / M_PI), c = 0.044715;
    double w[4] = {0, 0, 0, 0}, l[4] = {0, 0, 0, 0};
    float xs[8];
    int n = 0;
    auto flush = [&](int m) {
        vx_f8 x = vx_load(xs), v[4] = {vx_gelu(x), vx_gelu_grad(x), vx_gelu_tanh(x), vx_gelu_tanh_grad(x)};
        for (int j = 0; j < m; j++) {
            double xd = xs[j], phi = exp(-0.5 * xd * xd) / sqrt(2.0 * M_PI), big = 0.5 * fabs(xd);
            double u = k * (xd + c * xd * xd * xd), e = exp(-2.0 * u), s = 1.0 / (1.0 + e);
            double ref[4] = {0.5 * xd * erfc(-xd / sqrt(2.0)), 0.5 * erfc(-xd / sqrt(2.0)) + xd * phi, xd * s,
                             isinf(e) ? 0.0 : s + 2.0 * xd * s * (e * s) * k * (1.0 + 3.0 * c * xd * xd)};
            float lib[4] = {gelu_f(xs[j]), gelu_grad_f(xs[j]), gelu_tanh_f(xs[j]), gelu_tanh_grad_f(xs[j])};
            for (int f = 0; f < 4; f++) {
                double unit = ulp_f32(fmax(fabs(ref[f]), f % 2 ? 0.5 : big));
                w[f] = fmax(w[f], isnan(v[f][j]) ? INFINITY : fabs(v[f][j] - ref[f]) / unit);
                if (!isnan(lib[f])) l[f] = fmax(l[f], fabs(lib[f] - ref[f]) / unit);
            }
        }
    };
    for (uint32_t sg = 0; sg < 2; sg++)
        for (uint32_t u = 0; u < 0x7f800000u; u += 1024) {
            xs[n++] = f32_of_bits(u | sg << 31);
            if (n == 8) { flush(8); n = 0; }
        }
    const char* what[4] = {"gelu (erf form)", "gelu' (erf form)", "gelu (tanh form)", "gelu' (tanh form)"};
    const double bound[4] = {3, 3, 5, 5};
    for (int f = 0; f < 4; f++) {
        char name[128];
        snprintf(name, sizeof(name), "vector %s within %g ulp of double (libm's: %.2f)", what[f], bound[f], l[f]);
        check(w[f] <= bound[f], name, w[f]);
    }
    vx_f8 x = (vx_f8){INFINITY, -INFINITY, NAN, 0.0f, -0.0f, 1e30f, -1e30f, 3.0f};
    vx_f8 g = vx_gelu_grad(x), t = vx_gelu_tanh(x), tg = vx_gelu_tanh_grad(x), y = vx_gelu(x);
    int ok = y[0] == INFINITY && isnan(y[2]) && y[3] == 0.0f && y[5] == 1e30f && y[6] == 0.0f;
    ok = ok && g[0] == 1.0f && g[1] == 0.0f && isnan(g[2]) && g[3] == 0.5f && g[5] == 1.0f && g[6] == 0.0f;
    ok = ok && t[0] == INFINITY && t[1] == 0.0f && isnan(t[2]) && t[3] == 0.0f && t[5] == 1e30f && t[6] == 0.0f;
    ok = ok && tg[0] == 1.0f && tg[1] == 0.0f && isnan(tg[2]) && tg[3] == 0.5f && tg[5] == 1.0f && tg[6] == 0.0f;
    check(ok, "vector GELUs at +-inf, NaN, +-0, +-1e30: the limits, NaN kept", 0);
}

static void test_rope(void) {
    Rng r = rng_seeded(9, 0);
    int T = 6, H = 3, hd = 8, N = 2 * T, half = hd / 2;
    float *cs = (float*)xmalloc(sizeof(float) * T * half), *sn = (float*)xmalloc(sizeof(float) * T * half);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) { double a = t * pow(10000.0, -2.0 * i / hd); cs[t * half + i] = (float)cos(a); sn[t * half + i] = (float)sin(a); }
    float* x = randn(N * H * hd, &r, 1);
    float* y = (float*)xmalloc(sizeof(float) * N * H * hd);
    memcpy(y, x, sizeof(float) * N * H * hd);
    rope_apply(y, cs, sn, NULL, N, T, H, hd, 0);
    double fe = 0;  // rotate-half: (x_i, x_{i+hd/2}) rotated by angle t*theta^(-2i/hd)
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < half; i++) {
                double a = (n % T) * pow(10000.0, -2.0 * i / hd);
                const float* xv = x + (n * H + h) * hd;
                const float* yv = y + (n * H + h) * hd;
                fe = fmax(fe, fabs(yv[i] - (xv[i] * cos(a) - xv[i + half] * sin(a))));
                fe = fmax(fe, fabs(yv[i + half] - (xv[i + half] * cos(a) + xv[i] * sin(a))));
            }
    check(fe < 1e-5, "RoPE (rotate-half) matches the rotation formula", fe);
    rope_apply(y, cs, sn, NULL, N, T, H, hd, 1);
    double ie = 0;
    for (int i = 0; i < N * H * hd; i++) ie = fmax(ie, fabs(y[i] - x[i]));
    check(ie < 1e-5, "RoPE backward (inverse rotation) undoes the forward", ie);
    free(cs); free(sn); free(x); free(y);
}

// ---- chunked loss --------------------------------------------------------------------------

static void test_chunked_loss(void) {
    Rng r = rng_seeded(10, 0);
    int N = 23, d = 16, V = 37;
    float *x = randn(N * d, &r, 1), *gamma = randn(d, &r, 0.2f), *W = randn(V * d, &r, 0.5f);
    for (int i = 0; i < d; i++) gamma[i] += 1.0f;
    int* tg = (int*)xmalloc(sizeof(int) * N);
    float* mask = (float*)xmalloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) { tg[i] = (int)rng_below(&r, V); mask[i] = (i % 5 == 2) ? 0.0f : 1.0f; }
    float* dx[2];
    LossStats st[2];
    int chunks[2] = {N, 4};
    for (int c = 0; c < 2; c++) {
        LossScratch sc = {(float*)xmalloc(sizeof(float) * N * d), (float*)xmalloc(sizeof(float) * N), (float*)xmalloc(sizeof(float) * N * V),
                          (float*)xmalloc(sizeof(float) * N * d)};
        dx[c] = (float*)xcalloc(N * d, sizeof(float));
        memset(&st[c], 0, sizeof(LossStats));
        lm_head_loss(x, gamma, 1e-5f, W, V, d, tg, mask, N, chunks[c], 1.0f / 18, dx[c], NULL, sc, &st[c]);
        free(sc.z); free(sc.r); free(sc.logits); free(sc.dz);
    }
    // independent reference: the full logits matrix in double
    double loss = 0, cnt = 0;
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int i = 0; i < d; i++) ss += (double)x[n * d + i] * x[n * d + i];
        double rr = 1.0 / sqrt(ss / d + 1e-5), mx = -1e300, lg[64], sum = 0;
        for (int v = 0; v < V; v++) {
            lg[v] = 0;
            for (int i = 0; i < d; i++) lg[v] += x[n * d + i] * rr * gamma[i] * W[v * d + i];
            mx = fmax(mx, lg[v]);
        }
        for (int v = 0; v < V; v++) sum += exp(lg[v] - mx);
        if (mask[n] != 0) { loss += mx + log(sum) - lg[tg[n]]; cnt += 1; }
    }
    double e1 = fabs(st[0].loss_sum - loss) / loss, e2 = fabs(st[1].loss_sum - loss) / loss;
    check(fmax(e1, e2) < 1e-5 && st[0].count == cnt && st[1].count == cnt, "chunked LM head + CE equals the full-logits loss (mask honoured)", fmax(e1, e2));
    double de = 0, dm = 0;
    for (int i = 0; i < N * d; i++) { de = fmax(de, fabs(dx[0][i] - dx[1][i])); dm = fmax(dm, fabs(dx[0][i])); }
    check(de / dm < 1e-6, "chunk size does not change the head gradient", de / dm);
    // finite differences on a few inputs of the loss (sum / 18)
    double ge = 0;
    LossScratch sc = {(float*)xmalloc(sizeof(float) * N * d), (float*)xmalloc(sizeof(float) * N), (float*)xmalloc(sizeof(float) * N * V),
                      (float*)xmalloc(sizeof(float) * N * d)};
    for (int i = 0; i < N * d; i += 7) {
        float keep = x[i], h = 1e-2f;
        LossStats a = {}, b = {};
        x[i] = keep + h;
        lm_head_loss(x, gamma, 1e-5f, W, V, d, tg, mask, N, 5, 0, NULL, NULL, sc, &a);
        x[i] = keep - h;
        lm_head_loss(x, gamma, 1e-5f, W, V, d, tg, mask, N, 5, 0, NULL, NULL, sc, &b);
        x[i] = keep;
        ge = fmax(ge, fabs((a.loss_sum - b.loss_sum) / (2 * h) / 18 - dx[0][i]));
    }
    check(ge / dm < 5e-3, "fused head gradient (final RMSNorm included) matches finite differences", ge / dm);
    free(sc.z); free(sc.r); free(sc.logits); free(sc.dz);
    free(x); free(gamma); free(W); free(tg); free(mask); free(dx[0]); free(dx[1]);
}

// ---- formats -------------------------------------------------------------------------------

static void test_safetensors_roundtrip(void) {
    const char* path = "test/tmp_units.safetensors";
    float a[6] = {1, -2, 3.5f, 0, 1e-3f, -7};
    int32_t b[3] = {7, -1, 123456};
    StWriter w;
    memset(&w, 0, sizeof(w));
    int64_t sa[2] = {2, 3}, sb[1] = {3};
    st_writer_add(&w, "a", ST_F32, 2, sa, a);
    st_writer_add(&w, "b.x", ST_I32, 1, sb, b);
    st_writer_save(&w, path, "\"format\":\"pt\"");
    st_writer_free(&w);
    StFile f;
    st_open(&f, path);
    const StTensor* ta = st_find(&f, "a");
    const StTensor* tb = st_find(&f, "b.x");
    int ok = f.count == 2 && ta && tb && ta->ndim == 2 && ta->shape[1] == 3 && memcmp(ta->data, a, sizeof(a)) == 0 && tb->dtype == ST_I32 &&
             memcmp(tb->data, b, sizeof(b)) == 0;
    st_close(&f);
    remove(path);
    check(ok, "safetensors write then read gives the same tensors", 0);
    // bf16/f16 conversion of exactly representable values
    uint16_t h1 = f32_to_bf16(-3.5f), h2 = 0x3C00 /* f16 1.0 */, h3 = 0x0001 /* f16 smallest subnormal */;
    int ok2 = bf16_to_f32(h1) == -3.5f && f16_to_f32(h2) == 1.0f && f16_to_f32(h3) == ldexpf(1.0f, -24) && f32_to_bf16(1.00390625f) == 0x3F80;
    // f32 -> f16 -> f32 against the exact rounding of random values (and the special cases)
    Rng r = rng_seeded(12, 0);
    int ok3 = f32_to_f16(65504.0f) == 0x7BFF && f32_to_f16(1e6f) == 0x7C00 && f32_to_f16(-0.0f) == 0x8000 &&
              f32_to_f16(ldexpf(1.0f, -24)) == 0x0001 && f32_to_f16(ldexpf(1.0f, -25)) == 0x0000 && f32_to_f16(1.0f + ldexpf(1.0f, -11)) == 0x3C00;
    for (int i = 0; i < 20000 && ok3; i++) {
        float x = rng_normal(&r) * ldexpf(1.0f, (int)rng_below(&r, 40) - 26);
        float y = f16_to_f32(f32_to_f16(x));
        // y must be a nearest half: no half lies strictly closer (the neighbours differ by one ulp)
        uint16_t hy = f32_to_f16(x);
        float up = f16_to_f32((uint16_t)(hy + 1)), dn = f16_to_f32((uint16_t)(hy - 1));
        if (fabsf(x) < 65504.0f && (fabsf(up - x) < fabsf(y - x) || ((hy & 0x7fff) && fabsf(dn - x) < fabsf(y - x)))) ok3 = 0;
    }
    check(ok2 && ok3, "bf16 / f16 conversions (round to nearest even, subnormals, overflow)", 0);
}

// CRC-32 against the standard check value (CRC-32/ISO-HDLC of "123456789" is cbf43926, the
// value zlib.crc32 gives), any split into updates giving the same value (the slicing-by-8 path
// and the byte path), and a flipped bit in a safetensors file's data refused by st_open's check.
static void test_crc32(void) {
    const char* s = "123456789";
    int ok = crc32_of(s, 9) == 0xCBF43926u && crc32_of("", 0) == 0;
    unsigned char buf[1000];
    for (int i = 0; i < 1000; i++) buf[i] = (unsigned char)(i * 7 + 3);
    uint32_t whole = crc32_of(buf, sizeof(buf));
    for (int cut = 0; cut <= 1000 && ok; cut += 37) {
        Crc32 c;
        crc32_init(&c);
        crc32_update(&c, buf, cut);
        crc32_update(&c, buf + cut, 1000 - cut);
        ok = crc32_final(&c) == whole;
    }
    buf[500] ^= 1;
    ok = ok && crc32_of(buf, sizeof(buf)) != whole;
    const char* path = "test/tmp_units_crc.safetensors";
    float a[4] = {1, 2, 3, 4};
    int64_t sa[1] = {4};
    StWriter w;
    memset(&w, 0, sizeof(w));
    st_writer_add(&w, "a", ST_F32, 1, sa, a);
    st_writer_save(&w, path, "\"format\":\"pt\"");
    st_writer_free(&w);
    StFile f;
    st_open(&f, path);
    uint32_t rec = 0;
    ok = ok && st_recorded_crc(&f, &rec) && rec == crc32_of(a, sizeof(a));
    st_close(&f);
    remove(path);
    check(ok, "CRC-32: check value, split updates, a flipped bit; safetensors records its data's CRC", 0);
}

static void test_json(void) {
    const char* text = "{\"a\": 3, \"b\": [1, 2.5e1, -3], \"s\": \"x\\n\\u00e9\", \"t\": true, \"n\": null, \"o\": {\"k\": \"v\"}}";
    Json j = json_parse(text, strlen(text), "inline");
    const Json* b = json_get(&j, "b");
    int ok = json_number_or(&j, "a", 0) == 3 && b && b->count == 3 && b->items[1].number == 25 && strcmp(json_string_or(&j, "s", ""), "x\n\xc3\xa9") == 0 &&
             json_bool_or(&j, "t", 0) == 1 && json_get(&j, "n")->type == JSON_NULL && strcmp(json_string_or(json_get(&j, "o"), "k", ""), "v") == 0;
    json_free(&j);
    check(ok, "JSON reader: numbers, strings with escapes, nesting, literals", 0);
}

// ---- gradient buckets and the ZeRO-1 shard layout ------------------------------------------

// For several arena sizes, world sizes, block layouts and bucket sizes: the buckets tile the
// padded arena from the top down, each splits into equal pieces per rank, 1-byte buckets give
// every block its own; the ranks' shards tile [0, shard) and, written back in arena order,
// rebuild the arena exactly.
static void test_grad_buckets(void) {
    int ok = 1;
    const int64_t counts[] = {1, 7, 1000, 4099};
    const char* bytes[] = {"1", "64", "1000000000"};
    for (int ci = 0; ci < 4; ci++)
        for (int world = 1; world <= 4; world++)
            for (int bi = 0; bi < 3; bi++) {
                int64_t count = counts[ci], off[5];
                int blocks = 0;
                for (int64_t o = count / 7; o < count && blocks < 5; o += count / 5 + 1) off[blocks++] = o;  // blocks above a stem
                setenv("LLMC_GRAD_BUCKET_BYTES", bytes[bi], 1);
                Trainable tr;
                memset(&tr, 0, sizeof(tr));
                tr.count = count; tr.world = world; tr.zero1 = world > 1;
                tr.shard = tr.zero1 ? (count + world - 1) / world : count;
                tr.padded = tr.zero1 ? tr.shard * world : count;
                trainable_plan_buckets(&tr, off, blocks);
                int64_t hi = tr.padded, align = tr.zero1 ? world : 1;
                for (int i = 0; i < tr.n_buckets; i++) {
                    const GradBucket* b = &tr.buckets[i];
                    ok &= b->hi == hi && b->lo < b->hi && (b->hi - b->lo) % align == 0 && b->shard_off * align == b->lo;
                    hi = b->lo;
                }
                // 1-byte buckets: one per distinct (rounded) block start, plus the stem's; 1 GB: one
                int expect = 1;
                for (int l = 0; l < blocks; l++) {
                    int64_t lo = (off[l] + align - 1) / align * align, prev = l ? (off[l - 1] + align - 1) / align * align : 0;
                    expect += lo > 0 && lo < tr.padded && lo != prev;
                }
                ok &= hi == 0 && tr.n_buckets == (bi == 0 ? expect : bi == 2 ? 1 : tr.n_buckets);
                float* arena = (float*)xmalloc(sizeof(float) * tr.padded);
                float* back = (float*)xcalloc(tr.padded, sizeof(float));
                float* shard = (float*)xmalloc(sizeof(float) * tr.shard);
                for (int64_t i = 0; i < tr.padded; i++) arena[i] = (float)i;
                for (int r = 0; r < world; r++) {
                    int64_t seen = 0;
                    trainable_shard_from_arena(&tr, arena, shard, tr.zero1 ? r : 0);
                    trainable_shard_to_arena(&tr, shard, back, tr.zero1 ? r : 0);
                    for (int i = 0; i < tr.n_buckets; i++) seen += bucket_piece(&tr, &tr.buckets[i]);
                    ok &= seen == tr.shard;
                }
                ok &= memcmp(arena, back, sizeof(float) * tr.padded) == 0;
                free(arena); free(back); free(shard); free(tr.buckets);
            }
    unsetenv("LLMC_GRAD_BUCKET_BYTES");
    check(ok, "gradient buckets: ZeRO-1 pieces tile the padded arena", 0);
}

// A buffer planned with an alignment (the cuBLAS workspace: 256 bytes) starts at such an offset,
// its padding counts in the arena, and the buffers around it keep PLAN_ALIGN and do not overlap.
static void test_plan_alignment(void) {
    MemPlan p;
    memset(&p, 0, sizeof(p));
    void *a, *w, *b;
    plan_add(&p, MEM_SCRATCH, "m", -1, "a", 100, &a);  // offset 0, next free 128
    plan_add_aligned(&p, MEM_SCRATCH, "cublas", -1, "w", BLAS_WORKSPACE_BYTES, &w, BLAS_WORKSPACE_ALIGN);
    plan_add(&p, MEM_SCRATCH, "m", -1, "b", 3, &b);
    const PlanBuffer* B = p.bufs;
    int ok = B[0].offset == 0 && B[1].offset == 256 && B[2].offset == 256 + BLAS_WORKSPACE_BYTES &&
             p.cat_bytes[MEM_SCRATCH] == 256 + BLAS_WORKSPACE_BYTES + PLAN_ALIGN;
    plan_free(&p);
    check(ok, "plan: a 256-byte aligned buffer between two others", 0);
}

// ---- LoRA dropout (llmc/lora.h, llmc/lora_dropout.h) -----------------------------------------
// On n = 2^20 elements of a constant input: the kept count is Binomial(n, 1 - p), so it lies
// within 6 standard deviations sqrt(n p (1-p)) of n (1-p) but for a chance below 1e-8; the mean
// output is scale * kept / n, so E[output] = 1 (the input) within 6 scale sqrt(p (1-p) / n). The
// backward regenerates the forward's mask: dx += keep * scale * t with t = 1 equals xa bit for bit.
// Behind a norm the input is fmaf(gamma, x, beta). Masks of two linears, two steps or two row
// offsets agree only by chance (in a fraction ~ (1-p)^2 + p^2 of elements, within the same bound).
static void test_lora_dropout(float p) {
    const int64_t N = 1024;
    const int in = 1024;
    int64_t n = N * in;
    float *x = (float*)xmalloc(4 * n), *xa = (float*)xmalloc(4 * n), *dx = (float*)xmalloc(4 * n), *t = (float*)xmalloc(4 * n);
    for (int64_t i = 0; i < n; i++) { x[i] = 1.0f; t[i] = 1.0f; dx[i] = 0.0f; }
    LoraDropout d;
    lora_dropout_init(&d, p, 1337, NULL);
    d.step = 5;
    d.row0 = 3 * N;
    d.active = 1;
    Linear L;
    memset(&L, 0, sizeof(L));
    L.in = in;
    lora_dropout_bind(&L, &d, 9);
    lora_dropout_input(xa, x, &L, N);
    double kept = 0, sum = 0;
    for (int64_t i = 0; i < n; i++) { kept += xa[i] != 0.0f; sum += xa[i]; }
    double q = 1.0 - p, sd = sqrt((double)n * p * q);
    char name[96];
    snprintf(name, sizeof(name), "lora dropout p=%g: kept fraction within 6 sd of 1-p", p);
    check(fabs(kept - n * q) <= 6 * sd, name, fabs(kept / n - q));
    snprintf(name, sizeof(name), "lora dropout p=%g: E[output] = input within 6 sd", p);
    check(fabs(sum / n - 1.0) <= 6 * d.scale * sqrt(p * q / n), name, fabs(sum / n - 1.0));
    lora_dropout_input_backward(dx, t, &L, N);
    int same = memcmp(dx, xa, 4 * n) == 0;
    snprintf(name, sizeof(name), "lora dropout p=%g: backward regenerates the forward's mask", p);
    check(same, name, 0);
    // another linear, step or row offset: another mask
    const char* what[3] = {"linear", "step", "row0"};
    for (int k = 0; k < 3; k++) {
        LoraDropout d2 = d;
        Linear L2 = L;
        if (k == 0) L2.drop_id = 10;
        if (k == 1) d2.step = 6;
        if (k == 2) d2.row0 = 4 * N;
        L2.drop = &d2;
        lora_dropout_input(dx, x, &L2, N);
        double agree = 0;
        for (int64_t i = 0; i < n; i++) agree += (dx[i] != 0.0f) == (xa[i] != 0.0f);
        double pa = q * q + (double)p * p, sda = sqrt(n * pa * (1 - pa));
        snprintf(name, sizeof(name), "lora dropout p=%g: another %s, an independent mask", p, what[k]);
        check(fabs(agree - n * pa) <= 6 * sda, name, fabs(agree / n - pa));
    }
    // behind a norm: fmaf(gamma, x, beta) * scale where kept, gamma * scale * t in the backward
    float *g = (float*)xmalloc(4 * in), *b = (float*)xmalloc(4 * in);
    for (int j = 0; j < in; j++) { g[j] = 0.5f + j / 1024.0f; b[j] = 0.25f - j / 4096.0f; }
    L.norm_gamma = g;
    L.norm_beta = b;
    lora_dropout_input(dx, x, &L, N);
    int ok = 1;
    for (int64_t i = 0; i < n && ok; i++) {
        int j = (int)(i % in);
        ok = dx[i] == (xa[i] != 0.0f ? fmaf(g[j], 1.0f, b[j]) * d.scale : 0.0f);
    }
    for (int64_t i = 0; i < n; i++) dx[i] = 0.0f;
    lora_dropout_input_backward(dx, t, &L, N);
    for (int64_t i = 0; i < n && ok; i++) ok = dx[i] == (xa[i] != 0.0f ? fmaf(d.scale, g[i % in], 0.0f) : 0.0f);
    snprintf(name, sizeof(name), "lora dropout p=%g: behind a norm, the same mask on gamma*x+beta", p);
    check(ok, name, 0);
    free(x); free(xa); free(dx); free(t); free(g); free(b);
}

int main(void) {
    test_pack_roundtrip();
    test_resilu2_backward();
    test_regelu2_backward();
    test_norm_backward(0);
    test_norm_backward(1);
    test_norm_huge_rows(0);
    test_norm_huge_rows(1);
    test_matmul();
    test_matmul_shapes();
    test_attention_blocks();
    test_vec_exp();
    test_vec_erf();
    test_vec_gelu();
    test_attention(1);
    test_attention(0);
    test_attention(2);
    test_attention(3);
    test_rope();
    test_chunked_loss();
    test_safetensors_roundtrip();
    test_crc32();
    test_json();
    test_grad_buckets();
    test_plan_alignment();
    test_lora_dropout(0.1f);
    test_lora_dropout(0.5f);
    printf("%d passed, %d failed\n", g_pass, g_fail);
    return g_fail ? 1 : 0;
}
