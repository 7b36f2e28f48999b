// cpu/matmul.h: fp32 matrix products of the CPU backend, row-major, OpenMP-parallel.
//   matmul_nt:  C[M,N] (+)= alpha * A[M,K] . B[N,K]^T   (linear forward: x W^T)
//   matmul_nn:  C[M,N] (+)= alpha * A[M,K] . B[K,N]     (input gradients: dy W)
//   matmul_tn:  C[M,N] (+)= alpha * A[K,M]^T . B[K,N]   (weight gradients: dy^T x)
//   mm_gemm:    the general strided form behind all three, also called single-threaded from
//               inside other kernels' parallel loops (attention's blocks)
// All are one packed GEMM: operands are copied into panels (any transposition is just a stride)
// and a 6x16 register-tile micro-kernel runs over them. The work is cut into tiles of C (row
// blocks x column blocks, both ways so that skinny products such as LoRA's r-row dA still use
// every thread), each tile computed by one thread with the k loop in a fixed order and the same
// k blocking, so every element of C gets the same operations in the same order whatever the thread
// count: results do not depend on it.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#ifdef _OPENMP
#include <omp.h>
// Threads a product may use from here: 1 inside another parallel region (attention's blocks).
static inline int mm_threads_available(void) { return omp_in_parallel() ? 1 : omp_get_max_threads(); }
#else
static inline int mm_threads_available(void) { return 1; }  // a build without OpenMP (the emulator's scratch checks)
#endif

#define MM_MR 6     // rows of the register tile
#define MM_NR 16    // columns of the register tile (two 8-wide vectors)
#define MM_KC 256   // k block: a packed B panel of KC x 16 floats stays in L1
#define MM_MC 96    // rows of A packed per tile (multiple of MR): 96 KiB at KC, within L2
#define MM_WHOLE_B (4 << 20)  // floats: B packed whole (all k blocks at once) up to 16 MiB
#define MM_PARALLEL_FLOPS (1 << 18)  // below this a product runs on one thread: forking costs more

typedef float mm_v8 __attribute__((vector_size(32)));

// B(k, n) = B[k*sbk + n*sbn] for k in [k0, k0+kc), n in [n0, n1), into panels of NR columns
// (zero-padded): Bp[panel][k][0..NR), panel counted from n = 0.
static void mm_pack_b(float* Bp, const float* B, int64_t sbk, int64_t sbn, int k0, int kc, int p0, int p1, int N) {
    for (int p = p0; p < p1; p++) {
        float* dst = Bp + (int64_t)p * kc * MM_NR;
        int n0 = p * MM_NR, nn = N - n0 < MM_NR ? N - n0 : MM_NR;
        if (sbn == 1) {
            for (int k = 0; k < kc; k++) {
                const float* src = B + (int64_t)(k0 + k) * sbk + n0;
                float* d = dst + (int64_t)k * MM_NR;
                memcpy(d, src, sizeof(float) * nn);
                for (int j = nn; j < MM_NR; j++) d[j] = 0.0f;
            }
        } else {  // B read along its rows (sbk == 1): one source row per column, k contiguous
            for (int j = 0; j < MM_NR; j++) {
                const float* src = B + (int64_t)(n0 + j) * sbn + (int64_t)k0 * sbk;
                if (j < nn) for (int k = 0; k < kc; k++) dst[(int64_t)k * MM_NR + j] = src[(int64_t)k * sbk];
                else for (int k = 0; k < kc; k++) dst[(int64_t)k * MM_NR + j] = 0.0f;
            }
        }
    }
}

// A(m, k) = A[m*sam + k*sak], rows [m0, m0+mc), k in [k0, k0+kc), into MR-row slivers
// (zero-padded): Ap[sliver][k][0..MR).
static void mm_pack_a(float* Ap, const float* A, int64_t sam, int64_t sak, int m0, int mc, int k0, int kc) {
    for (int s = 0; s < (mc + MM_MR - 1) / MM_MR; s++) {
        float* dst = Ap + (int64_t)s * kc * MM_MR;
        if (sam == 1 && s * MM_MR + MM_MR <= mc) {  // A read down its columns (A^T products): MR rows side by side
            for (int k = 0; k < kc; k++) memcpy(dst + (int64_t)k * MM_MR, A + (int64_t)(k0 + k) * sak + m0 + s * MM_MR, sizeof(float) * MM_MR);
            continue;
        }
        for (int i = 0; i < MM_MR; i++) {
            int m = s * MM_MR + i;
            if (m >= mc) { for (int k = 0; k < kc; k++) dst[(int64_t)k * MM_MR + i] = 0.0f; continue; }
            const float* src = A + (int64_t)(m0 + m) * sam + (int64_t)k0 * sak;
            for (int k = 0; k < kc; k++) dst[(int64_t)k * MM_MR + i] = src[(int64_t)k * sak];
        }
    }
}

