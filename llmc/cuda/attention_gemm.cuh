// cuda/attention_gemm.cuh: attention forward and backward on tensor cores, the twin of
// llmc/cpu/attention.h like the flash kernels of attention.cuh (same layout, AttnShape, lse), but
// with the products done by batched cuBLAS GEMMs (bf16 operands, fp32 accumulation) over tiles of
// query rows x keys of every (batch, head) entry at once, and the softmax between them by small
// kernels. The tiles (llmc/memory/cuda_workspace.h, attn_gemm_tiles) hold all keys while that
// leaves at least 64 rows in the workspace's budget; at longer sequences they are square blocks:
//   forward, one key block:   S = scale Q K^T (fp32) -> P = softmax(S), lse -> O = P V
//   forward, key blocks:      per block S -> running max m and sum l, P = exp(S - m), O32 rescaled
//                             -> O32 += P V; after the last block O = O32 / l, lse = m + log l
//   backward, per tile:       S again -> P = exp(S - lse) -> dV += P^T dO -> dP = dO V^T
//                             -> dS = P (dP - D) -> dQ (+)= scale dS K -> dK += scale dS^T Q
// Only one tile of scores per entry exists at a time, never the whole T x T matrix, and nothing but
// q, k, v, o and lse is kept for the backward, as with the flash kernels. Causal tiles above the
// diagonal are not computed. dK and dV are summed over tiles in fp32 and rounded to bf16 once;
// dQ of a chunk seeing several key blocks likewise. Grouped-query heads read their kv head through
// the pointer arrays (no copies of k and v); their dK/dV sums run one query head of each group at a
// time, so no two entries of a batched product write the same rows.
// The pointer arrays are built on the device once per operand set and kept in the workspace
// (attn_gemm_slot): a call issues products and kernels only, no host arrays and no copies.
//
// Why: the flash kernels of attention.cuh run fp32 arithmetic on CUDA cores (~10-25 TFLOP/s on an
// H200); here the FLOPs go to tensor cores, at the price of writing and reading the scores once
// per product (memory traffic that a fused tensor-core flash kernel would avoid: the next step).
#pragma once
#include "common.cuh"
#include "matmul.cuh"
#include "attention.cuh"
#include "../memory/cuda_workspace.h"  // attn_gemm_tiles, attn_gemm_work_parts

// Operands of the batched products. Row operands have addresses per chunk of query rows, key
// operands per block of keys, tile operands (the workspace's per-tile buffers) one per entry.
typedef enum {
    AT_Q, AT_O, AT_DO, AT_DQ,       // [B*T, H*hd] bf16, from row r0 of the chunk
    AT_K, AT_V, AT_DK32, AT_DV32,   // [B*T, KVH*hd] (bf16; the sums fp32), from key k0 of the block
    AT_S, AT_P, AT_O32, AT_DQ32,    // [E, rows, keys] fp32 / bf16; [E, rows, hd] fp32
    AT_COUNT
} AttnOperand;

typedef struct {
    void* base;
    float* S;              // [E, rows, keys] scores, then dP (fp32)
    bf16* P;               // [E, rows, keys] probabilities, then dS
    float* o32;            // [E, rows, hd] a chunk's o (forward) or dq (backward) sums, key blocks only
    float* ml;             // [E, rows, 2] running max and sum of the online softmax, key blocks only
    void** tables;         // attn_table_slots pointer tables (attn_gemm_slot)
    float *dk32, *dv32;    // [B*T, KVH*hd] dK and dV sums (backward)
    float* D;              // [B, H, T] rowsum(dO * O) (backward)
    float* G;              // [E, rows, keys] soft-capped scores: 1 - (capped / softcap)^2 (backward), else NULL
    AttnTiles t;
} AttnGemmWork;

static AttnGemmWork attn_gemm_work(void* base, const AttnShape* s) {
    AttnWorkParts parts = attn_gemm_work_parts(s);
    AttnGemmWork w;
    memset(&w, 0, sizeof(w));
    w.base = base;
    w.t = attn_gemm_tiles(s);
    uint8_t* p = (uint8_t*)base;
    w.D = (float*)p; p += parts.D;
    w.S = (float*)p; p += parts.S;
    w.P = (bf16*)p; p += parts.P;
    w.o32 = parts.o32 ? (float*)p : NULL; p += parts.o32;
    w.ml = parts.ml ? (float*)p : NULL; p += parts.ml;
    w.tables = (void**)p; p += parts.tables;
    w.dk32 = (float*)p; p += parts.dk32;
    w.dv32 = (float*)p; p += parts.dv32;
    w.G = parts.G ? (float*)p : NULL;
    return w;
}

