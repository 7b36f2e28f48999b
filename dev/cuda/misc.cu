// dev/cuda/misc.cu: the small kernels of llmc/cuda/misc.cuh against their CPU twins: token
// embedding gather, residual add, bias add and bias gradient, ViT patch unfold (bf16 and fp32
// pixels) and patch-embed finish, strided row copies, the sum of --seq-parallel's replicated
// heads' blocks, and the image resize/normalise of the image loader (llmc/vision/imagedata.h's
// image_loader_convert with the bilinear taps of llmc/vision/resample.h, grayscale and RGB, with
// flips). Where the CPU twin is a loop inside llmc/ops.h (op_embed, op_patch_unfold,
// op_patch_embed_finish, op_copy_rows), the reference below is that loop transcribed; moving those
// loops into llmc/cpu/ would let both sides share one copy. Then times the memory-bound ones. The
// casts, both kernels, bit for bit, at aligned and misaligned offsets.
#include "check.h"
#include "../../llmc/cpu/embedding.h"
#include "../../llmc/cpu/misc.h"
#include "../../llmc/linear.h"
#include "../../llmc/vision/imagedata.h"
#include "../../llmc/cuda/misc.cuh"
#include "misc_scalar.cuh"  // the scalar kernels: the reference version the trainers no longer run

static void test_embed(int64_t N, int d, int V, Rng* rng) {
    float* embed = host_randn((int64_t)V * d, rng, 1.0f, 1);
    int* ids = (int*)xmalloc(sizeof(int) * N);
    for (int64_t i = 0; i < N; i++) ids[i] = (int)rng_below(rng, V);
    ids[0] = V - 1;  // the last row of the table
    float* want = (float*)xmalloc(4 * N * d);
    for (int64_t n = 0; n < N; n++)
        memcpy(want + n * d, embed + (int64_t)ids[n] * d, sizeof(float) * d);  // llmc/ops.h op_embed
    bf16 *d_e = upload_bf16(embed, (int64_t)V * d), *d_x = (bf16*)dev_alloc(2 * N * d);
    int* d_ids = (int*)upload(ids, sizeof(int) * N);
    dev_poison(d_x, 2 * N * d);
    embed_tokens_cuda(d_x, d_e, d_ids, N, d, g_stream);
    float* got = download_bf16(d_x, N * d);
    char name[96];
    snprintf(name, sizeof(name), "embed_tokens, N=%lld d=%d V=%d", (long long)N, d, V);
    check_equal_f32(name, got, want, N * d);
    CUDA_CHECK(cudaFree(d_e)); CUDA_CHECK(cudaFree(d_x)); CUDA_CHECK(cudaFree(d_ids));
    free(embed); free(ids); free(want); free(got);
}

// The gradient of a trained embedding: repeated ids add up (accumulated onto random values), each
// row's tokens summed in text order before the add; the kernel sums the same bf16 values in fp32 in
// the same order as its twin, so the two agree to the last bit.
static void test_embedding_backward(int64_t N, int d, int V, Rng* rng) {
    float *dx = host_randn(N * d, rng, 1.0f, 1), *e0 = host_randn((int64_t)V * d, rng, 1.0f, 0);
    int* ids = (int*)xmalloc(sizeof(int) * N);
    int* order = (int*)xmalloc(sizeof(int) * N);
    for (int64_t n = 0; n < N; n++) ids[n] = (int)rng_below(rng, V);
    ids[N - 1] = ids[0];  // a repeat for sure
    embedding_token_order(order, ids, N);
    float* want = host_copy(e0, (int64_t)V * d);
    embedding_backward(want, dx, ids, order, N, d);
    bf16* d_dx = upload_bf16(dx, N * d);
    float* d_e = (float*)upload(e0, 4 * (int64_t)V * d);
    int* d_ids = (int*)upload(ids, sizeof(int) * N);
    int* d_order = (int*)upload(order, sizeof(int) * N);
    embedding_backward_cuda(d_e, d_dx, d_ids, d_order, N, d, g_stream);
    float* got = download_f32(d_e, (int64_t)V * d);
    char name[96];
    snprintf(name, sizeof(name), "embedding_backward (accumulated), N=%lld d=%d V=%d", (long long)N, d, V);
    check_equal_f32(name, got, want, (int64_t)V * d);
    free(got);
    // a padding_idx (Gemma's pad_token_id): its row keeps its value, the others as before
    float* want2 = host_copy(e0, (int64_t)V * d);
    embedding_backward(want2, dx, ids, order, N, d, ids[0]);
    CUDA_CHECK(cudaMemcpy(d_e, e0, 4 * (int64_t)V * d, cudaMemcpyHostToDevice));
    embedding_backward_cuda(d_e, d_dx, d_ids, d_order, N, d, g_stream, ids[0]);
    got = download_f32(d_e, (int64_t)V * d);
    snprintf(name, sizeof(name), "embedding_backward skipping row %d, N=%lld d=%d V=%d", ids[0], (long long)N, d, V);
    check_equal_f32(name, got, want2, (int64_t)V * d);
    int kept = memcmp(want2 + (int64_t)ids[0] * d, e0 + (int64_t)ids[0] * d, 4 * (size_t)d) == 0;
    check_true("embedding_backward's skipped row untouched", kept, "");
    free(want2);
    CUDA_CHECK(cudaFree(d_dx)); CUDA_CHECK(cudaFree(d_e)); CUDA_CHECK(cudaFree(d_ids)); CUDA_CHECK(cudaFree(d_order));
    free(dx); free(e0); free(ids); free(order); free(want); free(got);
}

