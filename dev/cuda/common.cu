// dev/cuda/common.cu: checks the reduction helpers of llmc/cuda/common.cuh that every row kernel
// is built on (warp sum/max, group sums, block sums in fp32 and double, block argmax with
// first-index ties) against plain host loops, at block sizes 32..1024.
#include "check.h"

__global__ void test_warp_kernel(float* sums, float* maxes, float* group8, const float* x) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    float s = warp_reduce_sum(v), m = warp_reduce_max(v), g = group_reduce_sum(v, 8);
    if ((threadIdx.x & 31) == 0) { sums[i / 32] = s; maxes[i / 32] = m; }
    if ((threadIdx.x & 7) == 0) group8[i / 8] = g;
}

// Two back-to-back block sums on the same scratch (x, then x^2), a double sum, and the argmax.
__global__ void test_block_kernel(float* sums, float* sums2, double* dsums, float* maxv, int64_t* maxi,
                                  const float* x) {
    int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    float v = x[i];
    float s = block_reduce_sum(v);
    float s2 = block_reduce_sum(v * v);
    double ds = block_reduce_sum_double((double)v);
    MaxLoc m = block_reduce_maxloc(MaxLoc{v, (int64_t)threadIdx.x});
    if (threadIdx.x == 0) {
        sums[blockIdx.x] = s;
        sums2[blockIdx.x] = s2;
        dsums[blockIdx.x] = ds;
        maxv[blockIdx.x] = m.v;
        maxi[blockIdx.x] = m.i;
    }
}

static void test_warp(Rng* rng) {
    const int blocks = 3, threads = 128, n = blocks * threads;
    float* hx = host_randn(n, rng, 1.0f, 0);
    float* dx = (float*)upload(hx, sizeof(float) * n);
    float *ds = (float*)dev_alloc(4 * n / 32), *dm = (float*)dev_alloc(4 * n / 32), *dg = (float*)dev_alloc(4 * n / 8);
    dev_poison(ds, 4 * n / 32);
    dev_poison(dm, 4 * n / 32);
    dev_poison(dg, 4 * n / 8);
    launch_kernel(blocks, threads, 0, g_stream, test_warp_kernel, ds, dm, dg, dx);
    float *gs = download_f32(ds, n / 32), *gm = download_f32(dm, n / 32), *gg = download_f32(dg, n / 8);
    float ws[n / 32], wm[n / 32], wg[n / 8];
    for (int w = 0; w < n / 32; w++) {
        double s = 0;
        float m = -INFINITY;
        for (int l = 0; l < 32; l++) { s += hx[w * 32 + l]; m = fmaxf(m, hx[w * 32 + l]); }
        ws[w] = (float)s;
        wm[w] = m;
    }
    for (int g = 0; g < n / 8; g++) {
        double s = 0;
        for (int l = 0; l < 8; l++) s += hx[g * 8 + l];
        wg[g] = (float)s;
    }
    check_close("warp_reduce_sum", gs, ws, n / 32, 1e-6);
    check_equal_f32("warp_reduce_max", gm, wm, n / 32);
    check_close("group_reduce_sum (width 8)", gg, wg, n / 8, 1e-6);
    CUDA_CHECK(cudaFree(dx));
    CUDA_CHECK(cudaFree(ds));
    CUDA_CHECK(cudaFree(dm));
    CUDA_CHECK(cudaFree(dg));
    free(hx); free(gs); free(gm); free(gg);
}

static void test_block(Rng* rng, int threads) {
    const int blocks = 3;
    int n = blocks * threads;
    float* hx = host_randn(n, rng, 1.0f, 1);
    // plant ties for the argmax: the max value at two places in block 1 (first must win)
    hx[threads + threads / 3] = 7.0f;
    hx[threads + threads - 1] = 7.0f;
    float* dx = (float*)upload(hx, sizeof(float) * n);
    float *ds = (float*)dev_alloc(4 * blocks), *ds2 = (float*)dev_alloc(4 * blocks),
          *dmv = (float*)dev_alloc(4 * blocks);
    double* dd = (double*)dev_alloc(8 * blocks);
    int64_t* dmi = (int64_t*)dev_alloc(8 * blocks);
    dev_poison(ds, 4 * blocks); dev_poison(ds2, 4 * blocks); dev_poison(dmv, 4 * blocks);
    dev_poison(dd, 8 * blocks); dev_poison(dmi, 8 * blocks);
    launch_kernel(blocks, threads, 0, g_stream, test_block_kernel, ds, ds2, dd, dmv, dmi, dx);
    float *gs = download_f32(ds, blocks), *gs2 = download_f32(ds2, blocks), *gmv = download_f32(dmv, blocks);
    double gd[3];
    int64_t gmi[3];
    CUDA_CHECK(cudaMemcpy(gd, dd, sizeof(gd), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(gmi, dmi, sizeof(gmi), cudaMemcpyDeviceToHost));
    float ws[3], ws2[3], wmv[3];
    double wd[3], derr = 0;
    int idx_ok = 1;
    for (int b = 0; b < blocks; b++) {
        double s = 0, s2 = 0;
        float m = -INFINITY;
        int64_t mi = 0;
        for (int t = 0; t < threads; t++) {
            float v = hx[b * threads + t];
            s += v; s2 += (double)v * v;
            if (v > m) { m = v; mi = t; }
        }
        ws[b] = (float)s; ws2[b] = (float)s2; wd[b] = s; wmv[b] = m;
        derr = fmax(derr, fabs(gd[b] - wd[b]) / fmax(1.0, fabs(wd[b])));
        idx_ok &= gmi[b] == mi;
    }
    char name[96], detail[96];
    snprintf(name, sizeof(name), "block_reduce_sum, %d threads", threads);
    check_close(name, gs, ws, blocks, 1e-6);
    snprintf(name, sizeof(name), "block_reduce_sum twice on one scratch, %d threads", threads);
    check_close(name, gs2, ws2, blocks, 1e-6);
    snprintf(name, sizeof(name), "block_reduce_sum_double, %d threads", threads);
    snprintf(detail, sizeof(detail), "(max rel error %.2e, tol 1e-12)", derr);
    check_true(name, derr < 1e-12, detail);
    snprintf(name, sizeof(name), "block_reduce_maxloc value, %d threads", threads);
    check_equal_f32(name, gmv, wmv, blocks);
    snprintf(name, sizeof(name), "block_reduce_maxloc first index of ties, %d threads", threads);
    snprintf(detail, sizeof(detail), "(block 1: got %lld, want %d)", (long long)gmi[1], threads / 3);
    check_true(name, idx_ok, detail);
    CUDA_CHECK(cudaFree(dx)); CUDA_CHECK(cudaFree(ds)); CUDA_CHECK(cudaFree(ds2)); CUDA_CHECK(cudaFree(dmv));
    CUDA_CHECK(cudaFree(dd)); CUDA_CHECK(cudaFree(dmi));
    free(hx); free(gs); free(gs2); free(gmv);
}

int main(void) {
    Rng rng = rng_seeded(1234, 0);
    check_begin("dev/cuda/common: reduction helpers");
    test_warp(&rng);
    int sizes[] = {32, 96, 256, 1024};
    for (int i = 0; i < 4; i++) test_block(&rng, sizes[i]);
    return finish();
}
