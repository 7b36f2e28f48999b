// dev/cuda/loss.cu: the chunked LM head + cross-entropy of llmc/cuda/loss.cuh against
// llmc/cpu/loss.h: final RMSNorm (standard), logits, masked loss, count, argmax-correct and the
// gradient into the final norm's input (accumulated), with an odd vocabulary, a ragged last
// chunk and masked tokens; evaluation mode (no gradient); and softmax_ce_rows on its own with fp32
// dlogits (the ViT head). Two rows of every case are finite but huge (|x| ~ 1e30): their norm
// statistics must come out right and be counted as overflowed (LossStats.overflowed) on both
// backends. Then times a LLaMA-7B-sized head.
#include "check.h"
#include "../../llmc/cpu/loss.h"
#include "../../llmc/cuda/loss.cuh"
#include "loss_scalar.cuh"

static LossScratchCuda alloc_loss_scratch(int chunk, int d, int V) {
    LossScratchCuda sc;
    sc.z = (bf16*)dev_alloc(2 * (int64_t)chunk * d);
    sc.r = (float*)dev_alloc(4 * (int64_t)chunk);
    sc.logits = (float*)dev_alloc(4 * (int64_t)chunk * V);
    sc.dlogits = (bf16*)dev_alloc(2 * (int64_t)chunk * V);
    sc.dz = (bf16*)dev_alloc(2 * (int64_t)chunk * d);
    sc.row_stats = (float*)dev_alloc(4 * 3 * (int64_t)chunk);
    sc.stats = (double*)dev_alloc(4 * sizeof(double));
    return sc;
}
static void free_loss_scratch(LossScratchCuda sc) {
    CUDA_CHECK(cudaFree(sc.z));
    CUDA_CHECK(cudaFree(sc.r));
    CUDA_CHECK(cudaFree(sc.logits));
    CUDA_CHECK(cudaFree(sc.dlogits));
    CUDA_CHECK(cudaFree(sc.dz)); CUDA_CHECK(cudaFree(sc.row_stats)); CUDA_CHECK(cudaFree(sc.stats));
}

