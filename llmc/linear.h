// linear.h: the linear layer both models are built from: a frozen weight W [out, in] and optional
// frozen bias, plus an optional LoRA adapter (A [r, in], B [out, r], trainable) whose update is
// scale * B (A x). Forward, backward, the fresh-adapter init, the wiring of adapters into the
// flat trainable arena, the merge of a preceding norm's affine into W (MS norms), with the adapter
// still acting on the norm's affine output (the original model's parameterisation), and the
// merge's inverse (--full and --ms-lora merged: exports and adapters in the original model's terms),
// and LoRA dropout on the adapter's input while training (--lora-dropout, llmc/lora_dropout.h).
// These are the CPU twins (llmc/cpu/matmul.h); the CUDA backend runs the same layer through
// llmc/cuda/linear.cuh, with the device copy of each layer in LinearDevice (llmc/ops.h dispatches).
#pragma once
#include <math.h>
#include "common.h"
#include "rng.h"
#include "lora_dropout.h"
#include "cpu/matmul.h"
#include "nf4.h"

// The CUDA backend's copy of a layer (device pointers; all NULL on the CPU backend). The adapter's
// fp32 masters and gradients sit in the device trainable arena at the same offsets as the host
// mirror's; the products read the bf16 shadows of the masters (llmc/cuda/linear.cuh).
typedef struct {
    void *W, *bias;        // bf16 [out, in], [out] (bias NULL when the layer has none); under full
                           // fine-tuning W is the bf16 shadow of the fp32 master in the arena
    float *A, *B, *dA, *dB;
    void *A16, *B16;       // bf16 shadows of A and B
    float* dW;             // full fine-tuning: W's gradient (fp32, in the device arena)
    float* dbias;          // full fine-tuning of a layer with a bias: its gradient (fp32)
} LinearDevice;

typedef struct {
    int in, out;
    float* W;              // [out, in] frozen (host fp32; NULL on CUDA once uploaded, if not needed)
    float* bias;           // [out] frozen, or NULL (LLaMA has none; ViT always has one)
    float *A, *B;          // LoRA [r, in], [out, r]; NULL when not a target (host: the arena's mirror)
    float *dA, *dB;        // their gradients (accumulated over micro-batches)
    float* dW;             // full fine-tuning: W is trainable and this is its gradient; else NULL
    float* dbias;          // full fine-tuning: the bias's gradient (ViT; NULL when frozen or absent)
    LinearDevice dev;      // the CUDA backend's copy
    // MS norms, --ms-lora exact: W absorbed the preceding norm's gamma (and beta, into the bias) but
    // the adapter still sees gamma*z + beta, as in the original model (lora_norm_bind). Backend
    // buffers (fp32 on the CPU, bf16 on CUDA); NULL otherwise (beta NULL for RMSNorm).
    const void *norm_gamma, *norm_beta;
    void* norm_work;       // scratch shared by every such layer: lora_norm_work_bytes
    // --quant nf4: W (L->W on the CPU, L->dev.W on CUDA) is a dequantization scratch shared by
    // every layer, refilled from this NF4 tensor (llmc/nf4.h) before each product that reads W.
    // Backend buffers: the quantized tensor and the tables (NF4 values, dynamic map); else NULL.
    const void* nf4;
    const float* nf4_tables;
    // --lora-dropout: the model's dropout state (NULL: none) and this adapter's index in it
    const LoraDropout* drop;
    uint32_t drop_id;
    const char* name;      // the module's short name ("q", "fc1", ...): its rows in --profile
} Linear;

// Model FLOPs per token of a linear layer in one training step (MFU's numerator; recomputation
// is not counted): 2 in*out for the forward product, as many for the input gradient, as many again
// for the weight gradient when W trains (--full); a LoRA adapter of rank r adds its own three
// products, 6 r (in + out).
static double linear_train_flops(int64_t in, int64_t out, int w_trains, int lora_rank) {
    return (double)in * out * (w_trains ? 6.0 : 4.0) + 6.0 * lora_rank * (double)(in + out);
}

// The bias of a linear layer, added after its product (on CUDA: the GEMM epilogue). CPU kernel.
static void add_bias_rows(float* y, const float* bias, int64_t N, int out) {
#pragma omp parallel for schedule(static) if (N * out > 32768)
    for (int64_t n = 0; n < N; n++) {
        float* r = y + n * out;
        for (int j = 0; j < out; j++) r[j] += bias[j];
    }
}