static void test_multiply_bias(int64_t N, int out, Rng* rng) {
    int64_t n = N * out;
    float *a = host_randn(n, rng, 1.0f, 1), *b = host_randn(n, rng, 1.0f, 1), *bias = host_randn(out, rng, 1.0f, 1);
    bf16 *d_a = upload_bf16(a, n), *d_b = upload_bf16(b, n), *d_out = (bf16*)dev_alloc(2 * n),
         *d_bias = upload_bf16(bias, out);
    char name[96];
    // residual add (Gemma's post-normed branch onto the stream), in place, one rounding
    float* want_add = (float*)xmalloc(4 * n);
    for (int64_t i = 0; i < n; i++) want_add[i] = bf16_round(a[i]);
    float* b16 = (float*)xmalloc(4 * n);
    for (int64_t i = 0; i < n; i++) b16[i] = bf16_round(b[i]);
    add_inplace(want_add, b16, n);
    for (int64_t i = 0; i < n; i++) want_add[i] = bf16_round(want_add[i]);
    bf16* d_y = upload_bf16(a, n);
    add_inplace_cuda(d_y, d_b, n, g_stream);
    float* got_add = download_bf16(d_y, n);
    snprintf(name, sizeof(name), "add_inplace, n=%lld", (long long)n);
    check_equal_f32(name, got_add, want_add, n);
    CUDA_CHECK(cudaFree(d_y));
    free(want_add); free(b16); free(got_add);
    // elementwise product (SwiGLU's down input rebuilt from silu(g) and u), one rounding
    float* want3 = (float*)xmalloc(4 * n);
    for (int64_t i = 0; i < n; i++) want3[i] = bf16_round(bf16_round(a[i]) * bf16_round(b[i]));
    for (KernelChoice impl : {KERNELS_VEC, KERNELS_SCALAR}) {  // 16-byte vectors (the default) and the scalar kernel
        dev_poison(d_out, 2 * n);
        multiply_launch(impl, d_out, d_a, d_b, n, g_stream);
        float* got3 = download_bf16(d_out, n);
        snprintf(name, sizeof(name), "multiply %s, n=%lld", impl == KERNELS_VEC ? "vec" : "scalar", (long long)n);
        check_equal_f32(name, got3, want3, n);
        free(got3);
    }
    {  // the production kernel's one-element path: every array 1 element into its allocation
        bf16 *m_a = (bf16*)dev_alloc(2 * (n + 1)) + 1, *m_b = (bf16*)dev_alloc(2 * (n + 1)) + 1,
             *m_out = (bf16*)dev_alloc(2 * (n + 1)) + 1;
        upload_bf16_to(m_a, a, n);
        upload_bf16_to(m_b, b, n);
        dev_poison(m_out, 2 * n);
        multiply_cuda(m_out, m_a, m_b, n, g_stream);
        float* got3 = download_bf16(m_out, n);
        snprintf(name, sizeof(name), "multiply vec misaligned, n=%lld", (long long)n);
        check_equal_f32(name, got3, want3, n);
        free(got3);
        CUDA_CHECK(cudaFree(m_a - 1)); CUDA_CHECK(cudaFree(m_b - 1)); CUDA_CHECK(cudaFree(m_out - 1));
    }
    free(want3);

    // columns scaled by a vector (Qwen3's q/k norm gamma), in place and out of place
    float* want4 = (float*)xmalloc(4 * n);
    for (int64_t i = 0; i < n; i++) want4[i] = bf16_round(a[i]);
    float* g4 = (float*)xmalloc(4 * out);
    for (int j = 0; j < out; j++) g4[j] = bf16_round(bias[j]);
    scale_columns(want4, want4, g4, N, out);
    for (int64_t i = 0; i < n; i++) want4[i] = bf16_round(want4[i]);
    for (KernelChoice impl : {KERNELS_VEC, KERNELS_SCALAR}) {
        const char* kind = impl == KERNELS_VEC ? "vec" : "scalar";
        dev_poison(d_out, 2 * n);
        scale_columns_launch(impl, d_out, d_a, d_bias, N, out, g_stream);
        float* got4 = download_bf16(d_out, n);
        snprintf(name, sizeof(name), "scale_columns %s, N=%lld d=%d", kind, (long long)N, out);
        check_equal_f32(name, got4, want4, n);
        bf16* d_a2 = upload_bf16(a, n);
        scale_columns_launch(impl, d_a2, d_a2, d_bias, N, out, g_stream);
        float* got5 = download_bf16(d_a2, n);
        snprintf(name, sizeof(name), "scale_columns %s in place, N=%lld d=%d", kind, (long long)N, out);
        check_equal_f32(name, got5, want4, n);
        CUDA_CHECK(cudaFree(d_a2));
        free(got4); free(got5);
    }
    free(want4); free(g4);

    // bias add, bf16 and fp32 rows, vs llmc/linear.h add_bias_rows
    float* yb = host_copy(b, n);
    add_bias_rows(yb, bias, N, out);
    for (int64_t i = 0; i < n; i++) yb[i] = bf16_round(yb[i]);
    add_bias_rows_cuda(d_b, d_bias, N, out, g_stream);
    float* gb = download_bf16(d_b, n);
    snprintf(name, sizeof(name), "add_bias_rows bf16, N=%lld out=%d", (long long)N, out);
    check_equal_f32(name, gb, yb, n);
    float *yf = host_randn(n, rng, 1.0f, 0), *biasf = host_randn(out, rng, 1.0f, 0);
    float *d_yf = (float*)upload(yf, 4 * n), *d_biasf = (float*)upload(biasf, 4 * out);
    add_bias_rows(yf, biasf, N, out);
    add_bias_rows_cuda(d_yf, d_biasf, N, out, g_stream);
    float* gf = download_f32(d_yf, n);
    snprintf(name, sizeof(name), "add_bias_rows fp32, N=%lld out=%d", (long long)N, out);
    check_equal_f32(name, gf, yf, n);

    // bias gradient: db += column sums (the ViT head, llmc/models/vit.h), fp32 and bf16 dy
    float* db0 = host_randn(out, rng, 1.0f, 0);
    float* wantdb = host_copy(db0, out);
    for (int64_t r = 0; r < N; r++)
        for (int j = 0; j < out; j++) wantdb[j] += yf[r * out + j];
    float* d_db = (float*)upload(db0, 4 * out);
    bias_grad_rows_cuda(d_db, d_yf, N, out, g_stream);
    float* gdb = download_f32(d_db, out);
    snprintf(name, sizeof(name), "bias_grad_rows fp32, N=%lld out=%d", (long long)N, out);
    check_close(name, gdb, wantdb, out, 1e-6);
    CUDA_CHECK(cudaMemcpy(d_db, db0, 4 * out, cudaMemcpyHostToDevice));
    bf16* d_yb = upload_bf16(yb, n);
    float* wantdb2 = host_copy(db0, out);
    for (int64_t r = 0; r < N; r++)
        for (int j = 0; j < out; j++) wantdb2[j] += yb[r * out + j];
    bias_grad_rows_cuda(d_db, d_yb, N, out, g_stream);
    float* gdb2 = download_f32(d_db, out);
    snprintf(name, sizeof(name), "bias_grad_rows bf16 dy, N=%lld out=%d", (long long)N, out);
    check_close(name, gdb2, wantdb2, out, 1e-6);

    CUDA_CHECK(cudaFree(d_a)); CUDA_CHECK(cudaFree(d_b)); CUDA_CHECK(cudaFree(d_out)); CUDA_CHECK(cudaFree(d_bias));
    CUDA_CHECK(cudaFree(d_yf)); CUDA_CHECK(cudaFree(d_biasf)); CUDA_CHECK(cudaFree(d_db)); CUDA_CHECK(cudaFree(d_yb));
    free(a); free(b); free(bias); free(yb); free(gb); free(yf); free(biasf); free(gf);
    free(db0); free(wantdb); free(gdb); free(wantdb2); free(gdb2);
}

