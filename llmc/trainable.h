// trainable.h: a model's trainable parameters as one flat fp32 array (LoRA adapters, a new head,
// or under --full the linear weights) with its gradient and AdamW moments; the optimizer half of a
// training step (gradients summed across ranks, or reduce-scattered under ZeRO-1; the global
// norm; clipping; AdamW; the all-gather); and that part of the resumable training state.
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
#include "common.h"
#include "plan.h"
#include "dist.h"
#include "checkpoint.h"
#include "train_common.h"
#include "backend.h"
#include "cpu/adamw.h"
#ifdef LLMC_HAVE_CUDA
#include "cuda/adamw.cuh"
#endif

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
    float *host_params, *host_grads;  // the host mirror (the arrays themselves on the CPU)
    void* params16;                   // CUDA: bf16 copy of params, refreshed after every update
    double* sumsq_scratch;            // CUDA: the gradient norm's partial sums
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
static void trainable_plan(Trainable* tr, MemPlan* p, const char* module, int64_t count, ShardMode shard, const Dist* dist, const Backend* be) {
    tr->be = be;
    tr->count = count;
    tr->rank = dist ? dist->rank : 0;
    tr->world = dist ? dist->world : 1;
    tr->zero1 = shard != SHARD_NONE && dist_sums_grads(dist);
    tr->master_sharded = tr->zero1 && shard == SHARD_OPTIM_AND_MASTER && be && be->cuda;
    tr->host_current = 0;
    tr->shard = tr->zero1 ? (count + tr->world - 1) / tr->world : count;
    int64_t padded = tr->padded = tr->zero1 ? tr->shard * tr->world : count;
    plan_add(p, MEM_TRAINABLE, module, -1, tr->master_sharded ? "params_fp32_shard" : "params", (tr->master_sharded ? tr->shard : padded) * 4,
             &tr->params);
    plan_add(p, MEM_GRADS, module, -1, "grads", padded * 4, &tr->grads);
    plan_add(p, MEM_OPTIM, module, -1, "adam_m", tr->shard * 4, &tr->adam_m);
    plan_add(p, MEM_OPTIM, module, -1, "adam_v", tr->shard * 4, &tr->adam_v);
    if (be && be->cuda) {
        plan_add(p, MEM_TRAINABLE, module, -1, "params_bf16", padded * 2, &tr->params16);
#ifdef LLMC_HAVE_CUDA
        plan_add(p, MEM_SCRATCH, module, -1, "grad_norm_partials", SUM_SQUARES_SCRATCH * sizeof(double), &tr->sumsq_scratch);
#endif
    }
}

static int trainable_on_device(const Trainable* tr) { return tr->be && tr->be->cuda; }

// A bucket is closed once this many bytes of final gradients are waiting (LLMC_GRAD_BUCKET_BYTES
// overrides it; tests use 1 to make every block its own bucket).
static int64_t trainable_bucket_bytes(void) {
    const char* e = getenv("LLMC_GRAD_BUCKET_BYTES");
    return e && atoll(e) > 0 ? atoll(e) : (int64_t)32 << 20;
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
    if (!trainable_on_device(tr)) { tr->host_params = tr->params; tr->host_grads = tr->grads; return; }
    tr->host_params = (float*)xcalloc(tr->padded + 1, sizeof(float));
    tr->host_grads = (float*)xcalloc(tr->padded + 1, sizeof(float));
}

