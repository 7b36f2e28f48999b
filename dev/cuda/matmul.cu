// dev/cuda/matmul.cu: the cuBLASLt products of llmc/cuda/matmul.cuh (forms nt, nn, tn; the three
// precision paths bf16->bf16, bf16->fp32, fp32->fp32; alpha; accumulate; the bias epilogue) and
// the LoRA linear layer of llmc/cuda/linear.cuh (also behind a merged RMSNorm or LayerNorm: the
// adapter sees gamma*x + beta, with its two small kernels checked on their own; and with LoRA
// dropout, whose two mask kernels must equal their CPU twins bit for bit), against
// llmc/cpu/matmul.h and llmc/linear.h, at
// odd shapes (leading dimensions that are not a multiple of 8: cuBLASLt may have no algorithm
// and the cublasGemmEx fallback runs) and aligned ones. Then times the shapes of a LLaMA-7B LoRA
// step against the measured dense bf16 ceiling.
// (On the CPU emulator, matmul.cuh is a plain loop: there this checks the wiring, not cuBLAS.)
#include "check.h"
#include "../../llmc/cpu/matmul.h"
#include "../../llmc/linear.h"
#include "../../llmc/cuda/matmul.cuh"
#include "../../llmc/cuda/linear.cuh"

typedef enum { P_BF16, P_BF16_F32OUT, P_F32 } Path;
static const char* path_name[3] = {"bf16->bf16", "bf16->fp32", "fp32->fp32"};
static const char* form_name[3] = {"nt", "nn", "tn"};

static void cpu_matmul(MatmulForm f, float* C, const float* A, const float* B, int M, int N, int K, float alpha,
                       int acc) {
    if (f == MM_NT) matmul_nt(C, A, B, M, N, K, alpha, acc);
    else if (f == MM_NN) matmul_nn(C, A, B, M, N, K, alpha, acc);
    else matmul_tn(C, A, B, M, N, K, alpha, acc);
}

template <class TC, class TAB>
static void cuda_matmul(MatmulForm f, TC* C, const TAB* A, const TAB* B, int M, int N, int K, float alpha, int acc) {
    if (f == MM_NT) matmul_nt_cuda(C, A, B, M, N, K, alpha, acc, g_stream);
    else if (f == MM_NN) matmul_nn_cuda(C, A, B, M, N, K, alpha, acc, g_stream);
    else matmul_tn_cuda(C, A, B, M, N, K, alpha, acc, g_stream);
}

// bias_mode: 0 none, 1 bias epilogue (nt only).
static void test_matmul(MatmulForm f, Path p, int M, int N, int K, float alpha, int acc, int bias_mode, Rng* rng) {
    int round = p != P_F32;  // bf16 operands: give the CPU the same rounded values
    int64_t na = (int64_t)M * K, nb = (int64_t)N * K, nc = (int64_t)M * N;
    float *A = host_randn(na, rng, 1.0f, round), *B = host_randn(nb, rng, 1.0f, round);
    float *C0 = host_randn(nc, rng, 1.0f, p == P_BF16), *bias = host_randn(N, rng, 1.0f, p == P_BF16);
    float* want = host_copy(C0, nc);
    cpu_matmul(f, want, A, B, M, N, K, alpha, acc);
    if (bias_mode) add_bias_rows(want, bias, M, N);
    float* got = NULL;
    if (p == P_F32) {
        float *dA = (float*)upload(A, 4 * na), *dB = (float*)upload(B, 4 * nb), *dC = (float*)upload(C0, 4 * nc);
        float* dbias = (float*)upload(bias, 4 * N);
        if (!acc) dev_poison(dC, 4 * nc);
        if (bias_mode) matmul_nt_bias_cuda(dC, dA, dB, dbias, M, N, K, alpha, acc, g_stream);
        else cuda_matmul(f, dC, dA, dB, M, N, K, alpha, acc);
        got = download_f32(dC, nc);
        CUDA_CHECK(cudaFree(dA)); CUDA_CHECK(cudaFree(dB)); CUDA_CHECK(cudaFree(dC)); CUDA_CHECK(cudaFree(dbias));
    } else {
        bf16 *dA = upload_bf16(A, na), *dB = upload_bf16(B, nb), *dbias = upload_bf16(bias, N);
        if (p == P_BF16) {
            bf16* dC = upload_bf16(C0, nc);
            if (!acc) dev_poison(dC, 2 * nc);
            if (bias_mode) matmul_nt_bias_cuda(dC, dA, dB, dbias, M, N, K, alpha, acc, g_stream);
            else cuda_matmul(f, dC, dA, dB, M, N, K, alpha, acc);
            got = download_bf16(dC, nc);
            CUDA_CHECK(cudaFree(dC));
        } else {
            float* dC = (float*)upload(C0, 4 * nc);
            if (!acc) dev_poison(dC, 4 * nc);
            cuda_matmul(f, dC, dA, dB, M, N, K, alpha, acc);
            got = download_f32(dC, nc);
            CUDA_CHECK(cudaFree(dC));
        }
        CUDA_CHECK(cudaFree(dA)); CUDA_CHECK(cudaFree(dB)); CUDA_CHECK(cudaFree(dbias));
    }
    char name[160];
    snprintf(name, sizeof(name), "matmul_%s%s %s M=%d N=%d K=%d alpha=%g%s", form_name[f], bias_mode ? "_bias" : "",
             path_name[p], M, N, K, alpha, acc ? " accumulate" : "");
    check_close(name, got, want, nc, p == P_BF16 ? 1e-2 : 1e-5);
    free(A); free(B); free(C0); free(bias); free(want); free(got);
}

