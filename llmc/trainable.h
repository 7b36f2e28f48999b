// trainable.h: a model's trainable parameters as one flat fp32 array (LoRA adapters, a new head,
// or under --full the linear weights) with its gradient and AdamW moments; the optimizer half of a
// training step (gradients summed across ranks, or reduce-scattered under ZeRO-1; the global
// norm; clipping; AdamW; the all-gather); and that part of the resumable training state.
// Both trainers use it, so data parallelism and resume behave the same for every model.
// On the CUDA backend the arrays live on the GPU (plus a bf16 shadow of the parameters, what the
// products read) and a host mirror serves initialisation, adapters and checkpoints: copies cross
// only at trainable_to_device / trainable_to_host, never inside a step.
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

typedef struct {
    float *params, *grads;     // count values (padded to world * shard under ZeRO-1)
    float *adam_m, *adam_v;    // shard values: the moments of the part this rank updates
    float* grad_shard;         // ZeRO-1: this rank's shard of the summed gradient
    int64_t count, shard;
    int zero1, rank, world;
    const Backend* be;
    float *host_params, *host_grads;  // the host mirror (the arrays themselves on the CPU)
    void* params16;                   // CUDA: bf16 copy of params, refreshed after every update
    double* sumsq_scratch;            // CUDA: the gradient norm's partial sums
    // Gradient buckets summed across ranks during the last micro-batch's backward (CUDA, several
    // ranks, not ZeRO-1): the models report, block by block, from which offset on the gradients
    // are final (the arena is laid out in forward order, the backward runs the other way).
    int buckets_armed;
    int64_t reduced_from;             // [reduced_from, count) already summed this step
#ifdef LLMC_HAVE_CUDA
    cudaStream_t comm;                // NCCL buckets run here, overlapping the rest of the backward
    cudaEvent_t grads_ready, comm_done;
#endif
} Trainable;

// Declares the arenas in the plan. zero1: shard the optimizer state across the ranks of `dist`
// (used for full fine-tuning, where the AdamW state is as big as the model).
static void trainable_plan(Trainable* tr, MemPlan* p, const char* module, int64_t count, int zero1, const Dist* dist, const Backend* be) {
    tr->be = be;
    tr->count = count;
    tr->rank = dist ? dist->rank : 0;
    tr->world = dist ? dist->world : 1;
    tr->zero1 = zero1 && tr->world > 1;
    tr->shard = tr->zero1 ? (count + tr->world - 1) / tr->world : count;
    int64_t padded = tr->zero1 ? tr->shard * tr->world : count;
    plan_add(p, MEM_TRAINABLE, module, -1, "params", padded * 4, &tr->params);
    plan_add(p, MEM_GRADS, module, -1, "grads", padded * 4, &tr->grads);
    plan_add(p, MEM_OPTIM, module, -1, "adam_m", tr->shard * 4, &tr->adam_m);
    plan_add(p, MEM_OPTIM, module, -1, "adam_v", tr->shard * 4, &tr->adam_v);
    if (tr->zero1) plan_add(p, MEM_SCRATCH, module, -1, "grad_shard", tr->shard * 4, &tr->grad_shard);
    if (be && be->cuda) {
        plan_add(p, MEM_TRAINABLE, module, -1, "params_bf16", count * 2, &tr->params16);
#ifdef LLMC_HAVE_CUDA
        plan_add(p, MEM_SCRATCH, module, -1, "grad_norm_partials", SUM_SQUARES_SCRATCH * sizeof(double), &tr->sumsq_scratch);
#endif
    }
}

static int trainable_on_device(const Trainable* tr) { return tr->be && tr->be->cuda; }

// After the arenas exist: the host mirror (the arrays themselves on the CPU).
static void trainable_bind_host(Trainable* tr) {
    if (!trainable_on_device(tr)) { tr->host_params = tr->params; tr->host_grads = tr->grads; return; }
    tr->host_params = (float*)xcalloc(tr->count ? tr->count : 1, sizeof(float));
    tr->host_grads = (float*)xcalloc(tr->count ? tr->count : 1, sizeof(float));
}