static void trainable_free_host(Trainable* tr) {
    if (trainable_on_device(tr)) { free(tr->host_params); free(tr->host_grads); }
    tr->host_params = tr->host_grads = NULL;
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
// *host_grad (if not NULL) that gradient's host mirror; returns the parameters' host mirror (what
// loading, init and export use).
static float* trainable_bind_tensor(const Trainable* tr, int64_t* off, int64_t n, void** dev, float** grad, float** host_grad) {
    float* host = tr->host_params + *off;
    *dev = trainable_on_device(tr) ? (void*)((uint16_t*)tr->params16 + *off) : (void*)(tr->params + *off);
    *grad = tr->grads + *off;
    if (host_grad) *host_grad = tr->host_grads + *off;
    *off += n;
    return host;
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
        backend_upload(tr->be, tr->params, tr->host_params, sizeof(float) * tr->count);
        cast_f32_to_bf16_cuda((bf16*)tr->params16, tr->params, tr->count, tr->be->stream);
        return;
    }
    backend_upload(tr->be, tr->grads, tr->host_params, sizeof(float) * tr->padded);
    cast_f32_to_bf16_cuda((bf16*)tr->params16, tr->grads, tr->padded, tr->be->stream);
    float* own = (float*)xmalloc(sizeof(float) * (tr->shard + 1));
    trainable_shard_from_arena(tr, tr->host_params, own, tr->rank);
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
        if (tr->master_sharded) fail("internal: the parameters are sharded across ranks; trainable_sync_host gathers them");
        backend_download(tr->be, tr->host_params, tr->params, sizeof(float) * tr->count);
        tr->host_current = 1;
    }
    if (grads) backend_download(tr->be, tr->host_grads, tr->grads, sizeof(float) * tr->count);
}

static void trainable_zero_grads(Trainable* tr) {
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr)) { CUDA_CHECK(cudaMemsetAsync(tr->grads, 0, sizeof(float) * tr->padded, tr->be->stream)); return; }
#endif
    memset(tr->grads, 0, sizeof(float) * tr->padded);  // the padding too: ZeRO-1 updates it
}

typedef struct {
    float grad_norm, lr;
    double comm_s;             // seconds in cross-rank communication
    int skipped;               // --nonfinite skip: the loss or the gradient was not finite, no update
} OptimStep;

// Whether buckets go to the other ranks during the backward: CUDA whenever gradients cross ranks
// (with NCCL they then overlap the rest of the backward). On the CPU, where MPI would only stall the
// backward's threads, every bucket goes at the step.
static int trainable_uses_buckets(const Trainable* tr, const Dist* dist) {
    return trainable_on_device(tr) && dist_sums_grads(dist);
}

#ifdef LLMC_HAVE_CUDA
static void bucket_sum_device(Trainable* tr, const Dist* dist, const GradBucket* b, cudaStream_t st) {
    if (tr->zero1) dist_reduce_scatter_sum_f32_device_inplace(dist, tr->grads + b->lo, bucket_piece(tr, b), st);
    else dist_allreduce_sum_f32_device(dist, tr->grads + b->lo, b->hi - b->lo, st);
}

// The comm stream and its events, made on first use (runs without NCCL never need them). The
// buckets are planned by then (the models plan them when they bind).
static void trainable_comm_init(Trainable* tr) {
    if (tr->comm) return;
    CUDA_CHECK(cudaStreamCreateWithFlags(&tr->comm, cudaStreamNonBlocking));
    CUDA_CHECK(cudaEventCreateWithFlags(&tr->grads_ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&tr->comm_done, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&tr->updated, cudaEventDisableTiming));
    tr->gathered = (cudaEvent_t*)xcalloc(tr->n_buckets + 1, sizeof(cudaEvent_t));
    tr->awaited = (unsigned char*)xcalloc(tr->n_buckets + 1, 1);
    for (int i = 0; i < tr->n_buckets; i++) CUDA_CHECK(cudaEventCreateWithFlags(&tr->gathered[i], cudaEventDisableTiming));
}

// Sends the buckets not yet sent whose gradients all lie at or above offset `lo`: with NCCL on the
// comm stream, after the compute stream has written them (so the kernels queued next on the
// compute stream overlap the transfer); else through the host, at once.
static void trainable_send_buckets_device(Trainable* tr, const Dist* dist, int64_t lo) {
    int first = tr->next_bucket;
    while (tr->next_bucket < tr->n_buckets && tr->buckets[tr->next_bucket].lo >= lo) tr->next_bucket++;
    if (first == tr->next_bucket) return;
    cudaStream_t st = tr->be->stream;
    if (dist_has_nccl(dist)) {
        trainable_comm_init(tr);
        CUDA_CHECK(cudaEventRecord(tr->grads_ready, st));
        CUDA_CHECK(cudaStreamWaitEvent(tr->comm, tr->grads_ready, 0));
        st = tr->comm;
    }
    for (int i = first; i < tr->next_bucket; i++) bucket_sum_device(tr, dist, &tr->buckets[i], st);
}
#endif

