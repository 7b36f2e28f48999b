// dev/cuda/norms.cu: RMSNorm and LayerNorm of llmc/cuda/norms.cuh (forward standard and MS,
// backward standard and MS, accumulating into dx) against llmc/cpu/norms.h, at odd and model
// sizes; then times each at a LLaMA-7B-like shape (16384 rows x 4096) against HBM bandwidth.
// Every check runs twice: on rows of magnitude ~1, and on finite rows of magnitude ~1e30, whose
// squares fp32 cannot hold (plus, for LayerNorm, a row near FLT_MAX whose centred values overflow
// fp32). Relative errors do not depend on a row's scale (eps aside, which only shrinks), so the
// same tolerances hold for both; the CPU twin is itself checked on such rows against fp64 in
// test/unit/norms.cu.
#include "check.h"
#include "../../llmc/cpu/norms.h"
#include "../../llmc/cuda/norms.cuh"

typedef struct { int64_t N; int d; } NormCase;

#define HUGE_ROWS 1e30f    // the scale of the second run of every check
#define HUGE_GRAD 1e9f     // its gradients: dy * x is then beyond fp32, dy * z is not

// x *= scale, rounded to bf16 again; a LayerNorm row near FLT_MAX last (mean ~ +3e38, one
// element -3e38: its fp32 centred value overflows) when the rows are huge.
static void scale_rows(float* x, NormCase c, float scale, int layer, Rng* rng) {
    if (scale == 1.0f) return;
    for (int64_t i = 0; i < c.N * c.d; i++) x[i] *= scale;
    if (layer && c.d > 1) {
        float* last = x + (c.N - 1) * c.d;
        for (int i = 0; i < c.d; i++) last[i] = 3.0e38f * (1.0f - 0.1f * fabsf(rng_normal(rng)));
        last[0] = -3.0e38f;
    }
    host_round_bf16(x, c.N * c.d);
}

static void test_forward(NormCase c, Rng* rng, int layer, int ms, float scale) {
    int64_t N = c.N, nd = N * c.d;
    float eps = 1e-5f;
    float *x = host_randn(nd, rng, 2.0f, 1), *gamma = host_randn(c.d, rng, 1.0f, 1),
          *beta = host_randn(c.d, rng, 0.5f, 1);
    for (int i = 0; i < c.d; i++) x[i] += 3.0f;  // a row with a large mean: the LayerNorm two-pass variance matters
    host_round_bf16(x, c.d);
    scale_rows(x, c, scale, layer, rng);
    float *y = (float*)xmalloc(4 * nd), *r = (float*)xmalloc(4 * N), *mean = (float*)xmalloc(4 * N);
    bf16 *dx = upload_bf16(x, nd), *dg = upload_bf16(gamma, c.d), *db = upload_bf16(beta, c.d),
         *dy = (bf16*)dev_alloc(2 * nd);
    float *dr = (float*)dev_alloc(4 * N), *dmean = (float*)dev_alloc(4 * N);
    dev_poison(dy, 2 * nd);
    dev_poison(dr, 4 * N);
    dev_poison(dmean, 4 * N);
    if (layer) {
        layernorm_forward(y, r, ms ? NULL : mean, x, ms ? NULL : gamma, ms ? NULL : beta, N, c.d, eps);
        layernorm_forward_cuda(dy, dr, ms ? NULL : dmean, dx, ms ? NULL : dg, ms ? NULL : db, N, c.d, eps, g_stream);
    } else {
        rmsnorm_forward(y, r, x, ms ? NULL : gamma, N, c.d, eps);
        rmsnorm_forward_cuda(dy, dr, dx, ms ? NULL : dg, N, c.d, eps, g_stream);
    }
    float *gy = download_bf16(dy, nd), *gr = download_f32(dr, N);
    char name[128];
    const char* kind =
        layer ? (ms ? "layernorm_forward MS" : "layernorm_forward") : (ms ? "rmsnorm_forward MS" : "rmsnorm_forward");
    snprintf(name, sizeof(name), "%s y, N=%lld d=%d, |x|~%g", kind, (long long)N, c.d, scale);
    check_close(name, gy, y, nd, 1e-2);
    snprintf(name, sizeof(name), "%s r, N=%lld d=%d, |x|~%g", kind, (long long)N, c.d, scale);
    check_close(name, gr, r, N, 1e-5);
    if (layer && !ms) {
        float* gm = download_f32(dmean, N);
        snprintf(name, sizeof(name), "%s mean, N=%lld d=%d, |x|~%g", kind, (long long)N, c.d, scale);
        check_close(name, gm, mean, N, 1e-5);
        free(gm);
    }
    CUDA_CHECK(cudaFree(dx)); CUDA_CHECK(cudaFree(dg)); CUDA_CHECK(cudaFree(db)); CUDA_CHECK(cudaFree(dy));
    CUDA_CHECK(cudaFree(dr)); CUDA_CHECK(cudaFree(dmean));
    free(x); free(gamma); free(beta); free(y); free(r); free(mean); free(gy); free(gr);
}

