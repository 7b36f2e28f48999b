// cpu/matmul.h: fp32 matrix products of the CPU backend, row-major, OpenMP-parallel.
//   matmul_nt:  C[M,N] (+)= alpha * A[M,K] . B[N,K]^T   (linear forward: x W^T)
//   matmul_nn:  C[M,N] (+)= alpha * A[M,K] . B[K,N]     (input gradients: dy W)
//   matmul_tn:  C[M,N] (+)= alpha * A[K,M]^T . B[K,N]   (weight gradients: dy^T x)
// All three are one packed GEMM: operands are copied into panels (any transposition is just a
// stride) and a 6x16 register-tile micro-kernel runs over them. Threads split the rows of C and
// the k loop runs in a fixed order, so results do not depend on the thread count.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define MM_MR 6     // rows of the register tile
#define MM_NR 16    // columns of the register tile (two 8-wide vectors)
#define MM_KC 256   // k block: a packed B panel of KC x 16 floats stays in L1/L2
#define MM_MC 72    // rows of A packed per thread task (multiple of MR)
#define MM_PARALLEL_FLOPS (1 << 18)  // below this a product runs on one thread: forking costs more

typedef float mm_v8 __attribute__((vector_size(32)));

// B(k, n) = B[k*sbk + n*sbn] for k in [k0, k0+kc), all n, into panels of NR columns
// (zero-padded): Bp[panel][k][0..NR).
static void mm_pack_b(float* Bp, const float* B, int64_t sbk, int64_t sbn, int k0, int kc, int N, int parallel) {
    int panels = (N + MM_NR - 1) / MM_NR;
#pragma omp parallel for schedule(static) if (parallel)
    for (int p = 0; p < panels; p++) {
        float* dst = Bp + (int64_t)p * kc * MM_NR;
        int n0 = p * MM_NR, nn = N - n0 < MM_NR ? N - n0 : MM_NR;
        for (int k = 0; k < kc; k++) {
            const float* src = B + (int64_t)(k0 + k) * sbk + (int64_t)n0 * sbn;
            float* d = dst + (int64_t)k * MM_NR;
            if (sbn == 1) { memcpy(d, src, sizeof(float) * nn); }
            else for (int j = 0; j < nn; j++) d[j] = src[(int64_t)j * sbn];
            for (int j = nn; j < MM_NR; j++) d[j] = 0.0f;
        }
    }
}

// A(m, k) = A[m*sam + k*sak], rows [m0, m0+mc), k in [k0, k0+kc), into MR-row slivers
// (zero-padded): Ap[sliver][k][0..MR).
static void mm_pack_a(float* Ap, const float* A, int64_t sam, int64_t sak, int m0, int mc, int k0, int kc) {
    for (int s = 0; s < (mc + MM_MR - 1) / MM_MR; s++) {
        float* dst = Ap + (int64_t)s * kc * MM_MR;
        for (int i = 0; i < MM_MR; i++) {
            int m = s * MM_MR + i;
            if (m >= mc) { for (int k = 0; k < kc; k++) dst[(int64_t)k * MM_MR + i] = 0.0f; continue; }
            const float* src = A + (int64_t)(m0 + m) * sam + (int64_t)k0 * sak;
            for (int k = 0; k < kc; k++) dst[(int64_t)k * MM_MR + i] = src[(int64_t)k * sak];
        }
    }
}

// acc[6][16] = sum_k a[k][i] * b[k][j]
static inline void mm_kernel_6x16(float acc[MM_MR][MM_NR], const float* a, const float* b, int kc) {
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
    for (int i = 0; i < MM_MR; i++) { memcpy(acc[i], &c[i][0], 32); memcpy(acc[i] + 8, &c[i][1], 32); }
}

static void mm_gemm(float* C, const float* A, int64_t sam, int64_t sak, const float* B, int64_t sbk, int64_t sbn,
                    int M, int N, int K, float alpha, int accumulate) {
    if (M <= 0 || N <= 0) return;
    int parallel = (double)M * N * K > MM_PARALLEL_FLOPS;
    if (!accumulate) {
#pragma omp parallel for schedule(static) if (parallel)
        for (int64_t i = 0; i < (int64_t)M * N; i++) C[i] = 0.0f;
    }
    int panels = (N + MM_NR - 1) / MM_NR, mblocks = (M + MM_MC - 1) / MM_MC;
    int kcmax = K < MM_KC ? K : MM_KC;
    float* Bp = (float*)malloc(sizeof(float) * (size_t)panels * MM_NR * (kcmax ? kcmax : 1));
    for (int k0 = 0; k0 < K; k0 += MM_KC) {
        int kc = K - k0 < MM_KC ? K - k0 : MM_KC;
        mm_pack_b(Bp, B, sbk, sbn, k0, kc, N, parallel);
#pragma omp parallel if (parallel)
        {
            float* Ap = (float*)malloc(sizeof(float) * MM_MC * kc);
            float acc[MM_MR][MM_NR];
#pragma omp for schedule(static)
            for (int mb = 0; mb < mblocks; mb++) {
                int m0 = mb * MM_MC, mc = M - m0 < MM_MC ? M - m0 : MM_MC;
                mm_pack_a(Ap, A, sam, sak, m0, mc, k0, kc);
                for (int p = 0; p < panels; p++) {
                    int n0 = p * MM_NR, nn = N - n0 < MM_NR ? N - n0 : MM_NR;
                    for (int s = 0; s * MM_MR < mc; s++) {
                        mm_kernel_6x16(acc, Ap + (int64_t)s * kc * MM_MR, Bp + (int64_t)p * kc * MM_NR, kc);
                        int mm = mc - s * MM_MR < MM_MR ? mc - s * MM_MR : MM_MR;
                        for (int i = 0; i < mm; i++) {
                            float* c = C + (int64_t)(m0 + s * MM_MR + i) * N + n0;
                            for (int j = 0; j < nn; j++) c[j] += alpha * acc[i][j];
                        }
                    }
                }
            }
            free(Ap);
        }
    }
    free(Bp);
}

static void matmul_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_gemm(C, A, K, 1, B, 1, K, M, N, K, alpha, accumulate);
}

static void matmul_nn(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_gemm(C, A, K, 1, B, N, 1, M, N, K, alpha, accumulate);
}

static void matmul_tn(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_gemm(C, A, 1, M, B, N, 1, M, N, K, alpha, accumulate);
}