// Entry e of a batched product is query head h = kh * group + g of batch row b, numbered
// e = (g * B + b) * KVH + kh: the heads of one group slot g (one query head per kv head, as the
// dK/dV sums need) are the contiguous range [g * B * KVH, (g + 1) * B * KVH).
static __host__ __device__ __forceinline__ void attn_entry(const AttnShape& s, int64_t e, int* b, int* h) {
    int64_t per_slot = (int64_t)s.B * s.KVH, rest = e % per_slot;
    *b = (int)(rest / s.KVH);
    *h = (int)(rest % s.KVH) * (s.H / s.KVH) + (int)(e / per_slot);
}

// Where operand `op` of chunk (row chunk or key block) `chunk` starts in a table slot.
static __host__ __device__ __forceinline__ int64_t attn_table_at(const AttnShape& s, const AttnTiles& t, int op,
                                                                 int64_t chunk) {
    int64_t E = (int64_t)s.B * s.H, rows_part = ATTN_ROW_OPERANDS * t.row_chunks * E;
    if (op < AT_K) return ((int64_t)op * t.row_chunks + chunk) * E;
    if (op < AT_S) return rows_part + ((int64_t)(op - AT_K) * t.key_blocks + chunk) * E;
    return rows_part + ATTN_KEY_OPERANDS * t.key_blocks * E + (int64_t)(op - AT_S) * E;
}

// ---- the pointer tables ----------------------------------------------------------------------

typedef struct {
    const void* base[AT_COUNT];  // each operand's buffer (NULL: not used by this call)
} AttnBases;

// Fills one table slot: every operand's address for every entry and chunk, from the buffers.
__global__ void attn_table_kernel(void** table, AttnBases bases, AttnShape s, AttnTiles t) {
    int64_t E = (int64_t)s.B * s.H, rows_part = ATTN_ROW_OPERANDS * t.row_chunks,
            keys_part = ATTN_KEY_OPERANDS * t.key_blocks, n = E * (rows_part + keys_part + ATTN_TILE_OPERANDS);
    int group = s.H / s.KVH;
    for (int64_t idx = thread_index_1d(); idx < n; idx += grid_stride_1d()) {
        int64_t e = idx % E, part = idx / E, chunk = 0, off;
        int op, b, h;
        if (part < rows_part) op = (int)(part / t.row_chunks), chunk = part % t.row_chunks;
        else if (part < rows_part + keys_part)
            op = AT_K + (int)((part - rows_part) / t.key_blocks), chunk = (part - rows_part) % t.key_blocks;
        else op = AT_S + (int)(part - rows_part - keys_part);
        attn_entry(s, e, &b, &h);
        int64_t kh = h / group, size = op == AT_DK32 || op == AT_DV32 || op == AT_S || op >= AT_O32 ? 4 : 2;
        if (op < AT_K) off = ((int64_t)b * s.T + chunk * t.rows) * s.H * s.hd + (int64_t)h * s.hd;
        else if (op < AT_S) {
            int64_t first = (int64_t)b * s.T + chunk * t.keys;                   // k, v: the block's first key
            if (op >= AT_DK32 && t.key_blocks > 1) first = (int64_t)b * t.keys;  // sums of one block at a time
            off = first * s.KVH * s.hd + kh * s.hd;
        }
        else if (op < AT_O32) off = e * t.rows * (int64_t)t.keys;
        else off = e * t.rows * (int64_t)s.hd;
        const char* base = (const char*)bases.base[op];
        table[idx] = base ? (void*)(base + off * size) : NULL;
    }
}

// The host's record of what each table slot holds: the operand buffers it was built for, under
// one workspace, shape and tiling (a change of any of these forgets every slot).
typedef struct {
    const void *q, *k, *v, *o, *dout, *dq;
} AttnOperandSet;

static struct {
    const void* work;
    AttnShape shape;
    AttnTiles tiles;
    AttnOperandSet set[ATTN_TABLE_SLOTS];
    int used, next;
    long long builds;  // tables built so far: a repeated call must not add one (dev/cuda/attention.cu)
} g_attn_tables;

// Forgets every slot (a workspace freed: tests reallocate at the same address).
static void attn_gemm_forget(void) {
    long long builds = g_attn_tables.builds;
    memset(&g_attn_tables, 0, sizeof(g_attn_tables));
    g_attn_tables.builds = builds;
}

static int attn_same_layout(const AttnShape* a, const AttnShape* b, const AttnTiles* ta, const AttnTiles* tb) {
    return a->B == b->B && a->T == b->T && a->H == b->H && a->KVH == b->KVH && a->hd == b->hd &&
           ta->rows == tb->rows && ta->keys == tb->keys;
}