// ---- an adapter behind a merged norm (MS norms, --ms-lora exact) ------------------------------
// The layer's input is the norm's bare output z; the original model feeds gamma*z + beta. W and
// the bias absorbed gamma and beta at load time; the adapter keeps A in the original layout and
// applies it as
//   A (gamma*z + beta) = (A diag(gamma)) z + A beta
// and its gradient, from dax = scale * dy B and the z the layer keeps anyway, is
//   dA += dax^T (gamma*z + beta) = (dax^T z) diag(gamma) + (sum_n dax_n) beta^T
// while z's gradient gets dax (A diag(gamma)). O(r * in) work per call, no activation memory:
// the scratch holds A diag(gamma) [r, in] and A beta [r] (activation type), dax^T z [r, in] and
// sum_n dax_n [r] (fp32).

typedef struct {
    void* Ag;              // A diag(gamma) [r, in]
    void* c;               // A beta [r]
    float* G;              // dax^T z [r, in]
    float* colsum;         // sum_n dax_n [r]
} LoraNormWork;

static size_t lora_align16(size_t b) { return (b + 15) & ~(size_t)15; }
static size_t lora_norm_work_bytes(int rank, int in, int abytes) {
    return lora_align16((size_t)rank * in * abytes) + lora_align16((size_t)rank * abytes) +
           lora_align16((size_t)rank * in * 4) + lora_align16((size_t)rank * 4);
}
static LoraNormWork lora_norm_work(const Linear* L, int rank, int abytes) {
    char* p = (char*)L->norm_work;
    LoraNormWork w;
    w.Ag = p; p += lora_align16((size_t)rank * L->in * abytes);
    w.c = p; p += lora_align16((size_t)rank * abytes);
    w.G = (float*)p; p += lora_align16((size_t)rank * L->in * 4);
    w.colsum = (float*)p;
    return w;
}

// Points L's adapter at the affine of the norm that W absorbed (backend buffers) and the shared
// scratch (lora_norm_work_bytes for the largest such layer).
static void lora_norm_bind(Linear* L, const void* gamma, const void* beta, void* work) {
    L->norm_gamma = gamma;
    L->norm_beta = beta;
    L->norm_work = work;
}

// Ag = A diag(gamma): column j of A [r, in] scaled by gamma_j. CPU kernel.
static void lora_fold_gamma(float* Ag, const float* A, const float* gamma, int rank, int in) {
    for (int i = 0; i < rank; i++)
        for (int j = 0; j < in; j++) Ag[(int64_t)i * in + j] = A[(int64_t)i * in + j] * gamma[j];
}

// c = A beta [r], in double. CPU kernel.
static void lora_beta_shift(float* c, const float* A, const float* beta, int rank, int in) {
    for (int i = 0; i < rank; i++) {
        double s = 0.0;
        for (int j = 0; j < in; j++) s += (double)A[(int64_t)i * in + j] * beta[j];
        c[i] = (float)s;
    }
}

// dA += G diag(gamma) + colsum beta^T (beta NULL: RMSNorm, no second term). CPU kernel.
static void lora_norm_grad(float* dA, const float* G, const float* gamma, const float* beta, const float* colsum,
                           int rank, int in) {
    for (int i = 0; i < rank; i++)
        for (int j = 0; j < in; j++) {
            int64_t k = (int64_t)i * in + j;
            dA[k] += G[k] * gamma[j] + (beta ? colsum[i] * beta[j] : 0.0f);
        }
}

// ---- LoRA dropout (--lora-dropout; llmc/lora_dropout.h) -------------------------------------------
// While training, the adapter reads xa = dropout(u), u its input (gamma*x + beta behind a merged
// norm, else x); the layer keeps x as it does anyway and xa is formed again in the backward, in a
// scratch shared by every layer (LoraDropout.work), so the mask costs no saved memory:
//   ax = xa A^T,   dA += dax^T xa,   dx += keep * scale * gamma * (dax A).
// Per element, u = fmaf(gamma, x, beta) (one rounding, as the CUDA twin) and xa = u * scale or 0.

static void lora_dropout_bind(Linear* L, const LoraDropout* d, uint32_t id) {
    L->drop = d;
    L->drop_id = id;
}
static int lora_dropout_on(const Linear* L) { return L->drop && L->drop->active; }
static uint64_t lora_dropout_layer_key(const Linear* L) {
    return lora_dropout_key(L->drop->seed, L->drop->step, L->drop_id);
}
// The stream position of the layer's first input element: its first row in the step's batch.
static uint64_t lora_dropout_layer_e0(const Linear* L) {
    return (uint64_t)(L->drop->row0 + L->drop->row_off) * L->in;
}

