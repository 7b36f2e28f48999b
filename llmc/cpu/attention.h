// cpu/attention.h: rotary position embedding and flash-style multi-head attention, fp32.
// Layout: q [N, H*hd], k and v [N, KVH*hd], o [N, H*hd], token n = b*T + t, head h at columns
// h*hd; query head h reads kv head h / (H/KVH) (grouped-query attention by index, no copies).
// Forward keeps only o and the per-row log-sum-exp; backward recomputes the scores block by block,
// so no T x T matrix is ever stored. Both run over blocks of 64 query rows, each a few products
// on a [block, keys] tile of scores with matmul.h's micro-kernel on one thread: the forward 2 per
// block (S = q k^T, o = P v), the backward 5 in one pass (S, dP, dq, and sums into dk, dv; see
// attention_backward). k and v are packed once per call (attn_pack) for every head and block
// that reads them. Work units run in parallel; each output element is summed in an order fixed by
// the shape (partial dk, dv of a kv head's units added in unit order): the bits do not depend on
// the thread count.
#pragma once
#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#include "matmul.h"
#include "vec_exp.h"

// Rotate-half RoPE on the first rot dims of each head (pairs i, i+rot/2; the rest pass unchanged,
// partial rotary; rot = hd: the whole head) applied in place to x [N, nheads*hd] at position pos[n]
// (packed examples restart at 0), or n % T when pos is NULL. cos/sin tables are [T, rot/2].
// inverse = 1 applies the transpose rotation (the backward).
static void rope_apply(float* x, const float* cos_t, const float* sin_t, const int* pos, int64_t N, int T, int nheads,
                       int hd, int rot, int inverse) {
    int half = rot / 2;
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
    const struct AttnDocs* docs;  // with pos, the same examples as cuDNN's ragged entries
                                  // (llmc/attn_docs.h; CUDA with cuDNN only), else NULL
    int window;      // causal only: a query at t sees keys t - window < j <= t (0: every earlier key)
    float scale;     // the scores' scale (0: head_dim^-0.5)
    float softcap;   // scores s become softcap * tanh(s / softcap) before the mask and softmax (0: none)
    int tile_window; // the window the CUDA GEMM path's tiles follow (llmc/memory/cuda_workspace.h): the
                     // model's, on its full layers too, so that every layer has one layout (0: window)
} AttnShape;
// The sliding window's boundary is transformers' eager/sdpa mask (Mistral, Qwen2, Gemma 2 in 4.46:
// key j is masked where j <= i - sliding_window; current transformers' sliding_window_overlay
// keeps kv_idx > q_idx - sliding_window, the same set): a query sees `window` keys, itself
// included. 4.46's flash-attention-2 path passes window_size=(W, W), one key more; the masks
// above are the definition its other paths and later versions agree on, so this follows them.

// The scale of the scores: s->scale, or head_dim^-0.5 where the caller left it 0.
static inline float attn_scale_of(const AttnShape* s) {
    return s->scale > 0.0f ? s->scale : 1.0f / sqrtf((float)s->hd);
}

// First key a causal query (b, t) may see: the start of its example, and within the window.
static inline int attn_first_key(const AttnShape* s, int b, int t) {
    int first = s->pos ? t - s->pos[(int64_t)b * s->T + t] : 0;
    if (s->window > 0 && t - s->window + 1 > first) first = t - s->window + 1;
    return first;
}

// The two layouts of attention's row statistics: lse [B, H, T] (every path saves it so), and
// token-major [B*T, H], what cuDNN's ragged attention of packed examples reads and writes
// (llmc/cuda/attention_cudnn.cu); LSE_TO_TOKENS converts the first into the second, LSE_TO_ROWS back
// (attention_lse_layout_cuda; the CPU backend never needs it).
typedef enum { LSE_TO_TOKENS, LSE_TO_ROWS } LseLayout;

// Blocks of ATT_BLOCK query rows: the work runs at the matrix-product rate and the tiles take
// O(block x T) memory per thread at any sequence length.
#define ATT_BLOCK 64

