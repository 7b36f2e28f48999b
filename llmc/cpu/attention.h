// cpu/attention.h: rotary position embedding and flash-style multi-head attention, fp32.
// Layout: q [N, H*hd], k and v [N, KVH*hd], o [N, H*hd], token n = b*T + t, head h at columns
// h*hd; query head h reads kv head h / (H/KVH) (grouped-query attention by index, no copies).
// Forward keeps only o and the per-row log-sum-exp; backward recomputes the scores block by block,
// so no T x T matrix is ever stored.
#pragma once
#include <float.h>
#include <math.h>
#include <stdint.h>
#include "matmul.h"
#include "vec_exp.h"

// Rotate-half RoPE (pairs i, i+hd/2) applied in place to x [N, nheads*hd] at position pos[n]
// (packed examples restart at 0), or n % T when pos is NULL. cos/sin tables are [T, hd/2].
// inverse = 1 applies the transpose rotation (the backward).
static void rope_apply(float* x, const float* cos_t, const float* sin_t, const int* pos, int64_t N, int T, int nheads, int hd, int inverse) {
    int half = hd / 2;
    float sgn = inverse ? -1.0f : 1.0f;
#pragma omp parallel for schedule(static) if (N * nheads * hd > 32768)
    for (int64_t n = 0; n < N; n++) {
        int64_t p = pos ? pos[n] : n % T;
        const float* c = cos_t + p * half;
        const float* s = sin_t + p * half;
        for (int h = 0; h < nheads; h++) {
            float* v = x + n * (int64_t)nheads * hd + (int64_t)h * hd;
            for (int i = 0; i < half; i++) {
                float a = v[i], b = v[i + half], si = sgn * s[i];
                v[i] = a * c[i] - b * si;
                v[i + half] = b * c[i] + a * si;
            }
        }
    }
}

typedef struct {
    int B, T, H, KVH, hd;
    int causal;
    const int* pos;        // [B*T] position of each token within its packed example, or NULL:
                           // a query then sees only keys of its own example (causal only)
} AttnShape;

// First key a causal query (b, t) may see: the start of its example.
static inline int attn_first_key(const AttnShape* s, int b, int t) {
    return s->pos ? t - s->pos[(int64_t)b * s->T + t] : 0;
}

// Attention runs in blocks of ATT_BLOCK query rows (forward, dq) or key rows (dk, dv): each block
// is a few packed products (llmc/cpu/matmul.h, one thread each) on a [block, keys] tile of scores,
// so the work runs at the matrix-product rate and memory stays O(block x T) per thread at any
// sequence length. Each output row belongs to one block and one thread, and every sum runs in a
// fixed order, so results do not depend on the thread count.
#define ATT_BLOCK 64

// Keys [*lo, *hi) that some query of rows [t0, t1) of sequence b may see.
static void attn_key_range(const AttnShape* s, int b, int t0, int t1, int* lo, int* hi) {
    *lo = s->causal ? attn_first_key(s, b, t0) : 0;
    *hi = s->causal ? t1 : s->T;
}
// The keys [*a, *e) query t of sequence b sees (a contiguous range: its example's start up to t).
static inline void attn_visible_range(const AttnShape* s, int b, int t, int* a, int* e) {
    *a = s->causal ? attn_first_key(s, b, t) : 0;
    *e = s->causal ? t + 1 : s->T;
}
// Whether query t of sequence b sees key j.
static inline int attn_visible(const AttnShape* s, int b, int t, int j) {
    return !s->causal || (j <= t && j >= attn_first_key(s, b, t));
}

