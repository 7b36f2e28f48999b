// cuda/graph.cuh: one piece of a step (a model's forward + backward of a micro-batch) captured into
// a CUDA graph once and replayed with one cudaGraphLaunch, so that the host issues one call instead
// of hundreds of kernel launches and cuBLAS calls (LLMC_CUDA_GRAPH=1; docs/gpu-testing.md).
//
// A graph replays its kernels with the arguments they had at the capture, so the caller describes
// with a key everything on the host that the captured work depends on:
//   - shape[]: what picks the work (micro-batch shape, which attention path, ...). The first call
//     of a shape runs eagerly, not captured: it creates what a capture must not (library handles,
//     cuBLASLt and cuDNN plans, kernels loaded on first use), as CUDA's guide advises a warm-up;
//   - values[]: host values the kernels take as arguments (a loss scale) or host-side caches whose
//     contents the captured work assumes (the attention path's pointer tables). When one changes,
//     the piece is captured again (counted: --profile's graph line shows how often).
// The caller also refuses the graph, in one line, where the piece makes calls a capture cannot
// hold (a host synchronisation, an allocation, a second stream): cuda_graph_refusal below, asked
// by llmc/train/run.h's run_graph_decide_once with the model's hazards. A call that slips through
// fails the capture with a CUDA error (on the CPU emulator, test/emu/emu.h, with the call named),
// never a wrong graph.
#pragma once
#include <string.h>
#include "common.cuh"

#define GRAPH_KEY_SHAPE 4
#define GRAPH_KEY_VALUES 4
#define GRAPH_WARM_SHAPES 8  // shapes run eagerly once (more than a run uses: train, its tail batch)

typedef struct {
    int64_t shape[GRAPH_KEY_SHAPE];
    int64_t values[GRAPH_KEY_VALUES];
} CudaGraphKey;

typedef enum { GRAPH_EAGER, GRAPH_CAPTURE, GRAPH_REPLAY } GraphStep;

typedef struct {
    int on;                  // LLMC_CUDA_GRAPH=1 and the caller did not refuse it
    int decided;             // the caller has decided `on` (once per model)
    int have_exec;           // exec holds the graph captured for `key`
    CudaGraphKey key;
    cudaGraphExec_t exec;
    int64_t warm[GRAPH_WARM_SHAPES][GRAPH_KEY_SHAPE];
    int n_warm;
    long long kernels;       // launch_kernel launches in exec (the GPU's count of what it replays)
    long long captured_at;   // cuda_counted.launches when the capture began (GPU)
} CudaGraph;

// LLMC_CUDA_GRAPH=1 asks for graphs (llmc/settings.h); 0 or unset leaves them off.
static int cuda_graph_wanted(void) { return setting_on(SETTING_CUDA_GRAPH); }

// What a model's piece holds that no capture can, as the model knows it (each 1 when so).
typedef struct {
    int crosses_ranks;   // collectives inside the backward (gradient buckets, sequence slices)
    int second_stream;   // copies on a second stream ordered by events (--offload host)
} GraphHazards;

// Why the piece cannot be one CUDA graph, or NULL.
static const char* cuda_graph_refusal(const GraphHazards* h) {
    if (cuda_sync_each_launch()) return "LLMC_CUDA_SYNC=1: every launch synchronises the device";
    if (h->crosses_ranks)
        return "gradients or sequence slices cross ranks inside the backward (collectives, a second stream)";
    if (h->second_stream) return "--offload host: block inputs travel on a second stream, ordered by events";
    return NULL;
}

// Once per model, at its first training step: whether LLMC_CUDA_GRAPH=1 can be honoured, said in
// one line when `print` (rank 0). LLMC_FAULT_GRAPH_NO_REFUSAL=1 skips the refusals, so that a test
// can see a call that breaks the capture caught (test/cuda/test_llama_cuda.py).
static void cuda_graph_decide(CudaGraph* g, const GraphHazards* h, int print) {
    g->decided = 1;
    if (!cuda_graph_wanted()) return;
    const char* why = cuda_graph_refusal(h);
#ifdef LLMC_FAULTS
    if (setting_on(SETTING_FAULT_GRAPH_NO_REFUSAL)) why = NULL;
#endif
    g->on = why == NULL;
    if (!print) return;
    if (why) printf("cuda graph: off: %s (LLMC_CUDA_GRAPH=1 refused; eager launches)\n", why);
    else printf("cuda graph: on: each micro-batch's forward + backward captured once per shape and replayed\n");
}

static int cuda_graph_shape_warm(const CudaGraph* g, const CudaGraphKey* k) {
    for (int i = 0; i < g->n_warm; i++)
        if (!memcmp(g->warm[i], k->shape, sizeof(k->shape))) return 1;
    return 0;
}

// What to do with the piece described by k: run it eagerly (a shape's first time), capture it, or
// replay the graph captured for the same key.
static GraphStep cuda_graph_next(CudaGraph* g, const CudaGraphKey* k) {
    if (g->have_exec && !memcmp(&g->key, k, sizeof(*k))) return GRAPH_REPLAY;
    if (cuda_graph_shape_warm(g, k)) return GRAPH_CAPTURE;
    if (g->n_warm < GRAPH_WARM_SHAPES) memcpy(g->warm[g->n_warm++], k->shape, sizeof(k->shape));
    return GRAPH_EAGER;
}

static void cuda_graph_drop(CudaGraph* g) {
    if (g->have_exec) CUDA_CHECK(cudaGraphExecDestroy(g->exec));
    g->have_exec = 0;
}

// Everything issued to `stream` from here to cuda_graph_capture_end is recorded, not run. Global
// mode: CUDA refuses, in any thread, the calls that would break the capture.
static void cuda_graph_capture_begin(CudaGraph* g, cudaStream_t stream) {
    cuda_graph_drop(g);
#ifndef LLMC_CUDA_EMU
    g->captured_at = cuda_counted.launches;
#endif
    CUDA_CHECK(cudaStreamBeginCapture(stream, cudaStreamCaptureModeGlobal));
}

// Ends the capture and instantiates it for key k: what the host state is after the capture (a
// cache the captured work filled is part of the key).
static void cuda_graph_capture_end(CudaGraph* g, cudaStream_t stream, const CudaGraphKey* k) {
    cudaGraph_t graph = NULL;
    CUDA_CHECK(cudaStreamEndCapture(stream, &graph));
    CUDA_CHECK(cudaGraphInstantiate(&g->exec, graph, 0));
    CUDA_CHECK(cudaGraphDestroy(graph));
    g->have_exec = 1;
    g->key = *k;
#ifndef LLMC_CUDA_EMU
    g->kernels = cuda_counted.launches - g->captured_at;  // recorded, not launched: not the host's launches
    cuda_counted.launches = g->captured_at;
    cuda_counted.graph_captures++;
#endif
}

// One launch of the captured graph on `stream`.
static void cuda_graph_launch(CudaGraph* g, cudaStream_t stream) {
    CUDA_CHECK(cudaGraphLaunch(g->exec, stream));
#ifndef LLMC_CUDA_EMU
    cuda_counted.launches++;
    cuda_counted.graph_launches++;
    cuda_counted.graph_kernels += g->kernels;
#endif
}

static void cuda_graph_free(CudaGraph* g) {
    cuda_graph_drop(g);
    memset(g, 0, sizeof(*g));
}