// Patch unfold and the embedding finish, against the CPU loops of llmc/ops.h.
static void test_patches(int B, int C, int H, int W, int ph, int pw, int d, Rng* rng) {
    int gh = H / ph, gw = W / pw, T = 1 + gh * gw;
    int64_t N = (int64_t)B * T, P = (int64_t)C * ph * pw;
    float* pixels = host_randn((int64_t)B * C * H * W, rng, 1.0f, 1);
    float* want = (float*)xmalloc(4 * N * P);
    for (int64_t n = 0; n < N; n++) {  // llmc/ops.h op_patch_unfold
        float* row = want + n * P;
        int b = (int)(n / T), t = (int)(n % T);
        if (t == 0) { memset(row, 0, sizeof(float) * P); continue; }
        int py = (t - 1) / gw, pxx = (t - 1) % gw;
        for (int ch = 0; ch < C; ch++)
            for (int i = 0; i < ph; i++)
                memcpy(row + ((int64_t)ch * ph + i) * pw,
                       pixels + (((int64_t)b * C + ch) * H + py * ph + i) * W + pxx * pw, sizeof(float) * pw);
    }
    bf16 *d_pix = upload_bf16(pixels, (int64_t)B * C * H * W), *d_patches = (bf16*)dev_alloc(2 * N * P);
    dev_poison(d_patches, 2 * N * P);
    PatchShape s = {B, T, C, H, W, ph, pw, gw};
    patch_unfold_cuda(d_patches, d_pix, s, g_stream);
    float* got = download_bf16(d_patches, N * P);
    char name[128];
    snprintf(name, sizeof(name), "patch_unfold, B=%d C=%d %dx%d patch %dx%d", B, C, H, W, ph, pw);
    check_equal_f32(name, got, want, N * P);
    // the same from fp32 pixels (what train_vit uploads): the values are bf16-representable, so
    // the conversion inside the kernel is exact and the result identical
    float* d_pix32 = (float*)upload(pixels, 4 * (int64_t)B * C * H * W);
    dev_poison(d_patches, 2 * N * P);
    patch_unfold_cuda(d_patches, d_pix32, s, g_stream);
    float* got32 = download_bf16(d_patches, N * P);
    snprintf(name, sizeof(name), "patch_unfold fp32 pixels, B=%d C=%d %dx%d patch %dx%d", B, C, H, W, ph, pw);
    check_equal_f32(name, got32, want, N * P);
    CUDA_CHECK(cudaFree(d_pix32));
    free(got32);

    float *x = host_randn(N * d, rng, 1.0f, 1), *cls = host_randn(d, rng, 1.0f, 1), *pb = host_randn(d, rng, 1.0f, 1);
    float* pos = host_randn((int64_t)T * d, rng, 1.0f, 1);
    float* wantx = host_copy(x, N * d);
    for (int64_t n = 0; n < N; n++) {  // llmc/ops.h op_patch_embed_finish
        float* xr = wantx + n * d;
        int64_t t = n % T;
        const float* p = pos + t * d;
        if (t == 0) for (int64_t i = 0; i < d; i++) xr[i] = cls[i] + p[i];
        else for (int64_t i = 0; i < d; i++) xr[i] += pb[i] + p[i];
    }
    bf16 *d_x = upload_bf16(x, N * d), *d_cls = upload_bf16(cls, d), *d_pb = upload_bf16(pb, d),
         *d_pos = upload_bf16(pos, (int64_t)T * d);
    patch_embed_finish_cuda(d_x, d_cls, d_pb, d_pos, N, T, d, g_stream);
    float* gx = download_bf16(d_x, N * d);
    snprintf(name, sizeof(name), "patch_embed_finish, B=%d T=%d d=%d", B, T, d);
    check_close(name, gx, wantx, N * d, 1e-2);
    CUDA_CHECK(cudaFree(d_pix));
    CUDA_CHECK(cudaFree(d_patches));
    CUDA_CHECK(cudaFree(d_x));
    CUDA_CHECK(cudaFree(d_cls));
    CUDA_CHECK(cudaFree(d_pb)); CUDA_CHECK(cudaFree(d_pos));
    free(pixels); free(want); free(got); free(x); free(cls); free(pb); free(pos); free(wantx); free(gx);
}

