// vit_step.h: one training step of the ViT (llmc/models/vit.h) and its evaluation: the batch's
// way up (the CPU loader's pixels, or on CUDA the raw images resized on the GPU), one micro-batch
// (through its CUDA graph, llmc/train/run.h), the optimizer step over the micro-batches, the
// model's FLOPs per image, and the validation pass.
#pragma once
#include "vit.h"
#include "../vision/imagedata.h"
#include "../train/loop.h"
#include "../train/run.h"

// ----------------------------------------------------------------------------------------------
// The batch

// A batch of B images into pixels and labels. The CPU loader resizes and normalises on the host;
// on CUDA only the raw bytes (a quarter of the fp32 pixels, or less) cross to the GPU, which
// resizes, flips and normalises them with the same arithmetic (image_resize_normalize_cuda).
// idx/flip: which shard images (and whether mirrored), labels already in h_labels.
static void vit_images_to_device(Vit* m, const ImageLoader* loader, const int64_t* idx, int B) {
    const VitConfig* c = &m->cfg;
    const ImageShard* s = loader->shard;
    int64_t per = (int64_t)s->H * s->W * s->C;
    if (per > m->batch.src_bytes)
        fail("internal: %s has images of %lld bytes, planned for %lld", s->path, (long long)per,
             (long long)m->batch.src_bytes);
    image_loader_gather(loader, idx, B, m->batch.h_raw);
    BatchStaging* st = &m->batch.staging;
    staging_begin(st);
    staging_upload(st, m->batch.raw, m->batch.h_raw, (size_t)(B * per));
    staging_upload(st, m->batch.flip, m->batch.h_flip, sizeof(int) * B);
    staging_upload(st, m->batch.labels, m->batch.h_labels, sizeof(int) * B);
    staging_upload(st, m->batch.taps, loader->ty, sizeof(ResampleTaps) * m->img_h);
    staging_upload(st, (ResampleTaps*)m->batch.taps + m->img_h, loader->tx, sizeof(ResampleTaps) * m->img_w);
    batch_values_stage(&m->batch.bv, st, &m->drop);
    staging_end(st);
    const ResampleTaps* taps = (const ResampleTaps*)m->batch.taps;
    op_resize_normalize_images(m->be, m->batch.pixels, m->batch.raw, taps, taps + m->img_h, m->batch.flip, B, s->H,
                               s->W, s->C, m->img_h, m->img_w, c->channels, loader->mean, loader->std);
}

// This rank's part of the next training batch, on the backend.
static void vit_next_batch(Vit* m, ImageLoader* loader, int B, int rank, int world) {
    if (!m->be->cuda) { image_loader_next(loader, B, rank, world, (float*)m->batch.pixels, m->batch.h_labels); return; }
    int64_t* idx = (int64_t*)xmalloc(sizeof(int64_t) * B);
    image_loader_pick(loader, B, rank, world, idx, m->batch.h_flip, m->batch.h_labels);
    vit_images_to_device(m, loader, idx, B);
    free(idx);
}

// Images [start, start+B) in file order, unflipped (evaluation), on the backend.
static void vit_range_batch(Vit* m, const ImageLoader* loader, int64_t start, int B) {
    if (!m->be->cuda) { image_loader_range(loader, start, B, (float*)m->batch.pixels, m->batch.h_labels); return; }
    int64_t* idx = (int64_t*)xmalloc(sizeof(int64_t) * B);
    for (int b = 0; b < B; b++) {
        idx[b] = start + b;
        m->batch.h_flip[b] = 0;
        m->batch.h_labels[b] = loader->shard->labels[start + b];
    }
    vit_images_to_device(m, loader, idx, B);
    free(idx);
}

// ----------------------------------------------------------------------------------------------
// One micro-batch

// The training micro-batch as llmc/train/run.h's run_micro_batch runs it: the planned B images,
// with the loss statistics added into step_stats on the device (CUDA; NULL: returned).
static LossStats vit_train_pass(void* model, float grad_scale, double* step_stats) {
    Vit* m = (Vit*)model;
    return vit_forward_backward(m, m->B, grad_scale, 1, NULL, step_stats);
}

#ifdef LLMC_HAVE_CUDA
// What the captured forward + backward depends on besides device memory: the micro-batch's
// images (their count), the loss scale where it is a kernel argument of the head and the GEMM
// attention path's pointer tables (run_graph_key; --lora-dropout's key is read from device memory).
static CudaGraphKey vit_graph_key(const void* model, float grad_scale) {
    const Vit* m = (const Vit*)model;
    CudaGraphKey k = run_graph_key(&m->batch.bv, grad_scale);
    k.shape[0] = m->B;
    return k;
}
#endif

