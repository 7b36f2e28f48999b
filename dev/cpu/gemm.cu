// dev/cpu/gemm.cu: times the CPU backend's products (llmc/cpu/matmul.h) at a model's shapes
// against the machine's sgemm (a BLAS loaded with dlopen: OpenBLAS's cblas_sgemm), interleaved in
// one process so that both see the same machine load. Each shape: the best of 2 rounds of R calls
// of each, alternating ours / BLAS by rounds. Prints one line per shape and a summary line with the ceiling
// (the BLAS at 2048^3) that scripts/bench/bench_cpu.sh reads.
// usage: dev/cpu/gemm [--blas PATH/libopenblas.so.0] [--shape d,f,r,T,V] [--reps R]
//        (default shape: SmolLM2-135M, d 576, f 1536, LoRA r 16, 512 tokens, vocab 49152)
#include <dlfcn.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "../../llmc/common.h"
#include "../../llmc/rng.h"
#include "../../llmc/cpu/matmul.h"

typedef void (*SgemmFn)(int order, int ta, int tb, int M, int N, int K, float alpha, const float* A, int lda,
                        const float* B, int ldb, float beta, float* C, int ldc);
enum { ROW_MAJOR = 101, NO_TRANS = 111, TRANS = 112 };

typedef struct {
    const char* what;
    char form;             // 'n': nt (x W^T), 'd': nn (dy W), 't': tn (dy^T x)
    int M, N, K, accumulate;
} Shape;

static double now(void) { return omp_get_wtime(); }

static void run_ours(const Shape* s, float* C, const float* A, const float* B) {
    if (s->form == 'n') matmul_nt(C, A, B, s->M, s->N, s->K, 1.0f, s->accumulate);
    if (s->form == 'd') matmul_nn(C, A, B, s->M, s->N, s->K, 1.0f, s->accumulate);
    if (s->form == 't') matmul_tn(C, A, B, s->M, s->N, s->K, 1.0f, s->accumulate);
}
static void run_blas(SgemmFn f, const Shape* s, float* C, const float* A, const float* B) {
    float beta = s->accumulate ? 1.0f : 0.0f;
    if (s->form == 'n') f(ROW_MAJOR, NO_TRANS, TRANS, s->M, s->N, s->K, 1.0f, A, s->K, B, s->K, beta, C, s->N);
    if (s->form == 'd') f(ROW_MAJOR, NO_TRANS, NO_TRANS, s->M, s->N, s->K, 1.0f, A, s->K, B, s->N, beta, C, s->N);
    if (s->form == 't') f(ROW_MAJOR, TRANS, NO_TRANS, s->M, s->N, s->K, 1.0f, A, s->M, B, s->N, beta, C, s->N);
}

int main(int argc, char** argv) {
    const char* blas = NULL;
    int d = 576, f = 1536, r = 16, T = 512, V = 49152, reps = 3;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "--blas")) blas = argv[i + 1];
        else if (!strcmp(argv[i], "--shape")) {
            if (sscanf(argv[i + 1], "%d,%d,%d,%d,%d", &d, &f, &r, &T, &V) != 5) fail("--shape d,f,r,T,V");
        } else if (!strcmp(argv[i], "--reps"))
            reps = atoi(argv[i + 1]);
        else fail("unknown argument %s", argv[i]);
    }
    SgemmFn sgemm = NULL;
    if (blas) {
        void* h = dlopen(blas, RTLD_NOW | RTLD_LOCAL);
        if (!h) fail("dlopen %s: %s", blas, dlerror());
        sgemm = (SgemmFn)dlsym(h, "cblas_sgemm");
        void (*set_threads)(int) = (void (*)(int))dlsym(h, "openblas_set_num_threads");
        if (set_threads) set_threads(omp_get_max_threads());
        if (!sgemm) fail("%s has no cblas_sgemm", blas);
    }
    int chunk = (int)((64ll << 20) / ((int64_t)V * 4)); if (chunk > T) chunk = T;
    Shape shapes[] = {
        {"q/o fwd  x W^T", 'n', T, d, d, 0},          {"gate/up fwd", 'n', T, f, d, 0},
        {"down fwd", 'n', T, d, f, 1},                {"q/o bwd  dy W", 'd', T, d, d, 0},
        {"gate bwd", 'd', T, d, f, 0},                {"down bwd", 'd', T, f, d, 0},
        {"LoRA ax = x A^T", 'n', T, r, d, 0},        {"LoRA y += ax B^T", 'n', T, f, r, 1},
        {"LoRA dB += dy^T ax", 't', f, r, T, 1},      {"LoRA dA += dax^T x", 't', r, d, T, 1},
        {"LoRA dax = dy B", 'd', T, r, f, 0},         {"LoRA dx += dax A", 'd', T, d, r, 1},
        {"--full dW += dy^T x", 't', f, d, T, 1},     {"head logits (chunk)", 'n', chunk, V, d, 0},
        {"head dz = dl W (chunk)", 'd', chunk, d, V, 0}, {"ceiling 2048^3", 'n', 2048, 2048, 2048, 0},
    };
    int n = sizeof(shapes) / sizeof(shapes[0]);
    printf("gemm: %d threads; ours = llmc/cpu/matmul.h, blas = %s; GFLOP/s, best of %d\n", omp_get_max_threads(),
           blas ? blas : "(none)", reps);
    printf("  %-24s %6s %6s %6s %9s %9s %7s\n", "product", "M", "N", "K", "ours", "blas", "ratio");
    Rng rng = rng_seeded(5, 0);
    double ceiling = 0.0;
    for (int i = 0; i < n; i++) {
        Shape* s = &shapes[i];
        int64_t na = (int64_t)s->M * s->K, nb = (int64_t)s->N * s->K, nc = (int64_t)s->M * s->N;
        float *A = (float*)xmalloc(4 * na), *B = (float*)xmalloc(4 * nb), *C = (float*)xmalloc(4 * nc);
        for (int64_t j = 0; j < na; j++) A[j] = rng_normal(&rng);
        for (int64_t j = 0; j < nb; j++) B[j] = rng_normal(&rng);
        memset(C, 0, 4 * nc);
        double flops = 2.0 * s->M * s->N * s->K, best_o = 1e30, best_b = 1e30;
        int rr = flops > 4e9 ? 2 : flops < 1e8 ? 5 * reps : reps;
        run_ours(s, C, A, B);
        if (sgemm) run_blas(sgemm, s, C, A, B);
        // Rounds of rr calls of each, alternating: after its calls OpenBLAS's worker threads spin
        // for a while, which takes a core from whatever runs next, so calls are not interleaved
        // one by one; the best call of each side counts.
        for (int round = 0; round < 2; round++) {
            for (int k = 0; k < rr; k++) {
                double t0 = now();
                run_ours(s, C, A, B);
                double t = now() - t0;
                if (t < best_o) best_o = t;
            }
            for (int k = 0; sgemm && k < rr; k++) {
                double t0 = now();
                run_blas(sgemm, s, C, A, B);
                double t = now() - t0;
                if (t < best_b) best_b = t;
            }
        }
        double go = flops / best_o * 1e-9, gb = sgemm ? flops / best_b * 1e-9 : NAN;
        if (i == n - 1) ceiling = gb;
        printf("  %-24s %6d %6d %6d %9.1f %9.1f %6.2fx\n", s->what, s->M, s->N, s->K, go, gb, go / gb);
        fflush(stdout);
        free(A); free(B); free(C);
    }
    printf("gemm ceiling: %.1f GFLOP/s (blas sgemm 2048^3, %d threads)\n", ceiling, omp_get_max_threads());
    return 0;
}
