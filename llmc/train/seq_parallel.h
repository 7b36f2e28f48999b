// seq_parallel.h: sequence parallelism (--seq-parallel P, in the style of DeepSpeed-Ulysses). Groups
// of P consecutive ranks share one micro-batch: group rank g holds tokens [g n, (g+1) n) of its
// B*T tokens (n = B*T / P, the flattened batch cut into P contiguous slices), so every activation
// outside attention is 1/P of one process's. Around attention all-to-alls switch q, k, v from
// "my tokens, all heads" [n, heads*hd] to "all tokens, my heads" [B*T, heads/P*hd] (group rank g's
// heads g*heads/P ..), attention runs on whole sequences for those heads, and its output (and in
// backward the gradients) go back the same way. Defines the group's state, its refusals, its
// buffers in the plan, the layout exchanges and the attention wrapped in them. The groups and the
// all-to-all primitive are llmc/train/dist.h's; data parallelism runs across groups.
#pragma once
#include "../common.h"
#include "../ops.h"
#include "dist.h"
#include "run_options.h"

typedef struct {
    const Dist* dist;
    const Backend* be;
    int P, g;              // ranks per group (1: off), this rank's place in it
    int B, T;              // the whole micro-batch: B sequences of T tokens
    int64_t N, n;          // its tokens B*T, this rank's slice N / P
    int heads, kv_heads, hd;  // the model's (the group rank attends over heads / P, kv_heads / P)
    int abytes;            // the backend's activation element size
    void* work;            // [n, heads*hd] the exchanges' packed blocks (activation type)
    void* tok;             // [n, heads*hd] the attention output in token layout (the o projection's input)
    int* pos;              // [N] backend: every token's position in its packed example (attention's mask)
    int* h_pos;            // its host side
} SeqPar;

// Refuses, in one line naming the flag, what --seq-parallel does not support (yet).
static void seqpar_check(const TrainOptions* o, int heads, int kv_heads, int qk_norm) {
    int P = o->seq_parallel;
    if (P < 1) fail("flag --seq-parallel: expected >= 1, got %d", P);
    if (P == 1) return;
    if (heads % P) fail("flag --seq-parallel: %d does not divide the model's %d attention heads", P, heads);
    if (kv_heads % P)
        fail("flag --seq-parallel: %d does not divide the model's %d key/value heads (replicating them is not "
             "supported yet)", P, kv_heads);
    if (o->seq % P) fail("flag --seq-parallel: %d does not divide --seq %d", P, o->seq);
    const char* no = o->generate ? "--generate" : qk_norm ? "a model with q/k norms (Qwen3)" : NULL;
    if (no) fail("flag --seq-parallel: not supported with %s yet (LoRA training only)", no);
}

// This rank's group and slice for micro-batches of B x T (T the whole sequence).
static void seqpar_setup(SeqPar* sp, const Dist* d, const Backend* be, int B, int T, int heads, int kv_heads, int hd) {
    memset(sp, 0, sizeof(*sp));
    sp->dist = d;
    sp->P = dist_sp(d);
    sp->g = sp->P > 1 ? d->sp_rank : 0;
    sp->B = B;
    sp->T = T;
    sp->N = (int64_t)B * T;
    sp->n = sp->N / sp->P;
    sp->heads = heads;
    sp->kv_heads = kv_heads;
    sp->hd = hd;
    sp->be = be;
    sp->abytes = be->abytes;
}

static void seqpar_plan(SeqPar* sp, MemPlan* p) {
    if (sp->P <= 1) return;
    size_t bytes = (size_t)sp->n * sp->heads * sp->hd * sp->abytes;
    plan_add(p, MEM_SCRATCH, "seq_parallel", -1, "exchange", bytes, &sp->work);
    plan_add(p, MEM_SCRATCH, "seq_parallel", -1, "attn_out_tokens", bytes, &sp->tok);
    plan_add(p, MEM_SCRATCH, "seq_parallel", -1, "positions", sp->N * 4, &sp->pos);
}