// Every bucket not yet sent, through MPI (the CPU backend).
static void trainable_send_buckets_host(Trainable* tr, const Dist* dist) {
    for (; tr->next_bucket < tr->n_buckets; tr->next_bucket++) {
        const GradBucket* b = &tr->buckets[tr->next_bucket];
        if (tr->zero1) dist_reduce_scatter_sum_f32_inplace(dist, tr->grads + b->lo, bucket_piece(tr, b));
        else dist_allreduce_sum_f32(dist, tr->grads + b->lo, b->hi - b->lo);
    }
}

// Called before the last micro-batch's backward of a step.
static void trainable_buckets_begin(Trainable* tr, const Dist* dist) {
    tr->buckets_armed = trainable_uses_buckets(tr, dist);
    tr->next_bucket = 0;
}

// The models call this after each block's backward: gradients from offset lo to the end are
// final. Sends the buckets that this completes.
static void trainable_grads_final_from(Trainable* tr, const Dist* dist, int64_t lo) {
    if (!tr->buckets_armed) return;
#ifdef LLMC_HAVE_CUDA
    trainable_send_buckets_device(tr, dist, lo);
#else
    (void)dist; (void)lo;
#endif
}

// The start-up line about data parallelism (rank 0, when gradients cross ranks: more than one,
// or the one-rank NCCL self-test): what sums the gradients, in how many buckets and when, and
// what ZeRO-1 shards.
static void trainable_print_parallel(const Trainable* tr, const Dist* dist) {
    if (!dist_sums_grads(dist)) return;
    int dev = trainable_on_device(tr);
    printf("data parallel: %d rank%s; gradients %s by %s in %d bucket%s %s%s%s\n", dist->world, dist->world == 1 ? "" : "s",
           tr->zero1 ? "reduce-scattered" : "summed", dev ? dist_gpu_collectives(dist) : "MPI", tr->n_buckets, tr->n_buckets == 1 ? "" : "s",
           dev ? "during the last backward" : "after the backward",
           tr->zero1 ? "; ZeRO-1: each rank updates its piece of every bucket, then all-gathers" : "",
           !tr->master_sharded ? "" : dev && dist_has_nccl(dist) ? " the bf16 weights during the next forward (fp32 master sharded too)"
                                                                 : " the bf16 weights (fp32 master sharded too)");
}

// The step's pieces on the arrays' backend (CUDA kernels, or the CPU twins).

// The locally accumulated gradients summed across ranks: the buckets not sent during the backward
// go now, and those that were are waited for. Afterwards this rank's part of the gradient arena
// (all of it, or under ZeRO-1 its piece of every bucket) holds the sum.
static void trainable_sum_grads(Trainable* tr, const Dist* dist) {
    int dev = trainable_on_device(tr);
    if (dist_sums_grads(dist)) {
#ifdef LLMC_HAVE_CUDA
        if (dev) {
            trainable_send_buckets_device(tr, dist, 0);
            if (tr->comm) {
                CUDA_CHECK(cudaEventRecord(tr->comm_done, tr->comm));
                CUDA_CHECK(cudaStreamWaitEvent(tr->be->stream, tr->comm_done, 0));
            }
        }
#endif
        if (!dev) trainable_send_buckets_host(tr, dist);
    }
    tr->buckets_armed = 0;
    tr->next_bucket = 0;
}

// The part of the gradient arena this rank updates, as ranges: bucket b's piece under ZeRO-1
// (b < n_buckets), else the whole arena (b == 0). Returns the count of values, *g their start.
static int trainable_own_ranges(const Trainable* tr) { return tr->zero1 ? tr->n_buckets : 1; }
static int64_t trainable_own_range(const Trainable* tr, int b, float** g) {
    if (!tr->zero1) { *g = tr->grads; return tr->count; }
    int64_t n = bucket_piece(tr, &tr->buckets[b]);
    *g = tr->grads + tr->buckets[b].lo + tr->rank * n;
    return n;
}