// The single-kernel launches of llmc/cuda/linear.cuh, which launches these kernels inline (with
// the same shapes) inside its adapter passes.
static void dev_lora_fold_gamma(bf16* Ag, const float* A, const bf16* gamma, int rank, int in, cudaStream_t stream) {
    launch_kernel(grid_for((int64_t)rank * in, 256), 256, 0, stream, lora_fold_gamma_kernel, Ag, A, gamma, rank, in);
}
static void dev_lora_norm_grad(float* dA, const float* G, const bf16* gamma, const bf16* beta, const float* colsum,
                               int rank, int in, cudaStream_t stream) {
    launch_kernel(grid_for((int64_t)rank * in, 256), 256, 0, stream, lora_norm_grad_kernel, dA, G, gamma, beta, colsum,
                  rank, in);
}
static void dev_lora_dropout_input(bf16* xa, const bf16* x, const Linear* L, int64_t N, cudaStream_t stream) {
    const LoraDropout* d = L->drop;
    int64_t n = N * L->in;
    launch_kernel(grid_for(n, 256), 256, 0, stream, lora_dropout_input_kernel, xa, x, (const bf16*)L->norm_gamma,
                  (const bf16*)L->norm_beta, lora_dropout_origin(L), d->threshold, d->scale, n, L->in);
}
static void dev_lora_dropout_input_backward(bf16* dx, const bf16* t, const Linear* L, int64_t N, cudaStream_t stream) {
    const LoraDropout* d = L->drop;
    int64_t n = N * L->in;
    launch_kernel(grid_for(n, 256), 256, 0, stream, lora_dropout_input_backward_kernel, dx, t,
                  (const bf16*)L->norm_gamma, lora_dropout_origin(L), d->threshold, d->scale, n, L->in);
}

// The CUDA branches of llmc/ops.h's op_linear_forward and op_linear_backward, in their order, with
// the fold given (the ops read it from LLMC_LORA_FUSED): the adapter's part first or after the frozen one.
static void linear_forward_as_op(LoraFold fold, bf16* y, const bf16* x, const Linear* L, bf16* ax, int64_t N, int rank,
                                 float scale, int accumulate) {
    int first = lora_runs_first(L, fold, LINEAR_FORWARD);
    if (first) lora_forward_cuda(y, x, L, ax, N, rank, scale, accumulate, g_stream);
    if (L->nf4) nf4_dequantize_cuda((bf16*)L->dev.W, L->nf4, L->nf4_tables, (int64_t)L->out * L->in, g_stream);
    frozen_forward_cuda(y, x, L, N, first ? 1 : accumulate, g_stream);
    if (L->dev.A && !first) lora_forward_cuda(y, x, L, ax, N, rank, scale, 1, g_stream);
}
static void linear_backward_as_op(LoraFold fold, bf16* dx, const bf16* dy, const bf16* x, const bf16* ax,
                                  const Linear* L, bf16* dax, int64_t N, int rank, float scale, int accumulate) {
    int first = lora_runs_first(L, fold, LINEAR_BACKWARD);
    if (first) lora_backward_cuda(dx, dy, x, ax, L, dax, N, rank, scale, accumulate, g_stream);
    if (dx && L->nf4) nf4_dequantize_cuda((bf16*)L->dev.W, L->nf4, L->nf4_tables, (int64_t)L->out * L->in, g_stream);
    frozen_backward_cuda(dx, dy, x, L, N, first ? 1 : accumulate, g_stream);
    if (L->dev.A && !first) lora_backward_cuda(dx, dy, x, ax, L, dax, N, rank, scale, 1, g_stream);
}

