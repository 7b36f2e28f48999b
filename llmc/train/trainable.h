// trainable.h: a model's trainable parameters as one flat fp32 array (LoRA adapters, a new head,
// or under --full the linear weights) with its gradient and AdamW moments: the arena, its layout in
// gradient buckets, binding the models' tensors into it, and the host mirror. The optimizer half
// of a step (buckets crossing ranks, ZeRO-1, AdamW) is zero.h; the state files are train_state.h.
// Both trainers use it, so data parallelism and resume behave the same for every model.
// On the CUDA backend the arrays live on the GPU (plus a bf16 shadow of the parameters, what the
// products read) and a host mirror serves initialisation, adapters and checkpoints: copies cross
// only at trainable_to_device / trainable_to_host / trainable_sync_host, never inside a step.
// ZeRO-1 on CUDA can shard the fp32 master too (SHARD_OPTIM_AND_MASTER, when the model's kernels
// read only the bf16 shadow): each rank then keeps the fp32 values of its pieces alone, updates
// them, and the ranks all-gather the bf16 shadow (half the bytes of fp32). Per rank that is
// 2 + 4 + 12/world bytes per parameter (shadow, gradient; master and moments) instead of
// 2 + 4 + 4 + 8/world with the whole master.
#pragma once
#include "../common.h"
#include "../memory/plan.h"
#include "dist.h"
#include "../backend.h"
#include "../linear.h"
#ifdef LLMC_HAVE_CUDA
#include "../cuda/adamw.cuh"
#endif

// The step's statistics (trainable_step_stats): the loss's, in LossStats' order, then the gradient's.
enum { STEP_LOSS, STEP_COUNT, STEP_CORRECT, STEP_OVERFLOWED, STEP_SUMSQ, STEP_STATS };


// One range [lo, hi) of the arena whose gradients cross ranks together. Under ZeRO-1 each bucket is
// split into world equal pieces and rank r updates piece r, [lo + r*piece, lo + (r+1)*piece): the
// bucket is reduce-scattered in place (rank r's piece of the sum lands on its own piece of the
// gradient arena, so no separate shard of the gradient is kept), and the piece's AdamW moments
// (and a sharded master) sit in the rank's shard arrays in arena order, from shard_off = lo / world
// on. So a bucket can go as soon as the backward has finished it, and the optimizer state still
// divides by the number of ranks.
typedef struct {
    int64_t lo, hi, shard_off;
} GradBucket;

// How much of the optimizer's side ZeRO-1 shards across ranks (full fine-tuning).
typedef enum {
    SHARD_NONE,              // every rank holds everything (LoRA: the state is small)
    SHARD_OPTIM,             // the AdamW moments
    SHARD_OPTIM_AND_MASTER,  // and, on CUDA, the fp32 master (the model's kernels read only the shadow)
} ShardMode;

typedef struct {
    float *params, *grads;     // count values (padded to world * shard under ZeRO-1); params: shard
                               // values when master_sharded
    float *adam_m, *adam_v;    // shard values: the moments of the part this rank updates
    int64_t count, shard, padded;
    int zero1, rank, world;
    int master_sharded;        // params holds this rank's pieces only (in shard order, like adam_m)
    int host_current;          // the host mirror holds the current parameters (rank 0's only, when
                               // master_sharded); the same value on every rank
    const Backend* be;
    float *h_params, *h_grads;  // the host mirror (the arrays themselves on the CPU)
    void* params16;                   // CUDA: bf16 copy of params, refreshed after every update
    double* sumsq_scratch;            // CUDA: the gradient norm's partial sums, then the step's statistics,
                                      // then AdamW's step values (trainable_adamw_step)
    double* h_step_stats;             // CUDA: pinned host copies of both [STEP_STATS + ADAMW_STEP_DOUBLES]
                                      // (made on first use)
    // The arena's gradient buckets, in the order the backward finishes them (highest offsets
    // first: the arena is laid out in forward order). On CUDA with several ranks they are summed
    // (or reduce-scattered) during the last micro-batch's backward as the models report, block by
    // block, from which offset on the gradients are final; the rest at the step.
    GradBucket* buckets;
    int n_buckets;
    int buckets_armed, next_bucket;   // next_bucket: the first not yet sent this step
#ifdef LLMC_HAVE_CUDA
    cudaStream_t comm;                // NCCL buckets run here, overlapping the rest of the backward
    cudaEvent_t grads_ready, comm_done;
    // A sharded master with NCCL: the all-gather of the updated bf16 weights runs on the comm
    // stream too, bucket by bucket in forward order, overlapping the next forward, which waits for
    // each bucket's event (trainable_weights_ready) before its blocks read the weights.
    cudaEvent_t updated;              // the optimizer's casts into the shadow are done
    cudaEvent_t* gathered;            // [n_buckets]: bucket i's all-gather is done
    unsigned char* awaited;           // [n_buckets]: the compute stream waits for it already
    int gathers_pending;              // some bucket is not awaited yet
#endif
} Trainable;

