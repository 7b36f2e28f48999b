// cuda/norms.cuh: RMSNorm and LayerNorm, standard and memory-sharing (MS) variants, the twins of
// llmc/cpu/norms.h. bf16 activations, fp32 statistics: forward writes z (times gamma/beta for the
// standard norm, plain for MS, whose affine lives in the next linears) and r = 1/sqrt(var + eps)
// per row (and the mean, for the standard LayerNorm). Backward:
//   MS-RMSNorm: dx += r * (dz - z * mean(dz*z))                  from z and r only
//   MS-LN:      dx += r * (dz - mean(dz) - z * mean(dz*z))
//   standard:   the same with dz <- dy*gamma and z recomputed from the kept input x.
// Like the CPU twin, every backward ACCUMULATES into dx (it already holds the residual-path
// gradient); dx is bf16, the sum is formed in fp32 and rounded once.
//
// One warp per row, four rows per block: a row is read once per pass with coalesced loads and
// the statistics are warp shuffles, no shared memory or __syncthreads. The second and third
// passes over a row (d <= a few thousand) hit L1/L2, so DRAM traffic is one read of each input
// and one write of each output: the bandwidth figure dev/cuda/norms.cu reports.
//
// Statistics cannot overflow for finite inputs (../norm_math.h): the fp32 sums are kept, and a
// row whose fp32 sum of squares overflowed (|x| above ~1e19) forms its statistics again in fp64,
// a third pass over the row that normal rows never take (warp-uniform branch).
#pragma once
#include "common.cuh"
#include "vec.cuh"
#include "../norm_math.h"

#define NORM_ROWS_PER_BLOCK 4

static __device__ __forceinline__ int64_t norm_row_index(void) {
    return (int64_t)blockIdx.x * NORM_ROWS_PER_BLOCK + (threadIdx.x >> 5);
}
static unsigned norm_grid(int64_t N) { return (unsigned)ceil_div(N, NORM_ROWS_PER_BLOCK); }

// ---- forward ---------------------------------------------------------------------------------

// fp64 sums over a row of sum (x - mean)^2 and of x, for a row whose fp32 statistics
// overflowed; every lane of the warp gets the result.
static __device__ double norm_row_sum_squares_f64(const bf16* xr, int d, float mean, int lane) {
    double ss = 0.0;
    for (int i = lane; i < d; i += 32) { double c = (double)bf2f(xr[i]) - mean; ss += c * c; }
    return warp_reduce_sum_double(ss);
}
static __device__ double norm_row_sum_f64(const bf16* xr, int d, int lane) {
    double s = 0.0;
    for (int i = lane; i < d; i += 32) s += bf2f(xr[i]);
    return warp_reduce_sum_double(s);
}

// y = x * r (* gamma); gamma NULL means the MS (parameter-free) form. Row n of rmsnorm_forward_kernel
// one element per lane at a time (any d, any alignment).
static __device__ __forceinline__ void rmsnorm_forward_row(bf16* __restrict__ y, float* __restrict__ r_out,
                                                           const bf16* __restrict__ x, const bf16* __restrict__ gamma,
                                                           int64_t N, int d, float eps) {
    int64_t n = norm_row_index();
    if (n >= N) return;  // the whole warp leaves together
    int lane = threadIdx.x & 31;
    const bf16* xr = x + n * d;
    bf16* yr = y + n * d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) { float v = bf2f(xr[i]); ss += v * v; }
    ss = warp_reduce_sum(ss);
    float r = 1.0f / sqrtf(ss / d + eps);
    if (isinf(ss)) r = norm_inv_rms(norm_row_sum_squares_f64(xr, d, 0.0f, lane), d, eps);
    if (lane == 0) r_out[n] = r;
    for (int i = lane; i < d; i += 32) yr[i] = f2bf(bf2f(xr[i]) * r * (gamma ? bf2f(gamma[i]) : 1.0f));
}

