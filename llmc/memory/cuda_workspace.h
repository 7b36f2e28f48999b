// cuda_workspace.h: the scratch the CUDA backend's library calls and attention need, as plain
// arithmetic: the workspace cuBLAS and cuBLASLt share, and the chunking and workspace of the
// tensor-core attention (llmc/cuda/attention_gemm.cuh). Both are buffers of the memory plan, so
// --dry-run and the measured-vs-planned line count them; the plan is made in every build, a CPU-only
// one planning the CUDA layout included, hence a header without CUDA.
#pragma once
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include "../common.h"
#include "../settings.h"
#include "../cpu/attention.h"  // AttnShape

// The workspace cuBLAS and cuBLASLt share (op_plan_matmul_workspace).
// 32 MiB: what cuBLAS recommends on Hopper (sm_90) for its own workspace and what cuBLASLt's
// Hopper kernels ask for at most; smaller GPUs need less and use what they need of it.
#define BLAS_WORKSPACE_BYTES ((size_t)32 << 20)
// cublasSetWorkspace requires a 256-byte aligned pointer; cudaMalloc's are, so the plan aligns
// the buffer's offset inside its arena.
#define BLAS_WORKSPACE_ALIGN 256

// ---- the tensor-core attention's tiles, pointer tables and workspace ----------------------------
//
// llmc/cuda/attention_gemm.cuh works on tiles of `rows` query rows x `keys` keys of every (batch,
// head) entry at once (E = B*H entries): a tile's scores S (fp32) and probabilities P (bf16) take
// E x rows x keys x 6 bytes. The rule, one for every length, keeps that within ATTN_TILE_BYTES and
// every tile at least 64 x 64 per entry (so a call never shrinks to a few rows):
//   1. whole keys: rows = ATTN_TILE_BYTES / (E x T x 6), rounded down to a multiple of 64. If that
//      is at least 64 (or covers T), tiles of that many rows and all T keys: one softmax pass,
//      exactly the tiling this path had before key blocks.
//   2. key blocks: else square tiles, rows = keys = the largest multiple of 64 with
//      E x side^2 x 6 <= ATTN_TILE_BYTES (at least 64): the forward runs an online softmax over the
//      key blocks, the backward two passes (dk, dv per key block; then dq per row chunk).
//   3. a sliding window shorter than T (causal): square tiles whose side is the window rounded up
//      to 64, or the largest the budget allows if less: the key blocks wholly outside a chunk's
//      window are skipped, so the work grows with T x window.
// Llama-3.1-8B (E = 32 at batch 1): whole keys up to T = 10,922 (128 rows at 4096), 832 x 832
// tiles beyond, so 131,072 tokens are 158 x 158 tiles (about half computed, causal) and 1M are
// 1,261 x 1,261; S and P stay 128 MiB at every length. Causal tiles above the diagonal are never
// computed. Calls stay few for their work: a product of a square tile is 32 x 832 x 832 x 128
// multiply-adds there (~14 us at 400 TFLOP/s), more than the host needs to issue it.
// Environment (llmc/settings.h; tests, the first GPU sessions): LLMC_ATTN_CHUNK=n caps rows, LLMC_ATTN_KEYS=n
// forces key blocks of n keys, LLMC_ATTN_KEY_BLOCKS=0 the old rule (whole keys always, rows
// shrinking down to 1 as T grows: 5 rows at 131k, 1 at 1M).
#define ATTN_TILE_BYTES (128ll << 20)
#define ATTN_TILE_MIN 64

typedef struct {
    int rows, keys;       // query rows and keys of a tile (keys = T: whole keys)
    int64_t row_chunks;   // ceil(T / rows)
    int64_t key_blocks;   // ceil(T / keys)
} AttnTiles;

static AttnTiles attn_gemm_tiles(const AttnShape* s) {
    AttnTiles t = {1, s->T > 0 ? s->T : 1, 0, 0};
    int64_t e = (int64_t)s->B * s->H, T = s->T > 0 ? s->T : 1;
    int64_t whole = e > 0 ? ATTN_TILE_BYTES / (e * T * 6) : T;  // rows of a whole-keys tile
    if (whole >= ATTN_TILE_MIN) whole -= whole % ATTN_TILE_MIN;
    int old_rule = !setting_on(SETTING_ATTN_KEY_BLOCKS);
    int64_t forced = setting_count(SETTING_ATTN_KEYS);
    int window = s->tile_window > 0 ? s->tile_window : s->window;  // a model's full layers: its sliding layers' tiles
    if (forced > 0 && forced < T) {
        t.keys = t.rows = (int)forced;
    } else if (s->causal && window > 0 && window < T) {
        // a sliding window: key blocks about the window's length, so that a row chunk sees two or
        // three of them and the work and the tiles grow with the window, not with T
        int64_t side = ATTN_TILE_MIN, want = (window + ATTN_TILE_MIN - 1) / ATTN_TILE_MIN * ATTN_TILE_MIN;
        while (side < want && (side + ATTN_TILE_MIN) * (side + ATTN_TILE_MIN) * e * 6 <= ATTN_TILE_BYTES)
            side += ATTN_TILE_MIN;
        t.keys = t.rows = (int)(side < T ? side : T);
    } else if (whole >= ATTN_TILE_MIN || whole >= T || old_rule) {
        t.rows = (int)(whole < 1 ? 1 : whole > T ? T : whole);
    } else {
        int64_t side = ATTN_TILE_MIN;
        while ((side + ATTN_TILE_MIN) * (side + ATTN_TILE_MIN) * e * 6 <= ATTN_TILE_BYTES) side += ATTN_TILE_MIN;
        t.keys = t.rows = (int)(side < T ? side : T);
    }
    int64_t cap = setting_count(SETTING_ATTN_CHUNK);
    if (cap > 0 && cap < t.rows) t.rows = (int)cap;
    t.row_chunks = (T + t.rows - 1) / t.rows;
    t.key_blocks = (T + t.keys - 1) / t.keys;
    return t;
}

