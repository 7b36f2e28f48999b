// dev/cuda/attention.cu: RoPE and flash attention (attention.cuh, attention_flash.cuh), and the batched-GEMM
// attention of llmc/cuda/attention_gemm.cuh (also split into many chunks of query rows), against
// llmc/cpu/attention.h: causal and bidirectional, grouped-query (H/KVH = 1, 2, 3, 4), head dims
// 16..128 including ones that are not a multiple of 8 or 32, sequence lengths that are not a
// multiple of the 32-row tiles; the tensor-core path with whole keys and with key blocks (online
// softmax), and its pointer tables built once per operand set. Forward (o, lse) and backward (dq,
// dk, dv) from identical bf16 inputs; the backward gets the CPU forward's o (rounded to bf16) and
// lse, as the GPU would keep them. Then times forward and backward at LLaMA-7B-like shapes in TFLOP/s.
#include "check.h"
#include "../../llmc/cpu/attention.h"
#include "../../llmc/cuda/attention.cuh"
#include "../../llmc/cuda/attention_gemm.cuh"
#include "rope_scalar.cuh"      // the scalar RoPE kernel: the reference version the trainers no longer run
#include "attention_flash.cuh"  // the flash backward: the reference version the trainers no longer run

// The pointer tables of the tensor-core path are built once per operand set: the forward and the
// backward again on the same buffers build none, and give the same bits (from the same inputs:
// o and lse are rewritten by the forward, as in training, so the backward reads those).
static void test_tables_kept(const char* tag, const AttnShape* sd, void* work, bf16* d_o, float* d_lse,
                             const bf16* d_q, const bf16* d_k, const bf16* d_v, const bf16* d_dout, bf16* d_dq,
                             bf16* d_dk, bf16* d_dv, const float* o_first, const float* dq_first) {
    int64_t N = (int64_t)sd->B * sd->T, nq = N * sd->H * sd->hd;
    attention_forward_gemm_cuda(d_o, d_lse, d_q, d_k, d_v, *sd, work, g_stream);
    attention_backward_gemm_cuda(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_o, d_lse, *sd, work, g_stream);
    long long before = g_attn_tables.builds;
    attention_forward_gemm_cuda(d_o, d_lse, d_q, d_k, d_v, *sd, work, g_stream);
    float* o_again = download_bf16(d_o, nq);
    attention_backward_gemm_cuda(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_o, d_lse, *sd, work, g_stream);
    float *dq_again = download_bf16(d_dq, nq), *dq_ref = (float*)xmalloc(4 * nq);
    attention_backward_gemm_cuda(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_o, d_lse, *sd, work, g_stream);
    float* dq_third = download_bf16(d_dq, nq);
    char name[160];
    snprintf(name, sizeof(name), "attn gemm pointer tables built once (%lld new builds), %s",
             g_attn_tables.builds - before, tag);
    check_true(name, g_attn_tables.builds == before, "");
    snprintf(name, sizeof(name), "attn gemm repeated forward gives the same o, %s", tag);
    check_true(name, memcmp(o_again, o_first, 4 * nq) == 0, "");
    snprintf(name, sizeof(name), "attn gemm repeated backward gives the same dq, %s", tag);
    check_true(name, memcmp(dq_again, dq_third, 4 * nq) == 0, "");
    (void)dq_first;
    free(o_again); free(dq_again); free(dq_ref); free(dq_third);
}