// The table slot for this call's operands (dout, dq NULL: a forward), built on the device the first
// time these buffers are seen: from then on a call of a layer finds its slot and builds nothing.
// `build` set: the caller launches attn_table_kernel to build it, before any product reads it.
typedef struct {
    void** table;         // the slot's first entry
    int64_t entries;      // its entries
    int build;            // 1: not yet built for these operands
    AttnBases bases;      // what attn_table_kernel builds it from
} AttnSlot;
static AttnSlot attn_gemm_slot(const AttnGemmWork* w, const AttnShape* s, AttnOperandSet ops) {
    if (g_attn_tables.work != w->base || !attn_same_layout(&g_attn_tables.shape, s, &g_attn_tables.tiles, &w->t)) {
        attn_gemm_forget();
        g_attn_tables.work = w->base;
        g_attn_tables.shape = *s;
        g_attn_tables.tiles = w->t;
    }
    int64_t per_slot = attn_table_entries(s, &w->t);
    AttnSlot out;
    memset(&out, 0, sizeof(out));
    out.entries = per_slot;
    int slot = -1;
    for (int i = 0; i < g_attn_tables.used && slot < 0; i++) {
        const AttnOperandSet* h = &g_attn_tables.set[i];
        if (h->q == ops.q && h->k == ops.k && h->v == ops.v && h->o == ops.o) slot = i;
    }
    if (slot >= 0) {
        const AttnOperandSet* h = &g_attn_tables.set[slot];
        out.table = w->tables + slot * per_slot;
        if (!ops.dout || (h->dout == ops.dout && h->dq == ops.dq)) return out;
    } else {
        int slots = attn_table_slots(s, &w->t);
        slot = g_attn_tables.used < slots ? g_attn_tables.used++ : g_attn_tables.next++ % slots;
    }
    g_attn_tables.set[slot] = ops;
    AttnBases* b = &out.bases;
    b->base[AT_Q] = ops.q, b->base[AT_O] = ops.o, b->base[AT_DO] = ops.dout, b->base[AT_DQ] = ops.dq;
    b->base[AT_K] = ops.k, b->base[AT_V] = ops.v, b->base[AT_DK32] = w->dk32, b->base[AT_DV32] = w->dv32;
    b->base[AT_S] = w->S, b->base[AT_P] = w->P, b->base[AT_O32] = w->o32, b->base[AT_DQ32] = w->o32;
    out.table = w->tables + slot * per_slot;
    out.build = 1;
    g_attn_tables.builds++;
    return out;
}
// ---- kernels ---------------------------------------------------------------------------------

// The keys [*a, *z) of a tile's kn keys (from key k0) that query row i of batch row b may see:
// causal, up to the row, from the start of its packed example and within the window; all T otherwise.
static __device__ __forceinline__ void attn_tile_visible(const AttnShape& s, int b, int i, int k0, int kn, int* a,
                                                         int* z) {
    int j0 = s.causal && s.pos ? i - s.pos[(int64_t)b * s.T + i] : 0, j1 = s.causal ? i + 1 : s.T;
    if (s.causal && s.window > 0 && i - s.window + 1 > j0) j0 = i - s.window + 1;
    *a = j0 - k0 > 0 ? j0 - k0 : 0;
    *z = j1 - k0 < kn ? j1 - k0 : kn;
}

// One warp per query row of the chunk [r0, r0 + rows) over a tile of kn keys from k0 (row stride
// ldk). forward = 1 (the tile holds every key the row sees): lse from the row's scores, written
// to lse; else lse is read. P = exp(S - lse) on the visible keys, 0 elsewhere.
__global__ void attn_probs_kernel(bf16* __restrict__ P, float* __restrict__ lse, float* __restrict__ G,
                                  const float* __restrict__ S, int r0, int rows, int R, int k0, int kn, int ldk,
                                  AttnShape s, int forward) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= (int64_t)s.B * s.H * rows) return;
    int64_t e = row / rows;
    int ii = (int)(row % rows), i = r0 + ii, b, h, a, z;
    attn_entry(s, e, &b, &h);
    attn_tile_visible(s, b, i, k0, kn, &a, &z);
    const float* Sr = S + (e * R + ii) * (int64_t)ldk;
    bf16* Pr = P + (e * R + ii) * (int64_t)ldk;
    float* L = lse + (((int64_t)b * s.H + h) * s.T + i);
    float l;
    if (forward) {
        float mx = -INFINITY;
        for (int j = a + lane; j < z; j += 32) mx = fmaxf(mx, att_softcap(Sr[j], s.softcap));
        mx = warp_reduce_max(mx);
        float sum = 0.0f;
        for (int j = a + lane; j < z; j += 32) sum += expf(att_softcap(Sr[j], s.softcap) - mx);
        sum = warp_reduce_sum(sum);
        l = mx + logf(sum);
        if (lane == 0) *L = l;
    } else {
        l = *L;
    }
    float* Gr = G ? G + (e * R + ii) * (int64_t)ldk : NULL;
    for (int j = lane; j < kn; j += 32) {
        float c = j >= a && j < z ? att_softcap(Sr[j], s.softcap) : 0.0f;
        Pr[j] = f2bf(j >= a && j < z ? expf(c - l) : 0.0f);
        if (Gr) Gr[j] = 1.0f - (c / s.softcap) * (c / s.softcap);  // the cap's derivative (backward)
    }
}