// The adapter behind a merged norm: A diag(gamma) rounded once to bf16 from the fp32 master (bit
// for bit), and dA += G diag(gamma) + colsum beta^T (fp32; the CPU twin's float products, up to a
// fused multiply-add: tolerance 1e-6).
static void test_lora_norm_kernels(int rank, int in, int with_beta, Rng* rng) {
    float *A = host_randn((int64_t)rank * in, rng, 0.1f, 0), *gamma = host_randn(in, rng, 1.0f, 1),
          *beta = host_randn(in, rng, 0.5f, 1);
    float *G = host_randn((int64_t)rank * in, rng, 1.0f, 0), *colsum = host_randn(rank, rng, 1.0f, 0);
    float *dA0 = host_randn((int64_t)rank * in, rng, 0.1f, 0), *dA = host_copy(dA0, (int64_t)rank * in);
    float* Ag = (float*)xmalloc(4 * (int64_t)rank * in);
    lora_fold_gamma(Ag, A, gamma, rank, in);
    host_round_bf16(Ag, (int64_t)rank * in);
    lora_norm_grad(dA, G, gamma, with_beta ? beta : NULL, colsum, rank, in);
    float *d_A = (float*)upload(A, 4 * (int64_t)rank * in), *d_G = (float*)upload(G, 4 * (int64_t)rank * in);
    float *d_colsum = (float*)upload(colsum, 4 * (int64_t)rank), *d_dA = (float*)upload(dA0, 4 * (int64_t)rank * in);
    bf16 *d_gamma = upload_bf16(gamma, in), *d_beta = upload_bf16(beta, in),
         *d_Ag = (bf16*)dev_alloc(2 * (int64_t)rank * in);
    dev_lora_fold_gamma(d_Ag, d_A, d_gamma, rank, in, g_stream);
    dev_lora_norm_grad(d_dA, d_G, d_gamma, with_beta ? d_beta : NULL, d_colsum, rank, in, g_stream);
    float *gAg = download_bf16(d_Ag, (int64_t)rank * in), *gdA = download_f32(d_dA, (int64_t)rank * in);
    char name[128];
    snprintf(name, sizeof(name), "lora_fold_gamma, r=%d in=%d", rank, in);
    check_equal_f32(name, gAg, Ag, (int64_t)rank * in);
    snprintf(name, sizeof(name), "lora_norm_grad (accumulated)%s, r=%d in=%d", with_beta ? " with beta" : "", rank, in);
    check_close(name, gdA, dA, (int64_t)rank * in, 1e-6);
    CUDA_CHECK(cudaFree(d_A)); CUDA_CHECK(cudaFree(d_G)); CUDA_CHECK(cudaFree(d_colsum)); CUDA_CHECK(cudaFree(d_dA));
    CUDA_CHECK(cudaFree(d_gamma)); CUDA_CHECK(cudaFree(d_beta)); CUDA_CHECK(cudaFree(d_Ag));
    free(A); free(gamma); free(beta); free(G); free(colsum); free(dA0); free(dA); free(Ag); free(gAg); free(gdA);
}