// Declares the arenas in the plan. shard: what ZeRO-1 shards across the ranks of `dist` (full
// fine-tuning, where the AdamW state is as big as the model); it applies whenever gradients
// cross ranks (dist_sums_grads: also the one-rank NCCL self-test, with a single piece).
static void trainable_plan(Trainable* tr, MemPlan* p, const char* module, int64_t count, ShardMode shard,
                           const Dist* dist, const Backend* be) {
    tr->be = be;
    tr->count = count;
    tr->rank = dist ? dist->rank : 0;
    tr->world = dist ? dist->world : 1;
    tr->zero1 = shard != SHARD_NONE && dist_sums_grads(dist);
    tr->master_sharded = tr->zero1 && shard == SHARD_OPTIM_AND_MASTER && be && be->cuda;
    tr->host_current = 0;
    tr->shard = tr->zero1 ? (count + tr->world - 1) / tr->world : count;
    int64_t padded = tr->padded = tr->zero1 ? tr->shard * tr->world : count;
    plan_add(p, MEM_TRAINABLE, module, -1, tr->master_sharded ? "params_fp32_shard" : "params",
             (tr->master_sharded ? tr->shard : padded) * 4, &tr->params);
    plan_add(p, MEM_GRADS, module, -1, "grads", padded * 4, &tr->grads);
    plan_add(p, MEM_OPTIM, module, -1, "adam_m", tr->shard * 4, &tr->adam_m);
    plan_add(p, MEM_OPTIM, module, -1, "adam_v", tr->shard * 4, &tr->adam_v);
    if (be && be->cuda) {
        plan_add(p, MEM_TRAINABLE, module, -1, "params_bf16", padded * 2, &tr->params16);
#ifdef LLMC_HAVE_CUDA
        plan_add(p, MEM_SCRATCH, module, -1, "grad_norm_partials",
                 (SUM_SQUARES_SCRATCH + STEP_STATS + ADAMW_STEP_DOUBLES) * sizeof(double),
                 &tr->sumsq_scratch);
#endif
    }
}

static int trainable_on_device(const Trainable* tr) { return tr->be && tr->be->cuda; }

// The step's statistics on the device, [STEP_STATS] doubles after the gradient norm's partial sums:
// the loss statistics of every micro-batch added up (LossStats' order; the models' heads add them
// there, llmc/ops.h) and the sum of squares of this rank's gradients, read back together once per
// step (trainable_read_step_stats, llmc/train/zero.h). NULL on the CPU, where each micro-batch's
// loss is returned.
static double* trainable_step_stats(const Trainable* tr) {
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr)) return tr->sumsq_scratch + SUM_SQUARES_SCRATCH;
#endif
    (void)tr;
    return NULL;
}

