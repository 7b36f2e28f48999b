// run.h: one run, shared by every model's driver: options -> config -> plan -> fit -> load ->
// train -> export. A driver (train_llama.cu, train_vit.cu) holds its flags, its model's table of
// operations (ModelOps) and one call, train_main; the training loop itself is llmc/train/loop.h's
// train_run over the model's Trainer table. This file also holds what every model's forward +
// backward shares around it: the CUDA graph of a micro-batch (RunGraph, run_micro_batch) and the
// allocate/free skeleton of a model's memory plan (run_allocate_plan, run_free).
//
// The model's run state is the driver's own struct (`void* run` below): its config, its model and
// the baseline model beside it, its data. The operations, in the order train_main calls them:
//   flags       registers the model's flags (train_flags_register and its own) on the table
//   config      reads the checkpoint's config.json into the run and checks the flags against it
//   dry_run     --dry-run, on rank 0: prints the plan (and the baseline's) without allocating
//   check       a real run's flags: what there is to do, refused in one line before anything is written
//   open        after train_prepare_run, before the backend: the data (and whatever else the run reads)
//   plan        the model (and the baseline) planned on the backend, the plan checked against the memory
//   load        the plan allocated and bound, weights read, adapters initialised or loaded
//   trainer     the Trainer table train_run drives (llmc/train/loop.h)
//   started     (may be NULL) rank 0's start-up lines after train_print_start's
//   base_plan   the baseline plan train_print_start compares with; free_base frees it after
//   finish      (may be NULL) after training: what the run does with the trained model (generation)
//   close       frees the model and the data
// Each operation fails in one line (fail(), llmc/common.h) on bad input; none returns an error.
#pragma once
#include "../common.h"
#include "../backend.h"
#include "../ops.h"
#include "../memory/plan.h"
#include "../memory/checkpoints.h"
#include "flags.h"
#include "run_options.h"
#include "dist.h"
#include "trainable.h"
#include "batch_values.h"
#include "profile.h"
#include "loop.h"
#ifdef LLMC_HAVE_CUDA
#include "../cuda/graph.cuh"
#endif

// ----------------------------------------------------------------------------------------------
// The CUDA graph of one micro-batch's forward + backward (LLMC_CUDA_GRAPH=1, llmc/cuda/graph.cuh):
// run eagerly the first time its shape is seen, captured the next time (or whenever its key
// changes), and replayed with one launch after that. Without CUDA it is empty and every
// micro-batch runs eagerly.

typedef struct {
#ifdef LLMC_HAVE_CUDA
    CudaGraph g;
#endif
    int unused;  // (a struct has a member without CUDA too)
} RunGraph;

// What a model's piece holds that no capture can (llmc/cuda/graph.cuh's GraphHazards), as the
// model knows it; decided once, at the first training step (said in one line on rank 0).
typedef struct {
    int exchanges;       // the backward exchanges sequence slices across ranks (--seq-parallel)
    int offload_host;    // block inputs travel on a second stream (--offload host)
} RunGraphHazards;

static void run_graph_decide_once(RunGraph* rg, const Backend* be, const Dist* dist, RunGraphHazards hz) {
#ifdef LLMC_HAVE_CUDA
    if (rg->g.decided) return;
    GraphHazards h = {dist_sums_grads(dist) || hz.exchanges, hz.offload_host};
    if (be->cuda) cuda_graph_decide(&rg->g, &h, !dist || dist->rank == 0);
    rg->g.decided = 1;
#else
    (void)rg; (void)be; (void)dist; (void)hz;
#endif
}

#ifdef LLMC_HAVE_CUDA
// The part of a graph's key every model shares: the loss scale where it is a kernel argument (a model
// that binds no device copy of it, bv->grad_scale NULL: the probes; the trainers' kernels read it from
// device memory, where it changes nothing captured) and the GEMM attention path's pointer tables, a
// host-side cache (a rebuild since the capture means the captured work assumes other contents). The
// model fills shape[].
static CudaGraphKey run_graph_key(const BatchValues* bv, float grad_scale) {
    CudaGraphKey k;
    memset(&k, 0, sizeof(k));
    uint32_t bits;
    memcpy(&bits, &grad_scale, sizeof(bits));
    k.values[0] = bv->grad_scale ? 0 : bits;  // read from device memory, it changes nothing captured
    k.values[1] = g_attn_tables.builds;
    return k;
}
#endif

// A model's forward + backward of the micro-batch it has uploaded (loss statistics added into
// step_stats on the device, CUDA; NULL: returned), and (CUDA) its graph's key.
typedef struct {
    void* model;
    LossStats (*forward_backward)(void* model, float grad_scale, double* step_stats);
#ifdef LLMC_HAVE_CUDA
    CudaGraphKey (*graph_key)(const void* model, float grad_scale);
#endif
} RunPass;

// One training micro-batch (already uploaded) through the model's forward + backward: eagerly, or
// captured into a CUDA graph and replayed (with the statistics in step_stats then).
static LossStats run_micro_batch(RunGraph* rg, const Backend* be, const RunPass* pass, float grad_scale,
                                 double* step_stats) {
#ifdef LLMC_HAVE_CUDA
    CudaGraph* g = &rg->g;
    CudaGraphKey key = pass->graph_key(pass->model, grad_scale);
    GraphStep what = g->on ? cuda_graph_next(g, &key) : GRAPH_EAGER;
    if (what != GRAPH_EAGER) {
        if (what == GRAPH_CAPTURE) {
            int profiling = prof_pause(be->prof);  // its events would be captured too
            cuda_graph_capture_begin(g, be->stream);
            pass->forward_backward(pass->model, grad_scale, step_stats);
            CudaGraphKey after = pass->graph_key(pass->model, grad_scale);  // the host caches the capture filled
            cuda_graph_capture_end(g, be->stream, &after);
            prof_resume(be->prof, profiling);
        }
        PROF_SCOPE(be, "forward + backward graph", "f+b", 0.0, 0.0);
        cuda_graph_launch(g, be->stream);
        LossStats none = {};
        return none;  // the statistics are in step_stats
    }
#else
    (void)rg; (void)be;
#endif
    return pass->forward_backward(pass->model, grad_scale, step_stats);
}