// linear_forward / linear_backward with a LoRA adapter (and optionally a bias), GPU vs CPU. The
// CPU gets W and the adapter as the GPU's products see them (bf16-rounded), so what is compared
// is the kernels, not the storage precision. norm: 0 a plain input; 1 behind a merged RMSNorm (the
// adapter sees gamma*x), 2 behind a merged LayerNorm (gamma*x + beta), gamma and beta bf16 as the
// frozen weights are on the GPU.
// The two kernels of LoRA dropout (--lora-dropout) against their twins in llmc/linear.h: the same
// hash decides the same elements and the arithmetic is the same fp32 (fmaf, one multiply), so the
// adapter input and the accumulated dx are equal bit for bit once the CPU's fp32 is rounded to bf16.
// Both forms of the key: as kernel arguments (where no device copy is bound: LoraDropout.at NULL) and
// with the step and first row read from device memory (the trainers' form), the layer at an MLP
// tile's offset.
static void test_lora_dropout_kernels(int64_t N, int in, int norm, float p, Rng* rng) {
    int64_t n = N * in;
    float *x = host_randn(n, rng, 1.0f, 1), *t = host_randn(n, rng, 1.0f, 1), *dx0 = host_randn(n, rng, 1.0f, 1);
    float *gamma = host_randn(in, rng, 1.0f, 1), *beta = host_randn(in, rng, 0.5f, 1);
    LoraDropout d;
    lora_dropout_init(&d, p, 99, NULL);
    d.step = 12;
    d.row0 = 7 * N;
    d.row_off = 3;  // an MLP tile's first row (llmc/models/llama.h's llama_mlp)
    d.active = 1;
    Linear L, G;
    memset(&L, 0, sizeof(L));
    L.in = in;
    lora_dropout_bind(&L, &d, 5);
    G = L;
    bf16 *d_gamma = upload_bf16(gamma, in), *d_beta = upload_bf16(beta, in);
    if (norm) {
        L.norm_gamma = gamma;
        L.norm_beta = norm == 2 ? beta : NULL;
        G.norm_gamma = d_gamma;
        G.norm_beta = norm == 2 ? d_beta : NULL;
    }
    float *xa = (float*)xmalloc(4 * n), *dx = host_copy(dx0, n);
    lora_dropout_input(xa, x, &L, N);
    host_round_bf16(xa, n);
    lora_dropout_input_backward(dx, t, &L, N);
    host_round_bf16(dx, n);
    bf16 *d_x = upload_bf16(x, n), *d_t = upload_bf16(t, n), *d_dx = upload_bf16(dx0, n),
         *d_xa = (bf16*)dev_alloc(2 * n);
    dev_poison(d_xa, 2 * n);
    dev_lora_dropout_input(d_xa, d_x, &G, N, g_stream);
    dev_lora_dropout_input_backward(d_dx, d_t, &G, N, g_stream);
    float *gxa = download_bf16(d_xa, n), *gdx = download_bf16(d_dx, n);
    char tag[96], name[192];
    snprintf(tag, sizeof(tag), "p=%g N=%lld in=%d%s", p, (long long)N, in,
             norm == 1   ? " behind RMSNorm"
             : norm == 2 ? " behind LayerNorm"
                         : "");
    snprintf(name, sizeof(name), "lora_dropout_input, %s", tag);
    check_equal_f32(name, gxa, xa, n);
    snprintf(name, sizeof(name), "lora_dropout_input_backward (accumulated), %s", tag);
    check_equal_f32(name, gdx, dx, n);
    // the step and first row read from device memory; the host's copies set wrong, so that only the
    // memory can give these masks
    LoraDropoutAt at = {d.step, d.row0};
    LoraDropout dm = d;
    dm.at = (const LoraDropoutAt*)upload(&at, sizeof(at));
    dm.step = 0;
    dm.row0 = -1;
    Linear GM = G;
    lora_dropout_bind(&GM, &dm, 5);
    upload_bf16_to(d_dx, dx0, n);
    dev_poison(d_xa, 2 * n);
    dev_lora_dropout_input(d_xa, d_x, &GM, N, g_stream);
    dev_lora_dropout_input_backward(d_dx, d_t, &GM, N, g_stream);
    float *mxa = download_bf16(d_xa, n), *mdx = download_bf16(d_dx, n);
    snprintf(name, sizeof(name), "lora_dropout_input, key from device memory, %s", tag);
    check_equal_f32(name, mxa, xa, n);
    snprintf(name, sizeof(name), "lora_dropout_input_backward (accumulated), key from device memory, %s", tag);
    check_equal_f32(name, mdx, dx, n);
    CUDA_CHECK(cudaFree((void*)dm.at));
    CUDA_CHECK(cudaFree(d_x)); CUDA_CHECK(cudaFree(d_t)); CUDA_CHECK(cudaFree(d_dx)); CUDA_CHECK(cudaFree(d_xa));
    CUDA_CHECK(cudaFree(d_gamma)); CUDA_CHECK(cudaFree(d_beta));
    free(x); free(t); free(dx0); free(gamma); free(beta); free(xa); free(dx);
    free(gxa); free(gdx); free(mxa); free(mdx);
}