// AdamW's learning rate and bias corrections and clipping's factor of this step in device memory,
// after the step's statistics, where the clipping and update kernels read them (written once per
// step by trainable_upload_adamw_step, llmc/train/zero.h, so the kernels' arguments stay the same
// from step to step). NULL on the CPU.
#ifdef LLMC_HAVE_CUDA
static AdamWStep* trainable_adamw_step(const Trainable* tr) {
    if (trainable_on_device(tr)) return (AdamWStep*)(tr->sumsq_scratch + SUM_SQUARES_SCRATCH + STEP_STATS);
    return NULL;
}
#endif

// A bucket is closed once this many bytes of final gradients are waiting (LLMC_GRAD_BUCKET_BYTES,
// llmc/settings.h, overrides it; tests use 1 to make every block its own bucket).
static int64_t trainable_bucket_bytes(void) {
    return setting_is_set(SETTING_GRAD_BUCKET_BYTES) ? setting_count(SETTING_GRAD_BUCKET_BYTES) : (int64_t)32 << 20;
}

// The buckets, from where each of the model's blocks starts in the arena (forward order; the
// backward finishes them last to first, and whatever lies below the first block at the end).
// Under ZeRO-1 the boundaries are rounded up to a multiple of the world size, so that every
// bucket splits into equal pieces; the arena's padded end is one too.
static void trainable_plan_buckets(Trainable* tr, const int64_t* block_off, int blocks) {
    int64_t align = tr->zero1 ? tr->world : 1, want = trainable_bucket_bytes(), hi = tr->padded;
    free(tr->buckets);
    tr->buckets = (GradBucket*)xcalloc(blocks + 1, sizeof(GradBucket));
    tr->n_buckets = 0;
    for (int l = blocks; l >= 0 && hi > 0; l--) {
        int64_t lo = l > 0 ? (block_off[l - 1] + align - 1) / align * align : 0;
        if (lo >= hi || (lo > 0 && (hi - lo) * 4 < want)) continue;
        GradBucket* b = &tr->buckets[tr->n_buckets++];
        b->lo = lo; b->hi = hi;
        b->shard_off = lo / align;  // the pieces in arena order: without ZeRO-1 the shard is the arena
        hi = lo;
    }
}

// Under ZeRO-1, the length of each rank's piece of bucket b (else the whole bucket).
static int64_t bucket_piece(const Trainable* tr, const GradBucket* b) {
    return (b->hi - b->lo) / (tr->zero1 ? tr->world : 1);
}

// This rank's shard (`shard` values, its pieces in bucket order) <-> the arena-ordered array
// `arena` (ranks' pieces in place): what the state file holds, whatever the world size.
static void trainable_shard_from_arena(const Trainable* tr, const float* arena, float* shard, int rank) {
    for (int i = 0; i < tr->n_buckets; i++) {
        const GradBucket* b = &tr->buckets[i];
        int64_t n = bucket_piece(tr, b);
        memcpy(shard + b->shard_off, arena + b->lo + rank * n, sizeof(float) * n);
    }
}

static void trainable_shard_to_arena(const Trainable* tr, const float* shard, float* arena, int rank) {
    for (int i = 0; i < tr->n_buckets; i++) {
        const GradBucket* b = &tr->buckets[i];
        int64_t n = bucket_piece(tr, b);
        memcpy(arena + b->lo + rank * n, shard + b->shard_off, sizeof(float) * n);
    }
}

// Before the compute stream reads the bf16 weights in arena range [lo, hi): it waits for the
// all-gathers of the buckets holding them, when some are still pending (a sharded master with
// NCCL). A model whose master is sharded calls it per block in its forward; whatever else writes
// or reads the whole shadow calls trainable_weights_ready_all.
static void trainable_weights_ready(Trainable* tr, int64_t lo, int64_t hi) {
#ifdef LLMC_HAVE_CUDA
    if (!tr->gathers_pending) return;
    int left = 0;
    for (int i = 0; i < tr->n_buckets; i++) {
        const GradBucket* b = &tr->buckets[i];
        if (!tr->awaited[i] && b->lo < hi && lo < b->hi) {
            CUDA_CHECK(cudaStreamWaitEvent(tr->be->stream, tr->gathered[i], 0));
            tr->awaited[i] = 1;
        }
        left += !tr->awaited[i];
    }
    tr->gathers_pending = left > 0;
#else
    (void)tr; (void)lo; (void)hi;
#endif
}
static void trainable_weights_ready_all(Trainable* tr) { trainable_weights_ready(tr, 0, tr->padded); }

