// cpu/matmul.h: fp32 matrix products of the CPU backend, row-major, OpenMP-parallel.
//   matmul_nt:  C[M,N] (+)= alpha * A[M,K] . B[N,K]^T   (dot-product form: linear forward)
//   matmul_nn:  C[M,N] (+)= alpha * A[M,K] . B[K,N]     (axpy form: input gradients)
//   matmul_tn:  C[M,N] (+)= alpha * A[K,M]^T . B[K,N]   (axpy form: weight gradients)
// Each thread owns whole rows of C, so no two threads ever write the same element and the
// result does not depend on the thread count (summation order is fixed per element).
#pragma once
#include <stdint.h>
#include <string.h>

#define MM_NB 256   // columns of C per tile in the axpy kernels (a 4 x 256 fp32 tile stays in L1)

// 4x4 dot-product micro-kernel over k; the simd reductions let the compiler vectorise without
// -ffast-math.
static inline void mm_nt_tile4x4(float* C, int ldc, const float* A, int lda, const float* B, int ldb,
                                 int K, float alpha, int accumulate) {
    const float *a0 = A, *a1 = A + lda, *a2 = A + 2 * (int64_t)lda, *a3 = A + 3 * (int64_t)lda;
    const float *b0 = B, *b1 = B + ldb, *b2 = B + 2 * (int64_t)ldb, *b3 = B + 3 * (int64_t)ldb;
    float c00 = 0, c01 = 0, c02 = 0, c03 = 0, c10 = 0, c11 = 0, c12 = 0, c13 = 0;
    float c20 = 0, c21 = 0, c22 = 0, c23 = 0, c30 = 0, c31 = 0, c32 = 0, c33 = 0;
#pragma omp simd reduction(+ : c00, c01, c02, c03, c10, c11, c12, c13, c20, c21, c22, c23, c30, c31, c32, c33)
    for (int k = 0; k < K; k++) {
        float x0 = a0[k], x1 = a1[k], x2 = a2[k], x3 = a3[k];
        float y0 = b0[k], y1 = b1[k], y2 = b2[k], y3 = b3[k];
        c00 += x0 * y0; c01 += x0 * y1; c02 += x0 * y2; c03 += x0 * y3;
        c10 += x1 * y0; c11 += x1 * y1; c12 += x1 * y2; c13 += x1 * y3;
        c20 += x2 * y0; c21 += x2 * y1; c22 += x2 * y2; c23 += x2 * y3;
        c30 += x3 * y0; c31 += x3 * y1; c32 += x3 * y2; c33 += x3 * y3;
    }
    float r[4][4] = {{c00, c01, c02, c03}, {c10, c11, c12, c13}, {c20, c21, c22, c23}, {c30, c31, c32, c33}};
    for (int i = 0; i < 4; i++)
        for (int j = 0; j < 4; j++) {
            float* c = &C[(int64_t)i * ldc + j];
            *c = (accumulate ? *c : 0.0f) + alpha * r[i][j];
        }
}

static inline float mm_dot(const float* a, const float* b, int K) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int k = 0; k < K; k++) s += a[k] * b[k];
    return s;
}

static void matmul_nt(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    int Mb = (M + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int mb = 0; mb < Mb; mb++) {
        int m0 = mb * 4, mrows = M - m0 < 4 ? M - m0 : 4;
        for (int n0 = 0; n0 < N; n0 += 4) {
            int ncols = N - n0 < 4 ? N - n0 : 4;
            if (mrows == 4 && ncols == 4) {
                mm_nt_tile4x4(C + (int64_t)m0 * N + n0, N, A + (int64_t)m0 * K, K, B + (int64_t)n0 * K, K, K, alpha, accumulate);
                continue;
            }
            for (int i = 0; i < mrows; i++)
                for (int j = 0; j < ncols; j++) {
                    float* c = &C[(int64_t)(m0 + i) * N + n0 + j];
                    float s = mm_dot(A + (int64_t)(m0 + i) * K, B + (int64_t)(n0 + j) * K, K);
                    *c = (accumulate ? *c : 0.0f) + alpha * s;
                }
        }
    }
}

// Shared body of the axpy-form products: a(m,k) = A[m*sam + k*sak], B row-major [K,N].
static void mm_axpy_rows(float* C, const float* A, int64_t sam, int64_t sak, const float* B, int M, int N, int K,
                         float alpha, int accumulate) {
    int Mb = (M + 3) / 4;
#pragma omp parallel for schedule(static)
    for (int mb = 0; mb < Mb; mb++) {
        int m0 = mb * 4, mrows = M - m0 < 4 ? M - m0 : 4;
        float acc[4][MM_NB];
        for (int n0 = 0; n0 < N; n0 += MM_NB) {
            int nc = N - n0 < MM_NB ? N - n0 : MM_NB;
            memset(acc, 0, sizeof(acc));
            for (int k = 0; k < K; k++) {
                const float* b = B + (int64_t)k * N + n0;
                for (int i = 0; i < mrows; i++) {
                    float a = A[(int64_t)(m0 + i) * sam + (int64_t)k * sak];
                    if (a == 0.0f) continue;  // masked rows of dlogits and zero-initialised LoRA B
                    float* ac = acc[i];
#pragma omp simd
                    for (int j = 0; j < nc; j++) ac[j] += a * b[j];
                }
            }
            for (int i = 0; i < mrows; i++) {
                float* c = C + (int64_t)(m0 + i) * N + n0;
                if (accumulate) for (int j = 0; j < nc; j++) c[j] += alpha * acc[i][j];
                else for (int j = 0; j < nc; j++) c[j] = alpha * acc[i][j];
            }
        }
    }
}

static void matmul_nn(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_axpy_rows(C, A, K, 1, B, M, N, K, alpha, accumulate);
}

static void matmul_tn(float* C, const float* A, const float* B, int M, int N, int K, float alpha, int accumulate) {
    mm_axpy_rows(C, A, 1, M, B, M, N, K, alpha, accumulate);
}
