// ops.h: the operations the model definitions call, each dispatched to the backend chosen at run
// time: llmc/cpu (fp32) or llmc/cuda (bf16 activations and frozen weights, fp32 statistics,
// masters and gradients). A model is written once against these; its activation and weight
// buffers are `void*` whose element type is the backend's (Backend.abytes / wbytes), statistics
// (norm r, attention lse, loss) are fp32 on both, index buffers (token ids, positions) int32.
// Every op has the meaning of its CPU twin in llmc/cpu/*.h; the CUDA kernels are checked against
// those twins one by one in dev/cuda, and whole models are checked backend against backend in
// test/test_cuda_models.py (on the CPU emulator in CI, on a GPU by make test-gpu).
#pragma once
#include "backend.h"
#include "lora.h"
#include "cpu/matmul.h"
#include "cpu/norms.h"
#include "cpu/activations.h"
#include "cpu/attention.h"
#include "cpu/loss.h"
#ifdef LLMC_HAVE_CUDA
#include "cuda/norms.cuh"
#include "cuda/activations.cuh"
#include "cuda/attention.cuh"
#include "cuda/matmul.cuh"
#include "cuda/linear.cuh"
#include "cuda/loss.cuh"
#endif

#define F32(p) ((float*)(p))
#define CF32(p) ((const float*)(p))
#ifdef LLMC_HAVE_CUDA
#define B16(p) ((bf16*)(p))
#define CB16(p) ((const bf16*)(p))
#define OP_CUDA(be, call) if ((be)->cuda) { call; return; }
#else
#define OP_CUDA(be, call)
#endif

// ---- copies ------------------------------------------------------------------------------------

// dst = src, n activation elements (device-to-device on CUDA).
static void op_copy(const Backend* be, void* dst, const void* src, int64_t n) {
    if (dst == src || n == 0) return;
    OP_CUDA(be, CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * be->abytes, cudaMemcpyDeviceToDevice, be->stream)))
    memcpy(dst, src, (size_t)n * be->abytes);
}

static void op_zero(const Backend* be, void* p, size_t bytes) {
    if (!bytes) return;
    OP_CUDA(be, CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, be->stream)))
    memset(p, 0, bytes);
}

// out = a * b elementwise (rebuilding SwiGLU's down input from silu(g) and u).
static void op_mul(const Backend* be, void* out, const void* a, const void* b, int64_t n) {
    OP_CUDA(be, multiply_cuda(B16(out), CB16(a), CB16(b), n, be->stream))
#pragma omp parallel for schedule(static) if (n > 32768)
    for (int64_t i = 0; i < n; i++) F32(out)[i] = CF32(a)[i] * CF32(b)[i];
}

// x[n] = embed[ids[n]] (rows of d).
static void op_embed(const Backend* be, void* x, const void* embed, const int* ids, int64_t N, int d) {
    OP_CUDA(be, embed_tokens_cuda(B16(x), CB16(embed), ids, N, d, be->stream))
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < N; n++) memcpy(F32(x) + n * d, CF32(embed) + (int64_t)ids[n] * d, sizeof(float) * d);
}

// ---- norms -------------------------------------------------------------------------------------

static void op_rmsnorm_forward(const Backend* be, void* y, float* r, const void* x, const void* gamma, int64_t N, int d, float eps) {
    OP_CUDA(be, rmsnorm_forward_cuda(B16(y), r, CB16(x), CB16(gamma), N, d, eps, be->stream))
    rmsnorm_forward(F32(y), r, CF32(x), CF32(gamma), N, d, eps);
}
// dx += standard RMSNorm backward from the kept input x.
static void op_rmsnorm_backward(const Backend* be, void* dx, const void* dy, const void* x, const float* r, const void* gamma, int64_t N, int d) {
    OP_CUDA(be, rmsnorm_backward_cuda(B16(dx), CB16(dy), CB16(x), r, CB16(gamma), N, d, be->stream))
    rmsnorm_backward(F32(dx), CF32(dy), CF32(x), r, CF32(gamma), N, d);
}
// dx += MS-RMSNorm backward from the normalised output z and r alone.
static void op_rmsnorm_ms_backward(const Backend* be, void* dx, const void* dz, const void* z, const float* r, int64_t N, int d) {
    OP_CUDA(be, rmsnorm_ms_backward_cuda(B16(dx), CB16(dz), CB16(z), r, N, d, be->stream))
    rmsnorm_ms_backward(F32(dx), CF32(dz), CF32(z), r, N, d);
}