// After the arenas exist: the host mirror (the arrays themselves on the CPU; padded like the
// gradients, so that the padding of the pieces reads as zeros). One bucket until the model says
// where its blocks start (trainable_plan_buckets).
static void trainable_bind_host(Trainable* tr) {
    trainable_plan_buckets(tr, NULL, 0);
    tr->host_current = 1;
    if (!trainable_on_device(tr)) { tr->h_params = tr->params; tr->h_grads = tr->grads; return; }
    tr->h_params = (float*)xcalloc(tr->padded + 1, sizeof(float));
    tr->h_grads = (float*)xcalloc(tr->padded + 1, sizeof(float));
}

static void trainable_free_host(Trainable* tr) {
    if (trainable_on_device(tr)) { free(tr->h_params); free(tr->h_grads); }
    tr->h_params = tr->h_grads = NULL;
    // the last step's AdamW values may still be on their way up from the pinned buffer (nothing
    // waits for the stream after the last step): the copy must have run before the buffer goes
    if (tr->h_step_stats) { backend_sync(tr->be); backend_free_staging(tr->be, tr->h_step_stats); }
    tr->h_step_stats = NULL;
#ifdef LLMC_HAVE_CUDA
    if (tr->comm) {
        CUDA_CHECK(cudaStreamDestroy(tr->comm));  // after what it still holds has run
        CUDA_CHECK(cudaEventDestroy(tr->grads_ready));
        CUDA_CHECK(cudaEventDestroy(tr->comm_done));
        CUDA_CHECK(cudaEventDestroy(tr->updated));
        for (int i = 0; i < tr->n_buckets; i++) CUDA_CHECK(cudaEventDestroy(tr->gathered[i]));
        free(tr->gathered);
        free(tr->awaited);
        tr->gathered = NULL;
        tr->awaited = NULL;
        tr->comm = NULL;
    }
#endif
    free(tr->buckets);
    tr->buckets = NULL;
    tr->n_buckets = 0;
}

// A tensor of n values trained in the arena at *off (advanced past it): *dev gets what the kernels
// read (the fp32 master on the CPU, its bf16 shadow on CUDA), *grad its gradient on the backend,
// *h_grad (if not NULL) that gradient's host mirror; returns the parameters' host mirror (what
// loading, init and export use).
static float* trainable_bind_tensor(const Trainable* tr, int64_t* off, int64_t n, void** dev, float** grad,
                                    float** h_grad) {
    float* host = tr->h_params + *off;
    *dev = trainable_on_device(tr) ? (void*)((uint16_t*)tr->params16 + *off) : (void*)(tr->params + *off);
    *grad = tr->grads + *off;
    if (h_grad) *h_grad = tr->h_grads + *off;
    *off += n;
    return host;
}

// A Linear trained whole (--full): its W at *off (advanced past it). L->W is the host mirror and
// L->dW its gradient's; on CUDA the products read the bf16 shadow (L->dev.W) and write L->dev.dW.
static void trainable_bind_linear_weight(const Trainable* tr, int64_t* off, Linear* L) {
    void* dev;
    float* grad;
    L->W = trainable_bind_tensor(tr, off, (int64_t)L->in * L->out, &dev, &grad, &L->dW);
    if (trainable_on_device(tr)) { L->dev.W = dev; L->dev.dW = grad; }
}