// xa [N, in] = dropout(u) for the micro-batch's rows (global rows row0 + row_off..). CPU kernel.
static void lora_dropout_input(float* xa, const float* x, const Linear* L, int64_t N) {
    const LoraDropout* d = L->drop;
    const float *gamma = (const float*)L->norm_gamma, *beta = (const float*)L->norm_beta;
    uint64_t key = lora_dropout_layer_key(L), e0 = lora_dropout_layer_e0(L);
    int in = L->in;
#pragma omp parallel for schedule(static) if (N * in > 32768)
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < in; j++) {
            int64_t i = n * in + j;
            float u = gamma ? fmaf(gamma[j], x[i], beta ? beta[j] : 0.0f) : x[i];
            xa[i] = lora_dropout_keep(key, e0 + (uint64_t)i, d->threshold) ? u * d->scale : 0.0f;
        }
}

// dx [N, in] += keep * scale * gamma * t, t = dax A: the input gradient through the dropout (and
// the norm's gamma). CPU kernel.
static void lora_dropout_input_backward(float* dx, const float* t, const Linear* L, int64_t N) {
    const LoraDropout* d = L->drop;
    const float* gamma = (const float*)L->norm_gamma;
    uint64_t key = lora_dropout_layer_key(L), e0 = lora_dropout_layer_e0(L);
    int in = L->in;
#pragma omp parallel for schedule(static) if (N * in > 32768)
    for (int64_t n = 0; n < N; n++)
        for (int j = 0; j < in; j++) {
            int64_t i = n * in + j;
            if (lora_dropout_keep(key, e0 + (uint64_t)i, d->threshold))
                dx[i] = fmaf(t[i] * d->scale, gamma ? gamma[j] : 1.0f, dx[i]);
        }
}

// y (+)= x W^T + bias: the frozen part of the layer (accumulate = 1 adds to y, a residual).
static void linear_forward_frozen(float* y, const float* x, const Linear* L, int64_t N, int accumulate) {
    if (L->nf4) nf4_dequantize(L->W, nf4_view((void*)L->nf4, (int64_t)L->out * L->in), L->nf4_tables);
    matmul_nt(y, x, L->W, (int)N, L->out, L->in, 1.0f, accumulate);
    if (L->bias) add_bias_rows(y, L->bias, N, L->out);
}

// y += scale * (x A^T) B^T, keeping ax = x A^T for the LoRA backward. Behind a merged norm the
// adapter's input is gamma*x + beta (see above).
static void linear_forward_lora(float* y, const float* x, const Linear* L, float* ax, int64_t N, int rank,
                                float scale) {
    if (!L->A) return;
    if (lora_dropout_on(L)) {  // training with --lora-dropout: the adapter reads dropout(its input)
        float* xa = (float*)L->drop->work;
        lora_dropout_input(xa, x, L, N);
        matmul_nt(ax, xa, L->A, (int)N, rank, L->in, 1.0f, 0);
    } else if (L->norm_gamma) {
        LoraNormWork w = lora_norm_work(L, rank, 4);
        lora_fold_gamma((float*)w.Ag, L->A, (const float*)L->norm_gamma, rank, L->in);
        matmul_nt(ax, x, (const float*)w.Ag, (int)N, rank, L->in, 1.0f, 0);
        if (L->norm_beta) {
            lora_beta_shift((float*)w.c, L->A, (const float*)L->norm_beta, rank, L->in);
            add_bias_rows(ax, (const float*)w.c, N, rank);
        }
    } else {
        matmul_nt(ax, x, L->A, (int)N, rank, L->in, 1.0f, 0);
    }
    matmul_nt(y, ax, L->B, (int)N, L->out, rank, scale, 1);
}

// db[j] += sum_n dy[n, j]: the gradient of a trained bias. Columns in parallel, rows in order.
static void bias_grad_rows(float* db, const float* dy, int64_t N, int out) {
#pragma omp parallel for schedule(static) if (N * out > 32768)
    for (int j = 0; j < out; j++) {
        double s = 0.0;
        for (int64_t n = 0; n < N; n++) s += dy[n * out + j];
        db[j] += (float)s;
    }
}

// Given dy [N, out], the frozen part: dx (+)= dy W, and under full fine-tuning dW += dy^T x and
// (with dbias) db += sum_n dy. dx NULL: no input gradient (the patch embedding).
static void linear_backward_frozen(float* dx, const float* dy, const float* x, const Linear* L, int64_t N,
                                   int accumulate) {
    if (dx && L->nf4) nf4_dequantize(L->W, nf4_view((void*)L->nf4, (int64_t)L->out * L->in), L->nf4_tables);
    if (dx) matmul_nn(dx, dy, L->W, (int)N, L->in, L->out, 1.0f, accumulate);
    if (L->dW) matmul_tn(L->dW, dy, x, L->out, L->in, (int)N, 1.0f, 1);
    if (L->dbias) bias_grad_rows(L->dbias, dy, N, L->out);
}

