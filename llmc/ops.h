// ops.h: the operations the model definitions call, each dispatched to the backend chosen at run
// time: llmc/cpu (fp32) or llmc/cuda (bf16 activations and frozen weights, fp32 statistics,
// masters and gradients). A model is written once against these; its activation and weight
// buffers are `void*` whose element type is the backend's (Backend.abytes / wbytes), statistics
// (norm r, attention lse, loss) are fp32 on both, index buffers (token ids, positions) int32.
// Every op has the meaning of its CPU twin in llmc/cpu/*.h; the CUDA kernels are checked against
// those twins one by one in dev/cuda, and whole models are checked backend against backend in
// test/cuda/test_llama_cuda.py and test/cuda/test_vit_cuda.py (on the CPU emulator in CI, on a GPU by
// make test-gpu).
#pragma once
#include "backend.h"
#include "train/profile.h"
#include "linear.h"
#include "cpu/matmul.h"
#include "cpu/embedding.h"
#include "vision/resample.h"
#include "cpu/norms.h"
#include "cpu/activations.h"
#include "cpu/attention.h"
#include "cpu/loss.h"
#include "cpu/misc.h"
#include "memory/cuda_workspace.h"
#include "memory/loss_buffers.h"
#ifdef LLMC_HAVE_CUDA
#include "cuda/norms.cuh"
#include "cuda/activations.cuh"
#include "cuda/attention.cuh"
#include "cuda/attention_gemm.cuh"
#ifdef LLMC_HAVE_CUDNN  // set by make when it links llmc/cuda/attention_cudnn.cu (never on the emulator)
#include "cuda/attention_cudnn.h"
#endif
#include "cuda/matmul.cuh"
#include "cuda/linear.cuh"
#include "cuda/loss.cuh"
#endif

#define F32(p) ((float*)(p))
#define CF32(p) ((const float*)(p))
#ifdef LLMC_HAVE_CUDA
#define B16(p) ((bf16*)(p))
#define CB16(p) ((const bf16*)(p))
#endif


// What an op does with its output: write it, or add to what it holds (the residual stream; a
// gradient that several consumers of one input each contribute to).
typedef enum { OUT_WRITE = 0, OUT_ADD = 1 } OutMode;
// RoPE's direction: rotate (forward), or rotate back (its backward, a rotation by minus the angle).
typedef enum { ROPE_FORWARD = 0, ROPE_INVERSE = 1 } RopeDir;
// ---- copies ------------------------------------------------------------------------------------

// dst = src, n activation elements (device-to-device on CUDA).
static void op_copy(const Backend* be, void* dst, const void* src, int64_t n) {
    PROF_SCOPE(be, "copy", "fwd", 0, 2.0 * n * (double)be->abytes);
    if (dst == src || n == 0) return;
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        CUDA_CHECK(cudaMemcpyAsync(dst, src, (size_t)n * be->abytes, cudaMemcpyDeviceToDevice, be->stream));
        return;
    }
#endif
    memcpy(dst, src, (size_t)n * be->abytes);
}

static void op_zero(const Backend* be, void* p, size_t bytes) {
    if (!bytes) return;
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { CUDA_CHECK(cudaMemsetAsync(p, 0, bytes, be->stream)); return; }
#endif
    memset(p, 0, bytes);
}