// softcap > 0: the logits soft-capped (Gemma 2), in the CPU's loop and the CUDA twin's two kernels.
static void test_lm_head(int64_t N, int d, int V, int chunk, int grad, Rng* rng, float softcap = 0.0f) {
    float eps = 1e-5f, grad_scale = 1.0f / 29.0f;
    float *xf = host_randn(N * d, rng, 1.0f, 1), *gamma = host_randn(d, rng, 1.0f, 1),
          *W = host_randn((int64_t)V * d, rng, 0.3f, 1);
    for (int64_t n : {(int64_t)1, N - 2})  // RMS ~1e30, beyond 2^64: two overflowed rows
        for (int i = 0; i < d; i++) xf[n * d + i] = bf16_round(xf[n * d + i] * 1e30f);
    int* targets = (int*)xmalloc(sizeof(int) * N);
    float* mask = (float*)xmalloc(sizeof(float) * N);
    for (int64_t i = 0; i < N; i++) {
        targets[i] = (int)rng_below(rng, V);
        mask[i] = i % 5 == 2 ? 0.0f : 1.0f;  // some tokens are not trained on
    }
    // make a few targets the argmax, so `correct` is not trivially zero
    for (int64_t i = 0; i < N; i += 3) targets[i] = -1;
    float* dx0 = host_randn(N * d, rng, 0.002f, 1);  // small: the check measures what the kernel adds
    // CPU
    LossScratch cs = {(float*)xmalloc(4 * (int64_t)chunk * d), (float*)xmalloc(4 * (int64_t)chunk),
                      (float*)xmalloc(4 * (int64_t)chunk * V), (float*)xmalloc(4 * (int64_t)chunk * d)};
    float* logits = (float*)xmalloc(4 * N * V);
    {  // targets[i] = -1 above means "the argmax of the row": find it from a logits-only pass
        LossStats tmp = {};
        int* t0 = (int*)xcalloc(N, sizeof(int));
        lm_head_loss(xf, gamma, eps, W, V, d, t0, mask, N, chunk, grad_scale, NULL, logits, cs, &tmp, NULL, NULL,
                     softcap);
        for (int64_t i = 0; i < N; i++)
            if (targets[i] < 0) {
                int am = 0;
                for (int v = 1; v < V; v++) if (logits[i * V + v] > logits[i * V + am]) am = v;
                targets[i] = am;
            }
        free(t0);
    }
    float* dx = host_copy(dx0, N * d);
    LossStats st = {};
    // the trained head and final norm (full fine-tuning): dW and dgamma accumulate onto random values
    float *dW0 = host_randn((int64_t)V * d, rng, 0.1f, 0), *dg0 = host_randn(d, rng, 0.1f, 0);
    float *dW = host_copy(dW0, (int64_t)V * d), *dg = host_copy(dg0, d);
    lm_head_loss(xf, gamma, eps, W, V, d, targets, mask, N, chunk, grad_scale, grad ? dx : NULL, logits, cs, &st, dW,
                 dg, softcap);
    // GPU
    LossScratchCuda sc = alloc_loss_scratch(chunk, d, V);
    bf16 *d_xf = upload_bf16(xf, N * d), *d_gamma = upload_bf16(gamma, d), *d_W = upload_bf16(W, (int64_t)V * d);
    bf16* d_dx = upload_bf16(dx0, N * d);
    int* d_t = (int*)upload(targets, sizeof(int) * N);
    float *d_mask = (float*)upload(mask, 4 * N), *d_logits = (float*)dev_alloc(4 * N * V);
    dev_poison(d_logits, 4 * N * V);
    LossStats gst = {};
    float *d_dW = (float*)upload(dW0, 4 * (int64_t)V * d), *d_dg = (float*)upload(dg0, 4 * (int64_t)d);
    lm_head_loss_cuda(d_xf, d_gamma, eps, d_W, V, d, d_t, d_mask, N, chunk, grad_scale, grad ? d_dx : NULL, d_logits,
                      sc, &gst, g_stream, d_dW, d_dg, NULL, softcap);
    char tag[96], name[160], detail[160];
    snprintf(tag, sizeof(tag), "N=%lld d=%d V=%d chunk=%d%s softcap=%g", (long long)N, d, V, chunk, grad ? "" : " eval",
             softcap);
    float* glogits = download_f32(d_logits, N * V);
    snprintf(name, sizeof(name), "lm_head_loss logits, %s", tag);
    check_close(name, glogits, logits, N * V, 1e-2);
    double lerr = fabs(gst.loss_sum - st.loss_sum) / fmax(1e-9, fabs(st.loss_sum));
    snprintf(name, sizeof(name), "lm_head_loss loss sum, %s", tag);
    snprintf(detail, sizeof(detail), "(%.6f vs %.6f, rel %.1e, tol 1e-3)", gst.loss_sum, st.loss_sum, lerr);
    check_true(name, isfinite(gst.loss_sum) && lerr < 1e-3, detail);
    snprintf(name, sizeof(name), "lm_head_loss count, %s", tag);
    snprintf(detail, sizeof(detail), "(%.0f vs %.0f)", gst.count, st.count);
    check_true(name, gst.count == st.count, detail);
    snprintf(name, sizeof(name), "lm_head_loss correct, %s", tag);
    snprintf(detail, sizeof(detail), "(%.0f vs %.0f; near-ties may flip one)", gst.correct, st.correct);
    check_true(name, fabs(gst.correct - st.correct) <= 1 && st.correct > 0, detail);
    snprintf(name, sizeof(name), "lm_head_loss overflowed rows, %s", tag);
    snprintf(detail, sizeof(detail), "(%.0f vs %.0f, expected 2)", gst.overflowed, st.overflowed);
    check_true(name, gst.overflowed == 2 && st.overflowed == 2, detail);
    if (grad) {
        float* gdx = download_bf16(d_dx, N * d);
        for (int64_t i = 0; i < N * d; i++) { gdx[i] -= dx0[i]; dx[i] -= dx0[i]; }
        snprintf(name, sizeof(name), "lm_head_loss dxf (accumulated), %s", tag);
        check_close(name, gdx, dx, N * d, 1e-2);
        float *gdW = download_f32(d_dW, (int64_t)V * d), *gdg = download_f32(d_dg, d);
        for (int64_t i = 0; i < (int64_t)V * d; i++) { gdW[i] -= dW0[i]; dW[i] -= dW0[i]; }
        for (int i = 0; i < d; i++) { gdg[i] -= dg0[i]; dg[i] -= dg0[i]; }
        snprintf(name, sizeof(name), "lm_head_loss head dW (accumulated), %s", tag);
        check_close(name, gdW, dW, (int64_t)V * d, 1e-2);
        snprintf(name, sizeof(name), "lm_head_loss final-norm dgamma (accumulated), %s", tag);
        check_close(name, gdg, dg, d, 1e-2);
        free(gdx); free(gdW); free(gdg);
    } else {
        float* gdx = download_bf16(d_dx, N * d);
        snprintf(name, sizeof(name), "lm_head_loss eval leaves dxf alone, %s", tag);
        check_equal_f32(name, gdx, dx0, N * d);
        free(gdx);
    }
    free_loss_scratch(sc);
    CUDA_CHECK(cudaFree(d_xf)); CUDA_CHECK(cudaFree(d_gamma)); CUDA_CHECK(cudaFree(d_W)); CUDA_CHECK(cudaFree(d_dx));
    CUDA_CHECK(cudaFree(d_t)); CUDA_CHECK(cudaFree(d_mask)); CUDA_CHECK(cudaFree(d_logits)); CUDA_CHECK(cudaFree(d_dW));
    CUDA_CHECK(cudaFree(d_dg));
    free(dW0); free(dg0); free(dW); free(dg);
    free(xf);
    free(gamma);
    free(W);
    free(targets);
    free(mask);
    free(dx0);
    free(cs.z);
    free(cs.r);
    free(cs.logits);
    free(cs.dz);
    free(logits); free(dx); free(glogits);
}