// The attention's shape on this rank: whole sequences, this rank's heads, every token's position.
static AttnShape seqpar_attn_shape(const SeqPar* sp) {
    AttnShape s = {sp->B, sp->T, sp->heads / sp->P, sp->kv_heads / sp->P, sp->hd, 1, sp->pos};
    return s;
}

// Without NCCL the exchanges work on host memory: the CPU backend's buffers as they are; on CUDA
// (correct, not fast) through host copies of the tensor, made and sent back here.
// The host view of a backend tensor of `bytes` (its copy on CUDA, after the queued kernels).
static char* seqpar_host_view(const SeqPar* sp, const void* x, size_t bytes) {
    if (!sp->be->cuda) return (char*)x;
    backend_sync(sp->be);
    char* h = (char*)xmalloc(bytes);
    backend_download(sp->be, h, x, bytes);
    return h;
}

// Ends a host view: on CUDA its contents go to the backend tensor x (when `back`) and the copy is freed.
static void seqpar_host_done(const SeqPar* sp, void* x, char* h, size_t bytes, int back) {
    if (!sp->be->cuda) return;
    if (back) backend_upload(sp->be, x, h, bytes);
    free(h);
}

// With NCCL (the CUDA backend; LLMC_NCCL=0 turns it off) the exchanges stay on the device: packed
// and unpacked by pitched copies in stream order, sent by grouped ncclSend/ncclRecv.
static int seqpar_on_device(const SeqPar* sp) {
#ifdef LLMC_HAVE_CUDA
    return sp->be->cuda && dist_sp_has_nccl(sp->dist);
#else
    (void)sp;
    return 0;
#endif
}

// Token layout x [n, heads*hd] (heads = nh) to head layout, in place: [N, nh/P*hd] (same size).
static void seqpar_to_heads(SeqPar* sp, void* x, int nh, const char* pass) {
    int64_t w = (int64_t)nh * sp->hd * sp->abytes, wp = w / sp->P, n = sp->n;  // row bytes, one rank's share
    PROF_SCOPE(sp->be, "all_to_all", pass, 0.0, 2.0 * n * w);
#ifdef LLMC_HAVE_CUDA
    if (seqpar_on_device(sp)) {
        for (int j = 0; j < sp->P; j++)  // block j [n, wp]: every token of mine, group rank j's heads
            CUDA_CHECK(cudaMemcpy2DAsync((char*)sp->work + j * n * wp, wp, (char*)x + j * wp, w, wp, n,
                                         cudaMemcpyDeviceToDevice, sp->be->stream));
        dist_sp_alltoall_device(sp->dist, sp->work, x, n * wp, sp->be->stream);
        return;
    }
#endif
    char* src = seqpar_host_view(sp, x, n * w);
    char* pk = sp->be->cuda ? (char*)xmalloc(n * w) : (char*)sp->work;
    for (int j = 0; j < sp->P; j++)  // block j: every token of mine, group rank j's heads
        for (int64_t t = 0; t < n; t++) memcpy(pk + (j * n + t) * wp, src + t * w + j * wp, wp);
    dist_sp_alltoall(sp->dist, pk, src, n * wp);
    seqpar_host_done(sp, x, src, n * w, 1);
    if (sp->be->cuda) free(pk);
}