// The keys a tile of ATT_BLOCK query rows may span: all T, or (a window) the block's rows plus the
// window plus the rounding of attn_key_range, so the tiles' memory grows with the window.
static inline int attn_tile_keys(const AttnShape* s) {
    int64_t w = (int64_t)s->window + ATT_BLOCK + MM_NR;  // the block's rows, attn_key_range's rounding
    return s->causal && s->window > 0 && w < s->T ? (int)w : s->T;
}

// Keys [*lo, *hi) that some query of rows [t0, t1) of sequence b may see. lo is rounded down to a
// multiple of MM_NR so that a tile starts on a panel of the packed keys (attn_pack); the
// extra keys are masked like any other invisible key.
static void attn_key_range(const AttnShape* s, int b, int t0, int t1, int* lo, int* hi) {
    *lo = s->causal ? attn_first_key(s, b, t0) / MM_NR * MM_NR : 0;
    *hi = s->causal ? t1 : s->T;
}
// The keys [*a, *e) query t of sequence b sees (a contiguous range: its example's start up to t).
static inline void attn_visible_range(const AttnShape* s, int b, int t, int* a, int* e) {
    *a = s->causal ? attn_first_key(s, b, t) : 0;
    *e = s->causal ? t + 1 : s->T;
}

// k or v packed once per call, per (b, kv head), in the panel layout of matmul.h's micro-kernel
// (panels of MM_NR columns, [panel][k][MM_NR], zero-padded), so that the tile products of every
// query head of the group and every block read them without packing them again:
//   cols = 1: B(i, j) = x[j][i], the keys as columns (K = hd, N = T): S = q k^T, dP = do v^T
//   cols = 0: B(j, i) = x[j][i], the keys as k (K = T, N = hd): o = P v, dq = dS k
// Called inside the caller's parallel region (its loop is shared out there, no barrier: the
// caller places one).
static int64_t attn_cols_size(const AttnShape* s) { return (int64_t)(s->T + MM_NR - 1) / MM_NR * MM_NR * s->hd; }
static int64_t attn_rows_size(const AttnShape* s) { return (int64_t)s->T * ((s->hd + MM_NR - 1) / MM_NR * MM_NR); }
static void attn_pack(float* dst, const float* x, const AttnShape* s, int cols) {
    int64_t ks = (int64_t)s->KVH * s->hd, size = cols ? attn_cols_size(s) : attn_rows_size(s);
#pragma omp for collapse(2) schedule(static) nowait
    for (int b = 0; b < s->B; b++)
        for (int kh = 0; kh < s->KVH; kh++) {
            const float* src = x + (int64_t)b * s->T * ks + (int64_t)kh * s->hd;
            float* d = dst + ((int64_t)b * s->KVH + kh) * size;
            if (cols) mm_pack_b(d, src, 1, ks, 0, s->hd, 0, (s->T + MM_NR - 1) / MM_NR, s->T);
            else mm_pack_b(d, src, ks, 1, 0, s->T, 0, (s->hd + MM_NR - 1) / MM_NR, s->hd);
        }
}

#define ATT_KC 256  // k block of the tile products (a B panel of KC x 16 floats stays in L1)