// Sum of squares of this rank's summed gradients (one bucket's piece at a time, in a fixed order,
// so it does not depend on timing).
static double trainable_sum_squares(const Trainable* tr) {
    double s = 0.0;
    for (int b = 0; b < trainable_own_ranges(tr); b++) {
        float* g;
        int64_t n = trainable_own_range(tr, b, &g);
#ifdef LLMC_HAVE_CUDA
        if (trainable_on_device(tr)) { s += sum_squares_cuda(g, n, tr->sumsq_scratch, tr->be->stream); continue; }
#endif
        s += sum_squares(g, n);
    }
    return s;
}

static void trainable_scale(const Trainable* tr, float s) {
    for (int b = 0; b < trainable_own_ranges(tr); b++) {
        float* g;
        int64_t n = trainable_own_range(tr, b, &g);
#ifdef LLMC_HAVE_CUDA
        if (trainable_on_device(tr)) { scale_inplace_cuda(g, n, s, tr->be->stream); continue; }
#endif
        scale_inplace(g, n, s);
    }
}

static void trainable_adamw(const Trainable* tr, float* p, const float* g, float* m, float* v, int64_t n, float lr, float weight_decay, int t) {
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr)) { adamw_update_cuda(p, g, m, v, n, lr, 0.9f, 0.999f, 1e-8f, weight_decay, t, tr->be->stream); return; }
#endif
    adamw_update(p, g, m, v, n, lr, 0.9f, 0.999f, 1e-8f, weight_decay, t);
}

// ZeRO-1: every rank's updated piece of bucket b to every rank, in place: the bf16 shadow when the
// master is sharded, else the fp32 parameters.
static void trainable_allgather_bucket(const Trainable* tr, const Dist* dist, const GradBucket* b) {
#ifdef LLMC_HAVE_CUDA
    if (tr->master_sharded) { dist_allgather_bf16_device(dist, (uint16_t*)tr->params16 + b->lo, bucket_piece(tr, b), tr->be->stream); return; }
    if (trainable_on_device(tr)) { dist_allgather_f32_device(dist, tr->params + b->lo, bucket_piece(tr, b), tr->be->stream); return; }
#endif
    dist_allgather_f32(dist, tr->params + b->lo, bucket_piece(tr, b));
}

// ZeRO-1's update of this rank's piece of bucket b: its summed gradient is in place in the
// gradient arena, its moments at b->shard_off of the shard arrays, its fp32 values there too in a
// sharded master, else in place in the whole parameters; a sharded master's piece is cast into its
// place in the bf16 shadow for the all-gather.
static void trainable_update_piece(const Trainable* tr, const GradBucket* b, float lr, float weight_decay, int t) {
    int64_t n = bucket_piece(tr, b), o = b->shard_off, at = b->lo + tr->rank * n;
    float* p = tr->master_sharded ? tr->params + o : tr->params + at;
    trainable_adamw(tr, p, tr->grads + at, tr->adam_m + o, tr->adam_v + o, n, lr, weight_decay, t);
#ifdef LLMC_HAVE_CUDA
    if (tr->master_sharded) cast_f32_to_bf16_cuda((bf16*)tr->params16 + b->lo + tr->rank * n, p, n, tr->be->stream);
#endif
}

#ifdef LLMC_HAVE_CUDA
// A sharded master with NCCL: the bf16 pieces go to every rank on the comm stream, the bottom
// bucket first (the order the next forward reads them), each recording its event; the forward
// waits bucket by bucket (trainable_weights_ready), so the transfer overlaps it.
static void trainable_allgather_async(Trainable* tr, const Dist* dist) {
    trainable_comm_init(tr);
    CUDA_CHECK(cudaEventRecord(tr->updated, tr->be->stream));
    CUDA_CHECK(cudaStreamWaitEvent(tr->comm, tr->updated, 0));
    for (int i = tr->n_buckets - 1; i >= 0; i--) {
        const GradBucket* b = &tr->buckets[i];
        dist_allgather_bf16_device(dist, (uint16_t*)tr->params16 + b->lo, bucket_piece(tr, b), tr->comm);
        CUDA_CHECK(cudaEventRecord(tr->gathered[i], tr->comm));
        tr->awaited[i] = 0;
    }
    tr->gathers_pending = 1;
}
#endif