// The online softmax's step over one key block (forward, the chunk seeing several): one warp per
// row. m, l (ml) become the running max and sum over the blocks so far; P = exp(S - m) on the
// visible keys; the row's o sums (o32) are rescaled to the new max (first block: nothing yet).
__global__ void attn_online_kernel(bf16* __restrict__ P, float* __restrict__ ml, float* __restrict__ o32,
                                   const float* __restrict__ S, int r0, int rows, int R, int k0, int kn, int ldk,
                                   AttnShape s, int first) {
    int64_t row = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) >> 5;
    int lane = threadIdx.x & 31;
    if (row >= (int64_t)s.B * s.H * rows) return;
    int64_t e = row / rows, r = e * R + (row % rows);
    int i = r0 + (int)(row % rows), b, h, a, z;
    attn_entry(s, e, &b, &h);
    attn_tile_visible(s, b, i, k0, kn, &a, &z);
    const float* Sr = S + r * ldk;
    bf16* Pr = P + r * ldk;
    float m_old = first ? -INFINITY : ml[2 * r], l_old = first ? 0.0f : ml[2 * r + 1];
    float mx = -INFINITY;
    for (int j = a + lane; j < z; j += 32) mx = fmaxf(mx, att_softcap(Sr[j], s.softcap));
    float m_new = fmaxf(m_old, warp_reduce_max(mx)), sum = 0.0f;
    for (int j = lane; j < kn; j += 32) {
        float p = j >= a && j < z ? expf(att_softcap(Sr[j], s.softcap) - m_new) : 0.0f;
        Pr[j] = f2bf(p);
        sum += p;
    }
    sum = warp_reduce_sum(sum);
    float corr = m_old == -INFINITY ? 0.0f : expf(m_old - m_new);  // nothing seen yet: nothing to rescale
    if (!first)
        for (int d = lane; d < s.hd; d += 32) o32[r * s.hd + d] *= corr;
    if (lane == 0) {
        ml[2 * r] = m_new;
        ml[2 * r + 1] = l_old * corr + sum;
    }
}

// Rows [r0, r0 + rows) of out [B*T, H*hd] from the chunk's fp32 sums x32 [E, R, hd]: divided by
// the online softmax's sum, with lse = m + log l, when ml is given (forward); as they are else (dq).
__global__ void attn_store_rows_kernel(bf16* __restrict__ out, float* __restrict__ lse, const float* __restrict__ x32,
                                       const float* __restrict__ ml, int r0, int rows, int R, AttnShape s) {
    int64_t total = (int64_t)s.B * s.H * rows * s.hd;
    for (int64_t idx = thread_index_1d(); idx < total; idx += grid_stride_1d()) {
        int d = (int)(idx % s.hd), b, h;
        int64_t row = idx / s.hd, e = row / rows, r = e * R + (row % rows);
        int i = r0 + (int)(row % rows);
        attn_entry(s, e, &b, &h);
        float x = x32[r * s.hd + d];
        if (ml) {
            x /= ml[2 * r + 1];
            if (d == 0) lse[((int64_t)b * s.H + h) * s.T + i] = ml[2 * r] + logf(ml[2 * r + 1]);
        }
        out[((int64_t)b * s.T + i) * s.H * s.hd + (int64_t)h * s.hd + d] = f2bf(x);
    }
}

