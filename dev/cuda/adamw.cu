// dev/cuda/adamw.cu: AdamW, sum of squares and scaling of llmc/cuda/adamw.cuh against
// llmc/cpu/adamw.h on fp32 arrays of odd length (tight fp32 tolerances: the arithmetic is the
// same, only FMA contraction and summation order differ), over several steps so the moments and
// bias corrections are exercised; the casts that refresh LoRA's bf16 shadows. Then times the
// update against HBM bandwidth.
#include "check.h"
#include "../../llmc/cpu/adamw.h"
#include "../../llmc/cuda/adamw.cuh"
#include "../../llmc/cuda/misc.cuh"

// The argument forms of llmc/cuda/adamw.cuh's launchers, kept here to check them against the CPU
// (the trainers read the values from device memory).

// The step's values as kernel arguments: the kernel's other form, which the trainers no longer use
// (they read the values from device memory, adamw_update_dev_cuda), kept here to check the two agree.
static void adamw_update_cuda(float* p, const float* g, float* m, float* v, int64_t n, float lr, float beta1,
                              float beta2, float eps, float weight_decay, int t, cudaStream_t stream) {
    if (n == 0) return;
    launch_kernel(grid_for(n, 256), 256, 0, stream, adamw_update_kernel, p, g, m, v, n, (const AdamWStep*)NULL,
                  adamw_step_values(lr, beta1, beta2, t), beta1, beta2, eps, weight_decay);
}