// packed: the rows hold examples of random lengths (positions restart; attention stays inside).
static void test_attention(AttnShape s, Rng* rng, int packed) {
    int64_t N = (int64_t)s.B * s.T, nq = N * s.H * s.hd, nk = N * s.KVH * s.hd, nl = (int64_t)s.B * s.H * s.T;
    int* pos = NULL;
    AttnShape sd = s;  // the device side's shape: same, but pos on the device
    if (packed) {
        pos = (int*)xmalloc(sizeof(int) * N);
        for (int64_t n = 0; n < N; n++) pos[n] = (n % s.T == 0 || rng_below(rng, 7) == 0) ? 0 : pos[n - 1] + 1;
        s.pos = pos;
        sd.pos = (const int*)upload(pos, sizeof(int) * N);
    }
    float *q = host_randn(nq, rng, 1.0f, 1), *k = host_randn(nk, rng, 1.0f, 1), *v = host_randn(nk, rng, 1.0f, 1);
    float *o = (float*)xmalloc(4 * nq), *lse = (float*)xmalloc(4 * nl);
    attention_forward(o, lse, q, k, v, s);
    bf16 *d_q = upload_bf16(q, nq), *d_k = upload_bf16(k, nk), *d_v = upload_bf16(v, nk),
         *d_o = (bf16*)dev_alloc(2 * nq);
    float* d_lse = (float*)dev_alloc(4 * nl);
    dev_poison(d_o, 2 * nq);
    dev_poison(d_lse, 4 * nl);
    attention_forward_cuda(d_o, d_lse, d_q, d_k, d_v, sd, g_stream);
    float *go = download_bf16(d_o, nq), *glse = download_f32(d_lse, nl);
    char tag[96], name[160];
    snprintf(tag, sizeof(tag), "B=%d T=%d H=%d KVH=%d hd=%d %s window=%d scale=%g softcap=%g", s.B, s.T, s.H, s.KVH,
             s.hd,
             packed     ? "causal packed"
             : s.causal ? "causal"
                        : "bidir",
             s.window, s.scale, s.softcap);
    // the flash backward reference (attention_flash.cuh) has the window (att_visible) but neither the
    // scale nor the soft-cap: it runs on the shapes without them only
    int flash_bwd = s.scale == 0.0f && s.softcap == 0.0f;
    snprintf(name, sizeof(name), "attn fwd o, %s", tag);
    check_close(name, go, o, nq, 1e-2);
    snprintf(name, sizeof(name), "attn fwd lse, %s", tag);
    check_close(name, glse, lse, nl, 1e-5);

    // backward: both sides get o as the CUDA forward would have stored it (bf16) and the CPU lse
    host_round_bf16(o, nq);
    float *dout = host_randn(nq, rng, 1.0f, 1), *dq = (float*)xmalloc(4 * nq), *dk = (float*)xmalloc(4 * nk),
          *dv = (float*)xmalloc(4 * nk);
    attention_backward(dq, dk, dv, dout, q, k, v, o, lse, s);
    upload_bf16_to(d_o, o, nq);
    CUDA_CHECK(cudaMemcpy(d_lse, lse, 4 * nl, cudaMemcpyHostToDevice));
    bf16 *d_dout = upload_bf16(dout, nq), *d_dq = (bf16*)dev_alloc(2 * nq), *d_dk = (bf16*)dev_alloc(2 * nk),
         *d_dv = (bf16*)dev_alloc(2 * nk);
    float* d_scratch = (float*)dev_alloc(4 * nl);
    dev_poison(d_dq, 2 * nq);
    dev_poison(d_dk, 2 * nk);
    dev_poison(d_dv, 2 * nk);
    dev_poison(d_scratch, 4 * nl);
    float *gdq = NULL, *gdk = NULL, *gdv = NULL;
    if (flash_bwd) {
        attention_backward_cuda(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_o, d_lse, d_scratch, sd, g_stream);
        gdq = download_bf16(d_dq, nq), gdk = download_bf16(d_dk, nk), gdv = download_bf16(d_dv, nk);
        snprintf(name, sizeof(name), "attn bwd dq, %s", tag);
        check_close(name, gdq, dq, nq, 1e-2);
        snprintf(name, sizeof(name), "attn bwd dk, %s", tag);
        check_close(name, gdk, dk, nk, 1e-2);
        snprintf(name, sizeof(name), "attn bwd dv, %s", tag);
        check_close(name, gdv, dv, nk, 1e-2);
    }

    // the tensor-core (batched GEMM) path: forward from the same inputs, backward from the same o and lse
    void* work = dev_alloc(attn_gemm_work_bytes(&sd, 1));
    dev_poison(work, attn_gemm_work_bytes(&sd, 1));
    dev_poison(d_o, 2 * nq);
    dev_poison(d_lse, 4 * nl);
    attention_forward_gemm_cuda(d_o, d_lse, d_q, d_k, d_v, sd, work, g_stream);
    float *go2 = download_bf16(d_o, nq), *glse2 = download_f32(d_lse, nl);
    float *o_ref = (float*)xmalloc(4 * nq), *lse_ref = (float*)xmalloc(4 * nl);
    attention_forward(o_ref, lse_ref, q, k, v, s);  // o as fp32, before the rounding above
    snprintf(name, sizeof(name), "attn gemm fwd o, %s", tag);
    check_close(name, go2, o_ref, nq, 1e-2);
    snprintf(name, sizeof(name), "attn gemm fwd lse, %s", tag);
    check_close(name, glse2, lse_ref, nl, 1e-4);
    upload_bf16_to(d_o, o, nq);
    CUDA_CHECK(cudaMemcpy(d_lse, lse, 4 * nl, cudaMemcpyHostToDevice));
    dev_poison(d_dq, 2 * nq);
    dev_poison(d_dk, 2 * nk);
    dev_poison(d_dv, 2 * nk);
    attention_backward_gemm_cuda(d_dq, d_dk, d_dv, d_dout, d_q, d_k, d_v, d_o, d_lse, sd, work, g_stream);
    float *g2dq = download_bf16(d_dq, nq), *g2dk = download_bf16(d_dk, nk), *g2dv = download_bf16(d_dv, nk);
    snprintf(name, sizeof(name), "attn gemm bwd dq, %s", tag);
    check_close(name, g2dq, dq, nq, 1e-2);
    snprintf(name, sizeof(name), "attn gemm bwd dk, %s", tag);
    check_close(name, g2dk, dk, nk, 1e-2);
    snprintf(name, sizeof(name), "attn gemm bwd dv, %s", tag);
    check_close(name, g2dv, dv, nk, 1e-2);
    // the flash backward (dev/cuda/attention_flash.cuh) against the production one: each is within
    // 1e-2 of the CPU twin, so within 2e-2 of each other
    if (flash_bwd) {
        snprintf(name, sizeof(name), "attn flash bwd vs production dq, %s", tag);
        check_close(name, gdq, g2dq, nq, 2e-2);
        snprintf(name, sizeof(name), "attn flash bwd vs production dk, %s", tag);
        check_close(name, gdk, g2dk, nk, 2e-2);
        snprintf(name, sizeof(name), "attn flash bwd vs production dv, %s", tag);
        check_close(name, gdv, g2dv, nk, 2e-2);
    }
    test_tables_kept(tag, &sd, work, d_o, d_lse, d_q, d_k, d_v, d_dout, d_dq, d_dk, d_dv, go2, g2dq);
    attn_gemm_forget();  // the workspace is freed: a later one may get its address
    CUDA_CHECK(cudaFree(work));
    free(go2); free(glse2); free(o_ref); free(lse_ref); free(g2dq); free(g2dk); free(g2dv);

    CUDA_CHECK(cudaFree(d_q)); CUDA_CHECK(cudaFree(d_k)); CUDA_CHECK(cudaFree(d_v)); CUDA_CHECK(cudaFree(d_o));
    CUDA_CHECK(cudaFree(d_lse)); CUDA_CHECK(cudaFree(d_dout)); CUDA_CHECK(cudaFree(d_dq)); CUDA_CHECK(cudaFree(d_dk));
    CUDA_CHECK(cudaFree(d_dv)); CUDA_CHECK(cudaFree(d_scratch));
    if (packed) { CUDA_CHECK(cudaFree((void*)sd.pos)); free(pos); }
    free(q); free(k); free(v); free(o); free(lse); free(go); free(glse); free(dout); free(dq); free(dk); free(dv);
    free(gdq); free(gdk); free(gdv);
}

