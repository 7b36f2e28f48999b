// llama_step.h: the LLaMA model's training step and evaluation over text micro-batches: the
// optimizer step over --grad-accum micro-batches (each through its CUDA graph, llmc/train/run.h),
// the loss normalised by the global step's targets, the model FLOPs per token, and the mean
// validation loss.
#pragma once
#include "llama.h"
#include "llama_batch.h"
#include "../text/textdata.h"
#include "../train/loop.h"
#include "../train/run.h"

// The training micro-batch as llmc/train/run.h's run_micro_batch runs it: the planned shape
// (m->B x m->T), with the loss statistics added into step_stats on the device (CUDA; NULL: returned).
static LossStats llama_train_pass(void* model, float grad_scale, double* step_stats) {
    Llama* m = (Llama*)model;
    return llama_forward_backward(m, m->B, m->T, grad_scale, 1, NULL, step_stats);
}

#ifdef LLMC_HAVE_CUDA
// What the captured forward + backward depends on besides device memory (llmc/cuda/graph.cuh): the
// shape and attention's document mask pick the work (on cuDNN's ragged path also its batch of
// documents and their sequence dimension, which pick cuDNN's plan); the loss scale where it is a
// kernel argument and the attention path's pointer tables (run_graph_key). --lora-dropout's key is
// not in it: its per-micro-batch part is read from device memory (m->io.bv).
static CudaGraphKey llama_graph_key(const void* model, float grad_scale) {
    const Llama* m = (const Llama*)model;
    CudaGraphKey k = run_graph_key(&m->io.bv, grad_scale);
    k.shape[0] = m->B;
    k.shape[1] = m->T;
    k.shape[2] = m->io.pos_restarts;
    const AttnDocs* docs = llama_attention_docs(m);  // cuDNN's ragged plan: its batch and sequence dimension
    k.shape[3] = docs && !docs->why ? (int64_t)docs->batch << 32 | docs->max_len : 0;
    return k;
}
#endif

// One training micro-batch (already uploaded): forward, head + loss, backward, eagerly or through
// its CUDA graph (LLMC_CUDA_GRAPH=1: llmc/train/run.h's run_micro_batch).
static LossStats llama_train_micro_batch(Llama* m, float grad_scale, double* step_stats) {
#ifdef LLMC_HAVE_CUDA
    RunPass pass = {m, llama_train_pass, llama_graph_key};
#else
    RunPass pass = {m, llama_train_pass};
#endif
    return run_micro_batch(&m->graph, m->be, &pass, grad_scale, step_stats);
}

// ----------------------------------------------------------------------------------------------
// Training step and evaluation

static double count_mask(const float* mask, int64_t n) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += mask[i];
    return s;
}

