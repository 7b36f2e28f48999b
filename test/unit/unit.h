// test/unit/unit.h: the harness of the C unit tests (make test-c): check() counts and prints one
// line per check; randn and rel_err serve every file. Each test/unit/<concern>.cu tests one concern
// against independent references; test/unit/main.cu runs them all in one order and prints
// "N passed, M failed". A new file here joins the program by itself (the Makefile takes every
// test/unit/*.cu); its tests are declared below and called from main.
#pragma once
#include "../../llmc/common.h"
#include "../../llmc/rng.h"

extern int g_pass, g_fail;
void check(int ok, const char* what, double err);

static float* randn(int64_t n, Rng* r, float scale) {
    float* x = (float*)xmalloc(sizeof(float) * n);
    for (int64_t i = 0; i < n; i++) x[i] = scale * rng_normal(r);
    return x;
}

// max |a-b| / max(max|b|, tiny)
static double rel_err(const float* a, const double* b, int64_t n) {
    double e = 0, m = 1e-30;
    for (int64_t i = 0; i < n; i++) {
        if (isnan(a[i])) return INFINITY;
        e = fmax(e, fabs(a[i] - b[i]));
        m = fmax(m, fabs(b[i]));
    }
    return e / m;
}

// activations.cu
void test_pack_roundtrip(void);
void test_resilu2_backward(void);
void test_regelu2_backward(void);

// norms.cu
void test_norm_backward(int layernorm);
void test_norm_huge_rows(int layernorm);

// matmul.cu
void test_matmul(void);
void test_matmul_shapes(void);

// attention.cu
void test_attention(int causal);
void test_attention_blocks(void);
void test_rope(void);

// vec_math.cu
void test_vec_exp(void);
void test_vec_erf(void);
void test_vec_gelu(void);

// loss.cu
void test_chunked_loss(void);

// formats.cu
void test_safetensors_roundtrip(void);
void test_crc32(void);
void test_json(void);

// memory.cu
void test_grad_buckets(void);
void test_plan_alignment(void);

// lora_dropout.cu
void test_lora_dropout(float p);
