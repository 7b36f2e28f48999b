// dev/cuda/activations.cu: SwiGLU and GELU of llmc/cuda/activations.cuh, exact and 2-bit
// (ReSiLU2 / ReGELU2), against llmc/cpu/activations.h at ragged sizes (n % 4 != 0), with inputs
// planted at the bf16 neighbours of every kink c1..c3 of the fits. The 2-bit path must agree
// EXACTLY: the packed code bytes byte for byte, and the approximate backward bit for bit (both
// sides form dy * level in fp32 from identical inputs, so the bf16 result cannot differ).
// SwiGLU's and GELU's production kernels (16-byte vectors where aligned, one code byte at a time
// where not) give the bytes of the scalar reference kernels (activations_scalar.cuh) exactly, on
// aligned buffers and misaligned ones.
// Then times each kernel at a LLaMA-7B MLP shape against HBM bandwidth.
#include "check.h"
#include "../../llmc/cpu/activations.h"
#include "../../llmc/cuda/activations.cuh"
#include "activations_scalar.cuh"  // the scalar kernels: the reference version the trainers no longer run

// Random bf16 inputs, with the first values set to the bf16 numbers just below, at and just above
// each kink of `fit` (and zero), where the strict `>` of the code rule decides.
static float* kink_inputs(int64_t n, Rng* rng, float scale, Relu3Fit fit) {
    float* x = host_randn(n, rng, scale, 1);
    float kinks[3] = {fit.c1, fit.c2, fit.c3};
    int64_t k = 0;
    for (int j = 0; j < 3 && k + 3 <= n; j++) {
        __nv_bfloat16_raw raw = __float2bfloat16(kinks[j]);
        for (int dlt = -1; dlt <= 1; dlt++) {  // the adjacent bf16 values (either sign: one step of the bit pattern)
            __nv_bfloat16_raw nb = raw;
            nb.x = (unsigned short)(raw.x + dlt);
            x[k++] = __bfloat162float(bf16(nb));
        }
    }
    if (k < n) x[k++] = 0.0f;
    if (k < n) x[k++] = -0.0f;
    return x;
}