// The embeddings' gradient when they train (--full): class token, patch bias and positions from
// dx [B*T, d], accumulated onto random values, against the CPU twin (llmc/cpu/embedding.h).
static void test_patch_embed_backward(int B, int T, int d, Rng* rng) {
    int64_t N = (int64_t)B * T, Td = (int64_t)T * d;
    float* dx = host_randn(N * d, rng, 1.0f, 1);
    float *c0 = host_randn(d, rng, 1.0f, 0), *b0 = host_randn(d, rng, 1.0f, 0), *p0 = host_randn(Td, rng, 1.0f, 0);
    float *wc = host_copy(c0, d), *wb = host_copy(b0, d), *wp = host_copy(p0, Td);
    patch_embed_finish_backward(wc, wb, wp, dx, N, T, d);
    bf16* d_dx = upload_bf16(dx, N * d);
    float *d_c = (float*)upload(c0, 4 * (int64_t)d), *d_b = (float*)upload(b0, 4 * (int64_t)d),
          *d_p = (float*)upload(p0, 4 * Td);
    patch_embed_finish_backward_cuda(d_c, d_b, d_p, d_dx, N, T, d, g_stream);
    float *gc = download_f32(d_c, d), *gb = download_f32(d_b, d), *gp = download_f32(d_p, Td);
    for (int i = 0; i < d; i++) { gc[i] -= c0[i]; wc[i] -= c0[i]; gb[i] -= b0[i]; wb[i] -= b0[i]; }
    for (int64_t i = 0; i < Td; i++) { gp[i] -= p0[i]; wp[i] -= p0[i]; }
    char name[96];
    snprintf(name, sizeof(name), "patch_embed_finish_backward dcls, B=%d T=%d d=%d", B, T, d);
    check_close(name, gc, wc, d, 1e-4);
    snprintf(name, sizeof(name), "patch_embed_finish_backward dpatch_b, B=%d T=%d d=%d", B, T, d);
    check_close(name, gb, wb, d, 1e-4);
    snprintf(name, sizeof(name), "patch_embed_finish_backward dpos, B=%d T=%d d=%d", B, T, d);
    check_close(name, gp, wp, Td, 1e-4);
    CUDA_CHECK(cudaFree(d_dx)); CUDA_CHECK(cudaFree(d_c)); CUDA_CHECK(cudaFree(d_b)); CUDA_CHECK(cudaFree(d_p));
    free(dx); free(c0); free(b0); free(p0); free(wc); free(wb); free(wp); free(gc); free(gb); free(gp);
}