// The same for its bias (ViT's linears under --full).
static void trainable_bind_linear_bias(const Trainable* tr, int64_t* off, Linear* L) {
    void* dev;
    float* grad;
    L->bias = trainable_bind_tensor(tr, off, L->out, &dev, &grad, &L->dbias);
    if (trainable_on_device(tr)) { L->dev.bias = dev; L->dev.dbias = grad; }
}

// L's LoRA adapter (A then B) at *off, advanced past it: the host mirror, and on CUDA the masters,
// gradients and bf16 shadows the kernels use.
static void trainable_bind_adapter(const Trainable* tr, int64_t* off, Linear* L, int rank) {
    if (trainable_on_device(tr)) lora_bind_device(L, tr->params, tr->grads, tr->params16, *off, rank);
    lora_bind(L, tr->h_params, tr->h_grads, off, rank);
}

// The same for an adapter that shares lead's A (llmc/linear.h's lora_bind_shared_a): its B only.
static void trainable_bind_adapter_shared_a(const Trainable* tr, int64_t* off, Linear* L, const Linear* lead,
                                            int rank) {
    if (trainable_on_device(tr)) lora_bind_shared_a_device(L, lead, tr->params, tr->grads, tr->params16, *off);
    lora_bind_shared_a(L, lead, tr->h_params, tr->h_grads, off, rank);
}

// Host mirror -> device (after init, adapter load, resume: every rank holds all of it), then the
// bf16 shadow. A sharded master keeps this rank's pieces; the shadow is then cast from the whole
// mirror staged in the gradient arena (as large, and zeroed again here: a step starts from zero).
static void trainable_to_device(Trainable* tr) {
    if (!trainable_on_device(tr)) return;
    trainable_weights_ready_all(tr);
    tr->host_current = 1;
#ifdef LLMC_HAVE_CUDA
    if (!tr->master_sharded) {
        backend_upload(tr->be, tr->params, tr->h_params, sizeof(float) * tr->count);
        cast_f32_to_bf16_cuda((bf16*)tr->params16, tr->params, tr->count, tr->be->stream);
        return;
    }
    backend_upload(tr->be, tr->grads, tr->h_params, sizeof(float) * tr->padded);
    cast_f32_to_bf16_cuda((bf16*)tr->params16, tr->grads, tr->padded, tr->be->stream);
    float* own = (float*)xmalloc(sizeof(float) * (tr->shard + 1));
    trainable_shard_from_arena(tr, tr->h_params, own, tr->rank);
    backend_upload(tr->be, tr->params, own, sizeof(float) * tr->shard);
    free(own);
    CUDA_CHECK(cudaMemsetAsync(tr->grads, 0, sizeof(float) * tr->padded, tr->be->stream));
    backend_sync(tr->be);
#endif
}

// Device -> host mirror: the parameters, and the gradients when asked (tests). A sharded master
// has no whole copy on any device: trainable_sync_host (every rank) gathers it first.
static void trainable_to_host(Trainable* tr, int grads) {
    if (!trainable_on_device(tr)) return;
    if (!tr->host_current) {
        if (tr->master_sharded)
            fail("internal: the parameters are sharded across ranks; trainable_sync_host gathers them");
        backend_download(tr->be, tr->h_params, tr->params, sizeof(float) * tr->count);
        tr->host_current = 1;
    }
    if (grads) backend_download(tr->be, tr->h_grads, tr->grads, sizeof(float) * tr->count);
}

// At a step's start: the gradients, and on CUDA the step's statistics, to zero.
static void trainable_zero_grads(Trainable* tr) {
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr)) {
        CUDA_CHECK(cudaMemsetAsync(tr->grads, 0, sizeof(float) * tr->padded, tr->be->stream));
        double* st = trainable_step_stats(tr);
        if (st) CUDA_CHECK(cudaMemsetAsync(st, 0, sizeof(double) * STEP_STATS, tr->be->stream));
        return;
    }
#endif
    memset(tr->grads, 0, sizeof(float) * tr->padded);  // the padding too: ZeRO-1 updates it
}
