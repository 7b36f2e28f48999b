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

// Rows of the LM head's chunk (tokens whose logits exist at once). Each chunk reads the whole
// head [V, d] again (twice in training: logits and dz), so on CUDA few large chunks are wanted; but
// the chunk's buffers are memory a long context would otherwise have. The rule (docs/memory.md,
// "The LM head's chunk"), chosen by LLMC_HEAD_CHUNK:
//   plan (default)  CUDA: the most rows, a multiple of LM_HEAD_CHUNK_ALIGN, whose fp32 logits
//                   take at most the head's own bytes (V x d x activation bytes: d/2 rows in
//                   bf16), so re-reading the head costs at most what the logits' own traffic
//                   does; at most LM_HEAD_CHUNK_MAX rows and at least the old chunk. It depends on
//                   the model and the tokens only, not on other switches, so two plans that differ
//                   in one switch differ by that switch's buffers alone. The CPU keeps the old
//                   chunk (its matmul reads the head in cache-sized blocks, not once per chunk
//                   from HBM).
//                   Where the memory a run is fitted to holds the plan only with the old chunk,
//                   the old one ("old_fitted": llmc/models/llama_plan.h, llama_fit_to_memory).
//   old             at most 64 MiB of fp32 logits per chunk (130 rows at a 128k vocabulary)
//   a count         that many rows
// Always at most N.
#define LM_HEAD_CHUNK_OLD_BYTES (64ll << 20)
#define LM_HEAD_CHUNK_ALIGN 64
#define LM_HEAD_CHUNK_MAX 4096
typedef enum { HEAD_CHUNK_PLAN, HEAD_CHUNK_OLD, HEAD_CHUNK_ROWS, HEAD_CHUNK_OLD_FITTED } HeadChunkRule;
static const char* const head_chunk_rule_names[] = {"plan", "old", "rows", "old_fitted"};
// What the model asks of the rule above: the plan's chunk, or (fitted to a memory that holds no
// more) the old one
typedef enum { HEAD_CHUNK_WANT_PLAN, HEAD_CHUNK_WANT_SMALL } HeadChunkWant;

static int64_t lm_head_chunk_old(int64_t N, int64_t V) {
    int64_t chunk = LM_HEAD_CHUNK_OLD_BYTES / (V * 4);
    if (chunk < 1) chunk = 1;
    return chunk > N ? N : chunk;
}

// LLMC_HEAD_CHUNK (llmc/settings.h): plan (the default), old, or a row count.
static HeadChunkRule lm_head_chunk_rule(int64_t* rows) {
    int w = setting_word(SETTING_HEAD_CHUNK);  // "plan|old"; -1: a row count
    *rows = w < 0 ? setting_count(SETTING_HEAD_CHUNK) : 0;
    return w == 0 ? HEAD_CHUNK_PLAN : w == 1 ? HEAD_CHUNK_OLD : HEAD_CHUNK_ROWS;
}

// The chunk for N tokens of a head [V, d] on backend be, and the rule that chose it.
static int64_t lm_head_chunk(const Backend* be, int64_t N, int64_t d, int64_t V, HeadChunkWant want,
                             HeadChunkRule* rule) {
    int64_t rows, old = lm_head_chunk_old(N, V);
    *rule = lm_head_chunk_rule(&rows);
    if (*rule == HEAD_CHUNK_ROWS) return rows > N ? N : rows;
    if (*rule == HEAD_CHUNK_OLD || !be->cuda) return old;
    if (want == HEAD_CHUNK_WANT_SMALL) {
        *rule = HEAD_CHUNK_OLD_FITTED;
        return old;
    }
    int64_t chunk = d * be->abytes / 4;  // rows x V x 4 bytes of logits <= V x d x abytes of head
    chunk = chunk / LM_HEAD_CHUNK_ALIGN * LM_HEAD_CHUNK_ALIGN;
    if (chunk > LM_HEAD_CHUNK_MAX) chunk = LM_HEAD_CHUNK_MAX;
    if (chunk < old) chunk = old;
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