// LayerNorm: z = (x - mean) * r (* gamma + beta); mean_out written only when non-NULL. Two-pass
// variance (mean first), as the CPU twin. Row n of layernorm_forward_kernel one element per lane at a time.
static __device__ __forceinline__ void layernorm_forward_row(bf16* __restrict__ y, float* __restrict__ r_out,
                                                             float* __restrict__ mean_out, const bf16* __restrict__ x,
                                                             const bf16* __restrict__ gamma,
                                                             const bf16* __restrict__ beta, int64_t N, int d,
                                                             float eps) {
    int64_t n = norm_row_index();
    if (n >= N) return;
    int lane = threadIdx.x & 31;
    const bf16* xr = x + n * d;
    bf16* yr = y + n * d;
    float s = 0.0f;
    for (int i = lane; i < d; i += 32) s += bf2f(xr[i]);
    float mu = warp_reduce_sum(s) / d;
    float ss = 0.0f;
    for (int i = lane; i < d; i += 32) { float c = bf2f(xr[i]) - mu; ss += c * c; }
    ss = warp_reduce_sum(ss);
    float r = 1.0f / sqrtf(ss / d + eps);
    if (!isfinite(ss)) {  // the fp32 sum or a centred value overflowed: again in fp64
        mu = (float)(norm_row_sum_f64(xr, d, lane) / d);
        r = norm_inv_rms(norm_row_sum_squares_f64(xr, d, mu, lane), d, eps);
    }
    if (lane == 0) {
        r_out[n] = r;
        if (mean_out) mean_out[n] = mu;
    }
    for (int i = lane; i < d; i += 32) {
        float z = norm_normalise(bf2f(xr[i]), mu, r);
        yr[i] = f2bf(gamma ? z * bf2f(gamma[i]) + (beta ? bf2f(beta[i]) : 0.0f) : z);
    }
}

// ---- 16-byte vector forms -------------------------------------------------------------------
// The same rows, each lane reading and writing 8 consecutive elements per access (lane l takes
// elements 8l .. 8l+7 of every 256), where d is a multiple of 8 and every row array is 16-byte
// aligned (norm_vec_ok). Each lane's partial sums hold other elements than the one-at-a-time rows',
// so the statistics may differ from those in the last bits (a sum's rounding, not its math); the
// per-element formulas are the same. The fp64 rescue of an overflowed row stays scalar (rare).
static int norm_vec_ok(int d, const void* a, const void* b, const void* c, const void* e) {
    return d % 8 == 0 && aligned16(a) && aligned16(b) && (!c || aligned16(c)) && (!e || aligned16(e));
}

static __device__ __forceinline__ void rmsnorm_forward_row_vec(bf16* __restrict__ y, float* __restrict__ r_out,
                                                               const bf16* __restrict__ x,
                                                               const bf16* __restrict__ gamma, int64_t N, int d,
                                                               float eps) {
    int64_t n = norm_row_index();
    if (n >= N) return;  // the whole warp leaves together
    int lane = threadIdx.x & 31;
    const bf16* xr = x + n * d;
    bf16* yr = y + n * d;
    float ss = 0.0f;
    for (int i = 8 * lane; i < d; i += 256) {
        Vec16<bf16> v = load_vec16(xr + i);
        for (int j = 0; j < 8; j++) { float f = bf2f(v.v[j]); ss += f * f; }
    }
    ss = warp_reduce_sum(ss);
    float r = 1.0f / sqrtf(ss / d + eps);
    if (isinf(ss)) r = norm_inv_rms(norm_row_sum_squares_f64(xr, d, 0.0f, lane), d, eps);
    if (lane == 0) r_out[n] = r;
    for (int i = 8 * lane; i < d; i += 256) {
        Vec16<bf16> v = load_vec16(xr + i), o;
        Vec16<bf16> gv;
        if (gamma) gv = load_vec16(gamma + i);
        for (int j = 0; j < 8; j++) o.v[j] = f2bf(bf2f(v.v[j]) * r * (gamma ? bf2f(gv.v[j]) : 1.0f));
        store_vec16(yr + i, o);
    }
}

// One warp per row: in 16-byte vectors where vec (norm_vec_ok), else one element per lane at a time.
__global__ void rmsnorm_forward_kernel(bf16* __restrict__ y, float* __restrict__ r_out, const bf16* __restrict__ x,
                                       const bf16* __restrict__ gamma, int64_t N, int d, float eps, int vec) {
    if (vec) rmsnorm_forward_row_vec(y, r_out, x, gamma, N, d, eps);
    else rmsnorm_forward_row(y, r_out, x, gamma, N, d, eps);
}
static void rmsnorm_forward_cuda(bf16* y, float* r_out, const bf16* x, const bf16* gamma, int64_t N, int d, float eps,
                                 cudaStream_t stream) {
    if (N == 0) return;
    launch_kernel(norm_grid(N), 32 * NORM_ROWS_PER_BLOCK, 0, stream, rmsnorm_forward_kernel, y, r_out, x, gamma, N, d,
                  eps, norm_vec_ok(d, y, x, gamma, NULL));
}