// The adapter's part, after the frozen part: LoRA grads accumulate and dx += scale * (dy B) A.
// x is the layer's input (its adapter's gradient needs it).
static void linear_backward_lora(float* dx, const float* dy, const float* x, const float* ax, const Linear* L,
                                 float* dax, int64_t N, int rank, float scale) {
    if (!L->A) return;
    matmul_tn(L->dB, dy, ax, L->out, rank, (int)N, scale, 1);
    matmul_nn(dax, dy, L->B, (int)N, rank, L->out, scale, 0);
    if (lora_dropout_on(L)) {  // the forward's adapter input, mask regenerated, then back through it
        float* xa = (float*)L->drop->work;
        lora_dropout_input(xa, x, L, N);
        matmul_tn(L->dA, dax, xa, rank, L->in, (int)N, 1.0f, 1);
        if (!dx) return;
        matmul_nn(xa, dax, L->A, (int)N, L->in, rank, 1.0f, 0);
        lora_dropout_input_backward(dx, xa, L, N);
        return;
    }
    if (L->norm_gamma) {  // behind a merged norm: the adapter's input is gamma*x + beta
        LoraNormWork w = lora_norm_work(L, rank, 4);
        const float *gamma = (const float*)L->norm_gamma, *beta = (const float*)L->norm_beta;
        matmul_tn(w.G, dax, x, rank, L->in, (int)N, 1.0f, 0);
        if (beta) {
            memset(w.colsum, 0, sizeof(float) * rank);
            bias_grad_rows(w.colsum, dax, N, rank);
        }
        lora_norm_grad(L->dA, w.G, gamma, beta, w.colsum, rank, L->in);
        lora_fold_gamma((float*)w.Ag, L->A, gamma, rank, L->in);
        matmul_nn(dx, dax, (const float*)w.Ag, (int)N, L->in, rank, 1.0f, 1);
        return;
    }
    matmul_tn(L->dA, dax, x, rank, L->in, (int)N, 1.0f, 1);
    matmul_nn(dx, dax, L->A, (int)N, L->in, rank, 1.0f, 1);
}

// Points the adapter of L at the next A then B of the flat trainable arena (and its gradient
// twin) starting at *off, and advances *off. The models call it layer-major in target order, so
// the arena layout is fixed by the config and the target list alone.
static void lora_bind(Linear* L, float* params, float* grads, int64_t* off, int rank) {
    L->A = params + *off; L->dA = grads + *off; *off += (int64_t)rank * L->in;
    L->B = params + *off; L->dB = grads + *off; *off += (int64_t)rank * L->out;
}

// The same for the CUDA copy: masters and gradients in the device arenas, shadows in the bf16
// arena of the same layout (2-byte elements, hence the separate pointer arithmetic).
static void lora_bind_device(Linear* L, float* params, float* grads, void* params16, int64_t off, int rank) {
    LinearDevice* d = &L->dev;
    int64_t offB = off + (int64_t)rank * L->in;
    d->A = params + off; d->dA = grads + off; d->A16 = (uint16_t*)params16 + off;
    d->B = params + offB; d->dB = grads + offB; d->B16 = (uint16_t*)params16 + offB;
}

// An adapter that shares `lead`'s A (the same values and the same gradient, into which each
// sharer's backward adds its part) and takes the next B [out, r] of the arena at *off: a fused
// module's parts (Phi-3's q, k, v) whose B rows then follow the lead's B, as the fused B is stored.
static void lora_bind_shared_a(Linear* L, const Linear* lead, float* params, float* grads, int64_t* off, int rank) {
    L->A = lead->A; L->dA = lead->dA;
    L->B = params + *off; L->dB = grads + *off; *off += (int64_t)rank * L->out;
}
static void lora_bind_shared_a_device(Linear* L, const Linear* lead, float* params, float* grads, void* params16,
                                      int64_t off) {
    LinearDevice* d = &L->dev;
    d->A = lead->dev.A; d->dA = lead->dev.dA; d->A16 = lead->dev.A16;
    d->B = params + off; d->dB = grads + off; d->B16 = (uint16_t*)params16 + off;
}

// A fresh adapter: A ~ kaiming-uniform (bound 1/sqrt(in), as PEFT), B = 0, so step 0 is exactly
// the pretrained model. Drawn on the host from the caller's stream so every backend starts equal.
static void lora_init(Linear* L, int rank, Rng* rng) {
    float bound = 1.0f / sqrtf((float)L->in);
    for (int64_t i = 0; i < (int64_t)rank * L->in; i++) L->A[i] = (2.0f * rng_uniform(rng) - 1.0f) * bound;
    memset(L->B, 0, sizeof(float) * rank * L->out);
}