// The backward gets the forward's own outputs (z, r, mean as the CPU computed them, z rounded to
// bf16 as the CUDA forward would store it) and a dx that already holds a residual gradient, of
// the size of the added part (1/scale: the row's r) so that the check sees that part.
static void test_backward(NormCase c, Rng* rng, int layer, int ms, float scale) {
    int64_t N = c.N, nd = N * c.d;
    float eps = 1e-5f;
    float *x = host_randn(nd, rng, 1.5f, 1), *gamma = host_randn(c.d, rng, 1.0f, 1);
    scale_rows(x, c, scale, 0, rng);
    float *z = (float*)xmalloc(4 * nd), *r = (float*)xmalloc(4 * N), *mean = (float*)xmalloc(4 * N);
    if (layer) layernorm_forward(z, r, mean, x, NULL, NULL, N, c.d, eps);
    else rmsnorm_forward(z, r, x, NULL, N, c.d, eps);
    host_round_bf16(z, nd);
    float *dz = host_randn(nd, rng, 1.0f, 1), *dx0 = host_randn(nd, rng, 1.0f, 1);
    for (int64_t i = 0; i < nd; i++) dx0[i] = bf16_round(dx0[i] / scale);
    float* dx = host_copy(dx0, nd);
    if (layer) {
        if (ms) layernorm_ms_backward(dx, dz, z, r, N, c.d);
        else layernorm_backward(dx, dz, x, mean, r, gamma, N, c.d);
    } else {
        if (ms) rmsnorm_ms_backward(dx, dz, z, r, N, c.d);
        else rmsnorm_backward(dx, dz, x, r, gamma, N, c.d);
    }
    bf16 *d_dx = upload_bf16(dx0, nd), *d_dz = upload_bf16(dz, nd), *d_z = upload_bf16(z, nd),
         *d_x = upload_bf16(x, nd);
    bf16* d_g = upload_bf16(gamma, c.d);
    float *d_r = (float*)upload(r, 4 * N), *d_mean = (float*)upload(mean, 4 * N);
    if (layer) {
        if (ms) layernorm_ms_backward_cuda(d_dx, d_dz, d_z, d_r, N, c.d, g_stream);
        else layernorm_backward_cuda(d_dx, d_dz, d_x, d_mean, d_r, d_g, N, c.d, g_stream);
    } else {
        if (ms) rmsnorm_ms_backward_cuda(d_dx, d_dz, d_z, d_r, N, c.d, g_stream);
        else rmsnorm_backward_cuda(d_dx, d_dz, d_x, d_r, d_g, N, c.d, g_stream);
    }
    float* got = download_bf16(d_dx, nd);
    // compare the added part (dx - dx0): the check must not pass just because dx0 dominates
    for (int64_t i = 0; i < nd; i++) { got[i] -= dx0[i]; dx[i] -= dx0[i]; }
    char name[128];
    snprintf(name, sizeof(name), "%s dx (accumulated), N=%lld d=%d, |x|~%g",
             layer ? (ms ? "layernorm_ms_backward" : "layernorm_backward")
                   : (ms ? "rmsnorm_ms_backward" : "rmsnorm_backward"),
             (long long)N, c.d, scale);
    check_close(name, got, dx, nd, 1e-2);
    CUDA_CHECK(cudaFree(d_dx)); CUDA_CHECK(cudaFree(d_dz)); CUDA_CHECK(cudaFree(d_z)); CUDA_CHECK(cudaFree(d_x));
    CUDA_CHECK(cudaFree(d_g)); CUDA_CHECK(cudaFree(d_r)); CUDA_CHECK(cudaFree(d_mean));
    free(x); free(gamma); free(z); free(r); free(mean); free(dz); free(dx0); free(dx); free(got);
}