// The batched products take arrays of operand addresses on the device. Every address is fixed by
// the operands' buffers and the shape, so the arrays are built once per operand set (a layer's q,
// k, v, o and the backward's dout, dq) by one kernel, kept in a table slot of this workspace and
// reused by every later call: no host arrays, no copies. A slot holds, per entry, the address of
// each operand for every row chunk (q, o, dout, dq), every key block (k, v and the fp32 dk, dv
// sums) and once for the tile buffers (S, P, the fp32 o and dq of a tile). A forward and its
// backward share a slot; up to ATTN_TABLE_SLOTS operand sets (layers) are kept, fewer where their
// tables would pass ATTN_TILE_BYTES (at least 2: Llama-3.1-8B keeps all 32 layers' up to 1.7M
// tokens). More operand sets than slots reuse slots in turn, rebuilding them on the device.
#define ATTN_TABLE_SLOTS 64
#define ATTN_ROW_OPERANDS 4
#define ATTN_KEY_OPERANDS 4
#define ATTN_TILE_OPERANDS 4

static int64_t attn_table_entries(const AttnShape* s, const AttnTiles* t) {
    int64_t e = (int64_t)s->B * s->H;
    return e * (ATTN_ROW_OPERANDS * t->row_chunks + ATTN_KEY_OPERANDS * t->key_blocks + ATTN_TILE_OPERANDS);
}

static int attn_table_slots(const AttnShape* s, const AttnTiles* t) {
    int64_t fit = ATTN_TILE_BYTES / (attn_table_entries(s, t) * (int64_t)sizeof(void*) + 1);
    return fit < 2 ? 2 : fit > ATTN_TABLE_SLOTS ? ATTN_TABLE_SLOTS : (int)fit;
}

// Bytes of each part of the workspace (attn_gemm_work carves D first, then S .. dv32 in this order).
typedef struct {
    size_t S, P, o32, ml, tables, dk32, dv32, D;  // o32 holds the backward's dq sums too
    size_t G;  // soft-capped scores (s->softcap > 0): the cap's derivative per score of a tile (fp32)
} AttnWorkParts;

static AttnWorkParts attn_gemm_work_parts(const AttnShape* s) {
    AttnTiles t = attn_gemm_tiles(s);
    int64_t e = (int64_t)s->B * s->H, tile = e * t.rows * (int64_t)t.keys, nk = (int64_t)s->B * s->T * s->KVH * s->hd;
    int key_blocked = t.key_blocks > 1;
    AttnWorkParts w;
    w.S = round_up(tile * 4, 256);
    w.P = round_up(tile * 2, 256);
    w.o32 = key_blocked ? round_up(e * t.rows * (int64_t)s->hd * 4, 256) : 0;  // a chunk's o (and dq) in fp32
    w.ml = key_blocked ? round_up(e * t.rows * 2 * 4, 256) : 0;                // running max and sum per row
    w.tables = round_up(attn_table_slots(s, &t) * attn_table_entries(s, &t) * sizeof(void*), 256);
    // the backward's fp32 dk, dv sums: the whole sequence's, or one key block's (two passes)
    if (key_blocked) nk = (int64_t)s->B * t.keys * s->KVH * s->hd;
    w.dk32 = w.dv32 = round_up(nk * 4, 256);
    w.D = round_up((int64_t)s->B * s->H * s->T * 4, 256);
    w.G = s->softcap > 0.0f ? round_up(tile * 4, 256) : 0;
    return w;
}

// Bytes of the workspace. The forward and the backward use one layout (a forward's table slot
// serves its backward), so `backward` no longer changes the size; it stays for the callers.
static size_t attn_gemm_work_bytes(const AttnShape* s, int backward) {
    (void)backward;
    AttnWorkParts w = attn_gemm_work_parts(s);
    return w.S + w.P + w.o32 + w.ml + w.tables + w.dk32 + w.dv32 + w.D + w.G;
}

// The workspace cuDNN's fused attention (llmc/cuda/attention_cudnn.cu) is planned with. cuDNN says
// what a plan needs only once the plan is built, and that needs the GPU (its heuristics ask the
// device), while the memory plan is made before, in every build. So the plan holds this bound,
// which covers what the FlashAttention-2 style backward keeps in fp32 (a dQ accumulator
// [B, H, T, hd], dK and dV accumulators at up to H heads for grouped queries, two [B, H, T] row
// statistics), each with T rounded up to a 128-row tile, plus 16 MiB for the engines' own
// scratch. It is an upper estimate, not cuDNN's figure: at run time the built plan's own need
// is compared with the planned bytes, and a larger one sends the shape to the GEMM path
// (llmc/ops.h says so in one line). Not yet compared with cuDNN's figure on a GPU.
// Packed examples (cuDNN's ragged layout) need the same accumulators, sized by the tokens rounded
// to a tile (attention_cudnn.cu's max_total_seq_len), and past them a token-major copy of the
// statistics [B*T, H] fp32 (llmc/ops.h converts lse into it and back): a third row statistic.
static size_t attn_cudnn_work_bound(const AttnShape* s) {
    int64_t t = (s->T + 127) / 128 * 128, bht = (int64_t)s->B * s->H * t;
    return round_up(3 * bht * s->hd * 4, 256) + round_up(3 * bht * 4, 256) + ((size_t)16 << 20);
}