// ----------------------------------------------------------------------------------------------
// A model's memory: planned by its setup (nothing allocated; a dry run stops there), allocated
// here, then bound by the model; freed by run_free, whether it was allocated or only planned.

// The plan's memory, then the matmul workspace attached; the model binds its buffers next.
// blas_work_slot: where the plan puts the workspace (the model's pointer), read only after the
// allocation has set it (read before, it is NULL, and cuBLAS would allocate a workspace of its own
// outside the plan at the first product: 32 MiB more on the device than planned).
static void run_allocate_plan(const Backend* be, MemPlan* plan, void* const* blas_work_slot) {
    backend_allocate_plan(be, plan);
    op_attach_matmul_workspace(be, *blas_work_slot);
}
// The first form, which took the workspace's pointer by value (before the allocation set it): a call
// written that way passes its address instead. (To go: its callers call run_allocate_plan.)
#define run_allocate(be, plan, blas_work) run_allocate_plan((be), (plan), &(blas_work))

// What a model's run holds beside its plan, for run_free: the trainable arena's host side, the
// batch's staging and device-read values, the matmul workspace, the checkpoints, the graph, and
// the host sides of its batch buffers (backend_host_side; NULL entries are skipped).
#define RUN_MAX_HOST_SIDES 8
typedef struct {
    Trainable* tr;
    BatchStaging* staging;
    BatchValues* bv;
    void* blas_work;
    Checkpoints* ckpt;
    RunGraph* graph;
    void* host_sides[RUN_MAX_HOST_SIDES];
} RunMemory;

static void run_free(const Backend* be, MemPlan* plan, const RunMemory* r) {
    checkpoints_free(r->ckpt);  // the copy stream done, before the plan's memory goes
    if (!plan->arena[MEM_SCRATCH] && !plan->arena[MEM_FROZEN]) {  // planned only (a dry run)
        plan_free(plan);
        return;
    }
    trainable_free_host(r->tr);
    staging_free(r->staging);
    for (int i = 0; i < RUN_MAX_HOST_SIDES; i++)
        if (r->host_sides[i]) backend_free_host_side(be, r->host_sides[i]);
    batch_values_free(r->bv, be);
    op_detach_matmul_workspace(be, r->blas_work);
#ifdef LLMC_HAVE_CUDA
    if (be->cuda) cuda_graph_free(&r->graph->g);
#endif
    backend_free_plan(be, plan);
}

// ----------------------------------------------------------------------------------------------
// The run: a model's table of operations (see the opening comment) and the one sequence every
// driver runs.

typedef struct {
    void (*flags)(FlagTable* t, TrainOptions* o);
    void (*config)(void* run, TrainOptions* o, const Dist* dist);
    void (*dry_run)(void* run, const TrainOptions* o, const Dist* dist);
    void (*check)(void* run, const TrainOptions* o);
    void (*open)(void* run, const TrainOptions* o, Dist* dist);
    void (*plan)(void* run, const TrainOptions* o, const Backend* be, const Dist* dist);
    void (*load)(void* run, const TrainOptions* o);
    void (*trainer)(void* run, Trainer* t, const TrainOptions* o, const Dist* dist);
    void (*started)(void* run, const TrainOptions* o, const Dist* dist);
    const MemPlan* (*base_plan)(void* run);
    void (*free_base)(void* run);
    void (*finish)(void* run, const TrainOptions* o, const Dist* dist);
    void (*close)(void* run);
} ModelOps;

// The Trainer fields every model fills the same way (llmc/train/loop.h); the model adds its
// unit, FLOPs, data cursor, settings line and operations.
static void run_trainer_init(Trainer* t, void* run, Trainable* tr, const MemPlan* plan, const Backend* be, int full) {
    memset(t, 0, sizeof(*t));
    t->model = run;
    t->tr = tr;
    t->plan = plan;
    t->be = be;
    t->full = full;
}

// main(): a model's whole run, from the command line to the exit status.
static int train_main(const ModelOps* ops, void* run, int argc, char** argv) {
    Dist dist;
    TrainOptions o;
    train_start(&dist, &o, &argc, &argv, ops->flags);
    ops->config(run, &o, &dist);
    if (o.dry_run) {
        if (dist.rank == 0) ops->dry_run(run, &o, &dist);
        dist_finalize(&dist);
        return 0;
    }
    ops->check(run, &o);
    train_prepare_run(&o, dist.rank);
    ops->open(run, &o, &dist);
    Backend be;
    Profiler prof;
    train_backend_open(&be, &prof, &o, &dist);
    ops->plan(run, &o, &be, &dist);  // before any allocation, on either backend
    ops->load(run, &o);
    Trainer trainer;
    ops->trainer(run, &trainer, &o, &dist);
    if (dist.rank == 0) {
        train_print_start(&trainer, &o, &dist, ops->base_plan(run));
        if (ops->started) ops->started(run, &o, &dist);
    }
    ops->free_base(run);
    train_run(&trainer, &o, &dist);
    if (ops->finish) ops->finish(run, &o, &dist);
    ops->close(run);
    dist_finalize(&dist);
    return 0;
}
