// test/unit/attention.cu: attention (causal, bidirectional, GQA, packed examples) against naive
// softmaxes, finite differences and a double-precision blocked reference; RoPE.
#include "unit.h"
#include "../../llmc/cpu/attention.h"

// ---- attention and RoPE --------------------------------------------------------------------

static double attn_loss(const float* q, const float* k, const float* v, const float* w, AttnShape s, float* o,
                        float* lse) {
    attention_forward(o, lse, q, k, v, s);
    double L = 0;
    for (int64_t i = 0; i < (int64_t)s.B * s.T * s.H * s.hd; i++) L += (double)o[i] * w[i];
    return L;
}

// causal = 2: causal with packed examples (positions restart; a query sees only its example).
// causal = 3: causal without GQA (H = KVH: the backward writes dk, dv directly, no partial sums).
void test_attention(int causal) {
    Rng r = rng_seeded(7 + causal, 0);
    static const int packed_pos[2 * 5] = {0, 1, 2, 0, 1, 0, 0, 1, 2, 3};
    AttnShape s = {2, 5, 4, causal == 3 ? 4 : 2, 6, causal != 0, causal == 2 ? packed_pos : NULL, NULL,
                   0, 0.0f, 0.0f, 0};
    int64_t nq = (int64_t)s.B * s.T * s.H * s.hd, nk = (int64_t)s.B * s.T * s.KVH * s.hd;
    float *q = randn(nq, &r, 1), *k = randn(nk, &r, 1), *v = randn(nk, &r, 1), *w = randn(nq, &r, 1);
    float *o = randn(nq, &r, 1), *lse = randn(s.B * s.H * s.T, &r, 1);
    float *dq = randn(nq, &r, 1), *dk = randn(nk, &r, 1), *dv = randn(nk, &r, 1);
    attn_loss(q, k, v, w, s, o, lse);
    attention_backward(dq, dk, dv, w, q, k, v, o, lse, s);
    // naive forward in double
    double fe = 0;
    double scale = 1.0 / sqrt((double)s.hd);
    for (int b = 0; b < s.B; b++)
        for (int h = 0; h < s.H; h++)
            for (int t = 0; t < s.T; t++) {
                int kh = h / (s.H / s.KVH), tend = causal ? t + 1 : s.T,
                    j0 = causal == 2 ? t - packed_pos[b * s.T + t] : 0;
                double p[16], mx = -1e300, sum = 0;
                for (int j = j0; j < tend; j++) {
                    double d = 0;
                    for (int i = 0; i < s.hd; i++)
                        d += (double)q[((b * s.T + t) * s.H + h) * s.hd + i] *
                             k[((b * s.T + j) * s.KVH + kh) * s.hd + i];
                    p[j] = d * scale;
                    mx = fmax(mx, p[j]);
                }
                for (int j = j0; j < tend; j++) { p[j] = exp(p[j] - mx); sum += p[j]; }
                for (int i = 0; i < s.hd; i++) {
                    double acc = 0;
                    for (int j = j0; j < tend; j++) acc += p[j] / sum * v[((b * s.T + j) * s.KVH + kh) * s.hd + i];
                    fe = fmax(fe, fabs(acc - o[((b * s.T + t) * s.H + h) * s.hd + i]));
                }
            }
    const char* fw[4] = {"bidirectional GQA attention forward matches a naive softmax",
                         "causal GQA attention forward matches a naive softmax",
                         "packed-example attention forward matches a per-example softmax",
                         "causal attention forward (H = KVH) matches a naive softmax"};
    check(fe < 1e-5, fw[causal], fe);
    // central finite differences on every input element
    float* tmp_o = (float*)xmalloc(sizeof(float) * nq);
    float* tmp_l = (float*)xmalloc(sizeof(float) * s.B * s.H * s.T);
    double ge = 0, gm = 0;
    float* ins[3] = {q, k, v};
    float* grads[3] = {dq, dk, dv};
    int64_t ns[3] = {nq, nk, nk};
    for (int which = 0; which < 3; which++)
        for (int64_t i = 0; i < ns[which]; i++) {
            float keep = ins[which][i], h = 1e-2f;
            ins[which][i] = keep + h;
            double lp = attn_loss(q, k, v, w, s, tmp_o, tmp_l);
            ins[which][i] = keep - h;
            double lm = attn_loss(q, k, v, w, s, tmp_o, tmp_l);
            ins[which][i] = keep;
            double num = (lp - lm) / (2 * h);
            ge = fmax(ge, fabs(num - grads[which][i]));
            gm = fmax(gm, fabs(num));
        }
    const char* bw[4] = {"bidirectional attention backward matches finite differences",
                         "causal attention backward (recomputed scores) matches finite differences",
                         "packed-example attention backward matches finite differences",
                         "causal attention backward, H = KVH (dk, dv written directly), matches finite differences"};
    check(ge / gm < 2e-3, bw[causal], ge / gm);
    free(q); free(k); free(v); free(w); free(o); free(lse); free(dq); free(dk); free(dv); free(tmp_o); free(tmp_l);
}