// dS = P (dP - D) over the chunk's rows and the tile's kn keys, written over P (bf16), times the
// soft-cap's derivative G where the scores are capped (G non-NULL). Masked keys have P = 0, hence dS = 0.
__global__ void attn_dscores_kernel(bf16* __restrict__ P, const float* __restrict__ dP, const float* __restrict__ D,
                                    const float* __restrict__ G, int r0, int rows, int R, int kn, int ldk,
                                    AttnShape s) {
    int64_t total = (int64_t)s.B * s.H * rows * kn;
    for (int64_t idx = thread_index_1d(); idx < total; idx += grid_stride_1d()) {
        int j = (int)(idx % kn), b, h;
        int64_t row = idx / kn, e = row / rows;
        int ii = (int)(row % rows);
        attn_entry(s, e, &b, &h);
        int64_t at = (e * R + ii) * (int64_t)ldk + j;
        float ds = bf2f(P[at]) * (dP[at] - D[((int64_t)b * s.H + h) * s.T + r0 + ii]);
        P[at] = f2bf(G ? ds * G[at] : ds);
    }
}

// ---- one batched product over the entries -----------------------------------------------------

typedef struct {
    void** table;         // this call's slot (attn_gemm_slot)
    const AttnShape* s;
    const AttnTiles* t;
    int64_t chunk, block; // the row chunk and key block the products work on
    cudaStream_t st;
} AttnRun;

static void** attn_operand_ptrs(const AttnRun* r, AttnOperand op, int64_t e0) {
    int64_t chunk = op < AT_K ? r->chunk : op < AT_S ? r->block : 0;
    return r->table + attn_table_at(*r->s, *r->t, op, chunk) + e0;
}

// C = alpha op(A) op(B) (+ C) for every head h = group_slot + g * (H/KVH) of every batch row when
// group_slot >= 0 (one head per kv group: dK/dV sums), else for all heads.
static void attn_product(const AttnRun* r, MatmulForm form, AttnOperand A, AttnOperand B, AttnOperand C,
                         cudaDataType_t ctype, int M, int N, int K, int lda, int ldb, int ldc, float alpha,
                         int accumulate, int group_slot) {
    const AttnShape* s = r->s;
    int64_t e0 = group_slot >= 0 ? (int64_t)group_slot * s->B * s->KVH : 0;
    int n = group_slot >= 0 ? s->B * s->KVH : s->B * s->H;  // int: entries, checked by attn_gemm_check
    matmul_batched_cuda(form, attn_operand_ptrs(r, C, e0), ctype, (const void* const*)attn_operand_ptrs(r, A, e0),
                        (const void* const*)attn_operand_ptrs(r, B, e0), M, N, K, lda, ldb, ldc, alpha, accumulate, n,
                        r->st);
}

static void attn_gemm_check(const AttnShape* s) {
    if (s->KVH <= 0 || s->H % s->KVH != 0) fail("attention: %d heads do not group over %d kv heads", s->H, s->KVH);
    if ((int64_t)s->B * s->H > INT32_MAX / 32)
        fail("attention: batch x heads = %lld is too many", (long long)s->B * s->H);
}

// ---- forward and backward --------------------------------------------------------------------

// The first key block of `ldk` keys a chunk of rows from r0 sees: 0, or with a sliding window the
// block of its first row's first key (no later row of the chunk sees an earlier key).
static int64_t attn_first_block(const AttnShape* s, int r0, int ldk) {
    int first = s->causal && s->window > 0 && r0 - s->window + 1 > 0 ? r0 - s->window + 1 : 0;
    return first / ldk;
}
// One past the last row chunk of `rows` that sees a key of [k0, k0 + kn): every chunk, or with a
// sliding window the chunk of the last query whose window reaches the block's last key.
static int64_t attn_last_chunk(const AttnShape* s, const AttnTiles* t, int k0, int kn) {
    if (!(s->causal && s->window > 0)) return t->row_chunks;
    int64_t last = (int64_t)k0 + kn - 1 + s->window - 1;
    return last >= s->T - 1 ? t->row_chunks : last / t->rows + 1;
}