// ---- the linear layer with its adapter ---------------------------------------------------------

#ifdef LLMC_HAVE_CUDA
static LinearCuda linear_cuda_view(const Linear* L) {
    LinearCuda v = {L->in, L->out, CB16(L->dev.W), CB16(L->dev.bias), L->dev.A, L->dev.B, B16(L->dev.A16), B16(L->dev.B16),
                    L->dev.dA, L->dev.dB};
    if (!L->A) v.A = v.B = NULL;
    return v;
}
#endif

// y (+)= x W^T + bias + scale * (x A^T) B^T, keeping ax for the adapter's backward.
static void op_linear_forward(const Backend* be, void* y, const void* x, const Linear* L, void* ax, int64_t N, int rank, float scale, int accumulate) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { LinearCuda v = linear_cuda_view(L); linear_forward_cuda(B16(y), CB16(x), &v, B16(ax), N, rank, scale, accumulate, be->stream); return; }
#endif
    linear_forward(F32(y), CF32(x), L, F32(ax), N, rank, scale, accumulate);
}

// dx (+)= dy W + scale * (dy B) A; adapter (or, on the CPU, full-fine-tuning) gradients accumulate.
static void op_linear_backward(const Backend* be, void* dx, const void* dy, const void* x, const void* ax, const Linear* L, void* dax,
                               int64_t N, int rank, float scale, int accumulate) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        LinearCuda v = linear_cuda_view(L);
        linear_backward_cuda(B16(dx), CB16(dy), CB16(x), CB16(ax), &v, B16(dax), N, rank, scale, accumulate, be->stream);
        return;
    }
#endif
    linear_backward(F32(dx), CF32(dy), CF32(x), CF32(ax), L, F32(dax), N, rank, scale, accumulate);
}

// The backend's frozen weight of L (what the plan allocates and the loader fills).
static void** linear_weight_slot(const Backend* be, Linear* L) { return be->cuda ? &L->dev.W : (void**)&L->W; }
static void** linear_bias_slot(const Backend* be, Linear* L) { return be->cuda ? &L->dev.bias : (void**)&L->bias; }

// ---- attention ---------------------------------------------------------------------------------

static void op_rope(const Backend* be, void* x, const float* cos_t, const float* sin_t, const int* pos, int64_t N, int T, int nheads,
                    int hd, int inverse) {
    OP_CUDA(be, rope_apply_cuda(B16(x), cos_t, sin_t, pos, N, T, nheads, hd, inverse, be->stream))
    rope_apply(F32(x), cos_t, sin_t, pos, N, T, nheads, hd, inverse);
}

static void op_attention_forward(const Backend* be, void* o, float* lse, const void* q, const void* k, const void* v, AttnShape s) {
    OP_CUDA(be, attention_forward_cuda(B16(o), lse, CB16(q), CB16(k), CB16(v), s, be->stream))
    attention_forward(F32(o), lse, CF32(q), CF32(k), CF32(v), s);
}

// scratch: B*H*T floats on CUDA (planned with the model; unused on the CPU).
static void op_attention_backward(const Backend* be, void* dq, void* dk, void* dv, const void* dout, const void* q, const void* k,
                                  const void* v, const void* o, const float* lse, float* scratch, AttnShape s) {
    OP_CUDA(be, attention_backward_cuda(B16(dq), B16(dk), B16(dv), CB16(dout), CB16(q), CB16(k), CB16(v), CB16(o), lse, scratch, s, be->stream))
    (void)scratch;
    attention_backward(F32(dq), F32(dk), F32(dv), CF32(dout), CF32(q), CF32(k), CF32(v), CF32(o), lse, s);
}