// LayerNorm's forward in 16-byte vectors: the same three passes (mean, centred squares, output)
// and per-element formulas as layernorm_forward_row, each lane 8 elements at a time.
static __device__ __forceinline__ void layernorm_forward_row_vec(bf16* __restrict__ y, float* __restrict__ r_out,
                                                                 float* __restrict__ mean_out,
                                                                 const bf16* __restrict__ x,
                                                                 const bf16* __restrict__ gamma,
                                                                 const bf16* __restrict__ beta, int64_t N, int d,
                                                                 float eps) {
    int64_t n = norm_row_index();
    if (n >= N) return;
    int lane = threadIdx.x & 31;
    const bf16* xr = x + n * d;
    bf16* yr = y + n * d;
    float s = 0.0f;
    for (int i = 8 * lane; i < d; i += 256) {
        Vec16<bf16> v = load_vec16(xr + i);
        for (int j = 0; j < 8; j++) s += bf2f(v.v[j]);
    }
    float mu = warp_reduce_sum(s) / d;
    float ss = 0.0f;
    for (int i = 8 * lane; i < d; i += 256) {
        Vec16<bf16> v = load_vec16(xr + i);
        for (int j = 0; j < 8; j++) { float c = bf2f(v.v[j]) - mu; ss += c * c; }
    }
    ss = warp_reduce_sum(ss);
    float r = 1.0f / sqrtf(ss / d + eps);
    if (!isfinite(ss)) {  // the fp32 sum or a centred value overflowed: again in fp64 (scalar, rare)
        mu = (float)(norm_row_sum_f64(xr, d, lane) / d);
        r = norm_inv_rms(norm_row_sum_squares_f64(xr, d, mu, lane), d, eps);
    }
    if (lane == 0) {
        r_out[n] = r;
        if (mean_out) mean_out[n] = mu;
    }
    for (int i = 8 * lane; i < d; i += 256) {
        Vec16<bf16> v = load_vec16(xr + i), o, gv, bv;
        if (gamma) gv = load_vec16(gamma + i);
        if (gamma && beta) bv = load_vec16(beta + i);
        for (int j = 0; j < 8; j++) {
            float z = norm_normalise(bf2f(v.v[j]), mu, r);
            o.v[j] = f2bf(gamma ? z * bf2f(gv.v[j]) + (beta ? bf2f(bv.v[j]) : 0.0f) : z);
        }
        store_vec16(yr + i, o);
    }
}

// One warp per row: in 16-byte vectors where vec (norm_vec_ok), else one element per lane at a time.
__global__ void layernorm_forward_kernel(bf16* __restrict__ y, float* __restrict__ r_out, float* __restrict__ mean_out,
                                         const bf16* __restrict__ x, const bf16* __restrict__ gamma,
                                         const bf16* __restrict__ beta, int64_t N, int d, float eps, int vec) {
    if (vec) layernorm_forward_row_vec(y, r_out, mean_out, x, gamma, beta, N, d, eps);
    else layernorm_forward_row(y, r_out, mean_out, x, gamma, beta, N, d, eps);
}
static void layernorm_forward_cuda(bf16* y, float* r_out, float* mean_out, const bf16* x, const bf16* gamma,
                                   const bf16* beta, int64_t N, int d, float eps, cudaStream_t stream) {
    if (N == 0) return;
    launch_kernel(norm_grid(N), 32 * NORM_ROWS_PER_BLOCK, 0, stream, layernorm_forward_kernel, y, r_out, mean_out, x,
                  gamma, beta, N, d, eps, norm_vec_ok(d, y, x, gamma, gamma ? beta : NULL));
}

// ---- backward --------------------------------------------------------------------------------
// One kernel for all four backward forms. The row's z and dz come either straight from the kept
// buffers (MS) or are rebuilt from the kept input (standard): z = (x - mean) * r, dz = dy * gamma.
// center = 1 for LayerNorm (subtract mean(dz)).

typedef struct {
    const bf16* dz;        // MS: dz; standard: dy
    const bf16* z;         // MS: z;  standard: x
    const float* r;        // [N]
    const float* mean;     // standard LayerNorm only, else NULL
    const bf16* gamma;     // standard only, else NULL
    int center;
} NormBackwardArgs;

static __device__ __forceinline__ void norm_bwd_load(const NormBackwardArgs& a, int64_t n, int64_t off, int i, float r,
                                                     float* z, float* dz) {
    float zv = bf2f(a.z[off + i]), dv = bf2f(a.dz[off + i]);
    if (a.gamma) {  // standard form: rebuild z and dz
        zv = norm_normalise(zv, a.mean ? a.mean[n] : 0.0f, r);
        dv *= bf2f(a.gamma[i]);
    }
    *z = zv;
    *dz = dv;
}