// C[M, N] (+)= alpha * A(m, k) B(k, n), k in [0, K), on one thread, with A(m, k) = A[m*sam + k*sak]
// and B packed: column panel p at Bp + p * pstride, row k of it at + k * MM_NR. Ap: scratch for
// the packed A, (M + MM_MR) * ATT_KC floats. k runs in blocks of ATT_KC, in order.
static void attn_gemm(float* C, int64_t ldc, const float* A, int64_t sam, int64_t sak, const float* Bp, int64_t pstride,
                      int M, int N, int K, float alpha, int accumulate, float* Ap) {
    int full = sak == 1 ? M / MM_MR : 0;  // 6-row slivers read in place (rows contiguous); the rest packed
    for (int k0 = 0; k0 < K; k0 += ATT_KC) {
        int kc = K - k0 < ATT_KC ? K - k0 : ATT_KC, store = k0 == 0 && !accumulate;
        if (full * MM_MR < M) mm_pack_a(Ap, A, sam, sak, full * MM_MR, M - full * MM_MR, k0, kc);
        for (int p = 0; p * MM_NR < N; p++) {
            int nn = N - p * MM_NR < MM_NR ? N - p * MM_NR : MM_NR;
            const float *b = Bp + p * pstride + (int64_t)k0 * MM_NR, *b2 = NULL;
            if (MM_WIDE && (p + 2) * MM_NR <= N) b2 = b + pstride, p++;  // two full panels: 6 x 32 tiles
            for (int i = 0; i * MM_MR < M; i++) {
                int mm = M - i * MM_MR < MM_MR ? M - i * MM_MR : MM_MR;
                float* c = C + (int64_t)i * MM_MR * ldc + (b2 ? p - 1 : p) * MM_NR;
                if (i < full) {
                    const float* a = A + (int64_t)i * MM_MR * sam + k0;
                    if (b2) mm_kernel_wide(c, ldc, a, sam, 1, b, b2, MM_NR, kc, alpha, store);
                    else mm_kernel_strided(c, ldc, mm, nn, a, sam, 1, b, MM_NR, kc, alpha, store);
                    continue;
                }
                const float* a = Ap + (int64_t)(i - full) * kc * MM_MR;
                if (b2 && mm == MM_MR) {
                    mm_kernel_wide(c, ldc, a, 1, MM_MR, b, b2, MM_NR, kc, alpha, store);
                    continue;
                }
                mm_kernel_6x16(c, ldc, mm, nn, a, b, kc, alpha, store);
                if (b2) mm_kernel_6x16(c + MM_NR, ldc, mm, MM_NR, a, b2, kc, alpha, store);
            }
        }
    }
}

// Row of a forward score tile, keys [0, nk) of which [a, e) are visible: the scores soft-capped
// (softcap > 0), then p = softmax over the visible keys, 0 elsewhere; returns the log-sum-exp.
static float attn_softmax_row(float* p, int nk, int a, int e, float softcap) {
    if (softcap > 0.0f)
        for (int j = a; j < e; j++) p[j] = softcap * tanhf(p[j] / softcap);
    float mx = vx_max(p + a, e - a);
    double sum = vx_exp_shifted(p + a, p + a, e - a, mx);
    float inv = (float)(1.0 / sum);
    memset(p, 0, sizeof(float) * a);
    for (int j = a; j < e; j++) p[j] *= inv;
    memset(p + e, 0, sizeof(float) * (nk - e));
    return mx + (float)log(sum);
}

// o = softmax(q k^T * scale) v per (b, h); lse[b, h, t] = log-sum-exp of the scaled scores.
// Scratch: k and v packed (about 2 x the size of k), per thread a [ATT_BLOCK, T] tile and a packed A.
static void attention_forward(float* o, float* lse, const float* q, const float* k, const float* v, AttnShape s) {
    int64_t qs = (int64_t)s.H * s.hd, csz = attn_cols_size(&s), rsz = attn_rows_size(&s);
    int group = s.H / s.KVH, nqb = (s.T + ATT_BLOCK - 1) / ATT_BLOCK;
    float scale = attn_scale_of(&s);
    int tk = attn_tile_keys(&s);
    float *kc = (float*)malloc(sizeof(float) * s.B * s.KVH * (csz + rsz)), *vr = kc + (int64_t)s.B * s.KVH * csz;
#pragma omp parallel if ((double)s.B * s.H * s.T * s.T * s.hd > (1 << 18))
    {
        attn_pack(kc, k, &s, 1);
        attn_pack(vr, v, &s, 0);
#pragma omp barrier
        float* S = (float*)malloc(sizeof(float) * ((int64_t)ATT_BLOCK * tk + (ATT_BLOCK + MM_MR) * ATT_KC));
        float* Ap = S + (int64_t)ATT_BLOCK * tk;
#pragma omp for collapse(3) schedule(dynamic)
        for (int b = 0; b < s.B; b++)
            for (int h = 0; h < s.H; h++)
                for (int qb = 0; qb < nqb; qb++) {
                    int t0 = qb * ATT_BLOCK, t1 = t0 + ATT_BLOCK < s.T ? t0 + ATT_BLOCK : s.T, m = t1 - t0,
                        kh = h / group, lo, hi;
                    attn_key_range(&s, b, t0, t1, &lo, &hi);
                    int nk = hi - lo;
                    int64_t r0 = ((int64_t)b * s.T + t0) * qs + (int64_t)h * s.hd, bh = (int64_t)b * s.KVH + kh;
                    attn_gemm(S, nk, q + r0, qs, 1, kc + bh * csz + (int64_t)lo * s.hd, (int64_t)s.hd * MM_NR, m, nk,
                              s.hd, scale, 0, Ap);  // S = scale q k^T
                    for (int t = t0; t < t1; t++) {
                        int a, e;
                        attn_visible_range(&s, b, t, &a, &e);
                        lse[((int64_t)b * s.H + h) * s.T + t] =
                            attn_softmax_row(S + (int64_t)(t - t0) * nk, nk, a - lo, e - lo, s.softcap);
                    }
                    attn_gemm(o + r0, qs, S, nk, 1, vr + bh * rsz + (int64_t)lo * MM_NR, (int64_t)s.T * MM_NR, m, s.hd,
                              nk, 1.0f, 0, Ap);  // o = P v
                }
        free(S);
    }
    free(kc);
}