static void attention_forward_gemm_cuda(bf16* o, float* lse, const bf16* q, const bf16* k, const bf16* v, AttnShape s,
                                        void* work, cudaStream_t st) {
    if ((int64_t)s.B * s.T * s.H == 0) return;
    attn_gemm_check(&s);
    AttnGemmWork w = attn_gemm_work(work, &s);
    AttnOperandSet ops = {q, k, v, o, NULL, NULL};
    AttnSlot slot = attn_gemm_slot(&w, &s, ops);
    if (slot.build)
        launch_kernel(grid_for(slot.entries, 256), 256, 0, st, attn_table_kernel, slot.table, slot.bases, s, w.t);
    AttnRun r = {slot.table, &s, &w.t, 0, 0, st};
    int qld = s.H * s.hd, kld = s.KVH * s.hd, ldk = w.t.keys;  // int: row widths
    float scale = attn_scale_of(&s);
    for (r.chunk = 0; r.chunk < w.t.row_chunks; r.chunk++) {
        int r0 = (int)(r.chunk * w.t.rows), rows = s.T - r0 < w.t.rows ? s.T - r0 : w.t.rows;
        int kend = s.causal ? r0 + rows : s.T;  // causal: the blocks past the chunk's last row are skipped
        int64_t nrows = (int64_t)s.B * s.H * rows, blocks = ceil_div(kend, ldk), kfirst = attn_first_block(&s, r0, ldk);
        r.block = 0;
        if (blocks == 1) {  // the chunk's visible keys fit one tile: a single softmax pass, o written directly
            attn_product(&r, MM_NT, AT_Q, AT_K, AT_S, CUDA_R_32F, rows, kend, s.hd, qld, kld, ldk, scale, 0, -1);
            launch_kernel(ceil_div(nrows * 32, 256), 256, 0, st, attn_probs_kernel, w.P, lse, (float*)NULL, w.S, r0,
                          rows, w.t.rows, 0, kend, ldk, s, 1);
            attn_product(&r, MM_NN, AT_P, AT_V, AT_O, CUDA_R_16BF, rows, s.hd, kend, ldk, kld, qld, 1.0f, 0, -1);
            continue;
        }
        for (r.block = kfirst; r.block < blocks; r.block++) {  // a window: the blocks before it are skipped
            int k0 = (int)(r.block * ldk), kn = kend - k0 < ldk ? kend - k0 : ldk, first = r.block == kfirst;
            attn_product(&r, MM_NT, AT_Q, AT_K, AT_S, CUDA_R_32F, rows, kn, s.hd, qld, kld, ldk, scale, 0, -1);
            launch_kernel(ceil_div(nrows * 32, 256), 256, 0, st, attn_online_kernel, w.P, w.ml, w.o32, w.S, r0, rows,
                          w.t.rows, k0, kn, ldk, s, first);
            attn_product(&r, MM_NN, AT_P, AT_V, AT_O32, CUDA_R_32F, rows, s.hd, kn, ldk, kld, s.hd, 1.0f, !first, -1);
        }
        launch_kernel(grid_for(nrows * s.hd, 256), 256, 0, st, attn_store_rows_kernel, o, lse, w.o32, w.ml, r0, rows,
                      w.t.rows, s);
    }
}

// dk, dv rows [k0, k0 + kn) of every batch row from one key block's fp32 sums [B, keys, KVH*hd].
__global__ void attn_store_keys_kernel(bf16* __restrict__ dk, bf16* __restrict__ dv, const float* __restrict__ dk32,
                                       const float* __restrict__ dv32, int k0, int kn, int keys, AttnShape s) {
    int64_t kvd = (int64_t)s.KVH * s.hd, total = (int64_t)s.B * kn * kvd;
    for (int64_t idx = thread_index_1d(); idx < total; idx += grid_stride_1d()) {
        int64_t c = idx % kvd, row = idx / kvd, b = row / kn, j = row % kn;
        int64_t from = (b * keys + j) * kvd + c, to = (b * s.T + k0 + j) * kvd + c;
        dk[to] = f2bf(dk32[from]);
        dv[to] = f2bf(dv32[from]);
    }
}

typedef enum { ATTN_GRAD_ALL, ATTN_GRAD_DQ, ATTN_GRAD_DKDV } AttnGrads;