// Returns sum g^2 (host value: synchronises the stream). scratch: SUM_SQUARES_SCRATCH doubles.
static double sum_squares_cuda(const float* g, int64_t n, double* scratch, cudaStream_t stream) {
    sum_squares_into_cuda(scratch + SUMSQ_BLOCKS, SUMSQ_SET, g, n, scratch, stream);
    double h = 0.0;
    CUDA_CHECK(cudaMemcpyAsync(&h, scratch + SUMSQ_BLOCKS, sizeof(double), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return h;
}

// x *= s, the factor as a kernel argument (the trainers read it from device memory: scale_inplace_dev_cuda).
static void scale_inplace_cuda(float* x, int64_t n, float s, cudaStream_t stream) {
    if (n == 0) return;
    launch_kernel(grid_for(n, 256), 256, 0, stream, scale_inplace_kernel, x, n, (const float*)NULL, s);
}

static void test_adamw(int64_t n, Rng* rng) {
    float lr = 1e-3f, b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
    float *p = host_randn(n, rng, 0.5f, 0), *m = (float*)xcalloc(n, 4), *v = (float*)xcalloc(n, 4);
    float *d_p = (float*)upload(p, 4 * n), *d_m = (float*)upload(m, 4 * n), *d_v = (float*)upload(v, 4 * n);
    float* d_g = (float*)dev_alloc(4 * n);
    for (int t = 1; t <= 5; t++) {
        float* g = host_randn(n, rng, 0.01f, 0);
        CUDA_CHECK(cudaMemcpy(d_g, g, 4 * n, cudaMemcpyHostToDevice));
        adamw_update(p, g, m, v, n, lr, b1, b2, eps, wd, t);
        adamw_update_cuda(d_p, d_g, d_m, d_v, n, lr, b1, b2, eps, wd, t, g_stream);
        free(g);
    }
    float *gp = download_f32(d_p, n), *gm = download_f32(d_m, n), *gv = download_f32(d_v, n);
    char name[96];
    snprintf(name, sizeof(name), "adamw_update p after 5 steps, n=%lld", (long long)n);
    check_close(name, gp, p, n, 1e-6);
    snprintf(name, sizeof(name), "adamw_update m after 5 steps, n=%lld", (long long)n);
    check_close(name, gm, m, n, 1e-6);
    snprintf(name, sizeof(name), "adamw_update v after 5 steps, n=%lld", (long long)n);
    check_close(name, gv, v, n, 1e-6);
    CUDA_CHECK(cudaFree(d_p)); CUDA_CHECK(cudaFree(d_m)); CUDA_CHECK(cudaFree(d_v)); CUDA_CHECK(cudaFree(d_g));
    free(p); free(m); free(v); free(gp); free(gm); free(gv);
}

// The trainer's form: the step's lr and bias corrections read from device memory (one upload per
// step, lr changing as a schedule does) must give the very bits of the arguments' form.
static void test_adamw_step_in_memory(int64_t n, Rng* rng) {
    float b1 = 0.9f, b2 = 0.999f, eps = 1e-8f, wd = 0.1f;
    float *p = host_randn(n, rng, 0.5f, 0), *zero = (float*)xcalloc(n, 4);
    float *a_p = (float*)upload(p, 4 * n), *a_m = (float*)upload(zero, 4 * n), *a_v = (float*)upload(zero, 4 * n);
    float *b_p = (float*)upload(p, 4 * n), *b_m = (float*)upload(zero, 4 * n), *b_v = (float*)upload(zero, 4 * n);
    float* d_g = (float*)dev_alloc(4 * n);
    AdamWStep* d_step = (AdamWStep*)dev_alloc(sizeof(AdamWStep));
    for (int t = 1; t <= 5; t++) {
        float* g = host_randn(n, rng, 0.01f, 0);
        CUDA_CHECK(cudaMemcpy(d_g, g, 4 * n, cudaMemcpyHostToDevice));
        float lr = 1e-3f / t;
        adamw_update_cuda(a_p, d_g, a_m, a_v, n, lr, b1, b2, eps, wd, t, g_stream);
        AdamWStep h = adamw_step_values(lr, b1, b2, t);
        CUDA_CHECK(cudaMemcpy(d_step, &h, sizeof(h), cudaMemcpyHostToDevice));
        adamw_update_dev_cuda(b_p, d_g, b_m, b_v, n, d_step, b1, b2, eps, wd, g_stream);
        free(g);
    }
    float* bufs[2][3] = {{a_p, a_m, a_v}, {b_p, b_m, b_v}};
    const char* names[3] = {"p", "m", "v"};
    for (int k = 0; k < 3; k++) {
        float *want = download_f32(bufs[0][k], n), *got = download_f32(bufs[1][k], n);
        char name[112];
        snprintf(name, sizeof(name), "adamw_update, step values in device memory: %s after 5 steps, n=%lld", names[k],
                 (long long)n);
        check_equal_f32(name, got, want, n);
        free(want); free(got);
        CUDA_CHECK(cudaFree(bufs[0][k])); CUDA_CHECK(cudaFree(bufs[1][k]));
    }
    CUDA_CHECK(cudaFree(d_g)); CUDA_CHECK(cudaFree(d_step));
    free(p); free(zero);
}

static void test_norm_and_scale(int64_t n, Rng* rng) {
    float* g = host_randn(n, rng, 0.3f, 0);
    float* d_g = (float*)upload(g, 4 * n);
    double* scratch = (double*)dev_alloc(sizeof(double) * SUM_SQUARES_SCRATCH);
    dev_poison(scratch, sizeof(double) * SUM_SQUARES_SCRATCH);
    double want = sum_squares(g, n), got = sum_squares_cuda(d_g, n, scratch, g_stream);
    char name[96], detail[128];
    snprintf(name, sizeof(name), "sum_squares, n=%lld", (long long)n);
    snprintf(detail, sizeof(detail), "(%.12g vs %.12g, tol 1e-10 relative)", got, want);
    check_true(name, isfinite(got) && fabs(got - want) <= 1e-10 * fmax(want, 1e-30), detail);
    scale_inplace(g, n, 0.37f);
    float* d_g2 = (float*)upload(g, 4 * n);  // already scaled: scaled again below through device memory
    scale_inplace_cuda(d_g, n, 0.37f, g_stream);
    float* gg = download_f32(d_g, n);
    snprintf(name, sizeof(name), "scale_inplace, n=%lld", (long long)n);
    check_equal_f32(name, gg, g, n);
    // the factor read from device memory (clipping's, in the trainer): the same bits
    AdamWStep h = adamw_step_values(1e-3f, 0.9f, 0.999f, 1);
    h.clip = 0.37f;
    AdamWStep* d_step = (AdamWStep*)upload(&h, sizeof(h));
    scale_inplace_dev_cuda(d_g2, n, &d_step->clip, g_stream);
    scale_inplace_cuda(d_g, n, 0.37f, g_stream);
    float *g2 = download_f32(d_g2, n), *g1 = download_f32(d_g, n);
    snprintf(name, sizeof(name), "scale_inplace, factor in device memory, n=%lld", (long long)n);
    check_equal_f32(name, g2, g1, n);
    free(g2); free(g1);
    CUDA_CHECK(cudaFree(d_g2)); CUDA_CHECK(cudaFree(d_step));
    CUDA_CHECK(cudaMemcpy(d_g, gg, 4 * n, cudaMemcpyHostToDevice));  // back to the once-scaled values
    // LoRA shadows: fp32 -> bf16 rounds to nearest even exactly as the host conversion
    bf16* d_h = (bf16*)dev_alloc(2 * n);
    dev_poison(d_h, 2 * n);
    cast_f32_to_bf16_cuda(d_h, d_g, n, g_stream);
    float* gh = download_bf16(d_h, n);
    host_round_bf16(g, n);
    snprintf(name, sizeof(name), "cast_f32_to_bf16 (round to nearest even), n=%lld", (long long)n);
    check_equal_f32(name, gh, g, n);
    float* d_back = (float*)dev_alloc(4 * n);
    dev_poison(d_back, 4 * n);
    cast_bf16_to_f32_cuda(d_back, d_h, n, g_stream);
    float* back = download_f32(d_back, n);
    snprintf(name, sizeof(name), "cast_bf16_to_f32, n=%lld", (long long)n);
    check_equal_f32(name, back, g, n);
    CUDA_CHECK(cudaFree(d_g)); CUDA_CHECK(cudaFree(scratch)); CUDA_CHECK(cudaFree(d_h)); CUDA_CHECK(cudaFree(d_back));
    free(g); free(gg); free(gh); free(back);
}

static void time_adamw(void) {
    int64_t n = (int64_t)64 << 20;  // 64M trainable values (a LoRA r=64 on a 13B model is ~250M)
    float *p = (float*)dev_alloc(4 * n), *g = (float*)dev_alloc(4 * n), *m = (float*)dev_alloc(4 * n),
          *v = (float*)dev_alloc(4 * n);
    double* scratch = (double*)dev_alloc(sizeof(double) * SUM_SQUARES_SCRATCH);
    CUDA_CHECK(cudaMemset(p, 0, 4 * n));
    CUDA_CHECK(cudaMemset(g, 0, 4 * n));
    CUDA_CHECK(cudaMemset(m, 0, 4 * n));
    CUDA_CHECK(cudaMemset(v, 0, 4 * n));
    report_bandwidth(
        "adamw_update 64M params", 4.0 * n * 7,
        time_kernel([&] { adamw_update_cuda(p, g, m, v, n, 1e-3f, 0.9f, 0.999f, 1e-8f, 0.1f, 3, g_stream); }, 10));
    report_bandwidth("sum_squares 64M (includes one host sync)",
                     4.0 * n, time_kernel([&] { sum_squares_cuda(g, n, scratch, g_stream); }, 10));
    CUDA_CHECK(cudaFree(p));
    CUDA_CHECK(cudaFree(g));
    CUDA_CHECK(cudaFree(m));
    CUDA_CHECK(cudaFree(v));
    CUDA_CHECK(cudaFree(scratch));
}

int main(void) {
    Rng rng = rng_seeded(3, 6);
    check_begin("dev/cuda/adamw: AdamW, sum of squares, scaling, casts vs llmc/cpu/adamw.h");
    int64_t sizes[] = {1, 1000, 100003};
    for (int i = 0; i < 3; i++) {
        test_adamw(sizes[i], &rng);
        test_adamw_step_in_memory(sizes[i], &rng);
        test_norm_and_scale(sizes[i], &rng);
    }
    if (g_timing) time_adamw();
    return finish();
}
