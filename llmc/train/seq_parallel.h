// seq_parallel.h: sequence parallelism (--seq-parallel P, in the style of DeepSpeed-Ulysses). Groups
// of P consecutive ranks share one micro-batch: group rank g holds tokens [g n, (g+1) n) of its
// B*T tokens (n = B*T / P, the flattened batch cut into P contiguous slices), so every activation
// outside attention is 1/P of one process's. Around attention all-to-alls switch q, k, v from
// "my tokens, all heads" [n, heads*hd] to "all tokens, my heads" [B*T, heads/P*hd] (group rank g's
// heads g*heads/P ..), attention runs on whole sequences for those heads, and its output (and in
// backward the gradients) go back the same way. Defines the group's state, its refusals, its
// buffers in the plan, the layout exchanges and the attention wrapped in them. The groups and the
// all-to-all primitive are llmc/train/dist.h's; data parallelism runs across groups.
// Fewer key/value heads than ranks (grouped-query attention, e.g. 8 at P = 16) are replicated as
// DeepSpeed-Ulysses does: rep = P / kv_heads ranks hold a copy of one key/value head, group rank
// g the head g / rep that its query heads g*heads/P .. read (query head h reads kv head
// h / (heads/kv_heads)). The head layout of k, v then holds [N, hd] per rank, rep times the token
// layout's share, and in the backward the replicas' partial gradients are summed back into the
// token layout (seqpar_grads_to_tokens, with the backend's sum_replica_blocks).
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
    int heads, kv_heads, hd;  // the model's (the group rank attends over heads / P, kv_heads * kv_rep / P)
    int kv_rep;            // ranks holding a copy of one key/value head: P / kv_heads when kv_heads < P, else 1
    int abytes;            // the backend's activation element size
    // Scratch of the exchanges, [n, heads*hd] each (activation type). Their lives are short, so a
    // model may lend buffers that are dead meanwhile (`lent`: train_llama's gradient scratch, see
    // llama_seqpar_lends) instead of planning them here:
    void* work;            // received blocks of o's and the gradients' exchanges, unless lent
    void* tok;             // the attention output in token layout (the o projection's input); also the
                           // packed blocks of q, k, v in the forward and of dout in the backward, when
                           // it is dead
    int lent;              // the model binds tok and passes every exchange's work buffer
    int* pos;              // [N] backend: every token's position in its packed example (attention's mask)
    int* h_pos;            // its host side
} SeqPar;

// Refuses, in one line naming the flag, what --seq-parallel does not support (yet).
static void seqpar_check(const TrainOptions* o, int heads, int kv_heads) {
    int P = o->seq_parallel;
    if (P < 1) fail("flag --seq-parallel: expected >= 1, got %d", P);
    if (P == 1) return;
    if (heads % P) fail("flag --seq-parallel: %d does not divide the model's %d attention heads", P, heads);
    if (kv_heads >= P && kv_heads % P)
        fail("flag --seq-parallel: %d does not divide the model's %d key/value heads (nor are there fewer of them "
             "than ranks, to replicate)", P, kv_heads);
    if (kv_heads < P && P % kv_heads)
        fail("flag --seq-parallel: %d is not a multiple of the model's %d key/value heads (fewer heads than ranks "
             "are replicated, each over the same number of ranks)", P, kv_heads);
    if (o->seq % P) fail("flag --seq-parallel: %d does not divide --seq %d", P, o->seq);
    if (o->generate) fail("flag --seq-parallel: not supported with --generate yet (training only)");
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
    sp->kv_rep = kv_heads < sp->P ? sp->P / kv_heads : 1;
    sp->be = be;
    sp->abytes = be->abytes;
}

// Elements per token of this rank's slice that a key or value buffer (k, v, dk, dv) [n, kv_heads*hd]
// holds: kv_heads*hd, or, where the head layout's replicas make it the larger, [N, hd] = n * P * hd.
static int64_t seqpar_kv_width(const SeqPar* sp) {
    return (int64_t)sp->kv_heads * sp->kv_rep * sp->hd;
}