// Strided row copies both ways (the ViT head's class tokens out of the residual stream [B, T, d]
// and their gradient back), against plain loops; rows outside the copy must stay untouched.
static void test_copy_rows(int B, int T, int d, Rng* rng) {
    int64_t n = (int64_t)B * T * d;
    float *resid = host_randn(n, rng, 1.0f, 1), *dense = host_randn((int64_t)B * d, rng, 1.0f, 1);
    float* want = (float*)xmalloc(4 * B * d);
    for (int b = 0; b < B; b++) memcpy(want + (int64_t)b * d, resid + (int64_t)b * T * d, sizeof(float) * d);
    bf16 *d_resid = upload_bf16(resid, n), *d_dense = (bf16*)dev_alloc(2 * (int64_t)B * d);
    dev_poison(d_dense, 2 * (int64_t)B * d);
    copy_rows_cuda(d_dense, d, d_resid, (int64_t)T * d, B, d, g_stream);
    float* got = download_bf16(d_dense, (int64_t)B * d);
    char name[96];
    snprintf(name, sizeof(name), "copy_rows gather, B=%d T=%d d=%d", B, T, d);
    check_equal_f32(name, got, want, (int64_t)B * d);
    float* want2 = host_copy(resid, n);
    for (int b = 0; b < B; b++) memcpy(want2 + (int64_t)b * T * d, dense + (int64_t)b * d, sizeof(float) * d);
    bf16* d_src = upload_bf16(dense, (int64_t)B * d);
    copy_rows_cuda(d_resid, (int64_t)T * d, d_src, d, B, d, g_stream);
    float* got2 = download_bf16(d_resid, n);
    snprintf(name, sizeof(name), "copy_rows scatter, B=%d T=%d d=%d", B, T, d);
    check_equal_f32(name, got2, want2, n);
    CUDA_CHECK(cudaFree(d_resid)); CUDA_CHECK(cudaFree(d_dense)); CUDA_CHECK(cudaFree(d_src));
    free(resid); free(dense); free(want); free(got); free(want2); free(got2);
}

