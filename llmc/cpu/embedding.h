// cpu/embedding.h: the token embedding of the CPU backend: the gather (forward) and, when the
// embedding is trained (full fine-tuning), the scatter-add of its gradient; and the gradient of
// ViT's class token, patch bias and positions. fp32.
#pragma once
#include <stdint.h>
#include <string.h>

// x[n] = embed[ids[n]] (rows of d).
static void embed_tokens(float* x, const float* embed, const int* ids, int64_t N, int d) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) memcpy(x + n * d, embed + (int64_t)ids[n] * d, sizeof(float) * d);
}

// dE[ids[n]] += dx[n]. Columns in parallel, tokens in order: repeated ids add up deterministically.
static void embedding_backward(float* dE, const float* dx, const int* ids, int64_t N, int d) {
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int i = 0; i < d; i++)
        for (int64_t n = 0; n < N; n++) dE[(int64_t)ids[n] * d + i] += dx[n * d + i];
}

// The ViT embeddings' gradient from dx [N, d] (N = B*T, token 0 of each image the class token):
// dcls += sum_b dx[b, 0], dpos[t] += sum_b dx[b, t], dpatch_b += the sum over every patch row
// (t > 0). Columns in parallel, images in order.
static void patch_embed_finish_backward(float* dcls, float* dpatch_b, float* dpos, const float* dx, int64_t N, int T, int d) {
    int64_t B = N / T;
#pragma omp parallel for schedule(static) if (N * d > 32768)
    for (int c = 0; c < d; c++) {
        double sb = 0.0;
        for (int64_t t = 0; t < T; t++) {
            double s = 0.0;
            for (int64_t b = 0; b < B; b++) s += dx[(b * T + t) * d + c];
            dpos[t * d + c] += (float)s;
            if (t == 0) dcls[c] += (float)s;
            else sb += s;
        }
        dpatch_b[c] += (float)sb;
    }
}