// drop_p > 0: training with LoRA dropout (the adapter reads dropout(gamma*x + beta), both sides
// keyed alike). `fold`: where the CUDA layer runs the adapter's output products (LLMC_LORA_FUSED);
// accumulate 0: y and dx are overwritten (their old values must not leak in), else added to.
static void test_linear(int64_t N, int in, int out, int rank, int with_bias, int with_lora, Rng* rng, int norm = 0,
                        float drop_p = 0.0f, LoraFold fold = LORA_IN_FROZEN_EPILOGUE, int accumulate = 1) {
    float scale = 2.0f;
    float *W = host_randn((int64_t)out * in, rng, 0.1f, 1), *bias = host_randn(out, rng, 0.5f, 1);
    float *A = host_randn((int64_t)rank * in, rng, 0.1f, 1), *B = host_randn((int64_t)out * rank, rng, 0.1f, 1);
    float *dA0 = host_randn((int64_t)rank * in, rng, 0.1f, 0), *dB0 = host_randn((int64_t)out * rank, rng, 0.1f, 0);
    float *x = host_randn(N * in, rng, 1.0f, 1), *y0 = host_randn(N * out, rng, 1.0f, 1),
          *dy = host_randn(N * out, rng, 1.0f, 1);
    float *dx0 = host_randn(N * in, rng, 1.0f, 1);
    // CPU
    float *dA = host_copy(dA0, (int64_t)rank * in), *dB = host_copy(dB0, (int64_t)out * rank);
    // without an adapter the layer trains W itself (full fine-tuning): dW accumulates onto random values
    float *dW0 = host_randn((int64_t)out * in, rng, 0.1f, 0), *dW = host_copy(dW0, (int64_t)out * in);
    float *db0 = host_randn(out, rng, 0.1f, 0), *db = host_copy(db0, out);  // and its bias, when it has one
    int train_bias = with_bias && !with_lora;
    Linear L = {in,
                out,
                W,
                with_bias ? bias : NULL,
                with_lora ? A : NULL,
                with_lora ? B : NULL,
                dA,
                dB,
                with_lora ? NULL : dW,
                train_bias ? db : NULL,
                {},
                NULL,
                NULL,
                NULL,
                NULL,
                NULL,
                NULL,
                0,
                "dev"};  // dev: no CUDA copy yet; no norm, NF4 or dropout (bound below)
    float *gamma = host_randn(in, rng, 1.0f, 1), *beta = host_randn(in, rng, 0.5f, 1);
    void* work = xmalloc(lora_norm_work_bytes(rank, in, 4));
    if (norm) lora_norm_bind(&L, gamma, norm == 2 ? beta : NULL, work);
    LoraDropout drop_cpu, drop_gpu;
    lora_dropout_init(&drop_cpu, drop_p, 31, xmalloc(4 * N * in));
    drop_cpu.step = 2;
    drop_cpu.row0 = 3 * N;
    drop_cpu.active = 1;
    drop_gpu = drop_cpu;
    drop_gpu.work = dev_alloc(2 * N * in);
    if (drop_p > 0) lora_dropout_bind(&L, &drop_cpu, 4);
    float *y = host_copy(y0, N * out), *ax = (float*)xmalloc(4 * N * rank), *dax = (float*)xmalloc(4 * N * rank);
    float* dx = host_copy(dx0, N * in);
    linear_forward_frozen(y, x, &L, N, accumulate);
    linear_forward_lora(y, x, &L, ax, N, rank, scale);
    float* ax16 = host_copy(ax, N * rank);
    host_round_bf16(ax16, N * rank);  // the GPU keeps ax in bf16
    linear_backward_frozen(dx, dy, x, &L, N, accumulate);
    linear_backward_lora(dx, dy, x, ax16, &L, dax, N, rank, scale);
    // GPU
    Linear G;  // the CUDA copy lives in G.dev, as the trainers bind it
    memset(&G, 0, sizeof(G));
    G.in = in;
    G.out = out;
    LinearDevice* D = &G.dev;
    D->W = upload_bf16(W, (int64_t)out * in);
    D->bias = with_bias ? upload_bf16(bias, out) : NULL;
    if (with_lora) {  // fp32 masters and their bf16 shadows
        D->A = (float*)upload(A, 4 * (int64_t)rank * in);
        D->B = (float*)upload(B, 4 * (int64_t)out * rank);
        D->A16 = upload_bf16(A, (int64_t)rank * in);
        D->B16 = upload_bf16(B, (int64_t)out * rank);
        D->dA = (float*)upload(dA0, 4 * (int64_t)rank * in);
        D->dB = (float*)upload(dB0, 4 * (int64_t)out * rank);
    } else {
        D->dW = (float*)upload(dW0, 4 * (int64_t)out * in);
        if (train_bias) D->dbias = (float*)upload(db0, 4 * (int64_t)out);
    }
    bf16 *d_gamma = upload_bf16(gamma, in), *d_beta = upload_bf16(beta, in);
    void* d_work = dev_alloc(lora_norm_work_bytes(rank, in, 2));
    if (norm) lora_norm_bind(&G, d_gamma, norm == 2 ? d_beta : NULL, d_work);
    if (drop_p > 0) lora_dropout_bind(&G, &drop_gpu, 4);
    bf16 *d_x = upload_bf16(x, N * in), *d_y = upload_bf16(y0, N * out), *d_dy = upload_bf16(dy, N * out);
    bf16 *d_dx = upload_bf16(dx0, N * in), *d_ax = (bf16*)dev_alloc(2 * N * rank),
         *d_dax = (bf16*)dev_alloc(2 * N * rank);
    dev_poison(d_ax, 2 * N * rank);
    dev_poison(d_dax, 2 * N * rank);
    linear_forward_as_op(fold, d_y, d_x, &G, d_ax, N, rank, scale, accumulate);
    linear_backward_as_op(fold, d_dx, d_dy, d_x, d_ax, &G, d_dax, N, rank, scale, accumulate);
    char tag[160], name[240];
    snprintf(tag, sizeof(tag), "N=%lld in=%d out=%d r=%d%s%s%s%s%s%s", (long long)N, in, out, rank,
             with_bias ? " bias" : "", with_lora ? " lora" : "",
             norm == 1   ? " behind merged RMSNorm"
             : norm == 2 ? " behind merged LayerNorm"
                         : "",
             drop_p > 0 ? " dropout" : "", with_lora && fold == LORA_AFTER_FROZEN ? " adapter after frozen" : "",
             accumulate ? "" : " overwrite");
    float *gy = download_bf16(d_y, N * out), *gdx = download_bf16(d_dx, N * in);
    if (accumulate) {  // compare what was added
        for (int64_t i = 0; i < N * out; i++) { gy[i] -= y0[i]; y[i] -= y0[i]; }
        for (int64_t i = 0; i < N * in; i++) { gdx[i] -= dx0[i]; dx[i] -= dx0[i]; }
    }
    snprintf(name, sizeof(name), "linear_forward y, %s", tag);
    check_close(name, gy, y, N * out, 1e-2);
    snprintf(name, sizeof(name), "linear_backward dx, %s", tag);
    check_close(name, gdx, dx, N * in, 1e-2);
    if (with_lora) {
        float *gax = download_bf16(d_ax, N * rank), *gdA = download_f32(D->dA, (int64_t)rank * in),
              *gdB = download_f32(D->dB, (int64_t)out * rank);
        for (int64_t i = 0; i < (int64_t)rank * in; i++) { gdA[i] -= dA0[i]; dA[i] -= dA0[i]; }
        for (int64_t i = 0; i < (int64_t)out * rank; i++) { gdB[i] -= dB0[i]; dB[i] -= dB0[i]; }
        snprintf(name, sizeof(name), "linear_forward kept ax, %s", tag);
        check_close(name, gax, ax, N * rank, 1e-2);
        snprintf(name, sizeof(name), "linear_backward dA (fp32, accumulated), %s", tag);
        check_close(name, gdA, dA, (int64_t)rank * in, 1e-2);
        snprintf(name, sizeof(name), "linear_backward dB (fp32, accumulated), %s", tag);
        check_close(name, gdB, dB, (int64_t)out * rank, 1e-2);
        free(gax); free(gdA); free(gdB);
        CUDA_CHECK(cudaFree(D->A));
        CUDA_CHECK(cudaFree(D->B));
        CUDA_CHECK(cudaFree(D->A16));
        CUDA_CHECK(cudaFree(D->B16));
        CUDA_CHECK(cudaFree(D->dA)); CUDA_CHECK(cudaFree(D->dB));
    } else {
        float* gdW = download_f32(D->dW, (int64_t)out * in);
        for (int64_t i = 0; i < (int64_t)out * in; i++) { gdW[i] -= dW0[i]; dW[i] -= dW0[i]; }
        snprintf(name, sizeof(name), "linear_backward dW (full fine-tuning, fp32, accumulated), %s", tag);
        check_close(name, gdW, dW, (int64_t)out * in, 1e-2);
        free(gdW);
        CUDA_CHECK(cudaFree(D->dW));
        if (train_bias) {
            float* gdb = download_f32(D->dbias, out);
            for (int j = 0; j < out; j++) { gdb[j] -= db0[j]; db[j] -= db0[j]; }
            snprintf(name, sizeof(name), "linear_backward dbias (full fine-tuning, fp32, accumulated), %s", tag);
            check_close(name, gdb, db, out, 1e-2);
            free(gdb);
            CUDA_CHECK(cudaFree(D->dbias));
        }
    }
    free(dW0); free(dW); free(db0); free(db);
    CUDA_CHECK(cudaFree(D->W));
    if (D->bias) CUDA_CHECK(cudaFree(D->bias));
    CUDA_CHECK(cudaFree(d_x)); CUDA_CHECK(cudaFree(d_y)); CUDA_CHECK(cudaFree(d_dy)); CUDA_CHECK(cudaFree(d_dx));
    CUDA_CHECK(cudaFree(d_ax)); CUDA_CHECK(cudaFree(d_dax));
    CUDA_CHECK(cudaFree(d_gamma)); CUDA_CHECK(cudaFree(d_beta)); CUDA_CHECK(cudaFree(d_work));
    CUDA_CHECK(cudaFree(drop_gpu.work));
    free(gamma); free(beta); free(work); free(drop_cpu.work);
    free(W);
    free(bias);
    free(A);
    free(B);
    free(dA0);
    free(dB0);
    free(x);
    free(y0);
    free(dy);
    free(dx0);
    free(dA);
    free(dB);
    free(y); free(ax); free(dax); free(dx); free(ax16); free(gy); free(gdx);
}