// Generation: n new queries against a cache of start + n keys (prefill: start = 0; decode: n = 1).
static void test_attention_cached(int n, int start, int H, int KVH, int hd, Rng* rng, int window, float scale,
                                  float softcap) {
    int keys = start + n;
    int64_t nq = (int64_t)n * H * hd, nk = (int64_t)keys * KVH * hd;
    float *q = host_randn(nq, rng, 1.0f, 1), *kc = host_randn(nk, rng, 1.0f, 1), *vc = host_randn(nk, rng, 1.0f, 1);
    float* want = (float*)xmalloc(4 * nq);
    AttnShape cs = {1, start + n, H, KVH, hd, 1, NULL, NULL, window, scale, softcap, 0};
    attention_cached(want, q, kc, vc, n, start, cs);
    bf16 *d_q = upload_bf16(q, nq), *d_k = upload_bf16(kc, nk), *d_v = upload_bf16(vc, nk),
         *d_o = (bf16*)dev_alloc(2 * nq);
    dev_poison(d_o, 2 * nq);
    attention_cached_cuda(d_o, d_q, d_k, d_v, n, start, cs, g_stream);
    float* got = download_bf16(d_o, nq);
    char name[128];
    snprintf(name, sizeof(name), "attention_cached n=%d start=%d H=%d KVH=%d hd=%d window=%d scale=%g softcap=%g", n,
             start, H, KVH, hd, window, scale, softcap);
    check_close(name, got, want, nq, 1e-2);
    CUDA_CHECK(cudaFree(d_q)); CUDA_CHECK(cudaFree(d_k)); CUDA_CHECK(cudaFree(d_v)); CUDA_CHECK(cudaFree(d_o));
    free(q); free(kc); free(vc); free(want); free(got);
}