// The 6x16 tile: c = sum_k a[k][i] * b[k][j] in k order, then C = alpha * c (store) or
// C += alpha * c. Edge tiles (mm < 6 or nn < 16) go through a local copy.
static inline void mm_kernel_6x16(float* C, int64_t ldc, int mm, int nn, const float* a, const float* b, int kc, float alpha, int store) {
    mm_v8 c[MM_MR][2];
    for (int i = 0; i < MM_MR; i++) c[i][0] = c[i][1] = (mm_v8){0, 0, 0, 0, 0, 0, 0, 0};
    for (int k = 0; k < kc; k++) {
        mm_v8 b0, b1;
        memcpy(&b0, b + (int64_t)k * MM_NR, 32);
        memcpy(&b1, b + (int64_t)k * MM_NR + 8, 32);
        const float* ak = a + (int64_t)k * MM_MR;
        for (int i = 0; i < MM_MR; i++) {
            mm_v8 ai = {ak[i], ak[i], ak[i], ak[i], ak[i], ak[i], ak[i], ak[i]};
            c[i][0] += ai * b0;
            c[i][1] += ai * b1;
        }
    }
    mm_v8 al = {alpha, alpha, alpha, alpha, alpha, alpha, alpha, alpha};
    if (mm == MM_MR && nn == MM_NR) {
        for (int i = 0; i < MM_MR; i++) {
            float* ci = C + (int64_t)i * ldc;
            mm_v8 y0 = al * c[i][0], y1 = al * c[i][1];
            if (!store) {
                mm_v8 x0, x1;
                memcpy(&x0, ci, 32);
                memcpy(&x1, ci + 8, 32);
                y0 = x0 + y0;
                y1 = x1 + y1;
            }
            memcpy(ci, &y0, 32);
            memcpy(ci + 8, &y1, 32);
        }
        return;
    }
    float acc[MM_MR][MM_NR];
    for (int i = 0; i < MM_MR; i++) {
        mm_v8 y0 = al * c[i][0], y1 = al * c[i][1];
        memcpy(acc[i], &y0, 32);
        memcpy(acc[i] + 8, &y1, 32);
    }
    for (int i = 0; i < mm; i++) {
        float* ci = C + (int64_t)i * ldc;
        if (store) for (int j = 0; j < nn; j++) ci[j] = acc[i][j];
        else for (int j = 0; j < nn; j++) ci[j] = ci[j] + acc[i][j];
    }
}

// One tile of C: rows [m0, m0+mc) x panels [p0, p1), k block k0..k0+kc, from the packed B.
static void mm_tile(float* C, int64_t ldc, const float* A, int64_t sam, int64_t sak, const float* Bp, float* Ap, int m0, int mc, int p0,
                    int p1, int N, int k0, int kc, float alpha, int store) {
    mm_pack_a(Ap, A, sam, sak, m0, mc, k0, kc);
    for (int p = p0; p < p1; p++) {
        int n0 = p * MM_NR, nn = N - n0 < MM_NR ? N - n0 : MM_NR;
        for (int s = 0; s * MM_MR < mc; s++) {
            int mm = mc - s * MM_MR < MM_MR ? mc - s * MM_MR : MM_MR;
            mm_kernel_6x16(C + (int64_t)(m0 + s * MM_MR) * ldc + n0, ldc, mm, nn, Ap + (int64_t)s * kc * MM_MR,
                           Bp + (int64_t)p * kc * MM_NR, kc, alpha, store);
        }
    }
}