// ---- activations -------------------------------------------------------------------------------

static void op_swiglu_forward(const Backend* be, void* p, void* sg, uint8_t* codes, const void* g, const void* u, int64_t n) {
    OP_CUDA(be, swiglu_forward_cuda(B16(p), B16(sg), codes, CB16(g), CB16(u), n, be->stream))
    swiglu_forward(F32(p), F32(sg), codes, CF32(g), CF32(u), n);
}
static void op_swiglu_backward(const Backend* be, void* dg, void* du, const void* dp, const void* sg, const void* u, const void* g,
                               const uint8_t* codes, int64_t n) {
    OP_CUDA(be, swiglu_backward_cuda(B16(dg), B16(du), CB16(dp), CB16(sg), CB16(u), CB16(g), codes, n, be->stream))
    swiglu_backward(F32(dg), F32(du), CF32(dp), CF32(sg), CF32(u), CF32(g), codes, n);
}

// ---- the LM head and loss ----------------------------------------------------------------------

// The loss chunk's buffers, typed per backend (planned by op_plan_lm_head_loss).
typedef struct {
    void* z;               // [chunk, d] activations
    float* r;              // [chunk]
    float* logits;         // [chunk, V] fp32
    void* dlogits;         // [chunk, V] (CUDA: bf16; the CPU turns logits into dlogits in place)
    void* dz;              // [chunk, d] (CPU fp32, CUDA bf16)
    float* row_stats;      // [chunk, 3] (CUDA)
    double* stats;         // [3] (CUDA)
} LossBuffers;

// At most ~64 MiB of fp32 logits per chunk, never the whole tokens x vocab matrix.
static int64_t lm_head_chunk(int64_t N, int64_t V) {
    int64_t chunk = (64ll << 20) / (V * 4);
    if (chunk < 1) chunk = 1;
    return chunk > N ? N : chunk;
}

static void op_plan_lm_head_loss(const Backend* be, MemPlan* p, LossBuffers* lb, int64_t chunk, int64_t d, int64_t V) {
    int a = be->abytes;
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_z", chunk * d * a, &lb->z);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_r", chunk * 4, &lb->r);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_logits", chunk * V * 4, &lb->logits);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_dz", chunk * d * a, &lb->dz);
    if (!be->cuda) return;
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_dlogits", chunk * V * a, &lb->dlogits);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_row_stats", chunk * 3 * 4, &lb->row_stats);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_stats", 3 * 8, &lb->stats);
}

// Final RMSNorm + head + CE over N tokens in chunks; dxf (when non-NULL) accumulates the gradient
// of the norm's input; logits_out (backend memory, fp32 [N, V]) receives the logits when non-NULL.
static void op_lm_head_loss(const Backend* be, const void* xf, const void* gamma, float eps, const void* W, int V, int d, const int* targets,
                            const float* mask, int64_t N, int chunk, float grad_scale, void* dxf, float* logits_out, const LossBuffers* lb,
                            LossStats* st) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        LossScratchCuda sc = {B16(lb->z), lb->r, lb->logits, B16(lb->dlogits), B16(lb->dz), lb->row_stats, lb->stats};
        lm_head_loss_cuda(CB16(xf), CB16(gamma), eps, CB16(W), V, d, targets, mask, N, chunk, grad_scale, B16(dxf), logits_out, sc, st, be->stream);
        return;
    }
#endif
    LossScratch sc = {F32(lb->z), lb->r, lb->logits, F32(lb->dz)};
    lm_head_loss(CF32(xf), CF32(gamma), eps, CF32(W), V, d, targets, mask, N, chunk, grad_scale, F32(dxf), logits_out, sc, st);
}