// The statistics' two layouts (cuDNN's packed examples): a permutation, so bit for bit a plain
// loop's (the CPU backend has no twin: it never converts), and back again to the very same bits.
static void test_lse_layout(int B, int H, int T, Rng* rng) {
    int64_t n = (int64_t)B * H * T;
    float *rows = host_randn(n, rng, 1.0f, 0), *want = (float*)xmalloc(4 * n);
    for (int b = 0; b < B; b++)  // lse [B, H, T] -> [B*T, H]
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) want[((int64_t)b * T + t) * H + h] = rows[((int64_t)b * H + h) * T + t];
    float *d_rows = (float*)dev_alloc(4 * n), *d_tokens = (float*)dev_alloc(4 * n), *d_back = (float*)dev_alloc(4 * n);
    CUDA_CHECK(cudaMemcpy(d_rows, rows, 4 * n, cudaMemcpyHostToDevice));
    dev_poison(d_tokens, 4 * n);
    dev_poison(d_back, 4 * n);
    attention_lse_layout_cuda(d_tokens, d_rows, B, H, T, LSE_TO_TOKENS, g_stream);
    attention_lse_layout_cuda(d_back, d_tokens, B, H, T, LSE_TO_ROWS, g_stream);
    float *got = (float*)xmalloc(4 * n), *back = (float*)xmalloc(4 * n);
    CUDA_CHECK(cudaMemcpy(got, d_tokens, 4 * n, cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(back, d_back, 4 * n, cudaMemcpyDeviceToHost));
    char name[96];
    snprintf(name, sizeof(name), "attention_lse_layout B=%d H=%d T=%d to tokens", B, H, T);
    check_equal_bytes(name, (const uint8_t*)got, (const uint8_t*)want, 4 * n);
    snprintf(name, sizeof(name), "attention_lse_layout B=%d H=%d T=%d and back", B, H, T);
    check_equal_bytes(name, (const uint8_t*)back, (const uint8_t*)rows, 4 * n);
    CUDA_CHECK(cudaFree(d_rows)); CUDA_CHECK(cudaFree(d_tokens)); CUDA_CHECK(cudaFree(d_back));
    free(rows); free(want); free(got); free(back);
}