// The replicated key/value heads' gradients summed back (--seq-parallel with fewer kv heads than
// ranks): rep partial blocks per column chunk, against llmc/cpu/misc.h's sum_replica_blocks on the
// same bf16 values; both add them in fp32 in replica order and round once, so to the last bit.
static void test_sum_replica_blocks(int64_t rows, int blocks, int rep, int bw, Rng* rng) {
    int64_t n = rows * blocks * bw, out = n / rep;
    float *src = host_randn(n, rng, 1.0f, 1), *want = (float*)xmalloc(4 * out);
    sum_replica_blocks(want, src, rows, blocks, rep, bw);
    host_round_bf16(want, out);
    bf16 *d_src = upload_bf16(src, n), *d_dst = (bf16*)dev_alloc(2 * out);
    dev_poison(d_dst, 2 * out);
    sum_replica_blocks_cuda(d_dst, d_src, rows, blocks, rep, bw, g_stream);
    float* got = download_bf16(d_dst, out);
    char name[96];
    snprintf(name, sizeof(name), "sum_replica_blocks, rows=%lld blocks=%d rep=%d bw=%d", (long long)rows, blocks, rep,
             bw);
    check_equal_f32(name, got, want, out);
    CUDA_CHECK(cudaFree(d_src)); CUDA_CHECK(cudaFree(d_dst));
    free(src); free(want); free(got);
}

// B images of sH x sW x sC uint8 -> [B, C, H, W], against image_loader_convert image by image.
static void test_image(int B, int sH, int sW, int sC, int H, int W, int C, Rng* rng) {
    ImageShard shard;
    memset(&shard, 0, sizeof(shard));
    shard.n = B;
    shard.H = sH;
    shard.W = sW;
    shard.C = sC;
    shard.pixels = (uint8_t*)xmalloc((size_t)B * sH * sW * sC);
    for (int64_t i = 0; i < (int64_t)B * sH * sW * sC; i++) shard.pixels[i] = (uint8_t)rng_below(rng, 256);
    ImageLoader L;
    memset(&L, 0, sizeof(L));
    L.shard = &shard;
    L.H = H;
    L.W = W;
    L.C = C;
    float mean[3] = {0.485f, 0.456f, 0.406f}, stdv[3] = {0.229f, 0.224f, 0.225f};
    for (int c = 0; c < 3; c++) { L.mean[c] = mean[c]; L.std[c] = stdv[c]; }
    L.ty = (ResampleTaps*)xmalloc(sizeof(ResampleTaps) * H);
    L.tx = (ResampleTaps*)xmalloc(sizeof(ResampleTaps) * W);
    bilinear_taps(L.ty, sH, H);
    bilinear_taps(L.tx, sW, W);
    int* flip = (int*)xmalloc(sizeof(int) * B);
    int64_t per = (int64_t)C * H * W;
    float* want = (float*)xmalloc(4 * B * per);
    for (int b = 0; b < B; b++) {
        flip[b] = b % 2;
        image_loader_convert(&L, b, flip[b], want + b * per);
    }
    uint8_t* d_src = (uint8_t*)upload(shard.pixels, (size_t)B * sH * sW * sC);
    ResampleTaps *d_ty = (ResampleTaps*)upload(L.ty, sizeof(ResampleTaps) * H),
                 *d_tx = (ResampleTaps*)upload(L.tx, sizeof(ResampleTaps) * W);
    int* d_flip = (int*)upload(flip, sizeof(int) * B);
    bf16* d_dst = (bf16*)dev_alloc(2 * B * per);
    dev_poison(d_dst, 2 * B * per);
    ImageShape s = {B, sH, sW, sC, H, W, C, {mean[0], mean[1], mean[2]}, {stdv[0], stdv[1], stdv[2]}};
    image_resize_normalize_cuda(d_dst, d_src, d_ty, d_tx, d_flip, s, g_stream);
    float* got = download_bf16(d_dst, B * per);
    char name[128];
    snprintf(name, sizeof(name), "image_resize_normalize %dx%dx%d -> %dx%dx%d, flips", sH, sW, sC, C, H, W);
    check_close(name, got, want, B * per, 1e-2);
    CUDA_CHECK(cudaFree(d_src)); CUDA_CHECK(cudaFree(d_ty)); CUDA_CHECK(cudaFree(d_tx)); CUDA_CHECK(cudaFree(d_flip));
    CUDA_CHECK(cudaFree(d_dst));
    free(shard.pixels); free(L.ty); free(L.tx); free(flip); free(want); free(got);
}

