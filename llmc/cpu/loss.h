// cpu/loss.h: final RMSNorm + LM head + cross-entropy, fused and chunked over tokens so that only
// chunk x vocab logits ever exist. In training the same pass writes the gradient with respect to
// the final norm's input (dlogits -> dz -> dx), so nothing of the head is kept for backward.
#pragma once
#include <float.h>
#include <math.h>
#include "matmul.h"
#include "norms.h"
#include "vec_exp.h"
#include "../softcap.h"

typedef struct {
    double loss_sum;       // sum of CE over counted (mask != 0) positions
    double count;          // number of counted positions
    double correct;        // counted positions whose argmax equals the target
    double overflowed;     // rows whose final-norm statistics left fp32's range (norm_stats_overflowed),
                           // masked or not: the activations of a diverged run
} LossStats;

typedef struct {           // scratch for one chunk, from the plan
    float* z;              // [chunk, d]
    float* r;              // [chunk]
    float* logits;         // [chunk, V]
    float* dz;             // [chunk, d]
} LossScratch;

// Softmax CE of one row; overwrites the row, with dlogits * grad_scale when grad is set. The row's
// exponentials are taken once (vectorised, llmc/cpu/vec_exp.h) and serve both the log-sum-exp and
// the gradient: this is the loss head's elementwise work, V per token.
static double ce_row(float* row, int V, int target, float weight, float grad_scale, int grad, int* argmax) {
    float mx = vx_max(row, V), xt = row[target];
    int am = 0;
    for (int v = 0; v < V; v++) if (row[v] == mx) { am = v; break; }  // the first maximum, as argmax
    double sum = vx_exp_shifted(row, row, V, mx);
    double lse = mx + log(sum);
    *argmax = am;
    if (grad) {
        float w = weight * grad_scale;
        vx_f8 f = vx_splat((float)(w / sum));
        int v = 0;
        for (; v + 8 <= V; v += 8) vx_store(row + v, vx_load(row + v) * f);
        for (; v < V; v++) row[v] *= f[0];
        row[target] -= w;
    }
    return lse - xt;
}

// ce_row over soft-capped logits (the row holds y = c tanh(x / c), llmc/softcap.h), its gradient
// w.r.t. the logits before the cap: the backward reads y after the softmax has, so the row's
// exponentials are taken twice here instead of being kept.
static double ce_row_capped(float* row, int V, int target, float weight, float grad_scale, int grad, int* argmax,
                            float cap) {
    float mx = vx_max(row, V), xt = row[target];
    int am = 0;
    for (int v = 0; v < V; v++) if (row[v] == mx) { am = v; break; }
    double sum = 0.0;
    for (int v = 0; v < V; v++) sum += expf(row[v] - mx);
    *argmax = am;
    if (grad) {
        float w = weight * grad_scale, f = (float)(w / sum);
        for (int v = 0; v < V; v++) {
            float y = row[v];
            row[v] = softcap_grad_f(expf(y - mx) * f - (v == target ? w : 0.0f), y, cap);
        }
    }
    return mx + log(sum) - xt;
}

// xf [N,d] final-norm input; W [V,d] head; dxf [N,d] accumulated when non-NULL; logits_out [N,V]
// receives the logits when non-NULL (tests). grad_scale = 1 / (masked tokens of the whole step).
// Full fine-tuning also trains the head and the final norm: dW [V,d] and dgamma [d] accumulate
// when non-NULL (with dxf). softcap > 0: the logits are soft-capped (Gemma 2's final_logit_softcapping).
static void lm_head_loss(const float* xf, const float* gamma, float eps, const float* W, int V, int d,
                         const int* targets, const float* mask, int64_t N, int chunk, float grad_scale, float* dxf,
                         float* logits_out, LossScratch sc, LossStats* st, float* dW = NULL, float* dgamma = NULL,
                         float softcap = 0.0f) {
    for (int64_t n0 = 0; n0 < N; n0 += chunk) {
        int c = (int)(N - n0 < chunk ? N - n0 : chunk);
        rmsnorm_forward(sc.z, sc.r, xf + n0 * d, gamma, c, d, eps);
        st->overflowed += norm_overflowed_rows(sc.r, c);
        matmul_nt(sc.logits, sc.z, W, c, V, d, 1.0f, 0);
        if (softcap > 0.0f)
            for (int64_t i = 0; i < (int64_t)c * V; i++) sc.logits[i] = softcap_f(sc.logits[i], softcap);
        if (logits_out) memcpy(logits_out + n0 * V, sc.logits, sizeof(float) * c * V);
        double ls = 0.0, cnt = 0.0, cor = 0.0;
#pragma omp parallel for reduction(+ : ls, cnt, cor) schedule(static) if ((int64_t)c * V > 32768)
        for (int i = 0; i < c; i++) {
            float m = mask ? mask[n0 + i] : 1.0f;
            int am;
            float* row = sc.logits + (int64_t)i * V;
            double l = softcap > 0.0f ? ce_row_capped(row, V, targets[n0 + i], m, grad_scale, dxf != NULL, &am, softcap)
                                      : ce_row(row, V, targets[n0 + i], m, grad_scale, dxf != NULL, &am);
            if (m != 0.0f) { ls += m * l; cnt += m; cor += m * (am == targets[n0 + i]); }
        }
        st->loss_sum += ls;
        st->count += cnt;
        st->correct += cor;
        if (!dxf) continue;
        if (dW) matmul_tn(dW, sc.logits, sc.z, V, d, c, 1.0f, 1);  // trained head: dW += dlogits^T z
        matmul_nn(sc.dz, sc.logits, W, c, d, V, 1.0f, 0);
        if (dgamma) rmsnorm_gamma_grad(dgamma, sc.dz, xf + n0 * d, sc.r, c, d);
        rmsnorm_backward(dxf + n0 * d, sc.dz, xf + n0 * d, sc.r, gamma, c, d);
    }
}

// Softmax cross-entropy over a few rows of fp32 logits (a classification head), every row counted:
// loss, count and correct add to st; dlogits [rows, V] = grad_scale * (softmax - onehot) when grad.
// logits are left as they are (ce_row works in place: on a copy of the row in dlogits).
static void softmax_ce_rows(float* dlogits, const float* logits, const int* targets, int64_t rows, int V,
                            float grad_scale, int grad, LossStats* st) {
    for (int64_t i = 0; i < rows; i++) {
        float* row = dlogits + i * V;
        memcpy(row, logits + i * V, sizeof(float) * V);
        int am;
        st->loss_sum += ce_row(row, V, targets[i], 1.0f, grad_scale, grad, &am);
        st->correct += am == targets[i];
        st->count += 1;
    }
}
