// test/unit/loss.cu: the chunked LM head + cross-entropy against the full-logits loss and finite
// differences.
#include "unit.h"
#include "../../llmc/cpu/loss.h"

// ---- chunked loss --------------------------------------------------------------------------

void test_chunked_loss(void) {
    Rng r = rng_seeded(10, 0);
    int N = 23, d = 16, V = 37;
    float *x = randn(N * d, &r, 1), *gamma = randn(d, &r, 0.2f), *W = randn(V * d, &r, 0.5f);
    for (int i = 0; i < d; i++) gamma[i] += 1.0f;
    int* tg = (int*)xmalloc(sizeof(int) * N);
    float* mask = (float*)xmalloc(sizeof(float) * N);
    for (int i = 0; i < N; i++) { tg[i] = (int)rng_below(&r, V); mask[i] = (i % 5 == 2) ? 0.0f : 1.0f; }
    float* dx[2];
    LossStats st[2];
    int chunks[2] = {N, 4};
    for (int c = 0; c < 2; c++) {
        LossScratch sc = {(float*)xmalloc(sizeof(float) * N * d), (float*)xmalloc(sizeof(float) * N), (float*)xmalloc(sizeof(float) * N * V),
                          (float*)xmalloc(sizeof(float) * N * d)};
        dx[c] = (float*)xcalloc(N * d, sizeof(float));
        memset(&st[c], 0, sizeof(LossStats));
        lm_head_loss(x, gamma, 1e-5f, W, V, d, tg, mask, N, chunks[c], 1.0f / 18, dx[c], NULL, sc, &st[c]);
        free(sc.z); free(sc.r); free(sc.logits); free(sc.dz);
    }
    // independent reference: the full logits matrix in double
    double loss = 0, cnt = 0;
    for (int n = 0; n < N; n++) {
        double ss = 0;
        for (int i = 0; i < d; i++) ss += (double)x[n * d + i] * x[n * d + i];
        double rr = 1.0 / sqrt(ss / d + 1e-5), mx = -1e300, lg[64], sum = 0;
        for (int v = 0; v < V; v++) {
            lg[v] = 0;
            for (int i = 0; i < d; i++) lg[v] += x[n * d + i] * rr * gamma[i] * W[v * d + i];
            mx = fmax(mx, lg[v]);
        }
        for (int v = 0; v < V; v++) sum += exp(lg[v] - mx);
        if (mask[n] != 0) { loss += mx + log(sum) - lg[tg[n]]; cnt += 1; }
    }
    double e1 = fabs(st[0].loss_sum - loss) / loss, e2 = fabs(st[1].loss_sum - loss) / loss;
    check(fmax(e1, e2) < 1e-5 && st[0].count == cnt && st[1].count == cnt, "chunked LM head + CE equals the full-logits loss (mask honoured)", fmax(e1, e2));
    double de = 0, dm = 0;
    for (int i = 0; i < N * d; i++) { de = fmax(de, fabs(dx[0][i] - dx[1][i])); dm = fmax(dm, fabs(dx[0][i])); }
    check(de / dm < 1e-6, "chunk size does not change the head gradient", de / dm);
    // finite differences on a few inputs of the loss (sum / 18)
    double ge = 0;
    LossScratch sc = {(float*)xmalloc(sizeof(float) * N * d), (float*)xmalloc(sizeof(float) * N), (float*)xmalloc(sizeof(float) * N * V),
                      (float*)xmalloc(sizeof(float) * N * d)};
    for (int i = 0; i < N * d; i += 7) {
        float keep = x[i], h = 1e-2f;
        LossStats a = {}, b = {};
        x[i] = keep + h;
        lm_head_loss(x, gamma, 1e-5f, W, V, d, tg, mask, N, 5, 0, NULL, NULL, sc, &a);
        x[i] = keep - h;
        lm_head_loss(x, gamma, 1e-5f, W, V, d, tg, mask, N, 5, 0, NULL, NULL, sc, &b);
        x[i] = keep;
        ge = fmax(ge, fabs((a.loss_sum - b.loss_sum) / (2 * h) / 18 - dx[0][i]));
    }
    check(ge / dm < 5e-3, "fused head gradient (final RMSNorm included) matches finite differences", ge / dm);
    free(sc.z); free(sc.r); free(sc.logits); free(sc.dz);
    free(x); free(gamma); free(W); free(tg); free(mask); free(dx[0]); free(dx[1]);
}