static void time_misc(void) {
    int64_t N = 16384;
    int d = 4096, V = 32000;
    bf16 *e = (bf16*)dev_alloc(2 * (int64_t)V * d), *x = (bf16*)dev_alloc(2 * N * d), *y = (bf16*)dev_alloc(2 * N * d);
    int* ids = (int*)dev_alloc(sizeof(int) * N);
    CUDA_CHECK(cudaMemset(ids, 0, sizeof(int) * N));
    CUDA_CHECK(cudaMemset(e, 0x3c, 2 * (int64_t)V * d));
    CUDA_CHECK(cudaMemset(y, 0x3c, 2 * N * d));
    report_bandwidth("embed_tokens 16384x4096", 2.0 * 2 * N * d,
                     time_kernel([&] { embed_tokens_cuda(x, e, ids, N, d, g_stream); }, 10));
    int B = 64, H = 224, W = 224;
    uint8_t* src = (uint8_t*)dev_alloc((size_t)B * 256 * 256 * 3);
    bf16* dst = (bf16*)dev_alloc(2 * (int64_t)B * 3 * H * W);
    CUDA_CHECK(cudaMemset(src, 7, (size_t)B * 256 * 256 * 3));
    ResampleTaps *ty = (ResampleTaps*)xmalloc(sizeof(ResampleTaps) * H),
                 *tx = (ResampleTaps*)xmalloc(sizeof(ResampleTaps) * W);
    bilinear_taps(ty, 256, H);
    bilinear_taps(tx, 256, W);
    ResampleTaps *d_ty = (ResampleTaps*)upload(ty, sizeof(ResampleTaps) * H),
                 *d_tx = (ResampleTaps*)upload(tx, sizeof(ResampleTaps) * W);
    ImageShape s = {B, 256, 256, 3, H, W, 3, {0.5f, 0.5f, 0.5f}, {0.5f, 0.5f, 0.5f}};
    report_bandwidth("image_resize_normalize 64 x 256^2 -> 224^2",
                     (double)B * 256 * 256 * 3 + 2.0 * B * 3 * H * W,
                     time_kernel([&] { image_resize_normalize_cuda(dst, src, d_ty, d_tx, NULL, s, g_stream); }, 10));
    CUDA_CHECK(cudaFree(e));
    CUDA_CHECK(cudaFree(x));
    CUDA_CHECK(cudaFree(y));
    CUDA_CHECK(cudaFree(ids));
    CUDA_CHECK(cudaFree(src));
    CUDA_CHECK(cudaFree(dst)); CUDA_CHECK(cudaFree(d_ty)); CUDA_CHECK(cudaFree(d_tx));
    free(ty); free(tx);
}