// softmax_ce_rows against ce_row, row by row, for both kernels (KERNELS_VEC: the production two-pass
// 16-byte one; KERNELS_SCALAR: the old single-pass one, dev/cuda/loss_scalar.cuh, also against the
// production kernel's output), with fp32 dlogits (the ViT head: few classes) or bf16 (the LM
// head's), the logits `offset` floats into their allocation (offset 1: no row starts 16-byte aligned
// whatever V, so the vector kernel's head and tail carry the row's ends; a vector access the
// alignment did not allow stops the emulator).
// ce_row over every row of x (in place: x becomes dlogits), summing loss and correct. Not inlined:
// inlined into test_ce_rows, GCC 12 at -O3 warns of vx_max's tail loop running 2^62 times
// (-Waggressive-loop-optimizations), which no V here makes it do.
__attribute__((noinline)) static void ce_rows_reference(float* x, const int* targets, int rows, int V,
                                                        float grad_scale, double* loss, double* correct) {
    for (int i = 0; i < rows; i++) {
        int am;
        *loss += ce_row(x + (int64_t)i * V, V, targets[i], 1.0f, grad_scale, 1, &am);
        *correct += am == targets[i];
    }
}

template <class T>
static void test_ce_rows(KernelChoice impl, int rows, int V, int offset, Rng* rng) {
    float grad_scale = 0.25f;
    int64_t n = (int64_t)rows * V;
    float* logits = host_randn(n, rng, 3.0f, 0);
    int* targets = (int*)xmalloc(sizeof(int) * rows);
    for (int i = 0; i < rows; i++) targets[i] = (int)rng_below(rng, V);
    logits[V / 2] = logits[V - 1] = 40.0f;  // row 0: a tie for the max, the first counts as argmax
    targets[0] = V / 2;
    float* want = host_copy(logits, n);
    double loss = 0, correct = 0;
    ce_rows_reference(want, targets, rows, V, grad_scale, &loss, &correct);
    if (sizeof(T) == 2) host_round_bf16(want, n);  // what a bf16 dlogits can hold
    float* d_alloc = (float*)dev_alloc(4 * (n + offset));
    float* d_logits = d_alloc + offset;
    CUDA_CHECK(cudaMemcpy(d_logits, logits, 4 * n, cudaMemcpyHostToDevice));
    T* d_dl = (T*)dev_alloc(sizeof(T) * n);
    float* d_rows = (float*)dev_alloc(4 * 3 * (int64_t)rows);
    int* d_t = (int*)upload(targets, sizeof(int) * rows);
    double* d_stats = (double*)dev_alloc(3 * sizeof(double));
    dev_poison(d_dl, sizeof(T) * n);
    CUDA_CHECK(cudaMemset(d_stats, 0, 3 * sizeof(double)));
    auto ce = impl == KERNELS_VEC ? softmax_ce_rows_launch<T> : softmax_ce_rows_scalar_launch<T>;
    ce(d_dl, d_rows, d_logits, d_t, NULL, rows, V, grad_scale, NULL, 1, g_stream);
    loss_stats_accumulate_cuda(d_stats, d_rows, rows, g_stream);
    float* got = sizeof(T) == 2 ? download_bf16((const bf16*)d_dl, n) : download_f32((const float*)d_dl, n);
    // the scale read from device memory (a CUDA graph's form; the argument given wrong, so that only
    // the memory can give these bytes): the same dlogits, bit for bit
    float* d_scale = (float*)upload(&grad_scale, sizeof(float));
    T* d_dl_at = (T*)dev_alloc(sizeof(T) * n);
    ce(d_dl_at, d_rows, d_logits, d_t, NULL, rows, V, -1.0f, d_scale, 1, g_stream);
    float* got_at = sizeof(T) == 2 ? download_bf16((const bf16*)d_dl_at, n) : download_f32((const float*)d_dl_at, n);
    char at_name[128];
    snprintf(at_name, sizeof(at_name), "softmax_ce_rows %s, scale from device memory = scale as argument, rows=%d V=%d",
             impl == KERNELS_VEC ? "vec" : "scalar", rows, V);
    check_true(at_name, memcmp(got, got_at, sizeof(float) * n) == 0, "(bit for bit)");
    CUDA_CHECK(cudaFree(d_scale)); CUDA_CHECK(cudaFree(d_dl_at));
    free(got_at);
    double h[3];
    CUDA_CHECK(cudaMemcpy(h, d_stats, sizeof(h), cudaMemcpyDeviceToHost));
    char name[128], detail[160];
    const char* kind = impl == KERNELS_VEC ? "vec" : "scalar";
    snprintf(name, sizeof(name), "softmax_ce_rows %s %s dlogits, rows=%d V=%d +%d", kind,
             sizeof(T) == 2 ? "bf16" : "fp32", rows, V, offset);
    // fp32: the sums differ only in order (1e-5); bf16: one rounding of 2^-9 relative per element
    double tol = sizeof(T) == 2 ? 4e-3 : 1e-5;
    check_close(name, got, want, n, tol);
    if (impl == KERNELS_SCALAR) {  // the reference version against the production kernel: each is within tol
        T* d_prod = (T*)dev_alloc(sizeof(T) * n);  // of the CPU twin, so within 2 tol of each other
        softmax_ce_rows_launch(d_prod, d_rows, d_logits, d_t, NULL, rows, V, grad_scale, NULL, 1, g_stream);
        float* prod = sizeof(T) == 2 ? download_bf16((const bf16*)d_prod, n) : download_f32((const float*)d_prod, n);
        snprintf(name, sizeof(name), "softmax_ce_rows scalar vs production %s dlogits, rows=%d V=%d +%d",
                 sizeof(T) == 2 ? "bf16" : "fp32", rows, V, offset);
        check_close(name, got, prod, n, 2 * tol);
        CUDA_CHECK(cudaFree(d_prod));
        free(prod);
    }
    snprintf(name, sizeof(name), "softmax_ce_rows %s loss/count/correct, rows=%d V=%d +%d", kind, rows, V, offset);
    snprintf(detail, sizeof(detail), "(loss %.6f vs %.6f, count %.0f, correct %.0f vs %.0f)", h[0], loss, h[1], h[2],
             correct);
    check_true(name, fabs(h[0] - loss) < 1e-4 * fmax(1.0, fabs(loss)) && h[1] == rows && h[2] == correct, detail);
    CUDA_CHECK(cudaFree(d_alloc)); CUDA_CHECK(cudaFree(d_dl)); CUDA_CHECK(cudaFree(d_rows)); CUDA_CHECK(cudaFree(d_t));
    CUDA_CHECK(cudaFree(d_stats));
    free(logits); free(targets); free(want); free(got);
}