// The backward over one tile (row chunk r->chunk from r0, key block r->block from k0, kn keys) is,
// in attention_backward_gemm_cuda's loops: the scores again (attn_product into AT_S), their
// probabilities (attn_probs_kernel), attn_backward_values, the scores' gradient
// (attn_dscores_kernel), attn_backward_inputs. The products of the tile between its kernels:
// dv's share (unless only dq is asked for), then dP = dout V^T into the scores' buffer.
static void attn_backward_values(const AttnRun* r, int rows, int kn, AttnGrads grads) {
    const AttnShape* s = r->s;
    int qld = s->H * s->hd, kld = s->KVH * s->hd, group = s->H / s->KVH, ldk = r->t->keys;  // int: row widths
    if (grads != ATTN_GRAD_DQ)
        for (int g = 0; g < group; g++)
            attn_product(r, MM_TN, AT_P, AT_DO, AT_DV32, CUDA_R_32F, kn, s->hd, rows, ldk, qld, kld, 1.0f, 1, g);
    attn_product(r, MM_NT, AT_DO, AT_V, AT_S, CUDA_R_32F, rows, kn, s->hd, qld, kld, ldk, 1.0f, 0, -1);
}
// After the scores' gradient: dq's and/or dk's share. dq goes to the chunk's fp32 sums when the
// chunk sees several key blocks (blocks > 1), else straight to dq.
static void attn_backward_inputs(const AttnRun* r, int rows, int kn, int64_t blocks, int64_t first_block,
                                 AttnGrads grads) {
    const AttnShape* s = r->s;
    int qld = s->H * s->hd, kld = s->KVH * s->hd, group = s->H / s->KVH, ldk = r->t->keys;  // int: row widths
    float scale = attn_scale_of(s);
    if (grads != ATTN_GRAD_DKDV) {
        if (blocks == 1)  // dq of the chunk in one product, rounded once by cuBLAS
            attn_product(r, MM_NN, AT_P, AT_K, AT_DQ, CUDA_R_16BF, rows, s->hd, kn, ldk, kld, qld, scale, 0, -1);
        else
            attn_product(r, MM_NN, AT_P, AT_K, AT_DQ32, CUDA_R_32F, rows, s->hd, kn, ldk, kld, s->hd, scale,
                         r->block > first_block, -1);
    }
    if (grads != ATTN_GRAD_DQ)
        for (int g = 0; g < group; g++)
            attn_product(r, MM_TN, AT_P, AT_Q, AT_DK32, CUDA_R_32F, kn, s->hd, rows, ldk, qld, kld, scale, 1, g);
}

static int attn_chunk_rows(const AttnShape* s, const AttnTiles* t, int64_t chunk) {
    int64_t r0 = chunk * t->rows;
    return (int)(s->T - r0 < t->rows ? s->T - r0 : t->rows);
}