// AdamW on this rank's part (under ZeRO-1 its piece of every bucket), then every rank gets every
// updated piece (ZeRO-1) and, on CUDA, the bf16 shadow is refreshed. Returns the seconds of
// communication (0 when the all-gather overlaps the next forward).
static double trainable_update(Trainable* tr, const Dist* dist, float lr, float weight_decay, int t) {
    trainable_weights_ready_all(tr);  // the last all-gathers still read the pieces about to change
    tr->host_current = !trainable_on_device(tr);
    if (!tr->zero1) trainable_adamw(tr, tr->params, tr->grads, tr->adam_m, tr->adam_v, tr->count, lr, weight_decay, t);
    for (int i = 0; tr->zero1 && i < tr->n_buckets; i++) trainable_update_piece(tr, &tr->buckets[i], lr, weight_decay, t);
#ifdef LLMC_HAVE_CUDA
    if (tr->master_sharded && dist_has_nccl(dist)) { trainable_allgather_async(tr, dist); return 0.0; }
#endif
    double comm = 0.0;
    if (tr->zero1) {
        double t0 = wall_seconds();
        for (int i = 0; i < tr->n_buckets; i++) trainable_allgather_bucket(tr, dist, &tr->buckets[i]);
        backend_sync(tr->be);
        comm = wall_seconds() - t0;
    }
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr) && !tr->master_sharded) cast_f32_to_bf16_cuda((bf16*)tr->params16, tr->params, tr->count, tr->be->stream);
#endif
    return comm;
}

// LLMC_FAULT_NONFINITE_STEP=k makes step k's loss NaN (1-based), as a diverging run would: how the
// tests reach --nonfinite's two behaviours on demand. Unset, it changes nothing.
static float train_fault_injected_loss(float loss, int step) {
    const char* e = getenv("LLMC_FAULT_NONFINITE_STEP");
    return e && atoi(e) == step + 1 ? NAN : loss;
}

// The locally accumulated gradients (already scaled so that their sum over ranks is the gradient
// of the global mean loss) -> one AdamW step, identical on every rank. The all-reduce time counts
// as communication (with NCCL the call returns at once: its time then shows in the step time).
// `loss` is the step's global mean loss: it and the global gradient norm must be finite, else
// the step stops the run or (--nonfinite skip) leaves the weights and the optimizer state as
// they were. Every rank sees the same global values, so every rank decides the same.
static OptimStep trainable_step(Trainable* tr, const TrainOptions* o, const Dist* dist, int step, float loss) {
    OptimStep r;
    memset(&r, 0, sizeof(r));
    double t = wall_seconds();
    trainable_sum_grads(tr, dist);
    r.comm_s = wall_seconds() - t;
    double ss = trainable_sum_squares(tr);
    t = wall_seconds();
    if (tr->zero1) dist_allreduce_sum_f64(dist, &ss, 1);
    r.comm_s += wall_seconds() - t;
    r.grad_norm = (float)sqrt(ss);
    r.lr = lr_at_step(o, step);
    if (!isfinite(loss) || !isfinite(r.grad_norm)) {
        const char* what = !isfinite(loss) ? "loss" : "gradient norm";
        if (strcmp(o->nonfinite, "skip") != 0)
            fail("step %d: non-finite %s (%g); lower --lr or check the data (--nonfinite skip skips such steps)", step + 1, what,
                 !isfinite(loss) ? loss : r.grad_norm);
        r.skipped = 1;
        return r;
    }
    if (o->grad_clip > 0 && r.grad_norm > o->grad_clip) trainable_scale(tr, o->grad_clip / r.grad_norm);
    r.comm_s += trainable_update(tr, dist, r.lr, o->weight_decay, step + 1);
    return r;
}