// The gradient of a trained RMSNorm gamma (full fine-tuning), accumulated onto random values.
static void test_gamma_grad(NormCase c, Rng* rng, float scale) {
    int64_t nd = c.N * c.d;
    float *dy = host_randn(nd, rng, scale == 1.0f ? 1.0f : HUGE_GRAD, 1), *x = host_randn(nd, rng, 1.0f, 1);
    float* r = host_randn(c.N, rng, 0.5f / scale, 0);
    scale_rows(x, c, scale, 0, rng);
    float *g0 = host_randn(c.d, rng, 1.0f, 0), *want = host_copy(g0, c.d);
    rmsnorm_gamma_grad(want, dy, x, r, c.N, c.d);
    bf16 *d_dy = upload_bf16(dy, nd), *d_x = upload_bf16(x, nd);
    float *d_r = (float*)upload(r, 4 * c.N), *d_g = (float*)upload(g0, 4 * (int64_t)c.d);
    rmsnorm_gamma_grad_cuda(d_g, d_dy, d_x, d_r, c.N, c.d, g_stream);
    float* got = download_f32(d_g, c.d);
    for (int i = 0; i < c.d; i++) { got[i] -= g0[i]; want[i] -= g0[i]; }
    char name[96];
    snprintf(name, sizeof(name), "rmsnorm_gamma_grad (accumulated), N=%lld d=%d, |x|~%g", (long long)c.N, c.d, scale);
    check_close(name, got, want, c.d, 1e-4);
    CUDA_CHECK(cudaFree(d_dy)); CUDA_CHECK(cudaFree(d_x)); CUDA_CHECK(cudaFree(d_r)); CUDA_CHECK(cudaFree(d_g));
    free(dy); free(x); free(r); free(g0); free(want); free(got);
}

// The gradient of a trained LayerNorm gamma and beta (full fine-tuning, standard norm),
// accumulated onto random values, from the forward's own mean and r.
static void test_affine_grad(NormCase c, Rng* rng, float scale) {
    int64_t nd = c.N * c.d;
    float *dy = host_randn(nd, rng, scale == 1.0f ? 1.0f : HUGE_GRAD, 1), *x = host_randn(nd, rng, 1.5f, 1);
    scale_rows(x, c, scale, 0, rng);
    float *z = (float*)xmalloc(4 * nd), *r = (float*)xmalloc(4 * c.N), *mean = (float*)xmalloc(4 * c.N);
    layernorm_forward(z, r, mean, x, NULL, NULL, c.N, c.d, 1e-5f);
    float *g0 = host_randn(c.d, rng, 1.0f, 0), *b0 = host_randn(c.d, rng, 1.0f, 0);
    float *wg = host_copy(g0, c.d), *wb = host_copy(b0, c.d);
    layernorm_affine_grad(wg, wb, dy, x, mean, r, c.N, c.d);
    bf16 *d_dy = upload_bf16(dy, nd), *d_x = upload_bf16(x, nd);
    float *d_r = (float*)upload(r, 4 * c.N), *d_mean = (float*)upload(mean, 4 * c.N);
    float *d_g = (float*)upload(g0, 4 * (int64_t)c.d), *d_b = (float*)upload(b0, 4 * (int64_t)c.d);
    layernorm_affine_grad_cuda(d_g, d_b, d_dy, d_x, d_mean, d_r, c.N, c.d, g_stream);
    float *gg = download_f32(d_g, c.d), *gb = download_f32(d_b, c.d);
    for (int i = 0; i < c.d; i++) { gg[i] -= g0[i]; wg[i] -= g0[i]; gb[i] -= b0[i]; wb[i] -= b0[i]; }
    char name[96];
    snprintf(name, sizeof(name), "layernorm_affine_grad dgamma (accumulated), N=%lld d=%d, |x|~%g", (long long)c.N, c.d,
             scale);
    check_close(name, gg, wg, c.d, 1e-3);
    snprintf(name, sizeof(name), "layernorm_affine_grad dbeta (accumulated), N=%lld d=%d, |x|~%g", (long long)c.N, c.d,
             scale);
    check_close(name, gb, wb, c.d, 1e-3);
    CUDA_CHECK(cudaFree(d_dy)); CUDA_CHECK(cudaFree(d_x)); CUDA_CHECK(cudaFree(d_r)); CUDA_CHECK(cudaFree(d_mean));
    CUDA_CHECK(cudaFree(d_g)); CUDA_CHECK(cudaFree(d_b));
    free(dy); free(x); free(z); free(r); free(mean); free(g0); free(b0); free(wg); free(wb); free(gg); free(gb);
}

