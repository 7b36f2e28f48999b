// dev/cuda/nf4.cu: the NF4 dequantization kernel of llmc/cuda/nf4.cuh against its CPU twin
// nf4_dequantize (llmc/nf4.h): random weights with varied block scales, quantized on the host,
// dequantized by both; the kernel's bf16 must equal the twin's fp32 rounded to bf16, bit for bit
// (the same fp32 operations, no fused multiply-add on either side). Then times it at LLaMA-7B's
// largest frozen linear (11008 x 4096), where its bf16 output and NF4 input bound it by memory.
#include "check.h"
#include "../../llmc/nf4.h"
#include "../../llmc/cuda/nf4.cuh"

// n weights quantized on the host: the NF4 buffer (host) and its tables.
static void *make_nf4(int64_t n, Rng* rng, float* tables) {
    float* w = host_randn(n, rng, 1.0f, 0);
    for (int64_t b = 0; b < (n + NF4_BLOCK - 1) / NF4_BLOCK; b++) {  // block scales over 6 decades
        float s = powf(10.0f, (float)rng_below(rng, 7) - 4.0f);
        for (int64_t i = b * NF4_BLOCK; i < n && i < (b + 1) * NF4_BLOCK; i++) w[i] *= s;
    }
    if (n > 256) memset(w + 128, 0, sizeof(float) * 64);  // a block of zeros
    nf4_fill_tables(tables);
    void* buf = xcalloc(1, (size_t)nf4_tensor_bytes(n));
    float* absmax = (float*)xmalloc(sizeof(float) * nf4_blocks(n));
    nf4_quantize(nf4_view(buf, n), w, tables, absmax);
    free(absmax);
    free(w);
    return buf;
}

static void test_dequantize(int64_t n, Rng* rng) {
    float tables[NF4_TABLE_FLOATS];
    void* buf = make_nf4(n, rng, tables);
    float* want = (float*)xmalloc(sizeof(float) * n);
    nf4_dequantize(want, nf4_view(buf, n), tables);
    host_round_bf16(want, n);
    void* d_buf = upload(buf, (size_t)nf4_tensor_bytes(n));
    float* d_tables = (float*)upload(tables, sizeof(tables));
    bf16* d_w = (bf16*)dev_alloc(2 * n);
    dev_poison(d_w, 2 * n);
    nf4_dequantize_cuda(d_w, d_buf, d_tables, n, g_stream);
    float* got = download_bf16(d_w, n);
    char name[96];
    snprintf(name, sizeof(name), "nf4_dequantize, n=%lld", (long long)n);
    check_equal_f32(name, got, want, n);
    CUDA_CHECK(cudaFree(d_buf)); CUDA_CHECK(cudaFree(d_tables)); CUDA_CHECK(cudaFree(d_w));
    free(buf); free(want); free(got);
}

static void time_dequantize(Rng* rng) {
    int64_t n = (int64_t)11008 * 4096;
    float tables[NF4_TABLE_FLOATS];
    void* buf = make_nf4(n, rng, tables);
    void* d_buf = upload(buf, (size_t)nf4_tensor_bytes(n));
    float* d_tables = (float*)upload(tables, sizeof(tables));
    bf16* d_w = (bf16*)dev_alloc(2 * n);
    report_bandwidth("nf4_dequantize 11008x4096 -> bf16", (double)nf4_tensor_bytes(n) + 2.0 * n,
                     time_kernel([&] { nf4_dequantize_cuda(d_w, d_buf, d_tables, n, g_stream); }, 10));
    CUDA_CHECK(cudaFree(d_buf)); CUDA_CHECK(cudaFree(d_tables)); CUDA_CHECK(cudaFree(d_w));
    free(buf);
}

int main(void) {
    Rng rng = rng_seeded(17, 15);
    check_begin("dev/cuda/nf4: NF4 dequantization into bf16 vs its CPU twin");
    test_dequantize(1, &rng);
    test_dequantize(63, &rng);
    test_dequantize(64 * 300 + 17, &rng);  // two 256-blocks of absmaxes, a ragged end, odd n
    test_dequantize((int64_t)96 * 257, &rng);
    if (g_timing) time_dequantize(&rng);
    return finish();
}