// --nonfinite skip: a run that keeps producing NaN stops instead of skipping forever. `in_a_row`
// counts the skipped steps since the last update.
#define TRAIN_MAX_SKIPS_IN_A_ROW 10
static void train_count_skip(int* in_a_row, int skipped, int step) {
    *in_a_row = skipped ? *in_a_row + 1 : 0;
    if (*in_a_row >= TRAIN_MAX_SKIPS_IN_A_ROW)
        fail("step %d: %d steps in a row had a non-finite loss or gradient (--nonfinite skip); lower --lr or check the data", step + 1,
             *in_a_row);
}

// ZeRO-1: a whole shard-ordered array (AdamW moments, a sharded master) in arena order (what the
// state file holds, whatever the world size), on rank 0, from every rank's `own` shard (host
// memory). Other ranks get NULL.
static float* trainable_gather_shards(const Trainable* tr, const Dist* dist, const float* own) {
    int rank0 = !dist || dist->rank == 0;
    float* by_rank = (float*)xmalloc(sizeof(float) * (tr->shard * tr->world + 1));
    dist_gather_f32(dist, own, by_rank, tr->shard);
    float* arena = NULL;
    if (rank0) {
        arena = (float*)xcalloc(tr->padded + 1, sizeof(float));
        for (int r = 0; r < tr->world; r++) trainable_shard_to_arena(tr, by_rank + r * tr->shard, arena, r);
    }
    free(by_rank);
    return arena;
}

// The current parameters to the host mirror: rank 0's gathers every rank's pieces of a sharded
// master, otherwise each rank copies its own. Called on every rank (a collective when sharded),
// before rank 0 writes a model, an adapter or the state.
static void trainable_sync_host(Trainable* tr, const Dist* dist) {
    if (tr->host_current || !trainable_on_device(tr)) return;
    if (!tr->master_sharded) { trainable_to_host(tr, 0); return; }
    float* own = (float*)xmalloc(sizeof(float) * (tr->shard + 1));
    backend_download(tr->be, own, tr->params, sizeof(float) * tr->shard);
    float* arena = trainable_gather_shards(tr, dist, own);
    if (arena) memcpy(tr->host_params, arena, sizeof(float) * tr->count);
    free(arena);
    free(own);
    tr->host_current = 1;
}

// Writes DIR/train_state.bin. Called on every rank (ZeRO-1 gathers the moments); rank 0 writes.
static void trainable_save_state(Trainable* tr, const Dist* dist, const char* dir, const char* settings, int64_t step,
                                 int64_t cursor, int seed) {
    trainable_sync_host(tr, dist);
    float *own_m = tr->adam_m, *own_v = tr->adam_v;  // this rank's moments, on the host
    if (trainable_on_device(tr)) {  // the moments come to the host for the file
        own_m = (float*)xmalloc(sizeof(float) * (tr->shard + 1));
        own_v = (float*)xmalloc(sizeof(float) * (tr->shard + 1));
        backend_download(tr->be, own_m, tr->adam_m, sizeof(float) * tr->shard);
        backend_download(tr->be, own_v, tr->adam_v, sizeof(float) * tr->shard);
    }
    float* adam_m = tr->zero1 ? trainable_gather_shards(tr, dist, own_m) : own_m;
    float* adam_v = tr->zero1 ? trainable_gather_shards(tr, dist, own_v) : own_v;
    if (!dist || dist->rank == 0) {
        StateHeader h;
        memset(&h, 0, sizeof(h));
        h.step = step;
        h.cursor = cursor;
        h.seed = (uint64_t)seed;
        h.count = tr->count;
        snprintf(h.settings, sizeof(h.settings), "%s", settings);
        char* path = path_join(dir, "train_state.bin");
        state_save(path, &h, tr->host_params, adam_m, adam_v);
        free(path);
    }
    if (tr->zero1) { free(adam_m); free(adam_v); }
    if (own_m != tr->adam_m) { free(own_m); free(own_v); }
}