// Gradients dq, dk, dv (overwritten). Whole keys (one key block): one pass over the row chunks, dk
// and dv summed over them in fp32 for the whole sequence. Key blocks: two passes, so that no sum
// spans the sequence (FlashAttention-2's split): per key block over the row chunks that see it, its
// dk, dv summed in fp32 and stored; then per row chunk over its key blocks, dq. The scores are
// computed twice (7 products a tile instead of 5) for memory that does not grow with T.
static void attention_backward_gemm_cuda(bf16* dq, bf16* dk, bf16* dv, const bf16* dout, const bf16* q, const bf16* k,
                                         const bf16* v, const bf16* o, const float* lse, AttnShape s, void* work,
                                         cudaStream_t st) {
    if ((int64_t)s.B * s.T * s.H == 0) return;
    attn_gemm_check(&s);
    AttnGemmWork w = attn_gemm_work(work, &s);
    int qld = s.H * s.hd, kld = s.KVH * s.hd, ldk = w.t.keys;  // int: row widths
    float scale = attn_scale_of(&s);
    int64_t all_rows = (int64_t)s.B * s.T * s.H;
    launch_kernel(grid_for(all_rows * 32, 256), 256, 0, st, attention_backward_preprocess_kernel, w.D, dout, o, s);
    AttnOperandSet ops = {q, k, v, o, dout, dq};
    AttnSlot slot = attn_gemm_slot(&w, &s, ops);
    if (slot.build)
        launch_kernel(grid_for(slot.entries, 256), 256, 0, st, attn_table_kernel, slot.table, slot.bases, s, w.t);
    AttnRun r = {slot.table, &s, &w.t, 0, 0, st};
    // every tile (attn_backward_values says the order): S, P, the values' products, dS, the inputs'
    if (w.t.key_blocks == 1) {
        int64_t nk = (int64_t)s.B * s.T * kld;
        CUDA_CHECK(cudaMemsetAsync(w.dk32, 0, sizeof(float) * nk, st));
        CUDA_CHECK(cudaMemsetAsync(w.dv32, 0, sizeof(float) * nk, st));
        for (r.chunk = 0; r.chunk < w.t.row_chunks; r.chunk++) {
            int r0 = (int)(r.chunk * w.t.rows), rows = attn_chunk_rows(&s, &w.t, r.chunk);
            int kn = s.causal ? r0 + rows : s.T;
            int64_t nrows = (int64_t)s.B * s.H * rows;
            attn_product(&r, MM_NT, AT_Q, AT_K, AT_S, CUDA_R_32F, rows, kn, s.hd, qld, kld, ldk, scale, 0, -1);
            launch_kernel(ceil_div(nrows * 32, 256), 256, 0, st, attn_probs_kernel, w.P, (float*)lse, w.G, w.S, r0,
                          rows, w.t.rows, 0, kn, ldk, s, 0);
            attn_backward_values(&r, rows, kn, ATTN_GRAD_ALL);
            launch_kernel(grid_for(nrows * kn, 256), 256, 0, st, attn_dscores_kernel, w.P, w.S, w.D, w.G, r0, rows,
                          w.t.rows, kn, ldk, s);
            attn_backward_inputs(&r, rows, kn, 1, 0, ATTN_GRAD_ALL);
        }
        int64_t hk = cast_vec_head(dk, w.dk32, nk), hv = cast_vec_head(dv, w.dv32, nk);  // cast_f32_to_bf16_cuda's
        launch_kernel(cast_grid(nk, hk), 256, 0, st, cast_f32_to_bf16_kernel, dk, w.dk32, nk, hk);
        launch_kernel(cast_grid(nk, hv), 256, 0, st, cast_f32_to_bf16_kernel, dv, w.dv32, nk, hv);
        return;
    }
    int64_t local = (int64_t)s.B * ldk * kld;  // one key block's sums
    for (r.block = 0; r.block < w.t.key_blocks; r.block++) {
        int k0 = (int)(r.block * ldk), kn_all = s.T - k0 < ldk ? s.T - k0 : ldk;
        CUDA_CHECK(cudaMemsetAsync(w.dk32, 0, sizeof(float) * local, st));
        CUDA_CHECK(cudaMemsetAsync(w.dv32, 0, sizeof(float) * local, st));
        // causal: the chunks before the block's first key see none of it (a window: nor those past its reach)
        int64_t last = attn_last_chunk(&s, &w.t, k0, kn_all);
        for (r.chunk = s.causal ? k0 / w.t.rows : 0; r.chunk < last; r.chunk++) {
            int r0 = (int)(r.chunk * w.t.rows), rows = attn_chunk_rows(&s, &w.t, r.chunk);
            int kend = s.causal ? r0 + rows : s.T, kn = kend - k0 < kn_all ? kend - k0 : kn_all;
            int64_t nrows = (int64_t)s.B * s.H * rows;
            attn_product(&r, MM_NT, AT_Q, AT_K, AT_S, CUDA_R_32F, rows, kn, s.hd, qld, kld, ldk, scale, 0, -1);
            launch_kernel(ceil_div(nrows * 32, 256), 256, 0, st, attn_probs_kernel, w.P, (float*)lse, w.G, w.S, r0,
                          rows, w.t.rows, k0, kn, ldk, s, 0);
            attn_backward_values(&r, rows, kn, ATTN_GRAD_DKDV);
            launch_kernel(grid_for(nrows * kn, 256), 256, 0, st, attn_dscores_kernel, w.P, w.S, w.D, w.G, r0, rows,
                          w.t.rows, kn, ldk, s);
            attn_backward_inputs(&r, rows, kn, 2, 0, ATTN_GRAD_DKDV);
        }
        launch_kernel(grid_for((int64_t)s.B * kn_all * kld, 256), 256, 0, st, attn_store_keys_kernel, dk, dv, w.dk32,
                      w.dv32, k0, kn_all, ldk, s);
    }
    for (r.chunk = 0; r.chunk < w.t.row_chunks; r.chunk++) {
        int r0 = (int)(r.chunk * w.t.rows), rows = attn_chunk_rows(&s, &w.t, r.chunk);
        int kend = s.causal ? r0 + rows : s.T;
        int64_t nrows = (int64_t)s.B * s.H * rows, blocks = ceil_div(kend, ldk), kfirst = attn_first_block(&s, r0, ldk);
        for (r.block = kfirst; r.block < blocks; r.block++) {
            int k0 = (int)(r.block * ldk), kn = kend - k0 < ldk ? kend - k0 : ldk;
            attn_product(&r, MM_NT, AT_Q, AT_K, AT_S, CUDA_R_32F, rows, kn, s.hd, qld, kld, ldk, scale, 0, -1);
            launch_kernel(ceil_div(nrows * 32, 256), 256, 0, st, attn_probs_kernel, w.P, (float*)lse, w.G, w.S, r0,
                          rows, w.t.rows, k0, kn, ldk, s, 0);
            attn_backward_values(&r, rows, kn, ATTN_GRAD_DQ);
            launch_kernel(grid_for(nrows * kn, 256), 256, 0, st, attn_dscores_kernel, w.P, w.S, w.D, w.G, r0, rows,
                          w.t.rows, kn, ldk, s);
            attn_backward_inputs(&r, rows, kn, blocks - kfirst, kfirst, ATTN_GRAD_DQ);
        }
        if (blocks - kfirst > 1)
            launch_kernel(grid_for((int64_t)s.B * s.H * rows * s.hd, 256), 256, 0, st, attn_store_rows_kernel, dq,
                          (float*)NULL, w.o32, (const float*)NULL, r0, rows, w.t.rows, s);
    }
}