static void test_swiglu(int64_t n, Rng* rng, int approx) {
    Relu3Fit fit = RESILU2_FIT;
    float *g = kink_inputs(n, rng, 3.0f, fit), *u = host_randn(n, rng, 1.0f, 1);
    float *p = (float*)xmalloc(4 * n), *sg = (float*)xmalloc(4 * n);
    int64_t nb = packed_codes_bytes(n);
    uint8_t* codes = (uint8_t*)xmalloc(nb);
    swiglu_forward(p, sg, approx ? codes : NULL, g, u, n);
    bf16 *d_g = upload_bf16(g, n), *d_u = upload_bf16(u, n), *d_p = (bf16*)dev_alloc(2 * n),
         *d_sg = (bf16*)dev_alloc(2 * n);
    uint8_t* d_codes = (uint8_t*)dev_alloc(nb);
    dev_poison(d_p, 2 * n);
    dev_poison(d_sg, 2 * n);
    dev_poison(d_codes, nb);
    swiglu_forward_cuda(d_p, d_sg, approx ? d_codes : NULL, d_g, d_u, n, g_stream);
    float *gp = download_bf16(d_p, n), *gsg = download_bf16(d_sg, n);
    char name[128];
    const char* kind = approx ? "ReSiLU2" : "exact";
    snprintf(name, sizeof(name), "swiglu_forward %s p, n=%lld", kind, (long long)n);
    check_close(name, gp, p, n, 1e-2);
    snprintf(name, sizeof(name), "swiglu_forward %s silu(g), n=%lld", kind, (long long)n);
    check_close(name, gsg, sg, n, 1e-2);
    uint8_t* gcodes = download_bytes(d_codes, nb);
    if (approx) {
        snprintf(name, sizeof(name), "swiglu_forward ReSiLU2 codes, n=%lld", (long long)n);
        check_equal_bytes(name, gcodes, codes, nb);
    }

    // backward from the forward's kept tensors: silu(g) and u (bf16), g (exact) or codes (approx)
    float *dp = host_randn(n, rng, 1.0f, 1), *dg = (float*)xmalloc(4 * n), *du = (float*)xmalloc(4 * n);
    float* sg16 = host_copy(sg, n);
    host_round_bf16(sg16, n);
    swiglu_backward(dg, du, dp, sg16, u, approx ? NULL : g, codes, n);
    bf16 *d_dp = upload_bf16(dp, n), *d_sg16 = upload_bf16(sg16, n), *d_dg = (bf16*)dev_alloc(2 * n),
         *d_du = (bf16*)dev_alloc(2 * n);
    dev_poison(d_dg, 2 * n);
    dev_poison(d_du, 2 * n);
    // the GPU backward reads the GPU's own codes (identical to the CPU's if the check above passed)
    swiglu_backward_cuda(d_dg, d_du, d_dp, d_sg16, d_u, approx ? NULL : d_g, approx ? d_codes : NULL, n, g_stream);
    float *gdg = download_bf16(d_dg, n), *gdu = download_bf16(d_du, n);
    if (approx) {
        host_round_bf16(dg, n);
        host_round_bf16(du, n);
        snprintf(name, sizeof(name), "swiglu_backward ReSiLU2 dg bit-exact, n=%lld", (long long)n);
        check_equal_f32(name, gdg, dg, n);
        snprintf(name, sizeof(name), "swiglu_backward ReSiLU2 du bit-exact, n=%lld", (long long)n);
        check_equal_f32(name, gdu, du, n);
    } else {
        snprintf(name, sizeof(name), "swiglu_backward exact dg, n=%lld", (long long)n);
        check_close(name, gdg, dg, n, 1e-2);
        snprintf(name, sizeof(name), "swiglu_backward exact du, n=%lld", (long long)n);
        check_close(name, gdu, du, n, 1e-2);
    }
    // the default (16-byte vectors where aligned) against the scalar kernels it replaced, bit for
    // bit, from the same inputs: on aligned buffers (above) and 1 element into each allocation
    // (misaligned: the production kernel must take its per-byte path, or the emulator stops)
    for (int off = 0; off < 2; off++) {
        int64_t m = n + off;
        bf16 *e_g = (bf16*)dev_alloc(2 * m) + off, *e_u = (bf16*)dev_alloc(2 * m) + off,
             *e_dp = (bf16*)dev_alloc(2 * m) + off, *e_sg16 = (bf16*)dev_alloc(2 * m) + off;
        upload_bf16_to(e_g, g, n); upload_bf16_to(e_u, u, n);
        upload_bf16_to(e_dp, dp, n); upload_bf16_to(e_sg16, sg16, n);
        bf16 *outs[2][4];
        uint8_t* ecodes[2];
        for (int k = 0; k < 2; k++) {
            KernelChoice impl = k ? KERNELS_SCALAR : KERNELS_VEC;
            for (int o = 0; o < 4; o++) { outs[k][o] = (bf16*)dev_alloc(2 * m) + off; dev_poison(outs[k][o], 2 * n); }
            ecodes[k] = (uint8_t*)dev_alloc(nb);
            dev_poison(ecodes[k], nb);
            swiglu_forward_launch(impl, outs[k][0], outs[k][1], approx ? ecodes[k] : NULL, e_g, e_u, n, g_stream);
            swiglu_backward_launch(impl, outs[k][2], outs[k][3], e_dp, e_sg16, e_u, approx ? NULL : e_g,
                                   approx ? ecodes[k] : NULL, n, g_stream);
        }
        const char* what[4] = {"p", "silu(g)", "dg", "du"};
        for (int o = 0; o < 4; o++) {
            uint8_t *a = download_bytes(outs[0][o], 2 * n), *b = download_bytes(outs[1][o], 2 * n);
            snprintf(name, sizeof(name), "swiglu %s %s: vec = scalar kernel, n=%lld +%d", kind, what[o], (long long)n,
                     off);
            check_equal_bytes(name, a, b, 2 * n);
            free(a); free(b);
        }
        if (approx) {
            uint8_t *a = download_bytes(ecodes[0], nb), *b = download_bytes(ecodes[1], nb);
            snprintf(name, sizeof(name), "swiglu ReSiLU2 codes: vec = scalar kernel, n=%lld +%d", (long long)n, off);
            check_equal_bytes(name, a, b, nb);
            free(a); free(b);
        }
        for (int k = 0; k < 2; k++) {
            for (int o = 0; o < 4; o++) CUDA_CHECK(cudaFree(outs[k][o] - off));
            CUDA_CHECK(cudaFree(ecodes[k]));
        }
        CUDA_CHECK(cudaFree(e_g - off)); CUDA_CHECK(cudaFree(e_u - off)); CUDA_CHECK(cudaFree(e_dp - off));
        CUDA_CHECK(cudaFree(e_sg16 - off));
    }
    CUDA_CHECK(cudaFree(d_g)); CUDA_CHECK(cudaFree(d_u)); CUDA_CHECK(cudaFree(d_p)); CUDA_CHECK(cudaFree(d_sg));
    CUDA_CHECK(cudaFree(d_codes)); CUDA_CHECK(cudaFree(d_dp)); CUDA_CHECK(cudaFree(d_sg16)); CUDA_CHECK(cudaFree(d_dg));
    CUDA_CHECK(cudaFree(d_du));
    free(g); free(u); free(p); free(sg); free(codes); free(gp); free(gsg); free(gcodes); free(dp); free(dg); free(du);
    free(sg16); free(gdg); free(gdu);
}

