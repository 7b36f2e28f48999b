// profile.h: --profile, where the training step's time goes. Defines Profiler: one row per module
// and pass (a norm's forward, a linear's frozen product and its LoRA products, attention, the loss
// head, the optimizer, the data), each with its time, calls, FLOPs and bytes moved, and the table
// printed at the end of a run (ms per step, share of the step, GFLOP/s, GB/s).
// The ops of llmc/ops.h time themselves through prof_start / prof_stop when the Backend carries a
// Profiler; the trainers bracket each step with prof_step_begin / prof_step_end. On the CPU a row's
// time is the wall time of its op (every op is synchronous). On CUDA it is the time between two
// CUDA events recorded on the stream around the op, read back once per step, so profiling adds no
// synchronisation inside the step (only the step's end waits for the stream).
#pragma once
#include <stdio.h>
#include <string.h>
#include <time.h>
#include "../common.h"
#include "../backend.h"

#define PROF_MAX_ROWS 96

typedef struct {
    char name[40];         // the module: "q", "q lora", "rmsnorm", "attention", "lm head + loss", ...
    const char* pass;      // "fwd", "bwd", "step"
    double seconds, flops, bytes;
    long calls;
} ProfRow;

typedef struct Profiler {
    ProfRow rows[PROF_MAX_ROWS];
    int nrows;
    int active;            // inside a timed step: ops record only then (evaluation and generation do not)
    int steps;             // steps accumulated in the rows
    double step_seconds;   // their total wall time
    double step_t0;
#ifdef LLMC_HAVE_CUDA
    int cuda;
    cudaStream_t stream;
    cudaEvent_t* events;   // pairs (start, stop), recorded this step, read at the step's end
    int* event_row;        // the row of each pair
    int nevents, cap;      // pairs used this step, pairs created
    CudaCounts at_begin;   // the counts when this step began
    CudaCounts counted;    // their growth over the counted steps
#endif
} Profiler;