// out = a * b elementwise (rebuilding SwiGLU's down input from silu(g) and u).
static void op_mul(const Backend* be, void* out, const void* a, const void* b, int64_t n) {
    PROF_SCOPE(be, "swiglu recompute", "bwd", n, 3.0 * n * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { multiply_cuda(B16(out), CB16(a), CB16(b), n, be->stream); return; }
#endif
    multiply(F32(out), CF32(a), CF32(b), n);
}

// y += x elementwise: Gemma's post-normed branch outputs onto the residual stream.
static void op_add(const Backend* be, void* y, const void* x, int64_t n) {
    PROF_SCOPE(be, "residual add", "fwd", n, 3.0 * n * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { add_inplace_cuda(B16(y), CB16(x), n, be->stream); return; }
#endif
    add_inplace(F32(y), CF32(x), n);
}

// y[n, i] = x[n, i] * g[i] over rows of d (y may be x): Qwen3's q/k norm gamma under MS norms.
static void op_scale_columns(const Backend* be, void* y, const void* x, const void* g, int64_t rows, int d) {
    PROF_SCOPE(be, "qk norm gamma", "fwd", (double)rows * d, 2.0 * rows * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { scale_columns_cuda(B16(y), CB16(x), CB16(g), rows, d, be->stream); return; }
#endif
    scale_columns(F32(y), CF32(x), CF32(g), rows, d);
}

// x[n] = embed[ids[n]] (rows of d).
static void op_embed(const Backend* be, void* x, const void* embed, const int* ids, int64_t N, int d) {
    PROF_SCOPE(be, "embedding", "fwd", 0, 2.0 * N * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { embed_tokens_cuda(B16(x), CB16(embed), ids, N, d, be->stream); return; }
#endif
    embed_tokens(F32(x), CF32(embed), ids, N, d);
}

// dE[ids[n]] += dx[n]: the gradient of a trained embedding (fp32 dE on both backends), each row's
// tokens summed in text order before the add (order: embedding_token_order of the batch); row
// skip_id (>= 0: a padding_idx) gets none.
static void op_embedding_backward(const Backend* be, float* dE, const void* dx, const int* ids, const int* order,
                                  int64_t N, int d, int skip_id) {
    PROF_SCOPE(be, "embedding", "bwd", N * (double)d, N * d * ((double)be->abytes + 8.0));
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { embedding_backward_cuda(dE, CB16(dx), ids, order, N, d, be->stream, skip_id); return; }
#endif
    embedding_backward(dE, CF32(dx), ids, order, N, d, skip_id);
}

// ---- norms -------------------------------------------------------------------------------------

static void op_rmsnorm_forward(const Backend* be, void* y, float* r, const void* x, const void* gamma, int64_t N, int d,
                               float eps) {
    PROF_SCOPE(be, "rmsnorm", "fwd", 4.0 * N * d, 2.0 * N * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { rmsnorm_forward_cuda(B16(y), r, CB16(x), CB16(gamma), N, d, eps, be->stream); return; }
#endif
    rmsnorm_forward(F32(y), r, CF32(x), CF32(gamma), N, d, eps);
}
// dx += standard RMSNorm backward from the kept input x.
static void op_rmsnorm_backward(const Backend* be, void* dx, const void* dy, const void* x, const float* r,
                                const void* gamma, int64_t N, int d) {
    PROF_SCOPE(be, "rmsnorm", "bwd", 6.0 * N * d, 4.0 * N * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { rmsnorm_backward_cuda(B16(dx), CB16(dy), CB16(x), r, CB16(gamma), N, d, be->stream); return; }
#endif
    rmsnorm_backward(F32(dx), CF32(dy), CF32(x), r, CF32(gamma), N, d);
}
// dgamma += sum over rows of dy * x * r: a trained RMSNorm gamma (fp32 dgamma on both backends).
static void op_rmsnorm_gamma_grad(const Backend* be, float* dgamma, const void* dy, const void* x, const float* r,
                                  int64_t N, int d) {
    PROF_SCOPE(be, "rmsnorm gamma", "bwd", 3.0 * N * d, 2.0 * N * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { rmsnorm_gamma_grad_cuda(dgamma, CB16(dy), CB16(x), r, N, d, be->stream); return; }
#endif
    rmsnorm_gamma_grad(dgamma, CF32(dy), CF32(x), r, N, d);
}
// dx += MS-RMSNorm backward from the normalised output z and r alone.
static void op_rmsnorm_ms_backward(const Backend* be, void* dx, const void* dz, const void* z, const float* r,
                                   int64_t N, int d) {
    PROF_SCOPE(be, "rmsnorm", "bwd", 5.0 * N * d, 4.0 * N * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { rmsnorm_ms_backward_cuda(B16(dx), CB16(dz), CB16(z), r, N, d, be->stream); return; }
#endif
    rmsnorm_ms_backward(F32(dx), CF32(dz), CF32(z), r, N, d);
}

// ---- the linear layer with its adapter ---------------------------------------------------------

// The --profile row of L's frozen product (its name) or of its adapter ("NAME lora"), in buf[40].
static const char* linear_prof_name(const Linear* L, int lora, char* buf) {
    snprintf(buf, 40, "%s%s", L->name ? L->name : "linear", lora ? " lora" : "");
    return buf;
}

// y (+)= x W^T + bias + scale * (x A^T) B^T, keeping ax for the adapter's backward.
static void op_linear_forward(const Backend* be, void* y, const void* x, const Linear* L, void* ax, int64_t N, int rank,
                              float scale, OutMode out) {
    int accumulate = out == OUT_ADD;
    char name[40];
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {  // one row for the layer; the adapter's part first where the frozen product's epilogue adds it
        PROF_SCOPE(be, linear_prof_name(L, 0, name), "fwd",
                   2.0 * N * L->in * L->out + (L->A ? 2.0 * N * rank * (L->in + L->out) : 0.0),
                   (double)L->in * L->out * be->wbytes);
        int first = lora_runs_first(L, lora_fold_choice(), LINEAR_FORWARD);
        if (first) lora_forward_cuda(B16(y), CB16(x), L, B16(ax), N, rank, scale, accumulate, be->stream);
        if (L->nf4) nf4_dequantize_cuda(B16(L->dev.W), L->nf4, L->nf4_tables, (int64_t)L->out * L->in, be->stream);
        frozen_forward_cuda(B16(y), CB16(x), L, N, first ? OUT_ADD : accumulate, be->stream);
        if (L->dev.A && !first) lora_forward_cuda(B16(y), CB16(x), L, B16(ax), N, rank, scale, OUT_ADD, be->stream);
        return;
    }
#endif
    {
        PROF_SCOPE(be, linear_prof_name(L, 0, name), "fwd", 2.0 * N * L->in * L->out,
                   (double)L->in * L->out * be->wbytes);
        linear_forward_frozen(F32(y), CF32(x), L, N, accumulate);
    }
    PROF_SCOPE(be, linear_prof_name(L, 1, name), "fwd", L->A ? 2.0 * N * rank * (L->in + L->out) : 0.0, 0.0);
    linear_forward_lora(F32(y), CF32(x), L, F32(ax), N, rank, scale);
}

// dx (+)= dy W + scale * (dy B) A; adapter (or full-fine-tuning) gradients accumulate.
static void op_linear_backward(const Backend* be, void* dx, const void* dy, const void* x, const void* ax,
                               const Linear* L, void* dax, int64_t N, int rank, float scale, OutMode out) {
    int accumulate = out == OUT_ADD;
    char name[40];
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {  // one row for the layer, as in the forward
        PROF_SCOPE(be, linear_prof_name(L, 0, name), "bwd",
                   2.0 * N * L->in * L->out * ((dx ? 1 : 0) + (L->dW ? 1 : 0)) +
                       (L->A ? 4.0 * N * rank * (L->in + L->out) : 0.0),
                   (double)L->in * L->out * be->wbytes);
        int first = lora_runs_first(L, lora_fold_choice(), LINEAR_BACKWARD);
        bf16 *gx = B16(dx), *gax = B16(dax);
        if (first) lora_backward_cuda(gx, CB16(dy), CB16(x), CB16(ax), L, gax, N, rank, scale, accumulate, be->stream);
        if (dx && L->nf4)
            nf4_dequantize_cuda(B16(L->dev.W), L->nf4, L->nf4_tables, (int64_t)L->out * L->in, be->stream);
        frozen_backward_cuda(gx, CB16(dy), CB16(x), L, N, first ? OUT_ADD : accumulate, be->stream);
        if (L->dev.A && !first)
            lora_backward_cuda(gx, CB16(dy), CB16(x), CB16(ax), L, gax, N, rank, scale, OUT_ADD, be->stream);
        return;
    }
#endif
    {
        PROF_SCOPE(be, linear_prof_name(L, 0, name), "bwd", 2.0 * N * L->in * L->out * ((dx ? 1 : 0) + (L->dW ? 1 : 0)),
                   (double)L->in * L->out * be->wbytes);
        linear_backward_frozen(F32(dx), CF32(dy), CF32(x), L, N, accumulate);
    }
    PROF_SCOPE(be, linear_prof_name(L, 1, name), "bwd", L->A ? 4.0 * N * rank * (L->in + L->out) : 0.0, 0.0);
    linear_backward_lora(F32(dx), CF32(dy), CF32(x), CF32(ax), L, F32(dax), N, rank, scale);
}

// The backend's frozen weight of L (what the plan allocates and the loader fills).
static void** linear_weight_slot(const Backend* be, Linear* L) { return be->cuda ? &L->dev.W : (void**)&L->W; }
static void** linear_bias_slot(const Backend* be, Linear* L) { return be->cuda ? &L->dev.bias : (void**)&L->bias; }

// ---- attention ---------------------------------------------------------------------------------

// --profile's model work of attention: `products` products of T x T x hd per (b, h) (2 forward:
// q k^T and p v; 4 backward), halved under the causal mask; a sliding window W < T: T x W keys less
// the first rows' missing ones.
static double attn_flops(AttnShape s, int products) {
    double T = s.T, pairs = s.causal ? 0.5 * T * T : T * T;
    if (s.causal && s.window > 0 && s.window < s.T) pairs = T * s.window - 0.5 * (double)s.window * s.window;
    return products * 2.0 * s.B * s.H * pairs * s.hd;
}
// and its bytes: `tensors` activations of [B*T, H*hd] read or written once each.
static double attn_bytes(AttnShape s, int abytes, int tensors) {
    return (double)tensors * s.B * s.T * s.H * s.hd * abytes;
}

// RoPE on the first rot dims of each head of x [N, nheads*hd] (rot = hd: all of it; Phi-3's partial rotary).
static void op_rope(const Backend* be, void* x, const float* cos_t, const float* sin_t, const int* pos, int64_t N,
                    int T, int nheads, int hd, int rot, RopeDir dir) {
    int inverse = dir == ROPE_INVERSE;
    PROF_SCOPE(be, "rope", inverse ? "bwd" : "fwd", 6.0 * N * nheads * rot / 2,
               2.0 * N * nheads * rot * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { rope_apply_cuda(B16(x), cos_t, sin_t, pos, N, T, nheads, hd, rot, inverse, be->stream); return; }
#endif
    rope_apply(F32(x), cos_t, sin_t, pos, N, T, nheads, hd, rot, inverse);
}

// On CUDA, attention runs one of two ways, chosen by LLMC_ATTENTION (llmc/settings.h):
//   cudnn  cuDNN's fused flash attention (llmc/cuda/attention_cudnn.cu): the default in a build
//          that links cuDNN (make's "cuDNN found" line); never on the CPU emulator, which cannot
//          run cuDNN, so there an explicit LLMC_ATTENTION=cudnn is refused
//   gemm   tensor-core batched GEMMs (llmc/cuda/attention_gemm.cuh): the default without cuDNN
// (the fp32 flash forward of llmc/cuda/attention.cuh runs the shapes the planned workspace does not
// fit; the flash backward, once a third choice, is dev/cuda/attention_flash.cuh's). Any other value
// is refused in one line. Under cudnn, packed examples (s.pos set: a document mask) run as cuDNN's
// ragged layout, each document one entry of its batch (s.docs, llmc/attn_docs.h, filled by the
// trainer at each upload), unless LLMC_CUDNN_PACKED=gemm sends them to gemm as
// before. A call cuDNN cannot take runs on gemm, and the first such call says why in one line:
// attention logit soft-capping (cuDNN's SDPA has none), packed examples it does not map
// (LLMC_CUDNN_PACKED=gemm, --seq-parallel's whole sequences, positions that are not documents
// one after another), head dims it lacks, no engine on this GPU, or a plan that wants more
// workspace than was planned. The forward's lse is the same statistic on every path (cuDNN's
// "Stats"; the ragged call's token-major statistics are converted from and to it), so a forward on
// one path and its backward on another agree. A sliding window (s.window) is cuDNN's diagonal band
// left bound (llmc/cuda/attention_cudnn.cu); where its engines lack one for the shape, the plan
// fails and the call runs on gemm, saying so like any other refusal.
typedef enum { ATTN_CUDNN, ATTN_GEMM } AttnImpl;
static const char* const attn_impl_names[] = {"cudnn", "gemm"};

#ifdef LLMC_HAVE_CUDNN
#define LLMC_CUDNN_BUILT 1
#else
#define LLMC_CUDNN_BUILT 0
#endif

// LLMC_CUDNN_PACKED (llmc/settings.h): ragged (the default) or gemm.
typedef enum { CUDNN_PACKED_RAGGED, CUDNN_PACKED_GEMM } CudnnPacked;
static const char* const cudnn_packed_names[] = {"ragged", "gemm"};
static CudnnPacked op_cudnn_packed(void) { return (CudnnPacked)setting_word(SETTING_CUDNN_PACKED); }

// LLMC_ATTENTION (llmc/settings.h): cudnn where this binary has it, else gemm; cudnn asked of a
// binary without it ends the run with one line.
static AttnImpl op_attention_impl(void) {
    int w = setting_word(SETTING_ATTENTION);
    if (w < 0) return LLMC_CUDNN_BUILT ? ATTN_CUDNN : ATTN_GEMM;
    if (w == ATTN_CUDNN && !LLMC_CUDNN_BUILT)
        fail("LLMC_ATTENTION=cudnn: this binary has no cuDNN (%s); use gemm",
#ifdef LLMC_CUDA_EMU
             "the CPU emulator cannot run it"
#else
             "make did not find cuDNN and its frontend: see its 'make: cuDNN' line"
#endif
        );
    return (AttnImpl)w;
}

// cuDNN's workspace is planned only while its bound stays within ATTN_CUDNN_PLAN_MAX: the bound
// grows with the sequence (about 12 x heads x hd bytes per token: 48 KiB at Llama-3.1-8B, so
// 1 GiB near 21k tokens), while the GEMM path's stays near ATTN_TILE_BYTES at any length. A longer
// sequence plans the GEMM path's workspace alone and runs there (the cuDNN check at the first call
// says so in one line), so that the longest contexts keep their memory; the first GPU run is to
// say whether the limit should move.
#define ATTN_CUDNN_PLAN_MAX ((size_t)1 << 30)
static size_t op_attention_work_bytes(const Backend* be, AttnShape s) {
    if (!be->cuda) return 0;
    size_t gemm = attn_gemm_work_bytes(&s, 1);
    // cudnn: its bound, and room for the GEMM path that takes what cuDNN cannot
    size_t cudnn = op_attention_impl() == ATTN_CUDNN ? attn_cudnn_work_bound(&s) : 0;
    if (cudnn > ATTN_CUDNN_PLAN_MAX) cudnn = 0;
    return cudnn > gemm ? cudnn : gemm;
}

// Declares that workspace for shape s in the plan; returns its bytes. The CPU kernels take theirs
// from the heap per call: the plan states the largest (MemPlan.percall_bytes).
static size_t op_plan_attention_work(const Backend* be, MemPlan* p, AttnShape s, void** work) {
    size_t bytes = op_attention_work_bytes(be, s);
    if (be->cuda) plan_add(p, MEM_SCRATCH, "attention", -1, "attn_workspace", bytes, work);
    size_t cpu = be->cuda ? 0 : attention_scratch_bytes(s, omp_get_max_threads());
    if (cpu > p->percall_bytes) p->percall_bytes = cpu;
    return bytes;
}

// The "attention:" line, once per process, at the first CUDA attention call (not at plan time:
// --dry-run --json's stdout is the JSON alone): which path LLMC_ATTENTION selected.
static void op_attention_announce(const Backend* be) {
    static int told = 0;
    if (!be->cuda || told++) return;
    AttnImpl impl = op_attention_impl();
    const char* env = setting_text(SETTING_ATTENTION);
#ifdef LLMC_HAVE_CUDNN
    const char* built = attention_cudnn_version();  // the library loaded
#else
    const char* built = NULL;
#endif
    const char* packed_env = setting_text(SETTING_CUDNN_PACKED);
    printf("attention: %s (LLMC_ATTENTION=%s; cudnn|gemm)%s%s", attn_impl_names[impl],
           env && *env ? env : "unset", built ? ", cuDNN " : ", no cuDNN in this build", built ? built : "");
    if (impl == ATTN_CUDNN)
        printf(", packed examples: %s (LLMC_CUDNN_PACKED=%s; ragged|gemm)", cudnn_packed_names[op_cudnn_packed()],
               packed_env && *packed_env ? packed_env : "unset");
    printf("\n");
}

// Whether the trainer should describe its packed micro-batches' documents for cuDNN (s.docs): where
// the ragged path can run (a build with cuDNN, LLMC_ATTENTION=cudnn, LLMC_CUDNN_PACKED=ragged), and
// on any CUDA backend where LLMC_CUDNN_PACKED=ragged is set explicitly, so that the emulator runs the
// description and its upload (test_llama_cuda.py; the other paths ignore s.docs).
static int op_attention_wants_docs(const Backend* be) {
    if (!be->cuda || op_cudnn_packed() != CUDNN_PACKED_RAGGED) return 0;
    return (LLMC_CUDNN_BUILT && op_attention_impl() == ATTN_CUDNN) || setting_is_set(SETTING_CUDNN_PACKED);
}

// The planned workspace `work` of `bytes`, if shape s fits in it (generation's shorter windows, a
// short last evaluation batch), else NULL: CUDA then uses the flash forward, which needs none.
static void* op_attention_work_fitting(const Backend* be, AttnShape s, void* work, size_t bytes) {
    return op_attention_work_bytes(be, s) <= bytes ? work : NULL;
}

#ifdef LLMC_HAVE_CUDNN
// Whether this call runs on cuDNN: selected, given the workspace, and a shape cuDNN takes within
// it; *cs the shape it runs as (packed examples: s.docs's entries), *stats where a ragged call's
// token-major statistics go (past cuDNN's own workspace; NULL for B rows of T). The first refusal
// says why in one line (later ones are the same shapes, or other batches of the same data: silent).
static int op_attention_on_cudnn(const Backend* be, AttnShape s, void* work, CudnnAttnShape* cs, float** stats) {
    *stats = NULL;
    if (op_attention_impl() != ATTN_CUDNN || !work) return 0;
    CudnnAttnShape c = {s.B, s.T, s.H, s.KVH, s.hd, s.causal, 0, 0, 0, attn_scale_of(&s)};
    if (s.causal && s.window > 0 && s.window < s.T) c.window = s.window;  // a window of T or more cuts nothing
    const char* why = NULL;
    if (s.softcap > 0.0f) why = "attention logit soft-capping, which cuDNN's attention does not have";
    else if (s.pos && op_cudnn_packed() == CUDNN_PACKED_GEMM) why = "packed examples: LLMC_CUDNN_PACKED=gemm";
    else if (s.pos && !s.docs)
        why = "packed examples without their documents: --seq-parallel's whole sequences are not mapped to cuDNN's "
              "ragged layout";
    else if (s.pos && s.docs->why) why = s.docs->why;
    else if (s.pos) {
        c.docs_batch = s.docs->batch;
        c.docs_len = s.docs->max_len;
    }
    int64_t need = why ? -1 : attention_cudnn_prepare(c, &why);
    size_t at = need < 0 ? 0 : round_up((size_t)need, 256);
    size_t stats_bytes = c.docs_batch ? (size_t)s.B * s.T * s.H * sizeof(float) : 0;
    if (!why && at + stats_bytes > op_attention_work_bytes(be, s))
        why = "its plan wants more workspace than was planned";
    static int told = 0;
    if (why && !told++)
        printf("attention: cudnn refused B=%d T=%d H=%d KVH=%d hd=%d (%s): gemm runs it\n", s.B, s.T, s.H, s.KVH, s.hd,
               why);
    *cs = c;
    if (!why && stats_bytes) *stats = (float*)((char*)work + at);
    return why == NULL;
}
#endif

// work: the planned workspace, or NULL (a shape that does not fit it: the flash forward then).
static void op_attention_forward(const Backend* be, void* o, float* lse, const void* q, const void* k, const void* v,
                                 AttnShape s, void* work) {
    PROF_SCOPE(be, "attention", "fwd", attn_flops(s, 2), attn_bytes(s, be->abytes, 4));
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        op_attention_announce(be);
#ifdef LLMC_HAVE_CUDNN
        CudnnAttnShape cs;
        float* stats;
        if (op_attention_on_cudnn(be, s, work, &cs, &stats)) {
            attention_cudnn_forward(B16(o), stats ? stats : lse, CB16(q), CB16(k), CB16(v), cs, s.docs, work,
                                    be->stream);
            if (stats) attention_lse_layout_cuda(lse, stats, s.B, s.H, s.T, LSE_TO_ROWS, be->stream);
            return;
        }
#endif
        if (work) attention_forward_gemm_cuda(B16(o), lse, CB16(q), CB16(k), CB16(v), s, work, be->stream);
        else attention_forward_cuda(B16(o), lse, CB16(q), CB16(k), CB16(v), s, be->stream);  // needs no workspace
        return;
    }
#endif
    (void)work;
    attention_forward(F32(o), lse, CF32(q), CF32(k), CF32(v), s);
}

// work: the planned workspace (CUDA).
static void op_attention_backward(const Backend* be, void* dq, void* dk, void* dv, const void* dout, const void* q,
                                  const void* k, const void* v, const void* o, const float* lse, AttnShape s,
                                  void* work) {
    PROF_SCOPE(be, "attention", "bwd", attn_flops(s, 4), attn_bytes(s, be->abytes, 8));
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        if (!work) fail("internal: the CUDA attention backward needs its planned workspace");
#ifdef LLMC_HAVE_CUDNN
        CudnnAttnShape cs;
        float* stats;
        if (op_attention_on_cudnn(be, s, work, &cs, &stats)) {
            if (stats) attention_lse_layout_cuda(stats, lse, s.B, s.H, s.T, LSE_TO_TOKENS, be->stream);
            attention_cudnn_backward(B16(dq), B16(dk), B16(dv), CB16(dout), CB16(q), CB16(k), CB16(v), CB16(o),
                                     stats ? stats : lse, cs, s.docs, work, be->stream);
            return;
        }
#endif
        attention_backward_gemm_cuda(B16(dq), B16(dk), B16(dv), CB16(dout), CB16(q), CB16(k), CB16(v), CB16(o), lse, s,
                                     work, be->stream);
        return;
    }
#endif
    (void)work;
    attention_backward(F32(dq), F32(dk), F32(dv), CF32(dout), CF32(q), CF32(k), CF32(v), CF32(o), lse, s);
}

// Generation: n new queries at positions start.. against the key/value cache kc, vc (causal, within
// s.window; s.H, KVH, hd, scale and softcap as in training).
static void op_attention_cached(const Backend* be, void* o, const void* q, const void* kc, const void* vc, int n,
                                int start, AttnShape s) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        attention_cached_cuda(B16(o), CB16(q), CB16(kc), CB16(vc), n, start, s, be->stream);
        return;
    }
#endif
    attention_cached(F32(o), CF32(q), CF32(kc), CF32(vc), n, start, s);
}

// ---- activations -------------------------------------------------------------------------------

static void op_swiglu_forward(const Backend* be, void* p, void* sg, uint8_t* codes, const void* g, const void* u,
                              int64_t n) {
    PROF_SCOPE(be, "swiglu", "fwd", 6.0 * n, 4.0 * n * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { swiglu_forward_cuda(B16(p), B16(sg), codes, CB16(g), CB16(u), n, be->stream); return; }
#endif
    swiglu_forward(F32(p), F32(sg), codes, CF32(g), CF32(u), n);
}
static void op_swiglu_backward(const Backend* be, void* dg, void* du, const void* dp, const void* sg, const void* u,
                               const void* g, const uint8_t* codes, int64_t n) {
    PROF_SCOPE(be, "swiglu", "bwd", 8.0 * n, 5.0 * n * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        swiglu_backward_cuda(B16(dg), B16(du), CB16(dp), CB16(sg), CB16(u), CB16(g), codes, n, be->stream);
        return;
    }
#endif
    swiglu_backward(F32(dg), F32(du), CF32(dp), CF32(sg), CF32(u), CF32(g), codes, n);
}

// ---- the LM head and loss ----------------------------------------------------------------------

// cuBLAS's and cuBLASLt's workspace (CUDA): a buffer of the model's plan, so that the plan names
// every device byte the run allocates. Attached to the handles once allocated; detached before the
// plan is freed.
static void op_plan_matmul_workspace(const Backend* be, MemPlan* p, void** work) {
    if (be->cuda)
        plan_add_aligned(p, MEM_SCRATCH, "cublas", -1, "cublas_workspace", BLAS_WORKSPACE_BYTES, work,
                         BLAS_WORKSPACE_ALIGN);
}
static void op_attach_matmul_workspace(const Backend* be, void* work) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { cublas_attach_workspace(work, BLAS_WORKSPACE_BYTES); return; }
#endif
    (void)work;
}
static void op_detach_matmul_workspace(const Backend* be, void* work) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { cublas_detach_workspace(work); return; }
#endif
    (void)work;
}

// Final RMSNorm + head + CE over N tokens in chunks; dxf (when non-NULL) accumulates the gradient
// of the norm's input; logits_out (backend memory, fp32 [N, V]) receives the logits when non-NULL.
// The LM head as the loss sees it: the final RMSNorm (gamma, eps) and the head W [V, d], with their
// gradients under --full (NULL while frozen), and the chunk buffers (llmc/memory/loss_buffers.h)
// for `chunk` rows at a time.
typedef struct {
    const void* gamma;
    float eps;
    const void* W;
    int V, d;
    int chunk;
    const LossBuffers* buffers;
    float *dW, *dgamma;
    float softcap;         // > 0: the logits are soft-capped, softcap * tanh(logits / softcap) (Gemma 2)
} LmHead;

// What one call computes over N rows of final-norm inputs xf [N, d]: masked cross-entropy against
// targets (grad_scale times its gradient into dxf, when not NULL), and/or the fp32 logits.
typedef struct {
    const void* xf;
    int64_t N;
    const int* targets;
    const float* mask;
    float grad_scale;
    void* dxf;             // NULL: forward only (evaluation, generation)
    float* logits_out;     // NULL but in tests and generation
    double* step_stats;    // CUDA, or NULL: the statistics are added there on the device ([4], LossStats'
                           // order: the trainer's step, read back once, llmc/train/zero.h) and st is untouched
    const float* grad_scale_at;  // CUDA, or NULL: grad_scale as the kernels read it from device memory
                                 // [1] (the same value; a CUDA graph then need not change with it)
} LmHeadCall;

static void op_lm_head_loss(const Backend* be, const LmHead* h, const LmHeadCall* c, LossStats* st) {
    int64_t N = c->N, V = h->V, d = h->d;
    int backward = c->dxf != NULL;
    PROF_SCOPE(be, backward ? "lm head + loss" : "lm head + loss (eval)", backward ? "f+b" : "fwd",
               (backward ? 4.0 : 2.0) * N * V * d + (h->dW ? 2.0 * N * V * d : 0.0),
               (double)V * d * be->wbytes * ((N + h->chunk - 1) / h->chunk) * (backward ? 2 : 1));
    const LossBuffers* lb = h->buffers;
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        LossScratchCuda sc = {B16(lb->z), lb->r, lb->logits, B16(lb->dlogits), B16(lb->dz), lb->row_stats, lb->stats};
        lm_head_loss_cuda(CB16(c->xf), CB16(h->gamma), h->eps, CB16(h->W), h->V, h->d, c->targets, c->mask, N, h->chunk,
                          c->grad_scale, B16(c->dxf), c->logits_out, sc, c->step_stats ? NULL : st, be->stream, h->dW,
                          h->dgamma, c->grad_scale_at, h->softcap);
        if (c->step_stats) loss_stats_fold_cuda(c->step_stats, lb->stats, 4, be->stream);
        return;
    }
#endif
    LossScratch sc = {F32(lb->z), lb->r, lb->logits, F32(lb->dz)};
    lm_head_loss(CF32(c->xf), CF32(h->gamma), h->eps, CF32(h->W), h->V, h->d, c->targets, c->mask, N, h->chunk,
                 c->grad_scale, F32(c->dxf), c->logits_out, sc, st, h->dW, h->dgamma, h->softcap);
}

// ---- ViT operations ----------------------------------------------------------------------------
// What train_vit adds to the above: LayerNorm, GELU, the patch embedding, the class-token rows
// and the classification head. The head is a small fp32 linear layer (B x d x classes) whose
// weight and bias are trainable fp32 masters: it runs in fp32 on both backends, on an fp32 copy
// of its input (op_acts_to_f32), so the head and its gradients take no bf16 rounding besides that
// of the features they read.

// LayerNorm: y = (x - mean) * r (* gamma + beta); gamma NULL is the MS form (affine merged into
// the next linears; mean not written then).
static void op_layernorm_forward(const Backend* be, void* y, float* r, float* mean, const void* x, const void* gamma,
                                 const void* beta, int64_t N, int d, float eps) {
    PROF_SCOPE(be, "layernorm", "fwd", 7.0 * N * d, 2.0 * N * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        layernorm_forward_cuda(B16(y), r, mean, CB16(x), CB16(gamma), CB16(beta), N, d, eps, be->stream);
        return;
    }
#endif
    layernorm_forward(F32(y), r, mean, CF32(x), CF32(gamma), CF32(beta), N, d, eps);
}
// dx += standard LayerNorm backward from the kept input x.
static void op_layernorm_backward(const Backend* be, void* dx, const void* dy, const void* x, const float* mean,
                                  const float* r, const void* gamma, int64_t N, int d) {
    PROF_SCOPE(be, "layernorm", "bwd", 8.0 * N * d, 4.0 * N * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        layernorm_backward_cuda(B16(dx), CB16(dy), CB16(x), mean, r, CB16(gamma), N, d, be->stream);
        return;
    }
#endif
    layernorm_backward(F32(dx), CF32(dy), CF32(x), mean, r, CF32(gamma), N, d);
}
// dgamma += sum over rows of dy * (x - mean) * r, dbeta += sum of dy: a trained LayerNorm affine
// (fp32 gradients on both backends).
static void op_layernorm_affine_grad(const Backend* be, float* dgamma, float* dbeta, const void* dy, const void* x,
                                     const float* mean, const float* r, int64_t N, int d) {
    PROF_SCOPE(be, "layernorm affine", "bwd", 4.0 * N * d, 2.0 * N * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { layernorm_affine_grad_cuda(dgamma, dbeta, CB16(dy), CB16(x), mean, r, N, d, be->stream); return; }
#endif
    layernorm_affine_grad(dgamma, dbeta, CF32(dy), CF32(x), mean, r, N, d);
}
// dx += MS-LN backward from the normalised output z and r alone.
static void op_layernorm_ms_backward(const Backend* be, void* dx, const void* dz, const void* z, const float* r,
                                     int64_t N, int d) {
    PROF_SCOPE(be, "layernorm", "bwd", 7.0 * N * d, 4.0 * N * d * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { layernorm_ms_backward_cuda(B16(dx), CB16(dz), CB16(z), r, N, d, be->stream); return; }
#endif
    layernorm_ms_backward(F32(dx), CF32(dz), CF32(z), r, N, d);
}

// How many of the n rows whose norm wrote r (backend memory) have statistics beyond fp32's range
// (llmc/norm_math.h): the activations of a diverged run. CUDA: a copy of r to the host (few rows);
// with step_stats (CUDA, or NULL) the count is added to step_stats[3] on the device instead
// (LossStats' `overflowed`; a trainer's step reads it back once) and 0 is returned.
static double op_norm_overflowed_rows(const Backend* be, const float* r, int64_t n, double* step_stats) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda && step_stats) { norm_overflowed_rows_cuda(step_stats + 3, r, n, be->stream); return 0.0; }
#endif
    (void)step_stats;
    float* h = (float*)xmalloc(sizeof(float) * (n + 1));
    backend_download(be, h, r, sizeof(float) * n);
    double count = norm_overflowed_rows(h, n);
    free(h);
    return count;
}

// y = gelu(x), the 2-bit ReGELU2 codes of x when codes is non-NULL.
static void op_gelu_forward(const Backend* be, void* y, uint8_t* codes, const void* x, int64_t n, int tanh_form) {
    PROF_SCOPE(be, "gelu", "fwd", 10.0 * n, 2.0 * n * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { gelu_forward_cuda(B16(y), codes, CB16(x), n, tanh_form, be->stream); return; }
#endif
    gelu_forward(F32(y), codes, CF32(x), n, tanh_form);
}
// dx = dy * gelu'(x) (exact, x kept) or dy * level(code) (ReGELU2, x NULL); dx may alias dy.
static void op_gelu_backward(const Backend* be, void* dx, const void* dy, const void* x, const uint8_t* codes,
                             int64_t n, int tanh_form) {
    PROF_SCOPE(be, "gelu", "bwd", 10.0 * n, 3.0 * n * (double)be->abytes);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { gelu_backward_cuda(B16(dx), CB16(dy), CB16(x), codes, n, tanh_form, be->stream); return; }
#endif
    gelu_backward(F32(dx), CF32(dy), CF32(x), codes, n, tanh_form);
}

// Images [B, C, H, W] (the backend's type: fp32 from the CPU loader, bf16 resized on the GPU) -> patch rows [B*T,
// C*ph*pw] of the backend's activation type, T = 1 + (H/ph)*(W/pw): token t = 1 + py*gw + px holds patch (py, px)
// unfolded in the conv kernel's (c, i, j) order; the class token's row (t = 0) is zero, so the patch product lands
// straight in the residual stream.
static void op_patch_unfold(const Backend* be, void* patches, const void* pixels_be, int B, int C, int H, int W, int ph,
                            int pw) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        int gw = W / pw, T = 1 + (H / ph) * gw;
        PatchShape s = {B, T, C, H, W, ph, pw, gw};
        patch_unfold_cuda(B16(patches), CB16(pixels_be), s, be->stream);
        return;
    }
#endif
    patch_unfold(F32(patches), CF32(pixels_be), B, C, H, W, ph, pw);
}

// CUDA only: raw images [B, sH, sW, sC] (uint8, device) -> pixels [B, C, H, W] (bf16): bilinear
// taps ty [H] and tx [W] (device), x mirrored where flip[b], /255, (x - mean) / std. The CPU
// loader does the same on the host (image_loader_convert), so the CPU backend never calls this.
static void op_resize_normalize_images(const Backend* be, void* pixels, const uint8_t* raw, const ResampleTaps* ty,
                                       const ResampleTaps* tx, const int* flip, int B, int sH, int sW, int sC, int H,
                                       int W, int C, const float* mean, const float* std) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        ImageShape s = {B, sH, sW, sC, H, W, C, {0, 0, 0}, {1, 1, 1}};
        for (int c = 0; c < C && c < 3; c++) { s.mean[c] = mean[c]; s.std[c] = std[c]; }
        image_resize_normalize_cuda(B16(pixels), raw, ty, tx, flip, s, be->stream);
        return;
    }
#endif
    (void)be;
    (void)pixels;
    (void)raw;
    (void)ty;
    (void)tx;
    (void)flip;
    (void)B;
    (void)sH;
    (void)sW;
    (void)sC;
    (void)H;
    (void)W;
    (void)C;
    (void)mean; (void)std;
    fail("internal: op_resize_normalize_images is the CUDA backend's (the CPU loader normalises on the host)");
}