static void trainable_free_host(Trainable* tr) {
    if (trainable_on_device(tr)) { free(tr->host_params); free(tr->host_grads); }
    tr->host_params = tr->host_grads = NULL;
#ifdef LLMC_HAVE_CUDA
    if (tr->comm) {
        CUDA_CHECK(cudaEventDestroy(tr->grads_ready));
        CUDA_CHECK(cudaEventDestroy(tr->comm_done));
        CUDA_CHECK(cudaStreamDestroy(tr->comm));
        tr->comm = NULL;
    }
#endif
}

// Host mirror -> device (after init, adapter load, resume), then the bf16 shadow.
static void trainable_to_device(Trainable* tr) {
    if (!trainable_on_device(tr)) return;
#ifdef LLMC_HAVE_CUDA
    backend_upload(tr->be, tr->params, tr->host_params, sizeof(float) * tr->count);
    cast_f32_to_bf16_cuda((bf16*)tr->params16, tr->params, tr->count, tr->be->stream);
#endif
}

// Device -> host mirror: the parameters, and the gradients when asked (tests).
static void trainable_to_host(Trainable* tr, int grads) {
    if (!trainable_on_device(tr)) return;
    backend_download(tr->be, tr->host_params, tr->params, sizeof(float) * tr->count);
    if (grads) backend_download(tr->be, tr->host_grads, tr->grads, sizeof(float) * tr->count);
}

static void trainable_zero_grads(Trainable* tr) {
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr)) { CUDA_CHECK(cudaMemsetAsync(tr->grads, 0, sizeof(float) * tr->count, tr->be->stream)); return; }
#endif
    memset(tr->grads, 0, sizeof(float) * tr->count);
}

typedef struct {
    float grad_norm, lr;
    double comm_s;             // seconds in cross-rank communication
} OptimStep;

// Whether gradients go to the other ranks in buckets during the backward: CUDA, more than one
// rank, and one all-reduce of the whole arena otherwise (ZeRO-1 reduce-scatters it at the step).
static int trainable_uses_buckets(const Trainable* tr, const Dist* dist) {
    return trainable_on_device(tr) && dist && dist->world > 1 && !tr->zero1;
}

// A bucket is sent once this many bytes of final gradients are waiting (LLMC_GRAD_BUCKET_BYTES
// overrides it; tests use 1 to send every block on its own).
static int64_t trainable_bucket_bytes(void) {
    const char* e = getenv("LLMC_GRAD_BUCKET_BYTES");
    return e && atoll(e) > 0 ? atoll(e) : (int64_t)32 << 20;
}

#ifdef LLMC_HAVE_CUDA
// Sums grads [lo, hi) across ranks: with NCCL on the comm stream, after the compute stream has
// written them (so the rest of the backward overlaps it); else through the host, in place.
static void trainable_reduce_range(Trainable* tr, const Dist* dist, int64_t lo, int64_t hi) {
    if (hi <= lo) return;
    if (!dist_has_nccl(dist)) { dist_allreduce_sum_f32_device(dist, tr->grads + lo, hi - lo, tr->be->stream); return; }
    if (!tr->comm) {
        CUDA_CHECK(cudaStreamCreateWithFlags(&tr->comm, cudaStreamNonBlocking));
        CUDA_CHECK(cudaEventCreateWithFlags(&tr->grads_ready, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&tr->comm_done, cudaEventDisableTiming));
    }
    CUDA_CHECK(cudaEventRecord(tr->grads_ready, tr->be->stream));
    CUDA_CHECK(cudaStreamWaitEvent(tr->comm, tr->grads_ready, 0));
    dist_allreduce_sum_f32_device(dist, tr->grads + lo, hi - lo, tr->comm);
}
#endif

// Called before the last micro-batch's backward of a step.
static void trainable_buckets_begin(Trainable* tr, const Dist* dist) {
    tr->buckets_armed = trainable_uses_buckets(tr, dist);
    tr->reduced_from = tr->count;
}

// The models call this after each block's backward: gradients from offset lo to the end are
// final. Sends them once a bucket's worth has gathered.
static void trainable_grads_final_from(Trainable* tr, const Dist* dist, int64_t lo) {
    if (!tr->buckets_armed || (tr->reduced_from - lo) * 4 < trainable_bucket_bytes()) return;
#ifdef LLMC_HAVE_CUDA
    trainable_reduce_range(tr, dist, lo, tr->reduced_from);
#else
    (void)dist;
#endif
    tr->reduced_from = lo;
}