static double prof_now(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

// A mark returned by prof_start: the host time (CPU) or the index of an event pair (CUDA).
typedef struct {
    double t;
    int pair;
} ProfMark;

static int prof_row(Profiler* p, const char* name, const char* pass) {
    for (int i = 0; i < p->nrows; i++)
        if (p->rows[i].pass == pass && strcmp(p->rows[i].name, name) == 0) return i;
    if (p->nrows == PROF_MAX_ROWS) fail("internal: profile table full (%d rows)", PROF_MAX_ROWS);
    ProfRow* r = &p->rows[p->nrows];
    memset(r, 0, sizeof(*r));
    snprintf(r->name, sizeof(r->name), "%s", name);
    r->pass = pass;
    return p->nrows++;
}

// --profile: be's ops time themselves into p from now on (events on be's stream on CUDA).
static void backend_profile(Backend* be, Profiler* p) {
    memset(p, 0, sizeof(*p));
#ifdef LLMC_HAVE_CUDA
    p->cuda = be->cuda;
    p->stream = be->stream;
#endif
    be->prof = p;
}

static ProfMark prof_start(Profiler* p) {
    ProfMark m = {0.0, -1};
    if (!p || !p->active) return m;
#ifdef LLMC_HAVE_CUDA
    if (p->cuda) {
        if (p->nevents == p->cap) {
            int cap = p->cap ? 2 * p->cap : 256;
            p->events = (cudaEvent_t*)realloc(p->events, sizeof(cudaEvent_t) * 2 * cap);
            p->event_row = (int*)realloc(p->event_row, sizeof(int) * cap);
            if (!p->events || !p->event_row) fail("out of host memory for --profile's CUDA events");
            for (int i = 2 * p->cap; i < 2 * cap; i++) CUDA_CHECK(cudaEventCreate(&p->events[i]));
            p->cap = cap;
        }
        m.pair = p->nevents++;
        CUDA_CHECK(cudaEventRecord(p->events[2 * m.pair], p->stream));
        return m;
    }
#endif
    m.t = prof_now();
    return m;
}

// Ends the region begun at m: its time goes to row (name, pass) with the FLOPs and bytes given.
// pass is one of the string literals "fwd", "bwd", "step" (rows compare it by address).
static void prof_stop(Profiler* p, ProfMark m, const char* name, const char* pass, double flops, double bytes) {
    if (!p || !p->active) return;
    int i = prof_row(p, name, pass);
    p->rows[i].calls++;
    p->rows[i].flops += flops;
    p->rows[i].bytes += bytes;
#ifdef LLMC_HAVE_CUDA
    if (p->cuda) {
        CUDA_CHECK(cudaEventRecord(p->events[2 * m.pair + 1], p->stream));
        p->event_row[m.pair] = i;
        return;
    }
#endif
    p->rows[i].seconds += prof_now() - m.t;
}

// A region the ops must not time (a CUDA graph's capture: recording events into it would make
// them part of the graph): prof_pause returns whether the profiler was active, prof_resume restores.
static int prof_pause(Profiler* p) {
    int was = p && p->active;
    if (p) p->active = 0;
    return was;
}
static void prof_resume(Profiler* p, int was) {
    if (p) p->active = was;
}

static void prof_step_begin(Profiler* p) {
    if (!p) return;
#ifdef LLMC_HAVE_CUDA
    if (p->cuda) {
        CUDA_CHECK(cudaStreamSynchronize(p->stream));
        p->at_begin = cuda_counts_now();  // after the profiler's own wait, which is not the step's
    }
#endif
    p->active = 1;
    p->step_t0 = prof_now();
}

// Closes the step: on CUDA waits for the stream and adds up the event pairs. The first step of a
// run (allocation, page faults, caches) is dropped when more follow: `first` says it was the first.
static void prof_step_end(Profiler* p, int first) {
    if (!p) return;
#ifdef LLMC_HAVE_CUDA
    if (p->cuda) {
        CudaCounts now = cuda_counts_now();  // before the profiler's own wait
        p->counted.launches += now.launches - p->at_begin.launches;
        p->counted.blas_calls += now.blas_calls - p->at_begin.blas_calls;
        p->counted.host_syncs += now.host_syncs - p->at_begin.host_syncs;
        p->counted.graph_launches += now.graph_launches - p->at_begin.graph_launches;
        p->counted.graph_kernels += now.graph_kernels - p->at_begin.graph_kernels;
        p->counted.graph_blas += now.graph_blas - p->at_begin.graph_blas;
        p->counted.graph_captures += now.graph_captures - p->at_begin.graph_captures;
        if (first) memset(&p->counted, 0, sizeof(p->counted));
        CUDA_CHECK(cudaStreamSynchronize(p->stream));
        for (int e = 0; e < p->nevents; e++) {
            float ms = 0.0f;
            CUDA_CHECK(cudaEventElapsedTime(&ms, p->events[2 * e], p->events[2 * e + 1]));
            p->rows[p->event_row[e]].seconds += ms * 1e-3;
        }
        p->nevents = 0;
    }
#endif
    p->active = 0;
    p->step_seconds += prof_now() - p->step_t0;
    p->steps++;
    if (first) p->nrows = 0, p->steps = 0, p->step_seconds = 0.0;  // warm-up: only its shape was wanted
}

static int prof_cmp_seconds(const void* a, const void* b) {
    double x = ((const ProfRow*)a)->seconds, y = ((const ProfRow*)b)->seconds;
    return x < y ? 1 : x > y ? -1 : 0;
}

// The step's cost to the host, the mean over the counted steps (CUDA): on the emulator exactly
// `per step: N kernel launches, N cuBLAS calls, N host synchronizations`; on a GPU the launches
// only (common.cuh's cuda_counts_now says why). A CUDA graph's launch is one kernel launch there;
// when graphs ran (LLMC_CUDA_GRAPH=1), a second line says how many, what they replayed and how
// often one was captured.
static void prof_print_counts(const Profiler* p) {
#ifdef LLMC_HAVE_CUDA
    if (!p->cuda || p->steps == 0) return;
    double n = p->steps;
    if (cuda_counts_now().host_syncs < 0)  // a GPU: not counted
        printf("per step: %.0f kernel launches (cuBLAS calls and host synchronizations are counted on the "
               "emulator only)\n", p->counted.launches / n);
    else
        printf("per step: %.0f kernel launches, %.0f cuBLAS calls, %.0f host synchronizations\n",
               p->counted.launches / n, p->counted.blas_calls / n, p->counted.host_syncs / n);
    if (p->counted.graph_launches > 0 || p->counted.graph_captures > 0) {
        char blas[48] = "";
        if (p->counted.graph_blas >= 0)
            snprintf(blas, sizeof(blas), " and %.0f cuBLAS calls", p->counted.graph_blas / n);
        printf("per step: %.0f of those launches are CUDA graphs, replaying %.0f kernel launches%s; "
               "%.2f graph captures\n",
               p->counted.graph_launches / n, p->counted.graph_kernels / n, blas, p->counted.graph_captures / n);
    }
#else
    (void)p;
#endif
}

// The table, rows by time. "(other)" is the step time no row accounts for (host bookkeeping, the
// gaps between ops; on CUDA also launch gaps, since rows count GPU time between their events).
static void prof_print(Profiler* p, const char* device) {
    if (!p || p->steps == 0) {
        if (p)
            printf("profile: no timed step (the first step is a warm-up and is not counted; run at least 2 steps)\n");
        return;
    }
    ProfRow rows[PROF_MAX_ROWS];
    memcpy(rows, p->rows, sizeof(ProfRow) * p->nrows);
    qsort(rows, p->nrows, sizeof(ProfRow), prof_cmp_seconds);
    double step_ms = 1e3 * p->step_seconds / p->steps, sum = 0.0, flops = 0.0;
    printf("profile: %d steps after the first, %s, %.1f ms per step; per step:\n", p->steps, device, step_ms);
    printf("  %-22s %-4s %6s %10s %6s %9s %8s\n", "module", "pass", "calls", "ms", "share", "GFLOP/s", "GB/s");
    for (int i = 0; i < p->nrows; i++) {
        const ProfRow* r = &rows[i];
        double ms = 1e3 * r->seconds / p->steps;
        sum += ms;
        flops += r->flops;
        char gf[16] = "-", gb[16] = "-";
        if (r->flops > 0 && r->seconds > 0) snprintf(gf, sizeof(gf), "%.1f", r->flops / r->seconds * 1e-9);
        if (r->bytes > 0 && r->seconds > 0) snprintf(gb, sizeof(gb), "%.1f", r->bytes / r->seconds * 1e-9);
        printf("  %-22s %-4s %6ld %10.2f %5.1f%% %9s %8s\n", r->name, r->pass, r->calls / p->steps, ms,
               100.0 * ms / step_ms, gf, gb);
    }
    printf("  %-22s %-4s %6s %10.2f %5.1f%%\n", "(other)", "", "", step_ms - sum, 100.0 * (step_ms - sum) / step_ms);
    printf("  %-22s %-4s %6s %10.2f %5.1f%% %9.1f\n", "step", "", "", step_ms, 100.0, flops / p->step_seconds * 1e-9);
    prof_print_counts(p);
    fflush(stdout);
}

// Times the enclosing block into row (name, pass): an op's scope ends at each of its returns
// (the CUDA branches return early), so one line at the op's top covers every path.
struct ProfScope {
    Profiler* p;
    ProfMark m;
    const char *name, *pass;
    double flops, bytes;
    ProfScope(Profiler* p_, const char* name_, const char* pass_, double flops_, double bytes_)
        : p(p_), m(prof_start(p_)), name(name_), pass(pass_), flops(flops_), bytes(bytes_) {}
    ~ProfScope() { prof_stop(p, m, name, pass, flops, bytes); }
};
#define PROF_SCOPE(be, name, pass, flops, bytes) ProfScope prof_scope_((be)->prof, name, pass, flops, bytes)