// Row of a backward tile, keys [0, nk) of which [a, e) are visible: p = e^(s - L) (the forward's
// probabilities, from its log-sum-exp L), and dp becomes dS = p (dp - D) scale; both 0 elsewhere.
// Soft-capped scores (softcap > 0): s is capped as the forward did, c = softcap tanh(s / softcap),
// p = e^(c - L), and dS takes the cap's derivative, dS = p (dp - D) (1 - (c / softcap)^2) scale.
static void attn_grad_row(float* p, float* dp, int nk, int a, int e, float L, float D, float scale, float softcap) {
    memset(p, 0, sizeof(float) * a);
    memset(dp, 0, sizeof(float) * a);
    if (softcap > 0.0f) {
        for (int j = a; j < e; j++) {
            float c = softcap * tanhf(p[j] / softcap), r = c / softcap;
            float pj = vx_exp(vx_splat(c - L))[0];
            p[j] = pj;
            dp[j] = pj * (dp[j] - D) * (1.0f - r * r) * scale;
        }
        memset(p + e, 0, sizeof(float) * (nk - e));
        memset(dp + e, 0, sizeof(float) * (nk - e));
        return;
    }
    vx_f8 vL = vx_splat(L), vD = vx_splat(D), vs = vx_splat(scale);
    int j = a;
    for (; j + 8 <= e; j += 8) {
        vx_f8 pj = vx_exp(vx_load(p + j) - vL);
        vx_store(p + j, pj);
        vx_store(dp + j, pj * (vx_load(dp + j) - vD) * vs);
    }
    for (; j < e; j++) {  // the same operations one lane at a time
        float pj = vx_exp(vx_splat(p[j] - L))[0];
        p[j] = pj;
        dp[j] = pj * (dp[j] - D) * scale;
    }
    memset(p + e, 0, sizeof(float) * (nk - e));
    memset(dp + e, 0, sizeof(float) * (nk - e));
}

// x . y over n floats: 8 lanes, then the lanes and the tail in a fixed order.
static inline float attn_dot(const float* x, const float* y, int n) {
    vx_f8 acc = vx_splat(0.0f);
    int i = 0;
    for (; i + 8 <= n; i += 8) acc += vx_load(x + i) * vx_load(y + i);
    float d = ((acc[0] + acc[1]) + (acc[2] + acc[3])) + ((acc[4] + acc[5]) + (acc[6] + acc[7]));
    for (; i < n; i++) d += x[i] * y[i];
    return d;
}