// The step's pieces on the arrays' backend (CUDA kernels, or the CPU twins).

// The locally accumulated gradients summed across ranks (on CUDA: NCCL, or MPI through the host;
// the buckets sent during the backward are waited for here). Returns what this rank updates from:
// all the gradients, or under ZeRO-1 its shard of them.
static float* trainable_sum_grads(Trainable* tr, const Dist* dist) {
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr)) {
        cudaStream_t st = tr->be->stream;
        if (tr->zero1) { dist_reduce_scatter_sum_f32_device(dist, tr->grads, tr->grad_shard, tr->shard, st); return tr->grad_shard; }
        if (!tr->buckets_armed) { dist_allreduce_sum_f32_device(dist, tr->grads, tr->count, st); return tr->grads; }
        trainable_reduce_range(tr, dist, 0, tr->reduced_from);  // the last bucket, then wait for all of them
        if (tr->comm) {
            CUDA_CHECK(cudaEventRecord(tr->comm_done, tr->comm));
            CUDA_CHECK(cudaStreamWaitEvent(st, tr->comm_done, 0));
        }
        tr->buckets_armed = 0;
        return tr->grads;
    }
#endif
    if (tr->zero1) { dist_reduce_scatter_sum_f32(dist, tr->grads, tr->grad_shard, tr->shard); return tr->grad_shard; }
    dist_allreduce_sum_f32(dist, tr->grads, tr->count);
    return tr->grads;
}

static double trainable_sum_squares(const Trainable* tr, const float* g) {
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr)) return sum_squares_cuda(g, tr->shard, tr->sumsq_scratch, tr->be->stream);
#endif
    return sum_squares(g, tr->shard);
}

static void trainable_scale(const Trainable* tr, float* g, float s) {
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr)) { scale_inplace_cuda(g, tr->shard, s, tr->be->stream); return; }
#endif
    scale_inplace(g, tr->shard, s);
}

// AdamW on this rank's part (p, g: shard values), then every rank gets every updated shard
// (ZeRO-1) and, on CUDA, the bf16 shadow is refreshed. Returns the seconds of communication.
static double trainable_update(Trainable* tr, const Dist* dist, float* g, float lr, float weight_decay, int t) {
    float* p = tr->params + (tr->zero1 ? (int64_t)tr->rank * tr->shard : 0);
    double comm = 0.0, t0;
#ifdef LLMC_HAVE_CUDA
    if (trainable_on_device(tr)) {
        cudaStream_t st = tr->be->stream;
        adamw_update_cuda(p, g, tr->adam_m, tr->adam_v, tr->shard, lr, 0.9f, 0.999f, 1e-8f, weight_decay, t, st);
        if (tr->zero1) {
            t0 = wall_seconds();
            dist_allgather_f32_device(dist, tr->params, tr->shard, st);
            backend_sync(tr->be);
            comm = wall_seconds() - t0;
        }
        cast_f32_to_bf16_cuda((bf16*)tr->params16, tr->params, tr->count, st);
        return comm;
    }
#endif
    adamw_update(p, g, tr->adam_m, tr->adam_v, tr->shard, lr, 0.9f, 0.999f, 1e-8f, weight_decay, t);
    if (tr->zero1) {
        t0 = wall_seconds();
        dist_allgather_f32(dist, tr->params, tr->shard);
        comm = wall_seconds() - t0;
    }
    return comm;
}