// The casts (bf16 shadows of fp32 masters, fp32 copies of bf16) against the host's round to
// nearest even, bit for bit, both forms (KERNELS_VEC: the production kernel, 16-byte vectors
// between a one-element head and tail; KERNELS_SCALAR: misc_scalar.cuh's), with each array
// `doff`/`soff` elements into its allocation: in step (a head of up to 7 elements), or out of step
// (no common alignment: the production kernel casts one element at a time), as ZeRO-1's shard
// offsets give (llmc/train/zero.h).
static void test_casts(int64_t n, int doff, int soff, Rng* rng) {
    float* x = host_randn(n, rng, 2.0f, 0);
    float* want = host_copy(x, n);
    host_round_bf16(want, n);
    for (KernelChoice impl : {KERNELS_VEC, KERNELS_SCALAR}) {
        const char* kind = impl == KERNELS_VEC ? "vec" : "scalar";
        float* d_src = (float*)dev_alloc(4 * (n + soff)) + soff;
        bf16* d_h = (bf16*)dev_alloc(2 * (n + doff)) + doff;
        float* d_back = (float*)dev_alloc(4 * (n + soff)) + soff;
        CUDA_CHECK(cudaMemcpy(d_src, x, 4 * n, cudaMemcpyHostToDevice));
        dev_poison(d_h, 2 * n);
        dev_poison(d_back, 4 * n);
        cast_f32_to_bf16_launch(impl, d_h, d_src, n, g_stream);
        cast_bf16_to_f32_launch(impl, d_back, d_h, n, g_stream);
        float *gh = download_bf16(d_h, n), *back = download_f32(d_back, n);
        char name[128];
        snprintf(name, sizeof(name), "cast_f32_to_bf16 %s, n=%lld, +%d/+%d", kind, (long long)n, doff, soff);
        check_equal_f32(name, gh, want, n);
        snprintf(name, sizeof(name), "cast_bf16_to_f32 %s, n=%lld, +%d/+%d", kind, (long long)n, doff, soff);
        check_equal_f32(name, back, want, n);
        CUDA_CHECK(cudaFree(d_src - soff)); CUDA_CHECK(cudaFree(d_h - doff)); CUDA_CHECK(cudaFree(d_back - soff));
        free(gh); free(back);
    }
    free(x); free(want);
}

int main(void) {
    Rng rng = rng_seeded(17, 7);
    check_begin(
        "dev/cuda/misc: embedding, residual, bias, column scaling, patches, strided rows, replica sums, image resize "
        "vs their CPU twins");
    test_embed(37, 67, 101, &rng);
    test_embed(5, 512, 7, &rng);
    test_embedding_backward(37, 67, 11, &rng);
    test_embedding_backward(300, 129, 50, &rng);
    test_multiply_bias(37, 67, &rng);
    test_multiply_bias(3, 10, &rng);
    test_multiply_bias(5, 64, &rng);  // d % 8 == 0: scale_columns' 16-byte 2-D kernel (and multiply's, as always)
    test_patches(2, 3, 32, 48, 16, 16, 24, &rng);
    test_patches(1, 1, 28, 28, 7, 4, 9, &rng);
    test_patch_embed_backward(3, 17, 67, &rng);
    test_patch_embed_backward(1, 50, 130, &rng);
    test_copy_rows(3, 17, 67, &rng);
    test_copy_rows(1, 5, 8, &rng);
    test_sum_replica_blocks(37, 8, 4, 16, &rng);  // 2 kv heads over 8 ranks
    test_sum_replica_blocks(5, 4, 2, 67, &rng);
    test_sum_replica_blocks(9, 3, 1, 24, &rng);   // no replicas: a copy into the token layout
    test_image(3, 37, 53, 3, 32, 32, 3, &rng);    // upscale and downscale, RGB
    test_image(2, 28, 28, 1, 40, 24, 3, &rng);    // grayscale feeding RGB
    test_image(2, 64, 30, 3, 16, 45, 3, &rng);
    for (int64_t n : {(int64_t)1, (int64_t)7, (int64_t)4099}) {
        test_casts(n, 0, 0, &rng);
        test_casts(n, 3, 3, &rng);  // in step: a head of 5 elements
        test_casts(n, 1, 0, &rng);  // out of step: scalar
    }
    if (g_timing) time_misc();
    return finish();
}