static void time_matmul(MatmulForm f, int M, int N, int K, const char* label) {
    bf16 *A = (bf16*)dev_alloc(2 * (int64_t)M * K), *B = (bf16*)dev_alloc(2 * (int64_t)N * K),
         *C = (bf16*)dev_alloc(2 * (int64_t)M * N);
    CUDA_CHECK(cudaMemset(A, 0x3c, 2 * (int64_t)M * K));
    CUDA_CHECK(cudaMemset(B, 0x3c, 2 * (int64_t)N * K));
    char name[128];
    snprintf(name, sizeof(name), "matmul_%s bf16 %dx%dx%d %s", form_name[f], M, N, K, label);
    report_flops(name, 2.0 * M * N * K, time_kernel([&] { cuda_matmul(f, C, A, B, M, N, K, 1.0f, 0); }, 10));
    CUDA_CHECK(cudaFree(A)); CUDA_CHECK(cudaFree(B)); CUDA_CHECK(cudaFree(C));
}

static void time_matmul_f32(int M, int N, int K) {
    float *A = (float*)dev_alloc(4 * (int64_t)M * K), *B = (float*)dev_alloc(4 * (int64_t)N * K),
          *C = (float*)dev_alloc(4 * (int64_t)M * N);
    CUDA_CHECK(cudaMemset(A, 0, 4 * (int64_t)M * K));
    CUDA_CHECK(cudaMemset(B, 0, 4 * (int64_t)N * K));
    char name[128];
    snprintf(name, sizeof(name), "matmul_nt fp32 %dx%dx%d (no tensor cores)", M, N, K);
    report_flops(name, 2.0 * M * N * K, time_kernel([&] { matmul_nt_cuda(C, A, B, M, N, K, 1.0f, 0, g_stream); }, 3));
    CUDA_CHECK(cudaFree(A)); CUDA_CHECK(cudaFree(B)); CUDA_CHECK(cudaFree(C));
}