// After the patch product x [N, d] (N = B*T): x[b, 0] = cls + pos[0] (the class token);
// x[b, t] += patch_b + pos[t] for the patches (t > 0).
static void op_patch_embed_finish(const Backend* be, void* x, const void* cls, const void* patch_b, const void* pos,
                                  int64_t N, int T, int d) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { patch_embed_finish_cuda(B16(x), CB16(cls), CB16(patch_b), CB16(pos), N, T, d, be->stream); return; }
#endif
    patch_embed_finish(F32(x), CF32(cls), CF32(patch_b), CF32(pos), N, T, d);
}

// Its backward when the embeddings train (fp32 gradients): dcls += sum_b dx[b, 0], dpos[t] +=
// sum_b dx[b, t], dpatch_b += the sum over every patch row (t > 0).
static void op_patch_embed_finish_backward(const Backend* be, float* dcls, float* dpatch_b, float* dpos, const void* dx,
                                           int64_t N, int T, int d) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { patch_embed_finish_backward_cuda(dcls, dpatch_b, dpos, CB16(dx), N, T, d, be->stream); return; }
#endif
    patch_embed_finish_backward(dcls, dpatch_b, dpos, CF32(dx), N, T, d);
}

// dst[r*dst_stride + c] = src[r*src_stride + c], rows x d activations (strides in elements): the
// class-token rows out of the residual stream, and their gradient back into it.
static void op_copy_rows(const Backend* be, void* dst, int64_t dst_stride, const void* src, int64_t src_stride,
                         int64_t rows, int d) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { copy_rows_cuda(B16(dst), dst_stride, CB16(src), src_stride, rows, d, be->stream); return; }