// mode 0: exact erf, 1: exact tanh, 2: ReGELU2. inplace: the backward writes over dy.
static void test_gelu(int64_t n, Rng* rng, int mode, int inplace) {
    Relu3Fit fit = REGELU2_FIT;
    int approx = mode == 2, tanh_form = mode == 1;
    float *x = kink_inputs(n, rng, 2.0f, fit), *y = (float*)xmalloc(4 * n);
    int64_t nb = packed_codes_bytes(n);
    uint8_t* codes = (uint8_t*)xmalloc(nb);
    gelu_forward(y, approx ? codes : NULL, x, n, tanh_form);
    bf16 *d_x = upload_bf16(x, n), *d_y = (bf16*)dev_alloc(2 * n);
    uint8_t* d_codes = (uint8_t*)dev_alloc(nb);
    dev_poison(d_y, 2 * n);
    dev_poison(d_codes, nb);
    gelu_forward_cuda(d_y, approx ? d_codes : NULL, d_x, n, tanh_form, g_stream);
    float* gy = download_bf16(d_y, n);
    char name[128];
    const char* kind = mode == 0 ? "erf" : mode == 1 ? "tanh" : "ReGELU2";
    snprintf(name, sizeof(name), "gelu_forward %s y, n=%lld", kind, (long long)n);
    check_close(name, gy, y, n, 1e-2);
    uint8_t* gcodes = download_bytes(d_codes, nb);
    if (approx) {
        snprintf(name, sizeof(name), "gelu_forward ReGELU2 codes, n=%lld", (long long)n);
        check_equal_bytes(name, gcodes, codes, nb);
    }
    float *dy = host_randn(n, rng, 1.0f, 1), *dx = (float*)xmalloc(4 * n);
    gelu_backward(dx, dy, approx ? NULL : x, codes, n, tanh_form);
    bf16 *d_dy = upload_bf16(dy, n), *d_dx = inplace ? d_dy : (bf16*)dev_alloc(2 * n);
    if (!inplace) dev_poison(d_dx, 2 * n);
    gelu_backward_cuda(d_dx, d_dy, approx ? NULL : d_x, approx ? d_codes : NULL, n, tanh_form, g_stream);
    float* gdx = download_bf16(d_dx, n);
    if (approx) {
        host_round_bf16(dx, n);
        snprintf(name, sizeof(name), "gelu_backward ReGELU2 dx bit-exact%s, n=%lld", inplace ? " (in place)" : "",
                 (long long)n);
        check_equal_f32(name, gdx, dx, n);
    } else {
        snprintf(name, sizeof(name), "gelu_backward %s dx%s, n=%lld", kind, inplace ? " (in place)" : "", (long long)n);
        check_close(name, gdx, dx, n, 1e-2);
    }
    // the default (16-byte vectors where aligned) against the scalar kernels, bit for bit: aligned,
    // and 1 element into each allocation (the production kernel must take its per-byte path)
    for (int off = 0; off < 2; off++) {
        bf16 *e_x = (bf16*)dev_alloc(2 * (n + off)) + off, *out[2][2];
        uint8_t* ecodes[2];
        upload_bf16_to(e_x, x, n);
        for (int k = 0; k < 2; k++) {
            KernelChoice impl = k ? KERNELS_SCALAR : KERNELS_VEC;
            out[k][0] = (bf16*)dev_alloc(2 * (n + off)) + off;
            out[k][1] = (bf16*)dev_alloc(2 * (n + off)) + off;
            ecodes[k] = (uint8_t*)dev_alloc(nb);
            dev_poison(out[k][0], 2 * n);
            dev_poison(ecodes[k], nb);
            upload_bf16_to(out[k][1], dy, n);  // the backward in place, dx = dy's buffer, as the models run it
            gelu_forward_launch(impl, out[k][0], approx ? ecodes[k] : NULL, e_x, n, tanh_form, g_stream);
            gelu_backward_launch(impl, out[k][1], out[k][1], approx ? NULL : e_x, approx ? ecodes[k] : NULL, n,
                                 tanh_form, g_stream);
        }
        for (int o = 0; o < 2; o++) {
            uint8_t *a = download_bytes(out[0][o], 2 * n), *b = download_bytes(out[1][o], 2 * n);
            snprintf(name, sizeof(name), "gelu %s %s: vec = scalar kernel, n=%lld +%d", kind, o ? "dx" : "y",
                     (long long)n, off);
            check_equal_bytes(name, a, b, 2 * n);
            free(a); free(b);
        }
        for (int k = 0; k < 2; k++) {
            CUDA_CHECK(cudaFree(out[k][0] - off)); CUDA_CHECK(cudaFree(out[k][1] - off));
            CUDA_CHECK(cudaFree(ecodes[k]));
        }
        CUDA_CHECK(cudaFree(e_x - off));
    }
    CUDA_CHECK(cudaFree(d_x)); CUDA_CHECK(cudaFree(d_y)); CUDA_CHECK(cudaFree(d_codes)); CUDA_CHECK(cudaFree(d_dy));
    if (!inplace) CUDA_CHECK(cudaFree(d_dx));
    free(x); free(y); free(codes); free(gy); free(gcodes); free(dy); free(dx); free(gdx);
}

