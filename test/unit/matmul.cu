// test/unit/matmul.cu: the CPU GEMMs against double-precision loops, at the shapes their tiling
// has to get right, within the fp32 dot-product bound, the same bits on any thread count.
#include "unit.h"
#include "../../llmc/cpu/matmul.h"

// ---- matmul --------------------------------------------------------------------------------

void test_matmul(void) {
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
void test_matmul_shapes(void) {
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