// The backward runs in one pass of work units, each one query head h of sequence b over a chunk
// of its query blocks [qb0, qb1) in order. Per block of query rows and the keys [lo, hi) they see:
//   S = scale q k^T, dP = do v^T (recomputed tiles), P = e^(S - lse), dS = P (dP - D) scale,
//   dq = dS k (the block's rows, written), dv += P^T do and dk += dS^T q (rows [lo, hi), summed).
// Five products per block. A unit owns its dq rows. Its dk, dv sums go to its own partial buffer,
// except the first unit of each kv head (first head of the group, first chunk), which sums
// straight into dk, dv; then the others' partials are added in a fixed order (the group's heads,
// then the chunks), so the bits do not depend on the thread count.
// Chunks: enough units to keep threads busy at batch 1 (9 heads on 2 threads leave one idle a
// ninth of the time), cut where the causal triangle's work is even. They depend on the shape only.
#define ATT_MIN_UNITS 16

// Chunks per (b, h): units = B*H*chunks reaches ATT_MIN_UNITS, at most one per query block.
static int attn_backward_chunks(const AttnShape* s) {
    int nb = (s->T + ATT_BLOCK - 1) / ATT_BLOCK, c = (ATT_MIN_UNITS + s->B * s->H - 1) / (s->B * s->H);  // int: B*H
    return c < nb ? c : nb;
}

// First query block of chunk c of n over nb blocks: even shares of the work, block qb costing
// qb + 1 key blocks when causal (1 otherwise).
static int attn_chunk_start(const AttnShape* s, int nb, int c, int n) {
    if (c >= n) return nb;
    double total = s->causal ? 0.5 * nb * (nb + 1) : nb, target = total * c / n, done = 0;
    int qb = 0;
    while (qb < nb && done + 0.5 * (s->causal ? qb + 1 : 1) <= target) done += s->causal ? qb + 1 : 1, qb++;
    return qb;
}

typedef struct {
    const float *dout, *q, *o, *lse;
    const float *kc, *vc, *kr;  // k, v packed as columns, k packed as rows (attn_pack), per (b, kv head)
    AttnShape s;
} AttnBwdArgs;

// One unit: head h of sequence b, query blocks [qb0, qb1). dq rows written; dk, dv contributions
// summed into kacc, vacc (row j at j * ld; rows [0, T) zeroed here first). Scratch: S and dP
// [ATT_BLOCK, T], Ap (ATT_BLOCK + MM_MR) * ATT_KC.
static void attn_backward_unit(float* dq, float* kacc, float* vacc, int64_t ld, const AttnBwdArgs* A, int b, int h,
                               int qb0, int qb1, float* S, float* dP, float* Ap) {
    const AttnShape* s = &A->s;
    int64_t qs = (int64_t)s->H * s->hd, bh = (int64_t)b * s->KVH + h / (s->H / s->KVH);
    int64_t csz = attn_cols_size(s), rsz = attn_rows_size(s), cstride = (int64_t)s->hd * MM_NR;
    float scale = attn_scale_of(s);
    for (int j = 0; j < s->T; j++) {
        memset(kacc + j * ld, 0, sizeof(float) * s->hd);
        memset(vacc + j * ld, 0, sizeof(float) * s->hd);
    }
    for (int qb = qb0; qb < qb1; qb++) {
        int t0 = qb * ATT_BLOCK, t1 = t0 + ATT_BLOCK < s->T ? t0 + ATT_BLOCK : s->T, m = t1 - t0, lo, hi;
        attn_key_range(s, b, t0, t1, &lo, &hi);
        int nk = hi - lo;
        int64_t r0 = ((int64_t)b * s->T + t0) * qs + (int64_t)h * s->hd;
        attn_gemm(S, nk, A->q + r0, qs, 1, A->kc + bh * csz + (int64_t)lo * s->hd, cstride, m, nk, s->hd, scale, 0,
                  Ap);  // S = scale q k^T
        attn_gemm(dP, nk, A->dout + r0, qs, 1, A->vc + bh * csz + (int64_t)lo * s->hd, cstride, m, nk, s->hd, 1.0f, 0,
                  Ap);  // dP = do v^T
        for (int t = t0; t < t1; t++) {
            const float *dot = A->dout + r0 + (int64_t)(t - t0) * qs, *ot = A->o + r0 + (int64_t)(t - t0) * qs;
            float D = attn_dot(dot, ot, s->hd);
            int a, e;
            attn_visible_range(s, b, t, &a, &e);
            attn_grad_row(S + (int64_t)(t - t0) * nk, dP + (int64_t)(t - t0) * nk, nk, a - lo, e - lo,
                          A->lse[((int64_t)b * s->H + h) * s->T + t], D, scale, s->softcap);
        }
        attn_gemm(dq + r0, qs, dP, nk, 1, A->kr + bh * rsz + (int64_t)lo * MM_NR, (int64_t)s->T * MM_NR, m, s->hd, nk,
                  1.0f, 0, Ap);  // dq = dS k
        mm_gemm(vacc + lo * ld, ld, S, 1, nk, A->dout + r0, qs, 1, nk, s->hd, m, 1.0f, 1, 0);  // dv += P^T do
        mm_gemm(kacc + lo * ld, ld, dP, 1, nk, A->q + r0, qs, 1, nk, s->hd, m, 1.0f, 1, 0);    // dk += dS^T q
    }
}