// MS norms: folds the affine of the norm that feeds a linear layer into its weight W [out, in] (and
// bias), once at load time on the host, so that the layer applied to the parameter-free norm
// output z equals it applied to gamma*z + beta:
//   b' = b + W beta (with the original W, hence first), W' = W diag(gamma).
// beta NULL: RMSNorm (no shift). A shift needs a bias to land in. Finite factors can have a
// product beyond fp32's range (gamma 1e30 times a weight 1e10): such a layer is refused, naming
// `module` (the checkpoint's tensor), rather than trained with Inf weights.
static void merge_norm_affine(float* W, float* bias, int out, int in, const float* gamma, const float* beta,
                              const char* module) {
    if (beta && !bias) fail("internal: merging a norm's beta needs a linear with a bias");
    for (int o = 0; o < out; o++) {
        float* w = W + (int64_t)o * in;
        if (beta) {
            double s = 0.0;
            for (int i = 0; i < in; i++) s += (double)w[i] * beta[i];
            bias[o] += (float)s;
            if (!isfinite(bias[o]))
                fail("%s: merging its norm's beta into the bias (--norm ms) overflows fp32 at row %d (%g); "
                     "train with --norm std", module, o, (double)bias[o]);
        }
        for (int i = 0; i < in; i++) {
            float merged = w[i] * gamma[i];
            if (!isfinite(merged))
                fail("%s: merging its norm's gamma into the weight (--norm ms) overflows fp32 at [%d][%d] "
                     "(%g x %g); train with --norm std", module, o, i, (double)w[i], (double)gamma[i]);
            w[i] = merged;
        }
    }
}
static void linear_merge_norm_affine(Linear* L, const float* gamma, const float* beta, const char* module) {
    merge_norm_affine(L->W, L->bias, L->out, L->in, gamma, beta, module);
}

// Its inverse, on a merged weight W' [out, in] (its adapter folded in, if any) and bias b': the
// original layer's W = W' diag(1/gamma), b = b' - W' (beta / gamma). A zero gamma has no inverse:
// fails, naming the module.
static void unmerge_norm_affine(float* W, float* b, int out, int in, const float* g, const float* be,
                                const char* module) {
    double* u = (double*)xmalloc(sizeof(double) * in);
    for (int j = 0; j < in; j++) {
        if (g[j] == 0.0f)
            fail("cannot export %s to the original model: its norm's gamma[%d] is 0, so the merged layer has no "
                 "inverse (train with --norm std)", module, j);
        u[j] = (double)be[j] / g[j];
    }
    for (int o = 0; o < out; o++) {
        float* w = W + (int64_t)o * in;
        double s = 0.0;
        for (int j = 0; j < in; j++) s += (double)w[j] * u[j];
        b[o] = (float)((double)b[o] - s);
        for (int j = 0; j < in; j++) w[j] = (float)((double)w[j] / g[j]);
    }
    free(u);
}

// out = (W + scale*B*A) (beta / gamma): the shift between the bias of a merged layer with an
// adapter and the original layer's (what a PEFT adapter of a merged layer carries in its bias),
// without forming B*A; fails when some gamma_j is 0 (no inverse).
static void lora_merged_shift(float* out, const Linear* L, int r, float scale, const float* gamma, const float* beta,
                              const char* module) {
    float* u = (float*)xmalloc(sizeof(float) * L->in);
    for (int j = 0; j < L->in; j++) {
        if (gamma[j] == 0.0f)
            fail(
                "cannot map the adapter of %s between the merged and the original model: its norm's gamma[%d] is 0 "
                "(train with --norm std)",
                module, j);
        u[j] = beta[j] / gamma[j];
    }
    float au[64];
    float* ax = r <= 64 ? au : (float*)xmalloc(sizeof(float) * r);
    for (int i = 0; i < r; i++) {
        double s = 0.0;
        for (int j = 0; j < L->in; j++) s += (double)L->A[(int64_t)i * L->in + j] * u[j];
        ax[i] = (float)s;
    }
    for (int o = 0; o < L->out; o++) {
        double s = 0.0;
        for (int j = 0; j < L->in; j++) s += (double)L->W[(int64_t)o * L->in + j] * u[j];
        for (int i = 0; i < r; i++) s += (double)scale * L->B[(int64_t)o * r + i] * ax[i];
        out[o] = (float)s;
    }
    if (ax != au) free(ax);
    free(u);
}