// One training micro-batch (already uploaded): forward, head + loss, backward, eagerly or through
// its CUDA graph (LLMC_CUDA_GRAPH=1: llmc/train/run.h's run_micro_batch).
static LossStats vit_train_micro_batch(Vit* m, float grad_scale, double* step_stats) {
#ifdef LLMC_HAVE_CUDA
    RunPass pass = {m, vit_train_pass, vit_graph_key};
#else
    RunPass pass = {m, vit_train_pass};
#endif
    return run_micro_batch(&m->graph, m->be, &pass, grad_scale, step_stats);
}

// ----------------------------------------------------------------------------------------------
// Training step and evaluation

// One optimizer step over grad_accum micro-batches on every rank; the loss is the mean over all
// images of the global step, so accumulation and data parallelism both equal one big batch.
// Gradients are summed across ranks before clipping: the norm is the global one and every rank
// applies the same update.
static StepResult vit_train_step(Vit* m, ImageLoader* loader, const TrainOptions* o, const Dist* dist, int step) {
    int B = m->B, K = o->grad_accum;
    float scale = 1.0f / (float)((double)B * K * dist->world);
    batch_values_set_loss_scale(&m->batch.bv, scale);  // uploaded with each micro-batch's images below
    trainable_zero_grads(&m->params.tr);
    // once, at the first step: what the micro-batch holds that no CUDA graph can capture
    RunGraphHazards hazards = {0, m->modes.offload_host};
    run_graph_decide_once(&m->graph, m->be, dist, hazards);
    m->drop.step = (uint64_t)step;
    double sums[3] = {0.0, 0.0, 0.0};  // loss, final-norm rows that overflowed (health.h), correct
    for (int k = 0; k < K; k++) {
        if (k == K - 1) trainable_buckets_begin(&m->params.tr, dist);  // the last backward sends buckets as they finish
        // (before the upload: CUDA's dropout kernels read it from device memory)
        m->drop.row0 = lora_dropout_row0(k, dist->rank, dist->world, (int64_t)B * m->T);
        {
            PROF_SCOPE(m->be, "data", "step", 0.0, 0.0);  // decoding, resizing, normalising, upload
            vit_next_batch(m, loader, B, dist->rank, dist->world);
        }
        m->drop.active = 1;  // training only: evaluation sees the adapters' whole input
        // on CUDA the loss stays on the device until the step's one readback (llmc/train/zero.h)
        LossStats st = vit_train_micro_batch(m, scale, trainable_step_stats(&m->params.tr));
        m->drop.active = 0;
        sums[0] += st.loss_sum;
        sums[1] += st.overflowed;
        sums[2] += st.correct;
    }
    double images = (double)B * K * dist->world;
    PROF_SCOPE(m->be, "optimizer", "step", 0.0, 0.0);  // gradient all-reduce, clipping and AdamW
    return train_step_finish(&m->params.tr, o, dist, step, sums, 3, images, images, m->classes);
}

// Model FLOPs of one image's forward and backward: every token through the block linears
// (linear_train_flops), the patch embedding, bidirectional attention (12 T d per layer per token:
// QK^T, PV and their four backward products) and the head. The convention of scripts/bench/bench_gpu.sh.
static double vit_flops_per_image(const Vit* m) {
    const VitConfig* c = &m->cfg;
    int full = m->modes.full;
    double per_token = 0.0;
    for (int t = 0; t < N_TARGETS; t++)
        per_token += c->layers * linear_train_flops(lin_in(c, t), lin_out(c, t), full,
                                                    !full && (m->modes.targets >> t & 1) ? m->modes.rank : 0);
    per_token += c->layers * 12.0 * m->T * c->dim;
    double patches = (double)(m->T - 1) * linear_train_flops(patch_len(c), c->dim, full, 0);
    return m->T * per_token + patches + linear_train_flops(c->dim, m->classes, 1, 0);
}

// Mean loss and top-1 accuracy over the first `batches` micro-batches of the validation shard, in
// file order (the last one may be short), or the whole shard when it is smaller.
static EvalResult vit_evaluate(Vit* m, const ImageLoader* loader, int batches) {
    int64_t n = loader->shard->n;
    double ls = 0.0, cor = 0.0;
    int64_t seen = 0;
    for (int i = 0; i < batches && seen < n; i++) {
        int B = (int)(n - seen < m->B ? n - seen : m->B);
        vit_range_batch(m, loader, seen, B);
        LossStats st = vit_forward_backward(m, B, 0.0f, 0, NULL, NULL);
        ls += st.loss_sum;
        cor += st.correct;
        seen += B;
    }
    EvalResult r = {(float)(ls / seen), (float)(cor / seen), seen};
    return r;
}
