// checkpoints.h: the block checkpoints of the recomputed blocks (--recompute block: all; N: the
// first N), as both models keep them. Each recomputed block's input [N, d] is saved in the forward
// and read again in the backward, where the block is recomputed from it. It lives on the device
// (the plan's MEM_SAVED), or under --offload host in pinned host memory (MEM_HOST), moved through
// the device staging buffers of offload.h.
//
//   plan:      checkpoints_plan_block (each block's input) and checkpoints_plan_staging (scratch)
//   allocate:  checkpoints_start once the plan's arenas are bound; checkpoints_free
//   forward:   checkpoint_save after block l's input is final
//   backward:  checkpoints_prefetch_last before the first (top) block's backward, checkpoint_input(l)
//              to recompute block l, checkpoints_prefetch_below(l) once block l's backward is done
#pragma once
#include "../ops.h"
#include "plan.h"
#include "offload.h"

typedef struct {
    void** input;     // [blocks] each block's input [N, d]: device memory, or host memory under --offload host
    int recomputed;   // blocks 0 .. recomputed-1 keep a checkpoint (llmc/train/run_options.h: train_block_recomputes)
    int host;         // --offload host
    Offload offload;  // the copy stream and the device staging buffers (host only)
} Checkpoints;

static void checkpoints_init(Checkpoints* c, int blocks, int recomputed, int offload_host) {
    memset(c, 0, sizeof(*c));
    c->input = (void**)xcalloc(blocks, sizeof(void*));
    c->recomputed = recomputed;
    c->host = offload_host && recomputed > 0;
}

// Block l's input, `bytes` of it, in the plan: saved activations, or pinned host memory.
static void checkpoints_plan_block(MemPlan* p, Checkpoints* c, int l, size_t bytes) {
    char nm[48];
    snprintf(nm, sizeof(nm), "L%d.block_input", l);
    plan_add(p, c->host ? MEM_HOST : MEM_SAVED, "checkpoint", l, nm, bytes, &c->input[l]);
}

// The device staging buffers of one block input each (under --offload host): `requested` of them
// (1, 2, or 0: two), unless LLMC_OFFLOAD_STAGING says otherwise (offload_staging_count).
static void checkpoints_plan_staging(MemPlan* p, Checkpoints* c, int requested, size_t bytes) {
    c->offload.slots = offload_staging_count(requested);
    if (!c->host) return;
    for (int i = 0; i < c->offload.slots; i++) {
        char nm[48];
        snprintf(nm, sizeof(nm), "offload_staging%d", i);
        plan_add(p, MEM_SCRATCH, "offload", -1, nm, bytes, &c->offload.staging[i]);
    }
}

// After the plan's allocation: the copy stream and its events, for blocks of `bytes` each.
static void checkpoints_start(Checkpoints* c, const Backend* be, int blocks, size_t bytes) {
    if (!c->host) return;
    c->offload.host = c->input;
    offload_init(&c->offload, be, blocks, bytes);
}

static void checkpoints_free(Checkpoints* c) {
    if (c->host && c->offload.be) offload_free(&c->offload);  // (offload.be: started)
    free(c->input);
    c->input = NULL;
}

// Forward: block l's input, x [n elements], kept: copied to its checkpoint, or (--offload host) to
// a staging buffer and from there to the host on the copy stream.
static void checkpoint_save(Checkpoints* c, const Backend* be, int l, const void* x, int64_t n) {
    if (!c->host) { op_copy(be, c->input[l], x, n); return; }
    op_copy(be, offload_staging_for_save(&c->offload, l), x, n);
    offload_save(&c->offload, l, (size_t)n * be->abytes);
}

// Backward: the inputs of the top recomputed blocks on their way back, one per staging buffer
// (called before the first block's backward: the kept blocks' backward, above them, runs beside).
static void checkpoints_prefetch_last(Checkpoints* c) {
    if (!c->host) return;
    int top = c->recomputed;
    for (int l = top - 1; l >= 0 && l >= top - c->offload.slots; l--) offload_fetch(&c->offload, l);
}

// Backward: block l's input on the device, to recompute it from (the compute stream waits for its fetch).
static void* checkpoint_input(Checkpoints* c, int l) {
    return c->host ? offload_staging_fetched(&c->offload, l) : c->input[l];
}

// Backward: block l's staging buffer is free once its backward is done; the input `slots` blocks
// down comes into it.
static void checkpoints_prefetch_below(Checkpoints* c, int l) {
    if (c->host && l < c->recomputed) offload_fetch(&c->offload, l - c->offload.slots);
}