// Head layout x [N, nh/P*hd] to token layout dst [n, nh*hd] (dst may be x).
static void seqpar_to_tokens(SeqPar* sp, const void* x, void* dst, int nh, const char* pass) {
    int64_t w = (int64_t)nh * sp->hd * sp->abytes, wp = w / sp->P, n = sp->n;
    PROF_SCOPE(sp->be, "all_to_all", pass, 0.0, 2.0 * n * w);
#ifdef LLMC_HAVE_CUDA
    if (seqpar_on_device(sp)) {
        dist_sp_alltoall_device(sp->dist, x, sp->work, n * wp, sp->be->stream);
        for (int j = 0; j < sp->P; j++)
            CUDA_CHECK(cudaMemcpy2DAsync((char*)dst + j * wp, w, (char*)sp->work + j * n * wp, wp, wp, n,
                                         cudaMemcpyDeviceToDevice, sp->be->stream));
        return;
    }
#endif
    char* src = seqpar_host_view(sp, x, n * w);
    char* pk = sp->be->cuda ? (char*)xmalloc(n * w) : (char*)sp->work;
    dist_sp_alltoall(sp->dist, src, pk, n * wp);  // block j: group rank j's tokens, my heads
    seqpar_host_done(sp, (void*)x, src, n * w, 0);
    char* out = sp->be->cuda ? (char*)xmalloc(n * w) : (char*)dst;
    for (int j = 0; j < sp->P; j++)
        for (int64_t t = 0; t < n; t++) memcpy(out + t * w + j * wp, pk + (j * n + t) * wp, wp);
    seqpar_host_done(sp, dst, out, n * w, 1);
    if (sp->be->cuda) free(pk);
}

// Attention over the group's sequences. On entry q [n, heads*hd], k, v [n, kv_heads*hd] hold this
// rank's tokens (after RoPE); on return they hold the head layout the backward reads, o
// [N, heads/P*hd] and lse [B, heads/P, T] are this rank's heads, and the result, o in token layout
// [n, heads*hd], is sp->tok.
static void* seqpar_attention_forward(SeqPar* sp, const Backend* be, void* o, float* lse, void* q, void* k, void* v,
                                      void* att_work, size_t att_work_bytes) {
    seqpar_to_heads(sp, q, sp->heads, "fwd");
    seqpar_to_heads(sp, k, sp->kv_heads, "fwd");
    seqpar_to_heads(sp, v, sp->kv_heads, "fwd");
    AttnShape as = seqpar_attn_shape(sp);
    op_attention_forward(be, o, lse, q, k, v, as, op_attention_work_fitting(be, as, att_work, att_work_bytes));
    seqpar_to_tokens(sp, o, sp->tok, sp->heads, "fwd");
    return sp->tok;
}

// The kept o (head layout) in token layout, for the o projection's backward: sp->tok.
static const void* seqpar_attention_output(SeqPar* sp, const void* o) {
    seqpar_to_tokens(sp, o, sp->tok, sp->heads, "bwd");
    return sp->tok;
}

// Attention's backward: dout [n, heads*hd] (this rank's tokens; clobbered) to dq [n, heads*hd],
// dk, dv [n, kv_heads*hd], this rank's tokens, from the head-layout q, k, v, o, lse of the forward.
static void seqpar_attention_backward(SeqPar* sp, const Backend* be, void* dq, void* dk, void* dv, void* dout,
                                      const void* q, const void* k, const void* v, const void* o, const float* lse,
                                      void* att_work) {
    seqpar_to_heads(sp, dout, sp->heads, "bwd");
    op_attention_backward(be, dq, dk, dv, dout, q, k, v, o, lse, seqpar_attn_shape(sp), att_work);
    seqpar_to_tokens(sp, dq, dq, sp->heads, "bwd");
    seqpar_to_tokens(sp, dk, dk, sp->kv_heads, "bwd");
    seqpar_to_tokens(sp, dv, dv, sp->kv_heads, "bwd");
}

// This rank's slice of a whole micro-batch (host arrays of N tokens) into the model's host batch
// (n tokens), and every token's position into sp->h_pos; returns the slice's first token.
static int64_t seqpar_slice(const SeqPar* sp, const int* in, const int* tg, const float* mk, const int* pos,
                            int* h_in, int* h_tg, float* h_mk, int* h_pos) {
    int64_t first = (int64_t)sp->g * sp->n;
    memcpy(h_in, in + first, sizeof(int) * sp->n);
    memcpy(h_tg, tg + first, sizeof(int) * sp->n);
    memcpy(h_mk, mk + first, sizeof(float) * sp->n);
    memcpy(h_pos, pos + first, sizeof(int) * sp->n);
    if (sp->P > 1) memcpy(sp->h_pos, pos, sizeof(int) * sp->N);
    return first;
}