// Row n of norm_backward_kernel, one element per lane at a time (any d, any alignment).
static __device__ __forceinline__ void norm_backward_row(bf16* dx, const NormBackwardArgs& a, int64_t N, int d) {
    int64_t n = norm_row_index();
    if (n >= N) return;
    int lane = threadIdx.x & 31;
    int64_t off = n * d;
    float r = a.r[n];
    float sdz = 0.0f, sdzz = 0.0f;
    for (int i = lane; i < d; i += 32) {
        float z, dz;
        norm_bwd_load(a, n, off, i, r, &z, &dz);
        sdz += dz;
        sdzz += dz * z;
    }
    sdz = warp_reduce_sum(sdz);
    sdzz = warp_reduce_sum(sdzz);
    float mdz = a.center ? sdz / d : 0.0f, mdzz = sdzz / d;
    for (int i = lane; i < d; i += 32) {
        float z, dz;
        norm_bwd_load(a, n, off, i, r, &z, &dz);
        dx[off + i] = f2bf(bf2f(dx[off + i]) + r * (dz - mdz - z * mdzz));
    }
}

// Elements i .. i+7 of row n: z and dz as norm_bwd_load forms them, from 16-byte vectors.
static __device__ __forceinline__ void norm_bwd_load8(const NormBackwardArgs& a, int64_t n, int64_t off, int i, float r,
                                                      float* z, float* dz) {
    Vec16<bf16> zv = load_vec16(a.z + off + i), dv = load_vec16(a.dz + off + i), gv;
    if (a.gamma) gv = load_vec16(a.gamma + i);
    float mean = a.mean ? a.mean[n] : 0.0f;
    for (int j = 0; j < 8; j++) {
        float zf = bf2f(zv.v[j]), df = bf2f(dv.v[j]);
        if (a.gamma) {
            zf = norm_normalise(zf, mean, r);
            df *= bf2f(gv.v[j]);
        }
        z[j] = zf;
        dz[j] = df;
    }
}
// The same row in 16-byte vectors (norm_vec_ok).
static __device__ __forceinline__ void norm_backward_row_vec(bf16* dx, const NormBackwardArgs& a, int64_t N, int d) {
    int64_t n = norm_row_index();
    if (n >= N) return;
    int lane = threadIdx.x & 31;
    int64_t off = n * d;
    float r = a.r[n];
    float sdz = 0.0f, sdzz = 0.0f, z[8], dz[8];
    for (int i = 8 * lane; i < d; i += 256) {
        norm_bwd_load8(a, n, off, i, r, z, dz);
        for (int j = 0; j < 8; j++) { sdz += dz[j]; sdzz += dz[j] * z[j]; }
    }
    sdz = warp_reduce_sum(sdz);
    sdzz = warp_reduce_sum(sdzz);
    float mdz = a.center ? sdz / d : 0.0f, mdzz = sdzz / d;
    for (int i = 8 * lane; i < d; i += 256) {
        norm_bwd_load8(a, n, off, i, r, z, dz);
        Vec16<bf16> o = load_vec16(dx + off + i);
        for (int j = 0; j < 8; j++) o.v[j] = f2bf(bf2f(o.v[j]) + r * (dz[j] - mdz - z[j] * mdzz));
        store_vec16(dx + off + i, o);
    }
}

// One warp per row: in 16-byte vectors where vec (norm_vec_ok), else one element per lane at a time.
__global__ void norm_backward_kernel(bf16* dx, NormBackwardArgs a, int64_t N, int d, int vec) {
    if (vec) norm_backward_row_vec(dx, a, N, d);
    else norm_backward_row(dx, a, N, d);
}

static void rmsnorm_ms_backward_cuda(bf16* dx, const bf16* dz, const bf16* z, const float* r, int64_t N, int d,
                                     cudaStream_t stream) {
    NormBackwardArgs a = {dz, z, r, NULL, NULL, 0};
    if (N == 0) return;
    launch_kernel(norm_grid(N), 32 * NORM_ROWS_PER_BLOCK, 0, stream, norm_backward_kernel, dx, a, N, d,
                  norm_vec_ok(d, dx, a.dz, a.z, a.gamma));
}