// o = softmax(q k^T * scale) v per (b, h); lse[b, h, t] = log-sum-exp of the scaled scores.
static void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v, AttnShape s) {
    int64_t qs = (int64_t)s.H * s.hd, ks = (int64_t)s.KVH * s.hd;
    int group = s.H / s.KVH, nqb = (s.T + ATT_BLOCK - 1) / ATT_BLOCK;
    float scale = 1.0f / sqrtf((float)s.hd);
#pragma omp parallel if ((double)s.B * s.H * s.T * s.T * s.hd > (1 << 18))
    {
        float* S = (float*)malloc(sizeof(float) * ATT_BLOCK * s.T);
#pragma omp for collapse(3) schedule(dynamic)
        for (int b = 0; b < s.B; b++)
            for (int h = 0; h < s.H; h++)
                for (int qb = 0; qb < nqb; qb++) {
                    int t0 = qb * ATT_BLOCK, t1 = t0 + ATT_BLOCK < s.T ? t0 + ATT_BLOCK : s.T, kh = h / group, lo, hi;
                    attn_key_range(&s, b, t0, t1, &lo, &hi);
                    int nk = hi - lo;
                    const float* qrow = q + ((int64_t)b * s.T + t0) * qs + (int64_t)h * s.hd;
                    const float* krow = k + ((int64_t)b * s.T + lo) * ks + (int64_t)kh * s.hd;
                    const float* vrow = v + ((int64_t)b * s.T + lo) * ks + (int64_t)kh * s.hd;
                    mm_gemm(S, nk, qrow, qs, 1, krow, 1, ks, t1 - t0, nk, s.hd, scale, 0, 0);  // S = scale q k^T
                    for (int t = t0; t < t1; t++) {
                        float* p = S + (int64_t)(t - t0) * nk;
                        int a, e;
                        attn_visible_range(&s, b, t, &a, &e);
                        float mx = vx_max(p + a - lo, e - a);
                        double sum = vx_exp_shifted(p + a - lo, p + a - lo, e - a, mx);
                        float inv = (float)(1.0 / sum);
                        for (int j = 0; j < nk; j++) p[j] = j >= a - lo && j < e - lo ? p[j] * inv : 0.0f;
                        lse[((int64_t)b * s.H + h) * s.T + t] = mx + (float)log(sum);
                    }
                    mm_gemm(o + ((int64_t)b * s.T + t0) * qs + (int64_t)h * s.hd, qs, S, nk, 1, vrow, ks, 1, t1 - t0, s.hd, nk, 1.0f, 0, 0);
                }
        free(S);
    }
}

// Gradients dq, dk, dv (overwritten) from do, in two passes that each own their outputs: dq by
// blocks of query rows (scores recomputed as in the forward), then dk and dv by blocks of key rows
// of each kv head, summed over the group's query heads in order (the transposed scores recomputed).
// Recomputing the scores twice costs two extra products of the six, and needs no T x T storage and
// no atomic or per-thread partial sums.
static void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                               const float* v, const float* o, const float* lse, AttnShape s) {
    int64_t qs = (int64_t)s.H * s.hd, ks = (int64_t)s.KVH * s.hd;
    int group = s.H / s.KVH, nb = (s.T + ATT_BLOCK - 1) / ATT_BLOCK;
    float scale = 1.0f / sqrtf((float)s.hd);
    int par = (double)s.B * s.H * s.T * s.T * s.hd > (1 << 18);
    float* Dsum = (float*)malloc(sizeof(float) * s.B * s.H * s.T);  // D[b, h, t] = do . o
#pragma omp parallel for collapse(2) schedule(static) if (par)
    for (int b = 0; b < s.B; b++)
        for (int h = 0; h < s.H; h++)
            for (int t = 0; t < s.T; t++) {
                int64_t row = ((int64_t)b * s.T + t) * qs + (int64_t)h * s.hd;
                float D = 0.0f;
                for (int i = 0; i < s.hd; i++) D += dout[row + i] * o[row + i];
                Dsum[((int64_t)b * s.H + h) * s.T + t] = D;
            }
#pragma omp parallel if (par)
    {
        float* S = (float*)malloc(sizeof(float) * ATT_BLOCK * s.T);
        float* dP = (float*)malloc(sizeof(float) * ATT_BLOCK * s.T);
#pragma omp for collapse(3) schedule(dynamic)
        for (int b = 0; b < s.B; b++)
            for (int h = 0; h < s.H; h++)
                for (int qb = 0; qb < nb; qb++) {  // dq = dS k, dS = P (dP - D) scale, dP = do v^T
                    int t0 = qb * ATT_BLOCK, t1 = t0 + ATT_BLOCK < s.T ? t0 + ATT_BLOCK : s.T, kh = h / group, lo, hi;
                    attn_key_range(&s, b, t0, t1, &lo, &hi);
                    int nk = hi - lo;
                    int64_t r0 = ((int64_t)b * s.T + t0) * qs + (int64_t)h * s.hd;
                    const float* krow = k + ((int64_t)b * s.T + lo) * ks + (int64_t)kh * s.hd;
                    const float* vrow = v + ((int64_t)b * s.T + lo) * ks + (int64_t)kh * s.hd;
                    mm_gemm(S, nk, q + r0, qs, 1, krow, 1, ks, t1 - t0, nk, s.hd, scale, 0, 0);
                    mm_gemm(dP, nk, dout + r0, qs, 1, vrow, 1, ks, t1 - t0, nk, s.hd, 1.0f, 0, 0);
                    for (int t = t0; t < t1; t++) {
                        float L = lse[((int64_t)b * s.H + h) * s.T + t], D = Dsum[((int64_t)b * s.H + h) * s.T + t];
                        float *p = S + (int64_t)(t - t0) * nk, *dp = dP + (int64_t)(t - t0) * nk;
                        int a, e;
                        attn_visible_range(&s, b, t, &a, &e);
                        vx_exp_shifted(p + a - lo, p + a - lo, e - a, L);
                        for (int j = 0; j < nk; j++) p[j] = j >= a - lo && j < e - lo ? p[j] * (dp[j] - D) * scale : 0.0f;
                    }
                    mm_gemm(dq + r0, qs, S, nk, 1, krow, ks, 1, t1 - t0, s.hd, nk, 1.0f, 0, 0);
                }
#pragma omp for collapse(3) schedule(dynamic)
        for (int b = 0; b < s.B; b++)
            for (int kh = 0; kh < s.KVH; kh++)
                for (int jb = 0; jb < nb; jb++) {  // dv = P^T do, dk = dS^T q, over the group's heads
                    int j0 = jb * ATT_BLOCK, j1 = j0 + ATT_BLOCK < s.T ? j0 + ATT_BLOCK : s.T;
                    int qlo = s.causal ? j0 : 0, nq = s.T - qlo;  // queries that may see these keys
                    int64_t kr = ((int64_t)b * s.T + j0) * ks + (int64_t)kh * s.hd;
                    for (int h = kh * group; h < (kh + 1) * group; h++) {
                        int64_t r0 = ((int64_t)b * s.T + qlo) * qs + (int64_t)h * s.hd;
                        mm_gemm(S, nq, k + kr, ks, 1, q + r0, 1, qs, j1 - j0, nq, s.hd, scale, 0, 0);     // S^T = scale k q^T
                        mm_gemm(dP, nq, v + kr, ks, 1, dout + r0, 1, qs, j1 - j0, nq, s.hd, 1.0f, 0, 0);  // dP^T = v do^T
                        const float *L = lse + ((int64_t)b * s.H + h) * s.T + qlo, *D = Dsum + ((int64_t)b * s.H + h) * s.T + qlo;
                        for (int j = j0; j < j1; j++) {
                            float *p = S + (int64_t)(j - j0) * nq, *dp = dP + (int64_t)(j - j0) * nq;
                            int t = 0;
                            for (; t + 8 <= nq; t += 8) vx_store(p + t, vx_exp(vx_load(p + t) - vx_load(L + t)));
                            for (; t < nq; t++) p[t] = vx_exp(vx_splat(p[t] - L[t]))[0];
                            for (t = 0; t < nq; t++) {
                                float pj = attn_visible(&s, b, qlo + t, j) ? p[t] : 0.0f;
                                p[t] = pj;
                                dp[t] = pj * (dp[t] - D[t]) * scale;
                            }
                        }
                        int acc = h != kh * group;
                        mm_gemm(dv + kr, ks, S, nq, 1, dout + r0, qs, 1, j1 - j0, s.hd, nq, 1.0f, acc, 0);
                        mm_gemm(dk + kr, ks, dP, nq, 1, q + r0, qs, 1, j1 - j0, s.hd, nq, 1.0f, acc, 0);
                    }
                }
        free(S);
        free(dP);
    }
    free(Dsum);
}