static void test_rope(int64_t N, int T, int nheads, int hd, int rot, Rng* rng) {
    int half = rot / 2;  // rot < hd: partial rotary (Phi-4-mini), the rest of each head passes unchanged
    int64_t n = N * nheads * hd;
    float *cos_t = (float*)xmalloc(4 * (int64_t)T * half), *sin_t = (float*)xmalloc(4 * (int64_t)T * half);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double ang = t * pow(10000.0, -2.0 * i / rot);
            cos_t[(int64_t)t * half + i] = (float)cos(ang);
            sin_t[(int64_t)t * half + i] = (float)sin(ang);
        }
    float* x = host_randn(n, rng, 1.0f, 1);
    float *d_cos = (float*)upload(cos_t, 4 * (int64_t)T * half), *d_sin = (float*)upload(sin_t, 4 * (int64_t)T * half);
    bf16* d_x = upload_bf16(x, n);
    char name[128];
    for (int inverse = 0; inverse < 2; inverse++) {
        float* want = host_copy(x, n);
        rope_apply(want, cos_t, sin_t, NULL, N, T, nheads, hd, rot, inverse);
        upload_bf16_to(d_x, x, n);
        rope_apply_cuda(d_x, d_cos, d_sin, NULL, N, T, nheads, hd, rot, inverse, g_stream);
        float* got = download_bf16(d_x, n);
        snprintf(name, sizeof(name), "rope_apply%s, N=%lld T=%d heads=%d hd=%d rot=%d", inverse ? " inverse" : "",
                 (long long)N, T, nheads, hd, rot);
        check_close(name, got, want, n, 1e-2);
        free(want);
        free(got);
    }
    upload_bf16_to(d_x, x, n);  // the inverse undoes the rotation (up to two bf16 roundings)
    rope_apply_cuda(d_x, d_cos, d_sin, NULL, N, T, nheads, hd, rot, 0, g_stream);
    rope_apply_cuda(d_x, d_cos, d_sin, NULL, N, T, nheads, hd, rot, 1, g_stream);
    float* back = download_bf16(d_x, n);
    snprintf(name, sizeof(name), "rope_apply then inverse is the identity, hd=%d", hd);
    check_close(name, back, x, n, 1e-2);
    // the default (16-byte vectors on a 2-D grid, where hd and the alignment allow) against the
    // scalar reference kernel (rope_scalar.cuh), bit for bit: positions n % T and packed ones (restarting at 0),
    // x aligned and 1 element into its allocation (the production kernel must take its 1-D form, or the emulator stops)
    int* pos = (int*)xmalloc(sizeof(int) * N);
    for (int64_t i = 0; i < N; i++) pos[i] = (int)(i % 5 == 0 ? 0 : pos[i - 1] + 1) % T;
    int* d_pos = (int*)upload(pos, sizeof(int) * N);
    for (int off = 0; off < 2; off++)
        for (int packed = 0; packed < 2; packed++) {
            bf16* d_y[2];
            for (int k = 0; k < 2; k++) {
                d_y[k] = (bf16*)dev_alloc(2 * (n + off)) + off;
                upload_bf16_to(d_y[k], x, n);
                rope_apply_launch(k ? KERNELS_SCALAR : KERNELS_VEC, d_y[k], d_cos, d_sin, packed ? d_pos : NULL, N, T,
                                  nheads, hd, rot, packed, g_stream);  // packed rows run the inverse
            }
            uint8_t *a = download_bytes(d_y[0], 2 * n), *b = download_bytes(d_y[1], 2 * n);
            snprintf(name, sizeof(name), "rope_apply vec = scalar kernel, hd=%d rot=%d heads=%d%s +%d", hd, rot,
                     nheads, packed ? " packed inverse" : "", off);
            check_equal_bytes(name, a, b, 2 * n);
            free(a); free(b);
            for (int k = 0; k < 2; k++) CUDA_CHECK(cudaFree(d_y[k] - off));
        }
    CUDA_CHECK(cudaFree(d_pos));
    free(pos);
    CUDA_CHECK(cudaFree(d_cos)); CUDA_CHECK(cudaFree(d_sin)); CUDA_CHECK(cudaFree(d_x));
    free(cos_t); free(sin_t); free(x); free(back);
}