// The heap scratch one call takes beside its operands, in bytes (the larger of the forward's and
// the backward's), with `threads` OpenMP threads: the packed keys and values, the per-thread tiles
// and packed A blocks, and the backward's partial dk, dv. It grows with B x T, so the memory plan
// states it (MemPlan.percall_bytes): a CPU run's peak RSS is the plan's arenas plus at most this.
static size_t attention_scratch_bytes(AttnShape s, int threads) {
    int64_t csz = attn_cols_size(&s), rsz = attn_rows_size(&s), nbh = (int64_t)s.B * s.KVH;
    int64_t tile = (int64_t)ATT_BLOCK * attn_tile_keys(&s) + (ATT_BLOCK + MM_MR) * ATT_KC;  // S, packed A, per thread
    int64_t fwd = nbh * (csz + rsz) + threads * tile;
    int64_t chunks = attn_backward_chunks(&s), per_kv = (int64_t)(s.H / s.KVH) * chunks;
    int64_t units = (int64_t)s.B * s.H * chunks;
    int64_t partials = per_kv > 1 ? 2 * (int64_t)s.T * s.hd * units : 0;
    int64_t bwd = nbh * (2 * csz + rsz) + partials + threads * (tile + (int64_t)ATT_BLOCK * attn_tile_keys(&s));
    return sizeof(float) * (size_t)(fwd > bwd ? fwd : bwd);
}