int main(void) {
    Rng rng = rng_seeded(5, 4);
    check_begin("dev/cuda/matmul: cuBLASLt products and the LoRA linear vs llmc/cpu/matmul.h, llmc/linear.h");
    // every shape runs twice per form and path (new buffers, beta 0 then 1; the bias cases with a
    // new bias): the second call reuses the cuBLASLt plan cached by the first
    int shapes[][3] = {{37, 53, 71}, {128, 256, 192}, {1, 40, 9}, {96, 8, 300}};
    for (int s = 0; s < 4; s++)
        for (int f = 0; f < 3; f++)
            for (int p = 0; p < 3; p++) {
                test_matmul((MatmulForm)f, (Path)p, shapes[s][0], shapes[s][1], shapes[s][2], 1.0f, 0, 0, &rng);
                test_matmul((MatmulForm)f, (Path)p, shapes[s][0], shapes[s][1], shapes[s][2], 0.5f, 1, 0, &rng);
            }
    for (int s = 0; s < 2; s++) {
        test_matmul(MM_NT, P_BF16, shapes[s][0], shapes[s][1], shapes[s][2], 1.0f, 0, 1, &rng);
        test_matmul(MM_NT, P_BF16, shapes[s][0], shapes[s][1], shapes[s][2], 1.0f, 1, 1, &rng);
        test_matmul(MM_NT, P_F32, shapes[s][0], shapes[s][1], shapes[s][2], 0.5f, 1, 1, &rng);
    }
    test_linear(37, 48, 80, 4, 0, 1, &rng);
    test_linear(64, 96, 64, 8, 1, 1, &rng);
    test_linear(33, 40, 24, 4, 1, 0, &rng);
    test_linear(19, 35, 21, 3, 0, 1, &rng);
    test_lora_norm_kernels(4, 48, 0, &rng);
    test_lora_norm_kernels(3, 35, 1, &rng);
    test_linear(37, 48, 80, 4, 0, 1, &rng, 1);
    test_linear(64, 96, 64, 8, 1, 1, &rng, 2);
    test_linear(19, 35, 21, 3, 1, 1, &rng, 2);
    test_lora_dropout_kernels(37, 48, 0, 0.1f, &rng);
    test_lora_dropout_kernels(19, 35, 1, 0.5f, &rng);
    test_lora_dropout_kernels(64, 96, 2, 0.1f, &rng);
    test_linear(37, 48, 80, 4, 0, 1, &rng, 0, 0.1f);
    test_linear(64, 96, 64, 8, 1, 1, &rng, 1, 0.1f);
    test_linear(19, 35, 21, 3, 1, 1, &rng, 2, 0.3f);
    // the adapter's output products after the frozen ones (LLMC_LORA_FUSED=0), and both orders
    // overwriting y and dx (the epilogue order then writes them first with beta 0)
    for (int f = 0; f < 2; f++) {
        LoraFold fold = f ? LORA_IN_FROZEN_EPILOGUE : LORA_AFTER_FROZEN;
        test_linear(37, 48, 80, 4, 0, 1, &rng, 0, 0.0f, fold, f);
        test_linear(64, 96, 64, 8, 1, 1, &rng, 2, 0.0f, fold, 0);
        test_linear(19, 35, 21, 3, 1, 1, &rng, 1, 0.1f, fold, 0);
        test_linear(33, 40, 24, 4, 1, 0, &rng, 0, 0.0f, fold, 0);
    }
    if (g_timing) {
        time_matmul(MM_NT, 8192, 8192, 8192, "(peak shape)");
        time_matmul(MM_NT, 8192, 4096, 4096, "(7B q/k/v/o fwd, 8192 tokens)");
        time_matmul(MM_NT, 8192, 11008, 4096, "(7B gate/up fwd)");
        time_matmul(MM_NN, 8192, 4096, 11008, "(7B down dx)");
        time_matmul(MM_NT, 8192, 16, 4096, "(LoRA r=16 x A^T, skinny)");
        time_matmul(MM_TN, 16, 4096, 8192, "(LoRA dA, skinny)");
        time_matmul_f32(4096, 4096, 4096);
    }
    return finish();
}
