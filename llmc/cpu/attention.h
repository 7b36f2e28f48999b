// cpu/attention.h: rotary position embedding and flash-style multi-head attention, fp32.
// Layout: q [N, H*hd], k and v [N, KVH*hd], o [N, H*hd], token n = b*T + t, head h at columns
// h*hd; query head h reads kv head h / (H/KVH) (grouped-query attention by index, no copies).
// Forward keeps only o and the per-row log-sum-exp; backward recomputes the scores row by row,
// so no T x T matrix is ever stored.
#pragma once
#include <float.h>
#include <math.h>
#include <stdint.h>

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

// o = softmax(q k^T * scale) v per (b, h); lse[b, h, t] = log-sum-exp of the scaled scores.
static void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v, AttnShape s) {
    int64_t qs = (int64_t)s.H * s.hd, ks = (int64_t)s.KVH * s.hd;
    int group = s.H / s.KVH;
    float scale = 1.0f / sqrtf((float)s.hd);
#pragma omp parallel for collapse(2) schedule(dynamic) if ((double)s.B * s.H * s.T * s.T * s.hd > (1 << 18))
    for (int b = 0; b < s.B; b++)
        for (int h = 0; h < s.H; h++) {
            float* p = (float*)malloc(sizeof(float) * s.T);
            int kh = h / group;
            for (int t = 0; t < s.T; t++) {
                const float* qi = q + ((int64_t)b * s.T + t) * qs + (int64_t)h * s.hd;
                int tend = s.causal ? t + 1 : s.T, j0 = s.causal ? attn_first_key(&s, b, t) : 0;
                float mx = -FLT_MAX;
                for (int j = j0; j < tend; j++) {
                    const float* kj = k + ((int64_t)b * s.T + j) * ks + (int64_t)kh * s.hd;
                    float d = 0.0f;
                    for (int i = 0; i < s.hd; i++) d += qi[i] * kj[i];
                    p[j] = d * scale;
                    if (p[j] > mx) mx = p[j];
                }
                double sum = 0.0;
                for (int j = j0; j < tend; j++) { p[j] = expf(p[j] - mx); sum += p[j]; }
                float inv = (float)(1.0 / sum);
                float* oi = o + ((int64_t)b * s.T + t) * qs + (int64_t)h * s.hd;
                for (int i = 0; i < s.hd; i++) oi[i] = 0.0f;
                for (int j = j0; j < tend; j++) {
                    const float* vj = v + ((int64_t)b * s.T + j) * ks + (int64_t)kh * s.hd;
                    float w = p[j] * inv;
                    for (int i = 0; i < s.hd; i++) oi[i] += w * vj[i];
                }
                lse[((int64_t)b * s.H + h) * s.T + t] = mx + (float)log(sum);
            }
            free(p);
        }
}

// Gradients dq, dk, dv (overwritten) from do. Parallel over (b, kv head): all query heads of a
// group write the same dk/dv rows, so they belong to one thread.
static void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                               const float* v, const float* o, const float* lse, AttnShape s) {
    int64_t qs = (int64_t)s.H * s.hd, ks = (int64_t)s.KVH * s.hd;
    int group = s.H / s.KVH;
    float scale = 1.0f / sqrtf((float)s.hd);
#pragma omp parallel for collapse(2) schedule(dynamic) if ((double)s.B * s.H * s.T * s.T * s.hd > (1 << 18))
    for (int b = 0; b < s.B; b++)
        for (int kh = 0; kh < s.KVH; kh++) {
            for (int t = 0; t < s.T; t++) {
                memset(dk + ((int64_t)b * s.T + t) * ks + (int64_t)kh * s.hd, 0, sizeof(float) * s.hd);
                memset(dv + ((int64_t)b * s.T + t) * ks + (int64_t)kh * s.hd, 0, sizeof(float) * s.hd);
            }
            for (int h = kh * group; h < (kh + 1) * group; h++)
                for (int t = 0; t < s.T; t++) {
                    int64_t row = ((int64_t)b * s.T + t) * qs + (int64_t)h * s.hd;
                    const float *qi = q + row, *doi = dout + row, *oi = o + row;
                    float* dqi = dq + row;
                    float D = 0.0f, L = lse[((int64_t)b * s.H + h) * s.T + t];
                    for (int i = 0; i < s.hd; i++) { D += doi[i] * oi[i]; dqi[i] = 0.0f; }
                    int tend = s.causal ? t + 1 : s.T, j0 = s.causal ? attn_first_key(&s, b, t) : 0;
                    for (int j = j0; j < tend; j++) {
                        int64_t krow = ((int64_t)b * s.T + j) * ks + (int64_t)kh * s.hd;
                        const float *kj = k + krow, *vj = v + krow;
                        float sc = 0.0f, dp = 0.0f;
                        for (int i = 0; i < s.hd; i++) { sc += qi[i] * kj[i]; dp += doi[i] * vj[i]; }
                        float p = expf(sc * scale - L);
                        float ds = p * (dp - D) * scale;
                        float *dkj = dk + krow, *dvj = dv + krow;
                        for (int i = 0; i < s.hd; i++) {
                            dqi[i] += ds * kj[i];
                            dkj[i] += ds * qi[i];
                            dvj[i] += p * doi[i];
                        }
                    }
                }
        }
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
