// zero.h: the optimizer half of a training step on a Trainable (trainable.h): the gradient
// buckets summed across ranks during the backward (NCCL on its own stream, or MPI at the step),
// or reduce-scattered under ZeRO-1; the global gradient norm, clipping and the non-finite check;
// AdamW on this rank's part; the all-gather of the updated pieces; and gathering a sharded
// master back to the host mirror. Whether a step may update at all: health.h.
#pragma once
#include "trainable.h"
#include "run_options.h"
#include "health.h"
#include "../cpu/adamw.h"

// AdamW's hyperparameters besides the learning rate and weight decay (the usual defaults, not flags).
#define ADAMW_BETA1 0.9f
#define ADAMW_BETA2 0.999f
#define ADAMW_EPS 1e-8f
typedef struct {
    float grad_norm, lr;
    double comm_s;             // seconds in cross-rank communication
    int skipped;               // --nonfinite skip: a non-finite or unhealthy step (health.h), no update
    const char* note;          // why there was no update (the log line says it), or NULL
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
    for (int i = 0; i < tr->n_buckets; i++)
        CUDA_CHECK(cudaEventCreateWithFlags(&tr->gathered[i], cudaEventDisableTiming));
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
    printf("data parallel: %d rank%s; gradients %s by %s in %d bucket%s %s%s%s\n", dist->world,
           dist->world == 1 ? "" : "s", tr->zero1 ? "reduce-scattered" : "summed",
           dev ? dist_gpu_collectives(dist) : "MPI", tr->n_buckets, tr->n_buckets == 1 ? "" : "s",
           dev ? "during the last backward" : "after the backward",
           tr->zero1 ? "; ZeRO-1: each rank updates its piece of every bucket, then all-gathers" : "",
           !tr->master_sharded          ? ""
           : dev && dist_has_nccl(dist) ? " the bf16 weights during the next forward (fp32 master sharded too)"
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
// so it does not depend on timing). On CUDA it goes to the step's statistics on the device
// (STEP_SUMSQ, the same additions in the same order) and comes back with them: returns 0 then.
static double trainable_sum_squares(const Trainable* tr) {
    double s = 0.0;
    for (int b = 0; b < trainable_own_ranges(tr); b++) {
        float* g;
        int64_t n = trainable_own_range(tr, b, &g);
#ifdef LLMC_HAVE_CUDA
        double* dev = trainable_step_stats(tr);
        if (dev) {
            sum_squares_into_cuda(dev + STEP_SUMSQ, b ? SUMSQ_ADD : SUMSQ_SET, g, n, tr->sumsq_scratch, tr->be->stream);
            continue;
        }
#endif
        s += sum_squares(g, n);
    }
    return s;
}

// The step's statistics (trainable_step_stats) to the host: one copy into pinned memory and the
// step's one wait for the stream. h: [STEP_STATS].
#ifdef LLMC_HAVE_CUDA
static double* trainable_pinned(Trainable* tr) {
    if (!tr->h_step_stats)
        tr->h_step_stats = (double*)backend_alloc_staging(tr->be, sizeof(double) * (STEP_STATS + ADAMW_STEP_DOUBLES));
    return tr->h_step_stats;
}
#endif
static void trainable_read_step_stats(Trainable* tr, double* h) {
#ifdef LLMC_HAVE_CUDA
    trainable_pinned(tr);
    CUDA_CHECK(cudaMemcpyAsync(tr->h_step_stats, trainable_step_stats(tr), sizeof(double) * STEP_STATS,
                               cudaMemcpyDeviceToHost, tr->be->stream));
    CUDA_CHECK(cudaStreamSynchronize(tr->be->stream));
    memcpy(h, tr->h_step_stats, sizeof(double) * STEP_STATS);
#else
    (void)tr; (void)h;
#endif
}

static void trainable_scale(const Trainable* tr, float s) {
    for (int b = 0; b < trainable_own_ranges(tr); b++) {
        float* g;
        int64_t n = trainable_own_range(tr, b, &g);
#ifdef LLMC_HAVE_CUDA
        const AdamWStep* at = trainable_adamw_step(tr);  // s is there (trainable_upload_adamw_step)
        if (at) { scale_inplace_dev_cuda(g, n, &at->clip, tr->be->stream); continue; }
#endif
        scale_inplace(g, n, s);
    }
}

static void trainable_adamw(const Trainable* tr, float* p, const float* g, float* m, float* v, int64_t n, float lr,
                            float weight_decay, int t) {
#ifdef LLMC_HAVE_CUDA
    const AdamWStep* at = trainable_adamw_step(tr);
    if (at) {
        adamw_update_dev_cuda(p, g, m, v, n, at, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, weight_decay, tr->be->stream);
        return;
    }
#endif
    adamw_update(p, g, m, v, n, lr, ADAMW_BETA1, ADAMW_BETA2, ADAMW_EPS, weight_decay, t);
}

// ZeRO-1: every rank's updated piece of bucket b to every rank, in place: the bf16 shadow when the
// master is sharded, else the fp32 parameters.
static void trainable_allgather_bucket(const Trainable* tr, const Dist* dist, const GradBucket* b) {
#ifdef LLMC_HAVE_CUDA
    if (tr->master_sharded) {
        dist_allgather_bf16_device(dist, (uint16_t*)tr->params16 + b->lo, bucket_piece(tr, b), tr->be->stream);
        return;
    }
    if (trainable_on_device(tr)) {
        dist_allgather_f32_device(dist, tr->params + b->lo, bucket_piece(tr, b), tr->be->stream);
        return;
    }
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
// The step's values (trainable_adamw_step: lr, bias corrections, clipping's factor) to the device,
// in stream order before the clipping and the updates that read them. The pinned source is
// rewritten only a step later, after the step's readback has waited for the stream, so this copy
// has run by then (the emulator checks it: emu.h's uploads).
static void trainable_upload_adamw_step(Trainable* tr, float lr, int t, float clip) {
#ifdef LLMC_HAVE_CUDA
    AdamWStep* at = trainable_adamw_step(tr);
    if (!at) return;
    AdamWStep* h = (AdamWStep*)(trainable_pinned(tr) + STEP_STATS);
    *h = adamw_step_values(lr, ADAMW_BETA1, ADAMW_BETA2, t);
    h->clip = clip;
    CUDA_CHECK(cudaMemcpyAsync(at, h, sizeof(AdamWStep), cudaMemcpyHostToDevice, tr->be->stream));
#else
    (void)tr; (void)lr; (void)t; (void)clip;
#endif
}

static double trainable_update(Trainable* tr, const Dist* dist, float lr, float weight_decay, int t) {
    trainable_weights_ready_all(tr);  // the last all-gathers still read the pieces about to change
    tr->host_current = !trainable_on_device(tr);
    if (!tr->zero1) trainable_adamw(tr, tr->params, tr->grads, tr->adam_m, tr->adam_v, tr->count, lr, weight_decay, t);
    for (int i = 0; tr->zero1 && i < tr->n_buckets; i++)
        trainable_update_piece(tr, &tr->buckets[i], lr, weight_decay, t);
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
    if (trainable_on_device(tr) && !tr->master_sharded)
        cast_f32_to_bf16_cuda((bf16*)tr->params16, tr->params, tr->count, tr->be->stream);
#endif
    return comm;
}

// The locally accumulated gradients (already scaled so that their sum over ranks is the gradient
// of the global mean loss) -> one AdamW step, identical on every rank. The all-reduce time counts
// as communication (with NCCL the call returns at once: its time then shows in the step time).
// `loss` is the step's global mean loss: it and the global gradient norm must be finite, else
// the step stops the run or (--nonfinite skip) leaves the weights and the optimizer state as
// they were; so does a step that diverged or collapsed (health.h). A step with no target makes
// no update. Every rank sees the same global values, so every rank decides the same. The gradients
// were summed across ranks (trainable_sum_grads) and `ss` is this rank's part of their sum of
// squares (trainable_sum_squares, or the step's statistics).
static OptimStep trainable_step(Trainable* tr, const TrainOptions* o, const Dist* dist, int step, const StepStats* s,
                                double ss) {
    float loss = s->loss;
    OptimStep r;
    memset(&r, 0, sizeof(r));
    double t = wall_seconds();
    if (tr->zero1) dist_allreduce_sum_f64(dist, &ss, 1);
    r.comm_s += wall_seconds() - t;
    r.grad_norm = (float)sqrt(ss);
    r.lr = lr_at_step(o, step);
    StepHealth h = step_health(s, r.grad_norm);
    if (h == STEP_NO_TARGETS) {  // no loss (NaN), so no gradient either: before the non-finite check
        r.grad_norm = NAN;
        r.note = step_health_note(h);
        return r;
    }
    HealthAdvice advice = {r.lr, !o->full, train_lora_scale(o), o->lora_dropout};  // (its text: on failure only)
    if (!isfinite(loss) || !isfinite(r.grad_norm)) {
        const char* what = !isfinite(loss) ? "loss" : "gradient norm";
        if (strcmp(o->nonfinite, "skip") != 0) {
            char tryit[320];
            health_advice_text(tryit, sizeof(tryit), &advice);
            fail("step %d: non-finite %s (%g); check the data, or %s", step + 1, what,
                 !isfinite(loss) ? loss : r.grad_norm, tryit);
        }
        r.skipped = 1;
        r.note = "skipped: non-finite loss or gradient";
        return r;
    }
    if (h != STEP_HEALTHY) {
        char msg[768];
        step_health_message(msg, sizeof(msg), h, s, step + 1, &advice);
        if (strcmp(o->nonfinite, "skip") != 0) fail("%s", msg);
        r.skipped = 1;
        r.note = step_health_note(h);
        return r;
    }
    int clips = o->grad_clip > 0 && r.grad_norm > o->grad_clip;
    float clip = clips ? o->grad_clip / r.grad_norm : 1.0f;
    trainable_upload_adamw_step(tr, r.lr, step + 1, clip);
    if (clips) trainable_scale(tr, clip);
    r.comm_s += trainable_update(tr, dist, r.lr, o->weight_decay, step + 1);
    return r;
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
    if (arena) memcpy(tr->h_params, arena, sizeof(float) * tr->count);
    free(arena);
    free(own);
    tr->host_current = 1;
}
