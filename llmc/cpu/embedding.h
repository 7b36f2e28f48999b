// cpu/embedding.h: the token embedding of the CPU backend: the gather (forward) and, when the
// embedding is trained (full fine-tuning), the scatter-add of its gradient; and ViT's patch
// embedding around its product: the unfold into patch rows, the class token, patch bias and
// positions, and their gradient. fp32.
#pragma once
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

// x[n] = embed[ids[n]] (rows of d).
static void embed_tokens(float* x, const float* embed, const int* ids, int64_t N, int d) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) memcpy(x + n * d, embed + (int64_t)ids[n] * d, sizeof(float) * d);
}

static int emb_key_cmp(const void* a, const void* b) {
    int64_t x = *(const int64_t*)a, y = *(const int64_t*)b;
    return (x > y) - (x < y);
}

// order = the token positions 0..N-1 sorted by id, then by position: the tokens of one embedding
// row lie together, in text order. Computed on the host from the batch (both backends use it).
static void embedding_token_order(int* order, const int* ids, int64_t N) {
    int64_t* key = (int64_t*)malloc(sizeof(int64_t) * (N > 0 ? N : 1));  // id * N + n
    if (!key) { fprintf(stderr, "error: out of host memory in embedding_token_order\n"); exit(1); }
    for (int64_t n = 0; n < N; n++) key[n] = (int64_t)ids[n] * N + n;
    qsort(key, (size_t)N, sizeof(int64_t), emb_key_cmp);
    for (int64_t n = 0; n < N; n++) order[n] = (int)(key[n] % N);
    free(key);
}

// dE[v] += (the sum of dx[n] over the tokens with ids[n] == v, in text order), order from
// embedding_token_order. Each row's sum is formed first and added once: a gradient accumulated over
// micro-batches is then (0 + s1) + s2, the same bits as data parallelism's all-reduce of the
// ranks' s1 and s2, and no result depends on the thread count (rows in parallel). skip_id >= 0: that
// row gets nothing (transformers' padding_idx, whose row nn.Embedding leaves without a gradient).
static void embedding_backward(float* dE, const float* dx, const int* ids, const int* order, int64_t N, int d,
                               int skip_id = -1) {
#pragma omp parallel if (N * d > 32768)
    {
        float* s = (float*)malloc(sizeof(float) * (d > 0 ? d : 1));
#pragma omp for schedule(dynamic, 16)
        for (int64_t g = 0; g < N; g++) {
            int v = ids[order[g]];
            if ((g > 0 && ids[order[g - 1]] == v) || v == skip_id) continue;  // not the first token of its row
            memset(s, 0, sizeof(float) * d);
            for (int64_t e = g; e < N && ids[order[e]] == v; e++) {
                const float* x = dx + (int64_t)order[e] * d;
                for (int i = 0; i < d; i++) s[i] += x[i];
            }
            float* row = dE + (int64_t)v * d;
            for (int i = 0; i < d; i++) row[i] += s[i];
        }
        free(s);
    }
}

// Images [B, C, H, W] -> patch rows [B*T, C*ph*pw], T = 1 + (H/ph)*(W/pw): token t = 1 + py*gw + px
// holds patch (py, px) unfolded in the conv kernel's (c, i, j) order; the class token's row (t = 0)
// is zero, so the patch product lands straight in the residual stream.
static void patch_unfold(float* patches, const float* pixels, int B, int C, int H, int W, int ph, int pw) {
    int gw = W / pw, T = 1 + (H / ph) * gw;
    int64_t P = (int64_t)C * ph * pw, N = (int64_t)B * T;
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float* row = patches + n * P;
        int b = (int)(n / T), t = (int)(n % T);
        if (t == 0) { memset(row, 0, sizeof(float) * P); continue; }
        int py = (t - 1) / gw, px = (t - 1) % gw;
        for (int ch = 0; ch < C; ch++)
            for (int i = 0; i < ph; i++)
                memcpy(row + ((int64_t)ch * ph + i) * pw,
                       pixels + (((int64_t)b * C + ch) * H + py * ph + i) * W + px * pw, sizeof(float) * pw);
    }
}

// After the patch product x [N, d] (N = B*T): x[b, 0] = cls + pos[0] (the class token);
// x[b, t] += patch_b + pos[t] for the patches (t > 0).
static void patch_embed_finish(float* x, const float* cls, const float* patch_b, const float* pos, int64_t N, int T,
                               int d) {
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) {
        float* xr = x + n * d;
        int64_t t = n % T;
        const float* p = pos + t * d;
        if (t == 0) for (int i = 0; i < d; i++) xr[i] = cls[i] + p[i];
        else for (int i = 0; i < d; i++) xr[i] += patch_b[i] + p[i];
    }
}

// The ViT embeddings' gradient from dx [N, d] (N = B*T, token 0 of each image the class token):
// dcls += sum_b dx[b, 0], dpos[t] += sum_b dx[b, t], dpatch_b += the sum over every patch row
// (t > 0). Columns in parallel, images in order.
static void patch_embed_finish_backward(float* dcls, float* dpatch_b, float* dpos, const float* dx, int64_t N, int T,
                                        int d) {
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