// Attention of n new queries against a key/value cache (generation): q [n, H*hd] at absolute
// positions start .. start+n-1, kc and vc [cap, KVH*hd] holding every position up to start+n-1
// (the new rows included); causal. o [n, H*hd]. No lse: nothing is trained from it.
static void attention_cached(float* o, const float* q, const float* kc, const float* vc, int n, int start, int H, int KVH, int hd) {
    int64_t qs = (int64_t)H * hd, ks = (int64_t)KVH * hd;
    int group = H / KVH;
    float scale = 1.0f / sqrtf((float)hd);
    float* p = (float*)malloc(sizeof(float) * (start + n));
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++) {
            const float* qi = q + t * qs + (int64_t)h * hd;
            int keys = start + t + 1, kh = h / group;
            float mx = -FLT_MAX;
            for (int j = 0; j < keys; j++) {
                const float* kj = kc + j * ks + (int64_t)kh * hd;
                float d = 0.0f;
                for (int i = 0; i < hd; i++) d += qi[i] * kj[i];
                p[j] = d * scale;
                if (p[j] > mx) mx = p[j];
            }
            double sum = 0.0;
            for (int j = 0; j < keys; j++) { p[j] = expf(p[j] - mx); sum += p[j]; }
            float inv = (float)(1.0 / sum), *oi = o + t * qs + (int64_t)h * hd;
            for (int i = 0; i < hd; i++) oi[i] = 0.0f;
            for (int j = 0; j < keys; j++) {
                const float* vj = vc + j * ks + (int64_t)kh * hd;
                for (int i = 0; i < hd; i++) oi[i] += p[j] * inv * vj[i];
            }
        }
    free(p);
}