// The group's buffers; `lent`: the model lends tok and the work buffers (seqpar_attention_forward ..).
static void seqpar_plan(SeqPar* sp, MemPlan* p, int lent) {
    if (sp->P <= 1) return;
    size_t bytes = (size_t)sp->n * sp->heads * sp->hd * sp->abytes;
    sp->lent = lent;
    if (!lent) plan_add(p, MEM_SCRATCH, "seq_parallel", -1, "exchange", bytes, &sp->work);
    if (!lent) plan_add(p, MEM_SCRATCH, "seq_parallel", -1, "attn_out_tokens", bytes, &sp->tok);
    plan_add(p, MEM_SCRATCH, "seq_parallel", -1, "positions", sp->N * 4, &sp->pos);
}

// The attention's shape on this rank: whole sequences, this rank's heads, every token's position,
// and the layer's window, scale and soft-cap (from `layer`; the exchanges move whole heads, so a
// query still has every key of its window on its rank).
static AttnShape seqpar_attn_shape(const SeqPar* sp, const AttnShape* layer) {
    AttnShape s = {sp->B, sp->T, sp->heads / sp->P, sp->kv_heads * sp->kv_rep / sp->P, sp->hd, 1, sp->pos, NULL,
                   layer->window, layer->scale, layer->softcap, layer->tile_window};
    return s;
}

// Without NCCL the exchanges work on host memory: the CPU backend's buffers as they are; on CUDA
// (correct, not fast) through host copies of the tensor, made and sent back here.
// The host view of a backend tensor's first `bytes`, room for `cap` (its copy on CUDA, after the
// queued kernels).
static char* seqpar_host_view(const SeqPar* sp, const void* x, size_t bytes, size_t cap) {
    if (!sp->be->cuda) return (char*)x;
    backend_sync(sp->be);
    char* h = (char*)xmalloc(cap);
    backend_download(sp->be, h, x, bytes);
    return h;
}