static void time_norms(void) {
    int64_t N = 16384;
    int d = 4096;
    int64_t nd = N * d;
    bf16 *x = (bf16*)dev_alloc(2 * nd), *y = (bf16*)dev_alloc(2 * nd), *dz = (bf16*)dev_alloc(2 * nd),
         *dx = (bf16*)dev_alloc(2 * nd);
    bf16* g = (bf16*)dev_alloc(2 * d);
    float *r = (float*)dev_alloc(4 * N), *mean = (float*)dev_alloc(4 * N);
    CUDA_CHECK(cudaMemset(x, 0x3f, 2 * nd));  // bf16 0x3f3f ~ 0.75: finite values
    CUDA_CHECK(cudaMemset(dz, 0x3f, 2 * nd));
    CUDA_CHECK(cudaMemset(dx, 0, 2 * nd));
    CUDA_CHECK(cudaMemset(g, 0x3f, 2 * d));
    double rw = 2.0 * nd * 2 + 4.0 * N;  // read x, write y, write r
    report_bandwidth("rmsnorm_forward 16384x4096",
                     rw, time_kernel([&] { rmsnorm_forward_cuda(y, r, x, g, N, d, 1e-5f, g_stream); }, 20));
    report_bandwidth("layernorm_forward 16384x4096", rw + 4.0 * N,
                     time_kernel([&] { layernorm_forward_cuda(y, r, mean, x, g, g, N, d, 1e-5f, g_stream); }, 20));
    double rb = 2.0 * nd * 4 + 4.0 * N;  // read dz, z, dx; write dx
    report_bandwidth("rmsnorm_ms_backward 16384x4096",
                     rb, time_kernel([&] { rmsnorm_ms_backward_cuda(dx, dz, y, r, N, d, g_stream); }, 20));
    report_bandwidth("rmsnorm_backward 16384x4096",
                     rb, time_kernel([&] { rmsnorm_backward_cuda(dx, dz, x, r, g, N, d, g_stream); }, 20));
    report_bandwidth("layernorm_ms_backward 16384x4096",
                     rb, time_kernel([&] { layernorm_ms_backward_cuda(dx, dz, y, r, N, d, g_stream); }, 20));
    float* hr = download_f32(r, N);
    int finite = 1;
    for (int64_t i = 0; i < N; i++) finite &= isfinite(hr[i]);
    check_true("timed kernels left finite statistics", finite, "");
    free(hr);
    CUDA_CHECK(cudaFree(x)); CUDA_CHECK(cudaFree(y)); CUDA_CHECK(cudaFree(dz)); CUDA_CHECK(cudaFree(dx));
    CUDA_CHECK(cudaFree(g)); CUDA_CHECK(cudaFree(r)); CUDA_CHECK(cudaFree(mean));
}

int main(void) {
    Rng rng = rng_seeded(42, 1);
    check_begin("dev/cuda/norms: RMSNorm / LayerNorm, standard and MS, vs llmc/cpu/norms.h");
    // d = 768 and 1032 (a partial last 256-element stride) take the 16-byte kernels, the others
    // (d % 8 != 0) the scalar ones (llmc/cuda/norms.cuh norm_vec_ok)
    NormCase cases[] = {{37, 67}, {64, 768}, {5, 2050}, {1, 31}, {7, 1032}};
    float scales[] = {1.0f, HUGE_ROWS};
    for (int s = 0; s < 2; s++) {
        for (int i = 0; i < 5; i++)
            for (int layer = 0; layer < 2; layer++)
                for (int ms = 0; ms < 2; ms++) {
                    test_forward(cases[i], &rng, layer, ms, scales[s]);
                    test_backward(cases[i], &rng, layer, ms, scales[s]);
                }
        for (int i = 0; i < 4; i++) test_gamma_grad(cases[i], &rng, scales[s]);
        for (int i = 0; i < 4; i++) test_affine_grad(cases[i], &rng, scales[s]);
    }
    if (g_timing) time_norms();
    return finish();
}