#endif
    copy_rows(F32(dst), dst_stride, CF32(src), src_stride, rows, d);
}

// n activations <-> fp32 (a cast on CUDA; on the CPU a copy, nothing when the buffers are one).
static void op_acts_to_f32(const Backend* be, float* dst, const void* src, int64_t n) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { cast_bf16_to_f32_cuda(dst, CB16(src), n, be->stream); return; }
#endif
    if (dst != src) memcpy(dst, src, sizeof(float) * n);
}
static void op_f32_to_acts(const Backend* be, void* dst, const float* src, int64_t n) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { cast_f32_to_bf16_cuda(B16(dst), src, n, be->stream); return; }
#endif
    if (dst != src) memcpy(dst, src, sizeof(float) * n);
}

// The fp32 linear layer (the classification head): y [N, out] = x W^T + bias.
static void op_linear_f32_forward(const Backend* be, float* y, const float* x, const float* W, const float* bias, int N,
                                  int out, int in) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) { matmul_nt_bias_cuda(y, x, W, bias, N, out, in, 1.0f, 0, be->stream); return; }
#endif
    matmul_nt(y, x, W, N, out, in, 1.0f, 0);
    add_bias_rows(y, bias, N, out);
}
// Its backward: dW += dy^T x and db += sum_n dy[n] (accumulated over micro-batches); dx = dy W.
static void op_linear_f32_backward(const Backend* be, float* dx, float* dW, float* db, const float* dy, const float* x,
                                   const float* W, int N, int out, int in) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        matmul_tn_cuda(dW, dy, x, out, in, N, 1.0f, 1, be->stream);
        bias_grad_rows_cuda(db, dy, N, out, be->stream);
        matmul_nn_cuda(dx, dy, W, N, in, out, 1.0f, 0, be->stream);
        return;
    }