// Gradients dq, dk, dv (overwritten) from do. Scratch: k and v packed (about 3 x the size of k),
// per thread two [ATT_BLOCK, T] tiles and a packed A, and the partial dk, dv of the units after
// the first of each kv head: at most 2 x chunks x the size of q (none when group = chunks = 1).
static void attention_backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                               const float* v, const float* o, const float* lse, AttnShape s) {
    int64_t ks = (int64_t)s.KVH * s.hd, csz = attn_cols_size(&s), rsz = attn_rows_size(&s), nbh = (int64_t)s.B * s.KVH;
    int group = s.H / s.KVH, nb = (s.T + ATT_BLOCK - 1) / ATT_BLOCK, nch = attn_backward_chunks(&s);
    int per_kv = group * nch, units = s.B * s.H * nch;  // int: units per kv head, in all (B*H*16 at most)
    int64_t part = (int64_t)s.T * s.hd;                  // floats of one unit's partial dk (or dv)
    float* packs = (float*)malloc(sizeof(float) * nbh * (2 * csz + rsz));
    float* pk =
        per_kv > 1 ? (float*)malloc(sizeof(float) * 2 * part * units) : NULL;  // slots of the first units stay unused
    AttnBwdArgs A = {dout, q, o, lse, packs, packs + nbh * csz, packs + 2 * nbh * csz, s};
    int par = (double)s.B * s.H * s.T * s.T * s.hd > (1 << 18);
#pragma omp parallel if (par)
    {
        attn_pack(packs, k, &s, 1);
        attn_pack(packs + nbh * csz, v, &s, 1);
        attn_pack(packs + 2 * nbh * csz, k, &s, 0);
#pragma omp barrier
        int tk = attn_tile_keys(&s);
        float* S = (float*)malloc(sizeof(float) * (2ll * ATT_BLOCK * tk + (ATT_BLOCK + MM_MR) * ATT_KC));
#pragma omp for schedule(dynamic)
        for (int u = 0; u < units; u++) {  // u = ((b * KVH + kh) * group + h % group) * nch + chunk
            int b = u / (s.H * nch), h = u / nch % s.H, c = u % nch;  // int: below units
            int qb0 = attn_chunk_start(&s, nb, c, nch), qb1 = attn_chunk_start(&s, nb, c + 1, nch);
            float *kacc = dk + (int64_t)b * s.T * ks + (int64_t)(h / group) * s.hd, *vacc = dv + (kacc - dk);
            int64_t ld = ks;
            if (u % per_kv) kacc = pk + 2 * part * u, vacc = kacc + part, ld = s.hd;
            attn_backward_unit(dq, kacc, vacc, ld, &A, b, h, qb0, qb1, S, S + (int64_t)ATT_BLOCK * tk,
                               S + 2ll * ATT_BLOCK * tk);
        }
        free(S);
        if (per_kv > 1) {  // dk, dv += the other units' partials, in unit order (the group's heads, then the chunks)
#pragma omp for collapse(2) schedule(static)
            for (int b = 0; b < s.B; b++)
                for (int j = 0; j < s.T; j++)
                    for (int kh = 0; kh < s.KVH; kh++) {
                        float *dkj = dk + ((int64_t)b * s.T + j) * ks + (int64_t)kh * s.hd, *dvj = dv + (dkj - dk);
                        for (int r = 1; r < per_kv; r++) {
                            const float* pu =
                                pk + 2 * part * (((int64_t)b * s.KVH + kh) * per_kv + r) + (int64_t)j * s.hd;
                            for (int i = 0; i < s.hd; i++) {
                                dkj[i] += pu[i];
                                dvj[i] += pu[part + i];
                            }
                        }
                    }
        }
    }
    free(pk);
    free(packs);
}

// Attention of n new queries against a key/value cache (generation): q [n, H*hd] at absolute
// positions start .. start+n-1, kc and vc [cap, KVH*hd] holding every position up to start+n-1
// (the new rows included); causal, within s.window (a cache longer than the window attends to
// its last s.window positions only), with s.scale and s.softcap. H, KVH, hd from s (B, T unused).
// o [n, H*hd]. No lse: nothing is trained from it.
static void attention_cached(float* o, const float* q, const float* kc, const float* vc, int n, int start,
                             AttnShape s) {
    int H = s.H, KVH = s.KVH, hd = s.hd;
    int64_t qs = (int64_t)H * hd, ks = (int64_t)KVH * hd;
    int group = H / KVH;
    float scale = attn_scale_of(&s);
    float* p = (float*)malloc(sizeof(float) * (start + n));
    for (int t = 0; t < n; t++)
        for (int h = 0; h < H; h++) {
            const float* qi = q + t * qs + (int64_t)h * hd;
            int keys = start + t + 1, kh = h / group;
            int j0 = s.window > 0 && keys > s.window ? keys - s.window : 0;
            float mx = -FLT_MAX;
            for (int j = j0; j < keys; j++) {
                const float* kj = kc + j * ks + (int64_t)kh * hd;
                float d = 0.0f;
                for (int i = 0; i < hd; i++) d += qi[i] * kj[i];
                p[j] = d * scale;
                if (s.softcap > 0.0f) p[j] = s.softcap * tanhf(p[j] / s.softcap);
                if (p[j] > mx) mx = p[j];
            }
            double sum = 0.0;
            for (int j = j0; j < keys; j++) { p[j] = expf(p[j] - mx); sum += p[j]; }
            float inv = (float)(1.0 / sum), *oi = o + t * qs + (int64_t)h * hd;
            for (int i = 0; i < hd; i++) oi[i] = 0.0f;
            for (int j = j0; j < keys; j++) {
                const float* vj = vc + j * ks + (int64_t)kh * hd;
                for (int i = 0; i < hd; i++) oi[i] += p[j] * inv * vj[i];
            }
        }
    free(p);
}