static void rmsnorm_backward_cuda(bf16* dx, const bf16* dy, const bf16* x, const float* r, const bf16* gamma, int64_t N,
                                  int d, cudaStream_t stream) {
    if (!gamma) fail("rmsnorm_backward_cuda: the standard backward needs gamma (use rmsnorm_ms_backward_cuda)");
    NormBackwardArgs a = {dy, x, r, NULL, gamma, 0};
    if (N == 0) return;
    launch_kernel(norm_grid(N), 32 * NORM_ROWS_PER_BLOCK, 0, stream, norm_backward_kernel, dx, a, N, d,
                  norm_vec_ok(d, dx, a.dz, a.z, a.gamma));
}

// dgamma[i] += sum_n dy[n, i] * (x[n, i] - mean[n]) * r[n], dbeta[i] += sum_n dy[n, i] (a trained
// LayerNorm affine), by column_sums_kernel: deterministic (the twin of layernorm_affine_grad).
struct LnAffineTerm {
    static const int K = 2;
    const bf16 *dy, *x;
    const float *mean, *r;
    int d;
    __device__ void add(int64_t n, int64_t i, float* s) const {
        float g = bf2f(dy[n * d + i]);
        s[0] += g * norm_normalise(bf2f(x[n * d + i]), mean[n], r[n]);  // z first: dy * x could overflow
        s[1] += g;
    }
};
static void layernorm_affine_grad_cuda(float* dgamma, float* dbeta, const bf16* dy, const bf16* x, const float* mean,
                                       const float* r, int64_t N, int d, cudaStream_t stream) {
    if (d == 0) return;
    launch_kernel(column_sums_grid(d), COLUMN_SUMS_BLOCK, 0, stream, column_sums_kernel<LnAffineTerm>, dgamma, dbeta,
                  LnAffineTerm{dy, x, mean, r, d}, N, d);
}

static void layernorm_ms_backward_cuda(bf16* dx, const bf16* dz, const bf16* z, const float* r, int64_t N, int d,
                                       cudaStream_t stream) {
    NormBackwardArgs a = {dz, z, r, NULL, NULL, 1};
    if (N == 0) return;
    launch_kernel(norm_grid(N), 32 * NORM_ROWS_PER_BLOCK, 0, stream, norm_backward_kernel, dx, a, N, d,
                  norm_vec_ok(d, dx, a.dz, a.z, a.gamma));
}

static void layernorm_backward_cuda(bf16* dx, const bf16* dy, const bf16* x, const float* mean, const float* r,
                                    const bf16* gamma, int64_t N, int d, cudaStream_t stream) {
    if (!gamma || !mean) fail("layernorm_backward_cuda: the standard backward needs mean and gamma");
    NormBackwardArgs a = {dy, x, r, mean, gamma, 1};
    if (N == 0) return;
    launch_kernel(norm_grid(N), 32 * NORM_ROWS_PER_BLOCK, 0, stream, norm_backward_kernel, dx, a, N, d,
                  norm_vec_ok(d, dx, a.dz, a.z, a.gamma));
}

// dgamma[i] += sum_n dy[n, i] * x[n, i] * r[n] (a trained RMSNorm gamma, full fine-tuning), by
// column_sums_kernel: rows in a fixed order, deterministic (the twin of rmsnorm_gamma_grad).
struct RmsGammaTerm {
    static const int K = 1;
    const bf16 *dy, *x;
    const float* r;
    int d;
    __device__ void add(int64_t n, int64_t i, float* s) const {
        s[0] += bf2f(dy[n * d + i]) * (bf2f(x[n * d + i]) * r[n]);
    }  // z first
};
static void rmsnorm_gamma_grad_cuda(float* dgamma, const bf16* dy, const bf16* x, const float* r, int64_t N, int d,
                                    cudaStream_t stream) {
    if (d == 0) return;
    launch_kernel(column_sums_grid(d), COLUMN_SUMS_BLOCK, 0, stream, column_sums_kernel<RmsGammaTerm>, dgamma,
                  (float*)NULL, RmsGammaTerm{dy, x, r, d}, N, d);
}

// *count += the rows of r [n] whose statistics left fp32's range (the twin of
// norm_overflowed_rows): one block, a fixed order, so the count is exact and deterministic.
__global__ void norm_overflowed_rows_kernel(double* count, const float* __restrict__ r, int64_t n) {
    double c = 0.0;
    for (int64_t i = threadIdx.x; i < n; i += blockDim.x) c += norm_stats_overflowed(r[i]);
    c = block_reduce_sum_double(c);
    if (threadIdx.x == 0) *count += c;
}
static void norm_overflowed_rows_cuda(double* count, const float* r, int64_t n, cudaStream_t stream) {
    if (n == 0) return;
    launch_kernel(1, 256, 0, stream, norm_overflowed_rows_kernel, count, r, n);
}