// The locally accumulated gradients (already scaled so that their sum over ranks is the gradient
// of the global mean loss) -> one AdamW step, identical on every rank. The all-reduce time counts
// as communication (with NCCL the call returns at once: its time then shows in the step time).
static OptimStep trainable_step(Trainable* tr, const TrainOptions* o, const Dist* dist, int step) {
    OptimStep r;
    double t = wall_seconds();
    float* g = trainable_sum_grads(tr, dist);
    r.comm_s = wall_seconds() - t;
    double ss = trainable_sum_squares(tr, g);
    t = wall_seconds();
    if (tr->zero1) dist_allreduce_sum_f64(dist, &ss, 1);
    r.comm_s += wall_seconds() - t;
    r.grad_norm = (float)sqrt(ss);
    if (!isfinite(r.grad_norm)) fail("step %d: non-finite gradient norm; lower --lr or check the data", step + 1);
    if (o->grad_clip > 0 && r.grad_norm > o->grad_clip) trainable_scale(tr, g, o->grad_clip / r.grad_norm);
    r.lr = lr_at_step(o, step);
    r.comm_s += trainable_update(tr, dist, g, r.lr, o->weight_decay, step + 1);
    return r;
}

// Writes DIR/train_state.bin. Called on every rank (ZeRO-1 gathers the moments); rank 0 writes.
static void trainable_save_state(const Trainable* tr, const Dist* dist, const char* dir, const char* settings, int64_t step,
                                 int64_t cursor, int seed) {
    int dev = trainable_on_device(tr);
    float *own_m = tr->adam_m, *own_v = tr->adam_v;  // this rank's moments, on the host
    if (dev) {  // the moments and the parameters come to the host for the file
        own_m = (float*)xmalloc(sizeof(float) * (tr->shard + 1));
        own_v = (float*)xmalloc(sizeof(float) * (tr->shard + 1));
        backend_download(tr->be, own_m, tr->adam_m, sizeof(float) * tr->shard);
        backend_download(tr->be, own_v, tr->adam_v, sizeof(float) * tr->shard);
        backend_download(tr->be, tr->host_params, tr->params, sizeof(float) * tr->count);
    }
    float *adam_m = own_m, *adam_v = own_v;
    if (tr->zero1) {  // rank 0 gathers every shard
        adam_m = (float*)xmalloc(sizeof(float) * tr->shard * tr->world);
        adam_v = (float*)xmalloc(sizeof(float) * tr->shard * tr->world);
        dist_gather_f32(dist, own_m, adam_m, tr->shard);
        dist_gather_f32(dist, own_v, adam_v, tr->shard);
    }
    if (!dist || dist->rank == 0) {
        StateHeader h;
        memset(&h, 0, sizeof(h));
        h.step = step;
        h.cursor = cursor;
        h.seed = (uint64_t)seed;
        h.count = tr->count;
        snprintf(h.settings, sizeof(h.settings), "%s", settings);
        char* path = path_join(dir, "train_state.bin");
        state_save(path, &h, tr->host_params ? tr->host_params : tr->params, adam_m, adam_v);
        free(path);
    }
    if (tr->zero1) { free(adam_m); free(adam_v); }
    if (dev) { free(own_m); free(own_v); }
}

// Reads DIR/train_state.bin on every rank (each keeps its own shard of the moments under ZeRO-1);
// returns the step to continue from and sets *cursor, the training loader's position.
static int64_t trainable_load_state(Trainable* tr, const char* dir, const char* settings, int64_t* cursor) {
    char* path = path_join(dir, "train_state.bin");
    StateHeader h;
    int dev = trainable_on_device(tr), staged = tr->zero1 || dev;
    float *adam_m = tr->adam_m, *adam_v = tr->adam_v;
    if (staged) {  // the whole file's moments on the host first
        adam_m = (float*)xcalloc(tr->shard * tr->world + 1, sizeof(float));
        adam_v = (float*)xcalloc(tr->shard * tr->world + 1, sizeof(float));
    }
    state_load(path, &h, settings, tr->count, tr->host_params ? tr->host_params : tr->params, adam_m, adam_v);
    if (staged) {  // this rank's part of the moments where the optimizer keeps them
        int64_t own = tr->zero1 ? (int64_t)tr->rank * tr->shard : 0;
        if (dev) {
            backend_upload(tr->be, tr->adam_m, adam_m + own, sizeof(float) * tr->shard);
            backend_upload(tr->be, tr->adam_v, adam_v + own, sizeof(float) * tr->shard);
            trainable_to_device(tr);
        } else {
            memcpy(tr->adam_m, adam_m + own, sizeof(float) * tr->shard);
            memcpy(tr->adam_v, adam_v + own, sizeof(float) * tr->shard);
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
