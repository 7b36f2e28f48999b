// loss_buffers.h: the scratch of the two losses, typed per backend and declared in the memory
// plan: the LM head's chunk buffers (op_lm_head_loss) and the classification head's reduction
// (op_softmax_ce_rows). Only what a backend uses is planned.
#pragma once
#include "plan.h"
#include "../backend.h"

// The loss chunk's buffers, typed per backend (planned by op_plan_lm_head_loss).
typedef struct {
    void* z;               // [chunk, d] activations
    float* r;              // [chunk]
    float* logits;         // [chunk, V] fp32
    void* dlogits;         // [chunk, V] (CUDA: bf16; the CPU turns logits into dlogits in place)
    void* dz;              // [chunk, d] (CPU fp32, CUDA bf16)
    float* row_stats;      // [chunk, 3] (CUDA)
    double* stats;         // [4] (CUDA): LossStats
} LossBuffers;

// At most ~64 MiB of fp32 logits per chunk, never the whole tokens x vocab matrix.
static int64_t lm_head_chunk(int64_t N, int64_t V) {
    int64_t chunk = (64ll << 20) / (V * 4);
    if (chunk < 1) chunk = 1;
    return chunk > N ? N : chunk;
}

static void op_plan_lm_head_loss(const Backend* be, MemPlan* p, LossBuffers* lb, int64_t chunk, int64_t d, int64_t V) {
    int a = be->abytes;
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_z", chunk * d * a, &lb->z);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_r", chunk * 4, &lb->r);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_logits", chunk * V * 4, &lb->logits);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_dz", chunk * d * a, &lb->dz);
    if (!be->cuda) return;
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_dlogits", chunk * V * a, &lb->dlogits);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_row_stats", chunk * 3 * 4, &lb->row_stats);
    plan_add(p, MEM_SCRATCH, "loss", -1, "loss_stats", 4 * 8, &lb->stats);
}

// Softmax cross-entropy over a few rows of fp32 logits (a classification head), every row
// counted. Scratch of the CUDA reduction (planned by op_plan_ce_rows; none on the CPU).
typedef struct {
    float* row_stats;      // [rows, 3]
    double* stats;         // [3]
} CeBuffers;

static void op_plan_ce_rows(const Backend* be, MemPlan* p, const char* module, CeBuffers* cb, int64_t rows) {
    if (!be->cuda) return;
    plan_add(p, MEM_SCRATCH, module, -1, "ce_row_stats", rows * 3 * 4, &cb->row_stats);
    plan_add(p, MEM_SCRATCH, module, -1, "ce_stats", 3 * 8, &cb->stats);
}
