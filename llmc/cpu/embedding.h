// cpu/embedding.h: the token embedding of the CPU backend: the gather (forward) and, when the
// embedding is trained (full fine-tuning), the scatter-add of its gradient. fp32.
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