// One optimizer step over grad_accum micro-batches on every rank. The loss is normalised by the
// unmasked tokens of the whole global step, counted before any forward pass, so accumulation and
// data parallelism both equal one big batch; gradients are summed across ranks before clipping,
// so the norm is the global one and every rank applies the same update.
// Under --seq-parallel each group of P ranks reads the same micro-batches (data parallelism runs
// across groups) and each rank trains its slice; the mask is counted on the slices, so the sum
// over the world is still every target of the global step.
static StepResult llama_train_step(Llama* m, TextLoader* loader, const TrainOptions* o, const Dist* dist, int step) {
    int B = m->B, K = o->grad_accum;
    int64_t N = m->sp.N, n = m->sp.n;  // the whole micro-batch's tokens, this rank's (N without --seq-parallel)
    int* in_all = (int*)xmalloc(sizeof(int) * N * K);
    int* tg_all = (int*)xmalloc(sizeof(int) * N * K);
    float* mk_all = (float*)xmalloc(sizeof(float) * N * K);
    int* pos_all = (int*)xmalloc(sizeof(int) * N * K);
    ProfMark pd = prof_start(m->be->prof);
    for (int k = 0; k < K; k++)
        loader_next(loader, B, dist_dp_rank(dist), dist_dp_world(dist), in_all + k * N, tg_all + k * N,
                    mk_all + k * N, pos_all + k * N);
    prof_stop(m->be->prof, pd, "data", "step", 0.0, (double)N * K * 13);
    double total = 0.0;
    for (int k = 0; k < K; k++) total += count_mask(mk_all + k * N + m->sp.g * n, n);
    dist_allreduce_sum_f64(dist, &total, 1);
    float scale = total > 0 ? (float)(1.0 / total) : 0.0f;
    batch_values_set_loss_scale(&m->io.bv, scale);  // uploaded with each micro-batch below
    trainable_zero_grads(&m->w.tr);
    RunGraphHazards hazards = {m->sp.P > 1, m->modes.offload_host};
    run_graph_decide_once(&m->graph, m->be, dist, hazards);
    m->drop.step = (uint64_t)step;
    double sums[2] = {0.0, 0.0};  // loss, final-norm rows that overflowed (health.h)
    for (int k = 0; k < K; k++) {
        if (k == K - 1) trainable_buckets_begin(&m->w.tr, dist);  // the last backward sends buckets as they finish
        int64_t first = seqpar_slice(&m->sp, in_all + k * N, tg_all + k * N, mk_all + k * N, pos_all + k * N,
                                     m->io.h_inputs, m->io.h_targets, m->io.h_mask, m->io.h_pos);
        // dropout is keyed by the global token: the slice's first row in the step's batch (uploaded
        // with the batch where the kernels read it from device memory)
        m->drop.row0 = lora_dropout_row0(k, dist_dp_rank(dist), dist_dp_world(dist), N) + first;
        llama_upload_batch(m, n);
        m->drop.active = 1;  // training only: evaluation and generation see the adapters' whole input
        // on CUDA the loss stays on the device until the step's one readback (llmc/train/zero.h)
        LossStats st = llama_train_micro_batch(m, scale, trainable_step_stats(&m->w.tr));
        m->drop.active = 0;
        sums[0] += st.loss_sum;
        sums[1] += st.overflowed;
    }
    free(in_all); free(tg_all); free(mk_all); free(pos_all);
    PROF_SCOPE(m->be, "optimizer", "step", 0.0, 0.0);  // gradient all-reduce, clipping and AdamW
    double tokens = (double)N * K * dist_dp_world(dist);
    return train_step_finish(&m->w.tr, o, dist, step, sums, 2, total, tokens, m->cfg.vocab);
}

// Model FLOPs of one token's forward and backward at sequence length T: every linear layer
// (linear_train_flops) and the head, plus causal attention, 6 T q_dim per layer (QK^T, PV and
// their four backward products, halved by the mask). The convention of scripts/bench/bench_gpu.sh.
static double llama_flops_per_token(const Llama* m) {
    const LlamaConfig* c = &m->cfg;
    int full = m->modes.full;
    double f = 0.0;
    for (int t = 0; t < N_TARGETS; t++)
        f += c->layers * linear_train_flops(lin_in(c, t), lin_out(c, t), full,
                                            !full && (m->modes.targets >> t & 1) ? m->modes.rank : 0);
    f += linear_train_flops(c->dim, c->vocab, full, 0);
    f += c->layers * 6.0 * m->sp.T * c->heads * c->head_dim;
    return f;
}

// Mean loss over one pass of the validation windows up to `batches` micro-batches hold, each window
// once, the last batch partial (textdata.h's loader_eval_batch; under --seq-parallel each rank its
// slice of each, summed over the group).
static float llama_evaluate(Llama* m, const TextLoader* loader, int batches) {
    double sums[2] = {0.0, 0.0};  // loss, targets
    int64_t N = m->sp.N, windows = loader_eval_windows(loader, m->B, batches);
    int* in = (int*)xmalloc(sizeof(int) * N * 3);  // inputs, targets, positions of the whole micro-batch
    float* mk = (float*)xmalloc(sizeof(float) * N);
    for (int64_t i = 0; i < loader_eval_batches(loader, m->B, batches); i++) {
        loader_eval_batch(loader, windows, i, m->B, in, in + N, mk, in + 2 * N);
        seqpar_slice(&m->sp, in, in + N, mk, in + 2 * N, m->io.h_inputs, m->io.h_targets, m->io.h_mask, m->io.h_pos);
        llama_upload_batch(m, m->sp.n);
        LossStats st = llama_forward_backward(m, m->B, m->T, 0.0f, 0, NULL, NULL);
        sums[0] += st.loss_sum;
        sums[1] += st.count;
    }
    free(in);
    free(mk);
    dist_sp_allreduce_sum_f64(m->dist, sums, 2);
    return (float)(sums[0] / sums[1]);  // > 0 targets: loader_require_eval_targets at start-up
}