// Attention across several 64-row blocks, forward and backward against a double-precision
// reference of the same formulas (P = softmax(scale q k^T), dS = P (dP - D), dq = scale dS k,
// dk = scale dS^T q, dv = P^T do). Tolerance: each output is a sum of at most T products of
// magnitude-bounded terms computed in fp32 (scores as length-hd dot products, exp within 2 ulp):
// we allow 64 T 2^-24 of the largest reference magnitude, about 6e-4 relative at T = 150; a wrong
// mask, block edge or partial sum gives O(1) errors. Then 1, 2 and 3 threads give the same bits.
// The cases cover the one-pass backward's layouts (llmc/cpu/attention.h): partial dk, dv summed
// over the group's heads and over query chunks (GQA group 2 and 3, and group 1 with several
// chunks per head), and dk, dv written directly (group 1, one chunk per head); causal with packed
// examples whose starts are not on a 16-key panel, causal, bidirectional; T not a multiple of 64;
// hd not a multiple of 16.
typedef struct { int B, T, H, KVH, hd, causal, packed; const char* name; } AttnCase;

static void test_attention_blocks_case(AttnCase c) {
    Rng r = rng_seeded(71 + c.T + c.H, 0);
    const int B = c.B, T = c.T, H = c.H, KVH = c.KVH, hd_ = c.hd;
    int* pos = (int*)xmalloc(sizeof(int) * B * T);
    for (int b = 0; b < B; b++)  // sequence 0 of a packed case: examples of 70 and T - 70 tokens
        for (int t = 0; t < T; t++) pos[b * T + t] = b == 0 && c.packed && t >= 70 ? t - 70 : t;
    AttnShape s = {B, T, H, KVH, hd_, c.causal, c.packed ? pos : NULL, NULL, 0, 0.0f, 0.0f, 0};
    int64_t nq = (int64_t)B * T * H * hd_, nk = (int64_t)B * T * KVH * hd_;
    float *q = randn(nq, &r, 1), *k = randn(nk, &r, 1), *v = randn(nk, &r, 1), *dout = randn(nq, &r, 1);
    float* out[3][5];  // per thread count: o, lse, dq, dk, dv
    int64_t n5[5] = {nq, (int64_t)B * H * T, nq, nk, nk};
    int nthreads = omp_get_max_threads();
    for (int th = 0; th < 3; th++) {
        for (int w = 0; w < 5; w++) out[th][w] = (float*)xmalloc(4 * n5[w]);
        omp_set_num_threads(th + 1);
        attention_forward(out[th][0], out[th][1], q, k, v, s);
        attention_backward(out[th][2], out[th][3], out[th][4], dout, q, k, v, out[th][0], out[th][1], s);
    }
    omp_set_num_threads(nthreads);
    double *ro = (double*)calloc(nq, 8), *rdq = (double*)calloc(nq, 8), *rdk = (double*)calloc(nk, 8),
           *rdv = (double*)calloc(nk, 8);
    double scale = 1.0 / sqrt((double)hd_);
    double* P = (double*)xmalloc(sizeof(double) * T);
    for (int b = 0; b < B; b++)
        for (int h = 0; h < H; h++)
            for (int t = 0; t < T; t++) {
                int kh = h / (H / KVH), j0 = c.causal ? t - pos[b * T + t] : 0, j1 = c.causal ? t : T - 1;
                const float *qi = q + ((int64_t)(b * T + t) * H + h) * hd_,
                            *doi = dout + ((int64_t)(b * T + t) * H + h) * hd_;
                double mx = -1e300, sum = 0, D = 0;
                for (int j = j0; j <= j1; j++) {
                    double d = 0;
                    for (int i = 0; i < hd_; i++) d += (double)qi[i] * k[((int64_t)(b * T + j) * KVH + kh) * hd_ + i];
                    P[j] = d * scale;
                    mx = fmax(mx, P[j]);
                }
                for (int j = j0; j <= j1; j++) { P[j] = exp(P[j] - mx); sum += P[j]; }
                for (int j = j0; j <= j1; j++) P[j] /= sum;
                double* oi = ro + ((int64_t)(b * T + t) * H + h) * hd_;
                for (int j = j0; j <= j1; j++)
                    for (int i = 0; i < hd_; i++) oi[i] += P[j] * v[((int64_t)(b * T + j) * KVH + kh) * hd_ + i];
                for (int i = 0; i < hd_; i++) D += doi[i] * oi[i];
                for (int j = j0; j <= j1; j++) {
                    const float *kj = k + ((int64_t)(b * T + j) * KVH + kh) * hd_,
                                *vj = v + ((int64_t)(b * T + j) * KVH + kh) * hd_;
                    double dp = 0;
                    for (int i = 0; i < hd_; i++) dp += (double)doi[i] * vj[i];
                    double ds = P[j] * (dp - D) * scale;
                    for (int i = 0; i < hd_; i++) {
                        rdq[((int64_t)(b * T + t) * H + h) * hd_ + i] += ds * kj[i];
                        rdk[((int64_t)(b * T + j) * KVH + kh) * hd_ + i] += ds * qi[i];
                        rdv[((int64_t)(b * T + j) * KVH + kh) * hd_ + i] += P[j] * doi[i];
                    }
                }
            }
    const double* want[4] = {ro, rdq, rdk, rdv};
    const int slot[4] = {0, 2, 3, 4};
    const char* names[4] = {"o", "dq", "dk", "dv"};
    double worst = 0;
    for (int w = 0; w < 4; w++) {
        double err = 0, mag = 0;
        const float* got = out[1][slot[w]];
        for (int64_t i = 0; i < n5[slot[w]]; i++) {
            err = fmax(err, fabs(got[i] - want[w][i]));
            mag = fmax(mag, fabs(want[w][i]));
        }
        double e = err / (64.0 * T * 0x1p-24 * mag);
        if (e > worst || isnan(e)) worst = isnan(e) ? INFINITY : e;
        if (!(e <= 1.0)) fprintf(stderr, "  %s: %s off by %g of the bound\n", c.name, names[w], e);
    }
    char what[200];
    snprintf(what, sizeof(what),
             "attention blocks, %s: o, dq, dk, dv match a double reference (error / 64 T 2^-24 max)", c.name);
    check(worst <= 1.0, what, worst);
    int same = 1;
    for (int th = 0; th < 3; th += 2)
        for (int w = 0; w < 5; w++) same &= !memcmp(out[th][w], out[1][w], 4 * n5[w]);
    snprintf(what, sizeof(what), "attention blocks, %s: 1, 2 and 3 threads give the same bits", c.name);
    check(same, what, 0);
    for (int th = 0; th < 3; th++)
        for (int w = 0; w < 5; w++) free(out[th][w]);
    free(q); free(k); free(v); free(dout); free(pos); free(P);
    free(ro); free(rdq); free(rdk); free(rdv);
}