// The chunk (llmc/memory/loss_buffers.h sizes it from the plan, LLMC_HEAD_CHUNK) against one
// chunk of all N rows, on the same inputs. A product of another row count may sum in another order
// (split-K partial sums, on the emulator as on a GPU) and the trained head's dW adds the chunks'
// products in fp32 one by one: the logits move by about d x 2^-24 relative (d = 64: 4e-6), which
// flips a few bf16 roundings of dlogits and dxf (2^-9 each). Bounds: dxf and dW 1e-3 (relative L2),
// the loss 1e-5; count and correct exactly (no row's argmax is that close at these random logits).
static void test_lm_head_chunks(int64_t N, int d, int V, int chunk, Rng* rng) {
    float *xf = host_randn(N * d, rng, 1.0f, 1), *gamma = host_randn(d, rng, 1.0f, 1),
          *W = host_randn((int64_t)V * d, rng, 0.3f, 1), *dx0 = host_randn(N * d, rng, 0.002f, 1);
    int* targets = (int*)xmalloc(sizeof(int) * N);
    for (int64_t i = 0; i < N; i++) targets[i] = (int)rng_below(rng, V);
    bf16 *d_xf = upload_bf16(xf, N * d), *d_gamma = upload_bf16(gamma, d), *d_W = upload_bf16(W, (int64_t)V * d);
    int* d_t = (int*)upload(targets, sizeof(int) * N);
    float* got[2][2];
    LossStats st[2] = {};
    for (int k = 0; k < 2; k++) {
        int c = k ? (int)N : chunk;
        LossScratchCuda sc = alloc_loss_scratch(c, d, V);
        bf16* d_dx = upload_bf16(dx0, N * d);
        float* d_dW = (float*)dev_alloc(4 * (int64_t)V * d);
        CUDA_CHECK(cudaMemset(d_dW, 0, 4 * (int64_t)V * d));
        lm_head_loss_cuda(d_xf, d_gamma, 1e-5f, d_W, V, d, d_t, NULL, N, c, 1.0f / N, d_dx, NULL, sc, &st[k], g_stream,
                          d_dW, NULL);
        got[k][0] = download_bf16(d_dx, N * d);
        got[k][1] = download_f32(d_dW, (int64_t)V * d);
        free_loss_scratch(sc);
        CUDA_CHECK(cudaFree(d_dx)); CUDA_CHECK(cudaFree(d_dW));
    }
    char name[128], detail[160];
    const char* what[2] = {"dxf", "head dW"};
    int64_t n[2] = {N * d, (int64_t)V * d};
    for (int o = 0; o < 2; o++) {
        snprintf(name, sizeof(name), "lm_head_loss %s: chunks of %d = one chunk, N=%lld V=%d", what[o], chunk,
                 (long long)N, V);
        check_close(name, got[0][o], got[1][o], n[o], 1e-3);
        free(got[0][o]); free(got[1][o]);
    }
    double rel = fabs(st[0].loss_sum - st[1].loss_sum) / fabs(st[1].loss_sum);
    snprintf(name, sizeof(name), "lm_head_loss loss: chunks of %d = one chunk, N=%lld V=%d", chunk, (long long)N, V);
    snprintf(detail, sizeof(detail), "(%.9f vs %.9f, rel %.1e, tol 1e-5; correct %.0f vs %.0f)", st[0].loss_sum,
             st[1].loss_sum, rel, st[0].correct, st[1].correct);
    check_true(name, rel < 1e-5 && st[0].count == st[1].count && st[0].correct == st[1].correct, detail);
    CUDA_CHECK(cudaFree(d_xf)); CUDA_CHECK(cudaFree(d_gamma)); CUDA_CHECK(cudaFree(d_W)); CUDA_CHECK(cudaFree(d_t));
    free(xf); free(gamma); free(W); free(dx0); free(targets);
}