// FLOPs of attention: 2 matmuls of 2*T*T*hd per (b, h) forward (halved when causal); the
// backward recomputes the scores and does 4 more in FlashAttention-2 counting (2.5x forward).
// Our backward recomputes QK^T and dO V^T in both kernels, so it does more work than it is
// credited with: the figure is comparable with other flash-attention implementations.
static void time_attention(AttnShape s, const char* label) {
    int64_t N = (int64_t)s.B * s.T, nq = N * s.H * s.hd, nk = N * s.KVH * s.hd, nl = (int64_t)s.B * s.H * s.T;
    bf16 *q = (bf16*)dev_alloc(2 * nq), *k = (bf16*)dev_alloc(2 * nk), *v = (bf16*)dev_alloc(2 * nk),
         *o = (bf16*)dev_alloc(2 * nq);
    bf16 *dq = (bf16*)dev_alloc(2 * nq), *dk = (bf16*)dev_alloc(2 * nk), *dv = (bf16*)dev_alloc(2 * nk),
         *dout = (bf16*)dev_alloc(2 * nq);
    float *lse = (float*)dev_alloc(4 * nl), *scratch = (float*)dev_alloc(4 * nl);
    CUDA_CHECK(cudaMemset(q, 0x3c, 2 * nq));  // bf16 0x3c3c ~ 0.0115: finite, tame scores
    CUDA_CHECK(cudaMemset(k, 0x3c, 2 * nk));
    CUDA_CHECK(cudaMemset(v, 0x3c, 2 * nk));
    CUDA_CHECK(cudaMemset(dout, 0x3c, 2 * nq));
    double fwd = 4.0 * s.B * s.H * (double)s.T * s.T * s.hd * (s.causal ? 0.5 : 1.0);
    char name[128];
    snprintf(name, sizeof(name), "attention_forward %s", label);
    report_flops(name, fwd, time_kernel([&] { attention_forward_cuda(o, lse, q, k, v, s, g_stream); }, 3));
    snprintf(name, sizeof(name), "attention_backward %s", label);
    report_flops(
        name, 2.5 * fwd,
        time_kernel([&] { attention_backward_cuda(dq, dk, dv, dout, q, k, v, o, lse, scratch, s, g_stream); }, 3));
    void* work = dev_alloc(attn_gemm_work_bytes(&s, 1));
    snprintf(name, sizeof(name), "attention_forward tensor-core GEMMs %s", label);
    report_flops(name, fwd, time_kernel([&] { attention_forward_gemm_cuda(o, lse, q, k, v, s, work, g_stream); }, 3));
    snprintf(name, sizeof(name), "attention_backward tensor-core GEMMs %s", label);
    report_flops(
        name, 2.5 * fwd,
        time_kernel([&] { attention_backward_gemm_cuda(dq, dk, dv, dout, q, k, v, o, lse, s, work, g_stream); }, 3));
    attn_gemm_forget();
    CUDA_CHECK(cudaFree(work));
    float* hl = download_f32(lse, nl);
    int finite = 1;
    for (int64_t i = 0; i < nl; i++) finite &= isfinite(hl[i]);
    snprintf(name, sizeof(name), "timed attention left finite lse, %s", label);
    check_true(name, finite, "");
    free(hl);
    CUDA_CHECK(cudaFree(q)); CUDA_CHECK(cudaFree(k)); CUDA_CHECK(cudaFree(v)); CUDA_CHECK(cudaFree(o));
    CUDA_CHECK(cudaFree(dq)); CUDA_CHECK(cudaFree(dk)); CUDA_CHECK(cudaFree(dv)); CUDA_CHECK(cudaFree(dout));
    CUDA_CHECK(cudaFree(lse)); CUDA_CHECK(cudaFree(scratch));
}