// C[M,N] (+)= alpha * A(m,k) B(k,n) with A(m,k) = A[m*sam + k*sak], B(k,n) = B[k*sbk + n*sbn], C
// with row stride ldc. parallel = 0 runs on the calling thread (inside another parallel loop).
// K = 0 gives C = 0 (or C unchanged when accumulating).
static void mm_gemm(float* C, int64_t ldc, const float* A, int64_t sam, int64_t sak, const float* B, int64_t sbk, int64_t sbn, int M, int N,
                    int K, float alpha, int accumulate, int parallel) {
    if (M <= 0 || N <= 0) return;
    if (K <= 0) {
        if (!accumulate) for (int i = 0; i < M; i++) memset(C + (int64_t)i * ldc, 0, sizeof(float) * N);
        return;
    }
    int threads = parallel && (double)M * N * K > MM_PARALLEL_FLOPS ? mm_threads_available() : 1;
    parallel = threads > 1;
    int panels = (N + MM_NR - 1) / MM_NR, mblocks = (M + MM_MC - 1) / MM_MC;
    int mcb = ((M + mblocks - 1) / mblocks + MM_MR - 1) / MM_MR * MM_MR;  // rows per block, balanced (<= MC)
    // Column blocks only when the row blocks alone leave threads idle or unbalanced: as few as give
    // each thread about four tiles (every extra column block packs the same A block again).
    int ppb = panels;
    if (mblocks < 4 * threads && threads > 1) {
        int want = (4 * threads + mblocks - 1) / mblocks;
        if (want > panels) want = panels;
        ppb = (panels + want - 1) / want;
    }
    int nblocks = (panels + ppb - 1) / ppb, tiles = mblocks * nblocks;
    // K in equal blocks of at most KC (576 = 3 x 192, not 256 + 256 + 64). When B's packed copy is
    // small enough (every weight of a small model; not the 49k-row LM head), all of it is packed
    // at once, and each tile then runs through every k block with its part of C hot in cache:
    // two synchronisations per product instead of two per k block.
    int kblocks = (K + MM_KC - 1) / MM_KC, kc0 = (K + kblocks - 1) / kblocks;
    int span = (int64_t)panels * MM_NR * K <= MM_WHOLE_B ? kblocks : 1;  // k blocks packed per round
    float* Bp = (float*)malloc(sizeof(float) * (size_t)panels * MM_NR * kc0 * span);
#pragma omp parallel if (parallel)
    {
        float* Ap = (float*)malloc(sizeof(float) * MM_MC * kc0);
        for (int kb0 = 0; kb0 < kblocks; kb0 += span) {
            int kb1 = kb0 + span < kblocks ? kb0 + span : kblocks;
#pragma omp for schedule(static)
            for (int i = 0; i < (kb1 - kb0) * panels; i++) {
                int kb = kb0 + i / panels, p = i % panels, k0 = kb * kc0, kc = K - k0 < kc0 ? K - k0 : kc0;
                mm_pack_b(Bp + (int64_t)panels * MM_NR * (k0 - kb0 * kc0), B, sbk, sbn, k0, kc, p, p + 1, N);
            }
#pragma omp for schedule(dynamic)
            for (int t = 0; t < tiles; t++) {
                int mb = t / nblocks, nb = t % nblocks;
                int m0 = mb * mcb, mc = M - m0 < mcb ? M - m0 : mcb;
                int p0 = nb * ppb, p1 = p0 + ppb < panels ? p0 + ppb : panels;
                for (int kb = kb0; kb < kb1; kb++) {
                    int k0 = kb * kc0, kc = K - k0 < kc0 ? K - k0 : kc0;
                    mm_tile(C, ldc, A, sam, sak, Bp + (int64_t)panels * MM_NR * (k0 - kb0 * kc0), Ap, m0, mc, p0, p1, N, k0, kc, alpha,
                            kb == 0 && !accumulate);
                }
            }
        }
        free(Ap);
    }
    free(Bp);
}

static void matmul_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_gemm(C, N, A, K, 1, B, 1, K, M, N, K, alpha, accumulate, 1);
}

static void matmul_nn(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_gemm(C, N, A, K, 1, B, N, 1, M, N, K, alpha, accumulate, 1);
}

static void matmul_tn(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_gemm(C, N, A, 1, M, B, N, 1, M, N, K, alpha, accumulate, 1);
}