// Ends a host view: on CUDA its contents go to the backend tensor x (HOST_VIEW_UPLOAD) and the copy is freed.
typedef enum { HOST_VIEW_DROP, HOST_VIEW_UPLOAD } HostViewEnd;
static void seqpar_host_done(const SeqPar* sp, void* x, char* h, size_t bytes, HostViewEnd end) {
    if (!sp->be->cuda) return;
    if (end == HOST_VIEW_UPLOAD) backend_upload(sp->be, x, h, bytes);
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

// The `rep` of heads that one rank each holds (query heads, the output, key/value heads P divides).
#define SEQPAR_ONE_COPY 1

// Token layout x [n, nh*hd] to head layout, in place: [N, nh*rep/P*hd] (rep: the ranks sharing a
// head, kv_rep for k and v, else 1; x holds rep times the token layout). Group rank j receives
// the heads' chunk j / rep.
// work: [n, nh*rep*hd] of scratch (packed blocks), not x.
static void seqpar_to_heads(SeqPar* sp, void* x, int nh, int rep, void* work, const char* pass) {
    // row bytes, one rank's share of them (rep * w / P: one head under replication), the result's bytes
    int64_t w = (int64_t)nh * sp->hd * sp->abytes, wp = w * rep / sp->P, n = sp->n, out = n * sp->P * wp;
    PROF_SCOPE(sp->be, "all_to_all", pass, 0.0, 2.0 * out);
#ifdef LLMC_HAVE_CUDA
    if (seqpar_on_device(sp)) {
        for (int j = 0; j < sp->P; j++)  // block j [n, wp]: every token of mine, group rank j's heads
            CUDA_CHECK(cudaMemcpy2DAsync((char*)work + j * n * wp, wp, (char*)x + j / rep * wp, w, wp, n,
                                         cudaMemcpyDeviceToDevice, sp->be->stream));
        dist_sp_alltoall_device(sp->dist, work, x, n * wp, sp->be->stream);
        return;
    }
#endif
    char* src = seqpar_host_view(sp, x, n * w, out);
    char* pk = sp->be->cuda ? (char*)xmalloc(out) : (char*)work;
    for (int j = 0; j < sp->P; j++)  // block j: every token of mine, group rank j's heads
        for (int64_t t = 0; t < n; t++) memcpy(pk + (j * n + t) * wp, src + t * w + j / rep * wp, wp);
    dist_sp_alltoall(sp->dist, pk, src, n * wp);
    seqpar_host_done(sp, x, src, out, HOST_VIEW_UPLOAD);
    if (sp->be->cuda) free(pk);
}

// The replicated key/value heads' gradients x [N, nh*rep/P*hd] (rep > 1) exchanged into work
// [n, nh*rep*hd]: block j holds group rank j's tokens of this rank's head replica, to be summed
// into the token layout (seqpar_grads_to_tokens). Timed by the caller.
static void seqpar_replicas_to_blocks(SeqPar* sp, const void* x, int nh, int rep, void* work) {
    int64_t w = (int64_t)nh * sp->hd * sp->abytes, wp = w * rep / sp->P, n = sp->n, in = n * sp->P * wp;
#ifdef LLMC_HAVE_CUDA
    if (seqpar_on_device(sp)) { dist_sp_alltoall_device(sp->dist, x, work, n * wp, sp->be->stream); return; }
#endif
    char* src = seqpar_host_view(sp, x, in, in);
    char* pk = sp->be->cuda ? (char*)xmalloc(in) : (char*)work;
    dist_sp_alltoall(sp->dist, src, pk, n * wp);
    seqpar_host_done(sp, (void*)x, src, in, HOST_VIEW_DROP);
    seqpar_host_done(sp, work, pk, in, HOST_VIEW_UPLOAD);
}

// Head layout x [N, nh/P*hd] to token layout dst [n, nh*hd] (dst may be x): heads that one rank
// each holds (the replicated key/value heads: seqpar_replicas_to_blocks).
// work: [n, nh*hd] of scratch (the received blocks), neither x nor dst.
static void seqpar_to_tokens(SeqPar* sp, const void* x, void* dst, int nh, void* work, const char* pass) {
    int64_t w = (int64_t)nh * sp->hd * sp->abytes, wp = w / sp->P, n = sp->n;
    PROF_SCOPE(sp->be, "all_to_all", pass, 0.0, 2.0 * n * sp->P * wp);
#ifdef LLMC_HAVE_CUDA
    if (seqpar_on_device(sp)) {
        dist_sp_alltoall_device(sp->dist, x, work, n * wp, sp->be->stream);
        for (int j = 0; j < sp->P; j++)
            CUDA_CHECK(cudaMemcpy2DAsync((char*)dst + j * wp, w, (char*)work + j * n * wp, wp, wp, n,
                                         cudaMemcpyDeviceToDevice, sp->be->stream));
        return;
    }
#endif
    char* src = seqpar_host_view(sp, x, n * w, n * w);
    char* pk = sp->be->cuda ? (char*)xmalloc(n * w) : (char*)work;
    dist_sp_alltoall(sp->dist, src, pk, n * wp);  // block j: group rank j's tokens, my heads
    seqpar_host_done(sp, (void*)x, src, n * w, HOST_VIEW_DROP);
    char* out = sp->be->cuda ? (char*)xmalloc(n * w) : (char*)dst;
    for (int j = 0; j < sp->P; j++)
        for (int64_t t = 0; t < n; t++) memcpy(out + t * w + j * wp, pk + (j * n + t) * wp, wp);
    seqpar_host_done(sp, dst, out, n * w, HOST_VIEW_UPLOAD);
    if (sp->be->cuda) free(pk);
}

// Attention across the group runs as a model's attention op (llmc/ops.h) between exchanges, which
// the model calls around it (llmc/models/llama.h's llama_attention_forward / _backward):
//   forward:  as = seqpar_qkv_to_heads(q, k, v); op_attention_forward(.. as ..); seqpar_output_to_tokens(o)
//   backward: as = seqpar_dout_to_heads(dout); op_attention_backward(.. as ..); seqpar_grads_to_tokens(dq, dk, dv)
// The op then attends over whole sequences for this rank's heads (the shape these return).

// On entry q [n, heads*hd], k, v [n, kv_heads*hd] hold this rank's tokens (after RoPE; k's and v's
// buffers hold seqpar_kv_width per token, room for the head layout's replicas); on return they hold
// the head layout attention reads (and its backward again). Packed in sp->tok (not yet written).
static AttnShape seqpar_qkv_to_heads(SeqPar* sp, void* q, void* k, void* v, const AttnShape* layer) {
    seqpar_to_heads(sp, q, sp->heads, SEQPAR_ONE_COPY, sp->tok, "fwd");
    seqpar_to_heads(sp, k, sp->kv_heads, sp->kv_rep, sp->tok, "fwd");
    seqpar_to_heads(sp, v, sp->kv_heads, sp->kv_rep, sp->tok, "fwd");
    return seqpar_attn_shape(sp, layer);
}

// Attention's output o [N, heads/P*hd] (this rank's heads) in token layout [n, heads*hd]: returns
// sp->tok. o's exchange receives into `work` (sp->work, or a buffer the model lends, dead during
// this forward).
static void* seqpar_output_to_tokens(SeqPar* sp, const void* o, void* work) {
    seqpar_to_tokens(sp, o, sp->tok, sp->heads, work, "fwd");
    return sp->tok;
}

// Which heads a buffer holds: the query heads (q, o and their gradients), or the key/value heads
// (k, v, dk, dv: kv_rep copies of each where there are fewer than ranks).
typedef enum { SEQPAR_QUERY_HEADS, SEQPAR_KV_HEADS } SeqParHeads;

// q or k after RoPE, rebuilt by the backward in token layout [n, nh*hd] (a model under MS q/k norms
// keeps their normalised rows instead, llmc/models/llama.h's llama_qk_rebuild), to the head layout
// attention's backward reads, as the forward exchanged them (x holds seqpar_kv_width per token for
// k). Packs in sp->tok: dead from the o projection's backward, its last reader, until attention's
// backward packs dout in it.
static void seqpar_rebuilt_to_heads(SeqPar* sp, void* x, SeqParHeads which) {
    int kv = which == SEQPAR_KV_HEADS;
    seqpar_to_heads(sp, x, kv ? sp->kv_heads : sp->heads, kv ? sp->kv_rep : SEQPAR_ONE_COPY, sp->tok, "bwd");
}

// The kept o (head layout) in token layout, for the o projection's backward: sp->tok (work: as
// in the forward, dead until the o projection's backward writes its output).
static const void* seqpar_attention_output(SeqPar* sp, const void* o, void* work) {
    seqpar_to_tokens(sp, o, sp->tok, sp->heads, work, "bwd");
    return sp->tok;
}

// dout [n, heads*hd] (this rank's tokens; clobbered) to the head layout attention's backward reads,
// packed in sp->tok (the o projection's backward has read it); returns the backward's shape.
static AttnShape seqpar_dout_to_heads(SeqPar* sp, void* dout, const AttnShape* layer) {
    seqpar_to_heads(sp, dout, sp->heads, SEQPAR_ONE_COPY, sp->tok, "bwd");
    return seqpar_attn_shape(sp, layer);
}

// Attention's head-layout gradients to this rank's tokens, in place: dq [n, heads*hd], dk, dv [n,
// kv_heads*hd] (their buffers seqpar_kv_width per token). Replicated key/value heads: the replicas'
// partial gradients summed (the backend's sum_replica_blocks, timed in the exchange's row). The
// exchanges receive into `work` (dead once attention's backward has read dout, until the q
// projection's backward: dout's own buffer can be it).
static void seqpar_grads_to_tokens(SeqPar* sp, void* dq, void* dk, void* dv, void* work) {
    seqpar_to_tokens(sp, dq, dq, sp->heads, work, "bwd");
    void* kv[2] = {dk, dv};
    for (int i = 0; i < 2; i++) {
        if (sp->kv_rep == 1) { seqpar_to_tokens(sp, kv[i], kv[i], sp->kv_heads, work, "bwd"); continue; }
        int64_t bytes = (int64_t)sp->kv_heads * sp->hd * sp->abytes * sp->kv_rep * sp->n;  // the exchange's
        int bw = (int)(bytes / sp->n / sp->P / sp->abytes);  // elements per token of one replica block
        PROF_SCOPE(sp->be, "all_to_all", "bwd", 0.0, 2.0 * bytes);
        seqpar_replicas_to_blocks(sp, kv[i], sp->kv_heads, sp->kv_rep, work);
#ifdef LLMC_HAVE_CUDA
        if (sp->be->cuda) {
            sum_replica_blocks_cuda(B16(kv[i]), CB16(work), sp->n, sp->P, sp->kv_rep, bw, sp->be->stream);
            continue;
        }
#endif
        sum_replica_blocks(F32(kv[i]), CF32(work), sp->n, sp->P, sp->kv_rep, bw);
    }
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