#endif
    matmul_tn(dW, dy, x, out, in, N, 1.0f, 1);
    bias_grad_rows(db, dy, N, out);
    matmul_nn(dx, dy, W, N, in, out, 1.0f, 0);
}

// logits [rows, V] against targets [rows] (backend memory): loss, count and correct add to st (on
// the host; CUDA synchronises once); dlogits [rows, V] = grad_scale * (softmax - onehot) when
// grad. logits are left as they are. step_stats (CUDA, or NULL): loss, count and correct are added
// there on the device instead (LossStats' order; a trainer's step reads them back once).
// grad_scale_at (CUDA device memory [1], or NULL): the same scale as the kernel reads it, so that a
// CUDA graph need not change with it (LmHeadCall.grad_scale_at's twin).
static void op_softmax_ce_rows(const Backend* be, float* dlogits, const float* logits, const int* targets, int64_t rows,
                               int V, float grad_scale, int grad, const CeBuffers* cb, LossStats* st,
                               double* step_stats, const float* grad_scale_at) {
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) {
        CUDA_CHECK(cudaMemsetAsync(cb->stats, 0, 3 * sizeof(double), be->stream));
        softmax_ce_rows_cuda(dlogits, cb->row_stats, logits, targets, NULL, rows, V, grad_scale, grad, be->stream,
                             grad_scale_at);
        loss_stats_accumulate_cuda(cb->stats, cb->row_stats, rows, be->stream);
        if (step_stats) { loss_stats_fold_cuda(step_stats, cb->stats, 3, be->stream); return; }
        double h[3];
        CUDA_CHECK(cudaMemcpyAsync(h, cb->stats, sizeof(h), cudaMemcpyDeviceToHost, be->stream));
        CUDA_CHECK(cudaStreamSynchronize(be->stream));
        st->loss_sum += h[0];
        st->count += h[1];
        st->correct += h[2];
        return;
    }
#endif
    (void)cb; (void)step_stats; (void)grad_scale_at;
    softmax_ce_rows(dlogits, logits, targets, rows, V, grad_scale, grad, st);
}
