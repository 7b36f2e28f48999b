// test/unit/lora_dropout.cu: LoRA dropout's keep mask: its statistics, its regeneration in the
// backward, its independence across linears, steps and rows.
#include "unit.h"
#include "../../llmc/linear.h"

// ---- LoRA dropout (llmc/linear.h, llmc/lora_dropout.h) -----------------------------------------
// On n = 2^20 elements of a constant input: the kept count is Binomial(n, 1 - p), so it lies
// within 6 standard deviations sqrt(n p (1-p)) of n (1-p) but for a chance below 1e-8; the mean
// output is scale * kept / n, so E[output] = 1 (the input) within 6 scale sqrt(p (1-p) / n). The
// backward regenerates the forward's mask: dx += keep * scale * t with t = 1 equals xa bit for bit.
// Behind a norm the input is fmaf(gamma, x, beta). Masks of two linears, two steps or two row
// offsets agree only by chance (in a fraction ~ (1-p)^2 + p^2 of elements, within the same bound).
void test_lora_dropout(float p) {
    const int64_t N = 1024;
    const int in = 1024;
    int64_t n = N * in;
    float *x = (float*)xmalloc(4 * n), *xa = (float*)xmalloc(4 * n), *dx = (float*)xmalloc(4 * n), *t = (float*)xmalloc(4 * n);
    for (int64_t i = 0; i < n; i++) { x[i] = 1.0f; t[i] = 1.0f; dx[i] = 0.0f; }
    LoraDropout d;
    lora_dropout_init(&d, p, 1337, NULL);
    d.step = 5;
    d.row0 = 3 * N;
    d.active = 1;
    Linear L;
    memset(&L, 0, sizeof(L));
    L.in = in;
    lora_dropout_bind(&L, &d, 9);
    lora_dropout_input(xa, x, &L, N);
    double kept = 0, sum = 0;
    for (int64_t i = 0; i < n; i++) { kept += xa[i] != 0.0f; sum += xa[i]; }
    double q = 1.0 - p, sd = sqrt((double)n * p * q);
    char name[96];
    snprintf(name, sizeof(name), "lora dropout p=%g: kept fraction within 6 sd of 1-p", p);
    check(fabs(kept - n * q) <= 6 * sd, name, fabs(kept / n - q));
    snprintf(name, sizeof(name), "lora dropout p=%g: E[output] = input within 6 sd", p);
    check(fabs(sum / n - 1.0) <= 6 * d.scale * sqrt(p * q / n), name, fabs(sum / n - 1.0));
    lora_dropout_input_backward(dx, t, &L, N);
    int same = memcmp(dx, xa, 4 * n) == 0;
    snprintf(name, sizeof(name), "lora dropout p=%g: backward regenerates the forward's mask", p);
    check(same, name, 0);
    // another linear, step or row offset: another mask
    const char* what[3] = {"linear", "step", "row0"};
    for (int k = 0; k < 3; k++) {
        LoraDropout d2 = d;
        Linear L2 = L;
        if (k == 0) L2.drop_id = 10;
        if (k == 1) d2.step = 6;
        if (k == 2) d2.row0 = 4 * N;
        L2.drop = &d2;
        lora_dropout_input(dx, x, &L2, N);
        double agree = 0;
        for (int64_t i = 0; i < n; i++) agree += (dx[i] != 0.0f) == (xa[i] != 0.0f);
        double pa = q * q + (double)p * p, sda = sqrt(n * pa * (1 - pa));
        snprintf(name, sizeof(name), "lora dropout p=%g: another %s, an independent mask", p, what[k]);
        check(fabs(agree - n * pa) <= 6 * sda, name, fabs(agree / n - pa));
    }
    // behind a norm: fmaf(gamma, x, beta) * scale where kept, gamma * scale * t in the backward
    float *g = (float*)xmalloc(4 * in), *b = (float*)xmalloc(4 * in);
    for (int j = 0; j < in; j++) { g[j] = 0.5f + j / 1024.0f; b[j] = 0.25f - j / 4096.0f; }
    L.norm_gamma = g;
    L.norm_beta = b;
    lora_dropout_input(dx, x, &L, N);
    int ok = 1;
    for (int64_t i = 0; i < n && ok; i++) {
        int j = (int)(i % in);
        ok = dx[i] == (xa[i] != 0.0f ? fmaf(g[j], 1.0f, b[j]) * d.scale : 0.0f);
    }
    for (int64_t i = 0; i < n; i++) dx[i] = 0.0f;
    lora_dropout_input_backward(dx, t, &L, N);
    for (int64_t i = 0; i < n && ok; i++) ok = dx[i] == (xa[i] != 0.0f ? fmaf(d.scale, g[i % in], 0.0f) : 0.0f);
    snprintf(name, sizeof(name), "lora dropout p=%g: behind a norm, the same mask on gamma*x+beta", p);
    check(ok, name, 0);
    free(x); free(xa); free(dx); free(t); free(g); free(b);
}