static void time_lm_head(void) {
    int64_t N = 8192;
    int d = 4096, V = 32000, chunk = 2048;
    LossScratchCuda sc = alloc_loss_scratch(chunk, d, V);
    bf16 *xf = (bf16*)dev_alloc(2 * N * d), *gamma = (bf16*)dev_alloc(2 * (int64_t)d),
         *W = (bf16*)dev_alloc(2 * (int64_t)V * d);
    bf16* dx = (bf16*)dev_alloc(2 * N * d);
    int* t = (int*)dev_alloc(sizeof(int) * N);
    CUDA_CHECK(cudaMemset(xf, 0x3c, 2 * N * d));
    CUDA_CHECK(cudaMemset(gamma, 0x3c, 2 * (int64_t)d));
    CUDA_CHECK(cudaMemset(W, 0x3c, 2 * (int64_t)V * d));
    CUDA_CHECK(cudaMemset(dx, 0, 2 * N * d));
    CUDA_CHECK(cudaMemset(t, 0, sizeof(int) * N));
    LossStats st = {};
    double flops = 2.0 * 2.0 * N * V * d;  // logits and dz products
    report_flops("lm_head_loss 8192 tok, d=4096, V=32000, chunk 2048", flops,
                 time_kernel(
                     [&] {
                         lm_head_loss_cuda(xf, gamma, 1e-5f, W, V, d, t, NULL, N, chunk, 1.0f / N, dx, NULL, sc, &st,
                                           g_stream);
                     },
                     3));
    char detail[96];
    snprintf(detail, sizeof(detail), "(loss sum %.3f over %.0f tokens)", st.loss_sum, st.count);
    check_true("timed lm_head_loss gave a finite loss", isfinite(st.loss_sum), detail);
    free_loss_scratch(sc);
    CUDA_CHECK(cudaFree(xf));
    CUDA_CHECK(cudaFree(gamma));
    CUDA_CHECK(cudaFree(W));
    CUDA_CHECK(cudaFree(dx));
    CUDA_CHECK(cudaFree(t));
}