int main(void) {
    Rng rng = rng_seeded(99, 3);
    check_begin("dev/cuda/attention: RoPE, flash attention and the tensor-core GEMM attention vs llmc/cpu/attention.h");
    test_rope(2 * 37, 37, 3, 16, 16, &rng);
    test_rope(65, 65, 2, 128, 128, &rng);
    test_rope(9, 9, 3, 24, 24, &rng);  // hd not a multiple of 16: the one-pair form
    test_rope(2 * 19, 19, 3, 32, 16, &rng);  // partial rotary (half the head): the vectorised kernel
    test_rope(9, 9, 2, 16, 12, &rng);        // Phi-4-mini's 0.75 of the head: the one-pair form
    test_lse_layout(3, 4, 37, &rng);
    test_lse_layout(1, 32, 300, &rng);  // more than one block, T not a multiple of it
    AttnShape cases[] = {
        {2, 37, 4, 2, 16, 1, NULL, NULL, 0, 0.0f, 0.0f, 0},   // GQA 2, tiny head dim, ragged T
        {1, 70, 3, 1, 64, 1, NULL, NULL, 0, 0.0f, 0.0f, 0},   // multi-query (3 heads on 1 kv head)
        {2, 33, 2, 2, 80, 0, NULL, NULL, 0, 0.0f, 0.0f, 0},   // bidirectional, hd not a power of two (ViT-like)
        {1, 65, 4, 1, 128, 1, NULL, NULL, 0, 0.0f, 0.0f, 0},  // hd 128, GQA 4
        {1, 64, 2, 2, 128, 0, NULL, NULL, 0, 0.0f, 0.0f, 0},  // bidirectional, T a multiple of the tile
        {3, 5, 2, 1, 8, 1, NULL, NULL, 0, 0.0f, 0.0f, 0},     // shorter than one tile
        {1, 97, 2, 2, 36, 1, NULL, NULL, 0, 0.0f, 0.0f, 0},   // hd 36: partial last register group
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) test_attention(cases[i], &rng, 0);
    // packed examples, ragged tiles
    AttnShape packed[] = {{2, 37, 4, 2, 16, 1, NULL, NULL, 0, 0.0f, 0.0f, 0},
                          {1, 97, 2, 2, 36, 1, NULL, NULL, 0, 0.0f, 0.0f, 0}};
    for (size_t i = 0; i < sizeof(packed) / sizeof(packed[0]); i++) test_attention(packed[i], &rng, 1);
    // sliding windows (key > query - window), the scores' scale, soft-capping that bites (scale 0.5
    // on unit-variance q, k: scores of several units against caps of 2 and 3)
    AttnShape extra[] = {
        {2, 37, 4, 2, 16, 1, NULL, NULL, 9, 0.0f, 0.0f, 0},    // window, GQA
        {1, 97, 2, 2, 36, 1, NULL, NULL, 20, 0.3f, 0.0f, 0},   // window and scale: key blocks of 64 (window rule)
        {1, 70, 3, 1, 64, 1, NULL, NULL, 0, 0.5f, 2.0f, 0},    // scale and soft-cap
        {2, 37, 4, 2, 16, 1, NULL, NULL, 7, 0.4f, 3.0f, 0},    // all three
        {1, 200, 2, 1, 32, 1, NULL, NULL, 50, 0.0f, 0.0f, 0},  // window rule: key blocks of 64, blocks skipped
        {1, 200, 2, 1, 32, 1, NULL, NULL, 0, 0.0f, 0.0f, 50},  // a full layer of a windowed model: its tiles
    };
    int nextra = (int)(sizeof(extra) / sizeof(extra[0]));
    for (int i = 0; i < nextra; i++) test_attention(extra[i], &rng, 0);
    test_attention(extra[0], &rng, 1);  // the window within packed documents
    test_attention(extra[3], &rng, 1);
    test_attention_cached(13, 0, 4, 2, 16, &rng, 0, 0.0f, 0.0f);    // prefill, GQA
    test_attention_cached(1, 200, 3, 1, 64, &rng, 0, 0.0f, 0.0f);   // decode, many keys (more than the block's threads)
    test_attention_cached(2, 37, 2, 2, 128, &rng, 0, 0.0f, 0.0f);   // hd 128
    test_attention_cached(1, 0, 2, 1, 36, &rng, 0, 0.0f, 0.0f);     // the first token
    test_attention_cached(13, 0, 4, 2, 16, &rng, 5, 0.0f, 0.0f);    // prefill, a window shorter than it
    test_attention_cached(1, 200, 3, 1, 64, &rng, 150, 0.0f, 0.0f); // decode, a cache longer than the window
    test_attention_cached(3, 40, 2, 1, 32, &rng, 16, 0.4f, 3.0f);   // window, scale and soft-cap
    // the tensor-core path over many chunks of query rows (ragged last chunk; causal key ranges)
    setenv("LLMC_ATTN_CHUNK", "16", 1);
    settings_read(SETTINGS_AGAIN);  // the table is read once per process otherwise (llmc/settings.h)
    printf("with LLMC_ATTN_CHUNK=16:\n");
    test_attention(cases[0], &rng, 0);
    test_attention(cases[2], &rng, 0);
    test_attention(cases[3], &rng, 0);
    test_attention(packed[1], &rng, 1);
    // key blocks (the rule past ~11k tokens at Llama-3-8B's 32 heads: llmc/memory/cuda_workspace.h),
    // forced at small sizes: the online softmax over several blocks, dq summed over them, causal
    // blocks above the diagonal skipped, ragged last blocks; rows per chunk unequal to keys per block
    printf("with LLMC_ATTN_KEYS=16 LLMC_ATTN_CHUNK=24:\n");
    setenv("LLMC_ATTN_CHUNK", "24", 1);
    setenv("LLMC_ATTN_KEYS", "16", 1);
    settings_read(SETTINGS_AGAIN);
    test_attention(cases[0], &rng, 0);
    test_attention(cases[1], &rng, 0);
    test_attention(cases[2], &rng, 0);
    test_attention(cases[6], &rng, 0);
    test_attention(packed[1], &rng, 1);
    for (int i = 0; i < nextra; i++) test_attention(extra[i], &rng, 0);  // blocks wholly outside a window skipped
    test_attention(extra[3], &rng, 1);
    unsetenv("LLMC_ATTN_CHUNK");
    printf("with LLMC_ATTN_KEYS=32 (square tiles):\n");
    setenv("LLMC_ATTN_KEYS", "32", 1);
    settings_read(SETTINGS_AGAIN);
    test_attention(cases[3], &rng, 0);
    test_attention(cases[4], &rng, 0);
    test_attention(packed[0], &rng, 1);
    unsetenv("LLMC_ATTN_KEYS");
    settings_read(SETTINGS_AGAIN);
    if (g_timing) {
        AttnShape llama = {4, 2048, 32, 8, 128, 1, NULL, NULL, 0, 0.0f, 0.0f, 0},
                  vit = {64, 197, 12, 12, 64, 0, NULL, NULL, 0, 0.0f, 0.0f, 0};
        time_attention(llama, "B=4 T=2048 H=32 KVH=8 hd=128 causal");
        time_attention(vit, "B=64 T=197 H=12 hd=64 bidir (ViT-B/16)");
    }
    return finish();
}