void test_attention_blocks(void) {
    const AttnCase cases[] = {
        {2, 150, 4, 2, 16, 1, 1, "T=150 causal packed, GQA group 2 (partial dk, dv, 2 chunks)"},
        {1, 130, 6, 2, 24, 0, 0, "T=130 bidirectional, GQA group 3, hd 24 (partial, 3 chunks)"},
        {1, 200, 2, 2, 16, 1, 1, "T=200 causal packed, group 1 (partial, 4 chunks per head)"},
        {2, 100, 8, 8, 16, 1, 0, "T=100 causal, group 1 (dk, dv written directly)"},
        {2, 70, 8, 8, 8, 0, 0, "T=70 bidirectional, group 1, hd 8 (direct)"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) test_attention_blocks_case(cases[i]);
}


void test_rope(void) {
    Rng r = rng_seeded(9, 0);
    int T = 6, H = 3, hd = 8, N = 2 * T, half = hd / 2;
    float *cs = (float*)xmalloc(sizeof(float) * T * half), *sn = (float*)xmalloc(sizeof(float) * T * half);
    for (int t = 0; t < T; t++)
        for (int i = 0; i < half; i++) {
            double a = t * pow(10000.0, -2.0 * i / hd);
            cs[t * half + i] = (float)cos(a);
            sn[t * half + i] = (float)sin(a);
        }
    float* x = randn(N * H * hd, &r, 1);
    float* y = (float*)xmalloc(sizeof(float) * N * H * hd);
    memcpy(y, x, sizeof(float) * N * H * hd);
    rope_apply(y, cs, sn, NULL, N, T, H, hd, hd, 0);
    double fe = 0;  // rotate-half: (x_i, x_{i+hd/2}) rotated by angle t*theta^(-2i/hd)
    for (int n = 0; n < N; n++)
        for (int h = 0; h < H; h++)
            for (int i = 0; i < half; i++) {
                double a = (n % T) * pow(10000.0, -2.0 * i / hd);
                const float* xv = x + (n * H + h) * hd;
                const float* yv = y + (n * H + h) * hd;
                fe = fmax(fe, fabs(yv[i] - (xv[i] * cos(a) - xv[i + half] * sin(a))));
                fe = fmax(fe, fabs(yv[i + half] - (xv[i + half] * cos(a) + xv[i] * sin(a))));
            }
    check(fe < 1e-5, "RoPE (rotate-half) matches the rotation formula", fe);
    rope_apply(y, cs, sn, NULL, N, T, H, hd, hd, 1);
    double ie = 0;
    for (int i = 0; i < N * H * hd; i++) ie = fmax(ie, fabs(y[i] - x[i]));
    check(ie < 1e-5, "RoPE backward (inverse rotation) undoes the forward", ie);
    free(cs); free(sn); free(x); free(y);
}