int main(void) {
    Rng rng = rng_seeded(11, 5);
    check_begin("dev/cuda/loss: chunked LM head + cross-entropy vs llmc/cpu/loss.h");
    test_lm_head(45, 64, 1003, 16, 1, &rng);
    test_lm_head(45, 64, 1003, 16, 0, &rng);
    test_lm_head(32, 96, 2048, 32, 1, &rng);
    test_lm_head(7, 40, 517, 100, 1, &rng);
    test_lm_head(45, 64, 1003, 16, 1, &rng, 5.0f);  // Gemma 2's soft-capped logits (the cap bites: logits ~ +-10)
    test_lm_head(7, 40, 517, 100, 0, &rng, 5.0f);
    test_lm_head_chunks(45, 64, 1003, 7, &rng);
    for (KernelChoice impl : {KERNELS_VEC, KERNELS_SCALAR}) {
        test_ce_rows<float>(impl, 9, 10, 0, &rng);
        test_ce_rows<float>(impl, 4, 1000, 0, &rng);
        test_ce_rows<float>(impl, 3, 1000, 1, &rng);
        test_ce_rows<bf16>(impl, 3, 1024, 0, &rng);  // every row aligned: no head, no tail
        test_ce_rows<bf16>(impl, 5, 1003, 0, &rng);  // rows start anywhere
        test_ce_rows<bf16>(impl, 3, 1024, 1, &rng);  // logits out of step with dlogits: scalar dlogits
        test_ce_rows<bf16>(impl, 4, 3, 0, &rng);     // rows shorter than one vector
    }
    if (g_timing) time_lm_head();
    return finish();
}