static void time_activations(void) {
    int64_t n = (int64_t)8192 * 11008;  // tokens x LLaMA-7B hidden
    bf16 *g = (bf16*)dev_alloc(2 * n), *u = (bf16*)dev_alloc(2 * n), *p = (bf16*)dev_alloc(2 * n),
         *sg = (bf16*)dev_alloc(2 * n);
    bf16 *dg = (bf16*)dev_alloc(2 * n), *du = (bf16*)dev_alloc(2 * n);
    uint8_t* codes = (uint8_t*)dev_alloc(packed_codes_bytes(n));
    CUDA_CHECK(cudaMemset(g, 0x3f, 2 * n));
    CUDA_CHECK(cudaMemset(u, 0x3f, 2 * n));
    double c = (double)packed_codes_bytes(n);
    report_bandwidth("swiglu_forward ReSiLU2 8192x11008",
                     2.0 * n * 4 + c, time_kernel([&] { swiglu_forward_cuda(p, sg, codes, g, u, n, g_stream); }, 10));
    report_bandwidth("swiglu_backward ReSiLU2 8192x11008", 2.0 * n * 5 + c,
                     time_kernel([&] { swiglu_backward_cuda(dg, du, p, sg, u, NULL, codes, n, g_stream); }, 10));
    report_bandwidth("swiglu_backward exact 8192x11008", 2.0 * n * 6,
                     time_kernel([&] { swiglu_backward_cuda(dg, du, p, sg, u, g, NULL, n, g_stream); }, 10));
    report_bandwidth("gelu_forward ReGELU2 8192x11008",
                     2.0 * n * 2 + c, time_kernel([&] { gelu_forward_cuda(p, codes, g, n, 0, g_stream); }, 10));
    report_bandwidth("gelu_backward ReGELU2 8192x11008",
                     2.0 * n * 2 + c, time_kernel([&] { gelu_backward_cuda(dg, p, NULL, codes, n, 0, g_stream); }, 10));
    CUDA_CHECK(cudaFree(g)); CUDA_CHECK(cudaFree(u)); CUDA_CHECK(cudaFree(p)); CUDA_CHECK(cudaFree(sg));
    CUDA_CHECK(cudaFree(dg)); CUDA_CHECK(cudaFree(du)); CUDA_CHECK(cudaFree(codes));
}

int main(void) {
    Rng rng = rng_seeded(7, 2);
    check_begin("dev/cuda/activations: SwiGLU / GELU, exact and 2-bit, vs llmc/cpu/activations.h");
    int64_t sizes[] = {1, 3, 14, 1001, 4099, 65537};
    for (int i = 0; i < 6; i++) {
        for (int approx = 0; approx < 2; approx++) test_swiglu(sizes[i], &rng, approx);
        for (int mode = 0; mode < 3; mode++) test_gelu(sizes[i], &rng, mode, 0);
    }
    for (int mode = 0; mode < 3; mode++) test_gelu(4099, &rng, mode, 1);
    if (g_timing) time_activations();
    return finish();
}