// Reads DIR/train_state.bin on every rank (each keeps its own shard of the moments under ZeRO-1);
// returns the step to continue from and sets *cursor, the training loader's position.
static int64_t trainable_load_state(Trainable* tr, const char* dir, const char* settings, int64_t* cursor) {
    char* path = path_join(dir, "train_state.bin");
    StateHeader h;
    int dev = trainable_on_device(tr), staged = tr->zero1 || dev;
    float *adam_m = tr->adam_m, *adam_v = tr->adam_v;
    if (staged) {  // the file's moments (arena order) on the host first
        adam_m = (float*)xcalloc(tr->padded + 1, sizeof(float));
        adam_v = (float*)xcalloc(tr->padded + 1, sizeof(float));
    }
    state_load(path, &h, settings, tr->count, tr->host_params, adam_m, adam_v);
    if (staged) {  // this rank's part of the moments where the optimizer keeps them
        float* own_m = dev ? (float*)xmalloc(sizeof(float) * (tr->shard + 1)) : tr->adam_m;
        float* own_v = dev ? (float*)xmalloc(sizeof(float) * (tr->shard + 1)) : tr->adam_v;
        trainable_shard_from_arena(tr, adam_m, own_m, tr->zero1 ? tr->rank : 0);
        trainable_shard_from_arena(tr, adam_v, own_v, tr->zero1 ? tr->rank : 0);
        if (dev) {
            backend_upload(tr->be, tr->adam_m, own_m, sizeof(float) * tr->shard);
            backend_upload(tr->be, tr->adam_v, own_v, sizeof(float) * tr->shard);
            trainable_to_device(tr);
            free(own_m);
            free(own_v);
        }
        free(adam_m);
        free(adam_v);
    }
    free(path);
    *cursor = h.cursor;
    return h.step;
}

// The step at which this run stops: --steps, or earlier with --stop-at (the schedule stays that
// of --steps, so a later --resume continues as if never stopped).
static int train_stop_step(const TrainOptions* o) {
    return o->stop_at > 0 && o->stop_at < o->steps ? o->stop_at : o->steps;
}

// Whether to write the adapter/model and the state after `step` steps (1-based).
static int train_save_due(const TrainOptions* o, int step) {
    return step == train_stop_step(o) || (o->save_every > 0 && step % o->save_every == 0);
}

// --resume: every rank loads the saved state; returns the step to continue from (0 without).
static int train_resume(Trainable* tr, const TrainOptions* o, const char* settings, int64_t* cursor, int rank0) {
    if (!o->resume_dir) return 0;
    int start = (int)trainable_load_state(tr, o->resume_dir, settings, cursor);
    if (rank0) printf("resumed %s/train_state.bin at step %d\n", o->resume_dir, start);
    return start;
}

// The run's log.csv in its output directory (rank 0 only, else NULL): appended to on resume,
// otherwise started with the CSV header line.
static FILE* train_open_log(const TrainOptions* o, int rank0, const char* header) {
    const char* out = o->out_dir ? o->out_dir : o->resume_dir;
    if (!out || !rank0) return NULL;
    char* lp = path_join(out, "log.csv");
    FILE* log = fopen(lp, o->resume_dir ? "a" : "w");
    if (!log) fail("flag --out: cannot write %s (%s)", lp, strerror(errno));
    if (!o->resume_dir) fprintf(log, "%s\n", header);
    free(lp);
    return log;
}

// The last lines of a training run (rank 0): steps and time, where the outputs went, and the
// planned memory beside the measured peak.
static void train_print_summary(const TrainOptions* o, int start, int stop, double seconds, double comm_s, int full, const MemPlan* plan,
                                const Backend* be) {
    const char* out = o->out_dir ? o->out_dir : o->resume_dir;
    printf("trained %d steps in %.1f s (%.1f s in all-reduce)%s%s\n", stop - start, seconds, comm_s,
           out ? (full ? ", model and state in " : ", adapter and state in ") : "", out ? out : "");
    if (stop < o->steps) printf("stopped at step %d of %d (--stop-at); continue with --resume %s\n", stop, o->steps, out ? out : "OUT");
    backend_print_memory(be, plan);
}
